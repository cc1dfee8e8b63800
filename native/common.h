/* common.h - helpers the shim's backends share. Internal: not part of the ABI (native/odma.h). */
#ifndef ODMA_COMMON_H
#define ODMA_COMMON_H
#include <stddef.h>

#include "odma.h"

/* Write a one-line message into msg (ODMA_MSG_LEN bytes, may be NULL) and return status, so a
 * failing call reads `return odma_set_msg(msg, ODMA_EINVAL, "...", ...);`. */
int odma_set_msg(char *msg, int status, const char *fmt, ...) __attribute__((format(printf, 3, 4)));

/* A function of a dlopen'ed runtime: its exported names (preferred first, NULL-padded), where to
 * store it, and whether the backend cannot work without it. */
struct odma_symbol {
    const char *names[3];
    void **slot;
    int required;
};

/* Resolve every symbol of `table` from `lib`, trying each name in order. Returns the preferred
 * name of the first required symbol that is missing, or NULL when all required ones were found
 * (optional ones that are missing are left NULL). */
const char *odma_resolve_symbols(void *lib, const struct odma_symbol *table, size_t n);

#endif
