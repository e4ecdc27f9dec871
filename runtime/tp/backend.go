// Package tp runs the forward pass of package runtime tensor-parallel over
// N ranks, Megatron style, without changing the forward pass: Backend
// implements runtime.Backend by wrapping one runtime.Backend per rank (N CPU
// backends, or N CUDA backends, one per device) and a Communicator for the
// all-reduce and all-gather between them.
//
// Weights are split at upload by their canonical names with the rules of
// package qtool/formats/shard (column-parallel q/k/v/gate/up, row-parallel
// o/down, vocabulary-parallel embedding and lm_head, replicated norms), or
// taken as they are from a shard directory (shard.OpenModel).
//
// Activation buffers are per-rank buffers with a layout: replicated (every
// rank holds the whole matrix) or column-split (rank r holds a column
// range). Each operation declares the layout it needs and converts its
// inputs when they differ (a column-split buffer is all-gathered into a
// replicated one; a replicated one is sliced locally); the layouts the
// forward pass produces need no conversion except where Megatron
// communicates:
//
//   - MatMul with a column-parallel weight: replicated input, column-split
//     output (no communication);
//   - MatMul with a row-parallel weight: column-split input, each rank's
//     partial product all-reduced into a replicated output;
//   - Embed: each rank looks up the ids of its vocabulary range (zero rows
//     for the others), then all-reduce;
//   - the classifier's output is vocabulary-split; NLL and Argmax all-gather
//     it and run on rank 0;
//   - RMSNorm and Add on replicated buffers run redundantly on every rank
//     (cheaper than computing on rank 0 and broadcasting), keeping the
//     replicas bit-identical because every rank sees identical inputs;
//   - RoPE, RMSNormHeads, AddBias, SiLUMul, StoreKV and Attention act on
//     each rank's local heads or columns; the KV cache is split by KV heads;
//   - runtime.Fused's operations run fused on each rank's pieces where the
//     rank backends fuse (CUDA), the residual add of o and down inside rank
//     0's partial product before the all-reduce (fused.go).
//
// A Backend drives the ranks of its process: all of them (New), or one
// rank of a job with a process per rank (NewRank; the communicator connects
// the processes). Every process runs the same forward pass in lockstep and
// ends with the same replicated results.
//
// Local ranks run concurrently. CPU ranks run each operation on a goroutine
// per rank. Ranks that are DeviceRanks (CUDA backends) only queue work, so
// the first runs on the caller's goroutine and every other on a persistent
// worker goroutine locked to its OS thread; with a DeviceCommunicator
// (NCCL) the collectives run on the device buffers, queued on the ranks'
// streams, and layout changes stay on the device. Otherwise the
// collectives move data through host memory (Download, Communicator,
// Upload), which is exact and backend-agnostic.
package tp

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"qtool/formats/model"
	"qtool/formats/shard"
	"qtool/runtime"
)

// Backend is a tensor-parallel runtime.Backend over one backend per rank.
// Like every backend it is not safe for concurrent use of the same buffers.
//
// Per-rank slices (ranks, dev, workers, the parts of buffers and weights)
// are indexed by the global rank and hold nil for ranks of other processes;
// local lists the ranks of this process.
type Backend struct {
	cfg   model.Config
	ranks []runtime.Backend
	local []int
	comm  Communicator
	kv    [][2]int // KV-cache column range (by KV heads) of each rank

	// With DeviceRanks: workers[r] runs local rank r except the first
	// (which runs on the caller); dev are the ranks as DeviceRanks.
	workers []*worker
	dev     []DeviceRank
	// aborter is comm where it can be aborted; firstPanic is the first
	// rank to panic in the current each, plus one (0: none), and
	// firstValue its panic (written by that rank, read once all are done).
	aborter    Aborter
	firstPanic atomic.Int32
	firstValue any
	// dcomm, when the ranks are DeviceRanks and the communicator runs
	// collectives on device buffers; streams are the local ranks' streams,
	// in the order of local.
	dcomm   DeviceCommunicator
	streams []uintptr
	// skipComm drops the collectives (benchmarks: wrong results).
	skipComm bool
	// grouped: the caller issues every rank's collective in one NCCL group;
	// else each rank issues its own from its thread (with rcomm).
	grouped bool
	rcomm   RankDeviceCommunicator
	// fused: every local rank's backend implements runtime.Fused (fused.go).
	fused bool
	// peer, when set (UsePeerMemory), runs the all-reduces of up to
	// peerLimit values over peer memory; peerCap is the most it can.
	peer               []PeerRank
	peerCap, peerLimit int
	// noSeq turns the sequence-parallel exchanges off; seqBuf is the
	// buffer they left split by rows, if any; seqCalls counts the
	// operations that took them (seqpar.go)
	noSeq    bool
	seqBuf   *Buf
	seqCalls int
	peerErr  error // why not, after NewGPU or OpenRank
}

var _ runtime.Backend = (*Backend)(nil)

// New returns a tensor-parallel backend for a model of config cfg over the
// given rank backends (rank r runs on ranks[r]) and communicator. It checks
// that len(ranks) divides the heads and KV heads. Close closes the rank
// backends and the communicator.
func New(cfg model.Config, ranks []runtime.Backend, comm Communicator) (*Backend, error) {
	for r, be := range ranks {
		if be == nil {
			return nil, fmt.Errorf("tp: rank %d has no backend", r)
		}
	}
	return newBackend(cfg, ranks, comm)
}

// NewRank returns the tensor-parallel backend of one process of a job with
// a process per rank: this process runs rank of world ranks on be, and comm
// (a SocketCommunicator, or NCCL through NewNCCLRankCommunicator) connects
// it to the others. Every process must run the same operations in the same
// order, as they do running the same forward pass.
func NewRank(cfg model.Config, world, rank int, be runtime.Backend, comm Communicator) (*Backend, error) {
	if world < 1 || rank < 0 || rank >= world {
		return nil, fmt.Errorf("tp: rank %d of %d", rank, world)
	}
	if be == nil {
		return nil, fmt.Errorf("tp: rank %d has no backend", rank)
	}
	ranks := make([]runtime.Backend, world)
	ranks[rank] = be
	return newBackend(cfg, ranks, comm)
}

