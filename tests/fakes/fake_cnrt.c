/* fake_cnrt.c - a stand-in libcnrt.so for tests: the real CNRT 6.x prototypes over host memory.
 *
 * Built by the tests with `cc -shared -fPIC` into $NEUWARE_HOME/lib64/libcnrt.so. It reports one
 * MLU370-X4: 384-bit bus, MemClockRate 3200000 kHz (the memory I/O clock, half of LPDDR5's 6400 MT/s;
 * native/cnrt.c computes peak = clock x bus / 8 x 2 = 307.2 GB/s), 24 GiB, CNRT 6.6.0.
 * Device memory is host memory; "async" calls run at once (a queue is ordered anyway), notifiers
 * record a monotonic clock when placed, so elapsed times are real host copy times.
 *
 * Environment:
 *   FAKE_CNRT_TOTAL_MB  device memory to report and enforce (default 24576)
 *   FAKE_CNRT_DEVICES   number of devices (default 1; 0 makes cnrtGetDeviceCount fail NoDevice)
 * Build with -DFAKE_CNRT_MINIMAL for a library that exports only what every CNRT has
 * (count, set device, malloc, free, memcpy): the shim must degrade to synchronous copies.
 * Without it, cnrtMemcpyAsync is exported as _V2 and plain (no _V3), like a mid 6.x release.
 *
 * Like the real runtime it refuses device pointers it did not hand out (ArgsInvalid), so a double
 * free or an out-of-range copy is an error, not a crash.
 */
#define _GNU_SOURCE
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef enum {
    cnrtSuccess = 0,
    cnrtErrorNotReady = 1,
    cnrtErrorInit = 100002,
    cnrtErrorNoDevice = 100004,
    cnrtErrorDeviceInvalid = 100005,
    cnrtErrorArgsInvalid = 100006,
    cnrtErrorNoMem = 100100,
    cnrtErrorUnknown = 999991,
} cnrtRet_t;

typedef enum {
    cnrtMemcpyHostToDev = 0,
    cnrtMemcpyDevToDev = 1,
    cnrtMemcpyDevToHost = 2,
    cnrtMemcpyHostToHost = 3,
    cnrtMemcpyPeerToPeer = 4,
    cnrtMemcpyNoDirection = 5,
} cnrtMemTransDir_t;

struct CNqueue { int device; };
struct CNnotifier { double t; int placed; };
typedef struct CNqueue *cnrtQueue_t;
typedef struct CNnotifier *cnrtNotifier_t;

#define EXPORT __attribute__((visibility("default")))

/* ---- fake device state ---- */
struct allocation { char *p; size_t n; };
static struct allocation *allocs;
static size_t nallocs, cap_allocs, used_bytes;
static pthread_mutex_t lock = PTHREAD_MUTEX_INITIALIZER;
static __thread int current_device;

static long env_long(const char *name, long dflt)
{
    const char *s = getenv(name);
    return s && *s ? strtol(s, NULL, 10) : dflt;
}

static size_t total_bytes(void) { return (size_t)env_long("FAKE_CNRT_TOTAL_MB", 24576) << 20; }
static int ndevices(void) { return (int)env_long("FAKE_CNRT_DEVICES", 1); }

/* index of the allocation holding [p, p + n), or -1; caller holds lock */
static long find(const void *p, size_t n)
{
    const char *c = p;
    for (size_t i = 0; i < nallocs; ++i)
        if (c >= allocs[i].p && c <= allocs[i].p + allocs[i].n && n <= (size_t)(allocs[i].p + allocs[i].n - c))
            return (long)i;
    return -1;
}

static int is_device(const void *p, size_t n)
{
    pthread_mutex_lock(&lock);
    long i = find(p, n);
    pthread_mutex_unlock(&lock);
    return i >= 0;
}

/* ---- always exported ---- */
EXPORT cnrtRet_t cnrtGetDeviceCount(unsigned int *count)
{
    if (!count)
        return cnrtErrorArgsInvalid;
    int n = ndevices();
    *count = n > 0 ? (unsigned)n : 0;
    return n > 0 ? cnrtSuccess : cnrtErrorNoDevice;
}

