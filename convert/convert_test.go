package convert

import (
	"encoding/json"
	"fmt"
	"math"
	"math/rand"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"testing"

	"qtool/formats/model"
	"qtool/quantize"
	"qtool/runtime"
	"qtool/runtime/cpu"
)

const (
	testdata  = "../testdata"
	sharedMS  = "../../shared/models/msmodelslim"
	pplChunks = 4 // first chunks of sotu-test.raw scored (ctx 512, GPTQ protocol)
)

// variant names a quantized in-memory model built by quantized().
type variant struct {
	model    string // llama-mini or qwen3-mini
	actOrder bool   // GPTQ act-order style g_idx (simulated with a seeded permutation)
}

// fixtures caches the quantized models and their in-memory perplexities:
// several tests share them and building one costs a perplexity run.
type fixture struct {
	m   *model.Model
	ppl float64
	err error
}

var (
	fixMu sync.Mutex
	fixes = map[variant]*fixture{}
)

// quantized returns model v.model with every decoder linear RTN-quantized
// 4-bit asymmetric, group 128 (quantize.Int4Asym, AutoAWQ's rule), scales
// rounded to fp16 and every other tensor rounded to fp16, plus its
// perplexity computed in memory.
//
// The rounding makes the comparison fair: AutoAWQ, GPTQ and ak48 store
// scales and non-linear tensors as fp16 (msmodelslim keeps fp32 scales and
// the model's own dtype), so a model already holding fp16 values must come
// back bit-identical from every format.
func quantized(t *testing.T, v variant) (*model.Model, float64) {
	t.Helper()
	fixMu.Lock()
	defer fixMu.Unlock()
	if f, ok := fixes[v]; ok {
		if f.err != nil {
			t.Fatal(f.err)
		}
		return f.m, f.ppl
	}
	f := &fixture{}
	fixes[v] = f
	f.m, f.err = buildQuantized(v)
	if f.err == nil {
		f.ppl, f.err = perplexity(f.m, v.model)
	}
	if f.err != nil {
		t.Fatal(f.err)
	}
	return f.m, f.ppl
}

func buildQuantized(v variant) (*model.Model, error) {
	src, err := Open(filepath.Join(testdata, v.model))
	if err != nil {
		return nil, err
	}
	// src stays open: its mapping backs nothing after the copies below.
	p := quantize.Int4Asym(128)
	out := model.New(src.Config)
	out.Source, out.Format, out.TokenizerDir = src.Source, src.Format, src.TokenizerDir
	rng := rand.New(rand.NewSource(int64(len(v.model))))
	for _, name := range src.Names() {
		t, _ := src.Lookup(name)
		layer, role, _ := model.ParseName(name)
		w, err := t.Float32()
		if err != nil {
			return nil, err
		}
		if layer < 0 || !model.IsLinear(role) {
			out.Set(name, f16Dense(t.Shape(), w))
			continue
		}
		rows, cols := t.Shape()[0], t.Shape()[1]
		var q *model.Quantized
		if v.actOrder {
			q, err = actOrderRTN(w, rows, cols, p, rng.Perm(cols))
		} else {
			q, err = quantize.RTN(w, rows, cols, p)
		}
		if err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		for i, s := range q.Scale {
			q.Scale[i] = model.RoundF16(s)
		}
		out.Set(name, q)
	}
	return out, nil
}

// actOrderRTN quantizes w the way GPTQ with desc_act lays a result out:
// groups are runs of GroupSize columns in the order perm (GPTQ's
// descending-Hessian order), codes stay in the original column order and
// g_idx[c] names the group of column c.
func actOrderRTN(w []float32, rows, cols int, p quantize.Params, perm []int) (*model.Quantized, error) {
	wp := make([]float32, len(w))
	for r := 0; r < rows; r++ {
		for j, c := range perm {
			wp[r*cols+j] = w[r*cols+c]
		}
	}
	qp, err := quantize.RTN(wp, rows, cols, p)
	if err != nil {
		return nil, err
	}
	q := *qp
	q.Q = make([]int8, len(qp.Q))
	q.GIdx = make([]int32, cols)
	for r := 0; r < rows; r++ {
		for j, c := range perm {
			q.Q[r*cols+c] = qp.Q[r*cols+j]
		}
	}
	for j, c := range perm {
		q.GIdx[c] = int32(j / p.Group)
	}
	return &q, q.Validate()
}

