/* cuda.c - NVIDIA GPUs through the CUDA driver API, libcuda loaded with dlopen.
 *
 * Nothing here links against CUDA: libcuda.so.1 (or libcuda.so) is opened at first use and every
 * entry point is looked up by its exported, versioned name (dlsym ignores cuda.h's renaming macros,
 * and the plain cuMemAlloc is the legacy 32-bit-size ABI). The toolkit's stub libcuda answers
 * CUDA_ERROR_STUB_LIBRARY, which means "no driver".
 *
 * The shim shares each device's primary context with whoever else is in the process (PyTorch) and
 * restores the caller's current context before returning. Kernels come from the PTX text in
 * kernels_ptx.h (generated from native/kernels.cu), JIT-compiled by the driver once per device.
 *
 * State: the library handle and function table (loaded once, pthread_once) and, per device, the
 * retained primary context and the loaded module (created lazily under a mutex). Nothing else.
 */
#define _GNU_SOURCE
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common.h"

/* ---- the slice of cuda.h the shim uses (values from the CUDA 13 header; stable since CUDA 4) ---- */
typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;
typedef struct CUctx_st *CUcontext;
typedef struct CUmod_st *CUmodule;
typedef struct CUfunc_st *CUfunction;
typedef struct CUstream_st *CUstream;
typedef struct CUevent_st *CUevent;
typedef int CUjit_option;

enum {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_STUB_LIBRARY = 34,
    CUDA_ERROR_INSUFFICIENT_DRIVER = 35,
    CUDA_ERROR_NO_DEVICE = 100,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_NO_BINARY_FOR_GPU = 209,
    CUDA_ERROR_INVALID_PTX = 218,
    CUDA_ERROR_UNSUPPORTED_PTX_VERSION = 222,
    CUDA_ERROR_SYSTEM_DRIVER_MISMATCH = 803,
    CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE = 804,
};
enum {
    ATTR_MULTIPROCESSOR_COUNT = 16,
    ATTR_MEMORY_CLOCK_RATE = 36,          /* kHz */
    ATTR_GLOBAL_MEMORY_BUS_WIDTH = 37,    /* bits */
    ATTR_L2_CACHE_SIZE = 38,              /* bytes */
    ATTR_MAX_THREADS_PER_MULTIPROCESSOR = 39,
    ATTR_COMPUTE_CAPABILITY_MAJOR = 75,
    ATTR_COMPUTE_CAPABILITY_MINOR = 76,
};
enum { CU_JIT_ERROR_LOG_BUFFER = 5, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES = 6 };
enum { CU_STREAM_NON_BLOCKING = 1, CU_EVENT_DEFAULT = 0 };

/* ---- embedded kernels: ODMA_PTX, the PTX of native/kernels.cu with its `.version` / `.target`
 * lines lowered to 6.4 / sm_52 so that drivers back to CUDA 10.1 accept it (ptxas accepts it for
 * sm_75 and sm_90). kernels_ptx.h is written by native/regen_ptx.py; never edit it by hand. ---- */
#include "kernels_ptx.h"

#define BLOCK 256           /* threads per block; kernels.cu declares __launch_bounds__(256, 4) */

/* ---- library handle and function table (loaded once) ---- */
static struct {
    CUresult (*Init)(unsigned);
    CUresult (*DriverGetVersion)(int *);
    CUresult (*DeviceGetCount)(int *);
    CUresult (*DeviceGet)(CUdevice *, int);
    CUresult (*DeviceGetName)(char *, int, CUdevice);
    CUresult (*DeviceGetAttribute)(int *, int, CUdevice);
    CUresult (*DeviceTotalMem)(size_t *, CUdevice);
    CUresult (*DevicePrimaryCtxRetain)(CUcontext *, CUdevice);
    CUresult (*DevicePrimaryCtxRelease)(CUdevice);
    CUresult (*CtxGetCurrent)(CUcontext *);
    CUresult (*CtxSetCurrent)(CUcontext);
    CUresult (*MemGetInfo)(size_t *, size_t *);
    CUresult (*MemAlloc)(CUdeviceptr *, size_t);
    CUresult (*MemFree)(CUdeviceptr);
    CUresult (*MemcpyHtoD)(CUdeviceptr, const void *, size_t);
    CUresult (*MemcpyDtoH)(void *, CUdeviceptr, size_t);
    CUresult (*MemcpyDtoDAsync)(CUdeviceptr, CUdeviceptr, size_t, CUstream);
    CUresult (*ModuleLoadDataEx)(CUmodule *, const void *, unsigned, CUjit_option *, void **);
    CUresult (*ModuleUnload)(CUmodule);
    CUresult (*ModuleGetFunction)(CUfunction *, CUmodule, const char *);
    CUresult (*LaunchKernel)(CUfunction, unsigned, unsigned, unsigned, unsigned, unsigned, unsigned,
                             unsigned, CUstream, void **, void **);
    CUresult (*StreamCreate)(CUstream *, unsigned);
    CUresult (*StreamDestroy)(CUstream);
    CUresult (*EventCreate)(CUevent *, unsigned);
    CUresult (*EventRecord)(CUevent, CUstream);
    CUresult (*EventSynchronize)(CUevent);
    CUresult (*EventElapsedTime)(float *, CUevent, CUevent);
    CUresult (*EventDestroy)(CUevent);
    /* optional */
    CUresult (*GetErrorName)(CUresult, const char **);
    CUresult (*GetErrorString)(CUresult, const char **);
    CUresult (*OccupancyMaxActiveBlocksPerMultiprocessor)(int *, CUfunction, int, size_t);
} cu;


