#!/usr/bin/env bash
# Compiles qtool.cu to PTX for sm_80 and sm_90 with nvcc and records the
# source's SHA-256 in the first line of each PTX file (kernels_test.go checks
# it). Usage: kernels/build.sh [OUTDIR] (default: kernels/). Also writes the
# ptxas resource report (registers, shared memory, spills) to OUTDIR/ptxas.txt.
# The three nvcc runs go in parallel.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
out=${1:-$here}
mkdir -p "$out"
h=$(sha256sum "$here/qtool.cu" | cut -d' ' -f1)
tmp=$(mktemp -d)
pids=()
for arch in 80 90; do
  nvcc -ptx -O3 -std=c++17 -arch=sm_$arch -o "$tmp/q$arch.ptx" "$here/qtool.cu" & pids+=($!)
done
nvcc -cubin -O3 -std=c++17 -arch=sm_90 -Xptxas -v -o "$tmp/q90.cubin" "$here/qtool.cu" > "$tmp/ptxas.txt" 2>&1 & pids+=($!)
for p in "${pids[@]}"; do
  wait "$p" || { cat "$tmp/ptxas.txt"; exit 1; }
done
for arch in 80 90; do
  { echo "// qtool-source-sha256: $h"; cat "$tmp/q$arch.ptx"; } > "$out/qtool_sm$arch.ptx"
done
cp "$tmp/ptxas.txt" "$out/ptxas.txt"
rm -rf "$tmp"
echo "built $out/qtool_sm80.ptx $out/qtool_sm90.ptx (source $h)"
