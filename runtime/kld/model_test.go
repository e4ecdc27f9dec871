package kld

import (
	"encoding/json"
	"math"
	"os"
	"testing"

	"qtool/formats/hf"
	"qtool/quantize"
	"qtool/runtime"
	"qtool/runtime/cpu"
)

const llamaMini = "../../testdata/llama-mini"

func sotuIDs(t *testing.T) []int {
	b, err := os.ReadFile(llamaMini + "/ids-sotu-test.raw.json")
	if err != nil {
		t.Fatal(err)
	}
	var ids []int
	if err := json.Unmarshal(b, &ids); err != nil {
		t.Fatal(err)
	}
	return ids
}

// TestCompareOnModel runs Compare for llama-mini against RTN w4 on one sotu
// chunk under both protocols and checks the cached base against the exact
// float64 computation: the mean KLD through the 16-bit codes is within
// 1e-4 relative of the exact one, top-1 agreement and ppl are identical.
func TestCompareOnModel(t *testing.T) {
	src, err := hf.Open(llamaMini)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	q, err := quantize.QuantizeModel(src, quantize.Options{Params: quantize.Int4Asym(128)})
	if err != nil {
		t.Fatal(err)
	}
	be := cpu.New(2)
	base, err := runtime.Load(src, be)
	if err != nil {
		t.Fatal(err)
	}
	m, err := runtime.Load(q, be)
	if err != nil {
		t.Fatal(err)
	}
	ids := sotuIDs(t)
	cfg := m.Config()
	for _, proto := range []string{runtime.ProtocolGPTQ, runtime.ProtocolLlamaCpp} {
		t.Run(proto, func(t *testing.T) {
			plan, err := NewPlan(ids, cfg.Vocab, cfg.BOS, cfg.MaxSeq, runtime.PPLOptions{Ctx: 256, MaxChunks: 1, Protocol: proto})
			if err != nil {
				t.Fatal(err)
			}
			res, err := Compare(m, &ModelBase{M: base, Plan: plan}, plan, nil)
			if err != nil {
				t.Fatal(err)
			}
			// exact: both distributions in float64 straight from the logits
			v := cfg.Vocab
			in := make([]int, plan.Ctx)
			hb, hm := make([]float32, plan.Ctx*v), make([]float32, plan.Ctx*v)
			lb, targets := plan.logits(base, base.NewCache(plan.Ctx), 0, in, hb)
			lm, _ := plan.logits(m, m.NewCache(plan.Ctx), 0, in, hm)
			var acc Accumulator
			lp := make([]float64, v)
			for i := range targets {
				top := LogSoftmax(lp, lb[i*v:(i+1)*v])
				acc.Add(CompareRow(lp, top, -lp[targets[i]], lm[i*v:(i+1)*v], targets[i]))
			}
			exact := acc.Stats()
			rel := math.Abs(res.KLD.Value/exact.KLD.Value - 1)
			t.Logf("%s: %d positions, mean KLD %.6g (exact %.6g, rel. error %.2g), same top %.4f, ppl %.4f vs base %.4f",
				proto, res.Count, res.KLD.Value, exact.KLD.Value, rel, res.SameTop.Value, res.PPL.Value, res.PPLBase.Value)
			if res.Count != plan.Scored || rel > 1e-4 || res.SameTop != exact.SameTop ||
				math.Abs(res.PPL.Value/exact.PPL.Value-1) > 1e-9 || math.Abs(res.PPLBase.Value/exact.PPLBase.Value-1) > 1e-6 {
				t.Fatalf("cached %+v\nexact %+v", res.Stats, exact)
			}
			r, err := runtime.Perplexity(m, ids, runtime.PPLOptions{Ctx: 256, MaxChunks: 1, Protocol: proto})
			if err != nil {
				t.Fatal(err)
			}
			if math.Abs(r.PPL/res.PPL.Value-1) > 1e-5 {
				t.Fatalf("ppl %g, runtime.Perplexity %g", res.PPL.Value, r.PPL)
			}
		})
	}
}
