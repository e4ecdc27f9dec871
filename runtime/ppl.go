package runtime

import (
	"fmt"
	"math"
)

// Perplexity protocols.
const (
	// ProtocolGPTQ is the GPTQ/AWQ papers' protocol: disjoint chunks of Ctx
	// tokens (tail dropped), every chunk scores its Ctx−1 next-token
	// predictions, ppl = exp(mean over chunks of the chunk's mean NLL).
	ProtocolGPTQ = "gptq"
	// ProtocolLlamaCpp is llama.cpp's llama-perplexity: the same chunks, but
	// the first token of each chunk is replaced by BOS (when the text starts
	// with BOS) and only the second half of each chunk is scored
	// (Ctx − Ctx/2 − 1 predictions per chunk).
	ProtocolLlamaCpp = "llamacpp"
)

// DefaultCtx is the default perplexity context length.
const DefaultCtx = 512

// PPLOptions controls Perplexity.
type PPLOptions struct {
	// Ctx is the chunk length (DefaultCtx when 0).
	Ctx int
	// MaxChunks limits the number of chunks evaluated (0: all).
	MaxChunks int
	// Protocol is ProtocolGPTQ (also when empty) or ProtocolLlamaCpp.
	Protocol string
	// Progress, when not nil, is called after every chunk.
	Progress func(done, total int, runningPPL float64)
}

// PPLResult is the outcome of Perplexity.
type PPLResult struct {
	PPL      float64   // exp(mean NLL over the scored predictions)
	NLL      float64   // that mean NLL
	Tokens   int       // tokens of the input text (including a leading BOS)
	Chunks   int       // chunks evaluated
	Ctx      int       // chunk length
	Scored   int       // predictions scored in all
	Protocol string    // ProtocolGPTQ or ProtocolLlamaCpp
	ChunkNLL []float64 // mean NLL of each chunk
}

// String renders the result with its protocol, e.g.
// "ppl 69.0356 (gptq protocol, ctx 512, 371 chunks, 190174 tokens)".
func (r PPLResult) String() string {
	return fmt.Sprintf("ppl %.4f (%s protocol, ctx %d, %d chunks, %d tokens, %d scored)",
		r.PPL, r.Protocol, r.Ctx, r.Chunks, r.Tokens, r.Scored)
}

// Perplexity evaluates m on the tokenized text ids (with BOS prepended
// already when the tokenizer adds one) under opt.Protocol.
func Perplexity(m *Model, ids []int, opt PPLOptions) (PPLResult, error) {
	ctx := opt.Ctx
	if ctx == 0 {
		ctx = DefaultCtx
	}
	proto := opt.Protocol
	if proto == "" {
		proto = ProtocolGPTQ
	}
	cfg := m.Config()
	res := PPLResult{Tokens: len(ids), Ctx: ctx, Protocol: proto}
	first := 0 // first logit row scored in each chunk
	switch proto {
	case ProtocolGPTQ:
		if ctx < 2 {
			return res, fmt.Errorf("perplexity: context %d is too short (want >= 2)", ctx)
		}
	case ProtocolLlamaCpp:
		if ctx < 4 {
			return res, fmt.Errorf("perplexity: context %d is too short (want >= 4)", ctx)
		}
		first = ctx / 2
		if len(ids) < 2*ctx {
			return res, fmt.Errorf("perplexity: the llama.cpp protocol needs at least %d tokens (2 × context %d), the text has %d", 2*ctx, ctx, len(ids))
		}
	default:
		return res, fmt.Errorf("perplexity: unknown protocol %q (want %q or %q)", proto, ProtocolGPTQ, ProtocolLlamaCpp)
	}
	if cfg.MaxSeq > 0 && ctx > cfg.MaxSeq {
		return res, fmt.Errorf("perplexity: context %d exceeds the model's max_position_embeddings %d", ctx, cfg.MaxSeq)
	}
	if err := checkKV(fmt.Sprintf("perplexity: context %d", ctx), cfg, ctx); err != nil {
		return res, err
	}
	n := len(ids) / ctx
	if n == 0 {
		return res, fmt.Errorf("perplexity: the text has %d tokens, fewer than one chunk of %d", len(ids), ctx)
	}
	if opt.MaxChunks > 0 && opt.MaxChunks < n {
		n = opt.MaxChunks
	}
	if err := checkIDs(ids[:n*ctx], cfg.Vocab); err != nil {
		return res, fmt.Errorf("perplexity: %w", err)
	}
	bos := -1
	if proto == ProtocolLlamaCpp && cfg.BOS >= 0 && ids[0] == cfg.BOS {
		bos = cfg.BOS
	}
	be := m.Backend()
	cache := m.NewCache(ctx)
	chunk := make([]int, ctx)
	scored := ctx - 1 - first
	targets := make([]int, scored)
	nll := make([]float64, scored)
	sum := 0.0
	for c := 0; c < n; c++ {
		copy(chunk, ids[c*ctx:(c+1)*ctx])
		if bos >= 0 {
			chunk[0] = bos
		}
		x := m.Hidden(chunk, 0, cache)
		rows := x
		if first > 0 || scored < ctx {
			rows = rowsOf(be, x, first, first+scored)
			be.Free(x)
		}
		logits := m.Logits(rows)
		be.Free(rows)
		copy(targets, chunk[first+1:first+1+scored])
		be.NLL(nll, logits, targets)
		be.Free(logits)
		s := 0.0
		for _, v := range nll {
			s += v
		}
		mean := s / float64(scored)
		if !finite(mean) {
			return res, fmt.Errorf("perplexity: chunk %d has a non-finite NLL (%v); the model produced NaN or Inf", c, mean)
		}
		res.ChunkNLL = append(res.ChunkNLL, mean)
		sum += mean
		if opt.Progress != nil {
			opt.Progress(c+1, n, math.Exp(sum/float64(c+1)))
		}
	}
	res.Chunks = n
	res.Scored = n * scored
	res.NLL = sum / float64(n)
	res.PPL = math.Exp(res.NLL)
	return res, nil
}
