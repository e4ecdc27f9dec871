package tp

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"qtool/runtime"
	"qtool/runtime/cpu"
	"qtool/runtime/runtimetest"
)

// fakePeer is a fake device rank with an all-reduce over "peer memory": the
// group's sums go through an in-process communicator (rank order, as the
// kernel sums), counted.
type fakePeer struct {
	fakeDevice
	group       *InProcess
	rank, world int
	calls       *atomic.Int64
	failOpen    bool // OpenPeerReduce fails
	failConnect bool // ConnectPeerReduce fails
	open        bool
}

func (f *fakePeer) OpenPeerReduce(rank, world, capFloats int, timeout time.Duration) ([]byte, error) {
	if f.failOpen {
		return nil, errors.New("no peer memory here")
	}
	f.rank, f.world, f.open = rank, world, true
	end := []byte{'p', byte(rank), 7, 7, 7}
	return end, nil
}

func (f *fakePeer) ConnectPeerReduce(ends [][]byte) error {
	if len(ends) != f.world {
		return fmt.Errorf("%d ends for %d ranks", len(ends), f.world)
	}
	for r, e := range ends {
		if len(e) != 5 || e[0] != 'p' || int(e[1]) != r {
			return fmt.Errorf("end %d is not rank %d's: %q", r, r, e)
		}
	}
	if f.failConnect {
		return errors.New("cannot map the peers")
	}
	return nil
}

func (f *fakePeer) ClosePeerReduce() error { f.open = false; return nil }

func (f *fakePeer) FillBits(x runtime.Buf, bits uint32) {
	d := x.(*cpu.Mat).Data
	for i := range d {
		d[i] = math.Float32frombits(bits)
	}
}

func (f *fakePeer) AllReducePeer(x runtime.Buf) {
	if !f.open {
		panic("AllReducePeer outside the group")
	}
	f.calls.Add(1)
	if err := f.group.AllReduceSum(f.rank, x.(*cpu.Mat).Data); err != nil {
		panic(err)
	}
}

// peerBackend is fakeBackend with fakePeer ranks.
func peerBackend(t testing.TB, rm *runtime.Model, n int, calls *atomic.Int64) (*Backend, []*fakePeer) {
	t.Helper()
	mem := newMemory()
	group, _ := NewInProcess(n)
	ranks := make([]runtime.Backend, n)
	peers := make([]*fakePeer, n)
	for r := range ranks {
		peers[r] = &fakePeer{fakeDevice: fakeDevice{cpu.New(1), mem}, group: group, calls: calls}
		ranks[r] = peers[r]
	}
	ip, _ := NewInProcess(n)
	be, err := New(rm.Config(), ranks, fakeComm{ip, mem})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Close() })
	return be, peers
}

// TestPeerMemory: with the all-reduces over peer memory the logits equal
// the in-process TP=2 run's bit for bit; the small ones (a decode step,
// the embedding of a few ids) take the peer path and the larger ones the
// device communicator, by the limit.
func TestPeerMemory(t *testing.T) {
	m := openHF(t, "llama-mini")
	ref := loadRef(t, "llama-mini")
	host := load(t, m, tpBackend(t, m, 2))
	ids := ref.LogitsInputIDs
	want := logits(host, ids)
	H := m.Config.Hidden
	for _, tc := range []struct {
		name      string
		limit     int // bytes
		peerCalls bool
	}{
		{"all", len(ids) * H * 4, true},
		{"below-the-prompt", len(ids)*H*4 - 4, false},
		{"off", 0, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var calls atomic.Int64
			be, _ := peerBackend(t, host, 2, &calls)
			if err := be.UsePeerMemory(len(ids)*H*4, time.Minute); err != nil {
				t.Fatal(err)
			}
			if !strings.Contains(be.Name(), "peer memory") {
				t.Errorf("Name %q does not say peer memory", be.Name())
			}
			be.SetPeerLimit(tc.limit)
			dev := load(t, m, be)
			calls.Store(0)
			if got := logits(dev, ids); !slices.Equal(got, want) {
				t.Errorf("logits differ from the in-process TP=2 run by %.3g", maxRel(got, want))
			}
			// 2 all-reduces a layer and the embedding's, on each rank
			if n, all := calls.Load(), int64(2*(2*m.Config.Layers+1)); (n == all) != tc.peerCalls || (n != 0 && n != all) {
				t.Errorf("%d all-reduces over peer memory, want %v of %d", n, tc.peerCalls, all)
			}
			calls.Store(0)
			checkGreedy(t, dev, ref, 4)
			if tc.limit > 0 && calls.Load() == 0 {
				t.Error("no decode step's all-reduce over peer memory")
			}
		})
	}
}

