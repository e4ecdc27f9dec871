package kuiper

import (
	"encoding/binary"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"math"
	"syscall"

	"qtool/formats/autoawq"
	"qtool/formats/infile"
	"qtool/formats/model"
)

// OpenOptions says what a file does not: zero values mean "from the
// sidecar, else the default". Defaults: Llama for FP32/Int8/ak42 (rope theta
// 1e4, eps 1e-5, interleaved rope as llama2.c and Kuiper's Llama-2 build
// expect, BOS 1, EOS 2); Qwen3 for ak47/ak48 (theta 1e6, eps 1e-6, half
// rope); Qwen2: theta 1e6, eps 1e-6, half rope.
type OpenOptions struct {
	Format       Format            // force a format instead of sniffing
	Arch         model.Arch        // architecture of a file without sidecar
	HeadDim      int               // head_dim of a headerless file whose dim/n_heads is not it
	RopeTheta    float64           // override rope theta
	NormEps      float64           // override RMSNorm epsilon
	Rope         *model.RopeLayout // override the q/k layout
	TokenizerDir string            // override the tokenizer directory
	NoSidecar    bool              // ignore PATH.json
}

// Info is what DecodeHeader learns without reading any tensor.
type Info struct {
	Path     string
	FileSize int64
	Header   Header
	Sidecar  *Sidecar // nil when there is none
	Config   model.Config
	Layout   *Layout
}

