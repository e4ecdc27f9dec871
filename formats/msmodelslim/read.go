package msmodelslim

import (
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"slices"
	"strings"

	"qtool/formats/hf"
	"qtool/formats/infile"
	"qtool/formats/model"
	"qtool/formats/safetensors"
)

// Format is the model.Model.Format of models read by Open.
const Format = "msmodelslim"

// File names of an msmodelslim export.
const (
	DescriptionFile = "quant_model_description.json"
	// WeightBaseV0 is the weights file base name of seed 001 and the fixtures.
	WeightBaseV0 = "quant_model_weight"
	// WeightBaseV1 is the base name newer msmodelslim releases write
	// (possibly sharded with an index).
	WeightBaseV1 = "quant_model_weights"
)

// normSites are the per-layer norms that SmoothQuant may fold, with their
// bias roles.
var normSites = [...][2]model.Role{{model.AttnNorm, model.AttnNormBias}, {model.MLPNorm, model.MLPNormBias}}

// Open reads an msmodelslim export: config.json, quant_model_description.json
// and quant_model_weights.safetensors (sharded or not) or, failing that,
// quant_model_weight.safetensors.
//
//   - W8A16 / W4A16 linears become *model.Quantized (Bits 8 or 4, Zero =
//     weight_offset, nil when all offsets are 0; GroupSize 0 for a 1-D
//     weight_scale [n], k/G for a 2-D [n, G] one).
//   - W8A8 linears become *model.W8A8. The weight scale is not stored by
//     msmodelslim; Weight.Scale is derived as deq_scale / input_scale.
//     W8A8.Bias stays nil: msmodelslim's quant_bias already holds the float
//     bias. A "bias" tensor beside a W8A8 linear is kept only when it has a
//     canonical role (Qwen2 q/k/v biases, which CheckShapes requires; a
//     runtime must not add it again to a W8A8 output) and dropped otherwise.
//   - SmoothQuant-folded norms: "<norm>.module.weight" becomes attn_norm /
//     mlp_norm and "<norm>.module.bias" attn_norm_bias / mlp_norm_bias. The
//     plain "<norm>.weight" beside them is the unsmoothed original, kept by
//     msmodelslim only for layers that fall back to float; the quantized
//     linears expect the folded one, so the plain copy is dropped. A newer
//     export's "<norm>.bias" (no "module.") becomes the bias role directly.
//   - FLOAT tensors stay dense, aliasing the memory-mapped weights.
func Open(dir string) (*model.Model, error) {
	cfg, _, err := hf.ReadConfig(dir)
	if err != nil {
		return nil, err
	}
	descPath := filepath.Join(dir, DescriptionFile)
	data, err := infile.ReadFile(descPath, infile.MetaLimit)
	if err != nil {
		return nil, fmt.Errorf("%s: not an msmodelslim export: %w", dir, err)
	}
	desc, err := ParseDescription(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", descPath, err)
	}
	ck, err := safetensors.OpenCheckpoint(dir, WeightBaseV1)
	if errors.Is(err, safetensors.ErrNotFound) {
		ck, err = safetensors.OpenCheckpoint(dir, WeightBaseV0)
	}
	if err != nil {
		return nil, err
	}
	m := model.New(cfg)
	m.Source, m.Format, m.TokenizerDir = dir, Format, dir
	m.AddCloser(ck)
	r := &reader{ck: ck, desc: desc, claimed: map[string]bool{}}
	if err := r.load(m); err != nil {
		m.Close()
		return nil, err
	}
	return m, nil
}

type reader struct {
	ck      *safetensors.Checkpoint
	desc    *Description
	claimed map[string]bool
}

func (r *reader) errorf(format string, args ...any) error {
	return fmt.Errorf("%s: "+format, append([]any{r.ck.Path}, args...)...)
}

// tensor returns name, claiming it.
func (r *reader) tensor(name string) (*model.Dense, error) {
	d, err := r.ck.Tensor(name)
	if err != nil {
		return nil, err
	}
	r.claimed[name] = true
	return d, nil
}

// typeOf is the description's type of name ("" when not listed).
func (r *reader) typeOf(name string) string { return r.desc.Types[name] }

