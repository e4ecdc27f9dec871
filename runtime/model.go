package runtime

import (
	"fmt"
	"math"

	"qtool/formats/model"
)

// CapturePoint names the input of a group of linear layers inside a decoder
// layer, as calibration (GPTQ, AWQ, SmoothQuant) needs them.
type CapturePoint int

// Capture points, in the order Layer reaches them.
const (
	// CaptureQKV is the attn_norm output: the input of q, k and v.
	CaptureQKV CapturePoint = iota
	// CaptureO is the attention output: the input of o.
	CaptureO
	// CaptureGateUp is the mlp_norm output: the input of gate and up.
	CaptureGateUp
	// CaptureDown is silu(gate)·up: the input of down.
	CaptureDown
)

// String returns "qkv", "o", "gate_up" or "down".
func (p CapturePoint) String() string {
	switch p {
	case CaptureQKV:
		return "qkv"
	case CaptureO:
		return "o"
	case CaptureGateUp:
		return "gate_up"
	case CaptureDown:
		return "down"
	}
	return fmt.Sprintf("CapturePoint(%d)", int(p))
}

// Roles lists the linear roles that read the input captured at p.
func (p CapturePoint) Roles() []model.Role {
	switch p {
	case CaptureQKV:
		return []model.Role{model.Q, model.K, model.V}
	case CaptureO:
		return []model.Role{model.O}
	case CaptureGateUp:
		return []model.Role{model.Gate, model.Up}
	case CaptureDown:
		return []model.Role{model.Down}
	}
	return nil
}

// Capture receives the input x of the linear group p of layer, just before
// the layer uses it. x belongs to the backend and is only valid during the
// call; Download it to keep it. The callee must not modify x.
type Capture func(layer int, p CapturePoint, x Buf)

// layerWeights are the uploaded tensors of one decoder layer. Optional
// vectors are nil when absent.
type layerWeights struct {
	attnNorm, attnNormBias Vector
	q, k, v, o             Linear
	qBias, kBias, vBias    Vector
	// biasInLinear[i] is set when q/k/v (i = 0, 1, 2) is a W8A8 linear:
	// its quant_bias already carries the float bias (msmodelslim folds it
	// there), so the separate q/k/v bias must not be added again.
	biasInLinear         [3]bool
	qNorm, kNorm         Vector
	mlpNorm, mlpNormBias Vector
	gate, up, down       Linear
}

// Model is a model.Model loaded onto a Backend: its weights uploaded in
// their stored (possibly quantized) form. A Model is not safe for concurrent
// use.
type Model struct {
	cfg    model.Config
	be     Backend
	ops    Fused // be's fused operations, or their sequences (Unfused)
	embed  Linear
	norm   Vector
	head   Linear // the embedding table when tied
	layers []layerWeights
	src    *model.Model // where LoadLayer reads

	// scratch is a one-layer KV cache reused by Layer when it is called
	// without a cache.
	scratch KVCache
	// kvq holds the int8 KV-cache quantizers of every layer (nil: the
	// cache holds floats).
	kvq []KVQuant
}

// Load uploads the tensors of m onto be. It checks the shapes first and
// reports the first tensor the backend cannot hold.
func Load(m *model.Model, be Backend) (*Model, error) {
	rm, err := LoadLazy(m, be)
	if err != nil {
		return nil, err
	}
	for l := range rm.layers {
		if err := rm.LoadLayer(l); err != nil {
			return nil, err
		}
	}
	return rm, nil
}

