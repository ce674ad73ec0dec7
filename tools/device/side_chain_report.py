#!/usr/bin/env python3
"""side_chain_report.py TRACE.csv[.xz] [--steps N]: the indexer layers' side chain against the main chain in a
ktrace of decode steps (bench/cuda_device.sh ktab, docs/PERFORMANCE.md stop 50).

For each indexer layer of the last N steps (default 16; a step starts at k_embed), it finds the indexer's
scores kernel (k_indexer_*), the top-k after it, the attention's scores kernel after that (which waits for
both chains), and list 2: the last op list of >= 60 blocks before the attention. It prints, grouped by how
many pool kernels ran in the layer (0: no window closed; 2: both compressors emitted a row), the mean time
from list 2's end (the main chain's last kernel) to the top-k's end (the side chain's), and from the top-k's
end to the attention scores' end. A positive first figure is how long the attention waited for the side chain.
"""
import collections, lzma, sys

def main():
    a = sys.argv[1:]
    if not a or a[0].startswith("-"):
        sys.exit(__doc__)
    path, steps = a[0], 16
    if "--steps" in a:
        steps = int(a[a.index("--steps") + 1])
    op = lzma.open if path.endswith(".xz") else open
    recs = []
    with op(path, "rt") as f:
        for line in f:
            p = line.rstrip("\n").split(",", 7)
            if len(p) == 8:
                recs.append((int(p[1]), int(p[2]), p[7], p[5]))
    recs.sort()
    emb = [i for i, r in enumerate(recs) if "k_embed" in r[2]][-steps:]
    if not emb:
        sys.exit("%s: no k_embed records" % path)
    res = collections.defaultdict(list)
    for si, s0 in enumerate(emb):
        one = recs[s0:emb[si + 1] if si + 1 < len(emb) else len(recs)]
        for i, r in enumerate(one):
            if "k_indexer" not in r[2]:
                continue
            j = next((x for x in range(i, len(one)) if "k_topk" in one[x][2]), None)
            k = next((x for x in range(j or i, len(one)) if "k_attn_scores" in one[x][2]), None) if j else None
            if j is None or k is None:
                continue
            m = next((x for x in range(k, 0, -1) if "k_op_list" in one[x][2] and
                      int(one[x][3].split("x")[0]) >= 60), None)
            if m is None:
                continue
            pools = sum(1 for q in one[max(0, m - 15):k] if "pool" in q[2])
            res[pools].append(((one[j][1] - one[m][1]) / 1e3, (one[k][1] - one[j][1]) / 1e3))
    for pools, v in sorted(res.items()):
        n = len(v)
        print("pools %d: %d layer calls; top-k end - list 2 end %.2f us; attention scores end - top-k end %.2f us"
              % (pools, n, sum(x[0] for x in v) / n, sum(x[1] for x in v) / n))

main()
