// attn_form_host.cpp times the forms of attn_form.cu (see there): 20 launches
// to warm up, then 200 back to back between two events, twice, a line each.
// The split of the keys is runtime/cuda's attnSplit on 132 multiprocessors.
#include <algorithm>
#include <cmath>

#include "cu_host.h"
int main(int argc, char** argv) {
    CUmodule mod;
    CK(module_arg(argc, argv, "attn_form.ptx", &mod));
    const char* names[] = {"attn_tc_f16_h", "attn_tc_f16_q", "at_mul", "at_cast", "attn_tc_f16_q"};
    const char* label[] = {"f16_h", "f16_q", "q_mul", "i8cast", "f16_q qs1e-3"};
    CUfunction fn[5], ff, fh;
    for (int i = 0; i < 5; i++) CK(cuModuleGetFunction(&fn[i], mod, names[i]));
    CK(cuModuleGetFunction(&ff, mod, "af_fillf"));
    CK(cuModuleGetFunction(&fh, mod, "af_fillh"));
    int smem = (2 * 64 * 136 + 2 * 128 * 72) * 2;  // runtime/cuda's attnTCSmem
    for (int i = 0; i < 4; i++) CK(cuFuncSetAttribute(fn[i], CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, smem));
    int heads = 32, hd = 128;
    for (int kvh : {32, 8})
        for (int T : {128, 512, 2048}) {
            int nq = (T + 63) / 64;
            auto tiles = [&](int i) { return (std::min(T, 64 * (i + 1)) - 1) / 64 + 1; };
            auto count = [&](int ct) {
                int u = 0;
                for (int i = 0; i < nq; i++) u += (tiles(i) + ct - 1) / ct;
                return u;
            };
            int ct = tiles(nq - 1);
            for (int c = ct - 1; c >= 1 && heads * count(c) <= 132; c--) ct = c;
            int units = count(ct);
            CUdeviceptr q, k, v, dh, dq, po, pml, cnt;
            CK(cuMemAlloc(&q, 4ull * T * heads * hd));
            CK(cuMemAlloc(&k, 2ull * T * kvh * hd));
            CK(cuMemAlloc(&v, 2ull * T * kvh * hd));
            CK(cuMemAlloc(&dh, 2ull * T * heads * hd));
            CK(cuMemAlloc(&dq, 1ull * T * heads * hd));
            CK(cuMemAlloc(&po, 4ull * 64 * hd * heads * units));
            CK(cuMemAlloc(&pml, 4ull * 64 * 2 * heads * units));
            CK(cuMemAlloc(&cnt, 4 * heads * nq));
            CK(cuMemsetD32(cnt, 0, heads * nq));
            auto fill = [&](CUfunction f, CUdeviceptr p, size_t n) {
                float a = 1.f;
                void* ar[] = {&p, &n, &a};
                return cuLaunchKernel(f, 512, 1, 1, 256, 1, 1, 0, 0, ar, 0);
            };
            CK(fill(ff, q, (size_t)T * heads * hd));
            CK(fill(fh, k, (size_t)T * kvh * hd));
            CK(fill(fh, v, (size_t)T * kvh * hd));
            float sc = 1.f / sqrtf(128.f), qo = 0.f;
            int pos0 = 0;
            CUevent e0, e1;
            CK(cuEventCreate(&e0, 0));
            CK(cuEventCreate(&e1, 0));
            for (int rep = 0; rep < 2; rep++)
                for (int var = 0; var < 5; var++) {
                    float qs = var == 4 ? 1e-3f : 1.f / 64, qinv = 1.f / qs;
                    void* ah[] = {&dh, &q, &k, &v, &T, &heads, &kvh, &pos0, &sc, &ct, &units, &po, &pml, &cnt};
                    void* aq[] = {&dq, var == 2 ? &qinv : &qs, &qo, &q, &k, &v, &T, &heads, &kvh, &pos0, &sc, &ct,
                                  &units, &po, &pml, &cnt};
                    auto go = [&]() {
                        return cuLaunchKernel(fn[var], heads, units, 1, 128, 1, 1, smem, 0, var == 0 ? ah : aq, 0);
                    };
                    for (int i = 0; i < 20; i++) CK(go());
                    CK(cuEventRecord(e0, 0));
                    for (int i = 0; i < 200; i++) CK(go());
                    CK(cuEventRecord(e1, 0));
                    CK(cuEventSynchronize(e1));
                    float ms;
                    CK(cuEventElapsedTime(&ms, e0, e1));
                    printf("kvh %2d T %4d ct %d units %3d %-13s %7.2f us\n", kvh, T, ct, units, label[var], ms * 1e3f / 200);
                }
            cuMemFree(q), cuMemFree(k), cuMemFree(v), cuMemFree(dh), cuMemFree(dq), cuMemFree(po), cuMemFree(pml),
                cuMemFree(cnt);
        }
    return 0;
}
