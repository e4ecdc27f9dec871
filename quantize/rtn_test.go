package quantize

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"qtool/formats/model"
)

// naiveRound is round-half-to-even written out by hand (no math.RoundToEven).
func naiveRound(x float32) float32 {
	f := float32(math.Floor(float64(x)))
	d := x - f
	switch {
	case d > 0.5:
		return f + 1
	case d < 0.5:
		return f
	}
	if int64(f)%2 == 0 {
		return f
	}
	return f + 1
}

// reference is a straightforward per-row, per-group transcription of the
// PyTorch code: it returns the dequantized matrix plus codes u (unsigned for
// asym, signed for sym), scales and (asym) integer zero points.
func reference(w []float32, rows, cols, group, bits int, rule Rule) (deq []float32, codes []int, scales []float32, zeros []int) {
	if group == 0 {
		group = cols
	}
	deq = make([]float32, len(w))
	codes = make([]int, len(w))
	for r := 0; r < rows; r++ {
		for g0 := 0; g0 < cols; g0 += group {
			seg := w[r*cols+g0 : r*cols+g0+group]
			switch rule {
			case SymZero, SymAWQ:
				var m float32
				for _, v := range seg {
					if v < 0 && -v > m {
						m = -v
					} else if v > m {
						m = v
					}
				}
				qmax := float32(math.Pow(2, float64(bits-1)) - 1)
				if rule == SymAWQ && m < 1e-5 {
					m = 1e-5
				}
				s := m / qmax
				scales = append(scales, s)
				for i, v := range seg {
					q := float32(0)
					if s != 0 {
						q = naiveRound(v / s)
					}
					if q > qmax {
						q = qmax
					}
					if q < -qmax-1 {
						q = -qmax - 1
					}
					codes[r*cols+g0+i] = int(q)
					deq[r*cols+g0+i] = q * s
				}
			case AsymAWQ:
				lo, hi := seg[0], seg[0]
				for _, v := range seg {
					if v < lo {
						lo = v
					}
					if v > hi {
						hi = v
					}
				}
				umax := float32(math.Pow(2, float64(bits)) - 1)
				rng := hi - lo
				if rng < 1e-5 {
					rng = 1e-5
				}
				s := rng / umax
				z := -naiveRound(lo / s)
				z = float32(math.Max(0, math.Min(float64(umax), float64(z))))
				scales = append(scales, s)
				zeros = append(zeros, int(z))
				for i, v := range seg {
					u := naiveRound(v/s) + z
					u = float32(math.Max(0, math.Min(float64(umax), float64(u))))
					codes[r*cols+g0+i] = int(u)
					deq[r*cols+g0+i] = (u - z) * s
				}
			}
		}
	}
	return
}

func TestWorkedExamples(t *testing.T) {
	tests := []struct {
		name   string
		w      []float32
		group  int
		p      Params
		q      []int8
		scale  []float32
		zero   []float32
		errSub string
	}{
		// seed 000: [3,5,2,4] in groups of 2 -> scales 5/127, 4/127, q 76,127,64,127.
		{"seed000", []float32{3, 5, 2, 4}, 2, Int8Sym(2), []int8{76, 127, 64, 127}, []float32{float32(5) / 127, float32(4) / 127}, nil, ""},
		// ties go to even: s = 1.
		{"ties", []float32{127, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 3.5}, 8, Int8Sym(8), []int8{127, 0, 2, 2, 0, -2, -2, 4}, []float32{1}, nil, ""},
		{"zero group", []float32{0, 0, 1, -127}, 2, Int8Sym(2), []int8{0, 0, 1, -127}, []float32{0, 1}, nil, ""},
		// asym: range 15 -> s = 1; z = -round(-2.5) = 2; u = round(-2.5)+2 = 0, round(12.5)+2 = 14.
		{"asym ties", []float32{-2.5, 12.5}, 2, Int4Asym(2), []int8{0 - 8, 14 - 8}, []float32{1}, []float32{2 - 8}, ""},
		// all positive: s = 1, z = clamp(-3) = 0, u = 3 and clamp(18) = 15.
		{"asym positive", []float32{3, 18}, 2, Int4Asym(2), []int8{3 - 8, 15 - 8}, []float32{1}, []float32{-8}, ""},
		{"sym awq zero", []float32{0, 0}, 2, Params{Bits: 4, Group: 2, Rule: SymAWQ}, []int8{0, 0}, []float32{float32(1e-5) / 7}, nil, ""},
		{"not dividing", []float32{1, 2, 3}, 2, Int8Sym(2), nil, nil, nil, "does not divide"},
		{"nan", []float32{1, float32(math.NaN())}, 2, Int8Sym(2), nil, nil, nil, "not finite"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			q := make([]int8, len(tc.w))
			ng := max(1, len(tc.w)/tc.group)
			s := make([]float32, ng)
			var z []float32
			if tc.p.Asymmetric() {
				z = make([]float32, ng)
			}
			err := Groups(tc.w, tc.group, tc.p, q, s, z)
			if tc.errSub != "" {
				if err == nil || !strings.Contains(err.Error(), tc.errSub) {
					t.Fatalf("err = %v, want %q", err, tc.errSub)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			for i := range tc.q {
				if q[i] != tc.q[i] {
					t.Fatalf("q = %v, want %v", q, tc.q)
				}
			}
			for i := range tc.scale {
				if s[i] != tc.scale[i] {
					t.Fatalf("scale = %v, want %v", s, tc.scale)
				}
			}
			for i := range tc.zero {
				if z[i] != tc.zero[i] {
					t.Fatalf("zero = %v, want %v", z, tc.zero)
				}
			}
		})
	}
}

func randMatrix(rows, cols int, seed uint64) []float32 {
	r := rand.New(rand.NewPCG(seed, 7))
	w := make([]float32, rows*cols)
	for i := range w {
		w[i] = float32(r.NormFloat64() * 0.05)
		if i%97 == 0 {
			w[i] = float32(math.Round(float64(w[i])*64) / 64) // some exact ties
		}
	}
	// a row of zeros to hit the zero-group rules
	for c := 0; c < cols; c++ {
		w[c] = 0
	}
	return w
}

func TestRTNMatchesReference(t *testing.T) {
	tests := []Params{
		Int8Sym(64), Int8Sym(0), {Bits: 4, Group: 128, Rule: SymAWQ}, Int4Asym(128), {Bits: 3, Group: 128, Rule: AsymAWQ}, {Bits: 8, Group: 32, Rule: AsymAWQ},
	}
	const rows, cols = 24, 256
	w := randMatrix(rows, cols, 1)
	for _, p := range tests {
		t.Run(p.String(), func(t *testing.T) {
			q, err := RTN(w, rows, cols, p)
			if err != nil {
				t.Fatal(err)
			}
			if err := q.Validate(); err != nil {
				t.Fatal(err)
			}
			deq, codes, scales, zeros := reference(w, rows, cols, p.Group, p.Bits, p.Rule)
			got, _ := q.Float32()
			for i := range got {
				if got[i] != deq[i] {
					t.Fatalf("dequantized[%d] = %v, reference %v", i, got[i], deq[i])
				}
				want := codes[i]
				if p.Asymmetric() {
					want -= q.Offset()
				}
				if int(q.Q[i]) != want {
					t.Fatalf("q[%d] = %d, reference %d", i, q.Q[i], want)
				}
			}
			for g := range scales {
				if q.Scale[g] != scales[g] {
					t.Fatalf("scale[%d] = %v, reference %v", g, q.Scale[g], scales[g])
				}
				if p.Asymmetric() && int(q.Zero[g])+q.Offset() != zeros[g] {
					t.Fatalf("zero[%d] = %v, reference %d", g, q.Zero[g], zeros[g])
				}
			}
		})
	}
}

func TestRTNErrors(t *testing.T) {
	tests := []struct {
		name       string
		rows, cols int
		p          Params
		sub        string
	}{
		{"group", 2, 48, Int8Sym(64), "does not divide 48 input columns"},
		{"bits", 2, 64, Params{Bits: 9, Group: 64}, "bits"},
		{"shape", 3, 64, Int8Sym(64), "values for shape"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := RTN(make([]float32, 2*tc.cols), tc.rows, tc.cols, tc.p)
			if err == nil || !strings.Contains(err.Error(), tc.sub) {
				t.Fatalf("err = %v, want %q", err, tc.sub)
			}
		})
	}
}

