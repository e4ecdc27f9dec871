package kuiper

import (
	"encoding/binary"
	"encoding/json"
	"fmt"
	"math"
	"os"
	"slices"

	"qtool/formats/atomicfile"
	"qtool/formats/autoawq"
	"qtool/formats/model"
	"qtool/quantize"
)

// WriteOptions controls Write.
type WriteOptions struct {
	Format Format
	// GroupSize of Int8 and AK42V2 (default 64; for AK42V2 a default is halved
	// until it divides dim, as llama2.c does) and AK48 (default 128).
	GroupSize int
	// Rope is the q/k row layout written to the file (and recorded in the
	// sidecar). RopeInterleaved applies the Meta permutation that llama2.c
	// and Kuiper's default (Llama-2) build expect to an HF-layout model;
	// RopeHalf keeps (or restores) HF layout. The q/k weights (with their
	// per-row quantization parameters), biases and per-head norms are
	// permuted whenever the model's layout differs.
	Rope model.RopeLayout
	// SeqLen is the header's seq_len (0: Config.MaxSeq). It sizes the fp32
	// freqs block.
	SeqLen int
	// Progress, if set, is called after each tensor is written.
	Progress func(done, total int, name string)
	// NoSidecar skips PATH.json (and removes a stale one). Readers then
	// assume the layout AssumedRope gives (convert.SaveWith writes that one).
	NoSidecar bool
	// QtoolOnly allows files that the format's own readers would not run
	// as this model (ReaderCompatible: a Qwen3 model in a Llama layout, a
	// Qwen2 one in an ak42 layout, an ak47/ak48 file of a Qwen3 shape
	// OrinMLLM cannot read); without it Write refuses them.
	QtoolOnly bool
}

// OrinCompatible reports why OrinMLLM's loader, the home of the ak47/ak48
// formats, cannot read a file of a model with config c: it sizes wq/wo as
// {dim, dim} and uses head_size = dim / n_heads, so it needs hidden_size ==
// n_heads · head_dim (Qwen3 1.7B/8B/14B; not 0.6B/4B/32B). qtool records
// head_dim in the header and sidecar, so it reads other shapes back itself.
func OrinCompatible(c model.Config) error {
	if c.Heads*c.HeadDim != c.Hidden {
		return fmt.Errorf("OrinMLLM cannot read this shape: %d heads × head_dim %d = %d ≠ hidden_size %d (its loader assumes head_dim = hidden/heads)", c.Heads, c.HeadDim, c.Heads*c.HeadDim, c.Hidden)
	}
	return nil
}

// ReaderCompatible reports why the readers the format is for (Kuiper's,
// llama2.c's, OrinMLLM's) would not run a model of config c from a file of
// format f: the Llama layouts (kuiper-fp32, kuiper-int8, ak42-v1, ak42-v2)
// have no place for q/k norms (Qwen3), and the ak42 ones none for q/k/v
// biases (Qwen2) — qtool appends them as an extension these readers skip,
// so they would load the file and run another model — and OrinMLLM reads no
// Qwen3 shape other than head_dim = hidden/heads (OrinCompatible). Write
// refuses such files unless WriteOptions.QtoolOnly. A Qwen2 model in
// kuiper-int8 passes: Kuiper's own int8 Qwen2 format has no biases (its
// exporter and reader drop them), so its reader runs such a file as it
// runs its own; qtool keeps them in the extension (ReaderNote).
func ReaderCompatible(f Format, c model.Config) error {
	var what string
	switch f {
	case AK47, AK48:
		if c.Arch == model.Qwen3 {
			return OrinCompatible(c)
		}
		return nil
	case FP32, Int8:
		if c.QKNorm {
			what = "q/k norms"
		}
	case AK42V1, AK42V2:
		switch {
		case c.QKNorm && c.AttnBias:
			what = "q/k norms or q/k/v biases"
		case c.QKNorm:
			what = "q/k norms"
		case c.AttnBias:
			what = "q/k/v biases"
		}
	}
	if what == "" {
		return nil
	}
	hint := ""
	if c.Arch == model.Qwen3 {
		hint = " (ak47 and ak48 hold Qwen3)"
	}
	return fmt.Errorf("its layout has no place for the %s of this %s model%s: qtool would append them as an extension that Kuiper's and llama2.c's readers skip, so they would run another model", what, c.Arch, hint)
}

