package main

import (
	"bufio"
	"encoding/json"
	"fmt"
	"math/rand/v2"
	"os"
	"os/exec"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
	"time"

	"qtool/quantize/calib"
)

// resumeArgs is a calibration command on llama-mini (4 layers) writing out.
func resumeArgs(t *testing.T, method, out string, extra ...string) []string {
	return resumeArgsOn(t, llamaMini, method, out, extra...)
}

// resumeArgsOn is resumeArgs on another 4-layer model.
func resumeArgsOn(t *testing.T, src, method, out string, extra ...string) []string {
	t.Helper()
	mini, err := filepath.Abs(src)
	if err != nil {
		t.Fatal(err)
	}
	text, _ := filepath.Abs(calibHead)
	return append([]string{method, "--hf", mini, "--calib", text, "--nsamples", "4", "--seqlen", "128",
		"--device", "cpu", "--threads", "2", "-o", out}, extra...)
}

// runKilled starts bin with args, reads its plain progress lines (stderr is
// a pipe) and kills it with SIGKILL as soon as the line of layer k
// ("METHOD layer k/4 ...") appears. It fails when the run ends first.
func runKilled(t *testing.T, bin, method string, k int, args []string) {
	t.Helper()
	cmd := exec.Command(bin, args...)
	stderr, err := cmd.StderrPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	want := fmt.Sprintf("%s layer %d/", method, k)
	sc := bufio.NewScanner(stderr)
	killed := false
	var lines []string
	for sc.Scan() {
		lines = append(lines, sc.Text())
		if !killed && strings.HasPrefix(sc.Text(), want) {
			if err := cmd.Process.Kill(); err != nil {
				t.Fatal(err)
			}
			killed = true
		}
	}
	err = cmd.Wait()
	if !killed {
		t.Fatalf("qtool %s ended (%v) before layer %d's line:\n%s", strings.Join(args, " "), err, k, strings.Join(lines, "\n"))
	}
	if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != -1 {
		t.Fatalf("qtool %s: want death by SIGKILL, got %v", strings.Join(args, " "), err)
	}
}

// workState reads the layers finished in out's work directory.
func workState(t *testing.T, out string) int {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(calib.CheckpointDir(out), "state.json"))
	if err != nil {
		t.Fatal(err)
	}
	var st struct {
		LayersDone int `json:"layers_done"`
	}
	if err := json.Unmarshal(b, &st); err != nil {
		t.Fatal(err)
	}
	return st.LayersDone
}

// TestResumeAfterKill kills `qtool gptq|awq|smoothquant --resume` (child
// processes, SIGKILL) right after the progress line of layer k, for
// several k and for a chain of kills (a resumed run killed again), resumes
// with --resume and checks that every file of the output is byte for byte
// the uninterrupted run's, that the per-module statistics cover all
// layers, and that the work directory is gone. QTOOL_RESUME_ALL=1 runs
// every k for every method (the default matrix keeps the test near 30 s on
// two cores).
func TestResumeAfterKill(t *testing.T) {
	if testing.Short() {
		t.Skip("builds qtool and runs a dozen quantizations")
	}
	bin := qtoolBinary(t)
	const qwen3 = "../../testdata/qwen3-mini"
	type plan struct {
		model, method string
		kills         [][]int // each: the layers after which successive runs are killed
	}
	plans := []plan{
		{llamaMini, "gptq", [][]int{{1}, {2}, {1, 3}}},
		{llamaMini, "awq", [][]int{{1}, {3}}},
		{llamaMini, "smoothquant", [][]int{{2}}},
		{qwen3, "awq", [][]int{{2}}},
	}
	if os.Getenv("QTOOL_RESUME_ALL") != "" {
		all := [][]int{{1}, {2}, {3}, {4}, {1, 2}, {1, 3}, {2, 3, 4}}
		plans = []plan{{llamaMini, "gptq", all}, {llamaMini, "awq", all}, {llamaMini, "smoothquant", all},
			{qwen3, "gptq", all}, {qwen3, "awq", all}}
	}
	for _, p := range plans {
		t.Run(filepath.Base(p.model)+"/"+p.method, func(t *testing.T) {
			work := t.TempDir()
			ref := filepath.Join(work, "ref")
			if out, err := exec.Command(bin, resumeArgsOn(t, p.model, p.method, ref, "-q")...).CombinedOutput(); err != nil {
				t.Fatalf("reference run: %v\n%s", err, out)
			}
			want, err := readTree(ref)
			if err != nil {
				t.Fatal(err)
			}
			wantReport := readReport(t, ref)
			for i, ks := range p.kills {
				out := filepath.Join(work, fmt.Sprintf("out%d", i))
				args := resumeArgsOn(t, p.model, p.method, out, "--resume")
				for _, k := range ks {
					before := 0
					if _, err := os.Stat(calib.CheckpointDir(out)); err == nil {
						before = workState(t, out)
					}
					runKilled(t, bin, p.method, k, args)
					if _, err := os.Stat(out); err == nil {
						t.Fatalf("killed after layer %d, %s exists", k, out)
					}
					done := workState(t, out)
					if done < k || done < before {
						t.Fatalf("killed after layer %d's line: work directory has %d layers (had %d)", k, done, before)
					}
					t.Logf("%s: killed after layer %d/4's line; %d layers in the work directory", p.method, k, done)
				}
				res, err := exec.Command(bin, args...).CombinedOutput()
				if err != nil {
					t.Fatalf("resume: %v\n%s", err, res)
				}
				if !strings.Contains(string(res), "resuming after layer") {
					t.Errorf("resume did not say where it resumed:\n%s", res)
				}
				got, err := readTree(out)
				if err != nil {
					t.Fatal(err)
				}
				if !sameTree(got, want) {
					for n := range want {
						if !slices.Equal(got[n], want[n]) {
							t.Errorf("%s: %s differs from the uninterrupted run's", out, n)
						}
					}
					t.Fatalf("kills %v: output differs (%d files, want %d)", ks, len(got), len(want))
				}
				if _, err := os.Stat(calib.CheckpointDir(out)); err == nil {
					t.Errorf("work directory %s left after a finished run", calib.CheckpointDir(out))
				}
				rep := readReport(t, out)
				if len(rep.Modules) != len(wantReport.Modules) {
					t.Fatalf("report: %d module stats, uninterrupted run %d", len(rep.Modules), len(wantReport.Modules))
				}
				for j, m := range rep.Modules {
					w := wantReport.Modules[j]
					if m.Layer != w.Layer || m.Role != w.Role || m.Loss != w.Loss || m.RelErr != w.RelErr {
						t.Errorf("module stat %d: %+v, uninterrupted %+v", j, m, w)
					}
				}
			}
		})
	}
}

