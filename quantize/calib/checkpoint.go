package calib

// Resumable calibration: a Checkpoint attached to a Session records, after
// every finished decoder layer, what a later run needs to continue from the
// next one: the residual stream (the only state carried from layer to
// layer), the tensors the layer installed in (or removed from) Out, and the
// layer's module statistics.

import (
	"bytes"
	"encoding/binary"
	"encoding/gob"
	"encoding/json"
	"errors"
	"fmt"
	"hash/crc32"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"unsafe"

	"qtool/formats/atomicfile"
	"qtool/formats/infile"
	"qtool/formats/model"
)

// KeyField is one input of a run that must be the same for a resume to
// give the uninterrupted run's result.
type KeyField struct {
	Name  string `json:"name"`
	Value string `json:"value"`
}

// checkpointVersion is the layout of a work directory.
const checkpointVersion = 1

// checkpointState is state.json, the commit point of a work directory: the
// files it names are complete (written before it, each atomically).
type checkpointState struct {
	Version    int        `json:"version"`
	Key        []KeyField `json:"key"`
	LayersDone int        `json:"layers_done"`
	// Residual is the residual stream after layer LayersDone−1.
	Residual     string   `json:"residual"`
	ResidualRows int      `json:"residual_rows"`
	ResidualCols int      `json:"residual_cols"`
	ResidualCRC  uint32   `json:"residual_crc32c"`
	LayerCRC     []uint32 `json:"layer_crc32c"` // of layer-NNN.gob, per finished layer
}

// layerRecord is one finished layer (layer-NNN.gob).
type layerRecord struct {
	Layer   int
	Tensors []tensorRecord
	Stats   []ModuleStat
}

// tensorRecord is a tensor of Out as the layer left it: Deleted, or one of
// Dense, Quant, W8A8. The int8 codes of Quant and W8A8 are not in the gob
// message (gob would copy them, element by element for []int8): the layer
// file holds them raw after it, Codes bytes per tensor in order.
type tensorRecord struct {
	Name    string
	Deleted bool
	Dense   *model.Dense
	Quant   *model.Quantized
	W8A8    *model.W8A8
	Codes   int
	codes   []byte // shared with the tensor
}

var castagnoli = crc32.MakeTable(crc32.Castagnoli)

// Checkpoint is the work directory of a resumable run. Make it with
// OpenCheckpoint, attach it with Session.SetCheckpoint, feed it the module
// statistics with Stat, and Remove it once the output is written.
type Checkpoint struct {
	dir   string
	key   []KeyField
	lock  *atomicfile.Lock
	state checkpointState // as on disk
	// of the current layer
	stats   []ModuleStat
	touched map[string]bool
	// resumed holds the finished layers found on disk, installed by
	// Session.SetCheckpoint.
	resumed []layerRecord
	resid   []float32
}

// CheckpointDir is the work directory of a resumable run writing out: the
// hidden directory ".NAME.resume" beside it.
func CheckpointDir(out string) string {
	out = filepath.Clean(out)
	return filepath.Join(filepath.Dir(out), "."+filepath.Base(out)+".resume")
}

// OpenCheckpoint opens (creating it when absent) the work directory dir for
// a run identified by key, and locks it against a concurrent run. When dir
// holds finished layers of a run with the same key, they are read and
// checked and Session.SetCheckpoint installs them; a different key is refused with the
// fields that differ.
func OpenCheckpoint(dir string, key []KeyField) (*Checkpoint, error) {
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return nil, fmt.Errorf("resume: %w", err)
	}
	lock, err := atomicfile.LockTarget(dir)
	if err != nil {
		return nil, fmt.Errorf("resume: %s is in use by another run (%v)", dir, err)
	}
	c := &Checkpoint{dir: dir, key: key, lock: lock, state: checkpointState{Version: checkpointVersion, Key: key}}
	if err := c.read(); err != nil {
		c.Close()
		return nil, err
	}
	return c, nil
}

// corrupt is the error for a damaged work directory.
func (c *Checkpoint) corrupt(format string, a ...any) error {
	return fmt.Errorf("resume: work directory %s is damaged: %s; remove it to start over", c.dir, fmt.Sprintf(format, a...))
}

