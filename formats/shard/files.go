package shard

import (
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"qtool/formats/hf"
	"qtool/formats/infile"
	"qtool/formats/model"
	"qtool/formats/safetensors"
)

// Metadata keys of a rank file.
const (
	metaRank  = "qtool.tp.rank"
	metaWorld = "qtool.tp.world_size"
)

// Format is the model.Model Format of models opened from a shard directory
// (the registry's codec name; older qtool versions said "qtool-shard").
const Format = "shard"

// IsDir reports whether path is a shard directory (holds manifest.json).
func IsDir(path string) bool {
	fi, err := os.Stat(filepath.Join(path, ManifestFile))
	return err == nil && fi.Mode().IsRegular()
}

// Plan checks that m can be split over n ranks and returns the manifest
// describing the split, without writing anything. Lazily quantized tensors
// are quantized to learn their layout.
func Plan(m *model.Model, n int) (*Manifest, error) {
	src := m.Source
	if src == "" {
		src = "model"
	}
	if err := CheckTP(m.Config, n); err != nil {
		return nil, fmt.Errorf("%s: %w", src, err)
	}
	man := &Manifest{Format: ManifestFormat, Version: ManifestVersion, WorldSize: n,
		Source: m.Source, SourceFormat: m.Format, Config: m.Config}
	for r := 0; r < n; r++ {
		man.Files = append(man.Files, RankFile(r))
	}
	for _, name := range m.SortedNames() {
		t, _ := m.Lookup(name)
		rt, err := Resolve(name, t)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", src, err)
		}
		e, err := Describe(m.Config, n, name, rt)
		if err != nil {
			return nil, fmt.Errorf("%s: %w", src, err)
		}
		man.Tensors = append(man.Tensors, e)
	}
	if err := man.Validate(); err != nil {
		return nil, fmt.Errorf("%s: %w", src, err)
	}
	return man, nil
}

// Write splits m over n ranks into dir: one safetensors file per rank, the
// tokenizer files of m.TokenizerDir, and manifest.json. Nothing is written
// when the model cannot be split; dir appears complete or not at all, and a
// dir that is not empty is refused (see WriteWith).
func Write(m *model.Model, n int, dir string) (*Manifest, error) {
	return WriteWith(m, n, dir, WriteOptions{})
}

// WriteOptions controls WriteWith.
type WriteOptions struct {
	// Force replaces a dir that is not empty (see hf.WriteDir).
	Force bool
}

// WriteWith is Write with options.
func WriteWith(m *model.Model, n int, dir string, opt WriteOptions) (*Manifest, error) {
	man, err := Plan(m, n)
	if err != nil {
		return nil, err
	}
	err = hf.WriteDir(dir, opt.Force, func(tmp string) error { return writeFiles(m, man, tmp) })
	if err != nil {
		return nil, err
	}
	return man, nil
}

// writeFiles writes the rank files, the tokenizer and the manifest of man
// into dir.
func writeFiles(m *model.Model, man *Manifest, dir string) error {
	n := man.WorldSize
	for r := 0; r < n; r++ {
		var entries []safetensors.Entry
		for i := range man.Tensors {
			e := &man.Tensors[i]
			t, _ := m.Lookup(e.Name)
			// The piece is computed once for all its safetensors parts
			// and dropped after the last one is written.
			var cached model.Tensor
			uses, nparts := 0, len(partSpecs(e, r))
			get := func() (model.Tensor, error) {
				uses++
				if uses == nparts {
					defer func() { cached = nil }()
				}
				if cached != nil {
					return cached, nil
				}
				rt, err := Resolve(e.Name, t)
				if err != nil {
					return nil, err
				}
				p, err := Part(e, rt, r)
				if err != nil {
					return nil, err
				}
				cached = p
				return p, nil
			}
			entries = append(entries, partEntries(e, r, get)...)
		}
		meta := map[string]string{"format": "pt", metaRank: strconv.Itoa(r), metaWorld: strconv.Itoa(n)}
		if err := safetensors.Write(filepath.Join(dir, man.Files[r]), entries, meta); err != nil {
			return fmt.Errorf("shard rank %d: %w", r, err)
		}
	}
	if err := hf.CopyTokenizer(m.TokenizerDir, dir); err != nil {
		return err
	}
	js, err := json.MarshalIndent(man, "", "  ")
	if err != nil {
		return err
	}
	return hf.WriteFile(filepath.Join(dir, ManifestFile), append(js, '\n'))
}