// LoadLazy uploads the tensors of m outside the decoder layers (embedding,
// final norm, classifier); LoadLayer uploads a layer when it is needed and
// UnloadLayer frees it again, so that a pass over the model (calibration)
// holds one layer on the backend at a time. m must stay open while the
// Model is used.
func LoadLazy(m *model.Model, be Backend) (*Model, error) {
	if m == nil || be == nil {
		return nil, fmt.Errorf("runtime: Load needs a model and a backend")
	}
	cfg := m.Config
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("runtime: %w", err)
	}
	if err := m.CheckShapes(); err != nil {
		return nil, fmt.Errorf("runtime: %w", err)
	}
	ops, ok := be.(Fused)
	if !ok {
		ops = Unfused{be}
	}
	rm := &Model{cfg: cfg, be: be, ops: ops, src: m, layers: make([]layerWeights, cfg.Layers)}
	var err error
	if rm.kvq, err = kvQuantOf(m); err != nil {
		return nil, err
	}
	if _, ok := be.(Int8KVBackend); rm.kvq != nil && !ok {
		return nil, fmt.Errorf("runtime: %s carries an int8 KV cache (C8), which the %s backend cannot hold; run it with a float cache", m.Source, be.Name())
	}
	if rm.embed, err = rm.uploadLinear(model.Name(-1, model.Embed)); err != nil {
		return nil, err
	}
	if rm.norm, err = rm.uploadVector(model.Name(-1, model.FinalNorm), false); err != nil {
		return nil, err
	}
	if _, hasHead := m.Lookup(model.Name(-1, model.LMHead)); cfg.Tied && !hasHead {
		rm.head = rm.embed
	} else if rm.head, err = rm.uploadLinear(model.Name(-1, model.LMHead)); err != nil {
		return nil, err
	}
	return rm, nil
}

func (rm *Model) uploadLinear(name string) (Linear, error) {
	t, err := rm.src.Get(name)
	if err != nil {
		return nil, err
	}
	l, err := rm.be.UploadLinear(name, t)
	if err != nil {
		return nil, fmt.Errorf("runtime: upload %s: %w", name, err)
	}
	return l, nil
}

func (rm *Model) uploadVector(name string, optional bool) (Vector, error) {
	t, ok := rm.src.Lookup(name)
	if !ok {
		if optional {
			return nil, nil
		}
		_, err := rm.src.Get(name)
		return nil, err
	}
	v, err := rm.be.UploadVector(name, t)
	if err != nil {
		return nil, fmt.Errorf("runtime: upload %s: %w", name, err)
	}
	return v, nil
}

// LoadLayer uploads the tensors of decoder layer l from the source model
// (nothing when it is loaded already).
func (rm *Model) LoadLayer(l int) error {
	if l < 0 || l >= len(rm.layers) {
		return fmt.Errorf("runtime: LoadLayer %d of a %d-layer model", l, len(rm.layers))
	}
	w := &rm.layers[l]
	if w.q != nil {
		return nil
	}
	cfg := rm.cfg
	var lw layerWeights
	var err error
	for _, f := range []struct {
		r   model.Role
		dst *Linear
	}{{model.Q, &lw.q}, {model.K, &lw.k}, {model.V, &lw.v}, {model.O, &lw.o},
		{model.Gate, &lw.gate}, {model.Up, &lw.up}, {model.Down, &lw.down}} {
		if *f.dst, err = rm.uploadLinear(model.Name(l, f.r)); err != nil {
			return err
		}
	}
	for i, r := range []model.Role{model.Q, model.K, model.V} {
		t, _ := rm.src.Lookup(model.Name(l, r))
		a, ok := t.(*model.W8A8)
		lw.biasInLinear[i] = ok && !a.Dynamic // static W8A8: quant_bias holds it
	}
	for _, f := range []struct {
		r        model.Role
		dst      *Vector
		optional bool
	}{{model.AttnNorm, &lw.attnNorm, false}, {model.MLPNorm, &lw.mlpNorm, false},
		{model.AttnNormBias, &lw.attnNormBias, true}, {model.MLPNormBias, &lw.mlpNormBias, true},
		{model.QBias, &lw.qBias, !cfg.AttnBias}, {model.KBias, &lw.kBias, !cfg.AttnBias}, {model.VBias, &lw.vBias, !cfg.AttnBias},
		{model.QNorm, &lw.qNorm, !cfg.QKNorm}, {model.KNorm, &lw.kNorm, !cfg.QKNorm}} {
		if *f.dst, err = rm.uploadVector(model.Name(l, f.r), f.optional); err != nil {
			return err
		}
	}
	*w = lw
	return nil
}