func (r *reader) load(m *model.Model) error {
	for _, name := range r.ck.Names() {
		if t := r.typeOf(name); t != "" {
			if err := checkType(name, t, true); err != nil {
				return r.errorf("%w", err)
			}
		}
	}
	cfg := m.Config
	for l := 0; l < cfg.Layers; l++ {
		for _, role := range model.Linears {
			mod, _ := hf.Module(l, role)
			if !r.ck.Has(mod + ".weight") {
				continue // missing: CheckShapes says so
			}
			info, _ := r.ck.Info(mod + ".weight")
			wt := r.typeOf(mod + ".weight")
			if info.DType.IsFloat() {
				if wt != "" && wt != TypeFloat {
					return r.errorf("tensor %q is %v but the description says %s", mod+".weight", info.DType, wt)
				}
				continue // a float linear, loaded below
			}
			var t model.Tensor
			var err error
			typ := wt // the type, the model's when the tensor has none
			if typ == "" {
				typ = r.desc.ModelQuantType
			}
			if r.ck.Has(mod + ".input_scale") {
				if wt != "" && wt != TypeW8A8 && wt != TypeW8A8S {
					return r.errorf("%s has W8A8 parameters (input_scale) but the description says %s", mod, wt)
				}
				var a *model.W8A8
				a, err = r.readW8A8(mod)
				if err == nil {
					a.Sparse = typ == TypeW8A8S
				}
				t = a
			} else {
				switch {
				case wt == TypeW8A8 || wt == TypeW8A8S:
					return r.errorf("%s is %s in the description but has no input_scale", mod, wt)
				case typ == TypeW8A8Dynamic:
					t, err = r.readDynamic(mod)
				default:
					bits := 8
					if typ == TypeW4A16 {
						bits = 4
					}
					t, err = r.readWeightOnly(mod, bits)
				}
			}
			if err != nil {
				return err
			}
			m.Set(model.Name(l, role), t)
		}
		if err := r.readKVCache(m, l); err != nil {
			return err
		}
		for _, site := range normSites {
			base, _ := hf.Module(l, site[0])
			switch {
			case r.ck.Has(base + ".module.weight"):
				w, err := r.tensor(base + ".module.weight")
				if err != nil {
					return err
				}
				m.Set(model.Name(l, site[0]), w)
				if r.ck.Has(base + ".module.bias") {
					b, err := r.tensor(base + ".module.bias")
					if err != nil {
						return err
					}
					if len(b.Dims) != 1 || b.Dims[0] != cfg.Hidden || !b.DType.IsFloat() {
						return r.errorf("%s.module.bias is %v%v, want a float [%d]", base, b.DType, b.Dims, cfg.Hidden)
					}
					m.Set(model.Name(l, site[1]), b)
				}
				r.claimed[base+".weight"] = true // the unsmoothed fallback copy
			case r.ck.Has(base + ".module.bias"):
				return r.errorf("%s.module.bias without %s.module.weight", base, base)
			case r.ck.Has(base + ".bias"):
				b, err := r.tensor(base + ".bias")
				if err != nil {
					return err
				}
				if len(b.Dims) != 1 || b.Dims[0] != cfg.Hidden || !b.DType.IsFloat() {
					return r.errorf("%s.bias is %v%v, want a float [%d]", base, b.DType, b.Dims, cfg.Hidden)
				}
				m.Set(model.Name(l, site[1]), b)
			}
		}
	}
	for _, name := range r.ck.Names() {
		if r.claimed[name] {
			continue
		}
		if t := r.typeOf(name); t != "" && t != TypeFloat {
			if _, ok := hf.CanonicalName(name); ok {
				// a FLOAT-shaped tensor typed as quantized (msmodelslim marks
				// some float tensors with the model type); accept floats only
				if info, _ := r.ck.Info(name); !info.DType.IsFloat() {
					return r.errorf("tensor %q (%s) has dtype %v and is not a parameter of a quantized linear", name, t, info.DType)
				}
			} else {
				return r.errorf("tensor %q (%s) is not a parameter qtool knows for a %s model", name, t, m.Config.Arch)
			}
		}
	}
	if err := hf.LoadTensors(m, r.ck, func(n string) bool { return r.claimed[n] }); err != nil {
		return err
	}
	return m.CheckShapes()
}

