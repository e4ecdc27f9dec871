package main

import (
	"context"
	"encoding/json"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"
)

var (
	buildOnce sync.Once
	builtBin  string
	buildErr  error
)

// qtoolBinary builds the qtool binary once per test run, into a directory
// under os.TempDir (left for the OS to clean).
func qtoolBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "qtool-bin-")
		if err != nil {
			buildErr = err
			return
		}
		builtBin = filepath.Join(dir, "qtool")
		if out, err := exec.Command("go", "build", "-o", builtBin, ".").CombinedOutput(); err != nil {
			buildErr = errors.New(string(out))
		}
	})
	if buildErr != nil {
		t.Fatalf("go build: %v", buildErr)
	}
	return builtBin
}

// runLimited runs the qtool binary under `ulimit -OPT N` (-v: a hard
// address-space cap, -f: a file-size cap, both in kilobytes) with a time
// limit, and returns its combined output and exit status.
func runLimited(t *testing.T, opt string, n int, timeout time.Duration, args ...string) (string, int) {
	t.Helper()
	bin := qtoolBinary(t)
	ctx, cancel := context.WithTimeout(context.Background(), timeout)
	defer cancel()
	script := `ulimit "$1" "$2"; shift 2; exec "$@"`
	cmd := exec.CommandContext(ctx, "sh", append([]string{"-c", script, "sh", opt, strconv.Itoa(n), bin}, args...)...)
	out, err := cmd.CombinedOutput()
	if ctx.Err() != nil {
		t.Fatalf("qtool %s did not finish in %s (hung?)\n%s", strings.Join(args, " "), timeout, out)
	}
	code := 0
	var ee *exec.ExitError
	if errors.As(err, &ee) {
		code = ee.ExitCode()
	} else if err != nil {
		t.Fatal(err)
	}
	return string(out), code
}

// withConfig copies llama-mini to a temporary directory with config.json
// keys changed.
func withConfig(t *testing.T, change map[string]any) string {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "llama-mini")
	if err := os.CopyFS(dir, os.DirFS(llamaMini)); err != nil {
		t.Fatal(err)
	}
	p := filepath.Join(dir, "config.json")
	data, _ := os.ReadFile(p)
	var cfg map[string]any
	if err := json.Unmarshal(data, &cfg); err != nil {
		t.Fatal(err)
	}
	for k, v := range change {
		if v == nil {
			delete(cfg, k)
		} else {
			cfg[k] = v
		}
	}
	data, _ = json.Marshal(cfg)
	if err := os.WriteFile(p, data, 0o644); err != nil {
		t.Fatal(err)
	}
	return dir
}

// TestBoundedResources runs the hostile inputs of issue 11 item 6 against
// the binary under a 3 GiB address-space cap: each must end in a clear
// error (or a clamped run), never a panic, an out-of-memory death or a hang.
func TestBoundedResources(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	dir := t.TempDir()
	// A Kuiper file whose sidecar claims 1e12 positions.
	kfile := filepath.Join(dir, "m.bin")
	if _, err := runApp(t, "export", "-q", "--hf", llamaMini, "--fp32", kfile); err != nil {
		t.Fatal(err)
	}
	side := map[string]any{}
	data, _ := os.ReadFile(kfile + ".json")
	json.Unmarshal(data, &side)
	side["max_position_embeddings"] = 1e12
	data, _ = json.Marshal(side)
	os.WriteFile(kfile+".json", data, 0o644)
	// A checkpoint whose model.safetensors is a FIFO.
	fifoDir := filepath.Join(dir, "fifo-model")
	os.CopyFS(fifoDir, os.DirFS(llamaMini))
	os.Remove(filepath.Join(fifoDir, "model.safetensors"))
	if err := syscall.Mkfifo(filepath.Join(fifoDir, "model.safetensors"), 0o644); err != nil {
		t.Fatal(err)
	}
	// A FIFO where a KLD logits file or a report input should be, and a
	// report input that is /dev/zero under a .json name.
	fifo := filepath.Join(dir, "fifo.json")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	zeroJSON := filepath.Join(dir, "zero.json")
	if err := os.Symlink("/dev/zero", zeroJSON); err != nil {
		t.Fatal(err)
	}
	short := withConfig(t, map[string]any{"max_position_embeddings": 16})
	zero := withConfig(t, map[string]any{"max_position_embeddings": 0})
	calibText, _ := filepath.Abs("../../testdata/corpus/train-head.txt")
	const capKB = 3 << 20
	verify := []string{"verify", "-q", "--device", "cpu"}
	for _, c := range []struct {
		name string
		args []string
		ok   bool   // exit 0 expected
		want string // in the output
	}{
		{"max-new MaxInt64 is clamped", append(verify, "--prompt", "The", "--max-new", "9223372036854775807", short), true, "new tokens"},
		{"max_position_embeddings 0", append(verify, "--prompt", "The", "--max-new", "1000000000", zero), false, "KV cache"},
		{"sidecar max_position_embeddings 1e12", append(verify, "--prompt", "The", "--max-new", "1000000000", kfile), false, "KV cache"},
		{"ppl /dev/zero", append(verify, "--ppl", "/dev/zero", llamaMini), false, "character device"},
		{"calib /dev/zero", []string{"gptq", "-q", "--hf", llamaMini, "--calib", "/dev/zero", "--nsamples", "1", "--seqlen", "8", "-o", filepath.Join(dir, "g")}, false, "character device"},
		{"FIFO model.safetensors (verify)", append(verify, fifoDir), false, "FIFO"},
		{"FIFO model.safetensors (inspect)", []string{"inspect", fifoDir}, false, "FIFO"},
		{"calib /dev/zero with --resume", []string{"gptq", "-q", "--hf", llamaMini, "--calib", "/dev/zero", "--resume", "--nsamples", "1", "--seqlen", "8", "-o", filepath.Join(dir, "g3")}, false, "character device"},
		{"FIFO KLD base", append(verify, "--kld", fifo, "--ppl", calibText, llamaMini), false, "FIFO"},
		{"FIFO report input", []string{"report", "-o", filepath.Join(dir, "r.html"), fifo}, false, "FIFO"},
		{"/dev/zero report input", []string{"report", "-o", filepath.Join(dir, "r.html"), zeroJSON}, false, "character device"},
		{"calib ok under the cap", []string{"gptq", "-q", "--hf", llamaMini, "--calib", calibText, "--nsamples", "1", "--seqlen", "16", "-o", filepath.Join(dir, "g2")}, true, "wrote"},
	} {
		t.Run(c.name, func(t *testing.T) {
			out, code := runLimited(t, "-v", capKB, 2*time.Minute, c.args...)
			if strings.Contains(out, "panic:") || strings.Contains(out, "goroutine ") || strings.Contains(out, "out of memory") {
				t.Fatalf("crashed (exit %d):\n%s", code, tail(out))
			}
			if (code == 0) != c.ok || !strings.Contains(out, c.want) {
				t.Fatalf("exit %d, want ok=%v and %q in:\n%s", code, c.ok, c.want, tail(out))
			}
		})
	}
}

