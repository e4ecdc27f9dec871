//go:build !amd64 || purego

package gemm

func selectImpl() *impl { return generic }

// impls lists every kernel set usable on this CPU, best first.
func impls() []*impl { return []*impl{generic} }
