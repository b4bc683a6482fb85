"""Training throughput, MFU, exposed communication and memory on the local GPU(s).

    python -m gridwright.evaluations.bench_gpu [--suite NAME] [--only CASE ...]
        [--one-gpu-cases-side-by-side]

Each case is a real `launch.py` run (torchrun, NCCL); the table reports the mean of the
steps after the first. In the `performance` suite two steps are traced with torch.profiler
and left out of the mean; their traces give each case's compute, exposed communication
per parallel group and overlap (gridwright.analysis.trace_analysis). MFU is given under both definitions (Megatron-LM's, causal
attention halved, and PaLM's); FP8 rows also against the bf16 peak. The GPU kind is read
from the device and written with the numbers: compare only rows from the same card and
the same invocation.

The `performance` suite (the default) runs each layout as it was (`..._base`: the
torch-native spec uncompiled, Megatron-Core's SP communication) and with the faster
paths: compiled layers, async TP, FP8 through torchao. The `te` suite runs Transformer
Engine's layer spec (bf16, each FP8 recipe, the float8 output layer, CUDA graphs on its
layers, micro-batch and recompute for FP8, packed documents through its THD attention)
beside the torch-native spec's best bf16 and FP8 rows and its varlen kernel.

`--one-gpu-cases-side-by-side` runs the one-GPU cases two at a time, one per GPU (the
table says so): it halves their wall time where device time is short, at the price of a
shared host, which matters to host-bound cases; compare such rows only with each other.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from gridwright.evaluations.results_file import card_of_this_machine, write_json, write_markdown
from gridwright.evaluations.same_weights import write_same_weights
from gridwright.runtime.jobdir import read_metrics
from gridwright.runtime.process_tree import run_bounded

REPO = Path(__file__).resolve().parents[1]

COMMON = ["tracking=off", "precision=bf16", "train.lr=3e-4", "train.min_lr=3e-5", "train.warmup_steps=3"]
# Both suites trace two steps of each case (exposed communication per group), on either engine.
TRACED = ["evaluate.profile_steps=[10,12]"]
FAST = ["engine.compile_layers=true"]
TP_FAST = FAST + ["engine.tp_comm_overlap=true"]
GRAPHS = ["engine.cuda_graphs=layers"]
CP_A2A = ["parallel.cp_comm_type=a2a"]
# name: (GPUs, overrides)
BENCH_2GPU = ["+bench=bench_gpu", "cluster=h100_x2", "train.steps=14"]
BENCH_1GPU = ["+bench=bench_gpu", "train.steps=14"]
LLAMA3_8B = ["model=llama3_8b", "cluster=h100_x2", "zero=stage1", "train.seq_length=4096",
             "train.micro_batch_size=1", "train.global_batch_size=8", "train.steps=14"]
LLAMA3_8B_1GPU = ["model=llama3_8b", "cluster=h100_x1", "zero=stage1", "train.seq_length=4096", "model.num_layers=8",
                  "train.micro_batch_size=1", "train.global_batch_size=8", "train.steps=14", "name=llama3_8b_8l_1gpu"]
LLAMA3_8B_16L_1GPU_MB2 = LLAMA3_8B_1GPU + ["model.num_layers=16", "train.micro_batch_size=2",
                                             "name=llama3_8b_16l_1gpu_mb2"]
DP2_OVERLAP = BENCH_2GPU + ["engine.overlap_grad_reduce=true", "engine.overlap_param_gather=true"]
# Gradient reduction overlapped, the parameter all-gather not: DDP's parameter-gather
# pre-hooks run inside compiled layers and make every layer compile its own graph.
DP2_OVERLAP_GRAD = BENCH_2GPU + ["engine.overlap_grad_reduce=true"]
MB4 = ["train.micro_batch_size=4"]
# torch's foreach Adam, gridwright's optimizer step before the fused form became the default
FOREACH_ADAM = ["engine.fused_adam=false"]
# The base cases run as gridwright did before Megatron-Core's fusions and the fused Adam
# became the CUDA default.
# Each linear's weight gradient written in bf16, then added into DDP's fp32 buffer by a kernel
# of its own (the default before the fused accumulation)
UNFUSED_WGRAD = ["engine.gradient_accumulation_fusion=false"]
UNFUSED = ["engine.fused_kernels=false"] + FOREACH_ADAM + UNFUSED_WGRAD
LLAMA_16L_TP2 = LLAMA3_8B + ["parallel.tp=2", "parallel.sp=true", "model.num_layers=16", "train.recompute=selective"]
TP2_SP = BENCH_2GPU + ["parallel.tp=2", "parallel.sp=true"]
# FP8 against bf16 over 200 steps is evaluations/fp8_loss_check.py (one GPU each, side by side).
# The float8 output layer is `auto` (on for one-GPU FP8 on CUDA): a case without it says so.
NO_FP8_OUTPUT = ["precision.fp8_output_layer=false"]
PERFORMANCE = {name: (gpus, overrides + TRACED) for name, (gpus, overrides) in {
    "bench_1b_1gpu_base": (1, BENCH_1GPU + UNFUSED),
    "bench_1b_1gpu_eager": (1, BENCH_1GPU),  # uncompiled, with Megatron-Core's fused SwiGLU and cross-entropy
    "bench_1b_1gpu": (1, BENCH_1GPU + FAST),
    "bench_1b_1gpu_unfused_wgrad": (1, BENCH_1GPU + FAST + UNFUSED_WGRAD),
    "bench_1b_1gpu_mb4": (1, BENCH_1GPU + FAST + MB4),
    "bench_1b_1gpu_mb4_foreach_adam": (1, BENCH_1GPU + FAST + MB4 + FOREACH_ADAM),
    "bench_1b_1gpu_mb8": (1, BENCH_1GPU + FAST + ["train.micro_batch_size=8"]),
    "bench_1b_1gpu_mb8_unfused_wgrad": (1, BENCH_1GPU + FAST + ["train.micro_batch_size=8"] + UNFUSED_WGRAD),
    "bench_1b_1gpu_fp8_tensorwise": (1, BENCH_1GPU + FAST + ["precision=fp8_tensorwise"] + NO_FP8_OUTPUT),
    "bench_1b_1gpu_fp8_rowwise": (1, BENCH_1GPU + FAST + ["precision=fp8_rowwise"] + NO_FP8_OUTPUT),
    "bench_1b_1gpu_fp8_tensorwise_mb4": (1, BENCH_1GPU + FAST + ["precision=fp8_tensorwise"] + MB4 + NO_FP8_OUTPUT),
    "bench_1b_tp2_sp_base": (2, TP2_SP + UNFUSED),
    "bench_1b_tp2_sp_base_mb4": (2, TP2_SP + MB4 + UNFUSED),
    "bench_1b_tp2_sp": (2, TP2_SP + TP_FAST),
    "bench_1b_dp2_overlap_base": (2, DP2_OVERLAP + UNFUSED),
    "bench_1b_dp2_overlap_grad": (2, DP2_OVERLAP_GRAD + FAST),
    "bench_1b_dp2_overlap_grad_mb4": (2, DP2_OVERLAP_GRAD + FAST + MB4),
    "bench_1b_dp2_overlap_grad_unfused_wgrad": (2, DP2_OVERLAP_GRAD + FAST + UNFUSED_WGRAD),
    "bench_1b_dp2_overlap": (2, DP2_OVERLAP + FAST),
    "bench_1b_cp2_base": (2, BENCH_2GPU + ["parallel.cp=2"] + UNFUSED),
    "bench_1b_cp2": (2, BENCH_2GPU + ["parallel.cp=2"] + FAST),
    "bench_1b_cp2_mb4": (2, BENCH_2GPU + ["parallel.cp=2"] + FAST + MB4),
    "llama3_8b_16l_tp2_sp_base": (2, LLAMA_16L_TP2 + UNFUSED + ["name=llama3_8b_16l_tp2_sp"]),
    "llama3_8b_16l_tp2_sp": (2, LLAMA_16L_TP2 + TP_FAST + ["name=llama3_8b_16l_tp2_sp"]),
    # CUDA graphs (Megatron-Core's, one per layer) on the host-bound layouts, and beside
    # compiled layers where compiling is allowed.
    "bench_1b_1gpu_graphs": (1, BENCH_1GPU + FAST + GRAPHS),
    "bench_1b_dp2_overlap_grad_graphs": (2, DP2_OVERLAP_GRAD + FAST + GRAPHS),
    "bench_1b_tp2_sp_graphs": (2, TP2_SP + GRAPHS),
    "bench_1b_tp2_sp_graphs_mb4": (2, TP2_SP + GRAPHS + MB4),
    "bench_1b_tp2_sp_overlap_graphs": (2, TP2_SP + TP_FAST + GRAPHS),
    "bench_1b_tp2_sp_overlap_graphs_mb4": (2, TP2_SP + TP_FAST + GRAPHS + MB4),
    "bench_1b_dp2_overlap_grad_graphs_mb4": (2, DP2_OVERLAP_GRAD + FAST + GRAPHS + MB4),
    "bench_1b_cp2_graphs": (2, BENCH_2GPU + ["parallel.cp=2"] + FAST + GRAPHS),
    "bench_1b_cp2_graphs_mb4": (2, BENCH_2GPU + ["parallel.cp=2"] + FAST + GRAPHS + MB4),
    # CP by all-to-all (one causal call on the whole sequence for half the heads) beside the
    # all-gather form above
    "bench_1b_cp2_a2a_mb4": (2, BENCH_2GPU + ["parallel.cp=2"] + CP_A2A + FAST + MB4),
    "bench_1b_cp2_a2a_graphs_mb4": (2, BENCH_2GPU + ["parallel.cp=2"] + CP_A2A + FAST + GRAPHS + MB4),
    # no recompute: Megatron-Core's graph capture cannot run activation checkpointing
    "llama3_8b_16l_tp2_sp_graphs": (2, LLAMA_16L_TP2 + GRAPHS + ["train.recompute=none", "name=llama3_8b_16l_tp2_sp"]),
    "llama3_8b_16l_tp2_sp_overlap_graphs": (2, LLAMA_16L_TP2 + TP_FAST + GRAPHS + ["train.recompute=none",
                                                                                  "name=llama3_8b_16l_tp2_sp"]),
    # FP8 where GEMMs dominate: the Llama-3-8B shape (8 layers fit one GPU's optimizer state),
    # compiled, bf16 against torchao's tensorwise FP8.
    "llama3_8b_8l_1gpu": (1, LLAMA3_8B_1GPU + FAST),
    "llama3_8b_8l_1gpu_fp8_tensorwise": (1, LLAMA3_8B_1GPU + FAST + ["precision=fp8_tensorwise"] + NO_FP8_OUTPUT),
    # Half the 8B's layers on one GPU (the output layer, kept in bf16, is then 13 % of the
    # matmul FLOPs rather than 23 % at 8 layers) at micro-batch 2: bigger float8 GEMMs.
    "llama3_8b_16l_1gpu_mb2": (1, LLAMA3_8B_16L_1GPU_MB2 + FAST),
    "llama3_8b_16l_1gpu_mb2_fp8_tensorwise": (1, LLAMA3_8B_16L_1GPU_MB2 + FAST + ["precision=fp8_tensorwise"]
                                              + NO_FP8_OUTPUT),
    "llama3_8b_16l_1gpu_mb2_fp8_tensorwise_output": (1, LLAMA3_8B_16L_1GPU_MB2 + FAST + [
        "precision=fp8_tensorwise", "engine.layer_spec=torch_native", "precision.fp8_output_layer=true"]),
    # bf16 with each weight gradient added into the fp32 buffer by a kernel of its own
    "llama3_8b_16l_1gpu_mb2_unfused_wgrad": (1, LLAMA3_8B_16L_1GPU_MB2 + FAST + UNFUSED_WGRAD),
    # the same for float8: torchao's GEMM writes the weight gradient in bf16 and a kernel adds it
    "llama3_8b_16l_1gpu_mb2_fp8_tensorwise_output_unfused_wgrad": (1, LLAMA3_8B_16L_1GPU_MB2 + FAST + [
        "precision=fp8_tensorwise", "precision.fp8_output_layer=true"] + UNFUSED_WGRAD),
    # the same two with the optimizer step in torch's foreach form (the 1.29x of 11-29)
    "llama3_8b_16l_1gpu_mb2_foreach_adam": (1, LLAMA3_8B_16L_1GPU_MB2 + FAST + FOREACH_ADAM),
    "llama3_8b_16l_1gpu_mb2_fp8_tensorwise_output_foreach_adam": (1, LLAMA3_8B_16L_1GPU_MB2 + FAST + [
        "precision=fp8_tensorwise", "precision.fp8_output_layer=true"] + FOREACH_ADAM),
}.items()}
ENGINES = {name: (gpus, overrides + TRACED) for name, (gpus, overrides) in {
    "bench_1b_dp2_distopt": (2, BENCH_2GPU + ["zero=stage1", "engine.overlap_grad_reduce=true",
                                              "engine.overlap_param_gather=true"]),
    "bench_1b_dp2_fsdp": (2, BENCH_2GPU + ["zero=stage3"]),
    # The same model under DeepSpeed: a Hugging Face Llama drawn by Megatron-Core's
    # init rules for ZeRO 1-3 and offload; Megatron-Core's GPTModel (the very weights of the
    # Megatron engine's TP=2 run, same seed) for ZeRO-1 over TP=2.
    "bench_1b_ds_zero1": (2, BENCH_2GPU + ["engine=deepspeed", "zero=stage1"]),
    "bench_1b_ds_zero2": (2, BENCH_2GPU + ["engine=deepspeed", "zero=stage2"]),
    "bench_1b_ds_zero3": (2, BENCH_2GPU + ["engine=deepspeed", "zero=stage3"]),
    "bench_1b_tp2": (2, BENCH_2GPU + ["parallel.tp=2"]),
    "bench_1b_ds_zero1_tp2": (2, BENCH_2GPU + ["engine=deepspeed", "zero=stage1", "parallel.tp=2"]),
    "bench_1b_ds_zero1_tp2_sp": (2, BENCH_2GPU + ["engine=deepspeed", "zero=stage1", "parallel.tp=2", "parallel.sp=true"]),
    "bench_1b_ds_zero2_offload": (2, BENCH_2GPU + ["engine=deepspeed", "zero=stage2_offload"]),
    "bench_1b_pp2": (2, BENCH_2GPU + ["parallel.pp=2"]),
    "bench_1b_pp2_vpp2": (2, BENCH_2GPU + ["parallel.pp=2", "parallel.vpp=2"]),
    "llama3_8b_8l_dp2": (2, LLAMA3_8B + ["model.num_layers=8", "engine.overlap_grad_reduce=true",
                                         "name=llama3_8b_8l_dp2"]),
    "mixtral_4l_ep2": (2, ["model=mixtral_8x7b", "cluster=h100_x2", "zero=stage1", "parallel.ep=2",
                           "model.num_layers=4", "train.seq_length=4096", "train.micro_batch_size=1",
                           "train.global_batch_size=16", "train.steps=14", "train.recompute=full",
                           "name=mixtral_4l_ep2"]),
    # The 8-GPU layouts (llama3_8b_dp8, llama3_8b_tp8, mixtral_ep8) scaled to 4 GPUs.
    "mixtral_8l_ep4": (4, ["model=mixtral_8x7b", "cluster=h100_x4", "zero=stage1", "parallel.ep=4",
                           "model.num_layers=8", "train.seq_length=4096", "train.micro_batch_size=1",
                           "train.global_batch_size=16", "train.steps=14", "train.recompute=full",
                           "name=mixtral_8l_ep4"]),
    "llama3_8b_tp4_sp": (4, ["model=llama3_8b", "cluster=h100_x4", "zero=stage1", "parallel.tp=4", "parallel.sp=true",
                             "train.seq_length=4096", "train.micro_batch_size=1", "train.global_batch_size=8",
                             "train.steps=14", "train.recompute=selective", "name=llama3_8b_tp4_sp"]),
    "llama3_8b_tp4_sp_graphs": (4, ["model=llama3_8b", "cluster=h100_x4", "zero=stage1", "parallel.tp=4",
                                    "parallel.sp=true", "train.seq_length=4096", "train.micro_batch_size=1",
                                    "train.global_batch_size=8", "train.steps=14", "train.recompute=none",
                                    "engine.cuda_graphs=layers", "name=llama3_8b_tp4_sp"]),
    "llama3_8b_16l_dp4": (4, LLAMA3_8B + ["cluster=h100_x4", "model.num_layers=16", "train.global_batch_size=16",
                                          "engine.overlap_grad_reduce=true", "engine.overlap_param_gather=true",
                                          "name=llama3_8b_16l_dp4"]),
}.items()}
# Where ZeRO's time goes: the same cases with one setting changed (ZERO_SPEED suite).
# DeepSpeed's own bucket defaults (deepspeed/runtime/zero/config.py), written out.
DS_BUCKETS = ["zero.reduce_bucket_size=500000000"]
DS_BUCKETS_Z3 = DS_BUCKETS + ["zero.stage3_prefetch_bucket_size=50000000", "zero.stage3_param_persistence_threshold=100000"]
DS = ["engine=deepspeed"]
# Where ZeRO's time goes: the same cases with one setting changed (zero_speed suite).
ZERO_SPEED = {name: (gpus, overrides + TRACED) for name, (gpus, overrides) in {
    "bench_1b_ds_zero3_one_queue": (2, BENCH_2GPU + DS + ["zero=stage3", "engine.cuda_device_max_connections=1"]),
    "bench_1b_ds_zero3_deepspeed_buckets": (2, BENCH_2GPU + DS + ["zero=stage3"] + DS_BUCKETS_Z3),
    "bench_1b_ds_zero3_leaf_layers": (2, BENCH_2GPU + DS + ["zero=stage3", "zero.stage3_leaf_layers=true"] + DS_BUCKETS_Z3),
    "bench_1b_ds_zero1_one_queue": (2, BENCH_2GPU + DS + ["zero=stage1", "engine.cuda_device_max_connections=1"]),
    "bench_1b_ds_zero1_deepspeed_buckets": (2, BENCH_2GPU + DS + ["zero=stage1"] + DS_BUCKETS),
    "bench_1b_ds_zero1_compiled": (2, BENCH_2GPU + DS + ["zero=stage1", "engine.compile_layers=true"] + DS_BUCKETS),
    "bench_1b_ds_zero2_deepspeed_buckets": (2, BENCH_2GPU + DS + ["zero=stage2"] + DS_BUCKETS),
    # DeepSpeed's ZeRO on the Megatron engine's own GPTModel: ZeRO against the distributed
    # optimizer with the model held equal (both from the seed draw the same weights).
    "bench_1b_dp2_distopt_baseline": (2, BENCH_2GPU + ["zero=stage1", "engine.overlap_grad_reduce=true",
                                                       "engine.overlap_param_gather=true"]),
    "bench_1b_ds_zero1_megatron_model": (2, BENCH_2GPU + DS + ["zero=stage1", "engine.deepspeed_model=megatron"]),
    "bench_1b_ds_zero2_megatron_model": (2, BENCH_2GPU + DS + ["zero=stage2", "engine.deepspeed_model=megatron"]),
    "bench_1b_tp2_sp_distopt": (2, BENCH_2GPU + ["zero=stage1", "parallel.tp=2", "parallel.sp=true"]),
    "bench_1b_ds_zero1_tp2_sp_deepspeed_buckets": (2, BENCH_2GPU + DS + ["zero=stage1", "parallel.tp=2", "parallel.sp=true"]
                                                   + DS_BUCKETS),
    # the Adam step's two forms under ZeRO on one GPU (the client optimizer DeepSpeed wraps)
    "bench_1b_1gpu_ds_zero1": (1, BENCH_1GPU + DS + ["zero=stage1"]),
    "bench_1b_1gpu_ds_zero1_foreach_adam": (1, BENCH_1GPU + DS + ["zero=stage1"] + FOREACH_ADAM),
    "bench_1b_1gpu_ds_zero3": (1, BENCH_1GPU + DS + ["zero=stage3"]),
    "bench_1b_1gpu_ds_zero3_foreach_adam": (1, BENCH_1GPU + DS + ["zero=stage3"] + FOREACH_ADAM),
}.items()}
# Variable-length documents: rows of 32k tokens packed with whole documents of a
# long-tailed length mix (lognormal, median 1k, sigma 1.5, capped at the row: about 10
# documents a row, a few of 16k-32k), uncompiled (shapes change every micro-batch). On 4
# GPUs: static CP=4, CP=2 x DP=2 and DP=4 against dynamic CP whose longest documents are
# split over 2 or 4 ranks (at most 8k tokens per rank, as under CP=4), under either
# scheduler, and with 32k per rank (every document on one rank: the balance alone). On 2
# GPUs the same at half the scale.
VARLEN_BASE = ["+bench=bench_gpu", "data.packing=true", "train.seq_length=32768",
               "model.max_position_embeddings=32768", "train.micro_batch_size=1",
               "data.doc_lengths.median=1024", "data.doc_lengths.sigma=1.5", "train.steps=14"]
# The Llama-3-8B shape (16 layers), where a rank cannot hold a whole 32k row (DP is refused
# by the memory check) and static layouts need CP for every document.
LLAMA_16L = ["model=llama3_8b", "model.num_layers=16", "train.steps=12"]


def varlen_suite(gpus: int, prefix: str) -> dict:
    """The varlen cases on `gpus` GPUs (two rows a GPU each step): static CP over every GPU,
    CP=2 x DP=2 on 4, DP over every GPU, and dynamic CP with a row split over every GPU at
    most (on 4 also over 2), under both schedulers, then with a whole row per rank; the same
    on the 8B shape, but for the whole-row case."""
    base = VARLEN_BASE + [f"cluster=h100_x{gpus}", f"train.global_batch_size={2 * gpus}"]
    split = [f"parallel.max_seqlen_per_rank={32768 // gpus}"]
    gridwright = ["parallel.cp_scheduler=gridwright"]
    megatron = ["parallel.cp_scheduler=megatron"]  # the default is gridwright's: the case names say which
    dynamic = ["parallel.cp_mode=dynamic"]
    # On 4 GPUs also half a row per rank: the tokens a rank holds under CP=2 x DP=2.
    half_row = ["parallel.max_seqlen_per_rank=16384"]
    layouts = {f"cp{gpus}": [f"parallel.cp={gpus}"], **({"cp2_dp2": ["parallel.cp=2"]} if gpus == 4 else {}),
               f"dp{gpus}": [], "dynamic": dynamic + split + megatron,
               "dynamic_gridwright": dynamic + split + gridwright,
               **({"dynamic_16k": dynamic + half_row + megatron,
                   "dynamic_16k_gridwright": dynamic + half_row + gridwright} if gpus == 4 else {})}
    whole_row = {"dynamic_32k_gridwright": dynamic + ["parallel.max_seqlen_per_rank=32768"] + gridwright}
    cases = {f"{prefix}_{name}": base + extra for name, extra in {**layouts, **whole_row}.items()}
    cases |= {f"{prefix}_8b16l_{name}": base + LLAMA_16L + extra for name, extra in layouts.items()}
    return {name: (gpus, overrides + TRACED) for name, overrides in cases.items()}


VARLEN = varlen_suite(4, "varlen")
VARLEN_2GPU = varlen_suite(2, "varlen2")
# Transformer Engine's layer spec beside the torch-native spec's best paths, every TE
# question in one suite so that one call (and one results file) holds them side by side.
# The cases run in this order, so that a call cut short by its machine's time keeps the
# rows that matter most: the 8B shape (bf16, FP8 delayed with and without the float8
# output layer, CUDA graphs), packed documents through TE's THD attention against the
# torch-native varlen kernel (32k rows, uncompiled), the bench model (host-bound: TE
# eager, CUDA graphs), micro-batch and recompute for TE FP8 on the 8B shape (micro-batch 4
# fits one H200 only with full recompute, by the memory estimate), then the other recipes.
TE = ["engine.layer_spec=transformer_engine"]
VARLEN_1GPU = VARLEN_BASE + ["cluster=h100_x1", "train.global_batch_size=2"]
FP8_OUTPUT = ["precision.fp8_output_layer=true"]
TE_DELAYED, TE_CURRENT, TE_BLOCKWISE = (TE + ["precision=fp8_delayed"], TE + ["precision=fp8_tensorwise"],
                                        TE + ["precision=fp8_blockwise"])
TE_FP8_BEST = TE_DELAYED + FP8_OUTPUT
TE_SUITE = {name: (gpus, overrides + TRACED) for name, (gpus, overrides) in {
    "llama3_8b_16l_1gpu_mb2": (1, LLAMA3_8B_16L_1GPU_MB2 + FAST),
    "llama3_8b_16l_1gpu_mb2_te": (1, LLAMA3_8B_16L_1GPU_MB2 + TE),
    "llama3_8b_16l_1gpu_mb2_te_fp8_delayed": (1, LLAMA3_8B_16L_1GPU_MB2 + TE_DELAYED + NO_FP8_OUTPUT),
    # the output layer (outside TE's layers) through torchao's tensorwise float8 matmul
    "llama3_8b_16l_1gpu_mb2_te_fp8_delayed_output": (1, LLAMA3_8B_16L_1GPU_MB2 + TE_FP8_BEST),
    # Megatron-Core's CUDA graphs (per layer) on TE's layers
    "llama3_8b_16l_1gpu_mb2_te_fp8_delayed_graphs": (1, LLAMA3_8B_16L_1GPU_MB2 + TE_DELAYED + GRAPHS + NO_FP8_OUTPUT),
    "varlen1_te": (1, VARLEN_1GPU + TE),
    "varlen1_torch_native": (1, VARLEN_1GPU + ["engine.layer_spec=torch_native"]),
    "bench_1b_1gpu": (1, BENCH_1GPU + FAST),
    "bench_1b_1gpu_te": (1, BENCH_1GPU + TE),
    "bench_1b_1gpu_te_graphs": (1, BENCH_1GPU + TE + GRAPHS),
    **{f"llama3_8b_16l_1gpu_mb{mb}_te_fp8_delayed_output{'_' + recompute if recompute != 'none' else ''}":
       (1, LLAMA3_8B_16L_1GPU_MB2 + TE_FP8_BEST + [f"train.micro_batch_size={mb}", f"train.recompute={recompute}"])
       for mb, recompute in ((1, "none"), (2, "selective"), (4, "full"), (8, "full"))},
    "llama3_8b_16l_1gpu_mb2_fp8_tensorwise_output": (1, LLAMA3_8B_16L_1GPU_MB2 + FAST + [
        "precision=fp8_tensorwise", "engine.layer_spec=torch_native", "precision.fp8_output_layer=true"]),
    "llama3_8b_16l_1gpu_mb2_te_fp8_current": (1, LLAMA3_8B_16L_1GPU_MB2 + TE_CURRENT + NO_FP8_OUTPUT),
    "llama3_8b_16l_1gpu_mb2_te_fp8_blockwise": (1, LLAMA3_8B_16L_1GPU_MB2 + TE_BLOCKWISE + NO_FP8_OUTPUT),
    "bench_1b_1gpu_te_fp8_delayed": (1, BENCH_1GPU + TE_DELAYED + NO_FP8_OUTPUT),
}.items()}

SUITES = {"performance": PERFORMANCE, "engines": ENGINES, "zero_speed": {**ZERO_SPEED}, "varlen": VARLEN,
          "varlen_2gpu": VARLEN_2GPU, "te": TE_SUITE,
          "all": {**PERFORMANCE, **ENGINES, **ZERO_SPEED, **VARLEN, **VARLEN_2GPU, **TE_SUITE}}


def device_overrides() -> list[str]:
    """Name the card actually present (an H200 may stand in for an H100)."""
    import torch

    props = torch.cuda.get_device_properties(0)
    return [f"cluster.gpu.name={props.name.replace(' ', '_')}",
            f"cluster.gpu.memory_gib={props.total_memory / 2**30:.1f}"]


def start_from(overrides: list[str], weights: dict[str, Path] | None) -> list[str]:
    """The `checkpoint.load` that starts a case from the shared weights: the Hugging Face
    folder for DeepSpeed's Hugging Face model, the converted checkpoint for Megatron-Core's
    GPTModel (both engines)."""
    if weights is None or "zero=stage3" in overrides and "engine=deepspeed" not in overrides:
        return []  # Megatron-FSDP loads no checkpoint in gridwright yet: it starts from the seed
    if "engine=deepspeed" in overrides and not any(o.startswith("parallel.tp=") for o in overrides):
        return [f"checkpoint.load={weights['hf']}"]
    return [f"checkpoint.load={weights['megatron']}"]


def run_case(name: str, gpus: int, overrides: list[str], jobs: Path, card: list[str], gpu: int | None = None,
             side_by_side: bool = False, timeout: float | None = None) -> dict:
    """One case as a launch.py run; `gpu`: pin a one-GPU case to that device (an index
    into the devices this process sees); `side_by_side`: another case runs beside it;
    `timeout`: seconds after which the case is stopped and recorded as timed out."""
    job_dir = jobs / name
    cmd = [sys.executable, "-m", "gridwright", *COMMON, *overrides, *card, f"job_dir={job_dir}"]
    env = None if gpu is None else {**os.environ, "CUDA_VISIBLE_DEVICES": _visible_device(gpu)}
    print(f"+ [{name}]", " ".join(cmd), flush=True)
    started = time.monotonic()
    proc = run_bounded(cmd, timeout, env=env)
    # Labelled: side by side, two cases' outputs arrive in the order they finish.
    print(f"[{name}] output:\n{proc.stdout[-2500:]}", proc.stderr[-4000:] if proc.returncode else "", flush=True)
    engine = "deepspeed" if "engine=deepspeed" in overrides else "megatron"
    row = {"case": name, "gpus": gpus, "engine": engine, "exit_code": proc.returncode, "job_dir": str(job_dir),
           "side_by_side": side_by_side, "wall_s": round(time.monotonic() - started, 1)}
    summary = job_dir / "summary.json"
    if proc.returncode == 0 and summary.exists():
        s = json.loads(summary.read_text())
        history = read_metrics(job_dir)
        last, losses = history[-1], [h["loss"] for h in history]
        comm = s.get("communication") or {}
        from omegaconf import OmegaConf

        bf16_peak = OmegaConf.load(job_dir / "config.yaml").cluster.gpu.peak_bf16_tflops
        row.update(
            tokens_per_s_per_gpu=s["tokens_per_s_per_gpu"],
            mfu=s.get("mfu"),
            mfu_palm=s.get("mfu_palm"),
            peak_kind=s.get("peak_kind"),
            # FP8 runs: MFU also against the bf16 peak (the toolkit's `mfu` uses the FP8 peak)
            mfu_vs_bf16_peak=(s["tokens_per_s_per_gpu"] * s["flops_per_token"]["megatron"] / 1e12 / bf16_peak)
            if bf16_peak and s.get("peak_kind") == "fp8" else None,
            loss_last10_mean=sum(losses[-10:]) / len(losses[-10:]) if losses else None,
            exposed_comm_ms=_ms(comm.get("exposed_comm_s")),
            comm_ms=_ms(comm.get("comm_s")),
            wait_ms=_ms(comm.get("wait_s")),  # communication spent waiting for the slowest rank (skew)
            idle_ms=_ms(comm.get("idle_s")),
            host_wait_ms=_ms(comm.get("host_wait_s")),  # idle with nothing launched yet: host-bound
            gpu_activities=comm.get("gpu_activities"),
            compute_by_class_ms={k: _ms(v) for k, v in (comm.get("compute_by_class_s") or {}).items()},
            compiled_graphs=s.get("compiled_graphs"),
            overlap_pct=comm.get("overlap_pct"),
            exposed_ms_by_group={g: _ms(v.get("exposed_s")) for g, v in (comm.get("by_group") or {}).items()},
            traced_step_ms=_ms(comm.get("step_s")),
            step_time_s=s["mean_step_time_s"],
            first_loss=s["first_loss"],
            last_loss=s["last_loss"],
            memory_max_allocated_gib=last.get("memory_max_allocated_gib"),
            layer_spec=s.get("layer_spec"),
            attention=(s.get("attention") or {}).get("backend"),
            attention_ms=(s.get("attention") or {}).get("ms"),
            compute_imbalance=comm.get("compute_imbalance"),
            dynamic_cp=s.get("dynamic_cp"),
            placement_verified=s.get("placement_verified"),
            layout=(job_dir / "config.yaml").exists() and _layout(job_dir),
        )
    return row


def _visible_device(index: int) -> str:
    """The index-th device this process sees, as CUDA_VISIBLE_DEVICES names it."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    return visible.split(",")[index].strip() if visible else str(index)


