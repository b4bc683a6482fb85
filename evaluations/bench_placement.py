"""Time to plan a placement (validate-free grid arithmetic) and to write it, by world size.

    python -m gridwright.evaluations.bench_placement
"""
from __future__ import annotations

import time

from gridwright.config.compose import compose_config
from gridwright.planning.layout import ParallelLayout
from gridwright.planning.placement import plan_placement
from gridwright.validation.validate import validate

LAYOUTS = [  # (world, tp, pp, cp, ep)
    (8, 1, 1, 1, 8),
    (512, 8, 4, 1, 1),
    (4096, 8, 8, 2, 8),
    (16384, 8, 16, 2, 8),
]


def main() -> None:
    print(f"{'world':>6} {'layout':<46} {'plan s':>8} {'json s':>8} {'csv s':>8} {'json MB':>8}")
    for world, tp, pp, cp, ep in LAYOUTS:
        lay = ParallelLayout(world_size=world, gpus_per_node=8, nvlink_domain_size=8,
                             tp=tp, pp=pp, cp=cp, ep=ep, etp=1)
        assert not lay.problems(), lay.problems()
        t0 = time.perf_counter()
        p = plan_placement(lay)
        t1 = time.perf_counter()
        j = p.to_json()
        t2 = time.perf_counter()
        p.to_csv()
        t3 = time.perf_counter()
        print(f"{world:>6} {lay.describe():<46} {t1 - t0:>8.4f} {t2 - t1:>8.3f} {t3 - t2:>8.3f} {len(j) / 1e6:>8.1f}")
    # The whole check a launch does: every rule, placement and NVLink-domain check.
    cfg = compose_config(["+experiment=llama3_70b", "launcher=plan", "cluster.nodes=2048",
                          "train.global_batch_size=4096"])
    t0 = time.perf_counter()
    layout = validate(cfg).layout
    print(f"\nvalidate + place llama3_70b on {layout.world_size} GPUs ({layout.describe()}): "
          f"{time.perf_counter() - t0:.3f} s")


if __name__ == "__main__":
    main()
