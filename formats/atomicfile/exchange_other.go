//go:build !linux

package atomicfile

import "golang.org/x/sys/unix"

// renameExchange is not available here: exchange falls back to two renames.
func renameExchange(a, b string) error { return unix.ENOTSUP }
