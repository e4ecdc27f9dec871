package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"slices"
	"strings"
	"time"

	"github.com/urfave/cli/v2"

	"qtool/formats/atomicfile"
	"qtool/formats/model"
	"qtool/runtime"
	"qtool/runtime/cuda"
	"qtool/runtime/tp"
)

func benchCommand() *cli.Command {
	return &cli.Command{
		Name:      "bench",
		Usage:     "measure GPU speed: kernels, prefill and decode of a model (CUDA only)",
		ArgsUsage: "[MODEL]",
		UsageText: "qtool bench --synthetic llama2-7b --format w4a16,w8a16,fp16\n" +
			"   qtool bench --kernels=false --decode 64 /tmp/llama-mini-awq\n" +
			"   qtool bench --tp 2 --kernels=false MODEL    (tensor-parallel vs one GPU)",
		Description: "Measures, in one run on the GPU: device-to-device copy bandwidth and our fp16 tensor-core GEMM\n" +
			"rate (the ceilings), per-kernel GEMV GB/s and GEMM TFLOP/s for each weight format, and for the\n" +
			"model: GPU memory used, prefill tokens/s at --prompt tokens and batch-1 decode tokens/s (plain and\n" +
			"CUDA-graph replay) against the bandwidth roofline. MODEL is any model qtool reads; with\n" +
			"--synthetic llama2-7b a random-weight model of that shape is generated on the GPU in each --format.",
		Flags: []cli.Flag{
			&cli.StringFlag{Name: "synthetic", Usage: "random-weight model of this shape: llama2-7b, llama2-7b-tp2 (one rank's share at --tp 2), llama3-8b, tiny (none: kernels only)"},
			&cli.StringFlag{Name: "format", Value: "w4a16,w8a16,fp16", Usage: "formats of the synthetic model (comma-separated: w4a16, w4a16-pc (per-channel), w4a16-act (GPTQ act-order), w8a16, w8a16-pc (per-channel), w8a8 (static int8 activations), fp16, bf16)"},
			&cli.IntFlag{Name: "prompt", Value: 512, Usage: "prefill length"},
			&cli.IntFlag{Name: "decode", Value: 128, Usage: "decode steps"},
			&cli.StringFlag{Name: "kv-cache", Value: "fp16", Usage: "KV cache element type: fp16 (verify's default on CUDA) or fp32"},
			&cli.BoolFlag{Name: "kernels", Value: true, Usage: "run the per-kernel GEMV/GEMM microbenchmarks"},
			&cli.IntSliceFlag{Name: "gemm-rows", Value: cli.NewIntSlice(512), Usage: "activation rows of the microbenchmarks' GEMMs (comma-separated, e.g. 512,2048,4096)"},
			&cli.StringFlag{Name: "json", Usage: "also write every number to this JSON file"},
			&cli.IntFlag{Name: "tp", Usage: "also run MODEL tensor-parallel over `N` GPUs (NCCL) and compare it with one GPU"},
		},
		Action: runBench,
	}
}

// benchShapes are the [out, in] GEMV/GEMM shapes of the microbenchmarks.
var benchShapes = [][2]int{{14336, 4096}, {4096, 14336}, {4096, 4096}, {11008, 4096}, {4096, 11008}}

// sizeRefFormats are the formats whose GEMV at each of benchShapes gets a
// size reference: an fp16 GEMV of about as many bytes in rows of
// sizeRefCols features (sizeRefRows), how near copy speed a one-row
// product with next to no arithmetic comes at that size — the ceiling
// that GEMV is read against (at 8–30 MB a launch's ramp and tail take a
// large share of it whatever the arithmetic: 49 % of copy at 9 MB, 77 %
// at 24 MB on an H200).
var sizeRefFormats = map[string]bool{"w4a16": true, "w8a16": true}

// sizeRefCols is the size references' row length: the 7B/8B hidden size,
// where the fp16 GEMV reads 86–101 % of copy at its own shapes. (Of as
// many rows as the quantized weight, their rows of 1 088 features read
// about 50 % at 11 008 and 14 336 rows, below the 4-bit kernels
// themselves: the short rows' costs, not the bytes'.)
const sizeRefCols = 4096

// sizeRefRows is the rows, a multiple of 64, of an fp16 weight of
// sizeRefCols features a row and about bytes bytes.
func sizeRefRows(bytes float64) int {
	return max(64, int(math.Round(bytes/(2*sizeRefCols)/64))*64)
}

// sizeRef is one size reference to time: its rows and the weights whose
// bytes it stands for.
type sizeRef struct {
	N  int
	of []string
}

// addSizeRef is refs with a reference of n rows for weight of: added to
// the one of n rows where refs has it (a shape and its transpose have the
// same bytes, so one timing serves both), else appended.
func addSizeRef(refs []sizeRef, n int, of string) []sizeRef {
	for i := range refs {
		if refs[i].N == n {
			refs[i].of = append(refs[i].of, of)
			return refs
		}
	}
	return append(refs, sizeRef{n, []string{of}})
}

// prefillRuns is how many timed prefills give bench's prefill rate (their
// median).
const prefillRuns = 5

// syntheticConfigs are the shapes --synthetic knows.
var syntheticConfigs = map[string]model.Config{
	"llama2-7b": {Arch: model.Llama, Hidden: 4096, Intermediate: 11008, Layers: 32, Heads: 32, KVHeads: 32, HeadDim: 128,
		Vocab: 32000, MaxSeq: 4096, RopeTheta: 10000, NormEps: 1e-5, BOS: 1, EOS: []int{2}},
	"llama3-8b": {Arch: model.Llama, Hidden: 4096, Intermediate: 14336, Layers: 32, Heads: 32, KVHeads: 8, HeadDim: 128,
		Vocab: 128256, MaxSeq: 8192, RopeTheta: 500000, NormEps: 1e-5, BOS: 128000, EOS: []int{128001}},
	// one rank's share of llama2-7b at --tp 2 (half the heads, half the
	// MLP, half the vocabulary; the collectives not included)
	"llama2-7b-tp2": {Arch: model.Llama, Hidden: 4096, Intermediate: 5504, Layers: 32, Heads: 16, KVHeads: 16, HeadDim: 128,
		Vocab: 16000, MaxSeq: 4096, RopeTheta: 10000, NormEps: 1e-5, BOS: 1, EOS: []int{2}},
	"tiny": {Arch: model.Llama, Hidden: 256, Intermediate: 768, Layers: 4, Heads: 4, KVHeads: 2, HeadDim: 64,
		Vocab: 4096, MaxSeq: 2048, RopeTheta: 10000, NormEps: 1e-5, BOS: 1, EOS: []int{2}},
}

