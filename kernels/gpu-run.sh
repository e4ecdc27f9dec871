#!/usr/bin/env bash
# GPU checks and measurements in one device call (issues 12, 14, 16): builds
# the PTX, runs the GPU tests, then times `qtool verify` on random-weight
# Llama-2-7B-shaped checkpoints (synth_hf.py: bf16 and its AutoAWQ twin) on
# one GPU and at TP=2 (ranks in one process and one process per rank).
# Needs: .devbin/*.gz or *.xz (CGO_ENABLED=0 builds of qtool and the test
# binaries, compressed), .devdata/ (sotu-test.raw, synth_hf.py, torch_anchor.py);
# kernels/gpu-prep.sh makes both. Usage:
#   STEPS="build fixtures topo tests gemvwaves attnbench ncu ncugemv ncusrc ncuprefill rankbench 7b one one-base tp tpctx tpab tpdec tl tp-base tpprof tpspeed kld 7b-sq 7b-gptq w8a8 kv16 c8 7b-c8 kbench kbench16 kbench-base ab kab bench anchor int8anchor" kernels/gpu-run.sh
# (ANCHOR_ARGS=--skip-decode: the anchor without the compiled gpt-fast decoders;
# KBENCH_ARGS: more flags of the synthetic bench, e.g. --kv-cache fp32 as qtool-base;
# TEST_TIMEOUT: a test binary's limit in s (cut to the BUDGET left: within), a timed-out one stops the call; TEST_COUNT: runs
# of each test (-test.count: a race's rate, with TESTRUN); TESTSKIP: tests
# the test binaries leave out (-test.skip: TestKernelNamesInPTX for an experiment that adds
# kernels, which reads the embedded PTX and would fail the suite and so skip ab); RUN_LIMIT: a
# verify run's; TPAB_MODELS: tpab's checkpoints; TPAB_BINS: more binaries bin/qtool-NAME
# (from .devbin/qtool-NAME.xz, a Go-side variant) that tpab times beside bin/qtool;
# TPDEC_ROUNDS, TPDEC_MODELS: tpdec's rounds and checkpoints; NCU_GEMV: the GEMV kernels ncugemv and ncusrc profile
#   (KERNEL:SKIP: its launch after SKIP of them), NCU_BENCH_ARGS: more flags of their bench (--kernels=false),
#   NCU_BIN=base: they profile HEAD's binary with its embedded PTX, not bin/qtool;
#   NCU_ARGS: more Nsight Compute options for both, e.g. "--cache-control none --clock-control none")
# CUBIN=1: every run of a build here loads its sm_90a cubin (QTOOL_CUDA_CUBIN, beside its PTX):
#   no driver compile of the 10 MB PTX (~50 s a build and machine; A/B calls), see kenv below;
#   compare such builds with each other, or with base where gpu-prep.sh left the base's source
#   (.devdata/qtool-base.cu, beside qtool-base): build then makes its PTX and cubin too ($OUT/base-ptx)
#   and base runs them (the embedded PTX, the driver's compile, otherwise)
# VARIANT_PTX: the AB_PTX builds whose PTX comes back (default all: two files each, and a call
#   returns at most 8); AB_TESTS_FOR: the AB_PTX builds tests runs AB_TESTRUN with (default all);
#   AB_SKIP: the AB_PTX builds ab and kab leave out (a timing build's, say -DQTOOL_EXP_PHASES)
# AB_CLOCKS=1: nvidia-smi logs the SM clock, power draw and temperature every 100 ms while ab
#   runs, to clocks.csv in logs.tgz, each run's start and end stamped in ab-times.txt (is a run's
#   speed its clocks'?)
set -uo pipefail
export PYTHONUNBUFFERED=1
FINAL=${OUT:-/tmp/out}
OUT=/tmp/gpu-run
rm -rf "$OUT"; mkdir -p "$OUT/ptx" "$FINAL"
finish() {
  # a call returns at most 8 files: PTX identical to the committed file (calib's, mostly) stays behind
  for f in "$OUT"/ptx/*.ptx; do
    [ -f "$f" ] && ! cmp -s "$f" "kernels/${f##*/}" && cp "$f" "$FINAL"/
  done
  for d in "$OUT"/ptx-*; do # each AB_PTX variant's qtool PTX, should it win (VARIANT_PTX: only the builds it names)
    [ -d "$d" ] || continue
    [ -n "${VARIANT_PTX:-}" ] && ! listed "$VARIANT_PTX" "${d##*/ptx-}" && continue
    mkdir -p "$FINAL/${d##*/}" && cp "$d"/qtool_sm*.ptx "$FINAL/${d##*/}"/ 2>/dev/null
  done
  tar -C "$OUT" -czf "$FINAL/logs.tgz" --exclude='*.ptx' --exclude='*.cubin' . 2>/dev/null
}
trap finish EXIT
STEPS=${STEPS:-build tests 7b tp}
t0=$(date +%s)
left() { echo $(( ${BUDGET:-570} - ($(date +%s) - t0) )); }
# within S: a step's limit of S seconds cut to the budget left, less 20 s
# for the logs (a call the device stops returns nothing: the fifty-ninth
# session's first call ran its tests past its 600 s so)
within() { local l; l=$(($(left) - 20)); echo $(( $1 < l ? $1 : (l > 1 ? l : 1) )); }
listed() { [[ " $1 " == *" $2 "* ]]; } # listed LIST NAME: NAME is a word of LIST
has() { listed "$STEPS" "$1"; }
NCU=$(command -v ncu || ls /usr/local/cuda*/bin/ncu 2>/dev/null | head -1) # Nsight Compute, for the ncu steps
nvidia-smi --query-gpu=name,memory.total --format=csv,noheader
has topo && nvidia-smi topo -m
mkdir -p bin
for f in .devbin/*.gz .devbin/*.xz; do
  [ -f "$f" ] || continue
  b=$(basename "${f%.*}"); case $f in *.xz) xz -dc "$f" ;; *) gunzip -c "$f" ;; esac > "bin/$b"; chmod +x "bin/$b"
done
# the A/B steps' base: the previous commit's binary (bin/qtool where there is none) with its embedded PTX
base=bin/qtool-base; [ -x "$base" ] || base=bin/qtool
BASE="env -u QTOOL_CUDA_PTX -u QTOOL_CUDA_CUBIN -u QTOOL_CALIB_PTX $base"
# kenv DIR: the environment that runs the kernels a build put in DIR (its PTX;
# with CUBIN=1 also its sm_90a cubin, which the driver loads without
# compiling the PTX: ~50 s saved a build and machine, the kernels as nvcc's
# ptxas made them rather than the driver's; the criteria's figures come
# from the PTX, the shipped path)
kenv() { # (QTOOL_CUDA_CUBIN= otherwise: no cubin inherited from another build's export)
  if [ "${CUBIN:-0}" = 1 ] && [ -f "$1/qtool_sm90a.cubin" ]; then
    echo "QTOOL_CUDA_PTX=$1/qtool_sm90.ptx QTOOL_CUDA_CUBIN=$1/qtool_sm90a.cubin"
  else
    echo "QTOOL_CUDA_PTX=$1/qtool_sm90.ptx QTOOL_CUDA_CUBIN="
  fi
}
if has build; then
  ab_builds=()
  # this build and each AB_PTX variant's (below) at once: nvcc's runs are a few threads each
  bash kernels/build.sh "$OUT/ptx" > "$OUT/build.log" 2>&1 & main_build=$!
  base_build=""
  if [ "${CUBIN:-0}" = 1 ] && [ -f .devdata/qtool-base.cu ] && [ -x bin/qtool-base ]; then
    # the base commit's qtool.cu through build.sh too, so that base runs a cubin (a like-for-like A/B)
    mkdir -p "$OUT/base-src" && cp .devdata/qtool-base.cu "$OUT/base-src/qtool.cu" && cp kernels/calib.cu "$OUT/base-src/"
    KERNEL_SRC="$OUT/base-src" bash kernels/build.sh "$OUT/base-ptx" > "$OUT/build-base.log" 2>&1 & base_build=$!
  fi
  for v in ${AB_PTX:-}; do
    NVCC_FLAGS="$(echo "${v#*=}" | tr , ' ')" bash kernels/build.sh "$OUT/ptx-${v%%=*}" > "$OUT/build-${v%%=*}.log" 2>&1 &
    ab_builds+=("$!=${v%%=*}")
  done
  wait "$main_build" || { tail -30 "$OUT/build.log"; wait; exit 1; } # the variants' builds ended too, not half-written
  ls -l "$OUT"/ptx/*.ptx | awk '{print $5, $9}'
  export QTOOL_CALIB_PTX="$OUT/ptx/calib_sm90.ptx" $(kenv "$OUT/ptx")
  # AB_PTX="name=-DFLAG ...": more builds of the same source with an experiment's switches, for ab
  # (several switches of one build joined by commas: "tlrn=-DQTOOL_TIMELINE,-DQTOOL_EXP_RN_VEC")
  for b in "${ab_builds[@]}"; do
    wait "${b%%=*}" || { tail -30 "$OUT/build-${b#*=}.log"; exit 1; }
    echo "built ${b#*=}"
  done
  if [ -n "$base_build" ]; then
    if wait "$base_build"; then
      BASE="env -u QTOOL_CALIB_PTX $(kenv "$OUT/base-ptx") $base"
      echo "built base: $BASE"
    else
      echo "base's cubin not built (base runs its embedded PTX):"; tail -5 "$OUT/build-base.log"
    fi
  fi
fi
if has fixtures; then # TestFixtures' quantized models, written here from testdata by this qtool (no carry)
  fx=/tmp/gpu-fixtures; rm -rf "$fx"; mkdir -p "$fx"
  { bin/qtool export --hf testdata/llama-mini --q8 "$fx/llama-mini.q8.bin" -q &&
    bin/qtool quantize --hf testdata/llama-mini --bits 8 --sym --group 128 --format msmodelslim -o "$fx/llama-mini-w8a16-g128" -q &&
    bin/qtool quantize --hf testdata/llama-mini --bits 8 --sym --group 0 --format msmodelslim -o "$fx/llama-mini-w8a16-perchannel" -q &&
    bin/qtool quantize --hf testdata/qwen3-mini --bits 4 --group 128 --format ak48 --qtool-only -o "$fx/qwen3-mini.ak48.bin" -q
  } > "$OUT/fixtures.log" 2>&1 && export QTOOL_GPU_FIXTURES=$fx || { echo "fixtures: not written"; tail -5 "$OUT/fixtures.log"; }
fi
if has tests; then
  for t in ${TESTS:-cuda kld gputest}; do
    [ -x "bin/$t.test" ] || continue
    dir=runtime/$t; [ "$t" = gputest ] && dir=runtime/tp/gputest
    (cd "$dir" && timeout "$(within "${TEST_TIMEOUT:-240}")" "$OLDPWD/bin/$t.test" -test.v ${TESTRUN:+-test.run "$TESTRUN"} ${TESTSKIP:+-test.skip "$TESTSKIP"} \
      ${TEST_COUNT:+-test.count "$TEST_COUNT"} > "$OUT/test-$t.log" 2>&1)
    rc=$?; [ "$t" = cuda ] && failed_new=$rc
    echo "test $t rc=$rc $(grep -c -- '--- PASS' "$OUT/test-$t.log") pass, $(grep -c -- '--- FAIL' "$OUT/test-$t.log") fail, $(grep -c -- '--- SKIP' "$OUT/test-$t.log") skip"
    grep -E -- "--- FAIL|panic|greedy|ppl|KLD|rel |loaded kernels" "$OUT/test-$t.log" | head -20
    # a broken peer-memory all-reduce would hang the TP runs until their timeout
    grep -q -- "--- FAIL: TestAllReducePeer" "$OUT/test-$t.log" && { echo "peer all-reduce broken: stopping"; exit 1; }
    # a kernel that waits forever (a barrier's count wrong) would hang every later step too
    [ $rc = 124 ] && { echo "test $t timed out: stopping"; tail -5 "$OUT/test-$t.log"; exit 1; }
  done
  # each AB_PTX build through the cuda tests AB_TESTRUN names (default: the decode attention's and the models')
  for v in ${AB_PTX:-}; do
    n=${v%%=*}
    [ -x bin/cuda.test ] || break
    [ -n "${AB_TESTS_FOR:-}" ] && ! listed "$AB_TESTS_FOR" "$n" && { echo "test cuda ($n): not run (AB_TESTS_FOR)"; continue; }
    (cd runtime/cuda && env $(kenv "$OUT/ptx-$n") timeout "$(within 240)" "$OLDPWD/bin/cuda.test" -test.v \
      -test.run "${AB_TESTRUN:-TestAttention|TestModels|TestKVHalf}" > "$OUT/test-cuda-$n.log" 2>&1)
    rc=$?; [ $rc = 0 ] || failed_variants="${failed_variants:-} $n"
    echo "test cuda ($n) rc=$rc $(grep -c -- '--- PASS' "$OUT/test-cuda-$n.log") pass, $(grep -c -- '--- FAIL' "$OUT/test-cuda-$n.log") fail"
    grep -E -- "--- FAIL|panic" "$OUT/test-cuda-$n.log" | head -10
  done
fi
if has gemvwaves; then # the quantized GEMVs against their waves of blocks (BenchmarkGEMVWaves)
  (cd runtime/cuda && timeout 240 "$OLDPWD/bin/cuda.test" -test.run '^$' -test.bench GEMVWaves -test.benchtime 1x > "$OUT/gemvwaves.log" 2>&1)
  grep -E '^BenchmarkGEMVWaves' "$OUT/gemvwaves.log" | sed -E 's/^BenchmarkGEMVWaves\/([^ \t]*)[ \t]+1[ \t]+/\1 /'
fi
if has attnbench; then # the prefill attention's key splits (BenchmarkPrefillAttention)
  (cd runtime/cuda && timeout 120 "$OLDPWD/bin/cuda.test" -test.run '^$' -test.bench PrefillAttention -test.benchtime 3x > "$OUT/attnbench.log" 2>&1)
  grep -E "us/launch|FAIL|panic" "$OUT/attnbench.log" | awk '{print $1, $(NF-1), $NF}'
fi
if has ncu; then # one launch of the prefill attention (512 tokens, 32 heads) under Nsight Compute
  if [ -z "$NCU" ]; then echo "ncu: not found"; else
    (cd runtime/cuda && timeout 200 "$NCU" --kernel-name regex:attn_tc --launch-count 1 --section SpeedOfLight --section WarpStateStats \
      --section SchedulerStats --section Occupancy --section ComputeWorkloadAnalysis --section LaunchStats ${NCU_ARGS:-} \
      "$OLDPWD/bin/cuda.test" -test.run '^$' -test.bench "${NCU_BENCH:-PrefillAttention/heads=32/split=0}" -test.benchtime 1x > "$OUT/ncu.txt" 2>&1)
    grep -vE "^==PROF==|^    -{5}" "$OUT/ncu.txt" | grep -E "[0-9]" | cut -c1-150 | head -90
  fi
fi
# ncu_prefill_sum CSV: the kernels of one forward pass in an ncu CSV (from one embed_* launch to
# the next), device time by kernel and the first layer's sequence, and each other metric
# (NCU_METRICS) of the first layer's launches
ncu_prefill_sum() {
  python3 - "$1" <<'PY'
import csv, collections, sys
hdr, seq, extra = None, [], collections.defaultdict(dict)
for r in csv.reader(open(sys.argv[1])):
    if r and r[0] == 'ID':
        hdr = r
    elif hdr and len(r) == len(hdr):
        d = dict(zip(hdr, r))
        v = float(d['Metric Value'].replace(',', '') or 'nan')
        if d['Metric Name'] == 'gpu__time_duration.sum':
            seq.append((d['Kernel Name'].split('(')[0], v, d['ID']))
        else:
            extra[d['ID']][d['Metric Name']] = v
idx = [i for i, (n, _, _) in enumerate(seq) if n.startswith('embed')]
if len(idx) < 2:
    sys.exit('  fewer than two embed launches in the window: widen NCU_SKIP/NCU_COUNT')
one = seq[idx[0]:idx[1]]
by = collections.defaultdict(float)
for n, t, _ in one:
    by[n] += t
print('  %d kernels, %.2f ms:' % (len(one), sum(t for _, t, _ in one) / 1e6),
      ', '.join('%s %.0f us' % (n, t / 1e3) for n, t in sorted(by.items(), key=lambda kv: -kv[1])))
print('  first layer:', ', '.join('%s %.1f' % (n, t / 1e3) for n, t, _ in one[1:15]))
print('  last:', ', '.join('%s %.1f' % (n, t / 1e3) for n, t, _ in one[-4:]))
for m in sorted({m for e in extra.values() for m in e}):
    print('  %s:' % m, ', '.join('%s %.4g' % (n, extra[i].get(m, float('nan'))) for n, _, i in one[1:8]))
PY
}
# ncu_gemv KERNEL[:SKIP] OUTFILE NCU-FLAGS...: Nsight Compute on the first launch of KERNEL (after
# SKIP of them) in bench (its kernel table's first shape: 14336×4096 for the 32-row register rings;
# NCU_BENCH_ARGS=--kernels=false: the decode's launches, layer 0's first). NCU_ARGS="--clock-control
# none" times the kernel at the GPU's own clocks (the locked base clocks make the streaming GEMVs
# issue-bound: kernels/NOTES.md, forty-sixth session); NCU_BIN=base profiles HEAD's binary
# (qtool-base, its embedded PTX) instead of bin/qtool
ncu_gemv() {
  local k=${1%%:*} skip=0 out=$2 lim
  [[ $1 == *:* ]] && skip=${1#*:}
  shift 2
  local bin=bin/qtool; [ "${NCU_BIN:-}" = base ] && bin=$BASE
  lim=$(left); [ "$lim" -lt 60 ] && { echo "ncu $k: no time left"; return 1; }
  [ -n "$NCU" ] || { echo "ncu $k: Nsight Compute not found"; return 1; }
  timeout $(( lim < 150 ? lim : 150 )) "$NCU" --kernel-name regex:"^$k\$" --launch-skip "$skip" --launch-count 1 ${NCU_ARGS:-} "$@" \
    $bin bench --synthetic llama2-7b --decode 4 --prompt 16 ${NCU_BENCH_ARGS:-} > "$out" 2>&1
}
if has ncugemv; then # NCU_GEMV's kernels (KERNEL or KERNEL:SKIP): the stall reasons in cycles an issued
  # instruction (--page raw), the instructions executed and each pipe's share
  stalls=$(printf 'smsp__average_warps_issue_stalled_%s_per_issue_active.ratio,' long_scoreboard wait selected not_selected \
    math_pipe_throttle dispatch_stall short_scoreboard barrier mio_throttle lg_throttle no_instruction branch_resolving membar)
  for k in ${NCU_GEMV:-gemv_q4_w4h gemv_q8_w4h}; do
    f="$OUT/ncu-${k/:/-}.txt"
    ncu_gemv "$k" "$f" --page raw --section ComputeWorkloadAnalysis \
      --metrics "${stalls}gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,smsp__inst_executed.sum,smsp__issue_active.avg.pct_of_peak_sustained_active,sm__warps_active.avg.pct_of_peak_sustained_active,launch__grid_size,launch__registers_per_thread,dram__bytes_read.sum,sm__cycles_elapsed.avg.per_second"
    echo "ncu $k rc=$?"
    # sm__cycles_elapsed.avg.per_second: the SM clock (NCU_ARGS="--clock-control none" for the GPU's own)
    grep -E "stalled|gpu__time_duration.sum|dram__throughput.avg.pct|dram__bytes_read.sum|smsp__inst_executed.sum |issue_active.avg|warps_active.avg|launch__grid_size|launch__registers_per_thread |launch__occupancy_limit_(reg|shared)|pipe_.*avg.pct_of_peak_sustained_active|sm__cycles_elapsed.avg.per_second" "$f" 2>/dev/null |
      sed -E 's/smsp__average_warps_issue_stalled_(.*)_per_issue_active.ratio/stall_\1/' | awk '{printf "  %-56s %s\n", $1, $NF}'
  done
fi
if has ncusrc; then # the same launches' warp stall samples a SASS instruction (--page source): where the cycles go
  for k in ${NCU_GEMV:-gemv_q4_w4h gemv_q8_w4h}; do
    f="$OUT/ncusrc-${k/:/-}.csv"
    ncu_gemv "$k" "$f" --section SourceCounters --section WarpStateStats --page source --print-source sass --csv
    echo "ncusrc $k rc=$? $(grep -c . "$f" 2>/dev/null) lines (logs.tgz)"
  done
fi
if has ncuprefill; then # every kernel of a window of the synthetic bench's prefill, durations as CSV
  # (NCU_MODELS: bench --synthetic's models, default llama2-7b; NCU_PROMPTS: prompt lengths, default
  # bench's own; NCU_METRICS: more metrics, comma-separated, printed for the first layer's first
  # seven launches, e.g. lts__t_bytes.sum,lts__throughput.avg.pct_of_peak_sustained_elapsed for
  # L2's share; the CSVs come back in logs.tgz)
  for m in ${NCU_MODELS:-llama2-7b}; do
  for p in ${NCU_PROMPTS:-0}; do
  for f in ${NCU_FORMATS:-fp16 w8a8}; do
    csv="$OUT/ncu-prefill-$m-$p-$f.csv"
    parg=""; [ "$p" = 0 ] || parg="--prompt $p"
    timeout "$(left)" "$NCU" --csv --metrics gpu__time_duration.sum${NCU_METRICS:+,$NCU_METRICS} --cache-control none --clock-control none \
      --launch-skip ${NCU_SKIP:-700} --launch-count ${NCU_COUNT:-800} \
      bin/qtool bench --synthetic "$m" --format "$f" --kernels=false $parg --decode 2 > "$csv" 2> "$OUT/ncu-prefill-$m-$p-$f.err"
    echo "ncu prefill $m $p $f rc=$? $(grep -c gpu__time_duration "$csv") kernels"
    ncu_prefill_sum "$csv"
  done
  done
  done
fi
if has 7b || has 7b-sq || has 7b-gptq || has 7b-awq || has 7b-c8; then
  ts=$(date +%s)
  if [ -f /tmp/l7b-awq/config.json ] && [ -f /tmp/l7b/config.json ]; then # a warm machine keeps /tmp
    echo "synth: /tmp/l7b and /tmp/l7b-awq kept from the previous call"
  else
    python3 .devdata/synth_hf.py llama2-7b /tmp/l7b --tokenizer testdata/llama-mini --awq > "$OUT/synth.log" 2>&1 || { tail "$OUT/synth.log"; exit 1; }
    echo "synth $(( $(date +%s) - ts )) s: $(grep -c . "$OUT/synth.log") lines"
  fi
fi
V="bin/qtool verify --json --ppl .devdata/sotu-test.raw --max-chunks ${CHUNKS:-16} --prompt The --max-new 256"
run() { # name, args...
  local name=$1; shift
  lim=$(left); [ "$lim" -lt 40 ] && { echo "$name: no time left"; return; }
  # a run that hangs gets SIGQUIT after RUN_LIMIT s (default 180): Go then
  # writes every goroutine's stack (where each rank waits) into the .err
  lim=$(( lim < ${RUN_LIMIT:-180} ? lim : ${RUN_LIMIT:-180} ))
  GOTRACEBACK=all timeout -s QUIT -k 15 "$lim" "$@" > "$OUT/$name.json" 2> "$OUT/$name.err"
  echo "$name rc=$? $(python3 - "$OUT/$name.json" <<'PY'
import json,sys
try: r=json.load(open(sys.argv[1]))
except Exception as e: print("no json", e); sys.exit()
g=r.get("generation") or {}
cs=[round(1000*c,1) for c in r.get("chunk_seconds",[])[1:]]
steady=f' steady chunks {min(cs)}-{max(cs)} ms' if cs else ''
print(f'ppl {r.get("ppl")} prefill {r.get("tokens_per_s",0):.0f} tok/s{steady} decode {g.get("tokens_per_s",0):.1f} tok/s steady {g.get("decode_tok_s",0):.1f} ({len(g.get("ids",[]))} ids) ids[:8] {g.get("ids",[])[:8]} on {r.get("device")}')
PY
)"; tail -2 "$OUT/$name.err" | cut -c1-300
}
if has one; then
  for m in l7b-awq l7b; do run "$m-1gpu" $V --device cuda /tmp/$m; done
fi
if has one-base; then # the same with the previous commit's binary and its embedded PTX
  for m in l7b-awq l7b; do run "$m-1gpu-base" $BASE ${V#bin/qtool } --device cuda /tmp/$m; done
fi
if has tp; then
  for m in l7b-awq l7b; do
    tr=" ${TP_RUNS:-1gpu tp2 tp2-nccl tp2-procs} " # which of the runs (TP_RUNS="1gpu tp2": the decode ratio alone)
    [[ $tr == *" 1gpu "* ]] && run "$m-1gpu" $V --device cuda /tmp/$m
    has nograph && run "$m-1gpu-nograph" $V --device cuda --no-graph /tmp/$m
    for i in $(seq "${TP_REPEAT:-1}"); do # TP_REPEAT: the TP=2 run in one process that many times
      [[ $tr == *" tp2 "* ]] && run "$m-tp2${i#1}" $V --device cuda --tp 2 /tmp/$m
    done
    [[ $tr == *" tp2-nccl "* ]] && QTOOL_TP_ALLREDUCE=nccl run "$m-tp2-nccl" $V --device cuda --tp 2 /tmp/$m
    [[ $tr == *" tp2-procs "* ]] && run "$m-tp2-procs" $V --device cuda --tp 2 --tp-processes /tmp/$m
  done
fi
if has tpctx; then # TP=2 prefill with TP_CTX-token chunks (default 2048), this binary and the previous commit's, both formats
  for m in l7b-awq l7b; do
    C="--ctx ${TP_CTX:-2048} --max-chunks ${TP_CHUNKS:-5}"
    run "$m-1gpu-ctx" bin/qtool verify --json --ppl .devdata/sotu-test.raw $C --device cuda /tmp/$m
    run "$m-tp2-ctx" bin/qtool verify --json --ppl .devdata/sotu-test.raw $C --device cuda --tp 2 /tmp/$m
    run "$m-tp2-ctx-base" $BASE verify --json --ppl .devdata/sotu-test.raw $C --device cuda --tp 2 /tmp/$m
  done
fi
if has tpab; then # TP=2 at TP_CTX-token chunks, alternating: this build's PTX, each AB_PTX variant's, the previous commit's binary (TPAB_ROUNDS rounds of AutoAWQ, bf16 in the first; or of TPAB_MODELS); in the first round also one GPU with the previous commit's binary, the ratio's base
  C1="--ctx ${TP_CTX:-2048} --max-chunks ${TP_CHUNKS:-5} --device cuda"
  C="$C1 --tp 2"
  for r in $(seq "${TPAB_ROUNDS:-2}"); do
    for m in ${TPAB_MODELS:-l7b-awq $([ "$r" = 1 ] && echo l7b)}; do
      [ "$r" = 1 ] && run "$m-1gpu-base" $BASE verify --json --ppl .devdata/sotu-test.raw $C1 /tmp/$m
      run "$m-tp2-ab$r" bin/qtool verify --json --ppl .devdata/sotu-test.raw $C /tmp/$m
      for v in ${AB_PTX:-}; do
        run "$m-tp2-${v%%=*}-ab$r" env $(kenv "$OUT/ptx-${v%%=*}") bin/qtool verify --json \
          --ppl .devdata/sotu-test.raw $C /tmp/$m
      done
      for x in ${TPAB_BINS:-}; do # bin/qtool-NAME: a Go-side variant built here, with this build's PTX
        run "$m-tp2-$x-ab$r" bin/qtool-$x verify --json --ppl .devdata/sotu-test.raw $C /tmp/$m
      done
      run "$m-tp2-base-ab$r" $BASE verify --json --ppl .devdata/sotu-test.raw $C /tmp/$m
    done
  done
fi
if has tpdec; then # TP=2 decode alone (one chunk of perplexity first), alternating this build and the previous commit's binary, TPDEC_ROUNDS rounds of TPDEC_MODELS
  D="verify --json --ppl .devdata/sotu-test.raw --max-chunks 1 --prompt The --max-new 256 --device cuda --tp 2"
  for r in $(seq "${TPDEC_ROUNDS:-2}"); do
    for m in ${TPDEC_MODELS:-l7b-awq}; do
      run "$m-tp2dec-ab$r" bin/qtool $D /tmp/$m
      run "$m-tp2dec-base-ab$r" $BASE $D /tmp/$m
    done
  done
fi
if has tl; then # timelines (kernels/exp/timeline.diff applied, AB_PTX="tl=-DQTOOL_TIMELINE"): TL_RUNS of tp2 and 1gpu
  # (a 2 048-token prefill at TP=2 and on one GPU) and dec (graph decode on one GPU, TLDEC_STEPS steps: the last one's kernels)
  for m in ${TL_MODELS:-l7b-awq}; do
    for v in ${TL_RUNS:-tp2 1gpu}; do
      case $v in
        dec) args="--prompt The --max-new ${TLDEC_STEPS:-32}" ;;
        tp2) args="--ppl .devdata/sotu-test.raw --ctx 2048 --max-chunks ${TL_CHUNKS:-2} --tp 2" ;;
        *) args="--ppl .devdata/sotu-test.raw --ctx 2048 --max-chunks ${TL_CHUNKS:-2}" ;;
      esac
      rm -f /tmp/tl-$m-$v.*
      run "$m-tl-$v" env QTOOL_TIMELINE=/tmp/tl-$m-$v $(kenv "$OUT/ptx-tl") bin/qtool verify --json \
        $args --device cuda /tmp/$m
      python3 kernels/exp/tl_analyze.py /tmp/tl-$m-$v.gpu*.qtl > "$OUT/tl-$m-$v.txt" 2>&1; head -"${TL_LINES:-40}" "$OUT/tl-$m-$v.txt"
    done
  done
fi
if has tp-base; then # the AutoAWQ runs of tp with the previous commit's binary and its embedded PTX
  B="$BASE ${V#bin/qtool } --device cuda"
  run l7b-awq-1gpu-base $B /tmp/l7b-awq
  run l7b-awq-tp2-base $B --tp 2 /tmp/l7b-awq
  run l7b-awq-tp2-procs-base $B --tp 2 --tp-processes /tmp/l7b-awq
fi
if has tpprof; then # CPU profiles of rank 0 and 1, ranks in one process vs a process per rank (AutoAWQ; read with go tool pprof)
  for v in "inproc:" "procs:--tp-processes"; do n=${v%%:*}
    run "l7b-awq-tp2-$n-prof" $V --device cuda --tp 2 ${v#*:} --cpuprofile "$FINAL/tp2-$n.prof" /tmp/l7b-awq
  done
  ls -l "$FINAL"/*.prof* 2>/dev/null | awk '{print $5, $9}'
fi
if has tpspeed; then # the synthetic 8-layer W4A16 7B at TP=2: NCCL vs peer memory, collectives alone
  lim=$(left); [ "$lim" -gt 60 ] && (cd runtime/tp/gputest && QTOOL_TP_SPEED=1 QTOOL_TP_PROF="$FINAL/prof" timeout "$lim" "$OLDPWD/bin/gputest.test" -test.v -test.run TestTPSpeed > "$OUT/tpspeed.log" 2>&1)
  grep -E "GPU|TP=2" "$OUT/tpspeed.log" | cut -c1-400
fi
if has kld; then
  run kld-base bin/qtool verify --json --device cuda --ppl .devdata/sotu-test.raw --max-chunks 16 /tmp/l7b
  run kld-quant bin/qtool verify --json --device cuda --ppl .devdata/sotu-test.raw --max-chunks 16 /tmp/l7b-awq
  lim=$(left); ts=$(date +%s)
  timeout "$lim" bin/qtool verify --json --device cuda --kld /tmp/l7b --ppl .devdata/sotu-test.raw --max-chunks 16 /tmp/l7b-awq > "$OUT/kld.json" 2> "$OUT/kld.err"
  echo "kld rc=$? wall $(( $(date +%s) - ts )) s: $(head -c 600 "$OUT/kld.json")"; tail -2 "$OUT/kld.err"
fi
quant() { # method format: calibrate the 7B model on the GPU, timed, and read the output back
  local meth=$1 fmt=$2
  lim=$(left); [ "$lim" -lt 60 ] && { echo "7b $meth: no time left"; return; }
  [ -f .devdata/train.txt ] || gunzip -k .devdata/train.txt.gz
  ts=$(date +%s); rm -rf "/tmp/l7b-$meth"
  timeout "$lim" /usr/bin/time -v bin/qtool "$meth" --hf /tmp/l7b --calib .devdata/train.txt -o "/tmp/l7b-$meth" --format "$fmt" \
    --device cuda --verify .devdata/sotu-test.raw --verify-chunks 4 ${QARGS:-} > "$OUT/7b-$meth.txt" 2> "$OUT/7b-$meth.err"
  echo "7b $meth rc=$? wall $(( $(date +%s) - ts )) s"
  grep -E "^wrote|^phases|^verify" "$OUT/7b-$meth.txt"; grep -E "Maximum resident" "$OUT/7b-$meth.err"; tail -2 "$OUT/7b-$meth.err" | grep -v "Exit status" | cut -c1-300
}
has 7b-sq && quant smoothquant msmodelslim
has 7b-gptq && quant gptq gptq
has 7b-awq && quant awq autoawq
if has w8a8; then
  run l7b-w8a8 bin/qtool verify --json --device cuda --ppl .devdata/sotu-test.raw --max-chunks 16 /tmp/l7b-smoothquant
  run l7b-bf16-ppl bin/qtool verify --json --device cuda --ppl .devdata/sotu-test.raw --max-chunks 16 /tmp/l7b
fi
if has c8; then # llama-mini msmodelslim files qtool writes on the CPU, read back on the CPU and on the GPU (all chunks)
  [ -f .devdata/train.txt ] || gunzip -k .devdata/train.txt.gz
  for v in "static-c8:--kv-cache int8" "dynamic-c8:--act dynamic --kv-cache int8" "w8a8s-2of4-c8:--weights sparsegpt --sparsity 2:4 --kv-cache int8"; do
    n=${v%%:*}; rm -rf "/tmp/mini-$n"
    bin/qtool smoothquant --device cpu -q --hf testdata/llama-mini --calib .devdata/train.txt -o "/tmp/mini-$n" ${v#*:} > "$OUT/mini-$n.txt" 2>&1 || tail -3 "$OUT/mini-$n.txt"
    for dev in cpu cuda; do run "c8-$n-$dev" bin/qtool verify --json --device $dev --ppl .devdata/sotu-test.raw "/tmp/mini-$n"; done
  done
fi
if has 7b-c8; then # the 7B shape with dynamic W8A8 and an int8 KV cache: decode at ~3.9k tokens of context
  [ -f .devdata/train.txt ] || gunzip -k .devdata/train.txt.gz
  ts=$(date +%s); rm -rf /tmp/l7b-c8
  timeout "$(left)" bin/qtool smoothquant --act dynamic --kv-cache int8 --hf /tmp/l7b --calib .devdata/train.txt -o /tmp/l7b-c8 \
    --device cuda > "$OUT/7b-c8.txt" 2> "$OUT/7b-c8.err"
  echo "7b smoothquant --act dynamic --kv-cache int8 rc=$? wall $(( $(date +%s) - ts )) s"; grep -E "^wrote|^phases" "$OUT/7b-c8.txt"; tail -2 "$OUT/7b-c8.err" | cut -c1-300
  for kv in int8 fp16 fp32; do
    run "l7b-c8-kv$kv-4k" bin/qtool verify --json --device cuda --kv-cache $kv --prompt "$(head -c 14000 .devdata/sotu-test.raw)" --max-new 256 /tmp/l7b-c8
  done
  run l7b-c8-ppl bin/qtool verify --json --device cuda --ppl .devdata/sotu-test.raw --max-chunks 16 /tmp/l7b-c8
fi
if has kv16; then
  for kv in fp32 fp16; do
    run "l7b-awq-kv$kv-4k" bin/qtool verify --json --device cuda --kv-cache $kv --prompt "$(head -c 14000 .devdata/sotu-test.raw)" --max-new 256 /tmp/l7b-awq
  done
fi
if has kbench; then # kernels and the synthetic 7B (no checkpoint needed)
  lim=$(left); [ "$lim" -gt 60 ] && timeout "$lim" bin/qtool bench --synthetic llama2-7b --decode 128 ${KBENCH_ARGS:-} > "$OUT/kbench.txt" 2>&1
  grep -E "gemv|decode|prefill" "$OUT/kbench.txt" | head -40
fi
if has rankbench; then # graph decode of one rank's share at TP=2 alone (no all-reduce) against the whole 7B on one GPU
  for syn in llama2-7b-tp2 llama2-7b; do
    lim=$(left); [ "$lim" -gt 60 ] && timeout "$lim" bin/qtool bench --synthetic $syn --format w4a16,fp16 --kernels=false \
      --prompt 16 --decode 256 > "$OUT/rankbench-$syn.txt" 2>&1
    echo "rankbench $syn: $(grep -oE 'decode batch 1: .*' "$OUT/rankbench-$syn.txt" | cut -c1-160 | paste -sd'|')"
  done
fi
if has kbench16; then # short prompts: the small-M GEMMs (prefill of 16 tokens)
  lim=$(left); [ "$lim" -gt 60 ] && timeout "$lim" bin/qtool bench --synthetic llama2-7b --kernels=false --prompt 16 --decode 32 ${KBENCH_ARGS:-} > "$OUT/kbench16.txt" 2>&1
  grep -E "prefill [0-9]+ tokens|prefill estimate" "$OUT/kbench16.txt"
fi
if has kbench-base; then # the same with the previous commit's binary (.devbin/qtool-base.gz, else qtool) and its embedded PTX
  lim=$(left); [ "$lim" -gt 60 ] && timeout "$lim" $BASE bench --synthetic llama2-7b --decode 128 ${KBENCH_ARGS:-} > "$OUT/kbench-base.txt" 2>&1
  grep -E "gemv|decode|prefill" "$OUT/kbench-base.txt" | head -40
fi
# ab_variants STEP prints the builds an A/B step runs besides base: new (bin/qtool with the
# PTX built here) and each AB_PTX build's, leaving out (and saying so on stderr) one whose cuda
# tests failed or timed out, perhaps hanging (the callers skip the whole step when this build's
# did); variant_cmd V is the command that runs build V
ab_variants() { # AB_SKIP: AB_PTX builds ab and kab leave out (a timing build's, e.g. -DQTOOL_EXP_PHASES)
  local v out=new
  for v in ${AB_PTX:-}; do
    [ -n "${AB_SKIP:-}" ] && listed "$AB_SKIP" "${v%%=*}" && continue
    case " ${failed_variants:-} " in
      *" ${v%%=*} "*) echo "$1: ${v%%=*} left out (its cuda tests failed)" >&2 ;;
      *) out="$out ${v%%=*}" ;;
    esac
  done
  for v in ${AB_ENV:-}; do out="$out ${v%%=*}"; done
  echo "$out"
}
# AB_ENV="name=VAR=value ...": more variants of ab and kab, bin/qtool (this build's PTX) with VAR
# set (a Go-side experiment's switch)
variant_cmd() {
  local e
  for e in ${AB_ENV:-}; do
    [ "${e%%=*}" = "$1" ] && { echo "env ${e#*=} bin/qtool"; return; }
  done
  case $1 in
    new) echo bin/qtool ;;
    base) echo "$BASE" ;;
    *) echo "env $(kenv "$OUT/ptx-$1") bin/qtool" ;;
  esac
}
if has ab; then # graph decode of the synthetic 7B, bin/qtool (with the PTX built here if build ran) and
  # bin/qtool-base (its embedded PTX) alternating AB_ROUNDS times in this call: positions 16-272, about
  # the context verify --prompt The --max-new 256 decodes at
  # (and bin/qtool with each AB_PTX build's PTX)
  # (a build whose cuda tests failed or timed out, perhaps hanging, is left out: ab_variants;
  # AB_MODEL, AB_FORMAT, AB_PROMPT, AB_DECODE and AB_ARGS change the bench's shapes, format, prompt, steps and flags;
  # AB_MODEL="llama2-7b llama3-8b": both in each round; AB_ENV: Go-side variants, see variant_cmd)
  variants=$(ab_variants ab)
  [ "${failed_new:-0}" = 0 ] || { echo "ab: skipped (this build's cuda tests failed)"; AB_ROUNDS=0; }
  clocks=""
  if [ "${AB_CLOCKS:-0}" = 1 ]; then
    nvidia-smi --query-gpu=timestamp,clocks.sm,clocks.mem,power.draw,temperature.gpu --format=csv,nounits -lms 100 > "$OUT/clocks.csv" 2>&1 &
    clocks=$!
  fi
  for i in $(seq "${AB_ROUNDS:-2}"); do
    for mdl in ${AB_MODEL:-llama2-7b}; do # AB_MODEL may list several (bench --synthetic's)
    for p in ${AB_PROMPT:-16}; do # AB_PROMPT may list several prompt lengths
    for v in $variants base; do
      lim=$(left); [ "$lim" -lt 90 ] && { echo "ab: no time left"; break 4; }
      cmd=$(variant_cmd "$v")
      f="$OUT/ab-$v-$p-$i.txt"; [ "$mdl" = llama2-7b ] || f="$OUT/ab-$mdl-$v-$p-$i.txt"
      echo "start ${f##*/} $(date +%Y/%m/%d\ %H:%M:%S.%3N)" >> "$OUT/ab-times.txt"
      timeout "$lim" $cmd bench --synthetic "$mdl" --format "${AB_FORMAT:-w4a16}" --kernels=false \
        --prompt "$p" --decode "${AB_DECODE:-256}" ${AB_ARGS:-} > "$f" 2>&1
      rc=$?
      echo "end ${f##*/} $(date +%Y/%m/%d\ %H:%M:%S.%3N)" >> "$OUT/ab-times.txt"
      echo "ab $mdl $v p$p $i rc=$rc: $(grep -oE 'prefill [0-9]+ tokens: .*|decode batch 1: .*' "$f" | cut -c1-230 | paste -sd'|')"
    done
    done
    done
  done
  [ -n "$clocks" ] && kill "$clocks"
