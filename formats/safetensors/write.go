package safetensors

import (
	"encoding/json"
	"fmt"
	"path/filepath"

	st "github.com/nlpodyssey/safetensors"

	"qtool/formats/atomicfile"
	"qtool/formats/model"
)

// Entry is one tensor to write. Data is called once, when the writer reaches
// the tensor, so a whole model never needs to be in memory; it must return
// exactly len(Shape)×DType bytes.
type Entry struct {
	Name  string
	DType model.DType
	Shape []int
	Data  func() ([]byte, error)
}

// DenseEntry makes an Entry for a tensor already in memory (or mapped).
func DenseEntry(name string, d *model.Dense) Entry {
	return Entry{Name: name, DType: d.DType, Shape: d.Dims, Data: func() ([]byte, error) { return d.Data, nil }}
}

// Size is the number of data bytes of e.
func (e Entry) Size() int64 { return int64(model.NumElements(e.Shape)) * int64(e.DType.Size()) }

var toLib = map[model.DType]st.DType{
	model.F32: st.F32, model.F16: st.F16, model.BF16: st.BF16, model.F64: st.F64,
	model.I8: st.I8, model.U8: st.U8, model.I16: st.I16, model.I32: st.I32, model.I64: st.I64,
}

// lazyView adapts an Entry to the library's View; the first error from Data
// is kept and reported after serialization.
type lazyView struct {
	e   Entry
	err *error
}

func (v lazyView) DType() st.DType { return toLib[v.e.DType] }
func (v lazyView) Shape() []uint64 {
	s := make([]uint64, len(v.e.Shape))
	for i, d := range v.e.Shape {
		s[i] = uint64(d)
	}
	return s
}
func (v lazyView) DataLen() uint64 { return uint64(v.e.Size()) }
func (v lazyView) Data() []byte {
	if *v.err != nil {
		return make([]byte, v.e.Size())
	}
	b, err := v.e.Data()
	if err == nil && int64(len(b)) != v.e.Size() {
		err = fmt.Errorf("tensor %q: produced %d bytes, shape %v of %v needs %d", v.e.Name, len(b), v.e.Shape, v.e.DType, v.e.Size())
	}
	if err != nil {
		*v.err = err
		return make([]byte, v.e.Size())
	}
	return b
}

func checkEntries(entries []Entry) error {
	seen := map[string]bool{}
	for _, e := range entries {
		if seen[e.Name] {
			return fmt.Errorf("tensor %q listed twice", e.Name)
		}
		seen[e.Name] = true
		if _, ok := toLib[e.DType]; !ok {
			return fmt.Errorf("tensor %q: dtype %v cannot be written", e.Name, e.DType)
		}
	}
	return nil
}

// writeTo serializes entries into an open output without committing it.
func writeTo(out *atomicfile.File, entries []Entry, metadata map[string]string) error {
	views := make(map[string]lazyView, len(entries))
	var dataErr error
	for _, e := range entries {
		views[e.Name] = lazyView{e: e, err: &dataErr}
	}
	if err := st.SerializeToWriter(views, metadata, out); err != nil {
		return fmt.Errorf("write %s: %w", out.Path(), err)
	}
	if dataErr != nil {
		return fmt.Errorf("write %s: %w", out.Path(), dataErr)
	}
	return nil
}

// Write streams entries into a single safetensors file at path. The file
// appears only when complete; path is locked against other writers while
// it is written (see atomicfile).
func Write(path string, entries []Entry, metadata map[string]string) error {
	if err := checkEntries(entries); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	lock, err := atomicfile.LockTarget(path)
	if err != nil {
		return err
	}
	defer lock.Unlock()
	out, err := atomicfile.Create(path)
	if err != nil {
		return err
	}
	defer out.Abort()
	if err := writeTo(out, entries, metadata); err != nil {
		return err
	}
	return out.Commit()
}

// WriteCheckpoint writes entries as dir/base.safetensors, or, when their
// total size exceeds maxShard bytes (maxShard > 0), as shards
// base-0000i-of-0000n.safetensors plus base.safetensors.index.json. No file
// is renamed into place until every shard has been written.
func WriteCheckpoint(dir, base string, entries []Entry, metadata map[string]string, maxShard int64) error {
	if err := checkEntries(entries); err != nil {
		return fmt.Errorf("write %s: %w", filepath.Join(dir, base), err)
	}
	var total int64
	for _, e := range entries {
		total += e.Size()
	}
	if maxShard <= 0 || total <= maxShard {
		return Write(filepath.Join(dir, base+".safetensors"), entries, metadata)
	}
	var shards [][]Entry
	var cur []Entry
	var curSize int64
	for _, e := range entries {
		if len(cur) > 0 && curSize+e.Size() > maxShard {
			shards = append(shards, cur)
			cur, curSize = nil, 0
		}
		cur = append(cur, e)
		curSize += e.Size()
	}
	shards = append(shards, cur)
	idx := Index{Metadata: map[string]any{"total_size": total}, WeightMap: map[string]string{}}
	var outs []*atomicfile.File
	defer func() {
		for _, o := range outs {
			o.Abort()
		}
	}()
	for i, sh := range shards {
		name := fmt.Sprintf("%s-%05d-of-%05d.safetensors", base, i+1, len(shards))
		out, err := atomicfile.Create(filepath.Join(dir, name))
		if err != nil {
			return err
		}
		outs = append(outs, out)
		if err := writeTo(out, sh, metadata); err != nil {
			return err
		}
		for _, e := range sh {
			idx.WeightMap[e.Name] = name
		}
	}
	js, err := json.MarshalIndent(idx, "", "  ")
	if err != nil {
		return err
	}
	ix, err := atomicfile.Create(filepath.Join(dir, base+".safetensors.index.json"))
	if err != nil {
		return err
	}
	outs = append(outs, ix)
	if _, err := ix.Write(append(js, '\n')); err != nil {
		return err
	}
	return atomicfile.CommitAll(outs...)
}
