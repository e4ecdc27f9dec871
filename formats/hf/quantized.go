package hf

import (
	"encoding/json"
	"fmt"
	"path/filepath"
	"strings"

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
