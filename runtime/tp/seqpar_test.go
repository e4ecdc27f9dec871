package tp

import (
	"math"
	"path/filepath"
	"sync/atomic"
	"testing"
	"time"

	"qtool/formats/model"
	"qtool/runtime"
	"qtool/runtime/cpu"
	"qtool/runtime/runtimetest"
)

// scatterPeer is a fake peer-memory rank (fusingPeer, declining its
// blocks so that the all-reduce path runs the sequences and AllReducePeer)
// with sequence-parallel exchanges, for testing this package's side of
// them in CI: the exchanges move whole matrices through an in-process
// communicator of their own and sum, norm and multiply with the rank's
// backend in the order the CUDA kernels do (the residual, then the ranks'
// partials in rank order; the norm and products of the gathered rows as
// RMSNorm and MatMul give them).
type scatterPeer struct {
	fusingPeer
	ex         *InProcess
	partial    []float32 // the sent partials of the exchange due, whole
	gathered   []float32 // the last ExchangeNorm's normed rows, whole
	rows, cols int       // gathered's shape
}

var _ PeerScatterer = (*scatterPeer)(nil)

// seqOwnRows is the CUDA backend's ownRows: rank r owns the rows of the
// 128-row tiles [r·T/world, (r+1)·T/world).
func seqOwnRows(rank, world, M int) (int, int) {
	T := (M + 127) / 128
	row := func(r int) int { return min(M, 128*(r*T/world)) }
	return row(rank), row(rank + 1)
}

func (f *scatterPeer) download(x runtime.Buf) []float32 {
	v := make([]float32, x.Rows()*x.Cols())
	f.Download(v, x)
	return v
}

func (f *scatterPeer) upload(rows, cols int, v []float32) runtime.Buf {
	x := f.Alloc(rows, cols)
	f.Upload(x, v)
	return x
}

// allGather returns every rank's v, in rank order.
func (f *scatterPeer) allGather(v []float32) []float32 {
	all := make([]float32, f.world*len(v))
	if err := f.ex.AllGather(f.rank, v, all); err != nil {
		panic(err)
	}
	return all
}

func (f *scatterPeer) CanScatter(w runtime.Linear, rows int) bool   { return rows > 128*(f.world-1) }
func (f *scatterPeer) CanGather(ws []runtime.Linear, rows int) bool { return true }

// send makes p (freed) the partials of the exchange due.
func (f *scatterPeer) send(p runtime.Buf) {
	f.partial = f.download(p)
	f.Free(p)
}

func (f *scatterPeer) AttentionScatter(x, q runtime.Buf, c runtime.KVCache, layer, pos0, heads, kvHeads, headDim int, o runtime.Linear) {
	a := runtime.AllocRaw(f, q.Rows(), q.Cols())
	f.Attention(a, q, c, layer, pos0, heads, kvHeads, headDim)
	p := runtime.AllocRaw(f, x.Rows(), o.Out())
	f.MatMul(p, a, o)
	f.Free(a)
	f.send(p)
}

func (f *scatterPeer) MLPScatter(x runtime.Buf, gate, up, down runtime.Linear) {
	h := f.upload(f.rows, f.cols, f.gathered)
	g, u := runtime.AllocRaw(f, f.rows, gate.Out()), runtime.AllocRaw(f, f.rows, up.Out())
	f.MatMul(g, h, gate)
	f.MatMul(u, h, up)
	f.SiLUMul(g, g, u)
	p := runtime.AllocRaw(f, x.Rows(), down.Out())
	f.MatMul(p, g, down)
	f.Free(h)
	f.Free(g)
	f.Free(u)
	f.send(p)
}

// sum adds the partials of the rows this rank owns to x and returns x's
// values (valid at those rows).
func (f *scatterPeer) sum(x runtime.Buf) []float32 {
	if f.partial == nil {
		panic("scatterPeer: an exchange with no partials sent")
	}
	v, n := f.download(x), x.Rows()*x.Cols()
	all := f.allGather(f.partial)
	r0, r1 := seqOwnRows(f.rank, f.world, x.Rows())
	for i := r0 * x.Cols(); i < r1*x.Cols(); i++ {
		s := v[i]
		for p := range f.world {
			s += all[p*n+i]
		}
		v[i] = s
	}
	f.Upload(x, v)
	f.partial = nil
	return v
}

func (f *scatterPeer) ExchangeSum(x runtime.Buf) { f.sum(x) }

func (f *scatterPeer) ExchangeNorm(x runtime.Buf, w, bias runtime.Vector, eps float32) {
	v := f.sum(x)
	M, N := x.Rows(), x.Cols()
	r0, r1 := seqOwnRows(f.rank, f.world, M)
	mine := make([]float32, M*N)
	if r1 > r0 {
		own := f.upload(r1-r0, N, v[r0*N:r1*N])
		h := runtime.AllocRaw(f, r1-r0, N)
		f.RMSNorm(h, own, w, bias, eps)
		copy(mine[r0*N:], f.download(h))
		f.Free(own)
		f.Free(h)
	}
	f.gathered, f.rows, f.cols = f.rowsOfOwners(mine, M, N), M, N
}

