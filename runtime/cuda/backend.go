// Package cuda is qtool's GPU backend: runtime.Backend over the CUDA driver
// API (package driver, bound through purego without cgo) and the kernels of
// package qtool/kernels, loaded from embedded PTX.
//
// Weights stay in their stored form on the device: f16/bf16/f32 dense,
// 4-bit weights packed 8 per word (repacked at upload in the order the
// LOP3 unpack wants), other quantized weights as int8 codes with per-group
// {scale, zero} pairs, W8A8 as int8 with its quant_bias/deq_scale.
// Activations and the KV cache are fp32; the matrix kernels accumulate in
// fp32 and feed the tensor cores fp16.
//
// A Backend is not safe for concurrent use. Each call binds the device's
// primary context to the calling OS thread, so it may be used from any
// goroutine.
package cuda

import (
	"bytes"
	"errors"
	"fmt"
	"maps"
	"math"
	"os"
	goruntime "runtime"
	"slices"
	"strings"
	"unsafe"

	"qtool/formats/model"
	"qtool/kernels"
	"qtool/runtime"
	"qtool/runtime/cuda/driver"
)

// ErrNoDriver is wrapped by New when the CUDA driver cannot be loaded.
var ErrNoDriver = driver.ErrNoDriver

var (
	_ runtime.Backend = (*Backend)(nil)
	_ runtime.Fused   = (*Backend)(nil)
)

// Options tune a Backend.
type Options struct {
	// Device is the CUDA device ordinal.
	Device int
	// GEMVMaxRows: matrix products with at most this many activation rows use
	// the GEMV kernels, larger ones the tensor-core GEMM (default 4).
	GEMVMaxRows int
	// PTXPath, when set, loads the kernels from this PTX file instead of the
	// embedded ones (kernel development). New sets it from $QTOOL_CUDA_PTX.
	PTXPath string
	// CubinPath, when set with PTXPath, loads the kernels from this cubin
	// instead: nvcc's build of the same source for this GPU, which the
	// driver takes without compiling PTX (~50 s for the sm_90a PTX on an
	// H200, once per PTX and machine); the kernels' properties are still
	// read from PTXPath's text. Kernel development only: the shipped path
	// is the PTX, and nothing checks that the two come from one source.
	// New sets it from $QTOOL_CUDA_CUBIN.
	CubinPath string
	// CalibPTXPath likewise replaces the calibration kernels
	// ($QTOOL_CALIB_PTX).
	CalibPTXPath string
	// KVHalf keeps the KV caches made afterwards in fp16: keys and values
	// are rounded to fp16 when stored, which halves the cache's memory and
	// attention's reads (attention still computes in fp32).
	KVHalf bool
	// NoDependentLaunch launches every kernel the plain way (it may be
	// changed between calls, through Backend.Options). By default the
	// kernels whose PTX waits for its predecessor (griddepcontrol.wait, the
	// sm_90 build) are programmatic dependent launches: each may start, and
	// prefetch its weights, while the kernel before it finishes.
	NoDependentLaunch bool
	// NoRowSums makes every streaming 4-bit GEMV with a norm sum its input's
	// squares itself instead of using the parts its producer wrote (see
	// rowsums.go; for comparisons, like NoDependentLaunch).
	NoRowSums bool
	// NoWGMMA keeps the prefill GEMMs on the mma.sync kernels (gemm_h_*,
	// w8a8_mma) where the Hopper ones (gemm_wg_*) would run (for
	// comparisons, like NoDependentLaunch).
	NoWGMMA bool
	// NoAsyncGEMV keeps the 4- and 8-bit decode products on gemv_q4_w4h and
	// gemv_q8_w4h (or their _pc forms) where gemv_q4_w4a or gemv_q8_w4a (the
	// ring in shared memory) would run (for comparisons, like
	// NoDependentLaunch).
	NoAsyncGEMV bool
	// NoClusterAttention runs the decode attention's splits as independent
	// blocks merged through global memory (attention*), not as one cluster
	// (attention_f16_cl, sm_90a; for comparisons, like NoDependentLaunch).
	NoClusterAttention bool
	// NoAttnGroups runs the prefill attention of an fp16 cache in blocks
	// of one key group only (attnGroups; for comparisons).
	NoAttnGroups bool
	// NoAttnRows32 runs the prefill attention's blocks of two key groups
	// on 64 query rows a block where attnRows32 would give them 32 (for
	// comparisons).
	NoAttnRows32 bool
	// NoClusterSplit merges the K splits of the int8 Hopper GEMMs through
	// global memory (w8a8_sum_splits) rather than in the splits' shared
	// memory, launched as one cluster a tile (splitPlan; the fp16 ones
	// merge so only where tests force it; for comparisons, like
	// NoDependentLaunch).
	NoClusterSplit bool
	// WGWide chooses the Hopper GEMMs' blocks of two 128-row halves (the
	// _w kernels: 256 activation rows for the register-fragment kinds,
	// every fragment serving both; 256 weight rows for fp16 and int8, one
	// wgmma m64n256 a step): 0 as wideWG's rule says, 1 wherever there is a _w
	// kernel, -1 never (for comparisons, like NoDependentLaunch).
	WGWide int
	// GLUFill chooses the W8A8 gate/up pair's fill forms
	// (gemm_wg_s8_glu_f88 and _f112, blocks of 88 or 112 rows of each
	// weight): 0 as gluFillRows's rule says, -1 never (for comparisons,
	// like NoDependentLaunch), above 0 as the rule says past its
	// gluFillMaxRows activation rows too (for measuring there).
	GLUFill int
	// S8Fill chooses the plain int8 GEMM's fill form (gemm_wg_s8_f112,
	// blocks of 112 weight rows): 0 as s8Fill's rule says, -1 never (for
	// comparisons, like NoDependentLaunch), above 0 always (tests).
	S8Fill int
	// AttnSplit is the number of 64-key tiles a block of the prefill
	// attention takes at most: 0 lets the launch's shape choose (attnSplit),
	// a negative value gives every query tile one block (for comparisons,
	// like NoDependentLaunch).
	AttnSplit int
	// KernelTimes records the device time of every kernel launched outside
	// a graph capture (KernelTimes; kerneltimes.go). NewDevice sets it from
	// $QTOOL_CUDA_KERNEL_TIMES=1.
	KernelTimes bool
}

// Backend runs the forward pass on one CUDA device.
type Backend struct {
	drv *driver.Driver
	dev driver.Device
	ctx driver.Context
	mod driver.Module
	// calibMod holds the calibration kernels, loaded on first use.
	calibMod driver.Module
	stream   driver.Stream
	name     string
	sms      int
	cc       [2]int
	opt      Options
	fn       map[string]driver.Function
	// smemPerSM and smemOptin are the shared memory bytes of a
	// multiprocessor and the most one block may take (dynamic included).
	smemPerSM, smemOptin int
	// dependent holds the kernels launched as programmatic dependent
	// launches (see Options.NoDependentLaunch).
	dependent map[string]bool
	// dynSmem is the dynamic shared memory limit set on each kernel that
	// needed more than the default.
	dynSmem map[string]int
	// resident caches the blocks of a kernel a multiprocessor holds at
	// once, by kernel and dynamic shared memory (residentBlocks).
	resident map[residentKey]int
	// attnClusterWide: attention_f16_cl may run clusters of more than 8
	// blocks (clusterAttention).
	attnClusterWide bool
	// clusterFit[s] is how many clusters of s Hopper GEMM blocks (one a
	// multiprocessor) the device runs at once (driver.MaxActiveClusters:
	// what its GPCs hold), for s up to 8; clusterSplits: the driver said
	// (CUDA 12, Hopper GEMMs), so K splits may merge in clusters
	// (splitPlan).
	clusterFit    [9]int
	clusterSplits bool
	// forceClusterSplit makes splitPlan merge in clusters wherever they
	// fit, whatever they cost (tests: every form of the merge).
	forceClusterSplit bool
	// asyncEverywhere makes gemvWide pick the ring in shared memory
	// wherever regRing would pick the one in registers, and streamRows
	// (16 or 32; 0: the rule) makes gemvStreaming pick a kernel of that
	// many rows a block (K ≤ 4096) whatever the launch's rows (set by
	// BenchmarkGEMVWaves alone, which times every form of a shape).
	asyncEverywhere bool
	streamRows      int

	// Kernel argument slots: ptrs[i] points at slots[i], or at a tensor
	// map's bytes.
	slots [32]uint64
	ptrs  [32]unsafe.Pointer
	// wgmma: the Hopper GEMMs (hopperKernels) are loaded and the driver
	// encodes tensor maps; tmaps are the maps encoded anew for each launch
	// (the activations; a widened weight; a Linear keeps its own).
	wgmma bool
	tmaps []*driver.TensorMap
	// attnKeys, where positive, makes the decode attention split its grid
	// as for a cache of that many keys, as a captured step does for its
	// cache's length (tests: splits without keys outside a capture).
	attnKeys int
	// maxSplits, where positive, caps the K splits of a GEMM (tests: rings
	// refilled many times).
	maxSplits int

	pool   map[int][]driver.DevicePtr // freed activation buffers by byte size
	owned  map[driver.DevicePtr]int   // every live allocation and its size
	graphs []*Graph

	scratch map[string]scratch

	// launches counts kernel launches and other writes; sums are the row
	// sums the last one wrote (rowsums.go).
	launches uint64
	sums     rowSums
	// launched counts the launches of each kernel (KernelLaunches).
	launched map[string]int
	// plainNext makes the next launch a plain one: after a kernel whose
	// blocks wait for other ranks' blocks on this GPU (metPeers), and after
	// the kernels that write synthetic weights (uploadSynthetic)
	plainNext bool
	// kt holds the kernel times (Options.KernelTimes).
	kt kernelTimes

	uploaded map[string]int64 // device bytes a decode step reads of each uploaded linear, by name

	// perms holds the act-order column orders by content and permUsers
	// how many linears use each (see Linear.perm).
	perms     map[string]driver.DevicePtr
	permUsers map[driver.DevicePtr]int

	heldBytes, peakBytes int64              // device memory allocated now and at most
	prof                 map[string]float64 // seconds per calibration step, see Profile

	// CUDA graph capture of decode steps.
	capturing bool
	captures  int  // captures begun (filledScratch: the one that filled an area)
	capPos    bool // a decode-step capture: positions and ids come from the device
	capBase   int
	capAllocs map[driver.DevicePtr]bool
	dstate    driver.DevicePtr // int32 [4]: pos, next id, ...
	hist      driver.DevicePtr
	histLen   int

	// peer is this backend's side of an all-reduce over peer memory
	// (peer.go), nil outside a group.
	peer *peerReduce
}

