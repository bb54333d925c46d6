"""bench/moves.py's report: the targets it checks, the table it prints, and what names a run
(commit, device, Triton)."""
from __future__ import annotations


import torch

from commit import git_commit  # noqa: F401  (bench/moves.py and its kin import it from here)

GB = 1e9
TARGETS = {  # figure -> (target, what it is compared with)
    "spill_fraction_of_ceiling": 0.95,
    "restore_fraction_of_ceiling": 0.90,
    "both_vs_one_direction": 1.7,
    # the same target, each both-at-once round over the spill and the restore of that round
    "both_vs_one_direction_paired": 1.7,
    "spill_checksum_cost_fraction": 0.05,   # at most
}


def device_name(dev) -> str:
    """The device's name and, on a GPU, its UUID: lent machines differ run to run (the same card
    model measured 93.6 and 101.5 GB/s both ways on two hosts)."""
    if dev.type != "cuda":
        return "cpu"
    uuid = getattr(torch.cuda.get_device_properties(dev), "uuid", None)
    return f"{torch.cuda.get_device_name(dev)} ({uuid})" if uuid else torch.cuda.get_device_name(dev)


def triton_version() -> str | None:
    try:
        import triton
        return triton.__version__
    except ImportError:
        return None


def table(r: dict) -> str:
    def row(name, key, ceil_key=None, unit="GB/s"):
        v = r.get(key)
        if v is None:
            return f"| {name} | n/a | |"
        f = r.get(key.replace("_GBps", "_fraction_of_ceiling")) if ceil_key is None else None
        return f"| {name} | {v:.2f} {unit} | {'' if f is None else f'{100 * f:.1f}%'} |"
    lines = ["| figure | value | of ceiling |", "|---|---|---|",
             row("ceiling d2h (contiguous pinned)", "ceiling_d2h_GBps", True),
             row("ceiling h2d (contiguous pinned)", "ceiling_h2d_GBps", True),
             row("ceiling both directions", "ceiling_bidir_GBps", True),
             row(f"spill, verified checksums ({r.get('copy_modes', {}).get('d2h')})", "spill_GBps"),
             row(f"restore, verified ({r.get('copy_modes', {}).get('h2d')})", "restore_GBps"),
             row("spill + restore at once, submit_many (aggregate)", "both_GBps"),
             row("spill + restore at once, two submits (aggregate)", "both_sequential_submits_GBps", True)]
    pct = lambda m, k: f"{100 * m[k + '_fraction_of_ceiling']:.1f}%" if k + "_fraction_of_ceiling" in m else "-"  # noqa: E731
    for mode, m in r.get("modes", {}).items():
        for d, keys in (("d2h", ("spill", "spill_no_checksum", "copy_only_d2h")),
                        ("h2d", ("restore", "restore_no_checksum", "copy_only_h2d"))):
            if all(k + "_GBps" in m for k in keys):
                lines.append(f"| {mode} {d}: engine / no checksum / bare copy | "
                             + " / ".join(f"{m[k + '_GBps']:.2f}" for k in keys) + " GB/s | "
                             + " / ".join(pct(m, k) for k in keys) + " |")
        for d in ("spill", "restore"):
            if d + "_phases_us" in m:
                lines.append(f"| {mode} {d} phases (us) | " + ", ".join(
                    f"{k} {v:.0f}" for k, v in m[d + "_phases_us"].items()) + " | |")
        if "both_GBps" in m:
            lines.append(f"| {mode}: both at once | {m['both_GBps']:.2f} GB/s ({m['both_vs_one_direction']:.2f}x one direction, "
                         f"{m.get('both_vs_one_direction_paired', float('nan')):.2f}x paired) "
                         f"| {100 * m['both_fraction_of_ceiling']:.1f}% of bidir |")
    lines += [row("baseline: per-chunk memcpy d2h (32 KiB each)", "per_chunk_memcpy_d2h_GBps"),
              row("baseline: per-chunk memcpy h2d (32 KiB each)", "per_chunk_memcpy_h2d_GBps"),
              row("baseline: per-block memcpy d2h (2 MiB each)", "per_block_memcpy_d2h_GBps"),
              row("checksum kernel (HBM read)", "checksum_kernel_GBps", True)]
    if "both_vs_one_direction" in r:
        hw = r.get("hardware_both_vs_one_direction")
        hwp = r.get("hardware_both_vs_one_direction_paired")
        lines.append(f"| both / one direction | {r['both_vs_one_direction']:.2f}x | "
                     + (f"bare copies on this host: {hw:.2f}x |" if hw else "|"))
        if "both_vs_one_direction_paired" in r:
            lines.append(f"| both / one direction, per round (its own spill and restore) | "
                         f"{r['both_vs_one_direction_paired']:.2f}x | "
                         + (f"bare copies per round: {hwp:.2f}x |" if hwp else "|"))
    if "both_fraction_of_bare_both_paired" in r:
        lines.append(f"| both at once / the bare copy both ways, per round (each round's own) | "
                     f"{100 * r['both_fraction_of_bare_both_paired']:.1f}% | |")
    if "spill_checksum_cost_fraction" in r:
        lines.append(f"| checksum cost on spill | {100 * r['spill_checksum_cost_fraction']:.1f}% | |")
    if "spill_engine_overhead_fraction" in r:
        lines.append(f"| engine cost on spill beyond the bare copy | {100 * r['spill_engine_overhead_fraction']:.1f}% | |")
    for k in ("single_block_spill_us", "single_block_restore_us"):
        if k in r:
            lines.append(f"| {k.replace('_us', '')} p50 / p99 | {r[k]['p50']} / {r[k]['p99']} us | |")
    if "single_block_first_us" in r:
        f = r["single_block_first_us"]
        lines.append(f"| first single-block spill / restore (Triton JIT) | {f['spill']} / {f['restore']} us | |")
    if "spill_host_cpu_ms_per_GiB" in r:
        lines.append(f"| host CPU per GiB: spill / restore | {r['spill_host_cpu_ms_per_GiB']:.2f} / "
                     f"{r['restore_host_cpu_ms_per_GiB']:.2f} ms | |")
    if "overlap" in r:
        o = r["overlap"]
        lines.append(f"| spill alone / with matmuls | {o['spill_alone_ms']:.1f} / {o['spill_with_compute_ms']:.1f} ms | |")
        lines.append(f"| matmuls alone / spill+matmuls / serial | {o['compute_alone_ms']:.1f} / "
                     f"{o['spill_and_compute_ms']:.1f} / {o['serial_would_be_ms']:.1f} ms | |")
    for k, t in r.get("targets", {}).items():
        lines.append(f"| target {k} {'<=' if k.endswith('cost_fraction') else '>='} {t['target']} | "
                     f"{t['measured']} | {'met' if t['met'] else 'MISSED' if t['met'] is False else 'n/a'} |")
    if r.get("errors"):
        lines.append(f"errors: {r['errors']}")
    return "\n".join(lines)
