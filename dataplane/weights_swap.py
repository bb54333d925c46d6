"""The worker's side of flip: ``SwapWeights`` executed on the device thread, like ``ResizePool``.

    flip   the rotation (dataplane/flip/rotation.py): the arena's image goes to the host slab while
           the slab's comes in; a model only in its file is read into the slab first
    sleep  level 1: the arena's image is copied to a pinned sleep buffer (checked), then the
           arena's device memory is given back; level 2: the image is dropped (its checksum kept)
    wake   the image that slept comes back (level 2: read from its file) and is checked

Refused before anything changes (``WeightsSwapped.error``, with the numbers): an unknown model, a
sequence still running, sleep while asleep, wake while awake, a flip while asleep, a ``to_gen``
that does not move forward, a host image failing its checksum, a slab too small, a sleep buffer
the pinned budget cannot fund, a reader that refuses the incoming layout.

The arena's readers, stamped with ``to_gen`` all or none (arena.install):

    runner    the incoming model's runner: its weights become views of the arena
    serving   the serving loop: runner, tokenizer, digest, context of the incoming model
    graphs    the decode CUDA graphs: captured again for the incoming weights (dropped on a sleep)

While the device is without weights, or holds another model than a request names, ``gate``
says why; the serving worker answers such a Generate with that error at once. A Tokenize that
names a model the worker serves needs no weights: ``ModelTokenizer`` answers it with that model's
own tokenizer, resident or not; one naming no model is gated like a Generate.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import structlog
import torch

from residency.dataplane.flip.arena import WeightsArena
from residency.dataplane.flip.errors import FlipRefused, ReaderRefused
from residency.dataplane.flip.image import Image
from residency.dataplane.flip.rotation import RotationExecutor
from residency.dataplane.flip.slab import HostSlab
from residency.dataplane.pools.budget import page_round
from residency.dataplane.pools.errors import ChecksumMismatch, DataPlaneError
from residency.dataplane.serving_text import tokenize_prompt
from residency.dataplane.flip.model_image import manifest_of
from residency.dataplane.weights_models import ModelSpec, ServedWeights, pack_into, read_host
from residency.events.commands import SwapWeights, WeightsSwapped
from residency.events.serving import ServedModel, Tokenize, Tokenized

log = structlog.get_logger("dataplane.weights_swap")
KEEP_ANSWERS = 64
SLEEP_OWNER = "weights-sleep"


class ServingReader:
    """The serving loop as a reader of the arena: bound, it serves ``entry``'s model."""

    name = "serving"

    def __init__(self, loop, entry: ServedWeights):
        self.loop, self.entry = loop, entry
        self.gen: int | None = None

    def refusal(self, manifest) -> str | None:
        if self.loop.seqs:
            ids = list(self.loop.seqs)
            return f"{len(ids)} sequences still run on {self.loop.model_id}: {ids[:4]}"
        return None

    def bind(self, views, gen: int) -> None:
        m = self.entry.model
        self.loop.use_model(m.runner, m.tokenizer, self.entry.name, m.kv_digest, sorted(m.tokenizer.eos_token_ids))
        self.gen = gen

    def unbind(self) -> None:
        self.gen = None


class GraphsReader:
    """The decode graphs as a reader of the arena: they hold the weights' addresses, so every new
    image (or the same one at a new address, after a wake) is captured again; unbound, dropped."""

    name = "graphs"

    def __init__(self, graphs, entry: ServedWeights, pool, page_tokens: int, max_seqs: int, capture: bool):
        self.graphs, self.entry, self.pool = graphs, entry, pool
        self.page, self.max_seqs, self.capture = page_tokens, max_seqs, capture
        self.gen: int | None = None

    def refusal(self, manifest) -> str | None:
        return None

    def bind(self, views, gen: int) -> None:
        from residency.dataplane.serving_graphs import graph_table_width  # noqa: PLC0415

        runner = self.entry.model.runner
        self.graphs.use_runner(runner, self.pool.tensor, max_seqs=self.max_seqs, capture=self.capture,
                               max_blocks_per_seq=graph_table_width(runner.max_positions, self.page))
        self.gen = gen

    def unbind(self) -> None:
        self.graphs.drop()
        self.gen = None