// newBackend makes the backend over ranks (nil for ranks of other processes).
func newBackend(cfg model.Config, ranks []runtime.Backend, comm Communicator) (*Backend, error) {
	n := len(ranks)
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("tp: %w", err)
	}
	if err := shard.CheckTP(cfg, n); err != nil {
		return nil, fmt.Errorf("tp: %w", err)
	}
	if comm == nil || comm.Size() != n {
		return nil, fmt.Errorf("tp: %d ranks need a communicator of %d ranks", n, n)
	}
	_, kv, err := shard.Layout(cfg, n, model.Name(0, model.K), []int{cfg.KVDim(), cfg.Hidden})
	if err != nil {
		return nil, fmt.Errorf("tp: %w", err)
	}
	b := &Backend{cfg: cfg, ranks: ranks, comm: comm, kv: kv}
	b.aborter, _ = comm.(Aborter)
	for r, be := range ranks {
		if be != nil {
			b.local = append(b.local, r)
		}
	}
	if len(b.local) == 0 {
		return nil, fmt.Errorf("tp: no rank backend")
	}
	b.fused = allFused(ranks, b.local)
	dev := make([]DeviceRank, n)
	for _, r := range b.local {
		d, ok := ranks[r].(DeviceRank)
		if !ok {
			return b, nil
		}
		dev[r] = d
	}
	b.dev = dev
	if len(b.local) > 1 {
		b.workers = make([]*worker, n)
		for _, r := range b.local[1:] {
			b.workers[r] = newWorker(r, b.rankPanicked)
		}
	}
	if dc, ok := comm.(DeviceCommunicator); ok {
		b.dcomm = dc
		b.rcomm, _ = comm.(RankDeviceCommunicator)
		b.grouped = b.rcomm == nil || len(b.local) == 1
		for _, r := range b.local {
			b.streams = append(b.streams, dev[r].Stream())
		}
	}
	return b, nil
}

// first is the first rank of this process: it holds the replicated
// results the host reads.
func (b *Backend) first() runtime.Backend { return b.ranks[b.local[0]] }

// allLocal reports whether every rank runs in this process.
func (b *Backend) allLocal() bool { return len(b.local) == len(b.ranks) }

// DeviceCollectives reports whether the collectives run on the ranks'
// device buffers (DeviceRanks and a DeviceCommunicator) rather than
// through host memory.
func (b *Backend) DeviceCollectives() bool { return b.dcomm != nil }

// SetGroupedCollectives chooses how device collectives are issued: true,
// the caller issues every rank's in one NCCL group; false (the default when
// the communicator is a RankDeviceCommunicator), each rank issues its own
// from its own thread, concurrently.
func (b *Backend) SetGroupedCollectives(grouped bool) {
	b.grouped = grouped || b.rcomm == nil || len(b.local) == 1
}

// SkipCollectives, for benchmarks only, turns the collectives of the
// forward pass into no-ops (the results are then wrong), to measure what
// they cost.
func (b *Backend) SkipCollectives(skip bool) { b.skipComm = skip }

// Sync waits until every rank has finished its queued work.
func (b *Backend) Sync() {
	if b.dev == nil {
		return
	}
	b.each(func(r int) { b.dev[r].Sync() })
}

// TimeAllReduce measures the all-reduce of a replicated [rows, cols]
// buffer as the forward pass runs it (reps times after one warm-up, all
// ranks synchronized before and after) and returns the time per call.
func (b *Backend) TimeAllReduce(rows, cols, reps int) time.Duration {
	if rows <= 0 || cols <= 0 || reps <= 0 {
		return 0
	}
	t := &Buf{rows: rows, cols: cols}
	b.layout(t, nil)
	defer b.release(t)
	b.allReduce(t)
	b.Sync()
	t0 := time.Now()
	for range reps {
		b.allReduce(t)
	}
	b.Sync()
	return time.Since(t0) / time.Duration(reps)
}

// TimeAllGather measures the all-gather of a [rows, cols] buffer split on
// its columns (evenly over the ranks) into a replicated one, as NLL and
// Argmax run it on the logits, and returns the time per call.
func (b *Backend) TimeAllGather(rows, cols, reps int) time.Duration {
	n := len(b.ranks)
	if rows <= 0 || cols <= 0 || reps <= 0 || cols%n != 0 {
		return 0
	}
	split := make([][2]int, n)
	for r := range split {
		split[r] = [2]int{r * cols / n, (r + 1) * cols / n}
	}
	t := &Buf{rows: rows, cols: cols}
	defer b.release(t)
	run := func() {
		b.layout(t, split)
		b.replicate(t)
	}
	run()
	b.Sync()
	t0 := time.Now()
	for range reps {
		run()
	}
	b.Sync()
	return time.Since(t0) / time.Duration(reps)
}

// Barrier returns once every rank of the job has reached it: with ranks in
// several processes (one a process, as NewRank makes them), each waits for
// the others (still loading, say) through the communicator; the ranks of
// one process are in step already.
func (b *Backend) Barrier() error {
	if b.allLocal() {
		return nil
	}
	b.Sync()
	if err := b.comm.AllReduceSum(b.local[0], []float32{1}); err != nil {
		return fmt.Errorf("tp: barrier: %w", err)
	}
	return nil
}

// Size is the number of ranks.
func (b *Backend) Size() int { return len(b.ranks) }

// Rank returns the backend of rank r (nil for a rank of another process).
func (b *Backend) Rank(r int) runtime.Backend { return b.ranks[r] }

// Local lists the ranks this process runs.
func (b *Backend) Local() []int { return slices.Clone(b.local) }

