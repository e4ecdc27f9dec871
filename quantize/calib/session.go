package calib

import (
	"fmt"
	"math"
	"time"

	"qtool/formats/model"
	"qtool/runtime"
)

// Session drives calibration over a model, one decoder layer at a time, on
// a runtime.Calibrator backend (the CPU or a GPU).
//
// It keeps only orchestration: the residual stream of every calibration
// window as one backend buffer [windows·seqlen, hidden], which layer is
// loaded, and the order of the linear groups. Every piece of layer
// arithmetic is the runtime's own (runtime.Model's blocks AttnNorm,
// Attention, Project, MLPNorm, MLPHidden, which runtime.Model.Layer
// composes too), so each linear group is calibrated on the inputs produced
// by the already quantized groups before it (true-sequential: q/k/v → o →
// gate/up → down) with exactly the arithmetic inference will use.
//
// The runtime model holds one decoder layer at a time (runtime.LoadLazy):
// the backend's memory holds that layer, the activations and the tensors
// outside the layers. Every weight or norm the quantizer installs with
// SetLinear/SetVector goes both into the runtime (so later blocks use it)
// and into Out, the result model.
type Session struct {
	Cfg model.Config
	RT  *runtime.Model
	// Out is the result: the source tensors, with every tensor installed
	// through SetLinear/SetVector replaced.
	Out *model.Model

	be      runtime.Calibrator
	windows [][]int
	seqLen  int
	threads int

	x runtime.Buf // residual stream [rows, hidden]; rows = len(windows)·seqLen

	layer int                  // layer whose host weights are cached
	cur   map[string][]float32 // current float weights of that layer

	ref          *floatRef // the float model's path (TrackFloat), nil when not tracked
	floatResumed []float32 // the float stream from a checkpoint, until TrackFloat takes it

	kv bool // calibrate an int8 KV cache (TrackKVCache)

	ckpt  *Checkpoint // records finished layers (nil: none)
	start int         // first layer Run calibrates (after resumed ones)

	phases map[string]float64 // wall seconds by phase, see Phase
	inStep time.Duration      // time spent inside steps during Layer
}

// NewSession loads m onto be (the layers one at a time, as the session
// reaches them) and embeds the calibration windows (all of the same length).
// threads is the number of goroutines of the quantizers' host work.
func NewSession(m *model.Model, be runtime.Calibrator, windows [][]int, threads int) (*Session, error) {
	if len(windows) == 0 {
		return nil, fmt.Errorf("calibration: no windows")
	}
	T := len(windows[0])
	for i, w := range windows {
		if len(w) != T {
			return nil, fmt.Errorf("calibration: window %d has %d tokens, window 0 has %d", i, len(w), T)
		}
		for j, id := range w {
			if id < 0 || id >= m.Config.Vocab {
				return nil, fmt.Errorf("calibration: token id %d (window %d, position %d) is outside the model vocabulary 0..%d; tokenizer and model do not match", id, i, j, m.Config.Vocab-1)
			}
		}
	}
	if m.Config.MaxSeq > 0 && T > m.Config.MaxSeq {
		return nil, fmt.Errorf("calibration: seqlen %d exceeds the model's max_position_embeddings %d", T, m.Config.MaxSeq)
	}
	rt, err := runtime.LoadLazy(m, be)
	if err != nil {
		return nil, err
	}
	out := model.New(m.Config)
	out.Source, out.Format, out.TokenizerDir = m.Source, m.Format, m.TokenizerDir
	for _, n := range m.Names() {
		t, _ := m.Lookup(n)
		out.Set(n, t)
	}
	if threads <= 0 {
		threads = 1
	}
	s := &Session{Cfg: m.Config, RT: rt, Out: out, be: be, windows: windows, seqLen: T, threads: threads, layer: -1,
		phases: map[string]float64{}}
	defer s.Phase("forward")()
	s.x = be.Alloc(len(windows)*T, m.Config.Hidden)
	for i, w := range windows {
		e := rt.Embed(w)
		be.CopyRows(s.x, i*T, e, 0, T)
		be.Free(e)
	}
	return s, nil
}