type scratch struct {
	p driver.DevicePtr
	n int
	// filledIn: for a filledScratch area allocated during a capture, whose
	// memset only the graph's replays run, the capture (Backend.captures,
	// from 1) whose graph last filled it; 0 once a use outside a capture
	// filled it, or where it was allocated outside one
	filledIn int
}

// New opens the first CUDA device with default options. Without a driver
// the error wraps ErrNoDriver ("no CUDA driver found").
func New() (*Backend, error) { return NewDevice(0) }

// NewDevice opens CUDA device d with default options ($QTOOL_CUDA_PTX,
// $QTOOL_CUDA_CUBIN, $QTOOL_CALIB_PTX and $QTOOL_CUDA_KERNEL_TIMES are
// honoured, for kernel work).
func NewDevice(d int) (*Backend, error) {
	return NewWithOptions(Options{Device: d, PTXPath: os.Getenv("QTOOL_CUDA_PTX"), CubinPath: os.Getenv("QTOOL_CUDA_CUBIN"),
		CalibPTXPath: os.Getenv("QTOOL_CALIB_PTX"), KernelTimes: os.Getenv("QTOOL_CUDA_KERNEL_TIMES") == "1"})
}

// DeviceCount returns the number of CUDA devices (an error wrapping
// ErrNoDriver without a usable driver).
func DeviceCount() (int, error) {
	drv, err := driver.Open()
	if err != nil {
		return 0, err
	}
	return drv.DeviceCount()
}

// NewRank is NewDevice typed for tp.NewGPU: the backend of the
// tensor-parallel rank on GPU d.
func NewRank(d int) (runtime.Backend, error) {
	b, err := NewDevice(d)
	if err != nil {
		return nil, err
	}
	return b, nil
}

// NewWithOptions opens a CUDA device.
func NewWithOptions(opt Options) (b *Backend, err error) {
	if opt.GEMVMaxRows <= 0 {
		opt.GEMVMaxRows = 4
	}
	if opt.CubinPath != "" && opt.PTXPath == "" {
		return nil, fmt.Errorf("cuda: the cubin %s needs the PTX it was built from (QTOOL_CUDA_PTX) for its kernels' properties", opt.CubinPath)
	}
	drv, err := driver.Open()
	if err != nil {
		return nil, err
	}
	goruntime.LockOSThread()
	defer goruntime.UnlockOSThread()
	n, err := drv.DeviceCount()
	if err != nil {
		return nil, err
	}
	if opt.Device < 0 || opt.Device >= n {
		return nil, fmt.Errorf("cuda: device %d requested, %d present: %w", opt.Device, n, ErrNoDriver)
	}
	b = &Backend{drv: drv, opt: opt, fn: map[string]driver.Function{}, dynSmem: map[string]int{}, resident: map[residentKey]int{}, pool: map[int][]driver.DevicePtr{}, launched: map[string]int{},
		owned: map[driver.DevicePtr]int{}, scratch: map[string]scratch{}, uploaded: map[string]int64{}, prof: map[string]float64{},
		perms: map[string]driver.DevicePtr{}, permUsers: map[driver.DevicePtr]int{}}
	for i := range b.slots {
		b.ptrs[i] = unsafe.Pointer(&b.slots[i])
	}
	if b.dev, err = drv.Device(opt.Device); err != nil {
		return nil, err
	}
	if b.ctx, err = drv.PrimaryCtxRetain(b.dev); err != nil {
		return nil, err
	}
	defer func() {
		if err != nil {
			b.Close()
			b = nil
		}
	}()
	if err = drv.SetCurrent(b.ctx); err != nil {
		return nil, err
	}
	devName, err := drv.DeviceName(b.dev)
	if err != nil {
		return nil, err
	}
	attrs, err := b.attributes(driver.AttrComputeMajor, driver.AttrComputeMinor, driver.AttrMultiprocessorCount,
		driver.AttrMaxSharedPerSM, driver.AttrMaxSharedPerBlockOptin)
	if err != nil {
		return nil, err
	}
	b.cc = [2]int{attrs[0], attrs[1]}
	b.sms, b.smemPerSM, b.smemOptin = attrs[2], attrs[3], attrs[4]
	ptx, arch := kernels.PTX(b.cc[0], b.cc[1])
	if opt.PTXPath != "" {
		if ptx, err = os.ReadFile(opt.PTXPath); err != nil {
			return nil, fmt.Errorf("cuda: %w", err)
		}
		arch = opt.PTXPath
	}
	if ptx == nil {
		return nil, fmt.Errorf("cuda: %s has compute capability %d.%d; qtool's kernels need 8.0 or newer", devName, b.cc[0], b.cc[1])
	}
	image, form := ptx, "PTX"
	if opt.CubinPath != "" {
		if image, err = readCubin(opt.CubinPath); err != nil {
			return nil, err
		}
		arch, form = opt.CubinPath, "cubin"
	}
	if b.mod, err = drv.ModuleLoadData(image); err != nil {
		return nil, fmt.Errorf("cuda: loading %s kernels: %w", arch, err)
	}
	for _, k := range kernelNames() {
		if attnGroupKernels[k] && attnTC2Smem > b.smemOptin {
			continue // never selected here (attnGroups): not loaded, so that no test must launch it
		}
		if b.fn[k], err = drv.Function(b.mod, k); err != nil {
			return nil, err
		}
	}
	if kernels.IsArchSpecific(ptx) && drv.CanEncodeTensorMaps() {
		for _, k := range hopperKernels {
			if b.fn[k], err = drv.Function(b.mod, k); err != nil {
				return nil, err
			}
		}
		b.wgmma, b.tmaps = true, driver.NewTensorMaps(2)
		b.clusterSplits = b.measureClusterFit()
	}
	if b.cc[0] >= 9 && drv.CanLaunchDependent() {
		b.dependent = waitingKernels(ptx)
	}
	if b.stream, err = drv.StreamCreate(0); err != nil {
		return nil, err
	}
	b.name = fmt.Sprintf("cuda:%s (sm_%d%d, %d SMs, %s %s)", devName, b.cc[0], b.cc[1], b.sms, arch, form)
	return b, nil
}

// readCubin reads the cubin at path (Options.CubinPath), an ELF image.
func readCubin(path string) ([]byte, error) {
	image, err := os.ReadFile(path)
	if err != nil {
		return nil, fmt.Errorf("cuda: %w", err)
	}
	if !bytes.HasPrefix(image, []byte("\x7fELF")) {
		return nil, fmt.Errorf("cuda: %s is not a cubin (no ELF header)", path)
	}
	return image, nil
}

// attributes reads the device attributes attrs (CUdevice_attribute
// values) of b's GPU, in order.
func (b *Backend) attributes(attrs ...int) ([]int, error) {
	v := make([]int, len(attrs))
	for i, a := range attrs {
		var err error
		if v[i], err = b.drv.Attribute(b.dev, a); err != nil {
			return nil, err
		}
	}
	return v, nil
}

// kernelNames lists every kernel the backend looks up.
func kernelNames() []string {
	names := []string{
		"embed_dense", "embed_q8", "embed_q4", "rmsnorm", "rmsnorm_heads", "add_bias", "add_inplace",
		"silu_mul", "rope", "rope_table", "store_kv", "store_kv_f16", "store_kv_i8", "attention", "attention_f16", "attention_i8",
		"attn_tc", "attn_tc_f16", "attn_tc_f16_q", "attn_tc_f16_h", "attn_tc_f16_g", "attn_tc_f16_q_g", "attn_tc_f16_h_g",
		"attn_tc_f16_g32", "attn_tc_f16_q_g32", "attn_tc_f16_h_g32", "attn_tc_i8",
		"gemm_f32", "gemm_q8", "gemm_q4", "sum_splits", "to_half", "gemm_h_f16", "gemm_h_bf16", "gemm_h_q4", "gemm_h_q8",
		"gemm_h_f16_s", "gemm_h_bf16_s", "gemm_h_q4_s", "gemm_h_q8_s", "dequant_h_q4", "dequant_h_q8",
		"gather_cols", "gather_half", "quant_act", "quant_act_token", "w8a8_gemm", "w8a8_glu", "w8a8_mma", "w8a8_sum_splits", "nll", "argmax", "sample", "fill_random",
		"allreduce_peer", "allreduce_peer_ll", "exchange_peer", "exchange_peer_shared",
	}
	names = append(names, gemvKernels...)
	return names
}

