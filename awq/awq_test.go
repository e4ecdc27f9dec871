package awq

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"
)

// refFakeQuant is an independent transcription of AutoAWQ's
// pseudo_quantize_tensor (zero_point=True), float64, fp16 scales.
func refFakeQuant(w []float64, rows, cols, bits, group int) []float64 {
	out := make([]float64, len(w))
	maxq := float64(int(1)<<bits - 1)
	for r := 0; r < rows; r++ {
		for g := 0; g < cols; g += group {
			lo, hi := math.Inf(1), math.Inf(-1)
			for c := g; c < g+group; c++ {
				lo, hi = math.Min(lo, w[r*cols+c]), math.Max(hi, w[r*cols+c])
			}
			s := float64(float32(math.Max(hi-lo, 1e-5)) / float32(maxq))
			z := math.Min(math.Max(-math.RoundToEven(float64(float32(lo)/float32(s))), 0), maxq)
			s = fp16(s)
			for c := g; c < g+group; c++ {
				q := math.Min(math.Max(math.RoundToEven(float64(float32(w[r*cols+c])/float32(s)))+z, 0), maxq)
				out[r*cols+c] = (q - z) * s
			}
		}
	}
	return out
}

func fp16(v float64) float64 {
	// round to 11 significant bits (normal range only; enough for the test data)
	e := math.Floor(math.Log2(v))
	u := math.Pow(2, e-10)
	return math.RoundToEven(v/u) * u
}

func randMat(rng *rand.Rand, rows, cols int, sd float64) []float32 {
	w := make([]float32, rows*cols)
	for i := range w {
		w[i] = float32(rng.NormFloat64() * sd)
	}
	return w
}

// TestGridPicksBruteForceOptimum: on a single linear with one outlier input
// channel, SearchScale must return the grid point a straightforward
// float64 brute force finds optimal, with the same losses.
func TestGridPicksBruteForceOptimum(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	const rows, cols, n = 8, 16, 64
	w := randMat(rng, rows, cols, 0.1)
	x := randMat(rng, n, cols, 1)
	for tk := 0; tk < n; tk++ {
		x[tk*cols+3] *= 30 // salient channel
		x[tk*cols+9] *= 8
	}
	xMean := MeanAbs(x, n, cols)
	out := func(wv []float64) []float64 {
		o := make([]float64, n*rows)
		for tk := 0; tk < n; tk++ {
			for r := 0; r < rows; r++ {
				s := 0.0
				for c := 0; c < cols; c++ {
					s += float64(x[tk*cols+c]) * wv[r*cols+c]
				}
				o[tk*rows+r] = s
			}
		}
		return o
	}
	w64 := make([]float64, len(w))
	for i, v := range w {
		w64[i] = float64(v)
	}
	ref := out(w64)
	mseOf := func(wq []float64) float64 {
		o := out(wq)
		e := 0.0
		for i := range o {
			e += (o[i] - ref[i]) * (o[i] - ref[i])
		}
		return e / float64(len(o))
	}
	opt := Options{Bits: 3, GroupSize: 8}
	// brute force
	bestR, bestL := -1.0, math.Inf(1)
	var want []float64
	for g := 0; g < 20; g++ {
		r := float64(g) / 20
		s := make([]float64, cols)
		lo, hi := math.Inf(1), math.Inf(-1)
		for c := range s {
			s[c] = math.Max(math.Pow(float64(xMean[c]), r), 1e-4)
			lo, hi = math.Min(lo, s[c]), math.Max(hi, s[c])
		}
		for c := range s {
			s[c] = float64(float32(s[c]) / float32(math.Sqrt(lo*hi)))
		}
		ws := make([]float64, len(w))
		for i := range ws {
			ws[i] = float64(w[i] * float32(s[i%cols]))
		}
		q := refFakeQuant(ws, rows, cols, 3, 8)
		for i := range q {
			q[i] /= s[i%cols]
		}
		l := mseOf(q)
		want = append(want, l)
		if l < bestL {
			bestR, bestL = r, l
		}
	}
	loss := func(fq [][]float32) (float64, error) {
		q := make([]float64, len(fq[0]))
		for i, v := range fq[0] {
			q[i] = float64(v)
		}
		return mseOf(q), nil
	}
	res, err := SearchScale(xMean, []Linear{{W: w, Rows: rows}}, loss, opt)
	if err != nil {
		t.Fatal(err)
	}
	if res.Ratio != bestR {
		t.Fatalf("ratio %g, brute force %g (losses %v vs %v)", res.Ratio, bestR, res.Losses, want)
	}
	for i := range want {
		if math.Abs(res.Losses[i]-want[i]) > 1e-4*want[i] {
			t.Fatalf("loss at grid %d: %g, brute force %g", i, res.Losses[i], want[i])
		}
	}
	if bestR == 0 || res.Loss >= res.Losses[0] {
		t.Fatalf("the outlier case should favour r > 0 (best %g, loss %g vs RTN %g)", bestR, res.Loss, res.Losses[0])
	}
}

