package hf

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"
	"unsafe"

	"qtool/formats/infile"
	"qtool/formats/model"
	"qtool/formats/safetensors"
)

// QuantizedLayout tells OpenQuantized how a codec (AutoAWQ, GPTQ) stores a
// quantized decoder linear inside an HF checkpoint.
type QuantizedLayout struct {
	// Format names the codec in model.Model.Format.
	Format string
	// Parts are the parameter suffixes that together make one quantized
	// linear (".qweight", ".qzeros", ".scales"): all or none must be present.
	Parts []string
	// Extra are optional suffixes that belong to a quantized linear
	// (".g_idx"); present without Parts they are an error.
	Extra []string
	// Read builds the tensor of module (e.g. "model.layers.0.mlp.up_proj").
	Read func(ck *safetensors.Checkpoint, module string) (model.Tensor, error)
}

// OpenQuantized reads an HF checkpoint directory whose decoder linears are
// stored either quantized (as ql describes) or as plain float weights. Every
// other tensor is read as in Open. cfg is the already parsed config.json.
func OpenQuantized(dir string, cfg model.Config, ql QuantizedLayout) (*model.Model, error) {
	ck, err := safetensors.OpenCheckpoint(dir, "model")
	if err != nil {
		return nil, err
	}
	m := model.New(cfg)
	m.Source, m.Format, m.TokenizerDir = dir, ql.Format, dir
	m.AddCloser(ck)
	fail := func(err error) (*model.Model, error) {
		m.Close()
		return nil, err
	}
	partList := strings.Join(ql.Parts, ", ")
	claimed := map[string]bool{}
	for l := 0; l < cfg.Layers; l++ {
		for _, r := range model.Linears {
			mod, _ := Module(l, r)
			n := 0
			for _, s := range ql.Parts {
				if ck.Has(mod + s) {
					n++
				}
			}
			if n == 0 {
				for _, s := range ql.Extra {
					if ck.Has(mod + s) {
						return fail(fmt.Errorf("%s: %s has a %s but none of %s", ck.Path, mod, s, partList))
					}
				}
				continue // a float linear (or missing: CheckShapes says so)
			}
			if n != len(ql.Parts) {
				return fail(fmt.Errorf("%s: %s has only some of %s", ck.Path, mod, partList))
			}
			if ck.Has(mod + ".weight") {
				return fail(fmt.Errorf("%s: %s has both quantized parameters and a float weight", ck.Path, mod))
			}
			t, err := ql.Read(ck, mod)
			if err != nil {
				return fail(err)
			}
			m.Set(model.Name(l, r), t)
			for _, s := range append(ql.Parts, ql.Extra...) {
				claimed[mod+s] = true
			}
		}
	}
	if err := LoadTensors(m, ck, func(n string) bool { return claimed[n] }); err != nil {
		return fail(err)
	}
	if err := m.CheckShapes(); err != nil {
		return fail(err)
	}
	return m, nil
}

// QuantizationConfig returns the JSON of a quantized checkpoint's
// quantization_config from the parsed config.json (raw), or, when it has
// none, the contents of the codec's own file dir/fallback (AutoAWQ's
// quant_config.json, AutoGPTQ's quantize_config.json), with the path it came
// from for error messages. codec names the checkpoint kind in the error.
func QuantizationConfig(dir string, raw map[string]json.RawMessage, fallback, codec string) (data []byte, path string, err error) {
	path = filepath.Join(dir, "config.json")
	data, ok := raw["quantization_config"]
	if ok && strings.TrimSpace(string(data)) != "null" {
		return data, path, nil
	}
	path = filepath.Join(dir, fallback)
	if data, err = infile.ReadFile(path, infile.MetaLimit); err != nil {
		return nil, "", fmt.Errorf("%s: config.json has no quantization_config and there is no %s: not %s checkpoint", dir, fallback, codec)
	}
	return data, path, nil
}

