package main

import (
	"fmt"
	"io"
	"runtime/pprof"
	"runtime/trace"

	"qtool/formats/atomicfile"
	"qtool/runtime/tp"
)

// A recorder is what verify can record about its own process while it
// runs: a CPU profile (--cpuprofile) or an execution trace (--trace).
type recorder struct {
	flag  string
	start func(io.Writer) error
	stop  func()
}

var (
	cpuProfile = recorder{"cpuprofile", pprof.StartCPUProfile, pprof.StopCPUProfile}
	// The execution trace times every goroutine's blocking and every call
	// into the CUDA driver (a system call to the tracer) with its stack:
	// where the time goes that a CPU profile, which samples only running
	// threads, cannot see.
	execTrace = recorder{"trace", trace.Start, trace.Stop}
)

// record starts rec into path (a rank of a job with a process per rank:
// path.rankN, N its rank) until the returned stop, which writes the file
// whole (atomicfile) or, on an error before it, not at all.
func record(rec recorder, path string, job tp.Job, isRank bool) (stop func() error, err error) {
	if isRank {
		path = fmt.Sprintf("%s.rank%d", path, job.Rank)
	}
	f, err := atomicfile.Create(path)
	if err != nil {
		return nil, fmt.Errorf("--%s: %w", rec.flag, err)
	}
	if err := rec.start(f); err != nil {
		f.Abort()
		return nil, fmt.Errorf("--%s %s: %w", rec.flag, path, err)
	}
	return func() error {
		rec.stop()
		if err := f.Commit(); err != nil {
			return fmt.Errorf("--%s: %w", rec.flag, err)
		}
		return nil
	}, nil
}
