package gptq

import (
	"fmt"
	"math"

	"qtool/formats/model"
)

// SupportedBits are the widths Pack and Unpack handle. 3-bit values cross
// word boundaries; the packing is one little-endian bit stream either way.
var SupportedBits = []int{2, 3, 4, 8}

func bitsOK(b int) bool {
	for _, s := range SupportedBits {
		if s == b {
			return true
		}
	}
	return false
}

// Layer describes the dimensions of one packed linear layer.
type Layer struct {
	In, Out int
	Bits    int
	// Group is the group size; 0 (or −1 in config files) means one group
	// spanning the whole input (per-channel).
	Group int
}

// Groups is the number of scale groups along the input dimension.
func (l Layer) Groups() int {
	if l.Group <= 0 {
		return 1
	}
	return l.In / l.Group
}

func (l Layer) check() error {
	if !bitsOK(l.Bits) {
		return fmt.Errorf("%d-bit weights are not supported (GPTQ bits: 2, 3, 4, 8)", l.Bits)
	}
	if l.In <= 0 || l.Out <= 0 || l.In > 1<<30 || l.Out > 1<<30 || int64(l.In)*int64(l.Out) > 1<<40 {
		return fmt.Errorf("layer shape [out %d, in %d] is not plausible", l.Out, l.In)
	}
	if l.Group > 0 && l.In%l.Group != 0 {
		return fmt.Errorf("group size %d does not divide %d input features", l.Group, l.In)
	}
	if l.In*l.Bits%32 != 0 {
		return fmt.Errorf("%d input features × %d bits is not a whole number of int32 words", l.In, l.Bits)
	}
	if l.Out*l.Bits%32 != 0 {
		return fmt.Errorf("%d output features × %d bits is not a whole number of int32 words", l.Out, l.Bits)
	}
	return nil
}

// Pack converts a quantized weight to the GPTQ v1 ("gptq" checkpoint
// format) tensors, row-major:
//
//	qweight int32 [in·bits/32, out]  codes packed along the input dimension
//	qzeros  int32 [G, out·bits/32]   zero points − 1, packed along the output dimension
//	scales  fp16 bits [G, out]
//	g_idx   int32 [in]               group of each input column
//
// Packing is a little-endian bit stream: element j of a packed column (or
// row) occupies bits j·bits … j·bits+bits−1 counted from bit 0 of the first
// word, which for 2, 4 and 8 bits is "low bits first" within each word and
// for 3 bits lets values straddle words as AutoGPTQ does.
//
// A symmetric q (Zero nil) stores zero point 2^(bits−1), so 4-bit qzeros
// words are 0x77777777 and 8-bit ones 0x7F7F7F7F. Asymmetric zero points
// must be integers in 1..2^bits−1 once Offset() is added back: v1 cannot
// store a zero point of 0 (its "−1" would spill into the neighbouring field).
//
// Pack rounds the scales to fp16 (round to nearest even); quantizers
// targeting GPTQ checkpoints should produce fp16-representable scales. A
// scale that overflows fp16 is an error.
func Pack(q *model.Quantized) (qweight, qzeros []int32, scales []uint16, gIdx []int32, err error) {
	if err := checkPackable(q); err != nil {
		return nil, nil, nil, nil, err
	}
	return packWeight(q), packZeros(q), packScales(q), packGIdx(q), nil
}

func layerOf(q *model.Quantized) Layer {
	return Layer{In: q.Cols, Out: q.Rows, Bits: q.Bits, Group: q.GroupSize}
}

// checkPackable checks that Pack can store q faithfully.
func checkPackable(q *model.Quantized) error {
	if q == nil {
		return fmt.Errorf("gptq pack: nil tensor")
	}
	if err := layerOf(q).check(); err != nil {
		return fmt.Errorf("gptq pack: %w", err)
	}
	if err := q.Validate(); err != nil {
		return fmt.Errorf("gptq pack: %w", err)
	}
	G := q.Groups()
	for i, s := range q.Scale {
		if f := float64(model.RoundF16(s)); math.IsInf(f, 0) || math.IsNaN(f) {
			return fmt.Errorf("gptq pack: scale %g of output %d, group %d is not representable in fp16", s, i/G, i%G)
		}
	}
	maxq := float32(int(1)<<q.Bits - 1)
	off := float32(q.Offset())
	for i, z := range q.Zero {
		u := z + off
		if u != float32(math.Round(float64(u))) || u < 1 || u > maxq {
			return fmt.Errorf("gptq pack: zero point %g of output %d, group %d is not an integer in 1..%d (GPTQ v1 stores zero−1, so 0 cannot be stored)", u, i/G, i%G, int(maxq))
		}
	}
	return nil
}

