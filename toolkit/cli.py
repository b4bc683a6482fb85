"""What `python launch.py [OVERRIDES]` does with a composed config.

validate -> create the job directory (config + placement) -> print the plan -> launch.
Nothing is created or started until validation has passed. `run` returns an Outcome;
the exit code and a sweep's record of the point are derived from it.
"""
from __future__ import annotations

import json
import shlex
import sys
from typing import TYPE_CHECKING

from omegaconf import DictConfig

from .config.compose import composition_notes, strip_hydra
from .validation.speed_notes import speed_notes
from .validation.override_errors import command_line_error, unknown_key_message
from .basics.atomic_io import unwritable_reason, write_text_atomic
from .basics.process_exit import skip_final_collection
from .checkpoints.checkpoint_dir import nothing_to_resume
from .runtime.jobdir import (ADVICE_FILE, PLAN_FILE, SUMMARY_FILE, JobDirExists, check_job_dir_free, create_job_dir,
                             planned_job_dir, read_json, same_job)
from .runtime.outcome import EXIT_INVALID, Outcome
from .planning.plan import Plan
from .planning.save_mode import save_mode_line
from .validation.validate import ConfigError, validate

if TYPE_CHECKING:
    from .tracking.sweep import SweepContext


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def plan_text(cfg, plan: Plan, job_dir) -> str:
    pc, layout, t = plan.params, plan.layout, cfg.train
    lines = [
        f"experiment  {cfg.name}   engine {cfg.engine.name}   launcher {cfg.launcher.name}",
        f"model       {cfg.model.name}: {_count(pc.total)} parameters, {cfg.model.num_layers} layers"
        + (f", {cfg.model.num_experts} experts top-{cfg.model.moe_router_topk}" if cfg.model.num_experts else ""),
        f"cluster     {cfg.cluster.name}: {cfg.cluster.nodes} node(s) x {cfg.cluster.gpus_per_node} "
        f"{cfg.cluster.gpu.name} ({cfg.cluster.device}), NVLink domain {cfg.cluster.nvlink_domain_size}",
        f"layout      {layout.describe()}   world {layout.world_size}   ZeRO stage {cfg.zero.stage}"
        f"   precision {cfg.precision.name}",
        f"batch       global {t.global_batch_size} = micro {t.micro_batch_size} x accumulation "
        f"{plan.accumulation} x DP {layout.dp}; sequence {t.seq_length}",
    ]
    layers = _layers_line(cfg)
    lines += [f"layers      {layers}"] if layers else []
    lines += [f"cp exchange {_cp_exchange_words(cfg)}"] if layout.cp > 1 else []
    saves = save_mode_line(cfg.checkpoint, cfg.model, cfg.precision, cfg.cluster)
    lines += [f"saves       {saves}"] if saves else []
    lines += plan.lines()
    if plan.memory is not None:
        lines.append(f"memory/GPU  {plan.memory.describe()} (estimate; {cfg.cluster.gpu.memory_gib} GiB)")
    lines += [f"note        {n}" for n in composition_notes(cfg) + speed_notes(cfg)]
    lines.append(f"job dir     {job_dir}")
    lines.append("placement")
    lines.append(plan.placement.table())
    return "\n".join(lines)


def _cp_exchange_words(cfg) -> str:
    """How static CP exchanges its shards, and why (parallel.cp_comm_type)."""
    from .planning.layout import A2A_MEASURED_FASTER_AT_CP, cp_exchange

    exchange = cp_exchange(cfg.parallel, cfg.model, cfg.data, cfg.cluster.device == "cuda")
    form = {"a2a": "all-to-all", "all_gather": "all-gather"}.get(exchange, exchange)
    if cfg.parallel.cp_comm_type != "auto":
        return f"{form} (parallel.cp_comm_type={cfg.parallel.cp_comm_type})"
    why = (f"measured faster at CP={A2A_MEASURED_FASTER_AT_CP}" if exchange == "a2a" else
           f"all-to-all was measured faster only at CP={A2A_MEASURED_FASTER_AT_CP}, TP=PP=EP=1, on CUDA, "
           "for unpacked rows and heads that divide by CP")
    return f"{form} (parallel.cp_comm_type=auto: {why})"