class ModelTokenizer:
    """One model's Tokenize, whether or not its weights are on the device: rendering and encoding
    read only its tokenizer, chat template, context, vocabulary and content-key digest, all fixed
    at start. So the control can tokenize a request for a model while a flip brings it in (no lock:
    nothing here changes under a flip). Both call ``tokenize_prompt``, so the ids and keys are
    exactly those the loop gives once the model is resident."""

    def __init__(self, loop, entry: ServedWeights):
        m = entry.model
        self.worker, self.page, self.keys_fn = loop.worker, loop.page, loop.keys_fn
        self.tokenizer, self.model_digest = m.tokenizer, m.kv_digest
        self.max_positions, self.vocab_size = m.runner.max_positions, m.runner.config.vocab_size

    def tokenize(self, msg: Tokenize) -> Tokenized:
        return tokenize_prompt(msg, worker=self.worker, tokenizer=self.tokenizer, max_positions=self.max_positions,
                               vocab_size=self.vocab_size, keys_fn=self.keys_fn, page=self.page,
                               model_digest=self.model_digest)


def device_free_bytes(device: torch.device) -> int | None:
    """The driver's free bytes after the allocator gave back its cache (CUDA); None elsewhere."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return int(torch.cuda.mem_get_info(device)[0])


class WeightsSwapper:
    """Owns the arena, the slab, the sleep buffer and the table of models (device thread only;
    ``gate`` and ``ready`` may run on other threads and take ``lock``)."""

    def __init__(self, *, worker: int, arena: WeightsArena, models: list[ServedWeights], slab: HostSlab | None,
                 budget, loop, graphs, pool, dtype: torch.dtype, chunk_bytes: int, ring_depth: int = 2,
                 capture_graphs: bool = False, books=None, clock: Callable[[], int] = time.time_ns,
                 keep: HostSlab | None = None, tp=None, faults=None):
        self.worker, self.arena, self.slab, self.budget = worker, arena, slab, budget
        # keep: a second pinned image buffer (two models, host memory for both; serving_worker
        # decides at start). With it, the slab and keep hold both images and a flip copies only
        # the incoming one; without it, every flip runs the rotation.
        self.keep = keep
        self.tp = tp                           # a group's rank: a model read again is read as its share
        self.faults = faults
        self.models = {m.name: m for m in models}
        self.loop, self.dtype, self.books, self.clock = loop, dtype, books, clock
        self.executor = RotationExecutor(arena, slab, chunk_bytes, ring_depth) if slab is not None else None
        self.last_flip = None                  # the last rotation's FlipResult (benches read the device's overlap)
        self.sleeper: HostSlab | None = None
        self.asleep: tuple[str, int] | None = None            # (model, level) while asleep
        self._graphs, self._pool, self._capture = graphs, pool, capture_graphs
        self.lock = threading.Lock()
        self._answers: dict[str, WeightsSwapped] = {}
        self.log = log.bind(worker=worker)

    # ------------------------------------------------------------ queries
    @property
    def resident(self) -> str:
        return self.arena.image.model if self.arena.image is not None else ""

    def readers_for(self, entry: ServedWeights) -> list:
        """The arena's readers for ``entry``'s image, in binding order (runner views first)."""
        return [entry.reader, ServingReader(self.loop, entry),
                GraphsReader(self._graphs, entry, self._pool, self.loop.page, self.loop.max_seqs, self._capture)]

    def gate(self, model: str) -> str | None:
        """Why a request naming ``model`` ("" : the resident one) cannot run now, or None. A caller
        off the device thread holds ``lock`` until its request is done with the model (a Tokenize:
        the tokenizer and digest must not change under it)."""
        if self.asleep is not None:
            name, level = self.asleep
            return f"weights_asleep: the worker's weights are asleep (level {level}, model {name}); wake it first"
        if self.arena.image is None:
            return "weights_unbound: no model's weights are on the device (a flip's checksum failed)"
        if model and model != self.resident:
            if model not in self.models:
                return f"model_unknown: this worker serves {sorted(self.models)}, not {model!r}"
            return f"model_not_resident: {model} is not on the device ({self.resident} is); flip to it first"
        return None

    def ready(self, base):
        """``base`` (the serving loop's ServingReady) with every model, the resident one and the
        arena's generation."""
        import msgspec  # noqa: PLC0415

        return msgspec.structs.replace(base, models=self.served_models(base.block_bytes), resident=self.resident,
                                       arena_gen=self.arena.gen)

    def served_models(self, block_bytes: int) -> list[ServedModel]:
        out = []
        for e in self.models.values():
            m = e.model
            out.append(ServedModel(name=e.name, digest=m.kv_digest, max_context=m.runner.max_positions,
                                   eos_token_ids=sorted(m.tokenizer.eos_token_ids), weights_bytes=e.nbytes,
                                   block_bytes=block_bytes, image_checksum=e.checksum_hex(),
                                   host_image=e.where in ("host", "slept") or self._host_copy(e.name) is not None))
        return out

    def check_integrity(self) -> None:
        self.arena.check_integrity()
        for buf in (self.slab, self.keep):
            if buf is not None:
                buf.check_integrity()
        on_device = [e.name for e in self.models.values() if e.where == "device"]
        if on_device != ([self.resident] if self.resident else []):
            raise DataPlaneError(f"models marked on the device {on_device}, the arena holds {self.resident!r}")

    # ------------------------------------------------------------ the command
    def handle(self, cmd: SwapWeights) -> list:
        """The answer to ``cmd``; the same flip_id sent again gets the same answer."""
        done = self._answers.get(cmd.flip_id)
        if done is None:
            with self.lock:
                done = self._answers[cmd.flip_id] = self.swap(cmd)
            while len(self._answers) > KEEP_ANSWERS:
                self._answers.pop(next(iter(self._answers)))
            self.tell_books()
        return [done]

    def swap(self, cmd: SwapWeights) -> WeightsSwapped:
        started = self.clock()
        base = dict(flip_id=cmd.flip_id, worker=self.worker, action=cmd.action, from_model=self.resident,
                    from_gen=self.arena.gen, to_gen=cmd.to_gen, started_ns=started)

        def refuse(why: str, refused: dict[str, str] | None = None) -> WeightsSwapped:
            self.log.warning("swap_refused", flip_id=cmd.flip_id, action=cmd.action, to_model=cmd.to_model, why=why)
            return WeightsSwapped(**base, resident=self.resident, refused=dict(refused or {}),
                                  finished_ns=self.clock(), error=why)

        act = {"flip": self._flip, "sleep": self._sleep, "wake": self._wake}.get(cmd.action)
        if act is None:
            return refuse(f"unknown action {cmd.action!r} (flip, sleep, wake)")
        if self.faults is not None and self.faults.before_swap():
            return refuse(f"fault_injected: refuse_swap={self.faults.refuse_swap} (nothing moved)")
        if (why := self.arena.gen_refusal(cmd.to_gen)) is not None:
            return refuse(why)
        if self.loop.seqs and cmd.action != "wake":
            ids = list(self.loop.seqs)
            return refuse(f"{len(ids)} sequences of {self.loop.model_id} still run: {ids[:4]}; park them first")
        try:
            fields = act(cmd)
        except ReaderRefused as e:
            return refuse(str(e), e.refusals)
        except (FlipRefused, DataPlaneError) as e:       # ChecksumMismatch and PinnedBudgetExceeded among them
            return refuse(f"{type(e).__name__}: {e}")
        if isinstance(fields, str):
            return refuse(fields)
        out = WeightsSwapped(**base, resident=self.resident, finished_ns=self.clock(),
                             stamps={r.name: r.gen for r in self.arena.readers}, **fields)
        self.log.info("weights_swapped", flip_id=cmd.flip_id, action=cmd.action, from_model=out.from_model,
                      resident=out.resident, to_gen=out.to_gen, bytes_out=out.bytes_out, bytes_in=out.bytes_in,
                      dropped_bytes=out.dropped_bytes, checksum_ok=out.checksum_ok,
                      measured_freed_bytes=out.measured_freed_bytes, ms=(out.finished_ns - started) // 1_000_000)
        return out

    # ------------------------------------------------------------ flip
    def _flip(self, cmd: SwapWeights) -> dict | str:
        target = self.models.get(cmd.to_model)
        if target is None:
            return f"unknown model {cmd.to_model!r}: this worker serves {sorted(self.models)}"
        if self.asleep is not None:
            return f"asleep (model {self.asleep[0]}, level {self.asleep[1]}): wake it before a flip"
        if target.where == "device":
            return f"{target.name} is already resident (arena gen {self.arena.gen})"
        if self.executor is None:
            return "this worker has one model: nothing to flip to"
        if not self.resident:
            return "the arena holds no verified image (an earlier flip's checksum failed): nothing to flip out"
        outgoing = self.models[self.resident]
        if self.keep is not None:
            return self._copy_flip(cmd, target, outgoing)
        if target.where == "file":
            self._stage(target)
        before = device_free_bytes(self.arena.device)
        res = self.last_flip = self.executor.flip(self.readers_for(target), to_gen=cmd.to_gen)
        outgoing.where, outgoing.sums = "host", self.slab.image.sums
        if res.checksum_ok:
            target.where = "device"
        else:                     # neither image is what its checksums say: nothing serves
            target.where = "file"
            self.log.error("flip_torn", flip_id=cmd.flip_id, mismatches=list(res.mismatches))
        after = device_free_bytes(self.arena.device)
        return dict(bytes_out=res.bytes_out, bytes_in=res.bytes_in, steps=res.steps,
                    overlapped_steps=res.overlapped_steps, checksum_ok=res.checksum_ok,
                    out_ns=int(res.d2h_s * 1e9), in_ns=int(res.h2d_s * 1e9),
                    measured_freed_bytes=None if before is None else after - before)

    def _host_copy(self, name: str) -> HostSlab | None:
        """The pinned buffer (slab or keep) holding ``name``'s image, or None."""
        for buf in (self.slab, self.keep):
            if buf is not None and buf.image is not None and buf.image.model == name:
                return buf
        return None

    def _copy_flip(self, cmd: SwapWeights, target: ServedWeights, outgoing: ServedWeights) -> dict | str:
        """A flip when the host holds both images: weights are immutable while served, so the
        outgoing image's host copy (checked against its checksums) is still the image and only the
        incoming bytes cross the link. A host copy missing or rotted is made again first (D2H
        into the buffer not holding the incoming image, verified), before the arena changes."""
        src = self._host_copy(target.name)
        if src is None:
            return f"{target.name} has no host image (where: {target.where}): nothing to copy in"
        readers = self.readers_for(target)
        self.arena.check_readers(readers, target.manifest)
        src.verify()                          # a host image that fails is refused before anything moves
        spare = self.keep if src is self.slab else self.slab
        before = device_free_bytes(self.arena.device)
        image = self.arena.seal()
        kept = spare.image is not None and spare.image.model == outgoing.name
        if kept:
            try:
                spare.verify()
            except ChecksumMismatch as e:     # the copy rotted: made again from the arena below
                kept = False
                self.log.warning("host_copy_failed_checksum", model=outgoing.name, why=str(e))
        bytes_out = out_ns = 0
        if not kept:
            n = image.nbytes
            off = spare.offset if spare.offset + n <= spare.capacity_bytes else 0
            t0 = time.perf_counter_ns()
            spare.image = None
            spare.bytes[off: off + n].copy_(self.arena.image_bytes())
            out_ns, bytes_out = time.perf_counter_ns() - t0, n
            spare.image, spare.offset = image, off
            try:
                spare.verify()                # the arena is untouched yet: a bad copy is refused here
            except ChecksumMismatch:
                spare.image = None
                raise
        outgoing.sums = image.sums
        self.arena.detach()
        incoming = Image(target.name, target.manifest, src.image.sums)
        t0 = time.perf_counter_ns()
        ok, mismatches = True, []
        try:
            self.arena.copy_in(incoming, src.image_bytes())      # checked against the incoming sums
        except ChecksumMismatch as e:
            ok, mismatches = False, [str(e)]
        in_ns = time.perf_counter_ns() - t0
        outgoing.where = "host"
        if ok:
            self.arena.install(incoming, readers, cmd.to_gen)
            target.where = "device"
        else:                     # the arena is not the image: nothing serves; both host copies stand
            target.where = "host"
            self.log.error("flip_torn", flip_id=cmd.flip_id, mismatches=mismatches)
        after = device_free_bytes(self.arena.device)
        # one whole-image copy per direction that moved: steps count copies, none overlap
        return dict(bytes_out=bytes_out, bytes_in=incoming.nbytes, steps=1 + (bytes_out > 0), overlapped_steps=0,
                    checksum_ok=ok, out_ns=out_ns, in_ns=in_ns,
                    measured_freed_bytes=None if before is None else after - before)

    def _stage(self, target: ServedWeights) -> None:
        """Read a model that lives only in its file into the slab, where the slab's image sits; the
        image there goes back to being only in its file. Checked against the sums of start: a
        file that changed is refused (ChecksumMismatch) before a byte reaches the device."""
        _, weights, *_ = read_host(_spec(target), self.dtype, self.tp)
        if manifest_of(weights) != target.manifest:
            raise DataPlaneError(f"model file of {target.name} no longer gives the image it gave at start")
        for e in self.models.values():
            if e.where == "host":
                e.where = "file"
        self.slab.image = None
        pack_into(self.slab.bytes, target.manifest, weights, self.slab.offset)
        self.slab.image = Image(target.name, target.manifest, target.sums)
        target.where = "host"
        self.log.info("weights_staged_from_file", model=target.name, bytes=target.nbytes)
        try:
            self.slab.verify()
        except ChecksumMismatch:
            self.slab.image, target.where = None, "file"
            raise

    # ------------------------------------------------------------ sleep and wake
    def _sleep(self, cmd: SwapWeights) -> dict | str:
        if self.asleep is not None:
            return f"already asleep (model {self.asleep[0]}, level {self.asleep[1]})"
        if cmd.level not in (1, 2):
            return f"sleep level {cmd.level}: 1 (weights to pinned host) or 2 (weights dropped)"
        if not self.resident:
            return "the arena holds no verified image (an earlier flip's checksum failed): nothing to put to sleep"
        entry = self.models[self.resident]
        image = self.arena.seal()             # the checksum a wake checks against
        entry.sums = image.sums
        before = device_free_bytes(self.arena.device)
        out_ns = bytes_out = dropped = 0
        if cmd.level == 1:
            need = page_round(max(image.nbytes, 1))
            if (refused := self.budget.refusal(SLEEP_OWNER, need)) is not None:
                return f"the sleep buffer cannot be pinned: {refused}"
            sleeper = HostSlab(self.budget, image.nbytes, owner=SLEEP_OWNER)
            try:
                t0 = time.perf_counter_ns()
                sleeper.bytes[: image.nbytes].copy_(self.arena.image_bytes())
                out_ns, bytes_out = time.perf_counter_ns() - t0, image.nbytes
                sleeper.image = image
                sleeper.verify()              # the copy is checked before the device copy goes
            except BaseException:
                sleeper.close()
                raise
            self.sleeper, entry.where = sleeper, "slept"
        else:
            dropped, entry.where = image.nbytes, "dropped"
        self.arena.release(cmd.to_gen)
        self.asleep = (entry.name, cmd.level)
        after = device_free_bytes(self.arena.device)
        return dict(bytes_out=bytes_out, dropped_bytes=dropped, checksum_ok=True, out_ns=out_ns,
                    measured_freed_bytes=None if before is None else after - before)

    def _wake(self, cmd: SwapWeights) -> dict | str:
        if self.asleep is None:
            return f"awake: {self.resident or 'no model'} is resident; nothing to wake"
        name, level = self.asleep
        if cmd.to_model not in ("", name):
            return f"wake brings back {name}, the model that slept, not {cmd.to_model!r}: flip after waking"
        entry = self.models[name]
        readers = self.readers_for(entry)
        self.arena.check_readers(readers, entry.manifest)
        if level == 1:
            self.sleeper.verify()             # a host image that fails is refused before it moves
        before = device_free_bytes(self.arena.device)
        if before is not None and before < self.arena.capacity_bytes:
            return (f"the weights arena needs {self.arena.capacity_bytes} device bytes, the driver has {before} "
                    f"free: give the device memory back first (still asleep)")
        t0 = time.perf_counter_ns()
        try:
            self.arena.reserve()
        except torch.OutOfMemoryError as e:
            return f"the weights arena of {self.arena.capacity_bytes} device bytes cannot be allocated: {e}"
        image = Image(name, entry.manifest, entry.sums)
        try:
            if level == 1:
                self.arena.copy_in(image, self.sleeper.image_bytes())
            else:
                _, weights, *_ = read_host(_spec(entry), self.dtype, self.tp)
                if manifest_of(weights) != entry.manifest:
                    raise DataPlaneError(f"model file of {name} no longer gives the image it gave at start")
                pack_into(self.arena.buffer, entry.manifest, weights)     # straight into the arena
                del weights
                self.arena.image = image
                try:
                    self.arena.verify()
                except ChecksumMismatch:
                    self.arena.image = None
                    raise
        except BaseException:
            self.arena.release(self.arena.gen)        # still asleep, the device given back again
            raise
        in_ns = time.perf_counter_ns() - t0
        self.arena.install(image, readers, cmd.to_gen)
        if self.sleeper is not None:
            self.sleeper.close()
            self.sleeper = None
        self.asleep, entry.where = None, "device"
        after = device_free_bytes(self.arena.device)
        return dict(bytes_in=image.nbytes, checksum_ok=True, in_ns=in_ns,
                    measured_freed_bytes=None if before is None else after - before)

    # ------------------------------------------------------------ the books
    def tier_bytes(self) -> dict[str, int]:
        """The resident model's image bytes by tier (the WeightsLoaded of a new incarnation)."""
        e = self.models.get(self.resident)
        return {"device": e.nbytes} if e is not None else {}

    def tell_books(self) -> None:
        if self.books is not None:
            e = self.models.get(self.resident)
            self.books.set_weights(self.resident, self.arena.held_bytes, self.tier_bytes(),
                                   e.checksum_hex() if e is not None else "")

    def close(self) -> None:
        """Give the pinned buffers back (the worker is stopping)."""
        for buf in (self.sleeper, self.slab, self.keep):
            if buf is not None and buf.bytes is not None:
                buf.close()
        self.sleeper = None


def _spec(entry: ServedWeights) -> ModelSpec:
    return ModelSpec(entry.name, entry.path)


__all__ = ["WeightsSwapper", "ServingReader", "ModelTokenizer", "GraphsReader", "device_free_bytes"]
