package tp

import (
	"fmt"
	"slices"

	"qtool/formats/model"
	"qtool/formats/shard"
	"qtool/runtime"
)

var _ runtime.Fused = (*Backend)(nil)

// The Backend implements runtime.Fused so that the forward pass hands it the
// decode step's fused sequences. Where every local rank backend fuses too
// (CUDA ranks) and the weights are split the way Megatron splits them, each
// rank runs the fused operation on its pieces: q/k/v and gate/up in one
// launch with the norm before them, the SwiGLU after them, RoPE and the
// KV store inside the attention (a decode row; inside the KV store for a
// prefill), and the residual add of o and down inside rank 0's partial
// product, before the all-reduce that adds the other ranks' (so the sum is
// (x + p₀) + p₁ + …, not x + (p₀ + p₁ + …)). Otherwise each method runs the
// sequence the runtime.Fused comment names (runtime.Unfused), which is what
// the forward pass runs on a backend without Fused, so CPU ranks give the
// same results bit for bit as before.

// rankFused returns rank r's backend as runtime.Fused (b.fused holds).
func (b *Backend) rankFused(r int) runtime.Fused { return b.ranks[r].(runtime.Fused) }

// allFused reports whether every local rank's backend implements
// runtime.Fused.
func allFused(ranks []runtime.Backend, local []int) bool {
	for _, r := range local {
		if _, ok := ranks[r].(runtime.Fused); !ok {
			return false
		}
	}
	return len(local) > 0
}

// columnLinears returns ws as the backend's linears when the ranks fuse and
// every weight is column-parallel (q, k, v, gate, up), with the shapes of
// dst and x checked as MatMul checks them; nil otherwise.
func (b *Backend) columnLinears(op string, dst []runtime.Buf, x runtime.Buf, ws []runtime.Linear) []*Linear {
	if !b.fused || len(dst) != len(ws) {
		return nil
	}
	s := rawBuf(x) // the shape alone
	ls := make([]*Linear, len(ws))
	for i, w := range ws {
		l, d := linearOf(w), bufOf(dst[i])
		if s.cols != l.in || d.cols != l.out || d.rows != s.rows {
			panic(fmt.Sprintf("tp.%s: x [%d %d], dst [%d %d], weight %s [%d %d]", op, s.rows, s.cols, d.rows, d.cols, l.name, l.out, l.in))
		}
		if l.split != shard.Column {
			return nil
		}
		ls[i] = l
	}
	return ls
}

// MatMulN implements runtime.Fused.
func (b *Backend) MatMulN(dst []runtime.Buf, x runtime.Buf, ws []runtime.Linear) {
	ls := b.columnLinears("MatMulN", dst, x, ws)
	if ls == nil {
		runtime.Unfused{Backend: b}.MatMulN(dst, x, ws)
		return
	}
	s := bufOf(x)
	b.replicate(s)
	b.fusedColumns(dst, ls, func(r int, parts []runtime.Buf, wp []runtime.Linear) {
		b.rankFused(r).MatMulN(parts, s.parts[r], wp)
	})
}

// NormMatMulN implements runtime.Fused.
func (b *Backend) NormMatMulN(dst []runtime.Buf, x runtime.Buf, w, bias runtime.Vector, eps float32, ws []runtime.Linear) {
	ls := b.columnLinears("NormMatMulN", dst, x, ws)
	if ls == nil {
		runtime.Unfused{Backend: b}.NormMatMulN(dst, x, w, bias, eps, ws)
		return
	}
	if s := rawBuf(x); s.seq == seqSent {
		gather := func(sc PeerScatterer, r int) bool {
			wp := make([]runtime.Linear, len(ls))
			for i, l := range ls {
				wp[i] = l.parts[r]
			}
			return sc.CanGather(wp, s.rows)
		}
		if ss := b.scatterAll(b.scatterers(), gather); ss != nil {
			wv, bv := b.replicatedVector("NormMatMulN", w, bias)
			b.fusedColumns(dst, ls, func(r int, parts []runtime.Buf, wp []runtime.Linear) {
				ss[r].ExchangeNorm(s.parts[r], wv.parts[r], bv.part(r), eps)
				ss[r].ProductsGathered(parts, wp)
			})
			b.leave(s, seqOwned)
			return
		}
	}
	s := bufOf(x)
	wv, bv := b.replicatedVector("NormMatMulN", w, bias)
	b.replicate(s)
	b.fusedColumns(dst, ls, func(r int, parts []runtime.Buf, wp []runtime.Linear) {
		b.rankFused(r).NormMatMulN(parts, s.parts[r], wv.parts[r], bv.part(r), eps, wp)
	})
}

