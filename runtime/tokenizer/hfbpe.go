package tokenizer

import (
	"encoding/json"
	"errors"
	"fmt"
	"sort"
	"strings"
	"sync"
	"unicode"
	"unicode/utf8"

	"golang.org/x/text/unicode/norm"
)

// maxCacheEntries bounds the per-tokenizer word cache.
const maxCacheEntries = 1 << 17

// maxCachedWord is the longest pre-token (in bytes) kept in the cache.
const maxCachedWord = 64

// HFBPE is a Hugging Face BPE tokenizer read from tokenizer.json. Encode runs
// the Hugging Face pipeline: added tokens are split out of the raw text, each
// remaining segment is normalized, pre-tokenized (Split regex, ByteLevel) and
// every pre-token is merged lowest merge rank first (leftmost first on equal
// ranks). Merge results are looked up, not assumed equal to ranks. Encode and
// Decode are safe for concurrent use.
type HFBPE struct {
	vocab   map[string]int // model vocabulary: token text -> id
	idToTok []string       // token text by id (model vocab and added tokens); "" for holes
	special []bool         // by id: added token marked special

	added      []addedToken // sorted by descending length
	addedFirst [256][]int   // first byte of content -> indices into added

	merges       map[uint64]mergeVal
	byteLevel    bool       // pre-tokenizer ends with ByteLevel: pre-tokens are mapped byte -> char
	byteChar     [256]rune  // GPT-2 byte -> char table
	charByte     [324]int16 // inverse of byteChar, -1 for other chars
	byteTokID    [256]int   // id of the byte-level char of each byte, -1 when absent
	byteFBID     [256]int   // byte_fallback <0xXX> ids, -1 when absent
	unkID        int
	byteFallback bool
	ignoreMerges bool

	normalizers []normalizer
	preSteps    []preStep
	decoders    []decoderStep
	// spaceWords: there is no pre-tokenizer (Llama-2 style: the normalizer
	// escapes spaces as U+2581) and no token holds U+2581 after another
	// character, so the text encodes "▁word" by word, as SentencePiece does.
	spaceWords bool

	bos    int
	eos    []int
	addBOS bool

	mu    sync.Mutex
	cache map[string][]int
}

type addedToken struct {
	id                         int
	content                    string
	singleWord, lstrip, rstrip bool
	special                    bool
}

type mergeVal struct{ rank, newID int32 }

func pairKey(a, b int32) uint64 { return uint64(uint32(a))<<32 | uint64(uint32(b)) }

// JSON layout of tokenizer.json (only the parts we read).
type hfJSON struct {
	AddedTokens   []hfAddedToken  `json:"added_tokens"`
	Normalizer    json.RawMessage `json:"normalizer"`
	PreTokenizer  json.RawMessage `json:"pre_tokenizer"`
	PostProcessor json.RawMessage `json:"post_processor"`
	Decoder       json.RawMessage `json:"decoder"`
	Model         *hfModel        `json:"model"`
}

type hfAddedToken struct {
	ID         *int   `json:"id"`
	Content    string `json:"content"`
	SingleWord bool   `json:"single_word"`
	LStrip     bool   `json:"lstrip"`
	RStrip     bool   `json:"rstrip"`
	Special    bool   `json:"special"`
}

type hfModel struct {
	Type                    string          `json:"type"`
	Vocab                   map[string]int  `json:"vocab"`
	Merges                  json.RawMessage `json:"merges"`
	UnkToken                *string         `json:"unk_token"`
	ContinuingSubwordPrefix *string         `json:"continuing_subword_prefix"`
	EndOfWordSuffix         *string         `json:"end_of_word_suffix"`
	ByteFallback            bool            `json:"byte_fallback"`
	IgnoreMerges            bool            `json:"ignore_merges"`
	Dropout                 *float64        `json:"dropout"`
}

