"""A serving worker's weights swap (issue #28), in process: the core that ``residency serve`` builds
from ``--model NAME=PATH`` (tiny random Llamas written as Hugging Face directories), driven with
the commands the control sends. Greedy output survives flips, sleeps and wakes token for token;
memory is back where it started after three cycles; every refusal changes nothing."""
from __future__ import annotations

import pytest
import torch

from residency.dataplane.faults import WorkerFaults
from residency.dataplane.flip.slab import HostSlab
from residency.dataplane.model import ModelConfig, random_model
from residency.dataplane.proc import arg_parser
from residency.dataplane.serving_worker import build_serving_core, model_id_for
from residency.dataplane.sizing import StartRefused
from residency.dataplane.weights_models import ModelSpec, parse_model_specs
from residency.dataplane.weights_swap import WeightsSwapper
from residency.events.serving import ChatTurn
from residency.events.commands import Generate, SamplingParams, SwapWeights, Tokenize, Tokenized, TokensGenerated
from tests.model.helpers_model import write_hf_dir

P = 4


def cfg(name: str, hidden: int, heads: int, inter: int, vocab: int, layers: int = 2, tie: bool = False) -> ModelConfig:
    return ModelConfig(name=name, num_layers=layers, hidden=hidden, num_heads=heads, num_kv_heads=2, head_dim=16,
                       intermediate=inter, vocab_size=vocab, rope_theta=10000.0, rope_scaling=None, rms_eps=1e-5,
                       max_position=256, tie_embeddings=tie)


# three models of three sizes whose KV pages have one shape (2 layers, 2 kv heads, head_dim 16)
SHAPES = {"a": cfg("a", 64, 4, 128, 300), "b": cfg("b", 48, 2, 96, 320, tie=True), "c": cfg("c", 80, 4, 160, 290),
          "deep": cfg("deep", 64, 4, 128, 300, layers=3)}


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("models")
    out = {}
    for seed, (name, c) in enumerate(SHAPES.items(), start=11):
        write_hf_dir(str(root / name), random_model(c, seed=seed))
        out[name] = str(root / name)
    return out


def build(tmp_path, dirs, *names: str, extra: tuple[str, ...] = ()):
    argv = ["--worker", "0", "--control", "ipc:///unused", "--run-dir", str(tmp_path / "run"),
            "--device-blocks", "64", "--page-tokens", str(P), "--host-bytes", str(1 << 20), "--no-disk-fsync",
            "--torch-threads", "1", "--flip-host-copies", "off", *extra]   # the rotation unless extra says auto
    for n in names:
        argv += ["--model", f"{n}={dirs[n]}"]
    core, _ = build_serving_core(arg_parser().parse_args(argv), WorkerFaults(""))
    return core


def swapper_of(core) -> WeightsSwapper:
    return core.handlers[SwapWeights].__self__


PROMPT = [17, 3, 250, 41, 99, 7, 64, 128, 5]


def generate(core, rid: str, model: str = "", prompt=PROMPT, max_tokens: int = 8) -> TokensGenerated:
    """Run one greedy request to its end; the final TokensGenerated, with every token in ``token_ids``."""
    out = core.run(Generate(request_id=rid, session=None, token_ids=list(prompt), block_ids=list(range(1, 6)),
                            num_cached_tokens=0, sampling=SamplingParams(max_tokens=max_tokens, temperature=0.0),
                            free_on_finish=True, model=model))
    while core.serving.has_work():
        out += core.serving.step()
    mine = [o for o in out if isinstance(o, TokensGenerated) and o.request_id == rid]
    last = mine[-1]
    return TokensGenerated(**{**{f: getattr(last, f) for f in last.__struct_fields__},
                              "token_ids": [t for o in mine for t in o.token_ids]})


def swap(core, flip_id: str, action: str, to_gen: int, to_model: str = "", level: int = 1):
    (r,) = core.run(SwapWeights(flip_id=flip_id, action=action, to_model=to_model, level=level, to_gen=to_gen))
    return r