/* Symbols needed after cuInit succeeded (cuInit and the error-name calls are looked up first). */
static const struct odma_symbol SYMBOLS[] = {
    {{"cuDriverGetVersion"}, (void **)&cu.DriverGetVersion, 1},
    {{"cuDeviceGetCount"}, (void **)&cu.DeviceGetCount, 1},
    {{"cuDeviceGet"}, (void **)&cu.DeviceGet, 1},
    {{"cuDeviceGetName"}, (void **)&cu.DeviceGetName, 1},
    {{"cuDeviceGetAttribute"}, (void **)&cu.DeviceGetAttribute, 1},
    {{"cuDeviceTotalMem_v2"}, (void **)&cu.DeviceTotalMem, 1},
    {{"cuDevicePrimaryCtxRetain"}, (void **)&cu.DevicePrimaryCtxRetain, 1},
    {{"cuDevicePrimaryCtxRelease_v2"}, (void **)&cu.DevicePrimaryCtxRelease, 1},
    {{"cuCtxGetCurrent"}, (void **)&cu.CtxGetCurrent, 1},
    {{"cuCtxSetCurrent"}, (void **)&cu.CtxSetCurrent, 1},
    {{"cuMemGetInfo_v2"}, (void **)&cu.MemGetInfo, 1},
    {{"cuMemAlloc_v2"}, (void **)&cu.MemAlloc, 1},
    {{"cuMemFree_v2"}, (void **)&cu.MemFree, 1},
    {{"cuMemcpyHtoD_v2"}, (void **)&cu.MemcpyHtoD, 1},
    {{"cuMemcpyDtoH_v2"}, (void **)&cu.MemcpyDtoH, 1},
    {{"cuMemcpyDtoDAsync_v2"}, (void **)&cu.MemcpyDtoDAsync, 1},
    {{"cuModuleLoadDataEx"}, (void **)&cu.ModuleLoadDataEx, 1},
    {{"cuModuleUnload"}, (void **)&cu.ModuleUnload, 1},
    {{"cuModuleGetFunction"}, (void **)&cu.ModuleGetFunction, 1},
    {{"cuLaunchKernel"}, (void **)&cu.LaunchKernel, 1},
    {{"cuStreamCreate"}, (void **)&cu.StreamCreate, 1},
    {{"cuStreamDestroy_v2"}, (void **)&cu.StreamDestroy, 1},
    {{"cuEventCreate"}, (void **)&cu.EventCreate, 1},
    {{"cuEventRecord"}, (void **)&cu.EventRecord, 1},
    {{"cuEventSynchronize"}, (void **)&cu.EventSynchronize, 1},
    /* CUDA 12.8 added _v2 (same signature); older drivers only have the plain name */
    {{"cuEventElapsedTime_v2", "cuEventElapsedTime"}, (void **)&cu.EventElapsedTime, 1},
    {{"cuEventDestroy_v2"}, (void **)&cu.EventDestroy, 1},
    {{"cuOccupancyMaxActiveBlocksPerMultiprocessor"},
     (void **)&cu.OccupancyMaxActiveBlocksPerMultiprocessor, 0},
};

/* Per-device state, created on first use. `ctx` is set once the primary context is retained;
 * `mod` once the kernels are loaded. Guarded by dev_lock until set, read-only afterwards. */
struct cuda_device {
    CUdevice dev;
    CUcontext ctx;
    CUmodule mod;
    CUfunction f_read, f_copy, f_gather8, f_gather16;
    int blocks; /* grid size that fills every SM (per kernel the occupancy can differ: max of them) */
};

