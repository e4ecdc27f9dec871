#!/usr/bin/env python3
"""Cross-check qtool's AutoAWQ and GPTQ writers against the documented layouts.

Each checkpoint written by qtool (convert.Save) is dequantized here with an
independent implementation of the published formulas (peers.md §5a AutoAWQ
GEMM, §5b GPTQ v1), loaded into transformers' LlamaForCausalLM (or, when
transformers is missing, a minimal torch Llama forward), and its perplexity
is computed with the GPTQ protocol of docs/protocol.md on reference token
ids (no tokenizer needed). The result is printed next to qtool's number and
must agree within --tol (relative, default 0.1 %).

Usage:
  python3 convert/testdata/check_hf_quant.py --ids testdata/llama-mini/ids-sotu-test.raw.json \
      --qtool bin/hfq/qtool-ppl.json bin/hfq/llama-mini-awq bin/hfq/llama-mini-gptq-actorder

Dependencies: numpy, torch; transformers optional. Safetensors files are
parsed by hand (8-byte header length, JSON header, raw little-endian data).
"""

import argparse
import json
import math
import os
import struct
import sys
import tempfile

import numpy as np

DTYPES = {"F32": np.float32, "F16": np.float16, "I32": np.int32, "I64": np.int64,
          "I8": np.int8, "U8": np.uint8, "F64": np.float64}


def read_safetensors(path):
    """Returns {name: numpy array} of one .safetensors file (BF16 widened)."""
    with open(path, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        lo, hi = info["data_offsets"]
        raw = data[base + lo:base + hi]
        if info["dtype"] == "BF16":
            u = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
            arr = u.view(np.float32)
        else:
            arr = np.frombuffer(raw, dtype=np.dtype(DTYPES[info["dtype"]]).newbyteorder("<"))
        out[name] = arr.reshape(info["shape"])
    return out


def read_checkpoint(d):
    idx = os.path.join(d, "model.safetensors.index.json")
    if os.path.exists(idx):
        files = sorted(set(json.load(open(idx))["weight_map"].values()))
    else:
        files = ["model.safetensors"]
    out = {}
    for f in files:
        out.update(read_safetensors(os.path.join(d, f)))
    return out


def unpack_cols(words, bits, order=None):
    """Unpacks int32 words [r, c] holding 32/bits values along the last
    axis, low bits first, into [r, c*32/bits]. order[i] is the column
    (within a word's group) held in field i (AWQ); None is sequential."""
    per = 32 // bits
    w = words.astype(np.int64) & 0xFFFFFFFF
    fields = [((w >> (bits * i)) & ((1 << bits) - 1)) for i in range(per)]
    out = np.empty((words.shape[0], words.shape[1] * per), dtype=np.int64)
    for i in range(per):
        col = order[i] if order is not None else i
        out[:, col::per] = fields[i]
    return out


AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]  # field i holds column 8c + AWQ_ORDER[i]


def dequant_awq(t, mod, group):
    """AutoAWQ GEMM: qweight [in, out/8], qzeros [in/g, out/8] (raw zero),
    scales [in/g, out]; W[k,n] = (q[k,n] - z[k/g,n]) * s[k/g,n]."""
    q = unpack_cols(t[mod + ".qweight"], 4, AWQ_ORDER)          # [in, out]
    z = unpack_cols(t[mod + ".qzeros"], 4, AWQ_ORDER)           # [in/g, out]
    s = t[mod + ".scales"].astype(np.float32)                   # [in/g, out]
    g = np.arange(q.shape[0]) // group
    w = (q - z[g]).astype(np.float32) * s[g]                    # [in, out]
    return np.ascontiguousarray(w.T)                            # nn.Linear [out, in]


