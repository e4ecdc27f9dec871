package model

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"sync"
	"sync/atomic"

	"github.com/x448/float16"
)

// DType is the element type of a dense tensor as stored.
type DType uint8

// Element types, named as safetensors names them.
const (
	F32 DType = iota + 1
	F16
	BF16
	F64
	I8
	U8
	I16
	I32
	I64
)

var dtypeNames = [...]string{F32: "F32", F16: "F16", BF16: "BF16", F64: "F64", I8: "I8", U8: "U8", I16: "I16", I32: "I32", I64: "I64"}
var dtypeSizes = [...]int{F32: 4, F16: 2, BF16: 2, F64: 8, I8: 1, U8: 1, I16: 2, I32: 4, I64: 8}

// String returns the safetensors name of d ("F16", ...).
func (d DType) String() string {
	if int(d) < len(dtypeNames) && dtypeNames[d] != "" {
		return dtypeNames[d]
	}
	return fmt.Sprintf("DType(%d)", uint8(d))
}

// Size is the number of bytes of one element (0 for an unknown dtype).
func (d DType) Size() int {
	if int(d) < len(dtypeSizes) {
		return dtypeSizes[d]
	}
	return 0
}

// IsFloat reports whether d is a floating-point type.
func (d DType) IsFloat() bool { return d == F32 || d == F16 || d == BF16 || d == F64 }

// ParseDType maps a safetensors dtype name to a DType.
func ParseDType(s string) (DType, error) {
	for i, n := range dtypeNames {
		if n != "" && n == s {
			return DType(i), nil
		}
	}
	return 0, fmt.Errorf("unsupported dtype %q (supported: F32, F16, BF16, F64, I8, U8, I16, I32, I64)", s)
}

// Tensor is a named weight of a model: a *Dense, a *Quantized or a *W8A8.
type Tensor interface {
	// Shape is the logical shape (for a linear layer [out, in]).
	Shape() []int
	// Float32 returns the values, dequantized if need be, row-major, in a
	// new slice the caller owns.
	Float32() ([]float32, error)
}

// Dense is an unquantized tensor in its stored dtype. Data is little-endian
// and may alias a read-only memory mapping: never write to it.
type Dense struct {
	DType DType
	Dims  []int
	Data  []byte
}

// NewDense checks that data holds exactly shape × dtype bytes.
func NewDense(dt DType, shape []int, data []byte) (*Dense, error) {
	if dt.Size() == 0 {
		return nil, fmt.Errorf("dense tensor: unknown dtype %v", dt)
	}
	for _, d := range shape {
		if d < 0 {
			return nil, fmt.Errorf("dense tensor: negative dimension in shape %v", shape)
		}
	}
	if want := NumElements(shape) * dt.Size(); want != len(data) {
		return nil, fmt.Errorf("dense tensor: shape %v of %v needs %d bytes, have %d", shape, dt, want, len(data))
	}
	return &Dense{DType: dt, Dims: append([]int(nil), shape...), Data: data}, nil
}

// FromFloat32 makes an F32 tensor holding a copy of v.
func FromFloat32(shape []int, v []float32) *Dense {
	if NumElements(shape) != len(v) {
		panic(fmt.Sprintf("model.FromFloat32: shape %v does not hold %d values", shape, len(v)))
	}
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return &Dense{DType: F32, Dims: append([]int(nil), shape...), Data: b}
}

// Shape implements Tensor.
func (d *Dense) Shape() []int { return d.Dims }

// Len is the number of elements.
func (d *Dense) Len() int { return NumElements(d.Dims) }

// Float32 implements Tensor. Integer dtypes convert by value.
func (d *Dense) Float32() ([]float32, error) {
	out := make([]float32, d.Len())
	if err := d.Float32Into(out); err != nil {
		return nil, err
	}
	return out, nil
}

// parallelConvert is the element count from which Float32Into converts on
// all cores.
const parallelConvert = 1 << 20

// Float32Into converts the values into dst, which must have Len() elements;
// large tensors are converted on all cores.
func (d *Dense) Float32Into(dst []float32) error {
	n := d.Len()
	if len(dst) != n {
		return fmt.Errorf("dense tensor: destination has %d elements, tensor %d", len(dst), n)
	}
	if n < parallelConvert || d.DType.Size() <= 0 {
		return d.convert(dst, 0)
	}
	var mu sync.Mutex
	var errs []error
	Parallel(n, parallelConvert/4, func(lo, hi int) {
		if err := d.convert(dst[lo:hi], lo); err != nil {
			mu.Lock()
			errs = append(errs, err)
			mu.Unlock()
		}
	})
	return errors.Join(errs...)
}

