package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"github.com/urfave/cli/v2"
	"golang.org/x/term"

	"qtool/formats/infile"
	"qtool/formats/model"
	"qtool/runtime"
	"qtool/runtime/cpu"
	"qtool/runtime/cuda"
	"qtool/runtime/tokenizer"
	"qtool/runtime/tp"
)

// wikitextFile is the file `--ppl wikitext` resolves to.
const wikitextFile = "wiki.test.raw"

// defaultPrompt is generated from when neither --ppl nor --prompt is given.
const defaultPrompt = "The"

func verifyCommand() *cli.Command {
	return &cli.Command{
		Name:      "verify",
		Usage:     "run a model in the bundled runtime: perplexity and/or generation",
		ArgsUsage: "MODEL (an HF directory, an msmodelslim directory or a Kuiper file)",
		UsageText: "qtool verify --ppl testdata/corpus/sotu-test.raw testdata/llama-mini\n" +
			"   qtool verify --ppl wikitext --ctx 2048 --json /tmp/llama-mini-awq\n" +
			"   qtool verify --prompt \"The State of the Union is\" --max-new 40 --tokenizer testdata/llama-mini /tmp/m.bin\n" +
			"   qtool verify --device cuda --tp 2 --ppl FILE MODEL\n" +
			"   qtool verify --tp 2 --tp-processes --ppl FILE MODEL      (one process per rank, on this machine)\n" +
			"   torchrun --nnodes 2 --nproc-per-node 1 ... --no-python qtool verify --device cuda --ppl FILE MODEL\n" +
			"   qtool verify --kld testdata/llama-mini --kld-cache /tmp/mini.kld --ppl testdata/corpus/sotu-test.raw --max-chunks 20 /tmp/llama-mini-awq\n" +
			"   qtool verify --kld /tmp/mini.kld /tmp/llama-mini-gptq        (reuses the base's logits: text, ctx and protocol from the file)",
		Description: "Perplexity follows the GPTQ/AWQ protocol by default (disjoint chunks of --ctx tokens, the\n" +
			"tail dropped, exp of the mean of per-chunk mean NLLs); --protocol llamacpp gives llama.cpp's\n" +
			"(BOS replaces each chunk's first token, only the second half of each chunk is scored).\n" +
			"--ppl wikitext reads " + wikitextFile + " from $QTOOL_DATA (default ~/.cache/qtool/datasets/wikitext-2-raw).\n" +
			"Without --ppl or --prompt, a few tokens are generated from \"" + defaultPrompt + "\".\n" +
			"Generation reports its rate over the whole call, the time to the first token (the prompt's prefill) and\n" +
			"the steady decode rate after it (with CUDA graphs, after the first chunk of replays).\n" +
			"--kld BASE compares MODEL's next-token distributions with BASE's (the float model, or a logits file\n" +
			"written by --kld-cache) over the --ppl text in the same chunks: mean KL divergence ± uncertainty and its\n" +
			"percentiles, top-1 agreement, Δp (probability of the correct token, MODEL − BASE) and PPL(MODEL)/PPL(BASE),\n" +
			"as llama.cpp's perplexity --kl-divergence prints them. --kld-cache FILE stores BASE's log-probabilities\n" +
			"(16 bits a vocabulary entry, 2·vocab+12 bytes a scored token) or reuses them when FILE exists; a file made\n" +
			"from another text, tokenization, ctx or protocol is refused with what differs.\n" +
			"Tensor parallelism: --tp N runs N ranks in this process; with --tp-processes, one process per rank on\n" +
			"this machine. Started by a launcher (torchrun's WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR and MASTER_PORT,\n" +
			"or mpirun's or srun's rank variables), verify runs as one rank of the job: rank 0 listens at\n" +
			"MASTER_ADDR:MASTER_PORT (under torchrun, whose store holds that port, the port after it; QTOOL_TP_PORT\n" +
			"names another), GPU ranks use GPU LOCAL_RANK and NCCL (rank 0 hands out NCCL's id), CPU ranks exchange\n" +
			"over TCP; only rank 0 prints. QTOOL_TP_TIMEOUT (e.g. 30m) bounds every wait for another rank.",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "ppl", Usage: "measure perplexity on `FILE` (raw text), or on wikitext-2's test file with \"wikitext\""},
			&cli.IntFlag{Name: "ctx", Value: runtime.DefaultCtx, Usage: "perplexity context length (512, or 2048 for the papers' wikitext2@2048)"},
			&cli.IntFlag{Name: "max-chunks", Usage: "evaluate at most `N` chunks (0: all)"},
			&cli.StringFlag{Name: "protocol", Value: runtime.ProtocolGPTQ, Usage: "perplexity protocol: gptq or llamacpp"},
			&cli.StringFlag{Name: "prompt", Usage: "generate a continuation of `TEXT`"},
			&cli.IntFlag{Name: "max-new", Value: 64, Usage: "generate at most `N` new tokens"},
			&cli.Float64Flag{Name: "temperature", Usage: "sampling temperature (0: greedy)"},
			&cli.IntFlag{Name: "top-k", Usage: "sample from the `K` most likely tokens (0: all)"},
			&cli.Float64Flag{Name: "top-p", Usage: "nucleus sampling probability mass (0 or 1: off)"},
			&cli.Uint64Flag{Name: "seed", Usage: "random seed for sampling"},
			&cli.BoolFlag{Name: "no-graph", Usage: "decode step by step, without replaying a captured step (CUDA graphs; to compare)"},
			&cli.StringFlag{Name: "kv-cache", Value: "auto", Usage: "KV cache element type: auto (int8 when the model carries msmodelslim C8 scales, else fp16 on CUDA and fp32 on the CPU), fp32, fp16 (CUDA: half the cache memory and attention reads) or int8 (the model's C8 scales; a quarter of fp32's)"},
			&cli.StringFlag{Name: "device", Value: "auto", Usage: "where to run: auto (CUDA when a GPU and driver are present, else CPU), cuda or cpu"},
			&cli.IntFlag{Name: "threads", Usage: "CPU threads (0: all cores)"},
			&cli.IntFlag{Name: "tp", Usage: "run tensor-parallel over `N` ranks (a `qtool shard` directory runs on its own N)"},
			&cli.BoolFlag{Name: "tp-processes", Usage: "with --tp N: run each rank in a process of its own on this machine"},
			&cli.StringFlag{Name: "tokenizer", Usage: "tokenizer `PATH` (a directory, tokenizer.json or tokenizer.model); default: beside the model"},
			&cli.StringFlag{Name: "kld", Usage: "KL divergence of MODEL from `BASE` (the float model, or a logits file from --kld-cache)"},
			&cli.StringFlag{Name: "kld-cache", Usage: "with --kld BASE (a model): write BASE's logits to `FILE`, or read them when FILE exists", TakesFile: true},
			&cli.StringFlag{Name: "cpuprofile", Usage: "write this run's CPU profile (pprof) to `FILE`; the ranks of --tp-processes or a launcher write FILE.rankN", TakesFile: true},
			&cli.StringFlag{Name: "trace", Usage: "write this run's Go execution trace (go tool trace) to `FILE`; ranks as --cpuprofile", TakesFile: true},
			&cli.BoolFlag{Name: "json", Usage: "print the results as one JSON object"},
			&cli.BoolFlag{Name: "quiet", Aliases: []string{"q"}, Usage: "no progress bar"},
		},
		Action: runVerify,
	}
}

