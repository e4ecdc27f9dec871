package tp

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	goruntime "runtime"
	"sync"
	"sync/atomic"
	"time"
	"unsafe"

	"github.com/ebitengine/purego"

	"qtool/runtime/cuda/driver"
)

// ErrNoNCCL is wrapped by LoadNCCL when libnccl.so.2 cannot be loaded.
var ErrNoNCCL = errors.New("no NCCL library found")

// UniqueIDBytes is NCCL_UNIQUE_ID_BYTES.
const UniqueIDBytes = 128

// UniqueID is an ncclUniqueId: created by one rank (GetUniqueID) and handed
// to every other rank out of band before they create the communicator.
type UniqueID struct {
	Internal [UniqueIDBytes]byte
}

// NCCL data types and reduction operations used here (ncclDataType_t,
// ncclRedOp_t).
const (
	ncclFloat32 = 7
	ncclSum     = 0
)

// NCCL is a loaded libnccl.so.2, bound at run time through purego (no cgo).
// Its methods take device pointers and CUDA streams as plain integers.
type NCCL struct {
	// Path is the library that was loaded.
	Path string

	getVersion           func(v *int32) int32
	getUniqueID          func(id *UniqueID) int32
	commInitAll          func(comms *uintptr, ndev int32, devlist *int32) int32
	commInitRankScalable func(comm *uintptr, nranks, myrank, nID int32, ids *UniqueID, config uintptr) int32
	commDestroy          func(comm uintptr) int32
	commAbort            func(comm uintptr) int32
	commCount            func(comm uintptr, n *int32) int32
	commUserRank         func(comm uintptr, rank *int32) int32
	allReduce            func(send, recv uintptr, count uint64, dtype, op int32, comm, stream uintptr) int32
	allGather            func(send, recv uintptr, sendCount uint64, dtype int32, comm, stream uintptr) int32
	groupStart           func() int32
	groupEnd             func() int32
	getErrorString       func(r int32) *byte
}

// ncclPaths lists where LoadNCCL looks after $QTOOL_NCCL: the dynamic
// loader's search path, the usual system and CUDA directories, and the
// nvidia-nccl Python wheels.
func ncclPaths() []string {
	paths := []string{"libnccl.so.2",
		"/usr/lib/x86_64-linux-gnu/libnccl.so.2", "/usr/lib/aarch64-linux-gnu/libnccl.so.2",
		"/usr/local/cuda/lib64/libnccl.so.2", "/usr/local/nccl/lib/libnccl.so.2", "/usr/lib64/libnccl.so.2"}
	for _, g := range []string{
		"/usr/local/lib/python3*/dist-packages/nvidia/nccl/lib/libnccl.so.2",
		"/usr/local/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2",
		"/usr/lib/python3/dist-packages/nvidia/nccl/lib/libnccl.so.2",
		"/opt/conda/lib/python3*/site-packages/nvidia/nccl/lib/libnccl.so.2",
	} {
		m, _ := filepath.Glob(g)
		paths = append(paths, m...)
	}
	return paths
}

