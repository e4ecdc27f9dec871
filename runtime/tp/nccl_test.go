package tp

import (
	"errors"
	"fmt"
	goruntime "runtime"
	"slices"
	"sync"
	"syscall"
	"testing"
	"time"
	"unsafe"

	"qtool/runtime"
	"qtool/runtime/cpu"
	"qtool/runtime/cuda/driver"
)

func TestLoadNCCLMissing(t *testing.T) {
	t.Setenv("QTOOL_NCCL", "/nonexistent/libnccl.so.2")
	if _, err := LoadNCCL(); !errors.Is(err, ErrNoNCCL) {
		t.Fatalf("err = %v, want ErrNoNCCL", err)
	}
}

// ncclDevices returns up to want GPU ordinals, skipping the test when NCCL
// or the CUDA driver is absent.
func ncclDevices(t *testing.T, want int) []int {
	t.Helper()
	lib, err := LoadNCCL()
	if err != nil {
		t.Skipf("no NCCL: %v", err)
	}
	drv, err := driver.Open()
	if err != nil {
		t.Skipf("no CUDA driver: %v", err)
	}
	n, err := drv.DeviceCount()
	if err != nil || n == 0 {
		t.Skipf("no GPU (%v)", err)
	}
	v, _ := lib.Version()
	t.Logf("NCCL %d from %s, %d GPUs", v, lib.Path, n)
	devs := make([]int, min(n, want))
	for i := range devs {
		devs[i] = i
	}
	return devs
}

// TestNCCLCollectives runs the NCCL communicator's all-reduce and
// all-gather with one goroutine per GPU against plain sums, at a size
// within the staging buffers connect made and at one that grows them
// (the outgrown buffers kept until Close: a free may wait for the peer
// GPUs, where another rank's collective may be waiting).
func TestNCCLCollectives(t *testing.T) {
	devs := ncclDevices(t, 8)
	c, err := NewNCCLCommunicator(devs)
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	n := len(devs)
	for _, L := range []int{3000, connectFloats * (n + 2)} {
		bufs := make([][]float32, n)
		want := make([]float32, L)
		for r := range bufs {
			bufs[r] = make([]float32, L)
			for i := range bufs[r] {
				bufs[r][i] = float32((i*7+r*13)%101) / 8 // exact in float32 sums
				want[i] += bufs[r][i]
			}
		}
		sends := make([][]float32, n)
		recvs := make([][]float32, n)
		errs := make([]error, 2*n)
		var wg sync.WaitGroup
		for r := 0; r < n; r++ {
			sends[r] = slices.Clone(bufs[r][:5])
			recvs[r] = make([]float32, 5*n)
			wg.Add(1)
			go func() {
				defer wg.Done()
				errs[r] = c.AllReduceSum(r, bufs[r])
				errs[n+r] = c.AllGather(r, sends[r], recvs[r])
			}()
		}
		wg.Wait()
		if err := errors.Join(errs...); err != nil {
			t.Fatal(err)
		}
		for r := range bufs {
			if !slices.Equal(bufs[r], want) {
				t.Fatalf("%d values, rank %d: NCCL all-reduce differs from the sum", L, r)
			}
			if !slices.Equal(recvs[r], slices.Concat(sends...)) {
				t.Fatalf("%d values, rank %d: NCCL all-gather %v", L, r, recvs[r])
			}
			if grew := 4*uint64(L) > uint64(4*connectFloats*(1+n)); grew != (len(c.retired[r]) > 0) {
				t.Errorf("%d values, rank %d: %d outgrown staging buffers kept", L, r, len(c.retired[r]))
			}
		}
	}
}

// TestNCCLForward runs llama-mini at TP=2 with the collectives through NCCL
// on two GPUs and compares the logits with the in-process communicator.
func TestNCCLForward(t *testing.T) {
	devs := ncclDevices(t, 2)
	if len(devs) < 2 {
		t.Skip("needs 2 GPUs")
	}
	comm, err := NewNCCLCommunicator(devs)
	if err != nil {
		t.Fatal(err)
	}
	m := openHF(t, "llama-mini")
	ref := loadRef(t, "llama-mini")
	be, err := New(m.Config, []runtime.Backend{cpu.New(2), cpu.New(2)}, comm)
	if err != nil {
		t.Fatal(err)
	}
	defer be.Close()
	got := logits(load(t, m, be), ref.LogitsInputIDs)
	want := logits(load(t, m, tpBackend(t, m, 2)), ref.LogitsInputIDs)
	rel := maxRel(got, want)
	t.Logf("NCCL TP=2 vs in-process TP=2: max rel %.3g (identical: %v)", rel, slices.Equal(got, want))
	if rel > 1e-6 {
		t.Errorf("NCCL TP=2 logits differ by %.3g", rel)
	}
}

