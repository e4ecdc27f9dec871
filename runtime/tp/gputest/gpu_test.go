// Package gputest runs the tensor-parallel backend over CUDA rank backends,
// one GPU each, with NCCL; it skips without two GPUs. It is a separate
// package so that package tp does not depend on the CUDA backend.
package gputest

import (
	"math"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"qtool/formats/hf"
	"qtool/formats/shard"
	"qtool/runtime"
	"qtool/runtime/cuda"
	"qtool/runtime/cuda/driver"
	"qtool/runtime/runtimetest"
	"qtool/runtime/tp"
)

const testdata = "../../../testdata"

// The CUDA backend is what package tp drives as a device rank with the
// all-reduce over peer memory, its GEMVs sending their rows to it.
var (
	_ tp.PeerRank   = (*cuda.Backend)(nil)
	_ tp.PeerSender = (*cuda.Backend)(nil)
)

type reference struct {
	LogitsInputIDs  []int     `json:"logits_input_ids"`
	LogitsLast      []float64 `json:"logits_last"`
	GreedyPromptIDs []int     `json:"greedy_prompt_ids"`
	GreedyIDs       []int     `json:"greedy_ids"`
}

func needGPUs(t *testing.T, n int) {
	t.Helper()
	drv, err := driver.Open()
	if err != nil {
		t.Skipf("no CUDA driver: %v", err)
	}
	if c, err := drv.DeviceCount(); err != nil || c < n {
		t.Skipf("needs %d GPUs (have %d, %v)", n, c, err)
	}
}

func newRank(d int) (runtime.Backend, error) { return cuda.NewRank(d) }

func forward(t *testing.T, rm *runtime.Model, ids []int) []float32 {
	be := rm.Backend()
	out := rm.Forward(ids, 0, nil)
	all := make([]float32, out.Rows()*out.Cols())
	be.Download(all, out)
	be.Free(out)
	return all
}

func maxRel(got []float32, want []float64) float64 {
	num, den := 0.0, 0.0
	for i := range want {
		num = max(num, math.Abs(float64(got[i])-want[i]))
		den = max(den, math.Abs(want[i]))
	}
	return num / den
}

func widen(v []float32) []float64 {
	out := make([]float64, len(v))
	for i, x := range v {
		out[i] = float64(x)
	}
	return out
}