// hopperKernels are the kernels only the sm_90a PTX holds (wgmma: the
// values of hopperGEMM, gluKernels, segsKernels, segsKVKernels and tileSendKernels,
// w8a8SegsKernel and the int8 fill forms; clusters: the decode attention's attention_f16_cl),
// looked up where it is loaded.
var hopperKernels = slices.Concat(slices.Sorted(maps.Values(hopperGEMM)), slices.Sorted(maps.Values(gluKernels)), slices.Sorted(maps.Values(wideKernels)),
	slices.Sorted(maps.Values(segsKernels)), slices.Sorted(maps.Values(segsKVKernels)), slices.Sorted(maps.Values(tileSendKernels)),
	[]string{"attention_f16_cl", w8a8SegsKernel, s8FillKernel}, gluFillKernels[:])

// enter binds the context to the calling thread; call the result when done.
func (b *Backend) enter() func() {
	goruntime.LockOSThread()
	if err := b.drv.SetCurrent(b.ctx); err != nil {
		goruntime.UnlockOSThread() // the caller's deferred call never comes
		b.must(err)
	}
	return goruntime.UnlockOSThread
}

func (b *Backend) must(err error) {
	if err != nil {
		panic(fmt.Sprintf("cuda backend: %v", err))
	}
}

// Name implements runtime.Backend.
func (b *Backend) Name() string { return b.name }

// Close frees every device allocation and releases the context.
func (b *Backend) Close() error {
	if b == nil || b.drv == nil {
		return nil
	}
	goruntime.LockOSThread()
	defer goruntime.UnlockOSThread()
	var errs []error
	if b.ctx != 0 {
		errs = append(errs, b.drv.SetCurrent(b.ctx))
		if b.stream != 0 {
			errs = append(errs, b.drv.StreamSynchronize(b.stream))
		}
		for _, g := range b.graphs {
			g.destroy()
		}
		b.graphs = nil
		errs = append(errs, b.closeKernelTimes()...)
		errs = append(errs, b.closePeer())
		for p := range b.owned {
			errs = append(errs, b.drv.MemFree(p))
		}
		b.owned = map[driver.DevicePtr]int{}
		b.pool = map[int][]driver.DevicePtr{}
		b.scratch = map[string]scratch{}
		if b.stream != 0 {
			errs = append(errs, b.drv.StreamDestroy(b.stream))
			b.stream = 0
		}
		if b.mod != 0 {
			errs = append(errs, b.drv.ModuleUnload(b.mod))
			b.mod = 0
		}
		if b.calibMod != 0 {
			errs = append(errs, b.drv.ModuleUnload(b.calibMod))
			b.calibMod = 0
		}
		errs = append(errs, b.drv.PrimaryCtxRelease(b.dev))
		b.ctx = 0
	}
	return errors.Join(errs...)
}

// ---------------------------------------------------------------------------
// Memory.

func (b *Backend) alloc(bytes int) driver.DevicePtr {
	if bytes <= 0 {
		bytes = 4
	}
	if l := b.pool[bytes]; len(l) > 0 {
		p := l[len(l)-1]
		b.pool[bytes] = l[:len(l)-1]
		if b.capturing {
			b.capAllocs[p] = true
		}
		return p
	}
	p, err := b.drv.MemAlloc(uint64(bytes))
	b.must(err)
	b.owned[p] = bytes
	b.heldBytes += int64(bytes)
	b.peakBytes = max(b.peakBytes, b.heldBytes)
	if b.capturing {
		b.capAllocs[p] = true
	}
	return p
}

// release returns p to the pool.
func (b *Backend) release(p driver.DevicePtr) {
	n, ok := b.owned[p]
	if !ok {
		panic("cuda backend: freeing a buffer this backend does not own")
	}
	if b.sums.of == p { // the pool may hand p out again
		b.sums = rowSums{}
	}
	b.pool[n] = append(b.pool[n], p)
}

func (b *Backend) upload(p driver.DevicePtr, src unsafe.Pointer, n int) {
	if n == 0 {
		return
	}
	b.must(b.drv.MemcpyHtoD(p, src, uint64(n)))
}

func (b *Backend) uploadBytes(data []byte) driver.DevicePtr {
	p := b.alloc(len(data))
	if len(data) > 0 {
		b.upload(p, unsafe.Pointer(&data[0]), len(data))
	}
	return p
}

func uploadSlice[T any](b *Backend, v []T) driver.DevicePtr {
	var z T
	n := len(v) * int(unsafe.Sizeof(z))
	p := b.alloc(n)
	if n > 0 {
		b.upload(p, unsafe.Pointer(&v[0]), n)
	}
	goruntime.KeepAlive(v)
	return p
}

// scratchBuf returns a device buffer of at least bytes for a named use.
// Growing an area frees the old one, except while a graph is being captured
// or any captured graph is alive (either may hold it), or while the backend
// is in a connected peer-memory group: then it stays allocated until Close.
// A free may wait for the GPUs this one has peer access to as well as its
// own (NVIDIA/nccl#744), where another rank's all-reduce may already spin,
// waiting for this rank's launch that comes after the free: a deadlock
// until the all-reduce's time-out.
func (b *Backend) scratchBuf(name string, bytes int) driver.DevicePtr {
	p, _ := b.scratchArea(name, bytes)
	return p
}

// scratchArea is scratchBuf that also reports whether it (re)allocated the
// area. A (re)allocated area holds whatever the allocator left there, also
// where the allocator hands out again the address of the area just freed:
// its users must not tell a new area by its address (zeroedScratch).
func (b *Backend) scratchArea(name string, bytes int) (p driver.DevicePtr, fresh bool) {
	s := b.scratch[name]
	if s.n >= bytes {
		return s.p, false
	}
	if s.p != 0 && !b.outgrownHeld() {
		b.must(b.drv.StreamSynchronize(b.stream))
		b.must(b.drv.MemFree(s.p))
		delete(b.owned, s.p)
	}
	n := max(bytes, 2*s.n, 1024)
	p, err := b.drv.MemAlloc(uint64(n))
	b.must(err)
	b.owned[p] = -1 // never pooled
	b.scratch[name] = scratch{p: p, n: n}
	return p, true
}

// outgrownHeld reports whether an outgrown scratch area must stay
// allocated (scratchBuf): during a capture, while a captured graph is
// alive, or in a connected peer-memory group.
func (b *Backend) outgrownHeld() bool {
	return b.capturing || b.liveGraphs() || b.peerReduceCap() > 0
}

// liveGraphs reports whether a captured graph has not been destroyed yet
// (and drops the destroyed ones from b.graphs).
func (b *Backend) liveGraphs() bool {
	live := b.graphs[:0]
	for _, g := range b.graphs {
		if !g.freed {
			live = append(live, g)
		}
	}
	clear(b.graphs[len(live):])
	b.graphs = live
	return len(live) > 0
}

// zeroedScratch is scratchBuf whose area is zeroed when it is (re)allocated;
// its users (kernels counting arrivals) leave it zero.
func (b *Backend) zeroedScratch(name string, bytes int) driver.DevicePtr {
	return b.filledScratch(name, bytes, 0)
}

// filledScratch is scratchBuf whose area holds the 32-bit word fill
// everywhere when it is (re)allocated, also at the address of the area it
// outgrew (scratchArea); its users leave it so. An area allocated during a
// graph capture is filled by the graph before its users. Until the first
// use outside a capture fills it once more (which may come before any
// replay), each later capture's graph fills it too, once, since the first
// graph may never run (a failed instantiation, a tensor-parallel capture
// given up on another rank).
func (b *Backend) filledScratch(name string, bytes int, fill uint32) driver.DevicePtr {
	old := b.scratch[name]
	p, fresh := b.scratchArea(name, bytes)
	now := 0 // the capture a memset would be part of, 0 outside one
	if b.capturing {
		now = b.captures
	}
	if fresh || old.filledIn != 0 && old.filledIn != now {
		s := b.scratch[name]
		b.must(b.drv.MemsetD32Async(p, fill, uint64(s.n/4), b.stream))
		s.filledIn = now
		b.scratch[name] = s
	}
	return p
}

// Buf is a device activation matrix of fp32 values.
type Buf struct {
	p          driver.DevicePtr
	rows, cols int
}

// Rows implements runtime.Buf.
func (x *Buf) Rows() int { return x.rows }

// Cols implements runtime.Buf.
func (x *Buf) Cols() int { return x.cols }

// Ptr is the device address of the first value.
func (x *Buf) Ptr() uint64 { return uint64(x.p) }

func (x *Buf) n() int { return x.rows * x.cols }

func buf(x runtime.Buf) *Buf {
	d, ok := x.(*Buf)
	if !ok || d == nil || d.p == 0 {
		panic(fmt.Sprintf("cuda backend: buffer %T is not a live CUDA buffer", x))
	}
	return d
}

