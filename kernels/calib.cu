// qtool calibration kernels: the heavy math of GPTQ, AWQ and SmoothQuant on
// the GPU (package runtime/cuda, calibrate.go, drives them). Compiled by
// build.sh to calib_sm80.ptx / calib_sm90.ptx, a module of its own that the
// backend loads on first use, so inference never pays for it.
//
// Conventions as in qtool.cu: row-major matrices, extern "C" kernels looked
// up by name, 64-bit element counts where a tensor can exceed 2^31 values.
//
// Precision: statistics and errors are accumulated in double; the Gram
// matrix (GPTQ's Hessian) and GPTQ's weight updates run in float32 like the
// reference implementation; the Cholesky factorisation and the triangular
// inverse run in double (the reference uses float32; double costs little
// next to the rest and removes the damping retries float32 needs on
// ill-conditioned Hessians).
#include <stdint.h>
#include <cuda_fp16.h>

#define FULL 0xffffffffu

__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}
__device__ __forceinline__ double warp_sum_d(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(FULL, v, o);
    return v;
}
__device__ __forceinline__ float warp_min(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fminf(v, __shfl_xor_sync(FULL, v, o));
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(FULL, v, o));
    return v;
}

// ---------------------------------------------------------------------------
// Rows, statistics, elementwise.

// gather_rows: dst row i = src row idx[i] (cols values each).
extern "C" __global__ void gather_rows(float* __restrict__ dst, const float* __restrict__ src,
                                       const int* __restrict__ idx, int n, int cols) {
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < (long long)n * cols;
         e += (long long)gridDim.x * blockDim.x) {
        long long i = e / cols, c = e - i * cols;
        dst[e] = src[(long long)idx[i] * cols + c];
    }
}

// col_stats: per-column partial statistics of x [rows, cols] over the row
// chunk blockIdx.y (chunk rows each): Σ|x| (double), max|x|, min, max into
// the [gridDim.y, cols] partial arrays. Block (32, 8).
extern "C" __global__ void col_stats(const float* __restrict__ x, long long rows, int cols, long long chunk,
                                     double* __restrict__ psum, float* __restrict__ pmaxabs,
                                     float* __restrict__ pmin, float* __restrict__ pmax) {
    __shared__ double ssum[8][32];
    __shared__ float smaxabs[8][32], smin[8][32], smax[8][32];
    int c = blockIdx.x * 32 + threadIdx.x;
    long long r0 = blockIdx.y * chunk, r1 = min(rows, r0 + chunk);
    double sum = 0;
    float ma = 0, mn = 0, mx = 0;
    if (c < cols) {
        for (long long r = r0 + threadIdx.y; r < r1; r += 8) {
            float v = x[r * cols + c];
            sum += fabs((double)v);
            ma = fmaxf(ma, fabsf(v));
            mn = fminf(mn, v);
            mx = fmaxf(mx, v);
            if (v != v) { ma = v; mn = v; mx = v; } // keep NaN visible
        }
    }
    ssum[threadIdx.y][threadIdx.x] = sum;
    smaxabs[threadIdx.y][threadIdx.x] = ma;
    smin[threadIdx.y][threadIdx.x] = mn;
    smax[threadIdx.y][threadIdx.x] = mx;
    __syncthreads();
    if (threadIdx.y == 0 && c < cols) {
        for (int i = 1; i < 8; i++) {
            sum += ssum[i][threadIdx.x];
            float a = smaxabs[i][threadIdx.x], b = smin[i][threadIdx.x], d = smax[i][threadIdx.x];
            ma = (a != a || ma != ma) ? a + ma : fmaxf(ma, a);
            mn = (b != b || mn != mn) ? b + mn : fminf(mn, b);
            mx = (d != d || mx != mx) ? d + mx : fmaxf(mx, d);
        }
        long long o = (long long)blockIdx.y * cols + c;
        psum[o] = sum;
        pmaxabs[o] = ma;
        pmin[o] = mn;
        pmax[o] = mx;
    }
}

