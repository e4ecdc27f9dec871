package runtime

import (
	"errors"
	"fmt"
	"math"
	"math/rand/v2"
	"slices"
	"time"
)

// ErrEmptyPrompt is returned by Generate for an empty prompt.
var ErrEmptyPrompt = errors.New("generate: empty prompt")

// GenOptions controls Generate.
type GenOptions struct {
	// MaxNew is the number of tokens to generate at most.
	MaxNew int
	// Temperature 0 (or less) selects greedy decoding; otherwise logits are
	// divided by it before sampling.
	Temperature float64
	// TopK keeps only the K most likely tokens when > 0.
	TopK int
	// TopP keeps the smallest set of most likely tokens whose probability
	// reaches TopP when 0 < TopP < 1.
	TopP float64
	// Seed makes sampling reproducible.
	Seed uint64
	// EOS lists the ids that stop generation (the EOS token itself is not
	// returned). Nil uses the model config's EOS.
	EOS []int
	// OnToken, when not nil, is called with every generated token as it is
	// produced.
	OnToken func(id int)
	// NoGraph turns off graph decoding (see Generate).
	NoGraph bool
	// Timing, when not nil, receives how long the call took to its first
	// token and how fast it went once decoding was steady.
	Timing *GenTiming
}

// GenTiming is how a Generate call spent its time, by the host's clock
// (each token is known on the host when its step has ended).
type GenTiming struct {
	// FirstToken is the time from the call to the first new token: the
	// prompt's prefill and the first logits.
	FirstToken time.Duration
	// SteadyTokens new tokens came in Steady once decoding was steady:
	// with a captured decode step, those after the first chunk of replays
	// (the first steps, the capture and the graph's first launch before
	// them); otherwise those after the first token. Zero where no token
	// came after that point.
	SteadyTokens int
	Steady       time.Duration
}

// SteadyTokensPerS is SteadyTokens over Steady (0 without steady tokens).
func (t GenTiming) SteadyTokensPerS() float64 {
	if t.SteadyTokens == 0 || t.Steady <= 0 {
		return 0
	}
	return float64(t.SteadyTokens) / t.Steady.Seconds()
}

// genClock fills a GenTiming (none where t is nil): first marks the first
// token, steady the start of the steady part (with the tokens so far), done
// the end. from and fromN are where the steady count starts; marked says
// which mark set them (0 none yet, 1 first, 2 steady).
type genClock struct {
	t             *GenTiming
	start, from   time.Time
	fromN, marked int
}

func newGenClock(t *GenTiming) *genClock { return &genClock{t: t, start: time.Now()} }

func (c *genClock) first() {
	if c.t != nil && c.marked == 0 {
		c.from, c.fromN, c.marked = time.Now(), 1, 1
		c.t.FirstToken = c.from.Sub(c.start)
	}
}

func (c *genClock) steady(n int) {
	if c.t != nil && c.marked < 2 {
		c.from, c.fromN, c.marked = time.Now(), n, 2
	}
}

func (c *genClock) done(n int) {
	if c.t != nil && c.marked > 0 && n > c.fromN {
		c.t.SteadyTokens, c.t.Steady = n-c.fromN, time.Since(c.from)
	}
}

// Generate continues prompt and returns the new tokens only (without the
// prompt and without a final EOS).
//
// Greedy decoding on a backend that is a DecodeGrapher (CUDA) replays a
// captured decode step from the third new token on, graphChunk steps per
// host round trip: the tokens are the same as step by step (the same
// kernels run), only the launch overhead goes. Tokens after an EOS within
// the last chunk are computed and dropped. opt.NoGraph turns this off.
func Generate(m *Model, prompt []int, opt GenOptions) ([]int, error) {
	if len(prompt) == 0 {
		return nil, ErrEmptyPrompt
	}
	cfg := m.Config()
	if err := checkIDs(prompt, cfg.Vocab); err != nil {
		return nil, fmt.Errorf("generate: %w", err)
	}
	if opt.MaxNew < 0 {
		return nil, fmt.Errorf("generate: max new tokens %d is negative", opt.MaxNew)
	}
	if opt.TopP < 0 || opt.TopP > 1 || math.IsNaN(opt.TopP) {
		return nil, fmt.Errorf("generate: top-p %g outside 0..1", opt.TopP)
	}
	if opt.TopK < 0 {
		return nil, fmt.Errorf("generate: top-k %d is negative", opt.TopK)
	}
	if math.IsNaN(opt.Temperature) || math.IsInf(opt.Temperature, 0) {
		return nil, fmt.Errorf("generate: temperature %g is not a finite number", opt.Temperature)
	}
	if cfg.MaxSeq > 0 && opt.MaxNew > cfg.MaxSeq-len(prompt) { // not len+MaxNew: that can overflow
		return nil, fmt.Errorf("generate: prompt (%d) + new tokens (%d) exceed the model's max_position_embeddings %d", len(prompt), opt.MaxNew, cfg.MaxSeq)
	}
	if opt.MaxNew > math.MaxInt32 {
		return nil, fmt.Errorf("generate: %d new tokens: more than %d", opt.MaxNew, math.MaxInt32)
	}
	total := len(prompt) + opt.MaxNew
	if err := checkKV(fmt.Sprintf("generate: prompt (%d) + new tokens (%d)", len(prompt), opt.MaxNew), cfg, total); err != nil {
		return nil, err
	}
	if opt.MaxNew == 0 {
		return nil, nil
	}
	eos := opt.EOS
	if eos == nil {
		eos = cfg.EOS
	}
	clock := newGenClock(opt.Timing)
	be := m.Backend()
	cache := m.NewCache(total)
	s := sampler{opt: opt, rng: rand.New(rand.NewPCG(opt.Seed, opt.Seed^0x9e3779b97f4a7c15))}
	logitsRow := make([]float32, cfg.Vocab)

	x := m.Hidden(prompt, 0, cache)
	last := x
	if x.Rows() > 1 {
		last = rowsOf(be, x, x.Rows()-1, x.Rows())
		be.Free(x)
	}
	var out []int
	pos := len(prompt)
	for {
		logits := m.Logits(last)
		be.Free(last)
		be.Download(logitsRow, logits)
		be.Free(logits)
		id := s.next(logitsRow)
		if slices.Contains(eos, id) {
			break
		}
		out = append(out, id)
		clock.first()
		if opt.OnToken != nil {
			opt.OnToken(id)
		}
		if len(out) == opt.MaxNew {
			break
		}
		if len(out) >= 2 && opt.Temperature <= 0 && !opt.NoGraph {
			// A single-token step has run uncaptured: capture the next.
			if g, ok := be.(DecodeGrapher); ok {
				out, err := graphDecode(m, g, cache, out, id, pos, total, eos, opt, clock)
				clock.done(len(out))
				return out, err
			}
		}
		last = m.Hidden([]int{id}, pos, cache)
		pos++
	}
	clock.done(len(out))
	return out, nil
}

