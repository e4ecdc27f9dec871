package gptq

import (
	"errors"
	"fmt"
	"math"
	"slices"

	"qtool/formats/model"
)

// SparseOptions are the knobs of Prune and Magnitude.
type SparseOptions struct {
	// Sparsity is the fraction of each row's weights set to zero
	// (unstructured), in [0, 1). With N and M set it must be 0.
	Sparsity float64
	// N, M select N:M semi-structured sparsity (2:4: N 2, M 4): in every M
	// consecutive input columns of a row, N weights are zero. 0, 0 for
	// unstructured.
	N, M int
	// Quant also quantizes the kept weights to per-row symmetric int8 (the
	// SymZero rule of W8A8 weights: scale = max|w|/127 of the row's
	// original weights, codes round(w/scale) in ±127), jointly with the
	// pruning: each column's error is the difference to its code (or to 0
	// when pruned).
	Quant bool
	// Damp is the damping as a fraction of mean(diag H); 0 means 0.01.
	Damp float64
	// BlockSize is the number of columns whose unstructured mask is chosen
	// together; 0 means 128.
	BlockSize int
	// Threads is the number of goroutines over the rows (0: 1).
	Threads int
}

// SparseResult is one pruned linear.
type SparseResult struct {
	W []float32 // the pruned (with Quant: dequantized) weight [rows, cols]
	// Q holds the int8 codes and per-row scales with Quant (pruned weights
	// are code 0), nil otherwise.
	Q *model.Quantized
	// Loss is Σ e²/2 over the columns, e = (w − q)/d with d the diagonal of
	// the inverse Hessian's Cholesky factor (GPTQ's Result.Loss); 0 for
	// Magnitude.
	Loss  float64
	Zeros int // zero weights in W
}

func (o SparseOptions) validate(rows, cols, n int) error {
	switch {
	case o.N != 0 || o.M != 0:
		if o.N <= 0 || o.M <= 0 || o.N >= o.M {
			return fmt.Errorf("gptq: sparse: %d:%d sparsity, want 0 < N < M", o.N, o.M)
		}
		if o.Sparsity != 0 {
			return fmt.Errorf("gptq: sparse: both a sparsity %g and %d:%d", o.Sparsity, o.N, o.M)
		}
		if cols%o.M != 0 {
			return fmt.Errorf("gptq: sparse: %d input columns are not a multiple of M = %d", cols, o.M)
		}
	case !(o.Sparsity >= 0 && o.Sparsity < 1):
		return fmt.Errorf("gptq: sparse: sparsity %g, want a fraction in [0, 1)", o.Sparsity)
	}
	if o.Damp < 0 || o.Damp >= 1 || math.IsNaN(o.Damp) {
		return fmt.Errorf("gptq: sparse: damp %g, want a fraction in [0, 1)", o.Damp)
	}
	if rows <= 0 || cols <= 0 || n != rows*cols {
		return fmt.Errorf("gptq: sparse: weight has %d values, want %d×%d", n, rows, cols)
	}
	return nil
}

// rowScale is the SymZero int8 scale of a row: max|w|/127 (0 for a zero row).
func rowScale(w []float32) float64 {
	m := float32(0)
	for _, v := range w {
		m = max(m, float32(math.Abs(float64(v))))
	}
	return float64(m / 127)
}

// code8 is the int8 code of x on scale s (0 when s is 0).
func code8(x, s float64) float64 {
	if s == 0 {
		return 0
	}
	return max(-127, min(127, math.RoundToEven(x/s)))
}

// pruneCount is the number of weights pruned among a row's first c
// columns at the given sparsity, so that blocks add up to
// round(sparsity·cols) exactly.
func pruneCount(sparsity float64, c int) int { return int(math.Round(sparsity * float64(c))) }

