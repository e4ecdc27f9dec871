package cuda

import (
	"math"
	"math/rand/v2"
	"testing"

	"qtool/awq"
	"qtool/formats/model"
	"qtool/gptq"
	"qtool/runtime"
	"qtool/runtime/cpu"
)

// The calibration operations of the GPU against the CPU backend's (fresh
// random inputs, outputs poisoned first).

func TestCalibratorOps(t *testing.T) {
	b := newTestBackend(t)
	c := cpu.New(2)
	r := rand.New(rand.NewPCG(1, 2))
	const rows, cols = 777, 200
	xv := randVec(r, rows*cols, 3)
	for i := 0; i < cols; i += 17 {
		xv[5*cols+i] = 40 // outliers
	}
	xg, xc := upload(b, rows, cols, xv), c.Alloc(rows, cols)
	c.Upload(xc, xv)

	t.Run("GatherRows", func(t *testing.T) {
		idx := []int{5, 0, 776, 5, 300}
		got := poisoned(b, len(idx), cols)
		b.GatherRows(got, xg, idx)
		want := c.Alloc(len(idx), cols)
		c.GatherRows(want, xc, idx)
		if d := maxAbsDiff(download(b, got), c, want); d != 0 {
			t.Fatalf("differs by %g", d)
		}
	})
	t.Run("AddGram", func(t *testing.T) {
		g := upload(b, cols, cols, make([]float32, cols*cols))
		b.AddGram(g, xg)
		b.AddGram(g, xg)
		want := make([]float64, cols*cols)
		for k := 0; k < 2; k++ {
			for t0 := 0; t0 < rows; t0++ {
				row := xv[t0*cols : (t0+1)*cols]
				for i, a := range row {
					for j, bb := range row {
						want[i*cols+j] += float64(a) * float64(bb)
					}
				}
			}
		}
		if e, err := relErr(download(b, g), want); err != nil || e > 1e-6 {
			t.Fatalf("relative error %g (%v)", e, err)
		}
		d := b.Diagonal(g)
		for i := range d {
			if math.Abs(float64(d[i])-want[i*cols+i]) > 1e-5*want[i*cols+i] {
				t.Fatalf("diagonal %d: %g, want %g", i, d[i], want[i*cols+i])
			}
		}
	})
	t.Run("AddCrossGram", func(t *testing.T) {
		const ycols = 96
		yv := randVec(r, rows*ycols, 1)
		gv := randVec(r, cols*ycols, 1)
		g, gc := upload(b, cols, ycols, gv), c.Alloc(cols, ycols)
		c.Upload(gc, gv)
		yc := c.Alloc(rows, ycols)
		c.Upload(yc, yv)
		b.AddCrossGram(g, xg, upload(b, rows, ycols, yv))
		c.AddCrossGram(gc, xc, yc)
		want := make([]float32, cols*ycols)
		c.Download(want, gc)
		checkClose(t, "AddCrossGram", download(b, g), f64(want), 1e-5)
	})
	t.Run("SolveSPD", func(t *testing.T) {
		// a = xᵀx (+ damping), b random: the GPU's b·a⁻¹ against the CPU's
		a, ac := upload(b, cols, cols, make([]float32, cols*cols)), c.Alloc(cols, cols)
		b.AddGram(a, xg)
		c.AddGram(ac, xc)
		const brows = 50
		bv := randVec(r, brows*cols, 1)
		x, want := upload(b, brows, cols, bv), c.Alloc(brows, cols)
		c.Upload(want, bv)
		if err := b.SolveSPD(x, a, 0.5); err != nil {
			t.Fatal(err)
		}
		if err := c.SolveSPD(want, ac, 0.5); err != nil {
			t.Fatal(err)
		}
		wv := make([]float32, brows*cols)
		c.Download(wv, want)
		checkClose(t, "SolveSPD", download(b, x), f64(wv), 1e-4)
	})
	t.Run("ColumnStats", func(t *testing.T) {
		got, want := b.ColumnStats(xg), c.ColumnStats(xc)
		for i := 0; i < cols; i++ {
			if math.Abs(float64(got.MeanAbs[i]-want.MeanAbs[i])) > 1e-6*float64(want.MeanAbs[i]) ||
				got.MaxAbs[i] != want.MaxAbs[i] || got.Min[i] != want.Min[i] || got.Max[i] != want.Max[i] {
				t.Fatalf("column %d: %v %v %v %v, want %v %v %v %v", i, got.MeanAbs[i], got.MaxAbs[i], got.Min[i], got.Max[i],
					want.MeanAbs[i], want.MaxAbs[i], want.Min[i], want.Max[i])
			}
		}
	})
	t.Run("SquaredError+ScaleColumns", func(t *testing.T) {
		s := randVec(r, cols, 1)
		for i := range s {
			s[i] += 1.5
		}
		yg := upload(b, rows, cols, xv)
		b.ScaleColumns(yg, s, true)
		yc := c.Alloc(rows, cols)
		c.Upload(yc, xv)
		c.ScaleColumns(yc, s, true)
		if d := maxAbsDiff(download(b, yg), c, yc); d != 0 {
			t.Fatalf("ScaleColumns differs by %g", d)
		}
		gd, gr := b.SquaredError(yg, xg)
		cd, cr := c.SquaredError(yc, xc)
		if math.Abs(gd-cd) > 1e-9*cd || math.Abs(gr-cr) > 1e-9*cr {
			t.Fatalf("SquaredError %g %g, want %g %g", gd, gr, cd, cr)
		}
	})
	t.Run("Dequantize", func(t *testing.T) {
		w := randVec(r, 64*96, 1)
		d := model.FromFloat32([]int{64, 96}, w)
		bf := &model.Dense{DType: model.BF16, Dims: []int{64, 96}, Data: make([]byte, 2*len(w))}
		for i, v := range w {
			u := math.Float32bits(v) >> 16
			bf.Data[2*i], bf.Data[2*i+1] = byte(u), byte(u>>8)
		}
		for _, tc := range []model.Tensor{d, bf} {
			l, err := b.UploadLinear("w", tc)
			if err != nil {
				t.Fatal(err)
			}
			got := download(b, b.Dequantize(l))
			want, _ := tc.Float32()
			for i := range want {
				if got[i] != want[i] {
					t.Fatalf("%T: value %d is %g, want %g", tc, i, got[i], want[i])
				}
			}
		}
	})
}

