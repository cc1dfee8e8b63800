/* cnrt.c - Cambricon MLUs through CNRT (libcnrt.so, Neuware SDK), loaded with dlopen.
 *
 * Looks for $NEUWARE_HOME/lib64/libcnrt.so first, then "libcnrt.so" on the loader's search path.
 * Only the CNRT 6.x names are used (devices.md lists them); every symbol beyond the five the shim
 * cannot work without is optional, and its absence degrades the method (visible in
 * result.method), never crashes.
 *
 * Without a kernel compiler (cncc) the MLU's cores cannot be programmed here, so every measurement
 * is done by the DMA engine through cnrtMemcpy*:
 * - read: the whole buffer streamed by device-to-device copies of up to 16 MiB into a scratch
 *   area, counting the bytes read (the writes land in the same small scratch as rand's, so read
 *   and rand differ only in where they read from: their ratio compares like with like).
 * - copy: the buffer's first half copied onto its second half, counted read + write (2x).
 * - rand: granules taken from random granule-aligned offsets of the whole buffer and copied into a
 *   scratch area, counting granule x accesses (the bytes read). Preferred form: cnrtMemcpy2D[Async]
 *   calls of up to 256 rows of `granule` bytes whose source pitch and start are random per call
 *   ("2d-randstride"); otherwise one small copy per access ("1d"). Both measure the DMA engine's
 *   random-access rate, not core loads; kernel-driven random access on MLU comes from the torch
 *   backend with torch_mlu.
 * Timing: notifiers around async copies on one queue (cnrtNotifierElapsedTime, ms); when the async
 * calls or notifiers are missing, a monotonic host clock around synchronous copies ("hostclock").
 *
 * Peak: MemClockRate (kHz) x GmemBusWidth (bits) / 8 x 2, i.e. the attribute is read as the memory
 * I/O clock (half the data rate), the same convention as CUDA's MEMORY_CLOCK_RATE. An MLU370-X4
 * (LPDDR5-6400, 384 bit) reporting 3200000 kHz thus gives 307.2 GB/s.
 *
 * State: the library handle and function table, loaded once (pthread_once). Nothing else.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* ---- the slice of cnrt.h the shim uses (devices.md) ---- */
typedef int cnrtRet_t; /* an enum in cnrt.h; 0 is success in every version */
typedef struct cnrtQueue *cnrtQueue_t;
typedef struct cnrtNotifier *cnrtNotifier_t;
typedef int cnrtMemTransDir_t;
enum { HOST_TO_DEV = 0, DEV_TO_DEV = 1, DEV_TO_HOST = 2 };
enum { CNRT_ERROR_NO_DEVICE = 100004, CNRT_ERROR_DEVICE_INVALID = 100005,
       CNRT_ERROR_ARGS_INVALID = 100006, CNRT_ERROR_NO_MEM = 100100 };
enum { ATTR_MEM_CLOCK_RATE = 0x403, ATTR_GMEM_BUS_WIDTH = 0x404, ATTR_TOTAL_MEM_SIZE = 0x405 };

/* cnrtMemcpy2D limits (devices.md), taken in decimal so that either reading of "MB" holds */
#define LIMIT_2D_WIDTH 1000000u
#define LIMIT_2D_PITCH 4000000u
#define LIMIT_2D_AREA 16000000u
#define ROWS_2D 256          /* granules per 2D call */
#define MIN_PITCH_2D 4096    /* below this a 2D copy is nearly sequential */
#define MAX_1D_ACCESSES 65536 /* per repetition: one DMA call each, bound the run time */
#define SLOTS_1D 4096        /* scratch granules the 1D form cycles through */
#define READ_CHUNK (16u << 20) /* bytes per DMA copy of the sequential read */

