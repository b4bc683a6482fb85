"""Checkpoint conversion: logits agree, round trips are bit-exact, bad input is refused.

Tiny random models of every supported architecture are made locally with `transformers`;
the Megatron-Core side runs in real gloo processes at TP=2, PP=2 and EP=2.
"""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from gridwright.adapters.convert import main as convert_main
from gridwright.adapters.tiny_models import ARCHITECTURES, make_tiny_model
from gridwright.megatron_internals.checkpoint_format import TORCH_DIST_METADATA
from gridwright.adapters.verify_logits import compare_logits, hf_logits, sample_tokens

TOLERANCE = 1e-4


@pytest.fixture(scope="session")
def models(tmp_path_factory):
    """Every architecture, saved by transformers (Llama in several small shards)."""
    root = tmp_path_factory.mktemp("hf")
    return {k: make_tiny_model(k, root / k, shard_size="40KB" if k == "llama" else None) for k in ARCHITECTURES}


@pytest.fixture(scope="session")
def converted(models, tmp_path_factory):
    root = tmp_path_factory.mktemp("megatron")
    out = {}
    for kind, path in models.items():
        assert convert_main(["hf-to-megatron", "--hf", str(path), "--out", str(root / kind)]) == 0
        out[kind] = root / kind
    return out


def _tensors(folder: Path) -> dict:
    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(f))
    return out


ACROSS_PROCESSES = [
    ("llama", 2, 1, None, 1),
    ("llama", 1, 2, 2, 1),
    ("llama3_tied", 1, 2, None, 1),  # the tied output layer lives on the last stage
    ("qwen2", 2, 1, None, 1),  # QKV biases split over TP
    ("mixtral", 1, 1, None, 2),
    ("mixtral", 2, 1, None, 1),
    ("qwen3", 2, 1, None, 1),  # QK-norm (per head) and a head size apart from hidden / heads, over TP
    ("qwen3", 1, 2, None, 1),
    ("qwen3_moe", 1, 1, None, 2),
]


# An architecture checked across processes is not checked again in one (the suite's time).
@pytest.mark.slow
@pytest.mark.parametrize("kind", [k for k in ARCHITECTURES if k not in {c[0] for c in ACROSS_PROCESSES}])
def test_logits_match_at_tp1(kind, models, converted):
    r = compare_logits(models[kind], converted[kind])
    print(f"{kind} TP=1: max |diff| {r['max_abs_diff']:.2e} (logits up to {r['max_abs_logit']:.2f})")
    assert r["max_abs_logit"] > 1.0  # logits large enough for a wrong mapping to show
    assert r["max_abs_diff"] <= TOLERANCE


@pytest.mark.slow
@pytest.mark.parametrize("kind,tp,pp,vpp,ep", ACROSS_PROCESSES)
def test_logits_match_across_processes(kind, tp, pp, vpp, ep, models, converted):
    r = compare_logits(models[kind], converted[kind], tp=tp, pp=pp, vpp=vpp, ep=ep)
    print(f"{kind} TP={tp} PP={pp} VPP={vpp} EP={ep}: max |diff| {r['max_abs_diff']:.2e}")
    assert r["max_abs_logit"] > 1.0
    assert r["max_abs_diff"] <= TOLERANCE


@pytest.mark.slow
def test_gate_catches_a_wrong_mapping(models, tmp_path):
    """k and v swapped (same shapes, so only the logits can tell): the gate fails loudly."""
    bad = tmp_path / "swapped"
    shutil.copytree(models["llama"], bad)
    for f in bad.glob("*.safetensors"):
        t = load_file(f)
        for name in [n for n in t if n.endswith("k_proj.weight")]:
            v = name.replace("k_proj", "v_proj")
            if v in t:
                t[name], t[v] = t[v], t[name]
        save_file(t, f, metadata={"format": "pt"})
    assert convert_main(["hf-to-megatron", "--hf", str(bad), "--out", str(tmp_path / "out")]) == 0
    assert compare_logits(models["llama"], tmp_path / "out")["max_abs_diff"] > 100 * TOLERANCE


