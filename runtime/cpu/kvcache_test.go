package cpu

import (
	"math"
	"math/rand/v2"
	"testing"

	"qtool/runtime"
)

// TestInt8KVCacheByHand checks msmodelslim's C8 formulas on one KV head of
// two channels over three positions, with numbers worked out by hand:
// cache_int = round(x/scale + offset), x̂ = (cache_int − offset)·scale.
func TestInt8KVCacheByHand(t *testing.T) {
	b := New(1)
	q := runtime.KVQuant{
		KScale: []float32{0.5, 0.25}, KOffset: []float32{3, -10},
		VScale: []float32{0.125, 1}, VOffset: []float32{0, 100},
	}
	c, err := b.NewInt8KVCache(4, 2, []runtime.KVQuant{q})
	if err != nil {
		t.Fatal(err)
	}
	k := []float32{1.2, -0.3, -2, 40, 0.1, 1}
	v := []float32{0.3, 20, -20, -500, 0.0625, 0.4}
	// keys, channel 0: 1.2/0.5+3 = 5.4 → 5; −2/0.5+3 = −1; 0.1/0.5+3 = 3.2 → 3
	// keys, channel 1: −0.3/0.25−10 = −11.2 → −11; 40/0.25−10 = 150 → 127 (saturated); 1/0.25−10 = −6
	// values, channel 0: 0.3/0.125 = 2.4 → 2; −20/0.125 = −160 → −128; 0.0625/0.125 = 0.5 → 0 (half to even)
	// values, channel 1: 20+100 = 120; −500+100 = −400 → −128; 0.4+100 = 100.4 → 100
	wantK := []int8{5, -11, -1, 127, 3, -6}
	wantV := []int8{2, 120, -128, -128, 0, 100}
	b.StoreKV(c, 0, 0, upload(b, 3, 2, k), upload(b, 3, 2, v))
	kc := cacheOf(c)
	for i := range wantK {
		if kc.kq[0][i] != wantK[i] || kc.vq[0][i] != wantV[i] {
			t.Fatalf("cached codes k %v v %v, want k %v v %v", kc.kq[0][:6], kc.vq[0][:6], wantK, wantV)
		}
	}
	// dequantized: keys (5−3)·0.5 = 1, (−11+10)·0.25 = −0.25, −2, 34.25, 0, 1;
	// values 0.25, 20, −16, −228, 0, 0
	kd := []float32{1, -0.25, -2, 34.25, 0, 1}
	vd := []float32{0.25, 20, -16, -228, 0, 0}
	for i, x := range kd {
		if got := runtime.DequantizeKV(wantK[i], q.KScale[i%2], q.KOffset[i%2]); got != x {
			t.Fatalf("key %d dequantizes to %g, want %g", i, got, x)
		}
		if got := runtime.DequantizeKV(wantV[i], q.VScale[i%2], q.VOffset[i%2]); got != vd[i] {
			t.Fatalf("value %d dequantizes to %g, want %g", i, got, vd[i])
		}
	}
	// attention of the query (1, 1) at position 2 over the dequantized
	// keys and values: scores (1 − 0.25, −2 + 34.25, 0 + 1)/√2
	qv := []float32{1, 1}
	out := b.Alloc(1, 2)
	b.Attention(out, upload(b, 1, 2, qv), c, 0, 2, 1, 1, 2)
	s := []float64{0.75 / math.Sqrt2, 32.25 / math.Sqrt2, 1 / math.Sqrt2}
	var z float64
	want := make([]float64, 2)
	for p, x := range s {
		e := math.Exp(x - s[1])
		z += e
		want[0] += e * float64(vd[2*p])
		want[1] += e * float64(vd[2*p+1])
	}
	got := download(b, out)
	for i := range want {
		if d := math.Abs(float64(got[i]) - want[i]/z); d > 1e-4*math.Abs(want[i]/z) {
			t.Errorf("attention output %d: %g, want %g", i, got[i], want[i]/z)
		}
	}
}

// TestInt8KVCacheAttention compares the int8 cache's attention with the
// float cache's on the dequantized keys and values (same positions,
// grouped-query heads).
func TestInt8KVCacheAttention(t *testing.T) {
	b := New(2)
	const T, S, heads, kvHeads, hd = 3, 20, 4, 2, 8
	kvDim := kvHeads * hd
	r := rand.New(rand.NewPCG(11, 12))
	q := runtime.KVQuant{KScale: make([]float32, kvDim), KOffset: make([]float32, kvDim), VScale: make([]float32, kvDim), VOffset: make([]float32, kvDim)}
	for c := 0; c < kvDim; c++ {
		q.KScale[c], q.KOffset[c] = float32(0.01+0.02*r.Float64()), float32(r.IntN(20)-10)
		q.VScale[c], q.VOffset[c] = float32(0.01+0.02*r.Float64()), float32(r.IntN(20)-10)
	}
	K, V := randVec(r, S*kvDim, 1), randVec(r, S*kvDim, 1)
	c8, err := b.NewInt8KVCache(S, kvDim, []runtime.KVQuant{q, q})
	if err != nil {
		t.Fatal(err)
	}
	b.StoreKV(c8, 1, 0, upload(b, S, kvDim, K), upload(b, S, kvDim, V))
	Kd, Vd := make([]float32, len(K)), make([]float32, len(V))
	for i := range K {
		ch := i % kvDim
		Kd[i] = runtime.DequantizeKV(runtime.QuantizeKV(K[i], q.KScale[ch], q.KOffset[ch]), q.KScale[ch], q.KOffset[ch])
		Vd[i] = runtime.DequantizeKV(runtime.QuantizeKV(V[i], q.VScale[ch], q.VOffset[ch]), q.VScale[ch], q.VOffset[ch])
	}
	qv := randVec(r, T*heads*hd, 2)
	out := b.Alloc(T, heads*hd)
	b.Attention(out, upload(b, T, heads*hd, qv), c8, 1, S-T, heads, kvHeads, hd)
	want := naiveAttention(qv, Kd, Vd, T, S-T, heads, kvHeads, hd)
	if d := maxAbsDiff(download(b, out), want); d > 1e-5 {
		t.Errorf("int8 cache attention: max |diff| %g against the dequantized keys and values", d)
	}
	if _, err := b.NewInt8KVCache(S, kvDim, []runtime.KVQuant{{KScale: q.KScale}}); err == nil {
		t.Error("a quantizer without offsets was accepted")
	}
}
