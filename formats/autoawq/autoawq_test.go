package autoawq

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"qtool/formats/hf"
	"qtool/formats/model"
	"qtool/formats/safetensors"
)

const testdata = "../../testdata"

// quantizeAll replaces every decoder linear of m by its 4-bit RTN version,
// except the names in keep.
func quantizeAll(t *testing.T, m *model.Model, group int, keep map[string]bool) {
	t.Helper()
	for l := 0; l < m.Config.Layers; l++ {
		for _, r := range model.Linears {
			name := model.Name(l, r)
			if keep[name] {
				continue
			}
			w, err := m.Get(name)
			if err != nil {
				t.Fatal(err)
			}
			v, err := w.Float32()
			if err != nil {
				t.Fatal(err)
			}
			sh := w.Shape()
			m.Set(name, rtnAsym(v, sh[0], sh[1], 4, group))
		}
	}
}

func TestWriteOpenRoundTrip(t *testing.T) {
	tests := []struct {
		name     string
		dir      string
		group    int
		maxShard int64
		keep     map[string]bool
	}{
		{"llama-mini", "llama-mini", 128, 0, nil},
		{"qwen3-mini", "qwen3-mini", 64, 0, nil},
		{"llama-mini-sharded-partial", "llama-mini", 32, 3 << 20, map[string]bool{"layers.1.down": true, "layers.3.q": true}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			src, err := hf.Open(filepath.Join(testdata, tc.dir))
			if err != nil {
				t.Fatal(err)
			}
			defer src.Close()
			quantizeAll(t, src, tc.group, tc.keep)
			out := t.TempDir()
			if err := Write(src, out, WriteOptions{MaxShard: tc.maxShard}); err != nil {
				t.Fatal(err)
			}
			if tc.maxShard > 0 {
				if _, err := os.Stat(filepath.Join(out, "model.safetensors.index.json")); err != nil {
					t.Fatalf("sharded write has no index: %v", err)
				}
			}
			got, err := Open(out)
			if err != nil {
				t.Fatal(err)
			}
			defer got.Close()
			if got.Format != Format {
				t.Errorf("Format = %q", got.Format)
			}
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
					continue
				}
				if _, ok := b.(*model.Dense); !ok {
					t.Fatalf("%s: read back as %T", name, b)
				}
				va, _ := a.Float32()
				vb, _ := b.Float32()
				for i := range va {
					if want := model.RoundF16(va[i]); vb[i] != want {
						t.Fatalf("%s[%d] = %g, want fp16(%g) = %g", name, i, vb[i], va[i], want)
					}
				}
			}
			// the quantization_config as written
			var cj struct {
				Q map[string]any `json:"quantization_config"`
			}
			data, _ := os.ReadFile(filepath.Join(out, "config.json"))
			if err := json.Unmarshal(data, &cj); err != nil {
				t.Fatal(err)
			}
			if cj.Q["quant_method"] != "awq" || cj.Q["bits"] != 4.0 || cj.Q["group_size"] != float64(tc.group) ||
				cj.Q["zero_point"] != true || cj.Q["version"] != "gemm" {
				t.Errorf("quantization_config = %v", cj.Q)
			}
			mods, _ := cj.Q["modules_to_not_convert"].([]any)
			if len(mods) != len(tc.keep) {
				t.Errorf("modules_to_not_convert = %v, want %d modules", cj.Q["modules_to_not_convert"], len(tc.keep))
			}
			if _, err := os.Stat(filepath.Join(out, "tokenizer_config.json")); err != nil {
				t.Errorf("tokenizer not copied: %v", err)
			}
		})
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

