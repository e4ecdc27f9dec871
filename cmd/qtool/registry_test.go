package main

import (
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"qtool/convert"
	"qtool/formats/kuiper"
	"qtool/formats/model"
	"qtool/quantize"
	"qtool/runtime"
	"qtool/runtime/cpu"
	"qtool/runtime/tokenizer"
	"qtool/runtime/tp"
)

const sotu = "../../testdata/corpus/sotu-test.raw"

// pplOf is the perplexity of m on the first two chunks of sotu-test.raw,
// tokenized with the tokenizer in tokDir.
func pplOf(t *testing.T, m *model.Model, tokDir string) float64 {
	t.Helper()
	tok, err := tokenizer.LoadDir(tokDir)
	if err != nil {
		t.Fatal(err)
	}
	text, err := os.ReadFile(sotu)
	if err != nil {
		t.Fatal(err)
	}
	load := func() (*runtime.Model, error) {
		if tp.ShardedSize(m) > 0 { // a shard directory runs over its ranks
			return tp.Load(m, 0, 0)
		}
		return runtime.Load(m, cpu.New(0))
	}
	rm, err := load()
	if err != nil {
		t.Fatal(err)
	}
	r, err := runtime.Perplexity(rm, tokenizer.EncodeWithBOS(tok, string(text)), runtime.PPLOptions{MaxChunks: 2})
	if err != nil {
		t.Fatal(err)
	}
	return r.PPL
}

// pplOfPath opens path through the registry and scores it.
func pplOfPath(t *testing.T, path, tokDir string) float64 {
	t.Helper()
	m, err := convert.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	return pplOf(t, m, tokDir)
}

// TestQuantizeCommand: `qtool quantize` is the RTN baseline the refusal of
// convert for float models points to; its output scores what the in-memory
// RTN model scores, and formats that cannot hold the result are refused.
func TestQuantizeCommand(t *testing.T) {
	dir := t.TempDir()
	src, err := convert.Open(llamaMini)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	for _, tc := range []struct {
		name   string
		args   []string
		params quantize.Params
	}{
		{"w4-g128-autoawq", []string{"--bits", "4", "--group", "128", "--format", "autoawq"}, quantize.Int4Asym(128)},
		{"w8-sym-g64-kuiper-int8", []string{"--bits", "8", "--sym", "--group", "64", "--format", "q8"}, quantize.Int8Sym(64)},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := filepath.Join(dir, tc.name)
			msg, err := runApp(t, append([]string{"quantize", "--hf", llamaMini, "-o", out}, tc.args...)...)
			if err != nil {
				t.Fatalf("%v\n%s", err, msg)
			}
			q, err := quantize.QuantizeModel(src, quantize.Options{Params: tc.params})
			if err != nil {
				t.Fatal(err)
			}
			want, got := pplOf(t, q, llamaMini), pplOfPath(t, out, llamaMini)
			t.Logf("%s: ppl %.4f written, %.4f in memory", tc.name, got, want)
			if relDiff := (got - want) / want; relDiff > 1e-3 || relDiff < -1e-3 {
				t.Errorf("written %.6f, in-memory RTN %.6f", got, want)
			}
		})
	}
	// The refusal that used to name a command that did not exist.
	if _, err := runApp(t, "convert", "--to", "gptq", llamaMini, "-o", filepath.Join(dir, "g")); err == nil || !strings.Contains(err.Error(), "qtool quantize") {
		t.Errorf("convert of a float model to gptq: %v, want a refusal naming qtool quantize", err)
	}
	for _, tc := range []struct {
		name string
		args []string
		want string
	}{
		{"3-bit into autoawq", []string{"--hf", llamaMini, "--bits", "3", "--format", "autoawq"}, "formats that can: gptq"},
		{"into a float format", []string{"--hf", llamaMini, "--format", "ak47"}, "fp16 format"},
		{"into a shard dir", []string{"--hf", llamaMini, "--format", "shard"}, "qtool shard"},
		{"bad bits", []string{"--hf", llamaMini, "--bits", "9"}, "--bits 9"},
		{"already quantized", []string{"--in", filepath.Join(dir, "w4-g128-autoawq")}, "already quantized"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := filepath.Join(dir, "refused")
			_, err := runApp(t, append([]string{"quantize", "-o", out}, tc.args...)...)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one containing %q", err, tc.want)
			}
			if _, err := os.Stat(out); err == nil {
				t.Fatal("a refused run wrote its output")
			}
		})
	}
}

