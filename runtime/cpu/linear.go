package cpu

import (
	"encoding/binary"
	"fmt"
	"math"

	"qtool/formats/model"
	"qtool/runtime"
	"qtool/runtime/cpu/gemm"
)

// denseLinear is a float weight widened to float32.
type denseLinear struct {
	out, in int
	w       []float32
}

func (l *denseLinear) Out() int { return l.out }
func (l *denseLinear) In() int  { return l.in }

// halfLinear is an F16 or BF16 weight kept in its stored form (once the
// backend's float32 budget is spent) and widened panel by panel.
type halfLinear struct {
	out, in int
	dt      model.DType
	data    []byte // little-endian, aliases the source tensor
}

func (l *halfLinear) Out() int { return l.out }
func (l *halfLinear) In() int  { return l.in }

// widenRows writes rows [r0, r1) as float32 into dst.
func (l *halfLinear) widenRows(r0, r1 int, dst []float32) {
	src := l.data[2*r0*l.in : 2*r1*l.in]
	if l.dt == model.BF16 {
		for i := range dst[:len(src)/2] {
			dst[i] = math.Float32frombits(uint32(binary.LittleEndian.Uint16(src[2*i:])) << 16)
		}
		return
	}
	for i := range dst[:len(src)/2] {
		dst[i] = model.F16ToFloat32(binary.LittleEndian.Uint16(src[2*i:]))
	}
}

// quantLinear is a *model.Quantized weight kept in its integer form.
type quantLinear struct {
	q *model.Quantized
}

func (l *quantLinear) Out() int { return l.q.Rows }
func (l *quantLinear) In() int  { return l.q.Cols }

// w8a8Linear is an msmodelslim W8A8 layer.
type w8a8Linear struct {
	w *model.W8A8
}

func (l *w8a8Linear) Out() int { return l.w.Weight.Rows }
func (l *w8a8Linear) In() int  { return l.w.Weight.Cols }

// UploadLinear implements runtime.Backend.
func (b *Backend) UploadLinear(name string, t model.Tensor) (runtime.Linear, error) {
	switch w := t.(type) {
	case *model.Dense:
		if len(w.Dims) != 2 {
			return nil, fmt.Errorf("%s: linear weight has shape %v, want [out, in]", name, w.Dims)
		}
		if !w.DType.IsFloat() {
			return nil, fmt.Errorf("%s: dense linear weight has dtype %v, want F32, F16 or BF16", name, w.DType)
		}
		if (w.DType == model.F16 || w.DType == model.BF16) && !b.reserveF32(int64(w.Len())*4) {
			return &halfLinear{out: w.Dims[0], in: w.Dims[1], dt: w.DType, data: w.Data}, nil
		}
		v := make([]float32, w.Len())
		if err := w.Float32Into(v); err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		return &denseLinear{out: w.Dims[0], in: w.Dims[1], w: v}, nil
	case *model.Quantized:
		if err := w.Validate(); err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		return &quantLinear{q: w}, nil
	case *model.W8A8:
		if err := w.Validate(); err != nil {
			return nil, fmt.Errorf("%s: %w", name, err)
		}
		return &w8a8Linear{w: w}, nil
	case nil:
		return nil, fmt.Errorf("%s: nil tensor", name)
	}
	return nil, fmt.Errorf("%s: the CPU backend cannot run weights of type %T", name, t)
}

func linearOf(w runtime.Linear) runtime.Linear {
	switch w.(type) {
	case *denseLinear, *halfLinear, *quantLinear, *w8a8Linear:
		return w
	}
	panic(fmt.Sprintf("cpu: linear weight of type %T does not belong to the CPU backend", w))
}

// MatMul implements runtime.Backend.
func (b *Backend) MatMul(dst, x runtime.Buf, w runtime.Linear) {
	d, s := mat(dst), mat(x)
	w = linearOf(w)
	if s.cols != w.In() || d.cols != w.Out() || d.rows != s.rows {
		panic(fmt.Sprintf("cpu.MatMul: x [%d %d] · W[%d %d]ᵀ into [%d %d]", s.rows, s.cols, w.Out(), w.In(), d.rows, d.cols))
	}
	m, n, k := s.rows, w.Out(), w.In()
	switch l := w.(type) {
	case *denseLinear:
		gemm.MatMulNT(m, n, k, s.Data, k, l.w, k, d.Data, n, false, b.threads)
	case *halfLinear:
		gemm.MatMulNTRows(m, n, k, s.Data, k, l.widenRows, d.Data, n, b.threads)
	case *quantLinear:
		gemm.MatMulNTRows(m, n, k, s.Data, k, func(j0, j1 int, out []float32) {
			dequantRows(l.q, j0, j1, 0, k, out)
		}, d.Data, n, b.threads)
	case *w8a8Linear:
		b.matMulW8A8(d, s, l.w)
	}
}

