package awq

import (
	"fmt"

	"qtool/formats/model"
	"qtool/gptq"
	"qtool/quantize/calib"
	"qtool/runtime"
)

// QuantizeModel runs AWQ over every decoder layer of the session's model and
// installs the quantized linears (and the rescaled norms) in the session;
// the result model is s.Out. Per layer, in order:
//
//   - attn_norm → q/k/v: scale search with the attention output (after the
//     float o projection) as the block output, on SearchTokens tokens;
//   - v → o when v and o have the same shape (not under GQA);
//   - mlp_norm → gate/up: the MLP output as the block output;
//   - up → down: the down output;
//   - clip search for every linear but q and k; asymmetric per-group
//     quantization with fp16 scales.
//
// Each group is calibrated on the inputs produced by the already quantized
// groups before it (calib.Session's true-sequential order).
func QuantizeModel(s *calib.Session, opt Options, progress calib.Progress) ([]calib.ModuleStat, error) {
	opt = opt.WithDefaults()
	opt.Threads = s.Threads()
	c := s.Cfg
	for _, d := range []struct {
		name string
		n    int
	}{{"hidden_size", c.Hidden}, {"q width (heads×head_dim)", c.QDim()}, {"intermediate_size", c.Intermediate}} {
		if opt.GroupSize > 0 && d.n%opt.GroupSize != 0 {
			return nil, fmt.Errorf("awq: group size %d does not divide %s %d", opt.GroupSize, d.name, d.n)
		}
	}
	q := &layerQuant{s: s, opt: opt, progress: progress}
	if err := s.Run(q.step, progress); err != nil {
		return q.stats, fmt.Errorf("awq: %w", err)
	}
	return q.stats, nil
}

type layerQuant struct {
	s        *calib.Session
	opt      Options
	progress calib.Progress
	stats    []calib.ModuleStat
	// ratios of the scale groups of the current layer, for the notes
	notes map[model.Role]string
	// the Hessian of the last input group (AWQ + GPTQ)
	hess  *gptq.Hessian
	hessX *float32
}

func (q *layerQuant) step(l int, p runtime.CapturePoint, x []float32, rows int) error {
	switch p {
	case runtime.CaptureQKV:
		q.notes = map[model.Role]string{}
		return q.qkv(l, x, rows)
	case runtime.CaptureO:
		return q.finish(l, []model.Role{model.O}, x, rows)
	case runtime.CaptureGateUp:
		return q.gateUp(l, x, rows)
	case runtime.CaptureDown:
		return q.finish(l, []model.Role{model.Down}, x, rows)
	}
	return nil
}

func (q *layerQuant) weight(l int, r model.Role) ([]float32, error) {
	w, err := q.s.Weight(l, r)
	if err != nil {
		return nil, err
	}
	if w == nil {
		return nil, fmt.Errorf("%s is missing", model.Name(l, r))
	}
	return append([]float32(nil), w...), nil
}

// windows picks evenly spaced calibration windows holding about
// SearchTokens tokens.
func (q *layerQuant) windows() []int {
	n := q.s.Windows()
	k := max(1, min(n, q.opt.SearchTokens/q.s.SeqLen()))
	out := make([]int, k)
	for i := range out {
		out[i] = i * n / k
	}
	return out
}

func mse(a, b []float32) float64 {
	e := 0.0
	for i := range a {
		d := float64(a[i] - b[i])
		e += d * d
	}
	return e / float64(len(a))
}