// Ranks is the number of ranks.
func (b *Backend) Ranks() int { return len(b.ranks) }

// Name implements runtime.Backend: "tp<N>", the rank when this process runs
// one, the communicator when it has a name, and the first local rank's
// name, e.g. "tp2(nccl 22803, peer memory):cuda:NVIDIA H200" or "tp2 rank
// 1(tcp):cpu".
func (b *Backend) Name() string {
	c := ""
	if !b.allLocal() && len(b.local) == 1 {
		c = fmt.Sprintf(" rank %d", b.local[0])
	}
	var how []string
	if nc, ok := b.comm.(interface{ Name() string }); ok {
		how = append(how, nc.Name())
	}
	if b.peer != nil {
		how = append(how, "peer memory")
	}
	if len(how) > 0 {
		c += "(" + strings.Join(how, ", ") + ")"
	}
	return fmt.Sprintf("tp%d%s:%s", len(b.ranks), c, b.first().Name())
}

// Close implements runtime.Backend: it closes every rank backend and the
// communicator.
func (b *Backend) Close() error {
	for _, w := range b.workers {
		if w != nil {
			w.stop()
		}
	}
	b.workers = nil
	var errs []error
	for _, r := range b.local {
		errs = append(errs, b.ranks[r].Close())
	}
	errs = append(errs, b.comm.Close())
	return errors.Join(errs...)
}

// each runs fn for every local rank concurrently and re-raises a rank's
// panic in the caller: the first rank's to panic, since the others' may
// only follow from it (rankPanicked aborts an Aborter communicator, where
// the other ranks may wait for the failed one: the in-process and NCCL
// communicators; the socket's collectives end at their time-out, and the
// peer-memory kernels at theirs).
func (b *Backend) each(fn func(r int)) {
	if len(b.local) == 1 {
		fn(b.local[0])
		return
	}
	b.firstPanic.Store(0)
	if b.workers != nil {
		rest := b.local[1:]
		for _, r := range rest {
			b.workers[r].post(fn)
		}
		b.runRank(fn, b.local[0])
		for _, r := range rest {
			b.workers[r].wait()
		}
	} else {
		var wg sync.WaitGroup
		for _, r := range b.local {
			wg.Add(1)
			go func() {
				defer wg.Done()
				b.runRank(fn, r)
			}()
		}
		wg.Wait()
	}
	if f := b.firstPanic.Load(); f > 0 {
		p := b.firstValue
		b.firstValue = nil
		panic(fmt.Sprintf("tp rank %d: %v", f-1, p))
	}
}

// runRank runs fn(r), passing a panic to rankPanicked.
func (b *Backend) runRank(fn func(r int), r int) {
	defer func() {
		if p := recover(); p != nil {
			b.rankPanicked(r, p)
		}
	}()
	fn(r)
}

// rankPanicked notes rank r's panic p in an each (the first one's is the
// one each re-raises) and aborts the communicator where it can be: the
// other ranks may be waiting for rank r in a collective it will not reach,
// and would wait forever.
func (b *Backend) rankPanicked(r int, p any) {
	if b.firstPanic.CompareAndSwap(0, int32(r)+1) {
		b.firstValue = p
	}
	if b.aborter != nil {
		b.aborter.Abort()
	}
}

// Buf is the tensor-parallel activation buffer: one buffer per local rank,
// with a layout.
type Buf struct {
	rows, cols int
	parts      []runtime.Buf // by rank; nil until an operation writes it (zeros)
	split      [][2]int      // nil: replicated; else each rank's column range
	// raw: made by AllocRaw, its first writer writes it whole, so its
	// rank buffers need no zeroing
	raw bool
	// seq: where a sequence-parallel exchange left it (seqpar.go); be, the
	// backend whose exchange makes it whole again (bufOf), while it is not
	// seqWhole
	seq seqState
	be  *Backend
}

// Rows implements runtime.Buf.
func (x *Buf) Rows() int { return x.rows }

// Cols implements runtime.Buf.
func (x *Buf) Cols() int { return x.cols }

// Replicated reports whether every rank holds the whole matrix.
func (x *Buf) Replicated() bool { return x.split == nil }

// bufOf is x as the tensor-parallel buffer it is, made whole first where a
// sequence-parallel exchange left it split by rows (seqpar.go): every
// operation but those that take it so sees it whole.
func bufOf(x runtime.Buf) *Buf {
	t := rawBuf(x)
	if t.seq != seqWhole {
		t.be.settle(t)
	}
	return t
}

// rawBuf is x as the tensor-parallel buffer it is, as it is.
func rawBuf(x runtime.Buf) *Buf {
	t, ok := x.(*Buf)
	if !ok {
		panic(fmt.Sprintf("tp: buffer of type %T does not belong to the tensor-parallel backend", x))
	}
	return t
}

// Linear is an uploaded weight: one piece per rank.
type Linear struct {
	name    string
	out, in int
	split   shard.Split
	ranges  [][2]int
	parts   []runtime.Linear
}

// Out implements runtime.Linear.
func (l *Linear) Out() int { return l.out }

// In implements runtime.Linear.
func (l *Linear) In() int { return l.in }

func linearOf(w runtime.Linear) *Linear {
	l, ok := w.(*Linear)
	if !ok {
		panic(fmt.Sprintf("tp: linear weight of type %T does not belong to the tensor-parallel backend", w))
	}
	return l
}

type vector struct {
	n     int
	split [][2]int // nil: replicated
	parts []runtime.Vector
}

func (v *vector) Len() int { return v.n }

func vectorOf(v runtime.Vector) *vector {
	if v == nil {
		return nil
	}
	x, ok := v.(*vector)
	if !ok {
		panic(fmt.Sprintf("tp: vector of type %T does not belong to the tensor-parallel backend", v))
	}
	return x
}

func (v *vector) part(r int) runtime.Vector {
	if v == nil {
		return nil
	}
	return v.parts[r]
}

