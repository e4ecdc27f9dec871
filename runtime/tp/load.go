package tp

import (
	"errors"
	"fmt"
	goruntime "runtime"

	"qtool/convert"
	"qtool/formats/model"
	"qtool/formats/shard"
	"qtool/runtime"
	"qtool/runtime/cpu"
)

// Check reports, before anything is uploaded or computed, whether m can run
// over n ranks: n must divide the heads and KV heads, quantized weights must
// split on group and packing boundaries, and a model opened from a shard
// directory must have been sharded for n ranks.
func Check(m *model.Model, n int) error {
	src := m.Source
	if src == "" {
		src = "model"
	}
	if err := shard.CheckTP(m.Config, n); err != nil {
		return fmt.Errorf("%s: %w", src, err)
	}
	if m.Format == shard.Format {
		for _, name := range m.Names() {
			t, _ := m.Lookup(name)
			if st, ok := t.(*shard.Tensor); ok && len(st.Parts) != n {
				return fmt.Errorf("%s: the shard directory was written for %d ranks, not %d (run it with --tp %d, or re-shard)", src, len(st.Parts), n, len(st.Parts))
			}
		}
		return nil
	}
	_, err := shard.Plan(m, n)
	return err
}

// ShardedSize is the number of ranks a model opened from a shard directory
// (shard.OpenModel) was split for, or 0 for any other model.
func ShardedSize(m *model.Model) int {
	if m == nil || m.Format != shard.Format {
		return 0
	}
	for _, name := range m.Names() {
		if t, ok := m.Lookup(name); ok {
			if st, ok := t.(*shard.Tensor); ok {
				return len(st.Parts)
			}
		}
	}
	return 0
}

// ranksFor resolves n <= 0: the shard directory's size, else 1.
func ranksFor(m *model.Model, n int) int {
	if n > 0 {
		return n
	}
	if s := ShardedSize(m); s > 0 {
		return s
	}
	return 1
}

// NewCPU returns a tensor-parallel backend of n CPU ranks (goroutines in
// this process, sharing threads CPU threads; 0: all cores) with an
// in-process communicator, for the model m, after Check(m, n). n <= 0
// takes the rank count of a model opened from a shard directory (1 for
// any other model).
func NewCPU(m *model.Model, n, threads int) (*Backend, error) {
	if m == nil {
		return nil, fmt.Errorf("tp: NewCPU needs the model")
	}
	n = ranksFor(m, n)
	if err := Check(m, n); err != nil {
		return nil, err
	}
	if threads <= 0 {
		threads = goruntime.GOMAXPROCS(0)
	}
	per := max(1, threads/n)
	ranks := make([]runtime.Backend, n)
	for r := range ranks {
		ranks[r] = cpu.New(per)
	}
	comm, err := NewInProcess(n)
	if err != nil {
		return nil, err
	}
	return New(m.Config, ranks, comm)
}

// OpenModel opens what qtool verify takes as MODEL: anything the formats
// registry reads (convert.Open). A shard directory opens as its codec does
// (shard.OpenModel): its tensors keep their per-rank pieces, runnable with
// a Backend of the same size.
func OpenModel(path string) (*model.Model, error) { return convert.Open(path) }

// Load is the whole path for a CPU run: it checks m against n ranks, makes
// the CPU backend (NewCPU) and uploads m (runtime.Load). Close the model's
// backend when done.
func Load(m *model.Model, n, threads int) (*runtime.Model, error) {
	be, err := NewCPU(m, n, threads)
	if err != nil {
		return nil, err
	}
	rm, err := runtime.Load(m, be)
	if err != nil {
		be.Close()
		return nil, err
	}
	return rm, nil
}

// NewGPU returns a tensor-parallel backend of n ranks for the model m, rank
// r on GPU r as made by newRank(r) (for instance a CUDA backend for that
// device), with the collectives through NCCL over GPUs 0..n−1 and the
// all-reduces of up to DefaultPeerBytes over peer memory where the GPUs can
// address each other's (UsePeerMemory; PeerMemoryErr says why not). When
// NCCL cannot be loaded it falls back to the in-process communicator (the
// backend's Name says which). n <= 0 is resolved as in NewCPU.
func NewGPU(m *model.Model, n int, newRank func(device int) (runtime.Backend, error)) (*Backend, error) {
	if m == nil || newRank == nil {
		return nil, fmt.Errorf("tp: NewGPU needs the model and a rank constructor")
	}
	n = ranksFor(m, n)
	if err := Check(m, n); err != nil {
		return nil, err
	}
	devices := make([]int, n)
	for i := range devices {
		devices[i] = i
	}
	var comm Communicator
	nc, err := NewNCCLCommunicator(devices)
	if err == nil {
		comm = nc
	} else if errors.Is(err, ErrNoNCCL) {
		if comm, err = NewInProcess(n); err != nil {
			return nil, err
		}
	} else {
		return nil, fmt.Errorf("tp: %w", err)
	}
	ranks := make([]runtime.Backend, 0, n)
	for _, d := range devices {
		be, err := newRank(d)
		if err != nil {
			for _, b := range ranks {
				b.Close()
			}
			comm.Close()
			return nil, fmt.Errorf("tp: rank %d on GPU %d: %w", d, d, err)
		}
		ranks = append(ranks, be)
	}
	b, err := New(m.Config, ranks, comm)
	if err == nil {
		b.usePeerMemoryByDefault(DefaultTimeout)
	}
	return b, err
}
