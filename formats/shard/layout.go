package shard

import (
	"fmt"
	"strconv"
	"strings"

	"qtool/formats/model"
)

// PackAlign is the split alignment of 4-bit weights: AWQ packs 8 output
// channels, GPTQ 8 input rows, into one int32.
const PackAlign = 8

// ValidSizes lists the tensor-parallel sizes (up to the query heads) that
// divide both the attention heads and the KV heads of cfg.
func ValidSizes(cfg model.Config) []int {
	var out []int
	for n := 1; n <= cfg.Heads; n++ {
		if cfg.Heads%n == 0 && cfg.KVHeads > 0 && cfg.KVHeads%n == 0 {
			out = append(out, n)
		}
	}
	return out
}

func joinInts(v []int) string {
	s := make([]string, len(v))
	for i, x := range v {
		s[i] = strconv.Itoa(x)
	}
	return strings.Join(s, ", ")
}

// CheckTP reports whether cfg can be split over n ranks: n must divide the
// attention heads and the KV heads (whole heads per rank), and the FFN width
// and vocabulary must have at least n entries. The error names the sizes
// that would work.
func CheckTP(cfg model.Config, n int) error {
	if n < 1 || n > MaxWorldSize {
		return fmt.Errorf("tensor-parallel size %d: want 1..%d", n, MaxWorldSize)
	}
	if cfg.Heads <= 0 || cfg.KVHeads <= 0 || cfg.Heads%n != 0 || cfg.KVHeads%n != 0 {
		return fmt.Errorf("tensor-parallel size %d does not divide the %d attention heads and %d KV heads of this %s model (sizes that work: %s)",
			n, cfg.Heads, cfg.KVHeads, cfg.Arch, joinInts(ValidSizes(cfg)))
	}
	if cfg.Intermediate < n || cfg.Vocab < n {
		return fmt.Errorf("tensor-parallel size %d exceeds the FFN width %d or vocabulary %d", n, cfg.Intermediate, cfg.Vocab)
	}
	return nil
}

// balanced splits size into n contiguous ranges of units of unit elements,
// as equal as possible (earlier ranks get fewer when uneven).
func balanced(size, unit, n int) [][2]int {
	units := size / unit
	out := make([][2]int, n)
	for r := range out {
		out[r] = [2]int{r * units / n * unit, (r + 1) * units / n * unit}
	}
	return out
}

// Layout returns how the tensor name of shape shape (of a model with config
// cfg) is split over n ranks, and each rank's range of the split dimension
// (nil when replicated). It checks that shape has the size the config implies
// along the split dimension; cfg must pass CheckTP for n.
func Layout(cfg model.Config, n int, name string, shape []int) (Split, [][2]int, error) {
	layer, role, ok := model.ParseName(name)
	if !ok {
		return "", nil, fmt.Errorf("%q is not a canonical tensor name", name)
	}
	if err := CheckTP(cfg, n); err != nil {
		return "", nil, err
	}
	var split Split
	var size, unit int
	switch {
	case layer < 0 && (role == model.Embed || role == model.LMHead):
		split, size, unit = Vocab, cfg.Vocab, 1
	case layer < 0:
		split = Replicated
	default:
		switch role {
		case model.Q, model.QBias:
			split, size, unit = Column, cfg.QDim(), cfg.HeadDim
		case model.K, model.V, model.KBias, model.VBias:
			split, size, unit = Column, cfg.KVDim(), cfg.HeadDim
		case model.O:
			split, size, unit = Row, cfg.QDim(), cfg.HeadDim
		case model.Gate, model.Up:
			split, size, unit = Column, cfg.Intermediate, 1
		case model.Down:
			split, size, unit = Row, cfg.Intermediate, 1
		default:
			split = Replicated
		}
	}
	if split == Replicated {
		return split, nil, nil
	}
	d := split.Dim()
	if d >= len(shape) || shape[d] != size {
		return "", nil, fmt.Errorf("tensor %q has shape %v; a %s split needs dim %d = %d for this config", name, shape, split, d, size)
	}
	if split == Row && len(shape) != 2 {
		return "", nil, fmt.Errorf("tensor %q has shape %v; a row-parallel weight must be [out, in]", name, shape)
	}
	return split, balanced(size, unit, n), nil
}

// checkAlign checks that a quantized tensor (kind, bits, group size,
// shape) can be cut at the boundaries of ranges along split's dimension.
func checkAlign(kind string, bits, group int, shape []int, split Split, ranges [][2]int) error {
	if kind == KindDense || split == Replicated {
		return nil
	}
	for r, rg := range ranges {
		b := rg[0]
		if b == 0 {
			continue
		}
		if bits == 4 && b%PackAlign != 0 {
			return fmt.Errorf("4-bit %s split at %d (rank %d starts there) is not a multiple of %d, the int4 packing width; choose a tensor-parallel size that splits dim %d (%d) into multiples of %d",
				split, b, r, PackAlign, split.Dim(), shape[split.Dim()], PackAlign)
		}
		if split == Row && group > 0 && b%group != 0 {
			return fmt.Errorf("row-parallel split at input column %d (rank %d starts there) falls inside a quantization group of %d columns; choose a tensor-parallel size that splits %d into multiples of %d",
				b, r, group, shape[1], group)
		}
	}
	return nil
}
