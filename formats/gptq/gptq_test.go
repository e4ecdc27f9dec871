package gptq

import (
	"encoding/binary"
	"encoding/json"
	"math/rand/v2"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"qtool/formats/hf"
	"qtool/formats/model"
	"qtool/formats/safetensors"
)

const testdata = "../../testdata"

type scheme struct {
	bits, group int
	sym, act    bool
}

// quantizeAll replaces every decoder linear of m by its RTN version, except
// the names in keep. With act, each layer gets a random (seeded) g_idx.
func quantizeAll(t *testing.T, m *model.Model, s scheme, keep map[string]bool) {
	t.Helper()
	r := rand.New(rand.NewPCG(7, 8))
	for l := 0; l < m.Config.Layers; l++ {
		for _, role := range model.Linears {
			name := model.Name(l, role)
			if keep[name] {
				continue
			}
			w, err := m.Get(name)
			if err != nil {
				t.Fatal(err)
			}
			v, _ := w.Float32()
			rows, cols := w.Shape()[0], w.Shape()[1]
			var gidx []int32
			if s.act {
				gidx = make([]int32, cols)
				for c, p := range r.Perm(cols) {
					gidx[c] = int32(p / s.group)
				}
			}
			m.Set(name, rtn(v, rows, cols, s.bits, s.group, gidx, s.sym))
		}
	}
}

func TestWriteOpenRoundTrip(t *testing.T) {
	tests := []struct {
		name     string
		dir      string
		s        scheme
		maxShard int64
		keep     map[string]bool
	}{
		{"llama-4bit-g128-asym", "llama-mini", scheme{4, 128, false, false}, 0, nil},
		{"llama-4bit-g128-sym", "llama-mini", scheme{4, 128, true, false}, 0, nil},
		{"qwen3-4bit-g64-act", "qwen3-mini", scheme{4, 64, false, true}, 0, nil},
		{"qwen3-8bit-perchannel-sym", "qwen3-mini", scheme{8, 0, true, false}, 0, nil},
		{"llama-3bit-g128-sharded-partial", "llama-mini", scheme{3, 128, false, false}, 2 << 20, map[string]bool{"layers.0.down": true}},
		{"llama-2bit-g32", "llama-mini", scheme{2, 32, false, false}, 0, nil},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			src, err := hf.Open(filepath.Join(testdata, tc.dir))
			if err != nil {
				t.Fatal(err)
			}
			defer src.Close()
			quantizeAll(t, src, tc.s, tc.keep)
			out := t.TempDir()
			if err := Write(src, out, WriteOptions{MaxShard: tc.maxShard}); err != nil {
				t.Fatal(err)
			}
			got, err := Open(out)
			if err != nil {
				t.Fatal(err)
			}
			defer got.Close()
			if err := got.CheckShapes(); err != nil {
				t.Fatal(err)
			}
			wantCfg := src.Config
			wantCfg.DType = "float16"
			if g, w := mustJSON(t, got.Config), mustJSON(t, wantCfg); g != w {
				t.Errorf("config\n got %s\nwant %s", g, w)
			}
			if len(got.Names()) != len(src.Names()) {
				t.Errorf("%d tensors read back, wrote %d", len(got.Names()), len(src.Names()))
			}
			for _, name := range src.SortedNames() {
				a, _ := src.Lookup(name)
				b, err := got.Get(name)
				if err != nil {
					t.Fatal(err)
				}
				if qa, ok := a.(*model.Quantized); ok {
					qb, ok := b.(*model.Quantized)
					if !ok {
						t.Fatalf("%s: read back as %T", name, b)
					}
					equalQuantized(t, qa, qb)
					if (qa.GIdx != nil) != (qb.GIdx != nil) {
						t.Fatalf("%s: GIdx presence changed", name)
					}
					continue
				}
				va, _ := a.Float32()
				vb, _ := b.Float32()
				for i := range va {
					if want := model.RoundF16(va[i]); vb[i] != want {
						t.Fatalf("%s[%d] = %g, want fp16(%g) = %g", name, i, vb[i], va[i], want)
					}
				}
			}
			var cj struct {
				Q map[string]any `json:"quantization_config"`
			}
			data, _ := os.ReadFile(filepath.Join(out, "config.json"))
			if err := json.Unmarshal(data, &cj); err != nil {
				t.Fatal(err)
			}
			wantGroup := float64(tc.s.group)
			if tc.s.group == 0 {
				wantGroup = -1
			}
			if cj.Q["quant_method"] != "gptq" || cj.Q["bits"] != float64(tc.s.bits) || cj.Q["group_size"] != wantGroup ||
				cj.Q["sym"] != tc.s.sym || cj.Q["desc_act"] != tc.s.act || cj.Q["checkpoint_format"] != "gptq" {
				t.Errorf("quantization_config = %v", cj.Q)
			}
		})
	}
}

