package msmodelslim

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"

	"qtool/formats/hf"
	"qtool/formats/model"
	"qtool/formats/safetensors"
)

// WriteOptions controls Write.
type WriteOptions struct {
	// MaxShard splits the weights into shards of at most this many bytes
	// plus an index (0: one file).
	MaxShard int64
	// V1Name writes quant_model_weights.safetensors (newer msmodelslim)
	// instead of seed 001's quant_model_weight.safetensors.
	V1Name bool
	// DeqScaleInt64 writes W8A8 deq_scale as int64 (the fp32 bit pattern
	// sign-extended, as msmodelslim does for fp16 models) instead of fp32.
	DeqScaleInt64 bool
	// Force replaces a dir that is not empty (see hf.WriteDir).
	Force bool
}

// Write saves m in the msmodelslim layout of seed 001: config.json,
// quant_model_description.json and the weights file, plus the tokenizer
// files of m.TokenizerDir. dir appears complete or not at all (hf.WriteDir).
//
//   - *model.Quantized decoder linears (8 bits → W8A16, 4 bits → W4A16; no
//     GIdx) are written as weight int8 [n,k], weight_scale fp32 ([n] when
//     GroupSize is 0, else [n, k/GroupSize]) and weight_offset (Zero, or
//     zeros when symmetric).
//   - *model.W8A8 linears are written as weight, input_scale and
//     input_offset [1] (fp16 or bf16 when that holds both values exactly,
//     else fp32), deq_scale [n] (fp32, or int64 with DeqScaleInt64),
//     quant_bias int32 [n]. The weight scale is not part of the format: Open
//     derives it as deq_scale / input_scale. A W8A8 with a separate Bias is
//     refused: msmodelslim's quant_bias must already contain the bias.
//     With Sparse set the type is W8A8S (the same tensors). A Dynamic one
//     (per-token activations) is W8A8_DYNAMIC: weight, weight_scale fp32
//     [n,1], weight_offset zeros [n,1].
//   - The int8 KV cache's scales and offsets (model.KVCacheRoles) are
//     written fp32 as "<k_proj>.kv_cache_scale", "<k_proj>.kv_cache_offset"
//     and the same after v_proj, with "kv_cache_type": "C8".
//   - A norm with a bias role (SmoothQuant-folded) is written as
//     "<norm>.module.weight" and "<norm>.module.bias" (typed like the model)
//     plus a FLOAT "<norm>.weight" holding the same folded weight: qtool does
//     not keep the unsmoothed original that msmodelslim stores there.
//   - Every other tensor is FLOAT in its own dtype (quantized non-linear
//     tensors are dequantized to the model's float dtype).
//
// Open(Write(m)) reproduces every tensor of m exactly (W8A8 weight scales
// exactly when they equal DeqScale / InputScale, as read ones do). A model
// whose q/k rows are in the interleaved rope layout is permuted to the HF
// layout first (model.WithRope).
func Write(m *model.Model, dir string, opt WriteOptions) error {
	m, err := model.WithRope(m, model.RopeHalf)
	if err != nil {
		return fmt.Errorf("write %s: %w", dir, err)
	}
	w := &writer{m: m, dir: dir, opt: opt, desc: &Description{Types: map[string]string{}}}
	if err := w.collect(); err != nil {
		return err
	}
	base := WeightBaseV0
	if opt.V1Name {
		base = WeightBaseV1
	}
	js, err := w.desc.Marshal(w.order)
	if err != nil {
		return err
	}
	cj, err := hf.MarshalConfig(m.Config, nil)
	if err != nil {
		return err
	}
	return hf.WriteModelDir(dir, opt.Force, hf.ModelFiles{Base: base, Entries: w.entries, MaxShard: opt.MaxShard,
		Files: map[string][]byte{DescriptionFile: js, "config.json": cj}, TokenizerDir: m.TokenizerDir})
}

type writer struct {
	m       *model.Model
	dir     string
	opt     WriteOptions
	desc    *Description
	entries []safetensors.Entry
	order   []string
	// typedLikeModel are names typed like the model (folded norms, KV-cache
	// parameters), resolved once it is known.
	typedLikeModel []string
	// w8a8 counts the W8A8 linears by description type.
	w8a8 map[string]int
	bits map[int]bool
}

func (w *writer) add(e safetensors.Entry, typ string) {
	w.entries = append(w.entries, e)
	w.order = append(w.order, e.Name)
	w.desc.Types[e.Name] = typ
}

func (w *writer) errorf(format string, args ...any) error {
	return fmt.Errorf("write %s: "+format, append([]any{w.dir}, args...)...)
}

// floatDType is the model's float dtype for dequantized tensors.
func (w *writer) floatDType() model.DType {
	switch w.m.Config.DType {
	case "float16":
		return model.F16
	case "bfloat16":
		return model.BF16
	}
	return model.F32
}