// TestCandidate checks the grid's scales: s ∝ xMean^r with max·min = 1.
func TestCandidate(t *testing.T) {
	xMean := []float32{1, 2, 4, 8}
	// Candidate normalisation: max·min = 1.
	s := Candidate(xMean, nil, 0.5)
	if p := float64(s[0] * s[3]); math.Abs(p-1) > 1e-6 {
		t.Fatalf("max·min = %g, want 1", p)
	}
	if math.Abs(float64(s[3]/s[0])-math.Sqrt(8)) > 1e-5 {
		t.Fatalf("s = %v, want ratios of sqrt(xMean)", s)
	}
}

// TestClipMatchesBruteForce compares SearchClip with a direct float64 loop.
func TestClipMatchesBruteForce(t *testing.T) {
	rng := rand.New(rand.NewPCG(3, 4))
	const rows, cols, n, gs = 6, 32, 40, 16
	w := randMat(rng, rows, cols, 0.1)
	w[5] = 0.9 // an outlier weight worth clipping
	x := randMat(rng, n, cols, 1)
	opt := Options{Bits: 3, GroupSize: gs}
	got, err := SearchClip(w, rows, cols, x, n, opt)
	if err != nil {
		t.Fatal(err)
	}
	for r := 0; r < rows; r++ {
		for g := 0; g < cols/gs; g++ {
			m := 0.0
			for c := g * gs; c < (g+1)*gs; c++ {
				m = math.Max(m, math.Abs(float64(w[r*cols+c])))
			}
			best, bestE := 0.0, math.Inf(1)
			for i := 0; i < 10; i++ {
				mv := float64(float32(m) * float32(1-float64(i)/20))
				wc := make([]float64, gs)
				for c := range wc {
					wc[c] = math.Min(math.Max(float64(w[r*cols+g*gs+c]), -mv), mv)
				}
				q := refFakeQuant(wc, 1, gs, 3, gs)
				e := 0.0
				for tk := 0; tk < n; tk++ {
					a, b := 0.0, 0.0
					for c := 0; c < gs; c++ {
						xv := float64(x[tk*cols+g*gs+c])
						a += xv * float64(w[r*cols+g*gs+c])
						b += xv * q[c]
					}
					e += (a - b) * (a - b)
				}
				if e < bestE*(1-1e-6) {
					best, bestE = mv, e
				}
			}
			if math.Abs(float64(got[r*2+g])-best) > 1e-6 {
				t.Fatalf("(%d,%d): threshold %g, brute force %g", r, g, got[r*2+g], best)
			}
		}
	}
}

func TestQuantizeFP16Scales(t *testing.T) {
	rng := rand.New(rand.NewPCG(5, 6))
	w := randMat(rng, 4, 32, 0.05)
	q, err := Options{Bits: 4, GroupSize: 16}.WithDefaults().Quantize(w, 4, 32)
	if err != nil {
		t.Fatal(err)
	}
	if err := q.Validate(); err != nil {
		t.Fatal(err)
	}
	w64 := make([]float64, len(w))
	for i, v := range w {
		w64[i] = float64(v)
	}
	want := refFakeQuant(w64, 4, 32, 4, 16)
	got, _ := q.Float32()
	for i := range got {
		if math.Abs(float64(got[i])-want[i]) > 1e-6 {
			t.Fatalf("%d: %g vs %g", i, got[i], want[i])
		}
	}
	for _, s := range q.Scale {
		if float64(s) != fp16(float64(s)) {
			t.Fatalf("scale %g is not a float16 value", s)
		}
	}
}

func TestBadInput(t *testing.T) {
	_, err := SearchScale([]float32{1, float32(math.NaN())}, []Linear{{W: []float32{1, 1}, Rows: 1}},
		func([][]float32) (float64, error) { return 0, nil }, Options{GroupSize: 2})
	if err == nil || !strings.Contains(err.Error(), "NaN") {
		t.Fatalf("NaN activations: %v", err)
	}
	_, err = SearchClip(make([]float32, 12), 1, 12, make([]float32, 12), 1, Options{GroupSize: 8})
	if err == nil || !strings.Contains(err.Error(), "does not divide") {
		t.Fatalf("group 8 on 12 columns: %v", err)
	}
	_, err = SearchScale([]float32{1, 1}, []Linear{{W: []float32{1, 1}, Rows: 1}},
		func([][]float32) (float64, error) { return math.NaN(), nil }, Options{GroupSize: 2})
	if err == nil {
		t.Fatal("all-NaN losses must fail")
	}
}