// ParseTokenizerJSON parses a Hugging Face tokenizer.json holding a BPE model.
// Supported components: normalizers NFC/NFD/NFKC/NFKD/Lowercase/Prepend/
// Replace(String)/Sequence; pre-tokenizers Split(Isolated)/ByteLevel/Sequence;
// decoders ByteLevel/Replace/ByteFallback/Fuse/Strip/Sequence. Anything else
// is rejected with an error naming it.
func ParseTokenizerJSON(data []byte) (*HFBPE, error) {
	var j hfJSON
	if err := json.Unmarshal(data, &j); err != nil {
		return nil, fmt.Errorf("tokenizer.json: %w", err)
	}
	if j.Model == nil {
		return nil, errors.New("tokenizer.json: no \"model\" section")
	}
	m := j.Model
	if m.Type != "" && m.Type != "BPE" {
		return nil, fmt.Errorf("tokenizer.json: model type %q is not supported (only BPE)", m.Type)
	}
	if len(m.Vocab) == 0 {
		return nil, errors.New("tokenizer.json: model.vocab is empty")
	}
	if m.ContinuingSubwordPrefix != nil && *m.ContinuingSubwordPrefix != "" {
		return nil, errors.New("tokenizer.json: continuing_subword_prefix is not supported")
	}
	if m.EndOfWordSuffix != nil && *m.EndOfWordSuffix != "" {
		return nil, errors.New("tokenizer.json: end_of_word_suffix is not supported")
	}
	if m.Dropout != nil && *m.Dropout != 0 {
		return nil, errors.New("tokenizer.json: BPE dropout is not supported")
	}
	t := &HFBPE{
		vocab:        m.Vocab,
		unkID:        -1,
		byteFallback: m.ByteFallback,
		ignoreMerges: m.IgnoreMerges,
		bos:          -1,
		cache:        make(map[string][]int),
	}
	if err := t.buildIDs(m, j.AddedTokens); err != nil {
		return nil, fmt.Errorf("tokenizer.json: %w", err)
	}
	if err := t.buildMerges(m.Merges); err != nil {
		return nil, fmt.Errorf("tokenizer.json: model.merges: %w", err)
	}
	var err error
	if t.normalizers, err = parseNormalizer(j.Normalizer); err != nil {
		return nil, fmt.Errorf("tokenizer.json: normalizer: %w", err)
	}
	if t.preSteps, err = parsePreTokenizer(j.PreTokenizer); err != nil {
		return nil, fmt.Errorf("tokenizer.json: pre_tokenizer: %w", err)
	}
	for i, st := range t.preSteps {
		if st.kind == "ByteLevel" {
			if i != len(t.preSteps)-1 {
				return nil, errors.New("tokenizer.json: pre_tokenizer: ByteLevel must be the last step")
			}
			t.byteLevel = true
		}
	}
	if len(t.preSteps) == 0 {
		t.spaceWords = true
		for tok := range t.vocab {
			t.spaceWords = t.spaceWords && spaceOnlyAtStart(tok)
		}
	}
	if t.decoders, err = parseDecoder(j.Decoder); err != nil {
		return nil, fmt.Errorf("tokenizer.json: decoder: %w", err)
	}
	t.byteChar = bytesToUnicode()
	for i := range t.charByte {
		t.charByte[i] = -1
	}
	for b, r := range t.byteChar {
		t.charByte[r] = int16(b)
	}
	for b := range 256 {
		t.byteTokID[b] = -1
		if id, ok := t.vocab[string(t.byteChar[b])]; ok {
			t.byteTokID[b] = id
		}
		t.byteFBID[b] = -1
		if id, ok := t.vocab[fmt.Sprintf("<0x%02X>", b)]; ok {
			t.byteFBID[b] = id
		}
	}
	if t.byteFallback {
		for b := range 256 {
			if t.byteFBID[b] < 0 {
				return nil, fmt.Errorf("tokenizer.json: byte_fallback is set but <0x%02X> is not in the vocabulary", b)
			}
		}
	}
	t.parsePostProcessor(j.PostProcessor)
	return t, nil
}

