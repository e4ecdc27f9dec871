// Package gemm holds the float32 matrix kernels of qtool's pure-Go CPU
// inference backend: C = A·Bᵀ products where B is a row-major weight
// [n, k] (the nn.Linear layout), a variant whose B rows are produced on
// demand (dequantized weight panels), and the Dot/Axpy vector helpers used
// by attention.
//
// The products are cache-blocked: a block of B rows (nc rows × kc of k) is
// packed into micro-panels of NR rows interleaved along k, and a
// register-blocked micro-kernel multiplies MR rows of A, read in place, by
// one micro-panel into an MR×NR tile of C. On amd64 the micro-kernels are
// assembly, picked at run time from the CPU features: AVX-512F (12×32 tile)
// or AVX2+FMA (6×16); elsewhere, or with the purego build tag, a pure-Go
// 4×4 kernel is used. Threads split the columns of C (rows of B), so each
// weight row is packed (or filled) by one goroutine only; when there are too
// few columns they split the rows of A instead. A single activation row
// (m == 1, decoding) takes a dot-product path that streams each weight row
// once, split across threads by output column.
//
// c must not overlap a or b. Shape errors are programmer errors and panic.
package gemm

import (
	"fmt"
	"runtime"
	"sync"
)

// impl is one set of kernels with its blocking parameters. The package
// picks the best one for the running CPU once (best); tests run every
// available impl.
type impl struct {
	name   string
	mr, nr int // micro-tile: mr rows of A × nr rows of B
	kcMax  int // k-block: a packed B micro-panel (kc×nr) should sit in L1
	mc     int // rows of A per block (multiple of mr), kept in L2
	nc     int // rows of B per packed block (multiple of nr)
	// pack is packPanels or a faster equivalent.
	pack func(dst, src []float32, ld, rows, kn, w int)
	// kernel computes the mr×nr tile C = A·Bpᵀ over kc, reading the mr
	// rows of A in place (row r at a[r*lda:]) and B from a packed
	// micro-panel bp (kc steps of nr floats); acc adds to C instead of
	// overwriting.
	kernel func(kc int, a []float32, lda int, bp, c []float32, ldc int, acc bool)
	// tail, when set, is kernel for tailMR (< mr) rows of A, used for the
	// last rows of A when at most tailMR of them remain.
	tailMR int
	tail   func(kc int, a []float32, lda int, bp, c []float32, ldc int, acc bool)
	// dot4 sets out[r] = Σ_i x[i]*b[r*ldb+i] for r < 4, i < len(x).
	dot4 func(x, b []float32, ldb int, out *[4]float32)
	dot  func(a, b []float32) float32
	axpy func(alpha float32, x, y []float32)
}

// best is the fastest kernel set for this CPU; it is chosen once at start-up
// and never modified.
var best = selectImpl()

// MatMulNT computes c[i*ldc+j] = Σ_k a[i*lda+k] * b[j*ldb+k] for i<m, j<n
// (C = A·Bᵀ; B is a row-major weight [n, k] like nn.Linear.weight). If
// accumulate, it adds to c instead of overwriting. threads<=0 means
// runtime.GOMAXPROCS(0). It panics if a slice is too short for the shape
// (a programmer error).
func MatMulNT(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, accumulate bool, threads int) {
	matMulNT(best, m, n, k, a, lda, b, ldb, c, ldc, accumulate, threads)
}

// MatMulNTRows is MatMulNT (without accumulate) where rows of B are
// produced on demand: fill(j0, j1, dst) must write rows j0..j1-1 of B (each
// k floats, contiguous, stride k) into dst. Every row of B is requested
// exactly once per call, so a quantized weight is dequantized once per call
// rather than once per activation row. fill may be called concurrently from
// several goroutines for disjoint row ranges.
func MatMulNTRows(m, n, k int, a []float32, lda int, fill func(j0, j1 int, dst []float32), c []float32, ldc int, threads int) {
	matMulNTRows(best, m, n, k, a, lda, fill, c, ldc, threads)
}

// Dot returns Σ a[i]*b[i]. It panics if len(b) < len(a).
func Dot(a, b []float32) float32 {
	if len(b) < len(a) {
		panic(fmt.Sprintf("gemm.Dot: len(b)=%d < len(a)=%d", len(b), len(a)))
	}
	return best.dot(a, b[:len(a)])
}

