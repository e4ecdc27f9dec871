package convert

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"sort"
	"strings"

	"qtool/formats/autoawq"
	"qtool/formats/gptq"
	"qtool/formats/hf"
	"qtool/formats/infile"
	"qtool/formats/kuiper"
	"qtool/formats/model"
	"qtool/formats/msmodelslim"
	"qtool/formats/shard"
)

// Codec is one entry of the formats registry: how to recognise, read and
// write one model format, and what it can hold. Every command, Open, Save
// and the tensor-parallel loader go through this one table.
type Codec struct {
	// Name is the canonical name: what --to and --format print and take,
	// and the model.Model Format of models the codec reads.
	Name string
	// Aliases are other accepted spellings, older names included.
	Aliases []string
	// Kind is what Detect reports for it.
	Kind Kind
	// Doc describes the format in one line.
	Doc string
	// Float is set for formats that store float weights: writing a
	// quantized model dequantizes it. It names the precision ("fp16").
	Float string

	// detect reports whether the path probed by pr holds this format,
	// reading no weights. An error means the path is of this kind but
	// cannot be read.
	detect func(pr *probe) (bool, error)
	open   func(path string, opt Options) (*model.Model, error)
	// write saves a model that holds passed; nil for read-only codecs.
	write func(m *model.Model, out string, opt SaveOptions, p *profile) error
	// holds reports why the format cannot hold a model (nil: it can).
	holds func(p *profile) error
	rope  ropePolicy
	// kvCache: the format holds an int8 KV cache's quantizers (C8).
	kvCache bool
	// early codecs are tried first by DetectCodec: their marker files
	// (manifest.json, quant_model_description.json) may sit beside a
	// config.json.
	early bool
}

// ropePolicy says which q/k row layouts a format stores.
type ropePolicy int

const (
	// ropeHalfOnly: HF-style checkpoints hold the "rotate half" layout only;
	// their writers permute interleaved models.
	ropeHalfOnly ropePolicy = iota
	// ropeKeep: the format records either layout; by default the model's
	// own is kept.
	ropeKeep
	// ropeLlama2c: llama2.c's formats; either layout is recorded in the
	// sidecar, and Llama models default to the interleaved layout that
	// llama2.c's run.c (which reads no sidecar) uses.
	ropeLlama2c
)

// Canonical format names (see Codecs for the aliases).
const (
	FormatHF          = "hf"                  // float safetensors; quantized weights dequantized (F32)
	FormatAutoAWQ     = "autoawq"             // AutoAWQ GEMM: 4-bit per-group linears
	FormatGPTQ        = "gptq"                // GPTQ v1: 2/3/4/8-bit linears, act-order g_idx allowed
	FormatMsModelSlim = "msmodelslim"         // W8A16 / W4A16 / W8A8
	FormatKuiperFP32  = string(kuiper.FP32)   // Kuiper / llama2.c legacy fp32 (version 0, no magic)
	FormatKuiperInt8  = string(kuiper.Int8)   // Kuiper int8 (export.py --version 3)
	FormatAK42V1      = string(kuiper.AK42V1) // llama2.c ak42 version 1 (fp32)
	FormatAK42V2      = string(kuiper.AK42V2) // llama2.c ak42 version 2 (Q8_0)
	FormatAK47        = string(kuiper.AK47)   // OrinMLLM ak47 (version 4): Qwen3 fp16
	FormatAK48        = string(kuiper.AK48)   // OrinMLLM ak48 (version 5): Qwen3 AWQ int4
	FormatShard       = "shard"               // qtool tensor-parallel shard directory
)

