package main

// Shared plumbing of the calibration commands (qtool gptq, awq, smoothquant):
// flags, output-format checks, calibration loading, progress bars, the
// per-module table, writing, --verify and --json.

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	goruntime "runtime"
	"sort"
	"strings"
	"time"

	"github.com/urfave/cli/v2"

	"qtool/convert"
	"qtool/formats/hf"
	"qtool/formats/infile"
	"qtool/formats/model"
	"qtool/quantize/calib"
	"qtool/runtime"
	"qtool/runtime/cpu"
	"qtool/runtime/cuda"
	"qtool/runtime/tokenizer"
)

// resultKind describes what a quantization run will produce, enough to know
// which formats can hold it before any work is done.
type resultKind struct {
	bits  int
	group int // 0: per row
	sym   bool
	w8a8  bool
	// dynamic: W8A8 with per-token dynamic activations; sparse: W8A8 from
	// pruned weights (W8A8S)
	dynamic, sparse bool
	kvInt8          bool // an int8 KV cache (C8)
	arch            model.Arch
	bias            bool // attention biases (Qwen2)
}

func (k resultKind) String() string {
	kv := ""
	if k.kvInt8 {
		kv = " and an int8 KV cache"
	}
	if k.w8a8 {
		act, w := "static", ""
		if k.dynamic {
			act = "per-token dynamic"
		}
		if k.sparse {
			w = "sparse "
		}
		return fmt.Sprintf("W8A8 (int8 %sper-channel weights, %s int8 activations)%s", w, act, kv)
	}
	g := "per-channel"
	if k.group > 0 {
		g = fmt.Sprintf("group %d", k.group)
	}
	s := "asymmetric"
	if k.sym {
		s = "symmetric"
	}
	return fmt.Sprintf("%d-bit %s %s weights%s", k.bits, s, g, kv)
}

// scheme is k as the formats registry describes a quantization result.
func (k resultKind) scheme() convert.Scheme {
	return convert.Scheme{Arch: k.arch, AttnBias: k.bias, Bits: k.bits, Group: k.group, Sym: k.sym, W8A8: k.w8a8, KVInt8: k.kvInt8}
}

// checkFormat refuses a format that cannot hold k, naming those that can.
func checkFormat(cmd, format string, k resultKind) (string, error) {
	f, err := convert.CanonicalFormat(format)
	if err != nil {
		return "", fmt.Errorf("%s: --format: %w", cmd, err)
	}
	if err := convert.CanHoldScheme(f, k.scheme()); err != nil {
		alt := "none of the formats"
		if can := convert.SchemeHolders(k.scheme()); len(can) > 0 {
			alt = strings.Join(can, ", ")
		}
		return "", fmt.Errorf("%s: --format %s cannot hold this result (%s): %v; formats that can: %s", cmd, f, k, err, alt)
	}
	return f, nil
}

// qtoolOnlyFlag is --qtool-only of the commands that write Kuiper files
// (export, convert, quantize and the calibration commands): it lets them
// write what kuiper.ReaderCompatible refuses.
func qtoolOnlyFlag() *cli.BoolFlag {
	return &cli.BoolFlag{Name: "qtool-only", Usage: "write files whose own readers would not run this model (only qtool does): Qwen3 in a Kuiper or llama2.c layout or Qwen2 in an ak42 one (q/k norms or biases in an extension those readers skip), ak47/ak48 of a Qwen3 shape OrinMLLM cannot read (heads × head_dim ≠ hidden)"}
}