// UnloadLayer releases the tensors of decoder layer l (on backends that
// free memory, see Releaser); later blocks of the layer need LoadLayer.
func (rm *Model) UnloadLayer(l int) {
	w := &rm.layers[l]
	if w.q == nil {
		return
	}
	if r, ok := rm.be.(Releaser); ok {
		for _, x := range []Linear{w.q, w.k, w.v, w.o, w.gate, w.up, w.down} {
			r.FreeLinear(x)
		}
		for _, v := range []Vector{w.attnNorm, w.attnNormBias, w.qBias, w.kBias, w.vBias, w.qNorm, w.kNorm, w.mlpNorm, w.mlpNormBias} {
			if v != nil {
				r.FreeVector(v)
			}
		}
	}
	*w = layerWeights{}
}

// Config returns the model's architecture.
func (m *Model) Config() model.Config { return m.cfg }

// Backend returns the backend the model runs on.
func (m *Model) Backend() Backend { return m.be }

// NewCache allocates a KV cache for all layers and up to maxSeq positions:
// an int8 one when the model carries KV-cache quantizers (KVInt8).
func (m *Model) NewCache(maxSeq int) KVCache {
	if m.kvq != nil {
		c, err := m.be.(Int8KVBackend).NewInt8KVCache(maxSeq, m.cfg.KVDim(), m.kvq)
		if err != nil {
			panic(fmt.Sprintf("runtime: int8 KV cache: %v", err)) // validated by Load
		}
		return c
	}
	return m.be.NewKVCache(m.cfg.Layers, maxSeq, m.cfg.KVDim())
}

// KVInt8 reports whether NewCache makes int8 caches.
func (m *Model) KVInt8() bool { return m.kvq != nil }

// Embed returns the embeddings of ids, [len(ids), hidden]. Ids outside the
// vocabulary are a programmer error (panic); check them first.
func (m *Model) Embed(ids []int) Buf {
	for i, id := range ids {
		if id < 0 || id >= m.cfg.Vocab {
			panic(fmt.Sprintf("runtime: token id %d at %d outside the vocabulary 0..%d", id, i, m.cfg.Vocab-1))
		}
	}
	x := AllocRaw(m.be, len(ids), m.cfg.Hidden)
	m.be.Embed(x, m.embed, ids)
	return x
}

// Overrides replaces linears of one decoder layer inside a block: a role
// present in the map uses that linear instead of the installed one
// (calibration scores candidate weights this way). A nil map uses the
// installed weights.
type Overrides map[model.Role]Linear

func (w *layerWeights) linear(r model.Role, ov Overrides) Linear {
	if l, ok := ov[r]; ok && l != nil {
		return l
	}
	switch r {
	case model.Q:
		return w.q
	case model.K:
		return w.k
	case model.V:
		return w.v
	case model.O:
		return w.o
	case model.Gate:
		return w.gate
	case model.Up:
		return w.up
	case model.Down:
		return w.down
	}
	panic(fmt.Sprintf("runtime: %s is not a linear role of a decoder layer", r))
}

// weights returns the uploaded tensors of layer l; it panics when the layer
// is not loaded (see LoadLayer).
func (m *Model) weights(l int) *layerWeights {
	w := &m.layers[l]
	if w.q == nil {
		panic(fmt.Sprintf("runtime: layer %d is not loaded", l))
	}
	return w
}

// AttnNorm returns attn_norm(x) of layer l, the input of q, k and v: a new
// buffer [T, hidden] the caller frees.
func (m *Model) AttnNorm(l int, x Buf) Buf {
	w := m.weights(l)
	h := AllocRaw(m.be, x.Rows(), m.cfg.Hidden)
	m.be.RMSNorm(h, x, w.attnNorm, w.attnNormBias, float32(m.cfg.NormEps))
	return h
}

