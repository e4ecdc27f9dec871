// launch_floor_host.cpp times launch_floor.cu's kernels in chains as
// `bench` times a GEMV: 20 launches captured into a graph (with the
// programmatic-dependent-launch attribute where a row says pdl), the graph
// replayed, the time a launch the median replay over 20; each link reads
// the weight copy i mod C (C copies exceeding L2 three times) and x/y swap
// between two rows of K floats. Prints one row a configuration: µs a link
// and, for the streaming links (register loads, then the bulk copies),
// the % of the copy bandwidth (2 × 1 GiB of a device-to-device copy / its
// time, as `bench`) of bytes + 8·K over that time; last, one launch's read
// bandwidth over 16 4-bit 4096² weights' bytes. Chains whose links share
// the copies' bytes evenly; a real GEMV's rows per block differ. On the
// GPU machine:
//     nvcc -cubin -O3 -std=c++17 -arch=sm_90a -o /tmp/launch_floor.cubin kernels/exp/launch_floor.cu
//     nvcc -O2 -o /tmp/launch_floor kernels/exp/launch_floor_host.cpp -lcuda && /tmp/launch_floor /tmp/launch_floor.cubin
#include <algorithm>
#include <cstring>
#include <vector>
#include "cu_host.h"

static CUresult time_chain(CUfunction fn, int grid, bool pdl, const std::vector<CUdeviceptr>& ws, long nw,
                           CUdeviceptr xy[2], int K, double* us, int per = 0) {
    CUstream st;
    CUresult r;
    if ((r = cuStreamCreate(&st, CU_STREAM_NON_BLOCKING))) return r;
    const int links = 20;
    auto queue = [&](int i) {
        CUdeviceptr w = ws.empty() ? 0 : ws[i % ws.size()];
        CUdeviceptr x = xy[i % 2], y = xy[(i + 1) % 2];
        void* args[] = {&w, &nw, &x, &y, &K, &per};  // the link kernels take the first five
        CUlaunchAttribute at;
        at.id = CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        at.value.programmaticStreamSerializationAllowed = 1;
        CUlaunchConfig c = {};
        c.gridDimX = grid, c.gridDimY = 1, c.gridDimZ = 1;
        c.blockDimX = 256, c.blockDimY = 1, c.blockDimZ = 1;
        c.sharedMemBytes = per ? 16384 + per : 4 * K;
        c.hStream = st;
        c.attrs = pdl ? &at : nullptr;
        c.numAttrs = pdl ? 1 : 0;
        return cuLaunchKernelEx(&c, fn, args, nullptr);
    };
    for (int i = 0; i < links; i++)  // uncaptured warm-up
        if ((r = queue(i))) return r;
    if ((r = cuStreamBeginCapture(st, CU_STREAM_CAPTURE_MODE_GLOBAL))) return r;
    for (int i = 0; i < links; i++)
        if ((r = queue(i))) return r;
    CUgraph g;
    CUgraphExec ge;
    if ((r = cuStreamEndCapture(st, &g)) || (r = cuGraphInstantiateWithFlags(&ge, g, 0))) return r;
    CUevent e0, e1;
    cuEventCreate(&e0, 0);
    cuEventCreate(&e1, 0);
    std::vector<double> t;
    for (int rep = 0; rep < 23; rep++) {
        cuEventRecord(e0, st);
        if ((r = cuGraphLaunch(ge, st))) return r;
        cuEventRecord(e1, st);
        if ((r = cuEventSynchronize(e1))) return r;
        float ms;
        cuEventElapsedTime(&ms, e0, e1);
        if (rep >= 3) t.push_back(1e3 * ms / links);
    }
    std::sort(t.begin(), t.end());
    *us = t[t.size() / 2];
    cuGraphExecDestroy(ge);
    cuGraphDestroy(g);
    cuEventDestroy(e0);
    cuEventDestroy(e1);
    cuStreamDestroy(st);
    return CUDA_SUCCESS;
}

