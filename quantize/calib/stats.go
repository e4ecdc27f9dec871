package calib

import (
	"fmt"
	"io"
	"os"
	"strconv"
	"strings"
	"text/tabwriter"
	"time"

	"qtool/formats/model"
)

// ModuleStat reports what happened to one linear module (Layer −1: the
// classifier, lm_head).
type ModuleStat struct {
	Layer int        `json:"layer"`
	Role  model.Role `json:"role"`
	// Loss is the method's own objective after quantization (GPTQ: Σ(w−q)²/2d²;
	// AWQ and SmoothQuant: mean squared error of the module's output on the
	// calibration tokens used for the search).
	Loss float64 `json:"loss"`
	// RelErr is ‖X·(W−Ŵ)ᵀ‖² / ‖X·Wᵀ‖² on the calibration inputs the module saw,
	// comparable between methods (0 when not measured).
	RelErr float64 `json:"rel_err"`
	// FloatErr is ‖X̃·Ŵᵀ − X·Wᵀ‖² / ‖X·Wᵀ‖² with X̃ the quantized model's
	// inputs and X the float model's: the module's error against the float
	// model's output, the errors of earlier layers included (methods that
	// track the float model, Session.TrackFloat; 0 otherwise).
	FloatErr float64 `json:"float_err,omitempty"`
	Seconds  float64 `json:"seconds"`
	Note     string  `json:"note,omitempty"`
}

// Progress receives events while a method runs: the start of a layer (st
// nil) and the end of each module, with its statistics.
type Progress func(layer int, st *ModuleStat)

// Timer measures one module.
type Timer struct{ t time.Time }

// StartTimer starts a Timer.
func StartTimer() Timer { return Timer{time.Now()} }

// Seconds since the start.
func (t Timer) Seconds() float64 { return time.Since(t.t).Seconds() }

// WriteTable prints the per-module table.
func WriteTable(w io.Writer, stats []ModuleStat, lossName string) error {
	tw := tabwriter.NewWriter(w, 0, 0, 2, ' ', tabwriter.AlignRight)
	fmt.Fprintf(tw, "layer\tmodule\t%s\trel.out.err\ttime(s)\t \tnote\n", lossName)
	for _, s := range stats {
		fmt.Fprintf(tw, "%d\t%s\t%.6g\t%.3e\t%.2f\t \t%s\n", s.Layer, s.Role, s.Loss, s.RelErr, s.Seconds, s.Note)
	}
	return tw.Flush()
}

// PeakRSSMiB returns the process's peak resident set size (VmHWM) in MiB,
// or 0 where /proc is unavailable.
func PeakRSSMiB() float64 {
	b, err := os.ReadFile("/proc/self/status")
	if err != nil {
		return 0
	}
	for _, line := range strings.Split(string(b), "\n") {
		if rest, ok := strings.CutPrefix(line, "VmHWM:"); ok {
			if f := strings.Fields(rest); len(f) > 0 {
				kb, _ := strconv.ParseFloat(f[0], 64)
				return kb / 1024
			}
		}
	}
	return 0
}