static pthread_once_t load_once = PTHREAD_ONCE_INIT;
static void *lib;                 /* never dlclose'd: other threads may still be inside it */
static int load_status;
static char load_msg[ODMA_MSG_LEN];
static int device_count;
static int driver_version;
static struct cuda_device *devices;
static pthread_mutex_t dev_lock = PTHREAD_MUTEX_INITIALIZER;

/* ---- messages ---- */

static const char *error_name(CUresult r)
{
    const char *s = NULL;
    if (cu.GetErrorName && cu.GetErrorName(r, &s) == CUDA_SUCCESS && s)
        return s;
    switch (r) { /* the codes the shim must explain even when the library cannot */
    case CUDA_ERROR_STUB_LIBRARY: return "CUDA_ERROR_STUB_LIBRARY";
    case CUDA_ERROR_NO_DEVICE: return "CUDA_ERROR_NO_DEVICE";
    case CUDA_ERROR_INSUFFICIENT_DRIVER: return "CUDA_ERROR_INSUFFICIENT_DRIVER";
    case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH: return "CUDA_ERROR_SYSTEM_DRIVER_MISMATCH";
    case CUDA_ERROR_UNSUPPORTED_PTX_VERSION: return "CUDA_ERROR_UNSUPPORTED_PTX_VERSION";
    case CUDA_ERROR_INVALID_PTX: return "CUDA_ERROR_INVALID_PTX";
    case CUDA_ERROR_NO_BINARY_FOR_GPU: return "CUDA_ERROR_NO_BINARY_FOR_GPU";
    default: return "CUDA error";
    }
}

static const char *error_string(CUresult r)
{
    const char *s = NULL;
    if (cu.GetErrorString && cu.GetErrorString(r, &s) == CUDA_SUCCESS && s)
        return s;
    return "no description";
}

/* odma status for a CUDA error */
static int status_for(CUresult r)
{
    switch (r) {
    case CUDA_ERROR_INVALID_VALUE: return ODMA_EINVAL;
    case CUDA_ERROR_OUT_OF_MEMORY: return ODMA_ENOMEM;
    case CUDA_ERROR_STUB_LIBRARY:
    case CUDA_ERROR_INSUFFICIENT_DRIVER:
    case CUDA_ERROR_SYSTEM_DRIVER_MISMATCH:
    case CUDA_ERROR_COMPAT_NOT_SUPPORTED_ON_DEVICE: return ODMA_ENOLIB;
    case CUDA_ERROR_NO_DEVICE:
    case CUDA_ERROR_INVALID_DEVICE: return ODMA_ENODEV;
    default: return ODMA_EDEVICE;
    }
}

/* "<call>: CUDA_ERROR_X (description)" with the matching odma status */
static int cu_fail(char *msg, CUresult r, const char *call)
{
    return odma_set_msg(msg, status_for(r), "%s: %s (%d, %s)", call, error_name(r), r, error_string(r));
}

/* ---- loading ---- */
static void load(void)
{
    const char *first_error;
    lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
    if (!lib) {
        char err[200];
        snprintf(err, sizeof err, "%s", dlerror());
        lib = dlopen("libcuda.so", RTLD_NOW | RTLD_LOCAL);
        if (!lib) {
            load_status = odma_set_msg(load_msg, ODMA_ENOLIB,
                                  "libcuda.so.1 not found: no NVIDIA driver installed (%s)", err);
            return;
        }
    }
    *(void **)&cu.Init = dlsym(lib, "cuInit");
    *(void **)&cu.GetErrorName = dlsym(lib, "cuGetErrorName");
    *(void **)&cu.GetErrorString = dlsym(lib, "cuGetErrorString");
    if (!cu.Init) {
        load_status = odma_set_msg(load_msg, ODMA_ENOLIB, "libcuda has no cuInit: not a CUDA driver");
        return;
    }
    CUresult r = cu.Init(0);
    if (r == CUDA_ERROR_STUB_LIBRARY) {
        load_status = odma_set_msg(load_msg, ODMA_ENOLIB,
                              "stub libcuda: no NVIDIA driver (cuInit: CUDA_ERROR_STUB_LIBRARY)");
        return;
    }
    if (r == CUDA_ERROR_NO_DEVICE) {
        load_status = odma_set_msg(load_msg, ODMA_ENODEV,
                              "NVIDIA driver loaded but no CUDA device (cuInit: CUDA_ERROR_NO_DEVICE)");
        return;
    }
    if (r != CUDA_SUCCESS) {
        load_status = cu_fail(load_msg, r, "cuInit");
        return;
    }
    first_error = odma_resolve_symbols(lib, SYMBOLS, sizeof SYMBOLS / sizeof SYMBOLS[0]);
    if (first_error) {
        load_status = odma_set_msg(load_msg, ODMA_ENOLIB,
                              "libcuda lacks %s: the NVIDIA driver is too old", first_error);
        return;
    }
    cu.DriverGetVersion(&driver_version);
    r = cu.DeviceGetCount(&device_count);
    if (r != CUDA_SUCCESS) {
        load_status = cu_fail(load_msg, r, "cuDeviceGetCount");
        return;
    }
    if (device_count <= 0) {
        device_count = 0;
        load_status = odma_set_msg(load_msg, ODMA_ENODEV, "NVIDIA driver loaded but no CUDA device");
        return;
    }
    devices = calloc((size_t)device_count, sizeof *devices);
    if (!devices) {
        load_status = odma_set_msg(load_msg, ODMA_ENOMEM, "out of host memory");
        return;
    }
    load_status = ODMA_OK;
}

