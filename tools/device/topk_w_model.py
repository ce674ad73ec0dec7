#!/usr/bin/env python3
"""A line-by-line model of k_topk_w (src/backend/cuda/attn.cu), the block's threads run as loops, checked
against the top-k's contract: every entry whose key is above the k-th largest, then the lowest-index ties, in
ascending index order (the CPU op's choice; keys as tk_key: NaN largest, -0 == +0).  No GPU needed; it checks the
selection's logic (the three passes, the bin pick by one scan, the early stop, the runs' placement), not the CUDA.
Run after any change to k_topk_w: `python3 tools/device/topk_w_model.py` prints "ok N" or stops at the first case
that differs."""
import random
import struct

T = 1024  # TK_THREADS


def tk_key(f):
    u = struct.unpack('<I', struct.pack('<f', f))[0]
    if (u & 0x7fffffff) > 0x7f800000:
        return 0xffffffff
    if (u & 0x7fffffff) == 0:
        return 0x80000000
    return (~u) & 0xffffffff if u & 0x80000000 else u | 0x80000000


def contract(s, n, k):
    if n <= k:
        return list(range(n))
    order = sorted(range(n), key=lambda i: (-tk_key(s[i]), i))
    return sorted(order[:k])


def topk_w(s, n, k, per_max):
    if n <= k:  # tk_whole
        return list(range(n))
    per = (n + T - 1) // T
    assert per <= per_max
    cnt = [max(0, min(per, n - t * per)) for t in range(T)]
    key = [[tk_key(s[t * per + u]) if u < cnt[t] else 0 for u in range(per_max)] for t in range(T)]
    prefix, mask, need = 0, 0, k
    for p in range(3):
        sh, nb = (21, 10, 0)[p], 1024 if p == 2 else 2048
        hist = [0] * nb
        for t in range(T):  # each thread's run, equal neighbours merged into one add
            cur, run = -1, 0
            for u in range(per_max):
                dg = (key[t][u] >> sh) & (nb - 1) if u < cnt[t] and (key[t][u] & mask) == prefix else -1
                if dg >= 0 and dg == cur:
                    run += 1
                elif dg >= 0:
                    if run:
                        hist[cur] += run
                    cur, run = dg, 1
            if run:
                hist[cur] += run
        bpt, above, found = nb // T, 0, 0  # thread t: bins nb-1-t*bpt (and the one below); exclusive scan
        for t in range(T):
            top = nb - 1 - t * bpt
            c0, c1 = hist[top], hist[top - 1] if bpt == 2 else 0
            if above < need <= above + c0 + c1:
                found += 1
                in0 = need <= above + c0
                before = above if in0 else above + c0
                s_prefix = prefix | ((top if in0 else top - 1) << sh)
                s_need, s_done = need - before, before + (c0 if in0 else c1) == need
            above += c0 + c1
        assert found == 1
        prefix, need = s_prefix, s_need
        mask |= (nb - 1) << sh
        if s_done:
            break
    out = [None] * k
    g = e = 0  # the scan's exclusive counts of the runs before thread t
    for t in range(T):
        gg, ee = g, e
        for u in range(cnt[t]):
            km, i = key[t][u] & mask, t * per + u
            if km > prefix:
                out[gg + min(ee, need)] = i
                gg += 1
            elif km == prefix:
                if ee < need:
                    out[gg + ee] = i
                ee += 1
        g += sum(1 for u in range(cnt[t]) if key[t][u] & mask > prefix)
        e += sum(1 for u in range(cnt[t]) if key[t][u] & mask == prefix)
    assert None not in out
    return out


def main():
    random.seed(1)
    specials = [-0.0, 0.0, float('-inf'), float('inf'), float('nan'), 1e-40, -1e-40, 2.0]
    cases = 0
    for n in [513, 516, 1000, 2052, 4100, 8192, 8193, 8198, 12000, 16384]:
        for kind in range(5):
            for k in [512, 1024, 100, 1]:
                if k >= n:
                    continue
                if kind == 0:
                    s = [random.uniform(-3, 3) for _ in range(n)]
                elif kind == 1:
                    s = [float(random.randrange(5) - 2) for _ in range(n)]
                elif kind == 2:
                    s = [0.5] * n
                elif kind == 3:
                    s = [0.0 if random.randrange(3) else abs(random.gauss(0, 0.01)) for _ in range(n)]
                else:
                    s = [random.choice(specials) for _ in range(n)]
                got, want = topk_w(s, n, k, 8 if n <= 8192 else 16), contract(s, n, k)
                assert got == want, (n, kind, k)
                cases += 1
    print("ok", cases)


if __name__ == '__main__':
    main()
