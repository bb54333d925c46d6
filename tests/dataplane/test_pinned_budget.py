"""Every pinned allocation is registered with the budget before it is made; over budget is a
refusal with its arithmetic, and nothing is allocated."""
import pytest
import torch

import residency.dataplane.pools.budget as budget_mod
from residency.dataplane.mover import Mover
from residency.dataplane.pools import PinnedBudget, PinnedBudgetExceeded
from tests.dataplane.helpers_dataplane import LAYOUT


def test_a_refusal_carries_asked_available_limit_and_in_use():
    b = PinnedBudget(10_000, pin=False)
    b.register("host-pool", 6_000)
    with pytest.raises(PinnedBudgetExceeded) as e:
        b.register("staging-ring", 5_000)
    err = e.value
    assert (err.owner, err.asked_bytes, err.available_bytes, err.limit_bytes, err.in_use_bytes) == (
        "staging-ring", 5_000, 4_000, 10_000, 6_000)
    assert "asked 5000 bytes, available 4000 = limit 10000 - in use 6000" in str(err)
    assert b.in_use_bytes == 6_000 and [g.owner for g in b.grants()] == ["host-pool"]


def test_the_budget_refuses_before_any_memory_is_made(monkeypatch):
    made = []
    monkeypatch.setattr(budget_mod, "PinnedBuffer", lambda *a, **k: made.append(a) or pytest.fail("allocated"))
    b = PinnedBudget(4096 * 3, pin=False)
    with pytest.raises(PinnedBudgetExceeded):
        b.alloc("read-buffer", (4096,), torch.int32)           # 16 KiB > 12 KiB
    assert made == [] and b.in_use_bytes == 0


def test_allocations_count_page_rounded_bytes_and_close_gives_them_back():
    b = PinnedBudget(1 << 20, pin=False)
    buf = b.alloc("x", (3, 5), torch.int32)                    # 60 bytes -> one page
    assert buf.tensor.shape == (3, 5) and buf.footprint_bytes == 4096 and b.in_use_bytes == 4096
    assert buf.tensor.data_ptr() % 4096 == 0
    buf.close()
    assert b.in_use_bytes == 0


def test_a_buffer_dropped_without_close_is_unregistered_before_its_mapping_goes(monkeypatch):
    """The driver keeps a registration after munmap and the next mmap may get the same addresses:
    a forgotten buffer must unregister (and give its grant back) while it still holds the mapping."""
    import gc

    calls = []

    class FakeCudart:
        def cudaHostRegister(self, ptr, size, flags):
            calls.append(("register", ptr, size))
            return 0

        def cudaHostUnregister(self, ptr):
            calls.append(("unregister", ptr))
            return 0

    monkeypatch.setattr(torch.cuda, "cudart", lambda: FakeCudart())
    b = PinnedBudget(1 << 20, pin=True)
    buf = b.alloc("forgotten", (1024,), torch.int32)
    ptr = buf.tensor.data_ptr()
    kept = buf.close
    closed = b.alloc("closed", (1024,), torch.int32)
    closed.close()
    assert b.in_use_bytes == 4096 and calls[-1][0] == "unregister"
    del buf, kept
    gc.collect()
    assert ("unregister", ptr) in calls and b.in_use_bytes == 0
    assert sum(c[0] == "unregister" for c in calls) == 2      # close() does not unregister twice


def test_cpu_hosts_say_their_host_memory_is_not_pinned():
    if torch.cuda.is_available():
        pytest.skip("this host can pin")
    buf = PinnedBudget(1 << 16, pin=False).alloc("x", (16,), torch.int32)
    assert not buf.pinned and "pin_memory is unavailable" in buf.how


def test_a_mover_over_its_pinned_budget_is_refused_with_the_arithmetic(tmp_path):
    host_bytes = 8 * LAYOUT.block_bytes
    need = Mover.pinned_bytes_needed(LAYOUT, 6, host_bytes)
    with Mover(LAYOUT, 6, host_bytes, tmp_path, need, fsync=False) as e:
        assert e.pinned.in_use_bytes == need == e.pinned.limit_bytes
        e.check_integrity()
    assert e.pinned.in_use_bytes == 0                         # close gave every grant back
    with pytest.raises(PinnedBudgetExceeded) as err:
        Mover(LAYOUT, 6, host_bytes, tmp_path, need - 1, fsync=False)
    assert err.value.available_bytes == err.value.asked_bytes - 1
    assert f"limit {need - 1}" in str(err.value)


def test_the_host_pool_alone_over_budget_is_named(tmp_path):
    with pytest.raises(PinnedBudgetExceeded, match="refuses host-pool: asked 8192 bytes, available 4096"):
        Mover(LAYOUT, 6, 10 * LAYOUT.block_bytes, tmp_path, 4096, fsync=False)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinning needs CUDA")
def test_gpu_movers_really_pin_their_host_memory(tmp_path):
    from tests.dataplane.helpers_dataplane import make_mover

    with make_mover(tmp_path, device="cuda:0") as e:
        assert e.host_pool.pinned and e.host_pool.words.is_pinned() and e.ring.rows.is_pinned()
        assert all(g.bytes > 0 for g in e.pinned.grants())
