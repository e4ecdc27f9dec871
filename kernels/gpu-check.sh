#!/usr/bin/env bash
# GPU check used for round 2 (kernels/NOTES.md): build the PTX with nvcc, run the
# runtime/cuda tests and the synthetic Llama-2-7B bench, then ncu on gemv_q4_m.
# Prepare on the Go machine (no cgo), then run on the device machine with carry ["bin/k2"]
# and the command `bash kernels/gpu-check.sh`:
#   CGO_ENABLED=0 go build -ldflags="-s -w" -o bin/k2/qtool ./cmd/qtool
#   CGO_ENABLED=0 go test -c -ldflags="-s -w" -o bin/k2/cuda.test ./runtime/cuda
#   mkdir -p bin/k2/fx && cp qwen3-mini.ak48.bin* bin/k2/fx/   # optional quantized fixture
# Everything lands in $OUT (at most 8 files come back).
set -u
exec > >(tee $OUT/run.log) 2>&1
export PATH=/usr/local/cuda/bin:$PATH
date -u; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader; nvcc --version | tail -2
t0=$(date +%s)
if bash kernels/build.sh $OUT > /tmp/build.log 2>&1; then
  export QTOOL_CUDA_PTX=$OUT/qtool_sm90.ptx; echo "built PTX with nvcc: $(tail -1 /tmp/build.log)"
  grep -A2 "gemv_q._m" $OUT/ptxas.txt | grep -E "registers|spill" | head -12
else
  echo "BUILD FAILED, using embedded PTX"; tail -30 /tmp/build.log
fi
echo "build $(( $(date +%s) - t0 )) s"
t0=$(date +%s)
(cd runtime/cuda && QTOOL_GPU_FIXTURES=../../bin/k2/fx timeout 200 ../../bin/k2/cuda.test -test.v -test.timeout 190s > $OUT/test.log 2>&1); echo "tests rc=$? $(( $(date +%s) - t0 )) s"
grep -E "^(--- |=== RUN   Test[A-Za-z]+$|ok|FAIL|PASS)" $OUT/test.log | grep -v "=== RUN" | grep -v "^    --- PASS" | head -30
grep -E "perplexity|ppl|relative" $OUT/test.log | head -10
nfail_q4=$(grep -E -- "--- FAIL" $OUT/test.log | grep -cE "q4/M=[0-9]+/m|ak48" || true)
nfail_q8=$(grep -E -- "--- FAIL" $OUT/test.log | grep -cE "q8/M=[0-9]+/m" || true)
npass_m=$(grep -E -- "--- PASS" $OUT/test.log | grep -cE "/M=[0-9]+/m" || true)
echo "m-variant subtests passed: $npass_m; q4 m failures: $nfail_q4; q8 m failures: $nfail_q8"
V=""
export QTOOL_GEMV_VARIANT="$V"; echo "QTOOL_GEMV_VARIANT=$V"
t0=$(date +%s)
timeout 300 bin/k2/qtool bench --synthetic llama2-7b --format w4a16,w8a16,fp16 --decode 64 > $OUT/bench.log 2>&1; echo "bench rc=$? $(( $(date +%s) - t0 )) s"
grep -E "copy|gemv +w|same-run|decode batch|prefill|w4a16:|w8a16:|graph measured|attention" $OUT/bench.log | grep -v "gemv .*/r" | head -100
echo "--- ncu ---"
timeout 100 ncu --clock-control none -k regex:'gemv_q4_m$' -c 1 --section SpeedOfLight --section MemoryWorkloadAnalysis --section WarpStateStats --section Occupancy --section LaunchStats --metrics smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_mio_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_dispatch_stall_per_issue_active.ratio,smsp__average_warps_issue_stalled_drain_per_issue_active.ratio,smsp__average_warps_issue_stalled_no_instruction_per_issue_active.ratio,smsp__average_warps_issue_stalled_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_tex_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_branch_resolving_per_issue_active.ratio bin/k2/qtool bench --synthetic none > $OUT/ncu.txt 2>&1; echo "ncu rc=$?"
grep -E "gemv_q4|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Stall|Registers|Block Limit|Warp Cycles|Compute \(SM\)|stalled" $OUT/ncu.txt | head -60
