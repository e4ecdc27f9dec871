package msmodelslim

import (
	"encoding/json"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"qtool/formats/model"
	"qtool/formats/safetensors"
)

func TestParseDescription(t *testing.T) {
	tests := []struct {
		name, js, want string
	}{
		{"ok-v0", `{"model_quant_type":"W8A16","model.embed_tokens.weight":"FLOAT","model.layers.0.self_attn.q_proj.weight":"W8A16"}`, ""},
		{"ok-v1", `{"model_quant_type":"W8A8","version":"1.0.0","group_size":0,"kv_quant_type":null,"metadata":{"a":1},"optional":{},"x.weight":"W8A8"}`, ""},
		{"no-type", `{"model.embed_tokens.weight":"FLOAT"}`, "\"model_quant_type\" is missing"},
		{"ok-dynamic", `{"model_quant_type":"W8A8_DYNAMIC","a.weight":"W8A8_DYNAMIC"}`, ""},
		{"ok-sparse", `{"model_quant_type":"W8A8S","a.weight":"W8A8S"}`, ""},
		{"ok-c8", `{"model_quant_type":"W8A8","kv_cache_type":"C8","a.k_proj.kv_cache_scale":"W8A8"}`, ""},
		{"dynamic-w4", `{"model_quant_type":"W4A8_DYNAMIC"}`, "4-bit weights with per-token"},
		{"sparse-compressed", `{"model_quant_type":"W8A8","a.weight":"W8A8SC"}`, "\"a.weight\" is W8A8SC"},
		{"kv-c4", `{"model_quant_type":"W8A8","kv_cache_type":"C4"}`, "KV-cache quantization \"C4\""},
		{"kv-as-type", `{"model_quant_type":"C8"}`, "not a tensor or model type"},
		{"unknown", `{"model_quant_type":"W3A16"}`, "unknown quantization type \"W3A16\""},
		{"float-model", `{"model_quant_type":"FLOAT"}`, "unknown quantization type"},
		{"group-neg", `{"model_quant_type":"W8A16","group_size":-1}`, "non-negative"},
		{"group-str", `{"model_quant_type":"W8A16","group_size":"128"}`, "must be a number"},
		{"non-string", `{"model_quant_type":"W8A16","a.weight":3}`, "\"a.weight\" must be a string"},
		{"array", `["W8A16"]`, "not a JSON object"},
		{"null", `null`, "not a JSON object"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d, err := ParseDescription([]byte(tc.js))
			if tc.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				if d.ModelQuantType == "" || len(d.Types) == 0 {
					t.Fatalf("parsed %+v", d)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to mention %q", err, tc.want)
			}
		})
	}
}

