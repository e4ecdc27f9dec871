// Package runtimetest holds helpers for the tests of the forward pass and
// its backends (runtime, runtime/tp).
package runtimetest

import (
	"math"

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
