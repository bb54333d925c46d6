"""The dial under load: a live shrink of a well-filled device pool, and an outside tenant's
reclaim-to-first-byte.

    python bench/dial.py                       # CPU, small pool  -> bench/results/dial-<date>-cpu.json
    python bench/dial.py --device cuda --pool-gib 16      (the GPU run; bench/gpu_session.sh dial)

One ``residency serve`` (real processes, SQLite ledger, ``--no-policies`` so nothing moves but
what is asked, ``--tenant bench``) serving a random-weight Llama-shaped Hugging Face directory
written here (nothing is fetched). Sessions with long histories fill the device pool to about
``--fill``; one stream runs throughout and its inter-token gaps are recorded. Then:

  (a) ``ctl resize`` shrinks the device pool by half: wall time of the ask, bytes the moves out
      moved (the MoveAcked of the answer), the stream's largest inter-token gap while the resize
      ran against its median before, and the bytes the driver measured freed against the bytes
      asked (PoolResized.measured_freed_bytes; None where not measured, e.g. on CPU);
  (b) ``ctl reclaim --tenant bench --bytes X``: from the ctl's start until a second process on
      the same GPU, which first took every other free byte as ballast, allocates X bytes
      (``torch.empty`` retried). On CPU there is no driver to share: reported n/a.

The model is not what is measured: the dial measures pool memory. So on the GPU the random model
has only 4 layers but 64 KV heads of 128, which gives Llama-3-8B's KV page (16 tokens x 32 layers
x 8 KV heads x 128 x 2 (K, V) x 2 B = 2 MiB): a 16 GiB pool is 8192 such pages, filled by ~6
prefills of 16k tokens (~90k tokens; the old 8-layer, 512 KiB-page shape needed ~350k tokens and
a 16 GiB pool did not fill in 300 s). The JSON's ``model`` says which shape ran.

Every phase (model write, serve start, fill, stream start, resize, reclaim, release, stream end,
teardown) prints its wall time to stderr as it ends and rewrites the JSON (``"complete": false``
until the end), so a run cut off by its time limit still says where it was and what it had.
Every wait is bounded: the second process gives up after ``--reclaim-wait`` seconds, the stream
after ``--stream-wait``.

Printed as a table; JSON with the commit (RESIDENCY_GIT_COMMIT overrides) and a ``targets``
object. ``freed_ge_asked`` is met when the measured bytes are >= the asked ones (or the ask was
refused); unmeasured (CPU) it is reported as not measured, never as met.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from datetime import date

import httpx

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from commit import git_commit  # noqa: E402

GiB, MiB = 1 << 30, 1 << 20
PAGE_TOKENS = 16
WORDS = ("ledger", "page", "block", "device", "host", "park", "restore", "tier", "rebind", "pool", "tenant",
         "bytes", "measured", "stranded", "refused", "session")


def log(*a) -> None:
    print(*a, file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ------------------------------------------------------------------ the model
def model_shape(device: str):
    """A Llama-shaped config. On the GPU: few layers (cheap to write, load and prefill) but a
    realistic page size in bytes, Llama-3-8B's 2 MiB per 16-token page in bfloat16 (4 layers x 64
    KV heads x 128 here, 32 x 8 x 128 there), so the pool holds many real-sized pages. On CPU tiny,
    so a small pool fills in seconds."""
    from residency.dataplane.model import ModelConfig

    if device == "cuda":
        return ModelConfig(name="dial-bench", num_layers=4, hidden=512, num_heads=64, num_kv_heads=64, head_dim=128,
                           intermediate=1024, vocab_size=512, rope_theta=10000.0, rope_scaling=None, rms_eps=1e-5,
                           max_position=32768, tie_embeddings=True)
    return ModelConfig(name="dial-bench", num_layers=2, hidden=64, num_heads=4, num_kv_heads=2, head_dim=16,
                       intermediate=128, vocab_size=512, rope_theta=10000.0, rope_scaling=None, rms_eps=1e-5,
                       max_position=8192, tie_embeddings=True)


def write_model(path: str, device: str) -> tuple[str, int]:
    """A random-weight HF directory at ``path``: (path, KV bytes per page)."""
    import torch

    from residency.dataplane.model.loader import random_model, save_hf_dir
    from tests.model.helpers_model import CHATML, tiny_tokenizer_json

    cfg = model_shape(device)
    model = random_model(cfg, "cpu", torch.float32, seed=27)
    os.makedirs(path, exist_ok=True)
    save_hf_dir(model, path, tokenizer_json=tiny_tokenizer_json(cfg.vocab_size))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": CHATML, "eos_token": "<|im_end|>", "bos_token": "<|im_start|>"}, f)
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump({"eos_token_id": [2]}, f)
    dtype_bytes = 2 if device == "cuda" else 4
    return path, 2 * cfg.num_layers * PAGE_TOKENS * cfg.num_kv_heads * cfg.head_dim * dtype_bytes


# ------------------------------------------------------------------ the server
class Serve:
    def __init__(self, tmp: str, model: str, device: str, device_blocks: int, host_bytes: int):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.dir = tmp
        self.db = f"sqlite:///{tmp}/l.db"
        self.run_dir = f"{tmp}/run"
        argv = [sys.executable, "-m", "residency.control.cli.main", "serve", "--ledger", self.db,
                "--port", str(self.port), "--run-dir", self.run_dir, "--no-policies", "--model", model,
                "--device", device, "--device-blocks", str(device_blocks), "--host-bytes", str(host_bytes),
                "--no-disk-fsync", "--tenant", "bench", "--retain-prefixes", "0", "--default-max-tokens", "64"]
        if device == "cuda":
            # the fill prefills ~90k tokens in ~16k-token histories: in 8k-token steps rather than 256
            argv += ["--max-step-tokens", "8192"]
        self.log = open(f"{tmp}/serve.log", "wb")
        self.proc = subprocess.Popen(argv, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                data = httpx.get(f"{self.url}/v1/models", timeout=2).json()["data"]
                if data:
                    self.model_id = data[0]["id"]
                    return
            except (httpx.HTTPError, KeyError, ValueError):
                pass
            if self.proc.poll() is not None:
                raise SystemExit(f"serve exited: see {tmp}/serve.log")
            time.sleep(0.5)
        raise SystemExit(f"serve did not come up: see {tmp}/serve.log")

    def ctl(self, *argv: str) -> tuple[int, dict, float]:
        t0 = time.perf_counter()
        try:
            r = subprocess.run([sys.executable, "-m", "residency.control.cli.main", "ctl", *argv, "--db", self.db,
                                "--run-dir", self.run_dir, "--json", "--timeout", "180"],
                               cwd=ROOT, capture_output=True, text=True, timeout=240)
        except subprocess.TimeoutExpired as e:
            return 124, {"stdout": str(e.stdout)[-2000:], "stderr": "ctl killed after 240 s"}, time.perf_counter() - t0
        wall = time.perf_counter() - t0
        try:
            return r.returncode, json.loads(r.stdout), wall
        except ValueError:
            return r.returncode, {"stdout": r.stdout, "stderr": r.stderr[-2000:]}, wall

    def state(self):
        from residency.control.state import decode_state
        from residency.control.transport import AskClient, ask_endpoint
        from residency.events.asks import AskStatus
        from residency.events.handshake import key_in

        rep = AskClient(ask_endpoint(self.run_dir), timeout_s=30, key=key_in(self.run_dir)).ask(AskStatus(ask_id="b"))
        return decode_state(rep.state)

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
        self.log.close()


def chat(s: Serve, session: str | None, text: str, max_tokens: int, times: list[float] | None = None) -> None:
    body = {"model": s.model_id, "messages": [{"role": "user", "content": text}], "max_tokens": max_tokens,
            "temperature": 0, "stream": times is not None}
    if session:
        body["session_id"] = session
    with httpx.Client(base_url=s.url, timeout=1800) as c:
        if times is None:
            r = c.post("/v1/chat/completions", json=body)
            if r.status_code != 200:        # say why (e.g. a history past the model's max_position)
                raise SystemExit(f"chat {session}: HTTP {r.status_code}: {r.text[:500]}")
            return
        with c.stream("POST", "/v1/chat/completions", json=body) as r:
            r.raise_for_status()
            for line in r.iter_lines():
                if line.startswith("data:") and '"content"' in line:
                    times.append(time.perf_counter())


def fill(s: Serve, target_bytes: int, tokens_each: int) -> int:
    """Sessions with long histories until the device holds ``target_bytes``; how many sessions."""
    n = 0
    while True:
        st = s.state()
        used = st.workers[0].tiers["device"].used_bytes
        if used >= target_bytes:
            return n
        words = " ".join(WORDS[(n * 7 + i) % len(WORDS)] for i in range(tokens_each // 6))
        t0 = time.perf_counter()
        chat(s, f"dial-{n}", f"({n}) {words}", 4)
        log(f"[dial]   session {n}: {time.perf_counter() - t0:.2f} s, device used {used / MiB:.0f} MiB before it")
        n += 1


def gaps_ms(times: list[float], lo: float, hi: float) -> list[float]:
    return [1e3 * (b - a) for a, b in zip(times, times[1:]) if lo <= b <= hi]


# ------------------------------------------------------------------ (b): the second process
ALLOCATOR = r"""
import sys, time, torch
want, keep, wait_s = int(sys.argv[1]), int(sys.argv[2]), float(sys.argv[3])
free, total = torch.cuda.mem_get_info()
margin = 64 << 20
# the server's shrink makes the new (smaller) pool tensor before it drops the old one: leave it
# that room, then wait for the room plus the asked bytes, which only the old tensor's release gives
ballast = torch.empty(max(0, free - keep - margin), dtype=torch.uint8, device="cuda")
print("ready", free, flush=True)
sys.stdin.readline()
t0 = time.perf_counter()
tries = 0
while True:
    tries += 1
    try:
        x = torch.empty(keep + want, dtype=torch.uint8, device="cuda")
        x[-1] = 1
        torch.cuda.synchronize()
        break
    except torch.cuda.OutOfMemoryError:
        if time.perf_counter() - t0 > wait_s:
            print("timeout", time.perf_counter() - t0, tries, flush=True)
            sys.exit(0)
        time.sleep(0.0005)
