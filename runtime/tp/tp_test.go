package tp

import (
	"math"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"

	"qtool/formats/hf"
	"qtool/formats/model"
	"qtool/formats/shard"
	"qtool/quantize"
	"qtool/runtime"
	"qtool/runtime/cpu"
	"qtool/runtime/runtimetest"
)

const testdata = "../../testdata"

var models = []string{"llama-mini", "qwen3-mini"}

type reference struct {
	LogitsInputIDs  []int     `json:"logits_input_ids"`
	LogitsLast      []float64 `json:"logits_last"`
	GreedyPromptIDs []int     `json:"greedy_prompt_ids"`
	GreedyIDs       []int     `json:"greedy_ids"`
}

// checkGreedy decodes n tokens greedily after ref's prompt with rm and
// wants ref's ids.
func checkGreedy(t testing.TB, rm *runtime.Model, ref reference, n int) {
	t.Helper()
	want := ref.GreedyIDs[len(ref.GreedyPromptIDs):][:n]
	gen, err := runtime.Generate(rm, ref.GreedyPromptIDs, runtime.GenOptions{MaxNew: n, EOS: []int{}})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(gen, want) {
		t.Errorf("greedy %v, reference %v", gen, want)
	}
}

func loadRef(t testing.TB, name string) reference {
	var ref reference
	runtimetest.ReadJSON(t, filepath.Join(testdata, name, "reference.json"), &ref)
	return ref
}

func openHF(t testing.TB, name string) *model.Model {
	t.Helper()
	m, err := hf.Open(filepath.Join(testdata, name))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

func load(t testing.TB, m *model.Model, be runtime.Backend) *runtime.Model {
	t.Helper()
	rm, err := runtime.Load(m, be)
	if err != nil {
		t.Fatal(err)
	}
	return rm
}

// logits runs ids through rm and returns all logits.
func logits(rm *runtime.Model, ids []int) []float32 {
	be := rm.Backend()
	out := rm.Forward(ids, 0, nil)
	all := make([]float32, out.Rows()*out.Cols())
	be.Download(all, out)
	be.Free(out)
	return all
}

func tpBackend(t testing.TB, m *model.Model, n int) *Backend {
	t.Helper()
	be, err := NewCPU(m, n, 0)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Close() })
	return be
}

// maxRel is max|got−want| / max|want|.
func maxRel(got, want []float32) float64 {
	num, den := 0.0, 0.0
	for i := range want {
		num = max(num, math.Abs(float64(got[i])-float64(want[i])))
		den = max(den, math.Abs(float64(want[i])))
	}
	return num / den
}

// variants of each test model: float, int8 per-group and AWQ-style int4.
var variants = []struct {
	name  string
	quant *quantize.Params
}{{"float", nil}, {"int8-g64", &[]quantize.Params{quantize.Int8Sym(64)}[0]}, {"awq-int4-g128", &[]quantize.Params{quantize.Int4Asym(128)}[0]}}

func variant(t testing.TB, m *model.Model, p *quantize.Params) *model.Model {
	t.Helper()
	if p == nil {
		return m
	}
	q, err := quantize.QuantizeModel(m, quantize.Options{Params: *p})
	if err != nil {
		t.Fatal(err)
	}
	return q
}

