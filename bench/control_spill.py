"""bench/control.py's big moves: a 2 GiB spill through the control process against the engine
called in this process, by variant (lane, hints, placement); the same moves through a no-copy
worker (the control plane alone), also under a DMA load; where each move's time goes."""
from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time

import placement
from control_cluster import BIG_LAYOUT, ROOT, Cluster, layout_bytes, pct
from residency.events.asks import AskMove

# Where a move's time goes, in order: (name, from mark, to mark). Marks are wall-clock ns: the
# bench's own (submit, returned), the control's (control.proc.MoveTraces), the worker's (MoveTimed,
# w_*) and the ack's started_ns/finished_ns. The worker's measured time is w_started..w_finished.
PHASES = [
    ("ask reaches the loop", "submit", "asked"),
    ("control: resolve, fund, fold MoveRequested", "asked", "requested"),
    ("control: commit MoveRequested", "requested", "committed"),
    ("ExecuteMove to the worker's socket", "committed", "w_received"),
    ("worker: decode, hand to engine thread", "w_received", "w_queued"),
    ("worker: engine thread wakes", "w_queued", "w_engine_start"),
    ("engine: before its clock starts", "w_engine_start", "w_started"),
    ("engine: measured (started..finished)", "w_started", "w_finished"),
    ("engine: after its clock stops", "w_finished", "w_engine_end"),
    ("worker: outcome encoded and sent", "w_engine_end", "w_sent"),
    ("outcome to the control's socket", "w_sent", "received"),
    ("control: decode outcome", "received", "decoded"),
    ("control: classify, record MoveAcked (folded after the answer when it commits at once)", "decoded", "recorded"),
    ("control: commit MoveAcked, answer", "recorded", "answered"),
    ("answer reaches the asker", "answered", "returned"),
]


def traced_move(c: Cluster, ask: AskMove) -> tuple[object, dict[str, int], float]:
    """One move through the control process: its ack, the phase marks of its trace, and its wall
    time in seconds from submit to the answer in hand.

    NOTE: the wall time is submit -> answer only. Collecting the trace afterwards (a ``call`` on
    the loop, and waiting for the worker's MoveTimed) is the bench's own work, never the move's."""
    t0 = time.time_ns()
    ans = c.proc.submit(ask).result(600)
    t1 = time.time_ns()
    if ans.error or type(ans.events[0]).__name__ != "MoveAcked":
        raise RuntimeError(f"{ask.kind} through control: {ans}")
    e = ans.events[0]
    mid = ans.move_ids[0]
    marks: dict[str, int] = {}
    for _ in range(100):      # the worker's MoveTimed follows its outcome
        marks = c.proc.call(lambda p: dict(p.traces.by_move.get(mid, {}))).result(10)
        if "w_sent" in marks:
            break
        time.sleep(0.002)
    marks.update(submit=t0, returned=t1, w_started=e.started_ns, w_finished=e.finished_ns)
    return e, marks, (t1 - t0) / 1e9


# ... of an early start (the worker began on the CommandAhead that carried the command): the
# request's commit and the command's trip run beside the copies; "(beside)" phases are not in the sum
PHASES_EARLY = [
    ("ask reaches the loop", "submit", "asked"),
    ("control: resolve, fund, send CommandAhead", "asked", "ahead"),
    ("CommandAhead to the worker's socket", "ahead", "w_ahead"),
    ("worker: decode, begin the move", "w_ahead", "w_engine_start"),
    *PHASES[6:],
]
BESIDE_EARLY = [
    ("(beside) control: fold and commit MoveRequested", "ahead", "committed"),
    ("(beside) ExecuteMove to the worker's socket", "committed", "w_received"),
]


# ... of an early ack (the worker sent the outcome before its engine settled the move)
EARLY_ACK_SENT = ("engine: after its clock stops, to its early ack sent", "w_finished", "w_sent")
BESIDE_EARLY_ACK = ("(beside) engine: settles the move after its ack left", "w_sent", "w_engine_end")


# ... and the part of "commit MoveAcked, answer" that is the commit (an ack committed at once)
PART_ACK_COMMIT = ("(part) control: commit MoveAcked alone", "recorded", "ack_committed")
# ... and when the ledger writer was warmed for the ack (MoveNearlyDone's estimate less the lead)
WARM_TIMING = [("(timing) MoveNearlyDone in, to the writer warmed", "nearly_done", "warmed"),
               ("(timing) the writer warmed, to the ack in", "warmed", "received")]


