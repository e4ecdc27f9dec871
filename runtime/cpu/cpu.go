// Package cpu is qtool's pure-Go inference backend: it implements
// runtime.Backend with float32 activations, multi-threaded over the
// available cores, using the packed GEMM kernels of runtime/cpu/gemm.
//
// Float weights (F32/F16/BF16) are widened to float32 once at upload, up
// to a budget (DefaultF32Budget); past it F16/BF16 weights stay 16-bit and
// are widened panel by panel inside the product.
// Quantized weights (*model.Quantized: int8/int4/int3 per group, with or
// without zero points; msmodelslim W8A16) stay quantized in memory and are
// dequantized panel by panel inside the product. *model.W8A8 layers
// quantize their input to int8 and accumulate the integer products exactly.
package cpu

import (
	"fmt"
	"math"
	goruntime "runtime"
	"sync"
	"sync/atomic"

	"qtool/formats/model"
	"qtool/runtime"
	"qtool/runtime/cpu/gemm"
)

// DefaultF32Budget is how many bytes of F16/BF16 weights a backend widens
// to float32 at upload (faster products); larger models keep the rest in
// their stored 16-bit form and widen them panel by panel.
const DefaultF32Budget = 4 << 30

// Backend is the CPU implementation of runtime.Backend. Its methods may be
// called from several goroutines on distinct buffers.
type Backend struct {
	threads int
	// f32Left is what remains of the float32 widening budget, in bytes.
	f32Left atomic.Int64

	mu   sync.Mutex
	rope map[ropeKey]*ropeTable
	free map[int][][]float32 // released slices by length, reused by Alloc
}

// maxPooled bounds the released slices kept per length.
const maxPooled = 16

// get returns a slice of n floats, reused when one was released (its
// contents are then arbitrary).
func (b *Backend) get(n int) []float32 {
	b.mu.Lock()
	l := b.free[n]
	if len(l) > 0 {
		s := l[len(l)-1]
		b.free[n] = l[:len(l)-1]
		b.mu.Unlock()
		return s
	}
	b.mu.Unlock()
	return make([]float32, n)
}

// put releases s for reuse.
func (b *Backend) put(s []float32) {
	if len(s) == 0 {
		return
	}
	b.mu.Lock()
	if l := b.free[len(s)]; len(l) < maxPooled {
		b.free[len(s)] = append(l, s)
	}
	b.mu.Unlock()
}

var _ runtime.Backend = (*Backend)(nil)

// New returns a CPU backend using threads goroutines for the heavy
// operations; threads <= 0 means runtime.GOMAXPROCS(0).
func New(threads int) *Backend {
	if threads <= 0 {
		threads = goruntime.GOMAXPROCS(0)
	}
	b := &Backend{threads: threads, rope: map[ropeKey]*ropeTable{}, free: map[int][][]float32{}}
	b.f32Left.Store(DefaultF32Budget)
	return b
}

// SetF32Budget sets how many bytes of 16-bit float weights later uploads may
// widen to float32 (0: keep every F16/BF16 weight in 16 bits).
func (b *Backend) SetF32Budget(bytes int64) { b.f32Left.Store(bytes) }

// reserveF32 takes n bytes from the widening budget if they are available.
func (b *Backend) reserveF32(n int64) bool {
	for {
		left := b.f32Left.Load()
		if left < n {
			return false
		}
		if b.f32Left.CompareAndSwap(left, left-n) {
			return true
		}
	}
}

// Threads is the number of goroutines the backend uses.
func (b *Backend) Threads() int { return b.threads }

// Name implements runtime.Backend.
func (b *Backend) Name() string {
	return fmt.Sprintf("cpu:%d threads, %s kernels", b.threads, gemm.KernelName())
}

// Close implements runtime.Backend; there is nothing to release.
func (b *Backend) Close() error { return nil }