// convert writes the values from element off on into dst.
func (d *Dense) convert(dst []float32, off int) error {
	b := d.Data[off*max(d.DType.Size(), 0):]
	switch d.DType {
	case F32:
		for i := range dst {
			dst[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[4*i:]))
		}
	case F16:
		for i := range dst {
			dst[i] = float16.Frombits(binary.LittleEndian.Uint16(b[2*i:])).Float32()
		}
	case BF16:
		for i := range dst {
			dst[i] = BF16ToFloat32(binary.LittleEndian.Uint16(b[2*i:]))
		}
	case F64:
		for i := range dst {
			dst[i] = float32(math.Float64frombits(binary.LittleEndian.Uint64(b[8*i:])))
		}
	case I8:
		for i := range dst {
			dst[i] = float32(int8(b[i]))
		}
	case U8:
		for i := range dst {
			dst[i] = float32(b[i])
		}
	case I16:
		for i := range dst {
			dst[i] = float32(int16(binary.LittleEndian.Uint16(b[2*i:])))
		}
	case I32:
		for i := range dst {
			dst[i] = float32(int32(binary.LittleEndian.Uint32(b[4*i:])))
		}
	case I64:
		for i := range dst {
			dst[i] = float32(int64(binary.LittleEndian.Uint64(b[8*i:])))
		}
	default:
		return fmt.Errorf("dense tensor: cannot convert dtype %v to float32", d.DType)
	}
	return nil
}

// Int32s returns the values of an I32 tensor.
func (d *Dense) Int32s() ([]int32, error) {
	if d.DType != I32 {
		return nil, fmt.Errorf("dense tensor: dtype %v, want I32", d.DType)
	}
	out := make([]int32, d.Len())
	for i := range out {
		out[i] = int32(binary.LittleEndian.Uint32(d.Data[4*i:]))
	}
	return out, nil
}

// Int8s returns the values of an I8 tensor (a copy).
func (d *Dense) Int8s() ([]int8, error) {
	if d.DType != I8 {
		return nil, fmt.Errorf("dense tensor: dtype %v, want I8", d.DType)
	}
	out := make([]int8, len(d.Data))
	for i, b := range d.Data {
		out[i] = int8(b)
	}
	return out, nil
}

// BF16ToFloat32 widens a bfloat16 bit pattern.
func BF16ToFloat32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// Float32ToBF16 narrows to bfloat16 with round-to-nearest-even, keeping NaN a NaN.
func Float32ToBF16(f float32) uint16 {
	u := math.Float32bits(f)
	if u&0x7fffffff > 0x7f800000 {
		return uint16(u>>16) | 0x40
	}
	u += 0x7fff + (u>>16)&1
	return uint16(u >> 16)
}

// Float32ToF16 narrows to IEEE half with round-to-nearest-even.
func Float32ToF16(f float32) uint16 { return float16.Fromfloat32(f).Bits() }

// F16ToFloat32 widens an IEEE half bit pattern.
func F16ToFloat32(h uint16) float32 { return float16.Frombits(h).Float32() }

// RoundF16 is f rounded to the nearest IEEE half (ties to even), widened
// back: the value an fp16 tensor stores for f (±Inf beyond its range).
func RoundF16(f float32) float32 { return F16ToFloat32(Float32ToF16(f)) }

// Quantized is a linear weight [Rows=out, Cols=in] stored as small integers
// with per-group scales (and zero points when asymmetric):
//
//	w[r][c] = (Q[r*Cols+c] - Zero[r*G+g]) * Scale[r*G+g],  g = group of column c
//
// where G = Groups() and g = c/GroupSize, or GIdx[c] when GIdx is set
// (GPTQ act-order). GroupSize 0 means one group per row (per-channel).
//
// Q holds values in the signed range of Bits: symmetric schemes store q
// directly (Kuiper int8: −127..127, Zero nil); unsigned schemes (AWQ, GPTQ:
// u in 0..2^Bits−1) store q = u − 2^(Bits−1) and Zero = z − 2^(Bits−1), so a
// codec recovers u and z by adding Offset(). Zero may be fractional
// (msmodelslim weight_offset).
type Quantized struct {
	Bits      int
	GroupSize int // 0: per row
	Rows      int
	Cols      int
	Q         []int8
	Scale     []float32 // [Rows * Groups()]
	Zero      []float32 // [Rows * Groups()], nil when symmetric about 0
	GIdx      []int32   // [Cols] group of each input column, nil when c/GroupSize
}

// Shape implements Tensor.
func (q *Quantized) Shape() []int { return []int{q.Rows, q.Cols} }

// Groups is the number of scale groups per row.
func (q *Quantized) Groups() int {
	if q.GroupSize <= 0 {
		return 1
	}
	return q.Cols / q.GroupSize
}

