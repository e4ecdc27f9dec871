// Vector exp for amd64 (AVX2 + FMA). The constants are float32 bit patterns.

#include "textflag.h"

// Vector constants, 8 copies each (one YMM register).
DATA expc<>+0(SB)/4, $0x3fb8aa3b
DATA expc<>+4(SB)/4, $0x3fb8aa3b
DATA expc<>+8(SB)/4, $0x3fb8aa3b
DATA expc<>+12(SB)/4, $0x3fb8aa3b
DATA expc<>+16(SB)/4, $0x3fb8aa3b
DATA expc<>+20(SB)/4, $0x3fb8aa3b
DATA expc<>+24(SB)/4, $0x3fb8aa3b
DATA expc<>+28(SB)/4, $0x3fb8aa3b
DATA expc<>+32(SB)/4, $0x3f317200
DATA expc<>+36(SB)/4, $0x3f317200
DATA expc<>+40(SB)/4, $0x3f317200
DATA expc<>+44(SB)/4, $0x3f317200
DATA expc<>+48(SB)/4, $0x3f317200
DATA expc<>+52(SB)/4, $0x3f317200
DATA expc<>+56(SB)/4, $0x3f317200
DATA expc<>+60(SB)/4, $0x3f317200
DATA expc<>+64(SB)/4, $0x35bfbe8e
DATA expc<>+68(SB)/4, $0x35bfbe8e
DATA expc<>+72(SB)/4, $0x35bfbe8e
DATA expc<>+76(SB)/4, $0x35bfbe8e
DATA expc<>+80(SB)/4, $0x35bfbe8e
DATA expc<>+84(SB)/4, $0x35bfbe8e
DATA expc<>+88(SB)/4, $0x35bfbe8e
DATA expc<>+92(SB)/4, $0x35bfbe8e
DATA expc<>+96(SB)/4, $0x42b0999a
DATA expc<>+100(SB)/4, $0x42b0999a
DATA expc<>+104(SB)/4, $0x42b0999a
DATA expc<>+108(SB)/4, $0x42b0999a
DATA expc<>+112(SB)/4, $0x42b0999a
DATA expc<>+116(SB)/4, $0x42b0999a
DATA expc<>+120(SB)/4, $0x42b0999a
DATA expc<>+124(SB)/4, $0x42b0999a
DATA expc<>+128(SB)/4, $0xc2ae999a
DATA expc<>+132(SB)/4, $0xc2ae999a
DATA expc<>+136(SB)/4, $0xc2ae999a
DATA expc<>+140(SB)/4, $0xc2ae999a
DATA expc<>+144(SB)/4, $0xc2ae999a
DATA expc<>+148(SB)/4, $0xc2ae999a
DATA expc<>+152(SB)/4, $0xc2ae999a
DATA expc<>+156(SB)/4, $0xc2ae999a
DATA expc<>+160(SB)/4, $0x39500d01
DATA expc<>+164(SB)/4, $0x39500d01
DATA expc<>+168(SB)/4, $0x39500d01
DATA expc<>+172(SB)/4, $0x39500d01
DATA expc<>+176(SB)/4, $0x39500d01
DATA expc<>+180(SB)/4, $0x39500d01
DATA expc<>+184(SB)/4, $0x39500d01
DATA expc<>+188(SB)/4, $0x39500d01
DATA expc<>+192(SB)/4, $0x3ab60b61
DATA expc<>+196(SB)/4, $0x3ab60b61
DATA expc<>+200(SB)/4, $0x3ab60b61
DATA expc<>+204(SB)/4, $0x3ab60b61
DATA expc<>+208(SB)/4, $0x3ab60b61
DATA expc<>+212(SB)/4, $0x3ab60b61
DATA expc<>+216(SB)/4, $0x3ab60b61
DATA expc<>+220(SB)/4, $0x3ab60b61
DATA expc<>+224(SB)/4, $0x3c088889
DATA expc<>+228(SB)/4, $0x3c088889
DATA expc<>+232(SB)/4, $0x3c088889
DATA expc<>+236(SB)/4, $0x3c088889
DATA expc<>+240(SB)/4, $0x3c088889
DATA expc<>+244(SB)/4, $0x3c088889
DATA expc<>+248(SB)/4, $0x3c088889
DATA expc<>+252(SB)/4, $0x3c088889
DATA expc<>+256(SB)/4, $0x3d2aaaab
DATA expc<>+260(SB)/4, $0x3d2aaaab
DATA expc<>+264(SB)/4, $0x3d2aaaab
DATA expc<>+268(SB)/4, $0x3d2aaaab
DATA expc<>+272(SB)/4, $0x3d2aaaab
DATA expc<>+276(SB)/4, $0x3d2aaaab
DATA expc<>+280(SB)/4, $0x3d2aaaab
DATA expc<>+284(SB)/4, $0x3d2aaaab
DATA expc<>+288(SB)/4, $0x3e2aaaab
DATA expc<>+292(SB)/4, $0x3e2aaaab
DATA expc<>+296(SB)/4, $0x3e2aaaab
DATA expc<>+300(SB)/4, $0x3e2aaaab
DATA expc<>+304(SB)/4, $0x3e2aaaab
DATA expc<>+308(SB)/4, $0x3e2aaaab
DATA expc<>+312(SB)/4, $0x3e2aaaab
DATA expc<>+316(SB)/4, $0x3e2aaaab
DATA expc<>+320(SB)/4, $0x3f000000
DATA expc<>+324(SB)/4, $0x3f000000
DATA expc<>+328(SB)/4, $0x3f000000
DATA expc<>+332(SB)/4, $0x3f000000
DATA expc<>+336(SB)/4, $0x3f000000
DATA expc<>+340(SB)/4, $0x3f000000
DATA expc<>+344(SB)/4, $0x3f000000
DATA expc<>+348(SB)/4, $0x3f000000
DATA expc<>+352(SB)/4, $0x3f800000
DATA expc<>+356(SB)/4, $0x3f800000
DATA expc<>+360(SB)/4, $0x3f800000
DATA expc<>+364(SB)/4, $0x3f800000
DATA expc<>+368(SB)/4, $0x3f800000
DATA expc<>+372(SB)/4, $0x3f800000
DATA expc<>+376(SB)/4, $0x3f800000
DATA expc<>+380(SB)/4, $0x3f800000
DATA expc<>+384(SB)/4, $0x0000007f
DATA expc<>+388(SB)/4, $0x0000007f
DATA expc<>+392(SB)/4, $0x0000007f
DATA expc<>+396(SB)/4, $0x0000007f
DATA expc<>+400(SB)/4, $0x0000007f
DATA expc<>+404(SB)/4, $0x0000007f
DATA expc<>+408(SB)/4, $0x0000007f
DATA expc<>+412(SB)/4, $0x0000007f
GLOBL expc<>(SB), RODATA|NOPTR, $416

