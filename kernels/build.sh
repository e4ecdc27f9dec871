#!/usr/bin/env bash
# Compiles the CUDA sources (qtool.cu: inference; calib.cu: calibration) to
# PTX for sm_80 and sm_90 (qtool: sm_90a, for Hopper's wgmma) with nvcc and
# records each source's SHA-256 in the first line of its PTX files
# (kernels_test.go checks it). Usage:
# kernels/build.sh [OUTDIR] (default: kernels/). Also writes the ptxas
# resource report (registers, shared memory, spills) to OUTDIR/ptxas.txt,
# and fails when the sm_90 SASS (qtool's sm_90a, calib's sm_90) of this
# machine's ptxas has a cp.async through uniform registers that nothing
# writes (sass_check.py; OUTDIR/sass-check-*.txt). The driver compiles the
# PTX again when qtool loads it; this vets the build machine's compiler.
# The vetted sm_90a cubin stays as OUTDIR/qtool_sm90a.cubin (ignored by git),
# which QTOOL_CUDA_CUBIN loads in place of the PTX in development runs.
# The nvcc runs go in parallel. NVCC_FLAGS adds flags to every nvcc run (an
# experiment's -D switches; the committed PTX is built without). KERNEL_SRC
# names another folder holding qtool.cu and calib.cu (gpu-run.sh: the base
# commit's sources, built as this tree's are for a like-for-like A/B).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
src_dir=${KERNEL_SRC:-$here}
out=${1:-$here}
mkdir -p "$out"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pids=()
for src in qtool calib; do
  # qtool's Hopper PTX is arch-specific (sm_90a: wgmma); calib's stays sm_90
  a90=sm_90; [ $src = qtool ] && a90=sm_90a
  nvcc -ptx -O3 -std=c++17 ${NVCC_FLAGS:-} -arch=sm_80 -o "$tmp/${src}80.ptx" "$src_dir/$src.cu" & pids+=($!)
  nvcc -ptx -O3 -std=c++17 ${NVCC_FLAGS:-} -arch=compute_${a90#sm_} -o "$tmp/${src}90.ptx" "$src_dir/$src.cu" & pids+=($!)
  nvcc -cubin -O3 -std=c++17 ${NVCC_FLAGS:-} -gencode=arch=compute_${a90#sm_},code=$a90 -Xptxas -v -o "$tmp/${src}90.cubin" "$src_dir/$src.cu" > "$tmp/ptxas-$src.txt" 2>&1 & pids+=($!)
done
for p in "${pids[@]}"; do
  wait "$p" || { cat "$tmp"/ptxas-*.txt; exit 1; }
done
# ptxas has emitted cp.async copies through uniform registers it never set
# (an illegal instruction at run time): refuse such a build before writing its PTX (sass_check.py)
for src in qtool calib; do
  cuobjdump -sass "$tmp/${src}90.cubin" > "$tmp/${src}90.sass"
  expect=""; [ $src = qtool ] && expect=--expect-copies # qtool's ring GEMVs copy; calib's kernels may not
  rc=0; python3 "$here/sass_check.py" $expect "$tmp/${src}90.sass" > "$out/sass-check-$src.txt" || rc=$?
  case $rc in
    0) ;;
    1) cat "$out/sass-check-$src.txt"; echo "build.sh: $src: ptxas wrote cp.async through unset uniform registers" >&2; exit 1 ;;
    *) cat "$out/sass-check-$src.txt"; echo "build.sh: $src: sass_check.py failed (exit $rc)" >&2; exit 1 ;;
  esac
done
for src in qtool calib; do
  h=$(sha256sum "$src_dir/$src.cu" | cut -d' ' -f1)
  for arch in 80 90; do
    { echo "// qtool-source-sha256: $h"; cat "$tmp/${src}${arch}.ptx"; } > "$out/${src}_sm$arch.ptx"
  done
  echo "built $out/${src}_sm80.ptx $out/${src}_sm90.ptx (source $h)"
done
cat "$tmp"/ptxas-*.txt > "$out/ptxas.txt"
# the sm_90a cubin of the same build, which runtime/cuda loads without the
# driver's ~50 s compile of the PTX where QTOOL_CUDA_CUBIN names it
# (gpu-run.sh's CUBIN=1; kernel development only: never committed)
cp "$tmp/qtool90.cubin" "$out/qtool_sm90a.cubin"
