package kuiper

import (
	"qtool/formats/model"
)

// Kind is how one entry of a file is stored.
type Kind uint8

// Entry kinds.
const (
	// KindF32 is little-endian float32, row-major.
	KindF32 Kind = iota + 1
	// KindF16 is little-endian IEEE half, row-major.
	KindF16
	// KindQ8 is int8[n] then float32 scales[n/GroupSize]; groups are
	// consecutive runs of the flattened [out, in] matrix (they may cross rows).
	KindQ8
	// KindAWQ is AutoAWQ GEMM: qweight int32 [in, out/8], qzeros int32
	// [in/G, out/8], scales fp16 [in/G, out].
	KindAWQ
	// KindFreqs is the fp32 rope table of the legacy fp32 format
	// (seq_len·head_size floats: cos then sin); readers skip it.
	KindFreqs
)

// String names the kind as inspect prints it.
func (k Kind) String() string {
	switch k {
	case KindF32:
		return "F32"
	case KindF16:
		return "F16"
	case KindQ8:
		return "Q8(int8+f32 scales)"
	case KindAWQ:
		return "AWQ4(GEMM)"
	case KindFreqs:
		return "F32(freqs, skipped)"
	}
	return "?"
}

// FreqsName is the entry name of the legacy fp32 rope table.
const FreqsName = "freqs"

// Entry is one tensor's place in a file.
type Entry struct {
	Name      string // canonical tensor name (model.Name), or FreqsName
	Kind      Kind
	Shape     []int // logical shape ([out, in] for linears)
	Offset    int64 // byte offset from the start of the file
	Size      int64 // bytes
	Extension bool  // qtool extension appended after the standard layout
}

// Shapes are the layout-relevant facts a header may not record.
type Shapes struct {
	HeadDim  int  // 0: Dim/Heads (the AK47/AK48 header states it)
	QKNorm   bool // Qwen3 q_norm/k_norm tensors
	AttnBias bool // Qwen2 q/k/v biases
}

// Layout is the complete byte map of a file.
type Layout struct {
	Header  Header
	Shapes  Shapes
	Entries []Entry
	Size    int64 // total file size in bytes
}

// Lookup returns the entry of a tensor.
func (l *Layout) Lookup(name string) (Entry, bool) {
	for _, e := range l.Entries {
		if e.Name == name {
			return e, true
		}
	}
	return Entry{}, false
}

type builder struct {
	path    string
	h       *Header
	off     int64
	limit   int64 // stop early once past this size (< 0: no limit)
	entries []Entry
	err     error
	ext     bool
}

func (b *builder) add(name string, k Kind, shape ...int) {
	if b.err != nil {
		return
	}
	n := int64(1)
	for _, d := range shape {
		n *= int64(d) // every dimension is <= 2^24 and shapes have <= 2 dims
	}
	var size int64
	switch k {
	case KindF32, KindFreqs:
		size = 4 * n
	case KindF16:
		size = 2 * n
	case KindQ8:
		gs := int64(b.h.GroupSize)
		if n%gs != 0 {
			b.err = errf(b.path, name, "group size %d does not divide its %d weights (shape %v)", gs, n, shape)
			return
		}
		size = n + 4*(n/gs)
	case KindAWQ:
		out, in, g := int64(shape[0]), int64(shape[1]), int64(b.h.GroupSize)
		if out%8 != 0 {
			b.err = errf(b.path, name, "%d output features is not a multiple of 8 (AWQ GEMM packing)", out)
			return
		}
		if in%g != 0 {
			b.err = errf(b.path, name, "group size %d does not divide %d input features", g, in)
			return
		}
		size = 4*in*(out/8) + 4*(in/g)*(out/8) + 2*(in/g)*out
	}
	b.entries = append(b.entries, Entry{Name: name, Kind: k, Shape: append([]int(nil), shape...), Offset: b.off, Size: size, Extension: b.ext})
	b.off += size
	if b.limit >= 0 && b.off > b.limit {
		b.err = errf(b.path, name, "needs bytes up to offset %d but the file has %d (truncated?)", b.off, b.limit)
	}
}

func (b *builder) layers(L int, r model.Role, k Kind, shape ...int) {
	for l := 0; l < L && b.err == nil; l++ {
		b.add(model.Name(l, r), k, shape...)
	}
}