def test_rope_scaling_is_exercised_by_the_gate(models):
    """The Llama-3 rope scaling changes these logits by more than the tolerance, so a
    conversion that dropped it would fail verification."""
    import transformers

    tokens = sample_tokens(128)
    scaled = hf_logits(models["llama3_tied"], tokens)
    config = transformers.AutoConfig.from_pretrained(models["llama3_tied"])
    config.rope_parameters = {"rope_type": "default", "rope_theta": config.rope_parameters["rope_theta"]}
    plain = transformers.AutoModelForCausalLM.from_pretrained(models["llama3_tied"], config=config).eval()
    with torch.no_grad():
        unscaled = plain(input_ids=tokens).logits
    assert (scaled - unscaled).abs().max() > 10 * TOLERANCE


@pytest.mark.parametrize("kind", ARCHITECTURES)
def test_round_trip_is_bit_exact(kind, models, converted, tmp_path):
    back = tmp_path / "back"
    assert convert_main(["megatron-to-hf", "--megatron", str(converted[kind]), "--out", str(back)]) == 0
    original, returned = _tensors(models[kind]), _tensors(back)
    assert sorted(original) == sorted(returned)
    for name, t in original.items():
        assert returned[name].dtype == t.dtype and torch.equal(returned[name], t), name
    assert json.loads((back / "config.json").read_text()) == json.loads((models[kind] / "config.json").read_text())
    record = json.loads((back / "conversion.json").read_text())
    assert record["direction"] == "megatron-to-hf" and record["toolkit_version"] != "unknown"


def test_bf16_round_trip_keeps_dtype_and_bits(tmp_path):
    hf = make_tiny_model("mixtral", tmp_path / "hf", dtype=torch.bfloat16)
    assert convert_main(["hf-to-megatron", "--hf", str(hf), "--out", str(tmp_path / "m")]) == 0
    assert convert_main(["megatron-to-hf", "--megatron", str(tmp_path / "m"), "--out", str(tmp_path / "back")]) == 0
    a, b = _tensors(hf), _tensors(tmp_path / "back")
    assert all(b[n].dtype == torch.bfloat16 and torch.equal(a[n], b[n]) for n in a)


def test_mixed_dtypes_round_trip_per_tensor(tmp_path):
    """fp32 norms beside bf16 weights (as some releases ship): each keeps its dtype both ways."""
    import transformers

    from gridwright.adapters.tiny_models import _configs

    model = transformers.AutoModelForCausalLM.from_config(_configs()["qwen2"]).to(torch.bfloat16)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data = p.data.float()
    model.save_pretrained(tmp_path / "hf")
    assert convert_main(["hf-to-megatron", "--hf", str(tmp_path / "hf"), "--out", str(tmp_path / "m")]) == 0
    assert convert_main(["megatron-to-hf", "--megatron", str(tmp_path / "m"), "--out", str(tmp_path / "back")]) == 0
    a, b = _tensors(tmp_path / "hf"), _tensors(tmp_path / "back")
    assert {a[n].dtype for n in a} == {torch.bfloat16, torch.float32}
    assert all(b[n].dtype == a[n].dtype and torch.equal(a[n], b[n]) for n in a)


@pytest.mark.parametrize("kind", ["llama3_tied", "mistral", "qwen2", "mixtral", "qwen3", "qwen3_moe"])
def test_export_without_the_source_config_writes_an_equivalent_one(kind, models, converted, tmp_path):
    """Without the kept source config.json, the exported config is written by transformers'
    config class from the model config; the exported model computes the original's logits."""
    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted[kind], ckpt)
    shutil.rmtree(ckpt / "hf_source")
    back = tmp_path / "back"
    assert convert_main(["megatron-to-hf", "--megatron", str(ckpt), "--out", str(back)]) == 0
    record = json.loads((back / "conversion.json").read_text())
    assert record["config_json"] == "written by transformers' config class" and record["copied_files"] == []
    tokens = sample_tokens(128)
    assert torch.equal(hf_logits(back, tokens), hf_logits(models[kind], tokens))


