#!/usr/bin/env bash
# GPU check used for round 3 (kernels/NOTES.md): build the PTX with nvcc, run the
# runtime/cuda tests (default variants, then the model/fixture tests with the
# candidate variants $CAND), the kernel bench and the synthetic Llama-2-7B decode
# with the defaults and with $CAND. Prepare on the Go machine (no cgo), then run
# on the device machine with carry ["bin-k"] and the command `bash kernels/gpu-check.sh`:
#   CGO_ENABLED=0 go build -ldflags="-s -w" -o bin-k/qtool ./cmd/qtool
#   CGO_ENABLED=0 go test -c -ldflags="-s -w" -o bin-k/cudatest ./runtime/cuda
#   mkdir -p bin-k/fx && cp qwen3-mini.ak48.bin* llama-mini.q8.bin* msmodelslim-dirs bin-k/fx/
# Everything lands in $OUT (at most 8 files come back).
set -u
exec > >(tee $OUT/run.log) 2>&1
export PATH=/usr/local/cuda/bin:$PATH
CAND=${CAND:-wah,wa}
CANDS=${CANDS:-p2h,p2 p2h3,p2d3 p4h,p4 p1h,p1}
T0=$(date +%s)
gunzip bin-k/*.gz bin-k/fx/*.gz; chmod +x bin-k/qtool bin-k/cudatest
date -u; nvidia-smi --query-gpu=name,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv,noheader; nvcc --version | tail -2
if bash kernels/build.sh $OUT > /tmp/build.log 2>&1; then
  export QTOOL_CUDA_PTX=$OUT/qtool_sm90.ptx; echo "built PTX with nvcc: $(tail -1 /tmp/build.log)"
  grep -A2 "gemv_q._[wp]\|gemv_q4_sh'\|gemv_q8_r4u1'" $OUT/ptxas.txt | grep -E "Compiling|registers|spill" | grep -v "0 bytes spill" | head -40
else
  echo "BUILD FAILED"; tail -30 /tmp/build.log; exit 1
fi
echo "build $(( $(date +%s) - T0 )) s"
t0=$(date +%s)
(cd runtime/cuda && QTOOL_GPU_FIXTURES=../../bin-k/fx timeout 150 ../../bin-k/cudatest -test.v -test.timeout 140s > $OUT/test.log 2>&1); echo "tests rc=$? $(( $(date +%s) - t0 )) s"
grep -E "^(--- |ok|FAIL|PASS)" $OUT/test.log | head -30
grep -E -- "--- FAIL" $OUT/test.log | head -20
echo "w-variant subtests passed: $(grep -E -- '--- PASS' $OUT/test.log | grep -cE '/M=[0-9]+/[wp]') failed: $(grep -E -- '--- FAIL' $OUT/test.log | grep -cE '/M=[0-9]+/[wp]')"
for C in $CAND $CANDS; do
  t0=$(date +%s)
  echo "=== QTOOL_GEMV_VARIANT=$C" >> $OUT/test2.log
  (cd runtime/cuda && QTOOL_GEMV_VARIANT=$C QTOOL_GPU_FIXTURES=../../bin-k/fx timeout 60 ../../bin-k/cudatest -test.v -test.run 'TestModels|TestFixtures' -test.timeout 55s >> $OUT/test2.log 2>&1); echo "model/fixture tests with QTOOL_GEMV_VARIANT=$C rc=$? $(( $(date +%s) - t0 )) s"
done
grep -E "^(===|--- |    --- |ok|FAIL|PASS)" $OUT/test2.log | head -60
t0=$(date +%s)
timeout 120 bin-k/qtool bench --synthetic none > $OUT/bench_none.log 2>&1; echo "bench none rc=$? $(( $(date +%s) - t0 )) s"
grep -E "copy|gemv " $OUT/bench_none.log | head -150
for V in "" "$CAND" p2h,p2 p2h3,p2d3; do
  t0=$(date +%s)
  echo "=== model bench QTOOL_GEMV_VARIANT=$V" >> $OUT/bench_model.log
  QTOOL_GEMV_VARIANT=$V timeout 120 bin-k/qtool bench --synthetic llama2-7b --format w4a16,w8a16 --kernels=false --decode 64 >> $OUT/bench_model.log 2>&1; echo "model bench V=$V rc=$? $(( $(date +%s) - t0 )) s"
done
grep -E "===|copy|decode batch|prefill|gate|down|q  |graph measured|same-run|w4a16|w8a16" $OUT/bench_model.log | head -60
if [ $(( $(date +%s) - T0 )) -lt 140 ]; then
  timeout 40 ncu --clock-control none -k regex:'gemv_q4_p2h$' -c 1 --section SpeedOfLight --section Occupancy --section LaunchStats --metrics smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_short_scoreboard_per_issue_active.ratio,smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio,smsp__average_warps_issue_stalled_math_pipe_throttle_per_issue_active.ratio,smsp__average_warps_issue_stalled_not_selected_per_issue_active.ratio,smsp__average_warps_issue_stalled_wait_per_issue_active.ratio,smsp__average_warps_issue_stalled_lg_throttle_per_issue_active.ratio bin-k/qtool bench --synthetic none > /tmp/ncu.txt 2>&1; echo "ncu rc=$?"
  grep -E "gemv_q4|Duration|DRAM Throughput|Memory Throughput|Achieved Occupancy|Registers|Block Limit|Compute \(SM\)|stalled" /tmp/ncu.txt | head -30
fi
echo "total $(( $(date +%s) - T0 )) s"
