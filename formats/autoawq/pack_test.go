package autoawq

import (
	"math/rand/v2"
	"strings"
	"testing"

	"qtool/formats/model"
)

// constQ makes a 4-bit weight [out, in] whose codes are all u (unsigned) and
// whose zero points are all z (unsigned), scale 1.
func constQ(out, in, group, u, z int) *model.Quantized {
	G := in / group
	q := &model.Quantized{Bits: 4, GroupSize: group, Rows: out, Cols: in,
		Q: make([]int8, out*in), Scale: make([]float32, out*G), Zero: make([]float32, out*G)}
	for i := range q.Q {
		q.Q[i] = int8(u - 8)
	}
	for i := range q.Scale {
		q.Scale[i] = 1
		q.Zero[i] = float32(z - 8)
	}
	return q
}

func TestPackKnownNibbles(t *testing.T) {
	tests := []struct {
		name       string
		setCol     int // output column whose code (row 0) becomes 0xA
		wantWeight uint32
	}{
		// column 8c+j sits in nibble ReverseOrder[j] = [0,4,1,5,2,6,3,7][j]
		{"col0->nibble0", 0, 0x8888888A},
		{"col1->nibble4", 1, 0x888A8888},
		{"col2->nibble1", 2, 0x888888A8},
		{"col3->nibble5", 3, 0x88A88888},
		{"col4->nibble2", 4, 0x88888A88},
		{"col7->nibble7", 7, 0xA8888888},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			q := constQ(16, 4, 2, 8, 8) // [out 16, in 4], group 2
			q.Q[tc.setCol*4+0] = 0xA - 8
			qw, qz, sc, err := Pack(q)
			if err != nil {
				t.Fatal(err)
			}
			if len(qw) != 4*2 || len(qz) != 2*2 || len(sc) != 2*16 {
				t.Fatalf("lengths %d %d %d, want 8 4 32", len(qw), len(qz), len(sc))
			}
			if got := uint32(qw[0]); got != tc.wantWeight {
				t.Errorf("qweight[0][0] = %#08x, want %#08x", got, tc.wantWeight)
			}
			for i := 1; i < len(qw); i++ {
				if uint32(qw[i]) != 0x88888888 {
					t.Errorf("qweight word %d = %#08x, want 0x88888888", i, uint32(qw[i]))
				}
			}
			for i, s := range sc {
				if s != 0x3C00 { // fp16 1.0
					t.Fatalf("scale %d = %#04x, want 0x3c00", i, s)
				}
			}
		})
	}
}

func TestPackZeros(t *testing.T) {
	// out 8, in 4, group 2: zeros [2, 1]. Zero of output 1, group 1 = 3;
	// output 6, group 0 = 15; everything else 0.
	q := constQ(8, 4, 2, 0, 0)
	q.Zero[1*2+1] = 3 - 8
	q.Zero[6*2+0] = 15 - 8
	_, qz, _, err := Pack(q)
	if err != nil {
		t.Fatal(err)
	}
	// column 6 -> nibble ReverseOrder[6] = 3; column 1 -> nibble 4
	if got, want := uint32(qz[0]), uint32(0x0000F000); got != want {
		t.Errorf("qzeros[0] = %#08x, want %#08x", got, want)
	}
	if got, want := uint32(qz[1]), uint32(0x00030000); got != want {
		t.Errorf("qzeros[1] = %#08x, want %#08x", got, want)
	}
	// symmetric: zero code 8 everywhere
	q.Zero = nil
	_, qz, _, err = Pack(q)
	if err != nil {
		t.Fatal(err)
	}
	for i, w := range qz {
		if uint32(w) != 0x88888888 {
			t.Errorf("symmetric qzeros[%d] = %#08x, want 0x88888888", i, uint32(w))
		}
	}
}

// RandomQuantized makes a random 4-bit asymmetric weight with fp16 scales.
func randomQuantized(r *rand.Rand, out, in, group int) *model.Quantized {
	G := in / group
	q := &model.Quantized{Bits: 4, GroupSize: group, Rows: out, Cols: in,
		Q: make([]int8, out*in), Scale: make([]float32, out*G), Zero: make([]float32, out*G)}
	for i := range q.Q {
		q.Q[i] = int8(r.IntN(16) - 8)
	}
	for i := range q.Scale {
		q.Scale[i] = model.RoundF16(r.Float32()*0.1 + 1e-3)
		q.Zero[i] = float32(r.IntN(16) - 8)
	}
	return q
}