type benchReport struct {
	Device      string             `json:"device"`
	CopyGBs     float64            `json:"copy_GBps"`
	GEMMF16     map[string]float64 `json:"gemm_f16_TFLOPs"` // by "NxK@M"
	Kernels     []kernelResult     `json:"kernels,omitempty"`
	Models      []modelResult      `json:"models"`
	TP          *tpResult          `json:"tp,omitempty"`
	MeasuredUTC string             `json:"measured_utc"`
}

type kernelResult struct {
	Kernel   string  `json:"kernel"`
	Format   string  `json:"format"`
	Out, In  int     `json:"-"`
	bytes    float64 // a GEMV's bytes read a call (TimeDecodeGEMV's count)
	Shape    string  `json:"shape"`
	M        int     `json:"m"`
	Seconds  float64 `json:"seconds"`
	GBs      float64 `json:"GBps,omitempty"`
	TFLOPs   float64 `json:"TFLOPs,omitempty"`
	RatioPct float64 `json:"ratio_pct"` // vs copy bandwidth (GEMV) or our fp16 GEMM (GEMM)
	// MMASyncTFLOPs: the GEMM on the mma.sync kernels (Options.NoWGMMA),
	// where the device runs the Hopper ones.
	MMASyncTFLOPs float64 `json:"mma_sync_TFLOPs,omitempty"`
	// WideSeconds and NarrowSeconds: the Hopper GEMM with blocks of two
	// 128-row halves (256 activation rows, or for fp16 and int8 256 weight
	// rows) and of one (Options.WGWide), where it has both.
	WideSeconds   float64 `json:"wide_seconds,omitempty"`
	NarrowSeconds float64 `json:"narrow_seconds,omitempty"`
	// SizeOf, of a size reference (kernel "gemv-size"): the format and
	// shape of each weight whose bytes it reads, comma-separated.
	SizeOf string `json:"size_of,omitempty"`
}

type modelResult struct {
	Name        string  `json:"name"`
	Format      string  `json:"format"`
	WeightBytes int64   `json:"weight_bytes"` // read a decode step (cuda.Linear.DecodeBytes)
	GPUMemBytes uint64  `json:"gpu_mem_used_bytes"`
	PrefillTokS float64 `json:"prefill_tok_s"`
	// PrefillMinTokS and PrefillMaxTokS are the slowest and fastest of the
	// prefillRuns timed prefills PrefillTokS is the median of.
	PrefillMinTokS float64 `json:"prefill_min_tok_s"`
	PrefillMaxTokS float64 `json:"prefill_max_tok_s"`
	// PrefillPlainTokS is PrefillTokS without programmatic dependent
	// launches, measured in the same run.
	PrefillPlainTokS float64 `json:"prefill_plain_launch_tok_s"`
	// PrefillHostSeconds is the host's time to queue one prefill;
	// PrefillGraphTokS the prefill's rate replayed as a CUDA graph (no host
	// launches; embedding left out).
	PrefillHostSeconds float64 `json:"prefill_host_seconds"`
	PrefillGraphTokS   float64 `json:"prefill_graph_tok_s"`
	DecodeTokS         float64 `json:"decode_tok_s"`
	DecodeGraphTok     float64 `json:"decode_graph_tok_s"`
	// DecodeGraphPlainTok is DecodeGraphTok without programmatic dependent
	// launches, measured in the same run.
	DecodeGraphPlainTok float64 `json:"decode_graph_plain_launch_tok_s"`
	// DecodeGraphNoSumsTok is DecodeGraphTok with every normed streaming
	// GEMV summing its input's squares itself (cuda.Options.NoRowSums).
	DecodeGraphNoSumsTok float64 `json:"decode_graph_no_row_sums_tok_s"`
	// DecodeGraphNoAsyncTok is DecodeGraphTok with the 4- and 8-bit GEMVs'
	// rings in registers everywhere (cuda.Options.NoAsyncGEMV).
	DecodeGraphNoAsyncTok float64 `json:"decode_graph_no_async_gemv_tok_s"`
	// DecodeGraphNoClusterTok is DecodeGraphTok with the decode attention's
	// splits merged through global memory (cuda.Options.NoClusterAttention).
	DecodeGraphNoClusterTok float64        `json:"decode_graph_no_cluster_attention_tok_s"`
	RooflineTokS            float64        `json:"roofline_tok_s"`
	Linears                 []kernelResult `json:"linears"`
}

