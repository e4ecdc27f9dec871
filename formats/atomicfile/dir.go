package atomicfile

import (
	"errors"
	"fmt"
	"io/fs"
	"math/rand/v2"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"golang.org/x/sys/unix"
)

// ErrNotEmpty is wrapped by WriteDir's error when the target directory holds
// something and replacing it was not asked for.
var ErrNotEmpty = errors.New("directory is not empty")

// WriteDir writes a directory output at path as one unit. Holding path's
// lock (see LockTarget), it creates a staging directory ".NAME.tmp-N" beside
// path and calls fill with it; when fill succeeds the staging directory
// takes path's place in one rename (an exchange when path exists), and the
// old directory is removed. When fill fails, or the process dies, path is
// untouched and the staging directory is removed (now, or by the next
// writer of path). Paths of the staging directory in fill's error are
// reported as paths under path.
//
// An existing path must be a directory (or a symbolic link to one, which
// is written through). An empty one is replaced. One that is not empty is
// refused with ErrNotEmpty unless force is set; even then it is replaced
// only when it holds a model (config.json, manifest.json, a
// quant_model_description file or a *.safetensors file at its top level)
// and is not the working directory or one of its parents: force must not
// remove a directory of anything else. A new directory gets mode 0777
// minus the umask; a replaced one keeps its mode. Missing parent
// directories are created.
func WriteDir(path string, force bool, fill func(dir string) error) error {
	// Missing parents are created (they are not part of the output and
	// block nothing if the write fails).
	if err := os.MkdirAll(filepath.Dir(filepath.Clean(path)), 0o777); err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	real, fi, err := resolve(path)
	if err != nil {
		return err
	}
	if fi != nil {
		if !fi.IsDir() {
			return fmt.Errorf("write %s: %s, want a directory (or a path that does not exist)", path, describe(real, fi))
		}
		if err := replaceable(path, real, force); err != nil {
			return err
		}
	}
	lock, err := LockTarget(real)
	if err != nil {
		return err
	}
	defer lock.Unlock()
	// Another writer may have finished between the check above and the
	// lock: check again, holding it.
	if fi, err = os.Stat(real); err == nil {
		if !fi.IsDir() {
			return fmt.Errorf("write %s: %s, want a directory", path, describe(real, fi))
		}
		if err := replaceable(path, real, force); err != nil {
			return err
		}
	} else if !errors.Is(err, fs.ErrNotExist) {
		return fmt.Errorf("write %s: %w", path, err)
	}
	tmp, err := mkdirTemp(real)
	if err != nil {
		return fmt.Errorf("write %s: staging directory: %w", path, err)
	}
	done := false
	defer func() {
		if !done {
			os.RemoveAll(tmp)
		}
	}()
	if fi != nil {
		if err := os.Chmod(tmp, fi.Mode().Perm()); err != nil {
			return fmt.Errorf("write %s: %w", path, err)
		}
	}
	if err := fill(tmp); err != nil {
		return &stagedError{msg: strings.ReplaceAll(err.Error(), tmp, path), err: err}
	}
	syncDir(tmp)
	if fi == nil {
		if err := os.Rename(tmp, real); err != nil {
			return fmt.Errorf("write %s: %w", path, err)
		}
		done = true
		syncDir(filepath.Dir(real))
		return nil
	}
	old, err := exchange(tmp, real)
	if err != nil {
		return fmt.Errorf("write %s: replace: %w", path, err)
	}
	done = true
	syncDir(filepath.Dir(real))
	if err := os.RemoveAll(old); err != nil {
		return fmt.Errorf("write %s: written, but removing the old contents (now %s) failed: %w", path, old, err)
	}
	return nil
}

// exchange puts the staging directory tmp at real and returns where the old
// contents of real went (to be removed). RENAME_EXCHANGE swaps both names
// in one step; on filesystems (or systems other than Linux) without it
// the old directory is renamed aside first (a crash between the two
// renames leaves path missing and the old model in ".NAME.tmp-N").
func exchange(tmp, real string) (string, error) {
	err := renameExchange(tmp, real)
	if err == nil {
		return tmp, nil
	}
	if !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOSYS) && !errors.Is(err, unix.ENOTSUP) {
		return "", err
	}
	old := tempPrefix(real) + strconv.FormatUint(uint64(rand.Uint32()), 10)
	if err := os.Rename(real, old); err != nil {
		return "", err
	}
	if err := os.Rename(tmp, real); err != nil {
		os.Rename(old, real)
		return "", err
	}
	return old, nil
}

// replaceable checks that the existing directory real may be replaced.
func replaceable(path, real string, force bool) error {
	ents, err := os.ReadDir(real)
	if err != nil {
		return fmt.Errorf("write %s: %w", path, err)
	}
	var names []string
	model := false
	for _, e := range ents {
		n := e.Name()
		names = append(names, n)
		model = model || isModelFile(n)
	}
	if len(names) == 0 {
		return nil
	}
	slices.Sort(names)
	list := strings.Join(names[:min(len(names), 4)], ", ")
	if len(names) > 4 {
		list += fmt.Sprintf(", … (%d entries)", len(names))
	}
	if !force {
		return fmt.Errorf("write %s: %w (it holds %s); --force replaces it, removing everything in it", path, ErrNotEmpty, list)
	}
	if !model {
		return fmt.Errorf("write %s: %w and holds no model (it holds %s); refusing to replace it even with --force", path, ErrNotEmpty, list)
	}
	abs, err1 := filepath.Abs(real)
	wd, err2 := os.Getwd()
	if err1 != nil || err2 != nil || wd == abs || strings.HasPrefix(wd, abs+string(filepath.Separator)) {
		return fmt.Errorf("write %s: it is the working directory or one of its parents; refusing to replace it", path)
	}
	return nil
}

// isModelFile reports whether a top-level file name marks a model directory.
func isModelFile(name string) bool {
	return name == "config.json" || name == "manifest.json" ||
		strings.HasPrefix(name, "quant_model_description") || strings.HasSuffix(name, ".safetensors") ||
		strings.HasSuffix(name, ".safetensors.index.json")
}

// stagedError is fill's error with staging paths replaced by the target's.
type stagedError struct {
	msg string
	err error
}

func (e *stagedError) Error() string { return e.msg }
func (e *stagedError) Unwrap() error { return e.err }
