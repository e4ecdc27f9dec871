package shard

import (
	"fmt"
	"slices"

	"qtool/formats/model"
)

// quantizer is a tensor that quantizes itself on demand (quantize.Lazy).
type quantizer interface {
	Quantize() (*model.Quantized, error)
}

// Resolve returns the concrete form of t that can be split: a
// *model.Dense, *model.Quantized or *model.W8A8 (a lazily quantized tensor
// is quantized now, a *Tensor of a shard directory joined). Other tensor
// types are an error.
func Resolve(name string, t model.Tensor) (model.Tensor, error) {
	switch x := t.(type) {
	case *model.Dense:
		if !x.DType.IsFloat() {
			return nil, fmt.Errorf("tensor %q: dense dtype %v is not a float type", name, x.DType)
		}
		return x, nil
	case *model.Quantized:
		if err := x.Validate(); err != nil {
			return nil, fmt.Errorf("tensor %q: %w", name, err)
		}
		return x, nil
	case *model.W8A8:
		if err := validateW8A8(x); err != nil {
			return nil, fmt.Errorf("tensor %q: %w", name, err)
		}
		return x, nil
	case *Tensor: // a model opened from a shard directory, re-sharded
		j, err := x.Join()
		if err != nil {
			return nil, fmt.Errorf("tensor %q: %w", name, err)
		}
		return Resolve(name, j)
	case quantizer:
		q, err := x.Quantize()
		if err != nil {
			return nil, fmt.Errorf("tensor %q: %w", name, err)
		}
		return Resolve(name, q)
	case nil:
		return nil, fmt.Errorf("tensor %q is nil", name)
	}
	return nil, fmt.Errorf("tensor %q: tensors of type %T cannot be sharded", name, t)
}

// validateW8A8 checks w and refuses per-token dynamic activations: a
// rank holding some input columns cannot compute a token's scale, which
// needs the whole row.
func validateW8A8(w *model.W8A8) error {
	if err := w.Validate(); err != nil {
		return err
	}
	if w.Dynamic {
		return fmt.Errorf("W8A8 with per-token dynamic activations cannot be split over ranks (a token's scale needs all input columns)")
	}
	return nil
}

// Describe returns the manifest entry of the tensor name (already
// resolved, see Resolve) for a model with config cfg over n ranks, checking
// that its splits fall on quantization group and packing boundaries.
func Describe(cfg model.Config, n int, name string, t model.Tensor) (Entry, error) {
	e := Entry{Name: name, Shape: append([]int(nil), t.Shape()...)}
	switch x := t.(type) {
	case *model.Dense:
		e.Kind, e.DType = KindDense, x.DType.String()
	case *model.Quantized:
		e.Kind, e.Bits, e.GroupSize, e.Zero, e.GIdx = KindQuantized, x.Bits, x.GroupSize, x.Zero != nil, x.GIdx != nil
	case *model.W8A8:
		e.Kind, e.Bits, e.Bias = KindW8A8, 8, x.Bias != nil
	default:
		return e, fmt.Errorf("tensor %q: type %T cannot be sharded (resolve it first)", name, t)
	}
	split, ranges, err := Layout(cfg, n, name, e.Shape)
	if err != nil {
		return e, err
	}
	e.Split, e.Dim, e.Ranges = split, split.Dim(), ranges
	if err := checkAlign(e.Kind, e.Bits, e.GroupSize, e.Shape, split, ranges); err != nil {
		return e, fmt.Errorf("tensor %q: %w", name, err)
	}
	return e, nil
}

// Part returns rank r's piece of t (a resolved tensor matching e). Dense
// pieces split on dim 0 alias t's bytes; everything else is copied.
func Part(e *Entry, t model.Tensor, r int) (model.Tensor, error) {
	if e.Split == Replicated {
		return t, nil
	}
	if r < 0 || r >= len(e.Ranges) {
		return nil, fmt.Errorf("tensor %q: rank %d outside 0..%d", e.Name, r, len(e.Ranges)-1)
	}
	if !slices.Equal(t.Shape(), e.Shape) {
		return nil, fmt.Errorf("tensor %q: shape %v, the manifest says %v", e.Name, t.Shape(), e.Shape)
	}
	b, end := e.Ranges[r][0], e.Ranges[r][1]
	switch x := t.(type) {
	case *model.Dense:
		return denseSlice(x, e.Split.Dim(), b, end), nil
	case *model.Quantized:
		return quantSlice(e.Name, x, e.Split.Dim(), b, end)
	case *model.W8A8:
		return w8a8Slice(e.Name, x, e.Split.Dim(), b, end, r)
	}
	return nil, fmt.Errorf("tensor %q: type %T cannot be sharded", e.Name, t)
}

