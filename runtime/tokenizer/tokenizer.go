// Package tokenizer turns text into token ids and back for the models qtool
// runs: SentencePiece BPE models stored as tokenizer.model (Llama-2 style, with
// byte fallback and a dummy prefix) and Hugging Face byte-level BPE models
// stored as tokenizer.json (GPT-2, Llama-3 and Qwen2/3 style, with added and
// special tokens).
//
// Both encoders are written here, without a tokenizer library, so that their
// behaviour can be matched exactly against the reference implementations:
//   - sentencepiece.go reads the ModelProto with protowire and runs the
//     SentencePiece BPE merge loop (highest piece score first, leftmost first
//     on ties) over the whole normalized text.
//   - hfbpe.go reads tokenizer.json and runs the Hugging Face pipeline:
//     added tokens, normalizer, pre-tokenizer, byte-level mapping and the
//     merge-rank BPE loop.
//   - pretokenize.go holds a hand-written scanner for the Llama-3/Qwen split
//     regex (including its `\s+(?!\S)` look-ahead, which Go's regexp cannot
//     express); other split patterns fall back to github.com/dlclark/regexp2.
package tokenizer

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"

	"qtool/formats/infile"
)

// Tokenizer turns text into ids and back.
type Tokenizer interface {
	// Encode turns plain text into ids. No BOS or EOS is added.
	Encode(text string) []int
	// Decode is the inverse of Encode; special and control tokens are skipped.
	Decode(ids []int) string
	// DecodeToken returns the text of one piece, for streaming generation
	// output (best effort: a byte piece may be an incomplete UTF-8 sequence).
	DecodeToken(id int) string
	// VocabSize is one more than the largest id the tokenizer can produce.
	VocabSize() int
	// BOS is the beginning-of-sequence id, -1 when there is none.
	BOS() int
	// EOS lists the ids that stop generation: the tokenizer's own EOS plus
	// eos_token_id from generation_config.json / config.json when present.
	EOS() []int
	// AddBOS reports whether Hugging Face prepends BOS for this model.
	AddBOS() bool
	// Kind is "sentencepiece" or "bpe".
	Kind() string
}

// Kind names returned by Tokenizer.Kind.
const (
	KindSentencePiece = "sentencepiece"
	KindBPE           = "bpe"
)

// File names LoadDir looks for, in order.
const (
	SentencePieceFile = "tokenizer.model"
	TokenizerJSONFile = "tokenizer.json"
)

// maxTokenizerFile bounds the size of a tokenizer file we are willing to read.
const maxTokenizerFile = 1 << 30

// ErrNoTokenizer is wrapped by LoadDir when a directory holds no tokenizer file.
var ErrNoTokenizer = errors.New("no tokenizer file")

// LoadDir finds tokenizer.model or tokenizer.json in dir and loads it,
// together with the EOS/BOS settings in tokenizer_config.json,
// generation_config.json and config.json next to it. When both files exist,
// tokenizer.model is tried first (it is the original of a SentencePiece model
// and the path checked against reference ids) and tokenizer.json is used when
// tokenizer.model cannot be loaded (for example a Unigram model); if neither
// loads, the error names both failures.
func LoadDir(dir string) (Tokenizer, error) {
	st, err := os.Stat(dir)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: model dir: %w", err)
	}
	if !st.IsDir() {
		return nil, fmt.Errorf("tokenizer: %s is not a directory", dir)
	}
	var errs []error
	for _, name := range []string{SentencePieceFile, TokenizerJSONFile} {
		p := filepath.Join(dir, name)
		if fi, err := os.Stat(p); err != nil || fi.IsDir() {
			continue
		}
		t, err := LoadFile(p)
		if err == nil {
			return t, nil
		}
		errs = append(errs, err)
	}
	if len(errs) > 0 {
		return nil, errors.Join(errs...)
	}
	return nil, fmt.Errorf("tokenizer: %w in %s: looked for %s and %s", ErrNoTokenizer, dir, SentencePieceFile, TokenizerJSONFile)
}

// LoadFile loads one tokenizer file by its extension: *.model is read as a
// SentencePiece ModelProto, *.json as a Hugging Face tokenizer.json. The JSON
// configuration files in the same directory (tokenizer_config.json,
// generation_config.json, config.json) are read when present to complete BOS,
// EOS and AddBOS.
func LoadFile(path string) (Tokenizer, error) {
	data, err := readLimited(path)
	if err != nil {
		return nil, err
	}
	side, err := readSidecars(filepath.Dir(path))
	if err != nil {
		return nil, err
	}
	switch strings.ToLower(filepath.Ext(path)) {
	case ".model":
		t, err := ParseSentencePiece(data)
		if err != nil {
			return nil, fmt.Errorf("tokenizer: %s: %w", path, err)
		}
		t.applySidecars(side)
		return t, nil
	case ".json":
		t, err := ParseTokenizerJSON(data)
		if err != nil {
			return nil, fmt.Errorf("tokenizer: %s: %w", path, err)
		}
		t.applySidecars(side)
		return t, nil
	default:
		return nil, fmt.Errorf("tokenizer: %s: unknown tokenizer file type (want *.model for SentencePiece or *.json for tokenizer.json)", path)
	}
}

