"""A small in-process engine over ``ModelRunner``: slots, prefix reuse, continuous batching.

For tests, the CLI smoke and the bench; the real scheduler and block allocation live in the
control plane and the pools. The loop is the whole idea:

    while engine.has_unfinished():
        engine.step()      # admit waiting requests; one forward for every running sequence
                           # (decodes take 1 token, prefills a chunk); sample the finished rows

A new request joins the running decodes at the next step (continuous batching). Its prompt's
full blocks are looked up by content key first; hits are shared read-only (ref-counted), and
prefill starts after them. Admission reserves every block a request may need (prompt +
max_tokens), so a running request never waits for memory and is never preempted.
"""
from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from residency.dataplane.model.errors import OutOfSlots
from residency.dataplane.model.loader import LoadedModel
from residency.dataplane.model.prefix import KeyChain, block_content_keys
from residency.dataplane.model.runner import SeqInput
from residency.dataplane.model.sampler import SamplingParams, make_generator, sample, stop_reason


class BlockManager:
    """Pool slots: free, held (ref-counted, possibly shared), or cached-idle (keyed, evictable LRU)."""

    def __init__(self, num_blocks: int):
        self.num_blocks = num_blocks
        self.free: deque[int] = deque(range(num_blocks))
        self.refs: dict[int, int] = {}
        self.by_key: dict[str, int] = {}
        self.key_of: dict[int, str] = {}
        self.idle: OrderedDict[int, None] = OrderedDict()   # keyed, unreferenced; oldest first

    def num_available(self) -> int:
        return len(self.free) + len(self.idle)

    def lookup(self, keys: Sequence[str]) -> list[int]:
        """Slots of the longest cached prefix of ``keys``, each retained once."""
        hits = []
        for k in keys:
            s = self.by_key.get(k)
            if s is None:
                break
            self.idle.pop(s, None)
            self.refs[s] = self.refs.get(s, 0) + 1
            hits.append(s)
        return hits

    def allocate(self, n: int) -> list[int]:
        if n > self.num_available():
            raise OutOfSlots(f"asked {n} blocks, {len(self.free)} free and {len(self.idle)} evictable "
                             f"of {self.num_blocks}")
        out = []
        for _ in range(n):
            if self.free:
                s = self.free.popleft()
            else:
                s, _ = self.idle.popitem(last=False)            # evict the least recently used
                del self.by_key[self.key_of.pop(s)]
            self.refs[s] = 1
            out.append(s)
        return out

    def commit(self, slot: int, key: str) -> None:
        """Publish a full block under its content key (first writer wins; later ones stay private)."""
        if key not in self.by_key and slot not in self.key_of:
            self.by_key[key] = slot
            self.key_of[slot] = key

    def release(self, slots: Sequence[int]) -> None:
        for s in slots:
            self.refs[s] -= 1
            if self.refs[s] == 0:
                del self.refs[s]
                if s in self.key_of:
                    self.idle[s] = None
                else:
                    self.free.append(s)

    def check_integrity(self) -> None:
        free, held, idle = set(self.free), set(self.refs), set(self.idle)
        if len(free) != len(self.free) or free & held or free & idle or held & idle:
            raise AssertionError(f"slot sets overlap: free∩held={sorted(free & held)[:8]} "
                                 f"free∩idle={sorted(free & idle)[:8]} held∩idle={sorted(held & idle)[:8]}")
        if len(free) + len(held) + len(idle) != self.num_blocks:
            raise AssertionError(f"free {len(free)} + held {len(held)} + idle {len(idle)} != {self.num_blocks}")
        if any(r <= 0 for r in self.refs.values()):
            raise AssertionError(f"non-positive refcounts: {[(s, r) for s, r in self.refs.items() if r <= 0][:8]}")
        if any(self.by_key[k] != s for s, k in self.key_of.items()):
            raise AssertionError("key maps disagree")


@dataclass
class Request:
    rid: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator | None
    tokens: list[int]
    chain: KeyChain
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0            # tokens whose K/V are in the pool
    num_cached: int = 0              # of those, found by prefix key instead of computed
    num_committed: int = 0           # full blocks published under their key
    generated: list[int] = field(default_factory=list)
    finish_reason: str | None = None


@dataclass
class GenerationOutput:
    token_ids: list[int]
    text: str | None
    finish_reason: str
    num_cached_tokens: int


