package calib

import (
	"fmt"
	"io"
	"text/tabwriter"
	"time"

	"qtool/formats/model"
)

// ModuleStat reports what happened to one linear module.
type ModuleStat struct {
	Layer int        `json:"layer"`
	Role  model.Role `json:"role"`
	// Loss is the method's own objective after quantization (GPTQ: Σ(w−q)²/2d²;
	// AWQ and SmoothQuant: mean squared error of the module's output on the
	// calibration tokens used for the search).
	Loss float64 `json:"loss"`
	// RelErr is ‖X·(W−Ŵ)ᵀ‖² / ‖X·Wᵀ‖² on the calibration inputs the module saw,
	// comparable between methods (0 when not measured).
	RelErr  float64 `json:"rel_err"`
	Seconds float64 `json:"seconds"`
	Note    string  `json:"note,omitempty"`
}

// Progress receives events while a method runs: the start of a layer
// (role "") and the end of each module.
type Progress func(layer int, role model.Role, done bool)

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

// RelErr returns ‖x·(w−wq)ᵀ‖² / ‖x·wᵀ‖² for x [rows, in] and w, wq [out, in],
// on at most maxRows rows of x (evenly strided).
func RelErr(x []float32, rows, in int, w, wq []float32, out, maxRows, threads int) float64 {
	sub, n := Subsample(x, rows, in, maxRows)
	diff := make([]float32, len(w))
	for i := range w {
		diff[i] = w[i] - wq[i]
	}
	ref := matMul(sub, w, n, out, in, threads)
	errOut := matMul(sub, diff, n, out, in, threads)
	num, den := 0.0, 0.0
	for i := range ref {
		num += float64(errOut[i]) * float64(errOut[i])
		den += float64(ref[i]) * float64(ref[i])
	}
	if den == 0 {
		return 0
	}
	return num / den
}

// Subsample returns at most maxRows rows of x ([rows, cols]) taken at an even
// stride, and their number. It returns x itself when rows <= maxRows.
func Subsample(x []float32, rows, cols, maxRows int) ([]float32, int) {
	if maxRows <= 0 || rows <= maxRows {
		return x, rows
	}
	stride := rows / maxRows
	out := make([]float32, 0, maxRows*cols)
	for r := 0; r < maxRows; r++ {
		out = append(out, x[r*stride*cols:(r*stride+1)*cols]...)
	}
	return out, maxRows
}
