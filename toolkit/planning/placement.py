"""Rank placement: where every global rank lives and which groups it joins.

The rank grid follows Megatron-Core's `initialize_model_parallel` exactly: one grid for
the dense part (tp, cp, dp, pp in `order`, tp fastest) and one for the experts
(expert-tp, ep, expert-dp, pp). Groups are enumerated in Megatron-Core's own order, which
`tests/test_placement.py` checks against its `RankGenerator` for many layouts.

Implemented with numpy index arithmetic (not by calling Megatron-Core) so that planning
16,384 ranks stays well under a second and needs no torch.distributed.
"""
from __future__ import annotations

import csv
import io
import json
from dataclasses import dataclass

import numpy as np

from .layout import ParallelLayout

# Group kinds recorded per rank: name -> (grid, token understood by Megatron-Core).
DENSE_GROUPS = {
    "tp": "tp",
    "cp": "cp",
    "dp": "dp",
    "dp_cp": "dp-cp",
    "pp": "pp",
    "mp": "tp-pp",
}
EXPERT_GROUPS = {
    "ep": "ep",
    "etp": "tp",
    "edp": "dp",
    "etp_ep": "tp-ep",
}


def _axes(order: str, sizes: dict[str, int]) -> tuple[list[str], list[int]]:
    names = order.split("-")
    return names, [sizes[n] for n in names]


def rank_groups(order: str, sizes: dict[str, int], token: str) -> np.ndarray:
    """Groups of ranks that vary along the axes in `token` (e.g. "tp-pp"), others fixed.

    Returns an array [num_groups, group_size]. Rank = sum(coord_i * stride_i) with the
    first axis of `order` fastest; groups are listed with the remaining axes' linear
    index (first axis fastest) and members with the masked axes' linear index, which
    is Megatron-Core's `generate_masked_orthogonal_rank_groups` ordering.
    """
    names, dims = _axes(order, sizes)
    world = int(np.prod(dims))
    # numpy is C-ordered (last axis fastest), so lay the grid out with reversed axes.
    grid = np.arange(world).reshape(dims[::-1])
    rev = names[::-1]
    wanted = set(token.split("-"))
    unknown = wanted - set(names)
    if unknown:
        raise ValueError(f"unknown parallel dimension(s) {sorted(unknown)} in '{token}'")
    keep = [i for i, n in enumerate(rev) if n not in wanted]
    vary = [i for i, n in enumerate(rev) if n in wanted]
    group_size = int(np.prod([dims[names.index(rev[i])] for i in vary])) if vary else 1
    return grid.transpose(keep + vary).reshape(-1, group_size)


