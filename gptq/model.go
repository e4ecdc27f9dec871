package gptq

import (
	"errors"
	"fmt"
	"math"

	"qtool/formats/model"
	"qtool/quantize/calib"
	"qtool/runtime"
)

// relErrRows bounds the calibration rows used for the reported output error.
const relErrRows = 4096

// QuantizeModel runs GPTQ over every decoder linear of the session's model,
// layer by layer and true-sequentially (q/k/v share one Hessian, then o,
// then gate/up, then down), installing each result in the session. The
// result model is s.Out.
//
// The Hessian is accumulated on the session's backend (Calibrator.AddGram).
// On a backend that implements runtime.GPTQSolver (the GPU) the
// factorisation and the column loop run there too, in the precision the
// reference uses (float32 weights and updates; the Cholesky factorisation
// and inverse in float64, see runtime/cuda); otherwise on the host
// (Quantize: float64, gonum).
//
// With opt.Asym the session also carries the float model
// (Session.TrackFloat) and each linear is rounded towards its asymmetric
// target (see targetTerms.weight): the weight that maps the quantized
// model's inputs to the float model's outputs (plus, for o and down,
// Asym.Resid of the gap between the two residual streams), computed on
// the backend (Calibrator.AddCrossGram, SolveSPD) and handed to the same
// GPTQ; then, with Asym.Head, the classifier is refit (RefitHead). The
// statistics then carry each module's error against the float model
// (FloatErr).
func QuantizeModel(s *calib.Session, opt Options, progress calib.Progress) ([]calib.ModuleStat, error) {
	opt.Threads = s.Threads()
	c := s.Cfg
	for _, d := range []struct {
		name string
		n    int
	}{{"hidden_size", c.Hidden}, {"q width (heads×head_dim)", c.QDim()}, {"intermediate_size", c.Intermediate}} {
		if err := opt.Validate(d.n); err != nil {
			return nil, fmt.Errorf("%w (%s)", err, d.name)
		}
	}
	be := s.Backend()
	solver, onDevice := be.(Device)
	if opt.Asym != nil {
		if err := s.TrackFloat(); err != nil {
			return nil, fmt.Errorf("gptq: %w", err)
		}
	}
	damp := opt.withDefaults().Damp
	var stats []calib.ModuleStat
	step := func(l int, p runtime.CapturePoint, x runtime.Buf) error {
		in, rows := x.Cols(), x.Rows()
		done := s.Phase("hessian")
		g := be.Alloc(in, in)
		defer be.Free(g)
		be.AddGram(g, x)
		var h *Hessian
		if !onDevice {
			h = NewHessian(in)
			if err := h.AddGram(s.Download(g), rows); err != nil {
				done()
				return fmt.Errorf("%s inputs: %w", p, err)
			}
		}
		done()
		// the float weights: on the device widened from the installed
		// uploads, on the host from the model
		roles := p.Roles()
		wbs := make([]runtime.Buf, len(roles))
		defer func() {
			for _, b := range wbs {
				if b != nil {
					be.Free(b)
				}
			}
		}()
		for i, r := range roles {
			if onDevice {
				wbs[i] = be.Dequantize(s.RT.Linear(l, r))
				continue
			}
			w, err := s.Weight(l, r)
			if err != nil {
				return err
			}
			wbs[i] = s.Upload(w, len(w)/in, in)
		}
		tbs := wbs // the weights GPTQ rounds
		asymNote := ""
		if opt.Asym != nil {
			done := s.Phase("asymmetric target")
			rf, rq := s.FloatResidual()
			terms := newTargetTerms(be, x, s.FloatInput(), g, rf, rq, opt.Asym.Resid, targetDamp(damp, in, rows))
			asymNote = ", asym"
			if terms.resid != nil {
				asymNote += fmt.Sprintf(" + %.2g residual", terms.beta)
			}
			var err error
			tbs, err = terms.weights(wbs)
			terms.free()
			done()
			if err != nil {
				return fmt.Errorf("%s: %w", p, err)
			}
			defer func() {
				for _, b := range tbs {
					be.Free(b)
				}
			}()
		}
		for i, r := range roles {
			t := calib.StartTimer()
			done := s.Phase("gptq")
			wb, tb := wbs[i], tbs[i]
			var res *Result
			var err error
			if onDevice {
				res, err = QuantizeOn(solver, g, rows, tb, opt)
			} else {
				res, err = Quantize(s.Download(tb), tb.Rows(), in, h, opt)
			}
			done()
			if err != nil {
				return fmt.Errorf("%s: %w", model.Name(l, r), err)
			}
			if err := s.SetLinear(l, r, res.Q); err != nil {
				return err
			}
			done = s.Phase("output error")
			rel := s.RelErrOf(x, wb, l, r, relErrRows)
			ferr := s.FloatErrOf(x, wb, l, r, relErrRows)
			done()
			note := fmt.Sprintf("damp %.3g", res.DampFrac)
			if res.DeadCols > 0 {
				note += fmt.Sprintf(", %d dead columns", res.DeadCols)
			}
			note += asymNote
			stats = append(stats, calib.ModuleStat{Layer: l, Role: r, Loss: res.Loss, RelErr: rel, FloatErr: ferr, Seconds: t.Seconds(), Note: note})
			if progress != nil {
				progress(l, &stats[len(stats)-1])
			}
		}
		return nil
	}
	if err := s.Run(step, progress); err != nil {
		return stats, fmt.Errorf("gptq: %w", err)
	}
	if opt.Asym != nil && opt.Asym.Head {
		st, err := RefitHead(s, damp)
		if err != nil {
			return stats, err
		}
		stats = append(stats, st)
	}
	return stats, nil
}

