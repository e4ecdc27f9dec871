package kld

import (
	"bytes"
	"encoding/binary"
	"errors"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"testing"

	"qtool/formats/atomicfile"
)

// The hand-worked example: 3 positions over a vocabulary of 4 words.
// base p, model q, the correct token t:
//
//	1: p = (1/2, 1/4, 1/8, 1/8)  q = (1/4, 1/4, 1/4, 1/4)  t = 1
//	   KLD = 1/2 ln 2 + 2·1/8 ln(1/2) = 1/4 ln 2; tops 0, 0 (first of ties); Δp = 0
//	2: p = (1/4, 1/4, 1/4, 1/4)  q = (2/5, 1/5, 1/5, 1/5)  t = 0
//	   KLD = 1/4 ln(5/8) + 3/4 ln(5/4); tops 0, 0; Δp = 2/5 − 1/4 = 0.15
//	3: p = (.1, .2, .3, .4)      q = (.4, .3, .2, .1)      t = 2
//	   KLD = .1 ln(1/4) + .2 ln(2/3) + .3 ln(3/2) + .4 ln 4 = .3 ln 4 + .1 ln(3/2);
//	   tops 3, 0: differ; Δp = .2 − .3 = −0.1
var (
	handP = [][]float64{{0.5, 0.25, 0.125, 0.125}, {0.25, 0.25, 0.25, 0.25}, {0.1, 0.2, 0.3, 0.4}}
	handQ = [][]float64{{0.25, 0.25, 0.25, 0.25}, {0.4, 0.2, 0.2, 0.2}, {0.4, 0.3, 0.2, 0.1}}
	handT = []int{1, 0, 2}
	handK = []float64{math.Ln2 / 4, math.Log(5.0/8)/4 + 0.75*math.Log(5.0/4), 0.3*math.Log(4) + 0.1*math.Log(1.5)}
)

func logs(p []float64) []float64 {
	out := make([]float64, len(p))
	for i, v := range p {
		out[i] = math.Log(v)
	}
	return out
}

func logits32(q []float64, shift float64) []float32 {
	out := make([]float32, len(q))
	for i, v := range q {
		out[i] = float32(math.Log(v) + shift) // logits are log q up to a constant
	}
	return out
}

func near(a, b, tol float64) bool { return math.Abs(a-b) <= tol*(1+math.Abs(b)) }