def _layers_line(cfg) -> str | None:
    """Whose layers and FP8 the run plans (engines that build Megatron-Core's layer spec)."""
    import importlib.util

    from .config.fp8_choice import planned_layers
    from .engine_rules.registry import rules

    if not rules(cfg.engine).builds_megatron_layer_spec(cfg.engine, cfg.parallel):
        return None
    te_installed = importlib.util.find_spec("transformer_engine") is not None
    return planned_layers(cfg.engine, cfg.precision, cfg.model, cfg.parallel, cfg.cluster.device == "cuda", te_installed)


def check_not_running(job_dir) -> None:
    """A job re-run while its owner still runs would be two runs in one directory."""
    from .tracking import run_owner

    owner = run_owner.owner(job_dir)
    if owner and run_owner.owner_gone(owner) is False:
        raise ConfigError([f"job {job_dir} is running now (pid {owner['pid']} on {owner['host']}); "
                           "stop it before running it again."])


def absolute_paths(cfg) -> None:
    """Make the paths the job records absolute: its workers may start in another directory
    (Slurm's submission directory, another node's home) and must find the same files."""
    from pathlib import Path

    from .tracking.store import absolute_uri

    cfg.tracking.uri = absolute_uri(cfg.tracking.uri)
    for key in ("save", "load"):
        if cfg.checkpoint[key]:
            cfg.checkpoint[key] = str(Path(cfg.checkpoint[key]).resolve())
    cfg.data.paths = [str(Path(p).resolve()) for p in cfg.data.paths]