// TestNCCLCommInitRank exercises the multi-process rendezvous calls
// (GetUniqueID once, CommInitRank on every rank with that id) with one
// goroutine per GPU standing in for one process per GPU, and an all-reduce
// on device memory.
func TestNCCLCommInitRank(t *testing.T) {
	devs := ncclDevices(t, 2)
	lib, err := LoadNCCL()
	if err != nil {
		t.Fatal(err)
	}
	drv, err := driver.Open()
	if err != nil {
		t.Fatal(err)
	}
	id, err := lib.GetUniqueID()
	if err != nil {
		t.Fatal(err)
	}
	n := len(devs)
	const L = 64
	out := make([][]float32, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r := 0; r < n; r++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = func() error {
				goruntime.LockOSThread()
				defer goruntime.UnlockOSThread()
				dev, err := drv.Device(devs[r])
				if err != nil {
					return err
				}
				ctx, err := drv.PrimaryCtxRetain(dev)
				if err != nil {
					return err
				}
				defer drv.PrimaryCtxRelease(dev)
				if err := drv.SetCurrent(ctx); err != nil {
					return err
				}
				comm, err := lib.CommInitRank(n, id, r)
				if err != nil {
					return err
				}
				defer lib.Destroy(comm)
				cnt, rank, err := lib.CountAndRank(comm)
				if err != nil {
					return err
				}
				if cnt != n || rank != r {
					return fmt.Errorf("communicator says rank %d of %d, want %d of %d", rank, cnt, r, n)
				}
				buf := make([]float32, L)
				for i := range buf {
					buf[i] = float32((r + 1) * i)
				}
				d, err := drv.MemAlloc(4 * L)
				if err != nil {
					return err
				}
				defer drv.MemFree(d)
				if err := drv.MemcpyHtoD(d, unsafe.Pointer(&buf[0]), 4*L); err != nil {
					return err
				}
				if err := lib.AllReduceSum(uint64(d), uint64(d), L, comm, 0); err != nil {
					return err
				}
				if err := drv.CtxSynchronize(); err != nil {
					return err
				}
				if err := drv.MemcpyDtoH(unsafe.Pointer(&buf[0]), d, 4*L); err != nil {
					return err
				}
				out[r] = buf
				return nil
			}()
		}()
	}
	wg.Wait()
	if err := errors.Join(errs...); err != nil {
		t.Fatal(err)
	}
	sum := n * (n + 1) / 2
	for r := range out {
		for i, v := range out[r] {
			if v != float32(sum*i) {
				t.Fatalf("rank %d: [%d] = %v, want %d", r, i, v, sum*i)
			}
		}
	}
}

// TestNCCLGroupOneThread checks that a group's calls all come from one OS
// thread: NCCL keeps a group open per thread, so a goroutine that moves
// between ncclGroupStart and ncclGroupEnd issues its collectives outside
// the group (with several ranks in one process, the first waits for ranks
// this thread has yet to launch: a hang) and ends a group it never opened
// (ncclInvalidUsage, as a TP=2 run in one process once failed "connecting
// the ranks"). A fake library records the thread of every call while other
// goroutines keep the scheduler busy, so an unlocked group moves.
func TestNCCLGroupOneThread(t *testing.T) {
	var mu sync.Mutex
	var tids []int
	record := func() int32 {
		mu.Lock()
		tids = append(tids, syscall.Gettid())
		mu.Unlock()
		goruntime.Gosched() // give the scheduler a chance to move this goroutine
		return 0
	}
	lib := fakeCollectives(record, func(string, uintptr) int32 { return record() })
	const ranks = 4
	c := &NCCLCommunicator{lib: lib, world: ranks, global: []int{0, 1, 2, 3}, comms: make([]Comm, ranks)}
	stop := make(chan struct{})
	var busy sync.WaitGroup
	for range 2 * goruntime.GOMAXPROCS(0) {
		busy.Add(1)
		go func() {
			defer busy.Done()
			for {
				select {
				case <-stop:
					return
				default:
					goruntime.Gosched()
				}
			}
		}()
	}
	defer func() { close(stop); busy.Wait() }()
	bufs, streams := make([]uint64, ranks), make([]uintptr, ranks)
	for i := range 200 {
		tids = tids[:0]
		var err error
		if i%2 == 0 {
			err = c.AllReduceSumDevice(bufs, 1024, streams)
		} else {
			err = c.AllGatherDevice(bufs, bufs, 1024, streams)
		}
		if err != nil {
			t.Fatal(err)
		}
		if len(tids) != ranks+2 {
			t.Fatalf("group %d: %d calls, want %d", i, len(tids), ranks+2)
		}
		for _, id := range tids[1:] {
			if id != tids[0] {
				t.Fatalf("group %d: calls from threads %v, want one (ncclGroupStart's)", i, tids)
			}
		}
	}
}

