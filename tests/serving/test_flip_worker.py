"""Flip in a real worker process (issue #28): the embedded SmolLM2 and a random model of another
size with the same KV pages (SmolLM2's 30 layers, 3 KV heads, head_dim 64; a narrower hidden and
MLP), served from one weights arena, driven over ZMQ with the commands the control sends.

Three A→B→A flips keep A's greedy tokens and give B's tokens exactly as a worker serving B alone
gives them; pinned and device memory are back where they started; sleep (level 1 and 2) and wake
give the same tokens; every refusal is a named answer that changes nothing, and a request for
weights that are not on the device is answered, never held.

The worker runs in bfloat16: every flip checksums the images on the host's CPU, and half the bytes
halve the time (the CPU reference of psum64 is the slow part of a CPU flip).
"""
from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from residency.dataplane.model import ModelConfig, random_model
from residency.dataplane.model.loader import save_hf_dir
from residency.events.commands import (
    CancelGenerate, Generate, Hello, MemoryReport, QueryMemory, SamplingParams, ServingReady, Shutdown, StepCompleted,
    SwapWeights, Tokenize, Tokenized, TokensGenerated, WeightsSwapped,
)
from residency.events.commands import PinnedChanged
from residency.events.serving import ChatTurn
from tests.control_plane.conftest import short_dir, spawn  # noqa: F401 - a fixture
from tests.control_plane.test_worker import Control

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "bench"))

SMALL = ModelConfig(name="small", num_layers=30, hidden=192, num_heads=3, num_kv_heads=3, head_dim=64,
                    intermediate=256, vocab_size=49152, rope_theta=100000.0, rope_scaling=None, rms_eps=1e-5,
                    max_position=2048, tie_embeddings=False)
A, B = "smol", "small"
SKIP = (StepCompleted, TokensGenerated, PinnedChanged, ServingReady)


@pytest.fixture(scope="module")
def small_dir(tmp_path_factory) -> str:
    from e2e_model import embedded_tokenizer, export_tokenizer

    path = str(tmp_path_factory.mktemp("small") / "small")
    save_hf_dir(random_model(SMALL, seed=5), path)
    export_tokenizer(embedded_tokenizer(), path)
    return path


def worker_argv(endpoint: str, run_dir: Path, *models: str) -> list[str]:
    argv = [sys.executable, "-m", "residency.dataplane.proc", "--worker", "0", "--control", endpoint,
            "--run-dir", str(run_dir), "--device-blocks", "64", "--host-bytes", str(4 << 20), "--no-disk-fsync",
            "--torch-threads", "1", "--orphan-exit-s", "60", "--dtype", "bfloat16"]
    for m in models:
        argv += ["--model", m]
    argv += ["--flip-host-copies", "off"]     # the rotation is what this measures
    return argv


def generate(ctl: Control, rid: str, ids: list[int], model: str = "", max_tokens: int = 10) -> TokensGenerated:
    """A greedy request to its end: the final answer, with every token of the request in ``token_ids``."""
    ctl.send(Generate(request_id=rid, session=None, token_ids=ids, block_ids=[100 + i for i in range(8)],
                      num_cached_tokens=0, sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
                      free_on_finish=True, model=model))
    tokens = []
    while True:
        m = ctl.recv(120)
        if isinstance(m, TokensGenerated) and m.request_id == rid:
            tokens += m.token_ids
            if m.finish_reason is not None:
                return TokensGenerated(**{**{f: getattr(m, f) for f in m.__struct_fields__}, "token_ids": tokens})


def swap(ctl: Control, flip_id: str, action: str, to_gen: int, to_model: str = "", level: int = 1) -> WeightsSwapped:
    ctl.send(SwapWeights(flip_id=flip_id, action=action, to_model=to_model, level=level, to_gen=to_gen))
    return ctl.expect(WeightsSwapped, timeout=180, skip=SKIP)


def memory(ctl: Control, nonce: int) -> tuple:
    ctl.send(QueryMemory(nonce=nonce))
    r = ctl.expect(MemoryReport, timeout=30, skip=SKIP)
    return r.pinned_in_use_bytes, r.device_owned


