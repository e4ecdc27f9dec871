//go:build amd64 && !purego

package gemm

import "golang.org/x/sys/cpu"

//go:noescape
func sgemm6x16AVX2(kc int, a *float32, lda int, b, c *float32, ldc int, acc bool)

//go:noescape
func sgemm12x32AVX512(kc int, a *float32, lda int, b, c *float32, ldc int, acc bool)

//go:noescape
func sgemm6x32AVX512(kc int, a *float32, lda int, b, c *float32, ldc int, acc bool)

//go:noescape
func dot4AVX2(x, b *float32, ldb, n int, out *[4]float32)

//go:noescape
func dotAVX2(a, b *float32, n int) float32

//go:noescape
func axpyAVX2(alpha float32, x, y *float32, n int)

var hasAVX2 = cpu.X86.HasAVX2 && cpu.X86.HasFMA
var hasAVX512 = hasAVX2 && cpu.X86.HasAVX512F

// avx2 is the AVX2+FMA kernel set (6×16 micro-tile).
var avx2 = &impl{
	name:   "avx2",
	mr:     6,
	nr:     16,
	kcMax:  384,
	mc:     120,
	nc:     512,
	pack:   packAVX2,
	kernel: kernelAVX2,
	dot4:   dot4Asm,
	dot:    dotAsm,
	axpy:   axpyAsm,
}

// avx512 is the AVX-512F kernel set (12×32 micro-tile); the vector helpers
// are the AVX2 ones (they are bandwidth-bound).
var avx512 = &impl{
	name:   "avx512",
	mr:     12,
	nr:     32,
	kcMax:  256,
	mc:     144,
	nc:     512,
	pack:   packAVX512,
	kernel: kernelAVX512,
	tailMR: 6,
	tail:   kernelAVX512Tail,
	dot4:   dot4Asm,
	dot:    dotAsm,
	axpy:   axpyAsm,
}

func selectImpl() *impl { return impls()[0] }

// impls lists every kernel set usable on this CPU, best first.
func impls() []*impl {
	var l []*impl
	if hasAVX512 {
		l = append(l, avx512)
	}
	if hasAVX2 {
		l = append(l, avx2)
	}
	return append(l, generic)
}

func kernelAVX2(kc int, a []float32, lda int, bp, c []float32, ldc int, acc bool) {
	_ = a[5*lda+kc-1]
	_ = bp[kc*16-1]
	_ = c[5*ldc+15]
	sgemm6x16AVX2(kc, &a[0], lda, &bp[0], &c[0], ldc, acc)
}

func kernelAVX512(kc int, a []float32, lda int, bp, c []float32, ldc int, acc bool) {
	_ = a[11*lda+kc-1]
	_ = bp[kc*32-1]
	_ = c[11*ldc+31]
	sgemm12x32AVX512(kc, &a[0], lda, &bp[0], &c[0], ldc, acc)
}

func kernelAVX512Tail(kc int, a []float32, lda int, bp, c []float32, ldc int, acc bool) {
	_ = a[5*lda+kc-1]
	_ = bp[kc*32-1]
	_ = c[5*ldc+31]
	sgemm6x32AVX512(kc, &a[0], lda, &bp[0], &c[0], ldc, acc)
}

func dot4Asm(x, b []float32, ldb int, out *[4]float32) {
	n := len(x)
	if n == 0 {
		*out = [4]float32{}
		return
	}
	_ = b[3*ldb+n-1]
	n8 := n &^ 7
	if n8 == 0 {
		dot4Generic(x, b, ldb, out)
		return
	}
	dot4AVX2(&x[0], &b[0], ldb, n8, out)
	for i := n8; i < n; i++ {
		v := x[i]
		out[0] += v * b[i]
		out[1] += v * b[ldb+i]
		out[2] += v * b[2*ldb+i]
		out[3] += v * b[3*ldb+i]
	}
}

func dotAsm(a, b []float32) float32 {
	n := len(a)
	b = b[:n]
	n8 := n &^ 7
	var s float32
	if n8 > 0 {
		s = dotAVX2(&a[0], &b[0], n8)
	}
	for i := n8; i < n; i++ {
		s += a[i] * b[i]
	}
	return s
}

func axpyAsm(alpha float32, x, y []float32) {
	n := len(x)
	y = y[:n]
	n8 := n &^ 7
	if n8 > 0 {
		axpyAVX2(alpha, &x[0], &y[0], n8)
	}
	for i := n8; i < n; i++ {
		y[i] += alpha * x[i]
	}
}

//go:noescape
func packGatherAVX512(dst, src *float32, idx *[32]int32, kn, w, gmask, smask int)

//go:noescape
func transpose16AVX512(dst, src *float32, ld, dstStride, blocks int)

// packAVX512 is packPanels (same contract) with AVX-512: full panels whose
// width is a multiple of 16 are packed by in-register 16×16 transposes, the
// rest (a last partial panel, k not a multiple of 16) with gathers.
func packAVX512(dst, src []float32, ld, rows, kn, w int) {
	if kn == 0 || rows == 0 {
		return
	}
	if w > 32 || int64(ld)*4*int64(w) >= 1<<31 {
		packPanels(dst, src, ld, rows, kn, w)
		return
	}
	_ = dst[((rows+w-1)/w)*w*kn-1]
	_ = src[(rows-1)*ld+kn-1]
	var idx [32]int32
	for r := range idx {
		idx[r] = int32(r * ld * 4)
	}
	smask := 1<<w - 1
	blocks := kn / 16
	for p0 := 0; p0 < rows; p0 += w {
		rn := min(w, rows-p0)
		if rn < w || w%16 != 0 || blocks == 0 {
			packGatherAVX512(&dst[p0*kn], &src[p0*ld], &idx, kn, w, 1<<rn-1, smask)
			continue
		}
		for g := 0; g < w; g += 16 {
			transpose16AVX512(&dst[p0*kn+g], &src[(p0+g)*ld], ld, w, blocks)
		}
		if q0 := blocks * 16; q0 < kn {
			packGatherAVX512(&dst[p0*kn+q0*w], &src[p0*ld+q0], &idx, kn-q0, w, 1<<rn-1, smask)
		}
	}
}

//go:noescape
func packGatherAVX2(dst, src *float32, idx *[16]int32, mask *[16]int32, kn, w int)

// packAVX2 is packPanels using AVX2 gathers for w = 8 or 16.
func packAVX2(dst, src []float32, ld, rows, kn, w int) {
	if kn == 0 || rows == 0 {
		return
	}
	if (w != 8 && w != 16) || int64(ld)*4*int64(w) >= 1<<31 {
		packPanels(dst, src, ld, rows, kn, w)
		return
	}
	_ = dst[((rows+w-1)/w)*w*kn-1]
	_ = src[(rows-1)*ld+kn-1]
	var idx, mask [16]int32
	for r := range idx {
		idx[r] = int32(r * ld * 4)
	}
	for p0 := 0; p0 < rows; p0 += w {
		rn := min(w, rows-p0)
		for r := range mask {
			mask[r] = 0
			if r < rn {
				mask[r] = -1
			}
		}
		packGatherAVX2(&dst[p0*kn], &src[p0*ld], &idx, &mask, kn, w)
	}
}
