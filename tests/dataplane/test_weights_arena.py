"""The weights arena and its host slab: images from tensors and safetensors files, checksums,
readers bound all or none, and a refit that stamps every reader with a new generation."""
from __future__ import annotations

import pytest
import torch

from residency.dataplane.flip.arena import WeightsArena
from residency.dataplane.flip.errors import FlipRefused, ReaderRefused
from residency.dataplane.flip.image import ALIGN_BYTES, Manifest, image_checksums, mismatched_chunks
from residency.dataplane.flip.readers import ModuleReader, ParamsReader, rebind_all
from residency.dataplane.flip.slab import HostSlab
from residency.dataplane.pools.budget import PinnedBudget
from residency.dataplane.pools.errors import ChecksumMismatch, IntegrityError, PinnedBudgetExceeded
from tests.dataplane.flip_helpers import image_of, packed, random_tensors, same_bytes

CHUNK = 1024


@pytest.fixture
def budget():
    b = PinnedBudget(64 << 20, pin=False)
    yield b
    b.check_integrity()


def test_every_tensor_starts_on_a_256_byte_boundary_in_the_given_order():
    tensors, m = image_of(1, "m", layers=3, hidden=19)
    assert [e.name for e in m.entries] == list(tensors)
    assert all(e.offset % ALIGN_BYTES == 0 for e in m.entries)
    assert m.nbytes % ALIGN_BYTES == 0 and m.nbytes >= m.entries[-1].offset + m.entries[-1].nbytes
    ends = [e.offset + e.nbytes for e in m.entries]
    assert all(end <= nxt.offset for end, nxt in zip(ends, m.entries[1:]))


def test_arena_views_of_a_loaded_state_dict_hold_its_bytes(budget):
    tensors, m = image_of(2, "m", layers=2, hidden=23)
    slab = HostSlab.from_tensors(budget, "m", tensors, chunk_bytes=CHUNK)
    arena = WeightsArena.sized_for([m])
    reader = ParamsReader.of_manifest("runner", m)
    stamps = arena.load(slab, [reader])
    assert stamps == {"runner": 1} and arena.gen == 1
    for name, t in tensors.items():
        assert same_bytes(reader.views[name], t)
        assert reader.views[name].untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()
    arena.verify()
    arena.check_integrity()
    slab.close()


def test_an_image_read_from_safetensors_files_matches_the_tensors(budget, tmp_path):
    from safetensors.torch import save_file

    t1 = random_tensors(3, [("a.w", (17, 9), torch.bfloat16), ("a.b", (9,), torch.float32)])
    t2 = random_tensors(4, [("b.w", (5, 31), torch.float16)])
    save_file(t1, str(tmp_path / "part1.safetensors"))
    save_file(t2, str(tmp_path / "part2.safetensors"))
    slab = HostSlab.from_safetensors(budget, "st", [str(tmp_path / "part1.safetensors"),
                                                    str(tmp_path / "part2.safetensors")], chunk_bytes=CHUNK)
    arena = WeightsArena.sized_for([slab.image.manifest])
    arena.load(slab)
    views = arena.views()
    for name, t in {**t1, **t2}.items():
        assert same_bytes(views[name], t), name
    slab.close()


def test_checksums_name_the_chunk_whose_byte_changed_and_catch_swapped_chunks():
    data = torch.randint(1, 256, (5 * CHUNK + 512,), dtype=torch.uint8)
    sums = image_checksums(data, CHUNK)
    assert len(sums.chunks) == 6
    one = data.clone()
    one[3 * CHUNK + 17] ^= 0x10
    assert [c for c, _, _ in mismatched_chunks(sums, image_checksums(one, CHUNK))] == [3]
    swapped = data.clone()
    swapped[:CHUNK], swapped[CHUNK: 2 * CHUNK] = data[CHUNK: 2 * CHUNK].clone(), data[:CHUNK].clone()
    assert [c for c, _, _ in mismatched_chunks(sums, image_checksums(swapped, CHUNK))] == [0, 1]
    assert image_checksums(swapped, CHUNK).total != sums.total