// DecodeHeader reads only the header (and the sidecar) of path, works out
// the format and checks that the file size matches the layout exactly.
func DecodeHeader(path string, opt OpenOptions) (*Info, error) {
	f, fi, err := infile.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	prefix := make([]byte, VersionedHeaderSize)
	n, err := io.ReadFull(f, prefix)
	if err != nil && !errors.Is(err, io.ErrUnexpectedEOF) && !errors.Is(err, io.EOF) {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	var side *Sidecar
	if !opt.NoSidecar {
		if side, err = ReadSidecar(path); err != nil {
			return nil, err
		}
	}
	return Sniff(path, prefix[:n], fi.Size(), side, opt)
}

// Sniff works out the format of a file from its first bytes (at least the
// header), its size and its sidecar (may be nil). Versioned files are told by
// their magic; the headerless FP32 and Int8 files by the exact size each
// header implies.
func Sniff(path string, prefix []byte, size int64, side *Sidecar, opt OpenOptions) (*Info, error) {
	info, err := sniff(path, prefix, size, side, opt)
	if side != nil && side.FileSize > 0 && side.FileSize != size {
		mismatch := fmt.Sprintf("file is %d bytes but its sidecar %s describes a file of %d bytes: the two come from different runs (an interrupted write?) or the file was cut; write the file again, or remove the sidecar to read the file without it", size, SidecarPath(path), side.FileSize)
		if err != nil {
			return nil, fmt.Errorf("%w (%s)", err, mismatch)
		}
		return nil, errf(path, "", "%s", mismatch)
	}
	return info, err
}

func sniff(path string, prefix []byte, size int64, side *Sidecar, opt OpenOptions) (*Info, error) {
	format := opt.Format
	if format == "" && side != nil {
		format = side.Format
	}
	if format == "" && IsVersioned(prefix) {
		h, err := ParseVersionedHeader(path, prefix)
		if err != nil {
			return nil, err
		}
		format = h.Format
	}
	if format != "" {
		return sniffAs(path, format, prefix, size, side, opt)
	}
	// Headerless: try fp32 and int8 with each plausible architecture.
	archs := []model.Arch{model.Llama, model.Qwen2, model.Qwen3}
	if opt.Arch != "" {
		archs = []model.Arch{opt.Arch}
	}
	var found []*Info
	var reasons []error
	for _, f := range []Format{FP32, Int8} {
		for _, a := range archs {
			o := opt
			o.Arch = a
			info, err := sniffAs(path, f, prefix, size, side, o)
			if err != nil {
				if a == archs[0] {
					reasons = append(reasons, fmt.Errorf("as %s: %w", f, err))
				}
				continue
			}
			found = append(found, info)
			break
		}
	}
	switch len(found) {
	case 1:
		return found[0], nil
	case 0:
		return nil, fmt.Errorf("%s: not a Kuiper/llama2.c/OrinMLLM file (no ak42/ak47/ak48 magic; size %d bytes fits no headerless layout): %w", path, size, errors.Join(reasons...))
	}
	return nil, fmt.Errorf("%s: ambiguous: the file fits both the fp32 and int8 layouts; pass OpenOptions.Format", path)
}

func sniffAs(path string, format Format, prefix []byte, size int64, side *Sidecar, opt OpenOptions) (*Info, error) {
	var h Header
	var err error
	switch format {
	case FP32:
		h, err = ParseFP32Header(path, prefix)
	case Int8:
		h, err = ParseInt8Header(path, prefix)
	case AK42V1, AK42V2, AK47, AK48:
		h, err = ParseVersionedHeader(path, prefix)
		if err == nil && h.Format != format {
			err = errf(path, "", "header says %s, expected %s", h.Format, format)
		}
	default:
		err = errf(path, "", "unknown format %q", format)
	}
	if err != nil {
		return nil, err
	}
	cfg, shapes := configFor(h, side, opt)
	l, err := NewLayout(path, h, shapes, size)
	if err != nil {
		return nil, err
	}
	if l.Size != size {
		last := l.Entries[len(l.Entries)-1].Name
		return nil, errf(path, "", "%d trailing bytes after the last tensor %q (layout ends at %d, file is %d bytes)", size-l.Size, last, l.Size, size)
	}
	cfg.HeadDim = l.Shapes.HeadDim
	if err := cfg.Validate(); err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &Info{Path: path, FileSize: size, Header: h, Sidecar: side, Config: cfg, Layout: l}, nil
}

// AssumedRope is the q/k layout a file of architecture arch is read in when
// no sidecar records it: interleaved for Llama (llama2.c, Kuiper's Llama-2
// build), half for Qwen.
func AssumedRope(arch model.Arch) model.RopeLayout {
	if arch == model.Llama {
		return model.RopeInterleaved
	}
	return model.RopeHalf
}

// configFor combines header, sidecar and options into a config and the
// layout-relevant shapes. HeadDim is settled by NewLayout.
func configFor(h Header, side *Sidecar, opt OpenOptions) (model.Config, Shapes) {
	arch := model.Llama
	if h.Format == AK47 || h.Format == AK48 {
		arch = model.Qwen3
	}
	if side != nil {
		arch = side.Arch
	}
	if opt.Arch != "" {
		arch = opt.Arch
	}
	c := model.Config{Arch: arch, Hidden: h.Dim, Intermediate: h.FFN, Layers: h.Layers, Heads: h.Heads,
		KVHeads: h.KVHeads, Vocab: h.Vocab, MaxSeq: h.SeqLen, Tied: h.Shared}
	s := Shapes{HeadDim: h.HeadDim, QKNorm: arch == model.Qwen3, AttnBias: arch == model.Qwen2}
	switch arch {
	case model.Llama:
		c.RopeTheta, c.NormEps, c.BOS, c.EOS = 1e4, 1e-5, 1, []int{2}
	default:
		c.RopeTheta, c.NormEps, c.BOS = 1e6, 1e-6, -1
	}
	c.Rope = AssumedRope(arch)
	switch h.Format {
	case AK47, AK48:
		c.DType = "float16"
	default:
		c.DType = "float32"
	}
	if side != nil && (opt.Arch == "" || opt.Arch == side.Arch) {
		c.RopeTheta, c.NormEps, c.BOS, c.EOS = side.RopeTheta, side.NormEps, side.BOS, side.EOS
		c.Rope = model.RopeHalf
		if side.RopeLayout == "interleaved" {
			c.Rope = model.RopeInterleaved
		}
		if side.HeadDim > 0 {
			s.HeadDim = side.HeadDim
		}
		s.QKNorm, s.AttnBias = side.QKNorm, side.AttnBias
		if side.MaxSeq > 0 {
			c.MaxSeq = side.MaxSeq
		}
		if side.DType != "" {
			c.DType = side.DType
		}
	}
	if opt.HeadDim > 0 {
		s.HeadDim = opt.HeadDim
	}
	if opt.RopeTheta > 0 {
		c.RopeTheta = opt.RopeTheta
	}
	if opt.NormEps > 0 {
		c.NormEps = opt.NormEps
	}
	if opt.Rope != nil {
		c.Rope = *opt.Rope
	}
	c.QKNorm, c.AttnBias = s.QKNorm, s.AttnBias
	return c, s
}

// Open reads a Kuiper, llama2.c ak42 or OrinMLLM ak47/ak48 file. Float
// tensors alias a read-only memory mapping of the file until the model is
// closed; int8 and AWQ tensors are decoded into *model.Quantized (int8
// tensors whose groups cross rows are dequantized to F32 instead).
func Open(path string, opt OpenOptions) (*model.Model, error) {
	f, fi, err := infile.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if fi.Size() < FP32HeaderSize {
		return nil, errf(path, "", "file is %d bytes, too short for any Kuiper header", fi.Size())
	}
	if fi.Size() > math.MaxInt {
		return nil, errf(path, "", "file too large to map")
	}
	data, err := syscall.Mmap(int(f.Fd()), 0, int(fi.Size()), syscall.PROT_READ, syscall.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("%s: mmap: %w", path, err)
	}
	var side *Sidecar
	if !opt.NoSidecar {
		if side, err = ReadSidecar(path); err != nil {
			syscall.Munmap(data)
			return nil, err
		}
	}
	m, err := decode(path, data, side, opt)
	if err != nil {
		syscall.Munmap(data)
		return nil, err
	}
	m.AddCloser(unmapper(data))
	return m, nil
}

type unmapper []byte

func (u unmapper) Close() error { return syscall.Munmap(u) }

// Decode reads a whole file held in memory; float tensors alias data. side
// may be nil. name is used in errors.
func Decode(name string, data []byte, side *Sidecar, opt OpenOptions) (*model.Model, error) {
	return decode(name, data, side, opt)
}

func decode(path string, data []byte, side *Sidecar, opt OpenOptions) (*model.Model, error) {
	prefix := data
	if len(prefix) > VersionedHeaderSize {
		prefix = prefix[:VersionedHeaderSize]
	}
	info, err := Sniff(path, prefix, int64(len(data)), side, opt)
	if err != nil {
		return nil, err
	}
	if side != nil && side.FileCRC32C != "" {
		if sum := fmt.Sprintf("%08x", crc32.Checksum(data, crc32.MakeTable(crc32.Castagnoli))); sum != side.FileCRC32C {
			return nil, errf(path, "", "CRC-32C %s, but its sidecar %s describes a file with CRC-32C %s: the two come from different runs (an interrupted write?) or the file changed; write it again, or remove the sidecar to read the file without it", sum, SidecarPath(path), side.FileCRC32C)
		}
	}
	m := model.New(info.Config)
	m.Source, m.Format = path, string(info.Header.Format)
	if side != nil {
		m.TokenizerDir = side.Tokenizer(path)
	}
	if opt.TokenizerDir != "" {
		m.TokenizerDir = opt.TokenizerDir
	}
	for _, e := range info.Layout.Entries {
		if e.Kind == KindFreqs {
			continue
		}
		t, err := decodeEntry(path, info.Header, e, data[e.Offset:e.Offset+e.Size])
		if err != nil {
			return nil, err
		}
		m.Set(e.Name, t)
	}
	if err := m.CheckShapes(); err != nil {
		return nil, err
	}
	return m, nil
}

func decodeEntry(path string, h Header, e Entry, b []byte) (model.Tensor, error) {
	switch e.Kind {
	case KindF32:
		return model.NewDense(model.F32, e.Shape, b)
	case KindF16:
		return model.NewDense(model.F16, e.Shape, b)
	case KindQ8:
		return decodeQ8(h.GroupSize, e.Shape, b), nil
	case KindAWQ:
		out, in, g := e.Shape[0], e.Shape[1], h.GroupSize
		nw, nz := in*(out/8), (in/g)*(out/8)
		qw, qz := make([]int32, nw), make([]int32, nz)
		for i := range qw {
			qw[i] = int32(binary.LittleEndian.Uint32(b[4*i:]))
		}
		b = b[4*nw:]
		for i := range qz {
			qz[i] = int32(binary.LittleEndian.Uint32(b[4*i:]))
		}
		b = b[4*nz:]
		sc := make([]uint16, (in/g)*out)
		for i := range sc {
			sc[i] = binary.LittleEndian.Uint16(b[2*i:])
		}
		q, err := autoawq.Unpack(qw, qz, sc, in, out, g)
		if err != nil {
			return nil, errf(path, e.Name, "%v", err)
		}
		return q, nil
	}
	return nil, errf(path, e.Name, "unknown entry kind %d", e.Kind)
}

// decodeQ8 turns int8 data + fp32 scales into a *model.Quantized when the
// groups stay within rows, or a dequantized F32 tensor otherwise (b has
// exactly the entry's bytes).
func decodeQ8(gs int, shape []int, b []byte) model.Tensor {
	n := model.NumElements(shape)
	scales := make([]float32, n/gs)
	for i := range scales {
		scales[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[n+4*i:]))
	}
	if len(shape) == 2 && shape[1]%gs == 0 {
		q := make([]int8, n)
		for i := range q {
			q[i] = int8(b[i])
		}
		return &model.Quantized{Bits: 8, GroupSize: gs, Rows: shape[0], Cols: shape[1], Q: q, Scale: scales}
	}
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(int8(b[i])) * scales[i/gs]
	}
	return model.FromFloat32(shape, v)
}
