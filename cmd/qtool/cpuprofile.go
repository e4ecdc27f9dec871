package main

import (
	"fmt"
	"runtime/pprof"

	"qtool/formats/atomicfile"
	"qtool/runtime/tp"
)

// startCPUProfile samples this process's CPU use into a pprof profile at
// path (a rank of a job with a process per rank: path.rankN, N its rank)
// until the returned stop, which writes the file whole (atomicfile) or, on
// an error before it, not at all.
func startCPUProfile(path string, job tp.Job, isRank bool) (stop func() error, err error) {
	if isRank {
		path = fmt.Sprintf("%s.rank%d", path, job.Rank)
	}
	f, err := atomicfile.Create(path)
	if err != nil {
		return nil, fmt.Errorf("--cpuprofile: %w", err)
	}
	if err := pprof.StartCPUProfile(f); err != nil {
		f.Abort()
		return nil, fmt.Errorf("--cpuprofile %s: %w", path, err)
	}
	return func() error {
		pprof.StopCPUProfile()
		if err := f.Commit(); err != nil {
			return fmt.Errorf("--cpuprofile: %w", err)
		}
		return nil
	}, nil
}