// partSpec is one safetensors tensor of a rank piece.
type partSpec struct {
	name  string
	dtype model.DType
	shape []int
	// data extracts the bytes from the rank piece.
	data func(t model.Tensor) ([]byte, error)
}

// partSpecs lists the safetensors tensors that hold rank r's piece of e.
func partSpecs(e *Entry, r int) []partSpec {
	ps := e.PartShape(r)
	n := e.Name
	switch e.Kind {
	case KindDense:
		dt, _ := model.ParseDType(e.DType)
		return []partSpec{{n, dt, ps, func(t model.Tensor) ([]byte, error) {
			d, ok := t.(*model.Dense)
			if !ok {
				return nil, fmt.Errorf("tensor %q: %T, want dense", n, t)
			}
			return d.Data, nil
		}}}
	case KindQuantized:
		rows, cols := ps[0], ps[1]
		g := 1
		if e.GroupSize > 0 {
			g = cols / e.GroupSize
		}
		qt := func(t model.Tensor) (*model.Quantized, error) {
			q, ok := t.(*model.Quantized)
			if !ok {
				return nil, fmt.Errorf("tensor %q: %T, want quantized", n, t)
			}
			return q, nil
		}
		var specs []partSpec
		if packed4(e.Bits, cols) {
			specs = append(specs, partSpec{n + ".q4", model.I32, []int{rows, cols / 8}, func(t model.Tensor) ([]byte, error) {
				q, err := qt(t)
				if err != nil {
					return nil, err
				}
				return pack4(q.Q), nil
			}})
		} else {
			specs = append(specs, partSpec{n + ".q", model.I8, []int{rows, cols}, func(t model.Tensor) ([]byte, error) {
				q, err := qt(t)
				if err != nil {
					return nil, err
				}
				return i8Bytes(q.Q), nil
			}})
		}
		specs = append(specs, partSpec{n + ".scale", model.F32, []int{rows, g}, func(t model.Tensor) ([]byte, error) {
			q, err := qt(t)
			if err != nil {
				return nil, err
			}
			return f32Bytes(q.Scale), nil
		}})
		if e.Zero {
			specs = append(specs, partSpec{n + ".zero", model.F32, []int{rows, g}, func(t model.Tensor) ([]byte, error) {
				q, err := qt(t)
				if err != nil {
					return nil, err
				}
				return f32Bytes(q.Zero), nil
			}})
		}
		if e.GIdx {
			specs = append(specs, partSpec{n + ".g_idx", model.I32, []int{cols}, func(t model.Tensor) ([]byte, error) {
				q, err := qt(t)
				if err != nil {
					return nil, err
				}
				return i32Bytes(q.GIdx), nil
			}})
		}
		return specs
	case KindW8A8:
		rows, cols := ps[0], ps[1]
		wt := func(t model.Tensor) (*model.W8A8, error) {
			w, ok := t.(*model.W8A8)
			if !ok {
				return nil, fmt.Errorf("tensor %q: %T, want w8a8", n, t)
			}
			return w, nil
		}
		field := func(suffix string, dt model.DType, shape []int, get func(w *model.W8A8) []byte) partSpec {
			return partSpec{n + suffix, dt, shape, func(t model.Tensor) ([]byte, error) {
				w, err := wt(t)
				if err != nil {
					return nil, err
				}
				return get(w), nil
			}}
		}
		specs := []partSpec{
			field(".weight", model.I8, []int{rows, cols}, func(w *model.W8A8) []byte { return i8Bytes(w.Weight.Q) }),
			field(".weight_scale", model.F32, []int{rows}, func(w *model.W8A8) []byte { return f32Bytes(w.Weight.Scale) }),
			field(".input_scale", model.F32, []int{1}, func(w *model.W8A8) []byte { return f32Bytes([]float32{w.InputScale}) }),
			field(".input_offset", model.F32, []int{1}, func(w *model.W8A8) []byte { return f32Bytes([]float32{w.InputOffset}) }),
			field(".deq_scale", model.F32, []int{rows}, func(w *model.W8A8) []byte { return f32Bytes(w.DeqScale) }),
			field(".quant_bias", model.I32, []int{rows}, func(w *model.W8A8) []byte { return i32Bytes(w.QuantBias) }),
		}
		if e.Bias {
			specs = append(specs, field(".bias", model.F32, []int{rows}, func(w *model.W8A8) []byte { return f32Bytes(w.Bias) }))
		}
		return specs
	}
	return nil
}

