package gptq

import (
	"encoding/json"
	"errors"
	"fmt"

	"qtool/formats/hf"
	"qtool/formats/model"
	"qtool/formats/safetensors"
)

// Format is the model.Model.Format of models read by Open.
const Format = "gptq"

// ReadQuantConfig returns the GPTQ quantization config of dir: the
// "quantization_config" of config.json, or AutoGPTQ's quantize_config.json
// when config.json has none.
func ReadQuantConfig(dir string, raw map[string]json.RawMessage) (QuantConfig, error) {
	data, path, err := hf.QuantizationConfig(dir, raw, "quantize_config.json", "a GPTQ")
	if err != nil {
		return QuantConfig{}, err
	}
	qc, err := ParseQuantConfig(data)
	if err != nil {
		return QuantConfig{}, fmt.Errorf("%s: %w", path, err)
	}
	return qc, nil
}

// Open reads a GPTQ checkpoint directory (checkpoint_format "gptq", or
// "gptq_v2"): config.json with its quantization_config, and model.safetensors
// or shards with an index. Each decoder linear stored as
// qweight/qzeros/scales/g_idx becomes a *model.Quantized (Zero nil when all
// zero points are 2^(bits−1); GIdx set when g_idx is not the default
// c/group_size). Float linears and other tensors stay dense, aliasing the
// memory-mapped files until the model is closed.
func Open(dir string) (*model.Model, error) {
	cfg, raw, err := hf.ReadConfig(dir)
	if err != nil {
		return nil, err
	}
	qc, err := ReadQuantConfig(dir, raw)
	if err != nil {
		return nil, err
	}
	return hf.OpenQuantized(dir, cfg, hf.QuantizedLayout{
		Format: Format,
		Parts:  []string{".qweight", ".qzeros", ".scales"},
		Extra:  []string{".g_idx"},
		Read: func(ck *safetensors.Checkpoint, mod string) (model.Tensor, error) {
			return readLinear(ck, mod, qc)
		},
	})
}

func readLinear(ck *safetensors.Checkpoint, mod string, qc QuantConfig) (*model.Quantized, error) {
	get := func(suffix string) (*model.Dense, error) { return ck.Tensor(mod + suffix) }
	qw, err := get(".qweight")
	if err != nil {
		return nil, err
	}
	qz, err := get(".qzeros")
	if err != nil {
		return nil, err
	}
	sc, err := get(".scales")
	if err != nil {
		return nil, err
	}
	if qw.DType != model.I32 || qz.DType != model.I32 {
		return nil, fmt.Errorf("%s: %s: qweight is %v and qzeros %v, want I32", ck.Path, mod, qw.DType, qz.DType)
	}
	if !sc.DType.IsFloat() {
		return nil, fmt.Errorf("%s: %s.scales has dtype %v, want F16", ck.Path, mod, sc.DType)
	}
	if len(qw.Dims) != 2 || len(qz.Dims) != 2 || len(sc.Dims) != 2 {
		return nil, fmt.Errorf("%s: %s: qweight %v, qzeros %v, scales %v must all be 2-D", ck.Path, mod, qw.Dims, qz.Dims, sc.Dims)
	}
	l := Layer{In: qw.Dims[0] * 32 / qc.Bits, Out: qw.Dims[1], Bits: qc.Bits, Group: qc.GroupSize}
	if qw.Dims[0]*32%qc.Bits != 0 || sc.Dims[1] != l.Out || qz.Dims[0] != sc.Dims[0] || qz.Dims[1]*32 != l.Out*qc.Bits ||
		(l.Group > 0 && sc.Dims[0]*l.Group != l.In) || (l.Group <= 0 && sc.Dims[0] != 1) {
		return nil, fmt.Errorf("%s: %s: qweight %v, qzeros %v, scales %v do not fit one layer with %d bits and group size %d (want [in·bits/32, out], [in/g, out·bits/32], [in/g, out])",
			ck.Path, mod, qw.Dims, qz.Dims, sc.Dims, qc.Bits, qc.GroupSize)
	}
	var gIdx []int32
	if ck.Has(mod + ".g_idx") {
		gi, err := get(".g_idx")
		if err != nil {
			return nil, err
		}
		if gi.DType != model.I32 || len(gi.Dims) != 1 || gi.Dims[0] != l.In {
			return nil, fmt.Errorf("%s: %s.g_idx is %v%v, want I32[%d]", ck.Path, mod, gi.DType, gi.Dims, l.In)
		}
		gIdx, _ = gi.Int32s()
	} else if qc.DescAct {
		return nil, fmt.Errorf("%s: %s has no g_idx but the config says desc_act = true (act-order needs g_idx)", ck.Path, mod)
	}
	wv, _ := qw.Int32s()
	zv, _ := qz.Int32s()
	sv, err := sc.Float32()
	if err != nil {
		return nil, fmt.Errorf("%s: %s.scales: %w", ck.Path, mod, err)
	}
	bias := 1
	if qc.CheckpointFormat == "gptq_v2" {
		bias = 0
	}
	q, err := unpack(wv, zv, sv, gIdx, l, bias)
	if err != nil {
		return nil, fmt.Errorf("%s: %s: %w", ck.Path, mod, err)
	}
	return q, nil
}

