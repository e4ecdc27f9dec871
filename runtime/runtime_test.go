package runtime_test

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"testing"

	"qtool/convert"
	"qtool/formats/hf"
	"qtool/formats/kuiper"
	"qtool/formats/model"
	"qtool/runtime"
	"qtool/runtime/cpu"
	"qtool/runtime/runtimetest"
)

const testdata = "../testdata"

// reference is the subset of a model's reference.json the tests use.
type reference struct {
	LogitsInputIDs  []int     `json:"logits_input_ids"`
	LogitsLast      []float64 `json:"logits_last"`
	Top5            [][]int   `json:"top5_per_position"`
	GreedyPromptIDs []int     `json:"greedy_prompt_ids"`
	GreedyIDs       []int     `json:"greedy_ids"`
	raw             map[string]json.RawMessage
}

func (r *reference) num(t testing.TB, key string) float64 {
	t.Helper()
	v, ok := r.raw[key]
	if !ok {
		t.Fatalf("reference.json has no %q", key)
	}
	var f float64
	if err := json.Unmarshal(v, &f); err != nil {
		t.Fatalf("reference.json %q: %v", key, err)
	}
	return f
}

func loadReference(t testing.TB, name string) *reference {
	t.Helper()
	r := &reference{}
	runtimetest.ReadJSON(t, filepath.Join(testdata, name, "reference.json"), r)
	runtimetest.ReadJSON(t, filepath.Join(testdata, name, "reference.json"), &r.raw)
	return r
}

// fixtures caches the loaded test models (read-only after loading).
type fixture struct {
	once sync.Once
	m    *runtime.Model
	err  error
}

var fixtures = map[string]*fixture{"llama-mini": {}, "qwen3-mini": {}}

func loadModel(t testing.TB, name string) *runtime.Model {
	t.Helper()
	f := fixtures[name]
	f.once.Do(func() {
		mm, err := hf.Open(filepath.Join(testdata, name))
		if err != nil {
			f.err = err
			return
		}
		f.m, f.err = runtime.Load(mm, cpu.New(0))
	})
	if f.err != nil {
		t.Fatal(f.err)
	}
	return f.m
}

func loadIDs(t testing.TB, dir, file string) []int {
	t.Helper()
	var ids []int
	runtimetest.ReadJSON(t, filepath.Join(dir, "ids-"+file+".json"), &ids)
	return ids
}

var models = []string{"llama-mini", "qwen3-mini"}
var files = []string{"sotu-test.raw", "moby-test.raw"}

func relErr(got, want float64) float64 { return math.Abs(got-want) / math.Abs(want) }

// TestLogitsLast compares the last position's logits with reference.json,
// with the 16-bit weights widened at upload and kept 16-bit ("-half").
func TestLogitsLast(t *testing.T) {
	for _, variant := range []string{"llama-mini", "qwen3-mini", "llama-mini-half", "qwen3-mini-half"} {
		t.Run(variant, func(t *testing.T) {
			name, half := strings.CutSuffix(variant, "-half")
			ref := loadReference(t, name)
			m := loadModel(t, name)
			if half {
				mm, err := hf.Open(filepath.Join(testdata, name))
				if err != nil {
					t.Fatal(err)
				}
				defer mm.Close()
				be := cpu.New(0)
				be.SetF32Budget(0)
				if m, err = runtime.Load(mm, be); err != nil {
					t.Fatal(err)
				}
			}
			be := m.Backend()
			logits := m.Forward(ref.LogitsInputIDs, 0, nil)
			all := make([]float32, logits.Rows()*logits.Cols())
			be.Download(all, logits)
			be.Free(logits)
			V := m.Config().Vocab
			last := all[(len(ref.LogitsInputIDs)-1)*V:]
			maxDiff := 0.0
			for i, want := range ref.LogitsLast {
				maxDiff = max(maxDiff, math.Abs(float64(last[i])-want))
			}
			t.Logf("logits_last max |diff| = %.3g", maxDiff)
			if maxDiff > 1e-3 {
				t.Errorf("logits_last max |diff| = %g, want <= 1e-3", maxDiff)
			}
			// The argmax of every position matches the reference top-1.
			for p, top := range ref.Top5 {
				row := all[p*V : (p+1)*V]
				best := 0
				for i, v := range row {
					if v > row[best] {
						best = i
					}
				}
				if best != top[0] && row[best]-row[top[0]] > 1e-4 {
					t.Errorf("position %d: argmax %d, reference top-1 %d", p, best, top[0])
				}
			}
		})
	}
}

func TestGreedy(t *testing.T) {
	for _, name := range models {
		t.Run(name, func(t *testing.T) {
			ref := loadReference(t, name)
			m := loadModel(t, name)
			var streamed []int
			var tm runtime.GenTiming
			n := len(ref.GreedyIDs) - len(ref.GreedyPromptIDs)
			got, err := runtime.Generate(m, ref.GreedyPromptIDs, runtime.GenOptions{MaxNew: n, EOS: []int{},
				OnToken: func(id int) { streamed = append(streamed, id) }, Timing: &tm})
			if err != nil {
				t.Fatal(err)
			}
			// step by step (no captured step on the CPU): steady from the first token
			if tm.FirstToken <= 0 || tm.SteadyTokens != n-1 || tm.Steady <= 0 || tm.SteadyTokensPerS() <= 0 {
				t.Errorf("timing %+v (%.1f tokens/s steady), want the first token's time and %d steady tokens", tm, tm.SteadyTokensPerS(), n-1)
			}
			want := ref.GreedyIDs[len(ref.GreedyPromptIDs):]
			if !equalInts(got, want) {
				t.Errorf("greedy ids\n got %v\nwant %v", got, want)
			}
			if !equalInts(streamed, got) {
				t.Errorf("OnToken saw %v, Generate returned %v", streamed, got)
			}
		})
	}
}

// noCapture is a backend that offers decode-step graphs but cannot make
// them (as a tensor-parallel backend of CPU ranks): Generate falls back to
// step-by-step decoding with the same result.
type noCapture struct{ runtime.Backend }

