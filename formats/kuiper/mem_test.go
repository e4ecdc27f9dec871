package kuiper

import "runtime"

type runtimeMemStats = runtime.MemStats

func readMem(m *runtime.MemStats) { runtime.ReadMemStats(m) }