static int ensure_loaded(char *msg)
{
    pthread_once(&load_once, load);
    if (load_status != ODMA_OK && msg)
        memcpy(msg, load_msg, ODMA_MSG_LEN);
    return load_status;
}

/* Retain the primary context and, when `kernels`, load the module. Caller holds dev_lock. */
static int prepare(struct cuda_device *d, int ordinal, int kernels, char *msg)
{
    CUresult r;
    if (!d->ctx) {
        CUcontext ctx;
        if ((r = cu.DeviceGet(&d->dev, ordinal)) != CUDA_SUCCESS)
            return cu_fail(msg, r, "cuDeviceGet");
        if ((r = cu.DevicePrimaryCtxRetain(&ctx, d->dev)) != CUDA_SUCCESS)
            return cu_fail(msg, r, "cuDevicePrimaryCtxRetain");
        d->ctx = ctx;
    }
    if (!kernels || d->mod)
        return ODMA_OK;

    CUcontext prev = NULL;
    cu.CtxGetCurrent(&prev);
    if ((r = cu.CtxSetCurrent(d->ctx)) != CUDA_SUCCESS)
        return cu_fail(msg, r, "cuCtxSetCurrent");
    char log[ODMA_MSG_LEN] = "";
    CUjit_option opts[] = {CU_JIT_ERROR_LOG_BUFFER, CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES};
    void *vals[] = {log, (void *)(uintptr_t)sizeof log};
    CUmodule mod = NULL;
    int status = ODMA_OK;
    r = cu.ModuleLoadDataEx(&mod, ODMA_PTX, 2, opts, vals);
    if (r != CUDA_SUCCESS) {
        log[sizeof log - 1] = '\0';
        char *nl = strchr(log, '\n');
        if (nl)
            *nl = '\0';
        status = odma_set_msg(msg, status_for(r), "cuModuleLoadDataEx (embedded PTX 6.4): %s (%d, %s)%s%s",
                         error_name(r), r, error_string(r), log[0] ? ": " : "", log);
        goto out;
    }
    static const char *names[] = {"odma_read", "odma_copy", "odma_gather8", "odma_gather16"};
    CUfunction *slots[] = {&d->f_read, &d->f_copy, &d->f_gather8, &d->f_gather16};
    int attr_sms = 0, attr_threads = 0, blocks_per_sm = 0;
    for (int i = 0; i < 4; ++i) {
        if ((r = cu.ModuleGetFunction(slots[i], mod, names[i])) != CUDA_SUCCESS) {
            status = cu_fail(msg, r, names[i]);
            cu.ModuleUnload(mod);
            goto out;
        }
        int n = 0;
        if (cu.OccupancyMaxActiveBlocksPerMultiprocessor &&
            cu.OccupancyMaxActiveBlocksPerMultiprocessor(&n, *slots[i], BLOCK, 0) == CUDA_SUCCESS &&
            n > blocks_per_sm)
            blocks_per_sm = n;
    }
    cu.DeviceGetAttribute(&attr_sms, ATTR_MULTIPROCESSOR_COUNT, d->dev);
    cu.DeviceGetAttribute(&attr_threads, ATTR_MAX_THREADS_PER_MULTIPROCESSOR, d->dev);
    if (blocks_per_sm <= 0) /* no occupancy API: as many blocks as an SM can hold threads for */
        blocks_per_sm = attr_threads >= BLOCK ? attr_threads / BLOCK : 4;
    d->blocks = (attr_sms > 0 ? attr_sms : 1) * blocks_per_sm;
    d->mod = mod;
out:
    cu.CtxSetCurrent(prev);
    return status;
}

