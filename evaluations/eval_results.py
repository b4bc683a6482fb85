"""The results file of an evaluation sweep: MFU, communication per group, prediction vs
measurement, memory estimate vs peak.

    python -m gridwright.evaluations.eval_results SWEEP_DIR [--out DIR]

Reads the sweep's points (summary.json, whose means leave out the warm-up and traced
steps; communication.json; plan.json); writes
`eval_sweep_<card>.md` beside the other results (replacing the last call's). Measured communication per group is
NCCL kernel time from the traces; `wait` is the part spent before the last member of the
communicator arrived (skew), so `transfer` = measured - wait is what the alpha-beta
prediction models.
"""
from __future__ import annotations

import argparse
from pathlib import Path

from omegaconf import OmegaConf

from gridwright.runtime.jobdir import CONFIG_FILE, PLAN_FILE, SUMMARY_FILE, load_job_config, read_json
from gridwright.tracking.sweep import SweepRecord
from gridwright.evaluations.results_file import card_of_this_machine, write_markdown
from gridwright.analysis.trace_analysis import COMMUNICATION_FILE

REPO = Path(__file__).resolve().parents[1]


def estimate_now(job: Path) -> float:
    """This code's memory estimate for the job's config, without the fixed workspace (which
    the allocator's peak does not hold), to compare with the measured peak."""
    from gridwright.planning.layout import ParallelLayout
    from gridwright.engine_rules.registry import rules
    from gridwright.planning.memory_estimate import estimate_memory

    cfg = load_job_config(job)
    if OmegaConf.select(OmegaConf.load(job / CONFIG_FILE), "engine.fused_adam") is None:
        cfg.engine.fused_adam = False  # a job from before the fused Adam ran the foreach form
    est = estimate_memory(cfg, ParallelLayout.from_config(cfg), rules(cfg.engine))
    return est.total_gib - est.workspace_gib


def tables(sweep_dir: Path) -> str:
    record = SweepRecord.load(sweep_dir)
    head = [
        "| point | engine | layout | tokens/s/GPU (untraced steps) | MFU megatron | MFU palm | HFU | step ms (untraced) | traced step ms | compute ms | exposed comm ms | idle ms | host wait ms | overlap % | peak alloc GiB (rank) | estimate at run time | estimate now |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    comm_rows = [
        "| point | group | predicted ms | measured ms | wait (skew) ms | transfer ms | predicted / transfer | exposed ms | MB/step measured | MB/step predicted |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    kind_rows = ["| point | kind | measured ms | wait (skew) ms | exposed ms | calls/step | MB/step |",
                 "| --- | --- | --- | --- | --- | --- | --- |"]
    for point in record.points:
        job = record.job_dir_of(point, sweep_dir)
        if job is None:  # an invalid point has no job directory
            head.append(f"| {point['num']} | {point.get('status')} | | | | | | | | | | | | | | | |")
            continue
        s = read_json(job / SUMMARY_FILE)
        c, plan = read_json(job / COMMUNICATION_FILE), read_json(job / PLAN_FILE)
        name = job.name
        if not s:
            head.append(f"| {name} | {point.get('status')} | | | | | | | | | | | | | | | |")
            continue
        m = c.get("mean", {})
        ms = lambda v: f"{v * 1e3:.1f}" if v is not None else ""  # noqa: E731
        head.append(
            f"| {name} | {engine_label(job)} | {plan.get('layout', {}).get('slug', '')} | {s['tokens_per_s_per_gpu']:,.0f} | {s.get('mfu', 0):.1%} | "
            f"{s.get('mfu_palm', 0):.1%} | {s.get('hfu', 0):.1%} | {s['mean_step_time_s'] * 1e3:.1f} | {ms(m.get('step_s'))} | {ms(m.get('compute_s'))} | "
            f"{ms(m.get('exposed_comm_s'))} | {ms(m.get('idle_s'))} | {ms(m.get('host_wait_s'))} | "
            f"{m.get('overlap_pct', 0):.1f} | "
            f"{s.get('memory_peak_gib', 0):.2f} ({s.get('memory_peak_rank', '')}) | "
            f"{s.get('memory_estimate_allocated_gib', 0):.2f} | {estimate_now(job):.2f} |")
        for kind, k in sorted(m.get("by_kind", {}).items()):
            size = "n/a" if k.get("bytes") is None else f"{k['bytes'] / 1e6:,.0f}"  # p2p kernels record none
            kind_rows.append(f"| {name} | {kind} | {ms(k.get('comm_s'))} | {ms(k.get('wait_s'))} | {ms(k.get('exposed_s'))} | "
                             f"{k.get('calls', 0):.0f} | {size} |")
        predicted = c.get("predicted") or {}
        for group in sorted(set(m.get("by_group", {})) | set(predicted)):
            g = m.get("by_group", {}).get(group, {})
            p = predicted.get(group, {})
            wait = g.get("wait_s")
            transfer = g["comm_s"] - wait if g and wait is not None else None
            ratio = f"{p['seconds'] / transfer:.2f}" if p.get("seconds") and transfer else ""
            mb = lambda v: f"{v / 1e6:,.0f}" if v is not None else "n/a"  # noqa: E731
            comm_rows.append(
                f"| {name} | {group} | {ms(p.get('seconds'))} | {ms(g.get('comm_s'))} | {ms(wait)} | {ms(transfer)} | "
                f"{ratio} | {ms(g.get('exposed_s'))} | {mb(g.get('bytes')) if g else ''} | {mb(p.get('bytes')) if p else ''} |")
    note = ("Memory: the allocator's peak (max over ranks; the rank in brackets) against the "
            "estimate without its fixed 3 GiB workspace (CUDA context, NCCL buffers, fragmentation "
            "are outside the allocator's count), as planned when the sweep ran and by the current code.")
    cards = sorted({f"{c.cluster.nodes * c.cluster.gpus_per_node} x {c.cluster.gpu.name}" for c in (
        load_job_config(j) for j in (record.job_dir_of(pt, sweep_dir) for pt in record.points) if j is not None)})
    return "\n".join([f"GPU: {', '.join(cards) or 'none ran'} (as each job's config names the card)", "",
                      "## Points", "", *head, "", note, "", "## Communication per group (mean step, mean over ranks)", "",
                      *comm_rows, "", "## Communication per kind (mean step, mean over ranks)", "", *kind_rows])


def engine_label(job: Path) -> str:
    """Which engine and ZeRO stage ran (with offload), as the job's config says."""
    cfg = load_job_config(job)
    z = cfg.zero
    offload = "+offload" if z.offload_optimizer or z.offload_params else ""
    return f"{cfg.engine.name} ZeRO-{z.stage}{offload}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sweep_dir", type=Path)
    ap.add_argument("--out", type=Path, default=REPO / "evaluations" / "results")
    ap.add_argument("--card", help="the machine the sweep ran on, as `2xh100` (default: this one's)")
    args = ap.parse_args()
    text = tables(args.sweep_dir)
    print(text)
    write_markdown(args.out, "eval_sweep", args.card or card_of_this_machine(),
                   "python -m gridwright.evaluations.eval_results SWEEP_DIR", f"Sweep: `{args.sweep_dir.name}`\n\n{text}",
                   title="Evaluation sweep")


if __name__ == "__main__":
    main()
