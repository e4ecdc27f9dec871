package autoawq

import (
	"fmt"
	"math"

	"qtool/formats/model"
)

// PackFactor is the number of 4-bit codes in one int32 word.
const PackFactor = 8

// Order is AutoAWQ's nibble order (AWQ_ORDER): nibble i of a packed word
// holds output column 8c+Order[i].
var Order = [PackFactor]int{0, 2, 4, 6, 1, 3, 5, 7}

// ReverseOrder is the inverse of Order (AWQ_REVERSE_ORDER): output column
// 8c+j lives in nibble ReverseOrder[j].
var ReverseOrder = [PackFactor]int{0, 4, 1, 5, 2, 6, 3, 7}

// Pack converts a 4-bit per-group weight to the AutoAWQ GEMM tensors:
//
//	qweight int32 [in, out/8]: word (k, c) holds the unsigned codes of input
//	                           row k, output columns 8c..8c+7, nibble i (bits
//	                           4i..4i+3) holding column 8c+Order[i]
//	qzeros  int32 [in/g, out/8]: the raw zero points (0..15, no "−1"), packed
//	                           the same way
//	scales  fp16 bits [in/g, out]
//
// The slices are row-major in the shapes above. q must have Bits 4,
// GroupSize > 0 dividing Cols, no GIdx and Rows a multiple of 8. A symmetric
// q (Zero nil) packs zero code 8; zero points must be integers in 0..15 once
// Offset() is added back.
//
// Pack rounds the scales to fp16 (round to nearest even), so the written
// checkpoint dequantizes exactly to q only when q.Scale is fp16-representable:
// quantizers targeting AWQ formats should produce fp16-representable scales.
// A scale that overflows fp16 is an error.
func Pack(q *model.Quantized) (qweight, qzeros []int32, scales []uint16, err error) {
	if err := checkPackable(q); err != nil {
		return nil, nil, nil, err
	}
	qweight = packWeight(q)
	if qzeros, err = packZeros(q); err != nil {
		return nil, nil, nil, err
	}
	if scales, err = packScales(q); err != nil {
		return nil, nil, nil, err
	}
	return qweight, qzeros, scales, nil
}

// Unpack is the inverse of Pack for a linear layer with in input features,
// out output features and the given group size. It validates the slice
// lengths. The result always carries zero points (Zero = z − 8), since the
// AutoAWQ layout cannot tell a symmetric weight from an asymmetric one.
func Unpack(qweight, qzeros []int32, scales []uint16, in, out, group int) (*model.Quantized, error) {
	if err := checkLengths(len(qweight), len(qzeros), len(scales), in, out, group); err != nil {
		return nil, fmt.Errorf("awq unpack: %w", err)
	}
	f := make([]float32, len(scales))
	for i, h := range scales {
		f[i] = model.F16ToFloat32(h)
	}
	return unpack(qweight, qzeros, f, in, out, group), nil
}

// unpack does the work of Unpack once the lengths are checked; scales are
// already widened to float32 [in/g, out].
func unpack(qweight, qzeros []int32, scales []float32, in, out, group int) *model.Quantized {
	G := in / group
	ow := out / PackFactor
	q := &model.Quantized{Bits: 4, GroupSize: group, Rows: out, Cols: in,
		Q: make([]int8, out*in), Scale: make([]float32, out*G), Zero: make([]float32, out*G)}
	model.Parallel(ow, max(1, (1<<13)/in), func(c0, c1 int) {
		var rows [PackFactor][]int8
		for c := c0; c < c1; c++ {
			for i, j := range Order {
				rows[i] = q.Q[(PackFactor*c+j)*in : (PackFactor*c+j+1)*in]
			}
			for k := 0; k < in; k++ {
				u := uint32(qweight[k*ow+c])
				for i := range rows {
					rows[i][k] = int8(int32((u>>(4*i))&15) - 8)
				}
			}
		}
	})
	for gi := 0; gi < G; gi++ {
		for n := 0; n < out; n++ {
			q.Scale[n*G+gi] = scales[gi*out+n]
		}
		for c := 0; c < ow; c++ {
			u := uint32(qzeros[gi*ow+c])
			for i, j := range Order {
				q.Zero[(PackFactor*c+j)*G+gi] = float32(int((u>>(4*i))&15) - 8)
			}
		}
	}
	return q
}

// checkLengths validates a layer's dimensions and the lengths of its packed
// tensors (nw qweight words, nz qzeros words, ns scales).
func checkLengths(nw, nz, ns, in, out, group int) error {
	if in <= 0 || out <= 0 {
		return fmt.Errorf("shape [out %d, in %d], want positive", out, in)
	}
	if out%PackFactor != 0 {
		return fmt.Errorf("%d output features is not a multiple of %d", out, PackFactor)
	}
	if group <= 0 || in%group != 0 {
		return fmt.Errorf("group size %d does not divide %d input features", group, in)
	}
	if in > 1<<30 || out > 1<<30 || int64(in)*int64(out) > 1<<40 {
		return fmt.Errorf("shape [out %d, in %d] is implausibly large", out, in)
	}
	G := in / group
	ow := out / PackFactor
	if nw != in*ow {
		return fmt.Errorf("qweight has %d words, want [%d, %d] = %d", nw, in, ow, in*ow)
	}
	if nz != G*ow {
		return fmt.Errorf("qzeros has %d words, want [%d, %d] = %d", nz, G, ow, G*ow)
	}
	if ns != G*out {
		return fmt.Errorf("scales has %d values, want [%d, %d] = %d", ns, G, out, G*out)
	}
	return nil
}

