package cpu

import (
	"fmt"
	"math"

	"qtool/formats/model"
	"qtool/runtime"
	"qtool/runtime/cpu/gemm"
)

// ropeKey identifies a table of rotary angles.
type ropeKey struct {
	theta   float64
	headDim int
}

// ropeTable holds cos and sin of position·inv_freq[j], [pos][headDim/2].
type ropeTable struct {
	n        int // positions covered
	cos, sin []float32
}

// ropeFor returns a table covering at least n positions, computed the way
// Hugging Face does (inv_freq and the angles in float32).
func (b *Backend) ropeFor(theta float64, headDim, n int) *ropeTable {
	key := ropeKey{theta, headDim}
	b.mu.Lock()
	defer b.mu.Unlock()
	if t := b.rope[key]; t != nil && t.n >= n {
		return t
	}
	n = max(n, 2048)
	half := headDim / 2
	inv := make([]float32, half)
	for j := range inv {
		e := float32(2*j) / float32(headDim)
		inv[j] = float32(1 / float64(float32(math.Pow(theta, float64(e)))))
	}
	t := &ropeTable{n: n, cos: make([]float32, n*half), sin: make([]float32, n*half)}
	for p := 0; p < n; p++ {
		for j, f := range inv {
			a := float64(float32(p) * f)
			t.cos[p*half+j] = float32(math.Cos(a))
			t.sin[p*half+j] = float32(math.Sin(a))
		}
	}
	b.rope[key] = t
	return t
}

// RoPE implements runtime.Backend.
func (b *Backend) RoPE(x runtime.Buf, headDim, pos0 int, theta float64, layout model.RopeLayout) {
	s := mat(x)
	if headDim <= 0 || headDim%2 != 0 || s.cols%headDim != 0 {
		panic(fmt.Sprintf("cpu.RoPE: %d columns, head dim %d", s.cols, headDim))
	}
	t := b.ropeFor(theta, headDim, pos0+s.rows)
	half := headDim / 2
	heads := s.cols / headDim
	parallel(s.rows, b.threads, 64, func(lo, hi int) {
		for r := lo; r < hi; r++ {
			p := pos0 + r
			cs, sn := t.cos[p*half:(p+1)*half], t.sin[p*half:(p+1)*half]
			for h := 0; h < heads; h++ {
				v := s.Data[r*s.cols+h*headDim : r*s.cols+(h+1)*headDim]
				if layout == model.RopeInterleaved {
					for j := 0; j < half; j++ {
						x0, x1 := v[2*j], v[2*j+1]
						v[2*j] = x0*cs[j] - x1*sn[j]
						v[2*j+1] = x1*cs[j] + x0*sn[j]
					}
					continue
				}
				for j := 0; j < half; j++ {
					x0, x1 := v[j], v[j+half]
					v[j] = x0*cs[j] - x1*sn[j]
					v[j+half] = x1*cs[j] + x0*sn[j]
				}
			}
		}
	})
}

// attnBlock is the number of query rows processed together: each block
// only visits the key positions it can see, which skips most of the
// masked half of a causal prefill.
const attnBlock = 64

// Attention implements runtime.Backend: per head and block of query rows,
// scores = q·Kᵀ/√d over the visible cached positions (GEMM), causal softmax
// (normalized after the product), then P·V (GEMM against the transposed
// values). Work items run in parallel.
func (b *Backend) Attention(dst, q runtime.Buf, c runtime.KVCache, layer, pos0, heads, kvHeads, headDim int) {
	d, qm := mat(dst), mat(q)
	kc := cacheOf(c)
	T := qm.rows
	qdim := heads * headDim
	if qm.cols != qdim || d.cols != qdim || d.rows != T || kvHeads <= 0 || heads%kvHeads != 0 || kvHeads*headDim != kc.kvDim {
		panic(fmt.Sprintf("cpu.Attention: q [%d %d], dst [%d %d], %d heads, %d kv heads × %d, cache kv dim %d",
			qm.rows, qm.cols, d.rows, d.cols, heads, kvHeads, headDim, kc.kvDim))
	}
	S := pos0 + T
	if pos0 < 0 || S > kc.maxSeq {
		panic(fmt.Sprintf("cpu.Attention: positions %d..%d outside the cache of %d", pos0, S-1, kc.maxSeq))
	}
	if T == 0 {
		return
	}
	K, V, done := b.layerKV(kc, layer, S)
	defer done()
	kvDim := kc.kvDim
	group := heads / kvHeads
	scale := float32(1 / math.Sqrt(float64(headDim)))

	// Values transposed per KV head: vt[g][e*S+p] = V[p][g*headDim+e].
	vt := b.get(kvHeads * headDim * S)
	defer b.put(vt)
	parallel(kvHeads*headDim, b.threads, 16, func(lo, hi int) {
		for ge := lo; ge < hi; ge++ {
			dstRow := vt[ge*S : (ge+1)*S]
			for p := range dstRow {
				dstRow[p] = V[p*kvDim+ge]
			}
		}
	})
	blocks := (T + attnBlock - 1) / attnBlock
	parallel(heads*blocks, b.threads, 1, func(lo, hi int) {
		scores := b.get(min(attnBlock, T) * S)
		defer b.put(scores)
		var inv [attnBlock]float32
		for item := lo; item < hi; item++ {
			h, blk := item/blocks, item%blocks
			g := h / group
			i0 := blk * attnBlock
			i1 := min(i0+attnBlock, T)
			tb, sb := i1-i0, pos0+i1
			gemm.MatMulNT(tb, sb, headDim, qm.Data[i0*qdim+h*headDim:], qdim, K[g*headDim:], kvDim, scores, sb, false, 1)
			for i := 0; i < tb; i++ {
				row := scores[i*sb : (i+1)*sb]
				n := pos0 + i0 + i + 1
				inv[i] = softmaxExp(row[:n], scale)
				clear(row[n:])
			}
			out := d.Data[i0*qdim+h*headDim:]
			gemm.MatMulNT(tb, headDim, sb, scores, sb, vt[g*headDim*S:], S, out, qdim, false, 1)
			for i := 0; i < tb; i++ {
				o := out[i*qdim : i*qdim+headDim]
				for e := range o {
					o[e] *= inv[i]
				}
			}
		}
	})
}

// softmaxExp replaces row by exp(row·scale − max(row)·scale), scale > 0,
// and returns 1/Σ: the softmax without its normalization.
func softmaxExp(row []float32, scale float32) float32 {
	mx := maxOf(row)
	return 1 / expBlock(row, row, scale, -mx*scale)
}

// maxOf returns the largest value of a non-empty slice (NaNs are skipped
// unless they come first).
func maxOf(v []float32) float32 {
	m0, m1, m2, m3 := v[0], v[0], v[0], v[0]
	i := 0
	for ; i+4 <= len(v); i += 4 {
		if v[i] > m0 {
			m0 = v[i]
		}
		if v[i+1] > m1 {
			m1 = v[i+1]
		}
		if v[i+2] > m2 {
			m2 = v[i+2]
		}
		if v[i+3] > m3 {
			m3 = v[i+3]
		}
	}
	for ; i < len(v); i++ {
		if v[i] > m0 {
			m0 = v[i]
		}
	}
	if m1 > m0 {
		m0 = m1
	}
	if m3 > m2 {
		m2 = m3
	}
	if m2 > m0 {
		m0 = m2
	}
	return m0
}