func runBench(c *cli.Context) error {
	syn := c.String("synthetic")
	if syn == "" && c.NArg() != 1 {
		return errors.New("bench: give a MODEL or --synthetic llama2-7b")
	}
	prompt, steps := c.Int("prompt"), c.Int("decode")
	kvHalf := c.String("kv-cache") == "fp16"
	if k := c.String("kv-cache"); k != "fp16" && k != "fp32" {
		return fmt.Errorf("bench: --kv-cache %q: want fp16 or fp32", k)
	}
	if prompt <= 0 || steps <= 0 {
		return errors.New("bench: --prompt and --decode must be positive")
	}
	rows := c.IntSlice("gemm-rows")
	for _, m := range rows {
		if m <= 0 || m > 1<<16 {
			return fmt.Errorf("bench: --gemm-rows %d: want 1 to 65536 rows", m)
		}
	}
	tpN := c.Int("tp")
	if tpN > 1 && syn != "" {
		return errors.New("bench: --tp needs a MODEL: --synthetic weights are generated on one GPU and cannot be split (runtime/tp/gputest's TestTPSpeed measures a Llama-2-7B-shaped W4A16 model at TP=2)")
	}
	out := c.App.Writer
	b, err := cuda.New()
	if err != nil {
		return fmt.Errorf("bench: %w", err)
	}
	rep := &benchReport{Device: b.Name(), GEMMF16: map[string]float64{}, MeasuredUTC: time.Now().UTC().Format(time.RFC3339)}
	fmt.Fprintf(out, "device: %s\n", b.Name())
	rep.CopyGBs = b.CopyBandwidth(1<<30) / 1e9
	fmt.Fprintf(out, "device-to-device copy: %.0f GB/s (read + write)\n", rep.CopyGBs)
	if c.Bool("kernels") {
		if err := benchKernels(b, rep, rows, out); err != nil {
			b.Close()
			return err
		}
	}
	if err := b.Close(); err != nil {
		return err
	}
	if syn == "none" {
		return nil // kernels only
	}
	if syn != "" {
		cfg, ok := syntheticConfigs[syn]
		if !ok {
			return fmt.Errorf("bench: unknown --synthetic %q (llama2-7b, llama2-7b-tp2, llama3-8b, tiny)", syn)
		}
		for _, f := range strings.Split(c.String("format"), ",") {
			m := syntheticModel(cfg, strings.TrimSpace(f))
			r, err := benchModel(m, syn, strings.TrimSpace(f), prompt, steps, kvHalf, rep.CopyGBs, out)
			if err != nil {
				return err
			}
			rep.Models = append(rep.Models, r)
		}
		printSyntheticRatios(rep, out)
	} else {
		m, err := tp.OpenModel(c.Args().First())
		if err != nil {
			return fmt.Errorf("bench: %w", err)
		}
		defer m.Close()
		if tp.ShardedSize(m) == 0 {
			r, err := benchModel(m, c.Args().First(), m.Format, prompt, steps, kvHalf, rep.CopyGBs, out)
			if err != nil {
				return err
			}
			rep.Models = append(rep.Models, r)
		}
		if tpN > 1 || tp.ShardedSize(m) > 0 {
			r, err := benchTP(m, tpN, prompt, steps, out)
			if err != nil {
				return err
			}
			rep.TP = &r
			if len(rep.Models) == 1 {
				one := rep.Models[0]
				fmt.Fprintf(out, "TP=%d vs one GPU: prefill %.2fx, decode %.2fx\n", r.Ranks, r.PrefillTokS/one.PrefillTokS, r.DecodeTokS/one.DecodeTokS)
			}
		}
	}
	if p := c.String("json"); p != "" {
		data, err := json.MarshalIndent(rep, "", " ")
		if err != nil {
			return err
		}
		if err := atomicfile.WriteFile(p, data); err != nil {
			return fmt.Errorf("bench: %w", err)
		}
	}
	return nil
}

// synthetic makes a random weight tensor that the CUDA backend generates on the device.
func syntheticModel(cfg model.Config, format string) *model.Model {
	m := model.New(cfg)
	seed := uint64(1)
	// order: the act-order column order's seed, one for the weights that
	// share an input (as GPTQ's desc_act orders them)
	lin := func(name string, out, in int, order uint64) {
		m.Set(name, &cuda.Synthetic{Format: format, Dims: []int{out, in}, GroupSize: 128, Seed: seed, OrderSeed: order})
		seed += 2
	}
	vec := func(name string, n int) {
		m.Set(name, &cuda.Synthetic{Format: format, Dims: []int{n}, Seed: seed})
		seed += 2
	}
	// The embedding table and the head stay fp16 in every format (as AWQ/GPTQ checkpoints keep them).
	m.Set(model.Name(-1, model.Embed), &cuda.Synthetic{Format: "fp16", Dims: []int{cfg.Vocab, cfg.Hidden}, Seed: 99})
	m.Set(model.Name(-1, model.LMHead), &cuda.Synthetic{Format: "fp16", Dims: []int{cfg.Vocab, cfg.Hidden}, Seed: 101})
	vec(model.Name(-1, model.FinalNorm), cfg.Hidden)
	for l := 0; l < cfg.Layers; l++ {
		order := uint64(1000 + 4*l)
		lin(model.Name(l, model.Q), cfg.QDim(), cfg.Hidden, order)
		lin(model.Name(l, model.K), cfg.KVDim(), cfg.Hidden, order)
		lin(model.Name(l, model.V), cfg.KVDim(), cfg.Hidden, order)
		lin(model.Name(l, model.O), cfg.Hidden, cfg.QDim(), order+1)
		lin(model.Name(l, model.Gate), cfg.Intermediate, cfg.Hidden, order+2)
		lin(model.Name(l, model.Up), cfg.Intermediate, cfg.Hidden, order+2)
		lin(model.Name(l, model.Down), cfg.Hidden, cfg.Intermediate, order+3)
		vec(model.Name(l, model.AttnNorm), cfg.Hidden)
		vec(model.Name(l, model.MLPNorm), cfg.Hidden)
	}
	return m
}

// benchKernels times, for each of benchShapes and each format, the GEMV
// (one row) and the GEMM at each of rows activation rows, the GEMMs against
// our fp16 GEMM of the same shape and rows.
func benchKernels(b *cuda.Backend, rep *benchReport, rows []int, out io.Writer) error {
	copyBps := rep.CopyGBs * 1e9
	fmt.Fprintf(out, "\n(GEMV times are device time per call from a replayed CUDA graph of 20 calls over copies of the weight\n that exceed the L2 cache together; GEMM times the median of %d turns over a GEMM's forms, 10 calls each)\n", gemmRounds)
	fmt.Fprintf(out, "%-8s %-14s %-12s %5s %10s %12s %9s\n", "kernel", "format", "shape", "M", "time(us)", "rate", "ratio")
	seed := uint64(1000)
	var refs []sizeRef
	for _, sh := range benchShapes {
		N, K := sh[0], sh[1]
		f16Rate := map[int]float64{} // by rows
		for _, f := range []string{"fp16", "bf16", "w8a8", "w8a16", "w8a16-pc", "w4a16", "w4a16-pc", "w4a16-act"} {
			spec := cuda.Synthetic{Format: f, Dims: []int{N, K}, GroupSize: 128, Seed: seed}
			seed++
			w, kv, err := benchGEMV(b, spec, copyBps)
			if err != nil {
				return err
			}
			rep.Kernels = append(rep.Kernels, kv)
			fmt.Fprint(out, kv.gemvLine())
			if sizeRefFormats[f] {
				refs = addSizeRef(refs, sizeRefRows(kv.bytes), f+" "+kv.Shape)
			}
			for _, M := range rows {
				seed++
				kr := benchGEMM(b, w, f, N, K, M, seed)
				if f == "fp16" {
					f16Rate[M] = kr.TFLOPs
					rep.GEMMF16[fmt.Sprintf("%s@%d", kr.Shape, M)] = kr.TFLOPs
				}
				kr.RatioPct = 100 * kr.TFLOPs / f16Rate[M]
				rep.Kernels = append(rep.Kernels, kr)
				fmt.Fprint(out, kr.gemmLine())
			}
			b.FreeLinear(w)
		}
	}
	fmt.Fprintf(out, "(size references: fp16 GEMVs of %d features a row and about the bytes of each shape's w4a16 and w8a16\n weight, codes and scales — how near copy speed a one-row product with next to no arithmetic comes at that size)\n", sizeRefCols)
	for _, r := range refs {
		spec := cuda.Synthetic{Format: "fp16", Dims: []int{r.N, sizeRefCols}, Seed: seed}
		seed++
		w, kv, err := benchGEMV(b, spec, copyBps)
		if err != nil {
			return err
		}
		b.FreeLinear(w)
		kv.Kernel, kv.SizeOf = "gemv-size", strings.Join(r.of, ", ")
		rep.Kernels = append(rep.Kernels, kv)
		fmt.Fprint(out, kv.gemvLine())
	}
	return nil
}

