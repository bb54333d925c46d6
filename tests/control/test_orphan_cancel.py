"""A surviving worker still generating for a request no control process waits for (its control
was lost; recovery closed the request) is told, once, to cancel it; its last report frees the
pages. The control process's I/O (record, send) is replaced by lists: the edge of this unit."""
from __future__ import annotations

import random
import types

from residency.control.scheduler.streams import GenerationStreams
from residency.events import catalog as ev
from residency.events.commands import CancelGenerate, TokensGenerated


class Proc:
    def __init__(self, block_bytes: int):
        self.state = types.SimpleNamespace(workers={0: types.SimpleNamespace(block_bytes=block_bytes)})
        self.recorded, self.sent = [], []

    def record(self, event, correlation=None):
        self.recorded.append(event)

    def send_to_worker(self, worker, msg):
        self.sent.append((worker, msg))
        return True


def test_tokens_for_a_request_nobody_waits_for_cancel_it_once_and_its_pages_are_freed():
    rng = random.Random()
    bb = rng.randrange(1, 64) * 4096
    proc = Proc(bb)
    sched = types.SimpleNamespace(written=lambda *a: None)
    streams = GenerationStreams(proc, types.SimpleNamespace(sched=sched), types.SimpleNamespace(get=lambda rid: None),
                                admission=None, book=None)
    link = types.SimpleNamespace(worker=0)
    rid = f"req-{rng.randrange(1 << 40):x}"
    pages = rng.sample(range(1000), rng.randint(1, 5))
    for _ in range(rng.randint(2, 5)):
        streams.on_tokens(link, TokensGenerated(request_id=rid, worker=0, token_ids=[rng.randrange(1000)], text="x"))
    assert proc.sent == [(0, CancelGenerate(request_id=rid, reason="control_lost"))]
    streams.on_tokens(link, TokensGenerated(request_id=rid, worker=0, token_ids=[], text="", finish_reason="cancelled",
                                            blocks_freed=pages, bytes_freed=len(pages) * bb))
    assert proc.recorded == [ev.BlocksFreed(worker=0, tier="device", blocks=pages, bytes=len(pages) * bb,
                                            reason="orphaned")]
    assert not streams.orphans_cancelled and len(proc.sent) == 1


def test_an_adopted_workers_report_that_arrives_before_serving_is_ready_is_recorded_and_cancelled():
    """After a control restart the adopted worker may report written pages of an orphan before the
    serving scheduler exists (``sched`` is None): the pages are still recorded, the sequence cancelled."""
    rng = random.Random()
    bb = rng.randrange(1, 64) * 4096
    proc = Proc(bb)
    streams = GenerationStreams(proc, types.SimpleNamespace(sched=None), types.SimpleNamespace(get=lambda rid: None),
                                admission=None, book=None)
    rid = f"req-{rng.randrange(1 << 40):x}"
    pages = rng.sample(range(1000), rng.randint(1, 5))
    streams.on_tokens(types.SimpleNamespace(worker=0),
                      TokensGenerated(request_id=rid, worker=0, token_ids=[rng.randrange(1000)], text="x",
                                      blocks_written=pages, keys_written=[""] * len(pages)))
    assert [type(e) for e in proc.recorded] == [ev.BlocksCommitted] and proc.recorded[0].blocks == pages
    assert proc.sent == [(0, CancelGenerate(request_id=rid, reason="control_lost"))]