// TestSymmetricZerosOnDisk reads the written file directly: symmetric 4-bit
// qzeros words must all be 0x77777777 (8-bit: 0x7F7F7F7F).
func TestSymmetricZerosOnDisk(t *testing.T) {
	for _, tc := range []struct {
		bits int
		want uint32
	}{{4, 0x77777777}, {8, 0x7F7F7F7F}} {
		src, err := hf.Open(filepath.Join(testdata, "llama-mini"))
		if err != nil {
			t.Fatal(err)
		}
		quantizeAll(t, src, scheme{tc.bits, 128, true, false}, nil)
		out := t.TempDir()
		if err := Write(src, out, WriteOptions{}); err != nil {
			t.Fatal(err)
		}
		src.Close()
		f, err := safetensors.Open(filepath.Join(out, "model.safetensors"))
		if err != nil {
			t.Fatal(err)
		}
		d, err := f.Tensor("model.layers.2.mlp.down_proj.qzeros")
		if err != nil {
			t.Fatal(err)
		}
		if want := []int{768 / 128, 256 * tc.bits / 32}; d.Dims[0] != want[0] || d.Dims[1] != want[1] {
			t.Errorf("qzeros shape %v, want %v", d.Dims, want)
		}
		for i := 0; i < len(d.Data); i += 4 {
			if w := binary.LittleEndian.Uint32(d.Data[i:]); w != tc.want {
				t.Fatalf("%d-bit qzeros word %d = %#08x, want %#08x", tc.bits, i/4, w, tc.want)
			}
		}
		f.Close()
	}
}

func mustJSON(t *testing.T, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	return string(b)
}

func TestParseQuantConfigErrors(t *testing.T) {
	tests := []struct {
		name, js, want string
	}{
		{"ok", `{"quant_method":"gptq","bits":4,"group_size":128,"desc_act":false,"sym":true,"checkpoint_format":"gptq"}`, ""},
		{"ok-gptqmodel", `{"bits":4,"checkpoint_format":"gptq","desc_act":false,"dynamic":null,"group_size":128,"lm_head":false,"meta":{"quantizer":["gptqmodel:4.0.0-dev"]},"pack_dtype":"int32","quant_method":"gptq","sym":true}`, ""},
		{"ok-perchannel", `{"quant_method":"gptq","bits":8,"group_size":-1}`, ""},
		{"bits5", `{"quant_method":"gptq","bits":5,"group_size":128}`, "bits = 5"},
		{"marlin", `{"quant_method":"gptq","bits":4,"group_size":128,"checkpoint_format":"marlin"}`, "checkpoint_format \"marlin\""},
		{"awq", `{"quant_method":"awq","bits":4,"group_size":128}`, "not GPTQ"},
		{"group0", `{"quant_method":"gptq","bits":4,"group_size":0}`, "group_size = 0"},
		{"nogroup", `{"quant_method":"gptq","bits":4}`, "\"group_size\" is missing"},
		{"lmhead", `{"quant_method":"gptq","bits":4,"group_size":128,"lm_head":true}`, "lm_head"},
		{"dynamic", `{"quant_method":"gptq","bits":4,"group_size":128,"dynamic":{"-:.*gate.*":{}}}`, "dynamic"},
		{"pack16", `{"quant_method":"gptq","bits":4,"group_size":128,"pack_dtype":"int16"}`, "pack_dtype"},
		{"notjson", `"gptq"`, "not a JSON object"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := ParseQuantConfig([]byte(tc.js))
			if tc.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to mention %q", err, tc.want)
			}
		})
	}
}

