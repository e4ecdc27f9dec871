// Package driver is a minimal binding of the CUDA driver API (libcuda.so.1)
// over github.com/ebitengine/purego: no cgo, no CUDA headers at build time.
// A binary using it builds with CGO_ENABLED=0 and, on a machine without the
// driver, Open fails with an error wrapping ErrNoDriver.
//
// The binding names the versioned entry points that cuda.h maps the plain
// names to (cuMemAlloc_v2, ...), and uses the device's primary context.
// CUDA contexts are current per OS thread: callers lock the goroutine to its
// thread and make the context current (Context.SetCurrent) before calls.
package driver

import (
	"errors"
	"fmt"
	"runtime"
	"unsafe"

	"github.com/ebitengine/purego"
)

// ErrNoDriver is wrapped by Open when libcuda.so.1 cannot be loaded, lacks
// entry points, or finds no usable GPU (cuInit fails).
var ErrNoDriver = errors.New("no CUDA driver found")

// Result is a CUresult.
type Result int32

// Handle types of the driver API.
type (
	// Device is a CUdevice ordinal handle.
	Device int32
	// Context is a CUcontext.
	Context uintptr
	// Module is a CUmodule.
	Module uintptr
	// Function is a CUfunction.
	Function uintptr
	// Stream is a CUstream (0 is the legacy default stream).
	Stream uintptr
	// Event is a CUevent.
	Event uintptr
	// Graph is a CUgraph.
	Graph uintptr
	// GraphExec is a CUgraphExec.
	GraphExec uintptr
	// DevicePtr is a CUdeviceptr.
	DevicePtr uint64
)

// Device attributes used by qtool (CUdevice_attribute values).
const (
	AttrMaxSharedPerBlockOptin = 97
	AttrMaxSharedPerSM         = 81
	AttrPCIBusID               = 33
	AttrPCIDeviceID            = 34
	AttrPCIDomainID            = 50
	AttrMultiprocessorCount    = 16
	AttrComputeMajor           = 75
	AttrComputeMinor           = 76
	AttrL2CacheSize            = 38
)

// FuncAttrMaxDynamicShared is CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES.
const FuncAttrMaxDynamicShared = 8

// Error is a failed driver call.
type Error struct {
	Call string
	Code Result
	Name string
	Msg  string
}

func (e *Error) Error() string {
	return fmt.Sprintf("cuda: %s: %s (%d): %s", e.Call, e.Name, int(e.Code), e.Msg)
}

// Driver holds the resolved entry points of one loaded libcuda.
type Driver struct {
	lib uintptr

	cuInit                      func(flags uint32) Result
	cuDriverGetVersion          func(v *int32) Result
	cuDeviceGetCount            func(n *int32) Result
	cuDeviceGet                 func(d *Device, ordinal int32) Result
	cuDeviceGetName             func(name *byte, n int32, d Device) Result
	cuDeviceGetAttribute        func(v *int32, attr int32, d Device) Result
	cuDeviceTotalMem            func(b *uint64, d Device) Result
	cuDevicePrimaryCtxRetain    func(c *Context, d Device) Result
	cuDevicePrimaryCtxRelease   func(d Device) Result
	cuCtxSetCurrent             func(c Context) Result
	cuCtxSynchronize            func() Result
	cuModuleLoadDataEx          func(m *Module, image unsafe.Pointer, n uint32, opts *int32, vals *uintptr) Result
	cuModuleUnload              func(m Module) Result
	cuModuleGetFunction         func(f *Function, m Module, name string) Result
	cuFuncSetAttribute          func(f Function, attr int32, v int32) Result
	cuOccupancyMaxBlocks        func(n *int32, f Function, blockSize int32, dynSmem uint64) Result
	cuOccupancyMaxClusters      func(n *int32, f Function, cfg *launchConfig) Result // nil before CUDA 12
	cuLaunchKernel              func(f Function, gx, gy, gz, bx, by, bz, shmem uint32, s Stream, params *unsafe.Pointer, extra *unsafe.Pointer) Result
	cuLaunchKernelEx            func(cfg *launchConfig, f Function, params *unsafe.Pointer, extra *unsafe.Pointer) Result                                                           // nil before CUDA 12
	cuTensorMapEncodeTiled      func(m *TensorMap, dtype, rank uint32, addr DevicePtr, dims, strides *uint64, box, elemStrides *uint32, interleave, swizzle, l2, oob uint32) Result // nil before CUDA 12
	cuMemAlloc                  func(p *DevicePtr, n uint64) Result
	cuMemFree                   func(p DevicePtr) Result
	cuMemAllocHost              func(p *unsafe.Pointer, n uint64) Result
	cuMemFreeHost               func(p unsafe.Pointer) Result
	cuMemcpyHtoD                func(dst DevicePtr, src unsafe.Pointer, n uint64) Result
	cuMemcpyDtoH                func(dst unsafe.Pointer, src DevicePtr, n uint64) Result
	cuMemcpyHtoDAsync           func(dst DevicePtr, src unsafe.Pointer, n uint64, s Stream) Result
	cuMemcpyDtoHAsync           func(dst unsafe.Pointer, src DevicePtr, n uint64, s Stream) Result
	cuMemcpyDtoDAsync           func(dst, src DevicePtr, n uint64, s Stream) Result
	cuMemsetD32Async            func(dst DevicePtr, v uint32, n uint64, s Stream) Result
	cuMemcpy2DAsync             func(p *memcpy2D, s Stream) Result
	cuMemGetInfo                func(free, total *uint64) Result
	cuStreamCreate              func(s *Stream, flags uint32) Result
	cuStreamDestroy             func(s Stream) Result
	cuStreamSynchronize         func(s Stream) Result
	cuEventCreate               func(e *Event, flags uint32) Result
	cuEventDestroy              func(e Event) Result
	cuEventRecord               func(e Event, s Stream) Result
	cuEventSynchronize          func(e Event) Result
	cuEventElapsedTime          func(ms *float32, start, end Event) Result
	cuStreamBeginCapture        func(s Stream, mode int32) Result
	cuStreamEndCapture          func(s Stream, g *Graph) Result
	cuGraphInstantiateWithFlags func(e *GraphExec, g Graph, flags uint64) Result
	cuGraphLaunch               func(e GraphExec, s Stream) Result
	cuGraphExecDestroy          func(e GraphExec) Result
	cuGraphDestroy              func(g Graph) Result
	cuGetErrorName              func(r Result, s **byte) Result
	cuGetErrorString            func(r Result, s **byte) Result

	// Peer memory (the tensor-parallel all-reduce); nil where the driver
	// lacks them.
	cuDeviceCanAccessPeer func(ok *int32, d, peer Device) Result
	cuCtxEnablePeerAccess func(peer Context, flags uint32) Result
	cuIpcGetMemHandle     func(h *IPCMemHandle, p DevicePtr) Result
	cuIpcOpenMemHandle    func(p *DevicePtr, h IPCMemHandle, flags uint32) Result
	cuIpcCloseMemHandle   func(p DevicePtr) Result
}