func (noCapture) BeginCapture(pos, maxHist int) error      { return runtime.ErrNoCapture }
func (noCapture) GreedyAdvance(runtime.Buf)                { panic("not capturing") }
func (noCapture) EndCapture() (runtime.DecodeGraph, error) { panic("not capturing") }
func (noCapture) SetDecodeState(id, pos int)               { panic("not capturing") }
func (noCapture) History(from, to int) []int               { panic("not capturing") }

func TestGreedyWithoutCapture(t *testing.T) {
	ref := loadReference(t, "llama-mini")
	mm, err := hf.Open(filepath.Join(testdata, "llama-mini"))
	if err != nil {
		t.Fatal(err)
	}
	defer mm.Close()
	m, err := runtime.Load(mm, noCapture{cpu.New(0)})
	if err != nil {
		t.Fatal(err)
	}
	want := ref.GreedyIDs[len(ref.GreedyPromptIDs):]
	var streamed []int
	got, err := runtime.Generate(m, ref.GreedyPromptIDs, runtime.GenOptions{MaxNew: len(want), EOS: []int{},
		OnToken: func(id int) { streamed = append(streamed, id) }})
	if err != nil || !equalInts(got, want) || !equalInts(streamed, want) {
		t.Errorf("greedy ids %v (streamed %v, %v), want %v", got, streamed, err, want)
	}
	stop, _ := runtime.Generate(m, ref.GreedyPromptIDs, runtime.GenOptions{MaxNew: len(want), EOS: []int{want[4]}})
	if !equalInts(stop, want[:4]) {
		t.Errorf("EOS stop gave %v, want %v", stop, want[:4])
	}
}

// poisonedRaw is a backend whose AllocRaw hands out buffers full of NaN, so
// that an activation read before it is written shows in every logit.
type poisonedRaw struct{ runtime.Backend }

func (p poisonedRaw) AllocRaw(rows, cols int) runtime.Buf {
	return runtimetest.AllocNaN(p.Backend, rows, cols)
}

// TestRawActivations checks that the forward pass writes every activation
// it takes from runtime.RawAllocator before reading it: with buffers full of
// NaN the prompt's logits equal those of zeroed buffers bit for bit, and the
// greedy ids the reference's.
func TestRawActivations(t *testing.T) {
	for _, name := range models {
		t.Run(name, func(t *testing.T) {
			ref := loadReference(t, name)
			mm, err := hf.Open(filepath.Join(testdata, name))
			if err != nil {
				t.Fatal(err)
			}
			defer mm.Close()
			logits := func(be runtime.Backend) []float32 {
				m, err := runtime.Load(mm, be)
				if err != nil {
					t.Fatal(err)
				}
				lg := m.Forward(ref.GreedyPromptIDs, 0, nil)
				out := make([]float32, lg.Rows()*lg.Cols())
				be.Download(out, lg)
				if be, ok := be.(poisonedRaw); ok {
					want := ref.GreedyIDs[len(ref.GreedyPromptIDs):]
					got, err := runtime.Generate(m, ref.GreedyPromptIDs, runtime.GenOptions{MaxNew: len(want), EOS: []int{}})
					if err != nil || !equalInts(got, want) {
						t.Errorf("%s: greedy ids %v (%v), want %v", be.Name(), got, err, want)
					}
				}
				return out
			}
			want, got := logits(noCapture{cpu.New(0)}), logits(poisonedRaw{noCapture{cpu.New(0)}})
			for i := range want {
				if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
					t.Fatalf("logit %d: %g with NaN-filled raw buffers, %g with zeroed ones", i, got[i], want[i])
				}
			}
		})
	}
}

