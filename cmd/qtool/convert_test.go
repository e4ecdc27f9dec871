package main

import (
	"bytes"
	"path/filepath"
	"strings"
	"testing"

	"github.com/urfave/cli/v2"

	"qtool/convert"
	"qtool/formats/kuiper"
	"qtool/formats/model"
	"qtool/quantize"
)

// convertApp is newApp with the convert command (registered here too until
// main.go lists it).
func convertApp() *cli.App {
	app := newApp()
	for _, c := range app.Commands {
		if c.Name == "convert" {
			return app
		}
	}
	app.Commands = append(app.Commands, convertCommand())
	return app
}

func runConvertApp(t *testing.T, args ...string) (string, error) {
	t.Helper()
	app := convertApp()
	var out bytes.Buffer
	app.Writer, app.ErrWriter = &out, &out
	err := app.Run(append([]string{"qtool"}, args...))
	return out.String(), err
}

// writeQwenAWQ writes qwen3-mini RTN-quantized 4-bit asymmetric with group
// size 64 (not ak48's default 128) as an AutoAWQ checkpoint.
func writeQwenAWQ(t *testing.T, dir string) string {
	t.Helper()
	src, err := convert.Open("../../testdata/qwen3-mini")
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	q, err := quantize.QuantizeModel(src, quantize.Options{Params: quantize.Int4Asym(64)})
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(dir, "qwen3-awq")
	if err := convert.Save(q, "autoawq", out); err != nil {
		t.Fatal(err)
	}
	return out
}

// sameCodes checks that every quantized tensor of want is in got with the
// same codes, scales and zero points.
func sameCodes(t *testing.T, got, want *model.Model) {
	t.Helper()
	n := 0
	for _, name := range want.Names() {
		wt, _ := want.Lookup(name)
		wq, ok := wt.(*model.Quantized)
		if !ok {
			continue
		}
		gt, _ := got.Lookup(name)
		gq, ok := gt.(*model.Quantized)
		if !ok {
			t.Errorf("%s: read back as %T, want *model.Quantized", name, gt)
			continue
		}
		n++
		a, _ := wq.Float32()
		b, _ := gq.Float32()
		if gq.Bits != wq.Bits || gq.GroupSize != wq.GroupSize || len(a) != len(b) {
			t.Errorf("%s: %d-bit group %d, want %d-bit group %d", name, gq.Bits, gq.GroupSize, wq.Bits, wq.GroupSize)
			continue
		}
		for i := range a {
			if a[i] != b[i] {
				t.Errorf("%s[%d] = %g, want %g (re-quantized?)", name, i, b[i], a[i])
				break
			}
		}
	}
	if n != 28 {
		t.Errorf("compared %d quantized linears, want 28", n)
	}
}

// TestExportV5FromAWQ is the seed 002 flow: an AutoAWQ Qwen3 checkpoint
// exported with --hf DIR --v5 OUT keeps its codes and group size.
func TestExportV5FromAWQ(t *testing.T) {
	dir := t.TempDir()
	awqDir := writeQwenAWQ(t, dir)
	out := filepath.Join(dir, "qwen3.ak48")
	if msg, err := runConvertApp(t, "export", "--quiet", "--hf", awqDir, "--v5", out, "--qtool-only"); err != nil {
		t.Fatalf("export: %v\n%s", err, msg)
	}
	in, err := convert.Open(awqDir)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	got, err := kuiper.Open(out, kuiper.OpenOptions{})
	if err != nil {
		t.Fatal(err)
	}
	defer got.Close()
	if got.Format != string(kuiper.AK48) {
		t.Errorf("format %q, want %q", got.Format, kuiper.AK48)
	}
	sameCodes(t, got, in)

	// An 8-bit model cannot become ak48 or AutoAWQ: export refuses and says
	// which formats can hold it.
	msm := filepath.Join(dir, "w8")
	if _, err := runConvertApp(t, "convert", "--to", "gptq", awqDir, "-o", filepath.Join(dir, "g4")); err != nil {
		t.Fatal(err)
	}
	if _, err := runConvertApp(t, "export", "--quiet", "--in", filepath.Join(dir, "g4"), "--q8", msm); err == nil ||
		!strings.Contains(err.Error(), "without re-quantizing") || !strings.Contains(err.Error(), "formats that can: hf, autoawq, gptq, msmodelslim") {
		t.Errorf("export --q8 of a 4-bit model: %v, want a refusal naming the formats that can", err)
	}
}

func TestConvertCommand(t *testing.T) {
	dir := t.TempDir()
	awqDir := writeQwenAWQ(t, dir)
	in, err := convert.Open(awqDir)
	if err != nil {
		t.Fatal(err)
	}
	defer in.Close()
	tests := []struct {
		name string
		args []string
		want []string // substrings of the output, or of the error when fail
		fail bool
	}{
		{"to-msmodelslim", []string{"convert", "--to", "msmodelslim", awqDir, "-o", filepath.Join(dir, "w4a16")}, []string{"wrote", "msmodelslim", "from autoawq"}, false},
		{"flags-first", []string{"convert", "--to", "kuiper-v5", "--qtool-only", "-o", filepath.Join(dir, "q.ak48"), awqDir}, []string{"(ak48, from autoawq"}, false},
		{"ak48-orin-shape", []string{"convert", "--to", "ak48", awqDir, "-o", filepath.Join(dir, "orin.ak48")}, []string{"OrinMLLM cannot read this shape", "--qtool-only"}, true},
		{"out-equals", []string{"convert", awqDir, "--to=gptq", "--out=" + filepath.Join(dir, "gptq")}, []string{"gptq"}, false},
		{"list", []string{"convert", "--list", awqDir}, []string{"hf, autoawq, gptq, msmodelslim, kuiper-fp32, ak42-v1, ak47, ak48"}, false},
		{"refuse-int8", []string{"convert", "--to", "q8", awqDir, "-o", filepath.Join(dir, "x")}, []string{"cannot hold", "would re-quantize", "formats that can"}, true},
		{"unknown-format", []string{"convert", "--to", "gguf", awqDir, "-o", filepath.Join(dir, "y")}, []string{"unknown format \"gguf\""}, true},
		{"no-model", []string{"convert", "--to", "hf", "-o", filepath.Join(dir, "z")}, []string{"exactly one MODEL"}, true},
		{"no-out", []string{"convert", "--to", "hf", awqDir}, []string{"-o OUT"}, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			msg, err := runConvertApp(t, tc.args...)
			if tc.fail != (err != nil) {
				t.Fatalf("err = %v, want failure %v; output %s", err, tc.fail, msg)
			}
			if err != nil {
				msg = err.Error()
			}
			for _, s := range tc.want {
				if !strings.Contains(msg, s) {
					t.Errorf("%q lacks %q", msg, s)
				}
			}
		})
	}
	for _, out := range []string{"w4a16", "q.ak48", "gptq"} {
		got, err := convert.Open(filepath.Join(dir, out))
		if err != nil {
			t.Fatal(err)
		}
		sameCodes(t, got, in)
		got.Close()
	}
}
