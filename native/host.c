/* host.c - host DRAM buffers and the host bandwidth kernels (devices.md, "method rules").
 *
 * Buffers: 2 MiB-aligned anonymous mappings with madvise(MADV_HUGEPAGE) (4 KiB pages cost about a
 * quarter of the bandwidth here), first-touched in parallel by the threads that will measure them.
 *
 * Kernels, one pass per repetition unless work_bytes asks for more:
 *   read  - every byte once with the widest vector loads the compiler was allowed (-march=native),
 *           four independent accumulators so the loads never wait on each other;
 *   copy  - first half -> second half with the copier's kernel (copy_kernel.h), counted 2x;
 *   rand  - G-aligned granules at addresses from eight interleaved multiplicative generators per
 *           thread (top bits, masked: the footprint is the largest power-of-two number of
 *           granules that fits), so many independent misses are in flight (rule 6);
 *           every byte of each granule is XORed into a per-stream vector accumulator, folded once
 *           per repetition, so no load can be dropped and none waits on another.
 * Threads start together at a barrier; thread 0 times from barrier to barrier, so a repetition
 * lasts until the slowest thread is done. One untimed warm-up precedes the timed repetitions.
 * Nothing here is global: every call owns its threads, barrier and timings.
 */
#define _GNU_SOURCE
#include "common.h"
#include "copy_kernel.h"

#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#define HUGE_PAGE ((size_t)2 << 20)
#define READ_BLOCK 256   /* bytes per unrolled iteration of the read kernel */
#define RAND_STREAMS 8     /* independent PRNG streams interleaved per thread */

/* vector types for the loads; may_alias because the buffer is written as bytes */
typedef uint64_t v16 __attribute__((vector_size(16), may_alias));
typedef uint64_t v32 __attribute__((vector_size(32), may_alias));
typedef uint64_t v64 __attribute__((vector_size(64), may_alias));

#if defined(__AVX512F__)
typedef v64 vload;
#define LOAD_ISA "avx512"
#elif defined(__AVX2__) || defined(__AVX__)
typedef v32 vload;
#define LOAD_ISA "avx2"
#elif defined(__SSE2__) || defined(__ARM_NEON)
typedef v16 vload;
#define LOAD_ISA "sse2"
#else
typedef uint64_t vload __attribute__((may_alias));
#define LOAD_ISA "scalar"
#endif

static size_t round_up(size_t x, size_t to) { return (x + to - 1) / to * to; }

/* ---------------------------------------------------------------- threads with a start gate */

/* Run fn(arg_i) on n threads, arg_i = args + i*stride; thread 0 is the caller. Workers wait at a
 * gate until every thread exists, so a failed pthread_create never leaves a thread stuck at a
 * barrier sized for n: instead all workers are told to leave and the call fails. */
typedef struct {
    pthread_mutex_t lock;
    pthread_cond_t cond;
    int state;  /* 0 wait, 1 go, -1 abandon */
} start_gate;

typedef struct {
    start_gate *gate;
    void *(*fn)(void *);
    void *arg;
} gated_call;

static void *gated_entry(void *p)
{
    gated_call *c = p;
    pthread_mutex_lock(&c->gate->lock);
    while (c->gate->state == 0)
        pthread_cond_wait(&c->gate->cond, &c->gate->lock);
    int go = c->gate->state == 1;
    pthread_mutex_unlock(&c->gate->lock);
    return go ? c->fn(c->arg) : NULL;
}

static int run_threads(int n, void *(*fn)(void *), void *args, size_t stride, char *msg)
{
    start_gate gate = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
    gated_call calls[ODMA_MAX_THREADS];
    pthread_t tids[ODMA_MAX_THREADS];
    int created = 1, err = 0;
    for (int i = 1; i < n; i++, created++) {
        calls[i] = (gated_call){&gate, fn, (char *)args + (size_t)i * stride};
        if ((err = pthread_create(&tids[i], NULL, gated_entry, &calls[i])) != 0)
            break;
    }
    pthread_mutex_lock(&gate.lock);
    gate.state = created == n ? 1 : -1;
    pthread_cond_broadcast(&gate.cond);
    pthread_mutex_unlock(&gate.lock);
    if (created == n)
        fn(args);
    for (int i = 1; i < created; i++)
        pthread_join(tids[i], NULL);
    pthread_cond_destroy(&gate.cond);
    pthread_mutex_destroy(&gate.lock);
    if (created != n)
        return odma_set_msg(msg, ODMA_ENOMEM, "could not start thread %d of %d: %s", created, n,
                    strerror(err));
    return ODMA_OK;
}

