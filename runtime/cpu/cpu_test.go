package cpu

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"qtool/formats/model"
	"qtool/runtime"
)

func randVec(r *rand.Rand, n int, scale float32) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = (r.Float32()*2 - 1) * scale
	}
	return v
}

func upload(b *Backend, rows, cols int, v []float32) runtime.Buf {
	x := b.Alloc(rows, cols)
	b.Upload(x, v)
	return x
}

func download(b *Backend, x runtime.Buf) []float32 {
	v := make([]float32, x.Rows()*x.Cols())
	b.Download(v, x)
	return v
}

func maxAbsDiff(a []float32, b []float64) float64 {
	d := 0.0
	for i := range a {
		d = max(d, math.Abs(float64(a[i])-b[i]))
	}
	return d
}

// naiveMatMul is y[t][o] = Σ_i x[t][i]·w[o][i] in float64.
func naiveMatMul(x []float32, w []float32, T, out, in int) []float64 {
	y := make([]float64, T*out)
	for t := 0; t < T; t++ {
		for o := 0; o < out; o++ {
			s := 0.0
			for i := 0; i < in; i++ {
				s += float64(x[t*in+i]) * float64(w[o*in+i])
			}
			y[t*out+o] = s
		}
	}
	return y
}

// randQuantized makes a random quantized weight of the given scheme.
func randQuantized(r *rand.Rand, rows, cols, bits, group int, zero, gidx bool) *model.Quantized {
	q := &model.Quantized{Bits: bits, GroupSize: group, Rows: rows, Cols: cols, Q: make([]int8, rows*cols)}
	lo, span := -(1 << (bits - 1)), 1<<bits
	for i := range q.Q {
		q.Q[i] = int8(lo + r.IntN(span))
	}
	ng := rows * q.Groups()
	q.Scale = randVec(r, ng, 0.02)
	if zero {
		q.Zero = make([]float32, ng)
		for i := range q.Zero {
			q.Zero[i] = float32(lo+r.IntN(span)) + r.Float32()*0.5
		}
	}
	if gidx {
		q.GIdx = make([]int32, cols)
		for c := range q.GIdx {
			q.GIdx[c] = int32(r.IntN(q.Groups()))
		}
	}
	return q
}

func TestMatMul(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	tests := []struct {
		name    string
		T, o, i int
		tensor  func() model.Tensor
	}{
		{"f32", 7, 33, 70, func() model.Tensor { return model.FromFloat32([]int{33, 70}, randVec(r, 33*70, 1)) }},
		{"int8-g64", 13, 40, 128, func() model.Tensor { return randQuantized(r, 40, 128, 8, 64, false, false) }},
		{"int4-asym-g32", 1, 24, 96, func() model.Tensor { return randQuantized(r, 24, 96, 4, 32, true, false) }},
		{"int3-asym-g32", 5, 24, 96, func() model.Tensor { return randQuantized(r, 24, 96, 3, 32, true, false) }},
		{"w8a16-perchannel-offset", 20, 50, 64, func() model.Tensor { return randQuantized(r, 50, 64, 8, 0, true, false) }},
		{"int4-gidx", 6, 16, 64, func() model.Tensor { return randQuantized(r, 16, 64, 4, 16, true, true) }},
	}
	half := func(dt model.DType, rows, cols int) func() model.Tensor {
		return func() model.Tensor {
			v := randVec(r, rows*cols, 1)
			data := make([]byte, 2*len(v))
			for i, x := range v {
				h := model.Float32ToF16(x)
				if dt == model.BF16 {
					h = model.Float32ToBF16(x)
				}
				data[2*i], data[2*i+1] = byte(h), byte(h>>8)
			}
			d, err := model.NewDense(dt, []int{rows, cols}, data)
			if err != nil {
				t.Fatal(err)
			}
			return d
		}
	}
	tests = append(tests, []struct {
		name    string
		T, o, i int
		tensor  func() model.Tensor
	}{
		{"f16-widened", 9, 20, 48, half(model.F16, 20, 48)},
		{"f16-kept", 9, 20, 48, half(model.F16, 20, 48)},
		{"bf16-kept", 1, 70, 32, half(model.BF16, 70, 32)},
	}...)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b := New(2)
			if strings.HasSuffix(tc.name, "-kept") {
				b.SetF32Budget(0)
			}
			w := tc.tensor()
			wf, err := w.Float32()
			if err != nil {
				t.Fatal(err)
			}
			lin, err := b.UploadLinear(tc.name, w)
			if err != nil {
				t.Fatal(err)
			}
			if _, kept := lin.(*halfLinear); kept != strings.HasSuffix(tc.name, "-kept") {
				t.Errorf("upload gave %T", lin)
			}
			xv := randVec(r, tc.T*tc.i, 1)
			x := upload(b, tc.T, tc.i, xv)
			y := b.Alloc(tc.T, tc.o)
			b.MatMul(y, x, lin)
			if d := maxAbsDiff(download(b, y), naiveMatMul(xv, wf, tc.T, tc.o, tc.i)); d > 1e-4 {
				t.Errorf("max |diff| %g", d)
			}
			// Embedding rows are the dequantized weight rows.
			e := b.Alloc(2, tc.i)
			b.Embed(e, lin, []int{tc.o - 1, 0})
			got := download(b, e)
			for c := 0; c < tc.i; c++ {
				if got[c] != wf[(tc.o-1)*tc.i+c] || got[tc.i+c] != wf[c] {
					t.Fatalf("embedding column %d differs", c)
				}
			}
		})
	}
}

