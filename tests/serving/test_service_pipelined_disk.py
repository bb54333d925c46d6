"""Pipelined restores from disk and into a shared prefix, through the real stack (control process,
ledger, ZMQ, worker): the Generate goes as soon as the restore is dispatched, the worker reads a
band of layers of every spill file at a time and the prefill reads each layer as it lands.

The tokens are those of a plain restore's turn and of a turn that computed its history; a spill
file with flipped bytes fails its turn cleanly (an error naming the restore, not one token, its
pages freed once, nothing published) and the next turn computes instead."""
from __future__ import annotations

import random
import time

from residency.dataplane.pools.disk import HEADER_BYTES
from tests.serving.stack import Stack, stack  # noqa: F401 - the fixture
from tests.serving.test_service_pipelined_restore import JoinedDma, metric, moves_of
from tests.serving.test_service_sharing import SYSTEM

TURNS = ["a first question, long enough for pages", "then a second one", "and a third to close"]


class JoinedDiskDma(JoinedDma):
    """``JoinedDma`` for the reads from disk too: a band crosses once a returning turn joined it."""

    def copy_rows_to_cols(self, stream, dst, src, runs, lo):
        deadline = time.monotonic() + 10
        while not any(q.awaits for q in list(self.loop.seqs.values())) and time.monotonic() < deadline:
            time.sleep(0.001)
        super().copy_rows_to_cols(stream, dst, src, runs, lo)


def joined(s: Stack) -> Stack:
    mover = s.worker.core.mover
    mover.ctx.dma = JoinedDiskDma(s.worker.core.serving)
    mover.ctx.disk_read_bytes = 1          # a band per layer: the tiny model's layers are small
    return s


def poison_free_slots(s: Stack) -> None:
    """NaN in every free slot of the worker's pool (it is idle between requests): a page read before
    its bytes landed, or a copy never made, could not give the same tokens."""
    pool = s.worker.core.mover.device_pool
    taken = set(pool.slots_of(pool.blocks()))
    pool.tensor[[i for i in range(pool.num_slots) if i not in taken]] = float("nan")


def from_disk(s: Stack, session: str, restored: bool = True) -> list[str]:
    """Three turns, the session parked to disk before each returning one."""
    convo, said = [], []
    for n, text in enumerate(TURNS):
        if n:
            assert s.client.post(f"/admin/sessions/{session}/park", json={"tier": "disk"}).status_code == 200
            assert s.session(session)["tier"] == "disk"
            poison_free_slots(s)
        convo.append({"role": "user", "content": text})
        r = s.chat(convo, session=session, max_tokens=7)
        assert r.status_code == 200, r.text
        if n:
            assert (r.json()["usage"]["restored_tokens"] > 0) == restored
        said.append(r.json()["choices"][0]["message"]["content"])
        convo.append({"role": "assistant", "content": said[-1]})
    return said


def test_a_session_parked_to_disk_is_restored_pipelined_with_the_tokens_of_a_plain_restore(stack):
    piped = joined(stack(restore_policy="restore"))
    plain = stack(restore_policy="restore", pipelined=False)
    computed = stack(restore_policy="recompute")
    said = from_disk(piped, "s")
    assert said == from_disk(plain, "s") == from_disk(computed, "s", restored=False)
    assert moves_of(piped, "s") == moves_of(plain, "s") == [          # parked to the host, then demoted
        ("park", "device", "host", "MoveAcked"), ("demote", "host", "disk", "MoveAcked"),
        ("restore", "disk", "device", "MoveAcked")] * 2
    assert metric(piped, 'residency_restores_total{path="pipelined"}') == 2
    assert metric(piped, 'residency_restores_total{path="plain"}') is None
    assert metric(plain, 'residency_restores_total{path="plain"}') == 2
    events, _ = piped.ledger()
    read_landing = [e for e in events if type(e).__name__ == "StepCompleted" and e.restore_wait_ns is not None]
    assert len(read_landing) >= 2                    # each returning turn's prefill read pages as they landed
    assert not piped.worker.core.mover.device_pool.table.reserved_blocks()


def flip_a_byte(s: Stack, bad: int | None = None) -> int:
    """A flipped bit in the payload of one of the worker's spill files (``bad``'s, else a random
    one's); the block."""
    disk = s.worker.core.mover.disk_tier
    bad = random.choice(disk.blocks()) if bad is None else bad
    with open(disk.path_of(bad), "r+b") as f:
        at = HEADER_BYTES + random.randrange(disk.block_bytes)
        f.seek(at)
        was = f.read(1)[0]
        f.seek(at)
        f.write(bytes([was ^ (1 << random.randrange(8))]))
    return bad