/* ---------------------------------------------------------------- buffers */

typedef struct {
    char *base;
    size_t bytes;
    int tid, threads;
} touch_job;

static void *touch_worker(void *p)
{
    touch_job *j = p;
    /* slices on huge-page boundaries so each 2 MiB page is faulted by exactly one thread */
    size_t pages = round_up(j->bytes, HUGE_PAGE) / HUGE_PAGE;
    size_t lo = pages * (size_t)j->tid / (size_t)j->threads * HUGE_PAGE;
    size_t hi = pages * (size_t)(j->tid + 1) / (size_t)j->threads * HUGE_PAGE;
    if (hi > j->bytes)
        hi = j->bytes;
    for (size_t off = lo; off < hi; off += 4096)
        j->base[off] = 0;
    return NULL;
}

int odma_host_alloc(size_t bytes, int threads, void **ptr, char *msg)
{
    if (!ptr)
        return odma_set_msg(msg, ODMA_EINVAL, "NULL result pointer");
    *ptr = NULL;
    if (bytes == 0)
        return odma_set_msg(msg, ODMA_EINVAL, "cannot allocate 0 bytes");
    if (threads < 1 || threads > ODMA_MAX_THREADS)
        return odma_set_msg(msg, ODMA_EINVAL, "threads must be in [1, %d], got %d", ODMA_MAX_THREADS, threads);
    size_t len = round_up(bytes, HUGE_PAGE);
    if (len < bytes || len + HUGE_PAGE < len)
        return odma_set_msg(msg, ODMA_EINVAL, "size %zu is too large", bytes);

    /* over-map by one huge page, then trim so the buffer starts on a 2 MiB boundary */
    char *raw = mmap(NULL, len + HUGE_PAGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS,
                     -1, 0);
    if (raw == MAP_FAILED)
        return odma_set_msg(msg, ODMA_ENOMEM, "mmap of %zu bytes failed: %s", len + HUGE_PAGE,
                    strerror(errno));
    char *base = (char *)round_up((uintptr_t)raw, HUGE_PAGE);
    if (base > raw)
        munmap(raw, (size_t)(base - raw));
    char *end = raw + len + HUGE_PAGE;
    if (end > base + len)
        munmap(base + len, (size_t)(end - (base + len)));
#ifdef MADV_HUGEPAGE
    /* a refusal (THP disabled) is not an error: odma_host_huge_bytes reports what was granted */
    madvise(base, len, MADV_HUGEPAGE);
#endif
    touch_job jobs[ODMA_MAX_THREADS];
    for (int i = 0; i < threads; i++)
        jobs[i] = (touch_job){base, len, i, threads};
    if (run_threads(threads, touch_worker, jobs, sizeof jobs[0], NULL) != ODMA_OK)
        for (int i = 0; i < threads; i++)  /* fewer threads than asked: touch it all here */
            touch_worker(&jobs[i]);
    *ptr = base;
    return ODMA_OK;
}

int odma_host_free(void *ptr, size_t bytes, char *msg)
{
    if (!ptr)
        return odma_set_msg(msg, ODMA_EINVAL, "NULL buffer");
    if (bytes == 0)
        return odma_set_msg(msg, ODMA_EINVAL, "buffer size is 0");
    if ((uintptr_t)ptr % HUGE_PAGE)
        return odma_set_msg(msg, ODMA_EINVAL, "%p is not a buffer from odma_host_alloc (not 2 MiB aligned)",
                    ptr);
    if (munmap(ptr, round_up(bytes, HUGE_PAGE)) != 0)
        return odma_set_msg(msg, ODMA_EINVAL, "munmap(%p, %zu) failed: %s", ptr, bytes, strerror(errno));
    return ODMA_OK;
}

