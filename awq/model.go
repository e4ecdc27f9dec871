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
	q.dev, _ = s.Backend().(runtime.AWQSolver)
	defer q.dropGram()
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
	// dev runs the fake quantization and the clip search on the device
	// when the backend has them (nil: on the host).
	dev runtime.AWQSolver
	// ratios of the scale groups of the current layer, for the notes
	notes map[model.Role]string
	// the Gram matrix of the current input group (AWQ + GPTQ)
	gram     runtime.Buf
	gramRows int
}

func (q *layerQuant) step(l int, p runtime.CapturePoint, x runtime.Buf) error {
	q.dropGram()
	switch p {
	case runtime.CaptureQKV:
		q.notes = map[model.Role]string{}
		return q.qkv(l, x)
	case runtime.CaptureO:
		return q.finish(l, []model.Role{model.O}, x)
	case runtime.CaptureGateUp:
		return q.gateUp(l, x)
	case runtime.CaptureDown:
		return q.finish(l, []model.Role{model.Down}, x)
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

// mse is the mean squared difference of two backend buffers.
func (q *layerQuant) mse(a, b runtime.Buf) float64 {
	d, _ := q.s.Backend().SquaredError(a, b)
	return d / float64(b.Rows()*b.Cols())
}

// candidates fake-quantizes weights at column scales s on the backend: on
// the device when it has an AWQSolver (the float weights uploaded once),
// else on the host.
type candidates struct {
	q    *layerQuant
	ws   [][]float32 // host float weights [rows_i, cols]
	rows []int
	cols int
	dev  []runtime.Buf // device copies of ws (with an AWQSolver)
	tmp  [][]float32   // host scratch
	made []runtime.Linear
	bufs []runtime.Buf
}

func (q *layerQuant) candidates(ws [][]float32, rows []int, cols int) *candidates {
	c := &candidates{q: q, ws: ws, rows: rows, cols: cols}
	if q.dev != nil {
		for i, w := range ws {
			c.dev = append(c.dev, q.s.Upload(w, rows[i], cols))
		}
	} else {
		for _, w := range ws {
			c.tmp = append(c.tmp, make([]float32, len(w)))
		}
	}
	return c
}

// linears returns the fake-quantized linears at scales s; they stay valid
// until the next call or release.
func (c *candidates) linears(s []float32) ([]runtime.Linear, error) {
	c.drop()
	be := c.q.s.Backend()
	for i, w := range c.ws {
		var b runtime.Buf
		if c.q.dev != nil {
			b = be.Alloc(c.rows[i], c.cols)
			c.q.dev.FakeQuantAWQ(b, c.dev[i], s, c.q.opt.Bits, c.q.opt.GroupSize, c.q.opt.FP32Scales)
		} else {
			fq, err := c.q.opt.FakeQuantScaled(c.tmp[i], w, c.rows[i], c.cols, s)
			if err != nil {
				return nil, err
			}
			b = c.q.s.Upload(fq, c.rows[i], c.cols)
		}
		c.bufs = append(c.bufs, b)
		c.made = append(c.made, be.FloatLinear(b))
	}
	return c.made, nil
}

func (c *candidates) drop() {
	for i := range c.made {
		c.q.s.Drop(c.made[i], c.bufs[i])
	}
	c.made, c.bufs = nil, nil
}

func (c *candidates) release() {
	c.drop()
	for _, b := range c.dev {
		c.q.s.Backend().Free(b)
	}
	c.dev = nil
}

// search runs the scale search for the linears ws reading an input with
// per-channel mean |x| xMean; loss scores the fake-quantized linears.
func (q *layerQuant) search(xMean []float32, ws [][]float32, rows []int, loss func([]runtime.Linear) float64) (*ScaleResult, error) {
	cols := len(xMean)
	var wMean []float32
	if q.opt.DuoScaling {
		lins := make([]Linear, len(ws))
		for i := range ws {
			lins[i] = Linear{W: ws[i], Rows: rows[i]}
		}
		wMean = WeightMean(lins, cols, q.opt.GroupSize)
	}
	defer q.s.Phase("scale search")()
	c := q.candidates(ws, rows, cols)
	defer c.release()
	return SearchScaleWith(xMean, wMean, q.opt, func(s []float32) (float64, error) {
		lins, err := c.linears(s)
		if err != nil {
			return 0, err
		}
		return loss(lins), nil
	})
}

// qkv searches and folds the attn_norm → q/k/v scales (and v → o when the
// shapes allow), then clips and quantizes q, k, v.
func (q *layerQuant) qkv(l int, h runtime.Buf) error {
	s, c := q.s, q.s.Cfg
	be := s.Backend()
	H, Q, KV := c.Hidden, c.QDim(), c.KVDim()
	roles := []model.Role{model.Q, model.K, model.V}
	outs := []int{Q, KV, KV}
	ws := make([][]float32, 3)
	for i, r := range roles {
		w, err := q.weight(l, r)
		if err != nil {
			return err
		}
		ws[i] = w
	}
	wo, err := q.weight(l, model.O)
	if err != nil {
		return err
	}
	wins := q.windows()
	attRef := s.AttentionOutputs(l, wins, nil)
	defer be.Free(attRef)
	lo, lob := s.Linear(wo, H, Q)
	ref := s.MatMul(attRef, lo)
	defer be.Free(ref)
	loss := func(fq []runtime.Linear) float64 {
		att := s.AttentionOutputs(l, wins, runtime.Overrides{model.Q: fq[0], model.K: fq[1], model.V: fq[2]})
		y := s.MatMul(att, lo)
		e := q.mse(y, ref)
		be.Free(att)
		be.Free(y)
		return e
	}
	t := calib.StartTimer()
	res, err := q.search(be.ColumnStats(h).MeanAbs, ws, outs, loss)
	if err != nil {
		s.Drop(lo, lob)
		return fmt.Errorf("attn_norm → q/k/v scales: %w", err)
	}
	if err := q.foldNorm(l, model.AttnNorm, model.AttnNormBias, res.Scales); err != nil {
		s.Drop(lo, lob)
		return err
	}
	for i := range ws {
		scaleCols(ws[i], outs[i], H, res.Scales)
	}
	be.ScaleColumns(h, res.Scales, true)
	note := fmt.Sprintf("r=%.2f", res.Ratio)

	// v → o, only when v's output matches o's input one to one.
	if KV == Q && Q == H {
		lossO := func(fq []runtime.Linear) float64 {
			y := s.MatMul(attRef, fq[0])
			e := q.mse(y, ref)
			be.Free(y)
			return e
		}
		ro, err := q.search(be.ColumnStats(attRef).MeanAbs, [][]float32{wo}, []int{H}, lossO)
		if err != nil {
			s.Drop(lo, lob)
			return fmt.Errorf("v → o scales: %w", err)
		}
		divRows(ws[2], KV, H, ro.Scales)
		if err := q.divBias(l, model.VBias, ro.Scales); err != nil {
			s.Drop(lo, lob)
			return err
		}
		scaleCols(wo, H, Q, ro.Scales)
		if err := s.SetLinear(l, model.O, model.FromFloat32([]int{H, Q}, wo)); err != nil {
			s.Drop(lo, lob)
			return err
		}
		q.notes[model.O] = fmt.Sprintf("v→o r=%.2f", ro.Ratio)
	}
	s.Drop(lo, lob)
	for i, r := range roles {
		clip := r == model.V // llm-awq skips q and k: their errors are softmax-damped
		if err := q.quantize(l, r, ws[i], outs[i], H, h, clip, res.Loss, note, t); err != nil {
			return err
		}
	}
	return nil
}

// gateUp searches and folds mlp_norm → gate/up and up → down scales, then
// clips and quantizes gate and up.
func (q *layerQuant) gateUp(l int, h runtime.Buf) error {
	s, c := q.s, q.s.Cfg
	be := s.Backend()
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
	xs := s.Subsample(h, q.opt.SearchTokens)
	defer be.Free(xs)
	n := xs.Rows()
	// block output through the installed (float) down projection
	block := func(ov runtime.Overrides) runtime.Buf {
		d := s.RT.MLPHidden(l, xs, ov)
		y := be.Alloc(n, H)
		s.RT.Project(l, model.Down, y, d, nil)
		be.Free(d)
		return y
	}
	ref := block(nil)
	defer be.Free(ref)
	loss := func(fq []runtime.Linear) float64 {
		y := block(runtime.Overrides{model.Gate: fq[0], model.Up: fq[1]})
		e := q.mse(y, ref)
		be.Free(y)
		return e
	}
	res, err := q.search(be.ColumnStats(h).MeanAbs, [][]float32{wg, wu}, []int{I, I}, loss)
	if err != nil {
		return fmt.Errorf("mlp_norm → gate/up scales: %w", err)
	}
	if err := q.foldNorm(l, model.MLPNorm, model.MLPNormBias, res.Scales); err != nil {
		return err
	}
	scaleCols(wg, I, H, res.Scales)
	scaleCols(wu, I, H, res.Scales)
	be.ScaleColumns(h, res.Scales, true)
	be.ScaleColumns(xs, res.Scales, true)
	note := fmt.Sprintf("r=%.2f", res.Ratio)

	// up → down on the float MLP hidden state of the scaled block.
	lg, lgb := s.Linear(wg, I, H)
	lu, lub := s.Linear(wu, I, H)
	d := s.RT.MLPHidden(l, xs, runtime.Overrides{model.Gate: lg, model.Up: lu})
	s.Drop(lg, lgb)
	s.Drop(lu, lub)
	defer be.Free(d)
	refD := be.Alloc(n, H)
	s.RT.Project(l, model.Down, refD, d, nil)
	defer be.Free(refD)
	lossD := func(fq []runtime.Linear) float64 {
		y := s.MatMul(d, fq[0])
		e := q.mse(y, refD)
		be.Free(y)
		return e
	}
	rd, err := q.search(be.ColumnStats(d).MeanAbs, [][]float32{wd}, []int{H}, lossD)
	if err != nil {
		return fmt.Errorf("up → down scales: %w", err)
	}
	divRows(wu, I, H, rd.Scales)
	scaleCols(wd, H, I, rd.Scales)
	if err := s.SetLinear(l, model.Down, model.FromFloat32([]int{H, I}, wd)); err != nil {
		return err
	}
	q.notes[model.Down] = fmt.Sprintf("up→down r=%.2f", rd.Ratio)
	for _, it := range []struct {
		r model.Role
		w []float32
	}{{model.Gate, wg}, {model.Up, wu}} {
		if err := q.quantize(l, it.r, it.w, I, H, h, true, res.Loss, note, t); err != nil {
			return err
		}
	}
	return nil
}

// finish clips and quantizes linears whose scales were already folded (o,
// down).
func (q *layerQuant) finish(l int, roles []model.Role, x runtime.Buf) error {
	in := x.Cols()
	for _, r := range roles {
		t := calib.StartTimer()
		w, err := q.weight(l, r)
		if err != nil {
			return err
		}
		if err := q.quantize(l, r, w, len(w)/in, in, x, true, -1, q.notes[r], t); err != nil {
			return err
		}
	}
	return nil
}

// clipSearch returns the clipping thresholds of w [out, in] on the
// ClipTokens-row subsample of x: on the device (from the subsample's Gram
// matrix) or on the host.
func (q *layerQuant) clipSearch(w []float32, out, in int, x runtime.Buf) ([]float32, error) {
	s := q.s
	defer s.Phase("clip search")()
	sub := s.Subsample(x, q.opt.ClipTokens)
	defer s.Backend().Free(sub)
	if q.dev == nil {
		return SearchClip(w, out, in, s.Download(sub), sub.Rows(), q.opt)
	}
	be := s.Backend()
	g := be.Alloc(in, in)
	defer be.Free(g)
	be.AddGram(g, sub)
	wb := s.Upload(w, out, in)
	defer be.Free(wb)
	steps := max(1, int(q.opt.MaxShrink*float64(q.opt.ClipGrid)))
	return q.dev.ClipSearchAWQ(wb, g, q.opt.Bits, q.opt.GroupSize, q.opt.ClipGrid, steps, q.opt.FP32Scales), nil
}

// quantize clips (optionally) and quantizes w [out, in] whose input is x,
// installs it and records the module's statistics.
func (q *layerQuant) quantize(l int, r model.Role, w []float32, out, in int, x runtime.Buf, clip bool, loss float64, note string, t calib.Timer) error {
	orig := append([]float32(nil), w...)
	if clip && !q.opt.NoClip {
		mv, err := q.clipSearch(w, out, in, x)
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
		go2 := *g
		go2.Bits, go2.GroupSize = q.opt.Bits, q.opt.GroupSize
		res, err := q.gptq(w, out, in, x, go2)
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
	if err := q.s.SetLinear(l, r, qt); err != nil {
		return err
	}
	done := q.s.Phase("output error")
	rel := q.s.RelErr(x, orig, l, r, 4096)
	done()
	if loss < 0 {
		loss = rel
	}
	q.stats = append(q.stats, calib.ModuleStat{Layer: l, Role: r, Loss: loss, RelErr: rel, Seconds: t.Seconds(), Note: note})
	if q.progress != nil {
		q.progress(l, &q.stats[len(q.stats)-1])
	}
	return nil
}

// gptq rounds w with GPTQ on the inputs x, on the device when the backend
// is a GPTQ solver; the Gram matrix of x is kept for the group's other
// linears (q, k and v share it).
func (q *layerQuant) gptq(w []float32, out, in int, x runtime.Buf, opt gptq.Options) (*gptq.Result, error) {
	be := q.s.Backend()
	if q.gram == nil {
		q.gram = be.Alloc(in, in)
		be.AddGram(q.gram, x)
		q.gramRows = x.Rows()
	}
	if dev, ok := be.(gptq.Device); ok {
		wb := q.s.Upload(w, out, in)
		defer be.Free(wb)
		return gptq.QuantizeOn(dev, q.gram, q.gramRows, wb, opt)
	}
	h := gptq.NewHessian(in)
	if err := h.AddGram(q.s.Download(q.gram), q.gramRows); err != nil {
		return nil, err
	}
	return gptq.Quantize(w, out, in, h, opt)
}

func (q *layerQuant) dropGram() {
	if q.gram != nil {
		q.s.Backend().Free(q.gram)
		q.gram = nil
	}
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
	model.Parallel(rows, max(1, (1<<16)/cols), func(r0, r1 int) {
		for r := r0; r < r1; r++ {
			for c := 0; c < cols; c++ {
				w[r*cols+c] *= s[c]
			}
		}
	})
}

// divRows divides row r of w [rows, cols] by s[r].
func divRows(w []float32, rows, cols int, s []float32) {
	model.Parallel(rows, max(1, (1<<16)/cols), func(r0, r1 int) {
		for r := r0; r < r1; r++ {
			for c := 0; c < cols; c++ {
				w[r*cols+c] /= s[r]
			}
		}
	})
}
