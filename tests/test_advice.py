"""Advice that leads somewhere: each refusal's first Fix, followed, ends in an experiment
that validates, and no Fix or note suggests a value that is already set.

Every case is composed and validated for a launch on this machine (the fast tier runs on a
CPU without GPUs), as `python launch.py OVERRIDES` would be. The first problem's first Fix
suggestion is read with `fix_overrides` (the convention: the `key=value` words right after
`Fix:`), added to the command line, and the result validated again. A Fix that is an action
in words is carried out for real where the battery names the action (ACTED_ON).
"""
import json
import re

import pytest
import yaml
from omegaconf import DictConfig, ListConfig, OmegaConf

from gridwright.config.compose import compose_config, composition_notes, group_choices
from gridwright.validation.validate import OVERRIDE_WORD, ConfigError, fix_overrides, validate

GPU8 = ["cluster=dgx_h100", "precision=bf16", "zero=stage1", "train.seq_length=4096",
        "train.micro_batch_size=1", "train.global_batch_size=64"]
MOE_CPU = ["model=tiny_mixtral", "parallel.moe_token_dispatcher=allgather"]
GROUPS = ("model", "cluster", "engine", "precision", "zero", "launcher", "tracking")
MAX_STEPS = 4

# name: (overrides, the first Fix's overrides, the fixes followed until it validates).
# "{data}" stands for a prepared dataset's prefix, "{store}" for a damaged MLflow store.
REFUSALS = {
    # where it runs: the GPU experiments of the presets on this CPU machine
    "gpu_preset_without_gpus": (["+experiment=mixtral_ep8"], ["launcher=plan"], 1),
    "one_gpu_preset_without_gpus": (["+bench=bench_gpu"], ["launcher=plan"], 1),
    "fp8_without_te_without_gpus": (GPU8 + ["model=bench_1b", "cluster=h100_x1", "precision=fp8_delayed",
                                            "train.global_batch_size=8"], ["launcher=plan"], 1),
    # whose layers: Transformer Engine's asked for where it cannot run, or beside torch-native-only keys
    "te_layers_on_cpu": (["engine.layer_spec=transformer_engine"], ["engine.layer_spec=auto"], 1),
    "te_layers_with_compiled_layers": (GPU8 + ["model=bench_1b", "cluster=h100_x1", "train.global_batch_size=8",
                                               "launcher=plan", "engine.layer_spec=transformer_engine",
                                               "engine.compile_layers=true"], ["engine.layer_spec=auto"], 1),
    "local_multinode_gpu": (GPU8 + ["model=llama3_8b", "cluster.nodes=2", "parallel.tp=8"], ["launcher=torchrun"], 1),
    "local_multinode_cpu": (["cluster.nodes=2"], ["launcher=torchrun"], 1),
    # how the layout divides the model
    "heads_vs_tp": (GPU8 + ["model=llama3_8b", "parallel.tp=8", "model.num_attention_heads=36", "model.num_query_groups=4",
                            "model.hidden_size=4608", "launcher=plan"], ["parallel.tp=4"], 1),
    "query_groups_vs_tp": (GPU8 + ["model=llama3_8b", "parallel.tp=8", "model.num_query_groups=4", "launcher=plan"],
                           ["parallel.tp=4"], 1),
    "vocab_vs_tp": (["parallel.tp=2", "model.vocab_size=257"], ["parallel.tp=1"], 1),
    "ffn_vs_tp": (["parallel.tp=2", "model.ffn_hidden_size=175"], ["parallel.tp=1"], 1),
    "layers_vs_pp": (["parallel.pp=2", "model.num_layers=3"], ["parallel.pp=1"], 1),
    "layers_vs_vpp": (["parallel.pp=2", "parallel.vpp=3"], ["parallel.vpp=2"], 1),
    # interleaved 1F1B runs its micro-batches in groups of PP: 3 micro-batches on PP=2 stall
    "micro_batches_vs_vpp": (["parallel.pp=2", "parallel.vpp=2", "train.micro_batch_size=1",
                              "train.global_batch_size=3"], ["train.global_batch_size=4"], 1),
    "experts_vs_ep": (GPU8 + ["model=mixtral_8x7b", "model.num_layers=4", "parallel.ep=8", "model.num_experts=12",
                              "launcher=plan"], ["parallel.ep=4"], 1),
    "ep_without_experts": (["parallel.ep=2"], ["parallel.ep=1"], 1),
    # the rank grid: the world size's fix changes the fewest degrees, nearest those asked,
    # to a layout that passes every rule and fits (validation's _world_size_fix)
    "world_not_divisible": (GPU8 + ["model=llama3_8b", "parallel.tp=4", "parallel.pp=3", "model.num_layers=24",
                                    "launcher=plan"], ["parallel.pp=2"], 1),
    # planning/layout.py alone once lowered tp=3 to tp=1 here, where Llama-3-8B does not fit
    "world_not_divisible_fits": (["+experiment=llama3_8b", "parallel.tp=3", "launcher=plan"], ["parallel.tp=2"], 1),
    "world_not_divisible_with_sp_and_vpp": (GPU8 + ["model=llama3_8b", "parallel.tp=3", "parallel.sp=true",
                                                    "parallel.pp=3", "parallel.vpp=2", "model.num_layers=24",
                                                    "model.num_attention_heads=24", "model.num_query_groups=3",
                                                    "model.hidden_size=3072", "launcher=plan"],
                                            ["parallel.tp=1", "parallel.pp=2", "parallel.sp=false"], 1),
    "expert_grid": (MOE_CPU + ["parallel.ep=4"], ["parallel.ep=2"], 1),
    "sp_without_tp": (["parallel.sp=true"], ["parallel.sp=false"], 1),
    "vpp_without_pp": (["parallel.vpp=2"], ["parallel.vpp=null"], 1),
    "etp_without_experts": (["parallel.etp=2"], ["parallel.etp=null"], 1),
    "moe_tp_without_sp": (MOE_CPU + ["parallel.tp=2"], ["parallel.sp=true"], 1),
    "topk_above_experts": (MOE_CPU + ["model.moe_router_topk=5"], ["model.moe_router_topk=4"], 1),
    "cp_sequence": (GPU8 + ["model=llama3_8b", "parallel.cp=2", "train.seq_length=4094", "launcher=plan"],
                    ["train.seq_length=4096"], 1),
    "seq_beyond_positions": (["train.seq_length=512"], ["train.seq_length=256"], 1),
    "global_batch": (["train.global_batch_size=7"], ["train.global_batch_size=8"], 1),
    "warmup_too_long": (["train.steps=2"], ["train.warmup_steps=0"], 1),
    "bad_name": (["name=../x"], ["name=my_run"], 1),
    # the model's family: the one its shape belongs to
    "family_unknown": (["model.family=lama"], ["model.family=llama"], 1),
    "family_of_experts_for_a_dense_model": (["model.family=mixtral"], ["model.family=mistral"], 1),
    "family_fixed_value": (["model.family=qwen2"], ["model.qkv_bias=true"], 1),
    "choice_misspelt": (["train.recompute=ful"], ["train.recompute=full"], 1),
    "zero_stage_out_of_range": (["zero.stage=-1"], ["zero.stage=0"], 1),
    # precision
    "fp8_preset_on_cpu": (["precision=fp8_delayed"], ["precision=bf16"], 1),
    "fp8_key_on_cpu": (["precision=bf16", "precision.fp8_recipe=delayed"], ["precision.fp8_recipe=null"], 1),
    # the first Fix carries the memory Fix of the config it leaves: one step to a run that fits
    "mxfp8_on_hopper": (GPU8 + ["model=llama3_8b", "precision=mxfp8", "launcher=plan"],
                        ["precision=fp8_delayed", "train.recompute=full"], 1),
    # engines
    "alltoall_on_cpu": (["model=tiny_mixtral", "parallel.ep=2"], ["parallel.moe_token_dispatcher=allgather"], 1),
    "megatron_stage3_on_cpu": (["zero=stage3"], ["zero.stage=1"], 1),
    "megatron_offload": (["zero=stage2_offload"], ["engine=deepspeed"], 1),
    "megatron_fsdp_one_rank": (["+bench=bench_gpu", "zero=stage3", "launcher=plan"], ["zero.stage=1"], 1),
    "megatron_overlap_param_gather_zero0": (["zero=stage0", "engine.overlap_param_gather=true"], ["zero.stage=1"], 1),
    "deepspeed_zero0_bf16": (["engine=deepspeed", "zero=stage0", "precision=bf16"], ["zero.stage=1"], 1),
    "deepspeed_selective_recompute": (["engine=deepspeed", "zero=stage1", "train.recompute=selective"],
                                      ["train.recompute=full"], 1),
    "deepspeed_tp_zero3": (["engine=deepspeed", "zero=stage3", "parallel.tp=2"], ["zero.stage=1"], 1),
    # GPU memory: the Fix is a layout that was estimated to fit, never a setting already made
    "gpu_memory": (GPU8 + ["model=llama3_70b", "launcher=plan"],
                   ["train.recompute=full", "cluster.nodes=2", "parallel.tp=8", "parallel.sp=true", "parallel.pp=2"], 1),
    "gpu_memory_recompute_set": (GPU8 + ["model=llama3_70b", "launcher=plan", "train.recompute=full"],
                                 ["cluster.nodes=2", "parallel.tp=8", "parallel.sp=true", "parallel.pp=2"], 1),
    "moe_memory": (["+experiment=mixtral_ep8", "launcher=plan", "parallel.ep=4", "model.num_layers=32"],
                   ["cluster.nodes=2", "parallel.tp=2", "parallel.sp=true"], 1),
    # dynamic CP: neither a whole 32k row per rank nor half of one fits the 8B shape on an H100; a quarter
    # does, which the Fix names before recompute
    "dynamic_cp_row_share": (["+bench=bench_gpu", "model=llama3_8b", "model.num_layers=16", "cluster=h100_x4",
                              "launcher=plan", "data.packing=true", "parallel.cp_mode=dynamic",
                              "train.seq_length=32768", "model.max_position_embeddings=32768",
                              "train.micro_batch_size=1", "train.global_batch_size=8"],
                             ["parallel.max_seqlen_per_rank=8192"], 1),
    # host memory of a CPU launch
    "host_memory_dense": (["model=llama3_8b"], ["model=tiny_llama"], 1),
    "host_memory_layout": (["model=bench_1b"], ["zero.stage=1"], 1),  # the states sharded over the two processes
    "host_memory_moe": (["+experiment=mixtral_ep8", "cluster=laptop", "parallel.ep=2",
                         "parallel.moe_token_dispatcher=allgather"], ["model=tiny_mixtral", "train.seq_length=256"], 1),
    # NVLink domains
    "tp_across_nodes": (GPU8 + ["model=llama3_70b", "cluster.nodes=2", "parallel.tp=16", "model.num_query_groups=16",
                                "launcher=plan"],
                        ["parallel.tp=8", "train.recompute=full", "parallel.sp=true", "parallel.pp=2"], 1),
    "ep_across_nodes": (GPU8 + ["model=mixtral_8x7b", "model.num_layers=4", "cluster.nodes=2", "parallel.ep=16",
                                "model.num_experts=16", "launcher=plan"], ["parallel.ep=8"], 1),
    # evaluation, tracking, data
    "profile_window_outside_run": (["evaluate.profile_steps=[3,30]"], ["evaluate.profile_steps=[2,20]"], 1),
    "missing_comm_profile": (["cluster.comm_profile=/nonexistent/profile.json"], ["cluster.comm_profile=null"], 1),
    "damaged_mlflow_store": (["tracking.uri=sqlite:///{store}"], ["tracking=off"], 1),
    "vocab_below_the_dataset": (["data.kind=indexed", "data.paths=[{data}]", "parallel.tp=2"], ["model.vocab_size=258"], 1),
    "validation_split_starved": (["data.kind=indexed", "data.paths=[{few}]", "model.vocab_size=264"],
                                 ["data.split=98/0/0"], 1),
    # packed documents and dynamic context parallelism
    "dynamic_cp_without_packing": (["parallel.cp_mode=dynamic"], ["data.packing=true"], 1),
    "packing_with_pp": (["data.packing=true", "parallel.pp=2"], ["parallel.pp=1"], 1),
    "packing_on_deepspeed": (["data.packing=true", "engine=deepspeed"], ["engine=megatron"], 1),
    "dynamic_cp_inside_static_cp": (["data.packing=true", "parallel.cp_mode=dynamic", "cluster.gpus_per_node=4",
                                     "parallel.cp=2"], ["parallel.cp=1"], 1),
    "dynamic_cp_with_tp": (["data.packing=true", "parallel.cp_mode=dynamic", "cluster.gpus_per_node=4",
                            "parallel.tp=2"], ["parallel.tp=1"], 1),
    "dynamic_cp_document_too_long": (["data.packing=true", "parallel.cp_mode=dynamic", "parallel.max_seqlen_per_rank=8"],
                                     ["parallel.max_seqlen_per_rank=32"], 1),
    "dynamic_cp_over_three_ranks": (["data.packing=true", "parallel.cp_mode=dynamic", "cluster.gpus_per_node=3",
                                     "train.global_batch_size=6"], ["parallel.cp_mode=static"], 1),
    "dynamic_cp_with_overlapped_grad_reduce": (["data.packing=true", "parallel.cp_mode=dynamic",
                                                "engine.overlap_grad_reduce=true"],
                                               ["engine.overlap_grad_reduce=false"], 1),
    "max_seqlen_without_dynamic": (["data.packing=true", "parallel.max_seqlen_per_rank=64"],
                                   ["parallel.cp_mode=dynamic"], 1),
    "validation_split_starved_with_evaluation": (["data.kind=indexed", "data.paths=[{few}]", "model.vocab_size=264",
                                                  "data.eval_interval=4"], ["data.split=98/0/0", "data.eval_interval=0"], 1),
}

