#!/usr/bin/env python3
"""Reads the timeline files of a -DQTOOL_TIMELINE build (kernels/exp/timeline.diff;
runtime/cuda/timeline.go writes PREFIX.gpuN.qtl at Close) and prints where one
forward pass's time goes on each GPU and, with two or more files (the ranks of
a tensor-parallel run), how the ranks meet in the kernels that wait for each other (MEETS).

    QTOOL_TIMELINE=/tmp/tl QTOOL_CUDA_PTX=.../qtool_sm90.ptx qtool verify --ppl F --ctx 2048 --max-chunks 3 --tp 2 MODEL
    python3 tl_analyze.py /tmp/tl.gpu0.qtl /tmp/tl.gpu1.qtl [--pass -1]

A record is one block: the kernel's name, %gridid, its linear index and
multiprocessor, and %globaltimer (ns) when it began, when its wait for the
kernel before ended (allreduce_peer, exchange_peer: when their first meeting
with the peers ended)
and when it ended. A launch is the records of one %gridid (split where their
starts are REPLAY_GAP apart: a CUDA graph's replays launch a node with one
%gridid). The window is one
forward pass: from the --pass'th launch of an embed_* kernel (default the
last) to the next one or the end.

Per GPU: each kernel's share of the window (from its launch's first block to
the next launch's first block, so the shares add up to the window) and its
span (first block to last block's end). Per meeting kernel (MEETS: the
large all-reduce, the sequence-parallel exchange): its wait (first block's
start to the last block's meeting end) and the rest (the meeting end to
its end). Then, where the launches
repeat with a period (the layers), each position of the period: the
kernel, its median added time (its end less the end of the launch before:
with programmatic dependent launches a kernel's blocks start early, so this
is what it adds to the pass), and its blocks' median time from release to
end; then, each a median over the repeats, from the end of the launch before:
its first block's start, how many blocks started before that end, its
blocks' median release, its last block's start. Across GPUs, whose clocks
differ, the k-th meeting kernel's meeting ends are taken as simultaneous (their
median difference aligns the clocks; a meeting ends when the last rank
arrives), and each says which rank arrived last and by how much,
and what the launch before it (the sending GEMM) took on each rank.
"""
import collections
import statistics
import struct
import sys

# the kernels whose blocks meet the peers' (t1: the end of the first meeting)
MEETS = ('allreduce_peer', 'exchange_peer', 'exchange_peer_shared')

REC = 64


def read(path):
    with open(path, 'rb') as f:
        data = f.read()
    if data[:4] != b'QTL1':
        sys.exit(f'{path}: not a timeline file')
    dev, n, counted = struct.unpack_from('<QQQ', data, 4)
    if counted > n:
        print(f'{path}: {counted - n} records lost (the buffer held {n}; QTOOL_TIMELINE_RECORDS)', file=sys.stderr)
    grids = collections.OrderedDict()
    for i in range(n):
        w = struct.unpack_from('<8Q', data, 28 + REC * i)
        name = b''.join(x.to_bytes(8, 'little') for x in w[:3]).rstrip(b'\0').decode('ascii', 'replace')
        gid, t0, t1, t2 = w[3], w[5], w[6], w[7]
        grids.setdefault(gid, (name, []))[1].append((t0, t1, t2))
    # a CUDA graph's replays launch a node with one %gridid: its blocks
    # split where their starts are more than REPLAY_GAP apart, a launch each
    launches = []
    for name, blocks in grids.values():
        blocks.sort()
        run = [blocks[0]]
        for b in blocks[1:]:
            if b[0] - run[-1][0] > REPLAY_GAP:
                launches.append(launch(name, run))
                run = []
            run.append(b)
        launches.append(launch(name, run))
    return dev, sorted(launches, key=lambda l: l['t0'])


# ns between two block starts of one %gridid that part two launches (a
# graph's replays: a decode step is ~1.5 ms, a launch's blocks start within
# tens of microseconds)
REPLAY_GAP = 300_000


def launch(name, blocks):
    return {'name': name, 'blocks': len(blocks), 'recs': blocks,
            't0': min(b[0] for b in blocks), 't1': max(b[1] for b in blocks), 't2': max(b[2] for b in blocks),
            'blocks_rel_end': [b[2] - max(b[0], b[1]) for b in blocks]}


def window(ls, which):
    starts = [i for i, l in enumerate(ls) if l['name'].startswith('embed')]
    if not starts:
        return ls
    i = starts[which]
    j = next((k for k in starts if k > i), len(ls))
    return ls[i:j]


def us(ns):
    return ns / 1e3


