package runtime

import "errors"

// Releaser is implemented by backends that free memory explicitly (cuda):
// a Model releases through it the uploads it replaces (SetLinear,
// SetVector) or unloads (UnloadLayer). Freeing a tensor twice, or one the
// backend did not upload, is a programmer error.
type Releaser interface {
	FreeLinear(Linear)
	FreeVector(Vector)
}

// Calibrator is a Backend that calibration (GPTQ, AWQ, SmoothQuant) can run
// on: beside the forward pass it gathers rows, wraps float buffers as
// weights and computes the statistics the quantizers need, so that the
// calibration activations never leave the backend. The cpu and cuda
// backends implement it.
type Calibrator interface {
	Backend
	Releaser
	RowCopier
	// GatherRows sets row i of dst to row rows[i] of src.
	GatherRows(dst, src Buf, rows []int)
	// FloatLinear returns the float32 buffer w [out, in] as a linear
	// weight, without copying: it is valid while w is and sees changes to
	// it. Release it with FreeLinear (which leaves w alone).
	FloatLinear(w Buf) Linear
	// Dequantize returns the float32 values of an uploaded linear as a new
	// buffer [out, in].
	Dequantize(w Linear) Buf
	// AddGram adds xᵀ·x to g [cols, cols] for x [rows, cols], in float32
	// products with at least float32 accumulation.
	AddGram(g, x Buf)
	// AddCrossGram adds xᵀ·y to g [a, b] for x [rows, a] and y [rows, b]
	// (the same rows), in float32 products with at least float32
	// accumulation.
	AddCrossGram(g, x, y Buf)
	// SolveSPD sets b = b·(a + damp·I)⁻¹ for b [rows, n] and a symmetric
	// positive definite a [n, n] (a is not changed), factorising in at
	// least float64; it returns ErrNotPositiveDefinite (wrapped) when the
	// damped a cannot be factorised.
	SolveSPD(b, a Buf, damp float64) error
	// Diagonal returns the diagonal of the square buffer g.
	Diagonal(g Buf) []float32
	// ColumnStats returns per-column statistics of x.
	ColumnStats(x Buf) ColumnStats
	// SquaredError returns Σ(a−b)² and Σb² over all elements, accumulated
	// in float64; a nil a gives Σb² twice.
	SquaredError(a, b Buf) (diff, ref float64)
	// ScaleColumns multiplies column c of x by s[c] in place, or divides
	// by it when divide is set.
	ScaleColumns(x Buf, s []float32, divide bool)
}

// ColumnStats are per-column statistics of a [rows, cols] buffer.
type ColumnStats struct {
	MeanAbs  []float32 // mean |x| (summed in float64)
	MaxAbs   []float32 // max |x|
	Min, Max []float32 // smallest and largest value
}

// GPTQJob describes one GPTQ run on a device (see GPTQSolver). The
// quantizer's rules are those of package gptq, which prepares the job.
type GPTQJob struct {
	Rows, Cols int
	Bits       int
	GroupSize  int // > 0; a per-row grid passes Cols
	BlockSize  int // columns per lazy-update block
	Sym        bool
	// Search: 0 min/max, 1 "mse" (Σ|w−q|^2.4), 2 "hmse" (Σ H_cc (w−q)²).
	Search int
	// FP16Scales rounds every scale to the nearest float16 (at least the
	// smallest normal half) before codes are computed.
	FP16Scales bool
	// Perm is the column order (act-order), nil for the natural order;
	// with Perm the group parameters are static: fitted on the original
	// weights before any update.
	Perm []int
	// Dead marks input columns whose Hessian diagonal is 0: their weights
	// are zeroed and the diagonal set to 1.
	Dead []bool
	// HDiag is the diagonal of H = 2/tokens·h (the hmse search's weights).
	HDiag []float64
	// Damp is added to the Hessian's diagonal (absolute).
	Damp float64
}

// GPTQOutput is the result of a device GPTQ run.
type GPTQOutput struct {
	// Codes are the unsigned codes 0..2^bits−1, [Rows, Cols], in the
	// column order of the job (permuted when Perm was given).
	Codes []uint8
	// Scale and Zero are per (row, group) of the original column order,
	// Zero on the unsigned grid.
	Scale, Zero []float32
	// Loss is Σ (w−q)²/(2·d²) with d the diagonal of the inverse Hessian's
	// upper Cholesky factor.
	Loss float64
}

// GPTQSolver is implemented by backends that factorise the Hessian and run
// GPTQ's column loop themselves (cuda). h is the Gram matrix Σxᵀx [Cols,
// Cols] of tokens inputs (the solver uses H = 2/tokens·h, GPTQ's Hessian,
// and adds job.Damp to its diagonal), w the float weight [Rows, Cols];
// neither is changed. It returns ErrNotPositiveDefinite (wrapped) when the damped
// Hessian cannot be factorised.
type GPTQSolver interface {
	GPTQ(h, w Buf, tokens int, job GPTQJob) (*GPTQOutput, error)
}

// AWQSolver is implemented by backends that run AWQ's weight-side search
// steps themselves (cuda). The quantizer is AWQ's asymmetric per-group
// rule (package quantize, AsymAWQ) with fp16 scales unless fp32Scales.
type AWQSolver interface {
	// FakeQuantAWQ sets dst = Q(w·diag(s))·diag(s)⁻¹ for w [out, in] and
	// column scales s (nil: all ones).
	FakeQuantAWQ(dst, w Buf, s []float32, bits, group int, fp32Scales bool)
	// ClipSearchAWQ returns, per (row, group) of w, the clipping threshold
	// max|w|·(1 − i/grid), i < steps, that minimises dᵀ·G_g·d with d the
	// group's quantization error and G_g the group's block of gram (Σxᵀx
	// of the search tokens).
	ClipSearchAWQ(w, gram Buf, bits, group, grid, steps int, fp32Scales bool) []float32
}

// ErrNotPositiveDefinite is returned (wrapped) when a damped Hessian cannot
// be factorised.
var ErrNotPositiveDefinite = errors.New("Hessian is not positive definite")
