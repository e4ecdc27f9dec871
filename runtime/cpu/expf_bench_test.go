package cpu

import (
	"math"
	"testing"
)

func BenchmarkExpf(b *testing.B) {
	x := make([]float32, 4096)
	for i := range x {
		x[i] = -float32(i) / 200
	}
	b.ResetTimer()
	s := float32(0)
	for i := 0; i < b.N; i++ {
		for _, v := range x {
			s += expf(v)
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(x)), "ns/exp")
	_ = s
}

func BenchmarkMathExp(b *testing.B) {
	x := make([]float32, 4096)
	for i := range x {
		x[i] = -float32(i) / 200
	}
	b.ResetTimer()
	s := float32(0)
	for i := 0; i < b.N; i++ {
		for _, v := range x {
			s += float32(math.Exp(float64(v)))
		}
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(x)), "ns/exp")
	_ = s
}

func TestExpf(t *testing.T) {
	worst := 0.0
	for x := float32(-100); x < 100; x += 0.0137 {
		got, want := float64(expf(x)), math.Exp(float64(x))
		if want < 0x1p-126 || want > math.MaxFloat32 { // subnormal float32 results have fewer digits
			continue
		}
		e := math.Abs(got-want) / want
		worst = max(worst, e)
	}
	if worst > 5e-7 {
		t.Errorf("expf: worst relative error %.3g, want <= 5e-7", worst)
	}
	for _, x := range []float32{float32(math.Inf(-1)), -1000, -87.5, 0, 88.5, 1000} {
		got, want := float64(expf(x)), float64(float32(math.Exp(float64(x))))
		if got != want && math.Abs(got-want)/want > 5e-7 {
			t.Errorf("expf(%g) = %g, want %g", x, got, want)
		}
	}
	if v := expf(float32(math.NaN())); v == v {
		t.Errorf("expf(NaN) = %g", v)
	}
}

func TestExpBlock(t *testing.T) {
	src := make([]float32, 1001)
	for i := range src {
		src[i] = -90 + float32(i)*0.179
	}
	dst := make([]float32, len(src))
	for _, tc := range []struct{ scale, bias float32 }{{1, 0}, {-1, 0}, {0.125, -3}, {0.5, -30}} {
		sum := expBlock(dst, src, tc.scale, tc.bias)
		want := 0.0
		for i, x := range src {
			a := float64(min(max(x*tc.scale+tc.bias, -87.3), 88.3))
			e := math.Exp(a)
			want += e
			if a > -87 && math.Abs(float64(dst[i])-e)/e > 5e-7 {
				t.Fatalf("scale %g bias %g: exp(%g) = %g, want %g", tc.scale, tc.bias, a, dst[i], e)
			}
		}
		if want < math.MaxFloat32 && math.Abs(float64(sum)-want)/want > 1e-5 {
			t.Errorf("scale %g bias %g: sum %g, want %g", tc.scale, tc.bias, sum, want)
		}
	}
}

func BenchmarkExpBlock(b *testing.B) {
	x := make([]float32, 4096)
	for i := range x {
		x[i] = -float32(i) / 200
	}
	dst := make([]float32, len(x))
	for i := 0; i < b.N; i++ {
		expBlock(dst, x, 1, 0)
	}
	b.ReportMetric(float64(b.Elapsed().Nanoseconds())/float64(b.N*len(x)), "ns/exp")
}
