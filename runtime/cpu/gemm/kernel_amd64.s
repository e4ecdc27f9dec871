//go:build amd64 && !purego

#include "textflag.h"

// ---------------------------------------------------------------------------
// AVX2+FMA micro-kernel: 6 rows of A × 16 rows of B.
// A is read in place: row r at R8 + r*lda (DX = lda bytes, R9 = 3*lda,
// R10 = 5*lda). Packed B panel: kc steps of 16 floats.
// Accumulators Y0..Y11 (row r in Y(2r), Y(2r+1)); B in Y12/Y13; A broadcast
// alternates Y14/Y15.

#define AVX2_ROW(addr, bc, acc0, acc1) \
	VBROADCASTSS addr, bc; \
	VFMADD231PS  Y12, bc, acc0; \
	VFMADD231PS  Y13, bc, acc1

#define AVX2_STEP(aoff, boff) \
	VMOVUPS boff(BX), Y12; \
	VMOVUPS boff+32(BX), Y13; \
	AVX2_ROW(aoff(R8), Y14, Y0, Y1); \
	AVX2_ROW(aoff(R8)(DX*1), Y15, Y2, Y3); \
	AVX2_ROW(aoff(R8)(DX*2), Y14, Y4, Y5); \
	AVX2_ROW(aoff(R8)(R9*1), Y15, Y6, Y7); \
	AVX2_ROW(aoff(R8)(DX*4), Y14, Y8, Y9); \
	AVX2_ROW(aoff(R8)(R10*1), Y15, Y10, Y11)

#define AVX2_STORE(r0, r1) \
	VMOVUPS r0, (DI); \
	VMOVUPS r1, 32(DI); \
	ADDQ    DX, DI

#define AVX2_ACC(r0, r1) \
	VADDPS  (DI), r0, r0; \
	VADDPS  32(DI), r1, r1; \
	VMOVUPS r0, (DI); \
	VMOVUPS r1, 32(DI); \
	ADDQ    DX, DI

// func sgemm6x16AVX2(kc int, a *float32, lda int, b, c *float32, ldc int, acc bool)
TEXT ·sgemm6x16AVX2(SB), NOSPLIT, $0-49
	MOVQ kc+0(FP), CX
	MOVQ a+8(FP), R8
	MOVQ lda+16(FP), DX
	SHLQ $2, DX
	LEAQ (DX)(DX*2), R9
	LEAQ (DX)(DX*4), R10
	MOVQ b+24(FP), BX
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3
	VXORPS Y4, Y4, Y4
	VXORPS Y5, Y5, Y5
	VXORPS Y6, Y6, Y6
	VXORPS Y7, Y7, Y7
	VXORPS Y8, Y8, Y8
	VXORPS Y9, Y9, Y9
	VXORPS Y10, Y10, Y10
	VXORPS Y11, Y11, Y11

avx2loop4:
	CMPQ CX, $4
	JLT  avx2loop1
	AVX2_STEP(0, 0)
	AVX2_STEP(4, 64)
	AVX2_STEP(8, 128)
	AVX2_STEP(12, 192)
	ADDQ $16, R8
	ADDQ $256, BX
	SUBQ $4, CX
	JMP  avx2loop4

avx2loop1:
	TESTQ CX, CX
	JEQ   avx2store
	AVX2_STEP(0, 0)
	ADDQ  $4, R8
	ADDQ  $64, BX
	DECQ  CX
	JMP   avx2loop1

avx2store:
	MOVQ    c+32(FP), DI
	MOVQ    ldc+40(FP), DX
	SHLQ    $2, DX
	MOVBQZX acc+48(FP), R8
	TESTQ   R8, R8
	JNE     avx2acc
	AVX2_STORE(Y0, Y1)
	AVX2_STORE(Y2, Y3)
	AVX2_STORE(Y4, Y5)
	AVX2_STORE(Y6, Y7)
	AVX2_STORE(Y8, Y9)
	AVX2_STORE(Y10, Y11)
	VZEROUPPER
	RET

