"""A returning turn's Generate goes as soon as its restore is dispatched; the worker's prefill reads
each layer of the history as it lands (the real stack: control process, ledger, ZMQ, worker).

The tokens are those of a plain restore's turn, the ledger records the same moves, and a restore
that fails after the Generate went fails that turn cleanly: an error to the client, its pages
freed once, the session's next turn computed instead, the books adding up on replay."""
from __future__ import annotations

import time

import httpx

from residency.dataplane.moves.dma import TorchDma

from tests.serving.stack import Stack, stack  # noqa: F401 - the fixture

TURNS = ["a first question, long enough for pages", "then a second one", "and a third to close"]


def conversation(s: Stack, session: str) -> list[str]:
    """Three turns, the session parked to the host before each returning one."""
    convo, said = [], []
    for n, text in enumerate(TURNS):
        if n:
            assert s.client.post(f"/admin/sessions/{session}/park").status_code == 200
            assert s.session(session)["tier"] == "host"
        convo.append({"role": "user", "content": text})
        r = s.chat(convo, session=session, max_tokens=7)
        assert r.status_code == 200, r.text
        if n:
            assert r.json()["usage"]["restored_tokens"] > 0
        said.append(r.json()["choices"][0]["message"]["content"])
        convo.append({"role": "assistant", "content": said[-1]})
    return said


def moves_of(s: Stack, session: str) -> list[tuple]:
    events, _ = s.ledger()
    kind = {e.move_id: (e.kind, e.src, e.dst) for e in events if type(e).__name__ == "MoveRequested"
            and e.session == session}
    return [(*kind[e.move_id], type(e).__name__) for e in events
            if getattr(e, "move_id", None) in kind and type(e).__name__ in OUTCOMES]


OUTCOMES = ("MoveAcked", "MoveFailed", "MoveRejected", "MoveStranded", "MoveLateAcked", "MoveAbandoned")


class JoinedDma(TorchDma):
    """A link that carries a restore's layers only once a returning turn has joined them (on a
    tiny CPU model the copies would otherwise land before the Generate is read, and the turn
    would find its pages in place): every restore of these tests is read while it lands."""

    def __init__(self, loop):
        self.loop = loop

    def copy_runs_cols(self, stream, dst, src, runs, lo, hi):
        deadline = time.monotonic() + 10
        while not any(q.awaits for q in list(self.loop.seqs.values())) and time.monotonic() < deadline:
            time.sleep(0.001)
        super().copy_runs_cols(stream, dst, src, runs, lo, hi)


def joined(s: Stack) -> Stack:
    s.worker.core.mover.ctx.dma = JoinedDma(s.worker.core.serving)
    return s


def metric(s: Stack, needle: str) -> float | None:
    for line in s.client.get("/metrics").text.splitlines():
        if line.startswith(needle + " "):
            return float(line.split()[-1])
    return None


def test_a_pipelined_restore_answers_a_returning_turn_like_a_plain_one_with_the_same_moves(stack):
    plain, piped = stack(restore_policy="restore", pipelined=False), joined(stack(restore_policy="restore"))
    assert conversation(piped, "s") == conversation(plain, "s")
    assert moves_of(piped, "s") == moves_of(plain, "s") == [
        ("park", "device", "host", "MoveAcked"), ("restore", "host", "device", "MoveAcked")] * 2
    assert metric(piped, 'residency_restores_total{path="pipelined"}') == 2
    assert metric(plain, 'residency_restores_total{path="plain"}') == 2
    assert metric(piped, 'residency_restores_total{path="plain"}') is None
    # every step said its decode path (eager on CPU); the pipelined turns' waits were measured
    assert metric(piped, 'residency_serving_steps_total{path="eager"}') > 0
    assert metric(piped, "residency_restore_wait_seconds_count") >= 2
    assert metric(plain, "residency_restore_wait_seconds_count") == 0
    events, _ = piped.ledger()
    ready = [e for e in events if type(e).__name__ == "StepCompleted" and e.restore_wait_ns is not None]
    assert len(ready) >= 2 and all(e.restore_wait_ns >= 0 for e in ready)


def test_a_pipelined_restore_that_fails_fails_its_turn_cleanly_and_the_next_turn_recomputes(stack):
    s = joined(stack(restore_policy="restore"))
    convo = [{"role": "user", "content": TURNS[0]}]
    r = s.chat(convo, session="s", max_tokens=7)
    convo += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
              {"role": "user", "content": TURNS[1]}]
    assert s.client.post("/admin/sessions/s/park").status_code == 200
    host = s.worker.core.mover.host_pool
    bad = host.blocks()[0]
    host.words[host.slot_of(bad), 3] ^= 1 << 7            # a flipped bit in the parked copy
    r = s.chat(convo, session="s", max_tokens=7)
    assert r.status_code == 500, r.text
    assert "restore" in r.json()["error"]["message"] and f"block {bad}" in r.json()["error"]["message"]
    r2 = s.chat(convo, session="s", max_tokens=7)           # the prefix is given up: computed instead
    assert r2.status_code == 200, r2.text
    assert r2.json()["usage"]["restored_tokens"] == 0 and r2.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
    events, state = s.ledger()                             # replays clean (check_integrity)
    failed = [e for e in events if type(e).__name__ == "MoveFailed"]
    assert len(failed) == 1 and "block" in failed[0].error
    finished = [e for e in events if type(e).__name__ == "RequestFinished" and e.reason == "error"]
    # nothing computed from the unverified pages left the worker: not one token of the failed turn
    assert [e.completion_tokens for e in finished] == [0]
    freed = [b for e in events if type(e).__name__ == "BlocksFreed" for b in e.blocks]
    assert len(freed) == len(set(freed)), "a page freed twice"
    mover = s.worker.core.mover
    assert not mover.device_pool.table.reserved_blocks()
    assert state.workers[0].tiers["device"].used_bytes == mover.device_pool.used_bytes
    assert httpx.codes.is_success(s.client.get("/health").status_code)
