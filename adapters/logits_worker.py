"""One process of a logits check: `torchrun ... -m gridwright.adapters.logits_worker`.

Builds the Megatron-Core GPTModel exactly as the engine does (same config mapping, same
layer spec), loads a checkpoint's weights at the requested TP/PP/VPP/EP, runs a forward
pass through Megatron-Core's pipeline schedule on the given tokens, and the rank holding
the last stage (TP rank 0, DP rank 0) writes the logits gathered over TP.
"""
from __future__ import annotations

import argparse
import contextlib
import faulthandler
import json
import signal
from pathlib import Path

import torch
import torch.distributed as dist


def layout_run_config(model: dict, tp: int, pp: int, vpp: int | None, ep: int, seq_length: int):
    """A run config of this model at this layout on CPU processes (one per rank), as the
    layout check and the logits worker both build the model."""
    from omegaconf import OmegaConf

    from ..config.schema import RunConfig

    cfg = OmegaConf.structured(RunConfig)
    cfg.model = OmegaConf.merge(cfg.model, model)
    cfg.parallel.tp, cfg.parallel.pp, cfg.parallel.vpp, cfg.parallel.ep = tp, pp, vpp, ep
    cfg.parallel.sp = tp > 1  # Megatron-Core needs SP for MoE with TP; harmless for dense
    cfg.parallel.moe_token_dispatcher = "allgather"
    cfg.cluster.gpus_per_node = cfg.cluster.nvlink_domain_size = tp * pp * ep
    cfg.train.seq_length, cfg.train.micro_batch_size = seq_length, 1
    return cfg


def main() -> bool:
    """True where the process must end at once (on the GPU)."""
    from ..checkpoints.checkpoint_trust import guard_process, inherited_trust

    # a caller's timeout ends this process with SIGTERM: its stacks go to stderr first, which
    # the caller's error carries (where it hung, not only that it did)
    faulthandler.register(signal.SIGTERM, all_threads=True, chain=True)
    guard_process(trust=inherited_trust())
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True, help="an iter_N directory")
    ap.add_argument("--tokens", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--vpp", type=int, default=None)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--model", help="model config JSON; default: the one the checkpoint records")
    ap.add_argument("--round-to", choices=("bf16", "fp16"), help="round the weights to this dtype and back")
    ap.add_argument("--layer-spec", choices=("torch_native", "transformer_engine"), default="torch_native",
                    help="whose layers are built (transformer_engine: on CUDA, where TE imports)")
    args = ap.parse_args()

    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.core.transformer import TransformerConfig

    from ..checkpoints.checkpoint_dir import read_common
    from ..engines.megatron_checkpoint import load_model_weights
    from .verify_logits import ROUNDING, round_weights
    from ..megatron_internals.cpu_compat import cpu_compat
    from ..engines.megatron_groups import init_parallel
    from ..megatron_internals.fixes import apply_megatron_fixes
    from ..engines.megatron_model import build_model_chunks, transformer_config_kwargs
    from ..planning.layout import ParallelLayout

    tokens = torch.load(args.tokens)  # [batch, seq]
    model = json.loads(Path(args.model).read_text()) if args.model else read_common(args.checkpoint)["model_config"]
    cfg = layout_run_config(model, args.tp, args.pp, args.vpp, args.ep, tokens.shape[1])
    te = args.layer_spec == "transformer_engine"
    # Transformer Engine's layers exist only on CUDA; there the whole check runs on the GPU
    # (NCCL), in fp32 like the CPU check, so both specs compare with the same arithmetic width.
    cfg.cluster.device = "cuda" if te else cfg.cluster.device
    cfg.engine.layer_spec = args.layer_spec
    on_cpu = cfg.cluster.device == "cpu"
    layout = ParallelLayout.from_config(cfg)
    apply_megatron_fixes()
    with cpu_compat() if on_cpu else contextlib.nullcontext():
        init_parallel(cfg.cluster, cfg.watchdog, layout)
        model_parallel_cuda_manual_seed(0, inference_rng_tracker=True)
        tcfg = TransformerConfig(**transformer_config_kwargs(cfg, layout, te))
        chunks = build_model_chunks(cfg.model, cfg.parallel, tcfg, te_available=te)
        if not on_cpu:
            for c in chunks:
                c.cuda(torch.cuda.current_device())
            tokens = tokens.cuda()
        load_model_weights(chunks, Path(args.checkpoint))
        for c in chunks:
            round_weights(c, ROUNDING.get(args.round_to))
        for c in chunks:
            c.eval()

        def forward_step(data_iterator, chunk):
            batch = next(data_iterator)
            positions = torch.arange(batch.shape[1], device=batch.device).unsqueeze(0)
            return chunk(batch, positions, None), None  # no loss function: the schedule keeps logits

        iterators = [iter(list(tokens.split(1))) for _ in chunks]
        with torch.no_grad():
            outputs = get_forward_backward_func()(
                forward_step_func=forward_step,
                data_iterator=iterators if len(chunks) > 1 else iterators[0],
                model=chunks if len(chunks) > 1 else chunks[0],
                num_microbatches=tokens.shape[0],
                seq_length=tokens.shape[1],
                micro_batch_size=1,
                forward_only=True,
            )
        if ps.is_pipeline_last_stage(ignore_virtual=True):
            local = torch.cat(outputs, dim=0)  # [batch, seq, vocab / TP]
            group = ps.get_tensor_model_parallel_group()
            parts = [torch.empty_like(local) for _ in range(dist.get_world_size(group))]
            dist.all_gather(parts, local.contiguous(), group=group)
            if ps.get_tensor_model_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0:
                torch.save(torch.cat(parts, dim=-1).cpu(), args.out)
        dist.barrier()
        if not on_cpu:  # the GPU check ends as a CUDA training worker does (worker._LEAVE_GROUPS_TO_EXIT)
            torch.cuda.synchronize()
            return True
        ps.destroy_model_parallel()
        dist.destroy_process_group()
    return False


if __name__ == "__main__":
    from gridwright.basics.process_exit import exit_without_final_collection
    from gridwright.runtime.process_tree import exit_at_once

    if main():
        exit_at_once(0)
    exit_without_final_collection(0)
