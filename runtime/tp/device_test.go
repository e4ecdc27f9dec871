package tp

import (
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"slices"
	"sync"
	"testing"
	"time"

	"qtool/runtime"
	"qtool/runtime/cpu"
	"qtool/runtime/runtimetest"
)

// memory stands in for device memory in the tests of the device paths:
// "device addresses" are ids of CPU buffers' slices.
type memory struct {
	mu   sync.Mutex
	next uint64
	ids  map[*float32]uint64
	bufs map[uint64][]float32
}

func newMemory() *memory {
	return &memory{next: 1, ids: map[*float32]uint64{}, bufs: map[uint64][]float32{}}
}

func (m *memory) addr(data []float32) uint64 {
	m.mu.Lock()
	defer m.mu.Unlock()
	k := &data[0]
	id, ok := m.ids[k]
	if !ok {
		id = m.next
		m.next++
		m.ids[k] = id
	}
	m.bufs[id] = data
	return id
}

func (m *memory) slice(id uint64, n int) []float32 {
	m.mu.Lock()
	defer m.mu.Unlock()
	b := m.bufs[id]
	if len(b) < n {
		panic(fmt.Sprintf("fake device: buffer %d has %d values, %d used", id, len(b), n))
	}
	return b[:n]
}

// fakeDevice is a CPU backend posing as a DeviceRank.
type fakeDevice struct {
	*cpu.Backend
	mem *memory
}

func (f fakeDevice) Stream() uintptr { return 0 }
func (f fakeDevice) BufPtr(x runtime.Buf) uint64 {
	return f.mem.addr(x.(*cpu.Mat).Data)
}
func (f fakeDevice) Do(fn func()) { fn() }
func (f fakeDevice) Sync()        {}
func (f fakeDevice) Copy2D(dst runtime.Buf, dr, dc int, src runtime.Buf, sr, sc, rows, cols int) {
	d, s := dst.(*cpu.Mat), src.(*cpu.Mat)
	for i := range rows {
		copy(d.Row(dr + i)[dc:dc+cols], s.Row(sr + i)[sc:sc+cols])
	}
}
func (f fakeDevice) EmbedRange(dst runtime.Buf, table runtime.Linear, ids []int, lo int) {
	local := make([]int, len(ids))
	for i, id := range ids {
		if id >= lo && id < lo+table.Out() {
			local[i] = id - lo
		}
	}
	f.Embed(dst, table, local)
	m := dst.(*cpu.Mat)
	for i, id := range ids {
		if id < lo || id >= lo+table.Out() {
			clear(m.Row(i))
		}
	}
}

// fakeComm adds device collectives (on memory) to an in-process
// communicator: sums in rank order, like InProcess.
type fakeComm struct {
	*InProcess
	mem *memory
}

func (c fakeComm) AllReduceSumDevice(bufs []uint64, count int, _ []uintptr) error {
	s := make([][]float32, len(bufs))
	for r, p := range bufs {
		s[r] = c.mem.slice(p, count)
	}
	for i := range count {
		v := s[0][i]
		for _, b := range s[1:] {
			v += b[i]
		}
		for _, b := range s {
			b[i] = v
		}
	}
	return nil
}

func (c fakeComm) AllGatherDevice(send, recv []uint64, count int, _ []uintptr) error {
	n := len(send)
	for r := range recv {
		out := c.mem.slice(recv[r], n*count)
		for j := range send {
			copy(out[j*count:(j+1)*count], c.mem.slice(send[j], count))
		}
	}
	return nil
}

func (c fakeComm) AllReduceSumDeviceRank(rank int, buf uint64, count int, _ uintptr) error {
	return c.AllReduceSum(rank, c.mem.slice(buf, count))
}

func (c fakeComm) AllGatherDeviceRank(rank int, send, recv uint64, count int, _ uintptr) error {
	return c.AllGather(rank, c.mem.slice(send, count), c.mem.slice(recv, c.Size()*count))
}

// fakeBackend is a TP=n backend of fake device ranks, with device
// collectives when deviceComm is set (else through host memory).
func fakeBackend(t testing.TB, rm *runtime.Model, n int, deviceComm bool) *Backend {
	t.Helper()
	mem := newMemory()
	ranks := make([]runtime.Backend, n)
	for r := range ranks {
		ranks[r] = fakeDevice{cpu.New(1), mem}
	}
	ip, err := NewInProcess(n)
	if err != nil {
		t.Fatal(err)
	}
	var comm Communicator = ip
	if deviceComm {
		comm = fakeComm{ip, mem}
	}
	be, err := New(rm.Config(), ranks, comm)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Close() })
	if be.workers == nil || be.DeviceCollectives() != deviceComm {
		t.Fatalf("fake device ranks: workers %v, device collectives %v", be.workers != nil, be.DeviceCollectives())
	}
	return be
}