avx2acc:
	AVX2_ACC(Y0, Y1)
	AVX2_ACC(Y2, Y3)
	AVX2_ACC(Y4, Y5)
	AVX2_ACC(Y6, Y7)
	AVX2_ACC(Y8, Y9)
	AVX2_ACC(Y10, Y11)
	VZEROUPPER
	RET

// ---------------------------------------------------------------------------
// AVX-512 micro-kernel: 12 rows of A × 32 rows of B.
// A is read in place: rows 0-5 at R8 + r*lda, rows 6-11 at R11 + (r-6)*lda
// (DX = lda bytes, R9 = 3*lda, R10 = 5*lda). Packed B panel: kc steps of
// 32 floats. Accumulators Z0..Z23 (row r in Z(2r), Z(2r+1)); B in Z24/Z25; A broadcasts
// rotate through Z26..Z31.

#define Z_ROW(addr, bc, acc0, acc1) \
	VBROADCASTSS addr, bc; \
	VFMADD231PS  Z24, bc, acc0; \
	VFMADD231PS  Z25, bc, acc1

#define Z_STEP(aoff, boff) \
	VMOVUPS boff(BX), Z24; \
	VMOVUPS boff+64(BX), Z25; \
	Z_ROW(aoff(R8), Z26, Z0, Z1); \
	Z_ROW(aoff(R8)(DX*1), Z27, Z2, Z3); \
	Z_ROW(aoff(R8)(DX*2), Z28, Z4, Z5); \
	Z_ROW(aoff(R8)(R9*1), Z29, Z6, Z7); \
	Z_ROW(aoff(R8)(DX*4), Z30, Z8, Z9); \
	Z_ROW(aoff(R8)(R10*1), Z31, Z10, Z11); \
	Z_ROW(aoff(R11), Z26, Z12, Z13); \
	Z_ROW(aoff(R11)(DX*1), Z27, Z14, Z15); \
	Z_ROW(aoff(R11)(DX*2), Z28, Z16, Z17); \
	Z_ROW(aoff(R11)(R9*1), Z29, Z18, Z19); \
	Z_ROW(aoff(R11)(DX*4), Z30, Z20, Z21); \
	Z_ROW(aoff(R11)(R10*1), Z31, Z22, Z23)

#define Z_STORE(r0, r1) \
	VMOVUPS r0, (DI); \
	VMOVUPS r1, 64(DI); \
	ADDQ    DX, DI

#define Z_ACC(r0, r1) \
	VADDPS  (DI), r0, r0; \
	VADDPS  64(DI), r1, r1; \
	VMOVUPS r0, (DI); \
	VMOVUPS r1, 64(DI); \
	ADDQ    DX, DI

// func sgemm12x32AVX512(kc int, a *float32, lda int, b, c *float32, ldc int, acc bool)
TEXT ·sgemm12x32AVX512(SB), NOSPLIT, $0-49
	MOVQ   kc+0(FP), CX
	MOVQ   a+8(FP), R8
	MOVQ   lda+16(FP), DX
	SHLQ   $2, DX
	LEAQ   (DX)(DX*2), R9
	LEAQ   (DX)(DX*4), R10
	LEAQ   (R8)(R9*2), R11
	MOVQ   b+24(FP), BX
	VPXORD Z0, Z0, Z0
	VPXORD Z1, Z1, Z1
	VPXORD Z2, Z2, Z2
	VPXORD Z3, Z3, Z3
	VPXORD Z4, Z4, Z4
	VPXORD Z5, Z5, Z5
	VPXORD Z6, Z6, Z6
	VPXORD Z7, Z7, Z7
	VPXORD Z8, Z8, Z8
	VPXORD Z9, Z9, Z9
	VPXORD Z10, Z10, Z10
	VPXORD Z11, Z11, Z11
	VPXORD Z12, Z12, Z12
	VPXORD Z13, Z13, Z13
	VPXORD Z14, Z14, Z14
	VPXORD Z15, Z15, Z15
	VPXORD Z16, Z16, Z16
	VPXORD Z17, Z17, Z17
	VPXORD Z18, Z18, Z18
	VPXORD Z19, Z19, Z19
	VPXORD Z20, Z20, Z20
	VPXORD Z21, Z21, Z21
	VPXORD Z22, Z22, Z22
	VPXORD Z23, Z23, Z23

