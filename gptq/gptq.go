// Package gptq implements GPTQ (Frantar et al., 2022): one-shot weight
// quantization that rounds one input column at a time and spreads each
// column's rounding error over the columns not yet quantized, weighted by
// the inverse Hessian H = 2·X·Xᵀ/n of the layer's calibration inputs.
//
// The package works on plain matrices: a weight W [rows=out, cols=in]
// (row-major float32) and a Hessian accumulated from the inputs X [tokens,
// cols] of that linear. It knows nothing about models or files; the
// layer-by-layer driver lives in qtool/quantize/calib.
package gptq

import (
	"errors"
	"fmt"
	"math"
	goruntime "runtime"
	"sort"
	"sync"

	"gonum.org/v1/gonum/mat"

	"qtool/formats/model"
	"qtool/runtime"
)

// Options are the knobs of one GPTQ run.
type Options struct {
	Bits      int     // 2, 3, 4 or 8
	GroupSize int     // input columns per scale group; 0 = one group per row
	Sym       bool    // symmetric grid (zero point fixed at 2^(Bits−1))
	ActOrder  bool    // quantize columns by decreasing diag(H), with static groups
	Damp      float64 // damping as a fraction of mean(diag(H)); 0 means 0.01
	BlockSize int     // columns per lazy-update block; 0 means 128
	Threads   int     // goroutines over the weight rows; 0 means 1
	// Search picks each group's range: "" or "minmax" uses the full
	// [min, max] (the reference); "mse" shrinks it (1, 0.99, …, 0.2) to the
	// smallest Σ|w−q|^2.4 (the reference quantizer's mse option); "hmse"
	// minimises Σ H_cc·(w−q)², the error weighted by the Hessian diagonal.
	Search string
	// FP32Scales keeps float32 scales; by default scales are rounded to the
	// nearest float16 before any code is computed, so that formats storing
	// fp16 scales hold exactly the weights GPTQ optimised.
	FP32Scales bool
	// Asym, when set, aims the rounding at the float model's outputs
	// instead of the float weights on the quantized inputs (see
	// QuantizeModel); nil is plain GPTQ.
	Asym *Asym
}

func (o Options) withDefaults() Options {
	if o.Damp == 0 {
		o.Damp = 0.01
	}
	if o.BlockSize <= 0 {
		o.BlockSize = 128
	}
	return o
}

// Validate checks the options against a weight with cols input columns.
func (o Options) Validate(cols int) error {
	switch o.Bits {
	case 2, 3, 4, 8:
	default:
		return fmt.Errorf("gptq: %d bits, want 2, 3, 4 or 8", o.Bits)
	}
	if o.GroupSize < 0 {
		return fmt.Errorf("gptq: group size %d, want >= 0 (0 = per row)", o.GroupSize)
	}
	if o.GroupSize > 0 && cols%o.GroupSize != 0 {
		return fmt.Errorf("gptq: group size %d does not divide the %d input columns", o.GroupSize, cols)
	}
	switch o.Search {
	case "", "minmax", "mse", "hmse":
	default:
		return fmt.Errorf("gptq: range search %q, want minmax, mse or hmse", o.Search)
	}
	if o.Damp < 0 || o.Damp >= 1 || math.IsNaN(o.Damp) {
		return fmt.Errorf("gptq: damp %g, want a fraction in [0, 1)", o.Damp)
	}
	if a := o.Asym; a != nil && (a.Resid < 0 || a.Resid > 1 || math.IsNaN(a.Resid)) {
		return fmt.Errorf("gptq: residual weight %g, want 0..1", a.Resid)
	}
	return nil
}

// Hessian accumulates Σ x·xᵀ over calibration tokens x (rows of X) of one
// linear layer; Matrix returns H = 2/n · Σ x·xᵀ as GPTQ defines it.
type Hessian struct {
	Cols int
	sum  []float64 // [Cols*Cols], full symmetric
	n    int
}

// NewHessian returns an empty accumulator for inputs of width cols.
func NewHessian(cols int) *Hessian {
	return &Hessian{Cols: cols, sum: make([]float64, cols*cols)}
}

// Tokens is the number of input rows accumulated so far.
func (h *Hessian) Tokens() int { return h.n }