// codecs is the registry, in the order Detect tries directories and
// refusals list formats.
var codecs = []*Codec{
	{Name: FormatHF, Aliases: []string{"safetensors"}, Kind: KindHF, Float: "float",
		Doc:    "Hugging Face safetensors checkpoint (F32/F16/BF16, single or sharded)",
		detect: func(pr *probe) (bool, error) { m, ok, err := pr.quantMethod(); return ok && m == "", err },
		open:   func(path string, _ Options) (*model.Model, error) { return hf.Open(path) },
		write: func(m *model.Model, out string, opt SaveOptions, _ *profile) error {
			return hf.Write(m, out, hf.WriteOptions{Force: opt.Force})
		},
		holds: func(p *profile) error { return p.noNormBias() }},
	{Name: FormatAutoAWQ, Aliases: []string{"awq"}, Kind: KindAutoAWQ,
		Doc:    "AutoAWQ GEMM checkpoint (4-bit per-group)",
		detect: func(pr *probe) (bool, error) { m, ok, err := pr.quantMethod(); return ok && m == "awq", err },
		open:   func(path string, _ Options) (*model.Model, error) { return autoawq.Open(path) },
		write: func(m *model.Model, out string, opt SaveOptions, _ *profile) error {
			return autoawq.Write(m, out, autoawq.WriteOptions{Force: opt.Force})
		},
		holds: holdsAutoAWQ},
	{Name: FormatGPTQ, Kind: KindGPTQ,
		Doc:    "GPTQ v1 checkpoint (2/3/4/8 bits, act-order g_idx)",
		detect: func(pr *probe) (bool, error) { m, ok, err := pr.quantMethod(); return ok && m == "gptq", err },
		open:   func(path string, _ Options) (*model.Model, error) { return gptq.Open(path) },
		write: func(m *model.Model, out string, opt SaveOptions, _ *profile) error {
			return gptq.Write(m, out, gptq.WriteOptions{Force: opt.Force})
		},
		holds: holdsGPTQ},
	{Name: FormatMsModelSlim, Kind: KindMsModelSlim, early: true, kvCache: true,
		Doc: "msmodelslim directory (W8A16, W4A16, W8A8/W8A8S/W8A8_DYNAMIC + SmoothQuant norms, C8 KV cache)",
		detect: func(pr *probe) (bool, error) {
			return pr.dir && pr.has("quant_model_description.json"), nil
		},
		open: func(path string, _ Options) (*model.Model, error) { return msmodelslim.Open(path) },
		write: func(m *model.Model, out string, opt SaveOptions, _ *profile) error {
			return msmodelslim.Write(m, out, msmodelslim.WriteOptions{Force: opt.Force})
		},
		holds: holdsMsModelSlim},
	{Name: FormatShard, Aliases: []string{"qtool-shard"}, Kind: KindShard, rope: ropeKeep, early: true,
		Doc:    "qtool tensor-parallel shard directory (manifest.json + rank-N.safetensors)",
		detect: func(pr *probe) (bool, error) { return pr.dir && shard.IsDir(pr.path), nil },
		open: func(path string, _ Options) (*model.Model, error) {
			m, _, err := shard.OpenModel(path)
			return m, err
		},
		write: func(m *model.Model, out string, opt SaveOptions, _ *profile) error {
			if opt.TP < 1 {
				return fmt.Errorf("convert %s: a shard directory needs the number of ranks (qtool shard --tp N)", out)
			}
			_, err := shard.WriteWith(m, opt.TP, out, shard.WriteOptions{Force: opt.Force})
			return err
		},
		holds: func(*profile) error { return nil }},
	kuiperCodec(kuiper.FP32, []string{"fp32"}, "fp32", ropeLlama2c,
		"Kuiper / llama2.c legacy fp32 file (version 0, no magic)", (*profile).noNormBias),
	kuiperCodec(kuiper.Int8, []string{"q8", "int8"}, "", ropeKeep,
		"Kuiper int8 file (export.py --version 3, symmetric per-group int8)", holdsInt8),
	kuiperCodec(kuiper.AK42V1, []string{"kuiper-ak42-v1"}, "fp32", ropeLlama2c,
		"llama2.c ak42 version 1 file (fp32)", (*profile).noNormBias),
	kuiperCodec(kuiper.AK42V2, []string{"kuiper-ak42-v2"}, "", ropeLlama2c,
		"llama2.c ak42 version 2 file (Q8_0)", holdsInt8),
	kuiperCodec(kuiper.AK47, []string{"ak47-v4", "kuiper-ak47", "kuiper-v4", "v4"}, "fp16", ropeKeep,
		"OrinMLLM ak47 (version 4) file: Qwen3 fp16", holdsAK47),
	kuiperCodec(kuiper.AK48, []string{"ak48-v5", "kuiper-ak48", "kuiper-v5", "v5"}, "", ropeKeep,
		"OrinMLLM ak48 (version 5) file: Qwen3 AWQ int4", holdsAK48),
}

