"""Events and messages: round trips, upcasting, and named errors for malformed input."""
from __future__ import annotations

import json
import random

import msgspec
import pytest

from residency.events import (
    EVENT_TYPES,
    DecodeError,
    decode_event,
    decode_message,
    encode_event,
    encode_message,
    event_from_json_obj,
    event_to_json_obj,
)
from residency.events import catalog as ev
from residency.events.codec import decode_packed
from residency.events.commands import ExecuteMove, Ping


def _random_event(rng: random.Random) -> ev.Event:
    n = rng.randint(1, 9)
    return ev.MoveRequested(
        move_id=f"m-{rng.getrandbits(40):x}", kind=rng.choice(ev.MOVE_KINDS), worker=rng.randint(0, 7),
        src="device", dst=rng.choice(["host", "disk"]), blocks=[rng.getrandbits(31) for _ in range(n)],
        bytes_planned=rng.getrandbits(40), keep_source=rng.random() < 0.5, deadline_ns=rng.getrandbits(62),
        reason=rng.choice(["pressure", "idle", "operator"]), session=rng.choice([None, f"s{rng.getrandbits(20)}"]),
    )


def test_every_event_type_is_in_the_union_with_a_unique_tag():
    assert len(EVENT_TYPES) == len(set(EVENT_TYPES))
    for name, cls in EVENT_TYPES.items():
        assert cls.__struct_config__.tag == name


def test_msgpack_and_json_round_trip_random_events():
    rng = random.Random()
    for _ in range(200):
        e = _random_event(rng)
        assert decode_event(encode_event(e), "MoveRequested", 1) == e
        assert event_from_json_obj(event_to_json_obj(e)) == e


def test_a_payload_stored_under_blocks_freed_v1_is_upcast_to_v2():
    blocks = [random.getrandbits(30) for _ in range(5)]
    v1 = msgspec.msgpack.encode(["BlocksFreed", 3, blocks, 5 * 4096, "finished"])
    e = decode_event(v1, "BlocksFreed", 1)
    assert e == ev.BlocksFreed(worker=3, tier="device", blocks=blocks, bytes=5 * 4096, reason="finished")
    assert ev.BlocksFreed.SCHEMA_VERSION == 2


def test_a_group_diverged_row_written_before_ballots_reads_as_caught_after_its_step():
    rng = random.Random()
    digests = {str(w): f"{rng.getrandbits(64):016x}" for w in range(3)}
    old = msgspec.msgpack.encode(["GroupDiverged", "tp0", 41, digests])
    e = decode_event(old, "GroupDiverged", 1)
    assert e == ev.GroupDiverged(group="tp0", step=41, digests_by_rank=digests)
    assert (e.caught_by, e.round, e.request_id) == ("step", None, "")
    new = ev.GroupDiverged(group="tp0", step=42, digests_by_rank=digests, caught_by="ballot", round=50, request_id="r")
    assert decode_event(encode_event(new), "GroupDiverged", 1) == new


def test_a_row_whose_type_disagrees_with_its_payload_is_named():
    e = _random_event(random.Random())
    with pytest.raises(DecodeError, match="row says MoveAcked but payload is MoveRequested"):
        decode_event(encode_event(e), "MoveAcked", 1)


def test_unknown_type_and_future_schema_are_named():
    with pytest.raises(DecodeError, match="unknown event type 'Teleported'"):
        decode_event(b"\x91\xa9Teleported", "Teleported", 1)
    with pytest.raises(DecodeError, match="newer than this code"):
        decode_event(encode_event(_random_event(random.Random())), "MoveRequested", 9)


def test_a_flipped_byte_does_not_decode_silently_as_the_same_event():
    rng = random.Random()
    e = _random_event(rng)
    raw = bytearray(encode_event(e))
    i = rng.randrange(len(raw))
    raw[i] ^= 1 << rng.randrange(8)
    try:
        got = decode_event(bytes(raw), "MoveRequested", 1)
    except DecodeError:
        return
    assert got != e


def test_messages_round_trip_and_garbage_is_a_named_error():
    m = ExecuteMove(move_id="m1", kind="restore", src="host", dst="device", blocks=[3, 1, 2], keep_source=True,
                    deadline_ns=123)
    assert decode_message(encode_message(m)) == m
    assert decode_message(encode_message(Ping(nonce=7, ts_ns=9))) == Ping(nonce=7, ts_ns=9)
    for garbage in (b"", b"\xff\xfe", random.randbytes(64), msgspec.msgpack.encode(["NoSuchMessage", 1])):
        with pytest.raises(DecodeError, match="malformed message"):
            decode_message(garbage)


