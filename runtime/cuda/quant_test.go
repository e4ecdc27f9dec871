package cuda

import (
	"fmt"
	"math"
	"math/big"
	"math/rand/v2"
	"path/filepath"
	"testing"

	"qtool/formats/hf"
	"qtool/formats/model"
	"qtool/quantize/calib"
	"qtool/runtime"
	"qtool/runtime/cpu"
	"qtool/runtime/runtimetest"
)

// TestW8A8Dynamic checks the per-token dynamic W8A8 product (GEMV and
// tensor-core paths, K split or not) against integer arithmetic:
// x_q = round(x/s_t), s_t = max|x_t|/127, y = (float32(Σ x_q·W)·s_t)·scale[n]
// + bias[n].
func TestW8A8Dynamic(t *testing.T) {
	for _, K := range []int{256, 1024} {
		testW8A8Dynamic(t, 136, K)
	}
}

func testW8A8Dynamic(t *testing.T, N, K int) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(13, 14))
	q := &model.Quantized{Bits: 8, Rows: N, Cols: K, Q: make([]int8, N*K), Scale: make([]float32, N)}
	for i := range q.Q {
		q.Q[i] = int8(r.IntN(255) - 127)
	}
	w := &model.W8A8{Weight: q, Dynamic: true, Bias: make([]float32, N)}
	for n := 0; n < N; n++ {
		q.Scale[n] = float32(0.001 + 0.01*r.Float64())
		w.Bias[n] = float32(r.Float64() - 0.5)
	}
	lw, err := b.UploadLinear("w8a8 dynamic", w)
	if err != nil {
		t.Fatal(err)
	}
	for _, M := range []int{1, 3, 64, 130} {
		x := randVec(r, M*K, 2)
		if M > 1 {
			clear(x[K : 2*K]) // an all-zero token: scale 0, output = bias
		}
		want := make([]float64, M*N)
		xq := make([]int8, K)
		for m := 0; m < M; m++ {
			s := model.QuantizeToken(xq, x[m*K:(m+1)*K])
			for n := 0; n < N; n++ {
				var acc int32
				for k := 0; k < K; k++ {
					acc += int32(xq[k]) * int32(q.Q[n*K+k])
				}
				want[m*N+n] = float64(float32(float32(float32(acc)*s)*q.Scale[n]) + w.Bias[n])
			}
		}
		y := poisoned(b, M, N)
		b.MatMul(y, upload(b, M, K, x), lw)
		checkClose(t, fmt.Sprintf("dynamic w8a8 M=%d K=%d", M, K), download(b, y), want, 0)
	}
}