// LoadNCCL loads libnccl.so.2: the file named by $QTOOL_NCCL when set (and
// only it), else the first of the standard locations that loads.
func LoadNCCL() (*NCCL, error) {
	paths := ncclPaths()
	if p := os.Getenv("QTOOL_NCCL"); p != "" {
		paths = []string{p}
	}
	var lib uintptr
	var path string
	var firstErr error
	for _, p := range paths {
		h, err := purego.Dlopen(p, purego.RTLD_NOW|purego.RTLD_GLOBAL)
		if err == nil {
			lib, path = h, p
			break
		}
		if firstErr == nil {
			firstErr = err
		}
	}
	if lib == 0 {
		return nil, fmt.Errorf("%w (tried %s first: %v; set QTOOL_NCCL to the library's path)", ErrNoNCCL, paths[0], firstErr)
	}
	n := &NCCL{Path: path}
	for _, s := range []struct {
		fn       any
		name     string
		optional bool
	}{
		{&n.getVersion, "ncclGetVersion", false},
		{&n.getUniqueID, "ncclGetUniqueId", false},
		{&n.commInitAll, "ncclCommInitAll", false},
		{&n.commInitRankScalable, "ncclCommInitRankScalable", true},
		{&n.commDestroy, "ncclCommDestroy", false},
		{&n.commAbort, "ncclCommAbort", true},
		{&n.commCount, "ncclCommCount", false},
		{&n.commUserRank, "ncclCommUserRank", false},
		{&n.allReduce, "ncclAllReduce", false},
		{&n.allGather, "ncclAllGather", false},
		{&n.groupStart, "ncclGroupStart", false},
		{&n.groupEnd, "ncclGroupEnd", false},
		{&n.getErrorString, "ncclGetErrorString", false},
	} {
		sym, err := purego.Dlsym(lib, s.name)
		if err != nil {
			if s.optional {
				continue
			}
			return nil, fmt.Errorf("nccl: %s lacks %s: %w", path, s.name, err)
		}
		purego.RegisterFunc(s.fn, sym)
	}
	return n, nil
}

// NCCLError is a failed NCCL call.
type NCCLError struct {
	Call string
	Code int32
	Msg  string
}

func (e *NCCLError) Error() string {
	return fmt.Sprintf("nccl: %s: error %d: %s", e.Call, e.Code, e.Msg)
}

func cString(p *byte) string {
	if p == nil {
		return ""
	}
	var b []byte
	for q := unsafe.Pointer(p); *(*byte)(q) != 0 && len(b) < 4096; q = unsafe.Add(q, 1) {
		b = append(b, *(*byte)(q))
	}
	return string(b)
}

func (n *NCCL) check(call string, r int32) error {
	if r == 0 {
		return nil
	}
	return &NCCLError{Call: call, Code: r, Msg: cString(n.getErrorString(r))}
}

// Version is NCCL's version code (major·10000 + minor·100 + patch).
func (n *NCCL) Version() (int, error) {
	var v int32
	err := n.check("ncclGetVersion", n.getVersion(&v))
	return int(v), err
}

// GetUniqueID creates the id that rank 0 hands to the other ranks.
func (n *NCCL) GetUniqueID() (UniqueID, error) {
	var id UniqueID
	return id, n.check("ncclGetUniqueId", n.getUniqueID(&id))
}

// Comm is an NCCL communicator handle (ncclComm_t).
type Comm uintptr

// CommInitAll creates one communicator per listed device of this process
// (single-process tensor parallelism); comms[i] is rank i on devices[i].
func (n *NCCL) CommInitAll(devices []int) ([]Comm, error) {
	if len(devices) == 0 {
		return nil, fmt.Errorf("nccl: CommInitAll with no devices")
	}
	comms := make([]uintptr, len(devices))
	devs := make([]int32, len(devices))
	for i, d := range devices {
		devs[i] = int32(d)
	}
	if err := n.check("ncclCommInitAll", n.commInitAll(&comms[0], int32(len(devices)), &devs[0])); err != nil {
		return nil, err
	}
	out := make([]Comm, len(comms))
	for i, c := range comms {
		out[i] = Comm(c)
	}
	return out, nil
}

// CommInitRank joins rank of an nranks-rank communicator named by id (the
// multi-process and multi-machine path; the caller's current CUDA device is
// used). It calls ncclCommInitRankScalable with one id, which takes the id
// by pointer: ncclCommInitRank takes the 128-byte id by value, which
// purego cannot pass on every platform. Needs NCCL 2.23 or later.
func (n *NCCL) CommInitRank(nranks int, id UniqueID, rank int) (Comm, error) {
	if n.commInitRankScalable == nil {
		v, _ := n.Version()
		return 0, fmt.Errorf("nccl: %s (version %d) has no ncclCommInitRankScalable; multi-process initialization needs NCCL 2.23 or later", n.Path, v)
	}
	if rank < 0 || rank >= nranks {
		return 0, fmt.Errorf("nccl: rank %d outside 0..%d", rank, nranks-1)
	}
	var c uintptr
	err := n.check("ncclCommInitRankScalable", n.commInitRankScalable(&c, int32(nranks), int32(rank), 1, &id, 0))
	return Comm(c), err
}

