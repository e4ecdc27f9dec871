package gptq

import (
	"fmt"

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
	var stats []calib.ModuleStat
	step := func(l int, p runtime.CapturePoint, x []float32, rows int) error {
		in := len(x) / rows
		h := NewHessian(in)
		if err := h.AddBatch(x, rows, s.Threads()); err != nil {
			return fmt.Errorf("%s inputs: %w", p, err)
		}
		for _, r := range p.Roles() {
			t := calib.StartTimer()
			w, err := s.Weight(l, r)
			if err != nil {
				return err
			}
			out := len(w) / in
			res, err := Quantize(w, out, in, h, opt)
			if err != nil {
				return fmt.Errorf("%s: %w", model.Name(l, r), err)
			}
			wq, _ := res.Q.Float32()
			rel := calib.RelErr(x, rows, in, w, wq, out, relErrRows, s.Threads())
			if err := s.SetLinear(l, r, res.Q); err != nil {
				return err
			}
			note := fmt.Sprintf("damp %.3g", res.DampFrac)
			if res.DeadCols > 0 {
				note += fmt.Sprintf(", %d dead columns", res.DeadCols)
			}
			stats = append(stats, calib.ModuleStat{Layer: l, Role: r, Loss: res.Loss, RelErr: rel, Seconds: t.Seconds(), Note: note})
			if progress != nil {
				progress(l, r, true)
			}
		}
		return nil
	}
	if err := s.Run(step, progress); err != nil {
		return stats, fmt.Errorf("gptq: %w", err)
	}
	return stats, nil
}