// func expBlockAVX2(dst, src *float32, n int, scale, bias float32) float32
//
// dst[i] = exp(clamp(src[i]*scale + bias)) for i < n (n a multiple of 8,
// clamp to [-87.3, 88.3]); returns the sum of the dst values. The same
// range reduction and degree-7 polynomial as the Go expf.
TEXT ·expBlockAVX2(SB), NOSPLIT, $0-36
	MOVQ dst+0(FP), DI
	MOVQ src+8(FP), SI
	MOVQ n+16(FP), CX
	VBROADCASTSS scale+24(FP), Y8
	VBROADCASTSS bias+28(FP), Y9
	VXORPS Y15, Y15, Y15
loop:
	CMPQ CX, $8
	JLT done
	VMOVUPS (SI), Y0
	VFMADD213PS Y9, Y8, Y0
	VMINPS expc<>+96(SB), Y0, Y0
	VMAXPS expc<>+128(SB), Y0, Y0
	VMULPS expc<>+0(SB), Y0, Y1
	VROUNDPS $0, Y1, Y1
	VMOVAPS Y0, Y2
	VFNMADD231PS expc<>+32(SB), Y1, Y2
	VFNMADD231PS expc<>+64(SB), Y1, Y2
	VMOVUPS expc<>+160(SB), Y3
	VFMADD213PS expc<>+192(SB), Y2, Y3
	VFMADD213PS expc<>+224(SB), Y2, Y3
	VFMADD213PS expc<>+256(SB), Y2, Y3
	VFMADD213PS expc<>+288(SB), Y2, Y3
	VFMADD213PS expc<>+320(SB), Y2, Y3
	VFMADD213PS expc<>+352(SB), Y2, Y3
	VFMADD213PS expc<>+352(SB), Y2, Y3
	VCVTPS2DQ Y1, Y4
	VPADDD expc<>+384(SB), Y4, Y4
	VPSLLD $23, Y4, Y4
	VMULPS Y4, Y3, Y3
	VMOVUPS Y3, (DI)
	VADDPS Y3, Y15, Y15
	ADDQ $32, SI
	ADDQ $32, DI
	SUBQ $8, CX
	JMP loop
done:
	VEXTRACTF128 $1, Y15, X14
	VADDPS X14, X15, X15
	VHADDPS X15, X15, X15
	VHADDPS X15, X15, X15
	VZEROUPPER
	MOVSS X15, ret+32(FP)
	RET
