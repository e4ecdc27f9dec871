package cuda

import (
	"errors"
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"regexp"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	"qtool/formats/model"
	"qtool/kernels"
	"qtool/runtime"
	"qtool/runtime/cuda/driver"
)

// newTestBackend opens the GPU or skips the test.
func newTestBackend(t testing.TB) *Backend {
	t.Helper()
	return newTestDevice(t, 0)
}

// newTestDevice is newTestBackend on GPU d.
func newTestDevice(t testing.TB, d int) *Backend {
	t.Helper()
	b, err := NewDevice(d)
	if errors.Is(err, ErrNoDriver) {
		t.Skip("no CUDA driver found: skipping GPU kernel tests")
	}
	if err != nil {
		t.Fatalf("cuda.New: %v", err)
	}
	t.Cleanup(func() {
		noteTestKernels(b)
		if err := b.Close(); err != nil {
			t.Errorf("Close: %v", err)
		}
	})
	t.Logf("device: %s", b.Name())
	return b
}

func TestNoDriverError(t *testing.T) {
	_, err := New()
	if err == nil {
		t.Skip("a CUDA driver is present")
	}
	if errors.Is(err, ErrNoDriver) && !strings.HasPrefix(err.Error(), "no CUDA driver found") {
		t.Errorf("error %q does not start with %q", err, "no CUDA driver found")
	}
}

// poisoned allocates a buffer filled with NaN, so unwritten outputs show.
func poisoned(b *Backend, rows, cols int) *Buf {
	x := b.Alloc(rows, cols).(*Buf)
	defer b.enter()()
	if rows*cols > 0 {
		b.must(b.drv.MemsetD32Async(x.p, 0x7fc00000, uint64(rows*cols), b.stream))
	}
	return x
}

func upload(b *Backend, rows, cols int, v []float32) *Buf {
	x := b.Alloc(rows, cols).(*Buf)
	b.Upload(x, v)
	return x
}

func download(b *Backend, x runtime.Buf) []float32 {
	out := make([]float32, x.Rows()*x.Cols())
	b.Download(out, x)
	return out
}

func randVec(r *rand.Rand, n int, a float64) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32((2*r.Float64() - 1) * a)
	}
	return v
}

// relErr is ‖got − want‖ / ‖want‖; any non-finite output or reference
// value (a GPU reference left unwritten) is an error.
func relErr(got []float32, want []float64) (float64, error) {
	if len(got) != len(want) {
		return 0, fmt.Errorf("%d values, want %d", len(got), len(want))
	}
	var num, den float64
	for i, g := range got {
		if math.IsNaN(float64(g)) || math.IsInf(float64(g), 0) {
			return 0, fmt.Errorf("element %d = %v (not written or overflowed)", i, g)
		}
		if math.IsNaN(want[i]) || math.IsInf(want[i], 0) {
			return 0, fmt.Errorf("reference element %d = %v (not written or overflowed)", i, want[i])
		}
		d := float64(g) - want[i]
		num += d * d
		den += want[i] * want[i]
	}
	if den == 0 {
		return math.Sqrt(num), nil
	}
	return math.Sqrt(num / den), nil
}

func checkClose(t *testing.T, what string, got []float32, want []float64, tol float64) {
	t.Helper()
	e, err := relErr(got, want)
	if err != nil {
		t.Fatalf("%s: %v", what, err)
	}
	if e > tol {
		t.Errorf("%s: relative error %.3g > %.3g", what, e, tol)
	} else {
		t.Logf("%s: relative error %.3g (tol %.1g)", what, e, tol)
	}
}

// weightCase builds a random weight and its float64 dequantized values.
type weightCase struct {
	name string
	k    int // input features this case needs (0: default)
	make func(r *rand.Rand, n, k int) (model.Tensor, []float64)
	// tall: rows a multiprocessor added (rowsFor) for the wide streaming
	// GEMVs (64: gemv_q4_w4a or gemv_q8_w4a, the ring in shared memory;
	// tallRegRing: gemv_q4_w4h or gemv_q8_w4h, the ring in registers, in
	// the tests that useRing)
	tall int
}

// tallRegRing is weightCase.tall for the 32-row kernels' ring in
// registers: an 8-bit weight's waves of blocks are fuller there at M = 1
// (regRing); a 4-bit weight takes it only with Options.NoAsyncGEMV.
const tallRegRing = 112

// rowsFor is the output rows a test gives wc's weight: base, plus wc.tall
// per multiprocessor.
func rowsFor(b *Backend, wc weightCase, base int) int {
	return base + wc.tall*b.sms
}

// useRing makes b's 32-row GEMVs run on the ring wc's rows are for, until
// the next call or t's end: the one in registers for a case of
// tallRegRing rows (Options.NoAsyncGEMV: gemvWide gives it no 4-bit weight
// otherwise; at M = 3 an 8-bit one neither), else the one gemvWide picks.
func useRing(t testing.TB, b *Backend, wc weightCase) {
	b.opt.NoAsyncGEMV = wc.tall == tallRegRing
	t.Cleanup(func() { b.opt.NoAsyncGEMV = false })
}

// uploadCase uploads a weight of case wc, N rows of K, on the ring its rows
// are for (useRing), and returns it with its values in float64.
func uploadCase(t *testing.T, b *Backend, r *rand.Rand, wc weightCase, N, K int) (runtime.Linear, []float64) {
	t.Helper()
	useRing(t, b, wc)
	w, wf := wc.make(r, N, K)
	lw, err := b.UploadLinear(wc.name, w)
	if err != nil {
		t.Fatalf("%s: upload: %v", wc.name, err)
	}
	return lw, wf
}

func denseCase(dt model.DType) func(r *rand.Rand, n, k int) (model.Tensor, []float64) {
	return func(r *rand.Rand, n, k int) (model.Tensor, []float64) {
		v := randVec(r, n*k, 0.5)
		want := make([]float64, n*k)
		data := make([]byte, n*k*dt.Size())
		for i, x := range v {
			switch dt {
			case model.F16:
				h := model.Float32ToF16(x)
				data[2*i], data[2*i+1] = byte(h), byte(h>>8)
				want[i] = float64(model.F16ToFloat32(h))
			case model.BF16:
				h := model.Float32ToBF16(x)
				data[2*i], data[2*i+1] = byte(h), byte(h>>8)
				want[i] = float64(model.BF16ToFloat32(h))
			default:
				u := math.Float32bits(x)
				data[4*i], data[4*i+1], data[4*i+2], data[4*i+3] = byte(u), byte(u>>8), byte(u>>16), byte(u>>24)
				want[i] = float64(x)
			}
		}
		d, err := model.NewDense(dt, []int{n, k}, data)
		if err != nil {
			panic(err)
		}
		return d, want
	}
}

// quantCase makes a random *model.Quantized. zero: 0 none, 1 integer, 2 fractional.
func quantCase(bits, gs, zero int, gidx bool) func(r *rand.Rand, n, k int) (model.Tensor, []float64) {
	return func(r *rand.Rand, n, k int) (model.Tensor, []float64) {
		q := &model.Quantized{Bits: bits, GroupSize: gs, Rows: n, Cols: k, Q: make([]int8, n*k)}
		G := q.Groups()
		off := q.Offset()
		lo := -off
		if zero == 0 && bits == 8 {
			lo = -127 // Kuiper symmetric int8
		}
		for i := range q.Q {
			q.Q[i] = int8(lo + r.IntN(off-lo))
		}
		q.Scale = make([]float32, n*G)
		for i := range q.Scale {
			q.Scale[i] = float32(0.01 + 0.02*r.Float64())
		}
		if zero > 0 {
			q.Zero = make([]float32, n*G)
			for i := range q.Zero {
				if zero == 1 {
					q.Zero[i] = float32(-off + r.IntN(2*off))
				} else {
					q.Zero[i] = float32((2*r.Float64() - 1) * 3)
				}
			}
		}
		if gidx {
			q.GIdx = make([]int32, k)
			for c := range q.GIdx {
				q.GIdx[c] = int32(c / gs)
			}
			r.Shuffle(k, func(i, j int) { q.GIdx[i], q.GIdx[j] = q.GIdx[j], q.GIdx[i] })
		}
		return q, quantWant(q)
	}
}

// halfScaled is mk with every scale rounded to fp16, as AutoAWQ, GPTQ and
// ak48 checkpoints store them: a 4-bit weight's decode GEMVs read its
// scales in the half form (Linear.szh).
func halfScaled(mk func(r *rand.Rand, n, k int) (model.Tensor, []float64)) func(r *rand.Rand, n, k int) (model.Tensor, []float64) {
	return func(r *rand.Rand, n, k int) (model.Tensor, []float64) {
		w, _ := mk(r, n, k)
		q := w.(*model.Quantized)
		for i, s := range q.Scale {
			q.Scale[i] = model.RoundF16(s)
		}
		return q, quantWant(q)
	}
}

// rowScaled is mk with the scales of every every-th row (every row for 1)
// times f: an 8-bit weight with scales below fp16's normal range (f =
// 2^−12 on quantCase's 0.01…0.03) is not q8Normal, and the tensor-core
// GEMMs make its fragments in the exponent-moved form (q8_half), its
// ordinary rows too.
func rowScaled(mk func(r *rand.Rand, n, k int) (model.Tensor, []float64), every int, f float32) func(r *rand.Rand, n, k int) (model.Tensor, []float64) {
	return func(r *rand.Rand, n, k int) (model.Tensor, []float64) {
		w, _ := mk(r, n, k)
		q := w.(*model.Quantized)
		G := q.Groups()
		for row := 0; row < n; row += every {
			for g := range G {
				q.Scale[row*G+g] *= f
			}
		}
		return q, quantWant(q)
	}
}

// quantWant is q's dequantized values.
func quantWant(q *model.Quantized) []float64 {
	f, err := q.Float32()
	if err != nil {
		panic(err)
	}
	want := make([]float64, len(f))
	for i, x := range f {
		want[i] = float64(x)
	}
	return want
}

// TestHalfScales checks which 4-bit weights get their scales in the half
// form as well (one word a group, Linear.szh): those whose every scale is
// an fp16 value.
func TestHalfScales(t *testing.T) {
	for _, c := range []struct {
		name   string
		scales []float32
		want   bool
	}{
		{"fp16 values", []float32{0.5, 0.0078125, model.F16ToFloat32(0x3c01), 65504, 0x1p-24}, true},
		{"none", nil, true},
		{"an fp32 value", []float32{0.5, 0.1}, false},
		{"beyond fp16", []float32{65520}, false},
		{"below fp16's subnormals", []float32{1e-9}, false},
		{"NaN", []float32{float32(math.NaN())}, false},
	} {
		if got := halfScales(c.scales); got != c.want {
			t.Errorf("%s: halfScales(%v) = %v, want %v", c.name, c.scales, got, c.want)
		}
	}
}

// TestNormalScales checks which 8-bit weights the Hopper GEMMs take with
// their scales as they are (Linear.q8Normal, GW_Q8_NORMAL): those whose
// every scale is 0 or in fp16's normal range.
func TestNormalScales(t *testing.T) {
	for _, c := range []struct {
		name   string
		scales []float32
		want   bool
	}{
		{"normal", []float32{0x1p-14, 0.01, -0.5, 0x1.fffffep14}, true},
		{"zero", []float32{0, float32(math.Copysign(0, -1)), 0.01}, true},
		{"none", nil, true},
		{"below fp16's normal range", []float32{0.01, 0x1.fffffep-15}, false},
		{"negative, below", []float32{-0x1p-20}, false},
		{"2^15", []float32{0x1p15}, false},
		{"infinite", []float32{float32(math.Inf(1))}, false},
		{"NaN", []float32{float32(math.NaN())}, false},
	} {
		if got := normalScales(c.scales); got != c.want {
			t.Errorf("%s: normalScales(%v) = %v, want %v", c.name, c.scales, got, c.want)
		}
	}
}

// TestOneTileNarrow checks the shapes whose launch stays narrow whatever
// wideWG estimates: the plain fp16 GEMM at one tile of activation rows,
// not at two, not the int8 or pair kinds, and what wideForm makes of it.
func TestOneTileNarrow(t *testing.T) {
	for _, c := range []struct {
		name string
		grid [3]uint32
		want bool
	}{
		{"gemm_wg_f16", [3]uint32{1, 32, 1}, true},      // 4096 outputs at 128 rows or fewer
		{"gemm_wg_f16", [3]uint32{2, 32, 1}, false},     // 256 rows
		{"gemm_wg_s8", [3]uint32{1, 32, 1}, false},      // int8: splitPlan's clusters decide
		{"gemm_wg_f16_glu", [3]uint32{1, 86, 1}, false}, // a gate/up pair
	} {
		if got := oneTileNarrow(c.name, c.grid); got != c.want {
			t.Errorf("oneTileNarrow(%s, grid %v) = %v, want %v", c.name, c.grid, got, c.want)
		}
	}
	// wideWG alone would take the wide form there (eight splits of 8 steps
	// at 1.7 against four of 16); wideForm keeps the narrow one
	b := &Backend{sms: 132}
	if !b.wideWG("gemm_wg_f16", 32, 16, 64, true) {
		t.Errorf("wideWG(gemm_wg_f16, 32 narrow blocks, 16 wide, 64 steps) = false: the case oneTileNarrow overrides is gone")
	}
	if name, grid, shm := b.wideForm("gemm_wg_f16", [3]uint32{1, 32, 1}, 1000, 64, true); name != "gemm_wg_f16" || grid != [3]uint32{1, 32, 1} || shm != 1000 {
		t.Errorf("wideForm(gemm_wg_f16, one row tile) = %s %v %d, want the narrow launch", name, grid, shm)
	}
}

// TestAttnSplit checks the prefill attention's key splits (attnSplit) on
// 132 multiprocessors: the least tiles a block whose blocks fit, where
// that saves the longest block attnSplitMergeTiles tiles or more, else
// none; and the forced splits of Options.AttnSplit.
func TestAttnSplit(t *testing.T) {
	for _, c := range []struct {
		T, pos0, heads, force int
		ct, units             int
	}{
		{128, 0, 32, 0, 2, 2},   // one tile would save the second query tile one: unsplit
		{192, 0, 32, 0, 3, 3},   // two a block: 128 blocks, one tile saved: unsplit
		{512, 0, 32, 0, 8, 8},   // no split fits: 7 a block is 288 blocks
		{512, 0, 8, 0, 3, 15},   // 3 a block: 120 blocks, five tiles saved
		{128, 512, 32, 0, 5, 4}, // after 512 cached keys: 9 and 10 tiles, 5 a block
		{128, 0, 32, -1, 2, 2},  // forced: every tile in one block
		{128, 0, 32, 1, 1, 3},   // forced: one tile a block
	} {
		b := &Backend{sms: 132, opt: Options{AttnSplit: c.force}}
		if ct, units := b.attnSplit(c.T, c.pos0, c.heads); ct != c.ct || units != c.units {
			t.Errorf("attnSplit(T %d, pos0 %d, %d heads; AttnSplit %d) = %d, %d, want %d, %d",
				c.T, c.pos0, c.heads, c.force, ct, units, c.ct, c.units)
		}
	}
}

