package cuda

import (
	"fmt"

	"qtool/runtime"
	"qtool/runtime/cuda/driver"
)

// Sequence-parallel exchanges (qtool.cu's exchange_peer, Megatron's
// sequence parallelism for a prefill): between a row-parallel product and
// the norm after it, the residual of an M-row matrix is split by rows
// instead of held whole on every rank. Rank r owns the rows of some of the
// 128-row tiles (ownRows); the product's sending GEMM (gemm_wg_*_tp with
// scatter) stores each tile only into the stage of the owner of its rows
// (a reduce-scatter: the owner's share of the bytes stays local, and x is
// not written); ExchangeNorm then adds each owned row's partials to the
// residual in rank order (allreduce_peer's bits where rank 0's product
// added the residual), norms it (rmsnorm's bits) and writes it in fp16
// into every rank's gather area, which the next column-parallel products
// read as their input (ProductsGathered, MLPScatter): each rank sums and
// norms only its rows. ExchangeSum and GatherOwned put the residual whole
// again where anything else reads it. Every rank must make the same calls
// in the same order, as for AllReducePeer.

// The exchange's modes (qtool.cu's EX_SUM, EX_NORM, EX_GATHER).
const (
	exSum = iota
	exNorm
	exGather
)

// ownRows is the rows [r0, r1) that rank owns of an M-row exchange over
// world ranks (qtool.cu's sp_row).
func ownRows(rank, world, M int) (r0, r1 int) {
	T := (M + 127) / 128
	row := func(r int) int { return min(M, 128*(r*T/world)) }
	return row(rank), row(rank + 1)
}

// CanScatter reports whether a product of rows activation rows by w sends
// its tiles to their rows' owners (a Hopper GEMM that sends, tileSender),
// with every rank of the group owning at least one tile, the norm of its
// output rows would run with exchange_peer's 256 threads (rowBlock: the
// same bits), and the exchange's blocks of all ranks on this GPU fit on it
// at once (exchangeFormOn).
func (b *Backend) CanScatter(w runtime.Linear, rows int) bool {
	return b.scatterer(lin(w), rows).kernel != ""
}

// scatterer is the sending GEMM of a product that scatters (CanScatter),
// none where it does not.
func (b *Backend) scatterer(l *Linear, rows int) tileSend {
	p := b.peer
	if p == nil || !p.connected || rows <= 128*(p.world-1) || b.rowBlock(rows, l.out) != block256 ||
		p.exchange.kernel == "" {
		return tileSend{}
	}
	return b.tileSender(l, rows)
}

// exchangeForm is an exchange_peer form a rank launches and its dynamic
// shared memory (padding only: the kernel uses none); kernel "" where no
// form fits. A block waits at its meetings for the same block of every
// peer, so the grids of the group's ranks on this GPU (one for each) must
// all be resident at once: a block that could not start until another
// rank's waiting blocks leave would hang the call (until the timeout's
// trap). The forms, fewest resident blocks and most registers first: a
// multiprocessor holds two blocks of exchange_peer, three of
// exchange_peer_shared (80 registers, with spills).
//   - A rank alone on its GPU (the product's case; ranks of other
//     processes count by the GPU's PCI address, onDevice) takes exchange_peer
//     padded to one block a multiprocessor: its grid (at most the smallest
//     GPU's multiprocessors) spreads over them instead of doubling up on
//     those the product before frees first, where a block's rows would
//     share one multiprocessor's loads (2xH200: a 2 048-token AutoAWQ
//     chunk at TP=2 35.0-35.2 ms, unpadded 35.2-35.4).
//   - Ranks that share a GPU (the tests') take the first form whose grids
//     all fit unpadded: exchange_peer for two, exchange_peer_shared for
//     three.
type exchangeForm struct {
	kernel string
	shm    int
}

