// Package report builds qtool's quality report: one self-contained HTML
// file (inline CSS and SVG, no network) comparing quantized models of one
// base — size and bits per weight, perplexity and KL divergence from the
// float model (`qtool verify --kld --json`), the per-token KLD histogram,
// and the per-layer and per-module errors the quantizers record
// (calib.RunReport: loss, relative output error, clip and scale notes).
// Everything it shows comes from those JSON files, so a report can be
// rebuilt at any time without the models.
package report

import (
	"bytes"
	"encoding/json"
	"fmt"
	"html/template"
	"io"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"time"

	"qtool/formats/infile"
	"qtool/quantize/calib"
	"qtool/runtime/kld"
)

// KLDSuffix is the name `qtool report MODEL` looks for beside MODEL for its
// `verify --kld --json` output (MODEL.kld.json).
const KLDSuffix = ".kld.json"

// Entry is one quantized model: what its quantizer recorded and its KLD
// run against the base, either of which may be missing.
type Entry struct {
	Label string           `json:"label"`
	Quant *calib.RunReport `json:"quant,omitempty"`
	KLD   *kld.Run         `json:"kld,omitempty"`
}

// path is the model the entry describes.
func (e *Entry) path() string {
	if e.Quant != nil {
		return filepath.Clean(e.Quant.Out)
	}
	return filepath.Clean(e.KLD.Model)
}

// Load reads the inputs in order: JSON files (a quantizer's record or
// --json summary, a `verify --kld --json` result) and model paths (whose
// MODEL.quant.json and MODEL.kld.json are read). A KLD run joins the entry
// of the quantizer record whose output it measured (same path, else same
// base name).
func Load(paths []string) ([]Entry, error) {
	var entries []*Entry
	var runs []*kld.Run
	add := func(p string) error {
		b, err := infile.ReadFile(p, infile.MetaLimit)
		if err != nil {
			return fmt.Errorf("report: %w", err)
		}
		var keys map[string]json.RawMessage
		if err := json.Unmarshal(b, &keys); err != nil {
			return fmt.Errorf("report: %s: not JSON (want a quantizer record or `qtool verify --kld --json` output): %w", p, err)
		}
		switch {
		case keys["kld"] != nil:
			var r kld.Run
			if err := json.Unmarshal(b, &r); err != nil {
				return fmt.Errorf("report: %s: %w", p, err)
			}
			if r.Model == "" || r.Count == 0 {
				return fmt.Errorf("report: %s: a KLD result without \"model\" or scored tokens", p)
			}
			runs = append(runs, &r)
		case keys["method"] != nil && keys["out"] != nil:
			q, err := calib.ReadReport(p)
			if err != nil {
				return fmt.Errorf("report: %w", err)
			}
			entries = append(entries, &Entry{Quant: &q})
		default:
			return fmt.Errorf("report: %s is neither a quantizer record (\"method\", \"out\", \"modules\") nor a `qtool verify --kld --json` result (\"kld\")", p)
		}
		return nil
	}
	for _, p := range paths {
		if strings.HasSuffix(p, ".json") {
			if err := add(p); err != nil {
				return nil, err
			}
			continue
		}
		found := false
		for _, side := range []string{calib.ReportPath(p), filepath.Clean(p) + KLDSuffix} {
			if _, err := os.Stat(side); err == nil {
				if err := add(side); err != nil {
					return nil, err
				}
				found = true
			}
		}
		if !found {
			return nil, fmt.Errorf("report: %s: found neither %s (written by the quantizer) nor %s (`qtool verify --kld BASE --json %s > %s`)",
				p, calib.ReportPath(p), filepath.Clean(p)+KLDSuffix, p, filepath.Clean(p)+KLDSuffix)
		}
	}
	for _, r := range runs {
		e := match(entries, filepath.Clean(r.Model))
		if e == nil {
			e = &Entry{}
			entries = append(entries, e)
		}
		if e.KLD != nil {
			return nil, fmt.Errorf("report: two KLD results for %s", r.Model)
		}
		e.KLD = r
	}
	if len(entries) == 0 {
		return nil, fmt.Errorf("report: nothing to report")
	}
	out := make([]Entry, len(entries))
	for i, e := range entries {
		e.Label = filepath.Base(e.path())
		out[i] = *e
	}
	return out, checkBase(out)
}