// TestAttnRows32 checks attnRows32's choice on 132 multiprocessors: 32
// query rows a block where those blocks fit one wave (the 64-row ones at
// most half of it), 64 past that and under Options.NoAttnRows32.
func TestAttnRows32(t *testing.T) {
	for _, c := range []struct {
		T, heads int
		noRows32 bool
		want     bool
	}{
		{128, 32, false, true},  // 128 blocks of 32 rows
		{130, 32, false, false}, // 160: past a wave
		{192, 32, false, false}, // 192
		{256, 16, false, true},  // a TP=2 rank of 32 heads: 128
		{512, 8, false, true},   // 128
		{128, 32, true, false},
	} {
		b := &Backend{sms: 132, opt: Options{NoAttnRows32: c.noRows32}}
		if got := b.attnRows32(c.T, c.heads); got != c.want {
			t.Errorf("attnRows32(T %d, %d heads; NoAttnRows32 %v) = %v, want %v", c.T, c.heads, c.noRows32, got, c.want)
		}
	}
}

// TestGLUFillRows checks gluFillRows's choice on 132 multiprocessors: the
// cases its comment names, the narrow form where its blocks fit a wave, a
// tie left narrow, the cap on activation rows and Options.GLUFill.
func TestGLUFillRows(t *testing.T) {
	for _, c := range []struct {
		M, N, force, want int
	}{
		{128, 11008, 0, 88}, {256, 11008, 0, 88}, {512, 11008, 0, 112}, // 126, 252, 396 blocks
		{128, 14336, 0, 112}, {256, 14336, 0, 112}, {512, 14336, 0, 88}, // 128, 256, 652 (112: 512, tied)
		{64, 8192, 0, 0},      // 128 narrow blocks, one wave
		{1024, 11008, 0, 0},   // past gluFillMaxRows
		{1024, 11008, 1, 112}, // lifted: 792 blocks (narrow 1 376)
		{256, 14336, -1, 0},   // off
		{200, 10976, 0, 88},   // 250 blocks of 88 (narrow 344, 112: 196)
	} {
		b := &Backend{sms: 132, opt: Options{GLUFill: c.force}}
		if got := b.gluFillRows(c.M, c.N); got != c.want {
			t.Errorf("gluFillRows(M %d, N %d; GLUFill %d) = %d, want %d", c.M, c.N, c.force, got, c.want)
		}
	}
}

// TestS8Fill checks s8Fill's choice of the int8 GEMM's fill form on 132
// multiprocessors with an H200's clusters: the cases its comment names,
// three tiles of activation rows (111 blocks unsplit against 96), a K split
// of four narrowed to three, splits the device cannot merge in clusters
// (the fill form then unsplit), and Options.S8Fill; and splitPlan's
// splits of the fill form (scatterOnlyKernels: threes at most, in
// clusters or not at all).
func TestS8Fill(t *testing.T) {
	fit := [9]int{2: 66, 3: 39, 4: 30, 5: 22, 6: 17, 7: 15, 8: 15}
	for _, c := range []struct {
		M, N, steps, force int
		noCluster, want    bool
	}{
		{128, 4096, 32, 0, false, true},   // o: 37 tiles in threes (9.6 + 6 against 11 + 6)
		{128, 4096, 86, 0, false, true},   // llama2-7b's down: 25.4 + 6 against 29 + 6
		{128, 4096, 112, 0, false, true},  // llama3-8b's down
		{256, 4096, 32, 0, false, false},  // 74 tiles unsplit (28) against 64 in pairs (16 + 6)
		{384, 4096, 32, 0, false, true},   // 111 blocks unsplit (28) against 96 (32)
		{512, 4096, 32, 0, false, false},  // two waves of fill blocks
		{128, 14336, 32, 0, false, true},  // one wave either way: 128 fill blocks (28) against 112 (32)
		{128, 16384, 32, 0, false, false}, // 147 fill tiles, two waves (56) against 128 (32)
		{128, 4096, 32, -1, false, false}, // off
		{128, 4096, 32, 0, true, true},    // no cluster merges: the fill unsplit (28) against four splits through memory (8 + 28)
		{128, 4096, 86, 0, true, false},   // the same for down: 75.25 unsplit against 22 + 28
		{256, 4096, 32, 1, false, true},   // forced: unsplit
		{64, 1024, 32, 1, false, true},    // forced: 10 tiles, eight splits narrowed to three
	} {
		b := &Backend{sms: 132, clusterSplits: true, clusterFit: fit, opt: Options{S8Fill: c.force, NoClusterSplit: c.noCluster}}
		if got := b.s8Fill(c.M, c.N, c.steps); got != c.want {
			t.Errorf("s8Fill(M %d, N %d, %d steps; S8Fill %d, NoClusterSplit %v) = %v, want %v",
				c.M, c.N, c.steps, c.force, c.noCluster, got, c.want)
		}
	}
	for _, c := range []struct {
		tiles, steps int
		noCluster    bool
		S            int
		cluster      bool
	}{
		{37, 32, false, 3, true},   // o at 128 rows: threes
		{10, 32, false, 3, true},   // eight splits would fit a wave: three
		{60, 32, false, 2, true},   // pairs
		{37, 32, true, 1, false},   // no cluster merges: unsplit, never through memory
		{140, 32, false, 1, false}, // a wave of tiles
	} {
		b := &Backend{sms: 132, clusterSplits: true, clusterFit: fit, opt: Options{NoClusterSplit: c.noCluster}}
		if S, cl, _ := b.splitPlan(s8FillKernel, c.tiles, c.steps, b.sms); S != c.S || cl != c.cluster {
			t.Errorf("splitPlan(%s, %d tiles, %d steps; NoClusterSplit %v) = %d, %v, want %d, %v",
				s8FillKernel, c.tiles, c.steps, c.noCluster, S, cl, c.S, c.cluster)
		}
	}
}

// TestWideWG checks wideWG's choice of the Hopper GEMMs' blocks of two
// halves on 132 multiprocessors against what bench's kernel table measured
// on an H200 at 512 rows (kernels/NOTES.md, fifty-second session): wide
// where its waves take less (14336 outputs, 11008 gate/up pairs), or where
// its fewer blocks split K in two and the K steps outweigh the split's cost
// (4096 outputs of 11008 or 14336 inputs); narrow for 11008 outputs (3
// narrow waves, 2 wide) and 4096 × 4096 (the split costs more than it
// saves); never where the wide blocks are as many (128 rows or fewer); and
// as Options.WGWide forces; and wideGrid's halved dimension.
func TestWideWG(t *testing.T) {
	for _, c := range []struct {
		name                       string
		narrow, wide, steps, force int
		split, want                bool
	}{
		{"gemm_wg_q8", 4 * 112, 2 * 112, 64, 0, true, true},      // 14336 × 4096: 4 narrow waves, 2 wide
		{"gemm_wg_f16", 4 * 112, 4 * 56, 64, 0, true, true},      // the same in fp16 (wide along N)
		{"gemm_wg_q8", 4 * 86, 2 * 86, 64, 0, true, false},       // 11008 × 4096: 3 narrow waves, 2 wide
		{"gemm_wg_f16", 4 * 86, 4 * 43, 64, 0, true, false},      //
		{"gemm_wg_q4", 4 * 32, 2 * 32, 64, 0, true, false},       // 4096 × 4096: the split costs more
		{"gemm_wg_q4", 4 * 32, 2 * 32, 224, 0, true, true},       // 4096 × 14336: wide split in two
		{"gemm_wg_q8", 4 * 32, 2 * 32, 172, 0, true, true},       // 4096 × 11008
		{"gemm_wg_f16", 4 * 32, 4 * 16, 172, 0, true, false},     // fp16: 174 steps wide, 172 narrow
		{"gemm_wg_q8", 4 * 32, 2 * 32, 224, 0, false, false},     // no split: a wide wave of 64 blocks
		{"gemm_wg_q4_glu", 4 * 172, 2 * 172, 64, 0, false, true}, // 11008 gate/up pairs (64-row tiles): 6 narrow waves, 3 wide
		{"gemm_wg_f16_glu", 4 * 172, 4 * 86, 64, 0, false, true}, // the fp16 pair: 128 rows of each weight a wide block
		{"gemm_wg_s8_glu", 4 * 172, 4 * 86, 32, 0, false, true},  // the int8 pair (K steps of 128)
		{"gemm_wg_s8", 4 * 112, 4 * 56, 32, 0, true, true},       // int8 14336 × 4096 at 512 rows: 4 narrow waves, 2 wide (84.7 / 77.2 µs)
		{"gemm_wg_s8", 8 * 112, 8 * 56, 32, 0, true, false},      // at 1 024 rows: 7 narrow waves, 4 wide (140.6 / 149.6 µs)
		{"gemm_wg_s8", 16 * 112, 16 * 56, 32, 0, true, true},     // at 2 048 rows: 14 narrow, 7 wide (252.2 / 224.7 µs)
		{"gemm_wg_s8", 8 * 86, 8 * 43, 32, 0, true, true},        // 11008 × 4096 at 1 024 rows: 6 narrow, 3 wide (126.3 / 112.8 µs)
		{"gemm_wg_q8", 16 * 32, 8 * 32, 64, 0, true, true},       // 2048 rows: 4 narrow waves, 2 wide
		{"gemm_wg_q8", 1 * 1000, 1 * 1000, 64, 0, true, false},   // 128 rows: a half of each wide block idle
		{"gemm_wg_q8", 2 * 1000, 1 * 1000, 64, 0, true, true},
		{"gemm_wg_q8", 4 * 112, 2 * 112, 64, -1, true, false},
		{"gemm_wg_q8", 4 * 32, 2 * 32, 64, 1, true, true},
	} {
		b := &Backend{sms: 132, opt: Options{WGWide: c.force}}
		if got := b.wideWG(c.name, c.narrow, c.wide, c.steps, c.split); got != c.want {
			t.Errorf("wideWG(%s, %d narrow blocks, %d wide, %d steps, split %v, WGWide %d) = %v, want %v",
				c.name, c.narrow, c.wide, c.steps, c.split, c.force, got, c.want)
		}
	}
	// where the int8 kind's splits merge in a cluster (splitPlan:
	// wgClusterRoundSteps a round, twice for a wide block; a narrow three
	// one round, gw_scatter), in as many
	// splits as take least of those whose clusters the device runs all at
	// once (clusterFit: an H200's). The µs: the fifty-fifth session's
	// kernel tables (kernels/NOTES.md, its stop section).
	fit := [9]int{2: 66, 3: 39, 4: 30, 5: 22, 6: 17, 7: 15, 8: 15}
	for _, c := range []struct {
		name                string
		narrow, wide, steps int
		noCluster, want     bool
	}{
		{"gemm_wg_s8", 4 * 32, 4 * 16, 32, false, false},   // 4096 × 4096 at 512 rows: narrow unsplit 32, wide in two 16 · 1.8 + 12 (22.8 / 30.7 µs)
		{"gemm_wg_s8", 4 * 32, 4 * 16, 86, false, false},   // 4096 × 11008: 86 against 43 · 1.8 + 12 (57.2 / 64.2 µs)
		{"gemm_wg_s8", 4 * 32, 4 * 16, 112, false, false},  // 4096 × 14336: 112 against 56 · 1.8 + 12 (69.0 / 74.7 µs)
		{"gemm_wg_s8", 4 * 32, 4 * 16, 200, false, true},   // K = 25600: 200 against 100 · 1.8 + 12
		{"gemm_wg_s8", 4 * 32, 4 * 16, 200, true, false},   // through w8a8_sum_splits: 100 · 1.8 + 28
		{"gemm_wg_s8", 2 * 32, 2 * 16, 32, false, false},   // 256 rows: narrow in two 16 + 6, wide in two 16 · 1.8 + 12 (18.0 / 27.7 µs)
		{"gemm_wg_s8", 1 * 32, 1 * 16, 32, false, false},   // 128 rows: narrow in three 11 + 6, wide in eight through memory 4 · 1.8 + 28 (17.2 / 28.4 µs in two)
		{"gemm_wg_s8", 4 * 112, 4 * 56, 32, false, true},   // unsplit as before: 2 wide waves against 4 narrow
		{"gemm_wg_s8", 8 * 112, 8 * 56, 32, false, false},  // 4 wide waves against 7 narrow
		{"gemm_wg_f16", 4 * 32, 4 * 16, 64, false, false},  // fp16 4096 × 4096 at 512 rows, merged through memory (mergeKernels): 64 against 32 · 1.7 + 28
		{"gemm_wg_f16", 4 * 32, 4 * 16, 172, false, false}, // 4096 × 11008: 172 against 86 · 1.7 + 28 (in clusters 86 · 1.7 + 12 would win)
	} {
		b := &Backend{sms: 132, clusterSplits: true, clusterFit: fit, opt: Options{NoClusterSplit: c.noCluster}}
		if got := b.wideWG(c.name, c.narrow, c.wide, c.steps, true); got != c.want {
			t.Errorf("wideWG(%s, %d narrow blocks, %d wide, %d steps, NoClusterSplit %v) = %v, want %v",
				c.name, c.narrow, c.wide, c.steps, c.noCluster, got, c.want)
		}
	}
	for _, c := range []struct {
		name            string
		tiles, steps, S int
		merge           float64
		cluster         bool
	}{
		{"gemm_wg_s8", 64, 32, 2, 6, true},     // 256 rows of 4096 outputs: two splits in clusters, one round
		{"gemm_wg_s8", 32, 32, 3, 6, true},     // 128 rows: four splits, but 30 clusters of 4 at once; of 3 11 + 6 (one round), of 2 16 + 6
		{"gemm_wg_s8", 16, 32, 3, 6, true},     // 8 splits: clusters of 8 to 6 too many; of 3 11 + 6 (of 4 8 + 12, of 5 7 + 18)
		{"gemm_wg_s8_w", 16, 32, 8, 28, false}, // wide: eight through memory 4 · 1.8 + 28, in clusters of 4 8 · 1.8 + 24
		{"gemm_wg_s8", 20, 4, 1, 0, false},     // too few steps to split
		{"gemm_wg_s8", 33, 400, 4, 28, false},  // 4 splits: clusters of 3 134 + 12, of 2 200 + 6, through memory 100 + 28
		{"gemm_wg_bf16", 32, 64, 4, 28, false}, // not a merging kind
		{"gemm_wg_f16", 64, 32, 2, 28, false},  // a merging kind the dispatcher does not merge so (mergeKernels)
		{"gemm_wg_s8", 140, 32, 1, 0, false},   // a wave of tiles: no split
	} {
		b := &Backend{sms: 132, clusterSplits: true, clusterFit: fit}
		if S, cl, m := b.splitPlan(c.name, c.tiles, c.steps, b.sms); S != c.S || cl != c.cluster || m != c.merge {
			t.Errorf("splitPlan(%s, %d tiles, %d steps) = %d, %v, %g, want %d, %v, %g", c.name, c.tiles, c.steps, S, cl, m, c.S, c.cluster, c.merge)
		}
		b.opt.NoClusterSplit = true // as many splits as fit a wave, merged through memory
		S, m := b.splits(c.tiles, c.steps, b.sms), 0.0
		if S > 1 {
			m = wgSplitSteps
		}
		if gS, cl, gm := b.splitPlan(c.name, c.tiles, c.steps, b.sms); gS != S || cl || gm != m {
			t.Errorf("splitPlan(%s, %d tiles, %d steps) with NoClusterSplit = %d, %v, %g, want %d, false, %g", c.name, c.tiles, c.steps, gS, cl, gm, S, m)
		}
	}
	for _, c := range []struct {
		name       string
		grid, want [3]uint32
	}{
		{"gemm_wg_q8", [3]uint32{5, 7, 1}, [3]uint32{3, 7, 1}},
		{"gemm_wg_q4_glu", [3]uint32{4, 7, 1}, [3]uint32{2, 7, 1}},
		{"gemm_wg_f16", [3]uint32{5, 7, 1}, [3]uint32{5, 4, 1}},
		{"gemm_wg_s8_glu", [3]uint32{4, 7, 1}, [3]uint32{4, 4, 1}},
	} {
		if got := wideGrid(c.name, c.grid); got != c.want {
			t.Errorf("wideGrid(%s, %v) = %v, want %v", c.name, c.grid, got, c.want)
		}
	}
}

