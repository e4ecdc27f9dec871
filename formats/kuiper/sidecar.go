package kuiper

import (
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"path/filepath"
	"strings"

	"qtool/formats/infile"
	"qtool/formats/model"
)

// Sidecar is the JSON file PATH.json that Write puts next to PATH. It
// records what the binary formats cannot: architecture, rope theta, norm
// epsilon, rope layout, head_dim and the tokenizer directory, so that a
// qtool-written file reads back exactly.
type Sidecar struct {
	Writer     string     `json:"writer"` // "qtool"
	Format     Format     `json:"format"`
	Arch       model.Arch `json:"arch"`
	RopeTheta  float64    `json:"rope_theta"`
	NormEps    float64    `json:"rms_norm_eps"`
	RopeLayout string     `json:"rope_layout"` // "half" or "interleaved"
	// Tied says the source model's lm_head was its embedding. Int8 files
	// still store a quantized classifier (always vocab = −V).
	Tied      bool   `json:"tied"`
	HeadDim   int    `json:"head_dim"`
	QKNorm    bool   `json:"qk_norm"`
	AttnBias  bool   `json:"attn_bias"`
	GroupSize int    `json:"group_size,omitempty"`
	MaxSeq    int    `json:"max_position_embeddings"`
	BOS       int    `json:"bos_token_id"`
	EOS       []int  `json:"eos_token_id"`
	DType     string `json:"source_dtype,omitempty"`
	// TokenizerDir is the directory holding the tokenizer files: relative
	// to the sidecar's directory when it lies inside it (the directory can
	// then move as a whole), else absolute. Readers resolve it with
	// Sidecar.Tokenizer.
	TokenizerDir string `json:"tokenizer_dir,omitempty"`
	// FileSize is the size of the binary file this sidecar describes;
	// readers refuse a file of another size (0: not recorded).
	FileSize int64 `json:"file_size"`
	// FileCRC32C is the CRC-32C (Castagnoli, 8 hex digits) of that file;
	// Open refuses a file whose checksum differs (empty: not recorded).
	FileCRC32C string `json:"file_crc32c,omitempty"`
	// Extension lists the tensors appended after the standard layout.
	Extension []string `json:"extension_tensors,omitempty"`
}

// SidecarPath is the sidecar file of a model file.
func SidecarPath(path string) string { return path + ".json" }

// ReadSidecar reads PATH.json; it returns nil and no error when there is none.
func ReadSidecar(path string) (*Sidecar, error) {
	sp := SidecarPath(path)
	data, err := infile.ReadFile(sp, infile.MetaLimit)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, err
	}
	return ParseSidecar(sp, data)
}

// ParseSidecar decodes sidecar JSON; name is used in errors.
func ParseSidecar(name string, data []byte) (*Sidecar, error) {
	var s Sidecar
	if err := json.Unmarshal(data, &s); err != nil {
		return nil, fmt.Errorf("%s: not a qtool kuiper sidecar: %w", name, err)
	}
	if f, ok := legacyFormats[string(s.Format)]; ok {
		s.Format = f
	}
	known := false
	for _, f := range AllFormats() {
		known = known || f == s.Format
	}
	if !known {
		return nil, fmt.Errorf("%s: unknown format %q (supported: %v)", name, s.Format, AllFormats())
	}
	switch s.Arch {
	case model.Llama, model.Qwen2, model.Qwen3:
	default:
		return nil, fmt.Errorf("%s: unknown architecture %q (supported: llama, qwen2, qwen3)", name, s.Arch)
	}
	switch s.RopeLayout {
	case "", "half", "interleaved":
	default:
		return nil, fmt.Errorf("%s: rope_layout %q, want \"half\" or \"interleaved\"", name, s.RopeLayout)
	}
	if s.HeadDim < 0 || s.HeadDim > maxDim {
		return nil, fmt.Errorf("%s: head_dim %d out of range", name, s.HeadDim)
	}
	return &s, nil
}

// Tokenizer resolves TokenizerDir of the sidecar of model file path: an
// absolute directory as it is, a relative one against the sidecar's
// directory ("" when none is recorded).
func (s *Sidecar) Tokenizer(path string) string {
	switch {
	case s == nil:
		return ""
	case s.TokenizerDir == "" || filepath.IsAbs(s.TokenizerDir):
		return s.TokenizerDir
	}
	return filepath.Join(filepath.Dir(SidecarPath(path)), s.TokenizerDir)
}

// relTokenizer expresses the tokenizer directory tok relative to the
// directory of the sidecar of model file path when it lies inside it (the
// usual model directory holding both: moving the directory keeps the
// reference valid); otherwise it returns tok made absolute (a relative path
// climbing out would break when the model file moves alone).
func relTokenizer(path, tok string) string {
	if tok == "" {
		return ""
	}
	abs, err := filepath.Abs(tok)
	if err != nil {
		return tok
	}
	base, err := filepath.Abs(filepath.Dir(SidecarPath(path)))
	if err != nil {
		return abs
	}
	if rel, err := filepath.Rel(base, abs); err == nil && rel != ".." && !strings.HasPrefix(rel, ".."+string(filepath.Separator)) {
		return rel
	}
	return abs
}