// Alloc implements runtime.Backend.
func (b *Backend) Alloc(rows, cols int) runtime.Buf {
	if rows < 0 || cols < 0 {
		panic(fmt.Sprintf("cuda backend: Alloc(%d, %d)", rows, cols))
	}
	defer b.enter()()
	x := &Buf{p: b.alloc(4 * rows * cols), rows: rows, cols: cols}
	// Buffers allocated inside a graph capture are not zeroed: the forward
	// pass takes its activations from AllocRaw, and what else a capture
	// allocates is written before it is read; a memset node per buffer
	// would cost a graph node each.
	if rows*cols > 0 && !b.capturing {
		b.must(b.drv.MemsetD32Async(x.p, 0, uint64(rows*cols), b.stream))
	}
	return x
}

// AllocRaw implements runtime.RawAllocator: Alloc without the memset.
func (b *Backend) AllocRaw(rows, cols int) runtime.Buf {
	if rows < 0 || cols < 0 {
		panic(fmt.Sprintf("cuda backend: AllocRaw(%d, %d)", rows, cols))
	}
	defer b.enter()()
	return &Buf{p: b.alloc(4 * rows * cols), rows: rows, cols: cols}
}

// Free implements runtime.Backend.
func (b *Backend) Free(x runtime.Buf) {
	d := buf(x)
	b.release(d.p)
	d.p = 0
}

// Upload implements runtime.Backend.
func (b *Backend) Upload(dst runtime.Buf, src []float32) {
	d := buf(dst)
	if len(src) != d.n() {
		panic(fmt.Sprintf("cuda backend: Upload of %d values into [%d %d]", len(src), d.rows, d.cols))
	}
	defer b.enter()()
	b.wrote()
	if len(src) > 0 {
		b.upload(d.p, unsafe.Pointer(&src[0]), 4*len(src))
	}
}

// Download implements runtime.Backend.
func (b *Backend) Download(dst []float32, src runtime.Buf) {
	s := buf(src)
	if len(dst) != s.n() {
		panic(fmt.Sprintf("cuda backend: Download of [%d %d] into %d values", s.rows, s.cols, len(dst)))
	}
	defer b.enter()()
	if len(dst) > 0 {
		b.must(b.drv.MemcpyDtoH(unsafe.Pointer(&dst[0]), s.p, uint64(4*len(dst))))
	}
}

// Vector is an uploaded fp32 vector.
type Vector struct {
	p driver.DevicePtr
	n int
}

// Len implements runtime.Vector.
func (v *Vector) Len() int { return v.n }

// UploadVector implements runtime.Backend.
func (b *Backend) UploadVector(name string, t model.Tensor) (runtime.Vector, error) {
	if t == nil {
		return nil, fmt.Errorf("cuda: vector %s: nil tensor", name)
	}
	shape := t.Shape()
	if len(shape) != 1 {
		return nil, fmt.Errorf("cuda: vector %s has shape %v, want 1-D", name, shape)
	}
	defer b.enter()()
	if s, ok := t.(*Synthetic); ok {
		p := b.alloc(4 * shape[0])
		b.fill(p, shape[0], s.Seed, 5, 0.1)
		return &Vector{p, shape[0]}, nil
	}
	v, err := t.Float32()
	if err != nil {
		return nil, fmt.Errorf("cuda: vector %s: %w", name, err)
	}
	return &Vector{uploadSlice(b, v), len(v)}, nil
}

func vec(v runtime.Vector) *Vector {
	d, ok := v.(*Vector)
	if !ok || d == nil {
		panic(fmt.Sprintf("cuda backend: vector %T is not a CUDA vector", v))
	}
	return d
}

func vecPtr(v runtime.Vector) driver.DevicePtr {
	if v == nil {
		return 0
	}
	if d, ok := v.(*Vector); ok && d == nil {
		return 0
	}
	return vec(v).p
}

// ---------------------------------------------------------------------------
// Launching.

// KernelLaunches returns how many times each kernel has been launched
// (a copy; the kernels of a CUDA graph count once, when captured): what
// a pass ran is the difference of two calls.
func (b *Backend) KernelLaunches() map[string]int { return maps.Clone(b.launched) }

func (b *Backend) launch(name string, grid, block [3]uint32, args ...any) {
	b.launchShm(name, grid, block, 0, args...)
}

// launchShm launches with shm bytes of dynamic shared memory.
func (b *Backend) launchShm(name string, grid, block [3]uint32, shm int, args ...any) {
	b.launchCluster(name, grid, block, [3]uint32{}, shm, args...)
}

// launchCluster launches with the grid's blocks in clusters of cluster
// blocks (none where cluster is zero) and shm bytes of dynamic shared memory.
func (b *Backend) launchCluster(name string, grid, block, cluster [3]uint32, shm int, args ...any) {
	f, ok := b.fn[name]
	if !ok {
		panic("cuda backend: unknown kernel " + name)
	}
	b.launches++
	b.launched[name]++
	if len(args) > len(b.slots) {
		panic("cuda backend: too many kernel arguments")
	}
	for i, a := range args {
		b.ptrs[i] = unsafe.Pointer(&b.slots[i])
		switch v := a.(type) {
		case *driver.TensorMap:
			b.ptrs[i] = v.Ptr()
		case driver.DevicePtr:
			b.slots[i] = uint64(v)
		case int:
			b.slots[i] = uint64(int64(v))
		case int64:
			b.slots[i] = uint64(v)
		case uint64:
			b.slots[i] = v
		case float32:
			b.slots[i] = uint64(math.Float32bits(v))
		case float64:
			b.slots[i] = math.Float64bits(v)
		default:
			panic(fmt.Sprintf("cuda backend: kernel %s argument %d has type %T", name, i, a))
		}
	}
	for _, d := range grid {
		if d == 0 {
			return // nothing to do
		}
	}
	timed := b.opt.KernelTimes && !b.capturing
	var start driver.Event
	if timed {
		start = b.markKernelStart()
	}
	dep := b.dependent[name] && !b.opt.NoDependentLaunch && !b.plainNext
	b.plainNext = false
	switch {
	case cluster != [3]uint32{}:
		b.must(b.drv.LaunchCluster(f, grid, block, cluster, uint32(shm), b.stream, &b.ptrs[0], dep))
	case dep:
		b.must(b.drv.LaunchDependent(f, grid, block, uint32(shm), b.stream, &b.ptrs[0]))
	default:
		b.must(b.drv.Launch(f, grid, block, uint32(shm), b.stream, &b.ptrs[0]))
	}
	if timed {
		b.markKernelEnd(name, start)
	}
}

// waitingKernels returns the entries of a PTX module whose code waits for
// the grid they depend on (griddepcontrol.wait): the kernels that may be
// launched as programmatic dependent launches. A kernel without the wait
// could read its inputs before they are written, so it never is.
func waitingKernels(ptx []byte) map[string]bool {
	out := map[string]bool{}
	const marker = ".entry "
	text := string(ptx)
	for {
		i := strings.Index(text, marker)
		if i < 0 {
			return out
		}
		text = text[i+len(marker):]
		name := text[:strings.IndexAny(text+"(", "( \n")]
		body := text
		if j := strings.Index(text, marker); j >= 0 {
			body = text[:j]
		}
		if strings.Contains(body, "griddepcontrol.wait") {
			out[name] = true
		}
	}
}

func g1(n int) [3]uint32 { return [3]uint32{uint32(n), 1, 1} }

// gridFor is a grid-stride grid of 256-thread blocks for n elements.
func (b *Backend) gridFor(n int) [3]uint32 {
	return g1(max(1, min((n+255)/256, 32*b.sms)))
}

var block256 = [3]uint32{256, 1, 1}

func (b *Backend) fill(p driver.DevicePtr, n int, seed uint64, mode int, a float32) {
	b.launch("fill_random", b.gridFor(n), block256, p, int64(n), seed, mode, a)
}

// ---------------------------------------------------------------------------
// Elementwise operations.

// Embed implements runtime.Backend.
func (b *Backend) Embed(dst runtime.Buf, table runtime.Linear, ids []int) {
	w := lin(table)
	for i, id := range ids {
		if id < 0 || id >= w.out {
			panic(fmt.Sprintf("cuda backend: token id %d at %d outside the table of %d rows", id, i, w.out))
		}
	}
	b.EmbedRange(dst, table, ids, 0)
}

// EmbedRange is Embed for one slice of a vocabulary-split table (the
// tensor-parallel backend's embedding): table holds the rows of ids
// lo..lo+table.Out()−1, and an id outside that range gives a row of zeros.
// Inside a decode-step capture the id comes from the device.
func (b *Backend) EmbedRange(dst runtime.Buf, table runtime.Linear, ids []int, lo int) {
	d, w := buf(dst), lin(table)
	if d.rows != len(ids) || d.cols != w.in {
		panic(fmt.Sprintf("cuda backend: Embed of %d ids into [%d %d] from a table of width %d", len(ids), d.rows, d.cols, w.in))
	}
	if w.kind == kindW8A8 {
		panic("cuda backend: a W8A8 weight cannot be an embedding table")
	}
	defer b.enter()()
	var idp driver.DevicePtr
	if b.capturing && !b.capPos {
		panic("cuda backend: Embed inside TimeCaptured")
	}
	if b.capturing {
		if len(ids) != 1 {
			panic("cuda backend: graph capture supports single-token steps only")
		}
		idp = b.dstate + 4
	} else {
		ids32 := make([]int32, len(ids))
		for i, id := range ids {
			if id < 0 || id > math.MaxInt32 {
				panic(fmt.Sprintf("cuda backend: token id %d at %d is negative or too large", id, i))
			}
			ids32[i] = int32(id)
		}
		idp = b.scratchBuf("ids", 4*len(ids))
		if len(ids) > 0 {
			b.upload(idp, unsafe.Pointer(&ids32[0]), 4*len(ids))
		}
	}
	switch w.kind {
	case kindQ4:
		b.launch("embed_q4", g1(len(ids)), block256, d.p, w.w, w.sz, w.perm, idp, w.in, w.gs, w.groups, lo, w.out)
	case kindQ8:
		b.launch("embed_q8", g1(len(ids)), block256, d.p, w.w, w.sz, w.gidx, idp, w.in, w.gs, w.groups, lo, w.out)
	default:
		b.launch("embed_dense", g1(len(ids)), block256, d.p, w.w, idp, w.in, w.kind, lo, w.out)
	}
}

