package kld

import (
	"bytes"
	"crypto/sha256"
	"encoding/binary"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"strings"

	"qtool/formats/atomicfile"
	"qtool/formats/infile"
)

// The logits file holds a base model's next-token log-probabilities over a
// tokenized text, so that a sweep of quantized models pays for the base
// once (llama.cpp's `--kl-divergence-base`). Layout, little-endian:
//
//	magic    [8]byte    "QTKLD\x00\x01\n"
//	hlen     uint32     length of the header
//	header   hlen bytes JSON (Header): base model, text and its SHA-256,
//	                    ctx, protocol, chunks, scored rows per chunk, vocab,
//	                    SHA-256 of the ids section
//	ids      int32 × chunks·ctx   the evaluated token ids, chunk after chunk
//	                    (before any BOS replacement)
//	rows     chunks·scored rows of RowBytes(vocab) bytes:
//	           float32  maxLogP  log-probability of the most likely token
//	           float32  nll      −log p(target), exact
//	           int32    top      argmax (exact, so ties never flip top-1)
//	           uint16   code[vocab]
//
// code[i] = round((maxLogP − log p_i) / step), step = Range/65534, stores
// log p_i to within step/2 (1.8e-4 nats for Range 24) over the Range nats
// below the top token; 65535 marks a token further down, read back as
// probability 0. Decoded rows are renormalized, so the base is a proper
// distribution and KLD ≥ 0. This is llama.cpp's 16-bit scheme (it keeps
// 16 nats and clamps the rest), with a wider range, the exact NLL and the
// exact argmax. The error it adds: 4e-9 to the KLD of llama-mini against
// itself, 3e-6 relative to the mean KLD of its RTN w4 model
// (TestCompareOnModel). Full distributions rather than top-K keep the KLD
// exact over the whole vocabulary: 2·vocab+12 bytes a position (8.2 KB for
// a 4096 vocabulary, 64 KB for 32 000).

// Magic starts every logits file.
const Magic = "QTKLD\x00\x01\n"

// Range is the span of log-probabilities (nats below the top token) the
// 16-bit codes hold.
const Range = 24.0

const (
	floorCode = 0xFFFF
	rowHead   = 12 // maxLogP, nll, top
	maxHeader = 1 << 20
)

// Header describes a logits file.
type Header struct {
	Model      string  `json:"model"`       // base model, as given on the command line
	Text       string  `json:"text"`        // text file the ids come from
	TextSHA256 string  `json:"text_sha256"` // of the whole text file
	IDsSHA256  string  `json:"ids_sha256"`  // of the ids section
	Tokens     int     `json:"tokens"`      // tokens of the whole text
	Ctx        int     `json:"ctx"`
	Protocol   string  `json:"protocol"`
	Chunks     int     `json:"chunks"`
	First      int     `json:"first"`  // first scored row of each chunk
	Scored     int     `json:"scored"` // scored rows per chunk
	BOS        int     `json:"bos"`    // id that replaced each chunk's first token, −1 if none
	Vocab      int     `json:"vocab"`
	Range      float64 `json:"range"`
}

// RowBytes is the size of one stored position for a vocabulary.
func RowBytes(vocab int) int64 { return rowHead + 2*int64(vocab) }

// Row is one stored position.
type Row struct {
	MaxLogP float32
	NLL     float32
	Top     int32
	Codes   []uint16
}

func step(r float64) float64 { return r / (floorCode - 1) }

// EncodeRow stores the log-softmax of logits (target: the correct next
// token) into r, reusing r.Codes; lp is scratch of len(logits).
func EncodeRow(r *Row, logits []float32, target int, lp []float64) {
	top := LogSoftmax(lp, logits)
	maxLP := lp[top]
	r.MaxLogP, r.NLL, r.Top = float32(maxLP), float32(-lp[target]), int32(top)
	if cap(r.Codes) < len(logits) {
		r.Codes = make([]uint16, len(logits))
	}
	r.Codes = r.Codes[:len(logits)]
	inv := 1 / step(Range)
	for i, v := range lp {
		c := math.Round((maxLP - v) * inv)
		if c >= floorCode || math.IsNaN(c) {
			r.Codes[i] = floorCode
		} else {
			r.Codes[i] = uint16(c)
		}
	}
}

