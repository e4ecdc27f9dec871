// Package kuiper reads and writes the single-file model formats of
// KuiperLLama, llama2.c and the OrinMLLM fork (see
// ../shared/docs/kuiper-formats.md for the byte layouts):
//
//   - FP32: llama2.c "legacy v0" / Kuiper fp32. 28-byte header of 7 int32;
//     the sign of vocab says whether the classifier is shared; a freqs block of
//     seq_len·head_size floats that readers skip.
//   - Int8: Kuiper int8 (export.py --version 3). 32-byte header (7 int32 +
//     group size); every linear as int8 data then fp32 scales; always
//     vocab = −V with a quantized classifier; then the fp32 embedding and norms.
//   - AK42V1 / AK42V2: llama2.c "ak42" version 1 (fp32) and 2 (Q8_0), 256-byte
//     header, in llama2.c's tensor order.
//   - AK47 / AK48: OrinMLLM Qwen3 fp16 (version 4) and Qwen3 AWQ int4
//     (version 5), 256-byte header with head_dim (and group size) fields.
//
// FP32 and Int8 files carry no magic number; Open tells them apart by the
// exact file size their headers imply. None of these files records the rope
// theta, the norm epsilon, the architecture or the tokenizer, so Write also
// writes a small JSON sidecar PATH.json that Open uses when present.
//
// Tensors the original layouts have no slot for (the q/k norms of Qwen3 in
// the Llama layouts, the q/k/v biases of Qwen2 in the int8 and ak42 layouts)
// are appended after the standard body as fp32, in a fixed order, as a qtool
// extension. Kuiper's C++ reader ignores trailing bytes, so such files still
// load there — without those tensors, as another model: Write makes them
// only when asked for a file only qtool runs (WriteOptions.QtoolOnly;
// ReaderCompatible), but for Qwen2 in kuiper-int8, whose Kuiper files have
// no biases either (ReaderNote).
package kuiper

import (
	"encoding/binary"
	"fmt"
)

// Format names one file layout.
type Format string

// The formats this package reads and writes.
const (
	FP32   Format = "kuiper-fp32" // headerless llama2.c v0 / Kuiper fp32
	Int8   Format = "kuiper-int8" // headerless Kuiper int8 (export.py --version 3)
	AK42V1 Format = "ak42-v1"     // llama2.c version 1 (fp32)
	AK42V2 Format = "ak42-v2"     // llama2.c version 2 (Q8_0)
	AK47   Format = "ak47"        // OrinMLLM version 4: Qwen3 fp16
	AK48   Format = "ak48"        // OrinMLLM version 5: Qwen3 AWQ int4
)

// legacyFormats maps the names older qtool versions wrote into sidecars.
var legacyFormats = map[string]Format{"ak47-v4": AK47, "ak48-v5": AK48}

// AllFormats lists every format, in the order the CLI documents them.
func AllFormats() []Format { return []Format{FP32, Int8, AK42V1, AK42V2, AK47, AK48} }

// Magic numbers of the versioned formats (uint32 at offset 0; on disk the
// bytes read "24ka", "74ka", "84ka").
const (
	MagicAK42 uint32 = 0x616b3432
	MagicAK47 uint32 = 0x616b3437
	MagicAK48 uint32 = 0x616b3438
)

// Header sizes in bytes.
const (
	FP32HeaderSize      = 28
	Int8HeaderSize      = 32
	VersionedHeaderSize = 256
)

// maxDim bounds every header dimension, as model.Config.Validate does.
const maxDim = 1 << 24

// maxLayers bounds n_layers so that a hostile header cannot make a layout
// of billions of entries.
const maxLayers = 1 << 12

// Header is the decoded file header. Dimensions are as the header states
// them (vocab as an absolute value).
type Header struct {
	Format   Format
	Magic    uint32 // versioned formats only
	Version  int32  // versioned formats only
	Dim      int    // hidden_size
	FFN      int    // hidden_dim: the FFN intermediate size
	Layers   int
	Heads    int
	KVHeads  int
	Vocab    int   // |vocab_size|
	RawVocab int32 // vocab_size as stored (signed in the headerless formats)
	SeqLen   int
	// Shared: no classifier is stored; the embedding is the classifier
	// (sign of vocab in FP32/Int8, flag byte at offset 36 in versioned files).
	Shared    bool
	GroupSize int // Int8, AK42V2, AK48
	HeadDim   int // AK47/AK48 header field (offset 37); 0 elsewhere
}