type kvCache struct {
	maxSeq int
	parts  []runtime.KVCache
}

func (c *kvCache) MaxSeq() int { return c.maxSeq }

// pieces returns the per-rank pieces of the tensor name: taken from a
// *shard.Tensor (checking its split matches this backend's) or split now.
func (b *Backend) pieces(name string, t model.Tensor) (shard.Split, [][2]int, []model.Tensor, error) {
	n := len(b.ranks)
	if st, ok := t.(*shard.Tensor); ok {
		e := &st.Entry
		if len(st.Parts) != n {
			return "", nil, nil, fmt.Errorf("%s: sharded for %d ranks, the tensor-parallel backend has %d", name, len(st.Parts), n)
		}
		split, ranges, err := shard.Layout(b.cfg, n, name, e.Shape)
		if err != nil {
			return "", nil, nil, err
		}
		if split != e.Split || !slices.Equal(ranges, e.Ranges) {
			return "", nil, nil, fmt.Errorf("%s: stored as a %s split %v, this backend splits it %s %v", name, e.Split, e.Ranges, split, ranges)
		}
		return split, ranges, st.Parts, nil
	}
	rt, err := shard.Resolve(name, t)
	if err != nil {
		return "", nil, nil, err
	}
	e, err := shard.Describe(b.cfg, n, name, rt)
	if err != nil {
		return "", nil, nil, err
	}
	parts, err := shard.SplitTensor(&e, rt)
	if err != nil {
		return "", nil, nil, err
	}
	return e.Split, e.Ranges, parts, nil
}

// UploadLinear implements runtime.Backend: the weight is split by the rule
// for its canonical name and each piece uploaded to its rank.
func (b *Backend) UploadLinear(name string, t model.Tensor) (runtime.Linear, error) {
	if t == nil {
		return nil, fmt.Errorf("%s: nil tensor", name)
	}
	s := t.Shape()
	if len(s) != 2 {
		return nil, fmt.Errorf("%s: linear weight has shape %v, want [out, in]", name, s)
	}
	split, ranges, parts, err := b.pieces(name, t)
	if err != nil {
		return nil, err
	}
	l := &Linear{name: name, out: s[0], in: s[1], split: split, ranges: ranges, parts: make([]runtime.Linear, len(b.ranks))}
	errs := make([]error, len(b.ranks))
	b.each(func(r int) {
		p := parts[0]
		if split != shard.Replicated {
			p = parts[r]
		}
		if l.parts[r], errs[r] = b.ranks[r].UploadLinear(name, p); errs[r] != nil {
			errs[r] = fmt.Errorf("rank %d: %w", r, errs[r])
		}
	})
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return l, nil
}

// UploadVector implements runtime.Backend: q/k/v biases are split with
// their heads, everything else replicated.
func (b *Backend) UploadVector(name string, t model.Tensor) (runtime.Vector, error) {
	if t == nil {
		return nil, fmt.Errorf("%s: nil tensor", name)
	}
	s := t.Shape()
	if len(s) != 1 {
		return nil, fmt.Errorf("%s: vector has shape %v, want one dimension", name, s)
	}
	split, ranges, parts, err := b.pieces(name, t)
	if err != nil {
		return nil, err
	}
	v := &vector{n: s[0], parts: make([]runtime.Vector, len(b.ranks))}
	if split != shard.Replicated {
		v.split = ranges
	}
	errs := make([]error, len(b.ranks))
	b.each(func(r int) {
		p := parts[0]
		if split != shard.Replicated {
			p = parts[r]
		}
		if v.parts[r], errs[r] = b.ranks[r].UploadVector(name, p); errs[r] != nil {
			errs[r] = fmt.Errorf("rank %d: %w", r, errs[r])
		}
	})
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return v, nil
}

// Alloc implements runtime.Backend. Rank buffers are allocated by the
// operation that first writes the buffer, in the layout it produces.
func (b *Backend) Alloc(rows, cols int) runtime.Buf {
	if rows < 0 || cols < 0 {
		panic(fmt.Sprintf("tp.Alloc: negative shape [%d %d]", rows, cols))
	}
	return &Buf{rows: rows, cols: cols}
}

var _ runtime.RawAllocator = (*Backend)(nil)

// AllocRaw implements runtime.RawAllocator: Alloc whose rank buffers are
// not zeroed (where the rank backends can skip it).
func (b *Backend) AllocRaw(rows, cols int) runtime.Buf {
	t := b.Alloc(rows, cols).(*Buf)
	t.raw = true
	return t
}

// rankAlloc allocates rank r's buffer of t: not zeroed when t is raw.
func (b *Backend) rankAlloc(t *Buf, r, cols int) runtime.Buf {
	if t.raw {
		return runtime.AllocRaw(b.ranks[r], t.rows, cols)
	}
	return b.ranks[r].Alloc(t.rows, cols)
}

// Free implements runtime.Backend.
func (b *Backend) Free(x runtime.Buf) {
	t := rawBuf(x)
	b.markWhole(t) // the sums that were due are not wanted
	b.release(t)
}

func (b *Backend) release(t *Buf) {
	if t.parts == nil {
		return
	}
	for _, r := range b.local {
		if p := t.parts[r]; p != nil {
			b.ranks[r].Free(p)
		}
	}
	t.parts, t.split = nil, nil
}

// width is the number of columns rank r holds in layout split.
func width(cols int, split [][2]int, r int) int {
	if split == nil {
		return cols
	}
	return split[r][1] - split[r][0]
}

// layout makes t hold rank buffers of layout split, allocating fresh
// ones (zeroed unless t is raw) when it has none or a different layout;
// the old contents are discarded.
func (b *Backend) layout(t *Buf, split [][2]int) {
	if t.parts != nil && slices.Equal(t.split, split) {
		return
	}
	b.release(t)
	parts := make([]runtime.Buf, len(b.ranks))
	if b.workers != nil {
		b.each(func(r int) { parts[r] = b.rankAlloc(t, r, width(t.cols, split, r)) })
	} else {
		for _, r := range b.local {
			parts[r] = b.rankAlloc(t, r, width(t.cols, split, r))
		}
	}
	t.parts, t.split = parts, split
}