def dequant_gptq(t, mod, bits):
    """GPTQ v1: qweight [in*b/32, out] packed along the input dim, qzeros
    [G, out*b/32] holding zero-1, scales [G, out], g_idx [in];
    W[k,n] = s[g_idx[k],n] * (q[k,n] - (qz[g_idx[k],n] + 1))."""
    if 32 % bits:
        raise SystemExit("this checker unpacks 2/4/8-bit GPTQ only")
    qw = t[mod + ".qweight"]
    q = unpack_cols(np.ascontiguousarray(qw.T), bits).T           # [in, out]
    z = unpack_cols(t[mod + ".qzeros"], bits) + 1                 # [G, out]
    s = t[mod + ".scales"].astype(np.float32)
    g = t[mod + ".g_idx"].astype(np.int64)
    w = s[g] * (q - z[g]).astype(np.float32)
    return np.ascontiguousarray(w.T)


def dequantize_dir(d):
    cfg = json.load(open(os.path.join(d, "config.json")))
    qc = cfg.pop("quantization_config")
    t = read_checkpoint(d)
    mods = sorted({k.rsplit(".", 1)[0] for k in t if k.endswith(".qweight")})
    sd = {}
    for mod in mods:
        if qc["quant_method"] == "awq":
            assert qc["bits"] == 4 and qc["version"] == "gemm" and qc["zero_point"], qc
            sd[mod + ".weight"] = dequant_awq(t, mod, qc["group_size"])
        elif qc["quant_method"] == "gptq":
            assert qc.get("checkpoint_format", "gptq") == "gptq", qc
            sd[mod + ".weight"] = dequant_gptq(t, mod, qc["bits"])
        else:
            raise SystemExit("%s: unknown quant_method %r" % (d, qc["quant_method"]))
    quant_parts = (".qweight", ".qzeros", ".scales", ".g_idx")
    for k, v in t.items():
        if not k.endswith(quant_parts):
            sd[k] = v.astype(np.float32)
    cfg["torch_dtype"] = "float32"
    cfg["dtype"] = "float32"
    return cfg, sd, qc, len(mods)


def hf_model(cfg, sd, torch):
    import transformers
    from safetensors.torch import save_file
    tmp = tempfile.mkdtemp(prefix="hfq-")
    json.dump(cfg, open(os.path.join(tmp, "config.json"), "w"))
    save_file({k: torch.from_numpy(np.ascontiguousarray(v)) for k, v in sd.items()},
              os.path.join(tmp, "model.safetensors"), metadata={"format": "pt"})
    m = transformers.LlamaForCausalLM.from_pretrained(tmp, torch_dtype=torch.float32,
                                                      attn_implementation="eager")
    return lambda ids: m(ids).logits, m


