/* common.c - helpers the shim's backends share (see common.h). */
#include "common.h"

#include <dlfcn.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

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

double odma_now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

static int cmp_double(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

void odma_summarise_times(double *seconds, int reps, odma_result *out)
{
    qsort(seconds, (size_t)reps, sizeof *seconds, cmp_double);
    out->best_s = seconds[0];
    out->median_s = reps % 2 ? seconds[reps / 2] : 0.5 * (seconds[reps / 2 - 1] + seconds[reps / 2]);
    out->worst_s = seconds[reps - 1];
    out->reps = reps;
}
