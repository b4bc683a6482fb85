"""What validation checks of a prepared dataset before anything starts: its .bin holds the
bytes its .idx describes (the last sequence's pointer plus its length times the token size)."""
import shlex

import pytest

from gridwright.validation.validate import ConfigError, validate
from gridwright.data.data_source import expected_bin_bytes
from gridwright.data.prepare_data import dataset_info, main as prepare_main, prepare
from test_data import write_jsonl


@pytest.fixture
def dataset(tmp_path):
    """A real dataset made by prepare_data (byte tokenizer: 2-byte tokens), and the
    overrides that train on it."""
    prefix = tmp_path / "corpus"
    prepare([write_jsonl(tmp_path / "corpus.jsonl", 60)], prefix, "byte")
    return prefix, ["data.kind=indexed", f"data.paths=[{prefix}]", "model.vocab_size=264"]


def test_the_index_describes_the_bin_that_prepare_data_wrote(dataset):
    prefix, overrides = dataset
    size = (prefix.parent / "corpus.bin").stat().st_size
    assert expected_bin_bytes(str(prefix)) == size == dataset_info(prefix)["tokens"] * 2


def test_truncated_bin_is_refused_in_one_line_and_its_fix_remakes_it(compose, dataset):
    prefix, overrides = dataset
    validate(compose(*overrides))  # intact: valid
    bin_path = prefix.parent / "corpus.bin"
    size = bin_path.stat().st_size
    with open(bin_path, "r+b") as f:
        f.truncate(size - 7)
    with pytest.raises(ConfigError) as err:
        validate(compose(*overrides))
    (problem,) = err.value.problems
    source = prefix.parent / "corpus.jsonl"
    assert problem == (
        f"{prefix}.bin holds {size - 7:,} bytes, but {prefix}.idx describes {size:,}: the dataset is truncated. "
        f"Fix: rm {prefix}.bin {prefix}.idx {prefix}.json && python -m gridwright.data.prepare_data "
        f"--input {source} --output-prefix {prefix} --tokenizer byte")
    # The Fix, carried out as written, makes the dataset again and the experiment validates.
    remove, remake = problem.split("Fix: ", 1)[1].split(" && ")
    for path in shlex.split(remove)[1:]:
        (prefix.parent / path.rsplit("/", 1)[1]).unlink()
    assert shlex.split(remake)[:3] == ["python", "-m", "gridwright.data.prepare_data"]
    assert prepare_main(shlex.split(remake)[3:]) == 0
    assert bin_path.stat().st_size == size
    validate(compose(*overrides))


def test_bin_longer_than_its_index_is_refused(compose, dataset):
    prefix, overrides = dataset
    with open(prefix.parent / "corpus.bin", "ab") as f:
        f.write(b"\0" * 4)
    with pytest.raises(ConfigError, match=r"corpus\.idx describes [\d,]+: the dataset is not the one its index was "
                                          "written for. Fix: rm "):
        validate(compose(*overrides))


def test_damaged_index_is_refused_in_one_line(compose, dataset):
    prefix, overrides = dataset
    (prefix.parent / "corpus.idx").write_bytes(b"not an index at all, though long enough to hold a header")
    with pytest.raises(ConfigError) as err:
        validate(compose(*overrides))
    (problem,) = err.value.problems
    assert problem.startswith(f"{prefix}.idx is not a Megatron-Core index (header b'not an in'")


def test_other_launchers_do_not_read_the_files(compose, dataset):
    """A plan or a cluster job's files live where it runs: they are not measured here."""
    prefix, overrides = dataset
    with open(prefix.parent / "corpus.bin", "r+b") as f:
        f.truncate(10)
    validate(compose(*overrides, "launcher=plan"))