// TestPeerMemoryErrors: a rank that cannot join leaves every rank on the
// device communicator, in one process and with a process per rank (the
// ends exchanged and the failure agreed through the communicator).
func TestPeerMemoryErrors(t *testing.T) {
	m := openHF(t, "llama-mini")
	host := load(t, m, tpBackend(t, m, 2))
	for _, fail := range []string{"open", "connect"} {
		t.Run("one-process/"+fail, func(t *testing.T) {
			var calls atomic.Int64
			be, peers := peerBackend(t, host, 2, &calls)
			peers[1].failOpen, peers[1].failConnect = fail == "open", fail == "connect"
			if err := be.UsePeerMemory(1<<20, time.Minute); err == nil {
				t.Fatal("no error")
			}
			if be.PeerMemory(1) || peers[0].open {
				t.Error("a rank stayed in the group")
			}
		})
		t.Run("processes/"+fail, func(t *testing.T) {
			errs, bes, peers := peerProcesses(t, host, fail == "open", fail == "connect")
			for r, err := range errs {
				if err == nil || bes[r].PeerMemory(1) || peers[r].open {
					t.Errorf("rank %d: error %v, still in the group %v", r, err, peers[r].open)
				}
			}
		})
	}
	t.Run("processes/ok", func(t *testing.T) {
		errs, bes, _ := peerProcesses(t, host, false, false)
		for r, err := range errs {
			if err != nil || !bes[r].PeerMemory(1) {
				t.Errorf("rank %d: %v", r, err)
			}
		}
	})
	t.Run("no-device-collectives", func(t *testing.T) {
		be := fakeBackend(t, host, 2, false)
		if err := be.UsePeerMemory(1<<20, time.Minute); err == nil {
			t.Error("no error without device collectives")
		}
	})
}

// peerProcesses runs UsePeerMemory on two backends of one rank each, as
// processes of a job make them (NewRank, one communicator between them),
// rank 1 failing to open or to connect as asked, and returns each rank's
// error.
func peerProcesses(t *testing.T, host *runtime.Model, failOpen, failConnect bool) ([]error, []*Backend, []*fakePeer) {
	ip, _ := NewInProcess(2)
	group, _ := NewInProcess(2)
	mem := newMemory()
	var calls atomic.Int64
	errs := make([]error, 2)
	bes := make([]*Backend, 2)
	peers := make([]*fakePeer, 2)
	var wg sync.WaitGroup
	for r := range 2 {
		peers[r] = &fakePeer{fakeDevice: fakeDevice{cpu.New(1), mem}, group: group, calls: &calls,
			failOpen: r == 1 && failOpen, failConnect: r == 1 && failConnect}
		be, err := NewRank(host.Config(), 2, r, peers[r], fakeComm{ip, mem})
		if err != nil {
			t.Fatal(err)
		}
		bes[r] = be
		t.Cleanup(func() { be.Close() })
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = be.UsePeerMemory(1<<20, time.Minute)
		}()
	}
	wg.Wait()
	return errs, bes, peers
}

// nanFusing is a fusing CPU rank (fusingCPU) and nanDevice a fake device
// rank whose AllocRaw hands out buffers full of NaN: a rank buffer read
// before it is written shows in every logit.
type (
	nanFusing struct{ fusingCPU }
	nanDevice struct{ fakeDevice }
)

func (p nanFusing) AllocRaw(rows, cols int) runtime.Buf {
	return runtimetest.AllocNaN(p.Backend, rows, cols)
}

func (p nanDevice) AllocRaw(rows, cols int) runtime.Buf {
	return runtimetest.AllocNaN(p.Backend, rows, cols)
}

