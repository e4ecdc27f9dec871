package gptq

import (
	"fmt"

	"qtool/runtime"
)

// Asym configures asymmetric calibration (GPTAQ, Li et al. 2025, in closed
// form): every linear is rounded to reproduce the float model's output from
// the quantized model's input, so the errors of earlier layers are
// corrected where they arrive instead of being passed on.
type Asym struct {
	// Resid (β, 0..1) also aims o and down, whose outputs join the residual
	// stream, at the gap between the float and the quantized residual
	// streams: they correct that share of the error accumulated before
	// them. 0 leaves the residual stream to the later layers.
	Resid float64
	// Head refits the classifier (float, never quantized) to map the
	// quantized model's final hidden states to the float model's logits
	// (see RefitHead). A tied classifier becomes an untied lm_head.
	Head bool
}

// targetTerms are the statistics of one linear group's inputs that turn a
// float weight into its asymmetric target (see Target), on the backend.
type targetTerms struct {
	be runtime.Calibrator
	// gram is X̃ᵀX̃ of the quantized inputs (the session's, not owned).
	gram runtime.Buf
	// cross is X̃ᵀ(X − X̃) with X the float model's inputs [in, in].
	cross runtime.Buf
	// resid is (Y − Ỹ)ᵀX̃ with Y and Ỹ the float and the quantized
	// residual streams the group's output joins [hidden, in]; nil for none.
	resid runtime.Buf
	beta  float64
	// lambda is the damping of the solve, damp × mean(diag gram).
	lambda float64
}

// newTargetTerms accumulates the terms of the group whose quantized inputs
// are x ([rows, in], Gram matrix gram) and float inputs xf; rf and rq are
// the float and quantized residual streams the group's output joins (nil:
// none, or beta 0). damp is the damping of the solve as a fraction of
// mean(diag gram) (callers take targetDamp's).
func newTargetTerms(be runtime.Calibrator, x, xf, gram, rf, rq runtime.Buf, beta, damp float64) *targetTerms {
	t := &targetTerms{be: be, gram: gram, beta: beta}
	in := x.Cols()
	t.cross = be.Alloc(in, in)
	addGapGram(be, t.cross, x, xf, x, true)
	if rf != nil && beta != 0 {
		t.resid = be.Alloc(rf.Cols(), in)
		addGapGram(be, t.resid, x, rf, rq, false)
	}
	mean := 0.0
	for _, d := range be.Diagonal(gram) {
		mean += float64(d)
	}
	t.lambda = damp * mean / float64(in)
	return t
}

// ridge scales the least damping of a target solve with in/rows: the
// target fits in² coefficients (a map of the inputs) from rows tokens, and
// with few tokens per input it would learn the calibration text.
const ridge = 2.0

// targetDamp is the damping of a target solve as a fraction of mean(diag
// G): at least damp, and ridge·in/rows (2 × in/rows: 0.023 for
// llama-mini's 768-wide down projection under the protocol's 65536 tokens,
// 0.34 for a 7B model's 11008-wide one).
func targetDamp(damp float64, in, rows int) float64 {
	return max(damp, ridge*float64(in)/float64(rows))
}

// weights returns the targets of the float weights ws ([out_i, in] on the
// backend) as new buffers:
//
//	W̃ = W + (W·C + β·R)·(G + λI)⁻¹,  C = (X − X̃)ᵀX̃,  R = (Y − Ỹ)ᵀX̃,  G = X̃ᵀX̃.
//
// With β = 1 and λ = 0, W̃ minimises ‖X·Wᵀ + Y − X̃·W̃ᵀ − Ỹ‖² (the output
// of the float layer and its residual stream against the quantized ones),
// and its residual is orthogonal to X̃, so for every Q
//
//	‖X·Wᵀ + Y − X̃·Qᵀ − Ỹ‖² = ‖(W̃ − Q)·X̃ᵀ‖² + const:
//
// GPTQ on W̃ with the Hessian of X̃ minimises the error against the float
// model. The residual rows R exist only where the output joins the
// residual stream (o, down: one weight, out = hidden). The weights of a
// group share one factorisation of G + λI.
func (t *targetTerms) weights(ws []runtime.Buf) ([]runtime.Buf, error) {
	be := t.be
	in, rows := t.gram.Cols(), 0
	for _, w := range ws {
		rows += w.Rows()
	}
	if t.resid != nil && (len(ws) != 1 || t.resid.Rows() != rows) {
		return nil, fmt.Errorf("gptq: target: the residual term has %d rows, the weights %d", t.resid.Rows(), rows)
	}
	b := be.Alloc(rows, in) // the weights' W·C + β·R, stacked
	defer be.Free(b)
	c := be.FloatLinear(t.cross)
	r0 := 0
	for _, w := range ws {
		wc := be.Alloc(w.Rows(), in)
		be.MatMul(wc, w, c) // W·crossᵀ = W·(X − X̃)ᵀX̃
		be.CopyRows(b, r0, wc, 0, w.Rows())
		be.Free(wc)
		r0 += w.Rows()
	}
	be.FreeLinear(c)
	if t.resid != nil {
		r := be.Alloc(rows, in)
		be.CopyRows(r, 0, t.resid, 0, rows)
		be.ScaleColumns(r, fill(in, float32(t.beta)), false)
		be.Add(b, r)
		be.Free(r)
	}
	if err := be.SolveSPD(b, t.gram, t.lambda); err != nil {
		return nil, fmt.Errorf("gptq: target: %w", err)
	}
	out := make([]runtime.Buf, len(ws))
	r0 = 0
	for i, w := range ws {
		out[i] = be.Alloc(w.Rows(), in)
		be.CopyRows(out[i], 0, b, r0, w.Rows())
		be.Add(out[i], w)
		r0 += w.Rows()
	}
	return out, nil
}

func (t *targetTerms) free() {
	for _, b := range []runtime.Buf{t.cross, t.resid} {
		if b != nil {
			t.be.Free(b)
		}
	}
}

// gapChunk bounds the rows of the difference buffers addGapGram makes.
const gapChunk = 4096

// addGapGram adds yᵀ·(a − b) to g when right, else (a − b)ᵀ·y, for a, b and
// y of the same rows, forming a − b in chunks of gapChunk rows (computing
// the difference first keeps its precision: a and b are close).
func addGapGram(be runtime.Calibrator, g, y, a, b runtime.Buf, right bool) {
	neg := fill(a.Cols(), -1)
	for r0 := 0; r0 < y.Rows(); r0 += gapChunk {
		k := min(gapChunk, y.Rows()-r0)
		d, ak, yk := be.Alloc(k, a.Cols()), be.Alloc(k, a.Cols()), be.Alloc(k, y.Cols())
		be.CopyRows(d, 0, b, r0, k)
		be.ScaleColumns(d, neg, false)
		be.CopyRows(ak, 0, a, r0, k)
		be.Add(d, ak)
		be.CopyRows(yk, 0, y, r0, k)
		if right {
			be.AddCrossGram(g, yk, d)
		} else {
			be.AddCrossGram(g, d, yk)
		}
		be.Free(d)
		be.Free(ak)
		be.Free(yk)
	}
}

// fill returns n copies of v.
func fill(n int, v float32) []float32 {
	s := make([]float32, n)
	for i := range s {
		s[i] = v
	}
	return s
}
