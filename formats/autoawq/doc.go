// Package autoawq reads and writes AutoAWQ "GEMM" checkpoints, the layout
// that transformers' AwqConfig (version "gemm") and vLLM's awq/awq_marlin
// load.
//
// Layout (sources: casper-hansen/AutoAWQ awq/modules/linear/gemm.py and
// awq/utils/packing_utils.py; vLLM quantization/awq.py; see
// ../shared/docs/peers.md §5a). Each quantized nn.Linear with in input and
// out output features and group size g is stored as three tensors:
//
//	qweight int32 [in, out/8]    unsigned 4-bit codes u = round(w/s) + z
//	qzeros  int32 [in/g, out/8]  raw zero points z in 0..15 (no "−1")
//	scales  fp16  [in/g, out]
//
// Both int32 tensors pack eight output columns per word in AWQ order: nibble
// i (bits 4i..4i+3) of word c holds column 8c+Order[i], Order =
// [0,2,4,6,1,3,5,7]; column 8c+j is in nibble ReverseOrder[j] =
// [0,4,1,5,2,6,3,7][j]. Dequantization is w[n][k] = (u[k][n] − z[k/g][n]) ·
// s[k/g][n]. In qtool's model.Quantized the codes are stored as q = u − 8 and
// Zero = z − 8 (see model.Quantized).
//
// config.json carries {"quantization_config": {"quant_method":"awq",
// "bits":4, "group_size":g, "zero_point":true, "version":"gemm",
// "modules_to_not_convert":[…] or null}}. Linears named in
// modules_to_not_convert keep a plain fp16 ".weight"; all other tensors
// (embeddings, norms, lm_head) are fp16 under their Hugging Face names.
// Weights are model.safetensors or shards with model.safetensors.index.json.
//
// Not supported (refused with a message): bits other than 4, zero_point
// false, versions gemv/exllama/ipex/marlin, the llm-awq backend.
package autoawq