// putBits ors v (already masked) into the bit stream words at element j.
func putBits(words []uint32, j, bits int, v uint32) {
	pos := j * bits
	w, sh := pos/32, pos%32
	words[w] |= v << sh
	if sh+bits > 32 {
		words[w+1] |= v >> (32 - sh)
	}
}

// getBits reads element j of the bit stream words.
func getBits(words []uint32, j, bits int) uint32 {
	pos := j * bits
	w, sh := pos/32, pos%32
	v := words[w] >> sh
	if sh+bits > 32 {
		v |= words[w+1] << (32 - sh)
	}
	return v & (1<<bits - 1)
}

func packWeight(q *model.Quantized) []int32 {
	in, out, bits := q.Cols, q.Rows, q.Bits
	nw := in * bits / 32
	off := q.Offset()
	qweight := make([]int32, nw*out)
	// Rows are packed packTile at a time into tile ([word][row]), so that
	// the transposed stores into qweight ([word][out]) are runs of
	// packTile consecutive words rather than one word per cache line.
	model.Parallel((out+packTile-1)/packTile, max(1, (1<<16)/(in*packTile)), func(t0, t1 int) {
		col := make([]uint32, nw)
		tile := make([]int32, nw*packTile)
		for t := t0; t < t1; t++ {
			n0, n1 := t*packTile, min(out, (t+1)*packTile)
			for n := n0; n < n1; n++ {
				row := q.Q[n*in : (n+1)*in]
				if bits == 4 { // eight codes a word, the common case, without the bit-stream loop
					for w := range col {
						r := row[8*w : 8*w+8 : 8*w+8]
						col[w] = uint32(int(r[0])+off)&15 | uint32(int(r[1])+off)&15<<4 |
							uint32(int(r[2])+off)&15<<8 | uint32(int(r[3])+off)&15<<12 |
							uint32(int(r[4])+off)&15<<16 | uint32(int(r[5])+off)&15<<20 |
							uint32(int(r[6])+off)&15<<24 | uint32(int(r[7])+off)&15<<28
					}
				} else {
					clear(col)
					for k, v := range row {
						putBits(col, k, bits, uint32(int(v)+off))
					}
				}
				for w, x := range col {
					tile[w*packTile+n-n0] = int32(x)
				}
			}
			for w := 0; w < nw; w++ {
				copy(qweight[w*out+n0:w*out+n1], tile[w*packTile:w*packTile+n1-n0])
			}
		}
	})
	return qweight
}

// packTile is the number of rows packWeight packs before storing them.
const packTile = 32

func packZeros(q *model.Quantized) []int32 {
	out, bits, G := q.Rows, q.Bits, q.Groups()
	nw := out * bits / 32
	mask := uint32(1)<<bits - 1
	qzeros := make([]int32, G*nw)
	row := make([]uint32, nw)
	for g := 0; g < G; g++ {
		clear(row)
		for n := 0; n < out; n++ {
			z := q.Offset()
			if q.Zero != nil {
				z = int(q.Zero[n*G+g]) + q.Offset()
			}
			putBits(row, n, bits, uint32(z-1)&mask)
		}
		for w, x := range row {
			qzeros[g*nw+w] = int32(x)
		}
	}
	return qzeros
}

func packScales(q *model.Quantized) []uint16 {
	out, G := q.Rows, q.Groups()
	scales := make([]uint16, G*out)
	for g := 0; g < G; g++ {
		for n := 0; n < out; n++ {
			scales[g*out+n] = model.Float32ToF16(q.Scale[n*G+g])
		}
	}
	return scales
}