func TestPackUnpackRoundTrip(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, sh := range []struct{ out, in, group int }{{8, 8, 8}, {16, 32, 8}, {64, 256, 128}, {24, 96, 32}, {8, 128, 128}} {
		q := randomQuantized(r, sh.out, sh.in, sh.group)
		qw, qz, sc, err := Pack(q)
		if err != nil {
			t.Fatal(err)
		}
		back, err := Unpack(qw, qz, sc, sh.in, sh.out, sh.group)
		if err != nil {
			t.Fatal(err)
		}
		equalQuantized(t, q, back)
	}
}

func equalQuantized(t *testing.T, a, b *model.Quantized) {
	t.Helper()
	if a.Bits != b.Bits || a.GroupSize != b.GroupSize || a.Rows != b.Rows || a.Cols != b.Cols {
		t.Fatalf("header %d/%d/%dx%d vs %d/%d/%dx%d", a.Bits, a.GroupSize, a.Rows, a.Cols, b.Bits, b.GroupSize, b.Rows, b.Cols)
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
}

func TestPackErrors(t *testing.T) {
	base := func() *model.Quantized { return constQ(8, 8, 4, 8, 8) }
	tests := []struct {
		name string
		mod  func(q *model.Quantized)
		want string
	}{
		{"bits8", func(q *model.Quantized) { q.Bits = 8 }, "only 4-bit"},
		{"perchannel", func(q *model.Quantized) { q.GroupSize = 0; q.Scale = q.Scale[:8]; q.Zero = q.Zero[:8] }, "per-group"},
		{"gidx", func(q *model.Quantized) { q.GIdx = make([]int32, 8) }, "g_idx"},
		{"fraczero", func(q *model.Quantized) { q.Zero[3] = 0.5 }, "not an integer"},
		{"rows", func(q *model.Quantized) { q.Rows = 4; q.Q = q.Q[:32]; q.Scale = q.Scale[:8]; q.Zero = q.Zero[:8] }, "multiple of 8"},
		{"bigscale", func(q *model.Quantized) { q.Scale[0] = 1e6 }, "fp16"},
		{"shortQ", func(q *model.Quantized) { q.Q = q.Q[:5] }, "values for shape"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			q := base()
			tc.mod(q)
			_, _, _, err := Pack(q)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("err = %v, want it to mention %q", err, tc.want)
			}
		})
	}
}

func TestUnpackErrors(t *testing.T) {
	tests := []struct {
		name           string
		nw, nz, ns     int
		in, out, group int
		want           string
	}{
		{"ok", 16, 2, 16, 16, 8, 8, ""},
		{"qweight", 15, 2, 16, 16, 8, 8, "qweight has 15"},
		{"qzeros", 16, 1, 16, 16, 8, 8, "qzeros has 1"},
		{"scales", 16, 2, 8, 16, 8, 8, "scales has 8"},
		{"group", 16, 2, 16, 16, 8, 5, "does not divide"},
		{"out", 16, 2, 16, 16, 7, 8, "multiple of 8"},
		{"neg", 0, 0, 0, -1, 8, 8, "positive"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Unpack(make([]int32, tc.nw), make([]int32, tc.nz), make([]uint16, tc.ns), tc.in, tc.out, tc.group)
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
}

func BenchmarkPack(b *testing.B) {
	q := randomQuantized(rand.New(rand.NewPCG(5, 6)), 2048, 2048, 128)
	b.SetBytes(int64(len(q.Q)))
	for b.Loop() {
		if _, _, _, err := Pack(q); err != nil {
			b.Fatal(err)
		}
	}
}

func BenchmarkUnpack(b *testing.B) {
	q := randomQuantized(rand.New(rand.NewPCG(5, 6)), 2048, 2048, 128)
	qw, qz, sc, err := Pack(q)
	if err != nil {
		b.Fatal(err)
	}
	b.SetBytes(int64(len(q.Q)))
	for b.Loop() {
		if _, err := Unpack(qw, qz, sc, 2048, 2048, 128); err != nil {
			b.Fatal(err)
		}
	}
}
