package cuda

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/fnv"
	"os"
	"time"
	"unsafe"

	"qtool/runtime"
	"qtool/runtime/cuda/driver"
)

// The all-reduce over peer memory: the ranks of a tensor-parallel group,
// one GPU each, sum their buffers in one kernel (allreduce_peer, whose
// comment in kernels/qtool.cu gives the protocol) instead of through NCCL:
// each rank writes its values straight into the other ranks' exchange
// areas, over NVLink or PCIe, and sums what they wrote into its own. For
// the small messages of a decode step (lane 0) that is one launch a call
// whose values carry the call's number (allreduce_peer_ll): no flag
// exchange; larger ones (lane 1) exchange a flag a block. A rank's backend
// joins one group: OpenPeerReduce allocates its area and describes it (an
// end), the ends of all ranks are
// exchanged (package runtime/tp does that through its communicator),
// ConnectPeerReduce maps the other ranks' areas, and AllReducePeer queues a
// sum on the stream, in CUDA graphs too.

// Sizes the kernel assumes (AR_MAX_RANKS, AR_MAX_BLOCKS, AR_HEADER).
const (
	peerMaxRanks  = 8
	peerMaxBlocks = 128
	peerHeader    = 16384
)

// The kernel's lanes (AR_LANES), each with a grid of its own that every
// call in it uses (at most the SMs of the smallest GPU of the group, so
// that all blocks are resident): sums of up to peerSmallFloats values (a
// decode step's) in a few blocks of allreduce_peer_ll, whose stages hold 8
// bytes a value (the value and the call's number); larger ones (a
// prefill's) on the whole device, for bandwidth.
const (
	peerSmallFloats = 1 << 16
	peerSmallBlocks = 16
	peerLargeBlocks = peerMaxBlocks
)

// peerLane is one lane of a group: its grid, how many values a call holds
// and where its stages begin in the area (in values after the header).
type peerLane struct {
	blocks, capFloats, stride, stageOff int
}

// peerEndBytes is the size of the end OpenPeerReduce returns.
const peerEndBytes = 104

// peerEndMagic begins an end ("qtP3").
const peerEndMagic = 0x3350_7471

// peerEnd is a rank's exchange area as the other ranks find it: the machine
// and process it lives in, its device and address there, its IPC handle
// (for other processes), and the device's SM count.
type peerEnd struct {
	host   uint64 // hash of the host name and boot id
	pid    uint32
	device int32
	sms    int32
	area   uint64
	gpu    uint64 // the device's PCI address (gpuID): one GPU in every process
	handle driver.IPCMemHandle
	ipc    bool // the handle is valid
}

func (e *peerEnd) encode() []byte {
	b := make([]byte, peerEndBytes)
	le := binary.LittleEndian
	le.PutUint32(b[0:], peerEndMagic)
	le.PutUint32(b[4:], e.pid)
	le.PutUint32(b[8:], uint32(e.device))
	le.PutUint32(b[12:], uint32(e.sms))
	le.PutUint64(b[16:], e.area)
	le.PutUint64(b[24:], e.host)
	le.PutUint64(b[32:], e.gpu)
	if e.ipc {
		copy(b[40:], e.handle.Reserved[:])
	}
	return b
}

func decodePeerEnd(b []byte) (peerEnd, error) {
	le := binary.LittleEndian
	if len(b) != peerEndBytes || le.Uint32(b) != peerEndMagic {
		return peerEnd{}, fmt.Errorf("not a peer-memory end (%d bytes)", len(b))
	}
	e := peerEnd{pid: le.Uint32(b[4:]), device: int32(le.Uint32(b[8:])), sms: int32(le.Uint32(b[12:])),
		area: le.Uint64(b[16:]), host: le.Uint64(b[24:]), gpu: le.Uint64(b[32:])}
	copy(e.handle.Reserved[:], b[40:])
	for _, c := range e.handle.Reserved {
		e.ipc = e.ipc || c != 0
	}
	if e.area == 0 {
		return peerEnd{}, fmt.Errorf("peer-memory end without an area")
	}
	return e, nil
}

