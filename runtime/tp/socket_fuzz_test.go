package tp

import (
	"bufio"
	"bytes"
	"net"
	"testing"
	"time"
)

// The wire's parsers against arbitrary bytes (another program on the port,
// a rank of another version, a cut connection): an error or a value, never
// a panic or an allocation beyond the bounds, and what they accept writes
// back as the same bytes.

// FuzzReadHello: a hello read back from any bytes is one writeHello makes
// of the values read, with a fingerprint within maxFingerprint.
func FuzzReadHello(f *testing.F) {
	var seed bytes.Buffer
	w := bufio.NewWriter(&seed)
	if err := writeHello(w, 2, 1, "verify --tp 2 model"); err != nil {
		f.Fatal(err)
	}
	f.Add(seed.Bytes())
	f.Add(seed.Bytes()[:19])
	f.Add([]byte{})
	f.Fuzz(func(t *testing.T, data []byte) {
		world, rank, fp, err := readHello(bufio.NewReader(bytes.NewReader(data)))
		if err != nil {
			return
		}
		if len(fp) > maxFingerprint {
			t.Fatalf("a fingerprint of %d bytes accepted", len(fp))
		}
		var out bytes.Buffer
		ow := bufio.NewWriter(&out)
		if err := writeHello(ow, world, rank, fp); err != nil {
			t.Fatal(err)
		}
		if !bytes.HasPrefix(data, out.Bytes()) {
			t.Fatalf("hello (%d, %d, %q) writes %x, read from %x", world, rank, fp, out.Bytes(), data)
		}
	})
}

// FuzzReadStatus: a status read back writes the same bytes.
func FuzzReadStatus(f *testing.F) {
	var seed bytes.Buffer
	w := bufio.NewWriter(&seed)
	if err := writeStatus(w, "rank 1 runs another job"); err != nil {
		f.Fatal(err)
	}
	f.Add(seed.Bytes())
	f.Add([]byte{0xff, 0xff, 0xff, 0xff})
	f.Fuzz(func(t *testing.T, data []byte) {
		msg, err := readStatus(bufio.NewReader(bytes.NewReader(data)))
		if err != nil {
			return
		}
		var out bytes.Buffer
		ow := bufio.NewWriter(&out)
		if err := writeStatus(ow, msg); err != nil {
			t.Fatal(err)
		}
		if !bytes.HasPrefix(data, out.Bytes()) {
			t.Fatalf("status %q writes %x, read from %x", msg, out.Bytes(), data)
		}
	})
}

// deadlineConn is a connection that only takes deadlines (peer.header sets
// one before it reads from the peer's reader).
type deadlineConn struct{ net.Conn }

func (deadlineConn) SetDeadline(time.Time) error { return nil }

// FuzzPeerMessage: a collective's header and payload read from any bytes
// (peer.header, peer.receive into a buffer of want values) give the
// message a peer would have sent for them, or an error.
func FuzzPeerMessage(f *testing.F) {
	var seed bytes.Buffer
	p := &peer{conn: deadlineConn{}, w: bufio.NewWriter(&seed)}
	if err := p.send(opAllReduce, []float32{1, -2, 3.5}); err != nil {
		f.Fatal(err)
	}
	f.Add(seed.Bytes(), uint8(3))
	f.Add(seed.Bytes()[:14], uint8(3))
	f.Add(seed.Bytes(), uint8(2))
	f.Fuzz(func(t *testing.T, data []byte, want uint8) {
		p := &peer{rank: 1, conn: deadlineConn{}, r: bufio.NewReader(bytes.NewReader(data)), timeout: time.Second}
		v := make([]float32, want)
		if err := p.receive(opAllReduce, v); err != nil {
			return
		}
		var out bytes.Buffer
		q := &peer{conn: deadlineConn{}, w: bufio.NewWriter(&out)}
		if err := q.send(opAllReduce, v); err != nil {
			t.Fatal(err)
		}
		if !bytes.HasPrefix(data, out.Bytes()) {
			t.Fatalf("%d values received write %x, read from %x", want, out.Bytes(), data)
		}
	})
}
