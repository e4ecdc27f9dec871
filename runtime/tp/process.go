package tp

import (
	"fmt"
	goruntime "runtime"

	"qtool/formats/model"
	"qtool/runtime"
	"qtool/runtime/cpu"
)

// RankOptions says what a process rank runs on (OpenRank).
type RankOptions struct {
	// Fingerprint identifies the job (the command line, the model); ranks
	// with another fingerprint are refused.
	Fingerprint string
	// Device is "cpu", "cuda" or "auto" (CUDA when rank 0 finds a GPU).
	// Rank 0 decides and every rank follows.
	Device string
	// Threads for a CPU rank (0: the cores divided among the machine's
	// ranks, LocalWorld).
	Threads int
	// LocalWorld is the number of ranks on this machine (torchrun's
	// LOCAL_WORLD_SIZE; 0: one).
	LocalWorld int
	// NewGPU makes the backend of GPU d (nil: no GPUs); GPUs counts them.
	NewGPU func(d int) (runtime.Backend, error)
	GPUs   func() (int, error)
}

// Rank kinds rank 0 hands out.
const (
	rankCPU     = 'c' // CPU ranks, collectives over TCP
	rankGPUNCCL = 'n' // GPU ranks, NCCL (the unique id follows)
	rankGPUTCP  = 't' // GPU ranks, collectives through host memory over TCP
)

// OpenRank joins job as one process rank and returns its backend for a
// model of configuration m: rank 0 decides between CPU and GPU ranks (and,
// for GPUs, whether NCCL is there: else the collectives go through host
// memory over TCP) and hands NCCL's unique id to the others.
func OpenRank(job Job, m *model.Model, opt RankOptions) (*Backend, error) {
	if err := Check(m, job.World); err != nil {
		return nil, err
	}
	if s := ShardedSize(m); s > 0 && s != job.World {
		return nil, fmt.Errorf("tp: %s is sharded for %d ranks, the job has %d", m.Source, s, job.World)
	}
	sock, err := DialJob(job, opt.Fingerprint)
	if err != nil {
		return nil, err
	}
	keepSock := false
	defer func() {
		if !keepSock {
			sock.Close()
		}
	}()
	var plan []byte
	if job.Rank == 0 {
		plan = rank0Plan(opt)
	}
	if plan, err = sock.Broadcast(job.Rank, plan, 1+UniqueIDBytes); err != nil {
		return nil, err
	}
	if len(plan) == 0 {
		return nil, fmt.Errorf("tp: rank %d: empty plan from rank 0", job.Rank)
	}
	if plan[0] == rankCPU {
		threads := opt.Threads
		if threads <= 0 {
			threads = max(1, goruntime.GOMAXPROCS(0)/max(1, opt.LocalWorld))
		}
		keepSock = true
		return NewRank(m.Config, job.World, job.Rank, cpu.New(threads), sock)
	}
	if opt.NewGPU == nil {
		return nil, fmt.Errorf("tp: rank %d: rank 0 runs on a GPU, this process cannot", job.Rank)
	}
	be, err := opt.NewGPU(job.LocalRank)
	if err == nil && be == nil {
		err = fmt.Errorf("no backend")
	}
	if err != nil {
		err = fmt.Errorf("tp: rank %d on GPU %d (LOCAL_RANK): %w", job.Rank, job.LocalRank, err)
	}
	// Every rank says whether its GPU opened before any goes on: NCCL's
	// initialization would wait for a rank that failed with no time-out
	// (a launcher such as srun need not end the others), the socket's
	// collectives have one.
	if err = agree(sock, job.Rank, err, "could not open their GPU"); err != nil {
		if be != nil {
			be.Close()
		}
		return nil, err
	}
	var comm Communicator
	switch plan[0] {
	case rankGPUNCCL:
		if len(plan) != 1+UniqueIDBytes {
			be.Close()
			return nil, fmt.Errorf("tp: rank %d: NCCL id of %d bytes from rank 0", job.Rank, len(plan)-1)
		}
		var id UniqueID
		copy(id.Internal[:], plan[1:])
		if comm, err = NewNCCLRankCommunicator(job.World, job.Rank, job.LocalRank, id); err != nil {
			be.Close()
			return nil, fmt.Errorf("tp: %w", err)
		}
	case rankGPUTCP:
		comm, keepSock = sock, true
	default:
		be.Close()
		return nil, fmt.Errorf("tp: rank %d: unknown plan %q from rank 0", job.Rank, plan[0])
	}
	b, err := NewRank(m.Config, job.World, job.Rank, be, comm)
	if err != nil {
		be.Close()
		if comm != Communicator(sock) {
			comm.Close()
		}
		keepSock = false
		return nil, err
	}
	b.usePeerMemoryByDefault(job.timeout())
	return b, nil
}

// rank0Plan is rank 0's choice: CPU or GPU ranks, and for GPUs NCCL's id
// (or TCP collectives when NCCL is missing).
func rank0Plan(opt RankOptions) []byte {
	gpu := opt.Device == "cuda"
	if opt.Device != "cpu" && !gpu && opt.NewGPU != nil && opt.GPUs != nil {
		n, err := opt.GPUs()
		gpu = err == nil && n > 0
	}
	if !gpu || opt.NewGPU == nil {
		return []byte{rankCPU}
	}
	lib, err := LoadNCCL()
	if err != nil {
		return []byte{rankGPUTCP} // no NCCL: the backend's Name says "tcp"
	}
	id, err := lib.GetUniqueID()
	if err != nil {
		return []byte{rankGPUTCP}
	}
	return append([]byte{rankGPUNCCL}, id.Internal[:]...)
}