// ReaderNote says what the format's readers leave out of a file of a model
// of config c that ReaderCompatible lets through ("" when nothing).
func ReaderNote(f Format, c model.Config) string {
	if f == Int8 && c.AttnBias && !c.QKNorm {
		return fmt.Sprintf("Kuiper's int8 reader runs this %s model without its q/k/v biases, as it runs the files of Kuiper's own exporter (which drops them); qtool reads them from its extension, so its perplexity is the model's with them", c.Arch)
	}
	return ""
}

// chunkElems is how many values the writer converts at a time: exporting
// holds O(chunk) converted data, not O(tensor) (AK48's AWQ packing excepted:
// it converts one whole tensor at a time).
const chunkElems = 1 << 16

// Write saves m to path in opt.Format, streaming tensor by tensor. The file
// (and its sidecar) appear only when complete; on error nothing is left.
// path is locked against other writers (atomicfile.LockTarget); a symbolic
// link is written through, a special file or directory refused. The
// sidecar records the file's size and CRC-32C, so that a reader refuses a
// file and sidecar from different runs.
// Float tensors are converted to the format's dtype; linears of the int8
// formats are quantized with the Kuiper rule (quantize.Int8Sym) unless they
// already are int8 with the same groups; AK48 linears must be 4-bit
// *model.Quantized with the header's group size, or are RTN-quantized
// (quantize.Int4Asym).
func Write(m *model.Model, path string, opt WriteOptions) error {
	plan, err := planWrite(m, path, opt)
	if err != nil {
		return err
	}
	lock, err := atomicfile.LockTarget(path, "json")
	if err != nil {
		return err
	}
	defer lock.Unlock()
	out, err := atomicfile.Create(path)
	if err != nil {
		return err
	}
	defer out.Abort()
	w := &writer{path: path, out: out, plan: plan}
	if err := w.run(opt.Progress); err != nil {
		return err
	}
	sp := SidecarPath(path)
	if opt.NoSidecar {
		if err := out.Commit(); err != nil {
			return err
		}
		if err := os.Remove(sp); err != nil && !os.IsNotExist(err) {
			return err
		}
		return nil
	}
	// The sidecar names the file it describes by size and checksum: the
	// two are renamed into place one after the other, and a reader must
	// be able to tell a new file beside an old sidecar (or the reverse).
	plan.side.FileCRC32C = fmt.Sprintf("%08x", out.CRC32C())
	js, err := json.MarshalIndent(plan.side, "", "  ")
	if err != nil {
		return err
	}
	so, err := atomicfile.Create(sp)
	if err != nil {
		return err
	}
	defer so.Abort()
	if _, err := so.Write(append(js, '\n')); err != nil {
		return err
	}
	// Both are synced before either is renamed: a kill leaves a new file
	// beside an old sidecar only between two renames.
	return atomicfile.CommitAll(out, so)
}

type plan struct {
	m      *model.Model
	layout *Layout
	side   *Sidecar
	srcs   []model.Tensor // per layout entry (nil for freqs)
	perms  [][]int        // per entry: file row i comes from source row perms[i] (nil: identity)
	theta  float64
}