func equalInts(a, b []int) bool {
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

// TestPerplexityFirst20 checks the first 20 chunks of sotu-test.raw against
// ppl_fp32_first20 and a 5-chunk prefix of moby-test.raw against
// chunk_nll.json (all 20 chunks of both with QTOOL_FULL_PPL), chunk by chunk.
func TestPerplexityFirst20(t *testing.T) {
	for _, name := range models {
		for _, file := range files {
			t.Run(name+"/"+file, func(t *testing.T) {
				ref := loadReference(t, name)
				var chunkNLL map[string][]float64
				runtimetest.ReadJSON(t, filepath.Join(testdata, name, "chunk_nll.json"), &chunkNLL)
				m := loadModel(t, name)
				ids := loadIDs(t, filepath.Join(testdata, name), file)
				n := 20
				if file != files[0] && !fullPPL() {
					n = 5
				}
				res, err := runtime.Perplexity(m, ids, runtime.PPLOptions{MaxChunks: n})
				if err != nil {
					t.Fatal(err)
				}
				want := prefixPPL(t, name, file, n)
				if n == 20 {
					want = ref.num(t, "ppl_fp32_first20/"+file)
				}
				t.Logf("%v; reference %.6f, rel err %.2e", res, want, relErr(res.PPL, want))
				if res.Chunks != n || res.Ctx != 512 || res.Scored != n*511 || res.Tokens != len(ids) {
					t.Errorf("result labels %+v", res)
				}
				if relErr(res.PPL, want) > 2e-4 {
					t.Errorf("ppl %.6f, reference %.6f (rel err %.2e > 2e-4)", res.PPL, want, relErr(res.PPL, want))
				}
				for c, got := range res.ChunkNLL {
					if d := math.Abs(got - chunkNLL[file][c]); d > 2e-4 {
						t.Errorf("chunk %d: mean NLL %.6f, reference %.6f", c, got, chunkNLL[file][c])
					}
				}
			})
		}
	}
}

// TestPerplexityFull runs both whole test files of both models; it takes a
// while, so it runs only with QTOOL_FULL_PPL=1.
func TestPerplexityFull(t *testing.T) {
	if os.Getenv("QTOOL_FULL_PPL") == "" {
		t.Skip("set QTOOL_FULL_PPL=1 to check the full-file perplexities")
	}
	for _, name := range models {
		for _, file := range files {
			t.Run(name+"/"+file, func(t *testing.T) {
				ref := loadReference(t, name)
				m := loadModel(t, name)
				ids := loadIDs(t, filepath.Join(testdata, name), file)
				res, err := runtime.Perplexity(m, ids, runtime.PPLOptions{})
				if err != nil {
					t.Fatal(err)
				}
				want := ref.num(t, "ppl_fp32/"+file)
				t.Logf("%v; reference %.6f, rel err %.2e", res, want, relErr(res.PPL, want))
				if res.Chunks != int(ref.num(t, "chunks/"+file)) || res.Tokens != int(ref.num(t, "ntokens/"+file)) {
					t.Errorf("%d chunks of %d tokens, reference %v / %v", res.Chunks, res.Tokens, ref.num(t, "chunks/"+file), ref.num(t, "ntokens/"+file))
				}
				if relErr(res.PPL, want) > 2e-4 {
					t.Errorf("ppl %.6f, reference %.6f (rel err %.2e > 2e-4)", res.PPL, want, relErr(res.PPL, want))
				}
			})
		}
	}
}

// openOrSkip opens a model with convert.Open, skipping while its codec is
// not wired in yet.
func openOrSkip(t *testing.T, path string) *model.Model {
	t.Helper()
	if _, err := os.Stat(path); errors.Is(err, os.ErrNotExist) {
		t.Skipf("%s is not present", path)
	}
	mm, err := convert.Open(path)
	if err != nil {
		if strings.Contains(err.Error(), "cannot be read yet") {
			t.Skipf("convert.Open: %v", err)
		}
		t.Fatal(err)
	}
	return mm
}

// flopsPerChunk counts the useful floating-point operations of one
// perplexity chunk of ctx tokens: 2 per multiply-add of every linear layer
// (and the classifier), plus causal attention (q·k and p·v over the
// positions each query sees).
func flopsPerChunk(c model.Config, ctx int) float64 {
	lin := float64(c.Hidden)*float64(c.QDim()+2*c.KVDim()) + float64(c.QDim())*float64(c.Hidden) +
		3*float64(c.Hidden)*float64(c.Intermediate)
	perTok := 2*lin*float64(c.Layers) + 2*float64(c.Hidden)*float64(c.Vocab)
	att := 0.0
	for p := 1; p <= ctx; p++ {
		att += 2 * 2 * float64(c.QDim()) * float64(p)
	}
	return perTok*float64(ctx) + att*float64(c.Layers)
}

// BenchmarkPerplexity measures CPU perplexity throughput on llama-mini with
// the GOMAXPROCS threads (run with -cpu 2 for the 2-core figure).
func BenchmarkPerplexity(b *testing.B) {
	for _, name := range models {
		b.Run(name, func(b *testing.B) {
			m := loadModel(b, name)
			ids := loadIDs(b, filepath.Join(testdata, name), "sotu-test.raw")
			const chunks = 8
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := runtime.Perplexity(m, ids, runtime.PPLOptions{MaxChunks: chunks}); err != nil {
					b.Fatal(err)
				}
			}
			sec := b.Elapsed().Seconds() / float64(b.N)
			b.ReportMetric(chunks*512/sec, "tokens/s")
			b.ReportMetric(chunks*flopsPerChunk(m.Config(), 512)/sec/1e9, "GFLOP/s")
		})
	}
}

// fullPPL reports whether the long whole-file perplexity checks run.
func fullPPL() bool { return os.Getenv("QTOOL_FULL_PPL") != "" }

// pplOf runs the GPTQ protocol at 512 on one test file.
func pplOf(t *testing.T, m *runtime.Model, idsDir, file string, maxChunks int) runtime.PPLResult {
	t.Helper()
	ids := loadIDs(t, idsDir, file)
	res, err := runtime.Perplexity(m, ids, runtime.PPLOptions{MaxChunks: maxChunks})
	if err != nil {
		t.Fatal(err)
	}
	return res
}

// TestMsModelSlim runs the three msmodelslim fixtures. With QTOOL_FULL_PPL
// both files are compared with models/msmodelslim/reference.json (0.05 %);
// otherwise a prefix of moby-test.raw must stay within 1 % of the float
// model's (int8 costs far less than that; quantSanity).
func TestMsModelSlim(t *testing.T) {
	var ref map[string]map[string]float64
	runtimetest.ReadJSON(t, filepath.Join(testdata, "msmodelslim", "reference.json"), &ref)
	for _, name := range []string{"llama-mini-w8a8-smooth", "llama-mini-w8a16-perchannel", "llama-mini-w8a16-g128"} {
		t.Run(name, func(t *testing.T) {
			dir := filepath.Join(testdata, "msmodelslim", name)
			if _, err := os.Stat(dir); err != nil {
				dir = filepath.Join("..", "..", "shared", "models", "msmodelslim", name)
			}
			mm := openOrSkip(t, dir)
			defer mm.Close()
			m, err := runtime.Load(mm, cpu.New(0))
			if err != nil {
				t.Fatal(err)
			}
			idsDir := filepath.Join(testdata, "llama-mini")
			if !fullPPL() {
				quantSanity(t, m, 0.01)
				return
			}
			for _, file := range files {
				res := pplOf(t, m, idsDir, file, 0)
				want := ref[name][file]
				t.Logf("%s: %v; reference %.6f, rel err %.2e", file, res, want, relErr(res.PPL, want))
				if relErr(res.PPL, want) > 5e-4 {
					t.Errorf("%s: ppl %.6f, reference %.6f (rel err %.2e > 5e-4)", file, res.PPL, want, relErr(res.PPL, want))
				}
			}
		})
	}
}

// rtnInt8Sym quantizes w [rows, cols] symmetric int8 per group of g
// (scale = max|w|/127), as reference.json's rtn_int8_sym_g64 and Kuiper's
// int8 files do.
func rtnInt8Sym(w []float32, rows, cols, g int) *model.Quantized {
	q := &model.Quantized{Bits: 8, GroupSize: g, Rows: rows, Cols: cols, Q: make([]int8, rows*cols), Scale: make([]float32, rows*cols/g)}
	for gi := range q.Scale {
		grp := w[gi*g : (gi+1)*g]
		mx := float32(0)
		for _, v := range grp {
			mx = max(mx, float32(math.Abs(float64(v))))
		}
		s := mx / 127
		q.Scale[gi] = s
		if s == 0 {
			continue
		}
		for i, v := range grp {
			q.Q[gi*g+i] = int8(max(-127, min(127, math.RoundToEven(float64(v/s)))))
		}
	}
	return q
}

