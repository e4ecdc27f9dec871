package tp

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"time"

	"qtool/runtime"
)

// PeerRank is a DeviceRank that can sum its buffers with the other ranks'
// through peer memory, in one kernel that writes into their exchange areas
// over NVLink or PCIe (the CUDA backend: runtime/cuda/peer.go). For the
// small all-reduces of a decode step that costs one launch and one flag
// exchange, where NCCL's costs several.
type PeerRank interface {
	DeviceRank
	// OpenPeerReduce makes the backend rank of a world-rank group summing
	// up to capFloats values a call, and returns its end for the others.
	OpenPeerReduce(rank, world, capFloats int, timeout time.Duration) ([]byte, error)
	// ConnectPeerReduce maps every rank's area, given all ranks' ends.
	ConnectPeerReduce(ends [][]byte) error
	// ClosePeerReduce leaves the group.
	ClosePeerReduce() error
	// AllReducePeer queues the in-place sum of x over the group, in rank
	// order (every rank gets the same bits).
	AllReducePeer(x runtime.Buf)
	// FillBits queues setting every value of x to the float32 whose bits
	// are bits.
	FillBits(x runtime.Buf, bits uint32)
}

// DefaultPeerBytes is the largest all-reduce NewGPU and OpenRank run over
// peer memory: a 2 048-token prefill of a 4096-wide model, whose
// row-parallel GEMMs send their tiles to the peers while they run on
// Hopper (cuda's MatMulAllReduce; elsewhere the all-reduces of 8–32 MiB,
// NCCL's before the twenty-fifth session, run allreduce_peer whole,
// unmeasured); larger ones go through NCCL. Each rank's area holds two
// stages a rank of this size for them (128 MiB at two ranks, 512 MiB at
// eight) and ~1 MiB a rank for the small sums.
const DefaultPeerBytes = 32 << 20

// UsePeerMemory makes the all-reduces of up to limitBytes run over peer
// memory (PeerRank) instead of through the device communicator, where every
// local rank is a PeerRank and the GPUs can address each other's memory (in
// one process, or in processes of one machine through CUDA IPC). A peer
// that does not take part within timeout fails the kernel instead of
// hanging it. On an error the backend keeps its device communicator for
// everything; with ranks in several processes every process must call it,
// and all of them end with the same choice.
func (b *Backend) UsePeerMemory(limitBytes int, timeout time.Duration) error {
	if b.dcomm == nil {
		return fmt.Errorf("tp: the all-reduce over peer memory needs device collectives")
	}
	if b.peer != nil {
		return fmt.Errorf("tp: the all-reduce over peer memory is on already")
	}
	n, capFloats := len(b.ranks), limitBytes/4
	if capFloats <= 0 {
		return fmt.Errorf("tp: all-reduce over peer memory of %d bytes", limitBytes)
	}
	peer := make([]PeerRank, n)
	ends := make([][]byte, n)
	errs := make([]error, n)
	for _, r := range b.local {
		p, ok := b.ranks[r].(PeerRank)
		if !ok {
			errs[r] = fmt.Errorf("rank %d (%s) has no peer-memory all-reduce", r, b.ranks[r].Name())
			continue
		}
		peer[r] = p
		ends[r], errs[r] = p.OpenPeerReduce(r, n, capFloats, timeout)
	}
	if !b.allLocal() {
		// Every process takes part in the exchange, a failed one with an
		// empty end, which fails every rank's connect below.
		b.each(func(r int) {
			got, err := b.exchangeEnds(r, ends[r])
			if err != nil {
				errs[r] = errors.Join(errs[r], err)
				return
			}
			for q := range got {
				if q != r {
					ends[q] = got[q]
				}
			}
		})
	}
	if errors.Join(errs...) == nil {
		b.each(func(r int) { errs[r] = peer[r].ConnectPeerReduce(ends) })
	}
	err := errors.Join(errs...)
	if !b.allLocal() {
		err = agree(b.comm, b.local[0], err, "could not join the peer-memory group")
	}
	if err != nil {
		for _, r := range b.local {
			if peer[r] != nil {
				peer[r].ClosePeerReduce()
			}
		}
		return fmt.Errorf("tp: all-reduce over peer memory: %w", err)
	}
	b.peer, b.peerCap, b.peerLimit = peer, capFloats, capFloats
	return nil
}

// usePeerMemoryByDefault turns UsePeerMemory on for DefaultPeerBytes where
// the ranks run device collectives, unless $QTOOL_TP_ALLREDUCE is "nccl";
// PeerMemoryErr keeps why it is off.
func (b *Backend) usePeerMemoryByDefault(timeout time.Duration) {
	switch {
	case b.dcomm == nil:
		b.peerErr = fmt.Errorf("tp: no device collectives")
	case os.Getenv("QTOOL_TP_ALLREDUCE") == "nccl":
		b.peerErr = fmt.Errorf("tp: QTOOL_TP_ALLREDUCE=nccl")
	default:
		b.peerErr = b.UsePeerMemory(DefaultPeerBytes, timeout)
	}
}

// PeerMemoryErr says why the all-reduces do not run over peer memory
// after NewGPU or OpenRank (nil when they do).
func (b *Backend) PeerMemoryErr() error { return b.peerErr }

// SetPeerLimit, for comparisons, makes the all-reduces of up to limitBytes
// (at most UsePeerMemory's) run over peer memory and larger ones through
// the device communicator; 0 sends all through the communicator.
func (b *Backend) SetPeerLimit(limitBytes int) {
	b.peerLimit = max(0, min(limitBytes/4, b.peerCap))
}

// PeerMemory reports whether all-reduces of count values run over peer
// memory.
func (b *Backend) PeerMemory(count int) bool { return b.peer != nil && count <= b.peerLimit }

// exchangeEnds all-gathers the ranks' ends for local rank r through the
// communicator: each as a length and its bytes, carried bit for bit in
// float32 words (at most maxEndBytes; a rank without one sends length 0).
func (b *Backend) exchangeEnds(r int, end []byte) ([][]byte, error) {
	if len(end) > maxEndBytes {
		return nil, fmt.Errorf("tp: a peer-memory end of %d bytes (at most %d)", len(end), maxEndBytes)
	}
	const words = 1 + maxEndBytes/4
	n := len(b.ranks)
	msg := make([]byte, 4*words)
	binary.LittleEndian.PutUint32(msg, uint32(len(end)))
	copy(msg[4:], end)
	send, recv := make([]float32, words), make([]float32, n*words)
	for i := range send {
		send[i] = math.Float32frombits(binary.LittleEndian.Uint32(msg[4*i:]))
	}
	if err := b.comm.AllGather(r, send, recv); err != nil {
		return nil, err
	}
	out := make([][]byte, n)
	for q := range out {
		for i := range words {
			binary.LittleEndian.PutUint32(msg[4*i:], math.Float32bits(recv[q*words+i]))
		}
		size := min(int(binary.LittleEndian.Uint32(msg)), maxEndBytes)
		out[q] = append([]byte(nil), msg[4:4+size]...)
	}
	return out, nil
}

// maxEndBytes bounds the end a PeerRank hands out (the CUDA backend's
// has 96 bytes).
const maxEndBytes = 252