// fakeAbortNCCL is a fake library whose collectives and groups record a
// call on a communicator already aborted (a use after ncclCommAbort freed
// it), and whose ncclCommAbort and ncclCommDestroy count their calls. A
// collective on a communicator in block waits until that one is aborted,
// as a collective would that waits for a failed rank.
type fakeAbortNCCL struct {
	mu        sync.Mutex
	aborts    map[uintptr]int
	destroyed int
	misuse    []string
	block     map[uintptr]chan struct{}
}

func (f *fakeAbortNCCL) lib() *NCCL {
	msg := []byte("aborted\x00")
	f.aborts, f.block = map[uintptr]int{}, map[uintptr]chan struct{}{}
	use := func(call string, comm uintptr) int32 {
		f.mu.Lock()
		if f.aborts[comm] > 0 {
			f.misuse = append(f.misuse, fmt.Sprintf("%s on communicator %d after its abort", call, comm))
		}
		ch := f.block[comm]
		f.mu.Unlock()
		if ch != nil {
			<-ch
			return 5
		}
		goruntime.Gosched()
		return 0
	}
	lib := fakeCollectives(func() int32 { return 0 }, use)
	lib.commAbort = func(comm uintptr) int32 {
		f.mu.Lock()
		defer f.mu.Unlock()
		f.aborts[comm]++
		if ch := f.block[comm]; ch != nil {
			close(ch)
			delete(f.block, comm)
		}
		return 0
	}
	lib.commDestroy = func(uintptr) int32 {
		f.mu.Lock()
		defer f.mu.Unlock()
		f.destroyed++
		return 0
	}
	lib.getErrorString = func(int32) *byte { return &msg[0] }
	return lib
}

// fakeCollectives is a fake library whose ncclGroupStart and ncclGroupEnd
// call group and whose all-reduce and all-gather call use with the call's
// name and communicator.
func fakeCollectives(group func() int32, use func(call string, comm uintptr) int32) *NCCL {
	return &NCCL{
		groupStart: group,
		groupEnd:   group,
		allReduce: func(_, _ uintptr, _ uint64, _, _ int32, comm, _ uintptr) int32 {
			return use("ncclAllReduce", comm)
		},
		allGather: func(_, _ uintptr, _ uint64, _ int32, comm, _ uintptr) int32 {
			return use("ncclAllGather", comm)
		},
	}
}

