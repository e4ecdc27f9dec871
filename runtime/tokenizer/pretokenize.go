package tokenizer

import (
	"time"
	"unicode"
	"unicode/utf8"

	"github.com/dlclark/regexp2"
)

// Split patterns of the common byte-level BPE models.
const (
	// PatternQwen2 is the Qwen2/Qwen3 pre-tokenizer regex (one digit per piece).
	PatternQwen2 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// PatternLlama3 is the Llama-3 pre-tokenizer regex (up to three digits per piece).
	PatternLlama3 = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
	// PatternGPT2 is the regex of the ByteLevel pre-tokenizer when use_regex is set.
	PatternGPT2 = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`
)

// regexTimeout bounds one regexp2 search so that a pathological pattern from a
// tokenizer file cannot hang Encode.
const regexTimeout = 5 * time.Second

// matcher finds the non-overlapping leftmost matches of a split pattern and
// calls fn with their byte ranges, in order.
type matcher interface {
	findAll(s string, fn func(start, end int))
}

// newMatcher returns the hand-written scanner for the Llama-3/Qwen patterns and
// a regexp2 matcher for any other regex.
func newMatcher(pattern string) (matcher, error) {
	switch pattern {
	case PatternQwen2:
		return llamaScanner{maxDigits: 1}, nil
	case PatternLlama3:
		return llamaScanner{maxDigits: 3}, nil
	}
	return newRegexMatcher(pattern)
}

// llamaScanner implements PatternQwen2 / PatternLlama3 by hand. Every input
// position starts a match of one of the alternatives, so the scanner only has
// to decide, at each position, which alternative matches first and how far it
// reaches, reproducing the backtracking of the regex:
//
//  1. (?i:'s|'t|'re|'ve|'m|'ll|'d)  contractions (case-insensitive; U+017F folds to s)
//  2. [^\r\n\p{L}\p{N}]?\p{L}+      a word, with one leading non-letter/digit/newline
//  3. \p{N} or \p{N}{1,3}            digits
//  4. ?[^\s\p{L}\p{N}]+[\r\n]*      punctuation run, optional leading space, trailing newlines
//  5. \s*[\r\n]+                     whitespace up to and including the last newline of the run
//  6. \s+(?!\S)                      whitespace not followed by a non-space: the run minus its
//     last character, or the whole run at the end of the text
//  7. \s+                            any other whitespace run (a single space before a digit, ...)
type llamaScanner struct{ maxDigits int }

type charClass uint8

const (
	classOther charClass = iota // [^\s\p{L}\p{N}]
	classLetter
	classNumber
	classSpace
)

func classify(r rune) charClass {
	switch {
	case r < utf8.RuneSelf:
		c := byte(r)
		switch {
		case 'a' <= c && c <= 'z', 'A' <= c && c <= 'Z':
			return classLetter
		case '0' <= c && c <= '9':
			return classNumber
		case c == ' ', '\t' <= c && c <= '\r':
			return classSpace
		}
		return classOther
	case unicode.IsLetter(r):
		return classLetter
	case unicode.IsNumber(r):
		return classNumber
	case unicode.IsSpace(r):
		return classSpace
	}
	return classOther
}

func decodeAt(s string, i int) (rune, int) {
	if i >= len(s) {
		return -1, 0
	}
	if c := s[i]; c < utf8.RuneSelf {
		return rune(c), 1
	}
	return utf8.DecodeRuneInString(s[i:])
}

func (sc llamaScanner) findAll(s string, fn func(start, end int)) {
	for i := 0; i < len(s); {
		e := sc.matchAt(s, i)
		fn(i, e)
		i = e
	}
}

// contraction returns the length of alternative 1 at i, 0 when it does not match.
func contraction(s string, i int) int {
	if s[i] != '\'' {
		return 0
	}
	r1, n1 := decodeAt(s, i+1)
	switch r1 {
	case 's', 'S', 't', 'T', 'm', 'M', 'd', 'D', '\u017f':
		return 1 + n1
	}
	r2, n2 := decodeAt(s, i+1+n1)
	lo := func(r rune) rune {
		if 'A' <= r && r <= 'Z' {
			return r + 'a' - 'A'
		}
		return r
	}
	switch [2]rune{lo(r1), lo(r2)} {
	case [2]rune{'r', 'e'}, [2]rune{'v', 'e'}, [2]rune{'l', 'l'}:
		return 1 + n1 + n2
	}
	return 0
}

// matchAt returns the end of the match that starts at i (always > i).
func (sc llamaScanner) matchAt(s string, i int) int {
	if n := contraction(s, i); n > 0 {
		return i + n
	}
	r, n := decodeAt(s, i)
	c := classify(r)

	// 2. optional leading char, then letters.
	j := -1
	if c == classLetter {
		j = i
	} else if c != classNumber && r != '\r' && r != '\n' {
		if r2, _ := decodeAt(s, i+n); r2 >= 0 && classify(r2) == classLetter {
			j = i + n
		}
	}
	if j >= 0 {
		for j < len(s) {
			r2, n2 := decodeAt(s, j)
			if classify(r2) != classLetter {
				break
			}
			j += n2
		}
		return j
	}

	// 3. digits.
	if c == classNumber {
		j = i + n
		for k := 1; k < sc.maxDigits && j < len(s); k++ {
			r2, n2 := decodeAt(s, j)
			if classify(r2) != classNumber {
				break
			}
			j += n2
		}
		return j
	}

	// 4. optional space, punctuation run, newlines.
	j = -1
	if c == classOther {
		j = i + n
	} else if r == ' ' {
		if r2, n2 := decodeAt(s, i+1); r2 >= 0 && classify(r2) == classOther {
			j = i + 1 + n2
		}
	}
	if j >= 0 {
		for j < len(s) {
			r2, n2 := decodeAt(s, j)
			if classify(r2) != classOther {
				break
			}
			j += n2
		}
		for j < len(s) && (s[j] == '\r' || s[j] == '\n') {
			j++
		}
		return j
	}

	// c is whitespace: scan the run, remembering the last newline and the
	// start of the last character.
	end, lastNL, lastStart, count := i, -1, i, 0
	for end < len(s) {
		r2, n2 := decodeAt(s, end)
		if classify(r2) != classSpace {
			break
		}
		if r2 == '\r' || r2 == '\n' {
			lastNL = end
		}
		lastStart = end
		end += n2
		count++
	}
	switch {
	case lastNL >= 0: // 5.
		return lastNL + 1
	case end == len(s): // 6. at end of text
		return end
	case count >= 2: // 6. leave the last space for the next word
		return lastStart
	}
	return end // 7.
}

// regexMatcher runs an arbitrary split regex with regexp2 (which supports
// look-ahead). regexp2 works on runes; offsets are mapped back to bytes.
type regexMatcher struct{ re *regexp2.Regexp }

func newRegexMatcher(pattern string) (*regexMatcher, error) {
	re, err := regexp2.Compile(pattern, regexp2.None)
	if err != nil {
		return nil, err
	}
	re.MatchTimeout = regexTimeout
	return &regexMatcher{re: re}, nil
}

func (m *regexMatcher) findAll(s string, fn func(start, end int)) {
	runes := []rune(s)
	off := make([]int, len(runes)+1) // byte offset of each rune index
	b := 0
	for i := range runes {
		off[i] = b
		_, n := utf8.DecodeRuneInString(s[b:])
		b += n
	}
	off[len(runes)] = len(s)
	match, err := m.re.FindRunesMatch(runes)
	for err == nil && match != nil {
		start, end := match.Index, match.Index+match.Length
		if end > start {
			fn(off[start], off[end])
		}
		match, err = m.re.FindNextMatch(match)
	}
}

// splitIsolated splits s into the matches of m and the gaps between them, in
// order (the "Isolated" behaviour of the Hugging Face Split pre-tokenizer).
func splitIsolated(m matcher, s string, out []string) []string {
	prev := 0
	m.findAll(s, func(start, end int) {
		if start > prev {
			out = append(out, s[prev:start])
		}
		out = append(out, s[start:end])
		prev = end
	})
	if prev < len(s) {
		out = append(out, s[prev:])
	}
	return out
}
