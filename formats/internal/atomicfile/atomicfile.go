// Package atomicfile writes a file so that readers see either nothing or the
// complete result: data goes to a temporary file in the target directory,
// which is renamed over the target only on Commit.
package atomicfile

import (
	"bufio"
	"fmt"
	"os"
	"path/filepath"
)

// File is an output being written. Write through W; finish with Commit, or
// Abort (safe to call after Commit, so `defer f.Abort()` is the idiom).
type File struct {
	W      *bufio.Writer
	path   string
	tmp    *os.File
	closed bool
}

// Create starts writing path. Its directory must exist.
func Create(path string) (*File, error) {
	dir := filepath.Dir(path)
	tmp, err := os.CreateTemp(dir, "."+filepath.Base(path)+".tmp-*")
	if err != nil {
		return nil, fmt.Errorf("create %s: %w", path, err)
	}
	return &File{W: bufio.NewWriterSize(tmp, 1<<20), path: path, tmp: tmp}, nil
}

// Write implements io.Writer.
func (f *File) Write(p []byte) (int, error) { return f.W.Write(p) }

// Path is the final path of the file.
func (f *File) Path() string { return f.path }

// Commit flushes, syncs and renames the temporary file to its final path.
func (f *File) Commit() error {
	if f.closed {
		return fmt.Errorf("write %s: already finished", f.path)
	}
	f.closed = true
	err := f.W.Flush()
	if err == nil {
		err = f.tmp.Sync()
	}
	if cerr := f.tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil {
		err = os.Chmod(f.tmp.Name(), 0o644)
	}
	if err == nil {
		err = os.Rename(f.tmp.Name(), f.path)
	}
	if err != nil {
		os.Remove(f.tmp.Name())
		return fmt.Errorf("write %s: %w", f.path, err)
	}
	return nil
}

// Abort discards the temporary file. It does nothing after Commit.
func (f *File) Abort() {
	if f.closed {
		return
	}
	f.closed = true
	f.tmp.Close()
	os.Remove(f.tmp.Name())
}