// exchangeFormOn is the form of a rank whose group has onDevice ranks on
// its GPU (ConnectPeerReduce keeps it in the group's exchange).
func (b *Backend) exchangeFormOn(onDevice int) exchangeForm {
	blocks := b.peer.lanes[1].blocks // at most the smallest GPU's multiprocessors
	if pad := b.smemPerSM / 2; onDevice == 1 && pad <= b.smemOptin && b.residentBlocks("exchange_peer", pad) == 1 {
		return exchangeForm{"exchange_peer", pad}
	}
	for _, k := range [...]string{"exchange_peer", "exchange_peer_shared"} {
		if onDevice*blocks <= b.residentBlocks(k, 0)*b.sms {
			return exchangeForm{k, 0}
		}
	}
	return exchangeForm{}
}

// CanGather reports whether the products ws of rows rows can take their
// input from the gather area as it stands after ExchangeNorm: fp16, the
// columns in order, on a GEMM (halfGEMM, as normed writes it), the norm
// with exchange_peer's 256 threads.
func (b *Backend) CanGather(ws []runtime.Linear, rows int) bool {
	p := b.peer
	if p == nil || !p.connected || len(ws) == 0 || b.rowBlock(rows, ws[0].In()) != block256 {
		return false
	}
	for _, w := range ws {
		l := lin(w)
		if l.in != lin(ws[0]).in || rows*l.in > p.capFloats || !b.halfGEMM(l, rows, false) || l.perm != 0 {
			return false
		}
	}
	return true
}

// ExchangeSum queues x + the ranks' partials (sent by AttentionScatter or
// MLPScatter) at the rows this rank owns into x; x then holds the sums at
// those rows only (GatherOwned makes it whole).
func (b *Backend) ExchangeSum(x runtime.Buf) {
	defer b.enter()()
	b.exchange(buf(x), exSum, nil, nil, 0)
}

// ExchangeNorm is ExchangeSum, then each owned row's RMSNorm(w, bias, eps)
// rounded to fp16 into every rank's gather area, which on return (on the
// stream) holds the whole normed matrix on every rank: the input of
// ProductsGathered and MLPScatter.
func (b *Backend) ExchangeNorm(x runtime.Buf, w, bias runtime.Vector, eps float32) {
	if vec(w).n != x.Cols() {
		panic("cuda backend: ExchangeNorm norm width")
	}
	defer b.enter()()
	b.exchange(buf(x), exNorm, w, bias, eps)
	b.peer.gathered = [2]int{x.Rows(), x.Cols()}
}

// GatherOwned queues the exchange that makes x, valid at this rank's rows
// only, whole on every rank.
func (b *Backend) GatherOwned(x runtime.Buf) {
	defer b.enter()()
	b.exchange(buf(x), exGather, nil, nil, 0)
}

// exchange launches the exchange on x in lane 1, in the group's form
// (context current).
func (b *Backend) exchange(x *Buf, mode int, w, bias runtime.Vector, eps float32) {
	p := b.peer
	if p == nil || !p.connected {
		panic("cuda backend: a sequence-parallel exchange without a connected peer-memory group")
	}
	if x.n() > p.capFloats {
		panic(fmt.Sprintf("cuda backend: exchange of %d values, the group's areas hold %d", x.n(), p.capFloats))
	}
	l := p.lanes[1]
	var nw driver.DevicePtr
	if w != nil {
		nw = vec(w).p
	}
	f := p.exchange
	if f.kernel == "" {
		panic("cuda backend: an exchange whose ranks of this GPU cannot all be resident (CanScatter said no)")
	}
	b.launchShm(f.kernel, g1(l.blocks), block256, f.shm, x.p, x.rows, x.cols, p.rank, p.world, p.area,
		int64(l.stageOff), int64(l.stride), uint64(p.timeout.Nanoseconds()), mode, nw, vecPtr(bias), eps,
		int64(p.gatherOff))
	b.metPeers()
}

// gathered is the input ExchangeNorm left in the gather area: rows × cols
// in fp16 (it panics where the last ExchangeNorm gathered another shape).
func (b *Backend) gathered(rows, cols int) *gemmIn {
	p := b.peer
	if p.gathered != [2]int{rows, cols} {
		panic(fmt.Sprintf("cuda backend: products of gathered rows [%d %d], the gather area holds [%d %d]", rows, cols, p.gathered[0], p.gathered[1]))
	}
	return &gemmIn{x: &Buf{rows: rows, cols: cols}, a16: p.area + p.gatherOff}
}

