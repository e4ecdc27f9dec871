// Package awq implements AWQ (Lin et al., 2023), activation-aware weight
// quantization: for each group of linears sharing an input, a per-channel
// scale s = mean|x|^r (r on a grid of 20 points in [0, 1)) is chosen to
// minimise the block output error after quantizing W·s, the scale is folded
// into the previous op (a norm or a linear), then each weight's clipping
// range is searched per (row, group) and the weights are quantized
// asymmetrically per group.
//
// This file holds the plain-matrix algorithms; model.go applies them layer
// by layer through qtool/quantize/calib.
package awq

import (
	"errors"
	"fmt"
	"math"

	"qtool/formats/model"
	"qtool/gptq"
	"qtool/quantize"
	"qtool/runtime/cpu/gemm"
)

// Options are the knobs of AWQ.
type Options struct {
	Bits      int // 2..8, default 4
	GroupSize int // default 128
	Grid      int // scale-exponent grid points, default 20
	// DuoScaling uses AutoAWQ's s = mean|x|^r / mean|ŵ|^(1−r) instead of
	// llm-awq's s = mean|x|^r.
	DuoScaling bool
	NoClip     bool    // skip the clipping search
	ClipGrid   int     // default 20
	MaxShrink  float64 // default 0.5: clip ranges 1, 0.95, … , 0.55 of max|w|
	ClipTokens int     // tokens for the clip search, default 512
	// SearchTokens bounds the calibration tokens used to evaluate the scale
	// search loss (llm-awq uses all of them; default 4096).
	SearchTokens int
	// FP32Scales keeps float32 quantization scales; by default they are
	// rounded to float16 before codes are computed (AutoAWQ and ak48 files
	// store fp16 scales).
	FP32Scales bool
	// GPTQ, when set, quantizes the scaled (and clipped, unless NoClip)
	// weights with GPTQ on the layer's calibration inputs instead of
	// round-to-nearest (AWQ scaling + GPTQ). Bits and GroupSize are taken
	// from this struct.
	GPTQ    *gptq.Options
	Threads int
}

// WithDefaults fills zero fields with the defaults.
func (o Options) WithDefaults() Options {
	if o.Bits == 0 {
		o.Bits = 4
	}
	if o.GroupSize == 0 {
		o.GroupSize = 128
	}
	if o.Grid == 0 {
		o.Grid = 20
	}
	if o.ClipGrid == 0 {
		o.ClipGrid = 20
	}
	if o.MaxShrink == 0 {
		o.MaxShrink = 0.5
	}
	if o.ClipTokens == 0 {
		o.ClipTokens = 512
	}
	if o.SearchTokens == 0 {
		o.SearchTokens = 4096
	}
	if o.Threads <= 0 {
		o.Threads = 1
	}
	return o
}

// Validate checks the options for weights with cols input columns.
func (o Options) Validate(cols int) error {
	if o.Bits < 2 || o.Bits > 8 {
		return fmt.Errorf("awq: %d bits, want 2..8", o.Bits)
	}
	if o.GroupSize < 0 {
		return fmt.Errorf("awq: group size %d, want > 0", o.GroupSize)
	}
	if o.GroupSize > 0 && cols%o.GroupSize != 0 {
		return fmt.Errorf("awq: group size %d does not divide the %d input columns", o.GroupSize, cols)
	}
	if o.MaxShrink < 0 || o.MaxShrink >= 1 {
		return fmt.Errorf("awq: max shrink %g, want [0, 1)", o.MaxShrink)
	}
	return nil
}

func (o Options) params() quantize.Params {
	return quantize.Params{Bits: o.Bits, Group: o.GroupSize, Rule: quantize.AsymAWQ}
}

// Quantize quantizes w ([rows, cols]) with AWQ's asymmetric per-group rule
// (qtool/quantize AsymAWQ), then, unless FP32Scales, rounds each scale to
// float16 and recomputes the codes with it so the stored scales are exact.
func (o Options) Quantize(w []float32, rows, cols int) (*model.Quantized, error) {
	q, err := quantize.RTN(w, rows, cols, o.params())
	if err != nil {
		return nil, fmt.Errorf("awq: %w", err)
	}
	if o.FP32Scales {
		return q, nil
	}
	gs := q.GroupSize
	if gs == 0 {
		gs = cols
	}
	off := float32(q.Offset())
	umax := float32(int(1)<<o.Bits - 1)
	G := cols / gs
	model.Parallel(rows, max(1, (1<<16)/cols), func(r0, r1 int) { o.fp16Rows(q, w, r0, r1, cols, gs, G, off, umax) })
	return q, nil
}