// RMSNorm implements runtime.Backend.
func (b *Backend) RMSNorm(dst, x runtime.Buf, w, bias runtime.Vector, eps float32) {
	d, s := buf(dst), buf(x)
	if d.rows != s.rows || d.cols != s.cols || vec(w).n != s.cols {
		panic(fmt.Sprintf("cuda backend: RMSNorm shapes [%d %d] <- [%d %d], weight %d", d.rows, d.cols, s.rows, s.cols, vec(w).n))
	}
	defer b.enter()()
	b.launch("rmsnorm", g1(s.rows), b.rowBlock(s.rows, s.cols), d.p, s.p, vec(w).p, vecPtr(bias), s.cols, eps, driver.DevicePtr(0),
		driver.DevicePtr(0), driver.DevicePtr(0), float32(0), float32(0))
}

// rowBlock is the block size of a one-block-per-row kernel: wide blocks
// when there are few rows (decode), 256 threads otherwise.
func (b *Backend) rowBlock(rows, cols int) [3]uint32 {
	if rows < b.sms && cols >= 4096 {
		return [3]uint32{1024, 1, 1}
	}
	return block256
}

// RMSNormHeads implements runtime.Backend.
func (b *Backend) RMSNormHeads(x runtime.Buf, headDim int, w runtime.Vector, eps float32) {
	s := buf(x)
	if headDim <= 0 || s.cols%headDim != 0 || vec(w).n != headDim {
		panic(fmt.Sprintf("cuda backend: RMSNormHeads of width %d, head %d, weight %d", s.cols, headDim, vec(w).n))
	}
	defer b.enter()()
	warps := min(32, s.cols/headDim) // a warp a head: Qwen3-8B's 32 query heads at once
	b.launch("rmsnorm_heads", g1(s.rows), [3]uint32{uint32(32 * warps), 1, 1}, s.p, vec(w).p, s.cols, headDim, eps)
}

// AddBias implements runtime.Backend.
func (b *Backend) AddBias(x runtime.Buf, bias runtime.Vector) {
	s := buf(x)
	if vec(bias).n != s.cols {
		panic("cuda backend: AddBias width mismatch")
	}
	defer b.enter()()
	b.launch("add_bias", b.gridFor(s.n()), block256, s.p, vec(bias).p, s.rows, s.cols)
}

// Add implements runtime.Backend.
func (b *Backend) Add(dst, x runtime.Buf) {
	d, s := buf(dst), buf(x)
	if d.rows != s.rows || d.cols != s.cols {
		panic("cuda backend: Add shape mismatch")
	}
	defer b.enter()()
	b.launch("add_inplace", b.gridFor(d.n()), block256, d.p, s.p, int64(d.n()))
}

// SiLUMul implements runtime.Backend.
func (b *Backend) SiLUMul(dst, gate, up runtime.Buf) {
	d, g, u := buf(dst), buf(gate), buf(up)
	if d.n() != g.n() || d.n() != u.n() || d.cols != g.cols {
		panic("cuda backend: SiLUMul shape mismatch")
	}
	defer b.enter()()
	b.launch("silu_mul", b.gridFor(d.n()), block256, d.p, g.p, u.p, int64(d.n()))
}

// posArgs returns the (pos0, dpos) kernel arguments for a step at pos0.
func (b *Backend) posArgs(pos0 int) (int, driver.DevicePtr) {
	if b.capturing && b.capPos {
		return pos0 - b.capBase, b.dstate
	}
	return pos0, 0
}

// RoPE implements runtime.Backend.
func (b *Backend) RoPE(x runtime.Buf, headDim, pos0 int, theta float64, layout model.RopeLayout) {
	s := buf(x)
	if headDim <= 0 || headDim%2 != 0 || s.cols%headDim != 0 {
		panic(fmt.Sprintf("cuda backend: RoPE of width %d with head %d", s.cols, headDim))
	}
	defer b.enter()()
	p, dp := b.posArgs(pos0)
	hg, items := ropeItems(s.rows, s.cols/headDim, headDim)
	b.launch("rope", b.gridFor(items), block256, s.p, s.rows, s.cols, headDim, p, dp, theta, int(layout), hg)
}

// KVCache is a device cache of keys and values, [layers][maxSeq][kvDim], in
// fp32 or (Options.KVHalf) fp16.
type KVCache struct {
	k, v                  driver.DevicePtr
	layers, maxSeq, kvDim int
	half                  bool // fp16 elements
	// quant holds an int8 cache's quantizers (NewInt8KVCache): k scales,
	// k offsets, v scales, v offsets, each [layers][kvDim] fp32; 0 for a
	// float cache.
	quant driver.DevicePtr
	// rope is the decode attention's table of RoPE angles for head size
	// ropeHD and ropeTheta (ropeTable), 0 until its first use.
	rope      driver.DevicePtr
	ropeHD    int
	ropeTheta float64
}

// elem is the size of one cached value in bytes.
func (c *KVCache) elem() int {
	switch {
	case c.quant != 0:
		return 1
	case c.half:
		return 2
	}
	return 4
}

// NewInt8KVCache implements runtime.Int8KVBackend: the cache holds int8
// values (msmodelslim C8) and the layers' quantizers.
func (b *Backend) NewInt8KVCache(maxSeq, kvDim int, layers []runtime.KVQuant) (runtime.KVCache, error) {
	n := len(layers) * kvDim
	q := make([]float32, 4*n)
	for l := range layers {
		if err := layers[l].Validate(kvDim); err != nil {
			return nil, fmt.Errorf("cuda: layer %d: %w", l, err)
		}
		for i, v := range [][]float32{layers[l].KScale, layers[l].KOffset, layers[l].VScale, layers[l].VOffset} {
			copy(q[i*n+l*kvDim:], v)
		}
	}
	defer b.enter()()
	c := &KVCache{layers: len(layers), maxSeq: maxSeq, kvDim: kvDim, quant: uploadSlice(b, q)}
	bytes := len(layers) * maxSeq * kvDim // int8; kvDim is a multiple of 32: whole words
	c.k, c.v = b.alloc(bytes), b.alloc(bytes)
	b.must(b.drv.MemsetD32Async(c.k, 0, uint64(bytes/4), b.stream))
	b.must(b.drv.MemsetD32Async(c.v, 0, uint64(bytes/4), b.stream))
	return c, nil
}

// quantArgs are the int8 cache kernels' scale and offset pointers of
// layer: k scale, k offset, v scale, v offset.
func (c *KVCache) quantArgs(layer int) []any {
	n := driver.DevicePtr(4 * c.layers * c.kvDim)
	p := c.quant + driver.DevicePtr(4*layer*c.kvDim)
	return []any{p, p + n, p + 2*n, p + 3*n}
}

// MaxSeq implements runtime.KVCache.
func (c *KVCache) MaxSeq() int { return c.maxSeq }

// NewKVCache implements runtime.Backend.
func (b *Backend) NewKVCache(layers, maxSeq, kvDim int) runtime.KVCache {
	defer b.enter()()
	n := layers * maxSeq * kvDim
	c := &KVCache{layers: layers, maxSeq: maxSeq, kvDim: kvDim, half: b.opt.KVHalf}
	bytes := c.elem() * n
	c.k, c.v = b.alloc(bytes), b.alloc(bytes)
	b.must(b.drv.MemsetD32Async(c.k, 0, uint64(bytes/4), b.stream)) // kvDim is even: whole words
	b.must(b.drv.MemsetD32Async(c.v, 0, uint64(bytes/4), b.stream))
	return c
}

func cache(c runtime.KVCache) *KVCache {
	d, ok := c.(*KVCache)
	if !ok || d == nil {
		panic(fmt.Sprintf("cuda backend: cache %T is not a CUDA cache", c))
	}
	return d
}

// FreeKVCache releases a cache made by NewKVCache.
func (b *Backend) FreeKVCache(c runtime.KVCache) {
	d := cache(c)
	b.release(d.k)
	b.release(d.v)
	if d.quant != 0 {
		b.release(d.quant)
	}
	if d.rope != 0 {
		b.release(d.rope)
	}
	d.k, d.v, d.quant, d.rope = 0, 0, 0, 0
}

func (c *KVCache) layerOff(layer int) driver.DevicePtr {
	return driver.DevicePtr(c.elem() * layer * c.maxSeq * c.kvDim)
}

// kernel names the variant of a cache kernel for c's element type.
func (c *KVCache) kernel(name string) string {
	switch {
	case c.quant != 0:
		return name + "_i8"
	case c.half:
		return name + "_f16"
	}
	return name
}

