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
	if q == nil {
		return nil, nil, nil, fmt.Errorf("awq pack: nil tensor")
	}
	if q.Bits != 4 {
		return nil, nil, nil, fmt.Errorf("awq pack: %d-bit weights, AutoAWQ GEMM holds only 4-bit", q.Bits)
	}
	if q.GroupSize <= 0 {
		return nil, nil, nil, fmt.Errorf("awq pack: group size %d, AutoAWQ GEMM needs per-group scales (group size > 0)", q.GroupSize)
	}
	if q.GIdx != nil {
		return nil, nil, nil, fmt.Errorf("awq pack: weight has a g_idx (act-order); AutoAWQ GEMM has no input permutation")
	}
	if err := q.Validate(); err != nil {
		return nil, nil, nil, fmt.Errorf("awq pack: %w", err)
	}
	out, in, g := q.Rows, q.Cols, q.GroupSize
	if out%PackFactor != 0 {
		return nil, nil, nil, fmt.Errorf("awq pack: %d output features is not a multiple of %d", out, PackFactor)
	}
	G := in / g
	ow := out / PackFactor
	qweight = make([]int32, in*ow)
	qzeros = make([]int32, G*ow)
	scales = make([]uint16, G*out)
	for k := 0; k < in; k++ {
		row := qweight[k*ow : (k+1)*ow]
		for c := range row {
			var w uint32
			for i, j := range Order {
				u := uint32(int(q.Q[(PackFactor*c+j)*in+k]) + 8)
				w |= u << (4 * i)
			}
			row[c] = int32(w)
		}
	}
	for gi := 0; gi < G; gi++ {
		for n := 0; n < out; n++ {
			s := q.Scale[n*G+gi]
			h := model.Float32ToF16(s)
			if f := model.F16ToFloat32(h); math.IsInf(float64(f), 0) || math.IsNaN(float64(f)) {
				return nil, nil, nil, fmt.Errorf("awq pack: scale %g of output %d, group %d is not representable in fp16", s, n, gi)
			}
			scales[gi*out+n] = h
		}
		for c := 0; c < ow; c++ {
			var w uint32
			for i, j := range Order {
				z := 8
				if q.Zero != nil {
					zf := q.Zero[(PackFactor*c+j)*G+gi] + 8
					if zf != float32(math.Round(float64(zf))) || zf < 0 || zf > 15 {
						return nil, nil, nil, fmt.Errorf("awq pack: zero point %g of output %d, group %d is not an integer code in 0..15", zf, PackFactor*c+j, gi)
					}
					z = int(zf)
				}
				w |= uint32(z) << (4 * i)
			}
			qzeros[gi*ow+c] = int32(w)
		}
	}
	return qweight, qzeros, scales, nil
}

// Unpack is the inverse of Pack for a linear layer with in input features,
// out output features and the given group size. It validates the slice
// lengths. The result always carries zero points (Zero = z − 8), since the
// AutoAWQ layout cannot tell a symmetric weight from an asymmetric one.
func Unpack(qweight, qzeros []int32, scales []uint16, in, out, group int) (*model.Quantized, error) {
	if in <= 0 || out <= 0 {
		return nil, fmt.Errorf("awq unpack: shape [out %d, in %d], want positive", out, in)
	}
	if out%PackFactor != 0 {
		return nil, fmt.Errorf("awq unpack: %d output features is not a multiple of %d", out, PackFactor)
	}
	if group <= 0 || in%group != 0 {
		return nil, fmt.Errorf("awq unpack: group size %d does not divide %d input features", group, in)
	}
	if in > 1<<30 || out > 1<<30 || int64(in)*int64(out) > 1<<40 {
		return nil, fmt.Errorf("awq unpack: shape [out %d, in %d] is implausibly large", out, in)
	}
	G := in / group
	ow := out / PackFactor
	if len(qweight) != in*ow {
		return nil, fmt.Errorf("awq unpack: qweight has %d words, want [%d, %d] = %d", len(qweight), in, ow, in*ow)
	}
	if len(qzeros) != G*ow {
		return nil, fmt.Errorf("awq unpack: qzeros has %d words, want [%d, %d] = %d", len(qzeros), G, ow, G*ow)
	}
	if len(scales) != G*out {
		return nil, fmt.Errorf("awq unpack: scales has %d values, want [%d, %d] = %d", len(scales), G, out, G*out)
	}
	q := &model.Quantized{Bits: 4, GroupSize: group, Rows: out, Cols: in,
		Q: make([]int8, out*in), Scale: make([]float32, out*G), Zero: make([]float32, out*G)}
	for k := 0; k < in; k++ {
		row := qweight[k*ow : (k+1)*ow]
		for c, w := range row {
			u := uint32(w)
			for i, j := range Order {
				q.Q[(PackFactor*c+j)*in+k] = int8(int((u>>(4*i))&15) - 8)
			}
		}
	}
	for gi := 0; gi < G; gi++ {
		for n := 0; n < out; n++ {
			q.Scale[n*G+gi] = model.F16ToFloat32(scales[gi*out+n])
		}
		for c := 0; c < ow; c++ {
			u := uint32(qzeros[gi*ow+c])
			for i, j := range Order {
				q.Zero[(PackFactor*c+j)*G+gi] = float32(int((u>>(4*i))&15) - 8)
			}
		}
	}
	return q, nil
}
