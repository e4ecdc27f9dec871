package calib

import (
	"fmt"
	"math"
	"sync"

	"qtool/formats/model"
	"qtool/runtime"
	"qtool/runtime/cpu/gemm"
)

// Session drives calibration over a model, one decoder layer at a time.
//
// It keeps the residual stream of every calibration window on the host
// ([windows·seqlen, hidden] float32) and, for the current layer, float32
// copies of the weights the quantizer may change. Attention runs in the
// runtime (runtime.Model.Layer with a capture at CaptureO); the cheap,
// purely linear parts of the layer (norms, the o/gate/up/down products, the
// residual adds) run on the host with the same float32 arithmetic, so that
// each linear group is calibrated on the inputs produced by the already
// quantized groups before it (true-sequential: q/k/v → o → gate/up → down)
// without re-running the whole layer once per group.
//
// Every weight or norm the quantizer installs with SetLinear/SetVector goes
// both into the runtime (so later passes use it) and into Out, the result
// model.
type Session struct {
	Cfg model.Config
	RT  *runtime.Model
	// Out is the result: the source tensors, with every tensor installed
	// through SetLinear/SetVector replaced.
	Out *model.Model

	src     *model.Model
	windows [][]int
	seqLen  int
	threads int

	x []float32 // residual stream [rows, hidden]; rows = len(windows)·seqLen

	layer int                  // layer whose weights are cached
	cur   map[string][]float32 // current float weights of that layer
}

// NewSession loads m onto be and embeds the calibration windows (all of the
// same length). threads is the number of goroutines of the host products.
func NewSession(m *model.Model, be runtime.Backend, windows [][]int, threads int) (*Session, error) {
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
	rt, err := runtime.Load(m, be)
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
	s := &Session{Cfg: m.Config, RT: rt, Out: out, src: m, windows: windows, seqLen: T, threads: threads, layer: -1}
	H := m.Config.Hidden
	s.x = make([]float32, len(windows)*T*H)
	for i, w := range windows {
		b := rt.Embed(w)
		be.Download(s.x[i*T*H:(i+1)*T*H], b)
		be.Free(b)
	}
	return s, nil
}

// Rows is the number of calibration tokens (windows × seqlen).
func (s *Session) Rows() int { return len(s.windows) * s.seqLen }

// SeqLen is the window length.
func (s *Session) SeqLen() int { return s.seqLen }

// Windows is the number of calibration windows.
func (s *Session) Windows() int { return len(s.windows) }

// Threads is the number of goroutines host products use.
func (s *Session) Threads() int { return s.threads }

// Residual returns the residual stream entering the current layer
// ([Rows, hidden]); callers must not modify it.
func (s *Session) Residual() []float32 { return s.x }

func (s *Session) load(l int) {
	if s.layer != l {
		s.layer = l
		s.cur = map[string][]float32{}
	}
}

// Weight returns the current float32 value of tensor (l, r) — a linear
// weight [out, in] or a vector — as installed so far (the source value when
// nothing was installed). The slice is shared: copy before modifying.
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

// SetLinear installs t as linear (l, r) in the runtime and the result model;
// later host products use its float32 (dequantized) value.
func (s *Session) SetLinear(l int, r model.Role, t model.Tensor) error {
	s.load(l)
	if err := s.RT.SetLinear(l, r, t); err != nil {
		return err
	}
	w, err := t.Float32()
	if err != nil {
		return fmt.Errorf("calibration: %s: %w", model.Name(l, r), err)
	}
	s.cur[model.Name(l, r)] = w
	s.Out.Set(model.Name(l, r), t)
	return nil
}