// NormSwiGLU implements runtime.Fused.
func (b *Backend) NormSwiGLU(dst, x runtime.Buf, w, bias runtime.Vector, eps float32, gate, up runtime.Linear) {
	ls := b.columnLinears("NormSwiGLU", []runtime.Buf{dst, dst}, x, []runtime.Linear{gate, up})
	if ls == nil || !slices.Equal(ls[0].ranges, ls[1].ranges) {
		runtime.Unfused{Backend: b}.NormSwiGLU(dst, x, w, bias, eps, gate, up)
		return
	}
	d, s := bufOf(dst), bufOf(x)
	wv, bv := b.replicatedVector("NormSwiGLU", w, bias)
	b.replicate(s)
	b.run(d, ls[0].ranges, func(r int) {
		b.rankFused(r).NormSwiGLU(d.parts[r], s.parts[r], wv.parts[r], bv.part(r), eps, ls[0].parts[r], ls[1].parts[r])
	})
}

// MatMulAdd implements runtime.Fused: with a row-parallel weight on fusing
// ranks, rank 0 adds its partial product to the residual and the others
// overwrite their copy with theirs, and the all-reduce sums them; over peer
// memory each rank's product sends its partial sums to the all-reduce
// itself where its backend can (PeerSender: a decode row's GEMV, a
// prefill's Hopper GEMM).
func (b *Backend) MatMulAdd(dst, x runtime.Buf, w runtime.Linear) {
	d, s, l := bufOf(dst), bufOf(x), linearOf(w)
	if !b.fused || l.split != shard.Row {
		runtime.Unfused{Backend: b}.MatMulAdd(dst, x, w)
		return
	}
	if s.cols != l.in || d.cols != l.out || d.rows != s.rows {
		panic(fmt.Sprintf("tp.MatMulAdd: x [%d %d], dst [%d %d], weight %s [%d %d]", s.rows, s.cols, d.rows, d.cols, l.name, l.out, l.in))
	}
	b.toSplit(s, l.ranges)
	b.replicate(d)
	if n := d.rows * d.cols; n > 0 && b.PeerMemory(n) && !b.skipComm {
		// the ranks may choose differently: the values cross in the same words
		b.each(func(r int) { b.sumPeer(r, d.parts[r], s.parts[r], l.parts[r]) })
		return
	}
	b.each(func(r int) { b.partial(r, d.parts[r], s.parts[r], l.parts[r]) })
	b.allReduce(d)
}

// partial queues rank r's partial product of a row-parallel weight (its
// piece w, its columns x of the input): dst += x·wᵀ on rank 0 (the
// residual add), dst = x·wᵀ on the others.
func (b *Backend) partial(r int, dst, x runtime.Buf, w runtime.Linear) {
	if r == 0 {
		b.rankFused(r).MatMulAdd(dst, x, w)
	} else {
		b.ranks[r].MatMul(dst, x, w)
	}
}

// sumPeer is rank r's share of a row-parallel product over peer memory
// (rank r's pieces): partial, then summed over the ranks, sent by the
// product itself where the backend can (PeerSender), else by AllReducePeer.
func (b *Backend) sumPeer(r int, dst, x runtime.Buf, w runtime.Linear) {
	if ps, ok := b.peer[r].(PeerSender); ok && ps.MatMulAllReduce(dst, x, w, r == 0) {
		return
	}
	b.partial(r, dst, x, w)
	b.peer[r].AllReducePeer(dst)
}

// PeerSender is a PeerRank whose products can send their values straight
// to the all-reduce (the CUDA backend's: a decode row's GEMV, a prefill's
// Hopper GEMM), alone or at the end of a block.
type PeerSender interface {
	// MatMulAllReduce queues dst = x·Wᵀ (dst + x·Wᵀ where add is set)
	// summed over the group, or returns false with nothing queued where
	// it cannot (the caller then runs the product and AllReducePeer).
	MatMulAllReduce(dst, x runtime.Buf, w runtime.Linear, add bool) bool
	// MLPAllReduce is MLP's block on x (NormSwiGLU, then down's
	// product) with down's products summed over the group as
	// MatMulAllReduce sums them (x's own value kept where add is set), or
	// false and nothing queued where it cannot (then NormSwiGLU and
	// MatMulAllReduce).
	MLPAllReduce(x runtime.Buf, w, bias runtime.Vector, eps float32, gate, up, down runtime.Linear, add bool) bool
	// AttentionAllReduce is AttentionAdd's block (the attention of q,
	// then o's product added to x) with o's products summed over the
	// group likewise, or false and nothing queued where it cannot (then
	// Attention and MatMulAllReduce).
	AttentionAllReduce(x, q runtime.Buf, c runtime.KVCache, layer, pos0, heads, kvHeads, headDim int, o runtime.Linear, add bool) bool
}

