package cuda

import (
	"errors"
	"fmt"
	"math"
	"math/bits"
	"math/rand/v2"
	"slices"
	"strings"
	"unsafe"

	"qtool/formats/model"
	"qtool/runtime"
	"qtool/runtime/cuda/driver"
)

// Weight kinds on the device. The first three match the kernels' dtype codes.
const (
	kindF32 = iota
	kindF16
	kindBF16
	kindQ8   // int8 codes, {scale, zero} per group, optional g_idx
	kindQ4   // packed 4-bit, {scale, half2(1024+z)} per group
	kindW8A8 // int8 weight, int8 activations
)

var kindNames = [...]string{"f32", "f16", "bf16", "q8", "q4", "w8a8"}

// dequantGEMMMinRows is the least number of rows for which a 4- or 8-bit
// weight that gemm_h cannot dequantize in its loader (groups of part of a K
// step, a g_idx) is widened to fp16 and multiplied by gemm_h_f16 (one more
// pass over the weight, amortised over the rows); fewer rows take the
// fused gemm_q4/gemm_q8, which dequantize each tile in their loaders. The
// others take gemm_h_q4/q8 from GEMVMaxRows + 1 rows, and the Hopper GEMMs
// from this many.
const dequantGEMMMinRows = 128

// gemmHSmallRows is the most rows for which gemm_h runs its _s form, whose
// block tiles are 32 rows of the activations instead of 128 (qtool.cu's
// gh_bm): a short prompt's product reads and dequantizes each weight tile
// for the rows it has.
const gemmHSmallRows = 32

// w8a8MMASmem is w8a8_mma's dynamic shared memory (W8_SMEM in qtool.cu: 4
// stages of 128 + 128 rows of 80 bytes).
const w8a8MMASmem = 4 * (128 + 128) * 80

// w8a8BK is w8a8_mma's K step (W8_BK).
const w8a8BK = 64

// gemmHSmem is the dynamic shared memory of gemm_h kernel name with block
// tiles of rows rows of activations (128, or 32 for the _s forms): 3
// stages of rows rows of 72 halfs, and of the weight tile's 128 rows — 72
// halfs (gemm_h_f16, gemm_h_bf16: qtool.cu's GH_SMEM, GH_S_SMEM), 8 words
// and a {scale, zero} (gemm_h_q4: GHQ_SMEM, GHQ_S_SMEM), 80 bytes and a
// {scale, zero} (gemm_h_q8: GHQ8_SMEM, GHQ8_S_SMEM).
func gemmHSmem(name string, rows int) int {
	switch name {
	case "gemm_h_q4":
		return 3 * (rows*72*2 + 128*32 + 128*8)
	case "gemm_h_q8":
		return 3 * (rows*72*2 + 128*80 + 128*8)
	}
	return 3 * (rows + 128) * 72 * 2
}

// gemmHBK is gemm_h's K step (qtool.cu's GH_BK).
const gemmHBK = 64

// Linear is an uploaded weight [Out, In].
type Linear struct {
	kind    int
	out, in int
	w, sz   driver.DevicePtr
	// szh, for a 4-bit weight whose every scale is an fp16 value (as the
	// checkpoints storing fp16 scales give them: AutoAWQ, GPTQ, ak48): a
	// copy of sz in the half form the streaming GEMVs read, a 32-bit word a
	// group, the scale in its low half and fp16 1024+z in its high half
	// (qtool.cu's Q4Group): a decode step reads 5 % fewer bytes, for 4
	// more bytes of device memory a group (a 7B: 0.2 GB). The GEMMs keep
	// sz: reading the half form instead cost gemm_wg_q4 3.5 %
	// (kernels/NOTES.md).
	szh  driver.DevicePtr
	gidx driver.DevicePtr
	// perm, for act-order 4-bit weights stored with their columns sorted
	// by group: int32 [in], stored column j is input feature perm[j]; the
	// products gather x by it first (Backend.permuted), the streaming GEMV
	// by the 16-bit form after it (stagedOrder). Shared by the weights
	// with the same order (q, k and v; gate and up).
	perm      driver.DevicePtr
	gs        int
	groups    int
	qbias     driver.DevicePtr
	deq, bias driver.DevicePtr
	inScale   float32
	inOffset  float32
	// dynamic: per-token activation scales (W8A8_DYNAMIC); deq holds the
	// weight scales and qbias is 0.
	dynamic bool
	// q8Normal, for an 8-bit weight: every scale is 0 or in fp16's normal
	// range (normalScales), so the Hopper GEMMs make its fp16 fragments
	// with one multiply a pair fewer (wgFlags).
	q8Normal bool
	bytes    int64 // device bytes of the weight and its scales
	// borrowed: w belongs to an activation buffer (FloatLinear), which
	// FreeLinear leaves alone.
	borrowed bool
	// wmap is w's tensor map for its Hopper GEMM, encoded at the first
	// launch (prepareWG); wmapF, of a W8A8 weight, the map in boxes of
	// s8FillRows rows for the int8 GEMM's fill form (s8Fill).
	wmap, wmapF *driver.TensorMap
	// glu and gluF map this gate weight and an up weight as two planes
	// for a gemm_wg_*_glu kernel (gluPair): glu in boxes of 64 rows of
	// each, gluF[np/112] of the W8A8 fill forms' np = 88 or 112
	// (gluFillRows; both may serve one weight, at different row counts).
	glu  gluPlanes
	gluF [2]gluPlanes
}

// Out implements runtime.Linear.
func (l *Linear) Out() int { return l.out }

// In implements runtime.Linear.
func (l *Linear) In() int { return l.in }

// Kind names the device storage ("f16", "q4", ...).
func (l *Linear) Kind() string { return kindNames[l.kind] }

// Bytes is the device memory the weight occupies (codes plus scales).
func (l *Linear) Bytes() int64 { return l.bytes }

// DecodeBytes is the device bytes a one-row product with the weight reads:
// Bytes less the scales the streaming GEMV leaves alone (sz, where it
// reads szh instead).
func (l *Linear) DecodeBytes() int64 {
	if l.szh != 0 {
		return l.bytes - int64(8*l.out*l.groups)
	}
	return l.bytes
}

func lin(w runtime.Linear) *Linear {
	d, ok := w.(*Linear)
	if !ok || d == nil {
		panic(fmt.Sprintf("cuda backend: weight %T is not a CUDA weight", w))
	}
	return d
}

// Synthetic is a random weight or vector generated directly on the device
// at upload, for benchmarks at real scale without host copies. Format is
// "fp16", "bf16", "w8a8" (int8 weights, static int8 activations:
// SmoothQuant, msmodelslim W8A8), "w8a16" (int8, per-group: GPTQ 8-bit,
// Kuiper int8), "w8a16-pc" (int8, one group a row: msmodelslim W8A16),
// "w4a16" (4-bit, per-group, with zeros: AutoAWQ, ak48), "w4a16-pc"
// (4-bit, one group a row: GPTQ group_size -1) or "w4a16-act" (w4a16 in a
// random act-order: GPTQ desc_act); vectors (1-D) are 1 ± 0.1 noise
// whatever the format.
type Synthetic struct {
	Format    string
	Dims      []int
	GroupSize int
	Seed      uint64
	// OrderSeed seeds w4a16-act's column order (0: Seed). GPTQ's desc_act
	// order sorts the input's Hessian diagonal, so the weights that share
	// an input (q, k and v; gate and up) share an order: give them one
	// OrderSeed.
	OrderSeed uint64
}

// Shape implements model.Tensor.
func (s *Synthetic) Shape() []int { return s.Dims }

// Float32 implements model.Tensor; synthetic values exist only on the GPU.
func (s *Synthetic) Float32() ([]float32, error) {
	return nil, errors.New("synthetic tensor: values exist only on the GPU")
}

// UploadLinear implements runtime.Backend.
func (b *Backend) UploadLinear(name string, t model.Tensor) (runtime.Linear, error) {
	if t == nil {
		return nil, fmt.Errorf("cuda: %s: nil tensor", name)
	}
	shape := t.Shape()
	if len(shape) != 2 || shape[0] <= 0 || shape[1] <= 0 {
		return nil, fmt.Errorf("cuda: %s has shape %v, want [out in]", name, shape)
	}
	in := shape[1]
	if in%8 != 0 {
		return nil, fmt.Errorf("cuda: %s has %d input features; the CUDA kernels need a multiple of 8", name, in)
	}
	defer b.enter()()
	var l *Linear
	var err error
	switch w := t.(type) {
	case *Synthetic:
		l, err = b.uploadSynthetic(name, w)
	case *model.Dense:
		l, err = b.uploadDense(name, w)
	case *model.Quantized:
		l, err = b.uploadQuantized(name, w)
	case *model.W8A8:
		l, err = b.uploadW8A8(name, w)
	default:
		return nil, fmt.Errorf("cuda: %s: tensor type %T is not supported", name, t)
	}
	if err != nil {
		return nil, err
	}
	b.uploaded[name] += l.DecodeBytes()
	return l, nil
}

// UploadedDecodeBytes returns the device bytes a decode step reads of
// every linear uploaded so far, by name (DecodeBytes: codes plus scales).
func (b *Backend) UploadedDecodeBytes() map[string]int64 {
	out := make(map[string]int64, len(b.uploaded))
	for k, v := range b.uploaded {
		out[k] = v
	}
	return out
}

// FreeLinear releases the device memory of an uploaded weight (implements
// runtime.Releaser); a FloatLinear's buffer stays.
func (b *Backend) FreeLinear(w runtime.Linear) {
	l := lin(w)
	if l.borrowed {
		return
	}
	defer b.enter()()
	b.must(b.drv.StreamSynchronize(b.stream))
	if l.perm != 0 {
		b.releasePerm(l.perm)
		l.perm = 0
	}
	for _, p := range []*driver.DevicePtr{&l.w, &l.sz, &l.szh, &l.gidx, &l.qbias, &l.deq, &l.bias} {
		if *p != 0 {
			b.must(b.drv.MemFree(*p))
			b.heldBytes -= int64(b.owned[*p])
			delete(b.owned, *p)
			*p = 0
		}
	}
}

func (b *Backend) uploadDense(name string, d *model.Dense) (*Linear, error) {
	out, in := d.Dims[0], d.Dims[1]
	l := &Linear{out: out, in: in}
	switch d.DType {
	case model.F16:
		l.kind = kindF16
		l.w = b.uploadBytes(d.Data)
	case model.BF16:
		l.kind = kindBF16
		l.w = b.uploadBytes(d.Data)
	case model.F32:
		l.kind = kindF32
		l.w = b.uploadBytes(d.Data)
	default:
		v, err := d.Float32()
		if err != nil {
			return nil, fmt.Errorf("cuda: %s: %w", name, err)
		}
		l.kind = kindF32
		l.w = uploadSlice(b, v)
	}
	l.bytes = int64(out) * int64(in) * int64([]int{4, 2, 2}[l.kind])
	return l, nil
}

// q4Shift is the bit position of element e (0..7) inside a packed word.
func q4Shift(e int) uint { return uint((e&1)*16 + (e>>1)*4) }

func (b *Backend) uploadQuantized(name string, q *model.Quantized) (*Linear, error) {
	if err := q.Validate(); err != nil {
		return nil, fmt.Errorf("cuda: %s: %w", name, err)
	}
	out, in := q.Rows, q.Cols
	gs := q.GroupSize
	if gs <= 0 {
		gs = in
	}
	G := q.Groups()
	l := &Linear{out: out, in: in, gs: gs, groups: G}
	perm := actOrder(q, gs) // act-order 4-bit: stored with its groups contiguous
	fast4 := q.Bits == 4 && (q.GIdx == nil || perm != nil) && gs%32 == 0 && in%32 == 0
	if fast4 && q.Zero != nil {
		for _, z := range q.Zero {
			if z != float32(math.Round(float64(z))) || z < -8 || z > 7 {
				fast4 = false
				break
			}
		}
	}
	if fast4 && perm != nil {
		q = permuteColumns(q, perm)
	} else {
		perm = nil
	}
	sz := make([]float32, 2*out*G)
	if fast4 {
		l.kind = kindQ4
		words := make([]uint32, out*in/8)
		for r := 0; r < out; r++ {
			row := q.Q[r*in : (r+1)*in]
			for c := 0; c < in/8; c++ {
				var w uint32
				for e := 0; e < 8; e++ {
					w |= uint32(int(row[8*c+e])+8) << q4Shift(e)
				}
				words[r*(in/8)+c] = w
			}
		}
		for i := 0; i < out*G; i++ {
			z := float32(8)
			if q.Zero != nil {
				z = q.Zero[i] + 8
			}
			h := uint32(model.Float32ToF16(1024 + z))
			sz[2*i] = q.Scale[i]
			sz[2*i+1] = math.Float32frombits(h | h<<16)
		}
		l.w = uploadSlice(b, words)
		l.bytes = int64(4 * len(words))
		if halfScales(q.Scale) {
			szh := make([]uint32, out*G)
			for i := range szh {
				z1024 := math.Float32bits(sz[2*i+1]) & 0xffff // one half of the pair
				szh[i] = uint32(model.Float32ToF16(q.Scale[i])) | z1024<<16
			}
			l.szh = uploadSlice(b, szh)
			l.bytes += int64(4 * len(szh))
		}
		if perm != nil {
			l.perm = b.sharedPerm(perm)
			l.bytes += permBytes(len(perm))
		}
	} else {
		l.kind = kindQ8
		for i := 0; i < out*G; i++ {
			sz[2*i] = q.Scale[i]
			if q.Zero != nil {
				sz[2*i+1] = q.Zero[i]
			}
		}
		l.q8Normal = normalScales(q.Scale)
		codes := unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(q.Q))), len(q.Q))
		l.w = b.uploadBytes(codes)
		l.bytes = int64(len(codes))
		if q.GIdx != nil {
			l.gidx = uploadSlice(b, q.GIdx)
			l.bytes += int64(4 * len(q.GIdx))
		}
	}
	l.sz = uploadSlice(b, sz)
	l.bytes += int64(4 * len(sz))
	return l, nil
}

// normalScales reports whether every scale is 0 or within fp16's normal
// range, 2^−14 ≤ |s| < 2^15 (an 8-bit weight's Linear.q8Normal; NaN is not).
func normalScales(scales []float32) bool {
	for _, s := range scales {
		a := math.Abs(float64(s))
		if a != 0 && !(a >= 0x1p-14 && a < 0x1p15) {
			return false
		}
	}
	return true
}

// wgQ8Normal is qtool.cu's GW_Q8_NORMAL, a bit of the Hopper GEMMs' flags.
const wgQ8Normal = 1

// wgFlags is the flags argument of a Hopper GEMM reading the weights ls
// (one; gate and up; q, k and v): GW_Q8_NORMAL where all are 8-bit weights
// of normal scales.
func wgFlags(ls ...*Linear) int {
	for _, l := range ls {
		if l.kind != kindQ8 || !l.q8Normal {
			return 0
		}
	}
	return wgQ8Normal
}

// halfScales reports whether every scale is an fp16 value (a 4-bit
// weight's half form, Linear.szh).
func halfScales(scales []float32) bool {
	for _, s := range scales {
		if model.RoundF16(s) != s {
			return false
		}
	}
	return true
}

func (b *Backend) uploadW8A8(name string, w *model.W8A8) (*Linear, error) {
	if err := w.Validate(); err != nil {
		return nil, fmt.Errorf("cuda: %s: %w", name, err)
	}
	q := w.Weight
	if q.Cols%16 != 0 {
		return nil, fmt.Errorf("cuda: %s: W8A8 needs input features a multiple of 16, have %d", name, q.Cols)
	}
	if w.Dynamic {
		l := &Linear{kind: kindW8A8, out: q.Rows, in: q.Cols, dynamic: true}
		l.w = b.uploadBytes(unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(q.Q))), len(q.Q)))
		l.deq = uploadSlice(b, q.Scale)
		if w.Bias != nil {
			l.bias = uploadSlice(b, w.Bias)
		}
		l.bytes = int64(len(q.Q) + 8*q.Rows)
		return l, nil
	}
	l := &Linear{kind: kindW8A8, out: q.Rows, in: q.Cols, inScale: w.InputScale, inOffset: w.InputOffset}
	l.w = b.uploadBytes(unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(q.Q))), len(q.Q)))
	l.qbias = uploadSlice(b, w.QuantBias)
	l.deq = uploadSlice(b, w.DeqScale)
	if w.Bias != nil {
		l.bias = uploadSlice(b, w.Bias)
	}
	l.bytes = int64(len(q.Q) + 12*q.Rows)
	return l, nil
}

