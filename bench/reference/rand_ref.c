/* rand_ref.c - an independent reference for random reads of G-byte granules, written apart from the
 * shim (native/host.c) so the two can be compared side by side (bench/compare_reference.py).
 *
 * Goal: as many independent DRAM misses in flight per core as the hardware allows, at the fewest
 * instructions per access, so the out-of-order window holds as many misses as it can:
 *   - addresses from STREAMS interleaved multiplicative congruential generators per thread
 *     (x = a*x mod 2^64, x odd: an LCG without the increment, one instruction per step; dropping
 *     the add measured about 10 % faster here). Their high bits are the good ones, so the byte
 *     offset is the top log2(buffer) bits (one shift) rounded down to the granule (one and):
 *     uniform over all granules. Per 64-B access that is multiply, shift, and, one vector load
 *     OR-ed in: about 5 instructions. Interleaved generators hide the multiply latency of each
 *     chain. Addresses never depend on loaded data: independent access, not pointer chasing.
 *   - every byte of each granule is loaded with the widest vector the compiler may use (64 B with
 *     AVX-512, else 32 B) and OR-ed into an accumulator, so no load can be dropped.
 *   - a power-of-two buffer, 2 MiB-aligned, madvise(MADV_HUGEPAGE), first-touched in parallel by
 *     the threads that read it; the fraction of huge pages granted is printed.
 *   - threads start together at a barrier and are timed from the first start to the last finish;
 *     one untimed warm-up repetition, then REPS timed ones; best and median are printed.
 * Bytes counted: granule x accesses, GB = 1e9 B.
 *
 *   usage: rand_ref MIB THREADS [GRANULE=64] [REPS=5] [ACCESS_MIB=256]
 *   prints: "rand_ref granule=G threads=T bytes=B best_s=S median_s=S gbps=X huge=F checksum=C"
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <time.h>

#define STREAMS 4            /* 4 chains of a 3-cycle multiply are far faster than DRAM; more
                                streams only cost registers (measured: 4, 6 and 8 perform alike) */
#define HUGE_PAGE ((size_t)2 << 20)
#define MCG_A 6364136223846793005ULL   /* Knuth's MMIX multiplier (= 5 mod 8: full period 2^62) */

#if defined(__AVX512F__)
#define VBYTES 64
#else
#define VBYTES 32
#endif
typedef uint64_t vec __attribute__((vector_size(VBYTES), may_alias));
typedef uint64_t vec32 __attribute__((vector_size(32), may_alias));
typedef uint64_t word __attribute__((may_alias));  /* the buffer is written as bytes */

struct job {
    const char *base;
    size_t bytes;            /* whole buffer, for the first touch */
    size_t touch_from, touch_len;
    int shift;               /* 64 - log2(buffer bytes): x >> shift is a byte offset in the buffer */
    uint64_t align_mask;     /* ~(granule - 1): rounds that offset down to a granule boundary */
    size_t granule;
    long rounds;             /* iterations of the STREAMS-wide loop per repetition */
    uint64_t x[STREAMS];
    uint64_t sink;
    double t0, t1;           /* this thread's start and end of the current repetition */
    pthread_barrier_t *start, *stop;
    int reps;
};

static double seconds(void)
{
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec + t.tv_nsec * 1e-9;
}

/* One repetition. G is a compile-time constant at each call site below, so the per-granule loop
 * is unrolled into G / VBYTES vector loads (or one 32-byte load, or G / 8 scalar loads). */
static inline __attribute__((always_inline)) uint64_t
run(const char *base, int shift, uint64_t mask, long rounds, uint64_t *state, size_t G)
{
    uint64_t x[STREAMS];
    memcpy(x, state, sizeof x);
    vec acc = {0};
    vec32 acc32 = {0};
    uint64_t acc8 = 0;
    for (long r = 0; r < rounds; r++) {
        for (int s = 0; s < STREAMS; s++) {
            x[s] *= MCG_A;
            const char *p = base + ((x[s] >> shift) & mask);
            if (G >= VBYTES)
                for (size_t k = 0; k < G; k += VBYTES)
                    acc |= *(const vec *)(p + k);
            else if (G >= 32)
                for (size_t k = 0; k < G; k += 32)
                    acc32 |= *(const vec32 *)(p + k);
            else
                for (size_t k = 0; k < G; k += 8)
                    acc8 |= *(const word *)(p + k);
        }
    }
    memcpy(state, x, sizeof x);
    for (int i = 0; i < VBYTES / 8; i++)
        acc8 |= acc[i];
    for (int i = 0; i < 4; i++)
        acc8 |= acc32[i];
    return acc8;
}

static uint64_t run_granule(struct job *j)
{
    const char *b = j->base;
    int sh = j->shift;
    uint64_t m = j->align_mask;
    long n = j->rounds;
    switch (j->granule) {  /* constant G for the common sizes, a loop for the rest */
    case 8: return run(b, sh, m, n, j->x, 8);
    case 16: return run(b, sh, m, n, j->x, 16);
    case 32: return run(b, sh, m, n, j->x, 32);
    case 64: return run(b, sh, m, n, j->x, 64);
    case 128: return run(b, sh, m, n, j->x, 128);
    case 256: return run(b, sh, m, n, j->x, 256);
    default: return run(b, sh, m, n, j->x, j->granule);
    }
}

