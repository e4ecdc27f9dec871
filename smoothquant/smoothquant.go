// Package smoothquant implements SmoothQuant (Xiao et al., 2022) for W8A8:
// activation outliers are migrated into the weights with per-channel scales
// s_j = max|X_j|^α / max|W_j|^(1−α), folded into the RMSNorm before q/k/v
// and gate/up; every decoder linear then gets per-channel symmetric int8
// weights and a static per-tensor asymmetric int8 activation quantizer
// (msmodelslim W8A8), calibrated on the same data.
package smoothquant

import (
	"fmt"
	"math"

	"qtool/formats/model"
	"qtool/gptq"
	"qtool/quantize"
	"qtool/quantize/calib"
	"qtool/runtime"
)

// Options are the knobs of SmoothQuant.
type Options struct {
	// Alpha is the migration strength (default 0.5).
	Alpha float64
	// AutoAlpha searches α ∈ {0.30, 0.35, …, 0.90} per scale group for the
	// smallest output error of the W8A8 linears on the calibration tokens.
	AutoAlpha bool
	// ClipSearch searches, per linear group, a shrink of the activation
	// range [min, max] (1, 0.95, … 0.3) minimising the output error;
	// otherwise the plain calibration min/max is used.
	ClipSearch bool
	// SmoothDown also migrates the outliers of down_proj's input into its
	// weights, folding the scales into up_proj's rows (exact: up's
	// per-channel weight scales absorb them).
	SmoothDown bool
	// Dynamic quantizes the activations per token at run time (W8A8
	// dynamic, model.W8A8.Dynamic) instead of with a static per-tensor
	// range; ClipSearch then has nothing to search, and Qwen2 biases stay
	// float bias tensors.
	Dynamic bool
	// Weights chooses how the smoothed weights become int8: "" or "rtn"
	// rounds to nearest; "gptq" rounds with GPTQ (the Hessian of the
	// smoothed calibration inputs); "sparsegpt" prunes them to Sparse and
	// rounds jointly (SparseGPT); "magnitude" prunes by |w| to Sparse, then
	// rounds to nearest. The searches use round to nearest; the chosen
	// smoothing is then rounded this way.
	Weights string
	// Sparse is the sparsity of "sparsegpt" and "magnitude" (W8A8S).
	Sparse gptq.SparseOptions
	// SearchTokens bounds the tokens used by the searches (default 4096).
	SearchTokens int
	Threads      int
}

// WithDefaults fills zero fields.
func (o Options) WithDefaults() Options {
	if o.Alpha == 0 {
		o.Alpha = 0.5
	}
	if o.SearchTokens == 0 {
		o.SearchTokens = 4096
	}
	if o.Threads <= 0 {
		o.Threads = 1
	}
	return o
}

// Scales returns s_j = max(actMax_j^α / wMax_j^(1−α), 1e-5) where wMax_j is
// the largest |w| of input column j over all weights ws ([rows_i, cols]).
func Scales(actMax []float32, ws [][]float32, alpha float64) []float32 {
	cols := len(actMax)
	wMax := make([]float64, cols)
	for _, w := range ws {
		for i, v := range w {
			c := i % cols
			wMax[c] = math.Max(wMax[c], math.Abs(float64(v)))
		}
	}
	s := make([]float32, cols)
	for j := range s {
		v := math.Pow(float64(actMax[j]), alpha) / math.Pow(math.Max(wMax[j], 1e-5), 1-alpha)
		s[j] = float32(math.Max(v, 1e-5))
	}
	return s
}

// AbsMax returns max |x| per column of x ([rows, cols]).
func AbsMax(x []float32, rows, cols int) []float32 {
	out := make([]float32, cols)
	for r := 0; r < rows; r++ {
		for c, v := range x[r*cols : (r+1)*cols] {
			out[c] = max(out[c], float32(math.Abs(float64(v))))
		}
	}
	return out
}

