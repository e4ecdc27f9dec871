package main

import (
	"bytes"
	"encoding/json"
	"maps"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
)

const verifyTestdata = "../../testdata"

// runQtool runs the CLI with args and returns its stdout and error.
func runQtool(t *testing.T, args ...string) (string, error) {
	t.Helper()
	app := newApp()
	var out, errOut bytes.Buffer
	app.Writer, app.ErrWriter = &out, &errOut
	err := app.Run(append([]string{"qtool"}, args...))
	return out.String(), err
}

// chunkPrefixPPL is exp(mean of the first n chunk NLLs) from chunk_nll.json.
func chunkPrefixPPL(t *testing.T, model, file string, n int) float64 {
	t.Helper()
	data, err := os.ReadFile(filepath.Join(verifyTestdata, model, "chunk_nll.json"))
	if err != nil {
		t.Fatal(err)
	}
	var c map[string][]float64
	if err := json.Unmarshal(data, &c); err != nil {
		t.Fatal(err)
	}
	s := 0.0
	for _, v := range c[file][:n] {
		s += v
	}
	return math.Exp(s / float64(n))
}

// TestVerifyJSON runs perplexity (tokenizing the text itself) and greedy
// generation through the command and checks them against reference.json
// and chunk_nll.json.
func TestVerifyJSON(t *testing.T) {
	for _, name := range []string{"llama-mini", "qwen3-mini"} {
		t.Run(name, func(t *testing.T) {
			dir := filepath.Join(verifyTestdata, name)
			data, err := os.ReadFile(filepath.Join(dir, "reference.json"))
			if err != nil {
				t.Fatal(err)
			}
			var ref struct {
				Prompt    string `json:"greedy_prompt"`
				PromptIDs []int  `json:"greedy_prompt_ids"`
				IDs       []int  `json:"greedy_ids"`
				Text      string `json:"greedy_text"`
			}
			if err := json.Unmarshal(data, &ref); err != nil {
				t.Fatal(err)
			}
			n := len(ref.IDs) - len(ref.PromptIDs)
			out, err := runQtool(t, "verify", "--json", "--ppl", filepath.Join(verifyTestdata, "corpus", "moby-test.raw"),
				"--max-chunks", "3", "--prompt", ref.Prompt, "--max-new", strconv.Itoa(n), "--device", "cpu", dir)
			if err != nil {
				t.Fatal(err)
			}
			var res struct {
				PPL        float64   `json:"ppl"`
				Tokens     int       `json:"tokens"`
				Chunks     int       `json:"chunks"`
				Ctx        int       `json:"ctx"`
				Protocol   string    `json:"protocol"`
				Device     string    `json:"device"`
				Seconds    float64   `json:"seconds"`
				ChunkSecs  []float64 `json:"chunk_seconds"`
				Generation struct {
					IDs         []int   `json:"ids"`
					Text        string  `json:"text"`
					TokensPerS  float64 `json:"tokens_per_s"`
					FirstTokenS float64 `json:"first_token_s"`
					DecodeTokS  float64 `json:"decode_tok_s"`
				} `json:"generation"`
			}
			if err := json.Unmarshal([]byte(out), &res); err != nil {
				t.Fatalf("output is not JSON: %v\n%s", err, out)
			}
			want := chunkPrefixPPL(t, name, "moby-test.raw", 3)
			if math.Abs(res.PPL-want)/want > 2e-4 || res.Chunks != 3 || res.Ctx != 512 || res.Protocol != "gptq" || !strings.HasPrefix(res.Device, "cpu") {
				t.Errorf("result %+v, want ppl %.6f over 3 chunks of 512 (gptq)", res, want)
			}
			sum := 0.0
			for _, s := range res.ChunkSecs {
				sum += s
			}
			if len(res.ChunkSecs) != 3 || sum <= 0 || sum > res.Seconds*(1+1e-9) {
				t.Errorf("chunk_seconds %v (sum %g), want 3 times adding up to at most seconds %g", res.ChunkSecs, sum, res.Seconds)
			}
			if got := append(append([]int(nil), ref.PromptIDs...), res.Generation.IDs...); !equal(got, ref.IDs) {
				t.Errorf("generated ids %v, want %v", res.Generation.IDs, ref.IDs[len(ref.PromptIDs):])
			}
			if !strings.HasSuffix(ref.Text, strings.TrimSpace(res.Generation.Text)) {
				t.Errorf("generated text %q is not the end of %q", res.Generation.Text, ref.Text)
			}
			// the steady rate leaves out the first token's wait (the prefill)
			if g := res.Generation; n > 1 && (g.TokensPerS <= 0 || g.FirstTokenS <= 0 || g.DecodeTokS <= 0) {
				t.Errorf("generation rates: %g tokens/s, first token after %g s, steady %g tokens/s; want all positive", g.TokensPerS, g.FirstTokenS, g.DecodeTokS)
			}
		})
	}
}