// run makes d hold rank buffers of layout split (as layout does) and runs
// fn on every rank. Fresh rank buffers are allocated by the ranks in the
// same dispatch as fn; fn(r) may read only d.parts[r] of d.
func (b *Backend) run(d *Buf, split [][2]int, fn func(r int)) {
	if b.workers == nil || (d.parts != nil && slices.Equal(d.split, split)) {
		b.layout(d, split)
		b.each(fn)
		return
	}
	b.release(d)
	d.parts, d.split = make([]runtime.Buf, len(b.ranks)), split
	b.each(func(r int) {
		d.parts[r] = b.rankAlloc(d, r, width(d.cols, split, r))
		fn(r)
	})
}

// replicate converts t to the replicated layout, all-gathering a split
// buffer; an unwritten buffer becomes replicated zeros.
func (b *Backend) replicate(t *Buf) {
	b.settleSplit(nil)
	if t.parts == nil {
		b.layout(t, nil)
		return
	}
	if t.split == nil {
		return
	}
	if t.rows == 1 && b.PeerMemory(t.cols) && !b.skipComm {
		b.replicatePeer(t)
		return
	}
	if b.dcomm != nil && evenSplit(t.cols, t.split) {
		b.replicateDevice(t)
		return
	}
	n := len(b.ranks)
	maxW := 0
	for r := range n {
		maxW = max(maxW, width(t.cols, t.split, r))
	}
	rows := t.rows
	old, split := t.parts, t.split
	full := make([]runtime.Buf, n)
	b.each(func(r int) {
		be := b.ranks[r]
		w := width(t.cols, split, r)
		send := make([]float32, rows*maxW) // padded: the collective needs equal counts
		be.Download(send[:rows*w], old[r])
		recv := make([]float32, n*rows*maxW)
		if err := b.comm.AllGather(r, send, recv); err != nil {
			panic(fmt.Sprintf("tp: all-gather: %v", err))
		}
		out := make([]float32, rows*t.cols)
		for j := range n {
			c0, wj := split[j][0], split[j][1]-split[j][0]
			src := recv[j*rows*maxW:]
			for i := 0; i < rows; i++ {
				copy(out[i*t.cols+c0:i*t.cols+c0+wj], src[i*wj:(i+1)*wj])
			}
		}
		be.Free(old[r])
		full[r] = runtime.AllocRaw(be, rows, t.cols)
		be.Upload(full[r], out)
	})
	t.parts, t.split = full, nil
}

// toSplit converts t to the column-split layout split.
func (b *Backend) toSplit(t *Buf, split [][2]int) {
	if t.parts == nil {
		b.layout(t, split)
		return
	}
	if slices.Equal(t.split, split) {
		return
	}
	if t.split != nil {
		b.replicate(t)
	}
	old := t.parts
	parts := make([]runtime.Buf, len(b.ranks))
	if b.dcomm != nil {
		b.each(func(r int) {
			c0, w := split[r][0], split[r][1]-split[r][0]
			parts[r] = runtime.AllocRaw(b.ranks[r], t.rows, w)
			b.dev[r].Copy2D(parts[r], 0, 0, old[r], 0, c0, t.rows, w)
			b.ranks[r].Free(old[r])
		})
		t.parts, t.split = parts, split
		return
	}
	b.each(func(r int) {
		be := b.ranks[r]
		all := make([]float32, t.rows*t.cols)
		be.Download(all, old[r])
		c0, w := split[r][0], split[r][1]-split[r][0]
		mine := make([]float32, t.rows*w)
		for i := 0; i < t.rows; i++ {
			copy(mine[i*w:(i+1)*w], all[i*t.cols+c0:i*t.cols+c0+w])
		}
		be.Free(old[r])
		parts[r] = runtime.AllocRaw(be, t.rows, w)
		be.Upload(parts[r], mine)
	})
	t.parts, t.split = parts, split
}

// allReduce sums the replicated-shape rank buffers of t over the ranks.
func (b *Backend) allReduce(t *Buf) {
	b.settleSplit(nil)
	if b.dcomm != nil {
		b.allReduceDevice(t)
		return
	}
	b.each(func(r int) {
		be := b.ranks[r]
		host := make([]float32, t.rows*t.cols)
		be.Download(host, t.parts[r])
		if err := b.comm.AllReduceSum(r, host); err != nil {
			panic(fmt.Sprintf("tp: all-reduce: %v", err))
		}
		be.Upload(t.parts[r], host)
	})
}

// Upload implements runtime.Backend: the values are replicated on every rank.
func (b *Backend) Upload(dst runtime.Buf, src []float32) {
	d := bufOf(dst)
	if len(src) != d.rows*d.cols {
		panic(fmt.Sprintf("tp.Upload: %d values into [%d %d]", len(src), d.rows, d.cols))
	}
	b.layout(d, nil)
	b.each(func(r int) { b.ranks[r].Upload(d.parts[r], src) })
}

// Download implements runtime.Backend: the first local rank's copy of a
// replicated buffer, or the column pieces of a split one put together (in
// a process of a multi-process job: all-gathered first, so every process
// must download it).
func (b *Backend) Download(dst []float32, src runtime.Buf) {
	s := bufOf(src)
	if len(dst) != s.rows*s.cols {
		panic(fmt.Sprintf("tp.Download: [%d %d] into %d values", s.rows, s.cols, len(dst)))
	}
	switch {
	case s.parts == nil:
		clear(dst)
	case s.split == nil:
		b.first().Download(dst, s.parts[b.local[0]])
	case !b.allLocal():
		b.replicate(s) // the pieces of other processes' ranks come by all-gather
		b.first().Download(dst, s.parts[b.local[0]])
	default:
		for r, be := range b.ranks {
			c0, w := s.split[r][0], s.split[r][1]-s.split[r][0]
			tmp := make([]float32, s.rows*w)
			be.Download(tmp, s.parts[r])
			for i := 0; i < s.rows; i++ {
				copy(dst[i*s.cols+c0:i*s.cols+c0+w], tmp[i*w:(i+1)*w])
			}
		}
	}
}