func packed4(bits, cols int) bool { return bits == 4 && cols%8 == 0 }

func partEntries(e *Entry, r int, get func() (model.Tensor, error)) []safetensors.Entry {
	var out []safetensors.Entry
	for _, s := range partSpecs(e, r) {
		out = append(out, safetensors.Entry{Name: s.name, DType: s.dtype, Shape: s.shape, Data: func() ([]byte, error) {
			t, err := get()
			if err != nil {
				return nil, err
			}
			return s.data(t)
		}})
	}
	return out
}

// Open reads a shard directory: the manifest, then every rank file, checking
// before anything is computed that each file is the rank the manifest says,
// holds exactly the manifest's tensors with the shapes its ranges imply, and
// that quantized pieces are valid. ranks[r] holds rank r's pieces under
// canonical names (with per-rank shapes; its Config is the whole model's).
// Dense pieces alias the memory-mapped files until the models are closed.
func Open(dir string) (ranks []*model.Model, man *Manifest, err error) {
	if man, err = ReadManifest(dir); err != nil {
		return nil, nil, err
	}
	for r := range man.Files {
		if err := statRank(dir, man, r); err != nil {
			return nil, nil, err
		}
	}
	defer func() {
		if err != nil {
			for _, m := range ranks {
				m.Close()
			}
			ranks = nil
		}
	}()
	for r, f := range man.Files {
		m, err := openRank(dir, f, r, man)
		if err != nil {
			return ranks, nil, err
		}
		ranks = append(ranks, m)
	}
	return ranks, man, nil
}

// ReadManifest reads and validates dir/manifest.json.
func ReadManifest(dir string) (*Manifest, error) {
	path := filepath.Join(dir, ManifestFile)
	data, err := infile.ReadFile(path, infile.MetaLimit)
	if errors.Is(err, fs.ErrNotExist) {
		return nil, fmt.Errorf("%s: not a shard directory (no %s)", dir, ManifestFile)
	}
	if err != nil {
		return nil, err
	}
	return ParseManifest(path, data)
}

func statRank(dir string, man *Manifest, r int) error {
	f := man.Files[r]
	fi, err := os.Stat(filepath.Join(dir, f))
	if err != nil {
		return fmt.Errorf("%s: rank %d of %d: file %s is missing or unreadable: %w", dir, r, man.WorldSize, f, err)
	}
	if !fi.Mode().IsRegular() {
		return fmt.Errorf("%s: rank %d file %s is not a regular file", dir, r, f)
	}
	return nil
}

// OpenRank reads only rank r's file of a shard directory, with the same
// checks as Open: what one process of a multi-process (multi-machine)
// tensor-parallel run needs.
func OpenRank(dir string, r int) (*model.Model, *Manifest, error) {
	man, err := ReadManifest(dir)
	if err != nil {
		return nil, nil, err
	}
	if r < 0 || r >= man.WorldSize {
		return nil, nil, fmt.Errorf("%s: rank %d outside 0..%d", dir, r, man.WorldSize-1)
	}
	if err := statRank(dir, man, r); err != nil {
		return nil, nil, err
	}
	m, err := openRank(dir, man.Files[r], r, man)
	if err != nil {
		return nil, nil, err
	}
	return m, man, nil
}

