package tp

import (
	"bufio"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"math"
	"net"
	"time"
)

// SocketCommunicator is the Communicator of one process of a job with a
// process per rank, over TCP: rank 0 listens at the job's address and every
// other rank connects to it. Rank 0 sums (in rank order, as InProcess does,
// so the results are bit-identical to an in-process run) and gathers, and
// sends every rank the result. It suits CPU ranks and small worlds; GPU
// ranks use NCCL (NewNCCLRankCommunicator), with a SocketCommunicator only
// to hand out NCCL's unique id.
//
// Every rank must make the same calls in the same order; a rank that makes
// another call, or whose connection breaks, or that does not answer within
// the job's timeout, ends the job with an error naming it.
type SocketCommunicator struct {
	job   Job
	ln    net.Listener
	peers []*peer // rank 0: the connection of each other rank (nil at 0)
	root  *peer   // other ranks: the connection to rank 0
	recv  [][]float32
}

// peer is one end of a rank-to-rank connection.
type peer struct {
	rank    int
	conn    net.Conn
	r       *bufio.Reader
	w       *bufio.Writer
	timeout time.Duration // for each message
}

var _ Communicator = (*SocketCommunicator)(nil)

// The wire: a hello (magic, version, world, rank, the job's fingerprint)
// answered by rank 0 with a status and a message; then, per collective, a
// header (operation, payload length in bytes) and the payload.
const (
	socketMagic   = 0x50547471 // "qtTP"
	socketVersion = 1

	opAllReduce = 1
	opAllGather = 2
	opBroadcast = 3

	maxFingerprint = 4096
	maxPayload     = 1 << 40 // a sanity bound for the length fields read
)

