package calib

import (
	"math"
	"testing"

	"qtool/formats/hf"
	"qtool/formats/model"
	"qtool/runtime"
	"qtool/runtime/cpu"
)

// TestSessionMatchesRuntime checks the host half of Session.Layer and
// AttentionOutputs against runtime.Model.Layer: with nothing installed, the
// inputs handed to each step and the propagated residual stream must equal
// what the runtime's own forward captures and produces.
func TestSessionMatchesRuntime(t *testing.T) {
	for _, name := range []string{"llama-mini", "qwen3-mini"} {
		t.Run(name, func(t *testing.T) {
			m, err := hf.Open("../../testdata/" + name)
			if err != nil {
				t.Fatal(err)
			}
			windows := [][]int{make([]int, 48), make([]int, 48)}
			for i := range windows {
				for j := range windows[i] {
					windows[i][j] = (i*977 + j*131 + 7) % m.Config.Vocab
				}
			}
			s, err := NewSession(m, cpu.New(2), windows, 2)
			if err != nil {
				t.Fatal(err)
			}
			ref, err := runtime.Load(m, cpu.New(2))
			if err != nil {
				t.Fatal(err)
			}
			be := ref.Backend()
			xs := make([]runtime.Buf, len(windows))
			for i, w := range windows {
				xs[i] = ref.Embed(w)
			}
			for l := 0; l < m.Config.Layers; l++ {
				want := map[runtime.CapturePoint][]float32{}
				for _, x := range xs {
					ref.Layer(l, x, 0, nil, func(_ int, p runtime.CapturePoint, b runtime.Buf) {
						v := make([]float32, b.Rows()*b.Cols())
						be.Download(v, b)
						want[p] = append(want[p], v...)
					})
				}
				err := s.Layer(l, func(_ int, p runtime.CapturePoint, x []float32, rows int) error {
					if d := maxRelDiff(x, want[p]); d > 1e-4 {
						t.Errorf("layer %d %s: inputs differ by %g", l, p, d)
					}
					return nil
				})
				if err != nil {
					t.Fatal(err)
				}
				var out []float32
				for _, x := range xs {
					v := make([]float32, x.Rows()*x.Cols())
					be.Download(v, x)
					out = append(out, v...)
				}
				if d := maxRelDiff(s.Residual(), out); d > 1e-4 {
					t.Errorf("layer %d: residual differs by %g", l, d)
				}
			}
			if _, ok := s.Out.Lookup(model.Name(0, model.Q)); !ok {
				t.Fatal("result model lost tensors")
			}
		})
	}
}

func maxRelDiff(a, b []float32) float64 {
	if len(a) != len(b) {
		return math.Inf(1)
	}
	scale := 0.0
	for _, v := range b {
		scale = math.Max(scale, math.Abs(float64(v)))
	}
	d := 0.0
	for i := range a {
		d = math.Max(d, math.Abs(float64(a[i]-b[i])))
	}
	return d / math.Max(scale, 1e-30)
}
