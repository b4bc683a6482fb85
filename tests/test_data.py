"""Data: preparation into Megatron-Core's indexed format, training on it, and its checks."""
import json
import random

import pytest

from gridwright.data.prepare_data import main as prepare_main
from gridwright.data.prepare_data import prepare

WORDS = "the quick brown fox jumps over a lazy dog while seven wizards quietly hex jumbo packs".split()


def write_jsonl(path, n, seed=0):
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            f.write(json.dumps({"text": " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, 60)))}) + "\n")
    return path


def test_prepare_jsonl_and_text_round_trip(tmp_path):
    from megatron.core.datasets.indexed_dataset import IndexedDataset

    src = tmp_path / "a.jsonl"
    src.write_text('{"text": "hello"}\n{"text": "héllo wörld"}\n')
    info = prepare([src], tmp_path / "a", "byte")
    assert info["documents"] == 2 and info["tokens"] == 6 + len("héllo wörld".encode()) + 1
    ds = IndexedDataset(str(tmp_path / "a"))
    assert ds[0].tolist() == list(b"hello") + [256]
    assert bytes(ds[1][:-1].tolist()).decode() == "héllo wörld"

    txt = tmp_path / "b.txt"
    txt.write_text("first doc\nstill first\n\nsecond doc\n")
    assert prepare([txt], tmp_path / "b", "byte")["documents"] == 2


def test_prepare_refuses_overwrite_and_bad_input(tmp_path, capsys):
    src = write_jsonl(tmp_path / "a.jsonl", 3)
    assert prepare_main(["--input", str(src), "--output-prefix", str(tmp_path / "a")]) == 0
    before = (tmp_path / "a.bin").read_bytes()
    assert prepare_main(["--input", str(src), "--output-prefix", str(tmp_path / "a")]) == 2
    assert "never overwrites" in capsys.readouterr().err
    assert (tmp_path / "a.bin").read_bytes() == before

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok"}\n{"body": "no text key"}\n')
    assert prepare_main(["--input", str(bad), "--output-prefix", str(tmp_path / "bad")]) == 2
    assert "bad.jsonl:2: no key 'text'" in capsys.readouterr().err
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "ok"\n')
    assert prepare_main(["--input", str(broken), "--output-prefix", str(tmp_path / "broken")]) == 2
    assert "not valid JSON" in capsys.readouterr().err
    assert not list(tmp_path.glob("bad.*[bx]")) and not list(tmp_path.glob("*.tmp*"))


def test_prepare_with_a_local_hugging_face_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)] * 20, trainers.BpeTrainer(vocab_size=80, special_tokens=["<unk>", "</s>"]))
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path / "tok")
    src = write_jsonl(tmp_path / "a.jsonl", 5)
    info = prepare([src], tmp_path / "a", str(tmp_path / "tok"))
    assert info["eod"] == 1 and info["vocab_size"] <= 80 and info["documents"] == 5


@pytest.mark.slow
def test_train_on_blended_indexed_data_with_validation_and_exact_resume(run_launch, tmp_path):
    for name, seed in (("a", 0), ("b", 1)):
        prepare([write_jsonl(tmp_path / f"{name}.jsonl", 300, seed)], tmp_path / name, "byte")
    data = ["data.kind=indexed", f"data.paths=[{tmp_path / 'a'},{tmp_path / 'b'}]", "data.weights=[0.7,0.3]",
            "model.vocab_size=264", "data.eval_interval=4", "train.steps=8", "tracking=off"]

    def losses(job):
        rows = [json.loads(l) for l in (job / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: r for r in rows}

    ck = tmp_path / "ck"
    result = run_launch(*data, f"job_dir={tmp_path / 'full'}", f"checkpoint.save={ck}", "checkpoint.save_interval=4")
    assert result.returncode == 0, result.stderr[-4000:]
    full = losses(tmp_path / "full")
    assert full[7]["loss"] < full[0]["loss"] - 0.5
    assert full[3]["val_loss"] > full[7]["val_loss"]
    (ck / "latest").write_text("iter_0000004\n")
    result = run_launch(*data, f"job_dir={tmp_path / 'resumed'}", f"checkpoint.load={ck}")
    assert result.returncode == 0, result.stderr[-4000:]
    resumed = losses(tmp_path / "resumed")
    assert sorted(resumed) == [4, 5, 6, 7]
    for step in resumed:  # the data position is restored with the step
        assert resumed[step]["loss"] == pytest.approx(full[step]["loss"], abs=1e-6)


@pytest.mark.parametrize("overrides,expected", [
    (["model.vocab_size=256"], "larger than model.vocab_size=256"),
    (["data.split=99990/10/0"], "gets none"),
    (["data.weights=[1.0,2.0]"], "data.weights has 2 entries for 1 data.paths"),
])
def test_data_checks_before_start(compose, tmp_path, overrides, expected):
    from gridwright.validation.validate import ConfigError, validate

    prepare([write_jsonl(tmp_path / "a.jsonl", 50)], tmp_path / "a", "byte")
    cfg = compose("data.kind=indexed", f"data.paths=[{tmp_path / 'a'}]", "model.vocab_size=264", *overrides)
    with pytest.raises(ConfigError, match=expected):
        validate(cfg)


def test_missing_dataset_is_refused(compose, tmp_path):
    from gridwright.validation.validate import ConfigError, validate

    cfg = compose("data.kind=indexed", f"data.paths=[{tmp_path / 'nothing'}]")
    with pytest.raises(ConfigError, match="dataset files missing"):
        validate(cfg)
