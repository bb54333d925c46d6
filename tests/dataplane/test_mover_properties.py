"""Random command sequences: after every step the mover's invariants hold, its residency equals a
simple model's, every outcome is the one the model predicts, and every copy keeps its bytes."""
import tempfile

import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from residency.dataplane.moves.plan import FREES_SOURCE, ROUTES
from residency.dataplane.pools import DataPlaneError
from residency.events.catalog import MoveAcked, MoveRejected
from tests.dataplane.helpers_dataplane import LAYOUT, commit, make_mover, move, release, words_of

TIERS = ("device", "host", "disk")
CAP = {"device": 6, "host": 5, "disk": 6}
KINDS = ("spill", "evict", "park", "restore", "demote", "promote")
BB = LAYOUT.block_bytes

KIND_ROUTES = [(k, a, b) for k in KINDS for a in TIERS for b in TIERS]


def draw_step(data, where):
    """One command; moves and releases mostly name blocks that are where the route needs them."""
    op = data.draw(st.sampled_from(["commit", "move", "move", "move", "release", "again"]))
    if op == "commit":
        return ("commit", data.draw(st.sampled_from(TIERS)), data.draw(st.integers(1, 3)))
    if op == "again":
        return ("again", data.draw(st.integers(0, 50)))
    if op == "move":
        kind, src, dst = data.draw(st.sampled_from(
            [r for r in KIND_ROUTES if (r[1], r[2]) in ROUTES[r[0]]] * 8 + KIND_ROUTES))
    else:
        src = data.draw(st.sampled_from(TIERS))
    here = sorted(b for b, t in where.items() if src in t)
    pool = st.sampled_from(here) if here and data.draw(st.integers(0, 9)) < 8 else st.integers(0, 11)
    blocks = data.draw(st.lists(pool, max_size=4, unique=data.draw(st.booleans()) or not here))
    if op == "release":
        return ("release", src, blocks)
    return ("move", kind, src, dst, blocks, data.draw(st.booleans()))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_random_command_sequences_keep_every_invariant(draw):
    with tempfile.TemporaryDirectory() as d, make_mover(
            d, device_blocks=CAP["device"], host_blocks=CAP["host"], disk_blocks=CAP["disk"]) as e:
        where: dict[int, set[str]] = {}
        data: dict[int, torch.Tensor] = {}
        sent: list = []
        next_id = 0
        for _ in range(draw.draw(st.integers(1, 25))):
            s = draw_step(draw, where)
            if s[0] == "commit":
                _, tier, n = s
                ids = list(range(next_id, next_id + n))
                room = CAP[tier] - sum(tier in t for t in where.values())
                try:
                    got = commit(e, tier, ids)
                except DataPlaneError:
                    assert n > room
                else:
                    assert n <= room
                    next_id += n
                    data.update(got)
                    for b in ids:
                        where[b] = {tier}
            elif s[0] == "move":
                _, kind, src, dst, blocks, keep = s
                keep = keep and kind not in FREES_SOURCE
                cmd = move(kind, src, dst, blocks, keep_source=keep)
                sent.append(cmd)
                out = e.execute(cmd)
                room = CAP[dst] - sum(dst in t for t in where.values())
                ok = ((src, dst) in ROUTES[kind] and blocks and len(set(blocks)) == len(blocks)
                      and all(src in where.get(b, ()) for b in blocks)
                      and not any(dst in where.get(b, ()) for b in blocks) and len(blocks) <= room)
                assert isinstance(out, MoveAcked if ok else MoveRejected), (s, out)
                event(f"{kind} {src}->{dst}: {type(out).__name__}")
                if ok:
                    assert out.bytes_moved == len(blocks) * BB
                    assert out.bytes_freed_src == (0 if keep else len(blocks) * BB)
                    for b in blocks:
                        where[b].add(dst)
                        if not keep:
                            where[b].discard(src)
            elif s[0] == "release":
                _, tier, blocks = s
                ok = len(set(blocks)) == len(blocks) and all(tier in where.get(b, ()) for b in blocks)
                try:
                    rel = release(e, tier, blocks)
                except DataPlaneError:
                    assert not ok
                else:
                    assert ok and rel.bytes_freed == len(blocks) * BB
                    for b in blocks:
                        where[b].discard(tier)
            elif sent:
                cmd = sent[s[1] % len(sent)]
                before = e.usage()
                assert e.execute(cmd) is e.outcome_of(cmd.move_id)
                assert e.usage() == before
            e.check_integrity()
            for tier in TIERS:
                assert set(e.pool(tier).blocks()) == {b for b, t in where.items() if tier in t}, tier
        for b, tiers in where.items():
            for tier in tiers:
                assert torch.equal(words_of(e, tier, b), data[b]), (b, tier)
