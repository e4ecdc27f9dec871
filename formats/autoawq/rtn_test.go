package autoawq

import (
	"math"

	"qtool/formats/model"
)

// rtnAsym is an independent, straightforward asymmetric round-to-nearest
// quantizer (AWQ's pseudo_quantize_tensor): per group of `group` input
// columns, scale = (max−min)/(2^bits−1) rounded to fp16, zero =
// clamp(−round(min/scale), 0, 2^bits−1), u = clamp(round(w/scale)+zero, 0,
// 2^bits−1). It stores q = u − 2^(bits−1) and Zero = zero − 2^(bits−1) as
// model.Quantized prescribes.
func rtnAsym(w []float32, rows, cols, bits, group int) *model.Quantized {
	maxq := float64(int(1)<<bits - 1)
	off := float64(int(1) << (bits - 1))
	G := cols / group
	q := &model.Quantized{Bits: bits, GroupSize: group, Rows: rows, Cols: cols,
		Q: make([]int8, rows*cols), Scale: make([]float32, rows*G), Zero: make([]float32, rows*G)}
	for r := 0; r < rows; r++ {
		for g := 0; g < G; g++ {
			seg := w[r*cols+g*group : r*cols+(g+1)*group]
			lo, hi := math.Inf(1), math.Inf(-1)
			for _, v := range seg {
				lo = math.Min(lo, float64(v))
				hi = math.Max(hi, float64(v))
			}
			s := float64(model.RoundF16(float32(math.Max((hi-lo)/maxq, 1e-5))))
			z := math.Min(math.Max(-math.Round(lo/s), 0), maxq)
			q.Scale[r*G+g] = float32(s)
			q.Zero[r*G+g] = float32(z - off)
			for i, v := range seg {
				u := math.Min(math.Max(math.Round(float64(v)/s)+z, 0), maxq)
				q.Q[r*cols+g*group+i] = int8(u - off)
			}
		}
	}
	return q
}