// TestW8A8Exact checks the W8A8 product against integer arithmetic, also
// for an input width where float32 partial sums would stop being exact.
func TestW8A8Exact(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for _, k := range []int{64, 1024, 3000} {
		const T, n = 3, 5
		w := &model.W8A8{
			Weight:      &model.Quantized{Bits: 8, Rows: n, Cols: k, Q: make([]int8, n*k), Scale: make([]float32, n)},
			InputScale:  0.01,
			InputOffset: 3,
			DeqScale:    randVec(r, n, 1e-3),
			QuantBias:   make([]int32, n),
			Bias:        randVec(r, n, 1),
		}
		for i := range w.Weight.Q {
			w.Weight.Q[i] = int8(-127 + r.IntN(255))
			if i%7 == 0 || i < k {
				w.Weight.Q[i] = 127 // row 0 all 127: sums beyond 2^24 when k is large
			}
		}
		for j := range w.QuantBias {
			w.QuantBias[j] = int32(r.IntN(20001) - 10000)
		}
		xv := randVec(r, T*k, 2)
		for i := 0; i < k; i++ {
			xv[i] = []float32{1.27, 1.23}[i%2] // quantize to 127 (clamped) and 126
		}
		b := New(2)
		lin, err := b.UploadLinear("w8a8", w)
		if err != nil {
			t.Fatal(err)
		}
		y := b.Alloc(T, n)
		b.MatMul(y, upload(b, T, k, xv), lin)
		got := download(b, y)
		for tt := 0; tt < T; tt++ {
			for j := 0; j < n; j++ {
				var acc int64
				for i := 0; i < k; i++ {
					xq := int64(math.RoundToEven(float64(xv[tt*k+i]/w.InputScale + w.InputOffset)))
					xq = max(-128, min(127, xq))
					acc += xq * int64(w.Weight.Q[j*k+i])
				}
				want := float32(float64(acc+int64(w.QuantBias[j]))) * w.DeqScale[j]
				want += w.Bias[j]
				if got[tt*n+j] != want {
					t.Errorf("k=%d row %d col %d: got %g, want %g (integer sum %d)", k, tt, j, got[tt*n+j], want, acc)
				}
			}
		}
	}
}

// naiveAttention is causal GQA attention in float64 over keys/values
// [S, kvHeads*hd] for queries at positions pos0...
func naiveAttention(q, K, V []float32, T, pos0, heads, kvHeads, hd int) []float64 {
	out := make([]float64, T*heads*hd)
	kvDim := kvHeads * hd
	for t := 0; t < T; t++ {
		for h := 0; h < heads; h++ {
			g := h / (heads / kvHeads)
			n := pos0 + t + 1
			s := make([]float64, n)
			mx := math.Inf(-1)
			for j := 0; j < n; j++ {
				d := 0.0
				for e := 0; e < hd; e++ {
					d += float64(q[t*heads*hd+h*hd+e]) * float64(K[j*kvDim+g*hd+e])
				}
				s[j] = d / math.Sqrt(float64(hd))
				mx = max(mx, s[j])
			}
			sum := 0.0
			for j := range s {
				s[j] = math.Exp(s[j] - mx)
				sum += s[j]
			}
			for e := 0; e < hd; e++ {
				v := 0.0
				for j := range s {
					v += s[j] / sum * float64(V[j*kvDim+g*hd+e])
				}
				out[t*heads*hd+h*hd+e] = v
			}
		}
	}
	return out
}

