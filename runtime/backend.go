// Package runtime is qtool's bundled inference engine: one forward pass for
// the Llama/Qwen families written once over the Backend interface. The CPU
// backend (runtime/cpu) is pure Go; the CUDA backend (runtime/cuda) drives a
// GPU through the driver API. Model.Layer is composed of blocks (AttnNorm,
// Attention, Project, MLPNorm, MLPHidden) that take weight overrides;
// calibration (GPTQ, AWQ, SmoothQuant, package quantize/calib) drives those
// same blocks on any backend that is a Calibrator, so it has no forward
// pass of its own.
package runtime

import "qtool/formats/model"

// Buf is a backend-resident activation matrix [Rows, Cols], row-major.
// Values have float32 semantics; a device backend may store a narrower type.
type Buf interface {
	Rows() int
	Cols() int
}

// Linear is a weight [Out, In] uploaded to a backend in its stored form:
// float (F32/F16/BF16), *model.Quantized (int8 per-group, int4/int3
// asymmetric, msmodelslim W8A16 with offsets) or *model.W8A8. A backend never
// keeps a pre-dequantized float copy of a quantized weight.
type Linear interface {
	Out() int
	In() int
}

// Vector is an uploaded float vector (norm weights, biases).
type Vector interface {
	Len() int
}

// KVCache holds keys and values of every layer for up to MaxSeq positions.
type KVCache interface {
	MaxSeq() int
}

// Backend executes the operations of the forward pass. Methods panic only on
// programmer errors (mismatched shapes); data errors are returned by the
// Upload* methods. Unless noted, dst must not alias an input.
type Backend interface {
	// Name is "cpu" or "cuda" (with device details after a colon if wanted).
	Name() string
	Close() error

	// UploadLinear uploads a linear weight (or embedding table) keeping its
	// quantized form; it returns an error naming the scheme when the
	// backend cannot run it.
	UploadLinear(name string, t model.Tensor) (Linear, error)
	// UploadVector uploads a 1-D float tensor.
	UploadVector(name string, t model.Tensor) (Vector, error)

	// Alloc returns a zeroed [rows, cols] activation buffer.
	Alloc(rows, cols int) Buf
	// Free releases b; it must not be used afterwards.
	Free(b Buf)
	// Upload copies src (rows*cols values) into dst.
	Upload(dst Buf, src []float32)
	// Download copies src into dst (rows*cols values).
	Download(dst []float32, src Buf)
	// NewKVCache allocates a cache for layers × maxSeq positions of kvDim
	// keys and values.
	NewKVCache(layers, maxSeq, kvDim int) KVCache

	// Embed gathers rows ids of table into dst [len(ids), table.In()].
	Embed(dst Buf, table Linear, ids []int)
	// RMSNorm normalizes every row of x with weight w (and adds bias when
	// not nil, for SmoothQuant-folded norms). dst may alias x.
	RMSNorm(dst, x Buf, w, bias Vector, eps float32)
	// RMSNormHeads normalizes each headDim-wide slice of every row of x in
	// place with the shared weight w (Qwen3 q_norm/k_norm).
	RMSNormHeads(x Buf, headDim int, w Vector, eps float32)
	// MatMul computes dst[T, Out] = x[T, In] · Wᵀ.
	MatMul(dst, x Buf, w Linear)
	// AddBias adds b to every row of x in place.
	AddBias(x Buf, b Vector)
	// RoPE rotates x in place: row i is at position pos0+i and holds
	// Cols/headDim heads.
	RoPE(x Buf, headDim, pos0 int, theta float64, layout model.RopeLayout)
	// StoreKV writes k and v (rows = positions pos0..) into the cache of layer.
	StoreKV(c KVCache, layer, pos0 int, k, v Buf)
	// Attention computes causal grouped-query attention of q (rows =
	// positions pos0.., heads×headDim columns) over cache positions
	// 0..pos0+row, writing dst [T, heads×headDim].
	Attention(dst, q Buf, c KVCache, layer, pos0, heads, kvHeads, headDim int)
	// SiLUMul sets dst = silu(gate) * up elementwise. dst may alias gate.
	SiLUMul(dst, gate, up Buf)
	// Add sets dst += x elementwise.
	Add(dst, x Buf)

	// NLL writes −log softmax(logits[i])[targets[i]] for each row i into
	// out, computed in at least float32 with a float64-safe reduction.
	NLL(out []float64, logits Buf, targets []int)
	// Argmax returns the index of the largest logit of each row.
	Argmax(logits Buf) []int
}