def breakdown(marks: dict[str, int]) -> dict[str, float] | None:
    """Phase durations in ms (None when a mark is missing); they add up to the whole round trip
    (an early start's "(beside)" phases overlap the copies and the "(part)" is inside another
    phase: neither is part of the sum)."""
    phases = PHASES_EARLY + BESIDE_EARLY if "w_ahead" in marks else PHASES
    if any(a not in marks or b not in marks for _, a, b in phases):
        return None
    if marks["w_sent"] < marks["w_engine_end"]:        # an early ack: it left before the engine settled
        phases = [p for p in phases if p[0] not in (PHASES[8][0], PHASES[9][0])]
        at = next(i for i, p in enumerate(phases) if p[0] == PHASES[10][0])
        phases[at:at] = [EARLY_ACK_SENT]
        phases.append(BESIDE_EARLY_ACK)
    if "ack_committed" in marks:
        phases = [*phases, PART_ACK_COMMIT]
    if "warmed" in marks and "nearly_done" in marks:
        phases = [*phases, *WARM_TIMING]
    return {name: (marks[b] - marks[a]) / 1e6 for name, a, b in phases}


def phase_medians(breakdowns: list[dict[str, float] | None]) -> dict[str, float] | None:
    """Each phase's median over several traced moves (one move's breakdown on a shared 2-core VM
    is one sample of scheduler noise; the medians show where the time goes)."""
    bs = [b for b in breakdowns if b]
    if not bs:
        return None
    names = dict.fromkeys(name for b in bs for name in b)      # early starts and others may mix
    return {name: _median([b[name] for b in bs if name in b]) for name in names}


def _median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def overheads(wall_s: float, marks: dict[str, int]) -> dict[str, float]:
    """What the control plane added to one move, three ways (seconds)."""
    out = {"through_control_s": wall_s, "worker_measured_s": (marks["w_finished"] - marks["w_started"]) / 1e9,
           "control_overhead_vs_worker_s": wall_s - (marks["w_finished"] - marks["w_started"]) / 1e9}
    if "w_engine_end" in marks:
        engine_s = (marks["w_engine_end"] - marks["w_engine_start"]) / 1e9
        out.update(engine_call_s=engine_s, control_overhead_vs_engine_call_s=wall_s - engine_s)
    return out


