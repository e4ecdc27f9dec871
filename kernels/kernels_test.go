package kernels

import (
	"bytes"
	"testing"
)

// TestPTXBuiltFromSource checks that every committed PTX file was compiled
// from the current CUDA source (run kernels/build.sh on a machine with nvcc
// after editing one) and holds the kernels the backend looks up.
func TestPTXBuiltFromSource(t *testing.T) {
	inference := []string{"gemv_q4_sh", "gemm_q4", "gemm_h_f16", "gemv_q8_r4u1", "gemv_f16_r4u2", "attention", "rmsnorm", "nll", "argmax"}
	calibration := []string{"gather_rows", "col_stats", "sq_diff", "scale_cols", "diag_f32", "widen", "cal_gemm_f32", "cal_gemm_f64",
		"mirror_lower", "build_a", "potrf_diag", "extract_u", "copy_block_f64", "gptq_prep", "gptq_fit", "gptq_block",
		"awq_fakequant", "awq_clip"}
	for _, tc := range []struct {
		name    string
		ptx     []byte
		arch    string
		want    string
		kernels []string
	}{
		{"qtool_sm80.ptx", ptx80, ".target sm_80", SourceHash(), inference},
		{"qtool_sm90.ptx", ptx90, ".target sm_90a", SourceHash(), append(inference, "gemm_wg_f16", "gemm_wg_bf16", "gemm_wg_q4", "gemm_wg_q8", "gemm_wg_s8")},
		{"calib_sm80.ptx", calibPTX80, ".target sm_80", CalibSourceHash(), calibration},
		{"calib_sm90.ptx", calibPTX90, ".target sm_90\n", CalibSourceHash(), calibration},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, ok := RecordedHash(tc.ptx)
			if !ok {
				t.Fatalf("%s: first line does not start with %q", tc.name, HashPrefix)
			}
			if got != tc.want {
				t.Fatalf("%s was built from source %s, the source is now %s: run kernels/build.sh", tc.name, got, tc.want)
			}
			if !bytes.Contains(tc.ptx, []byte(tc.arch)) {
				t.Errorf("%s does not target %s", tc.name, tc.arch)
			}
			for _, k := range tc.kernels {
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
	}{{9, 0, "sm_90a"}, {10, 0, "sm_80"}, {12, 0, "sm_80"}, {8, 0, "sm_80"}, {8, 9, "sm_80"}, {7, 5, ""}} {
		if _, got := PTX(tc.major, tc.minor); got != tc.want {
			t.Errorf("PTX(%d.%d) = %q, want %q", tc.major, tc.minor, got, tc.want)
		}
	}
}

func TestIsArchSpecific(t *testing.T) {
	for _, tc := range []struct {
		ptx  string
		want bool
	}{
		{"//\n.version 8.8\n.target sm_90a\n.address_size 64\n", true},
		{".version 8.8\n.target sm_90\n", false},
		{".version 8.8\n.target sm_80, debug\n", false},
		{"no target", false},
	} {
		if got := IsArchSpecific([]byte(tc.ptx)); got != tc.want {
			t.Errorf("IsArchSpecific(%q) = %v, want %v", tc.ptx, got, tc.want)
		}
	}
}
