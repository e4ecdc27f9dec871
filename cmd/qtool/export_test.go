package main

import (
	"bytes"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

const llamaMini = "../../testdata/llama-mini"

func runApp(t *testing.T, args ...string) (string, error) {
	t.Helper()
	app := newApp()
	var out bytes.Buffer
	app.Writer, app.ErrWriter = &out, &out
	err := app.Run(append([]string{"qtool"}, args...))
	return out.String(), err
}

func TestExportAndInspect(t *testing.T) {
	dir := t.TempDir()
	tests := []struct {
		flag, file string
		header     []string
	}{
		{"--q8", "m.bin", []string{"kuiper-int8", "vocab_size -4096", "group_size 64", "dim 256 hidden_dim 768 n_layers 4 n_heads 4 n_kv_heads 2"}},
		{"--fp32", "m32.bin", []string{"kuiper-fp32", "vocab_size -4096", "seq_len 2048"}},
		{"--ak42-v2", "v2.bin", []string{"ak42-v2", "magic 0x616b3432 version 2"}},
	}
	for _, tc := range tests {
		t.Run(tc.flag, func(t *testing.T) {
			out := filepath.Join(dir, tc.file)
			if msg, err := runApp(t, "export", "--quiet", "--hf", llamaMini, tc.flag, out); err != nil {
				t.Fatalf("export: %v\n%s", err, msg)
			}
			for _, p := range []string{out, out + ".json"} {
				if _, err := os.Stat(p); err != nil {
					t.Fatal(err)
				}
			}
			msg, err := runApp(t, "inspect", "--source", llamaMini, out)
			if err != nil {
				t.Fatalf("inspect: %v", err)
			}
			for _, s := range append(tc.header, "layers.0.q", "max|err|") {
				if !strings.Contains(msg, s) {
					t.Errorf("inspect output lacks %q:\n%s", s, msg[:min(len(msg), 800)])
				}
			}
			if _, err := runApp(t, "inspect", "--json", out); err != nil {
				t.Fatal(err)
			}
		})
	}
}

// TestExportErrors runs the real main in a subprocess to check the exit code.
func TestExportErrors(t *testing.T) {
	if args := os.Getenv("QTOOL_TEST_ARGS"); args != "" {
		os.Args = append([]string{"qtool"}, strings.Split(args, "\x1f")...)
		main()
		os.Exit(0)
	}
	dir := t.TempDir()
	// a checkpoint of an unsupported architecture
	bad := filepath.Join(dir, "gpt2")
	os.Mkdir(bad, 0o755)
	cfg, _ := os.ReadFile(filepath.Join(llamaMini, "config.json"))
	os.WriteFile(filepath.Join(bad, "config.json"), bytes.Replace(cfg, []byte("LlamaForCausalLM"), []byte("GPT2LMHeadModel"), 1), 0o644)
	// a truncated int8 file
	good := filepath.Join(dir, "good.bin")
	if _, err := runApp(t, "export", "--quiet", "--hf", llamaMini, "--q8", good); err != nil {
		t.Fatal(err)
	}
	data, _ := os.ReadFile(good)
	trunc := filepath.Join(dir, "trunc.bin")
	os.WriteFile(trunc, data[:len(data)-1000], 0o644)
	side, _ := os.ReadFile(good + ".json")
	os.WriteFile(trunc+".json", side, 0o644)

	tests := []struct {
		name string
		args []string
		out  string
		want []string
	}{
		{"group", []string{"export", "--hf", llamaMini, "--q8", filepath.Join(dir, "g48.bin"), "--group", "48"}, filepath.Join(dir, "g48.bin"), []string{"g48.bin", `tensor "layers.0.q"`, "group size 48"}},
		{"arch", []string{"export", "--hf", bad, "--fp32", filepath.Join(dir, "a.bin")}, filepath.Join(dir, "a.bin"), []string{"config.json", "GPT2LMHeadModel"}},
		{"truncated", []string{"inspect", trunc}, "", []string{"trunc.bin", "tensor", "truncated"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			cmd := exec.Command(os.Args[0], "-test.run=^TestExportErrors$")
			cmd.Env = append(os.Environ(), "QTOOL_TEST_ARGS="+strings.Join(tc.args, "\x1f"))
			var stderr bytes.Buffer
			cmd.Stderr = &stderr
			err := cmd.Run()
			var ee *exec.ExitError
			if !errors.As(err, &ee) || ee.ExitCode() == 0 {
				t.Fatalf("exit: %v, want a non-zero exit code; stderr: %s", err, stderr.String())
			}
			for _, s := range tc.want {
				if !strings.Contains(stderr.String(), s) {
					t.Errorf("stderr %q lacks %q", stderr.String(), s)
				}
			}
			if tc.out != "" {
				if _, err := os.Stat(tc.out); !os.IsNotExist(err) {
					t.Errorf("%s was left behind", tc.out)
				}
				ents, _ := os.ReadDir(filepath.Dir(tc.out))
				for _, e := range ents {
					if strings.Contains(e.Name(), filepath.Base(tc.out)) {
						t.Errorf("left behind: %s", e.Name())
					}
				}
			}
		})
	}
}
