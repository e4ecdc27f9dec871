package gemm

import (
	"fmt"
	"math"
	"math/rand/v2"
	"testing"
)

// naiveNT is the reference: a triple loop with float64 accumulation.
func naiveNT(m, n, k int, a []float32, lda int, b []float32, ldb int, c []float64, ldc int) {
	for i := 0; i < m; i++ {
		for j := 0; j < n; j++ {
			var s float64
			for p := 0; p < k; p++ {
				s += float64(a[i*lda+p]) * float64(b[j*ldb+p])
			}
			c[i*ldc+j] = s
		}
	}
}

func randSlice(r *rand.Rand, n int) []float32 {
	s := make([]float32, n)
	for i := range s {
		s[i] = float32(r.NormFloat64())
	}
	return s
}

type shape struct{ m, n, k int }

func testShapes() []shape {
	dims := []int{1, 3, 7, 17, 63, 65}
	var s []shape
	for _, m := range dims {
		for _, n := range dims {
			for _, k := range []int{1, 7, 17, 65} {
				s = append(s, shape{m, n, k})
			}
		}
	}
	s = append(s,
		shape{255, 33, 511}, shape{13, 769, 255}, shape{1, 769, 511}, shape{2, 100, 769},
		shape{511, 65, 769}, shape{1, 1, 769}, shape{64, 64, 64}, shape{130, 257, 300},
		shape{300, 20, 300}, shape{100, 9, 70}, shape{25, 3000, 40},
		shape{0, 5, 5}, shape{5, 0, 5}, shape{5, 5, 0},
	)
	if !testing.Short() {
		s = append(s, shape{512, 256, 256}, shape{512, 128, 768}, shape{37, 1030, 1100})
	}
	return s
}

// checkClose compares got against the float64 reference with a relative
// tolerance scaled by sqrt(k) and by the magnitude of the summands.
func checkClose(t *testing.T, name string, m, n, k int, got []float32, ldc int, want []float64, scale []float64) {
	t.Helper()
	tol := 1e-5 * math.Sqrt(float64(max(k, 1)))
	bad := 0
	for i := 0; i < m; i++ {
		for j := 0; j < n; j++ {
			g, w := float64(got[i*ldc+j]), want[i*n+j]
			// scale = Σ|a·b| (the sum if no cancellation happened).
			if d := math.Abs(g - w); d > tol*(scale[i*n+j]+1e-30) || math.IsNaN(g) {
				if bad < 5 {
					t.Errorf("%s: c[%d,%d] = %g, want %g (diff %g, tol %g)", name, i, j, g, w, d, tol*scale[i*n+j])
				}
				bad++
			}
		}
	}
	if bad > 0 {
		t.Errorf("%s: %d of %d values wrong", name, bad, m*n)
	}
}

func TestMatMulNT(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	for _, im := range impls() {
		for _, sh := range testShapes() {
			m, n, k := sh.m, sh.n, sh.k
			for _, pad := range []int{0, 3} {
				lda, ldb, ldc := k+pad, k+2*pad, n+pad
				a := randSlice(r, max(m*lda, 1))
				b := randSlice(r, max(n*ldb, 1))
				want := make([]float64, m*n)
				scale := make([]float64, m*n)
				naiveNT(m, n, k, a, lda, b, ldb, want, n)
				absA := make([]float32, len(a))
				absB := make([]float32, len(b))
				for i, v := range a {
					absA[i] = float32(math.Abs(float64(v)))
				}
				for i, v := range b {
					absB[i] = float32(math.Abs(float64(v)))
				}
				naiveNT(m, n, k, absA, lda, absB, ldb, scale, n)
				for _, threads := range []int{1, 2} {
					for _, acc := range []bool{false, true} {
						name := fmt.Sprintf("%s/m%d_n%d_k%d_pad%d_t%d_acc%v", im.name, m, n, k, pad, threads, acc)
						c := randSlice(r, max(m*ldc, 1))
						init := append([]float32(nil), c...)
						matMulNT(im, m, n, k, a, lda, b, ldb, c, ldc, acc, threads)
						w := want
						sc := scale
						if acc {
							w = make([]float64, m*n)
							sc = make([]float64, m*n)
							for i := 0; i < m; i++ {
								for j := 0; j < n; j++ {
									w[i*n+j] = want[i*n+j] + float64(init[i*ldc+j])
									sc[i*n+j] = scale[i*n+j] + math.Abs(float64(init[i*ldc+j]))
								}
							}
						}
						checkClose(t, name, m, n, k, c, ldc, w, sc)
						// Padding between rows of C must be untouched.
						for i := 0; i < m; i++ {
							for j := n; j < ldc && i*ldc+j < len(c); j++ {
								if c[i*ldc+j] != init[i*ldc+j] {
									t.Fatalf("%s: padding c[%d,%d] changed", name, i, j)
								}
							}
						}
					}
				}
			}
		}
	}
}