func (b *Backend) uploadSynthetic(name string, s *Synthetic) (*Linear, error) {
	out, in := s.Dims[0], s.Dims[1]
	gs := s.GroupSize
	if gs <= 0 {
		gs = 128
	}
	if s.Format == "w8a16-pc" || s.Format == "w4a16-pc" { // one group a row
		gs = in
	}
	if in%gs != 0 {
		return nil, fmt.Errorf("cuda: synthetic %s: group %d does not divide %d", name, gs, in)
	}
	G := in / gs
	l := &Linear{out: out, in: in, gs: gs, groups: G}
	n := out * in
	a := float32(1 / math.Sqrt(float64(in)))
	switch s.Format {
	case "fp16", "f16":
		l.kind = kindF16
		l.w = b.alloc(2 * n)
		b.fill(l.w, n, s.Seed, 1, a)
		l.bytes = int64(2 * n)
	case "bf16":
		l.kind = kindBF16
		l.w = b.alloc(2 * n)
		b.fill(l.w, n, s.Seed, 6, a)
		l.bytes = int64(2 * n)
	case "w8a8":
		if in%16 != 0 {
			return nil, fmt.Errorf("cuda: synthetic %s: W8A8 needs a width multiple of 16", name)
		}
		l.kind, l.inScale = kindW8A8, 1.0/64
		l.w = b.alloc(n)
		b.fill(l.w, n/4, s.Seed, 0, 0)
		l.qbias = b.alloc(4 * out)
		b.must(b.drv.MemsetD32Async(l.qbias, 0, uint64(out), b.stream))
		l.deq = b.alloc(4 * out)
		b.fill(l.deq, out, s.Seed+1, 2, a/8192)
		l.bytes = int64(n + 8*out)
	case "w8a16", "q8", "w8a16-pc":
		l.kind = kindQ8
		l.w = b.alloc(n)
		b.fill(l.w, n/4, s.Seed, 0, 0)
		l.sz = b.alloc(8 * out * G)
		b.fill(l.sz, out*G, s.Seed+1, 4, a/128) // scales in [a/128, a/64]
		l.q8Normal = normalScales([]float32{a / 128, a / 64})
		l.bytes = int64(n + 8*out*G)
	case "w4a16", "q4", "w4a16-act", "w4a16-pc":
		if gs%32 != 0 || in%32 != 0 {
			return nil, fmt.Errorf("cuda: synthetic %s: 4-bit needs group size and width multiples of 32", name)
		}
		l.kind = kindQ4
		l.w = b.alloc(n / 2)
		b.fill(l.w, n/8, s.Seed, 0, 0)
		l.sz = b.alloc(8 * out * G)
		b.fill(l.sz, out*G, s.Seed+1, 3, a/8)
		l.szh = b.alloc(4 * out * G) // the same groups in the half form
		b.fill(l.szh, out*G, s.Seed+1, 7, a/8)
		l.bytes = int64(n/2 + 12*out*G)
		if s.Format == "w4a16-act" {
			seed := s.OrderSeed
			if seed == 0 {
				seed = s.Seed
			}
			perm := shuffledOrder(in, seed)
			spreadBanks(perm, gs) // as actOrder stores a checkpoint's order
			l.perm = b.sharedPerm(perm)
			l.bytes += permBytes(in)
		}
	default:
		return nil, fmt.Errorf("cuda: synthetic %s: format %q (want fp16, bf16, w8a8, w8a16, w8a16-pc, w4a16, w4a16-pc or w4a16-act)", name, s.Format)
	}
	// A GEMV reads its weights before its programmatic wait (qtool.cu,
	// pdl_wait): the kernel after the fills starts when they have ended.
	b.plainNext = true
	return l, nil
}

// shuffledOrder is a random column order of width n from seed (a
// synthetic act-order weight's).
func shuffledOrder(n int, seed uint64) []int32 {
	perm := make([]int32, n)
	for i := range perm {
		perm[i] = int32(i)
	}
	rand.New(rand.NewPCG(seed, 7)).Shuffle(n, func(i, j int) { perm[i], perm[j] = perm[j], perm[i] })
	return perm
}

// actOrder returns the column order that makes an act-order 4-bit
// weight's groups contiguous (GPTQ desc_act: g_idx a permutation of equal
// groups): the columns sorted by group, stably. It returns nil when q has
// no g_idx, is not 4-bit, or its groups are not gs columns each.
func actOrder(q *model.Quantized, gs int) []int32 {
	if q.GIdx == nil || q.Bits != 4 || gs%32 != 0 || q.Cols%gs != 0 {
		return nil
	}
	count := make([]int, q.Groups())
	for _, g := range q.GIdx {
		if g < 0 || int(g) >= len(count) {
			return nil
		}
		count[g]++
	}
	for _, n := range count {
		if n != gs {
			return nil
		}
	}
	perm := make([]int32, q.Cols)
	for c := range perm {
		perm[c] = int32(c)
	}
	slices.SortStableFunc(perm, func(a, b int32) int { return int(q.GIdx[a]) - int(q.GIdx[b]) })
	spreadBanks(perm, gs)
	return perm
}

// spreadBanks reorders the columns inside each group of a column order
// (groups of gs contiguous columns keep their features) so that the
// streaming GEMV's gathers meet few shared-memory bank conflicts: for each
// c of 0..7 a warp reads at once the features of columns w + 8L + c (lanes
// L) of a window of 256 columns from the staged row, feature f in bank f
// mod 32. Each window's features are placed greedily, those of its most
// crowded banks first, each in the slot c of its group where its bank is
// rarest so far (a random order's worst bank a read: ~3.5 lanes; after:
// ~2, near the bound the window's crowded banks set).
func spreadBanks(perm []int32, gs int) {
	const window, slots, banks = 256, 8, 32
	for w := 0; w < len(perm); w += window {
		cols := perm[w:min(w+window, len(perm))]
		g0 := w / gs
		// free[(g−g0)·slots + c]: the window's columns of group g in slot c
		free := make([][]int, ((w+len(cols)-1)/gs-g0+1)*slots)
		for i := range cols {
			k := ((w+i)/gs-g0)*slots + i%slots
			free[k] = append(free[k], i)
		}
		type feature struct{ f, g int32 }
		fs := make([]feature, len(cols))
		var crowd [banks]int
		for i, f := range cols {
			fs[i] = feature{f, int32((w+i)/gs - g0)}
			crowd[f%banks]++
		}
		slices.SortFunc(fs, func(a, b feature) int {
			if d := crowd[b.f%banks] - crowd[a.f%banks]; d != 0 {
				return d
			}
			if d := a.f%banks - b.f%banks; d != 0 {
				return int(d)
			}
			return int(a.f - b.f)
		})
		var used [slots][banks]int
		for _, x := range fs {
			bank, best, bestK := x.f%banks, -1, 0
			for c := range slots {
				k := int(x.g)*slots + c
				if len(free[k]) == 0 {
					continue
				}
				if best < 0 || used[c][bank] < used[best][bank] || used[c][bank] == used[best][bank] && len(free[k]) > len(free[bestK]) {
					best, bestK = c, k
				}
			}
			cols[free[bestK][0]] = x.f
			free[bestK] = free[bestK][1:]
			used[best][bank]++
		}
	}
}

// permuteColumns returns q with column j = column perm[j] of q and the
// plain group layout (column j in group j / gs).
func permuteColumns(q *model.Quantized, perm []int32) *model.Quantized {
	p := *q
	p.GIdx = nil
	p.Q = make([]int8, len(q.Q))
	for r := 0; r < q.Rows; r++ {
		src, dst := q.Q[r*q.Cols:(r+1)*q.Cols], p.Q[r*q.Cols:(r+1)*q.Cols]
		for j, c := range perm {
			dst[j] = src[c]
		}
	}
	return &p
}

// sharedPerm uploads a column order (and its stagedOrder after it), or
// returns the device copy of an equal one (weights that share their input
// share it), counting its users.
func (b *Backend) sharedPerm(perm []int32) driver.DevicePtr {
	key := string(unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(perm))), 4*len(perm)))
	if p, ok := b.perms[key]; ok {
		b.permUsers[p]++
		return p
	}
	p := uploadSlice(b, append(slices.Clip(perm), stagedOrder(perm)...))
	b.perms[key] = p
	b.permUsers[p] = 1
	return p
}

// stagedOrder is perm (a column order of a width that is a multiple of
// 32, at most 1<<16) in the form the streaming GEMV gathers by
// (qtool.cu's gemvw_body): 16-bit feature indices, the 8 of staged unit u
// (columns 8u .. 8u+7) in the 16-byte unit xwSwizzle(u), packed in pairs
// into int32 words (low half first). Other widths, which that kernel does
// not run, give nothing.
func stagedOrder(perm []int32) []int32 {
	if !stagedOrderFits(len(perm)) {
		return nil
	}
	st := make([]int32, len(perm)/2)
	for u := 0; u < len(perm)/8; u++ {
		for i := 0; i < 8; i += 2 {
			lo, hi := uint32(perm[8*u+i]), uint32(perm[8*u+i+1])
			st[4*xwSwizzle(u)+i/2] = int32(lo | hi<<16)
		}
	}
	return st
}

// xwSwizzle is the place of the streaming GEMV's staged 16-byte unit u
// (qtool.cu's xw_swz: its low 2 bits flipped by bits 3-4).
func xwSwizzle(u int) int { return u ^ (u>>3)&3 }

// stagedOrderFits reports whether a column order of width in has a
// stagedOrder.
func stagedOrderFits(in int) bool { return in%32 == 0 && in <= 1<<16 }

// permBytes is the device memory of a column order of width in (sharedPerm).
func permBytes(in int) int64 {
	if stagedOrderFits(in) {
		return int64(6 * in)
	}
	return int64(4 * in)
}

// stagedPerm is the address of l's stagedOrder for the streaming GEMV
// (whose widths, at most gemvStreamMaxSmem/6 with an order, all have one),
// or 0 without a column order.
func stagedPerm(l *Linear) driver.DevicePtr {
	if l.perm == 0 {
		return 0
	}
	return l.perm + driver.DevicePtr(4*l.in)
}

// releasePerm drops one user of a shared column order, freeing it with the last.
func (b *Backend) releasePerm(p driver.DevicePtr) {
	if b.permUsers[p]--; b.permUsers[p] > 0 {
		return
	}
	delete(b.permUsers, p)
	for k, q := range b.perms {
		if q == p {
			delete(b.perms, k)
		}
	}
	b.must(b.drv.MemFree(p))
	b.heldBytes -= int64(b.owned[p])
	delete(b.owned, p)
}

// permuted returns x, or x with its columns gathered by perm (act-order
// weights) in a scratch buffer.
func (b *Backend) permuted(s *Buf, perm driver.DevicePtr) *Buf {
	if perm == 0 {
		return s
	}
	g := &Buf{p: b.scratchBuf("x_perm", 4*s.rows*s.cols), rows: s.rows, cols: s.cols}
	b.launch("gather_cols", b.gridFor(s.n()), block256, g.p, s.p, perm, s.rows, s.cols)
	return g
}

// MatMul implements runtime.Backend.
func (b *Backend) MatMul(dst, x runtime.Buf, w runtime.Linear) {
	d, s, l := buf(dst), buf(x), lin(w)
	if s.cols != l.in || d.cols != l.out || d.rows != s.rows {
		panic(fmt.Sprintf("cuda backend: MatMul [%d %d] <- [%d %d] x [%d %d]ᵀ", d.rows, d.cols, s.rows, s.cols, l.out, l.in))
	}
	if d.p == s.p {
		panic("cuda backend: MatMul dst aliases x")
	}
	if s.rows == 0 {
		return
	}
	defer b.enter()()
	b.matmul(d, &gemmIn{x: s}, l, false, outStore)
}

// How matmul puts the products p into d (qtool.cu's OUT_*, the out
// argument of every tensor-core GEMM and of the sums of their splits).
const (
	outStore  = iota // d = p
	outAdd           // d += p (MatMulAdd)
	outSwiGLU        // d = silu(d)·p, d holding the gate's products (NormSwiGLU)
)

// gemmIn is the input of one or more products (the weights of one
// MatMulN): x, and the forms the GEMMs take it in, made by the first GEMM
// that needs them and kept for the next: rounded to fp16 in the column
// order perm (a16), or quantized to int8 for W8A8 (xq, per-token scales
// tok) as xqKey says. A norm may write either directly; x is then a shape
// only (p == 0).
type gemmIn struct {
	x         *Buf
	a16, perm driver.DevicePtr
	xq, tok   driver.DevicePtr
	xqKey     actQuant
	// kv, where set, asks a segs launch of q, k and v to rotate and store
	// them (NormMatMulStoreKV); the launch that does sets kv.done.
	kv *qkvStore
}

// actQuant is how W8A8 quantizes a layer's input: per token, or with one
// scale and offset.
type actQuant struct {
	dynamic       bool
	scale, offset float32
}

// divisionFree reports whether a static quantizer's codes may come from
// the producers' quant_fast (qtool.cu: a reciprocal and two FMAs a value,
// the same codes as quant_act's division only for 2^-30 ≤ |scale| ≤ 2^30
// and |offset| ≤ 2^8). Producers write codes only for such a quantizer
// (formFor, normed); every other takes floats and quant_act.
func (q actQuant) divisionFree() bool {
	s := math.Abs(float64(q.scale))
	return s >= 0x1p-30 && s <= 0x1p30 && math.Abs(float64(q.offset)) <= 0x1p8
}

// actQuant is how W8A8 layer l quantizes its input.
func (l *Linear) actQuant() actQuant {
	if l.dynamic {
		return actQuant{dynamic: true}
	}
	return actQuant{scale: l.inScale, offset: l.inOffset}
}

// half returns in's activations in fp16 in l's column order, made once
// (to_half; gather_half for act-order weights, rows of at most
// gatherHalfMaxCols, else gather_cols first). K is a multiple of 32
// (halfGEMM).
func (b *Backend) half(in *gemmIn, l *Linear) driver.DevicePtr {
	if in.a16 != 0 && in.perm == l.perm {
		return in.a16
	}
	s := in.x
	in.a16, in.perm = b.scratchBuf("gemm_a16", 2*s.n()), l.perm
	if l.perm != 0 && s.cols <= gatherHalfMaxCols {
		b.raiseSmem("gather_half", 4*s.cols)
		b.launchShm("gather_half", g1(s.rows), block256, 4*s.cols, in.a16, s.p, l.perm, s.cols)
		return in.a16
	}
	s = b.permuted(s, l.perm)
	b.launch("to_half", b.gridFor(s.n()/4), block256, in.a16, s.p, int64(s.n()))
	return in.a16
}

// gatherHalfMaxCols bounds the row gather_half stages in shared memory
// (96 KB, as gemvStreamMaxSmem: within every supported device's limit).
const gatherHalfMaxCols = 24 << 10

// quantized returns in's activations quantized for W8A8 layer l (and the
// per-token scales of a dynamic one), made once for each actQuant.
func (b *Backend) quantized(in *gemmIn, l *Linear) (xq, tok driver.DevicePtr) {
	key := l.actQuant()
	if in.xq != 0 && in.xqKey == key {
		return in.xq, in.tok
	}
	s := in.x
	M, K := s.rows, s.cols
	in.xq, in.tok, in.xqKey = b.scratchBuf("xq", M*K), 0, key
	if l.dynamic {
		in.tok = b.scratchBuf("xq_tok", 4*M)
		b.launch("quant_act_token", g1(M), block256, in.xq, in.tok, s.p, K)
	} else {
		b.launch("quant_act", b.gridFor(M*K/4), block256, in.xq, s.p, int64(M*K), l.inScale, l.inOffset)
	}
	return in.xq, in.tok
}