// WriteOptions controls Write.
type WriteOptions struct {
	// MaxShard splits the weights into shards of at most this many bytes
	// plus model.safetensors.index.json (0: one model.safetensors).
	MaxShard int64
	// Force replaces a dir that is not empty (see hf.WriteDir).
	Force bool
}

// Write saves m as a GPTQ v1 checkpoint (checkpoint_format "gptq") in dir.
// Every *model.Quantized decoder linear must share one bit width (2, 3, 4 or
// 8) and one group size (0 is written as group_size −1); their scales are
// rounded to fp16 (see Pack). desc_act is true when some layer has a GIdx,
// sym is true when no layer has zero points. Float decoder linears stay
// plain fp16 weights; every other tensor is written as fp16 (quantized ones
// dequantized). config.json gets the quantization_config and the tokenizer
// files of m.TokenizerDir are copied. dir appears complete or not at all
// (hf.WriteDir).
func Write(m *model.Model, dir string, opt WriteOptions) error {
	qc := QuantConfig{Sym: true, CheckpointFormat: "gptq"}
	return hf.WriteQuantized(m, dir, hf.WriteOptions{MaxShard: opt.MaxShard, Force: opt.Force}, hf.QuantizedWriter{
		Codec: "GPTQ",
		Linear: func(canon, mod string, q *model.Quantized) ([]safetensors.Entry, error) {
			if err := checkPackable(q); err != nil {
				return nil, err
			}
			g := q.GroupSize
			if g == 0 {
				g = -1
			}
			if qc.Bits == 0 {
				qc.Bits, qc.GroupSize = q.Bits, g
			} else if q.Bits != qc.Bits || g != qc.GroupSize {
				return nil, fmt.Errorf("%d bits, group size %d, others %d bits, group size %d; a GPTQ checkpoint has one of each", q.Bits, g, qc.Bits, qc.GroupSize)
			}
			if q.GIdx != nil {
				qc.DescAct = true
			}
			if q.Zero != nil {
				qc.Sym = false
			}
			return quantEntries(mod, q), nil
		},
		Config: func() (any, error) {
			if qc.Bits == 0 {
				return nil, errors.New("model has no quantized decoder linear; quantize it before writing GPTQ")
			}
			return qc.JSON(), nil
		},
	})
}

// quantEntries makes the four lazily packed tensors of one linear.
func quantEntries(mod string, q *model.Quantized) []safetensors.Entry {
	G := q.Groups()
	return []safetensors.Entry{
		{Name: mod + ".qweight", DType: model.I32, Shape: []int{q.Cols * q.Bits / 32, q.Rows},
			Data: func() ([]byte, error) { return hf.Int32Bytes(packWeight(q)), nil }},
		{Name: mod + ".qzeros", DType: model.I32, Shape: []int{G, q.Rows * q.Bits / 32},
			Data: func() ([]byte, error) { return hf.Int32Bytes(packZeros(q)), nil }},
		{Name: mod + ".scales", DType: model.F16, Shape: []int{G, q.Rows},
			Data: func() ([]byte, error) { return hf.Uint16Bytes(packScales(q)), nil }},
		{Name: mod + ".g_idx", DType: model.I32, Shape: []int{q.Cols},
			Data: func() ([]byte, error) { return hf.Int32Bytes(packGIdx(q)), nil }},
	}
}