def test_a_host_image_failing_its_checksum_is_refused_before_anything_moves(budget):
    tensors, m = image_of(5, "m", layers=2, hidden=21)
    other, _ = image_of(6, "m", layers=2, hidden=21)
    slab = HostSlab.from_tensors(budget, "m", tensors, chunk_bytes=CHUNK)
    arena = WeightsArena.sized_for([m])
    reader = ParamsReader.of_manifest("runner", m)
    arena.load(slab, [reader])
    slab.store("m2", m, other, chunk_bytes=CHUNK)
    slab.bytes[m.nbytes // 2] ^= 0x01                      # one flipped bit on the host
    before = arena.buffer.clone()
    with pytest.raises(ChecksumMismatch, match="host image m2"):
        arena.load(slab, [reader])
    assert torch.equal(arena.buffer, before)
    assert arena.gen == 1 and reader.gen == 1 and arena.image.model == "m"
    with pytest.raises(ChecksumMismatch):
        arena.refit(slab)
    assert torch.equal(arena.buffer, before) and reader.gen == 1
    slab.close()


def test_a_reader_of_the_wrong_shape_refuses_to_bind_and_no_reader_is_rebound(budget):
    tensors, m = image_of(7, "m", layers=2, hidden=16)
    slab = HostSlab.from_tensors(budget, "m", tensors, chunk_bytes=CHUNK)
    arena = WeightsArena.sized_for([m])
    good = ParamsReader.of_manifest("good", m)
    arena.load(slab, [good])
    want = m.shapes()
    want["m.layers.1.proj"] = ((16, 20), "bfloat16")
    wrong = ParamsReader("wrong", want)
    before = arena.buffer.clone()
    with pytest.raises(ReaderRefused) as e:
        arena.load(slab, [good, wrong])
    assert set(e.value.refusals) == {"wrong"} and "m.layers.1.proj" in e.value.refusals["wrong"]
    assert good.gen == 1 and arena.gen == 1 and wrong.gen is None
    assert torch.equal(arena.buffer, before)
    arena.check_integrity()
    slab.close()


def test_a_refit_stamps_every_reader_and_the_model_reads_the_new_weights():
    torch.manual_seed(8)
    net = torch.nn.Sequential(torch.nn.Linear(12, 7), torch.nn.Tanh(), torch.nn.Linear(7, 5))
    first = {n: torch.randn_like(p) for n, p in net.named_parameters()}
    m = Manifest.of_tensors(first)
    arena = WeightsArena.sized_for([m])
    arena.buffer.zero_()
    m.pack(first, arena.buffer)
    module_reader, params_reader = ModuleReader("runner", net), ParamsReader.of_manifest("graph", m)
    arena.adopt("net", m, [module_reader, params_reader], chunk_bytes=CHUNK)
    x = torch.randn(4, 12)
    assert torch.allclose(net(x), torch.func.functional_call(net, first, (x,)))
    update = {n: torch.randn_like(p) for n, p in first.items()}
    stamps = arena.refit(update)
    assert stamps == {"runner": 2, "graph": 2} and arena.gen == 2
    assert torch.equal(net(x), torch.func.functional_call(net, update, (x,)))
    assert torch.equal(params_reader.views["0.weight"], update["0.weight"])
    arena.verify()
    arena.check_integrity()
    bad = dict(update)
    bad["2.bias"] = torch.randn(6)
    with pytest.raises(ValueError, match="2.bias"):
        arena.refit(bad)
    assert arena.gen == 2 and module_reader.gen == 2 and torch.equal(net[2].bias, update["2.bias"])


def test_a_reader_left_at_an_old_generation_fails_the_integrity_check(budget):
    tensors, m = image_of(9, "m", layers=1, hidden=8)
    arena = WeightsArena.sized_for([m])
    m.pack(tensors, arena.buffer)
    r = ParamsReader.of_manifest("runner", m)
    arena.adopt("m", m, [r], chunk_bytes=CHUNK)
    r.gen = 0
    with pytest.raises(IntegrityError, match="runner"):
        arena.check_integrity()


def test_an_image_larger_than_the_arena_is_refused_with_its_arithmetic(budget):
    tensors, m = image_of(10, "big", layers=3, hidden=24)
    slab = HostSlab.from_tensors(budget, "big", tensors, chunk_bytes=CHUNK)
    arena = WeightsArena(m.nbytes - 256)
    with pytest.raises(FlipRefused) as e:
        arena.load(slab)
    assert (e.value.asked_bytes, e.value.available_bytes) == (m.nbytes, m.nbytes - 256)
    assert arena.image is None and arena.gen == 0
    slab.close()


def test_a_slab_the_pinned_budget_cannot_fund_is_refused_and_nothing_is_held():
    b = PinnedBudget(8192, pin=False)
    tensors, m = image_of(11, "m", layers=2, hidden=40)
    with pytest.raises(PinnedBudgetExceeded):
        HostSlab.from_tensors(b, "m", tensors)
    assert b.in_use_bytes == 0


def test_the_slab_stores_an_image_byte_for_byte_with_zero_padding(budget):
    tensors, m = image_of(12, "m", layers=2, hidden=13)
    slab = HostSlab.from_tensors(budget, "m", tensors, overshoot_bytes=4096, chunk_bytes=CHUNK)
    assert torch.equal(slab.image_bytes(), packed(m, tensors))
    assert budget.in_use_bytes >= m.nbytes + 4096
    slab.close()
    assert budget.in_use_bytes == 0


def test_rebind_all_binds_no_reader_when_one_refuses():
    tensors, m = image_of(13, "m", layers=2, hidden=10)
    buf = torch.zeros(m.nbytes, dtype=torch.uint8)
    m.pack(tensors, buf)
    first, last = ParamsReader.of_manifest("first", m), ParamsReader("last", {"m.embed": ((1, 1), "bfloat16")})
    with pytest.raises(ReaderRefused) as e:
        rebind_all([first, last], m, m.views(buf), gen=4)
    assert list(e.value.refusals) == ["last"] and first.gen is None and first.views == {}
    assert rebind_all([first], m, m.views(buf), gen=4) == {"first": 4}
