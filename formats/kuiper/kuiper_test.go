package kuiper

import (
	"bytes"
	"encoding/binary"
	"math"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"qtool/formats/hf"
	"qtool/formats/model"
	"qtool/quantize"
)

func openHF(t testing.TB, name string) *model.Model {
	t.Helper()
	m, err := hf.Open(filepath.Join("..", "..", "testdata", name))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { m.Close() })
	return m
}

// roundHalfEven is written out by hand, independently of package quantize.
func roundHalfEven(x float32) float32 {
	r := float32(math.Floor(float64(x) + 0.5))
	if r-x == 0.5 && int64(r)%2 != 0 {
		r--
	}
	return r
}

// naiveQ8 is the Kuiper/llama2.c quantize_q80 rule over flat groups of gs.
func naiveQ8(w []float32, gs int) (q []int8, s []float32, deq []float32) {
	q, deq = make([]int8, len(w)), make([]float32, len(w))
	for g := 0; g < len(w)/gs; g++ {
		var m float32
		for _, v := range w[g*gs : (g+1)*gs] {
			if v < 0 {
				v = -v
			}
			if v > m {
				m = v
			}
		}
		sc := m / 127
		s = append(s, sc)
		for i := g * gs; i < (g+1)*gs; i++ {
			if sc != 0 {
				q[i] = int8(roundHalfEven(w[i] / sc))
			}
			deq[i] = float32(q[i]) * sc
		}
	}
	return q, s, deq
}

// metaRows permutes HF q/k rows into the Meta layout by the formula in
// kuiper-formats.md §3.5: Meta row h*hd+2j+half = HF row h*hd+half*hd/2+j.
func metaRows(w []float32, heads, hd, cols int) []float32 {
	out := make([]float32, len(w))
	for h := 0; h < heads; h++ {
		for half := 0; half < 2; half++ {
			for j := 0; j < hd/2; j++ {
				copy(out[(h*hd+2*j+half)*cols:][:cols], w[(h*hd+half*hd/2+j)*cols:][:cols])
			}
		}
	}
	return out
}

func f16(w []float32) []float32 {
	out := make([]float32, len(w))
	for i, v := range w {
		out[i] = model.RoundF16(v)
	}
	return out
}