// Offset is 2^(Bits−1): stored value + Offset() is the unsigned code that
// AWQ/GPTQ files hold.
func (q *Quantized) Offset() int { return 1 << (q.Bits - 1) }

// Symmetric reports whether there are no zero points.
func (q *Quantized) Symmetric() bool { return q.Zero == nil }

// Group returns the scale group of input column c.
func (q *Quantized) Group(c int) int {
	if q.GIdx != nil {
		return int(q.GIdx[c])
	}
	if q.GroupSize <= 0 {
		return 0
	}
	return c / q.GroupSize
}

// checkParams reports the first scale or zero point that is NaN or
// infinite (by row and group): such a weight has no value, and the GPU's
// fp16 GEMMs would not even give NaN for it (q8_pair makes a weight of an
// infinite scale 0).
func (q *Quantized) checkParams() error {
	g := max(q.Groups(), 1)
	for _, p := range []struct {
		what string
		v    []float32
	}{{"scale", q.Scale}, {"zero point", q.Zero}} {
		for i, x := range p.v {
			if !finite(x) {
				return fmt.Errorf("quantized tensor: %s %g of row %d, group %d is not finite", p.what, x, i/g, i%g)
			}
		}
	}
	return nil
}

// finite reports whether x is neither NaN nor infinite.
func finite(x float32) bool { return !math.IsNaN(float64(x)) && !math.IsInf(float64(x), 0) }

// Validate checks the slice lengths and value ranges (checkParams
// included).
func (q *Quantized) Validate() error {
	if q.Bits < 2 || q.Bits > 8 {
		return fmt.Errorf("quantized tensor: %d bits, want 2..8", q.Bits)
	}
	if q.Rows <= 0 || q.Cols <= 0 {
		return fmt.Errorf("quantized tensor: shape [%d %d]", q.Rows, q.Cols)
	}
	if q.GroupSize < 0 || (q.GroupSize > 0 && q.Cols%q.GroupSize != 0) {
		return fmt.Errorf("quantized tensor: group size %d does not divide %d input columns", q.GroupSize, q.Cols)
	}
	if len(q.Q) != q.Rows*q.Cols {
		return fmt.Errorf("quantized tensor: %d values for shape [%d %d]", len(q.Q), q.Rows, q.Cols)
	}
	ng := q.Rows * q.Groups()
	if len(q.Scale) != ng {
		return fmt.Errorf("quantized tensor: %d scales, want %d", len(q.Scale), ng)
	}
	if q.Zero != nil && len(q.Zero) != ng {
		return fmt.Errorf("quantized tensor: %d zero points, want %d", len(q.Zero), ng)
	}
	if err := q.checkParams(); err != nil {
		return err
	}
	if q.GIdx != nil {
		if len(q.GIdx) != q.Cols {
			return fmt.Errorf("quantized tensor: g_idx has %d entries, want %d", len(q.GIdx), q.Cols)
		}
		for c, g := range q.GIdx {
			if g < 0 || int(g) >= q.Groups() {
				return fmt.Errorf("quantized tensor: g_idx[%d] = %d outside 0..%d", c, g, q.Groups()-1)
			}
		}
	}
	if q.Bits == 8 {
		return nil // every int8 is an 8-bit code
	}
	// The codes are scanned on all cores (a 7B layer holds 200 M of them);
	// a failure is looked up again in order, to name the first bad code.
	lo, hi := -q.Offset(), q.Offset()-1
	var bad atomic.Bool
	Parallel(len(q.Q), 1<<18, func(i0, i1 int) {
		for _, v := range q.Q[i0:i1] {
			if int(v) < lo || int(v) > hi {
				bad.Store(true)
				return
			}
		}
	})
	if bad.Load() {
		for i, v := range q.Q {
			if int(v) < lo || int(v) > hi {
				return fmt.Errorf("quantized tensor: value %d at %d outside the %d-bit range %d..%d", v, i, q.Bits, lo, hi)
			}
		}
	}
	return nil
}

// Float32 implements Tensor: the dequantized weights.
func (q *Quantized) Float32() ([]float32, error) {
	out := make([]float32, q.Rows*q.Cols)
	q.DequantizeRows(0, q.Rows, out)
	return out, nil
}

// DequantizeRows writes rows [r0, r1) dequantized into dst (len (r1−r0)·Cols).
func (q *Quantized) DequantizeRows(r0, r1 int, dst []float32) {
	G := q.Groups()
	for r := r0; r < r1; r++ {
		row := q.Q[r*q.Cols : (r+1)*q.Cols]
		d := dst[(r-r0)*q.Cols : (r-r0+1)*q.Cols]
		for c, v := range row {
			g := q.Group(c)
			z := float32(0)
			if q.Zero != nil {
				z = q.Zero[r*G+g]
			}
			d[c] = (float32(v) - z) * q.Scale[r*G+g]
		}
	}
}