// TestLogits compares the logits of the 64 reference ids at TP=2 (the model
// split in memory, and read back from a shard directory) with the unsplit
// CPU backend, for float, int8 and int4 weights: within 1e-5 of the largest
// logit, also over ranks that fuse (checkFusedRanks). The float run is also
// checked against reference.json.
func TestLogits(t *testing.T) {
	for _, name := range models {
		ref := loadRef(t, name)
		base := openHF(t, name)
		for _, v := range variants {
			t.Run(name+"/"+v.name, func(t *testing.T) {
				m := variant(t, base, v.quant)
				want := logits(load(t, m, cpu.New(0)), ref.LogitsInputIDs)
				got := logits(load(t, m, tpBackend(t, m, 2)), ref.LogitsInputIDs)
				rel := maxRel(got, want)
				t.Logf("TP=2 in memory: max |Δ| / max |logit| = %.3g", rel)
				if rel > 1e-5 {
					t.Errorf("TP=2 logits differ from TP=1 by %.3g relative, want <= 1e-5", rel)
				}
				checkFusedRanks(t, m, ref.LogitsInputIDs, want)
				if v.quant == nil {
					V := m.Config.Vocab
					last := got[(len(ref.LogitsInputIDs)-1)*V:]
					d := 0.0
					for i, w := range ref.LogitsLast {
						d = max(d, math.Abs(float64(last[i])-w))
					}
					t.Logf("TP=2 logits_last vs reference.json: max |Δ| = %.3g", d)
					if d > 1e-3 {
						t.Errorf("TP=2 logits_last differ from reference.json by %g", d)
					}
				}
				dir := t.TempDir()
				if _, err := shard.Write(m, 2, dir); err != nil {
					t.Fatal(err)
				}
				sm, err := OpenModel(dir)
				if err != nil {
					t.Fatal(err)
				}
				defer sm.Close()
				fromDir := logits(load(t, sm, tpBackend(t, sm, 2)), ref.LogitsInputIDs)
				if !slices.Equal(fromDir, got) {
					t.Errorf("TP=2 from the shard directory differs from TP=2 in memory by %.3g", maxRel(fromDir, got))
				}
			})
		}
	}
}

// TestPerplexity: the first chunks of sotu-test at TP=2 give the TP=1
// perplexity within 0.01 %, and per-chunk NLLs close to the reference's.
func TestPerplexity(t *testing.T) {
	chunks := 4
	if testing.Short() {
		chunks = 2
	}
	for _, name := range models {
		t.Run(name, func(t *testing.T) {
			m := openHF(t, name)
			var ids []int
			runtimetest.ReadJSON(t, filepath.Join(testdata, name, "ids-sotu-test.raw.json"), &ids)
			var chunkNLL map[string][]float64
			runtimetest.ReadJSON(t, filepath.Join(testdata, name, "chunk_nll.json"), &chunkNLL)
			opt := runtime.PPLOptions{MaxChunks: chunks}
			want, err := runtime.Perplexity(load(t, m, cpu.New(0)), ids, opt)
			if err != nil {
				t.Fatal(err)
			}
			got, err := runtime.Perplexity(load(t, m, tpBackend(t, m, 2)), ids, opt)
			if err != nil {
				t.Fatal(err)
			}
			rel := math.Abs(got.PPL-want.PPL) / want.PPL
			t.Logf("TP=2 %v; TP=1 ppl %.6f; rel diff %.2e", got, want.PPL, rel)
			if rel > 1e-4 {
				t.Errorf("TP=2 ppl %.6f, TP=1 %.6f: relative difference %.2e > 0.01 %%", got.PPL, want.PPL, rel)
			}
			for c, nll := range got.ChunkNLL {
				if d := math.Abs(nll - chunkNLL["sotu-test.raw"][c]); d > 2e-4 {
					t.Errorf("chunk %d: TP=2 mean NLL %.6f, reference %.6f", c, nll, chunkNLL["sotu-test.raw"][c])
				}
			}
		})
	}
}

// TestGreedy decodes token by token through the split KV cache, over plain
// ranks and over ranks that fuse, and must reproduce the reference's greedy
// continuation.
func TestGreedy(t *testing.T) {
	for _, name := range models {
		t.Run(name, func(t *testing.T) {
			ref := loadRef(t, name)
			m := openHF(t, name)
			want := ref.GreedyIDs[len(ref.GreedyPromptIDs):] // greedy_ids holds the prompt too
			if testing.Short() {
				want = want[:16]
			}
			// plain ranks, and ranks that fuse (the KV cache written by
			// RoPEStoreKV on each rank)
			var calls atomic.Int64
			for _, be := range []*Backend{tpBackend(t, m, 2), fusingTP(t, m, &calls)} {
				got, err := runtime.Generate(load(t, m, be), ref.GreedyPromptIDs, runtime.GenOptions{MaxNew: len(want), EOS: []int{}})
				if err != nil {
					t.Fatal(err)
				}
				if !slices.Equal(got, want) {
					t.Errorf("TP=2 greedy ids (fusing ranks: %v) %v\nreference        %v", be.fused, got, want)
				}
			}
		})
	}
}