// TestShardDirIsAFormat: a shard directory is read by inspect, convert,
// export and shard itself like any other format (inspect used to say "a
// model directory needs config.json").
func TestShardDirIsAFormat(t *testing.T) {
	dir := t.TempDir()
	sh := filepath.Join(dir, "sh")
	msg, err := runApp(t, "shard", "-q", "--tp", "2", llamaMini, "-o", sh)
	if err != nil {
		t.Fatalf("%v\n%s", err, msg)
	}
	if strings.Contains(msg, "rank 0") || !strings.Contains(msg, "wrote") {
		t.Errorf("shard -q printed %q, want only the wrote line", msg)
	}
	msg, err = runApp(t, "inspect", sh)
	if err != nil {
		t.Fatal(err)
	}
	for _, s := range []string{"shard", "rope layout: half (recorded in the manifest)", "layers.0.q", "×2 column"} {
		if !strings.Contains(msg, s) {
			t.Errorf("inspect of a shard dir lacks %q:\n%.600s", s, msg)
		}
	}
	want := pplOfPath(t, llamaMini, llamaMini)
	for _, tc := range []struct {
		name string
		args []string
		out  string
	}{
		{"convert-hf", []string{"convert", "--to", "hf", sh, "-o", filepath.Join(dir, "hf")}, "hf"},
		{"export-fp32", []string{"export", "-q", "--in", sh, "--fp32", filepath.Join(dir, "m.fp32")}, "m.fp32"},
		{"reshard", []string{"shard", "-q", "--tp", "1", sh, "-o", filepath.Join(dir, "sh1")}, "sh1"},
		{"convert-to-shard", []string{"convert", "--to", "shard", "--tp", "2", llamaMini, "-o", filepath.Join(dir, "sh2")}, "sh2"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			if msg, err := runApp(t, tc.args...); err != nil {
				t.Fatalf("%v\n%s", err, msg)
			}
			got := pplOfPath(t, filepath.Join(dir, tc.out), llamaMini)
			if d := (got - want) / want; d > 1e-5 || d < -1e-5 {
				t.Errorf("ppl %.6f, the source %.6f", got, want)
			}
		})
	}
	// An interleaved llama2.c file keeps its layout in the manifest.
	il := filepath.Join(dir, "il.fp32")
	if msg, err := runApp(t, "export", "-q", "--hf", llamaMini, "--fp32", il); err != nil {
		t.Fatalf("%v\n%s", err, msg)
	}
	shil := filepath.Join(dir, "shil")
	if msg, err := runApp(t, "shard", "-q", "--tp", "2", il, "-o", shil); err != nil {
		t.Fatalf("%v\n%s", err, msg)
	}
	if msg, _ := runApp(t, "inspect", shil); !strings.Contains(msg, "rope layout: interleaved (recorded in the manifest)") {
		t.Errorf("inspect of a shard dir of an interleaved file:\n%.300s", msg)
	}
	if got := pplOfPath(t, shil, llamaMini); (got-want)/want > 1e-5 || (want-got)/want > 1e-5 {
		t.Errorf("shard dir of an interleaved file: ppl %.6f, the source %.6f", got, want)
	}
	if _, err := runApp(t, "convert", "--to", "shard", llamaMini, "-o", filepath.Join(dir, "sh3")); err == nil || !strings.Contains(err.Error(), "--tp") {
		t.Errorf("convert --to shard without --tp: %v, want a message asking for --tp", err)
	}
}

