package cuda

import (
	"cmp"
	"fmt"
	"maps"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
	"unsafe"

	"qtool/formats/model"
	"qtool/runtime"
)

// TestMatMulN checks the fused products against one MatMul per weight: the
// same values bit for bit (within mixedFormTol where one launch ran a
// fixed-point GEMV and the other not; within segsSplitTol where a Hopper
// segs launch left K unsplit: checkMatMulN), from one launch
// where gemvPlan allows it (every shipped GEMV kernel but the split-K one)
// and from the one-at-a-time path otherwise. The three weights have row
// counts that leave partial blocks.
func TestMatMulN(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(21, 22))
	fusedKernels := map[string]bool{}
	for _, wc := range weightCases {
		K := 256
		if wc.k > 0 {
			K = wc.k
		}
		outs := []int{rowsFor(b, wc, 200), 72, 40}
		useRing(t, b, wc)
		ws := uploadWeights(t, b, r, wc, "", outs, K)
		for _, M := range []int{1, 3, 5, 130} {
			for _, nw := range []int{2, 3} {
				segs := make([]gemvSeg, nw)
				for i := range segs {
					segs[i].l = lin(ws[i])
				}
				kernel, _, one := b.gemvPlan(segs, M)
				name := fmt.Sprintf("%s/M=%d/n=%d/one-launch=%v", wc.name, M, nw, one)
				t.Run(name, func(t *testing.T) {
					if one {
						fusedKernels[kernel] = true
					}
					checkMatMulN(t, b, r, M, K, outs, ws[:nw])
				})
			}
		}
	}
	for _, k := range gemvKernels {
		if k != "gemv_q4_sh" && !strings.HasSuffix(k, "_n") && !fusedKernels[k] && !t.Failed() { // _n: TestRowSums
			t.Errorf("no case runs the GEMV kernel %s with several weights", k)
		}
	}
}

// uploadWeights uploads weights of case wc with outs[i] rows of K, named
// after the case, tag and i.
func uploadWeights(t *testing.T, b *Backend, r *rand.Rand, wc weightCase, tag string, outs []int, K int) []runtime.Linear {
	t.Helper()
	ws := make([]runtime.Linear, len(outs))
	for i, n := range outs {
		w, _ := wc.make(r, n, K)
		lw, err := b.UploadLinear(fmt.Sprintf("%s.%s%d", wc.name, tag, i), w)
		if err != nil {
			t.Fatalf("%s: upload: %v", wc.name, err)
		}
		ws[i] = lw
	}
	return ws
}

// mixedFormTol bounds the relative difference of a product computed by a
// fixed-point GEMV (gemvFixedPoint) and by one that is not: an fp16-staged
// 4-bit one's rounding (TestMatMul: 3e-4 to 5e-4 of the reference, the
// fixed point's 1e-5 to 3e-5; the fp32 8-bit GEMV's 1e-7).
const mixedFormTol = 2e-3

// launchedBy runs f and returns the kernels it launched.
func launchedBy(b *Backend, f func()) map[string]bool {
	launched := map[string]bool{}
	for k := range launchCounts(b, f) {
		launched[k] = true
	}
	return launched
}

// launchCounts is launchedBy with how many times f launched each kernel.
func launchCounts(b *Backend, f func()) map[string]int {
	before, counts := b.KernelLaunches(), map[string]int{}
	f()
	for k, n := range b.KernelLaunches() {
		if n > before[k] {
			counts[k] = n - before[k]
		}
	}
	return counts
}

// oneLaunch is the kernel that computes every product of ws at M rows in
// one launch (MatMulN, NormMatMulN, NormSwiGLU: gemvPlan), or "" where
// they run one at a time, each as MatMul runs it.
func oneLaunch(b *Backend, ws []runtime.Linear, M int) string {
	segs := make([]gemvSeg, len(ws))
	for i, w := range ws {
		segs[i].l = lin(w)
	}
	if name, _, one := b.gemvPlan(segs, M); one {
		return name
	}
	return ""
}

// arithTol is the tolerance between a product of the one launch of kernel
// fused (oneLaunch; "": the product ran as MatMul runs it) and the same
// product by the kernels alone: tol, or at least mixedFormTol where one of
// them is a fixed-point GEMV and the other is not.
func arithTol(fused string, alone map[string]bool, tol float64) float64 {
	if fused != "" && gemvFixedPoint(fused) != slices.ContainsFunc(slices.Collect(maps.Keys(alone)), gemvFixedPoint) {
		return max(tol, mixedFormTol)
	}
	return tol
}

// checkMatMulN multiplies a random M × K input by ws (outs[i] rows each)
// with MatMulN and with one MatMul a weight, requires the same values bit
// for bit (within arithTol where their kernels' arithmetic differs, within
// 1e-5 where a split form's launches split the rows otherwise, or a Hopper
// segs launch leaves K unsplit where MatMul splits it and sums the splits'
// floats: other parts added), and returns the kernels MatMulN launched.
func checkMatMulN(t *testing.T, b *Backend, r *rand.Rand, M, K int, outs []int, ws []runtime.Linear) map[string]bool {
	t.Helper()
	xb := upload(b, M, K, randVec(r, M*K, 1))
	defer b.Free(xb)
	dst := make([]runtime.Buf, len(ws))
	for i := range dst {
		dst[i] = poisoned(b, M, outs[i])
		defer b.Free(dst[i])
	}
	launched := launchedBy(b, func() { b.MatMulN(dst, xb, ws) })
	fused := oneLaunch(b, ws, M)
	segs := slices.ContainsFunc(slices.Collect(maps.Keys(launched)), func(k string) bool { return strings.HasSuffix(k, "_segs") })
	rows := 0 // the one launch's
	for _, n := range outs[:len(ws)] {
		rows += n
	}
	for i := range dst {
		want := poisoned(b, M, outs[i])
		alone := launchedBy(b, func() { b.MatMul(want, xb, ws[i]) })
		g, w := download(b, dst[i]), download(b, want)
		tol := arithTol(fused, alone, 0)
		if k, _ := streamKernelOf(fused); k.split {
			sf := b.gemvSplits(lin(ws[i]), M, rows)
			sa := b.gemvSplits(lin(ws[i]), M, outs[i])
			if sf != sa {
				tol = max(tol, 1e-5)
			}
		}
		if segs && alone["sum_splits"] { // K unsplit in one launch, split alone: the partial sums added otherwise
			tol = max(tol, segsSplitTol(K))
		}
		if tol > 0 {
			compare(t, fmt.Sprintf("weight %d: MatMulN (%s) against MatMul %v", i, fused, slices.Sorted(maps.Keys(alone))), g, w, tol)
		} else if !slices.Equal(g, w) {
			t.Errorf("weight %d: MatMulN differs from MatMul (first values %v vs %v)", i, g[:4], w[:4])
		}
		b.Free(want)
	}
	return launched
}

// segsSplitTol bounds the relative difference of a product whose K steps
// one accumulator ran through (a segs launch) and the same product split
// along K, its partial sums added in float32 (sum_splits): 1e-5, growing
// with K beyond 4 096 as the two orders' roundings add up (an H200 gave
// 5.7e-5 at K = 49 280, the huge-k cases, where 1e-5 had failed).
func segsSplitTol(K int) float64 {
	return 1e-5 * max(1, float64(K)/4096)
}

// hopperUnsplit returns a test backend whose GEMMs never split K, and
// skips the test, saying why, where the device has no Hopper GEMMs.
func hopperUnsplit(t *testing.T, why string) *Backend {
	t.Helper()
	b := newTestBackend(t)
	if !b.wgmma {
		t.Skip(why)
	}
	b.maxSplits = 1
	t.Cleanup(func() { b.maxSplits = 0 })
	return b
}

// TestMatMulNHopper checks the products of one input with two or three
// weights of one kind as one launch of a Hopper GEMM (gemm_wg_*_segs: each
// weight's tiles at most half the multiprocessors, all of them enough for
// the device or a few) against one MatMul per weight, K unsplit in both:
// the same values bit for bit; every such kernel runs with both sets of
// weights.
func TestMatMulNHopper(t *testing.T) {
	b := hopperUnsplit(t, "no Hopper GEMMs on this device (sm_90a)")
	r := rand.New(rand.NewPCG(23, 24))
	const M = 256 // two row tiles
	nt := b.sms / 4
	for _, oc := range []struct {
		name string
		outs []int
	}{
		{"fill", []int{nt*128 - 56, nt * 128, nt*128 - 8}}, // nt weight tiles each
		{"few", []int{200, 72, 40}},                        // 4, 2, 2 tiles
	} {
		ran := map[string]bool{}
		for _, wc := range weightCases {
			K := 512 // enough K steps for each product alone to split
			if wc.k > 0 {
				K = wc.k * ((512 + wc.k - 1) / wc.k) // a multiple of the case's K: its group size divides it
			}
			if K > 4096 || wc.tall > 0 {
				continue
			}
			ws := uploadWeights(t, b, r, wc, "segs", oc.outs, K)
			for _, nw := range []int{2, 3} {
				t.Run(fmt.Sprintf("%s/%s/n=%d", oc.name, wc.name, nw), func(t *testing.T) {
					for k := range checkMatMulN(t, b, r, M, K, oc.outs, ws[:nw]) {
						if strings.HasSuffix(k, "_segs") {
							ran[k] = true
							t.Logf("one launch: %s", k)
						}
					}
				})
			}
			for _, w := range ws {
				b.FreeLinear(w)
			}
		}
		for _, k := range segsKernels {
			if !ran[k] && !t.Failed() {
				t.Errorf("%s: no case runs %s", oc.name, k)
			}
		}
	}
}

