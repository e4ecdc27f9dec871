// Package atomicfile writes outputs so that readers see either the old or
// the complete new result, also when the writer is killed:
//
//   - A file (Create) is written to a temporary file ".NAME.tmp-N" beside
//     it, which is renamed over the target only on Commit. A new file gets
//     mode 0666 minus the umask; a replaced file keeps its mode.
//   - A directory (WriteDir) is built as a staging directory ".NAME.tmp-N"
//     beside it and swapped in whole: renamed into place when the target
//     does not exist or is empty, exchanged with it atomically
//     (renameat2 RENAME_EXCHANGE) when it is replaced, so no reader ever
//     sees a mix of old and new files.
//
// Targets are checked first: device nodes, FIFOs and sockets are refused; a
// symbolic link is written through (its final target is replaced, the link
// stays); a directory that is not empty is replaced only when forced, and
// only when it holds a model.
//
// Lock serialises writers of one target with flock(2) on ".NAME.lock": a
// second writer fails at once with a clear error. Holding the lock, it
// removes the temporary files and directories that killed runs left for
// that target, so nothing from a dead run blocks or confuses the next one.
package atomicfile

import (
	"bufio"
	"errors"
	"fmt"
	"hash"
	"hash/crc32"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"regexp"
	"strconv"

	"golang.org/x/sys/unix"

	"qtool/formats/infile"
)

// File is an output being written. Write through Write; finish with Commit,
// or Abort (safe to call after Commit, so `defer f.Abort()` is the idiom).
type File struct {
	w      *bufio.Writer
	path   string      // as given, for messages
	real   string      // path with symbolic links resolved: what is replaced
	old    bool        // a file is replaced (else a new one is created)
	mode   fs.FileMode // mode of the file replaced
	tmp    *os.File
	crc    hash.Hash32
	n      int64
	closed bool
}

// Create starts writing path. Its directory must exist. path must not be a
// directory or a special file; a symbolic link is written through.
func Create(path string) (*File, error) {
	real, fi, err := resolve(path)
	if err != nil {
		return nil, err
	}
	if fi != nil && !fi.Mode().IsRegular() {
		return nil, fmt.Errorf("write %s: %s; qtool writes model files only as regular files", path, describe(real, fi))
	}
	tmp, err := createTemp(real)
	if err != nil {
		return nil, fmt.Errorf("create %s: %w", path, err)
	}
	f := &File{path: path, real: real, tmp: tmp, crc: crc32.New(crc32.MakeTable(crc32.Castagnoli))}
	if fi != nil {
		f.old, f.mode = true, fi.Mode().Perm()
	}
	f.w = bufio.NewWriterSize(tmp, 1<<20)
	return f, nil
}

// Write implements io.Writer.
func (f *File) Write(p []byte) (int, error) {
	n, err := f.w.Write(p)
	f.crc.Write(p[:n])
	f.n += int64(n)
	return n, err
}

// Path is the final path of the file.
func (f *File) Path() string { return f.path }

// Size is the number of bytes written through Write so far.
func (f *File) Size() int64 { return f.n }

// CRC32C is the CRC-32C (Castagnoli) of the bytes written so far.
func (f *File) CRC32C() uint32 { return f.crc.Sum32() }

// Commit flushes, syncs and renames the temporary file to its final path.
func (f *File) Commit() error { return CommitAll(f) }

// CommitAll commits files together: each is flushed and synced first, then
// all are renamed into place one right after the other, so the time in
// which some are new and others old is that of a few renames. On error
// nothing not yet renamed is committed.
func CommitAll(files ...*File) error {
	var err error
	for _, f := range files {
		if err == nil {
			err = f.prepare()
		} else {
			f.Abort()
		}
	}
	// A rename over a file frees the old file's blocks inside the rename
	// call, which for a large file takes long enough for a kill to land
	// between two renames (the signal is delivered as the call returns).
	// Keeping each old file linked under a temporary name until all are
	// renamed makes the renames quick; the old data is freed afterwards.
	var keep []string
	for _, f := range files {
		if err == nil && f.old {
			name := tempPrefix(f.real) + strconv.FormatUint(uint64(rand.Uint32()), 10)
			if os.Link(f.real, name) == nil {
				keep = append(keep, name)
			}
		}
	}
	defer func() {
		for _, k := range keep {
			os.Remove(k)
		}
	}()
	for _, f := range files {
		if err == nil {
			if err = os.Rename(f.tmp.Name(), f.real); err != nil {
				err = fmt.Errorf("write %s: %w", f.path, err)
			}
		}
		if err != nil {
			os.Remove(f.tmp.Name())
		}
	}
	if err != nil {
		return err
	}
	synced := map[string]bool{}
	for _, f := range files {
		if d := filepath.Dir(f.real); !synced[d] {
			syncDir(d)
			synced[d] = true
		}
	}
	return nil
}