var weightCases = []weightCase{
	{"f32", 0, denseCase(model.F32), 0},
	{"f16", 0, denseCase(model.F16), 0},
	{"bf16", 0, denseCase(model.BF16), 0},
	// fewer K steps than the GEMM's cp.async stages
	{"f16-k96", 96, denseCase(model.F16), 0},
	{"bf16-k32", 32, denseCase(model.BF16), 0},
	// enough K steps for gemm_h to split K (gemmSplits)
	{"f16-splitk", 1024, denseCase(model.F16), 0},
	{"bf16-splitk", 1024, denseCase(model.BF16), 0},
	{"kuiper-int8-sym-g64", 0, quantCase(8, 64, 0, false), 0},
	{"msmodelslim-w8-perchannel-offset", 0, quantCase(8, 0, 2, false), 0}, // one group a row: gemv_q8_w2h_pc
	{"w8-g128-offset", 0, quantCase(8, 128, 2, false), 0},
	{"w8-g128-offset-tall", 0, quantCase(8, 128, 2, false), 64},                // ≥ 40 rows a multiprocessor, waves full at three blocks: gemv_q8_w4a at M = 1
	{"w8-g128-offset-taller", 0, quantCase(8, 128, 2, false), tallRegRing},     // gemv_q8_w4h
	{"w8-perchannel-offset-tall", 0, quantCase(8, 0, 2, false), 64},            // per-channel {scale, zero}: gemv_q8_w4a_pc
	{"w8-perchannel-offset-taller", 0, quantCase(8, 0, 2, false), tallRegRing}, // gemv_q8_w4h_pc
	// 4-bit weights with fp16 scales (the checkpoints' form: the GEMVs
	// read the scales' half form) and with fp32 scales (msmodelslim
	// W4A16, FP32Scales: the _s32 GEMV)
	{"awq-int4-asym-g128", 0, halfScaled(quantCase(4, 128, 1, false)), 0},
	{"w4-f32scales-g128", 0, quantCase(4, 128, 1, false), 0},
	{"int4-sym-g32", 0, quantCase(4, 32, 0, false), 0},
	{"gptq-int4-actorder-g64", 0, halfScaled(quantCase(4, 64, 1, true)), 0}, // stored with sorted columns (Linear.perm)
	{"gptq-int8-actorder-g64", 0, quantCase(8, 64, 1, true), 0},             // g_idx read by the kernels
	{"int3-asym-g64", 0, quantCase(3, 64, 1, false), 0},
	{"int4-g48-fallback", 384, quantCase(4, 48, 1, false), 0},
	{"awq-int4-g128-splitk", 2560, halfScaled(quantCase(4, 128, 1, false)), 0},
	{"w8-g128-offset-splitk", 1280, quantCase(8, 128, 2, false), 0},
	{"w8-g128-offset-split-22", 1408, quantCase(8, 128, 2, false), 0},                         // 22 K steps in 5 splits: shares of 6 (Q8_SPLIT_ALIGN 2), the last empty
	{"w8-g128-offset-long", 5120, quantCase(8, 128, 2, false), 0},                             // K > 4096: gemv_q8_w4h_k, split along K
	{"w8-g128-offset-tiny-scales", 0, rowScaled(quantCase(8, 128, 2, false), 1, 0x1p-12), 0},  // every scale below fp16's normal range
	{"w8-g128-offset-mixed-scales", 0, rowScaled(quantCase(8, 128, 2, false), 5, 0x1p-12), 0}, // every fifth row tiny: some in each warp's 16
	{"w8-perchannel-offset-long", 4640, quantCase(8, 0, 2, false), 0},                         // gemv_q8_w4h_pc_k
	{"awq-int4-g128-wide", 4608, halfScaled(quantCase(4, 128, 1, false)), 0},                  // K > 4096: gemv_q4_w2h
	{"awq-int4-g128-tall", 0, halfScaled(quantCase(4, 128, 1, false)), 64},                    // ≥ 40 rows a multiprocessor, waves full at three blocks: gemv_q4_w4a at M = 1
	{"awq-int4-g128-taller", 0, halfScaled(quantCase(4, 128, 1, false)), tallRegRing},         // gemv_q4_w4h
	{"gptq-int4-actorder-g128-tall", 0, halfScaled(quantCase(4, 128, 1, true)), 64},
	{"gptq-int4-perchannel", 0, halfScaled(quantCase(4, 0, 1, false)), 0},                  // one group a row (group_size -1): gemv_q4_w2h_pc
	{"gptq-int4-perchannel-tall", 0, halfScaled(quantCase(4, 0, 1, false)), 64},            // gemv_q4_w4a_pc
	{"gptq-int4-perchannel-taller", 0, halfScaled(quantCase(4, 0, 1, false)), tallRegRing}, // gemv_q4_w4h_pc
	// act-order rows too wide for gather_half (K > gatherHalfMaxCols: a
	// 70B's down): gather_cols, then to_half; the GEMV's x too wide to stage
	{"gptq-int4-actorder-g128-wide-k", 24704, halfScaled(quantCase(4, 128, 1, true)), 0},
	// x too wide to stage in shared memory (over gemvStreamMaxSmem): the split-K gemv_q4_sh
	{"awq-int4-g128-huge-k", 49280, halfScaled(quantCase(4, 128, 1, false)), 0},
	{"w4-f32scales-g128-huge-k", 49280, quantCase(4, 128, 1, false), 0},
}

func TestMatMul(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(1, 2))
	ran := map[string]bool{} // the GEMV kernels the cases reached
	defer func() {
		for _, k := range gemvKernels {
			if !ran[k] && !strings.HasSuffix(k, "_n") && !t.Failed() { // _n: TestRowSums
				t.Errorf("no case runs the shipped GEMV kernel %s", k)
			}
		}
		for _, k := range hopperKernels {
			if b.wgmma && !ran[k] && strings.HasPrefix(k, "gemm_") && !strings.HasPrefix(k, "gemm_wg_s8") && !strings.Contains(k, "_glu") && !strings.HasSuffix(k, "_segs") && !strings.HasSuffix(k, "_segs_kv") && !strings.HasSuffix(k, "_tp") && !t.Failed() { // TestW8A8, TestGLUPair, TestMatMulNHopper, TestNormMatMulStoreKV, TestMatMulAllReduceTiles; attention_f16_cl: TestAttention
				t.Errorf("no case runs the Hopper GEMM %s", k)
			}
		}
	}()
	for _, wc := range weightCases {
		K := 256
		if wc.k > 0 {
			K = wc.k
		}
		N := rowsFor(b, wc, 198) // N % 4 = 2: the GEMM epilogues' column tails
		lw, wf := uploadCase(t, b, r, wc, N, K)
		for _, M := range []int{1, 3, 5, 37, 130, 300} {
			// On Hopper the GEMM rows also run on the mma.sync kernels
			// (Options.NoWGMMA), which other devices take, and on the
			// Hopper GEMM's form of 256-row blocks where it has one
			// (Options.WGWide: 130 rows a half-empty block, 300 a second
			// block of 44).
			type form struct {
				noWGMMA bool
				wide    int
			}
			forms := []form{{false, -1}}
			if b.wgmma && M > b.opt.GEMVMaxRows {
				forms = append(forms, form{true, -1})
				if b.HasWideGEMM(lw, M) {
					forms = append(forms, form{false, 1})
				}
			}
			for _, f := range forms {
				b.opt.NoWGMMA, b.opt.WGWide = f.noWGMMA, f.wide
				name := fmt.Sprintf("%s/%s/M=%d", wc.name, lin(lw).Kind(), M)
				kernel := ""
				if M <= b.opt.GEMVMaxRows {
					kernel, _ = b.gemvKernel(lin(lw), M, N)
					ran[kernel] = true
					name += "/" + kernel
				} else if gh, _ := gemmHKernel(lin(lw)); b.halfGEMM(lin(lw), M, false) {
					if wg := b.wgmmaKernel(gh, M); wg != "" {
						if f.wide > 0 {
							wg = wideKernels[wg]
						}
						ran[wg] = true
						name += "/" + wg
					} else {
						k, _ := gemmHForm(gh, M)
						name += "/" + k
					}
				}
				t.Run(name, func(t *testing.T) {
					checkMatMul(t, b, name, kernel, lw, wf, randVec(r, M*K, 1), M, N, K)
				})
			}
			b.opt.NoWGMMA, b.opt.WGWide = false, 0
		}
	}
}

// TestPerChannelGEMV checks every _pc GEMV form (one group a row: the
// row's {scale, zero} loaded with the first chunk, read for every chunk)
// against float64 on rows of several chunks, the last one partial, their
// count not a multiple of a ring's depth (K = 2080: three chunks of 4-bit
// codes, five of 8-bit ones), at M = 1 and 3; weightCases' per-channel
// cases have one chunk (K = 256).
func TestPerChannelGEMV(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(61, 62))
	const K = 2080
	ran := map[string]bool{}
	for _, wc := range []weightCase{
		{"int4-perchannel", K, halfScaled(quantCase(4, 0, 1, false)), 0},
		{"int4-perchannel-tall", K, halfScaled(quantCase(4, 0, 1, false)), 64},
		{"int4-perchannel-taller", K, halfScaled(quantCase(4, 0, 1, false)), tallRegRing},
		{"int8-perchannel", K, quantCase(8, 0, 2, false), 0},
		{"int8-perchannel-tall", K, quantCase(8, 0, 2, false), 64},
		{"int8-perchannel-taller", K, quantCase(8, 0, 2, false), tallRegRing},
	} {
		checkGEMVCase(t, b, r, wc, K, ran)
	}
	for _, k := range gemvKernels {
		if strings.HasSuffix(k, "_pc") && !ran[k] {
			t.Errorf("no case runs %s", k)
		}
	}
}

// TestGroupedRingGEMV checks the 32-row 8-bit streaming GEMVs on grouped
// weights against float64 over rows of several chunks (512 features),
// the last one partial where the group size allows: the ring in shared
// memory (gemv_q8_w4a, at 64 rows a multiprocessor; where the groups tile
// a chunk a group's first lane alone copies its scale, LEAD in qtool.cu)
// and in registers (gemv_q8_w4h, at 112), every group size that tiles a
// chunk and one that does not (160), at M = 1 and 3. weightCases' grouped
// tall cases have one chunk (K = 256).
func TestGroupedRingGEMV(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(63, 64))
	ran := map[string]bool{}
	for _, gk := range []struct{ gs, k int }{{32, 4064}, {64, 2112}, {128, 2176}, {256, 2304}, {512, 2560}, {160, 2080}} {
		for _, tall := range []int{64, tallRegRing} {
			wc := weightCase{fmt.Sprintf("w8-g%d-k%d-tall%d", gk.gs, gk.k, tall), gk.k, quantCase(8, gk.gs, 2, false), tall}
			checkGEMVCase(t, b, r, wc, gk.k, ran)
		}
	}
	for _, k := range []string{"gemv_q8_w4a", "gemv_q8_w4h"} {
		if !ran[k] && !t.Failed() {
			t.Errorf("no case runs %s", k)
		}
	}
}

// checkGEMVCase uploads a weight of case wc (rowsFor's rows of K), checks
// its products at M = 1 and 3 against float64 (checkMatMul) and notes the
// GEMV kernels they ran in ran.
func checkGEMVCase(t *testing.T, b *Backend, r *rand.Rand, wc weightCase, K int, ran map[string]bool) {
	t.Helper()
	N := rowsFor(b, wc, 198)
	lw, wf := uploadCase(t, b, r, wc, N, K)
	defer b.FreeLinear(lw)
	for _, M := range []int{1, 3} {
		kernel, _ := b.gemvKernel(lin(lw), M, N)
		ran[kernel] = true
		name := fmt.Sprintf("%s/M=%d/%s", wc.name, M, kernel)
		t.Run(name, func(t *testing.T) {
			checkMatMul(t, b, name, kernel, lw, wf, randVec(r, M*K, 1), M, N, K)
		})
	}
}

