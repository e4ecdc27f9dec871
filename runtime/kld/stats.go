// Package kld compares a model's next-token distributions with a base
// model's (normally the float model it was quantized from) over the same
// text, as llama.cpp's `perplexity --kl-divergence` does:
//
//	KLD_t  = Σ_i p_i (log p_i − log q_i)   p: base, q: model, at token t
//	Δp_t   = q(x_t) − p(x_t)               probability of the correct token
//	same_t = argmax q == argmax p          top-1 agreement
//
// plus both perplexities and their ratio. Logits are computed on any
// runtime backend (runtime.Model.Forward), downloaded, and all of the math
// here is float64 on the host, so CPU and CUDA share it.
//
// The base's log-probabilities are stored in a logits file (see File) so a
// sweep of quantized models pays for the float model once.
package kld

import (
	"math"
	"slices"
)

// Token is what one scored position contributes.
type Token struct {
	KLD     float64 // Σ p log(p/q)
	NLL     float64 // −log q(target), the model's
	NLLBase float64 // −log p(target), the base's
	DeltaP  float64 // q(target) − p(target)
	SameTop bool    // the two argmaxes agree
}

// CompareRow computes the Token of one position: base is the base's
// log-probabilities (normalized: logsumexp = 0; −Inf entries are tokens of
// zero base probability), baseTop its argmax and baseNLL its −log p(target)
// (given apart so a stored exact value can be used), logits the model's raw
// logits, target the correct next token.
func CompareRow(base []float64, baseTop int, baseNLL float64, logits []float32, target int) Token {
	lse, top := logSumExp(logits)
	var kld float64
	for i, lp := range base {
		if math.IsInf(lp, -1) {
			continue
		}
		kld += math.Exp(lp) * (lp - (float64(logits[i]) - lse))
	}
	nll := lse - float64(logits[target])
	nllBase := baseNLL
	return Token{
		KLD:     kld,
		NLL:     nll,
		NLLBase: nllBase,
		DeltaP:  math.Exp(-nll) - math.Exp(-nllBase),
		SameTop: top == baseTop,
	}
}

// logSumExp returns log Σ exp(x_i) in float64 and the index of the largest
// x_i (the first one on ties).
func logSumExp(x []float32) (float64, int) {
	top := 0
	for i, v := range x {
		if v > x[top] {
			top = i
		}
	}
	m := float64(x[top])
	s := 0.0
	for _, v := range x {
		s += math.Exp(float64(v) - m)
	}
	return m + math.Log(s), top
}

// LogSoftmax writes log softmax(x) into dst (float64) and returns the argmax.
func LogSoftmax(dst []float64, x []float32) int {
	lse, top := logSumExp(x)
	for i, v := range x {
		dst[i] = float64(v) - lse
	}
	return top
}

// Value is a mean with its uncertainty (the standard error of the mean).
type Value struct {
	Value float64 `json:"value"`
	Unc   float64 `json:"unc"`
}

// Quantiles are order statistics of per-token values, named as llama.cpp
// prints them (P99_9 is the 99.9th percentile; linear interpolation between
// neighbouring sorted values, as llama.cpp).
type Quantiles struct {
	Max    float64 `json:"max"`
	P99_9  float64 `json:"p99_9"`
	P99    float64 `json:"p99"`
	P95    float64 `json:"p95"`
	P90    float64 `json:"p90"`
	P75    float64 `json:"p75"`
	Median float64 `json:"median"`
	P25    float64 `json:"p25"`
	P10    float64 `json:"p10"`
	P5     float64 `json:"p5"`
	P1     float64 `json:"p1"`
	P0_1   float64 `json:"p0_1"`
	Min    float64 `json:"min"`
}

// Histogram counts values in bins; Edges has len(Counts)+1 entries. Values
// below Edges[0] are counted in Under, at or above the last edge in Over.
type Histogram struct {
	Edges  []float64 `json:"edges"`
	Counts []int     `json:"counts"`
	Under  int       `json:"under"`
	Over   int       `json:"over"`
}

