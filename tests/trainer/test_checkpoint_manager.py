"""Driver-side checkpoints: atomic saves, rotation, verl's resume modes, stale and incomplete folders."""

import json
import logging
import os
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from meshrl.trainer.checkpoint import (
    COMPLETE_MARKER,
    DRIVER_STATE_JSON,
    LATEST_FILE,
    CheckpointError,
    CheckpointManager,
    parts_to_keep,
    pruned_parts,
)

DEAD_PID = 2**31 - 1  # above any pid_max: never a live process


def write_actor(text):
    def write_parts(folder):
        (folder / "actor").mkdir()
        (folder / "actor" / "model.pt").write_text(text)

    return write_parts


def state(step):
    return {"step": step, "sampler": {"epoch": 0, "offset": 8 * step}, "kl_ctrl": {"value": 0.001},
            "rng": {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state()}}


def leftovers(root):
    return sorted(p.name for p in root.iterdir() if ".tmp-" in p.name)


def test_save_writes_layout_and_state_round_trips(tmp_path):
    manager = CheckpointManager(tmp_path)
    saved = state(3)
    path = manager.save(3, saved, write_actor("weights"))
    assert path == tmp_path / "global_step_3"
    assert (path / "actor" / "model.pt").read_text() == "weights"
    marker = json.loads((path / COMPLETE_MARKER).read_text())
    assert marker["step"] == 3 and marker["files"]["actor/model.pt"] == len("weights")  # what damaged_files compares
    assert set(marker["files"]) == {"actor/model.pt", "trainer_state.pt", DRIVER_STATE_JSON}
    assert (tmp_path / LATEST_FILE).read_text() == "3\n"
    view = json.loads((path / DRIVER_STATE_JSON).read_text())
    assert view["sampler"] == {"epoch": 0, "offset": 24} and view["rng"]["torch"].startswith("<Tensor")
    loaded = manager.load_driver_state(path)
    assert loaded["sampler"] == saved["sampler"]
    assert loaded["rng"]["python"] == saved["rng"]["python"]
    assert np.array_equal(loaded["rng"]["numpy"][1], saved["rng"]["numpy"][1])
    assert torch.equal(loaded["rng"]["torch"], saved["rng"]["torch"])
    assert leftovers(tmp_path) == []


def test_failure_inside_write_parts_leaves_previous_checkpoint_and_latest(tmp_path):
    manager = CheckpointManager(tmp_path)
    manager.save(1, state(1), write_actor("one"))

    def crash(folder):
        write_actor("half")(folder)
        raise RuntimeError("worker died while saving")

    with pytest.raises(RuntimeError, match="worker died"):
        manager.save(2, state(2), crash)
    assert not (tmp_path / "global_step_2").exists()
    assert leftovers(tmp_path) == []
    assert (tmp_path / LATEST_FILE).read_text() == "1\n"
    assert manager.latest() == tmp_path / "global_step_1"
    assert (manager.latest() / "actor" / "model.pt").read_text() == "one"
    assert manager.load_driver_state(manager.latest())["step"] == 1


def test_a_refused_part_keeps_the_last_good_checkpoint_and_names_it(tmp_path):
    """A worker refusing its part (weights holding NaN: ``meshrl.parallel.checkpoint``) under
    max_actor_ckpt_to_keep=1: nothing is marked complete or rotated away, and the error names the latest."""
    manager = CheckpointManager(tmp_path, {"actor": 1})
    manager.save(1, state(1), write_actor("one"))

    def refuse(folder):
        raise FloatingPointError("refusing to save step 2 of the actor: 1 weight tensor(s) hold NaN or inf")

    with pytest.raises(FloatingPointError) as info:
        manager.save(2, state(2), refuse)
    assert info.value.__notes__ == [f"checkpoint {tmp_path / 'global_step_2'} was not saved; the latest checkpoint "
                                    f"is still {tmp_path / 'global_step_1'}"]
    assert manager.checkpoints() == [tmp_path / "global_step_1"] and leftovers(tmp_path) == []
    assert manager.latest() == tmp_path / "global_step_1" and not pruned_parts(manager.latest())


class Controller:
    """Picklable, but not plain data: weights_only loading refuses it."""


def test_state_the_resume_could_not_load_fails_the_save(tmp_path):
    class Local:
        pass

    manager = CheckpointManager(tmp_path)
    with pytest.raises(CheckpointError, match=r"Controller.*state_dict\(\)"):
        manager.save(1, {"step": 1, "controller": Controller()}, write_actor("w"))
    with pytest.raises(CheckpointError, match=r"cannot save the driver state.*Local"):
        manager.save(1, {"step": 1, "controller": Local()}, write_actor("w"))
    assert list(tmp_path.iterdir()) == []


def test_keep_last_rotation(tmp_path):
    (tmp_path / "global_step_0").mkdir()  # incomplete: neither counted nor deleted
    manager = CheckpointManager(tmp_path, keep={"actor": 2, "critic": 1})  # the critic part never appears
    for step in (1, 2, 3, 4):
        manager.save(step, state(step), write_actor(str(step)))
    assert [p.name for p in manager.checkpoints()] == ["global_step_3", "global_step_4"]
    assert (tmp_path / "global_step_0").is_dir()
    assert leftovers(tmp_path) == []
    keep_all = CheckpointManager(tmp_path / "all", keep={"actor": None, "critic": 0})
    for step in (1, 2, 3):
        keep_all.save(step, state(step), write_actor(str(step)))
    assert len(keep_all.checkpoints()) == 3
    with pytest.raises(ValueError, match="max_actor_ckpt_to_keep"):
        CheckpointManager(tmp_path, keep={"actor": -1})


