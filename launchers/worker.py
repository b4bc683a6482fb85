"""One training process, started by torchrun: `python -m gridwright.launchers.worker --job-dir DIR`.

Reads the job's composed config, checks that the process groups Megatron-Core builds
are the placement that was printed, trains, and (on the one logging rank) writes each
step's metrics to its sinks (gridwright.runtime.metric_sinks): `metrics.jsonl`, the
terminal, and the MLflow run node 0's agent opened.

Its life around training: it dies with its agent; SIGTERM/SIGINT stop it after the
current step (with a checkpoint when `checkpoint.save` is set); a job directory that has
run before (torchrun's elastic restart, a Slurm requeue, a re-run of the printed lines)
resumes from the newest checkpoint in `checkpoint.save` into the same MLflow run, and no
step is recorded twice.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path

from ..basics.atomic_io import write_text_atomic
from ..basics.process_exit import exit_without_final_collection
from ..checkpoints.checkpoint_dir import BadPointer, hold_writer_lock, latest_checkpoint
from ..checkpoints.checkpoint_trust import UntrustedCheckpointFile, guard_process
from ..basics.path_rules import PathRefused
from ..runtime.jobdir import (FAILURE_FILE, METRICS_FILE, PLACEMENT_JSON, PLAN_FILE, RANKS_DIR, SUMMARY_FILE, load_job_config, read_json,
                     read_metrics)
from gridwright.launchers.failure_report import log_only
from ..runtime.metric_sinks import JsonlSink, MetricsSink, TerminalSink
from ..basics.known_warnings import filter_known_warnings
from ..planning.layout import ParallelLayout
from ..planning.disk_space import DiskFull
from ..runtime.heartbeat import Heartbeat
from ..runtime.process_tree import TOKEN_ENV, die_with_parent, end_descendants, exit_at_once
from ..runtime.step_metrics import StepMetrics, read_memory_records

EXIT_REFUSED = 2  # a worker refused its input (the agent then exits 2 too)
# How gloo and NCCL report a collective whose peer process has ended.
PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "NCCL communicator was aborted")
# gridwright's placement names -> Megatron-Core's group getters in observed_coordinates().
CHECKED_GROUPS = ("tp", "pp", "dp", "cp", "ep", "etp", "edp")


def placement_mismatches(planned: dict, observed: dict) -> list[str]:
    """Differences between a rank's planned record and what Megatron-Core built."""
    out = []
    rank = observed["rank"]
    rec = planned["ranks"][rank]
    for key in CHECKED_GROUPS:
        if rec[key] != observed[key]:
            out.append(f"rank {rank}: {key} coordinate planned {rec[key]}, built {observed[key]}")
        members = planned["groups"][key][rec["group_ids"][key]]
        if members != observed["groups"][key]:
            out.append(f"rank {rank}: {key} group planned {members}, built {observed['groups'][key]}")
    return out


