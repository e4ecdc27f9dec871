#!/usr/bin/env bash
# Calibration on the GPU machine (issue 10), in one device call: builds the
# PTX, runs the calibration kernel tests, calibrates llama-mini with GPTQ,
# AWQ and SmoothQuant on the GPU (perplexity of the written files), then a
# random-weight Llama-2-7B-shaped checkpoint (synth_hf.py) end to end, and
# optionally the reference GPTQ in the same call.
# Needs: .devbin/qtool and .devbin/cuda.test (CGO_ENABLED=0 builds, .xz or
# .gz to fit the transfer; CALIB=1 kernels/gpu-prep.sh makes them), .devdata/ (train.txt.gz,
# sotu-test.raw, synth_hf.py, ref_gptq_scale.py), .peers/ (IST-DASLab/gptq's
# gptq.py and quant.py, for STEPS containing ref). Usage:
#   STEPS="build unit mini 7b-gptq 7b-asym 7b-awq 7b-sq ref" kernels/gpu-calib.sh
# (7b-asym: gptq --asym, issue 15; mini-asym: the same on llama-mini)
set -uo pipefail
export PYTHONUNBUFFERED=1
FINAL=${OUT:-/tmp/out}
OUT=/tmp/gpu-calib # logs; packed into $FINAL/logs.tgz at the end with the PTX
rm -rf "$OUT"; mkdir -p "$OUT" "$FINAL"
finish() {
  cp "$OUT"/ptx/calib_sm*.ptx "$FINAL"/ 2>/dev/null
  tar -C "$OUT" -czf "$FINAL/logs.tgz" . 2>/dev/null
}
trap finish EXIT
STEPS=${STEPS:-build unit mini 7b-gptq}
t0=$(date +%s)
left() { echo $(( ${BUDGET:-560} - ($(date +%s) - t0) )); }
has() { [[ " $STEPS " == *" $1 "* ]]; }
nvidia-smi --query-gpu=name,memory.total,clocks.sm --format=csv,noheader
mkdir -p "$OUT/ptx"
mkdir -p bin
for f in qtool cuda.test; do
  if [ -f .devbin/$f.xz ]; then xz -dc .devbin/$f.xz; else gunzip -c .devbin/$f.gz; fi > bin/$f
  chmod +x bin/$f
done
[ -f .devdata/train.txt ] || gunzip -k .devdata/train.txt.gz
if has build; then
  bash kernels/build.sh "$OUT/ptx" > "$OUT/build.log" 2>&1 || { cat "$OUT/build.log"; exit 1; }
  grep -A2 "calib\|gptq_block\|awq_clip" "$OUT/ptx/ptxas.txt" | grep -i "registers\|spill" | head -20
  export QTOOL_CALIB_PTX="$OUT/ptx/calib_sm90.ptx"
fi
if has unit; then
  bin/cuda.test -test.run 'Calibrator|InvChol|GPTQOnDevice|AWQOnDevice' -test.v > "$OUT/unit.log" 2>&1
  grep -E "^(=== RUN|--- |    calib|ok|FAIL|PASS)|codes differ|thresholds" "$OUT/unit.log" | grep -v "=== RUN" | head -40
fi
if has mini; then
  for m in gptq:gptq awq:autoawq smoothquant:msmodelslim; do
    meth=${m%%:*}; fmt=${m##*:}
    rm -rf "/tmp/mini-$meth"
    /usr/bin/time -v bin/qtool "$meth" --hf testdata/llama-mini --calib .devdata/train.txt -o "/tmp/mini-$meth" --format "$fmt" \
      --device cuda --verify .devdata/sotu-test.raw --json > "$OUT/mini-$meth.json" 2> "$OUT/mini-$meth.err"
    echo "mini $meth rc=$? $(grep -o '"ppl": [0-9.]*' "$OUT/mini-$meth.json") $(grep -o '"seconds": [0-9.]*' "$OUT/mini-$meth.json" | head -1)"
  done
fi
if has mini-asym; then
  rm -rf /tmp/mini-asym
  bin/qtool gptq --asym --hf testdata/llama-mini --calib .devdata/train.txt -o /tmp/mini-asym --format gptq \
    --device cuda --verify .devdata/sotu-test.raw --json > "$OUT/mini-asym.json" 2> "$OUT/mini-asym.err"
  echo "mini gptq --asym rc=$? $(grep -o '"ppl": [0-9.]*' "$OUT/mini-asym.json") $(grep -o '"seconds": [0-9.]*' "$OUT/mini-asym.json" | head -1)"
fi
if has 7b-gptq || has 7b-asym || has 7b-awq || has 7b-sq || has ref; then
  ts=$(date +%s)
  python3 .devdata/synth_hf.py llama2-7b /tmp/l7b --tokenizer testdata/llama-mini > "$OUT/synth.log" 2>&1 || { tail "$OUT/synth.log"; exit 1; }
  echo "synth $(( $(date +%s) - ts )) s: $(tail -1 "$OUT/synth.log")"
fi
for m in ${ORDER:-gptq:gptq asym:gptq awq:autoawq sq:msmodelslim}; do
  meth=${m%%:*}; fmt=${m##*:}
  has "7b-$meth" || continue
  cmd=$meth; [ "$meth" = sq ] && cmd=smoothquant; [ "$meth" = asym ] && cmd="gptq --asym"
  lim=$(left); [ "$lim" -lt 30 ] && { echo "7b $meth: no time left"; continue; }
  ts=$(date +%s)
  rm -rf "/tmp/l7b-$meth"
  timeout "$lim" /usr/bin/time -v bin/qtool $cmd --hf /tmp/l7b --calib .devdata/train.txt -o "/tmp/l7b-$meth" --format "$fmt" \
    --device cuda --verify .devdata/sotu-test.raw --verify-chunks 4 > "$OUT/7b-$meth.txt" 2> "$OUT/7b-$meth.err"
  rc=$?
  echo "7b $meth rc=$rc wall $(( $(date +%s) - ts )) s"
  grep -E "^wrote|^phases|^verify" "$OUT/7b-$meth.txt"; grep -E "Maximum resident" "$OUT/7b-$meth.err"; tail -3 "$OUT/7b-$meth.err" | grep -v "Exit status" | cut -c1-300
  rm -rf "/tmp/l7b-$meth"
done
if has ref; then
  lim=$(left)
  ts=$(date +%s)
  timeout "$lim" python3 .devdata/ref_gptq_scale.py /tmp/l7b testdata/llama-mini/tokenizer.model .devdata/train.txt .peers > "$OUT/ref.log" 2>&1
  echo "ref rc=$? wall $(( $(date +%s) - ts )) s"; tail -3 "$OUT/ref.log"
fi
echo "total $(( $(date +%s) - t0 )) s"