static struct {
    /* required */
    cnrtRet_t (*GetDeviceCount)(unsigned *);
    cnrtRet_t (*SetDevice)(int);
    cnrtRet_t (*Malloc)(void **, size_t);
    cnrtRet_t (*Free)(void *);
    cnrtRet_t (*Memcpy)(void *, void *, size_t, cnrtMemTransDir_t);
    /* optional */
    cnrtRet_t (*DeviceGetAttribute)(int *, int, int);
    cnrtRet_t (*MemGetInfo)(size_t *, size_t *);
    cnrtRet_t (*GetLibVersion)(int *, int *, int *);
    const char *(*GetErrorStr)(cnrtRet_t);
    cnrtRet_t (*MemcpyAsync)(void *, void *, size_t, cnrtQueue_t, cnrtMemTransDir_t);
    cnrtRet_t (*Memcpy2D)(void *, size_t, const void *, size_t, size_t, size_t, cnrtMemTransDir_t);
    cnrtRet_t (*Memcpy2DAsync)(void *, size_t, const void *, size_t, size_t, size_t,
                               cnrtMemTransDir_t, cnrtQueue_t);
    cnrtRet_t (*QueueCreate)(cnrtQueue_t *);
    cnrtRet_t (*QueueDestroy)(cnrtQueue_t);
    cnrtRet_t (*QueueSync)(cnrtQueue_t);
    cnrtRet_t (*NotifierCreate)(cnrtNotifier_t *);
    cnrtRet_t (*NotifierDestroy)(cnrtNotifier_t);
    cnrtRet_t (*PlaceNotifier)(cnrtNotifier_t, cnrtQueue_t);
    cnrtRet_t (*NotifierElapsedTime)(cnrtNotifier_t, cnrtNotifier_t, float *);
} cn;

static const struct odma_symbol SYMBOLS[] = {
    {{"cnrtGetDeviceCount"}, (void **)&cn.GetDeviceCount, 1},
    {{"cnrtSetDevice"}, (void **)&cn.SetDevice, 1},
    {{"cnrtMalloc"}, (void **)&cn.Malloc, 1},
    {{"cnrtFree"}, (void **)&cn.Free, 1},
    {{"cnrtMemcpy"}, (void **)&cn.Memcpy, 1},
    {{"cnrtDeviceGetAttribute"}, (void **)&cn.DeviceGetAttribute, 0},
    {{"cnrtMemGetInfo"}, (void **)&cn.MemGetInfo, 0},
    {{"cnrtGetLibVersion"}, (void **)&cn.GetLibVersion, 0},
    {{"cnrtGetErrorStr"}, (void **)&cn.GetErrorStr, 0},
    /* older 6.x exports only the plain name; same prototype (queue before direction) */
    {{"cnrtMemcpyAsync_V3", "cnrtMemcpyAsync_V2", "cnrtMemcpyAsync"}, (void **)&cn.MemcpyAsync, 0},
    {{"cnrtMemcpy2D"}, (void **)&cn.Memcpy2D, 0},
    {{"cnrtMemcpy2DAsync"}, (void **)&cn.Memcpy2DAsync, 0},
    {{"cnrtQueueCreate"}, (void **)&cn.QueueCreate, 0},
    {{"cnrtQueueDestroy"}, (void **)&cn.QueueDestroy, 0},
    {{"cnrtQueueSync"}, (void **)&cn.QueueSync, 0},
    {{"cnrtNotifierCreate"}, (void **)&cn.NotifierCreate, 0},
    {{"cnrtNotifierDestroy"}, (void **)&cn.NotifierDestroy, 0},
    {{"cnrtPlaceNotifier"}, (void **)&cn.PlaceNotifier, 0},
    {{"cnrtNotifierElapsedTime"}, (void **)&cn.NotifierElapsedTime, 0},
};

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static void *lib; /* never dlclose'd */
static int load_status;
static char load_msg[ODMA_MSG_LEN];
static int device_count;
static int lib_version; /* major*10000 + minor*100 + patch, 0 when unknown */

/* ---- messages ---- */

static int status_for(cnrtRet_t r)
{
    switch (r) {
    case CNRT_ERROR_ARGS_INVALID: return ODMA_EINVAL;
    case CNRT_ERROR_NO_MEM: return ODMA_ENOMEM;
    case CNRT_ERROR_NO_DEVICE:
    case CNRT_ERROR_DEVICE_INVALID: return ODMA_ENODEV;
    default: return ODMA_EDEVICE;
    }
}

static int cn_fail(char *msg, cnrtRet_t r, const char *call)
{
    const char *s = cn.GetErrorStr ? cn.GetErrorStr(r) : NULL;
    return odma_set_msg(msg, status_for(r), "%s: cnrtRet %d (%s)", call, r, s ? s : "no description");
}