// Destroy frees the communicator.
func (n *NCCL) Destroy(c Comm) error { return n.check("ncclCommDestroy", n.commDestroy(uintptr(c))) }

// Abort ends the communicator's queued and running operations and frees it
// (ncclCommAbort; a library without it returns an error and does nothing).
func (n *NCCL) Abort(c Comm) error {
	if n.commAbort == nil {
		return fmt.Errorf("nccl: %s has no ncclCommAbort", n.Path)
	}
	return n.check("ncclCommAbort", n.commAbort(uintptr(c)))
}

// CountAndRank returns the communicator's size and this rank.
func (n *NCCL) CountAndRank(c Comm) (count, rank int, err error) {
	var cnt, r int32
	if err := n.check("ncclCommCount", n.commCount(uintptr(c), &cnt)); err != nil {
		return 0, 0, err
	}
	err = n.check("ncclCommUserRank", n.commUserRank(uintptr(c), &r))
	return int(cnt), int(r), err
}

// AllReduceSum enqueues a float32 sum all-reduce of count values from the
// device pointer send into recv (they may be equal) on stream.
func (n *NCCL) AllReduceSum(send, recv uint64, count int, c Comm, stream uintptr) error {
	return n.check("ncclAllReduce", n.allReduce(uintptr(send), uintptr(recv), uint64(count), ncclFloat32, ncclSum, uintptr(c), stream))
}

// AllGather enqueues a float32 all-gather: every rank's count values at send
// land in recv (count × ranks values) in rank order.
func (n *NCCL) AllGather(send, recv uint64, count int, c Comm, stream uintptr) error {
	return n.check("ncclAllGather", n.allGather(uintptr(send), uintptr(recv), uint64(count), ncclFloat32, uintptr(c), stream))
}

// GroupStart opens a group of NCCL calls (needed when one thread issues
// the collectives of several ranks).
func (n *NCCL) GroupStart() error { return n.check("ncclGroupStart", n.groupStart()) }

// GroupEnd closes the group opened by GroupStart and launches its calls.
func (n *NCCL) GroupEnd() error { return n.check("ncclGroupEnd", n.groupEnd()) }

// NCCLCommunicator is a Communicator over NCCL for the ranks of this
// process, one GPU each: every rank of the job (NewNCCLCommunicator,
// ncclCommInitAll), or one rank of a job with a process per rank
// (NewNCCLRankCommunicator, ncclCommInitRank). As a Communicator it works
// on host slices like InProcess, staging them through a device buffer per
// rank, so it plugs into Backend with any rank backends; as a
// DeviceCommunicator it runs the collectives of the local ranks on their
// device buffers and streams (what Backend uses with CUDA ranks). Per-rank
// slices are indexed by local rank: global[i] is the rank of comms[i].
type NCCLCommunicator struct {
	lib     *NCCL
	drv     *driver.Driver
	world   int
	global  []int
	devices []driver.Device
	ctxs    []driver.Context
	comms   []Comm
	streams []driver.Stream

	mu      []sync.Mutex // per rank: the staging buffers
	buf     []driver.DevicePtr
	size    []uint64
	retired [][]driver.DevicePtr // per rank: outgrown staging buffers, freed by Close

	// calls is held for reading by every call that names a communicator
	// (call), for writing by Abort; aborted is set by Abort before it
	// takes it, so no call starts on an aborted communicator.
	calls   sync.RWMutex
	aborted atomic.Bool
}

var _ Aborter = (*NCCLCommunicator)(nil)