def test_exported_folder_loads_with_from_pretrained(models, converted, tmp_path):
    """transformers loads the export (Mixtral experts fused on load) and computes the same logits."""
    back = tmp_path / "back"
    assert convert_main(["megatron-to-hf", "--megatron", str(converted["mixtral"]), "--out", str(back)]) == 0
    tokens = sample_tokens(128)
    assert torch.equal(hf_logits(back, tokens), hf_logits(models["mixtral"], tokens))


@pytest.mark.slow
@pytest.mark.parametrize("experiment,saved", [("tiny_llama_tp2", "tp"), ("tiny_mixtral_cpu", "ep")])
def test_trained_checkpoint_exports_to_hugging_face(experiment, saved, run_launch, tmp_path):
    """A checkpoint the engine saved at TP=2 or EP=2 (tensors stored in parts by several
    ranks) exports; transformers then computes the logits the Megatron-Core model computes."""
    ckpt = tmp_path / "ckpt"
    r = run_launch(f"+experiment={experiment}", "train.steps=3", f"checkpoint.save={ckpt}", "tracking=off")
    assert r.returncode == 0, r.stderr[-3000:]
    # the metadata Megatron-Core's own save writes is what the converter writes
    assert json.loads((ckpt / "iter_0000003" / "metadata.json").read_text()) == TORCH_DIST_METADATA
    out = tmp_path / "hf"
    assert convert_main(["megatron-to-hf", "--megatron", str(ckpt), "--out", str(out)]) == 0
    record = json.loads((out / "conversion.json").read_text())
    assert record["source_layout"][saved] == 2 and record["source_step"] == 3
    r = compare_logits(out, ckpt, tp=1)
    assert r["max_abs_diff"] <= TOLERANCE
    if experiment == "tiny_llama_tp2":
        # A checkpoint that records no model config converts with the model's conf/ file.
        common_file = ckpt / "iter_0000003" / "common.pt"
        common = torch.load(common_file, weights_only=False)
        del common["common"]["model_config"]
        torch.save(common, common_file)
        conf_file = Path(__file__).resolve().parents[1] / "conf" / "model" / "tiny_llama.yaml"
        assert convert_main(["megatron-to-hf", "--megatron", str(ckpt), "--out", str(tmp_path / "hf2"),
                             "--model-config", str(conf_file), "--verify", "--tp", "2"]) == 0
        assert _tensors(tmp_path / "hf2").keys() == _tensors(out).keys()
        # A bf16 export of the fp32 run is verified like with like: both sides' weights in bf16,
        # fp32 compute, the usual tolerance. A failed verify publishes nothing.
        bf16 = ["megatron-to-hf", "--megatron", str(ckpt), "--model-config", str(conf_file), "--dtype", "bf16",
                "--verify"]
        assert convert_main(bf16 + ["--out", str(tmp_path / "hf_bf16")]) == 0
        record = json.loads((tmp_path / "hf_bf16" / "conversion.json").read_text())
        assert record["dtype"] == ["bfloat16"] and record["verify"]["max_abs_diff"] <= TOLERANCE
        assert record["verify"]["weights"] == "both sides rounded to bf16, computed in fp32"
        # A tolerance no difference can meet: on an AMD EPYC the two sides agreed exactly, so
        # tolerance 0 did not fail there (it did on the machines before).
        assert convert_main(bf16 + ["--out", str(tmp_path / "hf_strict"), "--tolerance", "-1"]) == 1
        assert not any(p.name.startswith((".hf_strict", "hf_strict")) for p in tmp_path.iterdir())