def test_a_corrupted_spill_file_fails_its_pipelined_turn_cleanly_and_the_next_turn_recomputes(stack):
    s = joined(stack(restore_policy="restore"))
    convo = [{"role": "user", "content": TURNS[0]}]
    r = s.chat(convo, session="s", max_tokens=7)
    convo += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
              {"role": "user", "content": TURNS[1]}]
    assert s.client.post("/admin/sessions/s/park", json={"tier": "disk"}).status_code == 200
    bad = flip_a_byte(s)
    r = s.chat(convo, session="s", max_tokens=7)
    assert r.status_code == 500, r.text
    message = r.json()["error"]["message"]
    assert "restore" in message and f"block {bad}" in message
    assert metric(s, 'residency_restores_total{path="pipelined"}') == 1
    r2 = s.chat(convo, session="s", max_tokens=7)           # the prefix is given up: computed instead
    assert r2.status_code == 200, r2.text
    assert r2.json()["usage"]["restored_tokens"] == 0
    events, state = s.ledger()                             # replays clean (check_integrity)
    failed = [e for e in events if type(e).__name__ == "MoveFailed"]
    assert len(failed) == 1 and f"block {bad}" in failed[0].error
    finished = [e for e in events if type(e).__name__ == "RequestFinished" and e.reason == "error"]
    assert [e.completion_tokens for e in finished] == [0]   # not one token of the failed turn left
    freed = [b for e in events if type(e).__name__ == "BlocksFreed" for b in e.blocks]
    assert len(freed) == len(set(freed)), "a page freed twice"
    mover = s.worker.core.mover
    assert not mover.device_pool.table.reserved_blocks()    # the restore's slots given back
    assert bad not in mover.device_pool.blocks()           # nothing of the failed restore was published
    assert state.workers[0].tiers["device"].used_bytes == mover.device_pool.used_bytes


def donor_parked_to_disk(stack):
    """Session a (the donor) answered on a sharing stack and on one without sharing, then parked
    to disk on the first. -> (sharing stack, the other, b's question that opens as a's did)."""
    s = joined(stack(device_blocks=160, restore_policy="restore"))
    off = stack(share_prefixes=False, device_blocks=160)
    ask_b = [SYSTEM, {"role": "user", "content": "second question"}]
    for st in (s, off):
        st.chat([SYSTEM, {"role": "user", "content": "first question"}], session="a", max_tokens=4)
    assert s.client.post("/admin/sessions/a/park", json={"tier": "disk"}).status_code == 200
    return s, off, ask_b


def test_a_parked_donors_shared_prefix_is_restored_pipelined_for_a_copy_and_for_a_reader_in_place(stack):
    s, off, ask_b = donor_parked_to_disk(stack)
    poison_free_slots(s)
    b = s.chat(ask_b, session="b", max_tokens=8).json()           # a session's turn: copies a's pages
    opening = len("<system>" + SYSTEM["content"] + "<user>") // P_TOKENS * P_TOKENS
    assert b["usage"]["shared_tokens"] == b["usage"]["restored_tokens"] == opening
    assert b["choices"] == off.chat(ask_b, session="b", max_tokens=8).json()["choices"]
    assert metric(s, 'residency_restores_total{path="pipelined"}') == 1
    # both parked: a request outside a session reads a donor's pages in place, restored as it reads
    for who, tier in (("a", "host"), ("b", "disk")):
        assert s.client.post(f"/admin/sessions/{who}/park", json={"tier": tier}).status_code == 200
    poison_free_slots(s)
    ask_c = [SYSTEM, {"role": "user", "content": "third question"}]
    lone = s.chat(ask_c, max_tokens=8).json()
    assert lone["usage"]["shared_tokens"] > 0 and lone["usage"]["restored_tokens"] > 0
    assert lone["choices"] == off.chat(ask_c, max_tokens=8).json()["choices"]
    assert metric(s, 'residency_restores_total{path="pipelined"}') == 2
    assert metric(s, 'residency_restores_total{path="plain"}') is None
    events, _ = s.ledger()
    adm = [e for e in events if type(e).__name__ == "RequestAdmitted" and e.shared_tokens]
    assert [(e.session, e.copied) for e in adm] == [("b", True), (None, False)]
    assert not s.worker.core.mover.device_pool.table.reserved_blocks()


P_TOKENS = 4     # tests.serving.stack.P


def test_a_donors_corrupted_spill_file_fails_the_sharing_turn_and_the_donor_gives_up_those_pages(stack):
    s, off, ask_b = donor_parked_to_disk(stack)
    bad = flip_a_byte(s, sorted(s.worker.core.mover.disk_tier.blocks())[0])   # a's first page: in b's prefix
    r = s.chat(ask_b, session="b", max_tokens=8)
    assert r.status_code == 500 and f"block {bad}" in r.json()["error"]["message"], r.text
    again = s.chat(ask_b, session="b", max_tokens=8)      # nothing of a's broken prefix is offered again
    assert again.status_code == 200, again.text
    assert again.json()["usage"]["shared_tokens"] == again.json()["usage"]["restored_tokens"] == 0
    assert again.json()["choices"] == off.chat(ask_b, session="b", max_tokens=8).json()["choices"]
    events, state = s.ledger()                             # replays clean
    assert len([e for e in events if type(e).__name__ == "MoveFailed"]) == 1
    assert bad not in state.blocks[0], "the donor's broken page is given up"
    freed = [b for e in events if type(e).__name__ == "BlocksFreed" for b in e.blocks]
    assert len(freed) == len(set(freed)), "a page freed twice"
    mover = s.worker.core.mover
    assert not mover.device_pool.table.reserved_blocks()
    assert state.workers[0].tiers["device"].used_bytes == mover.device_pool.used_bytes
