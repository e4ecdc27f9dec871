package gptq

import (
	"errors"
	"math"
	"math/rand/v2"
	"qtool/runtime/cpu"
	"strings"
	"testing"
)

func hessianOf(t *testing.T, x []float32, rows, cols int) *Hessian {
	t.Helper()
	h := NewHessian(cols)
	if err := h.Add(x, rows); err != nil {
		t.Fatal(err)
	}
	return h
}

func deq(t *testing.T, r *Result) []float32 {
	t.Helper()
	w, err := r.Q.Float32()
	if err != nil {
		t.Fatal(err)
	}
	return w
}

// TestTwoColumnsByHand checks GPTQ on a 1×2 weight against the closed-form
// optimal-brain-surgeon update w2 += (w1−q1)·H12/H22 solved by hand.
func TestTwoColumnsByHand(t *testing.T) {
	// X = [[1,1],[1,0]] → H = 2/2·XᵀX = [[2,1],[1,1]], damping 0.01·1.5.
	x := []float32{1, 1, 1, 0}
	h := hessianOf(t, x, 2, 2)
	w := []float32{0.3, -0.4}
	r, err := Quantize(w, 1, 2, h, Options{Bits: 2, FP32Scales: true})
	if err != nil {
		t.Fatal(err)
	}
	// By hand: 2-bit asym grid over [min(w,0), max(w,0)] = [-0.4, 0.3]:
	s := 0.7 / 3
	z := math.RoundToEven(0.4 / s) // 2
	q := func(v float64) float64 { return s * (math.Min(3, math.Max(0, math.RoundToEven(v/s)+z)) - z) }
	lam := 0.01 * 1.5
	h11, h12, h22 := 2+lam, 1.0, 1+lam
	q1 := q(0.3)
	w2 := -0.4 + (0.3-q1)*h12/h22 // OBS update of the remaining column
	q2 := q(w2)
	got := deq(t, r)
	if math.Abs(float64(got[0])-q1) > 1e-6 || math.Abs(float64(got[1])-q2) > 1e-6 {
		t.Fatalf("got %v, want [%g %g]", got, q1, q2)
	}
	// RTN would round w2 = -0.4 to -0.4667; GPTQ must pick -0.2333 here.
	if math.Abs(q2-(-s)) > 1e-9 {
		t.Fatalf("hand computation expected q2 = -s, got %g", q2)
	}
	// Loss: e_i = (w_i − q_i)/U_ii with U the upper Cholesky factor of H⁻¹.
	det := h11*h22 - h12*h12
	u00 := math.Sqrt(h22 / det)
	u11 := math.Sqrt(1 / h22)
	e1, e2 := (0.3-q1)/u00, (w2-q2)/u11
	if want := (e1*e1 + e2*e2) / 2; math.Abs(r.Loss-want) > 1e-9 {
		t.Fatalf("loss %g, want %g", r.Loss, want)
	}
}

// naiveGPTQ is the textbook OBS/OBQ-style loop: quantize column i, update the
// remaining columns with the explicit inverse Hessian, then remove column i
// from the inverse. No Cholesky, no blocking.
func naiveGPTQ(w []float32, rows, cols int, H []float64, bits, gs int, sym bool) []float64 {
	n := cols
	Hd := append([]float64(nil), H...)
	mean := 0.0
	for i := 0; i < n; i++ {
		mean += Hd[i*n+i]
	}
	for i := 0; i < n; i++ {
		Hd[i*n+i] += 0.01 * mean / float64(n)
	}
	inv := invert(Hd, n)
	W := make([]float64, len(w))
	for i, v := range w {
		W[i] = float64(v)
	}
	out := make([]float64, len(w))
	maxq := float64(int(1)<<bits - 1)
	sc := make([]float64, rows)
	zr := make([]float64, rows)
	for i := 0; i < n; i++ {
		if i%gs == 0 {
			for r := 0; r < rows; r++ {
				lo, hi := 0.0, 0.0
				for c := i; c < i+gs; c++ {
					lo, hi = math.Min(lo, W[r*n+c]), math.Max(hi, W[r*n+c])
				}
				if sym {
					hi = math.Max(-lo, hi)
					if lo < 0 {
						lo = -hi
					}
				}
				sc[r] = (hi - lo) / maxq
				if sym {
					zr[r] = (maxq + 1) / 2
				} else {
					zr[r] = math.RoundToEven(-lo / sc[r])
				}
			}
		}
		for r := 0; r < rows; r++ {
			x := W[r*n+i]
			qv := math.Min(maxq, math.Max(0, math.RoundToEven(x/sc[r])+zr[r]))
			dq := sc[r] * (qv - zr[r])
			out[r*n+i] = dq
			e := (x - dq) / inv[i*n+i]
			for j := i + 1; j < n; j++ {
				W[r*n+j] -= e * inv[i*n+j]
			}
		}
		d := inv[i*n+i]
		ci := make([]float64, n)
		for a := 0; a < n; a++ {
			ci[a] = inv[a*n+i]
		}
		for a := 0; a < n; a++ {
			for b := 0; b < n; b++ {
				inv[a*n+b] -= ci[a] * ci[b] / d
			}
		}
	}
	return out
}

