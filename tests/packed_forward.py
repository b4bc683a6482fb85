"""One process, one real GPTModel (tiny_llama on CPU over gloo): per-token losses of a
packed row of two documents [A, B], printed as JSON, for tests/test_packing.py.

    python tests/packed_forward.py [--te] SEED_OF_A:PACKED ...   (PACKED 0 or 1; one JSON line each)

A is drawn from SEED_OF_A; B is fixed. With PACKED=1 the row runs as two documents (THD,
`packing.pack`); with 0 as one sequence, where B sees A (the control a leak test needs). `--te`: Transformer Engine's layers in
bf16 on the GPU (NCCL), whose fused attention reads the THD bounds on the device.
"""
import contextlib
import json
import os
import sys

import numpy as np
import torch


def main() -> None:
    te = "--te" in sys.argv
    cases = [(int(c.split(":")[0]), c.split(":")[1] == "1") for c in sys.argv[1:] if c != "--te"]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("MASTER_PORT", "29533"),
                      RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    from megatron.core.transformer import TransformerConfig

    from gridwright.config.compose import compose_config
    from gridwright.engines.megatron_groups import init_parallel
    from gridwright.engines.megatron_model import build_model_chunks, choose_torch_native_paths, transformer_config_kwargs
    from gridwright.megatron_internals.cpu_compat import cpu_compat
    from gridwright.megatron_internals.fixes import apply_megatron_fixes
    from gridwright.planning.layout import ParallelLayout
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    # on the GPU: head dimension 64 and bf16, which TE's fused THD attention needs
    on_gpu = ["cluster=h100_x1", "engine.layer_spec=transformer_engine", "precision=bf16", "model.hidden_size=256",
              "model.ffn_hidden_size=768", "model.num_attention_heads=4", "model.num_query_groups=2"]
    cfg = compose_config(["cluster.gpus_per_node=1", "data.packing=true", "train.seq_length=96",
                          *(on_gpu if te else [])])
    layout = ParallelLayout.from_config(cfg)
    apply_megatron_fixes()
    with contextlib.nullcontext() if te else cpu_compat():
        init_parallel(cfg.cluster, cfg.watchdog, layout)
        torch.manual_seed(1)
        model_parallel_cuda_manual_seed(1, inference_rng_tracker=True)
        tcfg = TransformerConfig(**transformer_config_kwargs(cfg, layout, te_available=te))
        choose_torch_native_paths(cfg, tcfg, te_available=te)
        model = build_model_chunks(cfg.model, cfg.parallel, tcfg, te_available=te)[0]
        model = (model.cuda() if te else model).eval()
        for seed_a, packed in cases:
            print(json.dumps(_losses(model, seed_a, packed, te)), flush=True)


def _losses(model, seed_a: int, packed: bool, te: bool) -> dict:
    from gridwright.data.packing import Document, pack
    from gridwright.engines.torch_attention import thd_params

    a = np.random.default_rng(seed_a).integers(0, 256, 41)
    b = (7 + 3 * np.arange(56)) % 256
    docs = [Document(x[:-1], x[1:], np.ones(len(x) - 1, dtype=np.float32)) for x in (a, b)]
    batch = pack(docs, device="cuda" if te else None)
    cu, longest = batch["cu_seqlens"], batch["max_seqlen"]
    if not packed:  # one 95-token sequence: B's tokens attend to A's
        cu, longest = torch.tensor([0, int(cu[-1])], dtype=torch.int32), int(cu[-1])
    params = thd_params(cu, longest, "cuda" if te else "cpu", te_layers=te)  # as the engine builds them
    with torch.no_grad():
        losses = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                       packed_seq_params=params)
    return {"b_start": int(batch["cu_seqlens"][1]), "losses": losses.view(-1).tolist()}


if __name__ == "__main__":
    main()