func floats(t testing.TB, m *model.Model, name string) []float32 {
	t.Helper()
	x, err := m.Get(name)
	if err != nil {
		t.Fatal(err)
	}
	v, err := x.Float32()
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func sameBits(t testing.TB, what string, got, want []float32) {
	t.Helper()
	if len(got) != len(want) {
		t.Fatalf("%s: %d values, want %d", what, len(got), len(want))
	}
	for i := range got {
		if math.Float32bits(got[i]) != math.Float32bits(want[i]) {
			t.Fatalf("%s[%d] = %v, want %v", what, i, got[i], want[i])
		}
	}
}

// sourceValues is what the file must hold for tensor name: the source values
// (the embedding for a tied model's int8 classifier), permuted for q/k when
// written interleaved.
func sourceValues(t testing.TB, src *model.Model, name string, rope model.RopeLayout) []float32 {
	sn := name
	if name == model.Name(-1, model.LMHead) && src.Config.Tied {
		sn = model.Name(-1, model.Embed)
	}
	w := floats(t, src, sn)
	l, r, _ := model.ParseName(name)
	if l >= 0 && rope == model.RopeInterleaved && (r == model.Q || r == model.K) {
		heads := src.Config.Heads
		if r == model.K {
			heads = src.Config.KVHeads
		}
		w = metaRows(w, heads, src.Config.HeadDim, src.Config.Hidden)
	}
	return w
}

type rtCase struct {
	model  string
	format Format
	rope   model.RopeLayout
	group  int
}

func rtCases() []rtCase {
	var cs []rtCase
	for _, f := range []Format{FP32, Int8, AK42V1, AK42V2} {
		cs = append(cs, rtCase{"llama-mini", f, model.RopeHalf, 0}, rtCase{"qwen3-mini", f, model.RopeHalf, 0})
	}
	cs = append(cs, rtCase{"llama-mini", FP32, model.RopeInterleaved, 0}, rtCase{"llama-mini", Int8, model.RopeInterleaved, 0},
		rtCase{"llama-mini", Int8, model.RopeHalf, 128}, rtCase{"llama-mini", Int8, model.RopeHalf, 512}, rtCase{"qwen3-mini", AK47, model.RopeHalf, 0},
		rtCase{"qwen3-mini", AK48, model.RopeHalf, 0}, rtCase{"qwen3-mini", AK48, model.RopeHalf, 64})
	return cs
}

func TestRoundTrip(t *testing.T) {
	for _, tc := range rtCases() {
		t.Run(tc.model+"/"+string(tc.format)+"/"+tc.rope.String()+"/g"+itoa(tc.group), func(t *testing.T) {
			src := openHF(t, tc.model)
			path := filepath.Join(t.TempDir(), "m.bin")
			if err := Write(src, path, WriteOptions{QtoolOnly: true, Format: tc.format, Rope: tc.rope, GroupSize: tc.group}); err != nil {
				t.Fatal(err)
			}
			info, err := DecodeHeader(path, OpenOptions{})
			if err != nil {
				t.Fatal(err)
			}
			m, err := Open(path, OpenOptions{})
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			checkConfig(t, src, m, tc)
			gs := info.Header.GroupSize
			for _, e := range info.Layout.Entries {
				if e.Kind == KindFreqs {
					continue
				}
				want := sourceValues(t, src, e.Name, tc.rope)
				got := floats(t, m, e.Name)
				switch e.Kind {
				case KindF32:
					sameBits(t, e.Name, got, want)
				case KindF16:
					sameBits(t, e.Name, got, f16(want))
				case KindQ8:
					q, s, deq := naiveQ8(want, gs)
					sameBits(t, e.Name, got, deq)
					if qt, ok := m.Lookup(e.Name); ok {
						if qq, ok := qt.(*model.Quantized); ok {
							if !bytes.Equal(int8Bytes(qq.Q), int8Bytes(q)) {
								t.Fatalf("%s: codes differ from the reference", e.Name)
							}
							sameBits(t, e.Name+" scales", qq.Scale, s)
						} else if e.Shape[1]%gs == 0 {
							t.Fatalf("%s: read as %T, want *model.Quantized", e.Name, qt)
						}
					}
				case KindAWQ:
					ref, err := quantize.RTN(want, e.Shape[0], e.Shape[1], quantize.Int4Asym(gs))
					if err != nil {
						t.Fatal(err)
					}
					qt, _ := m.Lookup(e.Name)
					qq := qt.(*model.Quantized)
					if !bytes.Equal(int8Bytes(qq.Q), int8Bytes(ref.Q)) {
						t.Fatalf("%s: codes differ from RTN", e.Name)
					}
					sameBits(t, e.Name+" zeros", qq.Zero, ref.Zero)
					sameBits(t, e.Name+" scales", qq.Scale, f16(ref.Scale))
				}
			}
			// Writing what was read gives the same bytes: reader and writer
			// are exact inverses.
			path2 := filepath.Join(t.TempDir(), "m2.bin")
			if err := Write(m, path2, WriteOptions{QtoolOnly: true, Format: tc.format, Rope: m.Config.Rope, GroupSize: gs}); err != nil {
				t.Fatal(err)
			}
			a, _ := os.ReadFile(path)
			b, _ := os.ReadFile(path2)
			if !bytes.Equal(a, b) {
				t.Fatalf("rewriting the read model changed the file (%d vs %d bytes)", len(a), len(b))
			}
		})
	}
}

func itoa(i int) string {
	if i == 0 {
		return "default"
	}
	return string(rune('0'+i/100%10)) + string(rune('0'+i/10%10)) + string(rune('0'+i%10))
}

func int8Bytes(q []int8) []byte {
	b := make([]byte, len(q))
	for i, v := range q {
		b[i] = byte(v)
	}
	return b
}

func checkConfig(t *testing.T, src, m *model.Model, tc rtCase) {
	t.Helper()
	want := src.Config
	got := m.Config
	if tc.format == Int8 {
		want.Tied = false // always a (quantized) classifier
	}
	want.Rope = tc.rope
	switch tc.format {
	case FP32, Int8, AK42V1, AK42V2:
		want.DType = src.Config.DType
	}
	if got.Arch != want.Arch || got.Hidden != want.Hidden || got.Intermediate != want.Intermediate ||
		got.Layers != want.Layers || got.Heads != want.Heads || got.KVHeads != want.KVHeads ||
		got.HeadDim != want.HeadDim || got.Vocab != want.Vocab || got.MaxSeq != want.MaxSeq ||
		got.RopeTheta != want.RopeTheta || got.NormEps != want.NormEps || got.Tied != want.Tied ||
		got.QKNorm != want.QKNorm || got.Rope != want.Rope || got.BOS != want.BOS || len(got.EOS) != len(want.EOS) {
		t.Fatalf("config\n got %+v\nwant %+v", got, want)
	}
	if m.TokenizerDir == "" {
		t.Error("tokenizer dir lost")
	}
}

// TestOpenWithoutSidecar: headerless files are told apart by their size.
func TestOpenWithoutSidecar(t *testing.T) {
	src := openHF(t, "llama-mini")
	for _, f := range []Format{FP32, Int8, AK42V1, AK42V2} {
		t.Run(string(f), func(t *testing.T) {
			path := filepath.Join(t.TempDir(), "m.bin")
			if err := Write(src, path, WriteOptions{QtoolOnly: true, Format: f, NoSidecar: true}); err != nil {
				t.Fatal(err)
			}
			if _, err := os.Stat(SidecarPath(path)); !os.IsNotExist(err) {
				t.Fatal("sidecar written despite NoSidecar")
			}
			half := model.RopeHalf
			m, err := Open(path, OpenOptions{Rope: &half})
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			if m.Format != string(f) || m.Config.Arch != model.Llama || m.Config.RopeTheta != 1e4 || m.Config.NormEps != 1e-5 {
				t.Fatalf("format %s, config %+v", m.Format, m.Config)
			}
			sameBits(t, "norm", floats(t, m, "norm"), floats(t, src, "norm"))
		})
	}
}

// TestReaderCompatible: the files whose readers would not run a model as
// qtool does (or, for Qwen2 in kuiper-int8, run it as Kuiper's own files
// without the biases: ReaderNote) are exactly those that need the qtool
// extension (or, for ak47/ak48, a shape OrinMLLM reads), and Write refuses
// the first unless QtoolOnly.
func TestReaderCompatible(t *testing.T) {
	llama := openHF(t, "llama-mini")
	qwen := openHF(t, "qwen3-mini")
	qwen2 := model.New(llama.Config) // llama-mini with q/k/v biases
	qwen2.Config.Arch, qwen2.Config.AttnBias = model.Qwen2, true
	for _, n := range llama.Names() {
		x, _ := llama.Lookup(n)
		qwen2.Set(n, x)
	}
	c := qwen2.Config
	for l := 0; l < c.Layers; l++ {
		for _, b := range []struct {
			r model.Role
			n int
		}{{model.QBias, c.QDim()}, {model.KBias, c.KVDim()}, {model.VBias, c.KVDim()}} {
			qwen2.Set(model.Name(l, b.r), model.FromFloat32([]int{b.n}, make([]float32, b.n)))
		}
	}
	dir := t.TempDir()
	for _, m := range []*model.Model{llama, qwen, qwen2} {
		for _, f := range []Format{FP32, Int8, AK42V1, AK42V2} {
			name := string(m.Config.Arch) + "/" + string(f)
			p := filepath.Join(dir, string(m.Config.Arch)+"-"+string(f)+".bin")
			if err := Write(m, p, WriteOptions{QtoolOnly: true, Format: f}); err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			side, err := ReadSidecar(p)
			if err != nil {
				t.Fatalf("%s: %v", name, err)
			}
			rc, note := ReaderCompatible(f, m.Config), ReaderNote(f, m.Config)
			if (rc != nil || note != "") != (len(side.Extension) > 0) || rc != nil && note != "" {
				t.Errorf("%s: ReaderCompatible %v, ReaderNote %q, and the file's extension holds %d tensors", name, rc, note, len(side.Extension))
			}
			err = Write(m, filepath.Join(dir, "plain.bin"), WriteOptions{Format: f})
			if (err != nil) != (rc != nil) {
				t.Errorf("%s: Write without QtoolOnly: %v (ReaderCompatible: %v)", name, err, rc)
			}
		}
	}
	if ReaderCompatible(AK47, qwen.Config) == nil { // qwen3-mini: 8 heads × 64 ≠ 256
		t.Error("ak47 of qwen3-mini's shape: no objection")
	}
}

// TestLayoutByHand checks file sizes against the formulas of
// kuiper-formats.md and reads tensors at hand-computed byte offsets.
func TestLayoutByHand(t *testing.T) {
	llama := openHF(t, "llama-mini")
	qwen := openHF(t, "qwen3-mini")
	c := llama.Config
	D, H, L, V, S := int64(c.Hidden), int64(c.Intermediate), int64(c.Layers), int64(c.Vocab), int64(c.MaxSeq)
	KV := D * int64(c.KVHeads) / int64(c.Heads)
	hs := D / int64(c.Heads)
	dir := t.TempDir()
	write := func(m *model.Model, f Format, name string) []byte {
		p := filepath.Join(dir, name)
		if err := Write(m, p, WriteOptions{QtoolOnly: true, Format: f}); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	f32At := func(b []byte, off int64, n int) []float32 {
		v := make([]float32, n)
		for i := range v {
			v[i] = math.Float32frombits(binary.LittleEndian.Uint32(b[off+4*int64(i):]))
		}
		return v
	}
	f16At := func(b []byte, off int64, n int) []float32 {
		v := make([]float32, n)
		for i := range v {
			v[i] = model.F16ToFloat32(binary.LittleEndian.Uint16(b[off+2*int64(i):]))
		}
		return v
	}
	src := func(m *model.Model, name string, n int) []float32 { return floats(t, m, name)[:n] }

	t.Run("fp32", func(t *testing.T) {
		b := write(llama, FP32, "fp32.bin")
		want := 28 + 4*(V*D+2*L*D+2*L*D*D+2*L*KV*D+3*L*H*D+D+S*hs+V*D)
		if int64(len(b)) != want {
			t.Fatalf("size %d, formula %d", len(b), want)
		}
		if v := int32(binary.LittleEndian.Uint32(b[20:])); v != -int32(V) {
			t.Fatalf("vocab field %d, want %d (unshared)", v, -V)
		}
		// wk of layer 1: floats V·D + L·D + L·D·D + 1·KV·D after the header.
		sameBits(t, "layers.1.k", f32At(b, 28+4*(V*D+L*D+L*D*D+KV*D), 100), src(llama, "layers.1.k", 100))
		// ffn norm of layer 2: V·D + L·D + 2·L·D·D + 2·L·KV·D + 2·D.
		sameBits(t, "layers.2.mlp_norm", f32At(b, 28+4*(V*D+L*D+2*L*D*D+2*L*KV*D+2*D), int(D)), src(llama, "layers.2.mlp_norm", int(D)))
		// classifier: the last V·D floats.
		sameBits(t, "lm_head", f32At(b, int64(len(b))-4*V*D, 50), src(llama, "lm_head", 50))
	})
	t.Run("int8", func(t *testing.T) {
		b := write(llama, Int8, "int8.bin")
		gs := int64(64)
		q8 := func(n int64) int64 { return n + 4*n/gs }
		lin := L * (2*q8(D*D) + 2*q8(KV*D) + 3*q8(H*D))
		want := 32 + lin + q8(V*D) + 4*(V*D+2*L*D+D)
		if int64(len(b)) != want {
			t.Fatalf("size %d, formula %d", len(b), want)
		}
		if g := binary.LittleEndian.Uint32(b[28:]); g != 64 {
			t.Fatalf("group size field %d", g)
		}
		// wv of layer 0: after L wq and L wk.
		off := 32 + L*q8(D*D) + L*q8(KV*D)
		w := floats(t, llama, "layers.0.v")
		q, s, _ := naiveQ8(w, 64)
		for i := 0; i < 200; i++ {
			if int8(b[off+int64(i)]) != q[i] {
				t.Fatalf("wv[%d] = %d, want %d", i, int8(b[off+int64(i)]), q[i])
			}
		}
		sameBits(t, "layers.0.v scales", f32At(b, off+KV*D, 4), s[:4])
		// embedding right after the classifier, then norms.
		emb := 32 + lin + q8(V*D)
		sameBits(t, "embed", f32At(b, emb, 50), src(llama, "embed", 50))
		sameBits(t, "layers.3.attn_norm", f32At(b, emb+4*(V*D+3*D), int(D)), src(llama, "layers.3.attn_norm", int(D)))
		sameBits(t, "norm", f32At(b, int64(len(b))-4*D, int(D)), src(llama, "norm", int(D)))
	})
	t.Run("ak42-v1", func(t *testing.T) {
		b := write(llama, AK42V1, "v1.bin")
		want := 256 + 4*(2*L*D+D+V*D+L*(2*D*D+2*KV*D+3*H*D)+V*D)
		if int64(len(b)) != want {
			t.Fatalf("size %d, formula %d", len(b), want)
		}
		if string(b[:4]) != "24ka" || binary.LittleEndian.Uint32(b[4:]) != 1 || b[36] != 0 {
			t.Fatalf("header % x", b[:40])
		}
		sameBits(t, "embed", f32At(b, 256+4*(2*L*D+D), 40), src(llama, "embed", 40))
		sameBits(t, "layers.0.q", f32At(b, 256+4*(2*L*D+D+V*D), 40), src(llama, "layers.0.q", 40))
	})
	t.Run("ak42-v2", func(t *testing.T) {
		b := write(llama, AK42V2, "v2.bin")
		gs := int64(64)
		q8 := func(n int64) int64 { return n + 4*n/gs }
		want := 256 + 4*(2*L*D+D) + q8(V*D) + L*(2*q8(D*D)+2*q8(KV*D)+3*q8(H*D)) + q8(V*D)
		if int64(len(b)) != want {
			t.Fatalf("size %d, formula %d", len(b), want)
		}
		if string(b[:4]) != "24ka" || binary.LittleEndian.Uint32(b[4:]) != 2 || binary.LittleEndian.Uint32(b[37:]) != 64 {
			t.Fatalf("header % x", b[:41])
		}
		q, _, _ := naiveQ8(floats(t, llama, "embed"), 64)
		off := 256 + 4*(2*L*D+D)
		for i := 0; i < 100; i++ {
			if int8(b[off+int64(i)]) != q[i] {
				t.Fatalf("embed q[%d] = %d, want %d", i, int8(b[off+int64(i)]), q[i])
			}
		}
	})
	qc := qwen.Config
	qD, qH, qL, qV := int64(qc.Hidden), int64(qc.Intermediate), int64(qc.Layers), int64(qc.Vocab)
	hd := int64(qc.HeadDim)
	Q, qKV := int64(qc.Heads)*hd, int64(qc.KVHeads)*hd
	t.Run("ak47", func(t *testing.T) {
		b := write(qwen, AK47, "ak47.bin")
		want := 256 + 2*(2*qL*qD+qD+qV*qD+qL*(2*Q*qD+2*qKV*qD+3*qH*qD)+2*qL*hd)
		if int64(len(b)) != want {
			t.Fatalf("size %d, formula %d", len(b), want)
		}
		if string(b[:4]) != "74ka" || binary.LittleEndian.Uint32(b[4:]) != 4 || b[36] != 1 || binary.LittleEndian.Uint32(b[37:]) != uint32(hd) {
			t.Fatalf("header % x", b[:41])
		}
		sameBits(t, "layers.0.attn_norm", f16At(b, 256, int(qD)), f16(src(qwen, "layers.0.attn_norm", int(qD))))
		sameBits(t, "layers.1.k_norm", f16At(b, int64(len(b))-2*(qL-1)*hd, int(hd)), f16(src(qwen, "layers.1.k_norm", int(hd))))
	})
	t.Run("ak48", func(t *testing.T) {
		b := write(qwen, AK48, "ak48.bin")
		g := int64(128)
		awq := func(out, in int64) int64 { return 4*in*out/8 + 4*(in/g)*out/8 + 2*(in/g)*out }
		want := 256 + 2*(2*qL*qD+qD+qV*qD) + qL*(awq(Q, qD)+2*awq(qKV, qD)+awq(qD, Q)+2*awq(qH, qD)+awq(qD, qH)) + 2*2*qL*hd
		if int64(len(b)) != want {
			t.Fatalf("size %d, formula %d", len(b), want)
		}
		if string(b[:4]) != "84ka" || binary.LittleEndian.Uint32(b[4:]) != 5 || binary.LittleEndian.Uint32(b[37:]) != uint32(hd) || binary.LittleEndian.Uint32(b[41:]) != 128 {
			t.Fatalf("header % x", b[:45])
		}
		// First qweight word of wq, layer 0: input row k=0, output columns
		// 0..7, column c in bits 4*order[c], order = {0,4,1,5,2,6,3,7}.
		ref, err := quantize.RTN(floats(t, qwen, "layers.0.q"), int(Q), int(qD), quantize.Int4Asym(128))
		if err != nil {
			t.Fatal(err)
		}
		order := []int{0, 4, 1, 5, 2, 6, 3, 7}
		off := 256 + 2*(2*qL*qD+qD+qV*qD)
		for word := 0; word < 3; word++ { // words (k=0, c=word)
			var want uint32
			for c := 0; c < 8; c++ {
				u := uint32(int(ref.Q[(8*word+c)*int(qD)+0]) + 8)
				want |= u << (4 * order[c])
			}
			if got := binary.LittleEndian.Uint32(b[off+4*int64(word):]); got != want {
				t.Fatalf("qweight word %d = %#x, want %#x", word, got, want)
			}
		}
		sameBits(t, "layers.0.q_norm", f16At(b, int64(len(b))-2*2*qL*hd, int(hd)), f16(src(qwen, "layers.0.q_norm", int(hd))))
	})
}

// TestBadInput: truncated files, unknown architectures and non-dividing
// group sizes fail with errors naming the file and tensor, leaving no file.
func TestBadInput(t *testing.T) {
	llama := openHF(t, "llama-mini")
	dir := t.TempDir()
	good := map[Format]string{}
	for _, f := range []Format{FP32, Int8, AK42V1, AK42V2} {
		p := filepath.Join(dir, string(f)+".bin")
		if err := Write(llama, p, WriteOptions{QtoolOnly: true, Format: f}); err != nil {
			t.Fatal(err)
		}
		good[f] = p
	}
	qwen := openHF(t, "qwen3-mini")
	for _, f := range []Format{AK47, AK48} {
		p := filepath.Join(dir, string(f)+".bin")
		if err := Write(qwen, p, WriteOptions{QtoolOnly: true, Format: f}); err != nil {
			t.Fatal(err)
		}
		good[f] = p
	}
	for f, p := range good {
		data, _ := os.ReadFile(p)
		side, _ := os.ReadFile(SidecarPath(p))
		for _, cut := range []int{1, len(data) / 3} {
			for _, withSide := range []bool{true, false} {
				tp := filepath.Join(t.TempDir(), "trunc.bin")
				os.WriteFile(tp, data[:len(data)-cut], 0o644)
				if withSide {
					os.WriteFile(SidecarPath(tp), side, 0o644)
				}
				_, err := Open(tp, OpenOptions{})
				if err == nil {
					t.Fatalf("%s cut %d sidecar=%v: no error", f, cut, withSide)
				}
				msg := err.Error()
				if !strings.Contains(msg, tp) || !strings.Contains(msg, "tensor") {
					t.Errorf("%s cut %d sidecar=%v: error %q should name the file and a tensor", f, cut, withSide, msg)
				}
			}
		}
	}
	tests := []struct {
		name string
		m    func() *model.Model
		opt  WriteOptions
		subs []string
	}{
		{"unknown arch", func() *model.Model {
			m := model.New(llama.Config)
			for _, n := range llama.Names() {
				x, _ := llama.Lookup(n)
				m.Set(n, x)
			}
			m.Config.Arch = "gpt2"
			return m
		}, WriteOptions{QtoolOnly: true, Format: Int8}, []string{"unknown architecture", "gpt2"}},
		{"group does not divide", func() *model.Model { return llama }, WriteOptions{QtoolOnly: true, Format: Int8, GroupSize: 48}, []string{"group size 48", `tensor "layers.0.q"`}},
		{"ak48 group", func() *model.Model { return qwen }, WriteOptions{QtoolOnly: true, Format: AK48, GroupSize: 96}, []string{"group size 96", "tensor"}},
		{"ak47 llama", func() *model.Model { return llama }, WriteOptions{QtoolOnly: true, Format: AK47}, []string{"Qwen3"}},
		{"qwen3 in a llama layout", func() *model.Model { return qwen }, WriteOptions{Format: Int8}, []string{"no place for the q/k norms", "ak47 and ak48 hold Qwen3", "--qtool-only"}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			d := t.TempDir()
			p := filepath.Join(d, "out.bin")
			err := Write(tc.m(), p, tc.opt)
			if err == nil {
				t.Fatal("no error")
			}
			for _, s := range append(tc.subs, p) {
				if !strings.Contains(err.Error(), s) {
					t.Errorf("error %q lacks %q", err, s)
				}
			}
			if ents, _ := os.ReadDir(d); len(ents) != 0 {
				t.Errorf("left behind: %v", ents)
			}
		})
	}
}

// TestExportMemory checks that exporting allocates less than one tensor's
// worth of converted data in total: conversion works in chunks of
// chunkElems values, so the bound does not grow with the model.
func TestExportMemory(t *testing.T) {
	src := openHF(t, "llama-mini")
	largest := 0
	for _, n := range src.Names() {
		x, _ := src.Lookup(n)
		largest = max(largest, 4*model.NumElements(x.Shape()))
	}
	for _, f := range []Format{FP32, Int8, AK42V2} {
		t.Run(string(f), func(t *testing.T) {
			p := filepath.Join(t.TempDir(), "m.bin")
			alloc := allocated(func() {
				if err := Write(src, p, WriteOptions{QtoolOnly: true, Format: f}); err != nil {
					t.Fatal(err)
				}
			})
			fi, _ := os.Stat(p)
			t.Logf("%s: wrote %d bytes, allocated %d bytes in total (largest tensor as fp32: %d)", f, fi.Size(), alloc, largest)
			if alloc >= uint64(largest) {
				t.Fatalf("allocated %d bytes, want less than one fp32 tensor (%d)", alloc, largest)
			}
		})
	}
}

func allocated(f func()) uint64 {
	var a, b runtimeMemStats
	readMem(&a)
	f()
	readMem(&b)
	return b.TotalAlloc - a.TotalAlloc
}

func BenchmarkExportInt8(b *testing.B) {
	src := openHF(b, "llama-mini")
	p := filepath.Join(b.TempDir(), "m.bin")
	b.ReportAllocs()
	for b.Loop() {
		if err := Write(src, p, WriteOptions{QtoolOnly: true, Format: Int8}); err != nil {
			b.Fatal(err)
		}
	}
}

// TestQuantizedModelInput: a model quantized beforehand by package quantize
// (eagerly or lazily) writes the same bytes as the float model quantized by
// the writer itself.
func TestQuantizedModelInput(t *testing.T) {
	tests := []struct {
		model  string
		format Format
		p      quantize.Params
	}{
		{"llama-mini", Int8, quantize.Int8Sym(64)},
		{"qwen3-mini", Int8, quantize.Int8Sym(64)},
		{"qwen3-mini", AK48, quantize.Int4Asym(128)},
	}
	for _, tc := range tests {
		for _, lazy := range []bool{false, true} {
			t.Run(tc.model+"/"+string(tc.format)+"/lazy="+map[bool]string{false: "no", true: "yes"}[lazy], func(t *testing.T) {
				src := openHF(t, tc.model)
				dir := t.TempDir()
				plain := filepath.Join(dir, "plain.bin")
				if err := Write(src, plain, WriteOptions{QtoolOnly: true, Format: tc.format, NoSidecar: true}); err != nil {
					t.Fatal(err)
				}
				qm, err := quantize.QuantizeModel(src, quantize.Options{Params: tc.p, Classifier: tc.format == Int8, Lazy: lazy})
				if err != nil {
					t.Fatal(err)
				}
				pre := filepath.Join(dir, "pre.bin")
				if err := Write(qm, pre, WriteOptions{QtoolOnly: true, Format: tc.format, NoSidecar: true}); err != nil {
					t.Fatal(err)
				}
				a, _ := os.ReadFile(plain)
				b, _ := os.ReadFile(pre)
				if !bytes.Equal(a, b) {
					t.Fatalf("pre-quantized model wrote different bytes (%d vs %d)", len(a), len(b))
				}
			})
		}
	}
}