// TestRawRankBuffers: the rank buffers of AllocRaw activations (and those
// of the layout changes, written whole) are not zeroed; with NaN in them
// the logits (and their rows' argmax, all-gathered) equal those of zeroed
// ones bit for bit, on fusing ranks with
// host collectives and on device ranks with device collectives, and the
// greedy ids are the reference's.
func TestRawRankBuffers(t *testing.T) {
	for _, name := range models {
		for _, device := range []bool{false, true} {
			t.Run(fmt.Sprintf("%s/device=%v", name, device), func(t *testing.T) {
				ref := loadRef(t, name)
				m := openHF(t, name)
				run := func(nan bool) ([]float32, *runtime.Model) {
					mem := newMemory()
					var calls atomic.Int64
					ranks := make([]runtime.Backend, 2)
					for r := range ranks {
						switch f, d := (fusingCPU{cpu.New(1), &calls}), (fakeDevice{cpu.New(1), mem}); {
						case device && nan:
							ranks[r] = nanDevice{d}
						case device:
							ranks[r] = d
						case nan:
							ranks[r] = nanFusing{f}
						default:
							ranks[r] = f
						}
					}
					ip, _ := NewInProcess(2)
					var comm Communicator = ip
					if device {
						comm = fakeComm{ip, mem}
					}
					be, err := New(m.Config, ranks, comm)
					if err != nil {
						t.Fatal(err)
					}
					t.Cleanup(func() { be.Close() })
					if be.fused == device || be.DeviceCollectives() != device {
						t.Fatalf("fused %v, device collectives %v", be.fused, be.DeviceCollectives())
					}
					rm := load(t, m, be)
					lg := logits(rm, ref.LogitsInputIDs)
					out := rm.Forward(ref.LogitsInputIDs, 0, nil) // the all-gather of every row
					defer be.Free(out)
					for _, id := range be.Argmax(out) {
						lg = append(lg, float32(id))
					}
					return lg, rm
				}
				want, _ := run(false)
				got, rm := run(true)
				for i := range want {
					if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
						t.Fatalf("logit %d: %g with NaN in the raw rank buffers, %g with zeros", i, got[i], want[i])
					}
				}
				w := ref.GreedyIDs[len(ref.GreedyPromptIDs):][:8]
				gen, err := runtime.Generate(rm, ref.GreedyPromptIDs, runtime.GenOptions{MaxNew: len(w), EOS: []int{}})
				if err != nil || !slices.Equal(gen, w) {
					t.Errorf("greedy %v (%v), reference %v", gen, err, w)
				}
			})
		}
	}
}

// TestPeerReplicate: a split single row (a decode step's logits) is
// all-gathered over peer memory, each rank's piece in a row of −0 that the
// group sums (replicatePeer), and every value keeps its bits on every rank:
// ±0, infinities, subnormals, even and uneven splits. Rows of more go
// through the device communicator.
func TestPeerReplicate(t *testing.T) {
	m := openHF(t, "llama-mini")
	host := load(t, m, tpBackend(t, m, 2))
	special := []float32{float32(math.Copysign(0, -1)), 0, float32(math.Inf(1)), float32(math.Inf(-1)),
		math.Float32frombits(1), -math.Float32frombits(1), math.MaxFloat32, -1.5, 2.25}
	for _, tc := range []struct {
		name  string
		rows  int
		split [][2]int
		peer  bool
	}{
		{"even", 1, [][2]int{{0, 384}, {384, 768}}, true},
		{"uneven", 1, [][2]int{{0, 300}, {300, 768}}, true},
		{"rows", 5, [][2]int{{0, 384}, {384, 768}}, false},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var calls atomic.Int64
			be, _ := peerBackend(t, host, len(tc.split), &calls)
			if err := be.UsePeerMemory(1<<20, time.Minute); err != nil {
				t.Fatal(err)
			}
			a := make([]float32, tc.rows*768)
			for i := range a {
				a[i] = special[i%len(special)] * float32(1+i%5)
			}
			x := be.Alloc(tc.rows, 768).(*Buf)
			defer be.Free(x)
			be.Upload(x, a)
			be.toSplit(x, tc.split)
			calls.Store(0)
			be.replicate(x)
			if got := calls.Load(); (got == int64(len(tc.split))) != tc.peer || (got != 0 && !tc.peer) {
				t.Errorf("%d all-reduces over peer memory, want one a rank: %v", got, tc.peer)
			}
			got := make([]float32, len(a))
			for r := range tc.split {
				be.ranks[r].Download(got, x.parts[r])
				for i := range a {
					if math.Float32bits(got[i]) != math.Float32bits(a[i]) {
						t.Fatalf("rank %d value %d: %g (%#x), want %g (%#x)", r, i, got[i], math.Float32bits(got[i]), a[i], math.Float32bits(a[i]))
					}
				}
			}
		})
	}
}