// libPaths are tried in order.
var libPaths = []string{"libcuda.so.1", "/usr/local/nvidia/lib64/libcuda.so.1", "/usr/lib/x86_64-linux-gnu/libcuda.so.1", "libcuda.so"}

// Open loads libcuda.so.1, resolves the entry points and calls cuInit.
func Open() (*Driver, error) {
	var lib uintptr
	var firstErr error
	for _, p := range libPaths {
		h, err := purego.Dlopen(p, purego.RTLD_NOW|purego.RTLD_GLOBAL)
		if err == nil {
			lib = h
			break
		}
		if firstErr == nil {
			firstErr = err
		}
	}
	if lib == 0 {
		return nil, fmt.Errorf("%w (dlopen libcuda.so.1: %v)", ErrNoDriver, firstErr)
	}
	d := &Driver{lib: lib}
	type entry struct {
		fn   any
		name string
	}
	syms := []entry{
		{&d.cuInit, "cuInit"},
		{&d.cuDriverGetVersion, "cuDriverGetVersion"},
		{&d.cuDeviceGetCount, "cuDeviceGetCount"},
		{&d.cuDeviceGet, "cuDeviceGet"},
		{&d.cuDeviceGetName, "cuDeviceGetName"},
		{&d.cuDeviceGetAttribute, "cuDeviceGetAttribute"},
		{&d.cuDeviceTotalMem, "cuDeviceTotalMem_v2"},
		{&d.cuDevicePrimaryCtxRetain, "cuDevicePrimaryCtxRetain"},
		{&d.cuDevicePrimaryCtxRelease, "cuDevicePrimaryCtxRelease_v2"},
		{&d.cuCtxSetCurrent, "cuCtxSetCurrent"},
		{&d.cuCtxSynchronize, "cuCtxSynchronize"},
		{&d.cuModuleLoadDataEx, "cuModuleLoadDataEx"},
		{&d.cuModuleUnload, "cuModuleUnload"},
		{&d.cuModuleGetFunction, "cuModuleGetFunction"},
		{&d.cuFuncSetAttribute, "cuFuncSetAttribute"},
		{&d.cuOccupancyMaxBlocks, "cuOccupancyMaxActiveBlocksPerMultiprocessor"},
		{&d.cuLaunchKernel, "cuLaunchKernel"},
		{&d.cuMemAlloc, "cuMemAlloc_v2"},
		{&d.cuMemFree, "cuMemFree_v2"},
		{&d.cuMemAllocHost, "cuMemAllocHost_v2"},
		{&d.cuMemFreeHost, "cuMemFreeHost"},
		{&d.cuMemcpyHtoD, "cuMemcpyHtoD_v2"},
		{&d.cuMemcpyDtoH, "cuMemcpyDtoH_v2"},
		{&d.cuMemcpyHtoDAsync, "cuMemcpyHtoDAsync_v2"},
		{&d.cuMemcpyDtoHAsync, "cuMemcpyDtoHAsync_v2"},
		{&d.cuMemcpyDtoDAsync, "cuMemcpyDtoDAsync_v2"},
		{&d.cuMemsetD32Async, "cuMemsetD32Async"},
		{&d.cuMemcpy2DAsync, "cuMemcpy2DAsync_v2"},
		{&d.cuMemGetInfo, "cuMemGetInfo_v2"},
		{&d.cuStreamCreate, "cuStreamCreate"},
		{&d.cuStreamDestroy, "cuStreamDestroy_v2"},
		{&d.cuStreamSynchronize, "cuStreamSynchronize"},
		{&d.cuEventCreate, "cuEventCreate"},
		{&d.cuEventDestroy, "cuEventDestroy_v2"},
		{&d.cuEventRecord, "cuEventRecord"},
		{&d.cuEventSynchronize, "cuEventSynchronize"},
		{&d.cuEventElapsedTime, "cuEventElapsedTime"},
		{&d.cuStreamBeginCapture, "cuStreamBeginCapture_v2"},
		{&d.cuStreamEndCapture, "cuStreamEndCapture"},
		{&d.cuGraphInstantiateWithFlags, "cuGraphInstantiateWithFlags"},
		{&d.cuGraphLaunch, "cuGraphLaunch"},
		{&d.cuGraphExecDestroy, "cuGraphExecDestroy"},
		{&d.cuGraphDestroy, "cuGraphDestroy"},
		{&d.cuGetErrorName, "cuGetErrorName"},
		{&d.cuGetErrorString, "cuGetErrorString"},
	}
	for _, s := range syms {
		sym, err := purego.Dlsym(lib, s.name)
		if err != nil {
			return nil, fmt.Errorf("%w (libcuda.so.1 lacks %s, driver too old: %v)", ErrNoDriver, s.name, err)
		}
		purego.RegisterFunc(s.fn, sym)
	}
	// newer or rarer entry points: nil where the driver lacks them
	for _, s := range []entry{
		{&d.cuLaunchKernelEx, "cuLaunchKernelEx"},
		{&d.cuOccupancyMaxClusters, "cuOccupancyMaxActiveClusters"},
		{&d.cuTensorMapEncodeTiled, "cuTensorMapEncodeTiled"},
		{&d.cuDeviceCanAccessPeer, "cuDeviceCanAccessPeer"},
		{&d.cuCtxEnablePeerAccess, "cuCtxEnablePeerAccess"},
		{&d.cuIpcGetMemHandle, "cuIpcGetMemHandle"},
		{&d.cuIpcOpenMemHandle, "cuIpcOpenMemHandle_v2"},
		{&d.cuIpcCloseMemHandle, "cuIpcCloseMemHandle"},
	} {
		if sym, err := purego.Dlsym(lib, s.name); err == nil {
			purego.RegisterFunc(s.fn, sym)
		}
	}
	if err := d.check("cuInit", d.cuInit(0)); err != nil {
		// A driver library without a usable GPU (a container without the
		// device, a CUDA toolkit's stub) is the same as no driver to callers.
		return nil, fmt.Errorf("%w (libcuda.so.1 loaded, but %v)", ErrNoDriver, err)
	}
	return d, nil
}

