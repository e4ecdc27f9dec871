package tp

import (
	"qtool/runtime"
)

// Sequence-parallel exchanges (Megatron's sequence parallelism) for a
// prefill over peer memory: between a row-parallel product (o, down) and
// the norm after it, the residual x is split by rows instead of summed
// whole on every rank. Each rank owns the rows of some of the matrix's
// 128-row tiles; the product sends each tile's partial sums only to the
// owner of its rows (half the link's bytes at TP=2), and the norm after it
// becomes one exchange in which each rank sums, norms and sends in fp16
// only the rows it owns, gathering every rank's normed rows as the input
// of the next products. The residual's rows then stay where they were
// summed until the next product adds to them. Where the ranks' backends
// are PeerScatterers (CUDA) and every product can: AttentionAdd and MLP
// leave x with its partials sent (seqSent), NormMatMulN and MLP take such
// an x through the exchange and leave it owned by rows (seqOwned); any
// other use of x first makes it whole again (settle, from bufOf). A
// row's sum is the residual plus the ranks' partials in rank order, and
// its norm rmsnorm's, so the results are the all-reduce's bit for bit.

// PeerScatterer is a PeerRank whose prefill's row-parallel products can
// send their tiles to the owners of their rows, with the exchanges that
// add them to the residual, norm and gather (the CUDA backend:
// runtime/cuda/exchange.go).
// Every rank must make the same calls in the same order.
type PeerScatterer interface {
	// CanScatter reports whether a product of rows rows by w sends its
	// tiles to their rows' owners.
	CanScatter(w runtime.Linear, rows int) bool
	// CanGather reports whether products ws of rows rows take their input
	// from ExchangeNorm's gathered rows.
	CanGather(ws []runtime.Linear, rows int) bool
	// AttentionScatter queues the attention of q and o's product of it
	// sent to the rows' owners (CanScatter(o)); x is not written.
	AttentionScatter(x, q runtime.Buf, c runtime.KVCache, layer, pos0, heads, kvHeads, headDim int, o runtime.Linear)
	// MLPScatter queues gate and up of the gathered rows, their SwiGLU and
	// down's product of it sent to the rows' owners; x is not written.
	MLPScatter(x runtime.Buf, gate, up, down runtime.Linear)
	// ExchangeSum adds the sent partials of the rows this rank owns to x.
	ExchangeSum(x runtime.Buf)
	// ExchangeNorm is ExchangeSum, then the owned rows' RMSNorm gathered
	// in fp16 on every rank.
	ExchangeNorm(x runtime.Buf, w, bias runtime.Vector, eps float32)
	// GatherOwned makes x, valid at the owned rows, whole on every rank.
	GatherOwned(x runtime.Buf)
	// ProductsGathered queues dst[i] = h·ws[i]ᵀ of the gathered rows h.
	ProductsGathered(dst []runtime.Buf, ws []runtime.Linear)
}

// seqState is where a sequence-parallel exchange left a buffer.
type seqState uint8

const (
	// seqWhole: the buffer's layout says what each rank holds.
	seqWhole seqState = iota
	// seqSent: each rank's partial sums of a row-parallel product are
	// sent to the rows' owners; the sums are due.
	seqSent
	// seqOwned: each rank holds the sums of the rows it owns; its other
	// rows are stale.
	seqOwned
)

// SetSequenceParallel turns the sequence-parallel exchanges on (the
// default where the ranks can) or off (every exchange an all-reduce).
func (b *Backend) SetSequenceParallel(on bool) { b.noSeq = !on }

// scatterers returns the ranks' PeerScatterers (by rank) where the
// exchanges are on, with fusing backends, and every rank is a local one
// (the ranks of one process decide alike; processes could differ, e.g. in
// their GPUs' multiprocessors, and a rank that all-reduces where another
// scatters would wait for it in vain); nil otherwise.
func (b *Backend) scatterers() []PeerScatterer {
	if b.noSeq || !b.fused || b.skipComm || !b.allLocal() {
		return nil
	}
	return b.exchangers()
}

// exchangers returns the local ranks' PeerScatterers (by rank) where every
// local rank in the peer-memory group is one, whether the exchanges are on
// or not (settle needs them after they were turned off); nil otherwise.
func (b *Backend) exchangers() []PeerScatterer {
	if b.peer == nil {
		return nil
	}
	ss := make([]PeerScatterer, len(b.ranks))
	for _, r := range b.local {
		s, ok := b.peer[r].(PeerScatterer)
		if !ok {
			return nil
		}
		ss[r] = s
	}
	return ss
}

// scatterAll returns ss where ok holds on every local rank, else nil.
func (b *Backend) scatterAll(ss []PeerScatterer, ok func(s PeerScatterer, r int) bool) []PeerScatterer {
	if ss == nil {
		return nil
	}
	for _, r := range b.local {
		if !ok(ss[r], r) {
			return nil
		}
	}
	return ss
}

// settle makes t whole on every rank where an exchange left it split by
// rows: the due sums, then the rows gathered.
func (b *Backend) settle(t *Buf) {
	st := t.seq
	if st == seqWhole {
		return
	}
	b.markWhole(t)
	ss := b.exchangers()
	if ss == nil {
		panic("tp: a buffer split by rows on a backend without sequence-parallel exchanges")
	}
	b.each(func(r int) {
		if st == seqSent {
			ss[r].ExchangeSum(t.parts[r])
		}
		ss[r].GatherOwned(t.parts[r])
	})
}

// markWhole records that t is whole again, its due sums done or not
// wanted.
func (b *Backend) markWhole(t *Buf) {
	t.seq, t.be = seqWhole, nil
	if b.seqBuf == t {
		b.seqBuf = nil
	}
}

// settleSplit settles the buffer that the exchanges left split by rows (at
// most one: seqBuf) unless it is keep. A sent buffer's partials lie in the
// stages of the group's next call, which any other exchange would take:
// replicate and allReduce, through which every other exchange over peer
// memory goes, call it first, and so does an operation that leaves a
// buffer split.
func (b *Backend) settleSplit(keep *Buf) {
	if t := b.seqBuf; t != nil && t != keep {
		b.settle(t)
	}
}

// leave records that t is split by rows in state st, for bufOf to settle,
// and counts the exchange. No other buffer is split by then (the caller
// settled it, settleSplit(t), or t was seqBuf already), so a buffer that is
// not whole is always seqBuf.
func (b *Backend) leave(t *Buf, st seqState) {
	t.seq, t.be, b.seqBuf = st, b, t
	b.seqCalls++
}

// SequenceParallelCalls is how many operations took the sequence-parallel
// exchanges so far (tests and reports: that they ran).
func (b *Backend) SequenceParallelCalls() int { return b.seqCalls }