class LocalEngine:
    def __init__(self, model: LoadedModel, num_blocks: int, page_tokens: int = 16,
                 max_batch_tokens: int = 2048, prefix_cache: bool = True):
        self.model = model
        self.runner = model.runner
        self.page_tokens = page_tokens
        self.max_batch_tokens = max_batch_tokens
        self.prefix_cache = prefix_cache
        self.pool = self.runner.allocate_kv_pool(num_blocks, page_tokens)
        self.blocks = BlockManager(num_blocks)
        self.eos = set(model.tokenizer.eos_token_ids) if model.tokenizer else set()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.done: dict[int, Request] = {}
        self._next_id = 0

    def add_request(self, prompt_ids: Sequence[int], params: SamplingParams = SamplingParams()) -> int:
        if not prompt_ids:
            raise ValueError("empty prompt")
        rid = self._next_id
        self._next_id += 1
        r = Request(rid, list(prompt_ids), params, make_generator(params, self.runner.device),
                    list(prompt_ids), KeyChain(self.model.kv_digest, self.page_tokens))
        self.waiting.append(r)
        return rid

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        page = self.page_tokens
        while self.waiting:
            r = self.waiting[0]
            need = -(-(len(r.prompt) + r.params.max_tokens) // page)
            if need > self.blocks.num_blocks:
                raise OutOfSlots(f"request {r.rid} needs {need} blocks, the pool has {self.blocks.num_blocks}")
            hits: list[int] = []
            if self.prefix_cache:
                # Reuse only blocks strictly before the last prompt token: its logits are needed.
                usable = (len(r.prompt) - 1) // page
                hits = self.blocks.lookup(block_content_keys(r.prompt[:usable * page], page, self.model.kv_digest))
            if need - len(hits) > self.blocks.num_available():
                self.blocks.release(hits)
                return                                          # wait for running requests to finish
            r.block_table = hits + self.blocks.allocate(need - len(hits))
            r.num_computed = r.num_cached = len(hits) * page
            r.num_committed = len(hits)
            r.chain.extend(r.prompt[:len(hits) * page])
            self.running.append(self.waiting.popleft())

    def step(self) -> list[tuple[int, int]]:
        """One forward over every running sequence; returns the (request id, token) emitted."""
        self._admit()
        if not self.running:
            return []
        batch, members, budget = [], [], self.max_batch_tokens
        for r in self.running:                                  # decodes first: one token each
            if len(r.tokens) - r.num_computed == 1:
                batch.append(SeqInput(r.tokens[-1:], r.num_computed, r.block_table))
                members.append(r)
                budget -= 1
        for r in self.running:                                  # then prefill chunks
            todo = len(r.tokens) - r.num_computed
            if todo > 1 and budget > 0:
                n = min(todo, budget)
                batch.append(SeqInput(r.tokens[r.num_computed:r.num_computed + n], r.num_computed, r.block_table))
                members.append(r)
                budget -= n
        logits = self.runner.forward(batch, self.pool)
        ready = []
        for i, (r, s) in enumerate(zip(members, batch)):
            r.num_computed += len(s.token_ids)
            for key in r.chain.extend(r.tokens[:r.num_computed]):
                self.blocks.commit(r.block_table[r.num_committed], key)
                r.num_committed += 1
            if r.num_computed == len(r.tokens):
                ready.append((i, r))
        emitted = []
        if ready:
            toks = sample(logits[[i for i, _ in ready]], [r.params for _, r in ready],
                          [r.generator for _, r in ready], [(r.tokens, len(r.prompt)) for _, r in ready])
            for (_, r), t in zip(ready, toks):
                r.tokens.append(t)
                r.generated.append(t)
                emitted.append((r.rid, t))
                r.finish_reason = stop_reason(t, len(r.generated), r.params, self.eos)
        for r in [r for r in self.running if r.finish_reason]:
            self.running.remove(r)
            self.blocks.release(r.block_table)
            self.done[r.rid] = r
        return emitted

    def run_until_done(self) -> dict[int, Request]:
        while self.has_unfinished():
            self.step()
        return self.done


def generate(model: LoadedModel, prompts: Sequence[Sequence[int] | str], params: SamplingParams = SamplingParams(),
             *, page_tokens: int = 16, num_blocks: int | None = None, max_batch_tokens: int = 2048
             ) -> list[GenerationOutput]:
    """Run prompts (token ids, or text encoded with the model's tokenizer) to completion together."""
    ids = [model.tokenizer.encode(p, add_special=True) if isinstance(p, str) else list(p) for p in prompts]
    if num_blocks is None:
        num_blocks = sum(-(-(len(p) + params.max_tokens) // page_tokens) for p in ids) + 1
    engine = LocalEngine(model, num_blocks, page_tokens, max_batch_tokens)
    rids = [engine.add_request(p, params) for p in ids]
    done = engine.run_until_done()
    outs = []
    for rid in rids:
        r = done[rid]
        text = model.tokenizer.decode(r.generated, skip_special=True) if model.tokenizer else None
        outs.append(GenerationOutput(r.generated, text, r.finish_reason or "length", r.num_cached))
    return outs


def chat(model: LoadedModel, messages: Sequence[dict], params: SamplingParams = SamplingParams(), **kw) -> str:
    """The model's reply to a conversation, rendered with its own chat template."""
    prompt = model.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    return generate(model, [model.tokenizer.encode(prompt)], params, **kw)[0].text