func cString(p *byte) string {
	if p == nil {
		return ""
	}
	var b []byte
	for q := unsafe.Pointer(p); *(*byte)(q) != 0; q = unsafe.Add(q, 1) {
		b = append(b, *(*byte)(q))
	}
	return string(b)
}

// ErrorString returns the driver's name and description of r.
func (d *Driver) ErrorString(r Result) (name, msg string) {
	var p *byte
	if d.cuGetErrorName(r, &p) == 0 {
		name = cString(p)
	}
	p = nil
	if d.cuGetErrorString(r, &p) == 0 {
		msg = cString(p)
	}
	if name == "" {
		name = "CUDA_ERROR_UNKNOWN"
	}
	return name, msg
}

func (d *Driver) check(call string, r Result) error {
	if r == 0 {
		return nil
	}
	name, msg := d.ErrorString(r)
	return &Error{Call: call, Code: r, Name: name, Msg: msg}
}

// Version is the driver's CUDA version (1000*major + 10*minor).
func (d *Driver) Version() (int, error) {
	var v int32
	err := d.check("cuDriverGetVersion", d.cuDriverGetVersion(&v))
	return int(v), err
}

// DeviceCount is the number of CUDA devices.
func (d *Driver) DeviceCount() (int, error) {
	var n int32
	err := d.check("cuDeviceGetCount", d.cuDeviceGetCount(&n))
	return int(n), err
}

