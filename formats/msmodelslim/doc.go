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
// quant_model_description.json maps "model_quant_type" and every tensor name
// to a type: "FLOAT", "W8A16", "W4A16" or "W8A8" are supported; sparse
// (W8A8S/W8A8SC), dynamic (W8A8_DYNAMIC, W4A8_DYNAMIC) and KV-cache (C8)
// quantization are refused with a message.
package msmodelslim