// verifyResult is what --json prints.
type verifyResult struct {
	Model      string   `json:"model"`
	PPL        *float64 `json:"ppl,omitempty"`
	Tokens     int      `json:"tokens,omitempty"`
	Chunks     int      `json:"chunks,omitempty"`
	Ctx        int      `json:"ctx,omitempty"`
	Protocol   string   `json:"protocol,omitempty"`
	Scored     int      `json:"scored,omitempty"`
	Seconds    float64  `json:"seconds,omitempty"`
	TokensPerS float64  `json:"tokens_per_s,omitempty"`
	// ChunkSeconds is each perplexity chunk's wall time, in order (a slow
	// first chunk is warm-up; the rest show the steady rate).
	ChunkSeconds []float64 `json:"chunk_seconds,omitempty"`
	// Kernels are the kernel launches of the perplexity pass on the (first
	// local rank's) CUDA device, by kernel.
	Kernels map[string]int `json:"kernels,omitempty"`
	// KernelSeconds are their device seconds where
	// $QTOOL_CUDA_KERNEL_TIMES=1 (each launch timed alone: see
	// cuda.Options.KernelTimes).
	KernelSeconds map[string]float64 `json:"kernel_seconds,omitempty"`
	Device        string             `json:"device"`
	Generation    *generation        `json:"generation,omitempty"`
}