// graphChunk is the number of graph replays Generate queues between two
// reads of the generated tokens.
const graphChunk = 16

// graphDecode continues greedy generation with a captured decode step:
// out holds the tokens so far, id the last one (not yet run), at position
// pos. A single-token step has run uncaptured before, so every buffer the
// step needs exists.
func graphDecode(m *Model, g DecodeGrapher, cache KVCache, out []int, id, pos, total int, eos []int, opt GenOptions, clock *genClock) ([]int, error) {
	be := m.Backend()
	if err := g.BeginCapture(pos, total); err != nil {
		if errors.Is(err, ErrNoCapture) {
			return stepDecode(m, cache, out, id, pos, eos, opt)
		}
		return out, fmt.Errorf("generate: %w", err)
	}
	logits := m.Forward([]int{0}, pos, cache) // the id and position come from the device
	g.GreedyAdvance(logits)
	be.Free(logits)
	graph, err := g.EndCapture()
	if err != nil {
		return out, fmt.Errorf("generate: %w", err)
	}
	defer graph.Destroy()
	g.SetDecodeState(id, pos)
	for len(out) < opt.MaxNew {
		n := min(graphChunk, opt.MaxNew-len(out))
		for range n {
			graph.Launch()
		}
		for _, next := range g.History(pos, pos+n) {
			if slices.Contains(eos, next) {
				return out, nil
			}
			out = append(out, next)
			if opt.OnToken != nil {
				opt.OnToken(next)
			}
		}
		pos += n
		clock.steady(len(out)) // after the first chunk: the replays alone from here
	}
	return out, nil
}

// stepDecode continues greedy generation step by step, as graphDecode's
// fallback: id at position pos is the last token, not yet run.
func stepDecode(m *Model, cache KVCache, out []int, id, pos int, eos []int, opt GenOptions) ([]int, error) {
	be := m.Backend()
	row := make([]float32, m.Config().Vocab)
	for len(out) < opt.MaxNew {
		logits := m.Forward([]int{id}, pos, cache)
		be.Download(row, logits)
		be.Free(logits)
		id = argmax(row)
		if slices.Contains(eos, id) {
			break
		}
		out = append(out, id)
		if opt.OnToken != nil {
			opt.OnToken(id)
		}
		pos++
	}
	return out, nil
}

// sampler picks the next token from a row of logits.
type sampler struct {
	opt  GenOptions
	rng  *rand.Rand
	idx  []int
	prob []float64
}

func (s *sampler) next(logits []float32) int {
	if s.opt.Temperature <= 0 {
		return argmax(logits)
	}
	n := len(logits)
	if cap(s.idx) < n {
		s.idx = make([]int, n)
		s.prob = make([]float64, n)
	}
	idx, prob := s.idx[:n], s.prob[:n]
	for i := range idx {
		idx[i] = i
	}
	// Sort candidates by logit, largest first (ties by id for determinism).
	slices.SortFunc(idx, func(a, b int) int {
		switch {
		case logits[a] > logits[b]:
			return -1
		case logits[a] < logits[b]:
			return 1
		}
		return a - b
	})
	k := n
	if s.opt.TopK > 0 && s.opt.TopK < k {
		k = s.opt.TopK
	}
	mx := float64(logits[idx[0]])
	sum := 0.0
	for i := 0; i < k; i++ {
		p := math.Exp((float64(logits[idx[i]]) - mx) / s.opt.Temperature)
		prob[i] = p
		sum += p
	}
	if tp := s.opt.TopP; tp > 0 && tp < 1 {
		acc := 0.0
		for i := 0; i < k; i++ {
			acc += prob[i] / sum
			if acc >= tp {
				k = i + 1
				break
			}
		}
		sum = 0
		for i := 0; i < k; i++ {
			sum += prob[i]
		}
	}
	r := s.rng.Float64() * sum
	for i := 0; i < k; i++ {
		r -= prob[i]
		if r < 0 {
			return idx[i]
		}
	}
	return idx[k-1]
}

// argmax returns the index of the largest value (the first on ties).
func argmax(v []float32) int {
	best := 0
	for i, x := range v {
		if x > v[best] {
			best = i
		}
	}
	return best
}