// Fused is implemented by backends that run some sequences of the forward
// pass's operations as one kernel (the CUDA backend). The forward pass calls
// each method in place of the sequence its comment names; the results are
// those of the sequence up to float32 rounding (a fused kernel may sum in
// another order).
type Fused interface {
	// MatMulN sets dst[i] = x·ws[i]ᵀ for every i: the products that share
	// their input (q, k and v; gate and up). No dst may alias x.
	MatMulN(dst []Buf, x Buf, ws []Linear)
	// NormMatMulN is RMSNorm(h, x, w, bias, eps) then MatMulN(dst, h, ws)
	// with h a temporary.
	NormMatMulN(dst []Buf, x Buf, w, bias Vector, eps float32, ws []Linear)
	// NormSwiGLU is RMSNorm(h, x, w, bias, eps), g = h·gateᵀ, u = h·upᵀ,
	// SiLUMul(dst, g, u) with h, g and u temporaries.
	NormSwiGLU(dst, x Buf, w, bias Vector, eps float32, gate, up Linear)
	// MatMulAdd is dst += x·wᵀ: MatMul into a temporary, then Add.
	MatMulAdd(dst, x Buf, w Linear)
	// RoPEStoreKV is RoPE(q, …), RoPE(k, …), then StoreKV(c, layer, pos0,
	// k, v): q and k are left rotated.
	RoPEStoreKV(c KVCache, layer, pos0 int, q, k, v Buf, headDim int, theta float64, layout model.RopeLayout)
	// NormMatMulStoreKV is NormMatMulN(qkv, x, w, bias, eps, ws) then
	// RoPEStoreKV(kv.Cache, kv.Layer, kv.Pos0, q, k, v, kv.HeadDim,
	// kv.Theta, kv.Layout) with q, k, v = qkv: a prefill's attention input
	// where the products need no finishing (no biases or head norms after
	// them). q is left rotated; k and v may be left unwritten.
	NormMatMulStoreKV(qkv []Buf, x Buf, w, bias Vector, eps float32, ws []Linear, kv RoPEKV)
	// AttentionAdd is Attention(a, q, c, layer, pos0, heads, kvHeads,
	// headDim) then MatMulAdd(x, a, o) with a a temporary: the attention
	// output o's input alone.
	AttentionAdd(x, q Buf, c KVCache, layer, pos0, heads, kvHeads, headDim int, o Linear)
	// RoPEAttention is RoPEStoreKV(c, layer, pos0, q, k, v, headDim,
	// theta, layout) then Attention(dst, q, c, layer, pos0, heads,
	// kvHeads, headDim): a decode step's attention from the q, k and v
	// products on, which it leaves rotated or not.
	RoPEAttention(dst, q, k, v Buf, c KVCache, layer, pos0, heads, kvHeads, headDim int, theta float64, layout model.RopeLayout)
	// MLP is NormSwiGLU(g, x, w, bias, eps, gate, up) then
	// MatMulAdd(x, g, down) with g a temporary: the MLP block on the
	// residual x, the SwiGLU's result down's input alone.
	MLP(x Buf, w, bias Vector, eps float32, gate, up, down Linear)
}

// RawAllocator is implemented by backends that can hand out an activation
// buffer without zeroing it first (on a GPU, a memset as long as the buffer
// ahead of every operation that writes one). The forward pass takes its
// activations from it (AllocRaw): each is written whole by the operation it
// is made for before anything reads it.
type RawAllocator interface {
	// AllocRaw is Alloc without the zeroing: the contents are undefined.
	AllocRaw(rows, cols int) Buf
}

// RowCopier is implemented by backends that copy rows between their own
// buffers (cpu, cuda, tp): taking some rows of an activation (the rows a
// perplexity chunk scores, a prompt's last row) then stays on the device
// instead of a round trip through host memory.
type RowCopier interface {
	// CopyRows copies n rows of src from srcRow into dst from dstRow
	// (same number of columns).
	CopyRows(dst Buf, dstRow int, src Buf, srcRow, n int)
}

// AllocRaw is be's AllocRaw where it has one, else Alloc: for a buffer
// that its first writer writes whole before anything reads it.
func AllocRaw(be Backend, rows, cols int) Buf {
	if r, ok := be.(RawAllocator); ok {
		return r.AllocRaw(rows, cols)
	}
	return be.Alloc(rows, cols)
}

// Unfused runs each Fused operation as the sequence its comment names, with
// the Backend's plain operations: the forward pass's path on a backend that
// does not fuse, and the fallback of one that fuses only some cases.
type Unfused struct{ Backend }

var _ Fused = Unfused{}

// MatMulN implements Fused: one MatMul a weight.
func (u Unfused) MatMulN(dst []Buf, x Buf, ws []Linear) {
	for i, w := range ws {
		u.MatMul(dst[i], x, w)
	}
}

// NormMatMulN implements Fused.
func (u Unfused) NormMatMulN(dst []Buf, x Buf, w, bias Vector, eps float32, ws []Linear) {
	h := AllocRaw(u.Backend, x.Rows(), x.Cols())
	u.RMSNorm(h, x, w, bias, eps)
	u.MatMulN(dst, h, ws)
	u.Free(h)
}