// DialJob connects this process to the other ranks of job. fingerprint
// identifies what the job runs (e.g. a hash of the command line and the
// model): rank 0 refuses ranks whose fingerprint or world size differ.
// Rank 0 waits for every other rank to connect; the others retry until
// rank 0 listens. Both give up after the job's timeout.
func DialJob(job Job, fingerprint string) (*SocketCommunicator, error) {
	if job.World < 2 || job.Rank < 0 || job.Rank >= job.World {
		return nil, fmt.Errorf("tp: job of rank %d in a world of %d", job.Rank, job.World)
	}
	if len(fingerprint) > maxFingerprint {
		return nil, fmt.Errorf("tp: job fingerprint of %d bytes (at most %d)", len(fingerprint), maxFingerprint)
	}
	c := &SocketCommunicator{job: job}
	deadline := time.Now().Add(job.timeout())
	if job.Rank == 0 {
		if err := c.accept(fingerprint, deadline); err != nil {
			c.Close()
			return nil, err
		}
		return c, nil
	}
	if err := c.connect(fingerprint, deadline); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

func newPeer(rank int, conn net.Conn, timeout time.Duration) *peer {
	return &peer{rank: rank, conn: conn, r: bufio.NewReaderSize(conn, 1<<16), w: bufio.NewWriterSize(conn, 1<<16), timeout: timeout}
}

// accept (rank 0) waits for every other rank's hello and answers it.
func (c *SocketCommunicator) accept(fingerprint string, deadline time.Time) error {
	ln, err := net.Listen("tcp", c.job.Addr)
	if err != nil {
		return fmt.Errorf("tp: rank 0: listen on %s: %w", c.job.Addr, err)
	}
	c.ln = ln
	if tl, ok := ln.(*net.TCPListener); ok {
		_ = tl.SetDeadline(deadline)
	}
	c.peers = make([]*peer, c.job.World)
	for missing := c.job.World - 1; missing > 0; {
		conn, err := ln.Accept()
		if err != nil {
			return fmt.Errorf("tp: rank 0: waiting on %s for %d more rank(s): %w", c.job.Addr, missing, err)
		}
		_ = conn.SetDeadline(deadline)
		p := newPeer(-1, conn, c.job.timeout())
		world, rank, fp, err := readHello(p.r)
		var refuse string
		switch {
		case err != nil:
			refuse = err.Error()
		case world != c.job.World:
			refuse = fmt.Sprintf("world size %d, rank 0 has %d", world, c.job.World)
		case rank < 1 || rank >= c.job.World:
			refuse = fmt.Sprintf("rank %d outside 1..%d", rank, c.job.World-1)
		case c.peers[rank] != nil:
			refuse = fmt.Sprintf("rank %d connected twice", rank)
		case fp != fingerprint:
			refuse = fmt.Sprintf("rank %d runs another job than rank 0 (different command line or model)", rank)
		}
		if refuse != "" {
			_ = writeStatus(p.w, refuse)
			conn.Close()
			return fmt.Errorf("tp: rank 0: refused a connection from %s: %s", conn.RemoteAddr(), refuse)
		}
		if err := writeStatus(p.w, ""); err != nil {
			conn.Close()
			return fmt.Errorf("tp: rank 0: answering rank %d: %w", rank, err)
		}
		p.rank = rank
		c.peers[rank] = p
		missing--
	}
	return nil
}

// connect (rank ≥ 1) dials rank 0 until it answers or the deadline passes.
func (c *SocketCommunicator) connect(fingerprint string, deadline time.Time) error {
	var conn net.Conn
	for {
		var err error
		conn, err = net.DialTimeout("tcp", c.job.Addr, time.Until(deadline))
		if err == nil {
			break
		}
		if time.Now().Add(200 * time.Millisecond).After(deadline) {
			return fmt.Errorf("tp: rank %d: rank 0 at %s did not answer within %v: %w", c.job.Rank, c.job.Addr, c.job.timeout(), err)
		}
		time.Sleep(200 * time.Millisecond)
	}
	_ = conn.SetDeadline(deadline)
	p := newPeer(0, conn, c.job.timeout())
	c.root = p
	if err := writeHello(p.w, c.job.World, c.job.Rank, fingerprint); err != nil {
		return fmt.Errorf("tp: rank %d: greeting rank 0 at %s: %w", c.job.Rank, c.job.Addr, err)
	}
	msg, err := readStatus(p.r)
	if err != nil {
		return fmt.Errorf("tp: rank %d: waiting for rank 0 at %s: %w", c.job.Rank, c.job.Addr, err)
	}
	if msg != "" {
		return fmt.Errorf("tp: rank %d: rank 0 refused this process: %s", c.job.Rank, msg)
	}
	return nil
}

func writeHello(w *bufio.Writer, world, rank int, fp string) error {
	var h [20]byte
	binary.LittleEndian.PutUint32(h[0:], socketMagic)
	binary.LittleEndian.PutUint32(h[4:], socketVersion)
	binary.LittleEndian.PutUint32(h[8:], uint32(world))
	binary.LittleEndian.PutUint32(h[12:], uint32(rank))
	binary.LittleEndian.PutUint32(h[16:], uint32(len(fp)))
	w.Write(h[:])
	w.WriteString(fp)
	return w.Flush()
}

func readHello(r *bufio.Reader) (world, rank int, fp string, err error) {
	var h [20]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return 0, 0, "", fmt.Errorf("reading the hello: %w", err)
	}
	if m := binary.LittleEndian.Uint32(h[0:]); m != socketMagic {
		return 0, 0, "", fmt.Errorf("not a qtool rank (magic %#x)", m)
	}
	if v := binary.LittleEndian.Uint32(h[4:]); v != socketVersion {
		return 0, 0, "", fmt.Errorf("protocol version %d, want %d (another qtool version?)", v, socketVersion)
	}
	n := binary.LittleEndian.Uint32(h[16:])
	if n > maxFingerprint {
		return 0, 0, "", fmt.Errorf("fingerprint of %d bytes (at most %d)", n, maxFingerprint)
	}
	b := make([]byte, n)
	if _, err := io.ReadFull(r, b); err != nil {
		return 0, 0, "", fmt.Errorf("reading the hello: %w", err)
	}
	return int(binary.LittleEndian.Uint32(h[8:])), int(binary.LittleEndian.Uint32(h[12:])), string(b), nil
}

func writeStatus(w *bufio.Writer, msg string) error {
	var h [4]byte
	binary.LittleEndian.PutUint32(h[:], uint32(len(msg)))
	w.Write(h[:])
	w.WriteString(msg)
	return w.Flush()
}

