/* odma.h - the whole ABI of the odma-hw native shim (bound by cffi in API mode).
 *
 * Conventions
 * - Every function returns an odma status (ODMA_OK == 0) and, on failure, writes a one-line,
 *   NUL-terminated reason into `msg` (at least ODMA_MSG_LEN bytes, may be NULL).
 * - No abort(), no exit(), no global state beyond the dlopen'ed library handles.
 * - Device memory is named by a 64-bit device address (CUdeviceptr or an MLU pointer cast).
 * - Byte counting (devices.md rule 3): a read counts the bytes read, a copy counts read + write
 *   (2x the bytes copied), a random read counts granule x accesses. Write-allocate is not counted.
 *
 * The block between ODMA_CDEF_BEGIN and ODMA_CDEF_END is fed verbatim to cffi's cdef(), so it may
 * hold only declarations and integer #defines.
 */
#ifndef ODMA_H
#define ODMA_H
#include <stddef.h>
#include <stdint.h>

/* ODMA_CDEF_BEGIN */
#define ODMA_MSG_LEN 512

/* status codes */
#define ODMA_OK 0
#define ODMA_EINVAL 1     /* bad argument */
#define ODMA_ENOMEM 2     /* allocation failed (host or device) */
#define ODMA_ENOLIB 3     /* runtime library absent or a stub (no driver) */
#define ODMA_ENODEV 4     /* library present but no such device */
#define ODMA_EDEVICE 5    /* the device or its runtime failed during the call */

/* limits the entry points enforce, here so that callers check against the same numbers */
/* host threads per call (odma_host_*, odma_copy): their per-thread state lives on the stack */
#define ODMA_MAX_THREADS 256
/* Timed repetitions per measurement. One value for every backend: CUDA and CNRT hold one event or
 * notifier per repetition (reps + 1 driver objects at once), and 10000 repetitions of the 10-100 ms
 * a timed region lasts are already minutes to hours, far past what a best/median summary needs. */
#define ODMA_MAX_REPS 10000
#define ODMA_MIN_GRANULE 8    /* smallest random-access granule, bytes (one 64-bit load) */

/* access patterns for *_measure */
#define ODMA_PAT_READ 0   /* sequential read of the whole buffer */
#define ODMA_PAT_COPY 1   /* sequential copy: first half -> second half, counted 2x */
#define ODMA_PAT_RAND 2   /* independent random reads of `granule` bytes, granule-aligned */

typedef struct {
    double bytes;        /* useful bytes moved per repetition (convention above) */
    double best_s;       /* fastest timed repetition, seconds */
    double median_s;     /* median timed repetition, seconds */
    double worst_s;      /* slowest timed repetition, seconds */
    int reps;            /* timed repetitions (one untimed warm-up precedes them) */
    int threads;         /* host threads used (0 on devices) */
    char method[64];     /* how it was measured, e.g. "avx2-load", "ptx-gather", "cnrt-dma-async" */
} odma_result;

typedef struct {
    char name[256];
    size_t total_bytes;
    size_t free_bytes;
    double peak_gbps;     /* from memory clock x bus width, 0 when unknown */
    int mem_clock_khz;
    int bus_width_bits;
    size_t l2_bytes;      /* 0 when unknown */
    int compute_units;    /* SMs or MLU cores, 0 when unknown */
    int cc_major;         /* CUDA compute capability, 0 elsewhere */
    int cc_minor;
    int runtime_version;  /* driver (CUDA) or library (CNRT, major*10000+minor*100+patch) version */
} odma_devinfo;

/* ---- host DRAM (native/host.c) ---- */
/* 2 MiB-aligned buffer, madvise(MADV_HUGEPAGE), parallel first touch with `threads` threads. */
int odma_host_alloc(size_t bytes, int threads, void **ptr, char *msg);
int odma_host_free(void *ptr, size_t bytes, char *msg);
/* Bytes of [ptr, ptr+bytes) backed by transparent huge pages (from /proc/self/smaps). */
int odma_host_huge_bytes(void *ptr, size_t bytes, size_t *huge_bytes, char *msg);
/* work_bytes: useful bytes per repetition; 0 = one pass over the buffer (read, copy) or
 * `bytes` worth of random granules (rand). Random addresses cover the largest power-of-two number
 * of granules that fits in the buffer (so a mask, not a division, maps the generator's bits). */
int odma_host_measure(void *buf, size_t bytes, int pattern, size_t granule, int threads, int reps,
                      size_t work_bytes, uint64_t seed, odma_result *out, char *msg);

/* ---- streaming copier (native/copier.c): multi-threaded, chunked, non-temporal stores for
 * large copies; overlapping ranges are handled like memmove. ---- */
int odma_copy(void *dst, const void *src, size_t bytes, int threads, char *msg);

/* ---- CUDA through the driver API, libcuda loaded with dlopen (native/cuda.c) ---- */
int odma_cuda_init(int *device_count, char *msg);
int odma_cuda_device_info(int ordinal, odma_devinfo *info, char *msg);
int odma_cuda_alloc(int ordinal, size_t bytes, uint64_t *dptr, char *msg);
int odma_cuda_free(int ordinal, uint64_t dptr, char *msg);
int odma_cuda_write(int ordinal, uint64_t dst, const void *src, size_t bytes, char *msg);
int odma_cuda_read(int ordinal, void *dst, uint64_t src, size_t bytes, char *msg);
/* device-to-device copy (ranges may not overlap); seconds measured with events */
int odma_cuda_copy(int ordinal, uint64_t dst, uint64_t src, size_t bytes, double *seconds, char *msg);
int odma_cuda_measure(int ordinal, uint64_t buf, size_t bytes, int pattern, size_t granule, int reps,
                      size_t work_bytes, uint64_t seed, odma_result *out, char *msg);

/* ---- Cambricon MLU through CNRT, libcnrt loaded with dlopen (native/cnrt.c) ----
 * Looks for $NEUWARE_HOME/lib64/libcnrt.so first, then the loader's search path. */
int odma_mlu_init(int *device_count, char *msg);
int odma_mlu_device_info(int ordinal, odma_devinfo *info, char *msg);
int odma_mlu_alloc(int ordinal, size_t bytes, uint64_t *dptr, char *msg);
int odma_mlu_free(int ordinal, uint64_t dptr, char *msg);
int odma_mlu_write(int ordinal, uint64_t dst, const void *src, size_t bytes, char *msg);
int odma_mlu_read(int ordinal, void *dst, uint64_t src, size_t bytes, char *msg);
int odma_mlu_copy(int ordinal, uint64_t dst, uint64_t src, size_t bytes, double *seconds, char *msg);
/* ODMA_PAT_RAND on MLU is DMA-based (no kernel compiler): result.method says so. */
int odma_mlu_measure(int ordinal, uint64_t buf, size_t bytes, int pattern, size_t granule, int reps,
                     size_t work_bytes, uint64_t seed, odma_result *out, char *msg);
/* ODMA_CDEF_END */

#endif