// readWeightOnly reads a W8A16/W4A16 linear: weight int8 [n,k], weight_scale
// fp32 [n], [n,1] or [n,G], weight_offset the same shape (optional).
func (r *reader) readWeightOnly(mod string, bits int) (*model.Quantized, error) {
	w, err := r.tensor(mod + ".weight")
	if err != nil {
		return nil, err
	}
	if w.DType != model.I8 || len(w.Dims) != 2 {
		return nil, r.errorf("%s.weight is %v%v, want a 2-D I8 tensor", mod, w.DType, w.Dims)
	}
	n, k := w.Dims[0], w.Dims[1]
	if !r.ck.Has(mod + ".weight_scale") {
		return nil, r.errorf("%s: int8 weight without weight_scale (or input_scale for W8A8)", mod)
	}
	sc, err := r.tensor(mod + ".weight_scale")
	if err != nil {
		return nil, err
	}
	G, group := 0, 0
	switch {
	case len(sc.Dims) == 1 && sc.Dims[0] == n:
		G, group = 1, 0
	case len(sc.Dims) == 2 && sc.Dims[0] == n && sc.Dims[1] > 0 && k%sc.Dims[1] == 0:
		G, group = sc.Dims[1], k/sc.Dims[1]
	default:
		return nil, r.errorf("%s.weight_scale has shape %v; for weight [%d %d] want [%d], [%d 1] or [%d k/group_size]", mod, sc.Dims, n, k, n, n, n)
	}
	if !sc.DType.IsFloat() {
		return nil, r.errorf("%s.weight_scale has dtype %v, want F32", mod, sc.DType)
	}
	if r.desc.GroupSize > 0 && G > 1 && group != r.desc.GroupSize {
		return nil, r.errorf("%s: weight_scale %v gives group size %d, the description says %d", mod, sc.Dims, group, r.desc.GroupSize)
	}
	q := &model.Quantized{Bits: bits, GroupSize: group, Rows: n, Cols: k}
	if q.Q, err = w.Int8s(); err != nil {
		return nil, r.errorf("%s.weight: %w", mod, err)
	}
	if q.Scale, err = sc.Float32(); err != nil {
		return nil, r.errorf("%s.weight_scale: %w", mod, err)
	}
	if r.ck.Has(mod + ".weight_offset") {
		off, err := r.tensor(mod + ".weight_offset")
		if err != nil {
			return nil, err
		}
		if !off.DType.IsFloat() || !sameShape(off.Dims, sc.Dims) {
			return nil, r.errorf("%s.weight_offset is %v%v, want %v%v like weight_scale", mod, off.DType, off.Dims, sc.DType, sc.Dims)
		}
		z, _ := off.Float32()
		for _, v := range z {
			if v != 0 {
				q.Zero = z
				break
			}
		}
	}
	if err := q.Validate(); err != nil {
		return nil, r.errorf("%s: %w", mod, err)
	}
	if hfBias := mod + ".bias"; r.ck.Has(hfBias) {
		if _, ok := hf.CanonicalName(hfBias); !ok {
			return nil, r.errorf("%s has a bias, which a %d-bit weight-only linear of this architecture cannot carry", mod, bits)
		}
	}
	return q, nil
}