// StoreKV implements runtime.Backend.
func (b *Backend) StoreKV(c runtime.KVCache, layer, pos0 int, k, v runtime.Buf) {
	b.storeKV(c, layer, pos0, k, v, nil, 0, 0, 0)
}

// RoPEStoreKV implements runtime.Fused: one kernel rotates q and k and
// stores the keys and values.
func (b *Backend) RoPEStoreKV(c runtime.KVCache, layer, pos0 int, q, k, v runtime.Buf, headDim int, theta float64, layout model.RopeLayout) {
	qb, kb := buf(q), buf(k)
	if headDim <= 0 || headDim%2 != 0 || qb.cols%headDim != 0 || kb.cols%headDim != 0 || qb.rows != kb.rows {
		panic(fmt.Sprintf("cuda backend: RoPEStoreKV of q [%d %d], k [%d %d] with head %d", qb.rows, qb.cols, kb.rows, kb.cols, headDim))
	}
	b.storeKV(c, layer, pos0, k, v, qb, headDim, theta, layout)
}

// ropeHeads is how many heads share one RoPE angle in rope and store_kv*
// from ropeGroupRows rows on (prefill: a quarter of the launch's work is
// the angles otherwise; store_kv* issues the loads of up to ROPE_BATCH = 8
// heads at once); fewer rows take one head an item, so that a decode
// step's few items each wait on one head's loads only.
const (
	ropeHeads     = 8
	ropeGroupRows = 32
)

// ropeItems is the heads an item takes (hg) and the items of a RoPE launch
// over rows of heads heads of hd values (qtool.cu's rope_item).
func ropeItems(rows, heads, hd int) (hg, items int) {
	hg = 1
	if rows >= ropeGroupRows {
		hg = ropeHeads
	}
	items = rows * hd / 2 * ((heads + hg - 1) / hg)
	if items > math.MaxInt32 {
		panic(fmt.Sprintf("cuda backend: RoPE of %d rows of %d heads exceeds a launch's 2³¹ items", rows, heads))
	}
	return hg, items
}

// storeKV launches store_kv*: with q set, RoPE of q and k first.
func (b *Backend) storeKV(c runtime.KVCache, layer, pos0 int, k, v runtime.Buf, q *Buf, headDim int, theta float64, layout model.RopeLayout) {
	kc, kb, vb := cache(c), buf(k), buf(v)
	if kb.cols != kc.kvDim || vb.cols != kc.kvDim || kb.rows != vb.rows || layer < 0 || layer >= kc.layers {
		panic("cuda backend: StoreKV shape mismatch")
	}
	if !b.capPos && (pos0 < 0 || pos0+kb.rows > kc.maxSeq) {
		panic(fmt.Sprintf("cuda backend: positions %d..%d outside the cache of %d", pos0, pos0+kb.rows-1, kc.maxSeq))
	}
	defer b.enter()()
	off := kc.layerOff(layer)
	p, dp := b.posArgs(pos0)
	args := []any{kc.k + off, kc.v + off, kb.p, vb.p, kb.rows, kc.kvDim, p, dp, kc.maxSeq}
	if kc.quant != 0 {
		args = append(args, kc.quantArgs(layer)...)
	}
	items := kb.n()
	var qp driver.DevicePtr
	qcols, hg := 0, 1
	if q != nil {
		qp, qcols = q.p, q.cols
		hg, items = ropeItems(kb.rows, (q.cols+kb.cols)/headDim, headDim)
	}
	args = append(args, qp, qcols, headDim, theta, int(layout), hg)
	b.launch(kc.kernel("store_kv"), b.gridFor(items), block256, args...)
}

// attnMaxSplits bounds the splits of a decode attention row (qtool.cu's
// ATT_MAX_SPLITS: the merge stages each split's max and sum in shared
// memory).
const attnMaxSplits = 256

// attnTCMinRows is the least number of query rows that Attention runs on
// the tensor cores (attn_tc: 64 queries a block share each key tile); fewer
// rows take the flash-decoding kernel, which splits long contexts over
// more blocks.
const attnTCMinRows = 32

// attnTCSmem is attn_tc's dynamic shared memory (AT_SMEM in qtool.cu: keys
// as fp16 hi and lo, 64 × 136 halfs each, values transposed, 128 × 72 each;
// attn_tc_f16 holds two key and two value tiles of 64 × 136 halfs in it).
const attnTCSmem = (2*64*136 + 2*128*72) * 2

// attnSplit chooses how the prefill attention splits the keys of its query
// tiles (AtUnit in qtool.cu): at most ct key tiles of 64 a block, units
// blocks a head. Causal query tile i of T rows from pos0 sees
// ⌊(pos0 + min(T, 64(i+1)) − 1)/64⌋ + 1 key tiles, and a launch lasts as
// long as its longest block where the blocks do not fill the device. The
// splits pay only while every block still has a multiprocessor of its own
// (a second block on one runs both at about half speed) and the longest
// block saves more than a split's merge costs (attnSplitMergeTiles): ct
// is the least number of tiles for which heads · units blocks fit the
// multiprocessors where that is attnSplitMergeTiles tiles or more below
// the longest tile's, else no split (H100, 512 tokens: 8 heads split in
// blocks of 3 tiles, 16 and 32 heads unsplit, BenchmarkPrefillAttention;
// H200, 32 heads: 128 and 192 tokens unsplit).
func (b *Backend) attnSplit(T, pos0, heads int) (ct, units int) {
	nq := (T + 63) / 64
	tiles := func(i int) int { return (pos0+min(T, 64*(i+1))-1)/64 + 1 }
	count := func(ct int) (units int) {
		for i := range nq {
			units += (tiles(i) + ct - 1) / ct
		}
		return units
	}
	longest := tiles(nq - 1)
	switch ct = b.opt.AttnSplit; {
	case ct < 0:
		ct = longest // every tile in one block
	case ct == 0:
		ct = longest
		for c := longest - 1; c >= 1 && heads*count(c) <= b.sms; c-- {
			ct = c
		}
		if ct+attnSplitMergeTiles > longest {
			ct = longest
		}
	}
	return ct, count(ct)
}

// attnGroupKernels are the prefill attention's forms in blocks of two key
// groups (attnGroups), of 64 query rows and of 32 (attnRows32).
var attnGroupKernels = map[string]bool{"attn_tc_f16_g": true, "attn_tc_f16_q_g": true, "attn_tc_f16_h_g": true,
	"attn_tc_f16_g32": true, "attn_tc_f16_q_g32": true, "attn_tc_f16_h_g32": true}

// attnTC2Smem is the dynamic shared memory of attn_tc_f16_g, _q_g and
// _h_g and of their _g32 forms (AT_SMEM2: two key groups' two key and two
// value tiles of 64 × 136 halfs).
const attnTC2Smem = 8 * 64 * 136 * 2

// attnGroups reports whether a prefill attention of an fp16 cache, T rows
// of heads heads in units units a head, runs in blocks of two key groups
// (attn_tc_f16_g, _q_g, _h_g: each group every other key tile of the
// block's query tile, merged in shared memory): where no query tile is
// split over blocks (attnSplit), some tile has two key tiles or more,
// the one-group launch is at most a wave (two of its blocks a
// multiprocessor: its registers), whose blocks the groups shorten, and a
// block may have attnTC2Smem (not on sm_86 and sm_89 GPUs: 99 KiB). On an
// H200 (seventy-second session, `bench --synthetic`, 32 heads, W8A8 and
// fp16 in one run) the groups gained at 128 tokens (64 blocks: W8A8
// prefill +1.1…+3.1 %, fp16 −0.2…+1.6 %) and 512 (256 blocks: W8A8
// +0.7…+3.6 %, fp16 within its spread of 36 400–41 200 tok/s), and lost
// 0.3–1.9 % at 2 048 (1 024 blocks), where every multiprocessor already
// runs two.
func (b *Backend) attnGroups(T, heads, units int) bool {
	nq := (T + 63) / 64
	return !b.opt.NoAttnGroups && units == nq && nq >= 2 && heads*units <= 2*b.sms && attnTC2Smem <= b.smemOptin
}

// attnRows32 reports whether a prefill attention in blocks of two key
// groups (attnGroups), T rows of heads heads, runs its blocks on 32 query
// rows (attn_tc_f16_g32, _q_g32, _h_g32: two warps a key group, 128
// threads) rather than 64: where the 32-row blocks fit one wave (one a
// multiprocessor: their shared memory), so that the 64-row ones would
// leave about half the multiprocessors idle — 128 tokens of 32 heads,
// 128 blocks against 64 on an H200's 132. A block's longest chain is
// the same (a warp's 16 rows by its group's key tiles); each scheduler
// runs one warp of it, not two, and the block stages and stores half the
// rows. Seventy-fourth session (one H200, bench --synthetic, 128 tokens,
// against this rule off in the same build; four rounds on llama2-7b,
// three on llama3-8b): W8A8 prefill +1.8 % and +0.9 % (every round
// ahead), fp16 +0.2 %. At a TP=2 rank of llama2-7b (16 heads, seventy-
// fifth session, three rounds) W8A8 +1.7 % at 128 tokens and −0.3 % at
// 256 (128 blocks of 32 rows against 64 of 64: within the spread).
func (b *Backend) attnRows32(T, heads int) bool {
	return !b.opt.NoAttnRows32 && heads*((T+31)/32) <= b.sms
}

