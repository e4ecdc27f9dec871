// Package safetensors reads and writes safetensors files and sharded
// checkpoints (model.safetensors.index.json).
//
// Reading memory-maps the file and parses it with
// github.com/nlpodyssey/safetensors, after validating the header here so that
// every error names the file and the tensor. Tensors are returned as
// *model.Dense values aliasing the mapping: opening a 10 GB checkpoint reads
// only its header. Writing streams one tensor at a time into a temporary file
// that is renamed into place when complete.
package safetensors

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"math"
	"slices"
	"sort"
	"syscall"

	st "github.com/nlpodyssey/safetensors"

	"qtool/formats/infile"
	"qtool/formats/model"
)

// MaxHeaderSize bounds the JSON header, as every safetensors implementation does.
const MaxHeaderSize = 100 << 20

// Info describes one tensor of a file.
type Info struct {
	Name   string
	DType  model.DType
	Shape  []int
	Begin  int64 // offset of the data from the start of the data section
	End    int64
	dtName string
}

// File is an open, memory-mapped safetensors file.
type File struct {
	Path     string
	Metadata map[string]string
	infos    []Info
	byName   map[string]int
	st       st.SafeTensors
	mapped   []byte
}

// Open maps path and validates its header.
func Open(path string) (*File, error) {
	f, fi, err := infile.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if fi.Size() < 8 {
		return nil, fmt.Errorf("%s: file is %d bytes, too short for a safetensors header", path, fi.Size())
	}
	if fi.Size() > math.MaxInt {
		return nil, fmt.Errorf("%s: file too large to map", path)
	}
	data, err := syscall.Mmap(int(f.Fd()), 0, int(fi.Size()), syscall.PROT_READ, syscall.MAP_SHARED)
	if err != nil {
		return nil, fmt.Errorf("%s: mmap: %w", path, err)
	}
	sf, err := parse(path, data)
	if err != nil {
		syscall.Munmap(data)
		return nil, err
	}
	sf.mapped = data
	return sf, nil
}

// Parse reads a safetensors file held in memory (data is aliased, not copied).
func Parse(name string, data []byte) (*File, error) { return parse(name, data) }

type rawInfo struct {
	DType   string   `json:"dtype"`
	Shape   []int64  `json:"shape"`
	Offsets [2]int64 `json:"data_offsets"`
}