// readW8A8 reads a static W8A8 linear.
func (r *reader) readW8A8(mod string) (*model.W8A8, error) {
	w, err := r.tensor(mod + ".weight")
	if err != nil {
		return nil, err
	}
	if w.DType != model.I8 || len(w.Dims) != 2 {
		return nil, r.errorf("%s.weight is %v%v, want a 2-D I8 tensor", mod, w.DType, w.Dims)
	}
	n, k := w.Dims[0], w.Dims[1]
	for _, p := range []string{"input_offset", "deq_scale", "quant_bias"} {
		if !r.ck.Has(mod + "." + p) {
			return nil, r.errorf("W8A8 linear %s has no %s", mod, p)
		}
	}
	scalar := func(p string) (float32, error) {
		d, err := r.tensor(mod + "." + p)
		if err != nil {
			return 0, err
		}
		if !d.DType.IsFloat() || d.Len() != 1 || len(d.Dims) > 1 {
			return 0, r.errorf("%s.%s is %v%v, want a float tensor of shape [1]", mod, p, d.DType, d.Dims)
		}
		v, _ := d.Float32()
		return v[0], nil
	}
	a := &model.W8A8{}
	if a.InputScale, err = scalar("input_scale"); err != nil {
		return nil, err
	}
	if a.InputOffset, err = scalar("input_offset"); err != nil {
		return nil, err
	}
	if a.InputScale == 0 || math.IsNaN(float64(a.InputScale)) || math.IsInf(float64(a.InputScale), 0) {
		return nil, r.errorf("%s.input_scale = %g, want a finite non-zero scale", mod, a.InputScale)
	}
	ds, err := r.tensor(mod + ".deq_scale")
	if err != nil {
		return nil, err
	}
	if len(ds.Dims) != 1 || ds.Dims[0] != n {
		return nil, r.errorf("%s.deq_scale has shape %v, want [%d]", mod, ds.Dims, n)
	}
	switch {
	case ds.DType == model.I64:
		// the fp32 bit pattern, reinterpreted as int32 and sign-extended
		a.DeqScale = make([]float32, n)
		for i := range a.DeqScale {
			a.DeqScale[i] = math.Float32frombits(uint32(ds.Data[8*i]) | uint32(ds.Data[8*i+1])<<8 | uint32(ds.Data[8*i+2])<<16 | uint32(ds.Data[8*i+3])<<24)
		}
	case ds.DType.IsFloat():
		a.DeqScale, _ = ds.Float32()
	default:
		return nil, r.errorf("%s.deq_scale has dtype %v, want I64 (fp32 bits) or F32", mod, ds.DType)
	}
	qb, err := r.tensor(mod + ".quant_bias")
	if err != nil {
		return nil, err
	}
	if qb.DType != model.I32 || len(qb.Dims) != 1 || qb.Dims[0] != n {
		return nil, r.errorf("%s.quant_bias is %v%v, want I32[%d]", mod, qb.DType, qb.Dims, n)
	}
	a.QuantBias, _ = qb.Int32s()
	// msmodelslim folds the float bias into quant_bias (quant_bias =
	// round(bias/deq_scale − input_offset·Σ_k W_q)); Ascend kernels pass only
	// quant_bias. A "bias" with a canonical role (Qwen2 q/k/v) stays that
	// dense tensor; any other one is redundant and dropped. W8A8.Bias stays nil.
	if hfBias := mod + ".bias"; r.ck.Has(hfBias) {
		if _, ok := hf.CanonicalName(hfBias); !ok {
			r.claimed[hfBias] = true
		}
	}
	q := &model.Quantized{Bits: 8, Rows: n, Cols: k, Scale: make([]float32, n)}
	if q.Q, err = w.Int8s(); err != nil {
		return nil, err
	}
	for i, d := range a.DeqScale {
		q.Scale[i] = d / a.InputScale
	}
	if err := q.Validate(); err != nil {
		return nil, r.errorf("%s: %w", mod, err)
	}
	a.Weight = q
	return a, nil
}

// readDynamic reads a W8A8_DYNAMIC linear: the W8A16 layout with one
// symmetric scale per output channel.
func (r *reader) readDynamic(mod string) (*model.W8A8, error) {
	q, err := r.readWeightOnly(mod, 8)
	if err != nil {
		return nil, err
	}
	if q.GroupSize == q.Cols { // weight_scale [n, 1]: one group per row
		q.GroupSize = 0
	}
	if q.GroupSize != 0 || q.Zero != nil {
		return nil, r.errorf("%s is W8A8_DYNAMIC, which needs one weight_scale per output channel and zero weight_offset (got group size %d, non-zero offsets %v)", mod, q.GroupSize, q.Zero != nil)
	}
	return &model.W8A8{Weight: q, Dynamic: true}, nil
}

