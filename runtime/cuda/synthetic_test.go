package cuda

import (
	"math"
	"math/rand/v2"
	"testing"

	"qtool/formats/model"
)

// TestSynthetic checks what fill_random writes for bench's random-weight
// models and FillRandom: every value in its range, a seed giving the same
// values again and another seed other values, and a synthetic fp16 weight
// multiplying as its downloaded values do.
func TestSynthetic(t *testing.T) {
	b := newTestBackend(t)
	defer b.enter()() // downloadAs below reads device memory with the driver's own calls
	const n = 4096
	fill := func(seed uint64, a float32) []float32 {
		x := b.Alloc(1, n)
		defer b.Free(x)
		b.FillRandom(x, seed, a)
		return download(b, x)
	}
	x1, x2, x3 := fill(7, 0.5), fill(7, 0.5), fill(8, 0.5)
	var mean float64
	same := 0
	for i, v := range x1 {
		if !(v >= -0.5 && v < 0.5) {
			t.Fatalf("FillRandom: value %d is %g, want [-0.5, 0.5)", i, v)
		}
		if x2[i] != v {
			t.Fatalf("FillRandom: seed 7 gave %g then %g at %d", v, x2[i], i)
		}
		if x3[i] == v {
			same++
		}
		mean += math.Abs(float64(v)) / n
	}
	if same > n/100 {
		t.Errorf("FillRandom: seeds 7 and 8 agree on %d of %d values", same, n)
	}
	if math.Abs(mean-0.25) > 0.02 { // E|u| = a/2 for u uniform in [-a, a)
		t.Errorf("FillRandom: mean |value| %.4f, want 0.25 ± 0.02", mean)
	}

	const out, in = 96, 256
	a := 1 / math.Sqrt(in) // uploadSynthetic's weight range
	synth := func(format string) *Linear {
		lw, err := b.UploadLinear("synthetic "+format, &Synthetic{Format: format, Dims: []int{out, in}, GroupSize: 128, Seed: 3})
		if err != nil {
			t.Fatalf("synthetic %s: %v", format, err)
		}
		t.Cleanup(func() { b.FreeLinear(lw) })
		if !b.plainNext { // a GEMV reads weights before its wait: the next kernel waits for the fills
			t.Errorf("synthetic %s: the launch after the weights' fills would be an early one", format)
		}
		return lin(lw)
	}
	inRange := func(what string, v []float64, lo, hi float64) {
		t.Helper()
		for i, x := range v {
			if !(x >= lo && x <= hi) {
				t.Fatalf("%s: value %d is %g, want [%g, %g]", what, i, x, lo, hi)
			}
		}
	}
	l16 := synth("fp16")
	w16 := make([]float64, out*in)
	for i, h := range downloadAs[uint16](b, l16.w, out*in) {
		w16[i] = float64(model.F16ToFloat32(h))
	}
	inRange("fp16 weight", w16, -a, a)
	r := rand.New(rand.NewPCG(5, 6))
	for _, M := range []int{1, 200} { // the GEMV and the GEMM
		xv := randVec(r, M*in, 1)
		xb, y := upload(b, M, in, xv), b.Alloc(M, out)
		b.MatMul(y, xb, l16)
		checkClose(t, "synthetic fp16 weight", download(b, y), matmulRef(xv, w16, M, out, in), 3e-3)
		b.Free(xb)
		b.Free(y)
	}

	lbf := synth("bf16")
	wbf := make([]float64, out*in)
	for i, h := range downloadAs[uint16](b, lbf.w, out*in) {
		wbf[i] = float64(math.Float32frombits(uint32(h) << 16))
	}
	inRange("bf16 weight", wbf, -a, a)

	lq4 := synth("w4a16")
	if lq4.szh == 0 {
		t.Fatalf("w4a16: no scales in the half form")
	}
	half := downloadAs[uint32](b, lq4.szh, out*lq4.groups)
	for i, p := range downloadAs[[2]uint32](b, lq4.sz, out*lq4.groups) {
		scale := math.Float32frombits(p[0])
		z0, z1 := model.F16ToFloat32(uint16(p[1])), model.F16ToFloat32(uint16(p[1]>>16))
		if z0 != z1 || z0 < 1024 || z0 > 1039 || z0 != float32(math.Trunc(float64(z0))) {
			t.Fatalf("w4a16 group %d: zero pair %g, %g, want one half2(1024 + z), z in 0..15", i, z0, z1)
		}
		inRange("w4a16 scale", []float64{float64(scale)}, a/8*(1-0x1p-11), 2*a/8*(1+0x1p-11)) // an fp16 value
		if want := uint32(model.Float32ToF16(scale)) | p[1]<<16; model.F16ToFloat32(uint16(want)) != scale || half[i] != want {
			t.Fatalf("w4a16 group %d: half form %#08x, want %#08x (scale %g, an fp16 value)", i, half[i], want, scale)
		}
	}
	lq8 := synth("w8a16")
	for i, p := range downloadAs[[2]float32](b, lq8.sz, out*lq8.groups) {
		if p[1] != 0 {
			t.Fatalf("w8a16 group %d: zero %g, want 0", i, p[1])
		}
		inRange("w8a16 scale", []float64{float64(p[0])}, a/128, 2*a/128)
	}
	for _, c := range []struct {
		format string
		bytes  int64 // the codes and one group's figures a row
	}{{"w4a16-pc", out*in/2 + 12*out}, {"w8a16-pc", out*in + 8*out}} {
		if l := synth(c.format); l.groups != 1 || l.gs != in || l.bytes != c.bytes {
			t.Errorf("%s: %d groups of %d columns, %d bytes; want 1 of %d, %d bytes", c.format, l.groups, l.gs, l.bytes, in, c.bytes)
		}
	}
	ls8 := synth("w8a8")
	deq := make([]float64, out)
	for i, v := range downloadAs[float32](b, ls8.deq, out) {
		deq[i] = float64(v)
	}
	inRange("w8a8 dequantization scale", deq, -a/8192, a/8192)

	nv0, err := b.UploadVector("synthetic norm", &Synthetic{Format: "fp16", Dims: []int{in}, Seed: 4})
	if err != nil {
		t.Fatal(err)
	}
	defer b.FreeVector(nv0)
	nv := make([]float64, in)
	for i, x := range downloadAs[float32](b, nv0.(*Vector).p, in) {
		nv[i] = float64(x)
	}
	inRange("synthetic vector", nv, 0.9, 1.1)
}