// read loads and checks the state on disk (nothing when there is none).
func (c *Checkpoint) read() error {
	b, err := infile.ReadFile(filepath.Join(c.dir, "state.json"), infile.MetaLimit)
	if errors.Is(err, fs.ErrNotExist) {
		return nil
	}
	if err != nil {
		return fmt.Errorf("resume: %w", err)
	}
	var st checkpointState
	if err := json.Unmarshal(b, &st); err != nil {
		return c.corrupt("state.json: %v", err)
	}
	if st.Version != checkpointVersion {
		return fmt.Errorf("resume: work directory %s has layout version %d, this qtool writes %d; remove it to start over", c.dir, st.Version, checkpointVersion)
	}
	if diff := KeyDiff(st.Key, c.key); len(diff) > 0 {
		return fmt.Errorf("resume: work directory %s belongs to a different run; %s; remove it to start over, or run with the same inputs",
			c.dir, strings.Join(diff, "; "))
	}
	if st.LayersDone < 0 || len(st.LayerCRC) != st.LayersDone {
		return c.corrupt("state.json: %d layers done, %d layer checksums", st.LayersDone, len(st.LayerCRC))
	}
	for l := 0; l < st.LayersDone; l++ {
		name := layerFile(l)
		b, err := c.readChecked(name, st.LayerCRC[l])
		if err != nil {
			return err
		}
		var rec layerRecord
		rd := bytes.NewReader(b)
		if err := gob.NewDecoder(rd).Decode(&rec); err != nil {
			return c.corrupt("%s: %v", name, err)
		}
		codes := b[len(b)-rd.Len():]
		for i := range rec.Tensors {
			t := &rec.Tensors[i]
			if t.Codes < 0 || t.Codes > len(codes) {
				return c.corrupt("%s: %s has %d codes, %d bytes left", name, t.Name, t.Codes, len(codes))
			}
			t.codes, codes = codes[:t.Codes], codes[t.Codes:]
		}
		if len(codes) != 0 {
			return c.corrupt("%s: %d bytes after the last tensor", name, len(codes))
		}
		if rec.Layer != l {
			return c.corrupt("%s holds layer %d", name, rec.Layer)
		}
		for i := range rec.Tensors {
			if err := rec.Tensors[i].unpack(); err != nil {
				return c.corrupt("%s: %v", name, err)
			}
		}
		c.resumed = append(c.resumed, rec)
	}
	if st.LayersDone > 0 {
		if st.ResidualRows <= 0 || st.ResidualCols <= 0 || st.Residual != residualFile(st.LayersDone-1) {
			return c.corrupt("state.json: residual %q [%d, %d]", st.Residual, st.ResidualRows, st.ResidualCols)
		}
		b, err := c.readChecked(st.Residual, st.ResidualCRC)
		if err != nil {
			return err
		}
		if len(b) != 4*st.ResidualRows*st.ResidualCols {
			return c.corrupt("%s has %d bytes, want %d", st.Residual, len(b), 4*st.ResidualRows*st.ResidualCols)
		}
		c.resid = make([]float32, len(b)/4)
		copy(f32Bytes(c.resid), b)
	}
	c.state = st
	return nil
}

// readChecked reads a file of the work directory and checks its CRC-32C.
func (c *Checkpoint) readChecked(name string, crc uint32) ([]byte, error) {
	f, _, err := infile.Open(filepath.Join(c.dir, name))
	if err != nil {
		return nil, c.corrupt("%v", err)
	}
	b, err := io.ReadAll(f)
	f.Close()
	if err != nil {
		return nil, c.corrupt("%v", err)
	}
	if got := crc32.Checksum(b, castagnoli); got != crc {
		return nil, c.corrupt("%s: checksum %08x, state.json says %08x (truncated or modified)", name, got, crc)
	}
	return b, nil
}

// KeyDiff lists the fields of two run keys that differ, as
// "NAME: OLD in the work dir, NEW now".
func KeyDiff(old, now []KeyField) []string {
	oldv := map[string]string{}
	for _, f := range old {
		oldv[f.Name] = f.Value
	}
	var diff []string
	seen := map[string]bool{}
	for _, f := range now {
		seen[f.Name] = true
		o, ok := oldv[f.Name]
		switch {
		case !ok:
			diff = append(diff, fmt.Sprintf("%s: absent in the work dir, %s now", f.Name, f.Value))
		case o != f.Value:
			diff = append(diff, fmt.Sprintf("%s: %s in the work dir, %s now", f.Name, o, f.Value))
		}
	}
	for _, f := range old {
		if !seen[f.Name] {
			diff = append(diff, fmt.Sprintf("%s: %s in the work dir, absent now", f.Name, f.Value))
		}
	}
	return diff
}