// rtnInt4Asym is AWQ's pseudo_quantize_tensor (4 bits, groups of g):
// scale = (max−min)/15, zero = clamp(−round(min/scale), 0, 15), stored in
// model.Quantized's signed form (q−8, zero−8).
func rtnInt4Asym(w []float32, rows, cols, g int) *model.Quantized {
	n := rows * cols / g
	q := &model.Quantized{Bits: 4, GroupSize: g, Rows: rows, Cols: cols, Q: make([]int8, rows*cols), Scale: make([]float32, n), Zero: make([]float32, n)}
	for gi := 0; gi < n; gi++ {
		grp := w[gi*g : (gi+1)*g]
		lo, hi := grp[0], grp[0]
		for _, v := range grp {
			lo, hi = min(lo, v), max(hi, v)
		}
		s := max((hi-lo)/15, 1e-5)
		z := max(0, min(15, -math.RoundToEven(float64(lo/s))))
		q.Scale[gi], q.Zero[gi] = s, float32(z)-8
		for i, v := range grp {
			u := max(0, min(15, math.RoundToEven(float64(v/s))+z))
			q.Q[gi*g+i] = int8(u - 8)
		}
	}
	return q
}

// TestRTN quantizes llama-mini in memory (round to nearest, as
// reference.json describes) and runs it through the quantized matmul path:
// int8 symmetric g64 with lm_head too (ppl_kuiper_q8_g64) and AWQ-style
// int4 asymmetric g128 (ppl_rtn_int4_asym_g128). The references are
// whole-file numbers, checked with QTOOL_FULL_PPL; by default the first 20
// chunks of moby-test.raw must lie between the float model's perplexity
// (−0.2 %) and +3 % of it (quantSanity).
func TestRTN(t *testing.T) {
	ref := loadReference(t, "llama-mini")
	tests := []struct {
		key   string
		quant func(w []float32, rows, cols int) *model.Quantized
		head  bool
	}{
		{"ppl_kuiper_q8_g64", func(w []float32, r, c int) *model.Quantized { return rtnInt8Sym(w, r, c, 64) }, true},
		{"ppl_rtn_int4_asym_g128", func(w []float32, r, c int) *model.Quantized { return rtnInt4Asym(w, r, c, 128) }, false},
	}
	for _, tc := range tests {
		t.Run(tc.key, func(t *testing.T) {
			mm, err := hf.Open(filepath.Join(testdata, "llama-mini"))
			if err != nil {
				t.Fatal(err)
			}
			defer mm.Close()
			names := []string{}
			for l := 0; l < mm.Config.Layers; l++ {
				for _, r := range model.Linears {
					names = append(names, model.Name(l, r))
				}
			}
			if tc.head {
				names = append(names, model.Name(-1, model.LMHead))
			}
			for _, n := range names {
				w, _ := mm.Get(n)
				v, err := w.Float32()
				if err != nil {
					t.Fatal(err)
				}
				s := w.Shape()
				mm.Set(n, tc.quant(v, s[0], s[1]))
			}
			m, err := runtime.Load(mm, cpu.New(0))
			if err != nil {
				t.Fatal(err)
			}
			if !fullPPL() {
				quantSanity(t, m, 0.03)
				return
			}
			for _, file := range files {
				res := pplOf(t, m, filepath.Join(testdata, "llama-mini"), file, 0)
				want := ref.num(t, tc.key+"/"+file)
				t.Logf("%s: %v; reference %.6f, rel err %.2e", file, res, want, relErr(res.PPL, want))
				if relErr(res.PPL, want) > 5e-4 {
					t.Errorf("%s: ppl %.6f, reference %.6f (rel err %.2e > 5e-4)", file, res.PPL, want, relErr(res.PPL, want))
				}
			}
		})
	}
}

// TestLlamaCppProtocol compares the llama.cpp protocol with a direct
// computation from Forward's logits (BOS replaces each chunk's first token;
// positions ctx/2 .. ctx−2 predict the next token).
func TestLlamaCppProtocol(t *testing.T) {
	for _, name := range models {
		t.Run(name, func(t *testing.T) {
			m := loadModel(t, name)
			be := m.Backend()
			ids := loadIDs(t, filepath.Join(testdata, name), "moby-test.raw")
			const ctx, chunks = 128, 3
			res, err := runtime.Perplexity(m, ids, runtime.PPLOptions{Ctx: ctx, MaxChunks: chunks, Protocol: runtime.ProtocolLlamaCpp})
			if err != nil {
				t.Fatal(err)
			}
			if res.Scored != chunks*(ctx-ctx/2-1) || res.Protocol != runtime.ProtocolLlamaCpp {
				t.Errorf("labels %+v", res)
			}
			V := m.Config().Vocab
			bos := m.Config().BOS
			sum, n := 0.0, 0
			for c := 0; c < chunks; c++ {
				chunk := append([]int(nil), ids[c*ctx:(c+1)*ctx]...)
				if bos >= 0 && ids[0] == bos {
					chunk[0] = bos
				}
				lb := m.Forward(chunk, 0, nil)
				logits := make([]float32, ctx*V)
				be.Download(logits, lb)
				be.Free(lb)
				for p := ctx / 2; p < ctx-1; p++ {
					row := logits[p*V : (p+1)*V]
					s := 0.0
					for _, v := range row {
						s += math.Exp(float64(v))
					}
					sum += math.Log(s) - float64(row[chunk[p+1]])
					n++
				}
			}
			want := math.Exp(sum / float64(n))
			t.Logf("%v; direct %.6f", res, want)
			if relErr(res.PPL, want) > 1e-5 {
				t.Errorf("ppl %.6f, direct computation %.6f", res.PPL, want)
			}
		})
	}
}