type generation struct {
	Prompt    string `json:"prompt"`
	PromptIDs []int  `json:"prompt_ids"`
	IDs       []int  `json:"ids"` // new tokens only
	Text      string `json:"text"`
	// TokensPerS is the new tokens over the whole call, the prompt's
	// prefill and the first steps included.
	TokensPerS float64 `json:"tokens_per_s"`
	// FirstTokenS is the time to the first new token (the prefill);
	// DecodeTokS the rate once decoding is steady (runtime.GenTiming:
	// after the first chunk of replays of a captured step, else after the
	// first token; 0 where no token came after that).
	FirstTokenS float64 `json:"first_token_s"`
	DecodeTokS  float64 `json:"decode_tok_s"`
}

func runVerify(c *cli.Context) (err error) {
	job, isRank, err := rankJob(c)
	if err != nil {
		return err
	}
	if (isRank || c.Bool("tp-processes")) && (c.IsSet("kld") || c.IsSet("kld-cache")) {
		return fmt.Errorf("verify: --kld runs in one process (use --tp N without --tp-processes or a launcher)")
	}
	if c.Bool("tp-processes") && !isRank {
		n := c.Int("tp")
		if !c.IsSet("tp") && c.NArg() == 1 { // a shard directory knows its ranks
			if mm, err := tp.OpenModel(c.Args().First()); err == nil {
				n = tp.ShardedSize(mm)
				mm.Close()
			}
		}
		if n < 2 {
			return fmt.Errorf("verify --tp-processes: give the number of ranks with --tp N (N ≥ 2), or a shard directory")
		}
		stdout, stderr, _ := outputs(c)
		return launchRanks(n, stdout, stderr)
	}
	if isRank && job.Rank != 0 {
		c.App.Writer = io.Discard // only rank 0 reports
	}
	for _, rec := range []recorder{cpuProfile, execTrace} {
		p := c.String(rec.flag)
		if p == "" {
			continue
		}
		stop, perr := record(rec, p, job, isRank)
		if perr != nil {
			return fmt.Errorf("verify: %w", perr)
		}
		defer func() { // err: runVerify's result (a failed write of the file fails the run)
			if serr := stop(); serr != nil && err == nil {
				err = fmt.Errorf("verify: %w", serr)
			}
		}()
	}
	if c.IsSet("kld") || c.IsSet("kld-cache") {
		return runVerifyKLD(c)
	}
	if c.NArg() != 1 {
		for _, a := range c.Args().Slice()[min(1, c.NArg()):] {
			if strings.HasPrefix(a, "-") {
				return fmt.Errorf("verify: options must come before MODEL (%q follows it): qtool verify [options] MODEL", a)
			}
		}
		return fmt.Errorf("verify: want exactly one MODEL argument, got %d (see `qtool verify --help`)", c.NArg())
	}
	path := c.Args().First()
	stdout, stderr, logf := outputs(c)

	// Validate the cheap options before reading anything big.
	proto := c.String("protocol")
	if proto != runtime.ProtocolGPTQ && proto != runtime.ProtocolLlamaCpp {
		return fmt.Errorf("verify: --protocol %q: want %s or %s", proto, runtime.ProtocolGPTQ, runtime.ProtocolLlamaCpp)
	}
	if c.Int("ctx") < 2 {
		return fmt.Errorf("verify: --ctx %d is too small", c.Int("ctx"))
	}
	if k := c.String("kv-cache"); k != "auto" && k != "fp32" && k != "fp16" && k != "int8" {
		return fmt.Errorf("verify: --kv-cache %q: want auto, fp32, fp16 or int8", k)
	}
	var pplPath string
	var text []byte
	if p := c.String("ppl"); p != "" {
		var err error
		if pplPath, text, err = readPPLText(p); err != nil {
			return err
		}
	}
	prompt := c.String("prompt")
	if pplPath == "" && prompt == "" {
		prompt = defaultPrompt
	}

	mm, err := tp.OpenModel(path)
	if err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	defer mm.Close()
	cfg := mm.Config
	tok, err := loadTokenizer(c.String("tokenizer"), path, mm)
	if err != nil {
		return err
	}
	if err := checkTokenizer(tok, cfg); err != nil {
		return err
	}
	m, be, err := loadOn(c, mm)
	if err != nil {
		return err
	}
	defer be.Close()
	res := verifyResult{Model: path, Device: be.Name()}
	logf("model   %s (%s, %s, %d layers, hidden %d, vocab %d)\n", path, mm.Format, cfg.Arch, cfg.Layers, cfg.Hidden, cfg.Vocab)
	logf("device  %s\n", be.Name())
	if m.KVInt8() {
		logf("kvcache int8 (C8 scales and offsets of the model)\n")
	}

	if pplPath != "" {
		ids := tokenizer.EncodeWithBOS(tok, string(text))
		ctx := c.Int("ctx")
		if len(ids) < ctx {
			return fmt.Errorf("verify: --ppl %s is too short: %d tokens, fewer than one chunk of --ctx %d", pplPath, len(ids), ctx)
		}
		opt := runtime.PPLOptions{Ctx: ctx, MaxChunks: c.Int("max-chunks"), Protocol: proto}
		total := len(ids) / ctx
		if opt.MaxChunks > 0 && opt.MaxChunks < total {
			total = opt.MaxChunks
		}
		start, err := startTimer(be)
		if err != nil {
			return fmt.Errorf("verify: %w", err)
		}
		bar := chunkBar(c, stderr, total, "perplexity")
		last := start
		opt.Progress = func(done, total int, running float64) {
			now := time.Now()
			res.ChunkSeconds = append(res.ChunkSeconds, now.Sub(last).Seconds())
			last = now
			if bar == nil {
				return
			}
			tps := float64(done*ctx) / time.Since(start).Seconds()
			bar.Describe(fmt.Sprintf("ppl %.4f, %.0f tok/s", running, tps))
			_ = bar.Set(done)
		}
		before, beforeT := kernelCounts(be)
		r, err := runtime.Perplexity(m, ids, opt)
		after, afterT := kernelCounts(be)
		res.Kernels, res.KernelSeconds = sinceBefore(after, before), sinceBefore(afterT, beforeT)
		if bar != nil {
			_ = bar.Finish()
			fmt.Fprintln(stderr)
		}
		if err != nil {
			return fmt.Errorf("verify: %s: %w", pplPath, err)
		}
		sec := time.Since(start).Seconds()
		res.PPL, res.Tokens, res.Chunks, res.Ctx, res.Protocol, res.Scored = &r.PPL, r.Tokens, r.Chunks, r.Ctx, r.Protocol, r.Scored
		res.Seconds, res.TokensPerS = sec, float64(r.Chunks*r.Ctx)/sec
		logf("ppl     %.4f  (%s protocol, %s: %d tokens, %d chunks × ctx %d, %d scored; %.1f s, %.0f tokens/s)\n",
			r.PPL, r.Protocol, filepath.Base(pplPath), r.Tokens, r.Chunks, r.Ctx, r.Scored, sec, res.TokensPerS)
	}

	if prompt != "" {
		ids := tokenizer.EncodeWithBOS(tok, prompt)
		if len(ids) == 0 {
			return fmt.Errorf("verify: --prompt %s encodes to no tokens", abbreviate(prompt))
		}
		if cfg.MaxSeq > 0 && len(ids) >= cfg.MaxSeq {
			return fmt.Errorf("verify: --prompt %s is %d tokens; the model holds %d positions (max_position_embeddings), so at most %d prompt tokens", abbreviate(prompt), len(ids), cfg.MaxSeq, cfg.MaxSeq-1)
		}
		eos := tok.EOS()
		for _, e := range cfg.EOS {
			if !slices.Contains(eos, e) {
				eos = append(eos, e)
			}
		}
		if eos == nil {
			eos = []int{}
		}
		maxNew := c.Int("max-new")
		if cfg.MaxSeq > 0 && maxNew > cfg.MaxSeq-len(ids) { // no overflow: both sides are in range
			maxNew = cfg.MaxSeq - len(ids)
		}
		// The prompt is echoed with the first token, so that an error
		// (a prompt too long, a --max-new too large) comes without it.
		var stream io.Writer
		echo := func() {}
		if !c.Bool("json") {
			echo = func() {
				if stream == nil {
					stream = stdout
					fmt.Fprintf(stdout, "prompt  %s", prompt)
				}
			}
		}
		start, err := startTimer(be)
		if err != nil {
			return fmt.Errorf("verify: %w", err)
		}
		var tm runtime.GenTiming
		out, err := runtime.Generate(m, ids, runtime.GenOptions{
			MaxNew: maxNew, Temperature: c.Float64("temperature"), TopK: c.Int("top-k"), TopP: c.Float64("top-p"),
			Seed: c.Uint64("seed"), EOS: eos, NoGraph: c.Bool("no-graph"), Timing: &tm,
			OnToken: func(id int) {
				echo()
				if stream != nil {
					fmt.Fprint(stream, tok.DecodeToken(id))
				}
			},
		})
		if err != nil {
			return fmt.Errorf("verify: %w", err)
		}
		echo()
		sec := time.Since(start).Seconds()
		g := &generation{Prompt: prompt, PromptIDs: ids, IDs: out, Text: tok.Decode(out),
			FirstTokenS: tm.FirstToken.Seconds(), DecodeTokS: tm.SteadyTokensPerS()}
		if g.IDs == nil {
			g.IDs = []int{}
		}
		if sec > 0 {
			g.TokensPerS = float64(len(out)) / sec
		}
		res.Generation = g
		if g.DecodeTokS > 0 {
			logf("\n        (%d new tokens, %.1f tokens/s; the first after %.1f ms, steady decode %.1f tokens/s)\n",
				len(out), g.TokensPerS, 1e3*g.FirstTokenS, g.DecodeTokS)
		} else {
			logf("\n        (%d new tokens, %.1f tokens/s)\n", len(out), g.TokensPerS)
		}
	}
	if c.Bool("json") {
		return json.NewEncoder(stdout).Encode(res)
	}
	return nil
}