// LogProbs decodes r into normalized log-probabilities (−Inf for tokens
// below the range); rng is the file's Range.
func (r Row) LogProbs(dst []float64, rng float64) {
	st := step(rng)
	m := float64(r.MaxLogP)
	for i, c := range r.Codes {
		if c == floorCode {
			dst[i] = math.Inf(-1)
		} else {
			dst[i] = m - float64(c)*st
		}
	}
	s := 0.0
	for _, v := range dst {
		s += math.Exp(v - m)
	}
	lz := m + math.Log(s)
	for i := range dst {
		dst[i] -= lz
	}
}

// Writer writes a logits file as every qtool output is written
// (formats/atomicfile): into a temporary beside it that Close renames into
// place, with the target locked meanwhile, so a killed run leaves no file
// that looks complete, a second writer of the same file fails at once, and
// a FIFO or device node is refused.
type Writer struct {
	path string
	out  *atomicfile.File
	lock *atomicfile.Lock
	h    Header
	rows int
	buf  []byte
}

// Create starts a logits file at path for h and the evaluated ids
// (h.Chunks·h.Ctx of them); it fills h.IDsSHA256 and h.Range.
func Create(path string, h Header, ids []int) (*Writer, error) {
	if len(ids) != h.Chunks*h.Ctx {
		return nil, fmt.Errorf("kld: %s: %d ids for %d chunks of %d", path, len(ids), h.Chunks, h.Ctx)
	}
	idb := idBytes(ids)
	h.IDsSHA256 = sha(idb)
	h.Range = Range
	hb, err := json.Marshal(h)
	if err != nil {
		return nil, err
	}
	lock, err := atomicfile.LockTarget(path)
	if err != nil {
		return nil, fmt.Errorf("kld: %w", err)
	}
	out, err := atomicfile.Create(path)
	if err != nil {
		lock.Unlock()
		return nil, fmt.Errorf("kld: %w", err)
	}
	w := &Writer{path: path, out: out, lock: lock, h: h}
	for _, b := range [][]byte{[]byte(Magic), binary.LittleEndian.AppendUint32(nil, uint32(len(hb))), hb, idb} {
		if _, err := w.out.Write(b); err != nil {
			w.Abort()
			return nil, fmt.Errorf("kld: %s: %w", path, err)
		}
	}
	return w, nil
}

// Header is what the file will say about itself.
func (w *Writer) Header() Header { return w.h }

// WriteRow appends one position.
func (w *Writer) WriteRow(r Row) error {
	if len(r.Codes) != w.h.Vocab {
		return fmt.Errorf("kld: %s: row of %d codes, want vocab %d", w.path, len(r.Codes), w.h.Vocab)
	}
	b := w.buf[:0]
	b = binary.LittleEndian.AppendUint32(b, math.Float32bits(r.MaxLogP))
	b = binary.LittleEndian.AppendUint32(b, math.Float32bits(r.NLL))
	b = binary.LittleEndian.AppendUint32(b, uint32(r.Top))
	for _, c := range r.Codes {
		b = binary.LittleEndian.AppendUint16(b, c)
	}
	w.buf = b
	w.rows++
	if _, err := w.out.Write(b); err != nil {
		return fmt.Errorf("kld: %s: %w", w.path, err)
	}
	return nil
}

// Close finishes the file; it fails, writing nothing, if fewer rows than
// the header promises were written.
func (w *Writer) Close() error {
	defer w.Abort()
	if want := w.h.Chunks * w.h.Scored; w.rows != want {
		return fmt.Errorf("kld: %s: %d rows written, the header promises %d", w.path, w.rows, want)
	}
	if err := w.out.Commit(); err != nil {
		return fmt.Errorf("kld: %w", err)
	}
	return nil
}

// Abort removes the unfinished file and releases the target (after Close,
// it does nothing).
func (w *Writer) Abort() {
	w.out.Abort()
	w.lock.Unlock()
}

func idBytes(ids []int) []byte {
	b := make([]byte, 0, 4*len(ids))
	for _, id := range ids {
		b = binary.LittleEndian.AppendUint32(b, uint32(int32(id)))
	}
	return b
}

func sha(b []byte) string {
	s := sha256.Sum256(b)
	return hex.EncodeToString(s[:])
}

// TextSHA256 is the hash a Header records for a text.
func TextSHA256(text []byte) string { return sha(text) }

// File is an opened logits file.
type File struct {
	Header
	Path string
	IDs  []int // Chunks·Ctx evaluated ids
	r    io.ReaderAt
	c    io.Closer
	data int64 // offset of the first row
	buf  []byte
}