def memory(core) -> dict:
    s = swapper_of(core)
    return dict(pinned=core.books.pinned_by_owner(), in_use=core.mover.pinned.in_use_bytes,
                arena=s.arena.held_bytes, slab_offset=s.slab.offset if s.slab else None,
                device_owned=dict(core.books.device_owned))


def test_three_flip_cycles_keep_each_models_greedy_output_and_leave_memory_where_it_started(tmp_path, dirs):
    alone = build(tmp_path / "alone", dirs, "b")
    b_alone = generate(alone, "alone").token_ids
    alone.close()
    core = build(tmp_path, dirs, "a", "b")                  # --flip-host-copies off: the rotation
    s = swapper_of(core)
    assert s.keep is None and "weights-keep" not in core.books.pinned_by_owner()
    (ready,) = core.hello_extras()
    assert [m.name for m in ready.models] == ["a", "b"] and ready.resident == "a" and ready.arena_gen == 0
    assert [m.host_image for m in ready.models] == [False, True] and all(m.image_checksum for m in ready.models)
    assert s.arena.capacity_bytes == max(m.weights_bytes for m in ready.models)       # sized for the larger
    start = memory(core)
    assert start["pinned"]["weights-slab"] > 0 and start["device_owned"]["weights"] == s.arena.capacity_bytes
    a_before = generate(core, "a0").token_ids
    assert len(a_before) == 8 and len(set(a_before)) > 1
    gen = 0
    for cycle in range(3):
        gen += 2                                  # the control's generation, not the worker's count
        to_b = swap(core, f"f{cycle}b", "flip", gen, "b")
        assert to_b.error == "" and to_b.checksum_ok and (to_b.from_model, to_b.resident) == ("a", "b")
        assert to_b.stamps == {"runner": gen, "serving": gen, "graphs": gen} and to_b.refused == {}
        assert to_b.bytes_out == ready.models[0].weights_bytes and to_b.bytes_in == ready.models[1].weights_bytes
        assert to_b.measured_freed_bytes is None                                   # a CPU worker: not measured
        assert generate(core, f"b{cycle}", model="b").token_ids == b_alone
        gen += 2
        to_a = swap(core, f"f{cycle}a", "flip", gen, "a")
        assert to_a.error == "" and to_a.checksum_ok and to_a.resident == "a" and to_a.from_gen == gen - 2
        assert [r.gen for r in s.arena.readers] == [gen] * 3 and s.arena.gen == gen
        assert generate(core, f"a{cycle}", model="a").token_ids == a_before
        s.check_integrity()
    assert memory(core) == start
    assert core.books.hello_fields()["weights_tier_bytes"] == {"device": ready.models[0].weights_bytes}
    assert core.books.hello_fields()["weights_checksum"] == ready.models[0].image_checksum
    core.close()
    assert core.mover.pinned.in_use_bytes == 0


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(
    not torch.cuda.is_available(), reason="CUDA: pinned host copies and H2D on a GPU"))])
