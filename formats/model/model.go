// Package model is qtool's one in-memory model description: a Config (the
// blueprint) and named, typed tensors. Every reader in formats/... produces a
// *Model and every writer consumes one; the runtime and the quantizers work on
// it too.
//
// Tensors are stored under canonical names (see Name and the Role constants),
// independent of any file format. Float tensors usually alias a read-only
// memory-mapped file, so opening a model reads nothing but headers; quantized
// tensors are typed values (*Quantized, *W8A8) that carry their scheme.
package model

import (
	"errors"
	"fmt"
	"io"
	"sort"
	"strconv"
	"strings"
)

// Arch names a supported model family.
type Arch string

// Supported architectures.
const (
	Llama Arch = "llama" // LlamaForCausalLM
	Qwen2 Arch = "qwen2" // Qwen2ForCausalLM: q/k/v biases
	Qwen3 Arch = "qwen3" // Qwen3ForCausalLM: q_norm/k_norm, head_dim may differ from hidden/heads
)

// RopeLayout says how the q/k weight rows pair up for rotary embeddings.
type RopeLayout int

const (
	// RopeHalf is the Hugging Face layout: dimension j pairs with j+head_dim/2
	// ("rotate half"). This is what HF checkpoints, Kuiper's LLAMA3/Qwen builds,
	// vLLM and llama.cpp's HF conversion use.
	RopeHalf RopeLayout = iota
	// RopeInterleaved is the Meta/llama2.c layout: dimension 2j pairs with 2j+1.
	// Kuiper's default Llama-2 build expects q/k permuted into this layout.
	RopeInterleaved
)

// String returns "half" or "interleaved".
func (r RopeLayout) String() string {
	if r == RopeInterleaved {
		return "interleaved"
	}
	return "half"
}

// Config is the architecture of a decoder-only transformer.
type Config struct {
	Arch         Arch
	Hidden       int // hidden_size (model width)
	Intermediate int // FFN width
	Layers       int
	Heads        int // query heads
	KVHeads      int // key/value heads (GQA when < Heads)
	HeadDim      int // may differ from Hidden/Heads (Qwen3)
	Vocab        int
	MaxSeq       int // max_position_embeddings
	RopeTheta    float64
	NormEps      float64
	Tied         bool // lm_head shares the embedding table
	AttnBias     bool // q/k/v projections have biases (Qwen2)
	QKNorm       bool // per-head RMSNorm on q and k (Qwen3)
	Rope         RopeLayout
	BOS          int    // -1 when the model has none
	EOS          []int  // ids that end generation
	DType        string // dtype of the source checkpoint ("float16", "bfloat16", ...)
}

// QDim is the width of the concatenated query heads (Heads*HeadDim).
func (c *Config) QDim() int { return c.Heads * c.HeadDim }

// KVDim is the width of the concatenated key (or value) heads.
func (c *Config) KVDim() int { return c.KVHeads * c.HeadDim }

// Validate checks that the dimensions are positive and consistent.
func (c *Config) Validate() error {
	type dim struct {
		name string
		v    int
	}
	for _, d := range []dim{{"hidden_size", c.Hidden}, {"intermediate_size", c.Intermediate},
		{"num_hidden_layers", c.Layers}, {"num_attention_heads", c.Heads},
		{"num_key_value_heads", c.KVHeads}, {"head_dim", c.HeadDim}, {"vocab_size", c.Vocab}} {
		if d.v <= 0 {
			return fmt.Errorf("config: %s = %d, want > 0", d.name, d.v)
		}
		if d.v > 1<<24 {
			return fmt.Errorf("config: %s = %d is implausibly large", d.name, d.v)
		}
	}
	if c.Heads%c.KVHeads != 0 {
		return fmt.Errorf("config: num_attention_heads %d is not a multiple of num_key_value_heads %d", c.Heads, c.KVHeads)
	}
	if c.HeadDim%2 != 0 {
		return fmt.Errorf("config: head_dim %d is odd; rotary embeddings need an even head_dim", c.HeadDim)
	}
	if c.NormEps <= 0 {
		return fmt.Errorf("config: rms_norm_eps = %g, want > 0", c.NormEps)
	}
	if c.RopeTheta <= 0 {
		return fmt.Errorf("config: rope_theta = %g, want > 0", c.RopeTheta)
	}
	return nil
}

