"""The serving stack without SmolLM2, shared by the service tests: a tiny random Llama behind the
real pieces.

    TestClient ─► create_app ─► ServingService ─► ControlProc (ledger) ─ZMQ─► WorkerProc (thread)
                                                                          WorkerCore + Mover + ServingLoop

Everything but the model and the tokenizer is what ``residency serve`` runs.
"""
from __future__ import annotations

import shutil
import tempfile
import threading
import time
from pathlib import Path

import pytest
import torch
from fastapi.testclient import TestClient

from residency.control.api import ApiConfig, create_app
from residency.control.moves import MoveConfig
from residency.control.policy import PolicyConfig
from residency.control.proc import ControlConfig, ControlProc
from residency.control.scheduler.service import ServingService
from residency.dataplane.mover import Mover
from residency.dataplane.model import ModelConfig, block_content_keys, random_model
from residency.dataplane.pools import DataPlaneError, KVLayout
from residency.dataplane.proc import WorkerProc
from residency.dataplane.restore_pipeline import KeptRestores
from residency.dataplane.serving import ServingLoop
from residency.dataplane.serving_worker import attach
from residency.dataplane.worker import WorkerCore, WorkerFaults
from residency.ledger import LedgerStore
from tests.serving.server import read_ledger

P = 4
TINY = ModelConfig(name="tiny", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16, intermediate=128,
                   vocab_size=300, rope_theta=10000.0, rope_scaling=None, rms_eps=1e-5, max_position=256,
                   tie_embeddings=True)


class ByteTokenizer:
    """Bytes as tokens (1..256), a visible chat template, and no end-of-turn: the random model
    always generates max_tokens."""

    eos_token_ids: set[int] = set()
    max_token_bytes = 1

    def encode(self, text: str, add_special: bool = False) -> list[int]:
        return [b + 1 for b in text.encode()]

    def surely_over(self, text: str, max_tokens: int) -> bool:
        return len(text.encode()) > max_tokens

    def decode(self, ids, skip_special: bool = False) -> str:
        return bytes(i - 1 for i in ids if 0 < i <= 256).decode(errors="replace")

    def apply_chat_template(self, messages, add_generation_prompt: bool = True) -> str:
        return "".join(f"<{m['role']}>{m['content']}" for m in messages) + ("<assistant>" if add_generation_prompt else "")


class Stack:
    def __init__(self, device_blocks: int = 64, restore_policy: str = "cost", park_idle_s: float | None = None,
                 policy: PolicyConfig | None = None, host_blocks: int = 256, tokenizer=None,
                 max_seqs: int = 64, share_prefixes: bool = True, retain_fraction: float = 0.0, workers: int = 1,
                 pipelined: bool = True, faults: str = "", max_context: int | None = None):
        self.dir = Path(tempfile.mkdtemp(prefix="rsv-", dir="/tmp"))
        self.url = f"sqlite:///{self.dir / 'ledger.db'}"
        self.store = LedgerStore.open(self.url, create=True)
        policy = policy or PolicyConfig(pressure=False, park=park_idle_s is not None,
                                        park_idle_s=park_idle_s or 30.0, cooldown_s=0.0)
        cfg = ControlConfig(worker_endpoint=f"ipc://{self.dir}/w.sock", expected_workers=list(range(workers)),
                            policy=policy, moves=MoveConfig(page_tokens=P), shutdown_grace_s=1.0)
        self.proc = ControlProc(self.store, cfg)
        self.service = ServingService(self.proc, restore_policy=restore_policy, wait_timeout_s=10.0,
                                      share_prefixes=share_prefixes, retain_fraction=retain_fraction)
        self.app = create_app(self.service, ApiConfig(admin_key=None))
        self.proc.start()
        # max_context: the model's positions capped (as serve --max-context), so a pool may shrink further
        model = random_model(TINY, seed=0, max_positions=max_context)
        kv = KVLayout(TINY.num_layers, P, TINY.num_kv_heads, TINY.head_dim, dtype=torch.float32)
        host = host_blocks * kv.block_bytes
        self.workers, self.threads = [], []
        for w in range(workers):             # one model, one worker thread each (as one process per GPU)
            # pipelined: as serve builds a worker (restores land by layer and a returning turn reads them
            # as they land); off: every restore is finished before the turn's Generate is sent
            mover = Mover(kv, device_blocks, host, self.dir / f"disk{w}",
                           Mover.pinned_bytes_needed(kv, device_blocks, host), "cpu", worker=w, fsync=False,
                           layered_restores=pipelined)
            faults_w = WorkerFaults(faults)         # dataplane/faults.py spec, e.g. stall_step=N:MS
            core = WorkerCore(mover, w, faults_w, expected_errors=(DataPlaneError,))
            core.restores = KeptRestores(mover) if pipelined else None
            loop = ServingLoop(worker=w, runner=model.runner, tokenizer=tokenizer or ByteTokenizer(),
                               device_pool=mover.device_pool, model_id="tiny", model_digest=model.kv_digest,
                               page_tokens=P, keys_fn=block_content_keys, max_seqs=max_seqs, restores=core.restores)
            attach(core, loop, kv.block_bytes)
            self.workers.append(WorkerProc(worker=w, epoch=1, endpoint=cfg.worker_endpoint, core=core, device="cpu",
                                           block_bytes=kv.block_bytes, faults=faults_w))
            self.threads.append(threading.Thread(target=self.workers[-1].run, daemon=True))
            self.threads[-1].start()
        self.worker, self.thread = self.workers[0], self.threads[0]
        self.client = TestClient(self.app)
        deadline = time.monotonic() + 20
        while len(self.service.workers.ready) < workers:
            assert time.monotonic() < deadline, "a worker never said ServingReady"
            time.sleep(0.02)

    def chat(self, text: str | list, session: str | None = None, max_tokens: int = 6, **kw):
        messages = [{"role": "user", "content": text}] if isinstance(text, str) else text
        body = {"model": "tiny", "messages": messages, "max_tokens": max_tokens, "temperature": 0, **kw}
        if session:
            body["session_id"] = session
        return self.client.post("/v1/chat/completions", json=body)

    def session(self, name: str) -> dict:
        return self.client.get(f"/admin/sessions/{name}").json()

    def close(self):
        self.client.close()
        self.service.close()
        self.proc.stop("test done")
        for w, t in zip(self.workers, self.threads):
            w.stop("test done")
            t.join(10)
        self.store.close()

    def ledger(self):
        events, state = read_ledger(self.url)
        state.check_integrity()
        return [r.event for r in events], state


@pytest.fixture
def stack():
    made = []

    def make(**kw) -> Stack:
        made.append(Stack(**kw))
        return made[-1]

    yield make
    for s in made:
        s.close()
        shutil.rmtree(s.dir, ignore_errors=True)


def names(events) -> list[str]:
    return [type(e).__name__ for e in events]

BUSY = "stall_step=2:1500"      # the worker's 2nd step (the long turn's first decode) waits 1.5 s


def generating(s: Stack, session: str) -> tuple[threading.Thread, dict]:
    """A long turn of ``session`` running in a thread, once the session says it is busy. The stack should
    stall a step of it (``stack(faults=BUSY)``): a tiny model's turn can end before the next request
    arrives."""
    out: dict = {}
    t = threading.Thread(target=lambda: out.update(r=s.chat("a long one", session=session, max_tokens=60)))
    t.start()
    deadline = time.monotonic() + 10
    while not s.session(session).get("busy"):
        assert time.monotonic() < deadline
        time.sleep(0.01)
    return t, out