// Stats is llama.cpp's summary of a KL-divergence run, every figure it
// prints. Probabilities (DeltaP, SameTop) are fractions, not percent.
type Stats struct {
	Count int `json:"count"` // scored positions

	PPL      Value   `json:"ppl"`          // exp(mean NLL) of the model
	PPLBase  Value   `json:"ppl_base"`     // of the base
	LnRatio  Value   `json:"ln_ppl_ratio"` // mean of NLL − NLL_base = ln(PPL/PPL_base)
	Ratio    Value   `json:"ppl_ratio"`    // PPL/PPL_base
	Diff     Value   `json:"ppl_diff"`     // PPL − PPL_base
	LnPPLCor float64 `json:"ln_ppl_cor"`   // correlation of ln PPL and ln PPL_base

	KLD     Value     `json:"kld"`
	KLDQ    Quantiles `json:"kld_quantiles"`
	DeltaP  Value     `json:"delta_p"`
	DeltaPQ Quantiles `json:"delta_p_quantiles"`
	RMSDP   Value     `json:"delta_p_rms"`
	SameTop Value     `json:"same_top"`

	KLDHistogram Histogram `json:"kld_histogram"` // per-token KLD on log10-spaced bins
}

// Accumulator collects Tokens; Stats summarizes them.
type Accumulator struct {
	kld, dp            []float64
	sNLL, sNLL2, sBase float64
	sBase2, sNLLBase   float64
	sKLD, sKLD2        float64
	sDP, sDP2, sDP4    float64
	same               int
}

// Add records one position.
func (a *Accumulator) Add(t Token) {
	a.kld = append(a.kld, t.KLD)
	a.dp = append(a.dp, t.DeltaP)
	a.sNLL += t.NLL
	a.sNLL2 += t.NLL * t.NLL
	a.sBase += t.NLLBase
	a.sBase2 += t.NLLBase * t.NLLBase
	a.sNLLBase += t.NLL * t.NLLBase
	a.sKLD += t.KLD
	a.sKLD2 += t.KLD * t.KLD
	a.sDP += t.DeltaP
	d2 := t.DeltaP * t.DeltaP
	a.sDP2 += d2
	a.sDP4 += d2 * d2
	if t.SameTop {
		a.same++
	}
}

// Count is the number of positions added.
func (a *Accumulator) Count() int { return len(a.kld) }

// MeanKLD is the running mean KLD (0 before any Add).
func (a *Accumulator) MeanKLD() float64 {
	if len(a.kld) == 0 {
		return 0
	}
	return a.sKLD / float64(len(a.kld))
}

// meanUnc is the mean of n values with sum s and sum of squares s2, and the
// standard error sqrt(var/(n−1)) (llama.cpp's formula; llama.cpp reports
// 0 below 11 values, this for any n ≥ 2).
func meanUnc(s, s2 float64, n int) Value {
	if n == 0 {
		return Value{}
	}
	m := s / float64(n)
	v := s2/float64(n) - m*m
	if v <= 0 || n < 2 {
		return Value{Value: m}
	}
	return Value{Value: m, Unc: math.Sqrt(v / float64(n-1))}
}

// covariance of the two means, as llama.cpp: (E[ab] − E[a]E[b]) / (n−1).
func covariance(sa, sb, sab float64, n int) float64 {
	if n < 2 {
		return 0
	}
	c := float64(n)
	return (sab/c - (sa/c)*(sb/c)) / (c - 1)
}

// percentile of sorted v at fraction f, interpolating linearly.
func percentile(v []float64, f float64) float64 {
	if f <= 0 {
		return v[0]
	}
	if f >= 1 {
		return v[len(v)-1]
	}
	p := f * float64(len(v)-1)
	i := int(p)
	p -= float64(i)
	return (1-p)*v[i] + p*v[min(i+1, len(v)-1)]
}

