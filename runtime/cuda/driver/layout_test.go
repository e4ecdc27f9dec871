package driver

import (
	"testing"
	"unsafe"
)

// TestLaunchConfigLayout checks the Go mirrors of CUlaunchConfig and
// CUlaunchAttribute against cuda.h's x86-64/arm64 layout (they are passed
// to cuLaunchKernelEx by pointer).
func TestLaunchConfigLayout(t *testing.T) {
	var c launchConfig
	var a launchAttr
	for _, tc := range []struct {
		what      string
		got, want uintptr
	}{
		{"sizeof(CUlaunchAttribute)", unsafe.Sizeof(a), 72},
		{"offsetof(CUlaunchAttribute, value)", unsafe.Offsetof(a.value), 8},
		{"offsetof(CUlaunchConfig, sharedMemBytes)", unsafe.Offsetof(c.shmem), 24},
		{"offsetof(CUlaunchConfig, hStream)", unsafe.Offsetof(c.stream), 32},
		{"offsetof(CUlaunchConfig, attrs)", unsafe.Offsetof(c.attrs), 40},
		{"offsetof(CUlaunchConfig, numAttrs)", unsafe.Offsetof(c.numAttrs), 48},
		{"sizeof(CUlaunchConfig)", unsafe.Sizeof(c), 56},
	} {
		if tc.got != tc.want {
			t.Errorf("%s = %d, want %d", tc.what, tc.got, tc.want)
		}
	}
}

// TestClusterDim checks the cluster attribute's value against
// CUlaunchAttributeValue's clusterDim {x, y, z unsigned int}: x and y in
// the first 8 bytes (x low), z in the next 4.
func TestClusterDim(t *testing.T) {
	a := clusterDim([3]uint32{2, 3, 8})
	if a.id != attrClusterDimension || a.value[0] != 2|3<<32 || a.value[1] != 8 {
		t.Errorf("clusterDim({2, 3, 8}) = id %d, value %#x %#x, want id %d, value 0x300000002 0x8", a.id, a.value[0], a.value[1], attrClusterDimension)
	}
}
