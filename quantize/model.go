package quantize

import (
	"fmt"

	"qtool/formats/model"
)

// Options controls QuantizeModel.
type Options struct {
	Params
	// Classifier also quantizes the output projection: lm_head, or for a
	// tied model the embedding table, stored as a new (untied) lm_head.
	// The embedding itself always stays float.
	Classifier bool
	// Lazy defers the work: each quantized tensor is a *Lazy that quantizes
	// its source when asked (Float32 gives the dequantized weights, Quantize
	// the typed tensor), so nothing is held in memory beyond what a consumer
	// asks for. Otherwise every tensor is quantized now into a *model.Quantized.
	Lazy bool
}

// QuantizeModel returns a model whose seven decoder linears of every layer
// (and, with Classifier, the classifier) are RTN-quantized with opt.Params.
// Every other tensor is shared with m, so m must stay open while the result
// is used; the result has no closers of its own.
func QuantizeModel(m *model.Model, opt Options) (*model.Model, error) {
	if err := opt.Params.Validate(); err != nil {
		return nil, err
	}
	src := m.Source
	if src == "" {
		src = "model"
	}
	cfg := m.Config
	out := model.New(cfg)
	out.Source, out.Format, out.TokenizerDir = m.Source, m.Format, m.TokenizerDir
	conv := func(name string, t model.Tensor) (model.Tensor, error) {
		if opt.Lazy {
			if err := checkDivides(t, opt.Params); err != nil {
				return nil, fmt.Errorf("%s: tensor %q: %w", src, name, err)
			}
			return &Lazy{Name: name, Src: t, Params: opt.Params}, nil
		}
		q, err := Tensor(name, t, opt.Params)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", src, err)
		}
		return q, nil
	}
	for _, name := range m.Names() {
		t, _ := m.Lookup(name)
		layer, role, _ := model.ParseName(name)
		quant := (layer >= 0 && model.IsLinear(role)) || (opt.Classifier && layer < 0 && role == model.LMHead)
		if !quant {
			out.Set(name, t)
			continue
		}
		qt, err := conv(name, t)
		if err != nil {
			return nil, err
		}
		out.Set(name, qt)
	}
	if opt.Classifier && cfg.Tied {
		emb, err := m.Get(model.Name(-1, model.Embed))
		if err != nil {
			return nil, err
		}
		qt, err := conv(model.Name(-1, model.LMHead), emb)
		if err != nil {
			return nil, err
		}
		out.Set(model.Name(-1, model.LMHead), qt)
		out.Config.Tied = false
	}
	return out, nil
}

func checkDivides(t model.Tensor, p Params) error {
	sh := t.Shape()
	if len(sh) != 2 {
		return fmt.Errorf("shape %v is not a matrix", sh)
	}
	if p.Group > 0 && sh[1]%p.Group != 0 {
		return fmt.Errorf("group size %d does not divide %d input columns", p.Group, sh[1])
	}
	return nil
}

// Lazy is a linear weight quantized on demand.
type Lazy struct {
	Name   string
	Src    model.Tensor
	Params Params
}

// Shape implements model.Tensor.
func (l *Lazy) Shape() []int { return l.Src.Shape() }

// Quantize returns the quantized weight (computed anew on every call).
func (l *Lazy) Quantize() (*model.Quantized, error) { return Tensor(l.Name, l.Src, l.Params) }

// Float32 implements model.Tensor: the dequantized weights (fake quantization).
func (l *Lazy) Float32() ([]float32, error) {
	q, err := l.Quantize()
	if err != nil {
		return nil, err
	}
	return q.Float32()
}
