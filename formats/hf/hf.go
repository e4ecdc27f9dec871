package hf

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"io"
	"maps"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"

	"qtool/formats/atomicfile"
	"qtool/formats/infile"
	"qtool/formats/model"
	"qtool/formats/safetensors"
)

// ReadConfig reads dir/config.json. raw holds every top-level key for codecs
// that need more (such as "quantization_config").
func ReadConfig(dir string) (cfg model.Config, raw map[string]json.RawMessage, err error) {
	path := filepath.Join(dir, "config.json")
	data, err := infile.ReadFile(path, infile.MetaLimit)
	if err != nil {
		return model.Config{}, nil, fmt.Errorf("%s: no config.json: %w", dir, err)
	}
	cfg, err = ParseConfig(path, data)
	if err != nil {
		return model.Config{}, nil, err
	}
	if err := json.Unmarshal(data, &raw); err != nil {
		return model.Config{}, nil, fmt.Errorf("%s: %w", path, err)
	}
	return cfg, raw, nil
}

// ignored are HF tensors with no role in qtool's model (recomputed buffers).
func ignored(name string) bool { return strings.HasSuffix(name, "rotary_emb.inv_freq") }

// Open reads an HF float checkpoint directory. Tensors alias the memory-mapped
// safetensors files until the model is closed.
func Open(dir string) (*model.Model, error) {
	cfg, raw, err := ReadConfig(dir)
	if err != nil {
		return nil, err
	}
	if q, ok := raw["quantization_config"]; ok && string(q) != "null" {
		return nil, fmt.Errorf("%s: config.json has a quantization_config (%s); open it with the matching quantized codec (autoawq or gptq)", dir, abbreviate(q))
	}
	ck, err := safetensors.OpenCheckpoint(dir, "model")
	if err != nil {
		return nil, err
	}
	m := model.New(cfg)
	m.Source, m.Format, m.TokenizerDir = dir, "hf", dir
	m.AddCloser(ck)
	if err := LoadTensors(m, ck, nil); err != nil {
		m.Close()
		return nil, err
	}
	if err := m.CheckShapes(); err != nil {
		m.Close()
		return nil, err
	}
	return m, nil
}

// LoadTensors adds every tensor of ck that has a canonical name to m.
// skip, when not nil, claims names handled by the caller (quantized
// parameters, say); any other unknown tensor is an error.
func LoadTensors(m *model.Model, ck *safetensors.Checkpoint, skip func(name string) bool) error {
	for _, name := range ck.Names() {
		if skip != nil && skip(name) {
			continue
		}
		canon, ok := CanonicalName(name)
		if !ok {
			if ignored(name) {
				continue
			}
			return fmt.Errorf("%s: tensor %q is not part of a %s model", ck.Path, name, m.Config.Arch)
		}
		if canon == model.Name(-1, model.LMHead) && m.Config.Tied {
			continue // some checkpoints store the tied head anyway
		}
		d, err := ck.Tensor(name)
		if err != nil {
			return err
		}
		if !d.DType.IsFloat() {
			return fmt.Errorf("%s: tensor %q has dtype %v, want a float type", ck.Path, name, d.DType)
		}
		m.Set(canon, d)
	}
	return nil
}

func abbreviate(b []byte) string {
	s := string(b)
	if len(s) > 80 {
		s = s[:80] + "…"
	}
	return s
}

// WriteOptions controls Write.
type WriteOptions struct {
	// DType of the written float tensors: F32, F16 or BF16. Zero keeps each
	// dense tensor's own dtype (quantized tensors are dequantized to F32).
	DType model.DType
	// MaxShard splits the weights into shards of at most this many bytes (0: one file).
	MaxShard int64
	// Force replaces a dir that is not empty (see atomicfile.WriteDir).
	Force bool
}

// Write saves m as an HF float checkpoint in dir: config.json,
// model.safetensors (or shards and an index) and the tokenizer files found
// in m.TokenizerDir. Quantized tensors are dequantized. A model whose q/k
// rows are in the interleaved rope layout is permuted to the HF layout
// first (model.WithRope). dir appears complete or not at all (see
// atomicfile.WriteDir: a dir that is not empty is replaced only with
// opt.Force).
func Write(m *model.Model, dir string, opt WriteOptions) error {
	m, err := model.WithRope(m, model.RopeHalf)
	if err != nil {
		return fmt.Errorf("write %s: %w", dir, err)
	}
	cfg := m.Config
	switch opt.DType {
	case model.F32:
		cfg.DType = "float32"
	case model.F16:
		cfg.DType = "float16"
	case model.BF16:
		cfg.DType = "bfloat16"
	case 0:
	default:
		return fmt.Errorf("write %s: dtype %v is not a float type for HF weights", dir, opt.DType)
	}
	var entries []safetensors.Entry
	for _, canon := range m.SortedNames() {
		name, ok := TensorName(canon)
		if !ok {
			return fmt.Errorf("write %s: tensor %q has no HF name", dir, canon)
		}
		t, _ := m.Lookup(canon)
		entries = append(entries, FloatEntry(name, t, opt.DType))
	}
	return writeCheckpoint(dir, opt, entries, cfg, nil, m.TokenizerDir)
}

