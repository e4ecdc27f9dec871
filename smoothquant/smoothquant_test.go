package smoothquant

import (
	"math"
	"math/rand/v2"
	"testing"

	"qtool/formats/model"
	"qtool/runtime/cpu"
)

func TestScalesByHand(t *testing.T) {
	// act max [4, 1, 9], weight column max [1, 4, 1] over the two weights:
	// α=0.5 → s = sqrt(a)/sqrt(w) = [2, 0.5, 3].
	act := []float32{4, 1, 9}
	ws := [][]float32{{1, -2, 0.5}, {-0.5, 4, -1}}
	s := Scales(act, ws, 0.5)
	want := []float64{2, 0.5, 3}
	for i := range want {
		if math.Abs(float64(s[i])-want[i]) > 1e-6 {
			t.Fatalf("s = %v, want %v", s, want)
		}
	}
	// α=1: s = act max; α=0: s = 1/weight max.
	s1, s0 := Scales(act, ws, 1), Scales(act, ws, 1e-12)
	for i := range act {
		if math.Abs(float64(s1[i]-act[i])) > 1e-5 {
			t.Fatalf("α=1: %v", s1)
		}
	}
	if math.Abs(float64(s0[1])-0.25) > 1e-5 {
		t.Fatalf("α→0: %v", s0)
	}
}

func TestActRange(t *testing.T) {
	cases := []struct{ lo, hi float32 }{{-1, 3}, {0.5, 2}, {-4, -1}, {-2.55, 2.55}}
	for _, c := range cases {
		s, off := ActRange(c.lo, c.hi)
		if off != float32(math.Round(float64(off))) {
			t.Fatalf("offset %g is not an integer", off)
		}
		lo, hi := min(c.lo, 0), max(c.hi, 0)
		if math.Abs(float64(s)-float64(hi-lo)/255) > 1e-7 {
			t.Fatalf("[%g,%g]: scale %g", c.lo, c.hi, s)
		}
		// both ends map inside [-128, 127] within half a step, 0 exactly
		for _, x := range []float32{lo, hi} {
			q := float64(x/s + off)
			if q < -128.5 || q > 127.5 {
				t.Fatalf("[%g,%g]: %g maps to %g", c.lo, c.hi, x, q)
			}
		}
	}
}

// TestW8A8MatchesRuntime: the W8A8 built here, run by the CPU backend's
// exact integer path, equals this package's float simulation and stays close
// to the float product.
func TestW8A8MatchesRuntime(t *testing.T) {
	rng := rand.New(rand.NewPCG(9, 9))
	const rows, cols, n = 24, 64, 16
	w := make([]float32, rows*cols)
	for i := range w {
		w[i] = float32(rng.NormFloat64() * 0.05)
	}
	x := make([]float32, n*cols)
	for i := range x {
		x[i] = float32(rng.NormFloat64() + 0.3)
	}
	bias := make([]float32, rows)
	for i := range bias {
		bias[i] = float32(rng.NormFloat64())
	}
	lo, hi := MinMax(x)
	sc, off := ActRange(lo, hi)
	w8, err := W8A8(w, rows, cols, bias, sc, off)
	if err != nil {
		t.Fatal(err)
	}
	sim := simulateW8A8(x, n, cols, w8)
	be := cpu.New(1)
	lin, err := be.UploadLinear("w", w8)
	if err != nil {
		t.Fatal(err)
	}
	xb, yb := be.Alloc(n, cols), be.Alloc(n, rows)
	be.Upload(xb, x)
	be.MatMul(yb, xb, lin)
	got := make([]float32, n*rows)
	be.Download(got, yb)
	num, den := 0.0, 0.0
	for i := 0; i < n; i++ {
		for j := 0; j < rows; j++ {
			if d := math.Abs(float64(got[i*rows+j] - sim[i*rows+j])); d > 1e-4 {
				t.Fatalf("(%d,%d): runtime %g, simulation %g", i, j, got[i*rows+j], sim[i*rows+j])
			}
			ref := float64(bias[j])
			for k := 0; k < cols; k++ {
				ref += float64(x[i*cols+k]) * float64(w[j*cols+k])
			}
			num += (float64(got[i*rows+j]) - ref) * (float64(got[i*rows+j]) - ref)
			den += ref * ref
		}
	}
	if num/den > 1e-3 {
		t.Fatalf("relative error %g of W8A8 vs float", num/den)
	}
	var _ model.Tensor = w8
}

// simulateW8A8 is a direct float64 evaluation of the W8A8 formulas:
// y = (Σ_k clamp(round(x/scale + offset))·W_q + quant_bias)·deq_scale.
func simulateW8A8(x []float32, n, cols int, w *model.W8A8) []float32 {
	rows := w.Weight.Rows
	y := make([]float32, n*rows)
	for i := 0; i < n; i++ {
		for j := 0; j < rows; j++ {
			acc := 0.0
			for k := 0; k < cols; k++ {
				q := math.RoundToEven(float64(x[i*cols+k]/w.InputScale + w.InputOffset))
				acc += math.Min(math.Max(q, -128), 127) * float64(w.Weight.Q[j*cols+k])
			}
			y[i*rows+j] = float32((acc + float64(w.QuantBias[j])) * float64(w.DeqScale[j]))
		}
	}
	return y
}
