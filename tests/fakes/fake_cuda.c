/* fake_cuda.c - a stand-in libcuda.so.1 over host memory, to test native/cuda.c without a GPU.
 *
 * It exports the versioned driver-API names the shim resolves (cuMemAlloc_v2, ...; only the plain
 * cuEventElapsedTime and no occupancy call, so the shim's fallbacks run) and checks what a driver
 * would check:
 * - memory calls need the primary context current on the calling thread (else
 *   CUDA_ERROR_INVALID_CONTEXT), device addresses must lie in live allocations (else
 *   CUDA_ERROR_INVALID_VALUE, or CUDA_ERROR_ILLEGAL_ADDRESS inside a kernel);
 * - cuModuleLoadDataEx parses the PTX: it must say .version 6.4 / .target sm_52, and each .entry's
 *   parameter list (.u64 / .u32) is what cuLaunchKernel reads from kernelParams, so an argument list
 *   that does not match kernels.cu's signatures gives wrong results or a range error in the tests;
 * - cuLaunchKernel runs a C model of each kernel's effect (what it reads, copies, or where its
 *   random granules fall) synchronously; events record a monotonic clock.
 * It is not the GPU: timings are host timings. Reports one device, "Fake GPU (host memory)":
 * 4 SMs, 2048 threads/SM, CC 9.0, L2 1 MiB, 100000 kHz x 128 bit (3.2 GB/s peak, which keeps the
 * shim's default work sizes small). FAKE_CUDA_TOTAL_MB (default 512) sets its memory,
 * FAKE_CUDA_PTX_ERROR=1 makes module loading fail with CUDA_ERROR_INVALID_PTX and a log line.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#define EXPORT __attribute__((visibility("default")))
typedef int CUresult;
typedef unsigned long long CUdeviceptr;
enum { OK = 0, INVALID_VALUE = 1, OUT_OF_MEMORY = 2, NOT_INITIALIZED = 3, INVALID_PTX = 218,
       INVALID_DEVICE = 101, INVALID_CONTEXT = 201, NOT_FOUND = 500, ILLEGAL_ADDRESS = 700,
       INVALID_HANDLE = 400 };

struct ctx { int device; };
struct event { double t; int recorded; };
#define MAX_FN 16
#define MAX_PARAMS 16
struct function { char name[64]; int nparams; int size[MAX_PARAMS]; int maxntid; };
struct module { int nfn; struct function fn[MAX_FN]; };

static struct ctx primary = {0};
static int retained, initialised;
static __thread struct ctx *current;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
struct allocation { char *p; size_t n; };
static struct allocation allocs[4096];
static size_t nallocs, used;

static size_t total_bytes(void)
{
    const char *s = getenv("FAKE_CUDA_TOTAL_MB");
    return (size_t)(s && *s ? atol(s) : 512) << 20;
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* [p, p + n) inside one live allocation */
static int valid(CUdeviceptr p, size_t n)
{
    int ok = 0;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < nallocs && !ok; ++i) {
        uintptr_t a = (uintptr_t)allocs[i].p;
        ok = p >= a && p <= a + allocs[i].n && n <= a + allocs[i].n - p;
    }
    pthread_mutex_unlock(&lock);
    return ok;
}

#define NEED_CTX() do { if (!initialised) return NOT_INITIALIZED; \
                        if (current != &primary || !retained) return INVALID_CONTEXT; } while (0)

EXPORT CUresult cuInit(unsigned flags) { initialised = flags == 0; return flags ? INVALID_VALUE : OK; }

EXPORT CUresult cuGetErrorName(CUresult r, const char **s)
{
    switch (r) {
    case OK: *s = "CUDA_SUCCESS"; return OK;
    case INVALID_VALUE: *s = "CUDA_ERROR_INVALID_VALUE"; return OK;
    case OUT_OF_MEMORY: *s = "CUDA_ERROR_OUT_OF_MEMORY"; return OK;
    case INVALID_PTX: *s = "CUDA_ERROR_INVALID_PTX"; return OK;
    case INVALID_CONTEXT: *s = "CUDA_ERROR_INVALID_CONTEXT"; return OK;
    case ILLEGAL_ADDRESS: *s = "CUDA_ERROR_ILLEGAL_ADDRESS"; return OK;
    case NOT_FOUND: *s = "CUDA_ERROR_NOT_FOUND"; return OK;
    default: *s = NULL; return INVALID_VALUE;
    }
}