func f16Dense(shape []int, v []float32) *model.Dense {
	b := make([]byte, 2*len(v))
	for i, x := range v {
		h := model.Float32ToF16(x)
		b[2*i], b[2*i+1] = byte(h), byte(h>>8)
	}
	return &model.Dense{DType: model.F16, Dims: append([]int(nil), shape...), Data: b}
}

var idsCache sync.Map

func referenceIDs(name string) ([]int, error) {
	if v, ok := idsCache.Load(name); ok {
		return v.([]int), nil
	}
	data, err := os.ReadFile(filepath.Join(testdata, name, "ids-sotu-test.raw.json"))
	if err != nil {
		return nil, err
	}
	var ids []int
	if err := json.Unmarshal(data, &ids); err != nil {
		return nil, err
	}
	idsCache.Store(name, ids)
	return ids, nil
}

// perplexity runs m on the CPU backend over the first pplChunks chunks of
// sotu-test.raw (reference ids of model name).
func perplexity(m *model.Model, name string) (float64, error) {
	return perplexityN(m, name, pplChunks)
}

// perplexityN is perplexity over the first chunks chunks (0: all).
func perplexityN(m *model.Model, name string, chunks int) (float64, error) {
	ids, err := referenceIDs(name)
	if err != nil {
		return 0, err
	}
	rm, err := runtime.Load(m, cpu.New(0))
	if err != nil {
		return 0, err
	}
	res, err := runtime.Perplexity(rm, ids, runtime.PPLOptions{MaxChunks: chunks})
	if err != nil {
		return 0, err
	}
	return res.PPL, nil
}

// sameWeights checks that every tensor of got dequantizes to exactly the
// values of want, and that quantized linears stay quantized.
func sameWeights(t *testing.T, got, want *model.Model) {
	t.Helper()
	if len(got.Names()) != len(want.Names()) {
		t.Errorf("read back %d tensors, wrote %d", len(got.Names()), len(want.Names()))
	}
	for _, name := range want.Names() {
		wt, _ := want.Lookup(name)
		gt, ok := got.Lookup(name)
		if !ok {
			t.Errorf("tensor %q is missing after the round trip", name)
			continue
		}
		if _, q := wt.(*model.Quantized); q {
			if _, gq := gt.(*model.Quantized); !gq {
				t.Errorf("tensor %q was quantized, read back as %T", name, gt)
			}
		}
		a, err := wt.Float32()
		if err != nil {
			t.Fatal(err)
		}
		b, err := gt.Float32()
		if err != nil {
			t.Fatal(err)
		}
		if len(a) != len(b) {
			t.Errorf("tensor %q: %d values, want %d", name, len(b), len(a))
			continue
		}
		for i := range a {
			if math.Float32bits(a[i]) != math.Float32bits(b[i]) && !(a[i] == 0 && b[i] == 0) {
				t.Errorf("tensor %q [%d]: %g, want %g", name, i, b[i], a[i])
				break
			}
		}
	}
}

// sameCodes checks a conversion into a format with fp16 scales (GPTQ,
// AutoAWQ) from one with fp32 scales (msmodelslim): the integer codes and
// zero points are identical and each scale is the fp16 rounding of the
// original, as Ascend's ms_to_vllm.py produces it too.
func sameCodes(t *testing.T, got, want *model.Model) {
	t.Helper()
	n := 0
	for _, name := range want.Names() {
		wt, _ := want.Lookup(name)
		wq, ok := wt.(*model.Quantized)
		if !ok {
			continue
		}
		gt, _ := got.Lookup(name)
		gq, ok := gt.(*model.Quantized)
		if !ok {
			t.Errorf("tensor %q read back as %T, want *model.Quantized", name, gt)
			continue
		}
		n++
		if gq.Bits != wq.Bits || gq.GroupSize != wq.GroupSize || len(gq.Q) != len(wq.Q) || len(gq.Scale) != len(wq.Scale) {
			t.Errorf("tensor %q: %d-bit group %d, want %d-bit group %d", name, gq.Bits, gq.GroupSize, wq.Bits, wq.GroupSize)
			continue
		}
		for i := range wq.Q {
			if gq.Q[i] != wq.Q[i] {
				t.Errorf("tensor %q: code %d is %d, want %d", name, i, gq.Q[i], wq.Q[i])
				break
			}
		}
		for i, s := range wq.Scale {
			z := func(q *model.Quantized) float32 {
				if q.Zero == nil {
					return 0
				}
				return q.Zero[i]
			}
			if gq.Scale[i] != model.RoundF16(s) || z(gq) != z(wq) {
				t.Errorf("tensor %q: group %d scale %g zero %g, want fp16(%g) zero %g", name, i, gq.Scale[i], z(gq), s, z(wq))
				break
			}
		}
	}
	if n == 0 {
		t.Error("no quantized tensor compared")
	}
}

