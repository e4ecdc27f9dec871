package cuda

import (
	"maps"

	"qtool/runtime/cuda/driver"
)

// Kernel times: with Options.KernelTimes each launch outside a graph
// capture is bracketed by two events on the stream, and the time between
// them is added to the kernel's total once the events have passed. The
// events order the stream, so the launches no longer overlap as dependent
// launches: the totals compare runs of the same kind (one process and a
// process per rank, one build and another), not a kernel's cost in a
// normal run.

// kernelTimesBatch is how many bracketed launches are left pending before
// the oldest are read (one wait on the stream).
const kernelTimesBatch = 1024

// kernelSpan is one bracketed launch.
type kernelSpan struct {
	name       string
	start, end driver.Event
}

// kernelTimes is a Backend's record of kernel device time.
type kernelTimes struct {
	total   map[string]float64 // seconds a kernel
	pending []kernelSpan
	free    []driver.Event
}

// markKernelStart records, before a launch (Options.KernelTimes, no
// capture running), the event its time starts at.
func (b *Backend) markKernelStart() driver.Event {
	start := b.timeEvent()
	b.must(b.drv.EventRecord(start, b.stream))
	return start
}

// markKernelEnd records, after the launch of kernel name, the event its
// time ends at.
func (b *Backend) markKernelEnd(name string, start driver.Event) {
	end := b.timeEvent()
	b.must(b.drv.EventRecord(end, b.stream))
	b.kt.pending = append(b.kt.pending, kernelSpan{name, start, end})
	if len(b.kt.pending) >= kernelTimesBatch {
		b.settleKernelTimes()
	}
}

// timeEvent returns an unused timing event.
func (b *Backend) timeEvent() driver.Event {
	if n := len(b.kt.free); n > 0 {
		e := b.kt.free[n-1]
		b.kt.free = b.kt.free[:n-1]
		return e
	}
	e, err := b.drv.EventCreate(0)
	b.must(err)
	return e
}

// settleKernelTimes waits for the pending launches and adds their times.
func (b *Backend) settleKernelTimes() {
	if len(b.kt.pending) == 0 {
		return
	}
	b.must(b.drv.EventSynchronize(b.kt.pending[len(b.kt.pending)-1].end))
	if b.kt.total == nil {
		b.kt.total = map[string]float64{}
	}
	for _, s := range b.kt.pending {
		ms, err := b.drv.EventElapsed(s.start, s.end)
		b.must(err)
		b.kt.total[s.name] += float64(ms) / 1e3
		b.kt.free = append(b.kt.free, s.start, s.end)
	}
	b.kt.pending = b.kt.pending[:0]
}

// KernelTimes returns the device seconds of each kernel launched so far
// outside graphs, where Options.KernelTimes is on (nil otherwise). It
// waits for the launches still running.
func (b *Backend) KernelTimes() map[string]float64 {
	if !b.opt.KernelTimes {
		return nil
	}
	defer b.enter()()
	b.settleKernelTimes()
	return maps.Clone(b.kt.total)
}

// closeKernelTimes destroys the events (the stream has been synchronized).
func (b *Backend) closeKernelTimes() []error {
	var errs []error
	for _, s := range b.kt.pending {
		b.kt.free = append(b.kt.free, s.start, s.end)
	}
	for _, e := range b.kt.free {
		errs = append(errs, b.drv.EventDestroy(e))
	}
	b.kt = kernelTimes{}
	return errs
}