int odma_host_huge_bytes(void *ptr, size_t bytes, size_t *huge_bytes, char *msg)
{
    if (!ptr || !huge_bytes)
        return odma_set_msg(msg, ODMA_EINVAL, "NULL %s", !ptr ? "buffer" : "result pointer");
    if (bytes == 0)
        return odma_set_msg(msg, ODMA_EINVAL, "range size is 0");
    *huge_bytes = 0;
    uintptr_t lo = (uintptr_t)ptr, hi = lo + bytes;
    if (hi < lo)
        return odma_set_msg(msg, ODMA_EINVAL, "range wraps around the address space");
    FILE *f = fopen("/proc/self/smaps", "r");
    if (!f)
        return odma_set_msg(msg, ODMA_EDEVICE, "cannot read /proc/self/smaps: %s", strerror(errno));
    char *line = NULL;
    size_t cap = 0, total = 0, overlap = 0;
    while (getline(&line, &cap, f) > 0) {
        unsigned long start, end;
        char after;
        unsigned long kb;
        if (sscanf(line, "%lx-%lx%c", &start, &end, &after) == 3 && after == ' ') {
            /* a new VMA: how much of our range it covers */
            uintptr_t a = start > lo ? start : lo, b = end < hi ? end : hi;
            overlap = b > a ? b - a : 0;
        } else if (overlap && sscanf(line, "AnonHugePages: %lu kB", &kb) == 1) {
            /* a VMA merged with a neighbour reports the whole VMA: count at most our part */
            size_t huge = (size_t)kb * 1024;
            total += huge < overlap ? huge : overlap;
            overlap = 0;
        }
    }
    free(line);
    fclose(f);
    *huge_bytes = total;
    return ODMA_OK;
}

/* ---------------------------------------------------------------- kernels */

typedef struct {
    char *buf;
    size_t bytes;
    int pattern;
    size_t granule;
    int threads;
    int reps;
    size_t passes;       /* read/copy: passes over the buffer per repetition */
    size_t accesses;     /* rand: granules per repetition, all threads together */
    size_t half;         /* copy: bytes per half */
    int nontemporal;     /* copy: streaming stores */
    uint64_t seed;
    pthread_barrier_t barrier;
    double *times;       /* reps + 1 entries, [0] is the warm-up */
} measure_ctx;

typedef struct {
    measure_ctx *ctx;
    int tid;
    uint64_t rng[RAND_STREAMS];
    uint64_t sink;       /* folded loads: stored so the compiler must perform them */
} worker;

/* Multiplicative congruential step (period 2^62 from an odd seed): one multiply, the cheapest
 * generator whose top bits are good enough to defeat prefetchers. A xorshift64 step costs six
 * instructions more per access and cut random 64 B bandwidth by about 40 % here (fewer misses fit
 * in the out-of-order window); an added increment (an LCG) cost about 15 %. Multiplier from
 * Steele and Vigna, "Computationally easy, spectrally good multipliers" (2022). */
static inline uint64_t mcg64(uint64_t *s)
{
    return *s *= 0xf1357aea2e62a9c5ULL;
}

/* by pointer: passing 64-byte vectors by value draws an ABI note from GCC without AVX-512 */
static inline uint64_t fold64(const v64 *v)
{
    return (*v)[0] ^ (*v)[1] ^ (*v)[2] ^ (*v)[3] ^ (*v)[4] ^ (*v)[5] ^ (*v)[6] ^ (*v)[7];
}

static uint64_t fold_load(const vload *v)
{
    uint64_t r = 0;
    for (size_t i = 0; i < sizeof *v / sizeof r; i++)
        r ^= ((const uint64_t *)v)[i];
    return r;
}

/* [lo, hi) of n units split across threads */
static void share(size_t n, int tid, int threads, size_t *lo, size_t *hi)
{
    *lo = n * (size_t)tid / (size_t)threads;
    *hi = n * (size_t)(tid + 1) / (size_t)threads;
}