// Device returns the handle of device ordinal i.
func (d *Driver) Device(i int) (Device, error) {
	var dev Device
	err := d.check("cuDeviceGet", d.cuDeviceGet(&dev, int32(i)))
	return dev, err
}

// DeviceName is the marketing name of dev.
func (d *Driver) DeviceName(dev Device) (string, error) {
	buf := make([]byte, 256)
	if err := d.check("cuDeviceGetName", d.cuDeviceGetName(&buf[0], int32(len(buf)), dev)); err != nil {
		return "", err
	}
	return cString(&buf[0]), nil
}

// Attribute reads a device attribute.
func (d *Driver) Attribute(dev Device, attr int) (int, error) {
	var v int32
	err := d.check("cuDeviceGetAttribute", d.cuDeviceGetAttribute(&v, int32(attr), dev))
	return int(v), err
}

// TotalMem is the device memory size in bytes.
func (d *Driver) TotalMem(dev Device) (uint64, error) {
	var b uint64
	err := d.check("cuDeviceTotalMem", d.cuDeviceTotalMem(&b, dev))
	return b, err
}

// PrimaryCtxRetain retains the primary context of dev.
func (d *Driver) PrimaryCtxRetain(dev Device) (Context, error) {
	var c Context
	err := d.check("cuDevicePrimaryCtxRetain", d.cuDevicePrimaryCtxRetain(&c, dev))
	return c, err
}

// PrimaryCtxRelease releases the primary context of dev.
func (d *Driver) PrimaryCtxRelease(dev Device) error {
	return d.check("cuDevicePrimaryCtxRelease", d.cuDevicePrimaryCtxRelease(dev))
}

// SetCurrent binds c to the calling OS thread.
func (d *Driver) SetCurrent(c Context) error { return d.check("cuCtxSetCurrent", d.cuCtxSetCurrent(c)) }

// CtxSynchronize waits for all work of the current context.
func (d *Driver) CtxSynchronize() error { return d.check("cuCtxSynchronize", d.cuCtxSynchronize()) }

// ModuleLoadData loads a PTX (NUL-terminated) or cubin image. On a JIT
// failure the error carries the compiler's log.
func (d *Driver) ModuleLoadData(image []byte) (Module, error) {
	if len(image) == 0 || image[len(image)-1] != 0 {
		image = append(append([]byte(nil), image...), 0)
	}
	const (
		optErrorLogBuffer     = 5 // CU_JIT_ERROR_LOG_BUFFER
		optErrorLogBufferSize = 6 // CU_JIT_ERROR_LOG_BUFFER_SIZE_BYTES
	)
	logBuf := make([]byte, 16384)
	opts := []int32{optErrorLogBuffer, optErrorLogBufferSize}
	// Option values are void* slots holding a pointer or an integer.
	vals := []uintptr{uintptr(unsafe.Pointer(&logBuf[0])), uintptr(len(logBuf))}
	var m Module
	r := d.cuModuleLoadDataEx(&m, unsafe.Pointer(&image[0]), uint32(len(opts)), &opts[0], &vals[0])
	runtime.KeepAlive(logBuf)
	if r != 0 {
		err := d.check("cuModuleLoadDataEx", r)
		if l := cString(&logBuf[0]); l != "" {
			err = fmt.Errorf("%w: %s", err, l)
		}
		return 0, err
	}
	return m, nil
}

// ModuleUnload unloads m.
func (d *Driver) ModuleUnload(m Module) error { return d.check("cuModuleUnload", d.cuModuleUnload(m)) }

// Function looks up a kernel by its (extern "C") name.
func (d *Driver) Function(m Module, name string) (Function, error) {
	var f Function
	if err := d.check("cuModuleGetFunction "+name, d.cuModuleGetFunction(&f, m, name)); err != nil {
		return 0, err
	}
	return f, nil
}

// SetFuncAttribute sets a kernel attribute.
func (d *Driver) SetFuncAttribute(f Function, attr, v int) error {
	return d.check("cuFuncSetAttribute", d.cuFuncSetAttribute(f, int32(attr), int32(v)))
}

// MaxActiveBlocks returns how many blocks of blockSize threads of f, each
// with dynSmem bytes of dynamic shared memory, fit on one multiprocessor at
// once (registers, shared memory, threads).
func (d *Driver) MaxActiveBlocks(f Function, blockSize, dynSmem int) (int, error) {
	var n int32
	if err := d.check("cuOccupancyMaxActiveBlocksPerMultiprocessor", d.cuOccupancyMaxBlocks(&n, f, int32(blockSize), uint64(dynSmem))); err != nil {
		return 0, err
	}
	return int(n), nil
}