def test_a_worker_flips_between_the_embedded_model_and_another_three_times_and_sleeps_and_wakes(
        short_dir, tmp_path, small_dir):
    ctl = Control(f"ipc://{short_dir}/w.sock")
    alone = Control(f"ipc://{short_dir}/b.sock")
    w = spawn(worker_argv(f"ipc://{short_dir}/w.sock", short_dir / "w", f"{A}=embedded", f"{B}={small_dir}"),
              tmp_path / "w.log")
    wb = spawn(worker_argv(f"ipc://{short_dir}/b.sock", short_dir / "b", f"{B}={small_dir}"), tmp_path / "b.log")
    try:
        hello = ctl.expect(Hello, timeout=300)
        assert hello.model == A and hello.weights_tier_bytes["device"] > 0 and len(hello.weights_checksum) == 16
        assert hello.pinned["weights-slab"] > hello.weights_tier_bytes["device"]        # one image plus the ring
        ready = ctl.expect(ServingReady, timeout=60)
        assert [m.name for m in ready.models] == [A, B] and ready.resident == A and ready.arena_gen == 0
        size = {m.name: m.weights_bytes for m in ready.models}
        assert size[A] > 3 * size[B] and hello.device_owned["weights"] == size[A]     # the arena: the larger
        ctl.send(Tokenize(request_id="t", messages=[ChatTurn(role="user", content="Name three colours.")]))
        ids = ctl.expect(Tokenized, timeout=60, skip=SKIP).token_ids
        a_before = generate(ctl, "a0", ids)
        assert a_before.finish_reason == "length" and len(a_before.token_ids) == 10
        start = memory(ctl, 1)
        gen = 0
        for cycle in range(3):
            gen += 1
            to_b = swap(ctl, f"b{cycle}", "flip", gen, B)
            assert to_b.error == "" and to_b.checksum_ok and to_b.resident == B and to_b.bytes_out == size[A]
            assert to_b.stamps == {"runner": gen, "serving": gen, "graphs": gen} and to_b.steps > 0
            assert to_b.overlapped_steps > 0 and to_b.measured_freed_bytes is None       # ring of 2; no CUDA
            b = generate(ctl, f"b{cycle}", ids, model=B)
            if cycle == 0:
                alone.expect(Hello, timeout=300)
                b_alone = generate(alone, "alone", ids, model=B)
                assert b_alone.token_ids and b_alone.token_ids != a_before.token_ids
            assert b.token_ids == b_alone.token_ids
            gen += 1
            to_a = swap(ctl, f"a{cycle}", "flip", gen, A)
            assert to_a.error == "" and to_a.checksum_ok and to_a.resident == A and to_a.bytes_in == size[A]
            assert generate(ctl, f"a{cycle}", ids, model=A).token_ids == a_before.token_ids
        assert memory(ctl, 2) == start
        # a request for the model that is not on the device, and refusals: answered, nothing changed
        r = generate(ctl, "not-here", ids, model=B)
        assert r.finish_reason == "error" and r.error.startswith(f"model_not_resident: {B}")
        assert "unknown model 'zz'" in swap(ctl, "x1", "flip", gen + 1, "zz").error
        assert swap(ctl, "x2", "wake", gen + 1).error.startswith("awake")
        ctl.send(Generate(request_id="long", session=None, token_ids=ids, block_ids=[200 + i for i in range(8)],
                          num_cached_tokens=0, sampling=SamplingParams(max_tokens=60, temperature=0.0)))
        busy = swap(ctl, "x3", "flip", gen + 1, B)
        assert "still run: ['long']" in busy.error and busy.resident == A
        ctl.send(CancelGenerate(request_id="long", reason="test"))
        # sleep and wake, at either level: the same tokens, the same memory after
        for level in (1, 2):
            slept = swap(ctl, f"s{level}", "sleep", gen + 1, level=level)
            assert slept.error == "" and slept.resident == "" and slept.measured_freed_bytes is None
            assert (slept.bytes_out, slept.dropped_bytes) == ((size[A], 0) if level == 1 else (0, size[A]))
            assert memory(ctl, 10 + level)[1]["weights"] == 0
            assert swap(ctl, f"again{level}", "sleep", gen + 2, level=1).error.startswith("already asleep")
            asleep = generate(ctl, f"asleep{level}", ids)
            assert asleep.finish_reason == "error" and asleep.error.startswith("weights_asleep")
            woke = swap(ctl, f"w{level}", "wake", gen + 2)
            assert woke.error == "" and woke.checksum_ok and woke.resident == A and woke.bytes_in == size[A]
            assert generate(ctl, f"woke{level}", ids).token_ids == a_before.token_ids
            gen += 2
        assert memory(ctl, 3) == start
        for c, p in ((ctl, w), (alone, wb)):
            c.send(Shutdown(reason="test"))
            assert p.wait(60) == 0
    finally:
        for p in (w, wb):
            p.kill()
        ctl.sock.close(0)
        alone.sock.close(0)