// dequantRows writes columns [c0, c1) of rows [r0, r1) of q, dequantized,
// into dst (row stride c1−c0).
func dequantRows(q *model.Quantized, r0, r1, c0, c1 int, dst []float32) {
	if q.GIdx != nil {
		if c0 == 0 && c1 == q.Cols {
			q.DequantizeRows(r0, r1, dst)
			return
		}
		G := q.Groups()
		w := c1 - c0
		for r := r0; r < r1; r++ {
			d := dst[(r-r0)*w : (r-r0+1)*w]
			for c := c0; c < c1; c++ {
				g := int(q.GIdx[c])
				z := float32(0)
				if q.Zero != nil {
					z = q.Zero[r*G+g]
				}
				d[c-c0] = (float32(q.Q[r*q.Cols+c]) - z) * q.Scale[r*G+g]
			}
		}
		return
	}
	G := q.Groups()
	gs := q.GroupSize
	if gs <= 0 {
		gs = q.Cols
	}
	w := c1 - c0
	for r := r0; r < r1; r++ {
		d := dst[(r-r0)*w : (r-r0+1)*w]
		row := q.Q[r*q.Cols : (r+1)*q.Cols]
		for c := c0; c < c1; {
			g := c / gs
			e := min((g+1)*gs, c1)
			s := q.Scale[r*G+g]
			z := float32(0)
			if q.Zero != nil {
				z = q.Zero[r*G+g]
			}
			src := row[c:e]
			out := d[c-c0 : e-c0]
			if z == 0 {
				for i, v := range src {
					out[i] = float32(v) * s
				}
			} else {
				for i, v := range src {
					out[i] = (float32(v) - z) * s
				}
			}
			c = e
		}
	}
}

// w8a8Chunk is the largest k slice whose int8·int8 partial sums stay exact
// in float32: 1024 · 128 · 128 = 2^24.
const w8a8Chunk = 1024

// quantizeInput applies the static per-tensor activation quantization of
// an msmodelslim W8A8 layer: clamp(round(x/scale + offset), −128, 127),
// rounding half to even as torch.round does.
func quantizeInput(dst, x []float32, scale, offset float32) {
	for i, v := range x {
		q := math.RoundToEven(float64(v/scale + offset))
		if q < -128 {
			q = -128
		} else if q > 127 {
			q = 127
		}
		dst[i] = float32(q)
	}
}

// matMulW8A8 computes y = (Σ x_q·W + quant_bias) · deq_scale (+ bias) with
// the integer products summed exactly: the GEMM runs on int8 values held
// in float32 over k slices short enough for every partial sum to be an
// exactly representable integer.
func (b *Backend) matMulW8A8(d, s *Mat, w *model.W8A8) {
	m, n, k := s.rows, w.Weight.Rows, w.Weight.Cols
	xq := b.get(len(s.Data))
	defer b.put(xq)
	var tok []float32 // per-token scales of a dynamic layer
	if w.Dynamic {
		tok = make([]float32, m)
		parallel(m, b.threads, 16, func(lo, hi int) {
			row := make([]int8, k)
			for i := lo; i < hi; i++ {
				tok[i] = model.QuantizeToken(row, s.Data[i*k:(i+1)*k])
				for c, v := range row {
					xq[i*k+c] = float32(v)
				}
			}
		})
	} else {
		parallel(len(xq), b.threads, 1<<15, func(lo, hi int) {
			quantizeInput(xq[lo:hi], s.Data[lo:hi], w.InputScale, w.InputOffset)
		})
	}
	q := w.Weight.Q
	fillCols := func(c0, c1 int) func(j0, j1 int, out []float32) {
		return func(j0, j1 int, out []float32) {
			kw := c1 - c0
			for j := j0; j < j1; j++ {
				src := q[j*k+c0 : j*k+c1]
				o := out[(j-j0)*kw : (j-j0+1)*kw]
				for i, v := range src {
					o[i] = float32(v)
				}
			}
		}
	}
	var acc []float64
	if k > w8a8Chunk {
		acc = make([]float64, m*n)
		tmp := make([]float32, m*n)
		for c0 := 0; c0 < k; c0 += w8a8Chunk {
			c1 := min(c0+w8a8Chunk, k)
			gemm.MatMulNTRows(m, n, c1-c0, xq[c0:], k, fillCols(c0, c1), tmp, n, b.threads)
			for i, v := range tmp {
				acc[i] += float64(v)
			}
		}
	} else {
		gemm.MatMulNTRows(m, n, k, xq, k, fillCols(0, k), d.Data, n, b.threads)
	}
	for i := 0; i < m; i++ {
		row := d.Data[i*n : (i+1)*n]
		for j := range row {
			var sum float64
			if acc != nil {
				sum = acc[i*n+j]
			} else {
				sum = float64(row[j])
			}
			var y float32
			if tok != nil { // explicit conversions: rounded step by step, no fused multiply-add
				y = float32(float32(float32(sum)*tok[i]) * w.Weight.Scale[j])
			} else {
				y = float32(float32(sum+float64(w.QuantBias[j])) * w.DeqScale[j])
			}
			if w.Bias != nil {
				y += w.Bias[j]
			}
			row[j] = y
		}
	}
}

// Embed implements runtime.Backend.
func (b *Backend) Embed(dst runtime.Buf, table runtime.Linear, ids []int) {
	d := mat(dst)
	table = linearOf(table)
	if d.rows != len(ids) || d.cols != table.In() {
		panic(fmt.Sprintf("cpu.Embed: %d ids into [%d %d], table width %d", len(ids), d.rows, d.cols, table.In()))
	}
	k := table.In()
	for i, id := range ids {
		if id < 0 || id >= table.Out() {
			panic(fmt.Sprintf("cpu.Embed: id %d outside the table of %d rows", id, table.Out()))
		}
		row := d.Data[i*k : (i+1)*k]
		switch t := table.(type) {
		case *denseLinear:
			copy(row, t.w[id*k:(id+1)*k])
		case *halfLinear:
			t.widenRows(id, id+1, row)
		case *quantLinear:
			dequantRows(t.q, id, id+1, 0, k, row)
		case *w8a8Linear:
			dequantRows(t.w.Weight, id, id+1, 0, k, row)
		}
	}
}