/* ---- loading ---- */
static void load(void)
{
    char path[4096] = "", first_err[300] = "";
    const char *home = getenv("NEUWARE_HOME");
    if (home && *home) {
        snprintf(path, sizeof path, "%s/lib64/libcnrt.so", home);
        lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!lib)
            snprintf(first_err, sizeof first_err, "%s; ", dlerror());
    }
    if (!lib)
        lib = dlopen("libcnrt.so", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        load_status = odma_set_msg(load_msg, ODMA_ENOLIB,
                              "libcnrt.so not found (Cambricon Neuware not installed; set "
                              "NEUWARE_HOME): %s%s", first_err, dlerror());
        return;
    }
    const char *missing = odma_resolve_symbols(lib, SYMBOLS, sizeof SYMBOLS / sizeof SYMBOLS[0]);
    if (missing) {
        load_status = odma_set_msg(load_msg, ODMA_ENOLIB, "libcnrt lacks %s: not a CNRT 6.x library",
                                   missing);
        return;
    }
    int major = 0, minor = 0, patch = 0;
    if (cn.GetLibVersion && cn.GetLibVersion(&major, &minor, &patch) == 0)
        lib_version = major * 10000 + minor * 100 + patch;
    unsigned count = 0;
    cnrtRet_t r = cn.GetDeviceCount(&count);
    if (r == CNRT_ERROR_NO_DEVICE || (r == 0 && count == 0)) {
        load_status = odma_set_msg(load_msg, ODMA_ENODEV, "libcnrt loaded but no MLU device found");
        return;
    }
    if (r != 0) {
        load_status = cn_fail(load_msg, r, "cnrtGetDeviceCount");
        return;
    }
    device_count = (int)count;
    load_status = ODMA_OK;
}

/* Library loaded and `ordinal` made this thread's current device. */
static int enter(int ordinal, char *msg)
{
    pthread_once(&load_once, load);
    if (load_status != ODMA_OK) {
        if (msg)
            memcpy(msg, load_msg, ODMA_MSG_LEN);
        return load_status;
    }
    if (ordinal < 0 || ordinal >= device_count)
        return odma_set_msg(msg, ODMA_ENODEV, "mlu:%d does not exist: this machine has %d MLU(s)",
                       ordinal, device_count);
    cnrtRet_t r = cn.SetDevice(ordinal);
    return r == 0 ? ODMA_OK : cn_fail(msg, r, "cnrtSetDevice");
}

static void *ptr(uint64_t address) { return (void *)(uintptr_t)address; }

/* ---- ABI ---- */
int odma_mlu_init(int *count, char *msg)
{
    if (count)
        *count = 0;
    pthread_once(&load_once, load);
    if (load_status != ODMA_OK) {
        if (msg)
            memcpy(msg, load_msg, ODMA_MSG_LEN);
        return load_status;
    }
    if (count)
        *count = device_count;
    return ODMA_OK;
}

int odma_mlu_device_info(int ordinal, odma_devinfo *info, char *msg)
{
    if (!info)
        return odma_set_msg(msg, ODMA_EINVAL, "info is NULL");
    int st = enter(ordinal, msg);
    if (st != ODMA_OK)
        return st;
    memset(info, 0, sizeof *info);
    int total_mb = 0;
    if (cn.DeviceGetAttribute) { /* an attribute the library does not know stays 0 ("unknown") */
        if (cn.DeviceGetAttribute(&info->mem_clock_khz, ATTR_MEM_CLOCK_RATE, ordinal) != 0)
            info->mem_clock_khz = 0;
        if (cn.DeviceGetAttribute(&info->bus_width_bits, ATTR_GMEM_BUS_WIDTH, ordinal) != 0)
            info->bus_width_bits = 0;
        if (cn.DeviceGetAttribute(&total_mb, ATTR_TOTAL_MEM_SIZE, ordinal) != 0)
            total_mb = 0;
    }
    size_t free_b = 0, total_b = 0;
    if (cn.MemGetInfo) {
        cnrtRet_t r = cn.MemGetInfo(&free_b, &total_b);
        if (r != 0)
            return cn_fail(msg, r, "cnrtMemGetInfo");
    }
    info->total_bytes = total_b ? total_b : (size_t)(total_mb > 0 ? total_mb : 0) << 20;
    info->free_bytes = free_b;
    info->peak_gbps = (double)info->mem_clock_khz * 1e3 * info->bus_width_bits / 8.0 * 2.0 / 1e9;
    info->runtime_version = lib_version;
    /* the properties struct that holds the marketing name changes layout between CNRT versions */
    snprintf(info->name, sizeof info->name, "Cambricon MLU %d (%zu MiB, CNRT %d.%d.%d)", ordinal,
             info->total_bytes >> 20, lib_version / 10000, lib_version / 100 % 100, lib_version % 100);
    return ODMA_OK;
}