static uint64_t read_kernel(const measure_ctx *c, int tid)
{
    size_t blocks = c->bytes / READ_BLOCK, lo, hi;
    share(blocks, tid, c->threads, &lo, &hi);
    const vload *p = (const vload *)(c->buf + lo * READ_BLOCK);
    const vload *e = (const vload *)(c->buf + hi * READ_BLOCK);
    const size_t per = READ_BLOCK / sizeof(vload);  /* multiple of 4 for every vload width */
    vload a0 = {0}, a1 = {0}, a2 = {0}, a3 = {0};
    for (size_t pass = 0; pass < c->passes; pass++)
        for (const vload *q = p; q < e; q += per)
            for (size_t j = 0; j < per; j += 4) {
                a0 ^= q[j];
                a1 ^= q[j + 1];
                a2 ^= q[j + 2];
                a3 ^= q[j + 3];
            }
    a0 ^= a1 ^ a2 ^ a3;
    uint64_t r = fold_load(&a0);
    if (tid == c->threads - 1)  /* the bytes after the last whole block */
        for (size_t pass = 0; pass < c->passes; pass++)
            for (size_t i = blocks * READ_BLOCK; i < c->bytes; i++)
                r += (unsigned char)c->buf[i];
    return r;
}

static void copy_kernel(const measure_ctx *c, int tid)
{
    /* 4 KiB-aligned chunks of the source half per thread */
    size_t pages = c->half / 4096, lo, hi;
    share(pages, tid, c->threads, &lo, &hi);
    lo *= 4096;
    hi = tid == c->threads - 1 ? c->half : hi * 4096;
    for (size_t pass = 0; pass < c->passes; pass++)
        odma_copy_range(c->buf + c->half + lo, c->buf + lo, hi - lo, c->nontemporal);
    odma_copy_fence();
}

/* Random reads. Per access the loop does one multiply (mcg64), a shift and an AND for the address
 * and the granule's loads XORed into that stream's vector accumulator: four instructions for a
 * 64 B granule with AVX-512, so the out-of-order window holds many independent misses at once
 * (rule 6; the window, not the number of streams, is what limits this loop: 4 to 16 streams
 * measured alike). The accumulators are folded to one word once per repetition, never per access.
 *
 * Footprint: the address is the top bits of the generator masked to a granule boundary, so the
 * granules read are the first 2^k of the buffer, 2^k the largest power of two <= bytes / granule.
 * That is the whole buffer when its size is a power of two (the default 1 GiB); otherwise at least
 * half of it, still far above the last-level cache for any footprint that measures DRAM. */
typedef struct {
    unsigned shift;   /* 64 - log2(footprint bytes): the generator's top bits give an offset */
    size_t offmask;   /* footprint - granule: clears the bits below the granule */
} rand_span;

static rand_span rand_span_of(size_t bytes, size_t g)
{
    size_t footprint = g;  /* g divides every power of two >= g: footprint / g granules */
    while (footprint <= bytes / 2)
        footprint <<= 1;
    unsigned log2fp = 0;
    while (((size_t)1 << log2fp) < footprint)
        log2fp++;
    return (rand_span){64 - log2fp, footprint - g};
}

/* One stream's accumulators; only those of the granule's width survive constant folding. */
typedef struct {
    v64 a64;
    v32 a32;
    v16 a16;
    uint64_t a8;
} rand_acc;

/* XOR all G bytes at p into a. G is a constant at every call site below except the generic one. */
static inline __attribute__((always_inline)) void rand_consume(rand_acc *a, const char *p, size_t g)
{
    if (g == 8)
        a->a8 ^= *(const uint64_t *)p;
    else if (g == 16)
        a->a16 ^= *(const v16 *)p;
    else if (g == 32)
        a->a32 ^= *(const v32 *)p;
    else
        for (size_t off = 0; off < g; off += 64)
            a->a64 ^= *(const v64 *)(p + off);
}