class Reporter:
    """The logging rank's record of the run: each step to every sink (metrics.jsonl, the
    terminal, the agent's MLflow run), and the summary at the end."""

    def __init__(self, cfg, job_dir: Path, layout: ParallelLayout):
        self.cfg, self.job_dir = cfg, job_dir
        self.metrics = StepMetrics(read_json(job_dir / PLAN_FILE), layout.world_size, cfg.cluster.device == "cuda")
        # Steps an earlier attempt of this job recorded (a restart resumes from a checkpoint
        # and repeats the steps after it exactly).
        recorded_before = read_metrics(job_dir)
        self.jsonl = JsonlSink(job_dir, recorded_before)
        self.sinks: list[MetricsSink] = [
            self.jsonl,
            TerminalSink(cfg.train.log_interval, cfg.train.steps - 1, self.metrics.record["flops_definition"])]
        run_id = os.environ.get("MLFLOW_RUN_ID")  # the agent's run of this job (none with tracking off)
        if cfg.tracking.enabled and run_id:
            from ..tracking import mlflow_runs as tracking

            try:
                self.sinks.append(tracking.MetricsLogger(cfg.tracking, run_id, job_dir, skip_logged=bool(recorded_before)))
            except Exception as e:  # noqa: BLE001 - tracking never stops training
                print(tracking.tracking_failure_line("reaching the run", tracking.one_line(e), job_dir), flush=True)

    @property
    def history(self) -> list[dict]:
        """Every step of the run so far (earlier attempts' included): metrics.jsonl's rows."""
        return self.jsonl.rows

    def on_step(self, step: int, raw: dict) -> None:
        m = self.metrics.derive(raw)
        for sink in self.sinks:
            sink.write(step, m)

    def _memory_peaks(self) -> dict:
        """The highest peak over every rank (each leaves a record), and which rank it was."""
        key = "memory_max_allocated_gib" if self.metrics.on_cuda else "memory_max_rss_gib"
        per_rank = read_memory_records(self.job_dir)
        if not per_rank:  # an engine that leaves no records: the logging rank's own
            per_rank = {-1: {k: max(h[k] for h in self.history) for k in self.history[-1] if k.startswith("memory_")}}
        worst = max(per_rank, key=lambda r: per_rank[r][key])
        out = {"memory_peak_gib": per_rank[worst][key], "memory_peak_rank": worst,
               "memory_peak_gib_per_rank": {str(r): rec[key] for r, rec in per_rank.items()}}
        if self.metrics.on_cuda:
            out["memory_reserved_peak_gib"] = max(rec["memory_max_reserved_gib"] for rec in per_rank.values())
        return out

    def finish(self, extra: dict) -> None:
        if not self.history:  # resumed at the last step: nothing ran
            return
        # The first step includes warm-up; traced steps carry the profiler's overhead.
        window = self.cfg.evaluate.profile_steps
        traced = set(range(window[0], window[1])) if window else set()
        steady = [h for h in self.history[1:] if h["step"] not in traced] or self.history[1:] or self.history
        summary = {
            "steps": len(self.history),
            "steps_averaged": [h["step"] for h in steady],
            "first_loss": self.history[0]["loss"],
            "last_loss": self.history[-1]["loss"],
            "mean_step_time_s": sum(h["step_time_s"] for h in steady) / len(steady),
            "tokens_per_s_per_gpu": sum(h["tokens_per_s_per_gpu"] for h in steady) / len(steady),
            "ended_ms": int(time.time() * 1000),  # the run's end for MLflow, wherever it is logged later
            **extra,
        }
        summary.update(self.metrics.record)
        summary["tflops_per_gpu"] = sum(h["tflops_per_gpu"] for h in steady) / len(steady)
        for key in ("mfu", "mfu_palm", "hfu"):
            if key in self.history[-1]:
                summary[key] = sum(h[key] for h in steady) / len(steady)
        summary.update(self._memory_peaks())
        if "cp_straggler" in steady[-1]:
            summary["dynamic_cp"] = dynamic_cp_summary(steady)
        estimate = read_json(self.job_dir / PLAN_FILE).get("memory_estimate")
        if estimate:  # the allocator's peak holds no CUDA context or NCCL buffers
            summary["memory_estimate_gib"] = estimate["total_gib"]
            summary["memory_estimate_allocated_gib"] = estimate["total_gib"] - estimate["workspace_gib"]
        write_text_atomic(self.job_dir / SUMMARY_FILE, json.dumps(summary, indent=1))
        print("\n".join(summary_lines(summary, self.cfg.cluster)), flush=True)

    def fail(self, error: str) -> None:
        """Leave why training failed where the agent, which closes the run, reads it."""
        write_text_atomic(self.job_dir / FAILURE_FILE, json.dumps({"error": error}))


