package gptq

import (
	"math"
	"math/rand/v2"
	"strings"
	"testing"

	"gonum.org/v1/gonum/mat"
)

// sparseProblem is a weight and inputs whose columns share a few strong
// components (correlated inputs, as in a transformer's activations).
func sparseProblem(seed uint64, rows, cols, tokens int) (w, x []float32, h *Hessian) {
	r := rand.New(rand.NewPCG(seed, 9))
	w = make([]float32, rows*cols)
	for i := range w {
		w[i] = float32(r.NormFloat64())
	}
	const comps = 4
	mix := make([]float64, comps*cols)
	for i := range mix {
		mix[i] = r.NormFloat64() * 2
	}
	x = make([]float32, tokens*cols)
	for t := 0; t < tokens; t++ {
		var z [comps]float64
		for k := range z {
			z[k] = r.NormFloat64()
		}
		for c := 0; c < cols; c++ {
			v := 0.3 * r.NormFloat64()
			for k := range z {
				v += z[k] * mix[k*cols+c]
			}
			x[t*cols+c] = float32(v)
		}
	}
	h = NewHessian(cols)
	if err := h.Add(x, tokens); err != nil {
		panic(err)
	}
	return w, x, h
}

// obsReference prunes one row with the mask given, the textbook way: the
// damped inverse Hessian kept explicitly, each fixed column's error spread
// over the later columns by H⁻¹[j,:]/H⁻¹[j,j], then column j removed from
// H⁻¹ by its rank-1 Schur complement.
func obsReference(w []float64, H []float64, n int, mask []bool) []float64 {
	a := mat.NewSymDense(n, nil)
	mean := 0.0
	for i := 0; i < n; i++ {
		mean += H[i*n+i]
	}
	damp := 0.01 * mean / float64(n)
	for i := 0; i < n; i++ {
		for j := i; j < n; j++ {
			v := H[i*n+j]
			if i == j {
				v += damp
			}
			a.SetSym(i, j, v)
		}
	}
	var c mat.Cholesky
	if !c.Factorize(a) {
		panic("not positive definite")
	}
	var inv mat.SymDense
	if err := c.InverseTo(&inv); err != nil {
		panic(err)
	}
	hi := mat.DenseCopyOf(&inv)
	w = append([]float64(nil), w...)
	for j := 0; j < n; j++ {
		q := w[j]
		if mask[j] {
			q = 0
		}
		d := hi.At(j, j)
		e := (w[j] - q) / d
		w[j] = q
		for k := j + 1; k < n; k++ {
			w[k] -= e * hi.At(j, k)
		}
		col := make([]float64, n)
		for k := 0; k < n; k++ {
			col[k] = hi.At(k, j)
		}
		for k := 0; k < n; k++ {
			for l := 0; l < n; l++ {
				hi.Set(k, l, hi.At(k, l)-col[k]*col[l]/d)
			}
		}
	}
	return w
}

// layerErr is ‖(W − Ŵ)Xᵀ‖² / ‖WXᵀ‖².
func layerErr(w, wh, x []float32, rows, cols, tokens int) float64 {
	num, den := 0.0, 0.0
	for t := 0; t < tokens; t++ {
		xt := x[t*cols : (t+1)*cols]
		for r := 0; r < rows; r++ {
			a, b := 0.0, 0.0
			for c, v := range xt {
				a += float64(w[r*cols+c]) * float64(v)
				b += float64(wh[r*cols+c]) * float64(v)
			}
			num += (a - b) * (a - b)
			den += a * a
		}
	}
	return num / den
}

func TestPruneMatchesOBS(t *testing.T) {
	const rows, cols, tokens = 6, 24, 200
	w, _, h := sparseProblem(3, rows, cols, tokens)
	for _, opt := range []SparseOptions{{Sparsity: 0.5, BlockSize: 8}, {N: 2, M: 4}, {Sparsity: 0.25, BlockSize: 128}} {
		res, err := Prune(w, rows, cols, h, opt)
		if err != nil {
			t.Fatal(err)
		}
		H := h.Matrix()
		for r := 0; r < rows; r++ {
			mask := make([]bool, cols)
			row := make([]float64, cols)
			for c := range mask {
				mask[c] = res.W[r*cols+c] == 0
				row[c] = float64(w[r*cols+c])
			}
			want := obsReference(row, H, cols, mask)
			for c := range want {
				if d := math.Abs(float64(res.W[r*cols+c]) - want[c]); d > 1e-5*(1+math.Abs(want[c])) {
					t.Fatalf("%+v: (%d,%d) Prune %g, OBS reference %g", opt, r, c, res.W[r*cols+c], want[c])
				}
			}
		}
	}
}