// fp16Rows rounds the scales of rows [r0, r1) of q to float16 and
// recomputes their codes from w.
func (o Options) fp16Rows(q *model.Quantized, w []float32, r0, r1, cols, gs, G int, off, umax float32) {
	for r := r0; r < r1; r++ {
		for g := 0; g < G; g++ {
			i := r*G + g
			s := model.RoundF16(q.Scale[i])
			if s < 6.103515625e-05 {
				s = 6.103515625e-05
			}
			q.Scale[i] = s
			z := q.Zero[i] + off
			for c := g * gs; c < (g+1)*gs; c++ {
				u := float32(math.RoundToEven(float64(w[r*cols+c]/s))) + z
				u = min(max(u, 0), umax)
				q.Q[r*cols+c] = int8(u - off)
			}
		}
	}
}

// FakeQuant returns the dequantized values of Quantize(w).
func (o Options) FakeQuant(w []float32, rows, cols int) ([]float32, error) {
	q, err := o.Quantize(w, rows, cols)
	if err != nil {
		return nil, err
	}
	return q.Float32()
}

// Linear is one weight [Rows, Cols] of a scale group.
type Linear struct {
	W    []float32
	Rows int
}

// ScaleResult is the outcome of SearchScale.
type ScaleResult struct {
	Scales []float32 // per input channel; divide the previous op by them
	Ratio  float64   // the chosen exponent r
	Loss   float64   // block loss at r
	Losses []float64 // loss at each grid point
}

// MeanAbs returns mean |x| per column of x ([rows, cols]).
func MeanAbs(x []float32, rows, cols int) []float32 {
	acc := make([]float64, cols)
	for r := 0; r < rows; r++ {
		for c, v := range x[r*cols : (r+1)*cols] {
			acc[c] += math.Abs(float64(v))
		}
	}
	out := make([]float32, cols)
	for c := range out {
		out[c] = float32(acc[c] / float64(rows))
	}
	return out
}

// Candidate returns the scales of grid point r: s = xMean^r (divided by
// wMean^(1−r) with duo scaling), clamped at 1e-4 and normalised so that
// max(s)·min(s) = 1.
func Candidate(xMean, wMean []float32, r float64) []float32 {
	s := make([]float32, len(xMean))
	lo, hi := math.Inf(1), math.Inf(-1)
	for i, x := range xMean {
		v := math.Pow(float64(x), r)
		if wMean != nil {
			v /= math.Pow(float64(wMean[i]), 1-r) + 1e-4
		}
		v = math.Max(v, 1e-4)
		lo, hi = math.Min(lo, v), math.Max(hi, v)
		s[i] = float32(v)
	}
	norm := float32(math.Sqrt(lo * hi))
	for i := range s {
		s[i] /= norm
	}
	return s
}

// WeightMean is AutoAWQ's duo-scaling weight statistic: |w| normalised by
// its group's max, averaged over the rows of every linear, per input column.
func WeightMean(lins []Linear, cols, group int) []float32 {
	if group <= 0 {
		group = cols
	}
	acc := make([]float64, cols)
	n := 0
	for _, l := range lins {
		for r := 0; r < l.Rows; r++ {
			row := l.W[r*cols : (r+1)*cols]
			for g := 0; g < cols; g += group {
				m := 0.0
				for _, v := range row[g : g+group] {
					m = math.Max(m, math.Abs(float64(v)))
				}
				if m == 0 {
					continue
				}
				for c := g; c < g+group; c++ {
					acc[c] += math.Abs(float64(row[c])) / m
				}
			}
		}
		n += l.Rows
	}
	out := make([]float32, cols)
	for c := range out {
		out[c] = float32(acc[c] / float64(n))
	}
	return out
}

// LossFunc evaluates the block with each linear's weight replaced by fq[i]
// (the fake-quantized Q(W·s)/s, in the original input space) and returns
// the mean squared error of the block output.
type LossFunc func(fq [][]float32) (float64, error)

// SearchScale grid-searches the scale exponent for the linears lins (all
// reading the same input, whose per-channel mean |x| is xMean), quantizing
// the candidates on the host.
func SearchScale(xMean []float32, lins []Linear, loss LossFunc, opt Options) (*ScaleResult, error) {
	opt = opt.WithDefaults()
	cols := len(xMean)
	var wMean []float32
	if opt.DuoScaling {
		wMean = WeightMean(lins, cols, opt.GroupSize)
	}
	scaled := make([][]float32, len(lins))
	for i, l := range lins {
		scaled[i] = make([]float32, len(l.W))
	}
	fq := make([][]float32, len(lins))
	return SearchScaleWith(xMean, wMean, opt, func(s []float32) (float64, error) {
		for i, l := range lins {
			q, err := opt.FakeQuantScaled(scaled[i], l.W, l.Rows, cols, s)
			if err != nil {
				return 0, err
			}
			fq[i] = q
		}
		return loss(fq)
	})
}