// halfGEMM reports whether matmul multiplies M rows by l with a gemm_h or
// Hopper GEMM (the activations in fp16): fp16 and bf16 weights, 4- and
// 8-bit ones that gemm_h dequantizes in its loader, and the other 4- and
// 8-bit ones from dequantGEMMMinRows rows, where the GEMMs run at all
// (more than GEMVMaxRows rows, or forceGEMM; K a multiple of 32).
func (b *Backend) halfGEMM(l *Linear, M int, forceGEMM bool) bool {
	if !(M > b.opt.GEMVMaxRows || forceGEMM) || l.in%32 != 0 {
		return false
	}
	switch l.kind {
	case kindF16, kindBF16:
		return true
	case kindQ4, kindQ8:
		_, widen := gemmHKernel(l)
		return !widen || M >= dequantGEMMMinRows
	}
	return false
}

// gemmHForm is the form of gemm_h kernel name (gemmHKernel's) that
// multiplies M rows where no Hopper GEMM takes them: its _s form up to
// gemmHSmallRows rows; and the rows of activations its block tile holds.
func gemmHForm(name string, M int) (kernel string, rows int) {
	if M <= gemmHSmallRows {
		return name + "_s", 32
	}
	return name, 128
}

// matmul dispatches d = in·lᵀ, the products put into d by out;
// forceGEMM picks the tensor-core path whatever M is.
func (b *Backend) matmul(d *Buf, in *gemmIn, l *Linear, forceGEMM bool, out int) {
	if l.kind == kindW8A8 {
		b.w8a8(d, in, l, forceGEMM, out, inputForm{})
		return
	}
	M, N, K := in.x.rows, l.out, l.in
	grid := [3]uint32{uint32((N + 127) / 128), uint32((M + 127) / 128), 1}
	if b.halfGEMM(l, M, forceGEMM) {
		// activations rounded to fp16 once, both operands streamed
		// through shared memory (gemm_h_*, gemm_wg_*); quantized weights
		// with groups of whole K steps (and no g_idx) dequantized in the
		// registers (gemm_h_q4, gemm_h_q8), other quantized weights
		// widened to fp16 first
		name, widen := gemmHKernel(l)
		w := l.w
		if widen {
			w = b.widened(l)
		}
		a16 := b.half(in, l)
		if wg := b.wgmmaKernel(name, M); wg != "" {
			b.launchWG(wg, d, a16, w, l, M, out)
			return
		}
		args := []any{a16, w, M, N, K}
		if name == "gemm_h_q4" || name == "gemm_h_q8" {
			args = []any{a16, w, l.sz, M, N, K, l.gs, l.groups}
		}
		kernel, rows := gemmHForm(name, M)
		shm := gemmHSmem(name, rows)
		grid[1] = uint32((M + rows - 1) / rows)
		b.raiseSmem(kernel, shm)
		b.launchGEMM(kernel, grid, block256, shm, 2*b.sms, (K+gemmHBK-1)/gemmHBK, d, out, args...)
		return
	}
	if (M > b.opt.GEMVMaxRows || forceGEMM) && K%32 == 0 {
		s := b.permuted(in.x, l.perm)
		name := "gemm_f32" // the rest: fused dequantizing loaders
		switch l.kind {
		case kindQ8:
			name = "gemm_q8"
		case kindQ4:
			name = "gemm_q4"
		}
		b.launchGEMM(name, grid, block256, 0, 2*b.sms, K/32, d, out, s.p, l.w, l.sz, l.gidx, M, N, K, l.gs, l.groups)
		return
	}
	segs := []gemvSeg{{d, l}}
	switch _, _, ok := b.gemvPlan(segs, M); {
	case out == outStore:
		b.gemv(in.x, segs, gemvEpi{})
	case out == outAdd && ok: // the GEMV kernels add their sums to d
		b.gemv(in.x, segs, gemvEpi{mode: gemvAdd})
	default: // the split-K GEMV, or the SwiGLU: through a temporary
		t := b.AllocRaw(d.rows, d.cols).(*Buf)
		b.gemv(in.x, []gemvSeg{{t, l}}, gemvEpi{})
		b.putOut(d, t, out)
		b.Free(t)
	}
}

// widened returns l's 4- or 8-bit weight widened to fp16 [N, K] in a
// scratch buffer (dequant_h_q4, dequant_h_q8), for the GEMMs that do not
// dequantize it in their loaders (gemmHKernel).
func (b *Backend) widened(l *Linear) driver.DevicePtr {
	N, K := l.out, l.in
	w := b.scratchBuf("gemm_w16", 2*N*K)
	if l.kind == kindQ4 {
		b.launch("dequant_h_q4", b.gridFor(N*K/8), block256, w, l.w, l.sz, N, K, l.gs, l.groups)
	} else {
		b.launch("dequant_h_q8", b.gridFor(N*K/8), block256, w, l.w, l.sz, l.gidx, N, K, l.gs, l.groups)
	}
	return w
}

// inputForm asks the producer of a product's input for it in the form
// the product's GEMM takes, at p instead of floats (p = 0: floats as
// usual): the int8 codes of a W8A8 weight's static quantizer key (qtool.cu's
// QOut), or fp16 (half) for a halfGEMM weight without a column order. The
// SwiGLU of NormSwiGLU's GEMMs takes it (down's input, MLP), and the
// prefill attention of an fp16 cache (o's input, AttentionAdd).
type inputForm struct {
	p    driver.DevicePtr
	key  actQuant
	half bool
}

// args are the int8 form's kernel arguments (int8_t* p, float scale, float
// offset; p = 0 for none or the fp16 form).
func (f inputForm) args() []any {
	if f.half {
		return []any{driver.DevicePtr(0), float32(0), float32(0)}
	}
	return []any{f.p, f.key.scale, f.key.offset}
}

// inputFor returns the form in which the producer of the M-row input of a
// product with l may write it (scratch "formed_in"), or none (p = 0): see
// formFor.
func (b *Backend) inputFor(l *Linear, M int) inputForm {
	switch b.formFor(l, M) {
	case formInt8:
		return inputForm{p: b.scratchBuf("formed_in", M*l.in), key: l.actQuant()}
	case formHalf:
		return inputForm{p: b.scratchBuf("formed_in", 2*M*l.in), half: true}
	}
	return inputForm{}
}

// Input forms (formFor).
const (
	formNone = iota
	formInt8 // the int8 codes of a W8A8 weight's static quantizer
	formHalf // fp16, in column order
)

// formFor names the form in which a product with l of M input rows takes
// its input, where the producer may write it so: l's int8 codes where l is
// W8A8 with a static quantizer whose codes need no division
// (actQuant.divisionFree), fp16 where its GEMM takes fp16 in column order;
// formNone otherwise.
func (b *Backend) formFor(l *Linear, M int) int {
	switch {
	case l.kind == kindW8A8 && !l.dynamic && l.actQuant().divisionFree():
		return formInt8
	case l.kind != kindW8A8 && b.halfGEMM(l, M, false) && l.perm == 0:
		return formHalf
	}
	return formNone
}

// input is the gemmIn of the product whose M × K input f holds (made by
// its producer): no floats, only the form.
func (f inputForm) input(M, K int) *gemmIn {
	in := &gemmIn{x: &Buf{rows: M, cols: K}}
	if f.half {
		in.a16 = f.p
	} else {
		in.xq, in.xqKey = f.p, f.key
	}
	return in
}

// w8a8 is matmul for a W8A8 weight l. With q an int8 form and out the
// SwiGLU, the results are quantized to q instead of being written to d
// (which holds the gate's products) where the kernel can (the mma.sync
// GEMM and the sums of its K splits; on Hopper gemm_wg_s8_glu does it for
// gate and up together, gluPair); it reports whether they were.
func (b *Backend) w8a8(d *Buf, in *gemmIn, l *Linear, forceGEMM bool, out int, q inputForm) bool {
	M, N, K := in.x.rows, l.out, l.in
	if out != outSwiGLU || q.half {
		q = inputForm{}
	}
	xq, tok := b.quantized(in, l)
	// the int8 tensor cores split K into integer partial sums, which
	// w8a8_sum_splits adds exactly
	sum := func(q inputForm) func(part driver.DevicePtr, S int) {
		return func(part driver.DevicePtr, S int) {
			b.launch("w8a8_sum_splits", b.gridFor(M*N), block256, append([]any{d.p, part, S, M, N, l.qbias, l.deq, l.bias, tok}, append(q.args(), out)...)...)
		}
	}
	if wg := b.wgmmaKernel("w8a8_mma", M); wg != "" { // K steps of 128 int8
		grid, shm, wmap := b.prepareWG(wg, xq, l.w, l, M)
		steps := (K + 127) / 128
		wg, grid, shm = b.wideForm(wg, grid, shm, steps, true)
		if wg == "gemm_wg_s8" && b.s8Fill(M, N, steps) {
			if l.wmapF == nil {
				l.wmapF = driver.NewTensorMaps(1)[0]
				b.encodeWeightMap(l.wmapF, wg, l.w, N, K, s8FillRows)
			}
			wg, grid[1], shm, wmap = s8FillKernel, uint32((N+s8FillRows-1)/s8FillRows), s8FillSmem(s8FillRows), l.wmapF
			b.raiseSmem(wg, shm)
		}
		b.launchSplit(wg, grid, block384, shm, b.sms, steps, d, out, []any{b.tmaps[0], wmap, l.qbias, l.deq, l.bias, tok, M, N, K}, sum(inputForm{}))
		return false
	}
	if M > b.opt.GEMVMaxRows || forceGEMM { // 128 × 128 tiles
		b.raiseSmem("w8a8_mma", w8a8MMASmem)
		grid := [3]uint32{uint32((N + 127) / 128), uint32((M + 127) / 128), 1}
		b.launchSplit("w8a8_mma", grid, block256, w8a8MMASmem, 2*b.sms, (K+w8a8BK-1)/w8a8BK, d, out,
			append([]any{xq, l.w, l.qbias, l.deq, l.bias, tok, M, N, K}, q.args()...), sum(q))
		return q.p != 0
	}
	b.w8a8GEMV(xq, tok, M, K, []gemvSeg{{d, l}}, out)
	return false
}

// w8a8DP4A reports whether w8a8 multiplies M rows by W8A8 weights with
// the dp4a kernels (w8a8_gemm, w8a8_glu): no Hopper GEMM for M rows, and
// at most GEMVMaxRows of them.
func (b *Backend) w8a8DP4A(M int) bool {
	return b.wgmmaKernel("w8a8_mma", M) == "" && M <= b.opt.GEMVMaxRows
}

// w8a8GEMV launches w8a8_gemm: the products of the M rows of xq (K int8
// each; tok their scales where the quantizer is dynamic) with up to three
// W8A8 weights of that quantizer, each into its output by out. A warp an
// output, a block row an activation row: at most 65535 rows a launch.
func (b *Backend) w8a8GEMV(xq, tok driver.DevicePtr, M, K int, segs []gemvSeg, out int) {
	var nb [3]int // blocks of 8 rows a weight
	for i, g := range segs {
		nb[i] = (g.l.out + 7) / 8
	}
	for r0 := 0; r0 < M; r0 += 65535 {
		m := min(65535, M-r0)
		t := tok
		if t != 0 {
			t += driver.DevicePtr(4 * r0)
		}
		args := []any{xq + driver.DevicePtr(r0*K), t, K, out, nb[0], nb[1]}
		for i := range nb {
			if i >= len(segs) { // no weight: no blocks, nothing read
				args = append(args, driver.DevicePtr(0), driver.DevicePtr(0), driver.DevicePtr(0), driver.DevicePtr(0), driver.DevicePtr(0), 0)
				continue
			}
			d, l := segs[i].d, segs[i].l
			args = append(args, d.p+driver.DevicePtr(4*r0*l.out), l.w, l.qbias, l.deq, l.bias, l.out)
		}
		b.launch("w8a8_gemm", [3]uint32{uint32(nb[0] + nb[1] + nb[2]), uint32(m), 1}, block256, args...)
	}
}

// w8a8Segs runs the products segs (two or three W8A8 weights of one
// activation quantizer sharing in: q, k and v) as one launch of w8a8_gemm
// where the dp4a kernels take in's rows; it reports whether it did.
func (b *Backend) w8a8Segs(in *gemmIn, segs []gemvSeg) bool {
	if !w8a8OneInput(segs) || !b.w8a8DP4A(in.x.rows) {
		return false
	}
	l0 := segs[0].l
	xq, tok := b.quantized(in, l0)
	b.w8a8GEMV(xq, tok, in.x.rows, l0.in, segs, outStore)
	return true
}

// w8a8OneInput reports whether segs are two or three W8A8 weights of one
// input width and activation quantizer, whose products one launch of
// quantized inputs can run (w8a8Segs, w8a8WGSegs).
func w8a8OneInput(segs []gemvSeg) bool {
	if len(segs) < 2 || len(segs) > 3 {
		return false
	}
	l0 := segs[0].l
	for _, g := range segs {
		if l := g.l; l.kind != kindW8A8 || l.in != l0.in || l.actQuant() != l0.actQuant() {
			return false
		}
	}
	return true
}

// w8a8SegsKernel is the Hopper int8 GEMM of one input with up to three
// W8A8 weights (w8a8WGSegs).
const w8a8SegsKernel = "gemm_wg_s8_segs"

// w8a8WGSegs runs the products segs (two or three W8A8 weights of one
// activation quantizer sharing in: q, k and v) as one launch of
// gemm_wg_s8_segs where the Hopper int8 GEMM takes in's rows and each
// product alone would split K (its tiles fill at most half the device) or
// the launch takes fewer waves than the products one by one
// (segsTiles), the launch's K splits, if any, merging in clusters
// (splitPlan over all the products' tiles; where it would merge them
// through memory, the products run one at a time); it reports whether it
// did. A K split of few steps costs a launch ~10 µs of fill, merge and
// epilogue whatever its size (kernels/NOTES.md), paid here once, not a
// product: on an H200 W8A8 prefill of 128 tokens ran 15 % faster
// (llama2-7b and llama3-8b), of 256 6 % and 13 %; the saved wave gave
// llama3-8b's prefill of 512 tokens 4 %, of 1 024 1.7 % (where one
// launch saves no wave it lost up to 2.6 %: llama2-7b at 1 024 and 2 048
// tokens). The sums are integers, so the values are each product's alone
// however K splits. Where in.kv asks for it (segsKV) the launch is of
// gemm_wg_s8_segs_kv, which rotates q and k and stores k and v into the
// cache, and up to kvSegsMaxRows rows it is taken whatever segsTiles says
// (kvSegs).
func (b *Backend) w8a8WGSegs(in *gemmIn, segs []gemvSeg) bool {
	M, l0 := in.x.rows, segs[0].l
	if !w8a8OneInput(segs) || b.wgmmaKernel("w8a8_mma", M) == "" {
		return false
	}
	mt, steps := (M+127)/128, (l0.in+127)/128
	tiles, eachSplits, savesWave := b.segsTiles(segs, M, steps)
	if !eachSplits && !savesWave && !kvSegs(in, w8a8SegsKernel) {
		return false
	}
	S, cluster, _ := b.splitPlan(w8a8SegsKernel, tiles, steps, b.sms)
	if S > 1 && !cluster {
		return false
	}
	xq, tok := b.quantized(in, l0)
	shm := b.actMap("gemm_wg_s8", xq, M, l0.in)
	name, kv := w8a8SegsKernel, segsKV(in, w8a8SegsKernel)
	if kv {
		name = segsKVKernels[name]
	}
	b.raiseSmem(name, shm)
	var maps [3]*driver.TensorMap
	var outs []any
	for i := range maps {
		if i >= len(segs) { // no weight: no tiles, nothing read
			maps[i] = maps[0]
			outs = append(outs, driver.DevicePtr(0), driver.DevicePtr(0), driver.DevicePtr(0), driver.DevicePtr(0), 0)
			continue
		}
		d, l := segs[i].d, segs[i].l
		maps[i] = b.weightMap("gemm_wg_s8", l.w, l)
		if kv { // {qbias, deq, bias, N} each, then q's output and the store's
			outs = append(outs, l.qbias, l.deq, l.bias, l.out)
			continue
		}
		outs = append(outs, d.p, l.qbias, l.deq, l.bias, l.out)
	}
	args := []any{b.tmaps[0], maps[0], maps[1], maps[2], tok, M, l0.in}
	if kv {
		args = append(append(append(args, outs...), segs[0].d.p), in.kv.args()...)
		in.kv.done = true
	} else {
		args = append(append(args, outStore), outs...)
	}
	b.launchMerged(name, [3]uint32{uint32(mt), uint32(tiles / mt), 1}, block384, shm, S, args...)
	return true
}