/* The device for `ordinal`, its primary context current on this thread; *prev receives the context
 * that was current before, to be given back with leave(). */
static int enter(int ordinal, int kernels, struct cuda_device **out, CUcontext *prev, char *msg)
{
    int st = ensure_loaded(msg);
    if (st != ODMA_OK)
        return st;
    if (ordinal < 0 || ordinal >= device_count)
        return odma_set_msg(msg, ODMA_ENODEV, "cuda:%d does not exist: this machine has %d CUDA device(s)",
                       ordinal, device_count);
    struct cuda_device *d = &devices[ordinal];
    pthread_mutex_lock(&dev_lock);
    st = prepare(d, ordinal, kernels, msg);
    pthread_mutex_unlock(&dev_lock);
    if (st != ODMA_OK)
        return st;
    *prev = NULL;
    cu.CtxGetCurrent(prev);
    CUresult r = cu.CtxSetCurrent(d->ctx);
    if (r != CUDA_SUCCESS)
        return cu_fail(msg, r, "cuCtxSetCurrent");
    *out = d;
    return ODMA_OK;
}

static int leave(CUcontext prev, int status)
{
    cu.CtxSetCurrent(prev);
    return status;
}

/* ---- ABI ---- */
int odma_cuda_init(int *count, char *msg)
{
    if (count)
        *count = 0;
    int st = ensure_loaded(msg);
    if (st == ODMA_OK && count)
        *count = device_count;
    return st;
}

int odma_cuda_device_info(int ordinal, odma_devinfo *info, char *msg)
{
    if (!info)
        return odma_set_msg(msg, ODMA_EINVAL, "info is NULL");
    struct cuda_device *d;
    CUcontext prev;
    int st = enter(ordinal, 0, &d, &prev, msg);
    if (st != ODMA_OK)
        return st;
    CUresult r;
    memset(info, 0, sizeof *info);
    if ((r = cu.DeviceGetName(info->name, (int)sizeof info->name, d->dev)) != CUDA_SUCCESS)
        return leave(prev, cu_fail(msg, r, "cuDeviceGetName"));
    info->name[sizeof info->name - 1] = '\0';
    if ((r = cu.DeviceTotalMem(&info->total_bytes, d->dev)) != CUDA_SUCCESS)
        return leave(prev, cu_fail(msg, r, "cuDeviceTotalMem_v2"));
    size_t free_b = 0, total_b = 0;
    if ((r = cu.MemGetInfo(&free_b, &total_b)) != CUDA_SUCCESS)
        return leave(prev, cu_fail(msg, r, "cuMemGetInfo_v2"));
    info->free_bytes = free_b;
    int l2 = 0;
    /* attributes a device does not report stay 0 ("unknown"), they are not errors */
    cu.DeviceGetAttribute(&info->mem_clock_khz, ATTR_MEMORY_CLOCK_RATE, d->dev);
    cu.DeviceGetAttribute(&info->bus_width_bits, ATTR_GLOBAL_MEMORY_BUS_WIDTH, d->dev);
    cu.DeviceGetAttribute(&l2, ATTR_L2_CACHE_SIZE, d->dev);
    cu.DeviceGetAttribute(&info->compute_units, ATTR_MULTIPROCESSOR_COUNT, d->dev);
    cu.DeviceGetAttribute(&info->cc_major, ATTR_COMPUTE_CAPABILITY_MAJOR, d->dev);
    cu.DeviceGetAttribute(&info->cc_minor, ATTR_COMPUTE_CAPABILITY_MINOR, d->dev);
    info->l2_bytes = l2 > 0 ? (size_t)l2 : 0;
    /* memory clock (kHz) x bus width (bits) / 8 x 2 (double data rate) */
    info->peak_gbps = (double)info->mem_clock_khz * 1e3 * info->bus_width_bits / 8.0 * 2.0 / 1e9;
    info->runtime_version = driver_version;
    return leave(prev, ODMA_OK);
}

int odma_cuda_alloc(int ordinal, size_t bytes, uint64_t *dptr, char *msg)
{
    if (!dptr || bytes == 0)
        return odma_set_msg(msg, ODMA_EINVAL, "cuda alloc: need bytes > 0 and an output pointer");
    *dptr = 0;
    struct cuda_device *d;
    CUcontext prev;
    int st = enter(ordinal, 0, &d, &prev, msg);
    if (st != ODMA_OK)
        return st;
    CUdeviceptr p = 0;
    CUresult r = cu.MemAlloc(&p, bytes);
    if (r != CUDA_SUCCESS) {
        char call[64];
        snprintf(call, sizeof call, "cuMemAlloc_v2(%zu B)", bytes);
        return leave(prev, cu_fail(msg, r, call));
    }
    *dptr = p;
    return leave(prev, ODMA_OK);
}