static inline __attribute__((always_inline)) uint64_t
rand_run(const char *buf, rand_span span, size_t g, size_t count, uint64_t *rng)
{
    rand_acc acc[RAND_STREAMS];
    uint64_t s[RAND_STREAMS];
    memset(acc, 0, sizeof acc);
    for (int k = 0; k < RAND_STREAMS; k++)
        s[k] = rng[k];
    const unsigned shift = span.shift;
    const size_t offmask = span.offmask;
    size_t i = 0;
    /* 8 B granules share two scalar accumulators: eight would not fit in registers with the
     * eight generator states */
    for (; i + RAND_STREAMS <= count; i += RAND_STREAMS)
        for (int k = 0; k < RAND_STREAMS; k++)  /* unrolled: RAND_STREAMS independent chains */
            rand_consume(&acc[g == 8 ? k % 2 : k], buf + ((mcg64(&s[k]) >> shift) & offmask), g);
    for (; i < count; i++)
        rand_consume(&acc[0], buf + ((mcg64(&s[0]) >> shift) & offmask), g);
    for (int k = 0; k < RAND_STREAMS; k++)
        rng[k] = s[k];
    /* the one fold per repetition */
    rand_acc t = acc[0];
    for (int k = 1; k < RAND_STREAMS; k++) {
        t.a64 ^= acc[k].a64;
        t.a32 ^= acc[k].a32;
        t.a16 ^= acc[k].a16;
        t.a8 ^= acc[k].a8;
    }
    return fold64(&t.a64) ^ t.a32[0] ^ t.a32[1] ^ t.a32[2] ^ t.a32[3] ^ t.a16[0] ^ t.a16[1] ^ t.a8;
}

/* Specialised per granule: a constant G unrolls the granule's loads and drops unused accumulators. */
#define RAND_FIXED(G)                                                                              \
    static __attribute__((noinline)) uint64_t rand_run_##G(const char *buf, rand_span span,       \
                                                           size_t count, uint64_t *rng)            \
    {                                                                                              \
        return rand_run(buf, span, G, count, rng);                                                 \
    }
RAND_FIXED(8)
RAND_FIXED(16)
RAND_FIXED(32)
RAND_FIXED(64)
RAND_FIXED(128)
RAND_FIXED(256)
RAND_FIXED(512)
RAND_FIXED(1024)
RAND_FIXED(2048)
RAND_FIXED(4096)
#undef RAND_FIXED

static uint64_t rand_kernel(const measure_ctx *c, worker *w)
{
    size_t lo, hi;
    share(c->accesses, w->tid, c->threads, &lo, &hi);
    size_t n = hi - lo;
    rand_span span = rand_span_of(c->bytes, c->granule);
    switch (c->granule) {
    case 8: return rand_run_8(c->buf, span, n, w->rng);
    case 16: return rand_run_16(c->buf, span, n, w->rng);
    case 32: return rand_run_32(c->buf, span, n, w->rng);
    case 64: return rand_run_64(c->buf, span, n, w->rng);
    case 128: return rand_run_128(c->buf, span, n, w->rng);
    case 256: return rand_run_256(c->buf, span, n, w->rng);
    case 512: return rand_run_512(c->buf, span, n, w->rng);
    case 1024: return rand_run_1024(c->buf, span, n, w->rng);
    case 2048: return rand_run_2048(c->buf, span, n, w->rng);
    case 4096: return rand_run_4096(c->buf, span, n, w->rng);
    default: return rand_run(c->buf, span, c->granule, n, w->rng);  /* 8 KiB and up: a loop */
    }
}

static void *measure_worker(void *p)
{
    worker *w = p;
    measure_ctx *c = w->ctx;
    for (int r = 0; r <= c->reps; r++) {  /* r == 0 is the untimed warm-up */
        double t0 = 0;
        pthread_barrier_wait(&c->barrier);
        if (w->tid == 0)
            t0 = odma_now_s();
        switch (c->pattern) {
        case ODMA_PAT_READ: w->sink ^= read_kernel(c, w->tid); break;
        case ODMA_PAT_COPY: copy_kernel(c, w->tid); break;
        default: w->sink ^= rand_kernel(c, w); break;
        }
        pthread_barrier_wait(&c->barrier);
        if (w->tid == 0)
            c->times[r] = odma_now_s() - t0;
    }
    return NULL;
}