// KV-cache parameter names (seed 001): "<linear>.kv_cache_scale" and
// "<linear>.kv_cache_offset" after the k and v projections when they are
// separate, "<merged linear>.k_proj.kv_cache_scale" (and so on) when q/k/v
// or k/v are one linear.
const (
	kvScaleSuffix  = "kv_cache_scale"
	kvOffsetSuffix = "kv_cache_offset"
	// kvOffsetAlias is the spelling seed 001's list uses once ("k_proj.kv_offset").
	kvOffsetAlias = "kv_offset"
)

// KVCacheNames returns the names of the four KV-cache tensors of the
// attention module attn ("model.layers.0.self_attn"): k scale, k offset,
// v scale, v offset. merged is the name of a merged q/k/v (or k/v) linear
// inside attn ("query_key_value"), "" for separate k_proj and v_proj.
func KVCacheNames(attn, merged string) [4]string {
	p := attn + "."
	if merged != "" {
		p += merged + "."
	}
	return [4]string{p + "k_proj." + kvScaleSuffix, p + "k_proj." + kvOffsetSuffix, p + "v_proj." + kvScaleSuffix, p + "v_proj." + kvOffsetSuffix}
}

// attentionModule is the HF name of layer l's attention module.
func attentionModule(l int) string {
	k, _ := hf.Module(l, model.K)
	return strings.TrimSuffix(k, ".k_proj")
}

// kvCacheNamesIn finds layer l's KV-cache tensors in the checkpoint: the
// separate names, else a merged linear's; ok is false when it has none.
func (r *reader) kvCacheNamesIn(l int) (names [4]string, ok bool, err error) {
	attn := attentionModule(l)
	sep := KVCacheNames(attn, "")
	if r.ck.Has(sep[0]) || r.ck.Has(sep[2]) {
		return sep, true, nil
	}
	var merged []string
	for _, n := range r.ck.Names() {
		rest, found := strings.CutPrefix(n, attn+".")
		if !found {
			continue
		}
		for _, suf := range []string{".k_proj." + kvScaleSuffix, ".v_proj." + kvScaleSuffix} {
			if mid, found := strings.CutSuffix(rest, suf); found && mid != "" && !strings.Contains(mid, ".") && !slices.Contains(merged, mid) {
				merged = append(merged, mid)
			}
		}
	}
	switch len(merged) {
	case 0:
		return sep, false, nil
	case 1:
		return KVCacheNames(attn, merged[0]), true, nil
	}
	return sep, false, r.errorf("layer %d has KV-cache scales under several linears (%s)", l, strings.Join(merged, ", "))
}

// readKVCache reads layer l's int8 KV-cache parameters (kv_cache_type C8):
// float vectors of the k/v projection's width, for the keys and the
// values as cached (after RoPE).
func (r *reader) readKVCache(m *model.Model, l int) error {
	names, ok, err := r.kvCacheNamesIn(l)
	if err != nil {
		return err
	}
	c8 := r.desc.KVCacheType == KVCacheC8
	switch {
	case !ok && !c8:
		return nil
	case !ok:
		return r.errorf("the description says kv_cache_type C8 but layer %d has no %s (qtool needs the KV-cache scales and offsets of every layer)", l, names[0])
	case !c8:
		return r.errorf("tensor %q is a KV-cache scale but the description has no kv_cache_type C8", names[0])
	}
	kvDim := m.Config.KVDim()
	for i, name := range names {
		if i%2 == 1 && !r.ck.Has(name) {
			if alias := strings.TrimSuffix(name, kvOffsetSuffix) + kvOffsetAlias; r.ck.Has(alias) {
				name = alias
			}
		}
		if !r.ck.Has(name) {
			return r.errorf("layer %d: KV-cache tensor %q is missing (C8 needs the scale and offset of the keys and of the values)", l, name)
		}
		d, err := r.tensor(name)
		if err != nil {
			return err
		}
		if !d.DType.IsFloat() || len(d.Dims) != 1 || d.Dims[0] != kvDim {
			return r.errorf("KV-cache tensor %q is %v%v, want a float vector [%d] (the k/v projection's output channels)", name, d.DType, d.Dims, kvDim)
		}
		m.Set(model.Name(l, model.KVCacheRoles[i]), d)
	}
	return nil
}

func sameShape(a, b []int) bool {
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