func planWrite(m *model.Model, path string, opt WriteOptions) (*plan, error) {
	c := m.Config
	switch c.Arch {
	case model.Llama, model.Qwen2, model.Qwen3:
	default:
		return nil, fmt.Errorf("write %s: unknown architecture %q (supported: llama, qwen2, qwen3)", path, c.Arch)
	}
	if err := c.Validate(); err != nil {
		return nil, fmt.Errorf("write %s: %w", path, err)
	}
	if err := m.CheckShapes(); err != nil {
		return nil, fmt.Errorf("write %s: %w", path, err)
	}
	h := Header{Format: opt.Format, Dim: c.Hidden, FFN: c.Intermediate, Layers: c.Layers, Heads: c.Heads,
		KVHeads: c.KVHeads, Vocab: c.Vocab, SeqLen: c.MaxSeq, Shared: c.Tied}
	if opt.SeqLen > 0 {
		h.SeqLen = opt.SeqLen
	}
	h.Magic, h.Version = magicVersion(opt.Format)
	switch opt.Format {
	case FP32, AK42V1, AK47:
	case Int8:
		// Kuiper's reader misreads a shared int8 classifier (§3.4): always
		// write vocab = −V and a quantized classifier.
		h.Shared = false
		h.GroupSize = 64
	case AK42V2:
		h.GroupSize = 64
		if opt.GroupSize == 0 {
			for h.Dim%h.GroupSize != 0 && h.GroupSize > 1 {
				h.GroupSize /= 2
			}
		}
	case AK48:
		h.GroupSize = 128
	default:
		return nil, fmt.Errorf("write %s: unknown format %q (supported: %v)", path, opt.Format, AllFormats())
	}
	if opt.GroupSize > 0 {
		if h.GroupSize == 0 {
			return nil, fmt.Errorf("write %s: %s has no group size", path, opt.Format)
		}
		h.GroupSize = opt.GroupSize
	} else if opt.GroupSize < 0 {
		return nil, fmt.Errorf("write %s: group size %d, want > 0", path, opt.GroupSize)
	}
	if opt.Format == AK47 || opt.Format == AK48 {
		// qtool writes the true shapes and records head_dim in the header
		// (and sidecar), so shapes OrinMLLM cannot read still round-trip in
		// qtool — when asked for such a file.
		if c.Arch != model.Qwen3 || c.AttnBias {
			return nil, fmt.Errorf("write %s: %s holds Qwen3 models (q/k norms, no attention biases); this model is %s", path, opt.Format, c.Arch)
		}
		h.HeadDim = c.HeadDim
	}
	if err := ReaderCompatible(opt.Format, c); err != nil && !opt.QtoolOnly {
		return nil, fmt.Errorf("write %s: %s: %w; ask for a file only qtool reads (--qtool-only) to write it anyway", path, opt.Format, err)
	}
	s := Shapes{HeadDim: c.HeadDim, QKNorm: c.QKNorm, AttnBias: c.AttnBias}
	l, err := NewLayout(path, h, s, -1)
	if err != nil {
		return nil, err
	}
	p := &plan{m: m, layout: l, theta: c.RopeTheta}
	used := map[string]bool{}
	var ext []string
	for _, e := range l.Entries {
		if e.Kind == KindFreqs {
			p.srcs = append(p.srcs, nil)
			p.perms = append(p.perms, nil)
			continue
		}
		src := e.Name
		if e.Name == model.Name(-1, model.LMHead) && c.Tied {
			src = model.Name(-1, model.Embed) // int8: the quantized embedding is the classifier
		}
		t, ok := m.Lookup(src)
		if !ok {
			return nil, errf(path, e.Name, "the %s layout needs it but the model has no tensor %q", h.Format, src)
		}
		if !slices.Equal(t.Shape(), e.Shape) {
			return nil, errf(path, e.Name, "shape %v, the layout expects %v", t.Shape(), e.Shape)
		}
		if e.Kind == KindAWQ {
			if q, ok := t.(*model.Quantized); ok && (q.Bits != 4 || q.GroupSize != h.GroupSize || q.GIdx != nil) {
				return nil, errf(path, e.Name, "quantized as %d-bit, group %d; ak48 needs 4-bit AWQ with group size %d (no g_idx)", q.Bits, q.GroupSize, h.GroupSize)
			}
		}
		used[src] = true
		if e.Extension {
			ext = append(ext, e.Name)
		}
		perm := model.RopeRows(c, e.Name, opt.Rope)
		if perm != nil && (len(e.Shape) == 1 || e.Kind == KindAWQ) {
			// Vectors (biases, norms) and AWQ weights are permuted whole;
			// the other kinds stream their rows through perm.
			if t, err = permuteWhole(t, perm); err != nil {
				return nil, errf(path, e.Name, "%v", err)
			}
			perm = nil
		}
		p.srcs = append(p.srcs, t)
		p.perms = append(p.perms, perm)
	}
	for _, n := range m.Names() {
		if !used[n] && !(n == model.Name(-1, model.LMHead) && c.Tied) {
			return nil, errf(path, n, "has no place in a %s file", h.Format)
		}
	}
	tok := relTokenizer(path, m.TokenizerDir)
	p.side = &Sidecar{Writer: "qtool", Format: h.Format, Arch: c.Arch, RopeTheta: c.RopeTheta, NormEps: c.NormEps,
		RopeLayout: opt.Rope.String(), Tied: c.Tied, HeadDim: c.HeadDim, QKNorm: c.QKNorm, AttnBias: c.AttnBias,
		GroupSize: h.GroupSize, MaxSeq: c.MaxSeq, BOS: c.BOS, EOS: c.EOS, DType: c.DType, TokenizerDir: tok,
		FileSize: l.Size, Extension: ext}
	return p, nil
}

