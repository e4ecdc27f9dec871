package main

// qtool verify --kld BASE MODEL: KL divergence of MODEL's next-token
// distributions from BASE's (runtime/kld), with llama.cpp's statistics.

import (
	"encoding/json"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/urfave/cli/v2"

	"qtool/formats/model"
	"qtool/runtime"
	"qtool/runtime/kld"
	"qtool/runtime/tokenizer"
	"qtool/runtime/tp"
)

// runVerifyKLD implements `qtool verify --kld BASE [--kld-cache FILE] MODEL`.
func runVerifyKLD(c *cli.Context) error {
	if c.NArg() != 1 {
		return fmt.Errorf("verify --kld: want exactly one MODEL argument after the options, got %d: qtool verify --kld BASE --ppl FILE MODEL", c.NArg())
	}
	if c.IsSet("prompt") {
		return fmt.Errorf("verify --kld: --prompt does not go with --kld (run generation separately)")
	}
	path, basePath, cachePath := c.Args().First(), c.String("kld"), c.String("kld-cache")
	if basePath == "" {
		return fmt.Errorf("verify: --kld-cache FILE goes with --kld BASE (the model whose logits it holds)")
	}
	stdout, stderr, logf := outputs(c)

	// Where the base comes from: a logits file given as BASE or as an
	// existing --kld-cache, else the BASE model (run alongside MODEL).
	var lf *kld.File
	baseIsFile := kld.IsLogitsFile(basePath)
	switch {
	case baseIsFile && cachePath != "":
		return fmt.Errorf("verify --kld: BASE %s is a logits file already; --kld-cache names where a BASE model's logits go", basePath)
	case baseIsFile:
		f, err := kld.Open(basePath)
		if err != nil {
			return fmt.Errorf("verify --kld: %w", err)
		}
		lf = f
	case cachePath != "":
		if _, err := os.Stat(cachePath); err == nil {
			f, err := kld.Open(cachePath)
			if err != nil {
				return fmt.Errorf("verify --kld-cache: %w", err)
			}
			if !samePath(f.Model, basePath) {
				f.Close()
				return fmt.Errorf("verify --kld-cache: %s holds the logits of %s, not of --kld %s; give another --kld-cache or the matching BASE", cachePath, f.Model, basePath)
			}
			lf = f
		}
	default:
		if _, err := os.Stat(basePath); err != nil {
			return fmt.Errorf("verify --kld: BASE: %w", err)
		}
	}
	if lf != nil {
		defer lf.Close()
	}

	proto := c.String("protocol")
	ctxLen := c.Int("ctx")
	var pplPath string
	var text []byte
	if p := c.String("ppl"); p != "" {
		var err error
		if pplPath, text, err = readPPLText(p); err != nil {
			return err
		}
	} else if lf == nil {
		return fmt.Errorf("verify --kld: --ppl FILE is required (the text both models are scored on) unless BASE is a logits file")
	} else {
		// Score the text the logits file was made from, as it stores it.
		pplPath = lf.Text
		if (c.IsSet("ctx") && ctxLen != lf.Ctx) || (c.IsSet("protocol") && proto != lf.Protocol) {
			return fmt.Errorf("verify --kld: %s holds ctx %d, %s protocol; --ctx and --protocol cannot change that without --ppl (and a new cache)", lf.Path, lf.Ctx, lf.Protocol)
		}
	}

	mm, err := tp.OpenModel(path)
	if err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	defer mm.Close()
	cfg := mm.Config
	var ids []int
	maxChunks := c.Int("max-chunks")
	if lf != nil && !c.IsSet("max-chunks") {
		maxChunks = lf.Chunks // the chunks the file holds
	}
	var plan kld.Plan
	if text != nil {
		tok, err := loadTokenizer(c.String("tokenizer"), path, mm)
		if err != nil {
			return err
		}
		if err := checkTokenizer(tok, cfg); err != nil {
			return err
		}
		ids = tokenizer.EncodeWithBOS(tok, string(text))
		if plan, err = kld.NewPlan(ids, cfg.Vocab, cfg.BOS, cfg.MaxSeq, runtime.PPLOptions{Ctx: ctxLen, MaxChunks: maxChunks, Protocol: proto}); err != nil {
			return fmt.Errorf("verify --kld: %s: %w", pplPath, err)
		}
	} else {
		plan = lf.Plan(maxChunks)
		if cfg.MaxSeq > 0 && plan.Ctx > cfg.MaxSeq {
			return fmt.Errorf("verify --kld: %s: context %d exceeds the model's max_position_embeddings %d", lf.Path, plan.Ctx, cfg.MaxSeq)
		}
	}
	want := plan.Header(cfg.Vocab)
	want.Model, want.Text = basePath, pplPath
	if text != nil {
		want.TextSHA256 = kld.TextSHA256(text)
	}

	m, be, err := loadOn(c, mm)
	if err != nil {
		return err
	}
	defer be.Close()
	res := kld.Run{Model: path, Base: basePath, Device: be.Name(), Text: pplPath, Tokens: plan.Tokens,
		Chunks: plan.Chunks, Ctx: plan.Ctx, Protocol: plan.Protocol, Scored: plan.Chunks * plan.Scored}

	var base kld.Base
	var w *kld.Writer
	if lf != nil {
		if err := lf.Check(want, plan.IDs); err != nil {
			return fmt.Errorf("verify --kld: %w", err)
		}
		base = &kld.FileBase{F: lf}
		res.BaseKind, res.Cache = "logits file", lf.Path
	} else {
		bm, closeBase, err := openKLDBase(c, basePath, text, ids, cfg)
		if err != nil {
			return err
		}
		defer closeBase()
		mb := &kld.ModelBase{M: bm, Plan: plan}
		if cachePath != "" {
			if w, err = kld.Create(cachePath, want, plan.IDs); err != nil {
				return fmt.Errorf("verify --kld-cache: %w", err)
			}
			defer func() {
				if w != nil {
					w.Abort()
				}
			}()
			mb.W = w
			res.Cache = cachePath
		}
		base = mb
		res.BaseKind = "model"
	}
	logf("model   %s (%s, %s, %d layers, hidden %d, vocab %d)\n", path, mm.Format, cfg.Arch, cfg.Layers, cfg.Hidden, cfg.Vocab)
	logf("base    %s (%s)\n", basePath, res.BaseKind)
	logf("device  %s\n", be.Name())

	start, err := startTimer(be)
	if err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	bar := chunkBar(c, stderr, plan.Chunks, "kld")
	r, err := kld.Compare(m, base, plan, func(done, total int, mean float64) {
		if bar != nil {
			tps := float64(done*plan.Ctx) / time.Since(start).Seconds()
			bar.Describe(fmt.Sprintf("KLD %.6f, %.0f tok/s", mean, tps))
			_ = bar.Set(done)
		}
	})
	if bar != nil {
		_ = bar.Finish()
		fmt.Fprintln(stderr)
	}
	if err != nil {
		return fmt.Errorf("verify --kld: %s: %w", pplPath, err)
	}
	if w != nil {
		err := w.Close()
		w = nil
		if err != nil {
			return fmt.Errorf("verify --kld-cache: %w", err)
		}
		res.CacheWritten = true
	}
	if res.Cache != "" {
		if fi, err := os.Stat(res.Cache); err == nil {
			res.CacheBytes = fi.Size()
		}
	}
	res.Result = r
	res.Seconds = time.Since(start).Seconds()
	res.TokensPerS = float64(plan.Chunks*plan.Ctx) / res.Seconds
	if c.Bool("json") {
		return json.NewEncoder(stdout).Encode(res)
	}
	logf("text    %s: %d tokens, %d chunks × ctx %d, %d scored (%s protocol); %.1f s, %.0f tokens/s\n",
		filepath.Base(pplPath), res.Tokens, res.Chunks, res.Ctx, res.Scored, res.Protocol, res.Seconds, res.TokensPerS)
	if res.Cache != "" {
		verb := "read"
		if res.CacheWritten {
			verb = "wrote"
		}
		logf("cache   %s %s (%.1f MB)\n", verb, res.Cache, float64(res.CacheBytes)/1e6)
	}
	return writeKLDStats(stdout, r.Stats)
}

