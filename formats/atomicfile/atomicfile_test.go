package atomicfile

import (
	"errors"
	"net"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
)

func write(t *testing.T, path, data string) error {
	t.Helper()
	return WriteFile(path, []byte(data))
}

func TestCreateRefusesSpecialFiles(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "fifo")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	sock := filepath.Join(dir, "sock")
	l, err := net.Listen("unix", sock)
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	cases := map[string]string{fifo: "FIFO", sock: "socket", dir: "directory"}
	// A device node like /dev/null (c 1 3), made here: only root can.
	nulldev := filepath.Join(dir, "nulldev")
	if err := syscall.Mknod(nulldev, syscall.S_IFCHR|0o666, 1<<8|3); err == nil {
		cases[nulldev] = "character device"
	} else {
		t.Logf("mknod: %v (device case skipped)", err)
	}
	for path, kind := range cases {
		before, _ := os.Lstat(path)
		err := write(t, path, "model")
		if err == nil || !strings.Contains(err.Error(), kind) || !strings.Contains(err.Error(), path) {
			t.Errorf("%s: err = %v, want a refusal naming it a %s", path, err, kind)
		}
		after, _ := os.Lstat(path)
		if after == nil || after.Mode() != before.Mode() {
			t.Errorf("%s: mode %v became %v", path, before.Mode(), after)
		}
	}
}

func TestCreateWritesThroughSymlink(t *testing.T) {
	dir := t.TempDir()
	target := filepath.Join(dir, "real.bin")
	if err := os.WriteFile(target, []byte("old"), 0o600); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(dir, "link.bin")
	if err := os.Symlink("real.bin", link); err != nil {
		t.Fatal(err)
	}
	if err := write(t, link, "new"); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Lstat(link); err != nil || fi.Mode()&os.ModeSymlink == 0 {
		t.Fatalf("the link was replaced: %v %v", fi, err)
	}
	if b, _ := os.ReadFile(target); string(b) != "new" {
		t.Fatalf("target holds %q, want the new contents", b)
	}
	if fi, _ := os.Stat(target); fi.Mode().Perm() != 0o600 {
		t.Errorf("target mode %v, want its old 0600", fi.Mode().Perm())
	}
	dangling := filepath.Join(dir, "dangling.bin")
	if err := os.Symlink("nowhere/x.bin", dangling); err != nil {
		t.Fatal(err)
	}
	if err := write(t, dangling, "new"); err == nil || !strings.Contains(err.Error(), "does not resolve") {
		t.Errorf("dangling link: err = %v", err)
	}
}

func TestCreateKeepsModeAndUmask(t *testing.T) {
	dir := t.TempDir()
	old := syscall.Umask(0o077)
	defer syscall.Umask(old)
	fresh := filepath.Join(dir, "fresh.bin")
	if err := write(t, fresh, "x"); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(fresh); fi.Mode().Perm() != 0o600 {
		t.Errorf("new file under umask 077 has mode %v, want 0600", fi.Mode().Perm())
	}
	syscall.Umask(0o022)
	kept := filepath.Join(dir, "kept.bin")
	if err := os.WriteFile(kept, []byte("old"), 0o640); err != nil {
		t.Fatal(err)
	}
	os.Chmod(kept, 0o640)
	if err := write(t, kept, "new"); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(kept); fi.Mode().Perm() != 0o640 {
		t.Errorf("replaced file has mode %v, want its old 0640", fi.Mode().Perm())
	}
	d := filepath.Join(dir, "newdir")
	if err := WriteDir(d, false, func(tmp string) error { return write(t, filepath.Join(tmp, "config.json"), "{}") }); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(d); fi.Mode().Perm() != 0o755 {
		t.Errorf("new directory under umask 022 has mode %v, want 0755", fi.Mode().Perm())
	}
}

// fillModel writes a small "model" whose files all carry tag.
func fillModel(tag string, files ...string) func(string) error {
	return func(dir string) error {
		for _, f := range files {
			if err := WriteFile(filepath.Join(dir, f), []byte(tag)); err != nil {
				return err
			}
		}
		return nil
	}
}

