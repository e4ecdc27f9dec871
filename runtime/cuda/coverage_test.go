package cuda

import (
	"flag"
	"fmt"
	"io"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
)

// testKernels adds up, over every backend the tests open (newTestBackend),
// the kernels loaded and the launches of each, for TestMain's check that
// the tests launch every kernel the backend can select.
var testKernels = struct {
	sync.Mutex
	loaded   map[string]bool
	launched map[string]int
}{loaded: map[string]bool{}, launched: map[string]int{}}

// noteTestKernels adds b's loaded kernels and launches to testKernels.
func noteTestKernels(b *Backend) {
	testKernels.Lock()
	defer testKernels.Unlock()
	for k := range b.fn {
		testKernels.loaded[k] = true
	}
	for k, n := range b.launched {
		testKernels.launched[k] += n
	}
}

func TestMain(m *testing.M) {
	code := m.Run()
	if code == 0 && fullRun() {
		testKernels.Lock()
		code = checkKernelCoverage(os.Stderr, testKernels.loaded, testKernels.launched)
		testKernels.Unlock()
	}
	os.Exit(code)
}

// fullRun reports whether every test ran: no -run or -skip, not -short.
func fullRun() bool {
	for _, name := range []string{"test.run", "test.skip"} {
		if f := flag.Lookup(name); f != nil && f.Value.String() != "" {
			return false
		}
	}
	return !testing.Short()
}

// checkKernelCoverage returns 1, naming the kernels on w, when a loaded
// kernel was never launched, else 0: the embedded PTX holds only kernels
// the dispatcher can select, so each must be exercised by some test.
// Without a GPU nothing was loaded and nothing is checked.
func checkKernelCoverage(w io.Writer, loaded map[string]bool, launched map[string]int) int {
	var missing []string
	for k := range loaded {
		if launched[k] == 0 {
			missing = append(missing, k)
		}
	}
	if len(missing) == 0 {
		if len(loaded) > 0 {
			fmt.Fprintf(w, "every one of the %d loaded kernels was launched by a test\n", len(loaded))
		}
		return 0
	}
	slices.Sort(missing)
	fmt.Fprintf(w, "FAIL: no test launched these %d of the %d loaded kernels: %s\n", len(missing), len(loaded), strings.Join(missing, ", "))
	return 1
}

func TestCheckKernelCoverage(t *testing.T) {
	for _, tc := range []struct {
		name     string
		loaded   map[string]bool
		launched map[string]int
		code     int
		out      string
	}{
		{"no GPU", nil, nil, 0, ""},
		{"all", map[string]bool{"a": true, "b": true}, map[string]int{"a": 1, "b": 3}, 0, "every one of the 2 loaded kernels"},
		{"missing", map[string]bool{"a": true, "c": true, "b": true}, map[string]int{"a": 1}, 1, "these 2 of the 3 loaded kernels: b, c\n"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var w strings.Builder
			if code := checkKernelCoverage(&w, tc.loaded, tc.launched); code != tc.code || !strings.Contains(w.String(), tc.out) || (tc.out == "") != (w.Len() == 0) {
				t.Errorf("status %d, output %q; want %d, %q", code, w.String(), tc.code, tc.out)
			}
		})
	}
}
