package main

import (
	"encoding/json"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"qtool/convert"
	"qtool/formats/hf"
	"qtool/formats/kuiper"
	"qtool/quantize/calib"
)

const w8a8Mini = "../../testdata/msmodelslim/llama-mini-w8a8-smooth"

// dirNames lists the entries of dir, sorted.
func dirNames(t *testing.T, dir string) []string {
	t.Helper()
	ents, err := os.ReadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	slices.Sort(names)
	return names
}

// TestConvertIntoModelDir: a directory that holds another model (a sharded
// HF checkpoint) is refused without --force; with it, the old model is gone
// entirely (no index.json next to the new model.safetensors).
func TestConvertIntoModelDir(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "out")
	src, err := convert.Open(llamaMini)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if err := hf.Write(src, dir, hf.WriteOptions{MaxShard: 1 << 20}); err != nil {
		t.Fatal(err)
	}
	before := dirNames(t, dir)
	msg, err := runConvertApp(t, "convert", "--to", "msmodelslim", w8a8Mini, "-o", dir)
	if err == nil || !strings.Contains(err.Error(), "--force") || !strings.Contains(err.Error(), dir) {
		t.Fatalf("convert into a model directory: err = %v, want a refusal naming %s and --force\n%s", err, dir, msg)
	}
	if got := dirNames(t, dir); !slices.Equal(got, before) {
		t.Fatalf("a refused convert changed the directory: %v → %v", before, got)
	}
	if msg, err := runConvertApp(t, "convert", "--to", "msmodelslim", w8a8Mini, "-o", dir, "--force"); err != nil {
		t.Fatalf("--force: %v\n%s", err, msg)
	}
	got := dirNames(t, dir)
	if slices.ContainsFunc(got, func(n string) bool { return strings.HasPrefix(n, "model") }) || !slices.Contains(got, "quant_model_description.json") {
		t.Fatalf("after --force the directory holds %v: old shards and index must be gone", got)
	}
	m, err := convert.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	m.Close()
	if left, _ := filepath.Glob(filepath.Join(filepath.Dir(dir), ".out*")); len(left) > 0 {
		t.Fatalf("left behind: %v", left)
	}
}

// TestConvertOntoItself: an AutoAWQ directory converted to msmodelslim onto
// itself with --force leaves only the new format (no AutoAWQ weights or
// quantization_config beside it).
func TestConvertOntoItself(t *testing.T) {
	dir := writeQwenAWQ(t, t.TempDir())
	if _, err := runConvertApp(t, "convert", "--to", "msmodelslim", dir, "-o", dir); err == nil {
		t.Fatal("convert onto itself without --force succeeded")
	}
	if msg, err := runConvertApp(t, "convert", "--to", "msmodelslim", dir, "-o", dir, "--force"); err != nil {
		t.Fatalf("%v\n%s", err, msg)
	}
	got := dirNames(t, dir)
	if slices.Contains(got, "model.safetensors") || !slices.Contains(got, "quant_model_description.json") || !slices.Contains(got, "tokenizer.json") {
		t.Fatalf("after converting onto itself the directory holds %v, want only the msmodelslim model and its tokenizer", got)
	}
	m, err := convert.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if m.Format != "msmodelslim" {
		t.Fatalf("reads back as %s", m.Format)
	}
}

// TestConcurrentWriters: writers started together on one new output: one
// wins, the others fail naming the output, and the output reads back.
func TestConcurrentWriters(t *testing.T) {
	for _, c := range []struct{ in, format string }{{w8a8Mini, "msmodelslim"}, {llamaMini, "kuiper-int8"}} {
		format := c.format
		src, err := convert.Open(c.in)
		if err != nil {
			t.Fatal(err)
		}
		defer src.Close()
		out := filepath.Join(t.TempDir(), "out")
		var wg sync.WaitGroup
		errs := make([]error, 4)
		for i := range errs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[i] = convert.Save(src, format, out)
			}()
		}
		wg.Wait()
		won := 0
		for _, err := range errs {
			if err == nil {
				won++
				continue
			}
			if !strings.Contains(err.Error(), out) || !(strings.Contains(err.Error(), "another process is writing it") || strings.Contains(err.Error(), "not empty")) {
				t.Errorf("%s: loser's error %v names neither the output nor the conflict", format, err)
			}
		}
		// A file output is replaced by later writers (no --force needed);
		// at least one wins, and the result is one complete model.
		if (format == "msmodelslim" && won != 1) || won < 1 {
			t.Fatalf("%s: %d writers succeeded (errors %v)", format, won, errs)
		}
		m, err := convert.Open(out)
		if err != nil {
			t.Fatalf("%s: %v", format, err)
		}
		m.Close()
	}
}