// TestInt8KVCache stores keys and values in the int8 cache of the GPU and
// of the CPU backend and compares the attention outputs, prefill and
// decode (one visible key: that key's dequantized value).
func TestInt8KVCache(t *testing.T) {
	b, c := newTestBackend(t), cpu.New(4)
	r := rand.New(rand.NewPCG(15, 16))
	const heads, kvHeads, hd, S = 8, 2, 64, 300
	kvDim := kvHeads * hd
	layers := make([]runtime.KVQuant, 2)
	for l := range layers {
		q := runtime.KVQuant{KScale: make([]float32, kvDim), KOffset: make([]float32, kvDim), VScale: make([]float32, kvDim), VOffset: make([]float32, kvDim)}
		for ch := 0; ch < kvDim; ch++ {
			q.KScale[ch], q.KOffset[ch] = float32(0.005+0.02*r.Float64()), float32(r.IntN(40)-20)+0.25
			q.VScale[ch], q.VOffset[ch] = float32(0.005+0.02*r.Float64()), float32(r.IntN(40)-20)
		}
		layers[l] = q
	}
	gc, err := b.NewInt8KVCache(S, kvDim, layers)
	if err != nil {
		t.Fatal(err)
	}
	defer b.FreeKVCache(gc)
	cc, err := c.NewInt8KVCache(S, kvDim, layers)
	if err != nil {
		t.Fatal(err)
	}
	K, V := randVec(r, S*kvDim, 2), randVec(r, S*kvDim, 2)
	cpuUp := func(rows, cols int, v []float32) runtime.Buf {
		x := c.Alloc(rows, cols)
		c.Upload(x, v)
		return x
	}
	const pre = S - 1
	b.StoreKV(gc, 1, 0, upload(b, pre, kvDim, K[:pre*kvDim]), upload(b, pre, kvDim, V[:pre*kvDim]))
	c.StoreKV(cc, 1, 0, cpuUp(pre, kvDim, K[:pre*kvDim]), cpuUp(pre, kvDim, V[:pre*kvDim]))
	b.StoreKV(gc, 1, pre, upload(b, 1, kvDim, K[pre*kvDim:]), upload(b, 1, kvDim, V[pre*kvDim:]))
	c.StoreKV(cc, 1, pre, cpuUp(1, kvDim, K[pre*kvDim:]), cpuUp(1, kvDim, V[pre*kvDim:]))
	for _, tc := range []struct{ T, pos0 int }{{5, S - 5}, {1, S - 1}, {1, 0}, {64, 100}} {
		qv := randVec(r, tc.T*heads*hd, 1)
		out := b.Alloc(tc.T, heads*hd)
		b.Attention(out, upload(b, tc.T, heads*hd, qv), gc, 1, tc.pos0, heads, kvHeads, hd)
		co := c.Alloc(tc.T, heads*hd)
		c.Attention(co, cpuUp(tc.T, heads*hd, qv), cc, 1, tc.pos0, heads, kvHeads, hd)
		want := make([]float32, tc.T*heads*hd)
		c.Download(want, co)
		w64 := make([]float64, len(want))
		for i, v := range want {
			w64[i] = float64(v)
		}
		// decode rows apply the quantizers algebraically (key scales folded
		// into q, value offsets after the sums), prefill rows (T=64, the
		// tensor-core kernel) dequantize into fp16 pairs: equal up to
		// float rounding
		checkClose(t, fmt.Sprintf("int8 cache attention T=%d pos0=%d", tc.T, tc.pos0), download(b, out), w64, 1e-5)
	}
}

// TestInt8KVCacheModel calibrates an int8 KV cache for llama-mini on the
// CPU (float weights, 8 windows of train-like text from sotu-test) and
// runs the model with it on the GPU and on the CPU: the perplexities agree
// to 1e-4, and differ from the float cache's by less than 0.3 %.
func TestInt8KVCacheModel(t *testing.T) {
	b := newTestBackend(t)
	dir := filepath.Join("..", "..", "testdata", "llama-mini")
	var ids []int
	runtimetest.ReadJSON(t, filepath.Join(dir, "ids-sotu-test.raw.json"), &ids)
	m, err := hf.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	var windows [][]int
	for i := 0; i < 8; i++ {
		windows = append(windows, ids[40000+i*512:40000+(i+1)*512])
	}
	c := cpu.New(4)
	s, err := calib.NewSession(m, c, windows, 4)
	if err != nil {
		t.Fatal(err)
	}
	s.TrackKVCache()
	if err := s.Run(func(int, runtime.CapturePoint, runtime.Buf) error { return nil }, nil); err != nil {
		t.Fatal(err)
	}
	s.Close()
	if !s.Out.HasKVCacheInt8() {
		t.Fatal("the session installed no KV-cache quantizers")
	}
	ppl := func(be runtime.Backend, mm *model.Model) float64 {
		rm, err := runtime.Load(mm, be)
		if err != nil {
			t.Fatal(err)
		}
		r, err := runtime.Perplexity(rm, ids, runtime.PPLOptions{MaxChunks: 6})
		if err != nil {
			t.Fatal(err)
		}
		return r.PPL
	}
	gpu, host := ppl(b, s.Out), ppl(c, s.Out)
	float := ppl(b, m)
	t.Logf("int8 KV cache: ppl %.6f on the GPU, %.6f on the CPU; float cache %.6f (6 chunks)", gpu, host, float)
	if d := math.Abs(gpu/host - 1); d > 1e-4 {
		t.Errorf("GPU and CPU differ by %.2e", d)
	}
	if d := gpu/float - 1; d > 3e-3 {
		t.Errorf("the int8 cache costs %.3f %%", 100*d)
	}
}