zloop2:
	CMPQ CX, $2
	JLT  zloop1
	Z_STEP(0, 0)
	Z_STEP(4, 128)
	ADDQ $8, R8
	ADDQ $8, R11
	ADDQ $256, BX
	SUBQ $2, CX
	JMP  zloop2

zloop1:
	TESTQ CX, CX
	JEQ   zstore
	Z_STEP(0, 0)

zstore:
	MOVQ    c+32(FP), DI
	MOVQ    ldc+40(FP), DX
	SHLQ    $2, DX
	MOVBQZX acc+48(FP), R8
	TESTQ   R8, R8
	JNE     zacc
	Z_STORE(Z0, Z1)
	Z_STORE(Z2, Z3)
	Z_STORE(Z4, Z5)
	Z_STORE(Z6, Z7)
	Z_STORE(Z8, Z9)
	Z_STORE(Z10, Z11)
	Z_STORE(Z12, Z13)
	Z_STORE(Z14, Z15)
	Z_STORE(Z16, Z17)
	Z_STORE(Z18, Z19)
	Z_STORE(Z20, Z21)
	Z_STORE(Z22, Z23)
	VZEROUPPER
	RET

zacc:
	Z_ACC(Z0, Z1)
	Z_ACC(Z2, Z3)
	Z_ACC(Z4, Z5)
	Z_ACC(Z6, Z7)
	Z_ACC(Z8, Z9)
	Z_ACC(Z10, Z11)
	Z_ACC(Z12, Z13)
	Z_ACC(Z14, Z15)
	Z_ACC(Z16, Z17)
	Z_ACC(Z18, Z19)
	Z_ACC(Z20, Z21)
	Z_ACC(Z22, Z23)
	VZEROUPPER
	RET

// ---------------------------------------------------------------------------
// AVX-512 tail micro-kernel: 6 rows of A × 32 rows of B (for the last rows of
// A when fewer than 7 remain). Same layout as the 12×32 kernel, rows 0-5 only.

#define ZH_STEP(aoff, boff) \
	VMOVUPS boff(BX), Z24; \
	VMOVUPS boff+64(BX), Z25; \
	Z_ROW(aoff(R8), Z26, Z0, Z1); \
	Z_ROW(aoff(R8)(DX*1), Z27, Z2, Z3); \
	Z_ROW(aoff(R8)(DX*2), Z28, Z4, Z5); \
	Z_ROW(aoff(R8)(R9*1), Z29, Z6, Z7); \
	Z_ROW(aoff(R8)(DX*4), Z30, Z8, Z9); \
	Z_ROW(aoff(R8)(R10*1), Z31, Z10, Z11)

// func sgemm6x32AVX512(kc int, a *float32, lda int, b, c *float32, ldc int, acc bool)
TEXT ·sgemm6x32AVX512(SB), NOSPLIT, $0-49
	MOVQ   kc+0(FP), CX
	MOVQ   a+8(FP), R8
	MOVQ   lda+16(FP), DX
	SHLQ   $2, DX
	LEAQ   (DX)(DX*2), R9
	LEAQ   (DX)(DX*4), R10
	MOVQ   b+24(FP), BX
	VPXORD Z0, Z0, Z0
	VPXORD Z1, Z1, Z1
	VPXORD Z2, Z2, Z2
	VPXORD Z3, Z3, Z3
	VPXORD Z4, Z4, Z4
	VPXORD Z5, Z5, Z5
	VPXORD Z6, Z6, Z6
	VPXORD Z7, Z7, Z7
	VPXORD Z8, Z8, Z8
	VPXORD Z9, Z9, Z9
	VPXORD Z10, Z10, Z10
	VPXORD Z11, Z11, Z11