// TestSplitGEMV checks the split forms (gemv_q8_w4h_k and its _pc form:
// 8-bit rows of more than 4 096 features split along K over 2–4 blocks,
// the last to finish adding the parts in a fixed order) against float64:
// grouped and per-channel scales, each row's last chunk partial, as many
// rows as make gemvSplits pick each count of splits at M = 1 (checked), and
// M = 3. MatMulAdd must add MatMul's sums to the output bit for bit, and
// MatMulN of two weights give each MatMul's (checkMatMulN: bit for bit
// where the two launches split alike, else within 1e-5).
func TestSplitGEMV(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(71, 72))
	ran, fused := map[string]bool{}, map[string]bool{}
	// blocks of 32 rows for which splits fill the waves of two blocks a
	// multiprocessor best (fewer splits fill them less, more no better)
	rowBlocks := map[int]int{2: b.sms, 3: 2 * b.sms / 3, 4: b.sms / 2}
	for _, wc := range []struct {
		name   string
		k      int
		make   func(r *rand.Rand, n, k int) (model.Tensor, []float64)
		splits int
	}{
		{"g128", 11008, quantCase(8, 128, 2, false), 4}, // down's K: 22 chunks of 512 features, the last half
		{"g128", 4608, quantCase(8, 128, 2, false), 3},  // 9 chunks
		{"g128", 4608, quantCase(8, 128, 2, false), 2},
		{"perchannel", 11008, quantCase(8, 0, 2, false), 4},
		{"perchannel", 4640, quantCase(8, 0, 2, false), 3}, // 10 chunks, the last of 32 features
		{"perchannel", 4640, quantCase(8, 0, 2, false), 2},
	} {
		N, K := 32*rowBlocks[wc.splits], wc.k
		if splits := b.gemvSplits(&Linear{kind: kindQ8, in: K}, 1, N); splits != wc.splits {
			t.Fatalf("%s: %d rows of %d features: gemvSplits picks %d splits, want %d", wc.name, N, K, splits, wc.splits)
		}
		ws := make([]runtime.Linear, 2)
		var wf []float64
		for i := range ws {
			w, f := wc.make(r, N, K)
			lw, err := b.UploadLinear(fmt.Sprintf("%s.%d", wc.name, i), w)
			if err != nil {
				t.Fatalf("%s: upload: %v", wc.name, err)
			}
			ws[i] = lw
			if i == 0 {
				wf = f
			}
		}
		for _, M := range []int{1, 3} {
			kernel, _ := b.gemvKernel(lin(ws[0]), M, N)
			splits := b.gemvSplits(lin(ws[0]), M, N)
			ran[kernel] = true
			name := fmt.Sprintf("%s/K=%d/M=%d/%s/splits=%d", wc.name, K, M, kernel, splits)
			t.Run(name, func(t *testing.T) {
				if k, _ := streamKernelOf(kernel); !k.split {
					t.Fatalf("%s: not a split form", kernel)
				}
				checkMatMul(t, b, name, kernel, ws[0], wf, randVec(r, M*K, 1), M, N, K)
				x, y0 := upload(b, M, K, randVec(r, M*K, 1)), randVec(r, M*N, 1)
				acc, prod := upload(b, M, N, y0), poisoned(b, M, N)
				b.MatMul(prod, x, ws[0])
				b.MatMulAdd(acc, x, ws[0])
				want := download(b, prod)
				for i := range want {
					want[i] += y0[i]
				}
				compare(t, "MatMulAdd", download(b, acc), want, 0)
				for _, f := range []*Buf{x, acc, prod} {
					b.Free(f)
				}
				if k := oneLaunch(b, ws, M); k != "" {
					fused[k] = true
				}
				checkMatMulN(t, b, r, M, K, []int{N, N}, ws)
				// every part taken, its word left empty for the next launch
				s := b.scratch["gemv_split_part"]
				for i, v := range download(b, &Buf{p: s.p, rows: 1, cols: s.n / 4}) {
					if math.Float32bits(v) != partEmpty {
						t.Fatalf("split parts: word %d of %d is %#x after the launches, want %#x", i, s.n/4, math.Float32bits(v), partEmpty)
					}
				}
			})
		}
		for _, w := range ws {
			b.FreeLinear(w)
		}
	}
	for _, k := range gemvKernels {
		if strings.HasSuffix(k, "_k") && (!ran[k] || !fused[k]) && !t.Failed() {
			t.Errorf("%s: run by a case %v, with several weights %v", k, ran[k], fused[k])
		}
	}
}

// checkMatMul multiplies x (M rows of K) by lw (N outputs; wf its values)
// and checks the result against float64 within the tolerance of kernel
// (the GEMV's name, or anything else for a GEMM).
func checkMatMul(t *testing.T, b *Backend, name, kernel string, lw runtime.Linear, wf []float64, x []float32, M, N, K int) {
	t.Helper()
	want := matmulRef(x, wf, M, N, K)
	xb := upload(b, M, K, x)
	y := poisoned(b, M, N)
	b.MatMul(y, xb, lw)
	tol := 1e-5 // fp32 GEMV
	switch {
	case M <= b.opt.GEMVMaxRows && gemvFixedPoint(kernel):
		tol = 2e-4 // x in 16-bit fixed point a chunk (measured up to 6.8e-5 here, with large inputs)
	case M > b.opt.GEMVMaxRows || strings.HasPrefix(kernel, "gemv_q4_"):
		tol = 3e-3 // fp16 operands on the tensor cores / half sums
	}
	checkClose(t, name, download(b, y), want, tol)
	b.Free(xb)
	b.Free(y)
}

// largeFeatures is the features of a row of cols that the large-input
// tests give values of several thousand, as real models' largest
// activations (TestMatMulLargeInputs, TestRowSums).
func largeFeatures(cols int) [3]int { return [3]int{3, cols/2 + 1, cols - 5} }

// setLargeFeatures sets the large features of each of x's rows (rows ×
// cols) to 6 000, −4 500 and 3 000.
func setLargeFeatures(x []float32, rows, cols int) {
	for m := range rows {
		for i, c := range largeFeatures(cols) {
			x[m*cols+c] = [3]float32{6000, -4500, 3000}[i]
		}
	}
}

// TestMatMulLargeInputs gives the products an input with a few features
// of several thousand, as real models' activations have (down's input
// above all), the rest small: every kernel must stay finite and within its
// tolerance. The fp16-staged 4-bit GEMVs sum four products x·(u − z) in a
// half before widening them, which overflows once |x|·|u − z| summed
// passes 65 504 (one |x| of 4 368 at |u − z| = 15; kernels/NOTES.md,
// thirty-fourth session). Their fused norm (NormMatMulN, NormSwiGLU) is
// given a norm weight of 1 000 on the large features, so that its
// normalised input is as large: the product of RMSNorm's output checked as
// the others, the fused ones against it. The other features (and norm
// weights) reach ±300, so that they carry a share of each output that an
// error in their staging would show above the tolerance (with features of
// ±1 the three large ones held all but 1e-3 of it), while four of them
// times a code cannot overflow a half alone. The fixed-point GEMVs (the
// 32-row 4-bit and the 8-bit streaming ones) get the same norm check.
func TestMatMulLargeInputs(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(7, 8))
	cases := []weightCase{ // and an 8-bit per-channel row as wide as a 14B's down
		{"w8-perchannel-offset-wide", 14592, quantCase(8, 0, 2, false), 0},
	}
	for _, wc := range weightCases {
		switch wc.name {
		case "f16", "kuiper-int8-sym-g64", "awq-int4-asym-g128", "w4-f32scales-g128", "gptq-int4-actorder-g64",
			"awq-int4-g128-wide", "awq-int4-g128-tall", "awq-int4-g128-taller", "gptq-int4-actorder-g128-tall",
			"awq-int4-g128-huge-k", "w8-g128-offset-tall":
			cases = append(cases, wc)
		}
	}
	for _, wc := range cases {
		K := 256
		if wc.k > 0 {
			K = wc.k
		}
		N := rowsFor(b, wc, 198)
		lw, wf := uploadCase(t, b, r, wc, N, K)
		nwv := randVec(r, K, 300)
		for _, c := range largeFeatures(K) {
			nwv[c] = 1000
		}
		nw, err := b.UploadVector(wc.name+".norm", model.FromFloat32([]int{K}, nwv))
		if err != nil {
			t.Fatalf("%s: upload norm: %v", wc.name, err)
		}
		for _, M := range []int{1, 3, 37} {
			kernel := "GEMM"
			if M <= b.opt.GEMVMaxRows {
				kernel, _ = b.gemvKernel(lin(lw), M, N)
			}
			name := fmt.Sprintf("%s/M=%d/%s", wc.name, M, kernel)
			x := randVec(r, M*K, 300)
			setLargeFeatures(x, M, K)
			t.Run(name, func(t *testing.T) {
				checkMatMul(t, b, name, kernel, lw, wf, x, M, N, K)
			})
			if !StreamingGEMV(kernel) { // the kernels that fuse the norm
				continue
			}
			t.Run(name+"/norm", func(t *testing.T) {
				const eps = 1e-5
				xb, h := upload(b, M, K, x), poisoned(b, M, K)
				defer b.Free(xb)
				defer b.Free(h)
				b.RMSNorm(h, xb, nw, nil, eps)
				checkMatMul(t, b, name+"/norm", kernel, lw, wf, download(b, h), M, N, K)
				checkNormProducts(t, b, xb, h, nw, nil, eps, []runtime.Linear{lw}, lw, lw, 1e-4)
			})
		}
		b.FreeLinear(lw)
	}
}

// TestGEMMRing runs the prefill GEMMs unsplit over more K steps than their
// rings have stages (gemm_wg_*: 5, gemm_h_*: 3), so that every stage is
// refilled several times, for each kind of weight they dequantize, with
// the prefill's rows and a short prompt's (gemm_h's _s forms).
func TestGEMMRing(t *testing.T) {
	b := newTestBackend(t)
	b.maxSplits = 1
	r := rand.New(rand.NewPCG(3, 4))
	const K = 1024
	for _, M := range []int{200, 20} {
		testGEMMRing(t, b, r, M, K, 198, -1)
	}
	// the Hopper GEMMs' blocks of two halves (Options.WGWide): 454 rows,
	// two blocks along N of fp16's 256 weight rows, the second part past N
	defer func() { b.opt.WGWide = 0 }()
	testGEMMRing(t, b, r, 200, K, 454, 1)
}

// testGEMMRing checks M rows by the weight cases' weights of about N rows
// and K inputs, unsplit, wide as Options.WGWide says.
func testGEMMRing(t *testing.T, b *Backend, r *rand.Rand, M, K, N0, wide int) {
	b.opt.WGWide = wide
	for _, wc := range weightCases {
		switch wc.name {
		case "f16", "bf16", "kuiper-int8-sym-g64", "w8-g128-offset", "awq-int4-asym-g128", "w4-f32scales-g128", "gptq-int4-actorder-g64":
		default:
			continue
		}
		N := rowsFor(b, wc, N0) // N % 4 = 2: the GEMM epilogues' column tails
		w, wf := wc.make(r, N, K)
		lw, err := b.UploadLinear(wc.name, w)
		if err != nil {
			t.Fatalf("%s: upload: %v", wc.name, err)
		}
		gh, _ := gemmHKernel(lin(lw))
		k, _ := gemmHForm(gh, M)
		name := fmt.Sprintf("%s/M=%d/N=%d/%s", wc.name, M, N, k)
		if !b.halfGEMM(lin(lw), M, false) {
			name = fmt.Sprintf("%s/M=%d/N=%d/%s", wc.name, M, N, "fused")
		} else if wg := b.wgmmaKernel(gh, M); wg != "" {
			if wide > 0 && wideKernels[wg] != "" {
				wg = wideKernels[wg]
			}
			name = fmt.Sprintf("%s/M=%d/N=%d/%s", wc.name, M, N, wg)
		}
		x := randVec(r, M*K, 1)
		want := matmulRef(x, wf, M, N, K)
		xb := upload(b, M, K, x)
		y := poisoned(b, M, N)
		b.MatMul(y, xb, lw)
		checkClose(t, name, download(b, y), want, 3e-3)
		b.Free(xb)
		b.Free(y)
		b.FreeLinear(lw)
	}
}

// matmulRef is x[M, K] · w[N, K]ᵀ in float64.
func matmulRef(x []float32, w []float64, M, N, K int) []float64 {
	out := make([]float64, M*N)
	// rows on every core (each sum in k order as before: the same values);
	// TestMatMul's huge-K cases took two minutes of a device call serially
	var wg sync.WaitGroup
	for m := range M {
		wg.Go(func() {
			for n := range N {
				var s float64
				for k := range K {
					s += float64(x[m*K+k]) * w[n*K+k]
				}
				out[m*N+n] = s
			}
		})
	}
	wg.Wait()
	return out
}

func TestGemmSplits(t *testing.T) {
	for _, c := range []struct{ tiles, steps, resident, want int }{
		{32, 64, 264, 8},    // 16 rows × a 4096-row weight, gemm_h steps of 64, 2 blocks × 132 SMs
		{128, 64, 264, 2},   // 512 rows × 4096: two splits stay within one wave
		{344, 64, 264, 1},   // 512 rows × 11008: more than a wave already
		{132, 64, 264, 2},   // exactly one block a multiprocessor
		{1, 8, 264, 2},      // few K steps: at least gemmSplitMinSteps each
		{1, 3, 264, 1},      // too few to split
		{264, 1000, 264, 1}, // a full wave
		{128, 64, 132, 1},   // gemm_wg: one block a multiprocessor
		{32, 64, 132, 4},    // gemm_wg, 128 rows × 4096
	} {
		if got := gemmSplits(c.tiles, c.steps, c.resident); got != c.want {
			t.Errorf("gemmSplits(%d tiles, %d steps, %d resident) = %d, want %d", c.tiles, c.steps, c.resident, got, c.want)
		}
	}
}

// TestSumSplits checks sum_splits, the sum of a K split's partial products
// through memory: its four-values-a-thread form (n a multiple of 4, C and
// the parts 16-byte aligned) against the sums in order in float32 on the
// host, bit for bit, stored and added to C; and against its value-a-thread
// form, which the same launch takes on buffers 4 bytes off alignment, bit
// for bit for every out (the SwiGLU's too). S = 9 and 16 take a second
// batch of loads (SUM_BATCH is 8).
func TestSumSplits(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(73, 74))
	for _, tc := range []struct{ S, n int }{{1, 4096}, {3, 4096}, {8, 1 << 19}, {9, 4100}, {16, 8192}, {4, 1030}} {
		for _, out := range []int{outStore, outAdd, outSwiGLU} {
			name := fmt.Sprintf("S=%d/n=%d/out=%d", tc.S, tc.n, out)
			parts, c0 := randVec(r, tc.S*tc.n, 1), randVec(r, tc.n, 2)
			var got [2][]float32
			for i, off := range []int{0, 1} { // aligned; one float off
				pb := upload(b, 1, tc.S*tc.n+4, slices.Concat(make([]float32, off), parts, make([]float32, 4-off)))
				cb := upload(b, 1, tc.n+4, slices.Concat(make([]float32, off), c0, make([]float32, 4-off)))
				func() {
					defer b.enter()() // launchGEMM's grid: the scalar form loops over the rest
					b.launch("sum_splits", b.sumSplitsGrid(tc.n), block256, cb.p+driver.DevicePtr(4*off),
						pb.p+driver.DevicePtr(4*off), tc.S, int64(tc.n), out)
				}()
				got[i] = download(b, cb)[off : off+tc.n]
				b.Free(pb)
				b.Free(cb)
			}
			if !slices.Equal(got[0], got[1]) {
				t.Errorf("%s: the float4 form and the scalar form differ", name)
			}
			if out == outSwiGLU {
				continue
			}
			bad := 0
			for i := range tc.n {
				var v float32
				for z := range tc.S {
					v += parts[z*tc.n+i]
				}
				if out == outAdd {
					v = c0[i] + v
				}
				if got[0][i] != v && bad < 3 {
					t.Errorf("%s: [%d] = %v, want %v (the sum in order)", name, i, got[0][i], v)
					bad++
				}
			}
		}
	}
}

