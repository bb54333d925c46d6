"""The serving messages between the control process and a data-plane worker that serves a model
(never stored as events; re-exported by ``events.commands``, whose unions hold them).
"""
from __future__ import annotations

import msgspec

from residency.events.message import Message


# A request's life on the wire:
#   control: Tokenize ─► worker: Tokenized (ids + content keys of its full pages)
#   control: [ExecuteMove restore … MoveAcked]  Generate ─► worker: TokensGenerated … BlocksWritten …
#            TokensGenerated(finish_reason)      (CancelGenerate ends it early: finish "cancelled")
#   worker:  StepCompleted after every batched forward step (the ledger's compact step record)
class ChatTurn(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False):
    """One message of a conversation, as the client sent it (rendered by the model's own template)."""

    role: str
    content: str


MAX_LOGPROBS = 20                     # the most alternatives a token's logprobs may list
MAX_PENALTY = 2.0                     # presence and frequency penalties lie in [-MAX_PENALTY, MAX_PENALTY]
MAX_LOGIT_BIAS = 100.0                # a logit_bias value lies in [-MAX_LOGIT_BIAS, MAX_LOGIT_BIAS]
MAX_LOGIT_BIAS_TOKENS = 1024          # the most token ids one request's logit_bias may name


class SamplingParams(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False):
    max_tokens: int
    temperature: float = 1.0          # 0 = greedy
    top_p: float = 1.0
    seed: int | None = None           # None = not seeded (a fresh generator per request)
    stop: list[str] = []              # stop strings; the text returned ends before the match
    ignore_eos: bool = False
    logprobs: int | None = None       # None: none; k: each token's log-probability and the k likeliest
    # penalties, applied to the logits before temperature, top_p and greedy's argmax
    # (dataplane/model/penalties.py); the defaults ask for none, so older senders still decode
    presence_penalty: float = 0.0     # [-2, 2]: subtracted once from every token the completion generated
    frequency_penalty: float = 0.0    # [-2, 2]: subtracted per time the completion generated the token
    repetition_penalty: float = 1.0   # > 0: CTRL's rule over prompt + completion (1 = none)
    logit_bias: dict[int, float] = {}  # token id -> added to its logit, [-100, 100]