// checkPackable checks everything Pack needs: 4 bits, per-group scales, no
// g_idx, a consistent tensor, the row count, integer zero points and
// fp16-representable scales.
func checkPackable(q *model.Quantized) error {
	if q == nil {
		return fmt.Errorf("awq pack: nil tensor")
	}
	if q.Bits != 4 {
		return fmt.Errorf("awq pack: %d-bit weights, AutoAWQ GEMM holds only 4-bit", q.Bits)
	}
	if q.GroupSize <= 0 {
		return fmt.Errorf("awq pack: group size %d, AutoAWQ GEMM needs per-group scales (group size > 0)", q.GroupSize)
	}
	if q.GIdx != nil {
		return fmt.Errorf("awq pack: weight has a g_idx (act-order); AutoAWQ GEMM has no input permutation")
	}
	if err := q.Validate(); err != nil {
		return fmt.Errorf("awq pack: %w", err)
	}
	if q.Rows%PackFactor != 0 {
		return fmt.Errorf("awq pack: %d output features is not a multiple of %d", q.Rows, PackFactor)
	}
	G := q.Groups()
	for i, s := range q.Scale {
		if f := model.RoundF16(s); math.IsInf(float64(f), 0) || math.IsNaN(float64(f)) {
			return fmt.Errorf("awq pack: scale %g of output %d, group %d is not representable in fp16", s, i/G, i%G)
		}
	}
	for i, z := range q.Zero {
		zf := z + 8
		if zf != float32(math.Round(float64(zf))) || zf < 0 || zf > 15 {
			return fmt.Errorf("awq pack: zero point %g of output %d, group %d is not an integer code in 0..15", zf, i/G, i%G)
		}
	}
	return nil
}

// packWeight packs q.Q into qweight [in, out/8] (q already checked). It
// walks eight output rows at a time so that the reads stay sequential.
func packWeight(q *model.Quantized) []int32 {
	out, in := q.Rows, q.Cols
	ow := out / PackFactor
	qweight := make([]int32, in*ow)
	// Words are made packTile output columns at a time into tile
	// ([k][column]), so that the stores into qweight ([k][out/8]) are runs
	// of packTile consecutive words rather than one word per cache line.
	model.Parallel((ow+packTile-1)/packTile, max(1, (1<<13)/(in*packTile)), func(t0, t1 int) {
		var rows [PackFactor][]int8
		tile := make([]int32, in*packTile)
		for t := t0; t < t1; t++ {
			c0, c1 := t*packTile, min(ow, (t+1)*packTile)
			for c := c0; c < c1; c++ {
				for i, j := range Order {
					rows[i] = q.Q[(PackFactor*c+j)*in : (PackFactor*c+j+1)*in]
				}
				for k := 0; k < in; k++ {
					var w uint32
					for i := range rows {
						w |= uint32(int32(rows[i][k])+8) << (4 * i)
					}
					tile[k*packTile+c-c0] = int32(w)
				}
			}
			for k := 0; k < in; k++ {
				copy(qweight[k*ow+c0:k*ow+c1], tile[k*packTile:k*packTile+c1-c0])
			}
		}
	})
	return qweight
}

// packTile is the number of packed columns packWeight makes before
// storing them.
const packTile = 32

// packZeros packs the zero points into qzeros [in/g, out/8]; code 8 when
// symmetric.
func packZeros(q *model.Quantized) ([]int32, error) {
	out, G := q.Rows, q.Groups()
	ow := out / PackFactor
	qzeros := make([]int32, G*ow)
	for gi := 0; gi < G; gi++ {
		for c := 0; c < ow; c++ {
			var w uint32
			for i, j := range Order {
				z := 8
				if q.Zero != nil {
					zf := q.Zero[(PackFactor*c+j)*G+gi] + 8
					if zf != float32(math.Round(float64(zf))) || zf < 0 || zf > 15 {
						return nil, fmt.Errorf("awq pack: zero point %g of output %d, group %d is not an integer code in 0..15", zf, PackFactor*c+j, gi)
					}
					z = int(zf)
				}
				w |= uint32(z) << (4 * i)
			}
			qzeros[gi*ow+c] = int32(w)
		}
	}
	return qzeros, nil
}

// packScales rounds the scales to fp16, transposed to [in/g, out].
func packScales(q *model.Quantized) ([]uint16, error) {
	out, G := q.Rows, q.Groups()
	scales := make([]uint16, G*out)
	for gi := 0; gi < G; gi++ {
		for n := 0; n < out; n++ {
			s := q.Scale[n*G+gi]
			h := model.Float32ToF16(s)
			if f := model.F16ToFloat32(h); math.IsInf(float64(f), 0) || math.IsNaN(float64(f)) {
				return nil, fmt.Errorf("awq pack: scale %g of output %d, group %d is not representable in fp16", s, n, gi)
			}
			scales[gi*out+n] = h
		}
	}
	return scales, nil
}