// MLPNorm returns mlp_norm(x) of layer l, the input of gate and up: a new
// buffer [T, hidden] the caller frees.
func (m *Model) MLPNorm(l int, x Buf) Buf {
	w := m.weights(l)
	h := AllocRaw(m.be, x.Rows(), m.cfg.Hidden)
	m.be.RMSNorm(h, x, w.mlpNorm, w.mlpNormBias, float32(m.cfg.NormEps))
	return h
}

// Attention runs the attention block of layer l on its normed input h
// (rows at positions pos0..): the q/k/v products (with the Qwen2 biases
// unless a W8A8 projection carries them), the Qwen3 q/k norms, RoPE, the
// store into cache and cached causal attention. It returns the attention
// output, the input of o, as a new buffer [T, heads×head_dim]. cache may be
// nil when pos0 is 0: a scratch cache then holds this call's keys and
// values. ov may replace q, k or v.
func (m *Model) Attention(l int, h Buf, pos0 int, cache KVCache, ov Overrides) Buf {
	c := &m.cfg
	w := m.weights(l)
	T := h.Rows()
	q, k, v := AllocRaw(m.be, T, c.QDim()), AllocRaw(m.be, T, c.KVDim()), AllocRaw(m.be, T, c.KVDim())
	m.ops.MatMulN([]Buf{q, k, v}, h, []Linear{w.linear(model.Q, ov), w.linear(model.K, ov), w.linear(model.V, ov)})
	cache, cl := m.storeKV(l, q, k, v, pos0, cache, ov)
	return m.attend(q, cache, cl, pos0)
}

// attend returns the attention output of q (rows at positions pos0..) over
// layer cl of cache, a new buffer, and frees q.
func (m *Model) attend(q Buf, cache KVCache, cl, pos0 int) Buf {
	c := &m.cfg
	att := AllocRaw(m.be, q.Rows(), c.QDim())
	m.be.Attention(att, q, cache, cl, pos0, c.Heads, c.KVHeads, c.HeadDim)
	m.be.Free(q)
	return att
}

// storeKV finishes the q, k and v products of layer l (rows at positions
// pos0..) as Attention describes, stores k and v and frees both; it
// returns the cache and layer that q's attention reads (cache, or the
// scratch cache where cache is nil).
func (m *Model) storeKV(l int, q, k, v Buf, pos0 int, cache KVCache, ov Overrides) (KVCache, int) {
	c := &m.cfg
	cache, cl := m.finishQKV(l, q, k, v, pos0, cache, ov)
	m.ops.RoPEStoreKV(cache, cl, pos0, q, k, v, c.HeadDim, c.RopeTheta, c.Rope)
	m.be.Free(k)
	m.be.Free(v)
	return cache, cl
}

// finishQKV is storeKV up to RoPE: the products finished, the cache and
// layer to store k and v in and read q's attention from.
func (m *Model) finishQKV(l int, q, k, v Buf, pos0 int, cache KVCache, ov Overrides) (KVCache, int) {
	cache, cl := m.kvTarget(l, q.Rows(), pos0, cache)
	m.finishProduct(l, model.Q, q, ov)
	m.finishProduct(l, model.K, k, ov)
	m.finishProduct(l, model.V, v, ov)
	return cache, cl
}

// kvTarget is the cache and layer that T rows at positions pos0.. of layer
// l store their keys and values in and read q's attention from: cache,
// or the scratch cache where cache is nil.
func (m *Model) kvTarget(l, T, pos0 int, cache KVCache) (KVCache, int) {
	cl := l
	if cache == nil {
		if pos0 != 0 {
			panic("runtime: Attention without a cache needs pos0 = 0")
		}
		if m.scratch == nil || m.scratch.MaxSeq() < T {
			m.scratch = m.be.NewKVCache(1, max(T, 512), m.cfg.KVDim())
		}
		cache, cl = m.scratch, 0
	}
	if pos0+T > cache.MaxSeq() {
		panic(fmt.Sprintf("runtime: positions %d..%d exceed the KV cache of %d", pos0, pos0+T-1, cache.MaxSeq()))
	}
	return cache, cl
}