// W8A8 is a linear layer that quantizes its input activations too (msmodelslim
// static W8A8): per-tensor asymmetric int8 activations
//
//	x_q = clamp(round(x/InputScale + InputOffset), −128, 127)
//
// then an integer matmul with the per-channel symmetric int8 Weight and
//
//	y[n] = (Σ_k x_q[k]·W[n][k] + QuantBias[n]) · DeqScale[n]  (+ Bias[n] if set)
//
// As msmodelslim writes it, QuantBias already holds the layer's float bias
// (quant_bias = round(bias/DeqScale − InputOffset·Σ_k W[n][k])), so Bias is
// nil and a Qwen2 q/k/v bias tensor beside a W8A8 linear is not added again
// by the runtime.
//
// With Dynamic set (msmodelslim W8A8_DYNAMIC) the activations are quantized
// per token instead, symmetric about 0:
//
//	s_t = max_k |x[t][k]| / 127,  x_q = round(x/s_t)  (x_q = 0 when s_t = 0)
//	y[t][n] = (float32(Σ_k x_q[k]·W[n][k]) · s_t) · Weight.Scale[n]  (+ Bias[n])
//
// evaluated in float32 in that order; InputScale, InputOffset, DeqScale and
// QuantBias are then unused (zero, nil) and Bias holds the float bias.
type W8A8 struct {
	Weight      *Quantized // 8 bits, per row, symmetric (Zero nil); Scale = per-channel weight scale
	InputScale  float32
	InputOffset float32
	DeqScale    []float32 // [Rows] = InputScale · weight scale
	QuantBias   []int32   // [Rows]
	Bias        []float32 // [Rows] or nil
	// Dynamic selects per-token dynamic activations (see above).
	Dynamic bool
	// Sparse marks weights from sparse quantization (msmodelslim W8A8S:
	// the W8A8 layout, many weights zero); it changes no arithmetic.
	Sparse bool
}

// Validate checks the weight (8-bit per-row symmetric, no g_idx) and that
// the parameters match it: static, a positive finite input scale, a finite
// offset and DeqScale/QuantBias per row; dynamic, none of those; Bias per
// row or nil.
func (w *W8A8) Validate() error {
	q := w.Weight
	if q == nil {
		return fmt.Errorf("W8A8 layer without a weight")
	}
	if err := q.Validate(); err != nil {
		return err
	}
	if q.Bits != 8 || q.Zero != nil || q.GIdx != nil || q.GroupSize != 0 {
		return fmt.Errorf("W8A8 weight must be 8-bit symmetric per row (got %d bits, group %d, zero points %v, g_idx %v)", q.Bits, q.GroupSize, q.Zero != nil, q.GIdx != nil)
	}
	if w.Bias != nil && len(w.Bias) != q.Rows {
		return fmt.Errorf("W8A8: bias has %d values for %d output channels", len(w.Bias), q.Rows)
	}
	if w.Dynamic {
		if w.DeqScale != nil || w.QuantBias != nil || w.InputScale != 0 || w.InputOffset != 0 {
			return fmt.Errorf("W8A8: a dynamic (per-token) layer has no input_scale, input_offset, deq_scale or quant_bias")
		}
		return nil
	}
	if len(w.DeqScale) != q.Rows || len(w.QuantBias) != q.Rows {
		return fmt.Errorf("W8A8: deq_scale %d, quant_bias %d values for %d output channels", len(w.DeqScale), len(w.QuantBias), q.Rows)
	}
	if !(w.InputScale > 0) || math.IsInf(float64(w.InputScale), 0) {
		return fmt.Errorf("W8A8: input_scale %g, want a positive finite number", w.InputScale)
	}
	if !finite(w.InputOffset) {
		return fmt.Errorf("W8A8: input_offset %g is not finite", w.InputOffset)
	}
	return nil
}

// QuantizeToken quantizes one row of activations for a Dynamic W8A8
// linear: it writes x_q into dst and returns s_t.
func QuantizeToken(dst []int8, x []float32) float32 {
	var mx float32
	for _, v := range x {
		mx = max(mx, float32(math.Abs(float64(v))))
	}
	s := mx / 127
	for i, v := range x {
		if s == 0 {
			dst[i] = 0
			continue
		}
		q := math.RoundToEven(float64(v / s))
		dst[i] = int8(max(-127, min(127, q)))
	}
	return s
}

// Shape implements Tensor.
func (w *W8A8) Shape() []int { return w.Weight.Shape() }

// Float32 implements Tensor: the dequantized weight only (activation
// quantization cannot be folded into a float matrix).
func (w *W8A8) Float32() ([]float32, error) { return w.Weight.Float32() }