func TestQuantizeModel(t *testing.T) {
	cfg := model.Config{Arch: model.Qwen3, Hidden: 64, Intermediate: 128, Layers: 1, Heads: 2, KVHeads: 1, HeadDim: 32,
		Vocab: 16, MaxSeq: 8, RopeTheta: 1e6, NormEps: 1e-6, Tied: true, QKNorm: true}
	m := model.New(cfg)
	seed := uint64(2)
	add := func(name string, shape ...int) {
		seed++
		m.Set(name, model.FromFloat32(shape, randMatrix(1, model.NumElements(shape), seed)))
	}
	add("embed", 16, 64)
	add("norm", 64)
	add("layers.0.attn_norm", 64)
	add("layers.0.mlp_norm", 64)
	add("layers.0.q_norm", 32)
	add("layers.0.k_norm", 32)
	add("layers.0.q", 64, 64)
	add("layers.0.k", 32, 64)
	add("layers.0.v", 32, 64)
	add("layers.0.o", 64, 64)
	add("layers.0.gate", 128, 64)
	add("layers.0.up", 128, 64)
	add("layers.0.down", 64, 128)
	for _, lazy := range []bool{false, true} {
		out, err := QuantizeModel(m, Options{Params: Int8Sym(32), Classifier: true, Lazy: lazy})
		if err != nil {
			t.Fatal(err)
		}
		if out.Config.Tied {
			t.Fatal("classifier quantization must untie the model")
		}
		if err := out.CheckShapes(); err != nil {
			t.Fatal(err)
		}
		for _, name := range out.Names() {
			tt, _ := out.Lookup(name)
			_, isQ := tt.(*model.Quantized)
			_, isL := tt.(*Lazy)
			l, r, _ := model.ParseName(name)
			wantQ := (l >= 0 && model.IsLinear(r)) || r == model.LMHead
			if (isQ || isL) != wantQ {
				t.Errorf("%s: quantized=%v, want %v", name, isQ || isL, wantQ)
			}
			if wantQ {
				src := name
				if r == model.LMHead {
					src = "embed"
				}
				st, _ := m.Lookup(src)
				sv, _ := st.Float32()
				sh := st.Shape()
				deq, _, _, _ := reference(sv, sh[0], sh[1], 32, 8, SymZero)
				got, err := tt.Float32()
				if err != nil {
					t.Fatal(err)
				}
				for i := range got {
					if got[i] != deq[i] {
						t.Fatalf("%s[%d] = %v, reference %v", name, i, got[i], deq[i])
					}
				}
			}
		}
	}
	if _, err := QuantizeModel(m, Options{Params: Int8Sym(48)}); err == nil || !strings.Contains(err.Error(), "layers.0") {
		t.Fatalf("non-dividing group: err = %v", err)
	}
}