func quantiles(v []float64) Quantiles {
	s := slices.Clone(v)
	slices.Sort(s)
	return Quantiles{
		Max: s[len(s)-1], P99_9: percentile(s, 0.999), P99: percentile(s, 0.99), P95: percentile(s, 0.95),
		P90: percentile(s, 0.90), P75: percentile(s, 0.75), Median: percentile(s, 0.5), P25: percentile(s, 0.25),
		P10: percentile(s, 0.10), P5: percentile(s, 0.05), P1: percentile(s, 0.01), P0_1: percentile(s, 0.001),
		Min: s[0],
	}
}

// KLD histogram bins: 4 per decade from 1e-6 to 10.
const (
	histLo     = -6
	histHi     = 1
	histPerDec = 4
)

// KLDHistogram bins v on log10-spaced edges 1e-6 … 10 (4 bins a decade).
func KLDHistogram(v []float64) Histogram {
	n := (histHi - histLo) * histPerDec
	h := Histogram{Edges: make([]float64, n+1), Counts: make([]int, n)}
	for i := range h.Edges {
		h.Edges[i] = math.Pow(10, histLo+float64(i)/histPerDec)
	}
	for _, x := range v {
		switch {
		case x < h.Edges[0]:
			h.Under++
		case x >= h.Edges[n]:
			h.Over++
		default:
			b := int((math.Log10(x) - histLo) * histPerDec)
			b = min(max(b, 0), n-1)
			// guard the rounding of Log10 at the edges
			for b > 0 && x < h.Edges[b] {
				b--
			}
			for b < n-1 && x >= h.Edges[b+1] {
				b++
			}
			h.Counts[b]++
		}
	}
	return h
}

// Stats summarizes the positions added so far (the zero Stats before any).
func (a *Accumulator) Stats() Stats {
	n := len(a.kld)
	if n == 0 {
		return Stats{}
	}
	var st Stats
	st.Count = n
	lnQ := meanUnc(a.sNLL, a.sNLL2, n)
	lnB := meanUnc(a.sBase, a.sBase2, n)
	st.PPL = Value{math.Exp(lnQ.Value), math.Exp(lnQ.Value) * lnQ.Unc}
	st.PPLBase = Value{math.Exp(lnB.Value), math.Exp(lnB.Value) * lnB.Unc}
	cov := covariance(a.sNLL, a.sBase, a.sNLLBase, n)
	if lnQ.Unc > 0 && lnB.Unc > 0 {
		st.LnPPLCor = cov / (lnQ.Unc * lnB.Unc)
	}
	lnr := lnQ.Value - lnB.Value
	lnrUnc := math.Sqrt(math.Max(0, lnQ.Unc*lnQ.Unc+lnB.Unc*lnB.Unc-2*cov))
	st.LnRatio = Value{lnr, lnrUnc}
	st.Ratio = Value{math.Exp(lnr), math.Exp(lnr) * lnrUnc}
	pplCov := st.PPL.Value * st.PPLBase.Value * cov
	st.Diff = Value{st.PPL.Value - st.PPLBase.Value,
		math.Sqrt(math.Max(0, st.PPL.Unc*st.PPL.Unc+st.PPLBase.Unc*st.PPLBase.Unc-2*pplCov))}

	st.KLD = meanUnc(a.sKLD, a.sKLD2, n)
	st.KLDQ = quantiles(a.kld)
	st.DeltaP = meanUnc(a.sDP, a.sDP2, n)
	st.DeltaPQ = quantiles(a.dp)
	mse := meanUnc(a.sDP2, a.sDP4, n)
	st.RMSDP.Value = math.Sqrt(mse.Value)
	if st.RMSDP.Value > 0 {
		st.RMSDP.Unc = 0.5 / st.RMSDP.Value * mse.Unc
	}
	p := float64(a.same) / float64(n)
	st.SameTop.Value = p
	if n > 1 {
		st.SameTop.Unc = math.Sqrt(p * (1 - p) / float64(n-1))
	}
	st.KLDHistogram = KLDHistogram(a.kld)
	return st
}