def per_gpu(dev, ls):
    total = ls[-1]['t2'] - ls[0]['t0']
    share, span, count = collections.defaultdict(int), collections.defaultdict(int), collections.Counter()
    for k, l in enumerate(ls):
        nxt = ls[k + 1]['t0'] if k + 1 < len(ls) else l['t2']
        share[l['name']] += nxt - l['t0']
        span[l['name']] += l['t2'] - l['t0']
        count[l['name']] += 1
    print(f'GPU {dev}: {len(ls)} launches, {total / 1e6:.3f} ms')
    for name in sorted(share, key=lambda n: -share[n]):
        print(f'  {name:24s} {count[name]:5d}x  share {share[name] / 1e6:8.3f} ms  span {span[name] / 1e6:8.3f} ms'
              f'  ({us(span[name]) / count[name]:7.1f} us a launch)')
    for name in MEETS:
        ar = [l for l in ls if l['name'] == name]
        if ar:
            wait = [l['t1'] - l['t0'] for l in ar]
            summ = [l['t2'] - l['t1'] for l in ar]
            print(f'  {name}: wait median {us(statistics.median(wait)):.1f} us (max {us(max(wait)):.1f}),'
                  f' the rest median {us(statistics.median(summ)):.1f} us; {sum(wait) / 1e6:.3f} ms waiting in all')
    per_position(ls)


def per_position(ls):
    names = [l['name'] for l in ls]
    for period in range(4, 40):
        start = next((i for i in range(len(names) - 2 * period) if names[i:i + period] == names[i + period:i + 2 * period]), None)
        if start is not None:
            break
    else:
        return
    reps = (len(ls) - start) // period
    print(f'  a period of {period} launches from launch {start}, {reps} times (medians):')
    print('        (times from the end of the launch before, E: first block start, blocks started before E,'
          ' median release (the end of a block\'s wait), last block start, end = added; a block: release to end)')
    for j in range(period):
        added, block, first, early, release, last = [], [], [], [], [], []
        for r in range(reps):
            k = start + r * period + j
            if names[k] != names[start + j]:
                continue
            E = ls[k - 1]['t2']
            recs = ls[k]['recs']
            added.append(ls[k]['t2'] - E)
            block.append(statistics.median(ls[k]['blocks_rel_end']))
            first.append(ls[k]['t0'] - E)
            early.append(sum(1 for b in recs if b[0] < E))
            release.append(statistics.median(max(b[0], b[1]) - E for b in recs))
            last.append(max(b[0] for b in recs) - E)
        med = lambda v: us(statistics.median(v))
        print(f'    {j:3d} {names[start + j]:24s} added {med(added):7.1f} us  sum {sum(added) / 1e6:7.3f} ms'
              f'  a block {med(block):6.1f} us  ({ls[start + j]["blocks"]} blocks)')
        print(f'        first {med(first):7.1f}  early {statistics.median(early):5.0f}  release {med(release):6.1f}'
              f'  last start {med(last):6.1f}  end {med(added):6.1f} us')


def across(runs):
    ars = [[(k, l) for k, l in enumerate(ls) if l['name'] in MEETS] for _, ls in runs]
    n = min(len(a) for a in ars)
    if n == 0:
        return
    if len({len(a) for a in ars}) > 1:
        print(f'ranks ran {[len(a) for a in ars]} meeting kernels in the window; pairing the first {n}')
    off = [statistics.median(a[k][1]['t1'] - ars[0][k][1]['t1'] for k in range(n)) for a in ars]
    last = collections.Counter()
    skews, rows = [], []
    for k in range(n):
        arrive = [ars[r][k][1]['t0'] - off[r] for r in range(len(runs))]
        late = max(range(len(runs)), key=lambda r: arrive[r])
        last[late] += 1
        skews.append(max(arrive) - min(arrive))
        gemm = []
        for r in range(len(runs)):
            i, _ = ars[r][k]
            prev = runs[r][1][i - 1] if i > 0 else None
            gemm.append(f'{prev["name"]} {us(prev["t2"] - prev["t0"]):.1f}' if prev else '-')
        rows.append((k, late, skews[-1], gemm))
    print(f'{n} meeting kernels across {len(runs)} ranks: arrival skew median {us(statistics.median(skews)):.1f} us,'
          f' mean {us(statistics.mean(skews)):.1f}, total {sum(skews) / 1e6:.3f} ms; last to arrive: '
          + ', '.join(f'rank {r} {c}x' for r, c in sorted(last.items())))
    for k, late, skew, gemm in rows[:8]:
        print(f'  #{k}: rank {late} last by {us(skew):.1f} us; before it: ' + ' | '.join(gemm))


def main():
    args = sys.argv[1:]
    which = -1
    if '--pass' in args:
        i = args.index('--pass')
        which = int(args[i + 1])
        del args[i:i + 2]
    if not args:
        sys.exit(__doc__)
    runs = []
    for p in args:
        dev, ls = read(p)
        ls = window(ls, which)
        per_gpu(dev, ls)
        runs.append((dev, ls))
    if len(runs) > 1:
        across(runs)


if __name__ == '__main__':
    main()
