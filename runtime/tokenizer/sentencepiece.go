package tokenizer

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"unicode/utf8"

	"google.golang.org/protobuf/encoding/protowire"
)

// SentencePiece piece types (ModelProto.SentencePiece.Type).
const (
	spNormal      = 1
	spUnknown     = 2
	spControl     = 3
	spUserDefined = 4
	spUnused      = 5
	spByte        = 6
)

// SentencePiece trainer model types (TrainerSpec.ModelType).
const (
	spModelUnigram = 1
	spModelBPE     = 2
)

// spaceSymbol is the visible stand-in SentencePiece uses for a space.
const spaceSymbol = "\u2581"

// maxPieces bounds the vocabulary of a SentencePiece model.
const maxPieces = 1 << 22

// SentencePiece is a SentencePiece BPE tokenizer read from a tokenizer.model
// ModelProto. Encode follows the reference library: the normalized text (with
// the dummy prefix and spaces escaped as U+2581) is split into characters
// (user-defined symbols kept whole), adjacent symbols whose concatenation is a
// piece are merged highest score first (leftmost first on equal scores), and
// symbols that are not pieces fall back to their UTF-8 byte pieces. Encode and
// Decode are safe for concurrent use.
type SentencePiece struct {
	pieces []string
	scores []float32
	types  []int8

	pieceID    map[string]int // NORMAL, USER_DEFINED and UNUSED pieces: the ones merges may form
	reservedID map[string]int // CONTROL, UNKNOWN and BYTE pieces
	byteID     [256]int       // id of <0xXX>, -1 when absent
	userDefs   map[string]bool
	maxUserLen int

	unkID, bosID, eosID int
	byteFallback        bool
	addDummyPrefix      bool
	removeExtraSpaces   bool
	escapeSpaces        bool

	splitWords bool // no piece has U+2581 after another character: words encode independently

	eos    []int
	addBOS bool

	mu    sync.Mutex
	cache map[string][]int
}