int main(int argc, char** argv) {
    CUmodule mod;
    CK(module_arg(argc, argv, "launch_floor.cubin", &mod));
    CUdevice dv;
    CK(cuDeviceGet(&dv, 0));
    int l2 = 0, sms = 0;
    CK(cuDeviceGetAttribute(&l2, CU_DEVICE_ATTRIBUTE_L2_CACHE_SIZE, dv));
    CK(cuDeviceGetAttribute(&sms, CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT, dv));
    // copy bandwidth as bench measures it
    double copyBps;
    {
        size_t n = 1ull << 30;
        CUdeviceptr a, b;
        CK(cuMemAlloc(&a, n));
        CK(cuMemAlloc(&b, n));
        CK(cuMemsetD32(a, 0x3f800000u, n / 4));
        CUevent e0, e1;
        cuEventCreate(&e0, 0);
        cuEventCreate(&e1, 0);
        for (int i = 0; i < 3; i++) CK(cuMemcpyDtoDAsync(b, a, n, 0));
        cuEventRecord(e0, 0);
        for (int i = 0; i < 20; i++) CK(cuMemcpyDtoDAsync(b, a, n, 0));
        cuEventRecord(e1, 0);
        CK(cuEventSynchronize(e1));
        float ms;
        cuEventElapsedTime(&ms, e0, e1);
        copyBps = 2.0 * n / (ms / 1e3 / 20);
        cuMemFree(a);
        cuMemFree(b);
    }
    printf("device: %d SMs, L2 %d bytes; copy %.0f GB/s (read + write)\n", sms, l2, copyBps / 1e9);
    const int K = 4096;
    CUdeviceptr xy[2];
    for (auto& p : xy) {
        CK(cuMemAlloc(&p, 4 * K));
        CK(cuMemsetD32(p, 0x3f800000u, K));
    }
    auto fn = [&](const char* name, CUfunction* f) {
        CUresult r = cuModuleGetFunction(f, mod, name);
        if (r == CUDA_SUCCESS) r = cuFuncSetAttribute(*f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 4 * K);
        return r;
    };
    std::vector<CUdeviceptr> none;
    // the fixed cost: empty links and x's stage alone
    struct Fixed {
        const char* name;
        int grid;
        bool pdl;
    } fixed[] = {{"empty_plain", 1, false},   {"empty_plain", 2 * sms, false}, {"empty_pdl", 1, true},
                 {"empty_pdl", 2 * sms, true}, {"link_u0", K / 16, false},      {"link_u0", K / 16, true},
                 {"link_u0_early", K / 16, true}};
    for (auto& c : fixed) {
        CUfunction f;
        CK(fn(c.name, &f));
        double us;
        CK(time_chain(f, c.grid, c.pdl, none, 0, xy, K, &us));
        printf("fixed %-12s grid %4d %s: %.2f us a link\n", c.name, c.grid, c.pdl ? "pdl  " : "plain", us);
    }
    // streaming links of the 4 096² products' bytes and of 4-bit down's
    struct Shape {
        const char* name;
        long bytes;
    } shapes[] = {{"q4 4096x4096 g128", 4096L * 4096 / 2 + 4096L * 32 * 4},
                  {"q8 4096x4096 g128", 4096L * 4096 + 4096L * 32 * 8},
                  {"q4 4096x14336 g128", 4096L * 14336 / 2 + 4096L * 112 * 4},
                  {"q4 11008x4096 g128", 11008L * 4096 / 2 + 11008L * 32 * 4}};
    const char* forms[] = {"link_u4_ahead", "link_u4_after", "link_u4_early",  "link_u8_ahead",
                           "link_u8_after", "link_u8_early", "link_u16_ahead", "link_u16_after",
                           "link_u16_early"};
    const int us_of[] = {4, 4, 4, 8, 8, 8, 16, 16, 16};
    const int nforms = 9;
    for (auto& s : shapes) {
        long nw = (s.bytes + 15) / 16;
        int copies = (int)std::min<long>(16, std::max<long>(2, (3L * l2 + s.bytes - 1) / s.bytes));
        std::vector<CUdeviceptr> ws(copies);
        for (auto& p : ws) {
            CK(cuMemAlloc(&p, nw * 16));
            CK(cuMemsetD32(p, 0x01020304u, nw * 4));
        }
        for (int i = 0; i < nforms; i++) {
            CUfunction f;
            CK(fn(forms[i], &f));
            int grid = (int)((nw + 256L * us_of[i] - 1) / (256L * us_of[i]));
            for (bool pdl : {true, false}) {
                if (!pdl && strstr(forms[i], "early")) continue;  // early is a PDL form
                double us;
                CK(time_chain(f, grid, pdl, ws, nw, xy, K, &us));
                double pct = 100.0 * (s.bytes + 8.0 * K) / (us * 1e-6) / copyBps;
                printf("stream %-18s %-15s grid %4d %s: %.2f us a link, %.1f %% of copy (%d copies)\n", s.name,
                       forms[i], grid, pdl ? "pdl  " : "plain", us, pct, copies);
            }
        }
        // the bulk-copy forms: each block's run of w in flight before the wait
        for (const char* name : {"bulk_ahead", "bulk_early"}) {
            CUfunction f;
            CK(cuModuleGetFunction(&f, mod, name));
            for (long blocks : {(long)sms, 2L * sms, (s.bytes + 65535) / 65536, (s.bytes + 32767) / 32768}) {
                int per = (int)(((s.bytes + blocks - 1) / blocks + 15) & ~15L);
                if (16384 + per > 232448) continue;
                int grid = (int)((s.bytes + per - 1) / per);
                CK(cuFuncSetAttribute(f, CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, 16384 + per));
                double us;
                CK(time_chain(f, grid, true, ws, nw * 16, xy, K, &us, per));
                double pct = 100.0 * (s.bytes + 8.0 * K) / (us * 1e-6) / copyBps;
                printf("stream %-18s %-15s grid %4d pdl  : %.2f us a link, %.1f %% of copy (%d bytes a block)\n",
                       s.name, name, grid, us, pct, per);
            }
        }
        for (auto p : ws) cuMemFree(p);
    }
    // the read bandwidth of one launch over many copies' bytes (no chain's fixed cost to speak of)
    {
        long bytes = 16L * (4096L * 4096 / 2 + 4096L * 32 * 4);
        long nw = bytes / 16;
        std::vector<CUdeviceptr> big(1);
        CK(cuMemAlloc(&big[0], bytes));
        CK(cuMemsetD32(big[0], 0x01020304u, bytes / 4));
        CUfunction f;
        CK(fn("link_u8_after", &f));
        double us;
        CK(time_chain(f, (int)((nw + 2047) / 2048), true, big, nw, xy, K, &us));
        printf("read %ld bytes in one launch: %.2f us, %.0f GB/s, %.1f %% of copy\n", bytes, us, bytes / (us * 1e3),
               100.0 * bytes / (us * 1e-6) / copyBps);
        cuMemFree(big[0]);
    }
    return 0;
}
