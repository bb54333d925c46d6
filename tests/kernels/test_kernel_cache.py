"""The Triton kernel cache shared by the worker processes of one host (kernels/cache.py): N
processes starting together compile each kernel once, and every one of them reads the same bytes."""
from __future__ import annotations

import os

import pytest
import torch

from residency.kernels.cache import MANAGER, install_shared_cache
from tests.kernels.helpers_cache import compile_like_triton, compile_project_kernel, launch_project_kernels, run_procs

pytest.importorskip("triton")


def test_processes_racing_on_one_key_compile_once_and_read_the_same_whole_bytes(tmp_path):
    cache = str(tmp_path / "cache")
    recs = run_procs(compile_like_triton, 4, (cache, MANAGER, "K" * 52, 1 << 20, 20), str(tmp_path))
    assert sum(r["compiled"] for r in recs) == 1, recs
    assert len({r["cubin_sha"] for r in recs}) == 1, "processes ended with different bytes"
    assert all(r["meta_cubin_sha"] == r["cubin_sha"] for r in recs), "metadata of one writer beside another's binary"
    assert all(r["torn"] == 0 for r in recs), "a reader saw a partly written file"
    key_dir = os.path.join(cache, "K" * 52)
    assert not [n for n in os.listdir(key_dir) if n.startswith(".tmp")], "a temporary file was left behind"


def test_real_triton_compiles_a_project_kernel_once_for_two_processes(tmp_path):
    # real code generation (ptxas for an explicit sm_90 target runs without a GPU)
    cache = str(tmp_path / "cache")
    recs = run_procs(compile_project_kernel, 2, (cache, MANAGER), str(tmp_path))
    assert sorted(r["cache_hit"] for r in recs) == [False, True], recs
    assert len({(r["cubin_sha"], r["shared"]) for r in recs}) == 1


def test_install_keeps_an_operators_choice(monkeypatch, tmp_path):
    for name in ("TRITON_CACHE_MANAGER", "TRITON_CACHE_DIR"):
        monkeypatch.setenv(name, "")      # recorded first, so the test's teardown restores the real value
        monkeypatch.delenv(name)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    where = install_shared_cache()
    assert where.startswith(str(tmp_path)) and os.environ["TRITON_CACHE_MANAGER"] == MANAGER
    monkeypatch.setenv("TRITON_CACHE_MANAGER", "elsewhere:Manager")
    monkeypatch.setenv("TRITON_CACHE_DIR", "/operator/dir")
    assert install_shared_cache() == "/operator/dir" and os.environ["TRITON_CACHE_MANAGER"] == "elsewhere:Manager"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="launches the compiled kernels on a GPU")
def test_workers_on_a_gpu_compile_the_project_kernels_into_one_empty_cache(tmp_path, rng):
    cache = str(tmp_path / "cache")
    recs = run_procs(launch_project_kernels, 4, (cache, rng.randrange(1 << 30)), str(tmp_path), timeout_s=420)
    assert all(r["ok"] for r in recs), recs
    assert all(r["cache_dir"] == cache and r["manager"] == MANAGER for r in recs), recs
    for key in os.listdir(cache):
        names = os.listdir(os.path.join(cache, key))
        assert not [n for n in names if n.startswith(".tmp")], (key, names)
