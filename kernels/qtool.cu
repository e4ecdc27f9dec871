// qtool CUDA kernels. Compiled to PTX by build.sh (sm_80 and sm_90), the PTX
// is committed and embedded by package kernels, and loaded by runtime/cuda.
//
// Conventions:
//   - activations are fp32, row-major [rows, cols];
//   - dense weights are [N, K] row-major (nn.Linear), dtype 0=f32 1=f16 2=bf16;
//   - q8 weights: int8 [N, K] codes (any bit width <= 8 stored unpacked),
//     sz = float2 {scale, zero} per (row, group), value = (q - zero) * scale;
//   - q4 weights: uint32 [N, K/8], 8 consecutive k per word, element e at bit
//     ((e & 1) ? 16 : 0) + (e >> 1) * 4 (the order the LOP3 trick unpacks),
//     unsigned codes u in 0..15; sz = float2 {scale, bits of half2(1024+z)};
//     value = (u - z) * scale; the streaming GEMVs read a copy of sz in the
//     half form where the scales allow it (Q4Group);
//   - every kernel is extern "C" so the Go side can look it up by name.
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <stdint.h>
#include <type_traits>

#define FULL 0xffffffffu

// Programmatic dependent launch (sm_90; no-ops when compiled for sm_80). The
// backend launches every kernel whose PTX holds griddepcontrol.wait so that
// it may start while the kernel ahead of it in the stream is finishing. A
// kernel therefore waits (pdl_wait) before it touches memory that an earlier
// kernel writes or reads; only weights, which no kernel writes (but
// fill_random's synthetic ones, after which the backend launches the plain
// way), may be read before (the GEMV kernels issue their first weight loads
// that early), and
// what kernels at least two launches back wrote (see pdl_trigger: the
// decode attention's position and cached keys).
// pdl_trigger then lets the next kernel launch: once every block of this
// one has passed its wait, the one before has finished.
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_trigger() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
#define PDL_ENTRY() \
    do {            \
        pdl_wait();    \
        pdl_trigger(); \
    } while (0)

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
    return v;
}
// block_sum for blockDim.x a multiple of 32, <= 1024; sh has 32 floats.
__device__ float block_sum(float v, float* sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float r = lane < nw ? sh[lane] : 0.f;
    return warp_sum(r);
}
__device__ double block_sum_d(double v, double* sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_sum_d(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    double r = lane < nw ? sh[lane] : 0.0;
    return warp_sum_d(r);
}
__device__ float block_max(float v, float* sh) {
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) sh[w] = v;
    __syncthreads();
    float r = lane < nw ? sh[lane] : -INFINITY;
    return warp_max(r);
}

__device__ __forceinline__ float bf16_to_f(uint16_t h) { return __uint_as_float(((uint32_t)h) << 16); }
__device__ __forceinline__ float load_dense(const void* p, size_t i, int dt) {
    if (dt == 1) return __half2float(((const __half*)p)[i]);
    if (dt == 2) return bf16_to_f(((const uint16_t*)p)[i]);
    return ((const float*)p)[i];
}
__device__ __forceinline__ int q4_shift(int e) { return ((e & 1) ? 16 : 0) + (e >> 1) * 4; }
// The streaming GEMVs read a 4-bit weight's {scale, zero} per (row, group)
// in one of two forms: where every scale of the weight is an fp16 value
// (AutoAWQ, GPTQ and ak48 store fp16 scales) the half form, a 32-bit word,
// the scale in its low half and half(1024 + z) in its high half (a copy of
// sz, Linear.szh on the Go side: a decode step reads 5 % fewer bytes);
// else sz's float2 {fp32 scale, bits of half2(1024 + z)}. Q4Group is
// either, read.
struct Q4Group {
    float scale;
    __half2 z1024;  // half2(1024 + z)
};
__device__ __forceinline__ Q4Group q4_group_of(uint32_t g) {
    __half2 h = *reinterpret_cast<__half2*>(&g);
    return Q4Group{__low2float(h), __high2half2(h)};
}
__device__ __forceinline__ Q4Group q4_group_of(float2 g) { return Q4Group{g.x, *reinterpret_cast<__half2*>(&g.y)}; }
// two floats rounded to a half2, a in the low half
__device__ __forceinline__ uint32_t pack_h2(float a, float b) {
    __half2 h = __floats2half2_rn(a, b);
    return *reinterpret_cast<uint32_t*>(&h);
}
// D += A·B on the tensor cores, fp16 operands, fp32 accumulators
__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// cp.async (16-byte copies to shared memory, zero-filled where !valid) and
// its group commit, used by the tensor-core GEMMs (gemm_h_*, w8a8_mma) and
// attn_tc_f16.
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
__device__ __forceinline__ void cp_async16_zfill(void* s, const void* g, bool valid) {
    uint32_t a = (uint32_t)__cvta_generic_to_shared(s);
    int n = valid ? 16 : 0;
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(g), "r"(n) : "memory");
}
// The same with 8 bytes (the {scale, zero} of a quantized weight row's
// group in gemm_h_q4/q8).
__device__ __forceinline__ void cp_async8_zfill(void* s, const void* g, bool valid) {
    uint32_t a = (uint32_t)__cvta_generic_to_shared(s);
    int n = valid ? 8 : 0;
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(a), "l"(g), "r"(n) : "memory");
}
// Weights are read once a decode step: gemv_body's weight loads and the
// streaming GEMV's cp.async ring (gemv_q4_w4a) carry an L2 policy of
// evict-first (createpolicy), so that streaming them does not evict what
// the step reads again (kernel code, activations, the KV cache): a 7B
// W4A16 graph decode step 2 % shorter (kernels/NOTES.md). The Hopper
// GEMMs' weight tiles likewise (tma_load_2d_once).
__device__ __forceinline__ uint64_t l2_evict_first() {
    uint64_t p;
    asm("createpolicy.fractional.L2::evict_first.b64 %0, 1.0;" : "=l"(p));
    return p;
}
__device__ __forceinline__ uint4 ldg_once16(const void* g, uint64_t pol) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v4.u32 {%0, %1, %2, %3}, [%4], %5;"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(g), "l"(pol));
    return v;
}
__device__ __forceinline__ uint2 ldg_once8(const void* g, uint64_t pol) {
    uint2 v;
    asm volatile("ld.global.nc.L1::no_allocate.L2::cache_hint.v2.u32 {%0, %1}, [%2], %3;"
                 : "=r"(v.x), "=r"(v.y)
                 : "l"(g), "l"(pol));
    return v;
}
// A weight row's {scale, zero} pairs: the same line is read again by the
// next chunk, so these stay in L1.
__device__ __forceinline__ float2 ldg_once_f2(const float2* g, uint64_t pol) {
    float2 v;
    asm volatile("ld.global.nc.L2::cache_hint.v2.f32 {%0, %1}, [%2], %3;" : "=f"(v.x), "=f"(v.y) : "l"(g), "l"(pol));
    return v;
}
__device__ __forceinline__ void cp_async16_once_at(uint32_t a, const void* g, uint64_t pol) {
    asm volatile("cp.async.cg.shared.global.L2::cache_hint [%0], [%1], 16, %2;\n" ::"r"(a), "l"(g), "l"(pol) : "memory");
}
__device__ __forceinline__ void cp_async4_once_at(uint32_t a, const void* g, uint64_t pol) {
    asm volatile("cp.async.ca.shared.global.L2::cache_hint [%0], [%1], 4, %2;\n" ::"r"(a), "l"(g), "l"(pol) : "memory");
}
__device__ __forceinline__ void cp_async8_once_at(uint32_t a, const void* g, uint64_t pol) {
    asm volatile("cp.async.ca.shared.global.L2::cache_hint [%0], [%1], 8, %2;\n" ::"r"(a), "l"(g), "l"(pol) : "memory");
}
// last_block counts the calling block in cnt[ci] and is true in the last of
// n blocks to arrive, after the stores every block made before the call
// are visible to it (a fence before the count, one after it in the last
// block); every thread of the block calls it and gets the same answer.
// The last block zeroes cnt[ci] again (for the next launch: every block
// has counted) and merges the others' parts.
__device__ __forceinline__ bool last_block(int* cnt, int ci, int n) {
    __shared__ int last;
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(&cnt[ci], 1) == n - 1;
    __syncthreads();
    if (!last) return false;
    if (threadIdx.x == 0) cnt[ci] = 0;
    __threadfence();
    return true;
}

// part_put and part_take pass one float from a block that is done with it
// to one that waits for it, through a word that holds PART_EMPTY until
// then (the area filled so when allocated: Backend.filledScratch). The
// word is written once and read whole, so the reader needs no fence or
// counter, only to see it leave PART_EMPTY; part_take leaves it PART_EMPTY
// again for the next launch. A reader must wait only on blocks launched
// before it (a lower index) or running beside it, or it could wait forever.
#define PART_EMPTY 0xffffffffu
__device__ __forceinline__ void part_put(float* p, float v) {
    uint32_t b = __float_as_uint(v);
    if (b == PART_EMPTY) b = 0x7fffffffu;  // that NaN's bits: still a NaN
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;\n" ::"l"(p), "r"(b) : "memory");
}
__device__ __forceinline__ float part_take(float* p) {
    uint32_t b;
    do {
        asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];\n" : "=r"(b) : "l"(p) : "memory");
    } while (b == PART_EMPTY);
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;\n" ::"l"(p), "r"(PART_EMPTY) : "memory");
    return __uint_as_float(b);
}

// ldmatrix_x4 loads four 8 × 8 fp16 matrices, lanes 8i..8i+7 addressing
// the rows of matrix i; lane l receives row l/4, columns 2(l%4) and
// 2(l%4) + 1 of each. ldmatrix_x4_trans gives the transposed: rows 2(l%4)
// and 2(l%4) + 1 of column l/4.
__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
    uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
    uint32_t a = (uint32_t)__cvta_generic_to_shared(p);
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}

// ---------------------------------------------------------------------------
// Elementwise and normalisation.

// The embedding kernels look up row ids[r] − lo of a table of n rows; an id
// outside lo..lo+n−1 (another rank's slice of a vocabulary-split table)
// gives a row of zeros.
__device__ __forceinline__ bool embed_zero(float* __restrict__ dst, int r, int id, int n, int cols) {
    if (id >= 0 && id < n) return false;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) dst[(size_t)r * cols + c] = 0.f;
    return true;
}

extern "C" __global__ void embed_dense(float* __restrict__ dst, const void* __restrict__ table,
                                       const int* __restrict__ ids, int cols, int dt, int lo, int n) {
    PDL_ENTRY();
    int r = blockIdx.x;
    int id = ids[r] - lo;
    if (embed_zero(dst, r, id, n, cols)) return;
    size_t base = (size_t)id * cols;
    // EMBED_U loads a thread issued before any store: one round trip a
    // row of up to EMBED_U·blockDim values, not one a value
    constexpr int EMBED_U = 16;
    for (int c0 = threadIdx.x; c0 < cols; c0 += EMBED_U * blockDim.x) {
        float v[EMBED_U];
#pragma unroll
        for (int i = 0; i < EMBED_U; i++) v[i] = load_dense(table, base + min(c0 + i * (int)blockDim.x, cols - 1), dt);
#pragma unroll
        for (int i = 0; i < EMBED_U; i++)
            if (c0 + i * (int)blockDim.x < cols) dst[(size_t)r * cols + c0 + i * blockDim.x] = v[i];
    }
}

// Group of input column c for a q8 weight.
__device__ __forceinline__ int q_group(int c, int gs, const int* gidx) {
    return gidx ? gidx[c] : c / gs;
}

extern "C" __global__ void embed_q8(float* __restrict__ dst, const int8_t* __restrict__ q,
                                    const float2* __restrict__ sz, const int* __restrict__ gidx,
                                    const int* __restrict__ ids, int cols, int gs, int G, int lo, int n) {
    PDL_ENTRY();
    int r = blockIdx.x;
    int id = ids[r] - lo;
    if (embed_zero(dst, r, id, n, cols)) return;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float2 s = sz[(size_t)id * G + q_group(c, gs, gidx)];
        dst[(size_t)r * cols + c] = ((float)q[(size_t)id * cols + c] - s.y) * s.x;
    }
}

// perm (act-order weights, else 0): stored column c is feature perm[c].
extern "C" __global__ void embed_q4(float* __restrict__ dst, const uint32_t* __restrict__ q,
                                    const float2* __restrict__ sz, const int* __restrict__ perm,
                                    const int* __restrict__ ids, int cols, int gs, int G, int lo, int n) {
    PDL_ENTRY();
    int r = blockIdx.x;
    int id = ids[r] - lo;
    if (embed_zero(dst, r, id, n, cols)) return;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        float2 s = sz[(size_t)id * G + c / gs];
        __half2 zh = *reinterpret_cast<__half2*>(&s.y);
        float z = __low2float(zh) - 1024.f;
        uint32_t w = q[((size_t)id * cols + c) >> 3];
        float u = (float)((w >> q4_shift(c & 7)) & 15u);
        dst[(size_t)r * cols + (perm ? perm[c] : c)] = (u - z) * s.x;
    }
}

// The W8A8 activation quantizers (msmodelslim): static, round(v/scale +
// offset) saturated to int8 (quant_act); per token, rint(v/s) within ±127
// for the row's s = max|v|/127, 0 where s = 0 (quant_act_token).
__device__ __forceinline__ int8_t quant_static(float v, float scale, float offset) {
    return (int8_t)fminf(fmaxf(roundf(__fdiv_rn(v, scale) + offset), -128.f), 127.f);
}
__device__ __forceinline__ int8_t quant_token(float v, float s) {
    return (int8_t)(s == 0.f ? 0.f : fminf(fmaxf(rintf(__fdiv_rn(v, s)), -127.f), 127.f));
}
// quot_rn is the correctly rounded quotient v/s without a division, from
// inv = RN(1/s) (Markstein's correction: with q0 = RN(v·inv) and r =
// RN(v − s·q0) by one FMA, RN(q0 + r·inv) = RN(v/s) while 2^-60 ≤ |v|,
// |s| ≤ 2^60 keeps every step normal; r itself is not always exact, the
// result is: checked exhaustively at reduced precisions and over ~2·10^9
// float32 pairs near rounding boundaries, kernels/NOTES.md, fifty-eighth
// session), v taken as ±2^60 above that and as ±0 below 2^-60 (the
// division's signed zero; NaN passes through). The division's fast path is the same reciprocal and FMAs
// behind a range check and a call of its slow path, a long dependent chain
// a value: with it, attn_tc_f16_q took 3.9–4.6 µs more than attn_tc_f16_h
// at 128–512 tokens on an H200 (kernels/exp/attn_form.cu).
__device__ __forceinline__ float quot_rn(float v, float s, float inv) {
    const float a = fabsf(v);
    v = copysignf(a > 0x1p60f ? 0x1p60f : a < 0x1p-60f ? 0.f : a, v);
    const float q0 = __fmul_rn(v, inv), r = __fmaf_rn(-q0, s, v);
    return __fmaf_rn(r, inv, q0);
}
// quant_fast is quant_static through quot_rn (inv = RN(1/scale)): the same
// codes for a quantizer with 2^-30 ≤ |scale| ≤ 2^30 and |offset| ≤ 2^8,
// where a v that quot_rn clamps saturates, or rounds, alike (|v/s| ≥ 2^30,
// or < 2^-30, which moves v/s + offset past no half-integer). The host
// lets producers write codes only for such a quantizer (runtime/cuda's
// actQuant.divisionFree); quant_act keeps quant_static for every other.
__device__ __forceinline__ int8_t quant_fast(float v, float scale, float offset, float inv) {
    return (int8_t)fminf(fmaxf(roundf(__fadd_rn(quot_rn(v, scale, inv), offset)), -128.f), 127.f);
}
// QOut asks a GEMM for its results quantized by quant_static (scale s,
// offset o) to p, int8 codes at the float output's indices, instead of
// floats: the SwiGLU of a W8A8 up GEMM written as the input of down
// (runtime.Fused's MLP), or the attention's output as o's (attn_tc_f16_q),
// with no fp32 copy and no quant_act. p = nullptr:
// floats as usual. The codes are quant_fast's (inv = RN(1/s)): the host
// asks for them only where they equal quant_static's.
struct QOut {
    int8_t* p;
    float s, o;
    float inv = __frcp_rn(s);
    __device__ __forceinline__ void put1(size_t i, float v) const { p[i] = quant_fast(v, s, o, inv); }
    __device__ __forceinline__ void put2(size_t i, float a, float b) const {
        *reinterpret_cast<char2*>(p + i) = make_char2(quant_fast(a, s, o, inv), quant_fast(b, s, o, inv));
    }
    __device__ __forceinline__ void put4(size_t i, float4 v) const {
        *reinterpret_cast<char4*>(p + i) = make_char4(quant_fast(v.x, s, o, inv), quant_fast(v.y, s, o, inv),
                                                      quant_fast(v.z, s, o, inv), quant_fast(v.w, s, o, inv));
    }
};

// rmsnorm writes row r of RMSNorm(x) in the form its products take: to
// dst; or rounded to fp16 to dst16 (to_half's); or quantized for W8A8 to
// dstq, per token where tok is set (the row's scale to tok[r]), else with
// qs and qo: the GEMMs' input without an fp32 copy. A row of at most
// RN_REG values a thread is loaded once, all its loads issued before the
// sum of squares, and kept in registers (the same sums in the same order
// as the loop over longer rows).
#define RN_REG 16
// rms_inv is 1/RMS of a row of cols values from each thread's sum of
// squares ss (summed over the block), and rms_normed value c of the normed
// row, each product rounded (the same value in every pass): rmsnorm's
// arithmetic, which exchange_peer's norm shares. rms_scaled is rms_normed
// of weight wc and, where has_bias, bias bc already loaded (a caller that
// stores where the compiler cannot rule out w or bias issues the loads of
// its values first: one round trip, not one a value).
__device__ __forceinline__ float rms_inv(float ss, int cols, float eps, float* sh) {
    return rsqrtf(block_sum(ss, sh) / (float)cols + eps);
}
__device__ __forceinline__ float rms_scaled(float xc, float inv, float wc, bool has_bias, float bc) {
    float v = __fmul_rn(__fmul_rn(xc, inv), wc);
    return has_bias ? __fadd_rn(v, bc) : v;
}
__device__ __forceinline__ float rms_normed(float xc, float inv, const float* __restrict__ w,
                                            const float* __restrict__ bias, int c) {
    return rms_scaled(xc, inv, w[c], bias != nullptr, bias ? bias[c] : 0.f);
}
// rmsnorm_vec is rmsnorm for a row of at most 4·RN_V·blockDim.x values, a
// multiple of 4, with 16-byte aligned rows (x, w, bias, dst; dst16 8-byte,
// dstq 4-byte): four consecutive values a thread from one 16-byte load,
// the weight's and bias's loads issued with the row's, before the sum of
// squares; stores of four values at once.
#define RN_V 4
// rn_vec_fits reports whether a row of cols values over nt threads, its
// input and weights at the addresses or-ed in addrs, takes rmsnorm_vec's
// partition (the float4s t + i·nt of thread t) and rn_vec_sumsq's order
// of sums; exchange_peer's norm asks too, so that its bits stay rmsnorm's.
__device__ __forceinline__ bool rn_vec_fits(int cols, int nt, uintptr_t addrs) {
    return (cols & 3) == 0 && cols <= 4 * RN_V * nt && (addrs & 15) == 0;
}
// rn_vec_sumsq is a thread's sum of the squares of its RN_V float4s in
// order, each product fused into the sum.
__device__ __forceinline__ float rn_vec_sumsq(const float4 (&xv)[RN_V]) {
    float ss = 0.f;
#pragma unroll
    for (int i = 0; i < RN_V; i++) {
        ss = __fmaf_rn(xv[i].x, xv[i].x, ss);
        ss = __fmaf_rn(xv[i].y, xv[i].y, ss);
        ss = __fmaf_rn(xv[i].z, xv[i].z, ss);
        ss = __fmaf_rn(xv[i].w, xv[i].w, ss);
    }
    return ss;
}
__device__ __forceinline__ void rmsnorm_vec(float* __restrict__ dst, const float* __restrict__ x,
                                            const float* __restrict__ w, const float* __restrict__ bias, int cols,
                                            float eps, __half* __restrict__ dst16, int8_t* __restrict__ dstq,
                                            float* __restrict__ tok, float qs, float qo, float* sh) {
    const int r = blockIdx.x, nt = blockDim.x, n4 = cols / 4;
    const float4* xr = reinterpret_cast<const float4*>(x + (size_t)r * cols);
    const float4 z4 = make_float4(0.f, 0.f, 0.f, 0.f);
    float4 xv[RN_V], wv[RN_V], bv[RN_V];
#pragma unroll
    for (int i = 0; i < RN_V; i++) {
        int c = threadIdx.x + i * nt;
        bool in = c < n4;
        xv[i] = in ? xr[c] : z4;
        wv[i] = in ? __ldg(reinterpret_cast<const float4*>(w) + c) : z4;
        bv[i] = in && bias ? __ldg(reinterpret_cast<const float4*>(bias) + c) : z4;
    }
    const float inv = rms_inv(rn_vec_sumsq(xv), cols, eps, sh);
    const bool hb = bias != nullptr;
#pragma unroll
    for (int i = 0; i < RN_V; i++) {
        xv[i] = make_float4(rms_scaled(xv[i].x, inv, wv[i].x, hb, bv[i].x), rms_scaled(xv[i].y, inv, wv[i].y, hb, bv[i].y),
                            rms_scaled(xv[i].z, inv, wv[i].z, hb, bv[i].z), rms_scaled(xv[i].w, inv, wv[i].w, hb, bv[i].w));
    }
    if (tok) {
        float mx = 0.f;
#pragma unroll
        for (int i = 0; i < RN_V; i++)
            if (threadIdx.x + i * nt < n4)
                mx = fmaxf(mx, fmaxf(fmaxf(fabsf(xv[i].x), fabsf(xv[i].y)), fmaxf(fabsf(xv[i].z), fabsf(xv[i].w))));
        qs = __fdiv_rn(block_max(mx, sh), 127.f);
        if (threadIdx.x == 0) tok[r] = qs;
    }
    const float qinv = __frcp_rn(qs);
#pragma unroll
    for (int i = 0; i < RN_V; i++) {
        int c = threadIdx.x + i * nt;
        if (c >= n4) break;
        size_t o = (size_t)r * cols + 4 * c;
        float4 v = xv[i];
        if (dstq) {
            char4 q = tok ? make_char4(quant_token(v.x, qs), quant_token(v.y, qs), quant_token(v.z, qs), quant_token(v.w, qs))
                          : make_char4(quant_fast(v.x, qs, qo, qinv), quant_fast(v.y, qs, qo, qinv),
                                       quant_fast(v.z, qs, qo, qinv), quant_fast(v.w, qs, qo, qinv));
            *reinterpret_cast<char4*>(dstq + o) = q;
        } else if (dst16) {
            __half2 h[2] = {__floats2half2_rn(v.x, v.y), __floats2half2_rn(v.z, v.w)};
            *reinterpret_cast<uint2*>(dst16 + o) = *reinterpret_cast<const uint2*>(h);
        } else {
            *reinterpret_cast<float4*>(dst + o) = v;
        }
    }
}
// rmsnorm's blocks: up to 1 024 threads (runtime/cuda's rowBlock), so at
// most 64 registers a thread. Aligned rows of at most 16 values a thread,
// a multiple of 4, take rmsnorm_vec (sixty-first and sixty-second sessions:
// the kernel 20–28 % faster, W8A8 prefill +1.5–2.4 %).
extern "C" __global__ void __launch_bounds__(1024) rmsnorm(float* __restrict__ dst, const float* __restrict__ x,
                                   const float* __restrict__ w, const float* __restrict__ bias,
                                   int cols, float eps, __half* __restrict__ dst16, int8_t* __restrict__ dstq,
                                   float* __restrict__ tok, float qs, float qo) {
    PDL_ENTRY();
    __shared__ float sh[32];
    int r = blockIdx.x, nt = blockDim.x;
    if (rn_vec_fits(cols, nt, (uintptr_t)x | (uintptr_t)w | (uintptr_t)bias | (uintptr_t)dst) &&
        ((uintptr_t)dst16 & 7) == 0 && ((uintptr_t)dstq & 3) == 0) {
        rmsnorm_vec(dst, x, w, bias, cols, eps, dst16, dstq, tok, qs, qo, sh);
        return;
    }
    const float* xr = x + (size_t)r * cols;
    const bool inreg = cols <= RN_REG * nt;
    float xv[RN_REG];
    float ss = 0.f;
    if (inreg) {
#pragma unroll
        for (int i = 0; i < RN_REG; i++) {
            int c = threadIdx.x + i * nt;
            xv[i] = c < cols ? xr[c] : 0.f;
        }
#pragma unroll
        for (int i = 0; i < RN_REG; i++)
            if (threadIdx.x + i * nt < cols) ss += xv[i] * xv[i];
    } else {
        for (int c = threadIdx.x; c < cols; c += nt) ss += xr[c] * xr[c];
    }
    const float inv = rms_inv(ss, cols, eps, sh);
    auto normed = [&](float xc, int c) { return rms_normed(xc, inv, w, bias, c); };
    const float qinv = __frcp_rn(qs);
    auto put = [&](float v, int c) {
        size_t i = (size_t)r * cols + c;
        if (dstq)
            dstq[i] = tok ? quant_token(v, qs) : quant_fast(v, qs, qo, qinv);
        else if (dst16)
            dst16[i] = __float2half_rn(v);
        else
            dst[i] = v;
    };
    if (tok) {
        float mx = 0.f;
        if (inreg) {
#pragma unroll
            for (int i = 0; i < RN_REG; i++) {
                int c = threadIdx.x + i * nt;
                if (c < cols) mx = fmaxf(mx, fabsf(normed(xv[i], c)));
            }
        } else {
            for (int c = threadIdx.x; c < cols; c += nt) mx = fmaxf(mx, fabsf(normed(xr[c], c)));
        }
        qs = __fdiv_rn(block_max(mx, sh), 127.f);
        if (threadIdx.x == 0) tok[r] = qs;
    }
    if (inreg) {
#pragma unroll
        for (int i = 0; i < RN_REG; i++) {
            int c = threadIdx.x + i * nt;
            if (c < cols) put(normed(xv[i], c), c);
        }
    } else {
        for (int c = threadIdx.x; c < cols; c += nt) put(normed(xr[c], c), c);
    }
}

// One warp per head: grid (rows), block 32*warps. A head of at most
// 32·RH_REG values is held in registers, its loads and its weights' issued
// at once (the same sums in the same order as the loop over wider heads).
#define RH_REG 4
extern "C" __global__ void __launch_bounds__(1024) rmsnorm_heads(float* __restrict__ x, const float* __restrict__ w,
                                                                 int cols, int hd, float eps) {
    PDL_ENTRY();
    int r = blockIdx.x;
    int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = blockDim.x >> 5;
    int heads = cols / hd;
    for (int h = wid; h < heads; h += nw) {
        float* p = x + (size_t)r * cols + (size_t)h * hd;
        float ss = 0.f;
        if (hd <= 32 * RH_REG) {
            float v[RH_REG], wv[RH_REG];
#pragma unroll
            for (int i = 0; i < RH_REG; i++) {
                int d = lane + 32 * i;
                v[i] = d < hd ? p[d] : 0.f;
                wv[i] = d < hd ? w[d] : 0.f;
            }
#pragma unroll
            for (int i = 0; i < RH_REG; i++)
                if (lane + 32 * i < hd) ss += v[i] * v[i];
            ss = warp_sum(ss);
            float inv = rsqrtf(ss / (float)hd + eps);
#pragma unroll
            for (int i = 0; i < RH_REG; i++)
                if (lane + 32 * i < hd) p[lane + 32 * i] = v[i] * inv * wv[i];
            continue;
        }
        for (int d = lane; d < hd; d += 32) ss += p[d] * p[d];
        ss = warp_sum(ss);
        float inv = rsqrtf(ss / (float)hd + eps);
        for (int d = lane; d < hd; d += 32) p[d] = p[d] * inv * w[d];
    }
}

extern "C" __global__ void add_bias(float* __restrict__ x, const float* __restrict__ b, int rows, int cols) {
    PDL_ENTRY();
    size_t n = (size_t)rows * cols;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] += b[i % cols];
}

// silu_quot is RN(g/d) for d = 1 + e^-g as silu_times computes it, the
// bits of the division g / d without its branch: the division's fast
// path (the reciprocal, one Newton step, Markstein's correction) with
// both operands scaled by 2^-64 where d > 2^60 (g < -41.5: an exact
// scaling that keeps every step normal), and the division's results
// where the path fails: g itself for g = +inf (d = 1) and ±0 (the path's
// last sum would give +0 for -0), the signed zero g·0 for d = +inf
// (g < -88.7), NaN from -inf or NaN. Checked against g / d over all
// 2^32 values of g on an H200 (kernels/exp/silu_div.cu) with build.sh's
// flags: under -ftz or -prec-div=false (fast math) the division itself
// is another (and a subnormal g would pass as g here). The division's
// range check and call of its slow path made each value's chain a
// region of its own that the compiler would not interleave with the
// next value's: the W8A8 GLU epilogue of 128 × 128 outputs took 8.6 µs of
// a 34.5 µs block at 128 rows, 7.5 without (sixty-sixth session).
__device__ __forceinline__ float silu_quot(float g, float d) {
    const float s = d > 0x1p60f ? 0x1p-64f : 1.f, gs = __fmul_rn(g, s), ds = __fmul_rn(d, s);
    float r;
    asm("rcp.approx.ftz.f32 %0, %1;" : "=f"(r) : "f"(ds));
    const float inv = __fmaf_rn(r, __fmaf_rn(-ds, r, 1.f), r);
    const float q0 = __fmul_rn(gs, inv), q = __fmaf_rn(inv, __fmaf_rn(-ds, q0, gs), q0);
    return g == INFINITY || g == 0.f ? g : d < INFINITY ? q : __fmul_rn(g, 0.f);
}
// silu_times is SwiGLU's silu(g)·u, the one formula of silu_mul, the
// GEMVs' SwiGLU epilogue and the GEMMs' OUT_SWIGLU.
__device__ __forceinline__ float silu_times(float g, float u) { return silu_quot(g, 1.f + expf(-g)) * u; }
// How a product's results v land in its output C (the out argument of the
// tensor-core GEMMs, sum_splits and the W8A8 products): stored; added to
// C (MatMulAdd, as add_inplace); or, with C holding the gate's products
// and v the up products, silu(C)·v (the SwiGLU, as silu_mul). Splits of K
// store their partial products and the sum applies out.
#define OUT_STORE 0
#define OUT_ADD 1
#define OUT_SWIGLU 2
__device__ __forceinline__ float out_val(const float* C, float v, int out) {
    if (out == OUT_ADD) return *C + v;
    if (out == OUT_SWIGLU) return silu_times(*C, v);
    return v;
}
// TileStage is shared memory free for a whole result tile of TS_ROWS ×
// TS_COLS from row m0, column n0 (a Hopper GEMM's stages once
// its products are done), shared by the nthr threads (this one: tid) that
// meet at named barrier bar; nthr is a multiple of TS_COLS / 4. The tile's
// rows r0..r1 − 1 are the ones out_tile_staged finishes (a cluster pair's
// block: its half; a cluster of three's: its part; gw_scatter).
#define TS_ROWS 128
#define TS_COLS 128
#define TS_LD (TS_COLS + 8)  // the fragments' float2 writes hit 32 banks a half warp
template <typename T>
struct TileStage {
    T* s;
    int m0, n0, bar, nthr, tid;
    int r0 = 0, r1 = TS_ROWS;
};
__device__ __forceinline__ void named_sync(int bar, int nthr) {
    asm volatile("bar.sync %0, %1;" ::"r"(bar), "r"(nthr) : "memory");
}
// out_tile puts a thread's NU result units of a GEMM tile into C [M, N] by
// out: unit u is W (1 or 2) values at row m, columns n (and n + 1), from
// at(u, m, n); raw(u, i) is its value i (of type T) before fin(m, n, raw)
// (W8A8Fin of an integer sum; AsIs for the float GEMMs). Stores and adds
// are unrolled, pairs as one float2 where they can; the SwiGLU, whose expf
// and division the unrolling would repeat at every value of every GEMM,
// loads all its gate values first (unrolled: one latency), then finishes in
// one rolled loop over local arrays, writing its results quantized to q.p
// where that is set (C then only read).
template <int NU, int W, typename T, typename At, typename Raw, typename Fin>
__device__ __forceinline__ void out_tile(float* C, int M, int N, int out, At at, Raw raw, Fin fin, QOut q = QOut{}) {
    if (out != OUT_SWIGLU) {
        bool add = out == OUT_ADD;
#pragma unroll
        for (int u = 0; u < NU; u++) {
            int m, n;
            at(u, m, n);
            if (m >= M) continue;
            float* cp = C + (size_t)m * N + n;
            float v0 = n < N ? fin(m, n, raw(u, 0)) : 0.f;
            if (W == 2 && n + 1 < N && (N & 1) == 0) {
                float v1 = fin(m, n + 1, raw(u, 1));
                float2 c = add ? *reinterpret_cast<const float2*>(cp) : make_float2(0.f, 0.f);
                *reinterpret_cast<float2*>(cp) = add ? make_float2(c.x + v0, c.y + v1) : make_float2(v0, v1);
                continue;
            }
            if (n < N) cp[0] = add ? cp[0] + v0 : v0;
            if (W == 2 && n + 1 < N) {
                float v1 = fin(m, n + 1, raw(u, 1));
                cp[1] = add ? cp[1] + v1 : v1;
            }
        }
        return;
    }
    T keep[NU][W];
    float gate[NU][W];
#pragma unroll
    for (int u = 0; u < NU; u++) {
        int m, n;
        at(u, m, n);
#pragma unroll
        for (int i = 0; i < W; i++) {
            keep[u][i] = raw(u, i);
            gate[u][i] = m < M && n + i < N ? C[(size_t)m * N + n + i] : 0.f;
        }
    }
#pragma unroll 1
    for (int u = 0; u < NU; u++) {
        int m, n;
        at(u, m, n);
#pragma unroll
        for (int i = 0; i < W; i++)
            if (m < M && n + i < N) {
                float r = silu_times(gate[u][i], fin(m, n + i, keep[u][i]));
                if (q.p)
                    q.put1((size_t)m * N + n + i, r);
                else
                    C[(size_t)m * N + n + i] = r;
            }
    }
}
// AsIs is the fin of the float GEMMs' out_tile and out_tile_staged: the
// value as it is. out_tile_staged asks a fin for the state of a thread's
// four columns n.. once (cols) and applies it to each of its rows (at:
// column n + i of row m).
struct AsIs {
    struct Cols {};
    __device__ __forceinline__ float operator()(int, int, float v) const { return v; }
    __device__ __forceinline__ Cols cols(int, int) const { return Cols{}; }
    __device__ __forceinline__ float at(const Cols&, int, int, float v) const { return v; }
};
// out_tile_staged is out_tile for a block whose free shared memory holds
// the whole tile (st): the tile's raw values go there and its threads
// finish it four columns a thread, rows apart: every load and store of C a
// coalesced float4, a thread's columns the same in every row, their part
// of fin (fin.cols) taken once (the column tail past a multiple of 4 takes
// fin whole). The adds and the SwiGLU load OTS_BATCH float4 of C a thread
// before they use any (one round trip to memory a batch instead of one an
// item: the epilogue runs after the products, with nothing else to hide
// it). mir gets every value stored into C as well (PeerMirror: the
// tensor-parallel peers' stages; NoMirror: nothing), or, where it takes
// them (QKVSink), stores them itself instead of C. COLS: the tile's
// columns, TS_COLS but for the int8 fill form's 112 (the stage's pitch
// COLS + 8; the threads past the last whole row of COLS / 4 have no
// columns and return once the tile is staged, so that with COLS ≠ TS_COLS
// out_tile_staged is a block's last barrier).
#define OTS_BATCH 4
// stage_tile puts a thread's NU units of W values (as out_tile's) into the
// tile stage st once every thread of st is done with the stages, and
// returns when all of st's threads have.
// (LD: the stage's row pitch in values, TS_LD but for the fill forms'
// tiles.)
template <int NU, int W, int LD = TS_LD, typename T, typename At, typename Raw>
__device__ __forceinline__ void stage_tile(At at, Raw raw, const TileStage<T>& st) {
    named_sync(st.bar, st.nthr);  // every thread is done with the stages
#pragma unroll
    for (int u = 0; u < NU; u++) {
        int m, n;
        at(u, m, n);
#pragma unroll
        for (int i = 0; i < W; i++) st.s[(m - st.m0) * LD + n + i - st.n0] = raw(u, i);
    }
    named_sync(st.bar, st.nthr);
}
// NoMirror is out_tile_staged's mir where the values go to C alone. A mir
// whose takes is true (QKVSink) is bound to a thread's columns once
// (bind), loads what a row needs for the batch (pre) and stores a
// thread's four values of a row itself instead (take4), the tile then a
// whole number of warps a row (the host's checks: N a multiple of 4 and
// of 128, out OUT_STORE).
struct NoMirror {
    static constexpr bool takes = false;
    struct Pre {};
    __device__ __forceinline__ void put4(size_t, float4) const {}
    __device__ __forceinline__ void put1(size_t, float) const {}
};
template <int NU, int W, typename T, int COLS = TS_COLS, typename At, typename Raw, typename Fin,
          typename Mir = NoMirror>
__device__ __forceinline__ void out_tile_staged(float* C, int M, int N, int out, At at, Raw raw, Fin fin,
                                                TileStage<T> st, Mir mir = Mir{}) {
    constexpr int TPR = COLS / 4, LD = COLS + 8;  // threads a row, the stage's pitch
    stage_tile<NU, W, LD>(at, raw, st);
    const int nthr = st.nthr / TPR * TPR;  // all of them where COLS = TS_COLS
    if constexpr (COLS != TS_COLS)
        if (st.tid >= nthr) return;
    const int items = st.r1 * TPR, c = st.tid % TPR * 4, n = st.n0 + c;
    const bool vec = (N & 3) == 0 && n < N;  // this thread's four columns as one float4 (the same in every row)
    const typename Fin::Cols fc = fin.cols(n, N);
    if constexpr (Mir::takes) mir.bind(n);
#pragma unroll 1
    for (int e0 = st.r0 * TPR + st.tid; e0 < items; e0 += OTS_BATCH * nthr) {
        float4 g[OTS_BATCH];
        typename Mir::Pre pre[OTS_BATCH];  // what take4 loads, issued for the batch at once
        if constexpr (Mir::takes)
            if (vec) {
#pragma unroll
                for (int j = 0; j < OTS_BATCH; j++) {
                    int m = st.m0 + (e0 + j * nthr) / TPR;
                    if (e0 + j * nthr < items && m < M) pre[j] = mir.pre(m);
                }
            }
        if (vec && out != OUT_STORE) {
#pragma unroll
            for (int j = 0; j < OTS_BATCH; j++) {
                int m = st.m0 + (e0 + j * nthr) / TPR;
                if (e0 + j * nthr < items && m < M) g[j] = *reinterpret_cast<const float4*>(C + (size_t)m * N + n);
            }
        }
#pragma unroll
        for (int j = 0; j < OTS_BATCH; j++) {
            int e = e0 + j * nthr, r = e / TPR, m = st.m0 + r;
            if (e >= items || m >= M) break;
            const T* kp = st.s + r * LD + c;
            float* cp = C + (size_t)m * N + n;
            if (vec) {
                float4 v = make_float4(fin.at(fc, m, 0, kp[0]), fin.at(fc, m, 1, kp[1]), fin.at(fc, m, 2, kp[2]),
                                       fin.at(fc, m, 3, kp[3]));
                if (out != OUT_STORE)
                    v = make_float4(out_val(&g[j].x, v.x, out), out_val(&g[j].y, v.y, out), out_val(&g[j].z, v.z, out),
                                    out_val(&g[j].w, v.w, out));
                if constexpr (Mir::takes) {
                    mir.take4(cp, m, N, n, v, pre[j]);
                } else {
                    *reinterpret_cast<float4*>(cp) = v;
                    mir.put4((size_t)m * N + n, v);
                }
                continue;
            }
            if constexpr (Mir::takes) {
                __trap();  // a host error: the columns are not whole float4s
            } else {
#pragma unroll 1
                for (int i = 0; i < 4; i++)
                    if (n + i < N) {
                        float v = out_val(cp + i, fin(m, n + i, kp[i]), out);
                        cp[i] = v;
                        mir.put1((size_t)m * N + n + i, v);
                    }
            }
        }
    }
}
// GluEpi is the epilogue of a gate/up pair GEMM (gemm_wg_*_glu): fin of
// the gate's and the up products (W8A8Fin, or AsIs for the float kinds),
// which of the two is the tile's plane 0 (its first 64 columns), and
// where the SwiGLU goes instead of C as the input of down: quantized (q.p
// set: W8A8 only), or rounded to fp16 (h set: the float kinds).
template <typename Fin>
struct GluEpi {
    Fin g, u;
    bool upFirst;
    QOut q;
    __half* h;
};
// glu_tile puts the NU units of W values (as out_tile's) of each consumer
// thread into the tile stage st, whose 2·HALF columns are HALF of each
// weight's products (64; the GLU fill forms 88 or 112, their stage's
// pitch LD); then each thread takes four outputs n.. of rows nthr / (HALF
// / 4) apart: silu(g(gate))·u(up) to C [M, N], or quantized to e.q.p, or
// in fp16 to e.h (a thread past the last whole row of a pass: none, and
// it returns, so with HALF ≠ 64 glu_tile is a block's last barrier).
template <int NU, int W, int HALF = 64, int LD = TS_LD, typename T, typename At, typename Raw, typename Fin>
__device__ __forceinline__ void glu_tile(float* C, int M, int N, At at, Raw raw, const GluEpi<Fin>& e,
                                         TileStage<T> st) {
    stage_tile<NU, W, LD>(at, raw, st);
    constexpr int TPR = HALF / 4;  // threads a row
    if constexpr (HALF != 64)
        if (st.tid >= st.nthr / TPR * TPR) return;
    const int c = st.tid % TPR * 4, n = st.n0 + c, gc = e.upFirst ? HALF + c : c, uc = e.upFirst ? c : HALF + c;
    const bool vec = (N & 3) == 0 && n < N;
    const typename Fin::Cols gcols = e.g.cols(n, N), ucols = e.u.cols(n, N);
#pragma unroll 2
    for (int r = st.tid / TPR; r < TS_ROWS; r += st.nthr / TPR) {
        int m = st.m0 + r;
        if (m >= M) break;
        const T* kp = st.s + r * LD;
        float v[4];
#pragma unroll
        for (int i = 0; i < 4; i++) v[i] = silu_times(e.g.at(gcols, m, i, kp[gc + i]), e.u.at(ucols, m, i, kp[uc + i]));
        size_t o = (size_t)m * N + n;
        if (vec) {
            if (e.q.p) {
                e.q.put4(o, make_float4(v[0], v[1], v[2], v[3]));
            } else if (e.h) {
                __half2 hv[2] = {__floats2half2_rn(v[0], v[1]), __floats2half2_rn(v[2], v[3])};
                *reinterpret_cast<uint2*>(e.h + o) = *reinterpret_cast<const uint2*>(hv);
            } else {
                *reinterpret_cast<float4*>(C + o) = make_float4(v[0], v[1], v[2], v[3]);
            }
            continue;
        }
#pragma unroll
        for (int i = 0; i < 4; i++)
            if (n + i < N) {
                if (e.q.p)
                    e.q.put1(o + i, v[i]);
                else if (e.h)
                    e.h[o + i] = __float2half_rn(v[i]);
                else
                    C[o + i] = v[i];
            }
    }
}
extern "C" __global__ void add_inplace(float* __restrict__ dst, const float* __restrict__ x, long long n) {
    PDL_ENTRY();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = out_val(dst + i, x[i], OUT_ADD);
}
extern "C" __global__ void silu_mul(float* dst, const float* gate, const float* __restrict__ up, long long n) {
    PDL_ENTRY();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = silu_times(gate[i], up[i]);
}

// Position of row t: pos0 + t, plus *dpos when dpos is set (CUDA graph
// replay). dpos is read through L2 (only argmax's decode advance writes it,
// at the end of the step before), so kernels may read it before their wait.
__device__ __forceinline__ int row_pos(int pos0, const int* dpos, int t) {
    return pos0 + (dpos ? __ldcg(dpos) : 0) + t;
}

// RoPE of pair i (0 ≤ i < hd/2) of a head of hd values at position pos:
// the pair's two indices in the head (layout 0 = half (HF): i and i + hd/2,
// 1 = interleaved: 2i and 2i + 1) and the rotation (x0, x1) → (r0, r1).
// The angle is computed in double and reduced to [-pi, pi] in double, then
// a float sincos; the products are rounded explicitly so that every kernel
// using it rotates alike.
struct RopePair {
    int a, b;
    float s, c;
};
__device__ __forceinline__ RopePair rope_pair(int i, int hd, int pos, double theta, int layout) {
    double inv = exp2(-2.0 * (double)i / (double)hd * log2(theta));
    double ang = (double)pos * inv;
    ang -= 6.283185307179586 * rint(ang * 0.15915494309189535);
    RopePair p;
    sincosf((float)ang, &p.s, &p.c);
    p.a = layout ? 2 * i : i;
    p.b = layout ? 2 * i + 1 : i + hd / 2;
    return p;
}
__device__ __forceinline__ float2 rope_rotate(const RopePair& p, float x0, float x1) {
    return make_float2(fmaf(x0, p.c, -__fmul_rn(x1, p.s)), fmaf(x0, p.s, __fmul_rn(x1, p.c)));
}

// RopeItem is item j of a RoPE launch over rows × hd/2 pairs × groups of
// hg heads (of heads a row): row r, pair i, heads h0..h1 − 1, which share
// the angle. Consecutive items are consecutive pairs of one head
// (coalesced).
struct RopeItem {
    int r, i, h0, h1;
};
__device__ __forceinline__ RopeItem rope_item(int j, int half, int heads, int hg) {
    int groups = (heads + hg - 1) / hg, rg = j / half, g = rg % groups;
    return RopeItem{rg / groups, j % half, g * hg, min(heads, (g + 1) * hg)};
}
// rope_apply rotates pair p of the head at x in place and returns it.
__device__ __forceinline__ float2 rope_apply(float* __restrict__ x, const RopePair& p) {
    float2 o = rope_rotate(p, x[p.a], x[p.b]);
    x[p.a] = o.x;
    x[p.b] = o.y;
    return o;
}

// RoPE in place: x [rows, cols], cols = heads*hd, hg heads an item.
extern "C" __global__ void rope(float* __restrict__ x, int rows, int cols, int hd, int pos0,
                                const int* __restrict__ dpos, double theta, int layout, int hg) {
    PDL_ENTRY();
    int half = hd / 2, heads = cols / hd, items = rows * half * ((heads + hg - 1) / hg);
    for (int j = blockIdx.x * blockDim.x + threadIdx.x; j < items; j += gridDim.x * blockDim.x) {
        RopeItem it = rope_item(j, half, heads, hg);
        RopePair rp = rope_pair(it.i, hd, row_pos(pos0, dpos, it.r), theta, layout);
#pragma unroll 4
        for (int h = it.h0; h < it.h1; h++) rope_apply(x + (size_t)it.r * cols + (size_t)h * hd, rp);
    }
}

// KV cache of one layer: kc, vc [maxSeq, kvDim], fp32, fp16 or int8 (KV).
// The int8 cache is msmodelslim's C8, per channel c with scale s and offset
// o: stored round(x/s + o) (saturated, each step rounded to float32 as on
// the CPU), read as (q − o)·s.
// kv_load reads a cached value: a float, or an int8 cache's code (the
// attention applies the quantizer, see attention_body).
__device__ __forceinline__ float kv_load(const float* p, size_t i) { return p[i]; }
__device__ __forceinline__ float kv_load(const __half* p, size_t i) { return __half2float(p[i]); }
__device__ __forceinline__ float kv_load(const int8_t* p, size_t i) { return (float)p[i]; }
// kv_row reads a lane's V (≤ N) consecutive cached values into r (zeros
// beyond V); for V = 4, the head size 128, with one vector load.
template <int N, typename KV>
__device__ __forceinline__ void kv_row(float (&r)[N], const KV* p, int V) {
    if constexpr (N >= 4) {
        if (V == 4) {
            float4 c;
            if constexpr (sizeof(KV) == 4) {
                c = *reinterpret_cast<const float4*>(p);
            } else if constexpr (sizeof(KV) == 2) {
                uint2 u = *reinterpret_cast<const uint2*>(p);
                float2 a = __half22float2(*reinterpret_cast<const __half2*>(&u.x));
                float2 b = __half22float2(*reinterpret_cast<const __half2*>(&u.y));
                c = make_float4(a.x, a.y, b.x, b.y);
            } else {
                char4 q = *reinterpret_cast<const char4*>(p);
                c = make_float4(q.x, q.y, q.z, q.w);
            }
            r[0] = c.x, r[1] = c.y, r[2] = c.z, r[3] = c.w;
#pragma unroll
            for (int i = 4; i < N; i++) r[i] = 0.f;
            return;
        }
    }
#pragma unroll
    for (int i = 0; i < N; i++) r[i] = i < V ? kv_load(p, i) : 0.f;
}
// kv_cached is x as the cache gives it back once stored (kv_store, then
// kv_load: an int8 cache's code); kv_put stores such a value.
__device__ __forceinline__ float kv_cached(const float*, float x, float, float) { return x; }
__device__ __forceinline__ float kv_cached(const __half*, float x, float, float) { return __half2float(__float2half_rn(x)); }
__device__ __forceinline__ float kv_cached(const int8_t*, float x, float s, float o) {
    return fminf(fmaxf(rintf(__fadd_rn(__fdiv_rn(x, s), o)), -128.f), 127.f);
}
__device__ __forceinline__ void kv_put(float* p, size_t i, float x) { p[i] = x; }
__device__ __forceinline__ void kv_put(__half* p, size_t i, float x) { p[i] = __float2half_rn(x); }
__device__ __forceinline__ void kv_put(int8_t* p, size_t i, float x) { p[i] = (int8_t)x; }
__device__ __forceinline__ void kv_store(float* p, size_t i, float x, float, float) { p[i] = x; }
__device__ __forceinline__ void kv_store(__half* p, size_t i, float x, float, float) { p[i] = __float2half_rn(x); }
__device__ __forceinline__ void kv_store(int8_t* p, size_t i, float x, float s, float o) {
    p[i] = (int8_t)kv_cached(p, x, s, o);
}
template <typename KV> struct kv_quantized { static constexpr bool value = false; };
template <> struct kv_quantized<int8_t> { static constexpr bool value = true; };

// kq = {k scale, k offset, v scale, v offset} of the layer, [kvDim] each
// (int8 caches only).
struct KVQuant { const float *ks, *ko, *vs, *vo; };

// ROPE_BATCH: the heads whose loads store_kv_body issues at once (runtime/cuda's
// ropeHeads, the heads of an item from ropeGroupRows rows on)
#define ROPE_BATCH 8
// store_kv_body writes rows of k and v (positions pos0..) into the cache.
// With q set (runtime.Fused.RoPEStoreKV) it first rotates q [rows, qcols] in
// place and k by RoPE (heads of hd values), as the rope kernel would, and
// stores the rotated keys (k keeps them too); hg heads share each angle.
template <typename KV>
__device__ __forceinline__ void store_kv_body(KV* __restrict__ kc, KV* __restrict__ vc, float* __restrict__ k,
                                              const float* __restrict__ v, int rows, int kvDim, int pos0,
                                              const int* __restrict__ dpos, int maxSeq, KVQuant kq,
                                              float* __restrict__ q, int qcols, int hd, double theta, int layout,
                                              int hg) {
    long long it = blockIdx.x * (long long)blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    if (q == nullptr) {
        long long n = (long long)rows * kvDim;
        for (long long i = it; i < n; i += stride) {
            int r = (int)(i / kvDim), c = (int)(i % kvDim);
            int pos = row_pos(pos0, dpos, r);
            if (pos >= maxSeq) continue;
            float ks = 1.f, ko = 0.f, vs = 1.f, vo = 0.f;
            if constexpr (kv_quantized<KV>::value) { ks = kq.ks[c]; ko = kq.ko[c]; vs = kq.vs[c]; vo = kq.vo[c]; }
            kv_store(kc, (size_t)pos * kvDim + c, k[i], ks, ko);
            kv_store(vc, (size_t)pos * kvDim + c, v[i], vs, vo);
        }
        return;
    }
    // Items as rope's over the heads of q, then those of k; an item that
    // rotates a pair of keys also stores them and the two values at the
    // same places. An item issues the loads of up to ROPE_BATCH heads (the
    // pair of each, and a key head's two values) before any rotation or
    // store: one round trip to memory, not one every few heads (prefill of
    // 128 tokens on an H200: the launch 8.2 → 6.0 µs, kernels/NOTES.md,
    // sixty-first session).
    const int half = hd / 2, qh = qcols / hd, heads = qh + kvDim / hd;
    const int items = rows * half * ((heads + hg - 1) / hg);
    for (int j = (int)it; j < items; j += (int)stride) {
        RopeItem ri = rope_item(j, half, heads, hg);
        const int r = ri.r, pos = row_pos(pos0, dpos, r);
        const int a = layout ? 2 * ri.i : ri.i, b = layout ? 2 * ri.i + 1 : ri.i + half;  // rope_pair's
        for (int h0 = ri.h0; h0 < ri.h1; h0 += ROPE_BATCH) {
            const int nh = min(ROPE_BATCH, ri.h1 - h0);
            float xa[ROPE_BATCH], xb[ROPE_BATCH], va[ROPE_BATCH], vb[ROPE_BATCH];
            float* px[ROPE_BATCH];
#pragma unroll
            for (int e = 0; e < ROPE_BATCH; e++) {
                const int h = h0 + e;
                const bool in = e < nh, key = in && h >= qh;
                px[e] = h < qh ? q + (size_t)r * qcols + (size_t)h * hd : k + (size_t)r * kvDim + (size_t)(h - qh) * hd;
                const float* pv = v + (size_t)r * kvDim + (size_t)(h - qh) * hd;
                xa[e] = in ? px[e][a] : 0.f;
                xb[e] = in ? px[e][b] : 0.f;
                va[e] = key ? pv[a] : 0.f;
                vb[e] = key ? pv[b] : 0.f;
            }
            const RopePair rp = rope_pair(ri.i, hd, pos, theta, layout);  // its angle while the loads are out
#pragma unroll
            for (int e = 0; e < ROPE_BATCH; e++) {
                if (e >= nh) break;
                const int h = h0 + e;
                const float2 o = rope_rotate(rp, xa[e], xb[e]);
                px[e][a] = o.x;
                px[e][b] = o.y;
                if (h < qh || pos >= maxSeq) continue;
                const int c0 = (h - qh) * hd, ca = c0 + a, cb = c0 + b;
                const size_t row = (size_t)pos * kvDim;
                float ks = 1.f, ko = 0.f, vs = 1.f, vo = 0.f;
                if constexpr (kv_quantized<KV>::value) { ks = kq.ks[ca]; ko = kq.ko[ca]; vs = kq.vs[ca]; vo = kq.vo[ca]; }
                kv_store(kc, row + ca, o.x, ks, ko);
                kv_store(vc, row + ca, va[e], vs, vo);
                if constexpr (kv_quantized<KV>::value) { ks = kq.ks[cb]; ko = kq.ko[cb]; vs = kq.vs[cb]; vo = kq.vo[cb]; }
                kv_store(kc, row + cb, o.y, ks, ko);
                kv_store(vc, row + cb, vb[e], vs, vo);
            }
        }
    }
}

// store_kv*(kc, vc, k, v, rows, kvDim, pos0, dpos, maxSeq, [ks, ko, vs, vo,]
// q, qcols, hd, theta, layout, hg): q = 0 stores only.
#define STORE_KV_ROPE float *__restrict__ q, int qcols, int hd, double theta, int layout, int hg
extern "C" __global__ void store_kv(float* __restrict__ kc, float* __restrict__ vc, float* __restrict__ k,
                                    const float* __restrict__ v, int rows, int kvDim, int pos0,
                                    const int* __restrict__ dpos, int maxSeq, STORE_KV_ROPE) {
    PDL_ENTRY();
    store_kv_body(kc, vc, k, v, rows, kvDim, pos0, dpos, maxSeq, KVQuant{}, q, qcols, hd, theta, layout, hg);
}

extern "C" __global__ void store_kv_f16(__half* __restrict__ kc, __half* __restrict__ vc, float* __restrict__ k,
                                        const float* __restrict__ v, int rows, int kvDim, int pos0,
                                        const int* __restrict__ dpos, int maxSeq, STORE_KV_ROPE) {
    PDL_ENTRY();
    store_kv_body(kc, vc, k, v, rows, kvDim, pos0, dpos, maxSeq, KVQuant{}, q, qcols, hd, theta, layout, hg);
}

extern "C" __global__ void store_kv_i8(int8_t* __restrict__ kc, int8_t* __restrict__ vc, float* __restrict__ k,
                                       const float* __restrict__ v, int rows, int kvDim, int pos0,
                                       const int* __restrict__ dpos, int maxSeq, const float* __restrict__ ks,
                                       const float* __restrict__ ko, const float* __restrict__ vs,
                                       const float* __restrict__ vo, STORE_KV_ROPE) {
    PDL_ENTRY();
    store_kv_body(kc, vc, k, v, rows, kvDim, pos0, dpos, maxSeq, KVQuant{ks, ko, vs, vo}, q, qcols, hd, theta, layout, hg);
}


// rope_angles loads the (sin, cos) pairs rope_lane applies to the V values
// a lane holds of a head of hd (elements lane·V + i) from tab (rope_table's,
// hd/2 pairs a position): layout 0 pairs element e with e + hd/2, layout 1
// pairs 2i with 2i + 1 (V even).
template <int VM>
__device__ __forceinline__ void rope_angles(float2 (&sc)[VM], int lane, int V, int hd, const float2* __restrict__ tab,
                                            int layout) {
#pragma unroll
    for (int i = 0; i < VM; i++) {
        int e = lane * V + i;
        sc[i] = make_float2(0.f, 1.f);
        if (i >= V) continue;
        if (layout == 0) sc[i] = tab[e < hd / 2 ? e : e - hd / 2];
        else if ((i & 1) == 0) sc[i] = tab[e / 2];
    }
}

// rope_lane rotates the V values a lane holds of a head of hd exactly as
// rope_apply rotates them in memory, by rope_angles' pairs sc: layout 0's
// partner element is held by lane ^ 16, layout 1's within the lane.
template <int VM>
__device__ __forceinline__ void rope_lane(float (&x)[VM], int lane, int V, int hd, const float2 (&sc)[VM],
                                          int layout) {
    float px[VM];
#pragma unroll
    for (int i = 0; i < VM; i++) px[i] = __shfl_xor_sync(FULL, x[i], 16);
#pragma unroll
    for (int i = 0; i < VM; i++) {
        int e = lane * V + i;
        if (i >= V) continue;
        RopePair p;
        p.s = sc[i].x, p.c = sc[i].y;
        if (layout == 0) {
            bool lo = e < hd / 2;
            float2 o = rope_rotate(p, lo ? x[i] : px[i], lo ? px[i] : x[i]);
            x[i] = lo ? o.x : o.y;
        } else if ((i & 1) == 0 && i + 1 < VM) {
            float2 o = rope_rotate(p, x[i], x[i + 1]);
            x[i] = o.x;
            x[i + 1] = o.y;
        }
    }
}

// rope_table writes the (sin, cos) of RoPE pair i at position p, as
// rope_pair computes them, to tab[p·hd/2 + i] for positions below npos: the
// decode attention's angles (AttNew).
extern "C" __global__ void rope_table(float2* __restrict__ tab, int npos, int hd, double theta) {
    PDL_ENTRY();
    long long half = hd / 2, n = (long long)npos * half;
    for (long long j = blockIdx.x * (long long)blockDim.x + threadIdx.x; j < n; j += (long long)gridDim.x * blockDim.x) {
        RopePair p = rope_pair((int)(j % half), hd, (int)(j / half), theta, 0);
        tab[j] = make_float2(p.s, p.c);
    }
}

// QKVSink is the mir of out_tile_staged in a q/k/v launch with RoPE and
// the KV store fused (gemm_wg_*_segs_kv; runtime.Fused.NormMatMulStoreKV):
// a thread's four values of row m, columns n..n + 3 of the product of
// role 0 (q: rotated, into C as fp32), 1 (k: rotated, into the fp16 cache
// kc at row pos0 + m) or 2 (v: into vc). The rotation is store_kv's bit
// for bit: rope_rotate with rope_table's angles of (position, pair) from
// tab (hd/2 a position); layout 1 pairs the thread's own values (n even),
// layout 0 pairs column i of a head with i ± hd/2, lane ^ hd/8's (a warp
// holds 128 consecutive columns of one row, heads of 64 or 128 aligned to
// them: the host's checks, which also keep every position below the
// cache's maxSeq and the table's).
struct QKVSink {
    static constexpr bool takes = true;
    __half *kc, *vc;
    const float2* __restrict__ tab;
    int pos0, hd, layout, role;
    // The thread's columns n.. as bind fixed them (the same in every row of
    // out_tile_staged's loop): the table's pair offset within a position
    // and whether they are the low half of their head (layout 0). Taken
    // once a thread, not a division by hd a row.
    int tcol = 0;
    bool low = false;
    __device__ __forceinline__ void bind(int n) {
        const int h2 = hd / 2, i = n % hd;
        tcol = layout ? i / 2 : i < h2 ? i : i - h2;
        low = i < h2;
    }
    // Pre is the (sin, cos) of a thread's four values' pairs in row m
    // (layout 1: two pairs, in a), loaded by pre before the batch's values.
    struct Pre {
        float4 a, b;
    };
    __device__ __forceinline__ Pre pre(int m) const {
        Pre p{};
        if (role == 2) return p;
        const float4* t = reinterpret_cast<const float4*>(tab + (size_t)(pos0 + m) * (hd / 2) + tcol);
        p.a = t[0];
        if (!layout) p.b = t[1];
        return p;
    }
    // take4 stores the four values v of row m, columns n.. (bind's).
    __device__ __forceinline__ void take4(float* cp, int m, int N, int n, float4 v, const Pre& pr) const {
        const int pos = pos0 + m;
        if (role != 2) {
            float x[4] = {v.x, v.y, v.z, v.w};
            if (layout) {
                const float2 o0 = rope_rotate(RopePair{0, 0, pr.a.x, pr.a.y}, x[0], x[1]);
                const float2 o1 = rope_rotate(RopePair{0, 0, pr.a.z, pr.a.w}, x[2], x[3]);
                x[0] = o0.x, x[1] = o0.y, x[2] = o1.x, x[3] = o1.y;
            } else {
                float p[4];
#pragma unroll
                for (int e = 0; e < 4; e++) p[e] = __shfl_xor_sync(FULL, x[e], hd / 8);
                const float4 a = pr.a, b = pr.b;
                const float sn[4] = {a.x, a.z, b.x, b.z}, cs[4] = {a.y, a.w, b.y, b.w};
#pragma unroll
                for (int e = 0; e < 4; e++) {
                    const RopePair rp{0, 0, sn[e], cs[e]};
                    x[e] = low ? rope_rotate(rp, x[e], p[e]).x : rope_rotate(rp, p[e], x[e]).y;
                }
            }
            v = make_float4(x[0], x[1], x[2], x[3]);
        }
        if (role == 0) {
            *reinterpret_cast<float4*>(cp) = v;
            return;
        }
        __half2 h[2] = {__floats2half2_rn(v.x, v.y), __floats2half2_rn(v.z, v.w)};
        *reinterpret_cast<uint2*>((role == 1 ? kc : vc) + (size_t)pos * N + n) = *reinterpret_cast<const uint2*>(h);
    }
};

// AttNew is a decode row's own key and value (runtime.Fused.RoPEAttention):
// k and v [1, kvDim] as the products left them, the RoPE angles (rope_table,
// covering the row's position) and layout. With k set the kernel rotates q
// and the key itself, the blocks of the row's last split use the new key and
// value from shared memory, and the first query head of each KV head stores
// them in the cache after its loop (no block of the launch reads them from
// the cache, so the key loads need not wait for the stores).
struct AttNew {
    const float* k;
    const float* v;
    const float2* tab;
    int layout;
};

// ---------------------------------------------------------------------------
// Attention: causal GQA over the fp32, fp16 or int8 cache, flash-decoding
// style. grid (heads, T, nsplit), block 128 (4 warps). Split s covers keys
// [s*chunk, (s+1)*chunk) ∩ [0, pos_t], chunk from the row's position (see
// below); the splits past a row's last key return at once. Where one split
// holds all of a row's keys it writes dst; otherwise each writes its
// partials (max, sum, acc[hd]) and the last of
// the row's splits to finish (counted in cnt[t·heads + h], which it resets)
// merges them in split order, so results do not depend on the order the
// blocks ran in.
#define ATT_WARPS 4
#define ATT_MAX_CLUSTER 16  // the splits of a cluster launch (attention_*_cl) at most
// A thread block cluster's barrier in two halves (every thread of every
// block that has not exited arrives, then waits; the arrive releases what
// the thread wrote before, the wait acquires), stores into another block's
// shared memory in the cluster, and an arrival counter there (sm_90).
__device__ __forceinline__ void cluster_arrive() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.arrive.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void cluster_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("barrier.cluster.wait.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ unsigned dsmem_addr(const void* p, unsigned rank) {
    unsigned a = (unsigned)__cvta_generic_to_shared(p), r = a;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mapa.shared::cluster.u32 %0, %1, %2;" : "=r"(r) : "r"(a), "r"(rank));
#endif
    return r;
}
__device__ __forceinline__ void st_dsmem(float* p, unsigned rank, float v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.shared::cluster.f32 [%0], %1;" ::"r"(dsmem_addr(p, rank)), "f"(v) : "memory");
#endif
}
__device__ __forceinline__ void st_dsmem_f2(float2* p, unsigned rank, float2 v) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.shared::cluster.v2.f32 [%0], {%1, %2};" ::"r"(dsmem_addr(p, rank)), "f"(v.x), "f"(v.y) : "memory");
#endif
}
// st_dsmem4 stores four values at address a of a block's shared memory
// in the cluster (dsmem_addr's), floats as f32 operands (an integer view
// of a wgmma's float accumulators made NVVM copy them into integer
// registers before the wgmma's wait, and ptxas serialize the wgmma: C7514)
__device__ __forceinline__ void st_dsmem4(unsigned a, int x, int y, int z, int w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.shared::cluster.v4.b32 [%0], {%1, %2, %3, %4};" ::"r"(a), "r"(x), "r"(y), "r"(z), "r"(w) : "memory");
#endif
}
__device__ __forceinline__ void st_dsmem4(unsigned a, float x, float y, float z, float w) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("st.shared::cluster.v4.f32 [%0], {%1, %2, %3, %4};" ::"r"(a), "f"(x), "f"(y), "f"(z), "f"(w) : "memory");
#endif
}
// dsmem_arrive adds one to the counter *p of block rank with release
// semantics at cluster scope: what this thread wrote before, and what its
// block's threads wrote before a __syncthreads it passed since, is visible
// to a thread that reads the new count with cluster_count (a release is
// cumulative over the barrier's causality order, PTX ISA memory
// consistency model; so the writers need no fence of their own).
__device__ __forceinline__ void dsmem_arrive(unsigned* p, unsigned rank) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("red.release.cluster.shared::cluster.add.u32 [%0], 1;" ::"r"(dsmem_addr(p, rank)) : "memory");
#endif
}
__device__ __forceinline__ unsigned cluster_count(const unsigned* p) {
    unsigned v = 0;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("ld.acquire.cluster.shared::cta.u32 %0, [%1];" : "=r"(v) : "r"((unsigned)__cvta_generic_to_shared(p)) : "memory");
#endif
    return v;
}
// cluster_blocks is the launch's blocks a cluster (1 without clusters).
__device__ __forceinline__ unsigned cluster_blocks() {
    unsigned n = 1;
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("mov.u32 %0, %%cluster_nctarank;" : "=r"(n));
#endif
    return n;
}
// split_to_memory reports whether this block is one K split of a Hopper
// GEMM launch whose splits merge through memory (its partial sums to the
// output + z·M·N, for sum_splits or w8a8_sum_splits): a launch split along
// z and not run as one cluster a tile (those merge in shared memory,
// gw_scatter or gw_merge_splits).
__device__ __forceinline__ bool split_to_memory() { return gridDim.z > 1 && cluster_blocks() == 1; }
#define ATT_MAX_SPLITS 256  // the grid's splits at most (attnMaxSplits)
#define ATT_MERGE_U 8      // partial sums a thread of the merge loads at once
// att_merge writes the row's output from its ns splits' partials, in
// split order whatever order they ran in: their (max, sum) pairs (ml(r))
// read at once into sml, then each output value's ns partial sums
// (acc(r, d)), ATT_MERGE_U loads in flight a thread. The global merge reads
// them from memory, the cluster's from the splits' shared memory: the same
// operations either way.
template <typename ML, typename ACC>
__device__ __forceinline__ void att_merge(float* __restrict__ out, int ns, int hd, float2* sml, ML ml, ACC acc) {
    for (int r = threadIdx.x; r < ns; r += blockDim.x) sml[r] = ml(r);
    __syncthreads();
    float M = -INFINITY;
    for (int r = 0; r < ns; r++) M = fmaxf(M, sml[r].x);
    float L = 0.f;
    for (int r = 0; r < ns; r++) L += sml[r].y * __expf(sml[r].x - M);
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.f;
        for (int r0 = 0; r0 < ns; r0 += ATT_MERGE_U) {
            float v[ATT_MERGE_U];
#pragma unroll
            for (int u = 0; u < ATT_MERGE_U; u++) v[u] = acc(min(r0 + u, ns - 1), d);
#pragma unroll
            for (int u = 0; u < ATT_MERGE_U; u++)
                if (r0 + u < ns) a += v[u] * __expf(sml[r0 + u].x - M);
        }
        out[d] = a / L;
    }
}
// A cluster's merge area, in split 0's shared memory: each other split
// stores its partials (max, sum) and acc[hd] at its rank and counts itself
// in cnt. One object a kernel (att_cluster_smem), only in the kernels that
// merge in a cluster.
template <int VM>
struct AttClusterSmem {
    float acc[ATT_MAX_CLUSTER][32 * VM];
    float2 ml[ATT_MAX_CLUSTER];
    unsigned cnt;
};
template <int VM>
__device__ __forceinline__ AttClusterSmem<VM>& att_cluster_smem() {
    __shared__ AttClusterSmem<VM> c;
    return c;
}
// U keys a warp step, each lane holding VM values of a key (VM ≥ hd/32):
// 8 keys of head size ≤ 128 or 4 of ≤ 256, the same registers; a warp
// issues all its step's loads before it uses any.
template <typename KV, int U, int VM, bool CL = false>
__device__ __forceinline__ void attention_body(
    float* __restrict__ dst, const float* __restrict__ q, KV* __restrict__ kc,
    KV* __restrict__ vc, float* __restrict__ part_ml, float* __restrict__ part_acc, int* __restrict__ cnt,
    int heads, int kvHeads, int hd, int pos0, const int* __restrict__ dpos, float scale,
    int nsplit, KVQuant kq, AttNew nw, KV* __restrict__ skv) {
    int h = blockIdx.x, t = blockIdx.y, s = blockIdx.z;
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    // Before the wait (pdl_wait below) the block reads only what kernels at
    // least two launches back wrote: the graph's position (argmax's advance,
    // the step before; through L2), the cached keys and values below the
    // launch's first row (the launch before may be the store of its rows)
    // and the RoPE angles (rope_table, launched at least two launches
    // before the first attention that reads them: ropeTable).
    int p0 = row_pos(pos0, dpos, 0);
    int pos = p0 + t;
    int nkeys = pos + 1;
    // Keys a split: the row's keys over the grid's splits, at least 32 (a
    // block's step), in multiples of 32; a function of the row's position
    // and the grid alone, so a graph-captured step splits as a launch for
    // that position does.
    int chunk = (max(32, (nkeys + nsplit - 1) / nsplit) + 31) & ~31;
    int ns = (nkeys + chunk - 1) / chunk;  // the splits holding keys of row t
    // (CL: a block that exits counts as arrived at the cluster's barrier)
    if (s >= ns) return;
    if constexpr (CL) {
        // Split 0's arrival counter is zeroed before any split passes the
        // barrier, which the others wait on only before their partials go
        // to split 0 (below), long after every block arrived.
        if (ns > 1) {
            if (s == 0 && threadIdx.x == 0) att_cluster_smem<VM>().cnt = 0;
            cluster_arrive();
        }
    }
    int j0 = s * chunk, j1 = min(nkeys, j0 + chunk);
    int kvDim = kvHeads * hd;
    int kvh = h / (heads / kvHeads);
    int V = hd >> 5;  // values per lane, hd % 32 == 0, hd <= 32*VM
    // The warp's first step of keys below p0, copied into shared memory
    // (16-byte pieces of each key's and value's row of the head), so that
    // their loads overlap the kernel ahead and the q loads after the wait.
    int jpre = min(j1, p0);  // keys below jpre come from skv in the first step
    // 16-byte pieces of a head's row: n16 of at most P a row of skv
    constexpr int P = 32 * VM * (int)sizeof(KV) / 16;
    int n16 = hd * (int)sizeof(KV) / 16;
    // Piece i % P of row i / P of the warp's part (key u = r, or value
    // u = r - U), for the keys in [jlo, jhi); the other slots are left as
    // they are (their keys are past the split, or the row's own, which the
    // loop takes from skn and svn), so no two copies write one slot.
    auto kv_copy = [&](int i, int jlo, int jhi) {
        int r = i / P, c = i % P, j = j0 + U * w + r % U;
        if (c < n16 && j >= jlo && j < jhi) {
            const KV* src = (r < U ? kc : vc) + (size_t)j * kvDim + (size_t)kvh * hd;
            cp_async16_zfill(reinterpret_cast<char*>(skv + (w * 2 * U + r) * 32 * VM) + 16 * c,
                             reinterpret_cast<const char*>(src) + 16 * c, true);
        }
    };
    for (int i = lane; i < 2 * U * P; i += 32) kv_copy(i, 0, jpre);
    cp_async_commit();
    float2 rsc[VM];  // the row's RoPE angles
    if (nw.k) rope_angles(rsc, lane, V, hd, nw.tab + (size_t)pos * (hd / 2), nw.layout);
    pdl_wait();
    pdl_trigger();
    __shared__ float sm[ATT_WARPS], sl[ATT_WARPS];
    __shared__ float sacc[ATT_WARPS][32 * VM];
    float qr[VM], acc[VM];
    const float* qp = q + (size_t)t * heads * hd + (size_t)h * hd + lane * V;
    // The row's own key and value (the last split's blocks), loaded with q:
    // one round trip to L2, not one for each before its RoPE.
    bool own = nw.k && s == ns - 1;
    float kn[VM], vn[VM];
#pragma unroll
    for (int i = 0; i < VM; i++) { qr[i] = i < V ? qp[i] : 0.f; acc[i] = 0.f; }
    if (own) {
        const float* kp = nw.k + (size_t)kvh * hd + lane * V;
        const float* vp = nw.v + (size_t)kvh * hd + lane * V;
#pragma unroll
        for (int i = 0; i < VM; i++) {
            kn[i] = i < V ? kp[i] : 0.f;
            vn[i] = i < V ? vp[i] : 0.f;
        }
    }
    // The own key and value as the cache will give them back, kept in
    // shared memory for the loop (each lane reads back only what it wrote:
    // no barrier).
    __shared__ float skn[32 * VM], svn[32 * VM];
    if (nw.k) rope_lane(qr, lane, V, hd, rsc, nw.layout);
    if (own) {
        rope_lane(kn, lane, V, hd, rsc, nw.layout);
#pragma unroll
        for (int i = 0; i < VM; i++) {
            if (i >= V) continue;
            int c = kvh * hd + lane * V + i;
            float ks = 1.f, ko = 0.f, vs = 1.f, vo = 0.f;
            if constexpr (kv_quantized<KV>::value) { ks = kq.ks[c]; ko = kq.ko[c]; vs = kq.vs[c]; vo = kq.vo[c]; }
            skn[lane * V + i] = kv_cached(kc, kn[i], ks, ko);
            svn[lane * V + i] = kv_cached(vc, vn[i], vs, vo);
        }
    }
#pragma unroll
    for (int i = 0; i < VM; i++) qr[i] *= scale;
    // An int8 cache is read as codes, its quantizers applied algebraically:
    // q·k̂ = Σ q_i·s_i·(k_i − o_i) = Σ (q_i·s_i)·k_i − Σ q_i·s_i·o_i, and the
    // second sum is the same for every key of this query and head, which
    // softmax ignores, so the key scales go into q and the key offsets drop
    // out; Σ p·v̂ = s·(Σ p·v − o·Σ p) per value channel, applied to each
    // warp's sums after the loop. Fewer registers than dequantizing every
    // element, the same result up to float rounding.
    if constexpr (kv_quantized<KV>::value) {
#pragma unroll
        for (int i = 0; i < VM; i++)
            if (i < V) qr[i] *= kq.ks[kvh * hd + lane * V + i];
    }
    float m = -INFINITY, l = 0.f;
    if (!nw.k) {  // the first step's keys from jpre (the launch before may have stored them)
        for (int i = lane; i < 2 * U * P; i += 32) kv_copy(i, jpre, j1);
        cp_async_commit();
    }
    asm volatile("cp.async.wait_all;\n" ::: "memory");
    __syncwarp();
    // Each warp takes U consecutive keys at a time (all loads first, for
    // memory-level parallelism), warps interleaved by U*ATT_WARPS keys, the
    // first step's from skv.
    for (int jb = j0 + U * w; jb < j1; jb += U * ATT_WARPS) {
        float kr[U][VM], vr[U][VM];
        if (jb == j0 + U * w) {
#pragma unroll
            for (int u = 0; u < U; u++) {
                kv_row(kr[u], skv + (w * 2 * U + u) * 32 * VM + lane * V, V);
                kv_row(vr[u], skv + ((w * 2 + 1) * U + u) * 32 * VM + lane * V, V);
            }
        } else {
#pragma unroll
            for (int u = 0; u < U; u++) {
                int j = min(jb + u, j1 - 1);
                kv_row(kr[u], kc + (size_t)j * kvDim + (size_t)kvh * hd + lane * V, V);
            }
#pragma unroll
            for (int u = 0; u < U; u++) {
                int j = min(jb + u, j1 - 1);
                kv_row(vr[u], vc + (size_t)j * kvDim + (size_t)kvh * hd + lane * V, V);
            }
        }
        float d[U];
        if (own) {  // the row's own key, which the cache does not hold yet
#pragma unroll
            for (int u = 0; u < U; u++)
                if (jb + u == pos) {
#pragma unroll
                    for (int i = 0; i < VM; i++)
                        if (i < V) kr[u][i] = skn[lane * V + i], vr[u][i] = svn[lane * V + i];
                }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            float a = 0.f;
#pragma unroll
            for (int i = 0; i < VM; i++) a += qr[i] * kr[u][i];
            d[u] = a;
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
#pragma unroll
            for (int u = 0; u < U; u++) d[u] += __shfl_xor_sync(FULL, d[u], o);
        }
        float mn = m;
#pragma unroll
        for (int u = 0; u < U; u++) if (jb + u < j1) mn = fmaxf(mn, d[u]);
        float corr = __expf(m - mn);  // m = -inf at the start: corr = 0
        l *= corr;
#pragma unroll
        for (int i = 0; i < VM; i++) acc[i] *= corr;
#pragma unroll
        for (int u = 0; u < U; u++) {
            if (jb + u < j1) {
                float p = __expf(d[u] - mn);
                l += p;
#pragma unroll
                for (int i = 0; i < VM; i++) acc[i] = fmaf(p, vr[u][i], acc[i]);
            }
        }
        m = mn;
    }
    if (own && h % (heads / kvHeads) == 0) {  // the first query head of the KV head stores them
#pragma unroll
        for (int i = 0; i < VM; i++) {
            if (i >= V) continue;
            size_t c = (size_t)pos * kvDim + kvh * hd + lane * V + i;
            kv_put(kc, c, skn[lane * V + i]);
            kv_put(vc, c, svn[lane * V + i]);
        }
    }
    if constexpr (kv_quantized<KV>::value) {
#pragma unroll
        for (int i = 0; i < VM; i++) {
            int c = kvh * hd + lane * V + i;
            if (i < V) acc[i] = kq.vs[c] * (acc[i] - kq.vo[c] * l);
        }
    }
    if (lane == 0) { sm[w] = m; sl[w] = l; }
#pragma unroll
    for (int i = 0; i < VM; i++) if (i < V) sacc[w][lane * V + i] = acc[i];
    __syncthreads();
    float M = -INFINITY;
    for (int i = 0; i < ATT_WARPS; i++) M = fmaxf(M, sm[i]);
    float L = 0.f;
    float f[ATT_WARPS];
    for (int i = 0; i < ATT_WARPS; i++) {
        f[i] = sm[i] == -INFINITY ? 0.f : __expf(sm[i] - M);
        L += sl[i] * f[i];
    }
    float* out = dst + (size_t)t * heads * hd + (size_t)h * hd;
    if (ns == 1) {
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            float a = 0.f;
            for (int i = 0; i < ATT_WARPS; i++) a += sacc[i][d] * f[i];
            out[d] = a / L;
        }
        return;
    }
    if constexpr (CL) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
        // The row's splits are one cluster (rank s): each other split
        // stores its partials in split 0's shared memory, counts itself
        // there and leaves; split 0 waits for the count and merges them as
        // the last split does below (the same operations in the same order).
        AttClusterSmem<VM>& c = att_cluster_smem<VM>();
        __shared__ float2 sml2[ATT_MAX_CLUSTER];
        cluster_wait();  // split 0 has zeroed its counter
        for (int d = threadIdx.x; d < hd; d += blockDim.x) {
            float a = 0.f;
            for (int i = 0; i < ATT_WARPS; i++) a += sacc[i][d] * f[i];
            if (s == 0)
                c.acc[0][d] = a;
            else
                st_dsmem(&c.acc[s][d], 0, a);
        }
        if (threadIdx.x == 0) {
            if (s == 0)
                c.ml[0] = make_float2(M, L);
            else
                st_dsmem_f2(&c.ml[s], 0, make_float2(M, L));
        }
        if (s != 0) {
            __syncthreads();
            if (threadIdx.x == 0) dsmem_arrive(&c.cnt, 0);
            return;
        }
        if (threadIdx.x == 0)
            while (cluster_count(&c.cnt) < (unsigned)(ns - 1)) {
            }
        __syncthreads();  // with the acquire above: the partials are in
        att_merge(out, ns, hd, sml2, [&](int r) { return c.ml[r]; }, [&](int r, int d) { return c.acc[r][d]; });
#endif
        return;
    }
    size_t pi0 = ((size_t)t * heads + h) * nsplit, pi = pi0 + s;
    if (threadIdx.x == 0) { part_ml[2 * pi] = M; part_ml[2 * pi + 1] = L; }
    for (int d = threadIdx.x; d < hd; d += blockDim.x) {
        float a = 0.f;
        for (int i = 0; i < ATT_WARPS; i++) a += sacc[i][d] * f[i];
        part_acc[pi * hd + d] = a;
    }
    int ci = t * heads + h;
    if (!last_block(cnt, ci, ns)) return;
    // The row's last split merges the ns partials (every split has keys).
    __shared__ float2 sml[ATT_MAX_SPLITS];
    att_merge(out, ns, hd, sml, [&](int r) { return __ldcg(reinterpret_cast<const float2*>(part_ml) + pi0 + r); },
              [&](int r, int d) { return __ldcg(part_acc + (pi0 + r) * hd + d); });
}

// attention_run picks the warp step of head size hd.
template <typename KV, bool CL = false>
__device__ __forceinline__ void attention_run(float* dst, const float* q, KV* kc, KV* vc, float* part_ml,
                                              float* part_acc, int* cnt, int heads, int kvHeads, int hd, int pos0,
                                              const int* dpos, float scale, int nsplit, KVQuant kq, AttNew nw) {
    // each warp's first step of keys and values (U·VM = 32 in both forms)
    __shared__ __align__(16) KV skv[ATT_WARPS * 2 * 32 * 32];
    if (hd <= 128)
        attention_body<KV, 8, 4, CL>(dst, q, kc, vc, part_ml, part_acc, cnt, heads, kvHeads, hd, pos0, dpos, scale,
                                     nsplit, kq, nw, skv);
    else if constexpr (CL)  // the cluster merge holds 128 values a split (clusterAttention)
        __trap();
    else
        attention_body<KV, 4, 8, CL>(dst, q, kc, vc, part_ml, part_acc, cnt, heads, kvHeads, hd, pos0, dpos, scale,
                                     nsplit, kq, nw, skv);
}

// Args (dst, q, kc, vc, part_ml, part_acc, cnt, heads, kvHeads, hd, pos0,
// dpos, scale, nsplit, kn, vn, rtab, layout [, ks, ko, vs, vo]): kn = 0
// reads every key from the cache; kn set (one row) is AttNew.
#define ATTENTION_ARGS(KV)                                                                                     \
    float *__restrict__ dst, const float *__restrict__ q, KV *__restrict__ kc, KV *__restrict__ vc,           \
        float *__restrict__ part_ml, float *__restrict__ part_acc, int *__restrict__ cnt, int heads, int kvHeads, \
        int hd, int pos0, const int *__restrict__ dpos, float scale, int nsplit, const float *__restrict__ kn,  \
        const float *__restrict__ vn, const float2 *__restrict__ rtab, int layout
extern "C" __global__ void __launch_bounds__(128) attention(ATTENTION_ARGS(float)) {
    attention_run(dst, q, kc, vc, part_ml, part_acc, cnt, heads, kvHeads, hd, pos0, dpos, scale, nsplit, KVQuant{},
                  AttNew{kn, vn, rtab, layout});
}

extern "C" __global__ void __launch_bounds__(128) attention_f16(ATTENTION_ARGS(__half)) {
    attention_run(dst, q, kc, vc, part_ml, part_acc, cnt, heads, kvHeads, hd, pos0, dpos, scale, nsplit, KVQuant{},
                  AttNew{kn, vn, rtab, layout});
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
// The same with a row's splits as one thread block cluster (grid z, at most
// ATT_MAX_CLUSTER; head size at most 128), merged in split 0's shared
// memory: no partials in global memory.
extern "C" __global__ void __launch_bounds__(128) attention_f16_cl(ATTENTION_ARGS(__half)) {
    attention_run<__half, true>(dst, q, kc, vc, part_ml, part_acc, cnt, heads, kvHeads, hd, pos0, dpos, scale, nsplit,
                                KVQuant{}, AttNew{kn, vn, rtab, layout});
}
#endif

extern "C" __global__ void __launch_bounds__(128) attention_i8(ATTENTION_ARGS(int8_t), const float* __restrict__ ks,
                                                               const float* __restrict__ ko, const float* __restrict__ vs,
                                                               const float* __restrict__ vo) {
    attention_run(dst, q, kc, vc, part_ml, part_acc, cnt, heads, kvHeads, hd, pos0, dpos, scale, nsplit,
                  KVQuant{ks, ko, vs, vo}, AttNew{kn, vn, rtab, layout});
}
// at_put2 stores a/l and b/l, a row's normalised outputs, through dst;
// rl is at_rcp(dst, l), taken once a row. Where at_quot<Out> (fp16, AtF16)
// rl is RN(1/l) and the stores take RN(a/l) from quot_rn (l in [1, keys],
// |a| below l·65504; an a below 2^-60, taken as ±0, is ±0 in fp16 too);
// the fp32 output divides. (The int8 codes, QOut, take RN(a/l) so too, in
// at_store_codes.)
template <typename Out>
constexpr bool at_quot = false;
template <typename Out>
__device__ __forceinline__ float at_rcp(const Out&, float l) {
    if constexpr (at_quot<Out>)
        return __frcp_rn(l);
    else
        return 0.f;
}
template <typename Out>
__device__ __forceinline__ void at_put2(const Out& dst, size_t i, float a, float b, float l, float rl) {
    if constexpr (at_quot<Out>)
        dst.put2(i, quot_rn(a, l, rl), quot_rn(b, l, rl));
    else
        dst.put2(i, a / l, b / l);
}

// Prefill attention on the tensor cores (FlashAttention-2 style) for T ≥
// a few dozen rows at positions pos0 + t: grid (heads, units), block 128
// (4 warps × 16 query rows), a block a query tile of 64 rows or a part of
// its keys (AtUnit below), the tiles with the most keys first. q·scale·log2 e
// and each tile of 64 keys (an int8 cache dequantized as (q − o)·s first)
// go to shared memory as fp16 pairs x ≈ hi + lo, and S = Q·Kᵀ is Qhi·Khi + Qlo·Khi + Qhi·Klo on
// mma.sync m16n8k16 with fp32 accumulators, and O = P·V likewise as
// Phi·Vhi + Plo·Vhi + Phi·Vlo: near-fp32 results (single fp16 operands give
// relative errors of ~3e-4, which the int8 activations of a W8A8 model turn
// into perplexity differences of 1e-3 against the CPU). An fp16 cache has
// no lo parts: attn_tc_f16 (attn_tc_h_body) copies its tiles unconverted
// with cp.async, one tile landing while the previous one is multiplied,
// and leaves out the products with Klo and Vlo (zero), which gives the same
// sums. Causal mask and online softmax in fp32 registers. Head size a
// multiple of 32, at most 128. Dynamic shared memory: AT_SMEM.
#define AT_Q 64
#define AT_K 64
#define AT_LD 136  // halfs per row of Ks (128 + 8): also stages Q
#define AT_VLD 72  // halfs per row of Vt (64 keys + 8)
#define AT_SMEM ((2 * AT_K * AT_LD + 2 * 128 * AT_VLD) * 2)
static_assert(4 * AT_K * AT_LD * 2 <= AT_SMEM, "attn_tc_h_body's two K and two V tiles exceed AT_SMEM");
// at_store_codes is at_store for the
// int8 codes (QOut: attn_tc_f16_q, whose head size 128 it assumes
// unchecked): RN(o/l) of this thread's values (quot_rn) into a stage of
// the block's QR rows in shared memory (the key and value buffers, free
// once every warp is past its last tile), then the codes of four values
// a thread a step (quant_fast, QOut's put4) from the stage, a row's 128
// in one warp's 128 contiguous bytes, in a loop of few instructions (all
// the block's threads; in a block of two key groups, attn_tc_h_body's G =
// 2, only group 0's hold rows: holds).
// Stored as at_put2 stores them, all 64 values of a thread unrolled
// (~3 400 instructions, each run once a warp), the launch's epilogue
// missed the instruction cache: half its stall samples were "no
// instruction", and attn_tc_f16_q took 19.5 µs against attn_tc_f16_h's
// 12.8 at 128 tokens, 32 heads, on an H200; with the stage, W8A8 prefill
// of 128 tokens ran 3 % faster (sixty-sixth session). The same codes: the
// same quot_rn and quant_fast.
#define AT_SLD 136  // floats a row of the codes' stage: float2 stores of 4 rows a half warp on 32 banks
static_assert(AT_Q * AT_SLD * 4 <= AT_SMEM, "at_store_codes' stage exceeds AT_SMEM");
// QR: the block's query rows (AT_Q, or 32 for attn_tc_h_body's blocks of
// 32 rows: QR / 16 warps a key group).
template <int QR = AT_Q>
__device__ __forceinline__ void at_store_codes(const QOut& dst, const float (&o)[16][4], int tlo, int T, int heads,
                                               int h, float l0, float l1, bool holds = true) {
    extern __shared__ __align__(16) unsigned char at_smem[];
    float* stage = reinterpret_cast<float*>(at_smem);
    const int lane = threadIdx.x & 31, r = ((threadIdx.x >> 5) & (QR / 16 - 1)) * 16 + (lane >> 2), tq = lane & 3,
              t0 = tlo - r;
    const float rl0 = __frcp_rn(l0), rl1 = __frcp_rn(l1);
    __syncthreads();  // every warp done with the key and value tiles
    if (holds)
#pragma unroll
        for (int nt = 0; nt < 16; nt++) {
            const int d = nt * 8 + 2 * tq;
            *reinterpret_cast<float2*>(stage + r * AT_SLD + d) =
                make_float2(quot_rn(o[nt][0], l0, rl0), quot_rn(o[nt][1], l0, rl0));
            *reinterpret_cast<float2*>(stage + (r + 8) * AT_SLD + d) =
                make_float2(quot_rn(o[nt][2], l1, rl1), quot_rn(o[nt][3], l1, rl1));
        }
    __syncthreads();
    const int rows = min(QR, T - t0);
#pragma unroll 2
    for (int e = threadIdx.x; e < rows * 32; e += blockDim.x) {  // 32 float4s a row
        const int rr = e >> 5, c = (e & 31) * 4;
        dst.put4((size_t)(t0 + rr) * heads * 128 + (size_t)h * 128 + c,
                 *reinterpret_cast<const float4*>(stage + rr * AT_SLD + c));
    }
}
// at_store stores o/l of this thread's rows tlo and tlo + 8 below T (sums
// l0 and l1) of head h: at_store_codes for the int8 codes (attn_tc_f16_q,
// head size 128), else at_put2 a pair of columns at a time.
template <typename Out>
__device__ __forceinline__ void at_store(const Out& dst, const float (&o)[16][4], int tlo, int T, int heads, int hd,
                                         int h, float l0, float l1) {
    if constexpr (std::is_same_v<Out, QOut>) {
        at_store_codes(dst, o, tlo, T, heads, h, l0, l1);
    } else {
        const int tq = threadIdx.x & 3, thi = tlo + 8;
        const float rl0 = at_rcp(dst, l0), rl1 = at_rcp(dst, l1);
#pragma unroll
        for (int nt = 0; nt < 16; nt++) {
            if (nt < (hd >> 3)) {
                int d = nt * 8 + 2 * tq;
                if (tlo < T) at_put2(dst, (size_t)tlo * heads * hd + (size_t)h * hd + d, o[nt][0], o[nt][1], l0, rl0);
                if (thi < T) at_put2(dst, (size_t)thi * heads * hd + (size_t)h * hd + d, o[nt][2], o[nt][3], l1, rl1);
            }
        }
    }
}
__device__ __forceinline__ uint2 split_h4(float a, float b, float c, float d, uint2& lo) {
    __half2 h0 = __floats2half2_rn(a, b), h1 = __floats2half2_rn(c, d);
    float2 f0 = __half22float2(h0), f1 = __half22float2(h1);
    lo = make_uint2(pack_h2(a - f0.x, b - f0.y), pack_h2(c - f1.x, d - f1.y));
    return make_uint2(*reinterpret_cast<uint32_t*>(&h0), *reinterpret_cast<uint32_t*>(&h1));
}
typedef __half AtRow[AT_LD];
// at_q_read reads the warp's 16 rows from qr of the staged Qh and Ql
// back as A fragments (k16 step ks in qa[ks], ql[ks]) once every thread's
// stores are in, and ends with a barrier: Qh and Ql may then be reused.
__device__ __forceinline__ void at_q_read(uint32_t (&qa)[8][4], uint32_t (&ql)[8][4], const AtRow* Qh,
                                          const AtRow* Ql, int hd, int qr) {
    const int lane = threadIdx.x & 31, gid = lane >> 2, tq = lane & 3;
    __syncthreads();
#pragma unroll
    for (int ks = 0; ks < 8; ks++) {
        if (ks < (hd >> 4)) {
            int k0 = ks * 16 + 2 * tq;
            qa[ks][0] = *reinterpret_cast<const uint32_t*>(&Qh[qr + gid][k0]);
            qa[ks][1] = *reinterpret_cast<const uint32_t*>(&Qh[qr + gid + 8][k0]);
            qa[ks][2] = *reinterpret_cast<const uint32_t*>(&Qh[qr + gid][k0 + 8]);
            qa[ks][3] = *reinterpret_cast<const uint32_t*>(&Qh[qr + gid + 8][k0 + 8]);
            ql[ks][0] = *reinterpret_cast<const uint32_t*>(&Ql[qr + gid][k0]);
            ql[ks][1] = *reinterpret_cast<const uint32_t*>(&Ql[qr + gid + 8][k0]);
            ql[ks][2] = *reinterpret_cast<const uint32_t*>(&Ql[qr + gid][k0 + 8]);
            ql[ks][3] = *reinterpret_cast<const uint32_t*>(&Ql[qr + gid + 8][k0 + 8]);
        }
    }
    __syncthreads();
}
// AtQ is a thread's share of the block's QR query rows of head size hd ≤
// 128 (float4 unit e = tid + NT·i: row e / (hd / 4), zeros from row T on),
// loaded into registers by at_q_load, so that attn_tc_h_body issues those
// loads before its first key and value tile's copies. Issued after them
// (32 cp.async a thread in the 32-row blocks), q's loads waited behind
// them: their first use held 14 % of the W8A8 attention's stall samples
// at 128 tokens, and W8A8 prefill gained 0.6-1.7 % from the order
// (seventy-seventh session). NT is the block's threads, a constant: the
// loads unrolled and issued together (a stride of blockDim.x made the
// prefill attention's block ~2 µs slower, seventy-second session).
template <int NT, int QR>
struct AtQ {
    float4 v[QR * 32 / NT];
};
template <int NT, int QR>
__device__ __forceinline__ void at_q_load(AtQ<NT, QR>& a, const float* __restrict__ q, int t0, int T, int heads,
                                          int hd, int h) {
    const unsigned c4 = hd >> 2;
#pragma unroll
    for (int i = 0; i < QR * 32 / NT; i++) {
        const unsigned e = threadIdx.x + NT * i;
        const int r = e / c4, c = e % c4 * 4;
        a.v[i] = make_float4(0.f, 0.f, 0.f, 0.f);
        if ((hd == 128 || r < QR) && t0 + r < T)  // at head size 128 every unit's row is below QR
            a.v[i] = *reinterpret_cast<const float4*>(q + (size_t)(t0 + r) * heads * hd + (size_t)h * hd + c);
    }
}
// at_q_stage stages the query rows a holds (times scale·log2 e: sl2) in Qh
// and Ql as fp16 hi and lo parts and reads the warp's 16 rows from qr back
// as A fragments (at_q_read).
template <int NT, int QR>
__device__ __forceinline__ void at_q_stage(uint32_t (&qa)[8][4], uint32_t (&ql)[8][4], AtRow* Qh, AtRow* Ql,
                                           const AtQ<NT, QR>& a, int hd, float sl2, int qr) {
    const unsigned c4 = hd >> 2;
#pragma unroll
    for (int i = 0; i < QR * 32 / NT; i++) {
        const unsigned e = threadIdx.x + NT * i;
        const int r = e / c4, c = e % c4 * 4;
        if (hd != 128 && r >= QR) continue;
        const float4 v = a.v[i];
        uint2 lo;
        *reinterpret_cast<uint2*>(&Qh[r][c]) = split_h4(v.x * sl2, v.y * sl2, v.z * sl2, v.w * sl2, lo);
        *reinterpret_cast<uint2*>(&Ql[r][c]) = lo;
    }
    at_q_read(qa, ql, Qh, Ql, hd, qr);
}
// AtState is a warp's running softmax over the key tiles: this thread's
// outputs o (n8 column chunk nt of rows lo = row gid and hi = gid + 8),
// maxima m and sums l of its two rows.
// AtF32 is the prefill attention's output as floats; attn_tc_f16_q writes
// it as QOut's int8 codes instead (put2: values i and i + 1).
struct AtF32 {
    float* f;
    __device__ __forceinline__ void put2(size_t i, float a, float b) const {
        *reinterpret_cast<float2*>(f + i) = make_float2(a, b);
    }
};
// AtF16 is the prefill attention's output rounded to fp16 as to_half rounds
// it (pack_h2): o's input where o's GEMM takes fp16 (attn_tc_f16_h).
struct AtF16 {
    __half* h;
    __device__ __forceinline__ void put2(size_t i, float a, float b) const {
        *reinterpret_cast<uint32_t*>(h + i) = pack_h2(a, b);
    }
};
template <>
constexpr bool at_quot<AtF16> = true;  // attn_tc_f16_h's o/l without a division, as QOut's
struct AtState {
    float o[16][4];
    float m0, m1, l0, l1;
    __device__ __forceinline__ AtState() : m0(-INFINITY), m1(-INFINITY), l0(0.f), l1(0.f) {
#pragma unroll
        for (int nt = 0; nt < 16; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) o[nt][e] = 0.f;
    }
    // rescale masks the scores sc of keys j0..j0 + 63 after positions plo and
    // phi (this thread's rows) and moves m, l and o to the new maxima.
    __device__ __forceinline__ void rescale(float (&sc)[8][4], int j0, int plo, int phi) {
        int tq = threadIdx.x & 3;
        float mx0 = m0, mx1 = m1;
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 2; e++) {
                int key = j0 + nt * 8 + 2 * tq + e;
                if (key > plo) sc[nt][e] = -INFINITY;
                if (key > phi) sc[nt][2 + e] = -INFINITY;
                mx0 = fmaxf(mx0, sc[nt][e]);
                mx1 = fmaxf(mx1, sc[nt][2 + e]);
            }
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(FULL, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(FULL, mx1, 2));
        // mx stays -inf while a row has seen no key: a split of the keys
        // (at_unit) may start after a row of its query tile
        float c0 = mx0 == -INFINITY ? 0.f : exp2f(m0 - mx0), c1 = mx1 == -INFINITY ? 0.f : exp2f(m1 - mx1);
        m0 = mx0;
        m1 = mx1;
        l0 *= c0;
        l1 *= c1;
#pragma unroll
        for (int nt = 0; nt < 16; nt++) {
            o[nt][0] *= c0; o[nt][1] *= c0;
            o[nt][2] *= c1; o[nt][3] *= c1;
        }
    }
    // probs makes P's 16 keys of step kk (16kk..16kk + 15 of the tile) A
    // fragments, hi in pa and lo in pl, and adds them to l.
    __device__ __forceinline__ void probs(const float (&sc)[8][4], int kk, uint32_t (&pa)[4], uint32_t (&pl)[4]) {
        float b0 = m0 == -INFINITY ? 0.f : m0, b1 = m1 == -INFINITY ? 0.f : m1;  // no key seen: every p is 0
#pragma unroll
        for (int u = 0; u < 2; u++) {
            int nt = 2 * kk + u;
            float p0 = exp2f(sc[nt][0] - b0), p1 = exp2f(sc[nt][1] - b0);
            float p2 = exp2f(sc[nt][2] - b1), p3 = exp2f(sc[nt][3] - b1);
            l0 += p0 + p1;
            l1 += p2 + p3;
            uint2 lo;
            uint2 hi = split_h4(p0, p1, p2, p3, lo);
            pa[2 * u] = hi.x; pa[2 * u + 1] = hi.y;
            pl[2 * u] = lo.x; pl[2 * u + 1] = lo.y;
        }
    }
    // tile takes one key tile from j0: qk(sc) adds the warp's scores Q·Kᵀ of
    // its 64 keys to sc (zeroed here); after the mask and the softmax step,
    // pv(kk, pa, pl, o) adds P·V of keys 16kk..16kk + 15 to o, P as A
    // fragments hi (pa) and lo (pl).
    template <typename QK, typename PV>
    __device__ __forceinline__ void tile(int j0, int plo, int phi, QK qk, PV pv) {
        float sc[8][4];
#pragma unroll
        for (int nt = 0; nt < 8; nt++)
#pragma unroll
            for (int e = 0; e < 4; e++) sc[nt][e] = 0.f;
        qk(sc);
        rescale(sc, j0, plo, phi);
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            uint32_t pa[4], pl[4];
            probs(sc, kk, pa, pl);
            pv(kk, pa, pl, o);
        }
    }
    // sum_l adds the sums l of the four threads that share this thread's rows.
    __device__ __forceinline__ void sum_l() {
        l0 += __shfl_xor_sync(FULL, l0, 1);
        l0 += __shfl_xor_sync(FULL, l0, 2);
        l1 += __shfl_xor_sync(FULL, l1, 1);
        l1 += __shfl_xor_sync(FULL, l1, 2);
    }
    // store writes o/l for the rows tlo and tlo + 8 below T of head h.
    template <typename Out>
    __device__ __forceinline__ void store(const Out& dst, int tlo, int T, int heads, int hd, int h) {
        sum_l();
        at_store(dst, o, tlo, T, heads, hd, h, l0, l1);
    }
};
// The prefill attention splits the keys of its long query tiles: causal
// query tile qt (64 rows; 32 in attn_tc_h_body's 32-row blocks, whose
// tiles are never split) sees tiles(qt) = ⌊last key / 64⌋ + 1 key tiles,
// and without splits the block of the last query tile runs tiles(qt) steps
// while the first runs one, so a launch lasts as long as its longest block
// however many multiprocessors idle. A unit is at most ct consecutive key
// tiles of one query tile (ns = ⌈tiles/ct⌉ units a tile); grid (heads,
// units of all tiles), the units of the query tiles with most keys first.
// A tile of one unit stores its rows directly; the units of a split tile
// each write their unnormalised rows o and their softmax state (m, l) to
// part_o and part_ml at slot h·units + y, and the last of them to finish
// (a counter a (head, query tile) in cnt, back at 0 after it) combines the
// ns states in unit order: the same sums whichever unit comes last.
struct AtUnit {
    int qt, s, ns, y0;  // query tile, its unit s of ns, the tile's first unit in y
};
// AtSplit is a launch's split: ct key tiles a unit, units a head, and the
// scratch of split tiles (part_o: 64 × hd floats a slot, part_ml: 64 × 2,
// cnt: an int a (head, query tile), zero between launches).
struct AtSplit {
    int ct, units;
    float *part_o, *part_ml;
    int* cnt;
};
template <int QR = AT_Q>
__device__ __forceinline__ AtUnit at_unit(int y, int T, int pos0, int ct) {
    int y0 = 0;
    for (int qt = (T + QR - 1) / QR - 1;; qt--) {
        int last = pos0 + min(T, (qt + 1) * QR) - 1;
        int ns = (last / AT_K + ct) / ct;
        if (y < y0 + ns || qt == 0) return AtUnit{qt, y - y0, ns, y0};
        y0 += ns;
    }
}
// at_unit_scale is the factor that scales a unit's sums of a row, whose
// largest score is m, to the row's largest over all units, M: 0 for a
// unit that saw no key of the row (m −∞; M is finite, as unit 0 holds key
// 0). at_finish's merge and a two-key-group block's (attn_tc_h_body) share it.
__device__ __forceinline__ float at_unit_scale(float m, float M) { return m == -INFINITY ? 0.f : exp2f(m - M); }
// at_finish ends unit u of head h: rows tlo and tlo + 8 of the warp's
// state st (query rows from t0 = 64·u.qt; r = tlo − t0 in the tile).
template <typename Out>
__device__ __forceinline__ void at_finish(AtState& st, const AtUnit& u, const AtSplit& sp, const Out& dst,
                                          int tlo, int T, int heads, int hd, int h) {
    if (u.ns == 1) {
        st.store(dst, tlo, T, heads, hd, h);
        return;
    }
    __shared__ int at_last;
    int tq = threadIdx.x & 3, r = tlo - u.qt * AT_Q, nnt = hd >> 3;
    size_t slot0 = (size_t)h * sp.units + u.y0;
    float *part_o = sp.part_o, *part_ml = sp.part_ml;
    st.sum_l();
    float* po = part_o + (slot0 + u.s) * AT_Q * hd;
#pragma unroll
    for (int nt = 0; nt < 16; nt++) {
        if (nt < nnt) {
            int d = nt * 8 + 2 * tq;
            *reinterpret_cast<float2*>(po + (size_t)r * hd + d) = make_float2(st.o[nt][0], st.o[nt][1]);
            *reinterpret_cast<float2*>(po + (size_t)(r + 8) * hd + d) = make_float2(st.o[nt][2], st.o[nt][3]);
        }
    }
    if (tq == 0) {
        float* pm = part_ml + (slot0 + u.s) * AT_Q * 2;
        *reinterpret_cast<float2*>(pm + 2 * r) = make_float2(st.m0, st.l0);
        *reinterpret_cast<float2*>(pm + 2 * (r + 8)) = make_float2(st.m1, st.l1);
    }
    __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        int* c = sp.cnt + h * ((T + AT_Q - 1) / AT_Q) + u.qt;
        at_last = atomicAdd(c, 1) == u.ns - 1;
        if (at_last) *c = 0;  // every unit of the tile has counted
    }
    __syncthreads();
    if (!at_last) return;
    __threadfence();
    // unit 0 holds key 0, which every row sees: M is finite
    float M0 = -INFINITY, M1 = -INFINITY, L0 = 0.f, L1 = 0.f;
    for (int s = 0; s < u.ns; s++) {
        const float* pm = part_ml + (slot0 + s) * AT_Q * 2;
        M0 = fmaxf(M0, __ldcg(pm + 2 * r));
        M1 = fmaxf(M1, __ldcg(pm + 2 * (r + 8)));
    }
    float o[16][4];
#pragma unroll
    for (int nt = 0; nt < 16; nt++)
#pragma unroll
        for (int e = 0; e < 4; e++) o[nt][e] = 0.f;
    for (int s = 0; s < u.ns; s++) {
        const float* pm = part_ml + (slot0 + s) * AT_Q * 2;
        const float* ps = part_o + (slot0 + s) * AT_Q * hd;
        float2 a = __ldcg(reinterpret_cast<const float2*>(pm + 2 * r));
        float2 b = __ldcg(reinterpret_cast<const float2*>(pm + 2 * (r + 8)));
        float w0 = at_unit_scale(a.x, M0), w1 = at_unit_scale(b.x, M1);
        L0 += a.y * w0;
        L1 += b.y * w1;
#pragma unroll
        for (int nt = 0; nt < 16; nt++) {
            if (nt < nnt) {
                int d = nt * 8 + 2 * tq;
                float2 v0 = __ldcg(reinterpret_cast<const float2*>(ps + (size_t)r * hd + d));
                float2 v1 = __ldcg(reinterpret_cast<const float2*>(ps + (size_t)(r + 8) * hd + d));
                o[nt][0] += v0.x * w0; o[nt][1] += v0.y * w0;
                o[nt][2] += v1.x * w1; o[nt][3] += v1.y * w1;
            }
        }
    }
    at_store(dst, o, tlo, T, heads, hd, h, L0, L1);
}
template <typename KV>
__device__ __forceinline__ void attn_tc_body(AtF32 dst, const float* __restrict__ q,
                                             const KV* __restrict__ kc, const KV* __restrict__ vc, int T,
                                             int heads, int kvHeads, int hd, int pos0, float scale,
                                             AtSplit sp, KVQuant kq) {
    extern __shared__ __align__(16) unsigned char at_smem[];
    AtRow* Ks = reinterpret_cast<AtRow*>(at_smem);
    AtRow* Kl = reinterpret_cast<AtRow*>(at_smem + AT_K * AT_LD * 2);
    __half (*Vt)[AT_VLD] = reinterpret_cast<__half (*)[AT_VLD]>(at_smem + 2 * AT_K * AT_LD * 2);
    __half (*Vl)[AT_VLD] = reinterpret_cast<__half (*)[AT_VLD]>(at_smem + (2 * AT_K * AT_LD + 128 * AT_VLD) * 2);
    AtUnit u = at_unit(blockIdx.y, T, pos0, sp.ct);
    int h = blockIdx.x, t0 = u.qt * AT_Q;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, gid = lane >> 2, tq = lane & 3;
    int kvDim = kvHeads * hd, kvh = h / (heads / kvHeads);
    int nks = hd >> 4, nnt = hd >> 3, c4 = hd >> 2;
    int qr = warp * 16;
    uint32_t qa[8][4], ql[8][4];
    {
        AtQ<128, AT_Q> qv;
        at_q_load(qv, q, t0, T, heads, hd, h);
        at_q_stage(qa, ql, Ks, Kl, qv, hd, scale * 1.4426950408889634f, qr);
    }
    AtState st;
    int plo = pos0 + t0 + qr + gid, phi = plo + 8;  // this thread's two rows
    int wlast = pos0 + t0 + qr + 15;                // the warp's last row
    int last = pos0 + min(T, t0 + AT_Q) - 1;        // the block's last key
    int jfirst = u.s * sp.ct * AT_K, jend = min(last + 1, jfirst + sp.ct * AT_K);
    for (int j0 = jfirst; j0 < jend; j0 += AT_K) {
        if (j0 > jfirst) __syncthreads();  // the previous tile consumed
        for (int i = tid; i < AT_K * c4; i += 128) {
            int r = i % AT_K, c = (i / AT_K) * 4, j = j0 + r;
            float kx[8], vx[8];
            if (j <= last) {
                size_t off = (size_t)j * kvDim + (size_t)kvh * hd + c;
                kv_row(kx, kc + off, 4);
                kv_row(vx, vc + off, 4);
                if constexpr (kv_quantized<KV>::value) {
#pragma unroll
                    for (int e = 0; e < 4; e++) {
                        int ch = kvh * hd + c + e;
                        kx[e] = (kx[e] - kq.ko[ch]) * kq.ks[ch];
                        vx[e] = (vx[e] - kq.vo[ch]) * kq.vs[ch];
                    }
                }
            } else {
#pragma unroll
                for (int e = 0; e < 4; e++) kx[e] = vx[e] = 0.f;
            }
            uint2 lo;
            *reinterpret_cast<uint2*>(&Ks[r][c]) = split_h4(kx[0], kx[1], kx[2], kx[3], lo);
            *reinterpret_cast<uint2*>(&Kl[r][c]) = lo;
#pragma unroll
            for (int e = 0; e < 4; e++) {
                __half hv = __float2half_rn(vx[e]);
                Vt[c + e][r] = hv;
                Vl[c + e][r] = __float2half_rn(vx[e] - __half2float(hv));
            }
        }
        __syncthreads();
        if (j0 > wlast) continue;  // every key of the tile is after this warp's rows
        st.tile(
            j0, plo, phi,
            [&](float (&sc)[8][4]) {
                // one product on all eight accumulators a pass (as in
                // attn_tc_h_body), each summing in the same order
#pragma unroll
                for (int ks = 0; ks < 8; ks++) {
                    if (ks < nks) {
                        uint32_t b[8][2], c[8][2];
#pragma unroll
                        for (int nt = 0; nt < 8; nt++) {
                            b[nt][0] = *reinterpret_cast<const uint32_t*>(&Ks[nt * 8 + gid][ks * 16 + 2 * tq]);
                            b[nt][1] = *reinterpret_cast<const uint32_t*>(&Ks[nt * 8 + gid][ks * 16 + 2 * tq + 8]);
                            c[nt][0] = *reinterpret_cast<const uint32_t*>(&Kl[nt * 8 + gid][ks * 16 + 2 * tq]);
                            c[nt][1] = *reinterpret_cast<const uint32_t*>(&Kl[nt * 8 + gid][ks * 16 + 2 * tq + 8]);
                        }
#pragma unroll
                        for (int nt = 0; nt < 8; nt++) mma16816(sc[nt], ql[ks], b[nt][0], b[nt][1]);
#pragma unroll
                        for (int nt = 0; nt < 8; nt++) mma16816(sc[nt], qa[ks], c[nt][0], c[nt][1]);
#pragma unroll
                        for (int nt = 0; nt < 8; nt++) mma16816(sc[nt], qa[ks], b[nt][0], b[nt][1]);
                    }
                }
            },
            [&](int kk, const uint32_t (&pa)[4], const uint32_t (&pl)[4], float (&o)[16][4]) {
                // in two halves of eight accumulators (registers)
#pragma unroll
                for (int n0 = 0; n0 < 16; n0 += 8) {
                    uint32_t b[8][2], c[8][2];
#pragma unroll
                    for (int i = 0; i < 8; i++) {
                        int nt = n0 + i;
                        if (nt < nnt) {
                            b[i][0] = *reinterpret_cast<const uint32_t*>(&Vt[nt * 8 + gid][kk * 16 + 2 * tq]);
                            b[i][1] = *reinterpret_cast<const uint32_t*>(&Vt[nt * 8 + gid][kk * 16 + 2 * tq + 8]);
                            c[i][0] = *reinterpret_cast<const uint32_t*>(&Vl[nt * 8 + gid][kk * 16 + 2 * tq]);
                            c[i][1] = *reinterpret_cast<const uint32_t*>(&Vl[nt * 8 + gid][kk * 16 + 2 * tq + 8]);
                        }
                    }
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        if (n0 + i < nnt) mma16816(o[n0 + i], pl, b[i][0], b[i][1]);
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        if (n0 + i < nnt) mma16816(o[n0 + i], pa, c[i][0], c[i][1]);
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        if (n0 + i < nnt) mma16816(o[n0 + i], pa, b[i][0], b[i][1]);
                }
            });
    }
    at_finish(st, u, sp, dst, t0 + qr + gid, T, heads, hd, h);
}
// attn_tc_h_body is attn_tc_body for an fp16 cache: K and V tiles of 64
// keys, two buffers each (rows of AT_LD halfs, the values untransposed: the
// B fragments of P·V come from ldmatrix .trans), copied with cp.async
// (zeros past the block's last key, so masked probabilities meet zeros,
// not stale values); Q staged in the second buffers before the first tile.
// HD, when not 0, is the head size hd known at compile time (128: the
// fragment loops without predicates and their addresses folded). G = 2:
// a block of two key groups of QR / 16 warps (attn_tc_f16_g, _q_g, _h_g
// with QR = 64; _g32 with 32: twice the blocks, one warp a scheduler), each
// the block's QR query rows over every other key tile of the unit with
// buffers of its own (AT_SMEM2), group 1's state merged into group 0's in
// shared memory with at_finish's arithmetic for two units (group 0's
// first); only for units that are whole query tiles (the host's choice; a
// split tile traps). The longest block of a 128-token prefill then runs
// one key tile a warp where it ran two, and the int8 codes' epilogue
// (at_store_codes) runs on twice the threads.
#define AT_SMEM2 (8 * AT_K * AT_LD * 2)
#define AT_MLD 132  // floats a row of G = 2's merge area
static_assert(AT_Q * AT_MLD * 4 + AT_Q * 2 * 4 <= AT_SMEM2 && AT_Q * AT_SLD * 4 <= AT_SMEM2, "G = 2's merge exceeds AT_SMEM2");
template <int HD, typename Out, int G = 1, int QR = AT_Q>
__device__ __forceinline__ void attn_tc_h_body(Out dst, const float* __restrict__ q,
                                               const __half* __restrict__ kc, const __half* __restrict__ vc, int T,
                                               int heads, int kvHeads, int hd_, int pos0, float scale, AtSplit sp) {
    static_assert(QR == AT_Q || (QR == 32 && G == 2), "attn_tc_h_body: 32-row blocks only in two key groups");
    constexpr int GT = 2 * QR, GTL = QR == 32 ? 6 : 7;  // a key group's threads (QR / 16 warps), their log2
    static_assert(GT == 1 << GTL, "attn_tc_h_body: a key group's threads a power of two");
    const int hd = HD ? HD : hd_;
    extern __shared__ __align__(16) unsigned char at_smem[];
    int tid = threadIdx.x, lane = tid & 31, warp = G > 1 ? (tid >> 5) & (QR / 16 - 1) : tid >> 5, gid = lane >> 2;
    const int g = G > 1 ? tid >> GTL : 0, gt = G > 1 ? tid & (GT - 1) : tid;  // key group, thread within it
    AtRow* Ks = reinterpret_cast<AtRow*>(at_smem) + g * 4 * AT_K;  // group g's [2][AT_K], then V likewise
    AtRow* Vs = Ks + 2 * AT_K;
    AtUnit u = at_unit<QR>(blockIdx.y, T, pos0, sp.ct);
    if (G > 1 && u.ns != 1) __trap();  // a host error: G = 2 merges no split tile
    int h = blockIdx.x, t0 = u.qt * QR;
    int kvDim = kvHeads * hd, kvh = h / (heads / kvHeads);
    int nks = hd >> 4, nnt = hd >> 3, c8 = hd >> 3;
    int last = pos0 + min(T, t0 + QR) - 1;  // the block's last key
    int jt0 = u.s * sp.ct, tiles = min(last / AT_K + 1, jt0 + sp.ct);  // this unit's key tiles jt0..tiles − 1
    // the group's i-th tile, jt0 + g + G·i, in buffers i & 1: the first in
    // buffers 0, as Q is staged in group 0's buffers 1
    auto load = [&](int i) {
        const int jt = jt0 + g + G * i;
        AtRow *K = Ks + (i & 1) * AT_K, *V = Vs + (i & 1) * AT_K;
        for (int e = gt; e < AT_K * c8; e += GT) {
            int r = e / c8, c = (e % c8) * 8, j = jt * AT_K + r;
            bool v = j <= last;
            size_t off = (size_t)(v ? j : 0) * kvDim + (size_t)kvh * hd + c;
            cp_async16_zfill(&K[r][c], kc + off, v);
            cp_async16_zfill(&V[r][c], vc + off, v);
        }
        cp_async_commit();
    };
    const int n = (tiles - jt0 - g + G - 1) / G;  // the group's tiles
    // the unit's arithmetic above reads nothing an earlier kernel writes:
    // it runs while the kernel before this one finishes (the entries below
    // have no PDL_ENTRY)
    pdl_wait();
    pdl_trigger();
    int qr = warp * 16;
    uint32_t qa[8][4], ql[8][4];
    {  // q's loads first (AtQ), then the tile's copies
        AtRow* K0 = reinterpret_cast<AtRow*>(at_smem);
        AtQ<GT * G, QR> qv;
        at_q_load(qv, q, t0, T, heads, hd, h);
        if (n > 0) load(0);
        at_q_stage(qa, ql, K0 + AT_K, K0 + 3 * AT_K, qv, hd, scale * 1.4426950408889634f, qr);
    }
    AtState st;
    int plo = pos0 + t0 + qr + gid, phi = plo + 8;  // this thread's two rows
    int wlast = pos0 + t0 + qr + 15;                // the warp's last row
    // a group's barrier: the whole block where G = 1
    auto gsync = [&]() {
        if constexpr (G > 1)
            named_sync(1 + g, GT);
        else
            __syncthreads();
    };
    for (int i = 0; i < n; i++) {
        if (i + 1 < n) {
            load(i + 1);
            asm volatile("cp.async.wait_group 1;\n" ::: "memory");
        } else {
            asm volatile("cp.async.wait_group 0;\n" ::: "memory");
        }
        gsync();  // tile i landed for every thread's copies
        int j0 = (jt0 + g + G * i) * AT_K;
        const AtRow *K = Ks + (i & 1) * AT_K, *V = Vs + (i & 1) * AT_K;
        if (j0 <= wlast)  // else every key of the tile is after this warp's rows
            st.tile(
                j0, plo, phi,
                [&](float (&sc)[8][4]) {
                    // b[nt]: K rows 8nt..8nt + 7 at dims 16ks.. (b[nt][0],
                    // b[nt][1]) and 16(ks + 1).. (b[nt][2], b[nt][3]). Each
                    // pass runs one product on all eight accumulators, so
                    // that consecutive mma never wait on each other (each
                    // accumulator sums in the same order as one at a time)
#pragma unroll
                    for (int ks = 0; ks < 8; ks += 2) {
                        if (ks < nks) {
                            uint32_t b[8][4];
#pragma unroll
                            for (int nt = 0; nt < 8; nt++) ldmatrix_x4(b[nt], &K[nt * 8 + (lane & 7)][(2 * ks + (lane >> 3)) * 8]);
#pragma unroll
                            for (int nt = 0; nt < 8; nt++) mma16816(sc[nt], ql[ks], b[nt][0], b[nt][1]);
#pragma unroll
                            for (int nt = 0; nt < 8; nt++) mma16816(sc[nt], qa[ks], b[nt][0], b[nt][1]);
#pragma unroll
                            for (int nt = 0; nt < 8; nt++) mma16816(sc[nt], ql[ks + 1], b[nt][2], b[nt][3]);
#pragma unroll
                            for (int nt = 0; nt < 8; nt++) mma16816(sc[nt], qa[ks + 1], b[nt][2], b[nt][3]);
                        }
                    }
                },
                [&](int kk, const uint32_t (&pa)[4], const uint32_t (&pl)[4], float (&o)[16][4]) {
                    // b[i]: keys 16kk..16kk + 15 of dims 16i.. (b[i][0],
                    // b[i][1]) and 16i + 8.. (b[i][2], b[i][3]), transposed;
                    // the lo products on every accumulator, then the hi ones
                    uint32_t b[8][4];
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        if (2 * i < nnt) ldmatrix_x4_trans(b[i], &V[kk * 16 + (lane & 15)][(2 * i + (lane >> 4)) * 8]);
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        if (2 * i < nnt) {
                            mma16816(o[2 * i], pl, b[i][0], b[i][1]);
                            mma16816(o[2 * i + 1], pl, b[i][2], b[i][3]);
                        }
#pragma unroll
                    for (int i = 0; i < 8; i++)
                        if (2 * i < nnt) {
                            mma16816(o[2 * i], pa, b[i][0], b[i][1]);
                            mma16816(o[2 * i + 1], pa, b[i][2], b[i][3]);
                        }
                });
        gsync();  // tile i consumed before its buffers take tile i + 2
    }
    if constexpr (G == 1) {
        at_finish(st, u, sp, dst, t0 + qr + gid, T, heads, hd, h);
    } else {
        // group 1's rows (o, and m and l summed over the row's lanes) into
        // the merge area, then group 0's as at_finish's merge of two units
        float* mo = reinterpret_cast<float*>(at_smem);
        float* mml = mo + AT_Q * AT_MLD;
        const int r = qr + gid, tq = lane & 3;
        st.sum_l();
        __syncthreads();  // every group past its last tile: the buffers free
        if (g == 1) {
#pragma unroll
            for (int nt = 0; nt < 16; nt++) {
                if (nt < nnt) {
                    int d = nt * 8 + 2 * tq;
                    *reinterpret_cast<float2*>(mo + r * AT_MLD + d) = make_float2(st.o[nt][0], st.o[nt][1]);
                    *reinterpret_cast<float2*>(mo + (r + 8) * AT_MLD + d) = make_float2(st.o[nt][2], st.o[nt][3]);
                }
            }
            if (tq == 0) {
                *reinterpret_cast<float2*>(mml + 2 * r) = make_float2(st.m0, st.l0);
                *reinterpret_cast<float2*>(mml + 2 * (r + 8)) = make_float2(st.m1, st.l1);
            }
        }
        __syncthreads();
        float L0 = 0.f, L1 = 0.f;
        float o[16][4];
        if (g == 0) {
            // group 0 holds key 0, which every row sees: M is finite
            const float2 a = *reinterpret_cast<const float2*>(mml + 2 * r);
            const float2 b = *reinterpret_cast<const float2*>(mml + 2 * (r + 8));
            const float M0 = fmaxf(st.m0, a.x), M1 = fmaxf(st.m1, b.x);
            const float u0 = at_unit_scale(st.m0, M0), u1 = at_unit_scale(st.m1, M1);
            const float w0 = at_unit_scale(a.x, M0), w1 = at_unit_scale(b.x, M1);
            L0 += st.l0 * u0;
            L1 += st.l1 * u1;
            L0 += a.y * w0;
            L1 += b.y * w1;
#pragma unroll
            for (int nt = 0; nt < 16; nt++) {
                o[nt][0] = 0.f; o[nt][1] = 0.f; o[nt][2] = 0.f; o[nt][3] = 0.f;
                if (nt < nnt) {
                    int d = nt * 8 + 2 * tq;
                    const float2 v0 = *reinterpret_cast<const float2*>(mo + r * AT_MLD + d);
                    const float2 v1 = *reinterpret_cast<const float2*>(mo + (r + 8) * AT_MLD + d);
                    o[nt][0] += st.o[nt][0] * u0; o[nt][1] += st.o[nt][1] * u0;
                    o[nt][2] += st.o[nt][2] * u1; o[nt][3] += st.o[nt][3] * u1;
                    o[nt][0] += v0.x * w0; o[nt][1] += v0.y * w0;
                    o[nt][2] += v1.x * w1; o[nt][3] += v1.y * w1;
                }
            }
        }
        if constexpr (std::is_same_v<Out, QOut>) {
            at_store_codes<QR>(dst, o, t0 + r, T, heads, h, L0, L1, g == 0);  // its first barrier: the merge area read
        } else if (g == 0) {
            at_store(dst, o, t0 + r, T, heads, hd, h, L0, L1);
        }
    }
}
extern "C" __global__ void __launch_bounds__(128) attn_tc(float* dst, const float* q, const float* kc, const float* vc,
                                                          int T, int heads, int kvHeads, int hd, int pos0, float scale,
                                                          int ct, int units, float* part_o, float* part_ml, int* cnt) {
    PDL_ENTRY();
    attn_tc_body(AtF32{dst}, q, kc, vc, T, heads, kvHeads, hd, pos0, scale, AtSplit{ct, units, part_o, part_ml, cnt}, KVQuant{});
}
// attn_tc_f16 is attn_tc for an fp16 cache (attn_tc_h_body). attn_tc_f16_q
// is it for head size 128 with its output written as the int8 input of a
// W8A8 o projection with a static quantizer (QOut{dq, qs, qo}): no fp32
// output, no quant_act (runtime.Fused's AttentionAdd). attn_tc_f16_h is it
// for head size 128 with its output written in fp16 (AtF16), the input of
// an o whose GEMM takes fp16: no fp32 output, no to_half (AttentionAdd).
// The three with the suffix _g run blocks of two key groups
// (attn_tc_h_body's G = 2; 256 threads, AT_SMEM2), for launches whose
// units are whole query tiles; those with _g32 blocks of 32 query rows in
// two key groups of two warps (QR = 32; 128 threads), for launches whose
// 64-row blocks would leave over half the multiprocessors idle. None waits
// for the kernel before it at entry: attn_tc_h_body does, after its unit's
// arithmetic and before its first copy.
#define ATTN_TC_F16_ENTRIES(SUF, G, QR)                                                                            \
    extern "C" __global__ void __launch_bounds__(2 * QR * G)                                                       \
        attn_tc_f16##SUF(float* dst, const float* q, const __half* kc, const __half* vc, int T, int heads,         \
                         int kvHeads, int hd, int pos0, float scale, int ct, int units, float* part_o,             \
                         float* part_ml, int* cnt) {                                                               \
        AtSplit sp{ct, units, part_o, part_ml, cnt};                                                               \
        if (hd == 128)                                                                                             \
            attn_tc_h_body<128, AtF32, G, QR>(AtF32{dst}, q, kc, vc, T, heads, kvHeads, hd, pos0, scale, sp);      \
        else                                                                                                       \
            attn_tc_h_body<0, AtF32, G, QR>(AtF32{dst}, q, kc, vc, T, heads, kvHeads, hd, pos0, scale, sp);        \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(2 * QR * G)                                                       \
        attn_tc_f16_q##SUF(int8_t* dq, float qs, float qo, const float* q, const __half* kc, const __half* vc,     \
                           int T, int heads, int kvHeads, int pos0, float scale, int ct, int units, float* part_o, \
                           float* part_ml, int* cnt) {                                                             \
        attn_tc_h_body<128, QOut, G, QR>(QOut{dq, qs, qo}, q, kc, vc, T, heads, kvHeads, 128, pos0, scale,         \
                                         AtSplit{ct, units, part_o, part_ml, cnt});                                \
    }                                                                                                              \
    extern "C" __global__ void __launch_bounds__(2 * QR * G)                                                       \
        attn_tc_f16_h##SUF(__half* dh, const float* q, const __half* kc, const __half* vc, int T, int heads,       \
                           int kvHeads, int pos0, float scale, int ct, int units, float* part_o, float* part_ml,   \
                           int* cnt) {                                                                             \
        attn_tc_h_body<128, AtF16, G, QR>(AtF16{dh}, q, kc, vc, T, heads, kvHeads, 128, pos0, scale,               \
                                          AtSplit{ct, units, part_o, part_ml, cnt});                               \
    }
ATTN_TC_F16_ENTRIES(, 1, AT_Q)
ATTN_TC_F16_ENTRIES(_g, 2, AT_Q)
ATTN_TC_F16_ENTRIES(_g32, 2, 32)
extern "C" __global__ void __launch_bounds__(128) attn_tc_i8(float* dst, const float* q, const int8_t* kc, const int8_t* vc,
                                                             int T, int heads, int kvHeads, int hd, int pos0, float scale,
                                                             int ct, int units, float* part_o, float* part_ml, int* cnt,
                                                             const float* ks, const float* ko, const float* vs, const float* vo) {
    PDL_ENTRY();
    attn_tc_body(AtF32{dst}, q, kc, vc, T, heads, kvHeads, hd, pos0, scale, AtSplit{ct, units, part_o, part_ml, cnt},
                 KVQuant{ks, ko, vs, vo});
}

// ---------------------------------------------------------------------------
// Tensor parallelism: the all-reduce over peer memory (runtime/cuda/peer.go).
//
// Every rank of a group owns an exchange area in its GPU's memory that every
// rank can address (peer access within a process, CUDA IPC across
// processes), with AR_LANES lanes that each keep their own grid, flags and
// stages (a small grid for the latency of small sums, the whole device for
// large ones):
//   u64   areas[AR_MAX_RANKS]                the group's areas, as this rank addresses them
//   then per lane:
//   u32   flags[AR_MAX_RANKS][AR_MAX_BLOCKS] flags[s][b]: the last call block b of rank s reached
//   u32   calls[AR_MAX_BLOCKS]               the calls block b of this rank has made
//   and from AR_HEADER + stage_off floats, per lane:
//   float stage[2][world][cap]               stage[p][s]: rank s's values, by the call's parity p
//                                            (lane 0: u64, allreduce_peer_ll)
// In a call every rank runs the lane's grid on the same n. Block b numbers the
// call e, writes its slice of x (float4 j with j mod gridDim == b) into
// stage[e & 1][rank] of every peer (remote writes are posted, so the values
// cross the link once without a round trip), tells every peer's block b that
// it reached e, waits until every peer's block b has, then sums the slice
// over the ranks in rank order (every rank gets the same bits) from x and
// its own stage, local reads only, into x. Two stages suffice: block b
// writes a peer's stage[e & 1] again in call e + 2, after that peer's block
// b reached e + 1, which it started after its whole call e, the reads
// included. A peer that does not arrive within timeout_ns traps (the
// launch fails) instead of hanging. With sent set (lane 1), the product
// before the all-reduce on this rank's stream (gemm_wg_*_tp) has written
// x's values into the peers' stage[e & 1][rank] already, so the blocks
// only raise and wait for the flags and sum: the flags follow the
// product's writes in stream order (the product's grid has completed), and
// the two-stage argument holds for the product as for block b, since it
// runs after this rank's whole call e + 1.
#define AR_MAX_RANKS 8
#define AR_MAX_BLOCKS 128
#define AR_LANES 2
#define AR_LANE_SYNC (4 * (AR_MAX_RANKS + 1) * AR_MAX_BLOCKS)  // bytes of a lane's flags and calls
#define AR_HEADER 16384
static_assert(8 * AR_MAX_RANKS + AR_LANES * AR_LANE_SYNC <= AR_HEADER, "AR_HEADER");
// exchange_peer's second meeting (the normed rows gathered) has flags of
// its own, [AR_MAX_RANKS][AR_MAX_BLOCKS] after the lanes', numbered by lane
// 1's calls.
#define AR_GATHER_SYNC (8 * AR_MAX_RANKS + AR_LANES * AR_LANE_SYNC)

__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_release_sys(unsigned* p, unsigned v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}
__device__ __forceinline__ unsigned long long ld_relaxed_sys_u64(const unsigned long long* p) {
    unsigned long long v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_relaxed_sys_u64(unsigned long long* p, unsigned long long v) {
    asm volatile("st.relaxed.sys.global.u64 [%0], %1;" ::"l"(p), "l"(v) : "memory");
}

// ar_call numbers this block's call of a lane whose call counters are
// calls: every thread gets e, one more than calls[blockIdx.x]; with advance
// thread 0 counts it there at once (allreduce_peer_ll with sent counts it
// when it has summed: the GEMVs that sent read the counter too).
__device__ __forceinline__ unsigned ar_call(unsigned* calls, bool advance = true) {
    __shared__ unsigned s_call;
    if (threadIdx.x == 0) {
        unsigned e = __ldcg(calls + blockIdx.x) + 1;
        if (advance) calls[blockIdx.x] = e;
        s_call = e;
    }
    __syncthreads();
    return s_call;
}

// Lane 0's call counters (ar_call), and its stage[e & 1][sender] (u64 words,
// allreduce_peer_ll) in the area at address area.
__device__ __forceinline__ unsigned* ar_calls0(char* area) {
    return reinterpret_cast<unsigned*>(area + 8 * AR_MAX_RANKS) + AR_MAX_RANKS * AR_MAX_BLOCKS;
}
__device__ __forceinline__ long long ar_stage0_off(long long stage_off, long long cap, unsigned e, int world,
                                                   int sender) {
    return AR_HEADER + 4 * stage_off + 8 * (((long long)(e & 1) * world + sender) * cap);
}
__device__ __forceinline__ unsigned long long* ar_stage0(unsigned long long area, long long stage_off, long long cap,
                                                         unsigned e, int world, int sender) {
    return reinterpret_cast<unsigned long long*>(area + ar_stage0_off(stage_off, cap, e, world, sender));
}

// ar_stage1 is lane 1's stage[e & 1][sender] of floats (stage_off and cap
// the lane's, in floats: allreduce_peer's layout) in the area at address
// area, as ar_stage0 is lane 0's of words.
__device__ __forceinline__ float* ar_stage1(unsigned long long area, long long stage_off, long long cap, unsigned e,
                                            int world, int sender) {
    return reinterpret_cast<float*>(reinterpret_cast<char*>(area) + AR_HEADER) + stage_off +
           ((long long)(e & 1) * world + sender) * cap;
}

// A sequence-parallel exchange (exchange_peer) splits an M-row matrix by
// its 128-row tiles: rank r owns tiles [r·T/world, (r+1)·T/world) of the
// T = ⌈M/128⌉, i.e. rows [128·(r·T/world), 128·((r+1)·T/world)) ∩ [0, M).
__device__ __forceinline__ int sp_owner(int tile, int T, int world) {
    int o = 0;
    while (o + 1 < world && tile >= (o + 1) * T / world) o++;
    return o;
}
__device__ __forceinline__ int sp_row(int r, int M, int world) {
    return min(M, 128 * (r * ((M + 127) / 128) / world));
}

// ar_meet is a block's meeting of call e: after the block's writes to the
// peers (every thread's, before it), thread p ≠ rank makes them visible,
// tells peer p's block b that this block reached e (its flags at sync_off:
// flags[s][b], the sender s), and waits until peer p's block b has told
// it the same, trapping after timeout_ns.
__device__ __forceinline__ void ar_meet(char* area, long long sync_off, int rank, int world, unsigned e,
                                        unsigned long long timeout_ns) {
    const int b = blockIdx.x, t = threadIdx.x;
    __syncthreads();
    if (t < world && t != rank) {
        __threadfence_system();
        char* peer = reinterpret_cast<char*>(reinterpret_cast<const unsigned long long*>(area)[t]);
        st_release_sys(reinterpret_cast<unsigned*>(peer + sync_off) + rank * AR_MAX_BLOCKS + b, e);
        const unsigned* f = reinterpret_cast<const unsigned*>(area + sync_off) + t * AR_MAX_BLOCKS + b;
        unsigned long long t0 = 0;
        while ((int)(ld_acquire_sys(f) - e) < 0) {
            unsigned long long now = global_ns();
            if (t0 == 0) t0 = now;
            else if (now - t0 > timeout_ns) __trap();
        }
    }
    __syncthreads();
}

// PeerMirror stores a row-parallel product's values, as they are stored
// into C, at the same offsets of the tensor-parallel peers' stages d[0..n)
// (the all-reduce's lane 1: allreduce_peer, whose write phase then has
// nothing left to do).
struct PeerMirror {
    static constexpr bool takes = false;
    struct Pre {};
    float* d[AR_MAX_RANKS - 1];
    int n;
    __device__ __forceinline__ void put4(size_t i, float4 v) const {
#pragma unroll 1
        for (int p = 0; p < n; p++) *reinterpret_cast<float4*>(d[p] + i) = v;
    }
    __device__ __forceinline__ void put1(size_t i, float v) const {
#pragma unroll 1
        for (int p = 0; p < n; p++) d[p][i] = v;
    }
};
// peer_mirror is the PeerMirror of a product that rank sends to lane 1 of
// the group whose area (this rank's) that is, stage_off and cap the lane's
// (gemm_wg_*_tp): stage[e & 1][rank] of every peer, e one more than the
// lane's call counter of block 0.
// ar_next_call1 is the number of lane 1's next call: one more than block
// 0's call counter, which no block advances before the caller's grid is done.
__device__ __forceinline__ unsigned ar_next_call1(const char* area) {
    const long long sync_off = 8 * AR_MAX_RANKS + AR_LANE_SYNC;  // lane 1's flags, in bytes
    return __ldcg(reinterpret_cast<const unsigned*>(area + sync_off) + AR_MAX_RANKS * AR_MAX_BLOCKS) + 1;
}
__device__ __forceinline__ PeerMirror peer_mirror(const char* area, int rank, int world, long long stage_off,
                                                  long long cap) {
    unsigned e = ar_next_call1(area);
    const unsigned long long* areas = reinterpret_cast<const unsigned long long*>(area);
    PeerMirror m;
    m.n = 0;
#pragma unroll 1
    for (int p = 0; p < world && p < AR_MAX_RANKS; p++)
        if (p != rank)
            m.d[m.n++] = ar_stage1(areas[p], stage_off, cap, e, world, rank);
    return m;
}

// A decode step's all-reduce may take its summands straight from the GEMV
// that computes them (runtime/cuda/peer.go's MatMulAllReduce): the GEMV
// writes each value it would store as lane 0's word (the value and the
// call's number e) into stage[e & 1][rank] of every rank, its own included,
// and allreduce_peer_ll with sent set only sums the words (the same sums in
// the same order), without waiting for the GEMV to end: no launch boundary
// between the product and the exchange. The GEMV takes e from the counter
// of the all-reduce block that sums value i (i / 256 mod its grid: 256
// threads, a value each), which that block advances only after it has
// summed all its values, so every GEMV block reads it first; and the lane's
// shape from the ArLane0 that ConnectPeerReduce writes at AR_LANE0.
struct ArLane0 {
    int rank, world, blocks, pad;
    long long stage_off, cap;
};
#define AR_LANE0 (AR_HEADER - 64)
static_assert(AR_GATHER_SYNC + 4 * AR_MAX_RANKS * AR_MAX_BLOCKS <= AR_LANE0, "AR_LANE0");

// ArSend is what a GEMV thread needs to send value i: the word's high half
// (e), the offset of stage[e & 1][rank] in every area, and the first two
// areas (the rest are loaded when sent). ar_send_to issues its loads, so a
// GEMV calls it before its reductions and ar_send after them.
struct ArSend {
    unsigned long long hi, a0, a1;
    const unsigned long long* areas;
    long long off;
    int world;
};
__device__ __forceinline__ ArSend ar_send_to(char* __restrict__ area, int i) {
    const ArLane0* l = reinterpret_cast<const ArLane0*>(area + AR_LANE0);
    int world = l->world;
    unsigned e = __ldcg(ar_calls0(area) + (i >> 8) % l->blocks) + 1;
    const unsigned long long* areas = reinterpret_cast<const unsigned long long*>(area);
    ArSend s;
    s.hi = (unsigned long long)e << 32;
    s.a0 = areas[0];
    s.a1 = world > 1 ? areas[1] : 0;
    s.areas = areas;
    s.off = ar_stage0_off(l->stage_off, l->cap, e, world, l->rank) + 8LL * i;
    s.world = world;
    return s;
}
__device__ __forceinline__ void ar_send(const ArSend& s, float v) {
    unsigned long long w = s.hi | __float_as_uint(v);
    for (int p = 0; p < s.world; p++) {
        unsigned long long a = p == 0 ? s.a0 : p == 1 ? s.a1 : s.areas[p];
        st_relaxed_sys_u64(reinterpret_cast<unsigned long long*>(a + s.off), w);
    }
}

// ---------------------------------------------------------------------------
// GEMV (few activation rows): y[m, n] = sum_k x[m, k] * W[n, k].
// A block of 256 threads (8 warps) handles R output rows of one activation
// row m = blockIdx.y; the threads split K in chunks of 8 consecutive k
// (chunk c = it*256*U + u*256 + tid, so x loads are coalesced), reduce in
// shared memory at the end. Each thread first issues the loads of U chunks x
// R rows, then computes: R*U independent loads in flight per thread.
#define GEMV_THREADS 256

// What a GEMV does with its sums: store them, add them to y (the residual
// add, runtime.Fused.MatMulAdd), or (streaming q4 kernel only) the SwiGLU
// of two weights' sums.
enum { GEMV_STORE = 0, GEMV_ADD = 1, GEMV_SWIGLU = 2 };

__device__ __forceinline__ void load_x8(const float* __restrict__ x, int k, float* xv) {
    float4 a = *reinterpret_cast<const float4*>(x + k);
    float4 b = *reinterpret_cast<const float4*>(x + k + 4);
    xv[0] = a.x; xv[1] = a.y; xv[2] = a.z; xv[3] = a.w;
    xv[4] = b.x; xv[5] = b.y; xv[6] = b.z; xv[7] = b.w;
}

// send (or null): the row is the summand of an all-reduce, sent to the
// group's stages instead of stored (ar_send; m = 0).
template <int R>
__device__ __forceinline__ void gemv_finish(float (&acc)[R], float* __restrict__ y, int m, int N, int n0, int mode,
                                            char* __restrict__ send) {
    __shared__ float red[GEMV_THREADS / 32][R];
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5;
    // GEMV_ADD: the residual, loaded before the reduction hides its latency
    float yold = mode == GEMV_ADD && threadIdx.x < R && n0 + (int)threadIdx.x < N ? y[(size_t)m * N + n0 + threadIdx.x] : 0.f;
    ArSend to;
    if (send && threadIdx.x < R) to = ar_send_to(send, n0 + threadIdx.x);
#pragma unroll
    for (int r = 0; r < R; r++) {
        float v = warp_sum(acc[r]);
        if (lane == 0) red[w][r] = v;
    }
    __syncthreads();
    if (threadIdx.x < R) {
        int r = threadIdx.x;
        float v = 0.f;
#pragma unroll
        for (int i = 0; i < GEMV_THREADS / 32; i++) v += red[i][r];
        if (mode == GEMV_ADD) v = yold + v;
        if (n0 + r >= N) return;
        if (send) ar_send(to, v);
        else y[(size_t)m * N + n0 + r] = v;
    }
}

// gemv_body's weight formats (the 4-bit weights have their own kernels:
// gemvw_body, gemvs_body).
enum { GF32 = 0, GF16 = 1, GBF16 = 2, GQ8 = 3 };
// 32-bit words of one chunk of 8 weights.
template <int F> struct RawWords { static const int n = F == GF32 ? 8 : F == GQ8 ? 2 : 4; };

template <int F>
__device__ __forceinline__ void gw_load(uint32_t* raw, const void* __restrict__ W, size_t n, int K, int c, uint64_t pol) {
    if (F == GF32) {
        const uint4* p = reinterpret_cast<const uint4*>((const float*)W + n * K + (size_t)c * 8);
        uint4 a = ldg_once16(p, pol), b = ldg_once16(p + 1, pol);
        raw[0] = a.x; raw[1] = a.y; raw[2] = a.z; raw[3] = a.w; raw[4] = b.x; raw[5] = b.y; raw[6] = b.z; raw[7] = b.w;
    } else if (F == GF16 || F == GBF16) {
        uint4 a = ldg_once16((const uint16_t*)W + n * K + (size_t)c * 8, pol);
        raw[0] = a.x; raw[1] = a.y; raw[2] = a.z; raw[3] = a.w;
    } else {
        uint2 a = ldg_once8((const int8_t*)W + n * K + (size_t)c * 8, pol);
        raw[0] = a.x; raw[1] = a.y;
    }
}

// q4_h2 is (x & MASK) | 0x64006400 in one LOP3: with MASK 0x000f000f the
// half2 1024 + u of the nibbles at bits 0 and 16 of x, with 0x00f000f0 the
// half2 1024 + 16u of those at bits 4 and 20.
template <uint32_t MASK>
__device__ __forceinline__ __half2 q4_h2(uint32_t x) {
    uint32_t h;
    asm("lop3.b32 %0, %1, %2, %3, 0xea;" : "=r"(h) : "r"(x), "n"(MASK), "n"(0x64006400u));
    return *reinterpret_cast<__half2*>(&h);
}

// q4_pair_uz is the half2 (u - z) of element pair j (elements 2j, 2j + 1,
// at bits 4j and 16 + 4j) of a q4 word, z1024 = half2(1024 + z): exact.
__device__ __forceinline__ __half2 q4_pair_uz(uint32_t w, int j, __half2 z1024) {
    return __hsub2(q4_h2<0x000f000fu>(w >> (4 * j)), z1024);
}

// LOP3-style unpack of one q4 word: four half2 (u - z) pairs in k order.
__device__ __forceinline__ void q4_dequant_uz(uint32_t w, __half2 z1024, __half2 (&out)[4]) {
#pragma unroll
    for (int j = 0; j < 4; j++) out[j] = q4_pair_uz(w, j, z1024);
}

// q4_dot_staged is Σ x·(u − z) over the 32 codes of a 16-byte chunk of q4
// words w4, with x the matching 16 half2 in staged form (q4_stage_unit)
// and z1024 the chunk's half2(1024 + z): a word's 8 products summed in one
// half2 (four a half: at most 4 · 1 024 · 15 < 65 504 for staged values
// below 1 024), the four words' sums in fp32. The high nibbles are
// unpacked as 1024 + 16u without a shift, less half2(1024 + 16z).
__device__ __forceinline__ float q4_dot_staged(const uint32_t (&w4)[4], const __half2* __restrict__ xh, __half2 z1024) {
    constexpr uint32_t LO = 0x000f000fu, HI = 0x00f000f0u;
    // (1024 + z) * 16 - 15360 = 1024 + 16 z, exact in fp16.
    __half2 z16 = __hfma2(z1024, __float2half2_rn(16.f), __float2half2_rn(-15360.f));
    float p = 0.f;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        uint32_t w = w4[q], w8 = w4[q] >> 8;
        __half2 a = __hmul2(xh[4 * q], __hsub2(q4_h2<LO>(w), z1024));
        a = __hfma2(xh[4 * q + 1], __hsub2(q4_h2<HI>(w), z16), a);
        a = __hfma2(xh[4 * q + 2], __hsub2(q4_h2<LO>(w8), z1024), a);
        a = __hfma2(xh[4 * q + 3], __hsub2(q4_h2<HI>(w8), z16), a);
        float2 af = __half22float2(a);
        p += af.x + af.y;
    }
    return p;
}

// q4_stage_k is the exponent k ≥ 0 of 2^k by which the fp16-staged 4-bit
// GEMVs (gemv_q4_w2h, gemv_q4_sh) divide a run of x whose largest |x| is
// mx before staging it in fp16: 0 below 1 024, else the least k that
// brings mx below 1 024, so that q4_dot_staged's half sums cannot overflow
// (real models' activations reach thousands). At most 119 (mx infinite);
// scaling by it is exact but where a value falls below fp16's normal range.
__device__ __forceinline__ int q4_stage_k(float mx) { return max(0, ((__float_as_int(mx) >> 23) & 0xff) - 136); }
// pow2f is 2^k, for k within a float's normal exponents.
__device__ __forceinline__ float pow2f(int k) { return __int_as_float((127 + k) << 23); }
// fmax_nan is the larger of a and b, NaN where either is.
__device__ __forceinline__ float fmax_nan(float a, float b) {
    float d;
    asm("max.NaN.f32 %0, %1, %2;" : "=f"(d) : "f"(a), "f"(b));
    return d;
}
// absmax8 is the largest |x| of 8 features a, b: NaN skipped, or with KEEP_NAN
// NaN where one is.
template <bool KEEP_NAN = false>
__device__ __forceinline__ float absmax8(float4 a, float4 b) {
    auto mx = [](float p, float q) { return KEEP_NAN ? fmax_nan(p, q) : fmaxf(p, q); };
    return mx(mx(mx(fabsf(a.x), fabsf(a.y)), mx(fabsf(a.z), fabsf(a.w))), mx(mx(fabsf(b.x), fabsf(b.y)), mx(fabsf(b.z), fabsf(b.w))));
}
// q4_stage_unit is the staged form of 8 features of x (a, b: in order)
// divided by 2^k (q4_stage_k): four half2, the odd pairs also by 16 —
// the odd pairs of a q4 word come out of the LOP3 as 1024 + 16u
// (q4_dot_staged), so their x is pre-scaled by 1/16 (exact) instead of
// shifting the word.
__device__ __forceinline__ uint4 q4_stage_unit(float4 a, float4 b, int k) {
    float sc = pow2f(-k), sc16 = sc * 0.0625f;
    return make_uint4(pack_h2(a.x * sc, a.y * sc), pack_h2(a.z * sc16, a.w * sc16), pack_h2(b.x * sc, b.y * sc),
                      pack_h2(b.z * sc16, b.w * sc16));
}

// The 32-row streaming GEMVs (gemv_q4_w4h, gemv_q4_w4a) stage x in 16-bit
// fixed point and multiply the codes on dp4a: a 32-feature chunk of x is
// q·s with q = rint(x·32 767 / max|x|) = 256·hi + lo, hi in [−128, 127],
// lo in [0, 255] (fx_unit), and a chunk of a row is
// scale·s·(Σu·q − z·Σq), exact in int32 but for x's rounding (2^-16 of the
// chunk's largest |x|, where fp16 keeps 2^-11 of each value). gemv_q4_w4h's
// main loop has 61 % of the fp16 form's instructions (nvcc 11.8), and
// there is no overflow to guard against.
//
// dp4a_us is c + Σ a_i·b_i over the 4 bytes, a's unsigned and b's signed.
__device__ __forceinline__ int dp4a_us(uint32_t a, uint32_t b, int c) {
    int d;
    asm("dp4a.u32.s32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
// dp4a_uu is c + Σ a_i·b_i over the 4 bytes, both unsigned.
__device__ __forceinline__ uint32_t dp4a_uu(uint32_t a, uint32_t b, uint32_t c) {
    uint32_t d;
    asm("dp4a.u32.u32 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
    return d;
}
// fx_unit is the fixed-point staged form of 8 features (a, b: in order)
// of a chunk whose largest |x| is 32 767 / inv: q = rint(x·inv) = 256·hi +
// lo with hi = q >> 8 (signed) and lo = q & 255 (unsigned), as the bytes
// the dot multiplies the codes by; qsum is their Σq. x·inv + 1.5·2^23
// rounds to a float whose bits are 0x4b400000 + q, so the bytes are taken
// straight from the floats and Σq from their bits. The words hold {hi of
// features o0-o3, hi of o4-o7, lo of o0-o3, lo of o4-o7}: for q4_dot_fx
// (Q8 false) o = 0 4 1 5 2 6 3 7 (w & 0x0f0f0f0f holds codes 0 4 1 5,
// w & 0xf0f0f0f0 codes 2 6 3 7 times 16: q4Shift), for q8_dot_fx16 the
// features in order.
template <bool Q8>
__device__ __forceinline__ uint4 fx_unit(float4 a, float4 b, float inv, uint32_t& qsum) {
    const float v[8] = {a.x, a.y, a.z, a.w, b.x, b.y, b.z, b.w};
    constexpr int o[8] = {0, Q8 ? 1 : 4, Q8 ? 2 : 1, Q8 ? 3 : 5, Q8 ? 4 : 2, Q8 ? 5 : 6, Q8 ? 6 : 3, 7};
    uint32_t f[8];
#pragma unroll
    for (int i = 0; i < 8; i++) f[i] = __float_as_uint(fmaf(v[i], inv, 12582912.f));
    qsum = f[0] + f[1] + f[2] + f[3] + f[4] + f[5] + f[6] + f[7] - 8u * 0x4b400000u;  // Σq in two's complement
    // {q's low byte, high byte} of two features a word, then the words' hi and lo bytes
    uint32_t p0 = __byte_perm(f[o[0]], f[o[1]], 0x5410), p1 = __byte_perm(f[o[2]], f[o[3]], 0x5410);
    uint32_t p2 = __byte_perm(f[o[4]], f[o[5]], 0x5410), p3 = __byte_perm(f[o[6]], f[o[7]], 0x5410);
    return make_uint4(__byte_perm(p0, p1, 0x7531), __byte_perm(p2, p3, 0x7531), __byte_perm(p0, p1, 0x6420),
                      __byte_perm(p2, p3, 0x6420));
}
// q4_dot_fx is 16·Σu·q over the 32 codes of a 16-byte chunk of q4 words w4
// and the chunk's four staged units xv (fx_unit<false>), exact in int32 (at
// most 2^28 in magnitude).
__device__ __forceinline__ int q4_dot_fx(const uint32_t (&w4)[4], const uint4 (&xv)[4]) {
    int ah = 0, bh = 0;
    uint32_t al = 0, bl = 0;
#pragma unroll
    for (int q = 0; q < 4; q++) {
        uint32_t t = w4[q] & 0x0f0f0f0fu, t16 = w4[q] & 0xf0f0f0f0u;
        ah = dp4a_us(t, xv[q].x, ah);
        bh = dp4a_us(t16, xv[q].y, bh);
        al = dp4a_uu(t, xv[q].z, al);
        bl = dp4a_uu(t16, xv[q].w, bl);
    }
    return ah * 4096 + bh * 256 + (int)((al << 4) + bl);
}

// The 8-bit streaming GEMVs (gemv_q8_w2h, gemv_q8_w4h, gemv_q8_w4a and their
// _pc forms: gemvw_body with Q8; W8A16 weights of K ≤ 4096) stage x in the same 16-bit fixed point,
// a scale per 16 features (a lane's chunk), the bytes of 8 features in
// their order (fx_unit<true>); a lane's 16 int8 codes times them is
// q8_dot_fx16, exact in int32 (at most 2^27).
__device__ __forceinline__ int q8_dot_fx16(const uint32_t (&w4)[4], const uint4* xv) {
    int ah = 0, al = 0;
#pragma unroll
    for (int q = 0; q < 2; q++) {
        ah = __dp4a((int)w4[2 * q], (int)xv[q].x, ah);
        ah = __dp4a((int)w4[2 * q + 1], (int)xv[q].y, ah);
        al = dp4a_us(xv[q].z, w4[2 * q], al);  // lo unsigned, the codes signed
        al = dp4a_us(xv[q].w, w4[2 * q + 1], al);
    }
    return ah * 256 + al;
}

template <int F>
__device__ __forceinline__ float gw_dot(const uint32_t* raw, const float* xv, float xs, float2 s) {
    if (F == GF32) {
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) a = fmaf(xv[i], __uint_as_float(raw[i]), a);
        return a;
    } else if (F == GF16) {
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            float2 f = __half22float2(*reinterpret_cast<const __half2*>(&raw[i]));
            a = fmaf(xv[2 * i], f.x, a);
            a = fmaf(xv[2 * i + 1], f.y, a);
        }
        return a;
    } else if (F == GBF16) {
        float a = 0.f;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            a = fmaf(xv[2 * i], __uint_as_float(raw[i] << 16), a);
            a = fmaf(xv[2 * i + 1], __uint_as_float(raw[i] & 0xffff0000u), a);
        }
        return a;
    } else {  // GQ8
        uint32_t wd[2] = {raw[0] ^ 0x80808080u, raw[1] ^ 0x80808080u};  // q + 128 as unsigned bytes
        float p = 0.f;
#pragma unroll
        for (int i = 0; i < 8; i++) {
            // 2^23 + byte as a float, minus 2^23 + 128, is q exactly.
            float q = __uint_as_float(__byte_perm(wd[i >> 2], 0x4B000000u, 0x7650 | (i & 3))) - 8388736.f;
            p = fmaf(xv[i], q, p);
        }
        return s.x * (p - s.y * xs);
    }
}

// One GEMV launch covers up to three weights that share the input x, its
// shape rules and kernel (runtime.Fused.MatMulN: q, k and v; gate and up).
// Segment s has its output y_s [M, N_s], weight W_s and scales sz_s; the
// first nb0 blocks of the grid's x dimension compute segment 0, the next nb1
// segment 1, the rest segment 2. A plain product is segment 0 alone.
struct GemvSeg {
    float* y;
    const void* W;
    const void* sz;  // float2 {scale, zero}; the streaming kernels': either form of Q4Group
    int N;
};
#define GEMV_SEGS                                                                                           \
    float *y0, const void *W0, const void *sz0, int N0, int nb0, float *y1, const void *W1, const void *sz1, \
        int N1, int nb1, float *y2, const void *W2, const void *sz2, int N2
// gemv_seg picks block bx's segment and makes bx its block within it.
__device__ __forceinline__ GemvSeg gemv_seg(int& bx, GEMV_SEGS) {
    if (bx < nb0) return GemvSeg{y0, W0, sz0, N0};
    bx -= nb0;
    if (bx < nb1) return GemvSeg{y1, W1, sz1, N1};
    bx -= nb1;
    return GemvSeg{y2, W2, sz2, N2};
}

template <int F, int R, int U>
__device__ __forceinline__ void gemv_body(float* __restrict__ y, const float* __restrict__ x, const void* __restrict__ W,
                                          const float2* __restrict__ sz, const int* __restrict__ gidx, int N, int K,
                                          int gs, int G, int bx, int mode, char* __restrict__ send) {
    constexpr int NW = RawWords<F>::n;
    int m = blockIdx.y, n0 = bx * R;
    const float* xr = x + (size_t)m * K;
    int nc = K >> 3;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.f;
    if (F == GQ8 && !(gidx == nullptr && (gs & 7) == 0)) {
        // Slow path: per-element groups (act-order g_idx or odd group sizes).
        for (int c = threadIdx.x; c < nc; c += GEMV_THREADS) {
            float xv[8];
            load_x8(xr, c * 8, xv);
#pragma unroll
            for (int r = 0; r < R; r++) {
                int n = min(n0 + r, N - 1);
                const int8_t* q = (const int8_t*)W + (size_t)n * K + c * 8;
#pragma unroll
                for (int i = 0; i < 8; i++) {
                    float2 s = sz[(size_t)n * G + q_group(c * 8 + i, gs, gidx)];
                    acc[r] = fmaf(xv[i] * s.x, (float)q[i] - s.y, acc[r]);
                }
            }
        }
        gemv_finish<R>(acc, y, m, N, n0, mode, send);
        return;
    }
    uint64_t pol = l2_evict_first();
    for (int c0 = threadIdx.x; c0 < nc; c0 += GEMV_THREADS * U) {
        uint32_t raw[U][R][NW];
        float2 s[U][R];
        float xv[U][8];
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = c0 + u * GEMV_THREADS;
            if (c < nc) {
                load_x8(xr, c * 8, xv[u]);
#pragma unroll
                for (int r = 0; r < R; r++) {
                    size_t n = (size_t)min(n0 + r, N - 1);
                    gw_load<F>(raw[u][r], W, n, K, c, pol);
                    if (F >= GQ8) s[u][r] = ldg_once_f2(sz + n * G + (c * 8) / gs, pol);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < U; u++) {
            int c = c0 + u * GEMV_THREADS;
            if (c < nc) {
                float xs = 0.f;
                if (F == GQ8) {
#pragma unroll
                    for (int i = 0; i < 8; i++) xs += xv[u][i];
                }
#pragma unroll
                for (int r = 0; r < R; r++) acc[r] += gw_dot<F>(raw[u][r], xv[u], xs, s[u][r]);
            }
        }
    }
    gemv_finish<R>(acc, y, m, N, n0, mode, send);
}

// gemv_<fmt>_r<R>u<U>(x, gidx, K, gs, G, mode, send, GEMV_SEGS); grid
// (nb0 + nb1 + nb2, M) with nb_s = ceil(N_s/R); mode GEMV_STORE or GEMV_ADD;
// send (or null, M = 1, one segment): y0 is an all-reduce's summand, sent
// to the group whose area that is (ar_send).
#define GEMV_ENTRY(name, F, R, U)                                                                               \
    extern "C" __global__ void __launch_bounds__(GEMV_THREADS) name(const float* x, const int* gidx, int K,     \
                                                                    int gs, int G, int mode, char* send,        \
                                                                    GEMV_SEGS) {                                \
        int bx = blockIdx.x;                                                                                    \
        GemvSeg s = gemv_seg(bx, y0, W0, sz0, N0, nb0, y1, W1, sz1, N1, nb1, y2, W2, sz2, N2);                  \
        PDL_ENTRY();                                                                                            \
        gemv_body<F, R, U>(s.y, x, s.W, static_cast<const float2*>(s.sz), gidx, s.N, K, gs, G, bx, mode, send);    \
    }
GEMV_ENTRY(gemv_f32_r4u1, GF32, 4, 1)
GEMV_ENTRY(gemv_f16_r4u2, GF16, 4, 2)
GEMV_ENTRY(gemv_bf16_r4u2, GBF16, 4, 2)
GEMV_ENTRY(gemv_q8_r4u1, GQ8, 4, 1)

// Split-K GEMV for 4-bit weights (the streaming kernels' fallback: a g_idx,
// or a width or group size they do not take). A block covers 64 output rows
// (8 warps x 8 rows) and one K slice of 32 lanes x 32 k (one 16-byte word
// quad per lane and row). The slice of x is staged in shared memory
// (float4-swizzled so that each lane's contiguous read is conflict-free)
// and held in registers across the 8 rows; every lane issues its 8 rows'
// 16-byte loads at once. Partial sums go to part[ks][m][n]; the last block
// of each (row tile, m) to finish (counted in cnt, which it resets) adds
// them in a fixed order, so results are deterministic.
// grid (ceil(N/(8R)), ceil(K/1024), M), block 256; R rows per warp.
template <int R>
__device__ __forceinline__ void gemvs_body(float* __restrict__ y, const float* __restrict__ x, const void* __restrict__ W,
                                           const float2* __restrict__ sz, float* __restrict__ part, int* __restrict__ cnt,
                                           int N, int K, int gs, int G) {
    constexpr int P = 8;         // float4 of x per lane
    constexpr int KL = 4 * P;    // k per lane
    constexpr int KS = 32 * KL;  // k per block
    __shared__ float4 xs[KS / 4];
    int m = blockIdx.z, ks = blockIdx.y, nks = gridDim.y, M = gridDim.z;
    int k0 = ks * KS;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const float* xr = x + (size_t)m * K;
    for (int f = tid; f < KS / 4; f += blockDim.x) {
        int k = k0 + 4 * f;
        float4 v = k < K ? *reinterpret_cast<const float4*>(xr + k) : make_float4(0.f, 0.f, 0.f, 0.f);
        xs[f ^ ((f >> 3) & 7)] = v;
    }
    __syncthreads();
    int kl = k0 + lane * KL;
    bool act = kl < K;
    int n0 = (blockIdx.x * 8 + warp) * R;
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.f;
    if (act) {
        uint4 raw[R];
        float2 s[R];
#pragma unroll
        for (int r = 0; r < R; r++) {
            size_t n = (size_t)min(n0 + r, N - 1);
            raw[r] = __ldg(reinterpret_cast<const uint4*>((const uint32_t*)W + n * (K >> 3) + (kl >> 3)));
            s[r] = __ldg(sz + n * G + kl / gs);
        }
        float xv[KL];
#pragma unroll
        for (int j = 0; j < P; j++) {
            int f = lane * P + j;
            float4 v = xs[f ^ ((f >> 3) & 7)];
            xv[4 * j] = v.x; xv[4 * j + 1] = v.y; xv[4 * j + 2] = v.z; xv[4 * j + 3] = v.w;
        }
        // x staged once for all rows, the lane's 32 features by one power
        // of two (q4_stage_k)
        float mx = 0.f;
#pragma unroll
        for (int j = 0; j < KL; j++) mx = fmaxf(mx, fabsf(xv[j]));
        int kx = q4_stage_k(mx);
        uint4 xh4[4];
#pragma unroll
        for (int j = 0; j < 4; j++)
            xh4[j] = q4_stage_unit(make_float4(xv[8 * j], xv[8 * j + 1], xv[8 * j + 2], xv[8 * j + 3]),
                                   make_float4(xv[8 * j + 4], xv[8 * j + 5], xv[8 * j + 6], xv[8 * j + 7]), kx);
        const __half2* xh = reinterpret_cast<const __half2*>(xh4);
        float ex = pow2f(kx);
#pragma unroll
        for (int r = 0; r < R; r++) {
            uint32_t w4[4] = {raw[r].x, raw[r].y, raw[r].z, raw[r].w};
            Q4Group g = q4_group_of(s[r]);
            acc[r] = g.scale * q4_dot_staged(w4, xh, g.z1024) * ex;
        }
    }
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = warp_sum(acc[r]);
    float mine = acc[0];
#pragma unroll
    for (int r = 1; r < R; r++) if (lane == r) mine = acc[r];
    if (nks == 1) {
        if (lane < R && n0 + lane < N) y[(size_t)m * N + n0 + lane] = mine;
        return;
    }
    if (lane < R && n0 + lane < N) part[((size_t)ks * M + m) * N + n0 + lane] = mine;
    int ci = m * gridDim.x + blockIdx.x;
    if (!last_block(cnt, ci, nks)) return;
    int n = blockIdx.x * 8 * R + tid;
    if (tid < 8 * R && n < N) {
        float v = 0.f;
        for (int k2 = 0; k2 < nks; k2++) v += __ldcg(part + ((size_t)k2 * M + m) * N + n);
        y[(size_t)m * N + n] = v;
    }
}

#define GEMVS_ENTRY(name, R, MINB)                                                                                \
    extern "C" __global__ void __launch_bounds__(256, MINB) name(float* y, const float* x, const void* W,          \
                                                                 const float2* sz, float* part, int* cnt, int N,  \
                                                                 int K, int gs, int G) {                          \
        PDL_ENTRY();                                                                                              \
        gemvs_body<R>(y, x, W, sz, part, cnt, N, K, gs, G);                                                       \
    }
GEMVS_ENTRY(gemv_q4_sh, 8, 1)

// ---------------------------------------------------------------------------
// Streaming GEMV for 4-bit weights (the dispatcher's q4 GEMV: gemv_q4_w4h
// or gemv_q4_w4a up to K = 4096, gemv_q4_w2h beyond) and, with Q8, for
// 8-bit ones up to K = 4096 (gemv_q8_w4h or gemv_q8_w4a, gemv_q8_w2h), M
// rows of x (grid.y). A block of 8 warps stages its activation row once in dynamic
// shared memory: R = 2 (gemv_q4_w2h) as fp16 half2 pairs (the high-nibble
// pairs pre-scaled by 1/16 as in gemv_q4_sh), R = 4 in fixed point for
// dp4a (FX: fx_unit; on the 16-row kernel, whose blocks each stage the
// whole row for fewer rows, that staging cost more than the products
// saved: 4096×14336 at 49–50 % of copy against 60–62 %; Q8 always), 16-byte units
// swizzled so that each lane's four 16-byte reads are bank-conflict free.
// A warp owns R rows and every chunk of 32 lanes x 16 bytes (1024 k, 512 with Q8).
// Weights and their {scale, zero} go through a ring of D chunks: D*R
// 16-byte loads per lane are in flight while one chunk is computed, and
// the chunk's slot is refilled right after. The ring is in registers (ld.global.nc, L1 no-allocate), or with
// ASYNC (gemv_q4_w4a, gemv_q8_w4a) in dynamic shared memory after x, each thread's own
// slots filled by cp.async (L2 evict-first, one commit group a chunk) and
// read back by that thread alone: no barrier, and registers enough for
// three blocks a multiprocessor instead of two. The weight loads of the
// first D chunks (ASYNC: of the first, the rest right after x's first
// loads) are issued before the kernel waits for its predecessor
// (pdl_wait) and stages x, so those latencies overlap. Requires (host side): no g_idx, K and gs
// multiples of 32. An act-order weight (stored with its columns sorted by
// group) passes its column order as permx: 16-bit feature indices, the 8 of
// staged unit u (stored columns 8u .. 8u+7) at unit xw_swz(u), the place
// of that unit's staged x. Each thread copies the units it will stage into
// the staged row with cp.async before the wait (no kernel writes the
// order), reads them back after copying x's row into shared memory (in the
// same way, one round trip) and normalising it there, and gathers from
// that copy; no barrier is needed between a unit's order and its staged x.
//
// The decode step's neighbours are fused in (runtime.Fused):
//   - nw set: x is rmsnorm(x)·nw (+ nb), computed by every block from the
//     whole row while it stages it (NormMatMulN, NormSwiGLU);
//   - mode GEMV_ADD: y += x·Wᵀ (MatMulAdd: the residual add);
//   - mode GEMV_SWIGLU: y = silu(x·W0ᵀ) ⊙ (x·W1ᵀ), segment 0 holding the
//     gate and segment 1 the up weight; a warp's R rows are R/2 gate rows
//     and the same R/2 up rows;
//   - yss set (GEMV_ADD, one segment): each block also writes the sum of
//     the squares of its rows of y, yss[m·gridDim.x + block], for the _n
//     kernel (gemv_q4_w4a_n, gemv_q4_w4h_n, gemv_q4_w2h_n and their _pc
//     forms) that normalises y next: it
//     takes 1/rms from those parts (xss, nss a row) instead of a pass over
//     the row and a block reduction before its staging;
//   - send set (M = 1, one segment, no yss): y is an all-reduce's summand,
//     sent to the group whose area that is instead of stored (ar_send).
// Args (x, xss, nss, permx, K, gs, G, nw, nb, eps, mode, yss, send, GEMV_SEGS);
// grid (nb0 + nb1 + nb2, M) with nb_s = ceil(N_s/(8R)) (GEMV_SWIGLU: nb0 =
// ceil(N_0/(4R)), one segment), block 256, dynamic shared memory 2 bytes a
// feature for the staged x (6 with permx), with FX then 8 bytes a chunk
// of 32 features (4-bit: {s/16, 16·Σq}) or 16 (Q8: {s, Σq}), with ASYNC then at a 16-byte
// boundary the ring: D·R·256 16-byte weight slots and as many {scale,
// zero} slots (4 bytes in the half form HS, else 8; Q4Group).
// The register ring's loads keep the default L2 policy: with evict-first
// these kernels lost 5–6 points of copy bandwidth (kernels/NOTES.md).
__device__ __forceinline__ uint4 ldg_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}
// Physical 16-byte unit of logical unit u (flips its low 2 bits by bits 3-4).
__device__ __forceinline__ int xw_swz(int u) { return u ^ ((u >> 3) & 3); }

// gemv_norm4 applies rmsnorm's scaling to x[k..k+3] (as the rmsnorm kernel:
// (x·inv)·w, then + bias).
__device__ __forceinline__ float4 gemv_norm4(float4 a, int k, float inv, const float* __restrict__ nw,
                                             const float* __restrict__ nb) {
    float4 w = *reinterpret_cast<const float4*>(nw + k);
    a = make_float4(a.x * inv * w.x, a.y * inv * w.y, a.z * inv * w.z, a.w * inv * w.w);
    if (nb) {
        float4 c = *reinterpret_cast<const float4*>(nb + k);
        a = make_float4(a.x + c.x, a.y + c.y, a.z + c.z, a.w + c.w);
    }
    return a;
}

// SUMS (with nw set): the kernel that wrote x also wrote the sums of the
// squares of its row in nss parts (xss; see yss), so the block takes 1/rms
// from them instead of reading the whole row once more before staging it.
// HS: the scales are in the half form (Q4Group), one word a group.
// Q8: W holds int8 codes (a lane's 16 bytes are 16 k, not 32) and sz
// {scale, zero} floats; x in fixed point (FX).
// PC: one group a row (per-channel scales, G = 1), its scale loaded once,
// with the first chunk (ASYNC: into that chunk's slot, read from there for
// every chunk; otherwise into registers, the row's group). Loaded with every chunk,
// the 32 lanes' copies of one address held gemv_q8_w4a at 51 % of copy and
// gemv_q4_w4a at 45 % on 11008×4096 (kernels/NOTES.md, thirty-ninth
// session).
// SPLIT: a split form (_k, GEMVW_SPLIT_ENTRY): grid.z blocks share a block
// of rows, each taking a run of the row's chunks; the last split adds the
// others' parts as they arrive (part_put, part_take) and runs the
// epilogue. Only the 8-bit register ring has split forms: split, the 8-bit
// ring in shared memory and the 4-bit kernels read fewer bytes a second
// than the unsplit kernels (kernels/NOTES.md, forty-first session; the
// 4-bit register ring's fence-free split, forty-eighth: +3 points at
// 4096×14336, −1 at 4096×11008).
template <int R, int D, bool SUMS, bool ASYNC, bool HS, bool Q8, bool PC, bool SPLIT>
__device__ __forceinline__ void gemvw_body(float* __restrict__ y, const float* __restrict__ x,
                                           const float* __restrict__ xss, int nss, const void* __restrict__ W,
                                           const void* __restrict__ sz, const void* __restrict__ Wu,
                                           const void* __restrict__ szu, int N, int K, int gs, int G, int bx,
                                           const float* __restrict__ nw, const float* __restrict__ nb, float eps,
                                           int mode, const uint4* __restrict__ permx, float* __restrict__ yss,
                                           char* __restrict__ send, float* __restrict__ part) {
    static_assert(!Q8 || !HS, "the 8-bit streaming GEMV takes {scale, zero} floats");
    static_assert(!SPLIT || (!SUMS && Q8 && !ASYNC), "the split forms: the 8-bit register ring's, no _n twins");
    constexpr int LK = Q8 ? 16 : 32;  // k a lane's 16 bytes of a row hold
    constexpr int KC = 32 * LK;       // k per chunk: 32 lanes x LK k
    constexpr int CU = LK / 8;        // staged units a lane's chunk (and an x scale) covers
    extern __shared__ uint4 xsh[];
    __shared__ float nsh[32];
    int m = blockIdx.y;
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    bool swiglu = mode == GEMV_SWIGLU;
    // rows of this warp: R of W, or R/2 of W (gate) and the same R/2 of Wu (up)
    int n0 = swiglu ? (bx * 8 + warp) * (R / 2) : (bx * 8 + warp) * R;
    int nch = (K + KC - 1) / KC;
    // SPLIT: this block's run of chunks, [jb, je), the grid.z-th part of
    // the row (cps chunks); the staged x holds that run alone, KL features
    // of shared memory
    const int cps = SPLIT ? (nch + (int)gridDim.z - 1) / (int)gridDim.z : nch;
    const int jb = SPLIT ? (int)blockIdx.z * cps : 0;
    const int je = SPLIT ? min(nch, jb + cps) : nch;
    const int KL = SPLIT ? min(K, cps * KC) : K;
    int upr = K / LK;  // 16-byte units per weight row
    using SG = typename std::conditional<HS, uint32_t, float2>::type;  // a group's {scale, zero}
    const uint4* wrow[R];
    const SG* srow[R];
#pragma unroll
    for (int r = 0; r < R; r++) {
        bool up = swiglu && r >= R / 2;
        size_t n = (size_t)min(n0 + (up ? r - R / 2 : r), N - 1);
        wrow[r] = reinterpret_cast<const uint4*>(up ? Wu : W) + n * upr + lane;
        srow[r] = static_cast<const SG*>(up ? szu : sz) + n * G;
    }
    // ASYNC: the ring is in shared memory after x (each thread's own
    // slots: cp.async, one commit group a chunk, read back by the thread
    // that copied them, but LEAD's scales, below), not in registers
    uint4 buf[ASYNC ? 1 : D][R];
    SG sb[ASYNC || PC ? 1 : D][R];
    // FX (the 32-row 4-bit kernels, the 8-bit ones): x in fixed point
    // (fx_unit), each chunk's figures after the staged row
    // (and xraw): {s/16, 16·Σq} a 32-feature chunk (4-bit), {s, Σq} a
    // 16-feature one (8-bit). gemv_q4_w2h stays in fp16 (above).
    constexpr bool FX = Q8 || R == 4;
    const int xend = SPLIT ? 2 * KL : (permx ? 6 : 2) * K;  // the bytes of the staged x (and its copy)
    float2* cst = reinterpret_cast<float2*>(reinterpret_cast<unsigned char*>(xsh) + xend);
    unsigned char* rw = reinterpret_cast<unsigned char*>(xsh) + ((xend + (FX ? (Q8 ? KL / 2 : KL / 4) : 0) + 15) & ~15);
    auto wslot = [&](int d, int r) { return reinterpret_cast<uint4*>(rw) + (d * R + r) * 256 + tid; };
    auto sslot = [&](int d, int r) { return reinterpret_cast<SG*>(rw + D * R * 256 * 16) + (d * R + r) * 256 + tid; };
    uint64_t pol = l2_evict_first();
    // ASYNC: this thread's first weight and scale slots as shared addresses,
    // passed through the slots themselves (a volatile store and load), so
    // that ptxas addresses every copy from a register holding the whole
    // address. Without it ptxas (nvcc 13.0 for gemv_q8_w2a, 11.8 for
    // gemv_q8_w4a too) addressed the ring's refills through a uniform
    // register it never set: an illegal instruction (kernels/NOTES.md,
    // thirty-eighth session; build.sh's sass_check.py refuses such a build).
    uint32_t wa0 = 0, sa0 = 0;
    if constexpr (ASYNC) {
        volatile uint32_t* pw = reinterpret_cast<volatile uint32_t*>(wslot(0, 0));
        volatile uint32_t* ps = reinterpret_cast<volatile uint32_t*>(sslot(0, 0));
        *pw = (uint32_t)__cvta_generic_to_shared(wslot(0, 0));
        *ps = (uint32_t)__cvta_generic_to_shared(sslot(0, 0));
        wa0 = *pw;
        sa0 = *ps;
    }
    // LEAD (the 8-bit grouped ring): where the groups tile a chunk (gs
    // divides KC), a group's lanes are the same every chunk, so the group's
    // first lane alone copies its scale and the others read that lane's
    // slot, lead lanes back (a __syncwarp after the wait, one before the
    // refill). gemv_q8_w4a at 11008×4096 (g128: 8 lanes a group): 74 → 82 %
    // of copy; the 4-bit ring (g128: 4 lanes a group) lost 75 → 67 % so
    // (kernels/NOTES.md, fortieth session).
    constexpr bool LEAD = ASYNC && Q8 && !PC;
    const int lead = LEAD && KC % gs == 0 ? (lane * LK) % gs / LK : 0;
    // The group of the lane's k in chunk j: where the groups tile a chunk
    // (gs divides KC, uniform across the grid) j·(KC/gs) plus the lane's
    // group within its chunk, without the division by gs each refill
    // (~25 instructions of a signed division a chunk, 4 rows' worth).
    const int gpc = KC % gs == 0 ? KC / gs : 0;
    const int glane = lane * LK / gs;
    auto group = [&](int j, int k) { return gpc ? j * gpc + glane : k / gs; };
    auto fetch = [&](int d, int j, int k) {
        const int g = group(j, k);
#pragma unroll
        for (int r = 0; r < R; r++) {
            if constexpr (ASYNC) {
                int slot = (d * R + r) * 256;  // the thread's slot of chunk d, row r, less tid
                cp_async16_once_at(wa0 + slot * 16, wrow[r] + j * 32, pol);
                if ((PC && j > jb) || lead > 0) {
                    // PC: the row's scale is in slot 0 (chunk 0's) already;
                    // LEAD: the group's first lane copies it
                } else if constexpr (HS) {
                    cp_async4_once_at(sa0 + slot * 4, srow[r] + g, pol);
                } else {
                    cp_async8_once_at(sa0 + slot * 8, srow[r] + g, pol);
                }
            } else {
                buf[d][r] = ldg_stream(wrow[r] + j * 32);
                if (!PC || j == jb) sb[PC ? 0 : d][r] = __ldg(srow[r] + g);
            }
        }
    };
    int nu = K / 8;  // 16-byte units of the staged row (8 k each)
    if (permx) {  // the order of the units this thread stages, before the ring's groups
        for (int u = tid; u < nu; u += 256) cp_async16_zfill(xsh + xw_swz(u), permx + xw_swz(u), true);
        cp_async_commit();
    }
    // The ring's first chunks [d0, d1).
    auto prefetch = [&](int d0, int d1) {
#pragma unroll
        for (int d = 0; d < D; d++) {
            if (d < d0 || d >= d1) continue;
            int k = (jb + d) * KC + lane * LK;
            if (jb + d < je && k < K) fetch(d, jb + d, k);
            if constexpr (ASYNC) cp_async_commit();
        }
    };
    // ASYNC: only the first chunk goes out before the wait, the rest right
    // after x's first loads (stage): gemv_q4_w4a 11008×4096 74.3 → 80.0 %
    // of copy, gemv_q8_w4a 82.5 → 85.4 (H200, kernels/NOTES.md, forty-third
    // session). The register rings lost so (gemv_q4_w4h 14336×4096 64.0 →
    // 59.7), and so did every ring with all its chunks after x's loads.
    const int early = ASYNC && !permx ? 1 : D;
    bool pending = early < D;
    prefetch(0, early);
    // The weights are in flight: now wait for the kernel that writes x.
    pdl_wait();
    pdl_trigger();
    const float* xr = x + (size_t)m * K;
    // The residual the sums are added to, loaded now to hide its latency.
    float yold = 0.f;
    if (mode == GEMV_ADD && lane < R && n0 + lane < N) yold = y[(size_t)m * N + n0 + lane];
    // Each phase of the staging issues all its loads at once (indices
    // clamped into the row, results used only in range): one round trip
    // to L2 a phase, not one a unit.
    // An act-order weight's input is gathered from a copy of the row in
    // shared memory, after the staged form (xraw).
    float* xraw = reinterpret_cast<float*>(xsh + K / 8);
    float inv = 1.f;
    // SPLIT: the units of this block's run alone, [ub, ue), staged from
    // the run's start (the chunk figures likewise)
    const int ub = jb * 32 * CU, ue = SPLIT ? min(nu, je * 32 * CU) : nu;
    if (permx) {  // x's row copied whole (one round trip), normalised in place
        for (int u = tid; u < K / 4; u += 256) cp_async16_zfill(xraw + 4 * u, xr + 4 * u, true);
        cp_async_commit();
        asm volatile("cp.async.wait_group 0;\n" ::: "memory");  // also the order and the ring's first chunks
        __syncthreads();
        if (nw) {
            float ss = 0.f;
            for (int u = tid; u < K / 4; u += 256) {
                float4 a = reinterpret_cast<const float4*>(xraw)[u];
                ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
            }
            ss = block_sum(ss, nsh);
            inv = rsqrtf(ss / (float)K + eps);
            for (int u = tid; u < K / 4; u += 256)
                reinterpret_cast<float4*>(xraw)[u] = gemv_norm4(reinterpret_cast<const float4*>(xraw)[u], 4 * u, inv, nw, nb);
            __syncthreads();
        }
    } else if (SUMS) {  // every warp adds the parts in the same order
        float ss = 0.f;
        constexpr int B = 8;
        const float* part = xss + (size_t)m * nss;
        for (int i0 = lane; i0 < nss; i0 += 32 * B) {
            float v[B];
#pragma unroll
            for (int i = 0; i < B; i++) v[i] = part[min(i0 + 32 * i, nss - 1)];
#pragma unroll
            for (int i = 0; i < B; i++)
                if (i0 + 32 * i < nss) ss += v[i];
        }
        ss = warp_sum(ss);
        inv = rsqrtf(ss / (float)K + eps);
    } else if (nw) {
        float ss = 0.f;
        constexpr int B = 4;
        for (int u0 = tid; u0 < K / 4; u0 += 256 * B) {
            float4 v[B];
#pragma unroll
            for (int i = 0; i < B; i++) v[i] = *reinterpret_cast<const float4*>(xr + 4 * min(u0 + 256 * i, K / 4 - 1));
#pragma unroll
            for (int i = 0; i < B; i++) {
                if (u0 + 256 * i < K / 4) {
                    float4 a = v[i];
                    ss += a.x * a.x + a.y * a.y + a.z * a.z + a.w * a.w;
                }
            }
        }
        ss = block_sum(ss, nsh);
        inv = rsqrtf(ss / (float)K + eps);
    }
    // Stage x row m: unit u = 16 bytes = 8 k of the staged form. FX: each
    // 32-feature chunk in fixed point by its own scale (fx_unit), in one
    // pass. Otherwise every unit divided by the row's one power of two 2^kx
    // (q4_stage_unit), the sums multiplied back at the end. kx is 0 (the
    // staged values as they are) unless some |x| reaches 1 024; then the
    // row is staged again with the kx its largest value needs
    // (q4_stage_k). stage returns the largest k the thread's units need;
    // again: the second staging, which takes an act-order weight's unit
    // orders from permx (the first staging wrote its units over them).
    auto stage = [&](int kx, bool again) {
        int kmax = 0;
        constexpr int B = 2;
        // Warp-uniform passes: every lane of a warp runs each pass, those
        // past the run on a copy of its last unit, storing nothing (a
        // chunk's CU lanes are all in or all out: ub, ue and each warp's
        // first unit are multiples of CU), so the chunk's shuffles take the
        // whole warp, with no convergence checks around them.
        for (int w0 = ub + (tid & ~31); w0 < ue; w0 += 256 * B) {
            const int u0 = w0 + lane;
            const unsigned gm = 0xffffffffu;
            float4 a[B], b[B];
#pragma unroll
            for (int i = 0; i < B; i++) {
                int u = min(u0 + 256 * i, ue - 1);
                if (permx) {  // act-order weight: stored column k holds feature order[k]
                    // this thread's own copy of the unit's order (zeros past the row:
                    // another thread's unit, maybe staged already)
                    uint4 o = u0 + 256 * i >= ue ? make_uint4(0, 0, 0, 0) : again ? permx[xw_swz(u)] : xsh[xw_swz(u)];
                    a[i] = make_float4(xraw[o.x & 0xffff], xraw[o.x >> 16], xraw[o.y & 0xffff], xraw[o.y >> 16]);
                    b[i] = make_float4(xraw[o.z & 0xffff], xraw[o.z >> 16], xraw[o.w & 0xffff], xraw[o.w >> 16]);
                } else {
                    a[i] = *reinterpret_cast<const float4*>(xr + 8 * u);
                    b[i] = *reinterpret_cast<const float4*>(xr + 8 * u + 4);
                    if (nw) {
                        a[i] = gemv_norm4(a[i], 8 * u, inv, nw, nb);
                        b[i] = gemv_norm4(b[i], 8 * u + 4, inv, nw, nb);
                    }
                }
            }
            if (pending) {
                prefetch(early, D);
                pending = false;
            }
#pragma unroll
            for (int i = 0; i < B; i++) {
                if (w0 + 256 * i >= ue) continue;  // the whole warp
                const bool in = u0 + 256 * i < ue;
                if constexpr (FX) {
                    // a chunk's CU units are staged by CU neighbouring lanes
                    // the chunk's largest |x|, NaN where one is
                    float mx = absmax8<true>(a[i], b[i]);
                    mx = fmax_nan(mx, __shfl_xor_sync(gm, mx, 1));
                    if constexpr (CU == 4) mx = fmax_nan(mx, __shfl_xor_sync(gm, mx, 2));
                    // non-finite x: s non-finite, so is the row's sum (q is then any bits);
                    // 32 767 / FLT_MAX (3.4e38) is a normal float, and x·qinv rounds within ±32 767
                    float qinv = mx >= 1e-30f && mx <= 3.40282347e38f ? 32767.f / mx : 0.f;
                    uint32_t qs;  // Σq of the chunk, two's complement (any bits where x is not finite)
                    uint4 v = fx_unit<Q8>(a[i], b[i], qinv, qs);
                    qs += __shfl_xor_sync(gm, qs, 1);
                    if constexpr (CU == 4) qs += __shfl_xor_sync(gm, qs, 2);
                    if (!in) continue;
                    int u = u0 + 256 * i - ub;
                    if ((lane & (CU - 1)) == 0) {
                        if constexpr (Q8)
                            cst[u / CU] = make_float2(mx * (1.f / 32767.f), (float)(int)qs);
                        else
                            cst[u >> 2] = make_float2(mx * (1.f / (16.f * 32767.f)), __uint_as_float(16u * qs));
                    }
                    xsh[xw_swz(u)] = v;
                } else if (in) {
                    kmax = max(kmax, q4_stage_k(absmax8(a[i], b[i])));
                    xsh[xw_swz(u0 + 256 * i - ub)] = q4_stage_unit(a[i], b[i], kx);
                }
            }
        }
        return kmax;
    };
    int kx = 0, kmax = stage(0, false);
    if (pending) prefetch(early, D);  // a warp that ran no staging pass
    if constexpr (FX) {
        __syncthreads();
    } else if (__syncthreads_or(kmax > 0)) {  // rare: the staged row could overflow q4_dot_staged
        kx = (int)block_max((float)kmax, nsh);
        stage(kx, true);
        __syncthreads();
    }
    float acc[R];
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = 0.f;
    for (int j0 = jb; j0 < je; j0 += D) {
#pragma unroll
        for (int d = 0; d < D; d++) {
            int j = j0 + d;
            int k = j * KC + lane * LK;
            if constexpr (ASYNC) asm volatile("cp.async.wait_group %0;\n" ::"n"(D - 1) : "memory");
            if constexpr (LEAD) __syncwarp();  // the group's first lane's copy, seen by the others
            if (j < je && k < K) {
                int u0 = ((j - jb) * 32 + lane) * CU;
                uint4 xv[4];
#pragma unroll
                for (int q = 0; q < CU; q++) xv[q] = xsh[xw_swz(u0 + q)];
                float2 cs = FX ? cst[(j - jb) * 32 + lane] : float2{};
#pragma unroll
                for (int r = 0; r < R; r++) {
                    uint4 wv = ASYNC ? *wslot(d, r) : buf[ASYNC ? 0 : d][r];
                    SG g = ASYNC ? *(sslot(PC ? 0 : d, r) - lead) : sb[ASYNC || PC ? 0 : d][r];
                    Q4Group sv = q4_group_of(g);
                    uint32_t w4[4] = {wv.x, wv.y, wv.z, wv.w};
                    if constexpr (Q8) {  // g: {scale, zero}
                        float p = (float)q8_dot_fx16(w4, xv);
                        acc[r] = fmaf(g.x * cs.x, fmaf(-g.y, cs.y, p), acc[r]);
                    } else if constexpr (FX) {
                        int z = (int)__half_as_ushort(__low2half(sv.z1024)) - 0x6400;  // 1024 + z's bits
                        int p = q4_dot_fx(w4, xv) - z * __float_as_int(cs.y);
                        acc[r] = fmaf(sv.scale * cs.x, (float)p, acc[r]);
                    } else {
                        float p = q4_dot_staged(w4, reinterpret_cast<const __half2*>(xv), sv.z1024);
                        acc[r] = fmaf(sv.scale, p, acc[r]);
                    }
                }
            }
            if constexpr (LEAD) __syncwarp();  // every lane has read the group's slot
            // Refill this slot with the chunk D further on.
            int jn = j + D;
            int kn = jn * KC + lane * LK;
            if (jn < je && kn < K) fetch(d, jn, kn);
            if constexpr (ASYNC) cp_async_commit();
        }
    }
    ArSend to;  // its loads issued before the reduction
    if (send && lane < R) to = ar_send_to(send, n0 + lane);
    // Every lane ends with every row's sum (butterfly reduction), times
    // the staging's 2^kx.
    float ex = pow2f(kx);
#pragma unroll
    for (int r = 0; r < R; r++) acc[r] = warp_sum(acc[r]) * ex;
    float mine = acc[0], upv = acc[R / 2];
#pragma unroll
    for (int r = 1; r < R; r++)
        if (lane == r) mine = acc[r];
#pragma unroll
    for (int r = 1; r < R / 2; r++)
        if (lane == r) upv = acc[r + R / 2];
    if constexpr (SPLIT) {
        // Each of the first grid.z − 1 blocks of these rows stores its part
        // of their sums (part: (grid.z − 1) × M × gridDim.x × 8R floats)
        // and is done; the last, blockIdx.z = grid.z − 1, takes each part
        // as it arrives and adds them in z order, its own last, so the
        // result does not depend on which finished first, and goes on with
        // the epilogue. No fence or counter: see part_put.
        const int zl = (int)gridDim.z - 1;
        const size_t pz = (size_t)gridDim.y * gridDim.x * (8 * R);
        const size_t pi = ((size_t)m * gridDim.x + blockIdx.x) * (8 * R) + warp * R + lane;
        if ((int)blockIdx.z < zl) {
            if (lane < R) part_put(part + blockIdx.z * pz + pi, mine);
            return;
        }
        if (lane < R) {
            float v = 0.f;
            for (int z = 0; z < zl; z++) v += part_take(part + z * pz + pi);
            mine = v + mine;
        }
        upv = __shfl_down_sync(0xffffffffu, mine, R / 2);  // GEMV_SWIGLU: lane r's up row is lane r + R/2's
    }
    float* yp = y + (size_t)m * N + n0 + lane;
    if (swiglu) {
        if (lane < R / 2 && n0 + lane < N) *yp = silu_times(mine, upv);
    } else {
        float v = mode == GEMV_ADD ? yold + mine : mine;
        bool own = lane < R && n0 + lane < N;
        if (own && send) ar_send(to, v);
        else if (own) *yp = v;
        if (yss) {  // this block's part of the sums of squares of y's row
            float s2 = warp_sum(own ? v * v : 0.f);
            if (lane == 0) nsh[warp] = s2;
            __syncthreads();
            if (tid == 0) {
                float t = 0.f;
                for (int w = 0; w < 8; w++) t += nsh[w];
                yss[(size_t)m * gridDim.x + blockIdx.x] = t;
            }
        }
    }
}

// The 4-bit kernels take the scales' half form (Q4Group); fp32 scales, a rarer
// form (msmodelslim W4A16, FP32Scales), run gemv_q4_w2h's _s32 twins.
// Every segment of a launch has the same form.
#define GEMVW_ENTRY(name, R, D, SUMS, MINB, ASYNC, HS, Q8, PC)                                                      \
    extern "C" __global__ void __launch_bounds__(256, MINB)                                                          \
        name(const float* x, const float* xss, int nss, const uint4* permx, int K, int gs, int G, const float* nw,   \
             const float* nb, float eps, int mode, float* yss, char* send, GEMV_SEGS) {                              \
        int bx = blockIdx.x;                                                                                         \
        GemvSeg s = gemv_seg(bx, y0, W0, sz0, N0, nb0, y1, W1, sz1, N1, nb1, y2, W2, sz2, N2);                       \
        gemvw_body<R, D, SUMS, ASYNC, HS, Q8, PC, false>(s.y, x, xss, nss, s.W, s.sz, W1, sz1, s.N, K, gs, G, bx, nw,  \
                                                     nb, eps, mode, permx, yss, send, nullptr);                      \
    }
// The split forms (_k, gemvw_body's SPLIT) of gemv_q8_w4h and its _pc form,
// for rows longer than 4 096 features: part after send (every word
// PART_EMPTY between launches), grid.z the blocks a block of rows is split
// into.
#define GEMVW_SPLIT_ENTRY(name, PC)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256, 2)                                                             \
        name(const float* x, const float* xss, int nss, const uint4* permx, int K, int gs, int G, const float* nw,   \
             const float* nb, float eps, int mode, float* yss, char* send, float* part, GEMV_SEGS) {                 \
        int bx = blockIdx.x;                                                                                         \
        GemvSeg s = gemv_seg(bx, y0, W0, sz0, N0, nb0, y1, W1, sz1, N1, nb1, y2, W2, sz2, N2);                       \
        gemvw_body<4, 2, false, false, false, true, PC, true>(s.y, x, xss, nss, s.W, s.sz, W1, sz1, s.N, K, gs, G,  \
                                                          bx, nw, nb, eps, mode, permx, yss, send, part);            \
    }
GEMVW_ENTRY(gemv_q4_w2h, 2, 4, false, 2, false, true, false, false)
GEMVW_ENTRY(gemv_q4_w4h, 4, 2, false, 2, false, true, false, false)
GEMVW_ENTRY(gemv_q4_w2h_n, 2, 4, true, 2, false, true, false, false)
GEMVW_ENTRY(gemv_q4_w4h_n, 4, 2, true, 2, false, true, false, false)
GEMVW_ENTRY(gemv_q4_w4a, 4, 2, false, 3, true, true, false, false)
GEMVW_ENTRY(gemv_q4_w4a_n, 4, 2, true, 3, true, true, false, false)
// the per-channel forms (PC: one group a row), 4-bit (GPTQ's group_size -1)
// and 8-bit (msmodelslim W8A16's default); with the ring in shared memory
GEMVW_ENTRY(gemv_q4_w4a_pc, 4, 2, false, 3, true, true, false, true)
GEMVW_ENTRY(gemv_q4_w4a_pc_n, 4, 2, true, 3, true, true, false, true)
// with the ring in registers
GEMVW_ENTRY(gemv_q4_w2h_pc, 2, 4, false, 2, false, true, false, true)
GEMVW_ENTRY(gemv_q4_w4h_pc, 4, 2, false, 2, false, true, false, true)
GEMVW_ENTRY(gemv_q4_w2h_pc_n, 2, 4, true, 2, false, true, false, true)
GEMVW_ENTRY(gemv_q4_w4h_pc_n, 4, 2, true, 2, false, true, false, true)
GEMVW_ENTRY(gemv_q8_w2h_pc, 2, 4, false, 2, false, false, true, true)
GEMVW_ENTRY(gemv_q8_w4h_pc, 4, 2, false, 2, false, false, true, true)
GEMVW_ENTRY(gemv_q4_w2h_s32, 2, 4, false, 2, false, false, false, false)
GEMVW_ENTRY(gemv_q4_w2h_s32_n, 2, 4, true, 2, false, false, false, false)
// the 8-bit weights' ({scale, zero} floats a group; 16 k a lane's 16 bytes)
GEMVW_ENTRY(gemv_q8_w2h, 2, 4, false, 2, false, false, true, false)
GEMVW_ENTRY(gemv_q8_w4h, 4, 2, false, 2, false, false, true, false)
GEMVW_ENTRY(gemv_q8_w4a, 4, 2, false, 3, true, false, true, false)
GEMVW_ENTRY(gemv_q8_w4a_pc, 4, 2, false, 3, true, false, true, true)
GEMVW_SPLIT_ENTRY(gemv_q8_w4h_k, false)
GEMVW_SPLIT_ENTRY(gemv_q8_w4h_pc_k, true)

// ---------------------------------------------------------------------------
// Tensor-core GEMM: C[M, N] = A[M, K] (fp32, rounded to fp16) · W[N, K]ᵀ with
// W dequantized to fp16 in registers on its way to shared memory.
// mma.sync m16n8k16, fp32 accumulate. Tile 128x128x32, 256 threads (8 warps
// as 2 (M) x 4 (N), each 64x32). K % 32 == 0.
#define BM 128
#define BN 128
#define BK 32
#define SPAD 40  // halfs per smem row (32 + 8 padding)

enum { WF32 = 0, WF16 = 1, WBF16 = 2, WQ8 = 3, WQ4 = 4 };

struct WArgs {
    const void* W;
    const float2* sz;
    const int* gidx;
    int gs, G;
};

// Raw registers of one thread's B slice: row n = tid/2, k offset (tid%2)*16.
struct BRaw {
    uint4 a, b, c, d;
    float2 s;
};

template <int WT>
__device__ __forceinline__ void b_load(BRaw& r, const WArgs& wa, int n, int N, int K, int k) {
    if (n >= N) return;
    if (WT == WF16 || WT == WBF16) {
        const uint4* p = reinterpret_cast<const uint4*>((const uint16_t*)wa.W + (size_t)n * K + k);
        r.a = p[0]; r.b = p[1];
    } else if (WT == WF32) {
        const uint4* p = reinterpret_cast<const uint4*>((const float*)wa.W + (size_t)n * K + k);
        r.a = p[0]; r.b = p[1]; r.c = p[2]; r.d = p[3];
    } else if (WT == WQ8) {
        r.a = *reinterpret_cast<const uint4*>((const int8_t*)wa.W + (size_t)n * K + k);
        if (wa.gidx == nullptr && (wa.gs & 15) == 0) r.s = wa.sz[(size_t)n * wa.G + k / wa.gs];
    } else {  // WQ4: 16 codes = 2 words
        uint2 u = *reinterpret_cast<const uint2*>((const uint32_t*)wa.W + ((size_t)n * K + k) / 8);
        r.a.x = u.x; r.a.y = u.y;
        r.s = wa.sz[(size_t)n * wa.G + k / wa.gs];
    }
}


// Convert to 16 halfs (two uint4) for smem.
template <int WT>
__device__ __forceinline__ void b_convert(const BRaw& r, const WArgs& wa, int n, int N, int k, uint4& o0, uint4& o1) {
    if (n >= N) { o0 = make_uint4(0, 0, 0, 0); o1 = o0; return; }
    if (WT == WF16) { o0 = r.a; o1 = r.b; return; }
    uint32_t o[8];
    if (WT == WBF16) {
        uint32_t in[8] = {r.a.x, r.a.y, r.a.z, r.a.w, r.b.x, r.b.y, r.b.z, r.b.w};
#pragma unroll
        for (int i = 0; i < 8; i++) o[i] = pack_h2(__uint_as_float(in[i] << 16), __uint_as_float(in[i] & 0xffff0000u));
    } else if (WT == WF32) {
        const float* f0 = reinterpret_cast<const float*>(&r.a);
        const float* f1 = reinterpret_cast<const float*>(&r.b);
        const float* f2 = reinterpret_cast<const float*>(&r.c);
        const float* f3 = reinterpret_cast<const float*>(&r.d);
        o[0] = pack_h2(f0[0], f0[1]); o[1] = pack_h2(f0[2], f0[3]);
        o[2] = pack_h2(f1[0], f1[1]); o[3] = pack_h2(f1[2], f1[3]);
        o[4] = pack_h2(f2[0], f2[1]); o[5] = pack_h2(f2[2], f2[3]);
        o[6] = pack_h2(f3[0], f3[1]); o[7] = pack_h2(f3[2], f3[3]);
    } else if (WT == WQ8) {
        uint32_t in[4] = {r.a.x ^ 0x80808080u, r.a.y ^ 0x80808080u, r.a.z ^ 0x80808080u, r.a.w ^ 0x80808080u};
        bool fast = wa.gidx == nullptr && (wa.gs & 15) == 0;
        float qv[16];
#pragma unroll
        for (int i = 0; i < 16; i++) qv[i] = __uint_as_float(__byte_perm(in[i >> 2], 0x4B000000u, 0x7650 | (i & 3))) - 8388736.f;
        if (fast) {
#pragma unroll
            for (int i = 0; i < 8; i++) o[i] = pack_h2((qv[2 * i] - r.s.y) * r.s.x, (qv[2 * i + 1] - r.s.y) * r.s.x);
        } else {
            float v[16];
#pragma unroll
            for (int i = 0; i < 16; i++) {
                float2 s = wa.sz[(size_t)n * wa.G + q_group(k + i, wa.gs, wa.gidx)];
                v[i] = (qv[i] - s.y) * s.x;
            }
#pragma unroll
            for (int i = 0; i < 8; i++) o[i] = pack_h2(v[2 * i], v[2 * i + 1]);
        }
    } else {  // WQ4
        Q4Group g = q4_group_of(r.s);
        __half2 z1024 = g.z1024;
        __half2 sc = __float2half2_rn(g.scale);
        __half2 d[4];
        q4_dequant_uz(r.a.x, z1024, d);
#pragma unroll
        for (int i = 0; i < 4; i++) { __half2 v = __hmul2(d[i], sc); o[i] = *reinterpret_cast<uint32_t*>(&v); }
        q4_dequant_uz(r.a.y, z1024, d);
#pragma unroll
        for (int i = 0; i < 4; i++) { __half2 v = __hmul2(d[i], sc); o[4 + i] = *reinterpret_cast<uint32_t*>(&v); }
    }
    o0 = make_uint4(o[0], o[1], o[2], o[3]);
    o1 = make_uint4(o[4], o[5], o[6], o[7]);
}

// mma_tile_out is the epilogue of gemm_body's and gemm_h_body's warp tile:
// 4 × 4 m16n8 accumulators from row m0, column n0, put into C by out (unit
// u = (4i + j)·2 + hh: row gid (+8 for hh) of m16 tile i, columns 2·tq and
// 2·tq + 1 of n8 tile j).
template <int MI = 4>
__device__ __forceinline__ void mma_tile_out(float* C, int M, int N, int out, const float (&acc)[MI][4][4], int m0,
                                             int n0, int lane) {
    int gid = lane >> 2, tq = lane & 3;
    out_tile<8 * MI, 2, float>(
        C, M, N, out,
        [&](int u, int& m, int& n) {
            m = m0 + (u >> 3) * 16 + gid + (u & 1) * 8;
            n = n0 + ((u >> 1) & 3) * 8 + tq * 2;
        },
        [&](int u, int e) { return acc[u >> 3][(u >> 1) & 3][2 * (u & 1) + e]; }, AsIs{});
}

template <int WT>
__device__ __forceinline__ void gemm_body(float* __restrict__ C, const float* __restrict__ A, WArgs wa,
                                          int M, int N, int K, int kt0, int kt1, int out) {
    __shared__ __align__(16) __half As[2][BM][SPAD];
    __shared__ __align__(16) __half Bs[2][BN][SPAD];
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int wm = warp >> 2, wn = warp & 3;  // 2 x 4 warps
    int m0 = blockIdx.y * BM, n0 = blockIdx.x * BN;
    int lr = tid >> 1, lk = (tid & 1) * 16;  // loader row and k offset
    int am = m0 + lr, bn = n0 + lr;

    float acc[4][4][4];
#pragma unroll
    for (int i = 0; i < 4; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;

    float4 ar[4];
    BRaw br;
    auto load = [&](int k0) {
        if (am < M) {
            const float4* p = reinterpret_cast<const float4*>(A + (size_t)am * K + k0 + lk);
#pragma unroll
            for (int i = 0; i < 4; i++) ar[i] = p[i];
        }
        b_load<WT>(br, wa, bn, N, K, k0 + lk);
    };
    auto store = [&](int buf, int k0) {
        uint4 a0, a1;
        if (am < M) {
            a0 = make_uint4(pack_h2(ar[0].x, ar[0].y), pack_h2(ar[0].z, ar[0].w), pack_h2(ar[1].x, ar[1].y), pack_h2(ar[1].z, ar[1].w));
            a1 = make_uint4(pack_h2(ar[2].x, ar[2].y), pack_h2(ar[2].z, ar[2].w), pack_h2(ar[3].x, ar[3].y), pack_h2(ar[3].z, ar[3].w));
        } else {
            a0 = make_uint4(0, 0, 0, 0); a1 = a0;
        }
        *reinterpret_cast<uint4*>(&As[buf][lr][lk]) = a0;
        *reinterpret_cast<uint4*>(&As[buf][lr][lk + 8]) = a1;
        uint4 b0, b1;
        b_convert<WT>(br, wa, bn, N, k0 + lk, b0, b1);
        *reinterpret_cast<uint4*>(&Bs[buf][lr][lk]) = b0;
        *reinterpret_cast<uint4*>(&Bs[buf][lr][lk + 8]) = b1;
    };

    if (kt0 < kt1) {
        load(kt0 * BK);
        store(0, kt0 * BK);
    }
    __syncthreads();
    for (int kt = kt0; kt < kt1; kt++) {
        int cur = (kt - kt0) & 1;
        if (kt + 1 < kt1) load((kt + 1) * BK);
#pragma unroll
        for (int kk = 0; kk < BK; kk += 16) {
            uint32_t af[4][4], bf[2][4];
#pragma unroll
            for (int i = 0; i < 4; i++)
                ldmatrix_x4(af[i], &As[cur][wm * 64 + i * 16 + (lane & 15)][kk + (lane >> 4) * 8]);
#pragma unroll
            for (int j = 0; j < 2; j++)
                ldmatrix_x4(bf[j], &Bs[cur][wn * 32 + j * 16 + (lane & 7) + ((lane >> 4) << 3)][kk + ((lane >> 3) & 1) * 8]);
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    mma16816(acc[i][j], af[i], bf[j >> 1][(j & 1) * 2], bf[j >> 1][(j & 1) * 2 + 1]);
        }
        if (kt + 1 < kt1) store(cur ^ 1, (kt + 1) * BK);
        __syncthreads();
    }
    mma_tile_out(C, M, N, out, acc, m0 + wm * 64, n0 + wn * 32, lane);
}

// Multistage fp16 tensor-core GEMM for dense fp16/bf16 weights and, in
// prefill, 4- and 8-bit weights (gemm_h_q4, gemm_h_q8: dequantized in the
// registers) or, with other groups, widened to fp16 (dequant_h_*): C[M,N] =
// A16[M,K]·W[N,K]ᵀ with A16 the activations rounded to fp16 once
// (to_half). 128 × 128 block tiles, K in steps of GH_BK through a cp.async
// ring of GH_STAGES tiles, so the copies of the next tiles overlap the mma
// of this one; warps and fragments as in gemm_body (bf16 weights rounded
// to fp16 in the registers after ldmatrix, as gemm_body rounds them before
// its shared-memory store). K % 8 == 0; rows past M or N and chunks past K
// are zero-filled. Dynamic shared memory: GH_SMEM bytes (gemm_h_q4:
// GHQ_SMEM, gemm_h_q8: GHQ8_SMEM).
#define GH_STAGES 3
#define GH_BK 64
// gh_bm<MI> is the rows of A a gemm_h block tile takes with MI 16-row
// fragments a warp (two warps of rows): 128 for the prefill's tiles (MI =
// 4, BM), 32 for a short prompt's (MI = 1; the _s kernels), whose weight
// tiles are then read and dequantized for 32 rows instead of 128 mostly
// zero. The shared memory sizes below are for BM rows; the _s kernels' for
// 32 (GH_S_SMEM, GHQ_S_SMEM, GHQ8_S_SMEM).
template <int MI>
constexpr int gh_bm = 32 * MI;
#define GH_LD 72  // halfs per smem row (64 + 8 padding)
// GH_SMEM_ROWS(bm) and its kin: the bytes for a tile of bm rows of A.
#define GH_SMEM_ROWS(bm) (GH_STAGES * ((bm) + BN) * GH_LD * 2)
#define GH_SMEM GH_SMEM_ROWS(BM)
// gemm_h_q4 keeps a stage's 4-bit weights as they are (BN rows of 8 words,
// the two 16-byte halves of a row swapped on rows 4-7 of every 8, so that
// the 8 rows a fragment load touches fall in distinct banks) and each
// row's {scale, zero} (one group a stage: gs % GH_BK == 0).
#define GHQ_SMEM_ROWS(bm) (GH_STAGES * ((bm) * GH_LD * 2 + BN * 32 + BN * 8))
#define GHQ_SMEM GHQ_SMEM_ROWS(BM)
// gemm_h_q8 keeps a stage's int8 codes (BN rows of GH_BK bytes, padded to
// GHQ8_LD) and each row's {scale, zero} (gs % GH_BK == 0, no g_idx).
#define GHQ8_LD 80
#define GHQ8_SMEM_ROWS(bm) (GH_STAGES * ((bm) * GH_LD * 2 + BN * GHQ8_LD + BN * 8))
#define GHQ8_SMEM GHQ8_SMEM_ROWS(BM)
#define GH_S_SMEM GH_SMEM_ROWS(32)
#define GHQ_S_SMEM GHQ_SMEM_ROWS(32)
#define GHQ8_S_SMEM GHQ8_SMEM_ROWS(32)
enum { GH_F16 = 0, GH_BF16 = 1, GH_Q4 = 2, GH_Q8 = 3, GH_S8 = 4 };  // GH_S8: gemm_wg_s8 alone

// gather_cols: dst[r][j] = x[r][perm[j]] (the input of an act-order
// weight stored with its columns sorted by group).
extern "C" __global__ void gather_cols(float* __restrict__ dst, const float* __restrict__ x, const int* __restrict__ perm,
                                       int rows, int cols) {
    PDL_ENTRY();
    long long n = (long long)rows * cols;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        long long r = i / cols;
        dst[i] = x[r * cols + perm[i - r * cols]];
    }
}

// gather_half: dst[r][j] = half(x[r][perm[j]]), as gather_cols then
// to_half in one pass: grid (rows), block 256, the row staged in dynamic
// shared memory (4·cols bytes) by coalesced loads, then gathered from it
// and written as fp16 pairs. cols % 4 == 0.
extern "C" __global__ void __launch_bounds__(256) gather_half(__half* __restrict__ dst, const float* __restrict__ x,
                                                              const int* __restrict__ perm, int cols) {
    extern __shared__ float4 xrow[];
    PDL_ENTRY();
    const float4* xr = reinterpret_cast<const float4*>(x + (size_t)blockIdx.x * cols);
    for (int i = threadIdx.x; i < cols / 4; i += blockDim.x) xrow[i] = xr[i];
    __syncthreads();
    const float* row = reinterpret_cast<const float*>(xrow);
    uint32_t* d = reinterpret_cast<uint32_t*>(dst + (size_t)blockIdx.x * cols);
    for (int j = threadIdx.x; j < cols / 2; j += blockDim.x) {
        int2 p = reinterpret_cast<const int2*>(perm)[j];
        d[j] = pack_h2(row[p.x], row[p.y]);
    }
}

extern "C" __global__ void to_half(__half* __restrict__ dst, const float* __restrict__ src, long long n) {
    PDL_ENTRY();
    long long n4 = n / 4;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n4; i += (long long)gridDim.x * blockDim.x) {
        float4 v = reinterpret_cast<const float4*>(src)[i];
        uint2 o = make_uint2(pack_h2(v.x, v.y), pack_h2(v.z, v.w));
        reinterpret_cast<uint2*>(dst)[i] = o;
    }
    for (long long i = n4 * 4 + blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x)
        dst[i] = __float2half_rn(src[i]);
}

// The quantized weights of a large prefill GEMM are first widened to fp16
// [N, K] (dequant_h_*: (q − z)·s in fp32, rounded once) and multiplied by
// gemm_h_f16: at M ≥ a few hundred rows the extra pass over the weight
// costs less than dequantizing every tile in the GEMM's loader. 8
// consecutive k per thread; K % 8 == 0.
extern "C" __global__ void dequant_h_q4(__half* __restrict__ dst, const uint32_t* __restrict__ q,
                                        const float2* __restrict__ sz, int N, int K, int gs, int G) {
    PDL_ENTRY();
    long long words = (long long)N * (K / 8);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < words; i += (long long)gridDim.x * blockDim.x) {
        int n = (int)(i / (K / 8)), k = (int)(i % (K / 8)) * 8;
        uint32_t w = q[i];
        float v[8];
#pragma unroll
        for (int e = 0; e < 8; e++) {
            float2 s = sz[(size_t)n * G + (k + e) / gs];
            __half2 zh = *reinterpret_cast<__half2*>(&s.y);
            float z = __low2float(zh) - 1024.f;
            v[e] = ((float)((w >> q4_shift(e)) & 15u) - z) * s.x;
        }
        reinterpret_cast<uint4*>(dst)[i] = make_uint4(pack_h2(v[0], v[1]), pack_h2(v[2], v[3]), pack_h2(v[4], v[5]), pack_h2(v[6], v[7]));
    }
}
extern "C" __global__ void dequant_h_q8(__half* __restrict__ dst, const int8_t* __restrict__ q, const float2* __restrict__ sz,
                                        const int* __restrict__ gidx, int N, int K, int gs, int G) {
    PDL_ENTRY();
    long long chunks = (long long)N * (K / 8);
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < chunks; i += (long long)gridDim.x * blockDim.x) {
        int n = (int)(i / (K / 8)), k = (int)(i % (K / 8)) * 8;
        uint2 w = reinterpret_cast<const uint2*>(q)[i];
        float v[8];
#pragma unroll
        for (int e = 0; e < 8; e++) {
            float2 s = sz[(size_t)n * G + q_group(k + e, gs, gidx)];
            int8_t c = (int8_t)(((e < 4 ? w.x : w.y) >> (8 * (e & 3))) & 0xff);
            v[e] = ((float)c - s.y) * s.x;
        }
        reinterpret_cast<uint4*>(dst)[i] = make_uint4(pack_h2(v[0], v[1]), pack_h2(v[2], v[3]), pack_h2(v[4], v[5]), pack_h2(v[6], v[7]));
    }
}

__device__ __forceinline__ uint32_t bf2_to_h2(uint32_t x) {
    return pack_h2(__uint_as_float(x << 16), __uint_as_float(x & 0xffff0000u));
}

// The tensor-core GEMMs make 8-bit codes fp16 weights two at a time in
// half2 arithmetic (q8_pair), from a row's {scale s, zero z} made into a
// Q8Half once a row and K step (q8_half): z's integer part zi as 1152 + zi
// (exact for zi in [−128, 895], z clamped there), the scale with its
// exponent moved into [0.5, 1) (ss = s·2^E, so that a scale below fp16's
// normal range keeps its bits), −ss·(z − zi) and 2^−E, each in both
// halves; a weight is then (ss·(q − zi) − ss·(z − zi))·2^−E. Against
// ((float)q − z)·s rounded to fp16 a weight is at most one fp16 unit off
// where z is an integer; a fractional z adds its term's own rounding
// (under 2^−13·ss: the term takes ss rounded, as the product does),
// for 2^−25 ≤ |s| < 2^15 (smaller scales give 0; from 2^15 on
// 2^−E is infinite); a NaN or infinite scale gives 0, which
// model.Quantized.Validate keeps out. NRM (a weight whose every scale is
// 0 or in fp16's normal range, 2^−14 ≤ |s| < 2^15: Linear.q8Normal): ss
// is the scale itself and the product has no 2^−E factor (one HMUL2 a pair
// fewer); the weights are the same but where a value or the fraction's
// term is below fp16's normal range.
struct Q8Half {
    __half2 z, s, f, p;
};
template <bool NRM = false>
__device__ __forceinline__ Q8Half q8_half(float2 v) {
    float zi = fminf(fmaxf(rintf(v.y), -128.f), 895.f);
    uint32_t bits = __float_as_uint(v.x), e = (bits >> 23) & 0xffu;
    float s = NRM ? v.x : __uint_as_float((bits & 0x807fffffu) | 0x3f000000u);  // exponent of 0.5
    float z = 1152.f + zi, f = -(v.y - zi) * __half2float(__float2half_rn(s));  // ss as the product's term takes it
    float p = __uint_as_float((e + 1) << 23);  // 2^(e − 126): s/ss
    return {__floats2half2_rn(z, z), __floats2half2_rn(s, s), __floats2half2_rn(f, f), __floats2half2_rn(p, p)};
}
// q8_pair is the fp16 weights of the codes in bytes 0 and 2 of x (the
// other bytes ignored): 1024 + (q + 128) from the code's bits (the sign
// bit flipped, fp16's exponent of 1024 put above), less 1152 + zi (exact),
// times ss plus the zero's fraction (one rounding), times 2^−E (NRM: the
// scale, no 2^−E).
template <bool NRM = false>
__device__ __forceinline__ __half2 q8_pair(uint32_t x, const Q8Half& c) {
    uint32_t u;  // (x & 0x00ff00ff) ^ 0x64806480 in one LOP3 (nvcc's own makes two: one immediate a LOP3)
    asm("lop3.b32 %0, %1, %2, %3, 0x6a;" : "=r"(u) : "r"(x), "n"(0x00ff00ff), "r"(0x64806480));
    __half2 d = __hsub2(*reinterpret_cast<__half2*>(&u), c.z);
    if constexpr (NRM) return __hfma2(d, c.s, c.f);
    return __hmul2(__hfma2(d, c.s, c.f), c.p);
}

// WK: GH_F16 and GH_BF16 (W [N, K] of 16-bit values), GH_Q4 (W [N, K/8]
// words of 4-bit codes as in the q4 convention, sz [N, G] their {scale,
// half2(1024 + z)}, gs a multiple of GH_BK; each fragment dequantized in
// registers, (u − z)·scale in fp16), GH_Q8 (W [N, K] int8 codes, sz their
// {scale, zero}, gs a multiple of GH_BK: q8_pair's half2 form, within
// one or two fp16 units of what dequant_h_q8 widens them to).
// MI is the 16-row fragments of A a warp holds: the block tile is
// gh_bm<MI> = 32·MI rows of A by 128 rows of W.
template <int WK, int MI = 4>
__device__ __forceinline__ void gemm_h_body(float* __restrict__ C, const __half* __restrict__ A, const void* __restrict__ W,
                                            const float2* __restrict__ sz, int M, int N, int K, int gs, int G, int kt0,
                                            int kt1, int out) {
    constexpr int TM = gh_bm<MI>;
    extern __shared__ __align__(16) unsigned char gh_smem[];
    __half (*As)[TM][GH_LD] = reinterpret_cast<__half (*)[TM][GH_LD]>(gh_smem);
    __half (*Bs)[BN][GH_LD] = reinterpret_cast<__half (*)[BN][GH_LD]>(gh_smem + GH_STAGES * TM * GH_LD * 2);
    uint32_t (*Bq)[BN][8] = reinterpret_cast<uint32_t (*)[BN][8]>(gh_smem + GH_STAGES * TM * GH_LD * 2);
    int8_t (*B8)[BN][GHQ8_LD] = reinterpret_cast<int8_t (*)[BN][GHQ8_LD]>(gh_smem + GH_STAGES * TM * GH_LD * 2);
    float2 (*Ss)[BN] = reinterpret_cast<float2 (*)[BN]>(gh_smem + GH_STAGES * (TM * GH_LD * 2 + (WK == GH_Q8 ? BN * GHQ8_LD : BN * 32)));
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int wm = warp >> 2, wn = warp & 3;  // 2 x 4 warps
    int m0 = blockIdx.y * TM, n0 = blockIdx.x * BN;
    // each thread copies MI chunks of 8 halfs of A and 4 of B per stage
    // (chunks past K zero-filled); GH_Q8: 2 chunks of 16 codes, GH_Q4: one
    // 16-byte half of a row of words, and (threads 0..127) a row's {scale,
    // zero}
    auto load = [&](int kt, int st) {
#pragma unroll
        for (int i = 0; i < 4; i++) {
            int c = tid + i * 256;  // row c/8, chunk c%8
            int r = c >> 3, kc = (c & 7) * 8, k = kt * GH_BK + kc;
            int am = m0 + r, bn = n0 + r;
            bool va = am < M && k < K, vb = bn < N && k < K;
            if (i < MI)
                cp_async16_zfill(&As[st][r][kc], va ? (const void*)(A + (size_t)am * K + k) : (const void*)A, va);
            if constexpr (WK == GH_F16 || WK == GH_BF16) {
                const uint16_t* W16 = static_cast<const uint16_t*>(W);
                cp_async16_zfill(&Bs[st][r][kc], vb ? (const void*)(W16 + (size_t)bn * K + k) : W, vb);
            }
        }
        if constexpr (WK == GH_Q8) {
#pragma unroll
            for (int i = 0; i < 2; i++) {
                int c = tid + i * 256;  // row c/4, 16 bytes c%4
                int r = c >> 2, kc = (c & 3) * 16, bn = n0 + r, k = kt * GH_BK + kc;
                bool vb = bn < N && k < K;
                const int8_t* W8 = static_cast<const int8_t*>(W);
                cp_async16_zfill(&B8[st][r][kc], vb ? (const void*)(W8 + (size_t)bn * K + k) : W, vb);
            }
        }
        if constexpr (WK == GH_Q4) {
            int r = tid >> 1, h = tid & 1, bn = n0 + r, k = kt * GH_BK + h * 32;
            bool vb = bn < N && k < K;
            const uint32_t* Wq = static_cast<const uint32_t*>(W);
            cp_async16_zfill(&Bq[st][r][(h ^ ((r >> 2) & 1)) * 4], vb ? (const void*)(Wq + ((size_t)bn * K + k) / 8) : W, vb);
        }
        if constexpr (WK == GH_Q4 || WK == GH_Q8) {
            if (tid < BN) {
                bool vs = n0 + tid < N && kt * GH_BK < K;
                cp_async8_zfill(&Ss[st][tid], vs ? (const void*)(sz + (size_t)(n0 + tid) * G + kt * GH_BK / gs) : (const void*)sz, vs);
            }
        }
    };
    float acc[MI][4][4];
#pragma unroll
    for (int i = 0; i < MI; i++)
#pragma unroll
        for (int j = 0; j < 4; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0.f;
#pragma unroll
    for (int s = 0; s < GH_STAGES - 1; s++) {
        if (kt0 + s < kt1) load(kt0 + s, s);
        cp_async_commit();
    }
    for (int kt = kt0; kt < kt1; kt++) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(GH_STAGES - 2) : "memory");
        __syncthreads();  // tile kt is in; every warp is done with tile kt-1's stage
        int nx = kt + GH_STAGES - 1;
        if (nx < kt1) load(nx, (nx - kt0) % GH_STAGES);
        cp_async_commit();
        int cur = (kt - kt0) % GH_STAGES;
        // GH_Q4: this lane's 4 weight rows (n = gid of each 8-row tile j)
        // and their scale and zero1024, as half2; GH_Q8: their Q8Half
        __half2 qs[4], qz[4];
        Q8Half q8c[4];
        if constexpr (WK == GH_Q8) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float2 sv = Ss[cur][wn * 32 + j * 8 + (lane >> 2)];
                q8c[j] = q8_half(sv);
            }
        }
        if constexpr (WK == GH_Q4) {
#pragma unroll
            for (int j = 0; j < 4; j++) {
                float2 sv = Ss[cur][wn * 32 + j * 8 + (lane >> 2)];
                qs[j] = __float2half2_rn(sv.x);
                qz[j] = *reinterpret_cast<__half2*>(&sv.y);
            }
        }
#pragma unroll
        for (int kk = 0; kk < GH_BK; kk += 16) {
            uint32_t af[MI][4], bf[2][4];
#pragma unroll
            for (int i = 0; i < MI; i++)
                ldmatrix_x4(af[i], &As[cur][wm * 16 * MI + i * 16 + (lane & 15)][kk + (lane >> 4) * 8]);
            if constexpr (WK == GH_Q4) {
                // tile j's b0, b1: k = kk + 2tq (+1) and kk + 8 + 2tq (+1) of
                // row gid, elements 2tq and 2tq+1 of words kk/8 and kk/8 + 1
                int tq = lane & 3;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    int r = wn * 32 + j * 8 + (lane >> 2);
                    const uint32_t* wp = &Bq[cur][r][((kk >> 5) ^ ((r >> 2) & 1)) * 4 + ((kk >> 3) & 3)];
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        __half2 v = __hmul2(q4_pair_uz(wp[e], tq, qz[j]), qs[j]);
                        bf[j >> 1][(j & 1) * 2 + e] = *reinterpret_cast<uint32_t*>(&v);
                    }
                }
            } else if constexpr (WK == GH_Q8) {
                // tile j's b0, b1: codes kk + 2tq (+1) and kk + 8 + 2tq (+1)
                // of row gid
                int tq = lane & 3;
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    const int8_t* cp = &B8[cur][wn * 32 + j * 8 + (lane >> 2)][kk + 2 * tq];
#pragma unroll
                    for (int e = 0; e < 2; e++) {
                        uint32_t v = *reinterpret_cast<const uint16_t*>(cp + 8 * e);
                        __half2 h = q8_pair(__byte_perm(v, 0, 0x0100), q8c[j]);
                        bf[j >> 1][(j & 1) * 2 + e] = *reinterpret_cast<uint32_t*>(&h);
                    }
                }
            } else {
#pragma unroll
                for (int j = 0; j < 2; j++) {
                    ldmatrix_x4(bf[j], &Bs[cur][wn * 32 + j * 16 + (lane & 7) + ((lane >> 4) << 3)][kk + ((lane >> 3) & 1) * 8]);
                    if (WK == GH_BF16) {
#pragma unroll
                        for (int e = 0; e < 4; e++) bf[j][e] = bf2_to_h2(bf[j][e]);
                    }
                }
            }
#pragma unroll
            for (int i = 0; i < MI; i++)
#pragma unroll
                for (int j = 0; j < 4; j++)
                    mma16816(acc[i][j], af[i], bf[j >> 1][(j & 1) * 2], bf[j >> 1][(j & 1) * 2 + 1]);
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    mma_tile_out<MI>(C, M, N, out, acc, m0 + wm * 16 * MI, n0 + wn * 32, lane);
}
// Split z of gridDim.z takes an equal share of the K steps and writes its
// partial product to C + z·M·N (sum_splits adds them up and applies out;
// see GEMM_ENTRY); an unsplit launch applies out itself.
#define SPLIT_OUT (gridDim.z > 1 ? OUT_STORE : out)
// KSplit is split blockIdx.z's share [kt0, kt1) of a GEMM's nk K steps:
// gridDim.z equal shares (each a multiple of align steps), the last ones
// short or empty.
struct KSplit {
    int kt0, kt1;
};
__device__ __forceinline__ KSplit k_split(int nk, int align = 1) {
    int per = (nk + gridDim.z - 1) / gridDim.z;
    per = (per + align - 1) / align * align;
    int kt0 = min(nk, (int)blockIdx.z * per);
    return KSplit{kt0, min(nk, kt0 + per)};
}
#define GEMM_H_SPLIT(WK, MI, W, sz, gs, G)                                                                       \
    PDL_ENTRY();                                                                                                 \
    KSplit ks = k_split((K + GH_BK - 1) / GH_BK);                                                                \
    gemm_h_body<WK, MI>(C + (size_t)blockIdx.z * M * N, A, W, sz, M, N, K, gs, G, ks.kt0, ks.kt1, SPLIT_OUT);
#define GEMM_H_ENTRY(name, WK, MI)                                                                               \
    extern "C" __global__ void __launch_bounds__(256, 2) name(float* C, const __half* A, const uint16_t* W, int M, \
                                                              int N, int K, int out) {                           \
        GEMM_H_SPLIT(WK, MI, W, nullptr, GH_BK, 0)                                                               \
    }
// The _s kernels take tiles of 32 rows of A (gh_bm<1>; grid.y = ceil(M/32)),
// for short prompts.
GEMM_H_ENTRY(gemm_h_f16, GH_F16, 4)
GEMM_H_ENTRY(gemm_h_bf16, GH_BF16, 4)
GEMM_H_ENTRY(gemm_h_f16_s, GH_F16, 1)
GEMM_H_ENTRY(gemm_h_bf16_s, GH_BF16, 1)
// gemm_h_q4(C, A16, W, sz, M, N, K, gs, G, out): the 4-bit weight fused
// (no widening pass); gs % GH_BK == 0, dynamic shared memory GHQ_SMEM
// (gemm_h_q4_s: GHQ_S_SMEM).
#define GEMM_H_Q_ENTRY(name, WK, WT, MI)                                                                            \
    extern "C" __global__ void __launch_bounds__(256, 2) name(float* C, const __half* A, const WT* W, const float2* sz, \
                                                              int M, int N, int K, int gs, int G, int out) {          \
        GEMM_H_SPLIT(WK, MI, W, sz, gs, G)                                                                            \
    }
GEMM_H_Q_ENTRY(gemm_h_q4, GH_Q4, uint32_t, 4)
GEMM_H_Q_ENTRY(gemm_h_q4_s, GH_Q4, uint32_t, 1)
// gemm_h_q8(C, A16, W, sz, M, N, K, gs, G, out): the 8-bit weight fused;
// gs % GH_BK == 0, no g_idx, dynamic shared memory GHQ8_SMEM (gemm_h_q8_s:
// GHQ8_S_SMEM).
GEMM_H_Q_ENTRY(gemm_h_q8, GH_Q8, int8_t, 4)
GEMM_H_Q_ENTRY(gemm_h_q8_s, GH_Q8, int8_t, 1)

// ---------------------------------------------------------------------------
// Hopper GEMM (sm_90a only: the wgmma instructions exist in no other
// target; the backend selects these kernels where the device is 9.0 and the
// driver can encode tensor maps). C[M, N] = A[M, K] · W[N, K]ᵀ with A the
// activations rounded to fp16 (to_half) and W of any gemm_h kind, each
// value as gemm_h_body makes it, or (gemm_wg_s8) A and W int8 as w8a8_mma
// takes them. A block of 3 warpgroups computes a 128 × 128 tile; the _w
// forms (AH = 2) a tile of two 128-row halves: 256 activation rows by 128
// for the register-fragment kinds, 128 by 256 weight rows for fp16 and
// int8.
// Warpgroup 0 produces: one thread loads the A and W tiles of each K step
// (64 values; 128 for int8) with the bulk tensor copy engine (TMA: a tensor
// map per operand, 128-byte swizzle for 128-byte rows, the parts past M, N
// or K zero-filled) into a ring of gw_stages stages, each completing on its
// mbarrier "full"; for the quantized kinds each producer thread also
// copies one weight row's {scale, zero}. Warpgroups 1 and 2 consume and
// release each stage to the producer once their wgmma has read it
// ("empty": one arrival per consumer warp). fp16 weights and int8: each
// consumer multiplies its 64 rows of A by the W tile, four wgmma
// m64n128k16 (int8: m64n128k32, int32 accumulators; _w: m64n256) a stage
// with both operands read from shared memory through descriptors, one
// stage in flight. Other kinds: each consumer computes the transposed
// product of its 64 weight rows, widened or dequantized from shared memory
// into the A registers of wgmma, by the A tile as the B operand, making the
// next step's registers while the tensor cores run the current one; these
// kinds and the _w forms move registers from the producer to the
// consumers (setmaxnreg: 40 and 232 a thread, the 168 of the launch on
// average). fp32
// accumulators in registers. Split z of gridDim.z takes an equal share of
// the K steps and writes its partial product to C + z·M·N, as the gemm_h
// kernels do.
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define GW_BK 64       // K step: 64 halfs, one 128-byte swizzle row
// gw_stages is the ring's depth (runtime/cuda's gemmWGStages): the 4-bit
// kind's stages are small (21 KB), and 8 of them keep its copies further
// ahead (4-bit GEMMs 2-6 % faster than with 5; 10 no faster). With AH
// = 2 (two 128-row halves: 16 KB more a stage) as many as fit in 227 KB.
template <int WK, int AH = 1>
__host__ __device__ constexpr int gw_stages() {
    return AH == 1 ? (WK == GH_Q4 ? 8 : 5) : WK == GH_Q4 ? 6 : WK == GH_Q8 ? 5 : 4;
}
__device__ __forceinline__ uint32_t smem_u32(const void* p) { return (uint32_t)__cvta_generic_to_shared(p); }
// TmaMap holds a CUtensorMap (cuTensorMapEncodeTiled) passed by value.
struct __align__(64) TmaMap {
    unsigned long long v[16];
};
__device__ __forceinline__ void mbar_init(uint32_t bar, int count) {
    asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(bar), "r"(count) : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint32_t bar) {
    asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(bar) : "memory");
}
__device__ __forceinline__ void mbar_expect_tx(uint32_t bar, uint32_t bytes) {
    asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(bar), "r"(bytes) : "memory");
}
__device__ __forceinline__ void mbar_wait(uint32_t bar, uint32_t parity) {
    uint32_t done;
    do {
        asm volatile(
            "{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}\n"
            : "=r"(done)
            : "r"(bar), "r"(parity)
            : "memory");
    } while (!done);
}
// tma_load_2d copies the box at (x, y) (x the inner, contiguous dimension)
// of the tensor map's tensor into shared memory at dst, completing on bar.
__device__ __forceinline__ void tma_load_2d(uint32_t dst, const TmaMap* map, int x, int y, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3}], [%4];"
        ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar)
        : "memory");
}
// tma_load_3d is tma_load_2d of the box at (x, y, z).
__device__ __forceinline__ void tma_load_3d(uint32_t dst, const TmaMap* map, int x, int y, int z, uint32_t bar) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1, {%2, %3, %4}], [%5];"
        ::"r"(dst), "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(bar)
        : "memory");
}
// tma_load_2d_once and tma_load_3d_once are tma_load_2d and _3d for a
// weight tile, which a prefill pass reads once: under the L2 policy pol
// (l2_evict_first), as the GEMVs read weights, so that the weights'
// stream leaves what the pass reads again in L2 (the activations, the KV
// cache, the kernels' code). On an H200 (seventy-fourth session, bench
// --synthetic, one call) W8A8 prefill ran 2.0–3.7 % faster at 128–512
// tokens on llama2-7b and llama3-8b, fp16 2–4 %, W4A16 as before.
__device__ __forceinline__ void tma_load_2d_once(uint32_t dst, const TmaMap* map, int x, int y, uint32_t bar,
                                                 uint64_t pol) {
    asm volatile(
        "cp.async.bulk.tensor.2d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%2, %3}], [%4], %5;" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(bar), "l"(pol)
        : "memory");
}
__device__ __forceinline__ void tma_load_3d_once(uint32_t dst, const TmaMap* map, int x, int y, int z, uint32_t bar,
                                                 uint64_t pol) {
    asm volatile(
        "cp.async.bulk.tensor.3d.shared::cluster.global.mbarrier::complete_tx::bytes.L2::cache_hint"
        " [%0], [%1, {%2, %3, %4}], [%5], %6;" ::"r"(dst),
        "l"(reinterpret_cast<uint64_t>(map)), "r"(x), "r"(y), "r"(z), "r"(bar), "l"(pol)
        : "memory");
}
// wg_desc is the wgmma descriptor of a K-major tile at shared address a:
// rows of 128 bytes, 128-byte swizzle, 8-row groups 1024 bytes apart.
__device__ __forceinline__ uint64_t wg_desc(uint32_t a) {
    return (uint64_t)((a & 0x3ffff) >> 4) | (1ull << 16) | ((uint64_t)(1024 >> 4) << 32) | (1ull << 62);
}
// The accumulator operands of an inline wgmma in runs (WG_R0_63 …), and
// those of an m64n112, m64n128, m64n176, m64n224 and m64n256 (WG_D56,
// WG_D64, WG_D88, WG_D112, WG_D128: %0..%55, %63, %87, %111, %127) with
// their constraints (WG_ACC56, WG_ACC, WG_ACC88, WG_ACC112, WG_ACC128: C
// is "+f" for fp32 accumulators, "+r" for int32).
#define WG_R0_63 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63"
#define WG_R64_87 \
    "%64, %65, %66, %67, %68, %69, %70, %71, %72, %73, %74, %75, %76, %77, %78, %79, " \
    "%80, %81, %82, %83, %84, %85, %86, %87"
#define WG_R88_111 \
    "%88, %89, %90, %91, %92, %93, %94, %95, %96, %97, %98, %99, %100, %101, %102, %103, " \
    "%104, %105, %106, %107, %108, %109, %110, %111"
#define WG_R112_127 \
    "%112, %113, %114, %115, %116, %117, %118, %119, %120, %121, %122, %123, %124, %125, %126, %127"
#define WG_R0_55 \
    "%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, " \
    "%16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, " \
    "%32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, " \
    "%48, %49, %50, %51, %52, %53, %54, %55"
#define WG_D56 "{" WG_R0_55 "}"
#define WG_D64 "{" WG_R0_63 "}"
#define WG_ACC8(C, i) C(d[i]), C(d[i + 1]), C(d[i + 2]), C(d[i + 3]), C(d[i + 4]), C(d[i + 5]), C(d[i + 6]), C(d[i + 7])
#define WG_ACC(C) \
    WG_ACC8(C, 0), WG_ACC8(C, 8), WG_ACC8(C, 16), WG_ACC8(C, 24), WG_ACC8(C, 32), WG_ACC8(C, 40), WG_ACC8(C, 48), WG_ACC8(C, 56)
#define WG_ACC56(C) \
    WG_ACC8(C, 0), WG_ACC8(C, 8), WG_ACC8(C, 16), WG_ACC8(C, 24), WG_ACC8(C, 32), WG_ACC8(C, 40), WG_ACC8(C, 48)
#define WG_D88 "{" WG_R0_63 ", " WG_R64_87 "}"
#define WG_ACC88(C) WG_ACC(C), WG_ACC8(C, 64), WG_ACC8(C, 72), WG_ACC8(C, 80)
#define WG_D112 "{" WG_R0_63 ", " WG_R64_87 ", " WG_R88_111 "}"
#define WG_ACC112(C) WG_ACC88(C), WG_ACC8(C, 88), WG_ACC8(C, 96), WG_ACC8(C, 104)
#define WG_D128 "{" WG_R0_63 ", " WG_R64_87 ", " WG_R88_111 ", " WG_R112_127 "}"
#define WG_ACC128(C) WG_ACC112(C), WG_ACC8(C, 112), WG_ACC8(C, 120)
// WGMMA_SS(name, T, NA, SHAPE, DS, ACCS, C, AB, P, TAIL) defines
// name(d, da, db): one wgmma of instruction shape and types SHAPE with both
// operands in shared memory (descriptors da, db) into the NA accumulators
// d of type T (DS their operand list, ACCS(C) their bindings under
// constraint C), AB and P the operand numbers of the descriptors and of
// the scale-d flag, TAIL the arguments after it (the f16 forms' scales and
// layouts).
#define WGMMA_SS(name, T, NA, SHAPE, DS, ACCS, C, AB, P, TAIL)                                     \
    __device__ __forceinline__ void name(T(&d)[NA], uint64_t da, uint64_t db) {                    \
        asm volatile("{\n.reg .pred p;\nsetp.ne.b32 p, " P ", 0;\nwgmma.mma_async.sync.aligned." SHAPE \
                     " " DS ", " AB ", p" TAIL ";\n}\n"                                            \
                     : ACCS(C)                                                                   \
                     : "l"(da), "l"(db), "r"(1));                                                \
    }
// D[64 × 128] += A[64 × 16] · B[128 × 16]ᵀ; in int8 A[64 × 32] · B[128 ×
// 32]ᵀ with int32 accumulators; the m64n256 forms D[64 × 256], A read once
// for 256 columns (half the shared-memory reads of two m64n128 products).
WGMMA_SS(wgmma_m64n128k16, float, 64, "m64n128k16.f32.f16.f16", WG_D64, WG_ACC, "+f", "%64, %65", "%66", ", 1, 1, 0, 0")
WGMMA_SS(wgmma_m64n128k32_s8, int, 64, "m64n128k32.s32.s8.s8", WG_D64, WG_ACC, "+r", "%64, %65", "%66", "")
WGMMA_SS(wgmma_m64n256k16, float, 128, "m64n256k16.f32.f16.f16", WG_D128, WG_ACC128, "+f", "%128, %129", "%130", ", 1, 1, 0, 0")
WGMMA_SS(wgmma_m64n256k32_s8, int, 128, "m64n256k32.s32.s8.s8", WG_D128, WG_ACC128, "+r", "%128, %129", "%130", "")
// The int8 m64n112, m64n176 and m64n224 forms (the fill forms: 112 rows
// of one weight, or 88 or 112 rows of each of gate and up a block).
WGMMA_SS(wgmma_m64n112k32_s8, int, 56, "m64n112k32.s32.s8.s8", WG_D56, WG_ACC56, "+r", "%56, %57", "%58", "")
WGMMA_SS(wgmma_m64n176k32_s8, int, 88, "m64n176k32.s32.s8.s8", WG_D88, WG_ACC88, "+r", "%88, %89", "%90", "")
WGMMA_SS(wgmma_m64n224k32_s8, int, 112, "m64n224k32.s32.s8.s8", WG_D112, WG_ACC112, "+r", "%112, %113", "%114", "")
// wgmma_ss: one k step of 32 bytes (16 halfs or 32 int8) with both operands
// in shared memory, by the accumulators' type.
__device__ __forceinline__ void wgmma_ss(float (&d)[64], uint64_t da, uint64_t db) { wgmma_m64n128k16(d, da, db); }
__device__ __forceinline__ void wgmma_ss(int (&d)[64], uint64_t da, uint64_t db) { wgmma_m64n128k32_s8(d, da, db); }
__device__ __forceinline__ void wgmma_ss(float (&d)[128], uint64_t da, uint64_t db) { wgmma_m64n256k16(d, da, db); }
__device__ __forceinline__ void wgmma_ss(int (&d)[128], uint64_t da, uint64_t db) { wgmma_m64n256k32_s8(d, da, db); }
__device__ __forceinline__ void wgmma_ss(int (&d)[56], uint64_t da, uint64_t db) { wgmma_m64n112k32_s8(d, da, db); }
__device__ __forceinline__ void wgmma_ss(int (&d)[88], uint64_t da, uint64_t db) { wgmma_m64n176k32_s8(d, da, db); }
__device__ __forceinline__ void wgmma_ss(int (&d)[112], uint64_t da, uint64_t db) { wgmma_m64n224k32_s8(d, da, db); }
// gw_ring_init sets up the GWS stages' barriers of a Hopper GEMM's ring
// (thread 0, before the block's first barrier): full counts fullArrivals
// (the copy engine's bytes, and for the quantized kinds the scales'
// copies), empty the 8 consumer warps.
template <int GWS, typename Full, typename Empty>
__device__ __forceinline__ void gw_ring_init(Full full, Empty empty, int fullArrivals) {
    for (int s = 0; s < GWS; s++) {
        mbar_init(full(s), fullArrivals);
        mbar_init(empty(s), 8);
    }
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}
// gw_ss_steps is the K loop of a consumer warpgroup c of a Hopper GEMM
// with both operands in shared memory (fp16, int8; GWS stages): step i
// waits for stage i % GWS to land (full), multiplies the stage's 64
// activation rows of c (tileA) by its weight tile (tileW) in four k steps
// of 32 bytes into d, and frees the stage of step i − 1 (empty: lane 0 of
// each warp) once that step's products are done; it returns with every
// product in d.
template <int GWS, typename D, typename Full, typename Empty, typename TileA, typename TileW>
__device__ __forceinline__ void gw_ss_steps(D& d, int nk, int c, int lane, Full full, Empty empty, TileA tileA,
                                            TileW tileW) {
    for (int i = 0; i < nk; i++) {
        int s = i % GWS;
        mbar_wait(full(s), (i / GWS) & 1);
        asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
        uint64_t da = wg_desc(tileA(s) + c * 64 * 128), dw = wg_desc(tileW(s));
#pragma unroll
        for (int kk = 0; kk < 4; kk++) wgmma_ss(d, da + 2 * kk, dw + 2 * kk);  // +32 bytes a k step
        asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");  // step i − 1 is done with its stage
        if (i > 0 && lane == 0) mbar_arrive(empty((i - 1) % GWS));
    }
    asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
}
// wg_pin keeps an accumulator's value where it is at this point (an empty
// asm with the register as operand: NVVM may not move its zeroing past it)
__device__ __forceinline__ void wg_pin(float& x) { asm volatile("" : "+f"(x)::"memory"); }
__device__ __forceinline__ void wg_pin(int& x) { asm volatile("" : "+r"(x)::"memory"); }
// gw_w_bytes is the W tile of a ring stage as the copy engine lands it: 128
// rows of 64 fp16/bf16 values (128-byte swizzle), 4-bit words (32 bytes a
// row) or int8 codes (64 bytes a row, 64-byte swizzle); gw_stage_bytes
// adds the A tile and, for the quantized kinds, the rows' {scale, zero}.
// With AH = 2 a block's tile has two 128-row halves: of activations for
// the register-fragment kinds (gw_a_halves), of weights for fp16 and int8.
template <int WK>
__host__ __device__ constexpr int gw_w_bytes() {
    return WK == GH_Q4 ? 128 * 32 : WK == GH_Q8 ? 128 * 64 : 128 * GW_BK * 2;
}
template <int WK, int AH>
__host__ __device__ constexpr int gw_a_halves() {
    return WK == GH_F16 || WK == GH_S8 ? 1 : AH;
}
template <int WK, int AH = 1>
__host__ __device__ constexpr int gw_stage_bytes() {
    return gw_a_halves<WK, AH>() * 128 * GW_BK * 2 + AH / gw_a_halves<WK, AH>() * gw_w_bytes<WK>() +
           (WK == GH_Q4 || WK == GH_Q8 ? 128 * 8 : 0);
}
// D[64 × 128] += A[64 × 16] · B[128 × 16]ᵀ, A in registers (the layout of
// mma.m16n8k16's A, warp w of the warpgroup holding rows 16w..16w+15), B
// from shared memory.
__device__ __forceinline__ void wgmma_m64n128k16_ra(float (&d)[64], const uint32_t* a, uint64_t db) {
    asm volatile(
        "{\n"
        ".reg .pred p;\n"
        "setp.ne.b32 p, %69, 0;\n"
        "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
        WG_D64 ", "
        "{%64, %65, %66, %67}, %68, p, 1, 1, 0;\n"
        "}\n"
        : WG_ACC("+f")
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(db), "r"(1));
}
__device__ __forceinline__ uint32_t h2_bits(__half2 h) { return *reinterpret_cast<uint32_t*>(&h); }
// gw_frags fills f with this thread's A fragments of one K step (f[4kk +
// r]: register r of k16 step kk) from the W tile at w (and its {scale,
// zero} at sz) for the warp's 16 tile rows from rw: with ra = rw + lane/4
// and t = lane % 4, register 0 holds row ra, k = 16kk + 2t (+1), register
// 1 row ra + 8, registers 2 and 3 the same at k + 8; each value as
// gemm_h_body makes it (bf16 rounded to fp16; 4-bit (u − z)·scale in fp16;
// 8-bit q8_pair's form, NRM's where the launch's flags say: see q8_half).
// KEEP (8-bit): 0 makes the two rows' Q8Half from sz, 1 makes them and
// keeps them in kc, 2 takes kc's (a step of the same groups as kc's step).
template <int WK, bool NRM, int KEEP = 0>
__device__ __forceinline__ void gw_frags(uint32_t (&f)[16], const unsigned char* w, const float2* sz, int rw, int lane,
                                         Q8Half* kc = nullptr) {
    int ra = rw + (lane >> 2), t = lane & 3;
    if constexpr (WK == GH_BF16) {
        // ldmatrix: lanes 0-7 / 8-15 / 16-23 / 24-31 address rows 0-7 / 8-15
        // / 0-7 / 8-15 at 16-byte chunk 2kk / 2kk / 2kk + 1 / 2kk + 1 of the
        // 128-byte swizzled rows (chunk c of row r sits at c ^ (r % 8))
        int r = rw + (lane & 15);
#pragma unroll
        for (int kk = 0; kk < 4; kk++) {
            uint32_t v[4];
            ldmatrix_x4(v, w + r * 128 + (((2 * kk + (lane >> 4)) ^ (r & 7)) << 4));
#pragma unroll
            for (int e = 0; e < 4; e++) f[4 * kk + e] = bf2_to_h2(v[e]);
        }
    } else if constexpr (WK == GH_Q4) {
        // the row's 8 words, k 8c..8c+7 in word c; pair t of words 2kk and
        // 2kk + 1
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int r = ra + 8 * h;
            const uint4* q = reinterpret_cast<const uint4*>(w + r * 32);
            uint4 q0 = q[0], q1 = q[1];
            uint32_t words[8] = {q0.x, q0.y, q0.z, q0.w, q1.x, q1.y, q1.z, q1.w};
            float2 sv = sz[r];
            __half2 hs = __float2half2_rn(sv.x), hz = *reinterpret_cast<__half2*>(&sv.y);
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                f[4 * kk + h] = h2_bits(__hmul2(q4_pair_uz(words[2 * kk], t, hz), hs));
                f[4 * kk + 2 + h] = h2_bits(__hmul2(q4_pair_uz(words[2 * kk + 1], t, hz), hs));
            }
        }
    } else {
        // the row's 64 codes; bytes 16kk + 2t (+1) and 16kk + 8 + 2t (+1),
        // picked into bytes 0 and 2 from the 8 bytes of their half of the
        // 16-byte unit by one byte permute. The copy engine's 64-byte
        // swizzle puts unit kk of row r at kk ^ ((r / 2) % 4), so that the
        // warp's 8 rows read distinct banks (ra and ra + 8 alike).
        uint32_t sel = 2 * t | (2 * t + 1) << 8, sw = (ra >> 1) & 3;
#pragma unroll
        for (int h = 0; h < 2; h++) {
            int r = ra + 8 * h;
            const uint4* q = reinterpret_cast<const uint4*>(w + r * 64);
            Q8Half c;
            if constexpr (KEEP == 2) c = kc[h];
            else c = q8_half<NRM>(sz[r]);
            if constexpr (KEEP == 1) kc[h] = c;
#pragma unroll
            for (int kk = 0; kk < 4; kk++) {
                uint4 v = q[kk ^ sw];
                f[4 * kk + h] = h2_bits(q8_pair<NRM>(__byte_perm(v.x, v.y, sel), c));
                f[4 * kk + 2 + h] = h2_bits(q8_pair<NRM>(__byte_perm(v.z, v.w, sel), c));
            }
        }
    }
}
// gw_unit is the 16-byte unit of four sums a Hopper GEMM's cluster merge
// moves: float4 of fp32 sums, int4 of int32.
template <typename T>
using gw_unit = typename std::conditional<std::is_same<T, float>::value, float4, int4>::type;
// gw_add_units adds to a thread's sums d the 16-byte units another block
// stored into this block's area for it: unit e / 4 at (e / 4 · stride +
// slot) · 16 (gw_merge_splits: 256 slots).
template <int N, typename T>
__device__ __forceinline__ void gw_add_units(T (&d)[N], const unsigned char* area, int stride, int slot) {
    using V = gw_unit<T>;
#pragma unroll
    for (int e = 0; e < N; e += 4) {
        V v = reinterpret_cast<const V*>(area)[(e / 4) * stride + slot];
        d[e] += v.x, d[e + 1] += v.y, d[e + 2] += v.z, d[e + 3] += v.w;
    }
}
// gw_merge_splits merges the sums d (N a thread, thread ct of the 256
// consumers; fp32 or integers) of an fp16 or int8 Hopper GEMM block whose
// launch runs the K splits of a tile as one cluster of ncl blocks along z
// (cluster rank = split; runtime/cuda's splitPlan), in the rounds of a
// tree: in round s (1, 2, 4, …) block r + s stores its sums into the
// shared memory at area (the ring's start, free once the products are
// done) of block r (r a multiple of 2s), which adds them to its own: the
// same order whatever the timing, ((p0 + p1) + (p2 + p3)) + …. The
// consumers of every block meet at a cluster barrier before a round's
// stores (the receivers' areas free; a thread that exited counts as
// arrived) and after them (the sums landed: release, acquire). A thread's
// 16-byte unit e / 4 at (e / 4 · 256 + ct) · 16: a warp's stores and loads
// 512 contiguous bytes. Returns whether the block goes on to the
// epilogue: rank 0, its consumers past a barrier after their loads (the
// epilogue's stage may reuse the area); a sender returns false once its
// sums are sent. gemm_wg_body merges a narrow block's pair with
// gw_scatter instead, and more splits or a wide block's so.
template <int N, typename T>
__device__ __forceinline__ bool gw_merge_splits(T (&d)[N], unsigned char* area, int ncl, int ct) {
    static_assert(N % 4 == 0, "four sums a unit");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    cluster_wait();  // the first arrival: every block of the cluster has set up
    const int rank = (int)blockIdx.z;  // the split: clusters (1, 1, ncl) over a grid of ncl along z
    for (int s = 1; s < ncl; s *= 2) {
        cluster_arrive();
        cluster_wait();  // the receivers' areas are free
        if ((rank & (2 * s - 1)) == s) {
            unsigned to = dsmem_addr(area, rank - s);
#pragma unroll
            for (int e = 0; e < N; e += 4) st_dsmem4(to + ((e / 4) * 256 + ct) * 16, d[e], d[e + 1], d[e + 2], d[e + 3]);
            cluster_arrive();  // the sums landed
            return false;
        }
        cluster_arrive();
        cluster_wait();
        if ((rank & (2 * s - 1)) == 0 && rank + s < ncl) {
            gw_add_units(d, area, 256, ct);
        }
    }
    named_sync(1, 256);
#endif
    return true;
}
// gw_scatter merges the sums d (N a thread, thread ct of the 256
// consumers) of an fp16 or int8 Hopper GEMM block whose launch runs the
// NCL = 2 or 3 K splits of a narrow tile as one cluster
// (gw_merge_splits's tree for more or for a wide block) in one round:
// each block finishes the rows of its warps (warp ct / 32 holds rows
// 16·(ct / 32) on): a pair's block r the 64 of warpgroup r (warps 4r to
// 4r + 3); a three's block 0 rows 0–47, block 1 48–95, block 2 96–127
// (warps 0–2, 3–5, 6–7), so that no block receives or finishes more than
// 48 rows (sixty-eighth session, against 64, 32 and 32: W8A8 prefill at
// 128 tokens +1.6–2.2 % on llama2-7b, within ±0.5 % on llama3-8b).
// Every thread whose rows another block finishes stores its sums into
// that block's shared memory at area (the ring's start, free once the
// products are done), in the slot of its rank among that block's senders
// (nt threads' units a slot: those whose rows the block finishes; a
// thread's 16-byte unit e / 4 at (slot · N / 4 + e / 4) · nt + t, t its
// place among the nt); the finishing threads add the parts in the tree's
// order, p0 + p1 or (p0 + p1) + p2: all blocks send at once, each a part
// of the tile, where the tree sends a whole tile one way a round. The
// consumers of the cluster's blocks meet at a cluster barrier before the
// stores (the areas free; a thread that exited counts as arrived) and
// after them (release, acquire). Sets r0, r1 to the rows this block
// finishes (the tile stage's). Area: 32 KB a pair's block, 48 KB at a
// three's blocks 0 and 1.
template <int NCL, int N, typename T>
__device__ __forceinline__ void gw_scatter(T (&d)[N], unsigned char* area, int ct, int& r0, int& r1) {
    static_assert(N % 4 == 0, "four sums a unit");
    static_assert(NCL == 2 || NCL == 3, "a pair or a three");
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    using V = gw_unit<T>;
    // block b finishes warps first(b) .. first(b) + warps(b) − 1
    auto first = [](int b) { return NCL == 2 ? 4 * b : 3 * b; };
    auto warps = [](int b) { return NCL == 2 ? 4 : b == 2 ? 2 : 3; };
    cluster_wait();  // the first arrival: every block has set up
    const int rank = (int)blockIdx.z, q = ct >> 5;
    const int to = NCL == 2 ? q >> 2 : q < 3 ? 0 : q < 6 ? 1 : 2;  // the block that finishes this thread's rows
    cluster_arrive();
    cluster_wait();  // the areas are free
    if (to != rank) {
        const int nt = 32 * warps(to), t = ct - 32 * first(to);
        const int slot = rank < to ? rank : rank - 1;  // among to's senders, by rank
        unsigned a = dsmem_addr(area, to);
#pragma unroll
        for (int e = 0; e < N; e += 4)
            st_dsmem4(a + ((slot * (N / 4) + e / 4) * nt + t) * 16, d[e], d[e + 1], d[e + 2], d[e + 3]);
    }
    cluster_arrive();
    cluster_wait();  // the parts landed
    if (to == rank) {
        const int nt = 32 * warps(rank), t = ct - 32 * first(rank);
        const V* in = reinterpret_cast<const V*>(area);
#pragma unroll
        for (int e = 0; e < N; e += 4) {
            const V u0 = in[(e / 4) * nt + t];  // the senders, lower rank first
            if constexpr (NCL == 2) {
                d[e] += u0.x, d[e + 1] += u0.y, d[e + 2] += u0.z, d[e + 3] += u0.w;
            } else {
                const V u1 = in[(N / 4 + e / 4) * nt + t];
                const V o = V{d[e], d[e + 1], d[e + 2], d[e + 3]};
                const V p0 = rank == 0 ? o : u0, p1 = rank == 1 ? o : rank == 0 ? u0 : u1, p2 = rank == 2 ? o : u1;
                d[e] = (p0.x + p1.x) + p2.x, d[e + 1] = (p0.y + p1.y) + p2.y;
                d[e + 2] = (p0.z + p1.z) + p2.z, d[e + 3] = (p0.w + p1.w) + p2.w;
            }
        }
    }
    named_sync(1, 256);
    r0 = 16 * first(rank), r1 = 16 * (first(rank) + warps(rank));
#endif
}
// gw_put puts a Hopper GEMM tile's sums (at, raw as out_tile_staged takes
// them) through the stage t by the writer of gemm_wg_body's kind, the one
// choice for a whole tile and for each half of a wide block's: a pair's
// SwiGLU (glu_tile, epi the GluEpi), W8A8's finish epi (integer sums
// through the stage as ints), the peer mirror (epi a PeerMirror), the
// fused RoPE and KV store (epi a QKVSink) or the plain store into C by out.
template <int WK, bool PAIR, typename Epi, typename At, typename Raw>
__device__ __forceinline__ void gw_put(float* C, int M, int N, int out, At at, Raw raw, const Epi& epi,
                                       TileStage<float> t) {
    const TileStage<int> ti{reinterpret_cast<int*>(t.s), t.m0, t.n0, t.bar, t.nthr, t.tid, t.r0, t.r1};
    if constexpr (PAIR && WK == GH_S8)
        glu_tile<32, 2>(C, M, N, at, raw, epi, ti);
    else if constexpr (PAIR)
        glu_tile<32, 2>(C, M, N, at, raw, epi, t);
    else if constexpr (WK == GH_S8)
        epi(at, raw, ti);
    else if constexpr (std::is_same<Epi, PeerMirror>::value || std::is_same<Epi, QKVSink>::value)
        out_tile_staged<32, 2, float>(C, M, N, out, at, raw, AsIs{}, t, epi);
    else
        out_tile_staged<32, 2, float>(C, M, N, out, at, raw, AsIs{}, t);
}
// GH_S8: A and W int8 tiles of 128 rows of 128 codes a K step, the
// integer sums handed to epi(at, raw, stage) as out_tile_staged takes them.
// PAIR: mapW is a 3-D map over two weights of N rows as planes, and a
// block's W tile is rows n0..n0 + 63 of each (n0 = 64·blockIdx.y), one
// copy a K step (fp16 and int8 with AH = 2: rows n0..n0 + 127 of each,
// n0 = 128·blockIdx.y, in two copies of 64 rows of each), with the
// {scale, zero} of plane 0 from sz and of plane 1 from sz2; epi is then the GluEpi of glu_tile (gemm_wg_*_glu). A float
// GEMM's epi may be a PeerMirror (gemm_wg_*_tp), which gets the tile's
// values too.
// The block's weight tile is ny (blockIdx.y where ny < 0).
// SPG (8-bit): the K steps a group spans where it is known: 2 (g128), 0
// (one group along all of K: per channel; the K split's kt0 even where
// 2), 1 otherwise; a thread keeps its rows' Q8Half across a group's steps.
// AH: the block tile's 128-row halves; with 2 a register-fragment kind's
// block computes 256 activation rows by its weight rows, each fragment
// serving both halves (two accumulator sets a consumer), and an fp16 or
// int8 block 128 activation rows by 256 weight rows, one wgmma m64n256 a
// k step (A read once for both weight halves).
template <int WK, bool PAIR = false, bool NRM = false, int SPG = 1, int AH = 1, typename Epi>
__device__ __forceinline__ void gemm_wg_body(float* __restrict__ C, const TmaMap* mapA, const TmaMap* mapW,
                                             const float2* __restrict__ sz, const float2* __restrict__ sz2, int M,
                                             int N, int gs, int G, int kt0, int kt1, int out, Epi epi, int ny = -1) {
    constexpr int SB = gw_stage_bytes<WK, AH>(), GWS = gw_stages<WK, AH>();
    static_assert(AH == 1 || !((WK == GH_F16 || WK == GH_S8) && std::is_same<Epi, PeerMirror>::value),
                  "two halves: not the fp16 or int8 peer forms");
    constexpr int AHA = gw_a_halves<WK, AH>(), AHW = AH / AHA;  // activation, weight halves
    constexpr bool MOVE_REGS = (WK != GH_F16 && WK != GH_S8) || AH == 2;  // setmaxnreg
    constexpr int BKE = WK == GH_S8 ? 128 : GW_BK;  // elements of a K step
    constexpr bool QUANT = WK == GH_Q4 || WK == GH_Q8;
    extern __shared__ __align__(1024) unsigned char gw_raw[];
    uint32_t raw = smem_u32(gw_raw), base = (raw + 1023) & ~1023u;  // the swizzle repeats every 1024 bytes
    uint32_t bars = base + GWS * SB;
    auto full = [&](int s) { return bars + 8 * s; };
    auto empty = [&](int s) { return bars + 8 * (GWS + s); };
    auto tileA = [&](int s) { return base + s * SB; };
    auto tileW = [&](int s) { return base + s * SB + AHA * 128 * GW_BK * 2; };
    auto tileS = [&](int s) { return tileW(s) + gw_w_bytes<WK>(); };  // GH_Q4, GH_Q8: {scale, zero}
    auto at = [&](uint32_t a) { return gw_raw + (a - raw); };      // generic address of shared address a
    // blockIdx.x walks the activation tiles: the blocks running at once
    // share weight tiles, so each weight tile leaves device memory once
    int tid = threadIdx.x, wg = tid >> 7, m0 = blockIdx.x * 128 * AHA, nk = kt1 - kt0;
    constexpr int NH = PAIR ? 64 : 128;  // outputs of a weight half
    int n0 = (ny < 0 ? (int)blockIdx.y : ny) * NH * AHW;
    if (tid == 0) gw_ring_init<GWS>(full, empty, QUANT ? 1 + 128 : 1);  // the scales' 128 copies too
    __syncthreads();
    // a K split launched as one cluster (gw_scatter, gw_merge_splits): every thread's first arrival, which the merge's
    // first wait takes as all started
    // (the plain fp16 and int8 GEMMs, which can; the dispatcher launches
    // so the int8 ones only, runtime/cuda's mergeKernels, and tests the
    // fp16 ones; not the pairs and peer forms, which do not split K)
    constexpr bool MERGES = (WK == GH_F16 || WK == GH_S8) && !PAIR && !std::is_same<Epi, PeerMirror>::value;
    const int ncl = MERGES ? (int)cluster_blocks() : 1;
    if (ncl > 1) cluster_arrive();
    if (wg == 0) {
        // the kinds whose consumers make fragments in registers give the
        // producer's registers to them (setmaxnreg: 40 here, 232 there;
        // 168 a thread at launch)
        if constexpr (MOVE_REGS) asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory");
        // one thread loads the A and W tiles of every K step; for the
        // quantized kinds every thread copies its weight row's {scale, zero}
        // of the step, its arrival on "full" due when the copy lands
        if (!QUANT && tid != 0) return;
        const uint64_t wpol = l2_evict_first();  // the weight tiles' (tma_load_2d_once)
        for (int i = 0; i < nk; i++) {
            int s = i % GWS;
            if (i >= GWS) mbar_wait(empty(s), (i / GWS - 1) & 1);
            if (tid == 0) {
                mbar_expect_tx(full(s), AHA * 128 * GW_BK * 2 + AHW * gw_w_bytes<WK>());
#pragma unroll
                for (int h = 0; h < AHA; h++)  // rows past M: zeros, their bytes counted
                    tma_load_2d(tileA(s) + h * 128 * GW_BK * 2, mapA, (kt0 + i) * BKE, m0 + h * 128, full(s));
                if constexpr (PAIR) {
#pragma unroll
                    for (int h = 0; h < AHW; h++)  // fp16, int8 _w: two boxes of 64 rows of each weight
                        tma_load_3d_once(tileW(s) + h * gw_w_bytes<WK>(), mapW,
                                         (kt0 + i) * BKE / (WK == GH_Q4 ? 8 : 1), n0 + h * 64, 0, full(s), wpol);
                } else {
#pragma unroll
                    for (int h = 0; h < AHW; h++)  // rows past N alike
                        tma_load_2d_once(tileW(s) + h * gw_w_bytes<WK>(), mapW,
                                         (kt0 + i) * BKE / (WK == GH_Q4 ? 8 : 1), n0 + h * 128, full(s), wpol);
                }
            }
            if (QUANT) {
                int row = n0 + (PAIR ? tid & 63 : tid);  // this thread's weight row (of plane tid / 64)
                bool v = row < N;
                const float2* src = (PAIR && tid >= 64 ? sz2 : sz) + (size_t)row * G + (kt0 + i) * GW_BK / gs;
                cp_async8_zfill(at(tileS(s)) + 8 * tid, v ? (const void*)src : (const void*)sz, v);
                asm volatile("cp.async.mbarrier.arrive.noinc.shared::cta.b64 [%0];" ::"r"(full(s)) : "memory");
            }
        }
        return;
    }
    int c = wg - 1, warp = (tid >> 5) & 3, lane = tid & 31;
    // the stages hold the whole result tile for the epilogue once the
    // products are done (consumers meet at barrier 1)
    static_assert(TS_ROWS * TS_LD * 4 <= GWS * SB, "the result tile fits in the stages");
    TileStage<float> st{reinterpret_cast<float*>(at(base)), m0, n0, 1, 256, tid - 128};
    if constexpr (WK == GH_F16 || WK == GH_S8) {
        // D = A · Wᵀ: 64 activation rows of warpgroup c by the 128 (AH = 2:
        // 256) weight rows, both operands from shared memory
        typename std::conditional<WK == GH_S8, int, float>::type d[64 * AH];
#pragma unroll
        for (int e = 0; e < 64 * AH; e++) d[e] = 0;
        if constexpr (AH == 2) {
            asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");  // the producer's 128 a thread
#pragma unroll
            for (int e = 0; e < 64 * AH; e++) wg_pin(d[e]);  // zeros before the first fence
        }
        gw_ss_steps<GWS>(d, nk, c, lane, full, empty, tileA, tileW);
        static_assert(64 * AH * 4 * 256 <= GWS * SB, "the merge's area fits in the ring");
        if constexpr (MERGES && AH == 1) {  // each block finishes its part of the tile's rows
            if (ncl == 2) gw_scatter<2>(d, at(base), tid - 128, st.r0, st.r1);
            if (ncl == 3) gw_scatter<3>(d, at(base), tid - 128, st.r0, st.r1);
        }
        if constexpr (MERGES)
            if (ncl > 3 || (AH == 2 && ncl >= 2))
                if (!gw_merge_splits(d, at(base), ncl, tid - 128)) return;  // a sender: no epilogue
        // accumulator e of n8 chunk j: activation row 16·warp + lane/4 (+8
        // for e ≥ 2), weight row 8j + 2·(lane % 4) (+1 for odd e)
        // (unit u = 2j + h)
        int r = m0 + c * 64 + warp * 16 + (lane >> 2);
        auto at = [&](int u, int& m, int& n) {
            m = r + 8 * (u & 1);
            n = n0 + (u >> 1) * 8 + 2 * (lane & 3);
        };
        auto raw = [&](int u, int e) { return d[4 * (u >> 1) + 2 * (u & 1) + e]; };
        auto put = [&](auto at_t, auto raw_t, TileStage<float> t) { gw_put<WK, PAIR>(C, M, N, out, at_t, raw_t, epi, t); };
        if constexpr (AH == 2) {
            // the two 128-column halves one after the other through the
            // stage: half h's outputs NH·h on (a pair's half: 64 columns of
            // each weight, the narrow pair tile of the outputs n0 + 64h on)
            auto half = [&](auto hc) {
                constexpr int h = decltype(hc)::value;
                auto at_h = [&](int u, int& m, int& n) {
                    at(u + 32 * h, m, n);
                    n -= (128 - NH) * h;
                };
                auto raw_h = [&](int u, int e) { return raw(u + 32 * h, e); };
                // the whole tile's rows (r0, r1 left out): only narrow blocks scatter
                put(at_h, raw_h, TileStage<float>{st.s, st.m0, st.n0 + NH * h, st.bar, st.nthr, st.tid});
            };
            half(std::integral_constant<int, 0>{});
            if (n0 + NH < N) half(std::integral_constant<int, 1>{});
        } else
            put(at, raw, st);
    } else {
        // Dᵀ = W · Aᵀ: the 64 weight rows of warpgroup c, widened or
        // dequantized from shared memory into registers, by the 128
        // activation rows from shared memory. The fragments of step i + 1
        // are made while step i's wgmma runs (two register sets).
        int rw = c * 64 + warp * 16, t = lane & 3;
        float d[AH][64];
#pragma unroll
        for (int h = 0; h < AH; h++)
#pragma unroll
            for (int e = 0; e < 64; e++) d[h][e] = 0.f;
        if constexpr (AH == 2)  // the zeros before the first wgmma.fence (NVVM sinks them past it: wgmma serialized)
#pragma unroll
            for (int h = 0; h < AH; h++)
#pragma unroll
                for (int e = 0; e < 64; e++) wg_pin(d[h][e]);
        uint32_t f[2][16];
        Q8Half kc[2];  // SPG ≠ 1: the rows' Q8Half of the current groups
        // keep: gw_frags' KEEP for step 0, an odd step or an even one
        using First = std::integral_constant<int, SPG == 1 ? 0 : 1>;
        using Odd = std::integral_constant<int, SPG == 1 ? 0 : 2>;
        using Even = std::integral_constant<int, SPG == 1 ? 0 : SPG == 2 ? 1 : 2>;
        auto frags = [&](int i, uint32_t (&fi)[16], auto keep) {
            int s = i % GWS;
            mbar_wait(full(s), (i / GWS) & 1);
            gw_frags<WK, NRM, decltype(keep)::value>(fi, at(tileW(s)), reinterpret_cast<const float2*>(at(tileS(s))),
                                                     rw, lane, kc);
        };
        auto step = [&](int i, const uint32_t (&fi)[16]) {
            asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
            uint64_t da = wg_desc(tileA(i % GWS));
#pragma unroll
            for (int kk = 0; kk < GW_BK / 16; kk++)
#pragma unroll
                for (int h = 0; h < AH; h++)  // half h's rows 16 KB on
                    wgmma_m64n128k16_ra(d[h], &fi[4 * kk], da + 2 * kk + h * (128 * GW_BK * 2 >> 4));
            asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
        };
        auto release = [&](int i) {  // step i's wgmma is complete: its stage is free
            if (lane == 0) mbar_arrive(empty(i % GWS));
        };
        asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");  // the producer's 128 a thread
        // step i is queued behind step i − 1, then step i − 1 waited for
        // (its register set is step i + 1's)
        if (nk > 0) {
            frags(0, f[0], First{});
            step(0, f[0]);
        }
        int i = 1;
        for (; i + 1 < nk; i += 2) {
            frags(i, f[1], Odd{});
            step(i, f[1]);
            asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
            release(i - 1);
            frags(i + 1, f[0], Even{});
            step(i + 1, f[0]);
            asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
            release(i);
        }
        if (i < nk) {
            frags(i, f[1], Odd{});
            step(i, f[1]);
            asm volatile("wgmma.wait_group.sync.aligned 1;" ::: "memory");
            release(i - 1);
        }
        asm volatile("wgmma.wait_group.sync.aligned 0;" ::: "memory");
        if (nk > 0) release(nk - 1);
        // accumulator e of n8 chunk j of half h: weight row 16·warp +
        // lane/4 (+8 for e ≥ 2), activation row 128h + 8j + 2·(lane % 4)
        // (+1 for odd e) (unit u = 4j + e); the halves one after the other
        // through the stage
        auto half = [&](auto hc) {
            constexpr int h = decltype(hc)::value;
            int mh = m0 + h * 128;
            auto unit = [&](int u, int& m, int& n) {
                m = mh + (u >> 2) * 8 + 2 * t + (u & 1);
                n = n0 + rw + (lane >> 2) + 8 * ((u >> 1) & 1);
            };
            auto raw = [&](int u, int) { return d[h][u]; };
            TileStage<float> sh{st.s, mh, st.n0, st.bar, st.nthr, st.tid};
            if constexpr (PAIR)
                glu_tile<64, 1>(C, M, N, unit, raw, epi, sh);
            else if constexpr (std::is_same<Epi, PeerMirror>::value || std::is_same<Epi, QKVSink>::value)
                out_tile_staged<64, 1, float>(C, M, N, out, unit, raw, AsIs{}, sh, epi);
            else
                out_tile_staged<64, 1, float>(C, M, N, out, unit, raw, AsIs{}, sh);
        };
        half(std::integral_constant<int, 0>{});
        if constexpr (AH == 2)
            if (m0 + 128 < M) half(std::integral_constant<int, 1>{});
    }
}
// GW_Q8_NORMAL, a bit of the Hopper GEMM entries' flags: every scale of
// the 8-bit weight (of each weight the launch reads) is 0 or in fp16's
// normal range (runtime/cuda's Linear.q8Normal), so the fragments may take
// the scales as they are (q8_half's NRM). Other kinds ignore it.
#define GW_Q8_NORMAL 1
// gw_q8_spg is the SPG gemm_wg_run takes for an 8-bit weight of group
// size gs and G groups where flags hold GW_Q8_NORMAL (0: one group along
// K, 2: g128, 1: other groups), −1 without it (no NRM, no kept groups).
__device__ __forceinline__ int gw_q8_spg(int flags, int gs, int G) {
    return !(flags & GW_Q8_NORMAL) ? -1 : G == 1 ? 0 : gs == 2 * GW_BK ? 2 : 1;
}
// Q8_SPLIT_ALIGN: the K split's share a multiple of two steps where
// gemm_wg_run takes SPG 2 (an even kt0: a g128 group's two steps keep one
// Q8Half), else one
#define Q8_SPLIT_ALIGN(WK, flags, gs, G) ((WK) == GH_Q8 && gw_q8_spg(flags, gs, G) == 2 ? 2 : 1)
// gemm_wg_run is gemm_wg_body with NRM and SPG from flags (8-bit kinds
// only: gw_q8_spg).
template <int WK, bool PAIR = false, int AH = 1, typename Epi>
__device__ __forceinline__ void gemm_wg_run(int flags, float* C, const TmaMap* mapA, const TmaMap* mapW,
                                            const float2* sz, const float2* sz2, int M, int N, int gs, int G, int kt0,
                                            int kt1, int out, Epi epi, int ny = -1) {
    if constexpr (WK == GH_Q8) {
        switch (gw_q8_spg(flags, gs, G)) {
        case 0:
            gemm_wg_body<WK, PAIR, true, 0, AH>(C, mapA, mapW, sz, sz2, M, N, gs, G, kt0, kt1, out, epi, ny);
            return;
        case 2:
            gemm_wg_body<WK, PAIR, true, 2, AH>(C, mapA, mapW, sz, sz2, M, N, gs, G, kt0, kt1, out, epi, ny);
            return;
        case 1:
            gemm_wg_body<WK, PAIR, true, 1, AH>(C, mapA, mapW, sz, sz2, M, N, gs, G, kt0, kt1, out, epi, ny);
            return;
        }
    }
    gemm_wg_body<WK, PAIR, false, 1, AH>(C, mapA, mapW, sz, sz2, M, N, gs, G, kt0, kt1, out, epi, ny);
}
// name(C, mapA, mapW, sz, M, N, K, gs, G, flags, out): mapA over the fp16
// activations [M, K], mapW over the weight (fp16 or bf16 [N, K]; GH_Q4: the
// words [N, K/8]; GH_Q8: the codes [N, K]), sz and the group size gs (a
// multiple of GW_BK) and count G of the quantized kinds, flags
// (GW_Q8_NORMAL); dynamic shared memory gw_stage_bytes · gw_stages + the
// barriers + 1024. The _w forms (AH = 2) take 256 activation rows a block
// (gemm_wg_f16_w: 256 weight rows). K split along z: split z writes its
// partial product to C + z·M·N for sum_splits (as SPLIT_OUT), except where
// the splits run as one cluster, which applies out to C itself: a narrow
// pair's blocks each to their half of the tile's rows, a narrow three's
// each to its part (gw_scatter), else the tree's
// rank 0 (gw_merge_splits).
#define GEMM_WG_ENTRY(name, WK, AH)                                                                              \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                         \
        name(float* C, const __grid_constant__ TmaMap mapA, const __grid_constant__ TmaMap mapW, const float2* sz, \
             int M, int N, int K, int gs, int G, int flags, int out) {                                           \
        PDL_ENTRY();                                                                                             \
        KSplit ks = k_split((K + GW_BK - 1) / GW_BK, Q8_SPLIT_ALIGN(WK, flags, gs, G));                           \
        const bool partial = split_to_memory();                                                                  \
        gemm_wg_run<WK, false, AH>(flags, partial ? C + (size_t)blockIdx.z * M * N : C, &mapA, &mapW, sz, nullptr, \
                                   M, N, gs, G, ks.kt0, ks.kt1, partial ? OUT_STORE : out, 0);                   \
    }
GEMM_WG_ENTRY(gemm_wg_f16, GH_F16, 1)
GEMM_WG_ENTRY(gemm_wg_bf16, GH_BF16, 1)
GEMM_WG_ENTRY(gemm_wg_q4, GH_Q4, 1)
GEMM_WG_ENTRY(gemm_wg_q8, GH_Q8, 1)
GEMM_WG_ENTRY(gemm_wg_f16_w, GH_F16, 2)
GEMM_WG_ENTRY(gemm_wg_bf16_w, GH_BF16, 2)
GEMM_WG_ENTRY(gemm_wg_q4_w, GH_Q4, 2)
GEMM_WG_ENTRY(gemm_wg_q8_w, GH_Q8, 2)

// name_tp(C, mapA, mapW, sz, M, N, K, gs, G, flags, out, area, rank, world,
// stage_off, cap): name's product, K unsplit, that also sends its values to
// the all-reduce over peer memory that follows it (runtime/cuda/peer.go's
// MatMulAllReduce): into stage[e & 1][rank] of lane 1 in every peer's area
// (allreduce_peer's layout; e the call that lane makes next, one more than
// its block 0's counter, which no block advances before this grid is
// done), so that allreduce_peer with sent set only exchanges flags and sums.
// With scatter set (a sequence-parallel exchange, exchange_peer) C and out
// are ignored: each tile is stored only into stage[e & 1][rank] of lane 1
// in the area of the rank that owns its rows (sp_owner), this rank's own
// included, and exchange_peer adds the residual.
#define GEMM_WG_TP_ENTRY(name, WK)                                                                               \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                         \
        name(float* C, const __grid_constant__ TmaMap mapA, const __grid_constant__ TmaMap mapW, const float2* sz, \
             int M, int N, int K, int gs, int G, int flags, int out, const char* area, int rank, int world,       \
             long long stage_off, long long cap, int scatter) {                                                  \
        PDL_ENTRY();                                                                                             \
        PeerMirror mir = peer_mirror(area, rank, world, stage_off, cap);                                         \
        if (scatter) {                                                                                           \
            int o = sp_owner(blockIdx.x, (M + 127) / 128, world);                                                \
            C = ar_stage1(reinterpret_cast<const unsigned long long*>(area)[o], stage_off, cap,                  \
                          ar_next_call1(area), world, rank);                                                     \
            out = OUT_STORE, mir.n = 0;                                                                          \
        }                                                                                                        \
        gemm_wg_run<WK>(flags, C, &mapA, &mapW, sz, nullptr, M, N, gs, G, 0, (K + GW_BK - 1) / GW_BK, out, mir); \
    }
GEMM_WG_TP_ENTRY(gemm_wg_f16_tp, GH_F16)
GEMM_WG_TP_ENTRY(gemm_wg_bf16_tp, GH_BF16)
GEMM_WG_TP_ENTRY(gemm_wg_q4_tp, GH_Q4)
GEMM_WG_TP_ENTRY(gemm_wg_q8_tp, GH_Q8)
// seg_of is the weight (0, 1, 2) whose 128-row tiles grid.y tile ny of a
// segs launch falls in (weights 0 and 1 of N0 and N1 rows first), ny made
// that weight's own tile index.
__device__ __forceinline__ int seg_of(int& ny, int N0, int N1) {
    const int t0 = (N0 + 127) / 128, t1 = (N1 + 127) / 128;
    if (ny >= t0 + t1) {
        ny -= t0 + t1;
        return 2;
    }
    if (ny >= t0) {
        ny -= t0;
        return 1;
    }
    return 0;
}
// name_segs(C0, C1, C2, mapA, mapW0, mapW1, mapW2, sz0, sz1, sz2, M, N0, N1,
// N2, K, gs, G, flags, out): WK's GEMM of one fp16 input [M, K] (mapA) with up to
// three weights of WK's kind, group size and count (q, k and v) in one
// launch: grid.y walks the weight tiles of weight 0, then 1, then 2 (N2 = 0:
// two weights), each tile written to its weight's output Ci [M, Ni] by
// out. No K split.
#define GEMM_WG_SEGS_ENTRY(name, WK)                                                                             \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                         \
        name(float* C0, float* C1, float* C2, const __grid_constant__ TmaMap mapA,                               \
             const __grid_constant__ TmaMap mapW0, const __grid_constant__ TmaMap mapW1,                         \
             const __grid_constant__ TmaMap mapW2, const float2* sz0, const float2* sz1, const float2* sz2, int M, \
             int N0, int N1, int N2, int K, int gs, int G, int flags, int out) {                                 \
        PDL_ENTRY();                                                                                             \
        int ny = blockIdx.y;                                                                                     \
        const int w = seg_of(ny, N0, N1);                                                                        \
        const TmaMap* mapW = w == 0 ? &mapW0 : w == 1 ? &mapW1 : &mapW2;                                         \
        float* C = w == 0 ? C0 : w == 1 ? C1 : C2;                                                               \
        const float2* sz = w == 0 ? sz0 : w == 1 ? sz1 : sz2;                                                    \
        const int N = w == 0 ? N0 : w == 1 ? N1 : N2;                                                            \
        gemm_wg_run<WK>(flags, C, &mapA, mapW, sz, nullptr, M, N, gs, G, 0, (K + GW_BK - 1) / GW_BK, out, 0, ny); \
    }
GEMM_WG_SEGS_ENTRY(gemm_wg_f16_segs, GH_F16)
GEMM_WG_SEGS_ENTRY(gemm_wg_bf16_segs, GH_BF16)
GEMM_WG_SEGS_ENTRY(gemm_wg_q4_segs, GH_Q4)
GEMM_WG_SEGS_ENTRY(gemm_wg_q8_segs, GH_Q8)
// name_segs_kv(C0, mapA, mapW0, mapW1, mapW2, sz0, sz1, sz2, M, N0, N1, K,
// gs, G, flags, kc, vc, tab, pos0, hd, layout): name_segs of q, k and v
// (weights 0, 1, 2; N2 = N1) stored as OUT_STORE with RoPE and the KV
// store fused (QKVSink, role = the weight): q rotated into C0 [M, N0], k
// rotated and v into the fp16 cache rows kc, vc [maxSeq, N1] from pos0.
#define GEMM_WG_SEGS_KV_ENTRY(name, WK)                                                                          \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                         \
        name(float* C0, const __grid_constant__ TmaMap mapA, const __grid_constant__ TmaMap mapW0,               \
             const __grid_constant__ TmaMap mapW1, const __grid_constant__ TmaMap mapW2, const float2* sz0,      \
             const float2* sz1, const float2* sz2, int M, int N0, int N1, int K, int gs, int G, int flags,       \
             __half* kc, __half* vc, const float2* __restrict__ tab, int pos0, int hd, int layout) {             \
        PDL_ENTRY();                                                                                             \
        int ny = blockIdx.y;                                                                                     \
        const int w = seg_of(ny, N0, N1);                                                                        \
        const TmaMap* mapW = w == 0 ? &mapW0 : w == 1 ? &mapW1 : &mapW2;                                         \
        const float2* sz = w == 0 ? sz0 : w == 1 ? sz1 : sz2;                                                    \
        const QKVSink kv{kc, vc, tab, pos0, hd, layout, w};                                                      \
        gemm_wg_run<WK>(flags, C0, &mapA, mapW, sz, nullptr, M, w == 0 ? N0 : N1, gs, G, 0,                      \
                        (K + GW_BK - 1) / GW_BK, OUT_STORE, kv, ny);                                             \
    }
GEMM_WG_SEGS_KV_ENTRY(gemm_wg_f16_segs_kv, GH_F16)
GEMM_WG_SEGS_KV_ENTRY(gemm_wg_q4_segs_kv, GH_Q4)
// name_glu(C, Ch, mapA, mapGU, sz, sz2, M, N, K, gs, G, flags, upFirst): the gate
// and up products of one fp16 input [M, K] (mapA) and their SwiGLU
// silu(gate)·up into C [M, N] (or rounded to fp16 into Ch [M, N] where Ch
// is set) in one launch, with no gate products in memory: WK's GEMM with
// a block's W tile 64 rows of each weight (gemm_wg_body's PAIR: mapGU
// covers both as the planes of one tensor, plane 0 the one at the lower
// address, the up weight where upFirst; sz and sz2 the planes' {scale,
// zero}), its result tile 128 rows × 64 outputs (glu_tile; the _w forms:
// two such tiles, 256 rows, or for fp16 128 rows × 128 outputs, 128 rows
// of each weight). No K split.
#define GEMM_WG_GLU_ENTRY(name, WK, AH)                                                                          \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                         \
        name(float* C, __half* Ch, const __grid_constant__ TmaMap mapA, const __grid_constant__ TmaMap mapGU,   \
             const float2* sz, const float2* sz2, int M, int N, int K, int gs, int G, int flags, int upFirst) {  \
        PDL_ENTRY();                                                                                             \
        gemm_wg_run<WK, true, AH>(flags, C, &mapA, &mapGU, sz, sz2, M, N, gs, G, 0, (K + GW_BK - 1) / GW_BK,     \
                                  OUT_STORE, GluEpi<AsIs>{AsIs{}, AsIs{}, upFirst != 0, QOut{}, Ch});            \
    }
GEMM_WG_GLU_ENTRY(gemm_wg_f16_glu, GH_F16, 1)
GEMM_WG_GLU_ENTRY(gemm_wg_bf16_glu, GH_BF16, 1)
GEMM_WG_GLU_ENTRY(gemm_wg_q4_glu, GH_Q4, 1)
GEMM_WG_GLU_ENTRY(gemm_wg_q8_glu, GH_Q8, 1)
GEMM_WG_GLU_ENTRY(gemm_wg_f16_glu_w, GH_F16, 2)
GEMM_WG_GLU_ENTRY(gemm_wg_bf16_glu_w, GH_BF16, 2)
GEMM_WG_GLU_ENTRY(gemm_wg_q4_glu_w, GH_Q4, 2)
GEMM_WG_GLU_ENTRY(gemm_wg_q8_glu_w, GH_Q8, 2)
#endif

// The fused GEMMs split K over grid.z where the tiles alone would leave the
// device idle (few activation rows: 5 to 127 in a prefill): split z takes
// an equal share of the BK steps and writes its partial product to
// C + z·M·N, which sum_splits adds up in order.
#define GEMM_ENTRY(name, WT)                                                                                     \
    extern "C" __global__ void __launch_bounds__(256) name(float* C, const float* A, const void* W,              \
                                                           const float2* sz, const int* gidx, int M, int N,      \
                                                           int K, int gs, int G, int out) {                      \
        PDL_ENTRY();                                                                                             \
        WArgs wa{W, sz, gidx, gs, G};                                                                            \
        KSplit ks = k_split(K / BK);                                                                             \
        gemm_body<WT>(C + (size_t)blockIdx.z * M * N, A, wa, M, N, K, ks.kt0, ks.kt1, SPLIT_OUT);               \
    }
GEMM_ENTRY(gemm_f32, WF32)
GEMM_ENTRY(gemm_q8, WQ8)
GEMM_ENTRY(gemm_q4, WQ4)

// SUM_BATCH: the splits whose float4 sum_splits loads at once.
#define SUM_BATCH 8
// sum_splits puts Σ_z part[z·n + i] over the S splits, in order, into C[i]
// by out. With n a multiple of 4 and C and part 16-byte aligned (runtime/cuda's
// launchGEMM then launches n / 4 threads), a thread takes four values at
// once, issuing the loads of up to SUM_BATCH splits and C's before any add:
// this kernel is latency-bound (two of them a layer in a prefill of 128
// tokens, kernels/NOTES.md, sixty-second session). The sums stay in order,
// from 0, so the values are the scalar loop's.
extern "C" __global__ void sum_splits(float* __restrict__ C, const float* __restrict__ part, int S, long long n,
                                      int out) {
    PDL_ENTRY();
    const long long it = blockIdx.x * (long long)blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    if ((n & 3) == 0 && (((uintptr_t)C | (uintptr_t)part) & 15) == 0) {
        const float4* p4 = reinterpret_cast<const float4*>(part);
        float4* C4 = reinterpret_cast<float4*>(C);
        const long long n4 = n / 4;
        for (long long i = it; i < n4; i += stride) {
            float4 c = out != OUT_STORE ? C4[i] : make_float4(0.f, 0.f, 0.f, 0.f);
            float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
            for (int z0 = 0; z0 < S; z0 += SUM_BATCH) {
                float4 pz[SUM_BATCH];
#pragma unroll
                for (int e = 0; e < SUM_BATCH; e++)
                    if (z0 + e < S) pz[e] = p4[(z0 + e) * n4 + i];
#pragma unroll
                for (int e = 0; e < SUM_BATCH; e++)
                    if (z0 + e < S) v = make_float4(v.x + pz[e].x, v.y + pz[e].y, v.z + pz[e].z, v.w + pz[e].w);
            }
            C4[i] = make_float4(out_val(&c.x, v.x, out), out_val(&c.y, v.y, out), out_val(&c.z, v.z, out),
                                out_val(&c.w, v.w, out));
        }
        return;
    }
    for (long long i = it; i < n; i += stride) {
        float v = 0.f;
        for (int z = 0; z < S; z++) v += part[z * n + i];
        C[i] = out_val(C + i, v, out);
    }
}

// ---------------------------------------------------------------------------
// W8A8 (msmodelslim static): quantize activations, integer dot, dequantize.
// quant_act quantizes x [n] to xq by quant_static, four values a load.
extern "C" __global__ void quant_act(int8_t* __restrict__ xq, const float* __restrict__ x, long long n,
                                     float scale, float offset) {
    PDL_ENTRY();
    long long it = blockIdx.x * (long long)blockDim.x + threadIdx.x, stride = (long long)gridDim.x * blockDim.x;
    for (long long i = it; i < n / 4; i += stride) {
        float4 v = reinterpret_cast<const float4*>(x)[i];
        reinterpret_cast<char4*>(xq)[i] =
            make_char4(quant_static(v.x, scale, offset), quant_static(v.y, scale, offset),
                       quant_static(v.z, scale, offset), quant_static(v.w, scale, offset));
    }
    for (long long i = n / 4 * 4 + it; i < n; i += stride) xq[i] = quant_static(x[i], scale, offset);
}

// Per-token dynamic W8A8 (msmodelslim W8A8_DYNAMIC): grid M, block 256.
// Row m quantized by quant_token, tok[m] = its scale s = max|x|/127.
extern "C" __global__ void __launch_bounds__(256) quant_act_token(int8_t* __restrict__ xq, float* __restrict__ tok,
                                                                  const float* __restrict__ x, int K) {
    PDL_ENTRY();
    __shared__ float sh[32];
    const float* xr = x + (size_t)blockIdx.x * K;
    float mx = 0.f;
    for (int i = threadIdx.x; i < K; i += blockDim.x) mx = fmaxf(mx, fabsf(xr[i]));
    float s = __fdiv_rn(block_max(mx, sh), 127.f);
    int8_t* q = xq + (size_t)blockIdx.x * K;
    for (int i = threadIdx.x; i < K; i += blockDim.x) q[i] = quant_token(xr[i], s);
    if (threadIdx.x == 0) tok[blockIdx.x] = s;
}

// w8a8_out is the epilogue of both W8A8 products: static, (acc + qbias)·deq;
// dynamic (tok set), (acc·tok[m])·deq with deq the weight scales; then the
// bias. No fused multiply-add, as on the CPU. w8a8_val is the same of the
// values t = tok[m] (dynamic), qb = qbias[n] (static), d = deq[n] and
// b = bias[n] (with a bias).
__device__ __forceinline__ float w8a8_val(int acc, bool dynamic, float t, int qb, float d, bool biased, float b) {
    float v = dynamic ? __fmul_rn(__fmul_rn((float)acc, t), d) : __fmul_rn((float)(acc + qb), d);
    return biased ? __fadd_rn(v, b) : v;
}
__device__ __forceinline__ float w8a8_out(int acc, int m, int n, const int* __restrict__ qbias,
                                          const float* __restrict__ deq, const float* __restrict__ bias,
                                          const float* __restrict__ tok) {
    return w8a8_val(acc, tok, tok ? tok[m] : 0.f, tok ? 0 : qbias[n], deq[n], bias, bias ? bias[n] : 0.f);
}
// W8A8Fin is w8a8_out as the fin of out_tile and out_tile_staged (see
// AsIs): a thread's four columns' qbias, deq and bias loaded once (cols;
// zeros past N) for all its rows. at gives w8a8_val's bits without a
// choice a value: ((acc + qb) · t) · d + b with qb 0 and t = tok[m] where
// dynamic, t = 1 where static, b = −0 without a bias (x · 1 and x + (−0)
// are x exactly, −0 and NaN included). (Until the sixty-fourth session at
// called w8a8_val a value, whose two forms and bias choice NVVM computed
// both of and selected: ~22 instructions a value, the int8 GEMMs'
// epilogue issue-bound at 3.0 µs a 128 × 128 tile against fp16's 1.7.)
struct W8A8Fin {
    const int* __restrict__ qbias;
    const float* __restrict__ deq;
    const float* __restrict__ bias;
    const float* __restrict__ tok;
    struct Cols {
        int qb[4];
        float d[4], b[4];
    };
    __device__ __forceinline__ float operator()(int m, int n, int acc) const {
        return w8a8_out(acc, m, n, qbias, deq, bias, tok);
    }
    __device__ __forceinline__ Cols cols(int n, int N) const {
        Cols c;
#pragma unroll
        for (int i = 0; i < 4; i++) {
            bool in = n + i < N;
            c.qb[i] = in && !tok ? qbias[n + i] : 0;
            c.d[i] = in ? deq[n + i] : 0.f;
            c.b[i] = in && bias ? bias[n + i] : -0.f;
        }
        return c;
    }
    __device__ __forceinline__ float at(const Cols& c, int m, int i, int acc) const {
        const float t = tok ? tok[m] : 1.f;
        return __fadd_rn(__fmul_rn(__fmul_rn((float)(acc + c.qb[i]), t), c.d[i]), c.b[i]);
    }
};
// w8a8_tile is the epilogue of a W8A8 GEMM tile (units as out_tile's, two
// integer sums each): split K, the sums stored to part; else w8a8_out put
// into y by out, the SwiGLU quantized to q where q.p is set (STAGED:
// through out_tile_staged, st and mir, q unset, a tile of COLS columns).
template <int NU, bool STAGED = false, int COLS = TS_COLS, typename At, typename Raw, typename Mir = NoMirror>
__device__ __forceinline__ void w8a8_tile(float* y, int* part, int M, int N, int out, At at, Raw raw,
                                          const int* __restrict__ qbias, const float* __restrict__ deq,
                                          const float* __restrict__ bias, const float* __restrict__ tok,
                                          QOut q = QOut{}, TileStage<int> st = TileStage<int>{}, Mir mir = Mir{}) {
    if (part) {
#pragma unroll
        for (int u = 0; u < NU; u++) {
            int m, n;
            at(u, m, n);
            if (m >= M) continue;
            if (n < N) part[(size_t)m * N + n] = raw(u, 0);
            if (n + 1 < N) part[(size_t)m * N + n + 1] = raw(u, 1);
        }
        return;
    }
    W8A8Fin fin{qbias, deq, bias, tok};
    if constexpr (STAGED)
        out_tile_staged<NU, 2, int, COLS>(y, M, N, out, at, raw, fin, st, mir);
    else
        out_tile<NU, 2, int>(y, M, N, out, at, raw, fin, q);
}

// W8A8Seg is one weight of a w8a8_gemm launch: its outputs, int8 rows,
// and w8a8_out's int32 biases, dequantization scales and biases (or none).
struct W8A8Seg {
    float* y;
    const int8_t* W;
    const int* qb;
    const float* dq;
    const float* bs;
    int N;
};
#define W8A8_SEG(i) float *y##i, const int8_t *W##i, const int *qb##i, const float *dq##i, const float *bs##i, int N##i

// w8a8_dot adds the products of the activation row xp with the rows wp[r]
// to acc[r], a lane's 16-byte units from c0 on, 32 apart: U of each row's
// loaded (issued together; whole: all in the row) before their dp4a's, so
// that a warp has U·NR loads in flight, not one. The sums are integers,
// so their order does not change them.
template <int NR, int U>
__device__ __forceinline__ void w8a8_dot(int (&acc)[NR], const int4* __restrict__ xp, const uint4* const (&wp)[NR],
                                         int c0, int nc, bool whole) {
    uint4 b[NR][U];
    int4 a[U];
#pragma unroll
    for (int u = 0; u < U; u++) {
        int c = c0 + 32 * u;
        bool in = whole || c < nc;
#pragma unroll
        for (int r = 0; r < NR; r++) b[r][u] = in ? ldg_stream(wp[r] + c) : make_uint4(0, 0, 0, 0);
        a[u] = in ? xp[c] : make_int4(0, 0, 0, 0);
    }
#pragma unroll
    for (int u = 0; u < U; u++)
#pragma unroll
        for (int r = 0; r < NR; r++) {
            acc[r] = __dp4a(a[u].x, (int)b[r][u].x, acc[r]);
            acc[r] = __dp4a(a[u].y, (int)b[r][u].y, acc[r]);
            acc[r] = __dp4a(a[u].z, (int)b[r][u].z, acc[r]);
            acc[r] = __dp4a(a[u].w, (int)b[r][u].w, acc[r]);
        }
}

// w8a8_rows is w8a8_dot over whole rows of K int8 (K % 16 == 0) and the
// warp's sum, in every lane.
template <int NR, int U>
__device__ __forceinline__ void w8a8_rows(int (&acc)[NR], const int8_t* __restrict__ x,
                                          const uint4* const (&wp)[NR], int K, int lane) {
    const int4* xp = reinterpret_cast<const int4*>(x);
    const int nc = K / 16;
    int c0 = lane;
    for (; c0 + 32 * (U - 1) < nc; c0 += 32 * U) w8a8_dot<NR, U>(acc, xp, wp, c0, nc, true);
    if (c0 < nc) w8a8_dot<NR, U>(acc, xp, wp, c0, nc, false);
#pragma unroll
    for (int r = 0; r < NR; r++)
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[r] += __shfl_xor_sync(FULL, acc[r], o);
}

// grid (nb0 + nb1 + nb2, M) with nb_s = ceil(N_s/8), block 256: one warp
// per output of up to three weights of one activation quantizer (xq, tok:
// q, k and v), each put into its y by out. K % 16 == 0. Eight 16-byte
// units of a row a lane in flight (a 4 096-feature row's all). Four
// blocks a multiprocessor (64 registers) let ptxas keep the loads
// hoisted; without the bound it kept two in flight at 32 registers. On an
// H200 the 7B W8A8 graph decode of one weight a launch ran 3.1 % faster
// than with one load in flight, with three blocks 0.6 %, with two 3.7 %
// slower, though three read 2–5 points more of copy bandwidth in the
// kernel table (kernels/NOTES.md, forty-eighth session).
extern "C" __global__ void __launch_bounds__(256, 4)
    w8a8_gemm(const int8_t* __restrict__ xq, const float* __restrict__ tok, int K, int out, int nb0, int nb1,
              W8A8_SEG(0), W8A8_SEG(1), W8A8_SEG(2)) {
    PDL_ENTRY();
    int lane = threadIdx.x & 31, bx = blockIdx.x, m = blockIdx.y;
    const W8A8Seg s = bx < nb0 ? W8A8Seg{y0, W0, qb0, dq0, bs0, N0}
                      : bx < nb0 + nb1 ? W8A8Seg{y1, W1, qb1, dq1, bs1, N1}
                                       : W8A8Seg{y2, W2, qb2, dq2, bs2, N2};
    bx -= bx < nb0 ? 0 : bx < nb0 + nb1 ? nb0 : nb0 + nb1;
    int n = bx * 8 + (threadIdx.x >> 5);
    if (n >= s.N) return;
    int acc[1] = {0};
    const uint4* const wp[1] = {reinterpret_cast<const uint4*>(s.W + (size_t)n * K)};
    w8a8_rows<1, 8>(acc, xq + (size_t)m * K, wp, K, lane);
    float* yp = s.y + (size_t)m * s.N + n;
    if (lane == 0) *yp = out_val(yp, w8a8_out(acc[0], m, n, s.qb, s.dq, s.bs, tok), out);
}

// w8a8_glu: grid (ceil(N/8), M), block 256: a warp takes row n of the
// gate W0 and of the up W1 (both N × K, one activation quantizer) and
// stores silu_times of their outputs into y, as w8a8_gemm's launch of the
// gate and then of the up with OUT_SWIGLU would (the same bits). Four
// 16-byte units of each row a lane in flight.
extern "C" __global__ void __launch_bounds__(256, 4)
    w8a8_glu(float* __restrict__ y, const int8_t* __restrict__ xq, const float* __restrict__ tok, int N, int K,
             const int8_t* __restrict__ W0, const int* __restrict__ qb0, const float* __restrict__ dq0,
             const float* __restrict__ bs0, const int8_t* __restrict__ W1, const int* __restrict__ qb1,
             const float* __restrict__ dq1, const float* __restrict__ bs1) {
    PDL_ENTRY();
    int lane = threadIdx.x & 31, m = blockIdx.y;
    int n = blockIdx.x * 8 + (threadIdx.x >> 5);
    if (n >= N) return;
    int acc[2] = {0, 0};
    const uint4* const wp[2] = {reinterpret_cast<const uint4*>(W0 + (size_t)n * K),
                                reinterpret_cast<const uint4*>(W1 + (size_t)n * K)};
    w8a8_rows<2, 4>(acc, xq + (size_t)m * K, wp, K, lane);
    if (lane == 0)
        y[(size_t)m * N + n] =
            silu_times(w8a8_out(acc[0], m, n, qb0, dq0, bs0, tok), w8a8_out(acc[1], m, n, qb1, dq1, bs1, tok));
}

// W8A8 GEMM on the int8 tensor cores (mma.sync m16n8k32 s8·s8→s32), for
// M > a few rows: y[m,n] = (Σ_k xq[m,k]·W[n,k] + qbias[n])·deq[n] (+ bias[n]),
// the same integers and float operations as w8a8_gemm, so the results are
// identical. Block tile 128 (m) × 128 (n), K in steps of 64 through shared
// memory (a cp.async ring of W8_STAGES tiles, rows padded to 80 bytes: the fragment
// loads of a warp hit 32 distinct banks); 8 warps, 4 along m × 2 along n,
// each 32 × 64 (2 × 8 mma tiles). K % 16 == 0 (16-byte row chunks; chunks
// past K or rows past M/N are zero-filled). With gridDim.z > 1 split z takes
// an equal share of the K steps and writes its integer sums, not y, to the
// int32 array y + z·M·N; w8a8_sum_splits adds them and applies w8a8_out
// and out. yq set with OUT_SWIGLU: the SwiGLU quantized there (QOut{yq,
// qs, qo}), y (the gate's products) only read.
#define W8_BM 128
#define W8_BN 128
#define W8_BK 64
#define W8_LD 80
#define W8_STAGES 4  // cp.async ring; dynamic shared memory W8_SMEM
#define W8_SMEM (W8_STAGES * (W8_BM + W8_BN) * W8_LD)
__device__ __forceinline__ void mma_s8(int (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3, uint32_t b0, uint32_t b1) {
    asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
                 : "+r"(c[0]), "+r"(c[1]), "+r"(c[2]), "+r"(c[3])
                 : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}
extern "C" __global__ void __launch_bounds__(256) w8a8_mma(
    float* __restrict__ y, const int8_t* __restrict__ xq, const int8_t* __restrict__ W,
    const int* __restrict__ qbias, const float* __restrict__ deq, const float* __restrict__ bias,
    const float* __restrict__ tok, int M, int N, int K, int8_t* yq, float qs, float qo, int out) {
    PDL_ENTRY();
    extern __shared__ __align__(16) unsigned char w8_smem[];
    int8_t (*As)[W8_BM * W8_LD] = reinterpret_cast<int8_t (*)[W8_BM * W8_LD]>(w8_smem);
    int8_t (*Bs)[W8_BN * W8_LD] = reinterpret_cast<int8_t (*)[W8_BN * W8_LD]>(w8_smem + W8_STAGES * W8_BM * W8_LD);
    int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    int gid = lane >> 2, tq = lane & 3;
    int wm = warp & 3, wn = warp >> 2;  // warp tile: rows wm*32.., cols wn*64..
    int bm = blockIdx.y * W8_BM, bn = blockIdx.x * W8_BN;
    KSplit ks = k_split((K + W8_BK - 1) / W8_BK);
    int kt0 = ks.kt0, nk = ks.kt1 - ks.kt0;  // this split's K steps
    // Each thread copies 2 chunks of 16 bytes of A and of B per K step (kt
    // counts from kt0).
    auto load = [&](int kt, int buf) {
#pragma unroll
        for (int i = 0; i < 2; i++) {
            int c = tid + i * 256;  // 0..511: row c/4, chunk c%4
            int r = c >> 2, kc = (c & 3) * 16, k = (kt0 + kt) * W8_BK + kc;
            bool kin = k < K;
            int am = bm + r, bnr = bn + r;
            bool va = kin && am < M, vb = kin && bnr < N;
            cp_async16_zfill(&As[buf][r * W8_LD + kc], va ? (const void*)(xq + (size_t)am * K + k) : (const void*)xq, va);
            cp_async16_zfill(&Bs[buf][r * W8_LD + kc], vb ? (const void*)(W + (size_t)bnr * K + k) : (const void*)W, vb);
        }
    };
    int acc[2][8][4];
#pragma unroll
    for (int i = 0; i < 2; i++)
#pragma unroll
        for (int j = 0; j < 8; j++)
#pragma unroll
            for (int e = 0; e < 4; e++) acc[i][j][e] = 0;
#pragma unroll
    for (int st = 0; st < W8_STAGES - 1; st++) {
        if (st < nk) load(st, st);
        cp_async_commit();
    }
    for (int kt = 0; kt < nk; kt++) {
        asm volatile("cp.async.wait_group %0;\n" ::"n"(W8_STAGES - 2) : "memory");
        __syncthreads();  // tile kt is in; every warp is done with tile kt-1's stage
        int nx = kt + W8_STAGES - 1;
        if (nx < nk) load(nx, nx % W8_STAGES);
        cp_async_commit();
        int buf = kt % W8_STAGES;
        const int8_t* A = As[buf];
        const int8_t* B = Bs[buf];
#pragma unroll
        for (int ks = 0; ks < W8_BK; ks += 32) {
            // fragments by ldmatrix, the int8 tiles read as 16-bit pairs: A's
            // four 8 × 16-byte matrices are rows 0-7 / 8-15 × bytes 0-15 /
            // 16-31 (a0..a3), B's two n-tiles × the two byte halves (b0, b1)
            uint32_t a[2][4], b[4][4];
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
                ldmatrix_x4(a[mt], A + (wm * 32 + mt * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * W8_LD + ks + (lane >> 4) * 16);
#pragma unroll
            for (int np = 0; np < 4; np++)
                ldmatrix_x4(b[np], B + (wn * 64 + np * 16 + (lane & 7) + (lane >> 4) * 8) * W8_LD + ks + ((lane >> 3) & 1) * 16);
#pragma unroll
            for (int mt = 0; mt < 2; mt++)
#pragma unroll
                for (int nt = 0; nt < 8; nt++)
                    mma_s8(acc[mt][nt], a[mt][0], a[mt][1], a[mt][2], a[mt][3], b[nt >> 1][(nt & 1) * 2], b[nt >> 1][(nt & 1) * 2 + 1]);
        }
    }
    asm volatile("cp.async.wait_group 0;\n" ::: "memory");
    int* part = gridDim.z > 1 ? reinterpret_cast<int*>(y) + (size_t)blockIdx.z * M * N : nullptr;
    // unit u = (8mt + nt)·2 + h: row gid (+8 for h) of m16 tile mt, columns
    // 2·tq, 2·tq + 1 of n8 tile nt
    w8a8_tile<32>(
        y, part, M, N, out,
        [&](int u, int& m, int& n) {
            m = bm + wm * 32 + (u >> 4) * 16 + gid + (u & 1) * 8;
            n = bn + wn * 64 + ((u >> 1) & 7) * 8 + 2 * tq;
        },
        [&](int u, int e) { return acc[u >> 4][(u >> 1) & 7][2 * (u & 1) + e]; }, qbias, deq, bias, tok,
        QOut{yq, qs, qo});
}

// w8a8_out of the S splits' integer sums of w8a8_mma (part: S × M × N
// int32) into y by out, or quantized to yq (QOut); integer addition, so the
// result is the unsplit kernel's.
extern "C" __global__ void w8a8_sum_splits(float* __restrict__ y, const int* __restrict__ part, int S, int M, int N,
                                           const int* __restrict__ qbias, const float* __restrict__ deq,
                                           const float* __restrict__ bias, const float* __restrict__ tok,
                                           int8_t* yq, float qs, float qo, int out) {
    PDL_ENTRY();
    long long n = (long long)M * N;
    QOut q{yq, qs, qo};
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        int acc = 0;
        for (int s = 0; s < S; s++) acc += part[s * n + i];
        float v = out_val(y + i, w8a8_out(acc, (int)(i / N), (int)(i % N), qbias, deq, bias, tok), out);
        if (yq)
            q.put1(i, v);
        else
            y[i] = v;
    }
}

#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
// gemm_wg_s8(y, mapA, mapW, qbias, deq, bias, tok, M, N, K, out): w8a8_mma on
// the Hopper GEMM (gemm_wg_body, GH_S8): mapA over the int8 activations xq
// [M, K], mapW over the int8 weight [N, K]; split z of gridDim.z > 1 writes
// its integer sums to the int32 array y + z·M·N for w8a8_sum_splits, except
// where the splits run as one cluster a tile (gw_scatter: each block of a
// narrow pair its half of the rows, of a narrow three its part;
// gw_merge_splits: the tree's rank 0), which applies
// w8a8_out into y by out as an unsplit launch does. Dynamic shared memory
// as gemm_wg_f16's.
// gemm_wg_s8_w: the same with 256 weight rows a block (AH = 2: one wgmma
// m64n256k32 a k32 step; its grid.y half gemm_wg_s8's), its two 128-column
// halves through the epilogue one after the other.
#define GEMM_WG_S8_ENTRY(name, AH)                                                                               \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                         \
        name(float* y, const __grid_constant__ TmaMap mapA, const __grid_constant__ TmaMap mapW,                 \
             const int* __restrict__ qbias, const float* __restrict__ deq, const float* __restrict__ bias,       \
             const float* __restrict__ tok, int M, int N, int K, int out) {                                      \
        PDL_ENTRY();                                                                                             \
        KSplit ks = k_split((K + 127) / 128);                                                                    \
        int* part = split_to_memory() ? reinterpret_cast<int*>(y) + (size_t)blockIdx.z * M * N : nullptr;        \
        gemm_wg_body<GH_S8, false, false, 1, AH>(                                                                \
            y, &mapA, &mapW, nullptr, nullptr, M, N, 128, 0, ks.kt0, ks.kt1, OUT_STORE,                          \
            [&](auto at, auto raw, TileStage<int> st) {                                                          \
                w8a8_tile<32, true>(y, part, M, N, out, at, raw, qbias, deq, bias, tok, QOut{}, st);             \
            });                                                                                                  \
    }
GEMM_WG_S8_ENTRY(gemm_wg_s8, 1)
GEMM_WG_S8_ENTRY(gemm_wg_s8_w, 2)
// gemm_wg_s8_segs(mapA, mapW0, mapW1, mapW2, tok, M, K, out, then for each
// weight i {y_i, qbias, deq, bias, N_i}): gemm_wg_s8 of one int8 input
// [M, K] (mapA) with up to three W8A8 weights of one activation quantizer
// (q, k and v) in one launch: grid.y walks the weight tiles of weight 0,
// then 1, then 2 (N2 = 0: two weights), each tile's w8a8_out put into its
// weight's y_i [M, N_i] by out. K splits along z only as clusters of a
// tile (gw_scatter, gw_merge_splits): a launch
// split otherwise would store each split's sums as the result. One launch
// pays the fill, merge and epilogue of a short K split once for the three
// products.
#define W8A8_FIN(i) const int *qb##i, const float *dq##i, const float *bs##i, int N##i
#define W8A8_OUT(i) float *y##i, W8A8_FIN(i)
// gemm_wg_s8_segs_run is the body of gemm_wg_s8_segs and its _kv form:
// the weights s0..s2, mir the staged epilogue's (QKVSink: its role set to
// the block's weight).
template <typename Mir>
__device__ __forceinline__ void gemm_wg_s8_segs_run(const TmaMap& mapA, const TmaMap& mapW0, const TmaMap& mapW1,
                                                    const TmaMap& mapW2, const float* __restrict__ tok, int M, int K,
                                                    int out, const W8A8Seg& s0, const W8A8Seg& s1, const W8A8Seg& s2,
                                                    Mir mir) {
    if (split_to_memory()) __trap();  // a host error: the splits would each store their sums as the result
    KSplit ks = k_split((K + 127) / 128);
    int ny = blockIdx.y;
    const int w = seg_of(ny, s0.N, s1.N);
    const TmaMap* mapW = w == 0 ? &mapW0 : w == 1 ? &mapW1 : &mapW2;
    const W8A8Seg s = w == 0 ? s0 : w == 1 ? s1 : s2;
    if constexpr (Mir::takes) mir.role = w;
    gemm_wg_body<GH_S8, false, false, 1, 1>(
        s.y, &mapA, mapW, nullptr, nullptr, M, s.N, 128, 0, ks.kt0, ks.kt1, OUT_STORE,
        [&](auto at, auto raw, TileStage<int> st) {
            w8a8_tile<32, true>(s.y, nullptr, M, s.N, out, at, raw, s.qb, s.dq, s.bs, tok, QOut{}, st, mir);
        },
        ny);
}
extern "C" __global__ void __launch_bounds__(384, 1)
    gemm_wg_s8_segs(const __grid_constant__ TmaMap mapA, const __grid_constant__ TmaMap mapW0,
                    const __grid_constant__ TmaMap mapW1, const __grid_constant__ TmaMap mapW2,
                    const float* __restrict__ tok, int M, int K, int out, W8A8_OUT(0), W8A8_OUT(1), W8A8_OUT(2)) {
    PDL_ENTRY();
    gemm_wg_s8_segs_run(mapA, mapW0, mapW1, mapW2, tok, M, K, out, W8A8Seg{y0, nullptr, qb0, dq0, bs0, N0},
                        W8A8Seg{y1, nullptr, qb1, dq1, bs1, N1}, W8A8Seg{y2, nullptr, qb2, dq2, bs2, N2}, NoMirror{});
}
// gemm_wg_s8_segs_kv(mapA, mapW0, mapW1, mapW2, tok, M, K, then for each
// weight i {qbias, deq, bias, N_i}, y0, kc, vc, tab, pos0, hd, layout):
// gemm_wg_s8_segs of q, k and v (N2 = N1) stored with RoPE and the KV
// store fused as gemm_wg_f16_segs_kv's (QKVSink).
extern "C" __global__ void __launch_bounds__(384, 1)
    gemm_wg_s8_segs_kv(const __grid_constant__ TmaMap mapA, const __grid_constant__ TmaMap mapW0,
                       const __grid_constant__ TmaMap mapW1, const __grid_constant__ TmaMap mapW2,
                       const float* __restrict__ tok, int M, int K, W8A8_FIN(0), W8A8_FIN(1), W8A8_FIN(2), float* y0,
                       __half* kc, __half* vc, const float2* __restrict__ tab, int pos0, int hd, int layout) {
    PDL_ENTRY();
    gemm_wg_s8_segs_run(mapA, mapW0, mapW1, mapW2, tok, M, K, OUT_STORE, W8A8Seg{y0, nullptr, qb0, dq0, bs0, N0},
                        W8A8Seg{y0, nullptr, qb1, dq1, bs1, N1}, W8A8Seg{y0, nullptr, qb2, dq2, bs2, N2},
                        QKVSink{kc, vc, tab, pos0, hd, layout, 0});
}
// The W8A8 gate/up entries' parameters (gemm_wg_s8_glu's and its fill
// forms') and the GluEpi they make of them.
#define S8_GLU_PARAMS                                                                                     \
    float *y, int8_t *yq, float qs, float qo, const __grid_constant__ TmaMap mapA,                        \
        const __grid_constant__ TmaMap mapGU, const int *__restrict__ gqb, const float *__restrict__ gdeq, \
        const float *__restrict__ gbias, const int *__restrict__ uqb, const float *__restrict__ udeq,     \
        const float *__restrict__ ubias, const float *__restrict__ tok, int M, int N, int K, int upFirst
#define S8_GLU_EPI \
    GluEpi<W8A8Fin>{W8A8Fin{gqb, gdeq, gbias, tok}, W8A8Fin{uqb, udeq, ubias, tok}, upFirst != 0, QOut{yq, qs, qo}, nullptr}
// gemm_wg_s8_glu(y, yq, qs, qo, mapA, mapGU, gate and up {qbias, deq, bias},
// tok, M, N, K, upFirst): the W8A8 gate and up products of one int8 input
// [M, K] (mapA) and their SwiGLU silu(gate)·up in one launch, with no gate
// products in memory: a block's W tile is 64 rows of each weight
// (gemm_wg_body's PAIR: mapGU covers both as the planes of one tensor,
// plane 0 the one at the lower address, the up weight where upFirst), its
// result tile 128 rows × 64 outputs (glu_tile; gemm_wg_s8_glu_w: 128 rows
// of each weight, 128 outputs). The SwiGLU goes to y [M, N] as floats, or
// quantized to yq (QOut). No K split.
#define GEMM_WG_S8_GLU_ENTRY(name, AH)                                                                           \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                         \
        name(S8_GLU_PARAMS) {                                                                                    \
        PDL_ENTRY();                                                                                             \
        gemm_wg_body<GH_S8, true, false, 1, AH>(                                                                 \
            y, &mapA, &mapGU, nullptr, nullptr, M, N, 128, 0, 0, (K + 127) / 128, OUT_STORE,                     \
            S8_GLU_EPI);                                                                                         \
    }
GEMM_WG_S8_GLU_ENTRY(gemm_wg_s8_glu, 1)
GEMM_WG_S8_GLU_ENTRY(gemm_wg_s8_glu_w, 2)
// gemm_wg_s8_fill_body is the block of an int8 Hopper GEMM's fill forms:
// NW weight rows a block (one wgmma m64nNW k32 a k32 step: the W box NW
// rows of mapW; PAIR: of a 3-D map over two weights as planes, NW / 2
// rows of each, plane 0's then plane 1's), so that a launch of one
// activation tile fills a wave where 128-row blocks leave multiprocessors
// idle. Its K steps kt0..kt1 − 1 of activation tile m0 by the weight rows
// from n0 go through S8F_STAGES stages of s8f_stage_bytes (the products
// as gw_ss_steps's); a plain block launched as one cluster of the K
// splits of its tile (2 or 3 along z) merges them with gw_scatter. Then
// put(at, raw, st) gets the block's sums as gemm_wg_body's epilogue does
// (units of two sums: NW / 4 a consumer thread; stage column 8j + 2·(lane
// % 4) of unit 2j (+1)), st the ring as a stage of NW columns (pitch NW +
// 8), its rows those this block finishes. Dynamic shared memory as
// runtime/cuda's s8FillSmem says (the stages, their barriers, the
// alignment).
template <int NW>
__host__ __device__ constexpr int s8f_stage_bytes() {
    return (128 * 128 + NW * 128 + 1023) & ~1023;
}
#define S8F_STAGES 5
template <int NW, bool PAIR, typename Put>
__device__ __forceinline__ void gemm_wg_s8_fill_body(const TmaMap* mapA, const TmaMap* mapW, int m0, int n0, int kt0,
                                                     int kt1, Put put) {
    constexpr int SB = s8f_stage_bytes<NW>(), GWS = S8F_STAGES, NV = NW / 2;
    static_assert(TS_ROWS * (NW + 8) * 4 <= GWS * SB, "the result tile fits in the ring");
    static_assert(2 * NV * 96 * 4 <= GWS * SB, "gw_scatter's parts fit in the ring");
    extern __shared__ __align__(1024) unsigned char gw_raw[];
    uint32_t raw = smem_u32(gw_raw), base = (raw + 1023) & ~1023u;
    uint32_t bars = base + GWS * SB;
    auto full = [&](int s) { return bars + 8 * s; };
    auto empty = [&](int s) { return bars + 8 * (GWS + s); };
    auto tileA = [&](int s) { return base + s * SB; };
    auto tileW = [&](int s) { return base + s * SB + 128 * 128; };
    const int tid = threadIdx.x, wg = tid >> 7, nk = kt1 - kt0;
    if (tid == 0) gw_ring_init<GWS>(full, empty, 1);
    __syncthreads();
    const int ncl = PAIR ? 1 : (int)cluster_blocks();
    if (ncl > 1) cluster_arrive();  // gw_scatter's first wait takes every thread's as all started
    if (wg == 0) {  // one thread copies the A and W tiles of every K step
        asm volatile("setmaxnreg.dec.sync.aligned.u32 40;" ::: "memory");
        if (tid != 0) return;
        const uint64_t wpol = l2_evict_first();
        for (int i = 0; i < nk; i++) {
            int s = i % GWS, k = (kt0 + i) * 128;
            if (i >= GWS) mbar_wait(empty(s), (i / GWS - 1) & 1);
            mbar_expect_tx(full(s), 128 * 128 + NW * 128);  // rows past M or N: zeros, their bytes counted
            tma_load_2d(tileA(s), mapA, k, m0, full(s));
            if constexpr (PAIR)
                tma_load_3d_once(tileW(s), mapW, k, n0, 0, full(s), wpol);
            else
                tma_load_2d_once(tileW(s), mapW, k, n0, full(s), wpol);
        }
        return;
    }
    const int c = wg - 1, warp = (tid >> 5) & 3, lane = tid & 31;
    int d[NV];  // 64 activation rows of warpgroup c by the NW weight rows
    asm volatile("setmaxnreg.inc.sync.aligned.u32 232;" ::: "memory");
#pragma unroll
    for (int e = 0; e < NV; e++) d[e] = 0;
#pragma unroll
    for (int e = 0; e < NV; e++) wg_pin(d[e]);  // zeros before the first fence
    gw_ss_steps<GWS>(d, nk, c, lane, full, empty, tileA, tileW);
    TileStage<int> st{reinterpret_cast<int*>(gw_raw + (base - raw)), m0, n0, 1, 256, tid - 128};
    if constexpr (!PAIR) {
        if (ncl == 2) gw_scatter<2>(d, gw_raw + (base - raw), tid - 128, st.r0, st.r1);
        if (ncl == 3) gw_scatter<3>(d, gw_raw + (base - raw), tid - 128, st.r0, st.r1);
    }
    // accumulator e of n8 chunk j: activation row 16·warp + lane/4 (+8 for
    // e ≥ 2), stage column 8j + 2·(lane % 4) (+1 for odd e)
    const int r = m0 + c * 64 + warp * 16 + (lane >> 2);
    auto at = [&](int u, int& m, int& n) {
        m = r + 8 * (u & 1);
        n = n0 + (u >> 1) * 8 + 2 * (lane & 3);
    };
    auto rawv = [&](int u, int e) { return d[4 * (u >> 1) + 2 * (u & 1) + e]; };
    put(at, rawv, st);
}
// gemm_wg_s8_f112, the plain int8 GEMM's fill form (runtime/cuda's
// s8Fill says where): gemm_wg_s8 with 112 weight rows a block
// (gemm_wg_s8_fill_body), so that 4 096 outputs at one activation tile
// make 37 tiles, 111 blocks in threes, where gemm_wg_s8's 32 make 96. K
// splits along z only as clusters of 2 or 3 (gw_scatter); the same sums
// and w8a8_out as gemm_wg_s8's, through a stage of 112 columns. Arguments
// as gemm_wg_s8's (mapW's box 112 rows); grid (ceil(M/128), ceil(N/112),
// splits), block 384.
extern "C" __global__ void __launch_bounds__(384, 1)
    gemm_wg_s8_f112(float* y, const __grid_constant__ TmaMap mapA, const __grid_constant__ TmaMap mapW,
                    const int* __restrict__ qbias, const float* __restrict__ deq, const float* __restrict__ bias,
                    const float* __restrict__ tok, int M, int N, int K, int out) {
    PDL_ENTRY();
    if (split_to_memory() || cluster_blocks() > 3) __trap();  // a host error: no merge for these splits
    KSplit ks = k_split((K + 127) / 128);
    gemm_wg_s8_fill_body<112, false>(&mapA, &mapW, blockIdx.x * 128, blockIdx.y * 112, ks.kt0, ks.kt1,
                                     [&](auto at, auto raw, TileStage<int> st) {
                                         w8a8_tile<28, true, 112>(y, nullptr, M, N, out, at, raw, qbias, deq, bias,
                                                                  tok, QOut{}, st);
                                     });
}
// gemm_wg_s8_glu_f88 and _f112, the GLU fill forms (runtime/cuda's
// gluFillRows says where): gemm_wg_s8_glu with NP rows of each weight a
// block (NP = 88 or 112: gemm_wg_s8_fill_body's pair of 2·NP rows, mapGU's
// box NP rows of both planes), so that a launch of one activation tile
// fills a wave where 128-row blocks leave multiprocessors idle (11 008 /
// 88 = 126 blocks, 14 336 / 112 = 128, against 86 and 112). The same
// sums, fin and SwiGLU as gemm_wg_s8_glu's, through a stage of 2·NP
// columns. Arguments as gemm_wg_s8_glu's; grid (ceil(M/128),
// ceil(N/NP)), block 384, dynamic shared memory as runtime/cuda's
// s8FillSmem(2·NP) says.
#define GEMM_WG_S8_GLU_FILL_ENTRY(name, NP)                                                                      \
    extern "C" __global__ void __launch_bounds__(384, 1)                                                         \
        name(S8_GLU_PARAMS) {                                                                                    \
        PDL_ENTRY();                                                                                             \
        const GluEpi<W8A8Fin> epi = S8_GLU_EPI;                                                                  \
        gemm_wg_s8_fill_body<2 * NP, true>(&mapA, &mapGU, blockIdx.x * 128, blockIdx.y * NP, 0, (K + 127) / 128, \
                                           [&](auto at, auto raw, TileStage<int> st) {                           \
                                               glu_tile<NP / 2, 2, NP, 2 * NP + 8>(y, M, N, at, raw, epi, st);   \
                                           });                                                                   \
    }
GEMM_WG_S8_GLU_FILL_ENTRY(gemm_wg_s8_glu_f88, 88)
GEMM_WG_S8_GLU_FILL_ENTRY(gemm_wg_s8_glu_f112, 112)
#endif

// ---------------------------------------------------------------------------
// Logits: NLL, argmax, sampling.

// out[r] = logsumexp(logits[r]) - logits[r][target[r]], sums in double.
extern "C" __global__ void nll(double* __restrict__ out, const float* __restrict__ logits,
                               const int* __restrict__ targets, int cols) {
    PDL_ENTRY();
    __shared__ float shf[32];
    __shared__ double shd[32];
    int r = blockIdx.x;
    const float* l = logits + (size_t)r * cols;
    float mx = -INFINITY;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) mx = fmaxf(mx, l[c]);
    mx = block_max(mx, shf);
    double s = 0.0;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) s += exp((double)l[c] - (double)mx);
    s = block_sum_d(s, shd);
    if (threadIdx.x == 0) out[r] = log(s) + (double)mx - (double)l[targets[r]];
}

// Largest logit of each row (lowest index on ties; NaN never wins; a row of
// NaN gives 0). Grid (splits, rows), ARGMAX_THREADS threads: split s of a
// row takes ARGMAX_SPAN columns from s·ARGMAX_SPAN, ARGMAX_U loads a
// thread in flight at once, and leaves its best (value bits, index) in
// part[r·splits + s]; the row's last split to finish (cnt[r], which it
// resets) takes the best of the parts (the order is a total one, so the
// result does not depend on the order the splits ran in) and writes out[r].
// With dpos set (graph decode, one row) it also advances the decode:
// hist[*dpos] = out[0] (while *dpos < histLen), ids[0] = out[0], *dpos += 1.
#define ARGMAX_THREADS 256
#define ARGMAX_U 8
#define ARGMAX_SPAN (ARGMAX_THREADS * ARGMAX_U)
__device__ __forceinline__ void argmax_take(float& bv, int& bi, float v, int i) {
    if (v > bv || (v == bv && i < bi)) { bv = v; bi = i; }
}
__device__ __forceinline__ void argmax_block(float& bv, int& bi, float* sv, int* si) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) argmax_take(bv, bi, __shfl_xor_sync(FULL, bv, o), __shfl_xor_sync(FULL, bi, o));
    int lane = threadIdx.x & 31, w = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) { sv[w] = bv; si[w] = bi; }
    __syncthreads();
    bv = lane < nw ? sv[lane] : -INFINITY;
    bi = lane < nw ? si[lane] : 0x7fffffff;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) argmax_take(bv, bi, __shfl_xor_sync(FULL, bv, o), __shfl_xor_sync(FULL, bi, o));
}
extern "C" __global__ void __launch_bounds__(ARGMAX_THREADS) argmax(int* __restrict__ out, const float* __restrict__ logits,
                                                                   int cols, int2* __restrict__ part, int* __restrict__ cnt,
                                                                   int* __restrict__ dpos, int* __restrict__ ids,
                                                                   int* __restrict__ hist, int histLen) {
    PDL_ENTRY();
    __shared__ float sv[32];
    __shared__ int si[32];
    __shared__ bool last;
    int s = blockIdx.x, ns = gridDim.x, r = blockIdx.y;
    const float* l = logits + (size_t)r * cols;
    float bv = -INFINITY;
    int bi = 0x7fffffff;
    int c0 = s * ARGMAX_SPAN + threadIdx.x;
    float v[ARGMAX_U];
#pragma unroll
    for (int i = 0; i < ARGMAX_U; i++) v[i] = l[min(c0 + i * ARGMAX_THREADS, cols - 1)];
#pragma unroll
    for (int i = 0; i < ARGMAX_U; i++)
        if (c0 + i * ARGMAX_THREADS < cols) argmax_take(bv, bi, v[i], c0 + i * ARGMAX_THREADS);
    argmax_block(bv, bi, sv, si);
    if (ns > 1) {
        if (threadIdx.x == 0) {
            part[(size_t)r * ns + s] = make_int2(__float_as_int(bv), bi);
            __threadfence();
            last = atomicAdd(&cnt[r], 1) == ns - 1;
        }
        __syncthreads();
        if (!last) return;
        __threadfence();
        bv = -INFINITY;
        bi = 0x7fffffff;
        for (int i = threadIdx.x; i < ns; i += blockDim.x) {
            int2 p = __ldcg(part + (size_t)r * ns + i);
            argmax_take(bv, bi, __int_as_float(p.x), p.y);
        }
        __syncthreads();  // sv, si free again
        argmax_block(bv, bi, sv, si);
        if (threadIdx.x == 0) cnt[r] = 0;
    }
    if (threadIdx.x == 0) {
        int id = bi == 0x7fffffff ? 0 : bi;
        out[r] = id;
        if (dpos) {
            int p = *dpos;
            if (p < histLen) hist[p] = id;
            ids[0] = id;
            *dpos = p + 1;
        }
    }
}

// Temperature sampling: out[r] = smallest i with cdf(i) > u[r], where cdf is
// the softmax of logits/temp. One block of 1024 threads per row.
extern "C" __global__ void __launch_bounds__(1024) sample(int* __restrict__ out, const float* __restrict__ logits,
                                                          const float* __restrict__ u, int cols, float temp) {
    PDL_ENTRY();
    __shared__ float shf[32];
    __shared__ double shd[32];
    __shared__ double part[1024];
    int r = blockIdx.x;
    const float* l = logits + (size_t)r * cols;
    float mx = -INFINITY;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) mx = fmaxf(mx, l[c]);
    mx = block_max(mx, shf);
    int per = (cols + blockDim.x - 1) / blockDim.x;
    int c0 = threadIdx.x * per, c1 = min(cols, c0 + per);
    double s = 0.0;
    for (int c = c0; c < c1; c++) s += exp(((double)l[c] - mx) / temp);
    part[threadIdx.x] = s;
    double tot = block_sum_d(s, shd);
    __syncthreads();
    if (threadIdx.x == 0) {
        double target = (double)u[r] * tot, run = 0.0;
        int t = 0;
        for (; t < (int)blockDim.x - 1; t++) {
            if (run + part[t] > target) break;
            run += part[t];
        }
        int a = t * per, b = min(cols, a + per);
        int pick = b - 1;
        for (int c = a; c < b; c++) {
            run += exp(((double)l[c] - mx) / temp);
            if (run > target) { pick = c; break; }
        }
        out[r] = max(0, min(cols - 1, pick));
    }
}

// ---------------------------------------------------------------------------
// The all-reduce kernels (the protocol is described above ar_call).
//
// allreduce_peer_ll is allreduce_peer for lane 0 (the small sums of a
// decode step) without the flag exchange, after NCCL's LL protocol: every
// value crosses the link in one 8-byte store together with the call's
// number (low word the float's bits, high word e), and the thread that sums
// it waits for that word to carry e, so neither a fence nor a flag's round
// trip is on the path; each thread sums the values it sent, in rank order
// (allreduce_peer's bits). Its stages hold 8 bytes a value: u64
// stage[2][world][cap] (the call counters are lane 0's). A word from an
// earlier call carries e − 2 or less (the area starts zeroed, e from 1),
// and the stage[e & 1] argument of allreduce_peer holds: a thread writes a
// peer's word again in call e + 2, after it read that peer's word of call
// e + 1, which the peer wrote after its call e ended.
// sent: the GEMV before it sent this rank's values (ar_send), its own word
// too, so the kernel does not wait for that GEMV (it reads nothing the GEMV
// stores, and writes x[i] only after the word the GEMV made from x[i] with
// a residual add; kernels before the GEMV have ended, it waited for them),
// takes every value from its stage, and advances its block's call counter
// only when it has summed them all (the GEMV's blocks read it first).
// yss (or null; x one row): each block also writes the sum of the squares
// of the sums it made, yss[block], as a residual add's GEMV does for the
// normed GEMV after it (gemvw_body's yss).
extern "C" __global__ void __launch_bounds__(256) allreduce_peer_ll(float* __restrict__ x, long long n, int rank,
                                                                    int world, char* __restrict__ area,
                                                                    long long stage_off, long long cap,
                                                                    unsigned long long timeout_ns,
                                                                    float* __restrict__ yss, int sent) {
    const int b = blockIdx.x, t = threadIdx.x;
    const unsigned long long* areas = reinterpret_cast<const unsigned long long*>(area);
    unsigned* calls = ar_calls0(area);
    if (sent) pdl_trigger();
    else PDL_ENTRY();
    const unsigned e = ar_call(calls, !sent);
    const long long step = (long long)gridDim.x * blockDim.x, i0 = (long long)b * blockDim.x + t;
    float ss = 0.f;
    if (!sent) {
        for (long long i = i0; i < n; i += step) {
            unsigned long long w = (unsigned long long)e << 32 | __float_as_uint(x[i]);
            for (int p = 0; p < world; p++)
                if (p != rank) st_relaxed_sys_u64(ar_stage0(areas[p], stage_off, cap, e, world, rank) + i, w);
        }
    }
    for (long long i = i0; i < n; i += step) {
        float s = 0.f;
        for (int r = 0; r < world; r++) {
            float v;
            if (r == rank && !sent) {
                v = x[i];
            } else {
                const unsigned long long* f = ar_stage0(areas[rank], stage_off, cap, e, world, r) + i;
                unsigned long long w = ld_relaxed_sys_u64(f), t0 = 0;
                while ((unsigned)(w >> 32) != e) {
                    unsigned long long now = global_ns();
                    if (t0 == 0) t0 = now;
                    else if (now - t0 > timeout_ns) __trap();
                    w = ld_relaxed_sys_u64(f);
                }
                v = __uint_as_float((unsigned)w);
            }
            s = r == 0 ? v : s + v;
        }
        x[i] = s;
        ss += s * s;
    }
    if (yss) {
        __shared__ float sh[32];
        ss = block_sum(ss, sh);
        if (t == 0) yss[b] = ss;
    }
    if (sent) {
        __syncthreads();
        if (t == 0) calls[b] = e;
    }
}

extern "C" __global__ void __launch_bounds__(256) allreduce_peer(float* __restrict__ x, long long n, int rank, int world,
                                                                 char* __restrict__ area, int lane, long long stage_off,
                                                                 long long cap, unsigned long long timeout_ns, int sent) {
    PDL_ENTRY();
    const int b = blockIdx.x, t = threadIdx.x;
    const unsigned long long* areas = reinterpret_cast<const unsigned long long*>(area);
    const long long sync_off = 8 * AR_MAX_RANKS + (long long)lane * AR_LANE_SYNC;  // the lane's flags, in bytes
    const unsigned e = ar_call(reinterpret_cast<unsigned*>(area + sync_off) + AR_MAX_RANKS * AR_MAX_BLOCKS);
    if (sent && lane != 1) __trap();  // only lane 1's senders (gemm_wg_*_tp) write the stage for it
    const long long n4 = n >> 2, step = (long long)gridDim.x * blockDim.x, i0 = (long long)b * blockDim.x + t;
    auto stage_of = [&](int peer, int sender) {  // stage[e & 1][sender] in peer's area
        return ar_stage1(areas[peer], stage_off, cap, e, world, sender);
    };
    const float4* x4 = reinterpret_cast<const float4*>(x);
    for (long long i = sent ? n4 : i0; i < n4; i += 4 * step) {
        float4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++)
            if (i + u * step < n4) v[u] = x4[i + u * step];
#pragma unroll
        for (int p = 0; p < AR_MAX_RANKS; p++) {
            if (p >= world) break;
            if (p == rank) continue;
            float4* d = reinterpret_cast<float4*>(stage_of(p, rank));
#pragma unroll
            for (int u = 0; u < 4; u++)
                if (i + u * step < n4) d[i + u * step] = v[u];
        }
    }
    for (long long i = 4 * n4 + i0; i < n && !sent; i += step)
        for (int p = 0; p < world; p++)
            if (p != rank) stage_of(p, rank)[i] = x[i];
    ar_meet(area, sync_off, rank, world, e, timeout_ns);
    // rank r's values: x for this rank, this rank's stage[e & 1][r] for the others
    auto src = [&](int r) -> const float* { return r == rank ? x : stage_of(rank, r); };
    float4* y4 = reinterpret_cast<float4*>(x);
    for (long long i = i0; i < n4; i += 4 * step) {
        float4 s[4];
#pragma unroll
        for (int u = 0; u < 4; u++)
            if (i + u * step < n4) s[u] = __ldcg(reinterpret_cast<const float4*>(src(0)) + i + u * step);
#pragma unroll
        for (int r = 1; r < AR_MAX_RANKS; r++) {
            if (r >= world) break;
            const float4* p = reinterpret_cast<const float4*>(src(r));
#pragma unroll
            for (int u = 0; u < 4; u++)
                if (i + u * step < n4) {
                    float4 v = __ldcg(p + i + u * step);
                    s[u].x += v.x, s[u].y += v.y, s[u].z += v.z, s[u].w += v.w;
                }
        }
#pragma unroll
        for (int u = 0; u < 4; u++)
            if (i + u * step < n4) y4[i + u * step] = s[u];
    }
    for (long long i = 4 * n4 + i0; i < n; i += step) {
        float s = __ldcg(src(0) + i);
        for (int r = 1; r < world; r++) s += __ldcg(src(r) + i);
        x[i] = s;
    }
}

// exchange_peer is a sequence-parallel exchange of x [M, cols] in lane 1
// of the group (allreduce_peer's grid, flags and stages): rank r owns the
// rows of sp_row(r) to sp_row(r + 1), and with
//   EX_SUM   x holds the residual and the product before (gemm_wg_*_tp
//            with scatter) has stored each rank's partial sums of a row
//            into stage[e & 1][rank] of the row's owner: the ranks meet,
//            and each adds to its own rows of x the ranks' partials in rank
//            order (x + p₀ + p₁ + …: allreduce_peer's bits where rank 0's
//            product added x). x then holds the sums at its own rows only.
//   EX_NORM  as EX_SUM, and then each row's RMSNorm (w, bias, eps: the
//            bits of rmsnorm with 256 threads) rounded to fp16 into the
//            gather area [M, cols] at gather_off bytes of every rank's area,
//            its own included, and the ranks meet again (AR_GATHER_SYNC): on
//            return every rank's gather area holds the whole normed matrix.
//   EX_GATHER x holds this rank's own rows (the rest stale): each rank
//            writes them into every peer's stage[e & 1][rank], the ranks
//            meet, and each copies the peers' rows into x: every rank then
//            holds the whole of x.
// Block b takes rows b, b + grid, … of the rank's own; 256 threads. A
// block waits at its meetings for its peers' same block, so the grids of
// the ranks that share a GPU must be resident at once. Two forms of the
// same body (the same bits): exchange_peer at most 128 registers (two
// blocks a multiprocessor: two ranks of one GPU; a rank alone on its GPU
// launches it padded to one a multiprocessor), exchange_peer_shared at
// most 80, with spills (three: up to three ranks of one GPU, as the tests
// run them); exchange.go's exchangeForm chooses.
#define EX_SUM 0
#define EX_NORM 1
#define EX_GATHER 2
__device__ __forceinline__ void exchange_body(float* __restrict__ x, int M, int cols, int rank, int world,
                                              char* __restrict__ area, long long stage_off, long long cap,
                                              unsigned long long timeout_ns, int mode, const float* __restrict__ w,
                                              const float* __restrict__ bias, float eps, long long gather_off) {
    constexpr int nt = 256;  // the block (rmsnorm's sums), and the loads' offsets immediates
    if (blockDim.x != nt) __trap();
    const int t = threadIdx.x;
    const unsigned long long* areas = reinterpret_cast<const unsigned long long*>(area);
    const long long sync_off = 8 * AR_MAX_RANKS + AR_LANE_SYNC;  // lane 1's flags, in bytes
    const unsigned e = ar_call(reinterpret_cast<unsigned*>(area + sync_off) + AR_MAX_RANKS * AR_MAX_BLOCKS);
    auto stage_of = [&](int peer, int sender) {  // stage[e & 1][sender] in peer's area
        return ar_stage1(areas[peer], stage_off, cap, e, world, sender);
    };
    const int r0 = sp_row(rank, M, world), r1 = sp_row(rank + 1, M, world);
    if (mode == EX_GATHER)  // this rank's rows to every peer
        for (int p = 0; p < world; p++) {
            if (p == rank) continue;
            float* d = stage_of(p, rank);
            for (long long i = (long long)r0 * cols + blockIdx.x * (long long)nt + t; i < (long long)r1 * cols;
                 i += (long long)gridDim.x * nt)
                d[i] = x[i];
        }
    ar_meet(area, sync_off, rank, world, e, timeout_ns);
    if (mode == EX_GATHER) {
        for (int p = 0; p < world; p++) {
            if (p == rank) continue;
            const float* src = stage_of(rank, p);
            int a = sp_row(p, M, world), z = sp_row(p + 1, M, world);
            for (long long i = (long long)a * cols + blockIdx.x * (long long)nt + t; i < (long long)z * cols;
                 i += (long long)gridDim.x * nt)
                x[i] = __ldcg(src + i);
        }
        return;
    }
    // A row is summed in chunks of RN_REG values a thread (the whole row
    // where it fits: kept in registers for the norm, as rmsnorm keeps it),
    // each chunk's loads of the residual and the partials all issued before
    // its sums (two ranks; more: a round trip a rank): a latency a chunk,
    // not one a value.
    __shared__ float sh[32];
    const int chunk = RN_REG * nt;
    const bool inreg = cols <= chunk;
    const float* st0 = stage_of(rank, 0);
    const float* st1 = stage_of(rank, world > 1 ? 1 : 0);
    __half* gown = reinterpret_cast<__half*>(area + gather_off);
    __half* gpeer = reinterpret_cast<__half*>(reinterpret_cast<char*>(areas[world == 2 ? 1 - rank : rank]) + gather_off);
    // EX_NORM's sum of squares: rmsnorm's vector form's (rn_vec_sumsq,
    // over the row read back) where the row fits it, else the strided sum
    // the loop below adds up as it stores the row
    const bool vec = mode == EX_NORM && rn_vec_fits(cols, nt, (uintptr_t)x | (uintptr_t)w | (uintptr_t)bias);
    const bool strided = mode == EX_NORM && !vec;
    for (int r = r0 + blockIdx.x; r < r1; r += gridDim.x) {
        float* xr = x + (size_t)r * cols;
        float xv[RN_REG];
        float ss = 0.f;
        for (int c0 = 0; c0 < cols; c0 += chunk) {
            const size_t o = (size_t)r * cols + c0 + t;
#pragma unroll
            for (int i = 0; i < RN_REG; i++) xv[i] = c0 + t + i * nt < cols ? xr[c0 + t + i * nt] : 0.f;
            if (world == 2) {
                float a[RN_REG], b2[RN_REG];
#pragma unroll
                for (int i = 0; i < RN_REG; i++) {
                    bool in = c0 + t + i * nt < cols;
                    a[i] = in ? __ldcg(st0 + o + i * nt) : 0.f;
                    b2[i] = in ? __ldcg(st1 + o + i * nt) : 0.f;
                }
#pragma unroll
                for (int i = 0; i < RN_REG; i++) xv[i] = (xv[i] + a[i]) + b2[i];
            } else {
#pragma unroll 1
                for (int p = 0; p < world; p++) {
                    const float* sp = stage_of(rank, p);
                    float a[RN_REG];
#pragma unroll
                    for (int i = 0; i < RN_REG; i++) a[i] = c0 + t + i * nt < cols ? __ldcg(sp + o + i * nt) : 0.f;
#pragma unroll
                    for (int i = 0; i < RN_REG; i++) xv[i] += a[i];
                }
            }
#pragma unroll
            for (int i = 0; i < RN_REG; i++) {
                int c = c0 + t + i * nt;
                if (c < cols) {
                    xr[c] = xv[i];
                    if (strided) ss += xv[i] * xv[i];
                }
            }
        }
        if (mode != EX_NORM) continue;
        if (vec) {  // as rmsnorm sums such rows
            __syncthreads();  // the row's sums, stored above by every thread of the block
            const float4* x4 = reinterpret_cast<const float4*>(xr);
            float4 xq[RN_V];
#pragma unroll
            for (int i = 0; i < RN_V; i++)
                xq[i] = t + i * nt < cols / 4 ? x4[t + i * nt] : make_float4(0.f, 0.f, 0.f, 0.f);
            ss = rn_vec_sumsq(xq);
        }
        const float inv = rms_inv(ss, cols, eps, sh);
        auto put = [&](float v, int c) {  // a normed value, to every rank's gather area
            __half h = __float2half_rn(v);
            size_t i = (size_t)r * cols + c;
            if (world == 2) {
                gown[i] = h, gpeer[i] = h;
                return;
            }
            for (int p = 0; p < world; p++) reinterpret_cast<__half*>(reinterpret_cast<char*>(areas[p]) + gather_off)[i] = h;
        };
        if (inreg) {  // the row's weights (and biases) loaded at once, before the stores
            float wv[RN_REG], bv[RN_REG];
#pragma unroll
            for (int i = 0; i < RN_REG; i++) {
                int c = t + i * nt;
                wv[i] = c < cols ? __ldg(w + c) : 0.f;
                bv[i] = bias && c < cols ? __ldg(bias + c) : 0.f;
            }
#pragma unroll
            for (int i = 0; i < RN_REG; i++) {
                int c = t + i * nt;
                if (c < cols) put(rms_scaled(xv[i], inv, wv[i], bias != nullptr, bv[i]), c);
            }
        } else {  // wider rows (a 13B's 5 120, a 70B's 8 192): a chunk at a time, its sums, weights and biases loaded at once
            for (int c0 = 0; c0 < cols; c0 += chunk) {
                float xs[RN_REG], wv[RN_REG], bv[RN_REG];
#pragma unroll
                for (int i = 0; i < RN_REG; i++) {
                    int c = c0 + t + i * nt;
                    bool in = c < cols;
                    xs[i] = in ? xr[c] : 0.f;  // this thread's own sums, stored above
                    wv[i] = in ? __ldg(w + c) : 0.f;
                    bv[i] = bias && in ? __ldg(bias + c) : 0.f;
                }
#pragma unroll
                for (int i = 0; i < RN_REG; i++) {
                    int c = c0 + t + i * nt;
                    if (c < cols) put(rms_scaled(xs[i], inv, wv[i], bias != nullptr, bv[i]), c);
                }
            }
        }
    }
    if (mode == EX_NORM) ar_meet(area, AR_GATHER_SYNC, rank, world, e, timeout_ns);
}
#define EXCHANGE_ENTRY(name, BLOCKS)                                                                                  \
    extern "C" __global__ void __launch_bounds__(256, BLOCKS)                                                        \
        name(float* __restrict__ x, int M, int cols, int rank, int world, char* __restrict__ area,                  \
             long long stage_off, long long cap, unsigned long long timeout_ns, int mode, const float* __restrict__ w, \
             const float* __restrict__ bias, float eps, long long gather_off) {                                     \
        PDL_ENTRY();                                                                                                  \
        exchange_body(x, M, cols, rank, world, area, stage_off, cap, timeout_ns, mode, w, bias, eps, gather_off);   \
    }
EXCHANGE_ENTRY(exchange_peer, 2)
EXCHANGE_ENTRY(exchange_peer_shared, 3)

// ---------------------------------------------------------------------------
// Synthetic weights for benchmarks, generated in place from a hash.
__device__ __forceinline__ uint32_t hash32(uint64_t x) {
    x ^= x >> 33; x *= 0xff51afd7ed558ccdull; x ^= x >> 33; x *= 0xc4ceb9fe1a85ec53ull; x ^= x >> 33;
    return (uint32_t)x;
}
__device__ __forceinline__ float unif(uint64_t seed, uint64_t i) {  // [-1, 1)
    return (float)(hash32(seed * 0x9E3779B97F4A7C15ull + i) >> 8) * (2.f / 16777216.f) - 1.f;
}
// mode 0: n random 32-bit words; 1: n halfs uniform(-a, a); 2: n floats
// uniform(-a, a); 3: n q4 {scale, half2(1024+z)} pairs with scale ~ a and z in
// 0..15; 4: n q8 {scale, 0} pairs with scale ~ a; 5: n floats 1 + a*uniform;
// 6: n bf16 uniform(-a, a); 7: mode 3's groups (the same seed and a) in the
// half form (Q4Group), n words.
extern "C" __global__ void fill_random(void* p, long long n, unsigned long long seed, int mode, float a) {
    PDL_ENTRY();
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        switch (mode) {
        case 0: ((uint32_t*)p)[i] = hash32(seed * 0x9E3779B97F4A7C15ull + i); break;
        case 1: ((__half*)p)[i] = __float2half(a * unif(seed, i)); break;
        case 2: ((float*)p)[i] = a * unif(seed, i); break;
        case 3:
        case 7: {  // the scale an fp16 value in both forms
            float z = (float)(hash32(seed + 77 * i) & 15u);
            __half s = __float2half_rn(a * (1.5f + 0.5f * unif(seed, i)));
            __half2 zh = __float2half2_rn(1024.f + z);
            if (mode == 3) ((float2*)p)[i] = make_float2(__half2float(s), *reinterpret_cast<float*>(&zh));
            else ((__half2*)p)[i] = __halves2half2(s, __low2half(zh));
            break;
        }
        case 4: ((float2*)p)[i] = make_float2(a * (1.5f + 0.5f * unif(seed, i)), 0.f); break;
        case 5: ((float*)p)[i] = 1.f + a * unif(seed, i); break;
        case 6: ((uint16_t*)p)[i] = (uint16_t)(__float_as_uint(a * unif(seed, i)) >> 16); break;
        }
    }
}
