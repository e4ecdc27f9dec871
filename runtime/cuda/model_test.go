package cuda

import (
	"math"
	"os"
	"path/filepath"
	"testing"

	"qtool/formats/hf"
	"qtool/runtime"
	"qtool/runtime/runtimetest"
)

type reference struct {
	LogitsInputIDs  []int     `json:"logits_input_ids"`
	LogitsLast      []float64 `json:"logits_last"`
	GreedyPromptIDs []int     `json:"greedy_prompt_ids"`
	GreedyIDs       []int     `json:"greedy_ids"`
	PPLFirst20      float64   `json:"ppl_fp32_first20/sotu-test.raw"`
	PPLFull         float64   `json:"ppl_fp32/sotu-test.raw"`
}

// loadFixture loads the float test model in dir on b, with its reference.
func loadFixture(t *testing.T, b *Backend, dir string) (*runtime.Model, reference) {
	t.Helper()
	var ref reference
	runtimetest.ReadJSON(t, filepath.Join(dir, "reference.json"), &ref)
	m, err := hf.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	rm, err := runtime.Load(m, b)
	if err != nil {
		t.Fatal(err)
	}
	return rm, ref
}

// TestModels runs the float test models end to end on the GPU through the
// shared forward pass and checks them against reference.json (HF fp32):
// last-position logits, greedy ids (plain and CUDA-graph decode) and the
// perplexity of the first 20 chunks of sotu-test (all chunks with
// QTOOL_GPU_LONG=1) within 0.1 %.
func TestModels(t *testing.T) {
	b := newTestBackend(t)
	for _, name := range []string{"llama-mini", "qwen3-mini"} {
		t.Run(name, func(t *testing.T) {
			dir := filepath.Join("..", "..", "testdata", name)
			rm, ref := loadFixture(t, b, dir)
			vocab := rm.Config().Vocab

			// Logits of the last position.
			lg := rm.Forward(ref.LogitsInputIDs, 0, nil)
			all := download(b, lg)
			b.Free(lg)
			last := all[len(all)-vocab:]
			checkClose(t, "last logits vs HF fp32", last, ref.LogitsLast, 2e-3)

			// Greedy decoding, token by token.
			cache := rm.NewCache(256)
			prompt := ref.GreedyPromptIDs
			want := ref.GreedyIDs[len(prompt):]
			lg = rm.Forward(prompt, 0, cache)
			next := b.Argmax(lg)[len(prompt)-1]
			b.Free(lg)
			got := []int{next}
			for len(got) < len(want) {
				pos := len(prompt) + len(got) - 1
				lg = rm.Forward([]int{next}, pos, cache)
				next = b.Argmax(lg)[0]
				b.Free(lg)
				got = append(got, next)
			}
			same := 0
			for same < len(want) && got[same] == want[same] {
				same++
			}
			if same < len(want) {
				t.Errorf("greedy ids differ from HF at %d: got %v, want %v", same, got, want)
			} else {
				t.Logf("greedy: %d ids equal HF", len(want))
			}

			// The same decode replayed as a CUDA graph.
			pos := len(prompt)
			lg = rm.Forward([]int{got[0]}, pos, cache) // warm-up step: buffers and scratch
			b.Free(lg)
			if err := b.BeginCapture(pos, 256); err != nil {
				t.Fatal(err)
			}
			lg = rm.Forward([]int{0}, pos, cache)
			b.GreedyAdvance(lg)
			b.Free(lg)
			g, err := b.EndCapture()
			if err != nil {
				t.Fatal(err)
			}
			b.SetDecodeState(got[0], pos)
			for i := 1; i < len(want); i++ {
				g.Launch()
			}
			hist := b.History(pos, pos+len(want)-1)
			for i, id := range hist {
				if id != want[i+1] {
					t.Errorf("graph decode: id %d = %d, want %d (all: %v)", i+1, id, want[i+1], hist)
					break
				}
			}
			g.Destroy()
			b.FreeKVCache(cache)

			// runtime.Generate, with graphs (the default) and without.
			for _, noGraph := range []bool{false, true} {
				var tm runtime.GenTiming
				out, err := runtime.Generate(rm, prompt, runtime.GenOptions{MaxNew: len(want), EOS: []int{}, NoGraph: noGraph, Timing: &tm})
				if err != nil {
					t.Fatal(err)
				}
				// steady: with graphs after two steps and a chunk of 16 replays, else after the first token
				steady := len(want) - 1
				if !noGraph {
					steady = max(0, len(want)-2-16)
				}
				if tm.FirstToken <= 0 || tm.SteadyTokens != steady || (steady > 0) != (tm.Steady > 0) {
					t.Errorf("Generate (NoGraph %v): timing %+v, want %d steady tokens", noGraph, tm, steady)
				}
				for i := range want {
					if i >= len(out) || out[i] != want[i] {
						t.Errorf("Generate (NoGraph %v): %v, want %v", noGraph, out, want)
						break
					}
				}
				// Declaring the 7th greedy token an EOS stops before it
				// (inside the first chunk of graph replays).
				stop, err := runtime.Generate(rm, prompt, runtime.GenOptions{MaxNew: len(want), EOS: []int{want[6]}, NoGraph: noGraph})
				if err != nil || len(stop) > 6 || len(stop) < 2 || stop[len(stop)-1] == want[6] {
					t.Errorf("Generate (NoGraph %v) with EOS %d: %v, %v", noGraph, want[6], stop, err)
				}
			}

			// Perplexity.
			var ids []int
			runtimetest.ReadJSON(t, filepath.Join(dir, "ids-sotu-test.raw.json"), &ids)
			opt, wantPPL := runtime.PPLOptions{MaxChunks: 20}, ref.PPLFirst20
			if os.Getenv("QTOOL_GPU_LONG") != "" {
				opt.MaxChunks, wantPPL = 0, ref.PPLFull
			}
			res, err := runtime.Perplexity(rm, ids, opt)
			if err != nil {
				t.Fatal(err)
			}
			rel := math.Abs(res.PPL-wantPPL) / wantPPL
			t.Logf("%s: %v; reference %.4f; relative difference %.2e", name, res, wantPPL, rel)
			if rel > 1e-3 {
				t.Errorf("perplexity %.4f differs from the reference %.4f by %.3g%% (> 0.1%%)", res.PPL, wantPPL, 100*rel)
			}
		})
	}
}

