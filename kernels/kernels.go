// Package kernels embeds qtool's CUDA kernels: the CUDA C sources (qtool.cu
// for inference, calib.cu for calibration, a module of its own) and the PTX
// that build.sh compiles from them with nvcc, for sm_80 (any GPU
// from Ampere on, JIT-compiled by the driver) and sm_90 (Hopper; qtool.cu's
// as sm_90a, for the wgmma GEMMs, which run on 9.0 devices alone). The PTX is
// committed so that the Go build needs no CUDA toolkit; the first line of
// each PTX file records the SHA-256 of the source it was built from.
package kernels

import (
	"bytes"
	"crypto/sha256"
	_ "embed"
	"encoding/hex"
)

//go:embed qtool.cu
var source []byte

//go:embed qtool_sm80.ptx
var ptx80 []byte

//go:embed qtool_sm90.ptx
var ptx90 []byte

//go:embed calib.cu
var calibSource []byte

//go:embed calib_sm80.ptx
var calibPTX80 []byte

//go:embed calib_sm90.ptx
var calibPTX90 []byte

// HashPrefix starts the first line of every committed PTX file.
const HashPrefix = "// qtool-source-sha256: "

// Source returns the CUDA C source.
func Source() []byte { return bytes.Clone(source) }

// SourceHash is the hex SHA-256 of the CUDA C source.
func SourceHash() string {
	h := sha256.Sum256(source)
	return hex.EncodeToString(h[:])
}

// PTX returns the PTX best suited to a device of compute capability
// major.minor and its name ("sm_90a" or "sm_80"); nil for devices older than
// sm_80. The sm_90a PTX uses Hopper's arch-specific instructions (wgmma),
// which the driver compiles for 9.0 devices alone; every other device from
// 8.0 on gets the sm_80 PTX.
func PTX(major, minor int) ([]byte, string) {
	switch {
	case major == 9 && minor == 0:
		return bytes.Clone(ptx90), "sm_90a"
	case major >= 8:
		return bytes.Clone(ptx80), "sm_80"
	}
	return nil, ""
}

// IsArchSpecific reports whether a PTX module targets an arch-specific
// variant such as sm_90a (its kernels run on that architecture alone).
func IsArchSpecific(ptx []byte) bool {
	for _, line := range bytes.SplitN(ptx, []byte("\n"), 64) {
		if t, ok := bytes.CutPrefix(bytes.TrimSpace(line), []byte(".target ")); ok {
			arch, _, _ := bytes.Cut(t, []byte(","))
			return bytes.HasSuffix(bytes.TrimSpace(arch), []byte("a"))
		}
	}
	return false
}

// CalibSourceHash is the hex SHA-256 of calib.cu.
func CalibSourceHash() string {
	h := sha256.Sum256(calibSource)
	return hex.EncodeToString(h[:])
}

// CalibPTX returns the calibration kernels' PTX for a device of compute
// capability major.minor and its name, like PTX.
func CalibPTX(major, minor int) ([]byte, string) {
	switch {
	case major >= 9:
		return bytes.Clone(calibPTX90), "sm_90"
	case major == 8:
		return bytes.Clone(calibPTX80), "sm_80"
	}
	return nil, ""
}

// RecordedHash returns the source hash recorded in a PTX file's first line.
func RecordedHash(ptx []byte) (string, bool) {
	line, _, _ := bytes.Cut(ptx, []byte("\n"))
	h, ok := bytes.CutPrefix(line, []byte(HashPrefix))
	return string(bytes.TrimSpace(h)), ok
}