// LayersDone is the number of finished layers in the work directory.
func (c *Checkpoint) LayersDone() int { return c.state.LayersDone }

// Dir is the work directory.
func (c *Checkpoint) Dir() string { return c.dir }

// Stat records a module statistic of the layer being calibrated (saved
// with the layer).
func (c *Checkpoint) Stat(st ModuleStat) { c.stats = append(c.stats, st) }

// ResumedStats are the module statistics of the layers read from the work
// directory, in order.
func (c *Checkpoint) ResumedStats() []ModuleStat {
	var out []ModuleStat
	for _, r := range c.resumed {
		out = append(out, r.Stats...)
	}
	return out
}

// Close releases the lock (the work directory stays).
func (c *Checkpoint) Close() {
	if c.lock != nil {
		c.lock.Unlock()
		c.lock = nil
	}
}

// Remove deletes the work directory (after the output was written).
func (c *Checkpoint) Remove() error {
	c.Close()
	return os.RemoveAll(c.dir)
}

func layerFile(l int) string    { return fmt.Sprintf("layer-%03d.gob", l) }
func residualFile(l int) string { return fmt.Sprintf("residual-after-%03d.f32", l) }

// pack moves the int8 codes into Q (gob writes []int8 element by element).
func (r *tensorRecord) pack(t model.Tensor) error {
	switch t := t.(type) {
	case *model.Dense:
		r.Dense = t
	case *model.Quantized:
		q := *t
		r.codes, q.Q = int8Bytes(t.Q), nil
		r.Quant = &q
	case *model.W8A8:
		w, q := *t, *t.Weight
		r.codes, q.Q = int8Bytes(t.Weight.Q), nil
		w.Weight = &q
		r.W8A8 = &w
	default:
		return fmt.Errorf("resume: %s: cannot save a tensor of type %T", r.Name, t)
	}
	r.Codes = len(r.codes)
	return nil
}

// unpack is the inverse of pack.
func (r *tensorRecord) unpack() error {
	n := 0
	for _, set := range []bool{r.Deleted, r.Dense != nil, r.Quant != nil, r.W8A8 != nil && r.W8A8.Weight != nil} {
		if set {
			n++
		}
	}
	if n != 1 {
		return fmt.Errorf("tensor record %q holds %d values", r.Name, n)
	}
	q := r.Quant
	if r.W8A8 != nil {
		q = r.W8A8.Weight
	}
	if q != nil {
		if q.Rows < 0 || q.Cols < 0 || len(r.codes) != q.Rows*q.Cols {
			return fmt.Errorf("%s: %d codes for [%d, %d]", r.Name, len(r.codes), q.Rows, q.Cols)
		}
		q.Q = make([]int8, len(r.codes))
		copy(int8Bytes(q.Q), r.codes)
		r.codes = nil
	} else if r.Codes != 0 {
		return fmt.Errorf("%s: %d codes without a quantized tensor", r.Name, r.Codes)
	}
	if r.Dense != nil && model.NumElements(r.Dense.Dims)*r.Dense.DType.Size() != len(r.Dense.Data) {
		return fmt.Errorf("%s: %d bytes for %v of %v", r.Name, len(r.Dense.Data), r.Dense.Dims, r.Dense.DType)
	}
	return nil
}

func (r *tensorRecord) tensor() model.Tensor {
	switch {
	case r.Dense != nil:
		return r.Dense
	case r.Quant != nil:
		return r.Quant
	}
	return r.W8A8
}

// int8Bytes is the memory of v as bytes (shared, not copied).
func int8Bytes(v []int8) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(v))), len(v))
}

// f32Bytes is the memory of v as bytes (shared, not copied): the
// little-endian float32 values of the work directory's files, as qtool's
// targets (amd64, arm64) are little-endian.
func f32Bytes(v []float32) []byte {
	if !littleEndian {
		panic("calib: the work directory's float32 files need a little-endian host")
	}
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(v))), 4*len(v))
}

var littleEndian = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

// touch records that the tensor name of Out changed in the current layer.
func (c *Checkpoint) touch(name string) {
	if c.touched == nil {
		c.touched = map[string]bool{}
	}
	c.touched[name] = true
}