def run(hydra_cfg: DictConfig, point: SweepContext | None = None) -> Outcome:
    """Launch one experiment; `point` when it is a point of a sweep (its job directory goes
    into the sweep's, and its MLflow run nests under the sweep's)."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        cfg = strip_hydra(hydra_cfg)
    except OmegaConfBaseException as e:
        message = unknown_key_message(e) if "Key" in type(e).__name__ else f"error: {e}".splitlines()[0]
        print(message, file=sys.stderr)
        return Outcome.invalid([message.removeprefix("error: ")])
    absolute_paths(cfg)
    if cfg.launcher.name == "advise":
        return advise(cfg, point)
    try:
        plan = validate(cfg, for_launch=True)
        job_dir = planned_job_dir(cfg, point.job_point if point else None)
        rerun = cfg.launcher.name == "local" and same_job(cfg, job_dir)
        if rerun:
            check_not_running(job_dir)
        else:
            check_job_dir_free(job_dir)
        problem = unwritable_reason(job_dir)
        if problem:
            raise ConfigError([f"cannot create the job directory {job_dir}: {problem}. Fix: set job_root or job_dir."])
        script_problem = emitted_script_problem(cfg, job_dir)
        if script_problem:
            raise ConfigError([script_problem])
    except (ConfigError, JobDirExists) as e:
        print(f"error: {e}", file=sys.stderr)
        for note in composition_notes(cfg):
            print(f"note: {note}", file=sys.stderr)
        return Outcome.invalid(getattr(e, "problems", None) or [e])
    idle = nothing_to_resume(cfg.checkpoint, cfg.train) if cfg.launcher.name == "local" else None
    if idle:
        print(idle)
        return Outcome("idle")
    if rerun:
        print(f"rerun       {job_dir} holds this job already: running it again (it resumes from the newest "
              "checkpoint in checkpoint.save, into its MLflow run)", flush=True)
    else:
        create_job_dir(cfg, plan.placement, job_dir, point.job_point if point else None,
                       run_tags=point.run_tags if point else None, run_name_suffix=point.name_suffix if point else "")
    write_text_atomic(job_dir / PLAN_FILE, json.dumps(plan.record(), indent=1))
    print(plan_text(cfg, plan, job_dir), flush=True)

    name = cfg.launcher.name
    if name == "plan":
        if cfg.data.packing:
            from gridwright.engines.dynamic_cp import preview_lines

            print("\n".join(preview_lines(cfg, plan.layout, job_dir)), flush=True)
        print("launcher=plan: nothing started.")
        return Outcome("planned", job_dir=job_dir)
    if name == "torchrun":
        from gridwright.launchers.torchrun_multinode import emit_torchrun

        path = emit_torchrun(cfg, job_dir)
        print(f"wrote {path}: run line N on node N.")
        print(path.read_text())
        return Outcome("planned", job_dir=job_dir)
    if name == "slurm":
        from gridwright.launchers.slurm import emit_slurm

        path = emit_slurm(cfg, job_dir)
        print(f"wrote {path}; submit it with: sbatch {shlex.quote(str(path))}")
        return Outcome("planned", job_dir=job_dir)
    return run_locally(cfg, job_dir)


def advise(cfg, point: SweepContext | None = None) -> Outcome:
    """`launcher=advise`: every valid layout of the composed model, cluster and batch, ranked
    by predicted speed; the best `launcher.top` printed, saved as advise.json and logged to
    MLflow. The composed layout itself need not be valid: it is what is being chosen."""
    from .planning.step_time import NoCalibration
    from .validation.layout_advice import advice_lines, advice_record, precision_keys, rank_layouts, verified_lines

    try:
        if cfg.launcher.top < 1:
            raise ConfigError([f"launcher.top={cfg.launcher.top} must be at least 1. Fix: launcher.top=10."])
        if not 0 <= cfg.launcher.verify <= cfg.launcher.top or cfg.launcher.verify_steps < 2:
            raise ConfigError([f"launcher.verify={cfg.launcher.verify} runs that many of the launcher.top="
                               f"{cfg.launcher.top} best layouts, each for launcher.verify_steps="
                               f"{cfg.launcher.verify_steps} (at least 2) steps. "
                               f"Fix: launcher.verify={min(3, cfg.launcher.top)} launcher.verify_steps=10."])
        job_dir = planned_job_dir(cfg, point.job_point if point else None)
        check_job_dir_free(job_dir)
        problem = unwritable_reason(job_dir)
        if problem:
            raise ConfigError([f"cannot create the job directory {job_dir}: {problem}. Fix: set job_root or job_dir."])
        for name in cfg.launcher.precisions:
            try:
                precision_keys(name)
            except ValueError as e:
                raise ConfigError([f"{e}. Fix: launcher.precisions=[bf16,fp8_tensorwise]."]) from None
        advice = rank_layouts(cfg, top=int(cfg.launcher.top))
    except NoCalibration as e:
        print(f"error: {e}", file=sys.stderr)
        return Outcome.invalid([str(e)])
    except (ConfigError, JobDirExists) as e:
        print(f"error: {e}", file=sys.stderr)
        return Outcome.invalid(getattr(e, "problems", None) or [e])
    record = advice_record(cfg, advice)
    job_dir.mkdir(parents=True)
    write_text_atomic(job_dir / ADVICE_FILE, json.dumps(record, indent=1))
    print("\n".join(advice_lines(record)))
    print(f"wrote {job_dir / ADVICE_FILE}")
    children = {}
    if cfg.tracking.enabled:
        from .tracking import mlflow_runs as tracking

        try:
            lines, children = tracking.log_advice(cfg.tracking, job_dir, record)
            print("\n".join(lines), flush=True)
        except Exception as e:  # noqa: BLE001 - the advice is in advise.json whatever the store does
            print(tracking.tracking_failure_line("logging the advice", tracking.one_line(e), job_dir))
    if cfg.launcher.verify:
        record["verified"] = verify_advice(cfg, job_dir, record)
        write_text_atomic(job_dir / ADVICE_FILE, json.dumps(record, indent=1))
        print("\n".join(verified_lines(record["verified"])), flush=True)
        if children:
            tracking.log_verified(cfg.tracking, children, record["verified"])
        if not all(v["status"] == "finished" for v in record["verified"]):
            return Outcome("failed", 1, job_dir=job_dir)
    return Outcome("planned" if not cfg.launcher.verify else "finished", job_dir=job_dir)


def verify_advice(cfg, job_dir, record: dict) -> list[dict]:
    """`launcher.verify`: the best K layouts that validate, each run here for
    `launcher.verify_steps` steps into `<advice dir>/verify/`, its measured speed beside the
    prediction (`layout_advice.to_verify` says which). A run that fails is recorded as such
    and the next one still runs."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from .validation.layout_advice import config_keys, to_verify

    out = []
    for top in to_verify(record["top"], int(cfg.launcher.verify)):
        trial = OmegaConf.create(OmegaConf.to_container(cfg, resolve=False))
        keys = config_keys(top["overrides"]) | {
            "launcher.name": "local", "launcher.verify": 0, "train.steps": int(cfg.launcher.verify_steps),
            "job_dir": str(job_dir / "verify" / f"{top['rank']}-{top['layout']}"),
            "name": f"{cfg.name}-advice-{top['rank']}"}
        for key, value in keys.items():
            OmegaConf.update(trial, key, value, merge=False)
        print(f"verify      #{top['rank']} {top['layout']}: {cfg.launcher.verify_steps} steps", flush=True)
        outcome = run(trial)
        summary = read_json(Path(keys["job_dir"]) / SUMMARY_FILE) if outcome.job_dir else {}
        out.append({"rank": top["rank"], "layout": top["layout"], "status": outcome.status, "job_dir": keys["job_dir"],
                    "predicted_tokens_per_s_per_gpu": top["tokens_per_s_per_gpu"],
                    "predicted_step_s": top["step_s"],
                    "measured_tokens_per_s_per_gpu": summary.get("tokens_per_s_per_gpu"),
                    "measured_step_s": summary.get("mean_step_time_s"), "measured_mfu": summary.get("mfu")})
    return out