// TestCUDATP2 compares TP=2 over two GPUs (in memory and from a shard
// directory) with one GPU: logits and the perplexity of 4 chunks; and
// TP=2's logits of a 600-token prefill with and without the
// sequence-parallel exchanges, which must be equal.
func TestCUDATP2(t *testing.T) {
	needGPUs(t, 2)
	for _, name := range []string{"llama-mini", "qwen3-mini"} {
		t.Run(name, func(t *testing.T) {
			dir := filepath.Join(testdata, name)
			var ref reference
			runtimetest.ReadJSON(t, filepath.Join(dir, "reference.json"), &ref)
			var ids []int
			runtimetest.ReadJSON(t, filepath.Join(dir, "ids-sotu-test.raw.json"), &ids)
			m, err := hf.Open(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			one, err := newRank(0)
			if err != nil {
				t.Fatal(err)
			}
			defer one.Close()
			rm1, err := runtime.Load(m, one)
			if err != nil {
				t.Fatal(err)
			}
			be, err := tp.NewGPU(m, 2, newRank)
			if err != nil {
				t.Fatal(err)
			}
			defer be.Close()
			be.SetGroupedCollectives(os.Getenv("QTOOL_TP_GROUPED") != "")
			t.Logf("backend %s, device collectives %v (grouped %v)", be.Name(), be.DeviceCollectives(), os.Getenv("QTOOL_TP_GROUPED") != "")
			rm2, err := runtime.Load(m, be)
			if err != nil {
				t.Fatal(err)
			}
			want := forward(t, rm1, ref.LogitsInputIDs)
			got := forward(t, rm2, ref.LogitsInputIDs)
			if err := be.PeerMemoryErr(); err != nil {
				t.Logf("all-reduces through NCCL only: %v", err)
			} else { // the same sums through NCCL: a + b either way for two ranks
				be.SetPeerLimit(0)
				viaNCCL := forward(t, rm2, ref.LogitsInputIDs)
				be.SetPeerLimit(tp.DefaultPeerBytes)
				d := maxRel(viaNCCL, widen(got))
				t.Logf("logits with the all-reduces over peer memory vs through NCCL: max rel %.3g", d)
				if d != 0 {
					t.Errorf("the all-reduce over peer memory changes the logits by %.3g", d)
				}
			}
			if be.PeerMemoryErr() == nil { // a prefill of more rows than a tile a rank: sequence-parallel exchanges where the products scatter
				long := ids[:min(len(ids), 600)]
				calls := be.SequenceParallelCalls()
				seq := forward(t, rm2, long)
				calls = be.SequenceParallelCalls() - calls
				be.SetSequenceParallel(false)
				ar := forward(t, rm2, long)
				be.SetSequenceParallel(true)
				d := maxRel(seq, widen(ar))
				t.Logf("logits of %d tokens with sequence-parallel exchanges (%d operations) vs all-reduces: max rel %.3g", len(long), calls, d)
				if d != 0 {
					t.Errorf("the sequence-parallel exchanges change the logits by %.3g", d)
				}
			}
			V := m.Config.Vocab
			rel := maxRel(got, widen(want))
			relRef := maxRel(got[len(got)-V:], ref.LogitsLast)
			t.Logf("TP=2 vs 1 GPU: max rel %.3g; TP=2 last logits vs reference.json: max rel %.3g", rel, relRef)
			if rel > 2e-3 || relRef > 2e-3 {
				t.Errorf("TP=2 logits off: %.3g vs one GPU, %.3g vs reference", rel, relRef)
			}
			checkGathered(t, be, rm2, ref.LogitsInputIDs, got)
			checkGenerate(t, rm1, rm2, ref)
			opt := runtime.PPLOptions{MaxChunks: 4}
			p1, err := runtime.Perplexity(rm1, ids, opt)
			if err != nil {
				t.Fatal(err)
			}
			p2, err := runtime.Perplexity(rm2, ids, opt)
			if err != nil {
				t.Fatal(err)
			}
			d := math.Abs(p2.PPL-p1.PPL) / p1.PPL
			t.Logf("ppl 4 chunks: TP=2 %.5f, 1 GPU %.5f, rel %.2e", p2.PPL, p1.PPL, d)
			if d > 1e-3 {
				t.Errorf("TP=2 ppl %.5f vs %.5f", p2.PPL, p1.PPL)
			}

			sd := t.TempDir()
			if _, err := shard.Write(m, 2, sd); err != nil {
				t.Fatal(err)
			}
			sm, err := tp.OpenModel(sd)
			if err != nil {
				t.Fatal(err)
			}
			defer sm.Close()
			be2, err := tp.NewGPU(sm, 0, newRank)
			if err != nil {
				t.Fatal(err)
			}
			defer be2.Close()
			rm3, err := runtime.Load(sm, be2)
			if err != nil {
				t.Fatal(err)
			}
			fromDir := forward(t, rm3, ref.LogitsInputIDs)
			if r := maxRel(fromDir, widen(got)); r > 1e-6 {
				t.Errorf("TP=2 from the shard directory differs by %.3g", r)
			}
		})
	}
}

// checkGenerate compares greedy generation at TP=2, replaying a captured
// decode step per rank (NCCL inside the graphs) and step by step, with one
// GPU's and with the reference's greedy ids.
func checkGenerate(t *testing.T, one, two *runtime.Model, ref reference) {
	t.Helper()
	prompt, want := ref.GreedyPromptIDs, ref.GreedyIDs[len(ref.GreedyPromptIDs):]
	gen := func(rm *runtime.Model, noGraph bool) []int {
		out, err := runtime.Generate(rm, prompt, runtime.GenOptions{MaxNew: len(want), EOS: []int{}, NoGraph: noGraph})
		if err != nil {
			t.Fatal(err)
		}
		return out
	}
	g1, g2, g2plain := gen(one, false), gen(two, false), gen(two, true)
	if !slices.Equal(g2, g2plain) || !slices.Equal(g2, g1) {
		t.Errorf("greedy ids: TP=2 graph %v, TP=2 step by step %v, 1 GPU graph %v", g2, g2plain, g1)
	}
	same := 0
	for same < len(want) && g2[same] == want[same] {
		same++
	}
	t.Logf("greedy: TP=2 with graphs = step by step = 1 GPU (%d ids); %d of %d equal the reference", len(g2), same, len(want))
	if same < len(want)/2 {
		t.Errorf("TP=2 greedy ids %v, reference %v", g2, want)
	}
}

// checkGathered compares Argmax and NLL of the TP backend, which all-gather
// the vocabulary-split logits on the devices, with the same computed on the
// host from logits (those of ids, downloaded piecewise).
func checkGathered(t *testing.T, be *tp.Backend, rm *runtime.Model, ids []int, logits []float32) {
	t.Helper()
	V := rm.Config().Vocab
	targets := append(slices.Clone(ids[1:]), ids[0])
	out := rm.Forward(ids, 0, nil)
	am := be.Argmax(out)
	nll := make([]float64, len(ids))
	be.NLL(nll, out, targets)
	be.Free(out)
	dNLL := 0.0
	for i := range ids {
		row := logits[i*V : (i+1)*V]
		best, m := 0, math.Inf(-1)
		for j, v := range row {
			if float64(v) > m {
				best, m = j, float64(v)
			}
		}
		if am[i] != best {
			t.Errorf("row %d: argmax %d, host %d", i, am[i], best)
		}
		sum := 0.0
		for _, v := range row {
			sum += math.Exp(float64(v) - m)
		}
		want := m + math.Log(sum) - float64(row[targets[i]])
		dNLL = max(dNLL, math.Abs(nll[i]-want))
	}
	t.Logf("all-gathered logits: argmax of %d rows as on the host; NLL max |Δ| %.3g", len(ids), dNLL)
	if dNLL > 1e-3 {
		t.Errorf("NLL of the all-gathered logits off by %.3g", dNLL)
	}
}
