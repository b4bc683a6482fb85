"""Every validation rule: a broken experiment fails with a message naming values and a fix."""
from pathlib import Path

import pytest

from gridwright.validation.validate import ConfigError, validate

GPU8 = ["cluster=dgx_h100", "precision=bf16", "zero=stage1", "train.seq_length=4096",
        "train.micro_batch_size=1", "train.global_batch_size=64"]

# The alpha-beta profile measured on 2 x H100: it has fits for groups of 2 only.
PROFILE_2GPU = Path(__file__).parent / "data" / "comm_profile_2xh100.json"

BROKEN = {
    # name: (overrides, substrings the message must contain)
    "world_not_divisible": (GPU8 + ["model=llama3_8b", "parallel.tp=4", "parallel.pp=3", "model.num_layers=24"],
                            ["world size 8", "TP*PP*CP = 4*3*1 = 12"]),
    "expert_grid": (["model=tiny_mixtral", "parallel.ep=4", "parallel.moe_token_dispatcher=allgather"],
                    ["expert-TP*EP*PP = 1*4*1 = 4", "world size 2"]),
    "heads_vs_tp": (GPU8 + ["model=llama3_8b", "parallel.tp=8", "model.num_attention_heads=36",
                            "model.num_query_groups=4", "model.hidden_size=4608"],
                    ["num_attention_heads=36 is not divisible by parallel.tp=8"]),
    "query_groups_vs_tp": (GPU8 + ["model=llama3_8b", "parallel.tp=8", "model.num_query_groups=4"],
                           ["num_query_groups=4", "parallel.tp=8", "Fix: parallel.tp=4"]),
    "experts_vs_ep": (GPU8 + ["model=mixtral_8x7b", "model.num_layers=4", "parallel.ep=8", "model.num_experts=12"],
                      ["num_experts=12 is not divisible by parallel.ep=8"]),
    "ep_without_experts": (["parallel.ep=2"], ["parallel.ep=2", "no experts"]),
    "deepspeed_load_not_hf": (["engine=deepspeed", "checkpoint.load=/tmp/gridwright-nowhere"],
                              ["engine=deepspeed resumes its own checkpoints (a root with 'latest') or starts from a Hugging Face folder",
                               "config.json does not exist"]),
    "deepspeed_tp_zero3": (["engine=deepspeed", "zero=stage3", "parallel.tp=2"],
                           ["ZeRO-3 partitions whole parameters", "deepspeedai/DeepSpeed#6523"]),
    "deepspeed_selective_recompute": (["engine=deepspeed", "zero=stage1", "train.recompute=selective"],
                                      ["train.recompute=selective is Megatron-Core's", "Fix: train.recompute=full"]),
    "deepspeed_zero0_bf16": (["engine=deepspeed", "zero=stage0", "precision=bf16"],
                             ["FP16_UnfusedOptimizer", "Fix: zero.stage=1"]),
    "deepspeed_tp_zero0": (["engine=deepspeed", "zero=stage0", "parallel.tp=2"], ["Fix: zero.stage=1"]),
    "deepspeed_pp": (["engine=deepspeed", "zero=stage2", "parallel.pp=2"],
                     ["ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism", "Megatron-DeepSpeed#474"]),
    "deepspeed_tp_checkpoints": (["engine=deepspeed", "zero=stage1", "parallel.tp=2", "checkpoint.save=/tmp/gw-x"],
                                 ["engine=deepspeed over Megatron-Core's GPTModel saves no checkpoints"]),
    "cudnn_attention_on_cpu": (["engine.attention_backend=cudnn"],
                               ["engine.attention_backend=cudnn is a CUDA kernel", "use auto, flash or math"]),
    "cuda_graphs_on_cpu": (["engine.cuda_graphs=layers"],
                           ["engine.cuda_graphs=layers cannot capture here: this run is on cpu", "Fix: engine.cuda_graphs=none"]),
    "cuda_graphs_packed_fsdp": (GPU8 + ["model=llama3_8b", "engine.cuda_graphs=layers", "data.packing=true", "zero=stage3",
                                       "train.recompute=full"],
                                ["packed documents change shape", "Megatron-FSDP gathers parameters",
                                 "train.recompute=full recomputes inside the layer"]),
    "cuda_graphs_moe": (GPU8 + ["model=mixtral_8x7b", "model.num_layers=4", "parallel.ep=8", "engine.cuda_graphs=layers"],
                        ["MoE layers read token counts back to the host"]),
    "cuda_graphs_deepspeed": (["engine=deepspeed", "zero=stage1", "engine.cuda_graphs=layers"],
                              ["engine.cuda_graphs=layers is Megatron-Core's graph manager", "Fix: engine=megatron"]),
    "fp8_output_layer_without_fp8": (["precision=bf16", "precision.fp8_output_layer=true"],
                                     ["precision.fp8_output_layer=true needs an FP8 recipe"]),
    "fp8_output_layer_vocab_shard": (["cluster=h100_x2", "precision=fp8_tensorwise", "precision.fp8_output_layer=true",
                                      "model.vocab_size=32008", "parallel.tp=2"],
                                     ["vocabulary shard (32008 / TP 2) must be a multiple of 16"]),
    "wgrad_fusion_fsdp": (["cluster=h100_x2", "+bench=bench_gpu", "zero=stage3",
                           "engine.gradient_accumulation_fusion=true"],
                          ["Megatron-FSDP takes its own path", "Fix: engine.gradient_accumulation_fusion=null"]),
    "wgrad_fusion_deepspeed": (["engine=deepspeed", "zero=stage1", "engine.gradient_accumulation_fusion=true"],
                               ["which DeepSpeed's engine does not keep", "or engine=megatron"]),
    "fused_kernels_hf_model": (["engine=deepspeed", "zero=stage1", "engine.fused_kernels=true"],
                               ["engine.fused_kernels=true asks for Megatron-Core's fused SwiGLU",
                                "Fix: engine.fused_kernels=null, or engine.deepspeed_model=megatron"]),
    "tp_overlap_without_sp": (["parallel.tp=2", "engine.tp_comm_overlap=true"],
                              ["engine.tp_comm_overlap=true", "parallel.sp=true"]),
    "deepspeed_megatron_model_zero3": (["engine=deepspeed", "zero=stage3", "engine.deepspeed_model=megatron"],
                                       ["engine.deepspeed_model=megatron with zero.stage=3", "Fix: zero.stage=1 or 2"]),
    "deepspeed_hf_model_with_tp": (["engine=deepspeed", "zero=stage1", "parallel.tp=2",
                                    "engine.deepspeed_model=huggingface"],
                                   ["engine.deepspeed_model=huggingface with parallel.tp=2"]),
    "compile_on_deepspeed_zero3": (["engine=deepspeed", "zero=stage3", "engine.compile_layers=true"],
                                   ["engine.compile_layers=true with zero.stage=3", "DeepCompile"]),
    "tp_overlap_on_deepspeed": (["engine=deepspeed", "zero=stage1", "parallel.tp=2", "parallel.sp=true",
                                 "engine.tp_comm_overlap=true"], ["DeepSpeed over TP trains Megatron-Core's own linears"]),
    "te_fp8_on_deepspeed": (["engine=deepspeed", "zero=stage1", "precision=bf16", "precision.fp8_recipe=delayed"],
                            ["through Transformer Engine needs Transformer Engine's layers"]),
    "compile_megatron_tp": (["parallel.tp=2", "engine.compile_layers=true"],
                            ["would compile Megatron-Core's tensor-parallel linear function", "engine.tp_comm_overlap=true"]),
    "max_connections": (["engine.cuda_device_max_connections=0"], ["engine.cuda_device_max_connections=0 must be 1 to 32"]),
    "rowwise_on_te": (["precision=fp8_rowwise", "precision.fp8_backend=transformer_engine"],
                      ["rowwise is torchao's"]),
    "torchao_fp8_moe": (["model=tiny_mixtral", "parallel.moe_token_dispatcher=allgather", "precision=fp8_rowwise"],
                        ["torchao covers dense layers only"]),
    "torchao_fp8_with_tp_overlap": (["+experiment=tiny_llama_tp2", "parallel.sp=true", "engine.tp_comm_overlap=true",
                                     "precision=fp8_rowwise"], ["does not combine with FP8 through torchao"]),
    "torchao_format": (["precision=fp8_rowwise", "precision.fp8_format=hybrid"],
                       ["torchao's rowwise recipe uses E4M3 everywhere: set precision.fp8_format=e4m3"]),
    "torchao_delayed": (["precision=fp8_delayed", "precision.fp8_backend=torchao"],
                        ["offers the recipes tensorwise, rowwise, not 'delayed'"]),
    "fp8_on_cpu_without_torchao": (["precision=fp8_tensorwise"], ["needs CUDA GPUs", "precision.fp8_backend=torchao"]),
    "layers_vs_pp": (["parallel.pp=2", "model.num_layers=3"], ["num_layers=3 is not divisible by parallel.pp=2"]),
    "layers_vs_vpp": (["parallel.pp=2", "parallel.vpp=3"], ["2 layers per stage", "parallel.vpp=3"]),
    "vpp_without_pp": (["parallel.vpp=2"], ["parallel.vpp=2", "needs parallel.pp>1"]),
    "sp_without_tp": (["parallel.sp=true"], ["parallel.sp=true needs tensor parallelism"]),
    "cp_sequence": (GPU8 + ["model=llama3_8b", "parallel.cp=2", "train.seq_length=4094"],
                    ["train.seq_length=4094 is not divisible by 2*parallel.cp=4"]),
    "global_batch": (["train.global_batch_size=7"], ["global_batch_size=7", "micro_batch_size=2 x DP=2 = 4"]),
    "fp8_on_cpu": (["precision=fp8_delayed"], ["needs CUDA GPUs"]),
    "profile_window_outside_run": (["evaluate.profile_steps=[3,30]"],
                                   ["evaluate.profile_steps=[3, 30]", "train.steps=20"]),
    "profile_window_backwards": (["evaluate.profile_steps=[5,2]"], ["must be [first, last)"]),
    "unknown_flops_definition": (["evaluate.flops_definition=titan"], ["evaluate.flops_definition='titan'", "megatron, palm"]),
    "missing_comm_profile": (["cluster.comm_profile=/nonexistent/profile.json"], ["does not exist", "bench_collectives"]),
    "comm_profile_without_the_group_size": (
        GPU8 + ["model=llama3_8b", f"cluster.comm_profile={PROFILE_2GPU}"],
        ["no reduce_scatter fit for groups of 8 ranks", "measured group sizes: 2"]),
    "mxfp8_on_hopper": (GPU8 + ["model=llama3_8b", "precision=mxfp8", "launcher=plan"],
                        ["does not support FP8 recipe 'mxfp8'", "Blackwell"]),
    "fp8_without_te_locally": (GPU8 + ["model=bench_1b", "cluster=h100_x1", "precision=fp8_delayed",
                                       "train.global_batch_size=8"],
                               ["Transformer Engine", "silently train in bf16"]),
    "offload_params_needs_stage3": (["engine=deepspeed", "zero=stage2", "zero.offload_params=true"],
                                    ["offload_params=true needs zero.stage=3"]),
    "offload_optimizer_needs_sharding": (["engine=deepspeed", "zero.offload_optimizer=true"],
                                         ["offload_optimizer=true needs zero.stage>=1"]),
    "megatron_stage3_on_cpu": (["zero=stage3"], ["zero.stage=3 on engine=megatron is Megatron-FSDP", "needs CUDA"]),
    "megatron_stage3_checkpoint": (GPU8 + ["model=llama3_8b", "zero=stage3", "checkpoint.save=/nonexistent/ck",
                                           "launcher=plan"], ["fsdp_dtensor"]),
    "megatron_offload": (["zero=stage2_offload"], ["CPU offload is a DeepSpeed feature"]),
    "deepspeed_with_tp": (["engine=deepspeed", "parallel.tp=2"], ["engine=deepspeed", "parallel.tp=2"]),
    "tp_across_nodes": (GPU8 + ["model=llama3_70b", "cluster.nodes=2", "parallel.tp=16", "model.num_query_groups=16",
                                "launcher=plan"],
                        ["tensor-parallel group(s) span NVLink domains of 8 GPUs", "allow_tp_across_nvlink"]),
    "ep_across_nodes": (GPU8 + ["model=mixtral_8x7b", "model.num_layers=4", "cluster.nodes=2", "parallel.ep=16",
                                "model.num_experts=16", "launcher=plan"],
                        ["expert-parallel", "span NVLink domains", "allow_ep_across_nvlink"]),
    "memory": (GPU8 + ["model=llama3_70b", "launcher=plan"], ["estimated memory per GPU", "exceeds H100-SXM's 79.6 GiB"]),
    "local_multinode": (GPU8 + ["model=llama3_8b", "cluster.nodes=2", "parallel.tp=8"], ["launcher=local runs on this machine only"]),
    "alltoall_on_cpu": (["model=tiny_mixtral", "parallel.ep=2"], ["moe_token_dispatcher=alltoall", "allgather"]),
    "warmup_too_long": (["train.steps=2"], ["train.warmup_steps=2 must be below train.steps=2"]),
    "param_gather_without_sharding": (["engine.overlap_param_gather=true"],
                                      ["overlap_param_gather=true needs the distributed optimizer"]),
    "moe_tp_without_sp": (["model=tiny_mixtral", "parallel.tp=2", "parallel.moe_token_dispatcher=allgather"],
                          ["needs parallel.sp=true"]),
    "bad_choice": (["engine.name=jax"], ["engine.name='jax' is not one of megatron, deepspeed"]),
    "unknown_family": (["model.family=gpt2"], ["model.family='gpt2' is not one of llama, mistral, qwen2, mixtral, qwen3, qwen3_moe"]),
    "experts_need_a_moe_family": (["model.num_experts=4"], ["the llama family is dense"]),
    "dense_family_without_experts": (["model.family=qwen3_moe"], ["the qwen3_moe family is a mixture of experts"]),
    "qkv_bias_needs_qwen2_family": (["model.qkv_bias=true"], ["the llama family has qkv_bias=False"]),
    "vocab_not_divisible_by_tp": (["parallel.tp=2", "model.vocab_size=257"],
                                  ["model.vocab_size=257 is not divisible by parallel.tp=2"]),
    "seq_beyond_positions": (["train.seq_length=512"], ["train.seq_length=512 exceeds model.max_position_embeddings=256"]),
    "cp_a2a_without_cp": (["parallel.cp_comm_type=a2a"], ["read only by static context parallelism",
                                                          "Fix: parallel.cp_comm_type=all_gather"]),
    "cp_a2a_packed": (["parallel.cp=2", "parallel.cp_comm_type=a2a", "data.packing=true"],
                      ["packed documents are built for the all-gather form only"]),
    # tiny_llama: 4 heads, 2 groups; TP=2 leaves one group per rank, which CP=2 cannot share
    "cp_a2a_groups": (["parallel.cp=2", "parallel.tp=2", "parallel.cp_comm_type=a2a", "cluster.gpus_per_node=4"],
                      ["each rank of TP=2 holds 2 heads and 1 key/value groups", "Fix: parallel.cp_comm_type=all_gather."]),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_broken_layout_fails_with_clear_message(compose, name):
    overrides, expected = BROKEN[name]
    cfg = compose(*overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, for_launch=True)
    message = str(err.value)
    for text in expected:
        assert text in message, f"{text!r} not in:\n{message}"


def test_all_problems_reported_at_once(compose):
    cfg = compose("parallel.sp=true", "train.steps=2", "precision=fp8_delayed")
    with pytest.raises(ConfigError) as err:
        validate(cfg)
    assert len(err.value.problems) == 3, err.value.problems


def test_tp_across_nodes_allowed_when_asked(compose):
    cfg = compose(*GPU8, "model=llama3_70b", "cluster.nodes=4", "parallel.tp=16", "model.num_query_groups=16",
                  "parallel.allow_tp_across_nvlink=true", "launcher=plan", "train.recompute=full",
                  "parallel.pp=2", "train.global_batch_size=64")
    layout = validate(cfg).layout
    assert layout.tp == 16 and layout.dp == 1


def test_nvl72_domain_spans_nodes(compose):
    """On GB200 NVL72 a TP=8 group spans two 4-GPU trays but stays in the 72-GPU NVLink domain."""
    cfg = compose(*GPU8, "cluster=gb200_nvl72", "model=llama3_70b", "parallel.tp=8", "parallel.pp=9",
                  "model.num_layers=81", "launcher=plan", "train.global_batch_size=64")
    placement = validate(cfg).placement
    assert placement.members("tp", 0) == list(range(8))
    assert set(placement.host[placement.members("tp", 0)]) == {0, 1}


def test_cli_rejects_before_anything_starts(run_launch, tmp_path):
    result = run_launch("parallel.tp=3")
    assert result.returncode == 2
    assert "nothing was started" in result.stderr and "parallel.tp=3" in result.stderr
    assert not (tmp_path / "jobs").exists()
    assert not (tmp_path / "mlflow.db").exists()


def test_existing_job_dir_is_refused_and_kept(run_launch, tmp_path):
    job = tmp_path / "taken"
    job.mkdir()
    (job / "keep.txt").write_text("earlier results")
    result = run_launch(f"job_dir={job}", "launcher=plan")
    assert result.returncode == 2
    assert "already exists" in result.stderr
    assert (job / "keep.txt").read_text() == "earlier results"
    assert sorted(p.name for p in job.iterdir()) == ["keep.txt"]


def test_deepspeed_initial_weights_must_have_the_models_shape(compose, tmp_path):
    from gridwright.adapters.tiny_models import make_tiny_model

    hf = make_tiny_model("llama", tmp_path / "hf")  # 4 layers, hidden 64: not tiny_llama's FFN size
    with pytest.raises(ConfigError) as err:
        validate(compose("engine=deepspeed", f"checkpoint.load={hf}"), for_launch=True)
    assert f"checkpoint.load={hf} holds another model shape: model.ffn_hidden_size=176 (checkpoint: 96)" in str(err.value)