fi
if has kab; then # kernel tables side by side: bin/qtool (with the PTX built here if build ran), each
  # AB_PTX build's PTX and bin/qtool-base (its embedded PTX), KAB_ROUNDS rounds (default 3) alternating
  # in this call, each `bench --synthetic llama2-7b --prompt 512 --decode 16` (KAB_FORMAT: the model's
  # formats, default w8a16,w4a16,fp16; KAB_ARGS: more flags), summed up by kernels/ktable.py
  # (a build whose cuda tests failed or timed out is left out, all of kab when this build's did, as in ab)
  kvariants=$(ab_variants kab)
  [ "${failed_new:-0}" = 0 ] || { echo "kab: skipped (this build's cuda tests failed)"; KAB_ROUNDS=0; }
  for i in $(seq "${KAB_ROUNDS:-3}"); do
    for v in $kvariants base; do
      lim=$(left); [ "$lim" -lt 60 ] && { echo "kab: no time left"; break 2; }
      timeout "$lim" $(variant_cmd "$v") bench --synthetic llama2-7b --format "${KAB_FORMAT:-w8a16,w4a16,fp16}" \
        --prompt 512 --decode 16 ${KAB_ARGS:-} > "$OUT/kab-$v-$i.txt" 2>&1
      echo "kab $v $i rc=$?"
    done
  done
  python3 kernels/ktable.py "$OUT"/kab-*-*.txt > "$OUT/ktable.txt" 2>&1
  cp "$OUT/ktable.txt" "$FINAL/" 2>/dev/null
  sed -n '/^GEMM/,/^GEMV/p' "$OUT/ktable.txt" | grep -vE '^  (fp16|w8a8) ' | head -40
  sed -n '/^prefill/,$p' "$OUT/ktable.txt"
