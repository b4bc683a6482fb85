"""The one rule for paths, on real links, FIFOs and devices: what each is called, and that
none is opened in a way that blocks, follows a link out or reads without end."""
from __future__ import annotations

import os

import pytest

from gridwright.basics.path_rules import (
    PathRefused,
    entry_problem,
    model_folder_file,
    open_regular,
    read_bounded_text,
    system_place,
    tree_problem,
    what_is,
)


@pytest.fixture
def root(tmp_path):
    r = tmp_path / "root"
    r.mkdir()
    (r / "file").write_text("iter_0000001\n")
    (r / "dir").mkdir()
    (tmp_path / "outside").write_text("not ours\n")
    (r / "link_out").symlink_to(tmp_path / "outside")
    os.mkfifo(r / "fifo")
    return r


def test_each_kind_of_entry_is_named(root):
    assert what_is(root / "file") == "a regular file"
    assert what_is(root / "dir") == "a directory"
    assert what_is(root / "fifo") == "a FIFO"
    assert what_is(root / "link_out") == f"a symbolic link to {root.parent / 'outside'}"
    assert what_is("/dev/null") == "a character device"
    assert what_is(root / "missing") == "nothing"


def test_only_regular_files_inside_the_root_pass(root):
    assert entry_problem(root / "file", root) is None
    assert entry_problem(root / "dir", root, "directory") is None
    assert "is a FIFO, not a regular file" in entry_problem(root / "fifo", root)
    assert "is a symbolic link to" in entry_problem(root / "link_out", root)
    assert tree_problem(root).startswith(f"{root / 'fifo'} is a FIFO")  # sorted: fifo before link_out


def test_opening_never_blocks_on_a_fifo_nor_follows_a_link(root):
    with pytest.raises(PathRefused, match="is a FIFO"):
        open_regular(root / "fifo")  # would block forever without O_NONBLOCK
    with pytest.raises(PathRefused, match="symbolic link"):
        open_regular(root / "link_out", os.O_RDWR | os.O_CREAT)
    assert (root.parent / "outside").read_text() == "not ours\n"
    os.close(open_regular(root / "file"))


def test_reads_are_bounded_by_what_the_file_must_hold(root, tmp_path):
    assert read_bounded_text(root / "file", 64, "an iteration's name") == "iter_0000001\n"
    (tmp_path / "big").write_bytes(b"x" * 65)
    with pytest.raises(PathRefused, match=r"is 65 bytes; an iteration's name takes at most 64"):
        read_bounded_text(tmp_path / "big", 64, "an iteration's name")
    with pytest.raises(PathRefused, match="character device"):
        read_bounded_text("/dev/zero", 64, "an iteration's name")  # would read until memory runs out


def test_system_directories_are_no_place_for_a_run(tmp_path):
    assert system_place("/") == "/ is the system directory /"
    assert system_place("/etc") and system_place("/proc/self") and system_place("/dev/shm")
    assert system_place(tmp_path) is None


def test_a_model_folder_reads_its_own_files_and_the_hub_caches_blobs(tmp_path):
    repo = tmp_path / "models--org--name"
    snapshot, blobs = repo / "snapshots" / "rev", repo / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    (blobs / "abc").write_text("{}")
    (snapshot / "config.json").symlink_to("../../blobs/abc")
    (tmp_path / "elsewhere.json").write_text("{}")
    (snapshot / "other.json").symlink_to(tmp_path / "elsewhere.json")
    assert model_folder_file(snapshot, "config.json") == snapshot / "config.json"
    with pytest.raises(PathRefused, match="symbolic link"):
        model_folder_file(snapshot, "other.json")
    for name in ("../elsewhere.json", "/etc/passwd", ".."):
        with pytest.raises(PathRefused, match="is not a file name of"):
            model_folder_file(snapshot, name)
