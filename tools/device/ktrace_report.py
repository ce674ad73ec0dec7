#!/usr/bin/env python3
"""Per-kernel device time per decode step from a ktrace CSV (tools/device/ktrace.c).

usage: ktrace_report.py TRACE.csv[.xz] [--steps N] [--marker k_embed] [--top N] [--timeline] [--gaps US] [--all]
                          [--vs OTHER.csv[.xz]] [--split GB_PER_STEP COPY_GBPS] [--overlap]

The trace is cut into forward passes at each launch of the marker kernel (the embedding
lookup starts every forward pass); the last N passes are the decode steps of a
`dsv4 bench --op-profile 0` run.  --all takes the whole trace as one step (a test binary,
opbench).  Prints, per kernel (and per copy kind): calls per step,
device time per step, mean time per call, its exposed time (the part of its records after every
earlier record had ended: these add up to the busy time, also when programmatic dependent launch
starts a kernel while its predecessor runs, which makes record times overlap), and the step's
span, busy time and idle gaps.  --gaps US adds the idle gaps longer than US microseconds per
step, summed by the record that ends them (where the device waits: a graph's first kernel, a copy
the host issues between steps).  --vs OTHER compares two traces (an A/B of two settings or two
builds, cut the same way): per kernel the exposed time per step of each, the difference
(OTHER minus TRACE) and the calls per step of each, largest differences first, then the two
steps' busy and span times.  --split GB COPY splits the exposed time into the kernels that stream
weights (the GEMVs, the MoE's expert kernels, the head) and the rest (hc, norms, attention, routing,
copies: the latency-bound chain), and with the step's weight bytes (GB, from `dsv4 bench`) and the copy
rate (GB/s) prints the weight kernels' rate and what the bar of 70 % of the copy rate leaves the rest.
--overlap: per kernel, how far its record starts before the records ahead of it have all ended (its head
start: the time programmatic dependent launch gives its blocks to run what precedes their wait, e.g. a
GEMV's first weight loads), as the mean head start a call, the share of its calls that had none, and the
kernel that ended last before it most often (the one whose tail it overlaps, or waits for), for every
kernel (--top 0 leaves the per-kernel time table out).
--layers PATTERN N: the decode steps cut into layers at every N-th launch of the kernel whose name contains
PATTERN (Flash: k_hc_dec 2, the attention's hc and the MoE's), layers grouped by their sequence of kernels
(the indexer's layers apart from the others), and per group each kernel's median start and end, in us from
the end of the layer's first launch, ordered by end, with the median end's lead over the row before: where a
layer's time goes on its critical path (the weight streams against the latency-bound links between them).
"""
import lzma, subprocess, sys, collections, statistics

def demangle(names):
    try:
        out = subprocess.run(["c++filt"], input="\n".join(names), capture_output=True, text=True).stdout.split("\n")
        return {n: out[i] for i, n in enumerate(names)}
    except OSError:
        return {n: n for n in names}

def short(d):
    # keep the template arguments (they name the kernel variant), drop the parameter list
    depth = 0
    for i, c in enumerate(d):
        if c == '<': depth += 1
        elif c == '>': depth -= 1
        elif c == '(' and depth == 0: return d[:i]
    return d

def load(path, steps, marker, whole):
    """the trace's records, the pass starts, the last `steps` passes' records, their span and busy
    time (ns), the per-label [calls, record time, exposed time] and the labelling function"""
    op = lzma.open if path.endswith(".xz") else open
    recs = []
    with op(path, "rt") as f:
        for line in f:
            p = line.rstrip("\n").split(",", 7)
            if len(p) < 8: continue
            recs.append((int(p[1]), int(p[2]), p[0], p[7], p[5], p[6], int(p[3])))
    recs.sort()
    if not recs: sys.exit("%s: no records" % path)
    names = sorted({r[3] for r in recs if r[2] == "K"})
    dm = demangle(names)
    label = lambda r: short(dm.get(r[3], r[3])) if r[2] == "K" else r[3] + ("" if r[2] == "S" else " %sB" % r[4] if int(r[4]) < 4096 else " >=4KB")
    starts = [0] if whole else [i for i, r in enumerate(recs) if r[2] == "K" and marker in dm.get(r[3], r[3])]
    if len(starts) < steps: sys.exit("%s: only %d passes start with %s" % (path, len(starts), marker))
    sel = recs[starts[-steps]:]
    span = sel[-1][1] - sel[0][0]
    busy = 0; last_end = sel[0][0]
    for r in sel:
        s = max(r[0], last_end)
        if r[1] > s: busy += r[1] - s
        last_end = max(last_end, r[1])
    # per label: calls, record time (start to end), exposed time (the part of the record after
    # every earlier record has ended: with programmatic dependent launch a kernel starts while its
    # predecessor runs and waits for it, so record times overlap; exposed times add up to the busy time)
    tot = collections.defaultdict(lambda: [0, 0, 0])
    last_end = sel[0][0]
    for r in sel:
        t = tot[label(r)]; t[0] += 1; t[1] += r[1] - r[0]
        t[2] += max(0, r[1] - max(r[0], last_end))
        last_end = max(last_end, r[1])
    return recs, starts, sel, span, busy, tot, label