def torch_llama(cfg, sd, torch, dev):
    """A minimal Llama forward (RMSNorm, rotate-half RoPE, GQA causal
    attention, SwiGLU) used when transformers is not installed."""
    W = {k: torch.from_numpy(np.ascontiguousarray(v)).to(dev) for k, v in sd.items()}
    H, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    nh, nkv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or H // nh
    eps = cfg["rms_norm_eps"]
    theta = cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
    head = W.get("lm_head.weight", W["model.embed_tokens.weight"])

    def norm(x, w):
        return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))

    def rope(x, cos, sin):
        x1, x2 = x[..., : hd // 2], x[..., hd // 2:]
        return x * cos + torch.cat((-x2, x1), -1) * sin

    def fwd(ids):
        T = ids.shape[1]
        inv = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32, device=dev) / hd))
        f = torch.outer(torch.arange(T, dtype=torch.float32, device=dev), inv)
        emb = torch.cat((f, f), -1)
        cos, sin = emb.cos(), emb.sin()
        mask = torch.full((T, T), float("-inf"), device=dev).triu(1)
        x = W["model.embed_tokens.weight"][ids[0]]
        for l in range(L):
            p = "model.layers.%d." % l
            h = norm(x, W[p + "input_layernorm.weight"])
            q = (h @ W[p + "self_attn.q_proj.weight"].T).view(T, nh, hd).transpose(0, 1)
            k = (h @ W[p + "self_attn.k_proj.weight"].T).view(T, nkv, hd).transpose(0, 1)
            v = (h @ W[p + "self_attn.v_proj.weight"].T).view(T, nkv, hd).transpose(0, 1)
            q, k = rope(q, cos, sin), rope(k, cos, sin)
            k = k.repeat_interleave(nh // nkv, 0)
            v = v.repeat_interleave(nh // nkv, 0)
            a = torch.softmax(q @ k.transpose(1, 2) / math.sqrt(hd) + mask, -1) @ v
            x = x + a.transpose(0, 1).reshape(T, nh * hd) @ W[p + "self_attn.o_proj.weight"].T
            h = norm(x, W[p + "post_attention_layernorm.weight"])
            g = h @ W[p + "mlp.gate_proj.weight"].T
            u = h @ W[p + "mlp.up_proj.weight"].T
            x = x + (torch.nn.functional.silu(g) * u) @ W[p + "mlp.down_proj.weight"].T
        return (norm(x, W["model.norm.weight"]) @ head.T)[None]

    return fwd


def perplexity(fwd, ids, ctx, chunks, torch, dev):
    """GPTQ protocol: disjoint chunks of ctx tokens (tail dropped), the
    ctx-1 next-token NLLs of each chunk averaged, ppl = exp(mean over chunks),
    NLL summed in float64."""
    n = len(ids) // ctx
    if chunks:
        n = min(n, chunks)
    total = 0.0
    with torch.no_grad():
        for c in range(n):
            x = torch.tensor(ids[c * ctx:(c + 1) * ctx], dtype=torch.long, device=dev)[None]
            logits = fwd(x)[0].float()
            nll = torch.nn.functional.cross_entropy(logits[:-1], x[0, 1:], reduction="none")
            total += nll.double().mean().item()
    return math.exp(total / n), n


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dirs", nargs="+", help="AutoAWQ / GPTQ checkpoint directories written by qtool")
    ap.add_argument("--ids", required=True, help="reference token ids (JSON list)")
    ap.add_argument("--qtool", help="qtool-ppl.json written by convert's TestWriteHFQuant")
    ap.add_argument("--ctx", type=int, default=512)
    ap.add_argument("--chunks", type=int, default=None, help="chunks scored (default: as in --qtool, 0 = all)")
    ap.add_argument("--tol", type=float, default=1e-3, help="relative tolerance against qtool (default 0.1 %%)")
    ap.add_argument("--no-transformers", action="store_true", help="use the minimal torch forward")
    a = ap.parse_args()

    import torch
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    ids = json.load(open(a.ids))
    ref = json.load(open(a.qtool)) if a.qtool else {}
    chunks = a.chunks if a.chunks is not None else ref.get("chunks", 0)
    use_hf = not a.no_transformers
    if use_hf:
        try:
            import transformers  # noqa: F401
            import safetensors  # noqa: F401
        except ImportError as e:
            print("transformers unavailable (%s); using the minimal torch Llama forward" % e)
            use_hf = False
    print("torch %s, device %s, forward %s, %d ids, ctx %d, chunks %s" % (
        torch.__version__, dev, "transformers LlamaForCausalLM" if use_hf else "minimal torch", len(ids), a.ctx, chunks or "all"))
    failed = False
    for d in a.dirs:
        cfg, sd, qc, nmods = dequantize_dir(d)
        if use_hf:
            fwd, m = hf_model(cfg, sd, torch)
            m.to(dev).eval()
        else:
            fwd = torch_llama(cfg, sd, torch, dev)
        ppl, n = perplexity(fwd, ids, a.ctx, chunks, torch, dev)
        name = os.path.basename(os.path.normpath(d))
        q = ref.get(name)
        line = "%s: %s %d-bit g%s desc_act=%s, %d quantized linears: ppl %.6f over %d chunks" % (
            name, qc["quant_method"], qc["bits"], qc["group_size"], qc.get("desc_act", False), nmods, ppl, n)
        if q is not None:
            rel = abs(ppl - q) / q
            ok = rel <= a.tol
            failed |= not ok
            line += "; qtool %.6f; rel diff %.3g %s" % (q, rel, "OK" if ok else "FAIL (> %g)" % a.tol)
        print(line, flush=True)
    if failed:
        sys.exit(1)
    print("all checks passed")


if __name__ == "__main__":
    main()
