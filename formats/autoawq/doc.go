// Package autoawq reads and writes AutoAWQ "GEMM" checkpoints (the layout
// vLLM's awq/awq_marlin and transformers' AwqConfig load).
package autoawq
