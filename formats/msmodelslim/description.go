package msmodelslim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"maps"
	"slices"
	"sort"
	"strconv"
	"strings"
)

// Tensor types of quant_model_description.json that qtool reads and writes.
const (
	TypeFloat = "FLOAT" // unquantized tensor
	TypeW8A16 = "W8A16" // int8 weight, float activations
	TypeW4A16 = "W4A16" // int4 values in int8 containers (msmodelslim v0), float activations
	TypeW8A8  = "W8A8"  // static int8 weight and per-tensor int8 activations
	// TypeW8A8S is W8A8 from sparse quantization: the W8A8 layout (weight,
	// input_scale, input_offset, deq_scale, quant_bias), many weights zero.
	TypeW8A8S = "W8A8S"
	// TypeW8A8Dynamic is int8 weights with per-token dynamic int8
	// activations: weight, weight_scale [n,1], weight_offset [n,1] (zeros).
	TypeW8A8Dynamic = "W8A8_DYNAMIC"
	// KVCacheC8 is the kv_cache_type of an int8 KV cache.
	KVCacheC8 = "C8"
)

// unsupported names msmodelslim types qtool refuses, with the reason.
var unsupported = map[string]string{
	"W8A8SC":       "sparse-compressed W8A8 needs the compressed sparse weight layout",
	"W4A8_DYNAMIC": "4-bit weights with per-token int8 activations have no qtool tensor type",
	"W8A8_MIX":     "mixed static/dynamic W8A8 has no qtool tensor type",
	"W4A4":         "4-bit activations have no qtool tensor type",
	"C8":           "C8 is a KV-cache type (kv_cache_type), not a tensor or model type",
	"FA3":          "attention quantization is not supported",
}

// supportedTypes lists the tensor types qtool reads, for error messages.
const supportedTypes = "W8A16, W4A16, W8A8 static, W8A8S, W8A8_DYNAMIC, FLOAT"

// Description is a parsed quant_model_description.json: the overall
// quantization type and the type of every tensor of the weights file.
type Description struct {
	ModelQuantType string
	Version        string // "" when absent (msmodelslim v0 files have none)
	GroupSize      int    // 0 when absent or per-channel
	// KVCacheType is "kv_cache_type" (v0) or "kv_quant_type" (v1), "" when
	// the KV cache is not quantized.
	KVCacheType string
	// Types maps each tensor name to its type ("FLOAT", "W8A16", ...).
	Types map[string]string
}