// invert is Gauss-Jordan with partial pivoting.
func invert(a []float64, n int) []float64 {
	m := append([]float64(nil), a...)
	inv := make([]float64, n*n)
	for i := 0; i < n; i++ {
		inv[i*n+i] = 1
	}
	for c := 0; c < n; c++ {
		p := c
		for r := c + 1; r < n; r++ {
			if math.Abs(m[r*n+c]) > math.Abs(m[p*n+c]) {
				p = r
			}
		}
		for k := 0; k < n; k++ {
			m[c*n+k], m[p*n+k] = m[p*n+k], m[c*n+k]
			inv[c*n+k], inv[p*n+k] = inv[p*n+k], inv[c*n+k]
		}
		d := m[c*n+c]
		for k := 0; k < n; k++ {
			m[c*n+k] /= d
			inv[c*n+k] /= d
		}
		for r := 0; r < n; r++ {
			if r == c {
				continue
			}
			f := m[r*n+c]
			for k := 0; k < n; k++ {
				m[r*n+k] -= f * m[c*n+k]
				inv[r*n+k] -= f * inv[c*n+k]
			}
		}
	}
	return inv
}

func randProblem(seed uint64, rows, cols, tokens int) ([]float32, []float32) {
	rng := rand.New(rand.NewPCG(seed, 1))
	w := make([]float32, rows*cols)
	for i := range w {
		w[i] = float32(rng.NormFloat64() * 0.1)
	}
	x := make([]float32, tokens*cols)
	for t := 0; t < tokens; t++ {
		common := rng.NormFloat64()
		for c := 0; c < cols; c++ {
			x[t*cols+c] = float32(rng.NormFloat64()*(1+float64(c%5)) + 0.5*common)
		}
	}
	return w, x
}

func TestAgainstNaiveOBS(t *testing.T) {
	cases := []struct {
		name       string
		bits, gs   int
		sym        bool
		block      int
		rows, cols int
	}{
		{"w4 g8 asym block 128", 4, 8, false, 128, 6, 32},
		{"w3 g16 asym block 5", 3, 16, false, 5, 5, 48},
		{"w4 per-row sym block 7", 4, 0, true, 7, 4, 24},
		{"w2 g4 asym block 1", 2, 4, false, 1, 3, 16},
		{"w8 g8 sym", 8, 8, true, 128, 3, 16},
	}
	for i, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			w, x := randProblem(uint64(i+1), tc.rows, tc.cols, 200)
			h := hessianOf(t, x, 200, tc.cols)
			r, err := Quantize(w, tc.rows, tc.cols, h, Options{Bits: tc.bits, GroupSize: tc.gs, Sym: tc.sym, BlockSize: tc.block, FP32Scales: true})
			if err != nil {
				t.Fatal(err)
			}
			gs := tc.gs
			if gs == 0 {
				gs = tc.cols
			}
			want := naiveGPTQ(w, tc.rows, tc.cols, h.Matrix(), tc.bits, gs, tc.sym)
			got := deq(t, r)
			for k := range want {
				if math.Abs(float64(got[k])-want[k]) > 1e-5 {
					t.Fatalf("element %d: got %g, want %g", k, got[k], want[k])
				}
			}
		})
	}
}

