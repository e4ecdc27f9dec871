package gptq

import (
	"testing"
	"time"

	"qtool/quantize/calib"
	"qtool/quantize/calib/calibtest"
)

// TestGPTQLlamaMini reproduces the table rows: GPTQ g128 asym on
// llama-mini, 128×512 calibration windows of train.txt, perplexity of
// sotu-test.raw (all 371 chunks), against the IST-DASLab/gptq numbers.
// Behind QTOOL_LONG=1 (minutes on 2 cores).
func TestGPTQLlamaMini(t *testing.T) {
	calibtest.Long(t)
	const dir = "../testdata/llama-mini"
	cases := []struct {
		name string
		opt  Options
		max  float64
	}{
		{"w4 g128 asym hmse", Options{Bits: 4, GroupSize: 128, Search: "hmse"}, 69.70},
		{"w3 g128 asym hmse", Options{Bits: 3, GroupSize: 128, Search: "hmse"}, 72.24},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			s := calibtest.Session(t, dir, 128, 512)
			t0 := time.Now()
			if _, err := QuantizeModel(s, tc.opt, nil); err != nil {
				t.Fatal(err)
			}
			t.Logf("quantized in %v", time.Since(t0))
			r := calibtest.Perplexity(t, s.Out, dir, calibtest.EnvInt("CHUNKS", 0))
			t.Logf("%s: %v", tc.name, r)
			if r.Chunks == 371 && r.PPL > tc.max {
				t.Fatalf("ppl %.4f, want <= %.2f", r.PPL, tc.max)
			}
		})
	}
}

// BenchmarkGPTQLlamaMini times GPTQ w4 g128 (hmse) on llama-mini with the
// protocol's 128 × 512 calibration windows (target: ≤ 30 s on 2 cores).
func BenchmarkGPTQLlamaMini(b *testing.B) {
	calibtest.Bench(b, "../testdata/llama-mini", func(s *calib.Session) error {
		_, err := QuantizeModel(s, Options{Bits: 4, GroupSize: 128, Search: "hmse"}, nil)
		return err
	})
}