// Mat is the CPU activation buffer: rows × cols float32 values, row-major.
type Mat struct {
	rows, cols int
	// Data holds the values; len(Data) == Rows()*Cols().
	Data []float32
}

// Rows implements runtime.Buf.
func (m *Mat) Rows() int { return m.rows }

// Cols implements runtime.Buf.
func (m *Mat) Cols() int { return m.cols }

// Row returns row i.
func (m *Mat) Row(i int) []float32 { return m.Data[i*m.cols : (i+1)*m.cols] }

// NewMat wraps data (rows*cols values) as a buffer without copying.
func NewMat(rows, cols int, data []float32) *Mat {
	if len(data) != rows*cols {
		panic(fmt.Sprintf("cpu.NewMat: %d values for [%d %d]", len(data), rows, cols))
	}
	return &Mat{rows: rows, cols: cols, Data: data}
}

func mat(b runtime.Buf) *Mat {
	m, ok := b.(*Mat)
	if !ok {
		panic(fmt.Sprintf("cpu: buffer of type %T does not belong to the CPU backend", b))
	}
	return m
}

// Alloc implements runtime.Backend.
func (b *Backend) Alloc(rows, cols int) runtime.Buf {
	if rows < 0 || cols < 0 {
		panic(fmt.Sprintf("cpu.Alloc: negative shape [%d %d]", rows, cols))
	}
	d := b.get(rows * cols)
	clear(d)
	return &Mat{rows: rows, cols: cols, Data: d}
}

// AllocRaw implements runtime.RawAllocator: Alloc without the clearing.
func (b *Backend) AllocRaw(rows, cols int) runtime.Buf {
	if rows < 0 || cols < 0 {
		panic(fmt.Sprintf("cpu.AllocRaw: negative shape [%d %d]", rows, cols))
	}
	return &Mat{rows: rows, cols: cols, Data: b.get(rows * cols)}
}

// Free implements runtime.Backend: the memory is kept for later Allocs.
func (b *Backend) Free(buf runtime.Buf) {
	if m, ok := buf.(*Mat); ok && m.Data != nil {
		b.put(m.Data)
		m.Data = nil
	}
}

// Upload implements runtime.Backend.
func (b *Backend) Upload(dst runtime.Buf, src []float32) {
	d := mat(dst)
	if len(src) != len(d.Data) {
		panic(fmt.Sprintf("cpu.Upload: %d values into [%d %d]", len(src), d.rows, d.cols))
	}
	copy(d.Data, src)
}

// Download implements runtime.Backend.
func (b *Backend) Download(dst []float32, src runtime.Buf) {
	s := mat(src)
	if len(dst) != len(s.Data) {
		panic(fmt.Sprintf("cpu.Download: [%d %d] into %d values", s.rows, s.cols, len(dst)))
	}
	copy(dst, s.Data)
}

// vector is an uploaded float vector.
type vector struct{ v []float32 }

func (v *vector) Len() int { return len(v.v) }

func vec(v runtime.Vector) []float32 {
	if v == nil {
		return nil
	}
	x, ok := v.(*vector)
	if !ok {
		panic(fmt.Sprintf("cpu: vector of type %T does not belong to the CPU backend", v))
	}
	return x.v
}

// UploadVector implements runtime.Backend.
func (b *Backend) UploadVector(name string, t model.Tensor) (runtime.Vector, error) {
	d, ok := t.(*model.Dense)
	if !ok {
		return nil, fmt.Errorf("%s: a vector must be a dense float tensor, got %T", name, t)
	}
	if len(d.Dims) != 1 {
		return nil, fmt.Errorf("%s: vector has shape %v, want one dimension", name, d.Dims)
	}
	if !d.DType.IsFloat() {
		return nil, fmt.Errorf("%s: vector has dtype %v, want a float type", name, d.DType)
	}
	v := make([]float32, d.Len())
	if err := d.Float32Into(v); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return &vector{v: v}, nil
}