// ActRange returns the per-tensor input quantizer for values in [lo, hi]
// (the range always includes 0): x_q = clamp(round(x/scale + offset),
// −128, 127) with offset an integer, so that 0 is exact.
func ActRange(lo, hi float32) (scale, offset float32) {
	lo, hi = min(lo, 0), max(hi, 0)
	if hi-lo == 0 {
		return 1, 0
	}
	scale = (hi - lo) / 255
	offset = float32(math.RoundToEven(float64(-128 - lo/scale)))
	return scale, offset
}

// MinMax returns the smallest and largest value of x.
func MinMax(x []float32) (lo, hi float32) {
	for _, v := range x {
		lo, hi = min(lo, v), max(hi, v)
	}
	return lo, hi
}

// W8A8 builds the msmodelslim W8A8 linear of a float weight w ([rows, cols])
// with per-channel symmetric int8 weights (qtool/quantize SymZero, per row)
// and the given activation quantizer; bias (may be nil) is folded into
// QuantBias. QuantBias also carries −offset·Σ_k W_q, so that
// y = (Σ x_q·W_q + QuantBias)·DeqScale.
func W8A8(w []float32, rows, cols int, bias []float32, inScale, inOffset float32) (*model.W8A8, error) {
	q, err := quantize.RTN(w, rows, cols, quantize.Params{Bits: 8, Group: 0, Rule: quantize.SymZero})
	if err != nil {
		return nil, err
	}
	return w8a8Of(q, rowSums(q), bias, inScale, inOffset), nil
}

// rowSums returns Σ_k W_q[r, k] per row of the int8 weight q.
func rowSums(q *model.Quantized) []int64 {
	sums := make([]int64, q.Rows)
	model.Parallel(q.Rows, 64, func(lo, hi int) {
		for r := lo; r < hi; r++ {
			for _, v := range q.Q[r*q.Cols : (r+1)*q.Cols] {
				sums[r] += int64(v)
			}
		}
	})
	return sums
}

// w8a8Of completes the per-channel int8 weight q (with its row sums) with
// the activation quantizer (see W8A8).
func w8a8Of(q *model.Quantized, sums []int64, bias []float32, inScale, inOffset float32) *model.W8A8 {
	rows := q.Rows
	out := &model.W8A8{Weight: q, InputScale: inScale, InputOffset: inOffset,
		DeqScale: make([]float32, rows), QuantBias: make([]int32, rows)}
	for r := 0; r < rows; r++ {
		d := inScale * q.Scale[r]
		out.DeqScale[r] = d
		qb := -float64(inOffset) * float64(sums[r])
		if bias != nil && d != 0 {
			qb += float64(bias[r] / d)
		}
		out.QuantBias[r] = int32(math.RoundToEven(qb))
	}
	return out
}