// match finds the entry without a KLD run for model: same path, else the
// only one with the same base name.
func match(entries []*Entry, model string) *Entry {
	var byName []*Entry
	for _, e := range entries {
		if e.KLD != nil || e.Quant == nil {
			continue
		}
		if e.path() == model {
			return e
		}
		if filepath.Base(e.path()) == filepath.Base(model) {
			byName = append(byName, e)
		}
	}
	if len(byName) == 1 {
		return byName[0]
	}
	return nil
}

// checkBase refuses models quantized from different bases, or KLD runs
// over different texts or chunks (their numbers would not compare).
func checkBase(es []Entry) error {
	var base, text string
	for _, e := range es {
		if e.Quant != nil {
			b := filepath.Base(filepath.Clean(e.Quant.Model))
			if base != "" && b != base {
				return fmt.Errorf("report: %s was quantized from %s, another model from %s: one report is for one base", e.Label, e.Quant.Model, base)
			}
			base = b
		}
		if e.KLD != nil {
			t := fmt.Sprintf("%s, %d chunks × %d, %s protocol", filepath.Base(e.KLD.Text), e.KLD.Chunks, e.KLD.Ctx, e.KLD.Protocol)
			if text != "" && t != text {
				return fmt.Errorf("report: the KLD of %s was measured on %s, another on %s: measure them on the same text and chunks", e.Label, t, text)
			}
			text = t
		}
	}
	return nil
}

// Options controls Write.
type Options struct {
	Title     string
	Generated time.Time
}

// Write renders the report of entries as one HTML page.
func Write(w io.Writer, entries []Entry, opt Options) error {
	d := page{Title: opt.Title, Generated: opt.Generated.UTC().Format("2006-01-02 15:04 UTC"), Entries: entries}
	if d.Title == "" {
		d.Title = "qtool quantization report"
	}
	for _, e := range entries {
		if e.Quant != nil && d.Base == "" {
			d.Base = e.Quant.Model
		}
		if e.KLD != nil && d.Text == "" {
			k := e.KLD
			d.Text = fmt.Sprintf("%s: %d chunks × %d tokens (%d scored, %s protocol), base %s", filepath.Base(k.Text), k.Chunks, k.Ctx, k.Count, k.Protocol, k.Base)
			if d.Base == "" {
				d.Base = k.Base
			}
		}
	}
	d.Charts = charts(entries)
	var b bytes.Buffer
	if err := pageTmpl.Execute(&b, d); err != nil {
		return err
	}
	_, err := w.Write(b.Bytes())
	return err
}

type page struct {
	Title, Generated, Base, Text string
	Entries                      []Entry
	Charts                       []template.HTML
}

func labels(es []Entry) []string {
	l := make([]string, len(es))
	for i, e := range es {
		l[i] = e.Label
	}
	return l
}