// TestHandComputed checks CompareRow and every summary figure on the
// example above. The aggregate values were worked out from the per-token
// ones with llama.cpp's formulas (mean ± sqrt(var/(n−1)), interpolated
// percentiles, ppl = exp(mean NLL)).
func TestHandComputed(t *testing.T) {
	var acc Accumulator
	for i := range handP {
		base := logs(handP[i])
		top := 0
		for j, v := range handP[i] {
			if v > handP[i][top] {
				top = j
			}
		}
		tok := CompareRow(base, top, -base[handT[i]], logits32(handQ[i], 3.5), handT[i])
		wantDP := handQ[i][handT[i]] - handP[i][handT[i]]
		if !near(tok.KLD, handK[i], 1e-6) || !near(tok.DeltaP, wantDP, 1e-6) || !near(tok.NLL, -math.Log(handQ[i][handT[i]]), 1e-6) {
			t.Fatalf("token %d: %+v, want KLD %g Δp %g", i, tok, handK[i], wantDP)
		}
		if tok.SameTop != (i < 2) {
			t.Fatalf("token %d: same top %v", i, tok.SameTop)
		}
		acc.Add(tok)
	}
	s := acc.Stats()
	ln := math.Log
	cases := []struct {
		name      string
		got, want float64
	}{
		{"mean KLD", s.KLD.Value, (handK[0] + handK[1] + handK[2]) / 3},
		{"KLD uncertainty", s.KLD.Unc, 0.12034983712045544},
		{"median KLD", s.KLDQ.Median, handK[0]},
		{"max KLD", s.KLDQ.Max, handK[2]},
		{"min KLD", s.KLDQ.Min, handK[1]},
		{"99% KLD", s.KLDQ.P99, 0.02*handK[0] + 0.98*handK[2]}, // 0.99·2 = 1.98 between sorted[1] and sorted[2]
		{"90% KLD", s.KLDQ.P90, 0.2*handK[0] + 0.8*handK[2]},
		{"10% KLD", s.KLDQ.P10, 0.8*handK[1] + 0.2*handK[0]},
		{"same top", s.SameTop.Value, 2.0 / 3},
		{"same top unc", s.SameTop.Unc, 1.0 / 3}, // sqrt(2/3·1/3 / 2)
		{"mean Δp", s.DeltaP.Value, 0.05 / 3},
		{"Δp unc", s.DeltaP.Unc, 0.0726483157256779},
		{"max Δp", s.DeltaPQ.Max, 0.15},
		{"min Δp", s.DeltaPQ.Min, -0.1},
		{"median Δp", s.DeltaPQ.Median, 0},
		{"RMS Δp", s.RMSDP.Value, math.Sqrt((0.15*0.15 + 0.1*0.1) / 3)},
		{"RMS Δp unc", s.RMSDP.Unc, 0.03126602153399283},
		{"PPL(Q)", s.PPL.Value, math.Cbrt(4 * 2.5 * 5)},
		{"PPL(Q) unc", s.PPL.Unc, 0.7525758274520548},
		{"PPL(base)", s.PPLBase.Value, math.Cbrt(4 * 4 / 0.3)},
		{"PPL(base) unc", s.PPLBase.Unc, 0.2287615383797218},
		{"ln ratio", s.LnRatio.Value, (ln(4) + ln(2.5) + ln(5) - 2*ln(4) - ln(1/0.3)) / 3},
		{"ln ratio unc", s.LnRatio.Unc, 0.2529548571365343},
		{"ratio", s.Ratio.Value, math.Cbrt(50 / (16 / 0.3))},
		{"ratio unc", s.Ratio.Unc, 0.24757119622007767},
		{"diff", s.Diff.Value, math.Cbrt(50) - math.Cbrt(16/0.3)},
		{"cor", s.LnPPLCor, -0.7475755919429515},
	}
	for _, c := range cases {
		if !near(c.got, c.want, 1e-6) {
			t.Errorf("%s = %.9g, want %.9g", c.name, c.got, c.want)
		}
	}
	if s.Count != 3 || s.KLDHistogram.Under+s.KLDHistogram.Over+sum(s.KLDHistogram.Counts) != 3 {
		t.Errorf("count %d, histogram %+v", s.Count, s.KLDHistogram)
	}
}

func sum(v []int) int {
	s := 0
	for _, x := range v {
		s += x
	}
	return s
}

// TestRowEncoding stores the example's base rows the way a logits file does
// and checks that the KLDs read back agree with the exact ones to 3e-4
// relative: the 16-bit codes hold log p to step/2 = 1.8e-4 nats, and the
// error is first order in it when the KLD is large (0.17 and 0.46 here).
func TestRowEncoding(t *testing.T) {
	lp := make([]float64, 4)
	for i := range handP {
		var r Row
		EncodeRow(&r, logits32(handP[i], -7), handT[i], lp)
		r.LogProbs(lp, Range)
		tok := CompareRow(lp, int(r.Top), float64(r.NLL), logits32(handQ[i], 0), handT[i])
		if math.Abs(tok.KLD-handK[i]) > 3e-4*handK[i] {
			t.Errorf("token %d: KLD %g through the encoding, want %g", i, tok.KLD, handK[i])
		}
	}
	// A token far below the top is stored as "below range" (p = 0).
	var r Row
	EncodeRow(&r, []float32{0, -100, -1}, 0, make([]float64, 3))
	if r.Codes[1] != floorCode || r.Codes[0] != 0 {
		t.Fatalf("codes %v", r.Codes)
	}
}

// writeSmall writes a logits file of a 4-word vocabulary: 2 chunks of
// ctx 4, 3 scored rows each.
func writeSmall(t testing.TB, path string) ([]int, Header) {
	ids := []int{1, 2, 3, 0, 1, 1, 2, 3}
	h := Header{Model: "m", Text: "t.txt", TextSHA256: TextSHA256([]byte("text")), Tokens: 9, Ctx: 4,
		Protocol: "gptq", Chunks: 2, Scored: 3, BOS: -1, Vocab: 4}
	w, err := Create(path, h, ids)
	if err != nil {
		t.Fatal(err)
	}
	lp := make([]float64, 4)
	var r Row
	for c := 0; c < 2; c++ {
		for i := 0; i < 3; i++ {
			EncodeRow(&r, logits32(handP[i], float64(c)), ids[c*4+i+1], lp)
			if err := w.WriteRow(r); err != nil {
				t.Fatal(err)
			}
		}
	}
	if err := w.Close(); err != nil {
		t.Fatal(err)
	}
	return ids, w.Header()
}

