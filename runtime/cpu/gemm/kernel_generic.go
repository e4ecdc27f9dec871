package gemm

// generic is the pure-Go kernel set, used where no assembly kernel fits the
// CPU and by tests as a second implementation.
var generic = &impl{
	name:   "generic",
	mr:     4,
	nr:     4,
	kcMax:  256,
	mc:     64,
	nc:     256,
	pack:   packPanels,
	kernel: kernelGeneric4x4,
	dot4:   dot4Generic,
	dot:    dotGeneric,
	axpy:   axpyGeneric,
}

// kernelGeneric4x4 is the 4×4 micro-kernel in plain Go.
func kernelGeneric4x4(kc int, a []float32, lda int, bp, c []float32, ldc int, acc bool) {
	a0s := a[0:kc]
	a1s := a[lda : lda+kc]
	a2s := a[2*lda : 2*lda+kc]
	a3s := a[3*lda : 3*lda+kc]
	bp = bp[:kc*4]
	var c00, c01, c02, c03 float32
	var c10, c11, c12, c13 float32
	var c20, c21, c22, c23 float32
	var c30, c31, c32, c33 float32
	for p := range a0s {
		b := bp[p*4 : p*4+4 : p*4+4]
		a0, a1, a2, a3 := a0s[p], a1s[p], a2s[p], a3s[p]
		b0, b1, b2, b3 := b[0], b[1], b[2], b[3]
		c00 += a0 * b0
		c01 += a0 * b1
		c02 += a0 * b2
		c03 += a0 * b3
		c10 += a1 * b0
		c11 += a1 * b1
		c12 += a1 * b2
		c13 += a1 * b3
		c20 += a2 * b0
		c21 += a2 * b1
		c22 += a2 * b2
		c23 += a2 * b3
		c30 += a3 * b0
		c31 += a3 * b1
		c32 += a3 * b2
		c33 += a3 * b3
	}
	r0 := c[0:4:4]
	r1 := c[ldc : ldc+4 : ldc+4]
	r2 := c[2*ldc : 2*ldc+4 : 2*ldc+4]
	r3 := c[3*ldc : 3*ldc+4 : 3*ldc+4]
	if acc {
		r0[0], r0[1], r0[2], r0[3] = r0[0]+c00, r0[1]+c01, r0[2]+c02, r0[3]+c03
		r1[0], r1[1], r1[2], r1[3] = r1[0]+c10, r1[1]+c11, r1[2]+c12, r1[3]+c13
		r2[0], r2[1], r2[2], r2[3] = r2[0]+c20, r2[1]+c21, r2[2]+c22, r2[3]+c23
		r3[0], r3[1], r3[2], r3[3] = r3[0]+c30, r3[1]+c31, r3[2]+c32, r3[3]+c33
		return
	}
	r0[0], r0[1], r0[2], r0[3] = c00, c01, c02, c03
	r1[0], r1[1], r1[2], r1[3] = c10, c11, c12, c13
	r2[0], r2[1], r2[2], r2[3] = c20, c21, c22, c23
	r3[0], r3[1], r3[2], r3[3] = c30, c31, c32, c33
}

// dot4Generic sets out[r] = x·b[r*ldb:] for four rows.
func dot4Generic(x, b []float32, ldb int, out *[4]float32) {
	n := len(x)
	b0 := b[:n]
	b1 := b[ldb : ldb+n]
	b2 := b[2*ldb : 2*ldb+n]
	b3 := b[3*ldb : 3*ldb+n]
	var s0, s1, s2, s3 float32
	for i, v := range x {
		s0 += v * b0[i]
		s1 += v * b1[i]
		s2 += v * b2[i]
		s3 += v * b3[i]
	}
	out[0], out[1], out[2], out[3] = s0, s1, s2, s3
}

// dotGeneric returns Σ a[i]*b[i] with four partial sums.
func dotGeneric(a, b []float32) float32 {
	b = b[:len(a)]
	var s0, s1, s2, s3 float32
	i := 0
	for ; i+4 <= len(a); i += 4 {
		s0 += a[i] * b[i]
		s1 += a[i+1] * b[i+1]
		s2 += a[i+2] * b[i+2]
		s3 += a[i+3] * b[i+3]
	}
	for ; i < len(a); i++ {
		s0 += a[i] * b[i]
	}
	return (s0 + s1) + (s2 + s3)
}

// axpyGeneric does y += alpha*x.
func axpyGeneric(alpha float32, x, y []float32) {
	y = y[:len(x)]
	for i, v := range x {
		y[i] += alpha * v
	}
}
