// Package shard splits a model for tensor parallelism (Megatron style) and
// stores the result as one safetensors file per rank plus a JSON manifest.
//
// Splitting rules (n ranks):
//   - column-parallel, split on the output dimension (dim 0): q, k, v (whole
//     heads per rank) with their biases, gate and up;
//   - row-parallel, split on the input dimension (dim 1): o (whole heads) and
//     down;
//   - vocabulary-parallel, split on dim 0: the embedding table (each rank
//     looks up the ids in its range, zero elsewhere, then all-reduce) and
//     lm_head (each rank computes its slice of the logits, then all-gather);
//   - everything else (norms, norm biases, q_norm/k_norm) is replicated.
//
// Quantized weights are split on quantization boundaries only: a split of
// the input dimension must fall on a group boundary (the scales of a group
// must live on one rank), and 4-bit weights must split on multiples of 8
// in both dimensions (the AWQ/GPTQ int32 packing). A row-parallel W8A8
// layer keeps its quant_bias and bias on rank 0 only (zeros elsewhere), so
// the all-reduce of the partial products adds them once.
//
// A shard directory holds manifest.json and rank-<r>.safetensors for every
// rank r, each holding canonical tensor names (see package model): a float
// tensor keeps its dtype and bytes; a quantized tensor is stored as parts
// NAME.q (int8 codes, or NAME.q4: 4-bit codes packed 8 per int32 along the
// input dimension, lowest nibble first), NAME.scale, NAME.zero, NAME.g_idx;
// a W8A8 layer as NAME.weight, NAME.weight_scale, NAME.input_scale,
// NAME.input_offset, NAME.deq_scale, NAME.quant_bias and NAME.bias.
// Concatenating the parts of every rank reproduces each source tensor bit
// for bit (Join). The manifest's config records the model's rope layout.
// The formats registry (package convert) reads a shard directory like any
// other format ("shard"), so every command takes one as input.
package shard

import (
	"bytes"
	"encoding/json"
	"fmt"
	"strconv"

	"qtool/formats/model"
)

// Split says how a tensor is divided over the ranks.
type Split string

// Splits.
const (
	// Replicated tensors are stored whole on every rank.
	Replicated Split = "replicated"
	// Column is the output dimension (dim 0) of a column-parallel linear
	// weight or its bias.
	Column Split = "column"
	// Row is the input dimension (dim 1) of a row-parallel linear weight.
	Row Split = "row"
	// Vocab is dim 0 of the embedding table or the classifier.
	Vocab Split = "vocab"
)

// Dim is the tensor dimension the split divides (−1 for Replicated).
func (s Split) Dim() int {
	switch s {
	case Column, Vocab:
		return 0
	case Row:
		return 1
	}
	return -1
}

// Tensor kinds in a manifest.
const (
	KindDense     = "dense"     // *model.Dense (float)
	KindQuantized = "quantized" // *model.Quantized
	KindW8A8      = "w8a8"      // *model.W8A8
)

// ManifestFormat is the "format" value of every manifest.
const ManifestFormat = "qtool-tp-shard"

// ManifestVersion is the manifest version this package writes and reads.
const ManifestVersion = 1

// ManifestFile is the manifest's name inside a shard directory.
const ManifestFile = "manifest.json"

// MaxWorldSize bounds the number of ranks a manifest may describe.
const MaxWorldSize = 1024

// Entry describes one tensor of the source model and its split.
type Entry struct {
	Name string `json:"name"`
	Kind string `json:"kind"`
	// DType of a dense tensor (F32, F16, BF16, ...).
	DType string `json:"dtype,omitempty"`
	// Bits and GroupSize of a quantized tensor (a W8A8 weight: 8 and 0).
	Bits      int `json:"bits,omitempty"`
	GroupSize int `json:"group_size,omitempty"`
	// Zero, GIdx: the quantized tensor has zero points / a g_idx.
	Zero bool `json:"zero,omitempty"`
	GIdx bool `json:"g_idx,omitempty"`
	// Bias: the W8A8 layer has a float bias.
	Bias bool `json:"bias,omitempty"`
	// Shape of the whole (unsplit) tensor.
	Shape []int `json:"shape"`
	Split Split `json:"split"`
	// Dim is Split.Dim(), recorded for readers of the JSON.
	Dim int `json:"dim"`
	// Ranges holds, per rank, the half-open range [begin, end) of Dim that
	// the rank stores; nil for replicated tensors.
	Ranges [][2]int `json:"ranges,omitempty"`
}

// PartShape is the shape rank r stores.
func (e *Entry) PartShape(r int) []int {
	s := append([]int(nil), e.Shape...)
	if e.Split != Replicated {
		s[e.Split.Dim()] = e.Ranges[r][1] - e.Ranges[r][0]
	}
	return s
}

// Manifest describes a shard directory.
type Manifest struct {
	Format    string `json:"format"`
	Version   int    `json:"version"`
	WorldSize int    `json:"world_size"`
	// Source and SourceFormat name the model that was split.
	Source       string `json:"source,omitempty"`
	SourceFormat string `json:"source_format,omitempty"`
	// Config is the architecture of the whole model.
	Config model.Config `json:"config"`
	// Files lists the rank files, relative to the directory, by rank.
	Files   []string `json:"files"`
	Tensors []Entry  `json:"tensors"`
}

// Entry returns the manifest entry of name.
func (m *Manifest) Entry(name string) (*Entry, bool) {
	for i := range m.Tensors {
		if m.Tensors[i].Name == name {
			return &m.Tensors[i], true
		}
	}
	return nil, false
}