zhloop2:
	CMPQ CX, $2
	JLT  zhloop1
	ZH_STEP(0, 0)
	ZH_STEP(4, 128)
	ADDQ $8, R8
	ADDQ $256, BX
	SUBQ $2, CX
	JMP  zhloop2

zhloop1:
	TESTQ CX, CX
	JEQ   zhstore
	ZH_STEP(0, 0)

zhstore:
	MOVQ    c+32(FP), DI
	MOVQ    ldc+40(FP), DX
	SHLQ    $2, DX
	MOVBQZX acc+48(FP), R8
	TESTQ   R8, R8
	JNE     zhacc
	Z_STORE(Z0, Z1)
	Z_STORE(Z2, Z3)
	Z_STORE(Z4, Z5)
	Z_STORE(Z6, Z7)
	Z_STORE(Z8, Z9)
	Z_STORE(Z10, Z11)
	VZEROUPPER
	RET

zhacc:
	Z_ACC(Z0, Z1)
	Z_ACC(Z2, Z3)
	Z_ACC(Z4, Z5)
	Z_ACC(Z6, Z7)
	Z_ACC(Z8, Z9)
	Z_ACC(Z10, Z11)
	VZEROUPPER
	RET

// ---------------------------------------------------------------------------
// Vector helpers (AVX2+FMA). n is a multiple of 8; callers do the tail.

// func dot4AVX2(x, b *float32, ldb, n int, out *[4]float32)
TEXT ·dot4AVX2(SB), NOSPLIT, $0-40
	MOVQ   x+0(FP), SI
	MOVQ   b+8(FP), R8
	MOVQ   ldb+16(FP), DX
	SHLQ   $2, DX
	LEAQ   (R8)(DX*1), R9
	LEAQ   (R9)(DX*1), R10
	LEAQ   (R10)(DX*1), R11
	MOVQ   n+24(FP), CX
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3
	VXORPS Y4, Y4, Y4
	VXORPS Y5, Y5, Y5
	VXORPS Y6, Y6, Y6
	VXORPS Y7, Y7, Y7

d4loop16:
	CMPQ        CX, $16
	JLT         d4tail8
	VMOVUPS     (SI), Y8
	VMOVUPS     32(SI), Y9
	VFMADD231PS (R8), Y8, Y0
	VFMADD231PS 32(R8), Y9, Y4
	VFMADD231PS (R9), Y8, Y1
	VFMADD231PS 32(R9), Y9, Y5
	VFMADD231PS (R10), Y8, Y2
	VFMADD231PS 32(R10), Y9, Y6
	VFMADD231PS (R11), Y8, Y3
	VFMADD231PS 32(R11), Y9, Y7
	ADDQ        $64, SI
	ADDQ        $64, R8
	ADDQ        $64, R9
	ADDQ        $64, R10
	ADDQ        $64, R11
	SUBQ        $16, CX
	JMP         d4loop16

d4tail8:
	TESTQ       CX, CX
	JEQ         d4done
	VMOVUPS     (SI), Y8
	VFMADD231PS (R8), Y8, Y0
	VFMADD231PS (R9), Y8, Y1
	VFMADD231PS (R10), Y8, Y2
	VFMADD231PS (R11), Y8, Y3

d4done:
	VADDPS       Y4, Y0, Y0
	VADDPS       Y5, Y1, Y1
	VADDPS       Y6, Y2, Y2
	VADDPS       Y7, Y3, Y3
	VHADDPS      Y1, Y0, Y0
	VHADDPS      Y3, Y2, Y2
	VHADDPS      Y2, Y0, Y0
	VEXTRACTF128 $1, Y0, X1
	VADDPS       X1, X0, X0
	MOVQ         out+32(FP), DI
	VMOVUPS      X0, (DI)
	VZEROUPPER
	RET

