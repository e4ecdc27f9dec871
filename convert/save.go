package convert

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"

	"qtool/formats/autoawq"
	"qtool/formats/kuiper"
	"qtool/formats/model"
	"qtool/quantize"
)

// SaveOptions carries what SaveWith needs beyond the model and the format.
type SaveOptions struct {
	// Rope is the q/k row layout to write; nil takes the format's default
	// (Codec.DefaultRope; for a Kuiper file without sidecar the layout its
	// readers assume, kuiper.AssumedRope). The q/k weights (with their per-row quantization
	// parameters), biases and per-head norms are permuted whenever it
	// differs from the model's. HF-style formats hold the half layout only.
	Rope *model.RopeLayout
	// GroupSize of float linears RTN-quantized into kuiper-int8, ak42-v2 or
	// ak48 (0: the model's quantized linears' own, else the format's
	// default).
	GroupSize int
	// TP is the number of ranks of a shard directory.
	TP int
	// QtoolOnly allows ak47/ak48 files for Qwen3 shapes OrinMLLM cannot read
	// (heads × head_dim ≠ hidden): only qtool reads them back.
	QtoolOnly bool
	// Force replaces a directory output that already holds a model: the
	// old model is removed entirely once the new one is complete.
	Force bool
	// Kuiper carries the Kuiper writer's own settings (SeqLen, NoSidecar,
	// Progress); Format, Rope and GroupSize are set from the above.
	Kuiper kuiper.WriteOptions
}

// Save writes m to out in format (a canonical name or alias, see Codecs)
// with default options: SaveWith(m, format, out, SaveOptions{}).
func Save(m *model.Model, format string, out string) error {
	return SaveWith(m, format, out, SaveOptions{})
}

// SaveWith writes m to out in format (a canonical name or alias).
// Quantized weights are never re-quantized to a different scheme: a format
// that would need that refuses, naming the formats that can hold m.
// Float formats (hf, kuiper-fp32, ak42-v1, ak47) dequantize. Writing float
// linears to a quantizing Kuiper format (kuiper-int8, ak42-v2, ak48)
// RTN-quantizes them as Kuiper's export does; autoawq, gptq and msmodelslim
// need an already quantized model. Lazily quantized tensors
// (quantize.Lazy) count as quantized with their parameters; tensors of a
// shard directory are joined. A quantizing Kuiper file takes its group size
// from opt.GroupSize, else from the model's quantized linears.
func SaveWith(m *model.Model, format string, out string, opt SaveOptions) error {
	if m == nil {
		return errors.New("convert: Save needs a model")
	}
	c, err := Lookup(format)
	if err != nil {
		return fmt.Errorf("convert %s: %w", out, err)
	}
	if c.write == nil {
		return fmt.Errorf("convert %s: qtool reads %s but does not write it", out, c.Name)
	}
	// Join the pieces of a shard directory once, for the checks and the
	// writer alike.
	if m, err = materialize(m, false); err != nil {
		return fmt.Errorf("convert %s: %w", out, err)
	}
	p, err := profileOf(m)
	if err != nil {
		return fmt.Errorf("convert %s: %w", out, err)
	}
	if err := c.canHold(p); err != nil {
		return refusal(out, c.Name, p, err)
	}
	noRecord := c.Kind == KindKuiper && opt.Kuiper.NoSidecar
	if opt.Rope == nil {
		r := c.DefaultRope(m.Config)
		if noRecord {
			r = kuiper.AssumedRope(m.Config.Arch) // nothing records another layout
		}
		opt.Rope = &r
	}
	if a := kuiper.AssumedRope(m.Config.Arch); noRecord && *opt.Rope != a {
		return fmt.Errorf("convert %s: without a sidecar the file is read with the %s rope layout (%s), not %s: keep the sidecar or write that layout", out, a, m.Config.Arch, *opt.Rope)
	} else if *opt.Rope != model.RopeHalf && c.rope == ropeHalfOnly {
		return fmt.Errorf("convert %s: %s holds the half (Hugging Face) rope layout only, not %s", out, c.Name, *opt.Rope)
	}
	// HF-style writers take every tensor as it is; the Kuiper writer (and
	// shard's) quantizes lazy tensors one at a time as it streams.
	if c.Kind != KindKuiper && c.Kind != KindShard {
		if m, err = materialize(m, true); err != nil {
			return fmt.Errorf("convert %s: %w", out, err)
		}
	}
	return c.write(m, out, opt, p)
}