// kvSegsMaxRows is the most rows at which q, k and v go in one segs launch
// whatever segsTiles says where that launch also rotates and stores them
// (kvSegs): it saves store_kv's launch (~17 µs a layer at 512 rows), more
// than the products lose together. On an H200 (sixty-fourth session, two
// calls of two rounds) prefill of 512 tokens gained W8A8 2.9 % on
// llama2-7b in both (llama3-8b equal), W4A16 2.4 % and 4.5 % in one call
// and nothing in the other, fp16 within its spread; of 256 nothing
// changed; of 1 024 W4A16 lost 4.9 % on llama2-7b.
const kvSegsMaxRows = 512

// kvSegs reports whether the products of in go in one launch of segs
// kernel name for the fused RoPE and KV store whatever segsTiles says
// (kvSegsMaxRows).
func kvSegs(in *gemmIn, name string) bool {
	return segsKV(in, name) && in.x.rows <= kvSegsMaxRows
}

// segsKV reports whether the segs launch of kernel name takes in.kv's
// fused RoPE and KV store (segsKVKernels; qkvStoreFor has checked that the
// products are q, k and v, k and v of one shape).
func segsKV(in *gemmIn, name string) bool {
	return in.kv != nil && segsKVKernels[name] != ""
}

// w8a8GLU runs gate's and up's products of in and their SwiGLU into d as
// one launch of w8a8_glu, where both are W8A8 weights of one activation
// quantizer and shape and the dp4a kernels take in's rows (gate's
// outputs never in memory); it reports whether it did.
func (b *Backend) w8a8GLU(d *Buf, in *gemmIn, gate, up *Linear) bool {
	M, N, K := in.x.rows, gate.out, gate.in
	if gate.kind != kindW8A8 || up.kind != kindW8A8 || up.out != N || up.in != K ||
		gate.actQuant() != up.actQuant() || !b.w8a8DP4A(M) || M > 65535 {
		return false
	}
	xq, tok := b.quantized(in, gate)
	b.launch("w8a8_glu", [3]uint32{uint32((N + 7) / 8), uint32(M), 1}, block256, d.p, xq, tok, N, K,
		gate.w, gate.qbias, gate.deq, gate.bias, up.w, up.qbias, up.deq, up.bias)
	return true
}

// putOut puts the products p into d by out with an elementwise kernel.
func (b *Backend) putOut(d, p *Buf, out int) {
	switch out {
	case outAdd:
		b.launch("add_inplace", b.gridFor(d.n()), block256, d.p, p.p, int64(d.n()))
	case outSwiGLU:
		b.launch("silu_mul", b.gridFor(d.n()), block256, d.p, d.p, p.p, int64(d.n()))
	default:
		panic("cuda backend: putOut with out = store")
	}
}

// gemmHKernel is the gemm_h kernel that multiplies by l's weight (fp16,
// bf16, 4- or 8-bit) from dequantGEMMMinRows rows on, and whether the
// weight is widened to fp16 first (quantized weights with groups of part
// of a K step, or a g_idx: gemm_h_f16 on the widened copy); quantized
// weights of whole K steps are dequantized in the kernel (gemm_h_q4,
// gemm_h_q8).
func gemmHKernel(l *Linear) (name string, widen bool) {
	inKernel := l.gs%gemmHBK == 0 && l.gidx == 0
	switch {
	case l.kind == kindBF16:
		return "gemm_h_bf16", false
	case l.kind == kindQ4 && inKernel:
		return "gemm_h_q4", false
	case l.kind == kindQ8 && inKernel:
		return "gemm_h_q8", false
	}
	return "gemm_h_f16", l.kind == kindQ4 || l.kind == kindQ8
}

// hopperGEMM maps each mma.sync GEMM to the Hopper GEMM that replaces it
// (the widened 4- and 8-bit weights go under gemm_h_f16).
var hopperGEMM = map[string]string{"gemm_h_f16": "gemm_wg_f16", "gemm_h_bf16": "gemm_wg_bf16",
	"gemm_h_q4": "gemm_wg_q4", "gemm_h_q8": "gemm_wg_q8", "w8a8_mma": "gemm_wg_s8"}

// wgmmaKernel is the Hopper GEMM that replaces GEMM name for M activation
// rows, or "" where there is none: from dequantGEMMMinRows rows on, where
// the sm_90a kernels are loaded and not turned off.
func (b *Backend) wgmmaKernel(name string, M int) string {
	if !b.wgmma || b.opt.NoWGMMA || M < dequantGEMMMinRows {
		return ""
	}
	return hopperGEMM[name]
}

// gemmWGSmem is the dynamic shared memory of Hopper GEMM name with ah
// 128-row halves a block (1; 2: its _w form, halves of activations, or of
// weights for fp16 and int8, whose tiles are the same 16 KB) (qtool.cu's
// gw_stage_bytes × gw_stages, 2 mbarriers a stage, 1024 bytes to align the
// ring): a stage holds the A tile (128 rows of 128 bytes a half) and the W
// tile as loaded (128 rows of 128 bytes; 4-bit: 32; 8-bit: 64, and 128
// {scale, zero}).
func gemmWGSmem(name string, ah int) int {
	stage := ah * 128 * 128
	switch name {
	case "gemm_wg_q4":
		stage += 128*32 + 128*8
	case "gemm_wg_q8":
		stage += 128*64 + 128*8
	default:
		stage += 128 * 128
	}
	S := gemmWGStages(name, ah)
	return S*stage + 2*S*8 + 1024
}

// gemmWGStages is the depth of Hopper GEMM name's ring with ah halves a
// block (qtool.cu's gw_stages): 8 for the 4-bit weights, whose stages are
// small, else 5; with two halves as many as fit in 227 KB (4-bit 6, 8-bit
// 5, bf16, fp16 and int8 4).
func gemmWGStages(name string, ah int) int {
	switch {
	case ah == 1 && name == "gemm_wg_q4":
		return 8
	case ah == 1:
		return 5
	case name == "gemm_wg_q4":
		return 6
	case name == "gemm_wg_q8":
		return 5
	}
	return 4
}

// wideKernels maps Hopper GEMMs to their forms of blocks with two 128-row
// halves (AH = 2 in qtool.cu): for the register-fragment kinds (and their
// gate/up pairs) 256 activation rows, each weight fragment made once for
// twice the rows; for fp16 and int8 256 weight rows (wideAlongN; their
// pairs 128 rows of each weight), one wgmma m64n256 reading the
// activations once for both halves.
var wideKernels = map[string]string{"gemm_wg_f16": "gemm_wg_f16_w", "gemm_wg_bf16": "gemm_wg_bf16_w", "gemm_wg_q4": "gemm_wg_q4_w",
	"gemm_wg_q8": "gemm_wg_q8_w", "gemm_wg_s8": "gemm_wg_s8_w", "gemm_wg_f16_glu": "gemm_wg_f16_glu_w",
	"gemm_wg_bf16_glu": "gemm_wg_bf16_glu_w", "gemm_wg_q4_glu": "gemm_wg_q4_glu_w", "gemm_wg_q8_glu": "gemm_wg_q8_glu_w",
	"gemm_wg_s8_glu": "gemm_wg_s8_glu_w"}

// wideAlongN reports whether Hopper GEMM name's _w form doubles the weight
// rows of a block rather than its activation rows.
func wideAlongN(name string) bool {
	name = strings.TrimSuffix(name, "_glu")
	return name == "gemm_wg_f16" || name == "gemm_wg_s8"
}

// wideCost is a wide block's time for one 128-row half of Hopper GEMM
// name, relative to a narrow block of 128 rows: the fragments made half as
// often (0.77–0.82 measured on an H200 at 512 rows, the 8/4-bit and bf16
// kinds), or for fp16 and int8 the activations read half as often (0.85
// for fp16; 0.89–0.93 for int8 at 512, 1 024 and 2 048 rows of 14336 ×
// 4096, whose wide blocks then lost at 1 024 rows: 4 waves against 7).
func wideCost(name string) float64 {
	switch {
	case !wideAlongN(name):
		return 0.8
	case strings.HasPrefix(name, "gemm_wg_s8"):
		return 0.9
	}
	return 0.85
}

// wgSplitSteps is what splitting K costs a Hopper GEMM launch, in block
// steps (one 128 × 128 tile through one K step, 128 bytes of activations):
// the partial products written in 4 bytes each and added up by sum_splits
// (w8a8_sum_splits). 13–16 µs measured on an H200 at 512 × 4096 outputs
// in two splits, ~0.5 µs a step.
const wgSplitSteps = 28

// wgClusterRoundSteps is what one round of a cluster's merge of K splits
// costs (splitPlan; log2 of the splits rounds, rounded up, but one for a
// narrow three), in block steps as wgSplitSteps, for a narrow block's 64
// KB of sums (a wide block's 128 KB: twice): sent from block to block of
// the cluster, no second launch.
// On an H200 (fifty-fifth session, a first form of the merge) the int8
// GEMM of 4096 × 4096 at 256 rows took 17.8 µs in narrow blocks
// split in two so (27.5 merged through memory), 27.7 in wide blocks split
// in three; 4096 × 11008 at 512 rows 64.2 µs in wide blocks split in two
// (74.2 through memory) against 57.2 narrow and unsplit. A narrow pair's
// round (qtool.cu's gw_scatter since the sixty-fourth session: 32 KB
// each way at once, each block finishing half the rows) is cheaper, 1.9 µs
// against the tree's 2.8 (4096 × 4096 int8 at 128 rows), but priced the
// same: the dispatcher's choices were measured at this price. A narrow
// three merges in one round too (gw_scatter, sixty-fifth session),
// and is priced so since its blocks finish 48, 48 and 32 rows (sixty-
// eighth session): o's 4096 × 4096 int8 at 128 rows moved from pairs to
// threes, W8A8 prefill at 128 tokens +0.9 % on llama2-7b and +0.7 % on
// llama3-8b over three rounds (with 64, 32 and 32 rows it moved with no
// gain).
const wgClusterRoundSteps = 6

// wgEstimate is a Hopper GEMM launch's time in block steps: tiles blocks
// of Hopper GEMM name (times the K splits launchSplit makes where split;
// those of a gate/up pair's launch do not split), b.sms at once, each
// through steps K steps at cost a step, plus what merging the splits
// costs (splitPlan) where K splits.
func (b *Backend) wgEstimate(name string, tiles, steps int, cost float64, split bool) float64 {
	S, merge := 1, 0.0
	if split {
		S, _, merge = b.splitPlan(name, tiles, steps, b.sms)
	}
	return float64((tiles*S+b.sms-1)/b.sms)*float64((steps+S-1)/S)*cost + merge
}

// wideWG reports whether Hopper GEMM name, narrow blocks through steps K
// steps, takes its _w form of wide blocks of two halves
// (Options.WGWide; by default where wgEstimate says the wide launch, two
// halves a block at wideCost each, takes less: where it has fewer waves,
// or fewer blocks to split K among; never where the wide blocks are as
// many, a half of each idle).
func (b *Backend) wideWG(name string, narrow, wide, steps int, split bool) bool {
	switch {
	case b.opt.WGWide > 0:
		return true
	case b.opt.WGWide < 0 || wide >= narrow:
		return false
	}
	return b.wgEstimate(wideKernels[name], wide, steps, 2*wideCost(name), split) < b.wgEstimate(name, narrow, steps, 1, split)
}

// wideForm is Hopper GEMM name's launch, its narrow grid and shared memory
// shm for steps K steps (split: launchSplit may split K), in the form
// wideWG picks (narrow where oneTileNarrow says, unless Options.WGWide
// forces the wide one): its _w form, its grid and shared memory (raised), or name,
// grid and shm as they are.
func (b *Backend) wideForm(name string, grid [3]uint32, shm, steps int, split bool) (string, [3]uint32, int) {
	wn, wg := wideKernels[name], wideGrid(name, grid)
	if wn == "" || b.opt.WGWide <= 0 && oneTileNarrow(name, grid) ||
		!b.wideWG(name, int(grid[0]*grid[1]), int(wg[0]*wg[1]), steps, split) {
		return name, grid, shm
	}
	shm = gemmWGSmem(strings.TrimSuffix(name, "_glu"), 2) // a pair's stages as its kind's plain GEMM's
	b.raiseSmem(wn, shm)
	return wn, wg, shm
}

// oneTileNarrow reports whether Hopper GEMM name on its narrow grid stays
// narrow whatever wideWG estimates: the plain fp16 GEMM with one tile of
// activation rows (128 or fewer; grid.x walks them), whose wide blocks of
// two weight halves split K in twice as many ways. wgEstimate counts only
// K steps and the merge; a block's fill and epilogue, which a wide block
// pays for two halves (3.5 and 3.7 µs against 1.8 and 1.9 on an H200,
// sixty-third session), decide at one tile: 4096 × 4096, 4096 × 11008 and
// 4096 × 14336 at 128 rows took 18.8, 35.8 and 43.2 µs a call narrow in
// four splits against 22.6, 40.3 and 49.0 wide in eight
// (BenchmarkGEMMSplitPlans), and fp16 prefill of 128 tokens ran 4 % faster
// narrow (llama2-7b 22 224 and 22 197 tok/s against 21 348 and 21 292;
// llama3-8b 20 618 against 19 754). At 256 rows (two tiles) the wide form
// stays: narrow lost 2 % there. (A rule here rather than in wgEstimate: a
// per-block cost of fill and epilogue added to it, once a narrow block and
// twice a wide one, turns all three shapes narrow from 10 steps a block
// on, but from 8 on turns two of TestWideWG's 512-row choices wrong (8-bit
// 4096 × 11008, int8 at K = 25 600): no one constant fits both.)
func oneTileNarrow(name string, grid [3]uint32) bool {
	return name == "gemm_wg_f16" && grid[0] == 1
}

// wideGrid is the grid of Hopper GEMM name's _w form for the narrow grid.
func wideGrid(name string, grid [3]uint32) [3]uint32 {
	if wideAlongN(name) {
		grid[1] = (grid[1] + 1) / 2
	} else {
		grid[0] = (grid[0] + 1) / 2
	}
	return grid
}

// launchWG launches Hopper GEMM name for l: d[M, N] = a16[M, K] · wᵀ, a16
// the activations in fp16 and w l's weight (fp16 or bf16 [N, K], 4-bit
// words [N, K/8], int8 codes [N, K]) or its widening to fp16; K a multiple
// of 32 (the tensor maps' row pitch a multiple of 16 bytes); the products
// put into d by out. 128 × 128 tiles of 3 warpgroups (where wideWG picks
// the _w form 256 activation rows by 128, or for fp16 128 by 256 weight
// rows), one block a multiprocessor, K split as for the other GEMMs.
func (b *Backend) launchWG(name string, d *Buf, a16, w driver.DevicePtr, l *Linear, M, out int) {
	grid, shm, wmap := b.prepareWG(name, a16, w, l, M)
	steps := (l.in + gemmHBK - 1) / gemmHBK
	name, grid, shm = b.wideForm(name, grid, shm, steps, true)
	gs, G := max(l.gs, gemmHBK), l.groups
	b.launchGEMM(name, grid, block384, shm, b.sms, steps, d, out, b.tmaps[0], wmap, l.sz, M, l.out, l.in, gs, G, wgFlags(l))
}

// prepareWG encodes the tensor map of Hopper GEMM name's activations
// (b.tmaps[0], over a [M, K]: fp16, int8 for gemm_wg_s8), raises its shared
// memory limit, and returns its grid (activation tiles first: the blocks
// running at once share weight tiles), shared memory and the weight's
// tensor map (over w [N, K] of l as the kernel reads it): l's own, encoded
// once, where w is l's weight; b.tmaps[1], encoded anew, for a widened
// copy.
func (b *Backend) prepareWG(name string, a, w driver.DevicePtr, l *Linear, M int) (grid [3]uint32, shm int, wmap *driver.TensorMap) {
	wmap = b.weightMap(name, w, l)
	shm = b.actMap(name, a, M, l.in)
	b.raiseSmem(name, shm)
	return [3]uint32{uint32((M + 127) / 128), uint32((l.out + 127) / 128), 1}, shm, wmap
}

