package shard

import (
	"encoding/json"
	"strings"
	"testing"

	"qtool/formats/model"
)

// tinyModel is a float model of tinyConfig with zero weights.
func tinyModel() *model.Model {
	c := tinyConfig
	m := model.New(c)
	set := func(name string, shape ...int) {
		m.Set(name, model.FromFloat32(shape, make([]float32, model.NumElements(shape))))
	}
	set("embed", c.Vocab, c.Hidden)
	set("lm_head", c.Vocab, c.Hidden)
	set("norm", c.Hidden)
	set("layers.0.attn_norm", c.Hidden)
	set("layers.0.mlp_norm", c.Hidden)
	set("layers.0.q", c.QDim(), c.Hidden)
	set("layers.0.k", c.KVDim(), c.Hidden)
	set("layers.0.v", c.KVDim(), c.Hidden)
	set("layers.0.o", c.Hidden, c.QDim())
	set("layers.0.gate", c.Intermediate, c.Hidden)
	set("layers.0.up", c.Intermediate, c.Hidden)
	set("layers.0.down", c.Hidden, c.Intermediate)
	return m
}

func TestTinyManifest(t *testing.T) {
	man, err := Plan(tinyModel(), 2)
	if err != nil {
		t.Fatal(err)
	}
	data, err := json.Marshal(man)
	if err != nil {
		t.Fatal(err)
	}
	back, err := ParseManifest("tiny", data)
	if err != nil {
		t.Fatal(err)
	}
	if len(back.Tensors) != 12 || back.WorldSize != 2 {
		t.Fatalf("reparsed %d tensors, world %d", len(back.Tensors), back.WorldSize)
	}
	e, _ := back.Entry("embed")
	if e.Split != Vocab || e.Ranges[0] != [2]int{0, 5} || e.Ranges[1] != [2]int{5, 10} {
		t.Fatalf("embed entry %+v", e)
	}
}

// FuzzParseManifest feeds arbitrary bytes to the manifest parser: it must
// never panic, and whatever it accepts must describe consistent ranges.
func FuzzParseManifest(f *testing.F) {
	for _, n := range []int{1, 2} {
		man, err := Plan(tinyModel(), n)
		if err != nil {
			f.Fatal(err)
		}
		data, _ := json.Marshal(man)
		f.Add(data)
		f.Add([]byte(strings.Replace(string(data), `"world_size":`+string(rune('0'+n)), `"world_size":3`, 1)))
		f.Add([]byte(strings.Replace(string(data), `[0,5]`, `[0,4]`, 1)))
	}
	f.Add([]byte(`{}`))
	f.Add([]byte(`{"format":"qtool-tp-shard","version":1,"world_size":1}`))
	f.Add([]byte(`not json`))
	f.Fuzz(func(t *testing.T, data []byte) {
		man, err := ParseManifest("fuzz", data)
		if err != nil {
			return
		}
		for i := range man.Tensors {
			e := &man.Tensors[i]
			for r := 0; r < man.WorldSize; r++ {
				s := e.PartShape(r)
				for _, d := range s {
					if d < 0 {
						t.Fatalf("%s rank %d: negative piece shape %v", e.Name, r, s)
					}
				}
			}
		}
	})
}
