package hf

import (
	"bytes"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"qtool/formats/model"
)

const llamaCfg = `{"architectures":["LlamaForCausalLM"],"hidden_size":256,"intermediate_size":768,
"num_hidden_layers":4,"num_attention_heads":4,"num_key_value_heads":2,"head_dim":64,"vocab_size":4096,
"rms_norm_eps":1e-05,"rope_parameters":{"rope_theta":10000.0,"rope_type":"default"},"tie_word_embeddings":false,
"dtype":"float16","bos_token_id":1,"eos_token_id":2}`

func TestParseConfig(t *testing.T) {
	cases := []struct {
		name string
		json string
		want model.Config
	}{
		{"llama transformers-5 style", llamaCfg, model.Config{Arch: model.Llama, Hidden: 256, Intermediate: 768, Layers: 4,
			Heads: 4, KVHeads: 2, HeadDim: 64, Vocab: 4096, MaxSeq: 2048, RopeTheta: 1e4, NormEps: 1e-5, BOS: 1, EOS: []int{2}, DType: "float16"}},
		{"qwen3 older style, head_dim != hidden/heads, tied", `{"architectures":["Qwen3ForCausalLM"],"hidden_size":256,
"intermediate_size":768,"num_hidden_layers":2,"num_attention_heads":8,"num_key_value_heads":2,"head_dim":64,
"vocab_size":4096,"rope_theta":1000000.0,"rms_norm_eps":1e-6,"tie_word_embeddings":true,"torch_dtype":"bfloat16",
"bos_token_id":null,"eos_token_id":[0,5],"max_position_embeddings":40960}`, model.Config{Arch: model.Qwen3, Hidden: 256,
			Intermediate: 768, Layers: 2, Heads: 8, KVHeads: 2, HeadDim: 64, Vocab: 4096, MaxSeq: 40960, RopeTheta: 1e6,
			NormEps: 1e-6, Tied: true, QKNorm: true, BOS: -1, EOS: []int{0, 5}, DType: "bfloat16"}},
		{"qwen2 biases, defaults for kv heads and head_dim", `{"architectures":["Qwen2ForCausalLM"],"hidden_size":128,
"intermediate_size":256,"num_hidden_layers":1,"num_attention_heads":4,"vocab_size":100}`, model.Config{Arch: model.Qwen2,
			Hidden: 128, Intermediate: 256, Layers: 1, Heads: 4, KVHeads: 4, HeadDim: 32, Vocab: 100, MaxSeq: 2048,
			RopeTheta: 1e4, NormEps: 1e-6, AttnBias: true, BOS: -1}},
		{"qwen3 without head_dim and max_position_embeddings: transformers' Qwen3Config defaults", `{"architectures":["Qwen3ForCausalLM"],
"hidden_size":1024,"intermediate_size":3072,"num_hidden_layers":1,"num_attention_heads":16,"num_key_value_heads":8,"vocab_size":100}`,
			model.Config{Arch: model.Qwen3, Hidden: 1024, Intermediate: 3072, Layers: 1, Heads: 16, KVHeads: 8, HeadDim: 128,
				Vocab: 100, MaxSeq: 32768, RopeTheta: 1e4, NormEps: 1e-6, QKNorm: true, BOS: -1}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			got, err := ParseConfig("config.json", []byte(c.json))
			if err != nil {
				t.Fatal(err)
			}
			if !reflect.DeepEqual(got, c.want) {
				t.Fatalf("got  %+v\nwant %+v", got, c.want)
			}
		})
	}
}

func TestParseConfigErrors(t *testing.T) {
	cases := []struct{ name, json, want string }{
		{"unknown arch", `{"architectures":["MistralForCausalLM"]}`, `unsupported architecture "MistralForCausalLM" (supported: LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)`},
		{"no arch", `{}`, `no "architectures"`},
		{"not json", `{`, "not a valid config.json"},
		{"missing hidden", `{"architectures":["LlamaForCausalLM"]}`, `"hidden_size" is missing`},
		{"gqa mismatch", strings.Replace(llamaCfg, `"num_key_value_heads":2`, `"num_key_value_heads":3`, 1), "not a multiple"},
		{"rope scaling", strings.Replace(llamaCfg, `"dtype"`, `"rope_scaling":{"type":"yarn"},"dtype"`, 1), "rope_scaling"},
		{"bad eos", strings.Replace(llamaCfg, `"eos_token_id":2`, `"eos_token_id":"x"`, 1), "eos_token_id"},
		{"zero heads", strings.Replace(llamaCfg, `"num_attention_heads":4`, `"num_attention_heads":0`, 1), "num_attention_heads"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := ParseConfig("dir/config.json", []byte(c.json))
			if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "dir/config.json") {
				t.Fatalf("err = %v, want it to name the file and contain %q", err, c.want)
			}
		})
	}
}

