"""The parallel layout: the single owner of every parallel degree.

Everything else (validation, placement, the engines, the memory estimate) asks this
object for degrees rather than re-deriving them from the config, so that the
arithmetic of Megatron-Core's `initialize_model_parallel` lives in one place.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass, replace
from typing import Optional

ORDER_TOKENS = ("tp", "cp", "ep", "dp", "pp")


@dataclass(frozen=True)
class ParallelLayout:
    world_size: int
    gpus_per_node: int
    nvlink_domain_size: int
    tp: int = 1
    pp: int = 1
    cp: int = 1
    ep: int = 1
    etp: int = 1
    vpp: Optional[int] = None
    sp: bool = False
    order: str = "tp-cp-ep-dp-pp"

    @classmethod
    def from_config(cls, cfg) -> "ParallelLayout":
        p, c = cfg.parallel, cfg.cluster
        return cls(
            world_size=int(c.nodes) * int(c.gpus_per_node),
            gpus_per_node=int(c.gpus_per_node),
            nvlink_domain_size=int(c.nvlink_domain_size),
            tp=int(p.tp),
            pp=int(p.pp),
            cp=int(p.cp),
            ep=int(p.ep),
            etp=int(p.tp if p.etp is None else p.etp),
            vpp=None if p.vpp is None else int(p.vpp),
            sp=bool(p.sp),
            order=str(p.order),
        )

    # Derived degrees -------------------------------------------------------
    @property
    def model_parallel_size(self) -> int:
        return self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        """Data-parallel degree of the dense (attention) part: world / (TP·PP·CP)."""
        return self.world_size // self.model_parallel_size

    def accumulation(self, train) -> int:
        """Micro-batches each data-parallel rank runs per step: global / (micro x DP)."""
        return int(train.global_batch_size) // (int(train.micro_batch_size) * self.dp)

    @property
    def expert_model_parallel_size(self) -> int:
        return self.etp * self.ep * self.pp

    @property
    def expert_dp(self) -> int:
        """Data-parallel degree of the experts: world / (expert-TP·EP·PP)."""
        return self.world_size // self.expert_model_parallel_size

    @property
    def nodes(self) -> int:
        return self.world_size // self.gpus_per_node

    def megatron_sizes(self) -> dict:
        """The degrees under the keyword names Megatron-Core uses in both
        `initialize_model_parallel` and `TransformerConfig`."""
        return dict(
            tensor_model_parallel_size=self.tp,
            pipeline_model_parallel_size=self.pp,
            virtual_pipeline_model_parallel_size=self.vpp,
            context_parallel_size=self.cp,
            expert_model_parallel_size=self.ep,
            expert_tensor_parallel_size=self.etp,
        )

    def describe(self) -> str:
        s = f"TP={self.tp} PP={self.pp}"
        if self.vpp:
            s += f" (VPP={self.vpp})"
        s += f" CP={self.cp} DP={self.dp}"
        if self.ep > 1 or self.etp != self.tp:
            s += f" EP={self.ep} ETP={self.etp} EDP={self.expert_dp}"
        if self.sp:
            s += " SP"
        return s

    def slug(self) -> str:
        """A short name for run names and sweep folders: the degrees above 1 in the order
        tp, sp, cp, pp, vpp, ep, etp (only when it differs from tp), then dp always;
        e.g. `dp2`, `tp2-sp-dp1`, `pp2-vpp2-dp1`, `ep2-dp2`."""
        parts = [f"tp{self.tp}"] if self.tp > 1 else []
        parts += ["sp"] if self.sp else []
        parts += [f"{name}{getattr(self, name)}" for name in ("cp", "pp") if getattr(self, name) > 1]
        parts += [f"vpp{self.vpp}"] if self.vpp and self.vpp > 1 else []
        parts += [f"ep{self.ep}"] if self.ep > 1 else []
        parts += [f"etp{self.etp}"] if self.etp != self.tp else []
        return "-".join(parts + [f"dp{self.dp}"])

    # Rules of Megatron-Core's rank grid -----------------------------------
    def _grid_broken(self) -> set[str]:
        """The grid rules this layout breaks, by name; cheap, for trying fixes."""
        out = set()
        if self.world_size % self.model_parallel_size:
            out.add("dense")
        if self.world_size % self.expert_model_parallel_size and not (self.ep == 1 and self.etp == self.tp):
            out.add("expert")
        if self.sp and self.tp == 1:
            out.add("sp")
        if self.vpp is not None and self.pp == 1:
            out.add("vpp")
        return out

    def _grid_fix(self, rule: str, names: tuple[str, ...]) -> str:
        """The overrides that answer `rule` by lowering degrees in `names` to divisors of
        their values (so what divided by a degree, heads by TP or layers by PP, still does),
        breaking no grid rule this layout keeps: the fewest degrees changed, then the
        largest product kept. A null expert TP follows TP; SP and VPP are turned off where
        TP or PP becomes 1."""
        broken = self._grid_broken() - {rule}
        candidates = []
        for values in itertools.product(*(_divisors(getattr(self, n)) for n in names)):
            changed = {n: v for n, v in zip(names, values) if v != getattr(self, n)}
            if not changed:
                continue
            fields = dict(changed)
            if "tp" in changed and "etp" not in changed and self.etp == self.tp:
                fields["etp"] = changed["tp"]
            extra = {}
            if self.sp and fields.get("tp", self.tp) == 1:
                fields["sp"], extra["sp"] = False, "false"
            if self.vpp is not None and fields.get("pp", self.pp) == 1:
                fields["vpp"], extra["vpp"] = None, "null"
            if replace(self, **fields)._grid_broken() <= broken:
                product = 1
                for v in values:
                    product *= v
                candidates.append(((len(changed), -product, [-v for v in values]), changed, extra))
        _, changed, extra = min(candidates, key=lambda c: c[0])
        return " ".join([f"parallel.{n}={v}" for n, v in changed.items()]
                        + [f"parallel.{n}={v}" for n, v in extra.items()])

    def problems(self, dense_fix: str | None = None) -> list[str]:
        """Every way this layout cannot be built, each with the numbers and a fix; the
        first suggestion of each grid fix is overrides that give a layout these rules accept.
        `dense_fix`: the world-size problem's Fix, where the caller found one that passes
        the rules this module does not know (the model's divisions, memory)."""
        out = []
        for name in ("tp", "pp", "cp", "ep", "etp"):
            if getattr(self, name) < 1:
                out.append(f"parallel.{name}={getattr(self, name)} must be at least 1.")
        if out:
            return out
        tokens = self.order.split("-")
        if sorted(tokens) != sorted(ORDER_TOKENS):
            out.append(
                f"parallel.order='{self.order}' must name each of {'-'.join(ORDER_TOKENS)} once."
            )
        broken = self._grid_broken()
        if "dense" in broken:
            out.append(
                f"world size {self.world_size} (cluster.nodes x cluster.gpus_per_node) is not "
                f"divisible by TP*PP*CP = {self.tp}*{self.pp}*{self.cp} = {self.model_parallel_size} "
                f"(parallel.tp={self.tp}, parallel.pp={self.pp}, parallel.cp={self.cp}), so "
                "DP = world/(TP*PP*CP) is not a whole number. "
                f"Fix: {dense_fix or self._grid_fix('dense', ('tp', 'pp', 'cp'))}, or other degrees whose product "
                f"divides {self.world_size}."
            )
        if "expert" in broken:
            out.append(
                f"the expert grid expert-TP*EP*PP = {self.etp}*{self.ep}*{self.pp} = "
                f"{self.expert_model_parallel_size} does not divide world size "
                f"{self.world_size} (Megatron-Core requires it). "
                f"Fix: {self._grid_fix('expert', ('etp', 'ep', 'pp'))}, or other expert degrees "
                f"(parallel.ep, parallel.etp) whose product with PP divides {self.world_size}."
            )
        if "sp" in broken:
            out.append(
                "parallel.sp=true needs tensor parallelism, but parallel.tp=1. "
                "Fix: parallel.sp=false, or set parallel.tp>1."
            )
        if self.vpp is not None:
            if "vpp" in broken:
                out.append(
                    f"parallel.vpp={self.vpp} (interleaved pipeline) needs parallel.pp>1. "
                    "Fix: parallel.vpp=null, or set parallel.pp>1."
                )
            if self.vpp < 1:
                out.append(f"parallel.vpp={self.vpp} must be null or at least 1.")
        if not self.order.endswith("pp") and self.pp > 1 and self.dp != self.expert_dp:
            out.append(
                f"parallel.order='{self.order}' does not end in pp, so Megatron-Core needs "
                f"the dense DP ({self.dp}) and expert DP ({self.expert_dp}) to match. "
                "Fix: use an order ending in -pp."
            )
        return out


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def max_seqlen_per_rank(parallel, seq_length: int) -> int:
    """Dynamic CP: the most tokens of one document a rank holds at once
    (`parallel.max_seqlen_per_rank`; None: a whole row, so that a document is split only
    where memory requires it: validation's memory check names the share that fits)."""
    return parallel.max_seqlen_per_rank or seq_length


# The all-to-all form of static CP was measured faster than the all-gather form at CP=2 with
# TP = PP = EP = 1: the bench model ran 36.9 % MFU against 33.3 % in one call (2 x H200,
# bench_gpu_2xh200_20261128-2016.md, evaluations/results at commit 8871d16). Elsewhere it
# was not measured, so `auto` keeps all-gather there.
A2A_MEASURED_FASTER_AT_CP = 2


def heads_per_tp_rank(model, tp: int) -> tuple[int, int]:
    """The attention heads and key/value groups one TP rank holds."""
    return model.num_attention_heads // tp, (model.num_query_groups or model.num_attention_heads) // tp


def a2a_splits_heads(model, tp: int, cp: int) -> bool:
    """Whether the all-to-all CP form can give each CP rank an equal share of a TP rank's
    heads and key/value groups."""
    heads, groups = heads_per_tp_rank(model, tp)
    return groups > 0 and heads % cp == 0 and groups % cp == 0


def cp_exchange(parallel, model, data, on_cuda: bool) -> str:
    """How static CP exchanges its shards (parallel.cp_comm_type): as asked, or under `auto`
    the all-to-all where it was measured faster and applies (unpacked data, heads and
    key/value groups of each TP rank divisible by CP), else the all-gather."""
    if parallel.cp_comm_type != "auto":
        return parallel.cp_comm_type
    tp, cp = parallel.tp, parallel.cp
    measured = (on_cuda and parallel.cp_mode == "static" and cp == A2A_MEASURED_FASTER_AT_CP
                and tp == 1 and parallel.pp == 1 and parallel.ep == 1)
    applies = not data.packing and a2a_splits_heads(model, tp, cp)
    return "a2a" if measured and applies else "all_gather"