// NewLayout computes where every tensor of a file with header h lives. path
// is used in errors; limit (the file size, or −1) stops the computation as
// soon as the layout runs past it, so a hostile header cannot make it loop.
func NewLayout(path string, h Header, s Shapes, limit int64) (*Layout, error) {
	D, F, L, V := h.Dim, h.FFN, h.Layers, h.Vocab
	hd := s.HeadDim
	switch {
	case h.Format == AK47 || h.Format == AK48:
		if hd != 0 && hd != h.HeadDim {
			return nil, errf(path, "", "head_dim %d from the sidecar/options differs from the header's %d", hd, h.HeadDim)
		}
		hd = h.HeadDim
		if !s.QKNorm || s.AttnBias {
			return nil, errf(path, "", "%s holds Qwen3 models only (q/k norms, no attention biases)", h.Format)
		}
	case hd == 0:
		if D%h.Heads != 0 {
			return nil, errf(path, "", "dim %d is not a multiple of n_heads %d; head_dim must be given", D, h.Heads)
		}
		hd = D / h.Heads
	}
	if hd <= 0 || hd > maxDim {
		return nil, errf(path, "", "head_dim %d is not in 1..%d", hd, maxDim)
	}
	Q, KV := h.Heads*hd, h.KVHeads*hd
	if Q > maxDim {
		return nil, errf(path, "", "n_heads·head_dim = %d is implausibly large", Q)
	}
	b := &builder{path: path, h: &h, off: int64(h.Size()), limit: limit}
	linears := func(k Kind) {
		b.layers(L, model.Q, k, Q, D)
		b.layers(L, model.K, k, KV, D)
		b.layers(L, model.V, k, KV, D)
		b.layers(L, model.O, k, D, Q)
		b.layers(L, model.Gate, k, F, D)
		b.layers(L, model.Down, k, D, F)
		b.layers(L, model.Up, k, F, D)
	}
	norms := func(k Kind) {
		b.layers(L, model.AttnNorm, k, D)
		b.layers(L, model.MLPNorm, k, D)
		b.add(model.Name(-1, model.FinalNorm), k, D)
	}
	classifier := func(k Kind) {
		if !h.Shared {
			b.add(model.Name(-1, model.LMHead), k, V, D)
		}
	}
	extension := func(biases bool) {
		b.ext = true
		if s.QKNorm {
			b.layers(L, model.QNorm, KindF32, hd)
			b.layers(L, model.KNorm, KindF32, hd)
		}
		if biases && s.AttnBias {
			b.layers(L, model.QBias, KindF32, Q)
			b.layers(L, model.KBias, KindF32, KV)
			b.layers(L, model.VBias, KindF32, KV)
		}
		b.ext = false
	}
	switch h.Format {
	case FP32:
		b.add(model.Name(-1, model.Embed), KindF32, V, D)
		b.layers(L, model.AttnNorm, KindF32, D)
		// Kuiper's Qwen2 fp32 layout puts each bias right after its weight.
		for _, p := range []struct {
			w, bias model.Role
			rows    int
		}{{model.Q, model.QBias, Q}, {model.K, model.KBias, KV}, {model.V, model.VBias, KV}} {
			for l := 0; l < L && b.err == nil; l++ {
				b.add(model.Name(l, p.w), KindF32, p.rows, D)
				if s.AttnBias {
					b.add(model.Name(l, p.bias), KindF32, p.rows)
				}
			}
		}
		b.layers(L, model.O, KindF32, D, Q)
		b.layers(L, model.MLPNorm, KindF32, D)
		b.layers(L, model.Gate, KindF32, F, D)
		b.layers(L, model.Down, KindF32, D, F)
		b.layers(L, model.Up, KindF32, F, D)
		b.add(model.Name(-1, model.FinalNorm), KindF32, D)
		// Kuiper skips seq_len·(dim/n_heads) floats, whatever the true head_dim.
		b.add(FreqsName, KindFreqs, h.SeqLen*(D/h.Heads))
		classifier(KindF32)
		extension(false)
	case Int8:
		linears(KindQ8)
		classifier(KindQ8)
		b.add(model.Name(-1, model.Embed), KindF32, V, D)
		norms(KindF32)
		extension(true)
	case AK42V1:
		norms(KindF32)
		b.add(model.Name(-1, model.Embed), KindF32, V, D)
		linears(KindF32)
		classifier(KindF32)
		extension(true)
	case AK42V2:
		norms(KindF32)
		b.add(model.Name(-1, model.Embed), KindQ8, V, D)
		linears(KindQ8)
		classifier(KindQ8)
		extension(true)
	case AK47, AK48:
		norms(KindF16)
		b.add(model.Name(-1, model.Embed), KindF16, V, D)
		if h.Format == AK47 {
			linears(KindF16)
		} else {
			linears(KindAWQ)
		}
		classifier(KindF16)
		b.layers(L, model.QNorm, KindF16, hd)
		b.layers(L, model.KNorm, KindF16, hd)
	default:
		return nil, errf(path, "", "unknown format %q", h.Format)
	}
	if b.err != nil {
		return nil, b.err
	}
	s.HeadDim = hd
	return &Layout{Header: h, Shapes: s, Entries: b.entries, Size: b.off}, nil
}
