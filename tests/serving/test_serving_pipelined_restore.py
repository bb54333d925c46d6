"""A returning turn whose history pages land layer by layer: its prefill starts at once and layer l
waits only for layer l's pages. The greedy tokens are those of the turn whose pages were in place.

The pages are poisoned (NaN) before they land, so a layer that read them early could not pass.
"""
from __future__ import annotations

import random
import threading
import time

import pytest
import torch

from residency.dataplane.model import ModelConfig, block_content_keys, random_model
from residency.dataplane.mover import Mover
from residency.dataplane.pools import KVLayout
from residency.dataplane.restore_layers import join_layers, landed
from residency.dataplane.restore_pipeline import KeptRestores
from residency.dataplane.serving import ServingLoop
from residency.events.catalog import MoveAcked, StepCompleted
from residency.events.commands import ExecuteMove, Generate, SamplingParams, TokensGenerated
from tests.serving.stack import ByteTokenizer

P = 8
CFG = ModelConfig(name="tiny-landing", num_layers=3, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16,
                  intermediate=128, vocab_size=300, rope_theta=10000.0, rope_scaling=None, rms_eps=1e-5,
                  max_position=512, tie_embeddings=True)
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)


def make_loop(model, tmp_path, name: str):
    kv = KVLayout(CFG.num_layers, P, CFG.num_kv_heads, CFG.head_dim, dtype=torch.float32)
    blocks, host = 64, 4 * kv.block_bytes
    mover = Mover(kv, blocks, host, tmp_path / name, Mover.pinned_bytes_needed(kv, blocks, host), "cpu", fsync=False)
    return ServingLoop(worker=0, runner=model.runner, tokenizer=ByteTokenizer(), device_pool=mover.device_pool,
                       model_id="tiny", model_digest=model.kv_digest, page_tokens=P, keys_fn=block_content_keys)


def drain(loop: ServingLoop, out: list) -> list:
    while loop.has_work():
        out += loop.step()
    return out


def tokens(out, rid: str) -> list[int]:
    return [t for o in out if isinstance(o, TokensGenerated) and o.request_id == rid for t in o.token_ids]


