package infile

import (
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"
)

func TestOpenRefusesSpecialFiles(t *testing.T) {
	dir := t.TempDir()
	fifo := filepath.Join(dir, "model.safetensors")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	done := make(chan error, 1)
	go func() { _, err := ReadFile(fifo, MetaLimit); done <- err }()
	select {
	case err := <-done:
		if err == nil || !strings.Contains(err.Error(), "FIFO") || !strings.Contains(err.Error(), fifo) {
			t.Fatalf("FIFO: err = %v", err)
		}
	case <-time.After(10 * time.Second):
		t.Fatal("reading a FIFO blocked")
	}
	for path, kind := range map[string]string{"/dev/zero": "character device", dir: "directory"} {
		if _, err := ReadFile(path, TextLimit); err == nil || !strings.Contains(err.Error(), kind) {
			t.Errorf("%s: err = %v, want %q", path, err, kind)
		}
	}
}

func TestReadFileLimit(t *testing.T) {
	p := filepath.Join(t.TempDir(), "big.txt")
	os.WriteFile(p, make([]byte, 3<<20), 0o644)
	if _, err := ReadFile(p, 2<<20); err == nil || !strings.Contains(err.Error(), "limit of 2 MiB") {
		t.Fatalf("err = %v", err)
	}
	if b, err := ReadFile(p, 3<<20); err != nil || len(b) != 3<<20 {
		t.Fatalf("%d bytes, %v", len(b), err)
	}
}