func TestMatMulNTRows(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for _, im := range impls() {
		for _, sh := range testShapes() {
			m, n, k := sh.m, sh.n, sh.k
			ldc := n + 1
			a := randSlice(r, max(m*k, 1))
			b := randSlice(r, max(n*k, 1))
			want := make([]float64, m*n)
			scale := make([]float64, m*n)
			naiveNT(m, n, k, a, k, b, k, want, n)
			for i := range scale {
				scale[i] = math.Abs(want[i]) + math.Sqrt(float64(k))*4
			}
			for _, threads := range []int{1, 2} {
				name := fmt.Sprintf("%s/m%d_n%d_k%d_t%d", im.name, m, n, k, threads)
				// filled counts how often each row of B was requested.
				filled := make([]int32, n)
				fill := func(j0, j1 int, dst []float32) {
					if j0 < 0 || j1 > n || j0 >= j1 || len(dst) < (j1-j0)*k {
						t.Errorf("%s: bad fill(%d, %d, len %d)", name, j0, j1, len(dst))
						return
					}
					for j := j0; j < j1; j++ {
						filled[j]++ // disjoint ranges: no race
					}
					copy(dst, b[j0*k:j1*k])
				}
				c := randSlice(r, max(m*ldc, 1))
				matMulNTRows(im, m, n, k, a, k, fill, c, ldc, threads)
				checkClose(t, name, m, n, k, c, ldc, want, scale)
				if m > 0 && k > 0 {
					for j, f := range filled {
						if f != 1 {
							t.Fatalf("%s: row %d of B filled %d times, want once", name, j, f)
						}
					}
				}
			}
		}
	}
}

func TestDotAxpy(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	for _, im := range impls() {
		for _, n := range []int{0, 1, 3, 7, 8, 9, 16, 31, 32, 33, 63, 64, 65, 127, 255, 1000} {
			a := randSlice(r, n)
			b := randSlice(r, n)
			var want, scale float64
			for i := range a {
				want += float64(a[i]) * float64(b[i])
				scale += math.Abs(float64(a[i]) * float64(b[i]))
			}
			got := float64(im.dot(a, b))
			if math.Abs(got-want) > 1e-5*math.Sqrt(float64(n+1))*(scale+1e-30) {
				t.Errorf("%s dot n=%d: got %g want %g", im.name, n, got, want)
			}
			alpha := float32(r.NormFloat64())
			y := append([]float32(nil), b...)
			im.axpy(alpha, a, y)
			for i := range y {
				w := float64(b[i]) + float64(alpha)*float64(a[i])
				if math.Abs(float64(y[i])-w) > 1e-6*(math.Abs(float64(b[i]))+math.Abs(float64(alpha*a[i])))+1e-30 {
					t.Errorf("%s axpy n=%d i=%d: got %g want %g", im.name, n, i, y[i], w)
					break
				}
			}
			if n >= 4 {
				var out [4]float32
				ldb := n / 4
				m := ldb
				x := a[:m]
				im.dot4(x, b, ldb, &out)
				for rr := 0; rr < 4; rr++ {
					var w, sc float64
					for i := 0; i < m; i++ {
						w += float64(x[i]) * float64(b[rr*ldb+i])
						sc += math.Abs(float64(x[i]) * float64(b[rr*ldb+i]))
					}
					if math.Abs(float64(out[rr])-w) > 1e-5*math.Sqrt(float64(m+1))*(sc+1e-30) {
						t.Errorf("%s dot4 n=%d row %d: got %g want %g", im.name, m, rr, out[rr], w)
					}
				}
			}
		}
	}
	// Public wrappers.
	a := []float32{1, 2, 3}
	if got := Dot(a, []float32{4, 5, 6, 7}); got != 32 {
		t.Errorf("Dot = %g, want 32", got)
	}
	y := []float32{1, 1, 1}
	Axpy(2, a, y)
	if y[0] != 3 || y[1] != 5 || y[2] != 7 {
		t.Errorf("Axpy = %v, want [3 5 7]", y)
	}
}

