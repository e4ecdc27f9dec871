package cuda

import (
	"qtool/formats/model"
	"qtool/runtime"
	"qtool/runtime/cuda/driver"
)

// segsKVKernels are the q/k/v segs GEMMs with RoPE and the KV store fused
// into their epilogue (qtool.cu's GEMM_WG_SEGS_KV_ENTRY and
// gemm_wg_s8_segs_kv), by the segs kernel they stand for.
var segsKVKernels = map[string]string{"gemm_wg_f16_segs": "gemm_wg_f16_segs_kv", "gemm_wg_q4_segs": "gemm_wg_q4_segs_kv",
	w8a8SegsKernel: "gemm_wg_s8_segs_kv"}

// qkvStore is where a segs launch of q, k and v puts its results with RoPE
// and the KV store fused (qtool.cu's QKVSink): the fp16 cache rows of one
// layer, the cache's table of angles, the first position, the head size
// and the RoPE layout. done records that a launch did.
type qkvStore struct {
	kc, vc, tab    driver.DevicePtr
	pos0, hd, rope int
	done           bool
}

// args are the kernel arguments after the products'.
func (s *qkvStore) args() []any {
	return []any{s.kc, s.vc, s.tab, s.pos0, s.hd, s.rope}
}

// NormMatMulStoreKV implements runtime.Fused: where one Hopper segs launch
// takes q, k and v (wgSegs, w8a8WGSegs) its epilogue rotates q and k with
// the cache's table of angles (ropeTable) and stores k and v into the fp16
// cache (qtool.cu's gemm_wg_*_segs_kv; the rotation and rounding
// store_kv_f16's bit for bit): no store_kv launch, k and v never in memory
// as floats. Up to kvSegsMaxRows rows the products go in that launch even
// where the sequence runs them one by one, K split through memory (fp16,
// 4-bit): their sums then differ in float32 rounding, as runtime.Fused
// allows. Otherwise, or for a cache or shape the epilogue does not take
// (qkvStoreFor), the sequence.
func (b *Backend) NormMatMulStoreKV(qkv []runtime.Buf, x runtime.Buf, w, bias runtime.Vector, eps float32, ws []runtime.Linear, kv runtime.RoPEKV) {
	st := b.qkvStoreFor(qkv, kv)
	if st == nil {
		runtime.NormMatMulStoreKVSeq(b, qkv, x, w, bias, eps, ws, kv)
		return
	}
	s, segs := b.segments("NormMatMulStoreKV", qkv, x, ws)
	func() {
		defer b.enter()()
		if b.normStreamed("NormMatMulStoreKV", s, segs, w, bias, eps, gemvStore) {
			return
		}
		in := b.normed(s, segs, w, bias, eps)
		in.kv = st
		b.matmulN(in, segs)
	}()
	if !st.done {
		b.RoPEStoreKV(kv.Cache, kv.Layer, kv.Pos0, qkv[0], qkv[1], qkv[2], kv.HeadDim, kv.Theta, kv.Layout)
	}
}

// qkvStoreFor is the fused store of the products q, k, v = qkv into
// kv, or nil where the segs epilogue cannot take it: a cache not of fp16,
// a graph capture (positions from the device, no table made), positions
// past the cache, heads other than 64 or 128 values, products not whole
// 128-column tiles of heads (every warp of the epilogue a row of whole
// heads), or a cache whose table of angles (ropeTable, made here where
// there is none) is of another head size or theta.
func (b *Backend) qkvStoreFor(qkv []runtime.Buf, kv runtime.RoPEKV) *qkvStore {
	if !b.wgmma || b.capturing || len(qkv) != 3 {
		return nil
	}
	kc := cache(kv.Cache)
	q, k, v := buf(qkv[0]), buf(qkv[1]), buf(qkv[2])
	hd := kv.HeadDim
	switch {
	case !kc.half || kc.quant != 0:
		return nil
	case hd != 64 && hd != 128, kv.Layout != model.RopeHalf && kv.Layout != model.RopeInterleaved:
		return nil
	case q.cols%128 != 0 || k.cols != kc.kvDim || v.cols != kc.kvDim || kc.kvDim%128 != 0:
		return nil
	case q.rows != k.rows || k.rows != v.rows || kv.Layer < 0 || kv.Layer >= kc.layers:
		return nil
	case kv.Pos0 < 0 || kv.Pos0+q.rows > kc.maxSeq:
		return nil
	}
	tab, _ := b.ropeTable(kc, hd, kv.Theta) // made just now or not: the GEMM reads it after its wait
	if tab == 0 {
		return nil
	}
	off := kc.layerOff(kv.Layer)
	return &qkvStore{kc: kc.k + off, vc: kc.v + off, tab: tab, pos0: kv.Pos0, hd: hd, rope: int(kv.Layout)}
}