func (t *HFBPE) buildIDs(m *hfModel, added []hfAddedToken) error {
	maxID := -1
	for tok, id := range m.Vocab {
		if id < 0 {
			return fmt.Errorf("model.vocab: token %q has negative id %d", truncate(tok, 40), id)
		}
		maxID = max(maxID, id)
	}
	for i, a := range added {
		if a.ID == nil || *a.ID < 0 {
			return fmt.Errorf("added_tokens[%d] %q: missing or negative id", i, truncate(a.Content, 40))
		}
		if a.Content == "" {
			return fmt.Errorf("added_tokens[%d] (id %d): empty content", i, *a.ID)
		}
		maxID = max(maxID, *a.ID)
	}
	if limit := 4*(len(m.Vocab)+len(added)) + 1024; maxID >= limit || maxID >= 1<<24 {
		return fmt.Errorf("largest id %d is far beyond the %d vocabulary entries", maxID, len(m.Vocab)+len(added))
	}
	t.idToTok = make([]string, maxID+1)
	t.special = make([]bool, maxID+1)
	seen := make([]bool, maxID+1)
	for tok, id := range m.Vocab {
		if seen[id] {
			return fmt.Errorf("model.vocab: id %d is assigned to both %q and %q", id, truncate(t.idToTok[id], 40), truncate(tok, 40))
		}
		seen[id] = true
		t.idToTok[id] = tok
	}
	for i, a := range added {
		id := *a.ID
		if seen[id] && t.idToTok[id] != a.Content {
			return fmt.Errorf("added_tokens[%d]: id %d is %q in the vocabulary but %q in added_tokens", i, id, truncate(t.idToTok[id], 40), truncate(a.Content, 40))
		}
		seen[id] = true
		t.idToTok[id] = a.Content
		t.special[id] = a.Special
		t.added = append(t.added, addedToken{id: id, content: a.Content, singleWord: a.SingleWord, lstrip: a.LStrip, rstrip: a.RStrip, special: a.Special})
	}
	sort.SliceStable(t.added, func(i, j int) bool { return len(t.added[i].content) > len(t.added[j].content) })
	for i, a := range t.added {
		t.addedFirst[a.content[0]] = append(t.addedFirst[a.content[0]], i)
	}
	if m.UnkToken != nil {
		id, ok := m.Vocab[*m.UnkToken]
		if !ok {
			return fmt.Errorf("model.unk_token %q is not in the vocabulary", truncate(*m.UnkToken, 40))
		}
		t.unkID = id
	}
	return nil
}

func (t *HFBPE) buildMerges(raw json.RawMessage) error {
	var pairs [][2]string
	if len(raw) > 0 && string(raw) != "null" {
		var asStrings []string
		if err := json.Unmarshal(raw, &asStrings); err == nil {
			pairs = make([][2]string, len(asStrings))
			for i, s := range asStrings {
				a, b, ok := strings.Cut(s, " ")
				if !ok || a == "" || b == "" || strings.Contains(b, " ") {
					return fmt.Errorf("merge %d %q: want two tokens separated by one space", i, truncate(s, 40))
				}
				pairs[i] = [2]string{a, b}
			}
		} else {
			var asPairs [][]string
			if err := json.Unmarshal(raw, &asPairs); err != nil {
				return errors.New("want a list of \"a b\" strings or of [a, b] pairs")
			}
			pairs = make([][2]string, len(asPairs))
			for i, p := range asPairs {
				if len(p) != 2 {
					return fmt.Errorf("merge %d has %d parts, want 2", i, len(p))
				}
				pairs[i] = [2]string{p[0], p[1]}
			}
		}
	}
	t.merges = make(map[uint64]mergeVal, len(pairs))
	for i, p := range pairs {
		a, ok1 := t.vocab[p[0]]
		b, ok2 := t.vocab[p[1]]
		c, ok3 := t.vocab[p[0]+p[1]]
		if !ok1 || !ok2 || !ok3 {
			return fmt.Errorf("merge %d (%q, %q): token not in the vocabulary", i, truncate(p[0], 40), truncate(p[1], 40))
		}
		t.merges[pairKey(int32(a), int32(b))] = mergeVal{rank: int32(i), newID: int32(c)}
	}
	return nil
}

// parsePostProcessor finds a BOS in a TemplateProcessing "single" template
// (possibly inside a Sequence).
func (t *HFBPE) parsePostProcessor(raw json.RawMessage) {
	var pp struct {
		Type       string            `json:"type"`
		Processors []json.RawMessage `json:"processors"`
		Single     []struct {
			SpecialToken *struct {
				ID string `json:"id"`
			} `json:"SpecialToken"`
		} `json:"single"`
		SpecialTokens map[string]struct {
			IDs []int `json:"ids"`
		} `json:"special_tokens"`
	}
	if len(raw) == 0 || json.Unmarshal(raw, &pp) != nil {
		return
	}
	switch pp.Type {
	case "Sequence":
		for _, p := range pp.Processors {
			t.parsePostProcessor(p)
		}
	case "TemplateProcessing":
		if len(pp.Single) > 0 && pp.Single[0].SpecialToken != nil {
			if st, ok := pp.SpecialTokens[pp.Single[0].SpecialToken.ID]; ok && len(st.IDs) == 1 && st.IDs[0] >= 0 && st.IDs[0] < len(t.idToTok) {
				t.bos = st.IDs[0]
				t.addBOS = true
			}
		}
	}
}