@pytest.mark.slow
def test_engine_trains_from_a_converted_checkpoint(converted, run_launch, tmp_path):
    """A converted Qwen3 (QK-norm, head size apart from hidden / heads) trains at TP=2+SP."""
    root = converted["qwen3"]
    r = run_launch(f"hydra.searchpath=[file://{root}]", "model=qwen3", f"checkpoint.load={root}",
                   "parallel.tp=2", "parallel.sp=true", "train.steps=3", "tracking=off")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step     2 loss" in r.stdout
    # ... and what it saves from there resumes.
    ckpt = tmp_path / "ckpt"
    common = [f"hydra.searchpath=[file://{root}]", "model=qwen3", "tracking=off"]
    assert run_launch(*common, f"checkpoint.load={root}", f"checkpoint.save={ckpt}", "train.steps=3").returncode == 0
    r = run_launch(*common, f"checkpoint.load={ckpt}", f"checkpoint.save={ckpt}", "train.steps=5")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "step     3 loss" in r.stdout and "step     0 loss" not in r.stdout
    # The wrong model for that checkpoint is refused before anything starts.
    r = run_launch(f"checkpoint.load={root}", "train.steps=3", "tracking=off")
    assert r.returncode == 2
    assert "written for another model shape" in r.stderr and "model=qwen3" in r.stderr
    assert len([p for p in (tmp_path / "jobs").glob("*/*") if p.is_dir()]) == 3  # none for the refused run


# --- bad input: a clear error, exit 2, nothing written --------------------------------


def _edit_config(src: Path, dst: Path, **changes) -> Path:
    shutil.copytree(src, dst)
    cfg = json.loads((dst / "config.json").read_text())
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


@pytest.mark.parametrize("kind,changes,message", [
    ("mistral", {"sliding_window": 4096}, "sliding_window=4096"),
    ("qwen2", {"use_sliding_window": True}, "use_sliding_window"),
    ("llama", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}}, "rope scaling type 'yarn'"),
    ("llama3_tied", {"rope_parameters": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                         "high_freq_factor": 2.0, "original_max_position_embeddings": 8192,
                                         "rope_theta": 5e5}}, "high_freq_factor=2.0"),
    ("llama", {"model_type": "gpt2"}, "model_type 'gpt2' is not supported"),
    ("llama", {"attention_bias": True}, "attention_bias=true"),
    ("mixtral", {"router_jitter_noise": 0.1}, "router_jitter_noise"),
    ("llama", {"intermediate_size": 80}, "config.json implies"),
])
def test_unsupported_or_inconsistent_sources_are_refused(kind, changes, message, models, tmp_path, capsys):
    src = _edit_config(models[kind], tmp_path / "src", **changes)
    out = tmp_path / "out"
    assert convert_main(["hf-to-megatron", "--hf", str(src), "--out", str(out)]) == 2
    assert message in capsys.readouterr().err
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["src"]