// fusingPeer is a fake peer-memory rank (fakePeer) that fuses (fusingCPU,
// over the fakePeer) and sends a block's products to the all-reduce itself
// (PeerSender's MLPAllReduce and AttentionAllReduce: the block's sequence,
// then AllReducePeer), counted in blocks; refuse makes it decline, as a
// backend that cannot does. Its MatMulAllReduce always declines.
type fusingPeer struct {
	fusingCPU
	*fakePeer
	refuse bool
	blocks *atomic.Int64
}

func (f fusingPeer) Sync() {}

func (f fusingPeer) MatMulAllReduce(dst, x runtime.Buf, w runtime.Linear, add bool) bool {
	return false
}

// sum is the end of a block: the product of x and w into dst (added where
// add is set), then AllReducePeer.
func (f fusingPeer) sum(dst, x runtime.Buf, w runtime.Linear, add bool) {
	if add {
		f.fusingCPU.MatMulAdd(dst, x, w)
	} else {
		f.MatMul(dst, x, w)
	}
	f.AllReducePeer(dst)
}

func (f fusingPeer) MLPAllReduce(x runtime.Buf, w, bias runtime.Vector, eps float32, gate, up, down runtime.Linear, add bool) bool {
	if f.refuse {
		return false
	}
	f.blocks.Add(1)
	g := f.Alloc(x.Rows(), gate.Out())
	f.fusingCPU.NormSwiGLU(g, x, w, bias, eps, gate, up)
	f.sum(x, g, down, add)
	f.Free(g)
	return true
}

func (f fusingPeer) AttentionAllReduce(x, q runtime.Buf, c runtime.KVCache, layer, pos0, heads, kvHeads, headDim int, o runtime.Linear, add bool) bool {
	if f.refuse {
		return false
	}
	f.blocks.Add(1)
	a := f.Alloc(q.Rows(), q.Cols())
	f.Attention(a, q, c, layer, pos0, heads, kvHeads, headDim)
	f.sum(x, a, o, add)
	f.Free(a)
	return true
}

// TestPeerBlocks: over peer memory the fused TP backend runs a prefill's
// attention and MLP blocks on each rank as one call each that ends in the
// all-reduce (AttentionAllReduce, MLPAllReduce), and the logits equal
// those of fusing ranks without peer memory bit for bit — also where one
// rank declines and runs the blocks' sequences and AllReducePeer itself
// (the ranks may choose differently). Decode rows keep the sequences, and
// greedy decoding gives the reference's ids.
func TestPeerBlocks(t *testing.T) {
	m := openHF(t, "llama-mini")
	ref := loadRef(t, "llama-mini")
	ids := ref.LogitsInputIDs
	var calls atomic.Int64
	want := logits(load(t, m, fusingTP(t, m, &calls)), ids)
	for _, refuse := range []int{-1, 0, 1} { // rank 0 declining runs the residual add's sequence itself
		t.Run(fmt.Sprintf("rank-declining=%d", refuse), func(t *testing.T) {
			var fused, peerCalls, blocks atomic.Int64
			mem := newMemory()
			group, _ := NewInProcess(2)
			ranks := make([]runtime.Backend, 2)
			for r := range ranks {
				p := &fakePeer{fakeDevice: fakeDevice{cpu.New(1), mem}, group: group, calls: &peerCalls}
				ranks[r] = fusingPeer{fusingCPU{p, &fused}, p, r == refuse, &blocks}
			}
			ip, _ := NewInProcess(2)
			be, err := New(m.Config, ranks, fakeComm{ip, mem})
			if err != nil {
				t.Fatal(err)
			}
			t.Cleanup(func() { be.Close() })
			if err := be.UsePeerMemory(len(ids)*m.Config.Hidden*4, time.Minute); err != nil {
				t.Fatal(err)
			}
			dev := load(t, m, be)
			if got := logits(dev, ids); !slices.Equal(got, want) {
				t.Errorf("logits differ from fusing ranks without peer memory by %.3g", maxRel(got, want))
			}
			// two blocks a layer on each rank that sends
			sent := int64(2 * 2 * m.Config.Layers)
			if refuse >= 0 {
				sent /= 2
			}
			if n := blocks.Load(); n != sent {
				t.Errorf("%d blocks sent their products, want %d (%d layers)", n, sent, m.Config.Layers)
			}
			blocks.Store(0)
			checkGreedy(t, dev, ref, 4)
			if n := blocks.Load(); n != sent {
				t.Errorf("%d blocks sent while generating, want %d (the prompt's alone, not the decode rows')", n, sent)
			}
		})
	}
}