// permuteWhole resolves a lazily quantized t and permutes its rows.
func permuteWhole(t model.Tensor, perm []int) (model.Tensor, error) {
	if lz, ok := t.(quantizer); ok {
		q, err := lz.Quantize()
		if err != nil {
			return nil, err
		}
		t = q
	}
	return model.PermuteRows(t, perm)
}

type writer struct {
	path string
	out  *atomicfile.File
	plan *plan
	pos  int64
	f    []float32 // conversion buffers, reused across tensors
	b    []byte
	q    []int8
	sc   []float32
}

func (w *writer) write(b []byte) error {
	n, err := w.out.Write(b)
	w.pos += int64(n)
	if err != nil {
		return fmt.Errorf("write %s: %w", w.path, err)
	}
	return nil
}

func (w *writer) run(progress func(done, total int, name string)) error {
	l := w.plan.layout
	if err := w.write(l.Header.Encode()); err != nil {
		return err
	}
	for i, e := range l.Entries {
		if w.pos != e.Offset {
			return errf(w.path, e.Name, "internal error: at byte %d, layout says %d", w.pos, e.Offset)
		}
		var err error
		switch e.Kind {
		case KindFreqs:
			err = w.freqs(e)
		case KindF32, KindF16:
			err = w.floats(e, w.plan.srcs[i], w.plan.perms[i])
		case KindQ8:
			err = w.q8(e, w.plan.srcs[i], w.plan.perms[i])
		case KindAWQ:
			err = w.awq(e, w.plan.srcs[i])
		}
		if err != nil {
			return err
		}
		if w.pos != e.Offset+e.Size {
			return errf(w.path, e.Name, "internal error: wrote %d bytes, layout says %d", w.pos-e.Offset, e.Size)
		}
		if progress != nil {
			progress(i+1, len(l.Entries), e.Name)
		}
	}
	if w.pos != l.Size {
		return errf(w.path, "", "internal error: wrote %d bytes, layout says %d", w.pos, l.Size)
	}
	return nil
}

// rows gives read access to the rows of a source tensor, converting only
// the requested rows.
type rows struct {
	t    model.Tensor
	q    *model.Quantized
	d    *model.Dense
	cols int
	perm []int
	full []float32 // fallback for other tensor types: converted once
}

// quantizer is implemented by lazily quantized tensors (quantize.Lazy).
type quantizer interface {
	Quantize() (*model.Quantized, error)
}

func newRows(t model.Tensor, shape []int, perm []int) (*rows, error) {
	r := &rows{t: t, cols: shape[len(shape)-1], perm: perm}
	switch v := t.(type) {
	case *model.Dense:
		r.d = v
	case *model.Quantized:
		r.q = v
	case quantizer:
		q, err := v.Quantize()
		if err != nil {
			return nil, err
		}
		r.q = q
	default:
		f, err := t.Float32()
		if err != nil {
			return nil, err
		}
		r.full = f
	}
	return r, nil
}