// Launch starts f; params points at an array of pointers to the argument
// values (the driver copies them before returning).
func (d *Driver) Launch(f Function, grid, block [3]uint32, shmem uint32, s Stream, params *unsafe.Pointer) error {
	return d.check("cuLaunchKernel", d.cuLaunchKernel(f, grid[0], grid[1], grid[2], block[0], block[1], block[2], shmem, s, params, nil))
}

// launchAttr is a CUlaunchAttribute: an id and a 64-byte value union.
type launchAttr struct {
	id    uint32
	_     uint32
	value [8]uint64
}

// launchConfig is a CUlaunchConfig.
type launchConfig struct {
	grid     [3]uint32
	block    [3]uint32
	shmem    uint32
	stream   Stream
	attrs    *launchAttr
	numAttrs uint32
}

// attrProgrammaticStreamSerialization is
// CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION.
const attrProgrammaticStreamSerialization = 6

// CanLaunchDependent reports whether LaunchDependent is available (a CUDA 12
// driver).
func (d *Driver) CanLaunchDependent() bool { return d.cuLaunchKernelEx != nil }

// LaunchDependent is Launch as a programmatic dependent launch (sm_90): f
// may start while the kernel before it on s is still running, and must
// itself wait for that kernel (griddepcontrol.wait) before it reads what
// the kernel wrote or writes what it reads. A kernel captured into a graph
// keeps the relaxed dependency.
func (d *Driver) LaunchDependent(f Function, grid, block [3]uint32, shmem uint32, s Stream, params *unsafe.Pointer) error {
	if d.cuLaunchKernelEx == nil {
		return d.Launch(f, grid, block, shmem, s, params)
	}
	var attrs [2]launchAttr
	return d.launchEx(f, grid, block, shmem, s, params, &attrs, withSerialization(&attrs, 0))
}

// withSerialization sets attrs[n] to programmatic stream serialization and
// returns the attributes' count.
func withSerialization(attrs *[2]launchAttr, n int) int {
	attrs[n] = launchAttr{id: attrProgrammaticStreamSerialization}
	attrs[n].value[0] = 1
	return n + 1
}

// launchEx launches f through cuLaunchKernelEx with the first n of attrs.
func (d *Driver) launchEx(f Function, grid, block [3]uint32, shmem uint32, s Stream, params *unsafe.Pointer, attrs *[2]launchAttr, n int) error {
	cfg := launchConfig{grid: grid, block: block, shmem: shmem, stream: s, attrs: &attrs[0], numAttrs: uint32(n)}
	err := d.check("cuLaunchKernelEx", d.cuLaunchKernelEx(&cfg, f, params, nil))
	runtime.KeepAlive(attrs)
	return err
}

// attrClusterDimension is CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION;
// FuncAttrNonPortableClusterSize is
// CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED (clusters of more
// than 8 blocks on sm_90).
const (
	attrClusterDimension           = 4
	FuncAttrNonPortableClusterSize = 14
)

// clusterDim is the launch attribute of clusters of cluster blocks.
func clusterDim(cluster [3]uint32) launchAttr {
	a := launchAttr{id: attrClusterDimension}
	a.value[0] = uint64(cluster[0]) | uint64(cluster[1])<<32 // struct {x, y, z uint32}
	a.value[1] = uint64(cluster[2])
	return a
}

// LaunchCluster is Launch with the grid's blocks grouped in clusters of
// cluster blocks (sm_90; each grid dimension a multiple of the cluster's),
// as a programmatic dependent launch (LaunchDependent) when dependent is set.
func (d *Driver) LaunchCluster(f Function, grid, block, cluster [3]uint32, shmem uint32, s Stream, params *unsafe.Pointer, dependent bool) error {
	if d.cuLaunchKernelEx == nil {
		return fmt.Errorf("cuda: cluster launches need cuLaunchKernelEx (a CUDA 12 driver)")
	}
	attrs := [2]launchAttr{clusterDim(cluster)}
	n := 1
	if dependent {
		n = withSerialization(&attrs, n)
	}
	return d.launchEx(f, grid, block, shmem, s, params, &attrs, n)
}

// MaxActiveClusters returns how many clusters of cluster blocks of f
// (block threads each, shmem bytes of dynamic shared memory) the device
// runs at once: what fits in its multiprocessors' groups (GPCs), which
// can be fewer than the multiprocessors divided by the cluster's size.
// 0 where the driver lacks cuOccupancyMaxActiveClusters (before CUDA 12).
func (d *Driver) MaxActiveClusters(f Function, block, cluster [3]uint32, shmem uint32) (int, error) {
	if d.cuOccupancyMaxClusters == nil {
		return 0, nil
	}
	attrs := [1]launchAttr{clusterDim(cluster)}
	// the grid a multiple of the cluster (the driver checks it)
	cfg := launchConfig{grid: cluster, block: block, shmem: shmem, attrs: &attrs[0], numAttrs: 1}
	var n int32
	err := d.check("cuOccupancyMaxActiveClusters", d.cuOccupancyMaxClusters(&n, f, &cfg))
	runtime.KeepAlive(&attrs)
	return int(n), err
}

