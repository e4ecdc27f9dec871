// Package quantize holds the round-to-nearest (RTN) weight quantizers every
// codec and method in qtool shares. All arithmetic is float32, like the
// PyTorch reference code, and rounding is half to even (torch.round).
//
// Three rules are implemented, each exactly as its reference does it:
//
//   - SymZero (Kuiper / llama2.c quantize_q80): s = max|w|/(2^(b−1)−1),
//     q = round(w/s); an all-zero group gets s = 0, q = 0.
//   - SymAWQ (AutoAWQ pseudo_quantize_tensor, zero_point=False):
//     s = max(max|w|, 1e−5)/(2^(b−1)−1), q = clamp(round(w/s), −2^(b−1), 2^(b−1)−1).
//   - AsymAWQ (AutoAWQ pseudo_quantize_tensor, zero_point=True):
//     s = max(max−min, 1e−5)/(2^b−1), z = clamp(−round(min/s), 0, 2^b−1),
//     u = clamp(round(w/s)+z, 0, 2^b−1).
//
// Results are *model.Quantized values in their storage convention: unsigned
// codes u and zero points z are stored minus 2^(b−1).
package quantize

import (
	"fmt"
	"math"
	"sync/atomic"

	"qtool/formats/model"
)

// Rule selects how scales (and zero points) are derived.
type Rule int

const (
	// SymZero is the Kuiper/llama2.c int8 rule (an all-zero group gets scale 0).
	SymZero Rule = iota
	// SymAWQ is AutoAWQ's zero_point=False rule (max|w| clamped to >= 1e-5).
	SymAWQ
	// AsymAWQ is AutoAWQ's zero_point=True rule (range clamped to >= 1e-5).
	AsymAWQ
)

// String names the rule.
func (r Rule) String() string {
	switch r {
	case SymZero:
		return "sym"
	case SymAWQ:
		return "sym-awq"
	case AsymAWQ:
		return "asym"
	}
	return fmt.Sprintf("Rule(%d)", int(r))
}

// Params describes one RTN scheme.
type Params struct {
	Bits int // 2..8
	// Group is the number of consecutive weights sharing a scale along the
	// input dimension; 0 means one group per row.
	Group int
	Rule  Rule
}

// Int8Sym is the Kuiper/llama2.c int8 scheme with the given group size.
func Int8Sym(group int) Params { return Params{Bits: 8, Group: group, Rule: SymZero} }

// Int4Asym is AutoAWQ's default 4-bit scheme with the given group size.
func Int4Asym(group int) Params { return Params{Bits: 4, Group: group, Rule: AsymAWQ} }

// Validate checks the bit width, group size and rule.
func (p Params) Validate() error {
	if p.Bits < 2 || p.Bits > 8 {
		return fmt.Errorf("quantize: %d bits, want 2..8", p.Bits)
	}
	if p.Group < 0 {
		return fmt.Errorf("quantize: group size %d, want >= 0", p.Group)
	}
	if p.Rule < SymZero || p.Rule > AsymAWQ {
		return fmt.Errorf("quantize: unknown rule %d", int(p.Rule))
	}
	return nil
}

// Asymmetric reports whether the scheme has zero points.
func (p Params) Asymmetric() bool { return p.Rule == AsymAWQ }

// String is a short description such as "int8 sym g64".
func (p Params) String() string {
	g := "per-row"
	if p.Group > 0 {
		g = fmt.Sprintf("g%d", p.Group)
	}
	return fmt.Sprintf("int%d %s %s", p.Bits, p.Rule, g)
}

// Groups quantizes w in consecutive runs of group values (a flat grouping:
// a group may cross a row boundary, as in Kuiper's int8 files). q receives
// len(w) codes, scale len(w)/group scales and, for AsymAWQ, zero the zero
// points (zero may be nil for symmetric rules). Codes and zero points follow
// model.Quantized's storage convention. It allocates nothing.
func Groups(w []float32, group int, p Params, q []int8, scale, zero []float32) error {
	if err := p.Validate(); err != nil {
		return err
	}
	if group <= 0 {
		return fmt.Errorf("quantize: group size %d, want > 0", group)
	}
	if len(w)%group != 0 {
		return fmt.Errorf("quantize: group size %d does not divide %d values", group, len(w))
	}
	ng := len(w) / group
	if len(q) != len(w) || len(scale) != ng {
		return fmt.Errorf("quantize: buffers hold %d codes and %d scales, want %d and %d", len(q), len(scale), len(w), ng)
	}
	if p.Asymmetric() && len(zero) != ng {
		return fmt.Errorf("quantize: %d zero points, want %d", len(zero), ng)
	}
	for g := 0; g < ng; g++ {
		ws := w[g*group : (g+1)*group]
		for i, v := range ws {
			if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
				return fmt.Errorf("quantize: value %v at index %d is not finite", v, g*group+i)
			}
		}
		qs := q[g*group : (g+1)*group]
		switch p.Rule {
		case SymZero, SymAWQ:
			scale[g] = symGroup(ws, qs, p.Bits, p.Rule == SymAWQ)
		case AsymAWQ:
			scale[g], zero[g] = asymGroup(ws, qs, p.Bits)
		}
	}
	return nil
}

