// attn_form.cu: the prefill attention's output forms timed alone (fifty-seventh
// session): attn_tc_f16_h (fp16), attn_tc_f16_q (W8A8's int8 codes; through
// quant_static when written, quant_fast since 41f6c58) and two forms only here, the codes from the product with
// the reciprocal (at_mul) and a plain cast (at_cast, no quantizer: the
// floor). Device code only (qtool.cu's Hopper kernels have no host stubs);
// attn_form_host.cpp loads its PTX with the driver API and times each form
// at 128, 512 and 2 048 tokens, 32 heads of 128, 32 and 8 KV heads:
//
//     nvcc -ptx -O3 -std=c++17 -arch=compute_90a -o /tmp/attn_form.ptx kernels/exp/attn_form.cu
//     nvcc -O2 -o /tmp/attn_form kernels/exp/attn_form_host.cpp -lcuda && /tmp/attn_form /tmp/attn_form.ptx
#include "../qtool.cu"
struct QOutMul {
    int8_t* p;
    float inv, o;
    __device__ __forceinline__ void put2(size_t i, float a, float b) const {
        *reinterpret_cast<char2*>(p + i) = make_char2((int8_t)fminf(fmaxf(roundf(a * inv + o), -128.f), 127.f),
                                                      (int8_t)fminf(fmaxf(roundf(b * inv + o), -128.f), 127.f));
    }
};
struct I8Cast {
    int8_t* p;
    __device__ __forceinline__ void put2(size_t i, float a, float b) const {
        *reinterpret_cast<char2*>(p + i) = make_char2((int8_t)a, (int8_t)b);
    }
};
#define AF_ARGS                                                                                                   \
    const float *q, const __half *kc, const __half *vc, int T, int heads, int kvHeads, int pos0, float scale, int ct, \
        int units, float *part_o, float *part_ml, int *cnt
extern "C" __global__ void __launch_bounds__(128) at_mul(int8_t* dq, float qinv, float qo, AF_ARGS) {
    attn_tc_h_body<128>(QOutMul{dq, qinv, qo}, q, kc, vc, T, heads, kvHeads, 128, pos0, scale,
                        AtSplit{ct, units, part_o, part_ml, cnt});
}
extern "C" __global__ void __launch_bounds__(128) at_cast(int8_t* dq, float qinv, float qo, AF_ARGS) {
    attn_tc_h_body<128>(I8Cast{dq}, q, kc, vc, T, heads, kvHeads, 128, pos0, scale, AtSplit{ct, units, part_o, part_ml, cnt});
}
extern "C" __global__ void af_fillf(float* p, size_t n, float a) {
    for (size_t i = blockIdx.x * 256 + threadIdx.x; i < n; i += gridDim.x * 256) p[i] = a * sinf(i * 0.7311f + 0.3f);
}
extern "C" __global__ void af_fillh(__half* p, size_t n, float a) {
    for (size_t i = blockIdx.x * 256 + threadIdx.x; i < n; i += gridDim.x * 256) p[i] = __float2half(a * cosf(i * 0.5123f + 0.1f));
}