// TestSegsTiles checks the rules of the segs launches (segsTiles) on a
// device of 132 multiprocessors (no GPU needed): whether each product
// alone would split K (both launches) and whether one launch saves a wave
// (W8A8's).
func TestSegsTiles(t *testing.T) {
	b := &Backend{sms: 132}
	segs := func(outs ...int) []gemvSeg {
		s := make([]gemvSeg, len(outs))
		for i, n := range outs {
			s[i].l = &Linear{out: n}
		}
		return s
	}
	for _, c := range []struct {
		name    string
		segs    []gemvSeg
		M, K    int // K steps
		tiles   int
		eachSpl bool
		wave    bool // one launch saves a wave
	}{
		{"7B q/k/v at 128 rows", segs(4096, 4096, 4096), 128, 32, 96, true, true},
		{"8B q/k/v at 128 rows", segs(4096, 1024, 1024), 128, 32, 48, true, true},
		{"7B q/k/v at 256 rows", segs(4096, 4096, 4096), 256, 32, 192, true, true},
		{"7B q at 512 rows fills the device", segs(4096, 4096, 4096), 512, 32, 384, false, false},
		{"7B at 1 024 rows", segs(4096, 4096, 4096), 1024, 32, 768, false, false},
		{"8B at 512 rows: 128, 32 and 32 tiles", segs(4096, 1024, 1024), 512, 32, 192, false, true},
		{"8B at 1 024 rows", segs(4096, 1024, 1024), 1024, 32, 384, false, true},
		{"8B at 2 048 rows: 512, 128 and 128 tiles", segs(4096, 1024, 1024), 2048, 32, 768, false, false},
		{"too few K steps to split", segs(4096, 4096), 128, 7, 64, false, true},
		{"partial tiles", segs(200, 72, 40), 130, 9, 8, true, true},
	} {
		if tiles, each, wave := b.segsTiles(c.segs, c.M, c.K); tiles != c.tiles || each != c.eachSpl || wave != c.wave {
			t.Errorf("%s: segsTiles = %d, %v, %v, want %d, %v, %v", c.name, tiles, each, wave, c.tiles, c.eachSpl, c.wave)
		}
	}
}

// TestW8A8Segs checks the W8A8 products of one input with two or three
// weights of one activation quantizer as one launch of gemm_wg_s8_segs
// (w8a8WGSegs) against one MatMul per weight: the same values bit for bit
// (integer sums, however K splits), with K unsplit (the products' tiles
// together leave no room for a second split on the device), split in
// clusters (few tiles; where the driver runs clusters), and where the plan
// would merge the splits through memory (Options.NoClusterSplit) or the
// quantizers differ, one product at a time; static and per-token
// quantizers.
func TestW8A8Segs(t *testing.T) {
	b := newTestBackend(t)
	if !b.wgmma {
		t.Skip("no Hopper GEMMs on this device (sm_90a)")
	}
	defer func() { b.opt.NoClusterSplit = false }()
	r := rand.New(rand.NewPCG(25, 26))
	const K = 1152 // 9 K steps of 128: at most two splits (deep: 4 096, 32 steps, more)
	// wide weights: at 130 rows (two row tiles) each alone takes at most
	// half the device and splits K, two or three together more than half
	// (unsplit); at 300 rows (three row tiles) each alone more than half,
	// unsplit, a wave each: two take two waves together as apart, three
	// two waves together and three apart (segsTiles)
	nt := (b.sms/6 + 1) * 128
	wide, narrow := []int{nt - 56, nt, nt - 8}, []int{200, 72, 40}
	static, dynamic := [3]float32{0.02, 0.02, 0.02}, [3]float32{}
	for _, tc := range []struct {
		name      string
		outs      []int
		rows      []int
		dynamic   bool
		scales    [3]float32
		noCluster bool
		segs      [2]bool // gemm_wg_s8_segs runs for two and three weights (the "clusters" cases: where the driver runs clusters)
		k         int     // K where not K
	}{
		{"unsplit", wide, []int{130}, false, static, false, [2]bool{true, true}, 0},
		{"unsplit/dynamic", wide, []int{130}, true, dynamic, false, [2]bool{true, true}, 0},
		{"each-fills-half", wide, []int{300}, false, static, false, [2]bool{false, true}, 0},
		{"clusters", narrow, []int{130, 300}, false, static, false, [2]bool{b.clusterSplits, b.clusterSplits}, 0},
		{"clusters/dynamic", narrow, []int{130, 300}, true, dynamic, false, [2]bool{b.clusterSplits, b.clusterSplits}, 0},
		{"through-memory", narrow, []int{130}, false, static, true, [2]bool{}, 0},
		{"quantizers-differ", narrow, []int{130}, false, [3]float32{0.02, 0.03, 0.02}, false, [2]bool{}, 0},
		{"clusters/deep", narrow, []int{130}, false, static, false, [2]bool{b.clusterSplits, b.clusterSplits}, 4096}, // a merge of more rounds where splitPlan picks more splits
	} {
		K := cmp.Or(tc.k, K)
		b.opt.NoClusterSplit = tc.noCluster
		ws := make([]runtime.Linear, 3)
		for i := range ws {
			ws[i] = uploadW8A8(t, b, r, tc.outs[i], K, tc.dynamic, tc.scales[i])
		}
		for _, M := range tc.rows {
			for _, nw := range []int{2, 3} {
				t.Run(fmt.Sprintf("%s/M=%d/n=%d", tc.name, M, nw), func(t *testing.T) {
					launched := checkMatMulN(t, b, r, M, K, tc.outs, ws[:nw])
					if want := tc.segs[nw-2]; launched[w8a8SegsKernel] != want {
						t.Errorf("%s launched %v, want %v (kernels %v)", w8a8SegsKernel, launched[w8a8SegsKernel], want,
							slices.Sorted(maps.Keys(launched)))
					}
				})
			}
		}
		for _, w := range ws {
			b.FreeLinear(w)
		}
	}
}

// TestFusedLinearSteps checks NormMatMulN, NormSwiGLU and MatMulAdd against
// the sequences of operations runtime.Fused names, for every weight case at
// decode (M = 1, 3: the GEMV kernels, the streaming q4 one with the norm and
// SwiGLU inside) and prefill sizes (M = 5: the GEMMs split over K, the sums
// of the splits adding or applying the SwiGLU; M = 130: the fp16-input and
// Hopper GEMMs with the same in their epilogues, the norm written in fp16).
// The residual add and the GEMMs' epilogues are exact; the streaming
// kernel's fused norm sums its squares in another order, so its results may
// differ in the last bits of its staged inputs; and where the one launch
// runs a fixed-point GEMV and a weight alone one that is not (or the
// other way), within mixedFormTol (arithTol).
func TestFusedLinearSteps(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(25, 26))
	streamed := map[string]bool{}
	for ci, wc := range weightCases {
		K := 256
		if wc.k > 0 {
			K = wc.k
		}
		outs := []int{rowsFor(b, wc, 200), 72, 40}
		useRing(t, b, wc)
		ws := make([]runtime.Linear, 4) // three for NormMatMulN; gate and up: 1 and 3 (72 rows each)
		for i, n := range []int{outs[0], 72, 40, 72} {
			w, _ := wc.make(r, n, K)
			lw, err := b.UploadLinear(fmt.Sprintf("%s.%d", wc.name, i), w)
			if err != nil {
				t.Fatalf("%s: upload: %v", wc.name, err)
			}
			ws[i] = lw
		}
		nw, _ := b.UploadVector("norm", model.FromFloat32([]int{K}, randVec(r, K, 1)))
		var nb runtime.Vector
		if ci%2 == 1 { // SmoothQuant-folded norms carry a bias
			nb, _ = b.UploadVector("norm_bias", model.FromFloat32([]int{K}, randVec(r, K, 0.1)))
		}
		const eps = 1e-5
		for _, M := range []int{1, 3, 5, 130} {
			_, streaming, _ := b.gemvPlan([]gemvSeg{{l: lin(ws[0])}}, M)
			if streaming {
				k, _, _ := b.gemvPlan([]gemvSeg{{l: lin(ws[0])}}, M)
				streamed[k] = true
			}
			tol := 0.0
			if streaming {
				tol = 1e-4
			}
			t.Run(fmt.Sprintf("%s/M=%d/streaming=%v", wc.name, M, streaming), func(t *testing.T) {
				if b.wgmma && M >= dequantGEMMMinRows {
					// NormSwiGLU's gate/up pair (gluPair) sums K in one
					// pass: the products it is compared with, unsplit too
					b.maxSplits = 1
					defer func() { b.maxSplits = 0 }()
				}
				x, h := normedInput(b, r, M, K, nw, nb, eps)
				free := []*Buf{x, h}
				defer func() {
					for _, f := range free {
						b.Free(f)
					}
				}()
				checkNormProducts(t, b, x, h, nw, nb, eps, ws[:3], ws[1], ws[3], tol)
				// MatMulAdd: exact
				res := randVec(r, M*outs[0], 1)
				acc, ref, tmp := upload(b, M, outs[0], res), upload(b, M, outs[0], res), poisoned(b, M, outs[0])
				free = append(free, acc, ref, tmp)
				b.MatMul(tmp, h, ws[0])
				b.Add(ref, tmp)
				b.MatMulAdd(acc, h, ws[0])
				compare(t, "MatMulAdd", download(b, acc), download(b, ref), 0)
			})
		}
	}
	for _, k := range []string{"gemv_q4_w4h", "gemv_q4_w4a", "gemv_q4_w2h"} {
		if !streamed[k] && !t.Failed() {
			t.Errorf("no case runs %s with the fused norm and SwiGLU", k)
		}
	}
}