// gemmRounds is how many times benchGEMM times each form of a GEMM, the
// forms taking turns (each round starting one form further on), each
// figure their median: on an H200 one form timed right after another read
// up to 10 % apart where each was timed once (fifty-second session).
const gemmRounds = 3

// benchGEMM times w's product with M random activation rows on the
// kernel the dispatcher picks and, where the device has them, on the
// mma.sync GEMMs instead of the Hopper ones and on the Hopper GEMM's two
// block forms (Options.WGWide), the forms in turn gemmRounds times; the
// caller sets RatioPct.
func benchGEMM(b *cuda.Backend, w runtime.Linear, format string, N, K, M int, seed uint64) kernelResult {
	xm, ym := b.Alloc(M, K), b.Alloc(M, N)
	defer b.Free(xm)
	defer b.Free(ym)
	b.FillRandom(xm, seed, 1)
	defer withOptions(b, nil)() // the forms below change NoWGMMA and WGWide
	opt := b.Options()
	type form struct {
		noWGMMA bool
		wide    int
		times   []float64
	}
	forms := []*form{{noWGMMA: opt.NoWGMMA}} // the dispatcher's pick
	if b.HasWGMMA() && !opt.NoWGMMA {
		forms = append(forms, &form{noWGMMA: true})
	}
	if b.HasWideGEMM(w, M) {
		forms = append(forms, &form{wide: 1}, &form{wide: -1})
	}
	for round := range gemmRounds {
		// each round starts one form further on: no form always first
		// (the dispatcher's int8 figure read 10 % above the same launch
		// timed after it in its round, fifty-third session)
		for i := range forms {
			f := forms[(round+i)%len(forms)]
			opt.NoWGMMA, opt.WGWide = f.noWGMMA, f.wide
			f.times = append(f.times, b.Time(2, 10, func() { b.MatMul(ym, xm, w) }))
		}
	}
	median := func(f *form) float64 {
		slices.Sort(f.times)
		return f.times[len(f.times)/2]
	}
	t := median(forms[0])
	flops := 2 * float64(M) * float64(N) * float64(K)
	kr := kernelResult{Kernel: "gemm", Format: format, Shape: fmt.Sprintf("%dx%d", N, K), M: M, Seconds: t, TFLOPs: flops / t / 1e12}
	for _, f := range forms[1:] {
		switch {
		case f.noWGMMA:
			kr.MMASyncTFLOPs = flops / median(f) / 1e12
		case f.wide > 0:
			kr.WideSeconds = median(f)
		default:
			kr.NarrowSeconds = median(f)
		}
	}
	return kr
}

// benchGEMV uploads the synthetic weight spec describes and times its
// one-row product on the kernel the dispatcher picks, as a decode step runs
// it (no copy still in L2); the caller frees the weight.
func benchGEMV(b *cuda.Backend, spec cuda.Synthetic, copyBps float64) (runtime.Linear, kernelResult, error) {
	w, err := b.UploadLinear("bench", &spec)
	if err != nil {
		return nil, kernelResult{}, err
	}
	tv, bytes, err := b.TimeDecodeGEMV(w, spec)
	if err != nil {
		b.FreeLinear(w)
		return nil, kernelResult{}, err
	}
	N, K := spec.Dims[0], spec.Dims[1]
	return w, kernelResult{Kernel: "gemv", Format: spec.Format + "/" + b.GEMVKernel(w, 1), Shape: fmt.Sprintf("%dx%d", N, K),
		M: 1, Seconds: tv, GBs: bytes / tv / 1e9, RatioPct: 100 * bytes / tv / copyBps, bytes: bytes}, nil
}

// gemvLine is k's row of bench's kernel table.
func (k kernelResult) gemvLine() string {
	of := ""
	if k.SizeOf != "" {
		of = " (the bytes of " + k.SizeOf + ")"
	}
	return fmt.Sprintf("%-8s %-24s %-12s %5d %10.2f %8.0f GB/s %7.1f%% of copy%s\n", k.Kernel, k.Format, k.Shape, k.M, k.Seconds*1e6, k.GBs, k.RatioPct, of)
}

// gemmLine is k's line of the kernel table: time, rate, the ratio to our
// fp16 GEMM and the other kernels' times benchGEMM took.
func (k kernelResult) gemmLine() string {
	more := ""
	if k.MMASyncTFLOPs > 0 {
		more = fmt.Sprintf(" (mma.sync %.1f)", k.MMASyncTFLOPs)
	}
	if k.WideSeconds > 0 {
		more += fmt.Sprintf(" (256-row tiles %.1f us, 128-row %.1f us)", k.WideSeconds*1e6, k.NarrowSeconds*1e6)
	}
	return fmt.Sprintf("%-8s %-14s %-12s %5d %10.1f %7.1f TFLOP/s %6.1f%% of our fp16 GEMM%s\n", "gemm", k.Format, k.Shape, k.M, k.Seconds*1e6, k.TFLOPs, k.RatioPct, more)
}