// Axpy does y[i] += alpha*x[i] for i < len(x). It panics if len(y) < len(x).
func Axpy(alpha float32, x, y []float32) {
	if len(y) < len(x) {
		panic(fmt.Sprintf("gemm.Axpy: len(y)=%d < len(x)=%d", len(y), len(x)))
	}
	best.axpy(alpha, x, y[:len(x)])
}

// KernelName names the kernel set in use ("avx512", "avx2", "generic"),
// for logs and benchmarks.
func KernelName() string { return best.name }

// minParallelFlops is the product size (m·n·k) below which the work is
// done on the calling goroutine: starting goroutines would cost more.
const minParallelFlops = 1 << 17

// minParallelGEMV is the weight size (n·k floats) below which a single-row
// product runs on one goroutine.
const minParallelGEMV = 1 << 19

func numThreads(threads, m, n, k int) int {
	if threads <= 0 {
		threads = runtime.GOMAXPROCS(0)
	}
	if m*n*k < minParallelFlops || (m == 1 && n*k < minParallelGEMV) {
		return 1
	}
	return threads
}

func checkShape(fn string, m, n, k int, a []float32, lda int, c []float32, ldc int) {
	if m < 0 || n < 0 || k < 0 {
		panic(fmt.Sprintf("gemm.%s: negative dimension m=%d n=%d k=%d", fn, m, n, k))
	}
	if m == 0 || n == 0 {
		return
	}
	if lda < k || ldc < n {
		panic(fmt.Sprintf("gemm.%s: lda=%d < k=%d or ldc=%d < n=%d", fn, lda, k, ldc, n))
	}
	if len(a) < (m-1)*lda+k {
		panic(fmt.Sprintf("gemm.%s: len(a)=%d, need %d for m=%d k=%d lda=%d", fn, len(a), (m-1)*lda+k, m, k, lda))
	}
	if len(c) < (m-1)*ldc+n {
		panic(fmt.Sprintf("gemm.%s: len(c)=%d, need %d for m=%d n=%d ldc=%d", fn, len(c), (m-1)*ldc+n, m, n, ldc))
	}
}

// bSource yields rows of B: either a strided matrix or a fill callback.
type bSource struct {
	b    []float32
	ldb  int
	fill func(j0, j1 int, dst []float32)
}

func matMulNT(im *impl, m, n, k int, a []float32, lda int, b []float32, ldb int, c []float32, ldc int, accumulate bool, threads int) {
	checkShape("MatMulNT", m, n, k, a, lda, c, ldc)
	if m == 0 || n == 0 {
		return
	}
	if k == 0 {
		if !accumulate {
			for i := 0; i < m; i++ {
				clear(c[i*ldc : i*ldc+n])
			}
		}
		return
	}
	if ldb < k || len(b) < (n-1)*ldb+k {
		panic(fmt.Sprintf("gemm.MatMulNT: len(b)=%d ldb=%d too short for n=%d k=%d", len(b), ldb, n, k))
	}
	run(im, m, n, k, a, lda, bSource{b: b, ldb: ldb}, c, ldc, accumulate, numThreads(threads, m, n, k))
}

func matMulNTRows(im *impl, m, n, k int, a []float32, lda int, fill func(j0, j1 int, dst []float32), c []float32, ldc int, threads int) {
	checkShape("MatMulNTRows", m, n, k, a, lda, c, ldc)
	if m == 0 || n == 0 {
		return
	}
	if k == 0 {
		for i := 0; i < m; i++ {
			clear(c[i*ldc : i*ldc+n])
		}
		return
	}
	run(im, m, n, k, a, lda, bSource{fill: fill}, c, ldc, false, numThreads(threads, m, n, k))
}