// Prune prunes (and with opt.Quant quantizes) the weight w [rows, cols]
// SparseGPT-style (Frantar & Alistarh 2023) on the GPTQ machinery: with U
// the upper Cholesky factor of the damped H⁻¹, columns are visited in
// order; a column's weight becomes 0 when masked (else its int8 value or
// itself), and its error e = (w − q)/U_ii updates the later columns of the
// row by −e·U_i,j, the optimal compensation of the inverse Hessian. The mask
// is chosen row by row from the weights updated so far, by the saliency
// w²/U_ii²: unstructured, at the start of each block of BlockSize columns
// the lowest-saliency weights of the block, pruneCount(c1) − pruneCount(c0)
// of them, so every row ends with round(Sparsity·cols) zeros; N:M, at the
// start of each group of M columns its N lowest. The Hessian is h's; dead
// columns (diag 0) are pruned first.
func Prune(w []float32, rows, cols int, h *Hessian, opt SparseOptions) (*SparseResult, error) {
	if err := opt.validate(rows, cols, len(w)); err != nil {
		return nil, err
	}
	if h.Cols != cols {
		return nil, fmt.Errorf("gptq: sparse: Hessian is %d×%d, weight has %d input columns", h.Cols, h.Cols, cols)
	}
	if h.n == 0 {
		return nil, errors.New("gptq: sparse: no calibration tokens reached this layer")
	}
	if err := finiteWeight(w, cols); err != nil {
		return nil, err
	}
	if opt.Damp == 0 {
		opt.Damp = 0.01
	}
	if opt.BlockSize <= 0 {
		opt.BlockSize = 128
	}
	H := h.Matrix()
	for i, v := range H {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return nil, fmt.Errorf("gptq: sparse: Hessian entry (%d,%d) is %g: the calibration activations overflow", i/cols, i%cols, v)
		}
	}
	dead := make([]bool, cols)
	for i := range dead {
		if H[i*cols+i] == 0 {
			dead[i], H[i*cols+i] = true, 1
		}
	}
	U, _, _, _, err := invCholUpper(H, cols, opt.Damp)
	if err != nil {
		return nil, fmt.Errorf("gptq: sparse: %w", err)
	}
	res := &SparseResult{W: make([]float32, len(w))}
	var scales []float32
	if opt.Quant {
		res.Q = &model.Quantized{Bits: 8, Rows: rows, Cols: cols, Q: make([]int8, len(w)), Scale: make([]float32, rows)}
		scales = res.Q.Scale
	}
	losses := make([]float64, rows)
	model.Parallel(rows, max(1, rows/max(1, opt.Threads)), func(r0, r1 int) {
		row := make([]float64, cols)
		mask := make([]bool, cols)
		order := make([]int, 0, max(opt.BlockSize, opt.M))
		sal := make([]float64, cols)
		for r := r0; r < r1; r++ {
			src := w[r*cols : (r+1)*cols]
			s := 0.0
			if opt.Quant {
				s = rowScale(src)
				scales[r] = float32(s)
			}
			for c, v := range src {
				row[c] = float64(v)
				mask[c] = dead[c]
			}
			// choose marks the k lowest-saliency live columns of [c0, c1).
			choose := func(c0, c1, k int) {
				order = order[:0]
				for c := c0; c < c1; c++ {
					d := U[c*cols+c]
					sal[c] = row[c] * row[c] / (d * d)
					if mask[c] {
						k-- // a dead column counts towards the group's zeros
					} else {
						order = append(order, c)
					}
				}
				slices.SortStableFunc(order, func(a, b int) int {
					switch {
					case sal[a] < sal[b]:
						return -1
					case sal[a] > sal[b]:
						return 1
					}
					return 0
				})
				for _, c := range order[:max(0, min(k, len(order)))] {
					mask[c] = true
				}
			}
			loss := 0.0
			for i := 0; i < cols; i++ {
				switch {
				case opt.M > 0 && i%opt.M == 0:
					choose(i, i+opt.M, opt.N)
				case opt.M == 0 && i%opt.BlockSize == 0:
					i2 := min(i+opt.BlockSize, cols)
					choose(i, i2, pruneCount(opt.Sparsity, i2)-pruneCount(opt.Sparsity, i))
				}
				x := row[i]
				q := x
				switch {
				case mask[i]:
					q = 0
				case opt.Quant:
					q = code8(x, s) * s
				}
				d := U[i*cols+i]
				e := (x - q) / d
				loss += e * e / 2
				row[i] = q
				if e != 0 {
					u := U[i*cols : (i+1)*cols]
					for j := i + 1; j < cols; j++ {
						row[j] -= e * u[j]
					}
				}
			}
			losses[r] = loss
			for c, v := range row {
				res.W[r*cols+c] = float32(v)
				if opt.Quant {
					res.Q.Q[r*cols+c] = int8(code8(v, s))
					res.W[r*cols+c] = float32(float64(res.Q.Q[r*cols+c])) * float32(s)
				}
			}
		}
	})
	for _, l := range losses {
		res.Loss += l
	}
	for _, v := range res.W {
		if v == 0 {
			res.Zeros++
		}
	}
	return res, nil
}

// Magnitude prunes w by |w| alone, the baseline of Prune: unstructured,
// the round(Sparsity·cols) smallest |w| of each row; N:M, the N smallest
// of every M columns of a row. With opt.Quant the kept weights get the
// same int8 quantization as Prune's (scale from the original row).
func Magnitude(w []float32, rows, cols int, opt SparseOptions) (*SparseResult, error) {
	if err := opt.validate(rows, cols, len(w)); err != nil {
		return nil, err
	}
	if err := finiteWeight(w, cols); err != nil {
		return nil, err
	}
	res := &SparseResult{W: make([]float32, len(w))}
	if opt.Quant {
		res.Q = &model.Quantized{Bits: 8, Rows: rows, Cols: cols, Q: make([]int8, len(w)), Scale: make([]float32, rows)}
	}
	idx := make([]int, cols)
	for r := 0; r < rows; r++ {
		src := w[r*cols : (r+1)*cols]
		dst := res.W[r*cols : (r+1)*cols]
		copy(dst, src)
		smallest := func(c0, c1, k int) {
			g := idx[:0]
			for c := c0; c < c1; c++ {
				g = append(g, c)
			}
			slices.SortStableFunc(g, func(a, b int) int {
				return cmpAbs(src[a], src[b])
			})
			for _, c := range g[:k] {
				dst[c] = 0
			}
		}
		if opt.M > 0 {
			for c := 0; c < cols; c += opt.M {
				smallest(c, c+opt.M, opt.N)
			}
		} else {
			smallest(0, cols, pruneCount(opt.Sparsity, cols))
		}
		if opt.Quant {
			s := rowScale(src)
			res.Q.Scale[r] = float32(s)
			for c, v := range dst {
				q := int8(code8(float64(v), s))
				res.Q.Q[r*cols+c] = q
				dst[c] = float32(float64(q)) * float32(s)
			}
		}
	}
	for _, v := range res.W {
		if v == 0 {
			res.Zeros++
		}
	}
	return res, nil
}

func finiteWeight(w []float32, cols int) error {
	for i, v := range w {
		if v-v != 0 { // NaN or ±Inf
			return fmt.Errorf("gptq: sparse: weight (%d,%d) is %g", i/cols, i%cols, v)
		}
	}
	return nil
}

func cmpAbs(a, b float32) int {
	x, y := math.Abs(float64(a)), math.Abs(float64(b))
	switch {
	case x < y:
		return -1
	case x > y:
		return 1
	}
	return 0
}
