package model

import (
	goruntime "runtime"
	"sync"
)

// Parallel runs fn over [0, n) split into contiguous ranges of at least
// grain elements, on up to GOMAXPROCS goroutines (the conversions and the
// quantizers' host loops over large tensors use it).
func Parallel(n, grain int, fn func(lo, hi int)) {
	parts := min(goruntime.GOMAXPROCS(0), n/max(grain, 1))
	if parts <= 1 {
		if n > 0 {
			fn(0, n)
		}
		return
	}
	var wg sync.WaitGroup
	for p := 0; p < parts; p++ {
		lo, hi := n*p/parts, n*(p+1)/parts
		wg.Add(1)
		go func() {
			defer wg.Done()
			fn(lo, hi)
		}()
	}
	wg.Wait()
}