// openKLDBase loads the BASE model on its own backend and checks that it
// can be compared with MODEL: same vocabulary, and (when its tokenizer is
// found) the same token ids for the text.
func openKLDBase(c *cli.Context, basePath string, text []byte, ids []int, cfg model.Config) (*runtime.Model, func(), error) {
	bmm, err := tp.OpenModel(basePath)
	if err != nil {
		return nil, nil, fmt.Errorf("verify --kld: BASE: %w", err)
	}
	if bmm.Config.Vocab != cfg.Vocab {
		bmm.Close()
		return nil, nil, fmt.Errorf("verify --kld: BASE %s has a vocabulary of %d, MODEL %d: not the same base", basePath, bmm.Config.Vocab, cfg.Vocab)
	}
	if btok, err := loadTokenizer("", basePath, bmm); err == nil && text != nil {
		if bids := tokenizer.EncodeWithBOS(btok, string(text)); !slices.Equal(bids, ids) {
			bmm.Close()
			return nil, nil, fmt.Errorf("verify --kld: BASE %s and MODEL tokenize the text differently (%d vs %d tokens); give --tokenizer or models of the same base", basePath, len(bids), len(ids))
		}
	}
	bm, bbe, err := loadOn(c, bmm)
	if err != nil {
		bmm.Close()
		return nil, nil, fmt.Errorf("verify --kld: BASE: %w", err)
	}
	return bm, func() { bbe.Close(); bmm.Close() }, nil
}