// prepare flushes, syncs and closes the temporary file and gives it its
// final mode.
func (f *File) prepare() error {
	if f.closed {
		return fmt.Errorf("write %s: already finished", f.path)
	}
	f.closed = true
	err := f.w.Flush()
	if err == nil {
		err = f.tmp.Sync()
	}
	if cerr := f.tmp.Close(); err == nil {
		err = cerr
	}
	if err == nil && f.old {
		err = os.Chmod(f.tmp.Name(), f.mode)
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

// tempPrefix is the hidden prefix of the temporaries of target.
func tempPrefix(target string) string {
	return filepath.Join(filepath.Dir(target), "."+filepath.Base(target)+".tmp-")
}

// createTemp creates a new temporary file for target with mode 0666 (the
// umask applies, as for any new file).
func createTemp(target string) (*os.File, error) {
	for range 1000 {
		name := tempPrefix(target) + strconv.FormatUint(uint64(rand.Uint32()), 10)
		f, err := os.OpenFile(name, os.O_RDWR|os.O_CREATE|os.O_EXCL, 0o666)
		if errors.Is(err, fs.ErrExist) {
			continue
		}
		return f, err
	}
	return nil, fmt.Errorf("no free temporary name %s*", tempPrefix(target))
}

// mkdirTemp creates a new staging directory for target (mode 0777 minus the
// umask).
func mkdirTemp(target string) (string, error) {
	for range 1000 {
		name := tempPrefix(target) + strconv.FormatUint(uint64(rand.Uint32()), 10)
		err := os.Mkdir(name, 0o777)
		if errors.Is(err, fs.ErrExist) {
			continue
		}
		return name, err
	}
	return "", fmt.Errorf("no free temporary name %s*", tempPrefix(target))
}

// resolve follows symbolic links of path to the file that would be
// replaced. fi is nil when that file does not exist yet (its directory
// must). A dangling link is refused: where it points is not ours to create.
func resolve(path string) (real string, fi fs.FileInfo, err error) {
	clean := filepath.Clean(path) // "out/" names out, not a file in it
	li, err := os.Lstat(clean)
	if errors.Is(err, fs.ErrNotExist) {
		if _, err := os.Stat(filepath.Dir(clean)); err != nil {
			return "", nil, fmt.Errorf("write %s: directory %s: %w", path, filepath.Dir(clean), err)
		}
		return clean, nil, nil
	}
	if err != nil {
		return "", nil, fmt.Errorf("write %s: %w", path, err)
	}
	if li.Mode()&fs.ModeSymlink == 0 {
		return clean, li, nil
	}
	real, err = filepath.EvalSymlinks(path)
	if err != nil {
		return "", nil, fmt.Errorf("write %s: it is a symbolic link that does not resolve (%w); remove it or point it at a file", path, err)
	}
	fi, err = os.Lstat(real)
	if err != nil {
		return "", nil, fmt.Errorf("write %s: %w", path, err)
	}
	return real, fi, nil
}

// describe names what an existing non-regular file is.
func describe(path string, fi fs.FileInfo) string { return path + " is " + infile.Kind(fi.Mode()) }

// syncDir makes a rename in dir durable (best effort).
func syncDir(dir string) {
	if d, err := os.Open(dir); err == nil {
		d.Sync()
		d.Close()
	}
}

// WriteFile writes data to path atomically (see Create).
func WriteFile(path string, data []byte) error {
	out, err := Create(path)
	if err != nil {
		return err
	}
	defer out.Abort()
	if _, err := out.Write(data); err != nil {
		return err
	}
	return out.Commit()
}

// Lock is the write lock of one target, held from Lock to Unlock.
type Lock struct {
	f    *os.File
	path string
}

// ErrLocked is wrapped by Lock's error when another process writes the
// target.
var ErrLocked = errors.New("another process is writing it")

// LockTarget takes the write lock of target (flock on ".NAME.lock" beside
// it, released by the kernel if the process dies) and removes what dead
// runs left for target: its temporaries ".NAME.tmp-N" and those of its
// companions ".NAME.COMPANION.tmp-N" (companions such as "json" for a
// sidecar NAME.json). It fails at once when another process holds it.
func LockTarget(target string, companions ...string) (*Lock, error) {
	real, _, err := resolve(target)
	if err != nil {
		return nil, err
	}
	lp := filepath.Join(filepath.Dir(real), "."+filepath.Base(real)+".lock")
	for {
		f, err := os.OpenFile(lp, os.O_RDWR|os.O_CREATE, 0o666)
		if err != nil {
			return nil, fmt.Errorf("write %s: lock: %w", target, err)
		}
		if err := unix.Flock(int(f.Fd()), unix.LOCK_EX|unix.LOCK_NB); err != nil {
			f.Close()
			if errors.Is(err, unix.EWOULDBLOCK) {
				return nil, fmt.Errorf("write %s: %w (lock %s is held); wait for it or choose another output", target, ErrLocked, lp)
			}
			return nil, fmt.Errorf("write %s: lock %s: %w", target, lp, err)
		}
		// The previous holder removes the lock file when done; if it did
		// so after we opened it, we hold a lock on a file nobody else
		// sees: start again.
		held, err1 := f.Stat()
		now, err2 := os.Stat(lp)
		if err1 == nil && err2 == nil && os.SameFile(held, now) {
			l := &Lock{f: f, path: lp}
			sweep(real, companions)
			return l, nil
		}
		f.Close()
	}
}

// Unlock releases the lock and removes the lock file.
func (l *Lock) Unlock() {
	if l == nil || l.f == nil {
		return
	}
	os.Remove(l.path)
	l.f.Close()
	l.f = nil
}

// sweep removes the temporaries of dead runs for target; the caller holds
// target's lock, so no live writer owns them.
func sweep(target string, companions []string) {
	dir, base := filepath.Dir(target), filepath.Base(target)
	alt := regexp.QuoteMeta(base)
	for _, c := range companions {
		alt += "|" + regexp.QuoteMeta(base+"."+c)
	}
	re := regexp.MustCompile(`^\.(` + alt + `)\.tmp-[0-9]+$`)
	ents, err := os.ReadDir(dir)
	if err != nil {
		return
	}
	for _, e := range ents {
		if re.MatchString(e.Name()) {
			os.RemoveAll(filepath.Join(dir, e.Name()))
		}
	}
}