// SetVector installs a norm weight or bias (l, r) with values v (nil removes
// an optional bias).
func (s *Session) SetVector(l int, r model.Role, v []float32) error {
	s.load(l)
	name := model.Name(l, r)
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

// Step is called by Layer with the input x ([rows, in], row-major, owned by
// the session, valid during the call) of each linear group of layer l, in
// order QKV, O, GateUp, Down. The callee may modify x at QKV and GateUp (the
// session recomputes those inputs from the installed norms), not at O and
// Down. It must install
// the weights the following groups should see (SetLinear, SetVector) before
// returning.
type Step func(l int, p runtime.CapturePoint, x []float32, rows int) error

// Layer calibrates decoder layer l true-sequentially and advances the
// residual stream through the layer with the installed weights.
func (s *Session) Layer(l int, step Step) error {
	c := &s.Cfg
	n := s.Rows()
	H := c.Hidden

	// 1. q/k/v: input is attn_norm(x), independent of this layer's weights.
	h, err := s.normed(l, model.AttnNorm, model.AttnNormBias, s.x)
	if err != nil {
		return err
	}
	if err := step(l, runtime.CaptureQKV, h, n); err != nil {
		return err
	}
	h = nil

	// 2. o: input is the attention output with the installed q/k/v.
	att, err := s.AttentionOutputs(l, nil, nil)
	if err != nil {
		return err
	}
	if err := step(l, runtime.CaptureO, att, n); err != nil {
		return err
	}
	mid := make([]float32, n*H)
	copy(mid, s.x)
	if err := s.linearAcc(l, model.O, mid, att, n, H, c.QDim()); err != nil {
		return err
	}
	att = nil

	// 3. gate/up: input is mlp_norm(x + o(att)).
	h2, err := s.normed(l, model.MLPNorm, model.MLPNormBias, mid)
	if err != nil {
		return err
	}
	if err := step(l, runtime.CaptureGateUp, h2, n); err != nil {
		return err
	}
	// The step may have rescaled mlp_norm (AWQ, SmoothQuant): recompute.
	h2, err = s.normed(l, model.MLPNorm, model.MLPNormBias, mid)
	if err != nil {
		return err
	}
	d, err := s.MLPHidden(l, h2, n)
	if err != nil {
		return err
	}
	h2 = nil

	// 4. down: input is silu(gate)·up with the installed gate/up.
	if err := step(l, runtime.CaptureDown, d, n); err != nil {
		return err
	}
	if err := s.linearAcc(l, model.Down, mid, d, n, H, c.Intermediate); err != nil {
		return err
	}
	for i, v := range mid {
		if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
			return fmt.Errorf("calibration: layer %d output (token %d, channel %d) is %g: the quantized layer overflows", l, i/H, i%H, v)
		}
	}
	s.x = mid
	return nil
}

// normed returns norm(x)·w (+b) with the current norm weights of layer l.
func (s *Session) normed(l int, wr, br model.Role, x []float32) ([]float32, error) {
	w, err := s.Weight(l, wr)
	if err != nil {
		return nil, err
	}
	b, err := s.Weight(l, br)
	if err != nil {
		return nil, err
	}
	H := s.Cfg.Hidden
	out := make([]float32, len(x))
	eps := float32(s.Cfg.NormEps)
	s.parallel(len(x)/H, func(lo, hi int) {
		for r := lo; r < hi; r++ {
			RMSNormRow(out[r*H:(r+1)*H], x[r*H:(r+1)*H], w, b, eps)
		}
	})
	return out, nil
}

// NormInput returns norm role wr (with optional bias br) of layer l applied
// to every row of x ([rows, hidden]).
func (s *Session) NormInput(l int, wr, br model.Role, x []float32) ([]float32, error) {
	return s.normed(l, wr, br, x)
}

// RMSNormRow is the runtime's RMSNorm of one row: dst = w·(x/rms(x)) (+b),
// with the sum of squares in float64 as the CPU backend does it.
func RMSNormRow(dst, x, w, b []float32, eps float32) {
	ss := 0.0
	for _, v := range x {
		ss += float64(v) * float64(v)
	}
	inv := float32(1 / math.Sqrt(float64(float32(ss/float64(len(x))))+float64(eps)))
	if b != nil {
		for i, v := range x {
			dst[i] = w[i]*(v*inv) + b[i]
		}
		return
	}
	for i, v := range x {
		dst[i] = w[i] * (v * inv)
	}
}