// TestExportRopeDefaults: llama2.c's formats default to the interleaved
// layout llama2.c's run.c uses (it reads no sidecar), so the file scores the
// same with and without its sidecar; the layout is recorded in the sidecar
// and shown by inspect.
func TestExportRopeDefaults(t *testing.T) {
	dir := t.TempDir()
	want := pplOfPath(t, llamaMini, llamaMini)
	for _, tc := range []struct {
		flag, rope string
	}{
		{"--fp32", "interleaved"},
		{"--ak42-v1", "interleaved"},
		{"--ak42-v2", "interleaved"},
		{"--q8", "half"},
	} {
		t.Run(tc.flag, func(t *testing.T) {
			out := filepath.Join(dir, strings.TrimPrefix(tc.flag, "--"))
			if msg, err := runApp(t, "export", "-q", "--hf", llamaMini, tc.flag, out); err != nil {
				t.Fatalf("%v\n%s", err, msg)
			}
			msg, err := runApp(t, "inspect", out)
			if err != nil {
				t.Fatal(err)
			}
			if s := "rope layout: " + tc.rope + " (recorded in the sidecar)"; !strings.Contains(msg, s) {
				t.Errorf("inspect lacks %q:\n%.500s", s, msg)
			}
			if tc.rope != "interleaved" {
				return
			}
			// As llama2.c reads it: no sidecar, Llama defaults.
			m, err := kuiper.Open(out, kuiper.OpenOptions{NoSidecar: true})
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			got := pplOf(t, m, llamaMini)
			tol := 1e-5
			if tc.flag == "--ak42-v2" {
				tol = 2e-2 // Q8_0
			}
			if d := (got - want) / want; d > tol || d < -tol {
				t.Errorf("read without sidecar: ppl %.4f, the source %.4f", got, want)
			}
		})
	}
	// Without a sidecar the layout is an assumption, and inspect says so.
	out := filepath.Join(dir, "nosidecar.bin")
	if msg, err := runApp(t, "export", "-q", "--hf", llamaMini, "--fp32", out, "--no-sidecar"); err != nil {
		t.Fatalf("%v\n%s", err, msg)
	}
	if msg, _ := runApp(t, "inspect", out); !strings.Contains(msg, "rope layout: interleaved (assumed") {
		t.Errorf("inspect of a sidecar-less file:\n%.400s", msg)
	}
	// --q8 keeps the input's (half) layout, which only a sidecar can
	// record: without one it is written in the layout readers assume.
	q8 := filepath.Join(dir, "nosidecar.q8")
	if msg, err := runApp(t, "export", "-q", "--hf", llamaMini, "--q8", q8, "--no-sidecar"); err != nil {
		t.Fatalf("%v\n%s", err, msg)
	}
	withSide := pplOfPath(t, filepath.Join(dir, "q8"), llamaMini)
	if got := pplOfPath(t, q8, llamaMini); (got-withSide)/withSide > 1e-5 || (withSide-got)/withSide > 1e-5 {
		t.Errorf("--q8 --no-sidecar reads back with ppl %.4f, with its sidecar %.4f", got, withSide)
	}
	if _, err := runApp(t, "export", "-q", "--hf", llamaMini, "--q8", filepath.Join(dir, "x.q8"), "--no-sidecar", "--rope", "half"); err == nil ||
		!strings.Contains(err.Error(), "without a sidecar") {
		t.Errorf("--no-sidecar --rope half of a Llama: %v, want a refusal", err)
	}
}

// TestSidecarTokenizerRelative: the sidecar records the tokenizer directory
// relative to itself, so a model directory moved as a whole still finds
// its tokenizer (an absolute path of the writing machine used to break).
func TestSidecarTokenizerRelative(t *testing.T) {
	dir := t.TempDir()
	a := filepath.Join(dir, "a")
	if err := os.Mkdir(a, 0o755); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"config.json", "model.safetensors", "tokenizer.model", "tokenizer_config.json"} {
		data, err := os.ReadFile(filepath.Join(llamaMini, f))
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(filepath.Join(a, f), data, 0o644); err != nil {
			t.Fatal(err)
		}
	}
	if msg, err := runApp(t, "export", "-q", "--hf", a, "--fp32", filepath.Join(a, "m.bin")); err != nil {
		t.Fatalf("%v\n%s", err, msg)
	}
	data, err := os.ReadFile(filepath.Join(a, "m.bin.json"))
	if err != nil {
		t.Fatal(err)
	}
	var side kuiper.Sidecar
	if err := json.Unmarshal(data, &side); err != nil {
		t.Fatal(err)
	}
	if side.TokenizerDir != "." {
		t.Errorf("sidecar tokenizer_dir %q, want \".\" (relative to the sidecar)", side.TokenizerDir)
	}
	b := filepath.Join(dir, "b")
	if err := os.Rename(a, b); err != nil {
		t.Fatal(err)
	}
	m, err := convert.Open(filepath.Join(b, "m.bin"))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if m.TokenizerDir != b {
		t.Errorf("tokenizer dir after the move %q, want %q", m.TokenizerDir, b)
	}
	// A tokenizer outside the sidecar's directory stays absolute: a path
	// climbing out would break when the file moves alone.
	if err := os.Mkdir(filepath.Join(dir, "other"), 0o755); err != nil {
		t.Fatal(err)
	}
	far := filepath.Join(dir, "other", "far.bin")
	if msg, err := runApp(t, "export", "-q", "--hf", b, "--fp32", far); err != nil {
		t.Fatalf("%v\n%s", err, msg)
	}
	if s, err := kuiper.ReadSidecar(far); err != nil || s.TokenizerDir != b {
		t.Errorf("sidecar of %s: tokenizer_dir %q (%v), want %q", far, s.TokenizerDir, err, b)
	}
	// An absolute path (older sidecars) is still read as it is.
	side.TokenizerDir = llamaMini + "-abs"
	if abs, err := filepath.Abs(llamaMini); err == nil {
		side.TokenizerDir = abs
	}
	if got := side.Tokenizer(filepath.Join(b, "m.bin")); got != side.TokenizerDir {
		t.Errorf("absolute tokenizer_dir resolved to %q", got)
	}
}