// TensorMap is a CUtensorMap: the description of a tensor in device memory
// that the bulk tensor copy engine (TMA, sm_90) copies tiles of. Kernels
// take it by value (a 128-byte parameter, 64-byte aligned).
type TensorMap struct {
	v [16]uint64
}

// Ptr is the address of the map's bytes, for a kernel's parameter list.
func (m *TensorMap) Ptr() unsafe.Pointer { return unsafe.Pointer(&m.v[0]) }

// NewTensorMaps returns n tensor maps at 64-byte aligned addresses, as
// cuTensorMapEncodeTiled wants them.
func NewTensorMaps(n int) []*TensorMap {
	buf := make([]byte, 128*n+64)
	off := int((64 - uintptr(unsafe.Pointer(&buf[0]))%64) % 64)
	maps := make([]*TensorMap, n)
	for i := range maps {
		maps[i] = (*TensorMap)(unsafe.Pointer(&buf[off+128*i]))
	}
	return maps
}

// CanEncodeTensorMaps reports whether EncodeTensorMap2D is available (a CUDA
// 12 driver).
func (d *Driver) CanEncodeTensorMaps() bool { return d.cuTensorMapEncodeTiled != nil }

// Tensor map element types and swizzles (CUtensorMapDataType,
// CUtensorMapSwizzle).
const (
	TensorMapUint8      = 0
	TensorMapUint32     = 2
	TensorMapFloat16    = 6
	TensorMapBFloat16   = 9
	TensorMapNoSwizzle  = 0
	TensorMapSwizzle64  = 2
	TensorMapSwizzle128 = 3
)

// EncodeTensorMap2D describes the row-major matrix of rows × cols elements
// of type dtype at p, rows pitch bytes apart, copied in boxes of boxRows ×
// boxCols with the given swizzle; the parts of a box outside the matrix
// read as zeros. pitch and a box row's bytes must be multiples of 16, p
// 16-byte aligned, a box row at most the swizzle span.
func (d *Driver) EncodeTensorMap2D(m *TensorMap, dtype uint32, p DevicePtr, rows, cols, pitch uint64, boxRows, boxCols uint32, swizzle uint32) error {
	return d.encodeTiled(m, dtype, p, []uint64{cols, rows}, []uint64{pitch}, []uint32{boxCols, boxRows}, swizzle)
}

// EncodeTensorMap3D is EncodeTensorMap2D for planes such matrices, the
// first at p, each planePitch bytes after the one before (a multiple of
// 16; the planes may be separate allocations), copied in boxes of
// boxPlanes × boxRows × boxCols.
func (d *Driver) EncodeTensorMap3D(m *TensorMap, dtype uint32, p DevicePtr, planes, rows, cols, pitch, planePitch uint64, boxPlanes, boxRows, boxCols uint32, swizzle uint32) error {
	return d.encodeTiled(m, dtype, p, []uint64{cols, rows, planes}, []uint64{pitch, planePitch}, []uint32{boxCols, boxRows, boxPlanes}, swizzle)
}

// encodeTiled encodes a tiled tensor map of len(dims) dimensions, the
// innermost first (strides: the bytes between steps of every dimension
// but the first; box: the copied box).
func (d *Driver) encodeTiled(m *TensorMap, dtype uint32, p DevicePtr, dims, strides []uint64, box []uint32, swizzle uint32) error {
	if d.cuTensorMapEncodeTiled == nil {
		return fmt.Errorf("cuTensorMapEncodeTiled: the driver predates CUDA 12")
	}
	if uintptr(unsafe.Pointer(m))%64 != 0 {
		return fmt.Errorf("cuTensorMapEncodeTiled: tensor map at %p is not 64-byte aligned", m)
	}
	elem := [5]uint32{1, 1, 1, 1, 1}
	const l2Promote256 = 3
	return d.check("cuTensorMapEncodeTiled", d.cuTensorMapEncodeTiled(m, dtype, uint32(len(dims)), p, &dims[0], &strides[0], &box[0], &elem[0], 0, swizzle, l2Promote256, 0))
}

// MemAlloc allocates n bytes of device memory.
func (d *Driver) MemAlloc(n uint64) (DevicePtr, error) {
	var p DevicePtr
	err := d.check(fmt.Sprintf("cuMemAlloc(%d bytes)", n), d.cuMemAlloc(&p, n))
	return p, err
}

// MemFree frees device memory.
func (d *Driver) MemFree(p DevicePtr) error { return d.check("cuMemFree", d.cuMemFree(p)) }