// TestClusterSplit checks the K splits of the fp16 and int8 Hopper GEMMs
// merged in their cluster's shared memory (qtool.cu's gw_scatter for a
// narrow pair or three, gw_merge_splits's tree of rounds otherwise)
// against the same launches merged through global memory
// (Options.NoClusterSplit): int8 equal bit for bit (integer sums; TestW8A8
// checks both against integer arithmetic), fp16 equal at two splits (one
// sum either way) and at three narrow ones ((p0 + p1) + p2 either way),
// within tolerance of float64 at any; at 2, 3 (a narrow
// block's three in one round, a wide block's tree a round where the last
// block has no partner), 4 and 8 splits (b.maxSplits), narrow and wide
// blocks, each in clusters wherever they fit (b.forceClusterSplit: also
// the forms splitPlan's costs pass over, three rounds of a wide block's
// sums, and the fp16 kinds, which the dispatcher merges through memory:
// mergeKernels), int8 with static and per-token quantizers, stored and
// added to a residual (MatMulAdd); and no sum_splits or w8a8_sum_splits
// launch where the clusters merge.
func TestClusterSplit(t *testing.T) {
	b := newTestBackend(t)
	if !b.wgmma || !b.clusterSplits {
		t.Skip("no Hopper GEMMs or no cluster launches on this device")
	}
	defer func() {
		b.maxSplits, b.opt.NoClusterSplit, b.opt.WGWide, b.forceClusterSplit, b.opt.S8Fill = 0, false, 0, false, 0
	}()
	// gemm_wg_s8's merges, not the fill form's (TestS8FillGEMM), which
	// s8Fill picks unsplit under NoClusterSplit at these shapes
	b.forceClusterSplit, b.opt.S8Fill = true, -1
	r := rand.New(rand.NewPCG(71, 72))
	const M, N, K = 200, 136, 4096 // 2 × 2 narrow tiles, 32 K steps: 8 splits
	x := randVec(r, M*K, 1)
	xb := upload(b, M, K, x)
	defer b.Free(xb)
	res := randVec(r, M*N, 1) // the residual MatMulAdd adds to
	t.Logf("clusters of s blocks the device runs at once (clusterFit, s = 2…8): %v", b.clusterFit[2:])
	// fp16: the cluster's sums in a tree (a narrow three: in its order),
	// sum_splits's in order: equal at two splits and three narrow ones,
	// within the GEMMs' tolerance of float64 at any; stored, and added to
	// the residual by the block that finishes the rows (a narrow pair: each
	// block half the tile; a narrow three: each its part; else rank 0;
	// sum_splits: out)
	f16, wf := uploadCase(t, b, r, weightCaseNamed(t, "f16"), N, K)
	want := matmulRef(x, wf, M, N, K)
	wantAdd := slices.Clone(want)
	for i, v := range res {
		wantAdd[i] += float64(v)
	}
	for _, S := range []int{2, 3, 4, 8} {
		for _, wide := range []int{-1, 1} {
			for _, add := range []bool{false, true} {
				b.maxSplits, b.opt.WGWide = S, wide
				var got [2][]float32
				for i, global := range []bool{false, true} {
					b.opt.NoClusterSplit = global
					name := fmt.Sprintf("fp16/S=%d/WGWide=%d/add=%v/NoClusterSplit=%v", S, wide, add, global)
					var y *Buf
					ref := want
					before := b.KernelLaunches()["sum_splits"]
					if add {
						y, ref = upload(b, M, N, res), wantAdd
						b.MatMulAdd(y, xb, f16)
					} else {
						y = poisoned(b, M, N)
						b.MatMul(y, xb, f16)
					}
					if n, want := b.KernelLaunches()["sum_splits"]-before, map[bool]int{false: 0, true: 1}[global]; n != want {
						t.Errorf("%s: %d launches of sum_splits, want %d", name, n, want)
					}
					got[i] = download(b, y)
					checkClose(t, name, got[i], ref, 3e-3)
					b.Free(y)
				}
				if (S == 2 || S == 3 && wide < 0) && !slices.Equal(got[0], got[1]) {
					t.Errorf("fp16 S=%d WGWide=%d add=%v: merged in the cluster and through memory differ", S, wide, add)
				}
			}
		}
	}
	b.FreeLinear(f16)
	for _, dynamic := range []bool{false, true} { // a static quantizer; per token (the epilogue's token scales)
		lw := uploadW8A8(t, b, r, N, K, dynamic, 0.02)
		for _, S := range []int{2, 3, 4, 8} {
			for _, wide := range []int{-1, 1} {
				for _, add := range []bool{false, true} { // the epilogue's store; its add (OUT_ADD)
					b.maxSplits, b.opt.WGWide = S, wide
					name := fmt.Sprintf("dynamic=%v/S=%d/WGWide=%d/add=%v", dynamic, S, wide, add)
					var got [2][]float32 // merged in clusters, through memory
					for i, global := range []bool{false, true} {
						b.opt.NoClusterSplit = global
						y := upload(b, M, N, res)
						before := b.KernelLaunches()["w8a8_sum_splits"]
						if add {
							b.MatMulAdd(y, xb, lw)
						} else {
							b.MatMul(y, xb, lw)
						}
						if n, want := b.KernelLaunches()["w8a8_sum_splits"]-before, map[bool]int{false: 0, true: 1}[global]; n != want {
							t.Errorf("%s NoClusterSplit=%v: %d launches of w8a8_sum_splits, want %d", name, global, n, want)
						}
						got[i] = download(b, y)
						b.Free(y)
					}
					for i, v := range got[0] {
						if w := got[1][i]; v != w {
							t.Errorf("%s: value %d merged in the cluster %v, through memory %v", name, i, v, w)
							break
						}
					}
				}
			}
		}
		b.FreeLinear(lw)
	}
}

// TestW8A8 checks the W8A8 products against integer arithmetic: the dp4a
// GEMV (M ≤ GEMVMaxRows) and the int8 tensor-core GEMM (partial 128-tiles
// in M and N, K not a multiple of the 64-wide K step; K split over the grid
// where there are K steps enough, gemmSplits; on Hopper gemm_wg_s8 from 128
// rows, also unsplit over more K steps than its ring has stages, and its
// form of 256 weight rows a block, gemm_wg_s8_w, forced (Options.WGWide):
// the second half partly past N (136, 200, 454: two blocks along N) or
// wholly (72, 42); its splits merged in clusters where splitPlan says and
// through memory, Options.NoClusterSplit). A fifth of the activations lie
// on or next to the static quantizer's rounding boundaries.
func TestW8A8(t *testing.T) {
	for _, c := range [][3]int{{136, 256, 0}, {200, 80, 0}, {136, 1024, 0}, {200, 1040, 0}, {200, 1040, 1}, {454, 1040, 0},
		// w8a8_gemm's whole batches of a lane's loads and a partial one with
		// one unit (K = 4112, 8208) or four of eight (5696); 42 rows: a
		// partial block
		{136, 4112, 0}, {72, 8208, 0}, {42, 5696, 0}} {
		testW8A8(t, c[0], c[1], c[2])
	}
}

func testW8A8(t *testing.T, N, K, maxSplits int) {
	b := newTestBackend(t)
	b.maxSplits = maxSplits
	r := rand.New(rand.NewPCG(3, 4))
	q := &model.Quantized{Bits: 8, Rows: N, Cols: K, Q: make([]int8, N*K), Scale: make([]float32, N)}
	for i := range q.Q {
		q.Q[i] = int8(r.IntN(255) - 127)
	}
	w := &model.W8A8{Weight: q, InputScale: 0.013, InputOffset: 3, DeqScale: make([]float32, N), QuantBias: make([]int32, N), Bias: make([]float32, N)}
	for n := 0; n < N; n++ {
		q.Scale[n] = float32(0.001 + 0.01*r.Float64())
		w.DeqScale[n] = w.InputScale * q.Scale[n]
		w.QuantBias[n] = int32(r.IntN(2000) - 1000)
		w.Bias[n] = float32(r.Float64() - 0.5)
	}
	lw, err := b.UploadLinear("w8a8", w)
	if err != nil {
		t.Fatal(err)
	}
	for _, M := range []int{1, 4, 7, 64, 130, 300} {
		x := randVec(r, M*K, 2)
		// every fifth value on or next to a rounding boundary of the
		// quantizer, x/scale + offset = j + 0.5: where quant_act's product
		// with the reciprocal would round otherwise than the division
		for i := 0; i < len(x); i += 5 {
			x[i] = roundingEdge(r, w.InputScale, w.InputOffset, r.IntN(3)-1)
		}
		want := make([]float64, M*N)
		for m := 0; m < M; m++ {
			xq := make([]int32, K)
			for k := 0; k < K; k++ {
				v := math.Round(float64(x[m*K+k]/w.InputScale + w.InputOffset))
				xq[k] = int32(math.Max(-128, math.Min(127, v)))
			}
			for n := 0; n < N; n++ {
				var acc int32
				for k := 0; k < K; k++ {
					acc += xq[k] * int32(q.Q[n*K+k])
				}
				want[m*N+n] = float64(float32(acc+w.QuantBias[n])*w.DeqScale[n] + w.Bias[n])
			}
		}
		xb := upload(b, M, K, x)
		for _, wide := range []int{-1, 1} { // the Hopper GEMM's narrow and wide blocks
			if wide > 0 && !b.HasWideGEMM(lw, M) {
				continue
			}
			for _, global := range []bool{false, true} { // its K splits merged in clusters where they may, or through memory
				b.opt.WGWide, b.opt.NoClusterSplit = wide, global
				y := poisoned(b, M, N)
				b.MatMul(y, xb, lw)
				checkClose(t, fmt.Sprintf("w8a8 M=%d N=%d K=%d WGWide=%d NoClusterSplit=%v", M, N, K, wide, global), download(b, y), want, 0) // exact: integers, then one product and one sum
				b.Free(y)
			}
		}
		b.opt.WGWide, b.opt.NoClusterSplit = 0, false
		b.Free(xb)
	}
}

func TestEmbed(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(5, 6))
	const V, D = 300, 256
	for _, wc := range weightCases {
		t.Run(wc.name, func(t *testing.T) {
			D := D
			if wc.k > 0 {
				D = wc.k
			}
			w, wf := wc.make(r, V, D)
			lw, err := b.UploadLinear(wc.name, w)
			if err != nil {
				t.Fatal(err)
			}
			ids := []int{0, 299, 17, 17, 150, 3}
			want := make([]float64, len(ids)*D)
			for i, id := range ids {
				copy(want[i*D:], wf[id*D:(id+1)*D])
			}
			y := poisoned(b, len(ids), D)
			b.Embed(y, lw, ids)
			checkClose(t, "embed "+wc.name, download(b, y), want, 1e-6)
		})
	}
}

func rmsRef(x []float64, w, bias []float32, eps float64) []float64 {
	var ss float64
	for _, v := range x {
		ss += v * v
	}
	inv := 1 / math.Sqrt(ss/float64(len(x))+eps)
	out := make([]float64, len(x))
	for i, v := range x {
		out[i] = v * inv * float64(w[i])
		if bias != nil {
			out[i] += float64(bias[i])
		}
	}
	return out
}

func f64(v []float32) []float64 {
	out := make([]float64, len(v))
	for i, x := range v {
		out[i] = float64(x)
	}
	return out
}

func TestNorms(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(7, 8))
	const rows, cols, hd = 5, 512, 64
	x := randVec(r, rows*cols, 3)
	w := randVec(r, cols, 1)
	bias := randVec(r, cols, 1)
	wv, _ := b.UploadVector("w", model.FromFloat32([]int{cols}, w))
	bv, _ := b.UploadVector("b", model.FromFloat32([]int{cols}, bias))
	for _, tc := range []struct {
		name      string
		bias      []float32
		biasV     runtime.Vector
		aliasDest bool
	}{{"plain", nil, nil, false}, {"bias", bias, bv, false}, {"in-place", nil, nil, true}} {
		t.Run("rmsnorm/"+tc.name, func(t *testing.T) {
			want := make([]float64, 0, rows*cols)
			for i := 0; i < rows; i++ {
				want = append(want, rmsRef(f64(x[i*cols:(i+1)*cols]), w, tc.bias, 1e-5)...)
			}
			xb := upload(b, rows, cols, x)
			dst := xb
			if !tc.aliasDest {
				dst = poisoned(b, rows, cols)
			}
			b.RMSNorm(dst, xb, wv, tc.biasV, 1e-5)
			checkClose(t, "rmsnorm "+tc.name, download(b, dst), want, 1e-6)
		})
	}
	t.Run("rmsnorm-heads", func(t *testing.T) {
		hw := randVec(r, hd, 1)
		hv, _ := b.UploadVector("hw", model.FromFloat32([]int{hd}, hw))
		want := make([]float64, 0, rows*cols)
		for i := 0; i < rows*cols/hd; i++ {
			want = append(want, rmsRef(f64(x[i*hd:(i+1)*hd]), hw, nil, 1e-6)...)
		}
		xb := upload(b, rows, cols, x)
		b.RMSNormHeads(xb, hd, hv, 1e-6)
		checkClose(t, "rmsnorm-heads", download(b, xb), want, 1e-6)
	})
}