func benchModel(m *model.Model, name, format string, prompt, steps int, kvHalf bool, copyGBs float64, out io.Writer) (modelResult, error) {
	res := modelResult{Name: name, Format: format}
	b, err := cuda.New()
	if err != nil {
		return res, err
	}
	defer b.Close()
	b.Options().KVHalf = kvHalf
	free0, _ := b.MemInfo()
	rm, err := runtime.Load(m, b)
	if err != nil {
		return res, fmt.Errorf("bench: %w", err)
	}
	cfg := rm.Config()
	maxSeq := prompt + steps + 8
	cache := rm.NewCache(maxSeq)
	b.Sync()
	free1, _ := b.MemInfo()
	res.GPUMemBytes = free0 - free1
	ids := make([]int, prompt)
	for i := range ids {
		ids[i] = (i*7919 + 13) % cfg.Vocab
	}

	// Prefill: the median of prefillRuns timed runs after a warm-up (one
	// slow run moves a mean of three by 10-20 %, as seen on the H100), the
	// runs' spread, and the same without dependent launches.
	prefill := func() {
		lg := rm.Forward(ids, 0, cache)
		b.Free(lg)
	}
	runs := prefillSeconds(b, prefill, nil)
	res.PrefillTokS = float64(prompt) / runs[len(runs)/2]
	res.PrefillMinTokS, res.PrefillMaxTokS = float64(prompt)/runs[len(runs)-1], float64(prompt)/runs[0]
	plain := prefillSeconds(b, prefill, func(o *cuda.Options) { o.NoDependentLaunch = true })
	res.PrefillPlainTokS = float64(prompt) / plain[len(plain)/2]
	res.PrefillHostSeconds = prefillHostSeconds(b, prefill)
	if res.PrefillGraphTokS, err = prefillGraphTokS(b, rm, ids, cache); err != nil {
		return res, err
	}

	// Decode, one token at a time with a host round trip (Argmax) per token.
	lg := rm.Forward(ids, 0, cache)
	next := b.Argmax(lg)[prompt-1]
	b.Free(lg)
	t0 := time.Now()
	for i := 0; i < steps; i++ {
		lg = rm.Forward([]int{next}, prompt+i, cache)
		next = b.Argmax(lg)[0]
		b.Free(lg)
	}
	res.DecodeTokS = float64(steps) / time.Since(t0).Seconds()

	// Decode replayed as a CUDA graph.
	if res.DecodeGraphTok, err = decodeGraphTokS(b, rm, cache, prompt, maxSeq, next, steps, nil); err != nil {
		return res, err
	}
	// The same without programmatic dependent launches, and without the
	// producers' row sums, side by side.
	if res.DecodeGraphPlainTok, err = decodeGraphTokS(b, rm, cache, prompt, maxSeq, next, steps,
		func(o *cuda.Options) { o.NoDependentLaunch = true }); err != nil {
		return res, err
	}
	if res.DecodeGraphNoSumsTok, err = decodeGraphTokS(b, rm, cache, prompt, maxSeq, next, steps,
		func(o *cuda.Options) { o.NoRowSums = true }); err != nil {
		return res, err
	}
	if res.DecodeGraphNoAsyncTok, err = decodeGraphTokS(b, rm, cache, prompt, maxSeq, next, steps,
		func(o *cuda.Options) { o.NoAsyncGEMV = true }); err != nil {
		return res, err
	}
	if res.DecodeGraphNoClusterTok, err = decodeGraphTokS(b, rm, cache, prompt, maxSeq, next, steps,
		func(o *cuda.Options) { o.NoClusterAttention = true }); err != nil {
		return res, err
	}

	// Per-linear rates at M = 1 and M = prompt (layer 0 and the head), and
	// the decode roofline: every weight read once per token (the embedding
	// table only when it is also the head) plus the KV cache at the mean context.
	var weightBytes int64
	for n, by := range b.UploadedDecodeBytes() {
		if n != model.Name(-1, model.Embed) || headIsEmbed(m) {
			weightBytes += by
		}
	}
	for _, r := range model.Linears {
		t, err := m.Get(model.Name(0, r))
		if err != nil {
			return res, err
		}
		wl, err := b.UploadLinear("probe", t)
		if err != nil {
			return res, err
		}
		layers := make([]runtime.Linear, cfg.Layers)
		for l := range layers {
			layers[l] = rm.Linear(l, r)
		}
		res.Linears = append(res.Linears, benchLinear(b, string(r), wl.(*cuda.Linear), layers, prompt, copyGBs)...)
		b.FreeLinear(wl)
	}
	head, err := b.UploadLinear("probe", headOf(m))
	if err != nil {
		return res, err
	}
	res.Linears = append(res.Linears, benchLinear(b, "lm_head", head.(*cuda.Linear), nil, prompt, copyGBs)...)
	b.FreeLinear(head)
	res.WeightBytes = weightBytes
	streaming := cuda.StreamingGEMV(b.GEMVKernel(rm.Linear(0, model.Q), 1))
	other, err := stepBreakdown(b, m, cfg, 1, prompt+steps/2, streaming, out)
	if err != nil {
		return res, err
	}
	layerMM, err := decodeProducts(b, rm, m, cfg, out)
	if err != nil {
		return res, err
	}
	mm := layerMM*float64(cfg.Layers) + matmulSeconds(res.Linears, 1, 0) // + the head
	est := mm + other*float64(cfg.Layers)
	fmt.Fprintf(out, "  decode step estimate from kernel times: matmuls %.0f us + other %.0f us = %.0f us (%.0f tok/s); graph measured %.0f us\n",
		mm*1e6, other*float64(cfg.Layers)*1e6, est*1e6, 1/est, 1e6/res.DecodeGraphTok)
	otherPre, err := stepBreakdown(b, m, cfg, prompt, 0, streaming, out)
	if err != nil {
		return res, err
	}
	mm = matmulSeconds(res.Linears, prompt, cfg.Layers)
	est = mm + otherPre*float64(cfg.Layers)
	fmt.Fprintf(out, "  prefill estimate from kernel times: matmuls %.2f ms + other %.2f ms = %.2f ms (%.0f tok/s); measured %.2f ms\n",
		mm*1e3, otherPre*float64(cfg.Layers)*1e3, est*1e3, float64(prompt)/est, 1e3*float64(prompt)/res.PrefillTokS)
	ctx := float64(prompt) + float64(steps)/2
	elem := 4.0
	if kvHalf {
		elem = 2
	}
	kvBytes := 2 * float64(cfg.Layers) * ctx * float64(cfg.KVDim()) * elem
	res.RooflineTokS = copyGBs * 1e9 / (float64(weightBytes) + kvBytes)

	fmt.Fprintf(out, "\nmodel %s (%s): weights %.2f GB read a token, GPU memory used %.2f GB (incl. KV cache of %d positions)\n",
		name, format, float64(weightBytes)/1e9, float64(res.GPUMemBytes)/1e9, maxSeq)
	fmt.Fprintf(out, "  prefill %d tokens: %.0f tok/s (runs %.0f-%.0f; %.0f without dependent launches; %.0f as a CUDA graph; queued by the host in %.2f ms)\n",
		prompt, res.PrefillTokS, res.PrefillMinTokS, res.PrefillMaxTokS, res.PrefillPlainTokS, res.PrefillGraphTokS, 1e3*res.PrefillHostSeconds)
	fmt.Fprintf(out, "  decode batch 1: %.1f tok/s plain, %.1f tok/s CUDA graph (%.1f without dependent launches, %.1f without row sums, %.1f with the GEMV rings in registers, %.1f with the attention's splits merged through global memory); roofline %.1f tok/s (%.0f%% reached)\n",
		res.DecodeTokS, res.DecodeGraphTok, res.DecodeGraphPlainTok, res.DecodeGraphNoSumsTok, res.DecodeGraphNoAsyncTok, res.DecodeGraphNoClusterTok,
		res.RooflineTokS, 100*res.DecodeGraphTok/res.RooflineTokS)
	for _, k := range res.Linears {
		if k.M == 1 {
			fmt.Fprintf(out, "  %-8s %-12s M=1   %8.1f us %7.0f GB/s (%.0f%% of copy)\n", k.Kernel, k.Shape, k.Seconds*1e6, k.GBs, k.RatioPct)
		} else {
			fmt.Fprintf(out, "  %-8s %-12s M=%-3d %8.1f us %7.1f TFLOP/s\n", k.Kernel, k.Shape, k.M, k.Seconds*1e6, k.TFLOPs)
		}
	}
	return res, nil
}