// MemAllocHost allocates n bytes of page-locked host memory.
func (d *Driver) MemAllocHost(n uint64) (unsafe.Pointer, error) {
	var p unsafe.Pointer
	err := d.check("cuMemAllocHost", d.cuMemAllocHost(&p, n))
	return p, err
}

// MemFreeHost frees page-locked host memory.
func (d *Driver) MemFreeHost(p unsafe.Pointer) error {
	return d.check("cuMemFreeHost", d.cuMemFreeHost(p))
}

// MemcpyHtoD copies n bytes from host to device (synchronous).
func (d *Driver) MemcpyHtoD(dst DevicePtr, src unsafe.Pointer, n uint64) error {
	return d.check("cuMemcpyHtoD", d.cuMemcpyHtoD(dst, src, n))
}

// MemcpyDtoH copies n bytes from device to host (synchronous).
func (d *Driver) MemcpyDtoH(dst unsafe.Pointer, src DevicePtr, n uint64) error {
	return d.check("cuMemcpyDtoH", d.cuMemcpyDtoH(dst, src, n))
}

// MemcpyHtoDAsync queues a host-to-device copy on s (src should be pinned).
func (d *Driver) MemcpyHtoDAsync(dst DevicePtr, src unsafe.Pointer, n uint64, s Stream) error {
	return d.check("cuMemcpyHtoDAsync", d.cuMemcpyHtoDAsync(dst, src, n, s))
}

// MemcpyDtoHAsync queues a device-to-host copy on s (dst should be pinned).
func (d *Driver) MemcpyDtoHAsync(dst unsafe.Pointer, src DevicePtr, n uint64, s Stream) error {
	return d.check("cuMemcpyDtoHAsync", d.cuMemcpyDtoHAsync(dst, src, n, s))
}

// MemcpyDtoDAsync queues a device-to-device copy on s.
func (d *Driver) MemcpyDtoDAsync(dst, src DevicePtr, n uint64, s Stream) error {
	return d.check("cuMemcpyDtoDAsync", d.cuMemcpyDtoDAsync(dst, src, n, s))
}

// MemsetD32Async sets n 32-bit words to v.
func (d *Driver) MemsetD32Async(dst DevicePtr, v uint32, n uint64, s Stream) error {
	return d.check("cuMemsetD32Async", d.cuMemsetD32Async(dst, v, n, s))
}

// CanAccessPeer reports whether device d can address peer's memory
// (cuDeviceCanAccessPeer; false where the driver lacks it).
func (d *Driver) CanAccessPeer(dev, peer Device) (bool, error) {
	if d.cuDeviceCanAccessPeer == nil {
		return false, nil
	}
	var ok int32
	err := d.check("cuDeviceCanAccessPeer", d.cuDeviceCanAccessPeer(&ok, dev, peer))
	return ok != 0, err
}

// errPeerAccessAlreadyEnabled is CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED.
const errPeerAccessAlreadyEnabled Result = 704

// EnablePeerAccess lets the current context address the memory of the
// context peer (another device's, in this process); enabling it twice is
// not an error.
func (d *Driver) EnablePeerAccess(peer Context) error {
	if d.cuCtxEnablePeerAccess == nil {
		return fmt.Errorf("cuda: the driver has no cuCtxEnablePeerAccess")
	}
	r := d.cuCtxEnablePeerAccess(peer, 0)
	if r == errPeerAccessAlreadyEnabled {
		return nil
	}
	return d.check("cuCtxEnablePeerAccess", r)
}

// IPCMemHandle is a CUipcMemHandle: names a device allocation to other
// processes.
type IPCMemHandle struct {
	Reserved [64]byte
}

// IPCGetMemHandle returns the handle of the allocation that begins at p.
func (d *Driver) IPCGetMemHandle(p DevicePtr) (IPCMemHandle, error) {
	var h IPCMemHandle
	if d.cuIpcGetMemHandle == nil {
		return h, fmt.Errorf("cuda: the driver has no cuIpcGetMemHandle")
	}
	return h, d.check("cuIpcGetMemHandle", d.cuIpcGetMemHandle(&h, p))
}

// ipcLazyEnablePeerAccess is CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS.
const ipcLazyEnablePeerAccess = 1

// IPCOpenMemHandle maps another process's allocation into the current
// context and returns its address here (close it with IPCCloseMemHandle).
func (d *Driver) IPCOpenMemHandle(h IPCMemHandle) (DevicePtr, error) {
	if d.cuIpcOpenMemHandle == nil {
		return 0, fmt.Errorf("cuda: the driver has no cuIpcOpenMemHandle")
	}
	var p DevicePtr
	return p, d.check("cuIpcOpenMemHandle", d.cuIpcOpenMemHandle(&p, h, ipcLazyEnablePeerAccess))
}

// IPCCloseMemHandle unmaps what IPCOpenMemHandle mapped.
func (d *Driver) IPCCloseMemHandle(p DevicePtr) error {
	return d.check("cuIpcCloseMemHandle", d.cuIpcCloseMemHandle(p))
}