static void *reader(void *arg)
{
    struct job *j = arg;
    memset((char *)j->base + j->touch_from, 1, j->touch_len);  /* parallel first touch */
    for (int r = 0; r <= j->reps; r++) {
        pthread_barrier_wait(j->start);
        j->t0 = seconds();
        j->sink |= run_granule(j);
        j->t1 = seconds();
        pthread_barrier_wait(j->stop);
    }
    return NULL;
}

static uint64_t splitmix64(uint64_t *s)  /* seeds the generators: distinct, well-mixed states */
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
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
        bytes < HUGE_PAGE || (bytes & (bytes - 1)) || granule > bytes) {
        fprintf(stderr, "rand_ref: MIB (>= 2) and GRANULE (>= 8) must be powers of two, "
                        "THREADS 1..64, REPS >= 1\n");
        return 2;
    }
    /* over-map by one huge page and round up, so the buffer starts on a 2 MiB boundary */
    char *map = mmap(NULL, bytes + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0);
    if (map == MAP_FAILED) {
        perror("mmap");
        return 1;
    }
    char *buf = (char *)(((uintptr_t)map + HUGE_PAGE - 1) & ~(uintptr_t)(HUGE_PAGE - 1));
    madvise(buf, bytes, MADV_HUGEPAGE);

    int log2_bytes = __builtin_ctzll(bytes);
    /* accesses per thread, rounded down to whole STREAMS-wide rounds (counted exactly below) */
    long rounds = (long)(access_bytes / granule / threads / STREAMS);
    if (rounds < 1)
        rounds = 1;
    pthread_barrier_t start, stop;
    pthread_barrier_init(&start, NULL, threads + 1);
    pthread_barrier_init(&stop, NULL, threads + 1);
    struct job *jobs = calloc(threads, sizeof *jobs);
    pthread_t *tid = calloc(threads, sizeof *tid);
    double *times = calloc(reps + 1, sizeof *times);
    if (!jobs || !tid || !times) {
        perror("calloc");
        return 1;
    }
    uint64_t seed = 0x243f6a8885a308d3ULL;
    size_t slice = (bytes / threads + HUGE_PAGE - 1) & ~(HUGE_PAGE - 1);
    for (int t = 0; t < threads; t++) {
        struct job *j = &jobs[t];
        j->base = buf;
        j->bytes = bytes;
        j->touch_from = (size_t)t * slice < bytes ? (size_t)t * slice : bytes;
        j->touch_len = j->touch_from + slice < bytes ? slice : bytes - j->touch_from;
        j->shift = 64 - log2_bytes;
        j->align_mask = ~(uint64_t)(granule - 1);
        j->granule = granule;
        j->rounds = rounds;
        for (int s = 0; s < STREAMS; s++)
            j->x[s] = splitmix64(&seed) | 1;  /* odd: the generator's full period */
        j->start = &start;
        j->stop = &stop;
        j->reps = reps;
        if (pthread_create(&tid[t], NULL, reader, j)) {
            perror("pthread_create");
            return 1;
        }
    }
    for (int r = 0; r <= reps; r++) {  /* r == 0: warm-up (and waits for the first touch) */
        pthread_barrier_wait(&start);
        pthread_barrier_wait(&stop);
        double t0 = jobs[0].t0, t1 = jobs[0].t1;
        for (int t = 1; t < threads; t++) {
            t0 = jobs[t].t0 < t0 ? jobs[t].t0 : t0;
            t1 = jobs[t].t1 > t1 ? jobs[t].t1 : t1;
        }
        times[r] = t1 - t0;
    }
    /* huge pages granted, read while the buffer is still mapped */
    size_t huge_kb = 0;
    FILE *f = fopen("/proc/self/smaps_rollup", "r");
    char line[256];
    while (f && fgets(line, sizeof line, f))
        sscanf(line, "AnonHugePages: %zu kB", &huge_kb);
    if (f)
        fclose(f);
    uint64_t sink = 0;
    for (int t = 0; t < threads; t++) {
        pthread_join(tid[t], NULL);
        sink |= jobs[t].sink;
    }
    qsort(times + 1, reps, sizeof *times, by_value);
    double moved = (double)rounds * STREAMS * threads * granule;
    double best = times[1], median = times[1 + reps / 2];
    printf("rand_ref granule=%zu threads=%d bytes=%.0f best_s=%.6f median_s=%.6f gbps=%.3f "
           "huge=%.3f checksum=%llu\n", granule, threads, moved, best, median, moved / best / 1e9,
           (double)huge_kb * 1024 / bytes, (unsigned long long)(sink & 0xff));
    free(times);
    free(jobs);
    free(tid);
    munmap(map, bytes + HUGE_PAGE);
    return 0;
}