// NormMatMulStoreKV implements runtime.Fused as its sequence: the group's
// NormMatMulN, then its RoPEStoreKV.
func (b *Backend) NormMatMulStoreKV(qkv []runtime.Buf, x runtime.Buf, w, bias runtime.Vector, eps float32, ws []runtime.Linear, kv runtime.RoPEKV) {
	runtime.NormMatMulStoreKVSeq(b, qkv, x, w, bias, eps, ws, kv)
}

// RoPEStoreKV implements runtime.Fused: each rank rotates its heads of q
// and k and stores its KV heads.
func (b *Backend) RoPEStoreKV(c runtime.KVCache, layer, pos0 int, q, k, v runtime.Buf, headDim int, theta float64, layout model.RopeLayout) {
	if !b.fused {
		runtime.Unfused{Backend: b}.RoPEStoreKV(c, layer, pos0, q, k, v, headDim, theta, layout)
		return
	}
	kc, qb, kb, vb := cacheOf(c), bufOf(q), bufOf(k), bufOf(v)
	n := len(b.ranks)
	if b.cfg.Heads%n != 0 || b.cfg.QDim() != qb.cols {
		panic(fmt.Sprintf("tp.RoPEStoreKV: q of %d columns, %d heads over %d ranks", qb.cols, b.cfg.Heads, n))
	}
	b.toSplit(qb, headSplit(qb.cols, n))
	b.toSplit(kb, b.kv)
	b.toSplit(vb, b.kv)
	b.each(func(r int) {
		b.rankFused(r).RoPEStoreKV(kc.parts[r], layer, pos0, qb.parts[r], kb.parts[r], vb.parts[r], headDim, theta, layout)
	})
}

// headSplit is the column split of q by heads over n ranks: rank r holds
// columns [r·cols/n, (r+1)·cols/n), as Attention takes it.
func headSplit(cols, n int) [][2]int {
	split := make([][2]int, n)
	per := cols / n
	for r := range split {
		split[r] = [2]int{r * per, (r + 1) * per}
	}
	return split
}

// fusedColumns lays out each dst[i] as weight i's column pieces and runs fn
// on every rank with its pieces of the outputs and weights.
func (b *Backend) fusedColumns(dst []runtime.Buf, ls []*Linear, fn func(r int, parts []runtime.Buf, wp []runtime.Linear)) {
	ds := make([]*Buf, len(dst))
	for i := range dst {
		ds[i] = bufOf(dst[i])
		b.layout(ds[i], ls[i].ranges)
	}
	b.each(func(r int) {
		parts := make([]runtime.Buf, len(ds))
		wp := make([]runtime.Linear, len(ls))
		for i := range ds {
			parts[i], wp[i] = ds[i].parts[r], ls[i].parts[r]
		}
		fn(r, parts, wp)
	})
}

// replicatedVector checks that a norm's weight and bias are replicated
// vectors, as RMSNorm needs them.
func (b *Backend) replicatedVector(op string, w, bias runtime.Vector) (*vector, *vector) {
	wv, bv := vectorOf(w), vectorOf(bias)
	if wv == nil || wv.split != nil || (bv != nil && bv.split != nil) {
		panic("tp." + op + ": norm weight and bias must be replicated vectors")
	}
	return wv, bv
}

// AttentionAdd implements runtime.Fused: Attention, then MatMulAdd (each
// on the ranks' pieces as above); over peer memory, with a prefill's rows
// and o split as the heads are, each rank runs the block as one call that
// ends in o's sending product (PeerSender's AttentionAllReduce: o reads
// the attention in the form the attention writes for it, without a
// conversion of its own).
func (b *Backend) AttentionAdd(x, q runtime.Buf, c runtime.KVCache, layer, pos0, heads, kvHeads, headDim int, o runtime.Linear) {
	d, s, kc, l := rawBuf(x), bufOf(q), cacheOf(c), linearOf(o)
	n := len(b.ranks)
	if !b.fused || s.rows <= 1 || l.split != shard.Row || heads%n != 0 || kvHeads%n != 0 ||
		!slices.Equal(l.ranges, headSplit(s.cols, n)) || l.in != s.cols || l.out != d.cols || d.rows != s.rows ||
		!b.PeerMemory(d.rows*d.cols) || b.skipComm {
		runtime.AttentionAddSeq(b, x, q, c, layer, pos0, heads, kvHeads, headDim, o)
		return
	}
	split := b.splitHeads("tp.AttentionAdd", s, heads, kvHeads, headDim)
	// sequence-parallel: x whole or owned by rows, its partials sent to the rows' owners
	if d.seq != seqSent && d.parts != nil && d.split == nil {
		scatter := func(sc PeerScatterer, r int) bool { return sc.CanScatter(l.parts[r], s.rows) }
		if ss := b.scatterAll(b.scatterers(), scatter); ss != nil {
			b.settleSplit(d)
			b.each(func(r int) {
				ss[r].AttentionScatter(d.parts[r], s.parts[r], kc.parts[r], layer, pos0, heads/n, kvHeads/n, headDim, l.parts[r])
			})
			b.leave(d, seqSent)
			return
		}
	}
	d = bufOf(x)
	b.replicate(d) // (settles any other split buffer)
	b.each(func(r int) {
		dr, qr, cr, or := d.parts[r], s.parts[r], kc.parts[r], l.parts[r]
		if ps, ok := b.peer[r].(PeerSender); ok && ps.AttentionAllReduce(dr, qr, cr, layer, pos0, heads/n, kvHeads/n, headDim, or, r == 0) {
			return
		}
		a := runtime.AllocRaw(b.ranks[r], s.rows, split[r][1]-split[r][0])
		b.ranks[r].Attention(a, qr, cr, layer, pos0, heads/n, kvHeads/n, headDim)
		b.sumPeer(r, dr, a, or)
		b.ranks[r].Free(a)
	})
}