int odma_mlu_alloc(int ordinal, size_t bytes, uint64_t *dptr, char *msg)
{
    if (!dptr || bytes == 0)
        return odma_set_msg(msg, ODMA_EINVAL, "mlu alloc: need bytes > 0 and an output pointer");
    *dptr = 0;
    int st = enter(ordinal, msg);
    if (st != ODMA_OK)
        return st;
    void *p = NULL;
    cnrtRet_t r = cn.Malloc(&p, bytes);
    if (r != 0 || !p) {
        char call[64];
        snprintf(call, sizeof call, "cnrtMalloc(%zu B)", bytes);
        return r == 0 ? odma_set_msg(msg, ODMA_ENOMEM, "%s returned NULL", call) : cn_fail(msg, r, call);
    }
    *dptr = (uint64_t)(uintptr_t)p;
    return ODMA_OK;
}

int odma_mlu_free(int ordinal, uint64_t dptr, char *msg)
{
    if (!dptr)
        return odma_set_msg(msg, ODMA_EINVAL, "mlu free: null device address");
    int st = enter(ordinal, msg);
    if (st != ODMA_OK)
        return st;
    cnrtRet_t r = cn.Free(ptr(dptr));
    return r == 0 ? ODMA_OK : cn_fail(msg, r, "cnrtFree");
}

int odma_mlu_write(int ordinal, uint64_t dst, const void *src, size_t bytes, char *msg)
{
    if (bytes == 0)
        return ODMA_OK;
    if (!dst || !src)
        return odma_set_msg(msg, ODMA_EINVAL, "mlu write: null address");
    int st = enter(ordinal, msg);
    if (st != ODMA_OK)
        return st;
    cnrtRet_t r = cn.Memcpy(ptr(dst), (void *)src, bytes, HOST_TO_DEV);
    return r == 0 ? ODMA_OK : cn_fail(msg, r, "cnrtMemcpy(HostToDev)");
}

int odma_mlu_read(int ordinal, void *dst, uint64_t src, size_t bytes, char *msg)
{
    if (bytes == 0)
        return ODMA_OK;
    if (!dst || !src)
        return odma_set_msg(msg, ODMA_EINVAL, "mlu read: null address");
    int st = enter(ordinal, msg);
    if (st != ODMA_OK)
        return st;
    cnrtRet_t r = cn.Memcpy(dst, ptr(src), bytes, DEV_TO_HOST);
    return r == 0 ? ODMA_OK : cn_fail(msg, r, "cnrtMemcpy(DevToHost)");
}

/* ---- timing: n intervals, either notifiers on a queue or a host clock around synchronous calls ---- */
struct timing {
    int async;               /* 1: calls go to `queue`, notifiers time them */
    cnrtQueue_t queue;
    cnrtNotifier_t *marks;   /* n + 1 notifiers (async) */
    double *clock;           /* n + 1 host timestamps (sync) */
    int created;             /* notifiers created, for timing_close */
};

static int have_queue_timing(void)
{
    return cn.QueueCreate && cn.QueueDestroy && cn.QueueSync && cn.NotifierCreate &&
           cn.NotifierDestroy && cn.PlaceNotifier && cn.NotifierElapsedTime;
}

static int timing_open(struct timing *t, int n, int async, char *msg)
{
    memset(t, 0, sizeof *t);
    t->async = async;
    t->clock = calloc((size_t)n + 1, sizeof *t->clock);
    t->marks = calloc((size_t)n + 1, sizeof *t->marks);
    if (!t->clock || !t->marks)
        return odma_set_msg(msg, ODMA_ENOMEM, "out of host memory");
    if (!async)
        return ODMA_OK;
    cnrtRet_t r = cn.QueueCreate(&t->queue);
    if (r != 0) {
        t->queue = NULL;
        return cn_fail(msg, r, "cnrtQueueCreate");
    }
    for (int i = 0; i <= n; ++i, ++t->created)
        if ((r = cn.NotifierCreate(&t->marks[i])) != 0)
            return cn_fail(msg, r, "cnrtNotifierCreate");
    return ODMA_OK;
}

