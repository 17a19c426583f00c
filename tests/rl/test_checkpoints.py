"""Checkpoints whose files do not match their manifest are never resumed from: the newest
whole one is, damaged newer ones are set aside (kept) with the file named, and a run with
no whole checkpoint says which file is damaged and what to do."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from qerl.errors import QerlError
from qerl.rl.checkpoints import (
    DAMAGED,
    MANIFEST,
    last_checkpoint,
    problem,
    save_staged,
    write_manifest,
)


def checkpoint(root, step: int, manifest: bool = True):
    path = root / f"checkpoint-{step}"
    (path / "sub").mkdir(parents=True)
    (path / "optimizer.pt").write_bytes(bytes(range(256)) * 8)
    (path / "sub" / "adapter.safetensors").write_bytes(b"weights")
    (path / "trainer_state.json").write_text(json.dumps({"global_step": step}))
    if manifest:
        write_manifest(path)
    return path


def test_a_whole_checkpoint_verifies_and_damage_is_named(tmp_path):
    ckpt = checkpoint(tmp_path, 1)
    assert problem(ckpt) is None
    assert sorted(json.loads((ckpt / MANIFEST).read_text())["files"]) == [
        "optimizer.pt", "sub/adapter.safetensors", "trainer_state.json"]
    opt = ckpt / "optimizer.pt"
    opt.write_bytes(opt.read_bytes()[:1024])  # cut to half
    assert problem(ckpt) == ("optimizer.pt has 1024 bytes, its manifest says 2048 (cut short:"
                             " a crash or a full disk while saving, or changed since)")
    opt.write_bytes(bytes(2048))  # same size, other bytes
    assert "optimizer.pt does not match its manifest's SHA-256" in problem(ckpt)
    opt.unlink()
    assert problem(ckpt) == "optimizer.pt is missing"
    (ckpt / MANIFEST).write_text("{")
    assert problem(ckpt) == f"{MANIFEST} is unreadable"


def test_resume_skips_damaged_checkpoints_and_keeps_them_aside(tmp_path, caplog):
    checkpoint(tmp_path, 1)
    for step in (2, 3):
        bad = checkpoint(tmp_path, step)
        (bad / "optimizer.pt").write_bytes(b"torn")
    (tmp_path / DAMAGED / "checkpoint-3").mkdir(parents=True)  # an earlier one set aside
    with caplog.at_level(logging.WARNING):
        assert last_checkpoint(tmp_path).name == "checkpoint-1"
    assert "not resuming from" in caplog.text and "optimizer.pt has 4 bytes" in caplog.text
    assert (tmp_path / DAMAGED / "checkpoint-2" / "optimizer.pt").read_bytes() == b"torn"
    assert (tmp_path / DAMAGED / "checkpoint-3.1" / "optimizer.pt").is_file()
    assert last_checkpoint(tmp_path).name == "checkpoint-1"  # again: nothing left to move


def test_only_the_writing_process_sets_checkpoints_aside(tmp_path):
    """Every process of a run looks for the checkpoint; one moves the damaged ones (two
    moving the same folder at once would fail)."""
    checkpoint(tmp_path, 1)
    (checkpoint(tmp_path, 2) / "optimizer.pt").write_bytes(b"torn")
    assert last_checkpoint(tmp_path, set_aside=False).name == "checkpoint-1"
    assert (tmp_path / "checkpoint-2").is_dir()
    assert last_checkpoint(tmp_path).name == "checkpoint-1"
    assert not (tmp_path / "checkpoint-2").exists()


def test_no_whole_checkpoint_names_the_file_and_the_fix(tmp_path):
    bad = checkpoint(tmp_path, 4)
    (bad / "sub" / "adapter.safetensors").write_bytes(b"w")
    with pytest.raises(QerlError, match=r"checkpoint-4: sub/adapter.safetensors has 1 bytes.*"
                                        r"Move them out of .* to start the run over"):
        last_checkpoint(tmp_path)
    assert bad.is_dir()  # a user's files are not touched


def test_checkpoints_from_before_manifests_count_by_their_state_file(tmp_path):
    checkpoint(tmp_path, 2, manifest=False)
    torn = checkpoint(tmp_path, 4, manifest=False)
    (torn / "trainer_state.json").write_text('{"global_st')
    assert last_checkpoint(tmp_path).name == "checkpoint-2"
    assert last_checkpoint(tmp_path / "none") is None


class FakeTrainer:
    """What save_staged reads of a transformers Trainer."""

    def __init__(self, run_dir, step: int):
        self.run_dir = run_dir
        self.state = type("State", (), {"global_step": step, "best_model_checkpoint": None})
        self.args = type("Args", (), {"save_total_limit": None})

    def _get_output_dir(self, trial=None):
        return str(self.run_dir)

    def is_world_process_zero(self):
        return True


def transformers_save(trainer, die: bool = False):
    """Writes checkpoint-N where transformers would, into _get_output_dir()."""
    def save():
        ckpt = Path(trainer._get_output_dir(trial=None)) / f"checkpoint-{trainer.state.global_step}"
        ckpt.mkdir(parents=True)
        (ckpt / "optimizer.pt").write_bytes(b"state")
        if die:
            raise KeyboardInterrupt  # killed while saving
        (ckpt / "trainer_state.json").write_text("{}")
    return save


def test_a_checkpoint_appears_only_whole(tmp_path):
    trainer = FakeTrainer(tmp_path, 3)
    with pytest.raises(KeyboardInterrupt):
        save_staged(trainer, None, transformers_save(trainer, die=True))
    assert not (tmp_path / "checkpoint-3").exists() and last_checkpoint(tmp_path) is None
    assert trainer._get_output_dir() == str(tmp_path)  # the trainer's own method again
    trainer.state.global_step = 2  # the rerun resumed from an earlier step
    save_staged(trainer, None, transformers_save(trainer))
    trainer.state.global_step = 3
    save_staged(trainer, None, transformers_save(trainer))
    ckpt = tmp_path / "checkpoint-3"
    assert problem(ckpt) is None and (ckpt / MANIFEST).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-2", "checkpoint-3"]
    save_staged(trainer, None, transformers_save(trainer))  # the same step saved again
    assert (tmp_path / DAMAGED / "checkpoint-3" / "optimizer.pt").is_file()
    assert problem(ckpt) is None