// run splits the product across threads and runs each part.
func run(im *impl, m, n, k int, a []float32, lda int, src bSource, c []float32, ldc int, acc bool, threads int) {
	if m == 1 {
		// Decode: stream each B row once, split by output column.
		units := (n + gemvRows - 1) / gemvRows
		parallel(min(threads, units), func(t, nt int) {
			j0 := units * t / nt * gemvRows
			j1 := min(units*(t+1)/nt*gemvRows, n)
			if j0 < j1 {
				gemv(im, j0, j1, k, a[:k], src, c, acc)
			}
		})
		return
	}
	mr, nr := im.mr, im.nr
	kBlocks := (k + im.kcMax - 1) / im.kcMax
	kc := (k + kBlocks - 1) / kBlocks
	panelsA := (m + mr - 1) / mr
	g := gemmArgs{im: im, m: m, k: k, kc: kc, a: a, lda: lda, src: src, c: c, ldc: ldc, acc: acc}
	unitsB := (n + nr - 1) / nr
	if threads > unitsB && src.fill == nil && panelsA >= 2*threads {
		// Too few columns to share: split the rows of A instead (each
		// thread packs the few B rows itself).
		parallel(threads, func(t, nt int) {
			g.block(panelsA*t/nt*mr, min(panelsA*(t+1)/nt*mr, m), 0, n)
		})
		return
	}
	parallel(min(threads, unitsB), func(t, nt int) {
		j0 := unitsB * t / nt * nr
		j1 := min(unitsB*(t+1)/nt*nr, n)
		if j0 < j1 {
			g.block(0, m, j0, j1)
		}
	})
}

// parallel runs f(t, threads) for t < threads, on the calling goroutine
// when threads <= 1.
func parallel(threads int, f func(t, nt int)) {
	if threads <= 1 {
		f(0, 1)
		return
	}
	var wg sync.WaitGroup
	for t := 1; t < threads; t++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			f(t, threads)
		}()
	}
	f(0, threads)
	wg.Wait()
}

// gemvRows is how many B rows the m==1 path hands to one thread at a time.
const gemvRows = 64

// fillFloats bounds the scratch buffer for rows produced by a fill
// callback (per thread): 64K floats (256 KiB) stay in L2.
const fillFloats = 1 << 16

// packFloats bounds the packed B block (per thread): 16K floats (64 KiB).
const packFloats = 1 << 14

// gemvFillFloats bounds the filled rows of the m==1 path (32 KiB, in L1).
const gemvFillFloats = 1 << 13

// gemv computes c[j] (+)= a·B[j] for j0 <= j < j1.
func gemv(im *impl, j0, j1, k int, x []float32, src bSource, c []float32, acc bool) {
	step := gemvRows
	var scratch []float32
	if src.fill != nil {
		// Fill a few rows at a time so that they are still in cache when
		// the dot products read them.
		step = max(4, min(gemvRows, gemvFillFloats/k/4*4))
		scratch = make([]float32, step*k)
	}
	var out [4]float32
	for jb := j0; jb < j1; jb += step {
		je := min(jb+step, j1)
		rows, ldb := src.b, src.ldb
		if src.fill != nil {
			src.fill(jb, je, scratch[:(je-jb)*k])
			rows, ldb = scratch, k
		} else {
			rows = rows[jb*ldb:]
		}
		j := jb
		for ; j+4 <= je; j += 4 {
			im.dot4(x, rows[(j-jb)*ldb:], ldb, &out)
			if acc {
				c[j] += out[0]
				c[j+1] += out[1]
				c[j+2] += out[2]
				c[j+3] += out[3]
			} else {
				c[j], c[j+1], c[j+2], c[j+3] = out[0], out[1], out[2], out[3]
			}
		}
		for ; j < je; j++ {
			o := (j - jb) * ldb
			d := im.dot(x, rows[o:o+k])
			if acc {
				c[j] += d
			} else {
				c[j] = d
			}
		}
	}
}

// gemmArgs is one blocked product.
type gemmArgs struct {
	im    *impl
	m     int
	k, kc int
	a     []float32
	lda   int
	src   bSource
	c     []float32
	ldc   int
	acc   bool
}