// roundEven is torch.round on a float32 (half to even).
func roundEven(x float32) float32 { return float32(math.RoundToEven(float64(x))) }

func clamp(x, lo, hi float32) float32 {
	if x < lo {
		return lo
	}
	if x > hi {
		return hi
	}
	return x
}

func symGroup(w []float32, q []int8, bits int, awqClamp bool) float32 {
	var amax float32
	for _, v := range w {
		if a := float32(math.Abs(float64(v))); a > amax {
			amax = a
		}
	}
	qmax := float32(int(1)<<(bits-1) - 1)
	qmin := -qmax - 1
	if awqClamp {
		amax = max(amax, 1e-5)
	} else if amax == 0 {
		for i := range q {
			q[i] = 0
		}
		return 0
	}
	s := amax / qmax
	for i, v := range w {
		q[i] = int8(clamp(roundEven(v/s), qmin, qmax))
	}
	return s
}

func asymGroup(w []float32, q []int8, bits int) (scale, zero float32) {
	lo, hi := w[0], w[0]
	for _, v := range w[1:] {
		lo, hi = min(lo, v), max(hi, v)
	}
	umax := float32(int(1)<<bits - 1)
	off := float32(int(1) << (bits - 1))
	s := max(hi-lo, 1e-5) / umax
	z := clamp(-roundEven(lo/s), 0, umax)
	for i, v := range w {
		q[i] = int8(clamp(roundEven(v/s)+z, 0, umax) - off)
	}
	return s, z - off
}

// RTN quantizes the row-major [rows, cols] matrix w. p.Group must divide
// cols (groups never cross rows here; see Groups for flat groups).
func RTN(w []float32, rows, cols int, p Params) (*model.Quantized, error) {
	if err := p.Validate(); err != nil {
		return nil, err
	}
	if rows <= 0 || cols <= 0 || len(w) != rows*cols {
		return nil, fmt.Errorf("quantize: %d values for shape [%d %d]", len(w), rows, cols)
	}
	g := p.Group
	if g == 0 {
		g = cols
	}
	if cols%g != 0 {
		return nil, fmt.Errorf("quantize: group size %d does not divide %d input columns", g, cols)
	}
	ng := len(w) / g
	out := &model.Quantized{Bits: p.Bits, GroupSize: p.Group, Rows: rows, Cols: cols,
		Q: make([]int8, len(w)), Scale: make([]float32, ng)}
	if p.Asymmetric() {
		out.Zero = make([]float32, ng)
	}
	// Groups are independent: large matrices are split on group boundaries
	// over the cores (on an error the whole matrix is redone sequentially,
	// so the message names the global index).
	var failed atomic.Bool
	model.Parallel(ng, max(1, (1<<16)/g), func(lo, hi int) {
		var zero []float32
		if out.Zero != nil {
			zero = out.Zero[lo:hi]
		}
		if Groups(w[lo*g:hi*g], g, p, out.Q[lo*g:hi*g], out.Scale[lo:hi], zero) != nil {
			failed.Store(true)
		}
	})
	if failed.Load() {
		if err := Groups(w, g, p, out.Q, out.Scale, out.Zero); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// Tensor quantizes a 2-D tensor (a linear weight [out, in]). name is used in
// errors.
func Tensor(name string, t model.Tensor, p Params) (*model.Quantized, error) {
	sh := t.Shape()
	if len(sh) != 2 {
		return nil, fmt.Errorf("tensor %q: shape %v is not a matrix", name, sh)
	}
	w, err := t.Float32()
	if err != nil {
		return nil, fmt.Errorf("tensor %q: %w", name, err)
	}
	q, err := RTN(w, sh[0], sh[1], p)
	if err != nil {
		return nil, fmt.Errorf("tensor %q: %w", name, err)
	}
	return q, nil
}