// gpuID is the PCI domain, bus and device of b's GPU: the same GPU gives
// the same id in every process of a machine, whatever its ordinal there
// (CUDA_VISIBLE_DEVICES).
func (b *Backend) gpuID() (uint64, error) {
	v, err := b.attributes(driver.AttrPCIDomainID, driver.AttrPCIBusID, driver.AttrPCIDeviceID)
	if err != nil {
		return 0, err
	}
	return uint64(v[0])<<32 | uint64(v[1])<<8 | uint64(v[2]), nil
}

// hostID tells machines apart: the host name and, on Linux, the boot id.
func hostID() uint64 {
	h := fnv.New64a()
	name, _ := os.Hostname()
	h.Write([]byte(name))
	if id, err := os.ReadFile("/proc/sys/kernel/random/boot_id"); err == nil {
		h.Write(id)
	}
	return h.Sum64()
}

// peerReduce is a backend's side of its group.
type peerReduce struct {
	rank, world int
	capFloats   int
	lanes       [2]peerLane
	// gatherOff is where the gather area of a sequence-parallel exchange
	// (exchange.go: capFloats fp16 values) begins in the area, in bytes;
	// gathered, the shape the last ExchangeNorm left there
	gatherOff driver.DevicePtr
	gathered  [2]int
	// onDevice is how many of the group's ranks (this one included) run
	// on this rank's GPU, in any process of the machine (by PCI address):
	// their kernels of a call share its multiprocessors (under MPS, for
	// other processes), and a call's blocks wait for each other
	onDevice int
	// gpu is this rank's GPU's PCI address (gpuID); exchange, the
	// exchange_peer form it launches (exchangeFormOn), chosen at connect
	gpu       uint64
	exchange  exchangeForm
	timeout   time.Duration
	area      driver.DevicePtr
	opened    []driver.DevicePtr // other processes' areas, mapped here
	retained  []driver.Device    // devices whose contexts this one has peer access to
	connected bool
}

// OpenPeerReduce makes this backend rank of a world-rank group that sums
// up to capFloats values a call over peer memory, and returns the rank's
// end (peerEndBytes) for the other ranks' ConnectPeerReduce. A peer that
// does not arrive within timeout makes the call's launch fail. A backend
// joins one group; Close leaves it.
func (b *Backend) OpenPeerReduce(rank, world, capFloats int, timeout time.Duration) ([]byte, error) {
	if b.peer != nil {
		return nil, fmt.Errorf("cuda: the backend is rank %d of a peer-memory group already", b.peer.rank)
	}
	if world < 2 || world > peerMaxRanks || rank < 0 || rank >= world {
		return nil, fmt.Errorf("cuda: peer-memory all-reduce of rank %d of %d ranks (2..%d ranks)", rank, world, peerMaxRanks)
	}
	if capFloats <= 0 || timeout <= 0 {
		return nil, fmt.Errorf("cuda: peer-memory all-reduce of %d values, timeout %v", capFloats, timeout)
	}
	if b.capturing {
		return nil, fmt.Errorf("cuda: OpenPeerReduce during a graph capture")
	}
	defer b.enter()()
	gpu, err := b.gpuID()
	if err != nil {
		return nil, fmt.Errorf("cuda: peer-memory area: the GPU's PCI address: %w", err)
	}
	p := &peerReduce{rank: rank, world: world, capFloats: capFloats, timeout: timeout, gpu: gpu}
	off := 0
	for i, c := range []int{min(capFloats, peerSmallFloats), capFloats} {
		l := &p.lanes[i]
		l.capFloats, l.stride, l.stageOff = c, (c+63)&^63, off // each stage 256-byte aligned
		off += 2 * world * l.stride                            // a stage a parity and sender
		if i == 0 {
			off += 2 * world * l.stride // lane 0 (allreduce_peer_ll): 8 bytes a value
		}
	}
	p.gatherOff = driver.DevicePtr(peerHeader + 4*off)
	n := uint64(p.gatherOff) + uint64(2*capFloats+255)&^255
	area, err := b.drv.MemAlloc(n)
	if err != nil {
		return nil, fmt.Errorf("cuda: peer-memory area: %w", err)
	}
	p.area = area
	err = b.drv.MemsetD32Async(area, 0, n/4, b.stream)
	if err == nil {
		err = b.drv.StreamSynchronize(b.stream)
	}
	if err != nil {
		b.drv.MemFree(area)
		return nil, fmt.Errorf("cuda: peer-memory area: %w", err)
	}
	b.peer = p
	e := peerEnd{host: hostID(), pid: uint32(os.Getpid()), device: int32(b.dev), sms: int32(b.sms), area: uint64(area), gpu: gpu}
	if h, err := b.drv.IPCGetMemHandle(area); err == nil {
		e.handle, e.ipc = h, true
	}
	return e.encode(), nil
}

