package kernels

import (
	"bytes"
	"testing"
)

// TestPTXBuiltFromSource checks that every committed PTX file was compiled
// from the current qtool.cu (run kernels/build.sh on a machine with nvcc
// after editing the source).
func TestPTXBuiltFromSource(t *testing.T) {
	want := SourceHash()
	for _, tc := range []struct {
		name string
		ptx  []byte
		arch string
	}{
		{"qtool_sm80.ptx", ptx80, ".target sm_80"},
		{"qtool_sm90.ptx", ptx90, ".target sm_90"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := RecordedHash(tc.ptx)
			if !ok {
				t.Fatalf("%s: first line does not start with %q", tc.name, HashPrefix)
			}
			if got != want {
				t.Fatalf("%s was built from source %s, qtool.cu is now %s: run kernels/build.sh", tc.name, got, want)
			}
			if !bytes.Contains(tc.ptx, []byte(tc.arch)) {
				t.Errorf("%s does not target %s", tc.name, tc.arch)
			}
			for _, k := range []string{"gemv_q4_sh", "gemm_q4", "gemm_f16", "gemv_q8_r4u1", "gemv_f16_r4u2", "attention", "rmsnorm", "nll", "argmax"} {
				if !bytes.Contains(tc.ptx, []byte(".entry "+k+"(")) {
					t.Errorf("%s lacks kernel %s", tc.name, k)
				}
			}
		})
	}
}

func TestPTXSelection(t *testing.T) {
	for _, tc := range []struct {
		major, minor int
		want         string
	}{{9, 0, "sm_90"}, {10, 0, "sm_90"}, {8, 0, "sm_80"}, {8, 9, "sm_80"}, {7, 5, ""}} {
		if _, got := PTX(tc.major, tc.minor); got != tc.want {
			t.Errorf("PTX(%d.%d) = %q, want %q", tc.major, tc.minor, got, tc.want)
		}
	}
}