// weightMap returns the tensor map over w [N, K] of l as Hopper GEMM name
// reads it: l's own, encoded once, where w is l's weight; b.tmaps[1],
// encoded anew, for a widened copy.
func (b *Backend) weightMap(name string, w driver.DevicePtr, l *Linear) *driver.TensorMap {
	switch {
	case w != l.w:
		b.encodeWeightMap(b.tmaps[1], name, w, l.out, l.in, 128)
		return b.tmaps[1]
	case l.wmap == nil:
		l.wmap = driver.NewTensorMaps(1)[0]
		b.encodeWeightMap(l.wmap, name, w, l.out, l.in, 128)
	}
	return l.wmap
}

// unwidenedWG is the Hopper GEMM that multiplies M rows by l's weight as
// stored (fp16, bf16, or 4/8-bit dequantized inside the GEMM), "" where
// there is none (no Hopper GEMMs, too few rows, or a weight the GEMMs
// take only widened to fp16).
func (b *Backend) unwidenedWG(l *Linear, M int) string {
	if !b.halfGEMM(l, M, false) {
		return ""
	}
	gh, widen := gemmHKernel(l)
	if widen {
		return ""
	}
	return b.wgmmaKernel(gh, M)
}

// actMap encodes b.tmaps[0], the tensor map of Hopper GEMM name's
// activations a [M, K] (fp16; int8 for gemm_wg_s8), and returns the
// GEMM's dynamic shared memory.
func (b *Backend) actMap(name string, a driver.DevicePtr, M, K int) (shm int) {
	at, aw := uint32(driver.TensorMapFloat16), uint64(2) // activations' type and width
	if name == "gemm_wg_s8" {
		at, aw = driver.TensorMapUint8, 1
	}
	// a K step is 128 bytes of activations whatever their type
	b.must(b.drv.EncodeTensorMap2D(b.tmaps[0], at, a, uint64(M), uint64(K), aw*uint64(K), 128, uint32(128/aw), driver.TensorMapSwizzle128))
	return gemmWGSmem(name, 1)
}

// encodeWeightMap encodes into m the tensor map of weight w [N, K] as
// Hopper GEMM name reads it (weightMapFormat), rows rows a box.
func (b *Backend) encodeWeightMap(m *driver.TensorMap, name string, w driver.DevicePtr, N, K, rows int) {
	f := weightMapFormat(name, K)
	b.must(b.drv.EncodeTensorMap2D(m, f.dtype, w, uint64(N), f.cols, f.pitch, uint32(rows), f.box, f.swizzle))
}

// mapFormat is how a Hopper GEMM's tensor map reads a weight's rows:
// their element type, elements and pitch in bytes, the elements of a K
// step (a box's width) and the swizzle.
type mapFormat struct {
	dtype        uint32
	cols, pitch  uint64
	box, swizzle uint32
}

// weightMapFormat is the mapFormat of Hopper GEMM name for weights of K
// input features: fp16/bf16 rows of 64 values a K step (128-byte
// swizzle), 4-bit words (8 a step), int8 codes (64 a step, 64-byte
// swizzle; 128 for gemm_wg_s8, 128-byte swizzle).
func weightMapFormat(name string, K int) mapFormat {
	k := uint64(K)
	switch name {
	case "gemm_wg_bf16":
		return mapFormat{driver.TensorMapBFloat16, k, 2 * k, 64, driver.TensorMapSwizzle128}
	case "gemm_wg_q4":
		return mapFormat{driver.TensorMapUint32, k / 8, k / 2, 8, driver.TensorMapNoSwizzle}
	case "gemm_wg_q8":
		return mapFormat{driver.TensorMapUint8, k, k, 64, driver.TensorMapSwizzle64}
	case "gemm_wg_s8":
		return mapFormat{driver.TensorMapUint8, k, k, 128, driver.TensorMapSwizzle128}
	}
	return mapFormat{driver.TensorMapFloat16, k, 2 * k, 64, driver.TensorMapSwizzle128}
}

var block384 = [3]uint32{384, 1, 1}

// launchGEMM launches tensor-core GEMM name (output d first, then args,
// then out) on grid with blocks of the given size, resident of them on the
// device at once, shm bytes of dynamic shared memory and steps K steps,
// split over grid.z as gemmSplits says: the splits write their partial
// products to a scratch buffer and sum_splits puts their sum into d by out.
func (b *Backend) launchGEMM(name string, grid, block [3]uint32, shm, resident, steps int, d *Buf, out int, args ...any) {
	n := d.n()
	b.launchSplit(name, grid, block, shm, resident, steps, d, out, args, func(part driver.DevicePtr, S int) {
		b.launch("sum_splits", b.sumSplitsGrid(n), block256, d.p, part, S, int64(n), out)
	})
}

// sumSplitsGrid is sum_splits's grid for n values: four a thread where n
// is a multiple of 4 (the kernel's float4 form, on aligned buffers), else
// one.
func (b *Backend) sumSplitsGrid(n int) [3]uint32 {
	if n%4 == 0 {
		return b.gridFor(n / 4)
	}
	return b.gridFor(n)
}

// launchSplit is launchGEMM with sum, which puts the sum of the S splits'
// partial products (4 bytes a value) at part into d by out; the kernel
// gets out (the splits store whatever it says).
func (b *Backend) launchSplit(name string, grid, block [3]uint32, shm, resident, steps int, d *Buf, out int, args []any, sum func(part driver.DevicePtr, S int)) {
	S, cluster, _ := b.splitPlan(name, int(grid[0]*grid[1]), steps, resident)
	args = append(slices.Clip(args), out)
	if S == 1 || cluster {
		b.launchMerged(name, grid, block, shm, S, append([]any{d.p}, args...)...)
		return
	}
	grid[2] = uint32(S)
	part := b.scratchBuf("gemm_part", 4*S*d.n())
	b.launchShm(name, grid, block, shm, append([]any{part}, args...)...)
	sum(part, S)
}

// launchMerged launches Hopper GEMM name on grid (z ignored) with K
// split S ways along z, a tile's splits one cluster that merges them in
// its blocks' shared memory (gw_scatter, gw_merge_splits); S = 1: a
// plain launch.
func (b *Backend) launchMerged(name string, grid, block [3]uint32, shm, S int, args ...any) {
	if S == 1 {
		grid[2] = 1
		b.launchShm(name, grid, block, shm, args...)
		return
	}
	grid[2] = uint32(S)
	b.launchCluster(name, grid, block, [3]uint32{1, 1, uint32(S)}, shm, args...)
}

// mergeKernels are the Hopper GEMMs whose K splits can merge in
// distributed shared memory (qtool.cu's gw_scatter and gw_merge_splits:
// the fp16 and int8 kinds, whose accumulators are the 64 or 128 values a
// consumer thread the merge sends), each with whether the dispatcher
// picks that merge. It does for int8 only: on an H200 (fifty-sixth session) the fp16 kernels merged
// in clusters were faster alone (4096 × 4096 at 256 rows 22.7 µs against
// 28.6) but fp16 prefill of 128 tokens lost 4–5 % on llama3-8b (its
// kernels' summed times fell, the forward pass's time rose) and gained 3 %
// at 256; W8A8 prefill gained 15–18 % (llama3-8b) and 31–34 % (llama2-7b)
// at 128 and 256 tokens.
var mergeKernels = map[string]bool{"gemm_wg_f16": false, "gemm_wg_f16_w": false, "gemm_wg_s8": true, "gemm_wg_s8_w": true,
	w8a8SegsKernel: true, s8FillKernel: true}

// scatterOnlyKernels are the Hopper GEMMs whose K splits merge only in a
// cluster of two or three blocks (qtool.cu's gw_scatter), neither through
// memory nor in gw_merge_splits's tree: the int8 fill form, which traps
// on any other split.
var scatterOnlyKernels = map[string]bool{s8FillKernel: true}

// mergesInCluster reports whether Hopper GEMM name may merge its K splits
// in its blocks' shared memory (splitPlan): a kind the dispatcher merges
// so (mergeKernels), or any kind that can where b.forceClusterSplit
// (tests: the fp16 merge stays checked).
func (b *Backend) mergesInCluster(name string) bool {
	picked, can := mergeKernels[name]
	return can && (picked || b.forceClusterSplit) && b.clusterSplits && !b.opt.NoClusterSplit
}

// measureClusterFit sets b.clusterFit from the driver (the int8 wide GEMM's
// block and shared memory, the most of the kinds that merge in clusters;
// every Hopper GEMM runs one block a multiprocessor), 0 for a size it
// cannot say or run (every size without a CUDA 12 driver), and reports
// whether clusters of two run.
func (b *Backend) measureClusterFit() bool {
	const name = "gemm_wg_s8_w"
	shm := gemmWGSmem("gemm_wg_s8", 2)
	if b.trySmem(name, shm) != nil {
		return false
	}
	for s := 2; s < len(b.clusterFit); s++ {
		if n, err := b.drv.MaxActiveClusters(b.fn[name], block384, [3]uint32{1, 1, uint32(s)}, uint32(shm)); err == nil {
			b.clusterFit[s] = n
		}
	}
	return b.clusterFit[2] > 0
}

// splitPlan is how a launch of tiles blocks of Hopper GEMM name (resident
// at once) splits its steps K steps and what merging the splits costs,
// in block steps as wgEstimate counts them (a wide block's step at
// 2·wideCost): S ways (b.splits), merged through sum_splits
// (wgSplitSteps); or, where the kind merges in clusters
// (mergesInCluster), each tile's splits as one cluster along z merging in
// shared memory (cluster set; wgClusterRoundSteps a round, twice for a
// wide block's sums; log2 of the splits rounds, one for a narrow three):
// the number of splits, of those whose clusters the device runs all at
// once (clusterFit, which counts each GPC's multiprocessors; at most 8, a
// portable cluster), that takes least, where that is less than the global
// merge. b.forceClusterSplit (tests) takes the most splits that fit,
// whatever they cost. A kernel that merges only in clusters of two or
// three (scatterOnlyKernels) splits at most in threes and only in
// clusters: where none fits, not at all.
func (b *Backend) splitPlan(name string, tiles, steps, resident int) (S int, cluster bool, merge float64) {
	S = b.splits(tiles, steps, resident)
	scatterOnly := scatterOnlyKernels[name]
	if scatterOnly {
		S = min(S, 3)
	}
	global := func() (int, bool, float64) { // the merge through memory, where the kernel has it
		if scatterOnly {
			return 1, false, 0
		}
		return S, false, wgSplitSteps
	}
	if S == 1 {
		return 1, false, 0
	}
	if !b.mergesInCluster(name) {
		return global()
	}
	halves, stepCost := 1, 1.0
	if strings.HasSuffix(name, "_w") {
		halves, stepCost = 2, 2*wideCost(strings.TrimSuffix(name, "_w"))
	}
	time := func(s int) float64 { return float64((steps+s-1)/s) * stepCost }
	best, bestS := time(S)+wgSplitSteps, 0
	for s := min(S, len(b.clusterFit)-1); s >= 2; s-- {
		if tiles > b.clusterFit[s] {
			continue
		}
		rounds := bits.Len(uint(s - 1)) // gw_merge_splits's tree
		if halves == 1 && s == 3 {
			rounds = 1 // a narrow three: gw_scatter
		}
		m := float64(rounds * halves * wgClusterRoundSteps)
		if b.forceClusterSplit {
			return s, true, m
		}
		if t := time(s) + m; t < best {
			best, bestS = t, s
		}
	}
	if bestS == 0 {
		return global()
	}
	return bestS, true, best - time(bestS)
}

// gemmSplits is how many ways the tensor-core GEMMs (gemm_h_*, gemm_wg_*,
// the fused gemm_f32, gemm_q8, gemm_q4, and w8a8_mma) split K for a launch
// of tiles 128 × 128 tiles and steps K steps where resident blocks fit on
// the device at once (two a multiprocessor, one for gemm_wg_*): as many as
// keep the launch within one wave, each split at least gemmSplitMinSteps
// steps. With few activation rows there are few tiles
// (512 rows of a 4096-row weight: 128; 16 rows: 32), and without the split
// much of the device would idle. The splits' partial products go through a
// scratch buffer that sum_splits adds up in order (w8a8_sum_splits:
// integers), so results stay deterministic; it holds at most 2·SMs tiles
// of 128 × 128 values (17 MB on 132 multiprocessors).
func gemmSplits(tiles, steps, resident int) int {
	return max(1, min(resident/tiles, steps/gemmSplitMinSteps))
}

// splits is gemmSplits within the test cap b.maxSplits: the splits of K
// launchSplit makes.
func (b *Backend) splits(tiles, steps, resident int) int {
	S := gemmSplits(tiles, steps, resident)
	if b.maxSplits > 0 {
		S = min(S, b.maxSplits)
	}
	return S
}

// gemmSplitMinSteps is the least number of K steps a GEMM split takes (its
// prologue and epilogue amortized over them).
const gemmSplitMinSteps = 4

// gemvSeg is one weight of a GEMV launch and the output it writes.
type gemvSeg struct {
	d *Buf
	l *Linear
}

// gemvEpi is what a GEMV launch fuses around its products (qtool.cu's
// GEMV_STORE, GEMV_ADD, GEMV_SWIGLU; the input's RMSNorm with weight nw and
// bias nb, streaming kernel only); send (one row, one segment, no split-K)
// sends the row to the peer-memory group whose area that is as an
// all-reduce's summand instead of storing it (MatMulAllReduce).
type gemvEpi struct {
	mode   int
	nw, nb driver.DevicePtr
	eps    float32
	send   driver.DevicePtr
}

const (
	gemvStore = iota
	gemvAdd
	gemvSwiGLU
)

// gemvPlan picks the GEMV kernel that computes the products of segs, M
// rows each, in one launch, and whether it can fuse the input's norm and
// the SwiGLU (streaming); ok is false when there is none: more rows than
// GEMVMaxRows, W8A8, weights that differ in kind, width, groups, column
// order or GEMV kernel (a 4-bit weight's scale form, Linear.szh), g_idx on
// several weights, or the split-K kernel (per-launch counters).
func (b *Backend) gemvPlan(segs []gemvSeg, M int) (name string, streaming, ok bool) {
	if len(segs) == 0 || len(segs) > 3 || M > b.opt.GEMVMaxRows {
		return "", false, false
	}
	first := segs[0].l
	for _, g := range segs {
		l := g.l
		if l.kind != first.kind || l.kind == kindW8A8 || l.in != first.in || l.gs != first.gs || l.groups != first.groups ||
			l.perm != first.perm || (len(segs) > 1 && l.gidx != 0) {
			return "", false, false
		}
	}
	total := launchRows(segs)
	name, R := b.gemvKernel(first, M, total)
	if R <= 0 {
		return "", false, false
	}
	for _, g := range segs[1:] {
		if n, _ := b.gemvKernel(g.l, M, total); n != name {
			return "", false, false
		}
	}
	return name, R == gemvStreamRowsTag, true
}

// launchRows is the output rows of a GEMV launch of segs.
func launchRows(segs []gemvSeg) int {
	n := 0
	for _, g := range segs {
		n += g.l.out
	}
	return n
}

// MatMulN implements runtime.Fused: products of up to three weights that
// share a GEMV kernel (gemvPlan) go in one launch; the rest, and every
// GEMM, one product at a time, the GEMMs sharing the input's fp16 or int8
// form.
func (b *Backend) MatMulN(dst []runtime.Buf, x runtime.Buf, ws []runtime.Linear) {
	s, segs := b.segments("MatMulN", dst, x, ws)
	if s.rows == 0 {
		return
	}
	defer b.enter()()
	b.matmulN(&gemmIn{x: s}, segs)
}

