package report

import (
	"bytes"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"qtool/quantize/calib"
	"qtool/runtime/kld"
)

func writeJSON(t *testing.T, path string, v any) string {
	t.Helper()
	b, err := json.Marshal(v)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(path, b, 0o644); err != nil {
		t.Fatal(err)
	}
	return path
}

func kldRun(model, text string, meanKLD float64) kld.Run {
	var acc kld.Accumulator
	for i := 0; i < 20; i++ {
		acc.Add(kld.Token{KLD: meanKLD * float64(i%3), NLL: 3 + 0.01*float64(i), NLLBase: 3, SameTop: i%4 != 0})
	}
	return kld.Run{Model: model, Base: "base.kld", Text: text, Chunks: 1, Ctx: 21, Protocol: "gptq", Result: kld.Result{Stats: acc.Stats()}}
}

// TestLoad checks how inputs are read and joined, and the refusals.
func TestLoad(t *testing.T) {
	dir := t.TempDir()
	g4 := filepath.Join(dir, "g4")
	if err := os.Mkdir(g4, 0o755); err != nil {
		t.Fatal(err)
	}
	q := calib.RunReport{Method: "gptq", Model: "models/llama", Out: g4, Scheme: "4-bit", Seconds: 1,
		Modules: []calib.ModuleStat{{Layer: 0, Role: "q", Loss: 0.5, RelErr: 1e-3, Note: "damp 0.01"}}}
	writeJSON(t, calib.ReportPath(g4), q)
	writeJSON(t, g4+KLDSuffix, kldRun(g4, "sotu.raw", 0.02))
	summary := writeJSON(t, filepath.Join(dir, "a4-summary.json"), calib.RunReport{Method: "awq", Model: "other/llama", Out: "elsewhere/a4", Modules: []calib.ModuleStat{}})
	a4kld := writeJSON(t, filepath.Join(dir, "a4-kld.json"), kldRun("a4", "sotu.raw", 0.03))
	otherBase := writeJSON(t, filepath.Join(dir, "x.json"), calib.RunReport{Method: "awq", Model: "models/qwen", Out: "x"})
	otherText := writeJSON(t, filepath.Join(dir, "y.json"), kldRun("y", "moby.raw", 0.03))
	junk := writeJSON(t, filepath.Join(dir, "junk.json"), map[string]int{"a": 1})

	es, err := Load([]string{g4, summary, a4kld})
	if err != nil {
		t.Fatal(err)
	}
	if len(es) != 2 || es[0].Label != "g4" || es[0].Quant == nil || es[0].KLD == nil || es[1].Label != "a4" || es[1].KLD == nil || es[1].Quant == nil {
		t.Fatalf("entries %+v", es)
	}
	cases := []struct {
		name string
		in   []string
		want string
	}{
		{"two bases", []string{g4, otherBase}, "one report is for one base"},
		{"two texts", []string{g4, otherText}, "measure them on the same text"},
		{"not a report", []string{junk}, "neither a quantizer record"},
		{"no sidecar", []string{dir}, "found neither"},
		{"missing file", []string{filepath.Join(dir, "none.json")}, "no such file"},
		{"nothing", nil, "nothing to report"},
	}
	for _, tc := range cases {
		if _, err := Load(tc.in); err == nil || !strings.Contains(err.Error(), tc.want) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.want)
		}
	}

	var b bytes.Buffer
	if err := Write(&b, es, Options{Generated: time.Unix(0, 0)}); err != nil {
		t.Fatal(err)
	}
	page := b.String()
	for _, want := range []string{
		`data-series="mean KLD" data-x="g4" data-value="` + Num(es[0].KLD.KLD.Value) + `"`,
		`data-series="g4" data-x="L0 q" data-value="0.001"`,
		"damp 0.01", `id="chart-hist"`, "render-check",
	} {
		if !strings.Contains(page, want) {
			t.Errorf("page lacks %s", want)
		}
	}
	if strings.Contains(page, "http://") || strings.Contains(page, "https://") {
		t.Errorf("page refers to the network")
	}
}

// TestChartSVG checks the chart axes and marks.
func TestChartSVG(t *testing.T) {
	cases := []struct {
		name  string
		c     Chart
		want  []string
		marks int
	}{
		{"bars", Chart{ID: "b", X: []string{"a", "b"}, Series: []Series{{Name: "s", Values: []float64{1.5, 2}, Errs: []float64{0.1, 0}}}},
			[]string{`data-x="a" data-value="1.5"`, `class="err"`}, 2},
		{"log lines skip <= 0 and NaN", Chart{ID: "l", LogY: true, Lines: true, X: []string{"a", "b", "c"},
			Series: []Series{{Name: "s", Values: []float64{1e-3, 0, math.NaN()}}}}, []string{`data-value="0.001"`, ">0.001<", ">0.01<"}, 1},
		{"no data", Chart{ID: "n", X: []string{"a"}, Series: []Series{{Name: "s", Values: []float64{math.NaN()}}}}, []string{"no data"}, 0},
		{"reference line", Chart{ID: "r", NoZero: true, RefY: 54.2, X: []string{"a"}, Series: []Series{{Name: "s", Values: []float64{55}}}},
			[]string{`class="ref"`, `data-value="54.2"`}, 1},
	}
	for _, tc := range cases {
		s := tc.c.SVG()
		for _, w := range tc.want {
			if !strings.Contains(s, w) {
				t.Errorf("%s: no %s in %s", tc.name, w, s)
			}
		}
		if n := strings.Count(s, `class="mark"`); n != tc.marks {
			t.Errorf("%s: %d marks, want %d", tc.name, n, tc.marks)
		}
	}
}