// Phase starts timing a phase of the work (the backend's queue is drained
// at both ends, so asynchronous GPU work is counted where it was queued);
// call the result to stop. Phases sums the times by name.
func (s *Session) Phase(name string) func() {
	syncer, _ := s.be.(interface{ Sync() })
	if syncer != nil {
		syncer.Sync()
	}
	t := time.Now()
	return func() {
		if syncer != nil {
			syncer.Sync()
		}
		s.phases[name] += time.Since(t).Seconds()
	}
}

// Phases returns the wall seconds spent per phase so far: "forward" (the
// layer blocks and the calibration windows' embedding), the quantizers'
// own phases, and the backend's (when it reports them with Profile).
func (s *Session) Phases() map[string]float64 {
	out := make(map[string]float64, len(s.phases))
	for k, v := range s.phases {
		out[k] = v
	}
	if p, ok := s.be.(interface{ Profile() map[string]float64 }); ok {
		for k, v := range p.Profile() {
			out[k] += v
		}
	}
	return out
}

// Backend is the backend the session runs on.
func (s *Session) Backend() runtime.Calibrator { return s.be }

// Rows is the number of calibration tokens (windows × seqlen).
func (s *Session) Rows() int { return len(s.windows) * s.seqLen }

// SeqLen is the window length.
func (s *Session) SeqLen() int { return s.seqLen }

// Windows is the number of calibration windows.
func (s *Session) Windows() int { return len(s.windows) }

// Threads is the number of goroutines of the host work.
func (s *Session) Threads() int { return s.threads }

// Residual returns the residual stream entering the current layer
// ([Rows, hidden]), owned by the session; callers must not modify it.
func (s *Session) Residual() runtime.Buf { return s.x }

// Close releases the session's backend buffers.
func (s *Session) Close() {
	if s.x != nil {
		s.be.Free(s.x)
		s.x = nil
	}
	s.ref.close(s.be)
	s.ref, s.floatResumed = nil, nil
}

func (s *Session) load(l int) {
	if s.layer != l {
		s.layer = l
		s.cur = map[string][]float32{}
	}
}

// Weight returns the current float32 value of tensor (l, r) — a linear
// weight [out, in] or a vector — as installed so far (the source value when
// nothing was installed), nil when an optional tensor is absent. The slice
// is shared: copy before modifying.
func (s *Session) Weight(l int, r model.Role) ([]float32, error) {
	s.load(l)
	name := model.Name(l, r)
	if w, ok := s.cur[name]; ok {
		return w, nil
	}
	t, ok := s.Out.Lookup(name)
	if !ok {
		return nil, nil // optional tensor absent
	}
	w, err := t.Float32()
	if err != nil {
		return nil, fmt.Errorf("calibration: %s: %w", name, err)
	}
	s.cur[name] = w
	return w, nil
}

// SetLinear installs t as linear (l, r) in the runtime and the result model.
func (s *Session) SetLinear(l int, r model.Role, t model.Tensor) error {
	s.load(l)
	if err := s.RT.SetLinear(l, r, t); err != nil {
		return err
	}
	delete(s.cur, model.Name(l, r))
	s.Out.Set(model.Name(l, r), t)
	s.touch(model.Name(l, r))
	return nil
}

// SetVector installs a norm weight or bias (l, r) with values v (nil removes
// an optional bias).
func (s *Session) SetVector(l int, r model.Role, v []float32) error {
	s.load(l)
	name := model.Name(l, r)
	s.touch(name)
	if v == nil {
		if err := s.RT.SetVector(name, nil); err != nil {
			return err
		}
		delete(s.cur, name)
		s.Out.Delete(name)
		return nil
	}
	t := model.FromFloat32([]int{len(v)}, v)
	if err := s.RT.SetVector(name, t); err != nil {
		return err
	}
	s.cur[name] = append([]float32(nil), v...)
	s.Out.Set(name, t)
	return nil
}

// Step is called by Layer with the input x ([rows, in], a backend buffer
// owned by the session, valid during the call) of each linear group of
// layer l, in order QKV, O, GateUp, Down. The callee may modify x at QKV
// and GateUp (the session recomputes the inputs from the installed norms
// afterwards), not at O and Down. It must install the weights the following
// groups should see (SetLinear, SetVector) before returning.
type Step func(l int, p runtime.CapturePoint, x runtime.Buf) error