// plainQKV reports whether the layer's q, k and v products need no finishing
// (finishProduct does nothing: no biases outside the projections, no head
// norms).
func (w *layerWeights) plainQKV() bool {
	return (w.qBias == nil || w.biasInLinear[0]) && (w.kBias == nil || w.biasInLinear[1]) &&
		(w.vBias == nil || w.biasInLinear[2]) && w.qNorm == nil && w.kNorm == nil
}

// KV returns the keys and values layer l caches for its normed input h
// (rows at positions pos0..): h·Kᵀ and h·Vᵀ with their Qwen2 biases, the
// Qwen3 k norm and RoPE on the keys. The caller frees both. ov may replace
// k or v.
func (m *Model) KV(l int, h Buf, pos0 int, ov Overrides) (k, v Buf) {
	c := &m.cfg
	w := m.weights(l)
	k, v = AllocRaw(m.be, h.Rows(), c.KVDim()), AllocRaw(m.be, h.Rows(), c.KVDim())
	m.ops.MatMulN([]Buf{k, v}, h, []Linear{w.linear(model.K, ov), w.linear(model.V, ov)})
	m.finishProduct(l, model.K, k, ov)
	m.finishProduct(l, model.V, v, ov)
	m.be.RoPE(k, c.HeadDim, pos0, c.RopeTheta, c.Rope)
	return k, v
}

// finishProduct applies to x = h·Wᵀ of the q, k or v projection of layer l
// what follows the product before RoPE: its Qwen2 bias (unless a W8A8
// projection carries it) and, for q and k, the Qwen3 head norm.
func (m *Model) finishProduct(l int, r model.Role, x Buf, ov Overrides) {
	w := m.weights(l)
	var i int
	var bias, norm Vector
	switch r {
	case model.Q:
		i, bias, norm = 0, w.qBias, w.qNorm
	case model.K:
		i, bias, norm = 1, w.kBias, w.kNorm
	case model.V:
		i, bias = 2, w.vBias
	default:
		panic("runtime: finishProduct " + string(r))
	}
	if bias != nil {
		if _, replaced := ov[r]; !w.biasInLinear[i] || replaced {
			m.be.AddBias(x, bias) // else the W8A8 projection's quant_bias holds it
		}
	}
	if norm != nil {
		m.be.RMSNormHeads(x, m.cfg.HeadDim, norm, float32(m.cfg.NormEps))
	}
}

// MLPHidden returns silu(h·Gateᵀ)·(h·Upᵀ) of layer l, the input of down:
// a new buffer [T, intermediate]. ov may replace gate or up.
func (m *Model) MLPHidden(l int, h Buf, ov Overrides) Buf {
	w := m.weights(l)
	be := m.be
	g := AllocRaw(be, h.Rows(), m.cfg.Intermediate)
	u := AllocRaw(be, h.Rows(), m.cfg.Intermediate)
	m.ops.MatMulN([]Buf{g, u}, h, []Linear{w.linear(model.Gate, ov), w.linear(model.Up, ov)})
	be.SiLUMul(g, g, u)
	be.Free(u)
	return g
}

// Linear returns the installed linear (l, r) of a loaded decoder layer.
func (m *Model) Linear(l int, r model.Role) Linear { return m.weights(l).linear(r, nil) }

// Project sets dst = x·Wᵀ for the linear (l, r) (ov may replace it).
func (m *Model) Project(l int, r model.Role, dst, x Buf, ov Overrides) {
	m.be.MatMul(dst, x, m.weights(l).linear(r, ov))
}