// SplitTensor returns the pieces of t for every rank.
func SplitTensor(e *Entry, t model.Tensor) ([]model.Tensor, error) {
	n := max(len(e.Ranges), 1)
	out := make([]model.Tensor, n)
	for r := range out {
		p, err := Part(e, t, r)
		if err != nil {
			return nil, err
		}
		out[r] = p
	}
	return out, nil
}

func denseSlice(d *model.Dense, dim, b, e int) *model.Dense {
	es := d.DType.Size()
	if dim == 0 {
		row := es
		if len(d.Dims) == 2 {
			row *= d.Dims[1]
		}
		dims := append([]int(nil), d.Dims...)
		dims[0] = e - b
		return &model.Dense{DType: d.DType, Dims: dims, Data: d.Data[b*row : e*row]}
	}
	rows, cols := d.Dims[0], d.Dims[1]
	w := (e - b) * es
	out := make([]byte, rows*w)
	for i := 0; i < rows; i++ {
		copy(out[i*w:(i+1)*w], d.Data[(i*cols+b)*es:(i*cols+e)*es])
	}
	return &model.Dense{DType: d.DType, Dims: []int{rows, e - b}, Data: out}
}

func quantSlice(name string, q *model.Quantized, dim, b, e int) (*model.Quantized, error) {
	G := q.Groups()
	if dim == 0 {
		p := &model.Quantized{Bits: q.Bits, GroupSize: q.GroupSize, Rows: e - b, Cols: q.Cols,
			Q:     slices.Clone(q.Q[b*q.Cols : e*q.Cols]),
			Scale: slices.Clone(q.Scale[b*G : e*G])}
		if q.Zero != nil {
			p.Zero = slices.Clone(q.Zero[b*G : e*G])
		}
		if q.GIdx != nil {
			p.GIdx = slices.Clone(q.GIdx)
		}
		return p, nil
	}
	w := e - b
	g0, g1 := 0, 1 // group range of the piece
	if q.GroupSize > 0 {
		if b%q.GroupSize != 0 || e%q.GroupSize != 0 {
			return nil, fmt.Errorf("tensor %q: input range [%d, %d) does not fall on %d-column group boundaries", name, b, e, q.GroupSize)
		}
		g0, g1 = b/q.GroupSize, e/q.GroupSize
	}
	pg := g1 - g0
	p := &model.Quantized{Bits: q.Bits, GroupSize: q.GroupSize, Rows: q.Rows, Cols: w,
		Q: make([]int8, q.Rows*w), Scale: make([]float32, q.Rows*pg)}
	if q.Zero != nil {
		p.Zero = make([]float32, q.Rows*pg)
	}
	for i := 0; i < q.Rows; i++ {
		copy(p.Q[i*w:(i+1)*w], q.Q[i*q.Cols+b:i*q.Cols+e])
		copy(p.Scale[i*pg:(i+1)*pg], q.Scale[i*G+g0:i*G+g1])
		if q.Zero != nil {
			copy(p.Zero[i*pg:(i+1)*pg], q.Zero[i*G+g0:i*G+g1])
		}
	}
	if q.GIdx != nil {
		p.GIdx = make([]int32, w)
		for c := b; c < e; c++ {
			g := int(q.GIdx[c])
			if g < g0 || g >= g1 {
				return nil, fmt.Errorf("tensor %q: g_idx[%d] = %d refers to a group outside the rank's input range [%d, %d) (act-order weights whose groups cross the split cannot be row-parallel)", name, c, g, b, e)
			}
			p.GIdx[c-b] = int32(g - g0)
		}
	}
	return p, nil
}

