package main

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"qtool/convert"
	"qtool/formats/hf"
	"qtool/formats/model"
	"qtool/formats/safetensors"
)

// TestWeightsBeyondConfigLayers: weights of more layers than
// num_hidden_layers are an error naming the extra tensors, in inspect,
// verify and convert alike (not a silently shorter model).
func TestWeightsBeyondConfigLayers(t *testing.T) {
	fewer := withConfig(t, map[string]any{"num_hidden_layers": 2})
	// layers.9.*: a stray layer beyond the config's 4.
	src, err := convert.Open(llamaMini)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	q, _ := src.Lookup(model.Name(0, model.Q))
	src.Set(model.Name(9, model.Q), q)
	stray := filepath.Join(t.TempDir(), "stray")
	if err := hf.Write(src, stray, hf.WriteOptions{}); err != nil {
		t.Fatal(err)
	}
	for _, c := range []struct {
		dir, want string
	}{{fewer, `layers.2.`}, {stray, `layers.9.q`}} {
		for _, args := range [][]string{
			{"inspect", c.dir},
			{"verify", "-q", "--device", "cpu", "--max-new", "1", c.dir},
			{"convert", "--to", "kuiper-fp32", c.dir, "-o", filepath.Join(t.TempDir(), "x.bin")},
		} {
			_, err := runConvertApp(t, args...)
			if err == nil || !strings.Contains(err.Error(), c.want) || !strings.Contains(err.Error(), "num_hidden_layers") {
				t.Errorf("qtool %s: err = %v, want it to name %s… and num_hidden_layers", args[0], err, c.want)
			}
		}
	}
}

// TestMsModelSlimWithoutDescription: an msmodelslim directory whose
// description file is missing is reported as such.
func TestMsModelSlimWithoutDescription(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "w8a8")
	if err := os.CopyFS(dir, os.DirFS(w8a8Mini)); err != nil {
		t.Fatal(err)
	}
	os.Remove(filepath.Join(dir, "quant_model_description.json"))
	_, err := runApp(t, "inspect", dir)
	if err == nil || !strings.Contains(err.Error(), "msmodelslim export without its quant_model_description.json") {
		t.Fatalf("err = %v", err)
	}
}

// TestCorruptHeaderErrorIsStable: a header with several bad tensors names
// the same one on every read (not the map's random order).
func TestCorruptHeaderErrorIsStable(t *testing.T) {
	var hdr strings.Builder
	hdr.WriteString(`{`)
	for i := range 20 {
		if i > 0 {
			hdr.WriteString(",")
		}
		// every entry claims 8 bytes of an F32[4] tensor (16 needed)
		hdr.WriteString(`"t` + string(rune('a'+i)) + `":{"dtype":"F32","shape":[4],"data_offsets":[0,8]}`)
	}
	hdr.WriteString(`}`)
	data := binary.LittleEndian.AppendUint64(nil, uint64(hdr.Len()))
	data = append(append(data, hdr.String()...), make([]byte, 8)...)
	first := ""
	for range 30 {
		_, err := safetensors.Parse("bad.safetensors", data)
		if err == nil {
			t.Fatal("a corrupt header parsed")
		}
		if first == "" {
			first = err.Error()
			if !strings.Contains(first, `"ta"`) {
				t.Errorf("error %q does not name the first tensor by name, ta", first)
			}
		} else if err.Error() != first {
			t.Fatalf("errors differ between reads:\n%s\n%s", first, err)
		}
	}
}
