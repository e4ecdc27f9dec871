package gputest

import (
	"fmt"
	"math/rand/v2"
	"os"
	"sync"
	"testing"
	"time"

	"qtool/formats/model"
	"qtool/runtime"
	"qtool/runtime/tp"
)

// timedComm wraps a Communicator and adds up the wall time rank 0 spends in
// collectives, so the speed test can report the all-reduce share.
type timedComm struct {
	tp.Communicator
	mu    sync.Mutex
	spent time.Duration
	calls int
}

func (c *timedComm) AllReduceSum(rank int, buf []float32) error {
	t0 := time.Now()
	err := c.Communicator.AllReduceSum(rank, buf)
	c.add(rank, time.Since(t0))
	return err
}

func (c *timedComm) AllGather(rank int, send, recv []float32) error {
	t0 := time.Now()
	err := c.Communicator.AllGather(rank, send, recv)
	c.add(rank, time.Since(t0))
	return err
}

func (c *timedComm) add(rank int, d time.Duration) {
	if rank != 0 {
		return
	}
	c.mu.Lock()
	c.spent += d
	c.calls++
	c.mu.Unlock()
}

func (c *timedComm) take() (time.Duration, int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	d, n := c.spent, c.calls
	c.spent, c.calls = 0, 0
	return d, n
}

// synthetic7B builds a Llama-2-7B-shaped model with `layers` decoder layers:
// random W4A16 linears (AWQ-style 4-bit codes, group 128, fp32 scales and
// zeros) and fp16 embedding/classifier. The weights are random; only the
// shapes matter for speed.
func synthetic7B(layers int) *model.Model {
	cfg := model.Config{Arch: model.Llama, Hidden: 4096, Intermediate: 11008, Layers: layers, Heads: 32,
		KVHeads: 32, HeadDim: 128, Vocab: 32000, MaxSeq: 4096, RopeTheta: 1e4, NormEps: 1e-5, BOS: 1, EOS: []int{2}}
	m := model.New(cfg)
	rng := rand.New(rand.NewPCG(1, 2))
	dense := func(shape ...int) *model.Dense {
		n := model.NumElements(shape)
		b := make([]byte, 2*n)
		for i := 0; i < n; i++ {
			h := model.Float32ToF16(float32(rng.NormFloat64() * 0.02))
			b[2*i], b[2*i+1] = byte(h), byte(h>>8)
		}
		d, _ := model.NewDense(model.F16, shape, b)
		return d
	}
	ones := func(n int) *model.Dense {
		v := make([]float32, n)
		for i := range v {
			v[i] = 1
		}
		return model.FromFloat32([]int{n}, v)
	}
	q4 := func(rows, cols int) *model.Quantized {
		const g = 128
		q := &model.Quantized{Bits: 4, GroupSize: g, Rows: rows, Cols: cols, Q: make([]int8, rows*cols),
			Scale: make([]float32, rows*cols/g), Zero: make([]float32, rows*cols/g)}
		for i := range q.Q {
			q.Q[i] = int8(rng.IntN(16) - 8)
		}
		for i := range q.Scale {
			q.Scale[i] = 0.002 + 0.001*rng.Float32()
			q.Zero[i] = float32(rng.IntN(16) - 8)
		}
		return q
	}
	m.Set("embed", dense(cfg.Vocab, cfg.Hidden))
	m.Set("lm_head", dense(cfg.Vocab, cfg.Hidden))
	m.Set("norm", ones(cfg.Hidden))
	for l := 0; l < layers; l++ {
		m.Set(model.Name(l, model.AttnNorm), ones(cfg.Hidden))
		m.Set(model.Name(l, model.MLPNorm), ones(cfg.Hidden))
		for _, r := range []model.Role{model.Q, model.K, model.V, model.O} {
			m.Set(model.Name(l, r), q4(cfg.Hidden, cfg.Hidden))
		}
		m.Set(model.Name(l, model.Gate), q4(cfg.Intermediate, cfg.Hidden))
		m.Set(model.Name(l, model.Up), q4(cfg.Intermediate, cfg.Hidden))
		m.Set(model.Name(l, model.Down), q4(cfg.Hidden, cfg.Intermediate))
	}
	return m
}

