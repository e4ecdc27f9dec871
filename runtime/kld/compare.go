package kld

import (
	"fmt"
	"math"
	goruntime "runtime"
	"sync"

	"qtool/runtime"
)

// Plan is how a text is cut into scored chunks: the perplexity protocols of
// runtime.Perplexity (disjoint chunks of Ctx tokens, the tail dropped; the
// llama.cpp protocol replaces each chunk's first token by BOS and scores
// only the second half).
type Plan struct {
	Ctx      int
	Protocol string
	Chunks   int
	First    int   // first scored logit row of each chunk
	Scored   int   // scored rows per chunk
	BOS      int   // replaces each chunk's first token (−1: none)
	Tokens   int   // tokens of the whole text
	IDs      []int // Chunks·Ctx evaluated ids
}

// NewPlan cuts ids (the tokenized text, BOS prepended when the tokenizer
// adds one) for a model of vocab ids and bos id (−1: none) and context
// limit maxSeq (0: none) under opt (Ctx, MaxChunks, Protocol), exactly as
// runtime.Perplexity does.
func NewPlan(ids []int, vocab, bos, maxSeq int, opt runtime.PPLOptions) (Plan, error) {
	p := Plan{Ctx: opt.Ctx, Protocol: opt.Protocol, BOS: -1, Tokens: len(ids)}
	if p.Ctx == 0 {
		p.Ctx = runtime.DefaultCtx
	}
	if p.Protocol == "" {
		p.Protocol = runtime.ProtocolGPTQ
	}
	switch p.Protocol {
	case runtime.ProtocolGPTQ:
		if p.Ctx < 2 {
			return p, fmt.Errorf("kld: context %d is too short (want >= 2)", p.Ctx)
		}
	case runtime.ProtocolLlamaCpp:
		if p.Ctx < 4 {
			return p, fmt.Errorf("kld: context %d is too short (want >= 4)", p.Ctx)
		}
		if len(ids) < 2*p.Ctx {
			return p, fmt.Errorf("kld: the llama.cpp protocol needs at least %d tokens (2 × context %d), the text has %d", 2*p.Ctx, p.Ctx, len(ids))
		}
		p.First = p.Ctx / 2
		if bos >= 0 && ids[0] == bos {
			p.BOS = bos
		}
	default:
		return p, fmt.Errorf("kld: unknown protocol %q (want %q or %q)", p.Protocol, runtime.ProtocolGPTQ, runtime.ProtocolLlamaCpp)
	}
	if maxSeq > 0 && p.Ctx > maxSeq {
		return p, fmt.Errorf("kld: context %d exceeds the model's max_position_embeddings %d", p.Ctx, maxSeq)
	}
	p.Scored = p.Ctx - 1 - p.First
	p.Chunks = len(ids) / p.Ctx
	if p.Chunks == 0 {
		return p, fmt.Errorf("kld: the text has %d tokens, fewer than one chunk of %d", len(ids), p.Ctx)
	}
	if opt.MaxChunks > 0 && opt.MaxChunks < p.Chunks {
		p.Chunks = opt.MaxChunks
	}
	p.IDs = ids[:p.Chunks*p.Ctx]
	for i, id := range p.IDs {
		if id < 0 || id >= vocab {
			return p, fmt.Errorf("kld: token id %d at position %d is outside the model vocabulary 0..%d (tokenizer and model do not match?)", id, i, vocab-1)
		}
	}
	return p, nil
}

// Plan is the plan the file was written under, cut to its first maxChunks
// chunks (0: all): what a run scores when it takes the text from the file.
func (f *File) Plan(maxChunks int) Plan {
	p := Plan{Ctx: f.Ctx, Protocol: f.Protocol, Chunks: f.Chunks, First: f.First, Scored: f.Scored,
		BOS: f.BOS, Tokens: f.Tokens}
	if maxChunks > 0 && maxChunks < p.Chunks {
		p.Chunks = maxChunks
	}
	p.IDs = f.IDs[:p.Chunks*p.Ctx]
	return p
}

// Header is the logits-file header of the plan for vocab.
func (p Plan) Header(vocab int) Header {
	return Header{Tokens: p.Tokens, Ctx: p.Ctx, Protocol: p.Protocol, Chunks: p.Chunks,
		First: p.First, Scored: p.Scored, BOS: p.BOS, Vocab: vocab, Range: Range}
}

// input returns chunk c's model input (with the BOS replacement) and its
// targets (the correct next token of each scored row).
func (p Plan) input(c int, in []int) (targets []int) {
	copy(in, p.IDs[c*p.Ctx:(c+1)*p.Ctx])
	if p.BOS >= 0 {
		in[0] = p.BOS
	}
	return in[p.First+1 : p.First+1+p.Scored]
}

// logits runs m on chunk c and returns the scored rows' logits
// [Scored·vocab] (downloaded to the host) and targets.
func (p Plan) logits(m *runtime.Model, cache runtime.KVCache, c int, in []int, host []float32) ([]float32, []int) {
	targets := p.input(c, in)
	be := m.Backend()
	out := m.Forward(in, 0, cache)
	be.Download(host, out)
	be.Free(out)
	v := m.Config().Vocab
	return host[p.First*v : (p.First+p.Scored)*v], targets
}

// Base supplies the base's stored rows of each chunk.
type Base interface {
	// Chunk returns the Scored rows of chunk c (valid until the next call).
	Chunk(c int) ([]Row, error)
	// Range is the span of the rows' codes (see Header.Range).
	Range() float64
}

// FileBase reads the base from a logits file.
type FileBase struct {
	F    *File
	rows []Row
}