static void timing_close(struct timing *t)
{
    if (t->queue)
        cn.QueueSync(t->queue); /* nothing may still be running on memory about to be freed */
    for (int i = 0; i < t->created; ++i)
        cn.NotifierDestroy(t->marks[i]);
    if (t->queue)
        cn.QueueDestroy(t->queue);
    free(t->marks);
    free(t->clock);
}

static int timing_mark(struct timing *t, int i, char *msg)
{
    if (!t->async) {
        t->clock[i] = odma_now_s();
        return ODMA_OK;
    }
    cnrtRet_t r = cn.PlaceNotifier(t->marks[i], t->queue);
    return r == 0 ? ODMA_OK : cn_fail(msg, r, "cnrtPlaceNotifier");
}

static int timing_read(struct timing *t, int n, double *seconds, char *msg)
{
    if (t->async) {
        cnrtRet_t r = cn.QueueSync(t->queue);
        if (r != 0)
            return cn_fail(msg, r, "cnrtQueueSync (a copy failed)");
    }
    for (int i = 0; i < n; ++i) {
        if (!t->async) {
            seconds[i] = t->clock[i + 1] - t->clock[i];
            continue;
        }
        float ms = 0;
        cnrtRet_t r = cn.NotifierElapsedTime(t->marks[i], t->marks[i + 1], &ms);
        if (r != 0)
            return cn_fail(msg, r, "cnrtNotifierElapsedTime");
        seconds[i] = ms * 1e-3;
    }
    return ODMA_OK;
}

/* device-to-device copy on the timing's queue (async) or synchronously */
static int d2d(struct timing *t, void *dst, void *src, size_t bytes, char *msg)
{
    cnrtRet_t r = t->async ? cn.MemcpyAsync(dst, src, bytes, t->queue, DEV_TO_DEV)
                           : cn.Memcpy(dst, src, bytes, DEV_TO_DEV);
    return r == 0 ? ODMA_OK : cn_fail(msg, r, t->async ? "cnrtMemcpyAsync(DevToDev)"
                                                          : "cnrtMemcpy(DevToDev)");
}

static int d2d_2d(struct timing *t, void *dst, size_t dpitch, void *src, size_t spitch, size_t width,
                  size_t height, char *msg)
{
    cnrtRet_t r = t->async
        ? cn.Memcpy2DAsync(dst, dpitch, src, spitch, width, height, DEV_TO_DEV, t->queue)
        : cn.Memcpy2D(dst, dpitch, src, spitch, width, height, DEV_TO_DEV);
    return r == 0 ? ODMA_OK : cn_fail(msg, r, t->async ? "cnrtMemcpy2DAsync(DevToDev)"
                                                          : "cnrtMemcpy2D(DevToDev)");
}

int odma_mlu_copy(int ordinal, uint64_t dst, uint64_t src, size_t bytes, double *seconds, char *msg)
{
    if (seconds)
        *seconds = 0;
    if (bytes == 0)
        return ODMA_OK;
    if (!dst || !src)
        return odma_set_msg(msg, ODMA_EINVAL, "mlu copy: null device address");
    if (dst < src + bytes && src < dst + bytes)
        return odma_set_msg(msg, ODMA_EINVAL, "mlu copy: source and destination overlap");
    int st = enter(ordinal, msg);
    if (st != ODMA_OK)
        return st;
    struct timing t;
    double s = 0;
    if ((st = timing_open(&t, 1, have_queue_timing() && cn.MemcpyAsync, msg)) == ODMA_OK &&
        (st = timing_mark(&t, 0, msg)) == ODMA_OK &&
        (st = d2d(&t, ptr(dst), ptr(src), bytes, msg)) == ODMA_OK &&
        (st = timing_mark(&t, 1, msg)) == ODMA_OK &&
        (st = timing_read(&t, 1, &s, msg)) == ODMA_OK && seconds)
        *seconds = s;
    timing_close(&t);
    return st;
}

/* ---- measurement ---- */
/* uniform in [0, n) */
static uint64_t below(uint64_t *state, uint64_t n)
{
    return (uint64_t)(((unsigned __int128)odma_splitmix64(state) * n) >> 64);
}

