"""After a worker restart the disk index is rebuilt from the files and verified."""
import os

import torch

from residency.dataplane.pools import KVLayout
from residency.dataplane.pools.disk import HEADER_BYTES
from residency.events.catalog import MoveAcked
from tests.dataplane.helpers_dataplane import LAYOUT, commit, make_mover, move, words_of


def test_a_new_mover_on_the_same_directory_finds_and_restores_every_block(tmp_path, mover_device):
    with make_mover(tmp_path, device=mover_device) as first:
        data = commit(first, "device", [3, 14, 15, 92])
        first.execute(move("evict", "device", "disk", [3, 14, 15, 92]))
        sums = {b: first.disk_tier.checksum_of(b) for b in data}
    with make_mover(tmp_path, device=mover_device) as second:
        assert sorted(second.disk_report.indexed) == [3, 14, 15, 92]
        assert second.disk_report.quarantined == []
        assert {b: second.disk_tier.checksum_of(b) for b in data} == sums
        assert second.usage()["disk"] == 4 * LAYOUT.block_bytes
        assert isinstance(second.execute(move("restore", "disk", "device", [92, 3, 15, 14])), MoveAcked)
        for b in data:
            assert torch.equal(words_of(second, "device", b), data[b])
        second.check_integrity()


def test_restart_quarantines_bad_files_and_drops_temporaries(tmp_path):
    with make_mover(tmp_path) as first:
        commit(first, "device", [1, 2, 3, 4])
        first.execute(move("evict", "device", "disk", [1, 2, 3, 4]))
        d = first.disk_tier
        with open(d.path_of(2), "r+b") as f:           # payload bit rot: caught by re-hashing
            f.seek(HEADER_BYTES + 7)
            rotted = bytes([f.read(1)[0] ^ 0x10])      # a flipped bit (writing a fixed byte over random
            f.seek(HEADER_BYTES + 7)                   # data left it unchanged 1 time in 256)
            f.write(rotted)
        os.truncate(d.path_of(3), HEADER_BYTES + 5)     # torn file
        with open(os.path.join(d.directory, ".block-9.kv.tmp"), "wb") as f:   # never published
            f.write(b"half a block")
    with make_mover(tmp_path) as second:
        rep = second.disk_report
        assert sorted(rep.indexed) == [1, 4]
        reasons = dict(rep.quarantined)
        assert "fails its checksum" in reasons["block-2.kv"]
        assert "truncated" in reasons["block-3.kv"]
        assert rep.removed_temporaries == [".block-9.kv.tmp"]
        kept = sorted(n.split("-", 1)[1] for n in os.listdir(os.path.join(second.disk_tier.directory, "quarantine")))
        assert kept == ["block-2.kv", "block-3.kv"]
        second.check_integrity()


def test_the_quarantine_keeps_only_its_newest_files(tmp_path, monkeypatch):
    from residency.dataplane.pools import disk
    monkeypatch.setattr(disk, "QUARANTINE_KEEP", 3)
    other = KVLayout(num_layers=3, page_tokens=5, num_kv_heads=2, head_dim=6, dtype=torch.float16)
    for round_ in range(3):           # each restart under another layout quarantines two files
        with make_mover(tmp_path, layout=other if round_ % 2 == 0 else LAYOUT) as e:
            commit(e, "disk", [10 * round_ + 1, 10 * round_ + 2])
    with make_mover(tmp_path, layout=other) as last:
        names = os.listdir(os.path.join(last.disk_tier.directory, "quarantine"))
    # rounds 1 and 2 quarantined 1, 2 then 11, 12; the oldest (1) went
    assert sorted(n.split("-", 1)[1] for n in names) == ["block-11.kv", "block-12.kv", "block-2.kv"]


def test_files_of_another_layout_are_not_loaded(tmp_path):
    with make_mover(tmp_path) as first:
        commit(first, "disk", [5])
    other = KVLayout(num_layers=3, page_tokens=5, num_kv_heads=2, head_dim=6, dtype=torch.float16)
    with make_mover(tmp_path, layout=other) as second:
        assert second.disk_report.indexed == []
        assert "another layout" in dict(second.disk_report.quarantined)["block-5.kv"]


def test_a_worker_offers_the_files_it_found_and_deletes_those_the_control_does_not_claim(tmp_path):
    from residency.dataplane.worker import WorkerCore
    from residency.events.commands import ClaimDisk, DiskClaimed
    with make_mover(tmp_path) as first:
        data = commit(first, "device", [3, 4, 5])
        first.execute(move("evict", "device", "disk", [3, 4, 5]))
    with make_mover(tmp_path) as second:
        core = WorkerCore(second, 0)
        assert core.unclaimed_disk == [3, 4, 5]
        out = core.run(ClaimDisk(keep=[4, 99]))        # 99: the ledger's, but no file: not kept
        assert out == [DiskClaimed(worker=0, kept=[4], dropped=[3, 5], bytes_dropped=2 * LAYOUT.block_bytes)]
        assert second.disk_tier.blocks() == [4] and core.unclaimed_disk == []
        assert sorted(os.listdir(second.disk_tier.directory)) == ["block-4.kv"]
        assert isinstance(second.execute(move("restore", "disk", "device", [4])), MoveAcked)
        assert torch.equal(words_of(second, "device", 4), data[4])
        assert core.run(ClaimDisk(keep=[])) == [DiskClaimed(worker=0, kept=[], dropped=[], bytes_dropped=0)]


def test_kv_files_on_disk_are_readable_only_by_their_owner(tmp_path):
    # KV bytes are what was served; the umask of whoever started the server must not widen that
    old = os.umask(0o022)
    try:
        with make_mover(tmp_path / "disk") as mover:
            commit(mover, "device", [5, 8])
            mover.execute(move("evict", "device", "disk", [5, 8]))
            paths = [mover.disk_tier.path_of(b) for b in (5, 8)]
            modes = [os.stat(p).st_mode & 0o777 for p in paths]
    finally:
        os.umask(old)
    assert modes == [0o600, 0o600]
    assert os.stat(tmp_path / "disk").st_mode & 0o777 == 0o700
