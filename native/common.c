/* common.c - helpers the shim's backends share (see common.h). */
#include "common.h"

#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>

int odma_set_msg(char *msg, int status, const char *fmt, ...)
{
    if (msg) {
        va_list ap;
        va_start(ap, fmt);
        vsnprintf(msg, ODMA_MSG_LEN, fmt, ap);
        va_end(ap);
    }
    return status;
}

const char *odma_resolve_symbols(void *lib, const struct odma_symbol *table, size_t n)
{
    const char *missing = NULL;
    for (size_t i = 0; i < n; ++i) {
        *table[i].slot = NULL;
        for (int k = 0; k < 3 && table[i].names[k] && !*table[i].slot; ++k)
            *table[i].slot = dlsym(lib, table[i].names[k]);
        if (!*table[i].slot && table[i].required && !missing)
            missing = table[i].names[0];
    }
    return missing;
}
