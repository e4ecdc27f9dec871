package shard

import (
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"qtool/formats/autoawq"
	"qtool/formats/hf"
	"qtool/formats/model"
	"qtool/formats/msmodelslim"
	"qtool/quantize"
)

const testdata = "../../testdata"

func openModel(t testing.TB, path string) *model.Model {
	t.Helper()
	// convert.Open imports this package; pick the codec by hand.
	open := hf.Open
	if _, err := os.Stat(filepath.Join(path, "quant_model_description.json")); err == nil {
		open = msmodelslim.Open
	} else if cfg, err := os.ReadFile(filepath.Join(path, "config.json")); err == nil && strings.Contains(string(cfg), "quantization_config") {
		open = autoawq.Open
	}
	m, err := open(path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

func quantized(t testing.TB, m *model.Model, p quantize.Params) *model.Model {
	t.Helper()
	q, err := quantize.QuantizeModel(m, quantize.Options{Params: p})
	if err != nil {
		t.Fatal(err)
	}
	return q
}

// sameTensor reports how a differs from b, or "" when they are identical
// (same type, dtype, shape and bits).
func sameTensor(a, b model.Tensor) string {
	switch x := a.(type) {
	case *model.Dense:
		y, ok := b.(*model.Dense)
		if !ok {
			return "type differs"
		}
		if x.DType != y.DType || !slices.Equal(x.Dims, y.Dims) || string(x.Data) != string(y.Data) {
			return "dense bytes differ"
		}
	case *model.Quantized:
		y, ok := b.(*model.Quantized)
		if !ok {
			return "type differs"
		}
		return sameQuant(x, y)
	case *model.W8A8:
		y, ok := b.(*model.W8A8)
		if !ok {
			return "type differs"
		}
		if s := sameQuant(x.Weight, y.Weight); s != "" {
			return s
		}
		if x.InputScale != y.InputScale || x.InputOffset != y.InputOffset || !slices.Equal(x.DeqScale, y.DeqScale) ||
			!slices.Equal(x.QuantBias, y.QuantBias) || !slices.Equal(x.Bias, y.Bias) {
			return "w8a8 parameters differ"
		}
	default:
		return "unexpected type"
	}
	return ""
}

func sameQuant(x, y *model.Quantized) string {
	if x.Bits != y.Bits || x.GroupSize != y.GroupSize || x.Rows != y.Rows || x.Cols != y.Cols {
		return "quantization header differs"
	}
	if !slices.Equal(x.Q, y.Q) || !slices.Equal(x.Scale, y.Scale) || !slices.Equal(x.Zero, y.Zero) || !slices.Equal(x.GIdx, y.GIdx) {
		return "quantized values differ"
	}
	return ""
}

// TestRoundTrip writes llama-mini and qwen3-mini (float, int8 per-group,
// AWQ-style int4) and the msmodelslim W8A8 fixture as TP=2 shards, reopens
// them and checks that concatenating the rank pieces reproduces every
// original tensor bit for bit, and that every piece has the shape the
// manifest's range implies.
func TestRoundTrip(t *testing.T) {
	type variant struct {
		name  string
		path  string
		quant *quantize.Params
		awq   bool // write the quantized model as an AutoAWQ checkpoint and reopen it
	}
	int8g64, int4g128 := quantize.Int8Sym(64), quantize.Int4Asym(128)
	var cases []variant
	for _, name := range []string{"llama-mini", "qwen3-mini"} {
		p := filepath.Join(testdata, name)
		cases = append(cases, variant{name + "/float", p, nil, false}, variant{name + "/int8-g64", p, &int8g64, false},
			variant{name + "/awq-int4-g128", p, &int4g128, false})
	}
	cases = append(cases, variant{"msmodelslim-w8a8", filepath.Join(testdata, "msmodelslim", "llama-mini-w8a8-smooth"), nil, false},
		variant{"qwen3-mini/autoawq-checkpoint", filepath.Join(testdata, "qwen3-mini"), &int4g128, true})
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			src := openModel(t, c.path)
			if c.quant != nil {
				src = quantized(t, src, *c.quant)
			}
			if c.awq {
				awqDir := t.TempDir()
				if err := autoawq.Write(src, awqDir, autoawq.WriteOptions{}); err != nil {
					t.Fatal(err)
				}
				src = openModel(t, awqDir)
				if src.Format != "autoawq" {
					t.Fatalf("reopened as %q", src.Format)
				}
			}
			dir := t.TempDir()
			man, err := Write(src, 2, dir)
			if err != nil {
				t.Fatal(err)
			}
			ranks, man2, err := Open(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer func() {
				for _, r := range ranks {
					r.Close()
				}
			}()
			if len(man2.Tensors) != len(man.Tensors) || len(man.Tensors) != len(src.Names()) {
				t.Fatalf("manifest has %d tensors (reread %d), model %d", len(man.Tensors), len(man2.Tensors), len(src.Names()))
			}
			joined, err := Join(ranks, man2)
			if err != nil {
				t.Fatal(err)
			}
			kinds := map[string]int{}
			for _, name := range src.Names() {
				orig, _ := src.Lookup(name)
				got, ok := joined.Lookup(name)
				if !ok {
					t.Fatalf("%s missing after the round trip", name)
				}
				if d := sameTensor(got, orig); d != "" {
					t.Fatalf("%s: %s", name, d)
				}
				e, _ := man2.Entry(name)
				kinds[e.Kind+"/"+string(e.Split)]++
				for r, rm := range ranks {
					p, _ := rm.Lookup(name)
					if want := e.PartShape(r); !slices.Equal(p.Shape(), want) {
						t.Fatalf("%s rank %d: shape %v, want %v", name, r, p.Shape(), want)
					}
				}
			}
			t.Logf("tensors by kind/split: %v", kinds)
			// Every linear of every layer is split.
			cfg := src.Config
			for l := 0; l < cfg.Layers; l++ {
				for _, role := range model.Linears {
					e, _ := man2.Entry(model.Name(l, role))
					if e.Split == Replicated {
						t.Fatalf("%s is replicated", e.Name)
					}
				}
			}
		})
	}
}

