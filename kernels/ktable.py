#!/usr/bin/env python3
"""Summarizes `qtool bench` kernel tables run side by side (gpu-run.sh's kab
step): each FILE is one run, named kab-VARIANT-ROUND.txt. Prints, for every
GEMM format and shape, each variant's times over the rounds (us at the
table's M) and its mean ratio to our fp16 GEMM of the same run; then the
GEMV lines' % of copy alike, and each run's prefill rates.
Usage: ktable.py FILE..."""
import collections
import re
import sys


def parse(path):
    gemm, gemv, prefill = {}, {}, {}
    fmt = None
    for line in open(path, errors="replace"):
        f = line.split()
        if len(f) >= 5 and f[0] == "gemm":
            gemm[(f[1], f[2])] = float(f[4])
        elif len(f) >= 8 and f[0] == "gemv":
            m = re.search(r"([0-9.]+)% of copy", line)
            if m:
                gemv[(f[1].split("/")[0], f[2])] = float(m.group(1))
        m = re.match(r"\s*(\S+): decode .*prefill \d+% of fp16 \((\d+) vs (\d+) tok/s\)", line)
        if m:
            prefill[m.group(1)] = int(m.group(2))
            prefill["fp16"] = int(m.group(3))
    return gemm, gemv, prefill


def main(paths):
    runs = collections.defaultdict(list)  # variant -> [(round, parsed)]
    for p in paths:
        m = re.search(r"kab-(.+)-(\d+)\.txt$", p)
        if not m:
            sys.exit(f"ktable: {p}: want a name kab-VARIANT-ROUND.txt")
        runs[m.group(1)].append((int(m.group(2)), parse(p)))
    variants = sorted(runs, key=lambda v: (v != "base", v))
    keys = sorted({k for v in runs for _, (g, _, _) in runs[v] for k in g})
    print("GEMM (us at M = 512; mean % of our fp16 GEMM of the same run)")
    for fmt, shape in keys:
        cells = []
        for v in variants:
            ts = [g[(fmt, shape)] for _, (g, _, _) in sorted(runs[v]) if (fmt, shape) in g]
            rs = [100 * g[("fp16", shape)] / g[(fmt, shape)] for _, (g, _, _) in runs[v] if (fmt, shape) in g and ("fp16", shape) in g]
            if ts:
                cells.append(f"{v} {'/'.join(f'{t:.1f}' for t in ts)}" + (f" ({sum(rs) / len(rs):.1f} %)" if rs else ""))
        print(f"  {fmt:<10} {shape:<11} " + " | ".join(cells))
    gkeys = sorted({k for v in runs for _, (_, g, _) in runs[v] for k in g})
    print("GEMV (% of copy)")
    for fmt, shape in gkeys:
        cells = []
        for v in variants:
            ps = [g[(fmt, shape)] for _, (_, g, _) in sorted(runs[v]) if (fmt, shape) in g]
            if ps:
                cells.append(f"{v} {'/'.join(f'{p:.1f}' for p in ps)}")
        print(f"  {fmt:<10} {shape:<11} " + " | ".join(cells))
    print("prefill (tok/s)")
    for v in variants:
        for r, (_, _, pf) in sorted(runs[v]):
            print(f"  {v} round {r}: " + ", ".join(f"{k} {n}" for k, n in sorted(pf.items())))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