print("allocated", time.perf_counter() - t0, tries, flush=True)
"""


def reclaim_to_first_byte(s: Serve, nbytes: int, device: str, keep: int = 0, wait_s: float = 60.0) -> dict:
    """``keep``: the bytes the server needs free for the shrink's new tensor (the pool's size after it)."""
    if device != "cuda":
        code, ans, wall = s.ctl("reclaim", "--tenant", "bench", "--bytes", str(nbytes))
        return {"asked_bytes": nbytes, "ctl_rc": code, "ctl_wall_s": wall, "answer": ans,
                "first_byte_s": None, "note": "n/a on CPU: no driver shared with a second process"}
    helper = subprocess.Popen([sys.executable, "-c", ALLOCATOR, str(nbytes), str(keep), str(wait_s)],
                              stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    ready = helper.stdout.readline().split()
    t0 = time.perf_counter()
    helper.stdin.write("go\n")
    helper.stdin.flush()
    out: dict = {}

    def ask() -> None:
        out["rc"], out["answer"], out["wall"] = s.ctl("reclaim", "--tenant", "bench", "--bytes", str(nbytes))
    t = threading.Thread(target=ask)
    t.start()
    line = helper.stdout.readline().split()
    first = time.perf_counter() - t0 if line and line[0] == "allocated" else None
    t.join(wait_s + 60)
    helper.stdin.close()
    try:
        helper.wait(60)
    except subprocess.TimeoutExpired:
        helper.kill()
    return {"asked_bytes": nbytes, "ballast_free_bytes": int(ready[1]) if len(ready) > 1 else None,
            "kept_free_bytes": keep, "ctl_rc": out.get("rc"), "ctl_wall_s": out.get("wall"),
            "answer": out.get("answer"), "first_byte_s": first,
            "helper": " ".join(line) or "no answer", "tries": int(line[2]) if len(line) > 2 else None}


def events_of(ans: dict, type_: str) -> list[dict]:
    return [e for e in ans.get("events", []) if e.get("type") == type_]


# ------------------------------------------------------------------ main
class Phases:
    """Each phase's wall time, printed to stderr as it ends, and the JSON rewritten after it (so a
    run cut off by its time limit still says where it was and what it had measured)."""

    def __init__(self, res: dict, out_path: str):
        self.res, self.out_path = res, out_path
        self.t_start = time.perf_counter()
        res["phases_s"] = {}
        res["complete"] = False

    def run(self, name: str, fn, *a, **kw):
        log(f"[dial] {name} ...")
        t0 = time.perf_counter()
        try:
            return fn(*a, **kw)
        finally:
            dt = time.perf_counter() - t0
            self.res["phases_s"][name] = round(dt, 3)
            log(f"[dial] {name}: {dt:.1f} s (total {time.perf_counter() - self.t_start:.1f} s)")
            self.write()

    def write(self) -> None:
        os.makedirs(os.path.dirname(self.out_path) or ".", exist_ok=True)
        with open(self.out_path, "w") as f:
            json.dump(self.res, f, indent=2, default=str)


def shrink_by_half(s: Serve, times: list[float]) -> dict:
    """(a): the ask, its events, and the stream's gaps before and while it ran."""
    cap = s.state().workers[0].tiers["device"].capacity_bytes
    half = cap // 2
    a0 = time.perf_counter()
    rc, ans, wall = s.ctl("resize", "--worker", "0", "--tier", "device", "--bytes", str(half))
    a1 = time.perf_counter()
    before = gaps_ms(times, 0, a0)
    during = gaps_ms(times, a0, a1)
    resized = events_of(ans, "PoolResized")
    measured = resized[0].get("measured_freed_bytes") if resized else None
    asked = cap - (resized[0]["to_bytes"] if resized else half)
    refused = bool(events_of(ans, "MoveRefused") or events_of(ans, "RebindRefused"))
    return {
        "rc": rc, "wall_s": wall, "from_bytes": cap, "to_bytes": half, "asked_freed_bytes": asked,
        "measured_freed_bytes": measured, "refused": refused,
        "bytes_moved": sum(e.get("bytes_moved", 0) for e in events_of(ans, "MoveAcked")),
        "num_moves": len(events_of(ans, "MoveAcked")),
        "committed": bool(events_of(ans, "RebindCommitted")),
        "gap_median_before_ms": statistics.median(before) if before else None,
        "gap_max_during_ms": max(during) if during else None, "gaps_during": len(during),
        # a stream that ended before the resize did saw only part of it
        "stream_tokens_after_resize": sum(1 for t in times if t > a1),
        "events": [e.get("type") for e in ans.get("events", [])] or ans,
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--pool-gib", type=float, default=None, help="device pool (default 16 on cuda, 1/32 on cpu)")
    p.add_argument("--fill", type=float, default=0.7, help="fraction of the pool the sessions fill")
    p.add_argument("--tokens-each", type=int, default=None, help="history tokens per session")
    p.add_argument("--reclaim-gib", type=float, default=None, help="(b)'s ask (default: a quarter of the pool)")
    p.add_argument("--stream-tokens", type=int, default=None)
    p.add_argument("--stream-wait", type=float, default=90.0, help="seconds to wait for the stream's end")
    p.add_argument("--reclaim-wait", type=float, default=60.0,
                   help="seconds the second process retries its allocation before it gives up")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    cuda = args.device == "cuda"
    pool_gib = args.pool_gib or (16.0 if cuda else 1 / 32)
    tokens_each = args.tokens_each or (16000 if cuda else 1500)
    stream_tokens = args.stream_tokens or (1500 if cuda else 600)
    machine = "cpu"
    if cuda:
        import torch
        machine = torch.cuda.get_device_name().split()[-1].lower().replace(" ", "-")
    out_path = args.out or os.path.join(ROOT, "bench", "results", f"dial-{date.today().isoformat()}-{machine}.json")
    cfg = model_shape(args.device)
    res: dict = {"bench": "dial", "git_commit": git_commit(), "date": date.today().isoformat(), "device": machine,
                 "pool_gib": pool_gib, "fill": args.fill, "tokens_each": tokens_each, "stream_tokens_asked": stream_tokens,
                 "model": {"layers": cfg.num_layers, "hidden": cfg.hidden, "kv_heads": cfg.num_kv_heads,
                           "head_dim": cfg.head_dim,
                           "note": ("random weights; few layers but Llama-3-8B's 2 MiB KV page: the dial measures "
                                    "pool memory, not the model") if cuda else
                                   "random weights, tiny (8 KiB pages) so a small pool fills in seconds on CPU"},
                 "loadavg_start": os.getloadavg()}
    ph = Phases(res, out_path)
    with tempfile.TemporaryDirectory(prefix="dial-") as tmp:
        model, page_bytes = ph.run("write_model", write_model, f"{tmp}/model", args.device)
        res["model"]["safetensors_bytes"] = sum(os.path.getsize(os.path.join(model, f)) for f in os.listdir(model)
                                                if f.endswith(".safetensors"))
        pool_bytes = int(pool_gib * GiB)
        blocks = pool_bytes // page_bytes
        s = ph.run("serve_start", Serve, tmp, model, args.device, blocks, host_bytes=pool_bytes)
        stream = None
        try:
            st = s.state()
            ws = st.workers[0]
            res.update(block_bytes=ws.block_bytes, pool_bytes=ws.tiers["device"].capacity_bytes,
                       page_bytes_planned=page_bytes)
            log(f"pool {ws.tiers['device'].capacity_bytes / MiB:.0f} MiB of {ws.block_bytes} B pages; filling")
            t0 = time.perf_counter()
            res["sessions"] = ph.run("fill", fill, s, int(args.fill * ws.tiers["device"].capacity_bytes), tokens_each)
            res["fill_s"] = time.perf_counter() - t0
            res["device_used_bytes"] = s.state().workers[0].tiers["device"].used_bytes
            log(f"{res['sessions']} sessions hold {res['device_used_bytes'] / MiB:.0f} MiB")
            times: list[float] = []
            stream = threading.Thread(target=chat, args=(s, None, "tell me everything", stream_tokens, times),
                                      daemon=True)

            def stream_start() -> None:
                stream.start()
                deadline = time.monotonic() + args.stream_wait
                while len(times) < 200 and stream.is_alive() and time.monotonic() < deadline:
                    time.sleep(0.01)
            ph.run("stream_start", stream_start)
            # (a) the shrink by half
            res["resize"] = ph.run("resize", shrink_by_half, s, times)
            # (b) reclaim to first byte: a quarter of what is left, unless asked
            left = s.state().workers[0].tiers["device"].capacity_bytes
            nbytes = int(args.reclaim_gib * GiB) if args.reclaim_gib else left // 4
            res["reclaim"] = ph.run("reclaim", reclaim_to_first_byte, s, nbytes, args.device,
                                    keep=max(0, left - nbytes), wait_s=args.reclaim_wait)
            rec = events_of(res["reclaim"]["answer"] or {}, "TenantReclaimed")
            res["reclaim"]["measured_bytes"] = rec[0].get("measured_bytes") if rec else None
            res["reclaim"]["granted_bytes"] = rec[0].get("granted_bytes") if rec else None
            code, rel, wall = ph.run("release", s.ctl, "release", "--tenant", "bench")
            res["release"] = {"rc": code, "wall_s": wall, "events": [e.get("type") for e in rel.get("events", [])]}
            ph.run("stream_end", stream.join, args.stream_wait)
            res["stream_tokens"] = len(times)
            res["stream_finished"] = not stream.is_alive()
        finally:
            ph.run("teardown", s.stop)
    r = res["resize"]
    m = r["measured_freed_bytes"]
    res["targets"] = {
        "freed_ge_asked": {"measured": m, "target": r["asked_freed_bytes"],
                           "met": True if r["refused"] else (None if m is None else m >= r["asked_freed_bytes"])},
        "resize_committed": {"measured": r["committed"], "target": True, "met": r["committed"] or r["refused"]},
    }
    if res["reclaim"].get("first_byte_s") is not None or cuda:
        res["targets"]["reclaim_first_byte"] = {"measured": res["reclaim"].get("first_byte_s"), "target": "allocated",
                                                "met": res["reclaim"].get("first_byte_s") is not None}
    res["loadavg_end"] = os.getloadavg()
    mb = lambda x: "n/a" if x is None else f"{x / MiB:.1f} MiB"  # noqa: E731
    ms = lambda x: "n/a" if x is None else f"{x:.1f} ms"  # noqa: E731
    sec = lambda x: "n/a" if x is None else f"{x:.3f} s"  # noqa: E731
    print(f"{'dial bench':<34}{machine}")
    print(f"{'pool / filled':<34}{mb(res['pool_bytes'])} / {mb(res['device_used_bytes'])} ({res['sessions']} sessions)")
    print(f"{'(a) shrink by half: wall':<34}{sec(r['wall_s'])}  (rc {r['rc']}, committed {r['committed']})")
    print(f"{'    bytes moved out':<34}{mb(r['bytes_moved'])} in {r['num_moves']} moves")
    print(f"{'    stream gap: median before':<34}{ms(r['gap_median_before_ms'])}")
    print(f"{'    stream gap: max during':<34}{ms(r['gap_max_during_ms'])} ({r['gaps_during']} gaps)")
    print(f"{'    freed: measured / asked':<34}{mb(m)} / {mb(r['asked_freed_bytes'])}")
    b = res["reclaim"]
    print(f"{'(b) reclaim: asked / granted':<34}{mb(b['asked_bytes'])} / {mb(b['granted_bytes'])}"
          f"  measured {mb(b['measured_bytes'])}")
    fb = b.get("first_byte_s")
    first = f"n/a ({b.get('note') or b.get('helper', '')})" if fb is None else f"{fb:.3f} s"
    print(f"{'    to first byte (2nd process)':<34}{first}")
    print(f"{'    ctl wall':<34}{sec(b['ctl_wall_s'])} (rc {b['ctl_rc']})")
    print("phases (s): " + ", ".join(f"{k} {v:.1f}" for k, v in res["phases_s"].items()))
    for k, v in res["targets"].items():
        print(f"target {k}: measured {v['measured']} target {v['target']} met {v['met']}")
    res["complete"] = True
    ph.write()
    print(f"wrote {out_path}")


if __name__ == "__main__":
    main()
