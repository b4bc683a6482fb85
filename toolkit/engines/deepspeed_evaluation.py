"""The validation loss of a DeepSpeed trainer (either model): the mean over
`data.eval_iters` held-out global batches, as the Megatron engine's evaluate reports it."""
from __future__ import annotations

import torch
import torch.distributed as dist


@torch.no_grad()
def held_out_loss(trainer, round_index: int, loss_of, group=None) -> float:
    """Mean of `loss_of(batch)` over the micro-batches of this round's held-out batches and
    over the data-parallel ranks (`group`; None: every rank, when DP is the world)."""
    trainer.engine.eval()
    iters = trainer.cfg.data.eval_iters
    total = torch.zeros(1, device=trainer.device)
    for i in range(iters):
        for batch in trainer.data.batches("valid", round_index * iters + i, trainer.dp_rank, trainer.layout.dp,
                                          trainer.num_micro, trainer.device):
            total += loss_of(batch)
    trainer.engine.train()
    dist.all_reduce(total, group=group)
    return float(total.item()) / (iters * trainer.num_micro * trainer.layout.dp)