func relDiff(a, b float64) float64 { return math.Abs(a-b) / math.Abs(b) }

// TestRoundTrip writes the quantized models in every quantized format that
// holds them, reads each back through Open, and checks that the weights are
// identical and the perplexity of the written file equals the in-memory one.
// Cross-format identity follows: every format's perplexity equals the same
// in-memory number (checked again explicitly at the end).
func TestRoundTrip(t *testing.T) {
	tests := []struct {
		v      variant
		format string
		kind   Kind
	}{
		{variant{"llama-mini", false}, FormatAutoAWQ, KindAutoAWQ},
		{variant{"llama-mini", false}, FormatGPTQ, KindGPTQ},
		{variant{"llama-mini", true}, FormatGPTQ, KindGPTQ},
		{variant{"llama-mini", false}, FormatMsModelSlim, KindMsModelSlim},
		{variant{"qwen3-mini", false}, FormatAutoAWQ, KindAutoAWQ},
		{variant{"qwen3-mini", false}, FormatGPTQ, KindGPTQ},
		{variant{"qwen3-mini", true}, FormatGPTQ, KindGPTQ},
		{variant{"qwen3-mini", false}, FormatMsModelSlim, KindMsModelSlim},
		{variant{"qwen3-mini", false}, FormatAK48, KindKuiper},
	}
	if testing.Short() {
		tests = tests[:3]
	}
	dir := t.TempDir()
	ppls := map[string]map[string]float64{}
	for i, tc := range tests {
		name := fmt.Sprintf("%s/%s/actorder=%v", tc.v.model, tc.format, tc.v.actOrder)
		t.Run(name, func(t *testing.T) {
			m, want := quantized(t, tc.v)
			out := filepath.Join(dir, fmt.Sprint(i))
			// qwen3-mini (8 heads × 64 ≠ 256) is a shape OrinMLLM cannot read.
			if err := SaveWith(m, tc.format, out, SaveOptions{QtoolOnly: true}); err != nil {
				t.Fatal(err)
			}
			if k, err := Detect(out); err != nil || k != tc.kind {
				t.Fatalf("Detect = %v, %v, want %v", k, err, tc.kind)
			}
			got, err := Open(out)
			if err != nil {
				t.Fatal(err)
			}
			defer got.Close()
			sameWeights(t, got, m)
			ppl, err := perplexity(got, tc.v.model)
			if err != nil {
				t.Fatal(err)
			}
			t.Logf("ppl %.6f (in memory %.6f, rel diff %.2g)", ppl, want, relDiff(ppl, want))
			if relDiff(ppl, want) > 1e-6 {
				t.Errorf("ppl of the written file %.8f, in memory %.8f", ppl, want)
			}
			if !tc.v.actOrder {
				if ppls[tc.v.model] == nil {
					ppls[tc.v.model] = map[string]float64{}
				}
				ppls[tc.v.model][tc.format] = ppl
			}
		})
	}
	for name, byFormat := range ppls {
		var ref float64
		var refName string
		for f, p := range byFormat {
			if refName == "" {
				ref, refName = p, f
				continue
			}
			if relDiff(p, ref) > 1e-6 {
				t.Errorf("%s: ppl %s %.8f, %s %.8f: the same weights give different perplexities", name, f, p, refName, ref)
			}
		}
	}
}

