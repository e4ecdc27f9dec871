package calib

import (
	"fmt"

	"qtool/formats/model"
	"qtool/runtime"
)

// kvRange accumulates the per-channel range of one layer's keys and
// values over the calibration windows.
type kvRange struct {
	kMin, kMax, vMin, vMax []float32
}

func (r *kvRange) add(k, v runtime.ColumnStats) {
	if r.kMin == nil {
		r.kMin, r.kMax = append([]float32(nil), k.Min...), append([]float32(nil), k.Max...)
		r.vMin, r.vMax = append([]float32(nil), v.Min...), append([]float32(nil), v.Max...)
		return
	}
	for c := range r.kMin {
		r.kMin[c], r.kMax[c] = min(r.kMin[c], k.Min[c]), max(r.kMax[c], k.Max[c])
		r.vMin[c], r.vMax[c] = min(r.vMin[c], v.Min[c]), max(r.vMax[c], v.Max[c])
	}
}

// TrackKVCache makes the session calibrate an int8 KV cache (msmodelslim
// C8): after each layer is quantized, its keys and values as the runtime
// caches them (after the k norm and RoPE, from the installed weights and
// the quantized model's residual stream) are run over every calibration
// window, and the per-channel range [min, max] gives the quantizer
// KVCacheParams computes; Out then holds model.KVCacheRoles for every
// layer. Call it before Run.
func (s *Session) TrackKVCache() { s.kv = true }

// KVCacheParams returns the int8 quantizer of a channel with range
// [lo, hi]: asymmetric min/max over the 256 codes, scale = (hi − lo)/255
// and offset = −128 − lo/scale, so that lo maps to −128 and hi to 127 in
// cache_int = round(x/scale + offset). A channel whose range is (nearly)
// a point gets scale max(|lo|, |hi|, 1e-6)/127 and offset 0.
func KVCacheParams(lo, hi float32) (scale, offset float32) {
	span := float64(hi) - float64(lo)
	m := max(abs32(lo), abs32(hi), 1e-6)
	if span <= float64(m)*1e-6 {
		return m / 127, 0
	}
	scale = float32(span / 255)
	return scale, float32(-128 - float64(lo)/float64(scale))
}

func abs32(x float32) float32 {
	if x < 0 {
		return -x
	}
	return x
}

// calibrateKV measures layer l's keys and values (see TrackKVCache) from
// its input x, the residual stream before the layer, and installs the
// quantizers in Out.
func (s *Session) calibrateKV(l int, x runtime.Buf) error {
	be, T := s.be, s.seqLen
	xw := be.Alloc(T, s.Cfg.Hidden)
	defer be.Free(xw)
	var r kvRange
	for r0 := 0; r0 < x.Rows(); r0 += T {
		be.CopyRows(xw, 0, x, r0, T)
		h := s.RT.AttnNorm(l, xw)
		k, v := s.RT.KV(l, h, 0, nil)
		be.Free(h)
		r.add(be.ColumnStats(k), be.ColumnStats(v))
		be.Free(k)
		be.Free(v)
	}
	kvDim := s.Cfg.KVDim()
	vals := [4][]float32{make([]float32, kvDim), make([]float32, kvDim), make([]float32, kvDim), make([]float32, kvDim)}
	for c := 0; c < kvDim; c++ {
		vals[0][c], vals[1][c] = KVCacheParams(r.kMin[c], r.kMax[c])
		vals[2][c], vals[3][c] = KVCacheParams(r.vMin[c], r.vMax[c])
	}
	for i, role := range model.KVCacheRoles {
		name := model.Name(l, role)
		s.Out.Set(name, model.FromFloat32([]int{kvDim}, vals[i]))
		s.touch(name)
	}
	q := runtime.KVQuant{KScale: vals[0], KOffset: vals[1], VScale: vals[2], VOffset: vals[3]}
	if err := q.Validate(kvDim); err != nil {
		return fmt.Errorf("layer %d: %w (non-finite keys or values)", l, err)
	}
	return nil
}