// Add accumulates the rows of x ([rows, Cols], row-major). It refuses
// non-finite inputs, naming the first bad element.
func (h *Hessian) Add(x []float32, rows int) error {
	if len(x) != rows*h.Cols {
		return fmt.Errorf("gptq: %d activation values for %d rows × %d columns", len(x), rows, h.Cols)
	}
	if err := checkFinite32(x, h.Cols); err != nil {
		return err
	}
	n := h.Cols
	for t := 0; t < rows; t++ {
		row := x[t*n : (t+1)*n]
		for i, a := range row {
			if a == 0 {
				continue
			}
			s := h.sum[i*n : (i+1)*n]
			ai := float64(a)
			for j := i; j < n; j++ {
				s[j] += ai * float64(row[j])
			}
		}
	}
	// Only the upper triangle is written; Matrix mirrors it.
	h.n += rows
	return nil
}

// AddGram accumulates a precomputed Gram matrix g = Xᵀ·X ([Cols, Cols],
// full or upper triangle) of rows input rows, e.g. from a fast GEMM.
func (h *Hessian) AddGram(g []float32, rows int) error {
	n := h.Cols
	if len(g) != n*n {
		return fmt.Errorf("gptq: Gram matrix has %d values, want %d×%d", len(g), n, n)
	}
	for i := 0; i < n; i++ {
		for j := i; j < n; j++ {
			v := float64(g[i*n+j])
			if math.IsNaN(v) || math.IsInf(v, 0) {
				return fmt.Errorf("gptq: Hessian entry (%d,%d) is %g: the calibration activations overflow or hold NaN/Inf", i, j, v)
			}
			h.sum[i*n+j] += v
		}
	}
	h.n += rows
	return nil
}

// Matrix returns H = 2/n · Σ x·xᵀ as a full symmetric [Cols*Cols] slice.
func (h *Hessian) Matrix() []float64 {
	n := h.Cols
	out := make([]float64, n*n)
	if h.n == 0 {
		return out
	}
	f := 2 / float64(h.n)
	for i := 0; i < n; i++ {
		for j := i; j < n; j++ {
			v := h.sum[i*n+j] * f
			out[i*n+j] = v
			out[j*n+i] = v
		}
	}
	return out
}

func checkFinite32(x []float32, cols int) error {
	for i, v := range x {
		if v-v != 0 { // NaN or ±Inf
			return fmt.Errorf("gptq: activation (token %d, channel %d) is %g: calibration inputs must be finite", i/cols, i%cols, v)
		}
	}
	return nil
}

// Result is one quantized linear.
type Result struct {
	Q *model.Quantized
	// Loss is GPTQ's own error estimate Σ (w−q)²/(2·d²) with d the diagonal
	// of the inverse Hessian's Cholesky factor, as the reference prints it.
	Loss float64
	// Damp is the absolute damping added to diag(H); DampFrac the fraction
	// of mean(diag(H)) it was (larger than Options.Damp after a retry).
	Damp, DampFrac float64
	// Retries counts damping increases needed before the Cholesky
	// factorisation succeeded.
	Retries int
	// DeadCols counts input columns that never saw a non-zero activation.
	DeadCols int
}

// ErrNotPositiveDefinite is returned (wrapped) when H stays singular after
// every damping retry.
var ErrNotPositiveDefinite = runtime.ErrNotPositiveDefinite

// grid is the min/max quantizer of the reference implementation for one
// group: per row scale and zero point on the unsigned grid 0..maxq.
type grid struct {
	maxq        float64
	sym         bool
	fp16        bool
	search      string    // "", "minmax", "mse" or "hmse"
	hdiag       []float64 // diag(H) in the column order of the weights fitted
	scale, zero []float64 // [rows]
}

