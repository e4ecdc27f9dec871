package cuda

import (
	"fmt"

	"qtool/runtime"
	"qtool/runtime/cuda/driver"
)

// The methods of this file let a wrapper (the tensor-parallel backend of
// package runtime/tp) run collectives directly on the backend's device
// buffers, ordered with its kernels on its stream.

// Stream is the CUDA stream (a CUstream handle) the backend queues all its
// work on, in order.
func (b *Backend) Stream() uintptr { return uintptr(b.stream) }

// BufPtr is the device address of the first value of x, a live buffer of
// this backend. The caller may write x through it (a collective), so it
// counts as a write: no row sums (rowsums.go) outlive it.
func (b *Backend) BufPtr(x runtime.Buf) uint64 {
	b.wrote()
	return uint64(buf(x).p)
}

// Do runs fn on a locked OS thread with the backend's context current (for
// library calls on the backend's stream, e.g. NCCL).
func (b *Backend) Do(fn func()) {
	defer b.enter()()
	fn()
}

// Copy2D queues on the stream a copy of the block of rows×cols values at
// (srcRow, srcCol) of src to (dstRow, dstCol) of dst. The buffers must not
// overlap.
func (b *Backend) Copy2D(dst runtime.Buf, dstRow, dstCol int, src runtime.Buf, srcRow, srcCol, rows, cols int) {
	d, s := buf(dst), buf(src)
	if rows < 0 || cols < 0 || dstRow < 0 || dstCol < 0 || srcRow < 0 || srcCol < 0 ||
		dstRow+rows > d.rows || dstCol+cols > d.cols || srcRow+rows > s.rows || srcCol+cols > s.cols {
		panic(fmt.Sprintf("cuda backend: Copy2D of %d×%d from (%d,%d) of [%d %d] to (%d,%d) of [%d %d]",
			rows, cols, srcRow, srcCol, s.rows, s.cols, dstRow, dstCol, d.rows, d.cols))
	}
	if rows == 0 || cols == 0 {
		return
	}
	dp := d.p + driver.DevicePtr(4*(dstRow*d.cols+dstCol))
	sp := s.p + driver.DevicePtr(4*(srcRow*s.cols+srcCol))
	defer b.enter()()
	b.wrote()
	if rows == 1 || (cols == d.cols && cols == s.cols) {
		b.must(b.drv.MemcpyDtoDAsync(dp, sp, uint64(4*rows*cols), b.stream))
		return
	}
	b.must(b.drv.MemcpyDtoD2DAsync(dp, uint64(4*d.cols), sp, uint64(4*s.cols), uint64(4*cols), uint64(rows), b.stream))
}

// FillBits queues on the stream setting every value of x to the float32
// whose bits are bits (runtime/tp's replicatePeer pads with −0, 0x80000000,
// the row that peer memory all-gathers).
func (b *Backend) FillBits(x runtime.Buf, bits uint32) {
	d := buf(x)
	if d.n() == 0 {
		return
	}
	defer b.enter()()
	b.wrote()
	b.must(b.drv.MemsetD32Async(d.p, bits, uint64(d.n()), b.stream))
}
