package kuiper

import (
	"bytes"
	"math"
	"os"
	"path/filepath"
	"testing"

	"qtool/formats/model"
)

// tinyModel builds a small model of arch with deterministic weights.
func tinyModel(arch model.Arch) *model.Model {
	c := model.Config{Arch: arch, Hidden: 16, Intermediate: 32, Layers: 1, Heads: 2, KVHeads: 1, HeadDim: 8,
		Vocab: 8, MaxSeq: 4, RopeTheta: 1e4, NormEps: 1e-5, BOS: 1, EOS: []int{2}}
	if arch == model.Qwen3 {
		c.Heads, c.KVHeads, c.HeadDim, c.QKNorm, c.Tied, c.RopeTheta, c.NormEps, c.BOS = 4, 2, 8, true, true, 1e6, 1e-6, -1
	}
	if arch == model.Qwen2 {
		c.AttnBias = true
	}
	m := model.New(c)
	seed := 1
	set := func(name string, shape ...int) {
		v := make([]float32, model.NumElements(shape))
		for i := range v {
			seed = seed*1103515245 + 12345
			v[i] = float32(seed>>8&0xffff)/65536 - 0.5
		}
		m.Set(name, model.FromFloat32(shape, v))
	}
	Q, KV := c.QDim(), c.KVDim()
	set("embed", c.Vocab, c.Hidden)
	set("norm", c.Hidden)
	if !c.Tied {
		set("lm_head", c.Vocab, c.Hidden)
	}
	for l := 0; l < c.Layers; l++ {
		n := func(r model.Role) string { return model.Name(l, r) }
		set(n(model.AttnNorm), c.Hidden)
		set(n(model.MLPNorm), c.Hidden)
		set(n(model.Q), Q, c.Hidden)
		set(n(model.K), KV, c.Hidden)
		set(n(model.V), KV, c.Hidden)
		set(n(model.O), c.Hidden, Q)
		set(n(model.Gate), c.Intermediate, c.Hidden)
		set(n(model.Up), c.Intermediate, c.Hidden)
		set(n(model.Down), c.Hidden, c.Intermediate)
		if c.QKNorm {
			set(n(model.QNorm), c.HeadDim)
			set(n(model.KNorm), c.HeadDim)
		}
		if c.AttnBias {
			set(n(model.QBias), Q)
			set(n(model.KBias), KV)
			set(n(model.VBias), KV)
		}
	}
	return m
}

// tinyFiles writes the tiny models in every format they fit.
func tinyFiles(tb testing.TB) map[Format][][]byte {
	dir := tb.TempDir()
	out := map[Format][][]byte{}
	for _, arch := range []model.Arch{model.Llama, model.Qwen2, model.Qwen3} {
		m := tinyModel(arch)
		for _, f := range AllFormats() {
			if (f == AK47 || f == AK48) && arch != model.Qwen3 {
				continue
			}
			p := filepath.Join(dir, string(arch)+string(f))
			gs := 0
			if f == Int8 || f == AK48 {
				gs = 16
			}
			if err := Write(m, p, WriteOptions{QtoolOnly: true, Format: f, GroupSize: gs, NoSidecar: true}); err != nil {
				tb.Fatal(err)
			}
			b, err := os.ReadFile(p)
			if err != nil {
				tb.Fatal(err)
			}
			out[f] = append(out[f], b)
		}
	}
	return out
}

func TestTinyFilesDecode(t *testing.T) {
	for f, files := range tinyFiles(t) {
		for i, b := range files {
			arch := []model.Arch{model.Llama, model.Qwen2, model.Qwen3}[i]
			if f == AK47 || f == AK48 {
				arch = model.Qwen3
			}
			m, err := Decode("tiny", b, nil, OpenOptions{Arch: arch, HeadDim: 8})
			if err != nil {
				t.Fatalf("%s/%s: %v", f, arch, err)
			}
			src := tinyModel(arch)
			tol := 0.003 // int8: half a step of 1/127 plus fp16 rounding
			if f == AK48 {
				tol = 0.04 // 4-bit: half a step of 1/15
			}
			for _, n := range m.Names() {
				got := floats(t, m, n)
				sn := n
				if n == "lm_head" && src.Config.Tied {
					sn = "embed"
				}
				want := floats(t, src, sn)
				for j := range got {
					if math.Abs(float64(got[j]-want[j])) > tol {
						t.Fatalf("%s/%s %s[%d] = %v, source %v", f, arch, n, j, got[j], want[j])
					}
				}
			}
		}
	}
}