func TestElementwise(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(9, 10))
	const rows, cols = 7, 300
	g, u := randVec(r, rows*cols, 4), randVec(r, rows*cols, 2)
	bias := randVec(r, cols, 1)
	t.Run("silu-mul", func(t *testing.T) {
		want := make([]float64, len(g))
		for i := range g {
			x := float64(g[i])
			want[i] = x / (1 + math.Exp(-x)) * float64(u[i])
		}
		gb, ub, d := upload(b, rows, cols, g), upload(b, rows, cols, u), poisoned(b, rows, cols)
		b.SiLUMul(d, gb, ub)
		checkClose(t, "silu-mul", download(b, d), want, 1e-6)
		b.SiLUMul(gb, gb, ub) // dst aliases gate
		checkClose(t, "silu-mul in place", download(b, gb), want, 1e-6)
	})
	t.Run("add", func(t *testing.T) {
		want := make([]float64, len(g))
		for i := range g {
			want[i] = float64(g[i] + u[i])
		}
		gb, ub := upload(b, rows, cols, g), upload(b, rows, cols, u)
		b.Add(gb, ub)
		checkClose(t, "add", download(b, gb), want, 1e-7)
	})
	t.Run("add-bias", func(t *testing.T) {
		want := make([]float64, len(g))
		for i := range g {
			want[i] = float64(g[i] + bias[i%cols])
		}
		gb := upload(b, rows, cols, g)
		bv, _ := b.UploadVector("bias", model.FromFloat32([]int{cols}, bias))
		b.AddBias(gb, bv)
		checkClose(t, "add-bias", download(b, gb), want, 1e-7)
	})
}

func TestRoPE(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(11, 12))
	const hd, heads, pos0 = 64, 10, 1000
	cols := hd * heads
	for _, tc := range []struct {
		layout model.RopeLayout
		theta  float64
		rows   int
	}{
		{model.RopeHalf, 10000, 4}, {model.RopeHalf, 1e6, 4}, {model.RopeInterleaved, 10000, 4}, {model.RopeInterleaved, 1e6, 4},
		{model.RopeHalf, 1e6, 40}, {model.RopeInterleaved, 10000, 40}, // ≥ ropeGroupRows: heads share their angles
	} {
		layout, theta, rows := tc.layout, tc.theta, tc.rows
		t.Run(fmt.Sprintf("%v/theta=%g/rows=%d", layout, theta, rows), func(t *testing.T) {
			x := randVec(r, rows*cols, 1)
			want := f64(x)
			for row := 0; row < rows; row++ {
				for h := 0; h < heads; h++ {
					base := row*cols + h*hd
					for i := 0; i < hd/2; i++ {
						a, c := base+i, base+i+hd/2
						if layout == model.RopeInterleaved {
							a, c = base+2*i, base+2*i+1
						}
						ang := float64(pos0+row) * math.Pow(theta, -2*float64(i)/hd)
						x0, x1 := float64(x[a]), float64(x[c])
						want[a] = x0*math.Cos(ang) - x1*math.Sin(ang)
						want[c] = x0*math.Sin(ang) + x1*math.Cos(ang)
					}
				}
			}
			xb := upload(b, rows, cols, x)
			b.RoPE(xb, hd, pos0, theta, layout)
			checkClose(t, "rope", download(b, xb), want, 1e-6)
		})
	}
}

func TestAttention(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(13, 14))
	const heads, kvHeads, maxSeq, layers = 8, 2, 400, 2
	defer func() { b.opt.KVHalf, b.opt.AttnSplit = false, 0 }()
	groupLaunches := func() int { // the launches in blocks of two key groups
		k := b.KernelLaunches()
		return k["attn_tc_f16_g"] + k["attn_tc_f16_g32"]
	}
	for _, cfg := range []struct {
		hd   int
		half bool // an fp16 cache: attention_f16, attn_tc_f16
	}{{64, false}, {128, false}, {64, true}, {128, true}} {
		hd, kvDim := cfg.hd, kvHeads*cfg.hd
		b.opt.KVHalf = cfg.half
		c := b.NewKVCache(layers, maxSeq, kvDim)
		const filled = 350
		keys, vals := randVec(r, filled*kvDim, 1), randVec(r, filled*kvDim, 1)
		kb, vb := upload(b, filled, kvDim, keys), upload(b, filled, kvDim, vals)
		b.StoreKV(c, 1, 0, kb, vb)
		if cfg.half { // the reference reads what the cache holds
			for i := range keys {
				keys[i] = model.RoundF16(keys[i])
				vals[i] = model.RoundF16(vals[i])
			}
		}
		// T ≥ attnTCMinRows: the tensor-core kernel (one and several
		// 64-query blocks, partial ones, after a filled prefix), its query
		// tiles' keys split as the shape chooses (0), not at all (−1) and
		// 1–3 key tiles a block (after a prefix of 150, a block's first
		// keys may come after some of its rows; unsplit over two query
		// tiles or more, an fp16 cache's blocks run two key groups,
		// attn_tc_f16_g, or attn_tc_f16_g32 on 32 query rows a block,
		// which must give the 64-row blocks' bits)
		// Decode rows (T < attnTCMinRows) also with the grid split as for
		// a cache of 352 keys (attnKeys: 11 splits, the later ones without
		// keys at early positions, as in a captured step).
		for _, tc := range []struct{ T, pos0, gridKeys int }{{9, 0, 0}, {1, 0, 0}, {1, 299, 0}, {3, 297, 0}, {1, 349, 0},
			{1, 0, 352}, {1, 40, 352}, {3, 97, 352}, {1, 299, 352}, {31, 300, 0}, {50, 300, 0}, {64, 0, 0}, {130, 0, 0}, {200, 150, 0}, {350, 0, 0}} {
			t.Run(fmt.Sprintf("hd=%d/half=%v/T=%d/pos0=%d/grid=%d", hd, cfg.half, tc.T, tc.pos0, tc.gridKeys), func(t *testing.T) {
				q := randVec(r, tc.T*heads*hd, 1)
				want := attentionRef(q, keys, vals, tc.T, tc.pos0, heads, kvHeads, hd)
				qb := upload(b, tc.T, heads*hd, q)
				b.attnKeys = tc.gridKeys
				defer func() { b.attnKeys = 0 }()
				splits := []int{0}
				if tc.T >= attnTCMinRows {
					splits = []int{0, -1, 1, 2, 3}
				}
				for _, sp := range splits {
					b.opt.AttnSplit = sp
					d := poisoned(b, tc.T, heads*hd)
					before, before32 := groupLaunches(), b.KernelLaunches()["attn_tc_f16_g32"]
					b.Attention(d, qb, c, 1, tc.pos0, heads, kvHeads, hd)
					got := download(b, d)
					checkClose(t, fmt.Sprintf("attention, split %d", sp), got, want, 1e-5)
					if tc.T >= attnTCMinRows {
						_, units := b.attnSplit(tc.T, tc.pos0, heads)
						wantG := cfg.half && b.attnGroups(tc.T, heads, units) // at least unsplit (−1) over two query tiles
						must := sp == -1 && tc.T > 64 && cfg.half && attnTC2Smem <= b.smemOptin
						if grouped := groupLaunches() > before; grouped != wantG || must && !grouped {
							t.Errorf("split %d: attn_tc_f16_g or _g32 launched %v, want %v", sp, grouped, wantG)
						}
						rows32 := wantG && b.attnRows32(tc.T, heads)
						if g32 := b.KernelLaunches()["attn_tc_f16_g32"] > before32; g32 != rows32 {
							t.Errorf("split %d: attn_tc_f16_g32 launched %v, want %v", sp, g32, rows32)
						}
						// the same launch with option off set: its output
						with := func(off *bool) []float32 {
							*off = true
							defer func() { *off = false }()
							d1 := poisoned(b, tc.T, heads*hd)
							defer b.Free(d1)
							b.Attention(d1, qb, c, 1, tc.pos0, heads, kvHeads, hd)
							return download(b, d1)
						}
						if rows32 && !slices.Equal(with(&b.opt.NoAttnRows32), got) { // blocks of 64 query rows: the same bits
							t.Errorf("split %d: attention in 64-row blocks differs from the 32-row ones", sp)
						}
						if wantG { // blocks of one key group
							before := groupLaunches()
							checkClose(t, fmt.Sprintf("attention, split %d, one key group", sp), with(&b.opt.NoAttnGroups), want, 1e-5)
							if groupLaunches() != before {
								t.Errorf("split %d: attn_tc_f16_g or _g32 launched under NoAttnGroups", sp)
							}
						}
					}
					if _, ok := b.fn["attention_f16_cl"]; ok && tc.T < attnTCMinRows {
						// the splits merged in a cluster: the same operations
						b.opt.NoClusterAttention = true
						b.Attention(d, qb, c, 1, tc.pos0, heads, kvHeads, hd)
						b.opt.NoClusterAttention = false
						if g := download(b, d); !slices.Equal(g, got) {
							t.Errorf("attention merged in a cluster differs from the merge through global memory")
						}
					}
					b.Free(d)
				}
			})
		}
	}
}

// TestAttentionLong runs the decode attention where the device's size asks
// for more splits than the merge holds (one head: four blocks a
// multiprocessor, capped at attnMaxSplits), at positions that use all of
// them, some and one, with head size 256 (4 keys a warp step instead of 8).
func TestAttentionLong(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(15, 16))
	const hd, filled = 256, 20000
	c := b.NewKVCache(1, filled, hd)
	keys, vals := randVec(r, filled*hd, 1), randVec(r, filled*hd, 1)
	kb, vb := upload(b, filled, hd, keys), upload(b, filled, hd, vals)
	b.StoreKV(c, 0, 0, kb, vb)
	for _, pos0 := range []int{filled - 1, 1000, 0} {
		q := randVec(r, hd, 1)
		qb, d := upload(b, 1, hd, q), poisoned(b, 1, hd)
		b.Attention(d, qb, c, 0, pos0, 1, 1, hd)
		checkClose(t, fmt.Sprintf("attention at position %d", pos0), download(b, d), attentionRef(q, keys, vals, 1, pos0, 1, 1, hd), 1e-5)
		b.Free(qb)
		b.Free(d)
	}
}

// attentionRef is causal GQA attention in float64 of T query rows q
// [T, heads·hd] at positions pos0… over keys and values [·, kvHeads·hd].
func attentionRef(q, keys, vals []float32, T, pos0, heads, kvHeads, hd int) []float64 {
	kvDim := kvHeads * hd
	want := make([]float64, T*heads*hd)
	scale := 1 / math.Sqrt(float64(hd))
	for ti := 0; ti < T; ti++ {
		n := pos0 + ti + 1
		for h := 0; h < heads; h++ {
			kh := h / (heads / kvHeads)
			s := make([]float64, n)
			mx := math.Inf(-1)
			for j := 0; j < n; j++ {
				var d float64
				for e := 0; e < hd; e++ {
					d += float64(q[(ti*heads+h)*hd+e]) * float64(keys[j*kvDim+kh*hd+e])
				}
				s[j] = d * scale
				mx = math.Max(mx, s[j])
			}
			var sum float64
			for j := range s {
				s[j] = math.Exp(s[j] - mx)
				sum += s[j]
			}
			for e := 0; e < hd; e++ {
				var a float64
				for j := 0; j < n; j++ {
					a += s[j] * float64(vals[j*kvDim+kh*hd+e])
				}
				want[(ti*heads+h)*hd+e] = a / sum
			}
		}
	}
	return want
}

// testArgmaxEdges checks Argmax on rows that cross its blocks' spans:
// ties within and across spans (the lowest index wins), NaN (never wins; a
// row of NaN gives 0), -Inf, a maximum in the last partial span, and rows
// narrower than one span.
func testArgmaxEdges(t *testing.T, b *Backend) {
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	r := rand.New(rand.NewPCG(21, 22))
	for _, cols := range []int{1, 7, argmaxSpan, argmaxSpan + 1, 32000} {
		type row struct {
			name string
			set  func(v []float32)
			want int
		}
		rows := []row{
			{"random", func(v []float32) {}, -1},
			{"tie across spans", func(v []float32) { v[cols-1] = 100; v[cols/2] = 100 }, min(cols/2, cols-1)},
			{"tie at the ends", func(v []float32) { v[0] = 100; v[cols-1] = 100 }, 0},
			{"last column", func(v []float32) { v[cols-1] = 100 }, cols - 1},
			{"NaN beside the largest", func(v []float32) { v[cols-1] = 100; v[0] = nan; v[cols/2] = nan }, -1},
			{"all NaN", func(v []float32) {
				for i := range v {
					v[i] = nan
				}
			}, 0},
			{"all -Inf", func(v []float32) {
				for i := range v {
					v[i] = -inf
				}
			}, 0},
			{"+Inf", func(v []float32) { v[cols-1] = inf }, cols - 1},
		}
		l := make([]float32, len(rows)*cols)
		for i, rw := range rows {
			v := l[i*cols : (i+1)*cols]
			for c := range v {
				v[c] = float32(r.NormFloat64())
			}
			rw.set(v)
		}
		got := b.Argmax(upload(b, len(rows), cols, l))
		for i, rw := range rows {
			want := rw.want
			if want < 0 { // the first largest, NaN skipped
				v := l[i*cols : (i+1)*cols]
				want = 0
				for c := range v {
					if v[c] > v[want] || v[want] != v[want] && v[c] == v[c] {
						want = c
					}
				}
			}
			if got[i] != want {
				t.Errorf("cols %d, %s: argmax %d, want %d", cols, rw.name, got[i], want)
			}
		}
	}
}

// TestScratchHeld checks that growing a scratch area keeps the old one
// allocated while something may still need it — a captured graph alive
// (the graph may read it), the backend in a connected peer-memory group (a
// free may wait for the peers' GPUs, where an all-reduce may spin waiting
// for this rank) — and frees it once nothing does.
func TestScratchHeld(t *testing.T) {
	for _, tc := range []struct {
		name string
		hold func(t *testing.T) (b *Backend, release func())
	}{
		{"graph", func(t *testing.T) (*Backend, func()) {
			b := newTestBackend(t)
			g := &Graph{b: b} // stands for a live captured graph
			b.graphs = append(b.graphs, g)
			t.Cleanup(func() { g.freed = true }) // before Close (cleanups run last first): it has no graph to destroy
			return b, func() { g.freed = true }  // destroyed: nothing holds areas any more
		}},
		{"peer-group", func(t *testing.T) (*Backend, func()) {
			ranks := peerGroup(t, 2, 1<<10, time.Minute)
			return ranks[0], func() {
				for _, r := range ranks {
					if err := r.ClosePeerReduce(); err != nil {
						t.Fatal(err)
					}
				}
			}
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			b, release := tc.hold(t)
			defer b.enter()() // scratchBuf runs with the context current
			old := b.scratchBuf("held_test", 1024)
			if grown := b.scratchBuf("held_test", 4096); grown == old {
				t.Fatal("the grown area kept the old address")
			}
			if _, ok := b.owned[old]; !ok {
				t.Fatal("growing the area while held freed the old one")
			}
			release()
			defer b.enter()() // release may leave another rank's context current (enter does not restore the one before)
			areas := len(b.owned)
			b.scratchBuf("held_test", 16384)
			// The allocator may hand the freed address out again, so count the areas.
			if len(b.owned) != areas {
				t.Errorf("growing the area, no longer held: %d areas owned, want %d (the outgrown one freed)", len(b.owned), areas)
			}
			if len(b.graphs) != 0 {
				t.Errorf("%d destroyed graphs still listed", len(b.graphs))
			}
		})
	}
}