// matmulN is MatMulN on checked operands.
func (b *Backend) matmulN(in *gemmIn, segs []gemvSeg) {
	if _, _, ok := b.gemvPlan(segs, in.x.rows); ok && len(segs) > 1 {
		b.gemv(in.x, segs, gemvEpi{})
		return
	}
	if b.wgSegs(in, segs) || b.w8a8WGSegs(in, segs) || b.w8a8Segs(in, segs) {
		return
	}
	for _, g := range segs {
		b.matmul(g.d, in, g.l, false, outStore)
	}
}

// segsKernels are the Hopper GEMMs that multiply one input by up to three
// weights of their kind in one launch (qtool.cu's GEMM_WG_SEGS_ENTRY).
var segsKernels = map[string]string{"gemm_wg_f16": "gemm_wg_f16_segs", "gemm_wg_bf16": "gemm_wg_bf16_segs",
	"gemm_wg_q4": "gemm_wg_q4_segs", "gemm_wg_q8": "gemm_wg_q8_segs"}

// wgSegs runs the products segs (two or three weights sharing in: q, k and
// v) as one launch of a gemm_wg_*_segs kernel where every weight is of one
// kind that a Hopper GEMM takes for in's rows without widening, with one
// group size and no column order, and each product alone would split K
// (its tiles fill at most half the device: q, k and v of a 7B or 8B up to
// ~256 rows, or at TP=2); it reports whether it did. The launch does not
// split K: a short split pays a launch's fill and the sum of its splits
// for few steps, here paid once for the three, and their tiles run
// together (on an H200, fp16 prefill of 128 tokens ran 16 % faster on
// llama2-7b, whose 96 tiles leave a third of the device idle, and 7 % on
// llama3-8b, whose 48 leave two thirds; of 256, 10 % on llama3-8b). The
// kernel's tiles are those of the products one at a time, so the values
// are theirs unsplit. (Where one product fills the device alone, as a GQA
// model's q, the others split K beside it in less time than a second wave
// of tiles.) Where in.kv asks for it (segsKV) and the kind has one
// (segsKVKernels: fp16, 4-bit) the launch is of the _kv form, which rotates
// q and k and stores k and v into the cache; up to kvSegsMaxRows rows it is
// taken then even where the products alone would not split K (kvSegs), so
// that their values are the unsplit sums where one by one they would be
// split ones.
func (b *Backend) wgSegs(in *gemmIn, segs []gemvSeg) bool {
	M, l0 := in.x.rows, segs[0].l
	if len(segs) < 2 || len(segs) > 3 || l0.perm != 0 {
		return false
	}
	wg := b.unwidenedWG(l0, M)
	name := segsKernels[wg]
	if name == "" {
		return false
	}
	for _, g := range segs {
		if l := g.l; l.kind != l0.kind || l.in != l0.in || l.gs != l0.gs || l.groups != l0.groups || l.perm != 0 || l.gidx != 0 {
			return false
		}
	}
	mt := (M + 127) / 128
	tiles, eachSplits, _ := b.segsTiles(segs, M, (l0.in+gemmHBK-1)/gemmHBK)
	if !eachSplits && !kvSegs(in, name) {
		return false
	}
	var (
		c, sz [3]driver.DevicePtr
		n     [3]int
		maps  [3]*driver.TensorMap
	)
	var ls [3]*Linear
	for i, g := range segs {
		c[i], sz[i], n[i], maps[i] = g.d.p, g.l.sz, g.l.out, b.weightMap(wg, g.l.w, g.l)
		ls[i] = g.l
	}
	if len(segs) == 2 {
		maps[2] = maps[0] // unread: N2 = 0
	}
	shm := b.actMap(wg, b.half(in, l0), M, l0.in)
	gs, flags := max(l0.gs, gemmHBK), wgFlags(ls[:len(segs)]...)
	grid := [3]uint32{uint32(mt), uint32(tiles / mt), 1}
	var args []any
	if segsKV(in, name) { // q's output alone, k and v's shape once, the store's arguments
		name = segsKVKernels[name]
		args = append([]any{c[0], b.tmaps[0], maps[0], maps[1], maps[2], sz[0], sz[1], sz[2],
			M, n[0], n[1], l0.in, gs, l0.groups, flags}, in.kv.args()...)
		in.kv.done = true
	} else {
		args = []any{c[0], c[1], c[2], b.tmaps[0], maps[0], maps[1], maps[2], sz[0], sz[1], sz[2],
			M, n[0], n[1], n[2], l0.in, gs, l0.groups, flags, outStore}
	}
	b.raiseSmem(name, shm)
	b.launchShm(name, grid, block384, shm, args...)
	return true
}

// segsTiles is the 128 × 128 tiles of one launch of M rows by every
// weight of segs, and what the segs launches (wgSegs, w8a8WGSegs) ask of
// them: whether each product alone would split its steps K steps
// (gemmSplits: its tiles at most half the device), where such a short
// split pays a launch's fill and merge for few steps, paid once for the
// products together; and whether the one launch runs fewer waves of
// tiles, a block a multiprocessor, than a launch a product, their partial
// last waves filling one another (llama3-8b's q, k and v at 512 rows:
// 128, 32 and 32 tiles, three waves one by one and two together on 132
// multiprocessors).
func (b *Backend) segsTiles(segs []gemvSeg, M, steps int) (tiles int, eachSplits, savesWave bool) {
	mt := (M + 127) / 128
	eachSplits, apart := true, 0
	for _, g := range segs {
		t := mt * ((g.l.out + 127) / 128)
		eachSplits = eachSplits && gemmSplits(t, steps, b.sms) > 1
		tiles += t
		apart += (t + b.sms - 1) / b.sms
	}
	return tiles, eachSplits, (tiles+b.sms-1)/b.sms < apart
}

// segments checks the operands of a product of x with several weights.
func (b *Backend) segments(op string, dst []runtime.Buf, x runtime.Buf, ws []runtime.Linear) (*Buf, []gemvSeg) {
	if len(dst) != len(ws) {
		panic(fmt.Sprintf("cuda backend: %s of %d weights into %d outputs", op, len(ws), len(dst)))
	}
	s := buf(x)
	segs := make([]gemvSeg, len(ws))
	for i, w := range ws {
		d, l := buf(dst[i]), lin(w)
		if s.cols != l.in || d.cols != l.out || d.rows != s.rows || d.p == s.p {
			panic(fmt.Sprintf("cuda backend: %s [%d %d] <- [%d %d] x [%d %d]ᵀ", op, d.rows, d.cols, s.rows, s.cols, l.out, l.in))
		}
		segs[i] = gemvSeg{d, l}
	}
	return s, segs
}

// NormMatMulN implements runtime.Fused: with the streaming 4-bit GEMV the
// RMSNorm runs inside the products' launch; otherwise RMSNorm into a
// scratch buffer (fp16, where every product is a GEMM that takes fp16) and
// MatMulN.
func (b *Backend) NormMatMulN(dst []runtime.Buf, x runtime.Buf, w, bias runtime.Vector, eps float32, ws []runtime.Linear) {
	s, segs := b.segments("NormMatMulN", dst, x, ws)
	defer b.enter()()
	if b.normStreamed("NormMatMulN", s, segs, w, bias, eps, gemvStore) {
		return
	}
	b.matmulN(b.normed(s, segs, w, bias, eps), segs)
}

// normStreamed checks the width of the norm before segs and runs segs as
// one launch of the streaming 4-bit GEMV in mode with the norm fused, where
// gemvPlan allows it; it reports whether nothing is left to do (that, or
// there are no rows). The caller holds the context.
func (b *Backend) normStreamed(op string, s *Buf, segs []gemvSeg, w, bias runtime.Vector, eps float32, mode int) bool {
	if vec(w).n != s.cols {
		panic("cuda backend: " + op + " norm width")
	}
	if s.rows == 0 {
		return true
	}
	if _, streaming, ok := b.gemvPlan(segs, s.rows); ok && streaming {
		b.gemv(s, segs, gemvEpi{mode: mode, nw: vec(w).p, nb: vecPtr(bias), eps: eps})
		return true
	}
	return false
}

// normed writes RMSNorm(x) into a scratch buffer shaped like x, the input
// of the products segs: in fp16 alone where every one of them is a
// halfGEMM with the columns in order; quantized alone where every one is
// W8A8 with one quantizer, per token or static and division-free
// (actQuant.divisionFree); in fp32 otherwise.
func (b *Backend) normed(s *Buf, segs []gemvSeg, w, bias runtime.Vector, eps float32) *gemmIn {
	half, quant := true, true
	key := segs[0].l.actQuant()
	for _, g := range segs {
		half = half && b.halfGEMM(g.l, s.rows, false) && g.l.perm == 0
		quant = quant && g.l.kind == kindW8A8 && g.l.actQuant() == key && (key.dynamic || key.divisionFree())
	}
	in := &gemmIn{x: &Buf{rows: s.rows, cols: s.cols}}
	switch {
	case half:
		in.a16 = b.scratchBuf("gemm_a16", 2*s.n())
	case quant:
		in.xq, in.xqKey = b.scratchBuf("xq", s.n()), key
		if key.dynamic {
			in.tok = b.scratchBuf("xq_tok", 4*s.rows)
		}
	default:
		in.x.p = b.scratchBuf("norm_h", 4*s.n())
	}
	b.launch("rmsnorm", g1(s.rows), b.rowBlock(s.rows, s.cols), in.x.p, s.p, vec(w).p, vecPtr(bias), s.cols, eps,
		in.a16, in.xq, in.tok, key.scale, key.offset)
	return in
}

// NormSwiGLU implements runtime.Fused: one launch of the streaming 4-bit
// GEMV (norm, both products and the SwiGLU); both products in one launch
// of another GEMV, then silu_mul; otherwise RMSNorm, then on Hopper both
// products and the SwiGLU in one GEMM (gluPair), else the gate's products
// into dst and the up products with the SwiGLU in their epilogue
// (OUT_SWIGLU).
func (b *Backend) NormSwiGLU(dst, x runtime.Buf, w, bias runtime.Vector, eps float32, gate, up runtime.Linear) {
	s, segs := b.segments("NormSwiGLU", []runtime.Buf{dst, dst}, x, []runtime.Linear{gate, up})
	defer b.enter()()
	b.normSwiGLU(s, segs, w, bias, eps, inputForm{})
}

// normSwiGLU is NormSwiGLU on checked operands (segs: gate and up into
// the same output), gate and up as one GEMM where gluPair can. With q set,
// the GEMMs that can write the SwiGLU in q's form instead of into the
// output (gluPair, w8a8); it reports whether they did.
func (b *Backend) normSwiGLU(s *Buf, segs []gemvSeg, w, bias runtime.Vector, eps float32, q inputForm) bool {
	if b.normStreamed("NormSwiGLU", s, segs, w, bias, eps, gemvSwiGLU) {
		return false
	}
	return b.swiGLUFrom(b.normed(s, segs, w, bias, eps), segs, q)
}

// swiGLUFrom is normSwiGLU after the norm: segs' products (gate and up)
// of the normed input in and their SwiGLU, into segs[0].d or in q's form
// (formed).
func (b *Backend) swiGLUFrom(in *gemmIn, segs []gemvSeg, q inputForm) (formed bool) {
	d := segs[0].d
	if _, _, ok := b.gemvPlan(segs, in.x.rows); ok {
		u := b.AllocRaw(d.rows, d.cols).(*Buf)
		segs[1].d = u
		b.gemv(in.x, segs, gemvEpi{})
		b.putOut(d, u, outSwiGLU)
		b.Free(u)
		return false
	}
	if ran, formed := b.gluPair(d, in, segs[0].l, segs[1].l, q); ran {
		return formed
	}
	if b.w8a8GLU(d, in, segs[0].l, segs[1].l) {
		return false
	}
	b.matmul(d, in, segs[0].l, false, outStore)
	if up := segs[1].l; up.kind == kindW8A8 {
		return b.w8a8(d, in, up, false, outSwiGLU, q)
	}
	b.matmul(d, in, segs[1].l, false, outSwiGLU)
	return false
}

// gluKernels are the Hopper GEMMs' gate/up pair kernels (gluPair).
var gluKernels = map[string]string{"gemm_wg_f16": "gemm_wg_f16_glu", "gemm_wg_bf16": "gemm_wg_bf16_glu",
	"gemm_wg_q4": "gemm_wg_q4_glu", "gemm_wg_q8": "gemm_wg_q8_glu", "gemm_wg_s8": "gemm_wg_s8_glu"}

// gluPair runs the gate and up products of in and their SwiGLU as one
// launch of a gemm_wg_*_glu kernel, where both weights are of one kind
// that a Hopper GEMM takes for in's rows without widening (W8A8: with one
// quantizer): the SwiGLU into d, or in q's form (W8A8: int8, the float
// kinds: fp16) where q.p is set (formed; d then unwritten), and no gate
// products in memory. ran reports whether it did.
func (b *Backend) gluPair(d *Buf, in *gemmIn, gate, up *Linear, q inputForm) (ran, formed bool) {
	M, N, K := in.x.rows, gate.out, gate.in
	if up.kind != gate.kind || up.out != N || up.in != K || up.gs != gate.gs || up.groups != gate.groups ||
		up.perm != gate.perm || gate.gidx != 0 || up.gidx != 0 {
		return false, false
	}
	var wg string
	switch {
	case gate.kind == kindW8A8:
		if gate.actQuant() == up.actQuant() {
			wg = b.wgmmaKernel("w8a8_mma", M)
		}
	default:
		wg = b.unwidenedWG(gate, M)
	}
	name := gluKernels[wg]
	if name == "" || !b.gluMap(&gate.glu, wg, gate, up, 64) {
		return false, false
	}
	grid := [3]uint32{uint32((M + 127) / 128), uint32((N + 63) / 64), 1}
	upFirst := 0
	if up.w < gate.w { // plane 0 the weight at the lower address
		upFirst = 1
	}
	if gate.kind == kindW8A8 {
		if q.half {
			q = inputForm{}
		}
		xq, tok := b.quantized(in, gate)
		shm, planes := b.actMap(wg, xq, M, K), gate.glu.m
		if np := b.gluFillRows(M, N); np != 0 && b.gluMap(&gate.gluF[np/112], wg, gate, up, np) {
			name = gluFillKernels[np/112] // 88 → _f88, 112 → _f112
			grid, shm, planes = [3]uint32{uint32((M + 127) / 128), uint32((N + np - 1) / np), 1}, s8FillSmem(2*np), gate.gluF[np/112].m
		} else {
			name, grid, shm = b.wideForm(name, grid, shm, (K+127)/128, false) // K steps of 128 int8
		}
		b.raiseSmem(name, shm)
		b.launchShm(name, grid, block384, shm, append(append([]any{d.p}, q.args()...), b.tmaps[0], planes, gate.qbias, gate.deq,
			gate.bias, up.qbias, up.deq, up.bias, tok, M, N, K, upFirst)...)
		return true, q.p != 0
	}
	var h driver.DevicePtr // the SwiGLU in fp16
	if q.half {
		h = q.p
	}
	shm := b.actMap(wg, b.half(in, gate), M, K)
	name, grid, shm = b.wideForm(name, grid, shm, (K+gemmHBK-1)/gemmHBK, false)
	b.raiseSmem(name, shm)
	sz, sz2 := gate.sz, up.sz // in plane order
	if upFirst == 1 {
		sz, sz2 = sz2, sz
	}
	b.launchShm(name, grid, block384, shm, d.p, h, b.tmaps[0], gate.glu.m, sz, sz2, M, N, K, max(gate.gs, gemmHBK), gate.groups,
		wgFlags(gate, up), upFirst)
	return true, h != 0
}

// gluFillKernels are the W8A8 GLU forms of 88 and 112 rows of each weight
// a block (qtool.cu's gemm_wg_s8_glu_f88, _f112), loaded with the Hopper
// kernels.
var gluFillKernels = [2]string{"gemm_wg_s8_glu_f88", "gemm_wg_s8_glu_f112"}