def dynamic_cp_summary(steady: list[dict]) -> dict:
    """Dynamic context parallelism over the averaged steps: documents per CP size (all
    steps together), and per step the mean groups, estimated and measured imbalance
    (max / mean per rank: the scheduler's length² / CP work, the ranks' busy time) and the
    swap's cost (scheduling, and the barriers before CP groups change)."""
    mean = lambda key: sum(h[key] for h in steady) / len(steady)  # noqa: E731
    sizes: dict[str, float] = {}
    for h in steady:
        for key, n in h.items():
            if key.startswith("cp_size_") and key.endswith("_documents"):
                k = key[len("cp_size_"):-len("_documents")]
                sizes[k] = sizes.get(k, 0) + n
    return {
        "documents_by_cp_size": {k: int(v) for k, v in sorted(sizes.items(), key=lambda kv: int(kv[0]))},
        "groups_per_step": mean("cp_groups"),
        "imbalance_estimated": mean("cp_imbalance_estimated"),
        "straggler": mean("cp_straggler"),
        "schedule_ms": mean("cp_schedule_ms"),
        "barrier_ms": mean("cp_barrier_ms"),
        "swap_ms": mean("cp_schedule_ms") + mean("cp_barrier_ms"),
    }


def has_run_before(job_dir: Path) -> bool:
    """Whether an earlier attempt of this job got as far as building its model (every
    rank asks before any rank of this attempt writes there: they meet first in init)."""
    return (job_dir / RANKS_DIR).is_dir() or (job_dir / METRICS_FILE).is_file()


def resume_point(checkpoint, job_dir: Path) -> str | None:
    """For a job that ran before: the checkpoint root to resume from (checkpoint.save,
    when it holds a checkpoint), else None (it starts over, or loads checkpoint.load)."""
    ck = checkpoint
    if not ck.save or not has_run_before(job_dir):
        return None
    try:
        return ck.save if latest_checkpoint(ck.save) is not None else None
    except Exception:  # noqa: BLE001 - a broken pointer is reported by the load itself
        return ck.save


def summary_lines(summary: dict, cluster) -> list[str]:
    """The end of a run on the terminal: what it learned, how fast, against which peak, how
    much memory. Every MFU names its definition; a run without a known peak says why."""
    averaged = summary["steps_averaged"]
    span = f"steps {averaged[0]}-{averaged[-1]}" if len(averaged) > 1 else f"step {averaged[0]}"
    lines = [
        f"summary     {summary['steps']} steps: loss {summary['first_loss']:.4f} -> {summary['last_loss']:.4f}",
        f"            {summary['tokens_per_s_per_gpu']:,.0f} tokens/s/GPU, {summary['mean_step_time_s'] * 1e3:,.1f} "
        f"ms/step, {_flop_rate(summary['tflops_per_gpu'])}/GPU (mean of {span})",
    ]
    if "mfu" in summary:
        definition = summary["flops_definition"]
        palm = f", {summary['mfu_palm']:.1%} by palm" if definition != "palm" else ""
        lines.append(
            f"            MFU {summary['mfu']:.1%} ({definition} definition{palm}; HFU {summary['hfu']:.1%}) "
            f"against {summary['peak_tflops']:g} TFLOP/s {summary['peak_kind']} ({cluster.gpu.name})")
    else:
        lines.append(f"            MFU none: the device ({cluster.device}, cluster {cluster.name}) has no "
                     "known peak FLOP/s")
    kind = "allocated by the CUDA allocator" if "memory_reserved_peak_gib" in summary else "resident (RSS)"
    estimate = (f"; estimate {summary['memory_estimate_allocated_gib']:.1f} GiB without workspace"
                if summary.get("memory_estimate_allocated_gib") is not None else "")
    lines.append(f"            peak memory {summary['memory_peak_gib']:.2f} GiB {kind}, rank "
                 f"{summary['memory_peak_rank']}{estimate}")
    if summary.get("attention"):
        from ..engines.attention_kernels import summary_line

        lines.append(f"            attention   {summary_line(summary['attention'])}")
    graphs = summary.get("cuda_graphs")
    if graphs:
        lines.append(f"            CUDA graphs {graphs['captured']} captured ({graphs['scope']}: a forward and a "
                     "backward per layer), replayed from step 1 on")
    d = summary.get("dynamic_cp")
    if d:
        sizes = ", ".join(f"CP {k} x {n:,}" for k, n in d["documents_by_cp_size"].items())
        lines.append(f"            dynamic CP  documents {sizes}; {d['groups_per_step']:.1f} groups/step; imbalance "
                     f"{d['straggler']:.2f} measured, {d['imbalance_estimated']:.2f} estimated (max/mean per rank); "
                     f"swap {d['swap_ms']:.1f} ms/step ({d['schedule_ms']:.1f} scheduling, "
                     f"{d['barrier_ms']:.1f} barriers)")
    return lines