// Layer runs decoder layer l on the residual stream x (rows are positions
// pos0, pos0+1, ...) in place, composing the blocks above. Keys and values
// go to cache; cache may be nil when pos0 is 0, and then a scratch cache
// holds them for this call only. capture, when not nil, sees the input of
// each linear group before use.
func (m *Model) Layer(l int, x Buf, pos0 int, cache KVCache, capture Capture) {
	c := &m.cfg
	w := m.weights(l)
	be := m.be
	T := x.Rows()
	eps := float32(c.NormEps)
	f := m.ops

	q, k, v := AllocRaw(be, T, c.QDim()), AllocRaw(be, T, c.KVDim()), AllocRaw(be, T, c.KVDim())
	qkv, wqkv := []Buf{q, k, v}, []Linear{w.q, w.k, w.v}
	if capture == nil {
		switch {
		case T == 1: // a decode row: RoPE and the KV store inside the attention where the backend can
			f.NormMatMulN(qkv, x, w.attnNorm, w.attnNormBias, eps, wqkv)
			kc, cl := m.finishQKV(l, q, k, v, pos0, cache, nil)
			att := AllocRaw(be, T, c.QDim())
			f.RoPEAttention(att, q, k, v, kc, cl, pos0, c.Heads, c.KVHeads, c.HeadDim, c.RopeTheta, c.Rope)
			be.Free(q)
			be.Free(k)
			be.Free(v)
			f.MatMulAdd(x, att, w.o)
			be.Free(att)
		default: // AttentionAdd may write o's input in the form its product takes
			var kc KVCache
			var cl int
			if w.plainQKV() { // RoPE and the KV store with the products where the backend can
				kc, cl = m.kvTarget(l, T, pos0, cache)
				f.NormMatMulStoreKV(qkv, x, w.attnNorm, w.attnNormBias, eps, wqkv,
					RoPEKV{Cache: kc, Layer: cl, Pos0: pos0, HeadDim: c.HeadDim, Theta: c.RopeTheta, Layout: c.Rope})
				be.Free(k)
				be.Free(v)
			} else {
				f.NormMatMulN(qkv, x, w.attnNorm, w.attnNormBias, eps, wqkv)
				kc, cl = m.storeKV(l, q, k, v, pos0, cache, nil)
			}
			f.AttentionAdd(x, q, kc, cl, pos0, c.Heads, c.KVHeads, c.HeadDim, w.o)
			be.Free(q)
		}
		f.MLP(x, w.mlpNorm, w.mlpNormBias, eps, w.gate, w.up, w.down)
		return
	}
	// a capture sees the normed inputs, so the norms run on their own
	h := m.AttnNorm(l, x)
	capture(l, CaptureQKV, h)
	f.MatMulN(qkv, h, wqkv)
	be.Free(h)
	kc, cl := m.storeKV(l, q, k, v, pos0, cache, nil)
	att := m.attend(q, kc, cl, pos0)
	capture(l, CaptureO, att)
	f.MatMulAdd(x, att, w.o)
	be.Free(att)

	h = m.MLPNorm(l, x)
	capture(l, CaptureGateUp, h)
	g := m.MLPHidden(l, h, nil)
	be.Free(h)
	capture(l, CaptureDown, g)
	f.MatMulAdd(x, g, w.down)
	be.Free(g)
}

// FinalNorm returns norm(x), the final RMSNorm: the classifier's input, a
// new buffer [rows, hidden] the caller frees.
func (m *Model) FinalNorm(x Buf) Buf {
	h := AllocRaw(m.be, x.Rows(), m.cfg.Hidden)
	m.be.RMSNorm(h, x, m.norm, nil, float32(m.cfg.NormEps))
	return h
}

// Logits applies the final norm and the classifier to x, returning
// [rows, vocab]. x is left unchanged.
func (m *Model) Logits(x Buf) Buf {
	h := m.FinalNorm(x)
	out := AllocRaw(m.be, x.Rows(), m.cfg.Vocab)
	m.be.MatMul(out, h, m.head)
	m.be.Free(h)
	return out
}

// Hidden runs the embedding and every decoder layer on ids at positions
// pos0.. and returns the residual stream before the final norm.
func (m *Model) Hidden(ids []int, pos0 int, cache KVCache) Buf {
	x := m.Embed(ids)
	m.Layers(x, pos0, cache)
	return x
}

// Layers runs every decoder layer on the residual stream x (rows at
// positions pos0..) in place: Hidden after the embedding, for a caller
// that embeds the rows itself (bench's prefill captured as a CUDA graph,
// which the embedding's upload of the ids would leave).
func (m *Model) Layers(x Buf, pos0 int, cache KVCache) {
	for l := 0; l < m.cfg.Layers; l++ {
		m.Layer(l, x, pos0, cache, nil)
	}
}

