"""Placement equals what Megatron-Core builds: checked against its own RankGenerator."""
import itertools
import json

import pytest
from megatron.core.parallel_state import RankGenerator

from gridwright.planning.layout import ParallelLayout
from gridwright.planning.placement import plan_placement, rank_groups

DENSE_TOKENS = ["tp", "cp", "dp", "pp", "tp-pp", "dp-cp", "tp-dp-cp", "tp-cp"]
EXPERT_TOKENS = ["tp", "ep", "dp", "tp-ep", "tp-ep-pp"]


def layouts():
    for world, tp, pp, cp, ep, etp in itertools.product(
        [8, 16, 24, 32], [1, 2, 4, 8], [1, 2, 3, 4], [1, 2], [1, 2, 4, 8], [None, 1, 2]
    ):
        lay = ParallelLayout(world_size=world, gpus_per_node=8, nvlink_domain_size=8,
                             tp=tp, pp=pp, cp=cp, ep=ep, etp=tp if etp is None else etp)
        if not lay.problems():
            yield lay


ALL_LAYOUTS = list(layouts())


def test_many_layouts_are_covered():
    assert len(ALL_LAYOUTS) > 300


@pytest.mark.parametrize("order", ["tp-cp-ep-dp-pp", "tp-pp-dp"])
def test_groups_match_megatron_rank_generator(order):
    checked = 0
    for lay in ALL_LAYOUTS:
        if order == "tp-pp-dp" and (lay.cp > 1 or lay.ep > 1):
            continue
        dense = RankGenerator(tp=lay.tp, ep=1, dp=lay.dp, pp=lay.pp, cp=lay.cp, order=order)
        expert = RankGenerator(tp=lay.etp, ep=lay.ep, dp=lay.expert_dp, pp=lay.pp, cp=1, order=order)
        dense_sizes = {"tp": lay.tp, "cp": lay.cp, "ep": 1, "dp": lay.dp, "pp": lay.pp}
        expert_sizes = {"tp": lay.etp, "cp": 1, "ep": lay.ep, "dp": lay.expert_dp, "pp": lay.pp}
        for tok in DENSE_TOKENS:
            assert rank_groups(dense.order, dense_sizes, tok).tolist() == dense.get_ranks(tok), (lay, tok)
            checked += 1
        for tok in EXPERT_TOKENS:
            assert rank_groups(expert.order, expert_sizes, tok).tolist() == expert.get_ranks(tok), (lay, tok)
            checked += 1
    assert checked > 1000


def test_placement_records_agree_with_generator():
    lay = ParallelLayout(world_size=32, gpus_per_node=8, nvlink_domain_size=8, tp=2, pp=2, cp=2, ep=4, etp=1)
    p = plan_placement(lay)
    gen = RankGenerator(tp=2, ep=1, dp=lay.dp, pp=2, cp=2, order="tp-cp-ep-dp-pp")
    egen = RankGenerator(tp=1, ep=4, dp=lay.expert_dp, pp=2, cp=1, order="tp-cp-ep-dp-pp")
    for kind, g, tok in (("tp", gen, "tp"), ("pp", gen, "pp"), ("dp", gen, "dp"), ("cp", gen, "cp"),
                         ("ep", egen, "ep"), ("edp", egen, "dp")):
        for group in g.get_ranks(tok):
            for pos, rank in enumerate(group):
                assert p.members(kind, rank) == group
                if kind in ("tp", "pp", "dp", "cp", "ep", "edp"):
                    assert p.coords[kind][rank] == pos
    assert p.host.tolist() == [r // 8 for r in range(32)]
    assert p.local_gpu.tolist() == [r % 8 for r in range(32)]


def test_json_and_csv_round_trip():
    lay = ParallelLayout(world_size=16, gpus_per_node=8, nvlink_domain_size=8, tp=2, pp=2, ep=2, etp=2)
    p = plan_placement(lay)
    doc = json.loads(p.to_json())
    assert doc["layout"]["dp"] == 4 and len(doc["ranks"]) == 16
    r5 = doc["ranks"][5]
    assert doc["groups"]["tp"][r5["group_ids"]["tp"]] == p.members("tp", 5) == [4, 5]
    rows = p.to_csv().strip().splitlines()
    assert len(rows) == 17 and rows[0].startswith("rank,host,local_gpu,tp,cp,dp,pp")


def test_mixtral_ep8_plan(compose):
    from gridwright.validation.validate import validate

    plan = validate(compose("+experiment=mixtral_ep8"), for_launch=False)

    layout, p = plan.layout, plan.placement
    assert (layout.world_size, layout.ep, layout.dp, layout.expert_dp) == (8, 8, 8, 1)
    assert p.members("ep", 3) == list(range(8))
    assert [int(p.coords["ep"][r]) for r in range(8)] == list(range(8))