// RoPEAttention implements runtime.Fused: each rank rotates its heads of q
// and k, stores its KV heads and attends with its heads (in one launch
// where its backend can).
func (b *Backend) RoPEAttention(dst, q, k, v runtime.Buf, c runtime.KVCache, layer, pos0, heads, kvHeads, headDim int, theta float64, layout model.RopeLayout) {
	if !b.fused {
		runtime.Unfused{Backend: b}.RoPEAttention(dst, q, k, v, c, layer, pos0, heads, kvHeads, headDim, theta, layout)
		return
	}
	n := len(b.ranks)
	d, qb, kb, vb, kc := bufOf(dst), bufOf(q), bufOf(k), bufOf(v), cacheOf(c)
	split := b.splitHeads("tp.RoPEAttention", qb, heads, kvHeads, headDim)
	b.toSplit(kb, b.kv)
	b.toSplit(vb, b.kv)
	b.run(d, split, func(r int) {
		b.rankFused(r).RoPEAttention(d.parts[r], qb.parts[r], kb.parts[r], vb.parts[r], kc.parts[r], layer, pos0, heads/n, kvHeads/n, headDim, theta, layout)
	})
}

// MLP implements runtime.Fused: NormSwiGLU, then MatMulAdd (each on the
// ranks' pieces as above); over peer memory, with a prefill's rows, each
// rank runs the block as one call that ends in down's sending product
// (PeerSender's MLPAllReduce: down reads the SwiGLU in the fp16 form the
// gate and up GEMM writes where that GEMM can, without a conversion of its
// own).
func (b *Backend) MLP(x runtime.Buf, w, bias runtime.Vector, eps float32, gate, up, down runtime.Linear) {
	s, gl, ul, dl := rawBuf(x), linearOf(gate), linearOf(up), linearOf(down)
	n := s.rows * s.cols
	if !b.fused || s.rows <= 1 || gl.split != shard.Column || ul.split != shard.Column || dl.split != shard.Row ||
		!slices.Equal(gl.ranges, ul.ranges) || !slices.Equal(gl.ranges, dl.ranges) ||
		s.cols != gl.in || gl.in != ul.in || gl.out != ul.out || dl.in != gl.out || dl.out != s.cols ||
		!b.PeerMemory(n) || b.skipComm {
		runtime.MLPSeq(b, x, w, bias, eps, gate, up, down)
		return
	}
	wv, bv := b.replicatedVector("MLP", w, bias)
	// sequence-parallel: o's partials sent to the rows' owners, down's sent likewise
	if s.seq == seqSent {
		scatter := func(sc PeerScatterer, r int) bool {
			return sc.CanGather([]runtime.Linear{gl.parts[r], ul.parts[r]}, s.rows) && sc.CanScatter(dl.parts[r], s.rows)
		}
		if ss := b.scatterAll(b.scatterers(), scatter); ss != nil {
			b.each(func(r int) {
				ss[r].ExchangeNorm(s.parts[r], wv.parts[r], bv.part(r), eps)
				ss[r].MLPScatter(s.parts[r], gl.parts[r], ul.parts[r], dl.parts[r])
			})
			b.leave(s, seqSent) // down's partials
			return
		}
	}
	s = bufOf(x)
	b.replicate(s)
	b.each(func(r int) {
		xr, wr, br, gr, ur, dr := s.parts[r], wv.parts[r], bv.part(r), gl.parts[r], ul.parts[r], dl.parts[r]
		if ps, ok := b.peer[r].(PeerSender); ok && ps.MLPAllReduce(xr, wr, br, eps, gr, ur, dr, r == 0) {
			return
		}
		g := runtime.AllocRaw(b.ranks[r], s.rows, gr.Out())
		b.rankFused(r).NormSwiGLU(g, xr, wr, br, eps, gr, ur)
		b.sumPeer(r, xr, g, dr)
		b.ranks[r].Free(g)
	})
}