func TestPerplexityErrors(t *testing.T) {
	m := loadModel(t, "llama-mini")
	tests := []struct {
		name string
		ids  []int
		opt  runtime.PPLOptions
		want string
	}{
		{"empty", nil, runtime.PPLOptions{}, "fewer than one chunk"},
		{"short", make([]int, 100), runtime.PPLOptions{}, "fewer than one chunk"},
		{"llamacpp short", make([]int, 600), runtime.PPLOptions{Protocol: runtime.ProtocolLlamaCpp}, "at least 1024 tokens"},
		{"bad id", []int{1, 2, 99999, 4}, runtime.PPLOptions{Ctx: 4}, "outside the model vocabulary"},
		{"protocol", make([]int, 600), runtime.PPLOptions{Protocol: "wiki"}, "unknown protocol"},
		{"ctx too long", make([]int, 9000), runtime.PPLOptions{Ctx: 4096}, "max_position_embeddings"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := runtime.Perplexity(m, tc.ids, tc.opt)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("error %v, want one containing %q", err, tc.want)
			}
		})
	}
	if _, err := runtime.Generate(m, nil, runtime.GenOptions{MaxNew: 3}); !errors.Is(err, runtime.ErrEmptyPrompt) {
		t.Errorf("Generate(empty prompt): %v", err)
	}
	if _, err := runtime.Generate(m, []int{1, 5000}, runtime.GenOptions{MaxNew: 3}); err == nil {
		t.Error("Generate accepted an id outside the vocabulary")
	}
}

// TestNonFiniteQuantParams checks that a quantized weight with a NaN or
// infinite scale or zero point is refused at load and by SetLinear, naming
// the tensor, its row and group (the backends' uploads validate it): run,
// it would give NaN on the CPU and in the GPU's GEMVs, but not in the
// GPU's fp16 GEMMs.
func TestNonFiniteQuantParams(t *testing.T) {
	name := model.Name(1, model.Down)
	for _, tc := range []struct {
		what string
		mod  func(q *model.Quantized)
		want string
	}{
		{"nan scale", func(q *model.Quantized) { q.Scale[3*q.Groups()+1] = float32(math.NaN()) }, "scale NaN of row 3, group 1 is not finite"},
		{"inf zero", func(q *model.Quantized) {
			q.Zero = make([]float32, len(q.Scale))
			q.Zero[len(q.Zero)-1] = float32(math.Inf(1))
		}, "zero point +Inf of row 255, group "}, // down: 256 rows
	} {
		t.Run(tc.what, func(t *testing.T) {
			mm, err := hf.Open(filepath.Join(testdata, "llama-mini"))
			if err != nil {
				t.Fatal(err)
			}
			defer mm.Close()
			w, _ := mm.Get(name)
			v, err := w.Float32()
			if err != nil {
				t.Fatal(err)
			}
			s := w.Shape()
			good := rtnInt8Sym(v, s[0], s[1], 64)
			bad := rtnInt8Sym(v, s[0], s[1], 64)
			tc.mod(bad)
			mm.Set(name, bad)
			if _, err := runtime.Load(mm, cpu.New(0)); err == nil || !strings.Contains(err.Error(), name) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("Load: %v, want an error naming %s and containing %q", err, name, tc.want)
			}
			mm.Set(name, good)
			m, err := runtime.Load(mm, cpu.New(0))
			if err != nil {
				t.Fatal(err)
			}
			if err := m.SetLinear(1, model.Down, bad); err == nil || !strings.Contains(err.Error(), name) || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("SetLinear: %v, want an error naming %s and containing %q", err, name, tc.want)
			}
		})
	}
}

// TestSampling checks that sampling is reproducible for a seed, that top-k
// 1 is greedy, and that generation stops on EOS.
func TestSampling(t *testing.T) {
	m := loadModel(t, "llama-mini")
	ref := loadReference(t, "llama-mini")
	prompt := ref.GreedyPromptIDs
	opt := runtime.GenOptions{MaxNew: 12, Temperature: 0.8, TopK: 40, TopP: 0.9, Seed: 42, EOS: []int{}}
	a, err := runtime.Generate(m, prompt, opt)
	if err != nil {
		t.Fatal(err)
	}
	b, _ := runtime.Generate(m, prompt, opt)
	if !equalInts(a, b) || len(a) != 12 {
		t.Errorf("same seed gave %v and %v", a, b)
	}
	greedy := ref.GreedyIDs[len(prompt):]
	k1, _ := runtime.Generate(m, prompt, runtime.GenOptions{MaxNew: 12, Temperature: 1, TopK: 1, Seed: 7, EOS: []int{}})
	if !equalInts(k1, greedy[:12]) {
		t.Errorf("top-k 1 gave %v, greedy %v", k1, greedy[:12])
	}
	// Declaring the 5th greedy token an EOS stops before it.
	stop, _ := runtime.Generate(m, prompt, runtime.GenOptions{MaxNew: 12, EOS: []int{greedy[4]}})
	if !equalInts(stop, greedy[:4]) {
		t.Errorf("EOS stop gave %v, want %v", stop, greedy[:4])
	}
}