// resolvePPLFile maps the --ppl argument to a readable file; "wikitext"
// means wiki.test.raw in $QTOOL_DATA (default
// ~/.cache/qtool/datasets/wikitext-2-raw).
func resolvePPLFile(arg string) (string, error) {
	if arg != "wikitext" {
		fi, err := os.Stat(arg)
		if err != nil {
			return "", fmt.Errorf("verify: --ppl: %w", err)
		}
		if !fi.Mode().IsRegular() {
			return "", fmt.Errorf("verify: --ppl %s is %s; give a text file", arg, infile.Kind(fi.Mode()))
		}
		return arg, nil
	}
	dir := os.Getenv("QTOOL_DATA")
	if dir == "" {
		home, err := os.UserHomeDir()
		if err != nil {
			return "", fmt.Errorf("verify: --ppl wikitext: no home directory to find the dataset in (set QTOOL_DATA): %w", err)
		}
		dir = filepath.Join(home, ".cache", "qtool", "datasets", "wikitext-2-raw")
	}
	candidates := []string{filepath.Join(dir, wikitextFile), filepath.Join(dir, "wikitext-2-raw", wikitextFile)}
	for _, p := range candidates {
		if fi, err := os.Stat(p); err == nil && !fi.IsDir() {
			return p, nil
		}
	}
	return "", fmt.Errorf("verify: --ppl wikitext: %s not found. Download wikitext-2-raw-v1.zip "+
		"(https://s3.amazonaws.com/research.metamind.io/wikitext/wikitext-2-raw-v1.zip), unzip it and put %s at %s "+
		"(or set QTOOL_DATA to the directory holding %s)", candidates[0], wikitextFile, candidates[0], wikitextFile)
}