func readStatus(r *bufio.Reader) (string, error) {
	var h [4]byte
	if _, err := io.ReadFull(r, h[:]); err != nil {
		return "", err
	}
	n := binary.LittleEndian.Uint32(h[:])
	if n > maxFingerprint {
		return "", fmt.Errorf("status of %d bytes", n)
	}
	b := make([]byte, n)
	_, err := io.ReadFull(r, b)
	return string(b), err
}

// Size implements Communicator.
func (c *SocketCommunicator) Size() int { return c.job.World }

// Name is "tcp".
func (c *SocketCommunicator) Name() string { return "tcp" }

// Close implements Communicator.
func (c *SocketCommunicator) Close() error {
	var errs []error
	for _, p := range c.peers {
		if p != nil {
			errs = append(errs, p.conn.Close())
		}
	}
	if c.root != nil {
		errs = append(errs, c.root.conn.Close())
	}
	if c.ln != nil {
		errs = append(errs, c.ln.Close())
	}
	c.peers, c.root, c.ln = nil, nil, nil
	return errors.Join(errs...)
}

func (c *SocketCommunicator) checkRank(rank int) error {
	if rank != c.job.Rank {
		return fmt.Errorf("tp: this process is rank %d, called as rank %d", c.job.Rank, rank)
	}
	if c.peers == nil && c.root == nil {
		return fmt.Errorf("tp: rank %d: communicator closed", rank)
	}
	return nil
}

// fail ends the job after a failed collective: the connections close, so
// that the other ranks fail at once instead of waiting for their timeout.
func (c *SocketCommunicator) fail(err error) error {
	if err != nil {
		c.Close()
	}
	return err
}

// AllReduceSum implements Communicator.
func (c *SocketCommunicator) AllReduceSum(rank int, buf []float32) error {
	if err := c.checkRank(rank); err != nil {
		return err
	}
	return c.fail(c.allReduceSum(buf))
}

func (c *SocketCommunicator) allReduceSum(buf []float32) error {
	if c.root != nil {
		if err := c.root.send(opAllReduce, buf); err != nil {
			return err
		}
		return c.root.receive(opAllReduce, buf)
	}
	all, err := c.collect(opAllReduce, buf)
	if err != nil {
		return err
	}
	for i := range buf {
		s := buf[i]
		for _, x := range all[1:] {
			s += x[i]
		}
		buf[i] = s
	}
	return c.answer(opAllReduce, buf)
}

// AllGather implements Communicator.
func (c *SocketCommunicator) AllGather(rank int, send, recv []float32) error {
	if err := c.checkRank(rank); err != nil {
		return err
	}
	if len(recv) != c.job.World*len(send) {
		return fmt.Errorf("tp: all-gather of %d values per rank into %d", len(send), len(recv))
	}
	return c.fail(c.allGather(send, recv))
}

func (c *SocketCommunicator) allGather(send, recv []float32) error {
	if c.root != nil {
		if err := c.root.send(opAllGather, send); err != nil {
			return err
		}
		return c.root.receive(opAllGather, recv)
	}
	all, err := c.collect(opAllGather, send)
	if err != nil {
		return err
	}
	for j, x := range all {
		copy(recv[j*len(send):], x)
	}
	return c.answer(opAllGather, recv)
}

// Broadcast sends rank 0's data to every rank and returns it (other ranks
// pass nil); at most limit bytes are accepted.
func (c *SocketCommunicator) Broadcast(rank int, data []byte, limit int) ([]byte, error) {
	if err := c.checkRank(rank); err != nil {
		return nil, err
	}
	b, err := c.broadcast(data, limit)
	return b, c.fail(err)
}

func (c *SocketCommunicator) broadcast(data []byte, limit int) ([]byte, error) {
	if c.root != nil {
		p := c.root
		n, err := p.header(opBroadcast)
		if err != nil {
			return nil, err
		}
		if n > uint64(limit) {
			return nil, fmt.Errorf("tp: rank %d: broadcast of %d bytes from rank 0, at most %d expected", c.job.Rank, n, limit)
		}
		b := make([]byte, n)
		if _, err := io.ReadFull(p.r, b); err != nil {
			return nil, p.lost(err)
		}
		return b, nil
	}
	for _, p := range c.peers[1:] {
		p.writeHeader(opBroadcast, uint64(len(data)))
		p.w.Write(data)
		if err := p.w.Flush(); err != nil {
			return nil, p.lost(err)
		}
	}
	return data, nil
}