// normedInput uploads a random x [M, K] and returns it with h =
// RMSNorm(x); the caller frees both.
func normedInput(b *Backend, r *rand.Rand, M, K int, nw, nb runtime.Vector, eps float32) (x, h *Buf) {
	x, h = upload(b, M, K, randVec(r, M*K, 1)), poisoned(b, M, K)
	b.RMSNorm(h, x, nw, nb, eps)
	return x, h
}

// normProductsLaunched runs checkNormProducts on a new normed input of M
// rows and returns the kernels it launched.
func normProductsLaunched(t *testing.T, b *Backend, r *rand.Rand, M, K int, nw, nb runtime.Vector, eps float32,
	mm []runtime.Linear, gate, up runtime.Linear, tol float64) map[string]bool {
	t.Helper()
	x, h := normedInput(b, r, M, K, nw, nb, eps)
	defer b.Free(x)
	defer b.Free(h)
	return launchedBy(b, func() { checkNormProducts(t, b, x, h, nw, nb, eps, mm, gate, up, tol) })
}

// checkNormProducts checks NormMatMulN of x by mm and NormSwiGLU of x by
// gate and up against the products of h = RMSNorm(x) (MatMul, then
// SiLUMul) within tol (arithTol); each fused output is compared once both
// ran, so neither may write over the other's.
func checkNormProducts(t *testing.T, b *Backend, x, h *Buf, nw, nb runtime.Vector, eps float32, mm []runtime.Linear,
	gate, up runtime.Linear, tol float64) {
	t.Helper()
	M := x.rows
	var free []*Buf
	defer func() {
		for _, f := range free {
			b.Free(f)
		}
	}()
	dst, want := make([]runtime.Buf, len(mm)), make([]*Buf, len(mm))
	alone := make([]map[string]bool, len(mm))
	for i, w := range mm {
		d, r := poisoned(b, M, lin(w).out), poisoned(b, M, lin(w).out)
		dst[i], want[i] = d, r
		free = append(free, d, r)
		alone[i] = launchedBy(b, func() { b.MatMul(r, h, w) })
	}
	b.NormMatMulN(dst, x, nw, nb, eps, mm)
	fused := oneLaunch(b, mm, M)
	n := lin(gate).out
	g, u, sw := poisoned(b, M, n), poisoned(b, M, n), poisoned(b, M, n)
	free = append(free, g, u, sw)
	pair := launchedBy(b, func() {
		b.MatMul(g, h, gate)
		b.MatMul(u, h, up)
	})
	b.SiLUMul(g, g, u)
	b.NormSwiGLU(sw, x, nw, nb, eps, gate, up)
	swiglu := oneLaunch(b, []runtime.Linear{gate, up}, M)
	for i := range mm {
		compare(t, fmt.Sprintf("NormMatMulN weight %d", i), download(b, dst[i]), download(b, want[i]), arithTol(fused, alone[i], tol))
	}
	compare(t, "NormSwiGLU", download(b, sw), download(b, g), arithTol(swiglu, pair, tol))
}

// TestNormQuantized checks the norm that writes W8A8 products' input
// quantized (static: one scale and offset for all weights; per token)
// against RMSNorm in fp32 followed by the products, which quantize it
// themselves: equal bit for bit, at decode and prefill sizes. Weights with
// different static quantizers take the fp32 norm, as does a static
// quantizer whose codes need the division (actQuant.divisionFree). From 128 rows on Hopper,
// NormSwiGLU's gate and up run as one gemm_wg_s8_glu launch (gluPair),
// here checked against the two products and SiLUMul, in blocks of 64
// rows of each weight and of 128 (gemm_wg_s8_glu_w, Options.WGWide, which
// must then be launched: 170 outputs, two wide blocks, the second's
// second box wholly past N; K = 1152, 9 steps through a ring of 4).
func TestNormQuantized(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(27, 28))
	const K, eps = 1152, 1e-5
	w8a8 := func(n int, dynamic bool, inScale float32) runtime.Linear {
		return uploadW8A8(t, b, r, n, K, dynamic, inScale)
	}
	nw, _ := b.UploadVector("norm", model.FromFloat32([]int{K}, randVec(r, K, 1)))
	nb, _ := b.UploadVector("norm_bias", model.FromFloat32([]int{K}, randVec(r, K, 0.1)))
	for _, tc := range []struct {
		name    string
		dynamic bool
		scales  [4]float32 // NormMatMulN: 0-2; NormSwiGLU: gate 2, up 3
	}{
		{"static", false, [4]float32{0.02, 0.02, 0.02, 0.02}},
		{"dynamic", true, [4]float32{}},
		{"static-mixed", false, [4]float32{0.02, 0.03, 0.02, 0.02}},
		{"static-divides", false, [4]float32{0x1p-31, 0x1p-31, 0x1p-31, 0x1p-31}}, // fp32 norm: actQuant.divisionFree
	} {
		outs := []int{200, 72, 170, 170} // gate/up: N % 4 = 2, the SwiGLU epilogues' column tails
		ws := make([]runtime.Linear, 4)
		for i := range ws {
			ws[i] = w8a8(outs[i], tc.dynamic, tc.scales[i])
		}
		for _, M := range []int{1, 5, 130, 300} {
			for _, wide := range []int{-1, 1} {
				b.opt.WGWide = wide
				t.Run(fmt.Sprintf("%s/M=%d/wide=%d", tc.name, M, wide), func(t *testing.T) {
					l := normProductsLaunched(t, b, r, M, K, nw, nb, eps, ws[:3], ws[2], ws[3], 0)
					if want := wide > 0 && b.HasWideGEMM(ws[2], M); l["gemm_wg_s8_glu_w"] != want {
						t.Errorf("gemm_wg_s8_glu_w launched %v, want %v", l["gemm_wg_s8_glu_w"], want)
					}
				})
			}
			b.opt.WGWide = 0
		}
	}
	// The static quantizer's rounding boundaries: a row of ones normed
	// with eps 0 is the norm's weight, here every column's value on or
	// next to v/scale + offset = j + 0.5, where a quantizer that rounds
	// otherwise than the division (the rmsnorm's codes against quant_act's)
	// shows.
	ws := make([]runtime.Linear, 4)
	for i, n := range []int{200, 72, 170, 170} {
		ws[i] = w8a8(n, false, 0.02)
	}
	q := lin(ws[0]).actQuant()
	edge := make([]float32, K)
	for c := range edge {
		edge[c] = roundingEdge(r, q.scale, q.offset, c%3-1)
	}
	ew, _ := b.UploadVector("norm_edge", model.FromFloat32([]int{K}, edge))
	for _, M := range []int{1, 5, 130} {
		t.Run(fmt.Sprintf("static-boundaries/M=%d", M), func(t *testing.T) {
			ones := make([]float32, M*K)
			for i := range ones {
				ones[i] = 1
			}
			x, h := upload(b, M, K, ones), poisoned(b, M, K)
			defer b.Free(x)
			defer b.Free(h)
			b.RMSNorm(h, x, ew, nil, 0)
			checkNormProducts(t, b, x, h, ew, nil, 0, ws[:3], ws[2], ws[3], 0)
		})
	}
}

// TestW8A8DP4A checks the dp4a W8A8 launches of several weights at decode
// sizes (up to GEMVMaxRows rows): NormMatMulN's two or three weights of
// one quantizer as one w8a8_gemm launch, NormSwiGLU's gate and up as one
// w8a8_glu launch, against the products one at a time (and SiLUMul):
// equal bit for bit. K = 4112 leaves a lane's last batch of loads one
// unit, 5696 four of w8a8_gemm's eight and three of w8a8_glu's four; the
// first weight's 42 rows end in a partial block before the next segment.
// Gate and up of different static quantizers keep their two launches.
func TestW8A8DP4A(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(29, 30))
	const eps = 1e-5
	for _, K := range []int{4112, 5696} {
		nw, _ := b.UploadVector("norm", model.FromFloat32([]int{K}, randVec(r, K, 1)))
		for _, dynamic := range []bool{false, true} {
			// NormMatMulN: 0-2; NormSwiGLU: gate 3, up 4, and 5 with another
			// static quantizer than the gate's
			ws := make([]runtime.Linear, 6)
			for i, n := range []int{42, 136, 20, 42, 42, 42} {
				ws[i] = uploadW8A8(t, b, r, n, K, dynamic, []float32{0.02, 0.02, 0.02, 0.02, 0.02, 0.03}[i])
			}
			for _, M := range []int{1, b.opt.GEMVMaxRows} {
				if !b.w8a8DP4A(M) {
					t.Fatalf("M=%d: the W8A8 products do not run on dp4a", M)
				}
				for _, n := range []int{2, 3} {
					t.Run(fmt.Sprintf("K=%d/dynamic=%v/M=%d/weights=%d", K, dynamic, M, n), func(t *testing.T) {
						x, h := normedInput(b, r, M, K, nw, nil, eps)
						defer b.Free(x)
						defer b.Free(h)
						dst := make([]runtime.Buf, n)
						for i := range dst {
							dst[i] = b.AllocRaw(M, lin(ws[i]).out)
							defer b.Free(dst[i])
						}
						if got := launchCounts(b, func() { b.NormMatMulN(dst, x, nw, nil, eps, ws[:n]) }); got["w8a8_gemm"] != 1 || len(got) != 2 {
							t.Errorf("NormMatMulN launched %v, want rmsnorm and one w8a8_gemm", got)
						}
						sw := b.AllocRaw(M, 42)
						defer b.Free(sw)
						if got := launchCounts(b, func() { b.NormSwiGLU(sw, x, nw, nil, eps, ws[3], ws[4]) }); got["w8a8_glu"] != 1 || len(got) != 2 {
							t.Errorf("NormSwiGLU launched %v, want rmsnorm and one w8a8_glu", got)
						}
						checkNormProducts(t, b, x, h, nw, nil, eps, ws[:n], ws[3], ws[4], 0)
						if dynamic {
							return
						}
						if got := launchCounts(b, func() { b.NormSwiGLU(sw, x, nw, nil, eps, ws[3], ws[5]) }); got["w8a8_glu"] != 0 {
							t.Errorf("NormSwiGLU of two static quantizers launched %v, want no w8a8_glu", got)
						}
						checkNormProducts(t, b, x, h, nw, nil, eps, ws[:1], ws[3], ws[5], 0)
					})
				}
			}
		}
	}
}

