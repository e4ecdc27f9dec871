package gptq

import (
	"testing"

	"qtool/formats/model"
)

// BenchmarkPackUnpack7B packs and unpacks a Llama-2-7B gate/up-sized 4-bit
// weight (11008×4096, group 128): the per-linear work of writing and
// reading a GPTQ checkpoint.
func BenchmarkPackUnpack7B(b *testing.B) {
	const out, in = 11008, 4096
	q := &model.Quantized{Bits: 4, GroupSize: 128, Rows: out, Cols: in, Q: make([]int8, out*in), Scale: make([]float32, out*in/128), Zero: make([]float32, out*in/128)}
	for i := range q.Q {
		q.Q[i] = int8(i%16 - 8)
	}
	for i := range q.Scale {
		q.Scale[i] = 0.01
		q.Zero[i] = float32(i%16 - 8)
	}
	b.Run("pack", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			packWeight(q)
		}
	})
	w := packWeight(q)
	z := packZeros(q)
	s := make([]float32, len(q.Scale))
	b.Run("unpack", func(b *testing.B) {
		for i := 0; i < b.N; i++ {
			unpack(w, z, s, nil, layerOf(q), 1)
		}
	})
}