// memcpy2D is CUDA_MEMCPY2D (64-bit layout).
type memcpy2D struct {
	srcXInBytes, srcY uint64
	srcMemoryType     uint32
	_                 uint32
	srcHost           uintptr
	srcDevice         DevicePtr
	srcArray          uintptr
	srcPitch          uint64
	dstXInBytes, dstY uint64
	dstMemoryType     uint32
	_                 uint32
	dstHost           uintptr
	dstDevice         DevicePtr
	dstArray          uintptr
	dstPitch          uint64
	widthInBytes      uint64
	height            uint64
}

// memoryTypeDevice is CU_MEMORYTYPE_DEVICE.
const memoryTypeDevice = 2

// MemcpyDtoD2DAsync queues a strided device-to-device copy on s: height
// rows of widthBytes bytes, from src (rows srcPitch bytes apart) to dst
// (rows dstPitch bytes apart).
func (d *Driver) MemcpyDtoD2DAsync(dst DevicePtr, dstPitch uint64, src DevicePtr, srcPitch uint64, widthBytes, height uint64, s Stream) error {
	p := memcpy2D{srcMemoryType: memoryTypeDevice, srcDevice: src, srcPitch: srcPitch,
		dstMemoryType: memoryTypeDevice, dstDevice: dst, dstPitch: dstPitch, widthInBytes: widthBytes, height: height}
	err := d.check("cuMemcpy2DAsync", d.cuMemcpy2DAsync(&p, s))
	runtime.KeepAlive(&p)
	return err
}

// MemGetInfo returns free and total device memory in bytes.
func (d *Driver) MemGetInfo() (free, total uint64, err error) {
	err = d.check("cuMemGetInfo", d.cuMemGetInfo(&free, &total))
	return
}

// StreamCreate makes a stream (flags 1 = non-blocking).
func (d *Driver) StreamCreate(flags uint32) (Stream, error) {
	var s Stream
	err := d.check("cuStreamCreate", d.cuStreamCreate(&s, flags))
	return s, err
}

// StreamDestroy destroys s.
func (d *Driver) StreamDestroy(s Stream) error {
	return d.check("cuStreamDestroy", d.cuStreamDestroy(s))
}

// StreamSynchronize waits for s.
func (d *Driver) StreamSynchronize(s Stream) error {
	return d.check("cuStreamSynchronize", d.cuStreamSynchronize(s))
}

// EventCreate makes an event (flags 0: timing enabled).
func (d *Driver) EventCreate(flags uint32) (Event, error) {
	var e Event
	err := d.check("cuEventCreate", d.cuEventCreate(&e, flags))
	return e, err
}

// EventDestroy destroys e.
func (d *Driver) EventDestroy(e Event) error { return d.check("cuEventDestroy", d.cuEventDestroy(e)) }

// EventRecord records e on s.
func (d *Driver) EventRecord(e Event, s Stream) error {
	return d.check("cuEventRecord", d.cuEventRecord(e, s))
}

// EventSynchronize waits for e.
func (d *Driver) EventSynchronize(e Event) error {
	return d.check("cuEventSynchronize", d.cuEventSynchronize(e))
}

// EventElapsed is the time between two recorded events in milliseconds.
func (d *Driver) EventElapsed(start, end Event) (float32, error) {
	var ms float32
	err := d.check("cuEventElapsedTime", d.cuEventElapsedTime(&ms, start, end))
	return ms, err
}

// BeginCapture starts capturing s into a graph (mode 2 = relaxed).
func (d *Driver) BeginCapture(s Stream) error {
	return d.check("cuStreamBeginCapture", d.cuStreamBeginCapture(s, 2))
}

// EndCapture ends capturing s and returns the graph.
func (d *Driver) EndCapture(s Stream) (Graph, error) {
	var g Graph
	err := d.check("cuStreamEndCapture", d.cuStreamEndCapture(s, &g))
	return g, err
}

// GraphInstantiate makes an executable graph.
func (d *Driver) GraphInstantiate(g Graph) (GraphExec, error) {
	var e GraphExec
	err := d.check("cuGraphInstantiateWithFlags", d.cuGraphInstantiateWithFlags(&e, g, 0))
	return e, err
}

// GraphLaunch queues an executable graph on s.
func (d *Driver) GraphLaunch(e GraphExec, s Stream) error {
	return d.check("cuGraphLaunch", d.cuGraphLaunch(e, s))
}

// GraphExecDestroy destroys an executable graph.
func (d *Driver) GraphExecDestroy(e GraphExec) error {
	return d.check("cuGraphExecDestroy", d.cuGraphExecDestroy(e))
}

// GraphDestroy destroys a graph.
func (d *Driver) GraphDestroy(g Graph) error { return d.check("cuGraphDestroy", d.cuGraphDestroy(g)) }
