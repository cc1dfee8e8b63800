/* common.h - helpers the shim's backends share. Internal: not part of the ABI (native/odma.h). */
#ifndef ODMA_COMMON_H
#define ODMA_COMMON_H
#include <stddef.h>
#include <stdint.h>

#include "odma.h"

/* Internal functions stay out of the shared object's symbol table, so they can never be bound to a
 * same-named symbol of a runtime library loaded with dlopen (or the other way round). */
#define ODMA_INTERNAL __attribute__((visibility("hidden")))

/* Write a one-line message into msg (ODMA_MSG_LEN bytes, may be NULL) and return status, so a
 * failing call reads `return odma_set_msg(msg, ODMA_EINVAL, "...", ...);`. */
ODMA_INTERNAL int odma_set_msg(char *msg, int status, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

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
ODMA_INTERNAL const char *odma_resolve_symbols(void *lib, const struct odma_symbol *table, size_t n);

/* Seconds on the monotonic clock (host-side timing). */
ODMA_INTERNAL double odma_now_s(void);

/* Sort the `reps` timed repetitions in `seconds` (reps >= 1) and store their best, median and worst
 * and `reps` in *out; the caller fills bytes, threads and method. */
ODMA_INTERNAL void odma_summarise_times(double *seconds, int reps, odma_result *out);

static inline int odma_is_pow2(size_t x) { return x && !(x & (x - 1)); }

/* SplitMix64 (Steele, Lea and Flood): one step of a 64-bit generator whose outputs are well mixed
 * even from consecutive or sparse seeds; used to seed the kernels' generators and to draw DMA
 * offsets. */
static inline uint64_t odma_splitmix64(uint64_t *state)
{
    uint64_t z = (*state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
}

#endif