// TestDevicePaths runs the paths taken with GPU ranks (worker goroutines,
// collectives and layout changes on device buffers) on CPU ranks posing as
// devices: logits, NLL and argmax of every prompt row equal the in-process
// TP=2 run (same summation order), and greedy decoding gives the
// reference's continuation.
func TestDevicePaths(t *testing.T) {
	for _, name := range models {
		for _, mode := range []string{"host-collectives", "device-grouped", "device-per-rank"} {
			t.Run(name+"/"+mode, func(t *testing.T) {
				ref := loadRef(t, name)
				m := openHF(t, name)
				host := load(t, m, tpBackend(t, m, 2))
				fb := fakeBackend(t, host, 2, mode != "host-collectives")
				fb.SetGroupedCollectives(mode == "device-grouped")
				if mode == "device-per-rank" && fb.grouped {
					t.Fatal("per-rank collectives not selected")
				}
				dev := load(t, m, fb)
				ids := ref.LogitsInputIDs
				want, got := logits(host, ids), logits(dev, ids)
				if !slices.Equal(got, want) {
					t.Errorf("logits differ from the in-process TP=2 run by %.3g", maxRel(got, want))
				}
				argmax := func(rm *runtime.Model) []int {
					out := rm.Forward(ids, 0, nil)
					defer rm.Backend().Free(out)
					return rm.Backend().Argmax(out)
				}
				if a, b := argmax(dev), argmax(host); !slices.Equal(a, b) {
					t.Errorf("argmax %v, want %v", a, b)
				}
				var cids []int
				runtimetest.ReadJSON(t, filepath.Join(testdata, name, "ids-sotu-test.raw.json"), &cids)
				opt := runtime.PPLOptions{MaxChunks: 1}
				p1, err := runtime.Perplexity(host, cids, opt)
				if err != nil {
					t.Fatal(err)
				}
				p2, err := runtime.Perplexity(dev, cids, opt)
				if err != nil {
					t.Fatal(err)
				}
				if math.Abs(p2.PPL-p1.PPL) > 1e-9*p1.PPL {
					t.Errorf("ppl %.9f, in-process TP=2 %.9f", p2.PPL, p1.PPL)
				}
				checkGreedy(t, dev, ref, 8)
			})
		}
	}
}

// TestDeviceLayouts converts between layouts on fake device ranks (the
// device slicing of toSplit, uneven and even all-gathers, a rank's panic
// re-raised in the caller) and compares with the values uploaded.
func TestDeviceLayouts(t *testing.T) {
	m := openHF(t, "qwen3-mini")
	host := load(t, m, tpBackend(t, m, 2))
	be := fakeBackend(t, host, 2, true)
	tests := []struct {
		name       string
		rows, cols int
		split      [][2]int
	}{
		{"uneven", 5, 768, [][2]int{{0, 300}, {300, 768}}},
		{"even", 5, 768, [][2]int{{0, 384}, {384, 768}}},
		{"even-one-row", 1, 768, [][2]int{{0, 384}, {384, 768}}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			a := make([]float32, tc.rows*tc.cols)
			for i := range a {
				a[i] = float32(i%97) - 48.5
			}
			x := be.Alloc(tc.rows, tc.cols).(*Buf)
			defer be.Free(x)
			be.Upload(x, a)
			be.toSplit(x, tc.split)
			got := make([]float32, len(a))
			be.Download(got, x)
			if !slices.Equal(got, a) {
				t.Fatal("split download differs")
			}
			be.replicate(x)
			for r := range 2 {
				be.ranks[r].Download(got, x.parts[r])
				if !slices.Equal(got, a) {
					t.Fatalf("rank %d after the all-gather differs", r)
				}
			}
		})
	}
	func() {
		defer func() {
			if p := recover(); p == nil || !slices.Contains([]string{"tp rank 1: boom"}, fmt.Sprint(p)) {
				t.Errorf("panic %v, want tp rank 1: boom", p)
			}
		}()
		be.each(func(r int) {
			if r == 1 {
				panic("boom")
			}
		})
	}()
}

// TestRankPanicAborts: a rank that panics before a collective the others
// have entered aborts the in-process communicator, so they return instead
// of waiting for it forever, and the caller gets the failing rank's panic
// (not the others' "aborted"), with CPU ranks (a goroutine each) and device
// ranks (persistent workers); later collectives fail at once.
func TestRankPanicAborts(t *testing.T) {
	m := openHF(t, "llama-mini")
	host := load(t, m, tpBackend(t, m, 2))
	for _, mode := range []string{"goroutines", "workers"} {
		for _, failing := range []int{0, 1} {
			t.Run(fmt.Sprintf("%s/rank=%d", mode, failing), func(t *testing.T) {
				be := tpBackend(t, m, 2)
				if mode == "workers" {
					be = fakeBackend(t, host, 2, false)
				}
				got := make(chan any, 1)
				go func() {
					defer func() { got <- recover() }()
					be.each(func(r int) {
						if r == failing {
							panic("boom")
						}
						if err := be.comm.AllReduceSum(r, []float32{1, 2}); err != nil {
							panic(err)
						}
					})
				}()
				select {
				case p := <-got:
					if want := fmt.Sprintf("tp rank %d: boom", failing); fmt.Sprint(p) != want {
						t.Errorf("panic %v, want %q", p, want)
					}
				case <-time.After(30 * time.Second):
					t.Fatalf("rank %d panicked and the other still waits in the all-reduce", failing)
				}
				if err := be.comm.AllReduceSum(0, []float32{1}); !errors.Is(err, ErrAborted) {
					t.Errorf("an all-reduce after the abort: %v, want ErrAborted", err)
				}
			})
		}
	}
}