int odma_cuda_free(int ordinal, uint64_t dptr, char *msg)
{
    if (!dptr)
        return odma_set_msg(msg, ODMA_EINVAL, "cuda free: null device address");
    struct cuda_device *d;
    CUcontext prev;
    int st = enter(ordinal, 0, &d, &prev, msg);
    if (st != ODMA_OK)
        return st;
    CUresult r = cu.MemFree(dptr);
    return leave(prev, r == CUDA_SUCCESS ? ODMA_OK : cu_fail(msg, r, "cuMemFree_v2"));
}

int odma_cuda_write(int ordinal, uint64_t dst, const void *src, size_t bytes, char *msg)
{
    if (bytes == 0)
        return ODMA_OK;
    if (!dst || !src)
        return odma_set_msg(msg, ODMA_EINVAL, "cuda write: null address");
    struct cuda_device *d;
    CUcontext prev;
    int st = enter(ordinal, 0, &d, &prev, msg);
    if (st != ODMA_OK)
        return st;
    CUresult r = cu.MemcpyHtoD(dst, src, bytes);
    return leave(prev, r == CUDA_SUCCESS ? ODMA_OK : cu_fail(msg, r, "cuMemcpyHtoD_v2"));
}

int odma_cuda_read(int ordinal, void *dst, uint64_t src, size_t bytes, char *msg)
{
    if (bytes == 0)
        return ODMA_OK;
    if (!dst || !src)
        return odma_set_msg(msg, ODMA_EINVAL, "cuda read: null address");
    struct cuda_device *d;
    CUcontext prev;
    int st = enter(ordinal, 0, &d, &prev, msg);
    if (st != ODMA_OK)
        return st;
    CUresult r = cu.MemcpyDtoH(dst, src, bytes);
    return leave(prev, r == CUDA_SUCCESS ? ODMA_OK : cu_fail(msg, r, "cuMemcpyDtoH_v2"));
}

/* ---- timing: `n` intervals between n + 1 events recorded on one stream ---- */
struct timing {
    CUstream stream;
    CUevent *events;
    int n;
};

static int timing_open(struct timing *t, int n, char *msg)
{
    CUresult r;
    memset(t, 0, sizeof *t);
    t->events = calloc((size_t)n + 1, sizeof *t->events);
    if (!t->events)
        return odma_set_msg(msg, ODMA_ENOMEM, "out of host memory");
    if ((r = cu.StreamCreate(&t->stream, CU_STREAM_NON_BLOCKING)) != CUDA_SUCCESS)
        return cu_fail(msg, r, "cuStreamCreate");
    for (int i = 0; i <= n; ++i) {
        if ((r = cu.EventCreate(&t->events[i], CU_EVENT_DEFAULT)) != CUDA_SUCCESS)
            return cu_fail(msg, r, "cuEventCreate");
        t->n = i + 1; /* events created so far, for timing_close */
    }
    return ODMA_OK;
}

static void timing_close(struct timing *t)
{
    for (int i = 0; i < t->n; ++i)
        cu.EventDestroy(t->events[i]);
    if (t->stream)
        cu.StreamDestroy(t->stream);
    free(t->events);
}

/* seconds[i] = time between events i and i + 1 (after waiting for the last one) */
static int timing_read(struct timing *t, int n, double *seconds, char *msg)
{
    CUresult r = cu.EventSynchronize(t->events[n]);
    if (r != CUDA_SUCCESS)
        return cu_fail(msg, r, "cuEventSynchronize (kernel or copy failed)");
    for (int i = 0; i < n; ++i) {
        float ms = 0;
        if ((r = cu.EventElapsedTime(&ms, t->events[i], t->events[i + 1])) != CUDA_SUCCESS)
            return cu_fail(msg, r, "cuEventElapsedTime");
        seconds[i] = ms * 1e-3;
    }
    return ODMA_OK;
}

