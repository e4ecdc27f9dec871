package safetensors

import (
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"os"
	"path/filepath"
	"slices"
	"sort"
	"strings"

	"qtool/formats/infile"
	"qtool/formats/model"
)

// Checkpoint is a set of safetensors files read as one: a single file or
// the shards named by an index (model.safetensors.index.json).
type Checkpoint struct {
	// Path is the single file or the index file.
	Path   string
	files  []*File
	byName map[string]*File
	names  []string
}

// OpenCheckpoint opens dir/base.safetensors, or the shards listed in
// dir/base.safetensors.index.json when that exists. base is usually "model";
// msmodelslim uses "quant_model_weight(s)".
func OpenCheckpoint(dir, base string) (*Checkpoint, error) {
	index := filepath.Join(dir, base+".safetensors.index.json")
	if _, err := os.Stat(index); err == nil {
		return OpenIndex(index)
	}
	single := filepath.Join(dir, base+".safetensors")
	if _, err := os.Stat(single); err != nil {
		others, _ := filepath.Glob(filepath.Join(dir, "*.safetensors"))
		for _, o := range others {
			if b := filepath.Base(o); strings.HasPrefix(b, "quant_model_weight") && !strings.HasPrefix(base, "quant_model_weight") {
				return nil, &notFound{fmt.Sprintf("%s: an msmodelslim export without its quant_model_description.json (it has %s but no %s.safetensors); restore the description file", dir, b, base)}
			}
		}
		hint := ""
		if len(others) > 0 {
			hint = fmt.Sprintf("; it has %s", filepath.Base(others[0]))
		}
		return nil, fmt.Errorf("%s: %w (looked for %s.safetensors and %s.safetensors.index.json%s)", dir, ErrNotFound, base, base, hint)
	}
	f, err := Open(single)
	if err != nil {
		return nil, err
	}
	return newCheckpoint(single, []*File{f})
}

// Index is the JSON of a sharded checkpoint's index file.
type Index struct {
	Metadata  map[string]any    `json:"metadata"`
	WeightMap map[string]string `json:"weight_map"`
}

// ParseIndex parses the JSON of an index file (path names it in errors) and
// checks that it maps at least one tensor and that every shard is a plain
// file name in the index's own directory.
func ParseIndex(path string, data []byte) (Index, error) {
	var idx Index
	if err := json.Unmarshal(data, &idx); err != nil {
		return Index{}, fmt.Errorf("%s: not a safetensors index: %w", path, err)
	}
	if len(idx.WeightMap) == 0 {
		return Index{}, fmt.Errorf("%s: weight_map is empty", path)
	}
	for _, name := range slices.Sorted(maps.Keys(idx.WeightMap)) {
		s := idx.WeightMap[name]
		if s == "" || s != filepath.Base(s) || strings.HasPrefix(s, ".") {
			return Index{}, fmt.Errorf("%s: tensor %q: shard name %q must be a plain file name in the same directory", path, name, s)
		}
	}
	return idx, nil
}

// OpenIndex opens every shard an index file names and checks that each shard
// holds the tensors the index assigns to it.
func OpenIndex(indexPath string) (*Checkpoint, error) {
	data, err := infile.ReadFile(indexPath, infile.MetaLimit)
	if err != nil {
		return nil, err
	}
	idx, err := ParseIndex(indexPath, data)
	if err != nil {
		return nil, err
	}
	dir := filepath.Dir(indexPath)
	shards := map[string]*File{}
	var files []*File
	closeAll := func() {
		for _, f := range files {
			f.Close()
		}
	}
	shardNames := make([]string, 0)
	for _, s := range idx.WeightMap {
		if _, ok := shards[s]; !ok {
			shards[s] = nil
			shardNames = append(shardNames, s)
		}
	}
	sort.Strings(shardNames)
	for _, s := range shardNames {
		f, err := Open(filepath.Join(dir, s))
		if err != nil {
			closeAll()
			return nil, fmt.Errorf("%s: shard: %w", indexPath, err)
		}
		shards[s] = f
		files = append(files, f)
	}
	for _, name := range slices.Sorted(maps.Keys(idx.WeightMap)) {
		s := idx.WeightMap[name]
		if !shards[s].Has(name) {
			closeAll()
			return nil, fmt.Errorf("%s: tensor %q is mapped to shard %s, which does not hold it", indexPath, name, s)
		}
	}
	c, err := newCheckpoint(indexPath, files)
	if err != nil {
		closeAll()
		return nil, err
	}
	return c, nil
}

func newCheckpoint(path string, files []*File) (*Checkpoint, error) {
	c := &Checkpoint{Path: path, files: files, byName: map[string]*File{}}
	for _, f := range files {
		for _, n := range f.Names() {
			if prev, dup := c.byName[n]; dup {
				return nil, fmt.Errorf("%s: tensor %q appears in both %s and %s", path, n, prev.Path, f.Path)
			}
			c.byName[n] = f
			c.names = append(c.names, n)
		}
	}
	return c, nil
}

// Names lists every tensor, shard by shard in file order.
func (c *Checkpoint) Names() []string { return append([]string(nil), c.names...) }

// Has reports whether the checkpoint holds name.
func (c *Checkpoint) Has(name string) bool { _, ok := c.byName[name]; return ok }

// Info describes name.
func (c *Checkpoint) Info(name string) (Info, bool) {
	f, ok := c.byName[name]
	if !ok {
		return Info{}, false
	}
	return f.Info(name)
}

// Tensor returns name as a dense tensor aliasing its shard's mapping.
func (c *Checkpoint) Tensor(name string) (*model.Dense, error) {
	f, ok := c.byName[name]
	if !ok {
		return nil, fmt.Errorf("%s: no tensor %q", c.Path, name)
	}
	return f.Tensor(name)
}

// Metadata returns the __metadata__ of the first shard.
func (c *Checkpoint) Metadata() map[string]string {
	if len(c.files) == 0 {
		return nil
	}
	return c.files[0].Metadata
}

// Close unmaps every shard.
func (c *Checkpoint) Close() error {
	var errs []error
	for _, f := range c.files {
		errs = append(errs, f.Close())
	}
	return errors.Join(errs...)
}

// notFound is ErrNotFound with a message of its own.
type notFound struct{ msg string }

func (e *notFound) Error() string { return e.msg }
func (e *notFound) Unwrap() error { return ErrNotFound }
