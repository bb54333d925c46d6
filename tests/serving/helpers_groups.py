"""What the live tests of a small tensor-parallel group share: a tiny random Llama whose heads
divide by 2, written as a Hugging Face directory, served by ``residency serve --tp 2`` on the CPU
(gloo) with a fault spec for its ranks."""
from __future__ import annotations

import random
import sys
import time

import httpx

from residency.dataplane.model import ModelConfig, random_model
from tests.model.helpers_model import write_hf_dir
from tests.serving.server import Server

CLI = [sys.executable, "-m", "residency.control.cli.main"]
COMMON = ("--drain-s", "0", "--no-policies", "--retain-prefixes", "0", "--no-keep-disk", "--move-deadline-s", "1")
TINY_LLAMA = ModelConfig(name="tiny-llama", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16,
                         intermediate=128, vocab_size=320, rope_theta=10000.0, rope_scaling=None, rms_eps=1e-5,
                         max_position=2048, tie_embeddings=True)


def tiny_tp2(tmp_path_factory, name: str, faults: str):
    """A module fixture's body: the server, stopped after the module's tests."""
    tmp = tmp_path_factory.mktemp(name)
    tiny = str(tmp / "tiny-llama")
    write_hf_dir(tiny, random_model(TINY_LLAMA, seed=random.randrange(1 << 30)))
    s = Server(tmp, *COMMON, "--tp", "2", "--model", tiny, "--max-context", "512", name=name, faults=faults)
    try:
        yield s
    finally:
        s.stop()


def wait_healthy(s: Server, timeout_s: float = 180.0) -> str:
    """The served model's id, once /health answers 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if s.proc.poll() is not None:
            raise RuntimeError(f"residency serve exited with {s.proc.returncode}:\n{s.tail()}")
        try:
            if httpx.get(f"{s.url}/health", timeout=2).status_code == 200:
                return httpx.get(f"{s.url}/v1/models", timeout=10).json()["data"][0]["id"]
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise RuntimeError(f"not healthy after {timeout_s} s:\n{s.tail()}")
