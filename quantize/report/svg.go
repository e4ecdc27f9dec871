package report

import (
	"fmt"
	"html"
	"math"
	"strconv"
	"strings"
)

// The charts are hand-written SVG rather than gonum.org/v1/plot output:
// every mark carries its series, category and value as data-* attributes
// and a <title> tooltip, so the page can be checked against the JSON it was
// built from (a browser's DOM dump) and read without the JSON; the four
// chart kinds needed (bars, grouped bars, lines, histograms as steps) fit in
// this file, and no module with fonts and image codecs is added to the
// build.

// palette holds the series colours (colour-blind safe, Okabe–Ito).
var palette = []string{"#0072B2", "#E69F00", "#009E73", "#CC79A7", "#56B4E9", "#D55E00", "#F0E442", "#000000"}

// Series is one named row of values, one per category (NaN: none).
type Series struct {
	Name   string
	Values []float64
	Errs   []float64 // ± error bars (optional)
}

// Chart is a bar or line chart over categories.
type Chart struct {
	ID, Title, YLabel string
	X                 []string // category labels
	Series            []Series
	Lines             bool    // lines instead of grouped bars
	LogY              bool    // log10 y axis (values <= 0 are left out)
	NoZero            bool    // linear axis fitted to the values, not from 0
	RefY              float64 // a dashed reference line (0: none)
	RefLabel          string
	Width, Height     int
	XEvery            int // label every n-th category (0: all)
}

// Num formats a value as the charts' data-value attributes do: 6
// significant digits.
func Num(v float64) string { return strconv.FormatFloat(v, 'g', 6, 64) }

// Short formats a value for labels: 4 significant digits.
func Short(v float64) string { return strconv.FormatFloat(v, 'g', 4, 64) }

