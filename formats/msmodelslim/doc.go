// Package msmodelslim reads and writes the quantized-weight exports of
// Huawei's msmodelslim (Ascend) for LLaMA/Qwen models.
//
// Layout (sources: seed 001 "msmodelslim量化权重格式" in ../shared/seeds;
// Ascend/msmodelslim docs quantized_weight_format.md and ascendv1.py; see
// ../shared/docs/peers.md §5d). An export directory holds config.json,
// quant_model_description.json and quant_model_weight.safetensors (seed 001,
// v0) or quant_model_weights.safetensors (v1, possibly sharded with
// quant_model_weights.safetensors.index.json). Tensors keep their Hugging
// Face names; quantized linears add parameters beside ".weight":
//
//	W8A16 / W4A16  weight int8 [n,k] (int4 values unpacked in int8 for W4A16)
//	               weight_scale fp32 [n] per channel, or [n, k/group] per group
//	               weight_offset fp32, same shape (zeros when symmetric)
//	               w = (weight − weight_offset) · weight_scale
//	W8A8 (static)  weight int8 [n,k], input_scale and input_offset [1] (fp16
//	               or bf16), deq_scale [n] (fp32, or int64 holding the fp32
//	               bit pattern sign-extended), quant_bias int32 [n], optional
//	               bias: x_q = round(x/input_scale + input_offset),
//	               y = (x_q·Wᵀ + quant_bias) · deq_scale
//
// The offset sign was checked against the fixtures: (weight − offset) ·
// scale reproduces llama-mini's float weights to half a step, (weight +
// offset) does not (the NPU kernel adds, so Ascend loaders negate it).
//
// SmoothQuant ("anti-outlier") exports fold the smoothing factors into the
// norms preceding the quantized linears: "<norm>.module.weight" (the scaled
// norm) and "<norm>.module.bias", plus the original "<norm>.weight" kept for
// float fallback. qtool maps module.weight to attn_norm/mlp_norm and
// module.bias to model.AttnNormBias/MLPNormBias, and drops the plain copy on
// reading; Write writes the folded weight under both names (see Write).
//
//	W8A8S          the W8A8 layout, the weights from sparse quantization
//	               (many zeros); read and run like W8A8 (model.W8A8.Sparse)
//	W8A8_DYNAMIC   weight int8 [n,k], weight_scale [n,1], weight_offset [n,1]
//	               (zeros): per-token symmetric int8 activations,
//	               s_t = max|x_t|/127 (model.W8A8.Dynamic). The layout equals
//	               W8A16's, so only the description tells them apart. Source:
//	               ../shared/docs/peers.md §5d (msmodelslim's save code,
//	               ascendv1.py), and MindIE-LLM's W8A8 dynamic loader.
//	KV cache C8    "kv_cache_type": "C8" and per attention layer
//	               <k linear>.kv_cache_scale / .kv_cache_offset and the same
//	               after v_proj ("<merged qkv>.k_proj.kv_cache_scale" when q/k/v
//	               are one linear), fp32 or fp16 [kv channels]:
//	               cache_int = cache/scale + offset, cache = (cache_int − offset)·scale.
//	               msmodelslim takes the ranges where HF's attention hands the
//	               keys and values to DynamicCache.update(), that is after
//	               RoPE (MindStudio-ModelSlim docs/zh/.../kvcache_quant.md);
//	               qtool caches them there too.
//
// quant_model_description.json maps "model_quant_type" and every tensor name
// to a type: "FLOAT", "W8A16", "W4A16", "W8A8", "W8A8S" and "W8A8_DYNAMIC"
// are supported, and kv_cache_type "C8"; sparse-compressed (W8A8SC), 4-bit
// dynamic (W4A8_DYNAMIC) and other types are refused with a message.
package msmodelslim