func (t *HFBPE) applySidecars(s sidecars) {
	if s.bosToken != nil {
		if id, ok := t.tokenID(*s.bosToken); ok {
			t.bos = id
		}
	} else if s.bosNullSet && !t.addBOS {
		t.bos = -1
	}
	if t.bos < 0 && s.bosID != nil && *s.bosID >= 0 && *s.bosID < len(t.idToTok) {
		t.bos = *s.bosID
	}
	if s.addBOS != nil {
		t.addBOS = *s.addBOS
	}
	if s.eosToken != nil {
		if id, ok := t.tokenID(*s.eosToken); ok {
			t.eos = appendUnique(t.eos, id)
		}
	}
	for _, id := range s.eosIDs {
		if id >= 0 && id < len(t.idToTok) {
			t.eos = appendUnique(t.eos, id)
		}
	}
}

func (t *HFBPE) tokenID(content string) (int, bool) {
	for _, a := range t.added {
		if a.content == content {
			return a.id, true
		}
	}
	id, ok := t.vocab[content]
	return id, ok
}

// Kind returns "bpe".
func (t *HFBPE) Kind() string { return KindBPE }

// VocabSize is one more than the largest id of the vocabulary and added tokens.
func (t *HFBPE) VocabSize() int { return len(t.idToTok) }

// BOS returns the BOS id (from tokenizer_config.json or the post-processor), -1 when none.
func (t *HFBPE) BOS() int { return t.bos }

// EOS returns the eos_token of tokenizer_config.json plus eos_token_id of the model configs.
func (t *HFBPE) EOS() []int { return append([]int(nil), t.eos...) }

// AddBOS reports whether BOS is prepended (post-processor template or add_bos_token).
func (t *HFBPE) AddBOS() bool { return t.addBOS && t.bos >= 0 }

// Token returns the vocabulary text of id ("" when out of range).
func (t *HFBPE) Token(id int) string {
	if id < 0 || id >= len(t.idToTok) {
		return ""
	}
	return t.idToTok[id]
}

// Encode tokenizes text without BOS/EOS. Added tokens (special or not) that
// occur in the text are emitted as their ids.
func (t *HFBPE) Encode(text string) []int {
	ids := make([]int, 0, len(text)/3+1)
	var scratch bpeScratch
	for len(text) > 0 {
		start, end, id := t.findAdded(text)
		if start < 0 {
			return t.encodeSegment(text, ids, &scratch)
		}
		ids = t.encodeSegment(text[:start], ids, &scratch)
		ids = append(ids, id)
		text = text[end:]
	}
	return ids
}

// findAdded returns the leftmost (longest on ties) added token in s, with the
// span it consumes (widened by lstrip/rstrip), or start = -1. All added tokens
// are matched on the raw text; Hugging Face matches tokens marked
// "normalized": true on the normalized text instead, which differs only when
// the normalizer changes such a token's text.
func (t *HFBPE) findAdded(s string) (start, end, id int) {
	if len(t.added) == 0 {
		return -1, -1, -1
	}
	for i := 0; i < len(s); i++ {
		cands := t.addedFirst[s[i]]
		for _, k := range cands {
			a := &t.added[k]
			if !strings.HasPrefix(s[i:], a.content) {
				continue
			}
			st, en := i, i+len(a.content)
			if a.singleWord && (isWordCharBefore(s, st) || isWordCharAt(s, en)) {
				continue
			}
			if a.lstrip {
				st = len(strings.TrimRightFunc(s[:st], unicode.IsSpace))
			}
			if a.rstrip {
				en = len(s) - len(strings.TrimLeftFunc(s[en:], unicode.IsSpace))
			}
			return st, en, a.id
		}
	}
	return -1, -1, -1
}

func isWordCharBefore(s string, i int) bool {
	if i == 0 {
		return false
	}
	r, _ := utf8.DecodeLastRuneInString(s[:i])
	return unicode.IsLetter(r) || unicode.IsNumber(r) || r == '_'
}