// abortWait bounds how long Abort waits for the NCCL calls in progress
// (enqueues, which return at once unless NCCL connects ranks lazily and
// waits for the failed one) before it aborts anyway.
const abortWait = 2 * time.Second

// Abort implements Aborter: the local ranks' communicators are aborted
// (ncclCommAbort), which ends their collectives queued or running on the
// GPUs. Without it a rank that failed before queueing its collective (the
// ranks of a process queue their own, each from its thread) leaves the
// others' NCCL kernels waiting for it forever, and with them every later
// synchronization of those ranks' streams: the failed run would hang
// instead of ending with the rank's error. Later collectives return
// ErrAborted, and Close destroys no aborted communicator.
func (c *NCCLCommunicator) Abort() {
	if c.aborted.Swap(true) {
		return
	}
	for deadline := time.Now().Add(abortWait); ; time.Sleep(time.Millisecond) {
		if c.calls.TryLock() {
			defer c.calls.Unlock()
			break
		}
		if time.Now().After(deadline) {
			break // a call blocked in NCCL: ncclCommAbort is what ends it
		}
	}
	for _, cm := range c.comms {
		c.lib.Abort(cm) // nothing to do about an error: the run is failing already
	}
}

// call runs fn, which calls NCCL with the communicators, unless Abort has
// been called (ErrAborted then).
func (c *NCCLCommunicator) call(fn func() error) error {
	c.calls.RLock()
	defer c.calls.RUnlock()
	if c.aborted.Load() {
		return ErrAborted
	}
	return fn()
}

var _ Communicator = (*NCCLCommunicator)(nil)

// NewNCCLCommunicator loads NCCL and the CUDA driver and creates a
// communicator of one rank per listed GPU ordinal, all in this process.
func NewNCCLCommunicator(devices []int) (*NCCLCommunicator, error) {
	global := make([]int, len(devices))
	for i := range global {
		global[i] = i
	}
	c, err := openNCCL(len(devices), global, devices)
	if err != nil {
		return nil, err
	}
	if c.comms, err = c.lib.CommInitAll(devices); err != nil {
		c.Close()
		return nil, err
	}
	return c.ready()
}

// NewNCCLRankCommunicator creates the communicator of one process of a job
// with a process per rank: rank of world, on GPU device, joining the NCCL
// communicator named by id (made by rank 0 with GetUniqueID and handed to
// every rank, e.g. with SocketCommunicator.Broadcast).
func NewNCCLRankCommunicator(world, rank, device int, id UniqueID) (*NCCLCommunicator, error) {
	if world < 1 || rank < 0 || rank >= world {
		return nil, fmt.Errorf("nccl: rank %d of %d", rank, world)
	}
	c, err := openNCCL(world, []int{rank}, []int{device})
	if err != nil {
		return nil, err
	}
	err = c.onRank(0, func() error {
		cm, err := c.lib.CommInitRank(world, id, rank)
		if err == nil {
			c.comms = []Comm{cm}
		}
		return err
	})
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("nccl: rank %d of %d on GPU %d: %w", rank, world, device, err)
	}
	return c.ready()
}

// ready makes the new communicator's streams and connections.
func (c *NCCLCommunicator) ready() (*NCCLCommunicator, error) {
	if err := c.makeStreams(); err != nil {
		return nil, err
	}
	if err := c.connect(); err != nil {
		c.Close()
		return nil, fmt.Errorf("nccl: connecting the ranks: %w", err)
	}
	return c, nil
}

// connectFloats is the larger size, in floats a rank, of connect's
// collectives (the smaller is 1 024): sizes of a decode step's and a
// prefill's, so that NCCL connects what either picks.
const connectFloats = 1 << 20

