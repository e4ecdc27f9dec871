package tp

import (
	goruntime "runtime"
	"sync/atomic"
	"time"

	"qtool/runtime"
)

// DeviceRank is implemented by rank backends whose buffers live in GPU
// memory and whose operations only queue work on one stream (the CUDA
// backend of package runtime/cuda). Backend drives such ranks from
// persistent worker goroutines and, with a DeviceCommunicator, runs the
// collectives on the device buffers, ordered on the ranks' streams, without
// host round trips.
type DeviceRank interface {
	runtime.Backend
	// Stream is the CUDA stream (CUstream) the backend queues its work on.
	Stream() uintptr
	// BufPtr is the device address of the first value of x.
	BufPtr(x runtime.Buf) uint64
	// Do runs fn on a locked OS thread with the backend's context current.
	Do(fn func())
	// Copy2D queues a copy of the rows×cols block at (srcRow, srcCol) of
	// src to (dstRow, dstCol) of dst.
	Copy2D(dst runtime.Buf, dstRow, dstCol int, src runtime.Buf, srcRow, srcCol, rows, cols int)
	// EmbedRange queues the lookup of ids in table, the slice of a
	// vocabulary-split table holding ids lo..lo+table.Out()−1; ids outside
	// it give rows of zeros. Inside a decode-step capture the id is the
	// one the device holds.
	EmbedRange(dst runtime.Buf, table runtime.Linear, ids []int, lo int)
	// Sync waits for all queued work.
	Sync()
}

// DeviceCommunicator is implemented by communicators that run collectives
// on device buffers (NCCLCommunicator). One call covers every rank of this
// process at once (an NCCL group) and only queues the work on the streams.
type DeviceCommunicator interface {
	// AllReduceSumDevice queues, for every rank r, an in-place float32 sum
	// all-reduce of count values at the device address bufs[r] on
	// streams[r].
	AllReduceSumDevice(bufs []uint64, count int, streams []uintptr) error
	// AllGatherDevice queues, for every rank r, an all-gather of count
	// float32 values at send[r] into recv[r] (Size()·count values, in rank
	// order) on streams[r].
	AllGatherDevice(send, recv []uint64, count int, streams []uintptr) error
}

// RankDeviceCommunicator is a DeviceCommunicator whose ranks can also
// issue their device collectives one by one, each from its own thread and
// concurrently (NCCL without a group); every rank must take part.
type RankDeviceCommunicator interface {
	DeviceCommunicator
	// AllReduceSumDeviceRank queues rank's in-place all-reduce of count
	// float32 values at buf on stream.
	AllReduceSumDeviceRank(rank int, buf uint64, count int, stream uintptr) error
	// AllGatherDeviceRank queues rank's all-gather of count float32 values
	// at send into recv (Size()·count values, in rank order) on stream.
	AllGatherDeviceRank(rank int, send, recv uint64, count int, stream uintptr) error
}

// worker runs one rank's share of each operation on a persistent goroutine
// locked to its OS thread (so the rank's GPU context stays current there).
// The hand-off is a sequence number the worker spins on for a while before
// it parks, so that back-to-back operations cost no thread wake-ups.
type worker struct {
	rank     int
	panicked func(rank int, p any) // gets a job's panic
	fn       func(r int)           // the posted job; nil asks the worker to exit
	posted   atomic.Uint64
	done     atomic.Uint64
	sleeping atomic.Int32
	wake     chan struct{}
}

// spinFor is how long an idle worker (or a waiting caller) spins before it
// parks (or yields).
const spinFor = 200 * time.Microsecond

func newWorker(rank int, panicked func(rank int, p any)) *worker {
	w := &worker{rank: rank, panicked: panicked, wake: make(chan struct{}, 1)}
	go w.loop()
	return w
}

func (w *worker) loop() {
	goruntime.LockOSThread()
	defer goruntime.UnlockOSThread()
	var last uint64
	idle := time.Time{}
	for i := 0; ; i++ {
		s := w.posted.Load()
		if s == last {
			if i%256 != 0 {
				continue
			}
			if idle.IsZero() {
				idle = time.Now()
				continue
			}
			if time.Since(idle) < spinFor {
				continue
			}
			w.sleeping.Store(1)
			if w.posted.Load() != last && w.sleeping.CompareAndSwap(1, 0) {
				idle = time.Time{}
				continue
			}
			<-w.wake // the poster cleared sleeping and sends a token
			idle = time.Time{}
			continue
		}
		last, idle = s, time.Time{}
		fn := w.fn
		if fn == nil {
			w.done.Store(s)
			return
		}
		w.run(fn)
		w.done.Store(s)
	}
}

func (w *worker) run(fn func(int)) {
	defer func() {
		if p := recover(); p != nil {
			w.panicked(w.rank, p)
		}
	}()
	fn(w.rank)
}

// post hands fn to the worker; the worker must be idle (waited for).
func (w *worker) post(fn func(int)) {
	w.fn = fn
	w.posted.Add(1)
	if w.sleeping.CompareAndSwap(1, 0) {
		w.wake <- struct{}{}
	}
}

// wait blocks until the posted job has run.
func (w *worker) wait() {
	want := w.posted.Load()
	var t0 time.Time
	for i := 0; w.done.Load() != want; i++ {
		if i%256 != 0 {
			continue
		}
		switch {
		case t0.IsZero():
			t0 = time.Now()
		case time.Since(t0) > 25*spinFor:
			time.Sleep(20 * time.Microsecond) // a long wait (a download): free the core
		case time.Since(t0) > spinFor:
			goruntime.Gosched()
		}
	}
}

// stop ends the worker's goroutine.
func (w *worker) stop() {
	w.post(nil)
	w.wait()
}