// TestKVHalf runs llama-mini with an fp16 KV cache: the perplexity of 8
// chunks within 1e-3 of the fp32 cache's, and the reference's greedy ids.
func TestKVHalf(t *testing.T) {
	b := newTestBackend(t)
	dir := filepath.Join("..", "..", "testdata", "llama-mini")
	rm, ref := loadFixture(t, b, dir)
	var ids []int
	runtimetest.ReadJSON(t, filepath.Join(dir, "ids-sotu-test.raw.json"), &ids)
	defer func() { b.Options().KVHalf = false }()
	var ppl [2]float64
	for i, half := range []bool{false, true} {
		b.Options().KVHalf = half
		r, err := runtime.Perplexity(rm, ids, runtime.PPLOptions{MaxChunks: 8})
		if err != nil {
			t.Fatal(err)
		}
		ppl[i] = r.PPL
		prompt, want := ref.GreedyPromptIDs, ref.GreedyIDs[len(ref.GreedyPromptIDs):]
		out, err := runtime.Generate(rm, prompt, runtime.GenOptions{MaxNew: len(want), EOS: []int{}})
		if err != nil {
			t.Fatal(err)
		}
		same := 0
		for same < len(out) && same < len(want) && out[same] == want[same] {
			same++
		}
		t.Logf("KVHalf %v: ppl %.6f (8 chunks); greedy %d of %d ids equal the reference", half, r.PPL, same, len(want))
		if same < len(want) {
			t.Errorf("KVHalf %v: greedy ids %v, reference %v", half, out, want)
		}
	}
	if d := math.Abs(ppl[1]/ppl[0] - 1); d > 1e-3 {
		t.Errorf("fp16 cache ppl %.6f, fp32 %.6f: %.2e apart", ppl[1], ppl[0], d)
	}
}