func isWordCharAt(s string, i int) bool {
	if i >= len(s) {
		return false
	}
	r, _ := utf8.DecodeRuneInString(s[i:])
	return unicode.IsLetter(r) || unicode.IsNumber(r) || r == '_'
}

// encodeSegment normalizes, pre-tokenizes and BPE-encodes text that holds no
// added token.
func (t *HFBPE) encodeSegment(text string, ids []int, sc *bpeScratch) []int {
	if text == "" {
		return ids
	}
	for _, n := range t.normalizers {
		text = n(text)
	}
	if t.spaceWords {
		spaceWords(text, func(w string) { ids = t.encodeWord(w, ids, sc) })
		return ids
	}
	words := []string{text}
	for _, st := range t.preSteps {
		words = st.apply(words)
	}
	for _, w := range words {
		ids = t.encodeWord(w, ids, sc)
	}
	return ids
}

// encodeWord BPE-encodes one pre-token, through the cache.
func (t *HFBPE) encodeWord(w string, ids []int, sc *bpeScratch) []int {
	if w == "" {
		return ids
	}
	if len(w) <= maxCachedWord {
		t.mu.Lock()
		cached, ok := t.cache[w]
		t.mu.Unlock()
		if ok {
			return append(ids, cached...)
		}
	}
	n0 := len(ids)
	ids = t.bpe(w, ids, sc)
	if len(w) <= maxCachedWord {
		t.mu.Lock()
		if len(t.cache) < maxCacheEntries {
			t.cache[w] = append([]int(nil), ids[n0:]...)
		}
		t.mu.Unlock()
	}
	return ids
}

type bpeScratch struct {
	sym  []int32
	prev []int32
	next []int32
	heap mergeHeap
	buf  []byte
}

// bpe turns one pre-token into initial symbols (byte-level chars, or
// characters with unk/byte fallback) and merges them.
func (t *HFBPE) bpe(w string, ids []int, sc *bpeScratch) []int {
	if t.ignoreMerges {
		key := w
		if t.byteLevel {
			key = t.mapBytes(w, sc)
		}
		if id, ok := t.vocab[key]; ok {
			return append(ids, id)
		}
	}
	sym := sc.sym[:0]
	if t.byteLevel {
		for i := 0; i < len(w); i++ {
			if id := t.byteTokID[w[i]]; id >= 0 {
				sym = append(sym, int32(id))
			} else if t.unkID >= 0 {
				sym = append(sym, int32(t.unkID))
			}
		}
	} else {
		for i := 0; i < len(w); {
			_, n := utf8.DecodeRuneInString(w[i:])
			if id, ok := t.vocab[w[i:i+n]]; ok {
				sym = append(sym, int32(id))
			} else if t.byteFallback {
				for k := i; k < i+n; k++ {
					sym = append(sym, int32(t.byteFBID[w[k]]))
				}
			} else if t.unkID >= 0 {
				sym = append(sym, int32(t.unkID))
			}
			i += n
		}
	}
	sc.sym = sym
	if len(sym) <= 48 {
		sym = t.mergeSmall(sym)
	} else {
		sym = t.mergeHeap(sym, sc)
	}
	for _, s := range sym {
		ids = append(ids, int(s))
	}
	return ids
}

func (t *HFBPE) mapBytes(w string, sc *bpeScratch) string {
	b := sc.buf[:0]
	for i := 0; i < len(w); i++ {
		b = utf8.AppendRune(b, t.byteChar[w[i]])
	}
	sc.buf = b
	return string(b)
}

// mergeSmall repeatedly merges the adjacent pair of lowest rank (leftmost on
// ties); quadratic in the symbol count, for short pre-tokens. rank[i] caches
// the merge of sym[i] and sym[i+1] (-1 when none).
func (t *HFBPE) mergeSmall(sym []int32) []int32 {
	if len(sym) < 2 {
		return sym
	}
	var rankBuf [64]int32
	var idBuf [64]int32
	rank, newID := rankBuf[:0], idBuf[:0]
	look := func(a, b int32) (int32, int32) {
		if mv, ok := t.merges[pairKey(a, b)]; ok {
			return mv.rank, mv.newID
		}
		return -1, 0
	}
	for i := 0; i+1 < len(sym); i++ {
		r, id := look(sym[i], sym[i+1])
		rank, newID = append(rank, r), append(newID, id)
	}
	for len(sym) > 1 {
		best := -1
		for i, r := range rank {
			if r >= 0 && (best < 0 || r < rank[best]) {
				best = i
			}
		}
		if best < 0 {
			break
		}
		sym[best] = newID[best]
		sym = append(sym[:best+1], sym[best+2:]...)
		rank = append(rank[:best], rank[best+1:]...)
		newID = append(newID[:best], newID[best+1:]...)
		if best > 0 {
			rank[best-1], newID[best-1] = look(sym[best-1], sym[best])
		}
		if best+1 < len(sym) {
			rank[best], newID[best] = look(sym[best], sym[best+1])
		}
	}
	return sym
}

