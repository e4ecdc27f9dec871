#!/usr/bin/env python3
"""Summarizes `qtool bench` kernel tables run side by side (gpu-run.sh's kab
step): each FILE is one run, named kab-VARIANT-ROUND.txt. Prints, for every
GEMM format and shape, each variant's times over the rounds (us at the
table's M: 512, or the M after @ for bench --gemm-rows) and its mean ratio
to our fp16 GEMM of the same run; then the GEMV lines' % of copy alike, and
each run's prefill rates.
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
            shape = f[2] if f[3] == "512" else f"{f[2]}@{f[3]}"  # bench --gemm-rows
            gemm[(f[1], shape)] = float(f[4])
        elif len(f) >= 8 and f[0] == "gemv":
            m = re.search(r"([0-9.]+)% of copy", line)
            if m:
                gemv[(f[1].split("/")[0], f[2])] = float(m.group(1))
        m = re.match(r"\s*(\S+): decode .*prefill \d+% of fp16 \((\d+) vs (\d+) tok/s\)", line)
        if m:
            prefill[m.group(1)] = int(m.group(2))
            prefill["fp16"] = int(m.group(3))
    return gemm, gemv, prefill


def table(runs, variants, pick, cell):
    """Prints a line for every key of the runs' pick(parsed run) dicts:
    each variant's cell(key, [parsed runs holding the key, by round])."""
    keys = sorted({k for v in runs for _, p in runs[v] for k in pick(p)})
    for fmt, shape in keys:
        cells = []
        for v in variants:
            held = [p for _, p in sorted(runs[v], key=lambda rp: rp[0]) if (fmt, shape) in pick(p)]
            if held:
                cells.append(f"{v} {cell((fmt, shape), held)}")
        print(f"  {fmt:<10} {shape:<11} " + " | ".join(cells))


def gemm_cell(key, held):
    ts = "/".join(f"{g[key]:.1f}" for g, _, _ in held)
    rs = [100 * g[("fp16", key[1])] / g[key] for g, _, _ in held if ("fp16", key[1]) in g]
    return ts + (f" ({sum(rs) / len(rs):.1f} %)" if rs else "")


def main(paths):
    runs = collections.defaultdict(list)  # variant -> [(round, parsed)]
    for p in paths:
        m = re.search(r"kab-(.+)-(\d+)\.txt$", p)
        if not m:
            sys.exit(f"ktable: {p}: want a name kab-VARIANT-ROUND.txt")
        runs[m.group(1)].append((int(m.group(2)), parse(p)))
    variants = sorted(runs, key=lambda v: (v != "base", v))
    print("GEMM (us at M = 512, or the M after @; mean % of our fp16 GEMM of the same run)")
    table(runs, variants, lambda p: p[0], gemm_cell)
    print("GEMV (% of copy)")
    table(runs, variants, lambda p: p[1], lambda key, held: "/".join(f"{g[key]:.1f}" for _, g, _ in held))
    print("prefill (tok/s)")
    for v in variants:
        for r, (_, _, pf) in sorted(runs[v], key=lambda rp: rp[0]):
            print(f"  {v} round {r}: " + ", ".join(f"{k} {n}" for k, n in sorted(pf.items())))


if __name__ == "__main__":
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    main(sys.argv[1:])