EXPORT CUresult cuGetErrorString(CUresult r, const char **s)
{
    const char *name;
    if (cuGetErrorName(r, &name) != OK)
        return INVALID_VALUE;
    *s = "fake driver error";
    return OK;
}

EXPORT CUresult cuDriverGetVersion(int *v) { *v = 12080; return OK; }
EXPORT CUresult cuDeviceGetCount(int *n) { if (!initialised) return NOT_INITIALIZED; *n = 1; return OK; }
EXPORT CUresult cuDeviceGet(int *d, int ordinal) { if (ordinal != 0) return INVALID_DEVICE; *d = 0; return OK; }

EXPORT CUresult cuDeviceGetName(char *name, int len, int dev)
{
    if (dev != 0 || len <= 0)
        return INVALID_VALUE;
    snprintf(name, (size_t)len, "Fake GPU (host memory)");
    return OK;
}

EXPORT CUresult cuDeviceGetAttribute(int *v, int attr, int dev)
{
    if (dev != 0)
        return INVALID_DEVICE;
    switch (attr) {
    case 16: *v = 4; return OK;            /* SMs */
    case 36: *v = 100000; return OK;       /* memory clock, kHz */
    case 37: *v = 128; return OK;          /* bus width, bits */
    case 38: *v = 1 << 20; return OK;      /* L2 bytes */
    case 39: *v = 2048; return OK;         /* threads per SM */
    case 75: *v = 9; return OK;
    case 76: *v = 0; return OK;
    default: return INVALID_VALUE;
    }
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t *b, int dev) { if (dev) return INVALID_DEVICE; *b = total_bytes(); return OK; }

EXPORT CUresult cuDevicePrimaryCtxRetain(struct ctx **c, int dev)
{
    if (dev)
        return INVALID_DEVICE;
    retained++;
    *c = &primary;
    return OK;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(int dev) { if (dev || !retained) return INVALID_VALUE; retained--; return OK; }
EXPORT CUresult cuCtxGetCurrent(struct ctx **c) { *c = current; return OK; }
EXPORT CUresult cuCtxSetCurrent(struct ctx *c) { current = c; return OK; }

EXPORT CUresult cuMemGetInfo_v2(size_t *free_b, size_t *total)
{
    NEED_CTX();
    pthread_mutex_lock(&lock);
    *total = total_bytes();
    *free_b = *total - used;
    pthread_mutex_unlock(&lock);
    return OK;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr *p, size_t n)
{
    NEED_CTX();
    if (n == 0)
        return INVALID_VALUE;
    void *q = NULL;
    CUresult r = OUT_OF_MEMORY;
    pthread_mutex_lock(&lock);
    if (nallocs < sizeof allocs / sizeof allocs[0] && n <= total_bytes() - used &&
        posix_memalign(&q, 256, n) == 0) {
        allocs[nallocs++] = (struct allocation){q, n};
        used += n;
        *p = (CUdeviceptr)(uintptr_t)q;
        r = OK;
    }
    pthread_mutex_unlock(&lock);
    return r;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr p)
{
    NEED_CTX();
    CUresult r = INVALID_VALUE;
    pthread_mutex_lock(&lock);
    for (size_t i = 0; i < nallocs; ++i)
        if ((uintptr_t)allocs[i].p == p) {
            used -= allocs[i].n;
            free(allocs[i].p);
            allocs[i] = allocs[--nallocs];
            r = OK;
            break;
        }
    pthread_mutex_unlock(&lock);
    return r;
}

EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr d, const void *s, size_t n)
{
    NEED_CTX();
    if (!valid(d, n))
        return INVALID_VALUE;
    memcpy((void *)(uintptr_t)d, s, n);
    return OK;
}

EXPORT CUresult cuMemcpyDtoH_v2(void *d, CUdeviceptr s, size_t n)
{
    NEED_CTX();
    if (!valid(s, n))
        return INVALID_VALUE;
    memcpy(d, (void *)(uintptr_t)s, n);
    return OK;
}

EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr d, CUdeviceptr s, size_t n, void *stream)
{
    NEED_CTX();
    if (!stream || !valid(d, n) || !valid(s, n))
        return INVALID_VALUE;
    memmove((void *)(uintptr_t)d, (void *)(uintptr_t)s, n);
    return OK;
}

/* ---- modules: parse the entries and their parameter sizes out of the PTX text ---- */
EXPORT CUresult cuModuleLoadDataEx(struct module **m, const void *image, unsigned nopt, int *opts,
                                   void **vals)
{
    NEED_CTX();
    const char *ptx = image;
    char *log = NULL;
    size_t loglen = 0;
    for (unsigned i = 0; i < nopt; ++i) {
        if (opts[i] == 5) log = vals[i];
        if (opts[i] == 6) loglen = (size_t)(uintptr_t)vals[i];
    }
    const char *err = NULL;
    if (getenv("FAKE_CUDA_PTX_ERROR"))
        err = "ptxas fatal   : fake driver asked to reject this module";
    else if (!strstr(ptx, "\n.version 6.4\n") || !strstr(ptx, "\n.target sm_52\n"))
        err = "ptxas fatal   : expected .version 6.4 and .target sm_52";
    if (err) {
        if (log && loglen)
            snprintf(log, loglen, "%s\nsecond line of the log", err);
        return INVALID_PTX;
    }
    struct module *mod = calloc(1, sizeof *mod);
    if (!mod)
        return OUT_OF_MEMORY;
    for (const char *e = strstr(ptx, ".entry "); e && mod->nfn < MAX_FN; e = strstr(e + 1, ".entry ")) {
        struct function *f = &mod->fn[mod->nfn++];
        sscanf(e + 7, "%63[A-Za-z0-9_]", f->name);
        const char *end = strchr(e, ')');
        for (const char *p = strstr(e, ".param "); p && p < end && f->nparams < MAX_PARAMS;
             p = strstr(p + 1, ".param "))
            f->size[f->nparams++] = strncmp(p + 7, ".u64", 4) == 0 ? 8 : 4;
        const char *ntid = strstr(end, ".maxntid ");
        f->maxntid = ntid ? atoi(ntid + 9) : 1024;
    }
    *m = mod;
    return OK;
}

EXPORT CUresult cuModuleUnload(struct module *m) { free(m); return OK; }

EXPORT CUresult cuModuleGetFunction(struct function **f, struct module *m, const char *name)
{
    for (int i = 0; i < m->nfn; ++i)
        if (strcmp(m->fn[i].name, name) == 0) {
            *f = &m->fn[i];
            return OK;
        }
    return NOT_FOUND;
}

/* ---- kernels, modelled ---- */
static uint64_t mix64(uint64_t z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return z ? z : 0x9E3779B97F4A7C15ULL;
}

static uint64_t next_random(uint64_t *s)
{
    uint64_t x = *s;
    x ^= x >> 12, x ^= x << 25, x ^= x >> 27;
    *s = x;
    return x * 0x2545F4914F6CDD1DULL;
}

static uint64_t mulhi(uint64_t a, uint64_t b) { return (uint64_t)(((unsigned __int128)a * b) >> 64); }

