package tp

import (
	"errors"
	"fmt"
	"sync"
)

// Communicator is the collective-communication layer between the ranks of
// a tensor-parallel group. Every method is called by every rank, each from
// its own goroutine (or process), with its own buffers; a call returns once
// all ranks have taken part, like NCCL's collectives.
type Communicator interface {
	// Size is the number of ranks.
	Size() int
	// AllReduceSum replaces buf, on every rank, by the element-wise sum of
	// all ranks' buf (all of the same length). Every rank ends with
	// bit-identical values.
	AllReduceSum(rank int, buf []float32) error
	// AllGather copies every rank's send (all of the same length) into
	// recv (len Size()·len(send)) in rank order.
	AllGather(rank int, send, recv []float32) error
	// Close releases the communicator.
	Close() error
}

// agree makes every process of the job end with an error when any has
// one: the count of failed processes (this one's err, nil where it did
// not fail) is all-reduced through comm by this process's rank. It
// returns err, or one saying how many others failed to do what, or that
// the count could not be made.
func agree(comm Communicator, rank int, err error, what string) error {
	failed := []float32{0}
	if err != nil {
		failed[0] = 1
	}
	if e := comm.AllReduceSum(rank, failed); e != nil {
		return errors.Join(err, fmt.Errorf("tp: rank %d: agreeing that no rank failed: %w", rank, e))
	}
	if err == nil && failed[0] > 0 {
		return fmt.Errorf("tp: rank %d: %.0f other rank(s) %s", rank, failed[0], what)
	}
	return err
}

// Aborter is a Communicator that can be broken, so that the ranks waiting
// in its collectives for a rank that has failed return an error instead
// of waiting forever (Backend aborts it when a rank panics).
type Aborter interface {
	Abort()
}

// ErrAborted is returned by the collectives of an aborted communicator.
var ErrAborted = errors.New("tp: communicator aborted (another rank failed)")

// InProcess is a Communicator for ranks that are goroutines of one process.
// The sum is taken in rank order, so results are deterministic.
type InProcess struct {
	n int

	mu      sync.Mutex
	cond    *sync.Cond
	arrived int
	gen     uint64
	broken  bool // Abort was called
	send    [][]float32
}

var _ Aborter = (*InProcess)(nil)

var _ Communicator = (*InProcess)(nil)

// NewInProcess returns an in-process communicator for n ranks.
func NewInProcess(n int) (*InProcess, error) {
	if n < 1 {
		return nil, fmt.Errorf("tp: communicator for %d ranks", n)
	}
	c := &InProcess{n: n, send: make([][]float32, n)}
	c.cond = sync.NewCond(&c.mu)
	return c, nil
}

// Size implements Communicator.
func (c *InProcess) Size() int { return c.n }

// Close implements Communicator.
func (c *InProcess) Close() error { return nil }

// Abort implements Aborter: the ranks waiting in a collective, and every
// later call of more than one rank's, get ErrAborted.
func (c *InProcess) Abort() {
	c.mu.Lock()
	c.broken = true
	c.cond.Broadcast()
	c.mu.Unlock()
}

// barrier blocks until all n ranks have called it, or returns ErrAborted
// once the communicator is aborted.
func (c *InProcess) barrier() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.broken {
		return ErrAborted
	}
	g := c.gen
	c.arrived++
	if c.arrived == c.n {
		c.arrived = 0
		c.gen++
		c.cond.Broadcast()
		return nil
	}
	for g == c.gen && !c.broken {
		c.cond.Wait()
	}
	if g == c.gen {
		return ErrAborted
	}
	return nil
}

func (c *InProcess) checkRank(rank int) error {
	if rank < 0 || rank >= c.n {
		return fmt.Errorf("tp: rank %d outside 0..%d", rank, c.n-1)
	}
	return nil
}

// lengthsAgree reports whether every rank's buffer has the length of rank 0's.
func lengthsAgree(bufs [][]float32) bool {
	for _, b := range bufs {
		if len(b) != len(bufs[0]) {
			return false
		}
	}
	return true
}

// AllReduceSum implements Communicator: a reduce-scatter in which each rank
// sums its slice of the elements over all ranks (in rank order) and writes
// the sum to every rank's buffer.
func (c *InProcess) AllReduceSum(rank int, buf []float32) error {
	if err := c.checkRank(rank); err != nil {
		return err
	}
	if c.n == 1 {
		return nil
	}
	c.send[rank] = buf
	if err := c.barrier(); err != nil {
		return err
	}
	ok := lengthsAgree(c.send)
	if ok {
		L := len(buf)
		lo, hi := rank*L/c.n, (rank+1)*L/c.n
		for i := lo; i < hi; i++ {
			s := c.send[0][i]
			for j := 1; j < c.n; j++ {
				s += c.send[j][i]
			}
			for j := 0; j < c.n; j++ {
				c.send[j][i] = s
			}
		}
	}
	if err := c.barrier(); err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("tp: all-reduce with buffers of different lengths (rank %d has %d)", rank, len(buf))
	}
	return nil
}

// AllGather implements Communicator.
func (c *InProcess) AllGather(rank int, send, recv []float32) error {
	if err := c.checkRank(rank); err != nil {
		return err
	}
	if len(recv) != c.n*len(send) {
		return fmt.Errorf("tp: all-gather of %d values per rank into %d", len(send), len(recv))
	}
	if c.n == 1 {
		copy(recv, send)
		return nil
	}
	c.send[rank] = send
	if err := c.barrier(); err != nil {
		return err
	}
	ok := lengthsAgree(c.send)
	if ok {
		L := len(send)
		for j := 0; j < c.n; j++ {
			copy(recv[j*L:(j+1)*L], c.send[j])
		}
	}
	if err := c.barrier(); err != nil {
		return err
	}
	if !ok {
		return fmt.Errorf("tp: all-gather with buffers of different lengths (rank %d sends %d)", rank, len(send))
	}
	return nil
}