// SVG renders the chart.
func (c Chart) SVG() string {
	w, h := c.Width, c.Height
	if w == 0 {
		w = 720
	}
	if h == 0 {
		h = 300
	}
	const left, right, top, bottom = 70, 150, 30, 60
	pw, ph := float64(w-left-right), float64(h-top-bottom)
	lo, hi := math.Inf(1), math.Inf(-1)
	for _, s := range c.Series {
		for i, v := range s.Values {
			if math.IsNaN(v) || (c.LogY && v <= 0) {
				continue
			}
			e := 0.0
			if i < len(s.Errs) {
				e = s.Errs[i]
			}
			lo, hi = math.Min(lo, v-e), math.Max(hi, v+e)
		}
	}
	if c.RefY != 0 {
		lo, hi = math.Min(lo, c.RefY), math.Max(hi, c.RefY)
	}
	var b strings.Builder
	fmt.Fprintf(&b, `<svg class="chart" id="%s" width="%d" height="%d" viewBox="0 0 %d %d" role="img" aria-label="%s">`,
		c.ID, w, h, w, h, html.EscapeString(c.Title))
	fmt.Fprintf(&b, `<text x="%d" y="18" class="title">%s</text>`, left, html.EscapeString(c.Title))
	if math.IsInf(lo, 0) {
		fmt.Fprintf(&b, `<text x="%d" y="%d" class="empty">no data</text></svg>`, left, top+int(ph/2))
		return b.String()
	}
	var ticks []float64
	var y func(v float64) float64
	if c.LogY {
		l0, l1 := math.Floor(math.Log10(lo)), math.Ceil(math.Log10(hi))
		if l1 == l0 {
			l1++
		}
		y = func(v float64) float64 { return top + ph*(1-(math.Log10(v)-l0)/(l1-l0)) }
		for e := l0; e <= l1; e++ {
			ticks = append(ticks, math.Pow(10, e))
		}
	} else {
		if c.NoZero {
			pad := 0.15 * math.Max(hi-lo, 1e-9*math.Abs(hi))
			lo, hi = lo-pad, hi+pad/2
		} else {
			lo = math.Min(lo, 0)
		}
		ticks = niceTicks(lo, hi)
		lo, hi = ticks[0], ticks[len(ticks)-1]
		y = func(v float64) float64 { return top + ph*(1-(v-lo)/(hi-lo)) }
	}
	// axes and grid
	for _, t := range ticks {
		ty := y(t)
		fmt.Fprintf(&b, `<line x1="%d" x2="%.1f" y1="%.1f" y2="%.1f" class="grid"/><text x="%d" y="%.1f" class="tick" text-anchor="end">%s</text>`,
			left, float64(left)+pw, ty, ty, left-6, ty+4, tickLabel(t))
	}
	fmt.Fprintf(&b, `<text transform="translate(16 %.1f) rotate(-90)" class="axis" text-anchor="middle">%s</text>`, top+ph/2, html.EscapeString(c.YLabel))
	n := len(c.X)
	slot := pw / float64(max(n, 1))
	xc := func(i int) float64 { return float64(left) + slot*(float64(i)+0.5) }
	every := max(c.XEvery, 1)
	for i, lab := range c.X {
		if i%every != 0 {
			continue
		}
		fmt.Fprintf(&b, `<text x="%.1f" y="%.1f" class="tick" text-anchor="end" transform="rotate(-35 %.1f %.1f)">%s</text>`,
			xc(i), top+ph+14, xc(i), top+ph+14, html.EscapeString(lab))
	}
	base := top + ph
	if !c.LogY && !c.NoZero {
		base = y(0)
	}
	ns := max(len(c.Series), 1)
	for si, s := range c.Series {
		col := palette[si%len(palette)]
		var pts []string
		for i, v := range s.Values {
			if i >= n || math.IsNaN(v) || (c.LogY && v <= 0) {
				continue
			}
			attrs := fmt.Sprintf(`data-series="%s" data-x="%s" data-value="%s"`, html.EscapeString(s.Name), html.EscapeString(c.X[i]), Num(v))
			tip := fmt.Sprintf("%s, %s: %s", s.Name, c.X[i], Num(v))
			e := 0.0
			if i < len(s.Errs) {
				e = s.Errs[i]
				if e > 0 {
					tip += " ± " + Num(e)
				}
			}
			if c.Lines {
				px, py := xc(i), y(v)
				pts = append(pts, fmt.Sprintf("%.1f,%.1f", px, py))
				fmt.Fprintf(&b, `<circle class="mark" cx="%.1f" cy="%.1f" r="2.5" fill="%s" %s><title>%s</title></circle>`, px, py, col, attrs, html.EscapeString(tip))
				continue
			}
			bw := slot * 0.8 / float64(ns)
			bx := float64(left) + slot*float64(i) + slot*0.1 + bw*float64(si)
			y0, y1 := base, y(v)
			if y1 > y0 {
				y0, y1 = y1, y0
			}
			fmt.Fprintf(&b, `<rect class="mark" x="%.1f" y="%.1f" width="%.1f" height="%.1f" fill="%s" %s><title>%s</title></rect>`,
				bx, y1, bw, math.Max(y0-y1, 0.5), col, attrs, html.EscapeString(tip))
			if e > 0 {
				cx := bx + bw/2
				fmt.Fprintf(&b, `<line class="err" x1="%.1f" x2="%.1f" y1="%.1f" y2="%.1f"/>`, cx, cx, y(v-e), y(v+e))
			}
			if n <= 12 {
				fmt.Fprintf(&b, `<text class="val" x="%.1f" y="%.1f" text-anchor="middle">%s</text>`, bx+bw/2, y(v+e)-4, Short(v))
			}
		}
		if c.Lines && len(pts) > 1 {
			fmt.Fprintf(&b, `<polyline fill="none" stroke="%s" stroke-width="1.5" points="%s"/>`, col, strings.Join(pts, " "))
		}
		// legend
		ly := top + 14*si
		fmt.Fprintf(&b, `<rect x="%d" y="%d" width="10" height="10" fill="%s"/><text x="%d" y="%d" class="legend">%s</text>`,
			w-right+12, ly, col, w-right+26, ly+9, html.EscapeString(s.Name))
	}
	if c.RefY != 0 {
		ry := y(c.RefY)
		fmt.Fprintf(&b, `<line class="ref" x1="%d" x2="%.1f" y1="%.1f" y2="%.1f" data-value="%s"/><text x="%.1f" y="%.1f" class="tick">%s</text>`,
			left, float64(left)+pw, ry, ry, Num(c.RefY), float64(left)+pw+4, ry+4, html.EscapeString(c.RefLabel))
	}
	fmt.Fprintf(&b, `<line x1="%d" x2="%d" y1="%d" y2="%.1f" class="axisline"/><line x1="%d" x2="%.1f" y1="%.1f" y2="%.1f" class="axisline"/></svg>`,
		left, left, top, top+ph, left, float64(left)+pw, top+ph, top+ph)
	return b.String()
}

// niceTicks returns 4–8 round tick values covering [lo, hi].
func niceTicks(lo, hi float64) []float64 {
	if hi <= lo {
		hi = lo + 1
	}
	raw := (hi - lo) / 5
	mag := math.Pow(10, math.Floor(math.Log10(raw)))
	step := mag
	for _, m := range []float64{1, 2, 2.5, 5, 10} {
		if m*mag >= raw {
			step = m * mag
			break
		}
	}
	var t []float64
	for v := math.Floor(lo/step) * step; v < hi+step*0.999; v += step {
		t = append(t, math.Round(v/step)*step)
	}
	return t
}

func tickLabel(v float64) string {
	if v != 0 && (math.Abs(v) < 1e-3 || math.Abs(v) >= 1e5) {
		return strconv.FormatFloat(v, 'e', 0, 64)
	}
	return strconv.FormatFloat(v, 'g', 4, 64)
}