// FakeQuantScaled returns Q(w·diag(s))·diag(s)⁻¹ for w [rows, cols], using
// scratch (len(w)) for the scaled weights.
func (o Options) FakeQuantScaled(scratch, w []float32, rows, cols int, s []float32) ([]float32, error) {
	for row := 0; row < rows; row++ {
		for c := 0; c < cols; c++ {
			scratch[row*cols+c] = w[row*cols+c] * s[c]
		}
	}
	q, err := o.FakeQuant(scratch, rows, cols)
	if err != nil {
		return nil, err
	}
	for row := 0; row < rows; row++ {
		for c := 0; c < cols; c++ {
			q[row*cols+c] /= s[c]
		}
	}
	return q, nil
}

// SearchScaleWith runs the grid search over the candidates of xMean (and
// wMean with duo scaling); eval returns the block loss with the linears
// fake-quantized at the candidate scales s.
func SearchScaleWith(xMean, wMean []float32, opt Options, eval func(s []float32) (float64, error)) (*ScaleResult, error) {
	opt = opt.WithDefaults()
	if err := opt.Validate(len(xMean)); err != nil {
		return nil, err
	}
	for i, v := range xMean {
		if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
			return nil, fmt.Errorf("awq: activation statistic of channel %d is %g: calibration activations hold NaN/Inf", i, v)
		}
	}
	res := &ScaleResult{Loss: math.Inf(1), Ratio: -1}
	for g := 0; g < opt.Grid; g++ {
		r := float64(g) / float64(opt.Grid)
		s := Candidate(xMean, wMean, r)
		e, err := eval(s)
		if err != nil {
			return nil, err
		}
		res.Losses = append(res.Losses, e)
		if e < res.Loss {
			res.Loss, res.Ratio, res.Scales = e, r, s
		}
	}
	if res.Scales == nil {
		return nil, errors.New("awq: the scale search found no finite loss (NaN in the block output?)")
	}
	return res, nil
}

// SearchClip finds, per (row, group) of w ([rows, cols]), the clipping
// threshold max|w|·(1 − i/ClipGrid), i < MaxShrink·ClipGrid, that minimises
// the mean squared error of that group's partial products x_g·w_gᵀ over the
// tokens x ([n, cols]). It returns the thresholds [rows·groups].
func SearchClip(w []float32, rows, cols int, x []float32, n int, opt Options) ([]float32, error) {
	opt = opt.WithDefaults()
	if err := opt.Validate(cols); err != nil {
		return nil, err
	}
	gs := opt.GroupSize
	if gs == 0 {
		gs = cols
	}
	G := cols / gs
	best := make([]float32, rows*G)
	bestErr := make([]float64, rows*G)
	xg := make([]float32, n*gs)
	wg := make([]float32, rows*gs)
	wc := make([]float32, rows*gs)
	org := make([]float32, n*rows)
	cur := make([]float32, n*rows)
	sub := opt
	sub.GroupSize = gs
	steps := int(opt.MaxShrink * float64(opt.ClipGrid))
	if steps < 1 {
		steps = 1
	}
	for g := 0; g < G; g++ {
		for t := 0; t < n; t++ {
			copy(xg[t*gs:(t+1)*gs], x[t*cols+g*gs:t*cols+(g+1)*gs])
		}
		maxAbs := make([]float32, rows)
		for r := 0; r < rows; r++ {
			copy(wg[r*gs:(r+1)*gs], w[r*cols+g*gs:r*cols+(g+1)*gs])
			for _, v := range wg[r*gs : (r+1)*gs] {
				maxAbs[r] = max(maxAbs[r], float32(math.Abs(float64(v))))
			}
			bestErr[r*G+g] = math.Inf(1)
		}
		gemm.MatMulNT(n, rows, gs, xg, gs, wg, gs, org, rows, false, opt.Threads)
		for i := 0; i < steps; i++ {
			f := float32(1 - float64(i)/float64(opt.ClipGrid))
			for r := 0; r < rows; r++ {
				m := maxAbs[r] * f
				for c := 0; c < gs; c++ {
					wc[r*gs+c] = min(max(wg[r*gs+c], -m), m)
				}
			}
			q, err := sub.FakeQuant(wc, rows, gs)
			if err != nil {
				return nil, err
			}
			gemm.MatMulNT(n, rows, gs, xg, gs, q, gs, cur, rows, false, opt.Threads)
			for r := 0; r < rows; r++ {
				e := 0.0
				for t := 0; t < n; t++ {
					d := float64(cur[t*rows+r] - org[t*rows+r])
					e += d * d
				}
				e /= float64(n)
				if e < bestErr[r*G+g] {
					bestErr[r*G+g] = e
					best[r*G+g] = maxAbs[r] * f
				}
			}
		}
	}
	return best, nil
}

// ApplyClip clamps every (row, group) of w to ±maxVal in place.
func ApplyClip(w []float32, rows, cols, group int, maxVal []float32) {
	if group <= 0 {
		group = cols
	}
	G := cols / group
	for r := 0; r < rows; r++ {
		for c := 0; c < cols; c++ {
			m := maxVal[r*G+c/group]
			w[r*cols+c] = min(max(w[r*cols+c], -m), m)
		}
	}
}
