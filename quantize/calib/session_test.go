package calib

import (
	"math"
	"math/rand/v2"
	"testing"

	"qtool/formats/hf"
	"qtool/formats/model"
	"qtool/quantize"
	"qtool/runtime"
	"qtool/runtime/cpu"
)

// TestSessionMatchesRuntime checks Session.Layer against
// runtime.Model.Layer: with nothing installed, the inputs handed to each
// step and the propagated residual stream must equal what the runtime's
// own forward captures and produces, on llama-mini, qwen3-mini and a
// synthetic layer of W8A8 linears whose down projection has K > 1024 (the
// CPU backend's integer products then run in several k slices).
func TestSessionMatchesRuntime(t *testing.T) {
	for _, name := range []string{"llama-mini", "qwen3-mini", "w8a8-k1280"} {
		t.Run(name, func(t *testing.T) {
			var m *model.Model
			if name == "w8a8-k1280" {
				m = syntheticW8A8(t, 1280)
			} else {
				var err error
				if m, err = hf.Open("../../testdata/" + name); err != nil {
					t.Fatal(err)
				}
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
			download := func(b runtime.Buf) []float32 {
				v := make([]float32, b.Rows()*b.Cols())
				be.Download(v, b)
				return v
			}
			for l := 0; l < m.Config.Layers; l++ {
				want := map[runtime.CapturePoint][]float32{}
				for _, x := range xs {
					ref.Layer(l, x, 0, nil, func(_ int, p runtime.CapturePoint, b runtime.Buf) {
						want[p] = append(want[p], download(b)...)
					})
				}
				steps := 0
				err := s.Layer(l, func(_ int, p runtime.CapturePoint, x runtime.Buf) error {
					steps++
					if d := maxRelDiff(s.Download(x), want[p]); d > 1e-6 {
						t.Errorf("layer %d %s: inputs differ by %g", l, p, d)
					}
					return nil
				})
				if err != nil {
					t.Fatal(err)
				}
				if steps != 4 {
					t.Fatalf("layer %d: %d steps, want 4", l, steps)
				}
				var out []float32
				for _, x := range xs {
					out = append(out, download(x)...)
				}
				if d := maxRelDiff(s.Download(s.Residual()), out); d > 1e-6 {
					t.Errorf("layer %d: residual differs by %g", l, d)
				}
			}
			if _, ok := s.Out.Lookup(model.Name(0, model.Q)); !ok {
				t.Fatal("result model lost tensors")
			}
		})
	}
}

// syntheticW8A8 is a one-layer Llama-shaped model with random weights whose
// seven linears are msmodelslim W8A8 (per-channel int8 weights, static
// per-tensor activations); inter is the down projection's K.
func syntheticW8A8(t *testing.T, inter int) *model.Model {
	t.Helper()
	cfg := model.Config{Arch: model.Llama, Hidden: 128, Intermediate: inter, Layers: 1, Heads: 4, KVHeads: 2,
		HeadDim: 32, Vocab: 256, MaxSeq: 512, RopeTheta: 10000, NormEps: 1e-5, BOS: 1, EOS: []int{2}}
	m := model.New(cfg)
	rng := rand.New(rand.NewPCG(3, 4))
	randn := func(n int, sd float64) []float32 {
		v := make([]float32, n)
		for i := range v {
			v[i] = float32(rng.NormFloat64() * sd)
		}
		return v
	}
	ones := func(n int) []float32 {
		v := make([]float32, n)
		for i := range v {
			v[i] = 1 + float32(rng.NormFloat64()*0.1)
		}
		return v
	}
	H := cfg.Hidden
	m.Set(model.Name(-1, model.Embed), model.FromFloat32([]int{cfg.Vocab, H}, randn(cfg.Vocab*H, 1)))
	m.Set(model.Name(-1, model.LMHead), model.FromFloat32([]int{cfg.Vocab, H}, randn(cfg.Vocab*H, 0.05)))
	m.Set(model.Name(-1, model.FinalNorm), model.FromFloat32([]int{H}, ones(H)))
	m.Set(model.Name(0, model.AttnNorm), model.FromFloat32([]int{H}, ones(H)))
	m.Set(model.Name(0, model.MLPNorm), model.FromFloat32([]int{H}, ones(H)))
	for _, l := range []struct {
		r       model.Role
		out, in int
		lo, hi  float32 // activation range of the input
	}{{model.Q, cfg.QDim(), H, -4, 4}, {model.K, cfg.KVDim(), H, -4, 4}, {model.V, cfg.KVDim(), H, -4, 4},
		{model.O, H, cfg.QDim(), -2, 2}, {model.Gate, inter, H, -4, 4}, {model.Up, inter, H, -4, 4},
		{model.Down, H, inter, -1, 1}} {
		w := randn(l.out*l.in, 1/math.Sqrt(float64(l.in)))
		q, err := quantize.RTN(w, l.out, l.in, quantize.Params{Bits: 8, Rule: quantize.SymZero})
		if err != nil {
			t.Fatal(err)
		}
		scale := (l.hi - l.lo) / 255
		offset := float32(math.RoundToEven(float64(-128 - l.lo/scale)))
		w8 := &model.W8A8{Weight: q, InputScale: scale, InputOffset: offset,
			DeqScale: make([]float32, l.out), QuantBias: make([]int32, l.out)}
		for r := range w8.DeqScale {
			w8.DeqScale[r] = scale * q.Scale[r]
			w8.QuantBias[r] = int32(rng.IntN(2001) - 1000)
		}
		m.Set(model.Name(0, l.r), w8)
	}
	return m
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