// QuantizeModel smooths and W8A8-quantizes every decoder linear of the
// session's model layer by layer (true-sequential), installing the results
// and the rescaled norms in the session; the result model is s.Out. The
// statistics and every candidate's output error are computed on the
// session's backend, the W8A8 candidates running through the backend's own
// W8A8 product (the arithmetic inference uses).
func QuantizeModel(s *calib.Session, opt Options, progress calib.Progress) ([]calib.ModuleStat, error) {
	opt = opt.WithDefaults()
	opt.Threads = s.Threads()
	be := s.Backend()
	var stats []calib.ModuleStat
	step := func(l int, p runtime.CapturePoint, x runtime.Buf) error {
		t := calib.StartTimer()
		defer s.Phase("search")()
		in := x.Cols()
		roles := p.Roles()
		ws := make([][]float32, len(roles))
		outs := make([]int, len(roles))
		biases := make([][]float32, len(roles))
		for i, r := range roles {
			w, err := s.Weight(l, r)
			if err != nil {
				return err
			}
			if w == nil {
				return fmt.Errorf("%s is missing", model.Name(l, r))
			}
			ws[i] = append([]float32(nil), w...)
			outs[i] = len(w) / in
			if br := biasRole(r); br != "" {
				b, err := s.Weight(l, br)
				if err != nil {
					return err
				}
				biases[i] = b
			}
		}
		st := be.ColumnStats(x)
		for c := range st.Min {
			for _, v := range []float32{st.Min[c], st.Max[c]} {
				if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
					return fmt.Errorf("%s input (channel %d) is %g: calibration activations must be finite", p, c, v)
				}
			}
		}
		sub := s.Subsample(x, opt.SearchTokens)
		defer be.Free(sub)
		ns := sub.Rows()
		if p == runtime.CaptureGateUp && opt.SmoothDown {
			if err := smoothDown(s, l, sub, ws, outs[0], opt); err != nil {
				return err
			}
		}
		refs := make([]runtime.Buf, len(roles))
		for i := range roles {
			lw, wb := s.Linear(ws[i], outs[i], in)
			refs[i] = s.MatMul(sub, lw)
			s.Drop(lw, wb)
			if biases[i] != nil {
				bv, err := be.UploadVector("bias", model.FromFloat32([]int{len(biases[i])}, biases[i]))
				if err != nil {
					return err
				}
				be.AddBias(refs[i], bv)
				be.FreeVector(bv)
			}
		}
		defer func() {
			for _, r := range refs {
				be.Free(r)
			}
		}()
		note := ""
		smooth := p == runtime.CaptureQKV || p == runtime.CaptureGateUp
		// smoothed holds, per α, the smoothed search tokens, the smoothed
		// weights' per-channel int8 quantization (which does not depend
		// on the activation range) and the input range.
		type smoothed struct {
			sc     []float32
			xs     runtime.Buf
			wq     []*model.Quantized
			sums   [][]int64 // row sums of wq
			lo, hi float32
		}
		cache := map[float64]*smoothed{}
		defer func() {
			for _, sm := range cache {
				if sm.xs != sub {
					be.Free(sm.xs)
				}
			}
		}()
		smoothFor := func(alpha float64) (*smoothed, error) {
			if sm, ok := cache[alpha]; ok {
				return sm, nil
			}
			sm := &smoothed{xs: sub}
			wsc := ws
			if smooth {
				sm.sc = Scales(st.MaxAbs, ws, alpha)
				sm.xs = be.Alloc(ns, in)
				be.CopyRows(sm.xs, 0, sub, 0, ns)
				be.ScaleColumns(sm.xs, sm.sc, true)
				wsc = make([][]float32, len(ws))
				for i := range ws {
					wsc[i] = scaledCopy(ws[i], outs[i], in, sm.sc, false)
				}
				for c := range st.Min {
					sm.lo = min(sm.lo, st.Min[c]/sm.sc[c])
					sm.hi = max(sm.hi, st.Max[c]/sm.sc[c])
				}
			} else {
				for c := range st.Min {
					sm.lo, sm.hi = min(sm.lo, st.Min[c]), max(sm.hi, st.Max[c])
				}
			}
			for i := range wsc {
				q, err := quantize.RTN(wsc[i], outs[i], in, quantize.Params{Bits: 8, Group: 0, Rule: quantize.SymZero})
				if err != nil {
					return nil, err
				}
				sm.wq = append(sm.wq, q)
				sm.sums = append(sm.sums, rowSums(q))
			}
			cache[alpha] = sm
			return sm, nil
		}
		build := func(alpha float64, clip float32) ([]*model.W8A8, float64, []float32, error) {
			sm, err := smoothFor(alpha)
			if err != nil {
				return nil, 0, nil, err
			}
			scale, off := ActRange(sm.lo*clip, sm.hi*clip)
			var lins []*model.W8A8
			e, norm := 0.0, 0.0
			for i := range roles {
				w8 := &model.W8A8{Weight: sm.wq[i], Dynamic: true}
				if !opt.Dynamic {
					w8 = w8a8Of(sm.wq[i], sm.sums[i], biases[i], scale, off)
				}
				lins = append(lins, w8)
				lw, err := be.UploadLinear(model.Name(l, roles[i]), w8)
				if err != nil {
					return nil, 0, nil, err
				}
				y := s.MatMul(sm.xs, lw)
				be.FreeLinear(lw)
				if opt.Dynamic && biases[i] != nil {
					bv, err := be.UploadVector("bias", model.FromFloat32([]int{len(biases[i])}, biases[i]))
					if err != nil {
						return nil, 0, nil, err
					}
					be.AddBias(y, bv)
					be.FreeVector(bv)
				}
				d, r := be.SquaredError(y, refs[i])
				be.Free(y)
				e += d
				norm += r
			}
			return lins, e / norm, sm.sc, nil
		}
		alpha := opt.Alpha
		if smooth && opt.AutoAlpha {
			best := math.Inf(1)
			for a := 0.30; a < 0.9001; a += 0.05 {
				_, e, _, err := build(a, 1)
				if err != nil {
					return err
				}
				if e < best {
					best, alpha = e, a
				}
			}
		}
		clip := float32(1)
		if opt.ClipSearch && !opt.Dynamic {
			best := math.Inf(1)
			for c := float32(1); c > 0.299; c -= 0.05 {
				_, e, _, err := build(alpha, c)
				if err != nil {
					return err
				}
				if e < best {
					best, clip = e, c
				}
			}
		}
		if opt.Weights != "" && opt.Weights != "rtn" {
			sm, err := smoothFor(alpha)
			if err != nil {
				return err
			}
			done := s.Phase("weights")
			err = roundWeights(s, x, sm.sc, ws, outs, sm.wq, opt)
			done()
			if err != nil {
				return fmt.Errorf("%s: %w", p, err)
			}
			for i, q := range sm.wq {
				sm.sums[i] = rowSums(q)
			}
			if note != "" {
				note += ", "
			}
			note += opt.Weights
		}
		lins, rel, sc, err := build(alpha, clip)
		if err != nil {
			return err
		}
		for _, l := range lins {
			l.Sparse = opt.Sparse.Sparsity > 0 || opt.Sparse.M > 0
		}
		if smooth {
			nr, br := model.AttnNorm, model.AttnNormBias
			if p == runtime.CaptureGateUp {
				nr, br = model.MLPNorm, model.MLPNormBias
			}
			for _, r := range []model.Role{nr, br} {
				v, err := s.Weight(l, r)
				if err != nil {
					return err
				}
				if v == nil {
					continue
				}
				nv := append([]float32(nil), v...)
				for j := range nv {
					nv[j] /= sc[j]
				}
				if err := s.SetVector(l, r, nv); err != nil {
					return err
				}
			}
			note = fmt.Sprintf("alpha %.2f", alpha)
		}
		if clip != 1 {
			if note != "" {
				note += ", "
			}
			note += fmt.Sprintf("act clip %.2f", clip)
		}
		for i, r := range roles {
			if err := s.SetLinear(l, r, lins[i]); err != nil {
				return err
			}
			if br := biasRole(r); br != "" && biases[i] != nil && !opt.Dynamic {
				// the bias now lives in quant_bias
				if err := s.SetVector(l, br, nil); err != nil {
					return err
				}
			}
			stats = append(stats, calib.ModuleStat{Layer: l, Role: r, Loss: rel, RelErr: rel, Seconds: t.Seconds(), Note: note})
			if progress != nil {
				progress(l, &stats[len(stats)-1])
			}
		}
		return nil
	}
	if err := s.Run(step, progress); err != nil {
		return stats, fmt.Errorf("smoothquant: %w", err)
	}
	return stats, nil
}

