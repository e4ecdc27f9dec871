package calib

import (
	"errors"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"qtool/formats/hf"
	"qtool/formats/model"
	"qtool/quantize"
	"qtool/runtime"
	"qtool/runtime/cpu"
)

// testWindows are two short calibration windows of arbitrary ids.
func testWindows(vocab, n int) [][]int {
	w := [][]int{make([]int, n), make([]int, n)}
	for i := range w {
		for j := range w[i] {
			w[i][j] = (i*977 + j*131 + 7) % vocab
		}
	}
	return w
}

// rtnStep installs every linear of the group RTN-quantized to 3 bits and
// doubles attn_norm at q/k/v (as AWQ rescales norms), so that the quantized
// path leaves the float one; stop > 0 fails at that layer.
func rtnStep(s *Session, stop int) Step {
	return func(l int, p runtime.CapturePoint, x runtime.Buf) error {
		if stop > 0 && l == stop {
			return errStop
		}
		for _, r := range p.Roles() {
			w, err := s.Weight(l, r)
			if err != nil {
				return err
			}
			q, err := quantize.RTN(w, len(w)/x.Cols(), x.Cols(), quantize.Params{Bits: 3, Group: 16, Rule: quantize.AsymAWQ})
			if err != nil {
				return err
			}
			if err := s.SetLinear(l, r, q); err != nil {
				return err
			}
		}
		if p == runtime.CaptureQKV {
			g, err := s.Weight(l, model.AttnNorm)
			if err != nil {
				return err
			}
			g2 := make([]float32, len(g))
			for i, v := range g {
				g2[i] = 2 * v
			}
			return s.SetVector(l, model.AttnNorm, g2)
		}
		return nil
	}
}

var errStop = errors.New("stop")

// TestFloatStreamMatchesRuntime checks TrackFloat against runtime.Model's
// own forward pass of the float model while the session's quantized path
// diverges: at every step the float inputs and residual streams equal what
// runtime.Model.Layer captures and holds, and after every layer the float
// stream equals the float model's residual stream.
func TestFloatStreamMatchesRuntime(t *testing.T) {
	for _, name := range []string{"llama-mini", "qwen3-mini"} {
		t.Run(name, func(t *testing.T) {
			m, err := hf.Open("../../testdata/" + name)
			if err != nil {
				t.Fatal(err)
			}
			windows := testWindows(m.Config.Vocab, 32)
			s, err := NewSession(m, cpu.New(2), windows, 2)
			if err != nil {
				t.Fatal(err)
			}
			defer s.Close()
			if err := s.TrackFloat(); err != nil {
				t.Fatal(err)
			}
			ref, err := runtime.Load(m, cpu.New(2))
			if err != nil {
				t.Fatal(err)
			}
			xs := make([]runtime.Buf, len(windows))
			for i, w := range windows {
				xs[i] = ref.Embed(w)
			}
			download := func(b runtime.Buf) []float32 {
				v := make([]float32, b.Rows()*b.Cols())
				ref.Backend().Download(v, b)
				return v
			}
			quantStep := rtnStep(s, 0)
			for l := 0; l < m.Config.Layers; l++ {
				want := map[runtime.CapturePoint][]float32{}
				var before []float32
				for _, x := range xs {
					before = append(before, download(x)...)
					ref.Layer(l, x, 0, nil, func(_ int, p runtime.CapturePoint, b runtime.Buf) {
						want[p] = append(want[p], download(b)...)
					})
				}
				err := s.Layer(l, func(l int, p runtime.CapturePoint, x runtime.Buf) error {
					if d := maxRelDiff(s.Download(s.FloatInput()), want[p]); d > 1e-6 {
						t.Errorf("layer %d %s: float inputs differ by %g", l, p, d)
					}
					rf, rq := s.FloatResidual()
					switch p {
					case runtime.CaptureO:
						if rf == nil || rq != s.Residual() {
							t.Fatalf("layer %d o: residual streams %v, %v", l, rf, rq)
						}
						if d := maxRelDiff(s.Download(rf), before); d > 1e-6 {
							t.Errorf("layer %d o: float residual differs by %g", l, d)
						}
					case runtime.CaptureDown:
						if rf == nil || rq == nil {
							t.Fatalf("layer %d down: no residual streams", l)
						}
					default:
						if rf != nil || rq != nil {
							t.Errorf("layer %d %s: residual streams outside o and down", l, p)
						}
					}
					if l > 0 && p == runtime.CaptureQKV && maxRelDiff(s.Download(x), want[p]) < 1e-3 {
						t.Errorf("layer %d: the quantized path did not leave the float one", l)
					}
					return quantStep(l, p, x)
				})
				if err != nil {
					t.Fatal(err)
				}
				var after []float32
				for _, x := range xs {
					after = append(after, download(x)...)
				}
				if d := maxRelDiff(s.Download(s.FloatStream()), after); d > 1e-6 {
					t.Errorf("layer %d: float stream differs by %g", l, d)
				}
			}
		})
	}
}