def test_with_host_memory_for_both_images_a_flip_copies_only_the_incoming_bytes(tmp_path, dirs, device):
    on = ("--device", device)
    alone = build(tmp_path / "alone", dirs, "b", extra=on)
    b_alone = generate(alone, "alone").token_ids
    alone.close()
    core = build(tmp_path, dirs, "a", "b", extra=(*on, "--flip-host-copies", "auto"))   # tiny images: both fit
    s = swapper_of(core)
    a_n, b_n = s.models["a"].nbytes, s.models["b"].nbytes
    start = memory(core)
    assert s.keep is not None and start["pinned"]["weights-keep"] >= max(a_n, b_n)
    a_before = generate(core, "a0").token_ids
    gen = 0
    for cycle in range(3):
        gen += 1
        to_b = swap(core, f"f{cycle}b", "flip", gen, "b")
        assert to_b.error == "" and to_b.checksum_ok and (to_b.from_model, to_b.resident) == ("a", "b")
        assert to_b.bytes_out == (a_n if cycle == 0 else 0) and to_b.bytes_in == b_n     # a's copy kept after 1
        assert to_b.overlapped_steps == 0 and to_b.stamps == {"runner": gen, "serving": gen, "graphs": gen}
        assert generate(core, f"b{cycle}", model="b").token_ids == b_alone
        gen += 1
        to_a = swap(core, f"f{cycle}a", "flip", gen, "a")
        assert to_a.error == "" and to_a.checksum_ok and to_a.bytes_out == 0 and to_a.bytes_in == a_n
        assert [r.gen for r in s.arena.readers] == [gen] * 3
        assert generate(core, f"a{cycle}", model="a").token_ids == a_before
        s.check_integrity()
    assert memory(core) == start
    assert {m.name: m.host_image for m in core.hello_extras()[0].models} == {"a": True, "b": True}
    at = s.keep.offset + a_n // 2
    s.keep.bytes[at] ^= 0x10                                                     # a's kept host copy rots
    r = swap(core, "rot", "flip", gen + 1, "b")
    assert r.error == "" and r.bytes_out == a_n and r.bytes_in == b_n          # copied out again, checked
    assert swap(core, "back", "flip", gen + 2, "a").bytes_out == 0
    assert generate(core, "a-end", model="a").token_ids == a_before and memory(core) == start
    s.slab.bytes[s.slab.offset + b_n // 3] ^= 0x01                              # b's only host copy rots
    r = swap(core, "bad", "flip", gen + 3, "b")
    assert r.error.startswith("ChecksumMismatch") and "host image b" in r.error and r.resident == "a"
    assert generate(core, "a-still", model="a").token_ids == a_before
    core.close()
    assert core.mover.pinned.in_use_bytes == 0


def test_sleep_then_wake_at_either_level_gives_the_same_tokens_and_gives_every_byte_back(tmp_path, dirs):
    core = build(tmp_path, dirs, "a")                       # one model: no slab, checksummed at its first sleep
    s = swapper_of(core)
    assert s.slab is None and core.hello_extras()[0].models[0].image_checksum == ""
    before, start = generate(core, "r0").token_ids, memory(core)
    slept = swap(core, "s1", "sleep", 1, level=1)
    assert slept.error == "" and slept.resident == "" and slept.bytes_out == s.models["a"].nbytes and slept.stamps == {}
    assert s.arena.held_bytes == 0 and core.books.device_owned["weights"] == 0
    assert core.books.pinned_by_owner()["weights-sleep"] >= slept.bytes_out
    asleep = generate(core, "r1")
    assert asleep.finish_reason == "error" and asleep.error.startswith("weights_asleep")
    assert asleep.blocks_unused == [1, 2, 3, 4, 5]                             # every page handed back
    (tok,) = core.run(Tokenize(request_id="t1", prompt="hello"))
    assert tok.error.startswith("weights_asleep") and tok.token_ids == []
    (named,) = core.run(Tokenize(request_id="t1a", prompt="hello", model="a"))      # named: needs no weights
    assert named.error is None and named.token_ids
    assert swap(core, "s1b", "sleep", 2, level=1).error.startswith("already asleep")
    woke = swap(core, "w1", "wake", 2)
    assert woke.error == "" and woke.resident == "a" and woke.bytes_in == slept.bytes_out and woke.checksum_ok
    assert woke.stamps == {"runner": 2, "serving": 2, "graphs": 2}
    assert generate(core, "r2").token_ids == before and memory(core) == start
    dropped = swap(core, "s2", "sleep", 3, level=2)
    assert dropped.error == "" and dropped.dropped_bytes == s.models["a"].nbytes and dropped.bytes_out == 0
    assert memory(core)["pinned"] == start["pinned"]                           # nothing pinned for a level 2
    woke = swap(core, "w2", "wake", 4)                                          # read from the file, checked
    assert woke.error == "" and woke.checksum_ok and woke.bytes_in == s.models["a"].nbytes
    assert generate(core, "r3").token_ids == before and memory(core) == start
    s.check_integrity()
    core.close()


def test_every_refusal_leaves_the_weights_the_readers_and_the_generation_as_they_were(tmp_path, dirs):
    core = build(tmp_path, dirs, "a", "b")
    s = swapper_of(core)
    before = generate(core, "r0").token_ids
    arena_bytes = s.arena.buffer.clone()
    cases = {
        "unknown model 'zz'": SwapWeights(flip_id="x1", action="flip", to_model="zz", to_gen=1),
        "already resident": SwapWeights(flip_id="x2", action="flip", to_model="a", to_gen=1),
        "awake: a is resident": SwapWeights(flip_id="x3", action="wake", to_gen=1),
        "to_gen 0 does not move forward": SwapWeights(flip_id="x4", action="flip", to_model="b", to_gen=0),
        "unknown action 'nap'": SwapWeights(flip_id="x5", action="nap", to_gen=1),
        "sleep level 3": SwapWeights(flip_id="x6", action="sleep", level=3, to_gen=1),
    }
    for expected, cmd in cases.items():
        (r,) = core.run(cmd)
        assert expected in r.error and r.resident == "a" and r.from_gen == 0 and r.stamps == {}, (expected, r)
        assert core.run(cmd) == [r]                                             # sent again: the same answer
    core.run(Generate(request_id="long", session=None, token_ids=PROMPT, block_ids=list(range(10, 15)),
                      num_cached_tokens=0, sampling=SamplingParams(max_tokens=8, temperature=0.0)))
    core.serving.step()
    for action in ("flip", "sleep"):
        r = swap(core, f"busy-{action}", action, 1, "b" if action == "flip" else "")
        assert "1 sequences of a still run: ['long']" in r.error and r.resident == "a"
    while core.serving.has_work():
        core.serving.step()
    assert swap(core, "sleep", "sleep", 1).error == ""
    r = swap(core, "asleep-flip", "flip", 2, "b")
    assert r.error.startswith("asleep (model a, level 1)") and r.resident == ""
    r = swap(core, "wake-other", "wake", 2, "b")
    assert "wake brings back a, the model that slept, not 'b'" in r.error
    assert swap(core, "wake", "wake", 2).error == ""
    assert torch.equal(s.arena.buffer, arena_bytes) and generate(core, "r1").token_ids == before
    assert [r.gen for r in s.arena.readers] == [2, 2, 2]
    s.check_integrity()
    core.close()


def test_a_host_image_failing_its_checksum_is_refused_before_a_byte_moves(tmp_path, dirs):
    core = build(tmp_path, dirs, "a", "b")
    s = swapper_of(core)
    before, arena_bytes = generate(core, "r0").token_ids, s.arena.buffer.clone()
    at = s.slab.offset + s.models["b"].nbytes // 2
    s.slab.bytes[at] ^= 0x40                                                     # one bit of b's host image
    r = swap(core, "f1", "flip", 1, "b")
    assert r.error.startswith("ChecksumMismatch") and "host image b" in r.error and r.bytes_in == 0
    assert r.resident == "a" and torch.equal(s.arena.buffer, arena_bytes)
    assert generate(core, "r1").token_ids == before and [x.gen for x in s.arena.readers] == [0, 0, 0]
    s.slab.bytes[at] ^= 0x40
    assert swap(core, "f2", "flip", 1, "b").error == ""                           # repaired: it flips
    core.close()


def test_a_slab_too_small_for_the_rotation_is_refused_with_its_arithmetic(tmp_path, dirs):
    core = build(tmp_path, dirs, "a", "b")
    s = swapper_of(core)
    b = s.models["b"]
    small = HostSlab(core.mover.pinned, b.nbytes + 1024, owner="small-slab")     # no room for a ring
    small.store("b", b.manifest, s.slab.image_bytes(), offset=0)
    tight = WeightsSwapper(worker=0, arena=s.arena, models=list(s.models.values()), slab=small,
                           budget=core.mover.pinned, loop=core.serving, graphs=core.serving.graphs,
                           pool=core.mover.device_pool, dtype=torch.float32, chunk_bytes=1 << 20)
    (r,) = tight.handle(SwapWeights(flip_id="f", action="flip", to_model="b", to_gen=1))
    ring = 2 * (1 << 20)
    assert "host slab smaller than one image plus the overshoot" in r.error
    assert f"ring {ring}" in r.error and f"available {b.nbytes + 1024} bytes" in r.error and r.resident == "a"
    small.close()
    core.close()


def test_a_model_only_in_its_file_is_read_into_the_slab_when_a_flip_needs_it(tmp_path, dirs):
    alone = build(tmp_path / "alone", dirs, "c")
    c_alone = generate(alone, "c").token_ids
    alone.close()
    core = build(tmp_path, dirs, "a", "b", "c")
    s = swapper_of(core)
    assert {m.name: m.where for m in s.models.values()} == {"a": "device", "b": "host", "c": "file"}
    assert s.slab.capacity_bytes >= max(m.nbytes for m in s.models.values())
    r = swap(core, "f1", "flip", 1, "c")
    assert r.error == "" and r.bytes_in == s.models["c"].nbytes
    assert {m.name: m.where for m in s.models.values()} == {"a": "host", "b": "file", "c": "device"}
    assert generate(core, "c", model="c").token_ids == c_alone
    assert swap(core, "f2", "flip", 2, "b").error == ""                          # b comes back from its file
    assert {m.name: m.where for m in s.models.values()} == {"a": "file", "b": "device", "c": "host"}
    s.check_integrity()
    core.close()


def test_a_request_for_a_model_not_on_the_device_is_answered_by_name_never_held(tmp_path, dirs):
    core = build(tmp_path, dirs, "a", "b")
    r = generate(core, "r1", model="b")
    assert r.finish_reason == "error" and r.error.startswith("model_not_resident: b is not on the device (a is)")
    assert r.blocks_unused == [1, 2, 3, 4, 5] and not core.serving.seqs
    (t,) = core.run(Tokenize(request_id="t2", prompt="hi", model="zz"))
    assert t.error.startswith("model_unknown: this worker serves ['a', 'b']")
    (t,) = core.run(Tokenize(request_id="t3", prompt="hi", model="a"))
    assert t.error is None and t.token_ids
    core.close()


def test_a_tokenize_for_a_model_not_on_the_device_gives_that_models_own_ids_and_keys(tmp_path, dirs):
    text = "the quick brown fox jumps over the lazy dog 1234567890 " * 2
    asks = {"prompt": dict(prompt=text), "chat": dict(messages=[ChatTurn(role="user", content=text)]),
            "ids": dict(prompt_token_ids=[310, 5, 301, 17, 299, 2, 315, 40])}       # 300..319: b's ids, not a's

    def answers(core, model: str) -> dict:
        return {k: core.run(Tokenize(request_id=f"{model}-{k}", model=model, **kw))[0] for k, kw in asks.items()}

    alone = build(tmp_path / "alone", dirs, "b")                  # b resident: the ids and keys to match
    b_resident = answers(alone, "b")
    alone.close()
    assert all(t.error is None and t.token_ids and t.keys for t in b_resident.values()), b_resident
    core = build(tmp_path, dirs, "a", "b")
    a_resident = answers(core, "a")
    assert a_resident["ids"].error == "invalid_token_id: [310, 301, 315] not in [0, 300)"   # a's vocabulary
    assert answers(core, "b") == b_resident                      # b not on the device: b's own tokenizer
    assert {k: t.keys for k, t in a_resident.items()} != {k: t.keys for k, t in b_resident.items()}
    (t,) = core.run(Tokenize(request_id="r", prompt=text))                    # "": the resident one, a
    assert t.error is None and t.keys == a_resident["prompt"].keys
    assert generate(core, "g", model="b").error.startswith("model_not_resident")   # generating still refused
    assert swap(core, "f1", "flip", 1, "b").error == ""
    assert answers(core, "a") == a_resident and answers(core, "b") == b_resident  # and after the flip
    core.close()


def test_models_whose_kv_pages_differ_are_refused_at_start_with_both_shapes(tmp_path, dirs):
    with pytest.raises(StartRefused) as e:
        build(tmp_path, dirs, "a", "deep")
    assert "a: 2 x 2 x 4 x 2 x 16 x 4 B = 2048 B" in str(e.value) and "deep: 3 x 2 x 4 x 2 x 16 x 4 B = 3072 B" in str(e.value)


def test_a_model_that_cannot_fit_even_alone_is_refused_at_start_with_the_arithmetic(tmp_path, dirs):
    argv = ["--worker", "0", "--control", "ipc:///unused", "--run-dir", str(tmp_path / "run"), "--page-tokens", "4",
            "--gpu-memory-fraction", "0.000001", "--model", f"a={dirs['a']}", "--model", f"b={dirs['b']}"]
    with pytest.raises(StartRefused) as e:
        build_serving_core(arg_parser().parse_args(argv), WorkerFaults(""))
    assert "model a cannot fit on the cpu device even alone: its weights arena is" in str(e.value)
    assert "the device KV pool does not fit" in str(e.value)


def test_model_arguments_name_each_model_or_take_the_files_name():
    assert parse_model_specs(["a=/x/y", "b=embedded"], None, model_id_for) == [ModelSpec("a", "/x/y"),
                                                                              ModelSpec("b", None)]
    assert parse_model_specs(["/m/Llama.Q4_K.gguf"], None, model_id_for) == [ModelSpec("Llama", "/m/Llama.Q4_K.gguf")]
    assert parse_model_specs("embedded", "mine", model_id_for) == [ModelSpec("mine", None)]
    assert parse_model_specs(["none"], None, model_id_for) == [] and parse_model_specs(None, None, model_id_for) == []
    with pytest.raises(StartRefused, match=r"names \['a'\] more than once"):
        parse_model_specs(["a=/x", "a=/y"], None, model_id_for)


def test_a_wake_whose_image_fails_its_checksum_is_refused_and_the_weights_stay_asleep(tmp_path, dirs):
    import shutil

    shutil.copytree(dirs["a"], tmp_path / "a")
    own = {**dirs, "a": str(tmp_path / "a")}
    core = build(tmp_path, own, "a")
    s = swapper_of(core)
    before = generate(core, "r0").token_ids
    assert swap(core, "s1", "sleep", 1, level=1).error == ""
    s.sleeper.bytes[s.models["a"].nbytes // 3] ^= 0x01                          # the pinned copy rots
    r = swap(core, "w1", "wake", 2)
    assert r.error.startswith("ChecksumMismatch") and "host image a" in r.error and r.resident == ""
    assert s.arena.held_bytes == 0 and generate(core, "r1").error.startswith("weights_asleep")
    s.sleeper.bytes[s.models["a"].nbytes // 3] ^= 0x01
    assert swap(core, "w2", "wake", 2).error == "" and generate(core, "r2").token_ids == before
    assert swap(core, "s2", "sleep", 3, level=2).error == ""
    write_hf_dir(own["a"], random_model(SHAPES["a"], seed=99))                  # the file changed meanwhile
    r = swap(core, "w3", "wake", 4)
    assert r.error.startswith("ChecksumMismatch") and "arena image a" in r.error and r.resident == ""
    assert s.arena.held_bytes == 0 and s.asleep == ("a", 2)                     # the device given back again
    core.close()


def test_host_copies_are_kept_only_when_the_measured_host_memory_covers_them_with_the_arithmetic_said():
    from residency.dataplane.pools.budget import page_round
    from residency.dataplane.weights_models import host_copy_bytes

    need = page_round(5000)
    kept, why = host_copy_bytes("auto", [5000, 3000], 10_000, 10_000 + need, page_round)
    assert kept == need and f"pinned 10000 B + host copy {need} B = {10_000 + need} B <= available" in why
    kept, why = host_copy_bytes("auto", [5000, 3000], 10_000, 10_000 + need - 1, page_round)
    assert kept == 0 and f"= {10_000 + need} B > available {10_000 + need - 1} B: every flip rotates" in why
    assert host_copy_bytes("auto", [5000, 3000], 0, None, page_round)[0] == 0              # not measured: rotate
    assert host_copy_bytes("off", [5000, 3000], 0, 1 << 40, page_round)[0] == 0
    assert "two models only" in host_copy_bytes("auto", [1, 2, 3], 0, 1 << 40, page_round)[1]