def coordinates(order: str, sizes: dict[str, int]) -> dict[str, np.ndarray]:
    """Each rank's coordinate on every axis of the grid, as arrays indexed by rank."""
    names, dims = _axes(order, sizes)
    ranks = np.arange(int(np.prod(dims)))
    out, stride = {}, 1
    for n, d in zip(names, dims):
        out[n] = (ranks // stride) % d
        stride *= d
    return out


@dataclass
class Placement:
    """Every rank's host, local GPU, mesh coordinates and group ids."""

    layout: ParallelLayout
    host: np.ndarray
    local_gpu: np.ndarray
    coords: dict[str, np.ndarray]  # tp, cp, dp, pp, ep, etp, edp
    groups: dict[str, np.ndarray]  # kind -> [num_groups, size]
    group_of_rank: dict[str, np.ndarray]  # kind -> group index per rank

    @property
    def world_size(self) -> int:
        return self.layout.world_size

    def members(self, kind: str, rank: int) -> list[int]:
        return self.groups[kind][self.group_of_rank[kind][rank]].tolist()

    def groups_crossing_domain(self, kind: str, domain_size: int) -> list[list[int]]:
        """Groups of `kind` whose members sit in more than one NVLink domain."""
        dom = self.groups[kind] // domain_size
        bad = (dom != dom[:, :1]).any(axis=1)
        return self.groups[kind][bad].tolist()

    # Output ----------------------------------------------------------------
    def rank_record(self, rank: int) -> dict:
        rec = {"rank": rank, "host": int(self.host[rank]), "local_gpu": int(self.local_gpu[rank])}
        rec.update({k: int(v[rank]) for k, v in self.coords.items()})
        rec["groups"] = {k: self.members(k, rank) for k in self.groups}
        return rec

    def to_json(self) -> str:
        """Ranks with coordinates and group ids, plus each group's member list once."""
        ranks = []
        for r in range(self.world_size):
            rec = {"rank": r, "host": int(self.host[r]), "local_gpu": int(self.local_gpu[r])}
            rec.update({k: int(v[r]) for k, v in self.coords.items()})
            rec["group_ids"] = {k: int(v[r]) for k, v in self.group_of_rank.items()}
            ranks.append(rec)
        doc = {
            "layout": {
                "world_size": self.world_size,
                "tp": self.layout.tp, "pp": self.layout.pp, "vpp": self.layout.vpp,
                "cp": self.layout.cp, "dp": self.layout.dp, "ep": self.layout.ep,
                "etp": self.layout.etp, "expert_dp": self.layout.expert_dp,
                "sp": self.layout.sp, "order": self.layout.order,
                "gpus_per_node": self.layout.gpus_per_node,
                "nvlink_domain_size": self.layout.nvlink_domain_size,
            },
            "groups": {k: v.tolist() for k, v in self.groups.items()},
            "ranks": ranks,
        }
        return json.dumps(doc, indent=1)

    CSV_COORDS = ("tp", "cp", "dp", "pp", "ep", "etp", "edp")

    def to_csv(self) -> str:
        """One row per rank: host, GPU, coordinates and group ids (members are in the JSON)."""
        buf = io.StringIO()
        w = csv.writer(buf)
        kinds = list(self.groups)
        w.writerow(["rank", "host", "local_gpu", *self.CSV_COORDS, *[f"{k}_group" for k in kinds]])
        cols = [np.arange(self.world_size), self.host, self.local_gpu]
        cols += [self.coords[c] for c in self.CSV_COORDS]
        cols += [self.group_of_rank[k] for k in kinds]
        w.writerows(np.stack(cols, axis=1).tolist())
        return buf.getvalue()

    def table(self, max_rows: int = 32) -> str:
        """A compact table for the terminal; long plans show the first and last ranks."""
        head = f"{'rank':>6} {'host':>5} {'gpu':>4} {'tp':>3} {'cp':>3} {'dp':>4} {'pp':>3} {'ep':>3} {'etp':>3} {'edp':>4}  tp group / ep group"
        lines = [head]
        n = self.world_size
        shown = list(range(n)) if n <= max_rows else list(range(max_rows // 2)) + [-1] + list(range(n - max_rows // 2, n))
        for r in shown:
            if r < 0:
                lines.append(f"{'...':>6} ({n - max_rows} ranks not shown; see placement.csv)")
                continue
            c = self.coords
            tpg = self.members("tp", r)
            epg = self.members("ep", r)
            lines.append(
                f"{r:>6} {int(self.host[r]):>5} {int(self.local_gpu[r]):>4} {int(c['tp'][r]):>3} "
                f"{int(c['cp'][r]):>3} {int(c['dp'][r]):>4} {int(c['pp'][r]):>3} {int(c['ep'][r]):>3} "
                f"{int(c['etp'][r]):>3} {int(c['edp'][r]):>4}  {_span(tpg)} / {_span(epg)}"
            )
        return "\n".join(lines)


def _span(members: list[int]) -> str:
    if len(members) > 2 and members == list(range(members[0], members[-1] + 1)):
        return f"[{members[0]}..{members[-1]}]"
    if len(members) > 6:
        return "[" + ",".join(map(str, members[:3])) + ",...," + str(members[-1]) + "]"
    return "[" + ",".join(map(str, members)) + "]"


def plan_placement(layout: ParallelLayout) -> Placement:
    """Place a layout that `layout.problems()` accepted."""
    dense_sizes = {"tp": layout.tp, "cp": layout.cp, "ep": 1, "dp": layout.dp, "pp": layout.pp}
    expert_sizes = {"tp": layout.etp, "cp": 1, "ep": layout.ep, "dp": layout.expert_dp, "pp": layout.pp}
    order = layout.order
    world = layout.world_size
    ranks = np.arange(world)
    dense = coordinates(order, dense_sizes)
    expert = coordinates(order, expert_sizes)
    coords = {
        "tp": dense["tp"], "cp": dense["cp"], "dp": dense["dp"], "pp": dense["pp"],
        "ep": expert["ep"], "etp": expert["tp"], "edp": expert["dp"],
    }
    groups, group_of_rank = {}, {}
    for grid_sizes, table in ((dense_sizes, DENSE_GROUPS), (expert_sizes, EXPERT_GROUPS)):
        for kind, token in table.items():
            g = rank_groups(order, grid_sizes, token)
            idx = np.empty(world, dtype=np.int64)
            idx[g.reshape(-1)] = np.repeat(np.arange(g.shape[0]), g.shape[1])
            groups[kind], group_of_rank[kind] = g, idx
    return Placement(
        layout=layout,
        host=ranks // layout.gpus_per_node,
        local_gpu=ranks % layout.gpus_per_node,
        coords=coords,
        groups=groups,
        group_of_rank=group_of_rank,
    )
