package autoawq

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strings"
)

// QuantConfig is the "quantization_config" of an AutoAWQ checkpoint.
type QuantConfig struct {
	Bits      int
	GroupSize int
	ZeroPoint bool
	// Version is the lower-cased packing version; only "gemm" is supported.
	Version string
	// ModulesToNotConvert lists module-name substrings left unquantized.
	ModulesToNotConvert []string
}

type rawQuantConfig struct {
	QuantMethod         string          `json:"quant_method"`
	Bits                *int            `json:"bits"`
	WBit                *int            `json:"w_bit"`
	GroupSize           *int            `json:"group_size"`
	QGroupSize          *int            `json:"q_group_size"`
	ZeroPoint           *bool           `json:"zero_point"`
	Version             *string         `json:"version"`
	Backend             string          `json:"backend"`
	ModulesToNotConvert json.RawMessage `json:"modules_to_not_convert"`
}

// ParseQuantConfig parses and validates the JSON of a quantization_config
// object (or of AutoAWQ's quant_config.json, which spells the keys w_bit and
// q_group_size). Everything qtool cannot load faithfully is refused with a
// message saying what is supported.
func ParseQuantConfig(data []byte) (QuantConfig, error) {
	var rc rawQuantConfig
	dec := json.NewDecoder(bytes.NewReader(data))
	if err := dec.Decode(&rc); err != nil {
		return QuantConfig{}, fmt.Errorf("quantization_config: not a JSON object: %w", err)
	}
	if m := strings.ToLower(rc.QuantMethod); m != "" && m != "awq" {
		return QuantConfig{}, fmt.Errorf("quantization_config: quant_method %q is not AutoAWQ (want \"awq\")", rc.QuantMethod)
	}
	if rc.Backend != "" && strings.ToLower(rc.Backend) != "autoawq" {
		return QuantConfig{}, fmt.Errorf("quantization_config: backend %q is not supported (only the AutoAWQ GEMM layout; llm-awq uses a different packing)", rc.Backend)
	}
	var c QuantConfig
	switch {
	case rc.Bits != nil:
		c.Bits = *rc.Bits
	case rc.WBit != nil:
		c.Bits = *rc.WBit
	default:
		return QuantConfig{}, fmt.Errorf("quantization_config: \"bits\" is missing")
	}
	if c.Bits != 4 {
		return QuantConfig{}, fmt.Errorf("quantization_config: bits = %d is not supported by the AutoAWQ GEMM layout (only 4)", c.Bits)
	}
	switch {
	case rc.GroupSize != nil:
		c.GroupSize = *rc.GroupSize
	case rc.QGroupSize != nil:
		c.GroupSize = *rc.QGroupSize
	default:
		return QuantConfig{}, fmt.Errorf("quantization_config: \"group_size\" is missing")
	}
	if c.GroupSize <= 0 || c.GroupSize > 1<<20 {
		return QuantConfig{}, fmt.Errorf("quantization_config: group_size = %d is not supported (AutoAWQ GEMM needs a positive group size)", c.GroupSize)
	}
	if rc.ZeroPoint == nil {
		return QuantConfig{}, fmt.Errorf("quantization_config: \"zero_point\" is missing")
	}
	c.ZeroPoint = *rc.ZeroPoint
	if !c.ZeroPoint {
		return QuantConfig{}, fmt.Errorf("quantization_config: zero_point = false is not supported (AutoAWQ GEMM checkpoints carry zero points)")
	}
	c.Version = "gemm"
	if rc.Version != nil {
		c.Version = strings.ToLower(*rc.Version)
	}
	if c.Version != "gemm" {
		return QuantConfig{}, fmt.Errorf("quantization_config: version %q is not supported (only \"gemm\"; GEMV, exllama, ipex and marlin pack differently)", c.Version)
	}
	if s := strings.TrimSpace(string(rc.ModulesToNotConvert)); s != "" && s != "null" {
		if err := json.Unmarshal(rc.ModulesToNotConvert, &c.ModulesToNotConvert); err != nil {
			return QuantConfig{}, fmt.Errorf("quantization_config: modules_to_not_convert must be a list of strings or null: %w", err)
		}
	}
	return c, nil
}

// JSON renders c as the quantization_config AutoAWQ/transformers write.
func (c QuantConfig) JSON() map[string]any {
	var mods any
	if len(c.ModulesToNotConvert) > 0 {
		mods = c.ModulesToNotConvert
	}
	return map[string]any{
		"quant_method":           "awq",
		"bits":                   c.Bits,
		"group_size":             c.GroupSize,
		"zero_point":             c.ZeroPoint,
		"version":                c.Version,
		"modules_to_not_convert": mods,
	}
}