# Fixes that are actions in words, carried out by the battery: (overrides, first problem's text, fixes until valid)
ACTED_ON = {
    "dataset_missing": (["data.kind=indexed", "data.paths=[{missing}]"], "dataset files missing", 2),
}

# Not in the battery: "checkpoint.save already holds checkpoints of another run" (Fix:
# checkpoint.load=SAVE) needs a real run's checkpoint, which only the slow tier writes.


def write_jsonl(path, documents: int):
    path.write_text("".join(json.dumps({"text": f"document {i} of the advice battery"}) + "\n" for i in range(documents)))
    return path


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    """Files some cases name, made once: a prepared dataset (60 documents), a small one (3),
    and an MLflow store that is not a database."""
    from gridwright.data.prepare_data import prepare

    root = tmp_path_factory.mktemp("advice")
    prepare([write_jsonl(root / "data.jsonl", 60)], root / "data", "byte")
    prepare([write_jsonl(root / "few.jsonl", 3)], root / "few", "byte")
    store = root / "store.db"
    store.write_text("not a database, though its name says so; " * 4)
    return {"data": root / "data", "few": root / "few", "store": store}


@pytest.fixture
def places(prepared, tmp_path):
    """The prepared files, and a prefix of this test's where no dataset is yet."""
    return prepared | {"missing": tmp_path / "missing"}


