package main

import (
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"qtool/convert"
	"qtool/formats/hf"
	"qtool/quantize"
	"qtool/runtime/kld"
)

// kldChunks is how many sotu chunks of 512 the KLD tests score.
const kldChunks = 4

// runKLD runs `verify --kld … --json` and decodes the result.
func runKLD(t *testing.T, args ...string) kld.Run {
	t.Helper()
	out, err := runQtool(t, append([]string{"verify", "--device", "cpu", "--json"}, args...)...)
	if err != nil {
		t.Fatalf("verify %v: %v", args, err)
	}
	var r kld.Run
	if err := json.Unmarshal([]byte(out), &r); err != nil {
		t.Fatalf("json: %v\n%s", err, out)
	}
	return r
}

// writeRTN writes llama-mini RTN-quantized (AutoAWQ's asymmetric rule,
// group 128) as a GPTQ checkpoint.
func writeRTN(t *testing.T, bits int, out string) {
	t.Helper()
	m, err := hf.Open(llamaMini)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	q, err := quantize.QuantizeModel(m, quantize.Options{Params: quantize.Params{Bits: bits, Group: 128, Rule: quantize.AsymAWQ}})
	if err != nil {
		t.Fatal(err)
	}
	if err := convert.Save(q, convert.FormatGPTQ, out); err != nil {
		t.Fatal(err)
	}
}

// TestVerifyKLD checks the KL divergence against the float model on the
// first sotu chunks: fp32 against itself is 0 with 100 % top-1 agreement
// (through the logits cache too), and RTN, GPTQ and AWQ at 4 bits rank by
// mean KLD as they rank by perplexity. The perplexity verify --kld reports
// is the plain perplexity of the same chunks.
func TestVerifyKLD(t *testing.T) {
	if testing.Short() {
		t.Skip("-short: quantizes llama-mini three times")
	}
	dir := t.TempDir()
	cache := filepath.Join(dir, "base.kld")
	chunks := []string{"--max-chunks", "4"}

	self := runKLD(t, append(chunks, "--kld", llamaMini, "--kld-cache", cache, "--ppl", sotuText, llamaMini)...)
	if !self.CacheWritten || self.BaseKind != "model" || self.Chunks != kldChunks || self.Count != kldChunks*511 {
		t.Fatalf("self run: %+v", self)
	}
	ref := fp32FirstChunks(t, llamaMini, kldChunks)
	for _, r := range []kld.Run{self, runKLD(t, "--kld", cache, llamaMini)} {
		// The base goes through the 16-bit cache encoding (1.8e-4 nats), so
		// "0" is 1e-7 here; top-1 uses the stored exact argmax.
		if r.KLD.Value > 1e-7 || r.KLDQ.Max > 1e-6 || r.SameTop.Value != 1 || math.Abs(r.DeltaP.Value) > 1e-6 {
			t.Fatalf("fp32 against itself (%s): KLD %g (max %g), same top %g, Δp %g; want 0, 100 %%, 0",
				r.BaseKind, r.KLD.Value, r.KLDQ.Max, r.SameTop.Value, r.DeltaP.Value)
		}
		if math.Abs(r.PPL.Value/ref-1) > 1e-5 || math.Abs(r.PPLBase.Value/ref-1) > 1e-5 {
			t.Fatalf("ppl %g, base %g; reference %g", r.PPL.Value, r.PPLBase.Value, ref)
		}
		t.Logf("fp32 vs itself (%s): KLD %.3g, same top %.2f %%, ppl %.4f", r.BaseKind, r.KLD.Value, 100*r.SameTop.Value, r.PPL.Value)
	}

	quant := []struct{ name, out string }{{"rtn w4", "rtn4"}, {"gptq w4", "gptq4"}, {"awq w4", "awq4"}}
	writeRTN(t, 4, filepath.Join(dir, "rtn4"))
	for _, q := range [][]string{
		{"gptq", "--bits", "4", "-o", filepath.Join(dir, "gptq4")},
		{"awq", "--bits", "4", "--search-tokens", "512", "-o", filepath.Join(dir, "awq4")},
	} {
		args := append(q, "--hf", llamaMini, "--calib", calibHead, "--nsamples", "8", "--seqlen", "256", "-q", "--json", "--threads", "2")
		if msg, err := runQuantApp(args...); err != nil {
			t.Fatalf("%v: %v\n%s", q, err, msg)
		}
	}
	var klds, ppls []float64
	for _, q := range quant {
		path := filepath.Join(dir, q.out)
		r := runKLD(t, "--kld", cache, path)
		if r.BaseKind != "logits file" || r.CacheWritten {
			t.Fatalf("%s: base %q", q.name, r.BaseKind)
		}
		out, err := runQtool(t, "verify", "--device", "cpu", "--json", "--ppl", sotuText, "--max-chunks", "4", path)
		if err != nil {
			t.Fatal(err)
		}
		var plain struct {
			PPL float64 `json:"ppl"`
		}
		if err := json.Unmarshal([]byte(out), &plain); err != nil {
			t.Fatal(err)
		}
		if math.Abs(r.PPL.Value/plain.PPL-1) > 1e-5 {
			t.Fatalf("%s: verify --kld ppl %g, verify --ppl %g", q.name, r.PPL.Value, plain.PPL)
		}
		if r.KLD.Value <= 1e-4 || r.SameTop.Value >= 1 || r.KLD.Unc <= 0 || r.KLDQ.Max < r.KLDQ.P99 || r.KLDQ.P99 < r.KLDQ.Median {
			t.Fatalf("%s: implausible statistics %+v", q.name, r.Stats)
		}
		klds, ppls = append(klds, r.KLD.Value), append(ppls, r.PPL.Value)
		t.Logf("%-8s ppl %.4f (ratio %.5f ± %.5f)  KLD %.6f ± %.6f  median %.6f  p99 %.6f  same top %.2f %%",
			q.name, r.PPL.Value, r.Ratio.Value, r.Ratio.Unc, r.KLD.Value, r.KLD.Unc, r.KLDQ.Median, r.KLDQ.P99, 100*r.SameTop.Value)
	}
	for i := range quant {
		for j := range quant {
			if (klds[i] < klds[j]) != (ppls[i] < ppls[j]) {
				t.Errorf("%s vs %s: KLD %.6f vs %.6f but ppl %.4f vs %.4f: the rankings differ",
					quant[i].name, quant[j].name, klds[i], klds[j], ppls[i], ppls[j])
			}
		}
	}
}

