// Package hf reads and writes Hugging Face checkpoints: config.json plus
// safetensors weights (single file or sharded), for LlamaForCausalLM,
// Qwen2ForCausalLM and Qwen3ForCausalLM. It also owns the mapping between HF
// tensor names and qtool's canonical names, which the other HF-derived
// codecs (msmodelslim, AutoAWQ, GPTQ) reuse.
package hf

import (
	"encoding/json"
	"fmt"
	"math"
	"sort"
	"strings"

	"qtool/formats/model"
)

// Supported lists the architectures this package maps, by their HF class name.
var Supported = map[string]model.Arch{
	"LlamaForCausalLM": model.Llama,
	"Qwen2ForCausalLM": model.Qwen2,
	"Qwen3ForCausalLM": model.Qwen3,
}

func supportedList() string {
	names := make([]string, 0, len(Supported))
	for n := range Supported {
		names = append(names, n)
	}
	sort.Strings(names)
	return strings.Join(names, ", ")
}

// rawConfig is the subset of config.json qtool reads.
type rawConfig struct {
	Architectures     []string        `json:"architectures"`
	ModelType         string          `json:"model_type"`
	HiddenSize        *int            `json:"hidden_size"`
	IntermediateSize  *int            `json:"intermediate_size"`
	NumLayers         *int            `json:"num_hidden_layers"`
	NumHeads          *int            `json:"num_attention_heads"`
	NumKVHeads        *int            `json:"num_key_value_heads"`
	HeadDim           *int            `json:"head_dim"`
	VocabSize         *int            `json:"vocab_size"`
	MaxPos            *int            `json:"max_position_embeddings"`
	RopeTheta         *float64        `json:"rope_theta"`
	RopeParameters    *ropeParameters `json:"rope_parameters"`
	RopeScaling       json.RawMessage `json:"rope_scaling"`
	RMSNormEps        *float64        `json:"rms_norm_eps"`
	TieWordEmbeddings *bool           `json:"tie_word_embeddings"`
	AttentionBias     *bool           `json:"attention_bias"`
	MLPBias           *bool           `json:"mlp_bias"`
	HiddenAct         string          `json:"hidden_act"`
	TorchDType        string          `json:"torch_dtype"`
	DType             string          `json:"dtype"`
	BOS               json.RawMessage `json:"bos_token_id"`
	EOS               json.RawMessage `json:"eos_token_id"`
}

type ropeParameters struct {
	RopeTheta *float64 `json:"rope_theta"`
	RopeType  string   `json:"rope_type"`
}

// ParseConfig maps the JSON of a config.json to a model config. file names
// the source in errors.
func ParseConfig(file string, data []byte) (model.Config, error) {
	var rc rawConfig
	if err := json.Unmarshal(data, &rc); err != nil {
		return model.Config{}, fmt.Errorf("%s: not a valid config.json: %w", file, err)
	}
	if len(rc.Architectures) == 0 {
		return model.Config{}, fmt.Errorf("%s: no \"architectures\" entry (supported: %s)", file, supportedList())
	}
	arch, ok := Supported[rc.Architectures[0]]
	if !ok {
		return model.Config{}, fmt.Errorf("%s: unsupported architecture %q (supported: %s)", file, rc.Architectures[0], supportedList())
	}
	need := func(name string, p *int) (int, error) {
		if p == nil {
			return 0, fmt.Errorf("%s: %q is missing", file, name)
		}
		return *p, nil
	}
	c := model.Config{Arch: arch, BOS: -1}
	var err error
	for _, f := range []struct {
		name string
		p    *int
		dst  *int
	}{
		{"hidden_size", rc.HiddenSize, &c.Hidden},
		{"intermediate_size", rc.IntermediateSize, &c.Intermediate},
		{"num_hidden_layers", rc.NumLayers, &c.Layers},
		{"num_attention_heads", rc.NumHeads, &c.Heads},
		{"vocab_size", rc.VocabSize, &c.Vocab},
	} {
		if *f.dst, err = need(f.name, f.p); err != nil {
			return model.Config{}, err
		}
	}
	c.KVHeads = c.Heads
	if rc.NumKVHeads != nil {
		c.KVHeads = *rc.NumKVHeads
	}
	if c.Heads <= 0 {
		return model.Config{}, fmt.Errorf("%s: num_attention_heads = %d, want > 0", file, c.Heads)
	}
	// Defaults for absent keys: head_dim hidden/heads and 2048 positions
	// (LlamaConfig's), but transformers' Qwen3Config says head_dim 128 and
	// 32768 positions.
	c.HeadDim, c.MaxSeq = c.Hidden/c.Heads, 2048
	if arch == model.Qwen3 {
		c.HeadDim, c.MaxSeq = 128, 32768
	}
	if rc.HeadDim != nil && *rc.HeadDim > 0 {
		c.HeadDim = *rc.HeadDim
	}
	if rc.MaxPos != nil {
		c.MaxSeq = *rc.MaxPos
	}
	c.RopeTheta = 10000
	switch {
	case rc.RopeParameters != nil && rc.RopeParameters.RopeTheta != nil:
		c.RopeTheta = *rc.RopeParameters.RopeTheta
		if t := rc.RopeParameters.RopeType; t != "" && t != "default" {
			return model.Config{}, fmt.Errorf("%s: rope_parameters.rope_type %q is not supported (only \"default\")", file, t)
		}
	case rc.RopeTheta != nil:
		c.RopeTheta = *rc.RopeTheta
	}
	if s := strings.TrimSpace(string(rc.RopeScaling)); s != "" && s != "null" {
		return model.Config{}, fmt.Errorf("%s: rope_scaling %s is not supported", file, s)
	}
	c.NormEps = 1e-6
	if rc.RMSNormEps != nil {
		c.NormEps = *rc.RMSNormEps
	}
	if rc.TieWordEmbeddings != nil {
		c.Tied = *rc.TieWordEmbeddings
	}
	switch arch {
	case model.Qwen2:
		c.AttnBias = true
	case model.Qwen3:
		c.QKNorm = true
	}
	if rc.AttentionBias != nil && arch != model.Qwen2 {
		c.AttnBias = *rc.AttentionBias
	}
	if rc.MLPBias != nil && *rc.MLPBias {
		return model.Config{}, fmt.Errorf("%s: mlp_bias = true is not supported", file)
	}
	if rc.HiddenAct != "" && rc.HiddenAct != "silu" {
		return model.Config{}, fmt.Errorf("%s: hidden_act %q is not supported (only silu)", file, rc.HiddenAct)
	}
	c.DType = rc.TorchDType
	if rc.DType != "" {
		c.DType = rc.DType
	}
	if c.BOS, err = firstID(rc.BOS); err != nil {
		return model.Config{}, fmt.Errorf("%s: bos_token_id: %w", file, err)
	}
	if c.EOS, err = idList(rc.EOS); err != nil {
		return model.Config{}, fmt.Errorf("%s: eos_token_id: %w", file, err)
	}
	if err := c.Validate(); err != nil {
		return model.Config{}, fmt.Errorf("%s: %w", file, err)
	}
	return c, nil
}