func parse(path string, data []byte) (*File, error) {
	if len(data) < 8 {
		return nil, fmt.Errorf("%s: %d bytes, too short for a safetensors header", path, len(data))
	}
	n := binary.LittleEndian.Uint64(data[:8])
	if n > MaxHeaderSize {
		return nil, fmt.Errorf("%s: header length %d exceeds the %d-byte limit", path, n, MaxHeaderSize)
	}
	if 8+n > uint64(len(data)) {
		return nil, fmt.Errorf("%s: header length %d runs past the end of the %d-byte file", path, n, len(data))
	}
	var raw map[string]json.RawMessage
	dec := json.NewDecoder(bytes.NewReader(data[8 : 8+n]))
	if err := dec.Decode(&raw); err != nil {
		return nil, fmt.Errorf("%s: header is not valid JSON: %w", path, err)
	}
	sf := &File{Path: path, byName: map[string]int{}}
	dataLen := int64(uint64(len(data)) - 8 - n)
	// Sorted, so that a header with several faults names the same tensor
	// on every run.
	for _, name := range slices.Sorted(maps.Keys(raw)) {
		msg := raw[name]
		if name == "__metadata__" {
			if err := json.Unmarshal(msg, &sf.Metadata); err != nil {
				return nil, fmt.Errorf("%s: __metadata__ must map strings to strings: %w", path, err)
			}
			continue
		}
		var ri rawInfo
		if err := json.Unmarshal(msg, &ri); err != nil {
			return nil, fmt.Errorf("%s: tensor %q: bad header entry: %w", path, name, err)
		}
		dt, err := model.ParseDType(ri.DType)
		if err != nil {
			return nil, fmt.Errorf("%s: tensor %q: %w", path, name, err)
		}
		shape := make([]int, len(ri.Shape))
		elems := int64(1)
		for i, d := range ri.Shape {
			if d < 0 || d > 1<<40 {
				return nil, fmt.Errorf("%s: tensor %q: bad dimension %d in shape %v", path, name, d, ri.Shape)
			}
			shape[i] = int(d)
			if d != 0 && elems > math.MaxInt64/d {
				return nil, fmt.Errorf("%s: tensor %q: shape %v overflows", path, name, ri.Shape)
			}
			elems *= d
		}
		b, e := ri.Offsets[0], ri.Offsets[1]
		if b < 0 || e < b || e > dataLen {
			return nil, fmt.Errorf("%s: tensor %q: data_offsets [%d, %d] outside the %d-byte data section", path, name, b, e, dataLen)
		}
		if want := elems * int64(dt.Size()); e-b != want {
			return nil, fmt.Errorf("%s: tensor %q: %v%v needs %d bytes but data_offsets [%d, %d] span %d", path, name, dt, ri.Shape, want, b, e, e-b)
		}
		sf.infos = append(sf.infos, Info{Name: name, DType: dt, Shape: shape, Begin: b, End: e, dtName: ri.DType})
	}
	sort.Slice(sf.infos, func(i, j int) bool {
		a, b := sf.infos[i], sf.infos[j]
		return a.Begin < b.Begin || (a.Begin == b.Begin && (a.End < b.End || (a.End == b.End && a.Name < b.Name)))
	})
	var pos int64
	for i, in := range sf.infos {
		if in.Begin < pos {
			return nil, fmt.Errorf("%s: tensor %q: data_offsets [%d, %d] overlap tensor %q ending at %d", path, in.Name, in.Begin, in.End, sf.infos[i-1].Name, pos)
		}
		if in.Begin > pos {
			return nil, fmt.Errorf("%s: tensor %q: gap of %d bytes before its data at %d", path, in.Name, in.Begin-pos, in.Begin)
		}
		pos = in.End
		sf.byName[in.Name] = i
	}
	if pos != dataLen {
		return nil, fmt.Errorf("%s: tensors cover %d bytes but the data section has %d (truncated or trailing bytes)", path, pos, dataLen)
	}
	parsed, err := st.Deserialize(data)
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	sf.st = parsed
	return sf, nil
}

// Infos lists the tensors in file order.
func (f *File) Infos() []Info { return append([]Info(nil), f.infos...) }

// Names lists the tensor names in file order.
func (f *File) Names() []string {
	names := make([]string, len(f.infos))
	for i, in := range f.infos {
		names[i] = in.Name
	}
	return names
}

// Has reports whether the file holds name.
func (f *File) Has(name string) bool { _, ok := f.byName[name]; return ok }

// Info returns the description of name.
func (f *File) Info(name string) (Info, bool) {
	i, ok := f.byName[name]
	if !ok {
		return Info{}, false
	}
	return f.infos[i], true
}

// Tensor returns name as a dense tensor aliasing the file's mapping.
func (f *File) Tensor(name string) (*model.Dense, error) {
	i, ok := f.byName[name]
	if !ok {
		return nil, fmt.Errorf("%s: no tensor %q", f.Path, name)
	}
	tv, ok := f.st.Tensor(name)
	if !ok {
		return nil, fmt.Errorf("%s: no tensor %q", f.Path, name)
	}
	in := f.infos[i]
	d, err := model.NewDense(in.DType, in.Shape, tv.Data())
	if err != nil {
		return nil, fmt.Errorf("%s: tensor %q: %w", f.Path, name, err)
	}
	return d, nil
}

// Close unmaps the file. Tensors returned earlier must not be used afterwards.
func (f *File) Close() error {
	if f.mapped == nil {
		return nil
	}
	err := syscall.Munmap(f.mapped)
	f.mapped = nil
	return err
}

// ErrNotFound is returned (wrapped) by OpenCheckpoint when a directory holds
// no safetensors checkpoint of the given base name.
var ErrNotFound = errors.New("no safetensors checkpoint")
