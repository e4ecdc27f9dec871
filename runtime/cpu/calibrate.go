package cpu

import (
	"fmt"
	"math"

	gmat "gonum.org/v1/gonum/mat"

	"qtool/runtime"
	"qtool/runtime/cpu/gemm"
)

var _ runtime.Calibrator = (*Backend)(nil)

// FreeLinear implements runtime.Releaser: the garbage collector frees host
// memory, so there is nothing to do.
func (b *Backend) FreeLinear(runtime.Linear) {}

// FreeVector implements runtime.Releaser (nothing to do).
func (b *Backend) FreeVector(runtime.Vector) {}

// CopyRows implements runtime.Calibrator.
func (b *Backend) CopyRows(dst runtime.Buf, dstRow int, src runtime.Buf, srcRow, n int) {
	d, s := mat(dst), mat(src)
	runtime.CheckCopyRows("cpu.CopyRows", d, dstRow, s, srcRow, n)
	copy(d.Data[dstRow*d.cols:(dstRow+n)*d.cols], s.Data[srcRow*s.cols:(srcRow+n)*s.cols])
}

// GatherRows implements runtime.Calibrator.
func (b *Backend) GatherRows(dst, src runtime.Buf, rows []int) {
	d, s := mat(dst), mat(src)
	if d.cols != s.cols || d.rows != len(rows) {
		panic(fmt.Sprintf("cpu.GatherRows: %d rows of [%d %d] into [%d %d]", len(rows), s.rows, s.cols, d.rows, d.cols))
	}
	for i, r := range rows {
		copy(d.Row(i), s.Row(r))
	}
}

// FloatLinear implements runtime.Calibrator.
func (b *Backend) FloatLinear(w runtime.Buf) runtime.Linear {
	m := mat(w)
	return &denseLinear{out: m.rows, in: m.cols, w: m.Data}
}

// Dequantize implements runtime.Calibrator for float and weight-only
// quantized linears; a W8A8 linear has no float form (panic).
func (b *Backend) Dequantize(w runtime.Linear) runtime.Buf {
	out := b.Alloc(w.Out(), w.In()).(*Mat)
	switch l := linearOf(w).(type) {
	case *denseLinear:
		copy(out.Data, l.w)
	case *halfLinear:
		l.widenRows(0, l.out, out.Data)
	case *quantLinear:
		dequantRows(l.q, 0, l.q.Rows, 0, l.q.Cols, out.Data)
	default:
		panic(fmt.Sprintf("cpu.Dequantize: %T has no float form", w))
	}
	return out
}

// gramChunk is the number of rows transposed and multiplied at a time.
const gramChunk = 2048

// AddGram implements runtime.Calibrator with the packed GEMM kernels on a
// transposed copy of gramChunk rows at a time.
func (b *Backend) AddGram(g, x runtime.Buf) {
	gm, xm := mat(g), mat(x)
	n := xm.cols
	if gm.rows != n || gm.cols != n {
		panic(fmt.Sprintf("cpu.AddGram: x [%d %d] into g [%d %d]", xm.rows, n, gm.rows, gm.cols))
	}
	xt := b.get(n * min(xm.rows, gramChunk))
	defer b.put(xt)
	tmp := b.get(n * n)
	defer b.put(tmp)
	for r0 := 0; r0 < xm.rows; r0 += gramChunk {
		k := min(r0+gramChunk, xm.rows) - r0
		transpose(xt[:n*k], xm.Data[r0*n:(r0+k)*n], k, n, b.threads)
		gemm.MatMulNT(n, n, k, xt, k, xt, k, tmp, n, false, b.threads)
		parallel(n*n, b.threads, 1<<16, func(lo, hi int) {
			for i := lo; i < hi; i++ {
				gm.Data[i] += tmp[i]
			}
		})
	}
}

// AddCrossGram implements runtime.Calibrator like AddGram, on transposed
// copies of gramChunk rows of x and y at a time.
func (b *Backend) AddCrossGram(g, x, y runtime.Buf) {
	gm, xm, ym := mat(g), mat(x), mat(y)
	na, nb := xm.cols, ym.cols
	if xm.rows != ym.rows || gm.rows != na || gm.cols != nb {
		panic(fmt.Sprintf("cpu.AddCrossGram: x [%d %d], y [%d %d] into g [%d %d]", xm.rows, na, ym.rows, nb, gm.rows, gm.cols))
	}
	chunk := min(xm.rows, gramChunk)
	xt, yt := b.get(na*chunk), b.get(nb*chunk)
	defer b.put(xt)
	defer b.put(yt)
	for r0 := 0; r0 < xm.rows; r0 += gramChunk {
		k := min(r0+gramChunk, xm.rows) - r0
		transpose(xt[:na*k], xm.Data[r0*na:(r0+k)*na], k, na, b.threads)
		transpose(yt[:nb*k], ym.Data[r0*nb:(r0+k)*nb], k, nb, b.threads)
		gemm.MatMulNT(na, nb, k, xt, k, yt, k, gm.Data, nb, true, b.threads)
	}
}