// gluFillRows is the rows of each weight a block of the W8A8 GLU fill form
// takes for a pair of N outputs at M activation rows, or 0 for the usual
// forms (gluPair reaches it from dequantGEMMMinRows on). It counts a
// form's cost in block-waves: its blocks (one tile of 128 activation rows
// by np rows of each weight) over the multiprocessors, rounded up to whole
// waves, times np; the narrow form's np is 64. The fill form of 88 or 112
// rows wins where it costs less than the narrow one (the cheaper of the
// two; the narrow one on a tie), up to gluFillMaxRows activation rows; 0
// with Options.GLUFill −1 (above 0 past gluFillMaxRows too). On 132
// multiprocessors llama2-7b's 11 008 outputs take 88 rows at 128 and 256
// activation rows (126 and 252 blocks against the narrow form's 172 and
// 344) and 112 at 512 (396 against 688); llama3-8b's 14 336 take 112 at
// 128 and 256 (128 and 256 against 224 and 448) and 88 at 512 (652
// against 896). At 128 rows W8A8 prefill ran +1.3 % and +1.9–3.1 % with
// it (sixty-sixth session); at 256 and 512, against the narrow and wide
// forms, +3.4–4.6 % and +2.2–2.3 % (sixty-ninth).
func (b *Backend) gluFillRows(M, N int) int {
	if b.opt.GLUFill < 0 || M > gluFillMaxRows && b.opt.GLUFill == 0 {
		return 0
	}
	tiles := (M + 127) / 128
	cost := func(np int) int { return (tiles*((N+np-1)/np) + b.sms - 1) / b.sms * np }
	best, least := 0, cost(64)
	for _, np := range []int{88, 112} {
		if c := cost(np); c < least {
			best, least = np, c
		}
	}
	return best
}

// gluFillMaxRows is the most activation rows gluFillRows gives a fill form:
// past it the wide form's blocks may cost less than the rule counts them
// (at 1 024 rows the fill forms ran W8A8 prefill +2.7 % on llama2-7b and
// −3.0 % on llama3-8b, at 2 048 ±0 and −3.0 %; sixty-ninth session).
const gluFillMaxRows = 512

// s8FillSmem is the dynamic shared memory of an int8 fill form of nw weight
// rows a block (a GLU fill form's 2·np; qtool.cu's s8f_stage_bytes,
// S8F_STAGES, their barriers, the alignment).
func s8FillSmem(nw int) int {
	const stages = 5 // qtool.cu's S8F_STAGES
	stage := (128*128 + nw*128 + 1023) &^ 1023
	return stages*stage + 2*stages*8 + 1024
}

// s8FillKernel is the plain int8 GEMM's fill form (qtool.cu's
// gemm_wg_s8_f112: s8FillRows weight rows a block), loaded with the Hopper
// kernels.
const s8FillKernel = "gemm_wg_s8_f112"

// s8FillRows is the weight rows of a gemm_wg_s8_f112 block.
const s8FillRows = 112

// s8Fill reports whether w8a8's int8 GEMM of N outputs at M activation
// rows through steps K steps, where gemm_wg_s8's narrow blocks would run,
// takes the fill form instead: where wgEstimate says its launch takes less
// (a block's step at 112 / 128 of a narrow one's; splitPlan splits it only
// in clusters of 2 or 3, scatterOnlyKernels). Options.S8Fill −1: never;
// above 0: always (tests). On 132 multiprocessors the 4 096 outputs of o and
// down at 128 activation rows make 37 fill tiles, 111 blocks in threes
// (11 steps of 32 at 0.875 against 96 narrow blocks of 11; llama2-7b's
// down 29 of 86), and at 256 rows none (74 tiles, unsplit, against 64
// narrow ones in pairs). On an H200 (seventieth session, two rounds
// against the narrow blocks) W8A8 prefill of 128 tokens ran 1.2–2.2 %
// faster on llama2-7b and 1.1–3.2 % on llama3-8b; Nsight Compute timed o
// 14.4 µs against 14.9 and down 22.3 against 22.5 (llama2-7b), 15.3 and
// 25.7 against 15.7 and 26.4 (llama3-8b).
func (b *Backend) s8Fill(M, N, steps int) bool {
	if b.opt.S8Fill < 0 {
		return false
	}
	tiles := (M + 127) / 128
	fill := tiles * ((N + s8FillRows - 1) / s8FillRows)
	return b.opt.S8Fill > 0 ||
		b.wgEstimate(s8FillKernel, fill, steps, s8FillRows/128.0, true) < b.wgEstimate("gemm_wg_s8", tiles*((N+127)/128), steps, 1, true)
}

// gluPlanes is a 3-D tensor map of a gate weight and an up weight as two
// planes (the one at the lower address plane 0), a box rows rows of each,
// for the up weight at with.
type gluPlanes struct {
	m    *driver.TensorMap
	with driver.DevicePtr
	rows int
}

// gluMap makes sure p maps gate's and up's weights for Hopper GEMM wg's
// pair kernels in boxes of rows rows of each plane, encoded once; it
// reports false where the driver refuses it.
func (b *Backend) gluMap(p *gluPlanes, wg string, gate, up *Linear, rows int) bool {
	if p.m != nil && p.with == up.w && p.rows == rows {
		return true
	}
	lo, hi := min(gate.w, up.w), max(gate.w, up.w)
	if p.m == nil {
		p.m = driver.NewTensorMaps(1)[0]
	}
	f := weightMapFormat(wg, gate.in)
	if err := b.drv.EncodeTensorMap3D(p.m, f.dtype, lo, 2, uint64(gate.out), f.cols, f.pitch, uint64(hi-lo), 2, uint32(rows), f.box, f.swizzle); err != nil {
		p.m = nil
		return false
	}
	p.with, p.rows = up.w, rows
	return true
}

// MLP implements runtime.Fused: NormSwiGLU, then down's products added to
// x. The GEMM that makes the SwiGLU writes it in the form down's GEMM
// takes where it can (inputFor, normSwiGLU): int8 codes for a W8A8 down
// with a division-free static quantizer (actQuant.divisionFree; no fp32
// SwiGLU, no quant_act), fp16 for a down
// on the fp16 GEMMs (no to_half).
func (b *Backend) MLP(x runtime.Buf, w, bias runtime.Vector, eps float32, gate, up, down runtime.Linear) {
	g := b.AllocRaw(x.Rows(), gate.Out())
	defer b.Free(g)
	s, segs := b.segments("MLP", []runtime.Buf{g, g}, x, []runtime.Linear{gate, up})
	_, dseg := b.segments("MLP", []runtime.Buf{x}, g, []runtime.Linear{down})
	if s.rows == 0 {
		return
	}
	defer b.enter()()
	q := b.inputFor(dseg[0].l, s.rows)
	if b.normSwiGLU(s, segs, w, bias, eps, q) {
		b.matmul(s, q.input(s.rows, down.In()), dseg[0].l, false, outAdd)
		return
	}
	b.matmul(s, &gemmIn{x: buf(g)}, dseg[0].l, false, outAdd)
}

// MatMulAdd implements runtime.Fused: the GEMV kernels and the GEMMs add
// their sums to dst; the split-K GEMV goes through a temporary.
func (b *Backend) MatMulAdd(dst, x runtime.Buf, w runtime.Linear) {
	s, segs := b.segments("MatMulAdd", []runtime.Buf{dst}, x, []runtime.Linear{w})
	if s.rows == 0 {
		return
	}
	defer b.enter()()
	b.matmul(segs[0].d, &gemmIn{x: s}, segs[0].l, false, outAdd)
}

// gemv launches the GEMV kernel of segs[0]'s weight for all of segs (one
// segment unless gemvPlan allowed more; gate and up for gemvSwiGLU): the
// kernels take up to three (output, weight, scales, rows, blocks) segments,
// see qtool.cu's GemvSeg.
func (b *Backend) gemv(s *Buf, segs []gemvSeg, epi gemvEpi) {
	l := segs[0].l
	M, K := s.rows, l.in
	nrows := launchRows(segs)
	name, R := b.gemvKernel(l, M, nrows)
	if R != gemvStreamRowsTag { // the streaming kernel gathers x itself
		s = b.permuted(s, l.perm)
	}
	if R <= 0 { // split-K kernel with -R rows per warp, one weight, stored
		if epi.send != 0 {
			panic("cuda backend: " + name + " sends no all-reduce summands")
		}
		N := l.out
		d := segs[0].d
		nks := (K + 1023) / 1024 // gemv_q4_sh: 32 lanes × 32 k a block
		tiles := (N + 8*(-R) - 1) / (8 * (-R))
		part := b.scratchBuf("gemv_part", 4*nks*M*N)
		cnt := b.zeroedScratch("gemv_cnt", 4*tiles*M)
		b.launch(name, [3]uint32{uint32(tiles), uint32(nks), uint32(M)}, block256, d.p, s.p, l.w, l.sz, part, cnt, N, K, l.gs, l.groups)
		return
	}
	rows, splits, shm := b.gemvShape(name, R, l, M, nrows)
	var in rowSums // x's sums of squares from its producer (rowsums.go)
	if R == gemvStreamRowsTag {
		k, _ := streamKernelOf(name)
		if in = b.sumsIn(s); in.p != 0 && epi.nw != 0 && l.perm == 0 && k.sumsTwin {
			name += "_n"
		} else {
			in = rowSums{}
		}
		b.raiseSmem(name, shm)
	}
	var seg [3]struct {
		y, w, sz driver.DevicePtr
		n, nb    int
	}
	blocks := 0
	for i, g := range segs {
		seg[i].w, seg[i].sz, seg[i].n = g.l.w, g.l.sz, g.l.out
		if R == gemvStreamRowsTag && g.l.szh != 0 {
			seg[i].sz = g.l.szh
		}
		seg[i].y = g.d.p
		seg[i].nb = (g.l.out + rows - 1) / rows
		blocks += seg[i].nb
	}
	if epi.mode == gemvSwiGLU { // a block covers rows/2 outputs of gate and up
		seg[0].nb = (l.out + rows/2 - 1) / (rows / 2)
		seg[1].nb, seg[1].y = 0, 0
		blocks = seg[0].nb
	}
	segArgs := []any{seg[0].y, seg[0].w, seg[0].sz, seg[0].n, seg[0].nb, seg[1].y, seg[1].w, seg[1].sz, seg[1].n, seg[1].nb,
		seg[2].y, seg[2].w, seg[2].sz, seg[2].n}
	grid := [3]uint32{uint32(blocks), uint32(M), uint32(splits)}
	if R == gemvStreamRowsTag {
		var yss driver.DevicePtr // the residual's sums of squares
		if epi.mode == gemvAdd && epi.send == 0 {
			yss = b.sumsOut(segs[0].d, blocks)
		}
		args := []any{s.p, in.p, in.n, stagedPerm(l), K, l.gs, l.groups, epi.nw, epi.nb, epi.eps, epi.mode, yss, epi.send}
		if splits > 1 { // each block's part of its rows' sums but the last split's, which adds them
			args = append(args, b.filledScratch("gemv_split_part", 4*(splits-1)*M*blocks*rows, partEmpty))
		}
		b.launchShm(name, grid, block256, shm, append(args, segArgs...)...)
		b.wroteSums(segs[0].d, yss, blocks)
		return
	}
	if epi.nw != 0 || epi.mode == gemvSwiGLU {
		panic("cuda backend: " + name + " fuses no norm or SwiGLU")
	}
	b.launch(name, grid, block256, append([]any{s.p, l.gidx, K, l.gs, l.groups, epi.mode, epi.send}, segArgs...)...)
}

// attrMaxDynSmem is CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES.
const attrMaxDynSmem = 8

// raiseSmem lets kernel name use shm bytes of dynamic shared memory (the
// driver's default limit is 48 KB minus the kernel's static shared memory).
func (b *Backend) raiseSmem(name string, shm int) {
	b.must(b.trySmem(name, shm))
}

// trySmem is raiseSmem that returns the driver's refusal.
func (b *Backend) trySmem(name string, shm int) error {
	if b.dynSmem[name] >= shm {
		return nil
	}
	if err := b.drv.SetFuncAttribute(b.fn[name], attrMaxDynSmem, shm); err != nil {
		return err
	}
	b.dynSmem[name] = shm
	return nil
}

// gemvStreamMaxSmem bounds the streaming GEMV's staged activation row
// (gemvStream); wider inputs take the split-K gemv_q4_sh.
const gemvStreamMaxSmem = 96 << 10

// gemvStream reports the streaming GEMV's dynamic shared memory (the
// staged activation row: 2 bytes a feature, 6 with a column order to gather
// by) and whether it can run l: 4 or 8 bits, no g_idx, width and group
// size multiples of 32, the row within gemvStreamMaxSmem. (The fixed-point
// kernels' chunk figures and the rings of gemv_q4_w4a and gemv_q8_w4a and
// their _pc forms come on top, streamSmem; those kernels run K ≤ 4096
// alone, 66 560 bytes at most: gemv_q4_w4a with a column order.)
func gemvStream(l *Linear) (shm int, ok bool) {
	shm = stagedBytes(l, l.in)
	ok = (l.kind == kindQ4 || l.kind == kindQ8) && l.gidx == 0 && l.in%32 == 0 && l.gs%32 == 0 && shm <= gemvStreamMaxSmem
	return shm, ok
}

// gemvShape is the shape of a launch of GEMV kernel name on l, R being
// gemvKernel's answer (not the split-K kernel's), over M rows of x and
// rows output rows (l's and those of the weights sharing the launch): the
// output rows a block, the blocks each block of rows is split into along
// K (a split form's, gemvSplits; else 1) and the dynamic shared memory (a
// split form stages its run of the row alone, splitRun).
func (b *Backend) gemvShape(name string, R int, l *Linear, M, rows int) (blockRows, splits, shm int) {
	if R != gemvStreamRowsTag {
		return R, 1, 0
	}
	k, _ := streamKernelOf(name)
	splits, features := 1, l.in
	if k.split {
		splits = b.gemvSplits(l, M, rows)
		features = splitRun(l, splits)
	}
	return k.rows, splits, streamSmemRun(name, l, features)
}

// streamKernel is what launching and choosing a streaming GEMV kernel
// (qtool.cu's GEMVW_ENTRY instances of gemvw_body) needs to know of it.
type streamKernel struct {
	rows int // output rows a block: 8 warps × R
	// chunk: the features one {scale, Σq} of the staged x covers where x is
	// staged in 16-bit fixed point and multiplied on dp4a (fx_unit: 32 for
	// the 4-bit kernels, 16 for the 8-bit ones); 0 where x is staged in
	// fp16
	chunk int
	// ring: the bytes of its ring in shared memory (ASYNC: D·R·256 slots a
	// block of a 16-byte weight word and its {scale, zero}, 4 bytes in the
	// half form Linear.szh, 8 as floats); 0 where the ring is in registers
	ring int
	// sumsTwin: it has an _n twin that takes its input's sums of squares
	// from the producer (rowsums.go)
	sumsTwin bool
	// pcForm: it has a _pc form for weights of one group a row, of the same
	// shape, with its own _n twin where it has one (perChannelForm)
	pcForm bool
	// splitForm: it (and its _pc form) has a split form, _k, for 8-bit
	// rows longer than 4 096 features (gemvSplits)
	splitForm bool
	// split: this is a _k form (streamKernelOf's answer only)
	split bool
}

// streamKernels are the streaming GEMV kernels by name (their _pc forms
// and _n twins under their own).
var streamKernels = map[string]streamKernel{
	"gemv_q4_w2h":     {rows: 16, sumsTwin: true, pcForm: true},
	"gemv_q4_w2h_s32": {rows: 16, sumsTwin: true},
	"gemv_q4_w4h":     {rows: 32, chunk: 32, sumsTwin: true, pcForm: true},
	"gemv_q4_w4a":     {rows: 32, chunk: 32, ring: 2 * 4 * 256 * (16 + 4), sumsTwin: true, pcForm: true},
	"gemv_q8_w2h":     {rows: 16, chunk: 16, pcForm: true},
	"gemv_q8_w4h":     {rows: 32, chunk: 16, pcForm: true, splitForm: true},
	"gemv_q8_w4a":     {rows: 32, chunk: 16, ring: 2 * 4 * 256 * (16 + 8), pcForm: true},
}