def compare(a, b, pa, pb, steps, top):
    ta, tb = a[5], b[5]
    print("A = %s\nB = %s\n%d steps each" % (pa, pb, steps))
    print("A: span %.3f ms/step, busy %.3f; B: span %.3f, busy %.3f; B - A: span %+.3f, busy %+.3f ms/step"
          % (a[3] / steps / 1e6, a[4] / steps / 1e6, b[3] / steps / 1e6, b[4] / steps / 1e6,
             (b[3] - a[3]) / steps / 1e6, (b[4] - a[4]) / steps / 1e6))
    print("%-62s %11s %11s %10s %7s %7s" % ("kernel (exposed us/step)", "A", "B", "B - A", "calls A", "calls B"))
    keys = set(ta) | set(tb)
    get = lambda t, k, i: t[k][i] if k in t else 0
    rows = sorted(keys, key=lambda k: -abs(get(tb, k, 2) - get(ta, k, 2)))[:top]
    for k in rows:
        xa, xb = get(ta, k, 2) / steps / 1e3, get(tb, k, 2) / steps / 1e3
        print("%-62s %11.1f %11.1f %+10.1f %7.1f %7.1f" % (k[:62], xa, xb, xb - xa, get(ta, k, 0) / steps,
                                                         get(tb, k, 0) / steps))

# kernels whose time is a weight stream (split): the GEMVs, the MoE's expert kernels, the head's GEMV
WEIGHT_KERNELS = ("k_gemv", "k_moe_b1", "k_moe_bn", "k_moe_bulk", "k_moe_q8<", "k_moe_up", "k_moe_down", "k_linear")

def split(tot, steps, busy, gb, copy):
    w = sum(v[2] for k, v in tot.items() if k.startswith(("void ",)) and any(x in k for x in WEIGHT_KERNELS)
            or any(k.startswith(x) for x in WEIGHT_KERNELS))
    rest = busy - w
    print("split: weight-stream kernels %.1f us/step exposed, the rest (the latency-bound chain, copies) %.1f us/step"
          % (w / steps / 1e3, rest / steps / 1e3))
    if gb > 0 and copy > 0:
        rate = gb / (w / steps / 1e9) if w else 0.0
        bar = gb / (0.7 * copy) * 1e6  # us a step at 70 % of the copy rate
        print("  at %.3f GB a step the weight kernels stream at %.0f GB/s = %.1f %% of %.0f GB/s; the whole step at %.1f %%;"
              % (gb, rate, 100.0 * rate / copy, copy, 100.0 * gb / (busy / steps / 1e9) / copy))
        print("  70 %% of the copy rate is %.1f us a step: at this weight rate the rest would have to fit in %.1f us (it takes %.1f)"
              % (bar, bar - w / steps / 1e3, rest / steps / 1e3))

def overlap(sel, steps, label):
    """per label: calls, summed head start (ns), calls without one, and the labels that ended last before it"""
    st = collections.defaultdict(lambda: [0, 0, 0, collections.Counter()])
    last_end, last_lab = sel[0][0], None
    for r in sel:
        if r[2] == "K":
            t = st[label(r)]
            t[0] += 1
            h = last_end - r[0]
            if h > 0: t[1] += h
            else: t[2] += 1
            if last_lab: t[3][last_lab] += 1
        if r[1] > last_end: last_end, last_lab = r[1], label(r)
    print("head starts: per kernel, calls/step, mean us a call it started before every record ahead of it had ended,")
    print("the share of its calls with none, and the record ending last before it (most often)")
    for k, (n, h, z, who) in sorted(st.items(), key=lambda kv: -kv[1][1]):
        w = who.most_common(1)[0][0] if who else "-"
        print("  %-58s %6.1f %8.2f %5.0f %%  after %s" % (k[:58], n / steps, h / n / 1e3, 100.0 * z / n, w[:50]))