// read converts rows [r0, r1) into dst.
func (r *rows) read(r0, r1 int, dst []float32) error {
	if r.perm == nil {
		return r.readSrc(r0, r1, dst)
	}
	for i := r0; i < r1; i++ {
		if err := r.readSrc(r.perm[i], r.perm[i]+1, dst[(i-r0)*r.cols:(i-r0+1)*r.cols]); err != nil {
			return err
		}
	}
	return nil
}

func (r *rows) readSrc(r0, r1 int, dst []float32) error {
	c := r.cols
	switch {
	case r.d != nil:
		sz := r.d.DType.Size()
		sub := &model.Dense{DType: r.d.DType, Dims: []int{(r1 - r0) * c}, Data: r.d.Data[r0*c*sz : r1*c*sz]}
		return sub.Float32Into(dst)
	case r.q != nil:
		r.q.DequantizeRows(r0, r1, dst)
		return nil
	}
	copy(dst, r.full[r0*c:r1*c])
	return nil
}

func (w *writer) buf(n int) {
	if cap(w.f) < n {
		w.f = make([]float32, n)
		w.b = make([]byte, 4*n)
		w.q = make([]int8, n)
	}
}

func (w *writer) floats(e Entry, t model.Tensor, perm []int) error {
	want := model.F32
	if e.Kind == KindF16 {
		want = model.F16
	}
	if d, ok := t.(*model.Dense); ok && d.DType == want && perm == nil {
		return w.write(d.Data)
	}
	r, err := newRows(t, e.Shape, perm)
	if err != nil {
		return errf(w.path, e.Name, "%v", err)
	}
	nrows := model.NumElements(e.Shape) / r.cols
	step := max(1, chunkElems/r.cols)
	w.buf(step * r.cols)
	for r0 := 0; r0 < nrows; r0 += step {
		r1 := min(nrows, r0+step)
		f := w.f[:(r1-r0)*r.cols]
		if err := r.read(r0, r1, f); err != nil {
			return errf(w.path, e.Name, "%v", err)
		}
		if err := w.write(encode(f, want, w.b)); err != nil {
			return err
		}
	}
	return nil
}

