package main

import (
	"bytes"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/schollz/progressbar/v3"
	"github.com/urfave/cli/v2"

	"qtool/formats/infile"
	"qtool/formats/model"
	"qtool/runtime"
	"qtool/runtime/cuda"
	"qtool/runtime/tp"
)

// outputs returns the command's stdout and stderr (the App's writers, else
// the process's) and a printf to stdout that is silent under --json.
func outputs(c *cli.Context) (stdout, stderr io.Writer, logf func(format string, a ...any)) {
	stdout, stderr = c.App.Writer, c.App.ErrWriter
	if stdout == nil {
		stdout = os.Stdout
	}
	if stderr == nil {
		stderr = os.Stderr
	}
	quiet := c.Bool("json")
	return stdout, stderr, func(format string, a ...any) {
		if !quiet {
			fmt.Fprintf(stdout, format, a...)
		}
	}
}

// chunkBar is the progress bar over total chunks, drawn only on a terminal
// and without --quiet (nil otherwise; its methods accept nil).
func chunkBar(c *cli.Context, stderr io.Writer, total int, desc string) *progressbar.ProgressBar {
	if c.Bool("quiet") || !isTerminal(stderr) {
		return nil
	}
	return progressbar.NewOptions(total, progressbar.OptionSetWriter(stderr),
		progressbar.OptionSetDescription(desc), progressbar.OptionShowCount(), progressbar.OptionSetWidth(30),
		progressbar.OptionThrottle(200*time.Millisecond), progressbar.OptionClearOnFinish())
}

// readPPLText resolves and reads the --ppl argument (see resolvePPLFile),
// refusing an empty text.
func readPPLText(arg string) (path string, text []byte, err error) {
	if path, err = resolvePPLFile(arg); err != nil {
		return "", nil, err
	}
	if text, err = infile.ReadFile(path, infile.TextLimit); err != nil {
		return "", nil, fmt.Errorf("verify: --ppl: %w", err)
	}
	if len(bytes.TrimSpace(text)) == 0 {
		return "", nil, fmt.Errorf("verify: --ppl %s is empty", path)
	}
	return path, text, nil
}

// loadOn makes the backend for --device/--threads/--tp and uploads mm to
// it; close the backend when done.
func loadOn(c *cli.Context, mm *model.Model) (*runtime.Model, runtime.Backend, error) {
	job, isRank, err := rankJob(c)
	if err != nil {
		return nil, nil, err
	}
	var be runtime.Backend
	if isRank {
		be, err = newRankBackend(job, c.String("device"), c.Int("threads"), mm)
	} else {
		be, err = newBackend(c.String("device"), c.Int("threads"), c.Int("tp"), mm)
	}
	if err != nil {
		return nil, nil, err
	}
	switch kv := c.String("kv-cache"); kv {
	case "fp32", "fp16":
		mm.DropKVCacheInt8() // run the C8 model with a float cache
	case "int8":
		if !mm.HasKVCacheInt8() {
			be.Close()
			return nil, nil, fmt.Errorf("verify: --kv-cache int8: %s has no int8 KV-cache scales (quantize with --kv-cache int8 into msmodelslim)", mm.Source)
		}
	}
	if err := setKVCache(be, c.String("kv-cache")); err != nil {
		be.Close()
		return nil, nil, err
	}
	m, err := runtime.Load(mm, be)
	if err != nil {
		be.Close()
		return nil, nil, fmt.Errorf("verify: %s: %w", mm.Source, err)
	}
	return m, be, nil
}

// startTimer returns the time a timed section starts: with ranks in
// several processes, once every rank has reached it (tp.Backend.Barrier),
// so that the section's time includes no other rank's loading or
// tokenizing.
func startTimer(be runtime.Backend) (time.Time, error) {
	if tb, ok := be.(*tp.Backend); ok {
		if err := tb.Barrier(); err != nil {
			return time.Time{}, err
		}
	}
	return time.Now(), nil
}

// kernelCounts returns the kernel launches of be's CUDA device (a
// tensor-parallel backend's first local rank) and, where
// $QTOOL_CUDA_KERNEL_TIMES=1 recorded them, their device seconds, by
// kernel; nil for other backends.
func kernelCounts(be runtime.Backend) (map[string]int, map[string]float64) {
	if cb := firstCUDA(be); cb != nil {
		return cb.KernelLaunches(), cb.KernelTimes()
	}
	return nil, nil
}

// firstCUDA is be's CUDA device, or a tensor-parallel backend's first local
// rank's; nil for other backends.
func firstCUDA(be runtime.Backend) *cuda.Backend {
	if t, ok := be.(*tp.Backend); ok {
		be = t.Rank(t.Local()[0])
	}
	cb, _ := be.(*cuda.Backend)
	return cb
}

// sinceBefore is what grew from before to now, by kernel (nil where
// nothing did).
func sinceBefore[V int | float64](now, before map[string]V) map[string]V {
	var d map[string]V
	for k, n := range now {
		if n > before[k] {
			if d == nil {
				d = map[string]V{}
			}
			d[k] = n - before[k]
		}
	}
	return d
}

// setKVCache applies --kv-cache to be: int8 (the model's C8 quantizers
// decide) and fp32 keep the backends' fp32 default, fp16 asks the CUDA
// backend (or every CUDA rank) for fp16 caches, and auto is fp16 on CUDA
// (half the cache memory and the decode attention's reads; perplexity moves
// by ~1e-6 relative) and fp32 on the CPU.
func setKVCache(be runtime.Backend, kind string) error {
	auto := kind == "" || kind == "auto"
	switch {
	case auto, kind == "fp16":
	case kind == "int8", kind == "fp32":
		return nil
	default:
		return fmt.Errorf("verify: --kv-cache %q: want auto, fp32, fp16 or int8", kind)
	}
	ranks := []runtime.Backend{be}
	if t, ok := be.(*tp.Backend); ok {
		ranks = ranks[:0]
		for _, r := range t.Local() {
			ranks = append(ranks, t.Rank(r))
		}
	}
	for _, r := range ranks {
		cb, ok := r.(*cuda.Backend)
		if !ok {
			if auto {
				return nil
			}
			return fmt.Errorf("verify: --kv-cache fp16 needs the CUDA backend; %s keeps an fp32 cache", r.Name())
		}
		cb.Options().KVHalf = true
	}
	return nil
}
