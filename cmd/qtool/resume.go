package main

import (
	"crypto/sha256"
	"encoding/binary"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"time"

	"github.com/urfave/cli/v2"

	"qtool/formats/infile"
	"qtool/quantize/calib"
)

// resumeKey lists what a run's result depends on, so that --resume
// continues only a run with the same inputs: the command, the source
// checkpoint (its path and its files' names, sizes and times), the
// calibration text and the token windows made of it, every flag that
// changes the numbers or the output, the backend (its numerics differ
// between devices and kernels), the thread count (the CPU splits its sums
// by it) and the qtool binary itself.
func resumeKey(c *cli.Context, hfDir string, threads int, device string, windows [][]int) ([]calib.KeyField, error) {
	var key []calib.KeyField
	add := func(name, value string) { key = append(key, calib.KeyField{Name: name, Value: value}) }
	add("command", c.Command.Name)
	abs, err := filepath.Abs(hfDir)
	if err != nil {
		return nil, err
	}
	add("--hf", abs)
	src, err := dirFingerprint(abs)
	if err != nil {
		return nil, err
	}
	add("source model files", src)
	sum, n, err := fileDigest(c.String("calib"))
	if err != nil {
		return nil, fmt.Errorf("--calib: %w", err)
	}
	add("--calib contents", fmt.Sprintf("%d bytes, sha256 %s", n, sum))
	h := sha256.New()
	for _, w := range windows {
		for _, id := range w {
			binary.Write(h, binary.LittleEndian, int32(id))
		}
		h.Write([]byte{0xff, 0xff, 0xff, 0xff})
	}
	add("calibration tokens", fmt.Sprintf("sha256 %x", h.Sum(nil)[:8]))
	// Flags that only say where and how to report do not change the result.
	skip := map[string]bool{"hf": true, "calib": true, "out": true, "resume": true, "verify": true, "verify-chunks": true,
		"json": true, "quiet": true, "threads": true, "device": true, "help": true}
	var names []string
	for _, f := range c.Command.Flags {
		if n := f.Names()[0]; !skip[n] {
			names = append(names, n)
		}
	}
	slices.Sort(names)
	for _, n := range names {
		add("--"+n, fmt.Sprint(c.Value(n)))
	}
	add("--threads", fmt.Sprint(threads))
	add("device", device)
	exe := "unknown"
	if p, err := os.Executable(); err == nil {
		if sum, _, err := fileDigest(p); err == nil {
			exe = "sha256 " + sum
		}
	}
	add("qtool binary", exe)
	return key, nil
}

// fileDigest returns the first 16 hex digits of the SHA-256 of a file and
// its size.
func fileDigest(path string) (string, int64, error) {
	f, _, err := infile.Open(path)
	if err != nil {
		return "", 0, err
	}
	defer f.Close()
	h := sha256.New()
	n, err := io.Copy(h, f)
	if err != nil {
		return "", 0, err
	}
	return fmt.Sprintf("%x", h.Sum(nil)[:8]), n, nil
}

// dirFingerprint describes the regular files of a checkpoint directory by
// name, size and modification time (hashing gigabytes of weights at every
// start would cost more than the layers it saves).
func dirFingerprint(dir string) (string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return "", err
	}
	h := sha256.New()
	var files int
	var bytes int64
	var newest time.Time
	for _, e := range ents {
		fi, err := os.Stat(filepath.Join(dir, e.Name()))
		if err != nil || !fi.Mode().IsRegular() {
			continue
		}
		files++
		bytes += fi.Size()
		if fi.ModTime().After(newest) {
			newest = fi.ModTime()
		}
		fmt.Fprintf(h, "%s\x00%d\x00%d\x00", e.Name(), fi.Size(), fi.ModTime().UnixNano())
	}
	return fmt.Sprintf("%d files, %d bytes, newest modified %s, digest %x", files, bytes,
		newest.UTC().Format(time.RFC3339), h.Sum(nil)[:8]), nil
}