// TestQtoolOnlyFiles: files that their own engines would not run as the
// model — ak47/ak48 of a Qwen3 shape OrinMLLM cannot read (qwen3-mini: 8
// heads × 64 ≠ 256), a Qwen3 model in a Llama layout (its q/k norms in
// qtool's extension, which Kuiper and llama2.c skip) — are refused unless
// --qtool-only by export, convert and the quantizers (before they
// calibrate), and inspect says what they are.
func TestQtoolOnlyFiles(t *testing.T) {
	dir := t.TempDir()
	qwen := "../../testdata/qwen3-mini"
	for _, tc := range []struct {
		name, flag, format, want string
	}{
		{"orin shape", "--ak47", "ak47", "OrinMLLM cannot read this shape"},
		{"q/k norms in a llama layout", "--q8", "kuiper-int8", "its layout has no place for the q/k norms"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			out := filepath.Join(dir, tc.format+".bin")
			refused := [][]string{
				{"export", "-q", "--hf", qwen, tc.flag, out},
				{"convert", "--to", tc.format, qwen, "-o", out},
			}
			if tc.format == "kuiper-int8" {
				refused = append(refused,
					[]string{"quantize", "-q", "--hf", qwen, "--bits", "8", "--sym", "--group", "64", "--format", "kuiper-int8", "-o", out},
					[]string{"gptq", "-q", "--hf", qwen, "--calib", calibHead, "--bits", "8", "--sym", "--group", "64", "--format", "ak42-v2", "-o", out})
			}
			for _, args := range refused {
				msg, err := runApp(t, args...)
				if err == nil || !strings.Contains(err.Error(), "--qtool-only") {
					t.Errorf("%v: %v, want a refusal naming --qtool-only\n%.300s", args, err, msg)
				}
				if _, err := os.Stat(out); err == nil {
					t.Fatalf("%v: a refused write left its output", args)
				}
			}
			if msg, err := runApp(t, "export", "-q", "--hf", qwen, tc.flag, out, "--qtool-only"); err != nil {
				t.Fatalf("%v\n%s", err, msg)
			}
			msg, err := runApp(t, "inspect", out)
			if err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(msg, "note: a qtool-only file: "+tc.want) {
				t.Errorf("inspect lacks the qtool-only note %q:\n%.800s", tc.want, msg)
			}
		})
	}
}

// TestExportNotesRTNOfFloatLinears: an AutoAWQ checkpoint that keeps a
// linear in float (modules_to_not_convert) exported to ak48 has that linear
// RTN-quantized; export says so.
func TestExportNotesRTNOfFloatLinears(t *testing.T) {
	dir := t.TempDir()
	src, err := convert.Open("../../testdata/qwen3-mini")
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	q, err := quantize.QuantizeModel(src, quantize.Options{Params: quantize.Int4Asym(128)})
	if err != nil {
		t.Fatal(err)
	}
	down := model.Name(0, model.Down)
	orig, _ := src.Lookup(down)
	q.Set(down, orig)
	awqDir := filepath.Join(dir, "awq")
	if err := convert.Save(q, "autoawq", awqDir); err != nil {
		t.Fatal(err)
	}
	msg, err := runApp(t, "export", "-q", "--hf", awqDir, "--ak48", filepath.Join(dir, "q.ak48"), "--qtool-only")
	if err != nil {
		t.Fatalf("%v\n%s", err, msg)
	}
	if !strings.Contains(msg, "note: ak48") || !strings.Contains(msg, "RTN-quantized ("+down+")") {
		t.Errorf("export output lacks the RTN note for %s:\n%s", down, msg)
	}
}
