"""The worker's inference loop with the real SmolLM2, in process: no sockets, no control plane.

The pages the model writes are the Mover's pages: parking them to host, demoting them to disk and
restoring them (checksum-verified) between turns must give the same greedy tokens as a
conversation whose pages never moved.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from residency.dataplane.mover import Mover
from residency.dataplane.model import block_content_keys, generate, load_model
from residency.dataplane.model import SamplingParams as ModelSampling
from residency.dataplane.pools import KVLayout
from residency.dataplane.serving import ServingLoop
from residency.events.catalog import MoveAcked, StepCompleted
from residency.events.commands import (
    CancelGenerate, ChatTurn, ExecuteMove, Generate, SamplingParams, Tokenize, TokensGenerated,
)

pytestmark = pytest.mark.model
P = 16


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return load_model(None)


def make_loop(model, tmp_path, name: str, device_blocks: int = 96):
    c = model.config
    kv = KVLayout(c.num_layers, P, c.num_kv_heads, c.head_dim, dtype=torch.float32)
    host = 64 * kv.block_bytes
    mover = Mover(kv, device_blocks, host, tmp_path / name, Mover.pinned_bytes_needed(kv, device_blocks, host),
                   "cpu", fsync=False)
    loop = ServingLoop(worker=0, runner=model.runner, tokenizer=model.tokenizer, device_pool=mover.device_pool,
                       model_id="smol", model_digest=model.kv_digest, page_tokens=P, keys_fn=block_content_keys)
    return mover, loop


def run(loop: ServingLoop, *cmds) -> list:
    out = []
    for c in cmds:
        out += loop.handle(c)
    while loop.has_work():
        out += loop.step()
    return out


def tokens_of(out, rid=None) -> list[int]:
    return [t for o in out if isinstance(o, TokensGenerated) and (rid is None or o.request_id == rid)
            for t in o.token_ids]


def final(out, rid) -> TokensGenerated:
    return next(o for o in out if isinstance(o, TokensGenerated) and o.request_id == rid and o.finish_reason)


def greedy(max_tokens: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw)


_ids = itertools.count(1000)


def pages(n: int) -> list[int]:
    return [next(_ids) for _ in range(n)]


def test_greedy_output_matches_the_model_packages_reference(model, tmp_path):
    _, loop = make_loop(model, tmp_path, "a")
    tk = loop.tokenize(Tokenize(request_id="t", messages=[ChatTurn(role="user", content="Name a color.")]))
    assert tk.error is None and len(tk.keys) == len(tk.token_ids) // P
    assert tk.keys == block_content_keys(tk.token_ids, P, model.kv_digest)
    out = run(loop, Generate(request_id="r", session=None, token_ids=tk.token_ids,
                             block_ids=pages(-(-(len(tk.token_ids) + 5) // P)), num_cached_tokens=0,
                             sampling=greedy(6), free_on_finish=True))
    ref = generate(model, [tk.token_ids], ModelSampling(max_tokens=6))[0]
    assert tokens_of(out) == ref.token_ids
    assert "".join(o.text for o in out if isinstance(o, TokensGenerated)) == ref.text
    assert any(isinstance(o, StepCompleted) for o in out)


def test_pages_are_reported_with_their_keys_and_freed_when_asked(model, tmp_path):
    mover, loop = make_loop(model, tmp_path, "b")
    ids = model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 4)
    bl = pages(-(-(len(ids) + 7) // P))
    out = run(loop, Generate(request_id="r", session=None, token_ids=ids, block_ids=bl, num_cached_tokens=0,
                             sampling=greedy(8, ignore_eos=True), free_on_finish=True))
    written = [b for o in out if isinstance(o, TokensGenerated) for b in o.blocks_written]
    keys = [k for o in out if isinstance(o, TokensGenerated) for k in o.keys_written]
    last = final(out, "r")
    fed = tokens_of(out)
    full = (len(ids) + len(fed) - 1) // P
    assert written == bl[:len(written)] and keys[:full] == block_content_keys(ids + fed, P, model.kv_digest)[:full]
    assert last.finish_reason == "length" and last.blocks_freed == written
    assert last.bytes_freed == len(written) * mover.layout.block_bytes and mover.device_pool.used_bytes == 0
    assert last.blocks_unused == bl[len(written):]


def test_a_stop_string_ends_the_text_before_it(model, tmp_path):
    _, loop = make_loop(model, tmp_path, "c")
    tk = loop.tokenize(Tokenize(request_id="t", messages=[ChatTurn(role="user", content="Count from 1 to 10.")]))
    base = run(loop, Generate(request_id="r0", session=None, token_ids=tk.token_ids, block_ids=pages(8),
                              num_cached_tokens=0, sampling=greedy(10), free_on_finish=True))
    text = "".join(o.text for o in base if isinstance(o, TokensGenerated))
    stop = next(w for w in ("4", "3", "2", ",") if w in text)
    out = run(loop, Generate(request_id="r1", session=None, token_ids=tk.token_ids, block_ids=pages(8),
                             num_cached_tokens=0, sampling=greedy(10, stop=[stop]), free_on_finish=True))
    got = "".join(o.text for o in out if isinstance(o, TokensGenerated))
    assert final(out, "r1").finish_reason == "stop" and got == text[:text.index(stop)]


def test_a_cancelled_sequence_frees_its_new_pages_and_keeps_the_reused_ones(model, tmp_path):
    mover, loop = make_loop(model, tmp_path, "d")
    ids = model.tokenizer.encode("Residency keeps the pages of a conversation between turns. " * 3)
    bl = pages(-(-(len(ids) + 40) // P))
    out = run(loop, Generate(request_id="r1", session="s", token_ids=ids, block_ids=bl, num_cached_tokens=0,
                             sampling=greedy(2, ignore_eos=True)))
    kept = [b for o in out if isinstance(o, TokensGenerated) for b in o.blocks_written]
    assert final(out, "r1").blocks_freed == [] and mover.device_pool.used_bytes == len(kept) * mover.layout.block_bytes
    reused = (len(ids) // P) * P
    more = ids + model.tokenizer.encode(" And then some more text follows.")
    bl2 = bl[:reused // P] + pages(-(-(len(more) + 40) // P) - reused // P)
    loop.handle(Generate(request_id="r2", session="s", token_ids=more, block_ids=bl2, num_cached_tokens=reused,
                         sampling=greedy(40, ignore_eos=True)))
    loop.step()
    loop.step()
    assert loop.holding(bl2) == bl2[:len(loop.seqs["r2"].cmd.block_ids[:loop.seqs["r2"].num_allocated])]
    out = loop.handle(CancelGenerate(request_id="r2", reason="disconnected"))
    last = final(out, "r2")
    assert last.finish_reason == "cancelled" and not loop.has_work()
    assert set(last.blocks_freed) == set(bl2[reused // P:]) - set(last.blocks_unused)
    assert all(mover.device_pool.has(b) for b in bl[:reused // P])


def test_a_generate_naming_pages_that_are_not_resident_is_refused_not_run(model, tmp_path):
    _, loop = make_loop(model, tmp_path, "e")
    ids = list(range(100, 140))
    out = loop.handle(Generate(request_id="r", session="s", token_ids=ids, block_ids=pages(4), num_cached_tokens=16,
                               sampling=greedy(4)))
    assert final(out, "r").finish_reason == "error" and "not usable" in final(out, "r").error
    assert not loop.has_work()


def test_continuous_batching_lets_a_request_join_running_decodes(model, tmp_path):
    _, loop = make_loop(model, tmp_path, "f")
    a = model.tokenizer.encode("One, two, three, four,")
    b = model.tokenizer.encode("Monday, Tuesday, Wednesday,")
    loop.handle(Generate(request_id="a", session=None, token_ids=a, block_ids=pages(3), num_cached_tokens=0,
                         sampling=greedy(5, ignore_eos=True), free_on_finish=True))
    out = loop.step() + loop.step()
    out += loop.handle(Generate(request_id="b", session=None, token_ids=b, block_ids=pages(3), num_cached_tokens=0,
                                sampling=greedy(5, ignore_eos=True), free_on_finish=True))
    joined = loop.step()
    out += joined
    steps = [o for o in joined if isinstance(o, StepCompleted)]
    assert steps[0].num_seqs == 2 and steps[0].num_tokens == 1 + len(b)
    out += run(loop)
    assert len(tokens_of(out, "a")) == 5 and len(tokens_of(out, "b")) == 5


def converse(loop: ServingLoop, mover: Mover, turns: list[str], move_between: bool) -> list[list[int]]:
    """A greedy multi-turn chat as the control process would drive it: reuse the session's full
    pages; between turns optionally park them to host, demote to disk and restore them."""
    messages: list[ChatTurn] = []
    held: list[int] = []          # the session's pages, in order
    held_keys: list[str] = []
    replies = []
    for n, user in enumerate(turns):
        messages.append(ChatTurn(role="user", content=user))
        tk = loop.tokenize(Tokenize(request_id=f"t{n}", messages=messages))
        reuse = 0
        while reuse < min(len(held_keys), len(tk.keys)) and held_keys[reuse] and held_keys[reuse] == tk.keys[reuse]:
            reuse += 1
        reuse = min(reuse, (len(tk.token_ids) - 1) // P)
        if move_between and reuse:
            for i, (kind, src, dst) in enumerate((("park", "device", "host"), ("demote", "host", "disk"),
                                                  ("restore", "disk", "device"))):
                ack = mover.execute(ExecuteMove(move_id=f"m{n}-{i}", kind=kind, src=src, dst=dst,
                                                 blocks=held[:reuse], keep_source=False, deadline_ns=1 << 62))
                assert isinstance(ack, MoveAcked) and ack.checksum_ok, ack
        if held[reuse:]:
            mover.device_pool.free(held[reuse:])
        bl = held[:reuse] + pages(-(-(len(tk.token_ids) + 7) // P) - reuse)
        out = run(loop, Generate(request_id=f"r{n}", session="s", token_ids=tk.token_ids, block_ids=bl,
                                 num_cached_tokens=reuse * P, sampling=greedy(8)))
        assert final(out, f"r{n}").num_computed_tokens == len(tk.token_ids) - reuse * P
        replies.append(tokens_of(out))
        written = [b for o in out if isinstance(o, TokensGenerated) for b in o.blocks_written]
        held = held[:reuse] + written
        held_keys = held_keys[:reuse] + [k for o in out if isinstance(o, TokensGenerated) for k in o.keys_written]
        messages.append(ChatTurn(role="assistant", content="".join(o.text for o in out
                                                                  if isinstance(o, TokensGenerated))))
    return replies


def test_parked_demoted_and_restored_pages_give_token_identical_greedy_output(model, tmp_path):
    turns = ["Hi! What is the capital of France?", "And of Italy?"]      # three turns: tests/serving/test_e2e.py
    e1, l1 = make_loop(model, tmp_path, "still")
    e2, l2 = make_loop(model, tmp_path, "moved")
    still = converse(l1, e1, turns, move_between=False)
    moved = converse(l2, e2, turns, move_between=True)
    assert moved == still
    assert all(len(r) > 0 for r in still)


def test_the_worker_refuses_to_move_or_free_pages_a_running_sequence_uses(model, tmp_path):
    from residency.dataplane.pools import DataPlaneError
    from residency.dataplane.serving_worker import attach
    from residency.dataplane.worker import WorkerCore
    from residency.events.catalog import MoveRejected
    from residency.events.commands import CommandFailed, ReleaseBlocks

    mover, loop = make_loop(model, tmp_path, "g")
    core = WorkerCore(mover, 0, expected_errors=(DataPlaneError,))
    attach(core, loop, mover.layout.block_bytes)
    ids = model.tokenizer.encode("Pages under a running sequence stay where they are. " * 3)
    bl = pages(-(-(len(ids) + 40) // P))
    core.run(Generate(request_id="r", session="s", token_ids=ids, block_ids=bl, num_cached_tokens=0,
                      sampling=greedy(40, ignore_eos=True)))
    assert core.background[0]()
    core.background[1]()                                   # the prefill: pages now hold K/V
    held = loop.holding(bl)
    assert held
    park = ExecuteMove(move_id="m1", kind="park", src="device", dst="host", blocks=held[:1], keep_source=False,
                       deadline_ns=1 << 62)
    [rej] = core.run(park)
    assert isinstance(rej, MoveRejected) and rej.blocks == held[:1] and "running sequence" in rej.reason
    [failed] = core.run(ReleaseBlocks(release_id="x1", tier="device", blocks=held[:1]))
    assert isinstance(failed, CommandFailed) and failed.error == "BlockBusy"
    core.run(CancelGenerate(request_id="r", reason="test"))
    assert not core.background[0]() and not loop.holding(bl)
    assert [type(o).__name__ for o in core.hello_extras()] == ["ServingReady"]


def test_a_prompt_over_the_context_is_refused_before_its_keys_and_a_huge_one_before_encoding(model, tmp_path):
    """A worker must not spend seconds on a prompt it will refuse (20 MB took 19 s to encode:
    its heartbeats stopped and it was declared lost)."""
    _, loop = make_loop(model, tmp_path, "long")
    ctx, per = loop.max_positions, model.tokenizer.max_token_bytes
    keyed, encoded = [], []
    keys_fn, encode = loop.keys_fn, loop.tokenizer.encode
    loop.keys_fn = lambda ids, *a: keyed.append(len(ids)) or keys_fn(ids, *a)
    loop.tokenizer.encode = lambda text, **kw: encoded.append(len(text)) or encode(text, **kw)
    try:
        huge = "ab" * (ctx * per + 7)
        for tk in (loop.tokenize(Tokenize(request_id="h1", messages=[ChatTurn(role="user", content=huge)])),
                   loop.tokenize(Tokenize(request_id="h2", prompt=huge))):
            assert tk.error.startswith("context_length_exceeded: ") and " characters, more than " in tk.error, tk.error
            assert tk.token_ids == [] and tk.keys == []
        assert encoded == [] and keyed == []
        words = "word " * (ctx + 10)                   # over the context, under the bound: encoded, not keyed
        tk = loop.tokenize(Tokenize(request_id="w", prompt=words))
        assert tk.error.startswith("context_length_exceeded: ") and tk.error.endswith(" tokens") and keyed == []
        tk = loop.tokenize(Tokenize(request_id="ids", prompt_token_ids=[1] * ctx))
        assert tk.error.startswith("context_length_exceeded: ") and keyed == []
        tk = loop.tokenize(Tokenize(request_id="bad", prompt_token_ids=[1, 2, loop.vocab_size]))
        assert tk.error.startswith("invalid_token_id: ") and keyed == []
        assert loop.tokenize(Tokenize(request_id="none", prompt_token_ids=[])).error.startswith("empty_prompt: ")
        tk = loop.tokenize(Tokenize(request_id="ok", prompt="word " * 20))
        assert tk.error is None and keyed == [len(tk.token_ids)]
    finally:
        loop.tokenizer.encode = encode


def test_logprobs_are_the_models_own_before_temperature_and_the_bytes_spell_the_text(model, tmp_path):
    """Sampled at temperature 0.8 (so the chosen token is not always the likeliest), each token's
    logprob and its top 3 are transformers' log-softmax of the raw logits at that position."""
    from residency.dataplane.model.hf_reference import build_hf_llama

    _, loop = make_loop(model, tmp_path, "lp")
    tk = loop.tokenize(Tokenize(request_id="t", messages=[ChatTurn(role="user", content="Write about cats.")]))
    n = len(tk.token_ids)
    sp = SamplingParams(max_tokens=10, temperature=0.8, seed=11, logprobs=3, ignore_eos=True)
    out = run(loop, Generate(request_id="r", session=None, token_ids=tk.token_ids, block_ids=pages(-(-(n + 10) // P)),
                             num_cached_tokens=0, sampling=sp, free_on_finish=True))
    gen = tokens_of(out)
    lps = [lp for o in out if isinstance(o, TokensGenerated) for lp in o.logprobs]
    assert len(gen) == 10 and [lp.chosen.token_id for lp in lps] == gen
    text = "".join(o.text for o in out if isinstance(o, TokensGenerated))
    assert b"".join(lp.chosen.token_bytes for lp in lps).decode(errors="replace") == text
    hf = build_hf_llama(model.config, model.weights)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([tk.token_ids + gen])).logits[0].float(), dim=-1)
    for i, lp in enumerate(lps):
        row = ref[n - 1 + i]
        assert lp.chosen.logprob == pytest.approx(row[gen[i]].item(), abs=2e-3)
        assert [c.logprob for c in lp.top] == pytest.approx(row.topk(3).values.tolist(), abs=2e-3)
        assert all(c.token_bytes == model.tokenizer.token_bytes(c.token_id) for c in [lp.chosen, *lp.top])
    assert any(lp.chosen.token_id != lp.top[0].token_id for lp in lps), "every sample was the likeliest"


