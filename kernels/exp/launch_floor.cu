// launch_floor.cu: the fixed cost of one link in a chain of dependent
// launches, as `bench` times a GEMV (TimeDecodeGEMV: a replayed graph of 20
// launches, programmatic dependent launch, weights cycling through copies
// that exceed L2), and how close a launch that reads a one-row product's
// bytes, in several ways but without its arithmetic, comes to the copy
// bandwidth in such a chain (what the GEMV criterion's 4 096² shapes are
// measured against). launch_floor_host.cpp runs it (see there and
// kernels/exp/README.md). Not qtool's kernels, but written with its
// helpers (pdl_wait, pdl_trigger, ldg_stream, the mbarrier ones: sm_90a);
// nothing here is embedded.
#include "../qtool.cu"

// An empty kernel, launched with or without the PDL attribute (the host
// chooses); PDL: waits for its predecessor, then lets its successor launch.
extern "C" __global__ void empty_plain() {}
extern "C" __global__ void empty_pdl() {
    pdl_wait();
    pdl_trigger();
}

// stage_x copies x's K floats (K <= 4 096) into shared memory xs with all
// of a thread's loads issued at once (four float4: one round trip), then
// waits for the block.
__device__ __forceinline__ void stage_x(float* xs, const float* __restrict__ x, int K) {
    const int tid = threadIdx.x;
    float4 t[4];
#pragma unroll
    for (int i = 0; i < 4; i++) {
        int k = tid + 256 * i;
        t[i] = k < K / 4 ? reinterpret_cast<const float4*>(x)[k] : make_float4(0.f, 0.f, 0.f, 0.f);
    }
#pragma unroll
    for (int i = 0; i < 4; i++)
        if (tid + 256 * i < K / 4) reinterpret_cast<float4*>(xs)[tid + 256 * i] = t[i];
    __syncthreads();
}
// store_link reduces the threads' words h over the block (256 threads) and
// has its first 16 threads store y[16·block + t] (within K), each depending
// on the block's words and on x.
__device__ __forceinline__ void store_link(uint32_t h, const float* xs, float* __restrict__ y, int K) {
    __shared__ uint32_t red[8];
    const int tid = threadIdx.x;
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) h ^= __shfl_xor_sync(0xffffffffu, h, o);
    if ((tid & 31) == 0) red[tid >> 5] = h;
    __syncthreads();
    if (tid < 16) {
        uint32_t t = 0;
        for (int i = 0; i < 8; i++) t ^= red[i];
        int n = blockIdx.x * 16 + tid;
        // (t & 1) keeps the words live; the value stays x's scale
        if (n < K) y[n] = xs[n] * 0.5f + (float)(t & 1) * 1e-30f;
    }
}

// link: one link of the chain (blocks of 256 threads, K <= 4 096). Each
// thread reads U 16-byte words of w (coalesced: word i of the block's run
// at i·blockDim + tid), before the wait (AHEAD) or after it; after the
// wait the block stages x's K floats (the predecessor's y) in shared
// memory in one round trip, as a GEMV stages its row, and its first 16
// threads store y[16·block + t] (within K), each depending on every word
// the block read and on x. So a link has a one-row product's memory
// traffic and critical path — the wait, x's round trip, a barrier, the
// reduction, the store — without its arithmetic. EARLY: the link lets its
// successor launch before it waits (qtool's kernels let it after: a
// kernel may read before its wait what the kernel two launches back
// wrote). nw: the words of w (past them a thread reads nothing).
template <int U, bool AHEAD, bool EARLY = false>
__device__ __forceinline__ void link_body(const uint4* __restrict__ w, long nw, const float* __restrict__ x,
                                          float* __restrict__ y, int K) {
    extern __shared__ float xs[];
    const int tid = threadIdx.x;
    const long base = (long)blockIdx.x * blockDim.x * U + tid;
    uint4 v[U];
    auto load = [&] {
#pragma unroll
        for (int i = 0; i < U; i++) {
            long j = base + (long)i * blockDim.x;
            v[i] = j < nw ? ldg_stream(w + j) : make_uint4(0, 0, 0, 0);
        }
    };
    if (EARLY) pdl_trigger();  // the successor may launch before this link's predecessor ends
    if (AHEAD) load();
    pdl_wait();
    if (!EARLY) pdl_trigger();
    if (!AHEAD) load();
    stage_x(xs, x, K);
    uint32_t h = 0;
#pragma unroll
    for (int i = 0; i < U; i++) h ^= v[i].x ^ v[i].y ^ v[i].z ^ v[i].w;
    store_link(h, xs, y, K);
}