static CUresult run_kernel(const struct function *f, const uint64_t *a, uint64_t nthreads)
{
    unsigned acc = 0;
    const char *n = f->name;
    if (!strcmp(n, "odma_read")) { /* p, n16, passes, sink, magic */
        if (!valid(a[0], 16 * a[1]) || !valid(a[3], 4))
            return ILLEGAL_ADDRESS;
        const unsigned *p = (const unsigned *)(uintptr_t)a[0];
        for (uint64_t pass = 0; pass < (unsigned)a[2]; ++pass)
            for (uint64_t i = 0; i < 4 * a[1]; ++i)
                acc ^= p[i];
        if (acc == (unsigned)a[4])
            *(unsigned *)(uintptr_t)a[3] = acc;
        return OK;
    }
    if (!strcmp(n, "odma_copy")) { /* dst, src, n16, passes */
        if (!valid(a[0], 16 * a[2]) || !valid(a[1], 16 * a[2]))
            return ILLEGAL_ADDRESS;
        for (uint64_t pass = 0; pass < (unsigned)a[3]; ++pass)
            memmove((void *)(uintptr_t)a[0], (void *)(uintptr_t)a[1], 16 * a[2]);
        return OK;
    }
    if (!strcmp(n, "odma_gather8")) { /* p, ngran, accesses, seed, sink, magic */
        if (!valid(a[0], 8 * a[1]) || !valid(a[4], 4))
            return ILLEGAL_ADDRESS;
        const uint64_t *p = (const uint64_t *)(uintptr_t)a[0];
        for (uint64_t id = 0; id < nthreads; ++id) {
            uint64_t s = mix64(a[3] ^ (id * 0x9E3779B97F4A7C15ULL));
            for (uint64_t k = id; k < a[2]; k += nthreads)
                acc ^= (unsigned)p[mulhi(next_random(&s), a[1])];
        }
        if (acc == (unsigned)a[5])
            *(unsigned *)(uintptr_t)a[4] = acc;
        return OK;
    }
    if (!strcmp(n, "odma_gather16")) { /* p, ngran, group, vecs, accesses, seed, sink, magic */
        uint64_t group = (unsigned)a[2], vecs = (unsigned)a[3];
        if (group == 0 || group > 32 || (group & (group - 1)) || vecs == 0 || (vecs > 1 && vecs % 2) ||
            (vecs > 1 && group != 32) || nthreads % group)
            return INVALID_VALUE;
        if (!valid(a[0], 16 * group * vecs * a[1]) || !valid(a[6], 4))
            return ILLEGAL_ADDRESS;
        const unsigned *p = (const unsigned *)(uintptr_t)a[0];
        uint64_t ngroups = nthreads / group;
        for (uint64_t g = 0; g < ngroups; ++g) {
            uint64_t s = mix64(a[5] ^ (g * 0x9E3779B97F4A7C15ULL));
            for (uint64_t k = g; k < a[4]; k += ngroups) {
                uint64_t base = mulhi(next_random(&s), a[1]) * group * vecs * 4; /* in words */
                for (uint64_t w = 0; w < group * vecs * 4; ++w) /* every lane's vectors */
                    acc ^= p[base + w];
            }
        }
        if (acc == (unsigned)a[7])
            *(unsigned *)(uintptr_t)a[6] = acc;
        return OK;
    }
    return INVALID_VALUE;
}

EXPORT CUresult cuLaunchKernel(struct function *f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                               unsigned by, unsigned bz, unsigned shmem, void *stream, void **params,
                               void **extra)
{
    NEED_CTX();
    if (!f || !stream || !params || extra || shmem || gx == 0 || gy != 1 || gz != 1 || by != 1 ||
        bz != 1 || bx == 0 || (int)bx > f->maxntid || bx % 32)
        return INVALID_VALUE;
    uint64_t a[MAX_PARAMS] = {0};
    for (int i = 0; i < f->nparams; ++i) {
        if (f->size[i] == 8)
            memcpy(&a[i], params[i], 8);
        else {
            uint32_t v;
            memcpy(&v, params[i], 4);
            a[i] = v;
        }
    }
    return run_kernel(f, a, (uint64_t)gx * bx);
}

/* ---- streams and events ---- */
EXPORT CUresult cuStreamCreate(void **s, unsigned flags) { NEED_CTX(); *s = malloc(1); return *s && flags <= 1 ? OK : INVALID_VALUE; }
EXPORT CUresult cuStreamDestroy_v2(void *s) { free(s); return OK; }
EXPORT CUresult cuEventCreate(struct event **e, unsigned flags) { NEED_CTX(); *e = calloc(1, sizeof **e); return *e && !flags ? OK : INVALID_VALUE; }
EXPORT CUresult cuEventDestroy_v2(struct event *e) { free(e); return OK; }

EXPORT CUresult cuEventRecord(struct event *e, void *stream)
{
    if (!e || !stream)
        return INVALID_HANDLE;
    e->t = now_s();
    e->recorded = 1;
    return OK;
}

EXPORT CUresult cuEventSynchronize(struct event *e) { return e && e->recorded ? OK : INVALID_HANDLE; }

EXPORT CUresult cuEventElapsedTime(float *ms, struct event *a, struct event *b)
{
    if (!a || !b || !a->recorded || !b->recorded)
        return INVALID_HANDLE;
    *ms = (float)((b->t - a->t) * 1e3);
    return OK;
}