// NewKVCache implements runtime.Backend: each rank caches its KV heads.
func (b *Backend) NewKVCache(layers, maxSeq, kvDim int) runtime.KVCache {
	if kvDim != b.cfg.KVDim() {
		panic(fmt.Sprintf("tp.NewKVCache: kv dim %d, the model's is %d", kvDim, b.cfg.KVDim()))
	}
	c := &kvCache{maxSeq: maxSeq, parts: make([]runtime.KVCache, len(b.ranks))}
	for _, r := range b.local {
		c.parts[r] = b.ranks[r].NewKVCache(layers, maxSeq, b.kv[r][1]-b.kv[r][0])
	}
	return c
}

// NewInt8KVCache implements runtime.Int8KVBackend: each rank caches its
// KV heads as int8 with their channels' quantizers.
func (b *Backend) NewInt8KVCache(maxSeq, kvDim int, layers []runtime.KVQuant) (runtime.KVCache, error) {
	if kvDim != b.cfg.KVDim() {
		return nil, fmt.Errorf("tp: int8 KV cache of width %d, the model's is %d", kvDim, b.cfg.KVDim())
	}
	c := &kvCache{maxSeq: maxSeq, parts: make([]runtime.KVCache, len(b.ranks))}
	for _, r := range b.local {
		rb, ok := b.ranks[r].(runtime.Int8KVBackend)
		if !ok {
			return nil, fmt.Errorf("tp: rank %d (%s) cannot hold an int8 KV cache", r, b.ranks[r].Name())
		}
		lo, hi := b.kv[r][0], b.kv[r][1]
		part := make([]runtime.KVQuant, len(layers))
		for l, q := range layers {
			if err := q.Validate(kvDim); err != nil {
				return nil, fmt.Errorf("tp: layer %d: %w", l, err)
			}
			part[l] = runtime.KVQuant{KScale: q.KScale[lo:hi], KOffset: q.KOffset[lo:hi], VScale: q.VScale[lo:hi], VOffset: q.VOffset[lo:hi]}
		}
		var err error
		if c.parts[r], err = rb.NewInt8KVCache(maxSeq, hi-lo, part); err != nil {
			return nil, fmt.Errorf("tp: rank %d: %w", r, err)
		}
	}
	return c, nil
}

func cacheOf(c runtime.KVCache) *kvCache {
	x, ok := c.(*kvCache)
	if !ok {
		panic(fmt.Sprintf("tp: KV cache of type %T does not belong to the tensor-parallel backend", c))
	}
	return x
}

// Embed implements runtime.Backend: vocabulary-parallel lookup (rank r
// fills the rows of the ids in its range, zeros elsewhere) and all-reduce.
func (b *Backend) Embed(dst runtime.Buf, table runtime.Linear, ids []int) {
	d, tl := bufOf(dst), linearOf(table)
	if d.rows != len(ids) || d.cols != tl.in {
		panic(fmt.Sprintf("tp.Embed: %d ids into [%d %d], table width %d", len(ids), d.rows, d.cols, tl.in))
	}
	for i, id := range ids {
		if id < 0 || id >= tl.out {
			panic(fmt.Sprintf("tp.Embed: id %d at %d outside the table of %d rows", id, i, tl.out))
		}
	}
	b.layout(d, nil)
	if tl.split == shard.Replicated {
		b.each(func(r int) { b.ranks[r].Embed(d.parts[r], tl.parts[r], ids) })
		return
	}
	if tl.split != shard.Vocab {
		panic(fmt.Sprintf("tp.Embed: table %s is split %s, want vocab or replicated", tl.name, tl.split))
	}
	if b.dcomm != nil {
		b.each(func(r int) { b.dev[r].EmbedRange(d.parts[r], tl.parts[r], ids, tl.ranges[r][0]) })
		b.allReduceDevice(d)
		return
	}
	b.each(func(r int) {
		be := b.ranks[r]
		lo, hi := tl.ranges[r][0], tl.ranges[r][1]
		local := make([]int, len(ids))
		for i, id := range ids {
			if id >= lo && id < hi {
				local[i] = id - lo
			}
		}
		be.Embed(d.parts[r], tl.parts[r], local)
		host := make([]float32, d.rows*d.cols)
		be.Download(host, d.parts[r])
		for i, id := range ids {
			if id < lo || id >= hi {
				clear(host[i*d.cols : (i+1)*d.cols])
			}
		}
		if err := b.comm.AllReduceSum(r, host); err != nil {
			panic(fmt.Sprintf("tp: all-reduce: %v", err))
		}
		be.Upload(d.parts[r], host)
	})
}

// RMSNorm implements runtime.Backend on a replicated x, on every rank.
func (b *Backend) RMSNorm(dst, x runtime.Buf, w, bias runtime.Vector, eps float32) {
	d, s := bufOf(dst), bufOf(x)
	wv, bv := vectorOf(w), vectorOf(bias)
	if wv == nil || wv.split != nil || (bv != nil && bv.split != nil) {
		panic("tp.RMSNorm: norm weight and bias must be replicated vectors")
	}
	b.replicate(s)
	b.run(d, nil, func(r int) { b.ranks[r].RMSNorm(d.parts[r], s.parts[r], wv.parts[r], bv.part(r), eps) })
}