// connect makes NCCL's connections before any timed work: NCCL otherwise
// makes them at a communicator's first collective of each algorithm
// (NCCL_RUNTIME_CONNECT's default), which with the ranks in one process
// took ~27 ms of the first perplexity chunk (runtime/tp/README.md,
// seventeenth session). It runs an all-reduce and an all-gather of two
// sizes on the staging buffers (their values are of no use; the buffers
// keep that size, 4·2^20·(world+1) bytes a rank, for the host collectives)
// and waits for them; every process of a job calls it at the same point,
// as it does the communicator's creation.
func (c *NCCLCommunicator) connect() error {
	n := len(c.comms)
	send, recv, streams := make([]uint64, n), make([]uint64, n), make([]uintptr, n)
	for r := range c.comms {
		err := c.onRank(r, func() error {
			p, err := c.staging(r, uint64(4*connectFloats*(1+c.world)))
			send[r], recv[r] = uint64(p), uint64(p)+4*connectFloats
			return err
		})
		if err != nil {
			return err
		}
		streams[r] = uintptr(c.streams[r])
	}
	for _, count := range []int{1 << 10, connectFloats} {
		if err := c.AllReduceSumDevice(send, count, streams); err != nil {
			return err
		}
		if err := c.AllGatherDevice(send, recv, count, streams); err != nil {
			return err
		}
	}
	for r := range c.comms {
		if err := c.onRank(r, func() error { return c.drv.StreamSynchronize(c.streams[r]) }); err != nil {
			return err
		}
	}
	return nil
}

// openNCCL loads NCCL and the CUDA driver and retains the contexts of the
// local ranks' GPUs.
func openNCCL(world int, global, devices []int) (*NCCLCommunicator, error) {
	lib, err := LoadNCCL()
	if err != nil {
		return nil, err
	}
	drv, err := driver.Open()
	if err != nil {
		return nil, err
	}
	cnt, err := drv.DeviceCount()
	if err != nil {
		return nil, err
	}
	n := len(devices)
	c := &NCCLCommunicator{lib: lib, drv: drv, world: world, global: global,
		mu: make([]sync.Mutex, n), buf: make([]driver.DevicePtr, n), size: make([]uint64, n),
		retired: make([][]driver.DevicePtr, n)}
	for _, d := range devices {
		if d < 0 || d >= cnt {
			return nil, fmt.Errorf("nccl: GPU %d requested, %d present", d, cnt)
		}
		dev, err := drv.Device(d)
		if err != nil {
			return nil, err
		}
		ctx, err := drv.PrimaryCtxRetain(dev)
		if err != nil {
			c.Close()
			return nil, err
		}
		c.devices, c.ctxs = append(c.devices, dev), append(c.ctxs, ctx)
	}
	return c, nil
}

// makeStreams creates the local ranks' staging streams.
func (c *NCCLCommunicator) makeStreams() error {
	drv := c.drv
	for r := range c.comms {
		if err := c.onRank(r, func() error {
			s, err := drv.StreamCreate(0)
			c.streams = append(c.streams, s)
			return err
		}); err != nil {
			c.Close()
			return err
		}
	}
	return nil
}

// local returns the local index of rank.
func (c *NCCLCommunicator) local(rank int) (int, error) {
	for i, g := range c.global {
		if g == rank && i < len(c.comms) {
			return i, nil
		}
	}
	return 0, fmt.Errorf("nccl: rank %d is not a rank of this process (it runs %v of 0..%d)", rank, c.global, c.world-1)
}

// onRank runs fn on a locked OS thread with local rank r's context current.
func (c *NCCLCommunicator) onRank(r int, fn func() error) error {
	goruntime.LockOSThread()
	defer goruntime.UnlockOSThread()
	if err := c.drv.SetCurrent(c.ctxs[r]); err != nil {
		return err
	}
	return fn()
}