// kvCache holds keys and values per layer: [maxSeq, kvDim] each, as
// float32 (k, v) or, with quantizers (quant), as int8 (kq, vq).
type kvCache struct {
	maxSeq, kvDim int
	k, v          [][]float32
	kq, vq        [][]int8
	quant         []runtime.KVQuant
}

// NewInt8KVCache implements runtime.Int8KVBackend.
func (b *Backend) NewInt8KVCache(maxSeq, kvDim int, layers []runtime.KVQuant) (runtime.KVCache, error) {
	c := &kvCache{maxSeq: maxSeq, kvDim: kvDim, kq: make([][]int8, len(layers)), vq: make([][]int8, len(layers)), quant: layers}
	for l := range layers {
		if err := layers[l].Validate(kvDim); err != nil {
			return nil, fmt.Errorf("cpu: layer %d: %w", l, err)
		}
		c.kq[l] = make([]int8, maxSeq*kvDim)
		c.vq[l] = make([]int8, maxSeq*kvDim)
	}
	return c, nil
}

// quantizeRows stores rows of x (kvDim wide) as int8 into dst.
func quantizeRows(dst []int8, x, scale, offset []float32) {
	for i, v := range x {
		c := i % len(scale)
		dst[i] = runtime.QuantizeKV(v, scale[c], offset[c])
	}
}

// dequantizeRows widens int8 rows (kvDim wide) of src into dst.
func dequantizeRows(dst []float32, src []int8, scale, offset []float32) {
	for i, q := range src {
		c := i % len(scale)
		dst[i] = runtime.DequantizeKV(q, scale[c], offset[c])
	}
}

// layerKV returns layer's keys and values of positions 0..n-1 as float32:
// the cache itself, or for an int8 cache dequantized copies the caller
// releases with done.
func (b *Backend) layerKV(c *kvCache, layer, n int) (k, v []float32, done func()) {
	if c.quant == nil {
		return c.k[layer], c.v[layer], func() {}
	}
	q := c.quant[layer]
	k, v = b.get(n*c.kvDim), b.get(n*c.kvDim)
	parallel(n, b.threads, 64, func(lo, hi int) {
		d := c.kvDim
		dequantizeRows(k[lo*d:hi*d], c.kq[layer][lo*d:hi*d], q.KScale, q.KOffset)
		dequantizeRows(v[lo*d:hi*d], c.vq[layer][lo*d:hi*d], q.VScale, q.VOffset)
	})
	return k, v, func() { b.put(k); b.put(v) }
}

func (c *kvCache) MaxSeq() int { return c.maxSeq }

// NewKVCache implements runtime.Backend.
func (b *Backend) NewKVCache(layers, maxSeq, kvDim int) runtime.KVCache {
	c := &kvCache{maxSeq: maxSeq, kvDim: kvDim, k: make([][]float32, layers), v: make([][]float32, layers)}
	for l := range c.k {
		c.k[l] = make([]float32, maxSeq*kvDim)
		c.v[l] = make([]float32, maxSeq*kvDim)
	}
	return c
}

func cacheOf(c runtime.KVCache) *kvCache {
	x, ok := c.(*kvCache)
	if !ok {
		panic(fmt.Sprintf("cpu: KV cache of type %T does not belong to the CPU backend", c))
	}
	return x
}

