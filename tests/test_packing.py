"""Packed variable-length documents: the data, the attention that stays inside a document,
and Megatron-Core's balanced scheduler as dynamic context parallelism uses it."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf

from conftest import REPO
from gridwright.data import packing
from gridwright.data.packing import Document, document_lengths, pack, split_at_eod, synthetic_row

LENGTHS = OmegaConf.create({"distribution": "lognormal", "median": 40, "sigma": 1.0, "min": 4, "cap": None})


def test_rows_are_whole_documents_drawn_from_the_step_alone():
    rows = [synthetic_row(i, 256, 256, 1234, LENGTHS) for i in range(50)]
    assert all(sum(len(d) for d in row) == 256 for row in rows)
    lengths = [len(d) for row in rows for d in row]
    assert min(lengths) >= 1 and max(lengths) <= 256 and len(set(lengths)) > 20  # a spread, not one length
    again = synthetic_row(17, 256, 256, 1234, LENGTHS)
    assert [d.tokens.tolist() for d in again] == [d.tokens.tolist() for d in rows[17]]
    assert [d.tokens.tolist() for d in synthetic_row(17, 256, 256, 99, LENGTHS)] != [d.tokens.tolist() for d in again]
    # each document is its own arithmetic sequence: a label is the next token of its document
    doc = rows[0][0]
    assert doc.labels[:-1].tolist() == doc.tokens[1:].tolist()


def test_lengths_respect_min_and_cap():
    capped = OmegaConf.merge(LENGTHS, {"median": 5000, "cap": 100, "min": 30})
    lengths = document_lengths(np.random.default_rng(0), capped, 1000)
    assert sum(lengths) == 1000 and max(lengths) == 100  # the last one may be cut shorter than min


def test_pack_pads_each_document_and_restarts_positions():
    docs = [Document(np.arange(5), np.arange(1, 6), np.ones(5, dtype=np.float32)),
            Document(np.arange(3), np.arange(1, 4), np.ones(3, dtype=np.float32))]
    batch = pack(docs, multiple=4)
    assert batch["cu_seqlens"].tolist() == [0, 8, 12]
    assert batch["max_seqlen"] == 8
    assert batch["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]]
    assert batch["loss_mask"].tolist() == [[1, 1, 1, 1, 1, 0, 0, 0, 1, 1, 1, 0]]
    assert batch["tokens"].tolist() == [[0, 1, 2, 3, 4, 0, 0, 0, 0, 1, 2, 0]]


def test_indexed_samples_are_cut_after_each_eod_and_never_predict_across_it():
    eod = 0
    tokens = np.array([5, 6, eod, 7, 8, 9, eod, 4])
    labels = np.array([6, eod, 7, 8, 9, eod, 4, 3])
    docs = split_at_eod(tokens, labels, np.ones(8, dtype=np.float32), eod)
    assert [d.tokens.tolist() for d in docs] == [[5, 6, eod], [7, 8, 9, eod], [4]]
    # the EOD position's label is the next document's first token: masked
    assert [d.loss_mask.tolist() for d in docs] == [[1, 1, 0], [1, 1, 1, 0], [1]]


def _dense_reference(q, k, v, cu):
    """Causal attention with an explicit block-diagonal mask over the whole row."""
    t = q.shape[0]
    doc = torch.zeros(t, dtype=torch.long)
    for i, (s, e) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        doc[s:e] = i
    allowed = (doc[:, None] == doc[None, :]) & torch.ones(t, t, dtype=torch.bool).tril()
    k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    out = F.scaled_dot_product_attention(*(x.transpose(0, 1) for x in (q, k, v)), attn_mask=allowed)
    return out.transpose(0, 1)


def test_document_attention_equals_a_block_diagonal_mask():
    from gridwright.engines.torch_attention import documents, thd_params

    torch.manual_seed(0)
    cu = torch.tensor([0, 7, 8, 30, 64], dtype=torch.int32)
    q, k, v = torch.randn(64, 4, 16), torch.randn(64, 2, 16), torch.randn(64, 2, 16)
    out = documents(q, k, v, thd_params(cu, 34, "cpu"))
    assert torch.allclose(out, _dense_reference(q, k, v, cu), atol=1e-6)
    # and it is not plain causal attention over the row
    plain = _dense_reference(q, k, v, torch.tensor([0, 64], dtype=torch.int32))
    assert not torch.allclose(out, plain, atol=1e-3)


def test_a_planted_document_never_reaches_the_next_one():
    """B's per-token losses on the real GPTModel are the same whatever document A holds, and
    differ when the row runs as one sequence (so the check could fail)."""
    proc = subprocess.run([sys.executable, str(REPO / "tests" / "packed_forward.py"), "1:1", "2:1", "2:0"],
                          capture_output=True, text=True, timeout=300, env={**os.environ, "MASTER_PORT": "29531"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    with_a, with_other_a, leaking = (json.loads(line) for line in proc.stdout.strip().splitlines()[-3:])
    start = with_a["b_start"]
    assert with_a["losses"][:start] != with_other_a["losses"][:start]  # A itself changed
    assert with_a["losses"][start:] == with_other_a["losses"][start:]  # B did not see it, to the last bit
    assert max(abs(x - y) for x, y in zip(with_a["losses"][start:], leaking["losses"][start:])) > 1e-3


@pytest.mark.parametrize("name", ["megatron", "gridwright"])
def test_scheduler_deals_every_document_once_to_aligned_groups(name):
    from gridwright.engines.cp_schedulers import aligned, make_scheduler

    rng = np.random.default_rng(3)
    lengths = [int(x) for x in np.clip(rng.lognormal(np.log(1024), 1.5, 200), 16, 32768)]
    plan = make_scheduler(name, 8192, 8).schedule(lengths)
    dealt = {i for group in plan.work for rank in group for i in rank}
    assert dealt == set(range(len(lengths)))
    assert aligned(plan.work, plan.cp_size)
    assert {plan.cp_size[i] for i, n in enumerate(lengths) if n > 16384} <= {4, 8}
    assert all(plan.cp_size[i] >= 2 for i, n in enumerate(lengths) if n > 8192)
    assert 1.0 <= plan.imbalance < 1.5
    if name == "gridwright":  # one group, no barriers; shared documents in one global order
        assert len(plan.work) == 1 and plan.imbalance < 1.05
        position = {}
        for rank_ids in plan.work[0]:
            shared = [i for i in rank_ids if plan.cp_size[i] > 1]
            for a, b in zip(shared, shared[1:]):
                position.setdefault((a, b), True)
                assert (b, a) not in position  # no two ranks run two shared documents in opposite orders


# Packed training at every layout against one process, per step (losses and gradient norms).
LAYOUTS = {
    "dp2": ["parallel.cp=1"],
    "cp2": ["parallel.cp=2"],
    "tp2_sp": ["parallel.tp=2", "parallel.sp=true"],
    "dynamic_dp4": ["cluster.gpus_per_node=4", "parallel.cp_mode=dynamic", "parallel.max_seqlen_per_rank=64"],
}
# gridwright's scheduler: its run is the first half of test_dynamic_cp_resumes_exactly
GRIDWRIGHT_DP4 = ["cluster.gpus_per_node=4", "parallel.cp_mode=dynamic", "parallel.max_seqlen_per_rank=64",
                  "parallel.cp_scheduler=gridwright"]
PACKED = ["data.packing=true", "train.seq_length=256", "train.global_batch_size=4", "train.micro_batch_size=1",
          "train.steps=4", "train.warmup_steps=1", "data.doc_lengths.median=40", "data.doc_lengths.min=4"]


def _history(job: Path) -> list[dict]:
    return [json.loads(line) for line in (job / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def one_process(tmp_path_factory):
    from conftest import launch

    tmp = tmp_path_factory.mktemp("one")
    result = launch(["tracking=off", f"job_dir={tmp / 'job'}", "cluster.gpus_per_node=1", *PACKED], cwd=tmp)
    assert result.returncode == 0, result.stderr[-3000:]
    return _history(tmp / "job")


def _matches(history: list[dict], reference: list[dict], name: str) -> None:
    assert len(history) == len(reference) == 4
    for ours, ref in zip(history, reference):
        for key in ("loss", "grad_norm"):
            assert abs(ours[key] - ref[key]) <= 1e-4 * abs(ref[key]), (name, ours["step"], key, ours[key], ref[key])
    assert history[-1]["loss"] < history[0]["loss"] - 0.1


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_packed_training_matches_one_process(run_launch, tmp_path, one_process, name):
    result = run_launch("tracking=off", f"job_dir={tmp_path / 'job'}", *PACKED, *LAYOUTS[name])
    assert result.returncode == 0, result.stderr[-3000:]
    history = _history(tmp_path / "job")
    _matches(history, one_process, name)
    if name.startswith("dynamic"):
        summary = json.loads((tmp_path / "job" / "summary.json").read_text())["dynamic_cp"]
        assert set(summary["documents_by_cp_size"]) == {"1", "2", "4"}  # every group size was used
        assert summary["straggler"] >= 1.0 and summary["swap_ms"] > 0
        assert "dynamic CP  documents CP 1 x" in result.stdout


@pytest.mark.slow
def test_packed_indexed_data_trains(run_launch, tmp_path):
    from gridwright.data.prepare_data import main as prepare

    corpus = tmp_path / "corpus.jsonl"
    rng = np.random.default_rng(0)
    words = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta"]
    corpus.write_text("".join(json.dumps({"text": " ".join(rng.choice(words, int(rng.integers(3, 60))))}) + "\n"
                              for _ in range(300)))
    prefix = tmp_path / "data" / "corpus"
    prepare(["--input", str(corpus), "--output-prefix", str(prefix)])
    result = run_launch("tracking=off", f"job_dir={tmp_path / 'job'}", "data.kind=indexed", f"data.paths=[{prefix}]",
                        "data.packing=true", "parallel.cp=2", "model.vocab_size=258", "train.seq_length=128", "train.steps=3",
                        "train.warmup_steps=1", "data.split=90/10/0")
    assert result.returncode == 0, result.stderr[-3000:]
    history = _history(tmp_path / "job")
    assert len(history) == 3 and all(np.isfinite(h["loss"]) for h in history)
    # rows of several documents: each step's mean context is shorter than the row
    assert all(h["attention_context"] < 128 for h in history)


def test_packing_module_imports_no_torch():
    proc = subprocess.run([sys.executable, "-c", "import sys, gridwright.data.packing as p; "
                           "print('torch' in sys.modules)"], capture_output=True, text=True)
    assert proc.stdout.strip() == "False", proc.stderr
    assert packing.padded_length(5, 4) == 8


def test_plan_prints_the_documents_and_the_schedule(run_launch):
    result = run_launch("data.packing=true", "parallel.cp_mode=dynamic", "cluster.gpus_per_node=4",
                        "train.seq_length=256", "parallel.max_seqlen_per_rank=64", "data.doc_lengths.median=40",
                        "launcher=plan")
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    assert "documents   steps 0-19:" in out
    assert "CP groups (DP ranks) of 2: [0, 1] [2, 3]; of 4: [0, 1, 2, 3]" in out
    line = next(x for x in out.splitlines() if "(documents, first 20 steps)" in x)
    counts = {int(k): int(n.replace(",", "")) for k, n in re.findall(r"CP (\d+) x ([\d,]+)", line)}
    assert set(counts) == {1, 2, 4} and counts[1] > counts[2] > 0
    assert "Megatron-FSDP" not in out + result.stderr


def test_a_steps_flops_follow_its_documents_context(compose):
    """Packed rows: attention FLOPs per token are those of the step's mean context, so a row
    of short documents counts fewer FLOPs than one document filling the row."""
    from gridwright.planning.model_math import flops_record, model_flops_per_token
    from gridwright.runtime.step_metrics import StepMetrics

    cfg = compose("+bench=bench_gpu", "data.packing=true", "launcher=plan")
    plan = {**flops_record(cfg), "tokens_per_step": 16 * 4096}
    metrics = StepMetrics(plan, 1, on_cuda=False)
    whole = metrics.derive({"step_time_s": 1.0, "attention_context": 4096})
    short = metrics.derive({"step_time_s": 1.0, "attention_context": 512})
    assert whole["tflops_per_gpu"] == pytest.approx(16 * 4096 * model_flops_per_token(cfg.model, 4096) / 1e12)
    assert short["tflops_per_gpu"] == pytest.approx(16 * 4096 * model_flops_per_token(cfg.model, 512) / 1e12)
    assert short["mfu"] < whole["mfu"] and short["mfu_palm"] < whole["mfu_palm"]


def test_dynamic_cp_summary_and_headline_metrics():
    from gridwright.launchers.worker import dynamic_cp_summary
    from gridwright.tracking.headline import run_metrics, step_metrics

    rows = [{"cp_groups": 3.0, "cp_schedule_ms": 1.0, "cp_barrier_ms": 5.0, "cp_imbalance_estimated": 1.02,
             "cp_straggler": 1.10, "cp_size_1_documents": 20.0, "cp_size_2_documents": 2.0},
            {"cp_groups": 1.0, "cp_schedule_ms": 3.0, "cp_barrier_ms": 1.0, "cp_imbalance_estimated": 1.04,
             "cp_straggler": 1.30, "cp_size_1_documents": 22.0, "cp_size_4_documents": 1.0}]
    d = dynamic_cp_summary(rows)
    assert d["documents_by_cp_size"] == {"1": 42, "2": 2, "4": 1}
    assert d["straggler"] == pytest.approx(1.2) and d["swap_ms"] == pytest.approx(5.0)
    assert run_metrics({"dynamic_cp": d}, {}) == {"cp_straggler": 1.2, "cp_imbalance_estimated": 1.03,
                                                   "cp_swap_ms": 5.0}
    assert step_metrics(rows[0])["cp_barrier_ms"] == 5.0


@pytest.mark.slow
def test_dynamic_cp_resumes_exactly(run_launch, tmp_path, one_process):
    """Dynamic CP under gridwright's scheduler matches one process, and, saved after step 2
    of 4 and resumed, gives steps 2-3 of one uninterrupted process again (the documents of
    a step follow from the step alone)."""
    import shutil

    dynamic = GRIDWRIGHT_DP4
    ck = tmp_path / "ck"
    first = run_launch("tracking=off", f"job_dir={tmp_path / 'first'}", *PACKED, *dynamic, f"checkpoint.save={ck}",
                       "checkpoint.save_interval=2")
    assert first.returncode == 0, first.stderr[-3000:]
    _matches(_history(tmp_path / "first"), one_process, "dynamic_dp4_gridwright")
    summary = json.loads((tmp_path / "first" / "summary.json").read_text())["dynamic_cp"]
    assert summary["groups_per_step"] == 1.0 and summary["barrier_ms"] == 0.0  # one group: no barriers
    halfway = tmp_path / "halfway"  # the root as it was after step 2
    halfway.mkdir()
    shutil.copytree(ck / "iter_0000002", halfway / "iter_0000002")
    (halfway / "latest").write_text("iter_0000002\n")
    resumed = run_launch("tracking=off", f"job_dir={tmp_path / 'second'}", *PACKED, *dynamic,
                         f"checkpoint.load={halfway}")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    history = _history(tmp_path / "second")
    assert [h["step"] for h in history] == [2, 3]
    for ours, ref in zip(history, one_process[2:]):
        assert abs(ours["loss"] - ref["loss"]) <= 1e-4 * abs(ref["loss"]), (ours["step"], ours["loss"], ref["loss"])
