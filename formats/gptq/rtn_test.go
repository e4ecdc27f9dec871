package gptq

import (
	"math"

	"qtool/formats/model"
)

// rtn is an independent, straightforward round-to-nearest quantizer. Groups
// are given by gidx (nil: c/group; group 0: one group per row). Asymmetric:
// scale = (max−min)/(2^bits−1), zero = clamp(−round(min/scale), 1, 2^bits−1)
// (GPTQ v1 cannot store a zero of 0). Symmetric: scale = max|w|/(2^(bits−1)−1)
// with zero 2^(bits−1). Scales are rounded to fp16. Codes are stored as
// model.Quantized prescribes (q = u − 2^(bits−1), Zero = z − 2^(bits−1)).
func rtn(w []float32, rows, cols, bits, group int, gidx []int32, sym bool) *model.Quantized {
	maxq := float64(int(1)<<bits - 1)
	off := float64(int(1) << (bits - 1))
	gs := group
	if gs == 0 {
		gs = cols
	}
	G := cols / gs
	q := &model.Quantized{Bits: bits, GroupSize: group, Rows: rows, Cols: cols, GIdx: gidx,
		Q: make([]int8, rows*cols), Scale: make([]float32, rows*G)}
	if !sym {
		q.Zero = make([]float32, rows*G)
	}
	groupOf := func(c int) int {
		if gidx != nil {
			return int(gidx[c])
		}
		return c / gs
	}
	lo := make([]float64, G)
	hi := make([]float64, G)
	for r := 0; r < rows; r++ {
		row := w[r*cols : (r+1)*cols]
		for g := range lo {
			lo[g], hi[g] = math.Inf(1), math.Inf(-1)
		}
		for c, v := range row {
			g := groupOf(c)
			lo[g] = math.Min(lo[g], float64(v))
			hi[g] = math.Max(hi[g], float64(v))
		}
		zs := make([]float64, G)
		ss := make([]float64, G)
		for g := 0; g < G; g++ {
			var s, z float64
			if sym {
				s = math.Max(math.Max(-lo[g], hi[g])/(off-1), 1e-5)
				z = off
			} else {
				s = math.Max((hi[g]-lo[g])/maxq, 1e-5)
			}
			s = float64(model.RoundF16(float32(s)))
			if !sym {
				z = math.Min(math.Max(-math.Round(lo[g]/s), 1), maxq)
				q.Zero[r*G+g] = float32(z - off)
			}
			q.Scale[r*G+g] = float32(s)
			ss[g], zs[g] = s, z
		}
		for c, v := range row {
			g := groupOf(c)
			u := math.Min(math.Max(math.Round(float64(v)/ss[g])+zs[g], 0), maxq)
			q.Q[r*cols+c] = int8(u - off)
		}
	}
	return q
}