func w8a8Slice(name string, w *model.W8A8, dim, b, e, rank int) (*model.W8A8, error) {
	wq, err := quantSlice(name, w.Weight, dim, b, e)
	if err != nil {
		return nil, err
	}
	p := &model.W8A8{Weight: wq, InputScale: w.InputScale, InputOffset: w.InputOffset}
	if dim == 0 {
		p.DeqScale = slices.Clone(w.DeqScale[b:e])
		p.QuantBias = slices.Clone(w.QuantBias[b:e])
		if w.Bias != nil {
			p.Bias = slices.Clone(w.Bias[b:e])
		}
		return p, nil
	}
	// Row-parallel: the biases are added once, by rank 0.
	p.DeqScale = slices.Clone(w.DeqScale)
	p.QuantBias = make([]int32, len(w.QuantBias))
	if w.Bias != nil {
		p.Bias = make([]float32, len(w.Bias))
	}
	if rank == 0 {
		copy(p.QuantBias, w.QuantBias)
		copy(p.Bias, w.Bias)
	}
	return p, nil
}

// Concat reassembles the whole tensor of e from the pieces of every rank,
// the inverse of SplitTensor. It checks the pieces' kinds and shapes, and
// that pieces meant to be equal (per-row scales of a row-parallel split,
// replicated tensors' shapes) are.
func Concat(e *Entry, parts []model.Tensor) (model.Tensor, error) {
	if len(parts) == 0 {
		return nil, fmt.Errorf("tensor %q: no pieces", e.Name)
	}
	for r, p := range parts {
		if p == nil {
			return nil, fmt.Errorf("tensor %q: rank %d piece is missing", e.Name, r)
		}
		if want := e.PartShape(r); !slices.Equal(p.Shape(), want) {
			return nil, fmt.Errorf("tensor %q: rank %d piece has shape %v, want %v", e.Name, r, p.Shape(), want)
		}
	}
	if e.Split == Replicated {
		return parts[0], nil
	}
	if len(parts) != len(e.Ranges) {
		return nil, fmt.Errorf("tensor %q: %d pieces for %d ranks", e.Name, len(parts), len(e.Ranges))
	}
	dim := e.Split.Dim()
	switch e.Kind {
	case KindDense:
		ds := make([]*model.Dense, len(parts))
		for r, p := range parts {
			d, ok := p.(*model.Dense)
			if !ok || d.DType.String() != e.DType {
				return nil, fmt.Errorf("tensor %q: rank %d piece is %T, want dense %s", e.Name, r, p, e.DType)
			}
			ds[r] = d
		}
		return denseConcat(ds, dim, e.Shape), nil
	case KindQuantized:
		qs := make([]*model.Quantized, len(parts))
		for r, p := range parts {
			q, ok := p.(*model.Quantized)
			if !ok {
				return nil, fmt.Errorf("tensor %q: rank %d piece is %T, want quantized", e.Name, r, p)
			}
			qs[r] = q
		}
		return quantConcat(e.Name, qs, dim)
	case KindW8A8:
		ws := make([]*model.W8A8, len(parts))
		qs := make([]*model.Quantized, len(parts))
		for r, p := range parts {
			w, ok := p.(*model.W8A8)
			if !ok {
				return nil, fmt.Errorf("tensor %q: rank %d piece is %T, want w8a8", e.Name, r, p)
			}
			ws[r], qs[r] = w, w.Weight
		}
		return w8a8Concat(e.Name, ws, qs, dim)
	}
	return nil, fmt.Errorf("tensor %q: unknown kind %q", e.Name, e.Kind)
}

func denseConcat(ds []*model.Dense, dim int, shape []int) *model.Dense {
	es := ds[0].DType.Size()
	out := make([]byte, 0, model.NumElements(shape)*es)
	if dim == 0 {
		for _, d := range ds {
			out = append(out, d.Data...)
		}
	} else {
		for i := 0; i < shape[0]; i++ {
			for _, d := range ds {
				w := d.Dims[1] * es
				out = append(out, d.Data[i*w:(i+1)*w]...)
			}
		}
	}
	return &model.Dense{DType: ds[0].DType, Dims: append([]int(nil), shape...), Data: out}
}