func TestLogitsFile(t *testing.T) {
	path := filepath.Join(t.TempDir(), "x.kld")
	ids, h := writeSmall(t, path)
	f, err := Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	if f.Chunks != 2 || f.Vocab != 4 || len(f.IDs) != 8 || f.IDs[3] != 0 {
		t.Fatalf("header %+v ids %v", f.Header, f.IDs)
	}
	rows := make([]Row, 3)
	lp := make([]float64, 4)
	for c := 0; c < 2; c++ {
		if err := f.ReadChunk(c, rows); err != nil {
			t.Fatal(err)
		}
		for i, r := range rows {
			r.LogProbs(lp, f.Range)
			for j := range lp {
				if math.Abs(lp[j]-math.Log(handP[i][j])) > 3e-4 {
					t.Fatalf("chunk %d row %d: log p %v, want log %v", c, i, lp, handP[i])
				}
			}
			if want := -math.Log(handP[i][ids[c*4+i+1]]); !near(float64(r.NLL), want, 1e-6) {
				t.Fatalf("nll %v, want %v", r.NLL, want)
			}
		}
	}
	if err := f.ReadChunk(2, rows); err == nil {
		t.Fatal("read chunk 2 of 2")
	}

	other := append([]int(nil), ids...)
	other[5] = 3
	cases := []struct {
		name string
		want Header
		ids  []int
		err  string
	}{
		{"same", h, ids, ""},
		{"first chunk only", withChunks(h, 1), ids[:4], ""},
		{"other ids", h, other, "token ids: file 1 at position 5, this run 3"},
		{"other ctx", withCtx(h, 8), ids, "ctx: file 4, this run 8"},
		{"more chunks", withChunks(h, 3), ids, "chunks: file 2, this run 3"},
		{"other vocab", withVocab(h, 5), ids, "vocabulary: file 4, this run 5"},
	}
	for _, tc := range cases {
		err := f.Check(tc.want, tc.ids)
		if tc.err == "" && err != nil || tc.err != "" && (err == nil || !strings.Contains(err.Error(), tc.err) || !errors.Is(err, ErrMismatch)) {
			t.Errorf("%s: %v, want %q", tc.name, err, tc.err)
		}
	}
}

// TestWriterOutput: a logits file is written as every qtool output is —
// whole or not at all, one writer at a time, never into a FIFO.
func TestWriterOutput(t *testing.T) {
	dir := t.TempDir()
	path := filepath.Join(dir, "base.kld")
	ids := []int{1, 2, 3, 0}
	h := Header{Model: "m", Text: "t.txt", Tokens: 5, Ctx: 4, Protocol: "gptq", Chunks: 1, Scored: 3, BOS: -1, Vocab: 4}
	w, err := Create(path, h, ids)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := Create(path, h, ids); !errors.Is(err, atomicfile.ErrLocked) {
		t.Errorf("a second writer of %s: %v, want %v", path, err, atomicfile.ErrLocked)
	}
	r := Row{Codes: make([]uint16, 4)}
	if err := w.WriteRow(r); err != nil {
		t.Fatal(err)
	}
	// one row of the three the header promises
	if err := w.Close(); err == nil || !strings.Contains(err.Error(), "1 rows written, the header promises 3") {
		t.Errorf("a short file's Close: %v", err)
	}
	if names := dirEntries(t, dir); len(names) != 0 {
		t.Errorf("a short file left %v", names)
	}
	w, err = Create(path, h, ids) // the lock went with the failed Close
	if err != nil {
		t.Fatal(err)
	}
	w.Abort()
	if names := dirEntries(t, dir); len(names) != 0 {
		t.Errorf("Abort left %v", names)
	}
	fifo := filepath.Join(dir, "fifo.kld")
	if err := syscall.Mkfifo(fifo, 0o644); err != nil {
		t.Fatal(err)
	}
	if _, err := Create(fifo, h, ids); err == nil || !strings.Contains(err.Error(), "FIFO") {
		t.Errorf("Create on a FIFO: %v", err)
	}
	if names := dirEntries(t, dir); !slices.Equal(names, []string{"fifo.kld"}) {
		t.Errorf("a refused FIFO left %v", names)
	}
}

