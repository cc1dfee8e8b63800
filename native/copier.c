/* copier.c - the streaming copier (odma_copy) and the copy kernel it shares with host.c.
 *
 * Large copies are split into one contiguous chunk per thread (a single core cannot saturate DRAM)
 * and written with non-temporal stores (no read-for-ownership of the destination, no eviction of
 * useful cache lines). Overlapping ranges keep memmove semantics: they are copied by one thread
 * with memmove, because parallel chunks of an overlapping copy would read bytes another chunk has
 * already overwritten.
 */
#define _GNU_SOURCE
#include "common.h"
#include "copy_kernel.h"

#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif


const char *odma_copy_isa(void)
{
#if defined(__AVX512F__)
    return "avx512";
#elif defined(__AVX__)
    return "avx";
#elif defined(__SSE2__)
    return "sse2";
#else
    return "memcpy";
#endif
}

void odma_copy_fence(void)
{
#if defined(__SSE2__)
    _mm_sfence();
#endif
}

/* Body of a non-temporal copy: d is 64-byte aligned, n a multiple of 256. Four lines per
 * iteration keep several loads in flight while the write-combining buffers drain. */
static void copy_body_nt(char *d, const char *s, size_t n)
{
    for (size_t i = 0; i < n; i += 256) {
#if defined(__AVX512F__)
        __m512i a = _mm512_loadu_si512((const void *)(s + i));
        __m512i b = _mm512_loadu_si512((const void *)(s + i + 64));
        __m512i c = _mm512_loadu_si512((const void *)(s + i + 128));
        __m512i e = _mm512_loadu_si512((const void *)(s + i + 192));
        _mm512_stream_si512((void *)(d + i), a);
        _mm512_stream_si512((void *)(d + i + 64), b);
        _mm512_stream_si512((void *)(d + i + 128), c);
        _mm512_stream_si512((void *)(d + i + 192), e);
#elif defined(__AVX__)
        for (size_t j = 0; j < 256; j += 128) {
            __m256i a = _mm256_loadu_si256((const __m256i *)(s + i + j));
            __m256i b = _mm256_loadu_si256((const __m256i *)(s + i + j + 32));
            __m256i c = _mm256_loadu_si256((const __m256i *)(s + i + j + 64));
            __m256i e = _mm256_loadu_si256((const __m256i *)(s + i + j + 96));
            _mm256_stream_si256((__m256i *)(d + i + j), a);
            _mm256_stream_si256((__m256i *)(d + i + j + 32), b);
            _mm256_stream_si256((__m256i *)(d + i + j + 64), c);
            _mm256_stream_si256((__m256i *)(d + i + j + 96), e);
        }
#elif defined(__SSE2__)
        for (size_t j = 0; j < 256; j += 64) {
            __m128i a = _mm_loadu_si128((const __m128i *)(s + i + j));
            __m128i b = _mm_loadu_si128((const __m128i *)(s + i + j + 16));
            __m128i c = _mm_loadu_si128((const __m128i *)(s + i + j + 32));
            __m128i e = _mm_loadu_si128((const __m128i *)(s + i + j + 48));
            _mm_stream_si128((__m128i *)(d + i + j), a);
            _mm_stream_si128((__m128i *)(d + i + j + 16), b);
            _mm_stream_si128((__m128i *)(d + i + j + 32), c);
            _mm_stream_si128((__m128i *)(d + i + j + 48), e);
        }
#else
        memcpy(d + i, s + i, 256);
#endif
    }
}

void odma_copy_range(void *dst, const void *src, size_t n, int nontemporal)
{
    char *d = dst;
    const char *s = src;
    if (!nontemporal || n < 512) {
        memcpy(d, s, n);
        return;
    }
    /* head: up to the first 64-byte boundary of the destination (streaming stores want it) */
    size_t head = (size_t)(-(uintptr_t)d & 63);
    memcpy(d, s, head);
    d += head;
    s += head;
    n -= head;
    size_t body = n & ~(size_t)255;
    copy_body_nt(d, s, body);
    memcpy(d + body, s + body, n - body);  /* tail: fewer than 256 bytes */
}

typedef struct {
    char *dst;
    const char *src;
    size_t n;
    int nontemporal;
} copy_job;

static void *copy_worker(void *arg)
{
    copy_job *job = arg;
    odma_copy_range(job->dst, job->src, job->n, job->nontemporal);
    odma_copy_fence();
    return NULL;
}

int odma_copy(void *dst, const void *src, size_t bytes, int threads, char *msg)
{
    if (threads < 1 || threads > ODMA_MAX_THREADS)
        return odma_set_msg(msg, ODMA_EINVAL, "threads must be in [1, %d], got %d", ODMA_MAX_THREADS, threads);
    if (bytes == 0)
        return ODMA_OK;  /* like memmove: copying nothing is not an error */
    if (!dst || !src)
        return odma_set_msg(msg, ODMA_EINVAL, "NULL %s pointer for a %zu-byte copy",
                    !dst ? "destination" : "source", bytes);
    uintptr_t d = (uintptr_t)dst, s = (uintptr_t)src;
    if (d + bytes < d || s + bytes < s)
        return odma_set_msg(msg, ODMA_EINVAL, "a %zu-byte range wraps around the address space", bytes);
    if (d == s)
        return ODMA_OK;
    if (d < s + bytes && s < d + bytes) {  /* overlap: memmove semantics, one thread */
        memmove(dst, src, bytes);
        return ODMA_OK;
    }

    int nontemporal = bytes >= ODMA_NT_THRESHOLD;
    size_t max_chunks = bytes / ODMA_MIN_CHUNK;
    int n = (size_t)threads < max_chunks ? threads : (int)(max_chunks ? max_chunks : 1);
    if (n == 1) {
        odma_copy_range(dst, src, bytes, nontemporal);
        odma_copy_fence();
        return ODMA_OK;
    }

    /* chunk boundaries on 4 KiB multiples so each thread owns whole pages of the destination */
    size_t chunk = ((bytes + (size_t)n - 1) / (size_t)n + 4095) & ~(size_t)4095;
    copy_job jobs[ODMA_MAX_THREADS];
    pthread_t tids[ODMA_MAX_THREADS];
    int started[ODMA_MAX_THREADS];
    int count = 0;
    for (size_t off = 0; off < bytes; off += chunk, count++) {
        jobs[count].dst = (char *)dst + off;
        jobs[count].src = (const char *)src + off;
        jobs[count].n = bytes - off < chunk ? bytes - off : chunk;
        jobs[count].nontemporal = nontemporal;
    }
    for (int i = 1; i < count; i++)
        started[i] = pthread_create(&tids[i], NULL, copy_worker, &jobs[i]) == 0;
    copy_worker(&jobs[0]);
    for (int i = 1; i < count; i++) {
        if (started[i])
            pthread_join(tids[i], NULL);
        else  /* no thread to be had: do the chunk here rather than fail half-way */
            copy_worker(&jobs[i]);
    }
    return ODMA_OK;
}