// TestCaptureAndSetters checks that Layer calls capture with the inputs of
// each linear group and that SetLinear/SetVector take effect.
func TestCaptureAndSetters(t *testing.T) {
	mm, err := hf.Open(filepath.Join(testdata, "qwen3-mini"))
	if err != nil {
		t.Fatal(err)
	}
	defer mm.Close()
	m, err := runtime.Load(mm, cpu.New(0))
	if err != nil {
		t.Fatal(err)
	}
	c := m.Config()
	ids := []int{5, 9, 100, 7}
	cols := map[runtime.CapturePoint]int{runtime.CaptureQKV: c.Hidden, runtime.CaptureO: c.QDim(),
		runtime.CaptureGateUp: c.Hidden, runtime.CaptureDown: c.Intermediate}
	var seen []runtime.CapturePoint
	x := m.Embed(ids)
	m.Layer(0, x, 0, nil, func(l int, p runtime.CapturePoint, buf runtime.Buf) {
		seen = append(seen, p)
		if l != 0 || buf.Rows() != len(ids) || buf.Cols() != cols[p] {
			t.Errorf("capture %v of layer %d: [%d %d]", p, l, buf.Rows(), buf.Cols())
		}
	})
	if len(seen) != 4 || seen[0] != runtime.CaptureQKV || seen[3] != runtime.CaptureDown {
		t.Errorf("capture points %v", seen)
	}
	logits := func() []float32 {
		b := m.Forward(ids, 0, nil)
		v := make([]float32, b.Rows()*b.Cols())
		m.Backend().Download(v, b)
		return v
	}
	before := logits()
	// Zeroing the down projection of layer 0 changes the output; restoring it
	// restores it exactly.
	orig, _ := mm.Layer(0, model.Down)
	if err := m.SetLinear(0, model.Down, model.FromFloat32(orig.Shape(), make([]float32, model.NumElements(orig.Shape())))); err != nil {
		t.Fatal(err)
	}
	if changed := logits(); changed[0] == before[0] {
		t.Error("SetLinear had no effect")
	}
	if err := m.SetLinear(0, model.Down, orig); err != nil {
		t.Fatal(err)
	}
	// A zero norm bias is a no-op.
	if err := m.SetVector(model.Name(0, model.MLPNormBias), model.FromFloat32([]int{c.Hidden}, make([]float32, c.Hidden))); err != nil {
		t.Fatal(err)
	}
	if after := logits(); after[0] != before[0] {
		t.Errorf("restored model gives %g, was %g", after[0], before[0])
	}
	if err := m.SetLinear(0, model.Down, orig.(*model.Dense)); err != nil {
		t.Fatal(err)
	}
	for _, bad := range []error{
		m.SetLinear(0, model.AttnNorm, orig),
		m.SetLinear(9, model.Q, orig),
		m.SetLinear(0, model.Q, orig),
		m.SetVector("layers.0.q", model.FromFloat32([]int{c.Hidden}, make([]float32, c.Hidden))),
		m.SetVector("layers.0.attn_norm", model.FromFloat32([]int{3}, make([]float32, 3))),
		m.SetVector("layers.0.attn_norm", nil),
	} {
		if bad == nil {
			t.Error("a bad Set call succeeded")
		}
	}
}

// TestKuiper exports llama-mini as Kuiper files (fp32, and int8 g64 as
// Kuiper's --q8 export) in the interleaved (Meta) rope layout, reads them
// back with convert.Open and checks the perplexity. By default: fp32 on a
// prefix of moby-test.raw against chunk_nll.json, int8 within 1 % of the
// float model (quantSanity). With QTOOL_FULL_PPL: both whole files against
// ppl_fp32 and ppl_kuiper_q8_g64.
func TestKuiper(t *testing.T) {
	ref := loadReference(t, "llama-mini")
	src, err := hf.Open(filepath.Join(testdata, "llama-mini"))
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	tests := []struct {
		format kuiper.Format
		key    string
		tol    float64
	}{
		{kuiper.FP32, "ppl_fp32", 2e-4},
		{kuiper.Int8, "ppl_kuiper_q8_g64", 5e-4},
	}
	for _, tc := range tests {
		t.Run(string(tc.format), func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "llama-mini.bin")
			if err := kuiper.Write(src, path, kuiper.WriteOptions{Format: tc.format, Rope: model.RopeInterleaved}); err != nil {
				t.Fatal(err)
			}
			mm := openOrSkip(t, path)
			defer mm.Close()
			if mm.Config.Rope != model.RopeInterleaved {
				t.Errorf("rope layout %v, want interleaved", mm.Config.Rope)
			}
			m, err := runtime.Load(mm, cpu.New(0))
			if err != nil {
				t.Fatal(err)
			}
			idsDir := filepath.Join(testdata, "llama-mini")
			if tc.format == kuiper.FP32 && !fullPPL() {
				res := pplOf(t, m, idsDir, "moby-test.raw", sanityChunks)
				want := prefixPPL(t, "llama-mini", "moby-test.raw", sanityChunks)
				t.Logf("%v; reference %.6f, rel err %.2e", res, want, relErr(res.PPL, want))
				if relErr(res.PPL, want) > tc.tol {
					t.Errorf("ppl %.6f, reference %.6f (rel err %.2e > %g)", res.PPL, want, relErr(res.PPL, want), tc.tol)
				}
				return
			}
			if !fullPPL() {
				quantSanity(t, m, 0.01)
				return
			}
			for _, file := range files {
				res := pplOf(t, m, idsDir, file, 0)
				want := ref.num(t, tc.key+"/"+file)
				t.Logf("%s: %v; reference %.6f, rel err %.2e", file, res, want, relErr(res.PPL, want))
				if relErr(res.PPL, want) > tc.tol {
					t.Errorf("%s: ppl %.6f, reference %.6f (rel err %.2e > %g)", file, res.PPL, want, relErr(res.PPL, want), tc.tol)
				}
			}
		})
	}
}

// quantSanity checks that a quantized llama-mini's perplexity over the
// first sanityChunks chunks of moby-test.raw lies between the float model's
// (from chunk_nll.json, less a little noise) and maxLoss above it.
func quantSanity(t *testing.T, m *runtime.Model, maxLoss float64) {
	t.Helper()
	res := pplOf(t, m, filepath.Join(testdata, "llama-mini"), "moby-test.raw", sanityChunks)
	fp := prefixPPL(t, "llama-mini", "moby-test.raw", sanityChunks)
	t.Logf("%v; float model %.4f (%+.3f %%)", res, fp, 100*(res.PPL/fp-1))
	if res.PPL < fp*(1-0.002) || res.PPL > fp*(1+maxLoss) {
		t.Errorf("ppl %.4f outside [%.4f, %.4f] (float model %.4f)", res.PPL, fp*(1-0.002), fp*(1+maxLoss), fp)
	}
}

// sanityChunks is the prefix length of the quick quantized-model checks.
const sanityChunks = 8