// IsLogitsFile reports whether path is a regular file that starts with the
// logits file magic.
func IsLogitsFile(path string) bool {
	f, _, err := infile.Open(path)
	if err != nil {
		return false
	}
	defer f.Close()
	var m [len(Magic)]byte
	_, err = io.ReadFull(f, m[:])
	return err == nil && string(m[:]) == Magic
}

// Open opens and checks a logits file (a regular file: formats/infile).
func Open(path string) (*File, error) {
	f, fi, err := infile.Open(path)
	if err != nil {
		return nil, fmt.Errorf("kld: %w", err)
	}
	lf, err := Decode(f, fi.Size(), path)
	if err != nil {
		f.Close()
		return nil, err
	}
	lf.c = f
	return lf, nil
}

// Close closes the file.
func (f *File) Close() error {
	if f.c != nil {
		return f.c.Close()
	}
	return nil
}

// Decode reads the header and ids of a logits file of size bytes from r and
// checks that the rest has exactly the size they imply; name is used in
// errors. Rows are read later, a chunk at a time.
func Decode(r io.ReaderAt, size int64, name string) (*File, error) {
	bad := func(format string, a ...any) error {
		return fmt.Errorf("kld: %s is not a valid qtool logits file: %s", name, fmt.Sprintf(format, a...))
	}
	pre := make([]byte, len(Magic)+4)
	if _, err := r.ReadAt(pre, 0); err != nil {
		return nil, bad("%d bytes, too short for the magic and header length", size)
	}
	if string(pre[:len(Magic)]) != Magic {
		return nil, bad("it does not start with %q (write one with `qtool verify --kld BASE --kld-cache FILE`)", Magic)
	}
	hlen := int64(binary.LittleEndian.Uint32(pre[len(Magic):]))
	if hlen > maxHeader || int64(len(pre))+hlen > size {
		return nil, bad("header length %d exceeds the file (%d bytes) or 1 MiB", hlen, size)
	}
	hb := make([]byte, hlen)
	if _, err := r.ReadAt(hb, int64(len(pre))); err != nil {
		return nil, bad("reading the header: %v", err)
	}
	var h Header
	dec := json.NewDecoder(bytes.NewReader(hb))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&h); err != nil {
		return nil, bad("header: %v", err)
	}
	switch {
	case h.Ctx < 2 || h.Ctx > 1<<20:
		return nil, bad("ctx %d", h.Ctx)
	case h.Chunks < 1 || h.Chunks > 1<<24:
		return nil, bad("chunks %d", h.Chunks)
	case h.Vocab < 1 || h.Vocab > 1<<24:
		return nil, bad("vocab %d", h.Vocab)
	case h.First < 0 || h.Scored < 1 || h.First+h.Scored > h.Ctx-1:
		return nil, bad("scored rows %d..%d do not fit ctx %d", h.First, h.First+h.Scored, h.Ctx)
	case !(h.Range > 0 && h.Range < 1e4):
		return nil, bad("range %v", h.Range)
	case h.BOS < -1 || h.BOS >= h.Vocab:
		return nil, bad("bos %d outside the vocabulary %d", h.BOS, h.Vocab)
	case h.Tokens < h.Chunks*h.Ctx:
		return nil, bad("%d text tokens for %d chunks of %d", h.Tokens, h.Chunks, h.Ctx)
	}
	nids := int64(h.Chunks) * int64(h.Ctx)
	data := int64(len(pre)) + hlen + 4*nids
	want := data + int64(h.Chunks)*int64(h.Scored)*RowBytes(h.Vocab)
	if want != size {
		return nil, bad("%d bytes, the header implies %d (%d chunks × %d rows of vocab %d); truncated or appended to?",
			size, want, h.Chunks, h.Scored, h.Vocab)
	}
	idb := make([]byte, 4*nids)
	if _, err := r.ReadAt(idb, int64(len(pre))+hlen); err != nil {
		return nil, bad("reading the ids: %v", err)
	}
	if got := sha(idb); got != h.IDsSHA256 {
		return nil, bad("the ids hash to %s, the header says %s", got, h.IDsSHA256)
	}
	ids := make([]int, nids)
	for i := range ids {
		id := int32(binary.LittleEndian.Uint32(idb[4*i:]))
		if id < 0 || int(id) >= h.Vocab {
			return nil, bad("token id %d at %d outside the vocabulary %d", id, i, h.Vocab)
		}
		ids[i] = int(id)
	}
	return &File{Header: h, Path: name, IDs: ids, r: r, data: data}, nil
}