func (w *writer) collect() error {
	w.bits, w.w8a8 = map[int]bool{}, map[string]int{}
	for _, canon := range w.m.SortedNames() {
		t, _ := w.m.Lookup(canon)
		layer, role, _ := model.ParseName(canon)
		if role == model.AttnNormBias || role == model.MLPNormBias {
			norm := model.AttnNorm
			if role == model.MLPNormBias {
				norm = model.MLPNorm
			}
			if _, ok := w.m.Lookup(model.Name(layer, norm)); !ok || layer < 0 {
				return w.errorf("tensor %q has no norm weight %q beside it", canon, model.Name(layer, norm))
			}
			continue // written with its norm
		}
		if kv := slices.Index(model.KVCacheRoles[:], role); kv >= 0 && layer >= 0 {
			name := KVCacheNames(attentionModule(layer), "")[kv]
			w.add(hf.FloatEntry(name, t, model.F32), "")
			w.typedLikeModel = append(w.typedLikeModel, name)
			w.desc.KVCacheType = KVCacheC8
			continue
		}
		linear := layer >= 0 && model.IsLinear(role)
		mod, _ := hf.Module(layer, role)
		switch v := t.(type) {
		case *model.Quantized:
			if linear {
				if err := w.addWeightOnly(canon, mod, v); err != nil {
					return err
				}
				continue
			}
		case *model.W8A8:
			if !linear {
				return w.errorf("tensor %q is W8A8 but not a decoder linear", canon)
			}
			if err := w.addW8A8(canon, mod, v); err != nil {
				return err
			}
			continue
		}
		name, ok := hf.TensorName(canon)
		if !ok {
			return w.errorf("tensor %q has no Hugging Face name", canon)
		}
		if role == model.AttnNorm || role == model.MLPNorm {
			bias := model.AttnNormBias
			if role == model.MLPNorm {
				bias = model.MLPNormBias
			}
			if bt, ok := w.m.Lookup(model.Name(layer, bias)); ok {
				if err := w.addFoldedNorm(mod, t, bt); err != nil {
					return err
				}
				continue
			}
		}
		dt := model.DType(0)
		if _, dense := t.(*model.Dense); !dense {
			dt = w.floatDType()
		}
		w.add(hf.FloatEntry(name, t, dt), TypeFloat)
	}
	nw8a8 := 0
	for _, n := range w.w8a8 {
		nw8a8 += n
	}
	switch {
	case nw8a8 > 0 && len(w.w8a8) == 1 && len(w.bits) == 0:
		for t := range w.w8a8 {
			w.desc.ModelQuantType = t // all W8A8, all W8A8S or all dynamic
		}
	case nw8a8 > 0:
		w.desc.ModelQuantType = TypeW8A8
	case w.bits[8]:
		w.desc.ModelQuantType = TypeW8A16
	case w.bits[4]:
		w.desc.ModelQuantType = TypeW4A16
	default:
		return w.errorf("model has no quantized decoder linear; msmodelslim exports need W8A16, W4A16 or W8A8 linears")
	}
	for _, n := range w.typedLikeModel {
		w.desc.Types[n] = w.desc.ModelQuantType
	}
	return nil
}

func (w *writer) addWeightOnly(canon, mod string, q *model.Quantized) error {
	if err := q.Validate(); err != nil {
		return w.errorf("tensor %q: %w", canon, err)
	}
	typ := TypeW8A16
	switch q.Bits {
	case 8:
	case 4:
		typ = TypeW4A16
	default:
		return w.errorf("tensor %q has %d bits; msmodelslim weight-only linears are 8-bit (W8A16) or 4-bit (W4A16)", canon, q.Bits)
	}
	if q.GIdx != nil {
		return w.errorf("tensor %q has a g_idx (act-order); msmodelslim has no input permutation", canon)
	}
	if q.GroupSize > 0 {
		if w.desc.GroupSize != 0 && w.desc.GroupSize != q.GroupSize {
			return w.errorf("tensor %q has group size %d, others %d; the description holds one group_size", canon, q.GroupSize, w.desc.GroupSize)
		}
		w.desc.GroupSize = q.GroupSize
	}
	w.bits[q.Bits] = true
	n, G := q.Rows, q.Groups()
	shape := []int{n}
	if q.GroupSize > 0 {
		shape = []int{n, G}
	}
	w.add(int8Entry(mod+".weight", q), typ)
	w.add(safetensors.Entry{Name: mod + ".weight_scale", DType: model.F32, Shape: shape,
		Data: func() ([]byte, error) { return hf.EncodeFloats(q.Scale, model.F32), nil }}, typ)
	w.add(safetensors.Entry{Name: mod + ".weight_offset", DType: model.F32, Shape: shape,
		Data: func() ([]byte, error) {
			if q.Zero == nil {
				return make([]byte, 4*n*G), nil
			}
			return hf.EncodeFloats(q.Zero, model.F32), nil
		}}, typ)
	return nil
}

