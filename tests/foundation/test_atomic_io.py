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


def _built(folder, text: str):
    folder.mkdir()
    (folder / "weights").write_text(text)
    return folder


def test_publish_cached_dir_keeps_a_complete_entry_another_process_published(tmp_path):
    """Two builders of one cache entry (the ranks of a launch): the second's rename fails on the published folder,
    which stays as it is (a reader may hold it); its own copy is discarded."""
    final = tmp_path / "model"
    atomic_io.publish_cached_dir(_built(tmp_path / "model.tmp-1", "first"), final, final / "weights")
    reading = (final / "weights").open()
    atomic_io.publish_cached_dir(_built(tmp_path / "model.tmp-2", "second"), final, final / "weights")
    assert reading.read() == "first" and (final / "weights").read_text() == "first"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model"]


def test_publish_cached_dir_replaces_an_incomplete_entry(tmp_path):
    final = tmp_path / "model"
    final.mkdir()
    (final / "config.json").write_text("{}")  # an interrupted writer's folder: no weights
    atomic_io.publish_cached_dir(_built(tmp_path / "model.tmp-1", "new"), final, final / "weights")
    assert sorted(p.name for p in final.iterdir()) == ["weights"] and (final / "weights").read_text() == "new"


def test_publish_cached_dir_raises_when_the_rename_fails_with_nothing_published(tmp_path, monkeypatch):
    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(atomic_io.os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        atomic_io.publish_cached_dir(_built(tmp_path / "model.tmp-1", "x"), tmp_path / "model",
                                     tmp_path / "model" / "w")
    assert not (tmp_path / "model.tmp-1").exists()
