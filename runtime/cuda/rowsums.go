package cuda

import "qtool/runtime/cuda/driver"

// Row sums. A streaming 4-bit GEMV with a norm before it (q/k/v, gate/up)
// must know the sum of the squares of its input row before it can stage
// the row: a pass over the row and a block reduction, in every block, while
// its weight ring waits. The kernels that write that row on a decode step,
// the residual adds of o and down (MatMulAdd with the streaming GEMV) and,
// on a tensor-parallel rank, the all-reduce of their partial sums
// (AllReducePeer's allreduce_peer_ll), already hold its values, so they
// also write its sums of squares, one part a block, and the normed GEMV
// that reads the row next (gemv_q4_w4h_n, gemv_q4_w2h_n, gemv_q4_w4a_n and
// their _pc forms) adds the parts instead.
//
// The parts are used only by the launch right after the one that wrote
// them, and only for the buffer they describe: every launch counts
// (launches), and so does every other write of a buffer (Upload, Copy2D,
// and handing out a buffer's address with BufPtr, through which a
// collective may write it: wrote), so nothing in between can leave them
// stale; freeing the buffer drops them (the pool may hand its address out
// again).
type rowSums struct {
	of driver.DevicePtr // the fp32 buffer described
	p  driver.DevicePtr // its sums of squares, n parts a row
	n  int
	at uint64 // launches when the producer was launched
}

// sumsOut returns where a producer writing d in parts blocks a row should
// put the sums of squares of its parts, or 0 when d gets none (more rows
// than a GEMV takes, or Options.NoRowSums). The caller launches the
// producer, then records it with wroteSums.
func (b *Backend) sumsOut(d *Buf, parts int) driver.DevicePtr {
	if b.opt.NoRowSums || d.rows > b.opt.GEMVMaxRows {
		return 0
	}
	return b.scratchBuf("row_sums", 4*d.rows*parts)
}

// wroteSums records that the launch just made wrote the sums of squares of
// d's rows to p in n parts a row (p may be 0: none).
func (b *Backend) wroteSums(d *Buf, p driver.DevicePtr, n int) {
	b.sums = rowSums{of: d.p, p: p, n: n, at: b.launches}
}

// sumsIn returns the sums of squares of s's rows that the last launch
// wrote (p = 0: none).
func (b *Backend) sumsIn(s *Buf) rowSums {
	if rs := b.sums; rs.of == s.p && rs.at == b.launches {
		return rs
	}
	return rowSums{}
}

// wrote marks a write that is not a kernel launch: no row sums outlive it.
func (b *Backend) wrote() { b.launches++ }