// NormSwiGLU implements Fused, with dst as the gate's temporary.
func (u Unfused) NormSwiGLU(dst, x Buf, w, bias Vector, eps float32, gate, up Linear) {
	h := AllocRaw(u.Backend, x.Rows(), x.Cols())
	u.RMSNorm(h, x, w, bias, eps)
	t := AllocRaw(u.Backend, dst.Rows(), dst.Cols())
	u.MatMul(dst, h, gate)
	u.MatMul(t, h, up)
	u.SiLUMul(dst, dst, t)
	u.Free(t)
	u.Free(h)
}

// MatMulAdd implements Fused.
func (u Unfused) MatMulAdd(dst, x Buf, w Linear) {
	t := AllocRaw(u.Backend, dst.Rows(), dst.Cols())
	u.MatMul(t, x, w)
	u.Add(dst, t)
	u.Free(t)
}

// RoPEStoreKV implements Fused.
func (u Unfused) RoPEStoreKV(c KVCache, layer, pos0 int, q, k, v Buf, headDim int, theta float64, layout model.RopeLayout) {
	u.RoPE(q, headDim, pos0, theta, layout)
	u.RoPE(k, headDim, pos0, theta, layout)
	u.StoreKV(c, layer, pos0, k, v)
}

// NormMatMulStoreKV implements Fused.
func (u Unfused) NormMatMulStoreKV(qkv []Buf, x Buf, w, bias Vector, eps float32, ws []Linear, kv RoPEKV) {
	NormMatMulStoreKVSeq(u, qkv, x, w, bias, eps, ws, kv)
}

// AttentionAdd implements Fused.
func (u Unfused) AttentionAdd(x, q Buf, c KVCache, layer, pos0, heads, kvHeads, headDim int, o Linear) {
	AttentionAddSeq(u, x, q, c, layer, pos0, heads, kvHeads, headDim, o)
}

// RoPEAttention implements Fused.
func (u Unfused) RoPEAttention(dst, q, k, v Buf, c KVCache, layer, pos0, heads, kvHeads, headDim int, theta float64, layout model.RopeLayout) {
	RoPEAttentionSeq(u, dst, q, k, v, c, layer, pos0, heads, kvHeads, headDim, theta, layout)
}

// MLP implements Fused.
func (u Unfused) MLP(x Buf, w, bias Vector, eps float32, gate, up, down Linear) {
	MLPSeq(u, x, w, bias, eps, gate, up, down)
}

// FusedBackend is a Backend with its Fused operations (Unfused, or a
// backend that fuses).
type FusedBackend interface {
	Backend
	Fused
}

// AttentionAddSeq runs Fused.AttentionAdd as the sequence its comment
// names, on f's Attention and MatMulAdd.
func AttentionAddSeq(f FusedBackend, x, q Buf, c KVCache, layer, pos0, heads, kvHeads, headDim int, o Linear) {
	a := AllocRaw(f, q.Rows(), q.Cols())
	f.Attention(a, q, c, layer, pos0, heads, kvHeads, headDim)
	f.MatMulAdd(x, a, o)
	f.Free(a)
}

// RoPEKV is where NormMatMulStoreKV rotates and stores the keys and values:
// layer Layer of Cache from position Pos0, heads of HeadDim values rotated
// with Theta in Layout.
type RoPEKV struct {
	Cache       KVCache
	Layer, Pos0 int
	HeadDim     int
	Theta       float64
	Layout      model.RopeLayout
}

// NormMatMulStoreKVSeq runs Fused.NormMatMulStoreKV as the sequence its
// comment names, on f's NormMatMulN and RoPEStoreKV.
func NormMatMulStoreKVSeq(f FusedBackend, qkv []Buf, x Buf, w, bias Vector, eps float32, ws []Linear, kv RoPEKV) {
	f.NormMatMulN(qkv, x, w, bias, eps, ws)
	f.RoPEStoreKV(kv.Cache, kv.Layer, kv.Pos0, qkv[0], qkv[1], qkv[2], kv.HeadDim, kv.Theta, kv.Layout)
}

// RoPEAttentionSeq runs Fused.RoPEAttention as the sequence its comment
// names, on f's RoPEStoreKV and Attention.
func RoPEAttentionSeq(f FusedBackend, dst, q, k, v Buf, c KVCache, layer, pos0, heads, kvHeads, headDim int, theta float64, layout model.RopeLayout) {
	f.RoPEStoreKV(c, layer, pos0, q, k, v, headDim, theta, layout)
	f.Attention(dst, q, c, layer, pos0, heads, kvHeads, headDim)
}

// MLPSeq runs Fused.MLP as the sequence its comment names, on f's
// NormSwiGLU and MatMulAdd: for a backend that fuses those but not the
// whole block.
func MLPSeq(f FusedBackend, x Buf, w, bias Vector, eps float32, gate, up, down Linear) {
	g := AllocRaw(f, x.Rows(), gate.Out())
	f.NormSwiGLU(g, x, w, bias, eps, gate, up)
	f.MatMulAdd(x, g, down)
	f.Free(g)
}
