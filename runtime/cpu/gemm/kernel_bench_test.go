package gemm

import (
	"fmt"
	"testing"
)

// BenchmarkKernel measures the micro-kernels alone on L1-resident panels.
func BenchmarkKernel(b *testing.B) {
	for _, im := range impls() {
		b.Run(im.name, func(b *testing.B) {
			kc := 256
			ap := make([]float32, kc*im.mr)
			bp := make([]float32, kc*im.nr)
			c := make([]float32, im.mr*im.nr)
			for b.Loop() {
				im.kernel(kc, ap, kc, bp, c, im.nr, true)
			}
			b.ReportMetric(2*float64(kc*im.mr*im.nr)*float64(b.N)/b.Elapsed().Seconds()/1e9, "GFLOP/s")
		})
	}
}

// BenchmarkPack measures packing a 512×256 block into panels.
func BenchmarkPack(b *testing.B) {
	for _, w := range []int{12, 32} {
		b.Run(fmt.Sprint(w), func(b *testing.B) {
			rows, kn := 512, 256
			src := make([]float32, rows*kn)
			dst := make([]float32, (rows+w)*kn)
			for b.Loop() {
				packPanels(dst, src, kn, rows, kn, w)
			}
			b.ReportMetric(float64(rows*kn)*float64(b.N)/b.Elapsed().Seconds()/1e9, "Gelem/s")
		})
	}
}
