package safetensors

import (
	"bytes"
	"encoding/binary"
	"encoding/json"
	"math"
	"os"
	"path/filepath"
	"runtime"
	"strings"
	"testing"

	"qtool/formats/model"
)

// rawFile builds a safetensors file by hand (independently of the writer):
// header JSON as given, then data.
func rawFile(header string, data []byte) []byte {
	var b bytes.Buffer
	binary.Write(&b, binary.LittleEndian, uint64(len(header)))
	b.WriteString(header)
	b.Write(data)
	return b.Bytes()
}

func f32bytes(v ...float32) []byte {
	b := make([]byte, 4*len(v))
	for i, x := range v {
		binary.LittleEndian.PutUint32(b[4*i:], math.Float32bits(x))
	}
	return b
}

func TestParseHandBuilt(t *testing.T) {
	data := append(f32bytes(1, 2, 3, 4), 0x01, 0xff)
	hdr := `{"__metadata__":{"format":"pt"},"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},"b":{"dtype":"I8","shape":[2],"data_offsets":[16,18]}}`
	f, err := Parse("hand.safetensors", rawFile(hdr, data))
	if err != nil {
		t.Fatal(err)
	}
	if got := f.Names(); len(got) != 2 || got[0] != "w" || got[1] != "b" {
		t.Fatalf("names in file order = %v", got)
	}
	w, err := f.Tensor("w")
	if err != nil {
		t.Fatal(err)
	}
	v, _ := w.Float32()
	for i, want := range []float32{1, 2, 3, 4} {
		if v[i] != want {
			t.Fatalf("w[%d] = %v, want %v", i, v[i], want)
		}
	}
	b, _ := f.Tensor("b")
	bv, _ := b.Int8s()
	if bv[0] != 1 || bv[1] != -1 {
		t.Fatalf("b = %v, want [1 -1]", bv)
	}
	if f.Metadata["format"] != "pt" {
		t.Fatalf("metadata = %v", f.Metadata)
	}
}

func TestParseRejects(t *testing.T) {
	ok16 := f32bytes(1, 2, 3, 4)
	cases := []struct {
		name string
		file []byte
		want string // substring of the error
	}{
		{"short", []byte{1, 2, 3}, "too short"},
		{"header past EOF", func() []byte {
			b := rawFile(`{}`, nil)
			binary.LittleEndian.PutUint64(b, 1000)
			return b
		}(), "runs past the end"},
		{"huge header", func() []byte {
			b := rawFile(`{}`, nil)
			binary.LittleEndian.PutUint64(b, 1<<40)
			return b
		}(), "exceeds"},
		{"bad json", rawFile(`{"w":`, ok16), "not valid JSON"},
		{"offsets past data", rawFile(`{"w":{"dtype":"F32","shape":[2,2],"data_offsets":[0,32]}}`, ok16), `tensor "w": data_offsets [0, 32] outside`},
		{"wrong dtype size", rawFile(`{"w":{"dtype":"F16","shape":[2,2],"data_offsets":[0,16]}}`, ok16), `tensor "w": F16[2 2] needs 8 bytes`},
		{"overlap", rawFile(`{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,12]},"b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}}`, ok16), `overlap`},
		{"gap", rawFile(`{"a":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}}`, f32bytes(0, 1)), `gap`},
		{"trailing bytes", rawFile(`{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}`, ok16), `cover 4 bytes but the data section has 16`},
		{"unknown dtype", rawFile(`{"a":{"dtype":"F8_E4M3","shape":[4],"data_offsets":[0,4]}}`, f32bytes(0)), `unsupported dtype "F8_E4M3"`},
		{"negative dim", rawFile(`{"a":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}}`, f32bytes(0)), `bad dimension`},
		{"bad metadata", rawFile(`{"__metadata__":{"a":1}}`, nil), `__metadata__`},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			_, err := Parse("bad.safetensors", c.file)
			if err == nil {
				t.Fatalf("no error")
			}
			if !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "bad.safetensors") {
				t.Fatalf("error %q does not contain %q and the file name", err, c.want)
			}
		})
	}
}