// fit sets the parameters of rows [r0, r1) from columns [c0, c1) of w
// ([rows, cols]). The range always includes 0, as in the reference quantizer.
func (g *grid) fit(w []float64, r0, r1, cols, c0, c1 int) {
	for r := r0; r < r1; r++ {
		row := w[r*cols+c0 : r*cols+c1]
		lo, hi := 0.0, 0.0
		for _, v := range row {
			lo = math.Min(lo, v)
			hi = math.Max(hi, v)
		}
		if g.sym {
			hi = math.Max(-lo, hi)
			if lo < 0 {
				lo = -hi
			}
		}
		if lo == 0 && hi == 0 {
			lo, hi = -1, 1
		}
		g.scale[r], g.zero[r] = g.params(lo, hi)
		if g.search != "mse" && g.search != "hmse" {
			continue
		}
		best := math.Inf(1)
		bs, bz := g.scale[r], g.zero[r]
		for i := 0; i < 80; i++ {
			p := 1 - float64(i)/100
			g.scale[r], g.zero[r] = g.params(p*lo, p*hi)
			e := 0.0
			for k, v := range row {
				_, dq := g.quant(r, v)
				d := math.Abs(v - dq)
				if g.search == "mse" {
					e += math.Pow(d, 2.4)
				} else {
					e += g.hdiag[c0+k] * d * d
				}
			}
			if e < best {
				best, bs, bz = e, g.scale[r], g.zero[r]
			}
		}
		g.scale[r], g.zero[r] = bs, bz
	}
}

// params returns the scale and zero point of the range [lo, hi].
func (g *grid) params(lo, hi float64) (s, z float64) {
	s = (hi - lo) / g.maxq
	if g.fp16 {
		s = fp16Round(s)
	}
	if g.sym {
		return s, (g.maxq + 1) / 2
	}
	return s, math.RoundToEven(-lo / s)
}

// quant returns the unsigned code and the dequantized value of x in row r.
func (g *grid) quant(r int, x float64) (int, float64) {
	s, z := g.scale[r], g.zero[r]
	q := math.RoundToEven(x/s) + z
	if q < 0 {
		q = 0
	} else if q > g.maxq {
		q = g.maxq
	}
	return int(q), s * (q - z)
}

// fp16Round rounds a positive scale to the nearest float16 value, keeping it
// at least the smallest normal half so it never becomes 0.
func fp16Round(s float64) float64 {
	v := float64(model.RoundF16(float32(s)))
	if v < 6.103515625e-05 {
		v = 6.103515625e-05
	}
	return v
}

// Quantize runs GPTQ on w ([rows, cols] row-major) with the Hessian of its
// inputs. w is not modified.
func Quantize(w []float32, rows, cols int, h *Hessian, opt Options) (*Result, error) {
	opt = opt.withDefaults()
	if err := opt.Validate(cols); err != nil {
		return nil, err
	}
	if len(w) != rows*cols {
		return nil, fmt.Errorf("gptq: weight has %d values, want %d×%d", len(w), rows, cols)
	}
	if h.Cols != cols {
		return nil, fmt.Errorf("gptq: Hessian is %d×%d, weight has %d input columns", h.Cols, h.Cols, cols)
	}
	if h.n == 0 {
		return nil, errors.New("gptq: no calibration tokens reached this layer")
	}
	for i, v := range w {
		if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
			return nil, fmt.Errorf("gptq: weight (%d,%d) is %g", i/cols, i%cols, v)
		}
	}
	H := h.Matrix()
	for i, v := range H {
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return nil, fmt.Errorf("gptq: Hessian entry (%d,%d) is %g: the calibration activations overflow", i/cols, i%cols, v)
		}
	}
	W := make([]float64, rows*cols)
	for i, v := range w {
		W[i] = float64(v)
	}
	maxq := float64(int(1)<<opt.Bits - 1)
	gs := opt.GroupSize
	if gs == 0 {
		gs = cols
	}
	ngroups := cols / gs
	hdiag := make([]float64, cols)
	for i := range hdiag {
		hdiag[i] = H[i*cols+i]
	}
	newGrid := func() *grid {
		return &grid{maxq: maxq, sym: opt.Sym, fp16: !opt.FP32Scales, search: opt.Search, hdiag: hdiag,
			scale: make([]float64, rows), zero: make([]float64, rows)}
	}
	res := &Result{}

	hd := make([]float64, cols)
	for i := range hd {
		hd[i] = H[i*cols+i]
	}
	dead, perm := columnOrder(hd, opt.ActOrder)
	for i, d := range dead {
		if d {
			H[i*cols+i] = 1
			for r := 0; r < rows; r++ {
				W[r*cols+i] = 0
			}
			res.DeadCols++
		}
	}

	// Static groups: parameters from the original (unpermuted, unupdated)
	// weights, so the result is a plain per-group format even with act-order.
	var static []*grid
	if opt.ActOrder {
		static = make([]*grid, ngroups)
		for g := range static {
			static[g] = newGrid()
			static[g].fit(W, 0, rows, cols, g*gs, (g+1)*gs)
		}
		W = permuteCols(W, rows, cols, perm)
		H = permuteSym(H, cols, perm)
	}

	U, damp, frac, retries, err := invCholUpper(H, cols, opt.Damp)
	if err != nil {
		return nil, err
	}
	res.Damp, res.DampFrac, res.Retries = damp, frac, retries

	codes := make([]uint8, rows*cols) // in permuted column order
	scale := make([]float32, rows*ngroups)
	zero := make([]float32, rows*ngroups)
	cur := newGrid()
	bs := opt.BlockSize
	if !opt.ActOrder && bs%gs != 0 && gs%bs != 0 {
		// A group must never start inside a block while some of its columns
		// still wait for the block's lazy update: align blocks to groups.
		bs = gs
	}
	errBlk := make([]float64, rows*bs)
	// Rows are independent: each one's errors only move its own later
	// columns. Split them over the threads.
	threads := max(1, min(opt.Threads, rows/16))
	losses := make([]float64, threads)
	var wg sync.WaitGroup
	for w := 0; w < threads; w++ {
		r0, r1 := w*rows/threads, (w+1)*rows/threads
		wg.Add(1)
		go func() {
			defer wg.Done()
			losses[w] = gptqRows(W, U, codes, scale, zero, errBlk, perm, static, cur, r0, r1, cols, gs, ngroups, bs, opt.ActOrder)
		}()
	}
	wg.Wait()
	loss := 0.0
	for _, l := range losses {
		loss += l
	}
	res.Loss = loss

	q, err := pack(codes, perm, scale, zero, rows, cols, opt)
	if err != nil {
		return nil, err
	}
	res.Q = q
	return res, nil
}