// quantFlags are the flags every calibration command shares; defBits and
// defGroup differ per method.
func quantFlags(defBits, defGroup int, defFormat string) []cli.Flag {
	return []cli.Flag{
		&cli.StringFlag{Name: "hf", Usage: "Hugging Face checkpoint `DIR` to quantize (float weights)", Required: true, TakesFile: true},
		&cli.StringFlag{Name: "calib", Usage: "calibration `FILE`: UTF-8 text, or JSONL with one {\"text\": ...} per line", Required: true, TakesFile: true},
		&cli.IntFlag{Name: "nsamples", Value: calib.DefaultNSamples, Usage: "calibration windows"},
		&cli.IntFlag{Name: "seqlen", Value: calib.DefaultSeqLen, Usage: "tokens per calibration window"},
		&cli.IntFlag{Name: "bits", Value: defBits, Usage: "weight bits"},
		&cli.IntFlag{Name: "group", Value: defGroup, Usage: "input columns per scale group (0: per channel)"},
		&cli.StringFlag{Name: "out", Aliases: []string{"o"}, Usage: "output `PATH` (a directory, or a file for Kuiper formats)", Required: true, TakesFile: true},
		&cli.StringFlag{Name: "format", Value: defFormat, Usage: "output format: ak48, kuiper-int8, ak42-v2, msmodelslim, autoawq or gptq (each as it can hold the result)"},
		qtoolOnlyFlag(),
		&cli.StringFlag{Name: "kv-cache", Value: "float", Usage: "KV cache of the result: float, or int8 (msmodelslim C8: per-channel scales and offsets of the keys after RoPE and of the values, from the calibration windows)"},
		&cli.StringFlag{Name: "verify", Usage: "after writing, print the perplexity of the written model on `FILE`", TakesFile: true},
		&cli.IntFlag{Name: "verify-chunks", Usage: "evaluate at most `N` chunks of 512 tokens with --verify (0: all)"},
		&cli.IntFlag{Name: "threads", Usage: "CPU threads (0: all cores)"},
		&cli.StringFlag{Name: "device", Value: "auto", Usage: "where calibration runs: auto (the GPU when one is usable, else the CPU), cpu or cuda"},
		&cli.BoolFlag{Name: "json", Usage: "print a JSON summary instead of the table"},
		&cli.BoolFlag{Name: "quiet", Aliases: []string{"q"}, Usage: "no progress bars"},
		&cli.BoolFlag{Name: "resume", Usage: "keep finished layers in a work directory .OUT.resume beside the output and continue a killed run from it (same flags, model and calibration; removed once the output is written)"},
	}
}

// quantJob is one run of a calibration command.
type quantJob struct {
	cmd    string
	method string // the report's method ("" : cmd)
	kind   resultKind
	format string
	loss   string // name of the table's loss column
	// run quantizes the session's model.
	run func(s *calib.Session, progress calib.Progress) ([]calib.ModuleStat, error)
}

