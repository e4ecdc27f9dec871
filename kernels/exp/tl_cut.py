#!/usr/bin/env python3
"""Cuts one forward pass out of a timeline file (timeline.diff's PREFIX.gpuN.qtl)
into a small one that tl_analyze.py reads in seconds: the records whose blocks
began from the PASS'th embed launch's first block to the next one's.

    python3 tl_cut.py PREFIX.gpu0.qtl PASS.qtl 5

A `bench --synthetic` run fills its random weights first (fill_random: ~4 M
records for a 7B, hence QTOOL_TIMELINE_RECORDS=6000000), then prefills once
untimed and five times timed (passes 1..5), so pass 5 is its last timed
prefill. Needs numpy (the GPU machine has it).
"""
import struct
import sys

import numpy as np

d = open(sys.argv[1], 'rb').read()
if d[:4] != b'QTL1':
    sys.exit(f'{sys.argv[1]}: not a timeline file')
dev, n, counted = np.frombuffer(d, '<u8', 3, 4)
r = np.frombuffer(d, '<u8', int(n) * 8, 28).reshape(-1, 8)
names = r[:, :3].copy().view('S24')[:, 0]
first = {}  # each embed launch's (%gridid) first block start
for i in np.nonzero(np.char.startswith(names, b'embed'))[0]:
    g = int(r[i, 3])
    first[g] = min(first.get(g, 1 << 63), int(r[i, 5]))
starts = sorted(first.values())
p = int(sys.argv[3])
if p >= len(starts):
    sys.exit(f'{sys.argv[1]}: {len(starts)} embed launches, no pass {p} (records lost? {counted - n})')
a, b = starts[p], starts[p + 1] if p + 1 < len(starts) else 1 << 63
keep = (r[:, 5] >= a) & (r[:, 5] < b)
k = int(keep.sum())
with open(sys.argv[2], 'wb') as f:
    f.write(b'QTL1' + struct.pack('<3Q', int(dev), k, k) + r[keep].tobytes())
print(f'{sys.argv[1]}: pass {p}, {k} records, {len(starts)} embed launches')