def two_turns(loop: ServingLoop, first: list[int], more: list[int], land=None) -> tuple[list[int], list]:
    """Turn 1, then turn 2 over turn 1's full pages. ``land(slots)``: the layer waits of those
    pages for turn 2 (it may poison them first and land them from another thread)."""
    pages = list(range(100, 100 + -(-(len(first) + 10) // P)))
    out = drain(loop, loop.handle(Generate(request_id="t1", session="s", token_ids=first, block_ids=pages,
                                           num_cached_tokens=0, sampling=GREEDY)))
    history = first + tokens(out, "t1")
    reuse = (len(history) - 1) // P
    prompt = history + more
    block_ids = pages[:reuse] + list(range(200, 200 + -(-(len(prompt) + 10) // P) - reuse))
    tail = [b for b in pages[reuse:] if loop.pool.has(b)]      # turn 1's last, partial page: written again
    if tail:
        loop.pool.free(tail)
    cmd = Generate(request_id="t2", session="s", token_ids=prompt, block_ids=block_ids, num_cached_tokens=reuse * P,
                   sampling=GREEDY)
    waits = land(loop.pool.slots_of(pages[:reuse])) if land is not None else None
    out2 = drain(loop, loop.start(cmd, layer_ready=waits))
    return tokens(out2, "t2"), [o for o in out2 if isinstance(o, StepCompleted)]


def test_a_turn_whose_pages_land_layer_by_layer_gives_the_tokens_of_one_whose_pages_were_in_place(tmp_path):
    rng = random.Random()
    model = random_model(CFG, "cpu", torch.float32, seed=rng.randrange(1 << 16))
    first = [rng.randrange(1, 257) for _ in range(29)]
    more = [rng.randrange(1, 257) for _ in range(13)]
    want, _ = two_turns(make_loop(model, tmp_path, "plain"), first, more)

    order: list[str] = []
    copier: list[threading.Thread] = []
    go = threading.Event()                                 # set by the forward's first wait

    def land(slots):
        pool = loop.pool.tensor
        saved = pool[slots].clone()                        # as parked on the host
        pool[slots] = float("nan")                         # not landed yet: unreadable
        ready = [threading.Event() for _ in range(CFG.num_layers)]

        def copy_layers():
            go.wait()
            for layer in range(CFG.num_layers):
                pool[slots, layer] = saved[:, layer]
                order.append(f"landed {layer}")
                ready[layer].set()

        class Waiting:                                     # the first wait lets the copier go
            def __init__(self, layer: int):
                self.layer = layer

            def wait(self):
                order.append(f"wait {self.layer}")
                go.set()
                ready[self.layer].wait()

        copier.append(threading.Thread(target=copy_layers))
        copier[0].start()
        return [Waiting(layer) for layer in range(CFG.num_layers)]

    loop = make_loop(model, tmp_path, "landing")
    got, steps = two_turns(loop, first, more, land)
    go.set()                                               # (a forward that never waited never let it go)
    copier[0].join()
    assert got == want and len(got) == GREEDY.max_tokens
    assert order[0] == "wait 0" and sorted(order) == sorted([f"{w} {i}" for i in range(3) for w in ("wait", "landed")])
    assert steps[0].decode_path == "eager"
    loop.pool.check_integrity()


def test_pages_already_landed_take_the_same_path_with_nothing_to_wait_for(tmp_path):
    rng = random.Random()
    model = random_model(CFG, "cpu", torch.float32, seed=rng.randrange(1 << 16))
    first = [rng.randrange(1, 257) for _ in range(21)]
    more = [rng.randrange(1, 257) for _ in range(9)]
    want, _ = two_turns(make_loop(model, tmp_path, "plain"), first, more)
    got, _ = two_turns(make_loop(model, tmp_path, "landed"), first, more, lambda slots: landed(CFG.num_layers))
    assert got == want


def test_the_waits_of_several_landing_sequences_are_joined_per_layer():
    seen = []

    class W:
        def __init__(self, tag):
            self.tag = tag

        def wait(self):
            seen.append(self.tag)

    joined = join_layers([[W("a0"), W("a1")], [W("b0"), W("b1")]], 2)
    for w in joined:
        w.wait()
    assert seen == ["a0", "b0", "a1", "b1"]
    assert join_layers([], 2) is None
    try:
        join_layers([[W("a0")]], 2)
    except ValueError as e:
        assert "1 layers for a model of 2" in str(e)
    else:
        raise AssertionError("a list of the wrong length was joined")


DEVICES = ["cpu"] + (["cuda:0"] if torch.cuda.is_available() else [])


class JoinedDma:
    """The mover's DMA issuer, whose layer copies wait (on CPU, in the copier thread) until a turn
    has joined the restore: a tiny restore would otherwise land before the Generate is handled,
    and the step would find its pages in place. On a GPU the copies are only enqueued here."""

    def __init__(self, loop, base):
        self.loop, self.base = loop, base

    def __getattr__(self, name):            # everything else is the issuer's own
        return getattr(self.base, name)

    def copy_runs_cols(self, stream, dst, src, runs, lo, hi):
        deadline = time.monotonic() + 10
        while stream is None and not any(q.awaits for q in list(self.loop.seqs.values())) \
                and time.monotonic() < deadline:
            time.sleep(0.001)
        self.base.copy_runs_cols(stream, dst, src, runs, lo, hi)


@pytest.mark.parametrize("device", DEVICES)
def test_a_turn_awaiting_a_kept_layered_restore_gives_the_tokens_of_a_plain_restores_turn(tmp_path, device):
    """The worker's whole path without sockets: the mover lands the restore by layer, KeptRestores
    keeps it unfinished, the Generate names it, the step reads the landing pages and settles the
    move before sampling. Every free slot is poisoned (NaN) first: a layer read before it landed
    could not give the same tokens."""
    rng = random.Random()
    model = random_model(CFG, device, torch.float32, seed=rng.randrange(1 << 16))
    first = [rng.randrange(1, 257) for _ in range(37)]
    more = [rng.randrange(1, 257) for _ in range(11)]

    def run(pipelined: bool):
        kv = KVLayout(CFG.num_layers, P, CFG.num_kv_heads, CFG.head_dim, dtype=torch.float32)
        host = 16 * kv.block_bytes
        mover = Mover(kv, 64, host, tmp_path / f"d{pipelined}", Mover.pinned_bytes_needed(kv, 64, host), device,
                      fsync=False, layered_restores=pipelined)
        kept = KeptRestores(mover) if pipelined else None
        loop = ServingLoop(worker=0, runner=model.runner, tokenizer=ByteTokenizer(), device_pool=mover.device_pool,
                           model_id="tiny", model_digest=model.kv_digest, page_tokens=P,
                           keys_fn=block_content_keys, restores=kept)
        pages = list(range(100, 100 + -(-(len(first) + 10) // P)))
        out = drain(loop, loop.handle(Generate(request_id="t1", session="s", token_ids=first, block_ids=pages,
                                               num_cached_tokens=0, sampling=GREEDY)))
        history = first + tokens(out, "t1")
        reuse = (len(history) - 1) // P
        loop.pool.free([b for b in pages[reuse:] if loop.pool.has(b)])
        park = ExecuteMove(move_id="park", kind="park", src="device", dst="host", blocks=pages[:reuse],
                           keep_source=False, deadline_ns=0)
        assert isinstance(mover.execute(park), MoveAcked)
        pool = mover.device_pool
        taken = set(pool.slots_of(pool.blocks()))
        free = [i for i in range(pool.num_slots) if i not in taken]
        pool.tensor[free] = float("nan")                  # whatever the restore claims is unreadable
        back = ExecuteMove(move_id="back", kind="restore", src="host", dst="device", blocks=pages[:reuse],
                           keep_source=False, deadline_ns=0)
        if pipelined:
            mover.ctx.dma = JoinedDma(loop, mover.ctx.dma)    # its layers cross once the turn joined them
            kept.keep(back, begun=False)
        else:
            assert isinstance(mover.execute(back), MoveAcked)
        prompt = history + more
        block_ids = pages[:reuse] + list(range(200, 200 + -(-(len(prompt) + 10) // P) - reuse))
        out2 = drain(loop, loop.handle(Generate(
            request_id="t2", session="s", token_ids=prompt, block_ids=block_ids, num_cached_tokens=reuse * P,
            sampling=GREEDY, awaits_move="back" if pipelined else "")))
        settled = kept.take() if kept is not None else []
        steps = [o for o in out2 if isinstance(o, StepCompleted)]
        mover.check_integrity()
        mover.close()
        return tokens(out2, "t2"), settled, steps

    want, _, plain_steps = run(False)
    got, settled, steps = run(True)
    assert got == want and len(got) == GREEDY.max_tokens
    assert [(c.move_id, type(o).__name__, r) for c, o, r in settled] == [("back", "MoveAcked", [])]
    assert steps[0].restore_wait_ns is not None and steps[0].decode_path == "eager"
    assert all(s.restore_wait_ns is None for s in steps[1:] + plain_steps)