// TestVerifyKLDRefuses checks the refusals: a cache made from another text,
// context or protocol, a cache of another base, a bad logits file.
func TestVerifyKLDRefuses(t *testing.T) {
	dir := t.TempDir()
	cache := filepath.Join(dir, "base.kld")
	runKLD(t, "--kld", llamaMini, "--kld-cache", cache, "--ppl", sotuText, "--max-chunks", "1", llamaMini)
	junk := filepath.Join(dir, "junk.kld")
	data, err := os.ReadFile(cache)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(junk, data[:len(data)-10], 0o644); err != nil {
		t.Fatal(err)
	}
	moby := "../../testdata/corpus/moby-test.raw"
	cases := []struct {
		name string
		args []string
		want string
	}{
		{"other text", []string{"--kld", cache, "--ppl", moby}, "token ids: file"},
		{"other ctx", []string{"--kld", cache, "--ctx", "256", "--ppl", sotuText}, "ctx: file 512, this run 256"},
		{"other ctx without the text", []string{"--kld", cache, "--ctx", "256"}, "cannot change that without --ppl"},
		{"other protocol", []string{"--kld", cache, "--protocol", "llamacpp", "--ppl", sotuText}, "protocol: file gptq"},
		{"more chunks than cached", []string{"--kld", cache, "--max-chunks", "2", "--ppl", sotuText}, "chunks: file 1, this run 2"},
		{"cache of another base", []string{"--kld", "../../testdata/qwen3-mini", "--kld-cache", cache, "--ppl", sotuText}, "holds the logits of"},
		{"truncated file", []string{"--kld", junk}, "truncated"},
		{"cache with a logits file", []string{"--kld", cache, "--kld-cache", junk}, "is a logits file already"},
		{"no text", []string{"--kld", llamaMini}, "--ppl FILE is required"},
		{"cache without base", []string{"--kld-cache", cache, "--ppl", sotuText}, "goes with --kld BASE"},
		{"base of another tokenizer", []string{"--kld", "../../testdata/qwen3-mini", "--ppl", sotuText, "--max-chunks", "1"}, "tokenize the text differently"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			_, err := runQtool(t, append(append([]string{"verify", "--device", "cpu", "-q"}, tc.args...), llamaMini)...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
			t.Log(err)
		})
	}
}

// TestVerifyKLDStoredText reuses a llama.cpp-protocol cache of one chunk
// without the text: the ids, ctx and protocol come from the file.
func TestVerifyKLDStoredText(t *testing.T) {
	cache := filepath.Join(t.TempDir(), "lc.kld")
	first := runKLD(t, "--kld", llamaMini, "--kld-cache", cache, "--protocol", "llamacpp", "--ppl", sotuText, "--max-chunks", "1", llamaMini)
	again := runKLD(t, "--kld", cache, llamaMini)
	if again.Protocol != "llamacpp" || again.Scored != 255 || again.Tokens != first.Tokens || again.Text != first.Text ||
		again.KLD.Value > 1e-7 || again.SameTop.Value != 1 || again.PPL != first.PPL {
		t.Fatalf("first %+v\nagain %+v", first, again)
	}
}
