package cpu

import "golang.org/x/sys/cpu"

// hasAVX2 selects the vector exp (AVX2 and FMA); it is set once at start-up
// from the CPU's features and never modified.
var hasAVX2 = cpu.X86.HasAVX2 && cpu.X86.HasFMA

//go:noescape
func expBlockAVX2(dst, src *float32, n int, scale, bias float32) float32

// expBlock sets dst[i] = exp(src[i]·scale + bias) and returns their sum.
// Arguments above about 88 saturate (the result is then ~2^127, not +Inf);
// below −87 they give ~1e−38 instead of a smaller value. dst may be src.
func expBlock(dst, src []float32, scale, bias float32) float32 {
	n := len(src)
	dst = dst[:n]
	var sum float32
	i := 0
	if hasAVX2 && n >= 8 {
		i = n &^ 7
		sum = expBlockAVX2(&dst[0], &src[0], i, scale, bias)
	}
	for ; i < n; i++ {
		e := expf(min(max(src[i]*scale+bias, -87.3), 88.3))
		dst[i] = e
		sum += e
	}
	return sum
}