// prefixPPL is the reference float32 perplexity of the first n chunks of
// file, from chunk_nll.json.
func prefixPPL(t *testing.T, name, file string, n int) float64 {
	t.Helper()
	var chunkNLL map[string][]float64
	runtimetest.ReadJSON(t, filepath.Join(testdata, name, "chunk_nll.json"), &chunkNLL)
	c := chunkNLL[file]
	if len(c) < n {
		t.Fatalf("chunk_nll.json has %d chunks of %s, want %d", len(c), file, n)
	}
	s := 0.0
	for _, v := range c[:n] {
		s += v
	}
	return math.Exp(s / float64(n))
}

// BenchmarkGenerate measures greedy decoding speed (new tokens per second,
// prompt processing included) on both models.
func BenchmarkGenerate(b *testing.B) {
	for _, name := range models {
		b.Run(name, func(b *testing.B) {
			m := loadModel(b, name)
			ref := loadReference(b, name)
			const n = 64
			b.ResetTimer()
			for i := 0; i < b.N; i++ {
				if _, err := runtime.Generate(m, ref.GreedyPromptIDs, runtime.GenOptions{MaxNew: n, EOS: []int{}}); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(n*float64(b.N)/b.Elapsed().Seconds(), "tokens/s")
		})
	}
}

// TestQwen2Biases runs llama-mini as a Qwen2 model (q/k/v biases). With zero
// biases it must match llama-mini exactly; a v bias b shifts every head's
// attention output by b (the softmax weights sum to 1), which the CaptureO
// input shows; a q bias changes the scores.
func TestQwen2Biases(t *testing.T) {
	mm, err := hf.Open(filepath.Join(testdata, "llama-mini"))
	if err != nil {
		t.Fatal(err)
	}
	defer mm.Close()
	base, err := runtime.Load(mm, cpu.New(0))
	if err != nil {
		t.Fatal(err)
	}
	mm.Config.Arch, mm.Config.AttnBias = model.Qwen2, true
	c := mm.Config
	zero := func(n int) *model.Dense { return model.FromFloat32([]int{n}, make([]float32, n)) }
	for l := 0; l < c.Layers; l++ {
		mm.Set(model.Name(l, model.QBias), zero(c.QDim()))
		mm.Set(model.Name(l, model.KBias), zero(c.KVDim()))
		mm.Set(model.Name(l, model.VBias), zero(c.KVDim()))
	}
	q2, err := runtime.Load(mm, cpu.New(0))
	if err != nil {
		t.Fatal(err)
	}
	ids := []int{1, 400, 17, 93, 5, 2000}
	captureO := func(m *runtime.Model) []float32 {
		var out []float32
		x := m.Embed(ids)
		m.Layer(0, x, 0, nil, func(l int, p runtime.CapturePoint, b runtime.Buf) {
			if p == runtime.CaptureO {
				out = make([]float32, b.Rows()*b.Cols())
				m.Backend().Download(out, b)
			}
		})
		return out
	}
	a, b := captureO(base), captureO(q2)
	for i := range a {
		if a[i] != b[i] {
			t.Fatalf("zero biases change the attention output at %d: %g vs %g", i, a[i], b[i])
		}
	}
	vb := make([]float32, c.KVDim())
	for i := range vb {
		vb[i] = float32(i%7) * 0.1
	}
	if err := q2.SetVector(model.Name(0, model.VBias), model.FromFloat32([]int{c.KVDim()}, vb)); err != nil {
		t.Fatal(err)
	}
	shifted := captureO(q2)
	group := c.Heads / c.KVHeads
	for r := range ids {
		for h := 0; h < c.Heads; h++ {
			for e := 0; e < c.HeadDim; e++ {
				i := r*c.QDim() + h*c.HeadDim + e
				want := a[i] + vb[(h/group)*c.HeadDim+e]
				if math.Abs(float64(shifted[i]-want)) > 1e-5 {
					t.Fatalf("row %d head %d dim %d: %g, want %g", r, h, e, shifted[i], want)
				}
			}
		}
	}
	qb := make([]float32, c.QDim())
	qb[3] = 5
	if err := q2.SetVector(model.Name(0, model.QBias), model.FromFloat32([]int{c.QDim()}, qb)); err != nil {
		t.Fatal(err)
	}
	// It moves head 0's scores, so head 0 of the last row (which sees
	// several positions) changes.
	last := (len(ids) - 1) * c.QDim()
	if moved := captureO(q2); moved[last] == shifted[last] {
		t.Error("a q bias did not change the attention output")
	}
}

// TestW8A8BiasNotAddedTwice: a W8A8 q projection carries its float bias in
// quant_bias (msmodelslim's convention, also what smoothquant.W8A8 builds),
// so the separate q bias of a Qwen2 model must not be added again.
func TestW8A8BiasNotAddedTwice(t *testing.T) {
	mm, err := hf.Open(filepath.Join(testdata, "llama-mini"))
	if err != nil {
		t.Fatal(err)
	}
	defer mm.Close()
	mm.Config.Arch, mm.Config.AttnBias = model.Qwen2, true
	c := mm.Config
	bias := make([]float32, c.QDim())
	for i := range bias {
		bias[i] = 0.5 * float32(i%5-2)
	}
	zero := func(n int) *model.Dense { return model.FromFloat32([]int{n}, make([]float32, n)) }
	for l := 0; l < c.Layers; l++ {
		mm.Set(model.Name(l, model.QBias), zero(c.QDim()))
		mm.Set(model.Name(l, model.KBias), zero(c.KVDim()))
		mm.Set(model.Name(l, model.VBias), zero(c.KVDim()))
	}
	mm.Set(model.Name(0, model.QBias), model.FromFloat32([]int{c.QDim()}, bias))
	ids := []int{1, 400, 17, 93, 5, 2000}
	// The float reference, and the input range of q for the activation quantizer.
	ref, err := runtime.Load(mm, cpu.New(0))
	if err != nil {
		t.Fatal(err)
	}
	var in, want []float32
	x := ref.Embed(ids)
	ref.Layer(0, x, 0, nil, func(l int, p runtime.CapturePoint, b runtime.Buf) {
		v := make([]float32, b.Rows()*b.Cols())
		ref.Backend().Download(v, b)
		switch p {
		case runtime.CaptureQKV:
			in = v
		case runtime.CaptureO:
			want = v
		}
	})
	lo, hi := float32(0), float32(0)
	for _, v := range in {
		lo, hi = min(lo, v), max(hi, v)
	}
	scale := (hi - lo) / 255
	offset := float32(-math.Round(float64(lo/scale))) - 128
	wt, _ := mm.Get(model.Name(0, model.Q))
	w, _ := wt.Float32()
	wq := w8a8(w, c.QDim(), c.Hidden, bias, scale, offset)
	captureO := func(qBias []float32) []float32 {
		mm.Set(model.Name(0, model.QBias), model.FromFloat32([]int{c.QDim()}, qBias))
		mm.Set(model.Name(0, model.Q), wq)
		rm, err := runtime.Load(mm, cpu.New(0))
		if err != nil {
			t.Fatal(err)
		}
		var out []float32
		x := rm.Embed(ids)
		rm.Layer(0, x, 0, nil, func(l int, p runtime.CapturePoint, b runtime.Buf) {
			if p == runtime.CaptureO {
				out = make([]float32, b.Rows()*b.Cols())
				rm.Backend().Download(out, b)
			}
		})
		return out
	}
	got, noBias := captureO(bias), captureO(make([]float32, c.QDim()))
	for i := range got {
		if got[i] != noBias[i] {
			t.Fatalf("the q bias beside a W8A8 q changed the output at %d: %g vs %g (added twice)", i, got[i], noBias[i])
		}
	}
	var maxErr, maxRef float64
	for i := range want {
		maxErr = max(maxErr, math.Abs(float64(got[i]-want[i])))
		maxRef = max(maxRef, math.Abs(float64(want[i])))
	}
	if maxErr > 0.05*maxRef {
		t.Fatalf("W8A8 q with the bias in quant_bias is off the float reference by %g (max |ref| %g)", maxErr, maxRef)
	}
}

// w8a8 quantizes w per channel (symmetric int8) with a per-tensor
// asymmetric activation quantizer, folding bias into QuantBias the way
// msmodelslim does (quant_bias = round(bias/deq_scale − offset·Σ W_q)).
func w8a8(w []float32, rows, cols int, bias []float32, inScale, inOffset float32) *model.W8A8 {
	q := &model.Quantized{Bits: 8, Rows: rows, Cols: cols, Q: make([]int8, rows*cols), Scale: make([]float32, rows)}
	out := &model.W8A8{Weight: q, InputScale: inScale, InputOffset: inOffset, DeqScale: make([]float32, rows), QuantBias: make([]int32, rows)}
	for r := 0; r < rows; r++ {
		row := w[r*cols : (r+1)*cols]
		amax := float32(0)
		for _, v := range row {
			amax = max(amax, float32(math.Abs(float64(v))))
		}
		s := amax / 127
		q.Scale[r] = s
		sum := 0.0
		for c, v := range row {
			qv := int8(math.RoundToEven(float64(v / s)))
			q.Q[r*cols+c] = qv
			sum += float64(qv)
		}
		out.DeqScale[r] = inScale * s
		out.QuantBias[r] = int32(math.RoundToEven(float64(bias[r]/out.DeqScale[r]) - float64(inOffset)*sum))
	}
	return out
}

// hostOnly hides every method of its backend beyond runtime.Backend (such
// as CopyRows), as a backend without them would have.
type hostOnly struct{ runtime.Backend }

// TestCopyRows copies rows on a backend that copies them itself and on one
// that does not (through host memory): the same values, dst's other rows
// kept.
func TestCopyRows(t *testing.T) {
	const rows, cols = 5, 7
	src, old := make([]float32, rows*cols), make([]float32, rows*cols)
	for i := range src {
		src[i], old[i] = float32(i), float32(-i)
	}
	for _, tc := range []struct {
		name                   string
		be                     runtime.Backend
		dstRows, dstRow, r0, n int
	}{
		{"rowcopier", cpu.New(1), rows, 1, 2, 3},
		{"host", hostOnly{cpu.New(1)}, rows, 1, 2, 3},
		{"host-whole", hostOnly{cpu.New(1)}, 2, 0, 3, 2},
	} {
		t.Run(tc.name, func(t *testing.T) {
			s, d := tc.be.Alloc(rows, cols), tc.be.Alloc(tc.dstRows, cols)
			tc.be.Upload(s, src)
			tc.be.Upload(d, old[:tc.dstRows*cols])
			runtime.CopyRows(tc.be, d, tc.dstRow, s, tc.r0, tc.n)
			got := make([]float32, tc.dstRows*cols)
			tc.be.Download(got, d)
			want := slices.Clone(old[:tc.dstRows*cols])
			copy(want[tc.dstRow*cols:], src[tc.r0*cols:(tc.r0+tc.n)*cols])
			if !slices.Equal(got, want) {
				t.Errorf("got %v, want %v", got, want)
			}
		})
	}
}

// TestCheckCopyRows: out-of-range rows or other widths panic with the
// shapes, on the host path and on a RowCopier alike.
func TestCheckCopyRows(t *testing.T) {
	for _, be := range []runtime.Backend{cpu.New(1), hostOnly{cpu.New(1)}} {
		for _, c := range []struct{ dstRows, dstCols, dstRow, srcRow, n int }{
			{4, 3, 0, 0, 5}, // more rows than src has
			{4, 3, 2, 0, 3}, // past dst's end
			{4, 2, 0, 0, 1}, // other widths
			{4, 3, 0, -1, 1},
		} {
			func() {
				defer func() {
					if p := recover(); p == nil || !strings.Contains(fmt.Sprint(p), "rows from") {
						t.Errorf("%s %+v: panic %v, want one naming the rows", be.Name(), c, p)
					}
				}()
				runtime.CopyRows(be, be.Alloc(c.dstRows, c.dstCols), c.dstRow, be.Alloc(4, 3), c.srcRow, c.n)
			}()
		}
	}
}
