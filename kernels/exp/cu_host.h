// cu_host.h: what the experiments' driver-API hosts share (attn_form_host.cpp,
// silu_div_host.cpp, launch_floor_host.cpp): CK, which prints a failed driver call and returns
// CK_FAIL from the function (1 unless defined before), load_module,
// which makes device 0's primary context current and loads a PTX or
// cubin file into it, and module_arg, a host's first argument so loaded.
#pragma once
#include <cuda.h>

#include <cstdio>
#ifndef CK_FAIL
#define CK_FAIL 1
#endif
#define CK(x)                                      \
    do {                                           \
        CUresult r_ = (x);                         \
        if (r_) {                                  \
            const char* m;                         \
            cuGetErrorString(r_, &m);              \
            printf("%s: %s\n", #x, m);             \
            return CK_FAIL;                        \
        }                                          \
    } while (0)
static CUresult load_module(const char* path, CUmodule* mod) {
    CUdevice dv;
    CUcontext cx;
    CUresult r;
    if ((r = cuInit(0)) || (r = cuDeviceGet(&dv, 0)) || (r = cuDevicePrimaryCtxRetain(&cx, dv)) ||
        (r = cuCtxSetCurrent(cx)))
        return r;
    return cuModuleLoad(mod, path);
}
// module_arg loads the module named by a host's first argument (what:
// the file it expects, for the usage line, printed where there is none
// and answered with CUDA_ERROR_INVALID_VALUE), for CK.
static CUresult module_arg(int argc, char** argv, const char* what, CUmodule* mod) {
    if (argc < 2) {
        printf("usage: %s %s\n", argv[0], what);
        return CUDA_ERROR_INVALID_VALUE;
    }
    return load_module(argv[1], mod);
}