func openRank(dir, file string, r int, man *Manifest) (*model.Model, error) {
	path := filepath.Join(dir, file)
	sf, err := safetensors.Open(path)
	if err != nil {
		return nil, err
	}
	m := model.New(man.Config)
	m.Source, m.Format, m.TokenizerDir = path, Format, dir
	m.AddCloser(sf)
	fail := func(err error) (*model.Model, error) {
		m.Close()
		return nil, err
	}
	if got := sf.Metadata[metaRank]; got != strconv.Itoa(r) {
		return fail(fmt.Errorf("%s: the file says it is rank %q, the manifest lists it as rank %d", path, got, r))
	}
	if got := sf.Metadata[metaWorld]; got != strconv.Itoa(man.WorldSize) {
		return fail(fmt.Errorf("%s: the file was written for world size %q, the manifest says %d", path, got, man.WorldSize))
	}
	want := map[string]bool{}
	for i := range man.Tensors {
		e := &man.Tensors[i]
		specs := partSpecs(e, r)
		for _, s := range specs {
			want[s.name] = true
			in, ok := sf.Info(s.name)
			if !ok {
				return fail(fmt.Errorf("%s: tensor %q (manifest entry %q) is missing", path, s.name, e.Name))
			}
			if in.DType != s.dtype || !slices.Equal(in.Shape, s.shape) {
				return fail(fmt.Errorf("%s: tensor %q is %v%v; the manifest (%s split, rank %d range %v of %v) implies %v%v",
					path, s.name, in.DType, in.Shape, e.Split, r, rangeOf(e, r), e.Shape, s.dtype, s.shape))
			}
		}
		t, err := readPiece(sf, e, r)
		if err != nil {
			return fail(fmt.Errorf("%s: %w", path, err))
		}
		m.Set(e.Name, t)
	}
	for _, name := range sf.Names() {
		if !want[name] {
			return fail(fmt.Errorf("%s: tensor %q is not listed in the manifest", path, name))
		}
	}
	return m, nil
}

func rangeOf(e *Entry, r int) any {
	if e.Split == Replicated {
		return "all"
	}
	return e.Ranges[r]
}

func readPiece(sf *safetensors.File, e *Entry, r int) (model.Tensor, error) {
	ps := e.PartShape(r)
	get := func(name string) (*model.Dense, error) { return sf.Tensor(name) }
	switch e.Kind {
	case KindDense:
		return get(e.Name)
	case KindQuantized:
		q := &model.Quantized{Bits: e.Bits, GroupSize: e.GroupSize, Rows: ps[0], Cols: ps[1]}
		if packed4(e.Bits, ps[1]) {
			d, err := get(e.Name + ".q4")
			if err != nil {
				return nil, err
			}
			q.Q = unpack4(d.Data)
		} else {
			d, err := get(e.Name + ".q")
			if err != nil {
				return nil, err
			}
			if q.Q, err = d.Int8s(); err != nil {
				return nil, err
			}
		}
		var err error
		if q.Scale, err = floats(sf, e.Name+".scale"); err != nil {
			return nil, err
		}
		if e.Zero {
			if q.Zero, err = floats(sf, e.Name+".zero"); err != nil {
				return nil, err
			}
		}
		if e.GIdx {
			d, err := get(e.Name + ".g_idx")
			if err != nil {
				return nil, err
			}
			if q.GIdx, err = d.Int32s(); err != nil {
				return nil, err
			}
		}
		if err := q.Validate(); err != nil {
			return nil, fmt.Errorf("tensor %q: %w", e.Name, err)
		}
		return q, nil
	case KindW8A8:
		d, err := get(e.Name + ".weight")
		if err != nil {
			return nil, err
		}
		q := &model.Quantized{Bits: 8, Rows: ps[0], Cols: ps[1]}
		if q.Q, err = d.Int8s(); err != nil {
			return nil, err
		}
		if q.Scale, err = floats(sf, e.Name+".weight_scale"); err != nil {
			return nil, err
		}
		w := &model.W8A8{Weight: q}
		is, err := floats(sf, e.Name+".input_scale")
		if err != nil {
			return nil, err
		}
		io, err := floats(sf, e.Name+".input_offset")
		if err != nil {
			return nil, err
		}
		w.InputScale, w.InputOffset = is[0], io[0]
		if w.DeqScale, err = floats(sf, e.Name+".deq_scale"); err != nil {
			return nil, err
		}
		qb, err := get(e.Name + ".quant_bias")
		if err != nil {
			return nil, err
		}
		if w.QuantBias, err = qb.Int32s(); err != nil {
			return nil, err
		}
		if e.Bias {
			if w.Bias, err = floats(sf, e.Name+".bias"); err != nil {
				return nil, err
			}
		}
		if err := validateW8A8(w); err != nil {
			return nil, fmt.Errorf("tensor %q: %w", e.Name, err)
		}
		return w, nil
	}
	return nil, fmt.Errorf("tensor %q: unknown kind %q", e.Name, e.Kind)
}