func TestAttention(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	tests := []struct {
		name                   string
		T, pos0, heads, kv, hd int
	}{
		{"prefill-gqa", 150, 0, 4, 2, 16},
		{"decode", 1, 37, 8, 2, 8},
		{"continue", 9, 70, 2, 2, 8},
		{"mha", 3, 0, 3, 3, 4},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b := New(2)
			S := tc.pos0 + tc.T
			kvDim := tc.kv * tc.hd
			K, V := randVec(r, S*kvDim, 1), randVec(r, S*kvDim, 1)
			c := b.NewKVCache(2, S+5, kvDim)
			b.StoreKV(c, 1, 0, upload(b, S, kvDim, K), upload(b, S, kvDim, V))
			qv := randVec(r, tc.T*tc.heads*tc.hd, 2)
			out := b.Alloc(tc.T, tc.heads*tc.hd)
			b.Attention(out, upload(b, tc.T, tc.heads*tc.hd, qv), c, 1, tc.pos0, tc.heads, tc.kv, tc.hd)
			want := naiveAttention(qv, K, V, tc.T, tc.pos0, tc.heads, tc.kv, tc.hd)
			if d := maxAbsDiff(download(b, out), want); d > 1e-5 {
				t.Errorf("max |diff| %g", d)
			}
		})
	}
}

func TestRoPE(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 8))
	const T, pos0, hd, heads = 5, 100, 8, 2
	theta := 10000.0
	xv := randVec(r, T*heads*hd, 1)
	for _, layout := range []model.RopeLayout{model.RopeHalf, model.RopeInterleaved} {
		t.Run(layout.String(), func(t *testing.T) {
			b := New(1)
			x := upload(b, T, heads*hd, xv)
			b.RoPE(x, hd, pos0, theta, layout)
			got := download(b, x)
			want := make([]float64, len(xv))
			for i := 0; i < T; i++ {
				for h := 0; h < heads; h++ {
					base := i*heads*hd + h*hd
					for j := 0; j < hd/2; j++ {
						a := float64(pos0+i) * math.Pow(theta, -float64(2*j)/hd)
						c, s := math.Cos(a), math.Sin(a)
						p0, p1 := base+j, base+j+hd/2
						if layout == model.RopeInterleaved {
							p0, p1 = base+2*j, base+2*j+1
						}
						x0, x1 := float64(xv[p0]), float64(xv[p1])
						want[p0] = x0*c - x1*s
						want[p1] = x1*c + x0*s
					}
				}
			}
			if d := maxAbsDiff(got, want); d > 1e-4 {
				t.Errorf("max |diff| %g", d)
			}
		})
	}
}

