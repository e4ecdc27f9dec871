package gptq

import (
	"math"
	"math/rand/v2"
	"testing"

	"gonum.org/v1/gonum/mat"

	"qtool/runtime"
	"qtool/runtime/cpu"
)

// asymProblem is a small layer: float inputs x, quantized inputs xq = x +
// noise, and the residual streams y (float) and yq its output joins.
type asymProblem struct {
	n, in, out int
	w          []float32 // [out, in]
	x, xq      []float32 // [n, in]
	y, yq      []float32 // [n, out]
}

func newAsymProblem(seed uint64, n, in, out int, noise float64) asymProblem {
	r := rand.New(rand.NewPCG(seed, 3))
	randn := func(k int, sd float64) []float32 {
		v := make([]float32, k)
		for i := range v {
			v[i] = float32(r.NormFloat64() * sd)
		}
		return v
	}
	p := asymProblem{n: n, in: in, out: out, w: randn(out*in, 0.3), x: randn(n*in, 1), y: randn(n*out, 1)}
	p.xq, p.yq = append([]float32(nil), p.x...), append([]float32(nil), p.y...)
	for i := range p.xq {
		p.xq[i] += float32(r.NormFloat64() * noise)
	}
	for i := range p.yq {
		p.yq[i] += float32(r.NormFloat64() * noise)
	}
	return p
}

func dense(rows, cols int, v []float32) *mat.Dense {
	d := mat.NewDense(rows, cols, nil)
	for i, x := range v {
		d.RawMatrix().Data[i] = float64(x)
	}
	return d
}

// targetOf runs targetTerms on the CPU backend.
func targetOf(t *testing.T, p asymProblem, beta, damp float64, withResid bool) []float32 {
	t.Helper()
	be := cpu.New(2)
	up := func(v []float32, rows, cols int) runtime.Buf {
		b := be.Alloc(rows, cols)
		be.Upload(b, v)
		return b
	}
	xq := up(p.xq, p.n, p.in)
	g := be.Alloc(p.in, p.in)
	be.AddGram(g, xq)
	var rf, rq runtime.Buf
	if withResid {
		rf, rq = up(p.y, p.n, p.out), up(p.yq, p.n, p.out)
	}
	terms := newTargetTerms(be, xq, up(p.x, p.n, p.in), g, rf, rq, beta, damp)
	defer terms.free()
	out, err := terms.weights([]runtime.Buf{up(p.w, p.out, p.in)})
	if err != nil {
		t.Fatal(err)
	}
	v := make([]float32, p.out*p.in)
	be.Download(v, out[0])
	return v
}

// TestTargetIsLeastSquares compares the asymmetric target with the
// least-squares solution of ‖X·Wᵀ + β(Y − Ỹ) − X̃·Vᵀ‖² computed directly in
// float64 (normal equations, no damping).
func TestTargetIsLeastSquares(t *testing.T) {
	for _, tc := range []struct {
		name  string
		beta  float64
		resid bool
		noise float64
	}{
		{"inputs only", 0, false, 0.1},
		{"full residual gap", 1, true, 0.1},
		{"half residual gap", 0.5, true, 0.3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			p := newAsymProblem(7, 300, 10, 6, tc.noise)
			got := targetOf(t, p, tc.beta, 1e-9, tc.resid)
			X, Xq, W := dense(p.n, p.in, p.x), dense(p.n, p.in, p.xq), dense(p.out, p.in, p.w)
			var T mat.Dense // the target outputs X·Wᵀ + β(Y − Ỹ)
			T.Mul(X, W.T())
			if tc.resid {
				var gap mat.Dense
				gap.Sub(dense(p.n, p.out, p.y), dense(p.n, p.out, p.yq))
				gap.Scale(tc.beta, &gap)
				T.Add(&T, &gap)
			}
			var V mat.Dense // argmin ‖T − X̃·Vᵀ‖², [in, out]
			if err := V.Solve(Xq, &T); err != nil {
				t.Fatal(err)
			}
			for o := 0; o < p.out; o++ {
				for i := 0; i < p.in; i++ {
					if d := math.Abs(float64(got[o*p.in+i]) - V.At(i, o)); d > 1e-4 {
						t.Fatalf("(%d,%d): target %g, least squares %g", o, i, got[o*p.in+i], V.At(i, o))
					}
				}
			}
		})
	}
}

// TestTargetSplitsTheObjective checks the identity GPTQ relies on: for any
// Q, ‖X·Wᵀ + (Y − Ỹ) − X̃·Qᵀ‖² − ‖(W̃ − Q)·X̃ᵀ‖² is the same constant, so
// rounding W̃ under X̃'s Hessian minimises the error against the float
// model.
func TestTargetSplitsTheObjective(t *testing.T) {
	p := newAsymProblem(11, 200, 8, 5, 0.2)
	wt := targetOf(t, p, 1, 1e-9, true)
	X, Xq := dense(p.n, p.in, p.x), dense(p.n, p.in, p.xq)
	var T, gap mat.Dense
	T.Mul(X, dense(p.out, p.in, p.w).T())
	gap.Sub(dense(p.n, p.out, p.y), dense(p.n, p.out, p.yq))
	T.Add(&T, &gap)
	r := rand.New(rand.NewPCG(5, 5))
	constant := math.NaN()
	for k := 0; k < 4; k++ {
		q := make([]float32, len(p.w))
		for i := range q {
			q[i] = p.w[i] + float32(r.NormFloat64()*0.05) // a rounded weight
		}
		Q := dense(p.out, p.in, q)
		var e, d, dx mat.Dense
		e.Mul(Xq, Q.T())
		e.Sub(&T, &e)
		d.Sub(dense(p.out, p.in, wt), Q)
		dx.Mul(Xq, d.T())
		full, split := mat.Norm(&e, 2), mat.Norm(&dx, 2)
		c := full*full - split*split
		if k > 0 && math.Abs(c-constant) > 1e-6*full*full {
			t.Fatalf("Q %d: objective − split objective = %g, Q 0 gave %g", k, c, constant)
		}
		constant = c
	}
}

// TestTargetOfExactInputs: with X̃ = X and no residual gap the target is
// the weight itself (plain GPTQ).
func TestTargetOfExactInputs(t *testing.T) {
	p := newAsymProblem(3, 100, 12, 4, 0)
	got := targetOf(t, p, 0, 0.01, false)
	for i := range got {
		if got[i] != p.w[i] {
			t.Fatalf("element %d: %g, want %g", i, got[i], p.w[i])
		}
	}
}

func TestTargetDamp(t *testing.T) {
	for _, tc := range []struct {
		damp     float64
		in, rows int
		want     float64
	}{
		{0.01, 256, 65536, 0.01},              // plenty of tokens: the base damping
		{0.01, 768, 65536, 2 * 768.0 / 65536}, // llama-mini's down projection
		{0.01, 11008, 65536, 2 * 11008.0 / 65536},
		{0.5, 100, 1000, 0.5},
	} {
		if got := targetDamp(tc.damp, tc.in, tc.rows); math.Abs(got-tc.want) > 1e-12 {
			t.Errorf("targetDamp(%g, %d, %d) = %g, want %g", tc.damp, tc.in, tc.rows, got, tc.want)
		}
	}
}
