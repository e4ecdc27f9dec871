package awq

import (
	"testing"

	"qtool/quantize/calib"
	"qtool/quantize/calib/calibtest"
)

// TestAWQLlamaMini reproduces the table rows: AWQ g128 (scale search
// + clip) on llama-mini, 128×512 calibration windows of train.txt,
// perplexity of sotu-test.raw; the bounds are the results before the
// calibration moved onto the runtime's backends (issue 10) plus 0.1 %
// (llm-awq: 69.955 and 73.334). Behind QTOOL_LONG=1.
func TestAWQLlamaMini(t *testing.T) {
	calibtest.Long(t)
	quant := func(opt Options) func(*calib.Session) error {
		return func(s *calib.Session) error { _, err := QuantizeModel(s, opt, nil); return err }
	}
	calibtest.Table(t, "../testdata/llama-mini", []calibtest.Row{
		{Name: "w4 g128", MaxPPL: 69.866, Quantize: quant(Options{Bits: 4, GroupSize: 128})},
		{Name: "w3 g128", MaxPPL: 72.79, Quantize: quant(Options{Bits: 3, GroupSize: 128})},
	})
}

// BenchmarkAWQLlamaMini times AWQ w4 g128 on llama-mini with the protocol's
// 128 × 512 calibration windows (target: ≤ 60 s on 2 cores).
func BenchmarkAWQLlamaMini(b *testing.B) {
	calibtest.Bench(b, "../testdata/llama-mini", func(s *calib.Session) error {
		_, err := QuantizeModel(s, Options{Bits: 4, GroupSize: 128}, nil)
		return err
	})
}