// TestKuiperMismatchedSidecar: a file beside the sidecar of another run
// (what a kill between the two renames leaves) is refused naming the file:
// by size when the sizes differ, by checksum when only the contents do.
func TestKuiperMismatchedSidecar(t *testing.T) {
	for _, c := range []struct {
		name     string
		a, b     []string
		want     string
		inspects bool // inspect (header only) sees it too
	}{
		{"size", []string{"--q8"}, []string{"--q8", "--group", "32"}, "different runs", true},
		{"contents", []string{"--fp32", "--rope", "half"}, []string{"--fp32", "--rope", "interleaved"}, "CRC-32C", false},
	} {
		dir := t.TempDir()
		a, b := filepath.Join(dir, "a.bin"), filepath.Join(dir, "b.bin")
		if _, err := runApp(t, append([]string{"export", "-q", "--hf", llamaMini, c.a[0], a}, c.a[1:]...)...); err != nil {
			t.Fatal(err)
		}
		if _, err := runApp(t, append([]string{"export", "-q", "--hf", llamaMini, c.b[0], b}, c.b[1:]...)...); err != nil {
			t.Fatal(err)
		}
		if _, err := convert.Open(b); err != nil {
			t.Fatalf("%s: the pair as written: %v", c.name, err)
		}
		side, _ := os.ReadFile(kuiper.SidecarPath(a))
		if err := os.WriteFile(kuiper.SidecarPath(b), side, 0o644); err != nil {
			t.Fatal(err)
		}
		_, err := convert.Open(b)
		if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), b) {
			t.Errorf("%s: mismatched pair: err = %v, want %q naming %s", c.name, err, c.want, b)
		}
		if _, err := runApp(t, "inspect", b); c.inspects && err == nil {
			t.Errorf("%s: inspect accepted a mismatched pair", c.name)
		}
	}
}

// TestExportSpecialFiles: export refuses a FIFO or device node as its
// output and leaves it (and its sidecar path) alone.
func TestExportSpecialFiles(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	if err := mkfifo(fifo); err != nil {
		t.Fatal(err)
	}
	_, err := runApp(t, "export", "-q", "--hf", llamaMini, "--q8", fifo)
	if err == nil || !strings.Contains(err.Error(), "FIFO") {
		t.Fatalf("export to a FIFO: err = %v", err)
	}
	fi, _ := os.Lstat(fifo)
	if fi.Mode()&os.ModeNamedPipe == 0 {
		t.Fatal("the FIFO was replaced")
	}
	if _, err := os.Lstat(fifo + ".json"); err == nil {
		t.Fatal("a sidecar was written for a refused output")
	}
}

// TestReportOutput: `qtool report -o` writes its page whole (no temporary
// left beside it) and refuses a FIFO instead of blocking on it.
func TestReportOutput(t *testing.T) {
	dir := t.TempDir()
	rec := filepath.Join(dir, "rtn4.quant.json")
	b, err := json.Marshal(calib.RunReport{Method: "rtn", Model: "llama-mini", Out: filepath.Join(dir, "rtn4"), Scheme: "4-bit"})
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(rec, b, 0o644); err != nil {
		t.Fatal(err)
	}
	page := filepath.Join(dir, "report.html")
	if msg, err := runApp(t, "report", "-o", page, rec); err != nil {
		t.Fatalf("report: %v\n%s", err, msg)
	}
	if got := dirNames(t, dir); !slices.Equal(got, []string{"report.html", "rtn4.quant.json"}) {
		t.Errorf("the directory holds %v", got)
	}
	fifo := filepath.Join(dir, "fifo.html")
	if err := mkfifo(fifo); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { _, err := runApp(t, "report", "-o", fifo, rec); done <- err }()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "FIFO") {
			t.Errorf("report into a FIFO: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("report into a FIFO blocked")
	}
}

func mkfifo(path string) error { return syscall.Mkfifo(path, 0o644) }

// TestTwoQuantizersOneOutput: two `qtool gptq` processes started 0.5 s
// apart with the same new -o: one wins, the other fails naming the output,
// and the output is one complete model.
func TestTwoQuantizersOneOutput(t *testing.T) {
	if testing.Short() {
		t.Skip("builds the binary and runs two quantizers")
	}
	bin := qtoolBinary(t)
	out := filepath.Join(t.TempDir(), "gptq")
	calibText, _ := filepath.Abs("../../testdata/corpus/train-head.txt")
	type result struct {
		out  string
		code int
	}
	results := make(chan result, 2)
	for i := range 2 {
		go func() {
			time.Sleep(time.Duration(i) * 500 * time.Millisecond)
			cmd := exec.Command(bin, "gptq", "-q", "--hf", llamaMini, "--calib", calibText, "--nsamples", "1", "--seqlen", "16", "--threads", "1", "-o", out)
			b, err := cmd.CombinedOutput()
			code := 0
			if err != nil {
				code = 1
			}
			results <- result{string(b), code}
		}()
	}
	won := 0
	for range 2 {
		r := <-results
		if r.code == 0 {
			won++
			continue
		}
		if !strings.Contains(r.out, out) || !(strings.Contains(r.out, "another process is writing it") || strings.Contains(r.out, "not empty") || strings.Contains(r.out, "already exists")) {
			t.Errorf("the losing run's message names neither the output nor the conflict:\n%s", r.out)
		}
	}
	if won != 1 {
		t.Fatalf("%d runs succeeded, want exactly 1", won)
	}
	m, err := convert.Open(out)
	if err != nil {
		t.Fatal(err)
	}
	m.Close()
}