def placed(overrides, places) -> list[str]:
    return [o.format(**places) for o in overrides]


def current(cfg, key):
    """The value `key` has now: a group's chosen option, or the config's value (None if absent)."""
    if key in GROUPS:
        if key == "tracking":
            return "local" if cfg.tracking.enabled else "off"
        return group_choices(cfg)[key] if key == "zero" else cfg[key].name
    value = OmegaConf.select(cfg, key, default=None)
    return OmegaConf.to_container(value) if isinstance(value, (DictConfig, ListConfig)) else value


def repeated_settings(cfg, texts) -> list[str]:
    """Every suggestion in a Fix with an override that is what `cfg` has already: advice that
    changes nothing, or that repeats a setting beside one it changes (`engine=megatron
    zero=stage3` to a run with zero=stage3). A note (no Fix) also names what is set, so a
    suggestion in it counts only where all its overrides are. Suggestions are separated by
    ',', ';' and 'or'."""
    out = []
    for text in texts:
        advice = text.split("Fix: ", 1)[1] if "Fix: " in text else text
        repeats = any if "Fix: " in text else all
        for suggestion in re.split(r",\s|;\s|\sor\s", advice):
            words = [w.strip("(),;.`") for w in suggestion.split()]
            pairs = [w.split("=", 1) for w in words if OVERRIDE_WORD.fullmatch(w) and not w.startswith(("+", "~"))]
            pairs = [(k, v) for k, v in pairs if k in GROUPS or OmegaConf.select(cfg, k, default="absent") != "absent"]
            if pairs and repeats(yaml.safe_load(v) == current(cfg, k) for k, v in pairs):
                out.append(f"{suggestion.strip()!r} is already set, yet advised in: {text}")
    return out


