package gptq

import (
	"fmt"
	"math/rand/v2"
	"strings"
	"testing"

	"qtool/formats/model"
)

// fill makes a weight [out, in] whose unsigned codes come from code(n, k)
// and whose zero points (nil: symmetric) come from zero(n, g).
func fill(out, in, bits, group int, code func(n, k int) int, zero func(n, g int) int) *model.Quantized {
	q := &model.Quantized{Bits: bits, GroupSize: group, Rows: out, Cols: in, Q: make([]int8, out*in)}
	G := q.Groups()
	q.Scale = make([]float32, out*G)
	off := q.Offset()
	for n := 0; n < out; n++ {
		for k := 0; k < in; k++ {
			q.Q[n*in+k] = int8(code(n, k) - off)
		}
		for g := 0; g < G; g++ {
			q.Scale[n*G+g] = 0.5
		}
	}
	if zero != nil {
		q.Zero = make([]float32, out*G)
		for n := 0; n < out; n++ {
			for g := 0; g < G; g++ {
				q.Zero[n*G+g] = float32(zero(n, g) - off)
			}
		}
	}
	return q
}

func TestPackKnownWords(t *testing.T) {
	tests := []struct {
		name      string
		q         *model.Quantized
		wantW     map[[2]int]uint32 // (word row, column) -> qweight word
		wantZeros []uint32          // whole qzeros, row-major
	}{
		{"4bit-sym", fill(8, 8, 4, 8, func(n, k int) int {
			if n == 0 {
				return k
			}
			return 8
		}, nil), map[[2]int]uint32{{0, 0}: 0x76543210, {0, 1}: 0x88888888, {0, 7}: 0x88888888}, []uint32{0x77777777}},
		{"8bit-sym", fill(4, 4, 8, 0, func(n, k int) int {
			if n == 2 {
				return []int{1, 2, 3, 0xFE}[k]
			}
			return 128
		}, nil), map[[2]int]uint32{{0, 2}: 0xFE030201, {0, 0}: 0x80808080}, []uint32{0x7F7F7F7F}},
		{"2bit", fill(16, 16, 2, 16, func(n, k int) int {
			if n == 0 && k < 4 {
				return []int{3, 0, 1, 2}[k]
			}
			return 0
		}, nil), map[[2]int]uint32{{0, 0}: 0x00000093, {0, 1}: 0}, []uint32{0x55555555}},
		{"3bit-straddle", fill(32, 32, 3, 32, func(n, k int) int {
			if n == 0 && k == 10 {
				return 7 // stream bits 30..32
			}
			if n == 0 && k == 21 {
				return 5 // stream bits 63..65: 1 in word 1 bit 31, 0b10 in word 2
			}
			return 0
		}, func(n, g int) int { return 1 }), map[[2]int]uint32{{0, 0}: 0xC0000000, {1, 0}: 0x80000001, {2, 0}: 0x00000002, {0, 1}: 0}, []uint32{0, 0, 0}},
		{"4bit-asym-zero", fill(8, 8, 4, 4, func(n, k int) int { return 0 }, func(n, g int) int {
			if n == 2 && g == 1 {
				return 5
			}
			if n == 7 && g == 0 {
				return 15
			}
			return 1
		}), map[[2]int]uint32{{0, 0}: 0}, []uint32{0xE0000000, 0x00000400}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			qw, qz, sc, gi, err := Pack(tc.q)
			if err != nil {
				t.Fatal(err)
			}
			out := tc.q.Rows
			for pos, want := range tc.wantW {
				if got := uint32(qw[pos[0]*out+pos[1]]); got != want {
					t.Errorf("qweight[%d][%d] = %#08x, want %#08x", pos[0], pos[1], got, want)
				}
			}
			if len(qz) != len(tc.wantZeros) {
				t.Fatalf("qzeros has %d words, want %d", len(qz), len(tc.wantZeros))
			}
			for i, want := range tc.wantZeros {
				if uint32(qz[i]) != want {
					t.Errorf("qzeros[%d] = %#08x, want %#08x", i, uint32(qz[i]), want)
				}
			}
			for i, s := range sc {
				if s != 0x3800 { // fp16 0.5
					t.Fatalf("scales[%d] = %#04x, want 0x3800", i, s)
				}
			}
			for c, g := range gi {
				if int(g) != tc.q.Group(c) {
					t.Fatalf("g_idx[%d] = %d, want %d", c, g, tc.q.Group(c))
				}
			}
		})
	}
}