func testEntries() []Entry {
	f32 := model.FromFloat32([]int{2, 3}, []float32{1, -2, 3.5, 4, 5, 6})
	i8, _ := model.NewDense(model.I8, []int{4}, []byte{1, 2, 0xfe, 0x80})
	i32, _ := model.NewDense(model.I32, []int{2}, []byte{1, 0, 0, 0, 0xff, 0xff, 0xff, 0xff})
	bf, _ := model.NewDense(model.BF16, []int{2}, []byte{0x80, 0x3f, 0x00, 0xc0})
	f16, _ := model.NewDense(model.F16, []int{1, 2}, []byte{0x00, 0x3c, 0x00, 0xc0})
	return []Entry{DenseEntry("a.f32", f32), DenseEntry("b.i8", i8), DenseEntry("c.i32", i32), DenseEntry("d.bf16", bf), DenseEntry("e.f16", f16)}
}

func TestWriteReadRoundTrip(t *testing.T) {
	for _, shard := range []int64{0, 20} {
		dir := t.TempDir()
		entries := testEntries()
		if err := WriteCheckpoint(dir, "model", entries, map[string]string{"format": "pt"}, shard); err != nil {
			t.Fatal(err)
		}
		ck, err := OpenCheckpoint(dir, "model")
		if err != nil {
			t.Fatal(err)
		}
		if shard > 0 && !strings.HasSuffix(ck.Path, ".index.json") {
			t.Fatalf("shard %d: expected an index, opened %s", shard, ck.Path)
		}
		for _, e := range entries {
			d, err := ck.Tensor(e.Name)
			if err != nil {
				t.Fatal(err)
			}
			want, _ := e.Data()
			if d.DType != e.DType || !bytes.Equal(d.Data, want) || len(d.Dims) != len(e.Shape) {
				t.Fatalf("shard %d: %s read back as %v %v %x, wrote %v %v %x", shard, e.Name, d.DType, d.Dims, d.Data, e.DType, e.Shape, want)
			}
		}
		ck.Close()
		left, _ := filepath.Glob(filepath.Join(dir, ".*tmp*"))
		if len(left) > 0 {
			t.Fatalf("temporary files left: %v", left)
		}
	}
}

func TestWriteFailureLeavesNothing(t *testing.T) {
	dir := t.TempDir()
	bad := Entry{Name: "x", DType: model.F32, Shape: []int{4}, Data: func() ([]byte, error) { return make([]byte, 8), nil }}
	err := WriteCheckpoint(dir, "model", []Entry{bad}, nil, 0)
	if err == nil || !strings.Contains(err.Error(), `tensor "x": produced 8 bytes`) {
		t.Fatalf("err = %v", err)
	}
	ents, _ := os.ReadDir(dir)
	if len(ents) != 0 {
		t.Fatalf("files left behind: %v", ents)
	}
}

func TestIndexErrors(t *testing.T) {
	dir := t.TempDir()
	if err := WriteCheckpoint(dir, "model", testEntries(), nil, 20); err != nil {
		t.Fatal(err)
	}
	idxPath := filepath.Join(dir, "model.safetensors.index.json")
	var idx Index
	b, _ := os.ReadFile(idxPath)
	json.Unmarshal(b, &idx)
	idx.WeightMap["ghost"] = idx.WeightMap["a.f32"]
	b, _ = json.Marshal(idx)
	os.WriteFile(idxPath, b, 0o644)
	if _, err := OpenCheckpoint(dir, "model"); err == nil || !strings.Contains(err.Error(), `"ghost"`) {
		t.Fatalf("err = %v, want mention of the ghost tensor", err)
	}
	idx.WeightMap = map[string]string{"a.f32": "../evil.safetensors"}
	b, _ = json.Marshal(idx)
	os.WriteFile(idxPath, b, 0o644)
	if _, err := OpenCheckpoint(dir, "model"); err == nil || !strings.Contains(err.Error(), "plain file name") {
		t.Fatalf("err = %v", err)
	}
	if _, err := OpenCheckpoint(t.TempDir(), "model"); err == nil {
		t.Fatal("empty dir opened")
	}
}