def _rewrite_tensors(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    f = dst / "model.safetensors"
    t = load_file(f)
    edit(t)
    save_file(t, f, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("edit,message", [
    (lambda t: t.pop("model.layers.2.block_sparse_moe.experts.3.w2.weight"), "missing tensors (1): "
     "model.layers.2.block_sparse_moe.experts.3.w2.weight"),
    (lambda t: t.update({"model.layers.0.block_sparse_moe.experts.4.w1.weight": torch.zeros(96, 64)}),
     "unexpected tensors, not mapped (1): model.layers.0.block_sparse_moe.experts.4.w1.weight"),
])
def test_missing_or_extra_tensors_are_refused(edit, message, models, tmp_path, capsys):
    src = _rewrite_tensors(models["mixtral"], tmp_path / "src", edit)
    assert convert_main(["hf-to-megatron", "--hf", str(src), "--out", str(tmp_path / "out")]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_corrupt_safetensors_file_is_refused(models, tmp_path, capsys):
    src = tmp_path / "src"
    shutil.copytree(models["qwen2"], src)
    f = src / "model.safetensors"
    f.write_bytes(f.read_bytes()[:1000])
    assert convert_main(["hf-to-megatron", "--hf", str(src), "--out", str(tmp_path / "out")]) == 2
    assert "not a readable safetensors file" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_layout_that_does_not_fit_is_refused(models, tmp_path, capsys):
    out = tmp_path / "out"
    assert convert_main(["hf-to-megatron", "--hf", str(models["llama"]), "--out", str(out), "--tp", "3"]) == 2
    assert "target layout TP=3" in capsys.readouterr().err and not out.exists()


def test_existing_output_is_kept_unless_overwrite(models, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "precious.txt").write_text("keep me")
    args = ["hf-to-megatron", "--hf", str(models["llama"]), "--out", str(out)]
    assert convert_main(args) == 2
    assert "already exists; pass --overwrite" in capsys.readouterr().err
    assert (out / "precious.txt").read_text() == "keep me"
    assert convert_main(args + ["--overwrite"]) == 0
    assert not (out / "precious.txt").exists() and (out / "latest").read_text().strip() == "iter_0000000"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary directory left
    record = json.loads((out / "conversion.json").read_text())
    assert record["layout"] == {"tp": 1, "pp": 1, "vpp": None, "ep": 1}
    assert record["source"] == str(models["llama"].resolve())


def test_checkpoint_without_model_config_needs_one(converted, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted["llama"], ckpt)
    common_file = ckpt / "iter_0000000" / "common.pt"
    common = torch.load(common_file, weights_only=False)
    del common["common"]["model_config"]
    torch.save(common, common_file)
    args = ["megatron-to-hf", "--megatron", str(ckpt), "--out", str(tmp_path / "hf")]
    assert convert_main(args) == 2
    assert "--model-config" in capsys.readouterr().err
    assert convert_main(args + ["--model-config", str(ckpt / "model" / "llama.yaml")]) == 0


@pytest.mark.slow
def test_command_line_with_verify(models, tmp_path):
    """The documented command, end to end in a subprocess, with --verify at TP=2 + PP=2."""
    out = tmp_path / "m"
    r = subprocess.run(
        [sys.executable, "-m", "gridwright.adapters.convert", "hf-to-megatron", "--hf", str(models["llama"]),
         "--out", str(out), "--tp", "2", "--pp", "2", "--verify"],
        capture_output=True, text=True, timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert "verify: max |logit diff|" in r.stdout and "(ok," in r.stdout
    assert json.loads((out / "conversion.json").read_text())["layout"]["pp"] == 2


# --- atomic output ---------------------------------------------------------------------


def test_staged_directory_leaves_nothing_on_error_and_keeps_a_late_arrival(tmp_path):
    from gridwright.basics.atomic_io import staged_directory

    final = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with staged_directory(final) as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise RuntimeError("killed mid-write")
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(FileExistsError, match="appeared while it was being written"):
        with staged_directory(final) as tmp:
            (tmp / "new.bin").write_bytes(b"new")
            final.mkdir()
            (final / "theirs.txt").write_text("someone else's")
    assert [p.name for p in tmp_path.iterdir()] == ["out"] and (final / "theirs.txt").exists()
    with staged_directory(final, overwrite=True) as tmp:
        (tmp / "new.bin").write_bytes(b"new")
    assert [p.name for p in final.iterdir()] == ["new.bin"] and [p.name for p in tmp_path.iterdir()] == ["out"]
    umask = os.umask(0)
    os.umask(umask)
    assert final.stat().st_mode & 0o777 == 0o777 & ~umask  # the umask's permissions, not mkdtemp's 0700


def test_failure_mid_write_leaves_no_output(tmp_path):
    """An error while tensors stream (after planning passed) surfaces as itself, and the
    half-written checkpoint is removed."""
    from gridwright.adapters.megatron_files import Slice, write_checkpoint
    from gridwright.basics.atomic_io import staged_directory

    slices = [Slice("a", (0,), (4,), (4,), torch.float32), Slice("b", (0,), (4,), (4,), torch.float32)]

    def produce(i):
        if i == 1:
            raise ValueError("tensor b is unreadable")
        return torch.ones(4)

    with pytest.raises(ValueError, match="tensor b is unreadable"):
        with staged_directory(tmp_path / "out") as tmp:
            write_checkpoint(tmp, slices, produce, {})
    assert list(tmp_path.iterdir()) == []


def test_corrupt_megatron_checkpoint_is_refused(converted, tmp_path, capsys):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(converted["llama"], ckpt)
    (ckpt / "iter_0000000" / ".metadata").write_bytes(b"not a pickle")
    assert convert_main(["megatron-to-hf", "--megatron", str(ckpt), "--out", str(tmp_path / "hf")]) == 2
    assert "is not a readable Megatron-Core checkpoint" in capsys.readouterr().err
    assert not (tmp_path / "hf").exists()