// TestNCCLAbort checks Abort (without a GPU, on a fake library): every
// local communicator is aborted once however often Abort is called; the
// collectives running on other goroutines end with ErrAborted and none
// reaches NCCL with an aborted communicator; Close then destroys none; and
// a collective blocked inside NCCL (waiting for a failed rank) does not
// keep Abort from aborting: it waits abortWait at most, and the abort
// ends the blocked call.
func TestNCCLAbort(t *testing.T) {
	t.Run("collectives running", func(t *testing.T) {
		f := &fakeAbortNCCL{}
		c := &NCCLCommunicator{lib: f.lib(), world: 2, global: []int{0, 1}, comms: []Comm{11, 12}}
		errs := make([]error, 6)
		var wg sync.WaitGroup
		for g := range errs {
			wg.Add(1)
			go func() {
				defer wg.Done()
				for {
					var err error
					switch g % 3 {
					case 0:
						err = c.AllReduceSumDeviceRank(g%2, 0, 8, 0)
					case 1:
						err = c.AllReduceSumDevice(make([]uint64, 2), 8, make([]uintptr, 2))
					default:
						err = c.AllGatherDevice(make([]uint64, 2), make([]uint64, 2), 8, make([]uintptr, 2))
					}
					if err != nil {
						errs[g] = err
						return
					}
				}
			}()
		}
		time.Sleep(20 * time.Millisecond)
		c.Abort()
		c.Abort()
		wg.Wait()
		for g, err := range errs {
			if !errors.Is(err, ErrAborted) {
				t.Errorf("goroutine %d ended with %v, want ErrAborted", g, err)
			}
		}
		if err := c.AllGatherDeviceRank(1, 0, 0, 8, 0); !errors.Is(err, ErrAborted) {
			t.Errorf("an all-gather after the abort: %v, want ErrAborted", err)
		}
		if err := c.Close(); err != nil {
			t.Fatal(err)
		}
		f.mu.Lock()
		defer f.mu.Unlock()
		if f.aborts[11] != 1 || f.aborts[12] != 1 || len(f.aborts) != 2 {
			t.Errorf("ncclCommAbort calls %v, want one a communicator", f.aborts)
		}
		if f.destroyed != 0 {
			t.Errorf("Close destroyed %d aborted communicators", f.destroyed)
		}
		for _, m := range f.misuse {
			t.Error(m)
		}
	})
	t.Run("a collective blocked in NCCL", func(t *testing.T) {
		f := &fakeAbortNCCL{}
		c := &NCCLCommunicator{lib: f.lib(), world: 2, global: []int{0, 1}, comms: []Comm{21, 22}}
		f.block[21] = make(chan struct{})
		done := make(chan error)
		go func() { done <- c.AllReduceSumDeviceRank(0, 0, 8, 0) }()
		time.Sleep(20 * time.Millisecond)
		t0 := time.Now()
		c.Abort()
		if d := time.Since(t0); d > abortWait+time.Second {
			t.Errorf("Abort took %v", d)
		}
		select {
		case err := <-done:
			var ne *NCCLError
			if !errors.As(err, &ne) {
				t.Errorf("the blocked all-reduce returned %v, want NCCL's error", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("the blocked all-reduce still waits after the abort")
		}
	})
}

// TestNCCLAbortWaiting makes the failure Abort is for on two GPUs: rank 0
// queues an all-reduce that waits for rank 1, which never queues its own
// (the rank that failed), so synchronizing rank 0's stream waits; Abort
// must end that wait, and later collectives return ErrAborted.
func TestNCCLAbortWaiting(t *testing.T) {
	devs := ncclDevices(t, 2)
	if len(devs) < 2 {
		t.Skip("needs 2 GPUs")
	}
	c, err := NewNCCLCommunicator(devs[:2])
	if err != nil {
		t.Fatal(err)
	}
	if c.lib.commAbort == nil {
		c.Close()
		t.Skipf("%s has no ncclCommAbort", c.lib.Path)
	}
	const n = 1 << 20
	var p driver.DevicePtr
	err = c.onRank(0, func() error {
		var err error
		if p, err = c.drv.MemAlloc(4 * n); err != nil {
			return err
		}
		return c.AllReduceSumDeviceRank(0, uint64(p), n, uintptr(c.streams[0]))
	})
	if err != nil {
		t.Fatal(err)
	}
	synced := make(chan error, 1)
	go func() { synced <- c.onRank(0, func() error { return c.drv.StreamSynchronize(c.streams[0]) }) }()
	select {
	case err := <-synced:
		t.Fatalf("rank 0's all-reduce ended without rank 1 (%v): nothing to abort", err)
	case <-time.After(500 * time.Millisecond):
	}
	c.Abort()
	select {
	case err := <-synced:
		t.Logf("rank 0's stream after the abort: %v", err)
	case <-time.After(30 * time.Second):
		t.Fatal("rank 0's stream still waits 30 s after the abort")
	}
	if err := c.AllReduceSumDeviceRank(1, uint64(p), n, uintptr(c.streams[1])); !errors.Is(err, ErrAborted) {
		t.Errorf("an all-reduce after the abort: %v, want ErrAborted", err)
	}
	if err := c.onRank(0, func() error { return c.drv.MemFree(p) }); err != nil {
		t.Error(err)
	}
	if err := c.Close(); err != nil {
		t.Error(err)
	}
}