// dirEntries lists the names in dir, dot files included.
func dirEntries(t *testing.T, dir string) []string {
	t.Helper()
	paths, err := filepath.Glob(filepath.Join(dir, "*"))
	if err != nil {
		t.Fatal(err)
	}
	for i, p := range paths {
		paths[i] = filepath.Base(p)
	}
	return paths
}

func withChunks(h Header, n int) Header { h.Chunks = n; return h }
func withCtx(h Header, n int) Header    { h.Ctx = n; return h }
func withVocab(h Header, n int) Header  { h.Vocab = n; return h }

// TestLogitsFileCorrupt checks that damaged files are refused with the file
// name and what is wrong.
func TestLogitsFileCorrupt(t *testing.T) {
	dir := t.TempDir()
	good := filepath.Join(dir, "good.kld")
	writeSmall(t, good)
	data, err := os.ReadFile(good)
	if err != nil {
		t.Fatal(err)
	}
	hlen := int(binary.LittleEndian.Uint32(data[len(Magic):]))
	idsAt := len(Magic) + 4 + hlen
	edit := func(f func(b []byte) []byte) []byte { return f(bytes.Clone(data)) }
	cases := []struct {
		name string
		data []byte
		want string
	}{
		{"empty", nil, "too short"},
		{"bad magic", edit(func(b []byte) []byte { b[0] = 'X'; return b }), "does not start with"},
		{"huge header", edit(func(b []byte) []byte { binary.LittleEndian.PutUint32(b[len(Magic):], 1<<30); return b }), "header length"},
		{"header not JSON", edit(func(b []byte) []byte { b[len(Magic)+4] = '['; return b }), "header"},
		{"truncated", data[:len(data)-1], "truncated"},
		{"appended", append(bytes.Clone(data), 0), "header implies"},
		{"ids changed", edit(func(b []byte) []byte { b[idsAt] ^= 1; return b }), "ids hash"},
	}
	for _, tc := range cases {
		_, err := Decode(bytes.NewReader(tc.data), int64(len(tc.data)), "bad.kld")
		if err == nil || !strings.Contains(err.Error(), tc.want) || !strings.Contains(err.Error(), "bad.kld") {
			t.Errorf("%s: %v, want an error naming bad.kld containing %q", tc.name, err, tc.want)
		}
	}
	// A corrupt row is found when its chunk is read.
	b := edit(func(b []byte) []byte {
		binary.LittleEndian.PutUint32(b[idsAt+4*8+8:], 99) // top of row 0
		return b
	})
	f, err := Decode(bytes.NewReader(b), int64(len(b)), "bad.kld")
	if err != nil {
		t.Fatal(err)
	}
	if err := f.ReadChunk(0, make([]Row, 3)); err == nil || !strings.Contains(err.Error(), "corrupt") {
		t.Fatalf("corrupt row: %v", err)
	}
}

// FuzzDecode feeds arbitrary bytes to the logits-file parser: it must not
// panic or allocate beyond what the input's size allows, and a file it
// accepts must have readable chunks.
func FuzzDecode(f *testing.F) {
	path := filepath.Join(f.TempDir(), "seed.kld")
	writeSmall(f, path)
	seed, err := os.ReadFile(path)
	if err != nil {
		f.Fatal(err)
	}
	f.Add(seed)
	f.Add(seed[:40])
	f.Add([]byte(Magic))
	f.Fuzz(func(t *testing.T, data []byte) {
		lf, err := Decode(bytes.NewReader(data), int64(len(data)), "fuzz.kld")
		if err != nil {
			return
		}
		rows := make([]Row, lf.Scored)
		lp := make([]float64, lf.Vocab)
		for c := 0; c < lf.Chunks; c++ {
			if lf.ReadChunk(c, rows) != nil {
				continue
			}
			for _, r := range rows {
				r.LogProbs(lp, lf.Range)
			}
		}
	})
}