// Layer calibrates decoder layer l true-sequentially and advances the
// residual stream through the layer with the installed weights.
func (s *Session) Layer(l int, step Step) error {
	t0 := time.Now()
	s.inStep = 0
	defer func() {
		s.phases["forward"] += (time.Since(t0) - s.inStep).Seconds()
	}()
	inner := step
	step = func(l int, p runtime.CapturePoint, x runtime.Buf) error {
		if sy, ok := s.be.(interface{ Sync() }); ok {
			sy.Sync()
		}
		t := time.Now()
		defer func() { s.inStep += time.Since(t) }()
		return inner(l, p, x)
	}
	if err := s.RT.LoadLayer(l); err != nil {
		return err
	}
	defer s.RT.UnloadLayer(l)
	be, rt := s.be, s.RT
	n, H := s.Rows(), s.Cfg.Hidden

	if s.ref != nil {
		s.ref.startLayer(s, l)
		defer s.ref.endLayer(s)
	}

	// 1. q/k/v: input is attn_norm(x), independent of this layer's weights.
	h := rt.AttnNorm(l, s.x)
	s.ref.capture(s, l, runtime.CaptureQKV, s.x)
	err := step(l, runtime.CaptureQKV, h)
	be.Free(h)
	if err != nil {
		return err
	}

	// 2. o: input is the attention output with the installed q/k/v.
	att := s.AttentionOutputs(l, nil, nil)
	s.ref.capture(s, l, runtime.CaptureO, s.x)
	if err := step(l, runtime.CaptureO, att); err != nil {
		be.Free(att)
		return err
	}
	mid := be.Alloc(n, H)
	rt.Project(l, model.O, mid, att, nil)
	be.Free(att)
	be.Add(mid, s.x)

	// 3. gate/up: input is mlp_norm(x + o(att)).
	h = rt.MLPNorm(l, mid)
	s.ref.capture(s, l, runtime.CaptureGateUp, mid)
	err = step(l, runtime.CaptureGateUp, h)
	be.Free(h)
	if err != nil {
		be.Free(mid)
		return err
	}
	// The step may have rescaled mlp_norm (AWQ, SmoothQuant): recompute.
	h = rt.MLPNorm(l, mid)
	d := rt.MLPHidden(l, h, nil)
	be.Free(h)

	// 4. down: input is silu(gate)·up with the installed gate/up.
	s.ref.capture(s, l, runtime.CaptureDown, mid)
	if err := step(l, runtime.CaptureDown, d); err != nil {
		be.Free(d)
		be.Free(mid)
		return err
	}
	o := be.Alloc(n, H)
	rt.Project(l, model.Down, o, d, nil)
	be.Free(d)
	be.Add(mid, o)
	be.Free(o)
	if _, sq := be.SquaredError(nil, mid); math.IsNaN(sq) || math.IsInf(sq, 0) {
		err := s.nonFinite(l, mid)
		be.Free(mid)
		return err
	}
	if s.kv {
		if err := s.calibrateKV(l, s.x); err != nil {
			be.Free(mid)
			return err
		}
	}
	be.Free(s.x)
	s.x = mid
	return nil
}

// nonFinite names the first NaN or infinite value of the layer output x.
func (s *Session) nonFinite(l int, x runtime.Buf) error {
	H := x.Cols()
	row := make([]float32, H)
	one := s.be.Alloc(1, H)
	defer s.be.Free(one)
	for r := 0; r < x.Rows(); r++ {
		s.be.CopyRows(one, 0, x, r, 1)
		s.be.Download(row, one)
		for c, v := range row {
			if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
				return fmt.Errorf("calibration: layer %d output (token %d, channel %d) is %g: the quantized layer overflows", l, r, c, v)
			}
		}
	}
	return fmt.Errorf("calibration: layer %d output overflows", l)
}

