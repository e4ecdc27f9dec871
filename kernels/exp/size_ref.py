#!/usr/bin/env python3
"""What a decode GEMV of a given number of bytes can reach outside qtool, timed the way
`qtool bench`'s kernel table times ours (runtime/cuda TimeDecodeGEMV): a CUDA graph of 20
one-row products cycling through copies of the weight that together exceed the L2 cache three
times (at most 16 copies), the device time per product from replays of the graph, the rate as a
per cent of the device-to-device copy bandwidth (read + write) of a 1 GiB buffer, timed
eagerly as torch_anchor.py does (a graph of that one copy ran at 2 706 GB/s on an H200 where the
eager copy and `qtool bench` gave ~4 240).

  python3 size_ref.py [--json FILE]

Rows (each as `bench` prints its own):
- cublas-f16: F.linear on an fp16 weight (cuBLAS's GEMV), bytes = the weight's, x's and y's;
- tinygemm-w4: torch._weight_int4pack_mm (gpt-fast's int4 kernel), g128 bf16 {scale, zero};
- copy: y.copy_(x) of the same weight bytes, counted read + write like the copy bandwidth.
The fp16 shapes N x K/4 and N x K/2 hold about the bytes of a 4-bit and an 8-bit N x K weight,
as `bench`'s size reference does.
"""
import argparse, json
import torch

dev = 'cuda'


def graph_time(calls, reps=20):
    """Device seconds per call of a graph of len(calls) calls, replayed reps times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for c in calls:
            c()  # warm-up outside the capture (cuBLAS workspaces, tinygemm's first launch)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for c in calls:
            c()
    for _ in range(3):
        g.replay()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    for _ in range(reps):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / 1e3 / reps / len(calls)


def copies(make, nbytes, l2):
    n = 1
    while n * nbytes < 3 * l2 and n < 16:
        n += 1
    return [make() for _ in range(n)]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument('--json')
    a = ap.parse_args()
    torch.manual_seed(0)
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    x = torch.empty(2**30, dtype=torch.uint8, device=dev)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(20):
        y.copy_(x)
    t1.record()
    torch.cuda.synchronize()
    copy_bps = 2 * x.numel() / (t0.elapsed_time(t1) / 1e3 / 20)
    del x, y
    r = {'gpu': torch.cuda.get_device_name(), 'torch': torch.__version__, 'l2_bytes': l2,
         'copy_GBps': round(copy_bps / 1e9, 1), 'rows': []}
    print(f"device: {r['gpu']}, L2 {l2 >> 20} MiB, copy {copy_bps / 1e9:.0f} GB/s (read + write)")

    def row(kind, shape, sec, nbytes):
        pct = 100 * nbytes / sec / copy_bps
        r['rows'].append({'kind': kind, 'shape': shape, 'us': round(sec * 1e6, 2), 'pct_copy': round(pct, 1)})
        print(f"{kind:12s} {shape:12s} {sec * 1e6:9.2f} us {nbytes / sec / 1e9:8.0f} GB/s {pct:6.1f}% of copy", flush=True)

    shapes = [(4096, 1024), (4096, 2048), (4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336)]
    for n, k in shapes:
        ws = copies(lambda: torch.randn(n, k, dtype=torch.float16, device=dev), 2 * n * k, l2)
        xf, yf = torch.randn(1, k, dtype=torch.float16, device=dev), torch.empty(1, n, dtype=torch.float16, device=dev)
        calls = [(lambda w=ws[i % len(ws)]: torch.matmul(xf, w.t(), out=yf)) for i in range(20)]
        row('cublas-f16', f'{n}x{k}', graph_time(calls), 2 * n * k + 2 * k + 2 * n)
        dst = torch.empty_like(ws[0])
        calls = [(lambda w=ws[i % len(ws)]: dst.copy_(w)) for i in range(20)]
        row('copy', f'{n}x{k}', graph_time(calls), 2 * 2 * n * k)
        del ws, dst
    for n, k in [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336)]:
        def pack():
            w = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device=dev)
            return torch._convert_weight_to_int4pack(w, 8), torch.randn(k // 128, n, 2, dtype=torch.bfloat16, device=dev)
        ws = copies(pack, n * k // 2, l2)
        xb = torch.randn(1, k, dtype=torch.bfloat16, device=dev)
        calls = [(lambda p=ws[i % len(ws)]: torch._weight_int4pack_mm(xb, p[0], 128, p[1])) for i in range(20)]
        try:
            row('tinygemm-w4', f'{n}x{k}', graph_time(calls), n * k // 2 + ws[0][1].numel() * 2 + 2 * k + 2 * n)
        except Exception as e:  # the int4 kernel's signature moves between torch versions
            print(f"tinygemm-w4 {n}x{k}: {e!r}"[:200])
        del ws
    if a.json:
        with open(a.json, 'w') as f:
            json.dump(r, f, indent=1)


if __name__ == '__main__':
    main()