def _flop_rate(tflops: float) -> str:
    return f"{tflops:,.1f} TFLOP/s" if tflops >= 1 else f"{tflops * 1e3:,.2f} GFLOP/s"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--job-dir", required=True, type=Path)
    args = parser.parse_args(argv)
    die_with_parent(signal.SIGTERM)
    rank = int(os.environ.get("RANK", "0"))
    try:
        return train(args.job_dir.resolve())
    except (UntrustedCheckpointFile, PathRefused, BadPointer) as e:  # input the user can act on: one line
        # (per node), no traceback
        if os.environ.get("LOCAL_RANK", "0") == "0":
            print(f"error: {e}", file=sys.stderr, flush=True)
        return EXIT_REFUSED
    except DiskFull as e:  # said in full by the rank that met it
        record_error(e)
        print(f"error: rank {rank}: {e}", file=sys.stderr, flush=True)
        return 1
    except Exception as e:  # noqa: BLE001 - the failure report names it; the traceback goes to this rank's log
        if isinstance(e, RuntimeError) and any(sign in str(e) for sign in PEER_GONE):
            # A peer ended first (its error is the one to read): one line, in this rank's log only.
            print(log_only(rank, f"error: rank {rank}: stopped because another rank ended first "
                                 f"({str(e).strip().splitlines()[0][:200]})"), end="", file=sys.stderr, flush=True)
            return 1
        record_error(e)
        print(log_only(rank, traceback.format_exc()), end="", file=sys.stderr, flush=True)
        return 1
    finally:
        end_descendants()


def record_error(e: BaseException) -> None:
    """torchrun's error file for this rank (TORCHELASTIC_ERROR_FILE, which the agent sets):
    the error, its traceback and when, from which the failure report names the first rank."""
    from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

    try:
        ErrorHandler().record_exception(e)
    except OSError:  # a full disk, say: the rank's log still has the traceback
        pass


def refuse_what_this_machine_cannot_run(cfg) -> None:
    """Validation's machine checks, repeated where the job runs: a Slurm or multi-node
    torchrun job's nodes are seen only by its workers. Without this, FP8 there would train
    in bf16 while MFU divided by the FP8 peak."""
    from ..runtime.machine_probe import transformer_engine_available
    from ..validation.validate import fp8_machine_problems, layer_spec_machine_problems
    from ..versions.torch_version import refuse_untested

    refuse_untested()  # a Slurm or torchrun node's torch is seen only here

    te = cfg.cluster.device == "cuda" and transformer_engine_available()
    problems = fp8_machine_problems(cfg, te) + layer_spec_machine_problems(cfg.engine, cfg.parallel, te)
    if problems:
        raise RuntimeError(" ".join(problems))