int odma_host_measure(void *buf, size_t bytes, int pattern, size_t granule, int threads, int reps,
                      size_t work_bytes, uint64_t seed, odma_result *out, char *msg)
{
    if (!buf || !out)
        return odma_set_msg(msg, ODMA_EINVAL, "NULL %s", !buf ? "buffer" : "result pointer");
    if ((uintptr_t)buf % 64)
        return odma_set_msg(msg, ODMA_EINVAL, "buffer %p is not 64-byte aligned", buf);
    if (bytes == 0)
        return odma_set_msg(msg, ODMA_EINVAL, "buffer size is 0");
    if ((uintptr_t)buf + bytes < (uintptr_t)buf)
        return odma_set_msg(msg, ODMA_EINVAL, "buffer wraps around the address space");
    if (threads < 1 || threads > ODMA_MAX_THREADS)
        return odma_set_msg(msg, ODMA_EINVAL, "threads must be in [1, %d], got %d", ODMA_MAX_THREADS, threads);
    if (reps < 1 || reps > ODMA_MAX_REPS)
        return odma_set_msg(msg, ODMA_EINVAL, "reps must be in [1, %d], got %d", ODMA_MAX_REPS, reps);

    measure_ctx c = {.buf = buf, .bytes = bytes, .pattern = pattern, .granule = granule,
                     .threads = threads, .reps = reps, .passes = 1, .seed = seed};
    const char *method;
    double moved;
    switch (pattern) {
    case ODMA_PAT_READ:
        if (bytes < 64)
            return odma_set_msg(msg, ODMA_EINVAL, "read needs a buffer of at least 64 bytes, got %zu", bytes);
        if (work_bytes > bytes)
            c.passes = (work_bytes + bytes - 1) / bytes;
        moved = (double)bytes * (double)c.passes;
        method = LOAD_ISA "-load";
        break;
    case ODMA_PAT_COPY:
        c.half = bytes / 2 / 64 * 64;
        if (c.half < 64)
            return odma_set_msg(msg, ODMA_EINVAL, "copy needs a buffer of at least 128 bytes, got %zu", bytes);
        if (work_bytes > 2 * c.half)
            c.passes = (work_bytes + 2 * c.half - 1) / (2 * c.half);
        c.nontemporal = c.half >= ODMA_NT_THRESHOLD;
        moved = 2.0 * (double)c.half * (double)c.passes;  /* read + write, rule 3 */
        method = c.nontemporal ? "nt-copy" : "memcpy-copy";
        break;
    case ODMA_PAT_RAND:
        if (!odma_is_pow2(granule) || granule < ODMA_MIN_GRANULE || granule > bytes)
            return odma_set_msg(msg, ODMA_EINVAL,
                        "granule must be a power of two in [%d, %zu (buffer)], got %zu",
                        ODMA_MIN_GRANULE, bytes, granule);
        c.accesses = (work_bytes ? work_bytes : bytes) / granule;
        if (c.accesses == 0)
            c.accesses = 1;
        moved = (double)c.accesses * (double)granule;
        method = "rand-mcg-8way";
        break;
    default:
        return odma_set_msg(msg, ODMA_EINVAL, "unknown pattern %d (0 read, 1 copy, 2 rand)", pattern);
    }

    c.times = malloc(sizeof(double) * (size_t)(reps + 1));
    worker *w = calloc((size_t)threads, sizeof *w);
    if (!c.times || !w) {
        free(c.times);
        free(w);
        return odma_set_msg(msg, ODMA_ENOMEM, "out of memory for %d repetitions x %d threads", reps, threads);
    }
    int err = pthread_barrier_init(&c.barrier, NULL, (unsigned)threads);
    if (err) {
        free(c.times);
        free(w);
        return odma_set_msg(msg, ODMA_ENOMEM, "pthread_barrier_init: %s", strerror(err));
    }
    for (int t = 0; t < threads; t++) {
        w[t].ctx = &c;
        w[t].tid = t;
        uint64_t s = seed ^ (0x5851f42d4c957f2dULL * (uint64_t)(t + 1));
        for (int k = 0; k < RAND_STREAMS; k++) {
            w[t].rng[k] = odma_splitmix64(&s) | 1;  /* odd: the multiplicative generator's full period */
        }
    }
    int status = run_threads(threads, measure_worker, w, sizeof *w, msg);
    pthread_barrier_destroy(&c.barrier);
    if (status == ODMA_OK) {
        memset(out, 0, sizeof *out);
        odma_summarise_times(c.times + 1, reps, out);  /* [0] is the warm-up */
        out->bytes = moved;
        out->threads = threads;
        snprintf(out->method, sizeof out->method, "%s", method);
    }
    free(c.times);
    free(w);
    return status;
}