def emitted_script_problem(cfg, job_dir) -> str | None:
    """What the torchrun lines or the Slurm script cannot express (a line break in a path,
    say), found before the job directory is created."""
    try:
        if cfg.launcher.name == "slurm":
            from gridwright.launchers.slurm import sbatch_script

            sbatch_script(cfg, job_dir)
        elif cfg.launcher.name == "torchrun":
            from gridwright.launchers.torchrun_multinode import node_command

            node_command(cfg, job_dir, 0)
    except ValueError as e:
        return str(e)
    return None


def run_locally(cfg, job_dir) -> Outcome:
    """Run the job here. Its MLflow run is the agent's: opened before the workers start,
    closed after they end. Only an agent killed outright leaves it RUNNING; its run is then
    closed here, as any later look at the job directory would (run_owner). A failed run ends
    in one block from its job directory (gridwright.launchers.failure_report), not in every
    rank's traceback: those are in the ranks' logs."""
    import time

    from gridwright.launchers.local import run_local

    started = time.time()
    code, stopped_by, lost = run_local(cfg, job_dir)
    # (the workers of an agent the launcher ended were stopped by it: not a user's signal)
    stopped_by = None if lost else stopped_by or read_json(job_dir / SUMMARY_FILE).get("stopped_by_signal")
    # A negative code: the agent itself was killed by that signal (by the launcher: `lost`).
    status = "failed" if lost else "killed" if stopped_by or code < 0 else ("finished" if code == 0 else "failed")
    run_id = None
    if cfg.tracking.enabled:
        from .tracking import mlflow_runs as tracking
        from .tracking.run_owner import owner

        run_id = owner(job_dir).get("run_id")
        if code < 0 or lost:
            try:
                error = lost or f"the agent was killed by signal {-code}"
                if tracking.close_orphaned_run(cfg.tracking, cfg.launcher, job_dir, status, error=error,
                                               ended_by_us=bool(lost)):
                    print("\n".join(tracking.where_to_see(tracking.tracking_uri(cfg.tracking), run_id)), flush=True)
            except Exception as e:  # noqa: BLE001 - a store lost mid-run: the job directory is the record
                print(tracking.tracking_failure_line("recording the run's end", tracking.one_line(e), job_dir))
    elif code == 0 and not stopped_by:
        print(f"mlflow      off (tracking=off); log the run later with: python -m gridwright.tracking.sync {job_dir}")
    if stopped_by:
        print(f"stopped: signal {stopped_by}; see {job_dir}", file=sys.stderr)
        return Outcome("killed", 128 + int(stopped_by), job_dir, run_id=run_id)
    if lost:
        print(f"error: {lost}; the launcher ended the job; see {job_dir}", file=sys.stderr)
        return Outcome(status, 1, job_dir, run_id=run_id)
    if code == 0:
        print(f"done: {job_dir}")
    elif code > 0 and code != EXIT_INVALID:  # which rank failed first, why, its log, the fix
        from gridwright.launchers.failure_report import block

        print("\n".join(block(job_dir, code, since=started)), file=sys.stderr)
    else:  # input refused (the workers said why, in one line), or the agent killed
        print(f"error: the job failed with exit code {code}; see {job_dir}", file=sys.stderr)
    return Outcome(status, code, job_dir, run_id=run_id)