func maxAbsDiff(got []float32, c *cpu.Backend, want runtime.Buf) float64 {
	w := make([]float32, want.Rows()*want.Cols())
	c.Download(w, want)
	d := 0.0
	for i := range w {
		d = math.Max(d, math.Abs(float64(got[i]-w[i])))
		if got[i] != got[i] {
			return math.Inf(1)
		}
	}
	return d
}

// TestInvCholUpper checks UᵀU·H = I for a damped random Hessian, with and
// without a permutation and a dead column.
func TestInvCholUpper(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(3, 4))
	for _, n := range []int{50, 64, 200} {
		const tokens = 300
		x := randVec(r, tokens*n, 1)
		for t0 := 0; t0 < tokens; t0++ {
			x[t0*n+n/2] = 0 // a dead column
		}
		g := upload(b, n, n, make([]float32, n*n))
		b.AddGram(g, upload(b, tokens, n, x))
		gv := download(b, g)
		perm := r.Perm(n)
		dead := make([]uint8, n)
		dead[n/2] = 1
		defer b.enter()()
		b.loadCalib()
		permP, deadP := uploadSlice(b, toInt32(perm)), uploadSlice(b, dead)
		scale, damp := 2.0/tokens, 0.05
		U, err := b.invCholUpper(g.p, n, permP, deadP, scale, damp)
		if err != nil {
			t.Fatal(err)
		}
		u := downloadAs[float32](b, U, n*n)
		// H in the permuted order
		h := make([]float64, n*n)
		for i := 0; i < n; i++ {
			for j := 0; j < n; j++ {
				pi, pj := perm[i], perm[j]
				v := scale * float64(gv[pi*n+pj])
				if i == j {
					if dead[pi] == 1 {
						v = 1
					}
					v += damp
				}
				h[i*n+j] = v
			}
		}
		worst := 0.0
		for i := 0; i < n; i++ {
			for j := 0; j < n; j++ {
				if j < i && u[i*n+j] != 0 {
					t.Fatalf("n=%d: U(%d,%d) = %g below the diagonal", n, i, j, u[i*n+j])
				}
				// (UᵀU·H)[i, j]
				s := 0.0
				for k := 0; k < n; k++ {
					uu := 0.0
					for m := 0; m <= min(i, k); m++ {
						uu += float64(u[m*n+i]) * float64(u[m*n+k])
					}
					s += uu * h[k*n+j]
				}
				if i == j {
					s--
				}
				worst = math.Max(worst, math.Abs(s))
			}
		}
		if worst > 1e-4 {
			t.Fatalf("n=%d: |UᵀU·H − I| = %g", n, worst)
		}
	}
}

func toInt32(v []int) []int32 {
	out := make([]int32, len(v))
	for i, x := range v {
		out[i] = int32(x)
	}
	return out
}