// charts builds the SVG charts of the page.
func charts(es []Entry) []template.HTML {
	var out []template.HTML
	add := func(c Chart) { out = append(out, template.HTML(c.SVG())) }
	nan := math.NaN()
	kldVals, kldErr, ppl, same := make([]float64, len(es)), make([]float64, len(es)), make([]float64, len(es)), make([]float64, len(es))
	basePPL := 0.0
	for i, e := range es {
		kldVals[i], ppl[i], same[i] = nan, nan, nan
		if k := e.KLD; k != nil {
			kldVals[i], kldErr[i], ppl[i], same[i] = k.KLD.Value, k.KLD.Unc, k.PPL.Value, 100*k.SameTop.Value
			basePPL = k.PPLBase.Value
		} else if q := e.Quant; q != nil && q.Verify != nil {
			ppl[i] = q.Verify.PPL
		}
	}
	add(Chart{ID: "chart-kld", Title: "Mean KL divergence from the base (± uncertainty)", YLabel: "mean KLD (nats)", X: labels(es),
		Series: []Series{{Name: "mean KLD", Values: kldVals, Errs: kldErr}}, Width: 480, Height: 300})
	add(Chart{ID: "chart-ppl", Title: "Perplexity", YLabel: "ppl", X: labels(es),
		Series: []Series{{Name: "ppl", Values: ppl}}, RefY: basePPL, RefLabel: "base " + Short(basePPL), NoZero: true, Width: 480, Height: 300})
	add(Chart{ID: "chart-top", Title: "Top-1 agreement with the base", YLabel: "same top token (%)", X: labels(es),
		Series: []Series{{Name: "same top %", Values: same}}, NoZero: true, Width: 480, Height: 300})

	// per-token KLD histogram: % of scored tokens per log-spaced bin
	var hx []string
	var hs []Series
	for _, e := range es {
		if e.KLD == nil || len(e.KLD.KLDHistogram.Counts) == 0 {
			continue
		}
		h := e.KLD.KLDHistogram
		if hx == nil {
			hx = append(hx, "<"+Short(h.Edges[0]))
			for _, ed := range h.Edges[:len(h.Edges)-1] {
				hx = append(hx, Short(ed))
			}
			hx = append(hx, "≥"+Short(h.Edges[len(h.Edges)-1]))
		}
		n := float64(e.KLD.Count)
		v := []float64{100 * float64(h.Under) / n}
		for _, c := range h.Counts {
			v = append(v, 100*float64(c)/n)
		}
		v = append(v, 100*float64(h.Over)/n)
		hs = append(hs, Series{Name: e.Label, Values: v})
	}
	add(Chart{ID: "chart-hist", Title: "Per-token KL divergence (log-spaced bins, lower edge shown)", YLabel: "% of scored tokens",
		X: hx, Series: hs, Lines: true, Width: 980, Height: 320, XEvery: 2})

	// per-layer mean and per-module relative output error, per-module loss
	layers := 0
	var mods []string
	for _, e := range es {
		if e.Quant == nil {
			continue
		}
		for _, m := range e.Quant.Modules {
			layers = max(layers, m.Layer+1)
			if k := modKey(m); !slices.Contains(mods, k) {
				mods = append(mods, k)
			}
		}
	}
	var lx []string
	for l := 0; l < layers; l++ {
		lx = append(lx, fmt.Sprintf("layer %d", l))
	}
	var ls, ms, lossS []Series
	for _, e := range es {
		if e.Quant == nil || len(e.Quant.Modules) == 0 {
			continue
		}
		sum, cnt := make([]float64, layers), make([]float64, layers)
		mv, lv := make([]float64, len(mods)), make([]float64, len(mods))
		for i := range mv {
			mv[i], lv[i] = nan, nan
		}
		for _, m := range e.Quant.Modules {
			if m.RelErr > 0 && m.Layer >= 0 {
				sum[m.Layer] += m.RelErr
				cnt[m.Layer]++
			}
			i := slices.Index(mods, modKey(m))
			mv[i], lv[i] = m.RelErr, m.Loss
		}
		for l := range sum {
			if cnt[l] > 0 {
				sum[l] /= cnt[l]
			} else {
				sum[l] = nan
			}
		}
		ls = append(ls, Series{Name: e.Label, Values: sum})
		ms = append(ms, Series{Name: e.Label, Values: mv})
		lossS = append(lossS, Series{Name: e.Label + " (" + e.Quant.Method + ")", Values: lv})
	}
	add(Chart{ID: "chart-layer", Title: "Relative output error per layer (mean over its modules, ‖X(W−Ŵ)ᵀ‖²/‖XWᵀ‖²)", YLabel: "rel. output error",
		X: lx, Series: ls, LogY: true, Width: 980, Height: 320})
	add(Chart{ID: "chart-module", Title: "Relative output error per module", YLabel: "rel. output error",
		X: mods, Series: ms, LogY: true, Lines: true, Width: 980, Height: 340})
	add(Chart{ID: "chart-loss", Title: "Quantizer loss per module (each method's own objective; see the tables)", YLabel: "loss",
		X: mods, Series: lossS, LogY: true, Lines: true, Width: 980, Height: 340})
	return out
}