def user_config_dir_first() -> None:
    """A user's `--config-dir DIR` (or `-cd DIR`) is searched before the packaged configs,
    so that an edited copy of a packaged file wins, as Hydra users expect (Hydra itself
    appends DIR after the application's own directory). The option is taken out of
    sys.argv and DIR is put first by a search-path plugin, registered through Hydra's
    public `Plugins.register`."""
    import os

    from hydra.core.plugins import Plugins
    from hydra.plugins.search_path_plugin import SearchPathPlugin

    argv, user, rest = sys.argv[1:], None, None
    for i, arg in enumerate(argv):
        if arg in ("--config-dir", "-cd") and i + 1 < len(argv):
            user, rest = argv[i + 1], argv[:i] + argv[i + 2:]
            break
        if arg.startswith("--config-dir="):
            user, rest = arg.split("=", 1)[1], argv[:i] + argv[i + 1:]
            break
    if user is None:
        return
    user = os.path.abspath(user)
    if not os.path.isdir(user):
        print(f"error: --config-dir {user} is not a directory.", file=sys.stderr)
        sys.exit(EXIT_INVALID)
    sys.argv[1:] = rest

    class UserConfigDirFirst(SearchPathPlugin):
        def manipulate_search_path(self, search_path) -> None:
            search_path.prepend(provider="gridwright --config-dir", path=f"file://{user}")

    Plugins.instance().register(UserConfigDirFirst)


def main() -> None:
    """Console entry point `gridwright`, the same as `python launch.py`."""
    import hydra

    from .config.compose import CONF_DIR

    user_config_dir_first()
    problem = command_line_error(sys.argv[1:], CONF_DIR)
    if problem:
        print(problem, file=sys.stderr)
        sys.exit(EXIT_INVALID)

    @hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
    def _main(cfg: DictConfig):
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        if HydraConfig.get().mode != RunMode.MULTIRUN:
            outcome = run(cfg)
            if outcome.exit_code:
                sys.exit(outcome.exit_code)
            return None
        # A sweep (-m) reports an invalid or failed point and goes on to the next. The
        # point's Outcome, or its exception, is what gridwright.tracking.sweep records for it.
        from .tracking.sweep import sweep_context

        num = HydraConfig.get().job.num
        try:
            outcome = run(cfg, sweep_context())
        except Exception as e:  # noqa: BLE001 - one point's crash must not end the sweep
            import traceback

            traceback.print_exc()
            print(f"sweep point {num} failed: {type(e).__name__}: {e}", file=sys.stderr)
            return e
        if outcome.exit_code:
            print(f"sweep point {num} ended with exit code {outcome.exit_code}", file=sys.stderr)
        return outcome

    try:
        _main()
    finally:  # hydra.main ends the process itself (sys.exit)
        skip_final_collection()