// GroupSize is the group size shared by all quantized decoder linears of m
// (0 when there are none, they are per-channel, or their sizes differ).
func GroupSize(m *model.Model) int {
	p, err := profileOf(m)
	if err != nil {
		return 0
	}
	return p.group
}

// canHold is holds plus the int8 KV cache, which only the formats with
// kvCache set hold.
func (c *Codec) canHold(p *profile) error {
	if p.kvInt8 && !c.kvCache {
		return errors.New("it cannot hold an int8 KV cache's scales and offsets (C8); msmodelslim can")
	}
	return c.holds(p)
}

// CanHold reports why format cannot hold m (nil when Save would write it).
func CanHold(m *model.Model, format string) error {
	c, err := Lookup(format)
	if err != nil {
		return err
	}
	p, err := profileOf(m)
	if err != nil {
		return err
	}
	return c.canHold(p)
}

// Holders lists the canonical formats that can hold m.
func Holders(m *model.Model) []string {
	p, err := profileOf(m)
	if err != nil {
		return nil
	}
	return p.holders()
}

func refusal(out, f string, p *profile, why error) error {
	alt := "none"
	if h := p.holders(); len(h) > 0 {
		alt = strings.Join(h, ", ")
	}
	return fmt.Errorf("convert %s: format %s cannot hold this model (%s): %w; formats that can: %s", out, f, p, why, alt)
}

// linearInfo describes one decoder linear.
type linearInfo struct {
	name  string
	kind  int // linFloat, linQuant, linW8A8
	bits  int
	group int // 0: per row
	sym   bool
	gidx  bool
	rows  int
	cols  int
	q     *model.Quantized // nil for lazy tensors (not quantized yet)
	w8a8  *model.W8A8
}

const (
	linFloat = iota
	linQuant
	linW8A8
)

// profile is what the format checks need to know about a model.
type profile struct {
	cfg      model.Config
	linears  []linearInfo
	nFloat   int
	nQuant   int
	nW8A8    int
	normBias []string
	group    int  // common group size of the quantized linears (0: none or mixed)
	kvInt8   bool // the model carries an int8 KV cache's quantizers (C8)
}

// quantizer is implemented by lazily quantized tensors (quantize.Lazy);
// its errors name the tensor.
type quantizer interface {
	Quantize() (*model.Quantized, error)
}