// AttentionOutputs runs the attention half of layer l on the backend for
// the given windows (all when nil) from the current residual stream, and
// returns the attention outputs (the input of o), [len(windows)·seqlen,
// QDim]. It issues the same backend operations as runtime.Model.Layer up to
// its CaptureO point (norm, q/k/v products and biases, q/k norms, RoPE,
// cached causal attention) with the currently installed tensors, or with
// override[role] for q, k or v when given. The residual stream is not
// changed.
func (s *Session) AttentionOutputs(l int, windows []int, override map[model.Role]model.Tensor) ([]float32, error) {
	if windows == nil {
		windows = make([]int, len(s.windows))
		for i := range windows {
			windows[i] = i
		}
	}
	be := s.RT.Backend()
	c := &s.Cfg
	T, H, Q, KV := s.seqLen, c.Hidden, c.QDim(), c.KVDim()
	lin := map[model.Role]runtime.Linear{}
	for _, r := range []model.Role{model.Q, model.K, model.V} {
		t, ok := override[r]
		if !ok {
			t, ok = s.Out.Lookup(model.Name(l, r))
			if !ok {
				return nil, fmt.Errorf("calibration: %s is missing", model.Name(l, r))
			}
		}
		u, err := be.UploadLinear(model.Name(l, r), t)
		if err != nil {
			return nil, fmt.Errorf("calibration: %s: %w", model.Name(l, r), err)
		}
		lin[r] = u
	}
	vec := map[model.Role]runtime.Vector{}
	for _, r := range []model.Role{model.AttnNorm, model.AttnNormBias, model.QBias, model.KBias, model.VBias, model.QNorm, model.KNorm} {
		t, ok := s.Out.Lookup(model.Name(l, r))
		if !ok {
			continue
		}
		u, err := be.UploadVector(model.Name(l, r), t)
		if err != nil {
			return nil, fmt.Errorf("calibration: %s: %w", model.Name(l, r), err)
		}
		vec[r] = u
	}
	if vec[model.AttnNorm] == nil {
		return nil, fmt.Errorf("calibration: %s is missing", model.Name(l, model.AttnNorm))
	}
	eps := float32(c.NormEps)
	out := make([]float32, len(windows)*T*Q)
	x := be.Alloc(T, H)
	h := be.Alloc(T, H)
	q := be.Alloc(T, Q)
	k := be.Alloc(T, KV)
	v := be.Alloc(T, KV)
	att := be.Alloc(T, Q)
	cache := be.NewKVCache(1, T, KV)
	defer func() {
		for _, b := range []runtime.Buf{x, h, q, k, v, att} {
			be.Free(b)
		}
	}()
	for i, w := range windows {
		be.Upload(x, s.x[w*T*H:(w+1)*T*H])
		be.RMSNorm(h, x, vec[model.AttnNorm], vec[model.AttnNormBias], eps)
		be.MatMul(q, h, lin[model.Q])
		be.MatMul(k, h, lin[model.K])
		be.MatMul(v, h, lin[model.V])
		if b := vec[model.QBias]; b != nil {
			be.AddBias(q, b)
		}
		if b := vec[model.KBias]; b != nil {
			be.AddBias(k, b)
		}
		if b := vec[model.VBias]; b != nil {
			be.AddBias(v, b)
		}
		if n := vec[model.QNorm]; n != nil {
			be.RMSNormHeads(q, c.HeadDim, n, eps)
		}
		if n := vec[model.KNorm]; n != nil {
			be.RMSNormHeads(k, c.HeadDim, n, eps)
		}
		be.RoPE(q, c.HeadDim, 0, c.RopeTheta, c.Rope)
		be.RoPE(k, c.HeadDim, 0, c.RopeTheta, c.Rope)
		be.StoreKV(cache, 0, 0, k, v)
		be.Attention(att, q, cache, 0, 0, c.Heads, c.KVHeads, c.HeadDim)
		be.Download(out[i*T*Q:(i+1)*T*Q], att)
	}
	return out, nil
}

// ResidualRows returns the residual-stream rows of the given windows.
func (s *Session) ResidualRows(windows []int) []float32 {
	T, H := s.seqLen, s.Cfg.Hidden
	out := make([]float32, 0, len(windows)*T*H)
	for _, w := range windows {
		out = append(out, s.x[w*T*H:(w+1)*T*H]...)
	}
	return out
}

// MLPHidden returns silu(x·Gateᵀ)·(x·Upᵀ) with the installed gate/up
// weights of layer l, [rows, Intermediate].
func (s *Session) MLPHidden(l int, x []float32, rows int) ([]float32, error) {
	I, H := s.Cfg.Intermediate, s.Cfg.Hidden
	out := make([]float32, rows*I)
	const chunk = 4096 // rows per step: bounds the up temporary
	up := make([]float32, min(rows, chunk)*I)
	for r0 := 0; r0 < rows; r0 += chunk {
		r1 := min(r0+chunk, rows)
		g, u := out[r0*I:r1*I], up[:(r1-r0)*I]
		clear(u)
		if err := s.linearAcc(l, model.Gate, g, x[r0*H:r1*H], r1-r0, I, H); err != nil {
			return nil, err
		}
		if err := s.linearAcc(l, model.Up, u, x[r0*H:r1*H], r1-r0, I, H); err != nil {
			return nil, err
		}
		s.parallel(len(g), func(lo, hi int) { siluMul(g[lo:hi], u[lo:hi]) })
	}
	return out, nil
}