def test_no_logprobs_unless_asked_none_for_the_end_of_turn_and_too_many_refused(model, tmp_path):
    _, loop = make_loop(model, tmp_path, "lq")
    tk = loop.tokenize(Tokenize(request_id="t", messages=[ChatTurn(role="user", content="What is the capital of France?")]))
    n = len(tk.token_ids)
    plain = run(loop, Generate(request_id="a", session=None, token_ids=tk.token_ids, block_ids=pages(-(-(n + 40) // P)),
                               num_cached_tokens=0, sampling=greedy(40), free_on_finish=True))
    assert all(o.logprobs == [] for o in plain if isinstance(o, TokensGenerated))
    out = run(loop, Generate(request_id="b", session=None, token_ids=tk.token_ids, block_ids=pages(-(-(n + 40) // P)),
                             num_cached_tokens=0, sampling=greedy(40, logprobs=0), free_on_finish=True))
    assert tokens_of(out) == tokens_of(plain)
    last = final(out, "b")
    assert last.finish_reason == "stop" and last.token_ids[-1] in model.tokenizer.eos_token_ids
    lps = [lp for o in out if isinstance(o, TokensGenerated) for lp in o.logprobs]
    assert len(lps) == len(tokens_of(out)) - 1 and all(lp.top == [] for lp in lps)
    bad = run(loop, Generate(request_id="c", session=None, token_ids=tk.token_ids, block_ids=pages(-(-(n + 4) // P)),
                             num_cached_tokens=0, sampling=greedy(4, logprobs=21), free_on_finish=True))
    assert final(bad, "c").finish_reason == "error" and "logprobs 21 must be in [0, 20]" in final(bad, "c").error


def test_a_prefix_shared_from_another_session_gives_the_tokens_of_computing_it(model, tmp_path):
    mover, loop = make_loop(model, tmp_path, "share")
    system = "You are a careful assistant. Answer in one short sentence, and never invent facts. " * 2
    a_ids = model.tokenizer.encode(system + "What is the capital of France?")
    b_ids = model.tokenizer.encode(system + "What is the capital of Spain?")
    keys_a, keys_b = (block_content_keys(i, P, model.kv_digest) for i in (a_ids, b_ids))
    k = len(list(itertools.takewhile(lambda pair: pair[0] == pair[1], zip(keys_a, keys_b))))
    assert k >= 2 and k * P < len(b_ids)
    a_bl = pages(-(-(len(a_ids) + 8) // P))
    run(loop, Generate(request_id="a", session="a", token_ids=a_ids, block_ids=a_bl, num_cached_tokens=0,
                       sampling=greedy(8, ignore_eos=True)))
    donor = a_bl[:k]
    before = mover.device_pool.words[mover.device_pool.slots_of(donor)].clone()
    n_b = -(-(len(b_ids) + 12) // P)

    scratch = pages(n_b)                       # computed from nothing, freed after
    out = run(loop, Generate(request_id="scratch", session=None, token_ids=b_ids, block_ids=scratch,
                             num_cached_tokens=0, sampling=greedy(12), free_on_finish=True))
    want = tokens_of(out, "scratch")

    in_place = donor + pages(n_b - k)          # outside a session: the donor's pages read where they are
    out = run(loop, Generate(request_id="read", session=None, token_ids=b_ids, block_ids=in_place,
                             num_cached_tokens=k * P, sampling=greedy(12), free_on_finish=True))
    last = final(out, "read")
    assert tokens_of(out, "read") == want and last.num_computed_tokens == len(b_ids) - k * P
    assert not set(last.blocks_freed) & set(donor) and all(mover.device_pool.has(b) for b in donor)

    own = pages(n_b)                           # a session's turn: copied into its own first pages
    gen = Generate(request_id="copy", session="b", token_ids=b_ids, block_ids=own, num_cached_tokens=k * P,
                   sampling=greedy(12), copy_from=donor)
    loop.handle(gen)
    assert set(loop.holding(donor)) == set(donor), "the source pages are held while the copy's sequence runs"
    out = []
    while loop.has_work():
        out += loop.step()
    last = final(out, "copy")
    written = [b for o in out if isinstance(o, TokensGenerated) for b in o.blocks_written]
    written_keys = [x for o in out if isinstance(o, TokensGenerated) for x in o.keys_written]
    assert tokens_of(out, "copy") == want and last.num_computed_tokens == len(b_ids) - k * P
    assert written[:k] == own[:k] and written_keys[:k] == keys_b[:k], "the copies are reported as its pages"
    assert last.blocks_freed == [] and all(mover.device_pool.has(b) for b in own[:k])
    assert torch.equal(mover.device_pool.words[mover.device_pool.slots_of(own[:k])], before)
    assert torch.equal(mover.device_pool.words[mover.device_pool.slots_of(donor)], before), "the source is unchanged"


def test_a_cancelled_copy_frees_its_copies_and_a_bad_copy_is_refused(model, tmp_path):
    mover, loop = make_loop(model, tmp_path, "copyfree")
    ids = model.tokenizer.encode("Pages copied from one session to another are the new one's own. " * 5)
    a_bl = pages(-(-(len(ids) + 2) // P))
    run(loop, Generate(request_id="a", session="a", token_ids=ids, block_ids=a_bl, num_cached_tokens=0,
                       sampling=greedy(2, ignore_eos=True)))
    used = mover.device_pool.used_bytes
    k = len(ids) // P - 1
    assert k >= 3
    own = pages(-(-(len(ids) + 30) // P))
    loop.handle(Generate(request_id="b", session="b", token_ids=ids, block_ids=own, num_cached_tokens=k * P,
                         sampling=greedy(30, ignore_eos=True), copy_from=a_bl[:k]))
    loop.step()
    last = final(loop.handle(CancelGenerate(request_id="b", reason="test")), "b")
    assert set(own[:k]) <= set(last.blocks_freed) and mover.device_pool.used_bytes == used
    assert not loop.holding(a_bl)
    wrong = loop.handle(Generate(request_id="c", session="c", token_ids=ids, block_ids=pages(len(own)),
                                 num_cached_tokens=k * P, sampling=greedy(4), copy_from=a_bl[:k - 1]))
    assert final(wrong, "c").finish_reason == "error" and "copy_from names" in final(wrong, "c").error
    gone = loop.handle(Generate(request_id="d", session="d", token_ids=ids, block_ids=pages(len(own)),
                                num_cached_tokens=k * P, sampling=greedy(4), copy_from=pages(k)))
    assert "pages to copy not usable" in final(gone, "d").error and mover.device_pool.used_bytes == used


def test_a_forward_that_raises_finishes_every_sequence_of_the_step_with_the_error(model, tmp_path, monkeypatch):
    mover, loop = make_loop(model, tmp_path, "fwd")
    ids = model.tokenizer.encode("One forward fails.")
    for rid in ("a", "b"):
        loop.handle(Generate(request_id=rid, session=None, token_ids=ids, block_ids=pages(-(-(len(ids) + 4) // P)),
                             num_cached_tokens=0, sampling=greedy(4), free_on_finish=True))

    def broken(*a, **k):
        raise RuntimeError("device fell over")

    monkeypatch.setattr(loop.runner, "forward", broken)
    out = loop.step()
    assert {final(out, r).finish_reason for r in "ab"} == {"error"}
    assert all("device fell over" in final(out, r).error for r in "ab")
    assert not loop.has_work() and mover.device_pool.used_bytes == 0


def test_a_sequence_whose_sampling_raises_ends_alone_and_the_batch_goes_on(model, tmp_path, monkeypatch):
    import residency.dataplane.serving as serving_mod

    mover, loop = make_loop(model, tmp_path, "smp")
    ids = model.tokenizer.encode("Sampling fails for one of us.")
    for rid, seed in (("good", 1), ("bad", 666)):
        loop.handle(Generate(request_id=rid, session=None, token_ids=ids, block_ids=pages(-(-(len(ids) + 4) // P)),
                             num_cached_tokens=0, sampling=greedy(3, seed=seed, ignore_eos=True),
                             free_on_finish=True))
    real = serving_mod.sample

    def sample(rows, params, gens, histories=None):
        if any(p.seed == 666 for p in params):
            raise ValueError("invalid multinomial distribution")
        return real(rows, params, gens, histories)

    monkeypatch.setattr(serving_mod, "sample", sample)
    out = []
    while loop.has_work():
        out += loop.step()
    assert final(out, "bad").finish_reason == "error" and "multinomial" in final(out, "bad").error
    assert final(out, "good").finish_reason == "length" and len(tokens_of(out, "good")) == 3
    assert mover.device_pool.used_bytes == 0