// sq_diff: out[0] += Σ(a−b)² (skipped when a is null), out[1] += Σb².
extern "C" __global__ void sq_diff(const float* __restrict__ a, const float* __restrict__ b, long long n,
                                   double* __restrict__ out) {
    double d = 0, s = 0;
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        double v = b[i];
        s += v * v;
        if (a) {
            double e = (double)a[i] - v;
            d += e * e;
        }
    }
    d = warp_sum_d(d);
    s = warp_sum_d(s);
    __shared__ double sd[32], ss[32];
    int w = threadIdx.x / 32, l = threadIdx.x % 32;
    if (l == 0) { sd[w] = d; ss[w] = s; }
    __syncthreads();
    if (threadIdx.x == 0) {
        for (int i = 1; i < blockDim.x / 32; i++) { d += sd[i]; s += ss[i]; }
        atomicAdd(&out[0], d);
        atomicAdd(&out[1], s);
    }
}

// scale_cols: x[r, c] *= s[c] (or /= s[c] when divide).
extern "C" __global__ void scale_cols(float* __restrict__ x, const float* __restrict__ s, long long rows, int cols, int divide) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < rows * cols; i += (long long)gridDim.x * blockDim.x) {
        float v = s[i % cols];
        x[i] = divide ? x[i] / v : x[i] * v;
    }
}

// diag_f32: out[i] = g[i, i].
extern "C" __global__ void diag_f32(float* __restrict__ out, const float* __restrict__ g, int n) {
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) out[i] = g[(long long)i * n + i];
}

// widen: dst = float of a dense f16 (dt 1) or bf16 (dt 2) weight.
extern "C" __global__ void widen(float* __restrict__ dst, const uint16_t* __restrict__ src, long long n, int dt) {
    for (long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x; i < n; i += (long long)gridDim.x * blockDim.x) {
        uint16_t v = src[i];
        dst[i] = dt == 2 ? __uint_as_float((uint32_t)v << 16) : __half2float(__ushort_as_half(v));
    }
}

// ---------------------------------------------------------------------------
// Matrix products (SIMT): C = alpha·op(A)·op(B) + beta·C, row-major,
// op(A) [M, K], op(B) [K, N]. 64×64 tiles, 16-deep k steps, 256 threads,
// 4×4 outputs per thread. lower: only tiles on or below the diagonal
// (blockIdx.y >= blockIdx.x) are computed.

template <typename T>
__device__ __forceinline__ void gemm_tile(int M, int N, int K, T alpha, const T* __restrict__ A, long long lda, int ta,
                                          const T* __restrict__ B, long long ldb, int tb, T beta, T* __restrict__ C,
                                          long long ldc) {
    __shared__ T As[16][64 + 1];
    __shared__ T Bs[16][64 + 1];
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    int m0 = blockIdx.y * 64, n0 = blockIdx.x * 64;
    T acc[4][4] = {};
    for (int k0 = 0; k0 < K; k0 += 16) {
        for (int e = threadIdx.x; e < 64 * 16; e += 256) {
            int mm, kk;
            if (ta) { mm = e % 64; kk = e / 64; } else { kk = e % 16; mm = e / 16; }
            int gm = m0 + mm, gk = k0 + kk;
            T v = 0;
            if (gm < M && gk < K) v = ta ? A[(long long)gk * lda + gm] : A[(long long)gm * lda + gk];
            As[kk][mm] = v;
            int nn;
            if (tb) { kk = e % 16; nn = e / 16; } else { nn = e % 64; kk = e / 64; }
            int gn = n0 + nn;
            gk = k0 + kk;
            v = 0;
            if (gn < N && gk < K) v = tb ? B[(long long)gn * ldb + gk] : B[(long long)gk * ldb + gn];
            Bs[kk][nn] = v;
        }
        __syncthreads();
#pragma unroll
        for (int kk = 0; kk < 16; kk++) {
            T a[4], b[4];
#pragma unroll
            for (int i = 0; i < 4; i++) { a[i] = As[kk][ty + 16 * i]; b[i] = Bs[kk][tx + 16 * i]; }
#pragma unroll
            for (int i = 0; i < 4; i++)
#pragma unroll
                for (int j = 0; j < 4; j++) acc[i][j] += a[i] * b[j];
        }
        __syncthreads();
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int gm = m0 + ty + 16 * i;
        if (gm >= M) continue;
#pragma unroll
        for (int j = 0; j < 4; j++) {
            int gn = n0 + tx + 16 * j;
            if (gn >= N) continue;
            T* c = &C[(long long)gm * ldc + gn];
            *c = beta == T(0) ? alpha * acc[i][j] : alpha * acc[i][j] + beta * *c;
        }
    }
}