// TestLongPromptNotEchoed: a 100 000-character prompt that does not fit is
// refused without printing it back whole.
func TestLongPromptNotEchoed(t *testing.T) {
	prompt := strings.Repeat("The State of the Union ", 100000/23+1)[:100000]
	out, err := runApp(t, "verify", "-q", "--device", "cpu", "--prompt", prompt, llamaMini)
	if err == nil || !strings.Contains(err.Error(), "max_position_embeddings") {
		t.Fatalf("err = %v", err)
	}
	if n := len(out) + len(err.Error()); n > 2000 {
		t.Fatalf("%d bytes of output and error for a refused prompt:\n%s", n, tail(out+err.Error()))
	}
}

// TestRejectedFlags: out-of-range numeric options are refused by name.
func TestRejectedFlags(t *testing.T) {
	for _, c := range [][]string{
		{"verify", "--max-chunks", "-1", llamaMini},
		{"verify", "--threads", "-1", llamaMini},
		{"verify", "--temperature", "-1", llamaMini},
		{"verify", "--max-new", "-1", llamaMini},
		{"verify", "--top-p", "1.5", llamaMini},
		{"gptq", "--block", "0", "--hf", llamaMini, "--calib", "x", "-o", "y"},
		{"gptq", "--threads", "-1", "--hf", llamaMini, "--calib", "x", "-o", "y"},
	} {
		_, err := runApp(t, c...)
		if err == nil || !strings.Contains(err.Error(), c[1]+" "+c[2]) {
			t.Errorf("qtool %s: err = %v, want a refusal naming %s %s", strings.Join(c, " "), err, c[1], c[2])
		}
	}
}

func tail(s string) string {
	if len(s) > 2000 {
		return "…" + s[len(s)-2000:]
	}
	return s
}

// TestFailedWriteDoesNotBlockRetry: a write that fails part way (here a
// file-size cap standing in for a full disk) leaves nothing behind: no
// output directory, no temporaries, so the same command succeeds next.
func TestFailedWriteDoesNotBlockRetry(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary")
	}
	dir := t.TempDir()
	for _, args := range [][]string{
		{"convert", "--to", "hf", llamaMini, "-o", filepath.Join(dir, "hf")},
		{"export", "-q", "--hf", llamaMini, "--q8", filepath.Join(dir, "m.bin")},
		{"shard", "--tp", "2", llamaMini, "-o", filepath.Join(dir, "sh")},
	} {
		out, code := runLimited(t, "-f", 2000, time.Minute, args...)
		if code == 0 || !strings.Contains(out, "file too large") {
			t.Fatalf("qtool %s under a 2 MB file cap: exit %d\n%s", args[0], code, tail(out))
		}
		if ents, _ := os.ReadDir(dir); len(ents) != 0 {
			t.Fatalf("qtool %s failed but left %v", args[0], ents)
		}
		if out, code := runLimited(t, "-f", 1<<30, time.Minute, args...); code != 0 {
			t.Fatalf("retry of qtool %s: exit %d\n%s", args[0], code, tail(out))
		}
		ents, _ := os.ReadDir(dir)
		for _, e := range ents {
			os.RemoveAll(filepath.Join(dir, e.Name()))
		}
	}
}
