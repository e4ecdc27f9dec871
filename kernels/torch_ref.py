# Reference ceilings measured with PyTorch on the GPU machine, in the same
# device call as qtool's own benchmarks: device-to-device copy bandwidth and
# cuBLAS fp16 GEMM rates at the benchmark shapes (M = 512).
import torch
def bench(f, warm=3, reps=20):
    for _ in range(warm): f()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize(); s.record()
    for _ in range(reps): f()
    e.record(); torch.cuda.synchronize()
    return s.elapsed_time(e) / 1e3 / reps
n = 1 << 28
a = torch.empty(n, dtype=torch.float32, device="cuda").uniform_(); b = torch.empty_like(a)
t = bench(lambda: b.copy_(a))
print(f"torch copy: {2 * 4 * n / t / 1e9:.0f} GB/s (read + write)")
for N, K in [(14336, 4096), (4096, 14336), (4096, 4096), (11008, 4096), (4096, 11008)]:
    x = torch.randn(512, K, dtype=torch.float16, device="cuda"); w = torch.randn(N, K, dtype=torch.float16, device="cuda")
    t = bench(lambda: x @ w.t())
    x1 = torch.randn(1, K, dtype=torch.float16, device="cuda")
    t1 = bench(lambda: x1 @ w.t(), 5, 50)
    print(f"torch fp16 GEMM M=512 {N}x{K}: {2 * 512 * N * K / t / 1e12:.1f} TFLOP/s; GEMV M=1: {2 * N * K / t1 / 1e9:.0f} GB/s")