// Device is a backend that runs GPTQ itself (the GPU).
type Device interface {
	runtime.Calibrator
	runtime.GPTQSolver
}

// QuantizeOn runs GPTQ for the float weight w ([rows, cols], on the
// device) on the device, with the Gram matrix g (Σxᵀx of tokens inputs).
// The host prepares what needs the whole diagonal (dead columns, the
// act-order permutation, the damping) and packs the result; the device
// factorises and runs the column loop. Damping is retried like Quantize's.
func QuantizeOn(dev Device, g runtime.Buf, tokens int, w runtime.Buf, opt Options) (*Result, error) {
	rows, cols := w.Rows(), w.Cols()
	opt = opt.withDefaults()
	if err := opt.Validate(cols); err != nil {
		return nil, err
	}
	if tokens == 0 {
		return nil, errors.New("gptq: no calibration tokens reached this layer")
	}
	diag := dev.Diagonal(g)
	job := runtime.GPTQJob{Rows: rows, Cols: cols, Bits: opt.Bits, GroupSize: opt.GroupSize, BlockSize: opt.BlockSize,
		Sym: opt.Sym, FP16Scales: !opt.FP32Scales}
	if job.GroupSize == 0 {
		job.GroupSize = cols
	}
	switch opt.Search {
	case "mse":
		job.Search = 1
	case "hmse":
		job.Search = 2
	}
	if !opt.ActOrder && job.BlockSize%job.GroupSize != 0 && job.GroupSize%job.BlockSize != 0 {
		job.BlockSize = job.GroupSize // as in Quantize: blocks aligned to groups
	}
	res := &Result{}
	hd := make([]float64, cols)
	mean := 0.0
	f := 2 / float64(tokens)
	for i, d := range diag {
		v := float64(d) * f
		if math.IsNaN(v) || math.IsInf(v, 0) {
			return nil, fmt.Errorf("gptq: Hessian entry (%d,%d) is %g: the calibration activations overflow", i, i, v)
		}
		hd[i] = v
		if v == 0 {
			res.DeadCols++
			v = 1
		}
		mean += v
	}
	mean /= float64(cols)
	var perm []int
	job.Dead, perm = columnOrder(hd, opt.ActOrder)
	job.HDiag = hd
	if opt.ActOrder {
		job.Perm = perm
	}
	var out *runtime.GPTQOutput
	var err error
	for res.Retries = 0; res.Retries < 4; res.Retries++ {
		res.DampFrac = min(opt.Damp*math.Pow(10, float64(res.Retries)), 1)
		res.Damp = res.DampFrac * mean
		job.Damp = res.Damp
		out, err = dev.GPTQ(g, w, tokens, job)
		if !errors.Is(err, runtime.ErrNotPositiveDefinite) {
			break
		}
	}
	if err != nil {
		if errors.Is(err, runtime.ErrNotPositiveDefinite) {
			return nil, fmt.Errorf("gptq: %w even with damping %.3g × mean(diag H)", ErrNotPositiveDefinite, res.DampFrac)
		}
		return nil, fmt.Errorf("gptq: %w", err)
	}
	res.Loss = out.Loss
	if res.Q, err = pack(out.Codes, perm, out.Scale, out.Zero, rows, cols, opt); err != nil {
		return nil, err
	}
	return res, nil
}