fi
if has bench; then
  # the context verify --prompt The --max-new 256 decodes at
  lim=$(left); [ "$lim" -gt 60 ] && timeout "$lim" bin/qtool bench --kernels=false --prompt 16 --decode 256 /tmp/l7b-awq > "$OUT/bench-awq.txt" 2>&1
  grep -E "decode batch|prefill" "$OUT/bench-awq.txt"
fi
if has anchor; then
  lim=$(left); [ "$lim" -gt 60 ] && timeout "$lim" python3 .devdata/torch_anchor.py ${ANCHOR_ARGS:-} --json "$OUT/anchor.json" > "$OUT/anchor.log" 2>&1
  grep -E "gptfast|copy_GBps|hf_fp16|cublas_f16_gemm" "$OUT/anchor.json" 2>/dev/null || tail -5 "$OUT/anchor.log"
fi
if has int8anchor; then # cuBLAS int8 (torch._int_mm) beside fp16 at the 7B/8B GEMM shapes (INT8_ROWS: the rows)
  lim=$(left); [ "$lim" -gt 40 ] && timeout "$lim" python3 kernels/exp/int8_anchor.py --rows "${INT8_ROWS:-512,1024,2048}" \
    --json "$OUT/int8anchor.json" > "$OUT/int8anchor.log" 2>&1
  grep -E "^cublas|Error" "$OUT/int8anchor.log" || tail -5 "$OUT/int8anchor.log"
fi
echo "total $(( $(date +%s) - t0 )) s"