func TestPublicAPI(t *testing.T) {
	// C = A·Bᵀ for a 2×3 · (2×3)ᵀ product worked by hand.
	a := []float32{1, 2, 3, 4, 5, 6}
	b := []float32{1, 0, -1, 2, 1, 0}
	c := make([]float32, 4)
	MatMulNT(2, 2, 3, a, 3, b, 3, c, 2, false, 0)
	want := []float32{1 - 3, 2 + 2, 4 - 6, 8 + 5}
	for i := range want {
		if c[i] != want[i] {
			t.Fatalf("MatMulNT = %v, want %v", c, want)
		}
	}
	MatMulNT(2, 2, 3, a, 3, b, 3, c, 2, true, 1)
	for i := range want {
		if c[i] != 2*want[i] {
			t.Fatalf("MatMulNT accumulate = %v, want 2×%v", c, want)
		}
	}
	MatMulNTRows(2, 2, 3, a, 3, func(j0, j1 int, dst []float32) { copy(dst, b[j0*3:j1*3]) }, c, 2, 0)
	for i := range want {
		if c[i] != want[i] {
			t.Fatalf("MatMulNTRows = %v, want %v", c, want)
		}
	}
	if KernelName() == "" {
		t.Error("empty KernelName")
	}
}

func TestShapePanics(t *testing.T) {
	cases := []struct {
		name string
		fn   func()
	}{
		{"short a", func() {
			MatMulNT(2, 2, 2, make([]float32, 3), 2, make([]float32, 4), 2, make([]float32, 4), 2, false, 1)
		}},
		{"short b", func() {
			MatMulNT(2, 2, 2, make([]float32, 4), 2, make([]float32, 3), 2, make([]float32, 4), 2, false, 1)
		}},
		{"short c", func() {
			MatMulNT(2, 2, 2, make([]float32, 4), 2, make([]float32, 4), 2, make([]float32, 3), 2, false, 1)
		}},
		{"small lda", func() {
			MatMulNT(2, 2, 2, make([]float32, 4), 1, make([]float32, 4), 2, make([]float32, 4), 2, false, 1)
		}},
		{"short dot", func() { Dot(make([]float32, 3), make([]float32, 2)) }},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			defer func() {
				if recover() == nil {
					t.Error("no panic")
				}
			}()
			tc.fn()
		})
	}
}

func TestPack(t *testing.T) {
	r := rand.New(rand.NewPCG(11, 12))
	for _, im := range impls() {
		for _, w := range []int{4, 8, 12, 16, 32} {
			for _, rows := range []int{1, 5, 8, 13, 16, 31, 32, 33, 64, 70} {
				for _, kn := range []int{1, 3, 17, 48, 70} {
					ld := kn + 2
					src := randSlice(r, rows*ld)
					panels := (rows + w - 1) / w
					got := randSlice(r, panels*w*kn)
					im.pack(got, src, ld, rows, kn, w)
					for p := 0; p < panels; p++ {
						for q := 0; q < kn; q++ {
							for rr := 0; rr < w; rr++ {
								var want float32
								if row := p*w + rr; row < rows {
									want = src[row*ld+q]
								}
								if g := got[p*w*kn+q*w+rr]; g != want {
									t.Fatalf("%s w=%d rows=%d kn=%d: panel %d q %d r %d = %g, want %g", im.name, w, rows, kn, p, q, rr, g, want)
								}
							}
						}
					}
				}
			}
		}
	}
}

// FuzzMatMulNT checks every kernel set against the float64 reference on
// fuzzed small shapes, strides and thread counts.
func FuzzMatMulNT(f *testing.F) {
	f.Add(uint8(13), uint8(33), uint8(17), uint8(2), uint8(1), true, uint64(1))
	f.Add(uint8(1), uint8(70), uint8(9), uint8(0), uint8(3), false, uint64(2))
	f.Add(uint8(40), uint8(5), uint8(100), uint8(1), uint8(0), false, uint64(3))
	f.Fuzz(func(t *testing.T, m8, n8, k8, pad8, threads8 uint8, acc bool, seed uint64) {
		m, n, k, pad := int(m8)%80, int(n8)%80, int(k8), int(pad8)%4
		threads := int(threads8)%3 + 1
		r := rand.New(rand.NewPCG(seed, 99))
		lda, ldb, ldc := k+pad, k+2*pad, n+pad
		a := randSlice(r, max(m*lda, 1))
		b := randSlice(r, max(n*ldb, 1))
		want := make([]float64, m*n)
		naiveNT(m, n, k, a, lda, b, ldb, want, n)
		scale := make([]float64, m*n)
		init := randSlice(r, max(m*ldc, 1))
		for i := 0; i < m; i++ {
			for j := 0; j < n; j++ {
				scale[i*n+j] = math.Sqrt(float64(k))*8 + 8
				if acc {
					want[i*n+j] += float64(init[i*ldc+j])
				}
			}
		}
		for _, im := range impls() {
			c := append([]float32(nil), init...)
			matMulNT(im, m, n, k, a, lda, b, ldb, c, ldc, acc, threads)
			checkClose(t, im.name, m, n, k, c, ldc, want, scale)
		}
	})
}