func floats(sf *safetensors.File, name string) ([]float32, error) {
	d, err := sf.Tensor(name)
	if err != nil {
		return nil, err
	}
	if d.DType != model.F32 {
		return nil, fmt.Errorf("tensor %q: dtype %v, want F32", name, d.DType)
	}
	return d.Float32()
}

// Tensor is a tensor kept as its per-rank pieces, as OpenModel returns
// them; the tensor-parallel runtime uploads the pieces directly.
type Tensor struct {
	Entry Entry
	// Parts holds rank r's piece at index r.
	Parts []model.Tensor
}

// Shape implements model.Tensor: the whole tensor's shape.
func (t *Tensor) Shape() []int { return t.Entry.Shape }

// Float32 implements model.Tensor: the pieces joined and dequantized.
func (t *Tensor) Float32() ([]float32, error) {
	j, err := t.Join()
	if err != nil {
		return nil, err
	}
	return j.Float32()
}

// Join concatenates the pieces into the whole tensor.
func (t *Tensor) Join() (model.Tensor, error) { return Concat(&t.Entry, t.Parts) }

// OpenModel opens a shard directory (see Open) as one model whose tensors
// are *Tensor values holding the pieces of every rank. It has the whole
// model's config and shapes, so it passes model.CheckShapes; closing it
// closes the rank files.
func OpenModel(dir string) (*model.Model, *Manifest, error) {
	ranks, man, err := Open(dir)
	if err != nil {
		return nil, nil, err
	}
	m := model.New(man.Config)
	m.Source, m.Format, m.TokenizerDir = dir, Format, dir
	for _, rm := range ranks {
		m.AddCloser(rm)
	}
	for i := range man.Tensors {
		e := man.Tensors[i]
		st := &Tensor{Entry: e}
		for _, rm := range ranks {
			p, _ := rm.Lookup(e.Name)
			st.Parts = append(st.Parts, p)
		}
		m.Set(e.Name, st)
	}
	if err := m.CheckShapes(); err != nil {
		m.Close()
		return nil, nil, fmt.Errorf("%s: %w", dir, err)
	}
	return m, man, nil
}

// Join reassembles the whole model from rank models and their manifest
// (as Open returns them). The result's tensors are fresh copies except
// replicated ones, which alias rank 0's.
func Join(ranks []*model.Model, man *Manifest) (*model.Model, error) {
	if len(ranks) != man.WorldSize {
		return nil, fmt.Errorf("shard join: %d rank models for world size %d", len(ranks), man.WorldSize)
	}
	m := model.New(man.Config)
	m.Source, m.Format = man.Source, man.SourceFormat
	if len(ranks) > 0 {
		m.TokenizerDir = ranks[0].TokenizerDir
	}
	for i := range man.Tensors {
		e := &man.Tensors[i]
		parts := make([]model.Tensor, len(ranks))
		for r, rm := range ranks {
			p, ok := rm.Lookup(e.Name)
			if !ok {
				return nil, fmt.Errorf("shard join: rank %d has no tensor %q", r, e.Name)
			}
			parts[r] = p
		}
		t, err := Concat(e, parts)
		if err != nil {
			return nil, fmt.Errorf("shard join: %w", err)
		}
		m.Set(e.Name, t)
	}
	return m, nil
}

func f32Bytes(v []float32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return b
}

func i32Bytes(v []int32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], uint32(x))
	}
	return b
}

func i8Bytes(v []int8) []byte {
	b := make([]byte, len(v))
	for i, x := range v {
		b[i] = byte(x)
	}
	return b
}

// pack4 packs signed 4-bit codes (−8..7) 8 per little-endian int32, as
// unsigned nibbles (code+8), lowest nibble first. len(q) must be a
// multiple of 8.
func pack4(q []int8) []byte {
	b := make([]byte, len(q)/2)
	for i := 0; i < len(q); i += 2 {
		b[i/2] = byte(q[i]+8)&0xf | byte(q[i+1]+8)<<4
	}
	return b
}

// unpack4 is the inverse of pack4.
func unpack4(b []byte) []int8 {
	q := make([]int8, 2*len(b))
	for i, x := range b {
		q[2*i] = int8(x&0xf) - 8
		q[2*i+1] = int8(x>>4) - 8
	}
	return q
}