extern "C" __global__ void __launch_bounds__(256) cal_gemm_f32(int M, int N, int K, float alpha, const float* A, long long lda, int ta,
                                                           const float* B, long long ldb, int tb, float beta, float* C, long long ldc, int lower) {
    if (lower && blockIdx.y < blockIdx.x) return;
    gemm_tile<float>(M, N, K, alpha, A, lda, ta, B, ldb, tb, beta, C, ldc);
}

extern "C" __global__ void __launch_bounds__(256) cal_gemm_f64(int M, int N, int K, double alpha, const double* A, long long lda, int ta,
                                                           const double* B, long long ldb, int tb, double beta, double* C, long long ldc, int lower) {
    if (lower && blockIdx.y < blockIdx.x) return;
    gemm_tile<double>(M, N, K, alpha, A, lda, ta, B, ldb, tb, beta, C, ldc);
}

// mirror_lower: g[j, i] = g[i, j] for i > j (completes a Gram matrix whose
// lower triangle was computed).
extern "C" __global__ void mirror_lower(float* __restrict__ g, int n) {
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < (long long)n * n; e += (long long)gridDim.x * blockDim.x) {
        long long i = e / n, j = e % n;
        if (i > j) g[j * n + i] = g[e];
    }
}

// ---------------------------------------------------------------------------
// Cholesky factorisation and inverse (double), for GPTQ's U = chol(H⁻¹)ᵀ:
// with J the reversal, L = chol(J·H·J) lower and X = L⁻¹, U = J·X·J is the
// upper Cholesky factor of H⁻¹.

// build_a: A[i, j] = scale·G[p(n−1−i), p(n−1−j)] with p the permutation
// (identity when perm is null); dead original columns get diagonal 1 (in
// scaled units); damp is added to the diagonal.
extern "C" __global__ void build_a(double* __restrict__ A, const float* __restrict__ G, int n, const int* __restrict__ perm,
                                   const unsigned char* __restrict__ dead, double scale, double damp) {
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < (long long)n * n; e += (long long)gridDim.x * blockDim.x) {
        int i = e / n, j = e % n;
        int pi = n - 1 - i, pj = n - 1 - j;
        if (perm) { pi = perm[pi]; pj = perm[pj]; }
        double v = scale * (double)G[(long long)pi * n + pj];
        if (i == j) {
            if (dead[pi]) v = 1;
            v += damp;
        }
        A[e] = v;
    }
}

// potrf_diag: factorises the kb×kb diagonal block at (k, k) of A (lower,
// in place) and writes its inverse (lower) to D [kb, 64]. info is set to
// the 1-based index of the first non-positive pivot. One block of 256
// threads, kb <= 64.
extern "C" __global__ void __launch_bounds__(256) potrf_diag(double* __restrict__ A, int lda, int k, int kb, double* __restrict__ D,
                                                             int* __restrict__ info) {
    __shared__ double s[64][65];
    for (int e = threadIdx.x; e < kb * kb; e += blockDim.x) {
        int i = e / kb, j = e % kb;
        s[i][j] = A[(long long)(k + i) * lda + k + j];
    }
    __syncthreads();
    __shared__ int bad;
    if (threadIdx.x == 0) bad = 0;
    __syncthreads();
    for (int j = 0; j < kb; j++) {
        if (threadIdx.x == 0) {
            double d = s[j][j];
            if (!(d > 0) || bad) {
                if (!bad) atomicCAS(info, 0, k + j + 1);
                bad = 1;
                d = 1;
            }
            s[j][j] = sqrt(d);
        }
        __syncthreads();
        double djj = s[j][j];
        for (int i = j + 1 + threadIdx.x; i < kb; i += blockDim.x) s[i][j] /= djj;
        __syncthreads();
        // trailing update of the lower part
        for (int e = threadIdx.x; e < (kb - j - 1) * (kb - j - 1); e += blockDim.x) {
            int i = j + 1 + e / (kb - j - 1), c = j + 1 + e % (kb - j - 1);
            if (c <= i) s[i][c] -= s[i][j] * s[c][j];
        }
        __syncthreads();
    }
    // inverse of the lower triangular factor into D, column by column
    // (forward substitution of the unit vectors), one thread a column: each
    // thread reads back only what it wrote itself
    for (int c = threadIdx.x; c < kb; c += blockDim.x) {
        for (int i = 0; i < c; i++) D[i * 64 + c] = 0;
        for (int i = c; i < kb; i++) {
            double v = i == c ? 1.0 : 0.0;
            for (int t = c; t < i; t++) v -= s[i][t] * D[t * 64 + c];
            D[i * 64 + c] = v / s[i][i];
        }
    }
    for (int e = threadIdx.x; e < kb * kb; e += blockDim.x) {
        int i = e / kb, j = e % kb;
        if (j <= i) A[(long long)(k + i) * lda + k + j] = s[i][j];
    }
}