// func dotAVX2(a, b *float32, n int) float32
TEXT ·dotAVX2(SB), NOSPLIT, $0-28
	MOVQ   a+0(FP), SI
	MOVQ   b+8(FP), DI
	MOVQ   n+16(FP), CX
	VXORPS Y0, Y0, Y0
	VXORPS Y1, Y1, Y1
	VXORPS Y2, Y2, Y2
	VXORPS Y3, Y3, Y3

dloop32:
	CMPQ        CX, $32
	JLT         dloop8
	VMOVUPS     (SI), Y4
	VMOVUPS     32(SI), Y5
	VMOVUPS     64(SI), Y6
	VMOVUPS     96(SI), Y7
	VFMADD231PS (DI), Y4, Y0
	VFMADD231PS 32(DI), Y5, Y1
	VFMADD231PS 64(DI), Y6, Y2
	VFMADD231PS 96(DI), Y7, Y3
	ADDQ        $128, SI
	ADDQ        $128, DI
	SUBQ        $32, CX
	JMP         dloop32

dloop8:
	TESTQ       CX, CX
	JEQ         ddone
	VMOVUPS     (SI), Y4
	VFMADD231PS (DI), Y4, Y0
	ADDQ        $32, SI
	ADDQ        $32, DI
	SUBQ        $8, CX
	JMP         dloop8

ddone:
	VADDPS       Y1, Y0, Y0
	VADDPS       Y3, Y2, Y2
	VADDPS       Y2, Y0, Y0
	VEXTRACTF128 $1, Y0, X1
	VADDPS       X1, X0, X0
	VHADDPS      X0, X0, X0
	VHADDPS      X0, X0, X0
	VZEROUPPER
	MOVSS        X0, ret+24(FP)
	RET

// func axpyAVX2(alpha float32, x, y *float32, n int)
TEXT ·axpyAVX2(SB), NOSPLIT, $0-32
	VBROADCASTSS alpha+0(FP), Y0
	MOVQ         x+8(FP), SI
	MOVQ         y+16(FP), DI
	MOVQ         n+24(FP), CX

aloop32:
	CMPQ        CX, $32
	JLT         aloop8
	VMOVUPS     (DI), Y1
	VMOVUPS     32(DI), Y2
	VMOVUPS     64(DI), Y3
	VMOVUPS     96(DI), Y4
	VFMADD231PS (SI), Y0, Y1
	VFMADD231PS 32(SI), Y0, Y2
	VFMADD231PS 64(SI), Y0, Y3
	VFMADD231PS 96(SI), Y0, Y4
	VMOVUPS     Y1, (DI)
	VMOVUPS     Y2, 32(DI)
	VMOVUPS     Y3, 64(DI)
	VMOVUPS     Y4, 96(DI)
	ADDQ        $128, SI
	ADDQ        $128, DI
	SUBQ        $32, CX
	JMP         aloop32

aloop8:
	TESTQ       CX, CX
	JEQ         adone
	VMOVUPS     (DI), Y1
	VFMADD231PS (SI), Y0, Y1
	VMOVUPS     Y1, (DI)
	ADDQ        $32, SI
	ADDQ        $32, DI
	SUBQ        $8, CX
	JMP         aloop8

adone:
	VZEROUPPER
	RET

// ---------------------------------------------------------------------------
// Panel packing with AVX-512 gathers.