// With a diagonal Hessian no error can be compensated: GPTQ equals RTN on
// the same min/max grid.
func TestDiagonalHessianIsRTN(t *testing.T) {
	w, _ := randProblem(7, 4, 16, 1)
	h := NewHessian(16)
	g := make([]float32, 256)
	for i := 0; i < 16; i++ {
		g[i*16+i] = float32(1 + i)
	}
	if err := h.AddGram(g, 1); err != nil {
		t.Fatal(err)
	}
	r, err := Quantize(w, 4, 16, h, Options{Bits: 3, GroupSize: 8, FP32Scales: true})
	if err != nil {
		t.Fatal(err)
	}
	got := deq(t, r)
	for row := 0; row < 4; row++ {
		for g0 := 0; g0 < 16; g0 += 8 {
			lo, hi := 0.0, 0.0
			for c := g0; c < g0+8; c++ {
				lo, hi = math.Min(lo, float64(w[row*16+c])), math.Max(hi, float64(w[row*16+c]))
			}
			s := (hi - lo) / 7
			z := math.RoundToEven(-lo / s)
			for c := g0; c < g0+8; c++ {
				want := s * (math.Min(7, math.Max(0, math.RoundToEven(float64(w[row*16+c])/s)+z)) - z)
				if math.Abs(float64(got[row*16+c])-want) > 1e-6 {
					t.Fatalf("(%d,%d): got %g want %g", row, c, got[row*16+c], want)
				}
			}
		}
	}
}

func TestActOrderStaticGroups(t *testing.T) {
	w, x := randProblem(3, 8, 32, 300)
	h := hessianOf(t, x, 300, 32)
	plain, err := Quantize(w, 8, 32, h, Options{Bits: 3, GroupSize: 8})
	if err != nil {
		t.Fatal(err)
	}
	ao, err := Quantize(w, 8, 32, h, Options{Bits: 3, GroupSize: 8, ActOrder: true})
	if err != nil {
		t.Fatal(err)
	}
	if ao.Q.GIdx != nil {
		t.Fatal("static groups must give plain c/GroupSize groups")
	}
	// Static groups: scales are those of the original weights' groups.
	for r := 0; r < 8; r++ {
		for g := 0; g < 4; g++ {
			lo, hi := 0.0, 0.0
			for c := g * 8; c < g*8+8; c++ {
				lo, hi = math.Min(lo, float64(w[r*32+c])), math.Max(hi, float64(w[r*32+c]))
			}
			want := fp16Round((hi - lo) / 7)
			if got := float64(ao.Q.Scale[r*4+g]); math.Abs(got-want) > 1e-9 {
				t.Fatalf("scale (%d,%d) = %g, want %g", r, g, got, want)
			}
		}
	}
	// Both must beat RTN on the proxy loss tr(ΔW H ΔWᵀ).
	H := h.Matrix()
	proxy := func(q []float32) float64 {
		s := 0.0
		for r := 0; r < 8; r++ {
			for i := 0; i < 32; i++ {
				di := float64(q[r*32+i] - w[r*32+i])
				for j := 0; j < 32; j++ {
					s += di * H[i*32+j] * float64(q[r*32+j]-w[r*32+j])
				}
			}
		}
		return s
	}
	rtn, _ := Quantize(w, 8, 32, diagOnly(h), Options{Bits: 3, GroupSize: 8})
	pr, pp, pa := proxy(deq(t, rtn)), proxy(deq(t, plain)), proxy(deq(t, ao))
	if pp >= pr || pa >= pr {
		t.Fatalf("proxy loss RTN %g, GPTQ %g, act-order %g: GPTQ should win", pr, pp, pa)
	}
}

func diagOnly(h *Hessian) *Hessian {
	d := NewHessian(h.Cols)
	d.n = h.n
	for i := 0; i < h.Cols; i++ {
		d.sum[i*h.Cols+i] = h.sum[i*h.Cols+i]
	}
	return d
}

func TestDeadColumns(t *testing.T) {
	w, x := randProblem(5, 3, 8, 50)
	for tk := 0; tk < 50; tk++ {
		x[tk*8+2] = 0
	}
	h := hessianOf(t, x, 50, 8)
	r, err := Quantize(w, 3, 8, h, Options{Bits: 4, GroupSize: 8})
	if err != nil {
		t.Fatal(err)
	}
	if r.DeadCols != 1 {
		t.Fatalf("dead columns %d, want 1", r.DeadCols)
	}
	got := deq(t, r)
	for row := 0; row < 3; row++ {
		if got[row*8+2] != 0 {
			t.Fatalf("dead column weight (%d,2) = %g, want 0", row, got[row*8+2])
		}
	}
}

