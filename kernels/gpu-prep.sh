#!/usr/bin/env bash
# Prepares a device call of kernels/gpu-run.sh or gpu-calib.sh here, where Go
# is (the GPU machine has none): CGO_ENABLED=0 builds of the working tree —
# qtool and the GPU test binaries TESTBINS names (default cuda; also kld,
# tp, gputest) — xz-compressed into .devbin/, the same qtool built from BASE (a
# commit, default HEAD) as .devbin/qtool-base.xz when the tree differs from
# it, and .devdata/ with the shared tools and corpus the scripts read
# (CALIB=1 adds the calibration text gpu-calib.sh needs). Both folders are
# ignored by git; name them in the device call's carry. What travels (the
# files git does not ignore, and the carry) must stay under 64 MiB: the script says how
# much it is and fails above. Usage:
#   kernels/gpu-prep.sh [BASE]
#   git apply kernels/exp/NAME.diff && kernels/gpu-prep.sh   # an experiment against HEAD
#   SM80_OUT=1 NOBASE=1 XZ_LEVEL=9 kernels/gpu-prep.sh       # the usual call since the 32-row attention (below)
# then run: STEPS="build tests ab" bash kernels/gpu-run.sh, carry .devbin .devdata
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
shared=${SHARED:-$root/../shared}
base=${1:-HEAD}
cd "$root"
# an emptied kernels/qtool_sm80.ptx (SM80_OUT, below, not yet put back) would be embedded
# in the binaries and, with SM80_OUT, overwrite the kept copy: refuse
if [ ! -s kernels/qtool_sm80.ptx ]; then
  echo "gpu-prep: kernels/qtool_sm80.ptx is empty (a previous SM80_OUT=1 call's): put it back first," \
    "cp bin/qtool_sm80.ptx.keep kernels/qtool_sm80.ptx (or git checkout kernels/qtool_sm80.ptx)" >&2
  exit 2
fi
rm -rf .devbin .devdata && mkdir -p .devbin .devdata bin
rm -f bin/qtool-base
export CGO_ENABLED=0
go build -trimpath -ldflags='-s -w' -o bin/qtool ./cmd/qtool
bins=(bin/qtool)
for t in ${TESTBINS:-cuda}; do
  case $t in
    cuda | kld | tp) pkg=./runtime/$t ;;
    gputest) pkg=./runtime/tp/gputest ;;
    *) echo "gpu-prep: unknown test binary $t (cuda, kld, tp, gputest)" >&2; exit 2 ;;
  esac
  go test -c -trimpath -ldflags="-s -w" -o "bin/$t.test" "$pkg" # stripped: panics still name their functions
  bins+=("bin/$t.test")
done
# NOBASE=1: no qtool-base (a kernel-only diff: gpu-run's A/B base is then
# bin/qtool with its embedded PTX, and the carry has room for two test binaries)
if [ "${NOBASE:-0}" != 1 ] && ! git diff --quiet "$base" -- . ':!kernels/exp'; then
  wt=$(mktemp -d)
  git worktree add -q --detach "$wt" "$base"
  (cd "$wt" && go build -trimpath -ldflags='-s -w' -o "$root/bin/qtool-base" ./cmd/qtool)
  # its kernels' source: gpu-run.sh's build makes base's cubin from it where CUBIN=1
  git show "$base":kernels/qtool.cu > .devdata/qtool-base.cu
  git worktree remove --force "$wt"
  bins+=(bin/qtool-base)
fi
for b in "${bins[@]}"; do
  xz -T2 -"${XZ_LEVEL:-3}" -c "$b" > ".devbin/$(basename "$b").xz" # XZ_LEVEL=9 when the carry is near the limit
done
# SM80_OUT=1: the binaries built, kernels/qtool_sm80.ptx (7 MiB that a call on an H200 never
# reads: the binaries embed it) is emptied so that the tree travels under the limit, its
# content kept in bin/qtool_sm80.ptx.keep; put it back after the call with
#   cp bin/qtool_sm80.ptx.keep kernels/qtool_sm80.ptx
if [ "${SM80_OUT:-0}" = 1 ]; then
  cp kernels/qtool_sm80.ptx bin/qtool_sm80.ptx.keep && : > kernels/qtool_sm80.ptx
  echo "gpu-prep: kernels/qtool_sm80.ptx emptied for the call; after it: cp bin/qtool_sm80.ptx.keep kernels/qtool_sm80.ptx"
fi
cp "$shared"/tools/synth_hf.py "$shared"/tools/torch_anchor.py "$shared"/tools/ref_gptq_scale.py .devdata/
cp "$shared"/corpus/sotu-test.raw .devdata/
[ "${CALIB:-0}" = 1 ] && gzip -c "$shared"/corpus/train.txt > .devdata/train.txt.gz
ls -l .devbin .devdata
tracked=$(git ls-files -z -co --exclude-standard | xargs -0 cat | wc -c) # tracked and untracked-not-ignored
carry=$(cat .devbin/* .devdata/* | wc -c)
echo "travels: tracked $((tracked >> 20)) MiB + carry $((carry >> 20)) MiB = $(((tracked + carry) >> 20)) MiB (limit 64)"
# the device refused 63.8 MiB by this count (fifty-fourth session) and took
# 63.1: keep under 63 MiB, or drop what the call does not need from
# .devdata (sotu-test.raw, torch_anchor.py, ref_gptq_scale.py: 0.7 MiB)
[ $((tracked + carry)) -lt $((63 << 20)) ] ||
  echo "gpu-prep: $(((tracked + carry) >> 10)) KiB: above 63 MiB, the device may refuse it (limit 64 by its own count)" >&2
[ $((tracked + carry)) -lt $((64 << 20)) ] || { echo "gpu-prep: over the device call's 64 MiB" >&2; exit 1; }
