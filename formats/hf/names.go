package hf

import (
	"strconv"
	"strings"

	"qtool/formats/model"
)

// hfLayerPart maps a per-layer role to the HF module path below
// "model.layers.N." and the parameter suffix.
var hfLayerPart = map[model.Role][2]string{
	model.AttnNorm: {"input_layernorm", "weight"},
	model.Q:        {"self_attn.q_proj", "weight"},
	model.K:        {"self_attn.k_proj", "weight"},
	model.V:        {"self_attn.v_proj", "weight"},
	model.O:        {"self_attn.o_proj", "weight"},
	model.QBias:    {"self_attn.q_proj", "bias"},
	model.KBias:    {"self_attn.k_proj", "bias"},
	model.VBias:    {"self_attn.v_proj", "bias"},
	model.QNorm:    {"self_attn.q_norm", "weight"},
	model.KNorm:    {"self_attn.k_norm", "weight"},
	model.MLPNorm:  {"post_attention_layernorm", "weight"},
	model.Gate:     {"mlp.gate_proj", "weight"},
	model.Up:       {"mlp.up_proj", "weight"},
	model.Down:     {"mlp.down_proj", "weight"},
}

var hfGlobal = map[model.Role][2]string{
	model.Embed:     {"model.embed_tokens", "weight"},
	model.FinalNorm: {"model.norm", "weight"},
	model.LMHead:    {"lm_head", "weight"},
}

// Module returns the HF module path of (layer, role), e.g.
// "model.layers.3.self_attn.q_proj"; ok is false for roles HF does not have.
// Quantized codecs append their own parameter names (".qweight",
// ".weight_scale", ...).
func Module(layer int, r model.Role) (string, bool) {
	if layer < 0 {
		p, ok := hfGlobal[r]
		return p[0], ok
	}
	p, ok := hfLayerPart[r]
	if !ok {
		return "", false
	}
	return "model.layers." + strconv.Itoa(layer) + "." + p[0], true
}

// TensorName returns the HF tensor name of a canonical name
// ("layers.3.q" -> "model.layers.3.self_attn.q_proj.weight").
func TensorName(canonical string) (string, bool) {
	layer, r, ok := model.ParseName(canonical)
	if !ok {
		return "", false
	}
	var p [2]string
	if layer < 0 {
		p, ok = hfGlobal[r]
		if !ok {
			return "", false
		}
		return p[0] + "." + p[1], true
	}
	p, ok = hfLayerPart[r]
	if !ok {
		return "", false
	}
	return "model.layers." + strconv.Itoa(layer) + "." + p[0] + "." + p[1], true
}

// CanonicalName maps an HF tensor name to qtool's canonical name.
func CanonicalName(hfName string) (string, bool) {
	for r, p := range hfGlobal {
		if hfName == p[0]+"."+p[1] {
			return model.Name(-1, r), true
		}
	}
	rest, ok := strings.CutPrefix(hfName, "model.layers.")
	if !ok {
		return "", false
	}
	i := strings.IndexByte(rest, '.')
	if i <= 0 {
		return "", false
	}
	layer, err := strconv.Atoi(rest[:i])
	if err != nil || layer < 0 {
		return "", false
	}
	tail := rest[i+1:]
	for r, p := range hfLayerPart {
		if tail == p[0]+"."+p[1] {
			return model.Name(layer, r), true
		}
	}
	return "", false
}