// extract_u: U[i, j] = X[n−1−i, n−1−j] (float) for j >= i, else 0.
extern "C" __global__ void extract_u(float* __restrict__ U, const double* __restrict__ X, int n) {
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < (long long)n * n; e += (long long)gridDim.x * blockDim.x) {
        int i = e / n, j = e % n;
        U[e] = j >= i ? (float)X[(long long)(n - 1 - i) * n + (n - 1 - j)] : 0.f;
    }
}

// copy_block_f64: dst[i*ldd + j] = src[i*lds + j] for i < rows, j < cols.
extern "C" __global__ void copy_block_f64(double* __restrict__ dst, long long ldd, const double* __restrict__ src, long long lds,
                                          int rows, int cols) {
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < (long long)rows * cols; e += (long long)gridDim.x * blockDim.x) {
        long long i = e / cols, j = e % cols;
        dst[i * ldd + j] = src[i * lds + j];
    }
}

// ---------------------------------------------------------------------------
// GPTQ (float32, the reference's precision).

struct Grid {
    float maxq;
    int sym, fp16, search;
};

__device__ __forceinline__ float fp16_round(float s) {
    float v = __half2float(__float2half_rn(s));
    return v < 6.103515625e-05f ? 6.103515625e-05f : v;
}

__device__ __forceinline__ void grid_params(const Grid& g, float lo, float hi, float& s, float& z) {
    s = (hi - lo) / g.maxq;
    if (g.fp16) s = fp16_round(s);
    z = g.sym ? (g.maxq + 1) / 2 : rintf(-lo / s);
}

__device__ __forceinline__ float grid_quant(const Grid& g, float x, float s, float z, float& dq) {
    float q = rintf(x / s) + z;
    q = fminf(fmaxf(q, 0.f), g.maxq);
    dq = s * (q - z);
    return q;
}

// gptq_prep: W[r, i] = Wsrc[r, p(i)], 0 for dead columns.
extern "C" __global__ void gptq_prep(float* __restrict__ W, const float* __restrict__ Wsrc, int rows, int cols,
                                     const int* __restrict__ perm, const unsigned char* __restrict__ dead) {
    for (long long e = blockIdx.x * (long long)blockDim.x + threadIdx.x; e < (long long)rows * cols; e += (long long)gridDim.x * blockDim.x) {
        long long r = e / cols;
        int i = e % cols, c = perm ? perm[i] : i;
        W[e] = dead[c] ? 0.f : Wsrc[r * cols + c];
    }
}

// gptq_fit: per row (one warp each), the grid of columns [c0, c0+gs) of W
// (row stride cols): the min/max range including 0, shrunk by the search
// (1, 0.99, …, 0.21) to the smallest error when search is 1 (Σ|w−q|^2.4)
// or 2 (Σ hdiag_c·(w−q)²). Writes scale and zero at out[r*ostride + oidx].
extern "C" __global__ void gptq_fit(const float* __restrict__ W, int rows, int cols, int c0, int gs, float maxq, int sym,
                                    int fp16, int search, const float* __restrict__ hdiag, float* __restrict__ scale, float* __restrict__ zero,
                                    int ostride, int oidx) {
    Grid g = {maxq, sym, fp16, search};
    int warps = blockDim.x / 32;
    int r = blockIdx.x * warps + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (r >= rows) return;
    const float* w = W + (long long)r * cols + c0;
    float lo = 0, hi = 0;
    for (int c = lane; c < gs; c += 32) { lo = fminf(lo, w[c]); hi = fmaxf(hi, w[c]); }
    lo = warp_min(lo);
    hi = warp_max(hi);
    if (g.sym) {
        hi = fmaxf(-lo, hi);
        if (lo < 0) lo = -hi;
    }
    if (lo == 0 && hi == 0) { lo = -1; hi = 1; }
    float bs, bz;
    grid_params(g, lo, hi, bs, bz);
    if (g.search) {
        float best = INFINITY;
        for (int i = 0; i < 80; i++) {
            float p = 1 - (float)i / 100;
            float s, z;
            grid_params(g, p * lo, p * hi, s, z);
            float e = 0;
            for (int c = lane; c < gs; c += 32) {
                float dq;
                grid_quant(g, w[c], s, z, dq);
                float d = fabsf(w[c] - dq);
                e += g.search == 1 ? powf(d, 2.4f) : hdiag[c0 + c] * d * d;
            }
            e = warp_sum(e);
            if (e < best) { best = e; bs = s; bz = z; }
        }
    }
    if (lane == 0) {
        scale[(long long)r * ostride + oidx] = bs;
        zero[(long long)r * ostride + oidx] = bz;
    }
}