func TestLogitOps(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(15, 16))
	const rows, cols = 6, 5003
	l := randVec(r, rows*cols, 8)
	lb := upload(b, rows, cols, l)
	t.Run("nll", func(t *testing.T) {
		targets := make([]int, rows)
		for i := range targets {
			targets[i] = r.IntN(cols)
		}
		out := make([]float64, rows)
		b.NLL(out, lb, targets)
		for i := 0; i < rows; i++ {
			mx := math.Inf(-1)
			for c := 0; c < cols; c++ {
				mx = math.Max(mx, float64(l[i*cols+c]))
			}
			var s float64
			for c := 0; c < cols; c++ {
				s += math.Exp(float64(l[i*cols+c]) - mx)
			}
			want := math.Log(s) + mx - float64(l[i*cols+targets[i]])
			if math.Abs(out[i]-want) > 1e-9*math.Max(1, math.Abs(want)) {
				t.Errorf("row %d: nll %.12g, want %.12g", i, out[i], want)
			}
		}
	})
	t.Run("argmax", func(t *testing.T) {
		got := b.Argmax(lb)
		for i := 0; i < rows; i++ {
			best := 0
			for c := 1; c < cols; c++ {
				if l[i*cols+c] > l[i*cols+best] {
					best = c
				}
			}
			if got[i] != best {
				t.Errorf("row %d: argmax %d, want %d", i, got[i], best)
			}
		}
	})
	t.Run("argmax edge rows", func(t *testing.T) { testArgmaxEdges(t, b) })
	t.Run("sample", func(t *testing.T) {
		u := make([]float32, rows)
		for i := range u {
			u[i] = float32(r.Float64())
		}
		const temp = 0.7
		got := b.Sample(lb, temp, u)
		for i := 0; i < rows; i++ {
			mx := math.Inf(-1)
			for c := 0; c < cols; c++ {
				mx = math.Max(mx, float64(l[i*cols+c]))
			}
			p := make([]float64, cols)
			var s float64
			for c := range p {
				p[c] = math.Exp((float64(l[i*cols+c]) - mx) / temp)
				s += p[c]
			}
			target, run, want := float64(u[i])*s, 0.0, cols-1
			for c := range p {
				run += p[c]
				if run > target {
					want = c
					break
				}
			}
			if got[i] != want {
				t.Errorf("row %d: sampled %d, want %d", i, got[i], want)
			}
		}
	})
}

// TestFilledScratch checks that a scratch area holds its fill word on its
// first use outside a capture also when it was allocated during one (whose
// memset only the graph's replays run): the flag set then makes the next
// uncaptured use fill it, and each later capture once (the first graph may
// never run), not each use within one. A capture is the flag and the count
// alone (the memset runs at once), so the area is dirtied in between as a
// replay-less graph would leave it. Then that a grown area holds the fill
// whole, where the allocator hands out the outgrown area's address again
// too (the dirtied words would stay: a counter of garbage, a block of rows
// never merged or merged early; kernels/NOTES.md, forty-seventh session).
// Zero is the arrival counters' fill, partEmpty the split GEMVs'.
func TestFilledScratch(t *testing.T) {
	b := newTestBackend(t)
	defer b.enter()() // filledScratch allocates and sets memory with the context current
	for _, fill := range []uint32{0, partEmpty} {
		name := fmt.Sprintf("test_fill_%x", fill)
		filled := func(x *Buf) bool {
			for _, v := range download(b, x) {
				if math.Float32bits(v) != fill {
					return false
				}
			}
			return true
		}
		b.capturing = true
		b.captures++
		p := b.filledScratch(name, 4096, fill)
		if b.scratch[name].filledIn == 0 {
			t.Fatalf("fill %#x: an area allocated during a capture is not marked", fill)
		}
		x := &Buf{p: p, rows: 1, cols: 1024}
		dirty := func(seed uint64) { b.Upload(x, randVec(rand.New(rand.NewPCG(seed, seed)), 1024, 1)) }
		dirty(3)
		if b.filledScratch(name, 4096, fill); filled(x) {
			t.Errorf("fill %#x: filled again by a second use in the same capture", fill)
		}
		b.captures++ // the first capture ended, its graph never run; another begins
		if b.filledScratch(name, 4096, fill); !filled(x) {
			t.Fatalf("fill %#x: not filled by a later capture while still marked", fill)
		}
		b.capturing = false
		dirty(1)
		if q := b.filledScratch(name, 4096, fill); q != p {
			t.Fatalf("fill %#x: the area moved: %#x, then %#x", fill, p, q)
		}
		if !filled(x) {
			t.Fatalf("fill %#x: not filled by the first uncaptured use", fill)
		}
		if b.scratch[name].filledIn != 0 {
			t.Errorf("fill %#x: still marked after the uncaptured use", fill)
		}
		dirty(2)
		q := b.filledScratch(name, 8192, fill)
		t.Logf("fill %#x: grown from %#x to %#x (the same address: %v)", fill, p, q, q == p)
		if !filled(&Buf{p: q, rows: 1, cols: 2048}) {
			t.Fatalf("fill %#x: the grown area is not filled whole", fill)
		}
	}
}

// TestPoolReuse checks that Alloc hands out zeroed buffers also when it
// reuses a freed one.
func TestPoolReuse(t *testing.T) {
	b := newTestBackend(t)
	x := upload(b, 3, 40, randVec(rand.New(rand.NewPCG(1, 1)), 120, 1))
	p := x.p
	b.Free(x)
	y := b.Alloc(3, 40).(*Buf)
	if y.p != p {
		t.Logf("pool did not reuse the buffer (fine, but unexpected)")
	}
	for i, v := range download(b, y) {
		if v != 0 {
			t.Fatalf("reused buffer element %d = %v, want 0", i, v)
		}
	}
}

// TestStreamKernels checks the streaming GEMVs' table against the kernel
// list and the shared memory of gemvw_body's layout (qtool.cu: the staged
// row, the fixed-point chunk figures, the ring at a 16-byte boundary) at
// K = 4096, the largest the ring kernels run, and the split forms' launch
// shapes (gemvShape, splitRun).
func TestStreamKernels(t *testing.T) {
	h200 := &Backend{sms: 132} // the launch shapes' arithmetic alone (no device)
	listed := map[string]bool{}
	for _, k := range gemvKernels {
		listed[k] = true
	}
	for name, k := range streamKernels {
		if !listed[name] {
			t.Errorf("%s: in streamKernels, not in gemvKernels", name)
		}
		if listed[name+"_n"] != k.sumsTwin {
			t.Errorf("%s: sumsTwin %v, gemvKernels has its _n twin: %v", name, k.sumsTwin, listed[name+"_n"])
		}
		if listed[name+"_pc"] != k.pcForm || listed[name+"_pc_n"] != (k.pcForm && k.sumsTwin) {
			t.Errorf("%s: pcForm %v, sumsTwin %v; gemvKernels has its _pc form: %v, that form's _n twin: %v",
				name, k.pcForm, k.sumsTwin, listed[name+"_pc"], listed[name+"_pc_n"])
		}
		if listed[name+"_k"] != k.splitForm || listed[name+"_pc_k"] != (k.pcForm && k.splitForm) {
			t.Errorf("%s: splitForm %v, pcForm %v; gemvKernels has its _k form: %v, its _pc form's: %v",
				name, k.splitForm, k.pcForm, listed[name+"_k"], listed[name+"_pc_k"])
		}
		if k.split {
			t.Errorf("%s: split set in streamKernels", name)
		}
	}
	for _, name := range gemvKernels {
		if strings.HasPrefix(name, "gemv_q4_w") || strings.HasPrefix(name, "gemv_q8_w") {
			if !StreamingGEMV(name) {
				t.Errorf("%s: a streaming kernel's name, not in streamKernels", name)
			}
		}
	}
	for _, c := range []struct {
		name  string
		l     Linear
		rows  int
		smem  int
		fixed bool
	}{
		{"gemv_q4_w2h", Linear{kind: kindQ4, in: 4096, gs: 128}, 16, 8192, false},
		{"gemv_q4_w4h_n", Linear{kind: kindQ4, in: 4096, gs: 128}, 32, 8192 + 1024, true},
		{"gemv_q4_w4a", Linear{kind: kindQ4, in: 4096, gs: 128, perm: 1}, 32, 6*4096 + 1024 + 40960, true},
		{"gemv_q8_w2h", Linear{kind: kindQ8, in: 4096, gs: 128}, 16, 8192 + 2048, true},
		{"gemv_q8_w4a", Linear{kind: kindQ8, in: 4096, gs: 128}, 32, 8192 + 2048 + 49152, true},
		{"gemv_q8_w4a", Linear{kind: kindQ8, in: 4064, gs: 32}, 32, (2*4064+4064/2+15)&^15 + 49152, true},
		{"gemv_q4_w4a_pc_n", Linear{kind: kindQ4, in: 4096, gs: 4096, groups: 1}, 32, 8192 + 1024 + 40960, true},
		{"gemv_q8_w4a_pc", Linear{kind: kindQ8, in: 4096, gs: 4096, groups: 1}, 32, 8192 + 2048 + 49152, true},
	} {
		rows, splits, smem := h200.gemvShape(c.name, gemvStreamRowsTag, &c.l, 1, 4096)
		if rows != c.rows || splits != 1 || smem != c.smem || gemvFixedPoint(c.name) != c.fixed {
			t.Errorf("%s at K = %d: %d rows, %d splits, %d bytes, fixed point %v; want %d, 1, %d, %v",
				c.name, c.l.in, rows, splits, smem, gemvFixedPoint(c.name), c.rows, c.smem, c.fixed)
		}
	}
	// a split form's launch: down's 4 096 rows of 14 336 features on 132
	// multiprocessors split in 2 (one full wave of two blocks a
	// multiprocessor; 4 fill theirs as well), each staging half the row
	down := Linear{kind: kindQ8, in: 14336, gs: 128}
	if rows, splits, smem := h200.gemvShape("gemv_q8_w4h_k", gemvStreamRowsTag, &down, 1, 4096); rows != 32 || splits != 2 || smem != 2*7168+7168/2 {
		t.Errorf("gemv_q8_w4h_k at 4096×14336: %d rows, %d splits, %d bytes; want 32, 2, %d", rows, splits, smem, 2*7168+7168/2)
	}
	// the split forms' runs of chunks (512 features of 8-bit codes) and
	// their shared memory: the run's staged x and its chunks' figures
	for _, c := range []struct {
		l           Linear
		splits, run int
		name        string
		smem        int
	}{
		{Linear{kind: kindQ8, in: 11008, gs: 128}, 3, 4096, "gemv_q8_w4h_k", 2*4096 + 4096/2},
		{Linear{kind: kindQ8, in: 14336, gs: 128}, 2, 7168, "gemv_q8_w4h_k", 2*7168 + 7168/2},
		{Linear{kind: kindQ8, in: 4640, gs: 4640, groups: 1}, 4, 1536, "gemv_q8_w4h_pc_k", 2*1536 + 1536/2},
	} {
		run := splitRun(&c.l, c.splits)
		if smem := streamSmemRun(c.name, &c.l, run); run != c.run || smem != c.smem {
			t.Errorf("%s at K = %d in %d: runs of %d features, %d bytes; want %d, %d", c.name, c.l.in, c.splits, run, smem, c.run, c.smem)
		}
	}
	if StreamingGEMV("gemv_q8_r4u1") || StreamingGEMV("gemv_q4_sh") || gemvFixedPoint("gemv_q8_r4u1") {
		t.Error("gemv_q8_r4u1 or gemv_q4_sh taken for a streaming kernel")
	}
	// the per-channel forms, where one group spans the row: each the
	// shape of the kernel it stands for
	for _, c := range []struct {
		name   string
		groups int
		want   string
	}{
		{"gemv_q4_w4a", 32, "gemv_q4_w4a"},
		{"gemv_q4_w4a", 1, "gemv_q4_w4a_pc"},
		{"gemv_q4_w4h", 1, "gemv_q4_w4h_pc"},
		{"gemv_q4_w2h", 1, "gemv_q4_w2h_pc"},
		{"gemv_q4_w2h_s32", 1, "gemv_q4_w2h_s32"}, // fp32 scales: no _pc form
		{"gemv_q8_w4a", 1, "gemv_q8_w4a_pc"},
		{"gemv_q8_w4h", 1, "gemv_q8_w4h_pc"},
		{"gemv_q8_w2h", 1, "gemv_q8_w2h_pc"},
		{"gemv_q8_w4a", 2, "gemv_q8_w4a"},
	} {
		got := perChannelForm(c.name, &Linear{groups: c.groups})
		gk, _ := streamKernelOf(got)
		if wk := streamKernels[c.name]; got != c.want || gk != wk {
			t.Errorf("perChannelForm(%s, %d groups) = %s (%+v); want %s (%+v)", c.name, c.groups, got, gk, c.want, wk)
		}
	}
}

// TestRegRing checks regRing (without a GPU) against the faster ring of
// each shape BenchmarkGEMVWaves timed on an H200 (132 multiprocessors,
// three blocks of the shared-memory ring a multiprocessor, K = 4096; %
// of copy bandwidth, shared-memory ring / register ring, forty-third and
// forty-fourth sessions). Shapes within two points are ties, either ring
// right; where the shared-memory ring fits two blocks, always registers.
func TestRegRing(t *testing.T) {
	const sms, slots = 132, 3
	for _, c := range []struct {
		kind, rows int
		async      float64 // % of copy, the ring in shared memory
		reg        float64 // and in registers
	}{
		{kindQ4, 6144, 57.8, 58.1},
		{kindQ4, 8448, 66.9, 66.8},
		{kindQ4, 11008, 83.0, 55.6},
		{kindQ4, 12288, 89.8, 59.8},
		{kindQ4, 12672, 90.2, 60.6},
		{kindQ4, 14336, 74.0, 67.4},
		{kindQ4, 16896, 78.3, 73.8},
		{kindQ4, 21120, 87.1, 68.4},
		{kindQ4, 22016, 87.4, 70.8},
		{kindQ4, 24576, 94.9, 76.8},
		{kindQ4, 25344, 94.2, 77.2},
		{kindQ4, 28672, 90.5, 72.7},
		{kindQ8, 6144, 74.8, 73.5},
		{kindQ8, 8448, 74.4, 83.8},
		{kindQ8, 11008, 90.8, 70.1},
		{kindQ8, 12288, 96.3, 76.8},
		{kindQ8, 12672, 94.9, 78.0},
		{kindQ8, 14336, 81.6, 86.7},
		{kindQ8, 16896, 84.5, 91.3},
		{kindQ8, 21120, 93.1, 85.3},
		{kindQ8, 22016, 96.7, 89.1},
		{kindQ8, 24576, 100.1, 95.0},
		{kindQ8, 25344, 98.6, 94.3},
		{kindQ8, 28672, 95.0, 89.7},
	} {
		blocks := (c.rows + 31) / 32
		got := regRing(c.kind, blocks, slots, sms)
		if diff := c.async - c.reg; (diff >= 2 && got) || (diff <= -2 && !got) {
			t.Errorf("%s %d rows: regRing = %v; the rings measured %.1f %% (shared memory) and %.1f %% (registers)", kindNames[c.kind], c.rows, got, c.async, c.reg)
		}
		if !regRing(c.kind, blocks, 2, sms) {
			t.Errorf("%s %d rows: the shared-memory ring at two blocks a multiprocessor picked", kindNames[c.kind], c.rows)
		}
	}
}