// AttentionOutputs runs the attention block of layer l (runtime.Model's
// AttnNorm and Attention) for the given windows (all when nil) from the
// current residual stream, with the installed q/k/v or ov's, and returns the
// attention outputs (the input of o) as a new buffer [len(windows)·seqlen,
// QDim]. The residual stream is not changed.
func (s *Session) AttentionOutputs(l int, windows []int, ov runtime.Overrides) runtime.Buf {
	if windows == nil {
		windows = make([]int, len(s.windows))
		for i := range windows {
			windows[i] = i
		}
	}
	be, T := s.be, s.seqLen
	out := be.Alloc(len(windows)*T, s.Cfg.QDim())
	x := be.Alloc(T, s.Cfg.Hidden)
	defer be.Free(x)
	for i, w := range windows {
		be.CopyRows(x, 0, s.x, w*T, T)
		h := s.RT.AttnNorm(l, x)
		s.attentionInto(out, i*T, l, h, ov)
		be.Free(h)
	}
	return out
}

// attention runs runtime.Model.Attention of layer l window by window on
// the normed input h ([Rows, hidden], every window) and returns the
// attention outputs as a new buffer [Rows, QDim].
func (s *Session) attention(l int, h runtime.Buf, ov runtime.Overrides) runtime.Buf {
	be, T := s.be, s.seqLen
	out := be.Alloc(h.Rows(), s.Cfg.QDim())
	hw := be.Alloc(T, h.Cols())
	defer be.Free(hw)
	for r0 := 0; r0 < h.Rows(); r0 += T {
		be.CopyRows(hw, 0, h, r0, T)
		s.attentionInto(out, r0, l, hw, ov)
	}
	return out
}

// attentionInto writes the attention outputs of one window's normed input
// h [seqlen, hidden] into rows r0.. of out.
func (s *Session) attentionInto(out runtime.Buf, r0, l int, h runtime.Buf, ov runtime.Overrides) {
	att := s.RT.Attention(l, h, 0, nil, ov)
	s.be.CopyRows(out, r0, att, 0, s.seqLen)
	s.be.Free(att)
}

// Subsample returns at most maxRows rows of x taken at an even stride (as
// a new buffer, also when all rows are taken).
func (s *Session) Subsample(x runtime.Buf, maxRows int) runtime.Buf {
	rows := x.Rows()
	idx := SubsampleRows(rows, maxRows)
	out := s.be.Alloc(len(idx), x.Cols())
	s.be.GatherRows(out, x, idx)
	return out
}

// SubsampleRows returns the rows Subsample takes: all of 0..rows−1 when
// rows <= maxRows (or maxRows <= 0), else maxRows rows at stride
// rows/maxRows.
func SubsampleRows(rows, maxRows int) []int {
	n, stride := rows, 1
	if maxRows > 0 && rows > maxRows {
		n, stride = maxRows, rows/maxRows
	}
	idx := make([]int, n)
	for i := range idx {
		idx[i] = i * stride
	}
	return idx
}

// Upload copies host values [rows, cols] into a new backend buffer.
func (s *Session) Upload(v []float32, rows, cols int) runtime.Buf {
	b := s.be.Alloc(rows, cols)
	s.be.Upload(b, v)
	return b
}

// Download returns the values of a backend buffer.
func (s *Session) Download(b runtime.Buf) []float32 {
	v := make([]float32, b.Rows()*b.Cols())
	s.be.Download(v, b)
	return v
}

// Linear uploads host float weights w [out, in] as a linear of the
// session's backend, returning it and the buffer holding it; release both
// with Drop.
func (s *Session) Linear(w []float32, out, in int) (runtime.Linear, runtime.Buf) {
	b := s.Upload(w, out, in)
	return s.be.FloatLinear(b), b
}

// Drop releases a linear made by Linear and its buffer.
func (s *Session) Drop(l runtime.Linear, b runtime.Buf) {
	s.be.FreeLinear(l)
	s.be.Free(b)
}

// MatMul returns x·Wᵀ as a new buffer [x.Rows(), w.Out()].
func (s *Session) MatMul(x runtime.Buf, w runtime.Linear) runtime.Buf {
	y := s.be.Alloc(x.Rows(), w.Out())
	s.be.MatMul(y, x, w)
	return y
}