/* What one repetition does. */
struct plan {
    int kind;              /* 0: copy halves, 1: random 2D, 2: random 1D, 3: read into scratch */
    size_t seq_bytes;      /* kind 0: bytes per copy; kind 3: bytes read per pass */
    size_t seq_copies;     /* kinds 0, 3: passes per repetition */
    size_t granule, ngran; /* kinds 1, 2 */
    size_t accesses;       /* kinds 1, 2: granules per repetition */
    size_t rows;           /* kind 1: rows per 2D call */
    size_t pitch_min, pitch_max; /* kind 1: source pitch range, multiples of granule */
    size_t scratch_bytes;  /* kinds 1, 2 */
};

/* Rows and pitch range for the 2D form, or 0 when the buffer or granule does not allow it. */
static int plan_2d(struct plan *p, size_t bytes)
{
    size_t g = p->granule;
    if (g > LIMIT_2D_WIDTH)
        return 0;
    size_t rows = ROWS_2D;
    if (rows > p->accesses)
        rows = p->accesses;
    if (rows > LIMIT_2D_AREA / g)
        rows = LIMIT_2D_AREA / g;
    size_t pmin = MIN_PITCH_2D > 2 * g ? MIN_PITCH_2D : 2 * g; /* both powers of two: multiple of g */
    for (; rows >= 16; rows /= 2) {
        size_t pmax = (bytes - g) / (rows - 1);
        if (pmax > LIMIT_2D_PITCH)
            pmax = LIMIT_2D_PITCH;
        pmax -= pmax % g;
        if (pmax >= pmin) {
            p->rows = rows;
            p->pitch_min = pmin;
            p->pitch_max = pmax;
            p->scratch_bytes = rows * g;
            return 1;
        }
    }
    return 0;
}

/* One repetition of the plan. */
static int run_once(const struct plan *p, struct timing *t, char *base, char *scratch, size_t bytes,
                    uint64_t *rng, char *msg)
{
    int st = ODMA_OK;
    if (p->kind == 0) {
        size_t half = bytes / 2;
        for (size_t i = 0; i < p->seq_copies && st == ODMA_OK; ++i)
            st = d2d(t, base + half, base, p->seq_bytes, msg);
        return st;
    }
    if (p->kind == 3) {
        for (size_t i = 0; i < p->seq_copies; ++i)
            for (size_t off = 0; off < p->seq_bytes && st == ODMA_OK; off += p->scratch_bytes) {
                size_t n = p->seq_bytes - off < p->scratch_bytes ? p->seq_bytes - off : p->scratch_bytes;
                st = d2d(t, scratch, base + off, n, msg);
            }
        return st;
    }
    size_t g = p->granule, done = 0;
    if (p->kind == 1) {
        size_t steps = (p->pitch_max - p->pitch_min) / g + 1;
        while (done < p->accesses && st == ODMA_OK) {
            size_t rows = p->accesses - done < p->rows ? p->accesses - done : p->rows;
            size_t pitch = p->pitch_min + g * (size_t)below(rng, steps);
            size_t span = rows > 1 ? (rows - 1) * pitch + g : g;
            size_t start = g * (size_t)below(rng, (bytes - span) / g + 1);
            st = d2d_2d(t, scratch, g, base + start, pitch, g, rows, msg);
            done += rows;
        }
        return st;
    }
    for (; done < p->accesses && st == ODMA_OK; ++done)
        st = d2d(t, scratch + (done % SLOTS_1D) * g, base + g * below(rng, p->ngran), g, msg);
    return st;
}