// func packGatherAVX512(dst, src *float32, idx *[32]int32, kn, w, gmask, smask int)
// For q < kn: dst[q*w+r] = src[idx[r]/4 + q] for the rows whose bit is set in
// gmask (other lanes 0), storing the w lanes selected by smask (bits 0..15
// for the first 16 rows, 16..31 for the rest). w is 1..32.
TEXT ·packGatherAVX512(SB), NOSPLIT, $0-56
	MOVQ    dst+0(FP), DI
	MOVQ    src+8(FP), SI
	MOVQ    idx+16(FP), AX
	MOVQ    kn+24(FP), CX
	MOVQ    w+32(FP), DX
	SHLQ    $2, DX
	MOVQ    gmask+40(FP), BX
	KMOVW   BX, K2
	SHRQ    $16, BX
	KMOVW   BX, K3
	MOVQ    smask+48(FP), BX
	KMOVW   BX, K4
	SHRQ    $16, BX
	KMOVW   BX, K5
	VMOVDQU32 (AX), Z16
	VMOVDQU32 64(AX), Z17
	TESTQ   CX, CX
	JEQ     pgdone
	CMPQ    DX, $64
	JGT     pgloop2

pgloop1:
	VPXORD     Z0, Z0, Z0
	KMOVW      K2, K1
	VGATHERDPS (SI)(Z16*1), K1, Z0
	VMOVUPS    Z0, K4, (DI)
	ADDQ       $4, SI
	ADDQ       DX, DI
	DECQ       CX
	JNE        pgloop1
	JMP        pgdone

pgloop2:
	VPXORD     Z0, Z0, Z0
	VPXORD     Z1, Z1, Z1
	KMOVW      K2, K1
	VGATHERDPS (SI)(Z16*1), K1, Z0
	KMOVW      K3, K6
	VGATHERDPS (SI)(Z17*1), K6, Z1
	VMOVUPS    Z0, K4, (DI)
	VMOVUPS    Z1, K5, 64(DI)
	ADDQ       $4, SI
	ADDQ       DX, DI
	DECQ       CX
	JNE        pgloop2

pgdone:
	VZEROUPPER
	RET

// func packGatherAVX2(dst, src *float32, idx *[16]int32, mask *[16]int32, kn, w int)
// As packGatherAVX512 for w = 8 or 16, with AVX2 gathers: lanes whose mask
// element is negative are loaded, the others are 0.
TEXT ·packGatherAVX2(SB), NOSPLIT, $0-48
	MOVQ    dst+0(FP), DI
	MOVQ    src+8(FP), SI
	MOVQ    idx+16(FP), AX
	MOVQ    mask+24(FP), BX
	MOVQ    kn+32(FP), CX
	MOVQ    w+40(FP), DX
	SHLQ    $2, DX
	VMOVDQU (AX), Y6
	VMOVDQU 32(AX), Y7
	VMOVDQU (BX), Y4
	VMOVDQU 32(BX), Y5
	TESTQ   CX, CX
	JEQ     pg2done
	CMPQ    DX, $32
	JGT     pg2loop2

pg2loop1:
	VXORPS     Y0, Y0, Y0
	VMOVDQU    Y4, Y2
	VGATHERDPS Y2, (SI)(Y6*1), Y0
	VMOVUPS    Y0, (DI)
	ADDQ       $4, SI
	ADDQ       DX, DI
	DECQ       CX
	JNE        pg2loop1
	JMP        pg2done

pg2loop2:
	VXORPS     Y0, Y0, Y0
	VXORPS     Y1, Y1, Y1
	VMOVDQU    Y4, Y2
	VMOVDQU    Y5, Y3
	VGATHERDPS Y2, (SI)(Y6*1), Y0
	VGATHERDPS Y3, (SI)(Y7*1), Y1
	VMOVUPS    Y0, (DI)
	VMOVUPS    Y1, 32(DI)
	ADDQ       $4, SI
	ADDQ       DX, DI
	DECQ       CX
	JNE        pg2loop2

pg2done:
	VZEROUPPER
	RET