func quantConcat(name string, qs []*model.Quantized, dim int) (*model.Quantized, error) {
	q0 := qs[0]
	for r, q := range qs {
		if q.Bits != q0.Bits || q.GroupSize != q0.GroupSize || (q.Zero == nil) != (q0.Zero == nil) || (q.GIdx == nil) != (q0.GIdx == nil) {
			return nil, fmt.Errorf("tensor %q: rank %d piece is quantized differently from rank 0", name, r)
		}
	}
	out := &model.Quantized{Bits: q0.Bits, GroupSize: q0.GroupSize}
	if dim == 0 {
		out.Cols = q0.Cols
		for r, q := range qs {
			out.Rows += q.Rows
			out.Q = append(out.Q, q.Q...)
			out.Scale = append(out.Scale, q.Scale...)
			if q.Zero != nil {
				out.Zero = append(out.Zero, q.Zero...)
			}
			if q0.GIdx != nil && !slices.Equal(q.GIdx, q0.GIdx) {
				return nil, fmt.Errorf("tensor %q: rank %d g_idx differs from rank 0", name, r)
			}
		}
		out.GIdx = slices.Clone(q0.GIdx)
		return out, nil
	}
	out.Rows = q0.Rows
	for _, q := range qs {
		out.Cols += q.Cols
	}
	perRow := q0.GroupSize <= 0 // one scale per row, shared by every piece
	for r, q := range qs[1:] {
		if perRow && (!slices.Equal(q.Scale, q0.Scale) || !slices.Equal(q.Zero, q0.Zero)) {
			return nil, fmt.Errorf("tensor %q: rank %d per-row scales differ from rank 0", name, r+1)
		}
	}
	for i := 0; i < out.Rows; i++ {
		for _, q := range qs {
			out.Q = append(out.Q, q.Q[i*q.Cols:(i+1)*q.Cols]...)
			if perRow {
				continue
			}
			G := q.Groups()
			out.Scale = append(out.Scale, q.Scale[i*G:(i+1)*G]...)
			if q.Zero != nil {
				out.Zero = append(out.Zero, q.Zero[i*G:(i+1)*G]...)
			}
		}
	}
	if perRow {
		out.Scale = slices.Clone(q0.Scale)
		out.Zero = slices.Clone(q0.Zero)
	}
	if q0.GIdx != nil {
		g0 := int32(0)
		for _, q := range qs {
			for _, g := range q.GIdx {
				out.GIdx = append(out.GIdx, g+g0)
			}
			if !perRow {
				g0 += int32(q.Groups())
			}
		}
	}
	return out, nil
}

func w8a8Concat(name string, ws []*model.W8A8, qs []*model.Quantized, dim int) (*model.W8A8, error) {
	wq, err := quantConcat(name, qs, dim)
	if err != nil {
		return nil, err
	}
	w0 := ws[0]
	out := &model.W8A8{Weight: wq, InputScale: w0.InputScale, InputOffset: w0.InputOffset}
	for r, w := range ws {
		if w.InputScale != w0.InputScale || w.InputOffset != w0.InputOffset || (w.Bias == nil) != (w0.Bias == nil) {
			return nil, fmt.Errorf("tensor %q: rank %d activation quantization or bias differs from rank 0", name, r)
		}
	}
	if dim == 0 {
		for _, w := range ws {
			out.DeqScale = append(out.DeqScale, w.DeqScale...)
			out.QuantBias = append(out.QuantBias, w.QuantBias...)
			if w.Bias != nil {
				out.Bias = append(out.Bias, w.Bias...)
			}
		}
		return out, nil
	}
	for r, w := range ws[1:] {
		if !slices.Equal(w.DeqScale, w0.DeqScale) {
			return nil, fmt.Errorf("tensor %q: rank %d deq_scale differs from rank 0", name, r+1)
		}
		for _, v := range w.QuantBias {
			if v != 0 {
				return nil, fmt.Errorf("tensor %q: rank %d of a row-parallel w8a8 layer has a non-zero quant_bias (only rank 0 may hold it)", name, r+1)
			}
		}
		for _, v := range w.Bias {
			if v != 0 {
				return nil, fmt.Errorf("tensor %q: rank %d of a row-parallel w8a8 layer has a non-zero bias (only rank 0 may hold it)", name, r+1)
			}
		}
	}
	out.DeqScale = slices.Clone(w0.DeqScale)
	out.QuantBias = slices.Clone(w0.QuantBias)
	out.Bias = slices.Clone(w0.Bias)
	return out, nil
}