func profileOf(m *model.Model) (*profile, error) {
	p := &profile{cfg: m.Config}
	groups := map[int]bool{}
	for _, name := range m.SortedNames() {
		t, _ := m.Lookup(name)
		layer, role, _ := model.ParseName(name)
		if role == model.AttnNormBias || role == model.MLPNormBias {
			p.normBias = append(p.normBias, name)
			continue
		}
		if slices.Contains(model.KVCacheRoles[:], role) {
			p.kvInt8 = true
			continue
		}
		if layer < 0 || !model.IsLinear(role) {
			continue
		}
		if j, ok := t.(joiner); ok {
			jt, err := j.Join()
			if err != nil {
				return nil, fmt.Errorf("tensor %q: %w", name, err)
			}
			t = jt
		}
		sh := t.Shape()
		if len(sh) != 2 {
			return nil, fmt.Errorf("tensor %q has shape %v, want a matrix", name, sh)
		}
		li := linearInfo{name: name, rows: sh[0], cols: sh[1]}
		switch v := t.(type) {
		case *model.Quantized:
			li.kind, li.q = linQuant, v
			li.bits, li.group, li.sym, li.gidx = v.Bits, v.GroupSize, v.Zero == nil, v.GIdx != nil
		case *quantize.Lazy:
			li.kind = linQuant
			li.bits, li.group, li.sym = v.Params.Bits, v.Params.Group, !v.Params.Asymmetric()
		case *model.W8A8:
			li.kind, li.w8a8 = linW8A8, v
			li.bits, li.sym = 8, true
		case quantizer:
			q, err := v.Quantize()
			if err != nil {
				return nil, err
			}
			li.kind, li.q = linQuant, q
			li.bits, li.group, li.sym, li.gidx = q.Bits, q.GroupSize, q.Zero == nil, q.GIdx != nil
		default:
			li.kind = linFloat
		}
		switch li.kind {
		case linFloat:
			p.nFloat++
		case linQuant:
			p.nQuant++
			groups[li.group] = true
		case linW8A8:
			p.nW8A8++
		}
		p.linears = append(p.linears, li)
	}
	if len(groups) == 1 {
		for g := range groups {
			p.group = g
		}
	}
	return p, nil
}

// String summarises the linears: "28 linears 4-bit asymmetric group 128".
func (p *profile) String() string {
	var parts []string
	if p.nFloat > 0 {
		parts = append(parts, fmt.Sprintf("%d float linears", p.nFloat))
	}
	if p.nW8A8 > 0 {
		parts = append(parts, fmt.Sprintf("%d W8A8 linears", p.nW8A8))
	}
	if p.nQuant > 0 {
		kinds := map[string]int{}
		var order []string
		for _, l := range p.linears {
			if l.kind != linQuant {
				continue
			}
			g := "per-channel"
			if l.group > 0 {
				g = fmt.Sprintf("group %d", l.group)
			}
			s := "asymmetric"
			if l.sym {
				s = "symmetric"
			}
			k := fmt.Sprintf("%d-bit %s %s", l.bits, s, g)
			if l.gidx {
				k += " act-order g_idx"
			}
			if kinds[k] == 0 {
				order = append(order, k)
			}
			kinds[k]++
		}
		for _, k := range order {
			parts = append(parts, fmt.Sprintf("%d linears %s", kinds[k], k))
		}
	}
	if len(p.normBias) > 0 {
		parts = append(parts, "SmoothQuant-folded norm biases")
	}
	return fmt.Sprintf("%s, %s", p.cfg.Arch, strings.Join(parts, ", "))
}

func (p *profile) holders() []string {
	var can []string
	for _, c := range codecs {
		if c.write != nil && c.Kind != KindShard && c.canHold(p) == nil {
			can = append(can, c.Name)
		}
	}
	return can
}

func (p *profile) noNormBias() error {
	if len(p.normBias) > 0 {
		return fmt.Errorf("it has no place for the SmoothQuant-folded norm biases (%s, ...)", p.normBias[0])
	}
	return nil
}

func (p *profile) noW8A8() error {
	if p.nW8A8 > 0 {
		return errors.New("W8A8 linears quantize their activations, which it cannot express")
	}
	return nil
}

func (p *profile) needQuant() error {
	if p.nQuant == 0 && p.nW8A8 == 0 {
		return errors.New("the model has no quantized linear; quantize it first (qtool quantize for RTN, or qtool gptq / awq / smoothquant)")
	}
	return nil
}

func (p *profile) qwen3() error {
	if p.cfg.Arch != model.Qwen3 || !p.cfg.QKNorm || p.cfg.AttnBias {
		return fmt.Errorf("it holds Qwen3 models only (q/k norms, no attention biases), this is %s", p.cfg.Arch)
	}
	return nil
}

func holdsAK47(p *profile) error { return errors.Join(p.qwen3(), p.noNormBias()) }