def train(job_dir: Path) -> int:
    from ..runtime.stop_request import StopRequest

    stop = StopRequest()
    cfg = load_job_config(job_dir)
    global _LEAVE_GROUPS_TO_EXIT
    _LEAVE_GROUPS_TO_EXIT = cfg.cluster.device == "cuda"
    guard_process(trust=cfg.checkpoint.trust_pickled_code)  # before any checkpoint file is read
    filter_known_warnings(cfg.cluster.device)
    refuse_what_this_machine_cannot_run(cfg)
    layout = ParallelLayout.from_config(cfg)
    planned = json.loads((job_dir / PLACEMENT_JSON).read_text())
    state = {}
    rank = int(os.environ.get("RANK", "0"))
    resume_from = resume_point(cfg.checkpoint, job_dir)
    if resume_from:
        cfg.checkpoint.load, cfg.checkpoint.weights_only = resume_from, False
        if rank == 0:
            print(f"restart     this job ran before: resuming from the newest checkpoint in {resume_from}", flush=True)
    if cfg.checkpoint.save and rank == 0:  # held until this process ends
        state["checkpoint_writer_lock"] = hold_writer_lock(cfg.checkpoint.save)

    def on_start(trainer):
        observed = trainer.observed_coordinates()
        write_text_atomic(job_dir / RANKS_DIR / f"rank_{observed['rank']:05d}.json", json.dumps(observed))
        problems = placement_mismatches(planned, observed)
        if problems:
            raise RuntimeError("the placement that ran differs from the plan:\n" + "\n".join(problems))
        state["spec"] = trainer.spec_name
        if trainer.is_logging_rank:
            state["reporter"] = Reporter(cfg, job_dir, layout)

    def on_step(step, raw):
        state["reporter"].on_step(step, raw)

    from ..engines.training_loop import run_training

    heartbeat = Heartbeat(job_dir, rank, os.environ.get(TOKEN_ENV))
    try:
        engine_facts = run_training(cfg, layout, on_step, on_start, job_dir=job_dir, stop=stop, progress=heartbeat)
    except BaseException as e:
        if "reporter" in state and not stop.signal:
            state["reporter"].fail(f"{type(e).__name__}: {e}")
        raise
    if "reporter" in state:
        extra = {"layer_spec": state["spec"], "placement_verified": True, **engine_facts}
        if stop.signal:
            extra.update(stopped_by_signal=int(stop.signal), stopped_after_step=state["reporter"].history[-1]["step"]
                         if state["reporter"].history else None)
        if cfg.evaluate.profile_steps is not None:
            extra["communication"] = evaluate_communication(job_dir)
        state["reporter"].finish(extra)
    return 0


# Set once a CUDA run starts: the process then ends at once (process_tree.exit_at_once), without destructors,
# whichever way training ends. A run with CUDA graphs leaves its NCCL groups to that exit
# (megatron_engine.open_trainer says why); and on 1 x H200 (torch 2.11, TE 2.19) a TE run
# of packed documents stayed alive after it had written its summary, its groups already
# destroyed, until its agent was stopped. Everything a run records is written by then.
# A failed rank on any device ends at once too (main's return code): one still tearing
# down when a peer that learnt of its failure has exited is SIGTERMed by torchrun, which
# then records -15 for it, not the rank's own exit code.
_LEAVE_GROUPS_TO_EXIT = False


def evaluate_communication(job_dir: Path) -> dict:
    """Analyse every rank's trace (all were written before training's final barrier), beside
    the plan's prediction (plan.json, when the cluster named a comm profile)."""
    from ..analysis.trace_analysis import COMMUNICATION_FILE, TraceError, analyze, format_report, summary_of

    try:
        doc = analyze(job_dir)
    except TraceError as e:
        doc = {"available": False, "reason": str(e)}
    predicted = read_json(job_dir / PLAN_FILE).get("predicted_communication")
    if predicted is not None:
        doc["predicted"] = predicted
    write_text_atomic(job_dir / COMMUNICATION_FILE, json.dumps(doc, indent=1))
    print(format_report(doc), flush=True)
    out = summary_of(doc)
    for group, pred in (doc.get("predicted") or {}).items():
        if out.get("available", True) and "by_group" in out:
            entry = out["by_group"].setdefault(group, {})
            entry["predicted_s"] = pred.get("seconds")
            entry["predicted_bytes"] = pred.get("bytes")
    return out


if __name__ == "__main__":
    code = main()
    if _LEAVE_GROUPS_TO_EXIT or code != 0:
        exit_at_once(code)
    exit_without_final_collection(code)