func randomQuantized(r *rand.Rand, out, in, bits, group int, sym, actOrder bool) *model.Quantized {
	q := &model.Quantized{Bits: bits, GroupSize: group, Rows: out, Cols: in, Q: make([]int8, out*in)}
	G := q.Groups()
	off := q.Offset()
	for i := range q.Q {
		q.Q[i] = int8(r.IntN(1<<bits) - off)
	}
	q.Scale = make([]float32, out*G)
	for i := range q.Scale {
		q.Scale[i] = model.RoundF16(r.Float32()*0.1 + 1e-3)
	}
	if !sym {
		q.Zero = make([]float32, out*G)
		for i := range q.Zero {
			q.Zero[i] = float32(1 + r.IntN(1<<bits-1) - off)
		}
	}
	if actOrder {
		perm := r.Perm(in)
		q.GIdx = make([]int32, in)
		for c, p := range perm {
			q.GIdx[c] = int32(p / group)
		}
	}
	return q
}

func TestPackUnpackRoundTrip(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for _, bits := range []int{2, 3, 4, 8} {
		for _, sh := range []struct{ out, in, group int }{{32, 64, 32}, {64, 256, 128}, {32, 96, 0}, {96, 128, 64}} {
			for _, sym := range []bool{true, false} {
				for _, act := range []bool{false, true} {
					if act && sh.group == 0 {
						continue
					}
					q := randomQuantized(r, sh.out, sh.in, bits, sh.group, sym, act)
					qw, qz, sc, gi, err := Pack(q)
					if err != nil {
						t.Fatal(err)
					}
					back, err := Unpack(qw, qz, sc, gi, Layer{In: sh.in, Out: sh.out, Bits: bits, Group: sh.group})
					if err != nil {
						t.Fatal(err)
					}
					equalQuantized(t, q, back)
				}
			}
		}
	}
}

func equalQuantized(t *testing.T, a, b *model.Quantized) {
	t.Helper()
	if a.Bits != b.Bits || a.GroupSize != b.GroupSize || a.Rows != b.Rows || a.Cols != b.Cols {
		t.Fatalf("header %d/%d/%dx%d vs %d/%d/%dx%d", a.Bits, a.GroupSize, a.Rows, a.Cols, b.Bits, b.GroupSize, b.Rows, b.Cols)
	}
	if (a.Zero == nil) != (b.Zero == nil) && !allZero(a.Zero) && !allZero(b.Zero) {
		t.Fatalf("symmetric %v vs %v", a.Zero == nil, b.Zero == nil)
	}
	for i := range a.Q {
		if a.Q[i] != b.Q[i] {
			t.Fatalf("Q[%d] = %d vs %d", i, a.Q[i], b.Q[i])
		}
	}
	for i := range a.Scale {
		if a.Scale[i] != b.Scale[i] {
			t.Fatalf("Scale[%d] = %g vs %g", i, a.Scale[i], b.Scale[i])
		}
		za, zb := float32(0), float32(0)
		if a.Zero != nil {
			za = a.Zero[i]
		}
		if b.Zero != nil {
			zb = b.Zero[i]
		}
		if za != zb {
			t.Fatalf("Zero[%d] = %g vs %g", i, za, zb)
		}
	}
	for c := 0; c < a.Cols; c++ {
		if a.Group(c) != b.Group(c) {
			t.Fatalf("group of column %d = %d vs %d", c, a.Group(c), b.Group(c))
		}
	}
}

func allZero(z []float32) bool {
	for _, v := range z {
		if v != 0 {
			return false
		}
	}
	return true
}

