// kernels.cu - source of the PTX that native/cuda.c embeds from native/kernels_ptx.h (the shim's
// build never runs nvcc).
//
// CUDA 13's nvcc emits .version 9.x / .target sm_75, which older drivers reject; the shim ships the
// lowest ISA that every supported driver accepts (.version 6.4, .target sm_52), so the header is
// lowered after compiling. After editing this file, regenerate kernels_ptx.h with
//
//   .venv/bin/python native/regen_ptx.py        (nvcc -ptx, lower the header, check with ptxas for
//                                                 sm_75 and sm_90, rewrite kernels_ptx.h)
//
// tests/test_cuda.py checks that the embedded PTX assembles and still matches this file.
//
// Every kernel keeps its loads alive by folding them into an accumulator that is stored only when it
// equals `magic`, a value the host picks at run time, so the store (almost) never happens and costs
// no bandwidth, yet the compiler cannot remove a single load.
#include <stdint.h>

#define BLOCK 256

/* Sequential read of n16 16-byte vectors, `passes` times; grid-stride so each warp's loads are
 * contiguous (coalesced), four independent loads in flight per thread. */
extern "C" __global__ void __launch_bounds__(BLOCK, 4)
odma_read(const uint4 *__restrict__ p, unsigned long long n16, unsigned passes, unsigned *sink,
          unsigned magic)
{
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned acc = 0;
    for (unsigned pass = 0; pass < passes; ++pass) {
        unsigned long long i = first;
        for (; i + 3 * stride < n16; i += 4 * stride) {
            uint4 a = p[i], b = p[i + stride], c = p[i + 2 * stride], d = p[i + 3 * stride];
            acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
            acc ^= c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
        }
        for (; i < n16; i += stride) {
            uint4 a = p[i];
            acc ^= a.x ^ a.y ^ a.z ^ a.w;
        }
    }
    if (acc == magic)
        sink[0] = acc;
}

/* Sequential copy of n16 16-byte vectors from src to dst, `passes` times. */
extern "C" __global__ void __launch_bounds__(BLOCK, 4)
odma_copy(uint4 *__restrict__ dst, const uint4 *__restrict__ src, unsigned long long n16,
          unsigned passes)
{
    const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    for (unsigned pass = 0; pass < passes; ++pass) {
        unsigned long long i = first;
        for (; i + 3 * stride < n16; i += 4 * stride) {
            uint4 a = src[i], b = src[i + stride], c = src[i + 2 * stride], d = src[i + 3 * stride];
            dst[i] = a;
            dst[i + stride] = b;
            dst[i + 2 * stride] = c;
            dst[i + 3 * stride] = d;
        }
        for (; i < n16; i += stride)
            dst[i] = src[i];
    }
}

/* xorshift64* step: cheap, good enough to defeat any prefetcher, no memory traffic of its own. */
__device__ __forceinline__ unsigned long long next_random(unsigned long long *state)
{
    unsigned long long x = *state;
    x ^= x >> 12;
    x ^= x << 25;
    x ^= x >> 27;
    *state = x;
    return x * 0x2545F4914F6CDD1DULL;
}

/* splitmix64 finaliser: turns (seed, group) into independent starting states. */
__device__ __forceinline__ unsigned long long mix64(unsigned long long z)
{
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return z ? z : 0x9E3779B97F4A7C15ULL; /* xorshift must not start at 0 */
}

/* Random reads of 8-byte granules: one 8-byte load per access, four accesses in flight per thread.
 * Granule index = high 64 bits of random x ngran, uniform over [0, ngran). */
extern "C" __global__ void __launch_bounds__(BLOCK, 4)
odma_gather8(const uint2 *__restrict__ p, unsigned long long ngran, unsigned long long accesses,
             unsigned long long seed, unsigned *sink, unsigned magic)
{
    const unsigned long long nthreads = (unsigned long long)gridDim.x * blockDim.x;
    const unsigned long long id = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    unsigned long long state = mix64(seed ^ (id * 0x9E3779B97F4A7C15ULL));
    unsigned acc = 0;
    unsigned long long k = id;
    for (; k + 3 * nthreads < accesses; k += 4 * nthreads) {
        uint2 a = p[__umul64hi(next_random(&state), ngran)];
        uint2 b = p[__umul64hi(next_random(&state), ngran)];
        uint2 c = p[__umul64hi(next_random(&state), ngran)];
        uint2 d = p[__umul64hi(next_random(&state), ngran)];
        acc ^= a.x ^ a.y ^ b.x ^ b.y ^ c.x ^ c.y ^ d.x ^ d.y;
    }
    for (; k < accesses; k += nthreads) {
        uint2 a = p[__umul64hi(next_random(&state), ngran)];
        acc ^= a.x ^ a.y;
    }
    if (acc == magic)
        sink[0] = acc;
}

/* Random reads of granules of G >= 16 bytes. A group of `group` threads (a power of two <= 32, so a
 * group never straddles a warp) reads one granule together: lane l loads the 16-byte vectors
 * l, l + group, l + 2 group, ... of it (`vecs` = G / (16 group) of them), so each granule is one
 * coalesced request of exactly G bytes. All lanes of a group derive the same random stream from the
 * group number, so they agree on the granule without communicating. */
extern "C" __global__ void __launch_bounds__(BLOCK, 4)
odma_gather16(const uint4 *__restrict__ p, unsigned long long ngran, unsigned group, unsigned vecs,
              unsigned long long accesses, unsigned long long seed, unsigned *sink, unsigned magic)
{
    const unsigned long long id = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    const unsigned long long ngroups = (unsigned long long)gridDim.x * blockDim.x / group;
    const unsigned long long g = id / group;
    const unsigned lane = (unsigned)(id % group);
    const unsigned long long vecs_per_granule = (unsigned long long)group * vecs;
    unsigned long long state = mix64(seed ^ (g * 0x9E3779B97F4A7C15ULL));
    unsigned acc = 0;
    unsigned long long k = g;
    if (vecs == 1) {
        /* G <= 512: one vector per lane and access; four accesses in flight */
        for (; k + 3 * ngroups < accesses; k += 4 * ngroups) {
            uint4 a = p[__umul64hi(next_random(&state), ngran) * vecs_per_granule + lane];
            uint4 b = p[__umul64hi(next_random(&state), ngran) * vecs_per_granule + lane];
            uint4 c = p[__umul64hi(next_random(&state), ngran) * vecs_per_granule + lane];
            uint4 d = p[__umul64hi(next_random(&state), ngran) * vecs_per_granule + lane];
            acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
            acc ^= c.x ^ c.y ^ c.z ^ c.w ^ d.x ^ d.y ^ d.z ^ d.w;
        }
        for (; k < accesses; k += ngroups) {
            uint4 a = p[__umul64hi(next_random(&state), ngran) * vecs_per_granule + lane];
            acc ^= a.x ^ a.y ^ a.z ^ a.w;
        }
    } else {
        /* G >= 1 KiB: a whole warp per granule, `vecs` (even) vectors per lane, two in flight */
        for (; k < accesses; k += ngroups) {
            const uint4 *q = p + __umul64hi(next_random(&state), ngran) * vecs_per_granule + lane;
            for (unsigned v = 0; v < vecs; v += 2) {
                uint4 a = q[(unsigned long long)v * group];
                uint4 b = q[(unsigned long long)(v + 1) * group];
                acc ^= a.x ^ a.y ^ a.z ^ a.w ^ b.x ^ b.y ^ b.z ^ b.w;
            }
        }
    }
    if (acc == magic)
        sink[0] = acc;
}