func TestOpenErrors(t *testing.T) {
	src, err := hf.Open(filepath.Join(testdata, "llama-mini"))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	quantizeAll(t, src, scheme{4, 128, false, true}, nil)
	good := t.TempDir()
	if err := Write(src, good, WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	cfgData, _ := os.ReadFile(filepath.Join(good, "config.json"))
	drop := func(name string) func([]safetensors.Entry) []safetensors.Entry {
		return func(es []safetensors.Entry) []safetensors.Entry {
			for i, e := range es {
				if e.Name == name {
					return append(es[:i], es[i+1:]...)
				}
			}
			return es
		}
	}
	tests := []struct {
		name   string
		config func(string) string
		edit   func([]safetensors.Entry) []safetensors.Entry
		want   string
	}{
		{"missing-gidx", nil, drop("model.layers.1.self_attn.v_proj.g_idx"), "no g_idx but the config says desc_act = true"},
		{"checkpoint-format", func(s string) string {
			return strings.Replace(s, `"checkpoint_format": "gptq"`, `"checkpoint_format": "gptq_v3"`, 1)
		}, nil, "checkpoint_format \"gptq_v3\""},
		{"bits-mismatch", func(s string) string { return strings.Replace(s, `"bits": 4`, `"bits": 8`, 1) }, nil, "do not fit"},
		{"missing-qzeros", nil, drop("model.layers.3.mlp.gate_proj.qzeros"), "only some of"},
		{"gidx-shape", nil, func(es []safetensors.Entry) []safetensors.Entry {
			for i, e := range es {
				if e.Name == "model.layers.0.mlp.up_proj.g_idx" {
					es[i] = safetensors.Entry{Name: e.Name, DType: model.I32, Shape: []int{8},
						Data: func() ([]byte, error) { return make([]byte, 32), nil }}
				}
			}
			return es
		}, "want I32[256]"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			js := string(cfgData)
			if tc.config != nil {
				js = tc.config(js)
			}
			if err := os.WriteFile(filepath.Join(dir, "config.json"), []byte(js), 0o644); err != nil {
				t.Fatal(err)
			}
			ck, err := safetensors.OpenCheckpoint(good, "model")
			if err != nil {
				t.Fatal(err)
			}
			defer ck.Close()
			var es []safetensors.Entry
			for _, n := range ck.Names() {
				d, _ := ck.Tensor(n)
				es = append(es, safetensors.DenseEntry(n, d))
			}
			if tc.edit != nil {
				es = tc.edit(es)
			}
			if err := safetensors.Write(filepath.Join(dir, "model.safetensors"), es, nil); err != nil {
				t.Fatal(err)
			}
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
}

func TestWriteErrors(t *testing.T) {
	src, err := hf.Open(filepath.Join(testdata, "llama-mini"))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if err := Write(src, t.TempDir(), WriteOptions{}); err == nil || !strings.Contains(err.Error(), "no quantized decoder linear") {
		t.Errorf("float model: err = %v", err)
	}
	quantizeAll(t, src, scheme{4, 128, false, false}, nil)
	w, _ := src.Get("layers.0.k")
	v, _ := w.Float32()
	src.Set("layers.0.k", rtn(v, w.Shape()[0], w.Shape()[1], 8, 128, nil, false))
	if err := Write(src, t.TempDir(), WriteOptions{}); err == nil || !strings.Contains(err.Error(), "8 bits") {
		t.Errorf("mixed bits: err = %v", err)
	}
	q := rtn(v, w.Shape()[0], w.Shape()[1], 4, 128, nil, false)
	q.Zero[0] = -8 // zero point 0
	src.Set("layers.0.k", q)
	if err := Write(src, t.TempDir(), WriteOptions{}); err == nil || !strings.Contains(err.Error(), "0 cannot be stored") {
		t.Errorf("zero point 0: err = %v", err)
	}
}

func FuzzParseQuantConfig(f *testing.F) {
	f.Add([]byte(`{"quant_method":"gptq","bits":4,"group_size":128,"desc_act":false,"sym":true,"checkpoint_format":"gptq"}`))
	f.Add([]byte(`{"bits":3,"group_size":-1,"desc_act":true,"sym":false,"checkpoint_format":"gptq_v2","dynamic":{}}`))
	f.Add([]byte(`{"bits":8,"group_size":32,"lm_head":true}`))
	f.Add([]byte(`{}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := ParseQuantConfig(data)
		if err != nil {
			return
		}
		if !bitsOK(c.Bits) || c.GroupSize == 0 || c.GroupSize < -1 {
			t.Fatalf("accepted an unsupported config %+v", c)
		}
		b, err := json.Marshal(c.JSON())
		if err != nil {
			t.Fatal(err)
		}
		c2, err := ParseQuantConfig(b)
		if err != nil || c2 != c {
			t.Fatalf("re-parse of %s: %+v, %v", b, c2, err)
		}
	})
}