// TestQuantizedMatchesFloat checks the codec against the float model: a layer
// written and read back dequantizes to within a quantization step of
// the original weights (one step: the clamped zero point of AWQ's RTN can
// shift the grid by up to half a step).
func TestQuantizedMatchesFloat(t *testing.T) {
	src, err := hf.Open(filepath.Join(testdata, "llama-mini"))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	orig, _ := src.Get("layers.2.gate")
	ov, _ := orig.Float32()
	quantizeAll(t, src, 128, nil)
	out := t.TempDir()
	if err := Write(src, out, WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	got, err := Open(out)
	if err != nil {
		t.Fatal(err)
	}
	defer got.Close()
	qt, _ := got.Get("layers.2.gate")
	q := qt.(*model.Quantized)
	dv, _ := q.Float32()
	for i := range ov {
		r, c := i/q.Cols, i%q.Cols
		s := q.Scale[r*q.Groups()+c/q.GroupSize]
		if d := dv[i] - ov[i]; d > s*1.001 || d < -s*1.001 {
			t.Fatalf("gate[%d][%d]: dequantized %g, float %g, step %g", r, c, dv[i], ov[i], s)
		}
	}
}

func TestParseQuantConfigErrors(t *testing.T) {
	tests := []struct {
		name, js, want string
	}{
		{"ok", `{"quant_method":"awq","bits":4,"group_size":128,"zero_point":true,"version":"gemm","modules_to_not_convert":null}`, ""},
		{"ok-autoawq-keys", `{"w_bit":4,"q_group_size":64,"zero_point":true,"version":"GEMM"}`, ""},
		{"bits3", `{"quant_method":"awq","bits":3,"group_size":128,"zero_point":true,"version":"gemm"}`, "bits = 3"},
		{"gemv", `{"quant_method":"awq","bits":4,"group_size":128,"zero_point":true,"version":"gemv"}`, "version \"gemv\""},
		{"exllama", `{"quant_method":"awq","bits":4,"group_size":128,"zero_point":true,"version":"exllama"}`, "only \"gemm\""},
		{"nozero", `{"quant_method":"awq","bits":4,"group_size":128,"zero_point":false,"version":"gemm"}`, "zero_point = false"},
		{"gptq", `{"quant_method":"gptq","bits":4,"group_size":128}`, "not AutoAWQ"},
		{"group-1", `{"quant_method":"awq","bits":4,"group_size":-1,"zero_point":true}`, "group_size = -1"},
		{"nobits", `{"quant_method":"awq","group_size":128,"zero_point":true}`, "\"bits\" is missing"},
		{"llm-awq", `{"quant_method":"awq","bits":4,"group_size":128,"zero_point":true,"backend":"llm-awq"}`, "backend"},
		{"mods", `{"quant_method":"awq","bits":4,"group_size":128,"zero_point":true,"modules_to_not_convert":"gate"}`, "list of strings"},
		{"notjson", `[1,2]`, "not a JSON object"},
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

// TestOpenErrors damages a valid checkpoint in several ways.
func TestOpenErrors(t *testing.T) {
	src, err := hf.Open(filepath.Join(testdata, "llama-mini"))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	quantizeAll(t, src, 128, nil)
	good := t.TempDir()
	if err := Write(src, good, WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	cfgData, _ := os.ReadFile(filepath.Join(good, "config.json"))
	tests := []struct {
		name   string
		config func(string) string                                   // edits config.json text
		edit   func(entries []safetensors.Entry) []safetensors.Entry // edits the tensors
		want   string
	}{
		{"bits3", func(s string) string { return strings.Replace(s, `"bits": 4`, `"bits": 3`, 1) }, nil, "bits = 3"},
		{"noquant", func(s string) string {
			return strings.Replace(s, `"quantization_config"`, `"x_quantization_config"`, 1)
		}, nil, "not an AutoAWQ checkpoint"},
		{"qzeros-shape", nil, func(es []safetensors.Entry) []safetensors.Entry {
			for i, e := range es {
				if e.Name == "model.layers.0.self_attn.q_proj.qzeros" {
					es[i] = safetensors.Entry{Name: e.Name, DType: model.I32, Shape: []int{1, 16},
						Data: func() ([]byte, error) { return make([]byte, 64), nil }}
				}
			}
			return es
		}, "do not fit"},
		{"missing-scales", nil, func(es []safetensors.Entry) []safetensors.Entry {
			for i, e := range es {
				if e.Name == "model.layers.1.mlp.up_proj.scales" {
					return append(es[:i], es[i+1:]...)
				}
			}
			return es
		}, "only some of"},
		{"group-mismatch", func(s string) string { return strings.Replace(s, `"group_size": 128`, `"group_size": 64`, 1) }, nil, "do not fit"},
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
	if err := Write(src, t.TempDir(), WriteOptions{}); err == nil || !strings.Contains(err.Error(), "no 4-bit quantized") {
		t.Errorf("float model: err = %v", err)
	}
	quantizeAll(t, src, 128, nil)
	w, _ := src.Get("layers.0.k")
	v, _ := w.Float32()
	src.Set("layers.0.k", rtnAsym(v, w.Shape()[0], w.Shape()[1], 4, 64))
	if err := Write(src, t.TempDir(), WriteOptions{}); err == nil || !strings.Contains(err.Error(), "group size 64") {
		t.Errorf("mixed groups: err = %v", err)
	}
	src.Set("layers.0.k", rtnAsym(v, w.Shape()[0], w.Shape()[1], 8, 128))
	if err := Write(src, t.TempDir(), WriteOptions{}); err == nil || !strings.Contains(err.Error(), "only 4-bit") {
		t.Errorf("8-bit: err = %v", err)
	}
}

func FuzzParseQuantConfig(f *testing.F) {
	f.Add([]byte(`{"quant_method":"awq","bits":4,"group_size":128,"zero_point":true,"version":"gemm","modules_to_not_convert":null}`))
	f.Add([]byte(`{"w_bit":4,"q_group_size":64,"zero_point":true,"version":"GEMM","modules_to_not_convert":["gate"]}`))
	f.Add([]byte(`{"quant_method":"awq","bits":3}`))
	f.Add([]byte(`null`))
	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := ParseQuantConfig(data)
		if err != nil {
			return
		}
		if c.Bits != 4 || c.GroupSize <= 0 || !c.ZeroPoint || c.Version != "gemm" {
			t.Fatalf("accepted an unsupported config %+v", c)
		}
		// what we accept, we can write back and accept again
		b, err := json.Marshal(c.JSON())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := ParseQuantConfig(b); err != nil {
			t.Fatalf("re-parse of %s: %v", b, err)
		}
	})
}
