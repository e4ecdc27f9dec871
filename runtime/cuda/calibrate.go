package cuda

import (
	"fmt"
	"os"
	goruntime "runtime"
	"time"
	"unsafe"

	"qtool/kernels"
	"qtool/runtime"
	"qtool/runtime/cuda/driver"
)

// This file makes the backend a runtime.Calibrator, GPTQSolver and
// AWQSolver: the calibration kernels of kernels/calib.cu, a module loaded on
// first use.

var (
	_                     runtime.Calibrator = (*Backend)(nil)
	_                     runtime.GPTQSolver = (*Backend)(nil)
	_                     runtime.AWQSolver  = (*Backend)(nil)
	_                     runtime.Releaser   = (*Backend)(nil)
	calibKernels                             = []string{"gather_rows", "col_stats", "sq_diff", "scale_cols", "diag_f32", "widen", "cal_gemm_f32", "cal_gemm_f64", "mirror_lower", "build_a", "potrf_diag", "extract_u", "copy_block_f64", "gptq_prep", "gptq_fit", "gptq_block", "awq_fakequant", "awq_clip"}
	gptqBlockRows, cholNB                    = 8, 64
)

// loadCalib loads the calibration module once (the context must be current).
func (b *Backend) loadCalib() {
	if b.calibMod != 0 {
		return
	}
	ptx, arch := kernels.CalibPTX(b.cc[0], b.cc[1])
	if p := b.opt.CalibPTXPath; p != "" {
		var err error
		if ptx, err = os.ReadFile(p); err != nil {
			panic(fmt.Sprintf("cuda backend: %v", err))
		}
		arch = p
	}
	mod, err := b.drv.ModuleLoadData(ptx)
	if err != nil {
		panic(fmt.Sprintf("cuda backend: loading the %s calibration kernels: %v", arch, err))
	}
	b.calibMod = mod
	for _, k := range calibKernels {
		if _, dup := b.fn[k]; dup {
			panic("cuda backend: calibration kernel " + k + " has the name of an inference kernel")
		}
		f, err := b.drv.Function(mod, k)
		b.must(err)
		b.fn[k] = f
	}
}

// FreeVector implements runtime.Releaser.
func (b *Backend) FreeVector(v runtime.Vector) {
	d := vec(v)
	if d.p != 0 {
		b.release(d.p)
	}
	*d = Vector{}
}

// CopyRows implements runtime.Calibrator.
func (b *Backend) CopyRows(dst runtime.Buf, dstRow int, src runtime.Buf, srcRow, n int) {
	runtime.CheckCopyRows("cuda backend: CopyRows", dst, dstRow, src, srcRow, n)
	b.Copy2D(dst, dstRow, 0, src, srcRow, 0, n, buf(src).cols)
}

// GatherRows implements runtime.Calibrator.
func (b *Backend) GatherRows(dst, src runtime.Buf, rows []int) {
	d, s := buf(dst), buf(src)
	if d.cols != s.cols || d.rows != len(rows) {
		panic(fmt.Sprintf("cuda backend: GatherRows of %d rows of [%d %d] into [%d %d]", len(rows), s.rows, s.cols, d.rows, d.cols))
	}
	idx := make([]int32, len(rows))
	for i, r := range rows {
		if r < 0 || r >= s.rows {
			panic(fmt.Sprintf("cuda backend: GatherRows row %d of %d", r, s.rows))
		}
		idx[i] = int32(r)
	}
	defer b.enter()()
	b.loadCalib()
	p := uploadSlice(b, idx)
	b.launch("gather_rows", b.gridFor(d.n()), block256, d.p, s.p, p, len(rows), d.cols)
	b.release(p)
}

// FloatLinear implements runtime.Calibrator.
func (b *Backend) FloatLinear(w runtime.Buf) runtime.Linear {
	x := buf(w)
	return &Linear{kind: kindF32, out: x.rows, in: x.cols, w: x.p, bytes: int64(4 * x.n()), borrowed: true}
}

// Dequantize implements runtime.Calibrator for dense weights.
func (b *Backend) Dequantize(w runtime.Linear) runtime.Buf {
	l := lin(w)
	out := b.AllocRaw(l.out, l.in) // written whole below
	d := buf(out)
	defer b.enter()()
	switch l.kind {
	case kindF32:
		b.must(b.drv.MemcpyDtoDAsync(d.p, l.w, uint64(4*d.n()), b.stream))
	case kindF16, kindBF16:
		b.loadCalib()
		b.launch("widen", b.gridFor(d.n()), block256, d.p, l.w, int64(d.n()), l.kind)
	default:
		panic(fmt.Sprintf("cuda backend: Dequantize of a %s weight is not supported", kindNames[l.kind]))
	}
	return out
}

