package model

import "fmt"

// RopePerm maps the q/k rows of heads heads of headDim rows each from
// layout from to layout to: row i of the result comes from row perm[i] of
// the source. Within a head, HF ("rotate half") row half·headDim/2 + j is
// Meta (interleaved) row 2j + half. It returns nil when from == to.
func RopePerm(heads, headDim int, from, to RopeLayout) []int {
	if from == to {
		return nil
	}
	perm := make([]int, heads*headDim)
	for h := 0; h < heads; h++ {
		for half := 0; half < 2; half++ {
			for j := 0; j < headDim/2; j++ {
				hf, meta := h*headDim+half*headDim/2+j, h*headDim+2*j+half
				if to == RopeInterleaved {
					perm[meta] = hf
				} else {
					perm[hf] = meta
				}
			}
		}
	}
	return perm
}

// PermuteRows returns a copy of t whose row i (first dimension; a vector's
// element i) is row perm[i] of t, with every per-row parameter moved along:
// the scales and zero points of a *Quantized (its g_idx indexes columns and
// stays), the per-channel weight, DeqScale, QuantBias and Bias of a *W8A8.
// A *Dense keeps its dtype; any other tensor is dequantized to F32.
func PermuteRows(t Tensor, perm []int) (Tensor, error) {
	sh := t.Shape()
	if len(sh) == 0 || sh[0] != len(perm) {
		return nil, fmt.Errorf("permute rows: shape %v, permutation of %d rows", sh, len(perm))
	}
	for _, p := range perm {
		if p < 0 || p >= len(perm) {
			return nil, fmt.Errorf("permute rows: row %d outside 0..%d", p, len(perm)-1)
		}
	}
	switch v := t.(type) {
	case *Dense:
		row := NumElements(sh) / sh[0] * v.DType.Size()
		return &Dense{DType: v.DType, Dims: append([]int(nil), sh...), Data: permute(v.Data, perm, row)}, nil
	case *Quantized:
		c := *v
		G := v.Groups()
		c.Q = permute(v.Q, perm, v.Cols)
		c.Scale = permute(v.Scale, perm, G)
		if v.Zero != nil {
			c.Zero = permute(v.Zero, perm, G)
		}
		return &c, nil
	case *W8A8:
		w, err := PermuteRows(v.Weight, perm)
		if err != nil {
			return nil, err
		}
		c := *v
		c.Weight = w.(*Quantized)
		c.DeqScale = permute(v.DeqScale, perm, 1)
		c.QuantBias = permute(v.QuantBias, perm, 1)
		if v.Bias != nil {
			c.Bias = permute(v.Bias, perm, 1)
		}
		return &c, nil
	}
	f, err := t.Float32()
	if err != nil {
		return nil, err
	}
	return FromFloat32(sh, permute(f, perm, len(f)/sh[0])), nil
}

// permute returns the rows of v (each n elements) in the order perm.
func permute[E any](v []E, perm []int, n int) []E {
	out := make([]E, len(v))
	for dst, src := range perm {
		copy(out[dst*n:(dst+1)*n], v[src*n:(src+1)*n])
	}
	return out
}

// RopeRows is the row permutation (see RopePerm) that puts tensor name of
// a model with config c into the rope layout to, nil when it needs none:
// q and k weights and biases are permuted per head, the per-head q/k norms
// (Qwen3) within one head.
func RopeRows(c Config, name string, to RopeLayout) []int {
	layer, role, _ := ParseName(name)
	switch {
	case layer < 0 || c.Rope == to:
		return nil
	case role == Q || role == QBias:
		return RopePerm(c.Heads, c.HeadDim, c.Rope, to)
	case role == K || role == KBias:
		return RopePerm(c.KVHeads, c.HeadDim, c.Rope, to)
	case role == QNorm || role == KNorm:
		return RopePerm(1, c.HeadDim, c.Rope, to)
	}
	return nil
}

// WithRope returns m with its q/k rows in layout to: the q and k weights
// and biases are permuted per head, the per-head q/k norms (Qwen3) within
// one head. It returns m itself when the layout already is to; otherwise a
// new model sharing every other tensor (m must stay open while it is used),
// whose q/k tensors are copies (for a Llama about a sixth of the weights).
// Tensors split into pieces (anything with a Join method, such as
// shard.Tensor) are joined first. Lazily quantized tensors (anything
// with a Quantize method, such as quantize.Lazy) are quantized first: their
// rows are quantized independently, so the result is the same.
func WithRope(m *Model, to RopeLayout) (*Model, error) {
	c := m.Config
	if c.Rope == to {
		return m, nil
	}
	out := New(c)
	out.Config.Rope = to
	out.Source, out.Format, out.TokenizerDir = m.Source, m.Format, m.TokenizerDir
	for _, name := range m.Names() {
		t, _ := m.Lookup(name)
		perm := RopeRows(c, name, to)
		if perm != nil {
			var err error
			switch v := t.(type) {
			case interface{ Quantize() (*Quantized, error) }:
				t, err = v.Quantize()
			case interface{ Join() (Tensor, error) }:
				t, err = v.Join()
			}
			if err != nil {
				return nil, fmt.Errorf("rope layout %s: tensor %q: %w", to, name, err)
			}
			p, err := PermuteRows(t, perm)
			if err != nil {
				return nil, fmt.Errorf("rope layout %s: tensor %q: %w", to, name, err)
			}
			t = p
		}
		out.Set(name, t)
	}
	return out, nil
}
