"""The inference loop of a worker: continuous batching over the Mover's device pool.

    handle(Tokenize)        ─► Tokenized (ids + content keys of the full pages)
    handle(Generate)        a sequence joins: its reused pages must be resident and verified
    handle(CancelGenerate)  it leaves at once: TokensGenerated("cancelled"), its new pages freed
    step()                  one forward for every running sequence: decodes (1 token each) and
                            prefill chunks, up to ``max_step_tokens`` new tokens in all
                            ─► TokensGenerated per sequence (with the pages the step filled),
                               StepCompleted (the ledger's compact step record)

The model reads and writes the same tensor the Mover moves (``mover.device_pool.tensor``):
a page parked, spilled to disk and restored is, byte for byte, the page the model wrote.

Pages of a sequence (``Generate.block_ids``) are logical ids chosen by the control process; a
page is given a pool slot when the first position in it is written, so a reserved page the
sequence never reached costs nothing and is handed back in ``blocks_unused``.

    positions: 0 ............ num_cached ............ num_prompt ........ num_computed
    pages:     [ reused, resident ][ new: allocated as the positions reach them ][ unused ]

No sockets here: the worker process shell feeds messages in and sends what comes out.
"""
from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field

import structlog
import torch

from residency.dataplane.group import tables_digest
from residency.dataplane.model.runner import ModelRunner, SeqInput
from residency.dataplane.model.sampler import SamplingParams as ModelSampling, make_generator, sample, token_logprobs
from residency.dataplane.pools import DataPlaneError, TornPool
from residency.dataplane.pools.readers import check_fits
from residency.dataplane.restore_layers import LANDED, WaitClock, join_layers, timed
from residency.dataplane.restore_pipeline import settled_ok, why_not
from residency.dataplane.serving_graphs import StepGraphs
from residency.dataplane.serving_pages import copy_landed, take_copies
from residency.dataplane.serving_text import TextStream, tokenize_prompt
from residency.events.catalog import StepCompleted
from residency.events.commands import (
    MAX_LOGPROBS, CancelGenerate, Generate, ServingReady, TokenChoice, TokenLogprobs, Tokenize, Tokenized, TokensGenerated,
)

log = structlog.get_logger("dataplane.serving")

KeysFn = Callable[[Sequence[int], int, str], list[str]]


@dataclass
class _Seq:
    cmd: Generate
    tokens: list[int]                 # prompt, then every sampled token
    num_prompt: int
    num_computed: int                 # positions whose K/V is in the pool
    num_allocated: int                # pages of block_ids given a slot (the reused ones included)
    num_reported: int                 # pages reported written to the control process (the reused ones included)
    first_new: int                    # its first page it wrote itself (copies of another session's included)
    text: TextStream
    sampling: ModelSampling
    generator: torch.Generator | None
    num_generated: int = 0
    # per layer, the wait for its reused pages still landing (a pipelined restore); dropped after
    # the first step that reads them (they are in place once that step's layer l has run)
    layer_ready: list | None = None
    # the kept restore of its reused pages (Generate.awaits_move) until it is settled, and where its
    # pages are landing meanwhile (block -> slot: reserved, not yet published), and the copies of a
    # donor's pages to make once it is verified (dataplane/serving_pages.py: (source, destination))
    awaits: str = ""
    landing: dict | None = None
    copy_later: list = field(default_factory=list)
    t_start_ns: int = field(default_factory=time.monotonic_ns)

    @property
    def request_id(self) -> str:
        return self.cmd.request_id

    @property
    def prefilling(self) -> bool:
        return self.num_computed < self.num_prompt