// rowsOfOwners puts together every rank's own rows of its mine.
func (f *scatterPeer) rowsOfOwners(mine []float32, M, N int) []float32 {
	all := f.allGather(mine)
	out := make([]float32, M*N)
	for p := range f.world {
		a, z := seqOwnRows(p, f.world, M)
		copy(out[a*N:z*N], all[p*M*N+a*N:p*M*N+z*N])
	}
	return out
}

func (f *scatterPeer) GatherOwned(x runtime.Buf) {
	f.Upload(x, f.rowsOfOwners(f.download(x), x.Rows(), x.Cols()))
}

func (f *scatterPeer) ProductsGathered(dst []runtime.Buf, ws []runtime.Linear) {
	h := f.upload(f.rows, f.cols, f.gathered)
	for i, w := range ws {
		f.MatMul(dst[i], h, w)
	}
	f.Free(h)
}

// scatterTP is a tensor-parallel backend of two CPU ranks (fake devices)
// whose exchanges go over scatterPeers in a peer-memory group of up to
// limit values: the all-reduces of o and down through AllReducePeer, or
// sequence-parallel.
func scatterTP(t *testing.T, m *model.Model, limit int) *Backend {
	t.Helper()
	var fused, peerCalls, blocks atomic.Int64
	mem := newMemory()
	group, _ := NewInProcess(2)
	ex, _ := NewInProcess(2)
	ranks := make([]runtime.Backend, 2)
	for r := range ranks {
		p := &fakePeer{fakeDevice: fakeDevice{cpu.New(1), mem}, group: group, calls: &peerCalls}
		ranks[r] = &scatterPeer{fusingPeer: fusingPeer{fusingCPU{p, &fused}, p, true, &blocks}, ex: ex}
	}
	ip, _ := NewInProcess(2)
	b, err := New(m.Config, ranks, fakeComm{ip, mem})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { b.Close() })
	if err := b.UsePeerMemory(4*limit, time.Minute); err != nil {
		t.Fatal(err)
	}
	return b
}

// TestSequenceParallel runs a prefill of 600 tokens over two CPU ranks with
// fake peer-memory ranks, with the sequence-parallel exchanges and without
// (all-reduces over AllReducePeer): the logits must be equal bit for bit,
// every layer's three operations but the first norm's must take the
// exchanges, and nothing may be left split by rows. Then a buffer left
// split is settled by its reader after the exchanges were turned off.
func TestSequenceParallel(t *testing.T) {
	for _, name := range []string{"llama-mini", "qwen3-mini"} {
		t.Run(name, func(t *testing.T) {
			m := openHF(t, name)
			var ids []int
			runtimetest.ReadJSON(t, filepath.Join(testdata, name, "ids-sotu-test.raw.json"), &ids)
			ids = ids[:600]
			b := scatterTP(t, m, len(ids)*m.Config.Hidden)
			rm := load(t, m, b)
			b.SetSequenceParallel(false)
			want := logits(rm, ids)
			if c := b.SequenceParallelCalls(); c != 0 {
				t.Fatalf("%d sequence-parallel operations with the exchanges off", c)
			}
			b.SetSequenceParallel(true)
			got := logits(rm, ids)
			if c, w := b.SequenceParallelCalls(), 3*m.Config.Layers-1; c != w {
				t.Errorf("%d sequence-parallel operations, want %d (3 a layer but the first norm)", c, w)
			}
			if b.seqBuf != nil {
				t.Error("a buffer is left split by rows after the forward pass")
			}
			for i := range want {
				if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
					t.Fatalf("logit %d: %v with the exchanges, %v with all-reduces", i, got[i], want[i])
				}
			}
			short := logits(rm, ids[:100]) // rows ≤ 128: no rank would own a tile
			if c, w := b.SequenceParallelCalls(), 3*m.Config.Layers-1; c != w {
				t.Errorf("a 100-token prefill took the exchanges (%d operations, want still %d)", c, w)
			}
			if len(short) != 100*m.Config.Vocab {
				t.Fatalf("%d logits", len(short))
			}
		})
	}
	t.Run("settle after off", func(t *testing.T) {
		m := openHF(t, "llama-mini")
		const M, N = 300, 64
		b := scatterTP(t, m, M*N)
		x := b.Alloc(M, N)
		v := make([]float32, M*N)
		for i := range v {
			v[i] = float32(i%97) / 7
		}
		b.Upload(x, v)
		xs := rawBuf(x)
		partials := make([][]float32, 2)
		for r := range partials {
			partials[r] = make([]float32, M*N)
			for i := range partials[r] {
				partials[r][i] = float32((i*(r+3))%89) / 11
			}
		}
		b.each(func(r int) { b.peer[r].(*scatterPeer).partial = partials[r] })
		b.leave(xs, seqSent)
		b.SetSequenceParallel(false)
		got := make([]float32, M*N)
		b.Download(got, x) // settles: the sums due, then the rows gathered
		for i := range v {
			if w := (v[i] + partials[0][i]) + partials[1][i]; math.Float32bits(got[i]) != math.Float32bits(w) {
				t.Fatalf("value %d: %v, want %v", i, got[i], w)
			}
		}
		if xs.seq != seqWhole || b.seqBuf != nil {
			t.Errorf("after Download: state %d, split buffer %v", xs.seq, b.seqBuf != nil)
		}
		b.Free(x)
	})
}
