package cuda

import (
	"os"
	"path/filepath"
	"strings"
	"testing"
)

// TestCubinPath checks Options.CubinPath's refusals, which come before any
// device is opened (so they run without a GPU): a cubin without the PTX
// it was built from, a missing file and a file that is not a cubin; and
// that an ELF image is taken.
func TestCubinPath(t *testing.T) {
	dir := t.TempDir()
	write := func(name, data string) string {
		p := filepath.Join(dir, name)
		if err := os.WriteFile(p, []byte(data), 0o644); err != nil {
			t.Fatal(err)
		}
		return p
	}
	if _, err := NewWithOptions(Options{CubinPath: "k.cubin"}); err == nil || !strings.Contains(err.Error(), "k.cubin") ||
		!strings.Contains(err.Error(), "QTOOL_CUDA_PTX") {
		t.Errorf("a cubin without its PTX: error %v, want one naming the cubin and QTOOL_CUDA_PTX", err)
	}
	for _, tc := range []struct {
		name, path, want string // want: a part of the error, "" for none
	}{
		{"missing", filepath.Join(dir, "none.cubin"), "none.cubin"},
		{"ptx", write("ptx.cubin", "// qtool-source-sha256: 00\n.version 8.0\n.target sm_90a\n"), "not a cubin"},
		{"empty", write("empty.cubin", ""), "not a cubin"},
		{"elf", write("elf.cubin", "\x7fELF\x02\x01\x01"), ""},
	} {
		t.Run(tc.name, func(t *testing.T) {
			image, err := readCubin(tc.path)
			switch {
			case tc.want == "" && err != nil:
				t.Errorf("readCubin(%s): %v", tc.path, err)
			case tc.want == "" && len(image) == 0:
				t.Errorf("readCubin(%s): no image", tc.path)
			case tc.want != "" && (err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), tc.path)):
				t.Errorf("readCubin(%s): error %v, want one naming the file and %q", tc.path, err, tc.want)
			}
		})
	}
}
