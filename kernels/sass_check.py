#!/usr/bin/env python3
"""Checks the SASS of kernels (cuobjdump -sass output on stdin or in the
file named) for cp.async copies (LDGSTS) addressed through uniform
registers that no instruction of their function writes.

nvcc 13.0's ptxas emitted gemv_q8_w2a's ring refills (thirty-eighth
session, kernels/NOTES.md) as LDGSTS through UR0/UR1, which nothing set:
an illegal instruction at run time on some shapes and not others. build.sh
runs this on the sm_90a cubin of every build and fails it on such a copy.
Prints one line a function with LDGSTS; exits 1 if any is suspect."""
import re
import sys


def check(sass):
    suspect = 0
    for f in sass.split('Function : ')[1:]:
        name = f.split('\n')[0].strip()
        written, copies = set(), []
        for line in f.split('\n'):
            m = re.match(r'\s*/\*([0-9a-f]{4,})\*/\s+(.*?);', line)
            if not m:
                continue
            off = m.group(1)
            ins = re.sub(r'^@!?U?P\w+\s+', '', m.group(2).strip())  # the predicate
            op, _, operands = ins.partition(' ')
            if op.startswith('LDGSTS'):
                copies.append((off, ins, [int(u) for u in re.findall(r'\bUR(\d+)\b', operands)]))
                continue
            d = re.match(r'\s*UR(\d+)\b', operands)  # a uniform destination
            if d:
                n = int(d.group(1))
                written.add(n)
                if '.64' in op:
                    written.add(n + 1)
        if not copies:
            continue
        bad = [(o, i) for o, i, urs in copies if any(u not in written for u in urs)]
        suspect += len(bad)
        print(f'{name}: {len(copies)} LDGSTS, {len(bad)} through a uniform register never written')
        for o, i in bad[:4]:
            print(f'    /*{o}*/ {i}')
    return suspect


if __name__ == '__main__':
    text = open(sys.argv[1]).read() if len(sys.argv) > 1 else sys.stdin.read()
    sys.exit(1 if check(text) else 0)
