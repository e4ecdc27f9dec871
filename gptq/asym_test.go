package gptq

import (
	"strings"
	"testing"

	"qtool/formats/hf"
	"qtool/formats/model"
	"qtool/quantize/calib"
	"qtool/runtime"
	"qtool/runtime/cpu"
	"qtool/runtime/tokenizer"
)

const miniDir = "../testdata/llama-mini"

// miniWindows are n windows of seqlen tokens of one of the shipped texts.
func miniWindows(t *testing.T, text string, n, seqlen int) [][]int {
	t.Helper()
	tok, err := tokenizer.LoadDir(miniDir)
	if err != nil {
		t.Fatal(err)
	}
	windows, _, err := calib.Load("../testdata/corpus/"+text, tok, n, seqlen)
	if err != nil {
		t.Fatal(err)
	}
	return windows
}

// miniSession opens llama-mini with 2048 tokens of the shipped calibration
// text (8 × hidden, enough for the classifier refit).
func miniSession(t *testing.T) *calib.Session {
	t.Helper()
	windows := miniWindows(t, "train-head.txt", 16, 128)
	m, err := hf.Open(miniDir)
	if err != nil {
		t.Fatal(err)
	}
	s, err := calib.NewSession(m, cpu.New(2), windows, 2)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Close)
	return s
}

// logitsErr is Σ‖logits(q) − logits(f)‖² / Σ‖logits(f)‖² over the windows.
func logitsErr(t *testing.T, q, f *model.Model, windows [][]int) float64 {
	t.Helper()
	rq, err := runtime.Load(q, cpu.New(2))
	if err != nil {
		t.Fatal(err)
	}
	rf, err := runtime.Load(f, cpu.New(2))
	if err != nil {
		t.Fatal(err)
	}
	num, den := 0.0, 0.0
	for _, w := range windows {
		a, b := rq.Forward(w, 0, nil), rf.Forward(w, 0, nil)
		d, r := rq.Backend().(runtime.Calibrator).SquaredError(a, b)
		num, den = num+d, den+r
	}
	return num / den
}

// TestAsymQuick runs gptq --asym (3 bits) on 2048 llama-mini calibration
// tokens: every linear reports its error against the float model, the
// result's logits on held-out text (sotu-test.raw) are closer to the float
// model's than plain GPTQ's, and the classifier is a refit untied lm_head
// that does better there than the original one on the quantized model;
// with too few tokens the classifier is kept.
func TestAsymQuick(t *testing.T) {
	opt := Options{Bits: 3, GroupSize: 64, Search: "hmse"}
	plain := miniSession(t)
	if _, err := QuantizeModel(plain, opt, nil); err != nil {
		t.Fatal(err)
	}
	s := miniSession(t)
	opt.Asym = &Asym{Resid: 0.5, Head: true}
	stats, err := QuantizeModel(s, opt, nil)
	if err != nil {
		t.Fatal(err)
	}
	if len(stats) != 7*s.Cfg.Layers+1 {
		t.Fatalf("%d module statistics, want %d", len(stats), 7*s.Cfg.Layers+1)
	}
	for _, st := range stats[:len(stats)-1] {
		if st.FloatErr <= 0 || !strings.Contains(st.Note, "asym") {
			t.Errorf("layer %d %s: float error %g, note %q", st.Layer, st.Role, st.FloatErr, st.Note)
		}
		if (st.Role == model.O || st.Role == model.Down) != strings.Contains(st.Note, "residual") {
			t.Errorf("layer %d %s: note %q", st.Layer, st.Role, st.Note)
		}
	}
	head := stats[len(stats)-1]
	if head.Layer != -1 || head.Role != model.LMHead || head.FloatErr <= 0 {
		t.Errorf("classifier statistics %+v", head)
	}
	if s.Out.Config.Tied {
		t.Error("the refit classifier is tied")
	}
	float, err := hf.Open(miniDir)
	if err != nil {
		t.Fatal(err)
	}
	test := miniWindows(t, "sotu-test.raw", 8, 128)
	ePlain, eAsym := logitsErr(t, plain.Out, float, test), logitsErr(t, s.Out, float, test)
	t.Logf("held-out logits error against the float model: plain GPTQ %.4g, asym %.4g", ePlain, eAsym)
	if eAsym >= ePlain {
		t.Errorf("asymmetric calibration's logits error %.4g is not below plain GPTQ's %.4g", eAsym, ePlain)
	}
	orig := model.New(s.Out.Config)
	for _, n := range s.Out.Names() {
		tt, _ := s.Out.Lookup(n)
		orig.Set(n, tt)
	}
	lm, _ := float.Lookup(model.Name(-1, model.LMHead))
	orig.Set(model.Name(-1, model.LMHead), lm)
	if eOrig := logitsErr(t, orig, float, test); eAsym >= eOrig {
		t.Errorf("the refit classifier's logits error %.4g is not below the original's %.4g", eAsym, eOrig)
	} else {
		t.Logf("held-out logits error with the original classifier %.4g", eOrig)
	}

	m, err := hf.Open(miniDir)
	if err != nil {
		t.Fatal(err)
	}
	few, err := calib.NewSession(m, cpu.New(2), miniWindows(t, "train-head.txt", 2, 64), 2)
	if err != nil {
		t.Fatal(err)
	}
	defer few.Close()
	stats, err = QuantizeModel(few, opt, nil)
	if err != nil {
		t.Fatal(err)
	}
	if st := stats[len(stats)-1]; !strings.HasPrefix(st.Note, "kept") || !few.Out.Config.Tied && few.Out.Config.Tied != m.Config.Tied {
		t.Errorf("128 calibration tokens: classifier %+v", st)
	}
}