// TestSplitRules checks the ranges against the config by hand for qwen3-mini
// (8 heads, 2 KV heads, head dim 64, FFN 768, vocab 4096) at TP=2.
func TestSplitRules(t *testing.T) {
	m := openModel(t, filepath.Join(testdata, "qwen3-mini"))
	man, err := Plan(m, 2)
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name   string
		split  Split
		ranges [][2]int
	}{
		{"embed", Vocab, [][2]int{{0, 2048}, {2048, 4096}}},
		{"norm", Replicated, nil},
		{"layers.0.q", Column, [][2]int{{0, 256}, {256, 512}}},
		{"layers.0.k", Column, [][2]int{{0, 64}, {64, 128}}},
		{"layers.0.v", Column, [][2]int{{0, 64}, {64, 128}}},
		{"layers.0.o", Row, [][2]int{{0, 256}, {256, 512}}},
		{"layers.0.gate", Column, [][2]int{{0, 384}, {384, 768}}},
		{"layers.0.up", Column, [][2]int{{0, 384}, {384, 768}}},
		{"layers.0.down", Row, [][2]int{{0, 384}, {384, 768}}},
		{"layers.0.q_norm", Replicated, nil},
		{"layers.3.attn_norm", Replicated, nil},
	} {
		e, ok := man.Entry(c.name)
		if !ok {
			t.Fatalf("%s not in the manifest", c.name)
		}
		if e.Split != c.split || !slices.Equal(e.Ranges, c.ranges) {
			t.Errorf("%s: %s %v, want %s %v", c.name, e.Split, e.Ranges, c.split, c.ranges)
		}
	}
	if _, ok := man.Entry("lm_head"); ok {
		t.Error("tied qwen3-mini has an lm_head entry")
	}
}

// tinyConfig is a small model whose heads are 4 wide, so head splits can
// miss the int4 packing width.
var tinyConfig = model.Config{Arch: model.Llama, Hidden: 16, Intermediate: 24, Layers: 1, Heads: 2, KVHeads: 2,
	HeadDim: 4, Vocab: 10, MaxSeq: 64, RopeTheta: 1e4, NormEps: 1e-5, BOS: -1}

func quant(bits, group, rows, cols int, gidx []int32) *model.Quantized {
	q := &model.Quantized{Bits: bits, GroupSize: group, Rows: rows, Cols: cols, Q: make([]int8, rows*cols)}
	g := 1
	if group > 0 {
		g = cols / group
	}
	q.Scale = make([]float32, rows*g)
	q.Zero = make([]float32, rows*g)
	for i := range q.Q {
		q.Q[i] = int8(i%(1<<bits)) - int8(q.Offset())
	}
	for i := range q.Scale {
		q.Scale[i] = float32(i+1) / 64
		q.Zero[i] = float32(i % 3)
	}
	q.GIdx = gidx
	return q
}