// RelErr returns ‖x·(W−Ŵ)ᵀ‖² / ‖x·Wᵀ‖² for the float weight w [out, in]
// and the installed linear (l, r), on at most maxRows rows of x (evenly
// strided), computed on the backend.
func (s *Session) RelErr(x runtime.Buf, w []float32, l int, r model.Role, maxRows int) float64 {
	wb := s.Upload(w, len(w)/x.Cols(), x.Cols())
	defer s.be.Free(wb)
	return s.RelErrOf(x, wb, l, r, maxRows)
}

// RelErrOf is RelErr for a float weight already on the backend.
func (s *Session) RelErrOf(x, w runtime.Buf, l int, r model.Role, maxRows int) float64 {
	return s.OutputErr(x, s.RT.Linear(l, r), x, w, maxRows)
}

// OutputErr returns ‖x·Ŵᵀ − xref·Wᵀ‖² / ‖xref·Wᵀ‖² for a linear got (Ŵ)
// and a float weight w (W, on the backend) on the same at most maxRows
// evenly strided rows of x and xref, computed on the backend.
func (s *Session) OutputErr(x runtime.Buf, got runtime.Linear, xref, w runtime.Buf, maxRows int) float64 {
	idx := SubsampleRows(x.Rows(), maxRows)
	sub := s.be.Alloc(len(idx), x.Cols())
	defer s.be.Free(sub)
	lw := s.be.FloatLinear(w)
	s.be.GatherRows(sub, xref, idx)
	ref := s.MatMul(sub, lw)
	s.be.FreeLinear(lw)
	s.be.GatherRows(sub, x, idx)
	y := s.MatMul(sub, got)
	num, den := s.be.SquaredError(y, ref)
	s.be.Free(y)
	s.be.Free(ref)
	if den == 0 {
		return 0
	}
	return num / den
}

// Run calibrates every decoder layer in order with step, reporting the start
// of each layer to progress (when not nil). With a checkpoint attached
// (SetCheckpoint) it starts after the layers resumed from it and saves each
// layer it finishes.
func (s *Session) Run(step Step, progress Progress) error {
	if s.floatResumed != nil {
		return fmt.Errorf("calibration: the checkpoint holds the float model's stream of a run that tracked it (TrackFloat); this one does not")
	}
	for l := s.start; l < s.Cfg.Layers; l++ {
		if progress != nil {
			progress(l, nil)
		}
		if err := s.Layer(l, step); err != nil {
			return fmt.Errorf("layer %d: %w", l, err)
		}
		if s.ckpt != nil {
			done := s.Phase("checkpoint")
			resid, rows := s.Download(s.x), s.x.Rows()
			if s.ref != nil {
				// the float stream after the quantized one
				resid, rows = append(resid, s.Download(s.ref.x)...), 2*rows
			}
			err := s.ckpt.layerDone(l, s.Out, resid, rows, s.x.Cols())
			done()
			if err != nil {
				return fmt.Errorf("layer %d: %w", l, err)
			}
		}
	}
	return nil
}

// SetCheckpoint attaches c before Run: the layers c holds are installed in
// Out, the residual stream after them replaces the embedded windows, and Run
// continues with the next layer, saving every layer it finishes to c. A
// checkpoint of a run that tracked the float model also holds the float
// stream, which TrackFloat then takes up.
func (s *Session) SetCheckpoint(c *Checkpoint) error {
	if c.LayersDone() > s.Cfg.Layers {
		return c.corrupt("%d layers done, the model has %d", c.LayersDone(), s.Cfg.Layers)
	}
	resid, err := c.apply(s.Out, s.Rows(), s.Cfg.Hidden)
	if err != nil {
		return err
	}
	if resid != nil {
		n := s.Rows() * s.Cfg.Hidden
		s.be.Upload(s.x, resid[:n])
		if len(resid) > n {
			s.floatResumed = resid[n:]
		}
	}
	s.ckpt, s.start = c, c.LayersDone()
	return nil
}

// touch records a change of Out for the checkpoint.
func (s *Session) touch(name string) {
	if s.ckpt != nil {
		s.ckpt.touch(name)
	}
}
