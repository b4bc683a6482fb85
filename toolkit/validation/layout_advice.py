"""Every valid layout of a model on a cluster, ranked by predicted speed: `launcher=advise`.

The composed experiment fixes the model, the cluster, the global batch and the sequence;
the advisor varies what a layout is: TP (with SP), PP, VPP, CP, EP and expert-TP, the ZeRO
stage (the distributed optimizer or not, where there is more than one DP x CP rank to
shard over), the micro-batch and recompute, compiled layers or eager on CUDA, and the
precision among those `launcher.precisions` offers (else the composed one), with the speed
options a layout can use (overlapped gradient reduce where DP > 1, TP communication
overlap where TP > 1). Each candidate passes the same layout rules `validate` applies
(`layout_rules.layout_passes`) and fits the card by the memory estimate, then is ranked by
the step-time model (`planning.step_time`).

Why not `validate()` per candidate: it composes and checks a whole config (engine, data,
paths) in milliseconds, and a 1,024-GPU search has thousands of candidates; the rules that
depend on the layout are the ones run here, on a plain copy of the config. The top layout
is then validated as a whole (`advise_lines` prints its Fix if it had one). Torch-free.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from itertools import product

from ..basics.conf_dir import CONF_DIR
from ..engine_rules.registry import rules
from ..planning.layout import ParallelLayout
from ..planning.memory_estimate import estimate_memory
from ..planning.model_math import param_counts
from ..planning.step_time import StepPrediction, load_calibration, predict_step, speeds_for
from .fix_advice import divisors, option_keys
from .layout_rules import layout_passes

RECOMPUTE = ("none", "selective", "full")
MICRO_BATCHES = (1, 2, 4, 8)
MEMORY_HEADROOM = 0.95  # of the card's memory: allocator fragmentation
# Predictions closer than this are a tie to the model: `launcher.verify` runs one of them
TIE = 0.01


class Plain(dict):
    """A config node as a plain dict read by attribute, as the planning functions read a
    DictConfig (OmegaConf's attribute access costs tens of microseconds a key)."""

    def __getattr__(self, key):
        try:
            return self[key]
        except KeyError:
            raise AttributeError(key) from None

    @classmethod
    def of(cls, node):
        if isinstance(node, dict):
            return cls({k: cls.of(v) for k, v in node.items()})
        if isinstance(node, list):
            return [cls.of(v) for v in node]
        return node

    def with_(self, **groups) -> "Plain":
        """A copy with the keys of each named group replaced."""
        out = Plain(self)
        for group, keys in groups.items():
            out[group] = Plain({**self[group], **keys})
        return out


@dataclass(frozen=True)
class Candidate:
    overrides: dict  # the layout's keys, as command-line overrides
    layout: ParallelLayout
    memory_gib: float
    prediction: StepPrediction

    def words(self) -> str:
        return " ".join(f"{k}={_word(v)}" for k, v in self.overrides.items())


def _word(v) -> str:
    return "null" if v is None else str(v).lower() if isinstance(v, bool) else str(v)


def _powers_of_two(limit: int) -> list[int]:
    out, n = [], 1
    while n <= limit:
        out.append(n)
        n *= 2
    return out


def precision_keys(name: str) -> dict:
    """The dotted keys a precision preset sets (conf/precision/NAME.yaml), as the advisor and
    its verify apply `precision=NAME` to a composed config."""
    keys = option_keys("precision", name)
    if keys is None:
        raise ValueError(f"launcher.precisions names {name!r}, not a precision preset; the presets: "
                         + ", ".join(sorted(p.stem for p in (CONF_DIR / "precision").glob("*.yaml"))))
    return keys


def layouts(cfg: Plain):
    """(overrides, layout) for every layout of the grid worth trying: degrees that divide
    the world, the layers and the experts; the rules then say which are valid."""
    c, m = cfg.cluster, cfg.model
    world = int(c.nodes) * int(c.gpus_per_node)
    domain = min(int(c.nvlink_domain_size), world)
    experts = int(m.num_experts or 0)
    for tp in _powers_of_two(min(domain, 8)):
        for pp in divisors(int(m.num_layers)):
            if world % (tp * pp) or pp > 64:
                continue
            chunks = int(m.num_layers) // pp
            vpps = [None] + ([v for v in divisors(chunks) if 1 < v <= 8] if pp > 1 else [])
            for cp in _powers_of_two(16):
                if world % (tp * pp * cp):
                    continue
                for ep in ([e for e in divisors(experts) if world % (pp * e) == 0] if experts else [1]):
                    for etp in ({1, tp} if experts else {tp}):
                        # an expert group (expert-TP x EP, adjacent ranks) inside one NVLink domain,
                        # as validation's check_nvlink_domains asks unless told otherwise
                        if experts and etp * ep > domain and not cfg.parallel.allow_ep_across_nvlink:
                            continue
                        for vpp in vpps:
                            layout = ParallelLayout(world_size=world, gpus_per_node=int(c.gpus_per_node),
                                                    nvlink_domain_size=int(c.nvlink_domain_size), tp=tp, pp=pp,
                                                    cp=cp, ep=ep, etp=etp, vpp=vpp, sp=tp > 1,
                                                    order=str(cfg.parallel.order))
                            yield {"parallel.tp": tp, "parallel.pp": pp, "parallel.vpp": vpp, "parallel.cp": cp,
                                   "parallel.ep": ep, "parallel.etp": etp if experts else None,
                                   "parallel.sp": tp > 1}, layout


def rank_layouts(cfg, top: int = 10) -> dict:
    """Every valid layout of `cfg` that fits, ranked by predicted tokens/s per GPU.

    Returns {"candidates": [Candidate, ...] (the `top` best), "counted": {...}, "seconds"}."""
    from omegaconf import OmegaConf

    started = time.perf_counter()
    base = Plain.of(OmegaConf.to_container(cfg, resolve=True))
    speeds = speeds_for(str(base.cluster.gpu.name), load_calibration())
    engine = rules(base.engine)
    params = param_counts(base.model)
    cap = float(base.cluster.gpu.memory_gib) * MEMORY_HEADROOM
    counted = {"layouts": 0, "valid": 0, "fit": 0}
    ranked: list[Candidate] = []
    gbs = int(base.train.global_batch_size)
    on_cuda = base.cluster.device == "cuda"  # compiled layers and TP overlap are CUDA's speed options
    compile_choices = (True, False) if on_cuda else (False,)
    chosen = list(base.launcher.get("precisions") or [])
    precisions = {name: Plain({**base.precision, **{k.removeprefix("precision."): v
                                                    for k, v in precision_keys(name).items()}})
                  for name in chosen} or {None: base.precision}
    for overrides, layout in layouts(base):
        for mbs in MICRO_BATCHES:
            if gbs % (mbs * layout.dp):
                continue
            train = {"micro_batch_size": mbs}
            trial_train = Plain({**base.train, **train})
            counted["layouts"] += 1
            if not layout_passes(base.model, trial_train, layout):
                continue
            counted["valid"] += 1
            # the distributed optimizer shards over DP x CP: with one such rank it is ZeRO 0
            stages = (0, 1) if layout.dp * layout.cp > 1 else (0,)
            for stage, recompute, (name, precision) in product(stages, RECOMPUTE, precisions.items()):
                trial = base.with_(parallel={k.split(".")[1]: v for k, v in overrides.items()},
                                   train={**train, "recompute": recompute},
                                   zero={"stage": stage, "offload_optimizer": False, "offload_params": False},
                                   engine={"overlap_grad_reduce": layout.dp > 1,
                                           "tp_comm_overlap": on_cuda and layout.tp > 1})
                trial["precision"] = precision
                memory = estimate_memory(trial, layout, engine, params).total_gib  # compiled or not, the same
                if cap and memory > cap:
                    continue
                for compiled in compile_choices:
                    trial["engine"] = Plain({**trial.engine, "compile_layers": compiled})
                    counted["fit"] += 1
                    prediction = predict_step(trial, layout, speeds, params)
                    keys = {**overrides, "train.micro_batch_size": mbs, "train.recompute": recompute,
                            "zero": f"stage{stage}", **({"precision": name} if name else {}),
                            **{f"engine.{k}": trial.engine[k]
                               for k in ("compile_layers", "overlap_grad_reduce", "tp_comm_overlap")}}
                    ranked.append(Candidate(keys, layout, memory, prediction))
    # Equal speeds (to 0.1 %): the simpler layout first (fewer split dimensions), then the
    # one with more memory left
    ranked.sort(key=lambda c: (-round(math.log(c.prediction.tokens_per_s_per_gpu) / math.log(1.001)), c.layout.cp,
                               c.layout.pp, c.layout.vpp or 1, c.layout.tp, c.layout.ep, c.memory_gib))
    best = ranked[:top]
    return {"candidates": best, "problems": [whole_config_problem(cfg, c) for c in best], "counted": counted,
            "seconds": time.perf_counter() - started, "card": speeds.card}


def config_keys(overrides: dict) -> dict:
    """A candidate's overrides as dotted config keys (its `zero=stageN` and `precision=NAME`
    groups as the keys they set)."""
    keys = {k: v for k, v in overrides.items() if k not in ("zero", "precision")}
    if "precision" in overrides:
        keys |= precision_keys(overrides["precision"])
    return keys | {"zero.stage": int(overrides["zero"][5:]), "zero.offload_optimizer": False,
                   "zero.offload_params": False}


def whole_config_problem(cfg, candidate: Candidate) -> str | None:
    """The first problem `validate` finds in `cfg` at the candidate's layout (every rule, not
    only the layout's), or None: the line `launcher=advise` offers to run must itself pass."""
    from .fix_advice import tried_with
    from .validate import ConfigError, validate

    with tried_with(cfg, config_keys(candidate.overrides)) as tried:
        try:
            validate(tried, for_launch=False)
        except ConfigError as e:
            return e.problems[0]
    return None


def advice_record(cfg, advice: dict) -> dict:
    """advise.json: what was searched, and each top layout with its prediction's parts."""
    return {"format": "gridwright-advice/1", "model": cfg.model.name, "cluster": cfg.cluster.name,
            "gpus": int(cfg.cluster.nodes) * int(cfg.cluster.gpus_per_node), "card": advice["card"],
            "global_batch_size": int(cfg.train.global_batch_size), "seq_length": int(cfg.train.seq_length),
            "precision": cfg.precision.name, "precisions": list(cfg.launcher.get("precisions") or []),
            "flops_definition": cfg.evaluate.flops_definition,
            "counted": advice["counted"], "seconds": round(advice["seconds"], 3),
            "top": [{"rank": i + 1, "overrides": c.overrides, "layout": c.layout.slug(), "memory_gib": c.memory_gib,
                     "problem": problem, **c.prediction.record()}
                    for i, (c, problem) in enumerate(zip(advice["candidates"], advice["problems"]))]}


def to_verify(top: list[dict], k: int) -> list[dict]:
    """The best `k` of advise.json's layouts that validate, passing over one predicted within
    `TIE` of one already taken: the model cannot order those two, so measuring both would
    test nothing about its ranking."""
    taken: list[dict] = []
    for layout in top:
        speed = layout["tokens_per_s_per_gpu"]
        if not layout["problem"] and all(abs(speed / t["tokens_per_s_per_gpu"] - 1) >= TIE for t in taken):
            taken.append(layout)
    return taken[:k]


def verified_lines(verified: list[dict]) -> list[str]:
    """Predicted beside measured for the layouts `launcher.verify` ran, and whether the
    measured order is the predicted one."""
    lines = [f"verify      {'#':>2} {'predicted tok/s/GPU':>19} {'measured':>9} {'error':>7}  layout"]
    for v in verified:
        measured = v.get("measured_tokens_per_s_per_gpu")
        error = f"{v['predicted_tokens_per_s_per_gpu'] / measured - 1:+.0%}" if measured else ""
        lines.append(f"            {v['rank']:>2} {v['predicted_tokens_per_s_per_gpu']:>19,.0f} "
                     f"{measured or 0:>9,.0f} {error:>7}  {v['layout']} ({v['status']}; {v['job_dir']})")
    same = measured_in_predicted_order(verified)
    if same is not None:
        lines.append("            measured order " + ("is the predicted one" if same else "differs from the predicted one"))
    return lines


def measured_in_predicted_order(verified: list[dict]) -> bool | None:
    """Whether the verified layouts that were measured rank by measured speed as they were
    predicted (advise.json's "verified", in predicted order); None with fewer than two."""
    ran = [v for v in verified if v.get("measured_tokens_per_s_per_gpu")]
    if len(ran) < 2:
        return None
    by_measured = sorted(ran, key=lambda v: -v["measured_tokens_per_s_per_gpu"])
    return [v["rank"] for v in by_measured] == [v["rank"] for v in ran]


def advice_lines(record: dict) -> list[str]:
    """The table `launcher=advise` prints, one layout a line, then each one's parts."""
    n = record["counted"]
    lines = [f"advise      {record['model']} on {record['gpus']} x {record['card']} ({record['cluster']}), global batch "
             f"{record['global_batch_size']} x {record['seq_length']}, {record['precision']}: "
             f"{n['layouts']} layouts, {n['valid']} valid; {n['fit']} configurations of them (ZeRO, recompute, "
             f"precision, compile) fit ({record['seconds']:.1f} s)"]
    if not record["top"]:
        lines.append("            no layout fits: a bigger cluster or a smaller model")
        return lines
    lines.append(f"            {'#':>2} {'tok/s/GPU':>10} {'MFU':>6} {'step s':>8} {'GiB':>6}  layout")
    for top in record["top"]:
        o = top["overrides"]
        extra = (f"mb{o['train.micro_batch_size']} {o['zero']} recompute={o['train.recompute']}"
                 + (f" {o['precision']}" if "precision" in o else "")
                 + (" compiled" if o.get("engine.compile_layers") else ""))
        lines.append(f"            {top['rank']:>2} {top['tokens_per_s_per_gpu']:>10,.0f} {top['mfu'] * 100:>5.1f}% "
                     f"{top['step_s']:>8.3f} {top['memory_gib']:>6.1f}  {top['layout']} {extra}")
    for top in record["top"]:
        parts = ", ".join(f"{k} {v * 1e3:.0f}" for k, v in top["parts"].items() if v > 0.0005)
        host = f"; host-bound: launching its kernels takes {top['host_s'] * 1e3:.0f}" if top["host_bound"] else ""
        lines.append(f"            #{top['rank']} ms: {parts}{host}"
                     + (f"; refused by validation: {top['problem']}" if top["problem"] else ""))
    lines.append(f"            MFU: model FLOPs ({record['flops_definition']}) / the card's peak; "
                 "parts: gridwright.planning.step_time")
    valid = [top for top in record["top"] if not top["problem"]]
    if valid:
        lines.append(f"            run #{valid[0]['rank']}: "
                     + " ".join(f"{k}={_word(v)}" for k, v in valid[0]["overrides"].items()))
    return lines
