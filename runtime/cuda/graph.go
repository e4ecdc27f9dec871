package cuda

import (
	"fmt"
	"unsafe"

	"qtool/runtime"
	"qtool/runtime/cuda/driver"
)

// Graph is a captured single-token decode step. Replaying it runs the step
// at the position held on the device, writes the greedy next token where the
// next replay's Embed reads it, and advances the position.
type Graph struct {
	b     *Backend
	g     driver.Graph
	e     driver.GraphExec
	bufs  []driver.DevicePtr
	freed bool
}

// BeginCapture starts capturing a decode step at position pos into a graph.
// Between BeginCapture and EndCapture, run exactly one single-token step
// (Embed of one id, the layers, the logits) followed by GreedyAdvance. Run
// the same step once uncaptured first, so that every buffer and scratch area
// it needs exists already. maxHist bounds the generated-token history.
func (b *Backend) BeginCapture(pos, maxHist int) error {
	if b.capturing {
		return fmt.Errorf("cuda: capture already in progress")
	}
	defer b.enter()()
	if b.dstate == 0 {
		b.dstate = b.scratchBuf("dstate", 64)
	}
	if b.histLen < maxHist {
		b.hist = b.scratchBuf("hist", 4*maxHist)
		b.histLen = maxHist
	}
	b.scratchBuf("argmax", 64)
	if err := b.drv.StreamSynchronize(b.stream); err != nil {
		return err
	}
	if err := b.drv.BeginCapture(b.stream); err != nil {
		return err
	}
	b.capturing, b.capPos, b.capBase, b.capAllocs = true, true, pos, map[driver.DevicePtr]bool{}
	b.captures++
	return nil
}

// GreedyAdvance (inside a capture) takes the argmax of the single row of
// logits as the next token, appends it to the history at the current
// position, feeds it to the next step and advances the position.
func (b *Backend) GreedyAdvance(logits runtime.Buf) {
	l := buf(logits)
	if !b.capturing || l.rows != 1 {
		panic("cuda backend: GreedyAdvance needs a capture and one row of logits")
	}
	defer b.enter()()
	b.launchArgmax(b.scratchBuf("argmax", 64), l, true)
}

var _ runtime.DecodeGrapher = (*Backend)(nil)

// EndCapture finishes the capture and instantiates the graph (a *Graph).
// Buffers allocated during the capture belong to the graph until Destroy.
func (b *Backend) EndCapture() (runtime.DecodeGraph, error) {
	if !b.capturing {
		return nil, fmt.Errorf("cuda: no capture in progress")
	}
	defer b.enter()()
	b.capturing, b.capPos = false, false
	g, err := b.drv.EndCapture(b.stream)
	if err != nil {
		return nil, err
	}
	e, err := b.drv.GraphInstantiate(g)
	if err != nil {
		b.drv.GraphDestroy(g)
		return nil, err
	}
	gr := &Graph{b: b, g: g, e: e}
	// Take the capture's buffers out of the pool so nothing else reuses them.
	for size, l := range b.pool {
		keep := l[:0]
		for _, p := range l {
			if b.capAllocs[p] {
				gr.bufs = append(gr.bufs, p)
			} else {
				keep = append(keep, p)
			}
		}
		b.pool[size] = keep
	}
	b.capAllocs = nil
	b.graphs = append(b.graphs, gr)
	return gr, nil
}

// SetDecodeState sets the token the next replay embeds and its position.
func (b *Backend) SetDecodeState(id, pos int) {
	defer b.enter()()
	st := []int32{int32(pos), int32(id)}
	b.upload(b.dstate, unsafe.Pointer(&st[0]), 8)
}

// History downloads the tokens GreedyAdvance recorded at positions [from, to).
func (b *Backend) History(from, to int) []int {
	if from < 0 || to > b.histLen || from > to {
		panic("cuda backend: History range")
	}
	defer b.enter()()
	r := make([]int32, to-from)
	out := make([]int, len(r))
	if len(r) == 0 {
		return out
	}
	b.must(b.drv.MemcpyDtoH(unsafe.Pointer(&r[0]), b.hist+driver.DevicePtr(4*from), uint64(4*len(r))))
	for i, v := range r {
		out[i] = int(v)
	}
	return out
}