// ParseSentencePiece parses a serialized SentencePiece ModelProto
// (tokenizer.model). Only BPE models with the identity normalizer (no
// precompiled character map) are supported, which covers Llama-2 style models;
// anything else is rejected with an error rather than tokenized differently.
func ParseSentencePiece(data []byte) (*SentencePiece, error) {
	if len(data) == 0 {
		return nil, errors.New("sentencepiece: empty model file")
	}
	t := &SentencePiece{
		unkID: 0, bosID: 1, eosID: 2,
		addDummyPrefix: true, removeExtraSpaces: true, escapeSpaces: true,
		addBOS: true,
	}
	modelType := uint64(spModelUnigram)
	var charsmapLen int
	var normName string
	treatAsSuffix := false

	err := walkProto(data, func(num protowire.Number, typ protowire.Type, v uint64, b []byte) error {
		switch num {
		case 1: // pieces
			if typ != protowire.BytesType {
				return fmt.Errorf("ModelProto.pieces: wire type %d, want bytes", typ)
			}
			if len(t.pieces) >= maxPieces {
				return fmt.Errorf("more than %d pieces", maxPieces)
			}
			p, sc, ty, err := parsePiece(b)
			if err != nil {
				return fmt.Errorf("piece %d: %w", len(t.pieces), err)
			}
			t.pieces = append(t.pieces, p)
			t.scores = append(t.scores, sc)
			t.types = append(t.types, ty)
		case 2: // trainer_spec
			if typ != protowire.BytesType {
				return fmt.Errorf("ModelProto.trainer_spec: wire type %d, want bytes", typ)
			}
			return walkProto(b, func(num protowire.Number, typ protowire.Type, v uint64, _ []byte) error {
				if typ != protowire.VarintType {
					return nil // strings and floats of the trainer are not needed
				}
				switch num {
				case 3:
					modelType = v
				case 24:
					treatAsSuffix = v != 0
				case 35:
					t.byteFallback = v != 0
				case 40:
					t.unkID = int(int32(v))
				case 41:
					t.bosID = int(int32(v))
				case 42:
					t.eosID = int(int32(v))
				}
				return nil
			})
		case 3: // normalizer_spec
			if typ != protowire.BytesType {
				return fmt.Errorf("ModelProto.normalizer_spec: wire type %d, want bytes", typ)
			}
			return walkProto(b, func(num protowire.Number, typ protowire.Type, v uint64, b []byte) error {
				switch {
				case num == 1 && typ == protowire.BytesType:
					normName = string(b)
				case num == 2 && typ == protowire.BytesType:
					charsmapLen = len(b)
				case num == 3 && typ == protowire.VarintType:
					t.addDummyPrefix = v != 0
				case num == 4 && typ == protowire.VarintType:
					t.removeExtraSpaces = v != 0
				case num == 5 && typ == protowire.VarintType:
					t.escapeSpaces = v != 0
				}
				return nil
			})
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("sentencepiece: malformed ModelProto: %w", err)
	}
	if len(t.pieces) == 0 {
		return nil, errors.New("sentencepiece: model has no pieces (not a tokenizer.model file?)")
	}
	switch modelType {
	case spModelBPE:
	case spModelUnigram:
		return nil, errors.New("sentencepiece: model type UNIGRAM is not supported (only BPE)")
	default:
		return nil, fmt.Errorf("sentencepiece: model type %d is not supported (only BPE = 2)", modelType)
	}
	if charsmapLen > 0 {
		return nil, fmt.Errorf("sentencepiece: normalizer %q with a %d-byte precompiled character map is not supported (only identity)", normName, charsmapLen)
	}
	if treatAsSuffix {
		return nil, errors.New("sentencepiece: treat_whitespace_as_suffix is not supported")
	}
	if err := t.index(); err != nil {
		return nil, fmt.Errorf("sentencepiece: %w", err)
	}
	return t, nil
}

// index builds the lookup tables and checks the special ids.
func (t *SentencePiece) index() error {
	n := len(t.pieces)
	t.pieceID = make(map[string]int, n)
	t.reservedID = make(map[string]int)
	t.userDefs = make(map[string]bool)
	for i := range t.byteID {
		t.byteID[i] = -1
	}
	// (in the pieces' order, not pieceID's: the same result, and the same
	// path through the code for the same model, which fuzzing relies on)
	t.splitWords = t.escapeSpaces
	for id, p := range t.pieces {
		if p == "" {
			return fmt.Errorf("piece %d is empty", id)
		}
		ty := t.types[id]
		m := t.pieceID
		switch ty {
		case spNormal, spUserDefined, spUnused:
			t.splitWords = t.splitWords && spaceOnlyAtStart(p)
		case spControl, spUnknown:
			m = t.reservedID
		case spByte:
			m = t.reservedID
			b, ok := parseBytePiece(p)
			if !ok {
				return fmt.Errorf("piece %d %q has type BYTE but is not of the form <0xXX>", id, p)
			}
			t.byteID[b] = id
		default:
			return fmt.Errorf("piece %d %q has unknown type %d", id, p, ty)
		}
		if _, dup := t.pieceID[p]; dup {
			return fmt.Errorf("piece %d %q is defined twice", id, p)
		}
		if _, dup := t.reservedID[p]; dup {
			return fmt.Errorf("piece %d %q is defined twice", id, p)
		}
		m[p] = id
		if ty == spUserDefined {
			t.userDefs[p] = true
			t.maxUserLen = max(t.maxUserLen, len(p))
		}
	}
	t.cache = make(map[string][]int)
	if t.unkID < 0 || t.unkID >= n || t.types[t.unkID] != spUnknown {
		return fmt.Errorf("unk_id %d does not name an UNKNOWN piece (vocabulary of %d)", t.unkID, n)
	}
	if t.bosID >= n {
		return fmt.Errorf("bos_id %d is outside the vocabulary of %d", t.bosID, n)
	}
	if t.eosID >= n {
		return fmt.Errorf("eos_id %d is outside the vocabulary of %d", t.eosID, n)
	}
	if t.bosID < 0 {
		t.bosID = -1
	}
	if t.eosID >= 0 {
		t.eos = []int{t.eosID}
	}
	if t.byteFallback {
		for b, id := range t.byteID {
			if id < 0 {
				return fmt.Errorf("byte_fallback is set but byte piece <0x%02X> is missing", b)
			}
		}
	}
	return nil
}

func (t *SentencePiece) applySidecars(s sidecars) {
	if s.addBOS != nil {
		t.addBOS = *s.addBOS
	}
	for _, id := range s.eosIDs {
		if id >= 0 && id < len(t.pieces) {
			t.eos = appendUnique(t.eos, id)
		}
	}
}

// walkProto calls fn for every field of a protobuf message. v is the value of
// varint and fixed fields, b the payload of bytes fields.
func walkProto(data []byte, fn func(num protowire.Number, typ protowire.Type, v uint64, b []byte) error) error {
	for len(data) > 0 {
		num, typ, n := protowire.ConsumeTag(data)
		if n < 0 {
			return fmt.Errorf("bad tag: %w", protowire.ParseError(n))
		}
		data = data[n:]
		var v uint64
		var b []byte
		switch typ {
		case protowire.VarintType:
			v, n = protowire.ConsumeVarint(data)
		case protowire.Fixed32Type:
			var x uint32
			x, n = protowire.ConsumeFixed32(data)
			v = uint64(x)
		case protowire.Fixed64Type:
			v, n = protowire.ConsumeFixed64(data)
		case protowire.BytesType:
			b, n = protowire.ConsumeBytes(data)
		default:
			n = protowire.ConsumeFieldValue(num, typ, data)
		}
		if n < 0 {
			return fmt.Errorf("field %d: %w", num, protowire.ParseError(n))
		}
		data = data[n:]
		if err := fn(num, typ, v, b); err != nil {
			return err
		}
	}
	return nil
}

func parsePiece(data []byte) (piece string, score float32, typ int8, err error) {
	typ = spNormal
	err = walkProto(data, func(num protowire.Number, wt protowire.Type, v uint64, b []byte) error {
		switch num {
		case 1:
			if wt != protowire.BytesType {
				return fmt.Errorf("piece: wire type %d, want bytes", wt)
			}
			piece = string(b)
		case 2:
			if wt != protowire.Fixed32Type {
				return fmt.Errorf("score: wire type %d, want fixed32", wt)
			}
			score = math.Float32frombits(uint32(v))
		case 3:
			if wt != protowire.VarintType {
				return fmt.Errorf("type: wire type %d, want varint", wt)
			}
			if v < spNormal || v > spByte {
				return fmt.Errorf("type %d is not a SentencePiece piece type", v)
			}
			typ = int8(v)
		}
		return nil
	})
	return piece, score, typ, err
}

func parseBytePiece(p string) (byte, bool) {
	if len(p) != 6 || p[:3] != "<0x" || p[5] != '>' {
		return 0, false
	}
	hi, ok1 := hexVal(p[3])
	lo, ok2 := hexVal(p[4])
	return hi<<4 | lo, ok1 && ok2
}

func hexVal(c byte) (byte, bool) {
	switch {
	case c >= '0' && c <= '9':
		return c - '0', true
	case c >= 'A' && c <= 'F':
		return c - 'A' + 10, true
	case c >= 'a' && c <= 'f':
		return c - 'a' + 10, true
	}
	return 0, false
}

// Kind returns "sentencepiece".
func (t *SentencePiece) Kind() string { return KindSentencePiece }

// VocabSize returns the number of pieces.
func (t *SentencePiece) VocabSize() int { return len(t.pieces) }

// BOS returns the trainer's bos_id, -1 when disabled.
func (t *SentencePiece) BOS() int { return t.bosID }

// EOS returns the trainer's eos_id plus the eos_token_id of the model configs.
func (t *SentencePiece) EOS() []int { return append([]int(nil), t.eos...) }

// AddBOS reports whether BOS is prepended (tokenizer_config.json add_bos_token,
// true by default as for LlamaTokenizer).
func (t *SentencePiece) AddBOS() bool { return t.addBOS && t.bosID >= 0 }

// normalize applies the identity normalizer: optional removal of extra spaces,
// the dummy prefix and escaping of spaces as U+2581.
func (t *SentencePiece) normalize(text string) string {
	if t.removeExtraSpaces {
		text = strings.Join(strings.FieldsFunc(text, func(r rune) bool { return r == ' ' }), " ")
	}
	if text == "" {
		return ""
	}
	if t.addDummyPrefix {
		text = " " + text
	}
	if t.escapeSpaces {
		text = strings.ReplaceAll(text, " ", spaceSymbol)
	}
	return text
}

// spSymbol is one symbol of the merge loop: the byte range [start, end) of
// the normalized text, linked to its neighbours. A merged-away symbol has
// start == end.
type spSymbol struct {
	start, end int32
	prev, next int32
}

// Encode tokenizes text without BOS/EOS.
func (t *SentencePiece) Encode(text string) []int {
	norm := t.normalize(text)
	if norm == "" {
		return nil
	}
	ids := make([]int, 0, len(norm)/3+1)
	var sc spScratch
	if !t.splitWords {
		return t.encodeRange(norm, ids, &sc)
	}
	// No piece holds U+2581 after another character, so no merge can cross
	// the start of a "▁word": encode word by word, through the cache.
	spaceWords(norm, func(w string) { ids = t.encodeWord(w, ids, &sc) })
	return ids
}

// spaceOnlyAtStart reports whether every U+2581 of piece is at its start or
// right after another U+2581. When that holds for every piece of a
// vocabulary, no merge can cross the start of a "▁word" and words (see
// spaceWords) encode independently.
func spaceOnlyAtStart(piece string) bool {
	for i := strings.Index(piece, spaceSymbol); i >= 0; {
		if i > 0 && !strings.HasSuffix(piece[:i], spaceSymbol) {
			return false
		}
		j := strings.Index(piece[i+len(spaceSymbol):], spaceSymbol)
		if j < 0 {
			break
		}
		i += len(spaceSymbol) + j
	}
	return true
}

// spaceWords calls word with each "▁word" of s in order: the pieces that
// start at a U+2581 not preceded by another one (the first piece starts at
// 0).
func spaceWords(s string, word func(string)) {
	start := 0
	for i := 1; i < len(s); i++ {
		if s[i] == spaceSymbol[0] && strings.HasPrefix(s[i:], spaceSymbol) && !strings.HasSuffix(s[:i], spaceSymbol) {
			word(s[start:i])
			start = i
			i += len(spaceSymbol) - 1
		}
	}
	word(s[start:])
}

func (t *SentencePiece) encodeWord(w string, ids []int, sc *spScratch) []int {
	if len(w) > maxCachedWord {
		return t.encodeRange(w, ids, sc)
	}
	t.mu.Lock()
	cached, ok := t.cache[w]
	t.mu.Unlock()
	if ok {
		return append(ids, cached...)
	}
	n0 := len(ids)
	ids = t.encodeRange(w, ids, sc)
	t.mu.Lock()
	if len(t.cache) < maxCacheEntries {
		t.cache[w] = append([]int(nil), ids[n0:]...)
	}
	t.mu.Unlock()
	return ids
}

type spScratch struct {
	syms []spSymbol
	heap mergeHeap
}

// encodeRange runs the BPE merge loop over norm (already normalized).
func (t *SentencePiece) encodeRange(norm string, ids []int, sc *spScratch) []int {
	if norm == "" {
		return ids
	}
	syms := sc.syms[:0]
	for i := 0; i < len(norm); {
		n := t.userDefLen(norm[i:])
		if n == 0 {
			_, n = utf8.DecodeRuneInString(norm[i:])
		}
		k := int32(len(syms))
		syms = append(syms, spSymbol{start: int32(i), end: int32(i + n), prev: k - 1, next: k + 1})
		i += n
	}
	syms[len(syms)-1].next = -1
	sc.syms = syms

	h := &sc.heap
	h.reset()
	var revMerge map[string][2]string // unused pieces formed by merges, for resegmentation
	push := func(l int32) {
		if l < 0 {
			return
		}
		r := syms[l].next
		if r < 0 {
			return
		}
		s := norm[syms[l].start:syms[r].end]
		id, ok := t.pieceID[s]
		if !ok {
			return
		}
		h.push(mergeItem{key: -float64(t.scores[id]), pos: l, right: r, size: int32(len(s))})
	}
	for i := range syms {
		push(int32(i))
	}
	for h.len() > 0 {
		m := h.pop()
		l, r := m.pos, m.right
		ls, rs := &syms[l], &syms[r]
		if ls.start == ls.end || rs.start == rs.end || ls.next != r || rs.end-ls.start != m.size {
			continue // stale
		}
		if id := t.pieceID[norm[ls.start:rs.end]]; t.types[id] == spUnused {
			if revMerge == nil {
				revMerge = make(map[string][2]string)
			}
			revMerge[norm[ls.start:rs.end]] = [2]string{norm[ls.start:ls.end], norm[rs.start:rs.end]}
		}
		ls.end = rs.end
		ls.next = rs.next
		if rs.next >= 0 {
			syms[rs.next].prev = l
		}
		rs.start, rs.end = 0, 0
		push(ls.prev)
		push(l)
	}

	for i := int32(0); i >= 0; i = syms[i].next {
		ids = t.emit(ids, norm[syms[i].start:syms[i].end], revMerge)
	}
	return ids
}

// userDefLen returns the length of the longest user-defined symbol at the
// start of s, 0 when none.
func (t *SentencePiece) userDefLen(s string) int {
	if t.maxUserLen == 0 {
		return 0
	}
	for n := min(t.maxUserLen, len(s)); n > 0; n-- {
		if t.userDefs[s[:n]] {
			return n
		}
	}
	return 0
}

// emit appends the ids of one final symbol: its piece id, the pieces an unused
// piece was merged from, or its byte pieces / unk when it is not a piece.
func (t *SentencePiece) emit(ids []int, piece string, revMerge map[string][2]string) []int {
	id, ok := t.reservedID[piece]
	if !ok {
		id, ok = t.pieceID[piece]
	}
	if ok && t.types[id] == spUnused {
		if parts, found := revMerge[piece]; found {
			ids = t.emit(ids, parts[0], revMerge)
			return t.emit(ids, parts[1], revMerge)
		}
	}
	if ok {
		return append(ids, id)
	}
	if t.byteFallback {
		for i := 0; i < len(piece); i++ {
			ids = append(ids, t.byteID[piece[i]])
		}
		return ids
	}
	return append(ids, t.unkID)
}

// Decode turns ids back into text: control pieces are skipped, U+2581 becomes
// a space, byte pieces are joined into UTF-8 (invalid sequences become
// U+FFFD) and the dummy-prefix space of the first piece is removed.
func (t *SentencePiece) Decode(ids []int) string {
	var sb strings.Builder
	var pend []byte
	first := true
	flush := func() {
		if len(pend) == 0 {
			return
		}
		sb.WriteString(strings.ToValidUTF8(string(pend), "\uFFFD"))
		pend = pend[:0]
	}
	for _, id := range ids {
		if id < 0 || id >= len(t.pieces) {
			continue
		}
		switch t.types[id] {
		case spControl:
			continue
		case spByte:
			b, _ := parseBytePiece(t.pieces[id])
			pend = append(pend, b)
			first = false
			continue
		}
		flush()
		s := t.pieces[id]
		if t.types[id] == spUnknown {
			s = " \u2047 "
		} else if t.escapeSpaces {
			s = strings.ReplaceAll(s, spaceSymbol, " ")
		}
		if first && t.addDummyPrefix && len(s) > 0 && s[0] == ' ' {
			s = s[1:]
		}
		first = false
		sb.WriteString(s)
	}
	flush()
	return sb.String()
}

// DecodeToken returns the text of one piece: U+2581 as a space, a byte piece
// as its single raw byte, control pieces as "".
func (t *SentencePiece) DecodeToken(id int) string {
	if id < 0 || id >= len(t.pieces) {
		return ""
	}
	switch t.types[id] {
	case spControl:
		return ""
	case spUnknown:
		return " \u2047 "
	case spByte:
		b, _ := parseBytePiece(t.pieces[id])
		return string([]byte{b})
	}
	if t.escapeSpaces {
		return strings.ReplaceAll(t.pieces[id], spaceSymbol, " ")
	}
	return t.pieces[id]
}

// Piece returns the raw piece string of id ("" when out of range).
func (t *SentencePiece) Piece(id int) string {
	if id < 0 || id >= len(t.pieces) {
		return ""
	}
	return t.pieces[id]
}