// withOptions changes b's options by change (nil: none) and returns what
// puts them back as they were.
func withOptions(b *cuda.Backend, change func(*cuda.Options)) (restore func()) {
	opt := b.Options()
	was := *opt
	if change != nil {
		change(opt)
	}
	return func() { *opt = was }
}

// prefillSeconds times prefillRuns runs of prefill after a warm-up, with
// b's options changed by change (nil: as they are) for the runs, and
// returns their times, sorted.
func prefillSeconds(b *cuda.Backend, prefill func(), change func(*cuda.Options)) []float64 {
	defer withOptions(b, change)()
	prefill()
	runs := make([]float64, prefillRuns)
	for i := range runs {
		runs[i] = b.Time(0, 1, prefill)
	}
	slices.Sort(runs)
	return runs
}

// prefillHostSeconds is the median wall time of queuing prefill on an idle
// stream, without waiting for it: where it approaches the device time, the
// host's launches, not the kernels, set the prefill's speed.
func prefillHostSeconds(b *cuda.Backend, prefill func()) float64 {
	runs := make([]float64, prefillRuns)
	for i := range runs {
		b.Sync()
		t0 := time.Now()
		prefill()
		runs[i] = time.Since(t0).Seconds()
	}
	b.Sync()
	slices.Sort(runs)
	return runs[len(runs)/2]
}

// prefillGraphTokS times the prefill of ids (its layers and classifier on
// the embedded rows, copied in first) captured as one CUDA graph: the
// prefill without the host's launch costs.
func prefillGraphTokS(b *cuda.Backend, rm *runtime.Model, ids []int, cache runtime.KVCache) (float64, error) {
	cfg := rm.Config()
	x0 := rm.Embed(ids)
	defer b.Free(x0)
	x := runtime.AllocRaw(b, len(ids), cfg.Hidden)
	defer b.Free(x)
	sec, err := b.TimeCaptured(1, func() {
		runtime.CopyRows(b, x, 0, x0, 0, len(ids))
		rm.Layers(x, 0, cache)
		b.Free(rm.Logits(x))
	})
	if err != nil {
		return 0, fmt.Errorf("bench: prefill graph: %w", err)
	}
	return float64(len(ids)) / sec, nil
}

// decodeGraphTokS captures one greedy decode step at position prompt and
// replays it steps times from token next: tokens per second. change, when
// set, alters the backend's options for this capture only.
func decodeGraphTokS(b *cuda.Backend, rm *runtime.Model, cache runtime.KVCache, prompt, maxSeq, next, steps int, change func(*cuda.Options)) (float64, error) {
	defer withOptions(b, change)()
	if err := b.BeginCapture(prompt, maxSeq); err != nil {
		return 0, err
	}
	lg := rm.Forward([]int{0}, prompt, cache)
	b.GreedyAdvance(lg)
	b.Free(lg)
	g, err := b.EndCapture()
	if err != nil {
		return 0, err
	}
	defer g.Destroy()
	b.SetDecodeState(next, prompt)
	tg := b.Time(0, 1, func() {
		for i := 0; i < steps; i++ {
			g.Launch()
		}
	})
	return float64(steps) / tg, nil
}

func headIsEmbed(m *model.Model) bool {
	_, ok := m.Lookup(model.Name(-1, model.LMHead))
	return !ok
}

func headOf(m *model.Model) model.Tensor {
	if t, ok := m.Lookup(model.Name(-1, model.LMHead)); ok {
		return t
	}
	t, _ := m.Lookup(model.Name(-1, model.Embed))
	return t
}

