import random

from residency.control.report.bins import count_bins, make_edges, step_bins
from residency.control.report.collect import Changes, Times


def step_bins_ref(points, edges, initial=0):
    """Brute force: walk every bin, carry the value in, look at every change inside."""
    lo, hi, last = [], [], []
    for a, b in zip(edges[:-1], edges[1:]):
        carried = initial
        for t, v in points:
            if t <= a:
                carried = v
        vals = [carried] + [v for t, v in points if a < t <= b]
        lo.append(min(vals))
        hi.append(max(vals))
        last.append(vals[-1])
    return lo, hi, last


def test_binned_step_functions_keep_every_spike_and_dip_and_match_the_reference():
    rng = random.Random()
    for _ in range(20):
        t0 = rng.randrange(10**15)
        n = rng.randrange(1, 300)
        ts = sorted(t0 + rng.randrange(1, 10**6) for _ in range(n))
        points = [(t, rng.randrange(-50, 10**9)) for t in ts]
        ch = Changes()
        for t, v in points:
            ch.set(t, v)
        edges = make_edges(t0, ts[-1] + rng.randrange(0, 10**5), rng.randrange(1, 64))
        if rng.random() < 0.5:      # changes exactly on bin edges
            points = [(int(edges[rng.randrange(len(edges))]), v) for _, v in points]
            points.sort(key=lambda p: p[0])
            ch = Changes()
            for t, v in points:
                ch.set(t, v)
        lo, hi, last = step_bins(ch, edges)
        rlo, rhi, rlast = step_bins_ref(points, edges)
        assert (lo.tolist(), hi.tolist(), last.tolist()) == (rlo, rhi, rlast)


def test_counts_per_bin_add_up_to_every_event():
    rng = random.Random()
    t = Times()
    stamps = sorted(rng.randrange(10**12) for _ in range(rng.randrange(1, 5000)))
    t.ts.extend(stamps)
    counts = count_bins(t, make_edges(stamps[0], stamps[-1], rng.randrange(1, 500)))
    assert counts.sum() == len(stamps)
