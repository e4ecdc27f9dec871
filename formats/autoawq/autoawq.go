package autoawq

import (
	"encoding/json"
	"errors"
	"fmt"

	"qtool/formats/hf"
	"qtool/formats/model"
	"qtool/formats/safetensors"
)

// Format is the model.Model.Format of models read by Open.
const Format = "autoawq"

// ReadQuantConfig returns the AutoAWQ quantization config of dir: the
// "quantization_config" of config.json, or AutoAWQ's own quant_config.json
// when config.json has none.
func ReadQuantConfig(dir string, raw map[string]json.RawMessage) (QuantConfig, error) {
	data, path, err := hf.QuantizationConfig(dir, raw, "quant_config.json", "an AutoAWQ")
	if err != nil {
		return QuantConfig{}, err
	}
	qc, err := ParseQuantConfig(data)
	if err != nil {
		return QuantConfig{}, fmt.Errorf("%s: %w", path, err)
	}
	return qc, nil
}

// Open reads an AutoAWQ GEMM checkpoint directory: config.json with its
// quantization_config, and model.safetensors or shards with an index. Each
// decoder linear stored as qweight/qzeros/scales becomes a *model.Quantized
// (4 bits, the config's group size, zero points always set); linears stored
// as plain weights (modules_to_not_convert) and every other tensor stay
// dense, aliasing the memory-mapped files until the model is closed.
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
		Extra:  nil,
		Read: func(ck *safetensors.Checkpoint, mod string) (model.Tensor, error) {
			return readLinear(ck, mod, qc.GroupSize)
		},
	})
}

// readLinear reads one module's qweight [in, out/8], qzeros [in/g, out/8]
// and scales [in/g, out].
func readLinear(ck *safetensors.Checkpoint, mod string, group int) (*model.Quantized, error) {
	qw, err := ck.Tensor(mod + ".qweight")
	if err != nil {
		return nil, err
	}
	qz, err := ck.Tensor(mod + ".qzeros")
	if err != nil {
		return nil, err
	}
	sc, err := ck.Tensor(mod + ".scales")
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
	in, out := qw.Dims[0], sc.Dims[1]
	if qw.Dims[1]*PackFactor != out || qz.Dims[1]*PackFactor != out || sc.Dims[0]*group != in || qz.Dims[0] != sc.Dims[0] {
		return nil, fmt.Errorf("%s: %s: qweight %v, qzeros %v, scales %v do not fit one [in, out] layer with group size %d (want [in, out/8], [in/g, out/8], [in/g, out])",
			ck.Path, mod, qw.Dims, qz.Dims, sc.Dims, group)
	}
	wv, _ := qw.Int32s()
	zv, _ := qz.Int32s()
	sv, err := sc.Float32()
	if err != nil {
		return nil, fmt.Errorf("%s: %s.scales: %w", ck.Path, mod, err)
	}
	if err := checkLengths(len(wv), len(zv), len(sv), in, out, group); err != nil {
		return nil, fmt.Errorf("%s: %s: %w", ck.Path, mod, err)
	}
	return unpack(wv, zv, sv, in, out, group), nil
}

// WriteOptions controls Write.
type WriteOptions struct {
	// MaxShard splits the weights into shards of at most this many bytes
	// plus model.safetensors.index.json (0: one model.safetensors).
	MaxShard int64
	// Force replaces a dir that is not empty (see hf.WriteDir).
	Force bool
}

// Write saves m as an AutoAWQ GEMM checkpoint in dir.
// Every *model.Quantized decoder linear must be 4-bit with one common group
// size and no g_idx; its scales are rounded to fp16 (see Pack). Float decoder
// linears are written as plain fp16 weights and listed in
// modules_to_not_convert. Every other tensor is written as fp16 (quantized
// ones dequantized first). config.json gets the quantization_config and the
// tokenizer files of m.TokenizerDir are copied. dir appears complete or not
// at all (hf.WriteDir).
func Write(m *model.Model, dir string, opt WriteOptions) error {
	qc := QuantConfig{Bits: 4, ZeroPoint: true, Version: "gemm"}
	return hf.WriteQuantized(m, dir, hf.WriteOptions{MaxShard: opt.MaxShard, Force: opt.Force}, hf.QuantizedWriter{
		Codec: "AutoAWQ",
		Linear: func(canon, mod string, q *model.Quantized) ([]safetensors.Entry, error) {
			if err := checkPackable(q); err != nil {
				return nil, err
			}
			if qc.GroupSize == 0 {
				qc.GroupSize = q.GroupSize
			} else if q.GroupSize != qc.GroupSize {
				return nil, fmt.Errorf("group size %d but others have %d; an AutoAWQ checkpoint has one group_size", q.GroupSize, qc.GroupSize)
			}
			return quantEntries(mod, q), nil
		},
		FloatLinear: func(mod string) { qc.ModulesToNotConvert = append(qc.ModulesToNotConvert, mod) },
		Config: func() (any, error) {
			if qc.GroupSize == 0 {
				return nil, errors.New("model has no 4-bit quantized decoder linear; quantize it before writing AutoAWQ")
			}
			return qc.JSON(), nil
		},
	})
}

// quantEntries makes the three lazily packed tensors of one linear.
func quantEntries(mod string, q *model.Quantized) []safetensors.Entry {
	G := q.Groups()
	ow := q.Rows / PackFactor
	return []safetensors.Entry{
		{Name: mod + ".qweight", DType: model.I32, Shape: []int{q.Cols, ow},
			Data: func() ([]byte, error) { return hf.Int32Bytes(packWeight(q)), nil }},
		{Name: mod + ".qzeros", DType: model.I32, Shape: []int{G, ow},
			Data: func() ([]byte, error) {
				z, err := packZeros(q)
				if err != nil {
					return nil, fmt.Errorf("%s: %w", mod, err)
				}
				return hf.Int32Bytes(z), nil
			}},
		{Name: mod + ".scales", DType: model.F16, Shape: []int{G, q.Rows},
			Data: func() ([]byte, error) {
				s, err := packScales(q)
				if err != nil {
					return nil, fmt.Errorf("%s: %w", mod, err)
				}
				return hf.Uint16Bytes(s), nil
			}},
	}
}