// StoreKV implements runtime.Backend.
func (b *Backend) StoreKV(c runtime.KVCache, layer, pos0 int, k, v runtime.Buf) {
	kc := cacheOf(c)
	km, vm := mat(k), mat(v)
	if km.cols != kc.kvDim || vm.cols != kc.kvDim || km.rows != vm.rows {
		panic(fmt.Sprintf("cpu.StoreKV: k [%d %d], v [%d %d], cache kv dim %d", km.rows, km.cols, vm.rows, vm.cols, kc.kvDim))
	}
	if pos0 < 0 || pos0+km.rows > kc.maxSeq {
		panic(fmt.Sprintf("cpu.StoreKV: positions %d..%d outside the cache of %d", pos0, pos0+km.rows-1, kc.maxSeq))
	}
	if kc.quant != nil {
		q, n := kc.quant[layer], len(km.Data)
		quantizeRows(kc.kq[layer][pos0*kc.kvDim:][:n], km.Data, q.KScale, q.KOffset)
		quantizeRows(kc.vq[layer][pos0*kc.kvDim:][:n], vm.Data, q.VScale, q.VOffset)
		return
	}
	copy(kc.k[layer][pos0*kc.kvDim:], km.Data)
	copy(kc.v[layer][pos0*kc.kvDim:], vm.Data)
}

// parallel runs fn over [0, n) split into at most threads contiguous parts
// of at least grain items each.
func parallel(n, threads, grain int, fn func(lo, hi int)) {
	if grain < 1 {
		grain = 1
	}
	parts := min(threads, (n+grain-1)/grain)
	if parts <= 1 {
		if n > 0 {
			fn(0, n)
		}
		return
	}
	var wg sync.WaitGroup
	for p := 0; p < parts; p++ {
		lo, hi := n*p/parts, n*(p+1)/parts
		if lo >= hi {
			continue
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			fn(lo, hi)
		}()
	}
	wg.Wait()
}

// RMSNorm implements runtime.Backend.
func (b *Backend) RMSNorm(dst, x runtime.Buf, w, bias runtime.Vector, eps float32) {
	d, s := mat(dst), mat(x)
	wv, bv := vec(w), vec(bias)
	if d.rows != s.rows || d.cols != s.cols || len(wv) != s.cols || (bv != nil && len(bv) != s.cols) {
		panic(fmt.Sprintf("cpu.RMSNorm: x [%d %d], dst [%d %d], weight %d", s.rows, s.cols, d.rows, d.cols, len(wv)))
	}
	n := s.cols
	parallel(s.rows, b.threads, max(1, 8192/max(n, 1)), func(lo, hi int) {
		for r := lo; r < hi; r++ {
			rmsNormRow(d.Data[r*n:(r+1)*n], s.Data[r*n:(r+1)*n], wv, bv, eps)
		}
	})
}

func rmsNormRow(dst, x, w, bias []float32, eps float32) {
	ss := 0.0
	for _, v := range x {
		ss += float64(v) * float64(v)
	}
	inv := float32(1 / math.Sqrt(float64(float32(ss/float64(len(x))))+float64(eps)))
	if bias != nil {
		for i, v := range x {
			dst[i] = w[i]*(v*inv) + bias[i]
		}
		return
	}
	for i, v := range x {
		dst[i] = w[i] * (v * inv)
	}
}

// RMSNormHeads implements runtime.Backend.
func (b *Backend) RMSNormHeads(x runtime.Buf, headDim int, w runtime.Vector, eps float32) {
	s := mat(x)
	wv := vec(w)
	if headDim <= 0 || s.cols%headDim != 0 || len(wv) != headDim {
		panic(fmt.Sprintf("cpu.RMSNormHeads: %d columns, head dim %d, weight %d", s.cols, headDim, len(wv)))
	}
	heads := len(s.Data) / headDim
	parallel(heads, b.threads, 256, func(lo, hi int) {
		for h := lo; h < hi; h++ {
			seg := s.Data[h*headDim : (h+1)*headDim]
			rmsNormRow(seg, seg, wv, nil, eps)
		}
	})
}

// AddBias implements runtime.Backend.
func (b *Backend) AddBias(x runtime.Buf, bias runtime.Vector) {
	s := mat(x)
	bv := vec(bias)
	if len(bv) != s.cols {
		panic(fmt.Sprintf("cpu.AddBias: %d columns, bias %d", s.cols, len(bv)))
	}
	for r := 0; r < s.rows; r++ {
		row := s.Data[r*s.cols : (r+1)*s.cols]
		for i := range row {
			row[i] += bv[i]
		}
	}
}