// TestGPTQOnDevice runs GPTQ on the GPU and on the host (float64) on the
// same problem: the output errors ‖X(W−Ŵ)ᵀ‖² agree within 1 % and at most
// a few codes differ (float32 against float64 updates).
func TestGPTQOnDevice(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(5, 6))
	const rows, cols, tokens = 96, 512, 1024
	w := randVec(r, rows*cols, 0.05)
	x := randVec(r, tokens*cols, 1)
	for c := 0; c < cols; c += 7 {
		for t0 := 0; t0 < tokens; t0++ {
			x[t0*cols+c] *= 4 // uneven channel scales
		}
	}
	for _, opt := range []gptq.Options{
		{Bits: 4, GroupSize: 128},
		{Bits: 4, GroupSize: 128, Search: "hmse"},
		{Bits: 3, GroupSize: 64, Search: "hmse"},
		{Bits: 4, GroupSize: 128, ActOrder: true},
		{Bits: 8, GroupSize: 0, Sym: true},
		{Bits: 4, GroupSize: 256, Search: "mse"},
	} {
		xg := upload(b, tokens, cols, x)
		g := upload(b, cols, cols, make([]float32, cols*cols))
		b.AddGram(g, xg)
		h := gptq.NewHessian(cols)
		if err := h.AddGram(download(b, g), tokens); err != nil {
			t.Fatal(err)
		}
		host, err := gptq.Quantize(w, rows, cols, h, opt)
		if err != nil {
			t.Fatal(err)
		}
		dev, err := gptq.QuantizeOn(b, g, tokens, upload(b, rows, cols, w), opt)
		if err != nil {
			t.Fatalf("%+v: %v", opt, err)
		}
		eh, ed := outErr(w, host.Q, x, tokens), outErr(w, dev.Q, x, tokens)
		diff := 0
		for i := range host.Q.Q {
			if host.Q.Q[i] != dev.Q.Q[i] {
				diff++
			}
		}
		t.Logf("%+v: output error host %.6g device %.6g, loss %.6g / %.6g, %d codes differ", opt, eh, ed, host.Loss, dev.Loss, diff)
		if math.Abs(ed-eh) > 0.01*eh || math.Abs(dev.Loss-host.Loss) > 0.01*host.Loss || diff > rows*cols/200 {
			t.Errorf("%+v: device and host GPTQ disagree", opt)
		}
	}
}

// outErr is ‖X·(W−Ŵ)ᵀ‖² in float64.
func outErr(w []float32, q *model.Quantized, x []float32, tokens int) float64 {
	wq, _ := q.Float32()
	rows, cols := q.Rows, q.Cols
	e := 0.0
	for t0 := 0; t0 < tokens; t0++ {
		xr := x[t0*cols : (t0+1)*cols]
		for r := 0; r < rows; r++ {
			s := 0.0
			for c, v := range xr {
				s += float64(v) * float64(w[r*cols+c]-wq[r*cols+c])
			}
			e += s * s
		}
	}
	return e
}

// TestAWQOnDevice compares the device fake quantization and clip search
// with the host implementations of package awq.
func TestAWQOnDevice(t *testing.T) {
	b := newTestBackend(t)
	r := rand.New(rand.NewPCG(7, 8))
	const rows, cols, n = 64, 256, 300
	w := randVec(r, rows*cols, 0.1)
	s := randVec(r, cols, 0.5)
	for i := range s {
		s[i] += 1
	}
	for _, opt := range []awq.Options{{Bits: 4, GroupSize: 128}, {Bits: 3, GroupSize: 64}, {Bits: 4, GroupSize: 128, FP32Scales: true}} {
		opt = opt.WithDefaults()
		want, err := opt.FakeQuantScaled(make([]float32, len(w)), w, rows, cols, s)
		if err != nil {
			t.Fatal(err)
		}
		got := poisoned(b, rows, cols)
		b.FakeQuantAWQ(got, upload(b, rows, cols, w), s, opt.Bits, opt.GroupSize, opt.FP32Scales)
		gv := download(b, got)
		for i := range want {
			if math.Abs(float64(gv[i]-want[i])) > 1e-6*math.Max(1, math.Abs(float64(want[i]))) {
				t.Fatalf("%+v: fake-quantized value %d is %g, host %g", opt, i, gv[i], want[i])
			}
		}
		x := randVec(r, n*cols, 1)
		hostClip, err := awq.SearchClip(w, rows, cols, x, n, opt)
		if err != nil {
			t.Fatal(err)
		}
		g := upload(b, cols, cols, make([]float32, cols*cols))
		b.AddGram(g, upload(b, n, cols, x))
		steps := max(1, int(opt.MaxShrink*float64(opt.ClipGrid)))
		devClip := b.ClipSearchAWQ(upload(b, rows, cols, w), g, opt.Bits, opt.GroupSize, opt.ClipGrid, steps, opt.FP32Scales)
		same := 0
		for i := range hostClip {
			if math.Abs(float64(hostClip[i]-devClip[i])) <= 1e-6*float64(hostClip[i]) {
				same++
			}
		}
		t.Logf("%+v: %d of %d clip thresholds equal", opt, same, len(hostClip))
		if same < len(hostClip)*95/100 {
			t.Errorf("%+v: only %d of %d clip thresholds agree with the host search", opt, same, len(hostClip))
		}
	}
}