// block computes rows i0..i1-1 and columns j0..j1-1 of C on the calling
// goroutine.
//
// Loop nest (outer to inner): jc over blocks of nc B rows, pc over k blocks
// (B block packed into micro-panels), ic over blocks of mc A rows, jr over
// B micro-panels (one stays in L1), ir over groups of mr A rows →
// micro-kernel. A is read in place; only a last group of fewer than mr rows
// is copied into a zero-padded buffer.
func (g *gemmArgs) block(i0, i1, j0, j1 int) {
	im, k, kc, ldc := g.im, g.k, g.kc, g.ldc
	mr, nr := im.mr, im.nr
	// The mc-row block of A is streamed (from L2) once per B micro-panel
	// whatever nc is, so nc mostly sizes the packed B buffer: keep it
	// small (measured as fast as nc=512 here, with less to allocate).
	nc := max(nr, min(im.nc, packFloats/kc/nr*nr))
	if g.src.fill != nil {
		// Bound the scratch holding filled rows (all of k for nc rows).
		nc = max(nr, min(nc, fillFloats/k/nr*nr))
	}
	nc = min(nc, (j1-j0+nr-1)/nr*nr)
	bp := make([]float32, nc*kc)
	tile := make([]float32, mr*nr)
	iFull := i0 + (i1-i0)/mr*mr // rows i0..iFull-1 come in full groups
	var aTail []float32
	if iFull < i1 {
		aTail = make([]float32, mr*kc)
	}
	var scratch []float32
	if g.src.fill != nil {
		scratch = make([]float32, nc*k)
	}
	for jc := j0; jc < j1; jc += nc {
		jn := min(nc, j1-jc)
		rows, ldb := g.src.b, g.src.ldb
		if g.src.fill != nil {
			g.src.fill(jc, jc+jn, scratch[:jn*k])
			rows, ldb = scratch, k
		} else {
			rows = rows[jc*ldb:]
		}
		for pc := 0; pc < k; pc += kc {
			kn := min(kc, k-pc)
			im.pack(bp, rows[pc:], ldb, jn, kn, nr)
			if aTail != nil {
				for i := iFull; i < iFull+mr; i++ {
					t := aTail[(i-iFull)*kn : (i-iFull+1)*kn]
					if i < i1 {
						copy(t, g.a[i*g.lda+pc:i*g.lda+pc+kn])
					} else {
						clear(t)
					}
				}
			}
			add := g.acc || pc > 0
			for ic := i0; ic < i1; ic += im.mc {
				ie := min(ic+im.mc, i1)
				for jr := 0; jr < jn; jr += nr {
					bpan := bp[jr*kn : (jr+nr)*kn]
					nn := min(nr, jn-jr)
					for ir := ic; ir < ie; ir += mr {
						co := ir*ldc + jc + jr
						if ir < iFull && nn == nr {
							ao := ir*g.lda + pc
							im.kernel(kn, g.a[ao:], g.lda, bpan, g.c[co:co+(mr-1)*ldc+nr], ldc, add)
							continue
						}
						mm := min(mr, ie-ir)
						if ir < iFull {
							ao := ir*g.lda + pc
							im.kernel(kn, g.a[ao:], g.lda, bpan, tile, nr, false)
						} else if mm <= im.tailMR {
							im.tail(kn, aTail, kn, bpan, tile, nr, false)
						} else {
							im.kernel(kn, aTail, kn, bpan, tile, nr, false)
						}
						for i := 0; i < mm; i++ {
							dst := g.c[co+i*ldc : co+i*ldc+nn]
							t := tile[i*nr : i*nr+nn]
							if add {
								for j := range dst {
									dst[j] += t[j]
								}
							} else {
								copy(dst, t)
							}
						}
					}
				}
			}
		}
	}
}

// packPanels copies rows 0..rows-1 (columns 0..kn-1) of the strided matrix
// src into micro-panels of w rows: panel p holds dst[p*w*kn + q*w + r] =
// src[(p*w+r)*ld + q]. Rows past the end are zero-filled.
func packPanels(dst, src []float32, ld, rows, kn, w int) {
	for p0 := 0; p0 < rows; p0 += w {
		pan := dst[p0*kn : (p0+w)*kn]
		rn := min(w, rows-p0)
		for r := 0; r < rn; r++ {
			s := src[(p0+r)*ld : (p0+r)*ld+kn]
			for q, v := range s {
				pan[q*w+r] = v
			}
		}
		for r := rn; r < w; r++ {
			for q := 0; q < kn; q++ {
				pan[q*w+r] = 0
			}
		}
	}
}