// gemm queues C = alpha·op(A)·op(B) + beta·C (row-major, op(A) [m, k],
// op(B) [k, n]) on the SIMT kernels; f64 selects double.
func (b *Backend) gemm(f64 bool, m, n, k int, alpha float64, a driver.DevicePtr, lda int, ta bool,
	bb driver.DevicePtr, ldb int, tb bool, beta float64, c driver.DevicePtr, ldc int, lower bool) {
	if m == 0 || n == 0 {
		return
	}
	grid := [3]uint32{uint32((n + 63) / 64), uint32((m + 63) / 64), 1}
	if f64 {
		b.launch("cal_gemm_f64", grid, block256, m, n, k, alpha, a, int64(lda), boolInt(ta), bb, int64(ldb), boolInt(tb), beta, c, int64(ldc), boolInt(lower))
		return
	}
	b.launch("cal_gemm_f32", grid, block256, m, n, k, float32(alpha), a, int64(lda), boolInt(ta), bb, int64(ldb), boolInt(tb), float32(beta), c, int64(ldc), boolInt(lower))
}

// AddGram implements runtime.Calibrator: the lower triangle with the SIMT
// float32 kernel (float32 products and sums, as the reference's torch
// matmul with TF32 off), then mirrored.
func (b *Backend) AddGram(g, x runtime.Buf) {
	gm, xm := buf(g), buf(x)
	n := xm.cols
	if gm.rows != n || gm.cols != n {
		panic(fmt.Sprintf("cuda backend: AddGram of x [%d %d] into g [%d %d]", xm.rows, n, gm.rows, gm.cols))
	}
	defer b.enter()()
	b.loadCalib()
	b.gemm(false, n, n, xm.rows, 1, xm.p, n, true, xm.p, n, false, 1, gm.p, n, true)
	b.launch("mirror_lower", b.gridFor(n*n), block256, gm.p, n)
}

// AddCrossGram implements runtime.Calibrator with the SIMT float32 GEMM
// kernel AddGram uses (all of g, no mirroring).
func (b *Backend) AddCrossGram(g, x, y runtime.Buf) {
	gm, xm, ym := buf(g), buf(x), buf(y)
	na, nb := xm.cols, ym.cols
	if xm.rows != ym.rows || gm.rows != na || gm.cols != nb {
		panic(fmt.Sprintf("cuda backend: AddCrossGram of x [%d %d], y [%d %d] into g [%d %d]", xm.rows, na, ym.rows, nb, gm.rows, gm.cols))
	}
	defer b.enter()()
	b.loadCalib()
	b.gemm(false, na, nb, xm.rows, 1, xm.p, na, true, ym.p, nb, false, 1, gm.p, nb, false)
}

// SolveSPD implements runtime.Calibrator with the GPTQ factorisation
// (invCholUpper: Cholesky and inverse in double, U in float32, A⁻¹ = UᵀU)
// and two float32 GEMMs, b = (b·Uᵀ)·U.
func (b *Backend) SolveSPD(x, a runtime.Buf, damp float64) error {
	xm, am := buf(x), buf(a)
	n := am.rows
	if am.cols != n || xm.cols != n {
		panic(fmt.Sprintf("cuda backend: SolveSPD of b [%d %d] with a [%d %d]", xm.rows, xm.cols, am.rows, am.cols))
	}
	defer b.enter()()
	b.loadCalib()
	dead := uploadSlice(b, make([]uint8, n))
	defer b.release(dead)
	U, err := b.invCholUpper(am.p, n, 0, dead, 1, damp)
	if err != nil {
		return err
	}
	defer b.release(U)
	T := b.alloc(4 * xm.n())
	defer b.release(T)
	b.gemm(false, xm.rows, n, n, 1, xm.p, n, false, U, n, true, 0, T, n, false)
	b.gemm(false, xm.rows, n, n, 1, T, n, false, U, n, false, 0, xm.p, n, false)
	return nil
}

