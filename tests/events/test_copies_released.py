"""CopiesReleased, a release's answer, through every codec a ledger row or an ask's answer takes."""
from __future__ import annotations

import msgspec

from residency.events import catalog as ev
from residency.events.codec import (
    decode_event, encode_event, encode_message, event_from_json_obj, event_to_json_obj,
)
from residency.events.asks import AnyAskReply, AskAnswered


def _released(rng) -> ev.CopiesReleased:
    return ev.CopiesReleased(move_id=f"m-{rng.randrange(1 << 30)}", worker=rng.randrange(8),
                             tier=rng.choice(ev.TIERS), blocks=rng.sample(range(1 << 20), rng.randint(0, 40)),
                             bytes=rng.choice([0, rng.randrange(1, 1 << 40)]))


def test_copies_released_round_trips_as_a_ledger_row_and_as_json(rng):
    for _ in range(50):
        e = _released(rng)
        assert decode_event(encode_event(e), "CopiesReleased", ev.CopiesReleased.SCHEMA_VERSION) == e
        assert decode_event(encode_event(e)) == e
        assert event_from_json_obj(event_to_json_obj(e)) == e


def test_copies_released_is_one_of_the_facts_an_ask_is_answered_with(rng):
    e = _released(rng)
    ans = AskAnswered(ask_id="a", events=[e], seqs=[7], move_ids=[e.move_id])
    assert msgspec.msgpack.decode(encode_message(ans), type=AnyAskReply) == ans     # as the ask client reads it


def test_a_release_answered_with_zero_keeps_its_zero(rng):
    e = ev.CopiesReleased(move_id="r", worker=0, tier="device", blocks=[1, 2], bytes=0)
    assert decode_event(encode_event(e)).bytes == 0
