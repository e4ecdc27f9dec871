package gptq

import (
	"testing"
	"time"

	"qtool/quantize/calib"
	"qtool/quantize/calib/calibtest"
)

func quant(opt Options) func(*calib.Session) error {
	return func(s *calib.Session) error { _, err := QuantizeModel(s, opt, nil); return err }
}

// TestGPTQLlamaMini reproduces the table rows: GPTQ g128 asym on
// llama-mini, 128×512 calibration windows of train.txt, perplexity of
// sotu-test.raw (all 371 chunks); the bounds are the results before the
// calibration moved onto the runtime's backends (issue 10) plus 0.1 %.
// Behind QTOOL_LONG=1 (minutes on 2 cores).
func TestGPTQLlamaMini(t *testing.T) {
	calibtest.Long(t)
	calibtest.Table(t, "../testdata/llama-mini", []calibtest.Row{
		{Name: "w4 g128 asym hmse", MaxPPL: 69.565, Quantize: quant(Options{Bits: 4, GroupSize: 128, Search: "hmse"})},
		{Name: "w3 g128 asym hmse", MaxPPL: 70.997, Quantize: quant(Options{Bits: 3, GroupSize: 128, Search: "hmse"})},
	})
}

// TestAsymLlamaMini checks issue 15's targets for asymmetric calibration
// (gptq --asym: float-model targets, half the residual gap at o and down,
// the classifier refit) on llama-mini with the protocol above, measured on
// the GPTQ checkpoint written and read back: sotu-test.raw within R ≥ 75 %
// of RTN's loss (w4 ≤ 69.32, w3 ≤ 70.37) and moby-test.raw below plain
// GPTQ's (76.337 and 78.007). Behind QTOOL_LONG=1.
func TestAsymLlamaMini(t *testing.T) {
	calibtest.Long(t)
	asym := &Asym{Resid: 0.5, Head: true}
	calibtest.Table(t, "../testdata/llama-mini", []calibtest.Row{
		{Name: "w4 g128 asym calibration", MaxPPL: 69.32, MaxMoby: 76.337, Format: "gptq",
			Quantize: quant(Options{Bits: 4, GroupSize: 128, Search: "hmse", Asym: asym})},
		{Name: "w3 g128 asym calibration", MaxPPL: 70.37, MaxMoby: 78.007, Format: "gptq",
			Quantize: quant(Options{Bits: 3, GroupSize: 128, Search: "hmse", Asym: asym})},
	})
}

// BenchmarkGPTQLlamaMini times GPTQ w4 g128 (hmse) on llama-mini with the
// protocol's 128 × 512 calibration windows (target: ≤ 30 s on 2 cores).
func BenchmarkGPTQLlamaMini(b *testing.B) {
	calibtest.Bench(b, "../testdata/llama-mini", func(s *calib.Session) error {
		_, err := QuantizeModel(s, Options{Bits: 4, GroupSize: 128, Search: "hmse"}, nil)
		return err
	})
}

// BenchmarkAsymLlamaMini times gptq --asym w4 g128 on llama-mini with the
// same windows.
func BenchmarkAsymLlamaMini(b *testing.B) {
	calibtest.Bench(b, "../testdata/llama-mini", func(s *calib.Session) error {
		_, err := QuantizeModel(s, Options{Bits: 4, GroupSize: 128, Search: "hmse", Asym: &Asym{Resid: 0.5, Head: true}}, nil)
		return err
	})
}

// TestAsymQwen3Mini runs plain GPTQ and gptq --asym (w4 g128 hmse) on
// qwen3-mini in the same run, with the protocol above, and requires the
// asymmetric result to be better on both test texts (sotu-test.raw, the
// calibration's domain, and moby-test.raw, another one). Behind
// QTOOL_LONG=1.
func TestAsymQwen3Mini(t *testing.T) {
	calibtest.Long(t)
	const dir = "../testdata/qwen3-mini"
	chunks := calibtest.EnvInt("CHUNKS", 0)
	type ppl struct{ sotu, moby float64 }
	run := func(opt Options) ppl {
		s := calibtest.Session(t, dir, 128, 512)
		t0 := time.Now()
		if err := quant(opt)(s); err != nil {
			t.Fatal(err)
		}
		el := time.Since(t0)
		r := ppl{calibtest.Perplexity(t, s.Out, dir, chunks).PPL, calibtest.PerplexityOf(t, s.Out, dir, "moby-test.raw", chunks).PPL}
		t.Logf("asym %v: quantized in %v, sotu-test.raw %.4f, moby-test.raw %.4f", opt.Asym != nil, el, r.sotu, r.moby)
		return r
	}
	base := Options{Bits: 4, GroupSize: 128, Search: "hmse"}
	plain := run(base)
	base.Asym = &Asym{Resid: 0.5, Head: true}
	asym := run(base)
	if asym.sotu >= plain.sotu || asym.moby >= plain.moby {
		t.Errorf("gptq --asym %.4f / %.4f, plain GPTQ %.4f / %.4f (sotu / moby): want both lower", asym.sotu, asym.moby, plain.sotu, plain.moby)
	}
}