// Diagonal implements runtime.Calibrator.
func (b *Backend) Diagonal(g runtime.Buf) []float32 {
	gm := buf(g)
	if gm.rows != gm.cols {
		panic(fmt.Sprintf("cuda backend: Diagonal of [%d %d]", gm.rows, gm.cols))
	}
	defer b.enter()()
	b.loadCalib()
	return b.diagOf(gm.p, gm.rows)
}

// downloadAs copies n elements of T from p.
func downloadAs[T any](b *Backend, p driver.DevicePtr, n int) []T {
	v := make([]T, n)
	if n > 0 {
		var z T
		b.must(b.drv.MemcpyDtoH(unsafe.Pointer(&v[0]), p, uint64(n)*uint64(unsafe.Sizeof(z))))
	}
	goruntime.KeepAlive(v)
	return v
}

// ColumnStats implements runtime.Calibrator: partial statistics per chunk
// of rows on the device, combined on the host.
func (b *Backend) ColumnStats(x runtime.Buf) runtime.ColumnStats {
	xm := buf(x)
	cols := xm.cols
	chunks := max(1, min(64, xm.rows/256))
	chunk := (xm.rows + chunks - 1) / chunks
	defer b.enter()()
	b.loadCalib()
	np := chunks * cols
	psum, pmaxabs, pmin, pmax := b.alloc(8*np), b.alloc(4*np), b.alloc(4*np), b.alloc(4*np)
	defer func() {
		for _, p := range []driver.DevicePtr{psum, pmaxabs, pmin, pmax} {
			b.release(p)
		}
	}()
	b.launch("col_stats", [3]uint32{uint32((cols + 31) / 32), uint32(chunks), 1}, [3]uint32{32, 8, 1},
		xm.p, int64(xm.rows), cols, int64(chunk), psum, pmaxabs, pmin, pmax)
	sum, ma, mn, mx := downloadAs[float64](b, psum, np), downloadAs[float32](b, pmaxabs, np), downloadAs[float32](b, pmin, np), downloadAs[float32](b, pmax, np)
	st := runtime.ColumnStats{MeanAbs: make([]float32, cols), MaxAbs: make([]float32, cols), Min: make([]float32, cols), Max: make([]float32, cols)}
	for c := 0; c < cols; c++ {
		s := 0.0
		for k := 0; k < chunks; k++ {
			i := k*cols + c
			s += sum[i]
			st.MaxAbs[c] = nanMax(st.MaxAbs[c], ma[i])
			st.Min[c] = nanMin(st.Min[c], mn[i])
			st.Max[c] = nanMax(st.Max[c], mx[i])
		}
		st.MeanAbs[c] = float32(s / float64(xm.rows))
	}
	return st
}

func nanMax(a, b float32) float32 {
	if a != a || b != b {
		return a + b
	}
	return max(a, b)
}

func nanMin(a, b float32) float32 {
	if a != a || b != b {
		return a + b
	}
	return min(a, b)
}

// SquaredError implements runtime.Calibrator.
func (b *Backend) SquaredError(a, ref runtime.Buf) (diff, sq float64) {
	r := buf(ref)
	var ap driver.DevicePtr
	if a != nil {
		am := buf(a)
		if am.n() != r.n() {
			panic(fmt.Sprintf("cuda backend: SquaredError of [%d %d] against [%d %d]", am.rows, am.cols, r.rows, r.cols))
		}
		ap = am.p
	}
	defer b.enter()()
	b.loadCalib()
	out := b.alloc(16)
	defer b.release(out)
	b.must(b.drv.MemsetD32Async(out, 0, 4, b.stream))
	b.launch("sq_diff", b.gridFor(r.n()), block256, ap, r.p, int64(r.n()), out)
	v := downloadAs[float64](b, out, 2)
	if a == nil {
		return v[1], v[1]
	}
	return v[0], v[1]
}

// ScaleColumns implements runtime.Calibrator.
func (b *Backend) ScaleColumns(x runtime.Buf, s []float32, divide bool) {
	xm := buf(x)
	if len(s) != xm.cols {
		panic(fmt.Sprintf("cuda backend: ScaleColumns with %d scales for [%d %d]", len(s), xm.rows, xm.cols))
	}
	defer b.enter()()
	b.loadCalib()
	p := uploadSlice(b, s)
	d := 0
	if divide {
		d = 1
	}
	b.launch("scale_cols", b.gridFor(xm.n()), block256, xm.p, p, int64(xm.rows), xm.cols, d)
	b.release(p)
}

