package calib_test

import (
	"math"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"qtool/convert"
	"qtool/formats/hf"
	"qtool/quantize"
	"qtool/quantize/calib"
)

// TestWriteReport writes the record of an RTN w4 g128 llama-mini written as
// GPTQ and reads it back: the size on disk, bits per parameter and the
// linear storage 4 + 16/128 (fp16 scale) + 4/128 (packed zero) bits.
func TestWriteReport(t *testing.T) {
	m, err := hf.Open("../../testdata/llama-mini")
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	q, err := quantize.QuantizeModel(m, quantize.Options{Params: quantize.Int4Asym(128)})
	if err != nil {
		t.Fatal(err)
	}
	out := filepath.Join(t.TempDir(), "rtn4")
	if err := convert.Save(q, convert.FormatGPTQ, out); err != nil {
		t.Fatal(err)
	}
	stats := []calib.ModuleStat{{Layer: 0, Role: "q", Loss: 1, RelErr: 2e-3, Note: "clip 0.9"}}
	if err := calib.WriteReport(q, calib.RunReport{Method: "rtn", Model: "llama-mini", Out: out, Modules: stats}); err != nil {
		t.Fatal(err)
	}
	r, err := calib.ReadReport(calib.ReportPath(out))
	if err != nil {
		t.Fatal(err)
	}
	if r.Bytes < 1e6 || r.Params < 1e6 || math.Abs(r.BitsPerWeight-8*float64(r.Bytes)/float64(r.Params)) > 1e-9 ||
		math.Abs(r.LinearBits-(4+20.0/128)) > 1e-9 || len(r.Modules) != 1 || r.Modules[0].Note != "clip 0.9" {
		t.Fatalf("record %+v", r)
	}
	t.Logf("%d bytes, %d params, %.3f bits/param, %.5f linear bits", r.Bytes, r.Params, r.BitsPerWeight, r.LinearBits)

	// The record is an output like the model: never written into a FIFO.
	if err := os.Remove(calib.ReportPath(out)); err != nil {
		t.Fatal(err)
	}
	if err := syscall.Mkfifo(calib.ReportPath(out), 0o644); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { done <- calib.WriteReport(q, calib.RunReport{Method: "rtn", Model: "llama-mini", Out: out}) }()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "FIFO") {
			t.Fatalf("a record into a FIFO: %v", err)
		}
	case <-time.After(30 * time.Second):
		t.Fatal("a record into a FIFO blocked")
	}

	bad := filepath.Join(t.TempDir(), "bad.json")
	if err := os.WriteFile(bad, []byte(`{"ppl": 3}`), 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := calib.ReadReport(bad); err == nil || !strings.Contains(err.Error(), "not a quantizer report") {
		t.Fatalf("read %s: %v", bad, err)
	}
}