// ParseDescription parses quant_model_description.json. It accepts the v0
// layout of seed 001 and the v1 additions (version, group_size, metadata,
// optional) and refuses the quantization types qtool cannot represent.
func ParseDescription(data []byte) (*Description, error) {
	var raw map[string]json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.UseNumber()
	if err := dec.Decode(&raw); err != nil {
		return nil, fmt.Errorf("quant_model_description.json: not a JSON object: %w", err)
	}
	if raw == nil {
		return nil, fmt.Errorf("quant_model_description.json: not a JSON object")
	}
	d := &Description{Types: map[string]string{}}
	str := func(key string, msg json.RawMessage) (string, error) {
		var s string
		if err := json.Unmarshal(msg, &s); err != nil {
			return "", fmt.Errorf("quant_model_description.json: %q must be a string, got %s", key, abbreviate(msg))
		}
		return s, nil
	}
	for _, key := range slices.Sorted(maps.Keys(raw)) { // sorted: the same fault is named on every run
		msg := raw[key]
		var err error
		switch key {
		case "model_quant_type":
			d.ModelQuantType, err = str(key, msg)
		case "version":
			d.Version, err = str(key, msg)
		case "kv_cache_type", "kv_quant_type":
			if s := strings.TrimSpace(string(msg)); s != "null" {
				d.KVCacheType, err = str(key, msg)
			}
		case "group_size":
			var n json.Number
			if t := bytes.TrimSpace(msg); len(t) > 0 && t[0] == '"' {
				return nil, fmt.Errorf("quant_model_description.json: group_size must be a number, got %s", abbreviate(msg))
			}
			if err = json.Unmarshal(msg, &n); err != nil {
				return nil, fmt.Errorf("quant_model_description.json: group_size must be a number, got %s", abbreviate(msg))
			}
			g, perr := strconv.ParseInt(n.String(), 10, 32)
			if perr != nil || g < 0 {
				return nil, fmt.Errorf("quant_model_description.json: group_size %s is not a non-negative integer", n)
			}
			d.GroupSize = int(g)
		case "metadata", "optional":
			// free-form objects of msmodelslim v1; nothing qtool needs
		default:
			s, serr := str(key, msg)
			if serr != nil {
				return nil, serr
			}
			d.Types[key] = s
		}
		if err != nil {
			return nil, err
		}
	}
	if d.ModelQuantType == "" {
		return nil, fmt.Errorf("quant_model_description.json: \"model_quant_type\" is missing")
	}
	if err := checkType("model_quant_type", d.ModelQuantType, false); err != nil {
		return nil, err
	}
	if d.KVCacheType != "" && d.KVCacheType != KVCacheC8 {
		return nil, fmt.Errorf("quant_model_description.json: KV-cache quantization %q is not supported (supported: C8, int8 per channel)", d.KVCacheType)
	}
	names := make([]string, 0, len(d.Types))
	for n := range d.Types {
		names = append(names, n)
	}
	sort.Strings(names)
	for _, n := range names {
		if err := checkType(n, d.Types[n], true); err != nil {
			return nil, err
		}
	}
	return d, nil
}

func checkType(key, t string, floatOK bool) error {
	switch t {
	case TypeW8A16, TypeW4A16, TypeW8A8, TypeW8A8S, TypeW8A8Dynamic:
		return nil
	case TypeFloat:
		if floatOK {
			return nil
		}
	}
	if why, ok := unsupported[t]; ok {
		return fmt.Errorf("quant_model_description.json: %q is %s: %s (supported: %s)", key, t, why, supportedTypes)
	}
	return fmt.Errorf("quant_model_description.json: %q has unknown quantization type %q (supported: %s)", key, t, supportedTypes)
}

// Marshal renders d with "model_quant_type" (and group_size when set) first,
// then the tensors in the given order (tensors not in order follow, sorted).
func (d *Description) Marshal(order []string) ([]byte, error) {
	var b bytes.Buffer
	b.WriteString("{\n")
	first := true
	put := func(k string, v any) error {
		kb, err := json.Marshal(k)
		if err != nil {
			return err
		}
		vb, err := json.Marshal(v)
		if err != nil {
			return err
		}
		if !first {
			b.WriteString(",\n")
		}
		first = false
		b.WriteString(" ")
		b.Write(kb)
		b.WriteString(": ")
		b.Write(vb)
		return nil
	}
	if err := put("model_quant_type", d.ModelQuantType); err != nil {
		return nil, err
	}
	if d.Version != "" {
		if err := put("version", d.Version); err != nil {
			return nil, err
		}
	}
	if d.GroupSize > 0 {
		if err := put("group_size", d.GroupSize); err != nil {
			return nil, err
		}
	}
	if d.KVCacheType != "" {
		if err := put("kv_cache_type", d.KVCacheType); err != nil {
			return nil, err
		}
	}
	done := map[string]bool{}
	for _, n := range order {
		if t, ok := d.Types[n]; ok && !done[n] {
			done[n] = true
			if err := put(n, t); err != nil {
				return nil, err
			}
		}
	}
	var rest []string
	for n := range d.Types {
		if !done[n] {
			rest = append(rest, n)
		}
	}
	sort.Strings(rest)
	for _, n := range rest {
		if err := put(n, d.Types[n]); err != nil {
			return nil, err
		}
	}
	b.WriteString("\n}\n")
	return b.Bytes(), nil
}

func abbreviate(b []byte) string {
	s := string(b)
	if len(s) > 60 {
		s = s[:60] + "…"
	}
	return s
}