def spill_control_only(url: str, num_blocks: int, reps: int = 60) -> dict:
    """The same number of 2 MiB blocks through the control process to a no-copy worker: the control
    plane's cost of a big move without the copy (precise: each move takes ms, not seconds)."""
    bb = layout_bytes(BIG_LAYOUT)
    c = Cluster(url, "nocopy", "cpu", BIG_LAYOUT, num_blocks + 8, (num_blocks + 8) * bb, traced=True)
    try:
        blocks = c.commit(num_blocks)
        runs = []
        for rep in range(reps + 4):
            kind = "evict" if rep % 2 == 0 else "restore"
            _, marks, wall = traced_move(c, AskMove(ask_id="big", kind=kind, worker=0, blocks=blocks))
            if rep >= 4:
                runs.append((kind, overheads(wall, marks), breakdown(marks)))
    finally:
        c.close()
    out: dict = {"engine": "nocopy", "blocks": num_blocks, "block_bytes": bb, "moves_per_kind": reps // 2}
    for kind in ("evict", "restore"):
        rs = [r for r in runs if r[0] == kind]
        vs = sorted(r[1]["control_overhead_vs_engine_call_s"] for r in rs)
        best = min(rs, key=lambda r: r[1]["control_overhead_vs_engine_call_s"])
        med = sorted(rs, key=lambda r: r[1]["control_overhead_vs_engine_call_s"])[len(rs) // 2]
        out[kind] = {"overhead_vs_engine_call_ms": {"min": vs[0] * 1e3, "p50": pct(vs, 0.5) * 1e3,
                                                    "p90": pct(vs, 0.9) * 1e3, "max": vs[-1] * 1e3},
                     "breakdown_ms_best": best[2], "breakdown_ms_median": med[2],
                     "breakdown_ms_phase_medians": phase_medians([r[2] for r in rs])}
    return out


def dma_hog(seconds: float) -> None:
    """(--dma-hog, run as its own process) Copy 2 GiB device -> pinned host and back, over and
    over, for ``seconds``: the host-memory traffic of a spill and a restore, without the control."""
    import torch  # noqa: PLC0415
    dev = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    host = torch.empty(1 << 31, dtype=torch.uint8, pin_memory=True)
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        host.copy_(dev, non_blocking=True)
        dev.copy_(host, non_blocking=True)
        torch.cuda.synchronize()


def cpu_spinner() -> subprocess.Popen:
    """(--cpu-spinner) Another process that keeps one CPU busy doing nothing: no vCPU of this
    machine ever has all of them halted."""
    return subprocess.Popen([sys.executable, "-c", "while True: pass"])


def idle_spinners():
    """(part ``awake``) control/keep_awake.py's spinners, one window through the whole variant
    (not only while big moves are in flight, as the control's ``keep_awake`` does)."""
    from residency.control.keep_awake import KeepAwake  # noqa: PLC0415
    ka = KeepAwake()
    ka.until(time.monotonic_ns() + 3600 * 10**9)
    return ka


def under_dma_load(fn, seconds: float = 120.0):
    """``fn()`` while another process streams 2 GiB copies between the GPU and pinned host memory."""
    hog = subprocess.Popen([sys.executable, str(ROOT / "bench" / "control.py"), "--dma-hog", str(seconds)], cwd=ROOT)
    try:
        time.sleep(5.0)           # its CUDA context and first copies under way
        if hog.poll() is not None:
            raise RuntimeError(f"the DMA load ended early (rc {hog.returncode})")
        return fn()
    finally:
        hog.kill()
        hog.wait(10)


# Ways through the control process the spill is measured (each its own worker and ledger):
#   lane      the worker's lane (dataplane/device_thread.py; always on: no-lane is gone)
#   nearly    the worker's MoveNearlyDone before the last chunk; the control polls awake for the ack
#   ahead     the control's CommandAhead before the MoveRequested commits; the lane polls awake
#             (the hint always carries a device <-> host copy's command)
#   early     ... and the worker begins the copies on it meanwhile (its --start-ahead: an early
#             start; nothing is visible before the command comes)
#   warm      on MoveNearlyDone the control also warms the ledger's write path for the ack's commit
#   wake      an ask for a big copy wakes the worker's lane before the control resolves it
#             (warm and wake are what the control always does now: the names stay so that every
#             variant named in bench/results/ still parses; without them, they are on all the same)
#   awake     (an experiment) the same spinners kept spinning through the whole variant (runs
#             35-53 measured it with the bench's own always-spinning ones: 35/36 with yields)
#   keepawake the control keeps every CPU from halting while a big move is in flight and 1 s after
#             (control/keep_awake.py: SCHED_IDLE spinners, asleep between bursts)
#   pin-worker / pin-control / pinned   the worker's engine thread / the control's loop thread /
#             both, each with its ZMQ I/O thread, on a CPU of its own (bench/placement.py)
# name -> {lane, nearly, ahead, early, pin_control, pin_worker}
def _variant(name: str) -> dict:
    parts = set(name.split("+"))
    return {"lane": "no-lane" not in parts, "nearly": "nearly" in parts, "ahead": "ahead" in parts,
            "early": "early" in parts, "warm": "warm" in parts, "wake": "wake" in parts,
            "awake": "awake" in parts, "keepawake": "keepawake" in parts, "early_ack": "late-ack" not in parts,
            "pin_control": bool(parts & {"pinned", "pin-control"}), "pin_worker": bool(parts & {"pinned", "pin-worker"})}


VARIANTS = {n: _variant(n) for n in (
    "lane", "lane+nearly", "lane+nearly+ahead", "lane+nearly+ahead+early", "lane+nearly+ahead+early+warm",
    "lane+nearly+ahead+early+warm+wake", "lane+nearly+ahead+early+warm+wake+keepawake",
    "lane+nearly+ahead+early+warm+wake+keepawake+pinned")}


PARTS = {"lane", "nearly", "ahead", "early", "warm", "wake", "awake", "keepawake", "pinned", "pin-control",
         "pin-worker"}


def variant_of(name: str) -> dict:
    """Any '+'-joined combination of PARTS (the listed VARIANTS are the ones run by default)."""
    unknown = set(name.split("+")) - PARTS
    if unknown:
        raise SystemExit(f"--spill-variants: {sorted(unknown)} not understood (parts: {sorted(PARTS)})")
    return _variant(name)


def default_variant() -> str:
    """What ``residency serve`` runs on a GPU host."""
    return "lane+nearly+ahead+early+warm+wake+keepawake"


def spill(url: str, device: str, spill_bytes: int, reps: int = 3, variants: list[str] | None = None) -> dict:
    """A large spill device->host: in this process (the engine alone) vs through the control process,
    once per variant (the headline figures are the default variant's; all are under "variants")."""
    import torch  # noqa: PLC0415

    from residency.dataplane.mover import Mover  # noqa: PLC0415
    from residency.dataplane.pools import KVLayout  # noqa: PLC0415
    from residency.dataplane.build import layout_block_bytes, parse_layout  # noqa: PLC0415
    from residency.events.commands import CommitBlocks, ExecuteMove  # noqa: PLC0415

    if device == "cpu":
        torch.set_num_threads(1)          # like the worker (--torch-threads 1): the same copy engine on both sides
    layout = parse_layout(BIG_LAYOUT)
    bb = layout_block_bytes(layout)
    n = max(1, spill_bytes // bb)
    host_bytes = (n + 8) * bb
    kv = KVLayout(*layout[:4], dtype=layout[4])
    d = tempfile.mkdtemp(prefix="rcb-", dir="/tmp")
    out: dict = {"bytes": n * bb, "blocks": n, "block_bytes": bb}
    try:
        eng = Mover(kv, n + 8, host_bytes, d, Mover.pinned_bytes_needed(kv, n + 8, host_bytes), device,
                     disk_bytes=0, fsync=False)
        eng.commit_blocks(CommitBlocks(request_id="c", session=None, tier="device", blocks=list(range(n)), seed=1))
        times = []
        # evict, restore, ...: the first evict compiles; then as many evicts as go through the control
        # (at least 3), so the two distributions stand side by side, not only their best
        for rep in range(max(7, reps + 2)):
            kind, src, dst = ("evict", "device", "host") if rep % 2 == 0 else ("restore", "host", "device")
            if device.startswith("cuda"):
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            o = eng.execute(ExecuteMove(move_id=f"in-{rep}", kind=kind, src=src, dst=dst, blocks=list(range(n)),
                                        keep_source=False, deadline_ns=time.time_ns() + 600 * 10**9))
            times.append((kind, time.perf_counter() - t0, type(o).__name__))
        eng.close()
        spills = [t for k, t, _ in times[2:] if k == "evict"]
        out["in_process_s"] = min(spills)
        out["in_process_p50_s"] = _median(spills)
        out["in_process_gb_s"] = n * bb / min(spills) / 1e9
        out["in_process_runs"] = times
    finally:
        shutil.rmtree(d, ignore_errors=True)
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    variants = variants or [default_variant()]
    headline = default_variant() if default_variant() in variants else variants[0]
    out["headline_variant"] = headline
    out["variants"] = {}
    for name in variants:
        var = VARIANTS.get(name) or variant_of(name)
        # a ledger of its own per variant (a second control on one ledger would write the first's worker off)
        vurl = url[:-3] + f"-{name}.db" if url.startswith("sqlite") and url.endswith(".db") else url
        v = through_control(vurl, device, n, host_bytes, reps, out["in_process_s"], var)
        # unpaired, side by side: the median spill through the control vs the median in this process
        v["control_overhead_p50_vs_in_process_p50_s"] = v["through_control_p50_s"] - out["in_process_p50_s"]
        out["variants"][name] = v
        if name == headline:
            out.update(v)
    return out


def through_control(url: str, device: str, n: int, host_bytes: int, reps: int, in_process_s: float,
                    var: dict) -> dict:
    bb = layout_bytes(BIG_LAYOUT)
    control_cpu, (worker_cpu,) = placement.plan(1)
    cpus = (control_cpu if var["pin_control"] else None, worker_cpu if var["pin_worker"] else None)
    out: dict = {**var, "cpus": list(cpus)}
    c = Cluster(url, "real", device, BIG_LAYOUT, n + 8, host_bytes, traced=True, lane=var["lane"], cpus=cpus,
                nearly_done=var["nearly"], ahead=var["ahead"], early=var["early"], keep_awake=var["keepawake"],
                ahead_min_bytes=min(64 << 20, n * bb), early_ack=var["early_ack"])
    spinners = idle_spinners() if var.get("awake") else None
    try:
        blocks = c.commit(n)
        runs = []
        for rep in range(reps):
            kind = "evict" if rep % 2 == 0 else "restore"
            e, marks, wall = traced_move(c, AskMove(ask_id="big", kind=kind, worker=0, blocks=blocks))
            runs.append((kind, wall, (e.finished_ns - e.started_ns) / 1e9, overheads(wall, marks), breakdown(marks)))
        spills = [r for r in runs if r[0] == "evict"]
        best = min(spills, key=lambda r: r[1])
        vs_engine = sorted(r[3]["control_overhead_vs_engine_call_s"] for r in spills
                           if "control_overhead_vs_engine_call_s" in r[3])
        out.update(through_control_s=best[1], worker_measured_s=best[2], through_control_gb_s=n * bb / best[1] / 1e9,
                   control_overhead_s=best[1] - in_process_s,
                   control_overhead_vs_worker_s=best[1] - best[2],
                   control_overhead_vs_engine_call_s=best[3].get("control_overhead_vs_engine_call_s"),
                   control_overhead_vs_engine_call_p50_s=vs_engine[len(vs_engine) // 2] if vs_engine else None,
                   control_overhead_vs_engine_call_all_s=vs_engine,
                   through_control_p50_s=_median([r[1] for r in spills]),
                   engine_call_p50_s=_median([r[3]["engine_call_s"] for r in spills if "engine_call_s" in r[3]] or [0.0]),
                   breakdown_ms=best[4], breakdown_ms_phase_medians=phase_medians([r[4] for r in spills]),
                   through_control_runs=[r[:3] for r in runs])
    finally:
        if spinners is not None:
            spinners.stop()
        c.close()
        if device.startswith("cuda"):
            import torch  # noqa: PLC0415
            torch.cuda.empty_cache()
    return out
