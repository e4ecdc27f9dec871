//go:build !amd64

package cpu

// expBlock sets dst[i] = exp(src[i]·scale + bias) and returns their sum.
// Arguments above about 88 saturate; below −87 they give ~1e−38. dst may
// be src.
func expBlock(dst, src []float32, scale, bias float32) float32 {
	dst = dst[:len(src)]
	var sum float32
	for i, x := range src {
		e := expf(min(max(x*scale+bias, -87.3), 88.3))
		dst[i] = e
		sum += e
	}
	return sum
}