def _attention(row) -> str:
    """The SDPA kernel the run chose, e.g. " (attention: cudnn)"."""
    return f" (attention: {row['attention']})" if row.get("attention") else ""


def _classes(row) -> str:
    """GPU milliseconds per step in matmuls, attention and the rest, e.g. "512 / 90 / 230"."""
    by = row.get("compute_by_class_ms") or {}
    return " / ".join(f"{by.get(k) or 0:.0f}" for k in ("matmul", "attention", "other")) if by else ""


def _ms(seconds):
    return None if seconds is None else seconds * 1e3


def _layout(job_dir: Path) -> str:
    doc = json.loads((job_dir / "placement.json").read_text())["layout"]
    extra = (" SP" if doc["sp"] else "") + (f" VPP={doc['vpp']}" if doc["vpp"] else "")
    return f"TP={doc['tp']} PP={doc['pp']} CP={doc['cp']} DP={doc['dp']} EP={doc['ep']}{extra}"


def table(rows: list[dict], card: str) -> str:
    groups = sorted({g for r in rows for g in r.get("exposed_ms_by_group") or {}})
    side = [r["case"] for r in rows if r.get("side_by_side")]
    lines = [
        f"GPU: {card}",
        "",
        *([f"Run side by side, two at a time (one GPU each, one host): {', '.join(side)}.", ""] if side else []),
        "MFU: model FLOPs / peak; `megatron` halves causal attention (Megatron-LM), `palm` counts it in full. "
        "FP8 rows divide by the FP8 peak, and also by the bf16 peak (column `MFU megatron / bf16 peak`). "
        "Exposed communication: NCCL time with no compute on the GPU; wait: NCCL time before the last member "
        "arrived (skew); idle: no GPU activity; host wait: the part of idle before the host had launched the "
        "next kernel (the step is host-bound there); kernels: GPU activities per step; all the mean of 2 traced "
        "steps over ranks. Matmul / attention / other: GPU time of each kernel class (trace_analysis.kernel_class). "
        "Symmetric-memory copies and barriers (async TP) are not NCCL kernels and count as compute. "
        "Attention: the SDPA kernel each run measured fastest at its start (engine.attention_backend=auto), or was told.",
        "",
        "| case | GPUs | layout | spec | tokens/s/GPU | MFU (megatron) | MFU (palm) | MFU megatron / bf16 peak "
        "| step s | comm ms | wait ms | exposed comm ms | " + "".join(f"exposed {g} ms | " for g in groups)
        + "overlap % | idle ms | host wait ms | kernels | matmul / attention / other ms | max alloc GiB "
        "| loss first→last (mean of last 10) |",
        "| --- " * (19 + len(groups)) + "|",
    ]
    f = lambda v, fmt: "" if v is None else format(v, fmt)  # noqa: E731
    for r in rows:
        if r["exit_code"]:
            why = "timed out" if r["exit_code"] == 124 else f"failed (exit {r['exit_code']})"
            lines.append(f"| {r['case']} | {r['gpus']} | {why} |" + " |" * (16 + len(groups)))
            continue
        lines.append(
            f"| {r['case']} | {r['gpus']} | {r['layout']} | {r['layer_spec']}{_attention(r)} | "
            f"{r['tokens_per_s_per_gpu']:,.0f} | "
            f"{f(r['mfu'], '.1%')} | {f(r['mfu_palm'], '.1%')} | {f(r.get('mfu_vs_bf16_peak'), '.1%')} | "
            f"{r['step_time_s']:.3f} | {f(r.get('comm_ms'), '.1f')} | {f(r.get('wait_ms'), '.1f')} | "
            f"{f(r.get('exposed_comm_ms'), '.1f')} | "
            + "".join(f"{f((r.get('exposed_ms_by_group') or {}).get(g), '.1f')} | " for g in groups)
            + f"{f(r.get('overlap_pct'), '.1f')} | {f(r.get('idle_ms'), '.1f')} | {f(r.get('host_wait_ms'), '.1f')} | "
            f"{f(r.get('gpu_activities'), ',.0f')} | {_classes(r)} | {f(r['memory_max_allocated_gib'], '.1f')} | "
            f"{r['first_loss']:.2f}→{r['last_loss']:.2f} ({f(r.get('loss_last10_mean'), '.3f')}) |"
        )
    balanced = [r for r in rows if not r["exit_code"] and (r.get("dynamic_cp") or r.get("compute_imbalance"))]
    if balanced:
        lines += ["", "Per-rank work imbalance: the busiest rank's GPU compute over the mean rank's in the traced "
                  "steps (every row); for dynamic CP also each rank's measured busy time and the scheduler's "
                  "estimate (length² / CP size), both max/mean. Swap: scheduling plus the barriers before CP "
                  "groups change, ms per step.", "",
                  "| case | imbalance (traced compute) | dynamic: busy | dynamic: estimated | documents by CP size "
                  "| groups/step | swap ms |", "| --- " * 7 + "|"]
        for r in balanced:
            d = r.get("dynamic_cp") or {}
            sizes = ", ".join(f"CP{k}: {n}" for k, n in (d.get("documents_by_cp_size") or {}).items())
            lines.append(f"| {r['case']} | {f(r.get('compute_imbalance'), '.2f')} | {f(d.get('straggler'), '.2f')} | "
                         f"{f(d.get('imbalance_estimated'), '.2f')} | {sizes} | {f(d.get('groups_per_step'), '.1f')} | "
                         f"{f(d.get('swap_ms'), '.1f')} |")
    return "\n".join(lines)