// CheckVocab returns an error when the tokenizer can produce ids that do not
// fit the model's embedding table of modelVocab rows.
func CheckVocab(t Tokenizer, modelVocab int) error {
	if t == nil {
		return errors.New("tokenizer: CheckVocab: nil tokenizer")
	}
	if n := t.VocabSize(); n > modelVocab {
		return fmt.Errorf("tokenizer: %s vocabulary has %d entries but the model's vocab_size is %d: tokenizer does not belong to this model", t.Kind(), n, modelVocab)
	}
	return nil
}

// EncodeWithBOS encodes text and prepends BOS iff t.AddBOS() and t has a BOS.
func EncodeWithBOS(t Tokenizer, text string) []int {
	ids := t.Encode(text)
	if !t.AddBOS() || t.BOS() < 0 {
		return ids
	}
	out := make([]int, 0, len(ids)+1)
	out = append(out, t.BOS())
	return append(out, ids...)
}

func readLimited(path string) ([]byte, error) {
	data, err := infile.ReadFile(path, maxTokenizerFile)
	if err != nil {
		return nil, fmt.Errorf("tokenizer: %w", err)
	}
	return data, nil
}

// sidecars holds the settings read from the JSON files next to a tokenizer.
type sidecars struct {
	eosIDs     []int   // eos_token_id from generation_config.json and config.json
	bosID      *int    // bos_token_id from generation_config.json / config.json (may be JSON null → nil)
	addBOS     *bool   // tokenizer_config.json add_bos_token
	bosToken   *string // tokenizer_config.json bos_token (content); "" when explicitly null
	eosToken   *string // tokenizer_config.json eos_token (content)
	bosNullSet bool    // tokenizer_config.json has "bos_token": null
}

func readSidecars(dir string) (sidecars, error) {
	var s sidecars
	for _, name := range []string{"generation_config.json", "config.json"} {
		p := filepath.Join(dir, name)
		raw, err := infile.ReadFile(p, infile.MetaLimit)
		if errors.Is(err, os.ErrNotExist) {
			continue
		}
		if err != nil {
			return s, fmt.Errorf("tokenizer: %w", err)
		}
		var m struct {
			EOS json.RawMessage `json:"eos_token_id"`
			BOS json.RawMessage `json:"bos_token_id"`
		}
		if err := json.Unmarshal(raw, &m); err != nil {
			return s, fmt.Errorf("tokenizer: %s: %w", p, err)
		}
		ids, err := intOrList(m.EOS)
		if err != nil {
			return s, fmt.Errorf("tokenizer: %s: eos_token_id: %w", p, err)
		}
		s.eosIDs = appendUnique(s.eosIDs, ids...)
		if s.bosID == nil {
			b, err := intOrList(m.BOS)
			if err != nil {
				return s, fmt.Errorf("tokenizer: %s: bos_token_id: %w", p, err)
			}
			if len(b) > 0 {
				v := b[0]
				s.bosID = &v
			}
		}
	}
	p := filepath.Join(dir, "tokenizer_config.json")
	raw, err := infile.ReadFile(p, infile.MetaLimit)
	if err != nil && !errors.Is(err, os.ErrNotExist) {
		return s, fmt.Errorf("tokenizer: %w", err)
	}
	if err == nil {
		var m map[string]json.RawMessage
		if err := json.Unmarshal(raw, &m); err != nil {
			return s, fmt.Errorf("tokenizer: %s: %w", p, err)
		}
		if v, ok := m["add_bos_token"]; ok {
			var b bool
			if err := json.Unmarshal(v, &b); err == nil {
				s.addBOS = &b
			}
		}
		if v, ok := m["bos_token"]; ok {
			if string(v) == "null" {
				s.bosNullSet = true
			} else if c, ok := tokenContent(v); ok {
				s.bosToken = &c
			}
		}
		if v, ok := m["eos_token"]; ok {
			if c, ok := tokenContent(v); ok {
				s.eosToken = &c
			}
		}
	}
	return s, nil
}

// tokenContent reads a tokenizer_config.json token entry, either a string or
// an AddedToken object {"content": ...}.
func tokenContent(raw json.RawMessage) (string, bool) {
	var s string
	if err := json.Unmarshal(raw, &s); err == nil {
		return s, true
	}
	var o struct {
		Content *string `json:"content"`
	}
	if err := json.Unmarshal(raw, &o); err == nil && o.Content != nil {
		return *o.Content, true
	}
	return "", false
}

// intOrList parses a JSON int, list of ints or null.
func intOrList(raw json.RawMessage) ([]int, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var one int
	if err := json.Unmarshal(raw, &one); err == nil {
		return []int{one}, nil
	}
	var many []int
	if err := json.Unmarshal(raw, &many); err != nil {
		return nil, fmt.Errorf("want an integer or a list of integers, got %s", truncate(string(raw), 40))
	}
	return many, nil
}

func appendUnique(dst []int, ids ...int) []int {
	for _, id := range ids {
		found := false
		for _, d := range dst {
			if d == id {
				found = true
				break
			}
		}
		if !found {
			dst = append(dst, id)
		}
	}
	return dst
}

func truncate(s string, n int) string {
	if len(s) <= n {
		return s
	}
	return s[:n] + "..."
}