// mergeHeap is the same merge order with a heap over a linked list, for long
// pre-tokens.
func (t *HFBPE) mergeHeap(sym []int32, sc *bpeScratch) []int32 {
	n := len(sym)
	prev := append(sc.prev[:0], make([]int32, n)...)
	next := append(sc.next[:0], make([]int32, n)...)
	for i := range n {
		prev[i], next[i] = int32(i-1), int32(i+1)
	}
	next[n-1] = -1
	alive := func(i int32) bool { return sym[i] >= 0 }
	h := &sc.heap
	h.reset()
	push := func(l int32) {
		if l < 0 {
			return
		}
		r := next[l]
		if r < 0 {
			return
		}
		if mv, ok := t.merges[pairKey(sym[l], sym[r])]; ok {
			h.push(mergeItem{key: float64(mv.rank), pos: l, right: r, a: sym[l], b: sym[r], newID: mv.newID})
		}
	}
	for i := range n {
		push(int32(i))
	}
	for h.len() > 0 {
		m := h.pop()
		l, r := m.pos, m.right
		if !alive(l) || !alive(r) || next[l] != r || sym[l] != m.a || sym[r] != m.b {
			continue
		}
		sym[l] = m.newID
		sym[r] = -1
		next[l] = next[r]
		if next[r] >= 0 {
			prev[next[r]] = l
		}
		push(prev[l])
		push(l)
	}
	sc.prev, sc.next = prev, next
	out := sym[:0]
	for i := int32(0); i >= 0; i = next[i] {
		out = append(out, sym[i])
	}
	return out
}

// Decode turns ids back into text, skipping special added tokens and running
// the tokenizer's decoder.
func (t *HFBPE) Decode(ids []int) string {
	toks := make([]string, 0, len(ids))
	for _, id := range ids {
		if id < 0 || id >= len(t.idToTok) || t.special[id] || t.idToTok[id] == "" {
			continue
		}
		toks = append(toks, t.idToTok[id])
	}
	return t.runDecoders(toks)
}

// DecodeToken returns the text of one token through the decoder (special
// tokens give ""; a byte-level token may be an incomplete UTF-8 sequence and
// is then returned as raw bytes).
func (t *HFBPE) DecodeToken(id int) string {
	if id < 0 || id >= len(t.idToTok) || t.special[id] {
		return ""
	}
	tok := t.idToTok[id]
	for _, d := range t.decoders {
		if d.kind == "ByteLevel" {
			return string(t.unmapBytes(tok, nil))
		}
	}
	return t.runDecoders([]string{tok})
}

func (t *HFBPE) runDecoders(toks []string) string {
	if len(t.decoders) == 0 {
		return strings.Join(toks, " ")
	}
	for _, d := range t.decoders {
		toks = d.apply(t, toks)
	}
	return strings.Join(toks, "")
}

// unmapBytes maps byte-level chars back to bytes; a token holding a char that
// is not in the table is taken as its raw UTF-8 bytes (as Hugging Face does).
func (t *HFBPE) unmapBytes(tok string, dst []byte) []byte {
	n0 := len(dst)
	for _, r := range tok {
		b, ok := t.charToByte(r)
		if !ok {
			return append(dst[:n0], tok...)
		}
		dst = append(dst, b)
	}
	return dst
}

// bytesToUnicode is GPT-2's reversible byte -> printable char table: the
// printable Latin-1 bytes map to themselves, the rest to U+0100 upwards.
func bytesToUnicode() [256]rune {
	var t [256]rune
	n := 0
	for b := range 256 {
		if isPrintableByte(byte(b)) {
			t[b] = rune(b)
		} else {
			t[b] = rune(256 + n)
			n++
		}
	}
	return t
}

func isPrintableByte(b byte) bool {
	return ('!' <= b && b <= '~') || (0xA1 <= b && b <= 0xAC) || (0xAE <= b)
}