// QuantizedWriter tells WriteQuantized how a codec (AutoAWQ, GPTQ) stores a
// quantized decoder linear inside an HF checkpoint: the mirror of
// QuantizedLayout.
type QuantizedWriter struct {
	// Codec names the format in messages ("AutoAWQ").
	Codec string
	// Linear checks one quantized decoder linear (canonical name canon,
	// HF module mod) and returns its lazily packed tensors; it records
	// what the quantization_config needs (bits, group size, ...).
	Linear func(canon, mod string, q *model.Quantized) ([]safetensors.Entry, error)
	// FloatLinear, if set, is told about each decoder linear kept in float.
	FloatLinear func(mod string)
	// Config returns the quantization_config once every tensor has been
	// seen, or an error when the model cannot be written (no quantized
	// linear).
	Config func() (any, error)
}

// WriteQuantized saves m as an HF checkpoint in dir (created if needed)
// whose quantized decoder linears are stored as qw says; float decoder
// linears stay plain fp16 weights and every other tensor is written as fp16
// (quantized ones dequantized). A model whose q/k rows are in the
// interleaved rope layout is permuted to the HF layout first
// (model.WithRope). W8A8 linears are refused. config.json gets the
// quantization_config and the tokenizer files of m.TokenizerDir are copied.
// maxShard splits the weights into shards of at most this many bytes plus
// model.safetensors.index.json (0: one model.safetensors).
func WriteQuantized(m *model.Model, dir string, opt WriteOptions, qw QuantizedWriter) error {
	m, err := model.WithRope(m, model.RopeHalf)
	if err != nil {
		return fmt.Errorf("write %s: %w", dir, err)
	}
	var entries []safetensors.Entry
	for _, canon := range m.SortedNames() {
		t, _ := m.Lookup(canon)
		layer, role, _ := model.ParseName(canon)
		linear := layer >= 0 && model.IsLinear(role)
		switch v := t.(type) {
		case *model.W8A8:
			return fmt.Errorf("write %s: tensor %q is W8A8 (activation-quantized); %s holds only weight-only linears", dir, canon, qw.Codec)
		case *model.Quantized:
			if !linear {
				break // dequantized below
			}
			mod, _ := Module(layer, role)
			es, err := qw.Linear(canon, mod, v)
			if err != nil {
				return fmt.Errorf("write %s: tensor %q: %w", dir, canon, err)
			}
			entries = append(entries, es...)
			continue
		}
		name, ok := TensorName(canon)
		if !ok {
			return fmt.Errorf("write %s: tensor %q has no Hugging Face name", dir, canon)
		}
		if linear && qw.FloatLinear != nil {
			mod, _ := Module(layer, role)
			qw.FloatLinear(mod)
		}
		entries = append(entries, FloatEntry(name, t, model.F16))
	}
	qc, err := qw.Config()
	if err != nil {
		return fmt.Errorf("write %s: %w", dir, err)
	}
	cfg := m.Config
	cfg.DType = "float16"
	return writeCheckpoint(dir, opt, entries, cfg, map[string]any{"quantization_config": qc}, m.TokenizerDir)
}

// Int32Bytes encodes v little-endian (safetensors I32 data). On a
// little-endian machine that is v's own memory, returned without a copy:
// the caller hands it to the writer and does not change v meanwhile.
func Int32Bytes(v []int32) []byte {
	if b, ok := hostBytes(v); ok {
		return b
	}
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], uint32(x))
	}
	return b
}

// Uint16Bytes encodes v little-endian (the bit patterns of F16 data),
// without a copy on a little-endian machine as Int32Bytes.
func Uint16Bytes(v []uint16) []byte {
	if b, ok := hostBytes(v); ok {
		return b
	}
	b := make([]byte, 2*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint16(b[2*i:], x)
	}
	return b
}

// hostBytes returns v's memory as bytes when that is its little-endian
// encoding (empty v, or a little-endian machine).
func hostBytes[T int32 | uint16](v []T) ([]byte, bool) {
	if len(v) == 0 {
		return []byte{}, true
	}
	if !littleEndianHost() {
		return nil, false
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(&v[0])), len(v)*int(unsafe.Sizeof(v[0]))), true
}

// littleEndianHost reports whether this machine stores integers
// little-endian, as safetensors does.
func littleEndianHost() bool {
	x := uint16(1)
	return *(*byte)(unsafe.Pointer(&x)) == 1
}
