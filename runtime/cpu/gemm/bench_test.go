package gemm

import (
	"fmt"
	"math/rand/v2"
	"testing"

	"gonum.org/v1/gonum/blas"
	"gonum.org/v1/gonum/blas/blas32"
)

// benchShapes are the products of one 512-token chunk of the 5M-parameter
// test model (hidden 256, FFN 768, vocab 4096) plus a decode GEMV.
var benchShapes = []shape{
	{512, 256, 256},   // q/o projections
	{512, 128, 256},   // k/v projections
	{512, 768, 256},   // gate/up
	{512, 256, 768},   // down
	{512, 4096, 256},  // logits
	{1, 4096, 4096},   // decode GEMV
	{1, 768, 256},     // small decode GEMV
	{64, 512, 64},     // attention scores (64 queries × 512 keys, head 64)
	{64, 64, 512},     // attention scores × values
	{2048, 2048, 512}, // larger square-ish
}

type benchData struct {
	a, b, c []float32
}

func newBenchData(sh shape) benchData {
	r := rand.New(rand.NewPCG(7, 8))
	return benchData{
		a: randSlice(r, sh.m*sh.k),
		b: randSlice(r, sh.n*sh.k),
		c: make([]float32, sh.m*sh.n),
	}
}

func reportGFLOPS(b *testing.B, sh shape) {
	flops := 2 * float64(sh.m) * float64(sh.n) * float64(sh.k) * float64(b.N)
	b.ReportMetric(flops/b.Elapsed().Seconds()/1e9, "GFLOP/s")
}

func benchImpl(b *testing.B, im *impl, rows bool) {
	for _, sh := range benchShapes {
		for _, threads := range []int{1, 2} {
			b.Run(fmt.Sprintf("%dx%dx%d/t%d", sh.m, sh.n, sh.k, threads), func(b *testing.B) {
				d := newBenchData(sh)
				fill := func(j0, j1 int, dst []float32) { copy(dst, d.b[j0*sh.k:j1*sh.k]) }
				b.SetBytes(int64(4 * (sh.m*sh.k + sh.n*sh.k)))
				for b.Loop() {
					if rows {
						matMulNTRows(im, sh.m, sh.n, sh.k, d.a, sh.k, fill, d.c, sh.n, threads)
					} else {
						matMulNT(im, sh.m, sh.n, sh.k, d.a, sh.k, d.b, sh.k, d.c, sh.n, false, threads)
					}
				}
				reportGFLOPS(b, sh)
			})
		}
	}
}

// BenchmarkMatMulNT measures the kernel set picked for this CPU.
func BenchmarkMatMulNT(b *testing.B) { benchImpl(b, best, false) }

// BenchmarkMatMulNTRows measures the fill-callback variant (fill is a copy).
func BenchmarkMatMulNTRows(b *testing.B) { benchImpl(b, best, true) }

// BenchmarkMatMulNTImpls measures the other assembly kernel sets (AVX2 on
// an AVX-512 machine).
func BenchmarkMatMulNTImpls(b *testing.B) {
	for _, im := range impls() {
		if im == best || im == generic {
			continue
		}
		b.Run(im.name, func(b *testing.B) { benchImpl(b, im, false) })
	}
}

// BenchmarkMatMulNTGeneric measures the pure-Go kernels.
func BenchmarkMatMulNTGeneric(b *testing.B) { benchImpl(b, generic, false) }

// BenchmarkMatMulNTNaive measures a plain float32 triple loop (single
// thread) for the speed-up ratio.
func BenchmarkMatMulNTNaive(b *testing.B) {
	for _, sh := range benchShapes {
		if sh.m*sh.n*sh.k > 1<<28 {
			continue
		}
		b.Run(fmt.Sprintf("%dx%dx%d/t1", sh.m, sh.n, sh.k), func(b *testing.B) {
			d := newBenchData(sh)
			for b.Loop() {
				for i := 0; i < sh.m; i++ {
					ar := d.a[i*sh.k : (i+1)*sh.k]
					for j := 0; j < sh.n; j++ {
						br := d.b[j*sh.k : (j+1)*sh.k]
						var s float32
						for p, v := range ar {
							s += v * br[p]
						}
						d.c[i*sh.n+j] = s
					}
				}
			}
			reportGFLOPS(b, sh)
		})
	}
}

// BenchmarkGonumSgemm measures gonum's blas32 Sgemm (its pure-Go
// implementation, which uses its own goroutines) on the same products.
func BenchmarkGonumSgemm(b *testing.B) {
	for _, sh := range benchShapes {
		b.Run(fmt.Sprintf("%dx%dx%d", sh.m, sh.n, sh.k), func(b *testing.B) {
			d := newBenchData(sh)
			A := blas32.General{Rows: sh.m, Cols: sh.k, Stride: sh.k, Data: d.a}
			B := blas32.General{Rows: sh.n, Cols: sh.k, Stride: sh.k, Data: d.b}
			C := blas32.General{Rows: sh.m, Cols: sh.n, Stride: sh.n, Data: d.c}
			for b.Loop() {
				blas32.Gemm(blas.NoTrans, blas.Trans, 1, A, B, 0, C)
			}
			reportGFLOPS(b, sh)
		})
	}
}

// BenchmarkDot measures Dot at an attention head size and a hidden size.
func BenchmarkDot(b *testing.B) {
	for _, n := range []int{64, 256, 4096} {
		b.Run(fmt.Sprint(n), func(b *testing.B) {
			r := rand.New(rand.NewPCG(9, 10))
			x, y := randSlice(r, n), randSlice(r, n)
			var s float32
			for b.Loop() {
				s += Dot(x, y)
			}
			b.ReportMetric(2*float64(n)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
		})
	}
}
