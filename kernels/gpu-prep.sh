#!/usr/bin/env bash
# Prepares a device call of kernels/gpu-run.sh or gpu-calib.sh here, where Go
# is (the GPU machine has none): CGO_ENABLED=0 builds of the working tree —
# qtool and the GPU test binaries — xz-compressed into .devbin/, the same
# qtool built from BASE (a commit, default HEAD) as .devbin/qtool-base.xz
# when the tree differs from it, and .devdata/ with the shared tools and
# corpus the scripts read. Both folders are ignored by git; name them in
# the device call's carry. Usage:
#   kernels/gpu-prep.sh [BASE]
#   git apply kernels/exp/NAME.diff && kernels/gpu-prep.sh   # an experiment against HEAD
# then run: STEPS="build tests ab" bash kernels/gpu-run.sh, carry .devbin .devdata
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
shared=${SHARED:-$root/../shared}
base=${1:-HEAD}
cd "$root"
rm -rf .devbin && mkdir -p .devbin .devdata bin
rm -f bin/qtool-base
export CGO_ENABLED=0
go build -trimpath -ldflags='-s -w' -o bin/qtool ./cmd/qtool
go test -c -o bin/cuda.test ./runtime/cuda
go test -c -o bin/kld.test ./runtime/kld
go test -c -o bin/gputest.test ./runtime/tp/gputest
if ! git diff --quiet "$base" -- . ':!kernels/exp'; then
  wt=$(mktemp -d)
  git worktree add -q --detach "$wt" "$base"
  (cd "$wt" && go build -trimpath -ldflags='-s -w' -o "$root/bin/qtool-base" ./cmd/qtool)
  git worktree remove --force "$wt"
fi
for b in bin/qtool bin/qtool-base bin/cuda.test bin/kld.test bin/gputest.test; do
  [ -f "$b" ] || continue
  xz -T2 -3 -c "$b" > ".devbin/$(basename "$b").xz"
done
cp "$shared"/tools/synth_hf.py "$shared"/tools/torch_anchor.py "$shared"/tools/ref_gptq_scale.py .devdata/
cp "$shared"/corpus/sotu-test.raw .devdata/
gzip -c "$shared"/corpus/train.txt > .devdata/train.txt.gz
du -sh .devbin .devdata
ls -l .devbin