// gptq_block: GPTQ's column loop over columns [i1, i1+bs) of W (bs <= 128,
// a multiple of 32), one warp per row, U's diagonal block in shared memory.
// Parameters: the current grid cs/cz [rows] (static: per original group,
// ss/sz [rows, ngroups], looked up through perm). Writes the codes, the
// scaled errors Err [rows, bs] and adds the loss.
#define GPTQ_ROWS 8
extern "C" __global__ void __launch_bounds__(32 * GPTQ_ROWS) gptq_block(
    float* __restrict__ W, int rows, int cols, int i1, int bs, const float* __restrict__ U, float maxq, int sym, int fp16,
    const float* __restrict__ cs, const float* __restrict__ cz, int isStatic, const int* __restrict__ perm, int gs, int ngroups,
    uint8_t* __restrict__ codes, float* __restrict__ Err, double* __restrict__ loss) {
    Grid g = {maxq, sym, fp16, 0};
    extern __shared__ float Us[]; // [bs, bs]
    for (int e = threadIdx.x; e < bs * bs; e += blockDim.x) {
        int i = e / bs, j = e % bs;
        Us[e] = U[(long long)(i1 + i) * cols + i1 + j];
    }
    __syncthreads();
    int r = blockIdx.x * GPTQ_ROWS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (r >= rows) return;
    float wv[4];
    float* wr = W + (long long)r * cols + i1;
#pragma unroll
    for (int k = 0; k < 4; k++) wv[k] = lane + 32 * k < bs ? wr[lane + 32 * k] : 0.f;
    float s = 0, z = 0;
    if (!isStatic) { s = cs[r]; z = cz[r]; }
    double lsum = 0;
#pragma unroll
    for (int slot = 0; slot < 4; slot++) {
        for (int o = 0; o < 32; o++) {
            int i = slot * 32 + o;
            if (i >= bs) break;
            float x = __shfl_sync(FULL, wv[slot], o);
            if (isStatic) {
                int gi = perm[i1 + i] / gs;
                s = cs[(long long)r * ngroups + gi];
                z = cz[(long long)r * ngroups + gi];
            }
            float dq;
            float q = grid_quant(g, x, s, z, dq);
            float d = Us[i * bs + i];
            float e = (x - dq) / d;
            if (lane == 0) {
                codes[(long long)r * cols + i1 + i] = (uint8_t)q;
                Err[(long long)r * bs + i] = e;
                lsum += (double)e * e / 2;
            }
#pragma unroll
            for (int k = 0; k < 4; k++) {
                int j = lane + 32 * k;
                if (j > i && j < bs) wv[k] -= e * Us[i * bs + j];
            }
        }
    }
    if (lane == 0) atomicAdd(loss, lsum);
}

// ---------------------------------------------------------------------------
// AWQ.

// awq_group_quant: AWQ's asymmetric rule on the gs values v of one group
// (one value per lane slot), writing the dequantized values back into v.
// s = max(max−min, 1e−5)/umax, z = clamp(−round(min/s), 0, umax), then
// (unless fp32) s rounded to fp16; u = clamp(round(v/s)+z, 0, umax).
template <int PER>
__device__ __forceinline__ void awq_group_quant(float (&v)[PER], int n, int lane, float umax, int fp32) {
    float lo = INFINITY, hi = -INFINITY;
#pragma unroll
    for (int k = 0; k < PER; k++)
        if (lane + 32 * k < n) { lo = fminf(lo, v[k]); hi = fmaxf(hi, v[k]); }
    lo = warp_min(lo);
    hi = warp_max(hi);
    float s = fmaxf(hi - lo, 1e-5f) / umax;
    float z = fminf(fmaxf(-rintf(lo / s), 0.f), umax);
    if (!fp32) s = fp16_round(s);
#pragma unroll
    for (int k = 0; k < PER; k++) {
        float u = fminf(fmaxf(rintf(v[k] / s) + z, 0.f), umax);
        v[k] = (u - z) * s;
    }
}

