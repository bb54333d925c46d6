"""Child processes for the kernel-cache tests: N processes started together, one cache directory.

Each child records what it saw in ``out_dir/proc{i}.json``. Children are spawned (not forked) and
unpickle their target by module name, so the repository root goes on the sys.path they inherit.
"""
from __future__ import annotations

import hashlib
import importlib
import json
import os
import sys
import time

from tests.model.helpers_tp import tests_importable


def run_procs(target, n: int, args: tuple, out_dir: str, timeout_s: float = 240.0) -> list[dict]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")
    barrier = ctx.Barrier(n)
    where = tests_importable(out_dir)
    sys.path.insert(0, where)
    try:
        procs = [ctx.Process(target=target, args=(i, barrier, out_dir) + args) for i in range(n)]
        for p in procs:
            p.start()
    finally:
        sys.path.remove(where)
    for p in procs:
        p.join(timeout_s)
    alive = [p.pid for p in procs if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.terminate()
            p.join(5)
    assert not alive, f"processes {alive} did not finish in {timeout_s} s"
    assert all(p.exitcode == 0 for p in procs), [p.exitcode for p in procs]
    recs = []
    for i in range(n):
        with open(os.path.join(out_dir, f"proc{i}.json")) as f:
            recs.append(json.load(f))
    return recs


def _manager(spec: str):
    mod, name = spec.split(":")
    return getattr(importlib.import_module(mod), name)


def _sha(b: bytes) -> str:
    return hashlib.sha256(b).hexdigest()


def compile_like_triton(i: int, barrier, out_dir: str, cache_dir: str, manager: str, key: str,
                        payload_bytes: int, rounds: int) -> None:
    """Follow ``triton.compile``'s protocol with a stand-in for code generation whose output is
    unlike every other process's (fresh random bytes), so any mixing of two writers shows.

    Then ``rounds`` times: publish a fresh blob under one shared name and read that name back:
    what is read must always be one whole blob (its header names the hash of its body)."""
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    cls = _manager(manager)
    barrier.wait()
    m = cls(key)
    group = m.get_group("k.json")
    compiled = group is None
    if compiled:
        cubin = os.urandom(payload_bytes)          # this process's "code generation"
        time.sleep(0.3)                            # compile time: every process misses before a publish
        group = {"k.ttir": m.put(os.urandom(4096), "k.ttir"), "k.cubin": m.put(cubin, "k.cubin")}
        group["k.json"] = m.put(json.dumps({"cubin_sha": _sha(cubin)}), "k.json", binary=False)
        m.put_group("k.json", group)
    with open(group["k.json"]) as f:
        meta = json.load(f)
    with open(group["k.cubin"], "rb") as f:
        cubin_read = f.read()
    torn = 0
    for _ in range(rounds):
        body = os.urandom(payload_bytes)
        m.put(_sha(body).encode() + body, "blob")
        with open(os.path.join(m.cache_dir, "blob"), "rb") as f:
            got = f.read()
        torn += got[:64].decode() != _sha(got[64:])
    with open(os.path.join(out_dir, f"proc{i}.json"), "w") as f:
        json.dump({"compiled": compiled, "meta_cubin_sha": meta["cubin_sha"], "cubin_sha": _sha(cubin_read),
                   "torn": torn}, f)


def compile_project_kernel(i: int, barrier, out_dir: str, cache_dir: str, manager: str) -> None:
    """Compile the project's gather kernel with real Triton for an explicit sm_90 target (no GPU
    needed: Triton's wheel carries ptxas) into the shared cache; record the cubin's hash and
    whether this process compiled or found it."""
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    os.environ["TRITON_CACHE_MANAGER"] = manager
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from residency.kernels.gather import _gather_kernel

    src = ASTSource(fn=JITFunction(_gather_kernel), constexprs={"HAS_OUT_IDX": True, "CHUNK": 4096, "BLOCK": 1024},
                    signature={"src_ptr": "*i32", "out_ptr": "*i32", "src_idx_ptr": "*i64", "out_idx_ptr": "*i64",
                               "row_words": "i32", "src_stride": "i32", "out_stride": "i32",
                               "HAS_OUT_IDX": "constexpr", "CHUNK": "constexpr", "BLOCK": "constexpr"})
    hits = []
    triton.knobs.compilation.listener = lambda **kw: hits.append(kw["cache_hit"])
    barrier.wait()
    k = triton.compile(src, target=GPUTarget("cuda", 90, 32))
    with open(os.path.join(out_dir, f"proc{i}.json"), "w") as f:
        json.dump({"cache_hit": hits[-1], "cubin_sha": _sha(k.asm["cubin"]),
                   "shared": k.metadata.shared}, f)


def launch_project_kernels(i: int, barrier, out_dir: str, cache_dir: str, seed: int, device: str = "cuda") -> None:
    """On a GPU: run the project's kernels (compiled on first launch, through the cache the
    kernels install themselves) against their torch references. (``device="cpu"`` with
    TRITON_INTERPRET=1 checks this helper itself: interpreted kernels compile nothing.)"""
    os.environ["TRITON_CACHE_DIR"] = cache_dir
    import torch

    from residency.kernels.attention import paged_decode_attention, paged_decode_attention_ref
    from residency.kernels.checksum import block_checksums, block_checksums_ref, checksums_to_ints
    from residency.kernels.gather import gather_blocks, gather_blocks_ref

    g = torch.Generator(device=device).manual_seed(seed + i)
    barrier.wait()
    src = torch.randint(-2**31, 2**31 - 1, (64, 3000), generator=g, device=device, dtype=torch.int32)
    idx = torch.randperm(64, generator=g, device=device)[:17].cpu()
    ok = torch.equal(gather_blocks(src, idx, torch.full((17, 3000), -1, dtype=torch.int32, device=device)),
                     gather_blocks_ref(src, idx, torch.empty(17, 3000, dtype=torch.int32, device=device)))
    ids = torch.arange(1000, 1017)
    ok &= checksums_to_ints(block_checksums(src, idx, ids)) == checksums_to_ints(block_checksums_ref(src.cpu(), idx, ids))
    pool = torch.randn(9, 2, 2, 16, 2, 64, generator=g, device=device, dtype=torch.bfloat16)
    q = torch.randn(3, 6, 64, generator=g, device=device, dtype=torch.bfloat16)
    bt = torch.tensor([[1, 4, 7], [2, 0, 0], [8, 3, 5]], dtype=torch.int32, device=device)
    lens = torch.tensor([40, 9, 33], dtype=torch.int32, device=device)
    got = paged_decode_attention(q, pool, 1, bt, lens, 0.125)
    ok &= bool(torch.allclose(got.float(), paged_decode_attention_ref(q, pool, 1, bt, lens, 0.125).float(),
                              atol=2e-2, rtol=2e-2))
    if device == "cuda":
        torch.cuda.synchronize()
    with open(os.path.join(out_dir, f"proc{i}.json"), "w") as f:
        json.dump({"ok": bool(ok), "cache_dir": os.environ.get("TRITON_CACHE_DIR"),
                   "manager": os.environ.get("TRITON_CACHE_MANAGER")}, f)
