package cuda

import (
	"fmt"
	"maps"
	"math"
	"math/rand/v2"
	"slices"
	"testing"

	"qtool/formats/model"
	"qtool/runtime"
)

// TestGLUFill checks the W8A8 GLU fill forms (qtool.cu's
// gemm_wg_s8_glu_f88 and _f112; Options.GLUFill) against the launches
// of gemm_wg_s8_glu (or its wide form) they stand for, bit for bit (the
// same integer sums, fin and SwiGLU) at 128 activation rows: 11 008 and
// 14 336 outputs (on 132 multiprocessors 126 blocks of 88 rows and 128 of
// 112; gluFillRows says which here), 10 976 (a partial last block) with a
// partial K step (4 160); at 256 and 512 rows (two and four tiles of
// activation rows) and 200 (a partial last tile); static and per-token
// quantizers; gate and up swapped (the up weight at the lower address:
// upFirst); the SwiGLU into NormSwiGLU's output and, through MLP,
// quantized for a W8A8 down (QOut); and one pair of weights through both
// fill forms in turn (each its own tensor map, gluF).
func TestGLUFill(t *testing.T) {
	b := newTestBackend(t)
	if !b.wgmma {
		t.Skip("no Hopper GEMMs on this device (sm_90a)")
	}
	defer func() { b.opt.GLUFill = 0 }()
	r := rand.New(rand.NewPCG(95, 96))
	const eps = 1e-5
	ran := map[string]bool{}
	for _, c := range []struct {
		Ms            []int // activation rows, one weight pair through each in turn
		N, K          int
		dynamic, swap bool
	}{{[]int{128}, 11008, 4096, false, false}, {[]int{128}, 14336, 4096, true, false}, {[]int{128}, 10976, 4160, false, true},
		{[]int{256}, 11008, 4096, false, false}, {[]int{256}, 14336, 4096, true, false}, {[]int{200}, 10976, 4160, false, true},
		{[]int{512, 256}, 11008, 4096, true, false}} { // 112 rows, then 88
		gate := uploadW8A8(t, b, r, c.N, c.K, c.dynamic, 0.02)
		up := uploadW8A8(t, b, r, c.N, c.K, c.dynamic, 0.02)
		if c.swap {
			gate, up = up, gate
		}
		down := uploadW8A8(t, b, r, c.K, c.N, false, 0.02)
		nw, err := b.UploadVector("norm", model.FromFloat32([]int{c.K}, randVec(r, c.K, 1)))
		if err != nil {
			t.Fatal(err)
		}
		for _, M := range c.Ms {
			b.opt.GLUFill = 0
			np := b.gluFillRows(M, c.N)
			if np == 0 {
				t.Logf("M=%d, N=%d: no fill form on %d multiprocessors", M, c.N, b.sms)
				continue
			}
			want := gluFillKernels[np/112]
			xv := randVec(r, M*c.K, 1)
			for _, step := range []struct {
				name string
				cols int
				run  func(y, x runtime.Buf)
			}{
				{"NormSwiGLU", c.N, func(y, x runtime.Buf) { b.NormSwiGLU(y, x, nw, nil, eps, gate, up) }},
				{"MLP", c.K, func(y, _ runtime.Buf) { b.MLP(y, nw, nil, eps, gate, up, down) }}, // y: the residual, x's copy
			} {
				t.Run(fmt.Sprintf("M=%d/N=%d/K=%d/dynamic=%v/swap=%v/%s", M, c.N, c.K, c.dynamic, c.swap, step.name), func(t *testing.T) {
					var got [2][]float32
					var launched [2]map[string]bool
					for i, fill := range []int{-1, 0} {
						b.opt.GLUFill = fill
						x := upload(b, M, c.K, xv)
						y := poisoned(b, M, step.cols)
						if step.cols == c.K {
							b.Upload(y, xv)
						}
						launched[i] = launchedBy(b, func() { step.run(y, x) })
						got[i] = download(b, y)
						b.Free(x)
						b.Free(y)
					}
					if !launched[1][want] || launched[0][want] {
						t.Fatalf("launched %v without the fill, %v with it; want %s with it alone",
							slices.Sorted(maps.Keys(launched[0])), slices.Sorted(maps.Keys(launched[1])), want)
					}
					ran[want] = true
					sameBits(t, got[1], got[0], step.cols)
				})
			}
		}
		for _, w := range []runtime.Linear{gate, up, down} {
			b.FreeLinear(w)
		}
		b.FreeVector(nw)
	}
	if b.sms == 132 {
		for _, k := range gluFillKernels {
			if !ran[k] && !t.Failed() {
				t.Errorf("no case runs %s", k)
			}
		}
	}
}