// Role is the job of a tensor inside the network.
type Role string

// Global roles (no layer index).
const (
	Embed     Role = "embed"   // [Vocab, Hidden]
	FinalNorm Role = "norm"    // [Hidden]
	LMHead    Role = "lm_head" // [Vocab, Hidden]; absent when Tied
)

// Per-layer roles. Linear weights are [out, in] like nn.Linear.weight.
const (
	AttnNorm     Role = "attn_norm"      // [Hidden] input_layernorm
	AttnNormBias Role = "attn_norm_bias" // [Hidden] only in SmoothQuant-folded msmodelslim models
	Q            Role = "q"              // [QDim, Hidden]
	K            Role = "k"              // [KVDim, Hidden]
	V            Role = "v"              // [KVDim, Hidden]
	O            Role = "o"              // [Hidden, QDim]
	QBias        Role = "q_bias"         // [QDim]  (Qwen2)
	KBias        Role = "k_bias"         // [KVDim] (Qwen2)
	VBias        Role = "v_bias"         // [KVDim] (Qwen2)
	QNorm        Role = "q_norm"         // [HeadDim] (Qwen3)
	KNorm        Role = "k_norm"         // [HeadDim] (Qwen3)
	MLPNorm      Role = "mlp_norm"       // [Hidden] post_attention_layernorm
	MLPNormBias  Role = "mlp_norm_bias"  // [Hidden] only in SmoothQuant-folded msmodelslim models
	Gate         Role = "gate"           // [Intermediate, Hidden]
	Up           Role = "up"             // [Intermediate, Hidden]
	Down         Role = "down"           // [Hidden, Intermediate]

	// The int8 KV cache (msmodelslim C8), per channel of the keys and the
	// values as they are cached (after RoPE): cache_int = round(x/scale +
	// offset), x̂ = (cache_int − offset)·scale. A model has all four for
	// every layer or none (HasKVCacheInt8).
	KCacheScale  Role = "k_cache_scale"  // [KVDim]
	KCacheOffset Role = "k_cache_offset" // [KVDim]
	VCacheScale  Role = "v_cache_scale"  // [KVDim]
	VCacheOffset Role = "v_cache_offset" // [KVDim]
)

// KVCacheRoles are the four per-layer tensors of an int8 KV cache.
var KVCacheRoles = [...]Role{KCacheScale, KCacheOffset, VCacheScale, VCacheOffset}

// Linears lists the seven decoder linear roles in the order Kuiper files store
// them (wq, wk, wv, wo, w1=gate, w2=down, w3=up).
var Linears = [...]Role{Q, K, V, O, Gate, Down, Up}

// IsLinear reports whether r is one of the seven decoder linear roles.
func IsLinear(r Role) bool {
	for _, l := range Linears {
		if l == r {
			return true
		}
	}
	return false
}

// Name is the canonical tensor name of a global role ("embed") or, for
// layer >= 0, of a per-layer role ("layers.3.q").
func Name(layer int, r Role) string {
	if layer < 0 {
		return string(r)
	}
	return "layers." + strconv.Itoa(layer) + "." + string(r)
}

// ParseName splits a canonical name into its layer (-1 for global tensors) and role.
func ParseName(name string) (layer int, r Role, ok bool) {
	rest, found := strings.CutPrefix(name, "layers.")
	if !found {
		return -1, Role(name), name != ""
	}
	i := strings.IndexByte(rest, '.')
	if i <= 0 {
		return 0, "", false
	}
	l, err := strconv.Atoi(rest[:i])
	if err != nil || l < 0 {
		return 0, "", false
	}
	return l, Role(rest[i+1:]), i+1 < len(rest)
}