// TestBadInput: refusals come from NewCPU / OpenModel / runtime.Load,
// before any compute.
func TestBadInput(t *testing.T) {
	llama := openHF(t, "llama-mini") // 4 heads, 2 KV heads
	qwen := openHF(t, "qwen3-mini")  // 8 heads, 2 KV heads
	dir := t.TempDir()
	if _, err := shard.Write(qwen, 2, dir); err != nil {
		t.Fatal(err)
	}
	sharded, err := OpenModel(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer sharded.Close()
	int4g256, err := quantize.QuantizeModel(llama, quantize.Options{Params: quantize.Int4Asym(256)})
	if err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		name string
		m    *model.Model
		n    int
		want string
	}{
		{"TP=3 llama", llama, 3, "tensor-parallel size 3 does not divide the 4 attention heads and 2 KV heads of this llama model (sizes that work: 1, 2)"},
		{"TP=4 qwen3", qwen, 4, "does not divide the 8 attention heads and 2 KV heads of this qwen3 model (sizes that work: 1, 2)"},
		{"shards for 2 run with 1", sharded, 1, "written for 2 ranks, not 1"},
		{"int4 groups of 256 cut at 128", int4g256, 2, "falls inside a quantization group of 256 columns"},
	} {
		t.Run(c.name, func(t *testing.T) {
			_, err := NewCPU(c.m, c.n, 0)
			if err == nil || !strings.Contains(err.Error(), c.want) {
				t.Fatalf("err = %v\nwant %q", err, c.want)
			}
		})
	}
	// A damaged shard directory is refused when opened.
	os.Remove(filepath.Join(dir, "rank-1.safetensors"))
	if _, err := OpenModel(dir); err == nil || !strings.Contains(err.Error(), "rank-1.safetensors is missing") {
		t.Errorf("missing rank file: %v", err)
	}
	// A backend made for one config refuses another's weights at upload.
	be := tpBackend(t, qwen, 2)
	if _, err := runtime.Load(llama, be); err == nil || !strings.Contains(err.Error(), "layers.0.q") {
		t.Errorf("llama weights on a qwen3 TP backend: %v", err)
	}
}

// TestCommunicator checks the in-process collectives against plain sums,
// with 3 ranks as goroutines.
func TestCommunicator(t *testing.T) {
	const n, L = 3, 1000
	c, err := NewInProcess(n)
	if err != nil {
		t.Fatal(err)
	}
	rng := rand.New(rand.NewPCG(1, 2))
	bufs := make([][]float32, n)
	want := make([]float32, L)
	for r := range bufs {
		bufs[r] = make([]float32, L)
		for i := range bufs[r] {
			bufs[r][i] = rng.Float32()*2 - 1
		}
	}
	for i := range want {
		want[i] = bufs[0][i] + bufs[1][i] + bufs[2][i]
	}
	sends := make([][]float32, n)
	for r := range sends {
		sends[r] = slices.Clone(bufs[r][:7])
	}
	recvs := make([][]float32, n)
	errs := make([]error, 2*n)
	var wg sync.WaitGroup
	for r := 0; r < n; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			for range 5 { // reuse across calls
				recvs[r] = make([]float32, 7*n)
				errs[n+r] = c.AllGather(r, sends[r], recvs[r])
			}
			errs[r] = c.AllReduceSum(r, bufs[r])
		}()
	}
	wg.Wait()
	if err := errorsJoin(errs); err != nil {
		t.Fatal(err)
	}
	for r := range bufs {
		if !slices.Equal(bufs[r], want) {
			t.Fatalf("rank %d: all-reduce differs from the sum", r)
		}
		if !slices.Equal(recvs[r], slices.Concat(sends...)) {
			t.Fatalf("rank %d: all-gather %v", r, recvs[r])
		}
	}
	// Mismatched lengths are an error on every rank, not a hang.
	for r := 0; r < n; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = c.AllReduceSum(r, make([]float32, 4+r))
		}()
	}
	wg.Wait()
	for r := 0; r < n; r++ {
		if errs[r] == nil {
			t.Errorf("rank %d accepted mismatched lengths", r)
		}
	}
}

func errorsJoin(errs []error) error {
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}

// uniform returns n values drawn uniformly from [-2, 2).
func uniform(rng *rand.Rand, n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = rng.Float32()*4 - 2
	}
	return v
}