def refusal(overrides):
    """(config, the problems of validating it for a launch here; [] when it validates)."""
    cfg = compose_config(overrides)
    try:
        validate(cfg, for_launch=True)
    except ConfigError as e:
        return cfg, e.problems
    return cfg, []


def follow(overrides, actions=None, max_steps=MAX_STEPS) -> list[list[str]]:
    """Follow each first problem's first Fix until the experiment validates; the fixes taken.
    Each step must answer its problem (it is gone after the fix) and advise nothing already set."""
    taken = []
    cfg, problems = refusal(overrides)
    while problems:
        assert len(taken) < max_steps, f"still refused after {taken}: {problems}"
        assert not repeated_settings(cfg, problems), repeated_settings(cfg, problems)
        first = problems[0]
        fix = fix_overrides(first)
        if fix is None:
            action = next((act for text, act in (actions or {}).items() if text in first), None)
            assert action, f"the first Fix is not an override and the battery knows no action for it: {first}"
            action()
            fix = ["(action)"]
        else:
            overrides = overrides + fix
        taken.append(fix)
        cfg, problems = refusal(overrides)
        assert first not in problems, f"{fix} did not answer: {first}"
    return taken


def test_the_repeat_check_sees_the_old_memory_advice():
    """The memory refusal once advised train.recompute=full to a run that had it: the check
    above would have caught it, and the advice now is a layout estimated to fit."""
    overrides = GPU8 + ["model=llama3_70b", "launcher=plan", "train.recompute=full"]
    cfg, problems = refusal(overrides)
    old = ("estimated memory per GPU exceeds H100-SXM's 79.6 GiB. Fix: train.recompute=full, a higher ZeRO stage, "
           "more TP/PP/EP, or a smaller micro-batch.")
    assert len(repeated_settings(cfg, [old])) == 1
    assert "train.recompute" not in problems[0].split("Fix: ")[1] and not repeated_settings(cfg, problems)