// qkv searches and folds the attn_norm → q/k/v scales (and v → o when the
// shapes allow), then clips and quantizes q, k, v.
func (q *layerQuant) qkv(l int, h []float32, rows int) error {
	s, c := q.s, q.s.Cfg
	H, Q, KV := c.Hidden, c.QDim(), c.KVDim()
	roles := []model.Role{model.Q, model.K, model.V}
	outs := []int{Q, KV, KV}
	ws := make([][]float32, 3)
	lins := make([]Linear, 3)
	for i, r := range roles {
		w, err := q.weight(l, r)
		if err != nil {
			return err
		}
		ws[i] = w
		lins[i] = Linear{W: w, Rows: outs[i]}
	}
	wo, err := q.weight(l, model.O)
	if err != nil {
		return err
	}
	wins := q.windows()
	attRef, err := s.AttentionOutputs(l, wins, nil)
	if err != nil {
		return err
	}
	n := len(attRef) / Q
	ref := s.MatMul(attRef, wo, n, H, Q)
	loss := func(fq [][]float32) (float64, error) {
		ov := map[model.Role]model.Tensor{}
		for i, r := range roles {
			ov[r] = model.FromFloat32([]int{outs[i], H}, fq[i])
		}
		att, err := s.AttentionOutputs(l, wins, ov)
		if err != nil {
			return 0, err
		}
		return mse(s.MatMul(att, wo, n, H, Q), ref), nil
	}
	t := calib.StartTimer()
	res, err := SearchScale(MeanAbs(h, rows, H), lins, loss, q.opt)
	if err != nil {
		return fmt.Errorf("attn_norm → q/k/v scales: %w", err)
	}
	if err := q.foldNorm(l, model.AttnNorm, model.AttnNormBias, res.Scales); err != nil {
		return err
	}
	for i := range ws {
		scaleCols(ws[i], outs[i], H, res.Scales)
	}
	divCols(h, rows, H, res.Scales)
	note := fmt.Sprintf("r=%.2f", res.Ratio)

	// v → o, only when v's output matches o's input one to one.
	if KV == Q && Q == H {
		xo := attRef
		lo := []Linear{{W: wo, Rows: H}}
		lossO := func(fq [][]float32) (float64, error) {
			return mse(s.MatMul(xo, fq[0], n, H, Q), ref), nil
		}
		ro, err := SearchScale(MeanAbs(xo, n, Q), lo, lossO, q.opt)
		if err != nil {
			return fmt.Errorf("v → o scales: %w", err)
		}
		divRows(ws[2], KV, H, ro.Scales)
		if err := q.divBias(l, model.VBias, ro.Scales); err != nil {
			return err
		}
		scaleCols(wo, H, Q, ro.Scales)
		if err := s.SetLinear(l, model.O, model.FromFloat32([]int{H, Q}, wo)); err != nil {
			return err
		}
		q.notes[model.O] = fmt.Sprintf("v→o r=%.2f", ro.Ratio)
	}
	sub, ns := calib.Subsample(h, rows, H, q.opt.ClipTokens)
	for i, r := range roles {
		clip := r == model.V // llm-awq skips q and k: their errors are softmax-damped
		if err := q.quantize(l, r, ws[i], outs[i], H, h, rows, sub, ns, clip, res.Loss, note, t); err != nil {
			return err
		}
	}
	return nil
}

// gateUp searches and folds mlp_norm → gate/up and up → down scales, then
// clips and quantizes gate and up.
func (q *layerQuant) gateUp(l int, h []float32, rows int) error {
	s, c := q.s, q.s.Cfg
	H, I := c.Hidden, c.Intermediate
	wg, err := q.weight(l, model.Gate)
	if err != nil {
		return err
	}
	wu, err := q.weight(l, model.Up)
	if err != nil {
		return err
	}
	wd, err := q.weight(l, model.Down)
	if err != nil {
		return err
	}
	t := calib.StartTimer()
	xs, n := calib.Subsample(h, rows, H, q.opt.SearchTokens)
	xs = append([]float32(nil), xs...)
	ref := s.MatMul(calib.MLPHidden(xs, n, H, I, wg, wu, q.opt.Threads), wd, n, H, I)
	loss := func(fq [][]float32) (float64, error) {
		d := calib.MLPHidden(xs, n, H, I, fq[0], fq[1], q.opt.Threads)
		return mse(s.MatMul(d, wd, n, H, I), ref), nil
	}
	res, err := SearchScale(MeanAbs(h, rows, H), []Linear{{W: wg, Rows: I}, {W: wu, Rows: I}}, loss, q.opt)
	if err != nil {
		return fmt.Errorf("mlp_norm → gate/up scales: %w", err)
	}
	if err := q.foldNorm(l, model.MLPNorm, model.MLPNormBias, res.Scales); err != nil {
		return err
	}
	scaleCols(wg, I, H, res.Scales)
	scaleCols(wu, I, H, res.Scales)
	divCols(h, rows, H, res.Scales)
	divCols(xs, n, H, res.Scales)
	note := fmt.Sprintf("r=%.2f", res.Ratio)

	// up → down on the float MLP hidden state of the scaled block.
	d := calib.MLPHidden(xs, n, H, I, wg, wu, q.opt.Threads)
	refD := s.MatMul(d, wd, n, H, I)
	lossD := func(fq [][]float32) (float64, error) {
		return mse(s.MatMul(d, fq[0], n, H, I), refD), nil
	}
	rd, err := SearchScale(MeanAbs(d, n, I), []Linear{{W: wd, Rows: H}}, lossD, q.opt)
	if err != nil {
		return fmt.Errorf("up → down scales: %w", err)
	}
	divRows(wu, I, H, rd.Scales)
	scaleCols(wd, H, I, rd.Scales)
	if err := s.SetLinear(l, model.Down, model.FromFloat32([]int{H, I}, wd)); err != nil {
		return err
	}
	q.notes[model.Down] = fmt.Sprintf("up→down r=%.2f", rd.Ratio)
	sub, ns := calib.Subsample(h, rows, H, q.opt.ClipTokens)
	for _, it := range []struct {
		r model.Role
		w []float32
	}{{model.Gate, wg}, {model.Up, wu}} {
		if err := q.quantize(l, it.r, it.w, I, H, h, rows, sub, ns, true, res.Loss, note, t); err != nil {
			return err
		}
	}
	return nil
}

