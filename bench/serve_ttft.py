"""Time to first token of a chat's next turn when its history's KV was parked in pinned host
memory: restore it (one contiguous copy on a side stream, layer by layer) and prefill only the
new turn, against recomputing the whole history (bench/serve_model.py runs it). Beside it, a
new session whose prompt opens with that history as another session's resident prefix: the
pages read in place (outside a session) or copied on the device into its own (a session's turn)."""
from __future__ import annotations

import torch

from residency.dataplane.model import SeqInput
from serve_common import PAGE, Timer, log, rel


def bench_ttft(model, device, history: int, new: int, gen) -> dict:
    """Turn N+1 of a chat whose history KV was parked to pinned host memory:
    restore (one contiguous copy on a side stream) + prefill of the new turn, vs recompute."""
    r = model.runner
    timer = Timer(device)
    hist_blocks = history // PAGE
    total_blocks = -(-(history + new) // PAGE)
    pool = r.allocate_kv_pool(2 * total_blocks + 1, PAGE)   # the second half: a new session's own pages
    table = list(range(total_blocks))                    # history pages contiguous: one DMA
    hist_ids = torch.randint(0, model.config.vocab_size, (history,), generator=gen).tolist()
    new_ids = torch.randint(0, model.config.vocab_size, (new,), generator=gen).tolist()
    r.forward([SeqInput(hist_ids, 0, table)], pool)      # turn N computed the history's KV
    host = torch.empty_like(pool[:hist_blocks], device="cpu")
    if device.type == "cuda":
        host = host.pin_memory()
    host.copy_(pool[:hist_blocks])                       # parked
    side = torch.cuda.Stream() if device.type == "cuda" else None
    out = {}

    def restore_and_prefill():
        if side is not None:
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                pool[:hist_blocks].copy_(host, non_blocking=True)
            torch.cuda.current_stream().wait_stream(side)
        else:
            pool[:hist_blocks].copy_(host)
        out["restored"] = r.forward([SeqInput(new_ids, history, table)], pool)[0]

    def recompute():
        out["recomputed"] = r.forward([SeqInput(hist_ids + new_ids, 0, table)], pool)[0]

    copy_layer = layer_copier(pool, host, hist_blocks) if side is not None else None

    def pipelined_restore_and_prefill():
        """The same restore as one pitched copy per layer (hist_blocks rows of one layer's bytes),
        each with an event; layer l of the prefill waits only for its own layer."""
        side.wait_stream(torch.cuda.current_stream())
        ready = []
        for layer in range(model.config.num_layers):
            copy_layer(layer, side)
            ev = torch.cuda.Event()
            ev.record(side)
            ready.append(ev)
        out["pipelined"] = r.forward([SeqInput(new_ids, history, table)], pool, layer_ready=ready)[0]
        torch.cuda.current_stream().wait_stream(side)

    pool[:hist_blocks].fill_(float("nan"))               # prove the restore brings the bytes back
    t_restore = timer(restore_and_prefill, repeat=5, warmup=1)
    t_copy = timer(lambda: pool[:hist_blocks].copy_(host, non_blocking=True), repeat=5, warmup=1)
    t_turn = timer(lambda: r.forward([SeqInput(new_ids, history, table)], pool), repeat=5, warmup=1)
    # The same turn with its attention through SDPA over gathered pages (the path before the
    # extend kernel), side by side: time and how far its logits are from the kernel's.
    import residency.dataplane.model.runner as runner_mod
    saved, runner_mod.EXTEND_MAX_TOKENS = runner_mod.EXTEND_MAX_TOKENS, 0
    try:
        t_turn_sdpa = timer(lambda: r.forward([SeqInput(new_ids, history, table)], pool), repeat=5, warmup=1)
        sdpa_logits = r.forward([SeqInput(new_ids, history, table)], pool)[0]
    finally:
        runner_mod.EXTEND_MAX_TOKENS = saved
    extend_logits = r.forward([SeqInput(new_ids, history, table)], pool)[0]
    t_recompute = timer(recompute, repeat=3, warmup=1)
    t_pipe = None
    if copy_layer is not None:
        pool[:hist_blocks].fill_(float("nan"))
        t_pipe = timer(pipelined_restore_and_prefill, repeat=5, warmup=1)
    restore_and_prefill()
    # a new session sharing the history as another session's prefix: copy its pages on the device
    # into its own (one run: Generate.copy_from's path), then prefill the new turn over them
    own = list(range(total_blocks, 2 * total_blocks))
    dst = pool[total_blocks:total_blocks + hist_blocks]

    def copy_and_prefill():
        dst.copy_(pool[:hist_blocks])
        out["copied"] = r.forward([SeqInput(new_ids, history, own)], pool)[0]

    t_devcopy = timer(lambda: dst.copy_(pool[:hist_blocks]), repeat=5, warmup=1)
    dst.fill_(float("nan"))
    t_shared_copy = timer(copy_and_prefill, repeat=5, warmup=1)
    res = {
        "history_tokens": history, "new_tokens": new,
        "history_kv_bytes": host.numel() * host.element_size(),
        "ttft_restore_ms": t_restore * 1e3, "restore_copy_ms": t_copy * 1e3,
        "restore_copy_gbs": host.numel() * host.element_size() / t_copy / 1e9,
        "new_turn_prefill_ms": t_turn * 1e3,
        "new_turn_prefill_sdpa_ms": t_turn_sdpa * 1e3,
        "rel_err_extend_vs_sdpa_logits": rel(extend_logits, sdpa_logits),
        "same_greedy_token_extend_vs_sdpa": int(extend_logits.argmax()) == int(sdpa_logits.argmax()),
        "ttft_recompute_ms": t_recompute * 1e3, "speedup": t_recompute / t_restore,
        "same_greedy_token": int(out["restored"].argmax()) == int(out["recomputed"].argmax()),
        "rel_err_restored_vs_recomputed": rel(out["restored"], out["recomputed"]),
        "ttft_shared_in_place_ms": t_turn * 1e3, "speedup_shared_in_place": t_recompute / t_turn,
        "ttft_shared_copied_ms": t_shared_copy * 1e3, "speedup_shared_copied": t_recompute / t_shared_copy,
        "shared_copy_ms": t_devcopy * 1e3,
        "shared_copy_gbs": 2 * host.numel() * host.element_size() / t_devcopy / 1e9,     # read + write
        "copied_equals_restored_bitwise": bool(torch.equal(out["copied"], out["restored"])),
    }
    if t_pipe is not None:
        res.update(ttft_pipelined_ms=t_pipe * 1e3, speedup_pipelined=t_recompute / t_pipe,
                   pipelined_equals_restored_bitwise=bool(torch.equal(out["pipelined"], out["restored"])))
    log(f"  TTFT {history}+{new}: restore+prefill {res['ttft_restore_ms']:.1f} ms (copy {res['restore_copy_ms']:.1f} ms "
        f"at {res['restore_copy_gbs']:.1f} GB/s, turn prefill {res['new_turn_prefill_ms']:.1f} ms, "
        f"{res['new_turn_prefill_sdpa_ms']:.1f} ms through SDPA) vs recompute "
        f"{res['ttft_recompute_ms']:.1f} ms: x{res['speedup']:.1f}"
        + (f"; layer-pipelined {t_pipe * 1e3:.1f} ms: x{res['speedup_pipelined']:.1f}" if t_pipe else ""))
    log(f"  TTFT {history}+{new}, the history another session's prefix: read in place {t_turn * 1e3:.1f} ms "
        f"(x{res['speedup_shared_in_place']:.1f}), copied on the device {t_shared_copy * 1e3:.1f} ms "
        f"(copy {t_devcopy * 1e3:.2f} ms, {res['shared_copy_gbs']:.0f} GB/s read+write; "
        f"x{res['speedup_shared_copied']:.1f}); copied == restored bitwise: {res['copied_equals_restored_bitwise']}")
    del pool
    return res


def layer_copier(pool: torch.Tensor, host: torch.Tensor, num_blocks: int):
    """``copy(layer, stream)``: host[:, layer] -> pool[:num_blocks, layer] as ONE pitched DMA
    (num_blocks rows of one layer's bytes, a block's bytes apart on both sides): cudaMemcpy2DAsync
    through CuPy or cuda-python, whichever the machine has. None when neither is there."""
    elem = pool.element_size()
    pitch, width = pool.stride(0) * elem, pool.stride(1) * elem
    assert host.stride(0) == pool.stride(0) and host.stride(1) == pool.stride(1) and host.is_pinned()
    try:
        import cupy

        def memcpy2d(dst, src, stream):
            cupy.cuda.runtime.memcpy2DAsync(dst, pitch, src, pitch, width, num_blocks,
                                            cupy.cuda.runtime.memcpyHostToDevice, stream.cuda_stream)
    except ImportError:
        try:
            from cuda.bindings import runtime as cudart
        except ImportError:
            return None

        def memcpy2d(dst, src, stream):
            (err,) = cudart.cudaMemcpy2DAsync(dst, pitch, src, pitch, width, num_blocks,
                                              cudart.cudaMemcpyKind.cudaMemcpyHostToDevice, stream.cuda_stream)
            if int(err) != 0:
                raise RuntimeError(f"cudaMemcpy2DAsync: {err}")

    def copy(layer: int, stream) -> None:
        memcpy2d(pool[0, layer].data_ptr(), host[0, layer].data_ptr(), stream)

    return copy


# ------------------------------------------------------------------ drivers
