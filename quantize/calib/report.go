package calib

import (
	"bytes"
	"encoding/json"
	"fmt"
	"io/fs"
	"path/filepath"

	"qtool/formats/atomicfile"
	"qtool/formats/infile"
	"qtool/formats/model"
)

// RunReport is the record of one quantizer run that `qtool report` reads:
// written beside the output by WriteReport (ReportPath), and with the same
// field names as the quantizer commands' --json summary, so either can be
// given to `qtool report`.
type RunReport struct {
	Method      string  `json:"method"`              // gptq, awq, smoothquant, rtn
	Model       string  `json:"model"`               // the float source
	Out         string  `json:"out"`                 // the written model
	Format      string  `json:"format"`              // as convert.Save names it
	Scheme      string  `json:"scheme"`              // e.g. "4-bit asymmetric group 128 weights"
	LossName    string  `json:"loss_name,omitempty"` // what ModuleStat.Loss measures
	NSamples    int     `json:"nsamples,omitempty"`
	SeqLen      int     `json:"seqlen,omitempty"`
	CalibTokens int     `json:"calib_tokens,omitempty"`
	Seconds     float64 `json:"seconds"`
	// Device is the backend calibration ran on.
	Device string `json:"device,omitempty"`
	// Phases are wall seconds per phase (Session.Phases, plus "write").
	Phases map[string]float64 `json:"phases,omitempty"`
	// PeakHostMiB is the process's peak resident memory (mapped source
	// files included), PeakDeviceMiB the backend's peak device memory
	// (GPU only).
	PeakHostMiB   float64      `json:"peak_host_mib,omitempty"`
	PeakDeviceMiB float64      `json:"peak_device_mib,omitempty"`
	Modules       []ModuleStat `json:"modules"`
	// Filled by WriteReport from the written files and the model.
	Bytes         int64   `json:"bytes,omitempty"`           // size of Out on disk (all files of a directory)
	Params        int64   `json:"params,omitempty"`          // elements of every tensor of the model
	BitsPerWeight float64 `json:"bits_per_weight,omitempty"` // 8·Bytes/Params
	// LinearBits is the storage of the quantized decoder linears per weight:
	// codes, fp16 scales, zero points packed at the code width and act-order
	// indices (4.156 for 4-bit asymmetric group 128).
	LinearBits float64 `json:"linear_bits,omitempty"`
	// Verify is the quantizer's --verify perplexity, when it ran one.
	Verify *VerifyRecord `json:"verify,omitempty"`
}

// VerifyRecord is a perplexity measured on the written model (the
// quantizer commands' --verify), with its protocol figures.
type VerifyRecord struct {
	File   string  `json:"file"`
	PPL    float64 `json:"ppl"`
	Tokens int     `json:"tokens"`
	Chunks int     `json:"chunks"`
	Ctx    int     `json:"ctx"`
}

// ReportPath is where WriteReport puts the record of a run that wrote out
// (a file or a directory): beside it, OUT.quant.json.
func ReportPath(out string) string { return filepath.Clean(out) + ".quant.json" }

// WriteReport completes r with the size of r.Out on disk and the parameter
// count of m (the quantized model as written; nil to skip) and writes it to
// ReportPath(r.Out). The quantizer commands call it once the output is
// written (and verified); their --json summary is the same record.
func WriteReport(m *model.Model, r RunReport) error {
	if r.Out == "" {
		return fmt.Errorf("calib: WriteReport: no output path")
	}
	if r.Modules == nil {
		r.Modules = []ModuleStat{}
	}
	n, err := diskSize(r.Out)
	if err != nil {
		return fmt.Errorf("calib: report for %s: %w", r.Out, err)
	}
	r.Bytes = n
	if m != nil {
		r.Params = 0
		for _, name := range m.Names() {
			t, _ := m.Lookup(name)
			p := int64(1)
			for _, d := range t.Shape() {
				p *= int64(d)
			}
			r.Params += p
		}
		if r.Params > 0 {
			r.BitsPerWeight = 8 * float64(r.Bytes) / float64(r.Params)
		}
		r.LinearBits = linearBits(m)
	}
	b, err := json.MarshalIndent(r, "", "  ")
	if err != nil {
		return err
	}
	path := ReportPath(r.Out)
	if err := atomicfile.WriteFile(path, append(b, '\n')); err != nil {
		return fmt.Errorf("calib: %w", err)
	}
	return nil
}

// ReadReport reads a RunReport (a file WriteReport wrote, or a quantizer's
// --json summary), checking that it is one: it names its output and
// method.
func ReadReport(path string) (RunReport, error) {
	var r RunReport
	b, err := infile.ReadFile(path, infile.MetaLimit)
	if err != nil {
		return r, fmt.Errorf("calib: %w", err)
	}
	if err := json.NewDecoder(bytes.NewReader(b)).Decode(&r); err != nil {
		return r, fmt.Errorf("calib: %s: not a quantizer report: %w", path, err)
	}
	if r.Out == "" || r.Method == "" {
		return r, fmt.Errorf("calib: %s: not a quantizer report (want \"method\" and \"out\", as WriteReport or `qtool gptq|awq|smoothquant --json` write)", path)
	}
	return r, nil
}

// linearBits is the mean storage per weight of the quantized decoder
// linears of m (0 when none is quantized).
func linearBits(m *model.Model) float64 {
	var bits, n float64
	for _, name := range m.Names() {
		l, role, _ := model.ParseName(name)
		t, _ := m.Lookup(name)
		q, ok := t.(*model.Quantized)
		if l < 0 || !model.IsLinear(role) || !ok {
			continue
		}
		w, g := float64(q.Rows*q.Cols), float64(q.Rows*q.Groups())
		bits += float64(q.Bits)*w + 16*g + 32*float64(len(q.GIdx))
		if q.Zero != nil {
			bits += float64(q.Bits) * g
		}
		n += w
	}
	if n == 0 {
		return 0
	}
	return bits / n
}

// diskSize is the size of a file, or of every regular file under a directory.
func diskSize(path string) (int64, error) {
	var n int64
	err := filepath.WalkDir(path, func(_ string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if d.Type().IsRegular() {
			fi, err := d.Info()
			if err != nil {
				return err
			}
			n += fi.Size()
		}
		return nil
	})
	return n, err
}