// Model is a config plus named tensors. The zero value is not usable; make
// one with New.
type Model struct {
	Config Config
	// Source is the path the model was read from ("" when built in memory).
	Source string
	// Format names the codec that read it ("hf", "kuiper-int8", ...).
	Format string
	// TokenizerDir is the directory holding the tokenizer files, if known.
	TokenizerDir string

	tensors map[string]Tensor
	order   []string
	closers []io.Closer
}

// New returns an empty model with the given config.
func New(cfg Config) *Model {
	return &Model{Config: cfg, tensors: map[string]Tensor{}}
}

// Set stores t under name, replacing any previous tensor of that name.
func (m *Model) Set(name string, t Tensor) {
	if _, ok := m.tensors[name]; !ok {
		m.order = append(m.order, name)
	}
	m.tensors[name] = t
}

// Delete removes name from the model.
func (m *Model) Delete(name string) {
	if _, ok := m.tensors[name]; !ok {
		return
	}
	delete(m.tensors, name)
	for i, n := range m.order {
		if n == name {
			m.order = append(m.order[:i], m.order[i+1:]...)
			break
		}
	}
}

// Lookup returns the tensor stored under name.
func (m *Model) Lookup(name string) (Tensor, bool) {
	t, ok := m.tensors[name]
	return t, ok
}

// Get returns the tensor stored under name, or an error naming the model
// source and the missing tensor.
func (m *Model) Get(name string) (Tensor, error) {
	t, ok := m.tensors[name]
	if !ok {
		src := m.Source
		if src == "" {
			src = "model"
		}
		return nil, fmt.Errorf("%s: tensor %q is missing", src, name)
	}
	return t, nil
}

// Layer returns tensor (layer, role), or an error when it is missing.
func (m *Model) Layer(layer int, r Role) (Tensor, error) { return m.Get(Name(layer, r)) }

// Names returns the tensor names in insertion order.
func (m *Model) Names() []string { return append([]string(nil), m.order...) }

// SortedNames returns the tensor names sorted by layer, then role.
func (m *Model) SortedNames() []string {
	names := m.Names()
	sort.SliceStable(names, func(i, j int) bool {
		li, ri, _ := ParseName(names[i])
		lj, rj, _ := ParseName(names[j])
		if li != lj {
			return li < lj
		}
		return ri < rj
	})
	return names
}

// AddCloser registers c to be closed by Close (for example a memory mapping
// the tensors alias).
func (m *Model) AddCloser(c io.Closer) { m.closers = append(m.closers, c) }

// Close releases the resources the tensors alias. Tensors must not be used
// afterwards.
func (m *Model) Close() error {
	var errs []error
	for i := len(m.closers) - 1; i >= 0; i-- {
		errs = append(errs, m.closers[i].Close())
	}
	m.closers = nil
	return errors.Join(errs...)
}