// staging returns rank r's device buffer of at least n bytes (context
// current). It grows to at least twice its size and keeps the outgrown
// buffer until Close: a free may wait for the GPUs this one has peer access
// to (NVIDIA/nccl#744; NCCL gives it to every GPU of the communicator),
// where another local rank's collective may already wait for this rank's.
func (c *NCCLCommunicator) staging(r int, n uint64) (driver.DevicePtr, error) {
	if c.size[r] >= n {
		return c.buf[r], nil
	}
	n = max(n, 2*c.size[r])
	p, err := c.drv.MemAlloc(n)
	if err != nil {
		return 0, err
	}
	if c.buf[r] != 0 {
		c.retired[r] = append(c.retired[r], c.buf[r])
	}
	c.buf[r], c.size[r] = p, n
	return p, nil
}

// Size implements Communicator.
func (c *NCCLCommunicator) Size() int { return c.world }

// Name is "nccl" and the library's version code.
func (c *NCCLCommunicator) Name() string {
	v, _ := c.lib.Version()
	return fmt.Sprintf("nccl %d", v)
}

// AllReduceSum implements Communicator.
func (c *NCCLCommunicator) AllReduceSum(rank int, buf []float32) error {
	rank, err := c.local(rank)
	if err != nil {
		return err
	}
	if len(buf) == 0 {
		return nil
	}
	c.mu[rank].Lock()
	defer c.mu[rank].Unlock()
	return c.onRank(rank, func() error {
		nb := uint64(4 * len(buf))
		d, err := c.staging(rank, nb)
		if err != nil {
			return err
		}
		if err := c.drv.MemcpyHtoD(d, unsafe.Pointer(&buf[0]), nb); err != nil {
			return err
		}
		err = c.call(func() error {
			return c.lib.AllReduceSum(uint64(d), uint64(d), len(buf), c.comms[rank], uintptr(c.streams[rank]))
		})
		if err != nil {
			return err
		}
		if err := c.settle(rank); err != nil {
			return err
		}
		return c.drv.MemcpyDtoH(unsafe.Pointer(&buf[0]), d, nb)
	})
}

// AllGather implements Communicator.
func (c *NCCLCommunicator) AllGather(rank int, send, recv []float32) error {
	rank, err := c.local(rank)
	if err != nil {
		return err
	}
	if len(recv) != c.world*len(send) {
		return fmt.Errorf("nccl: all-gather of %d values per rank into %d", len(send), len(recv))
	}
	if len(send) == 0 {
		return nil
	}
	c.mu[rank].Lock()
	defer c.mu[rank].Unlock()
	return c.onRank(rank, func() error {
		sb, rb := uint64(4*len(send)), uint64(4*len(recv))
		d, err := c.staging(rank, sb+rb)
		if err != nil {
			return err
		}
		if err := c.drv.MemcpyHtoD(d, unsafe.Pointer(&send[0]), sb); err != nil {
			return err
		}
		err = c.call(func() error {
			return c.lib.AllGather(uint64(d), uint64(d)+sb, len(send), c.comms[rank], uintptr(c.streams[rank]))
		})
		if err != nil {
			return err
		}
		if err := c.settle(rank); err != nil {
			return err
		}
		return c.drv.MemcpyDtoH(unsafe.Pointer(&recv[0]), d+driver.DevicePtr(sb), rb)
	})
}

// settle waits for local rank r's staging stream (context current): the
// host collectives' results are there then, unless Abort ended the
// collective unfinished (ErrAborted).
func (c *NCCLCommunicator) settle(r int) error {
	if err := c.drv.StreamSynchronize(c.streams[r]); err != nil {
		return err
	}
	if c.aborted.Load() {
		return ErrAborted
	}
	return nil
}

var _ DeviceCommunicator = (*NCCLCommunicator)(nil)

// AllReduceSumDevice implements DeviceCommunicator: one NCCL group of the
// local ranks' in-place all-reduces, queued on their streams.
func (c *NCCLCommunicator) AllReduceSumDevice(bufs []uint64, count int, streams []uintptr) error {
	n := len(c.comms)
	if len(bufs) != n || len(streams) != n {
		return fmt.Errorf("nccl: all-reduce over %d buffers and %d streams, %d local ranks", len(bufs), len(streams), n)
	}
	if count == 0 {
		return nil
	}
	return c.call(func() error {
		return c.group(func(r int) error {
			return c.lib.AllReduceSum(bufs[r], bufs[r], count, c.comms[r], streams[r])
		})
	})
}