// Launch queues one replay of the graph.
func (g *Graph) Launch() {
	defer g.b.enter()()
	g.b.must(g.b.drv.GraphLaunch(g.e, g.b.stream))
}

func (g *Graph) destroy() {
	if g.freed {
		return
	}
	g.freed = true
	g.b.drv.GraphExecDestroy(g.e)
	g.b.drv.GraphDestroy(g.g)
	for _, p := range g.bufs {
		g.b.pool[g.b.owned[p]] = append(g.b.pool[g.b.owned[p]], p)
	}
}

// Destroy releases the graph; its buffers go back to the pool.
func (g *Graph) Destroy() {
	defer g.b.enter()()
	g.b.must(g.b.drv.StreamSynchronize(g.b.stream))
	g.destroy()
}

// ---------------------------------------------------------------------------
// Timing and memory, for benchmarks.

// Sync waits for all queued work.
func (b *Backend) Sync() {
	defer b.enter()()
	b.must(b.drv.StreamSynchronize(b.stream))
}

// Time runs f (which queues work on the backend) reps times after warm
// warm-up runs and returns the mean time per run in seconds, measured with
// device events.
func (b *Backend) Time(warm, reps int, f func()) float64 {
	for i := 0; i < warm; i++ {
		f()
	}
	defer b.enter()()
	e0, err := b.drv.EventCreate(0)
	b.must(err)
	e1, err := b.drv.EventCreate(0)
	b.must(err)
	defer b.drv.EventDestroy(e0)
	defer b.drv.EventDestroy(e1)
	b.must(b.drv.EventRecord(e0, b.stream))
	for i := 0; i < reps; i++ {
		f()
	}
	b.must(b.drv.EventRecord(e1, b.stream))
	b.must(b.drv.EventSynchronize(e1))
	ms, err := b.drv.EventElapsed(e0, e1)
	b.must(err)
	return float64(ms) / 1e3 / float64(reps)
}

// MemInfo returns free and total device memory in bytes.
func (b *Backend) MemInfo() (free, total uint64) {
	defer b.enter()()
	free, total, err := b.drv.MemGetInfo()
	b.must(err)
	return free, total
}

// CopyBandwidth measures a device-to-device copy of bytes (counting bytes
// read plus bytes written) and returns bytes per second.
func (b *Backend) CopyBandwidth(bytes int) float64 {
	var src, dst driver.DevicePtr
	func() {
		defer b.enter()()
		src, dst = b.alloc(bytes), b.alloc(bytes)
		b.fill(src, bytes/4, 7, 0, 0)
	}()
	t := b.Time(3, 20, func() {
		defer b.enter()()
		b.must(b.drv.MemcpyDtoDAsync(dst, src, uint64(bytes), b.stream))
	})
	b.release(src)
	b.release(dst)
	return 2 * float64(bytes) / t
}

// TimeDecodeGEMV returns the device time of a one-row product with w, the
// synthetic weight spec made, as a decode step runs it: a replayed graph
// of 20 products cycling through w and copies of it (spec with seeds
// spec.Seed + 1000, + 2000, …) that together exceed the L2 cache three
// times, so none is still cached when it comes round again; and the bytes
// one product reads (the weight as a decode step reads it, x and y). The
// benchmarks' GEMV rates (qtool bench's kernel table, BenchmarkGEMVWaves)
// are these.
func (b *Backend) TimeDecodeGEMV(w runtime.Linear, spec Synthetic) (sec, bytes float64, err error) {
	l := lin(w)
	copies := []runtime.Linear{w}
	defer func() {
		for _, c := range copies[1:] {
			b.FreeLinear(c)
		}
	}()
	for n := int64(b.L2Bytes()); l.Bytes()*int64(len(copies)) < 3*n && len(copies) < 16; {
		s := spec
		s.Seed += uint64(1000 * len(copies))
		c, err := b.UploadLinear("bench", &s)
		if err != nil {
			return 0, 0, err
		}
		copies = append(copies, c)
	}
	x, y := b.Alloc(1, l.in), b.Alloc(1, l.out)
	defer b.Free(x)
	defer b.Free(y)
	b.FillRandom(x, spec.Seed, 1)
	i := 0
	sec, err = b.TimeCaptured(20, func() { b.MatMul(y, x, copies[i%len(copies)]); i++ })
	return sec, float64(l.DecodeBytes() + int64(4*l.in+4*l.out)), err
}