// TestFloatStreamResume interrupts a run that tracks the float model after
// two layers and resumes it from the checkpoint: the result and both
// streams equal an uninterrupted run's exactly. A resumed run that does not
// track the float model, or tracks it from a checkpoint without the float
// stream, is refused.
func TestFloatStreamResume(t *testing.T) {
	m, err := hf.Open("../../testdata/llama-mini")
	if err != nil {
		t.Fatal(err)
	}
	windows := testWindows(m.Config.Vocab, 24)
	run := func(c *Checkpoint, track bool, stop int) (*Session, error) {
		s, err := NewSession(m, cpu.New(2), windows, 2)
		if err != nil {
			t.Fatal(err)
		}
		if c != nil {
			if err := s.SetCheckpoint(c); err != nil {
				t.Fatal(err)
			}
		}
		if track {
			if err := s.TrackFloat(); err != nil {
				return s, err
			}
		}
		return s, s.Run(rtnStep(s, stop), nil)
	}
	whole, err := run(nil, true, 0)
	if err != nil {
		t.Fatal(err)
	}
	dir := filepath.Join(t.TempDir(), ".out.resume")
	c, err := OpenCheckpoint(dir, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := run(c, true, 2); !errors.Is(err, errStop) {
		t.Fatalf("interrupted run: %v", err)
	}
	c.Close()
	reopen := func() *Checkpoint {
		c, err := OpenCheckpoint(dir, nil)
		if err != nil {
			t.Fatal(err)
		}
		if c.LayersDone() != 2 {
			t.Fatalf("%d layers done, want 2", c.LayersDone())
		}
		return c
	}
	c = reopen()
	if _, err := run(c, false, 0); err == nil || !strings.Contains(err.Error(), "float model's stream") {
		t.Errorf("resuming without the float model: %v", err)
	}
	c.Close()
	c = reopen()
	resumed, err := run(c, true, 0)
	c.Close()
	if err != nil {
		t.Fatal(err)
	}
	for what, pair := range map[string][2]runtime.Buf{
		"residual":     {resumed.Residual(), whole.Residual()},
		"float stream": {resumed.FloatStream(), whole.FloatStream()},
	} {
		if got, want := resumed.Download(pair[0]), whole.Download(pair[1]); !reflect.DeepEqual(got, want) {
			t.Errorf("%s differs from the uninterrupted run's", what)
		}
	}
	for _, n := range whole.Out.Names() {
		a, _ := whole.Out.Lookup(n)
		b, _ := resumed.Out.Lookup(n)
		if !reflect.DeepEqual(a, b) {
			t.Errorf("%s differs from the uninterrupted run's", n)
		}
	}

	// a checkpoint written without the float stream
	dir2 := filepath.Join(t.TempDir(), ".plain.resume")
	c, err = OpenCheckpoint(dir2, nil)
	if err != nil {
		t.Fatal(err)
	}
	run(c, false, 1)
	c.Close()
	if c, err = OpenCheckpoint(dir2, nil); err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	if _, err := run(c, true, 0); err == nil || !strings.Contains(err.Error(), "holds no float stream") {
		t.Errorf("tracking the float model from a plain checkpoint: %v", err)
	}
}