int odma_cuda_copy(int ordinal, uint64_t dst, uint64_t src, size_t bytes, double *seconds, char *msg)
{
    if (seconds)
        *seconds = 0;
    if (bytes == 0)
        return ODMA_OK;
    if (!dst || !src)
        return odma_set_msg(msg, ODMA_EINVAL, "cuda copy: null device address");
    if (dst < src + bytes && src < dst + bytes)
        return odma_set_msg(msg, ODMA_EINVAL, "cuda copy: source and destination overlap");
    struct cuda_device *d;
    CUcontext prev;
    int st = enter(ordinal, 0, &d, &prev, msg);
    if (st != ODMA_OK)
        return st;
    struct timing t;
    double s = 0;
    CUresult r;
    if ((st = timing_open(&t, 1, msg)) != ODMA_OK)
        goto out;
    if ((r = cu.EventRecord(t.events[0], t.stream)) != CUDA_SUCCESS ||
        (r = cu.MemcpyDtoDAsync(dst, src, bytes, t.stream)) != CUDA_SUCCESS ||
        (r = cu.EventRecord(t.events[1], t.stream)) != CUDA_SUCCESS) {
        st = cu_fail(msg, r, "cuMemcpyDtoDAsync_v2");
        goto out;
    }
    if ((st = timing_read(&t, 1, &s, msg)) == ODMA_OK && seconds)
        *seconds = s;
out:
    timing_close(&t);
    return leave(prev, st);
}

/* ---- measurement ---- */
/* One kernel launch with its argument list, chosen by the pattern. */
struct launch {
    CUfunction f;
    void *args[8];
    /* argument storage (args[] points here) */
    CUdeviceptr a_buf, a_dst, a_sink;
    unsigned long long a_n, a_ngran, a_accesses, a_seed;
    unsigned a_passes, a_magic, a_group, a_vecs;
};

/* Arguments for `pattern`; fills out->bytes and out->method. */
static int plan(struct cuda_device *d, struct launch *L, uint64_t buf, size_t bytes, int pattern,
                size_t granule, size_t work, uint64_t seed, CUdeviceptr sink, odma_result *out,
                char *msg)
{
    memset(L, 0, sizeof *L);
    L->a_buf = buf;
    L->a_sink = sink;
    L->a_magic = (unsigned)((seed * 0x9E3779B97F4A7C15ULL) >> 32) | 1u;
    if (pattern == ODMA_PAT_READ || pattern == ODMA_PAT_COPY) {
        /* one pass = the buffer (read) or its first half copied onto its second half (copy) */
        unsigned long long n16 = pattern == ODMA_PAT_READ ? bytes / 16 : bytes / 32;
        double per_pass = (pattern == ODMA_PAT_READ ? 16.0 : 32.0) * (double)n16;
        unsigned long long passes = 1;
        if (n16 == 0)
            return odma_set_msg(msg, ODMA_EINVAL, "buffer of %zu B is too small for pattern %d", bytes,
                           pattern);
        if (work && work >= per_pass) {
            passes = (unsigned long long)(work / per_pass);
        } else if (work) { /* less than one pass: a prefix of the buffer */
            n16 = pattern == ODMA_PAT_READ ? work / 16 : work / 32;
            if (n16 == 0)
                n16 = 1;
            per_pass = (pattern == ODMA_PAT_READ ? 16.0 : 32.0) * (double)n16;
        }
        if (passes > 0xFFFFFFFFull)
            return odma_set_msg(msg, ODMA_EINVAL, "work_bytes %zu is too large", work);
        L->a_n = n16;
        L->a_passes = (unsigned)passes;
        out->bytes = per_pass * (double)passes;
        if (pattern == ODMA_PAT_READ) {
            L->f = d->f_read;
            L->args[0] = &L->a_buf, L->args[1] = &L->a_n, L->args[2] = &L->a_passes;
            L->args[3] = &L->a_sink, L->args[4] = &L->a_magic;
            snprintf(out->method, sizeof out->method, "ptx-read (16 B loads, grid-stride)");
        } else {
            L->a_dst = buf + 16 * n16;
            L->f = d->f_copy;
            L->args[0] = &L->a_dst, L->args[1] = &L->a_buf, L->args[2] = &L->a_n;
            L->args[3] = &L->a_passes;
            snprintf(out->method, sizeof out->method, "ptx-copy (16 B vectors, counted 2x)");
        }
        return ODMA_OK;
    }
    /* random: granule-aligned granules of the whole buffer, indices from an inline PRNG */
    if (!odma_is_pow2(granule) || granule < ODMA_MIN_GRANULE || granule > bytes)
        return odma_set_msg(msg, ODMA_EINVAL, "granule %zu must be a power of two in [%d, %zu]",
                            granule, ODMA_MIN_GRANULE, bytes);
    L->a_ngran = bytes / granule;
    L->a_accesses = work ? work / granule : L->a_ngran;
    if (L->a_accesses == 0)
        L->a_accesses = 1;
    L->a_seed = seed;
    out->bytes = (double)L->a_accesses * (double)granule;
    if (granule == 8) {
        L->f = d->f_gather8;
        L->args[0] = &L->a_buf, L->args[1] = &L->a_ngran, L->args[2] = &L->a_accesses;
        L->args[3] = &L->a_seed, L->args[4] = &L->a_sink, L->args[5] = &L->a_magic;
        snprintf(out->method, sizeof out->method, "ptx-gather (8 B loads, 1 thread/granule)");
    } else {
        /* 16..512 B: granule/16 threads, one 16-B vector each; larger: a warp, granule/512 each */
        L->a_group = granule / 16 < 32 ? (unsigned)(granule / 16) : 32u;
        L->a_vecs = (unsigned)(granule / 16 / L->a_group);
        L->f = d->f_gather16;
        L->args[0] = &L->a_buf, L->args[1] = &L->a_ngran, L->args[2] = &L->a_group;
        L->args[3] = &L->a_vecs, L->args[4] = &L->a_accesses, L->args[5] = &L->a_seed;
        L->args[6] = &L->a_sink, L->args[7] = &L->a_magic;
        snprintf(out->method, sizeof out->method, "ptx-gather (16 B loads, %u threads/granule)",
                 L->a_group);
    }
    return ODMA_OK;
}

