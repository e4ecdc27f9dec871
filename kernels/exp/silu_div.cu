// silu_div.cu: silu_times (qtool.cu: silu_quot, the division without its
// branch) against the division g / (1 + e^-g) it replaces, over all 2^32
// bit patterns of g, bit for bit, u a runtime 1 and 3 (sixty-sixth
// session). Device code only (qtool.cu has no host pass); silu_div_host.cpp
// loads it with the driver API and prints the mismatches (the first few
// and their count):
//
//     nvcc -cubin -O3 -std=c++17 -arch=sm_90a -o /tmp/silu_div.cubin kernels/exp/silu_div.cu
//     nvcc -O2 -o /tmp/silu_div kernels/exp/silu_div_host.cpp -lcuda && /tmp/silu_div /tmp/silu_div.cubin
#include "../qtool.cu"

__device__ __forceinline__ float silu_times_div(float g, float u) { return g / (1.f + expf(-g)) * u; }

extern "C" __global__ void silu_check(unsigned long long* bad, unsigned* first, float u) {
    for (unsigned long long i = blockIdx.x * (unsigned long long)blockDim.x + threadIdx.x; i < (1ull << 32);
         i += (unsigned long long)gridDim.x * blockDim.x) {
        float g = __uint_as_float((unsigned)i);
        unsigned a = __float_as_uint(silu_times(g, u)), b = __float_as_uint(silu_times_div(g, u));
        if (a != b) {
            unsigned long long n = atomicAdd(bad, 1ull);
            if (n < 16) {
                first[3 * n] = (unsigned)i;
                first[3 * n + 1] = a;
                first[3 * n + 2] = b;
            }
        }
    }
}
