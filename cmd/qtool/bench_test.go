package main

import (
	"reflect"
	"strings"
	"testing"
)

// TestPrintSyntheticRatios checks the same-run ratio lines: one for every
// format benched beside fp16 (W8A8 included: issue 12's prefill criterion),
// in the order benched, none where the run has no fp16.
func TestPrintSyntheticRatios(t *testing.T) {
	f16 := modelResult{Format: "fp16", DecodeGraphTok: 200, PrefillTokS: 30000, RooflineTokS: 300}
	w8a8 := modelResult{Format: "w8a8", DecodeGraphTok: 300, PrefillTokS: 45000, RooflineTokS: 600}
	w4a16 := modelResult{Format: "w4a16", DecodeGraphTok: 500, PrefillTokS: 27000, RooflineTokS: 1000}
	for _, c := range []struct {
		name   string
		models []modelResult
		want   []string
	}{
		{"w8a8 and w4a16", []modelResult{w8a8, f16, w4a16}, []string{
			"  w8a8: decode 1.50x fp16 (graph 300.0 vs 200.0 tok/s), 50% of roofline; prefill 150% of fp16 (45000 vs 30000 tok/s)",
			"  w4a16: decode 2.50x fp16 (graph 500.0 vs 200.0 tok/s), 50% of roofline; prefill 90% of fp16 (27000 vs 30000 tok/s)",
		}},
		{"fp16 alone", []modelResult{f16}, nil},
		{"no fp16", []modelResult{w8a8, w4a16}, nil},
	} {
		var out strings.Builder
		printSyntheticRatios(&benchReport{Models: c.models}, &out)
		var got []string
		for _, l := range strings.Split(out.String(), "\n") {
			if strings.HasPrefix(l, "  ") {
				got = append(got, l)
			}
		}
		if strings.Join(got, "\n") != strings.Join(c.want, "\n") {
			t.Errorf("%s: ratio lines\n%s\nwant\n%s", c.name, strings.Join(got, "\n"), strings.Join(c.want, "\n"))
		}
	}
}

// TestSizeRefRows checks the size references' fp16 shapes: about the bytes
// asked for in rows of sizeRefCols, a multiple of 64 rows, never empty.
func TestSizeRefRows(t *testing.T) {
	for _, c := range []struct {
		bytes float64
		want  int
	}{
		{4096 * 4096 * 0.53125, 1088},  // a 4-bit 4096x4096 weight with its g128 scale words: 1 088 rows exactly
		{4096 * 11008 * 0.53125, 2944}, // a 4-bit down of llama2-7b: 2 924 rows, to 2 944
		{14336 * 4096 * 1.0625, 7616},  // an 8-bit gate of llama3-8b with {scale, zero} floats a group
		{100, 64},                      // no fewer than 64
	} {
		if got := sizeRefRows(c.bytes); got != c.want {
			t.Errorf("sizeRefRows(%.0f) = %d, want %d", c.bytes, got, c.want)
		}
	}
}

// TestAddSizeRef checks that weights of the same reference rows share one
// reference, in the order they came, and that other rows get their own.
func TestAddSizeRef(t *testing.T) {
	var refs []sizeRef
	for _, c := range []struct {
		n  int
		of string
	}{{3840, "w4a16 14336x4096"}, {7616, "w8a16 14336x4096"}, {3840, "w4a16 4096x14336"}, {1088, "w4a16 4096x4096"}} {
		refs = addSizeRef(refs, c.n, c.of)
	}
	want := []sizeRef{{3840, []string{"w4a16 14336x4096", "w4a16 4096x14336"}}, {7616, []string{"w8a16 14336x4096"}}, {1088, []string{"w4a16 4096x4096"}}}
	if !reflect.DeepEqual(refs, want) {
		t.Errorf("addSizeRef gave %v, want %v", refs, want)
	}
}