// holdsInt8 is what kuiper-int8 and ak42-v2 hold: float or 8-bit symmetric
// per-group linears with one group size.
func holdsInt8(p *profile) error {
	if err := errors.Join(p.noNormBias(), p.noW8A8()); err != nil {
		return err
	}
	for _, l := range p.linears {
		if l.kind == linQuant && (l.bits != 8 || !l.sym || l.gidx || l.group <= 0 || l.group != p.group) {
			return fmt.Errorf("%s is %d-bit (symmetric %v, group %d, g_idx %v); the file holds 8-bit symmetric weights with one group size, so writing would re-quantize them", l.name, l.bits, l.sym, l.group, l.gidx)
		}
	}
	return nil
}

func holdsAK48(p *profile) error {
	if err := errors.Join(p.qwen3(), p.noNormBias(), p.noW8A8()); err != nil {
		return err
	}
	for _, l := range p.linears {
		if l.kind == linQuant && (l.bits != 4 || l.gidx || l.group <= 0 || l.group != p.group) {
			return fmt.Errorf("%s is %d-bit (group %d, g_idx %v); ak48 holds 4-bit weights with one group size and no g_idx", l.name, l.bits, l.group, l.gidx)
		}
	}
	return nil
}

func holdsAutoAWQ(p *profile) error {
	if err := errors.Join(p.noNormBias(), p.noW8A8(), p.needQuant()); err != nil {
		return err
	}
	for _, l := range p.linears {
		if l.kind != linQuant {
			continue
		}
		switch {
		case l.bits != 4:
			return fmt.Errorf("%s is %d-bit; AutoAWQ GEMM is 4-bit only", l.name, l.bits)
		case l.gidx:
			return fmt.Errorf("%s has an act-order g_idx; AutoAWQ has no input permutation", l.name)
		case l.group <= 0 || l.group != p.group:
			return fmt.Errorf("%s has group size %d; AutoAWQ needs one positive group size for all linears", l.name, l.group)
		case l.rows%autoawq.PackFactor != 0:
			return fmt.Errorf("%s has %d outputs, not a multiple of %d", l.name, l.rows, autoawq.PackFactor)
		}
		if err := integerZeros(l, 0, 15); err != nil {
			return err
		}
	}
	return nil
}

func holdsGPTQ(p *profile) error {
	if err := errors.Join(p.noNormBias(), p.noW8A8(), p.needQuant()); err != nil {
		return err
	}
	bits := 0
	for _, l := range p.linears {
		if l.kind != linQuant {
			continue
		}
		if bits == 0 {
			bits = l.bits
		}
		switch {
		case l.bits != 2 && l.bits != 3 && l.bits != 4 && l.bits != 8:
			return fmt.Errorf("%s is %d-bit; GPTQ holds 2, 3, 4 or 8 bits", l.name, l.bits)
		case l.bits != bits || l.group != p.group:
			return fmt.Errorf("%s is %d-bit with group %d, others differ; a GPTQ checkpoint has one bit width and group size", l.name, l.bits, l.group)
		case l.rows*l.bits%32 != 0 || l.cols*l.bits%32 != 0:
			return fmt.Errorf("%s [%d %d] × %d bits does not pack into int32 words", l.name, l.rows, l.cols, l.bits)
		}
		if err := integerZeros(l, 1, 1<<l.bits-1); err != nil {
			return fmt.Errorf("%w (GPTQ v1 stores zero−1, so a zero point of 0 cannot be stored)", err)
		}
	}
	return nil
}