// Size is the header size in bytes.
func (h *Header) Size() int {
	switch h.Format {
	case FP32:
		return FP32HeaderSize
	case Int8:
		return Int8HeaderSize
	}
	return VersionedHeaderSize
}

// FormatError is a malformed or unsupported file.
type FormatError struct {
	Path   string
	Tensor string // "" when the problem is in the header
	Msg    string
}

// Error implements error: "PATH: tensor "NAME": message".
func (e *FormatError) Error() string {
	p := e.Path
	if p == "" {
		p = "kuiper file"
	}
	if e.Tensor != "" {
		return fmt.Sprintf("%s: tensor %q: %s", p, e.Tensor, e.Msg)
	}
	return fmt.Sprintf("%s: %s", p, e.Msg)
}

func errf(path, tensor, format string, args ...any) error {
	return &FormatError{Path: path, Tensor: tensor, Msg: fmt.Sprintf(format, args...)}
}

func i32(b []byte, off int) int32 { return int32(binary.LittleEndian.Uint32(b[off:])) }

// dims reads the 7 config ints at off and checks them.
func dims(path string, b []byte, off int, h *Header) error {
	v := [7]int32{}
	for i := range v {
		v[i] = i32(b, off+4*i)
	}
	h.Dim, h.FFN, h.Layers, h.Heads, h.KVHeads = int(v[0]), int(v[1]), int(v[2]), int(v[3]), int(v[4])
	h.RawVocab = v[5]
	vocab := int64(v[5])
	if vocab < 0 {
		vocab = -vocab
	}
	h.Vocab = int(vocab)
	h.SeqLen = int(v[6])
	names := []string{"dim", "hidden_dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "seq_len"}
	vals := []int{h.Dim, h.FFN, h.Layers, h.Heads, h.KVHeads, h.Vocab, h.SeqLen}
	for i, x := range vals {
		if x <= 0 || x > maxDim {
			return errf(path, "", "header field %s = %d (at byte %d) is not in 1..%d", names[i], x, off+4*i, maxDim)
		}
	}
	if h.Layers > maxLayers {
		return errf(path, "", "header field n_layers = %d (at byte %d) is implausibly large (max %d)", h.Layers, off+8, maxLayers)
	}
	if h.Heads%h.KVHeads != 0 {
		return errf(path, "", "header: n_heads %d is not a multiple of n_kv_heads %d", h.Heads, h.KVHeads)
	}
	return nil
}

// ParseFP32Header decodes the 28-byte headerless fp32 header (llama2.c v0).
func ParseFP32Header(path string, b []byte) (Header, error) {
	if len(b) < FP32HeaderSize {
		return Header{}, errf(path, "", "%d bytes, too short for the %d-byte fp32 header", len(b), FP32HeaderSize)
	}
	h := Header{Format: FP32}
	if err := dims(path, b, 0, &h); err != nil {
		return Header{}, err
	}
	h.Shared = h.RawVocab > 0
	return h, nil
}

// ParseInt8Header decodes the 32-byte headerless Kuiper int8 header.
func ParseInt8Header(path string, b []byte) (Header, error) {
	if len(b) < Int8HeaderSize {
		return Header{}, errf(path, "", "%d bytes, too short for the %d-byte int8 header", len(b), Int8HeaderSize)
	}
	h := Header{Format: Int8}
	if err := dims(path, b, 0, &h); err != nil {
		return Header{}, err
	}
	h.Shared = h.RawVocab > 0
	h.GroupSize = int(i32(b, 28))
	if h.GroupSize <= 0 || h.GroupSize > maxDim {
		return Header{}, errf(path, "", "header field group_size = %d (at byte 28) is not in 1..%d", h.GroupSize, maxDim)
	}
	return h, nil
}

// IsVersioned reports whether b starts with an ak42/ak47/ak48 magic.
func IsVersioned(b []byte) bool {
	if len(b) < 4 {
		return false
	}
	m := binary.LittleEndian.Uint32(b)
	return m == MagicAK42 || m == MagicAK47 || m == MagicAK48
}

// ParseVersionedHeader decodes a 256-byte ak42 (versions 1, 2), ak47
// (version 4) or ak48 (version 5) header.
func ParseVersionedHeader(path string, b []byte) (Header, error) {
	if len(b) < VersionedHeaderSize {
		return Header{}, errf(path, "", "%d bytes, too short for the %d-byte versioned header", len(b), VersionedHeaderSize)
	}
	h := Header{Magic: binary.LittleEndian.Uint32(b), Version: i32(b, 4)}
	switch {
	case h.Magic == MagicAK42 && h.Version == 1:
		h.Format = AK42V1
	case h.Magic == MagicAK42 && h.Version == 2:
		h.Format = AK42V2
	case h.Magic == MagicAK47 && h.Version == 4:
		h.Format = AK47
	case h.Magic == MagicAK48 && h.Version == 5:
		h.Format = AK48
	default:
		return Header{}, errf(path, "", "magic %#08x with version %d is not supported (supported: ak42 v1/v2, ak47 v4, ak48 v5)", h.Magic, h.Version)
	}
	if err := dims(path, b, 8, &h); err != nil {
		return Header{}, err
	}
	if h.RawVocab < 0 {
		return Header{}, errf(path, "", "header: vocab_size %d is negative; versioned files store the shared flag at byte 36", h.RawVocab)
	}
	switch b[36] {
	case 0, 1:
		h.Shared = b[36] == 1
	default:
		return Header{}, errf(path, "", "header: shared_classifier byte at 36 is %d, want 0 or 1", b[36])
	}
	switch h.Format {
	case AK42V2:
		h.GroupSize = int(i32(b, 37))
	case AK47:
		h.HeadDim = int(i32(b, 37))
	case AK48:
		h.HeadDim = int(i32(b, 37))
		h.GroupSize = int(i32(b, 41))
	}
	if h.Format == AK42V2 || h.Format == AK48 {
		off := 37
		if h.Format == AK48 {
			off = 41
		}
		if h.GroupSize <= 0 || h.GroupSize > maxDim {
			return Header{}, errf(path, "", "header field group_size = %d (at byte %d) is not in 1..%d", h.GroupSize, off, maxDim)
		}
	}
	if h.Format == AK47 || h.Format == AK48 {
		if h.HeadDim <= 0 || h.HeadDim > maxDim || h.HeadDim%2 != 0 {
			return Header{}, errf(path, "", "header field head_dim = %d (at byte 37) is not a positive even number", h.HeadDim)
		}
	}
	return h, nil
}

// Encode renders h as its on-disk header bytes. Vocab is written as −V in
// the headerless formats when the classifier is not shared.
func (h *Header) Encode() []byte {
	b := make([]byte, h.Size())
	put := func(off int, v int) { binary.LittleEndian.PutUint32(b[off:], uint32(int32(v))) }
	vocab := h.Vocab
	base := 0
	switch h.Format {
	case FP32, Int8:
		if !h.Shared {
			vocab = -vocab
		}
	default:
		binary.LittleEndian.PutUint32(b, h.Magic)
		put(4, int(h.Version))
		base = 8
	}
	for i, v := range []int{h.Dim, h.FFN, h.Layers, h.Heads, h.KVHeads, vocab, h.SeqLen} {
		put(base+4*i, v)
	}
	switch h.Format {
	case Int8:
		put(28, h.GroupSize)
	case AK42V1, AK42V2, AK47, AK48:
		if h.Shared {
			b[36] = 1
		}
		switch h.Format {
		case AK42V2:
			put(37, h.GroupSize)
		case AK47:
			put(37, h.HeadDim)
		case AK48:
			put(37, h.HeadDim)
			put(41, h.GroupSize)
		}
	}
	return b
}

// magicVersion returns the magic and version of a versioned format.
func magicVersion(f Format) (uint32, int32) {
	switch f {
	case AK42V1:
		return MagicAK42, 1
	case AK42V2:
		return MagicAK42, 2
	case AK47:
		return MagicAK47, 4
	case AK48:
		return MagicAK48, 5
	}
	return 0, 0
}
