package awq

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"qtool/formats/model"
	"qtool/quantize/calib"
	"qtool/runtime"
	"qtool/runtime/cpu"
)

// tinyModel is a random one-layer Llama without GQA (so the v → o scale group
// applies) with a few outlier input channels.
func tinyModel(kvHeads int) *model.Model {
	cfg := model.Config{Arch: model.Llama, Hidden: 64, Intermediate: 128, Layers: 1, Heads: 2, KVHeads: kvHeads,
		HeadDim: 32, Vocab: 50, MaxSeq: 128, RopeTheta: 10000, NormEps: 1e-5, BOS: 1}
	rng := rand.New(rand.NewPCG(42, 7))
	m := model.New(cfg)
	mat := func(r, c int, sd float64) *model.Dense {
		v := make([]float32, r*c)
		for i := range v {
			v[i] = float32(rng.NormFloat64() * sd)
		}
		return model.FromFloat32([]int{r, c}, v)
	}
	norm := func() *model.Dense {
		v := make([]float32, cfg.Hidden)
		for i := range v {
			v[i] = 1
			if i%17 == 3 {
				v[i] = 8 // outlier channels
			}
		}
		return model.FromFloat32([]int{cfg.Hidden}, v)
	}
	m.Set(model.Name(-1, model.Embed), mat(cfg.Vocab, cfg.Hidden, 1))
	m.Set(model.Name(-1, model.FinalNorm), norm())
	m.Set(model.Name(-1, model.LMHead), mat(cfg.Vocab, cfg.Hidden, 0.1))
	m.Set(model.Name(0, model.AttnNorm), norm())
	m.Set(model.Name(0, model.MLPNorm), norm())
	m.Set(model.Name(0, model.Q), mat(cfg.QDim(), cfg.Hidden, 0.1))
	m.Set(model.Name(0, model.K), mat(cfg.KVDim(), cfg.Hidden, 0.1))
	m.Set(model.Name(0, model.V), mat(cfg.KVDim(), cfg.Hidden, 0.1))
	m.Set(model.Name(0, model.O), mat(cfg.Hidden, cfg.QDim(), 0.1))
	m.Set(model.Name(0, model.Gate), mat(cfg.Intermediate, cfg.Hidden, 0.1))
	m.Set(model.Name(0, model.Up), mat(cfg.Intermediate, cfg.Hidden, 0.1))
	m.Set(model.Name(0, model.Down), mat(cfg.Hidden, cfg.Intermediate, 0.1))
	return m
}

func logits(t *testing.T, m *model.Model, ids []int) []float32 {
	t.Helper()
	rt, err := runtime.Load(m, cpu.New(1))
	if err != nil {
		t.Fatal(err)
	}
	b := rt.Forward(ids, 0, nil)
	out := make([]float32, b.Rows()*b.Cols())
	rt.Backend().Download(out, b)
	return out
}

// TestQuantizeModelTiny runs the whole AWQ flow (including v → o, which the
// GQA test models never reach) on a tiny model and checks that the result is
// a 3-bit model whose logits stay close to the float model, closer than
// plain RTN's.
func TestQuantizeModelTiny(t *testing.T) {
	for _, kv := range []int{2, 1} {
		m := tinyModel(kv)
		rng := rand.New(rand.NewPCG(1, 1))
		windows := make([][]int, 4)
		for i := range windows {
			windows[i] = make([]int, 64)
			for j := range windows[i] {
				windows[i][j] = rng.IntN(50)
			}
		}
		s, err := calib.NewSession(m, cpu.New(1), windows, 1)
		if err != nil {
			t.Fatal(err)
		}
		stats, err := QuantizeModel(s, Options{Bits: 3, GroupSize: 32}, nil)
		if err != nil {
			t.Fatal(err)
		}
		vo := false
		for _, st := range stats {
			vo = vo || strings.Contains(st.Note, "v→o")
		}
		if vo != (kv == 2) {
			t.Fatalf("kv heads %d: v→o applied = %v", kv, vo)
		}
		for _, r := range model.Linears {
			tq, _ := s.Out.Lookup(model.Name(0, r))
			if q, ok := tq.(*model.Quantized); !ok || q.Bits != 3 || q.GroupSize != 32 {
				t.Fatalf("%s is %T, want 3-bit g32", r, tq)
			}
		}
		// RTN of the same model for comparison.
		rtn := tinyModel(kv)
		opt := Options{Bits: 3, GroupSize: 32}.WithDefaults()
		for _, r := range model.Linears {
			tw, _ := rtn.Lookup(model.Name(0, r))
			w, _ := tw.Float32()
			sh := tw.Shape()
			q, err := opt.Quantize(w, sh[0], sh[1])
			if err != nil {
				t.Fatal(err)
			}
			rtn.Set(model.Name(0, r), q)
		}
		ids := windows[0]
		ref := logits(t, m, ids)
		errOf := func(x []float32) float64 {
			e, n := 0.0, 0.0
			for i := range x {
				e += math.Pow(float64(x[i]-ref[i]), 2)
				n += math.Pow(float64(ref[i]), 2)
			}
			return e / n
		}
		ea, er := errOf(logits(t, s.Out, ids)), errOf(logits(t, rtn, ids))
		t.Logf("kv %d: relative logit error AWQ %.3g, RTN %.3g", kv, ea, er)
		if ea >= er {
			t.Fatalf("AWQ (%g) should beat RTN (%g) on its calibration tokens", ea, er)
		}
	}
}
