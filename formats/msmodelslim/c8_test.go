package msmodelslim

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"qtool/formats/model"
	"qtool/formats/safetensors"
)

func TestKVCacheNames(t *testing.T) {
	for _, tc := range []struct {
		attn, merged string
		want         [4]string
	}{
		{"model.layers.0.self_attn", "", [4]string{
			"model.layers.0.self_attn.k_proj.kv_cache_scale", "model.layers.0.self_attn.k_proj.kv_cache_offset",
			"model.layers.0.self_attn.v_proj.kv_cache_scale", "model.layers.0.self_attn.v_proj.kv_cache_offset"}},
		// seed 001's example: q/k/v merged into query_key_value
		{"transformer.encoder.layers.0.self_attention", "query_key_value", [4]string{
			"transformer.encoder.layers.0.self_attention.query_key_value.k_proj.kv_cache_scale",
			"transformer.encoder.layers.0.self_attention.query_key_value.k_proj.kv_cache_offset",
			"transformer.encoder.layers.0.self_attention.query_key_value.v_proj.kv_cache_scale",
			"transformer.encoder.layers.0.self_attention.query_key_value.v_proj.kv_cache_offset"}},
	} {
		if got := KVCacheNames(tc.attn, tc.merged); got != tc.want {
			t.Errorf("KVCacheNames(%q, %q) = %v, want %v", tc.attn, tc.merged, got, tc.want)
		}
	}
}

// kvEntries are the four KV-cache tensors of every llama-mini layer under
// a merged linear's names (merged "") with the kv_offset spelling when
// alias is set, scales 0.01·(1+c%7), offsets c%5−2.
func kvEntries(merged string, alias bool) []safetensors.Entry {
	var es []safetensors.Entry
	for l := 0; l < 4; l++ {
		for i, n := range KVCacheNames(fmt.Sprintf("model.layers.%d.self_attn", l), merged) {
			v := make([]float32, 128)
			for c := range v {
				if i%2 == 0 {
					v[c] = 0.01 * float32(1+c%7)
				} else {
					v[c] = float32(c%5 - 2)
				}
			}
			if alias && i%2 == 1 {
				n = n[:len(n)-len("kv_cache_offset")] + "kv_offset"
			}
			es = append(es, safetensors.DenseEntry(n, model.FromFloat32([]int{128}, v)))
		}
	}
	return es
}

// TestReadC8Names reads the W8A8 fixture with KV-cache tensors added under
// the separate and the merged names (and seed 001's "kv_offset").
func TestReadC8Names(t *testing.T) {
	for _, tc := range []struct {
		name, merged string
		alias        bool
	}{{"separate", "", false}, {"merged qkv", "query_key_value", false}, {"kv_offset spelling", "", true}} {
		t.Run(tc.name, func(t *testing.T) {
			dir := damaged(t, func(d map[string]any) { d["kv_cache_type"] = "C8" }, func(es []safetensors.Entry) []safetensors.Entry {
				return append(es, kvEntries(tc.merged, tc.alias)...)
			})
			m, err := Open(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			if !m.HasKVCacheInt8() {
				t.Fatal("no KV-cache quantizers read")
			}
			off, _ := m.Layer(3, model.VCacheOffset)
			v, _ := off.Float32()
			if v[6] != -1 {
				t.Errorf("layers.3.v_cache_offset[6] = %g, want −1", v[6])
			}
		})
	}
}

// TestWriteC8SparseDynamic round-trips a model with an int8 KV cache,
// W8A8S linears (layer 0) and W8A8_DYNAMIC linears (layer 1) and checks
// the description and the tensor layout.
func TestWriteC8SparseDynamic(t *testing.T) {
	m, err := Open(fixtureDir(t, "llama-mini-w8a8-smooth"))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	r := rand.New(rand.NewPCG(1, 2))
	for l := 0; l < m.Config.Layers; l++ {
		for _, role := range model.KVCacheRoles {
			v := make([]float32, m.Config.KVDim())
			for c := range v {
				v[c] = float32(0.001 + r.Float64())
			}
			m.Set(model.Name(l, role), model.FromFloat32([]int{len(v)}, v))
		}
	}
	for _, role := range model.Linears {
		t0, _ := m.Layer(0, role)
		a := *t0.(*model.W8A8)
		a.Sparse = true
		m.Set(model.Name(0, role), &a)
		t1, _ := m.Layer(1, role)
		m.Set(model.Name(1, role), &model.W8A8{Weight: t1.(*model.W8A8).Weight, Dynamic: true})
	}
	dir := t.TempDir() + "/out"
	if err := Write(m, dir, WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	types, h := readLayout(t, dir, WeightBaseV0)
	for name, want := range map[string]string{
		"kv_cache_type":                                  `"C8"`,
		"model_quant_type":                               `"W8A8"`,
		"model.layers.0.self_attn.q_proj.weight":         `"W8A8S"`,
		"model.layers.0.self_attn.q_proj.deq_scale":      `"W8A8S"`,
		"model.layers.1.mlp.down_proj.weight":            `"W8A8_DYNAMIC"`,
		"model.layers.1.mlp.down_proj.weight_scale":      `"W8A8_DYNAMIC"`,
		"model.layers.2.self_attn.v_proj.weight":         `"W8A8"`,
		"model.layers.2.self_attn.k_proj.kv_cache_scale": `"W8A8"`,
	} {
		if types[name] != want {
			t.Errorf("description %s = %s, want %s", name, types[name], want)
		}
	}
	for name, want := range map[string]string{
		"model.layers.1.mlp.down_proj.weight_scale":       "F32 [256 1]",
		"model.layers.1.mlp.down_proj.weight_offset":      "F32 [256 1]",
		"model.layers.3.self_attn.v_proj.kv_cache_offset": "F32 [128]",
	} {
		if got := fmt.Sprint(h[name].DType, " ", h[name].Shape); got != want {
			t.Errorf("%s is %s, want %s", name, got, want)
		}
	}
	if _, ok := h["model.layers.1.mlp.down_proj.input_scale"]; ok {
		t.Error("a dynamic linear was written with an input_scale")
	}
	back, err := Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer back.Close()
	equalModels(t, m, back)
}
