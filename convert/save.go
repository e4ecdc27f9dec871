package convert

import (
	"errors"
	"fmt"
	"math"
	"sort"
	"strings"

	"qtool/formats/autoawq"
	"qtool/formats/gptq"
	"qtool/formats/hf"
	"qtool/formats/kuiper"
	"qtool/formats/model"
	"qtool/formats/msmodelslim"
	"qtool/quantize"
)

// Canonical format names Save accepts (see Formats for the aliases).
const (
	FormatHF          = "hf"             // float safetensors; quantized weights dequantized (F32)
	FormatAutoAWQ     = "autoawq"        // AutoAWQ GEMM: 4-bit per-group linears
	FormatGPTQ        = "gptq"           // GPTQ v1: 2/3/4/8-bit linears, act-order g_idx allowed
	FormatMsModelSlim = "msmodelslim"    // W8A16 / W4A16 / W8A8
	FormatKuiperFP32  = "kuiper-fp32"    // Kuiper / llama2.c legacy fp32
	FormatKuiperInt8  = "kuiper-int8"    // Kuiper int8 (export.py v3)
	FormatAK42V1      = "kuiper-ak42-v1" // llama2.c ak42 version 1 (fp32)
	FormatAK42V2      = "kuiper-ak42-v2" // llama2.c ak42 version 2 (Q8_0)
	FormatAK47        = "kuiper-ak47"    // OrinMLLM ak47 (version 4): Qwen3 fp16
	FormatAK48        = "kuiper-v5"      // OrinMLLM ak48 (version 5): Qwen3 AWQ int4
)

// saveFormats lists the canonical names in the order refusals list them.
var saveFormats = []string{FormatHF, FormatAutoAWQ, FormatGPTQ, FormatMsModelSlim, FormatKuiperFP32,
	FormatKuiperInt8, FormatAK42V1, FormatAK42V2, FormatAK47, FormatAK48}

// formatAliases maps every accepted spelling (lower case) to its canonical name.
var formatAliases = map[string]string{
	"hf": FormatHF, "safetensors": FormatHF,
	"autoawq": FormatAutoAWQ, "awq": FormatAutoAWQ,
	"gptq":        FormatGPTQ,
	"msmodelslim": FormatMsModelSlim,
	"kuiper-fp32": FormatKuiperFP32, "fp32": FormatKuiperFP32,
	"kuiper-int8": FormatKuiperInt8, "q8": FormatKuiperInt8, "int8": FormatKuiperInt8,
	"kuiper-ak42-v1": FormatAK42V1, "ak42-v1": FormatAK42V1,
	"kuiper-ak42-v2": FormatAK42V2, "ak42-v2": FormatAK42V2,
	"kuiper-ak47": FormatAK47, "ak47": FormatAK47, "ak47-v4": FormatAK47, "kuiper-v4": FormatAK47,
	"kuiper-v5": FormatAK48, "ak48": FormatAK48, "ak48-v5": FormatAK48, "kuiper-ak48": FormatAK48, "v5": FormatAK48,
}

// Formats returns the canonical format names Save accepts.
func Formats() []string { return append([]string(nil), saveFormats...) }

// CanonicalFormat resolves a format name or alias ("ak48", "awq", "q8", ...)
// to its canonical name.
func CanonicalFormat(format string) (string, error) {
	f, ok := formatAliases[strings.ToLower(strings.TrimSpace(format))]
	if !ok {
		names := make([]string, 0, len(formatAliases))
		for a := range formatAliases {
			names = append(names, a)
		}
		sort.Strings(names)
		return "", fmt.Errorf("unknown format %q (known: %s; aliases: %s)", format, strings.Join(saveFormats, ", "), strings.Join(names, ", "))
	}
	return f, nil
}

// Save writes m to out in format (a canonical name or alias, see Formats).
// Quantized weights are never re-quantized to a different scheme: a format
// that would need that refuses, naming the formats that can hold m.
// Float formats (hf, kuiper-fp32, kuiper-ak42-v1, kuiper-ak47) dequantize.
// Writing float linears to a quantizing Kuiper format (kuiper-int8,
// kuiper-ak42-v2, kuiper-v5) RTN-quantizes them as Kuiper's export does;
// autoawq, gptq and msmodelslim need an already quantized model.
// Lazily quantized tensors (quantize.Lazy) count as quantized with their
// parameters. A kuiper-v5 or quantizing Kuiper file takes its group size
// from the model's quantized linears. Outputs appear complete or not at
// all; a directory output that is not empty is refused (see SaveWith).
func Save(m *model.Model, format string, out string) error {
	return SaveWith(m, format, out, SaveOptions{})
}

// SaveOptions controls SaveWith.
type SaveOptions struct {
	// Force replaces a directory output that already holds a model: the
	// old model is removed entirely once the new one is complete.
	Force bool
}