// RMSNormHeads implements runtime.Backend on each rank's local heads.
func (b *Backend) RMSNormHeads(x runtime.Buf, headDim int, w runtime.Vector, eps float32) {
	s, wv := bufOf(x), vectorOf(w)
	if s.parts == nil {
		b.replicate(s)
	}
	b.each(func(r int) { b.ranks[r].RMSNormHeads(s.parts[r], headDim, wv.parts[r], eps) })
}

// MatMul implements runtime.Backend; see the package documentation for the
// layouts of each kind of weight.
func (b *Backend) MatMul(dst, x runtime.Buf, w runtime.Linear) {
	d, s, l := bufOf(dst), bufOf(x), linearOf(w)
	if s.cols != l.in || d.cols != l.out || d.rows != s.rows {
		panic(fmt.Sprintf("tp.MatMul: x [%d %d], dst [%d %d], weight %s [%d %d]", s.rows, s.cols, d.rows, d.cols, l.name, l.out, l.in))
	}
	switch l.split {
	case shard.Column, shard.Vocab:
		b.replicate(s)
		b.run(d, l.ranges, func(r int) { b.ranks[r].MatMul(d.parts[r], s.parts[r], l.parts[r]) })
	case shard.Row:
		b.toSplit(s, l.ranges)
		b.run(d, nil, func(r int) { b.ranks[r].MatMul(d.parts[r], s.parts[r], l.parts[r]) })
		b.allReduce(d)
	default:
		b.replicate(s)
		b.run(d, nil, func(r int) { b.ranks[r].MatMul(d.parts[r], s.parts[r], l.parts[r]) })
	}
}

// AddBias implements runtime.Backend: a split bias (q/k/v) on the matching
// column pieces, a replicated one on a replicated x.
func (b *Backend) AddBias(x runtime.Buf, bias runtime.Vector) {
	s, bv := bufOf(x), vectorOf(bias)
	if bv.split != nil {
		b.toSplit(s, bv.split)
	} else {
		b.replicate(s)
	}
	b.each(func(r int) { b.ranks[r].AddBias(s.parts[r], bv.parts[r]) })
}

// RoPE implements runtime.Backend on each rank's local heads.
func (b *Backend) RoPE(x runtime.Buf, headDim, pos0 int, theta float64, layout model.RopeLayout) {
	s := bufOf(x)
	if s.parts == nil {
		b.replicate(s)
	}
	b.each(func(r int) { b.ranks[r].RoPE(s.parts[r], headDim, pos0, theta, layout) })
}

// StoreKV implements runtime.Backend: each rank stores its KV heads.
func (b *Backend) StoreKV(c runtime.KVCache, layer, pos0 int, k, v runtime.Buf) {
	kc, kb, vb := cacheOf(c), bufOf(k), bufOf(v)
	b.toSplit(kb, b.kv)
	b.toSplit(vb, b.kv)
	b.each(func(r int) { b.ranks[r].StoreKV(kc.parts[r], layer, pos0, kb.parts[r], vb.parts[r]) })
}

// Attention implements runtime.Backend: each rank attends with its heads
// over its KV heads.
func (b *Backend) Attention(dst, q runtime.Buf, c runtime.KVCache, layer, pos0, heads, kvHeads, headDim int) {
	d, s, kc := bufOf(dst), bufOf(q), cacheOf(c)
	split := b.splitHeads("tp.Attention", s, heads, kvHeads, headDim)
	n := len(b.ranks)
	b.run(d, split, func(r int) {
		b.ranks[r].Attention(d.parts[r], s.parts[r], kc.parts[r], layer, pos0, heads/n, kvHeads/n, headDim)
	})
}

// splitHeads checks that heads and kvHeads of headDim divide over the
// ranks and match the model, splits q by heads (rank r its heads·cols/n
// columns) and returns the split: an attention's layout.
func (b *Backend) splitHeads(op string, q *Buf, heads, kvHeads, headDim int) [][2]int {
	n := len(b.ranks)
	if heads%n != 0 || kvHeads%n != 0 || kvHeads*headDim != b.cfg.KVDim() || heads*headDim != q.cols {
		panic(fmt.Sprintf("%s: q of %d columns, %d heads, %d KV heads × %d over %d ranks (model KV dim %d)", op, q.cols, heads, kvHeads, headDim, n, b.cfg.KVDim()))
	}
	split := headSplit(q.cols, n)
	b.toSplit(q, split)
	return split
}

var _ runtime.RowCopier = (*Backend)(nil)

// CopyRows implements runtime.RowCopier on every rank's piece: dst takes
// src's layout (keeping its values where it has another one) and each
// rank copies the rows of its piece (runtime.CopyRows: on the device
// where the rank backend can).
func (b *Backend) CopyRows(dst runtime.Buf, dstRow int, src runtime.Buf, srcRow, n int) {
	d, s := bufOf(dst), bufOf(src)
	runtime.CheckCopyRows("tp.CopyRows", d, dstRow, s, srcRow, n)
	if s.parts == nil {
		b.replicate(s) // unwritten: zeros
	}
	if d.parts != nil {
		b.conform(d, s)
	}
	b.run(d, s.split, func(r int) { runtime.CopyRows(b.ranks[r], d.parts[r], dstRow, s.parts[r], srcRow, n) })
}

// conform brings t to the layout of ref (replicated or the same split).
func (b *Backend) conform(t, ref *Buf) {
	if ref.split == nil {
		b.replicate(t)
	} else {
		b.toSplit(t, ref.split)
	}
}

// SiLUMul implements runtime.Backend on matching pieces.
func (b *Backend) SiLUMul(dst, gate, up runtime.Buf) {
	d, g, u := bufOf(dst), bufOf(gate), bufOf(up)
	if g.parts == nil {
		b.replicate(g)
	}
	b.conform(u, g)
	if d != g {
		b.layout(d, g.split)
	}
	b.each(func(r int) { b.ranks[r].SiLUMul(d.parts[r], g.parts[r], u.parts[r]) })
}