// kuiperCodec makes the codec of one Kuiper / llama2.c / OrinMLLM layout.
func kuiperCodec(f kuiper.Format, aliases []string, float string, rope ropePolicy, doc string, holds func(*profile) error) *Codec {
	return &Codec{Name: string(f), Aliases: aliases, Kind: KindKuiper, Float: float, Doc: doc, rope: rope, holds: holds,
		detect: func(pr *probe) (bool, error) {
			info, err := pr.kuiperInfo()
			return err == nil && info.Header.Format == f, err
		},
		open: func(path string, opt Options) (*model.Model, error) { return kuiper.Open(path, opt.Kuiper) },
		write: func(m *model.Model, out string, opt SaveOptions, p *profile) error {
			ko := opt.Kuiper
			ko.Format, ko.Rope, ko.GroupSize, ko.QtoolOnly = f, *opt.Rope, opt.GroupSize, opt.QtoolOnly
			if ko.GroupSize == 0 && (f == kuiper.Int8 || f == kuiper.AK42V2 || f == kuiper.AK48) {
				ko.GroupSize = p.group
			}
			return kuiper.Write(m, out, ko)
		}}
}

// Codecs returns the registry in its order.
func Codecs() []*Codec { return append([]*Codec(nil), codecs...) }

// Lookup finds the codec of a format name or alias ("ak48", "awq", "q8",
// "kuiper-v5", ...), case-insensitively.
func Lookup(format string) (*Codec, error) {
	f := strings.ToLower(strings.TrimSpace(format))
	for _, c := range codecs {
		if c.Name == f {
			return c, nil
		}
	}
	var aliases []string
	for _, c := range codecs {
		for _, a := range c.Aliases {
			if a == f {
				return c, nil
			}
			aliases = append(aliases, a)
		}
	}
	sort.Strings(aliases)
	return nil, fmt.Errorf("unknown format %q (known: %s; aliases: %s)", format, strings.Join(Formats(), ", "), strings.Join(aliases, ", "))
}

// Formats returns the canonical names of the formats Save writes.
func Formats() []string {
	var names []string
	for _, c := range codecs {
		if c.write != nil {
			names = append(names, c.Name)
		}
	}
	return names
}

// CanonicalFormat resolves a format name or alias to its canonical name.
func CanonicalFormat(format string) (string, error) {
	c, err := Lookup(format)
	if err != nil {
		return "", err
	}
	return c.Name, nil
}

// DefaultRope is the q/k layout Save writes m in when SaveOptions.Rope is
// nil: HF-style checkpoints hold the half layout only; llama2.c's formats
// (kuiper-fp32, ak42-v1, ak42-v2) take Llama models interleaved, as
// llama2.c's run.c expects; the other formats keep the model's layout
// (and record it).
func (c *Codec) DefaultRope(cfg model.Config) model.RopeLayout {
	switch c.rope {
	case ropeHalfOnly:
		return model.RopeHalf
	case ropeLlama2c:
		if cfg.Arch == model.Llama {
			return model.RopeInterleaved
		}
	}
	return cfg.Rope
}

// probe is what Detect learns about a path, read at most once however
// many codecs ask.
type probe struct {
	path string
	dir  bool
	opt  Options

	cfgRead   bool
	method    string
	hasConfig bool
	cfgErr    error

	kuiperRead bool
	info       *kuiper.Info
	kuiperErr  error
}

func (pr *probe) has(name string) bool {
	_, err := os.Stat(filepath.Join(pr.path, name))
	return err == nil
}

// quantMethod reads config.json of a directory: ok is false when there is
// none; method is its quantization_config.quant_method ("" when absent).
func (pr *probe) quantMethod() (method string, ok bool, err error) {
	if !pr.dir {
		return "", false, nil
	}
	if !pr.cfgRead {
		pr.cfgRead = true
		file := filepath.Join(pr.path, "config.json")
		data, err := infile.ReadFile(file, infile.MetaLimit)
		if err == nil {
			pr.hasConfig = true
			var raw struct {
				Q *struct {
					Method string `json:"quant_method"`
				} `json:"quantization_config"`
			}
			if err := json.Unmarshal(data, &raw); err != nil {
				pr.cfgErr = fmt.Errorf("%s: %w", file, err)
			} else if raw.Q != nil {
				pr.method = raw.Q.Method
				if pr.method != "awq" && pr.method != "gptq" {
					pr.cfgErr = fmt.Errorf("%s: quantization_config.quant_method %q is not supported (supported: awq, gptq)", pr.path, pr.method)
				}
			}
		}
	}
	return pr.method, pr.hasConfig, pr.cfgErr
}

