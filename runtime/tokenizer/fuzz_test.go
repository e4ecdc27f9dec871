package tokenizer

import (
	"encoding/binary"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// checkUsable runs a loaded tokenizer over a few strings: ids must be inside
// the vocabulary and nothing may panic.
func checkUsable(t *testing.T, tk Tokenizer) {
	for _, s := range []string{"hello world", " 12345  tabs\t\nend", "🦙 café", ""} {
		ids := tk.Encode(s)
		for _, id := range ids {
			if id < 0 || id >= tk.VocabSize() {
				t.Fatalf("Encode(%q) gave id %d outside vocabulary %d", s, id, tk.VocabSize())
			}
			_ = tk.DecodeToken(id)
		}
		_ = tk.Decode(ids)
	}
	_ = tk.Decode([]int{-1, 0, 1 << 30})
}

// FuzzLoadSentencePiece parses arbitrary model files and runs what loads.
// Its inputs are kilobytes, and the fuzzer minimizes each new interesting
// one for up to a minute by default, which leaves it a few inputs a
// minute: fuzz it with -fuzzminimizetime=10x (0.5 M inputs in 20 s on two
// cores).
func FuzzLoadSentencePiece(f *testing.F) {
	spm, err := os.ReadFile(filepath.Join(testdata, "llama-mini", SentencePieceFile))
	if err != nil {
		f.Fatal(err)
	}
	f.Add(spm)
	// The model's first pieces (the special and byte pieces, a few merges)
	// with its other fields: a valid model of 5 KB.
	small := sentencePieceHead(f, spm, 300)
	if _, err := ParseSentencePiece(small); err != nil {
		f.Fatalf("the model's first 300 pieces: %v", err)
	}
	f.Add(small)
	for _, n := range []int{0, 16, 200, 4000} {
		f.Add(spm[:n])
	}
	f.Fuzz(func(t *testing.T, data []byte) {
		tk, err := ParseSentencePiece(data)
		if err != nil {
			return
		}
		checkUsable(t, tk)
	})
}

// sentencePieceHead returns the SentencePiece model spm (a ModelProto)
// with only its first n pieces (field 1) and all its other fields.
func sentencePieceHead(tb testing.TB, spm []byte, n int) []byte {
	var out []byte
	for i, pieces := 0, 0; i < len(spm); {
		tag, k := binary.Uvarint(spm[i:])
		if k <= 0 || tag&7 != 2 {
			tb.Fatalf("sentencepiece model: field at byte %d is not length-delimited", i)
		}
		size, m := binary.Uvarint(spm[i+k:])
		end := i + k + m + int(size)
		if m <= 0 || end > len(spm) {
			tb.Fatalf("sentencepiece model: field at byte %d overruns the file", i)
		}
		if tag>>3 != 1 || pieces < n {
			out = append(out, spm[i:end]...)
		}
		if tag>>3 == 1 {
			pieces++
		}
		i = end
	}
	return out
}

// minimalJSON is a small valid byte-level BPE tokenizer.json.
const minimalJSON = `{"added_tokens":[{"id":6,"content":"<|end|>","special":true}],
"normalizer":{"type":"NFC"},
"pre_tokenizer":{"type":"Sequence","pretokenizers":[{"type":"Split","pattern":{"Regex":"\\s+(?!\\S)|\\s+|\\p{L}+"},"behavior":"Isolated","invert":false},{"type":"ByteLevel","add_prefix_space":false,"use_regex":false}]},
"decoder":{"type":"ByteLevel"},
"model":{"type":"BPE","vocab":{"a":0,"b":1,"ab":2,"Ġ":3,"Ġab":4,"c":5},"merges":[["a","b"],["Ġ","ab"]]}}`

func FuzzLoadTokenizerJSON(f *testing.F) {
	tj, err := os.ReadFile(filepath.Join(testdata, "qwen3-mini", TokenizerJSONFile))
	if err != nil {
		f.Fatal(err)
	}
	f.Add([]byte(minimalJSON))
	f.Add([]byte(strings.Replace(minimalJSON, `[["a","b"],["Ġ","ab"]]`, `["a b","Ġ ab"]`, 1)))
	f.Add([]byte(`{"model":{"type":"BPE","vocab":{"a":0,"<0x00>":1},"byte_fallback":true}}`))
	f.Add([]byte(`{"normalizer":{"type":"Sequence","normalizers":[{"type":"Prepend","prepend":"▁"},{"type":"Replace","pattern":{"String":" "},"content":"▁"}]},"decoder":{"type":"Sequence","decoders":[{"type":"Replace","pattern":{"String":"▁"},"content":" "},{"type":"ByteFallback"},{"type":"Fuse"},{"type":"Strip","content":" ","start":1,"stop":0}]},"model":{"type":"BPE","vocab":{"▁":0,"a":1,"▁a":2},"merges":["▁ a"]}}`))
	f.Add(tj[:2000])
	f.Fuzz(func(t *testing.T, data []byte) {
		tk, err := ParseTokenizerJSON(data)
		if err != nil {
			return
		}
		checkUsable(t, tk)
	})
}

// FuzzEncodeDecode checks decode(encode(x)) == x for both test models (NFC of
// x for the byte-level model, which normalizes to NFC).
func FuzzEncodeDecode(f *testing.F) {
	sp := loadModel(f, "llama-mini")
	hf := loadModel(f, "qwen3-mini").(*HFBPE)
	for _, s := range []string{"hello world", "  two  spaces ", "line\nbreak\r\n", "It's 2024: ½ café 🦙", "日本語", ""} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		if !utf8.ValidString(s) {
			return
		}
		// SentencePiece shows spaces as U+2581, so a literal U+2581 cannot round-trip.
		if !strings.Contains(s, spaceSymbol) {
			if got := sp.Decode(sp.Encode(s)); got != s {
				t.Errorf("sentencepiece: Decode(Encode(%q)) = %q", s, got)
			}
		}
		for _, a := range hf.added {
			if strings.Contains(s, a.content) {
				return // special tokens are skipped by Decode
			}
		}
		want := norm.NFC.String(s)
		if got := hf.Decode(hf.Encode(s)); got != want {
			t.Errorf("bpe: Decode(Encode(%q)) = %q, want %q", s, got, want)
		}
	})
}

// BenchmarkEncodeSotu encodes the 0.7 MB sotu-test.raw. "warm" reuses the
// word cache filled by earlier iterations; "cold" clears it each time.
func BenchmarkEncodeSotu(b *testing.B) {
	text := readCorpus(b, "sotu-test.raw")
	for _, m := range models {
		tk := loadModel(b, m.dir)
		for _, mode := range []string{"cold", "warm"} {
			b.Run(m.dir+"/"+mode, func(b *testing.B) {
				b.SetBytes(int64(len(text)))
				n := 0
				for b.Loop() {
					if mode == "cold" {
						clearCache(tk)
					}
					n += len(tk.Encode(text))
				}
				b.ReportMetric(float64(n)/b.Elapsed().Seconds(), "tokens/s")
			})
		}
	}
}

func clearCache(tk Tokenizer) {
	switch t := tk.(type) {
	case *SentencePiece:
		t.mu.Lock()
		clear(t.cache)
		t.mu.Unlock()
	case *HFBPE:
		t.mu.Lock()
		clear(t.cache)
		t.mu.Unlock()
	}
}