int odma_mlu_measure(int ordinal, uint64_t buf, size_t bytes, int pattern, size_t granule, int reps,
                     size_t work_bytes, uint64_t seed, odma_result *out, char *msg)
{
    if (!out)
        return odma_set_msg(msg, ODMA_EINVAL, "result is NULL");
    memset(out, 0, sizeof *out);
    if (!buf)
        return odma_set_msg(msg, ODMA_EINVAL, "mlu measure: null buffer");
    if (pattern != ODMA_PAT_READ && pattern != ODMA_PAT_COPY && pattern != ODMA_PAT_RAND)
        return odma_set_msg(msg, ODMA_EINVAL, "unknown pattern %d", pattern);
    if (reps < 1 || reps > ODMA_MAX_REPS)
        return odma_set_msg(msg, ODMA_EINVAL, "reps must be in [1, %d], got %d", ODMA_MAX_REPS, reps);
    if (pattern == ODMA_PAT_COPY && bytes < 2)
        return odma_set_msg(msg, ODMA_EINVAL, "buffer of %zu B is too small to copy half of it", bytes);
    if (pattern == ODMA_PAT_RAND &&
        (!odma_is_pow2(granule) || granule < ODMA_MIN_GRANULE || granule > bytes))
        return odma_set_msg(msg, ODMA_EINVAL, "granule %zu must be a power of two in [%d, %zu]",
                            granule, ODMA_MIN_GRANULE, bytes);
    int st = enter(ordinal, msg);
    if (st != ODMA_OK)
        return st;

    int queue_ok = have_queue_timing();
    int async;
    const char *form;
    struct plan p = {0};
    if (pattern == ODMA_PAT_READ) {
        p.kind = 3;
        p.seq_bytes = bytes;
        p.seq_copies = 1;
        if (work_bytes >= bytes)
            p.seq_copies = work_bytes / bytes;
        else if (work_bytes) /* less than one pass: a prefix */
            p.seq_bytes = work_bytes;
        p.scratch_bytes = p.seq_bytes < READ_CHUNK ? p.seq_bytes : READ_CHUNK;
        out->bytes = (double)p.seq_bytes * (double)p.seq_copies;
        async = queue_ok && cn.MemcpyAsync;
        form = "d2d into scratch, reads counted";
    } else if (pattern == ODMA_PAT_COPY) {
        size_t half = bytes / 2;
        p.seq_bytes = half;
        p.seq_copies = 1;
        if (work_bytes >= 2 * half)
            p.seq_copies = work_bytes / (2 * half);
        else if (work_bytes) /* less than one pass: a prefix */
            p.seq_bytes = work_bytes / 2 ? work_bytes / 2 : 1;
        out->bytes = 2.0 * (double)p.seq_bytes * (double)p.seq_copies;
        async = queue_ok && cn.MemcpyAsync;
        form = "d2d halves, counted 2x";
    } else {
        p.granule = granule;
        p.ngran = bytes / granule;
        p.accesses = work_bytes ? work_bytes / granule : p.ngran;
        if (p.accesses == 0)
            p.accesses = 1;
        int async2d = queue_ok && cn.Memcpy2DAsync;
        if ((async2d || cn.Memcpy2D) && plan_2d(&p, bytes)) {
            p.kind = 1;
            async = async2d;
            form = "2d-randstride";
        } else {
            p.kind = 2;
            if (p.accesses > MAX_1D_ACCESSES)
                p.accesses = MAX_1D_ACCESSES;
            p.scratch_bytes = (p.accesses < SLOTS_1D ? p.accesses : SLOTS_1D) * granule;
            async = queue_ok && cn.MemcpyAsync;
            form = "1d-gather";
        }
        out->bytes = (double)p.accesses * (double)granule;
    }
    snprintf(out->method, sizeof out->method, "cnrt-dma-%s (%s)", async ? "async" : "sync-hostclock",
             form);

    void *scratch = NULL;
    struct timing t = {0};
    double *seconds = calloc((size_t)reps, sizeof *seconds);
    uint64_t rng = seed;
    cnrtRet_t r;
    if (!seconds) {
        st = odma_set_msg(msg, ODMA_ENOMEM, "out of host memory");
        goto out;
    }
    if (p.scratch_bytes && ((r = cn.Malloc(&scratch, p.scratch_bytes)) != 0 || !scratch)) {
        scratch = NULL;
        st = r ? cn_fail(msg, r, "cnrtMalloc (scratch)") : odma_set_msg(msg, ODMA_ENOMEM, "cnrtMalloc");
        goto out;
    }
    if ((st = timing_open(&t, reps, async, msg)) != ODMA_OK)
        goto out;
    /* one untimed warm-up, then reps back to back between marks */
    if ((st = run_once(&p, &t, ptr(buf), scratch, bytes, &rng, msg)) != ODMA_OK)
        goto out;
    for (int i = 0; i < reps; ++i) {
        if ((st = timing_mark(&t, i, msg)) != ODMA_OK)
            goto out;
        if ((st = run_once(&p, &t, ptr(buf), scratch, bytes, &rng, msg)) != ODMA_OK)
            goto out;
    }
    if ((st = timing_mark(&t, reps, msg)) != ODMA_OK || (st = timing_read(&t, reps, seconds, msg)) != ODMA_OK)
        goto out;
    odma_summarise_times(seconds, reps, out);
    out->threads = 0;
out:
    timing_close(&t); /* safe on a zeroed or half-opened timing */
    if (scratch)
        cn.Free(scratch);
    free(seconds);
    return st;
}
