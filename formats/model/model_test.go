package model

import (
	"math"
	"strings"
	"testing"
)

func TestNames(t *testing.T) {
	for _, c := range []struct {
		layer int
		role  Role
		name  string
	}{{-1, Embed, "embed"}, {0, Q, "layers.0.q"}, {17, MLPNormBias, "layers.17.mlp_norm_bias"}} {
		if got := Name(c.layer, c.role); got != c.name {
			t.Errorf("Name(%d,%s) = %q", c.layer, c.role, got)
		}
		l, r, ok := ParseName(c.name)
		if !ok || l != c.layer || r != c.role {
			t.Errorf("ParseName(%q) = %d %q %v", c.name, l, r, ok)
		}
	}
	for _, bad := range []string{"", "layers.", "layers.x.q", "layers.1.", "layers.-1.q"} {
		if _, _, ok := ParseName(bad); ok {
			t.Errorf("ParseName(%q) accepted", bad)
		}
	}
}

func TestBF16RoundTrip(t *testing.T) {
	for _, c := range []struct {
		in   float32
		want uint16
	}{{1, 0x3f80}, {-2, 0xc000}, {1.00390625, 0x3f80 /* tie -> even */}, {1.01171875, 0x3f82 /* tie -> even up */}} {
		if got := Float32ToBF16(c.in); got != c.want {
			t.Errorf("Float32ToBF16(%v) = %#x, want %#x", c.in, got, c.want)
		}
	}
	if v := BF16ToFloat32(Float32ToBF16(float32(math.NaN()))); !math.IsNaN(float64(v)) {
		t.Error("NaN lost")
	}
}

func TestRoundF16(t *testing.T) {
	for _, c := range []struct{ in, want float32 }{
		{1, 1}, {1.0 / 3, 0.333251953125}, {1 + 0x1p-11, 1 /* tie -> even */}, {1 + 3*0x1p-11, 1 + 0x1p-9 /* tie -> even up */},
		{65519, 65504}, {65520, float32(math.Inf(1))}, {1e-8, 0}, {-6e-8, -0x1p-24 /* subnormal */},
	} {
		if got := RoundF16(c.in); got != c.want {
			t.Errorf("RoundF16(%v) = %v, want %v", c.in, got, c.want)
		}
	}
	if v := RoundF16(float32(math.NaN())); !math.IsNaN(float64(v)) {
		t.Error("NaN lost")
	}
}

func TestQuantizedDequantize(t *testing.T) {
	// 2 rows x 4 cols, groups of 2; asymmetric 4-bit codes stored minus 8.
	q := &Quantized{Bits: 4, GroupSize: 2, Rows: 2, Cols: 4,
		Q:     []int8{-8, 7, 0, 1, 2, -3, 4, -5},
		Scale: []float32{0.5, 2, 1, 0.25},
		Zero:  []float32{-8, 0, 1, -1},
	}
	if err := q.Validate(); err != nil {
		t.Fatal(err)
	}
	got, _ := q.Float32()
	want := []float32{(-8 + 8) * 0.5, (7 + 8) * 0.5, 0 * 2, 1 * 2, (2 - 1) * 1, (-3 - 1) * 1, (4 + 1) * 0.25, (-5 + 1) * 0.25}
	for i := range want {
		if got[i] != want[i] {
			t.Fatalf("w[%d] = %v, want %v", i, got[i], want[i])
		}
	}
	// act-order groups
	q.GIdx = []int32{1, 0, 1, 0}
	got, _ = q.Float32()
	if got[0] != (-8-0)*2 || got[1] != (7+8)*0.5 {
		t.Fatalf("g_idx dequantization wrong: %v", got[:2])
	}
}

func TestQuantizedValidate(t *testing.T) {
	ok := func() *Quantized {
		return &Quantized{Bits: 8, GroupSize: 0, Rows: 1, Cols: 2, Q: []int8{1, -1}, Scale: []float32{1}}
	}
	for _, c := range []struct {
		name string
		mod  func(*Quantized)
		want string
	}{
		{"bits", func(q *Quantized) { q.Bits = 9 }, "bits"},
		{"group", func(q *Quantized) { q.GroupSize = 3 }, "does not divide"},
		{"values", func(q *Quantized) { q.Q = q.Q[:1] }, "values"},
		{"scales", func(q *Quantized) { q.Scale = nil }, "scales"},
		{"range", func(q *Quantized) { q.Bits = 2; q.Q[0] = 2 }, "outside"},
		{"gidx", func(q *Quantized) { q.GIdx = []int32{0, 1} }, "g_idx"},
		{"nan scale", func(q *Quantized) { q.Scale[0] = float32(math.NaN()) }, "scale NaN of row 0, group 0 is not finite"},
		{"inf zero", func(q *Quantized) { q.Zero = []float32{float32(math.Inf(-1))} }, "zero point -Inf of row 0, group 0 is not finite"},
		{"inf scale by row and group", func(q *Quantized) {
			q.Rows, q.GroupSize, q.Q = 2, 1, []int8{1, 2, 3, 4}
			q.Scale = []float32{1, 1, 1, float32(math.Inf(1))}
		}, "scale +Inf of row 1, group 1 is not finite"},
	} {
		q := ok()
		c.mod(q)
		if err := q.Validate(); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%s: err = %v", c.name, err)
		}
	}
}

func TestCheckShapes(t *testing.T) {
	cfg := Config{Arch: Llama, Hidden: 4, Intermediate: 8, Layers: 1, Heads: 2, KVHeads: 1, HeadDim: 2, Vocab: 5, RopeTheta: 1e4, NormEps: 1e-5}
	m := New(cfg)
	set := func(name string, shape ...int) { m.Set(name, FromFloat32(shape, make([]float32, NumElements(shape)))) }
	set("embed", 5, 4)
	set("norm", 4)
	set("lm_head", 5, 4)
	set("layers.0.attn_norm", 4)
	set("layers.0.mlp_norm", 4)
	set("layers.0.q", 4, 4)
	set("layers.0.k", 2, 4)
	set("layers.0.v", 2, 4)
	set("layers.0.o", 4, 4)
	set("layers.0.gate", 8, 4)
	set("layers.0.up", 8, 4)
	set("layers.0.down", 4, 8)
	if err := m.CheckShapes(); err != nil {
		t.Fatal(err)
	}
	set("layers.0.k", 4, 4)
	if err := m.CheckShapes(); err == nil || !strings.Contains(err.Error(), `"layers.0.k" has shape [4 4]`) {
		t.Fatalf("err = %v", err)
	}
	m.Delete("layers.0.k")
	if err := m.CheckShapes(); err == nil || !strings.Contains(err.Error(), `"layers.0.k" is missing`) {
		t.Fatalf("err = %v", err)
	}
}