// attnSplitMergeTiles is what merging a split query tile costs, in key
// tiles of one block (attnSplit): its units write their unnormalised rows
// and softmax state, and the last of them reads them back and finishes
// the rows. Sixty-eighth session (one H200, `bench --synthetic`, 32
// heads): splitting the query tiles' keys one tile a block (128 tokens:
// 96 blocks against 64; 192: 128 against 96) lost against no split —
// W8A8 prefill 2.4–5.4 % at 128 tokens and 1.8–2.2 % at 192 on llama2-7b
// and llama3-8b, fp16 1.5–3.4 % and 0.5–1.1 %. A merge costs more than
// the one tile it saves the longest block.
const attnSplitMergeTiles = 2

// Attention implements runtime.Backend.
func (b *Backend) Attention(dst, q runtime.Buf, c runtime.KVCache, layer, pos0, heads, kvHeads, headDim int) {
	d, qb, kc := buf(dst), buf(q), cache(c)
	b.checkAttention(d.rows, d.cols, qb, kc, layer, pos0, heads, kvHeads, headDim)
	if qb.rows == 0 {
		return
	}
	defer b.enter()()
	b.attention(d, inputForm{}, qb, kc, layer, pos0, heads, kvHeads, headDim, attnNew{})
}

// checkAttention panics unless Attention can write an output of rows ×
// cols from q, c and the rest.
func (b *Backend) checkAttention(rows, cols int, qb *Buf, kc *KVCache, layer, pos0, heads, kvHeads, headDim int) {
	T := qb.rows
	if qb.cols != heads*headDim || cols != qb.cols || rows != T || kvHeads <= 0 || heads%kvHeads != 0 ||
		kvHeads*headDim != kc.kvDim || headDim%32 != 0 || headDim > 256 || layer < 0 || layer >= kc.layers {
		panic(fmt.Sprintf("cuda backend: Attention shapes q [%d %d], heads %d/%d, head %d, cache width %d", qb.rows, qb.cols, heads, kvHeads, headDim, kc.kvDim))
	}
	if !b.capPos && pos0+T > kc.maxSeq {
		panic("cuda backend: Attention beyond the cache")
	}
}

// attnTC reports whether attention runs T query rows of head size
// headDim on the tensor cores (attn_tc*, the prefill).
func (b *Backend) attnTC(T, headDim int) bool {
	return T >= attnTCMinRows && headDim%16 == 0 && headDim <= 128 && !(b.capturing && b.capPos)
}

// attnNew is a decode row's own key and value for the decode attention
// kernel to rotate, store and use (qtool.cu's AttNew; RoPEAttention),
// with the cache's table of RoPE angles (ropeTable): k = 0 reads every key
// from the cache.
type attnNew struct {
	k, v, tab driver.DevicePtr
	layout    model.RopeLayout
}

// attention is Attention on checked operands. With f an int8 or fp16 form
// (where attnFormOut allows it) the output goes to f, not to d (nil); with nw set
// (one row, the decode kernel) the kernel rotates q and the row's key,
// uses the new key and value as the cache will hold them and stores them.
func (b *Backend) attention(d *Buf, f inputForm, qb *Buf, kc *KVCache, layer, pos0, heads, kvHeads, headDim int, nw attnNew) {
	T := qb.rows
	off := kc.layerOff(layer)
	scale := float32(1 / math.Sqrt(float64(headDim)))
	if b.attnTC(T, headDim) {
		// prefill: 64 queries a block on the tensor cores, the keys of
		// long query tiles split over several blocks where that fills the
		// device (attnSplit), unsplit ones in blocks of two key groups
		// (attnGroups), of 32 queries where 64 would idle half the device
		// (attnRows32)
		ct, units := b.attnSplit(T, pos0, heads)
		var po, pml, cnt driver.DevicePtr
		if units > (T+63)/64 { // some query tile is split: its parts, and a counter a (head, tile)
			po = b.scratchBuf("att_tc_o", 4*64*headDim*heads*units)
			pml = b.scratchBuf("att_tc_ml", 4*64*2*heads*units)
			cnt = b.zeroedScratch("att_tc_cnt", 4*heads*((T+63)/64))
		}
		name := kc.kernel("attn_tc")
		var args []any
		switch {
		case f.p == 0:
			args = []any{d.p, qb.p, kc.k + off, kc.v + off, T, heads, kvHeads, headDim, pos0, scale, ct, units, po, pml, cnt}
			if kc.quant != 0 {
				args = append(args, kc.quantArgs(layer)...)
			}
		case !kc.half || kc.quant != 0 || headDim != 128:
			panic("cuda backend: attention output in a form its kernel does not write")
		case f.half:
			name = "attn_tc_f16_h"
			args = []any{f.p, qb.p, kc.k + off, kc.v + off, T, heads, kvHeads, pos0, scale, ct, units, po, pml, cnt}
		default:
			name = "attn_tc_f16_q"
			args = append(f.args(), qb.p, kc.k+off, kc.v+off, T, heads, kvHeads, pos0, scale, ct, units, po, pml, cnt)
		}
		threads, smem, blocks := uint32(128), attnTCSmem, units
		if kc.half && kc.quant == 0 && b.attnGroups(T, heads, units) {
			name, threads, smem = name+"_g", 256, attnTC2Smem
			if b.attnRows32(T, heads) {
				name, threads, blocks = name+"32", 128, (T+31)/32
			}
		}
		b.raiseSmem(name, smem)
		b.launchShm(name, [3]uint32{uint32(heads), uint32(blocks), 1}, [3]uint32{threads, 1, 1}, smem, args...)
		return
	}
	if f.p != 0 {
		panic("cuda backend: attention output in a form the decode kernel does not write")
	}
	// Splits a row: about four blocks a multiprocessor, no more than the
	// most keys (the cache's length where a graph-captured step serves every
	// position) have 32 each, at most attnMaxSplits (the merge's shared
	// memory). The kernel shares a row's keys among them (at least 32 a
	// split), so a row splits alike in and out of a graph.
	nk := pos0 + T
	if b.capturing && b.capPos {
		nk = kc.maxSeq
	}
	if b.attnKeys > 0 {
		nk = b.attnKeys
	}
	nsplit := min((4*b.sms+T*heads-1)/(T*heads), (nk+31)/32, attnMaxSplits)
	var ml, acc, cnt driver.DevicePtr // the splits' partials and arrivals, merged by each row's last split
	if nsplit > 1 {
		ml = b.scratchBuf("att_ml", 8*T*heads*nsplit)
		acc = b.scratchBuf("att_acc", 4*T*heads*nsplit*headDim)
		cnt = b.zeroedScratch("att_cnt", 4*T*heads)
	}
	p, dp := b.posArgs(pos0)
	args := []any{d.p, qb.p, kc.k + off, kc.v + off, ml, acc, cnt, heads, kvHeads, headDim, p, dp, scale, nsplit,
		nw.k, nw.v, nw.tab, int(nw.layout)}
	if kc.quant != 0 {
		args = append(args, kc.quantArgs(layer)...)
	}
	grid := [3]uint32{uint32(heads), uint32(T), uint32(nsplit)}
	if kc.half && kc.quant == 0 && nsplit > 1 && b.clusterAttention(nsplit, headDim) { // attention_f16's cache
		// the row's splits as one cluster, merged in distributed shared memory
		b.launchCluster("attention_f16_cl", grid, [3]uint32{128, 1, 1}, [3]uint32{1, 1, uint32(nsplit)}, 0, args...)
		return
	}
	b.launch(kc.kernel("attention"), grid, [3]uint32{128, 1, 1}, args...)
}

// clusterAttention reports whether the decode attention of an fp16 cache
// runs a row's nsplit splits as one cluster (attention_f16_cl, a Hopper
// kernel): at most attnMaxCluster, more than 8 only once the kernel
// allows non-portable cluster sizes, and heads of at most 128 values (its
// merge area in shared memory).
func (b *Backend) clusterAttention(nsplit, headDim int) bool {
	f, ok := b.fn["attention_f16_cl"]
	if !ok || b.opt.NoClusterAttention || nsplit > attnMaxCluster || headDim > 128 {
		return false
	}
	if nsplit > 8 && !b.attnClusterWide {
		if err := b.drv.SetFuncAttribute(f, driver.FuncAttrNonPortableClusterSize, 1); err != nil {
			return false
		}
		b.attnClusterWide = true
	}
	return true
}

// attnMaxCluster is the most splits a cluster launch of the decode
// attention merges: the kernel holds ATT_MAX_CLUSTER (16), but on an H100
// a row of 13 or more splits as one cluster made the graph decode 7–10 %
// slower than the global merge, while 5 to 12 splits gained 0.7–1.6 %
// (kernels/NOTES.md, seventeenth session).
const attnMaxCluster = 12

// attnFormOut reports whether the prefill attention of T rows writes its
// output in the form o's product takes (inputFor), where it has one: the
// int8 input of a W8A8 o with a static quantizer whose codes need no
// division (actQuant.divisionFree; attn_tc_f16_q) or the fp16 input of an
// o whose GEMM takes fp16 (attn_tc_f16_h); both for an fp16 cache and head
// size 128.
func (b *Backend) attnFormOut(o *Linear, kc *KVCache, T, headDim int) bool {
	return kc.half && kc.quant == 0 && headDim == 128 && b.attnTC(T, headDim) && b.formFor(o, T) != formNone
}

