"""Every rule a composed experiment must pass before any process starts.

Each rule is a small function returning messages that name the offending values and a
fix. `validate` runs them all and raises one `ConfigError` listing every problem, so a
user fixes a broken layout in one round instead of one error at a time. The rules live
by concern beside this module: `input_rules` (the config's own values), `layout_rules`,
`precision_rules`, `data_rules`, `resource_rules` (memory), and `fix_advice` (how a Fix
is written and read).
"""
from __future__ import annotations

import os

from ..engine_rules.registry import rules
from ..planning.layout import ParallelLayout
from ..planning.placement import plan_placement
from ..planning.plan import CommProfileProblem, Plan, derive_plan, predict_communication
from .data_rules import check_data
from .fix_advice import OVERRIDE_WORD, fix_overrides  # noqa: F401 - read from here by the tests and tools
from .input_rules import (check_checkpoint, check_choices, check_counts, check_engine, check_evaluate,
                          check_launcher, check_numbers, check_paths, check_tested_releases, check_tracking)
from .layout_rules import (check_batch, check_context_parallel, check_cp_comm_type, check_model_split,
                           check_nvlink_domains, check_packing)
from .precision_rules import (  # noqa: F401 - the machine checks, read from here by the worker and the tests
    LAYER_SPEC_WITHOUT_TE, check_precision, check_torch_native_paths, fp8_machine_problems,
    layer_spec_machine_problems)
from .resource_rules import check_host_memory, check_memory, fix_that_fits, world_size_fix


class ConfigError(ValueError):
    """A composed experiment that cannot run; `problems` lists every reason."""

    def __init__(self, problems: list[str]):
        self.problems = problems
        super().__init__(
            "the experiment is invalid; nothing was started:\n" + "\n".join(f"  - {p}" for p in problems)
        )


def validate(cfg, for_launch: bool = True) -> Plan:
    """Check everything; return the plan (derived once, here), or raise ConfigError."""
    count_problems = check_counts(cfg.model, cfg.train, cfg.cluster)
    # Where it runs comes first: on a machine without the cluster's GPUs, the first Fix says where to go.
    problems = check_launcher(cfg.launcher, cfg.cluster, for_launch)
    problems += check_choices(cfg) + count_problems + check_numbers(cfg) + check_paths(cfg)
    layout = ParallelLayout.from_config(cfg)
    counts_ok = not count_problems  # else the layout's arithmetic would divide by zero
    world_fix = world_size_fix(cfg, layout) if counts_ok else None
    layout_problems = layout.problems(dense_fix=world_fix) if counts_ok else []
    problems += layout_problems
    if counts_ok:  # how the degrees divide the model, beside any grid problem: every problem at once
        problems += check_model_split(cfg.model, cfg.train, layout, world_fix)
    if counts_ok and not layout_problems:
        problems += check_context_parallel(cfg.train, layout, cfg.model)
        problems += check_cp_comm_type(cfg.parallel, cfg.data, cfg.model, layout)
        problems += check_batch(cfg.train, layout)
        problems += check_packing(cfg.data, cfg.parallel, cfg.train, cfg.model, layout)
        problems += check_engine(cfg, layout, for_launch)
    problems += check_precision(cfg, for_launch)
    problems += check_torch_native_paths(cfg, for_launch)
    problems += check_tested_releases(cfg.launcher, for_launch)
    problems += check_tracking(cfg.tracking, cfg.launcher)
    problems += check_checkpoint(cfg)
    problems += check_data(cfg.data, cfg.model, cfg.parallel, cfg.launcher)
    problems += check_evaluate(cfg.evaluate, cfg.train, cfg.cluster)
    plan = None
    if not problems:
        placement = plan_placement(layout)
        problems += check_nvlink_domains(cfg.parallel, cfg.model, cfg.train, placement)
        try:
            plan = derive_plan(cfg, layout, placement, rules(cfg.engine))
        except CommProfileProblem as e:
            problems.append(str(e))
    if plan is not None:
        problems += check_memory(cfg, plan)
        problems += check_host_memory(cfg, plan, for_launch)
    elif counts_ok and not layout_problems and os.path.isfile(cfg.cluster.comm_profile or ""):
        try:  # no plan for an invalid config, but a profile that cannot price it is one more fix to list
            predict_communication(cfg, layout, rules(cfg.engine))
        except CommProfileProblem as e:
            problems.append(str(e))
    if problems:  # following the first Fix must leave a run that fits, not one more refusal
        problems[0] = fix_that_fits(cfg, problems[0])
    if problems:
        raise ConfigError(problems)
    return plan
