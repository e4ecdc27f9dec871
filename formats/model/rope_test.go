package model

import (
	"math/rand"
	"reflect"
	"testing"
)

// TestWithRope permutes every kind of q/k tensor (dense weights and
// biases, per-group int4 with zeros and g_idx, per-channel W8A8 with its
// DeqScale/QuantBias/Bias, Qwen3 q/k norms) to the interleaved layout and
// back: the round trip must give the tensors back exactly, each step must
// move whole rows with their parameters (the dequantized rows follow the
// permutation), and tensors other than q/k must be shared untouched.
func TestWithRope(t *testing.T) {
	rng := rand.New(rand.NewSource(1))
	cfg := Config{Arch: Qwen2, Hidden: 16, Intermediate: 32, Layers: 1, Heads: 4, KVHeads: 2, HeadDim: 4, Vocab: 8,
		RopeTheta: 1e4, NormEps: 1e-6, AttnBias: true, QKNorm: true}
	floats := func(n int) []float32 {
		v := make([]float32, n)
		for i := range v {
			v[i] = rng.Float32()*2 - 1
		}
		return v
	}
	quant := func(rows, cols, group int, zeros, gidx bool) *Quantized {
		q := &Quantized{Bits: 4, GroupSize: group, Rows: rows, Cols: cols, Q: make([]int8, rows*cols)}
		for i := range q.Q {
			q.Q[i] = int8(rng.Intn(16) - 8)
		}
		q.Scale = floats(rows * q.Groups())
		if zeros {
			q.Zero = floats(rows * q.Groups())
		}
		if gidx {
			q.GIdx = make([]int32, cols)
			for c := range q.GIdx {
				q.GIdx[c] = int32(rng.Intn(q.Groups()))
			}
		}
		return q
	}
	qd, kvd := cfg.QDim(), cfg.KVDim()
	cases := []struct {
		name string
		role Role
		t    Tensor
	}{
		{"dense f32 q", Q, FromFloat32([]int{qd, 16}, floats(qd*16))},
		{"dense f16 k", K, &Dense{DType: F16, Dims: []int{kvd, 16}, Data: f16Data(floats(kvd * 16))}},
		{"int4 asym g8 act-order q", Q, quant(qd, 16, 8, true, true)},
		{"int4 sym per-channel k", K, quant(kvd, 16, 0, false, false)},
		{"w8a8 q with bias", Q, &W8A8{Weight: &Quantized{Bits: 8, Rows: qd, Cols: 16, Q: make([]int8, qd*16), Scale: floats(qd)},
			InputScale: 0.1, DeqScale: floats(qd), QuantBias: []int32{1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16}, Bias: floats(qd)}},
		{"q bias", QBias, FromFloat32([]int{qd}, floats(qd))},
		{"k bias", KBias, FromFloat32([]int{kvd}, floats(kvd))},
		{"q norm", QNorm, FromFloat32([]int{4}, floats(4))},
		{"k norm", KNorm, FromFloat32([]int{4}, floats(4))},
		{"v untouched", V, FromFloat32([]int{kvd, 16}, floats(kvd*16))},
	}
	m := New(cfg)
	for _, c := range cases {
		m.Set(Name(0, c.role), c.t)
	}
	il, err := WithRope(m, RopeInterleaved)
	if err != nil {
		t.Fatal(err)
	}
	back, err := WithRope(il, RopeHalf)
	if err != nil {
		t.Fatal(err)
	}
	if il.Config.Rope != RopeInterleaved || back.Config.Rope != RopeHalf {
		t.Fatalf("layouts %s, %s", il.Config.Rope, back.Config.Rope)
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			name := Name(0, c.role)
			orig, _ := m.Lookup(name)
			mid, _ := il.Lookup(name)
			got, _ := back.Lookup(name)
			if !reflect.DeepEqual(got, orig) {
				t.Fatalf("half → interleaved → half changed %s", name)
			}
			if c.role == V {
				if mid != orig {
					t.Fatal("v was copied or permuted")
				}
				return
			}
			heads, hd := cfg.Heads, cfg.HeadDim
			switch c.role {
			case K, KBias:
				heads = cfg.KVHeads
			case QNorm, KNorm:
				heads = 1
			}
			perm := RopePerm(heads, hd, RopeHalf, RopeInterleaved)
			a, _ := orig.Float32()
			b, _ := mid.Float32()
			n := len(a) / len(perm)
			for dst, src := range perm {
				if !reflect.DeepEqual(b[dst*n:(dst+1)*n], a[src*n:(src+1)*n]) {
					t.Fatalf("row %d of the interleaved %s is not row %d of the half one", dst, name, src)
				}
			}
			if w, ok := mid.(*W8A8); ok {
				o := orig.(*W8A8)
				for dst, src := range perm {
					if w.DeqScale[dst] != o.DeqScale[src] || w.QuantBias[dst] != o.QuantBias[src] || w.Bias[dst] != o.Bias[src] {
						t.Fatalf("W8A8 row %d: per-channel parameters did not follow row %d", dst, src)
					}
				}
			}
		})
	}
	// Interleaved pairs (2j, 2j+1) are HF's (j, j+hd/2).
	if got, want := RopePerm(1, 4, RopeHalf, RopeInterleaved), []int{0, 2, 1, 3}; !reflect.DeepEqual(got, want) {
		t.Errorf("RopePerm(1, 4, half → interleaved) = %v, want %v", got, want)
	}
}

// f16Data encodes v as F16 bytes.
func f16Data(v []float32) []byte {
	b := make([]byte, 2*len(v))
	for i, x := range v {
		h := Float32ToF16(x)
		b[2*i], b[2*i+1] = byte(h), byte(h>>8)
	}
	return b
}