// TestGLUPair checks NormSwiGLU where gate and up run as one Hopper GEMM
// (gluPair: gemm_wg_*_glu) against RMSNorm, the two products and SiLUMul
// (unsplit, as the pair): equal within 1e-6 of the largest value (the same
// sums), for every weight kind of weightCases but the GEMV-only ones, at
// 130 and 300 rows of 170 outputs (64-row planes with a tail, N % 4 = 2),
// in narrow blocks and, where the kind has them (Options.WGWide), in
// blocks of two halves (256 activation rows; fp16: 128 rows of each
// weight, 170 outputs in two such blocks, the second's second box wholly
// past N) (the two products then also in wide blocks: TestMatMul checks
// those against the CPU); each pair kernel must be launched.
// Kinds a Hopper GEMM takes only widened (int4 g32, g_idx) keep their two
// products. The W8A8 pair is TestNormQuantized's and TestMLPDownInput's.
func TestGLUPair(t *testing.T) {
	b := hopperUnsplit(t, "no Hopper GEMMs (sm_90a PTX) on this device: no gate/up pair kernels")
	r := rand.New(rand.NewPCG(51, 52))
	ran := map[string]bool{}
	kernel := map[int]string{kindF16: "gemm_wg_f16_glu", kindBF16: "gemm_wg_bf16_glu", kindQ4: "gemm_wg_q4_glu", kindQ8: "gemm_wg_q8_glu"}
	wide := map[int]string{kindF16: "gemm_wg_f16_glu_w", kindBF16: "gemm_wg_bf16_glu_w", kindQ4: "gemm_wg_q4_glu_w", kindQ8: "gemm_wg_q8_glu_w"}
	defer func() { b.opt.WGWide = 0 }()
	const N, eps = 170, 1e-5
	for _, wc := range weightCases {
		if wc.tall > 0 || wc.k > 4096 { // the GEMVs' shapes
			continue
		}
		K := 256
		if wc.k > 0 {
			K = wc.k
		}
		ws := make([]runtime.Linear, 2)
		for i := range ws {
			w, _ := wc.make(r, N, K)
			var err error
			if ws[i], err = b.UploadLinear(wc.name, w); err != nil {
				t.Fatalf("%s: upload: %v", wc.name, err)
			}
		}
		nw, _ := b.UploadVector("norm", model.FromFloat32([]int{K}, randVec(r, K, 1)))
		for _, M := range []int{130, 300} {
			for _, w := range []int{-1, 1} {
				b.opt.WGWide = w
				t.Run(fmt.Sprintf("%s/M=%d/wide=%d", wc.name, M, w), func(t *testing.T) {
					for k := range normProductsLaunched(t, b, r, M, K, nw, nil, eps, ws[:1], ws[0], ws[1], 1e-6) {
						ran[k] = true
					}
				})
			}
		}
	}
	for _, k := range kernel {
		if !ran[k] && !t.Failed() {
			t.Errorf("no case runs %s", k)
		}
	}
	for _, k := range wide {
		if !ran[k] && !t.Failed() {
			t.Errorf("no case runs %s", k)
		}
	}
}

// uploadW8A8 uploads a random W8A8 weight [n, k]: activations quantized
// per token (dynamic) or with scale inScale and offset 2.
func uploadW8A8(t *testing.T, b *Backend, r *rand.Rand, n, k int, dynamic bool, inScale float32) runtime.Linear {
	t.Helper()
	q := &model.Quantized{Bits: 8, Rows: n, Cols: k, Q: make([]int8, n*k), Scale: make([]float32, n)}
	for i := range q.Q {
		q.Q[i] = int8(r.IntN(255) - 127)
	}
	w := &model.W8A8{Weight: q, Dynamic: dynamic, Bias: make([]float32, n)}
	if !dynamic {
		w.InputScale, w.InputOffset = inScale, 2
		w.DeqScale, w.QuantBias = make([]float32, n), make([]int32, n)
	}
	for i := 0; i < n; i++ {
		q.Scale[i] = float32(0.001 + 0.01*r.Float64())
		w.Bias[i] = float32(r.Float64() - 0.5)
		if !dynamic {
			w.DeqScale[i] = inScale * q.Scale[i]
			w.QuantBias[i] = int32(r.IntN(2000) - 1000)
		}
	}
	lw, err := b.UploadLinear("w8a8", w)
	if err != nil {
		t.Fatal(err)
	}
	return lw
}

// checkFormed runs seq and fused on two copies of the residual x [M, K]:
// the results must be equal bit for bit, and fused must take one launch
// fewer than seq where a producer writes its consumer's input in the
// consumer's form (formed: no quant_act or to_half), as many otherwise.
func checkFormed(t *testing.T, b *Backend, x []float32, M, K int, formed bool, seq, fused func(x runtime.Buf)) {
	t.Helper()
	want, got := upload(b, M, K, x), upload(b, M, K, x)
	defer b.Free(want)
	defer b.Free(got)
	n0 := b.launches
	seq(want)
	n1 := b.launches
	fused(got)
	compare(t, "residual", download(b, got), download(b, want), 0)
	nSeq, nFused := n1-n0, b.launches-n1
	wantN := nSeq
	if formed {
		wantN--
	}
	if nFused != wantN {
		t.Errorf("%d launches, want %d (the sequence: %d)", nFused, wantN, nSeq)
	}
}

// TestMLPDownInput checks runtime.Fused's MLP where the SwiGLU is written
// in the form down's GEMM takes (inputFor) against the sequence it stands
// for: the residual equal bit for bit, with one launch fewer (no quant_act,
// no to_half) where the SwiGLU is so formed and the same launches where it
// is not. W8A8 (int8 codes of down's static quantizer): gemm_wg_s8_glu on
// Hopper, the mma.sync GEMM's epilogue, split or not; not formed for decode
// rows, a per-token quantizer, a static one whose codes need the division
// (actQuant.divisionFree), or gate and up with different quantizers on
// Hopper. fp16, bf16, 4- and 8-bit weights (fp16): the Hopper pair
// kernels from 128 rows, in both block forms (Options.WGWide 0 and 1:
// the wide pairs' quantized and fp16 outputs).
func TestMLPDownInput(t *testing.T) {
	b := newTestBackend(t)
	defer func() { b.maxSplits, b.opt.NoWGMMA = 0, false }()
	r := rand.New(rand.NewPCG(41, 42))
	const K, inter, eps = 512, 640, 1e-5 // 8 K steps of w8a8_mma: two splits of up where the tiles are few
	nw, _ := b.UploadVector("norm", model.FromFloat32([]int{K}, randVec(r, K, 1)))
	nb, _ := b.UploadVector("norm_bias", model.FromFloat32([]int{K}, randVec(r, K, 0.1)))
	uploadCase := func(wc string, n, k int) runtime.Linear {
		return uploadWeights(t, b, r, weightCaseNamed(t, wc), "", []int{n}, k)[0]
	}
	type mlpCase struct {
		name      string
		weights   func() (gate, up, down runtime.Linear)
		maxSplits int
		noWGMMA   bool
		formed    func(M int) bool // the SwiGLU is written in down's form at M rows
	}
	w8a8 := func(upScale float32, dynamic bool) func() (gate, up, down runtime.Linear) {
		return func() (gate, up, down runtime.Linear) {
			return uploadW8A8(t, b, r, inter, K, false, 0.02), uploadW8A8(t, b, r, inter, K, false, upScale), uploadW8A8(t, b, r, K, inter, dynamic, 0.05)
		}
	}
	int8Formed := func(sameQ bool) func(M int) bool {
		return func(M int) bool {
			return M > b.opt.GEMVMaxRows && (b.wgmmaKernel("w8a8_mma", M) == "" || sameQ)
		}
	}
	float := func(wc string) func() (gate, up, down runtime.Linear) {
		return func() (gate, up, down runtime.Linear) {
			return uploadCase(wc, inter, K), uploadCase(wc, inter, K), uploadCase(wc, K, inter)
		}
	}
	pairFormed := func(M int) bool { return b.wgmmaKernel("gemm_h_f16", M) != "" }
	never := func(int) bool { return false }
	cases := []mlpCase{
		{"w8a8-static", w8a8(0.02, false), 0, false, int8Formed(true)},
		{"w8a8-static/unsplit", w8a8(0.02, false), 1, false, int8Formed(true)},
		{"w8a8-static/mma.sync", w8a8(0.02, false), 0, true, int8Formed(true)},
		{"w8a8-static/mma.sync/unsplit", w8a8(0.02, false), 1, true, int8Formed(true)},
		{"w8a8-static/gate≠up", w8a8(0.03, false), 0, false, int8Formed(false)},
		{"w8a8-dynamic", w8a8(0.02, true), 0, false, never},
		{"w8a8-static/divides", func() (gate, up, down runtime.Linear) {
			return uploadW8A8(t, b, r, inter, K, false, 0.02), uploadW8A8(t, b, r, inter, K, false, 0.02), uploadW8A8(t, b, r, K, inter, false, 0x1p31)
		}, 0, false, never},
	}
	for _, wc := range []string{"f16", "bf16", "awq-int4-asym-g128", "w8-g128-offset"} {
		cases = append(cases, mlpCase{wc, float(wc), 0, false, pairFormed})
	}
	for _, tc := range cases {
		b.maxSplits, b.opt.NoWGMMA = tc.maxSplits, tc.noWGMMA
		gate, up, down := tc.weights()
		for _, M := range []int{1, 5, 130, 300} {
			for _, wide := range []int{0, 1} { // 1: the wide pair and GEMMs where there are (Options.WGWide)
				if wide > 0 && M < 128 {
					continue
				}
				b.opt.WGWide = wide
				t.Run(fmt.Sprintf("%s/M=%d/wide=%d", tc.name, M, wide), func(t *testing.T) {
					checkFormed(t, b, randVec(r, M*K, 1), M, K, tc.formed(M), func(x runtime.Buf) {
						runtime.MLPSeq(b, x, nw, nb, eps, gate, up, down)
					}, func(x runtime.Buf) {
						b.MLP(x, nw, nb, eps, gate, up, down)
					})
				})
			}
			b.opt.WGWide = 0
		}
	}
}