// runQuant executes job with the shared flags of c.
func runQuant(c *cli.Context, job quantJob) error {
	if c.NArg() > 0 {
		return fmt.Errorf("%s: unexpected arguments %q", job.cmd, c.Args().Slice())
	}
	stdout, stderr, _ := outputs(c)
	dir, out := c.String("hf"), c.String("out")
	ns, sl := c.Int("nsamples"), c.Int("seqlen")
	if ns <= 0 || sl < 2 {
		return fmt.Errorf("%s: --nsamples %d --seqlen %d: want > 0 and >= 2", job.cmd, ns, sl)
	}
	if _, err := os.Stat(out); err == nil {
		if wd := calib.CheckpointDir(out); c.Bool("resume") {
			if _, err := os.Stat(wd); err == nil {
				return fmt.Errorf("%s: %s already exists beside the work directory %s: a --resume run was written completely and stopped before it removed its work directory, which can be removed", job.cmd, out, wd)
			}
		}
		return fmt.Errorf("%s: %s already exists; remove it or choose another --out", job.cmd, out)
	}
	verifyFile := c.String("verify")
	if verifyFile != "" {
		if _, err := os.Stat(verifyFile); err != nil {
			return fmt.Errorf("%s: --verify: %w", job.cmd, err)
		}
	}
	threads := c.Int("threads")
	if threads <= 0 {
		threads = max(1, goruntime.NumCPU())
	}
	start := time.Now()
	m, err := hf.Open(dir)
	if err != nil {
		return fmt.Errorf("%s: %w", job.cmd, err)
	}
	defer m.Close()
	job.kind.arch, job.kind.bias = m.Config.Arch, m.Config.AttnBias
	switch kv := c.String("kv-cache"); kv {
	case "float":
	case "int8":
		job.kind.kvInt8 = true
	default:
		return fmt.Errorf("%s: --kv-cache %q: want float or int8", job.cmd, kv)
	}
	format, err := checkFormat(job.cmd, c.String("format"), job.kind)
	if err != nil {
		return err
	}
	if err := convert.CheckShape(format, m.Config, c.Bool("qtool-only")); err != nil {
		return fmt.Errorf("%s: %w", job.cmd, err)
	}
	job.format = format
	tokDir := m.TokenizerDir
	if tokDir == "" {
		tokDir = dir
	}
	tok, err := tokenizer.LoadDir(tokDir)
	if err != nil {
		return fmt.Errorf("%s: %w", job.cmd, err)
	}
	if err := tokenizer.CheckVocab(tok, m.Config.Vocab); err != nil {
		return fmt.Errorf("%s: %w", job.cmd, err)
	}
	windows, ntok, err := calib.Load(c.String("calib"), tok, ns, sl)
	if err != nil {
		return fmt.Errorf("%s: %w", job.cmd, err)
	}
	quiet := c.Bool("quiet") || c.Bool("json")
	notices := stderr
	if quiet {
		notices = io.Discard
	}
	be, err := calibBackend(c.String("device"), threads, notices)
	if err != nil {
		return fmt.Errorf("%s: %w", job.cmd, err)
	}
	defer be.Close()
	s, err := calib.NewSession(m, be, windows, threads)
	if err != nil {
		return fmt.Errorf("%s: %w", job.cmd, err)
	}
	defer s.Close()
	if job.kind.kvInt8 {
		s.TrackKVCache()
	}
	bar := newProgress(stderr, quiet, job.cmd+" layer", s.Cfg.Layers)
	var ckpt *calib.Checkpoint
	if workDir := calib.CheckpointDir(out); c.Bool("resume") {
		key, err := resumeKey(c, dir, threads, be.Name(), windows)
		if err != nil {
			return fmt.Errorf("%s: --resume: %w", job.cmd, err)
		}
		if ckpt, err = calib.OpenCheckpoint(workDir, key); err != nil {
			return fmt.Errorf("%s: %w", job.cmd, err)
		}
		defer ckpt.Close()
		if err := s.SetCheckpoint(ckpt); err != nil {
			return fmt.Errorf("%s: %w", job.cmd, err)
		}
		if n := ckpt.LayersDone(); n > 0 {
			fmt.Fprintf(notices, "qtool: resuming after layer %d/%d from %s\n", n, s.Cfg.Layers, workDir)
			bar.Skip(n)
		}
	} else if _, err := os.Stat(workDir); err == nil {
		fmt.Fprintf(notices, "qtool: %s holds the state of an interrupted run; --resume continues it, this run ignores it\n", workDir)
	}
	var layerStats []*calib.ModuleStat
	endLayer := func() {
		if len(layerStats) == 0 {
			return
		}
		st := layerStats[0]
		worst := st
		var parts []string
		for _, m := range layerStats {
			parts = append(parts, fmt.Sprintf("%s %.3g", m.Role, m.Loss))
			if m.RelErr > worst.RelErr {
				worst = m
			}
		}
		bar.Step(fmt.Sprintf("(layer %d): %d modules; %s %s; largest rel. output error %.3g (%s)",
			st.Layer, len(layerStats), job.loss, strings.Join(parts, ", "), worst.RelErr, worst.Role))
		layerStats = layerStats[:0]
	}
	progress := func(l int, st *calib.ModuleStat) {
		if st == nil {
			endLayer()
			bar.Describe(fmt.Sprintf("%d/%d", l+1, s.Cfg.Layers))
			return
		}
		if ckpt != nil {
			ckpt.Stat(*st)
		}
		layerStats = append(layerStats, st)
		bar.Describe(fmt.Sprintf("%d/%d %s", l+1, s.Cfg.Layers, st.Role))
	}
	stats, err := job.run(s, progress)
	if err == nil {
		endLayer()
	}
	bar.Finish()
	if err != nil {
		return fmt.Errorf("%s: %w", job.cmd, err)
	}
	if ckpt != nil {
		stats = append(ckpt.ResumedStats(), stats...)
	}
	tw := time.Now()
	if err := convert.SaveWith(s.Out, format, out, convert.SaveOptions{QtoolOnly: c.Bool("qtool-only")}); err != nil {
		return fmt.Errorf("%s: %w", job.cmd, err)
	}
	if ckpt != nil {
		if err := ckpt.Remove(); err != nil {
			fmt.Fprintf(stderr, "qtool: warning: %s written, but its work directory stays: %v\n", out, err)
		}
	}
	phases := s.Phases()
	phases["write"] = time.Since(tw).Seconds()
	method := job.method
	if method == "" {
		method = job.cmd
	}
	sum := calib.RunReport{Method: method, Model: dir, Out: out, Format: format, Scheme: job.kind.String(), LossName: job.loss,
		NSamples: ns, SeqLen: sl, CalibTokens: ntok, Seconds: time.Since(start).Seconds(), Device: be.Name(), Phases: phases,
		PeakHostMiB: calib.PeakRSSMiB(), Modules: stats}
	if p, ok := be.(interface{ PeakBytes() int64 }); ok {
		sum.PeakDeviceMiB = float64(p.PeakBytes()) / (1 << 20)
	}
	if !c.Bool("json") {
		if err := calib.WriteTable(stdout, stats, job.loss); err != nil {
			return err
		}
		fmt.Fprintf(stdout, "wrote %s (%s, %s) in %.1f s on %s; calibration %d × %d tokens from %s (%d tokens)\n",
			out, format, job.kind, sum.Seconds, be.Name(), ns, sl, c.String("calib"), ntok)
		fmt.Fprintf(stdout, "phases: %s; peak host memory %.0f MiB", formatPhases(phases), sum.PeakHostMiB)
		if sum.PeakDeviceMiB > 0 {
			fmt.Fprintf(stdout, ", device %.0f MiB", sum.PeakDeviceMiB)
		}
		fmt.Fprintln(stdout)
	}
	if verifyFile != "" {
		s.Close()
		v, err := verifyWritten(out, dir, verifyFile, c.Int("verify-chunks"), be)
		if err != nil {
			return fmt.Errorf("%s: --verify: %w", job.cmd, err)
		}
		sum.Verify = v
		if !c.Bool("json") {
			fmt.Fprintf(stdout, "verify %s: ppl %.4f (gptq protocol, ctx %d, %d chunks, %d tokens) read back from %s\n",
				filepath.Base(verifyFile), v.PPL, v.Ctx, v.Chunks, v.Tokens, out)
		}
	}
	if err := calib.WriteReport(s.Out, sum); err != nil {
		return fmt.Errorf("%s: %w", job.cmd, err)
	}
	if c.Bool("json") {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(sum)
	}
	return nil
}

