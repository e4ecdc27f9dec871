package runtime

import (
	"fmt"
	"syscall"

	"qtool/formats/model"
)

// KVBudget is the most bytes a KV cache may take (0: half the machine's
// memory, or half the address-space limit when one is set and lower).
// Sizes come from flags and files (--max-new, --ctx,
// max_position_embeddings), so they are checked against it before anything
// is allocated.
var KVBudget int64

func kvBudget() int64 {
	if KVBudget > 0 {
		return KVBudget
	}
	budget := int64(1) << 62
	if mem := totalMemory(); mem > 0 {
		budget = mem / 2
	}
	var rl syscall.Rlimit
	if syscall.Getrlimit(syscall.RLIMIT_AS, &rl) == nil && rl.Cur/2 < uint64(budget) {
		budget = int64(rl.Cur / 2)
	}
	return budget
}

// checkKV refuses a KV cache of positions positions that would not fit the
// budget: 2 (keys, values) × layers × positions × kv_dim float32 values.
func checkKV(what string, cfg model.Config, positions int) error {
	perPos := int64(2*4) * int64(cfg.Layers) * int64(cfg.KVDim())
	budget := kvBudget()
	if perPos <= 0 || int64(positions) <= budget/perPos {
		return nil
	}
	gib := func(b float64) float64 { return b / (1 << 30) }
	return fmt.Errorf("%s needs a KV cache of %d positions: %.1f GiB (%d layers × kv_dim %d × keys and values × 4 bytes each), more than the %.1f GiB allowed (half the memory of this machine or of the process's address-space limit)",
		what, positions, gib(float64(perPos)*float64(positions)), cfg.Layers, cfg.KVDim(), gib(float64(budget)))
}