// TestAttentionAdd checks runtime.Fused's AttentionAdd against the
// sequence it stands for: the residual equal bit for bit, with one launch
// fewer where the prefill attention writes o's input in the form o's
// product takes (an fp16 cache, head size 128, at least attnTCMinRows rows;
// its query tiles split or not — unsplit in blocks of two key groups,
// attn_tc_f16_q_g and _h_g, on 32 query rows a block (_q_g32, _h_g32) and
// on 64 (Options.NoAttnRows32) —, after a prefix): int8 codes for a W8A8 o
// with a static quantizer (attn_tc_f16_q: no quant_act), fp16 for an o
// whose GEMM takes fp16 (attn_tc_f16_h: no to_half), and the same launches
// where it does not (a per-token quantizer, a static one whose codes need
// the division, actQuant.divisionFree; an fp32 cache, head size 64, rows
// too few for the tensor-core attention).
func TestAttentionAdd(t *testing.T) {
	b := newTestBackend(t)
	defer func() { b.opt.KVHalf, b.opt.AttnSplit = false, 0 }()
	r := rand.New(rand.NewPCG(61, 62))
	const heads, kvHeads = 4, 2
	for _, hd := range []int{128, 64} {
		K := heads * hd
		for _, half := range []bool{true, false} {
			b.opt.KVHalf = half
			c := b.NewKVCache(1, 400, kvHeads*hd)
			for _, oc := range []struct {
				name   string
				upload func() runtime.Linear
			}{
				{"w8a8-static", func() runtime.Linear { return uploadW8A8(t, b, r, K, K, false, 0.01) }},
				{"w8a8-dynamic", func() runtime.Linear { return uploadW8A8(t, b, r, K, K, true, 0.01) }},
				{"w8a8-static-divides", func() runtime.Linear { return uploadW8A8(t, b, r, K, K, false, 0x1p-31) }},
				{"f16", func() runtime.Linear { return uploadWeights(t, b, r, weightCaseNamed(t, "f16"), "o", []int{K}, K)[0] }},
				{"awq-int4", func() runtime.Linear {
					return uploadWeights(t, b, r, weightCaseNamed(t, "awq-int4-asym-g128"), "o", []int{K}, K)[0]
				}},
			} {
				o := oc.upload()
				for _, tc := range []struct {
					T, pos0, split int
					rows64         bool // Options.NoAttnRows32
				}{{5, 0, 0, false}, {130, 0, 0, false}, {130, 0, 1, false}, {130, 0, -1, false}, {130, 0, -1, true},
					{200, 150, 0, false}, {200, 150, -1, false}, {200, 150, -1, true}, {200, 150, 2, false}} {
					name := fmt.Sprintf("hd=%d/half=%v/o=%s/T=%d/pos0=%d/split=%d/rows64=%v", hd, half, oc.name, tc.T, tc.pos0, tc.split, tc.rows64)
					t.Run(name, func(t *testing.T) {
						b.opt.AttnSplit, b.opt.NoAttnRows32 = tc.split, tc.rows64
						defer func() { b.opt.NoAttnRows32 = false }()
						kv := upload(b, tc.T, kvHeads*hd, randVec(r, tc.T*kvHeads*hd, 1))
						defer b.Free(kv)
						b.StoreKV(c, 0, tc.pos0, kv, kv)
						q := upload(b, tc.T, K, randVec(r, tc.T*K, 1))
						defer b.Free(q)
						formable := oc.name == "w8a8-static" || !strings.HasPrefix(oc.name, "w8a8") && b.halfGEMM(lin(o), tc.T, false)
						formed := formable && half && hd == 128 && tc.T >= attnTCMinRows
						checkFormed(t, b, randVec(r, tc.T*K, 1), tc.T, K, formed, func(x runtime.Buf) {
							runtime.AttentionAddSeq(b, x, q, c, 0, tc.pos0, heads, kvHeads, hd, o)
						}, func(x runtime.Buf) {
							b.AttentionAdd(x, q, c, 0, tc.pos0, heads, kvHeads, hd, o)
						})
					})
				}
				b.FreeLinear(o)
			}
		}
	}
}

// weightCaseNamed returns the weight case of that name (weightCases).
func weightCaseNamed(t *testing.T, name string) weightCase {
	t.Helper()
	for _, c := range weightCases {
		if c.name == name {
			return c
		}
	}
	t.Fatalf("no weight case %q", name)
	return weightCase{}
}

