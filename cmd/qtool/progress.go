package main

import (
	"fmt"
	"io"
	"time"

	"github.com/schollz/progressbar/v3"
)

// progress reports a long job of total steps: a bar on a terminal, one
// plain line per step otherwise (a log file, nohup, CI), nothing when quiet.
type progress struct {
	w     io.Writer
	what  string
	total int
	bar   *progressbar.ProgressBar
	plain bool
	start time.Time
	done  int
	skip  int // of done, steps finished before this run
}

// newProgress starts reporting on w; the bar is drawn only when w is a
// terminal.
func newProgress(w io.Writer, quiet bool, what string, total int) *progress {
	p := &progress{w: w, what: what, total: total, start: time.Now()}
	switch {
	case quiet:
	case isTerminal(w):
		p.bar = progressbar.NewOptions(total, progressbar.OptionSetWriter(w), progressbar.OptionSetDescription(what),
			progressbar.OptionShowCount(), progressbar.OptionShowElapsedTimeOnFinish(),
			progressbar.OptionThrottle(100*time.Millisecond), progressbar.OptionClearOnFinish())
	default:
		p.plain = true
	}
	return p
}

// Step reports one finished step with a short description (the plain line
// carries it with the elapsed and the estimated remaining time).
func (p *progress) Step(desc string) {
	p.done++
	if p.bar != nil {
		p.bar.Describe(p.what + " " + desc)
		_ = p.bar.Add(1)
		return
	}
	if !p.plain {
		return
	}
	el := time.Since(p.start)
	left := time.Duration(0)
	if ran := p.done - p.skip; ran > 0 && p.done < p.total {
		left = el / time.Duration(ran) * time.Duration(p.total-p.done)
	}
	fmt.Fprintf(p.w, "%s %d/%d %s; elapsed %s, remaining ~%s\n", p.what, p.done, p.total, desc,
		el.Round(100*time.Millisecond), left.Round(time.Second))
}

// Skip counts n steps done before this run (a resumed job): the bar and
// the plain lines go on from there.
func (p *progress) Skip(n int) {
	p.done += n
	p.skip += n
	if p.bar != nil {
		_ = p.bar.Add(n)
	}
}

// Describe changes the bar's description without a step (no plain line).
func (p *progress) Describe(desc string) {
	if p.bar != nil {
		p.bar.Describe(p.what + " " + desc)
	}
}

// Finish ends the bar.
func (p *progress) Finish() {
	if p.bar != nil {
		_ = p.bar.Finish()
	}
}
