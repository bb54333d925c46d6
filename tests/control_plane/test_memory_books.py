"""The worker's memory books reach the ledger: grants made after Hello travel as PinnedChanged
and are recorded; a worker that never answers its memory probe is shown unknown, not zero."""
from __future__ import annotations

import json
import random

import pytest
import torch

from residency.dataplane.memory_books import MemoryBooks
from residency.dataplane.pools import PinnedBudget
from residency.events import catalog as ev
from residency.events.asks import AskMemory, MemoryAnswer
from residency.events.commands import Hello, MemoryReport, PinnedChanged, QueryMemory
from tests.control_plane.conftest import events_of, joined, wait_for


def test_grants_are_in_the_hello_snapshot_or_in_a_change_after_it_never_both():
    budget = PinnedBudget(1 << 24, pin=False)
    early = budget.alloc("ring", (4096,), torch.uint8)
    books = MemoryBooks(3, "cpu", budget, None)
    before = budget.alloc("index", (8192,), torch.uint8)          # made before Hello: in its snapshot
    fields = books.hello_fields()
    assert fields["pinned"] == {"ring": 4096, "index": 8192} and books.take_changes() == []
    grown = budget.alloc("index", (rng_size := random.Random(1).randrange(5000, 9000),), torch.uint8)
    before.close()
    assert books.take_changes() == [
        PinnedChanged(worker=3, owner="index", bytes=grown.footprint_bytes, registered=True),
        PinnedChanged(worker=3, owner="index", bytes=8192, registered=False)]
    assert books.take_changes() == [] and rng_size > 0
    early.close()
    grown.close()


def test_a_cpu_probe_reads_the_host_and_leaves_the_allocator_unknown():
    budget = PinnedBudget(1 << 20, pin=False)
    r = MemoryBooks(0, "cpu", budget, None).probe(7)
    assert r.nonce == 7 and r.device_total_bytes > r.device_free_bytes > 0
    assert r.allocator_allocated_bytes is None and r.allocator_reserved_bytes is None
    assert r.pinned_in_use_bytes == 0 and r.pinned_limit_bytes == 1 << 20


@pytest.fixture
def control(make_control, fake_worker, sqlite_url):
    proc, store = make_control(sqlite_url)
    fw = fake_worker()
    fw.send(Hello(worker=0, epoch=1, device="cpu", tiers=fw.tiers, block_bytes=fw.block_bytes,
                  pinned={"host-pool": 128 * fw.block_bytes}, device_owned={"weights": 12345},
                  model="m", pinned_limit_bytes=130 * fw.block_bytes))
    wait_for(lambda: joined(proc), what="worker joined")
    return proc, store, fw


def test_a_grant_changed_after_hello_is_recorded(control):
    proc, store, fw = control
    fw.send(PinnedChanged(worker=0, owner="index-d2h", bytes=8192, registered=True))
    fw.send(PinnedChanged(worker=0, owner="index-d2h", bytes=4096, registered=False))
    wait_for(lambda: len(events_of(store, ev.PinnedReleased)) == 1, what="the release recorded")
    assert [r.event.bytes for r in events_of(store, ev.PinnedRegistered)] == [128 * fw.block_bytes, 8192]
    assert proc.call(lambda p: dict(p.state.workers[0].pinned)).result(5) == {
        "host-pool": 128 * fw.block_bytes, "index-d2h": 4096}
    [w] = [r.event for r in events_of(store, ev.WorkerJoined)]
    assert w.device_owned == {"weights": 12345} and w.pinned_limit_bytes == 130 * fw.block_bytes
    [loaded] = [r.event for r in events_of(store, ev.WeightsLoaded)]
    assert (loaded.model, loaded.bytes, loaded.allocator_bytes) == ("m", 12345, None)


def test_a_worker_that_never_answers_its_probe_is_unknown_and_one_that_answers_is_shown(control):
    proc, store, fw = control
    silent = proc.submit(AskMemory(ask_id="a", probe_timeout_ms=200))
    q = fw.expect(QueryMemory)
    answer = silent.result(10)                 # the probe's time ran out: answered all the same
    assert isinstance(answer, MemoryAnswer)
    [w] = json.loads(answer.view)["workers"]
    assert w["probe"]["answered"] is False and w["probe"]["device_free_bytes"] is None
    assert w["tiers"]["device"]["tenants"]["weights"] == 12345
    spoken = proc.submit(AskMemory(ask_id="b", probe_timeout_ms=5000))
    q2 = fw.expect(QueryMemory)
    assert q2.nonce != q.nonce
    fw.send(MemoryReport(worker=0, nonce=q.nonce, device_free_bytes=1))       # a stale answer: ignored
    fw.send(MemoryReport(worker=0, nonce=q2.nonce, device_total_bytes=100, device_free_bytes=0))
    [w] = json.loads(spoken.result(10).view)["workers"]
    assert w["probe"]["answered"] is True and w["probe"]["device_free_bytes"] == 0