def test_json_with_unknown_or_missing_fields_is_refused_by_name():
    with pytest.raises(DecodeError, match="unknown fields \\['colour'\\]"):
        event_from_json_obj({"type": "ServerStopped", "reason": "x", "colour": "red"})
    with pytest.raises(DecodeError, match="MoveAcked"):
        event_from_json_obj({"type": "MoveAcked", "move_id": "m"})


def _lengths(payloads) -> str:
    return ", ".join(str(len(p)) for p in payloads)


def test_a_packed_run_decodes_only_when_each_row_holds_exactly_its_own_event():
    rng = random.Random()
    events = [_random_event(rng) for _ in range(rng.randint(3, 40))]
    payloads = [encode_event(e) for e in events]
    types = ",".join(["MoveRequested"] * len(events))
    assert decode_packed(len(events), b"".join(payloads), types, _lengths(payloads)) == events

    # one byte of row i + 1 stored at the end of row i: the same concatenation, every tag in
    # place, but neither row decodes on its own
    i = rng.randrange(len(events) - 1)
    slid = payloads[:i] + [payloads[i] + payloads[i + 1][:1], payloads[i + 1][1:]] + payloads[i + 2:]
    assert b"".join(slid) == b"".join(payloads)
    assert decode_packed(len(events), b"".join(slid), types, _lengths(slid)) is None

    # a row whose type is not its payload's, a row too many or too few, a payload that is not msgpack
    other = types.split(",")
    other[i] = "MoveAcked"
    assert decode_packed(len(events), b"".join(payloads), ",".join(other), _lengths(payloads)) is None
    assert decode_packed(len(events) + 1, b"".join(payloads), types, _lengths(payloads)) is None
    assert decode_packed(len(events) - 1, b"".join(payloads), types, _lengths(payloads)) is None
    broken = payloads[:i] + [b"\xc1"] + payloads[i + 1:]
    assert decode_packed(len(events), b"".join(broken), types, _lengths(broken)) is None


def test_move_acked_carries_its_checksums_packed_and_a_v1_list_is_upcast_to_the_same_bytes():
    rng = random.Random()
    sums = [rng.getrandbits(64) for _ in range(rng.randint(1, 300))] + [0, (1 << 64) - 1]
    head = ["MoveAcked", "m-7", 2, 4096 * len(sums), 4096 * len(sums), True, 11, 22]
    packed = ev.pack_checksums(sums)
    assert len(packed) == 8 * len(sums) and ev.unpack_checksums(packed) == sums
    e = ev.MoveAcked(move_id="m-7", worker=2, bytes_moved=4096 * len(sums), bytes_freed_src=4096 * len(sums),
                     checksum_ok=True, started_ns=11, finished_ns=22, checksums=packed)
    assert ev.MoveAcked.SCHEMA_VERSION == 2
    assert decode_event(encode_event(e), "MoveAcked", 2) == e
    assert event_from_json_obj(event_to_json_obj(e)) == e
    assert event_from_json_obj(json.loads(json.dumps(event_to_json_obj(e)))) == e             # plain json too
    assert decode_event(msgspec.msgpack.encode([*head, sums]), "MoveAcked", 1) == e            # v1, a list
    empty = decode_event(msgspec.msgpack.encode(head), "MoveAcked", 1)                         # v1, none
    assert empty.checksums == b"" and empty.checksum_list() == []
    with pytest.raises(ValueError, match=r"\[0, 2\^64\)"):
        ev.pack_checksums([1 << 64])
    with pytest.raises(ValueError, match="8 bytes each"):
        ev.unpack_checksums(b"\x00" * 9)


def test_an_event_with_records_inside_goes_through_the_stdlibs_json_and_back():
    import json

    from residency.events.catalog import ExpertMove, ExpertsMoved

    rng = random.Random()
    moves = [ExpertMove(kind=rng.choice(["fetch", "prefetch", "evict"]), layer=rng.randrange(48), expert=rng.randrange(128),
                        bytes=rng.randrange(1 << 30), ns=rng.choice([None, rng.randrange(1 << 40)])) for _ in range(7)]
    e = ExpertsMoved(worker=rng.randrange(8), step=rng.randrange(1 << 40), moves=moves,
                     fetched_bytes=sum(m.bytes for m in moves if m.kind != "evict"), device_bytes=rng.randrange(1 << 40),
                     host_bytes=rng.randrange(1 << 40), num_layers=48, num_experts=128)
    assert event_from_json_obj(json.loads(json.dumps(event_to_json_obj(e)))) == e
    assert decode_event(encode_event(e), "ExpertsMoved", 1) == e