// damaged copies the W8A8 fixture into a new directory, letting edit change
// the description and the tensors.
func damaged(t *testing.T, desc func(map[string]any), edit func([]safetensors.Entry) []safetensors.Entry) string {
	t.Helper()
	src := fixtureDir(t, "llama-mini-w8a8-smooth")
	dir := t.TempDir()
	cfg, err := os.ReadFile(filepath.Join(src, "config.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "config.json"), cfg, 0o644); err != nil {
		t.Fatal(err)
	}
	var d map[string]any
	data, _ := os.ReadFile(filepath.Join(src, DescriptionFile))
	if err := json.Unmarshal(data, &d); err != nil {
		t.Fatal(err)
	}
	if desc != nil {
		desc(d)
	}
	data, _ = json.Marshal(d)
	if err := os.WriteFile(filepath.Join(dir, DescriptionFile), data, 0o644); err != nil {
		t.Fatal(err)
	}
	f, err := safetensors.Open(filepath.Join(src, WeightBaseV0+".safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	var es []safetensors.Entry
	for _, n := range f.Names() {
		x, _ := f.Tensor(n)
		es = append(es, safetensors.DenseEntry(n, x))
	}
	if edit != nil {
		es = edit(es)
	}
	if err := safetensors.Write(filepath.Join(dir, WeightBaseV0+".safetensors"), es, nil); err != nil {
		t.Fatal(err)
	}
	return dir
}

func replace(name string, e safetensors.Entry) func([]safetensors.Entry) []safetensors.Entry {
	return func(es []safetensors.Entry) []safetensors.Entry {
		for i := range es {
			if es[i].Name == name {
				if e.Name == "" {
					return append(es[:i], es[i+1:]...)
				}
				es[i] = e
			}
		}
		return es
	}
}

func zeros(name string, dt model.DType, shape ...int) safetensors.Entry {
	e := safetensors.Entry{Name: name, DType: dt, Shape: shape}
	e.Data = func() ([]byte, error) { return make([]byte, e.Size()), nil }
	return e
}

func TestOpenErrors(t *testing.T) {
	const q = "model.layers.1.self_attn.q_proj"
	tests := []struct {
		name string
		desc func(map[string]any)
		edit func([]safetensors.Entry) []safetensors.Entry
		want string
	}{
		{"no-deq-scale", nil, replace(q+".deq_scale", safetensors.Entry{}), "has no deq_scale"},
		{"deq-scale-shape", nil, replace(q+".deq_scale", zeros(q+".deq_scale", model.F32, 255)), "deq_scale has shape [255]"},
		{"input-scale-shape", nil, replace(q+".input_scale", zeros(q+".input_scale", model.F16, 2)), "want a float tensor of shape [1]"},
		{"input-scale-zero", nil, replace(q+".input_scale", zeros(q+".input_scale", model.F16, 1)), "finite non-zero"},
		{"quant-bias-dtype", nil, replace(q+".quant_bias", zeros(q+".quant_bias", model.F32, 256)), "want I32[256]"},
		{"weight-shape", nil, replace(q+".weight", zeros(q+".weight", model.I8, 256, 128)), "shape"},
		{"desc-says-w8a16", func(d map[string]any) { d[q+".weight"] = "W8A16" }, nil, "description says W8A16"},
		{"desc-dynamic", func(d map[string]any) { d[q+".weight"] = "W8A8_DYNAMIC" }, nil, "description says W8A8_DYNAMIC"},
		{"desc-tensor-sparse-compressed", func(d map[string]any) { d[q+".deq_scale"] = "W8A8SC" }, nil, "W8A8SC"},
		{"sparse-weight-not-int8", func(d map[string]any) { d["model_quant_type"] = "W8A8S"; d[q+".weight"] = "W8A8S" },
			replace(q+".weight", zeros(q+".weight", model.F16, 256, 256)), "is F16 but the description says W8A8S"},
		{"c8-missing", func(d map[string]any) { d["kv_cache_type"] = "C8" }, nil, "layer 0 has no model.layers.0.self_attn.k_proj.kv_cache_scale"},
		{"c8-missing-v-offset", func(d map[string]any) { d["kv_cache_type"] = "C8" }, func(es []safetensors.Entry) []safetensors.Entry {
			for l := 0; l < 4; l++ {
				p := fmt.Sprintf("model.layers.%d.self_attn.", l)
				es = append(es, zeros(p+"k_proj.kv_cache_scale", model.F32, 128), zeros(p+"k_proj.kv_cache_offset", model.F32, 128),
					zeros(p+"v_proj.kv_cache_scale", model.F32, 128))
			}
			return es
		}, `"model.layers.0.self_attn.v_proj.kv_cache_offset" is missing`},
		{"c8-shape", func(d map[string]any) { d["kv_cache_type"] = "C8" }, func(es []safetensors.Entry) []safetensors.Entry {
			p := "model.layers.0.self_attn."
			return append(es, zeros(p+"k_proj.kv_cache_scale", model.F32, 128, 1))
		}, `"model.layers.0.self_attn.k_proj.kv_cache_scale" is F32[128 1], want a float vector [128]`},
		{"c8-dtype", func(d map[string]any) { d["kv_cache_type"] = "C8" }, func(es []safetensors.Entry) []safetensors.Entry {
			p := "model.layers.0.self_attn."
			return append(es, zeros(p+"k_proj.kv_cache_scale", model.I8, 128))
		}, `is I8[128], want a float vector`},
		{"module-bias-alone", nil, replace("model.layers.2.post_attention_layernorm.module.weight", safetensors.Entry{}), "module.bias without"},
		{"module-bias-shape", nil, replace("model.layers.0.input_layernorm.module.bias", zeros("model.layers.0.input_layernorm.module.bias", model.F16, 128)), "want a float [256]"},
		{"kv-cache", nil, func(es []safetensors.Entry) []safetensors.Entry {
			return append(es, zeros("model.layers.0.self_attn.k_proj.kv_cache_scale", model.F32, 128))
		}, "kv_cache_scale"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := damaged(t, tc.desc, tc.edit)
			m, err := Open(dir)
			if err == nil {
				m.Close()
				t.Fatalf("Open succeeded, want an error mentioning %q", tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to mention %q", err, tc.want)
			}
		})
	}
	if _, err := Open(t.TempDir()); err == nil {
		t.Error("Open of an empty directory succeeded")
	}
}

func TestWriteErrors(t *testing.T) {
	m, err := Open(fixtureDir(t, "llama-mini-w8a8-smooth"))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	a, _ := m.Layer(0, model.Q)
	w8 := a.(*model.W8A8)
	bad := *w8
	bad.QuantBias = bad.QuantBias[:10]
	m.Set(model.Name(0, model.Q), &bad)
	if err := Write(m, t.TempDir(), WriteOptions{}); err == nil || !strings.Contains(err.Error(), "quant_bias") {
		t.Errorf("short quant_bias: err = %v", err)
	}
	withBias := *w8
	withBias.Bias = make([]float32, w8.Weight.Rows)
	m.Set(model.Name(0, model.Q), &withBias)
	if err := Write(m, t.TempDir(), WriteOptions{}); err == nil || !strings.Contains(err.Error(), "inside quant_bias") {
		t.Errorf("separate W8A8 bias: err = %v", err)
	}
	q3 := &model.Quantized{Bits: 3, Rows: 256, Cols: 256, Q: make([]int8, 256*256), Scale: make([]float32, 256)}
	m.Set(model.Name(0, model.Q), q3)
	if err := Write(m, t.TempDir(), WriteOptions{}); err == nil || !strings.Contains(err.Error(), "3 bits") {
		t.Errorf("3-bit: err = %v", err)
	}
	m.Set(model.Name(0, model.Q), w8)
	m.Set("layers.0.attn_norm_bias_x", model.FromFloat32([]int{1}, []float32{0}))
	if err := Write(m, t.TempDir(), WriteOptions{}); err == nil || !strings.Contains(err.Error(), "no Hugging Face name") {
		t.Errorf("unknown tensor: err = %v", err)
	}
}

func FuzzParseDescription(f *testing.F) {
	for _, name := range []string{"llama-mini-w8a8-smooth"} {
		if data, err := os.ReadFile(filepath.Join(testdata, "msmodelslim", name, DescriptionFile)); err == nil {
			f.Add(data)
		}
	}
	f.Add([]byte(`{"model_quant_type":"W8A16","group_size":128,"version":"1.0.0","a.weight":"W8A16","b.weight":"FLOAT"}`))
	f.Add([]byte(`{"model_quant_type":"W8A8","kv_cache_type":"C8","metadata":{}}`))
	f.Add([]byte(`{"model_quant_type":"W4A16","group_size":1e3}`))
	f.Add([]byte(`{"model_quant_type":"W8A8S","a.weight":"W8A8S","kv_quant_type":"C8"}`))
	f.Add([]byte(`{"model_quant_type":"W8A8_DYNAMIC","a.weight":"W8A8_DYNAMIC","a.weight_scale":"W8A8_DYNAMIC"}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		d, err := ParseDescription(data)
		if err != nil {
			return
		}
		// what parses must re-serialize to an equivalent description
		out, err := d.Marshal(nil)
		if err != nil {
			t.Fatal(err)
		}
		d2, err := ParseDescription(out)
		if err != nil {
			t.Fatalf("re-parse of %s: %v", out, err)
		}
		if d2.ModelQuantType != d.ModelQuantType || d2.GroupSize != d.GroupSize || len(d2.Types) != len(d.Types) {
			t.Fatalf("re-parse changed %+v into %+v", d, d2)
		}
		for k, v := range d.Types {
			if d2.Types[k] != v {
				t.Fatalf("type of %q changed from %q to %q", k, v, d2.Types[k])
			}
		}
	})
}