// CheckShapes verifies that every tensor the config implies is present with
// the expected shape. Optional tensors (biases, q/k norms, lm_head) are
// required exactly when the config says so.
func (m *Model) CheckShapes() error {
	c := &m.Config
	want := map[string][]int{
		Name(-1, Embed):     {c.Vocab, c.Hidden},
		Name(-1, FinalNorm): {c.Hidden},
	}
	if !c.Tied {
		want[Name(-1, LMHead)] = []int{c.Vocab, c.Hidden}
	}
	for l := 0; l < c.Layers; l++ {
		want[Name(l, AttnNorm)] = []int{c.Hidden}
		want[Name(l, MLPNorm)] = []int{c.Hidden}
		want[Name(l, Q)] = []int{c.QDim(), c.Hidden}
		want[Name(l, K)] = []int{c.KVDim(), c.Hidden}
		want[Name(l, V)] = []int{c.KVDim(), c.Hidden}
		want[Name(l, O)] = []int{c.Hidden, c.QDim()}
		want[Name(l, Gate)] = []int{c.Intermediate, c.Hidden}
		want[Name(l, Up)] = []int{c.Intermediate, c.Hidden}
		want[Name(l, Down)] = []int{c.Hidden, c.Intermediate}
		if c.AttnBias {
			want[Name(l, QBias)] = []int{c.QDim()}
			want[Name(l, KBias)] = []int{c.KVDim()}
			want[Name(l, VBias)] = []int{c.KVDim()}
		}
		if c.QKNorm {
			want[Name(l, QNorm)] = []int{c.HeadDim}
			want[Name(l, KNorm)] = []int{c.HeadDim}
		}
	}
	src := m.Source
	if src == "" {
		src = "model"
	}
	if err := m.checkKVCache(src, want); err != nil {
		return err
	}
	names := make([]string, 0, len(want))
	for n := range want {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		t, ok := m.tensors[n]
		if !ok {
			return fmt.Errorf("%s: tensor %q is missing (config %s with %d layers needs it)", src, n, c.Arch, c.Layers)
		}
		if !equalShape(t.Shape(), want[n]) {
			return fmt.Errorf("%s: tensor %q has shape %v, config implies %v", src, n, t.Shape(), want[n])
		}
	}
	var extra []string
	for n := range m.tensors {
		if l, _, _ := ParseName(n); l >= c.Layers {
			extra = append(extra, n)
		}
	}
	if len(extra) > 0 {
		sort.Strings(extra)
		list := strings.Join(extra[:min(len(extra), 3)], ", ")
		if len(extra) > 3 {
			list += ", …"
		}
		return fmt.Errorf("%s: %d tensors belong to layers beyond the config's %d (num_hidden_layers) (%s): the config and the weights disagree", src, len(extra), c.Layers, list)
	}
	return nil
}

// HasKVCacheInt8 reports whether m carries int8 KV-cache quantizers (the
// KVCacheRoles; CheckShapes verifies that every layer has all four).
func (m *Model) HasKVCacheInt8() bool {
	_, ok := m.tensors[Name(0, KCacheScale)]
	return ok
}

// DropKVCacheInt8 deletes the int8 KV-cache quantizers of every layer, so
// the model runs with a float cache.
func (m *Model) DropKVCacheInt8() {
	for l := 0; l < m.Config.Layers; l++ {
		for _, r := range KVCacheRoles {
			m.Delete(Name(l, r))
		}
	}
}

// checkKVCache adds the KV-cache quantizers to want when any layer has one
// (then every layer needs all four) and checks that they are float.
func (m *Model) checkKVCache(src string, want map[string][]int) error {
	c := &m.Config
	any := ""
	for l := 0; l < c.Layers && any == ""; l++ {
		for _, r := range KVCacheRoles {
			if _, ok := m.tensors[Name(l, r)]; ok {
				any = Name(l, r)
				break
			}
		}
	}
	if any == "" {
		return nil
	}
	for l := 0; l < c.Layers; l++ {
		for _, r := range KVCacheRoles {
			n := Name(l, r)
			t, ok := m.tensors[n]
			if !ok {
				return fmt.Errorf("%s: tensor %q is missing: the model has an int8 KV cache (%s), which needs scales and offsets for the keys and the values of every layer", src, n, any)
			}
			if d, ok := t.(*Dense); !ok || !d.DType.IsFloat() {
				return fmt.Errorf("%s: tensor %q is %s, want a float vector [%d]", src, n, describe(t), c.KVDim())
			}
			want[n] = []int{c.KVDim()}
		}
	}
	return nil
}

// describe names the kind of tensor t for error messages.
func describe(t Tensor) string {
	switch x := t.(type) {
	case *Dense:
		return fmt.Sprintf("%v%v", x.DType, x.Dims)
	case *Quantized:
		return fmt.Sprintf("a %d-bit quantized tensor %v", x.Bits, x.Shape())
	case *W8A8:
		return fmt.Sprintf("a W8A8 linear %v", x.Shape())
	}
	return fmt.Sprintf("%T", t)
}

func equalShape(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// NumElements is the product of the dimensions of shape.
func NumElements(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}
