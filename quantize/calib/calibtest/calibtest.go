// Package calibtest holds helpers for the long end-to-end tests of the
// calibration methods (GPTQ, AWQ, SmoothQuant): the protocol's 128 × 512
// windows of train.txt, the reference tokenization of sotu-test.raw, and a
// perplexity run of a result model. Tests use it behind QTOOL_LONG=1.
package calibtest

import (
	"encoding/binary"
	"encoding/json"
	"os"
	"path/filepath"
	"strconv"
	"testing"
	"time"

	"qtool/convert"
	"qtool/formats/hf"
	"qtool/formats/model"
	"qtool/quantize/calib"
	"qtool/runtime"
	"qtool/runtime/cpu"
	"qtool/runtime/tokenizer"
)

// TrainText is the calibration corpus of the protocol: shared/corpus/train.txt
// in the shared folder beside the repository (../shared from the module
// root), or $QTOOL_TRAIN_TEXT.
func TrainText() string {
	if p := os.Getenv("QTOOL_TRAIN_TEXT"); p != "" {
		return p
	}
	dir, err := os.Getwd()
	if err != nil {
		return "train.txt"
	}
	for {
		if _, err := os.Stat(filepath.Join(dir, "go.mod")); err == nil {
			return filepath.Join(dir, "..", "shared", "corpus", "train.txt")
		}
		parent := filepath.Dir(dir)
		if parent == dir {
			return "train.txt"
		}
		dir = parent
	}
}

// Long skips t unless QTOOL_LONG is set.
func Long(t testing.TB) {
	t.Helper()
	if os.Getenv("QTOOL_LONG") == "" {
		t.Skip("long end-to-end run: set QTOOL_LONG=1")
	}
	if _, err := os.Stat(TrainText()); err != nil {
		t.Skip("no " + TrainText())
	}
}

// EnvInt reads an integer environment variable with a default.
func EnvInt(name string, def int) int {
	if v, err := strconv.Atoi(os.Getenv(name)); err == nil {
		return v
	}
	return def
}

// Session opens the HF model in dir and a calibration session over
// nsamples × seqlen windows of train.txt (tokenized once per model and
// cached in the OS temp dir).
func Session(t testing.TB, dir string, nsamples, seqlen int) *calib.Session {
	t.Helper()
	tok, err := tokenizer.LoadDir(dir)
	if err != nil {
		t.Fatal(err)
	}
	cache := filepath.Join(os.TempDir(), "qtool-calibtest-"+filepath.Base(dir)+".ids")
	var ids []int
	if b, err := os.ReadFile(cache); err == nil {
		ids = make([]int, len(b)/4)
		for i := range ids {
			ids[i] = int(binary.LittleEndian.Uint32(b[4*i:]))
		}
	} else {
		text, err := calib.ReadText(TrainText())
		if err != nil {
			t.Fatal(err)
		}
		ids = tokenizer.EncodeWithBOS(tok, text)
		b := make([]byte, 4*len(ids))
		for i, id := range ids {
			binary.LittleEndian.PutUint32(b[4*i:], uint32(id))
		}
		_ = os.WriteFile(cache, b, 0o644)
	}
	win, err := calib.Windows(ids, nsamples, seqlen)
	if err != nil {
		t.Fatal(err)
	}
	m, err := hf.Open(dir)
	if err != nil {
		t.Fatal(err)
	}
	s, err := calib.NewSession(m, cpu.New(2), win, 2)
	if err != nil {
		t.Fatal(err)
	}
	return s
}

// Perplexity evaluates m on the reference ids of sotu-test.raw in dir (all
// chunks when chunks is 0).
func Perplexity(t testing.TB, m *model.Model, dir string, chunks int) runtime.PPLResult {
	t.Helper()
	return PerplexityOf(t, m, dir, "sotu-test.raw", chunks)
}

// PerplexityOf evaluates m on the reference ids of a test file (ids-FILE.json
// in dir: sotu-test.raw or moby-test.raw), all chunks when chunks is 0.
func PerplexityOf(t testing.TB, m *model.Model, dir, file string, chunks int) runtime.PPLResult {
	t.Helper()
	b, err := os.ReadFile(filepath.Join(dir, "ids-"+file+".json"))
	if err != nil {
		t.Fatal(err)
	}
	var ids []int
	if err := json.Unmarshal(b, &ids); err != nil {
		t.Fatal(err)
	}
	rt, err := runtime.Load(m, cpu.New(2))
	if err != nil {
		t.Fatal(err)
	}
	r, err := runtime.Perplexity(rt, ids, runtime.PPLOptions{MaxChunks: chunks})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

// Bench runs quantize b.N times over fresh sessions of the protocol's
// 128 × 512 windows (tokenization cached, not timed) and reports the peak
// RSS. It skips without train.txt.
func Bench(b *testing.B, dir string, quantize func(s *calib.Session) error) {
	if _, err := os.Stat(TrainText()); err != nil {
		b.Skip("no " + TrainText())
	}
	Session(b, dir, 1, 512) // warm the token cache
	b.ResetTimer()
	for i := 0; i < b.N; i++ {
		s := Session(b, dir, EnvInt("NSAMPLES", 128), 512)
		if err := quantize(s); err != nil {
			b.Fatal(err)
		}
	}
	b.ReportMetric(calib.PeakRSSMiB(), "peakRSS-MiB")
}

// Row is one line of the perplexity table: a method run on a
// calibration session, and the perplexity of sotu-test.raw it must reach.
type Row struct {
	Name     string
	MaxPPL   float64
	Quantize func(s *calib.Session) error
	// Format, when set, writes the result in that format (convert.SaveWith)
	// and measures the model read back from the files.
	Format string
	// MaxMoby, when > 0, also bounds the perplexity of moby-test.raw.
	MaxMoby float64
}

// Table runs every row on the model in dir with the protocol's 128 × 512
// windows and checks the perplexity over all chunks (fewer with $CHUNKS,
// which then only reports).
func Table(t *testing.T, dir string, rows []Row) {
	for _, row := range rows {
		t.Run(row.Name, func(t *testing.T) {
			s := Session(t, dir, EnvInt("NSAMPLES", 128), 512)
			t0 := time.Now()
			if err := row.Quantize(s); err != nil {
				t.Fatal(err)
			}
			t.Logf("quantized in %v", time.Since(t0))
			m := s.Out
			if row.Format != "" {
				out := filepath.Join(t.TempDir(), "out")
				if err := convert.SaveWith(m, row.Format, out, convert.SaveOptions{}); err != nil {
					t.Fatal(err)
				}
				back, err := convert.Open(out)
				if err != nil {
					t.Fatal(err)
				}
				defer back.Close()
				m = back
				t.Logf("wrote and read back %s (%s)", out, row.Format)
			}
			r := Perplexity(t, m, dir, EnvInt("CHUNKS", 0))
			t.Logf("%s: %v", row.Name, r)
			if EnvInt("CHUNKS", 0) == 0 && r.PPL > row.MaxPPL {
				t.Errorf("ppl %.4f, want <= %.2f", r.PPL, row.MaxPPL)
			}
			if row.MaxMoby > 0 {
				mr := PerplexityOf(t, m, dir, "moby-test.raw", EnvInt("CHUNKS", 0))
				t.Logf("%s: moby-test.raw %v", row.Name, mr)
				if EnvInt("CHUNKS", 0) == 0 && mr.PPL > row.MaxMoby {
					t.Errorf("moby-test.raw ppl %.4f, want <= %.2f", mr.PPL, row.MaxMoby)
				}
			}
		})
	}
}