func modKey(m calib.ModuleStat) string { return fmt.Sprintf("L%d %s", m.Layer, m.Role) }

var pageTmpl = template.Must(template.New("report").Funcs(template.FuncMap{
	"num":   Num,
	"f":     func(format string, v float64) string { return fmt.Sprintf(format, v) },
	"pct":   func(v float64) string { return fmt.Sprintf("%.2f", 100*v) },
	"mb":    func(b int64) string { return fmt.Sprintf("%.2f", float64(b)/1e6) },
	"base":  filepath.Base,
	"short": strings.NewReplacer("asymmetric", "asym", "symmetric", "sym", "group ", "g", " weights", "").Replace,
}).Parse(`<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8">
<title>{{.Title}}</title>
<style>
body{font:13px/1.4 -apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;margin:20px;color:#222;max-width:1320px}
h1{font-size:22px;margin:0 0 4px}h2{font-size:17px;margin:28px 0 8px;border-bottom:1px solid #ddd}
.wide{overflow-x:auto}#kld-stats{font-size:12px}table{border-collapse:collapse;margin:6px 0}td,th{padding:3px 6px;border-bottom:1px solid #eee;text-align:right;white-space:nowrap}
th{background:#f4f4f4}td.l,th.l{text-align:left}.meta{color:#555}
.charts{display:flex;flex-wrap:wrap;gap:8px}svg.chart{background:#fff;border:1px solid #e4e4e4}
svg .title{font-size:13px;font-weight:600}svg .tick{font-size:10px;fill:#444}svg .axis{font-size:11px}
svg .legend{font-size:11px}svg .val{font-size:10px;fill:#333}svg .grid{stroke:#eee}svg .axisline{stroke:#888}
svg .err{stroke:#333;stroke-width:1.2}svg .ref{stroke:#c00;stroke-dasharray:4 3}
details{margin:6px 0}summary{cursor:pointer;font-weight:600}#render-check{color:#999;font-size:11px}
</style></head><body>
<h1>{{.Title}}</h1>
<div class="meta">base <b>{{.Base}}</b>{{if .Text}} · KLD text {{.Text}}{{end}} · generated {{.Generated}} by qtool report</div>

<h2>Summary</h2>
<div class="wide"><table id="summary">
<tr><th class="l">model</th><th class="l">method</th><th class="l">scheme</th><th>size (MB)</th><th>bits/param</th><th>linear bits</th>
<th>ppl</th><th>ppl/base</th><th>mean KLD</th><th>same top %</th><th>RMS Δp %</th><th>quant time (s)</th></tr>
{{range .Entries}}<tr data-model="{{.Label}}">
<td class="l">{{.Label}}</td>
{{with .Quant}}<td class="l">{{.Method}}</td><td class="l" title="{{.Scheme}}">{{short .Scheme}}{{if .Format}} ({{.Format}}){{end}}</td>
<td>{{if .Bytes}}{{mb .Bytes}}{{end}}</td><td>{{if .BitsPerWeight}}{{f "%.3f" .BitsPerWeight}}{{end}}</td><td>{{if .LinearBits}}{{f "%.3f" .LinearBits}}{{end}}</td>{{else}}<td></td><td></td><td></td><td></td><td></td>{{end}}
{{with .KLD}}<td data-value="{{num .PPL.Value}}">{{f "%.4f" .PPL.Value}} ± {{f "%.4f" .PPL.Unc}}</td><td>{{f "%.5f" .Ratio.Value}} ± {{f "%.5f" .Ratio.Unc}}</td>
<td data-value="{{num .KLD.Value}}">{{f "%.6f" .KLD.Value}} ± {{f "%.6f" .KLD.Unc}}</td>
<td>{{pct .SameTop.Value}} ± {{pct .SameTop.Unc}}</td><td>{{pct .RMSDP.Value}}</td>
{{else}}<td>{{with .Quant}}{{with .Verify}}{{f "%.4f" .PPL}}{{end}}{{end}}</td><td></td><td></td><td></td><td></td>{{end}}
<td>{{with .Quant}}{{f "%.1f" .Seconds}}{{end}}</td></tr>
{{end}}</table></div>

<h2>Charts</h2>
<div class="charts">{{range .Charts}}{{.}}{{end}}</div>

<h2>KL divergence and token probability statistics</h2>
<p class="meta">As llama.cpp's <code>perplexity --kl-divergence</code>: mean ± standard error, percentiles over scored tokens; Δp is the probability of the correct token, model minus base.</p>
<div class="wide"><table id="kld-stats">
<tr><th class="l">model</th><th>mean KLD</th><th>max</th><th>99.9%</th><th>99%</th><th>95%</th><th>90%</th><th>median</th><th>10%</th><th>min</th>
<th>mean Δp %</th><th>max Δp %</th><th>99% Δp %</th><th>median Δp %</th><th>1% Δp %</th><th>min Δp %</th><th>ln(ppl/base)</th><th>tokens</th></tr>
{{range .Entries}}{{if .KLD}}{{with .KLD}}<tr>
<td class="l">{{base .Model}}</td><td>{{f "%.6f" .KLD.Value}}</td><td>{{f "%.6f" .KLDQ.Max}}</td><td>{{f "%.6f" .KLDQ.P99_9}}</td><td>{{f "%.6f" .KLDQ.P99}}</td>
<td>{{f "%.6f" .KLDQ.P95}}</td><td>{{f "%.6f" .KLDQ.P90}}</td><td>{{f "%.6f" .KLDQ.Median}}</td><td>{{f "%.6f" .KLDQ.P10}}</td><td>{{f "%.2e" .KLDQ.Min}}</td>
<td>{{pct .DeltaP.Value}} ± {{pct .DeltaP.Unc}}</td><td>{{pct .DeltaPQ.Max}}</td><td>{{pct .DeltaPQ.P99}}</td><td>{{pct .DeltaPQ.Median}}</td><td>{{pct .DeltaPQ.P1}}</td><td>{{pct .DeltaPQ.Min}}</td>
<td>{{f "%.5f" .LnRatio.Value}} ± {{f "%.5f" .LnRatio.Unc}}</td><td>{{.Count}}</td></tr>{{end}}{{end}}{{end}}
</table></div>

<h2>Per-module errors from the quantizers</h2>
{{range .Entries}}{{with .Quant}}<details{{if le (len .Modules) 64}} open{{end}}><summary>{{base .Out}} — {{.Method}}, {{.Scheme}}{{if .NSamples}}, calibration {{.NSamples}} × {{.SeqLen}} tokens{{end}}</summary>
{{if .Modules}}<table class="modules" data-model="{{base .Out}}"><tr><th>layer</th><th class="l">module</th><th>{{if .LossName}}{{.LossName}}{{else}}loss{{end}}</th><th>rel. output error</th><th>time (s)</th><th class="l">note (clip, scale, damping)</th></tr>
{{range .Modules}}<tr><td>{{.Layer}}</td><td class="l">{{.Role}}</td><td data-value="{{num .Loss}}">{{num .Loss}}</td><td data-value="{{num .RelErr}}">{{f "%.3e" .RelErr}}</td><td>{{f "%.2f" .Seconds}}</td><td class="l">{{.Note}}</td></tr>
{{end}}</table>{{else}}<p class="meta">no per-module record (round-to-nearest has no calibration)</p>{{end}}
</details>{{end}}{{end}}
<pre id="render-check"></pre>
<script>
// Render check for headless tests: every chart mark must have been laid out.
(function(){var r={charts:0,marks:0,empty:0,width:0};
document.querySelectorAll("svg.chart").forEach(function(s){r.charts++;var b=s.getBoundingClientRect();r.width=Math.max(r.width,Math.round(b.width));
s.querySelectorAll(".mark").forEach(function(m){r.marks++;var bb=m.getBBox();if(bb.width<=0&&bb.height<=0)r.empty++;});});
document.getElementById("render-check").textContent="render-check "+JSON.stringify(r);})();
</script>
</body></html>
`))
