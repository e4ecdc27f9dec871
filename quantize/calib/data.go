// Package calib holds what every calibration-based quantizer (GPTQ, AWQ,
// SmoothQuant) shares: the calibration data (text or JSONL, tokenized with
// the model's tokenizer and cut into evenly spaced windows as
// shared/docs/protocol.md prescribes) and Session, the layer-by-layer driver
// that runs the runtime's forward blocks (runtime.Model) over the windows
// one decoder layer at a time on a runtime.Calibrator backend (CPU or GPU),
// hands the inputs of each linear group to the quantizer, and propagates the
// quantized layer's outputs to the next layer.
package calib

import (
	"bufio"
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"unicode/utf8"

	"qtool/formats/infile"
	"qtool/runtime/tokenizer"
)

// Defaults of the calibration protocol.
const (
	DefaultNSamples = 128
	DefaultSeqLen   = 512
)

// maxCalibFile bounds the calibration file we read into memory.
const maxCalibFile = 2 << 30

// ErrTooShort is wrapped when the calibration text has fewer tokens than one
// window.
var ErrTooShort = errors.New("calibration text is shorter than one window")

// ReadText reads a calibration file: plain UTF-8 text, or JSONL with one
// {"text": "..."} object per line (chosen by a .jsonl/.json extension or a
// first non-blank byte '{'). JSONL documents are joined by a blank line.
func ReadText(path string) (string, error) {
	fi, err := os.Stat(path)
	if err != nil {
		return "", fmt.Errorf("calibration data: %w", err)
	}
	if fi.IsDir() {
		return "", fmt.Errorf("calibration data: %s is a directory, want a text or JSONL file", path)
	}
	if fi.Size() > maxCalibFile {
		return "", fmt.Errorf("calibration data: %s is %d bytes, more than the %d this tool reads", path, fi.Size(), int64(maxCalibFile))
	}
	data, err := infile.ReadFile(path, maxCalibFile)
	if err != nil {
		return "", fmt.Errorf("calibration data: %w", err)
	}
	return ParseText(path, data)
}

// ParseText is ReadText on bytes already read; name is used in errors and to
// pick the format by extension.
func ParseText(name string, data []byte) (string, error) {
	if !utf8.Valid(data) {
		off := 0
		for off < len(data) {
			r, n := utf8.DecodeRune(data[off:])
			if r == utf8.RuneError && n <= 1 {
				break
			}
			off += n
		}
		line := 1 + bytes.Count(data[:off], []byte{'\n'})
		return "", fmt.Errorf("calibration data %s: invalid UTF-8 at byte %d (line %d); convert the file to UTF-8", name, off, line)
	}
	ext := strings.ToLower(filepath.Ext(name))
	trimmed := bytes.TrimLeft(data, " \t\r\n\ufeff")
	if ext == ".jsonl" || ext == ".json" || (len(trimmed) > 0 && trimmed[0] == '{') {
		return parseJSONL(name, data)
	}
	return string(data), nil
}

func parseJSONL(name string, data []byte) (string, error) {
	var docs []string
	sc := bufio.NewScanner(bytes.NewReader(data))
	sc.Buffer(make([]byte, 1<<20), len(data)+1)
	line := 0
	for sc.Scan() {
		line++
		b := bytes.TrimSpace(sc.Bytes())
		if len(b) == 0 {
			continue
		}
		var rec struct {
			Text *string `json:"text"`
		}
		if err := json.Unmarshal(b, &rec); err != nil {
			return "", fmt.Errorf("calibration data %s: line %d: %v (want one {\"text\": ...} object per line)", name, line, err)
		}
		if rec.Text == nil {
			return "", fmt.Errorf("calibration data %s: line %d has no \"text\" field", name, line)
		}
		docs = append(docs, *rec.Text)
	}
	if err := sc.Err(); err != nil {
		return "", fmt.Errorf("calibration data %s: %w", name, err)
	}
	if len(docs) == 0 {
		return "", fmt.Errorf("calibration data %s: no JSONL records", name)
	}
	return strings.Join(docs, "\n\n"), nil
}

// Windows cuts nsamples windows of seqlen ids from ids: window i starts at
// i·⌊(len(ids)−seqlen)/nsamples⌋ (the calibration protocol: deterministic,
// evenly spread). When the text is too short for that stride to be at least
// 1, starts are spread as i·(len(ids)−seqlen)/nsamples instead.
func Windows(ids []int, nsamples, seqlen int) ([][]int, error) {
	if nsamples <= 0 || seqlen <= 1 {
		return nil, fmt.Errorf("calibration: nsamples %d and seqlen %d, want > 0 and > 1", nsamples, seqlen)
	}
	if len(ids) < seqlen {
		return nil, fmt.Errorf("calibration: %w: %d tokens, need at least seqlen = %d", ErrTooShort, len(ids), seqlen)
	}
	span := len(ids) - seqlen
	stride := span / nsamples
	out := make([][]int, nsamples)
	for i := range out {
		start := i * stride
		if stride == 0 {
			start = i * span / nsamples
		}
		out[i] = ids[start : start+seqlen]
	}
	return out, nil
}

// Load reads path, tokenizes it with tok (BOS prepended once when the
// tokenizer adds one, as in the perplexity protocol) and cuts the windows.
// It also returns the token count of the whole text.
func Load(path string, tok tokenizer.Tokenizer, nsamples, seqlen int) ([][]int, int, error) {
	text, err := ReadText(path)
	if err != nil {
		return nil, 0, err
	}
	ids := tokenizer.EncodeWithBOS(tok, text)
	w, err := Windows(ids, nsamples, seqlen)
	if err != nil {
		return nil, len(ids), fmt.Errorf("%s: %w", path, err)
	}
	return w, len(ids), nil
}