// SaveWith is Save with options.
func SaveWith(m *model.Model, format string, out string, so SaveOptions) error {
	if m == nil {
		return errors.New("convert: Save needs a model")
	}
	f, err := CanonicalFormat(format)
	if err != nil {
		return fmt.Errorf("convert %s: %w", out, err)
	}
	p, err := profileOf(m)
	if err != nil {
		return fmt.Errorf("convert %s: %w", out, err)
	}
	if err := p.canHold(f); err != nil {
		return refusal(out, f, p, err)
	}
	switch f {
	case FormatHF, FormatAutoAWQ, FormatGPTQ, FormatMsModelSlim:
		mm, err := materialize(m)
		if err != nil {
			return fmt.Errorf("convert %s: %w", out, err)
		}
		switch f {
		case FormatHF:
			return hf.Write(mm, out, hf.WriteOptions{Force: so.Force})
		case FormatAutoAWQ:
			return autoawq.Write(mm, out, autoawq.WriteOptions{Force: so.Force})
		case FormatGPTQ:
			return gptq.Write(mm, out, gptq.WriteOptions{Force: so.Force})
		default:
			return msmodelslim.Write(mm, out, msmodelslim.WriteOptions{Force: so.Force})
		}
	}
	opt := kuiper.WriteOptions{Rope: m.Config.Rope}
	switch f {
	case FormatKuiperFP32:
		opt.Format = kuiper.FP32
	case FormatKuiperInt8:
		opt.Format, opt.GroupSize = kuiper.Int8, p.group
	case FormatAK42V1:
		opt.Format = kuiper.AK42V1
	case FormatAK42V2:
		opt.Format, opt.GroupSize = kuiper.AK42V2, p.group
	case FormatAK47:
		opt.Format = kuiper.AK47
	case FormatAK48:
		opt.Format, opt.GroupSize = kuiper.AK48, p.group
	}
	return kuiper.Write(m, out, opt)
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

// CanHold reports why format cannot hold m (nil when Save would write it).
func CanHold(m *model.Model, format string) error {
	f, err := CanonicalFormat(format)
	if err != nil {
		return err
	}
	p, err := profileOf(m)
	if err != nil {
		return err
	}
	return p.canHold(f)
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
	group    int // common group size of the quantized linears (0: none or mixed)
}

// quantizer is implemented by lazily quantized tensors (quantize.Lazy).
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
		if layer < 0 || !model.IsLinear(role) {
			continue
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
				return nil, fmt.Errorf("tensor %q: %w", name, err)
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
	for _, f := range saveFormats {
		if p.canHold(f) == nil {
			can = append(can, f)
		}
	}
	return can
}

// canHold reports why format f (canonical) cannot hold the model.
func (p *profile) canHold(f string) error {
	noNormBias := func() error {
		if len(p.normBias) > 0 {
			return fmt.Errorf("it has no place for the SmoothQuant-folded norm biases (%s, ...)", p.normBias[0])
		}
		return nil
	}
	noW8A8 := func() error {
		if p.nW8A8 > 0 {
			return errors.New("W8A8 linears quantize their activations, which it cannot express")
		}
		return nil
	}
	needQuant := func() error {
		if p.nQuant == 0 && p.nW8A8 == 0 {
			return errors.New("the model has no quantized linear; quantize it first (qtool gptq / awq / smoothquant, or RTN)")
		}
		return nil
	}
	qwen3 := func() error {
		if p.cfg.Arch != model.Qwen3 || !p.cfg.QKNorm || p.cfg.AttnBias {
			return fmt.Errorf("it holds Qwen3 models only (q/k norms, no attention biases), this is %s", p.cfg.Arch)
		}
		return nil
	}
	switch f {
	case FormatHF, FormatKuiperFP32, FormatAK42V1:
		return noNormBias()
	case FormatAK47:
		return errors.Join(qwen3(), noNormBias())
	case FormatKuiperInt8, FormatAK42V2:
		if err := errors.Join(noNormBias(), noW8A8()); err != nil {
			return err
		}
		for _, l := range p.linears {
			if l.kind == linQuant && (l.bits != 8 || !l.sym || l.gidx || l.group <= 0 || l.group != p.group) {
				return fmt.Errorf("%s is %d-bit (symmetric %v, group %d, g_idx %v); the file holds 8-bit symmetric weights with one group size, so writing would re-quantize them", l.name, l.bits, l.sym, l.group, l.gidx)
			}
		}
	case FormatAK48:
		if err := errors.Join(qwen3(), noNormBias(), noW8A8()); err != nil {
			return err
		}
		for _, l := range p.linears {
			if l.kind == linQuant && (l.bits != 4 || l.gidx || l.group <= 0 || l.group != p.group) {
				return fmt.Errorf("%s is %d-bit (group %d, g_idx %v); ak48 holds 4-bit weights with one group size and no g_idx", l.name, l.bits, l.group, l.gidx)
			}
		}
	case FormatAutoAWQ:
		if err := errors.Join(noNormBias(), noW8A8(), needQuant()); err != nil {
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
	case FormatGPTQ:
		if err := errors.Join(noNormBias(), noW8A8(), needQuant()); err != nil {
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
	case FormatMsModelSlim:
		if err := needQuant(); err != nil {
			return err
		}
		g := 0
		for _, l := range p.linears {
			switch {
			case l.kind == linW8A8 && l.w8a8.Bias != nil:
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
	default:
		return fmt.Errorf("unknown format %q", f)
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

// materialize returns m with every lazily quantized tensor replaced by its
// *model.Quantized (other tensors shared).
func materialize(m *model.Model) (*model.Model, error) {
	lazy := false
	for _, n := range m.Names() {
		t, _ := m.Lookup(n)
		if _, ok := t.(quantizer); ok {
			lazy = true
			break
		}
	}
	if !lazy {
		return m, nil
	}
	out := model.New(m.Config)
	out.Source, out.Format, out.TokenizerDir = m.Source, m.Format, m.TokenizerDir
	for _, n := range m.Names() {
		t, _ := m.Lookup(n)
		if lz, ok := t.(quantizer); ok {
			q, err := lz.Quantize()
			if err != nil {
				return nil, fmt.Errorf("tensor %q: %w", n, err)
			}
			t = q
		}
		out.Set(n, t)
	}
	return out, nil
}