class ServingLoop:
    def __init__(
        self,
        *,
        worker: int,
        runner: ModelRunner,
        tokenizer,
        device_pool,
        model_id: str,
        model_digest: str,
        page_tokens: int,
        keys_fn: KeysFn,
        eos_token_ids: Sequence[int] | None = None,
        max_step_tokens: int = 256,
        max_seqs: int = 64,
        clock: Callable[[], int] = time.time_ns,
        graphs: StepGraphs | None = None,
        restores=None,
    ):
        self.worker = worker
        self.runner = runner
        self.tokenizer = tokenizer
        self.pool = device_pool
        self.model_id = model_id
        self.model_digest = model_digest
        self.page = page_tokens
        self.keys_fn = keys_fn
        self.eos = set(eos_token_ids if eos_token_ids is not None else tokenizer.eos_token_ids)
        self.max_step_tokens = max_step_tokens
        self.max_seqs = max_seqs
        self.clock = clock
        self.max_positions = runner.max_positions
        self.vocab_size = runner.config.vocab_size
        self.seqs: dict[str, _Seq] = {}           # running, in arrival order (decodes and prefills)
        self.graphs = graphs or StepGraphs(runner)  # the forward: a captured decode graph or eager
        # restores kept unfinished so a returning turn reads their layers as they land
        # (dataplane/restore_pipeline.py KeptRestores); None: every reused page must be in place
        self.restores = restores
        if restores is not None:
            restores.listener = self.restore_settled
        self.wait_clock = WaitClock()            # what the steps' forwards waited for landing pages
        self.num_steps = 0
        # a rank of a group: the sampled tokens as the group's rank 0 decided them (dataplane/group.py)
        self.agree_tokens: Callable[[list[int]], list[int]] | None = None
        self.log = log.bind(worker=worker)
        # a reader of the pool (dataplane/pools/readers.py): the tensor the runner gets each step is
        # the one bound at ``gen``; a pool of another page shape is refused here (ReaderRefused)
        self.gen = -1
        self.kv: torch.Tensor | None = None
        device_pool.add_reader(self)

    # ------------------------------------------------------------------ the pool's reader
    name = "serving"

    def bind(self, pool, gen: int) -> None:
        """Carry ``pool`` at generation ``gen``: the runner will read and write its tensor. Raises
        ReaderRefused (nothing changed) if its pages are not this model's."""
        want = self.runner.kv_pool_shape(1, self.page)[1:]
        check_fits(self.name, pool.tensor, want, self.runner.dtype, torch.device(self.runner.device))
        self.pool, self.kv, self.gen = pool, pool.tensor, gen
        pool.stamp(self.name, gen)

    def _bound_pool(self) -> torch.Tensor:
        """The bound tensor, if this loop and every other reader carry the pool's generation;
        else raises TornPool naming the readers behind."""
        if self.gen != self.pool.gen:
            raise TornPool(self.pool.tier, self.pool.gen, {**self.pool.behind(), self.name: self.gen}, "serving")
        self.pool.check_usable("serving")
        return self.kv

    def use_model(self, runner: ModelRunner, tokenizer, model_id: str, model_digest: str,
                  eos_token_ids: Sequence[int]) -> None:
        """Serve another model from now on (a flip, dataplane/weights_swap.py): called between
        steps with no sequence running; the pool's pages keep their shape (checked at start)."""
        if self.seqs:
            raise DataPlaneError(f"{len(self.seqs)} sequences still run on {self.model_id}")
        self.runner, self.tokenizer = runner, tokenizer
        self.model_id, self.model_digest = model_id, model_digest
        self.eos = set(eos_token_ids)
        self.max_positions = runner.max_positions
        self.vocab_size = runner.config.vocab_size

    # ------------------------------------------------------------------ queries
    def ready(self, block_bytes: int) -> ServingReady:
        return ServingReady(
            worker=self.worker, model=self.model_id, model_digest=self.model_digest,
            max_context=self.max_positions, page_tokens=self.page, block_bytes=block_bytes,
            device_blocks=self.pool.num_slots, eos_token_ids=sorted(self.eos), max_seqs=self.max_seqs,
            pool_gen=self.pool.gen, readers=sorted(self.pool.readers),
            decode_graph_sizes=list(self.graphs.sizes), decode_graph_bytes=self.graphs.graph_bytes,
            restore_overlap=self.restores is not None,
        )

    def has_work(self) -> bool:
        return bool(self.seqs)

    def holding(self, blocks: Sequence[int]) -> list[int]:
        """Which of ``blocks`` a running sequence reads or writes (a move must not take them)."""
        held = set()
        for s in self.seqs.values():
            held.update(s.cmd.block_ids[:s.num_allocated])
            held.update(s.cmd.copy_from)
        return [b for b in blocks if b in held]

    # ------------------------------------------------------------------ commands
    def handle(self, msg) -> list:
        if isinstance(msg, Tokenize):
            return [self.tokenize(msg)]
        if isinstance(msg, Generate):
            return self.start(msg)
        if isinstance(msg, CancelGenerate):
            s = self.seqs.get(msg.request_id)
            return [self._finish(s, "cancelled")] if s is not None else []
        raise TypeError(f"ServingLoop does not handle {type(msg).__name__}")

    def tokenize(self, msg: Tokenize) -> Tokenized:
        return tokenize_prompt(msg, worker=self.worker, tokenizer=self.tokenizer, max_positions=self.max_positions,
                               vocab_size=self.vocab_size, keys_fn=self.keys_fn, page=self.page,
                               model_digest=self.model_digest)

    def start(self, cmd: Generate, layer_ready: Sequence | None = None) -> list:
        """A sequence joins. ``layer_ready``: per layer, the wait for its reused pages, which a
        restore is still landing layer by layer (dataplane/restore_layers.py); None: in place."""
        P = self.page
        n = len(cmd.token_ids)
        max_tokens = cmd.sampling.max_tokens
        need = -(-(n + max(0, max_tokens - 1)) // P)
        cached_pages = cmd.num_cached_tokens // P
        first_new = 0 if cmd.copy_from else cached_pages
        problem = None
        if cmd.request_id in self.seqs:
            problem = f"request {cmd.request_id} is already running"
        elif n == 0 or cmd.num_cached_tokens % P or not 0 <= cmd.num_cached_tokens < n:
            problem = f"num_cached_tokens {cmd.num_cached_tokens} must be whole pages below the prompt's {n} tokens"
        elif max_tokens < 1 or n + max_tokens > self.max_positions:
            problem = f"prompt {n} + max_tokens {max_tokens} does not fit the context of {self.max_positions}"
        elif len(cmd.block_ids) < need or len(set(cmd.block_ids)) != len(cmd.block_ids):
            problem = f"{len(cmd.block_ids)} distinct pages given, the sequence may need {need}"
        elif cmd.sampling.logprobs is not None and not 0 <= cmd.sampling.logprobs <= MAX_LOGPROBS:
            problem = f"logprobs {cmd.sampling.logprobs} must be in [0, {MAX_LOGPROBS}]"
        elif len(self.seqs) >= self.max_seqs:
            problem = f"{len(self.seqs)} sequences running, the most this worker batches is {self.max_seqs}"
        elif cmd.copy_from and (len(cmd.copy_from) != cached_pages or set(cmd.copy_from) & set(cmd.block_ids)):
            problem = (f"copy_from names {len(cmd.copy_from)} pages; it must name the {cached_pages} cached pages "
                       "and none of block_ids")
        if problem is None:
            try:
                self._bound_pool()
            except TornPool as e:
                problem = str(e)
        landing = None
        if problem is None and cmd.awaits_move and self.restores is not None:
            landing = self.restores.landing(cmd.awaits_move)
        if problem is None:
            reused = list(cmd.copy_from) or cmd.block_ids[:cached_pages]
            try:
                if landing is not None:       # every reused page resident, or landing in the awaited restore
                    missing = [b for b in reused if not self.pool.has(b) and b not in landing[1]]
                    if missing:
                        raise DataPlaneError(f"pages {missing[:8]} are neither resident nor in restore "
                                             f"{cmd.awaits_move}")
                else:
                    self.pool.slots_of(reused)     # resident and verified, or this raises
            except DataPlaneError as e:
                problem = f"{'pages to copy' if cmd.copy_from else 'reused pages'} not usable: {e}"
                if cmd.awaits_move and self.restores is not None:      # say why the restore did not bring them
                    problem += f" (restore {cmd.awaits_move}: {why_not(self.restores.settle(cmd.awaits_move))})"
            new_present = [b for b in cmd.block_ids[first_new:] if self.pool.has(b)]
            if problem is None and new_present:
                problem = f"pages {new_present[:8]} are already in the pool"
        sampling = generator = None
        if problem is None:
            sp = cmd.sampling
            try:
                sampling = ModelSampling.of(sp, max_tokens, self.vocab_size)     # penalties and logit_bias too
                generator = make_generator(sampling, "cpu")
            except (ValueError, RuntimeError, OverflowError) as e:
                problem = f"sampling: {e}"
        later: list = []                            # copies to make once the awaited restore is verified
        if problem is None and cmd.copy_from:       # last: a refusal never has copies to free
            problem, later, reads = take_copies(self.pool, cmd.copy_from, cmd.block_ids[:cached_pages],
                                                landing[1] if landing is not None else None)
            if landing is not None:                 # the prefill reads the donor's landing slots meanwhile
                landing = (landing[0], reads)
        if problem is not None:
            self.log.warning("generate_refused", request_id=cmd.request_id, problem=problem)
            return [TokensGenerated(request_id=cmd.request_id, worker=self.worker, token_ids=[], text="",
                                    finish_reason="error", error=problem, num_prompt_tokens=n,
                                    blocks_unused=list(cmd.block_ids[first_new:]))]
        self.seqs[cmd.request_id] = _Seq(
            cmd=cmd, tokens=list(cmd.token_ids), num_prompt=n, num_computed=cmd.num_cached_tokens,
            num_allocated=cached_pages, num_reported=first_new, first_new=first_new,
            text=TextStream(self.tokenizer, cmd.sampling.stop), sampling=sampling, generator=generator,
            layer_ready=list(layer_ready) if layer_ready is not None else None,
        )
        if landing is not None:
            seq = self.seqs[cmd.request_id]
            seq.awaits, seq.landing, seq.layer_ready = cmd.awaits_move, landing[1], list(landing[0])
            seq.copy_later = later
        return []

    def restore_settled(self, move_id: str, outcome) -> list:
        """A kept restore got its outcome (KeptRestores' listener): the sequences reading its pages
        go on with them in place, or, if it failed, are failed (its error named; nothing they
        computed from the pages was sent)."""
        out = []
        for s in [s for s in self.seqs.values() if s.awaits == move_id]:
            if settled_ok(outcome):
                # landed before the step that reads it ran: that step still reads a restore's pages and
                # reports its wait (measured: none), so it is a list of landed layers, not "no restore"
                landed = [LANDED] * len(s.layer_ready) if s.layer_ready is not None else None
                try:
                    copy_landed(self.pool, s.copy_later)   # a donor's pages, verified now: copied
                except Exception as e:  # noqa: BLE001 - the sequence cannot go on without them
                    out.append(self._finish(s, "error", error=f"the copies of restore {move_id}'s pages failed: {e}"))
                    continue
                s.awaits, s.landing, s.layer_ready, s.copy_later = "", None, landed, []
            else:
                out.append(self._finish(s, "error", error=f"restore {move_id} of its reused pages failed: "
                                                          f"{why_not(outcome)}"))
        return out

    def _slots(self, s: _Seq, blocks: Sequence[int]) -> list[int]:
        """The pool slots of ``blocks``; those still landing in the awaited restore (or, for a copy
        not made yet, its source's landing slot: dataplane/serving_pages.py), from it."""
        if s.landing is None:
            return self.pool.slots_of(blocks)
        landing, slot_of = s.landing, self.pool.slot_of
        return [landing[b] if b in landing else slot_of(b) for b in blocks]

    # ------------------------------------------------------------------ the step
    def _plan(self, only: Collection[str] | None = None) -> list[tuple[_Seq, int]]:
        """(sequence, new tokens) for this step: every decode, then prefill chunks in arrival order
        (``only``: of these sequences, the ones a group agreed on)."""
        budget = self.max_step_tokens
        seqs = list(self.seqs.values()) if only is None else [self.seqs[i] for i in only if i in self.seqs]
        plan = [(s, 1) for s in seqs if not s.prefilling]
        budget -= len(plan)
        for s in seqs:
            if s.prefilling and budget > 0:
                n = min(s.num_prompt - s.num_computed, budget)
                plan.append((s, n))
                budget -= n
        return plan

    def _layer_waits(self, plan: list[tuple[_Seq, int]]) -> list | None:
        """The step's per-layer waits for pages still landing (taken: the next step reads them in place)."""
        per_seq = []
        for s, _ in plan:
            if s.layer_ready is not None:
                per_seq.append(s.layer_ready)
                s.layer_ready = None
        joined = join_layers(per_seq, self.runner.config.num_layers)
        return timed(joined, self.wait_clock) if joined is not None else None

    def step(self, only: Collection[str] | None = None) -> list:
        if self.restores is not None and self.restores.kept:
            self.restores.poll()          # landed meanwhile: settled first (a failed one fails its sequences)
        plan = self._plan(only)
        if not plan:
            return []
        t0 = time.perf_counter_ns()
        out: list = []
        batch: list[SeqInput] = []
        try:
            kv = self._bound_pool()          # a torn pool: every sequence of the step fails, named
            for s, n in plan:
                end = s.num_computed + n
                pages = -(-end // self.page)
                if pages > s.num_allocated:
                    self.pool.allocate(s.cmd.block_ids[s.num_allocated:pages])
                    s.num_allocated = pages
                batch.append(SeqInput(s.tokens[s.num_computed:end], s.num_computed,
                                      self._slots(s, s.cmd.block_ids[:pages])))
            waits = self._layer_waits(plan)
            logits, path = self.graphs.forward(batch, kv, waits)
        except Exception as e:  # noqa: BLE001 - a failed step fails its sequences, never the worker
            self.log.error("step_failed", error=repr(e), num_seqs=len(plan))
            for s, _ in plan:
                out.append(self._finish(s, "error", error=f"{type(e).__name__}: {e}"))
            return out
        waited = self.wait_clock.take() if waits is not None else None
        # NOTE: what the step computed from pages still landing leaves only once their restore is
        # verified: settled here, before any sampling (a failed one fails its sequences instead)
        for mid in dict.fromkeys(s.awaits for s, _ in plan if s.awaits):
            self.restores.settle(mid)
        duration = time.perf_counter_ns() - t0
        self.num_steps += 1
        digest = hashlib.blake2b(";".join(f"{s.request_id}:{s.num_computed}+{n}" for s, n in plan).encode(),
                                 digest_size=8).hexdigest()
        out.append(StepCompleted(worker=self.worker, step=self.num_steps, batch_digest=digest, num_seqs=len(plan),
                                 num_tokens=sum(n for _, n in plan), duration_ns=duration,
                                 decode_path=path.path, restore_wait_ns=waited,
                                 tables_digest=tables_digest([(s.request_id, s.cmd.block_ids) for s, _ in plan])))
        ready = []
        for i, (s, n) in enumerate(plan):
            if s.request_id not in self.seqs:            # failed with its restore: nothing of it leaves
                continue
            s.num_computed += n
            if s.num_computed == len(s.tokens):          # every known token is in: sample the next
                ready.append((i, s))
            else:                                        # a prefill chunk: report the pages it filled
                blocks, keys = self._full_pages(s)
                if blocks:
                    out.append(TokensGenerated(request_id=s.request_id, worker=self.worker, token_ids=[], text="",
                                               blocks_written=blocks, keys_written=keys))
        if ready:
            rows = logits[[i for i, _ in ready]] if len(ready) < len(plan) else logits
            try:
                tokens = sample(rows, [s.sampling for _, s in ready], [s.generator for _, s in ready],
                                [(s.tokens, s.num_prompt) for _, s in ready])
                lps = self._logprobs(rows, ready, tokens)
            except Exception as e:  # noqa: BLE001 - one sequence's failure must neither fail nor wedge the batch
                self.log.error("sampling_failed", error=repr(e), num_seqs=len(ready))
                out += self._sample_each(rows, ready)
                return out
            if self.agree_tokens is not None:       # a group's rank: rank 0's tokens, never its own guess
                try:
                    tokens = self.agree_tokens(list(tokens))
                except Exception as e:  # noqa: BLE001 - the group's store failed: these sequences cannot go on
                    self.log.error("tokens_not_agreed", error=repr(e), num_seqs=len(ready))
                    return out + [self._finish(s, "error", error=f"the group's tokens were not told: {e}")
                                  for _, s in ready]
            for j, ((_, s), t) in enumerate(zip(ready, tokens)):
                out.append(self._advance(s, t, lps.get(j)))
        return out

    def _sample_each(self, rows, ready: list[tuple[int, _Seq]]) -> list:
        """After a batch's sampling raised: each sequence alone; one that still fails is finished
        with its error (its pages freed), the others go on."""
        out = []
        for j, (_, s) in enumerate(ready):
            try:
                (t,) = sample(rows[j:j + 1], [s.sampling], [s.generator], [(s.tokens, s.num_prompt)])
                lp = self._logprobs(rows[j:j + 1], [(0, s)], [t]).get(0)
            except Exception as e:  # noqa: BLE001
                out.append(self._finish(s, "error", error=f"{type(e).__name__}: {e}"))
                continue
            out.append(self._advance(s, t, lp))
        return out

    def _logprobs(self, rows, ready: list[tuple[int, _Seq]], tokens: list[int]) -> dict[int, TokenLogprobs]:
        """The sampled tokens' log-probabilities, for the sequences that asked (row -> them)."""
        want = [j for j, (_, s) in enumerate(ready) if s.cmd.sampling.logprobs is not None]
        if not want:
            return {}
        found = token_logprobs(rows[want], [tokens[j] for j in want],
                               [ready[j][1].cmd.sampling.logprobs for j in want])
        return {j: TokenLogprobs(chosen=self._choice(tokens[j], lp), top=[self._choice(i, x) for i, x in top])
                for j, (lp, top) in zip(want, found)}

    def _choice(self, token: int, logprob: float) -> TokenChoice:
        raw = self.tokenizer.token_bytes(token)
        return TokenChoice(token_id=token, text=raw.decode(errors="replace"), token_bytes=raw, logprob=logprob)

    def _full_pages(self, s: _Seq) -> tuple[list[int], list[str]]:
        full = s.num_computed // self.page
        if full <= s.num_reported:
            return [], []
        keys = self.keys_fn(s.tokens[:full * self.page], self.page, self.model_digest)
        blocks = list(s.cmd.block_ids[s.num_reported:full])
        out = blocks, keys[s.num_reported:full]
        s.num_reported = full
        return out

    def _advance(self, s: _Seq, token: int, logprobs: TokenLogprobs | None = None) -> TokensGenerated:
        s.tokens.append(token)
        s.num_generated += 1
        sp = s.cmd.sampling
        if token in self.eos and not sp.ignore_eos:
            return self._finish(s, "stop", last=[token])       # no text, no logprobs: the turn ended
        lps = [logprobs] if logprobs is not None else []
        delta = s.text.push(token)
        if s.text.stopped is not None:
            return self._finish(s, "stop", last=[token], text=delta, logprobs=lps)
        if s.num_generated >= sp.max_tokens or len(s.tokens) >= self.max_positions:
            return self._finish(s, "length", last=[token], text=delta, logprobs=lps)
        blocks, keys = self._full_pages(s)
        return TokensGenerated(request_id=s.request_id, worker=self.worker, token_ids=[token], text=delta,
                               blocks_written=blocks, keys_written=keys, logprobs=lps)

    def fail(self, request_id: str, error: str) -> list:
        """End one sequence with ``error`` (its pages freed and reported, as a failed step's)."""
        s = self.seqs.get(request_id)
        return [] if s is None else [self._finish(s, "error", error=error)]

    def _finish(self, s: _Seq, reason: str, *, last: list[int] | None = None, text: str = "",
                error: str | None = None, logprobs: list[TokenLogprobs] | None = None) -> TokensGenerated:
        """The sequence leaves: report its last pages, free what it must, hand back the rest."""
        self.seqs.pop(s.request_id, None)
        if reason in ("stop", "length"):
            text += s.text.flush()
        blocks, keys = self._full_pages(s)
        pages = s.cmd.block_ids
        if s.num_allocated > s.num_reported:    # the partial tail (or, after a failed step, unwritten pages)
            tail = list(pages[s.num_reported:s.num_allocated])
            blocks, keys = blocks + tail, keys + [""] * len(tail)
            s.num_reported = s.num_allocated
        freed, bytes_freed = [], 0
        if s.cmd.free_on_finish or reason not in ("stop", "length"):
            freed = list(pages[s.first_new:s.num_allocated])
            bytes_freed = self.pool.free(freed) if freed else 0
        self.log.info("generate_finished", request_id=s.request_id, reason=reason, num_generated=s.num_generated,
                      ms=round((time.monotonic_ns() - s.t_start_ns) / 1e6, 1), pages_freed=len(freed))
        return TokensGenerated(
            request_id=s.request_id, worker=self.worker, token_ids=list(last or []), text=text,
            finish_reason=reason, error=error, num_prompt_tokens=s.num_prompt,
            num_computed_tokens=max(0, min(s.num_computed, s.num_prompt) - s.cmd.num_cached_tokens),
            blocks_unused=list(pages[s.num_allocated:]), blocks_written=blocks, keys_written=keys,
            blocks_freed=freed, bytes_freed=bytes_freed, logprobs=logprobs or [],
        )