// ReadChunk reads the Scored rows of chunk c into rows (reused: rows must
// have len Scored; their Codes are views of an internal buffer valid until
// the next call).
func (f *File) ReadChunk(c int, rows []Row) error {
	if c < 0 || c >= f.Chunks || len(rows) != f.Scored {
		return fmt.Errorf("kld: %s: chunk %d of %d, %d rows (want %d)", f.Path, c, f.Chunks, len(rows), f.Scored)
	}
	rb := RowBytes(f.Vocab)
	n := int64(f.Scored) * rb
	if int64(cap(f.buf)) < n {
		f.buf = make([]byte, n)
	}
	b := f.buf[:n]
	if _, err := f.r.ReadAt(b, f.data+int64(c)*n); err != nil {
		return fmt.Errorf("kld: %s: chunk %d: %w", f.Path, c, err)
	}
	for i := range rows {
		p := b[int64(i)*rb : int64(i+1)*rb]
		r := &rows[i]
		r.MaxLogP = math.Float32frombits(binary.LittleEndian.Uint32(p))
		r.NLL = math.Float32frombits(binary.LittleEndian.Uint32(p[4:]))
		r.Top = int32(binary.LittleEndian.Uint32(p[8:]))
		if r.Top < 0 || int(r.Top) >= f.Vocab || !finite32(r.MaxLogP) || !finite32(r.NLL) {
			return fmt.Errorf("kld: %s: chunk %d row %d is corrupt (top %d, max log-prob %v, nll %v)", f.Path, c, i, r.Top, r.MaxLogP, r.NLL)
		}
		if cap(r.Codes) < f.Vocab {
			r.Codes = make([]uint16, f.Vocab)
		}
		r.Codes = r.Codes[:f.Vocab]
		for j := range r.Codes {
			r.Codes[j] = binary.LittleEndian.Uint16(p[rowHead+2*j:])
		}
	}
	return nil
}

func finite32(v float32) bool { return !math.IsNaN(float64(v)) && !math.IsInf(float64(v), 0) }

// ErrMismatch is wrapped by Check's errors.
var ErrMismatch = errors.New("logits file does not match this run")

// Check compares the file with the run that wants to use it: want is the
// header the run would write (its Text, TextSHA256, Ctx, Protocol, First,
// Scored, BOS, Vocab) and ids the run's evaluated ids (want.Chunks·want.Ctx
// of them; fewer chunks than the file holds is fine, the file's first ones
// are used). The error lists every difference.
func (f *File) Check(want Header, ids []int) error {
	var diffs []string
	d := func(what string, file, run any) {
		diffs = append(diffs, fmt.Sprintf("%s: file %v, this run %v", what, file, run))
	}
	if f.Ctx != want.Ctx {
		d("ctx", f.Ctx, want.Ctx)
	}
	if f.Protocol != want.Protocol || (f.Ctx == want.Ctx && (f.First != want.First || f.Scored != want.Scored)) {
		d("protocol", fmt.Sprintf("%s (rows %d..%d)", f.Protocol, f.First, f.First+f.Scored-1),
			fmt.Sprintf("%s (rows %d..%d)", want.Protocol, want.First, want.First+want.Scored-1))
	}
	if f.BOS != want.BOS {
		d("BOS replacement", f.BOS, want.BOS)
	}
	if f.Vocab != want.Vocab {
		d("vocabulary", f.Vocab, want.Vocab)
	}
	if want.Chunks > f.Chunks {
		d("chunks", f.Chunks, want.Chunks)
	}
	if len(diffs) == 0 {
		n := len(ids)
		if n > len(f.IDs) {
			n = len(f.IDs)
		}
		for i := 0; i < n; i++ {
			if ids[i] != f.IDs[i] {
				text := ""
				if want.TextSHA256 != "" && want.TextSHA256 != f.TextSHA256 {
					text = fmt.Sprintf("; the text differs too (file: %s sha256 %.12s…, this run: %s sha256 %.12s…)", f.Text, f.TextSHA256, want.Text, want.TextSHA256)
				} else if want.TextSHA256 != "" {
					text = "; same text, so the tokenizer differs"
				}
				d("token ids", fmt.Sprintf("%d at position %d", f.IDs[i], i), fmt.Sprintf("%d%s", ids[i], text))
				break
			}
		}
	}
	if len(diffs) == 0 {
		return nil
	}
	return fmt.Errorf("%w: %s (base %s, %s): %s", ErrMismatch, f.Path, f.Model, f.Text, strings.Join(diffs, "; "))
}
