package atomicfile

import "golang.org/x/sys/unix"

// renameExchange swaps the names a and b in one step (renameat2
// RENAME_EXCHANGE).
func renameExchange(a, b string) error {
	return unix.Renameat2(unix.AT_FDCWD, a, unix.AT_FDCWD, b, unix.RENAME_EXCHANGE)
}