// roundWeights replaces wq, the per-channel int8 weights of a linear
// group, by opt.Weights's: GPTQ or SparseGPT with the Hessian of all the
// calibration inputs x divided by the smoothing scales sc (nil: none), or
// magnitude pruning then rounding; ws are the float weights before
// smoothing.
func roundWeights(s *calib.Session, x runtime.Buf, sc []float32, ws [][]float32, outs []int, wq []*model.Quantized, opt Options) error {
	in := x.Cols()
	sp := opt.Sparse
	sp.Quant, sp.Threads = true, opt.Threads
	var h *gptq.Hessian
	if opt.Weights != "magnitude" {
		be := s.Backend()
		xs := x
		if sc != nil {
			xs = be.Alloc(x.Rows(), in)
			be.CopyRows(xs, 0, x, 0, x.Rows())
			be.ScaleColumns(xs, sc, true)
			defer be.Free(xs)
		}
		g := be.Alloc(in, in)
		be.AddGram(g, xs)
		h = gptq.NewHessian(in)
		err := h.AddGram(s.Download(g), x.Rows())
		be.Free(g)
		if err != nil {
			return err
		}
	}
	for i := range ws {
		w := ws[i]
		if sc != nil {
			w = scaledCopy(ws[i], outs[i], in, sc, false)
		}
		var res *gptq.SparseResult
		var err error
		switch opt.Weights {
		case "gptq":
			sp.Sparsity, sp.N, sp.M = 0, 0, 0
			res, err = gptq.Prune(w, outs[i], in, h, sp)
		case "sparsegpt":
			res, err = gptq.Prune(w, outs[i], in, h, sp)
		case "magnitude":
			res, err = gptq.Magnitude(w, outs[i], in, sp)
		default:
			return fmt.Errorf("weights %q: want rtn, gptq, sparsegpt or magnitude", opt.Weights)
		}
		if err != nil {
			return err
		}
		wq[i] = res.Q
	}
	return nil
}