// TestRowSums checks the row sums of a decode step (rowsums.go) on the
// steps of a layer: o's residual add → norm, gate/up and SwiGLU → down's
// residual add → norm and q. Each normed GEMV must find the sums its
// producer wrote and run the _n kernel, and the results must equal those
// of the same steps with Options.NoRowSums: the first residual add bit for
// bit, the normed products within 1e-4 (their sums of squares are added in
// another order, which can flip the rounding of a staged input), what
// follows within 2e-4 and, past a second norm, 5e-4; also with every
// product's input reaching thousands (o's input and the residual with
// setLargeFeatures, the norm weight 1 000 on those features), where the
// fp16-staged 4-bit GEMVs stage x a second time, scaled
// (TestMatMulLargeInputs), and the fixed-point ones scale each chunk. A
// write or a launch between producer and consumer, or freeing the buffer,
// leaves no sums to read.
func TestRowSums(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(29, 30))
	const qdim, inter = 512, 256
	// rows enough for gemv_q4_w4a (K ≤ 4096), and for gemv_q4_w4h (with
	// Options.NoAsyncGEMV: useRing)
	tall, taller := (64*b.sms+127)/128*128+256, (tallRegRing*b.sms+127)/128*128+256
	var q4 func(r *rand.Rand, n, k int) (model.Tensor, []float64)
	uploads := 0
	upLinear := func(n, k int) runtime.Linear {
		w, _ := q4(r, n, k)
		uploads++
		l, err := b.UploadLinear(fmt.Sprintf("w%d", uploads), w)
		if err != nil {
			t.Fatalf("upload [%d %d]: %v", n, k, err)
		}
		return l
	}
	ran := map[string]bool{}
	shapes := []struct {
		scales string // the scales' form: the half form (Linear.szh), that of one group a row (rows of several chunks), or fp32
		N, nq  int    // the hidden size, q's rows
	}{{"half", 256, tall}, {"half", 256, taller}, {"half", tall, 256}, {"half-pc", 2080, tall}, {"half-pc", 2080, taller}, {"s32", 256, tall}}
	t.Cleanup(func() { b.opt.NoAsyncGEMV = false })
	for _, sh := range shapes {
		N, nq := sh.N, sh.nq
		b.opt.NoAsyncGEMV = nq == taller
		q4 = quantCase(4, 128, 1, false)
		if sh.scales == "half-pc" {
			q4 = quantCase(4, 0, 1, false)
		}
		if sh.scales != "s32" {
			q4 = halfScaled(q4)
		}
		wo, gate, up, down := upLinear(N, qdim), upLinear(inter, N), upLinear(inter, N), upLinear(N, inter)
		wq := upLinear(nq, N) // gemv_q4_w4a_n (_pc_n), gemv_q4_w4h_n, gemv_q4_w2h_n (K > 4096)
		nwv := randVec(r, N, 1)
		nw, _ := b.UploadVector(fmt.Sprintf("norm%d", N), model.FromFloat32([]int{N}, nwv))
		nwv = slices.Clone(nwv) // the large cases' norm: the large features' weights 1 000
		for _, c := range largeFeatures(N) {
			nwv[c] = 1000
		}
		nwLarge, _ := b.UploadVector(fmt.Sprintf("norm%d.large", N), model.FromFloat32([]int{N}, nwv))
		var nb runtime.Vector
		if N != 256 {
			nb, _ = b.UploadVector(fmt.Sprintf("bias%d", N), model.FromFloat32([]int{N}, randVec(r, N, 0.1)))
		}
		for _, M := range []int{1, 3} {
			for _, large := range []bool{false, true} {
				t.Run(fmt.Sprintf("%s/N=%d/q=%d/M=%d/large=%v", sh.scales, N, nq, M, large), func(t *testing.T) {
					a, res := randVec(r, M*qdim, 1), randVec(r, M*N, 1)
					norm := nw
					if large { // every product's input reaches thousands (TestMatMulLargeInputs): the fp16-staged 4-bit GEMVs' second staging
						setLargeFeatures(a, M, qdim)
						setLargeFeatures(res, M, N)
						norm = nwLarge
					}
					// run the steps and return every output; withSums: each
					// normed GEMV must find its producer's sums
					run := func(withSums bool) [][]float32 {
						b.opt.NoRowSums = !withSums
						defer func() { b.opt.NoRowSums = false }()
						att, x := upload(b, M, qdim, a), upload(b, M, N, res)
						g, q := poisoned(b, M, inter), poisoned(b, M, nq)
						defer func() {
							for _, f := range []*Buf{att, x, g, q} {
								b.Free(f)
							}
						}()
						// expect checks what the normed GEMV of x finds and notes
						// its kernel
						expect := func(w runtime.Linear, rows int) {
							if got := b.sumsIn(x).p != 0; got != withSums {
								t.Errorf("row sums found: %v, want %v", got, withSums)
							}
							name, _ := b.gemvKernel(lin(w), M, rows)
							ran[name+"_n"] = true
						}
						b.MatMulAdd(x, att, wo)
						out := [][]float32{download(b, x)}
						expect(gate, 2*inter)
						b.NormSwiGLU(g, x, norm, nb, 1e-5, gate, up)
						b.MatMulAdd(x, g, down)
						expect(wq, nq)
						b.NormMatMulN([]runtime.Buf{q}, x, norm, nb, 1e-5, []runtime.Linear{wq})
						return append(out, download(b, g), download(b, x), download(b, q))
					}
					got, want := run(true), run(false)
					for i, what := range []string{"o", "SwiGLU", "down", "q"} {
						compare(t, what+" with row sums", got[i], want[i], []float64{0, 1e-4, 2e-4, 5e-4}[i])
					}
				})
			}
		}
	}
	for _, k := range gemvKernels {
		if strings.HasSuffix(k, "_n") && !ran[k] && !t.Failed() {
			t.Errorf("no case runs %s", k)
		}
	}
	// nothing stale: an Upload, a launch, BufPtr or freeing the buffer
	// between producer and consumer; freeing another buffer is harmless
	wo := upLinear(256, qdim)
	att, x, other := upload(b, 1, qdim, randVec(r, qdim, 1)), poisoned(b, 1, 256), poisoned(b, 1, 256)
	defer func() {
		for _, f := range []*Buf{att, x, other} {
			b.Free(f)
		}
	}()
	for _, between := range []struct {
		name  string
		do    func()
		stays bool
	}{
		{"Upload", func() { b.Upload(x, randVec(r, 256, 1)) }, false},
		{"a launch", func() { b.Add(other, x) }, false},
		{"BufPtr", func() { b.BufPtr(x) }, false},
		{"Free of the buffer, then Alloc", func() { b.Free(x); x = b.Alloc(1, 256).(*Buf) }, false},
		{"Free of another buffer", func() { b.Free(b.Alloc(1, 1)) }, true},
	} {
		b.MatMulAdd(x, att, wo)
		if b.sumsIn(x).p == 0 {
			t.Fatalf("MatMulAdd left no row sums")
		}
		between.do()
		if got := b.sumsIn(x).p != 0; got != between.stays {
			t.Errorf("after %s: row sums found %v, want %v", between.name, got, between.stays)
		}
	}
}

// compare fails unless got equals want bit for bit (tol 0) or within tol
// relative (relErr).
func compare(t *testing.T, what string, got, want []float32, tol float64) {
	t.Helper()
	if tol == 0 {
		if !slices.Equal(got, want) {
			t.Errorf("%s differs from the unfused sequence", what)
		}
		return
	}
	checkClose(t, what, got, f64(want), tol)
}

// TestRoPEStoreKV checks the fused RoPE and cache store against RoPE of q
// and k followed by StoreKV, for every cache type and both RoPE layouts, at
// a decode step and prefill chunks (T = 40: heads share their angles): q, k
// and the cache equal bit for bit.
func TestRoPEStoreKV(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(23, 24))
	const heads, kvHeads, hd, maxSeq, layers = 8, 2, 64, 64, 2
	kvDim := kvHeads * hd
	quant := make([]runtime.KVQuant, layers)
	for l := range quant {
		q := &quant[l]
		for _, v := range []*[]float32{&q.KScale, &q.KOffset, &q.VScale, &q.VOffset} {
			*v = randVec(r, kvDim, 1)
		}
		for i := range q.KScale {
			q.KScale[i] = 0.01 + 0.02*abs32(q.KScale[i])
			q.VScale[i] = 0.01 + 0.02*abs32(q.VScale[i])
			q.KOffset[i] *= 4
			q.VOffset[i] *= 4
		}
	}
	newCache := func(kind string) runtime.KVCache {
		switch kind {
		case "f16":
			b.opt.KVHalf = true
			defer func() { b.opt.KVHalf = false }()
		case "i8":
			c, err := b.NewInt8KVCache(maxSeq, kvDim, quant)
			if err != nil {
				t.Fatal(err)
			}
			return c
		}
		return b.NewKVCache(layers, maxSeq, kvDim)
	}
	for _, kind := range []string{"f32", "f16", "i8"} {
		for _, layout := range []model.RopeLayout{model.RopeHalf, model.RopeInterleaved} {
			for _, tc := range []struct{ T, pos0 int }{{1, 37}, {5, 0}, {40, 3}} {
				t.Run(fmt.Sprintf("%s/%v/T=%d/pos0=%d", kind, layout, tc.T, tc.pos0), func(t *testing.T) {
					q, k, v := randVec(r, tc.T*heads*hd, 1), randVec(r, tc.T*kvDim, 1), randVec(r, tc.T*kvDim, 1)
					ca, cb := newCache(kind), newCache(kind)
					defer b.FreeKVCache(ca)
					defer b.FreeKVCache(cb)
					qa, ka, va := upload(b, tc.T, heads*hd, q), upload(b, tc.T, kvDim, k), upload(b, tc.T, kvDim, v)
					qb, kb, vb := upload(b, tc.T, heads*hd, q), upload(b, tc.T, kvDim, k), upload(b, tc.T, kvDim, v)
					b.RoPE(qa, hd, tc.pos0, 1e6, layout)
					b.RoPE(ka, hd, tc.pos0, 1e6, layout)
					b.StoreKV(ca, 1, tc.pos0, ka, va)
					b.RoPEStoreKV(cb, 1, tc.pos0, qb, kb, vb, hd, 1e6, layout)
					for _, p := range [][2]*Buf{{qa, qb}, {ka, kb}} {
						if g, w := download(b, p[1]), download(b, p[0]); !slices.Equal(g, w) {
							t.Errorf("rotated values differ from RoPE's")
						}
					}
					if g, w := cacheBytes(b, cb), cacheBytes(b, ca); !slices.Equal(g, w) {
						t.Errorf("cache differs from StoreKV's")
					}
					for _, x := range []*Buf{qa, ka, va, qb, kb, vb} {
						b.Free(x)
					}
				})
			}
		}
	}
}

// TestNormMatMulStoreKV checks the q/k/v products with RoPE and the KV
// store in their epilogue (qtool.cu's gemm_wg_*_segs_kv) against the
// sequence runtime.Fused names (NormMatMulN, then RoPEStoreKV): q and the
// fp16 cache bit for bit, for fp16, 4-bit and W8A8 weights (static and
// per-token quantizers), both RoPE layouts and heads of 64 and 128, 130 rows (a partial row tile)
// from position 7 and 200 from 0; the fused kernel launched and no
// store_kv. An fp32 cache, which the epilogue does not take, runs the
// sequence (store_kv launched) with the same results. (The shapes are ones
// whose products alone split K, so that the sequence too runs them as one
// segs launch and its sums are the fused launch's: kvSegs takes that launch
// up to 512 rows also where the sequence would split K one product at a
// time, and the values then differ in float32 rounding.)
func TestNormMatMulStoreKV(t *testing.T) {
	b := newTestBackend(t)
	if !b.wgmma {
		t.Skip("no Hopper GEMMs on this device (sm_90a)")
	}
	defer func() { b.opt.KVHalf = false }()
	r := rand.New(rand.NewPCG(81, 82))
	const K, theta = 2048, 1e4
	nw, err := b.UploadVector("norm", model.FromFloat32([]int{K}, randVec(r, K, 1)))
	if err != nil {
		t.Fatal(err)
	}
	defer b.FreeVector(nw)
	ran := map[string]bool{} // the fused kernels the cases launched
	defer func() {
		for _, k := range segsKVKernels {
			if !ran[k] && !t.Failed() {
				t.Errorf("no case runs %s", k)
			}
		}
	}()
	for _, kind := range []string{"f16", "awq-int4-asym-g128", "w8a8", "w8a8-dynamic"} {
		for _, hd := range []int{64, 128} {
			heads, kvHeads := 8, 2
			qDim, kvDim := heads*hd, kvHeads*hd
			ws := make([]runtime.Linear, 3)
			for i, n := range []int{qDim, kvDim, kvDim} {
				switch kind {
				case "w8a8", "w8a8-dynamic":
					ws[i] = uploadW8A8(t, b, r, n, K, kind == "w8a8-dynamic", 0.02)
				default:
					ws[i], _ = uploadCase(t, b, r, weightCaseNamed(t, kind), n, K)
				}
			}
			for _, half := range []bool{true, false} {
				for _, layout := range []model.RopeLayout{model.RopeHalf, model.RopeInterleaved} {
					for _, tc := range []struct{ M, pos0 int }{{130, 7}, {200, 0}} {
						name := fmt.Sprintf("%s/hd=%d/f16cache=%v/%v/M=%d", kind, hd, half, layout, tc.M)
						t.Run(name, func(t *testing.T) {
							ran[checkNormMatMulStoreKV(t, b, r, ws, nw, K, qDim, kvDim, tc.M, tc.pos0, half, runtime.RoPEKV{
								Layer: 1, Pos0: tc.pos0, HeadDim: hd, Theta: theta, Layout: layout})] = true
						})
					}
				}
			}
			for _, w := range ws {
				b.FreeLinear(w)
			}
		}
	}
}