func TestPrunePatterns(t *testing.T) {
	const rows, cols, tokens = 16, 64, 256
	w, _, h := sparseProblem(5, rows, cols, tokens)
	for _, tc := range []struct {
		name string
		opt  SparseOptions
	}{
		{"50% unstructured", SparseOptions{Sparsity: 0.5, BlockSize: 24}},
		{"30% unstructured int8", SparseOptions{Sparsity: 0.3, Quant: true}},
		{"2:4", SparseOptions{N: 2, M: 4}},
		{"1:4 int8", SparseOptions{N: 1, M: 4, Quant: true}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			for _, prune := range []func() (*SparseResult, error){
				func() (*SparseResult, error) { return Prune(w, rows, cols, h, tc.opt) },
				func() (*SparseResult, error) { return Magnitude(w, rows, cols, tc.opt) },
			} {
				res, err := prune()
				if err != nil {
					t.Fatal(err)
				}
				for r := 0; r < rows; r++ {
					row := res.W[r*cols : (r+1)*cols]
					if tc.opt.M > 0 {
						for c := 0; c < cols; c += tc.opt.M {
							z := 0
							for _, v := range row[c : c+tc.opt.M] {
								if v == 0 {
									z++
								}
							}
							if z < tc.opt.N {
								t.Fatalf("row %d columns %d..: %d zeros, want at least %d", r, c, z, tc.opt.N)
							}
						}
					} else {
						z := 0
						for _, v := range row {
							if v == 0 {
								z++
							}
						}
						if want := pruneCount(tc.opt.Sparsity, cols); z < want || (!tc.opt.Quant && z != want) {
							t.Fatalf("row %d: %d zeros, want %d", r, z, want)
						}
					}
				}
				if q := res.Q; tc.opt.Quant {
					got := make([]float32, rows*cols)
					q.DequantizeRows(0, rows, got)
					for i, v := range got {
						if v != res.W[i] || q.Q[i] < -127 {
							t.Fatalf("code %d at %d: dequantized %g, W %g", q.Q[i], i, v, res.W[i])
						}
					}
				}
			}
		})
	}
}

// TestPruneBeatsMagnitude: on correlated inputs the Hessian-compensated
// pruning loses much less of the layer's output than magnitude pruning.
func TestPruneBeatsMagnitude(t *testing.T) {
	const rows, cols, tokens = 32, 64, 512
	w, x, h := sparseProblem(7, rows, cols, tokens)
	for _, opt := range []SparseOptions{{Sparsity: 0.5}, {N: 2, M: 4}, {Sparsity: 0.5, Quant: true}} {
		sg, err := Prune(w, rows, cols, h, opt)
		if err != nil {
			t.Fatal(err)
		}
		mg, err := Magnitude(w, rows, cols, opt)
		if err != nil {
			t.Fatal(err)
		}
		es, em := layerErr(w, sg.W, x, rows, cols, tokens), layerErr(w, mg.W, x, rows, cols, tokens)
		t.Logf("%+v: relative output error SparseGPT %.4g, magnitude %.4g", opt, es, em)
		if es > 0.5*em {
			t.Errorf("%+v: SparseGPT error %.4g is not below half magnitude pruning's %.4g", opt, es, em)
		}
	}
}

func TestPruneErrors(t *testing.T) {
	w, _, h := sparseProblem(1, 4, 8, 32)
	nan := append([]float32(nil), w...)
	nan[9] = float32(math.NaN())
	for _, tc := range []struct {
		name string
		w    []float32
		opt  SparseOptions
		want string
	}{
		{"sparsity 1", w, SparseOptions{Sparsity: 1}, "want a fraction in [0, 1)"},
		{"negative", w, SparseOptions{Sparsity: -0.1}, "want a fraction"},
		{"N >= M", w, SparseOptions{N: 4, M: 4}, "want 0 < N < M"},
		{"both", w, SparseOptions{Sparsity: 0.5, N: 2, M: 4}, "both a sparsity"},
		{"M does not divide", w, SparseOptions{N: 1, M: 3}, "not a multiple of M = 3"},
		{"length", w[:30], SparseOptions{Sparsity: 0.5}, "want 4×8"},
		{"nan", nan, SparseOptions{Sparsity: 0.5}, "weight (1,1) is NaN"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			_, err := Prune(tc.w, 4, 8, h, tc.opt)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("Prune: err = %v, want %q", err, tc.want)
			}
		})
	}
	if _, err := Prune(w, 4, 8, NewHessian(8), SparseOptions{Sparsity: 0.5}); err == nil || !strings.Contains(err.Error(), "no calibration tokens") {
		t.Errorf("empty Hessian: err = %v", err)
	}
}