def test_the_repeat_check_sees_the_old_zero3_advice():
    """DeepSpeed's TP with ZeRO-3 refusal once advised `engine=megatron zero=stage3` to a run
    with zero=stage3: a suggestion that repeats one setting beside one it changes is caught,
    and the advice now changes the engine alone."""
    overrides, _, _ = REFUSALS["deepspeed_tp_zero3"]
    cfg, problems = refusal(overrides)
    old = ("parallel.tp=2 with zero.stage=3: ZeRO-3 partitions whole parameters for data parallelism. "
           "Fix: zero.stage=1 or 2, or engine=megatron zero=stage3 (Megatron-FSDP).")
    assert len(repeated_settings(cfg, [old])) == 1
    zero3 = next(p for p in problems if p.startswith("parallel.tp=2 with zero.stage=3"))
    assert "or engine=megatron (" in zero3 and "zero=stage3" not in zero3.split("Fix: ")[1]
    assert not repeated_settings(cfg, problems)


@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_first_fix_leads_to_a_valid_experiment(name, places):
    overrides, first_fix, steps = REFUSALS[name]
    taken = follow(placed(overrides, places))
    assert taken, f"{overrides} validates; the case no longer tests a refusal"
    assert taken[0] == first_fix and len(taken) == steps, taken


