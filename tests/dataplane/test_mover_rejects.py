"""Bad commands are refused with their reasons and arithmetic, and change nothing."""
import pytest

from residency.dataplane.pools import BlockBusy, NoRoom, NotResident
from residency.events.catalog import MoveRejected
from tests.dataplane.helpers_dataplane import LAYOUT, assert_same, commit, make_mover, move, release, snapshot

BB = LAYOUT.block_bytes


def rejected(mover, cmd) -> MoveRejected:
    before = snapshot(mover)
    out = mover.execute(cmd)
    assert isinstance(out, MoveRejected), out
    assert out.move_id == cmd.move_id and out.asked_bytes == len(cmd.blocks) * BB
    assert_same(snapshot(mover), before)
    mover.check_integrity()
    return out


def test_blocks_that_do_not_exist_are_named(mover):
    commit(mover, "device", [1])
    r = rejected(mover, move("spill", "device", "host", [1, 404, 405]))
    assert r.blocks == [404, 405] and "not resident on device" in r.reason


def test_blocks_not_resident_where_the_command_says(mover):
    commit(mover, "host", [3])
    r = rejected(mover, move("spill", "device", "host", [3]))
    assert r.blocks == [3]
    r = rejected(mover, move("restore", "disk", "device", [3]))
    assert r.blocks == [3] and "disk" in r.reason


@pytest.mark.parametrize("kind,src,dst", [
    ("restore", "device", "host"), ("demote", "device", "disk"), ("promote", "host", "device"),
    ("spill", "host", "device"), ("park", "disk", "host"), ("evict", "device", "device"),
])
def test_a_kind_that_does_not_move_src_to_dst_is_refused(mover, kind, src, dst):
    commit(mover, src if src != "disk" else "disk", [1])
    r = rejected(mover, move(kind, src, dst, [1], keep_source=False))
    assert r.reason.startswith("route:")


def test_evict_and_park_cannot_keep_their_source(mover):
    commit(mover, "device", [1])
    assert "keep_source=True" in rejected(mover, move("evict", "device", "host", [1], keep_source=True)).reason
    assert "keep_source=True" in rejected(mover, move("park", "device", "disk", [1], keep_source=True)).reason


def test_empty_and_duplicated_block_lists(mover):
    commit(mover, "device", [1, 2])
    assert "names no blocks" in rejected(mover, move("spill", "device", "host", [])).reason
    r = rejected(mover, move("spill", "device", "host", [1, 2, 1]))
    assert r.blocks == [1] and "more than once" in r.reason


def test_a_destination_without_room_is_refused_with_asked_and_available(tmp_path):
    with make_mover(tmp_path, host_blocks=4) as e:
        commit(e, "host", [100, 101])
        commit(e, "device", [1, 2, 3])
        r = rejected(e, move("spill", "device", "host", [1, 2, 3]))
        assert (r.asked_bytes, r.available_bytes) == (3 * BB, 2 * BB)
        assert f"asked {3 * BB} bytes, available {2 * BB} bytes" in r.reason
        assert "3 blocks" in r.reason and "2 free slots" in r.reason


def test_a_disk_without_room_is_refused_with_its_arithmetic(tmp_path):
    with make_mover(tmp_path, disk_blocks=2) as e:
        commit(e, "device", [1, 2, 3])
        r = rejected(e, move("spill", "device", "disk", [1, 2, 3]))
        assert (r.asked_bytes, r.available_bytes) == (3 * BB, 2 * BB)


def test_a_block_already_on_the_destination(mover):
    commit(mover, "device", [1])
    mover.execute(move("spill", "device", "host", [1]))
    r = rejected(mover, move("spill", "device", "host", [1]))
    assert r.blocks == [1] and "already on host" in r.reason


def test_a_past_deadline_is_refused_before_anything_moves(tmp_path):
    now = [10_000_000_000]
    with make_mover(tmp_path, clock=lambda: now[0]) as e:
        commit(e, "device", [1])
        r = rejected(e, move("spill", "device", "host", [1], deadline_ns=now[0] - 2_500_000))
        assert "deadline" in r.reason and "2.500 ms" in r.reason


def test_evicting_a_block_another_reader_holds_is_refused(mover):
    commit(mover, "device", [1, 2])
    mover.device_pool.incref([2])
    r = rejected(mover, move("evict", "device", "host", [1, 2]))
    assert r.blocks == [2] and "holders" in r.reason
    assert mover.execute(move("spill", "device", "host", [2])).bytes_freed_src == 0   # copying is fine


def test_release_is_all_or_nothing_and_names_what_is_missing(mover):
    commit(mover, "device", [1, 2])
    with pytest.raises(NotResident, match=r"blocks \[77\]"):
        release(mover, "device", [1, 77])
    assert mover.device_pool.has(1)


def test_commit_without_room_raises_with_arithmetic(tmp_path):
    with make_mover(tmp_path, device_blocks=3) as e:
        commit(e, "device", [1, 2])
        with pytest.raises(NoRoom, match=f"asked {2 * BB} bytes, available {BB} bytes"):
            commit(e, "device", [3, 4])
        assert not e.device_pool.has(3)


def test_blocks_in_a_move_in_flight_cannot_be_moved_or_released(mover):
    commit(mover, "device", [1, 2])
    ticket = mover.submit(move("evict", "device", "host", [1]))
    r = mover.execute(move("spill", "device", "disk", [1, 2]))
    assert isinstance(r, MoveRejected) and r.blocks == [1] and "busy" in r.reason
    with pytest.raises(BlockBusy):
        release(mover, "device", [1])
    mover.check_integrity()
    assert mover.wait(ticket).bytes_freed_src == BB


def test_check_integrity_catches_a_reservation_no_move_owns(mover):
    from residency.dataplane.pools import IntegrityError

    mover.device_pool.reserve([99])                     # a slot taken behind the mover's back
    with pytest.raises(IntegrityError, match=r"device: 1 reserved slots belong to no move in flight: \[99\]"):
        mover.check_integrity()
    mover.device_pool.cancel([99])