// AttentionAdd implements runtime.Fused: Attention, then o's products
// added to x; where the prefill attention of an fp16 cache can write o's
// input in the form o's product takes (attnFormOut: int8 codes for a W8A8
// o with a division-free static quantizer, fp16 for a GEMM of fp16
// inputs) it does, with no fp32 output and no quant_act or to_half;
// elsewhere the sequence (runtime.AttentionAddSeq).
func (b *Backend) AttentionAdd(x, q runtime.Buf, c runtime.KVCache, layer, pos0, heads, kvHeads, headDim int, o runtime.Linear) {
	d, qb, kc, l := buf(x), buf(q), cache(c), lin(o)
	if !b.attnFormOut(l, kc, qb.rows, headDim) {
		runtime.AttentionAddSeq(b, x, q, c, layer, pos0, heads, kvHeads, headDim, o)
		return
	}
	defer b.enter()()
	b.matmul(d, b.attendFormed(d, qb, kc, layer, pos0, heads, kvHeads, headDim, l), l, false, outAdd)
}

// attendFormed queues the prefill attention of qb with its output in the
// form o's product takes (attnFormOut holds) and returns that input
// (context current; d is the product's output, checked against it).
func (b *Backend) attendFormed(d, qb *Buf, kc *KVCache, layer, pos0, heads, kvHeads, headDim int, o *Linear) *gemmIn {
	b.checkAttention(qb.rows, qb.cols, qb, kc, layer, pos0, heads, kvHeads, headDim)
	if o.in != qb.cols || o.out != d.cols || d.rows != qb.rows || d.p == qb.p {
		panic(fmt.Sprintf("cuda backend: attention [%d %d] x o [%d %d]ᵀ into [%d %d]", qb.rows, qb.cols, o.out, o.in, d.rows, d.cols))
	}
	f := b.inputFor(o, qb.rows)
	b.attention(nil, f, qb, kc, layer, pos0, heads, kvHeads, headDim, attnNew{})
	return f.input(qb.rows, qb.cols)
}

// RoPEAttention implements runtime.Fused: for a decode row with a head size
// that is a multiple of 64 (each lane's values pair up within the lane or
// with lane ^ 16) the RoPE of q and k and the store of k and v run inside
// the decode attention kernel (AttNew in qtool.cu: one launch fewer), its
// angles from the cache's table (ropeTable); otherwise the sequence
// (runtime.RoPEAttentionSeq). q, k and v are left as they came.
func (b *Backend) RoPEAttention(dst, q, k, v runtime.Buf, c runtime.KVCache, layer, pos0, heads, kvHeads, headDim int, theta float64, layout model.RopeLayout) {
	d, qb, kb, vb, kc := buf(dst), buf(q), buf(k), buf(v), cache(c)
	var tab driver.DevicePtr
	if qb.rows == 1 && headDim%64 == 0 && !b.attnTC(qb.rows, headDim) {
		b.checkAttention(d.rows, d.cols, qb, kc, layer, pos0, heads, kvHeads, headDim)
		if kb.rows != 1 || vb.rows != 1 || kb.cols != kc.kvDim || vb.cols != kc.kvDim || d.p == qb.p || (!b.capPos && pos0 < 0) {
			panic(fmt.Sprintf("cuda backend: RoPEAttention [%d %d] of q [%d %d], k [%d %d], v [%d %d] at position %d",
				d.rows, d.cols, qb.rows, qb.cols, kb.rows, kb.cols, vb.rows, vb.cols, pos0))
		}
		// the attention reads the angles before its wait: not a table made just now
		if t, made := b.ropeTable(kc, headDim, theta); !made {
			tab = t
		}
	}
	if tab == 0 {
		runtime.RoPEAttentionSeq(b, dst, q, k, v, c, layer, pos0, heads, kvHeads, headDim, theta, layout)
		return
	}
	defer b.enter()()
	b.attention(d, inputForm{}, qb, kc, layer, pos0, heads, kvHeads, headDim, attnNew{kb.p, vb.p, tab, layout})
}

// ropeTable returns c's table of RoPE angles for head size hd and theta,
// the (sin, cos) of every pair at every position of the cache (qtool.cu's
// rope_table, computed as the rope kernels compute them), and whether this
// call made it (its kernel the last one queued): its first use outside a
// graph capture makes it; a capture that finds none and a head size or
// theta other than the table's get 0 (the unfused sequence). A kernel that
// reads the angles before its wait (the decode attention) must not take a
// table made just now; one that reads them after (the fused q/k/v store)
// may.
func (b *Backend) ropeTable(c *KVCache, hd int, theta float64) (tab driver.DevicePtr, made bool) {
	switch {
	case c.rope != 0 && c.ropeHD == hd && c.ropeTheta == theta:
		return c.rope, false
	case c.rope != 0 || b.capturing:
		return 0, false
	}
	defer b.enter()()
	n := c.maxSeq * hd / 2
	c.rope, c.ropeHD, c.ropeTheta = b.alloc(8*n), hd, theta
	b.launch("rope_table", b.gridFor(n), block256, c.rope, c.maxSeq, hd, theta)
	return c.rope, true
}

// NLL implements runtime.Backend.
func (b *Backend) NLL(out []float64, logits runtime.Buf, targets []int) {
	l := buf(logits)
	if len(out) != l.rows || len(targets) != l.rows {
		panic("cuda backend: NLL length mismatch")
	}
	if l.rows == 0 {
		return
	}
	t32 := make([]int32, len(targets))
	for i, t := range targets {
		if t < 0 || t >= l.cols {
			panic(fmt.Sprintf("cuda backend: NLL target %d outside 0..%d", t, l.cols-1))
		}
		t32[i] = int32(t)
	}
	defer b.enter()()
	tp := b.scratchBuf("targets", 4*len(t32))
	b.upload(tp, unsafe.Pointer(&t32[0]), 4*len(t32))
	op := b.scratchBuf("nll", 8*l.rows)
	b.launch("nll", g1(l.rows), [3]uint32{512, 1, 1}, op, l.p, tp, l.cols)
	b.must(b.drv.MemcpyDtoH(unsafe.Pointer(&out[0]), op, uint64(8*l.rows)))
}

// Argmax implements runtime.Backend.
func (b *Backend) Argmax(logits runtime.Buf) []int {
	l := buf(logits)
	if l.rows == 0 {
		return nil
	}
	defer b.enter()()
	op := b.scratchBuf("argmax", 4*l.rows)
	b.launchArgmax(op, l, false)
	r := make([]int32, l.rows)
	b.must(b.drv.MemcpyDtoH(unsafe.Pointer(&r[0]), op, uint64(4*l.rows)))
	out := make([]int, l.rows)
	for i, v := range r {
		out[i] = int(v)
	}
	return out
}

// argmaxSpan and argmaxThreads are qtool.cu's ARGMAX_SPAN (the columns of
// a row one block of the argmax kernel takes) and ARGMAX_THREADS.
const (
	argmaxSpan    = 2048
	argmaxThreads = 256
)

// launchArgmax writes the largest logit's index of each row of l to out
// (an int32 a row), a row's columns split over blocks of argmaxSpan. With
// advance (a captured decode step, one row) the kernel also takes it as the
// next token: it appends it to the history, feeds it to the next step and
// advances the position (GreedyAdvance).
func (b *Backend) launchArgmax(out driver.DevicePtr, l *Buf, advance bool) {
	if l.cols == 0 { // no logits: id 0, as a row of NaN gives
		b.must(b.drv.MemsetD32Async(out, 0, uint64(l.rows), b.stream))
		return
	}
	splits := (l.cols + argmaxSpan - 1) / argmaxSpan
	var dpos, ids, hist driver.DevicePtr
	histLen := 0
	if advance {
		dpos, ids, hist, histLen = b.dstate, b.dstate+4, b.hist, b.histLen
	}
	const maxRows = 65535 // grid.y
	for r0 := 0; r0 < l.rows; r0 += maxRows {
		rows := min(maxRows, l.rows-r0)
		var part, cnt driver.DevicePtr
		if splits > 1 {
			part = b.scratchBuf("argmax_part", 8*rows*splits)
			cnt = b.zeroedScratch("argmax_cnt", 4*rows)
		}
		b.launch("argmax", [3]uint32{uint32(splits), uint32(rows), 1}, [3]uint32{argmaxThreads, 1, 1},
			out+driver.DevicePtr(4*r0), l.p+driver.DevicePtr(4*r0*l.cols), l.cols, part, cnt, dpos, ids, hist, histLen)
	}
}

// Sample draws one id per row from softmax(logits/temp), using u[i] in
// [0, 1) as the row's uniform random number (inverse-CDF sampling).
func (b *Backend) Sample(logits runtime.Buf, temp float32, u []float32) []int {
	l := buf(logits)
	if len(u) != l.rows || temp <= 0 {
		panic("cuda backend: Sample needs one uniform per row and temp > 0")
	}
	if l.rows == 0 {
		return nil
	}
	defer b.enter()()
	up := b.scratchBuf("sample_u", 4*l.rows)
	b.upload(up, unsafe.Pointer(&u[0]), 4*len(u))
	op := b.scratchBuf("sample", 4*l.rows)
	b.launch("sample", g1(l.rows), [3]uint32{1024, 1, 1}, op, l.p, up, l.cols, temp)
	r := make([]int32, l.rows)
	b.must(b.drv.MemcpyDtoH(unsafe.Pointer(&r[0]), op, uint64(4*l.rows)))
	out := make([]int, l.rows)
	for i, v := range r {
		out[i] = int(v)
	}
	return out
}
