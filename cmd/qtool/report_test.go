package main

import (
	"context"
	"encoding/json"
	"fmt"
	"image/png"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"qtool/convert"
	"qtool/quantize/calib"
	"qtool/quantize/report"
	"qtool/runtime/kld"
)

// buildReportInputs quantizes llama-mini with RTN, GPTQ and AWQ at 4 and 3
// bits (small calibration), writes each model's record with
// calib.WriteReport and its `verify --kld --json` result beside it, and
// returns the model paths.
func buildReportInputs(t *testing.T, dir string) []string {
	t.Helper()
	cache := filepath.Join(dir, "base.kld")
	runKLD(t, "--kld", llamaMini, "--kld-cache", cache, "--ppl", sotuText, "--max-chunks", "4", llamaMini)
	var models []string
	for _, bits := range []string{"4", "3"} {
		rtn := filepath.Join(dir, "rtn-w"+bits)
		start := time.Now()
		writeRTN(t, int(bits[0]-'0'), rtn)
		writeRecord(t, calib.RunReport{Method: "rtn", Model: llamaMini, Out: rtn, Format: convert.FormatGPTQ,
			Scheme: bits + "-bit asymmetric group 128 weights", Seconds: time.Since(start).Seconds()})
		models = append(models, rtn)
		for _, method := range []string{"gptq", "awq"} {
			out := filepath.Join(dir, method+"-w"+bits)
			args := []string{method, "--bits", bits, "--hf", llamaMini, "--calib", calibHead, "--nsamples", "8", "--seqlen", "256",
				"-o", out, "-q", "--json", "--threads", "2"}
			if method == "awq" {
				args = append(args, "--search-tokens", "512", "--format", "gptq")
			}
			msg, err := runQuantApp(args...)
			if err != nil {
				t.Fatalf("%v: %v\n%s", args, err, msg)
			}
			var r calib.RunReport
			if err := json.Unmarshal([]byte(msg), &r); err != nil {
				t.Fatalf("%s: %v", msg, err)
			}
			writeRecord(t, r)
			models = append(models, out)
		}
	}
	for _, m := range models {
		out, err := runQtool(t, "verify", "--device", "cpu", "--json", "--kld", cache, m)
		if err != nil {
			t.Fatal(err)
		}
		if err := os.WriteFile(m+report.KLDSuffix, []byte(out), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return models
}

// writeRecord does what the quantizer commands do after writing: record the
// run beside the output.
func writeRecord(t *testing.T, r calib.RunReport) {
	t.Helper()
	m, err := convert.Open(r.Out)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if err := calib.WriteReport(m, r); err != nil {
		t.Fatal(err)
	}
}

// TestReportBrowser builds the report of llama-mini's RTN, GPTQ and AWQ w4
// and w3 models and renders it in headless Chromium: every chart is laid out
// with no empty mark, the charts and tables carry the figures of the JSON
// inputs, and a screenshot is taken ($QTOOL_REPORT_PNG, default in the test's
// temporary directory). Runs only with QTOOL_BROWSER_TEST=1.
func TestReportBrowser(t *testing.T) {
	if os.Getenv("QTOOL_BROWSER_TEST") != "1" {
		t.Skip("set QTOOL_BROWSER_TEST=1 to render the report in headless Chromium")
	}
	browser := ""
	for _, b := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(b); err == nil {
			browser = p
			break
		}
	}
	if browser == "" {
		t.Skip("QTOOL_BROWSER_TEST=1 but no chromium on PATH (Debian: apt-get install chromium)")
	}
	dir := t.TempDir()
	models := buildReportInputs(t, dir)
	page := filepath.Join(dir, "report.html")
	if msg, err := runQtool(t, append([]string{"report", "-o", page, "--title", "llama-mini: RTN, GPTQ, AWQ at 4 and 3 bits"}, models...)...); err != nil {
		t.Fatalf("%v\n%s", err, msg)
	}
	html, err := os.ReadFile(page)
	if err != nil {
		t.Fatal(err)
	}
	for _, banned := range []string{"http://", "https://", "<link", "src="} {
		if i := strings.Index(string(html), banned); i >= 0 {
			t.Fatalf("the page refers to something outside itself: %q", html[max(0, i-40):min(len(html), i+40)])
		}
	}
	chrome := func(args ...string) string {
		ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
		defer cancel()
		cmd := exec.CommandContext(ctx, browser, append([]string{"--headless", "--no-sandbox", "--disable-gpu",
			"--disable-dev-shm-usage", "--hide-scrollbars", "--user-data-dir=" + filepath.Join(dir, "profile")}, args...)...)
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("%s %v: %v", browser, args, err)
		}
		return string(out)
	}
	dom := chrome("--virtual-time-budget=5000", "--dump-dom", "file://"+page)

	m := regexp.MustCompile(`render-check (\{.*?\})`).FindStringSubmatch(dom)
	if m == nil {
		t.Fatalf("the page's script did not run: no render check in the DOM")
	}
	var rc struct{ Charts, Marks, Empty, Width int }
	if err := json.Unmarshal([]byte(m[1]), &rc); err != nil {
		t.Fatal(err)
	}
	t.Logf("rendered: %s", m[1])
	if rc.Charts != 7 || rc.Marks < 100 || rc.Empty != 0 || rc.Width < 400 {
		t.Fatalf("render check %+v: want 7 charts, their marks laid out", rc)
	}

	// The charts carry the numbers of the JSON inputs.
	svg := func(id string) string {
		i := strings.Index(dom, `id="`+id+`"`)
		if i < 0 {
			t.Fatalf("no chart %s in the DOM", id)
		}
		return dom[i : i+strings.Index(dom[i:], "</svg>")]
	}
	mark := func(chart, series, x string, v float64) {
		t.Helper()
		want := fmt.Sprintf(`data-series="%s" data-x="%s" data-value="%s"`, series, x, report.Num(v))
		if !strings.Contains(svg(chart), want) {
			t.Errorf("chart %s has no mark %s", chart, want)
		}
	}
	checked := 0
	for _, path := range models {
		label := filepath.Base(path)
		var k kld.Run
		b, err := os.ReadFile(path + report.KLDSuffix)
		if err != nil {
			t.Fatal(err)
		}
		if err := json.Unmarshal(b, &k); err != nil {
			t.Fatal(err)
		}
		mark("chart-kld", "mean KLD", label, k.KLD.Value)
		mark("chart-ppl", "ppl", label, k.PPL.Value)
		mark("chart-top", "same top %", label, 100*k.SameTop.Value)
		for i, c := range k.KLDHistogram.Counts {
			if c > 0 {
				mark("chart-hist", label, report.Short(k.KLDHistogram.Edges[i]), 100*float64(c)/float64(k.Count))
			}
		}
		if !strings.Contains(dom, fmt.Sprintf("%.6f ± %.6f", k.KLD.Value, k.KLD.Unc)) {
			t.Errorf("%s: the summary table lacks mean KLD %.6f ± %.6f", label, k.KLD.Value, k.KLD.Unc)
		}
		r, err := calib.ReadReport(calib.ReportPath(path))
		if err != nil {
			t.Fatal(err)
		}
		if r.Bytes == 0 || r.BitsPerWeight <= 0 || !strings.Contains(dom, fmt.Sprintf("%.3f", r.BitsPerWeight)) ||
			!strings.Contains(dom, fmt.Sprintf("%.3f", r.LinearBits)) {
			t.Errorf("%s: size %d bytes, %.3f bits/param, %.3f linear bits not on the page", label, r.Bytes, r.BitsPerWeight, r.LinearBits)
		}
		for _, s := range r.Modules {
			mark("chart-module", label, fmt.Sprintf("L%d %s", s.Layer, s.Role), s.RelErr)
			checked++
		}
		t.Logf("%-8s %6.2f MB %.3f bits/param %.3f linear bits  ppl %.4f  KLD %.6f ± %.6f  same top %.2f %%  (%d modules)",
			label, float64(r.Bytes)/1e6, r.BitsPerWeight, r.LinearBits, k.PPL.Value, k.KLD.Value, k.KLD.Unc, 100*k.SameTop.Value, len(r.Modules))
	}
	if checked != 4*28 {
		t.Errorf("%d module marks checked, want 4 calibrated models × 28", checked)
	}

	shot := os.Getenv("QTOOL_REPORT_PNG")
	if shot == "" {
		shot = filepath.Join(dir, "report.png")
	}
	abs, err := filepath.Abs(shot)
	if err != nil {
		t.Fatal(err)
	}
	chrome("--virtual-time-budget=5000", "--window-size=1360,3400", "--screenshot="+abs, "file://"+page)
	f, err := os.Open(abs)
	if err != nil {
		t.Fatalf("no screenshot: %v", err)
	}
	defer f.Close()
	img, err := png.Decode(f)
	if err != nil {
		t.Fatal(err)
	}
	colors := map[[3]uint32]bool{}
	bnd := img.Bounds()
	for y := bnd.Min.Y; y < bnd.Max.Y; y += 7 {
		for x := bnd.Min.X; x < bnd.Max.X; x += 7 {
			r, g, b, _ := img.At(x, y).RGBA()
			colors[[3]uint32{r >> 8, g >> 8, b >> 8}] = true
		}
	}
	if len(colors) < 20 {
		t.Fatalf("screenshot %s looks blank (%d colours)", abs, len(colors))
	}
	t.Logf("screenshot %s (%dx%d, %d colours sampled)", abs, bnd.Dx(), bnd.Dy(), len(colors))
}