def test_missing_dataset_fix_is_carried_out(places):
    """`Fix: python -m gridwright.data.prepare_data ...`: preparing the dataset at that prefix
    (then the vocabulary's override) gives a valid experiment."""
    from gridwright.data.prepare_data import main as prepare_main

    overrides, text, steps = ACTED_ON["dataset_missing"]
    overrides = placed(overrides, places)
    _, problems = refusal(overrides)
    assert text in problems[0] and fix_overrides(problems[0]) is None
    command = problems[0].split("Fix: ", 1)[1].split()
    assert command[:3] == ["python", "-m", "gridwright.data.prepare_data"]
    # as many documents as it says the split needs, and no more: the split does not fail next
    assert "; data.split='98/2/0' needs 50 documents at least. Fix: " in problems[0], problems[0]
    corpus = write_jsonl(places["missing"].parent / "corpus.jsonl", 50)
    argv = [str(corpus) if word == "YOUR_TEXT.jsonl" else word for word in command[3:]]
    taken = follow(overrides, actions={text: lambda: prepare_main(argv)})
    assert taken == [["(action)"], ["model.vocab_size=257"]] and len(taken) == steps


def test_gpu_preset_on_this_machine_is_planned_not_shrunk_onto_the_cpu():
    """The new user's path: `+experiment=mixtral_ep8` here. The first Fix plans the 8-GPU job
    as it is (23.5 B parameters), rather than moving it onto this machine's CPU."""
    cfg, problems = refusal(["+experiment=mixtral_ep8"])
    assert problems[0].startswith("cluster 'dgx_h100' runs 8 process(es) on CUDA GPUs, but this machine has 0 CUDA")
    assert "cluster=laptop" not in problems[0]
    plan = validate(compose_config(["+experiment=mixtral_ep8", "launcher=plan"]), for_launch=True)
    assert plan.layout.world_size == 8 and round(plan.params.total / 1e9, 1) == 23.5


def test_host_memory_rule_on_this_machine():
    """A local CPU launch needs the processes' weights, gradients, Adam state and activations
    within 90 % of this machine's memory; a plan, torchrun or Slurm job for other machines,
    and a validation not for a launch, are not measured against this machine."""
    from gridwright.planning.layout import ParallelLayout
    from gridwright.runtime.machine_probe import host_memory_bytes
    from gridwright.engine_rules.registry import rules
    from gridwright.planning.memory_estimate import GIB, host_memory_estimate

    cfg, problems = refusal(["model=llama3_8b"])
    per = host_memory_estimate(cfg, ParallelLayout.from_config(cfg), rules(cfg.engine))
    have = host_memory_bytes()
    assert per.total_gib * 2 * GIB > 0.9 * have
    assert problems == [
        f"model llama3_8b (8.03 B parameters) needs about {per.total_gib * 2:,.1f} GiB on 2 CPU processes "
        f"({per.describe()} each), more than 90% of this machine's {have / GIB:,.1f} GiB. Fix: model=tiny_llama, "
        "or launcher=torchrun or slurm to emit the job for machines that hold it."]
    # weights 4 + gradients 4 + Adam 8 bytes a parameter in fp32, and the foreach step's sqrt(v) 4
    assert per.weights_gib + per.grads_gib + per.optimizer_gib == pytest.approx(cfg_params(cfg) * 16 / GIB, rel=1e-6)
    for elsewhere in (["launcher=plan"], ["launcher=torchrun"], ["launcher=slurm"]):
        validate(compose_config(["model=llama3_8b", *elsewhere]), for_launch=True)
    validate(compose_config(["model=llama3_8b"]), for_launch=False)
    for preset in ("tiny_llama_cpu", "tiny_llama_tp2", "tiny_llama_pp2", "tiny_mixtral_cpu"):
        validate(compose_config([f"+experiment={preset}"]), for_launch=True)