// columnOrder returns the dead columns (diagonal of H 0: no activation
// ever reached them; their weights do not matter, so they are quantized as
// zeros with H's diagonal set to 1 to keep it invertible) and the order the
// columns are quantized in: by decreasing diag(H) (dead ones counting as 1)
// with act-order, else the natural order.
func columnOrder(hdiag []float64, actOrder bool) (dead []bool, perm []int) {
	n := len(hdiag)
	dead = make([]bool, n)
	d := make([]float64, n)
	for i, v := range hdiag {
		d[i] = v
		if v == 0 {
			dead[i], d[i] = true, 1
		}
	}
	perm = make([]int, n)
	for i := range perm {
		perm[i] = i
	}
	if actOrder {
		sort.SliceStable(perm, func(a, b int) bool { return d[perm[a]] > d[perm[b]] })
	}
	return dead, perm
}

// pack builds the quantized weight from unsigned codes in the column order
// perm ([rows, cols]) and per-(row, group) scales and unsigned zero points.
func pack(codes []uint8, perm []int, scale, zero []float32, rows, cols int, opt Options) (*model.Quantized, error) {
	off := 1 << (opt.Bits - 1)
	q := &model.Quantized{Bits: opt.Bits, GroupSize: opt.GroupSize, Rows: rows, Cols: cols,
		Q: make([]int8, rows*cols), Scale: scale}
	threads := max(1, min(goruntime.NumCPU(), rows/64))
	var wg sync.WaitGroup
	for t := 0; t < threads; t++ {
		r0, r1 := t*rows/threads, (t+1)*rows/threads
		wg.Add(1)
		go func() {
			defer wg.Done()
			for r := r0; r < r1; r++ {
				for i := 0; i < cols; i++ {
					c := i
					if perm != nil {
						c = perm[i]
					}
					q.Q[r*cols+c] = int8(int(codes[r*cols+i]) - off)
				}
			}
		}()
	}
	wg.Wait()
	if !opt.Sym {
		q.Zero = zero
		for i := range zero {
			zero[i] -= float32(off)
		}
	}
	if err := q.Validate(); err != nil {
		return nil, fmt.Errorf("gptq: internal error: %w", err)
	}
	return q, nil
}