// Forward runs ids (at positions pos0..) through the whole model and returns
// the logits [len(ids), vocab]. cache may be nil when pos0 is 0.
func (m *Model) Forward(ids []int, pos0 int, cache KVCache) Buf {
	x := m.Hidden(ids, pos0, cache)
	out := m.Logits(x)
	m.be.Free(x)
	return out
}

// SetLinear replaces the linear weight (layer l, role r) with t, uploading
// it in its stored form (for instance after quantizing it). The source
// model.Model is not changed.
func (m *Model) SetLinear(l int, r model.Role, t model.Tensor) error {
	if t == nil {
		return fmt.Errorf("runtime: SetLinear %s: nil tensor", model.Name(l, r))
	}
	var dst *Linear
	var want []int
	c := &m.cfg
	if l < 0 {
		switch r {
		case model.Embed:
			dst, want = &m.embed, []int{c.Vocab, c.Hidden}
		case model.LMHead:
			dst, want = &m.head, []int{c.Vocab, c.Hidden}
		}
	} else if l < len(m.layers) {
		w := &m.layers[l]
		switch r {
		case model.Q:
			dst, want = &w.q, []int{c.QDim(), c.Hidden}
		case model.K:
			dst, want = &w.k, []int{c.KVDim(), c.Hidden}
		case model.V:
			dst, want = &w.v, []int{c.KVDim(), c.Hidden}
		case model.O:
			dst, want = &w.o, []int{c.Hidden, c.QDim()}
		case model.Gate:
			dst, want = &w.gate, []int{c.Intermediate, c.Hidden}
		case model.Up:
			dst, want = &w.up, []int{c.Intermediate, c.Hidden}
		case model.Down:
			dst, want = &w.down, []int{c.Hidden, c.Intermediate}
		}
	}
	name := model.Name(l, r)
	if dst == nil {
		return fmt.Errorf("runtime: SetLinear: %s is not a linear weight of this %d-layer model", name, c.Layers)
	}
	if s := t.Shape(); len(s) != 2 || s[0] != want[0] || s[1] != want[1] {
		return fmt.Errorf("runtime: SetLinear %s: shape %v, want %v", name, s, want)
	}
	lin, err := m.be.UploadLinear(name, t)
	if err != nil {
		return fmt.Errorf("runtime: SetLinear %s: %w", name, err)
	}
	tiedHead := m.head == m.embed
	if old := *dst; old != nil && l >= 0 {
		if r, ok := m.be.(Releaser); ok {
			r.FreeLinear(old)
		}
	}
	*dst = lin
	if l >= 0 {
		_, isW8A8 := t.(*model.W8A8)
		switch r {
		case model.Q:
			m.layers[l].biasInLinear[0] = isW8A8
		case model.K:
			m.layers[l].biasInLinear[1] = isW8A8
		case model.V:
			m.layers[l].biasInLinear[2] = isW8A8
		}
	}
	if r == model.Embed && tiedHead {
		m.head = lin
	}
	return nil
}