// charToByte inverts bytesToUnicode (table from bytesToUnicode).
func (t *HFBPE) charToByte(r rune) (byte, bool) {
	if r < 0 || int(r) >= len(t.charByte) || t.charByte[r] < 0 {
		return 0, false
	}
	return byte(t.charByte[r]), true
}

// ---- normalizers ----

type normalizer func(string) string

func parseNormalizer(raw json.RawMessage) ([]normalizer, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var n struct {
		Type        string            `json:"type"`
		Normalizers []json.RawMessage `json:"normalizers"`
		Prepend     string            `json:"prepend"`
		Pattern     *hfPattern        `json:"pattern"`
		Content     string            `json:"content"`
	}
	if err := json.Unmarshal(raw, &n); err != nil {
		return nil, err
	}
	switch n.Type {
	case "Sequence":
		var out []normalizer
		for i, r := range n.Normalizers {
			s, err := parseNormalizer(r)
			if err != nil {
				return nil, fmt.Errorf("normalizers[%d]: %w", i, err)
			}
			out = append(out, s...)
		}
		return out, nil
	case "NFC":
		return []normalizer{norm.NFC.String}, nil
	case "NFD":
		return []normalizer{norm.NFD.String}, nil
	case "NFKC":
		return []normalizer{norm.NFKC.String}, nil
	case "NFKD":
		return []normalizer{norm.NFKD.String}, nil
	case "Lowercase":
		return []normalizer{strings.ToLower}, nil
	case "Prepend":
		p := n.Prepend
		return []normalizer{func(s string) string {
			if s == "" {
				return s
			}
			return p + s
		}}, nil
	case "Replace":
		if n.Pattern == nil || n.Pattern.String == nil {
			return nil, errors.New("Replace: only a String pattern is supported")
		}
		from, to := *n.Pattern.String, n.Content
		if from == "" {
			return nil, errors.New("Replace: empty pattern")
		}
		return []normalizer{func(s string) string { return strings.ReplaceAll(s, from, to) }}, nil
	}
	return nil, fmt.Errorf("normalizer type %q is not supported", n.Type)
}

type hfPattern struct {
	String *string `json:"String"`
	Regex  *string `json:"Regex"`
}

// ---- pre-tokenizers ----

type preStep struct {
	kind          string // "Split" or "ByteLevel"
	m             matcher
	literal       string // Split with a String pattern
	addPrefixSpac bool
}

func (p *preStep) apply(words []string) []string {
	out := make([]string, 0, len(words))
	for _, w := range words {
		switch {
		case p.kind == "ByteLevel":
			if p.addPrefixSpac && !strings.HasPrefix(w, " ") {
				w = " " + w
			}
			if p.m != nil {
				out = splitIsolated(p.m, w, out)
			} else {
				out = append(out, w)
			}
		case p.m != nil:
			out = splitIsolated(p.m, w, out)
		default:
			out = splitLiteral(w, p.literal, out)
		}
	}
	return out
}

func splitLiteral(s, sep string, out []string) []string {
	for {
		i := strings.Index(s, sep)
		if i < 0 {
			break
		}
		if i > 0 {
			out = append(out, s[:i])
		}
		out = append(out, s[i:i+len(sep)])
		s = s[i+len(sep):]
	}
	if s != "" {
		out = append(out, s)
	}
	return out
}