func encode(f []float32, dt model.DType, b []byte) []byte {
	if dt == model.F16 {
		b = b[:2*len(f)]
		for i, x := range f {
			binary.LittleEndian.PutUint16(b[2*i:], model.Float32ToF16(x))
		}
		return b
	}
	b = b[:4*len(f)]
	for i, x := range f {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return b
}

func gcd(a, b int) int {
	for b != 0 {
		a, b = b, a%b
	}
	return a
}

func (w *writer) q8(e Entry, t model.Tensor, perm []int) error {
	gs := w.plan.layout.Header.GroupSize
	rows2, cols := e.Shape[0], e.Shape[1]
	n := rows2 * cols
	if cap(w.sc) < n/gs {
		w.sc = make([]float32, n/gs)
	}
	sc := w.sc[:n/gs]
	if lz, ok := t.(quantizer); ok {
		q, err := lz.Quantize()
		if err != nil {
			return errf(w.path, e.Name, "%v", err)
		}
		t = q
	}
	if q, ok := passThroughQ8(t, gs); ok {
		// Already int8 with the same per-row groups: write codes as they are.
		G := cols / gs
		row := make([]byte, cols)
		for i := 0; i < rows2; i++ {
			src := i
			if perm != nil {
				src = perm[i]
			}
			for c, v := range q.Q[src*cols : (src+1)*cols] {
				row[c] = byte(v)
			}
			if err := w.write(row); err != nil {
				return err
			}
			copy(sc[i*G:(i+1)*G], q.Scale[src*G:(src+1)*G])
		}
		return w.scales(sc)
	}
	r, err := newRows(t, e.Shape, perm)
	if err != nil {
		return errf(w.path, e.Name, "%v", err)
	}
	// A chunk of rows must hold whole groups (groups may cross rows).
	unit := gs / gcd(cols, gs)
	step := max(1, chunkElems/cols)
	step = (step + unit - 1) / unit * unit
	w.buf(step * cols)
	p := quantize.Int8Sym(gs)
	for r0 := 0; r0 < rows2; r0 += step {
		r1 := min(rows2, r0+step)
		k := (r1 - r0) * cols
		f, q := w.f[:k], w.q[:k]
		if err := r.read(r0, r1, f); err != nil {
			return errf(w.path, e.Name, "%v", err)
		}
		g0 := r0 * cols / gs
		if err := quantize.Groups(f, gs, p, q, sc[g0:g0+k/gs], nil); err != nil {
			return errf(w.path, e.Name, "%v", err)
		}
		b := w.b[:k]
		for i, v := range q {
			b[i] = byte(v)
		}
		if err := w.write(b); err != nil {
			return err
		}
	}
	return w.scales(sc)
}

func passThroughQ8(t model.Tensor, gs int) (*model.Quantized, bool) {
	q, ok := t.(*model.Quantized)
	if !ok {
		return nil, false
	}
	sameGroups := (q.GroupSize == gs && q.Cols%gs == 0) || (q.GroupSize == 0 && q.Cols == gs)
	return q, q.Bits == 8 && q.Zero == nil && q.GIdx == nil && sameGroups
}

func (w *writer) scales(sc []float32) error {
	for len(sc) > 0 {
		k := min(len(sc), chunkElems)
		w.buf(k)
		if err := w.write(encode(sc[:k], model.F32, w.b)); err != nil {
			return err
		}
		sc = sc[k:]
	}
	return nil
}

func (w *writer) awq(e Entry, t model.Tensor) error {
	gs := w.plan.layout.Header.GroupSize
	var q *model.Quantized
	switch v := t.(type) {
	case *model.Quantized:
		q = v
	case quantizer:
		var err error
		if q, err = v.Quantize(); err != nil {
			return errf(w.path, e.Name, "%v", err)
		}
	default:
		var err error
		if q, err = quantize.Tensor(e.Name, t, quantize.Int4Asym(gs)); err != nil {
			return fmt.Errorf("write %s: %w", w.path, err)
		}
	}
	if q.Bits != 4 || q.GroupSize != gs || q.GIdx != nil {
		return errf(w.path, e.Name, "quantized as %d-bit, group %d; ak48 needs 4-bit with group size %d (no g_idx)", q.Bits, q.GroupSize, gs)
	}
	if q.Zero == nil { // symmetric: AWQ GEMM stores zero code 8
		c := *q
		c.Zero = make([]float32, len(q.Scale))
		q = &c
	}
	qw, qz, sc, err := autoawq.Pack(q)
	if err != nil {
		return errf(w.path, e.Name, "%v", err)
	}
	for _, words := range [][]int32{qw, qz} {
		b := make([]byte, 4*len(words))
		for i, v := range words {
			binary.LittleEndian.PutUint32(b[4*i:], uint32(v))
		}
		if err := w.write(b); err != nil {
			return err
		}
	}
	b := make([]byte, 2*len(sc))
	for i, v := range sc {
		binary.LittleEndian.PutUint16(b[2*i:], v)
	}
	return w.write(b)
}

// freqs writes the legacy rope table: cos then sin of pos·θ^(−2i/hs) for
// pos < seq_len, i < hs/2, hs = dim/n_heads (as llama2.c's export computes
// it); readers skip it, only its size matters.
func (w *writer) freqs(e Entry) error {
	h := w.plan.layout.Header
	hs := h.Dim / h.Heads
	half := hs / 2
	n := model.NumElements(e.Shape)
	w.buf(min(n, chunkElems))
	value := func(i int) float32 {
		block := i / max(1, h.SeqLen*half)
		if half == 0 || block > 1 {
			return 0
		}
		k := i % (h.SeqLen * half)
		pos, j := k/half, k%half
		freq := 1 / math.Pow(w.plan.theta, float64(2*j)/float64(hs))
		a := float64(pos) * float64(float32(freq))
		if block == 0 {
			return float32(math.Cos(a))
		}
		return float32(math.Sin(a))
	}
	for i0 := 0; i0 < n; i0 += chunkElems {
		i1 := min(n, i0+chunkElems)
		f := w.f[:i1-i0]
		for i := range f {
			f[i] = value(i0 + i)
		}
		if err := w.write(encode(f, model.F32, w.b)); err != nil {
			return err
		}
	}
	return nil
}