// checkNormMatMulStoreKV runs NormMatMulStoreKV and its sequence on caches
// of maxSeq 256 and two layers (fp16 where half) for TestNormMatMulStoreKV
// and returns the _segs_kv kernel the fused call launched ("" if none).
func checkNormMatMulStoreKV(t *testing.T, b *Backend, r *rand.Rand, ws []runtime.Linear, nw runtime.Vector, K, qDim, kvDim, M, pos0 int, half bool, kv runtime.RoPEKV) string {
	t.Helper()
	b.opt.KVHalf = half
	ca, cb := b.NewKVCache(2, 256, kvDim), b.NewKVCache(2, 256, kvDim)
	defer b.FreeKVCache(ca)
	defer b.FreeKVCache(cb)
	x := upload(b, M, K, randVec(r, M*K, 1))
	defer b.Free(x)
	var qkv [2][]runtime.Buf
	for i := range qkv {
		qkv[i] = []runtime.Buf{poisoned(b, M, qDim), poisoned(b, M, kvDim), poisoned(b, M, kvDim)}
		for _, y := range qkv[i] {
			defer b.Free(y)
		}
	}
	seq := kv
	seq.Cache = ca
	runtime.NormMatMulStoreKVSeq(b, qkv[0], x, nw, nil, 1e-5, ws, seq)
	kv.Cache = cb
	launched := launchedBy(b, func() { b.NormMatMulStoreKV(qkv[1], x, nw, nil, 1e-5, ws, kv) })
	fusedKernel := ""
	for k := range launched {
		if strings.HasSuffix(k, "_segs_kv") {
			fusedKernel = k
		}
	}
	switch {
	case half && (fusedKernel == "" || launched["store_kv_f16"]):
		t.Errorf("launched %v, want a _segs_kv kernel and no store_kv_f16", slices.Sorted(maps.Keys(launched)))
	case !half && (fusedKernel != "" || !launched["store_kv"]):
		t.Errorf("an fp32 cache launched %v, want store_kv", slices.Sorted(maps.Keys(launched)))
	}
	if g, w := download(b, qkv[1][0]), download(b, qkv[0][0]); !slices.Equal(g, w) {
		i := 0
		for g[i] == w[i] {
			i++
		}
		t.Errorf("q differs from the sequence's at %d (row %d, column %d): %v against %v", i, i/qDim, i%qDim, g[i], w[i])
	}
	if g, w := cacheBytes(b, cb), cacheBytes(b, ca); !slices.Equal(g, w) {
		n := 0
		for j := range g {
			if g[j] != w[j] {
				n++
			}
		}
		t.Errorf("the cache differs from the sequence's in %d of %d bytes", n, len(g))
	}
	return fusedKernel
}

// TestRoPEAttention checks runtime.Fused's RoPEAttention against the
// sequence it stands for (RoPEStoreKV, then Attention) for every cache
// type, both RoPE layouts and head sizes 64, 128 and 256, at positions whose
// keys fit one split and need several: the output and the cache equal bit
// for bit, one launch fewer for a decode row (the kernel rotates and stores
// the row's key itself, its angles from the cache's rope_table), the same
// launches for two rows.
func TestRoPEAttention(t *testing.T) {
	b := newTestBackend(t)
	defer func() { b.opt.KVHalf = false }()
	r := rand.New(rand.NewPCG(63, 64))
	const heads, kvHeads, maxSeq, theta = 8, 2, 400, 1e4
	for _, hd := range []int{64, 128, 256} {
		kvDim, K := kvHeads*hd, heads*hd
		quant := []runtime.KVQuant{{KScale: make([]float32, kvDim), KOffset: make([]float32, kvDim), VScale: make([]float32, kvDim), VOffset: make([]float32, kvDim)}}
		for i := range kvDim {
			q := &quant[0]
			q.KScale[i], q.VScale[i] = 0.01+0.02*r.Float32(), 0.01+0.02*r.Float32()
			q.KOffset[i], q.VOffset[i] = 8*r.Float32()-4, 8*r.Float32()-4
		}
		newCache := func(kind string) runtime.KVCache {
			if kind == "i8" {
				c, err := b.NewInt8KVCache(maxSeq, kvDim, quant)
				if err != nil {
					t.Fatal(err)
				}
				return c
			}
			b.opt.KVHalf = kind == "f16"
			defer func() { b.opt.KVHalf = false }()
			return b.NewKVCache(1, maxSeq, kvDim)
		}
		kinds := []string{"f32", "f16", "i8"}
		if hd == 256 {
			kinds = []string{"f16"}
		}
		for _, kind := range kinds {
			for _, layout := range []model.RopeLayout{model.RopeHalf, model.RopeInterleaved} {
				for _, tc := range []struct{ T, pos0 int }{{1, 0}, {1, 20}, {1, 299}, {2, 150}} {
					t.Run(fmt.Sprintf("hd=%d/%s/%v/T=%d/pos0=%d", hd, kind, layout, tc.T, tc.pos0), func(t *testing.T) {
						ca, cb := newCache(kind), newCache(kind)
						defer b.FreeKVCache(ca)
						defer b.FreeKVCache(cb)
						b.ropeTable(cache(cb), hd, theta) // made once a cache: not a launch of the step
						if tc.pos0 > 0 {                  // the earlier positions' keys and values
							kv := randVec(r, tc.pos0*kvDim, 1)
							kvb := upload(b, tc.pos0, kvDim, kv)
							b.StoreKV(ca, 0, 0, kvb, kvb)
							b.StoreKV(cb, 0, 0, kvb, kvb)
							b.Free(kvb)
						}
						qv, kv, vv := randVec(r, tc.T*K, 1), randVec(r, tc.T*kvDim, 1), randVec(r, tc.T*kvDim, 1)
						bufs := func() (q, k, v *Buf) {
							return upload(b, tc.T, K, qv), upload(b, tc.T, kvDim, kv), upload(b, tc.T, kvDim, vv)
						}
						qa, ka, va := bufs()
						qb, kb, vb := bufs()
						want, got := b.AllocRaw(tc.T, K), b.AllocRaw(tc.T, K)
						defer b.Free(want)
						defer b.Free(got)
						n0 := b.launches
						runtime.RoPEAttentionSeq(b, want, qa, ka, va, ca, 0, tc.pos0, heads, kvHeads, hd, theta, layout)
						n1 := b.launches
						b.RoPEAttention(got, qb, kb, vb, cb, 0, tc.pos0, heads, kvHeads, hd, theta, layout)
						compare(t, "attention", download(b, buf(got)), download(b, buf(want)), 0)
						if nSeq, nFused, fused := n1-n0, b.launches-n1, tc.T == 1; fused && nFused != nSeq-1 || !fused && nFused != nSeq {
							t.Errorf("%d launches, the sequence %d", nFused, nSeq)
						}
						if g, w := cacheBytes(b, cb), cacheBytes(b, ca); !slices.Equal(g, w) {
							t.Errorf("cache differs from RoPEStoreKV's")
						}
						for _, x := range []*Buf{qa, ka, va, qb, kb, vb} {
							b.Free(x)
						}
					})
				}
			}
		}
	}
}

func abs32(x float32) float32 {
	if x < 0 {
		return -x
	}
	return x
}

// cacheBytes downloads the keys and values of every layer of c.
func cacheBytes(b *Backend, c runtime.KVCache) []byte {
	kc := cache(c)
	n := kc.elem() * kc.layers * kc.maxSeq * kc.kvDim
	out := make([]byte, 2*n)
	defer b.enter()()
	b.must(b.drv.MemcpyDtoH(unsafe.Pointer(&out[0]), kc.k, uint64(n)))
	b.must(b.drv.MemcpyDtoH(unsafe.Pointer(&out[n]), kc.v, uint64(n)))
	return out
}