func parsePreTokenizer(raw json.RawMessage) ([]preStep, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var p struct {
		Type           string            `json:"type"`
		Pretokenizers  []json.RawMessage `json:"pretokenizers"`
		Pattern        *hfPattern        `json:"pattern"`
		Behavior       string            `json:"behavior"`
		Invert         bool              `json:"invert"`
		AddPrefixSpace bool              `json:"add_prefix_space"`
		UseRegex       *bool             `json:"use_regex"`
	}
	if err := json.Unmarshal(raw, &p); err != nil {
		return nil, err
	}
	switch p.Type {
	case "Sequence":
		var out []preStep
		for i, r := range p.Pretokenizers {
			s, err := parsePreTokenizer(r)
			if err != nil {
				return nil, fmt.Errorf("pretokenizers[%d]: %w", i, err)
			}
			out = append(out, s...)
		}
		return out, nil
	case "Split":
		if p.Behavior != "Isolated" {
			return nil, fmt.Errorf("Split behavior %q is not supported (only Isolated)", p.Behavior)
		}
		if p.Invert {
			return nil, errors.New("Split with invert is not supported")
		}
		switch {
		case p.Pattern != nil && p.Pattern.Regex != nil:
			m, err := newMatcher(*p.Pattern.Regex)
			if err != nil {
				return nil, fmt.Errorf("Split regex: %w", err)
			}
			return []preStep{{kind: "Split", m: m}}, nil
		case p.Pattern != nil && p.Pattern.String != nil && *p.Pattern.String != "":
			return []preStep{{kind: "Split", literal: *p.Pattern.String}}, nil
		}
		return nil, errors.New("Split without a String or Regex pattern")
	case "ByteLevel":
		st := preStep{kind: "ByteLevel", addPrefixSpac: p.AddPrefixSpace}
		if p.UseRegex == nil || *p.UseRegex {
			m, err := newMatcher(PatternGPT2)
			if err != nil {
				return nil, err
			}
			st.m = m
		}
		return []preStep{st}, nil
	}
	return nil, fmt.Errorf("pre-tokenizer type %q is not supported", p.Type)
}

// ---- decoders ----

type decoderStep struct {
	kind        string
	from, to    string // Replace
	content     string // Strip
	start, stop int    // Strip
}

func parseDecoder(raw json.RawMessage) ([]decoderStep, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var d struct {
		Type     string            `json:"type"`
		Decoders []json.RawMessage `json:"decoders"`
		Pattern  *hfPattern        `json:"pattern"`
		Content  string            `json:"content"`
		Start    int               `json:"start"`
		Stop     int               `json:"stop"`
	}
	if err := json.Unmarshal(raw, &d); err != nil {
		return nil, err
	}
	switch d.Type {
	case "Sequence":
		var out []decoderStep
		for i, r := range d.Decoders {
			s, err := parseDecoder(r)
			if err != nil {
				return nil, fmt.Errorf("decoders[%d]: %w", i, err)
			}
			out = append(out, s...)
		}
		return out, nil
	case "ByteLevel", "ByteFallback", "Fuse":
		return []decoderStep{{kind: d.Type}}, nil
	case "Replace":
		if d.Pattern == nil || d.Pattern.String == nil || *d.Pattern.String == "" {
			return nil, errors.New("Replace: only a non-empty String pattern is supported")
		}
		return []decoderStep{{kind: "Replace", from: *d.Pattern.String, to: d.Content}}, nil
	case "Strip":
		if utf8.RuneCountInString(d.Content) != 1 || d.Start < 0 || d.Stop < 0 {
			return nil, errors.New("Strip: want one content character and non-negative start/stop")
		}
		return []decoderStep{{kind: "Strip", content: d.Content, start: d.Start, stop: d.Stop}}, nil
	}
	return nil, fmt.Errorf("decoder type %q is not supported", d.Type)
}

func (d *decoderStep) apply(t *HFBPE, toks []string) []string {
	switch d.kind {
	case "ByteLevel":
		var b []byte
		for _, tok := range toks {
			b = t.unmapBytes(tok, b)
		}
		return []string{strings.ToValidUTF8(string(b), "\uFFFD")}
	case "Fuse":
		return []string{strings.Join(toks, "")}
	case "Replace":
		for i := range toks {
			toks[i] = strings.ReplaceAll(toks[i], d.from, d.to)
		}
		return toks
	case "Strip":
		for i, tok := range toks {
			for k := 0; k < d.start && strings.HasPrefix(tok, d.content); k++ {
				tok = tok[len(d.content):]
			}
			for k := 0; k < d.stop && strings.HasSuffix(tok, d.content); k++ {
				tok = tok[:len(tok)-len(d.content)]
			}
			toks[i] = tok
		}
		return toks
	case "ByteFallback":
		out := make([]string, 0, len(toks))
		var pend []byte
		flush := func() {
			if len(pend) == 0 {
				return
			}
			if utf8.Valid(pend) {
				out = append(out, string(pend))
			} else {
				out = append(out, strings.Repeat("\uFFFD", len(pend)))
			}
			pend = pend[:0]
		}
		for _, tok := range toks {
			if b, ok := parseBytePiece(tok); ok {
				pend = append(pend, b)
				continue
			}
			flush()
			out = append(out, tok)
		}
		flush()
		return out
	}
	return toks
}
