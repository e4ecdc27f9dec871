package gptq

import (
	"fmt"

	"qtool/formats/model"
	"qtool/quantize/calib"
	"qtool/runtime"
)

// headErrRows bounds the calibration rows of the logits errors RefitHead
// reports (a row holds the whole vocabulary).
const headErrRows = 1024

// headMinTokens is the least number of calibration tokens per hidden
// dimension RefitHead fits the classifier on: the fit has hidden² free
// parameters, and with fewer tokens it learns the calibration text rather
// than the float model.
const headMinTokens = 8

// RefitHead replaces the classifier of the session's result by its
// asymmetric target (see Asym): with H̃ and H the final-norm outputs of the
// quantized and the float model (Residual and FloatStream after Run) and W
// the float classifier,
//
//	W̃ = W + W·(H − H̃)ᵀH̃·(H̃ᵀH̃ + λI)⁻¹
//
// is the least-squares map from the quantized model's final hidden states
// to the float model's logits over the calibration tokens (λ = damp ×
// mean(diag H̃ᵀH̃)). The classifier stays float; the embedding table is
// not changed, so a tied classifier becomes an untied lm_head (Out's
// Config.Tied false). The session must have tracked the float model
// (TrackFloat) through every layer. With fewer than headMinTokens
// calibration tokens per hidden dimension the classifier is kept. The
// statistics give the logits' error against the float model's after the
// refit (FloatErr, Loss) and before it (Note).
func RefitHead(s *calib.Session, damp float64) (calib.ModuleStat, error) {
	t := calib.StartTimer()
	defer s.Phase("head refit")()
	if s.FloatStream() == nil {
		return calib.ModuleStat{}, fmt.Errorf("gptq: refitting the classifier needs the float model's stream (Session.TrackFloat)")
	}
	be, c := s.Backend(), s.Cfg
	if s.Rows() < headMinTokens*c.Hidden {
		return calib.ModuleStat{Layer: -1, Role: model.LMHead, Seconds: t.Seconds(),
			Note: fmt.Sprintf("kept: %d calibration tokens, the refit needs %d (%d × hidden)", s.Rows(), headMinTokens*c.Hidden, headMinTokens)}, nil
	}
	hq := s.RT.FinalNorm(s.Residual())
	defer be.Free(hq)
	hf := s.RT.FinalNorm(s.FloatStream())
	defer be.Free(hf)
	g := be.Alloc(c.Hidden, c.Hidden)
	defer be.Free(g)
	be.AddGram(g, hq)
	terms := newTargetTerms(be, hq, hf, g, nil, nil, 0, targetDamp(damp, c.Hidden, hq.Rows()))
	defer terms.free()

	name, src := model.Name(-1, model.LMHead), model.Name(-1, model.LMHead)
	if _, ok := s.Out.Lookup(name); !ok {
		src = model.Name(-1, model.Embed) // tied
	}
	ht, err := s.Out.Get(src)
	if err != nil {
		return calib.ModuleStat{}, fmt.Errorf("gptq: classifier: %w", err)
	}
	w, err := ht.Float32()
	if err != nil {
		return calib.ModuleStat{}, fmt.Errorf("gptq: classifier %s: %w", src, err)
	}
	wb := s.Upload(w, c.Vocab, c.Hidden)
	defer be.Free(wb)
	wts, err := terms.weights([]runtime.Buf{wb})
	if err != nil {
		return calib.ModuleStat{}, fmt.Errorf("gptq: classifier: %w", err)
	}
	wt := wts[0]
	defer be.Free(wt)
	lin, linT := be.FloatLinear(wb), be.FloatLinear(wt)
	before := s.OutputErr(hq, lin, hf, wb, headErrRows)
	after := s.OutputErr(hq, linT, hf, wb, headErrRows)
	be.FreeLinear(lin)
	be.FreeLinear(linT)
	head := model.FromFloat32([]int{c.Vocab, c.Hidden}, s.Download(wt))
	if err := s.RT.SetLinear(-1, model.LMHead, head); err != nil {
		return calib.ModuleStat{}, err
	}
	s.Out.Set(name, head)
	s.Out.Config.Tied = false
	note := fmt.Sprintf("refit from the quantized hidden states: logits error %.3g before", before)
	if src != name {
		note += "; untied from the embedding"
	}
	return calib.ModuleStat{Layer: -1, Role: model.LMHead, Loss: after, FloatErr: after, Seconds: t.Seconds(), Note: note}, nil
}
