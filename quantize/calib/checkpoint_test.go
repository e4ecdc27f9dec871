package calib

import (
	"fmt"
	"math"
	"os"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"qtool/formats/model"
)

// TestCheckpointRoundTrip saves a layer holding every tensor type the
// quantizers install (and a removed bias) and reads it back exactly.
func TestCheckpointRoundTrip(t *testing.T) {
	dir := filepath.Join(t.TempDir(), ".out.resume")
	key := []KeyField{{"command", "gptq"}, {"--bits", "4"}}
	c, err := OpenCheckpoint(dir, key)
	if err != nil {
		t.Fatal(err)
	}
	if c.LayersDone() != 0 {
		t.Fatalf("new work directory: %d layers done", c.LayersDone())
	}
	if _, err := OpenCheckpoint(dir, key); err == nil || !strings.Contains(err.Error(), "in use by another run") {
		t.Fatalf("second open while locked: %v", err)
	}
	q := &model.Quantized{Bits: 4, GroupSize: 2, Rows: 2, Cols: 4, Q: []int8{-8, 7, 0, 1, 2, 3, -1, -2},
		Scale: []float32{0.5, 0.25, 1e-7, 3}, Zero: []float32{1, -2, 0.5, 0}, GIdx: []int32{1, 0, 1, 0}}
	w := &model.W8A8{Weight: &model.Quantized{Bits: 8, Rows: 1, Cols: 3, Q: []int8{-127, 0, 127}, Scale: []float32{0.1}},
		InputScale: 0.02, InputOffset: -3, DeqScale: []float32{0.002}, QuantBias: []int32{-5}, Bias: []float32{0.25}}
	d := model.FromFloat32([]int{3}, []float32{1, float32(math.Inf(1)), -0})
	out := model.New(model.Config{})
	out.Set("q", q)
	out.Set("w", w)
	out.Set("d", d)
	out.Set("untouched", model.FromFloat32([]int{1}, []float32{9}))
	for _, n := range []string{"q", "w", "d", "gone"} {
		c.touch(n)
	}
	c.Stat(ModuleStat{Layer: 0, Role: model.Q, Loss: 0.125, RelErr: 1e-3, Note: "damp 0.01"})
	resid := []float32{1, -2, 3.5, float32(math.SmallestNonzeroFloat32), 5, 6}
	if err := c.layerDone(0, out, resid, 2, 3); err != nil {
		t.Fatal(err)
	}
	c.Close()

	c, err = OpenCheckpoint(dir, key)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if c.LayersDone() != 1 {
		t.Fatalf("reopened: %d layers done, want 1", c.LayersDone())
	}
	back := model.New(model.Config{})
	back.Set("gone", model.FromFloat32([]int{1}, []float32{1}))
	got, err := c.apply(back, 2, 3)
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, resid) {
		t.Errorf("residual %v, want %v", got, resid)
	}
	for n, want := range map[string]model.Tensor{"q": q, "w": w, "d": d} {
		if tt, _ := back.Lookup(n); !reflect.DeepEqual(tt, want) {
			t.Errorf("%s: read back %#v, want %#v", n, tt, want)
		}
	}
	if _, ok := back.Lookup("gone"); ok {
		t.Error("a removed tensor is back")
	}
	if _, ok := back.Lookup("untouched"); ok {
		t.Error("a tensor the layer did not touch was saved")
	}
	if st := c.ResumedStats(); len(st) != 1 || st[0].Loss != 0.125 || st[0].Note != "damp 0.01" {
		t.Errorf("stats %+v", st)
	}
	if _, err := c.apply(model.New(model.Config{}), 3, 3); err == nil {
		t.Error("a residual of another shape was accepted")
	}
	c.Close()
	_, err = OpenCheckpoint(dir, []KeyField{{"command", "gptq"}, {"--bits", "3"}, {"--sym", "true"}})
	if err == nil || !strings.Contains(err.Error(), "--bits: 4 in the work dir, 3 now; --sym: absent in the work dir, true now") {
		t.Fatalf("other key: %v", err)
	}
}

// BenchmarkCheckpointLayer7B saves one layer of the 7B shape (hidden 4096,
// intermediate 11008, 4-bit group-128 codes) with the residual stream of
// the default calibration (128 × 512 tokens: 1 GiB) to a temporary
// directory: the cost --resume adds per layer. Set QTOOL_BENCH_7B=1.
func BenchmarkCheckpointLayer7B(b *testing.B) {
	if os.Getenv("QTOOL_BENCH_7B") == "" {
		b.Skip("set QTOOL_BENCH_7B=1 (needs about 4 GiB of memory and disk)")
	}
	const H, I, rows = 4096, 11008, 128 * 512
	out := model.New(model.Config{})
	lin := func(name string, r, c int) {
		g := c / 128
		q := &model.Quantized{Bits: 4, GroupSize: 128, Rows: r, Cols: c, Q: make([]int8, r*c),
			Scale: make([]float32, r*g), Zero: make([]float32, r*g)}
		for i := range q.Q {
			q.Q[i] = int8(i%16 - 8)
		}
		out.Set(name, q)
	}
	for _, n := range []string{"q", "k", "v", "o"} {
		lin(n, H, H)
	}
	lin("gate", I, H)
	lin("up", I, H)
	lin("down", H, I)
	resid := make([]float32, rows*H)
	for i := range resid {
		resid[i] = float32(i % 1000)
	}
	dir := b.TempDir()
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		c, err := OpenCheckpoint(filepath.Join(dir, fmt.Sprint(i)), nil)
		if err != nil {
			b.Fatal(err)
		}
		for _, n := range out.Names() {
			c.touch(n)
		}
		if err := c.layerDone(0, out, resid, rows, H); err != nil {
			b.Fatal(err)
		}
		c.Remove()
	}
}