// benchLinear times w at M = 1 (cycling through layers, the same linear of
// every layer, when given: none is then in L2, as in a decode step) and at
// M rows.
func benchLinear(b *cuda.Backend, role string, w *cuda.Linear, layers []runtime.Linear, M int, copyGBs float64) []kernelResult {
	N, K := w.Out(), w.In()
	x1, y1 := b.Alloc(1, K), b.Alloc(1, N)
	b.FillRandom(x1, 5, 1)
	if len(layers) == 0 {
		layers = []runtime.Linear{w}
	}
	i := 0
	t, err := b.TimeCaptured(20, func() { b.MatMul(y1, x1, layers[i%len(layers)]); i++ })
	if err != nil {
		panic(err)
	}
	bytes := float64(w.DecodeBytes() + int64(4*K+4*N))
	r1 := kernelResult{Kernel: role, Format: w.Kind(), Shape: fmt.Sprintf("%dx%d", N, K), M: 1, Seconds: t, GBs: bytes / t / 1e9, RatioPct: 100 * bytes / t / 1e9 / copyGBs}
	b.Free(x1)
	b.Free(y1)
	xm, ym := b.Alloc(M, K), b.Alloc(M, N)
	b.FillRandom(xm, 6, 1)
	t = b.Time(2, 10, func() { b.MatMul(ym, xm, w) })
	r2 := kernelResult{Kernel: role, Format: w.Kind(), Shape: r1.Shape, M: M, Seconds: t, TFLOPs: 2 * float64(M) * float64(N) * float64(K) / t / 1e12}
	b.Free(xm)
	b.Free(ym)
	return []kernelResult{r1, r2}
}

// matmulSeconds is the time of a forward pass's matrix products at M rows
// from the per-linear measurements of layer 0 (each counted for every
// layer) and the head (counted once).
func matmulSeconds(linears []kernelResult, M, layers int) float64 {
	var t float64
	for _, k := range linears {
		switch {
		case k.M != M:
		case k.Kernel == "lm_head":
			t += k.Seconds
		default:
			t += k.Seconds * float64(layers)
		}
	}
	return t
}

// decodeProducts times a decode step's matrix products as the forward pass
// runs them (runtime.Fused where the backend fuses: q/k/v with the
// attention norm, o and down with the residual add, gate/up with the MLP
// norm and the SwiGLU), each call on the next layer's weights so that none
// comes from L2, device time from replayed graphs, beside the q/k/v launch
// without its norm; it returns their sum for one layer.
func decodeProducts(b *cuda.Backend, rm *runtime.Model, m *model.Model, cfg model.Config, out io.Writer) (float64, error) {
	var norms [2]runtime.Vector
	for i, r := range []model.Role{model.AttnNorm, model.MLPNorm} {
		t, err := m.Get(model.Name(0, r))
		if err != nil {
			return 0, err
		}
		if norms[i], err = b.UploadVector("probe_norm", t); err != nil {
			return 0, err
		}
		defer b.FreeVector(norms[i])
	}
	layer := 0 // each call takes the next layer's weights, as a decode step does
	w := func(r model.Role) runtime.Linear { return rm.Linear(layer, r) }
	x, q, k, v := b.Alloc(1, cfg.Hidden), b.Alloc(1, cfg.QDim()), b.Alloc(1, cfg.KVDim()), b.Alloc(1, cfg.KVDim())
	att, g := b.Alloc(1, cfg.QDim()), b.Alloc(1, cfg.Intermediate)
	defer func() {
		for _, t := range []runtime.Buf{x, q, k, v, att, g} {
			b.Free(t)
		}
	}()
	for i, t := range []runtime.Buf{x, att, g} {
		b.FillRandom(t, uint64(60+i), 1)
	}
	eps := float32(cfg.NormEps)
	qkv := []runtime.Buf{q, k, v}
	wqkv := func() []runtime.Linear { return []runtime.Linear{w(model.Q), w(model.K), w(model.V)} }
	ops := []struct {
		name  string
		inSum bool
		f     func()
	}{
		{"q,k,v + norm", true, func() { b.NormMatMulN(qkv, x, norms[0], nil, eps, wqkv()) }},
		{"q,k,v alone", false, func() { b.MatMulN(qkv, x, wqkv()) }},
		{"o + add", true, func() { b.MatMulAdd(x, att, w(model.O)) }},
		{"gate,up + norm, swiglu", true, func() { b.NormSwiGLU(g, x, norms[1], nil, eps, w(model.Gate), w(model.Up)) }},
		{"down + add", true, func() { b.MatMulAdd(x, g, w(model.Down)) }},
	}
	fmt.Fprintf(out, "  decode step, matrix products per layer as the forward pass runs them (device time):\n")
	var total float64
	for _, op := range ops {
		t, err := b.TimeCaptured(20, func() {
			op.f()
			layer = (layer + 1) % cfg.Layers
		})
		if err != nil {
			return 0, err
		}
		if op.inSum {
			total += t
		}
		fmt.Fprintf(out, "    %-24s %9.2f us\n", op.name, t*1e6)
	}
	return total, nil
}

// stepBreakdown times the non-matmul operations (fused as the forward pass
// runs them on this backend) of one layer's forward step over T rows at positions pos0… (T = 1: a decode step at context
// pos0; pos0 = 0: a prefill of T tokens), device time from replayed graphs,
// and returns their sum for one layer.
func stepBreakdown(b *cuda.Backend, m *model.Model, cfg model.Config, T, pos0 int, streaming bool, out io.Writer) (float64, error) {
	h, q, k, v := b.Alloc(T, cfg.Hidden), b.Alloc(T, cfg.QDim()), b.Alloc(T, cfg.KVDim()), b.Alloc(T, cfg.KVDim())
	g, u, att := b.Alloc(T, cfg.Intermediate), b.Alloc(T, cfg.Intermediate), b.Alloc(T, cfg.QDim())
	for i, x := range []runtime.Buf{h, q, k, v, g, u} {
		b.FillRandom(x, uint64(40+i), 1)
	}
	nt, _ := m.Get(model.Name(0, model.AttnNorm))
	nw, err := b.UploadVector("probe_norm", nt)
	if err != nil {
		return 0, err
	}
	cache := b.NewKVCache(1, pos0+T+8, cfg.KVDim())
	eps := float32(cfg.NormEps)
	type op struct {
		name  string
		times int
		f     func()
	}
	// With a streaming GEMV a decode step's norms, SwiGLU and
	// residual adds run inside the matrix products (runtime.Fused); the
	// other GEMVs fuse the adds, the GEMMs (prefill) the adds and the
	// SwiGLU.
	var ops []op
	if T == 1 { // a decode row: RoPE and the KV store inside the attention where the backend can
		ops = []op{{"rope+attn", 1, func() {
			b.RoPEAttention(att, q, k, v, cache, 0, pos0, cfg.Heads, cfg.KVHeads, cfg.HeadDim, cfg.RopeTheta, cfg.Rope)
		}}}
	} else {
		ops = []op{{"rope+store", 1, func() { b.RoPEStoreKV(cache, 0, pos0, q, k, v, cfg.HeadDim, cfg.RopeTheta, cfg.Rope) }},
			{"attention", 1, func() { b.Attention(att, q, cache, 0, pos0, cfg.Heads, cfg.KVHeads, cfg.HeadDim) }}}
		// beside it, not in the sum: every query tile in one block
		// (cuda.Options.AttnSplit < 0), as before the key splits
		ops = append(ops, op{"attn 1 blk", 0, func() {
			o := b.Options()
			split := o.AttnSplit
			o.AttnSplit = -1
			b.Attention(att, q, cache, 0, pos0, cfg.Heads, cfg.KVHeads, cfg.HeadDim)
			o.AttnSplit = split
		}})
	}
	if T > 1 || !streaming {
		ops = append(ops, op{"rmsnorm", 2, func() { b.RMSNorm(h, h, nw, nil, eps) }})
	}
	if gemm := T > b.Options().GEMVMaxRows; !gemm && !(T == 1 && streaming) {
		ops = append(ops, op{"silu_mul", 1, func() { b.SiLUMul(g, g, u) }})
	}
	var total float64
	if T == 1 {
		fmt.Fprintf(out, "  decode step, other kernels per layer at context %d (device time):\n", pos0)
	} else {
		fmt.Fprintf(out, "  prefill of %d tokens, other kernels per layer (device time):\n", T)
	}
	for _, op := range ops {
		t, err := b.TimeCaptured(20, op.f)
		if err != nil {
			return 0, err
		}
		total += t * float64(op.times)
		fmt.Fprintf(out, "    %-10s x%d %9.2f us\n", op.name, op.times, t*1e6)
	}
	b.FreeKVCache(cache)
	for _, x := range []runtime.Buf{h, q, k, v, g, u, att} {
		b.Free(x)
	}
	return total, nil
}