func TestWriteDirReplaces(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "out")
	if err := WriteDir(out, false, fillModel("old", "config.json", "model-00001-of-00002.safetensors", "model.safetensors.index.json")); err != nil {
		t.Fatal(err)
	}
	err := WriteDir(out, false, fillModel("new", "config.json", "model.safetensors"))
	if !errors.Is(err, ErrNotEmpty) || !strings.Contains(err.Error(), "--force") || !strings.Contains(err.Error(), "config.json") {
		t.Fatalf("err = %v, want a refusal naming the contents and --force", err)
	}
	if err := WriteDir(out, true, fillModel("new", "config.json", "model.safetensors")); err != nil {
		t.Fatal(err)
	}
	if names := listDir(out); names != "config.json model.safetensors" {
		t.Fatalf("after --force the directory holds %v: the old model must be gone entirely", names)
	}
	left, _ := filepath.Glob(filepath.Join(dir, ".out*"))
	if len(left) > 0 {
		t.Fatalf("left behind: %v", left)
	}
	// A directory of something else is not replaced even when forced.
	other := filepath.Join(dir, "photos")
	os.Mkdir(other, 0o755)
	os.WriteFile(filepath.Join(other, "cat.jpg"), []byte("meow"), 0o644)
	if err := WriteDir(other, true, fillModel("new", "config.json")); err == nil || !strings.Contains(err.Error(), "holds no model") {
		t.Fatalf("forced over a non-model directory: err = %v", err)
	}
	// "out/" is out itself.
	if err := WriteDir(out+"/", true, fillModel("slash", "config.json")); err != nil {
		t.Fatal(err)
	}
	if names := listDir(out); names != "config.json" {
		t.Fatalf("after writing %s/: %q", out, names)
	}
	// An empty directory is simply filled.
	empty := filepath.Join(dir, "empty")
	os.Mkdir(empty, 0o700)
	if err := WriteDir(empty, false, fillModel("new", "config.json")); err != nil {
		t.Fatal(err)
	}
	if fi, _ := os.Stat(empty); fi.Mode().Perm() != 0o700 {
		t.Errorf("replaced empty directory has mode %v, want its old 0700", fi.Mode().Perm())
	}
	// A regular file where a directory should go is refused.
	file := filepath.Join(dir, "file")
	os.WriteFile(file, nil, 0o644)
	if err := WriteDir(file, true, fillModel("new", "config.json")); err == nil || !strings.Contains(err.Error(), "want a directory") {
		t.Fatalf("err = %v", err)
	}
}

func TestWriteDirThroughSymlink(t *testing.T) {
	dir := t.TempDir()
	real := filepath.Join(dir, "models", "m")
	os.MkdirAll(real, 0o750)
	link := filepath.Join(dir, "m")
	if err := os.Symlink("models/m", link); err != nil {
		t.Fatal(err)
	}
	if err := WriteDir(link, false, fillModel("new", "config.json")); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Lstat(link); err != nil || fi.Mode()&os.ModeSymlink == 0 {
		t.Fatalf("the link was replaced: %v %v", fi, err)
	}
	if names := listDir(real); names != "config.json" {
		t.Fatalf("link target holds %q", names)
	}
	if fi, _ := os.Stat(real); fi.Mode().Perm() != 0o750 {
		t.Errorf("replaced directory has mode %v, want its old 0750", fi.Mode().Perm())
	}
}

func TestWriteDirFailureLeavesNothing(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "out")
	boom := errors.New("disk full")
	err := WriteDir(out, false, func(tmp string) error {
		if err := WriteFile(filepath.Join(tmp, "model.safetensors"), []byte("half")); err != nil {
			return err
		}
		return &os.PathError{Op: "write", Path: filepath.Join(tmp, "config.json"), Err: boom}
	})
	if !errors.Is(err, boom) || !strings.Contains(err.Error(), filepath.Join(out, "config.json")) || strings.Contains(err.Error(), ".tmp-") {
		t.Fatalf("err = %v, want the fill error naming %s", err, filepath.Join(out, "config.json"))
	}
	if ents, _ := os.ReadDir(dir); len(ents) != 0 {
		t.Fatalf("a failed write left %v", ents)
	}
	// ... so the retry is not blocked.
	if err := WriteDir(out, false, fillModel("new", "config.json")); err != nil {
		t.Fatal(err)
	}
}

func TestLockOneWriterWins(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "out")
	l, err := LockTarget(out)
	if err != nil {
		t.Fatal(err)
	}
	err = WriteDir(out, false, fillModel("b", "config.json"))
	if !errors.Is(err, ErrLocked) || !strings.Contains(err.Error(), out) {
		t.Fatalf("second writer: err = %v, want ErrLocked naming %s", err, out)
	}
	if _, err := os.Stat(out); err == nil {
		t.Fatal("the losing writer wrote the target")
	}
	l.Unlock()
	if err := WriteDir(out, false, fillModel("b", "config.json")); err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(filepath.Join(dir, ".out.lock")); err == nil {
		t.Error("lock file left behind")
	}
}

func TestLockRemovesDeadRunsTemporaries(t *testing.T) {
	dir := t.TempDir()
	out := filepath.Join(dir, "m.bin")
	stale := []string{".m.bin.tmp-12345", ".m.bin.json.tmp-678"}
	for _, s := range stale {
		os.WriteFile(filepath.Join(dir, s), []byte("dead"), 0o644)
	}
	os.MkdirAll(filepath.Join(dir, ".m.bin.tmp-99", "sub"), 0o755)
	keep := []string{".m.bin.tmp-x", ".other.tmp-1", ".m.bin.x.tmp-1", "m.bin.tmp-1"}
	for _, k := range keep {
		os.WriteFile(filepath.Join(dir, k), nil, 0o644)
	}
	l, err := LockTarget(out, "json")
	if err != nil {
		t.Fatal(err)
	}
	l.Unlock()
	if names := listDir(dir); names != ".m.bin.tmp-x .m.bin.x.tmp-1 .other.tmp-1 m.bin.tmp-1" {
		t.Fatalf("after the sweep: %v", names)
	}
}

// listDir is the names in dir, sorted and joined by spaces.
func listDir(dir string) string {
	ents, _ := os.ReadDir(dir)
	var names []string
	for _, e := range ents {
		names = append(names, e.Name())
	}
	return strings.Join(names, " ")
}