// SiLUMul implements runtime.Backend.
func (b *Backend) SiLUMul(dst, gate, up runtime.Buf) {
	d, g, u := mat(dst), mat(gate), mat(up)
	if len(d.Data) != len(g.Data) || len(g.Data) != len(u.Data) {
		panic("cpu.SiLUMul: shape mismatch")
	}
	parallel(len(d.Data), b.threads, 1<<15, func(lo, hi int) {
		var e [1024]float32
		for c := lo; c < hi; c += len(e) {
			ce := min(c+len(e), hi)
			dd, gg, uu := d.Data[c:ce], g.Data[c:ce], u.Data[c:ce]
			expBlock(e[:], gg, -1, 0)
			for i, x := range gg {
				dd[i] = x / (1 + e[i]) * uu[i]
			}
		}
	})
}

// Add implements runtime.Backend.
func (b *Backend) Add(dst, x runtime.Buf) {
	d, s := mat(dst), mat(x)
	if len(d.Data) != len(s.Data) {
		panic("cpu.Add: shape mismatch")
	}
	for i, v := range s.Data {
		d.Data[i] += v
	}
}

// NLL implements runtime.Backend: the log-sum-exp is accumulated in float64.
func (b *Backend) NLL(out []float64, logits runtime.Buf, targets []int) {
	l := mat(logits)
	if len(out) != l.rows || len(targets) != l.rows {
		panic(fmt.Sprintf("cpu.NLL: %d rows, %d targets, %d outputs", l.rows, len(targets), len(out)))
	}
	parallel(l.rows, b.threads, 16, func(lo, hi int) {
		scratch := b.get(l.cols)
		defer b.put(scratch)
		for r := lo; r < hi; r++ {
			row := l.Data[r*l.cols : (r+1)*l.cols]
			out[r] = logSumExp(row, scratch) - float64(row[targets[r]])
		}
	})
}

// logSumExp returns log Σ exp(x[i]), summing blocks of float32 partial
// sums in float64. scratch holds at least len(x) values.
func logSumExp(x, scratch []float32) float64 {
	mx := maxOf(x)
	if math.IsInf(float64(mx), 0) || math.IsNaN(float64(mx)) {
		return float64(mx)
	}
	const block = 512
	s := 0.0
	for i := 0; i < len(x); i += block {
		e := min(i+block, len(x))
		s += float64(expBlock(scratch[i:e], x[i:e], 1, -mx))
	}
	return float64(mx) + math.Log(s)
}

// Argmax implements runtime.Backend.
func (b *Backend) Argmax(logits runtime.Buf) []int {
	l := mat(logits)
	out := make([]int, l.rows)
	for r := range out {
		row := l.Data[r*l.cols : (r+1)*l.cols]
		best := 0
		for i, v := range row {
			if v > row[best] {
				best = i
			}
		}
		out[r] = best
	}
	return out
}

// expf is a float32 exp accurate to about 2 ulp over the normal range,
// several times faster than math.Exp; outside (−87, 88) and for NaN it
// defers to math.Exp.
func expf(x float32) float32 {
	const (
		log2e = 1.44269504088896341
		ln2hi = 0.693145751953125
		ln2lo = 1.42860682030941723212e-6
		magic = 12582912 // 1.5·2^23: adding it rounds to an integer
	)
	if !(x > -87 && x < 88) { // also NaN
		return float32(math.Exp(float64(x)))
	}
	t := x*log2e + magic
	n := int32(math.Float32bits(t)) - int32(math.Float32bits(magic))
	fn := t - magic
	r := x - fn*ln2hi - fn*ln2lo
	p := 1 + r*(1+r*(0.5+r*(1.0/6+r*(1.0/24+r*(1.0/120+r*(1.0/720+r*(1.0/5040)))))))
	return p * math.Float32frombits(uint32(n+127)<<23)
}