def cfg_params(cfg) -> int:
    from gridwright.planning.model_math import param_counts

    return param_counts(cfg.model).total


NOTE_SUGGESTION = re.compile(r"\+?experiment=\w+|precision=bf16")

# name: (overrides, the suggestions its notes make)
NOTES = {
    "preset_keeping_the_root_settings": (["+experiment=tiny_mixtral_cpu"], []),
    "model_whose_preset_keeps_the_root_settings": (MOE_CPU + ["parallel.ep=2"], []),
    "large_model_on_gpus": (["model=llama3_8b", "cluster=dgx_h100", "launcher=plan"],
                            ["+experiment=llama3_8b", "+experiment=llama3_8b_dp8", "+experiment=llama3_8b_tp8",
                             "precision=bf16"]),
    "large_model_over_a_cpu_preset": (["+experiment=tiny_llama_cpu", "model=llama3_8b"],
                                      ["experiment=llama3_8b", "experiment=llama3_8b_dp8", "experiment=llama3_8b_tp8"]),
}


@pytest.mark.parametrize("name", sorted(NOTES))
def test_notes_suggest_nothing_chosen_and_lead_to_a_valid_experiment(name):
    overrides, expected = NOTES[name]
    cfg = compose_config(overrides)
    notes = composition_notes(cfg)
    suggestions = [s for note in notes for s in NOTE_SUGGESTION.findall(note)]
    assert suggestions == expected, notes
    assert not repeated_settings(cfg, notes)
    assert f"experiment={cfg.name}" not in suggestions
    for suggestion in suggestions:
        follow(overrides + [suggestion], max_steps=2)


GPU2 = ["+bench=bench_gpu", "cluster=h100_x2"]
GPU8_BENCH = ["+bench=bench_gpu", "cluster=dgx_h100"]
RECIPE_TP = "engine.compile_layers=true engine.tp_comm_overlap=true engine.cuda_graphs=layers"
# name: (overrides, the settings the speed note names, or None for no note)
SPEED_NOTES = {
    "tp_sp_on_gpus": (GPU2 + ["parallel.tp=2", "parallel.sp=true"], RECIPE_TP),
    # graphs cannot capture recomputation: the recipe drops it where memory allows
    "tp_sp_with_recompute": (GPU2 + ["parallel.tp=2", "parallel.sp=true", "train.recompute=selective"],
                             RECIPE_TP + " train.recompute=none"),
    "tp_sp_half_chosen": (GPU2 + ["parallel.tp=2", "parallel.sp=true", "engine.cuda_graphs=layers"],
                          "engine.compile_layers=true engine.tp_comm_overlap=true"),
    "tp_sp_recipe_chosen": (GPU2 + ["parallel.tp=2", "parallel.sp=true"] + RECIPE_TP.split(), None),
    "cp_on_gpus": (GPU2 + ["parallel.cp=2"], None),  # all-to-all, measured faster, is its default (auto)
    "cp_packed": (GPU2 + ["parallel.cp=2", "data.packing=true"], None),  # a2a is refused with packing
    "tp_sp_on_cpu": (["+experiment=tiny_llama_tp2", "parallel.sp=true"], None),
    "tp_without_sp": (GPU2 + ["parallel.tp=2"], None),  # async TP needs SP
    # A note cites only a result of the layout's own model-parallel degrees (TP=2+SP, PP=1 here)
    "tp_sp_over_dp4": (GPU8_BENCH + ["parallel.tp=2", "parallel.sp=true"], RECIPE_TP),
    "tp4_sp_not_measured": (GPU8_BENCH + ["parallel.tp=4", "parallel.sp=true"], None),
    "tp_sp_with_pp_not_measured": (GPU8_BENCH + ["parallel.tp=2", "parallel.sp=true", "parallel.pp=2"], None),
    "fp8_tensorwise_at_tp2_not_measured": (GPU8_BENCH + ["parallel.tp=2", "precision=fp8_tensorwise"], None),
    # torchao's tensorwise FP8 (auto picks it: Transformer Engine is not installed here): its
    # float8 output layer, measured faster, is the default (precision.fp8_output_layer=auto)
    "fp8_tensorwise": (GPU2 + ["precision=fp8_tensorwise"], None),
    "fp8_tensorwise_output_off": (GPU2 + ["precision=fp8_tensorwise", "precision.fp8_output_layer=false"], None),
    "fp8_output_chosen": (GPU2 + ["precision=fp8_tensorwise", "precision.fp8_output_layer=true"], None),
    "fp8_rowwise": (GPU2 + ["precision=fp8_rowwise"], None),
    "fp8_te_told": (GPU2 + ["precision=fp8_tensorwise", "precision.fp8_backend=transformer_engine"], None),
}


