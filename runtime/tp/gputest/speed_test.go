package gputest

import (
	"fmt"
	"math/rand/v2"
	"os"
	"runtime/pprof"
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
// random W4A16 linears (AWQ-style 4-bit codes, group 128, fp16 scales and
// integer zeros) and fp16 embedding/classifier. The weights are random; only the
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
			q.Scale[i] = model.RoundF16(0.002 + 0.001*rng.Float32()) // fp16, as AutoAWQ stores them
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
// model (QTOOL_TP_LAYERS decoder layers, default 8; a prompt of
// QTOOL_TP_PROMPT tokens, default 512) on one GPU and at TP=2,
// with the collectives measured separately: alone (all-reduce and
// all-gather of the decode and prefill shapes), and as the slowdown against
// a run that skips them. It also runs the host-memory collectives for
// comparison. It only reports; the numbers go into the issue notes.
func TestTPSpeed(t *testing.T) {
	needGPUs(t, 2)
	if os.Getenv("QTOOL_TP_SPEED") == "" {
		t.Skip("set QTOOL_TP_SPEED=1 to run the TP speed comparison")
	}
	layers := 8
	if v := os.Getenv("QTOOL_TP_LAYERS"); v != "" {
		fmt.Sscan(v, &layers)
	}
	prompt, steps := 512, 64
	if v := os.Getenv("QTOOL_TP_PROMPT"); v != "" {
		fmt.Sscan(v, &prompt)
	}
	m := synthetic7B(layers)

	one, err := newRank(0)
	if err != nil {
		t.Fatal(err)
	}
	rm1, err := runtime.Load(m, one)
	if err != nil {
		t.Fatal(err)
	}
	p1, d1 := speed(t, rm1, prompt, steps)
	q1, w1 := prefillHost(t, rm1, prompt, 20, "one")
	t.Logf("1 GPU prefill: the host queues it in %.2f ms of %.2f ms", ms(q1), ms(w1))
	one.Close()

	newTP := func(wrap bool) (*tp.Backend, *runtime.Model, *timedComm) {
		nc, err := tp.NewNCCLCommunicator([]int{0, 1})
		if err != nil {
			t.Fatal(err)
		}
		var comm tp.Communicator = nc
		var tc *timedComm
		if wrap { // hides the device collectives: the host path
			tc = &timedComm{Communicator: nc}
			comm = tc
		}
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
		rm, err := runtime.Load(m, be)
		if err != nil {
			be.Close()
			t.Fatal(err)
		}
		return be, rm, tc
	}
	t.Logf("Llama-2-7B shape, %d layers, W4A16 g128, prompt %d, %d decode steps", layers, prompt, steps)
	t.Logf("1 GPU : prefill %.0f tok/s, decode %.1f tok/s", p1, d1)

	// Device collectives (NCCL on the ranks' buffers and streams).
	be, rm2, _ := newTP(false)
	H, V := m.Config.Hidden, m.Config.Vocab
	be.SetGroupedCollectives(true)
	pG, dG := speed(t, rm2, prompt, steps)
	t.Logf("TP=2 device collectives, one NCCL group per collective: prefill %.0f tok/s (%.2fx), decode %.1f tok/s (%.2fx); all-reduce [1 %d] %.1f µs",
		pG, pG/p1, dG, dG/d1, H, us(be.TimeAllReduce(1, H, 200)))
	be.SetGroupedCollectives(false)
	p2, d2 := speed(t, rm2, prompt, steps)
	peerBytes := max(tp.DefaultPeerBytes, 4*prompt*H) // the prompt's all-reduces too
	if err := be.UsePeerMemory(peerBytes, time.Minute); err != nil {
		t.Logf("TP=2 all-reduce over peer memory: %v", err)
	} else {
		pP, dP := speed(t, rm2, prompt, steps)
		q2, w2 := prefillHost(t, rm2, prompt, 20, "tp2")
		t.Logf("TP=2 prefill: the host queues it in %.2f ms of %.2f ms", ms(q2), ms(w2))
		t.Logf("TP=2 all-reduces of up to %d MiB over peer memory: prefill %.0f tok/s (%.2fx), decode %.1f tok/s (%.2fx); all-reduce [1 %d] %.1f µs, [%d %d] %.1f µs",
			peerBytes>>20, pP, pP/p1, dP, dP/d1, H, us(be.TimeAllReduce(1, H, 200)), prompt, H, us(be.TimeAllReduce(prompt, H, 20)))
		be.SetPeerLimit(0)
	}
	be.SkipCollectives(true)
	p3, d3 := speed(t, rm2, prompt, steps)
	be.SkipCollectives(false)
	arDec, arPre := be.TimeAllReduce(1, H, 200), be.TimeAllReduce(prompt, H, 20)
	agDec, agPre := be.TimeAllGather(1, V, 200), be.TimeAllGather(prompt, V, 20)
	nAR := 2*layers + 1 // two per layer and the embedding
	t.Logf("TP=2 device collectives=%v, issued per rank: prefill %.0f tok/s (%.2fx), decode %.1f tok/s (%.2fx)", be.DeviceCollectives(), p2, p2/p1, d2, d2/d1)
	t.Logf("TP=2 with the collectives skipped (wrong results, timing only): prefill %.0f tok/s, decode %.1f tok/s",
		p3, d3)
	t.Logf("TP=2 collectives alone: all-reduce [1 %d] %.1f µs, [%d %d] %.1f µs; all-gather of the logits [1 %d] %.1f µs, [%d %d] %.1f µs",
		H, us(arDec), prompt, H, us(arPre), V, us(agDec), prompt, V, us(agPre))
	cPre := time.Duration(nAR)*arPre + agPre
	cDec := time.Duration(nAR)*arDec + agDec
	tPre, tDec := float64(prompt)/p2, float64(steps)/d2
	t.Logf("TP=2 collective time (%d all-reduces + 1 all-gather per forward): prefill %.2f ms (%.0f%% of %.1f ms); decode %.0f µs/token (%.0f%% of %.0f µs); slowdown from the collectives: prefill %.1f ms, decode %.0f µs/token",
		nAR, ms(cPre), 100*cPre.Seconds()/tPre, 1e3*tPre, us(cDec), 100*cDec.Seconds()*float64(steps)/tDec, 1e6*tDec/float64(steps),
		1e3*(float64(prompt)/p2-float64(prompt)/p3), 1e6*(1/d2-1/d3))
	be.Close()

	// Host collectives (download, NCCL on a staging buffer, upload), the
	// path of CPU ranks, with rank 1 on its worker.
	beH, rmH, comm := newTP(true)
	defer beH.Close()
	speed(t, rmH, prompt, steps) // warm-up
	comm.take()
	ids := make([]int, prompt)
	for i := range ids {
		ids[i] = 3 + i%1000
	}
	cache := rmH.NewCache(prompt + steps + 1)
	t0 := time.Now()
	lg := rmH.Forward(ids, 0, cache)
	tok := beH.Argmax(lg)[prompt-1]
	beH.Free(lg)
	tPreH := time.Since(t0)
	commPre, nPre := comm.take()
	t1 := time.Now()
	for s := 0; s < steps; s++ {
		lg := rmH.Forward([]int{tok}, prompt+s, cache)
		tok = beH.Argmax(lg)[0]
		beH.Free(lg)
	}
	tDecH := time.Since(t1)
	commDec, nDec := comm.take()
	pH, dH := float64(prompt)/tPreH.Seconds(), float64(steps)/tDecH.Seconds()
	t.Logf("TP=2 host collectives: prefill %.0f tok/s (%.2fx), decode %.1f tok/s (%.2fx)", pH, pH/p1, dH, dH/d1)
	t.Logf("TP=2 host collectives on rank 0: prefill %d calls %.1f ms (%.0f%% of %.1f ms); decode %d calls %.1f ms (%.0f%% of %.1f ms, %.0f µs/token)",
		nPre, ms(commPre), 100*commPre.Seconds()/tPreH.Seconds(), ms(tPreH),
		nDec, ms(commDec), 100*commDec.Seconds()/tDecH.Seconds(), ms(tDecH), 1e6*commDec.Seconds()/float64(steps))
}

// prefillHost times reps prefills of prompt tokens, each from the call to
// the device finishing it, and how long the host takes to queue it (until
// Forward returns). With $QTOOL_TP_PROF set, the host's CPU profile of the
// prefills goes to $QTOOL_TP_PROF-name.
func prefillHost(t *testing.T, rm *runtime.Model, prompt, reps int, name string) (queue, whole time.Duration) {
	be := rm.Backend()
	sync, ok := be.(interface{ Sync() })
	if !ok {
		t.Fatalf("%s cannot be synchronized", be.Name())
	}
	ids := make([]int, prompt)
	for i := range ids {
		ids[i] = 3 + i%1000
	}
	if p := os.Getenv("QTOOL_TP_PROF"); p != "" {
		f, err := os.Create(p + "-" + name)
		if err != nil {
			t.Fatal(err)
		}
		defer f.Close()
		if err := pprof.StartCPUProfile(f); err != nil {
			t.Fatal(err)
		}
		defer pprof.StopCPUProfile()
	}
	for range reps {
		t0 := time.Now()
		lg := rm.Forward(ids, 0, nil)
		queue += time.Since(t0)
		sync.Sync()
		whole += time.Since(t0)
		be.Free(lg)
	}
	return queue / time.Duration(reps), whole / time.Duration(reps)
}

func us(d time.Duration) float64 { return float64(d.Nanoseconds()) / 1000 }

func ms(d time.Duration) float64 { return float64(d.Microseconds()) / 1000 }
