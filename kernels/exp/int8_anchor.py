#!/usr/bin/env python3
"""cuBLAS's int8 GEMM beside its fp16 one at the 7B/8B prefill shapes.

torch_anchor.py (../shared/tools) times cuBLAS in fp16 only, so W8A8's
int8 GEMM (gemm_wg_s8, gemm_wg_s8_w) has no outside ceiling. This times
torch._int_mm (cuBLASLt, int8 x int8 -> int32, the weight read as the
transposed view of its [N, K] rows, the layout cuBLASLt's int8 kernels
take) and torch.mm in fp16 on the same shapes, M rows of activations by a
weight of N outputs and K inputs, and prints TOPS and their ratio, one line
a shape, and a JSON object with --json FILE. Run by gpu-run.sh's
int8anchor step. Its first run (fifty-third session, one H200, timing each
launch alone, so the short GEMMs may read high: kernels/NOTES.md) found
cuBLAS's int8 1.0-1.19x its fp16 and our int8 GEMM 1.24-1.31x cuBLAS's
int8 at 2 048 rows.

    python3 kernels/exp/int8_anchor.py [--rows 512,1024,2048] [--json out.json]
"""
import argparse
import json
import statistics

import torch

SHAPES = [(4096, 4096), (11008, 4096), (4096, 11008), (14336, 4096), (4096, 14336)]  # (N, K)


def timed(fn, reps, rounds=5):
    """Device time of one fn in seconds: the median over rounds of reps
    launches back to back between two events, after three warm-ups. (The
    first form, an event pair around each launch, could count the host's
    launch overhead into the short GEMMs.)"""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3 / reps)
    return statistics.median(times)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rows", default="512,1024,2048", help="activation rows M, comma-separated")
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--json", help="write the results here as well")
    args = ap.parse_args()
    dev = torch.device("cuda")
    print(torch.cuda.get_device_name(dev), "torch", torch.__version__)
    results = []
    for M in (int(r) for r in args.rows.split(",")):
        for N, K in SHAPES:
            a8 = torch.randint(-127, 128, (M, K), dtype=torch.int8, device=dev)
            w8 = torch.randint(-127, 128, (N, K), dtype=torch.int8, device=dev)
            a16 = torch.randn(M, K, dtype=torch.float16, device=dev)
            w16 = torch.randn(N, K, dtype=torch.float16, device=dev)
            ops = 2.0 * M * N * K
            t8 = timed(lambda: torch._int_mm(a8, w8.t()), args.reps)
            t16 = timed(lambda: torch.mm(a16, w16.t()), args.reps)
            r = {"M": M, "N": N, "K": K, "int8_us": t8 * 1e6, "fp16_us": t16 * 1e6,
                 "int8_tops": ops / t8 / 1e12, "fp16_tflops": ops / t16 / 1e12, "int8_over_fp16": t16 / t8}
            results.append(r)
            print(f"cublas {N}x{K}@{M}: int8 {r['int8_us']:.1f} us {r['int8_tops']:.1f} TOPS, "
                  f"fp16 {r['fp16_us']:.1f} us {r['fp16_tflops']:.1f} TFLOP/s, int8 {r['int8_over_fp16']:.2f}x fp16")
            del a8, w8, a16, w16
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(dev), "gemm": results}, f, indent=1)


if __name__ == "__main__":
    main()