func int8Entry(name string, q *model.Quantized) safetensors.Entry {
	return safetensors.Entry{Name: name, DType: model.I8, Shape: []int{q.Rows, q.Cols},
		Data: func() ([]byte, error) {
			b := make([]byte, len(q.Q))
			for i, v := range q.Q {
				b[i] = byte(v)
			}
			return b, nil
		}}
}

func (w *writer) addW8A8(canon, mod string, a *model.W8A8) error {
	if err := a.Validate(); err != nil {
		return w.errorf("tensor %q: %w", canon, err)
	}
	q := a.Weight
	n := q.Rows
	if a.Dynamic {
		w.w8a8[TypeW8A8Dynamic]++
		typ := TypeW8A8Dynamic
		w.add(int8Entry(mod+".weight", q), typ)
		w.add(safetensors.Entry{Name: mod + ".weight_scale", DType: model.F32, Shape: []int{n, 1},
			Data: func() ([]byte, error) { return hf.EncodeFloats(q.Scale, model.F32), nil }}, typ)
		w.add(safetensors.Entry{Name: mod + ".weight_offset", DType: model.F32, Shape: []int{n, 1},
			Data: func() ([]byte, error) { return make([]byte, 4*n), nil }}, typ)
		if a.Bias != nil {
			return w.errorf("tensor %q: W8A8_DYNAMIC linear with a Bias field; msmodelslim keeps a dynamic linear's bias as the model's float bias tensor", canon)
		}
		return nil
	}
	if a.Bias != nil {
		return w.errorf("tensor %q: W8A8 has a separate float Bias; msmodelslim holds the bias inside quant_bias (fold round(Bias/DeqScale) into QuantBias first)", canon)
	}
	typ := TypeW8A8
	if a.Sparse {
		typ = TypeW8A8S
	}
	w.w8a8[typ]++
	w.add(int8Entry(mod+".weight", q), typ)
	sdt := w.exactDType(a.InputScale, a.InputOffset)
	w.add(safetensors.Entry{Name: mod + ".input_scale", DType: sdt, Shape: []int{1},
		Data: func() ([]byte, error) { return hf.EncodeFloats([]float32{a.InputScale}, sdt), nil }}, typ)
	w.add(safetensors.Entry{Name: mod + ".input_offset", DType: sdt, Shape: []int{1},
		Data: func() ([]byte, error) { return hf.EncodeFloats([]float32{a.InputOffset}, sdt), nil }}, typ)
	if w.opt.DeqScaleInt64 {
		w.add(safetensors.Entry{Name: mod + ".deq_scale", DType: model.I64, Shape: []int{n},
			Data: func() ([]byte, error) {
				b := make([]byte, 8*n)
				for i, d := range a.DeqScale {
					binary.LittleEndian.PutUint64(b[8*i:], uint64(int64(int32(math.Float32bits(d)))))
				}
				return b, nil
			}}, typ)
	} else {
		w.add(safetensors.Entry{Name: mod + ".deq_scale", DType: model.F32, Shape: []int{n},
			Data: func() ([]byte, error) { return hf.EncodeFloats(a.DeqScale, model.F32), nil }}, typ)
	}
	w.add(safetensors.Entry{Name: mod + ".quant_bias", DType: model.I32, Shape: []int{n},
		Data: func() ([]byte, error) {
			b := make([]byte, 4*n)
			for i, v := range a.QuantBias {
				binary.LittleEndian.PutUint32(b[4*i:], uint32(v))
			}
			return b, nil
		}}, typ)
	return nil
}

// exactDType picks the model's 16-bit float type when it holds every value
// exactly, else the other 16-bit type, else F32.
func (w *writer) exactDType(vs ...float32) model.DType {
	cands := []model.DType{model.F16, model.BF16}
	if w.floatDType() == model.BF16 {
		cands = []model.DType{model.BF16, model.F16}
	}
	for _, dt := range cands {
		ok := true
		for _, v := range vs {
			var back float32
			if dt == model.F16 {
				back = model.RoundF16(v)
			} else {
				back = model.BF16ToFloat32(model.Float32ToBF16(v))
			}
			if back != v && !(math.IsNaN(float64(v)) && math.IsNaN(float64(back))) {
				ok = false
			}
		}
		if ok {
			return dt
		}
	}
	return model.F32
}

// addFoldedNorm writes a SmoothQuant-folded norm (see Write).
func (w *writer) addFoldedNorm(base string, weight, bias model.Tensor) error {
	wd, bd := model.DType(0), model.DType(0)
	if _, ok := weight.(*model.Dense); !ok {
		wd = w.floatDType()
	}
	if _, ok := bias.(*model.Dense); !ok {
		bd = w.floatDType()
	}
	w.add(hf.FloatEntry(base+".weight", weight, wd), TypeFloat)
	w.add(hf.FloatEntry(base+".module.weight", weight, wd), "")
	w.add(hf.FloatEntry(base+".module.bias", bias, bd), "")
	w.typedLikeModel = append(w.typedLikeModel, base+".module.weight", base+".module.bias")
	return nil
}