// Add implements runtime.Backend: on matching column pieces, else on
// replicated buffers.
func (b *Backend) Add(dst, x runtime.Buf) {
	d, s := bufOf(dst), bufOf(x)
	if d.parts != nil && d.split != nil && s.parts != nil && slices.Equal(d.split, s.split) {
		// Both split alike: add piecewise.
	} else {
		b.replicate(d)
		b.replicate(s)
	}
	b.each(func(r int) { b.ranks[r].Add(d.parts[r], s.parts[r]) })
}

// NLL implements runtime.Backend: the logits are all-gathered and the
// first local rank computes the NLL exactly as an unsplit backend would.
func (b *Backend) NLL(out []float64, logits runtime.Buf, targets []int) {
	l := bufOf(logits)
	b.replicate(l)
	b.first().NLL(out, l.parts[b.local[0]], targets)
}

// Argmax implements runtime.Backend on the all-gathered logits.
func (b *Backend) Argmax(logits runtime.Buf) []int {
	l := bufOf(logits)
	b.replicate(l)
	return b.first().Argmax(l.parts[b.local[0]])
}

// evenSplit reports whether every rank holds the same number of columns,
// in rank order (the layout the device all-gather reassembles).
func evenSplit(cols int, split [][2]int) bool {
	w := split[0][1] - split[0][0]
	for r, s := range split {
		if s[0] != r*w || s[1]-s[0] != w {
			return false
		}
	}
	return len(split)*w == cols
}

// allReduceDevice queues the in-place all-reduce of t's rank buffers on the
// ranks' streams.
func (b *Backend) allReduceDevice(t *Buf) {
	count := t.rows * t.cols
	if count == 0 || b.skipComm {
		return
	}
	if b.PeerMemory(count) {
		b.each(func(r int) { b.peer[r].AllReducePeer(t.parts[r]) })
		return
	}
	if !b.grouped {
		errs := make([]error, len(b.ranks))
		b.each(func(r int) {
			p := b.dev[r].BufPtr(t.parts[r])
			b.dev[r].Do(func() { errs[r] = b.rcomm.AllReduceSumDeviceRank(r, p, count, b.dev[r].Stream()) })
		})
		if err := errors.Join(errs...); err != nil {
			panic(fmt.Sprintf("tp: all-reduce: %v", err))
		}
		return
	}
	ptrs := make([]uint64, 0, len(b.local))
	for _, r := range b.local {
		ptrs = append(ptrs, b.dev[r].BufPtr(t.parts[r]))
	}
	var err error
	b.dev[b.local[0]].Do(func() { err = b.dcomm.AllReduceSumDevice(ptrs, count, b.streams) })
	if err != nil {
		panic(fmt.Sprintf("tp: all-reduce: %v", err))
	}
}

// negZero is the bits of −0, the float x + (−0) and (−0) + x leave as x
// (every x but NaN, −0 and +0 included; a NaN stays a NaN, perhaps with
// another payload).
const negZero = 0x80000000

// replicatePeer all-gathers the split single row t over peer memory (a
// decode step's logits): each rank puts its piece into a row of −0 and the
// group sums the rows, in rank order, adding each value to −0s only, so
// every value keeps its bits (a NaN stays a NaN). A fill, a copy and the
// all-reduce's one launch, where NCCL's all-gather of a 32 000-value row
// took 16.7 µs (runtime/tp/README.md, measured alone).
func (b *Backend) replicatePeer(t *Buf) {
	old, split := t.parts, t.split
	full := make([]runtime.Buf, len(b.ranks))
	b.each(func(r int) {
		full[r] = runtime.AllocRaw(b.ranks[r], 1, t.cols)
		b.peer[r].FillBits(full[r], negZero)
		b.peer[r].Copy2D(full[r], 0, split[r][0], old[r], 0, 0, 1, width(t.cols, split, r))
		b.peer[r].AllReducePeer(full[r])
		b.ranks[r].Free(old[r])
	})
	t.parts, t.split = full, nil
}

// replicateDevice all-gathers the evenly split t on the devices: each rank
// receives the pieces in rank order ([rank][rows][w]) and reassembles the
// rows with strided copies (a single row needs none).
func (b *Backend) replicateDevice(t *Buf) {
	n := len(b.ranks)
	rows, cols := t.rows, t.cols
	w := cols / n
	old, split := t.parts, t.split
	full := make([]runtime.Buf, n)
	recv := make([]runtime.Buf, n)
	b.each(func(r int) {
		full[r] = runtime.AllocRaw(b.ranks[r], rows, cols) // the pieces cover it
		recv[r] = full[r]
		if rows > 1 {
			recv[r] = runtime.AllocRaw(b.ranks[r], n*rows, w)
		}
	})
	if rows*w > 0 && !b.skipComm {
		var err error
		if b.grouped {
			var send, to []uint64
			for _, r := range b.local {
				send, to = append(send, b.dev[r].BufPtr(old[r])), append(to, b.dev[r].BufPtr(recv[r]))
			}
			b.dev[b.local[0]].Do(func() { err = b.dcomm.AllGatherDevice(send, to, rows*w, b.streams) })
		} else {
			errs := make([]error, n)
			b.each(func(r int) {
				d := b.dev[r]
				d.Do(func() {
					errs[r] = b.rcomm.AllGatherDeviceRank(r, d.BufPtr(old[r]), d.BufPtr(recv[r]), rows*w, d.Stream())
				})
			})
			err = errors.Join(errs...)
		}
		if err != nil {
			panic(fmt.Sprintf("tp: all-gather: %v", err))
		}
	}
	b.each(func(r int) {
		if rows > 1 {
			for j := range n {
				b.dev[r].Copy2D(full[r], 0, split[j][0], recv[r], j*rows, 0, rows, w)
			}
			b.ranks[r].Free(recv[r])
		}
		b.ranks[r].Free(old[r])
	})
	t.parts, t.split = full, nil
}