// SolveSPD implements runtime.Calibrator with gonum's Cholesky
// factorisation in float64.
func (b *Backend) SolveSPD(x, a runtime.Buf, damp float64) error {
	xm, am := mat(x), mat(a)
	n := am.rows
	if am.cols != n || xm.cols != n {
		panic(fmt.Sprintf("cpu.SolveSPD: b [%d %d] with a [%d %d]", xm.rows, xm.cols, am.rows, am.cols))
	}
	s := gmat.NewSymDense(n, nil)
	for i := 0; i < n; i++ {
		for j := i; j < n; j++ {
			v := float64(am.Data[i*n+j])
			if i == j {
				v += damp
			}
			s.SetSym(i, j, v)
		}
	}
	var ch gmat.Cholesky
	if !ch.Factorize(s) {
		return fmt.Errorf("cpu: SolveSPD of %d×%d: %w", n, n, runtime.ErrNotPositiveDefinite)
	}
	// b·A⁻¹ = (A⁻¹·bᵀ)ᵀ, A symmetric: solve for the rows of b as columns.
	bt := gmat.NewDense(n, xm.rows, nil)
	for r := 0; r < xm.rows; r++ {
		for c := 0; c < n; c++ {
			bt.Set(c, r, float64(xm.Data[r*n+c]))
		}
	}
	var sol gmat.Dense
	if err := ch.SolveTo(&sol, bt); err != nil {
		return fmt.Errorf("cpu: SolveSPD: %w", err)
	}
	for r := 0; r < xm.rows; r++ {
		for c := 0; c < n; c++ {
			xm.Data[r*n+c] = float32(sol.At(c, r))
		}
	}
	return nil
}

// transpose writes dst[c*rows+t] = src[t*cols+c] in cache-sized tiles.
func transpose(dst, src []float32, rows, cols, threads int) {
	const tile = 32
	parallel((rows+tile-1)/tile, threads, 1, func(lo, hi int) {
		for tt := lo * tile; tt < min(hi*tile, rows); tt += tile {
			te := min(tt+tile, rows)
			for cc := 0; cc < cols; cc += tile {
				ce := min(cc+tile, cols)
				for t := tt; t < te; t++ {
					row := src[t*cols : (t+1)*cols]
					for c := cc; c < ce; c++ {
						dst[c*rows+t] = row[c]
					}
				}
			}
		}
	})
}

// ColumnStats implements runtime.Calibrator.
func (b *Backend) ColumnStats(x runtime.Buf) runtime.ColumnStats {
	m := mat(x)
	cols := m.cols
	st := runtime.ColumnStats{MeanAbs: make([]float32, cols), MaxAbs: make([]float32, cols),
		Min: make([]float32, cols), Max: make([]float32, cols)}
	parallel(cols, b.threads, 64, func(lo, hi int) {
		acc := make([]float64, hi-lo)
		for r := 0; r < m.rows; r++ {
			row := m.Data[r*cols+lo : r*cols+hi]
			for i, v := range row {
				c := lo + i
				acc[i] += math.Abs(float64(v))
				st.MaxAbs[c] = max(st.MaxAbs[c], float32(math.Abs(float64(v))))
				st.Min[c] = min(st.Min[c], v)
				st.Max[c] = max(st.Max[c], v)
			}
		}
		for i, a := range acc {
			st.MeanAbs[lo+i] = float32(a / float64(m.rows))
		}
	})
	return st
}

// SquaredError implements runtime.Calibrator.
func (b *Backend) SquaredError(a, ref runtime.Buf) (diff, sq float64) {
	r := mat(ref)
	var av []float32
	if a != nil {
		am := mat(a)
		if len(am.Data) != len(r.Data) {
			panic(fmt.Sprintf("cpu.SquaredError: [%d %d] against [%d %d]", am.rows, am.cols, r.rows, r.cols))
		}
		av = am.Data
	}
	for i, v := range r.Data {
		sq += float64(v) * float64(v)
		if av != nil {
			d := float64(av[i] - v)
			diff += d * d
		}
	}
	if av == nil {
		diff = sq
	}
	return diff, sq
}

// ScaleColumns implements runtime.Calibrator.
func (b *Backend) ScaleColumns(x runtime.Buf, s []float32, divide bool) {
	m := mat(x)
	if len(s) != m.cols {
		panic(fmt.Sprintf("cpu.ScaleColumns: %d scales for [%d %d]", len(s), m.rows, m.cols))
	}
	parallel(m.rows, b.threads, 64, func(lo, hi int) {
		for r := lo; r < hi; r++ {
			row := m.Row(r)
			if divide {
				for c := range row {
					row[c] /= s[c]
				}
			} else {
				for c := range row {
					row[c] *= s[c]
				}
			}
		}
	})
}

// Diagonal implements runtime.Calibrator.
func (b *Backend) Diagonal(g runtime.Buf) []float32 {
	m := mat(g)
	if m.rows != m.cols {
		panic(fmt.Sprintf("cpu.Diagonal: [%d %d] is not square", m.rows, m.cols))
	}
	d := make([]float32, m.rows)
	for i := range d {
		d[i] = m.Data[i*m.cols+i]
	}
	return d
}