// Profile returns the seconds spent in the steps of the calibration
// solvers so far (GPTQ's factorisation and column loop).
func (b *Backend) Profile() map[string]float64 {
	out := make(map[string]float64, len(b.prof))
	for k, v := range b.prof {
		out[k] = v
	}
	return out
}

// PeakBytes is the largest device memory the backend has held at once.
func (b *Backend) PeakBytes() int64 { return b.peakBytes }

// ---------------------------------------------------------------------------
// GPTQ.

// GPTQ implements runtime.GPTQSolver. Steps: A = J·P(2/tokens·h + damp)·J
// in double; L = chol(A) blocked (potrf_diag on 64-wide diagonal blocks,
// the panel and trailing updates on the SIMT double GEMM); X = L⁻¹ blocked
// by rows; U = J·X·J in float32; then the column loop in float32 (fit,
// gptq_block, the lazy update as a GEMM), as the reference does.
func (b *Backend) GPTQ(h, w runtime.Buf, tokens int, job runtime.GPTQJob) (*runtime.GPTQOutput, error) {
	n, rows := job.Cols, job.Rows
	hm, wm := buf(h), buf(w)
	if hm.rows != n || hm.cols != n || wm.rows != rows || wm.cols != n || len(job.Dead) != n || len(job.HDiag) != n || (job.Perm != nil && len(job.Perm) != n) {
		panic(fmt.Sprintf("cuda backend: GPTQ of w [%d %d] with h [%d %d] for a %d×%d job", wm.rows, wm.cols, hm.rows, hm.cols, rows, n))
	}
	gs, bs := job.GroupSize, job.BlockSize
	if bs > 128 || bs%32 != 0 {
		return nil, fmt.Errorf("cuda: GPTQ block size %d, want a multiple of 32 up to 128", bs)
	}
	if job.Perm == nil && gs < bs {
		bs = gs // groups start only at block starts (exact: lazy batching only regroups the updates)
		if bs%32 != 0 {
			return nil, fmt.Errorf("cuda: GPTQ group size %d, want a multiple of 32", gs)
		}
	}
	if n%gs != 0 {
		return nil, fmt.Errorf("cuda: GPTQ group size %d does not divide %d columns", gs, n)
	}
	defer b.enter()()
	b.loadCalib()

	dead := make([]uint8, n)
	for i, d := range job.Dead {
		if d {
			dead[i] = 1
		}
	}
	deadP := uploadSlice(b, dead)
	defer b.release(deadP)
	var permP driver.DevicePtr
	if job.Perm != nil {
		p32 := make([]int32, n)
		for i, v := range job.Perm {
			p32[i] = int32(v)
		}
		permP = uploadSlice(b, p32)
		defer b.release(permP)
	}
	t0 := time.Now()
	U, err := b.invCholUpper(hm.p, n, permP, deadP, 2/float64(tokens), job.Damp)
	if err != nil {
		return nil, err
	}
	defer b.release(U)
	b.must(b.drv.StreamSynchronize(b.stream))
	b.prof["gptq: factorise"] += time.Since(t0).Seconds()
	t0 = time.Now()
	defer func() { b.prof["gptq: column loop"] += time.Since(t0).Seconds() }()

	maxq := float32(int(1)<<job.Bits - 1)
	sym, fp16 := boolInt(job.Sym), boolInt(job.FP16Scales)
	ng := n / gs
	// the hmse search's weights: H's diagonal, 0 for dead columns
	hd := make([]float32, n)
	for i, d := range job.HDiag {
		if !job.Dead[i] {
			hd[i] = float32(d)
		}
	}
	hdP := uploadSlice(b, hd)
	defer b.release(hdP)

	W := b.alloc(4 * rows * n)
	defer b.release(W)
	scale, zero := b.alloc(4*rows*ng), b.alloc(4*rows*ng)
	defer b.release(scale)
	defer b.release(zero)
	cs, cz := b.alloc(4*rows), b.alloc(4*rows)
	defer b.release(cs)
	defer b.release(cz)
	fitGrid := g1((rows + 7) / 8)
	if job.Perm != nil {
		// static groups from the original (unpermuted) weights
		b.launch("gptq_prep", b.gridFor(rows*n), block256, W, wm.p, rows, n, driver.DevicePtr(0), deadP)
		for g := 0; g < ng; g++ {
			b.launch("gptq_fit", fitGrid, block256, W, rows, n, g*gs, gs, maxq, sym, fp16, job.Search, hdP, scale, zero, ng, g)
		}
	}
	b.launch("gptq_prep", b.gridFor(rows*n), block256, W, wm.p, rows, n, permP, deadP)
	codes := b.alloc(rows * n)
	defer b.release(codes)
	errBlk := b.alloc(4 * rows * bs)
	defer b.release(errBlk)
	loss := b.alloc(8)
	defer b.release(loss)
	b.must(b.drv.MemsetD32Async(loss, 0, 2, b.stream))
	shm := 4 * bs * bs
	b.raiseSmem("gptq_block", shm)
	for i1 := 0; i1 < n; i1 += bs {
		static := 0
		if job.Perm != nil {
			static = 1
		} else if i1%gs == 0 {
			g := i1 / gs
			b.launch("gptq_fit", fitGrid, block256, W, rows, n, i1, gs, maxq, sym, fp16, job.Search, hdP, scale, zero, ng, g)
			b.must(b.drv.MemcpyDtoD2DAsync(cs, 4, scale+driver.DevicePtr(4*g), uint64(4*ng), 4, uint64(rows), b.stream))
			b.must(b.drv.MemcpyDtoD2DAsync(cz, 4, zero+driver.DevicePtr(4*g), uint64(4*ng), 4, uint64(rows), b.stream))
		}
		ps, pz := cs, cz
		if static == 1 {
			ps, pz = scale, zero
		}
		b.launchShm("gptq_block", g1((rows+gptqBlockRows-1)/gptqBlockRows), [3]uint32{32 * uint32(gptqBlockRows), 1, 1}, shm,
			W, rows, n, i1, bs, U, maxq, sym, fp16, ps, pz, static, permP, gs, ng, codes, errBlk, loss)
		if i2 := i1 + bs; i2 < n {
			b.gemm(false, rows, n-i2, bs, -1, errBlk, bs, false, U+driver.DevicePtr(4*(i1*n+i2)), n, false, 1, W+driver.DevicePtr(4*i2), n, false)
		}
	}
	out := &runtime.GPTQOutput{Codes: downloadAs[uint8](b, codes, rows*n), Scale: downloadAs[float32](b, scale, rows*ng),
		Zero: downloadAs[float32](b, zero, rows*ng), Loss: downloadAs[float64](b, loss, 1)[0]}
	return out, nil
}