// ConnectPeerReduce maps the areas of the group's ranks, ends[r] being
// rank r's end from OpenPeerReduce (this rank's own included): an area of
// this process through peer access between the devices, one of another
// process on this machine through CUDA IPC. Ranks on other machines, or
// GPUs without peer access, are an error; the backend then stays out of
// the group (AllReducePeer panics).
func (b *Backend) ConnectPeerReduce(ends [][]byte) (err error) {
	p := b.peer
	if p == nil || p.connected {
		return fmt.Errorf("cuda: ConnectPeerReduce without OpenPeerReduce")
	}
	if len(ends) != p.world {
		return fmt.Errorf("cuda: %d peer-memory ends for %d ranks", len(ends), p.world)
	}
	defer b.enter()()
	defer func() {
		if err != nil {
			err = fmt.Errorf("cuda: peer-memory all-reduce, rank %d: %w", p.rank, err)
			b.closePeer()
		}
	}()
	self := peerEnd{host: hostID(), pid: uint32(os.Getpid()), gpu: p.gpu}
	areas := make([]uint64, peerMaxRanks)
	smallest, onDevice := b.sms, 0
	for r, raw := range ends {
		e, err := decodePeerEnd(raw)
		if err != nil {
			return fmt.Errorf("rank %d: %w", r, err)
		}
		smallest = min(smallest, int(e.sms))
		if e.host == self.host && e.gpu == self.gpu {
			onDevice++
		}
		switch {
		case r == p.rank:
			if e.area != uint64(p.area) {
				return fmt.Errorf("end %d is not this rank's", r)
			}
			areas[r] = e.area
		case e.host != self.host:
			return fmt.Errorf("rank %d runs on another machine", r)
		case e.pid == self.pid:
			peer := driver.Device(e.device)
			if peer != b.dev {
				ok, err := b.drv.CanAccessPeer(b.dev, peer)
				if err != nil {
					return err
				}
				if !ok {
					return fmt.Errorf("GPU %d cannot access the memory of GPU %d (rank %d)", b.dev, peer, r)
				}
				ctx, err := b.drv.PrimaryCtxRetain(peer)
				if err != nil {
					return err
				}
				p.retained = append(p.retained, peer)
				if err := b.drv.EnablePeerAccess(ctx); err != nil {
					return fmt.Errorf("peer access to GPU %d (rank %d): %w", peer, r, err)
				}
			}
			areas[r] = e.area
		default:
			if !e.ipc {
				return fmt.Errorf("rank %d (process %d) cannot export its area (no CUDA IPC)", r, e.pid)
			}
			a, err := b.drv.IPCOpenMemHandle(e.handle)
			if err != nil {
				return fmt.Errorf("rank %d (process %d): %w", r, e.pid, err)
			}
			p.opened = append(p.opened, a)
			areas[r] = uint64(a)
		}
	}
	if err := b.drv.MemcpyHtoD(p.area, unsafe.Pointer(&areas[0]), uint64(8*len(areas))); err != nil {
		return err
	}
	p.onDevice = onDevice
	p.lanes[0].blocks = max(1, min(peerSmallBlocks, smallest))
	p.lanes[1].blocks = max(1, min(peerLargeBlocks, smallest))
	p.exchange = b.exchangeFormOn(onDevice) // (residentBlocks raised its padding's limit)
	// lane 0's shape for the GEMVs that send to it (qtool.cu's ArLane0)
	l0 := p.lanes[0]
	desc := [4]int64{int64(p.rank) | int64(p.world)<<32, int64(l0.blocks), int64(l0.stageOff), int64(l0.stride)}
	if err := b.drv.MemcpyHtoD(p.area+peerLane0, unsafe.Pointer(&desc[0]), uint64(8*len(desc))); err != nil {
		return err
	}
	p.connected = true
	return nil
}