// SetVector replaces (or adds) a norm weight or bias by canonical name:
// "norm", "layers.N.attn_norm", "layers.N.attn_norm_bias", "layers.N.mlp_norm",
// "layers.N.mlp_norm_bias", "layers.N.{q,k,v}_bias", "layers.N.{q,k}_norm".
// Passing a nil tensor removes an optional bias.
func (m *Model) SetVector(name string, t model.Tensor) error {
	l, r, ok := model.ParseName(name)
	if !ok {
		return fmt.Errorf("runtime: SetVector: %q is not a canonical tensor name", name)
	}
	c := &m.cfg
	var dst *Vector
	var n int
	optional := false
	if l < 0 {
		if r == model.FinalNorm {
			dst, n = &m.norm, c.Hidden
		}
	} else if l < len(m.layers) {
		w := &m.layers[l]
		switch r {
		case model.AttnNorm:
			dst, n = &w.attnNorm, c.Hidden
		case model.MLPNorm:
			dst, n = &w.mlpNorm, c.Hidden
		case model.AttnNormBias:
			dst, n, optional = &w.attnNormBias, c.Hidden, true
		case model.MLPNormBias:
			dst, n, optional = &w.mlpNormBias, c.Hidden, true
		case model.QBias:
			dst, n, optional = &w.qBias, c.QDim(), true
		case model.KBias:
			dst, n, optional = &w.kBias, c.KVDim(), true
		case model.VBias:
			dst, n, optional = &w.vBias, c.KVDim(), true
		case model.QNorm:
			dst, n = &w.qNorm, c.HeadDim
		case model.KNorm:
			dst, n = &w.kNorm, c.HeadDim
		}
	}
	if dst == nil {
		return fmt.Errorf("runtime: SetVector: %q is not a norm or bias of this %d-layer model", name, c.Layers)
	}
	if t == nil {
		if !optional {
			return fmt.Errorf("runtime: SetVector %s: cannot remove a required vector", name)
		}
		if old := *dst; old != nil {
			if r, ok := m.be.(Releaser); ok {
				r.FreeVector(old)
			}
		}
		*dst = nil
		return nil
	}
	if s := t.Shape(); len(s) != 1 || s[0] != n {
		return fmt.Errorf("runtime: SetVector %s: shape %v, want [%d]", name, s, n)
	}
	v, err := m.be.UploadVector(name, t)
	if err != nil {
		return fmt.Errorf("runtime: SetVector %s: %w", name, err)
	}
	if old := *dst; old != nil {
		if r, ok := m.be.(Releaser); ok {
			r.FreeVector(old)
		}
	}
	*dst = v
	return nil
}

// rowsOf copies rows [r0, r1) of x into a new buffer.
func rowsOf(be Backend, x Buf, r0, r1 int) Buf {
	out := AllocRaw(be, r1-r0, x.Cols())
	CopyRows(be, out, 0, x, r0, r1-r0)
	return out
}

// CopyRows copies n rows of src from srcRow into dst from dstRow (same
// number of columns) with be's CopyRows where it is a RowCopier, else
// through host memory (Download, Upload).
func CopyRows(be Backend, dst Buf, dstRow int, src Buf, srcRow, n int) {
	if rc, ok := be.(RowCopier); ok {
		rc.CopyRows(dst, dstRow, src, srcRow, n)
		return
	}
	CheckCopyRows("runtime.CopyRows", dst, dstRow, src, srcRow, n)
	cols := src.Cols()
	s := make([]float32, src.Rows()*cols)
	be.Download(s, src)
	d := make([]float32, dst.Rows()*cols)
	if n < dst.Rows() { // keep dst's other rows
		be.Download(d, dst)
	}
	copy(d[dstRow*cols:], s[srcRow*cols:(srcRow+n)*cols])
	be.Upload(dst, d)
}

// CheckCopyRows panics, naming op, unless n rows of src from srcRow fit
// into dst from dstRow and both have the same columns: the check of every
// RowCopier's CopyRows.
func CheckCopyRows(op string, dst Buf, dstRow int, src Buf, srcRow, n int) {
	if dst.Cols() != src.Cols() || dstRow < 0 || srcRow < 0 || n < 0 || dstRow+n > dst.Rows() || srcRow+n > src.Rows() {
		panic(fmt.Sprintf("%s: %d rows from %d of [%d %d] to %d of [%d %d]", op, n, srcRow, src.Rows(), src.Cols(), dstRow, dst.Rows(), dst.Cols()))
	}
}

// checkIDs reports the first id outside 0..vocab-1.
func checkIDs(ids []int, vocab int) error {
	for i, id := range ids {
		if id < 0 || id >= vocab {
			return fmt.Errorf("token id %d at position %d is outside the model vocabulary 0..%d (tokenizer and model do not match?)", id, i, vocab-1)
		}
	}
	return nil
}

// finite reports whether v is neither NaN nor infinite.
func finite(v float64) bool { return !math.IsNaN(v) && !math.IsInf(v, 0) }