// boolInt is v as the int flag a kernel argument takes (1 or 0).
func boolInt(v bool) int {
	if v {
		return 1
	}
	return 0
}

// diagOf downloads the diagonal of the n×n float32 matrix at p.
func (b *Backend) diagOf(p driver.DevicePtr, n int) []float32 {
	d := b.alloc(4 * n)
	defer b.release(d)
	b.launch("diag_f32", b.gridFor(n), block256, d, p, n)
	return downloadAs[float32](b, d, n)
}

// invCholUpper returns (float32, n×n) the upper Cholesky factor U of H⁻¹
// for H = scale·P·G·Pᵀ (+ damp on the diagonal, dead diagonals set to 1),
// computed in double as U = J·L⁻¹·J with L = chol(J·H·J).
func (b *Backend) invCholUpper(g driver.DevicePtr, n int, perm, dead driver.DevicePtr, scale, damp float64) (driver.DevicePtr, error) {
	A := b.alloc(8 * n * n)
	defer b.release(A)
	b.launch("build_a", b.gridFor(n*n), block256, A, g, n, perm, dead, scale, damp)
	nb := cholNB
	nblk := (n + nb - 1) / nb
	D := b.alloc(8 * nblk * nb * nb) // inverses of the diagonal blocks
	defer b.release(D)
	P := b.alloc(8 * n * nb)
	defer b.release(P)
	info := b.alloc(4)
	defer b.release(info)
	b.must(b.drv.MemsetD32Async(info, 0, 1, b.stream))
	a := func(i, j int) driver.DevicePtr { return A + driver.DevicePtr(8*(i*n+j)) }
	for k := 0; k < n; k += nb {
		kb := min(nb, n-k)
		Dk := D + driver.DevicePtr(8*(k/nb)*nb*nb)
		b.launch("potrf_diag", g1(1), block256, A, n, k, kb, Dk, info)
		if m := n - k - kb; m > 0 {
			// panel: L21 = A21 · L11⁻ᵀ, through P
			b.gemm(true, m, kb, kb, 1, a(k+kb, k), n, false, Dk, nb, true, 0, P, kb, false)
			b.launch("copy_block_f64", b.gridFor(m*kb), block256, a(k+kb, k), int64(n), P, int64(kb), m, kb)
			// trailing update of the lower triangle: A22 −= L21·L21ᵀ
			b.gemm(true, m, m, kb, -1, P, kb, false, P, kb, true, 1, a(k+kb, k+kb), n, true)
		}
	}
	if bad := downloadAs[int32](b, info, 1)[0]; bad != 0 {
		return 0, fmt.Errorf("cuda: pivot %d: %w", bad, runtime.ErrNotPositiveDefinite)
	}
	// X = L⁻¹ by block rows: X_ii = D_i, X[i, :i] = −D_i · (L[i, :i] · X[:i, :i]).
	X := b.alloc(8 * n * n)
	defer b.release(X)
	b.must(b.drv.MemsetD32Async(X, 0, uint64(2*n*n), b.stream))
	T := b.alloc(8 * nb * n)
	defer b.release(T)
	x := func(i, j int) driver.DevicePtr { return X + driver.DevicePtr(8*(i*n+j)) }
	for k := 0; k < n; k += nb {
		kb := min(nb, n-k)
		Dk := D + driver.DevicePtr(8*(k/nb)*nb*nb)
		b.launch("copy_block_f64", b.gridFor(kb*kb), block256, x(k, k), int64(n), Dk, int64(nb), kb, kb)
		if k > 0 {
			b.gemm(true, kb, k, k, 1, a(k, 0), n, false, X, n, false, 0, T, n, false)
			b.gemm(true, kb, k, kb, -1, Dk, nb, false, T, n, false, 0, x(k, 0), n, false)
		}
	}
	U := b.alloc(4 * n * n)
	b.launch("extract_u", b.gridFor(n*n), block256, U, X, n)
	return U, nil
}