// gptqRows runs the column loop of GPTQ for rows [r0, r1) and returns their
// loss.
func gptqRows(W, U []float64, codes []uint8, scale, zero []float32, errBlk []float64, perm []int, static []*grid, cur *grid,
	r0, r1, cols, gs, ngroups, bs int, actOrder bool) float64 {
	loss := 0.0
	for i1 := 0; i1 < cols; i1 += bs {
		i2 := min(i1+bs, cols)
		n := i2 - i1
		for i := i1; i < i2; i++ {
			orig := perm[i]
			g := orig / gs
			gr := cur
			if actOrder {
				gr = static[g]
			} else if i%gs == 0 {
				cur.fit(W, r0, r1, cols, i, i+gs)
			}
			if !actOrder && i%gs == 0 || actOrder && orig%gs == 0 {
				for r := r0; r < r1; r++ {
					scale[r*ngroups+g] = float32(gr.scale[r])
					zero[r*ngroups+g] = float32(gr.zero[r])
				}
			}
			d := U[i*cols+i]
			urow := U[i*cols : (i+1)*cols]
			for r := r0; r < r1; r++ {
				wr := W[r*cols : (r+1)*cols]
				x := wr[i]
				q, dq := gr.quant(r, x)
				codes[r*cols+i] = uint8(q)
				e := (x - dq) / d
				loss += e * e / 2
				errBlk[r*bs+(i-i1)] = e
				for j := i + 1; j < i2; j++ {
					wr[j] -= e * urow[j]
				}
			}
		}
		if i2 < cols {
			lazyUpdate(W, U, errBlk, r0, r1, cols, bs, i1, n, i2)
		}
	}
	return loss
}

// lazyUpdate applies W[r0:r1, i2:] −= Err[r0:r1, 0:n] · U[i1:i1+n, i2:].
func lazyUpdate(W, U, errBlk []float64, r0, r1, cols, bs, i1, n, i2 int) {
	for r := r0; r < r1; r++ {
		wr := W[r*cols+i2 : (r+1)*cols]
		eb := errBlk[r*bs : r*bs+n]
		for k, e := range eb {
			if e == 0 {
				continue
			}
			u := U[(i1+k)*cols+i2 : (i1+k+1)*cols]
			for j := range wr {
				wr[j] -= e * u[j]
			}
		}
	}
}

// invCholUpper damps H, inverts it through a Cholesky factorisation and
// returns the upper Cholesky factor U of H⁻¹ (H⁻¹ = UᵀU), row-major. When H
// is not positive definite it retries with 10× more damping, three times.
func invCholUpper(H []float64, n int, frac float64) (U []float64, damp, usedFrac float64, retries int, err error) {
	mean := 0.0
	for i := 0; i < n; i++ {
		mean += H[i*n+i]
	}
	mean /= float64(n)
	for retries = 0; retries < 4; retries++ {
		usedFrac = frac * math.Pow(10, float64(retries))
		if usedFrac >= 1 && retries > 0 {
			usedFrac = 1
		}
		damp = usedFrac * mean
		a := mat.NewSymDense(n, nil)
		for i := 0; i < n; i++ {
			for j := i; j < n; j++ {
				v := H[i*n+j]
				if i == j {
					v += damp
				}
				a.SetSym(i, j, v)
			}
		}
		var c mat.Cholesky
		if !c.Factorize(a) {
			continue
		}
		var inv mat.SymDense
		if e := c.InverseTo(&inv); e != nil {
			continue
		}
		var c2 mat.Cholesky
		if !c2.Factorize(&inv) {
			continue
		}
		var u mat.TriDense
		c2.UTo(&u)
		U = make([]float64, n*n)
		ok := true
		for i := 0; i < n && ok; i++ {
			for j := i; j < n; j++ {
				v := u.At(i, j)
				if math.IsNaN(v) || math.IsInf(v, 0) {
					ok = false
					break
				}
				U[i*n+j] = v
			}
		}
		if ok {
			return U, damp, usedFrac, retries, nil
		}
	}
	return nil, 0, 0, retries, fmt.Errorf("gptq: %w even with damping %.3g × mean(diag H)", ErrNotPositiveDefinite, usedFrac)
}

func permuteCols(W []float64, rows, cols int, perm []int) []float64 {
	out := make([]float64, len(W))
	for r := 0; r < rows; r++ {
		for i, p := range perm {
			out[r*cols+i] = W[r*cols+p]
		}
	}
	return out
}

func permuteSym(H []float64, n int, perm []int) []float64 {
	out := make([]float64, len(H))
	for i, pi := range perm {
		for j, pj := range perm {
			out[i*n+j] = H[pi*n+pj]
		}
	}
	return out
}