// streamKernelOf is streaming GEMV kernel name's entry (a _pc form's, an
// _n twin's or a _k form's its base's; a _k form has no _n twin);
// ok is false for the other GEMV kernels.
func streamKernelOf(name string) (k streamKernel, ok bool) {
	base, split := strings.CutSuffix(name, "_k")
	k, ok = streamKernels[strings.TrimSuffix(strings.TrimSuffix(base, "_n"), "_pc")]
	if split {
		k.split, k.sumsTwin = true, false
	}
	return k, ok
}

// StreamingGEMV reports whether GEMV kernel name (GEMVKernel's answer) is a
// streaming one: those run the norm before a product and the SwiGLU after
// gate/up inside the product (runtime.Fused), the others beside it.
func StreamingGEMV(name string) bool {
	_, ok := streamKernelOf(name)
	return ok
}

// streamSmem is the dynamic shared memory of streaming GEMV name (or its
// _n twin) on l's weight: the staged x (gemvStream); where x is in fixed
// point 8 bytes of scale and sum after it a chunk (streamKernel.chunk); the
// ring in shared memory, if any, after those at a 16-byte boundary.
func streamSmem(name string, l *Linear) int {
	return streamSmemRun(name, l, l.in)
}

// streamSmemRun is streamSmem where the staged x holds features of the row
// (a split form's run, splitRun).
func streamSmemRun(name string, l *Linear, features int) int {
	k, _ := streamKernelOf(name)
	shm := stagedBytes(l, features)
	if k.chunk != 0 {
		shm += 8 * features / k.chunk
	}
	if k.ring != 0 {
		shm = (shm+15)&^15 + k.ring
	}
	return shm
}

// stagedBytes is the streaming GEMVs' staged x for features of l's row: 2
// bytes a feature, 6 with a column order to gather by (the row's copy in
// fp32 after the staged form).
func stagedBytes(l *Linear, features int) int {
	if l.perm != 0 {
		return 6 * features
	}
	return 2 * features
}

// gemvFixedPoint reports whether GEMV kernel name stages x in 16-bit fixed
// point and multiplies on dp4a (streamKernel.chunk: the 32-row 4-bit
// kernels and the 8-bit streaming ones) rather than in fp16 (gemv_q4_w2h,
// gemv_q4_sh) or fp32. The forms' results differ by the fp16 form's
// rounding (TestMatMul: relative errors 1e-5 against 3e-4 to 5e-4), so a
// product gives the same bits through MatMul and MatMulN only where both
// launches run the same form.
func gemvFixedPoint(name string) bool {
	k, _ := streamKernelOf(name)
	return k.chunk != 0
}

// gemvWide picks the 32-row streaming kernel of l's kind for a launch of
// blocks: async (the ring in shared memory: registers allow three blocks a
// multiprocessor, the shared memory decides) or reg (the ring in registers,
// two blocks) as regRing rules, and always reg with Options.NoAsyncGEMV.
func (b *Backend) gemvWide(l *Linear, blocks int, async, reg string) string {
	if b.opt.NoAsyncGEMV {
		return reg
	}
	if slots := b.residentBlocks(async, streamSmem(async, l)); slots > 2 && (b.asyncEverywhere || !regRing(l.kind, blocks, slots, b.sms)) {
		return async
	}
	return reg
}

// regRingWaveMargin is how much fuller (waveFill) the last wave of an
// 8-bit 32-row launch must be at the register ring's two blocks a
// multiprocessor than at the shared-memory ring's for regRing to pick the
// register ring.
const regRingWaveMargin = 0.15

// regRing reports whether a launch of blocks 32-row blocks of a weight of
// kind runs on the ring in registers (two blocks a multiprocessor) rather
// than the one in shared memory (asyncSlots blocks a multiprocessor, sms
// multiprocessors): where the shared-memory ring fits no more blocks, and
// for an 8-bit weight where the register ring's last wave is fuller by more
// than regRingWaveMargin; never else for a 4-bit one. BenchmarkGEMVWaves on
// an H200 (K = 4096, 6 144 to 28 672 rows; kernels/NOTES.md, forty-fourth
// session): the 4-bit shared-memory ring was as fast (6 144, 8 448 rows)
// or 4 to 30 points of copy bandwidth faster elsewhere; the 8-bit one 5 to
// 9 points slower at 8 448, 14 336 and 16 896 rows (a last wave two thirds
// full or less at three blocks, fuller at two), as fast at 6 144 (the
// same waves: the rule's register ring read 1.3 points less there), faster
// elsewhere, by 5 points at 28 672 rows whose last wave the register ring
// fills better by 0.09 (TestRegRing).
func regRing(kind, blocks, asyncSlots, sms int) bool {
	switch {
	case asyncSlots <= 2:
		return true
	case kind == kindQ4:
		return false
	}
	return waveFill(blocks, 2*sms) > waveFill(blocks, asyncSlots*sms)+regRingWaveMargin
}

// residentBlocks is the blocks of 256 threads of kernel name with shm
// bytes of dynamic shared memory one multiprocessor holds at once (it
// raises the kernel's dynamic shared memory limit to shm). It is also
// called outside a launch (GEMVKernel, exchangeFormOn); an _n twin's limit
// is raised at its launch (gemv).
func (b *Backend) residentBlocks(name string, shm int) int {
	k := residentKey{name, shm}
	n, ok := b.resident[k]
	if !ok {
		defer b.enter()()
		b.raiseSmem(name, shm)
		var err error
		n, err = b.drv.MaxActiveBlocks(b.fn[name], 256, shm)
		b.must(err)
		b.resident[k] = n
	}
	return n
}

// residentKey is a kernel and its dynamic shared memory.
type residentKey struct {
	name string
	shm  int
}

// waveFill is the share of the block slots of a launch's last wave (and
// every earlier one) its blocks take, slots blocks running at once.
func waveFill(blocks, slots int) float64 {
	waves := (blocks + slots - 1) / slots
	return float64(blocks) / float64(waves*slots)
}

// gemvStreamRowsTag is gemvKernel's rows-per-block answer for the streaming
// kernels (their rows per block come from streamKernels).
const gemvStreamRowsTag = 1 << 29

// gemvKernels are the GEMV kernels the dispatcher selects (gemvKernel), the
// only ones in the embedded PTX; kernels/NOTES.md has the measurements
// behind the choice and the commit that still holds the variants that lost.
//
//	weight         rule                                        kernel          launch
//	f32            always                                      gemv_f32_r4u1   4 rows a block
//	f16, bf16      always                                      gemv_*_r4u2     4 rows a block
//	q8             streamable (gemvStream), K ≤ 4096,          gemv_q8_w4a     32 rows a block, x staged
//	               ≥ 40 rows a multiprocessor in the launch,                   in fixed point, the ring
//	               3 blocks a multiprocessor fit, the last                     in shared memory
//	               wave at 2 no fuller by over 0.15 (regRing)
//	q8             the same, that wave fuller at 2, or         gemv_q8_w4h     32 rows a block, the same,
//	               2 blocks fit                                                the ring in registers
//	q8             streamable, K ≤ 4096                        gemv_q8_w2h     16 rows a block, the same
//	q8             streamable, K > 4096, no column order       gemv_q8_w4h_k   gemv_q8_w4h's 32 rows split
//	               (gemvSplits: the fullest waves over                         along K over 2–4 blocks, the
//	               2–4 splits)                                                 last adding the parts
//	q8             otherwise (g_idx, width or group)           gemv_q8_r4u1    4 rows a block
//	q4             streamable (gemvStream), K ≤ 4096,          gemv_q4_w4a     32 rows a block, x staged,
//	               ≥ 40 rows a multiprocessor in the launch,                   the ring in shared memory
//	               3 blocks a multiprocessor fit (regRing)
//	q4             the same, 2 blocks fit                      gemv_q4_w4h     32 rows a block, x staged
//	q4             other streamable                            gemv_q4_w2h     16 rows a block, x staged
//	q4             g_idx, width or group not a multiple of 32  gemv_q4_sh      split-K, 8 rows a warp
//	q4             fp32 scales (no Linear.szh), otherwise      gemv_q4_w2h_s32 16 rows a block, x staged
//	               streamable
//
// Where a weight has one group a row (per-channel scales), each streaming
// kernel above but gemv_q4_w2h_s32 runs as its _pc form (perChannelForm),
// which loads the row's {scale, zero} once (a _k form as _pc_k). The 4-bit streaming kernels
// but the _s32 twins read the scales' half form (Linear.szh), the 8-bit
// ones {scale, zero} floats (Linear.sz). The 8-bit ones and the 32-row
// 4-bit ones (gemv_q4_w4a, gemv_q4_w4h) stage x in fixed point and
// multiply on dp4a, the others in fp16 (gemvFixedPoint). A streaming
// kernel with a norm whose input's sums of squares the previous launch
// wrote (rowsums.go) runs as its _n twin. The fp32 scales (msmodelslim
// W4A16, FP32Scales) keep to one kernel: the wider kernels' twins would
// add ~430 KB of PTX an architecture for a rarer form.
var gemvKernels = []string{"gemv_f32_r4u1", "gemv_f16_r4u2", "gemv_bf16_r4u2", "gemv_q8_r4u1",
	"gemv_q8_w4a", "gemv_q8_w4h", "gemv_q8_w2h", "gemv_q8_w4a_pc", "gemv_q8_w4h_pc", "gemv_q8_w2h_pc",
	"gemv_q4_w4a", "gemv_q4_w4h", "gemv_q4_w2h", "gemv_q4_w4a_n", "gemv_q4_w4h_n", "gemv_q4_w2h_n",
	"gemv_q4_w4a_pc", "gemv_q4_w4h_pc", "gemv_q4_w2h_pc", "gemv_q4_w4a_pc_n", "gemv_q4_w4h_pc_n", "gemv_q4_w2h_pc_n",
	"gemv_q4_w2h_s32", "gemv_q4_w2h_s32_n", "gemv_q4_sh",
	"gemv_q8_w4h_k", "gemv_q8_w4h_pc_k"}

// GEMVKernel names the GEMV kernel a product of M activation rows with w
// runs (see gemvKernels), for reports.
func (b *Backend) GEMVKernel(w runtime.Linear, M int) string {
	if l := lin(w); l.kind != kindW8A8 {
		name, _ := b.gemvKernel(l, M, l.out)
		return name
	}
	return "w8a8_gemm"
}

// gemvKernel picks the GEMV kernel of l (see gemvKernels) for a launch of
// rows output rows (l's and those of the weights it shares the launch
// with) and its launch shape: rows per block, gemvStreamRowsTag for the
// streaming kernels, or minus the rows per warp for the split-K one.
func (b *Backend) gemvKernel(l *Linear, M, rows int) (string, int) {
	switch l.kind {
	case kindF32:
		return "gemv_f32_r4u1", 4
	case kindF16:
		return "gemv_f16_r4u2", 4
	case kindBF16:
		return "gemv_bf16_r4u2", 4
	case kindQ8:
		// the streaming kernels up to K = 4096, their split form beyond
		// (gemvSplits; gemv_q8_w2h's ring lost to gemv_q8_r4u1 on a longer
		// row: kernels/NOTES.md, thirty-seventh session)
		if _, ok := gemvStream(l); ok {
			if l.in > 4096 && l.perm == 0 {
				return perChannelForm("gemv_q8_w4h", l) + "_k", gemvStreamRowsTag
			}
			if l.in <= 4096 {
				return b.gemvStreaming(l, M, rows, "gemv_q8_w4a", "gemv_q8_w4h", "gemv_q8_w2h"), gemvStreamRowsTag
			}
		}
		return "gemv_q8_r4u1", 4
	case kindQ4:
		if _, ok := gemvStream(l); !ok {
			return "gemv_q4_sh", -8
		}
		if l.szh == 0 {
			return "gemv_q4_w2h_s32", gemvStreamRowsTag
		}
		return b.gemvStreaming(l, M, rows, "gemv_q4_w4a", "gemv_q4_w4h", "gemv_q4_w2h"), gemvStreamRowsTag
	}
	panic(fmt.Sprintf("cuda backend: no GEMV for weight kind %d", l.kind))
}

// gemvStreaming picks one of l's kind's streaming kernels for a launch of
// rows output rows of l (with the rows of the weights it shares the launch
// with), in the form for l's scales (perChannelForm): a 32-row one (async,
// the ring in shared memory, or reg, in registers: gemvWide) up to K = 4096
// from 40 rows a multiprocessor, else the 16-row one, narrow. (A TP=2
// rank's q/k/v, 6 144 rows, decodes faster on the 32-row kernels than on
// the 16-row one: kernels/NOTES.md, twenty-eighth session. At 4 096 rows
// the 32-row shared-memory ring is the faster alone, 4-bit 49 % of copy
// against 42 %, and the slower in decode, where o's 16-row blocks start
// beside the attention's: from 24 rows a multiprocessor, graph decode lost
// 3.1 % (w4a16) and 2.2 % (w8a16) on llama2-7b, 1.7 % and 2.6 % on
// llama3-8b; forty-fifth session.) Backend.streamRows sets the rows a
// block instead of the launch's rows (BenchmarkGEMVWaves).
func (b *Backend) gemvStreaming(l *Linear, M, rows int, async, reg, narrow string) string {
	if l.in <= 4096 && (b.streamRows == 32 || b.streamRows == 0 && rows >= 40*b.sms) {
		return b.gemvWide(l, M*((rows+31)/32), perChannelForm(async, l), perChannelForm(reg, l))
	}
	return perChannelForm(narrow, l)
}

// gemvMaxSplits bounds the blocks a split form divides a block of rows'
// product among (gemvSplits).
const gemvMaxSplits = 4

// gemvSplits is the blocks each block of 32 rows is split into along K by
// the split form (_k) of gemv_q8_w4h (or of its _pc form), which runs an
// 8-bit weight of K > 4 096 without column order (gemvKernel), in a launch
// of rows output rows:
// of 2 to gemvMaxSplits (every run of chunks non-empty) the count whose
// waves of two blocks a multiprocessor are fullest, the fewest where they
// tie. Down's 4 096 rows of 11 008 or 14 336 features are 128 blocks of 32
// rows; on the H200's 132 multiprocessors unsplit they ran on gemv_q8_r4u1
// at 62–67 % of copy; split in 2 (256 blocks, one wave) they read 71–78 %,
// in 3 (1.45 waves) 60–65 %, in 4 (1.94) 66–74 %. The ring in shared memory
// (gemv_q8_w4a's) split read 54–65 %, and the 4-bit kernels split 44–60 %
// against gemv_q4_w2h's 57–62 %: those have no split forms
// (kernels/NOTES.md, forty-first session).
func (b *Backend) gemvSplits(l *Linear, M, rows int) (splits int) {
	nch := (l.in + gemvSplitChunk - 1) / gemvSplitChunk
	best := -1.0
	for s := 2; s <= gemvMaxSplits; s++ {
		if (s-1)*((nch+s-1)/s) >= nch { // a run would be empty
			continue
		}
		if f := waveFill(M*((rows+31)/32)*s, 2*b.sms); f > best {
			best, splits = f, s
		}
	}
	return splits
}

// partEmpty is qtool.cu's PART_EMPTY: the word a split form's part area
// (filledScratch) holds where no part waits to be added.
const partEmpty = 0xffffffff

// gemvSplitChunk is the features of a chunk of an 8-bit row in the
// streaming kernels: 32 lanes' 16 bytes of codes.
const gemvSplitChunk = 32 * 16

// splitRun is the features of the longest run of chunks of l's rows split
// in splits (what a split form's block stages of x).
func splitRun(l *Linear, splits int) int {
	nch := (l.in + gemvSplitChunk - 1) / gemvSplitChunk
	return min(l.in, (nch+splits-1)/splits*gemvSplitChunk)
}

// perChannelForm is streaming kernel name's _pc form where l has one group a
// row (per-channel scales), else name. The _pc forms load a row's {scale,
// zero} once, not with every chunk: with every chunk, the 32 lanes' loads
// of one address held per-channel weights at 51 % of copy on gemv_q8_w4a
// and 45 % on gemv_q4_w4a (11008×4096), against 81–82 % and 71 % on their
// _pc forms, and 54–75 % on the register-ring kernels against 62–81 %
// (kernels/NOTES.md, thirty-ninth session).
func perChannelForm(name string, l *Linear) string {
	if streamKernels[name].pcForm && l.groups == 1 {
		return name + "_pc"
	}
	return name
}