// collect (rank 0) reads every other rank's payload of the same length as
// mine, in rank order; all[0] is mine.
func (c *SocketCommunicator) collect(op uint32, mine []float32) ([][]float32, error) {
	if len(c.recv) != c.job.World {
		c.recv = make([][]float32, c.job.World)
	}
	c.recv[0] = mine
	for _, p := range c.peers[1:] {
		if cap(c.recv[p.rank]) < len(mine) {
			c.recv[p.rank] = make([]float32, len(mine))
		}
		c.recv[p.rank] = c.recv[p.rank][:len(mine)]
		if err := p.receive(op, c.recv[p.rank]); err != nil {
			return nil, err
		}
	}
	return c.recv, nil
}

// answer (rank 0) sends every other rank the result.
func (c *SocketCommunicator) answer(op uint32, result []float32) error {
	for _, p := range c.peers[1:] {
		if err := p.send(op, result); err != nil {
			return err
		}
	}
	return nil
}

func opName(op uint32) string {
	switch op {
	case opAllReduce:
		return "all-reduce"
	case opAllGather:
		return "all-gather"
	case opBroadcast:
		return "broadcast"
	}
	return fmt.Sprintf("operation %d", op)
}

// writeHeader starts a message (and the time it has to go out).
func (p *peer) writeHeader(op uint32, n uint64) {
	_ = p.conn.SetDeadline(time.Now().Add(p.timeout))
	var h [12]byte
	binary.LittleEndian.PutUint32(h[0:], op)
	binary.LittleEndian.PutUint64(h[4:], n)
	p.w.Write(h[:])
}

// header reads the next message's header, which must be of operation op,
// and returns its payload length in bytes.
func (p *peer) header(op uint32) (uint64, error) {
	_ = p.conn.SetDeadline(time.Now().Add(p.timeout))
	var h [12]byte
	if _, err := io.ReadFull(p.r, h[:]); err != nil {
		return 0, p.lost(err)
	}
	got, n := binary.LittleEndian.Uint32(h[0:]), binary.LittleEndian.Uint64(h[4:])
	if got != op {
		return 0, fmt.Errorf("tp: rank %d ran a %s where this rank runs a %s (the ranks are out of step)", p.rank, opName(got), opName(op))
	}
	if n > maxPayload {
		return 0, fmt.Errorf("tp: rank %d sent a %s of %d bytes", p.rank, opName(op), n)
	}
	return n, nil
}

// send writes a message of operation op carrying v.
func (p *peer) send(op uint32, v []float32) error {
	p.writeHeader(op, uint64(4*len(v)))
	var b [4]byte
	for _, x := range v {
		binary.LittleEndian.PutUint32(b[:], math.Float32bits(x))
		p.w.Write(b[:])
	}
	if err := p.w.Flush(); err != nil {
		return p.lost(err)
	}
	return nil
}

// receive reads a message of operation op into v, which it must fill.
func (p *peer) receive(op uint32, v []float32) error {
	n, err := p.header(op)
	if err != nil {
		return err
	}
	if n != uint64(4*len(v)) {
		return fmt.Errorf("tp: rank %d sent a %s of %d values where this rank has %d (the ranks are out of step)", p.rank, opName(op), n/4, len(v))
	}
	var b [4]byte
	for i := range v {
		if _, err := io.ReadFull(p.r, b[:]); err != nil {
			return p.lost(err)
		}
		v[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[:]))
	}
	return nil
}

// lost describes a broken or silent connection to p.
func (p *peer) lost(err error) error {
	var ne net.Error
	if errors.As(err, &ne) && ne.Timeout() {
		return fmt.Errorf("tp: rank %d did not answer in time: %w", p.rank, err)
	}
	if errors.Is(err, io.EOF) || errors.Is(err, io.ErrUnexpectedEOF) {
		return fmt.Errorf("tp: rank %d closed the connection (it exited or failed)", p.rank)
	}
	return fmt.Errorf("tp: connection to rank %d: %w", p.rank, err)
}