func readReport(t *testing.T, out string) calib.RunReport {
	t.Helper()
	b, err := os.ReadFile(calib.ReportPath(out))
	if err != nil {
		t.Fatal(err)
	}
	var r calib.RunReport
	if err := json.Unmarshal(b, &r); err != nil {
		t.Fatal(err)
	}
	return r
}

// TestResumeRefused checks that --resume refuses a work directory of a run
// with other inputs, naming each difference, and a damaged one, without
// touching it or writing the output; that a run without --resume leaves the
// work directory alone and says it is there; and that --resume with the
// output already in place says the run was complete.
func TestResumeRefused(t *testing.T) {
	if testing.Short() {
		t.Skip("builds qtool")
	}
	bin := qtoolBinary(t)
	work := t.TempDir()
	out := filepath.Join(work, "out")
	runKilled(t, bin, "gptq", 1, resumeArgs(t, "gptq", out, "--resume"))
	wd := calib.CheckpointDir(out)
	snapshot := func() map[string][]byte {
		tree, err := readTree(wd)
		if err != nil {
			t.Fatal(err)
		}
		return tree
	}
	orig := snapshot()
	otherCalib := filepath.Join(work, "other.txt")
	if err := os.WriteFile(otherCalib, []byte(strings.Repeat("Another calibration text, with other words. ", 2000)), 0o644); err != nil {
		t.Fatal(err)
	}
	qwen, _ := filepath.Abs("../../testdata/qwen3-mini")
	refuse := func(name string, args []string, want ...string) {
		t.Helper()
		res, err := exec.Command(bin, args...).CombinedOutput()
		if err == nil {
			t.Fatalf("%s: resumed:\n%s", name, res)
		}
		for _, w := range want {
			if !strings.Contains(string(res), w) {
				t.Errorf("%s: message lacks %q:\n%s", name, w, res)
			}
		}
		if strings.Contains(string(res), "panic") {
			t.Errorf("%s: panic:\n%s", name, res)
		}
		if _, err := os.Stat(out); err == nil {
			t.Fatalf("%s: output written", name)
		}
		t.Logf("%s: %s", name, strings.TrimSpace(string(res)))
	}
	base := resumeArgs(t, "gptq", out, "--resume")
	with := func(flag, value string) []string {
		a := slices.Clone(base)
		i := slices.Index(a, flag)
		if i < 0 {
			return append(a, flag, value)
		}
		a[i+1] = value
		return a
	}
	refuse("bits", with("--bits", "3"), "belongs to a different run", "--bits: 4 in the work dir, 3 now")
	refuse("calib", with("--calib", otherCalib), "--calib contents: 1000000 bytes", "calibration tokens: ")
	refuse("model", with("--hf", qwen), "--hf: ", "qwen3-mini now", "source model files: ")
	refuse("threads and act-order", append(with("--threads", "1"), "--act-order"),
		"--threads: 2 in the work dir, 1 now", "--act-order: false in the work dir, true now")
	if !sameTree(snapshot(), orig) {
		t.Fatal("a refused resume changed the work directory")
	}
	// Without --resume a run starts over, says so, and leaves the work
	// directory alone; a --resume run then finds the output in place.
	plain := slices.DeleteFunc(slices.Clone(base), func(a string) bool { return a == "--resume" })
	res, err := exec.Command(bin, plain...).CombinedOutput()
	if err != nil {
		t.Fatalf("run without --resume: %v\n%s", err, res)
	}
	if !strings.Contains(string(res), "holds the state of an interrupted run; --resume continues it") {
		t.Errorf("run without --resume beside a work directory did not say so:\n%s", res)
	}
	if !sameTree(snapshot(), orig) {
		t.Fatal("a run without --resume changed the work directory")
	}
	if res, err := exec.Command(bin, base...).CombinedOutput(); err == nil || !strings.Contains(string(res), "was written completely") {
		t.Fatalf("--resume with the output in place: %v\n%s", err, res)
	}
	if err := os.RemoveAll(out); err != nil {
		t.Fatal(err)
	}

	// Damage: each case on a fresh copy of the work directory.
	damage := []struct {
		name string
		do   func() error
		want string
	}{
		{"truncated layer", func() error { return os.Truncate(filepath.Join(wd, "layer-000.gob"), 1000) }, "layer-000.gob: checksum"},
		{"flipped residual byte", func() error {
			p := filepath.Join(wd, "residual-after-000.f32")
			b, err := os.ReadFile(p)
			if err == nil {
				b[12345] ^= 0x40
				err = os.WriteFile(p, b, 0o644)
			}
			return err
		}, "residual-after-000.f32: checksum"},
		{"missing residual", func() error { return os.Remove(filepath.Join(wd, "residual-after-000.f32")) }, "residual-after-000.f32: no such file"},
		{"truncated state", func() error { return os.Truncate(filepath.Join(wd, "state.json"), 100) }, "state.json: unexpected end of JSON input"},
	}
	for _, d := range damage {
		if err := os.RemoveAll(wd); err != nil {
			t.Fatal(err)
		}
		if err := os.Mkdir(wd, 0o755); err != nil {
			t.Fatal(err)
		}
		for n, b := range orig {
			if err := os.WriteFile(filepath.Join(wd, n), b, 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if err := d.do(); err != nil {
			t.Fatal(err)
		}
		refuse(d.name, base, "is damaged", d.want, "remove it to start over")
	}
}

// TestResumeKillLoop kills `qtool gptq --resume` and `qtool awq --resume`
// at random times (in the middle of a layer, of a checkpoint write or of
// the output's), resumes until a run finishes, and compares the output
// with an uninterrupted run's. Set QTOOL_RESUME_LOOP=N to run it with N
// complete runs per method.
func TestResumeKillLoop(t *testing.T) {
	n, _ := strconv.Atoi(os.Getenv("QTOOL_RESUME_LOOP"))
	if n <= 0 {
		t.Skip("set QTOOL_RESUME_LOOP=N to run N kill-and-resume chains per method")
	}
	bin := qtoolBinary(t)
	for _, method := range []string{"gptq", "awq"} {
		t.Run(method, func(t *testing.T) {
			work := t.TempDir()
			ref := filepath.Join(work, "ref")
			start := time.Now()
			if out, err := exec.Command(bin, resumeArgs(t, method, ref, "-q")...).CombinedOutput(); err != nil {
				t.Fatalf("reference run: %v\n%s", err, out)
			}
			full := time.Since(start)
			want, err := readTree(ref)
			if err != nil {
				t.Fatal(err)
			}
			kills, leftWorkDir := 0, 0
			for i := range n {
				out := filepath.Join(work, fmt.Sprintf("out%d", i))
				args := resumeArgs(t, method, out, "--resume", "-q")
				for try := 0; ; try++ {
					if _, err := os.Stat(out); err == nil {
						// Killed after the output was in place, before its
						// work directory was removed.
						leftWorkDir++
						break
					}
					cmd := exec.Command(bin, args...)
					var buf strings.Builder
					cmd.Stdout, cmd.Stderr = &buf, &buf
					if err := cmd.Start(); err != nil {
						t.Fatal(err)
					}
					timer := time.AfterFunc(time.Duration(rand.Int64N(int64(full))), func() { cmd.Process.Kill() })
					err := cmd.Wait()
					timer.Stop()
					if err == nil {
						break
					}
					if ee, ok := err.(*exec.ExitError); !ok || ee.ExitCode() != -1 {
						t.Fatalf("try %d: %v\n%s", try, err, buf.String())
					}
					kills++
					if try > 50 {
						t.Fatal("no run finished in 50 tries")
					}
				}
				got, err := readTree(out)
				if err != nil {
					t.Fatal(err)
				}
				if !sameTree(got, want) {
					t.Fatalf("chain %d: output differs from the uninterrupted run's", i)
				}
			}
			t.Logf("%s: %d chains, %d kills at random times, all outputs byte-identical; %d killed between writing the output and removing the work directory",
				method, n, kills, leftWorkDir)
		})
	}
}
