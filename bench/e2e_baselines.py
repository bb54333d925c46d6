"""The two baselines of bench/serve_e2e.py, on the weights the server serves, in the bench's own
process (before any server starts, so nothing else holds the device):

- the model runner's decode throughput at the bench's concurrency levels as batch sizes: through
  CUDA graphs on a GPU (dataplane/model/graphs.py), eagerly on the CPU; every sequence at
  ``context`` tokens. It is the ceiling for served decode: no HTTP, no scheduler, no ledger, no
  prefill beside the decodes. bench/serve_model.py's ``bench_decode`` does the timing.
- transformers' ``generate`` on the same weights (greedy): its decode step is the time of a
  ``1 + steps``-token generate less that of a 1-token one (the prefill), over ``steps``. When
  noise makes the difference not positive the figure is None (not measured), never a huge rate.
"""
from __future__ import annotations

import time

import torch


def baselines(model_path: str | None, device: str, dtype: torch.dtype, batches: list[int], hf_batches: list[int],
              context: int, steps: int) -> dict:
    from serve_common import log
    from serve_model import bench_decode

    from residency.dataplane.model import load_model
    from residency.dataplane.model.hf_reference import build_hf_llama

    dev = torch.device(device)
    t0 = time.perf_counter()
    model = load_model(model_path, dev, dtype, max_positions=context + steps + 64)
    res: dict = {"model": model.config.name, "dtype": str(dtype)[6:], "context_tokens": context, "steps": steps,
                 "load_s": time.perf_counter() - t0}
    graphs_cls = None
    if dev.type == "cuda":
        from residency.dataplane.model.graphs import DecodeGraphs
        graphs_cls = DecodeGraphs
    gen = torch.Generator().manual_seed(5)
    # the roofline columns of bench_decode are not used here: a nominal bandwidth keeps them finite
    rows = bench_decode(model, None, dev, batches, context, steps, 1.0, graphs_cls, gen)
    res["runner"] = {str(r["batch"]): {"mode": "graphs" if "ours_graph_tok_s" in r else "eager",
                                       "tok_s": r.get("ours_graph_tok_s", r["ours_eager_tok_s"]),
                                       "eager_tok_s": r["ours_eager_tok_s"]} for r in rows}
    hf = build_hf_llama(model.config, model.weights)
    res["hf_generate"] = {}
    for b in hf_batches:
        prompts = torch.randint(0, model.config.vocab_size, (b, context), generator=gen)
        try:
            res["hf_generate"][str(b)] = hf_generate(hf, prompts.to(dev), steps)
        except torch.OutOfMemoryError as e:                      # said, not hidden
            res["hf_generate"][str(b)] = {"tok_s": None, "error": f"out of memory: {str(e)[:120]}"}
            torch.cuda.empty_cache()
        log(f"  transformers generate B={b}: {res['hf_generate'][str(b)]['tok_s']} tok/s")
    del hf, model
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return res


def hf_generate(hf, ids: torch.Tensor, steps: int) -> dict:
    from serve_common import Timer

    timer = Timer(ids.device)
    mask = torch.ones_like(ids)

    def run(n: int) -> None:
        with torch.no_grad():
            hf.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)

    t_prefill = timer(lambda: run(1), repeat=3, warmup=1)
    t_full = timer(lambda: run(1 + steps), repeat=3, warmup=0)
    step = (t_full - t_prefill) / steps
    return {"tok_s": ids.shape[0] / step if step > 0 else None, "step_ms": step * 1e3 if step > 0 else None,
            "prefill_ms": t_prefill * 1e3}