func (pr *probe) kuiperInfo() (*kuiper.Info, error) {
	if pr.dir {
		return nil, errNotMine
	}
	if !pr.kuiperRead {
		pr.kuiperRead = true
		pr.info, pr.kuiperErr = kuiper.DecodeHeader(pr.path, pr.opt.Kuiper)
	}
	return pr.info, pr.kuiperErr
}

// errNotMine tells DetectCodec to try the next codec.
var errNotMine = errors.New("not this format")

// DetectCodec finds the codec that reads path, reading no weights.
func DetectCodec(path string, opt Options) (*Codec, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, err
	}
	pr := &probe{path: path, dir: fi.IsDir(), opt: opt}
	order := Codecs()
	sort.SliceStable(order, func(i, j int) bool { return order[i].early && !order[j].early })
	for _, c := range order {
		ok, err := c.detect(pr)
		if errors.Is(err, errNotMine) {
			continue
		}
		if err != nil {
			return nil, err
		}
		if ok {
			return c, nil
		}
	}
	if pr.dir {
		return nil, fmt.Errorf("%s: not a model directory: it needs config.json (Hugging Face, AutoAWQ, GPTQ), quant_model_description.json (msmodelslim) or %s (qtool shard)", path, shard.ManifestFile)
	}
	return nil, fmt.Errorf("%s: no codec recognises the file", path)
}

// Scheme describes a quantization result before it exists (what a
// calibration command will produce), enough to check the output format
// before any work is done.
type Scheme struct {
	Arch     model.Arch
	AttnBias bool // attention biases (Qwen2)
	Bits     int
	Group    int // 0: per row
	Sym      bool
	W8A8     bool // int8 weights and int8 activations
	// KVInt8: the result carries an int8 KV cache (C8).
	KVInt8 bool
}

// profile is a stand-in profile of a model quantized as s.
func (s Scheme) profile() *profile {
	p := &profile{cfg: model.Config{Arch: s.Arch, AttnBias: s.AttnBias, QKNorm: s.Arch == model.Qwen3}, group: s.Group}
	l := linearInfo{name: "each linear", kind: linQuant, bits: s.Bits, group: s.Group, sym: s.Sym}
	if s.W8A8 {
		l = linearInfo{name: "each linear", kind: linW8A8, bits: 8, sym: true, w8a8: &model.W8A8{}}
		p.nW8A8 = 1
	} else {
		p.nQuant = 1
	}
	p.linears = []linearInfo{l}
	p.kvInt8 = s.KVInt8
	return p
}

// CanHoldScheme reports why format cannot hold a model quantized as s (nil
// when it can). Float formats, which would dequantize the result, and
// shard directories (qtool shard splits a written model) refuse.
func CanHoldScheme(format string, s Scheme) error {
	c, err := Lookup(format)
	if err != nil {
		return err
	}
	return c.holdsScheme(s)
}

func (c *Codec) holdsScheme(s Scheme) error {
	switch {
	case c.Float != "":
		return fmt.Errorf("%s is a %s format and holds no quantized weights", c.Name, c.Float)
	case c.write == nil || c.Kind == KindShard:
		return fmt.Errorf("%s is not an output of quantization (write a model, then split it with qtool shard)", c.Name)
	}
	return c.canHold(s.profile())
}

// SchemeHolders lists the canonical formats that can hold a model
// quantized as s.
func SchemeHolders(s Scheme) []string {
	var can []string
	for _, c := range codecs {
		if c.holdsScheme(s) == nil {
			can = append(can, c.Name)
		}
	}
	return can
}

// CheckShape reports why format should not be written for a model of
// config cfg although it can hold its tensors: a Kuiper, llama2.c or
// OrinMLLM file that those readers would not run as this model
// (kuiper.ReaderCompatible) unless qtoolOnly. The quantizers ask before
// they calibrate.
func CheckShape(format string, cfg model.Config, qtoolOnly bool) error {
	c, err := Lookup(format)
	if err != nil {
		return err
	}
	if c.Kind != KindKuiper || qtoolOnly {
		return nil
	}
	if err := kuiper.ReaderCompatible(kuiper.Format(c.Name), cfg); err != nil {
		return fmt.Errorf("%s: %w; ask for a file only qtool reads (--qtool-only) to write it anyway", c.Name, err)
	}
	return nil
}
