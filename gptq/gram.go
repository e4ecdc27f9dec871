package gptq

import (
	"fmt"
	"sync"

	"qtool/runtime/cpu/gemm"
)

// gramChunk is the number of tokens transposed and multiplied at a time.
const gramChunk = 2048

// AddBatch accumulates the rows of x ([rows, Cols]) like Add, computing
// Xᵀ·X with the packed GEMM kernels on threads goroutines.
func (h *Hessian) AddBatch(x []float32, rows, threads int) error {
	n := h.Cols
	if len(x) != rows*n {
		return fmt.Errorf("gptq: %d activation values for %d rows × %d columns", len(x), rows, n)
	}
	threads = max(threads, 1)
	xt := make([]float32, n*min(rows, gramChunk))
	g := make([]float32, n*n)
	for r0 := 0; r0 < rows; r0 += gramChunk {
		r1 := min(r0+gramChunk, rows)
		k := r1 - r0
		if err := transposeChecked(xt[:n*k], x[r0*n:r1*n], k, n, r0, threads); err != nil {
			return err
		}
		gemm.MatMulNT(n, n, k, xt, k, xt, k, g, n, false, threads)
		if err := h.AddGram(g, k); err != nil {
			return err
		}
	}
	return nil
}

// transposeChecked writes dst[c*rows+t] = src[t*cols+c] in cache-sized
// tiles on threads goroutines, failing on the first non-finite value (row0
// offsets the token index in the message).
func transposeChecked(dst, src []float32, rows, cols, row0, threads int) error {
	const tile = 32
	errs := make([]error, threads)
	var wg sync.WaitGroup
	for w := 0; w < threads; w++ {
		t0, t1 := w*rows/threads, (w+1)*rows/threads
		wg.Add(1)
		go func() {
			defer wg.Done()
			for tt := t0; tt < t1; tt += tile {
				te := min(tt+tile, t1)
				if err := checkFinite32(src[tt*cols:te*cols], cols); err != nil {
					errs[w] = fmt.Errorf("%w (calibration row %d)", err, row0+tt)
					return
				}
				for cc := 0; cc < cols; cc += tile {
					ce := min(cc+tile, cols)
					for t := tt; t < te; t++ {
						row := src[t*cols : (t+1)*cols]
						for c := cc; c < ce; c++ {
							dst[c*rows+t] = row[c]
						}
					}
				}
			}
		}()
	}
	wg.Wait()
	for _, e := range errs {
		if e != nil {
			return e
		}
	}
	return nil
}