// peerLane0 is where lane 0's shape lies in an area (AR_LANE0).
const peerLane0 = peerHeader - 64

// peerReduceCap is how many values AllReducePeer sums a call (0 without a
// connected group).
func (b *Backend) peerReduceCap() int {
	if b.peer == nil || !b.peer.connected {
		return 0
	}
	return b.peer.capFloats
}

// AllReducePeer queues the in-place sum of x over the group's ranks, in
// rank order, so that every rank ends with the same bits. Every rank must
// make the same calls, with buffers of the same size, in the same order.
// The sums of a single row of up to peerSmallFloats values also leave
// their sums of squares for the normed GEMV that reads the row next
// (rowsums.go).
func (b *Backend) AllReducePeer(x runtime.Buf) {
	p, d := b.peer, buf(x)
	if p == nil || !p.connected {
		panic("cuda backend: AllReducePeer without a connected peer-memory group")
	}
	if d.n() > p.capFloats {
		panic(fmt.Sprintf("cuda backend: AllReducePeer of %d values, the group's areas hold %d", d.n(), p.capFloats))
	}
	defer b.enter()()
	if d.n() <= p.lanes[0].capFloats { // the values and the call's number in one store: no flag exchange
		b.allReduceLL(d, false)
		return
	}
	b.allReduceLarge(d, false)
}

// allReduceLarge launches lane 1's all-reduce of d (allreduce_peer), whose
// summands the GEMM before it sent where sent is set (MatMulAllReduce).
func (b *Backend) allReduceLarge(d *Buf, sent bool) {
	p := b.peer
	l := p.lanes[1]
	b.launch("allreduce_peer", g1(l.blocks), block256, d.p, int64(d.n()), p.rank, p.world, p.area,
		1, int64(l.stageOff), int64(l.stride), uint64(p.timeout.Nanoseconds()), boolInt(sent))
	b.metPeers()
}

// metPeers follows the launch of a kernel whose blocks wait for the other
// ranks' blocks (allreduce_peer, allreduce_peer_ll, exchange_peer). Where
// other ranks of the group share this GPU (onDevice > 1, as the tests run
// them), the next kernel is launched the plain way: launched early (a
// programmatic dependent launch, once every block of the waiting kernel
// has started), its blocks could take the slots that another rank's
// waiting blocks still need, and that rank's blocks would never start. A
// rank alone on its GPU keeps the early launch.
func (b *Backend) metPeers() {
	if b.peer.onDevice > 1 {
		b.plainNext = true
	}
}

// allReduceLL launches lane 0's all-reduce of d (allreduce_peer_ll), whose
// summands the GEMV before it sent where sent is set (MatMulAllReduce).
func (b *Backend) allReduceLL(d *Buf, sent bool) {
	p := b.peer
	l := p.lanes[0]
	var yss driver.DevicePtr // a decode row's sums of squares for the normed GEMV after it (rowsums.go)
	if d.rows == 1 {
		yss = b.sumsOut(d, l.blocks)
	}
	b.launch("allreduce_peer_ll", g1(l.blocks), block256, d.p, int64(d.n()), p.rank, p.world, p.area,
		int64(l.stageOff), int64(l.stride), uint64(p.timeout.Nanoseconds()), yss, boolInt(sent))
	b.metPeers()
	b.wroteSums(d, yss, l.blocks)
}