func TestNormsAndNLL(t *testing.T) {
	r := rand.New(rand.NewPCG(9, 10))
	b := New(2)
	const rows, cols = 3, 40
	xv := randVec(r, rows*cols, 3)
	wv, bv := randVec(r, cols, 1), randVec(r, cols, 1)
	w, _ := b.UploadVector("w", model.FromFloat32([]int{cols}, wv))
	bias, _ := b.UploadVector("b", model.FromFloat32([]int{cols}, bv))
	const eps = 1e-5
	y := b.Alloc(rows, cols)
	b.RMSNorm(y, upload(b, rows, cols, xv), w, bias, eps)
	want := make([]float64, rows*cols)
	for i := 0; i < rows; i++ {
		ss := 0.0
		for c := 0; c < cols; c++ {
			ss += float64(xv[i*cols+c]) * float64(xv[i*cols+c])
		}
		inv := 1 / math.Sqrt(ss/cols+eps)
		for c := 0; c < cols; c++ {
			want[i*cols+c] = float64(xv[i*cols+c])*inv*float64(wv[c]) + float64(bv[c])
		}
	}
	if d := maxAbsDiff(download(b, y), want); d > 1e-5 {
		t.Errorf("RMSNorm max |diff| %g", d)
	}

	// Per-head norm: every 8-wide slice normalized with the same weight.
	hw, _ := b.UploadVector("hw", model.FromFloat32([]int{8}, wv[:8]))
	x := upload(b, rows, cols, xv)
	b.RMSNormHeads(x, 8, hw, eps)
	got := download(b, x)
	for s := 0; s < rows*cols/8; s++ {
		ss := 0.0
		for e := 0; e < 8; e++ {
			ss += float64(xv[s*8+e]) * float64(xv[s*8+e])
		}
		for e := 0; e < 8; e++ {
			w := float64(xv[s*8+e]) / math.Sqrt(ss/8+eps) * float64(wv[e])
			if math.Abs(float64(got[s*8+e])-w) > 1e-5 {
				t.Fatalf("RMSNormHeads slice %d elem %d: %g, want %g", s, e, got[s*8+e], w)
			}
		}
	}

	// NLL and argmax against float64.
	logits := randVec(r, rows*cols, 20)
	logits[cols+7] = 50
	targets := []int{3, 7, 39}
	nll := make([]float64, rows)
	lb := upload(b, rows, cols, logits)
	b.NLL(nll, lb, targets)
	for i := 0; i < rows; i++ {
		s := 0.0
		for c := 0; c < cols; c++ {
			s += math.Exp(float64(logits[i*cols+c]))
		}
		want := math.Log(s) - float64(logits[i*cols+targets[i]])
		if math.Abs(nll[i]-want) > 1e-5 {
			t.Errorf("NLL row %d: %g, want %g", i, nll[i], want)
		}
	}
	if am := b.Argmax(lb); am[1] != 7 {
		t.Errorf("argmax row 1 = %d, want 7", am[1])
	}

	// AddBias adds the vector to every row.
	ab := upload(b, rows, cols, xv)
	b.AddBias(ab, bias)
	for i, v := range download(b, ab) {
		if v != xv[i]+bv[i%cols] {
			t.Fatalf("AddBias %d: %g, want %g", i, v, xv[i]+bv[i%cols])
		}
	}

	// SiLU·up and Add.
	g, u := randVec(r, 10, 5), randVec(r, 10, 1)
	gb := upload(b, 1, 10, g)
	b.SiLUMul(gb, gb, upload(b, 1, 10, u))
	b.Add(gb, upload(b, 1, 10, u))
	out := download(b, gb)
	for i := range g {
		x := float64(g[i])
		want := x/(1+math.Exp(-x))*float64(u[i]) + float64(u[i])
		if math.Abs(float64(out[i])-want) > 1e-5 {
			t.Errorf("SiLUMul+Add %d: %g, want %g", i, out[i], want)
		}
	}
}

func TestUploadErrors(t *testing.T) {
	b := New(1)
	bad := []struct {
		name string
		t    model.Tensor
	}{
		{"int dense", &model.Dense{DType: model.I32, Dims: []int{2, 2}, Data: make([]byte, 16)}},
		{"1-d linear", model.FromFloat32([]int{4}, make([]float32, 4))},
		{"bad quantized", &model.Quantized{Bits: 4, Rows: 2, Cols: 4, Q: make([]int8, 3)}},
		{"w8a8 without weight", &model.W8A8{}},
		{"w8a8 zero scale", &model.W8A8{Weight: &model.Quantized{Bits: 8, Rows: 1, Cols: 2, Q: make([]int8, 2), Scale: []float32{1}},
			DeqScale: []float32{1}, QuantBias: []int32{0}}},
		{"nil", nil},
	}
	for _, tc := range bad {
		if _, err := b.UploadLinear(tc.name, tc.t); err == nil {
			t.Errorf("%s: UploadLinear accepted it", tc.name)
		}
	}
	if _, err := b.UploadVector("v", model.FromFloat32([]int{2, 2}, make([]float32, 4))); err == nil {
		t.Error("UploadVector accepted a matrix")
	}
}
