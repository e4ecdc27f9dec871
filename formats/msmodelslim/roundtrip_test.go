package msmodelslim

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"qtool/formats/hf"
	"qtool/formats/model"
	"qtool/formats/safetensors"
)

// equalTensor compares two tensors exactly (a nil Zero equals all-zero ones).
func equalTensor(t *testing.T, name string, a, b model.Tensor) {
	t.Helper()
	switch x := a.(type) {
	case *model.Dense:
		y, ok := b.(*model.Dense)
		if !ok || x.DType != y.DType || !sameShape(x.Dims, y.Dims) || !bytes.Equal(x.Data, y.Data) {
			t.Fatalf("%s: dense tensor differs after the round trip (%T)", name, b)
		}
	case *model.Quantized:
		y, ok := b.(*model.Quantized)
		if !ok {
			t.Fatalf("%s: read back as %T", name, b)
		}
		equalQuantized(t, name, x, y)
	case *model.W8A8:
		y, ok := b.(*model.W8A8)
		if !ok {
			t.Fatalf("%s: read back as %T", name, b)
		}
		equalQuantized(t, name, x.Weight, y.Weight)
		if x.Dynamic != y.Dynamic || x.Sparse != y.Sparse {
			t.Fatalf("%s: dynamic %v sparse %v read back as %v %v", name, x.Dynamic, x.Sparse, y.Dynamic, y.Sparse)
		}
		if x.InputScale != y.InputScale || x.InputOffset != y.InputOffset {
			t.Fatalf("%s: input scale/offset %g/%g vs %g/%g", name, x.InputScale, x.InputOffset, y.InputScale, y.InputOffset)
		}
		if !equalF32(x.DeqScale, y.DeqScale) || !equalF32(x.Bias, y.Bias) || len(x.QuantBias) != len(y.QuantBias) {
			t.Fatalf("%s: deq_scale or bias differs", name)
		}
		for i := range x.QuantBias {
			if x.QuantBias[i] != y.QuantBias[i] {
				t.Fatalf("%s: quant_bias[%d] %d vs %d", name, i, x.QuantBias[i], y.QuantBias[i])
			}
		}
	default:
		t.Fatalf("%s: unexpected %T", name, a)
	}
}

func equalF32(a, b []float32) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

func equalQuantized(t *testing.T, name string, a, b *model.Quantized) {
	t.Helper()
	if a.Bits != b.Bits || a.GroupSize != b.GroupSize || a.Rows != b.Rows || a.Cols != b.Cols || (a.GIdx == nil) != (b.GIdx == nil) {
		t.Fatalf("%s: header %d/%d/%dx%d vs %d/%d/%dx%d", name, a.Bits, a.GroupSize, a.Rows, a.Cols, b.Bits, b.GroupSize, b.Rows, b.Cols)
	}
	for i := range a.Q {
		if a.Q[i] != b.Q[i] {
			t.Fatalf("%s: Q[%d] = %d vs %d", name, i, a.Q[i], b.Q[i])
		}
	}
	if !equalF32(a.Scale, b.Scale) {
		t.Fatalf("%s: scales differ", name)
	}
	for i := range a.Scale {
		za, zb := float32(0), float32(0)
		if a.Zero != nil {
			za = a.Zero[i]
		}
		if b.Zero != nil {
			zb = b.Zero[i]
		}
		if za != zb {
			t.Fatalf("%s: Zero[%d] = %g vs %g", name, i, za, zb)
		}
	}
}

