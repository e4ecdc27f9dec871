package tp

import (
	"sync/atomic"
	"testing"

	"qtool/formats/model"
	"qtool/runtime"
	"qtool/runtime/cpu"
)

// fusingCPU is a CPU backend that implements runtime.Fused by running each
// fused operation as its sequence (runtime.Unfused), and counts the calls:
// with it as the ranks, the TP backend takes its fused path (the layouts of
// the pieces, the residual added by rank 0 before the all-reduce) on CPUs.
type fusingCPU struct {
	runtime.Backend
	calls *atomic.Int64
}

func (f fusingCPU) unfused() runtime.Unfused {
	f.calls.Add(1)
	return runtime.Unfused{Backend: f.Backend}
}

func (f fusingCPU) MatMulN(dst []runtime.Buf, x runtime.Buf, ws []runtime.Linear) {
	f.unfused().MatMulN(dst, x, ws)
}

func (f fusingCPU) NormMatMulN(dst []runtime.Buf, x runtime.Buf, w, bias runtime.Vector, eps float32, ws []runtime.Linear) {
	f.unfused().NormMatMulN(dst, x, w, bias, eps, ws)
}

func (f fusingCPU) NormSwiGLU(dst, x runtime.Buf, w, bias runtime.Vector, eps float32, gate, up runtime.Linear) {
	f.unfused().NormSwiGLU(dst, x, w, bias, eps, gate, up)
}

func (f fusingCPU) MatMulAdd(dst, x runtime.Buf, w runtime.Linear) { f.unfused().MatMulAdd(dst, x, w) }

func (f fusingCPU) RoPEStoreKV(c runtime.KVCache, layer, pos0 int, q, k, v runtime.Buf, headDim int, theta float64, layout model.RopeLayout) {
	f.unfused().RoPEStoreKV(c, layer, pos0, q, k, v, headDim, theta, layout)
}

func (f fusingCPU) NormMatMulStoreKV(qkv []runtime.Buf, x runtime.Buf, w, bias runtime.Vector, eps float32, ws []runtime.Linear, kv runtime.RoPEKV) {
	f.unfused().NormMatMulStoreKV(qkv, x, w, bias, eps, ws, kv)
}

// checkFusedRanks runs ids through m at TP=2 over ranks that fuse: the
// logits match want (the unsplit CPU backend's) within 1e-5 of the largest
// logit, as TestLogits asks of plain TP=2 (only the order of the residual
// sums differs), and every fused operation reached the ranks.
func checkFusedRanks(t *testing.T, m *model.Model, ids []int, want []float32) {
	t.Helper()
	var calls atomic.Int64
	got := logits(load(t, m, fusingTP(t, m, &calls)), ids)
	// a layer: q/k/v with the norm, RoPE + store, gate/up with the norm and
	// SwiGLU on both ranks; o + add and down + add on rank 0 (rank 1
	// computes its partial products plainly)
	if n := int64((2*3 + 2) * m.Config.Layers); calls.Load() != n {
		t.Errorf("the ranks ran %d fused operations, want %d", calls.Load(), n)
	}
	rel := maxRel(got, want)
	t.Logf("TP=2 with fusing ranks: max |Δ| / max |logit| = %.3g", rel)
	if rel > 1e-5 {
		t.Errorf("TP=2 logits with fusing ranks differ from TP=1 by %.3g relative, want <= 1e-5", rel)
	}
}

// fusingTP is a TP=2 backend over two fusingCPU ranks that count into calls.
func fusingTP(t testing.TB, m *model.Model, calls *atomic.Int64) *Backend {
	t.Helper()
	comm, err := NewInProcess(2)
	if err != nil {
		t.Fatal(err)
	}
	be, err := New(m.Config, []runtime.Backend{fusingCPU{cpu.New(1), calls}, fusingCPU{cpu.New(1), calls}}, comm)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { be.Close() })
	return be
}

func (f fusingCPU) AttentionAdd(x, q runtime.Buf, c runtime.KVCache, layer, pos0, heads, kvHeads, headDim int, o runtime.Linear) {
	f.unfused().AttentionAdd(x, q, c, layer, pos0, heads, kvHeads, headDim, o)
}

func (f fusingCPU) RoPEAttention(dst, q, k, v runtime.Buf, c runtime.KVCache, layer, pos0, heads, kvHeads, headDim int, theta float64, layout model.RopeLayout) {
	f.unfused().RoPEAttention(dst, q, k, v, c, layer, pos0, heads, kvHeads, headDim, theta, layout)
}

func (f fusingCPU) MLP(x runtime.Buf, w, bias runtime.Vector, eps float32, gate, up, down runtime.Linear) {
	f.unfused().MLP(x, w, bias, eps, gate, up, down)
}