// verifyWritten reads the written model back and measures the perplexity of
// textFile under the GPTQ protocol (ctx 512) on be (the backend calibration
// ran on).
func verifyWritten(out, hfDir, textFile string, maxChunks int, be runtime.Backend) (*calib.VerifyRecord, error) {
	mm, err := convert.Open(out)
	if err != nil {
		return nil, err
	}
	defer mm.Close()
	// Prefer the tokenizer the output carries (or points to); fall back to
	// the source checkpoint's.
	tok, err := loadTokenizer("", out, mm)
	if err != nil {
		if tok, err = loadTokenizer(hfDir, out, mm); err != nil {
			return nil, err
		}
	}
	text, err := infile.ReadFile(textFile, infile.TextLimit)
	if err != nil {
		return nil, err
	}
	ids := tokenizer.EncodeWithBOS(tok, string(text))
	rt, err := runtime.Load(mm, be)
	if err != nil {
		return nil, err
	}
	r, err := runtime.Perplexity(rt, ids, runtime.PPLOptions{MaxChunks: maxChunks})
	if err != nil {
		return nil, err
	}
	return &calib.VerifyRecord{File: textFile, PPL: r.PPL, Tokens: r.Tokens, Chunks: r.Chunks, Ctx: r.Ctx}, nil
}

// calibBackend returns the backend calibration runs on for --device: auto
// takes the GPU when a driver and a device are usable and the CPU
// otherwise, saying which on notices.
func calibBackend(device string, threads int, notices io.Writer) (runtime.Calibrator, error) {
	switch device {
	case "cpu":
		return cpu.New(threads), nil
	case "auto", "cuda":
		be, err := cuda.New()
		switch {
		case err == nil:
			fmt.Fprintf(notices, "qtool: calibrating on %s\n", be.Name())
			return be, nil
		case device == "auto" && errors.Is(err, cuda.ErrNoDriver):
			fmt.Fprintf(notices, "qtool: %v; calibrating on the CPU\n", err)
			return cpu.New(threads), nil
		default:
			return nil, fmt.Errorf("--device %s: %w", device, err)
		}
	}
	return nil, fmt.Errorf("--device %q: want auto, cpu or cuda", device)
}

// formatPhases prints phase times in a fixed order.
func formatPhases(p map[string]float64) string {
	names := make([]string, 0, len(p))
	for n := range p {
		names = append(names, n)
	}
	sort.Strings(names)
	var parts []string
	for _, n := range names {
		parts = append(parts, fmt.Sprintf("%s %.1f s", n, p[n]))
	}
	return strings.Join(parts, ", ")
}