// roundingEdge is a value v on a rounding boundary of the static
// quantizer (scale, offset), v/scale + offset = j + 0.5 for a random j in
// [−150, 150), moved ulps (−1, 0 or 1) floats toward +∞ or −∞: where a
// quantizer that rounds otherwise than the division shows.
func roundingEdge(r *rand.Rand, scale, offset float32, ulps int) float32 {
	v := (float32(r.IntN(300)-150) + 0.5 - offset) * scale
	if ulps != 0 {
		v = math.Nextafter32(v, float32(math.Inf(ulps)))
	}
	return v
}

// TestQuantFastModel checks, in a float32 model with exact FMAs (math/big),
// that qtool.cu's quant_fast (quot_rn: the reciprocal's product corrected
// by two FMAs) gives quant_static's codes (the correctly rounded division)
// for quantizers that actQuant.divisionFree admits, a quarter of the
// values on or next to a rounding boundary and divisors with all-ones
// significands among them; and which quantizers it admits. The kernels
// themselves are checked against quant_act's codes on the GPU
// (TestNormQuantized's boundaries, TestW8A8, TestAttentionAdd).
func TestQuantFastModel(t *testing.T) {
	for _, tc := range []struct {
		scale, offset float32
		want          bool
	}{
		{0.02, 2, true}, {-0x1p-30, -0x1p8, true}, {0x1p30, 0x1p8, true},
		{0x1p-31, 0, false}, {0x1p31, 0, false}, {0.02, 257, false}, {0.02, -257, false},
		{0, 0, false}, {float32(math.NaN()), 0, false}, {float32(math.Inf(1)), 0, false},
	} {
		if got := (actQuant{scale: tc.scale, offset: tc.offset}).divisionFree(); got != tc.want {
			t.Errorf("divisionFree(scale %g, offset %g) = %v, want %v", tc.scale, tc.offset, got, tc.want)
		}
	}
	fma := func(a, b, c float32) float32 { // RN32(a·b + c), one rounding
		x := new(big.Float).SetPrec(200).SetFloat64(float64(a))
		x.Mul(x, new(big.Float).SetFloat64(float64(b)))
		x.Add(x, new(big.Float).SetFloat64(float64(c)))
		f, _ := x.Float32()
		return f
	}
	quotRN := func(v, s, inv float32) float32 {
		switch a := float32(math.Abs(float64(v))); {
		case a > 0x1p60:
			v = float32(math.Copysign(0x1p60, float64(v)))
		case a < 0x1p-60:
			v = 0
		}
		q0 := float32(v * inv) // no fused multiply-add here (the Go spec would allow one)
		return fma(fma(-q0, s, v), inv, q0)
	}
	code := func(t float32) int8 { return int8(min(max(float32(math.Round(float64(t))), -128), 127)) }
	r := rand.New(rand.NewPCG(71, 72))
	for i := 0; i < 20000; i++ {
		s := float32(math.Ldexp(1+r.Float64(), r.IntN(61)-30)) * float32([]float64{1, -1}[r.IntN(2)])
		if i%8 == 0 { // an all-ones significand
			s = math.Float32frombits(math.Float32bits(s) | 0x7fffff)
		}
		o := float32(r.IntN(513) - 256)
		if i%3 == 0 {
			o = float32(r.Float64()*512 - 256)
		}
		var v float32
		switch i % 4 {
		case 0: // on or next to v/s + o = j + 0.5
			v = roundingEdge(r, s, o, r.IntN(2)*2-1)
		case 1:
			v = float32(math.Ldexp(r.Float64()*2-1, r.IntN(200)-100))
		default:
			v = float32(r.NormFloat64()*200) * s
		}
		inv := 1 / s
		if got, want := code(quotRN(v, s, inv)+o), code(v/s+o); got != want {
			t.Fatalf("v %g (%#x), scale %g (%#x), offset %g: quant_fast %d, the division %d",
				v, math.Float32bits(v), s, math.Float32bits(s), o, got, want)
		}
	}
}