// Chunk implements Base.
func (b *FileBase) Chunk(c int) ([]Row, error) {
	if b.rows == nil {
		b.rows = make([]Row, b.F.Scored)
	}
	return b.rows, b.F.ReadChunk(c, b.rows)
}

// Range implements Base.
func (b *FileBase) Range() float64 { return b.F.Range }

// ModelBase runs the base model chunk by chunk, encoding its rows as a
// logits file stores them (so the numbers are the same whether the base is
// cached or not), and writes them to W when it is not nil.
type ModelBase struct {
	M    *runtime.Model
	Plan Plan
	W    *Writer

	cache runtime.KVCache
	in    []int
	host  []float32
	rows  []Row
	lp    [][]float64
}

// Chunk implements Base.
func (b *ModelBase) Chunk(c int) ([]Row, error) {
	p, v := b.Plan, b.M.Config().Vocab
	if b.cache == nil {
		b.cache = b.M.NewCache(p.Ctx)
		b.in = make([]int, p.Ctx)
		b.host = make([]float32, p.Ctx*v)
		b.rows = make([]Row, p.Scored)
	}
	logits, targets := p.logits(b.M, b.cache, c, b.in, b.host)
	b.lp = parallel(p.Scored, v, b.lp, func(i int, lp []float64) {
		EncodeRow(&b.rows[i], logits[i*v:(i+1)*v], targets[i], lp)
	})
	if b.W != nil {
		for _, r := range b.rows {
			if err := b.W.WriteRow(r); err != nil {
				return nil, err
			}
		}
	}
	return b.rows, nil
}

// Range implements Base.
func (b *ModelBase) Range() float64 { return Range }

// parallel runs f(i, scratch) for i in 0..n-1 over GOMAXPROCS goroutines,
// each with a float64 scratch of len v (kept in the returned slice for the
// next call).
func parallel(n, v int, scratch [][]float64, f func(i int, lp []float64)) [][]float64 {
	w := min(goruntime.GOMAXPROCS(0), n)
	for len(scratch) < w {
		scratch = append(scratch, make([]float64, v))
	}
	var wg sync.WaitGroup
	for k := 0; k < w; k++ {
		wg.Add(1)
		go func(k int) {
			defer wg.Done()
			for i := k; i < n; i += w {
				f(i, scratch[k])
			}
		}(k)
	}
	wg.Wait()
	return scratch
}

// Result is a comparison: the statistics over every scored position and
// the mean KLD and perplexity of each chunk.
type Result struct {
	Stats
	ChunkKLD []float64 `json:"chunk_kld"`
	ChunkPPL []float64 `json:"chunk_ppl"`
}

// Run is what `qtool verify --kld --json` prints (and `qtool report`
// reads): the run, then every figure of Result at the top level.
type Run struct {
	Model        string  `json:"model"`
	Base         string  `json:"base"`
	BaseKind     string  `json:"base_kind"` // "model" or "logits file"
	Cache        string  `json:"cache,omitempty"`
	CacheWritten bool    `json:"cache_written,omitempty"`
	CacheBytes   int64   `json:"cache_bytes,omitempty"`
	Text         string  `json:"text"`
	Tokens       int     `json:"tokens"`
	Chunks       int     `json:"chunks"`
	Ctx          int     `json:"ctx"`
	Protocol     string  `json:"protocol"`
	Scored       int     `json:"scored"`
	Device       string  `json:"device"`
	Seconds      float64 `json:"seconds"`
	TokensPerS   float64 `json:"tokens_per_s"`
	Result
}

// Compare runs m over plan's chunks and compares each scored position with
// base. progress, when not nil, is called after each chunk with the running
// mean KLD.
func Compare(m *runtime.Model, base Base, plan Plan, progress func(done, total int, meanKLD float64)) (Result, error) {
	var res Result
	v := m.Config().Vocab
	cache := m.NewCache(plan.Ctx)
	in := make([]int, plan.Ctx)
	host := make([]float32, plan.Ctx*v)
	toks := make([]Token, plan.Scored)
	var acc Accumulator
	var scratch [][]float64
	for c := 0; c < plan.Chunks; c++ {
		rows, err := base.Chunk(c)
		if err != nil {
			return res, err
		}
		if len(rows) != plan.Scored {
			return res, fmt.Errorf("kld: base chunk %d has %d rows, want %d", c, len(rows), plan.Scored)
		}
		logits, targets := plan.logits(m, cache, c, in, host)
		rng := base.Range()
		scratch = parallel(plan.Scored, v, scratch, func(i int, lp []float64) {
			rows[i].LogProbs(lp, rng)
			toks[i] = CompareRow(lp, int(rows[i].Top), float64(rows[i].NLL), logits[i*v:(i+1)*v], targets[i])
		})
		sk, sn := 0.0, 0.0
		for i, t := range toks {
			if math.IsNaN(t.KLD) || math.IsInf(t.NLL, 0) || math.IsNaN(t.NLL) {
				return res, fmt.Errorf("kld: chunk %d row %d: non-finite result (KLD %v, NLL %v); the model produced NaN or Inf", c, plan.First+i, t.KLD, t.NLL)
			}
			acc.Add(t)
			sk += t.KLD
			sn += t.NLL
		}
		res.ChunkKLD = append(res.ChunkKLD, sk/float64(plan.Scored))
		res.ChunkPPL = append(res.ChunkPPL, math.Exp(sn/float64(plan.Scored)))
		if progress != nil {
			progress(c+1, plan.Chunks, acc.MeanKLD())
		}
	}
	res.Stats = acc.Stats()
	return res, nil
}