// TestActOrder checks (without a GPU) the column order that makes an
// act-order weight's groups contiguous, and that the reordered weight with
// the gathered input gives the same values.
func TestActOrder(t *testing.T) {
	r := rand.New(rand.NewPCG(27, 28))
	const rows, cols, gs = 3, 256, 64
	q, _ := quantCase(4, gs, 1, true)(r, rows, cols)
	qz := q.(*model.Quantized)
	perm := actOrder(qz, gs)
	if perm == nil {
		t.Fatal("no order for an act-order weight")
	}
	p := permuteColumns(qz, perm)
	want, _ := qz.Float32()
	got, _ := p.Float32()
	for j, c := range perm {
		if int(qz.GIdx[c]) != j/gs {
			t.Fatalf("column %d (feature %d) is in group %d, want %d", j, c, qz.GIdx[c], j/gs)
		}
		for row := 0; row < rows; row++ {
			if got[row*cols+j] != want[row*cols+int(c)] {
				t.Fatalf("row %d: reordered column %d = %v, feature %d = %v", row, j, got[row*cols+j], c, want[row*cols+int(c)])
			}
		}
	}
	for _, tc := range []struct {
		name  string
		edit  func(q *model.Quantized)
		order bool
	}{
		{"no g_idx", func(q *model.Quantized) { q.GIdx = nil }, false},
		{"unequal groups", func(q *model.Quantized) { q.GIdx[0] = (q.GIdx[0] + 1) % int32(q.Groups()) }, false},
		{"group out of range", func(q *model.Quantized) { q.GIdx[5] = 99 }, false},
		{"8-bit", func(q *model.Quantized) { q.Bits = 8 }, false},
	} {
		c := *qz
		c.GIdx = slices.Clone(qz.GIdx)
		tc.edit(&c)
		if got := actOrder(&c, gs); (got != nil) != tc.order {
			t.Errorf("%s: order %v, want one: %v", tc.name, got != nil, tc.order)
		}
	}
}

// TestSpreadBanks checks (without a GPU) that spreadBanks keeps every
// group's features and leaves the streaming GEMV's gathers fewer bank
// conflicts than a random order within the groups: the mean over a
// window's reads of the most lanes sharing a bank.
func TestSpreadBanks(t *testing.T) {
	degree := func(perm []int32) float64 {
		var sum, n float64
		for w := 0; w < len(perm); w += 256 {
			for c := 0; c < 8; c++ {
				var lanes [32]int
				most := 0
				for col := w + c; col < min(w+256, len(perm)); col += 8 {
					lanes[perm[col]%32]++
					most = max(most, lanes[perm[col]%32])
				}
				sum, n = sum+float64(most), n+1
			}
		}
		return sum / n
	}
	for _, tc := range []struct{ in, gs int }{{4096, 128}, {4096, 32}, {11008, 64}, {14336, 128}, {1024, 512}, {352, 32}} {
		perm := shuffledOrder(tc.in, uint64(tc.in*tc.gs))
		spread := slices.Clone(perm)
		spreadBanks(spread, tc.gs)
		for g := 0; g < tc.in; g += tc.gs {
			a, b := slices.Clone(perm[g:g+tc.gs]), slices.Clone(spread[g:g+tc.gs])
			slices.Sort(a)
			slices.Sort(b)
			if !slices.Equal(a, b) {
				t.Fatalf("width %d, group size %d: group at %d changed its features", tc.in, tc.gs, g)
			}
		}
		before, after := degree(perm), degree(spread)
		t.Logf("width %d, group size %d: %.2f lanes a bank a read at most, %.2f spread", tc.in, tc.gs, before, after)
		if after > 2.25 || after >= before {
			t.Errorf("width %d, group size %d: %.2f lanes a bank a read after spreading (random order %.2f), want at most 2.25", tc.in, tc.gs, after, before)
		}
	}
}

// TestStagedOrder checks (without a GPU) the 16-bit column order the
// streaming GEMV gathers by: the thread staging unit u finds the unit's 8
// features at the unit's own place, and widths the kernel does not run
// get none.
func TestStagedOrder(t *testing.T) {
	for _, in := range []int{32, 256, 4096, 11008, 1 << 16} {
		perm := shuffledOrder(in, uint64(in))
		st := stagedOrder(perm)
		if 4*len(st) != 2*in || permBytes(in) != int64(6*in) {
			t.Fatalf("width %d: %d words, %d bytes in all; want %d and %d", in, len(st), permBytes(in), in/2, 6*in)
		}
		for u := 0; u < in/8; u++ {
			if s := xwSwizzle(u); xwSwizzle(s) != u || s/4 != u/4 {
				t.Fatalf("width %d: unit %d placed at %d (back at %d)", in, u, s, xwSwizzle(s))
			}
			for i := 0; i < 8; i++ {
				w := uint32(st[4*xwSwizzle(u)+i/2])
				if got := int32(w >> (16 * (i & 1)) & 0xffff); got != perm[8*u+i] {
					t.Fatalf("width %d: unit %d feature %d = %d, want %d", in, u, i, got, perm[8*u+i])
				}
			}
		}
	}
	for _, in := range []int{48, 1<<16 + 32} {
		if st := stagedOrder(make([]int32, in)); st != nil || permBytes(in) != int64(4*in) {
			t.Errorf("width %d: staged order of %d words, %d bytes; want none and %d", in, len(st), permBytes(in), 4*in)
		}
	}
}

// TestAsyncGEMV checks gemv_q4_w4a and gemv_q8_w4a and their _pc forms
// (the ring in shared memory) against gemv_q4_w4h and gemv_q8_w4h and
// theirs (Options.NoAsyncGEMV) on the decode steps that run them: a
// product, q/k/v with the norm (three segments), gate/up with the norm and
// SwiGLU, and a normed product after a residual add that wrote its row
// sums. Each lane computes the same chunks in the same order in both, so
// the results must agree bit for bit (partial blocks, groups of 32, a
// column order; 8-bit rows of several chunks with groups of 32, 128 and
// 160 features, whose scales gemv_q8_w4a's lanes share or do not).
func TestAsyncGEMV(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(41, 42))
	var cases []weightCase
	for _, wc := range weightCases {
		switch wc.name {
		case "awq-int4-g128-tall", "gptq-int4-actorder-g128-tall", "w8-g128-offset-tall":
			cases = append(cases, wc)
		case "gptq-int4-perchannel-tall", "w8-perchannel-offset-tall":
			wc.k = 2080 // the _pc forms over several chunks, the last one partial (TestPerChannelGEMV)
			cases = append(cases, wc)
		}
	}
	// the 8-bit grouped ring over several chunks, the last one partial:
	// groups that tile a chunk (a group's first lane copies its scale,
	// LEAD in qtool.cu; 32 and 128 features) and groups that do not (160)
	cases = append(cases, weightCase{"w8-g32-offset-tall-k4064", 4064, quantCase(8, 32, 2, false), 64},
		weightCase{"w8-g128-offset-tall-k2176", 2176, quantCase(8, 128, 2, false), 64},
		weightCase{"w8-g160-offset-tall-k2080", 2080, quantCase(8, 160, 2, false), 64})
	for _, wc := range cases {
		K := 256
		if wc.k > 0 {
			K = wc.k
		}
		Ms := []int{1, 3}
		if strings.Contains(wc.name, "actorder") {
			Ms = Ms[:1] // each weight its own column order: one launch a weight, q alone at M = 1
		}
		for _, M := range Ms {
			// q/k/v: at M = 1 a little over two blocks of 32 rows a
			// multiprocessor (one wave at three a multiprocessor, two at
			// two), at M = 3 exactly two (two full waves either way); the
			// SwiGLU's gate and up: 4.5 blocks a multiprocessor
			N, G := rowsFor(b, wc, 200), 72*b.sms
			if M > 1 {
				N = 64*b.sms - 112
			}
			ws := uploadWeights(t, b, r, wc, fmt.Sprintf("async%d", M), []int{N, 72, 40, K, G, G}, K) // q, k, v; o; gate, up
			nw, _ := b.UploadVector("async_norm", model.FromFloat32([]int{K}, randVec(r, K, 1)))
			t.Run(fmt.Sprintf("%s/M=%d", wc.name, M), func(t *testing.T) {
				x, res := randVec(r, M*K, 1), randVec(r, M*K, 1)
				run := func(noAsync bool) (out [][]float32) {
					b.opt.NoAsyncGEMV = noAsync
					defer func() { b.opt.NoAsyncGEMV = false }()
					xb, rb := upload(b, M, K, x), upload(b, M, K, res)
					y := []*Buf{poisoned(b, M, N), poisoned(b, M, 72), poisoned(b, M, 40), poisoned(b, M, G)}
					defer func() {
						for _, f := range append(y, xb, rb) {
							b.Free(f)
						}
					}()
					b.MatMul(y[0], xb, ws[0])
					out = append(out, download(b, y[0]))
					b.NormMatMulN([]runtime.Buf{y[0], y[1], y[2]}, xb, nw, nil, 1e-5, ws[:3])
					out = append(out, download(b, y[0]), download(b, y[1]), download(b, y[2]))
					b.NormSwiGLU(y[3], xb, nw, nil, 1e-5, ws[4], ws[5])
					out = append(out, download(b, y[3]))
					b.MatMulAdd(rb, xb, ws[3]) // writes the row sums the next normed product reads
					b.NormMatMulN([]runtime.Buf{y[0], y[1], y[2]}, rb, nw, nil, 1e-5, ws[:3])
					return append(out, download(b, rb), download(b, y[0]), download(b, y[1]), download(b, y[2]))
				}
				var got [][]float32
				ringInShared := func(k string) bool { sk, _ := streamKernelOf(k); return sk.ring != 0 }
				if launched := launchedBy(b, func() { got = run(false) }); !slices.ContainsFunc(slices.Collect(maps.Keys(launched)), ringInShared) {
					t.Fatalf("no GEMV with its ring in shared memory ran (%v)", slices.Sorted(maps.Keys(launched)))
				}
				want := run(true)
				for i, what := range []string{"MatMul", "q", "k", "v", "SwiGLU", "residual add", "q after the add", "k after the add", "v after the add"} {
					compare(t, what, got[i], want[i], 0)
				}
			})
		}
	}
}