// printSyntheticRatios prints, where the run benched fp16, every other
// format's decode and prefill as ratios to fp16's of the same run, in the
// order benched (W8A8's prefill against fp16 is one of issue 12's
// criteria; kernels/ktable.py reads these lines).
func printSyntheticRatios(rep *benchReport, out io.Writer) {
	i := slices.IndexFunc(rep.Models, func(r modelResult) bool { return r.Format == "fp16" })
	if i < 0 {
		return
	}
	f16 := rep.Models[i]
	fmt.Fprintf(out, "\nsame-run ratios against fp16:\n")
	for _, r := range rep.Models {
		if r.Format == "fp16" {
			continue
		}
		fmt.Fprintf(out, "  %s: decode %.2fx fp16 (graph %.1f vs %.1f tok/s), %.0f%% of roofline; prefill %.0f%% of fp16 (%.0f vs %.0f tok/s)\n",
			r.Format, r.DecodeGraphTok/f16.DecodeGraphTok, r.DecodeGraphTok, f16.DecodeGraphTok, 100*r.DecodeGraphTok/r.RooflineTokS,
			100*r.PrefillTokS/f16.PrefillTokS, r.PrefillTokS, f16.PrefillTokS)
	}
}

type tpResult struct {
	Ranks       int     `json:"ranks"`
	Backend     string  `json:"backend"`
	PrefillTokS float64 `json:"prefill_tok_s"`
	DecodeTokS  float64 `json:"decode_tok_s"`
	// Collective time per forward pass (2·layers+1 all-reduces of the
	// hidden state and one all-gather of the logits), measured separately.
	CollectivesPrefillMs float64 `json:"collectives_per_prefill_ms"`
	CollectivesDecodeUs  float64 `json:"collectives_per_decode_step_us"`
}

// benchTP runs m tensor-parallel over n GPUs (a shard directory's own n when
// n <= 1): prefill of prompt tokens, steps decode steps (plain, with an
// argmax round trip per token), and the collectives timed on their own.
func benchTP(m *model.Model, n, prompt, steps int, out io.Writer) (tpResult, error) {
	be, err := tp.NewGPU(m, n, cuda.NewRank)
	if err != nil {
		return tpResult{}, fmt.Errorf("bench: %w", err)
	}
	defer be.Close()
	rm, err := runtime.Load(m, be)
	if err != nil {
		return tpResult{}, fmt.Errorf("bench: %w", err)
	}
	cfg := rm.Config()
	res := tpResult{Ranks: be.Ranks(), Backend: be.Name()}
	ids := make([]int, prompt)
	for i := range ids {
		ids[i] = (i*7919 + 13) % cfg.Vocab
	}
	run := func() (next int, pre, dec time.Duration) {
		cache := rm.NewCache(prompt + steps + 8)
		t0 := time.Now()
		lg := rm.Forward(ids, 0, cache)
		next = be.Argmax(lg)[prompt-1]
		be.Free(lg)
		pre = time.Since(t0)
		t1 := time.Now()
		for i := 0; i < steps; i++ {
			lg = rm.Forward([]int{next}, prompt+i, cache)
			next = be.Argmax(lg)[0]
			be.Free(lg)
		}
		return next, pre, time.Since(t1)
	}
	run() // warm-up: module loads, NCCL, allocator pools
	_, pre, dec := run()
	res.PrefillTokS = float64(prompt) / pre.Seconds()
	res.DecodeTokS = float64(steps) / dec.Seconds()
	reduces := time.Duration(2*cfg.Layers + 1)
	res.CollectivesPrefillMs = (reduces*be.TimeAllReduce(prompt, cfg.Hidden, 20) + be.TimeAllGather(prompt, cfg.Vocab, 5)).Seconds() * 1e3
	res.CollectivesDecodeUs = (reduces*be.TimeAllReduce(1, cfg.Hidden, 200) + be.TimeAllGather(1, cfg.Vocab, 200)).Seconds() * 1e6
	fmt.Fprintf(out, "TP=%d (%s): prefill %.0f tok/s, decode %.1f tok/s; collectives %.2f ms per prefill (%.0f%%), %.0f µs per decode step (%.0f%%)\n",
		res.Ranks, res.Backend, res.PrefillTokS, res.DecodeTokS,
		res.CollectivesPrefillMs, 100*res.CollectivesPrefillMs/1e3/pre.Seconds(),
		res.CollectivesDecodeUs, 100*res.CollectivesDecodeUs/1e6/(dec.Seconds()/float64(steps)))
	return res, nil
}