EXPORT cnrtRet_t cnrtSetDevice(int ordinal)
{
    if (ordinal < 0 || ordinal >= ndevices())
        return cnrtErrorDeviceInvalid;
    current_device = ordinal;
    return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtGetDevice(int *ordinal)
{
    if (!ordinal)
        return cnrtErrorArgsInvalid;
    *ordinal = current_device;
    return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtMalloc(void **ptr, size_t bytes)
{
    if (!ptr || bytes == 0)
        return cnrtErrorArgsInvalid;
    *ptr = NULL;
    pthread_mutex_lock(&lock);
    cnrtRet_t r = cnrtErrorNoMem;
    void *p = NULL;
    if (bytes <= total_bytes() - used_bytes && posix_memalign(&p, 4096, bytes) == 0) {
        if (nallocs == cap_allocs) {
            size_t cap = cap_allocs ? 2 * cap_allocs : 64;
            struct allocation *a = realloc(allocs, cap * sizeof *a);
            if (!a) {
                free(p);
                goto out;
            }
            allocs = a;
            cap_allocs = cap;
        }
        allocs[nallocs++] = (struct allocation){p, bytes};
        used_bytes += bytes;
        *ptr = p;
        r = cnrtSuccess;
    }
out:
    pthread_mutex_unlock(&lock);
    return r;
}

EXPORT cnrtRet_t cnrtFree(void *ptr)
{
    pthread_mutex_lock(&lock);
    cnrtRet_t r = cnrtErrorArgsInvalid;
    for (size_t i = 0; i < nallocs; ++i)
        if (allocs[i].p == ptr) {
            used_bytes -= allocs[i].n;
            free(allocs[i].p);
            allocs[i] = allocs[--nallocs];
            r = cnrtSuccess;
            break;
        }
    pthread_mutex_unlock(&lock);
    return r;
}

/* checks the device side(s) of a transfer */
static cnrtRet_t check_dir(void *dst, const void *src, size_t bytes, cnrtMemTransDir_t dir)
{
    if (!dst || !src)
        return cnrtErrorArgsInvalid;
    switch (dir) {
    case cnrtMemcpyHostToDev: return is_device(dst, bytes) ? cnrtSuccess : cnrtErrorArgsInvalid;
    case cnrtMemcpyDevToHost: return is_device(src, bytes) ? cnrtSuccess : cnrtErrorArgsInvalid;
    case cnrtMemcpyDevToDev:
        return is_device(dst, bytes) && is_device(src, bytes) ? cnrtSuccess : cnrtErrorArgsInvalid;
    case cnrtMemcpyHostToHost: return cnrtSuccess;
    default: return cnrtErrorArgsInvalid;
    }
}

EXPORT cnrtRet_t cnrtMemcpy(void *dst, void *src, size_t bytes, cnrtMemTransDir_t dir)
{
    if (bytes == 0)
        return cnrtSuccess;
    cnrtRet_t r = check_dir(dst, src, bytes, dir);
    if (r == cnrtSuccess)
        memmove(dst, src, bytes);
    return r;
}

#ifndef FAKE_CNRT_MINIMAL
static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

EXPORT cnrtRet_t cnrtGetLibVersion(int *major, int *minor, int *patch)
{
    if (!major || !minor || !patch)
        return cnrtErrorArgsInvalid;
    *major = 6, *minor = 6, *patch = 0;
    return cnrtSuccess;
}

EXPORT const char *cnrtGetErrorStr(cnrtRet_t r)
{
    switch (r) {
    case cnrtSuccess: return "success";
    case cnrtErrorNoDevice: return "no device";
    case cnrtErrorDeviceInvalid: return "invalid device";
    case cnrtErrorArgsInvalid: return "invalid arguments";
    case cnrtErrorNoMem: return "out of device memory";
    default: return "unknown error";
    }
}

EXPORT cnrtRet_t cnrtDeviceGetAttribute(int *value, int attr, int device)
{
    if (!value || device < 0 || device >= ndevices())
        return cnrtErrorArgsInvalid;
    switch (attr) {
    case 0x403: *value = 3200000; return cnrtSuccess;                      /* MemClockRate, kHz */
    case 0x404: *value = 384; return cnrtSuccess;                          /* GmemBusWidth, bits */
    case 0x405: *value = (int)(total_bytes() >> 20); return cnrtSuccess;   /* TotalMemSize, MB */
    default: return cnrtErrorArgsInvalid;
    }
}

EXPORT cnrtRet_t cnrtMemGetInfo(size_t *free_bytes, size_t *total)
{
    if (!free_bytes || !total)
        return cnrtErrorArgsInvalid;
    pthread_mutex_lock(&lock);
    *total = total_bytes();
    *free_bytes = *total - used_bytes;
    pthread_mutex_unlock(&lock);
    return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtMemset(void *ptr, int value, size_t bytes)
{
    if (!is_device(ptr, bytes))
        return cnrtErrorArgsInvalid;
    memset(ptr, value, bytes);
    return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtQueueCreate(cnrtQueue_t *queue)
{
    if (!queue)
        return cnrtErrorArgsInvalid;
    *queue = calloc(1, sizeof **queue);
    if (!*queue)
        return cnrtErrorNoMem;
    (*queue)->device = current_device;
    return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtQueueDestroy(cnrtQueue_t queue)
{
    if (!queue)
        return cnrtErrorArgsInvalid;
    free(queue);
    return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtQueueSync(cnrtQueue_t queue) { return queue ? cnrtSuccess : cnrtErrorArgsInvalid; }

EXPORT cnrtRet_t cnrtNotifierCreate(cnrtNotifier_t *notifier)
{
    if (!notifier)
        return cnrtErrorArgsInvalid;
    *notifier = calloc(1, sizeof **notifier);
    return *notifier ? cnrtSuccess : cnrtErrorNoMem;
}

EXPORT cnrtRet_t cnrtNotifierDestroy(cnrtNotifier_t notifier)
{
    if (!notifier)
        return cnrtErrorArgsInvalid;
    free(notifier);
    return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtPlaceNotifier(cnrtNotifier_t notifier, cnrtQueue_t queue)
{
    if (!notifier || !queue)
        return cnrtErrorArgsInvalid;
    notifier->t = now_s();
    notifier->placed = 1;
    return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtNotifierElapsedTime(cnrtNotifier_t start, cnrtNotifier_t end, float *ms)
{
    if (!start || !end || !ms || !start->placed || !end->placed)
        return cnrtErrorArgsInvalid;
    *ms = (float)((end->t - start->t) * 1e3);
    return cnrtSuccess;
}

EXPORT cnrtRet_t cnrtNotifierDuration(cnrtNotifier_t start, cnrtNotifier_t end, float *us)
{
    if (!start || !end || !us || !start->placed || !end->placed)
        return cnrtErrorArgsInvalid;
    *us = (float)((end->t - start->t) * 1e6);
    return cnrtSuccess;
}

/* queue comes before the direction, unlike CUDA */
EXPORT cnrtRet_t cnrtMemcpyAsync(void *dst, void *src, size_t bytes, cnrtQueue_t queue,
                                 cnrtMemTransDir_t dir)
{
    if (!queue)
        return cnrtErrorArgsInvalid;
    return cnrtMemcpy(dst, src, bytes, dir);
}

EXPORT cnrtRet_t cnrtMemcpyAsync_V2(void *dst, void *src, size_t bytes, cnrtQueue_t queue,
                                    cnrtMemTransDir_t dir)
{
    return cnrtMemcpyAsync(dst, src, bytes, queue, dir);
}

EXPORT cnrtRet_t cnrtMemcpy2D(void *dst, size_t dpitch, const void *src, size_t spitch, size_t width,
                              size_t height, cnrtMemTransDir_t dir)
{
    /* the documented limits: width, height <= 1 MB, pitches <= 4 MB, width x height <= 16 MB */
    if (width == 0 || height == 0)
        return cnrtSuccess;
    if (width > (1u << 20) || height > (1u << 20) || dpitch > (4u << 20) || spitch > (4u << 20) ||
        width * height > (16u << 20) || dpitch < width || spitch < width)
        return cnrtErrorArgsInvalid;
    cnrtRet_t r = check_dir(dst, src, 0, dir);
    if (r == cnrtSuccess && dir == cnrtMemcpyDevToDev &&
        (!is_device(dst, (height - 1) * dpitch + width) || !is_device(src, (height - 1) * spitch + width)))
        r = cnrtErrorArgsInvalid;
    if (r != cnrtSuccess)
        return r;
    for (size_t row = 0; row < height; ++row)
        memmove((char *)dst + row * dpitch, (const char *)src + row * spitch, width);
    return cnrtSuccess;
}

/* direction before the queue, as in cnrt.h */
EXPORT cnrtRet_t cnrtMemcpy2DAsync(void *dst, size_t dpitch, const void *src, size_t spitch,
                                   size_t width, size_t height, cnrtMemTransDir_t dir,
                                   cnrtQueue_t queue)
{
    if (!queue)
        return cnrtErrorArgsInvalid;
    return cnrtMemcpy2D(dst, dpitch, src, spitch, width, height, dir);
}
#endif /* FAKE_CNRT_MINIMAL */
