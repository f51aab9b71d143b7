"""meshrl.atomic_io: temp name beside the target, fsync, rename, fsync the folder; a failure keeps the old version."""

import os

import pytest

from meshrl import atomic_io


def test_write_text_atomically_replaces_and_fsyncs_file_then_folder(tmp_path, monkeypatch):
    target = tmp_path / "latest"
    target.write_text("old")
    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(atomic_io.os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                           real_fsync(fd)))
    atomic_io.write_text_atomically(target, "new")
    assert target.read_text() == "new"
    assert synced == [str(tmp_path / f"latest.tmp-{os.getpid()}"), str(tmp_path)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest"]


def test_write_text_atomically_refuses_a_temporary_elsewhere(tmp_path):
    (tmp_path / "sub").mkdir()
    with pytest.raises(ValueError, match="must be in the folder"):
        atomic_io.write_text_atomically(tmp_path / "latest", "x", tmp=tmp_path / "sub" / "latest.tmp")


def test_publish_dir_creates_and_replaces(tmp_path):
    for version in ("one", "two"):
        tmp = tmp_path / "step.tmp"
        (tmp / "shard").mkdir(parents=True)
        (tmp / "shard" / "weights").write_text(version)
        atomic_io.publish_dir(tmp, tmp_path / "step", aside=tmp_path / "step.aside")
        assert (tmp_path / "step" / "shard" / "weights").read_text() == version
        assert sorted(p.name for p in tmp_path.iterdir()) == ["step"]


def test_publish_dir_fsyncs_the_whole_tree_before_the_rename(tmp_path, monkeypatch):
    tmp = tmp_path / "new.tmp"
    (tmp / "a").mkdir(parents=True)
    (tmp / "a" / "f").write_text("x")
    events = []
    real_fsync, real_replace = os.fsync, os.replace
    monkeypatch.setattr(atomic_io.os, "fsync", lambda fd: (events.append(os.readlink(f"/proc/self/fd/{fd}")),
                                                           real_fsync(fd)))
    monkeypatch.setattr(atomic_io.os, "replace", lambda a, b: (events.append("rename"), real_replace(a, b)))
    atomic_io.publish_dir(tmp, tmp_path / "new", aside=tmp_path / "new.aside")
    assert events == [str(tmp / "a" / "f"), str(tmp / "a"), str(tmp), "rename", str(tmp_path)]


def test_a_failed_rename_leaves_the_previous_version(tmp_path, monkeypatch):
    final = tmp_path / "latest"
    final.write_text("old")

    def crash(*_args):
        raise OSError("disk gone")

    monkeypatch.setattr(atomic_io.os, "replace", crash)
    with pytest.raises(OSError, match="disk gone"):
        atomic_io.write_text_atomically(final, "new")
    assert final.read_text() == "old"



def _writer(text: str, log: list):
    def build(tmp):
        log.append(text)
        tmp.mkdir()
        (tmp / "weights").write_text(text)
    return build


def test_cached_dir_builds_once_and_keeps_the_entry_a_reader_holds(tmp_path):
    """A complete entry is returned as it is: neither rebuilt nor replaced under a reader."""
    log = []
    final = atomic_io.cached_dir(tmp_path / "model", "weights", _writer("first", log))
    reading = (final / "weights").open()
    assert atomic_io.cached_dir(tmp_path / "model", "weights", _writer("second", log)) == final
    assert log == ["first"] and reading.read() == "first" and (final / "weights").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "model.lock"]


def test_cached_dir_waits_for_the_builder_holding_the_lock(tmp_path):
    """Two processes asking at once (the ranks of a launch): the second waits for the first's build and then finds
    the entry complete, building nothing and removing nothing."""
    import fcntl
    import threading

    log, final = [], tmp_path / "model"
    lock = open(tmp_path / "model.lock", "a")
    fcntl.flock(lock, fcntl.LOCK_EX)  # another process building
    waiter = threading.Thread(target=atomic_io.cached_dir, args=(final, "weights", _writer("second", log)))
    waiter.start()
    waiter.join(0.5)
    assert waiter.is_alive() and log == []  # it waits
    _writer("first", [])(tmp_path / "model")  # the other process publishes, then releases
    lock.close()
    waiter.join(10)
    assert log == [] and (final / "weights").read_text() == "first"


def test_cached_dir_replaces_an_incomplete_entry_and_cleans_up_a_failed_build(tmp_path):
    final = tmp_path / "model"
    final.mkdir()
    (final / "config.json").write_text("{}")  # an interrupted writer's folder: no weights

    def failing(tmp):
        tmp.mkdir()
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_io.cached_dir(final, "weights", failing)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model", "model.lock"]
    atomic_io.cached_dir(final, "weights", _writer("new", []))
    assert sorted(p.name for p in final.iterdir()) == ["weights"] and (final / "weights").read_text() == "new"


def test_cached_dir_refuses_a_build_that_wrote_no_complete_file(tmp_path):
    """A builder that wrote less than it should (transformers' save_pretrained on a torch.distributed rank other
    than 0 writes no weights) is an error, not a cache entry other processes would then read."""
    def tokenizer_only(tmp):
        tmp.mkdir()
        (tmp / "tokenizer.json").write_text("{}")

    with pytest.raises(RuntimeError, match="wrote no weights"):
        atomic_io.cached_dir(tmp_path / "model", "weights", tokenizer_only)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.lock"]

