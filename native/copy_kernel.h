/* copy_kernel.h - the one streaming-copy kernel, shared by the copier (odma_copy) and the host
 * copy measurement (odma_host_measure, ODMA_PAT_COPY), so the bandwidth the probe reports is the
 * bandwidth the allocator's migration gets. Internal to the shim: not part of the ABI in odma.h.
 */
#ifndef ODMA_COPY_KERNEL_H
#define ODMA_COPY_KERNEL_H
#include <stddef.h>

/* Copies at or above this size bypass the cache with non-temporal stores: the destination would
 * not stay cached anyway, and skipping the read-for-ownership of every destination line saves a
 * third of the DRAM traffic. Below it, the data may still be in cache and plain stores win. */
#define ODMA_NT_THRESHOLD ((size_t)8 << 20)

/* Smallest piece of a copy worth its own thread. */
#define ODMA_MIN_CHUNK ((size_t)1 << 20)

/* Copy n bytes between non-overlapping ranges with one thread; `nontemporal` selects streaming
 * stores for the 64-byte-aligned body of the destination (head and tail use memcpy). Any
 * alignment and any size are exact. Does not fence: call odma_copy_fence() when done. */
__attribute__((visibility("hidden")))
void odma_copy_range(void *dst, const void *src, size_t n, int nontemporal);

/* Make earlier non-temporal stores of this thread globally visible (sfence on x86). */
__attribute__((visibility("hidden")))
void odma_copy_fence(void);

/* The instruction set the kernel uses, for result.method: "avx512", "avx", "sse2" or "memcpy". */
__attribute__((visibility("hidden")))
const char *odma_copy_isa(void);

#endif