// awq_fakequant: dst = Q(w·diag(cs))·diag(cs)⁻¹ (cs null: ones) per
// (row, group of gs <= 256 columns), one warp per (row, group).
extern "C" __global__ void awq_fakequant(float* __restrict__ dst, const float* __restrict__ w, const float* __restrict__ cs,
                                         int rows, int cols, int gs, float umax, int fp32) {
    int warps = blockDim.x / 32;
    long long item = (long long)blockIdx.x * warps + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    int G = cols / gs;
    if (item >= (long long)rows * G) return;
    long long r = item / G;
    int c0 = (item % G) * gs;
    float v[8];
#pragma unroll
    for (int k = 0; k < 8; k++) {
        int c = lane + 32 * k;
        v[k] = c < gs ? w[r * cols + c0 + c] * (cs ? cs[c0 + c] : 1.f) : 0.f;
    }
    awq_group_quant<8>(v, gs, lane, umax, fp32);
#pragma unroll
    for (int k = 0; k < 8; k++) {
        int c = lane + 32 * k;
        if (c < gs) dst[r * cols + c0 + c] = cs ? v[k] / cs[c0 + c] : v[k];
    }
}

// awq_clip: per (row, group) the clipping threshold max|w|·(1 − i/grid),
// i < steps, minimising dᵀ·G_g·d, d = Q(clip(w)) − w over the group's gs
// (<= 128) columns and G_g the group's diagonal block of gram. Grid:
// (ceil(rows/8), groups); 8 warps per block; G_g in shared memory.
extern "C" __global__ void __launch_bounds__(256) awq_clip(const float* __restrict__ w, const float* __restrict__ gram,
                                                           int rows, int cols, int gs, float umax, int fp32, int grid,
                                                           int steps, float* __restrict__ best) {
    extern __shared__ float sm[];
    float* Gs = sm;               // [gs, gs]
    float* ds = sm + gs * gs;     // [8][gs]
    int g = blockIdx.y, c0 = g * gs;
    for (int e = threadIdx.x; e < gs * gs; e += blockDim.x) {
        int i = e / gs, j = e % gs;
        Gs[e] = gram[(long long)(c0 + i) * cols + c0 + j];
    }
    __syncthreads();
    int wi = threadIdx.x / 32, lane = threadIdx.x % 32;
    int r = blockIdx.x * 8 + wi;
    if (r >= rows) return;
    float wv[4];
    float ma = 0;
#pragma unroll
    for (int k = 0; k < 4; k++) {
        int c = lane + 32 * k;
        wv[k] = c < gs ? w[(long long)r * cols + c0 + c] : 0.f;
        if (c < gs) ma = fmaxf(ma, fabsf(wv[k]));
    }
    ma = warp_max(ma);
    float* d = ds + wi * gs;
    float bestErr = INFINITY, bestVal = 0;
    for (int i = 0; i < steps; i++) {
        float m = ma * (1 - (float)i / grid);
        float v[4];
#pragma unroll
        for (int k = 0; k < 4; k++) v[k] = fminf(fmaxf(wv[k], -m), m);
        awq_group_quant<4>(v, gs, lane, umax, fp32);
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int c = lane + 32 * k;
            if (c < gs) d[c] = v[k] - wv[k];
        }
        __syncwarp();
        double e = 0;
#pragma unroll
        for (int k = 0; k < 4; k++) {
            int a = lane + 32 * k;
            if (a >= gs) continue;
            float acc = 0;
            for (int b = 0; b < gs; b++) acc += Gs[a * gs + b] * d[b];
            e += (double)d[a] * acc;
        }
        e = warp_sum_d(e);
        __syncwarp();
        if (e < bestErr) { bestErr = e; bestVal = m; }
    }
    if (lane == 0) best[(long long)r * (cols / gs) + g] = bestVal;
}