// loadTokenizer loads the tokenizer given by --tokenizer, or the one found
// beside the model.
func loadTokenizer(flag, modelPath string, mm *model.Model) (tokenizer.Tokenizer, error) {
	if flag != "" {
		fi, err := os.Stat(flag)
		if err != nil {
			return nil, fmt.Errorf("verify: --tokenizer: %w", err)
		}
		var t tokenizer.Tokenizer
		if fi.IsDir() {
			t, err = tokenizer.LoadDir(flag)
		} else {
			t, err = tokenizer.LoadFile(flag)
		}
		if err != nil {
			return nil, fmt.Errorf("verify: --tokenizer %s: %w", flag, err)
		}
		return t, nil
	}
	dir := mm.TokenizerDir
	if dir == "" {
		dir = modelPath
		if fi, err := os.Stat(modelPath); err == nil && !fi.IsDir() {
			dir = filepath.Dir(modelPath)
		}
	}
	t, err := tokenizer.LoadDir(dir)
	if errors.Is(err, tokenizer.ErrNoTokenizer) {
		return nil, fmt.Errorf("verify: no tokenizer beside the model: %s has neither %s nor %s; copy the tokenizer files there or pass --tokenizer PATH",
			dir, tokenizer.TokenizerJSONFile, tokenizer.SentencePieceFile)
	}
	if err != nil {
		return nil, fmt.Errorf("verify: %w", err)
	}
	return t, nil
}