class TokenChoice(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """A token at one position with its log-probability under the model (the raw distribution:
    before temperature and top_p), its text alone and the exact bytes it stands for (a token may
    hold part of a UTF-8 character; its text then shows U+FFFD)."""

    token_id: int
    text: str
    token_bytes: bytes
    logprob: float


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """The sampled token at one position and the likeliest ``SamplingParams.logprobs`` there."""

    chosen: TokenChoice
    top: list[TokenChoice] = []


class Tokenize(Message):
    """Render (chat) and tokenize a prompt the model's way. Exactly one of the three is set."""

    request_id: str
    messages: list[ChatTurn] | None = None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    model: str = ""                   # which of the worker's models ("": the resident one)


class Tokenized(Message):
    request_id: str
    worker: int
    token_ids: list[int]
    keys: list[str]                   # content keys of token_ids' full pages, in order
    error: str | None = None          # e.g. "chat_template_missing: ..."; token_ids is then []
    vocab_size: int | None = None     # the model's; the control checks logit_bias ids against it (None: not told)


class ServedModel(msgspec.Struct, frozen=True, kw_only=True, array_like=True, gc=False):
    """One of a worker's models (``residency serve --model NAME=PATH`` repeated). Models that share a
    worker share its KV pool, so they must have the same ``block_bytes`` (refused at start otherwise)."""

    name: str
    digest: str
    max_context: int
    eos_token_ids: list[int]
    weights_bytes: int
    block_bytes: int
    image_checksum: str = ""
    host_image: bool = False          # a pinned host copy of its image is kept (a flip to it moves no file bytes)


class ServingReady(Message):
    """The worker loaded a model and can serve it (sent once, after Hello)."""

    worker: int
    model: str                        # the id clients name in requests
    model_digest: str
    max_context: int                  # positions the model supports (prompt + completion)
    page_tokens: int
    block_bytes: int
    device_blocks: int                # logical blocks the device pool can hold
    eos_token_ids: list[int]
    max_seqs: int = 0                 # sequences it batches at once (0: not said; no limit kept)
    pool_gen: int = 0                 # generation of its device pool (the dial: every resize adds one)
    readers: list[str] = []           # its readers of the device pool, each stamped on a rebind
    decode_graph_sizes: list[int] = []     # batch sizes of its captured decode graphs ([]: none, e.g. on CPU)
    decode_graph_bytes: int | None = None  # device memory the graphs hold (None: none captured, not measured)
    restore_overlap: bool = False          # a turn's prefill starts while its restore lands, layer by layer
    # every model the worker was started with (issue #28; [] : only ``model``), and the one whose
    # weights its arena holds now ("" : asleep). ``model``/``model_digest``/``max_context``/
    # ``eos_token_ids`` above describe the resident one at start.
    models: list[ServedModel] = []
    resident: str = ""
    arena_gen: int = 0


class Generate(Message):
    """Run one sequence. ``block_ids`` are its pages in order, enough for prompt + max_tokens;
    the first ``num_cached_tokens // page_tokens`` already hold this prompt's KV (resident, verified).

    When it ends, the worker frees the pages it wrote if ``free_on_finish`` (a request outside a
    session) or if it did not finish normally (cancelled, failed); a session's turn keeps them.
    The reused pages are never freed by the worker: they belong to earlier turns (or, for a
    request outside a session, to another session whose prefix it shares).

    ``copy_from``: another session's resident pages holding this prompt's first
    ``num_cached_tokens`` positions; the worker copies them into the first pages of
    ``block_ids`` on the device before the prefill, and those copies are then this sequence's new
    pages (reported written, freed like them). The source pages are held (no move may take them)
    while the sequence runs."""

    request_id: str
    session: str | None
    token_ids: list[int]
    block_ids: list[int]
    num_cached_tokens: int
    sampling: SamplingParams
    free_on_finish: bool = False
    copy_from: list[int] = []
    model: str = ""                   # the model the request names ("": the resident one); a worker refuses
                                      # a Generate for a model its arena does not hold
    # a restore of its reused pages that may still be landing (the control sent this Generate once the
    # move was dispatched, before its ack): the prefill's layer l waits only for that layer's pages, and no
    # token leaves before the move verified; the request fails if it does not ("": the pages are in place)
    awaits_move: str = ""


class CancelGenerate(Message):
    request_id: str
    reason: str                       # "disconnected", "shutdown", ...


class TokensGenerated(Message):
    """Progress of one sequence, once per step it took part in; the last one has ``finish_reason``.

    It carries the pages the step filled (``blocks_written``: full pages with their content key;
    at the end, the partial tail with key ""), so the control process commits them to the ledger,
    owned by the request's session, in the order they were written. The last report also names
    the pages the worker freed (``blocks_freed``/``bytes_freed``, measured by the pool: see
    ``Generate.free_on_finish``) and the reserved pages it never reached (``blocks_unused``: never
    given a slot, never in the ledger).
    """

    request_id: str
    worker: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "cancelled" | "error"
    error: str | None = None
    num_prompt_tokens: int = 0
    num_computed_tokens: int = 0      # prompt positions actually prefilled (the rest were cached)
    blocks_unused: list[int] = []
    blocks_written: list[int] = []
    keys_written: list[str] = []
    blocks_freed: list[int] = []
    bytes_freed: int = 0
    # with SamplingParams.logprobs: one per token of ``token_ids`` whose text is the answer's (an
    # end-of-turn token that stopped the sequence has none)
    logprobs: list[TokenLogprobs] = []


# ---------------------------------------------------------------- a group's step ballots (docs/groups.md)
class StepBallot(msgspec.Struct, frozen=True, array_like=True, gc=False):
    """What one rank of a group posts to the group's store before a step (dataplane/ballot.py):
    the request ids it could run, in arrival order, and for each its digest of what it would run
    for that sequence (block table, positions, the move it awaits, the weights it holds). Every
    rank reads every rank's ballot, so every rank reaches the same verdict. ``digests`` [] : not
    said (an ids-only post), never compared."""

    ids: list[str]
    digests: list[str] = []


class StepRefused(Message):
    """A group's ranks did not run a step: for ``request_id`` (the first, in rank 0's order, of the
    sequences every rank posted) their ballots' digests differ. Every rank saw the same ballots, so
    every rank sends the same verdict; the control records it once as ``GroupDiverged`` and stops
    the group. No rank entered the step's collectives."""

    worker: int
    round: int                        # the ballot's round on the group's store
    step: int                         # the step it would have been (the rank's steps so far + 1)
    request_id: str
    digests_by_rank: list[str]        # each rank's digest of ``request_id``, by rank