func equal(a, b []int) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if a[i] != b[i] {
			return false
		}
	}
	return true
}

// TestVerifyErrors checks that bad input gives a clear error, not a panic.
func TestVerifyErrors(t *testing.T) {
	tmp := t.TempDir()
	// A model directory without tokenizer files.
	noTok := filepath.Join(tmp, "no-tokenizer")
	if err := os.Mkdir(noTok, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"config.json", "model.safetensors"} {
		abs, _ := filepath.Abs(filepath.Join(verifyTestdata, "llama-mini", f))
		if err := os.Symlink(abs, filepath.Join(noTok, f)); err != nil {
			t.Fatal(err)
		}
	}
	empty := filepath.Join(tmp, "empty.txt")
	short := filepath.Join(tmp, "short.txt")
	os.WriteFile(empty, []byte(" \n"), 0o644)
	os.WriteFile(short, []byte("Call me Ishmael."), 0o644)
	llama := filepath.Join(verifyTestdata, "llama-mini")
	qwen := filepath.Join(verifyTestdata, "qwen3-mini")
	t.Setenv("QTOOL_DATA", filepath.Join(tmp, "data"))
	tests := []struct {
		name string
		args []string
		want []string
	}{
		{"no tokenizer", []string{"verify", noTok}, []string{"no tokenizer beside the model", "--tokenizer"}},
		{"foreign tokenizer", []string{"verify", "--tokenizer", qwen, llama}, []string{"tokenizer does not match the model"}},
		{"empty text", []string{"verify", "--ppl", empty, llama}, []string{"is empty"}},
		{"short text", []string{"verify", "--ppl", short, llama}, []string{"too short", "fewer than one chunk"}},
		{"missing text", []string{"verify", "--ppl", filepath.Join(tmp, "nope.txt"), llama}, []string{"nope.txt"}},
		{"missing wikitext", []string{"verify", "--ppl", "wikitext", llama},
			[]string{filepath.Join(tmp, "data", "wiki.test.raw"), "wikitext-2-raw-v1.zip", "QTOOL_DATA"}},
		{"ctx too long", []string{"verify", "--ppl", filepath.Join(verifyTestdata, "corpus", "moby-test.raw"),
			"--protocol", "llamacpp", "--ctx", "4096", "--max-chunks", "1", llama}, []string{"max_position_embeddings"}},
		{"bad protocol", []string{"verify", "--protocol", "wiki", llama}, []string{"--protocol"}},
		{"bad device", []string{"verify", "--device", "tpu", llama}, []string{"--device"}},
		{"no model", []string{"verify"}, []string{"MODEL"}},
		{"missing model", []string{"verify", filepath.Join(tmp, "nothing")}, []string{"nothing"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := runQtool(t, tc.args...)
			if err == nil {
				t.Fatal("no error")
			}
			for _, w := range tc.want {
				if !strings.Contains(err.Error(), w) {
					t.Errorf("error %q does not mention %q", err, w)
				}
			}
		})
	}
}

func TestSinceBefore(t *testing.T) {
	for _, c := range []struct {
		now, before, want map[string]int
	}{
		{nil, nil, nil},
		{map[string]int{"a": 2}, map[string]int{"a": 2}, nil},
		{map[string]int{"a": 5, "b": 1}, map[string]int{"a": 2}, map[string]int{"a": 3, "b": 1}},
	} {
		if got := sinceBefore(c.now, c.before); !maps.Equal(got, c.want) || (got == nil) != (c.want == nil) {
			t.Errorf("sinceBefore(%v, %v) = %v, want %v", c.now, c.before, got, c.want)
		}
	}
	// device seconds: only what grew
	got := sinceBefore(map[string]float64{"a": 1.5, "b": 0.25}, map[string]float64{"a": 0.5, "b": 0.25})
	if want := map[string]float64{"a": 1}; !maps.Equal(got, want) {
		t.Errorf("sinceBefore(seconds) = %v, want %v", got, want)
	}
}
