package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"sync"

	"github.com/urfave/cli/v2"

	"qtool/formats/model"
	"qtool/runtime"
	"qtool/runtime/cuda"
	"qtool/runtime/tp"
)

// A verify run is one rank of a tensor-parallel job with a process per
// rank when a launcher's variables are in the environment (torchrun's
// WORLD_SIZE, RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT, or mpirun's and
// srun's equivalents; see tp.JobFromEnv): this is how the same binary runs
// across machines. --tp-processes makes qtool its own launcher on one
// machine: it starts one such process per rank.

// rankJob returns the job this process is a rank of, if any, checked
// against --tp.
func rankJob(c *cli.Context) (tp.Job, bool, error) {
	job, ok, err := tp.JobFromEnv(os.Getenv)
	if err != nil {
		return job, false, fmt.Errorf("verify: %w", err)
	}
	if ok && c.IsSet("tp") && c.Int("tp") != job.World {
		return job, false, fmt.Errorf("verify: --tp %d, but the launcher started %d ranks (world size from the environment)", c.Int("tp"), job.World)
	}
	return job, ok, nil
}

// jobFingerprint identifies what the ranks run: their command lines must
// agree.
func jobFingerprint() string {
	h := sha256.Sum256([]byte(strings.Join(os.Args[1:], "\x00")))
	return hex.EncodeToString(h[:16])
}

// newRankBackend joins job as one rank of the model mm.
func newRankBackend(job tp.Job, device string, threads int, mm *model.Model) (runtime.Backend, error) {
	if device != "auto" && device != "cpu" && device != "cuda" {
		return nil, fmt.Errorf("verify: --device %q: want auto, cpu or cuda", device)
	}
	localWorld, _ := strconv.Atoi(os.Getenv("LOCAL_WORLD_SIZE"))
	be, err := tp.OpenRank(job, mm, tp.RankOptions{
		Fingerprint: jobFingerprint(), Device: device, Threads: threads, LocalWorld: localWorld,
		NewGPU: cuda.NewRank, GPUs: cuda.DeviceCount,
	})
	if err != nil {
		return nil, fmt.Errorf("verify: rank %d of %d: %w", job.Rank, job.World, err)
	}
	if job.Rank == 0 {
		notePeerMemory(be)
	}
	return be, nil
}

// notePeerMemory tells, on stderr, why the all-reduces of GPU ranks go
// through NCCL rather than peer memory (nothing for CPU ranks).
func notePeerMemory(be *tp.Backend) {
	if err := be.PeerMemoryErr(); err != nil && be.DeviceCollectives() {
		fmt.Fprintf(os.Stderr, "qtool: the tensor-parallel all-reduces go through NCCL, not peer memory: %v\n", err)
	}
}

// launchRanks runs this command as n rank processes on this machine (the
// same arguments, a launcher's environment) and waits for them. Rank 0
// writes to stdout and stderr; the others' stderr is shown if they fail.
func launchRanks(n int, stdout, stderr io.Writer) error {
	exe, err := os.Executable()
	if err != nil {
		return fmt.Errorf("verify --tp-processes: %w", err)
	}
	ln, err := net.Listen("tcp", "127.0.0.1:0") // a free port for rank 0
	if err != nil {
		return fmt.Errorf("verify --tp-processes: %w", err)
	}
	addr := ln.Addr().String()
	ln.Close()
	procs := make([]*exec.Cmd, n)
	logs := make([]*tailBuffer, n)
	for r := range n {
		job := tp.Job{World: n, Rank: r, LocalRank: r, Addr: addr}
		cmd := exec.Command(exe, os.Args[1:]...)
		cmd.Env = append(os.Environ(), job.Env()...)
		cmd.Env = append(cmd.Env, "LOCAL_WORLD_SIZE="+strconv.Itoa(n))
		cmd.SysProcAttr = rankProcAttr()
		if r == 0 {
			cmd.Stdout, cmd.Stderr = stdout, stderr
		} else {
			logs[r] = &tailBuffer{max: 8 << 10}
			cmd.Stdout, cmd.Stderr = io.Discard, logs[r]
		}
		if err := cmd.Start(); err != nil {
			for _, p := range procs[:r] {
				p.Process.Kill()
				p.Wait()
			}
			return fmt.Errorf("verify --tp-processes: starting rank %d: %w", r, err)
		}
		procs[r] = cmd
	}
	errs := make([]error, n)
	var once sync.Once
	var wg sync.WaitGroup
	for r, p := range procs {
		wg.Add(1)
		go func() {
			defer wg.Done()
			if errs[r] = p.Wait(); errs[r] != nil {
				once.Do(func() { // one rank failed: the job cannot finish
					for _, q := range procs {
						q.Process.Kill()
					}
				})
			}
		}()
	}
	wg.Wait()
	if errs[0] != nil {
		var ee *exec.ExitError
		if errors.As(errs[0], &ee) && ee.ExitCode() > 0 {
			return exitError{code: ee.ExitCode()} // rank 0 printed its error
		}
	}
	for r := 1; r < n; r++ {
		if errs[r] != nil && !killed(errs[r]) {
			return fmt.Errorf("verify --tp-processes: rank %d: %v\n%s", r, errs[r], strings.TrimSpace(logs[r].String()))
		}
	}
	if errs[0] != nil {
		return fmt.Errorf("verify --tp-processes: rank 0: %w", errs[0])
	}
	return nil
}

// killed reports whether err is the exit of a process launchRanks killed.
func killed(err error) bool {
	var ee *exec.ExitError
	return errors.As(err, &ee) && ee.ExitCode() == -1
}

// exitError ends qtool with a status and no further message.
type exitError struct{ code int }

func (e exitError) Error() string { return "exit status " + strconv.Itoa(e.code) }

// tailBuffer keeps the last max bytes written to it.
type tailBuffer struct {
	mu  sync.Mutex
	max int
	b   bytes.Buffer
}

func (t *tailBuffer) Write(p []byte) (int, error) {
	t.mu.Lock()
	defer t.mu.Unlock()
	t.b.Write(p)
	if over := t.b.Len() - t.max; over > 0 {
		t.b.Next(over)
	}
	return len(p), nil
}

func (t *tailBuffer) String() string {
	t.mu.Lock()
	defer t.mu.Unlock()
	return t.b.String()
}
