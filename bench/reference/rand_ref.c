/* rand_ref.c - an independent reference for random 64-byte reads, written apart from the shim
 * (native/host.c) so the two can be compared side by side (bench/compare_reference.py).
 *
 * Deliberately the plainest correct method: each thread draws granule indices from its own 64-bit
 * linear congruential generator (Knuth's MMIX constants; the high bits are used), reads the whole
 * granule with ordinary 8-byte loads and sums them. Addresses never depend on loaded data, so the
 * out-of-order core overlaps the misses by itself; no interleaved streams, no vector loads.
 * The buffer is a power-of-two size on transparent huge pages, first-touched by the threads.
 *
 *   usage: rand_ref MIB THREADS [GRANULE=64] [REPS=5] [ACCESS_MIB=256]
 *   prints: one line "rand_ref granule=G threads=T bytes=B best_s=S median_s=S gbps=X huge=F"
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

struct job {
    const uint64_t *base;
    uint64_t mask;        /* granules - 1 */
    size_t words;         /* granule / 8 */
    long count;           /* accesses */
    uint64_t state;
    uint64_t sum;
    pthread_barrier_t *start, *stop;
    int reps;
};

static double seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

static void *reader(void *arg)
{
    struct job *j = arg;
    for (int r = 0; r <= j->reps; r++) {
        pthread_barrier_wait(j->start);
        uint64_t x = j->state, s = 0;
        for (long i = 0; i < j->count; i++) {
            x = x * 6364136223846793005ULL + 1442695040888963407ULL;
            const uint64_t *g = j->base + ((x >> 20) & j->mask) * j->words;
            for (size_t w = 0; w < j->words; w++)
                s += g[w];
        }
        j->state = x;
        j->sum += s;
        pthread_barrier_wait(j->stop);
    }
    return NULL;
}

static int by_value(const void *a, const void *b)
{
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int main(int argc, char **argv)
{
    if (argc < 3) {
        fprintf(stderr, "usage: %s MIB THREADS [GRANULE=64] [REPS=5] [ACCESS_MIB=256]\n", argv[0]);
        return 2;
    }
    size_t bytes = (size_t)atol(argv[1]) << 20;
    int threads = atoi(argv[2]);
    size_t granule = argc > 3 ? (size_t)atol(argv[3]) : 64;
    int reps = argc > 4 ? atoi(argv[4]) : 5;
    size_t access_bytes = (size_t)(argc > 5 ? atol(argv[5]) : 256) << 20;
    if (threads < 1 || threads > 64 || reps < 1 || granule < 8 || (granule & (granule - 1)) ||
        (bytes & (bytes - 1)) || granule > bytes) {
        fprintf(stderr, "rand_ref: MIB and GRANULE must be powers of two, THREADS 1..64\n");
        return 2;
    }
    uint64_t *buf = aligned_alloc(2 << 20, bytes);
    if (!buf) {
        perror("aligned_alloc");
        return 1;
    }
    madvise(buf, bytes, MADV_HUGEPAGE);

    pthread_barrier_t start, stop;
    pthread_barrier_init(&start, NULL, threads + 1);
    pthread_barrier_init(&stop, NULL, threads + 1);
    struct job *jobs = calloc(threads, sizeof *jobs);
    pthread_t *tid = calloc(threads, sizeof *tid);
    /* first touch by the main thread in slices is enough here: one NUMA node */
    memset(buf, 1, bytes);
    long total = (long)(access_bytes / granule);
    for (int t = 0; t < threads; t++) {
        jobs[t] = (struct job){buf, bytes / granule - 1, granule / 8, total / threads,
                               0x243f6a8885a308d3ULL * (t + 1), 0, &start, &stop, reps};
        pthread_create(&tid[t], NULL, reader, &jobs[t]);
    }
    double *times = calloc(reps + 1, sizeof *times);
    for (int r = 0; r <= reps; r++) {  /* r == 0: warm-up */
        pthread_barrier_wait(&start);
        double t0 = seconds();
        pthread_barrier_wait(&stop);
        times[r] = seconds() - t0;
    }
    uint64_t sum = 0;
    for (int t = 0; t < threads; t++) {
        pthread_join(tid[t], NULL);
        sum += jobs[t].sum;
    }
    /* huge pages granted, for the record */
    size_t huge_kb = 0;
    FILE *f = fopen("/proc/self/smaps_rollup", "r");
    char line[256];
    while (f && fgets(line, sizeof line, f))
        sscanf(line, "AnonHugePages: %zu kB", &huge_kb);
    if (f)
        fclose(f);
    qsort(times + 1, reps, sizeof *times, by_value);
    double moved = (double)(total / threads) * threads * granule;
    double best = times[1], median = times[1 + reps / 2];
    printf("rand_ref granule=%zu threads=%d bytes=%.0f best_s=%.6f median_s=%.6f gbps=%.3f "
           "huge=%.3f checksum=%llu\n", granule, threads, moved, best, median, moved / best / 1e9,
           (double)huge_kb * 1024 / bytes, (unsigned long long)(sum & 0xff));
    free(times);
    free(jobs);
    free(tid);
    free(buf);
    return 0;
}