// MatMulAllReduce queues dst = x·Wᵀ (dst + x·Wᵀ where add is set) summed
// over the peer-memory group, as MatMul (or MatMulAdd) and AllReducePeer
// of dst would, bit for bit, but with the product sending its values
// straight into the group's stages: a decode row's GEMV sends them as the
// small all-reduce's words, which it sums without waiting for the GEMV to
// end (qtool.cu's ar_send: one launch boundary less); a prefill's Hopper
// GEMM stores each finished tile into the peers' stages of the large
// all-reduce as well (gemm_wg_*_tp), while its other tiles are computed, and
// the all-reduce only exchanges flags and sums (no pass over the link of its
// own). It queues nothing and returns false where it cannot: for one row,
// a row the small all-reduce does not hold, a product that does not run
// as a GEMV that sends (the split-K GEMV, W8A8, a tensor-core GEMM), or a
// GEMV of more blocks than the device holds at once (gemvOneWave); for
// several rows, a product the large all-reduce does not sum or that no
// Hopper GEMM multiplies with K unsplit (tileSender). The caller then runs
// the two. The ranks may choose differently: either way a rank's values
// reach the others in the same words (for several rows, in lane 1 either
// way).
func (b *Backend) MatMulAllReduce(dst, x runtime.Buf, w runtime.Linear, add bool) bool {
	p, d, s, l := b.peer, buf(dst), buf(x), lin(w)
	if s.cols != l.in || d.cols != l.out || d.rows != s.rows || d.p == s.p {
		panic(fmt.Sprintf("cuda backend: MatMulAllReduce [%d %d] <- [%d %d] x [%d %d]ᵀ", d.rows, d.cols, s.rows, s.cols, l.out, l.in))
	}
	if p == nil || !p.connected {
		return false
	}
	if s.rows > 1 {
		return b.sumSent(d, func() bool { return b.sendTiles(d, &gemmIn{x: s}, l, add) })
	}
	if d.n() > p.lanes[0].capFloats {
		return false
	}
	if !b.gemvOneWave(l) { // W8A8, a GEMM, the split-K GEMV, several waves
		return false
	}
	defer b.enter()()
	epi := gemvEpi{send: p.area}
	if add {
		epi.mode = gemvAdd
	}
	b.gemv(s, []gemvSeg{{d, l}}, epi)
	b.allReduceLL(d, true)
	return true
}

// AttentionAllReduce queues AttentionAdd's block (the prefill attention
// of q, then x·oᵀ) with o's products summed over the peer-memory group as
// MatMulAllReduce sums them: x becomes (x where add is set) + attention·oᵀ
// summed over the ranks, the attention written in the form o's GEMM takes
// (attnFormOut), where both hold: several rows whose o product sends its
// tiles (tileSender) and a formed input; otherwise it queues nothing and
// returns false (the caller then runs Attention and MatMulAllReduce).
func (b *Backend) AttentionAllReduce(x, q runtime.Buf, c runtime.KVCache, layer, pos0, heads, kvHeads, headDim int, o runtime.Linear, add bool) bool {
	return b.sumSent(buf(x), func() bool { return b.attentionSend(x, q, c, layer, pos0, heads, kvHeads, headDim, o, add) })
}

// sumSent queues send, a product (or a block ending in one) whose GEMM
// sends its tiles into lane 1's stages, and where it did (true) the large
// all-reduce of d that then only meets and sums; it reports whether.
func (b *Backend) sumSent(d *Buf, send func() bool) bool {
	defer b.enter()()
	if !send() {
		return false
	}
	b.allReduceLarge(d, true)
	return true
}

// attentionSend is AttentionAllReduce up to the all-reduce: the attention
// and o's GEMM sending its tiles (true), or nothing queued (false).
func (b *Backend) attentionSend(x, q runtime.Buf, c runtime.KVCache, layer, pos0, heads, kvHeads, headDim int, o runtime.Linear, add bool) bool {
	d, qb, kc, l := buf(x), buf(q), cache(c), lin(o)
	if qb.rows <= 1 || !b.attnFormOut(l, kc, qb.rows, headDim) {
		return false
	}
	ts := b.tileSender(l, qb.rows)
	if ts.kernel == "" { // also no connected group
		return false
	}
	defer b.enter()()
	b.launchTiles(ts, d, b.attendFormed(d, qb, kc, layer, pos0, heads, kvHeads, headDim, l), l, add, false)
	return true
}

