package cpu

import (
	"errors"
	"math"
	"math/rand/v2"
	"testing"

	"qtool/runtime"
)

func randMat(r *rand.Rand, rows, cols int) []float32 {
	v := make([]float32, rows*cols)
	for i := range v {
		v[i] = float32(r.NormFloat64())
	}
	return v
}

// TestAddCrossGram checks g += xᵀ·y against float64 sums, across the
// gramChunk boundary and onto a non-zero g.
func TestAddCrossGram(t *testing.T) {
	for _, tc := range []struct {
		name       string
		rows, a, c int
	}{
		{"square", 40, 16, 16},
		{"wide y", 33, 5, 24},
		{"two chunks", gramChunk + 77, 7, 3},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(uint64(tc.rows), 5))
			b := New(2)
			xv, yv, gv := randMat(r, tc.rows, tc.a), randMat(r, tc.rows, tc.c), randMat(r, tc.a, tc.c)
			g := upload(b, tc.a, tc.c, gv)
			b.AddCrossGram(g, upload(b, tc.rows, tc.a, xv), upload(b, tc.rows, tc.c, yv))
			got := download(b, g)
			for i := 0; i < tc.a; i++ {
				for j := 0; j < tc.c; j++ {
					want := float64(gv[i*tc.c+j])
					for k := 0; k < tc.rows; k++ {
						want += float64(xv[k*tc.a+i]) * float64(yv[k*tc.c+j])
					}
					if d := math.Abs(float64(got[i*tc.c+j]) - want); d > 1e-4*math.Sqrt(float64(tc.rows)) {
						t.Fatalf("(%d,%d): got %g, want %g", i, j, got[i*tc.c+j], want)
					}
				}
			}
		})
	}
}

// TestSolveSPD checks b·(a + damp·I)⁻¹ by multiplying back in float64,
// and the refusal of an indefinite matrix.
func TestSolveSPD(t *testing.T) {
	for _, tc := range []struct {
		name       string
		rows, n    int
		damp       float64
		indefinite bool
	}{
		{"one row", 1, 12, 0, false},
		{"damped", 9, 20, 0.5, false},
		{"indefinite", 3, 6, 0, true},
	} {
		t.Run(tc.name, func(t *testing.T) {
			r := rand.New(rand.NewPCG(uint64(tc.n), 9))
			b := New(2)
			// a = zᵀz + I (positive definite), or with a negative pivot
			z := randMat(r, 3*tc.n, tc.n)
			av := make([]float32, tc.n*tc.n)
			for i := 0; i < tc.n; i++ {
				for j := 0; j < tc.n; j++ {
					s := 0.0
					for k := 0; k < 3*tc.n; k++ {
						s += float64(z[k*tc.n+i]) * float64(z[k*tc.n+j])
					}
					av[i*tc.n+j] = float32(s)
				}
				av[i*tc.n+i]++
			}
			if tc.indefinite {
				av[2*tc.n+2] = -1
			}
			bv := randMat(r, tc.rows, tc.n)
			x := upload(b, tc.rows, tc.n, bv)
			err := b.SolveSPD(x, upload(b, tc.n, tc.n, av), tc.damp)
			if tc.indefinite {
				if !errors.Is(err, runtime.ErrNotPositiveDefinite) {
					t.Fatalf("err %v, want ErrNotPositiveDefinite", err)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			got := download(b, x)
			for i := 0; i < tc.rows; i++ {
				for j := 0; j < tc.n; j++ {
					s := 0.0 // (got·(a + damp·I))_ij
					for k := 0; k < tc.n; k++ {
						v := float64(av[k*tc.n+j])
						if k == j {
							v += tc.damp
						}
						s += float64(got[i*tc.n+k]) * v
					}
					if math.Abs(s-float64(bv[i*tc.n+j])) > 1e-4 {
						t.Fatalf("row %d col %d: x·a = %g, want %g", i, j, s, bv[i*tc.n+j])
					}
				}
			}
		})
	}
}