// ---------------------------------------------------------------------------
// AWQ.

// FakeQuantAWQ implements runtime.AWQSolver.
func (b *Backend) FakeQuantAWQ(dst, w runtime.Buf, s []float32, bits, group int, fp32Scales bool) {
	d, wm := buf(dst), buf(w)
	if d.rows != wm.rows || d.cols != wm.cols || (s != nil && len(s) != wm.cols) {
		panic(fmt.Sprintf("cuda backend: FakeQuantAWQ of [%d %d] into [%d %d] with %d scales", wm.rows, wm.cols, d.rows, d.cols, len(s)))
	}
	if group <= 0 {
		group = wm.cols
	}
	if group > 256 || wm.cols%group != 0 {
		panic(fmt.Sprintf("cuda backend: FakeQuantAWQ group %d of %d columns (at most 256, dividing)", group, wm.cols))
	}
	defer b.enter()()
	b.loadCalib()
	var sp driver.DevicePtr
	if s != nil {
		sp = uploadSlice(b, s)
		defer b.release(sp)
	}
	items := wm.rows * (wm.cols / group)
	b.launch("awq_fakequant", g1((items+7)/8), block256, d.p, wm.p, sp, wm.rows, wm.cols, group,
		float32(int(1)<<bits-1), boolInt(fp32Scales))
}

// ClipSearchAWQ implements runtime.AWQSolver.
func (b *Backend) ClipSearchAWQ(w, gram runtime.Buf, bits, group, grid, steps int, fp32Scales bool) []float32 {
	wm, gm := buf(w), buf(gram)
	if group <= 0 {
		group = wm.cols
	}
	if gm.rows != wm.cols || gm.cols != wm.cols || group > 128 || wm.cols%group != 0 {
		panic(fmt.Sprintf("cuda backend: ClipSearchAWQ of w [%d %d] with gram [%d %d], group %d (at most 128, dividing)", wm.rows, wm.cols, gm.rows, gm.cols, group))
	}
	defer b.enter()()
	b.loadCalib()
	G := wm.cols / group
	best := b.alloc(4 * wm.rows * G)
	defer b.release(best)
	shm := 4 * (group*group + 8*group)
	b.raiseSmem("awq_clip", shm)
	b.launchShm("awq_clip", [3]uint32{uint32((wm.rows + 7) / 8), uint32(G), 1}, block256, shm,
		wm.p, gm.p, wm.rows, wm.cols, group, float32(int(1)<<bits-1), boolInt(fp32Scales), grid, steps, best)
	return downloadAs[float32](b, best, wm.rows*G)
}