@pytest.mark.parametrize("name", sorted(SPEED_NOTES))
def test_speed_notes_name_only_missing_settings_that_validate(name):
    from gridwright.validation.speed_notes import speed_notes

    overrides, expected = SPEED_NOTES[name]
    cfg = compose_config(overrides)
    notes = speed_notes(cfg)
    if expected is None:
        assert notes == []
        return
    assert len(notes) == 1 and f"measured faster for this layout: {expected}. " in notes[0], notes
    assert not repeated_settings(cfg, notes)
    followed = compose_config(overrides + expected.split())
    validate(followed, for_launch=False)
    assert speed_notes(followed) == []


def test_the_plan_prints_the_speed_note_and_the_measured_cp_exchange(run_launch):
    result = run_launch(*GPU2, "parallel.tp=2", "parallel.sp=true", "launcher=plan")
    assert result.returncode == 0, result.stderr[-2000:]
    assert f"note        measured faster for this layout: {RECIPE_TP}." in result.stdout
    result = run_launch(*GPU2, "parallel.cp=2", "launcher=plan")
    assert "cp exchange all-to-all (parallel.cp_comm_type=auto: measured faster at CP=2)" in result.stdout
    assert "measured faster for this layout" not in result.stdout
    result = run_launch(*GPU2, "parallel.cp=2", "parallel.cp_comm_type=all_gather", "launcher=plan")
    assert "cp exchange all-gather (parallel.cp_comm_type=all_gather)" in result.stdout


def test_the_model_divisions_are_reported_beside_the_world_size_and_share_its_fix():
    """Every problem at once: a TP that neither divides the world nor the heads says both,
    and each suggests the one fix that answers all of them."""
    cfg, problems = refusal(["+experiment=llama3_8b", "parallel.tp=3", "launcher=plan"])
    assert [p.split(" is not divisible")[0] for p in problems] == [
        "world size 16 (cluster.nodes x cluster.gpus_per_node)", "model.num_attention_heads=32",
        "model.num_query_groups=8", "model.ffn_hidden_size=14336"], problems
    assert {fix_overrides(p)[0] for p in problems} == {"parallel.tp=2"}


@pytest.mark.slow
def test_a_checkpoint_of_another_model_is_answered_by_its_shape(tmp_path):
    """A resume under another model shape is refused with the overrides that give the
    checkpoint's shape: its own preset where another was chosen, else its values."""
    from conftest import launch

    ck = tmp_path / "ck"
    saved = launch(["tracking=off", "train.steps=2", "train.warmup_steps=1", f"checkpoint.save={ck}",
                    f"job_dir={tmp_path / 'job'}"], tmp_path)
    assert saved.returncode == 0, saved.stderr[-3000:]
    for overrides, first in ((["model.num_layers=2", "model.hidden_size=32"],
                              ["model.num_layers=4", "model.hidden_size=64", "model.head_dim=16"]),
                             (MOE_CPU, ["model=tiny_llama"]),
                             (["model.family=qwen3"], ["model.family=llama"])):
        taken = follow([f"checkpoint.load={ck}", "train.steps=4", *overrides])
        assert taken == [first], taken