// TestS8FillGEMM checks the plain int8 GEMM's fill form (qtool.cu's
// gemm_wg_s8_f112; Options.S8Fill) against gemm_wg_s8, bit for bit (the
// same integer sums and w8a8_out), stored (MatMul) and added (MatMulAdd):
// where s8Fill's rule picks it (o's and down's 4 096 outputs at 128
// activation rows, K split in threes; 384 rows, unsplit) and forced
// elsewhere: 4 000 outputs (a partial last weight tile) with a partial K
// step (4 160) at 128 rows (in threes) and 200 (a partial last activation
// tile, unsplit), and 5 600 outputs (K split in pairs); static and
// per-token quantizers.
func TestS8FillGEMM(t *testing.T) {
	b := newTestBackend(t)
	if !b.wgmma {
		t.Skip("no Hopper GEMMs on this device (sm_90a)")
	}
	defer func() { b.opt.S8Fill = 0 }()
	r := rand.New(rand.NewPCG(97, 98))
	splits := map[int]bool{}
	for _, c := range []struct {
		M, N, K int
		dynamic bool
		fill    int // Options.S8Fill of the fill's run: 0 the rule, 1 forced
	}{
		{128, 4096, 4096, false, 0}, {128, 4096, 11008, true, 0}, {384, 4096, 4096, true, 0},
		{128, 4000, 4160, false, 1}, {200, 4000, 4160, true, 1}, {128, 5600, 2048, true, 1},
	} {
		w := uploadW8A8(t, b, r, c.N, c.K, c.dynamic, 0.02)
		xv, rv := randVec(r, c.M*c.K, 1), randVec(r, c.M*c.N, 1)
		steps := (c.K + 127) / 128
		b.opt.S8Fill = c.fill
		if !b.s8Fill(c.M, c.N, steps) {
			b.FreeLinear(w)
			if c.fill > 0 || b.sms == 132 {
				t.Errorf("M=%d, N=%d, K=%d: s8Fill declines on %d multiprocessors", c.M, c.N, c.K, b.sms)
			}
			continue
		}
		S, _, _ := b.splitPlan(s8FillKernel, (c.M+127)/128*((c.N+s8FillRows-1)/s8FillRows), steps, b.sms)
		splits[S] = true
		for _, op := range []struct {
			name string
			run  func(y, x runtime.Buf)
		}{
			{"MatMul", func(y, x runtime.Buf) { b.MatMul(y, x, w) }},
			{"MatMulAdd", func(y, x runtime.Buf) { b.MatMulAdd(y, x, w) }},
		} {
			t.Run(fmt.Sprintf("M=%d/N=%d/K=%d/dynamic=%v/splits=%d/%s", c.M, c.N, c.K, c.dynamic, S, op.name), func(t *testing.T) {
				var got [2][]float32
				var launched [2]map[string]bool
				for i, fill := range []int{-1, c.fill} {
					b.opt.S8Fill = fill
					x := upload(b, c.M, c.K, xv)
					y := poisoned(b, c.M, c.N)
					if op.name == "MatMulAdd" {
						b.Upload(y, rv)
					}
					launched[i] = launchedBy(b, func() { op.run(y, x) })
					got[i] = download(b, y)
					b.Free(x)
					b.Free(y)
				}
				if !launched[1][s8FillKernel] || launched[0][s8FillKernel] || !launched[0]["gemm_wg_s8"] {
					t.Fatalf("launched %v without the fill, %v with it; want gemm_wg_s8, then %s",
						slices.Sorted(maps.Keys(launched[0])), slices.Sorted(maps.Keys(launched[1])), s8FillKernel)
				}
				sameBits(t, got[1], got[0], c.N)
			})
		}
		b.FreeLinear(w)
	}
	if b.sms == 132 && !t.Failed() {
		for _, S := range []int{1, 2, 3} {
			if !splits[S] {
				t.Errorf("no case runs the fill form in %d splits", S)
			}
		}
	}
}

// sameBits fails t at the first output of the fill form (got, rows of cols
// values) whose bits differ from the form it stands for (want).
func sameBits(t *testing.T, got, want []float32, cols int) {
	t.Helper()
	for i := range want {
		if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			t.Fatalf("output %d (row %d, column %d): %g with the fill, %g without", i, i/cols, i%cols, got[i], want[i])
		}
	}
}