// ProductsGathered queues dst[i] = h·ws[i]ᵀ for the normed input h that
// ExchangeNorm gathered (CanGather must hold), as MatMulN would from h.
func (b *Backend) ProductsGathered(dst []runtime.Buf, ws []runtime.Linear) {
	if len(dst) == 0 {
		return
	}
	rows := dst[0].Rows()
	if !b.CanGather(ws, rows) {
		panic("cuda backend: ProductsGathered of products that do not take the gathered input")
	}
	in := b.gathered(rows, ws[0].In())
	segs := gatheredSegs("ProductsGathered", dst, ws, in.x)
	defer b.enter()()
	b.matmulN(in, segs)
}

// gatheredSegs is segments for products of the gathered input h (shape
// alone, no device buffer).
func gatheredSegs(op string, dst []runtime.Buf, ws []runtime.Linear, h *Buf) []gemvSeg {
	if len(dst) != len(ws) {
		panic(fmt.Sprintf("cuda backend: %s of %d weights into %d outputs", op, len(ws), len(dst)))
	}
	segs := make([]gemvSeg, len(ws))
	for i, w := range ws {
		d, l := buf(dst[i]), lin(w)
		if h.cols != l.in || d.cols != l.out || d.rows != h.rows {
			panic(fmt.Sprintf("cuda backend: %s [%d %d] <- [%d %d] x [%d %d]ᵀ", op, d.rows, d.cols, h.rows, h.cols, l.out, l.in))
		}
		segs[i] = gemvSeg{d, l}
	}
	return segs
}

// AttentionScatter queues the prefill attention of q and o's product of
// it, each tile stored into the stage of the owner of its rows
// (CanScatter(o) must hold); ExchangeSum or ExchangeNorm then adds the
// owned rows' partials to x. The attention is written in the form o's GEMM
// takes where it can (attnFormOut), else in fp32.
func (b *Backend) AttentionScatter(x, q runtime.Buf, c runtime.KVCache, layer, pos0, heads, kvHeads, headDim int, o runtime.Linear) {
	d, qb, kc, l := buf(x), buf(q), cache(c), lin(o)
	ts := b.scatterer(l, qb.rows)
	if ts.kernel == "" {
		panic("cuda backend: AttentionScatter of a product that does not scatter")
	}
	defer b.enter()()
	var in *gemmIn
	if b.attnFormOut(l, kc, qb.rows, headDim) {
		in = b.attendFormed(d, qb, kc, layer, pos0, heads, kvHeads, headDim, l)
	} else {
		a := b.AllocRaw(qb.rows, qb.cols).(*Buf)
		defer b.Free(a)
		b.Attention(a, qb, kc, layer, pos0, heads, kvHeads, headDim)
		in = &gemmIn{x: a}
	}
	b.launchTiles(ts, d, in, l, false, true)
}

// MLPScatter queues the MLP block's products from the normed input that
// ExchangeNorm gathered (CanGather(gate, up) and CanScatter(down) must
// hold): gate and up with their SwiGLU, then down's product of it, each
// tile stored into the stage of the owner of its rows, for the exchange
// that adds them to x.
func (b *Backend) MLPScatter(x runtime.Buf, gate, up, down runtime.Linear) {
	rows := x.Rows()
	ts := b.scatterer(lin(down), rows)
	if !b.CanGather([]runtime.Linear{gate, up}, rows) || ts.kernel == "" {
		panic("cuda backend: MLPScatter of products that do not gather or scatter")
	}
	g := b.AllocRaw(rows, gate.Out())
	defer b.Free(g)
	h := b.gathered(rows, gate.In())
	segs := gatheredSegs("MLPScatter", []runtime.Buf{g, g}, []runtime.Linear{gate, up}, h.x)
	_, dseg := b.segments("MLPScatter", []runtime.Buf{x}, g, []runtime.Linear{down})
	defer b.enter()()
	dl := dseg[0].l
	q := b.inputFor(dl, rows)
	in := &gemmIn{x: buf(g)}
	if b.swiGLUFrom(h, segs, q) {
		in = q.input(rows, dl.in)
	}
	b.launchTiles(ts, buf(x), in, dl, false, true)
}
