// Package infile opens input files without the surprises of special files:
// a device node, FIFO or socket where a model, config or text file should
// be is refused with an error that says what it is (opening a FIFO would
// block until a writer appears; /dev/zero never ends), and whole-file reads
// are bounded by a size limit checked before any memory is allocated.
package infile

import (
	"fmt"
	"io"
	"io/fs"
	"os"
	"syscall"
)

// Size limits for whole-file reads.
const (
	// MetaLimit bounds JSON metadata: config.json, sidecars, indexes,
	// manifests, descriptions, tokenizer files.
	MetaLimit = 256 << 20
	// TextLimit bounds text read whole and tokenized (--ppl, --calib).
	TextLimit = 1 << 30
)

// Open opens path for reading. It must be a regular file (symbolic links are
// followed); the type is checked before the open, and the open never blocks
// (O_NONBLOCK, in case the file was swapped for a FIFO in between).
func Open(path string) (*os.File, fs.FileInfo, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return nil, nil, err
	}
	if err := regular(path, fi); err != nil {
		return nil, nil, err
	}
	f, err := os.OpenFile(path, os.O_RDONLY|syscall.O_NONBLOCK, 0)
	if err != nil {
		return nil, nil, err
	}
	fi, err = f.Stat()
	if err == nil {
		err = regular(path, fi)
	}
	if err != nil {
		f.Close()
		return nil, nil, err
	}
	return f, fi, nil
}

// ReadFile reads a whole regular file of at most limit bytes.
func ReadFile(path string, limit int64) ([]byte, error) {
	f, fi, err := Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	if fi.Size() > limit {
		return nil, fmt.Errorf("%s: %d bytes, more than the limit of %d MiB for this kind of file", path, fi.Size(), limit>>20)
	}
	data, err := io.ReadAll(io.LimitReader(f, limit+1))
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	if int64(len(data)) > limit {
		return nil, fmt.Errorf("%s: grew past the limit of %d MiB while being read", path, limit>>20)
	}
	return data, nil
}

// regular refuses anything but a regular file, naming what it is.
func regular(path string, fi fs.FileInfo) error {
	if fi.Mode().IsRegular() {
		return nil
	}
	return &fs.PathError{Op: "open", Path: path, Err: fmt.Errorf("is %s, want a regular file", Kind(fi.Mode()))}
}

// Kind names the type of a file that is not regular: "a directory", "a
// FIFO (named pipe)", ...
func Kind(m fs.FileMode) string {
	switch {
	case m.IsRegular():
		return "a regular file"
	case m.IsDir():
		return "a directory"
	case m&fs.ModeSymlink != 0:
		return "a symbolic link"
	case m&fs.ModeCharDevice != 0:
		return "a character device"
	case m&fs.ModeDevice != 0:
		return "a block device"
	case m&fs.ModeNamedPipe != 0:
		return "a FIFO (named pipe)"
	case m&fs.ModeSocket != 0:
		return "a socket"
	}
	return "a special file"
}
