// silu_div_host.cpp runs silu_div.cu's check (see there) for u = 1 and 3;
// its exit status is the number of u with a mismatch (100: a driver call
// failed).
#include <cstring>
#include <initializer_list>
#define CK_FAIL 100
#include "cu_host.h"
int main(int argc, char** argv) {
    CUmodule mod;
    CK(module_arg(argc, argv, "silu_div.cubin", &mod));
    CUfunction fn;
    CK(cuModuleGetFunction(&fn, mod, "silu_check"));
    CUdeviceptr bad, first;
    CK(cuMemAlloc(&bad, 8));
    CK(cuMemAlloc(&first, 48 * 4));
    int fails = 0;
    for (float u : {1.f, 3.f}) {
        CK(cuMemsetD8(bad, 0, 8));
        void* args[] = {&bad, &first, &u};
        CK(cuLaunchKernel(fn, 132 * 16, 1, 1, 256, 1, 1, 0, nullptr, args, nullptr));
        unsigned long long n = 0;
        unsigned f[48];
        CK(cuMemcpyDtoH(&n, bad, 8));
        CK(cuMemcpyDtoH(f, first, sizeof f));
        printf("u = %g: %llu of 2^32 values of g differ\n", u, n);
        for (unsigned long long k = 0; k < n && k < 16; k++) {
            float g, a, b;
            memcpy(&g, &f[3 * k], 4);
            memcpy(&a, &f[3 * k + 1], 4);
            memcpy(&b, &f[3 * k + 2], 4);
            printf("  g %08x (%g): silu_times %08x (%g), division %08x (%g)\n", f[3 * k], g, f[3 * k + 1], a,
                   f[3 * k + 2], b);
        }
        fails += n != 0;
    }
    return fails;
}
