#!/usr/bin/env python3
"""Medians of k_hc_dec's phase stamps (DSV4_CUDA_HC_STAMP=1, mhc.cu) by the kernel the call follows.

usage: hcstamp_report.py LOG [LOG ...] [--last N]

LOG is the stderr of a run with DSV4_CUDA_HC_STAMP=1 (e.g. `dsv4 bench ... 2> LOG`): the backend prints
one line a call, in time order, when it is freed.  A decode step's first hc call (layer 0's plain
hc_pre, POST 0) starts each step; after it the fused calls alternate: the one after wo_b (the MoE
half's hc_pre), then the one after the MoE's combine (the next layer's attention hc_pre), and so on.
For each kind the script prints the medians of the last N calls (default 200) of every column, in us
after block 0 passed its PDL wait: start (block 0's first instruction), the last block's wait, the last
block's partials stored, the finisher's sums done, pre formed, y done and normed (block 0's thread 0),
Sinkhorn done, and where the log has them, the last y thread's first value, its y and the last
thread's end.
"""
import re
import statistics
import sys

MAIN = re.compile(r'hc_stamp\s+(\d+):\s+(.*)\|\s*(\d+)\s+(\d+)\s*\|\s*([-\d.]+)')
EXTRA = re.compile(r"hc_stamp\s+(\d+)\+ last y thread's first value\s+([-\d.]+), its y\s+([-\d.]+), "
                   r"last thread's end\s+([-\d.]+)")
COLS = ['start', 'last wait', 'last partials', 'sums', 'pre', 'y', 'norm', 'sinkhorn']
XCOLS = ['first y value', 'y done (last)', 'end (last)']


def parse(path):
    rows, extra = [], {}
    with open(path, errors='replace') as f:
        for line in f:
            m = MAIN.match(line)
            if m:
                rows.append((int(m.group(1)), [float(x) for x in m.group(2).split()], int(m.group(3))))
                continue
            m = EXTRA.match(line)
            if m:
                extra[int(m.group(1))] = [float(m.group(i)) for i in (2, 3, 4)]
    return rows, extra


def report(path, last):
    rows, extra = parse(path)
    kinds = {'after wo_b': [], 'after combine': []}
    first = None
    for i, v, post in rows:
        if post == 0:
            first = i
            continue
        if first is None:
            continue
        kinds['after wo_b' if (i - first) % 2 else 'after combine'].append((v, extra.get(i)))
    print(path)
    if not rows:
        print('  no hc_stamp lines (was DSV4_CUDA_HC_STAMP=1 set, and k_hc_dec on its tagged-partials path?)')
        return
    for name, calls in kinds.items():
        calls = calls[-last:]
        if not calls:
            print('  %-14s no calls' % name)
            continue
        med = [statistics.median(v[j] for v, _ in calls) for j in range(len(COLS))]
        line = '  %-14s %4d calls: ' % (name, len(calls)) + ', '.join('%s %.2f' % c for c in zip(COLS, med))
        xs = [e for _, e in calls if e]
        if xs:
            xm = [statistics.median(e[j] for e in xs) for j in range(len(XCOLS))]
            line += ' | ' + ', '.join('%s %.2f' % c for c in zip(XCOLS, xm))
        print(line)


def main(argv):
    last, paths, i = 200, [], 0
    while i < len(argv):
        if argv[i] == '--last' and i + 1 < len(argv):
            last = int(argv[i + 1])
            i += 2
            continue
        if argv[i].startswith('-'):
            print(__doc__.strip().splitlines()[2], file=sys.stderr)
            return 2
        paths.append(argv[i])
        i += 1
    if not paths:
        print(__doc__.strip().splitlines()[2], file=sys.stderr)
        return 2
    for p in paths:
        report(p, last)
    return 0


if __name__ == '__main__':
    sys.exit(main(sys.argv[1:]))