func TestPackErrors(t *testing.T) {
	base := func() *model.Quantized {
		return fill(8, 32, 4, 8, func(n, k int) int { return 3 }, func(n, g int) int { return 2 })
	}
	tests := []struct {
		name string
		mod  func(q *model.Quantized)
		want string
	}{
		{"zero0", func(q *model.Quantized) { q.Zero[5] = -8 }, "0 cannot be stored"},
		{"fraczero", func(q *model.Quantized) { q.Zero[5] = 0.25 }, "not an integer"},
		{"bits5", func(q *model.Quantized) { q.Bits = 5 }, "5-bit"},
		{"rows", func(q *model.Quantized) { q.Rows = 4; q.Q = q.Q[:128]; q.Scale = q.Scale[:16]; q.Zero = q.Zero[:16] }, "output features"},
		{"bigscale", func(q *model.Quantized) { q.Scale[0] = 1e9 }, "fp16"},
		{"gidx-range", func(q *model.Quantized) { q.GIdx = make([]int32, 32); q.GIdx[3] = 9 }, "g_idx[3]"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			q := base()
			tc.mod(q)
			_, _, _, _, err := Pack(q)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to mention %q", err, tc.want)
			}
		})
	}
}

func TestUnpackErrors(t *testing.T) {
	l := Layer{In: 64, Out: 16, Bits: 4, Group: 32}
	tests := []struct {
		name           string
		nw, nz, ns, ng int
		l              Layer
		want           string
	}{
		{"ok", 8 * 16, 2 * 2, 2 * 16, 64, l, ""},
		{"ok-no-gidx", 8 * 16, 2 * 2, 2 * 16, -1, l, ""},
		{"qweight", 8*16 - 1, 4, 32, 64, l, "qweight has"},
		{"qzeros", 128, 3, 32, 64, l, "qzeros has"},
		{"scales", 128, 4, 16, 64, l, "scales has"},
		{"gidx", 128, 4, 32, 63, l, "g_idx has 63"},
		{"bits", 128, 4, 32, 64, Layer{In: 64, Out: 16, Bits: 6, Group: 32}, "6-bit"},
		{"group", 128, 4, 32, 64, Layer{In: 64, Out: 16, Bits: 4, Group: 48}, "does not divide"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var gi []int32
			if tc.ng >= 0 {
				gi = make([]int32, tc.ng)
			}
			_, err := Unpack(make([]int32, tc.nw), make([]int32, tc.nz), make([]uint16, tc.ns), gi, tc.l)
			if tc.want == "" {
				if err != nil {
					t.Fatal(err)
				}
				return
			}
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to mention %q", err, tc.want)
			}
		})
	}
	// g_idx out of range
	gi := make([]int32, 64)
	gi[10] = 2
	if _, err := Unpack(make([]int32, 128), make([]int32, 4), make([]uint16, 32), gi, l); err == nil || !strings.Contains(err.Error(), "g_idx[10] = 2") {
		t.Errorf("g_idx range: err = %v", err)
	}
}

func BenchmarkPack(b *testing.B) {
	for _, bits := range []int{3, 4} {
		q := randomQuantized(rand.New(rand.NewPCG(5, 6)), 2048, 2048, bits, 128, false, false)
		b.Run(fmt.Sprintf("%dbit", bits), func(b *testing.B) {
			b.SetBytes(int64(len(q.Q)))
			for b.Loop() {
				if _, _, _, _, err := Pack(q); err != nil {
					b.Fatal(err)
				}
			}
		})
	}
}

func BenchmarkUnpack(b *testing.B) {
	q := randomQuantized(rand.New(rand.NewPCG(5, 6)), 2048, 2048, 4, 128, false, false)
	qw, qz, sc, gi, err := Pack(q)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(q.Q)))
	for b.Loop() {
		if _, err := Unpack(qw, qz, sc, gi, Layer{In: 2048, Out: 2048, Bits: 4, Group: 128}); err != nil {
			b.Fatal(err)
		}
	}
}