func idList(raw json.RawMessage) ([]int, error) {
	s := strings.TrimSpace(string(raw))
	if s == "" || s == "null" {
		return nil, nil
	}
	var one int
	if err := json.Unmarshal(raw, &one); err == nil {
		return []int{one}, nil
	}
	var many []int
	if err := json.Unmarshal(raw, &many); err != nil {
		return nil, fmt.Errorf("want an integer or a list of integers, got %s", s)
	}
	return many, nil
}

func firstID(raw json.RawMessage) (int, error) {
	ids, err := idList(raw)
	if err != nil || len(ids) == 0 {
		return -1, err
	}
	return ids[0], nil
}

// MarshalConfig renders c as a config.json in the transformers style. extra
// keys (such as "quantization_config") are added at the top level.
func MarshalConfig(c model.Config, extra map[string]any) ([]byte, error) {
	class := ""
	for n, a := range Supported {
		if a == c.Arch {
			class = n
		}
	}
	if class == "" {
		return nil, fmt.Errorf("config.json: architecture %q has no HF class", c.Arch)
	}
	m := map[string]any{
		"architectures":           []string{class},
		"model_type":              string(c.Arch),
		"hidden_size":             c.Hidden,
		"intermediate_size":       c.Intermediate,
		"num_hidden_layers":       c.Layers,
		"num_attention_heads":     c.Heads,
		"num_key_value_heads":     c.KVHeads,
		"head_dim":                c.HeadDim,
		"vocab_size":              c.Vocab,
		"max_position_embeddings": c.MaxSeq,
		"rope_theta":              c.RopeTheta,
		"rms_norm_eps":            c.NormEps,
		"tie_word_embeddings":     c.Tied,
		"hidden_act":              "silu",
		"torch_dtype":             c.DType,
	}
	if c.Arch == model.Llama {
		m["attention_bias"] = c.AttnBias
		m["mlp_bias"] = false
	}
	if c.BOS >= 0 {
		m["bos_token_id"] = c.BOS
	} else {
		m["bos_token_id"] = nil
	}
	switch len(c.EOS) {
	case 0:
		m["eos_token_id"] = nil
	case 1:
		m["eos_token_id"] = c.EOS[0]
	default:
		m["eos_token_id"] = c.EOS
	}
	for k, v := range extra {
		m[k] = v
	}
	if math.IsNaN(c.RopeTheta) || math.IsNaN(c.NormEps) {
		return nil, fmt.Errorf("config.json: NaN in rope_theta or rms_norm_eps")
	}
	b, err := json.MarshalIndent(m, "", "  ")
	if err != nil {
		return nil, err
	}
	return append(b, '\n'), nil
}
