package cuda

import "testing"

// TestKernelTimes: with Options.KernelTimes every launch outside a capture
// adds its device time to its kernel's total; without it nothing is kept.
func TestKernelTimes(t *testing.T) {
	b := newTestBackend(t)
	x := upload(b, 64, 4096, make([]float32, 64*4096))
	y := upload(b, 64, 4096, make([]float32, 64*4096))
	if got := b.KernelTimes(); got != nil {
		t.Fatalf("KernelTimes without the option = %v, want nil", got)
	}
	b.opt.KernelTimes = true
	defer func() { b.opt.KernelTimes = false }()
	const n = kernelTimesBatch + 3 // one batch read on the way, three pending at the end
	before := b.KernelLaunches()["add_inplace"]
	for range n {
		b.Add(y, x)
	}
	if got := b.KernelLaunches()["add_inplace"] - before; got != n {
		t.Fatalf("%d launches of add_inplace, want %d (Add runs one kernel)", got, n)
	}
	times := b.KernelTimes()
	if len(times) != 1 || times["add_inplace"] <= 0 {
		t.Fatalf("KernelTimes = %v, want add_inplace's time alone", times)
	}
	// 2 MB read and 1 MB written a launch: well under a millisecond each,
	// well over a nanosecond
	if per := times["add_inplace"] / n; per < 1e-9 || per > 1e-3 {
		t.Errorf("add_inplace took %.3g s a launch", per)
	}
	// the events of a batch are made once and reused after it is read
	if len(b.kt.pending) != 0 || len(b.kt.free) != 2*kernelTimesBatch {
		t.Errorf("%d launches pending and %d events free after KernelTimes, want 0 and %d", len(b.kt.pending), len(b.kt.free), 2*kernelTimesBatch)
	}
}