// func transpose16AVX512(dst, src *float32, ld, dstStride, blocks int)
// For each of blocks consecutive 16×16 blocks (block b covers columns
// 16b..16b+15 of 16 rows of src, row stride ld floats): dst[(16b+q)*dstStride
// + r] = src[r*ld + 16b + q] for r, q < 16. Done with an in-register
// transpose: unpack ps, unpack pd, then two rounds of 128-bit lane shuffles.
TEXT ·transpose16AVX512(SB), NOSPLIT, $0-40
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), R8
	MOVQ ld+16(FP), DX
	SHLQ $2, DX
	MOVQ dstStride+24(FP), BX
	SHLQ $2, BX
	MOVQ blocks+32(FP), CX
	LEAQ (DX)(DX*2), R9
	LEAQ (DX)(DX*4), R10
	LEAQ (R9)(DX*4), R11
	LEAQ (R8)(DX*8), R12
	TESTQ CX, CX
	JEQ  trdone

trloop:
	VMOVUPS (R8), Z0
	VMOVUPS (R8)(DX*1), Z1
	VMOVUPS (R8)(DX*2), Z2
	VMOVUPS (R8)(R9*1), Z3
	VMOVUPS (R8)(DX*4), Z4
	VMOVUPS (R8)(R10*1), Z5
	VMOVUPS (R8)(R9*2), Z6
	VMOVUPS (R8)(R11*1), Z7
	VMOVUPS (R12), Z8
	VMOVUPS (R12)(DX*1), Z9
	VMOVUPS (R12)(DX*2), Z10
	VMOVUPS (R12)(R9*1), Z11
	VMOVUPS (R12)(DX*4), Z12
	VMOVUPS (R12)(R10*1), Z13
	VMOVUPS (R12)(R9*2), Z14
	VMOVUPS (R12)(R11*1), Z15

	// Stage 1: pairs of rows. t(2i) = [r(2i)q0 r(2i+1)q0 r(2i)q1 r(2i+1)q1],
	// t(2i+1) = the same for q2, q3 (per 128-bit lane).
	VUNPCKLPS Z1, Z0, Z16
	VUNPCKHPS Z1, Z0, Z17
	VUNPCKLPS Z3, Z2, Z18
	VUNPCKHPS Z3, Z2, Z19
	VUNPCKLPS Z5, Z4, Z20
	VUNPCKHPS Z5, Z4, Z21
	VUNPCKLPS Z7, Z6, Z22
	VUNPCKHPS Z7, Z6, Z23
	VUNPCKLPS Z9, Z8, Z24
	VUNPCKHPS Z9, Z8, Z25
	VUNPCKLPS Z11, Z10, Z26
	VUNPCKHPS Z11, Z10, Z27
	VUNPCKLPS Z13, Z12, Z28
	VUNPCKHPS Z13, Z12, Z29
	VUNPCKLPS Z15, Z14, Z30
	VUNPCKHPS Z15, Z14, Z31

	// Stage 2: groups of 4 rows. u(4g+j) lane L = rows 4g..4g+3 at q=4L+j.
	VUNPCKLPD Z18, Z16, Z0
	VUNPCKHPD Z18, Z16, Z1
	VUNPCKLPD Z19, Z17, Z2
	VUNPCKHPD Z19, Z17, Z3
	VUNPCKLPD Z22, Z20, Z4
	VUNPCKHPD Z22, Z20, Z5
	VUNPCKLPD Z23, Z21, Z6
	VUNPCKHPD Z23, Z21, Z7
	VUNPCKLPD Z26, Z24, Z8
	VUNPCKHPD Z26, Z24, Z9
	VUNPCKLPD Z27, Z25, Z10
	VUNPCKHPD Z27, Z25, Z11
	VUNPCKLPD Z30, Z28, Z12
	VUNPCKHPD Z30, Z28, Z13
	VUNPCKLPD Z31, Z29, Z14
	VUNPCKHPD Z31, Z29, Z15

	// Stage 3: lanes. For each j, out(q=4L+j) = [u(j) lane L, u(4+j) lane L,
	// u(8+j) lane L, u(12+j) lane L].
	VSHUFF32X4 $0x44, Z4, Z0, Z16
	VSHUFF32X4 $0xEE, Z4, Z0, Z17
	VSHUFF32X4 $0x44, Z12, Z8, Z18
	VSHUFF32X4 $0xEE, Z12, Z8, Z19
	VSHUFF32X4 $0x88, Z18, Z16, Z20 // q = 0
	VSHUFF32X4 $0xDD, Z18, Z16, Z21 // q = 4
	VSHUFF32X4 $0x88, Z19, Z17, Z22 // q = 8
	VSHUFF32X4 $0xDD, Z19, Z17, Z23 // q = 12

	VSHUFF32X4 $0x44, Z5, Z1, Z16
	VSHUFF32X4 $0xEE, Z5, Z1, Z17
	VSHUFF32X4 $0x44, Z13, Z9, Z18
	VSHUFF32X4 $0xEE, Z13, Z9, Z19
	VSHUFF32X4 $0x88, Z18, Z16, Z24 // q = 1
	VSHUFF32X4 $0xDD, Z18, Z16, Z25 // q = 5
	VSHUFF32X4 $0x88, Z19, Z17, Z26 // q = 9
	VSHUFF32X4 $0xDD, Z19, Z17, Z27 // q = 13

	VSHUFF32X4 $0x44, Z6, Z2, Z16
	VSHUFF32X4 $0xEE, Z6, Z2, Z17
	VSHUFF32X4 $0x44, Z14, Z10, Z18
	VSHUFF32X4 $0xEE, Z14, Z10, Z19
	VSHUFF32X4 $0x88, Z18, Z16, Z28 // q = 2
	VSHUFF32X4 $0xDD, Z18, Z16, Z29 // q = 6
	VSHUFF32X4 $0x88, Z19, Z17, Z30 // q = 10
	VSHUFF32X4 $0xDD, Z19, Z17, Z31 // q = 14

	VSHUFF32X4 $0x44, Z7, Z3, Z16
	VSHUFF32X4 $0xEE, Z7, Z3, Z17
	VSHUFF32X4 $0x44, Z15, Z11, Z18
	VSHUFF32X4 $0xEE, Z15, Z11, Z19
	VSHUFF32X4 $0x88, Z18, Z16, Z0 // q = 3
	VSHUFF32X4 $0xDD, Z18, Z16, Z1 // q = 7
	VSHUFF32X4 $0x88, Z19, Z17, Z2 // q = 11
	VSHUFF32X4 $0xDD, Z19, Z17, Z3 // q = 15

	VMOVUPS Z20, (DI)
	ADDQ    BX, DI
	VMOVUPS Z24, (DI)
	ADDQ    BX, DI
	VMOVUPS Z28, (DI)
	ADDQ    BX, DI
	VMOVUPS Z0, (DI)
	ADDQ    BX, DI
	VMOVUPS Z21, (DI)
	ADDQ    BX, DI
	VMOVUPS Z25, (DI)
	ADDQ    BX, DI
	VMOVUPS Z29, (DI)
	ADDQ    BX, DI
	VMOVUPS Z1, (DI)
	ADDQ    BX, DI
	VMOVUPS Z22, (DI)
	ADDQ    BX, DI
	VMOVUPS Z26, (DI)
	ADDQ    BX, DI
	VMOVUPS Z30, (DI)
	ADDQ    BX, DI
	VMOVUPS Z2, (DI)
	ADDQ    BX, DI
	VMOVUPS Z23, (DI)
	ADDQ    BX, DI
	VMOVUPS Z27, (DI)
	ADDQ    BX, DI
	VMOVUPS Z31, (DI)
	ADDQ    BX, DI
	VMOVUPS Z3, (DI)
	ADDQ    BX, DI

	ADDQ $64, R8
	ADDQ $64, R12
	DECQ CX
	JNE  trloop

trdone:
	VZEROUPPER
	RET