func TestNameMapping(t *testing.T) {
	for _, c := range []struct{ canon, hf string }{
		{"embed", "model.embed_tokens.weight"},
		{"lm_head", "lm_head.weight"},
		{"norm", "model.norm.weight"},
		{"layers.3.q", "model.layers.3.self_attn.q_proj.weight"},
		{"layers.0.k_bias", "model.layers.0.self_attn.k_proj.bias"},
		{"layers.12.q_norm", "model.layers.12.self_attn.q_norm.weight"},
		{"layers.1.mlp_norm", "model.layers.1.post_attention_layernorm.weight"},
		{"layers.2.down", "model.layers.2.mlp.down_proj.weight"},
	} {
		if got, ok := TensorName(c.canon); !ok || got != c.hf {
			t.Errorf("TensorName(%q) = %q, want %q", c.canon, got, c.hf)
		}
		if got, ok := CanonicalName(c.hf); !ok || got != c.canon {
			t.Errorf("CanonicalName(%q) = %q, want %q", c.hf, got, c.canon)
		}
	}
	for _, bad := range []string{"model.layers.x.mlp.down_proj.weight", "model.layers.1.mlp.foo.weight", "foo"} {
		if _, ok := CanonicalName(bad); ok {
			t.Errorf("CanonicalName(%q) accepted", bad)
		}
	}
}

func TestOpenAndWriteRoundTrip(t *testing.T) {
	for _, dir := range []string{"../../testdata/llama-mini", "../../testdata/qwen3-mini"} {
		t.Run(filepath.Base(dir), func(t *testing.T) {
			m, err := Open(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			wantN := 3 + 9*m.Config.Layers
			if m.Config.Tied {
				wantN--
			}
			if m.Config.QKNorm {
				wantN += 2 * m.Config.Layers
			}
			if len(m.Names()) != wantN {
				t.Fatalf("%d tensors, want %d", len(m.Names()), wantN)
			}
			out := t.TempDir()
			for _, shard := range []int64{0, 1 << 20} {
				if err := Write(m, out, WriteOptions{MaxShard: shard, Force: true}); err != nil { // the second write replaces the first
					t.Fatal(err)
				}
				back, err := Open(out)
				if err != nil {
					t.Fatal(err)
				}
				if back.Config.Tied != m.Config.Tied || back.Config.HeadDim != m.Config.HeadDim || back.Config.RopeTheta != m.Config.RopeTheta {
					t.Fatalf("config changed: %+v vs %+v", back.Config, m.Config)
				}
				for _, n := range m.Names() {
					a, _ := m.Lookup(n)
					b, err := back.Get(n)
					if err != nil {
						t.Fatal(err)
					}
					ad, bd := a.(*model.Dense), b.(*model.Dense)
					if ad.DType != bd.DType || !bytes.Equal(ad.Data, bd.Data) {
						t.Fatalf("shard %d: tensor %s differs after round trip", shard, n)
					}
				}
				back.Close()
				if _, err := os.Stat(filepath.Join(out, "tokenizer_config.json")); err != nil {
					t.Fatal("tokenizer files not copied")
				}
				os.Remove(filepath.Join(out, "model.safetensors"))
			}
		})
	}
}

func TestWriteConvertsDType(t *testing.T) {
	m, err := Open("../../testdata/llama-mini")
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	out := t.TempDir()
	if err := Write(m, out, WriteOptions{DType: model.F32}); err != nil {
		t.Fatal(err)
	}
	back, err := Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer back.Close()
	if back.Config.DType != "float32" {
		t.Fatalf("dtype %q", back.Config.DType)
	}
	for _, n := range []string{"embed", "layers.2.down"} {
		a, _ := m.Get(n)
		b, _ := back.Get(n)
		av, _ := a.Float32()
		bv, _ := b.Float32()
		for i := range av {
			if av[i] != bv[i] {
				t.Fatalf("%s[%d]: %v -> %v, f16 to f32 must be exact", n, i, av[i], bv[i])
			}
		}
	}
}

func TestOpenErrors(t *testing.T) {
	dir := t.TempDir()
	if _, err := Open(dir); err == nil || !strings.Contains(err.Error(), "config.json") {
		t.Fatalf("err = %v", err)
	}
	os.WriteFile(filepath.Join(dir, "config.json"), []byte(llamaCfg), 0o644)
	if _, err := Open(dir); err == nil || !strings.Contains(err.Error(), "model.safetensors") {
		t.Fatalf("err = %v", err)
	}
	q := strings.Replace(llamaCfg, "{", `{"quantization_config":{"quant_method":"awq"},`, 1)
	os.WriteFile(filepath.Join(dir, "config.json"), []byte(q), 0o644)
	if _, err := Open(dir); err == nil || !strings.Contains(err.Error(), "quantization_config") {
		t.Fatalf("err = %v", err)
	}
	// A checkpoint missing a tensor the config implies.
	m, _ := Open("../../testdata/llama-mini")
	defer m.Close()
	m.Delete("layers.3.up")
	out := t.TempDir()
	if err := Write(m, out, WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	if _, err := Open(out); err == nil || !strings.Contains(err.Error(), `"layers.3.up" is missing`) {
		t.Fatalf("err = %v", err)
	}
}

func FuzzParseConfig(f *testing.F) {
	for _, p := range []string{"../../testdata/llama-mini/config.json", "../../testdata/qwen3-mini/config.json"} {
		if b, err := os.ReadFile(p); err == nil {
			f.Add(b)
		}
	}
	f.Add([]byte(`{"architectures":["Qwen2ForCausalLM"],"hidden_size":1,"intermediate_size":1,"num_hidden_layers":1,"num_attention_heads":1,"vocab_size":1}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := ParseConfig("fuzz", data)
		if err != nil {
			return
		}
		if err := c.Validate(); err != nil {
			t.Fatalf("accepted config fails validation: %v", err)
		}
		if _, err := MarshalConfig(c, nil); err != nil {
			t.Fatalf("accepted config cannot be written: %v", err)
		}
	})
}