func TestBadInput(t *testing.T) {
	nan := float32(math.NaN())
	cases := []struct {
		name string
		run  func() error
		want string
	}{
		{"NaN activation", func() error { return NewHessian(2).Add([]float32{1, nan}, 1) }, "activation (token 0, channel 1)"},
		{"Inf Gram", func() error {
			return NewHessian(1).AddGram([]float32{float32(math.Inf(1))}, 1)
		}, "NaN/Inf"},
		{"group does not divide", func() error {
			h := NewHessian(6)
			_ = h.Add([]float32{1, 2, 3, 4, 5, 6}, 1)
			_, err := Quantize(make([]float32, 6), 1, 6, h, Options{Bits: 4, GroupSize: 4})
			return err
		}, "does not divide"},
		{"bad bits", func() error {
			_, err := Quantize(make([]float32, 2), 1, 2, NewHessian(2), Options{Bits: 5})
			return err
		}, "5 bits"},
		{"no tokens", func() error {
			_, err := Quantize(make([]float32, 2), 1, 2, NewHessian(2), Options{Bits: 4})
			return err
		}, "no calibration tokens"},
		{"indefinite Hessian", func() error {
			h := NewHessian(2)
			_ = h.AddGram([]float32{1, 3, 3, 1}, 2)
			_, err := Quantize([]float32{1, 2}, 1, 2, h, Options{Bits: 4})
			if !errors.Is(err, ErrNotPositiveDefinite) {
				return errors.New("wrong error " + err.Error())
			}
			return err
		}, "not positive definite"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			err := tc.run()
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
}

func TestDampingRetry(t *testing.T) {
	// eigenvalues 1±1.05: indefinite at damp 0.01, fixed at 0.1.
	h := NewHessian(2)
	if err := h.AddGram([]float32{1, 1.05, 1.05, 1}, 2); err != nil {
		t.Fatal(err)
	}
	r, err := Quantize([]float32{0.5, -0.25}, 1, 2, h, Options{Bits: 4})
	if err != nil {
		t.Fatal(err)
	}
	if r.Retries != 1 || math.Abs(r.DampFrac-0.1) > 1e-12 {
		t.Fatalf("retries %d damp %g, want 1 retry at 0.1", r.Retries, r.DampFrac)
	}
}

// TestBackendGramMatchesAdd checks the CPU backend's Gram matrix (the
// Hessian accumulation calibration uses) against Hessian.Add.
func TestBackendGramMatchesAdd(t *testing.T) {
	_, x := randProblem(11, 1, 40, 5000)
	a, b := NewHessian(40), NewHessian(40)
	if err := a.Add(x, 5000); err != nil {
		t.Fatal(err)
	}
	be := cpu.New(2)
	xb, g := be.Alloc(5000, 40), be.Alloc(40, 40)
	be.Upload(xb, x)
	be.AddGram(g, xb)
	gv := make([]float32, 40*40)
	be.Download(gv, g)
	if err := b.AddGram(gv, 5000); err != nil {
		t.Fatal(err)
	}
	ha, hb := a.Matrix(), b.Matrix()
	for i := range ha {
		if math.Abs(ha[i]-hb[i]) > 1e-4*math.Max(1, math.Abs(ha[i])) {
			t.Fatalf("entry %d: %g vs %g", i, ha[i], hb[i])
		}
	}
}

func TestThreadsAgree(t *testing.T) {
	w, x := randProblem(21, 64, 48, 300)
	h := hessianOf(t, x, 300, 48)
	for _, ao := range []bool{false, true} {
		a, err := Quantize(w, 64, 48, h, Options{Bits: 4, GroupSize: 16, ActOrder: ao, Search: "hmse"})
		if err != nil {
			t.Fatal(err)
		}
		b, err := Quantize(w, 64, 48, h, Options{Bits: 4, GroupSize: 16, ActOrder: ao, Search: "hmse", Threads: 3})
		if err != nil {
			t.Fatal(err)
		}
		if math.Abs(a.Loss-b.Loss) > 1e-9*a.Loss {
			t.Fatalf("losses %g vs %g", a.Loss, b.Loss)
		}
		for i := range a.Q.Q {
			if a.Q.Q[i] != b.Q.Q[i] {
				t.Fatalf("code %d differs", i)
			}
		}
	}
}