// RankFile is the conventional file name of rank r.
func RankFile(r int) string { return "rank-" + strconv.Itoa(r) + ".safetensors" }

// ParseManifest decodes and validates a manifest; file names the source in
// errors.
func ParseManifest(file string, data []byte) (*Manifest, error) {
	var m Manifest
	dec := json.NewDecoder(bytes.NewReader(data))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&m); err != nil {
		return nil, fmt.Errorf("%s: not a valid shard manifest: %w", file, err)
	}
	if err := m.Validate(); err != nil {
		return nil, fmt.Errorf("%s: %w", file, err)
	}
	return &m, nil
}

// Validate checks the manifest's internal consistency: format and version,
// one file per rank, every tensor split according to the rules for the
// configured architecture, ranges contiguous and covering the dimension.
func (m *Manifest) Validate() error {
	if m.Format != ManifestFormat {
		return fmt.Errorf("manifest format %q, want %q", m.Format, ManifestFormat)
	}
	if m.Version != ManifestVersion {
		return fmt.Errorf("manifest version %d, this qtool reads version %d", m.Version, ManifestVersion)
	}
	n := m.WorldSize
	if n < 1 || n > MaxWorldSize {
		return fmt.Errorf("manifest world_size %d, want 1..%d", n, MaxWorldSize)
	}
	if err := m.Config.Validate(); err != nil {
		return fmt.Errorf("manifest: %w", err)
	}
	if err := CheckTP(m.Config, n); err != nil {
		return fmt.Errorf("manifest: %w", err)
	}
	if len(m.Files) != n {
		return fmt.Errorf("manifest lists %d rank files for world_size %d", len(m.Files), n)
	}
	seenFile := map[string]bool{}
	for r, f := range m.Files {
		if f == "" || f == "." || f == ".." || bytes.ContainsAny([]byte(f), "/\\\x00") {
			return fmt.Errorf("manifest: rank %d file %q is not a plain file name", r, f)
		}
		if seenFile[f] {
			return fmt.Errorf("manifest: file %q is listed for two ranks", f)
		}
		seenFile[f] = true
	}
	if len(m.Tensors) == 0 {
		return fmt.Errorf("manifest lists no tensors")
	}
	seen := map[string]bool{}
	for i := range m.Tensors {
		e := &m.Tensors[i]
		if seen[e.Name] {
			return fmt.Errorf("manifest: tensor %q is listed twice", e.Name)
		}
		seen[e.Name] = true
		if err := m.validateEntry(e); err != nil {
			return fmt.Errorf("manifest: tensor %q: %w", e.Name, err)
		}
	}
	return nil
}

func (m *Manifest) validateEntry(e *Entry) error {
	if _, _, ok := model.ParseName(e.Name); !ok {
		return fmt.Errorf("not a canonical tensor name")
	}
	if len(e.Shape) < 1 || len(e.Shape) > 2 {
		return fmt.Errorf("shape %v: want 1 or 2 dimensions", e.Shape)
	}
	for _, d := range e.Shape {
		if d <= 0 || d > 1<<31 {
			return fmt.Errorf("shape %v: bad dimension", e.Shape)
		}
	}
	switch e.Kind {
	case KindDense:
		dt, err := model.ParseDType(e.DType)
		if err != nil {
			return err
		}
		if !dt.IsFloat() {
			return fmt.Errorf("dense dtype %v is not a float type", dt)
		}
		if e.Bits != 0 || e.GroupSize != 0 || e.Zero || e.GIdx || e.Bias {
			return fmt.Errorf("dense tensor with quantization fields")
		}
	case KindQuantized, KindW8A8:
		if len(e.Shape) != 2 {
			return fmt.Errorf("%s tensor with shape %v, want [out, in]", e.Kind, e.Shape)
		}
		if e.DType != "" {
			return fmt.Errorf("%s tensor with a dtype", e.Kind)
		}
		if e.Bits < 2 || e.Bits > 8 {
			return fmt.Errorf("%d bits, want 2..8", e.Bits)
		}
		if e.GroupSize < 0 || (e.GroupSize > 0 && e.Shape[1]%e.GroupSize != 0) {
			return fmt.Errorf("group size %d does not divide %d input columns", e.GroupSize, e.Shape[1])
		}
		if e.Kind == KindW8A8 && (e.Bits != 8 || e.GroupSize != 0 || e.Zero || e.GIdx) {
			return fmt.Errorf("w8a8 weight must be 8-bit per-channel symmetric")
		}
		if e.Kind == KindQuantized && e.Bias {
			return fmt.Errorf("quantized tensor with a w8a8 bias flag")
		}
	default:
		return fmt.Errorf("kind %q, want %s, %s or %s", e.Kind, KindDense, KindQuantized, KindW8A8)
	}
	split, ranges, err := Layout(m.Config, m.WorldSize, e.Name, e.Shape)
	if err != nil {
		return err
	}
	if e.Split != split {
		return fmt.Errorf("split %q, the rules for %s give %q", e.Split, m.Config.Arch, split)
	}
	if e.Dim != split.Dim() {
		return fmt.Errorf("dim %d, a %s split divides dim %d", e.Dim, split, split.Dim())
	}
	if len(e.Ranges) != len(ranges) {
		return fmt.Errorf("%d ranges, want %d", len(e.Ranges), len(ranges))
	}
	for r := range ranges {
		if e.Ranges[r] != ranges[r] {
			return fmt.Errorf("rank %d range %v, want %v", r, e.Ranges[r], ranges[r])
		}
	}
	return checkAlign(e.Kind, e.Bits, e.GroupSize, e.Shape, split, ranges)
}