// finish clips and quantizes linears whose scales were already folded (o,
// down).
func (q *layerQuant) finish(l int, roles []model.Role, x []float32, rows int) error {
	in := len(x) / rows
	sub, ns := calib.Subsample(x, rows, in, q.opt.ClipTokens)
	for _, r := range roles {
		t := calib.StartTimer()
		w, err := q.weight(l, r)
		if err != nil {
			return err
		}
		if err := q.quantize(l, r, w, len(w)/in, in, x, rows, sub, ns, true, -1, q.notes[r], t); err != nil {
			return err
		}
	}
	return nil
}

// quantize clips (optionally) and quantizes w [out, in] whose input is x,
// installs it and records the module's statistics.
func (q *layerQuant) quantize(l int, r model.Role, w []float32, out, in int, x []float32, rows int, sub []float32, ns int, clip bool, loss float64, note string, t calib.Timer) error {
	orig := append([]float32(nil), w...)
	if clip && !q.opt.NoClip {
		mv, err := SearchClip(w, out, in, sub, ns, q.opt)
		if err != nil {
			return fmt.Errorf("%s clip: %w", model.Name(l, r), err)
		}
		ApplyClip(w, out, in, q.opt.GroupSize, mv)
		if note != "" {
			note += ", "
		}
		note += "clipped"
	}
	var qt *model.Quantized
	if g := q.opt.GPTQ; g != nil {
		h, err := q.hessian(x, rows, in)
		if err != nil {
			return fmt.Errorf("%s: %w", model.Name(l, r), err)
		}
		go2 := *g
		go2.Bits, go2.GroupSize = q.opt.Bits, q.opt.GroupSize
		res, err := gptq.Quantize(w, out, in, h, go2)
		if err != nil {
			return fmt.Errorf("%s: %w", model.Name(l, r), err)
		}
		qt = res.Q
		if note != "" {
			note += ", "
		}
		note += "gptq"
	} else {
		var err error
		if qt, err = q.opt.Quantize(w, out, in); err != nil {
			return fmt.Errorf("%s: %w", model.Name(l, r), err)
		}
	}
	wq, _ := qt.Float32()
	rel := calib.RelErr(x, rows, in, orig, wq, out, 4096, q.opt.Threads)
	if loss < 0 {
		loss = rel
	}
	if err := q.s.SetLinear(l, r, qt); err != nil {
		return err
	}
	q.stats = append(q.stats, calib.ModuleStat{Layer: l, Role: r, Loss: loss, RelErr: rel, Seconds: t.Seconds(), Note: note})
	if q.progress != nil {
		q.progress(l, r, true)
	}
	return nil
}

// hessian returns the GPTQ Hessian of the inputs x, reusing the last one
// when the same input slice is passed again (q, k and v share it).
func (q *layerQuant) hessian(x []float32, rows, in int) (*gptq.Hessian, error) {
	if q.hess != nil && q.hessX == &x[0] {
		return q.hess, nil
	}
	h := gptq.NewHessian(in)
	if err := h.AddBatch(x, rows, q.opt.Threads); err != nil {
		return nil, err
	}
	q.hess, q.hessX = h, &x[0]
	return h, nil
}

// foldNorm divides a norm weight (and its bias, if any) by the scales.
func (q *layerQuant) foldNorm(l int, wr, br model.Role, sc []float32) error {
	w, err := q.weight(l, wr)
	if err != nil {
		return err
	}
	for i := range w {
		w[i] /= sc[i]
	}
	if err := q.s.SetVector(l, wr, w); err != nil {
		return err
	}
	return q.divBias(l, br, sc)
}

func (q *layerQuant) divBias(l int, r model.Role, sc []float32) error {
	b, err := q.s.Weight(l, r)
	if err != nil || b == nil {
		return err
	}
	nb := append([]float32(nil), b...)
	for i := range nb {
		nb[i] /= sc[i]
	}
	return q.s.SetVector(l, r, nb)
}

// scaleCols multiplies column c of w [rows, cols] by s[c].
func scaleCols(w []float32, rows, cols int, s []float32) {
	for r := 0; r < rows; r++ {
		for c := 0; c < cols; c++ {
			w[r*cols+c] *= s[c]
		}
	}
}

// divCols divides column c of x [rows, cols] by s[c].
func divCols(x []float32, rows, cols int, s []float32) {
	for r := 0; r < rows; r++ {
		for c := 0; c < cols; c++ {
			x[r*cols+c] /= s[c]
		}
	}
}

// divRows divides row r of w [rows, cols] by s[r].
func divRows(w []float32, rows, cols int, s []float32) {
	for r := 0; r < rows; r++ {
		for c := 0; c < cols; c++ {
			w[r*cols+c] /= s[r]
		}
	}
}
