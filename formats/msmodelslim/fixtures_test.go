package msmodelslim

import (
	"math"
	"os"
	"path/filepath"
	"testing"

	"qtool/formats/hf"
	"qtool/formats/model"
	"qtool/formats/safetensors"
)

const (
	testdata   = "../../testdata"
	sharedMS   = "../../../shared/models/msmodelslim"
	smoothDir  = testdata + "/msmodelslim/llama-mini-w8a8-smooth"
	floatLlama = testdata + "/llama-mini"
)

// fixtureDir returns the directory of an msmodelslim fixture, skipping the
// test when it is not present (the W8A16 ones live only in ../shared).
func fixtureDir(t testing.TB, name string) string {
	t.Helper()
	for _, d := range []string{filepath.Join(testdata, "msmodelslim", name), filepath.Join(sharedMS, name)} {
		if _, err := os.Stat(filepath.Join(d, DescriptionFile)); err == nil {
			return d
		}
	}
	t.Skipf("fixture %s not present", name)
	return ""
}

// rawTensor reads one tensor of a fixture's weights file directly.
func rawTensor(t *testing.T, dir, name string) []float32 {
	t.Helper()
	f, err := safetensors.Open(filepath.Join(dir, WeightBaseV0+".safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	d, err := f.Tensor(name)
	if err != nil {
		t.Fatal(err)
	}
	v, err := d.Float32()
	if err != nil {
		t.Fatal(err)
	}
	return v
}

func TestOpenFixtures(t *testing.T) {
	fp, err := hf.Open(floatLlama)
	if err != nil {
		t.Fatal(err)
	}
	defer fp.Close()
	tests := []struct {
		name      string
		group     int  // W8A16 group size (0 per channel)
		asym      bool // W8A16 with non-zero offsets
		w8a8      bool
		maxRelErr float64 // max |deq − w_float| / scale
	}{
		{"llama-mini-w8a16-perchannel", 0, true, false, 0.5},
		{"llama-mini-w8a16-g128", 128, false, false, 0.5},
		// W8A8: the smoothing factors are recovered from fp16-rounded norms and the
		// weight scale from deq_scale / fp16 input_scale, so allow a little more.
		{"llama-mini-w8a8-smooth", 0, false, true, 0.6},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := fixtureDir(t, tc.name)
			m, err := Open(dir)
			if err != nil {
				t.Fatal(err)
			}
			defer m.Close()
			if err := m.CheckShapes(); err != nil {
				t.Fatal(err)
			}
			if m.Format != Format || m.Config.Layers != 4 || m.Config.Hidden != 256 || m.Config.KVHeads != 2 {
				t.Errorf("format %q config %+v", m.Format, m.Config)
			}
			worst := 0.0
			for l := 0; l < m.Config.Layers; l++ {
				// SmoothQuant: linears after a norm see x / s with s = plain/module
				// per input channel, so their weights were scaled by s.
				var smooth [2][]float32
				if tc.w8a8 {
					for i := range smooth {
						base, _ := hf.Module(l, []model.Role{model.AttnNorm, model.MLPNorm}[i])
						plain := rawTensor(t, dir, base+".weight")
						folded := rawTensor(t, dir, base+".module.weight")
						smooth[i] = make([]float32, len(plain))
						for k := range plain {
							smooth[i][k] = plain[k] / folded[k]
						}
						for _, bias := range []model.Role{model.AttnNormBias, model.MLPNormBias} {
							bt, err := m.Layer(l, bias)
							if err != nil {
								t.Fatal(err)
							}
							bv, _ := bt.Float32()
							for _, x := range bv {
								if x != 0 {
									t.Fatalf("layer %d %s: non-zero module.bias %g (fixture has zeros)", l, bias, x)
								}
							}
						}
						nt, _ := m.Layer(l, []model.Role{model.AttnNorm, model.MLPNorm}[i])
						nv, _ := nt.Float32()
						for k := range nv {
							if nv[k] != folded[k] {
								t.Fatalf("layer %d: norm is not the folded module.weight", l)
							}
						}
					}
				}
				for _, role := range model.Linears {
					tt, _ := m.Layer(l, role)
					wt, _ := fp.Layer(l, role)
					wf, _ := wt.Float32()
					var q *model.Quantized
					if tc.w8a8 {
						a, ok := tt.(*model.W8A8)
						if !ok {
							t.Fatalf("layer %d %s is %T, want *model.W8A8", l, role, tt)
						}
						q = a.Weight
						checkQuantBias(t, l, role, a)
						var s []float32
						switch role {
						case model.Q, model.K, model.V:
							s = smooth[0]
						case model.Gate, model.Up:
							s = smooth[1]
						}
						if s != nil {
							for i := range wf {
								wf[i] *= s[i%q.Cols]
							}
						}
					} else {
						var ok bool
						q, ok = tt.(*model.Quantized)
						if !ok {
							t.Fatalf("layer %d %s is %T, want *model.Quantized", l, role, tt)
						}
						if q.Bits != 8 || q.GroupSize != tc.group || (q.Zero != nil) != tc.asym {
							t.Fatalf("layer %d %s: bits %d group %d asym %v", l, role, q.Bits, q.GroupSize, q.Zero != nil)
						}
					}
					deq, _ := q.Float32()
					for i := range deq {
						r, c := i/q.Cols, i%q.Cols
						s := float64(q.Scale[r*q.Groups()+q.Group(c)])
						if e := math.Abs(float64(deq[i])-float64(wf[i])) / s; e > worst {
							worst = e
						}
					}
				}
			}
			t.Logf("max |dequantized − float| = %.4f quantization steps", worst)
			if worst > tc.maxRelErr*1.01 {
				t.Errorf("dequantized weights differ from llama-mini by %.3f steps, want ≤ %.2f (offset sign or scale layout wrong?)", worst, tc.maxRelErr)
			}
		})
	}
}

// checkQuantBias verifies msmodelslim's quant_bias = round(bias/deq_scale −
// input_offset·Σ_k W_q[n][k]) with bias 0 (llama has none).
func checkQuantBias(t *testing.T, l int, role model.Role, a *model.W8A8) {
	t.Helper()
	q := a.Weight
	for n := 0; n < q.Rows; n++ {
		sum := 0
		for _, v := range q.Q[n*q.Cols : (n+1)*q.Cols] {
			sum += int(v)
		}
		want := int32(math.Round(-float64(a.InputOffset) * float64(sum)))
		if d := a.QuantBias[n] - want; d > 1 || d < -1 {
			t.Fatalf("layer %d %s row %d: quant_bias %d, want −input_offset·ΣW = %d", l, role, n, a.QuantBias[n], want)
		}
	}
}