// apply installs the finished layers in out and returns the residual
// stream after the last one ([rows, cols], or [2·rows, cols] with the float
// stream after the quantized one).
func (c *Checkpoint) apply(out *model.Model, rows, cols int) ([]float32, error) {
	if c.state.LayersDone == 0 {
		return nil, nil
	}
	// A run that tracks the float model saves its stream after the
	// quantized one: twice the rows.
	if r := c.state.ResidualRows; r != rows && r != 2*rows || c.state.ResidualCols != cols {
		return nil, c.corrupt("residual [%d, %d], the session has [%d, %d]", c.state.ResidualRows, c.state.ResidualCols, rows, cols)
	}
	for _, rec := range c.resumed {
		for i := range rec.Tensors {
			t := &rec.Tensors[i]
			if t.Deleted {
				out.Delete(t.Name)
				continue
			}
			if old, ok := out.Lookup(t.Name); ok && !slices.Equal(old.Shape(), t.tensor().Shape()) {
				return nil, c.corrupt("%s: %s has shape %v, the model %v", layerFile(rec.Layer), t.Name, t.tensor().Shape(), old.Shape())
			}
			out.Set(t.Name, t.tensor())
		}
	}
	r := c.resid
	c.resid = nil
	return r, nil
}

// layerDone saves layer l (the tensors touched since the previous layer,
// as out now holds them, and the statistics recorded) and the residual
// stream after it, then commits state.json and drops the previous residual.
func (c *Checkpoint) layerDone(l int, out *model.Model, resid []float32, rows, cols int) error {
	if l != c.state.LayersDone {
		return fmt.Errorf("resume: layer %d finished after %d layers done", l, c.state.LayersDone)
	}
	rec := layerRecord{Layer: l, Stats: c.stats}
	names := make([]string, 0, len(c.touched))
	for n := range c.touched {
		names = append(names, n)
	}
	slices.Sort(names)
	for _, n := range names {
		r := tensorRecord{Name: n}
		if t, ok := out.Lookup(n); ok {
			if err := r.pack(t); err != nil {
				return err
			}
		} else {
			r.Deleted = true
		}
		rec.Tensors = append(rec.Tensors, r)
	}
	layerCRC, err := writeAtomic(filepath.Join(c.dir, layerFile(l)), func(w io.Writer) error {
		if err := gob.NewEncoder(w).Encode(&rec); err != nil {
			return err
		}
		for _, t := range rec.Tensors {
			if _, err := w.Write(t.codes); err != nil {
				return err
			}
		}
		return nil
	})
	if err != nil {
		return err
	}
	st := c.state
	prev := st.Residual
	st.Residual, st.ResidualRows, st.ResidualCols = residualFile(l), rows, cols
	st.ResidualCRC, err = writeAtomic(filepath.Join(c.dir, st.Residual), func(w io.Writer) error {
		_, err := w.Write(f32Bytes(resid))
		return err
	})
	if err != nil {
		return err
	}
	st.LayersDone = l + 1
	st.LayerCRC = append(append([]uint32(nil), st.LayerCRC...), layerCRC)
	js, err := json.MarshalIndent(st, "", "  ")
	if err != nil {
		return err
	}
	if _, err := writeAtomic(filepath.Join(c.dir, "state.json"), func(w io.Writer) error {
		_, err := w.Write(append(js, '\n'))
		return err
	}); err != nil {
		return err
	}
	c.state = st
	c.stats, c.touched = nil, nil
	if prev != "" && prev != st.Residual {
		os.Remove(filepath.Join(c.dir, prev))
	}
	return nil
}

// writeAtomic writes path whole or not at all (atomicfile: a synced
// temporary renamed over it) and returns the CRC-32C of what write wrote.
func writeAtomic(path string, write func(io.Writer) error) (uint32, error) {
	f, err := atomicfile.Create(path)
	if err != nil {
		return 0, fmt.Errorf("resume: %w", err)
	}
	defer f.Abort()
	if err := write(f); err != nil {
		return 0, fmt.Errorf("resume: %s: %w", path, err)
	}
	crc := f.CRC32C()
	if err := f.Commit(); err != nil {
		return 0, fmt.Errorf("resume: %w", err)
	}
	return crc, nil
}
