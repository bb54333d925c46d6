"""The rotation executor on a CPU: byte for byte after flips of images of any sizes, the aliasing
hazard it avoids, overlap by ring depth, refusals before anything moves, and no leak over cycles."""
from __future__ import annotations

import pytest
import torch

from residency.dataplane.flip.arena import WeightsArena
from residency.dataplane.flip.errors import FlipRefused, ReaderRefused
from residency.dataplane.flip.plan import plan_rotation
from residency.dataplane.flip.readers import ModuleReader, ParamsReader
from residency.dataplane.flip.rotation import RotationExecutor
from residency.dataplane.flip.slab import HostSlab
from residency.dataplane.pools.budget import PinnedBudget
from residency.dataplane.pools.errors import ChecksumMismatch
from residency.events.catalog import FlipCompleted
from residency.events.codec import decode_event, encode_event
from tests.dataplane.flip_helpers import image_of, packed

CHUNK = 1024
DEVICES = ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])


class Rig:
    """Model A in the arena, model B in the slab, a budget that counts every pinned byte."""

    def __init__(self, a_layers=3, a_hidden=24, b_layers=3, b_hidden=24, ring_depth=2, chunk=CHUNK,
                 slab_bytes=None, device="cpu"):
        self.a, self.ma = image_of(101, "a", a_layers, a_hidden)
        self.b, self.mb = image_of(202, "b", b_layers, b_hidden)
        self.budget = PinnedBudget(64 << 20, pin=device != "cpu")
        cap = slab_bytes or HostSlab.capacity_for([self.ma.nbytes, self.mb.nbytes], chunk, ring_depth)
        self.slab = HostSlab(self.budget, cap)
        self.arena = WeightsArena.sized_for([self.ma, self.mb], device)
        self.slab.store("A", self.ma, self.a, chunk_bytes=CHUNK)
        self.arena.load(self.slab)
        self.slab.store("B", self.mb, self.b, chunk_bytes=CHUNK)
        self.ex = RotationExecutor(self.arena, self.slab, chunk, ring_depth)
        self.bytes = {"A": packed(self.ma, self.a), "B": packed(self.mb, self.b)}

    def assert_holds(self, on_device: str, on_host: str):
        assert self.arena.image.model == on_device and self.slab.image.model == on_host
        assert torch.equal(self.arena.image_bytes().cpu(), self.bytes[on_device])
        assert torch.equal(self.slab.image_bytes(), self.bytes[on_host])


