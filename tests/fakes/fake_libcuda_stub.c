/* fake_libcuda_stub.c - behaves like the CUDA toolkit's stub libcuda.so (lib64/stubs), for machines
 * whose toolkit does not ship one: cuInit answers CUDA_ERROR_STUB_LIBRARY (34), as the real stub
 * does when no NVIDIA driver is installed. FAKE_CUDA_INIT_RESULT overrides the code (100 =
 * CUDA_ERROR_NO_DEVICE: a driver without a GPU). Nothing else is exported, so a shim that called
 * anything before cuInit succeeded would fail to find it rather than crash on it.
 */
#include <stdlib.h>

__attribute__((visibility("default"))) int cuInit(unsigned int flags)
{
    (void)flags;
    const char *s = getenv("FAKE_CUDA_INIT_RESULT");
    return s && *s ? atoi(s) : 34;
}