// TestKernelNamesInPTX checks (without a GPU) that every kernel the backend
// looks up is in both embedded PTX files.
func TestKernelNamesInPTX(t *testing.T) {
	entry := regexp.MustCompile(`\.entry ([A-Za-z0-9_]+)\(`)
	for _, cc := range [][2]int{{8, 0}, {9, 0}} {
		ptx, arch := kernels.PTX(cc[0], cc[1])
		names := kernelNames()
		if kernels.IsArchSpecific(ptx) {
			names = append(names, hopperKernels...)
		}
		used := map[string]bool{}
		for _, k := range names {
			used[k] = true
			if !strings.Contains(string(ptx), ".entry "+k+"(") {
				t.Errorf("%s PTX lacks kernel %s", arch, k)
			}
		}
		// only live kernels ship: every entry is one the backend looks up
		for _, m := range entry.FindAllStringSubmatch(string(ptx), -1) {
			if !used[m[1]] {
				t.Errorf("%s PTX ships kernel %s, which the backend never launches", arch, m[1])
			}
		}
		// sm_90: every kernel waits for its predecessor, so every launch
		// is a programmatic dependent one; sm_80 has no such launches
		waiting := waitingKernels(ptx)
		for _, k := range names {
			if cc[0] >= 9 && !waiting[k] {
				t.Errorf("%s PTX: kernel %s lacks griddepcontrol.wait (pdl_wait)", arch, k)
			}
			if cc[0] < 9 && waiting[k] {
				t.Errorf("%s PTX: kernel %s has griddepcontrol.wait", arch, k)
			}
		}
	}
}

func TestWaitingKernels(t *testing.T) {
	ptx := []byte(".visible .entry a(\n.param .u64 p\n)\n{\ngriddepcontrol.wait;\nret;\n}\n" +
		".visible .entry b(\n)\n{\nret;\n}\n.visible .entry c(\n)\n{\nbar.sync 0;\ngriddepcontrol.wait;\n}\n")
	got := waitingKernels(ptx)
	if want := map[string]bool{"a": true, "c": true}; !maps.Equal(got, want) {
		t.Errorf("waitingKernels = %v, want %v", got, want)
	}
}

// BenchmarkPrefillAttention times the prefill attention of 512 tokens on
// an fp16 cache (Llama-2-7B heads, and the 16 and 8 of one rank at TP = 2
// and 4) with its query tiles' keys split as the shape chooses (split 0),
// not at all (−1) and at most 1…6 key tiles a block: device time a launch
// from a replayed graph, reported as µs/launch.
func BenchmarkPrefillAttention(bm *testing.B) {
	b := newTestBackend(bm)
	defer func() { b.opt.KVHalf, b.opt.AttnSplit = false, 0 }()
	b.opt.KVHalf = true
	const T, hd = 512, 128
	for _, heads := range []int{32, 16, 8} {
		c := b.NewKVCache(1, T, heads*hd)
		q, k, v, d := b.Alloc(T, heads*hd), b.Alloc(T, heads*hd), b.Alloc(T, heads*hd), b.Alloc(T, heads*hd)
		for i, x := range []runtime.Buf{q, k, v} {
			b.FillRandom(x, uint64(70+i), 1)
		}
		b.StoreKV(c, 0, 0, k, v)
		for _, sp := range []int{0, -1, 1, 2, 3, 4, 5, 6} {
			bm.Run(fmt.Sprintf("heads=%d/split=%d", heads, sp), func(bm *testing.B) {
				b.opt.AttnSplit = sp
				var sec float64
				for bm.Loop() {
					s, err := b.TimeCaptured(20, func() { b.Attention(d, q, c, 0, 0, heads, heads, hd) })
					if err != nil {
						bm.Fatal(err)
					}
					sec = s
				}
				bm.ReportMetric(sec*1e6, "us/launch")
			})
		}
		for _, x := range []runtime.Buf{q, k, v, d} {
			b.Free(x)
		}
		b.FreeKVCache(c)
	}
}

// BenchmarkGEMVWaves times the one-row products of 4- and 8-bit weights
// of width 4096 with the rows of the 7B/8B models' launches (llama2-7b,
// llama3-8b, qwen3-8b: o, q/k/v, one of gate/up, both; a TP=2 rank's q/k/v
// and o; per-channel scales at the shorter ones), timed as bench's
// kernel table times them (TimeDecodeGEMV) and reported as GB/s and % of
// the device's copy bandwidth, each on every streaming kernel that could
// take it — the 32-row ones with the ring in registers and in shared
// memory (gemvWide's two forms) and the 16-row one — with its waves of
// blocks, so that regRing's choice and gemvStreaming's rows rule can be
// checked against one run (TestRegRing holds the H200's figures). A
// launch timed alone is not a launch in a decode step: at 4096×4096 the
// 32-row shared-memory ring read 49 % of copy here against the 16-row
// kernel's 42 %, and decode lost 3 % with it (kernels/NOTES.md,
// forty-fifth session); a rule change wants bench's graph decode too.
// The 32-row shape is a launch's floor: one or two blocks whose 64 KB
// weights and their copies stay in L2, so its µs a launch is what a
// product of any size pays beyond its bytes in a chain of launches (the
// programmatic wait for the one before, x's round trip, the reduction).
func BenchmarkGEMVWaves(bm *testing.B) {
	b := newTestBackend(bm)
	copyBps := b.CopyBandwidth(1 << 30) // as bench measures it
	type shape struct {
		N, K int
		pc   bool // one group a row (the _pc forms)
	}
	var shapes []shape
	for _, N := range []int{32, 2048, 3072, 4096, 6144, 11008, 12288, 14336, 22016, 24576, 28672} {
		shapes = append(shapes, shape{N: N, K: 4096})
	}
	// a TP=2 rank's o (4096×2048), and per-channel scales at the row
	// counts of less than two waves of 16-row blocks
	shapes = append(shapes, shape{N: 4096, K: 2048}, shape{3072, 4096, true}, shape{4096, 4096, true}, shape{6144, 4096, true})
	for fi, f := range []string{"w4a16", "w8a16"} {
		for si, sh := range shapes {
			N, K, format := sh.N, sh.K, f
			if sh.pc {
				format += "-pc"
			}
			spec := Synthetic{Format: format, Dims: []int{N, K}, GroupSize: 128, Seed: uint64(100*fi + si + 2)}
			w, err := b.UploadLinear("bench", &spec)
			if err != nil {
				bm.Fatal(err)
			}
			timed := map[string]bool{}
			for _, form := range []struct {
				noAsync, async bool
				rows           int // streamRows
			}{{}, {noAsync: true}, {async: true}, {noAsync: true, rows: 32}, {async: true, rows: 32}, {rows: 16}} {
				b.opt.NoAsyncGEMV, b.asyncEverywhere, b.streamRows = form.noAsync, form.async, form.rows
				k, R := b.gemvKernel(lin(w), 1, N)
				if timed[k] {
					continue
				}
				timed[k] = true
				rows, _, shm := b.gemvShape(k, R, lin(w), 1, N)
				waves := float64((N+rows-1)/rows) / float64(b.residentBlocks(k, shm)*b.sms)
				bm.Run(fmt.Sprintf("%s/%s/%dx%d/waves=%.2f", format, k, N, K, waves), func(bm *testing.B) {
					var sec, bytes float64
					for bm.Loop() {
						s, n, err := b.TimeDecodeGEMV(w, spec)
						if err != nil {
							bm.Fatal(err)
						}
						sec, bytes = s, n
					}
					bm.ReportMetric(bytes/sec/1e9, "GB/s")
					bm.ReportMetric(100*bytes/sec/copyBps, "%copy")
					bm.ReportMetric(sec*1e6, "us/launch")
				})
			}
			b.opt.NoAsyncGEMV, b.asyncEverywhere, b.streamRows = false, false, 0
			b.FreeLinear(w)
		}
	}
}

// BenchmarkGEMMSplitPlans times the Hopper GEMMs of the 7B/8B shapes whose
// output has few tiles at few activation rows (o, down: N = 4096) under
// each way of splitting K the dispatcher could take — unsplit (S1), S
// splits merged through memory (memS: sum_splits), S splits merged in
// clusters (clS: the most up to S whose clusters fit), the wide form — so
// the split rule (splitPlan, its step costs) can be checked against one
// run: each kernel's device time a call (Options.KernelTimes: launches
// ordered, no dependent-launch overlap) and the call's time with its
// launches back to back. The dispatcher's own pick is the plan "auto".
// (Sixty-third session, H200, W8A8 4096² at 128 rows: 15.8–17.7 µs a
// call unsplit or in clusters, for 4 µs of weight bytes; kernels/NOTES.md
// has where a block's time goes.)
func BenchmarkGEMMSplitPlans(bm *testing.B) {
	b := newTestBackend(bm)
	if !b.HasWGMMA() {
		bm.Skip("no Hopper GEMMs on this device (sm_90a): the split plans are theirs")
	}
	type plan struct {
		name    string
		S       int // b.maxSplits; 0: the dispatcher's
		mem, cl bool
		wide    int
	}
	plans := []plan{{name: "auto"}, {name: "S1", S: 1}, {name: "wide-auto", wide: 1}}
	for S := 2; S <= 4; S++ {
		plans = append(plans, plan{name: fmt.Sprintf("mem%d", S), S: S, mem: true}, plan{name: fmt.Sprintf("cl%d", S), S: S, cl: true})
	}
	for _, format := range []string{"w8a8", "fp16"} {
		for si, sh := range [][2]int{{4096, 4096}, {4096, 11008}, {4096, 14336}} {
			N, K := sh[0], sh[1]
			w, err := b.UploadLinear("bench", &Synthetic{Format: format, Dims: []int{N, K}, GroupSize: 128, Seed: uint64(si + 7)})
			if err != nil {
				bm.Fatal(err)
			}
			for _, M := range []int{128, 256} {
				x, y := b.Alloc(M, K), b.Alloc(M, N)
				b.FillRandom(x, 9, 1)
				for _, p := range plans {
					b.maxSplits, b.opt.NoClusterSplit, b.forceClusterSplit, b.opt.WGWide = p.S, p.mem, p.cl, p.wide
					bm.Run(fmt.Sprintf("%s/%dx%d/M=%d/%s", format, N, K, M, p.name), func(bm *testing.B) {
						benchCalls(bm, b, func() { b.MatMul(y, x, w) })
					})
				}
				b.maxSplits, b.opt.NoClusterSplit, b.forceClusterSplit, b.opt.WGWide = 0, false, false, 0
				b.Free(x)
				b.Free(y)
			}
			b.FreeLinear(w)
		}
	}
}

// benchCalls reports on bm the device time of a call of run (which queues
// kernels only) with its launches back to back (us/call), and each
// kernel's device time a call (Options.KernelTimes: launches ordered, no
// dependent-launch overlap), 20 calls of each.
func benchCalls(bm *testing.B, b *Backend, run func()) {
	var call float64
	var kt map[string]float64
	for bm.Loop() {
		call = b.Time(3, 20, run)
		b.opt.KernelTimes = true
		b.kt.total = nil
		for range 20 {
			run()
		}
		kt = b.KernelTimes()
		b.opt.KernelTimes = false
	}
	bm.ReportMetric(call*1e6, "us/call")
	for _, k := range slices.Sorted(maps.Keys(kt)) {
		bm.ReportMetric(kt[k]/20*1e6, "us/"+k)
	}
}

// BenchmarkGLUForms times the gate/up products with their SwiGLU
// (NormSwiGLU: the norm, then on Hopper one GLU launch) of the 7B/8B
// intermediate sizes at 128–512 activation rows, in the form the
// dispatcher picks (auto: up to 512 rows W8A8's fill forms, gluFillRows) and
// forced wide or narrow (Options.WGWide, no fill), as
// BenchmarkGEMMSplitPlans times its launches (benchCalls). At 128 rows the
// wide W8A8 GLU fills 86 of the H200's 132 multiprocessors (11 008 / 128),
// the fill form 126.
func BenchmarkGLUForms(bm *testing.B) {
	b := newTestBackend(bm)
	if !b.HasWGMMA() {
		bm.Skip("no Hopper GEMMs on this device (sm_90a): the GLU launches are theirs")
	}
	const K = 4096
	nw, err := b.UploadVector("norm", model.FromFloat32([]int{K}, slices.Repeat([]float32{1}, K)))
	if err != nil {
		bm.Fatal(err)
	}
	defer b.FreeVector(nw)
	forms := []struct {
		name       string
		wide, fill int // Options.WGWide, Options.GLUFill
	}{{"auto", 0, 0}, {"wide", 1, -1}, {"narrow", -1, -1}}
	for _, format := range []string{"w8a8", "fp16"} {
		for si, inter := range []int{11008, 14336} {
			var gu [2]runtime.Linear
			for i := range gu {
				if gu[i], err = b.UploadLinear("bench", &Synthetic{Format: format, Dims: []int{inter, K}, GroupSize: 128, Seed: uint64(10*si + i + 31)}); err != nil {
					bm.Fatal(err)
				}
			}
			for _, M := range []int{128, 256, 512} {
				x, y := b.Alloc(M, K), b.Alloc(M, inter)
				b.FillRandom(x, 9, 1)
				for _, f := range forms {
					b.opt.WGWide, b.opt.GLUFill = f.wide, f.fill
					bm.Run(fmt.Sprintf("%s/%dx%d/M=%d/%s", format, inter, K, M, f.name), func(bm *testing.B) {
						benchCalls(bm, b, func() { b.NormSwiGLU(y, x, nw, nil, 1e-5, gu[0], gu[1]) })
					})
				}
				b.opt.WGWide, b.opt.GLUFill = 0, 0
				b.Free(x)
				b.Free(y)
			}
			for _, w := range gu {
				b.FreeLinear(w)
			}
		}
	}
}