// TestAlignment covers the refusals (and acceptances) of quantized splits.
func TestAlignment(t *testing.T) {
	actOrderOK := []int32{0, 1, 0, 1, 1, 0, 0, 1, 1, 0, 0, 1, 2, 3, 3, 2, 2, 3, 3, 2, 2, 3, 3, 2} // groups of 6 columns, permuted within each half
	actOrderBad := slices.Clone(actOrderOK)
	actOrderBad[0] = 3
	for _, c := range []struct {
		name   string
		tensor string
		t      model.Tensor
		want   string // "" : splits and joins back exactly
	}{
		{"int8 row split on group boundary", "layers.0.down", quant(8, 4, 16, 24, nil), ""},
		{"int8 row split inside a group", "layers.0.down", quant(8, 8, 16, 24, nil), "falls inside a quantization group of 8"},
		{"int4 column split off the packing width", "layers.0.q", quant(4, 8, 8, 16, nil), "multiple of 8, the int4 packing width"},
		{"int4 FFN split at 12", "layers.0.gate", quant(4, 8, 24, 16, nil), "multiple of 8"},
		{"int4 row split on 8", "layers.0.o", quant(4, 4, 16, 8, nil), "multiple of 8"},
		{"int8 per-row scales row split", "layers.0.down", quant(8, 0, 16, 24, nil), ""},
		{"act-order g_idx within ranges", "layers.0.down", quant(4, 6, 16, 24, actOrderOK), "packing"},
		{"act-order g_idx per-row groups", "layers.0.down", quant(8, 6, 16, 24, actOrderOK), ""},
		{"act-order g_idx crossing the split", "layers.0.down", quant(8, 6, 16, 24, actOrderBad), "act-order"},
		{"dense bf16 row split", "layers.0.o", &model.Dense{DType: model.BF16, Dims: []int{16, 8}, Data: make([]byte, 256)}, ""},
	} {
		t.Run(c.name, func(t *testing.T) {
			e, err := Describe(tinyConfig, 2, c.tensor, c.t)
			var parts []model.Tensor
			if err == nil {
				parts, err = SplitTensor(&e, c.t)
			}
			if c.want != "" {
				if err == nil || !strings.Contains(err.Error(), c.want) {
					t.Fatalf("err = %v, want %q", err, c.want)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			back, err := Concat(&e, parts)
			if err != nil {
				t.Fatal(err)
			}
			if d := sameTensor(back, c.t); d != "" {
				t.Fatal(d)
			}
		})
	}
}

func TestBadTPSize(t *testing.T) {
	m := openModel(t, filepath.Join(testdata, "llama-mini")) // 4 heads, 2 KV heads
	dir := t.TempDir()
	for _, n := range []int{3, 4, 0} {
		_, err := Write(m, n, dir)
		if err == nil {
			t.Fatalf("TP=%d accepted", n)
		}
		if n != 0 && !strings.Contains(err.Error(), "sizes that work: 1, 2") {
			t.Errorf("TP=%d: %v", n, err)
		}
	}
	if entries, _ := os.ReadDir(dir); len(entries) != 0 {
		t.Errorf("refused shard wrote %d files", len(entries))
	}
	q := quantized(t, m, quantize.Int8Sym(256))
	if _, err := Plan(q, 2); err == nil || !strings.Contains(err.Error(), "quantization group of 256") {
		t.Errorf("int8 g256 at TP=2: %v", err)
	}
}

// TestOpenErrors damages a valid shard directory in the ways a user might
// and checks that Open refuses it, naming the problem.
func TestOpenErrors(t *testing.T) {
	src := openModel(t, filepath.Join(testdata, "llama-mini"))
	good := t.TempDir()
	if _, err := Write(src, 2, good); err != nil {
		t.Fatal(err)
	}
	manifest := func(t *testing.T, dir string, edit func(m map[string]any)) {
		path := filepath.Join(dir, ManifestFile)
		data, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		var m map[string]any
		if err := json.Unmarshal(data, &m); err != nil {
			t.Fatal(err)
		}
		edit(m)
		out, _ := json.Marshal(m)
		if err := os.WriteFile(path, out, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	tensor := func(m map[string]any, name string) map[string]any {
		for _, e := range m["tensors"].([]any) {
			if e.(map[string]any)["name"] == name {
				return e.(map[string]any)
			}
		}
		return nil
	}
	for _, c := range []struct {
		name   string
		damage func(t *testing.T, dir string)
		want   string
	}{
		{"missing rank file", func(t *testing.T, dir string) { os.Remove(filepath.Join(dir, "rank-1.safetensors")) }, "rank 1 of 2: file rank-1.safetensors is missing"},
		{"no manifest", func(t *testing.T, dir string) { os.Remove(filepath.Join(dir, ManifestFile)) }, "not a shard directory"},
		{"swapped rank files", func(t *testing.T, dir string) {
			a, b := filepath.Join(dir, "rank-0.safetensors"), filepath.Join(dir, "rank-1.safetensors")
			os.Rename(a, a+".tmp")
			os.Rename(b, a)
			os.Rename(a+".tmp", b)
		}, "the file says it is rank \"1\", the manifest lists it as rank 0"},
		{"truncated rank file", func(t *testing.T, dir string) {
			p := filepath.Join(dir, "rank-1.safetensors")
			fi, _ := os.Stat(p)
			os.Truncate(p, fi.Size()-100)
		}, "rank-1.safetensors"},
		{"dtype mismatch", func(t *testing.T, dir string) {
			manifest(t, dir, func(m map[string]any) { tensor(m, "layers.0.q")["dtype"] = "F32" })
		}, `tensor "layers.0.q" is F16[128 256]; the manifest (column split, rank 0 range [0 128] of [256 256]) implies F32[128 256]`},
		{"ranges off the heads", func(t *testing.T, dir string) {
			manifest(t, dir, func(m map[string]any) {
				tensor(m, "layers.1.o")["ranges"] = []any{[]any{0, 100}, []any{100, 256}}
			})
		}, `tensor "layers.1.o": rank 0 range [0 100], want [0 128]`},
		{"tensor dropped from the manifest", func(t *testing.T, dir string) {
			manifest(t, dir, func(m map[string]any) {
				var keep []any
				for _, e := range m["tensors"].([]any) {
					if e.(map[string]any)["name"] != "layers.2.up" {
						keep = append(keep, e)
					}
				}
				m["tensors"] = keep
			})
		}, `tensor "layers.2.up" is not listed in the manifest`},
		{"world size that does not divide the heads", func(t *testing.T, dir string) {
			manifest(t, dir, func(m map[string]any) { m["world_size"] = 3 })
		}, "sizes that work: 1, 2"},
		{"extra rank", func(t *testing.T, dir string) {
			manifest(t, dir, func(m map[string]any) {
				m["files"] = []any{"rank-0.safetensors", "rank-1.safetensors", "rank-2.safetensors"}
			})
		}, "3 rank files for world_size 2"},
		{"path in file name", func(t *testing.T, dir string) {
			manifest(t, dir, func(m map[string]any) { m["files"] = []any{"../rank-0.safetensors", "rank-1.safetensors"} })
		}, "not a plain file name"},
		{"unknown field", func(t *testing.T, dir string) {
			manifest(t, dir, func(m map[string]any) { m["colour"] = "blue" })
		}, "unknown field"},
	} {
		t.Run(c.name, func(t *testing.T) {
			dir := t.TempDir()
			copyDir(t, good, dir)
			c.damage(t, dir)
			ranks, _, err := Open(dir)
			for _, r := range ranks {
				r.Close()
			}
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v\nwant it to contain %q", err, c.want)
			}
		})
	}
}

func copyDir(t *testing.T, src, dst string) {
	t.Helper()
	entries, err := os.ReadDir(src)
	if err != nil {
		t.Fatal(err)
	}
	for _, e := range entries {
		data, err := os.ReadFile(filepath.Join(src, e.Name()))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(dst, e.Name()), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

func TestOpenModel(t *testing.T) {
	src := openModel(t, filepath.Join(testdata, "qwen3-mini"))
	dir := t.TempDir()
	if _, err := Write(src, 2, dir); err != nil {
		t.Fatal(err)
	}
	if !IsDir(dir) || IsDir(filepath.Join(testdata, "qwen3-mini")) {
		t.Fatal("IsDir is wrong")
	}
	m, man, err := OpenModel(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if man.WorldSize != 2 || m.Config.Heads != 8 || m.Format != Format {
		t.Fatalf("world %d, heads %d, format %q", man.WorldSize, m.Config.Heads, m.Format)
	}
	// The tokenizer travelled along, and the sharded tensors dequantize to the source.
	if _, err := os.Stat(filepath.Join(dir, "tokenizer.json")); err != nil {
		t.Error(err)
	}
	for _, name := range []string{"embed", "layers.1.o", "layers.3.k_norm"} {
		st, _ := m.Lookup(name)
		orig, _ := src.Lookup(name)
		a, err := st.Float32()
		if err != nil {
			t.Fatal(err)
		}
		b, _ := orig.Float32()
		if !slices.Equal(a, b) {
			t.Errorf("%s: joined values differ", name)
		}
	}
	_ = hf.TokenizerFiles
	// One rank alone, as a process of a multi-machine run opens it.
	r1, man1, err := OpenRank(dir, 1)
	if err != nil {
		t.Fatal(err)
	}
	defer r1.Close()
	e, _ := man1.Entry("layers.0.q")
	q, _ := r1.Lookup("layers.0.q")
	if !slices.Equal(q.Shape(), e.PartShape(1)) || e.PartShape(1)[0] != 256 {
		t.Errorf("rank 1 q piece %v, manifest %v", q.Shape(), e.PartShape(1))
	}
	if _, _, err := OpenRank(dir, 2); err == nil || !strings.Contains(err.Error(), "rank 2 outside 0..1") {
		t.Errorf("OpenRank(2): %v", err)
	}
}