// writeCheckpoint writes the weights (shards of at most opt.MaxShard bytes,
// 0: one file), config.json of cfg with the extra keys, and the tokenizer
// files of tokDir as the checkpoint directory dir (WriteModelDir).
func writeCheckpoint(dir string, opt WriteOptions, entries []safetensors.Entry, cfg model.Config, extra map[string]any, tokDir string) error {
	js, err := MarshalConfig(cfg, extra)
	if err != nil {
		return err
	}
	return WriteModelDir(dir, opt.Force, ModelFiles{Base: "model", Entries: entries, Metadata: map[string]string{"format": "pt"},
		MaxShard: opt.MaxShard, Files: map[string][]byte{"config.json": js}, TokenizerDir: tokDir})
}

// ModelFiles is what WriteModelDir writes into a checkpoint directory.
type ModelFiles struct {
	Base     string // weights file base name: "model" → model.safetensors
	Entries  []safetensors.Entry
	Metadata map[string]string // safetensors __metadata__
	MaxShard int64             // see safetensors.WriteCheckpoint
	// Files are small files by name: config.json, a description, ...
	Files map[string][]byte
	// TokenizerDir's tokenizer files are copied (none when empty).
	TokenizerDir string
}

// WriteModelDir writes f into dir as one unit (see WriteDir): the weights,
// the small files and the tokenizer.
func WriteModelDir(dir string, force bool, f ModelFiles) error {
	return WriteDir(dir, force, func(tmp string) error {
		if err := safetensors.WriteCheckpoint(tmp, f.Base, f.Entries, f.Metadata, f.MaxShard); err != nil {
			return err
		}
		for _, name := range slices.Sorted(maps.Keys(f.Files)) {
			if err := WriteFile(filepath.Join(tmp, name), f.Files[name]); err != nil {
				return err
			}
		}
		return CopyTokenizer(f.TokenizerDir, tmp)
	})
}

// WriteDir writes a checkpoint directory as one unit: fill writes into a
// staging directory that then replaces dir (atomicfile.WriteDir: dir
// appears complete or not at all; a dir that is not empty is replaced only
// with force, and only when it holds a model).
func WriteDir(dir string, force bool, fill func(tmp string) error) error {
	return atomicfile.WriteDir(dir, force, fill)
}

// FloatEntry makes a lazily converted safetensors entry for t in dtype dt
// (0: a dense tensor keeps its dtype, anything else becomes F32).
func FloatEntry(name string, t model.Tensor, dt model.DType) safetensors.Entry {
	d, isDense := t.(*model.Dense)
	if dt == 0 {
		if isDense && d.DType.IsFloat() {
			return safetensors.DenseEntry(name, d)
		}
		dt = model.F32
	}
	if isDense && d.DType == dt {
		return safetensors.DenseEntry(name, d)
	}
	return safetensors.Entry{Name: name, DType: dt, Shape: t.Shape(), Data: func() ([]byte, error) {
		v, err := t.Float32()
		if err != nil {
			return nil, fmt.Errorf("tensor %q: %w", name, err)
		}
		return EncodeFloats(v, dt), nil
	}}
}

// EncodeFloats converts v to little-endian bytes of dt (F32, F16 or BF16).
func EncodeFloats(v []float32, dt model.DType) []byte {
	switch dt {
	case model.F16:
		b := make([]byte, 2*len(v))
		for i, x := range v {
			binary.LittleEndian.PutUint16(b[2*i:], model.Float32ToF16(x))
		}
		return b
	case model.BF16:
		b := make([]byte, 2*len(v))
		for i, x := range v {
			binary.LittleEndian.PutUint16(b[2*i:], model.Float32ToBF16(x))
		}
		return b
	default:
		b := make([]byte, 4*len(v))
		for i, x := range v {
			binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
		}
		return b
	}
}

// TokenizerFiles are the files CopyTokenizer carries along.
var TokenizerFiles = []string{"tokenizer.model", "tokenizer.json", "tokenizer_config.json",
	"special_tokens_map.json", "generation_config.json", "vocab.json", "merges.txt"}

// CopyTokenizer copies the tokenizer files present in src into dst. An empty
// src copies nothing.
func CopyTokenizer(src, dst string) error {
	if src == "" || filepath.Clean(src) == filepath.Clean(dst) {
		return nil
	}
	for _, name := range TokenizerFiles {
		in, _, err := infile.Open(filepath.Join(src, name))
		if os.IsNotExist(err) {
			continue
		}
		if err != nil {
			return err
		}
		out, err := atomicfile.Create(filepath.Join(dst, name))
		if err != nil {
			in.Close()
			return err
		}
		_, err = io.Copy(out, in)
		in.Close()
		if err == nil {
			err = out.Commit()
		}
		out.Abort()
		if err != nil {
			return fmt.Errorf("copy %s: %w", name, err)
		}
	}
	return nil
}

// WriteFile writes data to path atomically (atomicfile.WriteFile).
func WriteFile(path string, data []byte) error { return atomicfile.WriteFile(path, data) }
