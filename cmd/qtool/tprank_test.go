package main

import (
	"bytes"
	"encoding/json"
	"math"
	"os"
	"os/exec"
	"strings"
	"testing"
)

// verifyJSON runs the built qtool binary's verify with --json and decodes
// the result.
func verifyJSON(t *testing.T, args ...string) verifyResult {
	t.Helper()
	cmd := exec.Command(qtoolBinary(t), append([]string{"verify", "--json", "--device", "cpu"}, args...)...)
	out, err := cmd.Output()
	if err != nil {
		msg := ""
		if ee, ok := err.(*exec.ExitError); ok {
			msg = string(ee.Stderr)
		}
		t.Fatalf("qtool verify %s: %v\n%s", strings.Join(args, " "), err, msg)
	}
	var res verifyResult
	if err := json.Unmarshal(out, &res); err != nil {
		t.Fatalf("%v: %s", err, out)
	}
	return res
}

// Two processes of one rank each give the perplexity and the greedy text
// of the same two ranks in one process (bit for bit: the TCP collectives sum
// in the same order), and of one unsplit process within rounding.
func TestVerifyTPProcesses(t *testing.T) {
	if testing.Short() {
		t.Skip("builds qtool and starts processes")
	}
	for _, name := range []string{"llama-mini", "qwen3-mini"} {
		t.Run(name, func(t *testing.T) {
			dir := "../../testdata/" + name
			ppl := []string{"--ppl", sotu, "--max-chunks", "3"}
			one := verifyJSON(t, append(ppl, dir)...)
			inproc := verifyJSON(t, append(ppl, "--tp", "2", dir)...)
			procs := verifyJSON(t, append(ppl, "--tp", "2", "--tp-processes", dir)...)
			if !strings.Contains(procs.Device, "tp2 rank 0(tcp)") {
				t.Errorf("device %q: want rank 0 of a TCP job", procs.Device)
			}
			if *procs.PPL != *inproc.PPL {
				t.Errorf("ppl: two processes %.12f, two ranks in one process %.12f", *procs.PPL, *inproc.PPL)
			}
			if d := math.Abs(*procs.PPL / *one.PPL - 1); d > 1e-6 {
				t.Errorf("ppl: two processes %.10f, one process unsplit %.10f (%.1e relative)", *procs.PPL, *one.PPL, d)
			}
			// A shard directory runs on its own number of ranks.
			sd := t.TempDir() + "/shard"
			if out, err := exec.Command(qtoolBinary(t), "shard", "--tp", "2", dir, "-o", sd).CombinedOutput(); err != nil {
				t.Fatalf("qtool shard: %v\n%s", err, out)
			}
			fromDir := verifyJSON(t, append(ppl, "--tp-processes", sd)...)
			if *fromDir.PPL != *inproc.PPL {
				t.Errorf("ppl: shard directory in two processes %.12f, in-process TP=2 %.12f", *fromDir.PPL, *inproc.PPL)
			}
			gen := []string{"--prompt", "The State of the Union is", "--max-new", "12"}
			g1 := verifyJSON(t, append(gen, "--tp", "2", dir)...)
			g2 := verifyJSON(t, append(gen, "--tp", "2", "--tp-processes", dir)...)
			if g1.Generation.Text != g2.Generation.Text {
				t.Errorf("greedy text: two processes %q, one process %q", g2.Generation.Text, g1.Generation.Text)
			}
			t.Logf("%s: ppl %.10f (two processes) = %.10f (in-process TP=2), unsplit %.10f; %q", name, *procs.PPL, *inproc.PPL, *one.PPL, g2.Generation.Text)
		})
	}
}

// A rank that fails ends the job with its message, and flags that cannot
// work are refused.
func TestVerifyTPProcessesErrors(t *testing.T) {
	if testing.Short() {
		t.Skip("builds qtool and starts processes")
	}
	for _, tc := range []struct {
		name string
		args []string
		env  []string
		want string
	}{
		{name: "no --tp", args: []string{"verify", "--tp-processes", "../../testdata/llama-mini"}, want: "give the number of ranks with --tp N"},
		{name: "kld", args: []string{"verify", "--tp", "2", "--tp-processes", "--kld", "../../testdata/llama-mini", "../../testdata/llama-mini"}, want: "--kld runs in one process"},
		{name: "heads do not split", args: []string{"verify", "--device", "cpu", "--tp", "3", "--tp-processes", "--max-new", "2", "../../testdata/llama-mini"}, want: "3"},
		{name: "launcher disagrees with --tp", args: []string{"verify", "--tp", "4", "../../testdata/llama-mini"},
			env: []string{"WORLD_SIZE=2", "RANK=0", "MASTER_ADDR=127.0.0.1", "MASTER_PORT=1"}, want: "the launcher started 2 ranks"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			cmd := exec.Command(qtoolBinary(t), tc.args...)
			cmd.Env = append(cmd.Environ(), tc.env...)
			out, err := cmd.CombinedOutput()
			if err == nil || !strings.Contains(string(out), tc.want) {
				t.Fatalf("err %v, output:\n%s\nwant it to mention %q", err, out, tc.want)
			}
			if strings.Contains(string(out), "panic") || strings.Contains(string(out), "goroutine ") {
				t.Fatalf("a panic:\n%s", out)
			}
		})
	}
}

// --cpuprofile and --trace write one file a process: the run's own, or one
// a rank (FILE.rankN) where the ranks are processes, none for the launcher.
func TestVerifyRecord(t *testing.T) {
	if testing.Short() {
		t.Skip("builds qtool and starts processes")
	}
	dir := t.TempDir()
	gen := []string{"--prompt", "The", "--max-new", "2", "../../testdata/llama-mini"}
	verifyJSON(t, append([]string{"--cpuprofile", dir + "/one.prof", "--trace", dir + "/one.trace"}, gen...)...)
	verifyJSON(t, append([]string{"--cpuprofile", dir + "/tp.prof", "--trace", dir + "/tp.trace", "--tp", "2", "--tp-processes"}, gen...)...)
	for _, base := range []string{"one", "tp"} {
		suffixes := []string{""}
		if base == "tp" {
			suffixes = []string{".rank0", ".rank1"}
		}
		for _, sfx := range suffixes {
			prof, trc := dir+"/"+base+".prof"+sfx, dir+"/"+base+".trace"+sfx
			if b, err := os.ReadFile(prof); err != nil {
				t.Error(err)
			} else if len(b) < 2 || b[0] != 0x1f || b[1] != 0x8b { // pprof's profiles are gzipped protocol buffers
				t.Errorf("%s: %d bytes, not a gzipped profile", prof, len(b))
			}
			if b, err := os.ReadFile(trc); err != nil {
				t.Error(err)
			} else if !bytes.HasPrefix(b, []byte("go 1.")) || !bytes.Contains(b[:min(len(b), 16)], []byte(" trace")) {
				t.Errorf("%s: %d bytes, not an execution trace (%q)", trc, len(b), b[:min(len(b), 16)])
			}
		}
		if base == "tp" {
			for _, f := range []string{"tp.prof", "tp.trace"} {
				if _, err := os.Stat(dir + "/" + f); !os.IsNotExist(err) {
					t.Errorf("the launcher wrote %s of its own (stat: %v)", f, err)
				}
			}
		}
	}
}