// MatMulGEMM is MatMul forced onto the tensor-core GEMM kernels whatever the
// number of rows (benchmarks compare it with the GEMV path).
func (b *Backend) MatMulGEMM(dst, x runtime.Buf, w runtime.Linear) {
	d, s, l := buf(dst), buf(x), lin(w)
	if s.cols != l.in || d.cols != l.out || d.rows != s.rows || l.in%32 != 0 {
		panic("cuda backend: MatMulGEMM shapes")
	}
	defer b.enter()()
	b.matmul(d, &gemmIn{x: s}, l, true, outStore)
}

// FillRandom fills x with uniform values in [-a, a) (benchmarks).
func (b *Backend) FillRandom(x runtime.Buf, seed uint64, a float32) {
	d := buf(x)
	defer b.enter()()
	b.fill(d.p, d.n(), seed, 2, a)
}

// L2Bytes is the device's L2 cache size (0 if the driver does not say).
func (b *Backend) L2Bytes() int {
	n, err := b.drv.Attribute(b.dev, driver.AttrL2CacheSize)
	if err != nil {
		return 0
	}
	return n
}

// SMs is the number of multiprocessors.
func (b *Backend) SMs() int { return b.sms }

// Options returns the backend's options; changes apply to later calls.
func (b *Backend) Options() *Options { return &b.opt }

// HasWGMMA reports whether the Hopper GEMMs (gemm_wg_*) are loaded: a 9.0
// device with the sm_90a PTX and a driver that encodes tensor maps.
func (b *Backend) HasWGMMA() bool { return b.wgmma }

// HasWideGEMM reports whether w's Hopper GEMM for M activation rows has a
// form of 256 rows a block (Options.WGWide chooses).
func (b *Backend) HasWideGEMM(w runtime.Linear, M int) bool {
	l := lin(w)
	if l.kind == kindW8A8 {
		return wideKernels[b.wgmmaKernel("w8a8_mma", M)] != ""
	}
	return wideKernels[b.unwidenedWG(l, M)] != ""
}

// TimeCaptured captures reps calls of f (which queues kernels only: no
// host transfers) into a graph, replays it and returns the device time per
// call in seconds: kernel time without host launch overhead.
func (b *Backend) TimeCaptured(reps int, f func()) (float64, error) {
	func() {
		defer b.enter()()
		b.must(b.drv.StreamSynchronize(b.stream))
	}()
	f() // warm-up, uncaptured: scratch buffers exist afterwards
	var g driver.Graph
	err := func() error {
		defer b.enter()()
		if err := b.drv.BeginCapture(b.stream); err != nil {
			return err
		}
		b.capturing, b.capBase, b.capAllocs = true, 0, map[driver.DevicePtr]bool{}
		b.captures++
		return nil
	}()
	if err != nil {
		return 0, err
	}
	for i := 0; i < reps; i++ {
		f()
	}
	defer b.enter()()
	b.capturing, b.capAllocs = false, nil
	if g, err = b.drv.EndCapture(b.stream); err != nil {
		return 0, err
	}
	defer b.drv.GraphDestroy(g)
	e, err := b.drv.GraphInstantiate(g)
	if err != nil {
		return 0, err
	}
	defer b.drv.GraphExecDestroy(e)
	b.must(b.drv.GraphLaunch(e, b.stream)) // warm
	e0, err := b.drv.EventCreate(0)
	b.must(err)
	e1, err := b.drv.EventCreate(0)
	b.must(err)
	defer b.drv.EventDestroy(e0)
	defer b.drv.EventDestroy(e1)
	b.must(b.drv.EventRecord(e0, b.stream))
	for i := 0; i < 3; i++ {
		b.must(b.drv.GraphLaunch(e, b.stream))
	}
	b.must(b.drv.EventRecord(e1, b.stream))
	b.must(b.drv.EventSynchronize(e1))
	ms, err := b.drv.EventElapsed(e0, e1)
	b.must(err)
	return float64(ms) / 1e3 / float64(3*reps), nil
}