// speed measures prefill of `prompt` tokens and `steps` greedy decode steps.
func speed(t *testing.T, rm *runtime.Model, prompt, steps int) (prefill, decode float64) {
	be := rm.Backend()
	ids := make([]int, prompt)
	for i := range ids {
		ids[i] = 3 + i%1000
	}
	run := func() (time.Duration, time.Duration) {
		cache := rm.NewCache(prompt + steps + 1)
		t0 := time.Now()
		logits := rm.Forward(ids, 0, cache)
		last := be.Argmax(logits)
		be.Free(logits)
		tPre := time.Since(t0)
		tok := last[len(last)-1]
		t1 := time.Now()
		for s := 0; s < steps; s++ {
			lg := rm.Forward([]int{tok}, prompt+s, cache)
			tok = be.Argmax(lg)[0]
			be.Free(lg)
		}
		return tPre, time.Since(t1)
	}
	run() // warm-up: module load, allocator pools
	tPre, tDec := run()
	return float64(prompt) / tPre.Seconds(), float64(steps) / tDec.Seconds()
}

// TestTPSpeed compares prefill and decode of a Llama-2-7B-shaped W4A16
// model (QTOOL_TP_LAYERS decoder layers, default 8) on one GPU and at TP=2,
// with the time rank 0 spends in collectives measured separately. It only
// reports; the numbers go into the issue notes.
func TestTPSpeed(t *testing.T) {
	needGPUs(t, 2)
	if os.Getenv("QTOOL_TP_SPEED") == "" {
		t.Skip("set QTOOL_TP_SPEED=1 to run the TP speed comparison")
	}
	layers := 8
	if v := os.Getenv("QTOOL_TP_LAYERS"); v != "" {
		fmt.Sscan(v, &layers)
	}
	m := synthetic7B(layers)
	const prompt, steps = 512, 64

	one, err := newRank(0)
	if err != nil {
		t.Fatal(err)
	}
	rm1, err := runtime.Load(m, one)
	if err != nil {
		t.Fatal(err)
	}
	p1, d1 := speed(t, rm1, prompt, steps)
	one.Close()

	nc, err := tp.NewNCCLCommunicator([]int{0, 1})
	if err != nil {
		t.Fatal(err)
	}
	comm := &timedComm{Communicator: nc}
	var ranks []runtime.Backend
	for d := 0; d < 2; d++ {
		be, err := newRank(d)
		if err != nil {
			t.Fatal(err)
		}
		ranks = append(ranks, be)
	}
	be, err := tp.New(m.Config, ranks, comm)
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	rm2, err := runtime.Load(m, be)
	if err != nil {
		t.Fatal(err)
	}
	speed(t, rm2, prompt, steps) // warm-up
	comm.take()
	ids := make([]int, prompt)
	for i := range ids {
		ids[i] = 3 + i%1000
	}
	cache := rm2.NewCache(prompt + steps + 1)
	t0 := time.Now()
	lg := rm2.Forward(ids, 0, cache)
	tok := be.Argmax(lg)[prompt-1]
	be.Free(lg)
	tPre := time.Since(t0)
	commPre, nPre := comm.take()
	t1 := time.Now()
	for s := 0; s < steps; s++ {
		lg := rm2.Forward([]int{tok}, prompt+s, cache)
		tok = be.Argmax(lg)[0]
		be.Free(lg)
	}
	tDec := time.Since(t1)
	commDec, nDec := comm.take()
	p2, d2 := float64(prompt)/tPre.Seconds(), float64(steps)/tDec.Seconds()
	t.Logf("Llama-2-7B shape, %d layers, W4A16 g128, prompt %d, %d decode steps", layers, prompt, steps)
	t.Logf("1 GPU : prefill %.0f tok/s, decode %.1f tok/s", p1, d1)
	t.Logf("TP=2  : prefill %.0f tok/s (%.2fx), decode %.1f tok/s (%.2fx)", p2, p2/p1, d2, d2/d1)
	t.Logf("TP=2 collectives on rank 0: prefill %d calls %.1f ms (%.0f%% of %.1f ms); decode %d calls %.1f ms (%.0f%% of %.1f ms, %.0f µs/token)",
		nPre, ms(commPre), 100*commPre.Seconds()/tPre.Seconds(), ms(tPre),
		nDec, ms(commDec), 100*commDec.Seconds()/tDec.Seconds(), ms(tDec), 1e6*commDec.Seconds()/steps)
}

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