// TestLayouts drives the buffer conversions directly: a column-split buffer
// downloads whole, converts to replicated and back, and Add/SiLUMul on
// mixed layouts give the same values as the plain CPU backend.
func TestLayouts(t *testing.T) {
	m := openHF(t, "qwen3-mini")
	be := tpBackend(t, m, 2)
	ref := cpu.New(1)
	rng := rand.New(rand.NewPCG(3, 4))
	const rows, cols = 5, 768
	a, b := uniform(rng, rows*cols), uniform(rng, rows*cols)
	split := [][2]int{{0, 300}, {300, 768}}
	x := be.Alloc(rows, cols).(*Buf)
	be.Upload(x, a)
	be.toSplit(x, split)
	if x.Replicated() {
		t.Fatal("still replicated")
	}
	got := make([]float32, rows*cols)
	be.Download(got, x)
	if !slices.Equal(got, a) {
		t.Fatal("split download differs")
	}
	y := be.Alloc(rows, cols)
	be.Upload(y, b) // replicated
	be.SiLUMul(x, x, y)
	be.Add(x, y)
	be.replicate(x)
	be.Download(got, x)
	xr, yr := ref.Alloc(rows, cols), ref.Alloc(rows, cols)
	ref.Upload(xr, a)
	ref.Upload(yr, b)
	ref.SiLUMul(xr, xr, yr)
	ref.Add(xr, yr)
	want := make([]float32, rows*cols)
	ref.Download(want, xr)
	if !slices.Equal(got, want) {
		t.Fatalf("mixed-layout SiLUMul/Add differ from the CPU backend by %.3g", maxRel(got, want))
	}
	z := be.Alloc(rows, cols)
	be.Download(got, z)
	if slices.ContainsFunc(got, func(v float32) bool { return v != 0 }) {
		t.Fatal("a fresh buffer is not zero")
	}
	be.Free(x)
	be.Free(y)
	be.Free(z)
}

// TestCopyRows copies rows of a split and a replicated buffer into fresh
// buffers and into a written one of the other layout: the copy keeps the
// source's layout, and the destination's other rows keep their values.
func TestCopyRows(t *testing.T) {
	m := openHF(t, "qwen3-mini")
	be := tpBackend(t, m, 2)
	rng := rand.New(rand.NewPCG(5, 6))
	const rows, cols = 6, 768
	for _, split := range [][][2]int{nil, {{0, 300}, {300, 768}}} {
		a, b := uniform(rng, rows*cols), uniform(rng, rows*cols)
		src := be.Alloc(rows, cols).(*Buf)
		be.Upload(src, a)
		if split != nil {
			be.toSplit(src, split)
		}
		fresh := runtime.AllocRaw(be, 3, cols).(*Buf)
		be.CopyRows(fresh, 0, src, 2, 3)
		if !slices.Equal(fresh.split, split) {
			t.Errorf("split %v: the copy's layout is %v", split, fresh.split)
		}
		got := make([]float32, 3*cols)
		be.Download(got, fresh)
		if !slices.Equal(got, a[2*cols:5*cols]) {
			t.Errorf("split %v: rows 2..4 differ", split)
		}
		dst := be.Alloc(rows, cols).(*Buf)
		be.Upload(dst, b) // replicated
		if split == nil {
			be.toSplit(dst, [][2]int{{0, 384}, {384, 768}})
		}
		be.CopyRows(dst, 4, src, 0, 2)
		want := slices.Concat(b[:4*cols], a[:2*cols])
		all := make([]float32, rows*cols)
		be.Download(all, dst)
		if !slices.Equal(all, want) {
			t.Errorf("split %v: rows 0, 1 into rows 4, 5 of a written buffer of another layout: wrong values", split)
		}
		for _, x := range []runtime.Buf{src, fresh, dst} {
			be.Free(x)
		}
	}
}

func BenchmarkForward(b *testing.B) {
	for _, n := range []int{1, 2} {
		b.Run(map[int]string{1: "tp1", 2: "tp2"}[n], func(b *testing.B) {
			m := openHF(b, "llama-mini")
			rm := load(b, m, tpBackend(b, m, n))
			ids := make([]int, 512)
			for i := range ids {
				ids[i] = (i * 7) % m.Config.Vocab
			}
			b.ResetTimer()
			for range b.N {
				out := rm.Forward(ids, 0, nil)
				rm.Backend().Free(out)
			}
			b.ReportMetric(float64(len(ids)*b.N)/b.Elapsed().Seconds(), "tok/s")
		})
	}
}