// smoothDown picks down_proj input scales from the float MLP hidden state of
// the tokens x ([n, hidden]) with gate/up ws[0], ws[1], divides up's rows
// (ws[1]) by them and installs down with its columns multiplied.
func smoothDown(s *calib.Session, l int, x runtime.Buf, ws [][]float32, inter int, opt Options) error {
	wd, err := s.Weight(l, model.Down)
	if err != nil {
		return err
	}
	in := x.Cols()
	be := s.Backend()
	lg, lgb := s.Linear(ws[0], inter, in)
	lu, lub := s.Linear(ws[1], inter, in)
	d := s.RT.MLPHidden(l, x, runtime.Overrides{model.Gate: lg, model.Up: lu})
	s.Drop(lg, lgb)
	s.Drop(lu, lub)
	sd := Scales(be.ColumnStats(d).MaxAbs, [][]float32{wd}, opt.Alpha)
	be.Free(d)
	for r := 0; r < inter; r++ {
		for c := 0; c < in; c++ {
			ws[1][r*in+c] /= sd[r]
		}
	}
	nd := scaledCopy(wd, len(wd)/inter, inter, sd, false)
	return s.SetLinear(l, model.Down, model.FromFloat32([]int{len(wd) / inter, inter}, nd))
}

func biasRole(r model.Role) model.Role {
	switch r {
	case model.Q:
		return model.QBias
	case model.K:
		return model.KBias
	case model.V:
		return model.VBias
	}
	return ""
}

// scaledCopy divides (div) or multiplies the columns of x [rows, cols] by s.
func scaledCopy(x []float32, rows, cols int, s []float32, div bool) []float32 {
	out := make([]float32, len(x))
	model.Parallel(rows, max(1, (1<<16)/cols), func(r0, r1 int) {
		for r := r0; r < r1; r++ {
			for c := 0; c < cols; c++ {
				if div {
					out[r*cols+c] = x[r*cols+c] / s[c]
				} else {
					out[r*cols+c] = x[r*cols+c] * s[c]
				}
			}
		}
	})
	return out
}