// samePath reports whether a and b name the same file or directory.
func samePath(a, b string) bool {
	if fa, err := os.Stat(a); err == nil {
		if fb, err := os.Stat(b); err == nil {
			return os.SameFile(fa, fb)
		}
	}
	return filepath.Clean(a) == filepath.Clean(b)
}

// writeKLDStats prints s as llama.cpp's `perplexity --kl-divergence` does.
func writeKLDStats(w io.Writer, s kld.Stats) error {
	var b strings.Builder
	f := func(format string, a ...any) { fmt.Fprintf(&b, format, a...) }
	f("====== Perplexity statistics ======\n")
	f("Mean PPL(Q)                   : %10.6f ± %10.6f\n", s.PPL.Value, s.PPL.Unc)
	f("Mean PPL(base)                : %10.6f ± %10.6f\n", s.PPLBase.Value, s.PPLBase.Unc)
	f("Cor(ln(PPL(Q)), ln(PPL(base))): %6.2f%%\n", 100*s.LnPPLCor)
	f("Mean ln(PPL(Q)/PPL(base))     : %10.6f ± %10.6f\n", s.LnRatio.Value, s.LnRatio.Unc)
	f("Mean PPL(Q)/PPL(base)         : %10.6f ± %10.6f\n", s.Ratio.Value, s.Ratio.Unc)
	f("Mean PPL(Q)-PPL(base)         : %10.6f ± %10.6f\n\n", s.Diff.Value, s.Diff.Unc)
	f("====== KL divergence statistics ======\n")
	f("Mean    KLD: %10.6f ± %10.6f\n", s.KLD.Value, s.KLD.Unc)
	q := s.KLDQ
	for _, r := range []struct {
		name string
		v    float64
	}{{"Maximum", q.Max}, {"99.9%  ", q.P99_9}, {"99.0%  ", q.P99}, {"95.0%  ", q.P95}, {"90.0%  ", q.P90},
		{"Median ", q.Median}, {"10.0%  ", q.P10}, {" 5.0%  ", q.P5}, {" 1.0%  ", q.P1}, {" 0.1%  ", q.P0_1}, {"Minimum", q.Min}} {
		f("%s KLD: %10.6f\n", r.name, r.v)
	}
	f("\n====== Token probability statistics ======\n")
	f("Mean    Δp: %6.3f ± %5.3f %%\n", 100*s.DeltaP.Value, 100*s.DeltaP.Unc)
	d := s.DeltaPQ
	for _, r := range []struct {
		name string
		v    float64
	}{{"Maximum", d.Max}, {"99.9%  ", d.P99_9}, {"99.0%  ", d.P99}, {"95.0%  ", d.P95}, {"90.0%  ", d.P90}, {"75.0%  ", d.P75},
		{"Median ", d.Median}, {"25.0%  ", d.P25}, {"10.0%  ", d.P10}, {" 5.0%  ", d.P5}, {" 1.0%  ", d.P1}, {" 0.1%  ", d.P0_1}, {"Minimum", d.Min}} {
		f("%s Δp: %6.3f%%\n", r.name, 100*r.v)
	}
	f("RMS Δp    : %6.3f ± %5.3f %%\n", 100*s.RMSDP.Value, 100*s.RMSDP.Unc)
	f("Same top p: %6.3f ± %5.3f %%\n", 100*s.SameTop.Value, 100*s.SameTop.Unc)
	_, err := io.WriteString(w, b.String())
	return err
}