// TestConversions converts between the formats and checks that the
// quantized weights pass through unchanged (no re-quantization).
func TestConversions(t *testing.T) {
	dir := t.TempDir()
	qwen, _ := quantized(t, variant{"qwen3-mini", false})
	llamaAct, _ := quantized(t, variant{"llama-mini", true})
	llama, _ := quantized(t, variant{"llama-mini", false})
	awqDir := filepath.Join(dir, "qwen-awq")
	if err := Save(qwen, "autoawq", awqDir); err != nil {
		t.Fatal(err)
	}
	gptqDir := filepath.Join(dir, "llama-gptq")
	if err := Save(llama, "gptq", gptqDir); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, in, format string
		kind             Kind
	}{
		{"awq-to-ak48", awqDir, "ak48", KindKuiper}, // seed 002: AutoAWQ Qwen3 → OrinMLLM v5
		{"awq-to-msmodelslim-w4a16", awqDir, "msmodelslim", KindMsModelSlim},
		{"awq-to-gptq", awqDir, "gptq", KindGPTQ},
		{"gptq-to-msmodelslim-w4a16", gptqDir, "msmodelslim", KindMsModelSlim},
		{"gptq-to-autoawq", gptqDir, "awq", KindAutoAWQ},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			in, err := Open(tc.in)
			if err != nil {
				t.Fatal(err)
			}
			defer in.Close()
			out := filepath.Join(dir, tc.name)
			if err := SaveWith(in, tc.format, out, SaveOptions{QtoolOnly: true}); err != nil {
				t.Fatal(err)
			}
			got, err := Open(out)
			if err != nil {
				t.Fatal(err)
			}
			defer got.Close()
			if got.Format == in.Format || Must(Detect(out)) != tc.kind {
				t.Errorf("read back as %s (%s), want %s", got.Format, Must(Detect(out)), tc.kind)
			}
			sameWeights(t, got, in)
		})
	}

	// msmodelslim W8A16 → GPTQ 8-bit, the reverse of Ascend's ms_to_vllm.py;
	// AutoAWQ GEMM is 4-bit only and must refuse.
	for _, fx := range []string{"llama-mini-w8a16-perchannel", "llama-mini-w8a16-g128"} {
		t.Run("msmodelslim-w8a16-to-gptq/"+fx, func(t *testing.T) {
			src := filepath.Join(sharedMS, fx)
			if _, err := os.Stat(src); err != nil {
				t.Skipf("fixture %s not present", src)
			}
			in, err := Open(src)
			if err != nil {
				t.Fatal(err)
			}
			defer in.Close()
			err = Save(in, "autoawq", filepath.Join(dir, fx+"-awq"))
			if err == nil || !strings.Contains(err.Error(), "4-bit only") || !strings.Contains(err.Error(), "formats that can: ") {
				t.Errorf("AutoAWQ from W8A16: %v, want a refusal naming the formats that can", err)
			}
			out := filepath.Join(dir, fx+"-gptq")
			if err := Save(in, "gptq", out); err != nil {
				t.Fatal(err)
			}
			got, err := Open(out)
			if err != nil {
				t.Fatal(err)
			}
			defer got.Close()
			sameCodes(t, got, in)
			q, _ := got.Lookup("layers.0.q")
			if qq, ok := q.(*model.Quantized); !ok || qq.Bits != 8 {
				t.Errorf("layers.0.q read back as %T, want 8-bit *model.Quantized", q)
			}
		})
	}

	// act-order GPTQ has no AutoAWQ, msmodelslim, ak48 or int8 layout.
	for _, f := range []string{"autoawq", "msmodelslim", "kuiper-int8"} {
		t.Run("actorder-to-"+f, func(t *testing.T) {
			err := Save(llamaAct, f, filepath.Join(dir, "act-"+f))
			if err == nil || !strings.Contains(err.Error(), "formats that can: hf, gptq, kuiper-fp32, ak42-v1") {
				t.Errorf("Save(act-order, %s) = %v, want a refusal listing hf, gptq, kuiper-fp32, ak42-v1", f, err)
			}
			if _, err := os.Stat(filepath.Join(dir, "act-"+f)); !os.IsNotExist(err) {
				t.Errorf("a refused Save left %s behind", f)
			}
		})
	}
}

// Must returns v, ignoring err (for test messages).
func Must[T any](v T, _ error) T { return v }

// TestSaveNaN: a weight with a NaN, quantized lazily as the quantize
// command does, is refused by every quantized format with an error that
// names the tensor once and the bad value, and nothing is written.
func TestSaveNaN(t *testing.T) {
	llama, err := Open(filepath.Join(testdata, "llama-mini"))
	if err != nil {
		t.Fatal(err)
	}
	defer llama.Close()
	q, err := llama.Get("layers.0.q")
	if err != nil {
		t.Fatal(err)
	}
	w, err := q.Float32()
	if err != nil {
		t.Fatal(err)
	}
	w = append([]float32(nil), w...)
	w[5] = float32(math.NaN())
	bad := model.New(llama.Config)
	bad.Source, bad.TokenizerDir = llama.Source, llama.TokenizerDir
	for _, n := range llama.Names() {
		x, _ := llama.Lookup(n)
		bad.Set(n, x)
	}
	bad.Set("layers.0.q", model.FromFloat32(q.Shape(), w))
	lazy, err := quantize.QuantizeModel(bad, quantize.Options{Params: quantize.Int4Asym(128), Lazy: true})
	if err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{FormatAutoAWQ, FormatGPTQ, FormatMsModelSlim} {
		out := filepath.Join(t.TempDir(), "out")
		err := Save(lazy, f, out)
		if err == nil || strings.Count(err.Error(), `"layers.0.q"`) != 1 || !strings.Contains(err.Error(), "NaN at index 5") {
			t.Errorf("%s: %v, want one mention of the tensor and the NaN", f, err)
		}
		if _, err := os.Stat(out); err == nil {
			t.Errorf("%s: a refused save wrote %s", f, out)
		}
	}
}

