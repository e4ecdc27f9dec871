package calib

import (
	"errors"
	"strings"
	"testing"
	"unicode/utf8"
)

func TestWindowsProtocol(t *testing.T) {
	ids := make([]int, 10000)
	for i := range ids {
		ids[i] = i
	}
	w, err := Windows(ids, 128, 512)
	if err != nil {
		t.Fatal(err)
	}
	stride := (10000 - 512) / 128 // protocol.md: window i starts at i·⌊(len−512)/128⌋
	for i, win := range w {
		if len(win) != 512 || win[0] != i*stride {
			t.Fatalf("window %d starts at %d (len %d), want %d", i, win[0], len(win), i*stride)
		}
	}
	// too short for a stride of 1: still evenly spread, in range
	w, err = Windows(ids[:600], 128, 512)
	if err != nil {
		t.Fatal(err)
	}
	if w[127][0] != 127*88/128 || w[127][511] >= 600 {
		t.Fatalf("last window starts at %d", w[127][0])
	}
	if _, err := Windows(ids[:100], 4, 512); !errors.Is(err, ErrTooShort) {
		t.Fatalf("short text: %v", err)
	}
}

func TestParseText(t *testing.T) {
	cases := []struct {
		name, file, data, want, err string
	}{
		{"plain", "a.txt", "hello\nworld", "hello\nworld", ""},
		{"jsonl by extension", "a.jsonl", "{\"text\": \"one\"}\n\n{\"text\": \"two\", \"id\": 3}\n", "one\n\ntwo", ""},
		{"jsonl by content", "data", " {\"text\": \"x\"}", "x", ""},
		{"jsonl missing text", "a.jsonl", "{\"body\": \"x\"}", "", "no \"text\" field"},
		{"jsonl broken", "a.jsonl", "{\"text\": \"x\"}\n{oops", "", "line 2"},
		{"empty jsonl", "a.jsonl", "\n\n", "", "no JSONL records"},
		{"latin-1", "a.txt", "ok\ncaf\xe9", "", "invalid UTF-8 at byte 6 (line 2)"},
	}
	for _, tc := range cases {
		t.Run(tc.name, func(t *testing.T) {
			got, err := ParseText(tc.file, []byte(tc.data))
			if tc.err != "" {
				if err == nil || !strings.Contains(err.Error(), tc.err) {
					t.Fatalf("error %v, want %q", err, tc.err)
				}
				return
			}
			if err != nil || got != tc.want {
				t.Fatalf("got %q, %v; want %q", got, err, tc.want)
			}
		})
	}
}

func FuzzParseText(f *testing.F) {
	f.Add("a.txt", []byte("plain text"))
	f.Add("a.jsonl", []byte("{\"text\": \"one\"}\n{\"text\": \"two\"}"))
	f.Add("x", []byte("{\"text\": 1}"))
	f.Add("a.txt", []byte("\xff\xfe"))
	f.Fuzz(func(t *testing.T, name string, data []byte) {
		s, err := ParseText(name, data)
		if err == nil && !utf8.ValidString(s) {
			t.Fatalf("accepted text is not UTF-8: %q", s)
		}
	})
}