func holdsMsModelSlim(p *profile) error {
	if err := p.needQuant(); err != nil {
		return err
	}
	g := 0
	for _, l := range p.linears {
		switch {
		case l.kind == linW8A8 && l.w8a8.Bias != nil && !l.w8a8.Dynamic:
			return fmt.Errorf("%s is W8A8 with a separate bias; msmodelslim folds biases into quant_bias", l.name)
		case l.kind != linQuant:
			continue
		case l.bits != 8 && l.bits != 4:
			return fmt.Errorf("%s is %d-bit; msmodelslim weight-only linears are W8A16 or W4A16", l.name, l.bits)
		case l.gidx:
			return fmt.Errorf("%s has an act-order g_idx; msmodelslim has no input permutation", l.name)
		case l.group > 0 && g > 0 && l.group != g:
			return fmt.Errorf("%s has group size %d, others %d; msmodelslim records one group_size", l.name, l.group, g)
		}
		if l.group > 0 {
			g = l.group
		}
	}
	return nil
}

// integerZeros checks that the unsigned zero points of l are integers in
// lo..hi (symmetric weights use the midpoint 2^(bits−1)). Lazy tensors are
// quantized by the AWQ rule, whose zero points are integers in 0..2^bits−1;
// only lo > 0 can fail for them, which their writer reports.
func integerZeros(l linearInfo, lo, hi int) error {
	if l.q == nil || l.q.Zero == nil {
		return nil
	}
	off := float64(l.q.Offset())
	G := l.q.Groups()
	for i, z := range l.q.Zero {
		u := float64(z) + off
		if u != math.Round(u) || u < float64(lo) || u > float64(hi) {
			return fmt.Errorf("%s: zero point %g of output %d, group %d is not an integer in %d..%d", l.name, u, i/G, i%G, lo, hi)
		}
	}
	return nil
}

// joiner is implemented by tensors held in pieces (shard.Tensor).
type joiner interface {
	Join() (model.Tensor, error)
}

// materialize returns m with every tensor held in pieces joined and, with
// lazy, every lazily quantized tensor replaced by its *model.Quantized
// (other tensors shared).
func materialize(m *model.Model, lazy bool) (*model.Model, error) {
	resolve := func(n string, t model.Tensor) (model.Tensor, bool, error) {
		if j, ok := t.(joiner); ok {
			jt, err := j.Join()
			if err != nil {
				return nil, false, fmt.Errorf("tensor %q: %w", n, err)
			}
			return jt, true, nil
		}
		if lz, ok := t.(quantizer); ok && lazy {
			q, err := lz.Quantize() // (its errors name the tensor)
			return q, true, err
		}
		return t, false, nil
	}
	var out *model.Model
	for i, n := range m.Names() {
		t, _ := m.Lookup(n)
		r, changed, err := resolve(n, t)
		if err != nil {
			return nil, err
		}
		if changed && out == nil {
			out = model.New(m.Config)
			out.Source, out.Format, out.TokenizerDir = m.Source, m.Format, m.TokenizerDir
			for _, prev := range m.Names()[:i] {
				pt, _ := m.Lookup(prev)
				out.Set(prev, pt)
			}
		}
		if out != nil {
			out.Set(n, r)
		}
	}
	if out == nil {
		return m, nil
	}
	return out, nil
}

// RTNQuantized lists the float decoder linears of a partly quantized m (an
// AutoAWQ checkpoint's modules_to_not_convert, say) that Save in format
// RTN-quantizes, because the format has no place for a float linear
// (kuiper-int8, ak42-v2, ak48). It is empty when m has no quantized linear
// (quantizing a float model is what those formats are for) or the format
// keeps float linears.
func RTNQuantized(m *model.Model, format string) []string {
	c, err := Lookup(format)
	if err != nil || c.Float != "" || c.Kind != KindKuiper {
		return nil
	}
	p, err := profileOf(m)
	if err != nil || p.nQuant+p.nW8A8 == 0 {
		return nil
	}
	var names []string
	for _, l := range p.linears {
		if l.kind == linFloat {
			names = append(names, l.name)
		}
	}
	return names
}

// IsFloat reports whether no decoder linear of m is quantized (lazily
// quantized ones count as quantized).
func IsFloat(m *model.Model) bool {
	p, err := profileOf(m)
	return err == nil && p.nQuant == 0 && p.nW8A8 == 0
}