// checkTokenizer rejects a tokenizer that cannot belong to the model: one
// with more ids than the embedding table, or one whose end-of-sequence ids
// share nothing with the model's.
func checkTokenizer(t tokenizer.Tokenizer, cfg model.Config) error {
	if err := tokenizer.CheckVocab(t, cfg.Vocab); err != nil {
		return fmt.Errorf("verify: %w", err)
	}
	teos := t.EOS()
	if len(teos) == 0 || len(cfg.EOS) == 0 {
		return nil
	}
	for _, e := range teos {
		if slices.Contains(cfg.EOS, e) {
			return nil
		}
	}
	return fmt.Errorf("verify: tokenizer does not match the model: its end-of-sequence ids %v share nothing with the model's eos_token_id %v (--tokenizer from another model?)", teos, cfg.EOS)
}

// newBackend returns the backend for --device, tensor-parallel over tpN
// ranks when tpN > 1 or mm is a shard directory.
func newBackend(device string, threads, tpN int, mm *model.Model) (runtime.Backend, error) {
	if tpN < 0 {
		return nil, fmt.Errorf("verify: --tp %d: want a positive rank count", tpN)
	}
	if tpN > 1 || tp.ShardedSize(mm) > 0 {
		if device == "cpu" {
			return tp.NewCPU(mm, tpN, threads)
		}
		ranks := max(tpN, tp.ShardedSize(mm))
		if n, err := cuda.DeviceCount(); err == nil && n < ranks {
			if device == "cuda" {
				return nil, fmt.Errorf("verify: --device cuda --tp %d: %d GPU(s) present, one per rank is needed (--device cpu runs the ranks on the CPU)", ranks, n)
			}
			fmt.Fprintf(os.Stderr, "qtool: %d GPU(s) present for %d ranks; running the ranks on the CPU\n", n, ranks)
			return tp.NewCPU(mm, tpN, threads)
		}
		be, err := tp.NewGPU(mm, tpN, cuda.NewRank)
		switch {
		case err == nil:
			notePeerMemory(be)
			return be, nil
		case device != "cuda" && errors.Is(err, cuda.ErrNoDriver):
			fmt.Fprintf(os.Stderr, "qtool: %v; running the %d ranks on the CPU\n", err, max(tpN, tp.ShardedSize(mm)))
			return tp.NewCPU(mm, tpN, threads)
		default:
			return nil, fmt.Errorf("verify: --device %s --tp: %w", device, err)
		}
	}
	switch device {
	case "cpu":
		return cpu.New(threads), nil
	case "auto", "", "cuda":
		be, err := cuda.New()
		switch {
		case err == nil:
			return be, nil
		case device != "cuda" && errors.Is(err, cuda.ErrNoDriver):
			fmt.Fprintf(os.Stderr, "qtool: %v; running on the CPU\n", err)
			return cpu.New(threads), nil
		default:
			return nil, fmt.Errorf("verify: --device %s: %w", device, err)
		}
	}
	return nil, fmt.Errorf("verify: --device %q: want auto, cpu or cuda", device)
}

// isTerminal reports whether w is a terminal (the progress bar is drawn
// only there).
func isTerminal(w io.Writer) bool {
	f, ok := w.(*os.File)
	return ok && term.IsTerminal(int(f.Fd()))
}

// abbreviate quotes s for a message, cut to its first 60 characters.
func abbreviate(s string) string {
	if r := []rune(s); len(r) > 60 {
		return fmt.Sprintf("%q… (%d characters)", string(r[:60]), len(r))
	}
	return fmt.Sprintf("%q", s)
}