// MLPAllReduce queues MLP's block (NormSwiGLU(g, x, w, bias, eps, gate,
// up), then x·downᵀ) with down's products summed over the peer-memory group
// as MatMulAllReduce sums them: x becomes (x where add is set) + g·downᵀ
// summed over the ranks, the bits of NormSwiGLU then MatMulAllReduce. Down's
// GEMM reads the SwiGLU in the fp16 form the gate/up GEMM writes where it
// can (gluPair), as MLP does on one GPU, where that sequence converts it
// with to_half. Only for several rows whose down product sends its tiles
// (tileSender); otherwise it queues nothing and returns false.
func (b *Backend) MLPAllReduce(x runtime.Buf, w, bias runtime.Vector, eps float32, gate, up, down runtime.Linear, add bool) bool {
	return b.sumSent(buf(x), func() bool {
		sent, _ := b.mlpSend(x, w, bias, eps, gate, up, down, add)
		return sent
	})
}

// mlpSend is MLPAllReduce up to the all-reduce: the block with down's GEMM
// sending its tiles (sent), or nothing queued (not sent); formed reports
// whether down read the SwiGLU's fp16 form. (The tests queue every rank's
// before any rank's all-reduce, which on one GPU would spin where the
// other ranks' GEMMs need the multiprocessors.)
func (b *Backend) mlpSend(x runtime.Buf, w, bias runtime.Vector, eps float32, gate, up, down runtime.Linear, add bool) (sent, formed bool) {
	rows := x.Rows()
	if rows <= 1 {
		return false, false
	}
	ts := b.tileSender(lin(down), rows)
	if ts.kernel == "" { // also no connected group
		return false, false
	}
	g := b.AllocRaw(rows, gate.Out())
	defer b.Free(g)
	s, segs := b.segments("MLPAllReduce", []runtime.Buf{g, g}, x, []runtime.Linear{gate, up})
	_, dseg := b.segments("MLPAllReduce", []runtime.Buf{x}, g, []runtime.Linear{down})
	defer b.enter()()
	dl := dseg[0].l
	q := b.inputFor(dl, rows)
	in := &gemmIn{x: buf(g)}
	if formed = b.normSwiGLU(s, segs, w, bias, eps, q); formed {
		in = q.input(rows, dl.in)
	}
	b.launchTiles(ts, s, in, dl, add, false)
	return true, formed
}

// ClosePeerReduce leaves the peer-memory group (nothing outside one).
func (b *Backend) ClosePeerReduce() error {
	defer b.enter()()
	return b.closePeer()
}

// closePeer leaves the group (context current).
func (b *Backend) closePeer() error {
	p := b.peer
	if p == nil {
		return nil
	}
	b.peer = nil
	var errs []error
	if b.stream != 0 {
		errs = append(errs, b.drv.StreamSynchronize(b.stream))
	}
	for _, a := range p.opened {
		errs = append(errs, b.drv.IPCCloseMemHandle(a))
	}
	for _, d := range p.retained {
		errs = append(errs, b.drv.PrimaryCtxRelease(d))
	}
	errs = append(errs, b.drv.MemFree(p.area))
	return errors.Join(errs...)
}

// gemvOneWave reports whether a one-row product with l runs as a GEMV
// (gemvPlan: not W8A8, a tensor-core GEMM or the split-K GEMV) whose
// blocks all run at once. Only such a GEMV sends its row (MatMulAllReduce):
// one of several waves pays for sending in every wave (measured at TP=2 on
// two H100s: bf16 o and down, 2.6 waves of gemv_bf16_r4u2, lost 1.5–2.5 %
// of decode with it, whether the all-reduce started beside the GEMV or
// after it, and with the sending loads issued before the products; the
// 4-bit ones, one wave of gemv_q4_w2h, gained 5 %). Presumably a block's
// stores to the peers hold it until they complete.
func (b *Backend) gemvOneWave(l *Linear) bool {
	name, _, ok := b.gemvPlan([]gemvSeg{{l: l}}, 1)
	if !ok {
		return false
	}
	_, R := b.gemvKernel(l, 1, l.out)
	rows, splits, shm := b.gemvShape(name, R, l, 1, l.out)
	return (l.out+rows-1)/rows*splits <= b.residentBlocks(name, shm)*b.sms
}