SIZES = {
    "equal": dict(),
    "outgoing_larger": dict(a_layers=5, a_hidden=31),
    "incoming_larger": dict(b_layers=6, b_hidden=29),
    "not_chunk_multiples": dict(a_layers=2, a_hidden=13, b_layers=4, b_hidden=9),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("ring_depth", [1, 2, 3])
@pytest.mark.parametrize("sizes", list(SIZES))
def test_a_flip_swaps_the_images_byte_for_byte(sizes, ring_depth, device):
    rig = Rig(ring_depth=ring_depth, device=device, **SIZES[sizes])
    if sizes == "not_chunk_multiples":
        assert rig.ma.nbytes % CHUNK and rig.mb.nbytes % CHUNK
    r = rig.ex.flip()
    assert r.checksum_ok and (r.from_model, r.to_model) == ("A", "B")
    assert (r.bytes_out, r.bytes_in) == (rig.ma.nbytes, rig.mb.nbytes)
    rig.assert_holds("B", "A")
    r = rig.ex.flip()
    assert r.checksum_ok and (r.bytes_out, r.bytes_in) == (rig.mb.nbytes, rig.ma.nbytes)
    rig.assert_holds("A", "B")
    rig.ex.check_integrity()


def naive_duplex(arena: torch.Tensor, host: torch.Tensor, nbytes: int, chunk: int, h2d_first: bool):
    """A literal in-place duplex: at each chunk the outgoing bytes go to the host range the incoming
    ones come from. Whichever copy a DMA engine happens to finish first, the other reads its output."""
    for lo in range(0, nbytes, chunk):
        dev, hst = arena[lo: lo + chunk], host[lo: lo + chunk]
        if h2d_first:
            dev.copy_(hst)
            hst.copy_(dev)
        else:
            hst.copy_(dev)
            dev.copy_(hst)


@pytest.mark.parametrize("h2d_first", [True, False])
def test_a_literal_duplex_in_place_corrupts_bytes_and_the_executor_does_not(h2d_first):
    rig = Rig()
    arena, host = rig.arena.buffer.clone(), rig.slab.bytes.clone()
    naive_duplex(arena, host, rig.ma.nbytes, CHUNK, h2d_first)
    a_out, b_in = host[: rig.ma.nbytes], arena[: rig.mb.nbytes]
    assert not (torch.equal(a_out, rig.bytes["A"]) and torch.equal(b_in, rig.bytes["B"]))
    # the flavour of the damage: one side ends up with two copies of the same image
    assert torch.equal(a_out, b_in)
    r = rig.ex.flip()
    assert r.checksum_ok
    rig.assert_holds("B", "A")


@pytest.mark.parametrize("device", DEVICES)
def test_a_ring_of_depth_one_never_overlaps_and_stays_byte_correct(device):
    rig = Rig(ring_depth=1, device=device)
    r = rig.ex.flip()
    assert r.overlapped_steps == 0 and r.steps > 3
    assert r.overlapped_steps_seen == (None if device == "cpu" else 0)
    rig.assert_holds("B", "A")


@pytest.mark.parametrize("device", DEVICES)
def test_a_deeper_ring_enqueues_each_outgoing_chunk_while_an_incoming_one_is_in_flight(device):
    rig = Rig(ring_depth=2, device=device)
    r = rig.ex.flip()
    # every step but the first has the previous step's H2D not yet retired
    assert r.overlapped_steps == r.steps - 1 > 0
    rig.assert_holds("B", "A")


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("sizes", ["outgoing_larger", "incoming_larger"])
def test_three_full_cycles_leave_host_and_device_memory_where_they_started(sizes, device):
    rig = Rig(device=device, **SIZES[sizes])
    rig.ex.flip()
    rig.ex.flip()                       # the first cycle warms what CUDA caches (streams, the checksum kernel)
    allocated = torch.cuda.memory_allocated() if device != "cpu" else None
    in_use, grants = rig.budget.in_use_bytes, [g.grant_id for g in rig.budget.grants()]
    arena_ptr, slab_ptr = rig.arena.buffer.data_ptr(), rig.slab.bytes.data_ptr()
    ids = (id(rig.arena.buffer), id(rig.slab.bytes))
    offset, gen = rig.slab.offset, rig.arena.gen
    for _ in range(3):
        assert rig.ex.flip().checksum_ok
        assert rig.ex.flip().checksum_ok
    assert rig.budget.in_use_bytes == in_use and [g.grant_id for g in rig.budget.grants()] == grants
    assert (rig.arena.buffer.data_ptr(), rig.slab.bytes.data_ptr()) == (arena_ptr, slab_ptr)
    assert (id(rig.arena.buffer), id(rig.slab.bytes)) == ids
    assert rig.slab.offset == offset and rig.arena.gen == gen + 6
    if device != "cpu":
        assert torch.cuda.memory_allocated() == allocated
    rig.assert_holds("A", "B")
    rig.budget.check_integrity()


@pytest.mark.parametrize("sizes", ["equal", "outgoing_larger", "not_chunk_multiples"])
def test_an_undersized_overshoot_is_refused_with_its_arithmetic_before_anything_moves(sizes):
    sized = Rig(**SIZES[sizes])
    ma, mb = sized.ma, sized.mb
    # B waits at slab offset 0, so A is written after a ring of 2 chunks: the slab must reach
    # past both images' ends: max(B, ring + A)
    need = max(mb.nbytes, 2 * CHUNK + ma.nbytes)
    rig = Rig(slab_bytes=need - 256, **SIZES[sizes])
    arena, host, gen = rig.arena.buffer.clone(), rig.slab.bytes.clone(), rig.arena.gen
    plan = rig.ex.plan()
    assert isinstance(plan, FlipRefused)
    assert (plan.asked_bytes, plan.available_bytes) == (need, need - 256)
    assert sum(plan.terms.values()) == need and plan.terms["incoming image"] == mb.nbytes
    if sizes == "outgoing_larger":
        assert plan.terms["size asymmetry"] == ma.nbytes - mb.nbytes and plan.terms["ring"] == 2 * CHUNK
    with pytest.raises(FlipRefused, match="host slab smaller"):
        rig.ex.flip()
    assert torch.equal(rig.arena.buffer, arena) and torch.equal(rig.slab.bytes, host)
    assert rig.arena.gen == gen and rig.arena.image.model == "A" and rig.slab.image.model == "B"


def test_a_corrupted_host_image_is_refused_by_checksum_before_anything_moves():
    rig = Rig()
    reader = ParamsReader.of_manifest("b-runner", rig.mb)
    rig.slab.image_bytes()[rig.mb.nbytes - 7] ^= 0x40
    arena, host = rig.arena.buffer.clone(), rig.slab.bytes.clone()
    with pytest.raises(ChecksumMismatch, match="host image B"):
        rig.ex.flip([reader])
    assert torch.equal(rig.arena.buffer, arena) and torch.equal(rig.slab.bytes, host)
    assert rig.arena.image.model == "A" and reader.gen is None


def test_a_flip_binds_the_incoming_models_readers_and_unbinds_the_outgoing_ones():
    torch.manual_seed(5)
    net_a = torch.nn.Sequential(torch.nn.Linear(16, 9), torch.nn.ReLU(), torch.nn.Linear(9, 4))
    net_b = torch.nn.Sequential(torch.nn.Linear(16, 33), torch.nn.GELU(), torch.nn.Linear(33, 4))
    wa = {n: torch.randn_like(p) for n, p in net_a.named_parameters()}
    wb = {n: torch.randn_like(p) for n, p in net_b.named_parameters()}
    budget = PinnedBudget(1 << 20, pin=False)
    slab = HostSlab.from_tensors(budget, "A", wa, overshoot_bytes=0, chunk_bytes=512)
    from residency.dataplane.flip.image import Manifest
    mb = Manifest.of_tensors(wb)
    arena = WeightsArena.sized_for([slab.image.manifest, mb])
    ra, rb = ModuleReader("a-runner", net_a), ModuleReader("b-runner", net_b)
    arena.load(slab, [ra])
    slab.close()
    slab = HostSlab(budget, HostSlab.capacity_for([arena.image.nbytes, mb.nbytes], 512, 2))
    slab.store("B", mb, wb, offset=0, chunk_bytes=512)
    ex = RotationExecutor(arena, slab, 512, 2)
    x = torch.randn(3, 16)
    with pytest.raises(ReaderRefused, match="a-runner"):
        ex.flip([ra])                                  # model A's runner cannot read model B
    assert ra.gen == arena.gen == 1 and slab.image.model == "B"
    r = ex.flip([rb])
    assert (r.from_gen, r.to_gen) == (1, 2) and rb.gen == 2 and ra.gen is None
    assert torch.equal(net_b(x), torch.func.functional_call(net_b, wb, (x,)))
    r = ex.flip([ra])
    assert ra.gen == 3 and rb.gen is None
    assert torch.equal(net_a(x), torch.func.functional_call(net_a, wa, (x,)))
    arena.check_integrity()


def test_the_result_fills_a_flip_completed_event():
    rig = Rig(**SIZES["incoming_larger"])
    t = iter([1_000, 5_000])
    rig.ex.clock_ns = lambda: next(t)
    r = rig.ex.flip()
    ev = r.to_event("flip-1")
    back = decode_event(encode_event(ev), "FlipCompleted")
    assert isinstance(back, FlipCompleted) and back == ev
    assert (ev.bytes_out, ev.bytes_in, ev.started_ns, ev.finished_ns) == (rig.ma.nbytes, rig.mb.nbytes, 1_000, 5_000)
    assert ev.overlapped_steps == r.overlapped_steps and ev.checksum_ok
    assert r.d2h_s > 0 and r.h2d_s > 0 and r.wall_s > 0


def test_the_plan_orders_chunks_so_each_write_lands_where_an_incoming_chunk_already_left():
    # forward: incoming at k*c, outgoing written from 0; reverse the other way round
    fwd = plan_rotation(5000, 3000, 2048, 1024, 2, 1 << 20, 1 << 20)
    rev = plan_rotation(5000, 3000, 0, 1024, 2, 1 << 20, 1 << 20)
    assert fwd.forward and [s.chunk for s in fwd.steps] == [0, 1, 2, 3, 4]
    assert not rev.forward and [s.chunk for s in rev.steps] == [4, 3, 2, 1, 0]
    assert [(s.out_bytes, s.in_bytes) for s in fwd.steps] == [(1024, 1024), (1024, 1024), (1024, 952),
                                                              (1024, 0), (904, 0)]
    assert (fwd.slab_need_bytes, rev.slab_need_bytes) == (2048 + 3000, 2048 + 5000)
    # an incoming image larger than the slab's free end: the ring before it is the overshoot
    short = plan_rotation(3000, 5000, 2048, 1024, 2, 7000, 1 << 20)
    assert isinstance(short, FlipRefused) and short.terms == {"ring": 2048, "incoming image": 5000}
    assert (short.asked_bytes, short.available_bytes) == (7048, 7000)
    odd = plan_rotation(5000, 3000, 512, 1024, 2, 1 << 20, 1 << 20)
    assert isinstance(odd, FlipRefused) and odd.available_bytes == 2048


def test_a_flip_that_fails_its_checksum_after_the_copies_binds_no_reader():
    rig = Rig()
    reader = ParamsReader.of_manifest("b-runner", rig.mb)
    rig.ex.copies.h2d = lambda dst, src, after: dst.copy_(src.flip(0))     # a copy engine that scrambles
    r = rig.ex.flip([reader], verify_before=True)
    assert not r.checksum_ok and r.to_gen is None and "arena image B" in r.mismatches[0]
    assert reader.gen is None and rig.arena.image is None
    assert not r.to_event("f").checksum_ok
    with pytest.raises(Exception, match="torn"):
        rig.ex.check_integrity()
