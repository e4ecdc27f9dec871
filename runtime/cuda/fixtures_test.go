package cuda

import (
	"math"
	"os"
	"path/filepath"
	"testing"

	"qtool/convert"
	"qtool/formats/kuiper"
	"qtool/formats/model"
	"qtool/runtime"
	"qtool/runtime/cpu"
	"qtool/runtime/runtimetest"
)

// TestFixtures checks quantized model files end to end, GPU against the CPU
// backend (perplexity of the first 20 sotu chunks within 0.1 %, greedy ids
// equal) and, where reference.json has one, the GPU full-text perplexity
// against it within 0.1 %. Fixtures are read from $QTOOL_GPU_FIXTURES (a
// directory with llama-mini.q8.bin, qwen3-mini.ak48.bin, msmodelslim
// directories), testdata/msmodelslim and ../shared/models/msmodelslim.
func TestFixtures(t *testing.T) {
	b := newTestBackend(t)
	fx := os.Getenv("QTOOL_GPU_FIXTURES")
	shared := filepath.Join("..", "..", "..", "shared", "models", "msmodelslim")
	type fixture struct {
		name, path, ids string
		refFile, refKey string
	}
	llamaIDs := filepath.Join("..", "..", "testdata", "llama-mini")
	qwenIDs := filepath.Join("..", "..", "testdata", "qwen3-mini")
	var fixtures []fixture
	add := func(name, path, ids, refFile, refKey string) {
		if _, err := os.Stat(path); err == nil {
			fixtures = append(fixtures, fixture{name, path, ids, refFile, refKey})
		}
	}
	msRef := filepath.Join("..", "..", "testdata", "msmodelslim", "reference.json")
	add("msmodelslim-w8a8-smooth", filepath.Join("..", "..", "testdata", "msmodelslim", "llama-mini-w8a8-smooth"), llamaIDs, msRef, "llama-mini-w8a8-smooth")
	for _, d := range []string{fx, shared} {
		if d == "" {
			continue
		}
		add("msmodelslim-w8a16-g128", filepath.Join(d, "llama-mini-w8a16-g128"), llamaIDs, msRef, "llama-mini-w8a16-g128")
		add("msmodelslim-w8a16-perchannel", filepath.Join(d, "llama-mini-w8a16-perchannel"), llamaIDs, msRef, "llama-mini-w8a16-perchannel")
	}
	if fx != "" {
		add("kuiper-q8-g64", filepath.Join(fx, "llama-mini.q8.bin"), llamaIDs, filepath.Join(llamaIDs, "reference.json"), "ppl_kuiper_q8_g64/sotu-test.raw")
		add("ak48-int4-g128", filepath.Join(fx, "qwen3-mini.ak48.bin"), qwenIDs, filepath.Join(qwenIDs, "reference.json"), "ppl_rtn_int4_asym_g128/sotu-test.raw")
	}
	if len(fixtures) == 0 {
		t.Skip("no quantized fixtures found")
	}
	seen := map[string]bool{}
	for _, f := range fixtures {
		if seen[f.name] {
			continue
		}
		seen[f.name] = true
		t.Run(f.name, func(t *testing.T) {
			var m *model.Model
			var err error
			if fi, e := os.Stat(f.path); e == nil && !fi.IsDir() {
				m, err = kuiper.Open(f.path, kuiper.OpenOptions{})
			} else {
				m, err = convert.Open(f.path)
			}
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			var ids []int
			runtimetest.ReadJSON(t, filepath.Join(f.ids, "ids-sotu-test.raw.json"), &ids)
			var ref reference
			runtimetest.ReadJSON(t, filepath.Join(f.ids, "reference.json"), &ref)

			gm, err := runtime.Load(m, b)
			if err != nil {
				t.Fatal(err)
			}
			cb := cpu.New(0)
			defer cb.Close()
			cm, err := runtime.Load(m, cb)
			if err != nil {
				t.Fatal(err)
			}
			opt := runtime.PPLOptions{MaxChunks: 20}
			gp, err := runtime.Perplexity(gm, ids, opt)
			if err != nil {
				t.Fatal(err)
			}
			cp, err := runtime.Perplexity(cm, ids, opt)
			if err != nil {
				t.Fatal(err)
			}
			rel := math.Abs(gp.PPL-cp.PPL) / cp.PPL
			t.Logf("%s: first 20 chunks: GPU ppl %.4f, CPU ppl %.4f, relative difference %.2e", f.name, gp.PPL, cp.PPL, rel)
			if rel > 1e-4 {
				t.Errorf("GPU perplexity %.4f differs from CPU %.4f by %.3g%%", gp.PPL, cp.PPL, 100*rel)
			}
			gg := greedy(gm, ref.GreedyPromptIDs, 24)
			cg := greedy(cm, ref.GreedyPromptIDs, 24)
			for i := range cg {
				if gg[i] != cg[i] {
					t.Errorf("greedy ids differ at %d: GPU %v, CPU %v", i, gg, cg)
					break
				}
			}
			full, err := runtime.Perplexity(gm, ids, runtime.PPLOptions{})
			if err != nil {
				t.Fatal(err)
			}
			var refs map[string]any
			runtimetest.ReadJSON(t, f.refFile, &refs)
			var want float64
			if v, ok := refs[f.refKey].(float64); ok {
				want = v
			} else if v, ok := refs[f.refKey].(map[string]any); ok {
				want, _ = v["sotu-test.raw"].(float64)
			}
			if want > 0 {
				r := math.Abs(full.PPL-want) / want
				t.Logf("%s: full sotu GPU %v; reference %s = %.4f; relative difference %.2e", f.name, full, f.refKey, want, r)
				if r > 1e-3 {
					t.Errorf("full perplexity %.4f differs from the reference %.4f by %.3g%%", full.PPL, want, 100*r)
				}
			}
		})
	}
}

// greedy decodes n tokens after prompt, one token per step.
func greedy(m *runtime.Model, prompt []int, n int) []int {
	be := m.Backend()
	cache := m.NewCache(len(prompt) + n + 1)
	lg := m.Forward(prompt, 0, cache)
	next := be.Argmax(lg)[len(prompt)-1]
	be.Free(lg)
	out := []int{next}
	for len(out) < n {
		lg = m.Forward([]int{next}, len(prompt)+len(out)-1, cache)
		next = be.Argmax(lg)[0]
		be.Free(lg)
		out = append(out, next)
	}
	return out
}
