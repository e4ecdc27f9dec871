#!/usr/bin/env python3
"""Checks the SASS of kernels (cuobjdump -sass output on stdin or in the
file named) for cp.async copies (LDGSTS) addressed through uniform
registers that no instruction of their function writes.

nvcc 13.0's ptxas emitted gemv_q8_w2a's ring refills (thirty-eighth
session, kernels/NOTES.md) as LDGSTS through UR0/UR1, which nothing set:
an illegal instruction at run time on some shapes and not others. build.sh
runs this on the sm_90 cubins of every build and fails it on such a copy.
It vets the compiler of the build machine only: the driver compiles the
PTX again at load time, with its own.

Control flow is not followed: a write under a predicate, or on another
path, counts. Destinations: the first operand of an instruction, both
halves for .64 and .WIDE forms, ELECT's second operand. desc[URn] needs
URn and URn+1. A copy through a register that only later instructions of
the listing write is reported as a warning (a block placed after its
use can still run before it). Prints one line a function with LDGSTS;
exits 1 if a copy goes through a register nothing writes, 2 with
--expect-copies when no function has a copy at all."""
import re
import sys


def writes(op, operands):
    """The uniform registers an instruction op writes."""
    out = set()
    ops = [o.strip() for o in operands.split(',')]
    dests = ops[1:2] if op.startswith('ELECT') else ops[:1]
    for d in dests:
        m = re.fullmatch(r'UR(\d+)', d)
        if m:
            n = int(m.group(1))
            out.add(n)
            if '.64' in op or '.WIDE' in op:
                out.add(n + 1)
    return out


def check(sass):
    """Returns (functions with LDGSTS, suspect copies), printing a line each."""
    funcs = suspect = 0
    for f in sass.split('Function : ')[1:]:
        name = f.split('\n')[0].strip()
        written, copies, pending = set(), 0, []
        for line in f.split('\n'):
            m = re.match(r'\s*/\*([0-9a-f]{4,})\*/\s+(.*?);', line)
            if not m:
                continue
            off = m.group(1)
            ins = re.sub(r'^@!?U?P\w+\s+', '', m.group(2).strip())  # the predicate
            op, _, operands = ins.partition(' ')
            if op.startswith('LDGSTS'):
                copies += 1
                need = {int(u) for u in re.findall(r'\bUR(\d+)\b', operands)}
                need |= {int(u) + 1 for u in re.findall(r'desc\[UR(\d+)\]', operands)}
                if need - written:
                    pending.append((off, ins, need - written))
                continue
            written |= writes(op, operands)
        if not copies:
            continue
        funcs += 1
        bad = [(o, i) for o, i, urs in pending if urs - written]  # written nowhere
        later = [(o, i) for o, i, urs in pending if not urs - written]
        suspect += len(bad)
        print(f'{name}: {copies} LDGSTS, {len(bad)} through a uniform register nothing writes')
        for o, i in bad[:4]:
            print(f'    /*{o}*/ {i}')
        for o, i in later[:2]:
            print(f'    warning: /*{o}*/ {i}: a register of it is written only later in the listing')
    return funcs, suspect


if __name__ == '__main__':
    args = [a for a in sys.argv[1:] if a != '--expect-copies']
    text = open(args[0]).read() if args else sys.stdin.read()
    funcs, suspect = check(text)
    if suspect:
        sys.exit(1)
    if funcs == 0 and '--expect-copies' in sys.argv:
        print('no function with LDGSTS: not the SASS expected')
        sys.exit(2)