// TestSaveRefusals checks the messages of formats that cannot hold a model.
func TestSaveRefusals(t *testing.T) {
	llama, err := Open(filepath.Join(testdata, "llama-mini"))
	if err != nil {
		t.Fatal(err)
	}
	defer llama.Close()
	lazy, err := quantize.QuantizeModel(llama, quantize.Options{Params: quantize.Int4Asym(128), Lazy: true})
	if err != nil {
		t.Fatal(err)
	}
	q8, err := quantize.QuantizeModel(llama, quantize.Options{Params: quantize.Int8Sym(64)})
	if err != nil {
		t.Fatal(err)
	}
	w8a8 := filepath.Join(testdata, "msmodelslim", "llama-mini-w8a8-smooth")
	smooth, err := Open(w8a8)
	if err != nil {
		t.Fatal(err)
	}
	defer smooth.Close()
	tests := []struct {
		name   string
		m      *model.Model
		format string
		want   []string // substrings of the error; nil: Save succeeds
	}{
		{"float-to-awq", llama, "autoawq", []string{"no quantized linear", "formats that can: hf, kuiper-fp32, kuiper-int8, ak42-v1, ak42-v2"}},
		{"float-to-gptq", llama, "gptq", []string{"quantize it first"}},
		{"llama-to-ak48", llama, "ak48", []string{"Qwen3 models only", "this is llama"}},
		{"llama-to-ak47", llama, "kuiper-ak47", []string{"Qwen3 models only"}},
		{"unknown", llama, "gguf", []string{"unknown format \"gguf\"", "kuiper-v5"}},
		{"int4-to-int8", lazy, "q8", []string{"would re-quantize", "formats that can: hf, autoawq, gptq, msmodelslim"}},
		{"int8-to-awq", q8, "awq", []string{"4-bit only"}},
		{"w8a8-to-hf", smooth, "hf", []string{"norm biases", "formats that can: msmodelslim"}},
		{"w8a8-to-gptq", smooth, "gptq", []string{"formats that can: msmodelslim"}},
		{"lazy-to-awq", lazy, "awq", nil},
		{"int8-to-q8", q8, "kuiper-int8", nil},
		{"w8a8-to-msmodelslim", smooth, "msmodelslim", nil},
	}
	dir := t.TempDir()
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			out := filepath.Join(dir, tc.name)
			err := Save(tc.m, tc.format, out)
			if tc.want == nil {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil {
				t.Fatalf("Save(%s) succeeded, want an error containing %q", tc.format, tc.want)
			}
			for _, s := range tc.want {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error %q lacks %q", err, s)
				}
			}
			if _, serr := os.Stat(out); !os.IsNotExist(serr) {
				t.Errorf("refused Save left %s behind", out)
			}
		})
	}
	if got := strings.Join(Holders(smooth), ","); got != "msmodelslim" {
		t.Errorf("Holders(W8A8 smooth) = %s, want msmodelslim", got)
	}
}