// linearAcc adds the output of the installed linear (l, r) on x to dst.
// A *model.W8A8 quantizes x first, exactly as the runtime does.
func (s *Session) linearAcc(l int, r model.Role, dst, x []float32, rows, out, in int) error {
	t, _ := s.Out.Lookup(model.Name(l, r))
	if w8, ok := t.(*model.W8A8); ok {
		xq := make([]float32, len(x))
		for i, v := range x {
			q := math.RoundToEven(float64(v/w8.InputScale + w8.InputOffset))
			xq[i] = float32(min(max(q, -128), 127))
		}
		wq := make([]float32, len(w8.Weight.Q))
		for i, v := range w8.Weight.Q {
			wq[i] = float32(v)
		}
		y := make([]float32, rows*out)
		gemm.MatMulNT(rows, out, in, xq, in, wq, in, y, out, false, s.threads)
		for i := 0; i < rows; i++ {
			for j := 0; j < out; j++ {
				v := (y[i*out+j] + float32(w8.QuantBias[j])) * w8.DeqScale[j]
				if w8.Bias != nil {
					v += w8.Bias[j]
				}
				dst[i*out+j] += v
			}
		}
		return nil
	}
	w, err := s.Weight(l, r)
	if err != nil {
		return err
	}
	if w == nil {
		return fmt.Errorf("calibration: %s is missing", model.Name(l, r))
	}
	gemm.MatMulNT(rows, out, in, x, in, w, in, dst, out, true, s.threads)
	return nil
}

// MLPHidden is silu(x·gᵀ)·(x·uᵀ) for x [rows, in] and g, u [inter, in].
func MLPHidden(x []float32, rows, in, inter int, g, u []float32, threads int) []float32 {
	gate := make([]float32, rows*inter)
	up := make([]float32, rows*inter)
	gemm.MatMulNT(rows, inter, in, x, in, g, in, gate, inter, false, threads)
	gemm.MatMulNT(rows, inter, in, x, in, u, in, up, inter, false, threads)
	t := max(1, min(threads, len(gate)/(1<<14)))
	var wg sync.WaitGroup
	for i := 0; i < t; i++ {
		lo, hi := i*len(gate)/t, (i+1)*len(gate)/t
		wg.Add(1)
		go func() { defer wg.Done(); siluMul(gate[lo:hi], up[lo:hi]) }()
	}
	wg.Wait()
	return gate
}

// siluMul sets g = silu(g)·u.
func siluMul(g, u []float32) {
	for i, v := range g {
		g[i] = v / (1 + expf(-v)) * u[i]
	}
}

// expf is exp for float32 arguments: 2^(x·log2 e) split into an integer
// power (built from the exponent bits) and a degree-7 polynomial on
// [−ln2/2, ln2/2]; relative error below 1e-7.
func expf(x float32) float32 {
	if !(x > -87 && x < 88) {
		return float32(math.Exp(float64(x)))
	}
	t := float64(x) * math.Log2E
	n := math.Floor(t + 0.5)
	f := (t - n) * math.Ln2
	p := 1 + f*(1+f*(1.0/2+f*(1.0/6+f*(1.0/24+f*(1.0/120+f*(1.0/720+f/5040))))))
	return float32(p * math.Float64frombits(uint64(int64(n)+1023)<<52))
}

// MatMulAcc adds x·wᵀ to dst ([rows, out]) for x [rows, in] and w [out, in].
func (s *Session) MatMulAcc(dst, x, w []float32, rows, out, in int) {
	gemm.MatMulNT(rows, out, in, x, in, w, in, dst, out, true, s.threads)
}

// MatMul returns x·wᵀ ([rows, out]) for x [rows, in] and w [out, in].
func (s *Session) MatMul(x, w []float32, rows, out, in int) []float32 {
	return matMul(x, w, rows, out, in, s.threads)
}

func matMul(x, w []float32, rows, out, in, threads int) []float32 {
	dst := make([]float32, rows*out)
	gemm.MatMulNT(rows, out, in, x, in, w, in, dst, out, false, threads)
	return dst
}

// Run calibrates every decoder layer in order with step, reporting the start
// of each layer to progress (when not nil).
func (s *Session) Run(step Step, progress Progress) error {
	for l := 0; l < s.Cfg.Layers; l++ {
		if progress != nil {
			progress(l, "", false)
		}
		if err := s.Layer(l, step); err != nil {
			return fmt.Errorf("layer %d: %w", l, err)
		}
	}
	return nil
}

func (s *Session) parallel(n int, fn func(lo, hi int)) {
	t := min(s.threads, n)
	if t <= 1 {
		fn(0, n)
		return
	}
	var wg sync.WaitGroup
	for i := 0; i < t; i++ {
		lo, hi := i*n/t, (i+1)*n/t
		wg.Add(1)
		go func() { defer wg.Done(); fn(lo, hi) }()
	}
	wg.Wait()
}