func packGIdx(q *model.Quantized) []int32 {
	g := make([]int32, q.Cols)
	for c := range g {
		g[c] = int32(q.Group(c))
	}
	return g
}

// Unpack is the inverse of Pack for a GPTQ v1 layer. gIdx may be nil
// (groups c/group). It validates the slice lengths and the g_idx range. The
// result has Zero nil when every zero point is 2^(bits−1) (symmetric), and
// GIdx nil when g_idx is the default c/group.
func Unpack(qweight, qzeros []int32, scales []uint16, gIdx []int32, l Layer) (*model.Quantized, error) {
	f := make([]float32, len(scales))
	for i, h := range scales {
		f[i] = model.F16ToFloat32(h)
	}
	q, err := unpack(qweight, qzeros, f, gIdx, l, 1)
	if err != nil {
		return nil, fmt.Errorf("gptq unpack: %w", err)
	}
	return q, nil
}

// checkLengths validates the packed tensor lengths of layer l.
func checkLengths(nw, nz, ns, ng int, l Layer) error {
	if err := l.check(); err != nil {
		return err
	}
	G := l.Groups()
	if want := l.In * l.Bits / 32 * l.Out; nw != want {
		return fmt.Errorf("qweight has %d words, want [%d, %d] = %d", nw, l.In*l.Bits/32, l.Out, want)
	}
	if want := G * (l.Out * l.Bits / 32); nz != want {
		return fmt.Errorf("qzeros has %d words, want [%d, %d] = %d", nz, G, l.Out*l.Bits/32, want)
	}
	if want := G * l.Out; ns != want {
		return fmt.Errorf("scales has %d values, want [%d, %d] = %d", ns, G, l.Out, want)
	}
	if ng >= 0 && ng != l.In {
		return fmt.Errorf("g_idx has %d entries, want %d", ng, l.In)
	}
	return nil
}

// unpack decodes a layer; zeroBias is 1 for the v1 checkpoint format
// (stored zero+1) and 0 for v2.
func unpack(qweight, qzeros []int32, scales []float32, gIdx []int32, l Layer, zeroBias int) (*model.Quantized, error) {
	ng := -1
	if gIdx != nil {
		ng = len(gIdx)
	}
	if err := checkLengths(len(qweight), len(qzeros), len(scales), ng, l); err != nil {
		return nil, err
	}
	in, out, bits, G := l.In, l.Out, l.Bits, l.Groups()
	group := l.Group
	if group < 0 {
		group = 0
	}
	q := &model.Quantized{Bits: bits, GroupSize: group, Rows: out, Cols: in,
		Q: make([]int8, out*in), Scale: make([]float32, out*G), Zero: make([]float32, out*G)}
	off := q.Offset()
	nw := in * bits / 32
	model.Parallel(out, max(1, (1<<16)/in), func(n0, n1 int) {
		col := make([]uint32, nw)
		for n := n0; n < n1; n++ {
			for w := range col {
				col[w] = uint32(qweight[w*out+n])
			}
			row := q.Q[n*in : (n+1)*in]
			for k := range row {
				row[k] = int8(int(getBits(col, k, bits)) - off)
			}
		}
	})
	nz := out * bits / 32
	zrow := make([]uint32, nz)
	sym := true
	for g := 0; g < G; g++ {
		for w := range zrow {
			zrow[w] = uint32(qzeros[g*nz+w])
		}
		for n := 0; n < out; n++ {
			z := int(getBits(zrow, n, bits)) + zeroBias
			q.Zero[n*G+g] = float32(z - off)
			if z != off {
				sym = false
			}
			q.Scale[n*G+g] = scales[g*out+n]
		}
	}
	if sym {
		q.Zero = nil
	}
	if gIdx != nil {
		trivial := true
		for c, g := range gIdx {
			if g < 0 || int(g) >= G {
				return nil, fmt.Errorf("g_idx[%d] = %d outside 0..%d", c, g, G-1)
			}
			if group > 0 && int(g) != c/group {
				trivial = false
			}
		}
		if !trivial {
			q.GIdx = append([]int32(nil), gIdx...)
		}
	}
	return q, nil
}