def main() -> None:
    import torch

    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", REPO / "evaluations" / "results")))
    ap.add_argument("--suite", choices=sorted(SUITES), default="performance")
    ap.add_argument("--only", nargs="*")
    ap.add_argument("--same-weights", action="store_true",
                    help="start every case from one draw of the weights, as a Hugging Face folder and its "
                    "Megatron-Core conversion (both engines; Megatron-FSDP, which loads no checkpoint, from the seed)")
    ap.add_argument("--jobs", type=Path, help="keep the job directories here (to log them into MLflow later "
                    "with python -m gridwright.tracking.sync); default: a temporary directory")
    ap.add_argument("--case-timeout", type=float, help="stop a case after this many seconds (a hung case "
                    "then costs the call no more); the table says it timed out")
    ap.add_argument("--one-gpu-cases-side-by-side", action="store_true",
                    help="run the one-GPU cases two at a time, one per GPU")
    args = ap.parse_args()
    unknown = sorted(set(args.only or ()) - set(SUITES[args.suite]))
    if unknown:
        print(f"error: no case {', '.join(unknown)} in the {args.suite} suite", file=sys.stderr)
        sys.exit(2)
    n = torch.cuda.device_count()
    card = torch.cuda.get_device_name(0)
    jobs = args.jobs or Path(tempfile.mkdtemp(prefix="bench_gpu_"))
    weights = write_same_weights(jobs, BENCH_2GPU) if args.same_weights else None
    rows = []
    cases = []
    for name, (gpus, overrides) in SUITES[args.suite].items():
        if args.only and name not in args.only:
            continue
        if gpus > n:
            print(f"skip {name}: needs {gpus} GPUs, {n} present")
            continue
        cases.append((name, gpus, overrides + start_from(overrides, weights)))
    pairs = args.one_gpu_cases_side_by_side and n >= 2
    ones = [c for c in cases if c[1] == 1] if pairs else []
    for i in range(0, len(ones), 2):  # two one-GPU cases at a time, GPU 0 and GPU 1
        batch = ones[i:i + 2]
        with ThreadPoolExecutor(2) as pool:
            rows += list(pool.map(lambda c: run_case(*c[1], jobs, device_overrides(), gpu=c[0],
                                                     side_by_side=len(batch) == 2, timeout=args.case_timeout),
                                  enumerate(batch)))
        write_results(args.out, args.suite, rows, card, n)
    for name, gpus, overrides in cases:
        if (name, gpus, overrides) in ones:
            continue
        rows.append(run_case(name, gpus, overrides, jobs, device_overrides(), timeout=args.case_timeout))
        write_results(args.out, args.suite, rows, card, n)  # after every case: a cut-short call keeps the rest
    print(write_results(args.out, args.suite, rows, card, n), flush=True)


def te_version() -> str:
    """", Transformer Engine X" where it imports (its spec's rows then ran on it)."""
    try:
        import transformer_engine
    except Exception:  # absent, or present without CUDA/cuDNN
        return ""
    return f", Transformer Engine {transformer_engine.__version__}"


def write_results(out: Path, suite: str, rows: list[dict], card: str, n: int) -> str:
    """Replace this suite's results file for this card (`bench_gpu_<suite>_<N>x<model>`)."""
    import torch

    text = table(rows, f"{n} x {card}, torch {torch.__version__}{te_version()}")
    benchmark, here = f"bench_gpu_{suite}", card_of_this_machine()
    write_markdown(out, benchmark, here, "python -m gridwright.evaluations.bench_gpu " + " ".join(sys.argv[1:]), text)
    write_json(out, benchmark, here, {"card": card, "gpus": n, "rows": rows})
    return text


if __name__ == "__main__":
    main()