// TestOpenBadConfig feeds convert.Open written checkpoints whose config.json
// was edited. The codec tests cover the same refusals at the codec level
// (formats/autoawq TestParseQuantConfig, formats/gptq: "missing-gidx" for
// desc_act without g_idx, formats/msmodelslim errors_test.go); this checks
// they surface through Detect/Open unchanged.
func TestOpenBadConfig(t *testing.T) {
	llama, _ := quantized(t, variant{"llama-mini", false})
	dir := t.TempDir()
	awqDir := filepath.Join(dir, "awq")
	if err := Save(llama, "autoawq", awqDir); err != nil {
		t.Fatal(err)
	}
	gptqDir := filepath.Join(dir, "gptq")
	if err := Save(llama, "gptq", gptqDir); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name, src string
		edit      func(cfg, q map[string]any)
		want      string
	}{
		{"awq-bits3", awqDir, func(_, q map[string]any) { q["bits"] = 3 }, "bits = 3 is not supported"},
		{"awq-version", awqDir, func(_, q map[string]any) { q["version"] = "gemv_fast" }, "version \"gemv_fast\" is not supported"},
		{"unknown-method", awqDir, func(_, q map[string]any) { q["quant_method"] = "hqq" }, "quant_method \"hqq\" is not supported"},
		{"gptq-v3", gptqDir, func(_, q map[string]any) { q["checkpoint_format"] = "gptq_v3" }, "checkpoint_format \"gptq_v3\""},
		{"gptq-bits5", gptqDir, func(_, q map[string]any) { q["bits"] = 5 }, "bits = 5"},
		{"awq-shape", awqDir, func(c, _ map[string]any) { c["intermediate_size"] = 512 }, "config implies"},
		{"gptq-shape", gptqDir, func(c, _ map[string]any) { c["hidden_size"] = 128; c["head_dim"] = 32 }, "config implies"},
		{"gptq-group", gptqDir, func(_, q map[string]any) { q["group_size"] = 64 }, "do not fit"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			bad := filepath.Join(dir, tc.name)
			if err := os.Mkdir(bad, 0o755); err != nil {
				t.Fatal(err)
			}
			ents, _ := os.ReadDir(tc.src)
			for _, e := range ents {
				if e.Name() != "config.json" {
					os.Symlink(filepath.Join(tc.src, e.Name()), filepath.Join(bad, e.Name()))
				}
			}
			var cfg map[string]any
			data, _ := os.ReadFile(filepath.Join(tc.src, "config.json"))
			if err := json.Unmarshal(data, &cfg); err != nil {
				t.Fatal(err)
			}
			tc.edit(cfg, cfg["quantization_config"].(map[string]any))
			data, _ = json.Marshal(cfg)
			os.WriteFile(filepath.Join(bad, "config.json"), data, 0o644)
			m, err := Open(bad)
			if err == nil {
				m.Close()
				t.Fatalf("Open succeeded, want an error containing %q", tc.want)
			}
			if !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), bad) {
				t.Errorf("error %q lacks %q or the path", err, tc.want)
			}
		})
	}
}

// TestWriteHFQuant writes the llama-mini AutoAWQ and act-order GPTQ
// checkpoints that testdata/check_hf_quant.py (beside this file)
// dequantizes independently, and qtool's perplexities of them, into
// $QTOOL_HFQ_OUT (skipped when unset).
// $QTOOL_HFQ_CHUNKS sets the number of chunks scored (default 4, 0: all).
func TestWriteHFQuant(t *testing.T) {
	out := os.Getenv("QTOOL_HFQ_OUT")
	if out == "" {
		t.Skip("QTOOL_HFQ_OUT not set")
	}
	chunks := pplChunks
	if s := os.Getenv("QTOOL_HFQ_CHUNKS"); s != "" {
		if _, err := fmt.Sscan(s, &chunks); err != nil {
			t.Fatalf("QTOOL_HFQ_CHUNKS=%q: %v", s, err)
		}
	}
	res := map[string]any{"chunks": chunks, "ctx": 512, "protocol": "gptq", "text": "testdata/corpus/sotu-test.raw",
		"ids": "testdata/llama-mini/ids-sotu-test.raw.json"}
	for _, c := range []struct {
		name   string
		v      variant
		format string
	}{{"llama-mini-awq", variant{"llama-mini", false}, "autoawq"}, {"llama-mini-gptq-actorder", variant{"llama-mini", true}, "gptq"}} {
		m, mem := quantized(t, c.v)
		dir := filepath.Join(out, c.name)
		os.RemoveAll(dir)
		if err := Save(m, c.format, dir); err != nil {
			t.Fatal(err)
		}
		got, err := Open(dir)
		if err != nil {
			t.Fatal(err)
		}
		ppl, err := perplexityN(got, c.v.model, chunks)
		got.Close()
		if err != nil {
			t.Fatal(err)
		}
		t.Logf("%s: qtool ppl %.6f over %d chunks (in memory, first %d chunks: %.6f)", c.name, ppl, chunks, pplChunks, mem)
		res[c.name] = ppl
	}
	data, _ := json.MarshalIndent(res, "", "  ")
	if err := os.WriteFile(filepath.Join(out, "qtool-ppl.json"), data, 0o644); err != nil {
		t.Fatal(err)
	}
}