def layers(recs, starts, steps, label, pat, every):
    """per group of layers with one kernel sequence: each kernel's median start and end (us) from the end of
    the layer's first boundary launch, by end; a kernel's n-th launch in the layer is its own row (name #n).
    The boundaries are counted from each step's start, so a layer begins at the same launch in every step; the
    step's last layer runs to the next step's first boundary launch"""
    groups = collections.defaultdict(list)
    bnd = []  # per step, the boundary launches' record indices
    for k, s0 in enumerate(starts[-steps:]):
        s1 = starts[len(starts) - steps + k + 1] if k + 1 < steps else len(recs)
        bnd.append([i for i in range(s0, s1) if recs[i][2] == "K" and pat in label(recs[i])][::every])
    for k, b in enumerate(bnd):
        ends = b[1:] + (bnd[k + 1][:1] if k + 1 < steps else [])
        for a, e in zip(b, ends):
            lay = [r for r in recs[a:e + 1] if r[2] == "K"]  # through the next boundary (its end closes the layer)
            t0, seen, rows = lay[0][1], collections.Counter(), []
            for r in lay[1:]:
                lab = label(r)
                seen[lab] += 1
                rows.append(("%s #%d" % (lab, seen[lab]) if seen[lab] > 1 else lab, (r[0] - t0) / 1e3,
                             (r[1] - t0) / 1e3))
            groups[tuple(x[0] for x in rows)].append(rows)
    print("layers: cut every %d launches of %s; %d layers in %d steps, %d kinds" % (every, pat, sum(
        len(g) for g in groups.values()), steps, len(groups)))
    for sig, ls in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        cols = [(sig[i], statistics.median(l[i][1] for l in ls), statistics.median(l[i][2] for l in ls))
                for i in range(len(sig))]
        cols.sort(key=lambda c: c[2])
        print("  %d layers (%.1f a step), %d kernels; us from the end of the first %s:" % (len(ls), len(ls) / steps,
                                                                                          len(sig), pat))
        prev = 0.0
        for name, s0, e0 in cols:
            print("    %-56s start %7.1f  end %7.1f  %+6.1f" % (name[:56], s0, e0, e0 - prev))
            prev = e0

def main():
    a = sys.argv[1:]
    if not a or a[0].startswith("--"): sys.exit(__doc__.strip().split("\n")[2])
    path = a[0]; steps = 16; marker = "k_embed"; top = 60; timeline = False; whole = False; gap_us = None; vs = None
    split_args = None; ovl = False; lay = None
    i = 1
    while i < len(a):
        if a[i] == "--steps": steps = int(a[i + 1]); i += 2
        elif a[i] == "--marker": marker = a[i + 1]; i += 2
        elif a[i] == "--top": top = int(a[i + 1]); i += 2
        elif a[i] == "--timeline": timeline = True; i += 1
        elif a[i] == "--all": whole = True; steps = 1; i += 1
        elif a[i] == "--gaps": gap_us = float(a[i + 1]); i += 2
        elif a[i] == "--vs": vs = a[i + 1]; i += 2
        elif a[i] == "--split": split_args = (float(a[i + 1]), float(a[i + 2])); i += 3
        elif a[i] == "--overlap": ovl = True; i += 1
        elif a[i] == "--layers":
            if i + 2 >= len(a) or not a[i + 2].isdigit() or int(a[i + 2]) < 1:
                sys.exit("--layers needs a kernel name pattern and a count N >= 1 (e.g. --layers k_hc_dec 2)")
            lay = (a[i + 1], int(a[i + 2])); i += 3
        else: sys.exit("unknown argument " + a[i])
    if vs is not None:
        compare(load(path, steps, marker, whole), load(vs, steps, marker, whole), path, vs, steps, top)
        return
    recs, starts, sel, span, busy, tot, label = load(path, steps, marker, whole)
    ksum = sum(v[1] for v in tot.values())
    print("decode steps %d: span %.3f ms/step, device busy %.3f ms/step, idle %.3f ms/step; %d records/step; sum of record times %.3f ms/step"
          % (steps, span / steps / 1e6, busy / steps / 1e6, (span - busy) / steps / 1e6, len(sel) / steps, ksum / steps / 1e6))
    print("%-70s %8s %10s %9s %12s %6s" % ("kernel", "calls", "us/step", "us/call", "exposed/step", "%busy"))
    for k, (n, t, x) in sorted(tot.items(), key=lambda kv: -kv[1][2])[:top]:
        print("%-70s %8.1f %10.1f %9.2f %12.1f %6.1f" % (k[:70], n / steps, t / steps / 1e3, t / n / 1e3, x / steps / 1e3,
                                                       100.0 * x / busy if busy else 0.0))
    if split_args is not None:
        split(tot, steps, busy, split_args[0], split_args[1])
    if ovl:
        overlap(sel, steps, label)
    if lay is not None:
        layers(recs, starts, steps, label, lay[0], lay[1])
    if gap_us is not None:
        gaps = collections.defaultdict(lambda: [0, 0])
        last_end = sel[0][1]
        for r in sel[1:]:
            g = r[0] - last_end
            if g > gap_us * 1e3:
                t = gaps[label(r)]; t[0] += 1; t[1] += g
            last_end = max(last_end, r[1])
        print("idle gaps over %g us, by the record after them: count/step, us/step" % gap_us)
        for k, (n, t) in sorted(gaps.items(), key=lambda kv: -kv[1][1])[:top]:
            print("  %-68s %8.1f %10.1f" % (k[:68], n / steps, t / steps / 1e3))
    if timeline:
        one = recs[starts[-1]:]
        t0 = one[0][0]
        for r in one:
            print("%9.1f %8.2f %-60s %s %s" % ((r[0] - t0) / 1e3, (r[1] - r[0]) / 1e3, label(r)[:60], r[4], r[5]))

main()
