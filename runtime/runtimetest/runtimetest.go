// Package runtimetest holds helpers for the tests of the forward pass and
// its backends (runtime, runtime/tp, runtime/cuda, runtime/tp/gputest).
package runtimetest

import (
	"encoding/json"
	"math"
	"os"
	"testing"

	"qtool/runtime"
)

// AllocNaN is be.Alloc with every value NaN: the AllocRaw of a test
// backend (runtime.RawAllocator), so that a buffer read before it is
// written shows in every result.
func AllocNaN(be runtime.Backend, rows, cols int) runtime.Buf {
	x := be.Alloc(rows, cols)
	nan := make([]float32, rows*cols)
	for i := range nan {
		nan[i] = float32(math.NaN())
	}
	be.Upload(x, nan)
	return x
}

// ReadJSON decodes the JSON file at path (a fixture's reference.json, a
// token-id list) into v, failing the test with the path on any error.
func ReadJSON(t testing.TB, path string, v any) {
	t.Helper()
	data, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("reading %s: %v", path, err)
	}
	if err := json.Unmarshal(data, v); err != nil {
		t.Fatalf("parsing %s: %v", path, err)
	}
}