// tileSend is a Hopper GEMM that sends its tiles to lane 1 of the
// peer-memory group (gemm_wg_*_tp; kernel "" where there is none), with the
// weight's kernel as the GEMM reads it (wg) and whether the weight is
// widened to fp16 first.
type tileSend struct {
	kernel, wg string
	widen      bool
}

// tileSender is the tileSend that multiplies M rows by l's weight: only
// where the sum goes through lane 1 (more values than lane 0 holds, up to
// the group's capacity) and the GEMM would not split K (gemmSplits: the
// splits' sum would have to send instead); none elsewhere.
func (b *Backend) tileSender(l *Linear, M int) tileSend {
	p, n := b.peer, M*l.out
	if p == nil || !p.connected || n <= p.lanes[0].capFloats || n > p.capFloats || !b.halfGEMM(l, M, false) {
		return tileSend{}
	}
	gh, widen := gemmHKernel(l)
	wg := b.wgmmaKernel(gh, M)
	if tileSendKernels[wg] == "" {
		return tileSend{}
	}
	if b.splits(((M+127)/128)*((l.out+127)/128), (l.in+gemmHBK-1)/gemmHBK, b.sms) != 1 {
		return tileSend{}
	}
	return tileSend{tileSendKernels[wg], wg, widen}
}

// tileSendKernels maps each Hopper GEMM of float activations to its form
// that sends its tiles to lane 1 (qtool.cu's GEMM_WG_TP_ENTRY).
var tileSendKernels = map[string]string{"gemm_wg_f16": "gemm_wg_f16_tp", "gemm_wg_bf16": "gemm_wg_bf16_tp",
	"gemm_wg_q4": "gemm_wg_q4_tp", "gemm_wg_q8": "gemm_wg_q8_tp"}

// sendTiles queues d = x·lᵀ (d + x·lᵀ where add is set), x in's
// activations as floats or in their fp16 form (no int8 form: the GEMM
// takes fp16), with the Hopper GEMM that sends its tiles to lane 1
// (tileSender), or returns false and queues nothing (context current).
func (b *Backend) sendTiles(d *Buf, in *gemmIn, l *Linear, add bool) bool {
	s := b.tileSender(l, in.x.rows)
	if s.kernel == "" {
		return false
	}
	b.launchTiles(s, d, in, l, add, false)
	return true
}

// launchTiles is sendTiles with its GEMM chosen (s: tileSender's for l and
// in's rows), for a block that chose it before queueing its first launch.
// With scatter set (a sequence-parallel exchange, exchange.go) d and add
// are ignored: each tile is stored only into the stage of the rank that
// owns its rows, this rank's own included.
func (b *Backend) launchTiles(s tileSend, d *Buf, in *gemmIn, l *Linear, add, scatter bool) {
	M, N, K := in.x.rows, l.out, l.in
	w := l.w
	if s.widen {
		w = b.widened(l)
	}
	a16 := b.half(in, l)
	grid, shm, wmap := b.prepareWG(s.wg, a16, w, l, M)
	b.raiseSmem(s.kernel, shm)
	out := outStore
	if add {
		out = outAdd
	}
	p := b.peer
	l1 := p.lanes[1]
	b.launchShm(s.kernel, grid, block384, shm, d.p, b.tmaps[0], wmap, l.sz, M, N, K, max(l.gs, gemmHBK), l.groups, wgFlags(l), out,
		p.area, p.rank, p.world, int64(l1.stageOff), int64(l1.stride), boolInt(scatter))
}
