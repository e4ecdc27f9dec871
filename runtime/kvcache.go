package runtime

import (
	"fmt"
	"math"

	"qtool/formats/model"
)

// KVQuant is the int8 quantizer of one layer's KV cache (msmodelslim C8):
// for channel c of the keys (values) as they are cached, after RoPE,
//
//	cache_int = clamp(round(x/KScale[c] + KOffset[c]), −128, 127)
//	x̂         = (cache_int − KOffset[c]) · KScale[c]
//
// each step rounded to float32 (QuantizeKV, DequantizeKV). All four slices
// have the model's KV width.
type KVQuant struct {
	KScale, KOffset, VScale, VOffset []float32
}

// QuantizeKV is the document's cache_int = round(x/scale + offset), with
// the division and the addition rounded to float32, rounding half to even
// and saturating to int8.
func QuantizeKV(x, scale, offset float32) int8 {
	q := math.RoundToEven(float64(x/scale + offset))
	return int8(max(-128, min(127, q)))
}

// DequantizeKV is the document's (cache_int − offset) · scale in float32.
func DequantizeKV(q int8, scale, offset float32) float32 {
	return (float32(q) - offset) * scale
}

// Int8KVBackend is a backend that can hold an int8 KV cache.
type Int8KVBackend interface {
	// NewInt8KVCache allocates a cache for len(layers) layers × maxSeq
	// positions of kvDim keys and values stored as int8 with the layers'
	// quantizers; StoreKV quantizes and Attention dequantizes them.
	NewInt8KVCache(maxSeq, kvDim int, layers []KVQuant) (KVCache, error)
}

// Validate checks the lengths (kvDim each) and that the scales are
// positive and finite and the offsets finite.
func (q *KVQuant) Validate(kvDim int) error {
	for _, p := range []struct {
		name  string
		v     []float32
		scale bool
	}{{"k scale", q.KScale, true}, {"k offset", q.KOffset, false}, {"v scale", q.VScale, true}, {"v offset", q.VOffset, false}} {
		if len(p.v) != kvDim {
			return fmt.Errorf("KV-cache %s has %d values, want %d", p.name, len(p.v), kvDim)
		}
		for c, x := range p.v {
			if math.IsNaN(float64(x)) || math.IsInf(float64(x), 0) || p.scale && x <= 0 {
				return fmt.Errorf("KV-cache %s of channel %d is %g, want a positive finite scale (finite offset)", p.name, c, x)
			}
		}
	}
	return nil
}

// kvQuantOf reads the int8 KV-cache quantizers of m (nil when it has none).
func kvQuantOf(m *model.Model) ([]KVQuant, error) {
	if !m.HasKVCacheInt8() {
		return nil, nil
	}
	c := m.Config
	out := make([]KVQuant, c.Layers)
	for l := range out {
		q := &out[l]
		for i, dst := range []*[]float32{&q.KScale, &q.KOffset, &q.VScale, &q.VOffset} {
			name := model.Name(l, model.KVCacheRoles[i])
			t, err := m.Get(name)
			if err != nil {
				return nil, err
			}
			if *dst, err = t.Float32(); err != nil {
				return nil, fmt.Errorf("runtime: %s: %w", name, err)
			}
		}
		if err := q.Validate(c.KVDim()); err != nil {
			return nil, fmt.Errorf("runtime: layer %d: %w", l, err)
		}
	}
	return out, nil
}