int odma_cuda_measure(int ordinal, uint64_t buf, size_t bytes, int pattern, size_t granule, int reps,
                      size_t work_bytes, uint64_t seed, odma_result *out, char *msg)
{
    if (!out)
        return odma_set_msg(msg, ODMA_EINVAL, "result is NULL");
    memset(out, 0, sizeof *out);
    if (!buf || buf % 16)
        return odma_set_msg(msg, ODMA_EINVAL, "cuda measure: buffer address must be non-null and 16-B aligned");
    if (pattern != ODMA_PAT_READ && pattern != ODMA_PAT_COPY && pattern != ODMA_PAT_RAND)
        return odma_set_msg(msg, ODMA_EINVAL, "unknown pattern %d", pattern);
    if (reps < 1 || reps > ODMA_MAX_REPS)
        return odma_set_msg(msg, ODMA_EINVAL, "reps must be in [1, %d], got %d", ODMA_MAX_REPS, reps);
    struct cuda_device *d;
    CUcontext prev;
    int st = enter(ordinal, 1, &d, &prev, msg);
    if (st != ODMA_OK)
        return st;

    struct launch L;
    struct timing t = {0};
    CUdeviceptr sink = 0;
    double *seconds = calloc((size_t)reps, sizeof *seconds);
    CUresult r;
    if (!seconds) {
        st = odma_set_msg(msg, ODMA_ENOMEM, "out of host memory");
        goto out;
    }
    if ((r = cu.MemAlloc(&sink, 256)) != CUDA_SUCCESS) {
        st = cu_fail(msg, r, "cuMemAlloc_v2 (sink)");
        goto out;
    }
    if ((st = plan(d, &L, buf, bytes, pattern, granule, work_bytes, seed, sink, out, msg)) != ODMA_OK)
        goto out;
    if ((st = timing_open(&t, reps, msg)) != ODMA_OK)
        goto out;
    /* one untimed warm-up (JIT, lazy loading, TLB), then reps back-to-back between events */
    for (int i = -1; i < reps; ++i) {
        if (i >= 0 && (r = cu.EventRecord(t.events[i], t.stream)) != CUDA_SUCCESS) {
            st = cu_fail(msg, r, "cuEventRecord");
            goto out;
        }
        r = cu.LaunchKernel(L.f, (unsigned)d->blocks, 1, 1, BLOCK, 1, 1, 0, t.stream, L.args, NULL);
        if (r != CUDA_SUCCESS) {
            st = cu_fail(msg, r, "cuLaunchKernel");
            goto out;
        }
    }
    if ((r = cu.EventRecord(t.events[reps], t.stream)) != CUDA_SUCCESS) {
        st = cu_fail(msg, r, "cuEventRecord");
        goto out;
    }
    if ((st = timing_read(&t, reps, seconds, msg)) != ODMA_OK)
        goto out;
    odma_summarise_times(seconds, reps, out);  /* out->threads stays 0: a device */
out:
    if (t.events)
        timing_close(&t);
    if (sink)
        cu.MemFree(sink);
    free(seconds);
    return leave(prev, st);
}
