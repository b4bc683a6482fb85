"""engine.fused_adam: torch's fused AdamW inside Megatron-Core's distributed optimizer makes
the unfused form's update (on CPU torch's per-tensor loop; foreach is its CUDA default), and
a state dict saved unfused (as every checkpoint before the fused form was) loads and goes on
fused, each parameter's step count its own. The step counts are rewritten where the
optimizer's groups are empty, as DeepSpeed's ZeRO-3 keeps them outside its step."""

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from gridwright.engines.optimizer_schedule import set_adam_form
from gridwright.runtime.loopback import free_port


def _optimizer(seed: int):
    """A two-layer model under Megatron-Core's DDP and distributed optimizer (fp32, one rank)."""
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    torch.manual_seed(seed)
    module = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Linear(32, 8))
    tcfg = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=1)
    model = DistributedDataParallel(tcfg, DistributedDataParallelConfig(use_distributed_optimizer=True), module)
    opt = get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-2, weight_decay=0.1,
                                                 use_distributed_optimizer=True), [model])
    return model, opt


def _step(model, opt, batch: int):
    g = torch.Generator().manual_seed(batch)
    opt.zero_grad()
    model.zero_grad_buffer()
    model(torch.randn(4, 16, generator=g)).pow(2).mean().backward()
    model.finish_grad_sync()
    opt.step()


def _groups(opt):
    return [g for inner in (o.optimizer for o in getattr(opt, "chained_optimizers", [opt])) for g in inner.param_groups]


def _states(opt):
    return [s for o in getattr(opt, "chained_optimizers", [opt]) for s in o.optimizer.state.values()]


def _worker(rank, port, out):
    from megatron.core import parallel_state as ps

    from gridwright.megatron_internals.cpu_compat import cpu_compat
    from gridwright.megatron_internals.fixes import apply_megatron_fixes

    apply_megatron_fixes()  # as every Megatron run does (one of them unties the loaded step counts)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    with cpu_compat():
        ps.initialize_model_parallel()
        (fused_model, fused), (foreach_model, foreach) = _optimizer(0), _optimizer(0)
        out["found"] = set_adam_form(fused, True) and set_adam_form(foreach, False)
        out["forms"] = [(g["fused"], g["foreach"]) for g in _groups(fused) + _groups(foreach)]
        for batch in range(3):
            _step(fused_model, fused, batch)
            _step(foreach_model, foreach, batch)
        # The fused optimizer takes the foreach one's state dict (its groups say foreach),
        # then the form is set again, as the engines do after every load.
        fused.load_state_dict(foreach.state_dict())
        out["loaded_forms"] = [(g["fused"], g["foreach"]) for g in _groups(fused)]
        set_adam_form(fused, True)
        out["reset_forms"] = [(g["fused"], g["foreach"]) for g in _groups(fused)]
        for batch in range(3, 5):
            _step(fused_model, fused, batch)
            _step(foreach_model, foreach, batch)
        out["steps"] = sorted({s["step"].item() for s in _states(fused) + _states(foreach)})
        out["difference"] = max((a - b).abs().max().item() for a, b in
                                zip(fused_model.parameters(), foreach_model.parameters()))
        out["moved"] = max(p.detach().abs().max().item() for p in fused_model.parameters())
        ps.destroy_model_parallel()
    dist.destroy_process_group()


def test_the_fused_form_makes_the_foreach_update_and_survives_a_load():
    out = mp.Manager().dict()
    mp.spawn(_worker, args=(free_port(), out), nprocs=1)
    assert out["found"]
    assert out["forms"] == [(True, False)] * 2 + [(None, None)] * 2  # two groups each: decayed, not
    assert out["loaded_forms"] == [(None, None)] * 2
    assert out["reset_forms"] == [(True, False)] * 2
    assert out["moved"] > 0.1
    assert out["steps"] == [5.0]  # three steps, a load, two more
    assert out["difference"] < 1e-6, out["difference"]


def test_step_counts_are_rewritten_when_the_groups_hold_no_parameters():
    """DeepSpeed's ZeRO-3 empties its torch optimizer's groups outside the step, and its loads
    leave each step count on the host; the form is set from the states themselves."""
    params = [torch.nn.Parameter(torch.randn(4, 4)) for _ in range(3)]
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    for state in opt.state.values():
        state["step"] = torch.tensor(1.0, dtype=torch.float64)  # as a load may leave it
    for group in opt.param_groups:
        group["params"] = []
    assert set_adam_form(opt, True)
    assert [s["step"].dtype for s in opt.state.values()] == [torch.float32] * 3
    assert opt.param_groups[0]["fused"] is True and opt.param_groups[0]["foreach"] is False
    assert set_adam_form(opt, False)
    assert opt.param_groups[0]["fused"] is None and opt.param_groups[0]["foreach"] is None