func FuzzParseFP32Header(f *testing.F) {
	for _, b := range tinyFiles(f)[FP32] {
		f.Add(b[:FP32HeaderSize])
	}
	f.Add(make([]byte, 28))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := ParseFP32Header("fuzz", b)
		if err != nil {
			return
		}
		if enc := h.Encode(); !bytes.Equal(enc, b[:FP32HeaderSize]) {
			t.Fatalf("Encode(Parse(b)) = % x, want % x", enc, b[:FP32HeaderSize])
		}
		NewLayout("fuzz", h, Shapes{}, 1<<20)
	})
}

func FuzzParseInt8Header(f *testing.F) {
	for _, b := range tinyFiles(f)[Int8] {
		f.Add(b[:Int8HeaderSize])
	}
	f.Add(make([]byte, 32))
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := ParseInt8Header("fuzz", b)
		if err != nil {
			return
		}
		if enc := h.Encode(); !bytes.Equal(enc, b[:Int8HeaderSize]) {
			t.Fatalf("Encode(Parse(b)) = % x, want % x", enc, b[:Int8HeaderSize])
		}
		NewLayout("fuzz", h, Shapes{QKNorm: true}, 1<<20)
	})
}

func FuzzParseVersionedHeader(f *testing.F) {
	files := tinyFiles(f)
	for _, fm := range []Format{AK42V1, AK42V2, AK47, AK48} {
		for _, b := range files[fm] {
			f.Add(b[:VersionedHeaderSize])
		}
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		h, err := ParseVersionedHeader("fuzz", b)
		if err != nil {
			return
		}
		h2, err := ParseVersionedHeader("fuzz", h.Encode())
		if err != nil {
			t.Fatalf("re-parse of an encoded header: %v", err)
		}
		if h2 != h {
			t.Fatalf("re-parse gives %+v, want %+v", h2, h)
		}
		NewLayout("fuzz", h, Shapes{QKNorm: true}, 1<<20)
	})
}

// FuzzDecode feeds whole files (sniffed, or with a forced format) to the
// reader: it must return an error or a model whose tensors all convert.
func FuzzDecode(f *testing.F) {
	formats := AllFormats()
	for fi, fm := range formats {
		for _, b := range tinyFiles(f)[fm] {
			f.Add(b, uint8(0))
			f.Add(b, uint8(fi+1))
		}
	}
	f.Fuzz(func(t *testing.T, b []byte, force uint8) {
		opt := OpenOptions{}
		if force > 0 && int(force) <= len(formats) {
			opt.Format = formats[force-1]
		}
		m, err := Decode("fuzz", b, nil, opt)
		if err != nil {
			return
		}
		for _, n := range m.Names() {
			x, _ := m.Lookup(n)
			if _, err := x.Float32(); err != nil {
				t.Fatalf("%s: %v", n, err)
			}
		}
	})
}

func FuzzParseSidecar(f *testing.F) {
	f.Add([]byte(`{"writer":"qtool","format":"int8","arch":"llama","rope_theta":10000,"rms_norm_eps":1e-5,"rope_layout":"half","head_dim":64}`))
	f.Add([]byte(`{"arch":"qwen3","tied":true}`))
	f.Add([]byte(`{`))
	f.Fuzz(func(t *testing.T, data []byte) {
		s, err := ParseSidecar("fuzz.json", data)
		if err == nil && s == nil {
			t.Fatal("nil sidecar without an error")
		}
	})
}
