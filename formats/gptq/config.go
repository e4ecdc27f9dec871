package gptq

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
)

// QuantConfig is the "quantization_config" of a GPTQ checkpoint (or the
// content of AutoGPTQ's quantize_config.json).
type QuantConfig struct {
	Bits int
	// GroupSize is the config value: −1 means per-channel.
	GroupSize int
	DescAct   bool
	Sym       bool
	// CheckpointFormat is "gptq" (v1, zero points stored minus one) or
	// "gptq_v2" (read only: zero points stored as they are).
	CheckpointFormat string
}

type rawQuantConfig struct {
	QuantMethod      string          `json:"quant_method"`
	Bits             *int            `json:"bits"`
	GroupSize        *int            `json:"group_size"`
	DescAct          *bool           `json:"desc_act"`
	Sym              *bool           `json:"sym"`
	CheckpointFormat *string         `json:"checkpoint_format"`
	PackDType        string          `json:"pack_dtype"`
	LMHead           *bool           `json:"lm_head"`
	Dynamic          json.RawMessage `json:"dynamic"`
}

// ParseQuantConfig parses and validates a quantization_config object. Every
// setting qtool cannot load faithfully is refused with a message naming what
// is supported.
func ParseQuantConfig(data []byte) (QuantConfig, error) {
	var rc rawQuantConfig
	if err := json.NewDecoder(bytes.NewReader(data)).Decode(&rc); err != nil {
		return QuantConfig{}, fmt.Errorf("quantization_config: not a JSON object: %w", err)
	}
	if m := strings.ToLower(rc.QuantMethod); m != "" && m != "gptq" {
		return QuantConfig{}, fmt.Errorf("quantization_config: quant_method %q is not GPTQ (want \"gptq\")", rc.QuantMethod)
	}
	if rc.Bits == nil {
		return QuantConfig{}, fmt.Errorf("quantization_config: \"bits\" is missing")
	}
	c := QuantConfig{Bits: *rc.Bits, Sym: true, CheckpointFormat: "gptq"}
	if !bitsOK(c.Bits) {
		return QuantConfig{}, fmt.Errorf("quantization_config: bits = %d is not supported (GPTQ bits: 2, 3, 4, 8)", c.Bits)
	}
	if rc.GroupSize == nil {
		return QuantConfig{}, fmt.Errorf("quantization_config: \"group_size\" is missing")
	}
	c.GroupSize = *rc.GroupSize
	if c.GroupSize == 0 || c.GroupSize < -1 || c.GroupSize > 1<<20 {
		return QuantConfig{}, fmt.Errorf("quantization_config: group_size = %d is not supported (want −1 for per-channel or a positive size)", c.GroupSize)
	}
	if rc.DescAct != nil {
		c.DescAct = *rc.DescAct
	}
	if rc.Sym != nil {
		c.Sym = *rc.Sym
	}
	if rc.CheckpointFormat != nil {
		c.CheckpointFormat = strings.ToLower(*rc.CheckpointFormat)
	}
	if c.CheckpointFormat != "gptq" && c.CheckpointFormat != "gptq_v2" {
		return QuantConfig{}, fmt.Errorf("quantization_config: checkpoint_format %q is not supported (want \"gptq\", or \"gptq_v2\" for reading)", c.CheckpointFormat)
	}
	if rc.PackDType != "" && rc.PackDType != "int32" {
		return QuantConfig{}, fmt.Errorf("quantization_config: pack_dtype %q is not supported (only int32)", rc.PackDType)
	}
	if rc.LMHead != nil && *rc.LMHead {
		return QuantConfig{}, fmt.Errorf("quantization_config: lm_head = true (quantized lm_head) is not supported")
	}
	if s := strings.TrimSpace(string(rc.Dynamic)); s != "" && s != "null" && s != "{}" {
		return QuantConfig{}, fmt.Errorf("quantization_config: per-module \"dynamic\" overrides are not supported")
	}
	return c, nil
}

// JSON renders c as the quantization_config GPTQModel/transformers write.
func (c QuantConfig) JSON() map[string]any {
	return map[string]any{
		"quant_method":      "gptq",
		"bits":              c.Bits,
		"group_size":        c.GroupSize,
		"desc_act":          c.DescAct,
		"sym":               c.Sym,
		"checkpoint_format": c.CheckpointFormat,
		"pack_dtype":        "int32",
		"lm_head":           false,
	}
}