// AllGatherDevice implements DeviceCommunicator: one NCCL group of the
// ranks' all-gathers, queued on their streams.
func (c *NCCLCommunicator) AllGatherDevice(send, recv []uint64, count int, streams []uintptr) error {
	n := len(c.comms)
	if len(send) != n || len(recv) != n || len(streams) != n {
		return fmt.Errorf("nccl: all-gather over %d/%d buffers and %d streams, %d local ranks", len(send), len(recv), len(streams), n)
	}
	if count == 0 {
		return nil
	}
	return c.call(func() error {
		return c.group(func(r int) error {
			return c.lib.AllGather(send[r], recv[r], count, c.comms[r], streams[r])
		})
	})
}

var _ RankDeviceCommunicator = (*NCCLCommunicator)(nil)

// AllReduceSumDeviceRank implements RankDeviceCommunicator.
func (c *NCCLCommunicator) AllReduceSumDeviceRank(rank int, buf uint64, count int, stream uintptr) error {
	rank, err := c.local(rank)
	if err != nil {
		return err
	}
	if count == 0 {
		return nil
	}
	return c.call(func() error { return c.lib.AllReduceSum(buf, buf, count, c.comms[rank], stream) })
}

// AllGatherDeviceRank implements RankDeviceCommunicator.
func (c *NCCLCommunicator) AllGatherDeviceRank(rank int, send, recv uint64, count int, stream uintptr) error {
	rank, err := c.local(rank)
	if err != nil {
		return err
	}
	if count == 0 {
		return nil
	}
	return c.call(func() error { return c.lib.AllGather(send, recv, count, c.comms[rank], stream) })
}

// group issues call(r) for every rank inside ncclGroupStart/End (one
// thread drives all ranks). NCCL keeps the open group per OS thread, so the
// goroutine stays on its thread throughout: moved after ncclGroupStart, it
// would issue the collectives outside the group (the first then waits for
// ranks this thread has not launched yet: a hang) and end a group it never
// opened on the new thread (ncclInvalidUsage).
func (c *NCCLCommunicator) group(call func(r int) error) error {
	goruntime.LockOSThread()
	defer goruntime.UnlockOSThread()
	if err := c.lib.GroupStart(); err != nil {
		return err
	}
	var errs []error
	for r := range c.comms {
		if err := call(r); err != nil {
			errs = append(errs, fmt.Errorf("rank %d: %w", c.global[r], err))
		}
	}
	errs = append(errs, c.lib.GroupEnd())
	return errors.Join(errs...)
}

// Close implements Communicator: it frees the staging buffers, streams and
// communicators (those Abort has not freed) and releases the GPU contexts.
func (c *NCCLCommunicator) Close() error {
	var errs []error
	for r := range c.ctxs {
		errs = append(errs, c.onRank(r, func() error {
			var es []error
			for _, p := range c.retired[r] {
				es = append(es, c.drv.MemFree(p))
			}
			if c.buf[r] != 0 {
				es = append(es, c.drv.MemFree(c.buf[r]))
			}
			c.buf[r], c.size[r], c.retired[r] = 0, 0, nil
			if r < len(c.streams) {
				es = append(es, c.drv.StreamDestroy(c.streams[r]))
			}
			return errors.Join(es...)
		}))
	}
	c.streams = nil
	if !c.aborted.Load() {
		for _, cm := range c.comms {
			errs = append(errs, c.lib.Destroy(cm))
		}
	}
	c.comms = nil
	for _, d := range c.devices {
		errs = append(errs, c.drv.PrimaryCtxRelease(d))
	}
	c.devices, c.ctxs = nil, nil
	return errors.Join(errs...)
}
