// Package gptq reads and writes GPTQ checkpoints in the v1 ("gptq")
// checkpoint format that AutoGPTQ and GPTQModel save by default and that
// transformers' GPTQConfig and vLLM's gptq/gptq_marlin load.
//
// Layout (sources: AutoGPTQ auto_gptq/nn_modules/qlinear/qlinear_cuda_old.py
// pack() and qlinear_cuda.py dequantization; GPTQ quant.py for the symmetric
// zero; vLLM quantization/gptq_marlin.py; see ../shared/docs/peers.md
// §5b). A quantized nn.Linear with in inputs, out outputs, b bits and G
// groups is stored as
//
//	qweight int32 [in·b/32, out]  unsigned codes, packed along the input dim
//	qzeros  int32 [G, out·b/32]   zero point − 1, packed along the output dim
//	scales  fp16  [G, out]
//	g_idx   int32 [in]            group of each input column
//
// Packing is low bits first: element j of a packed run sits at bits
// j·b … j·b+b−1 of one little-endian bit stream (3-bit values straddle
// words, as AutoGPTQ packs them). Dequantization is
// w[n][k] = (u[k][n] − (qz[g][n] + 1)) · s[g][n] with g = g_idx[k].
// Symmetric quantization uses zero 2^(b−1), stored as 2^(b−1)−1, so 4-bit
// qzeros words are 0x77777777 and 8-bit ones 0x7F7F7F7F. With act-order
// (desc_act) g_idx is not monotone; qtool keeps it as model.Quantized.GIdx.
// "gptq_v2" checkpoints (GPTQModel) store the zero point itself; Open reads
// them, Write always writes v1.
//
// config.json carries {"quantization_config": {"quant_method":"gptq",
// "bits":b, "group_size":g or −1, "desc_act":…, "sym":…,
// "checkpoint_format":"gptq"}}. Other tensors are fp16 under their Hugging
// Face names; weights are model.safetensors or shards with an index.
//
// Refused: bits other than 2/3/4/8, unknown checkpoint_format or pack_dtype,
// quantized lm_head, per-module "dynamic" overrides, desc_act without g_idx,
// and (when writing) asymmetric zero points of 0, which v1 cannot store.
package gptq