#define LINK(name, U, AHEAD, EARLY)                                                                  \
    extern "C" __global__ void __launch_bounds__(256) name(const uint4* w, long nw, const float* x, \
                                                           float* y, int K) {                      \
        link_body<U, AHEAD, EARLY>(w, nw, x, y, K);                                                  \
    }
LINK(link_u4_ahead, 4, true, false)
LINK(link_u4_after, 4, false, false)
LINK(link_u8_ahead, 8, true, false)
LINK(link_u8_after, 8, false, false)
LINK(link_u16_ahead, 16, true, false)
LINK(link_u16_after, 16, false, false)
LINK(link_u0, 1, false, false)  // with nw = 0: x's stage and the store alone
LINK(link_u4_early, 4, true, true)
LINK(link_u8_early, 8, true, true)
LINK(link_u16_early, 16, true, true)
LINK(link_u0_early, 1, false, true)

// bulk_body: the most bytes in flight before the wait a one-row product
// can have: each block's run of w (per bytes, a multiple of 16) copied
// into its shared memory by the bulk-copy engine (cp.async.bulk, an
// mbarrier counting the bytes), issued before the wait (and, EARLY, after
// letting the successor launch), then x staged, then the run read back
// from shared memory. Dynamic shared memory: 16 KB for x, then the run.
template <bool EARLY>
__device__ __forceinline__ void bulk_body(const unsigned char* __restrict__ w, long nbytes, const float* __restrict__ x,
                                          float* __restrict__ y, int K, int per) {
    extern __shared__ __align__(128) unsigned char sm[];
    float* xs = reinterpret_cast<float*>(sm);
    unsigned char* ws = sm + 16384;
    __shared__ __align__(8) uint64_t bar;
    const int tid = threadIdx.x;
    const long off = (long)blockIdx.x * per;
    const int n = (int)max(0L, min((long)per, nbytes - off));
    if (tid == 0) {
        mbar_init(smem_u32(&bar), 1);
        asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    }
    __syncthreads();
    if (EARLY) pdl_trigger();
    if (tid == 0) {
        mbar_expect_tx(smem_u32(&bar), n);
        constexpr int CH = 16384;
        for (int o = 0; o < n; o += CH)
            asm volatile(
                "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                    smem_u32(ws + o)),
                "l"(w + off + o), "r"(min(CH, n - o)), "r"(smem_u32(&bar))
                : "memory");
    }
    pdl_wait();
    if (!EARLY) pdl_trigger();
    stage_x(xs, x, K);
    mbar_wait(smem_u32(&bar), 0);
    uint32_t h = 0;
    for (int i = tid * 16; i < n; i += 256 * 16) {
        uint4 v = *reinterpret_cast<const uint4*>(ws + i);
        h ^= v.x ^ v.y ^ v.z ^ v.w;
    }
    store_link(h, xs, y, K);
}
extern "C" __global__ void __launch_bounds__(256) bulk_ahead(const unsigned char* w, long nbytes, const float* x,
                                                             float* y, int K, int per) {
    bulk_body<false>(w, nbytes, x, y, K, per);
}
extern "C" __global__ void __launch_bounds__(256) bulk_early(const unsigned char* w, long nbytes, const float* x,
                                                             float* y, int K, int per) {
    bulk_body<true>(w, nbytes, x, y, K, per);
}