func equalModels(t *testing.T, a, b *model.Model) {
	t.Helper()
	if g, w := mustJSON(t, a.Config), mustJSON(t, b.Config); g != w {
		t.Errorf("config\n got %s\nwant %s", w, g)
	}
	an, bn := a.SortedNames(), b.SortedNames()
	if strings.Join(an, ",") != strings.Join(bn, ",") {
		t.Fatalf("tensor names differ:\n%v\n%v", an, bn)
	}
	for _, n := range an {
		x, _ := a.Lookup(n)
		y, _ := b.Lookup(n)
		equalTensor(t, n, x, y)
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

type header map[string]struct {
	DType string `json:"dtype"`
	Shape []int  `json:"shape"`
}

// readLayout returns the description types and the tensor dtypes/shapes of
// an export's single weights file.
func readLayout(t *testing.T, dir, base string) (map[string]string, header) {
	t.Helper()
	var desc map[string]any
	data, err := os.ReadFile(filepath.Join(dir, DescriptionFile))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(data, &desc); err != nil {
		t.Fatal(err)
	}
	types := map[string]string{}
	for k, v := range desc {
		types[k] = mustJSON(t, v)
	}
	f, err := safetensors.Open(filepath.Join(dir, base+".safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	h := header{}
	for _, in := range f.Infos() {
		h[in.Name] = struct {
			DType string `json:"dtype"`
			Shape []int  `json:"shape"`
		}{in.DType.String(), in.Shape}
	}
	return types, h
}

func TestFixtureRoundTrip(t *testing.T) {
	tests := []struct {
		fixture string
		opt     WriteOptions
		base    string
	}{
		{"llama-mini-w8a8-smooth", WriteOptions{}, WeightBaseV0},
		{"llama-mini-w8a8-smooth", WriteOptions{V1Name: true, DeqScaleInt64: true, MaxShard: 2 << 20}, WeightBaseV1},
		{"llama-mini-w8a16-perchannel", WriteOptions{}, WeightBaseV0},
		{"llama-mini-w8a16-g128", WriteOptions{V1Name: true}, WeightBaseV1},
	}
	for _, tc := range tests {
		t.Run(tc.fixture+"/"+tc.base, func(t *testing.T) {
			dir := fixtureDir(t, tc.fixture)
			a, err := Open(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer a.Close()
			out := t.TempDir()
			if err := Write(a, out, tc.opt); err != nil {
				t.Fatal(err)
			}
			b, err := Open(out)
			if err != nil {
				t.Fatal(err)
			}
			defer b.Close()
			equalModels(t, a, b)
			if tc.opt.MaxShard > 0 {
				if _, err := os.Stat(filepath.Join(out, tc.base+".safetensors.index.json")); err != nil {
					t.Fatalf("no index for a sharded write: %v", err)
				}
				return
			}
			// the written layout is the fixture's: same description, same
			// tensor names, dtypes and shapes
			wantTypes, wantHdr := readLayout(t, dir, WeightBaseV0)
			gotTypes, gotHdr := readLayout(t, out, tc.base)
			// qtool adds msmodelslim v1's "group_size" key for per-group
			// exports (the v0 fixtures have none); everything else matches.
			if g, ok := gotTypes["group_size"]; ok {
				if a.Config.Layers > 0 && g != "128" {
					t.Errorf("group_size = %s, want 128", g)
				}
				delete(gotTypes, "group_size")
			}
			if g, w := mustJSON(t, gotTypes), mustJSON(t, wantTypes); g != w {
				t.Errorf("description differs from the fixture's:\n got %.600s\nwant %.600s", g, w)
			}
			if g, w := mustJSON(t, gotHdr), mustJSON(t, wantHdr); g != w {
				t.Errorf("weights header differs from the fixture's:\n got %.400s\nwant %.400s", g, w)
			}
			// and the bytes too, except the plain norm weights beside folded
			// ones (qtool writes the folded weight there, see Write)
			ff, err := safetensors.Open(filepath.Join(dir, WeightBaseV0+".safetensors"))
			if err != nil {
				t.Fatal(err)
			}
			defer ff.Close()
			gf, err := safetensors.Open(filepath.Join(out, tc.base+".safetensors"))
			if err != nil {
				t.Fatal(err)
			}
			defer gf.Close()
			differ := 0
			for _, n := range ff.Names() {
				x, _ := ff.Tensor(n)
				y, err := gf.Tensor(n)
				if err != nil {
					t.Fatal(err)
				}
				if !bytes.Equal(x.Data, y.Data) {
					if ff.Has(strings.TrimSuffix(n, ".weight") + ".module.weight") {
						differ++
						continue
					}
					t.Errorf("tensor %s: bytes differ from the fixture's", n)
				}
			}
			t.Logf("%d tensors byte-identical to the fixture, %d unsmoothed plain norms replaced", len(ff.Names())-differ, differ)
		})
	}
}

// rtnInt8 is an independent per-group int8 quantizer: symmetric (scale =
// max|w|/127) or asymmetric with a fractional offset like msmodelslim's
// (scale = (max−min)/255, offset = −128 − min/scale).
func rtnInt8(w []float32, rows, cols, group int, asym bool) *model.Quantized {
	gs := group
	if gs == 0 {
		gs = cols
	}
	G := cols / gs
	q := &model.Quantized{Bits: 8, GroupSize: group, Rows: rows, Cols: cols, Q: make([]int8, rows*cols), Scale: make([]float32, rows*G)}
	if asym {
		q.Zero = make([]float32, rows*G)
	}
	for r := 0; r < rows; r++ {
		for g := 0; g < G; g++ {
			seg := w[r*cols+g*gs : r*cols+(g+1)*gs]
			lo, hi := seg[0], seg[0]
			for _, v := range seg {
				lo, hi = min(lo, v), max(hi, v)
			}
			var s, z float32
			if asym {
				s = max((hi-lo)/255, 1e-8)
				z = -128 - lo/s
				q.Zero[r*G+g] = z
			} else {
				s = max(max(-lo, hi)/127, 1e-8)
			}
			q.Scale[r*G+g] = s
			for i, v := range seg {
				u := v/s + z
				u = min(max(float32(int32(u+0.5*sign(u))), -128), 127)
				q.Q[r*cols+g*gs+i] = int8(u)
			}
		}
	}
	return q
}

func sign(x float32) float32 {
	if x < 0 {
		return -1
	}
	return 1
}

// TestWriteQuantizedModels writes models quantized here (not read from an
// export) and reads them back.
func TestWriteQuantizedModels(t *testing.T) {
	tests := []struct {
		name  string
		dir   string
		group int
		asym  bool
		bits4 bool
	}{
		{"llama-int8-g64-sym", "llama-mini", 64, false, false},
		{"qwen3-int8-perchannel-asym", "qwen3-mini", 0, true, false},
		{"llama-int4-g128", "llama-mini", 128, false, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			m, err := hf.Open(filepath.Join(testdata, tc.dir))
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			for l := 0; l < m.Config.Layers; l++ {
				for _, role := range model.Linears {
					w, _ := m.Layer(l, role)
					v, _ := w.Float32()
					q := rtnInt8(v, w.Shape()[0], w.Shape()[1], tc.group, tc.asym)
					if tc.bits4 {
						q.Bits = 4
						for i := range q.Q {
							q.Q[i] = max(min(q.Q[i]/16, 7), -8)
						}
					}
					m.Set(model.Name(l, role), q)
				}
			}
			out := t.TempDir()
			if err := Write(m, out, WriteOptions{}); err != nil {
				t.Fatal(err)
			}
			b, err := Open(out)
			if err != nil {
				t.Fatal(err)
			}
			defer b.Close()
			equalModels(t, m, b)
			d, err := os.ReadFile(filepath.Join(out, DescriptionFile))
			if err != nil {
				t.Fatal(err)
			}
			desc, err := ParseDescription(d)
			if err != nil {
				t.Fatal(err)
			}
			wantType := TypeW8A16
			if tc.bits4 {
				wantType = TypeW4A16
			}
			if desc.ModelQuantType != wantType || desc.GroupSize != tc.group {
				t.Errorf("description: type %s group %d, want %s %d", desc.ModelQuantType, desc.GroupSize, wantType, tc.group)
			}
		})
	}
}