func TestOpenRealCheckpoint(t *testing.T) {
	ck, err := OpenCheckpoint("../../testdata/llama-mini", "model")
	if err != nil {
		t.Fatal(err)
	}
	defer ck.Close()
	in, ok := ck.Info("model.layers.0.self_attn.k_proj.weight")
	if !ok || in.DType != model.F16 || in.Shape[0] != 128 || in.Shape[1] != 256 {
		t.Fatalf("k_proj info = %+v", in)
	}
}

// TestStreamingWriteMemory checks that the writer keeps at most about one
// tensor's data alive: 16 lazily produced 4 MiB tensors must not raise the
// live heap by more than a few tensors' worth.
func TestStreamingWriteMemory(t *testing.T) {
	const n, size = 16, 4 << 20
	var entries []Entry
	for i := 0; i < n; i++ {
		entries = append(entries, Entry{Name: string(rune('a' + i)), DType: model.U8, Shape: []int{size},
			Data: func() ([]byte, error) { return make([]byte, size), nil }})
	}
	var peak uint64
	var ms runtime.MemStats
	runtime.GC()
	runtime.ReadMemStats(&ms)
	base := ms.HeapAlloc
	for i := range entries {
		inner := entries[i].Data
		entries[i].Data = func() ([]byte, error) {
			runtime.GC()
			runtime.ReadMemStats(&ms)
			if ms.HeapAlloc > peak {
				peak = ms.HeapAlloc
			}
			return inner()
		}
	}
	if err := Write(filepath.Join(t.TempDir(), "big.safetensors"), entries, nil); err != nil {
		t.Fatal(err)
	}
	if grown := int64(peak) - int64(base); grown > 3*size {
		t.Fatalf("live heap grew by %d bytes while writing %d tensors of %d bytes: not streaming", grown, n, size)
	}
}

func FuzzParse(f *testing.F) {
	f.Add(rawFile(`{"w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}`, f32bytes(1, 2)))
	f.Add(rawFile(`{"__metadata__":{"format":"pt"},"a":{"dtype":"I8","shape":[],"data_offsets":[0,1]}}`, []byte{7}))
	f.Add(rawFile(`{"a":{"dtype":"BF16","shape":[1,1],"data_offsets":[0,2]},"b":{"dtype":"I64","shape":[1],"data_offsets":[2,10]}}`, make([]byte, 10)))
	f.Add([]byte{0, 0, 0, 0, 0, 0, 0, 0})
	f.Fuzz(func(t *testing.T, data []byte) {
		sf, err := Parse("fuzz", data)
		if err != nil {
			return
		}
		for _, n := range sf.Names() {
			d, err := sf.Tensor(n)
			if err != nil {
				t.Fatalf("validated tensor %q unreadable: %v", n, err)
			}
			if len(d.Data) != d.Len()*d.DType.Size() {
				t.Fatalf("tensor %q: %d bytes for %v", n, len(d.Data), d.Dims)
			}
		}
	})
}

func FuzzParseIndex(f *testing.F) {
	f.Add([]byte(`{"metadata":{"total_size":8},"weight_map":{"a":"model-00001-of-00002.safetensors","b":"model-00002-of-00002.safetensors"}}`))
	f.Add([]byte(`{"weight_map":{"a":"../x.safetensors"}}`))
	f.Add([]byte(`{"weight_map":{}}`))
	f.Fuzz(func(t *testing.T, data []byte) {
		idx, err := ParseIndex("fuzz.index.json", data)
		if err != nil {
			return
		}
		for name, s := range idx.WeightMap {
			if s != filepath.Base(s) || strings.HasPrefix(s, ".") || s == "" {
				t.Fatalf("tensor %q: accepted shard name %q", name, s)
			}
		}
	})
}