def write_actor_and_critic(folder):
    for part in ("actor", "critic"):
        (folder / part).mkdir()
        (folder / part / "model.pt").write_text(part)


@pytest.mark.parametrize("actor, critic", [(3, 1), (1, 2)])
def test_actor_and_critic_keep_their_own_counts(tmp_path, actor, critic):
    """verl's max_actor_ckpt_to_keep / max_critic_ckpt_to_keep each bound their own part; a checkpoint that
    lost a part cannot resume the run, and one with no part left is deleted."""
    manager = CheckpointManager(tmp_path, parts_to_keep(SimpleNamespace(max_actor_ckpt_to_keep=actor,
                                                                        max_critic_ckpt_to_keep=critic)))
    for step in (1, 2, 3, 4):
        manager.save(step, state(step), write_actor_and_critic)
    holding = {part: [p.name for p in manager.checkpoints() if (p / part).is_dir()] for part in ("actor", "critic")}
    assert holding == {"actor": [f"global_step_{s}" for s in range(5 - actor, 5)],
                       "critic": [f"global_step_{s}" for s in range(5 - critic, 5)]}
    assert [p.name for p in manager.checkpoints()] == [f"global_step_{s}" for s in range(5 - max(actor, critic), 5)]
    assert leftovers(tmp_path) == []
    partial = tmp_path / "global_step_3"
    missing = "critic" if critic < actor else "actor"
    assert pruned_parts(partial) == [missing]
    with pytest.raises(CheckpointError, match=rf"no longer holds its {missing} part \(removed by "
                                              rf"trainer.max_{missing}_ckpt_to_keep\).*global_step_4"):
        manager.resolve("resume_path", partial)
    (tmp_path / LATEST_FILE).unlink()  # without the pointer, the newest whole checkpoint is found
    assert manager.resolve("auto") == tmp_path / "global_step_4"


def test_resaving_an_existing_step_replaces_it_and_moves_latest(tmp_path):
    manager = CheckpointManager(tmp_path, keep={"actor": 3})
    for step in (1, 2, 3):
        manager.save(step, state(step), write_actor(f"old {step}"))
    manager.save(2, state(2), write_actor("new 2"))  # a run resumed from step 1 reaches step 2 again
    assert (tmp_path / "global_step_2" / "actor" / "model.pt").read_text() == "new 2"
    assert manager.latest() == tmp_path / "global_step_2"  # the newest write, not the highest step
    assert leftovers(tmp_path) == []


def test_resume_modes(tmp_path):
    manager = CheckpointManager(tmp_path / "ckpt")
    assert manager.resolve("auto") is None  # nothing yet: train from scratch
    first = manager.save(5, state(5), write_actor("5"))
    second = manager.save(10, state(10), write_actor("10"))
    assert manager.resolve("auto") == second
    assert manager.resolve("disable") is None
    assert manager.resolve("resume_path", str(first)) == first
    with pytest.raises(CheckpointError, match="global_step_7 does not exist"):
        manager.resolve("resume_path", tmp_path / "ckpt" / "global_step_7")
    with pytest.raises(CheckpointError, match="did you mean .*global_step_10"):
        manager.resolve("resume_path", tmp_path / "ckpt")
    with pytest.raises(ValueError, match="resume_from_path"):
        manager.resolve("resume_path", None)
    with pytest.raises(ValueError, match="auto, disable, resume_path"):
        manager.resolve("resume")


def test_incomplete_checkpoint_is_refused(tmp_path, caplog):
    manager = CheckpointManager(tmp_path)
    manager.save(1, state(1), write_actor("1"))
    second = manager.save(2, state(2), write_actor("2"))
    (second / COMPLETE_MARKER).unlink()  # e.g. a partial copy
    with pytest.raises(CheckpointError, match=r"global_step_2 is incomplete \(missing COMPLETE\)"):
        manager.resolve("resume_path", second)
    with pytest.raises(CheckpointError, match="global_step_2 is incomplete"):
        manager.load_driver_state(second)
    with caplog.at_level(logging.WARNING):
        assert manager.resolve("auto") == tmp_path / "global_step_1"
    assert "global_step_2" in caplog.text and "not a complete checkpoint" in caplog.text


def test_stale_temporaries_are_removed_at_start(tmp_path):
    stale = tmp_path / f"global_step_4.tmp-{DEAD_PID}"
    (stale / "actor").mkdir(parents=True)
    (stale / "actor" / "model.pt").write_text("half")
    (tmp_path / f"{LATEST_FILE}.tmp-{DEAD_PID}").write_text("4\n")
    (tmp_path / f"global_step_2.tmp-{DEAD_PID}-deleting").mkdir()
    live = tmp_path / f"global_step_5.tmp-{os.getppid()}"  # a live process other than this one
    live.mkdir()
    unrelated = tmp_path / f"metrics.jsonl.tmp-{DEAD_PID}"  # not the manager's to remove
    unrelated.write_text("")
    manager = CheckpointManager(tmp_path)
    assert leftovers(tmp_path) == sorted([live.name, unrelated.name])
    assert manager.latest() is None
