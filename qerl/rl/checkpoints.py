"""Training checkpoints that cannot look complete unless they are: transformers saves each
checkpoint-N into ``output_dir/.staging/``, then it gets a manifest of every file's size and
SHA-256 and is renamed into place. Resuming takes the newest checkpoint whose files match
their manifest (damaged later: a full disk, a bad copy), moves newer damaged ones aside into
``damaged/`` (never deleting a user's files) and says which file was wrong. Checkpoints
written before manifests existed count as whole when their trainer_state.json (transformers
writes it last) reads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
from collections.abc import Callable
from pathlib import Path

from qerl.errors import QerlError

MANIFEST = "manifest.json"
DAMAGED = "damaged"
STAGING = ".staging"
log = logging.getLogger(__name__)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(checkpoint: Path) -> None:
    files = {p.relative_to(checkpoint).as_posix(): {"bytes": p.stat().st_size,
                                                    "sha256": _sha256(p)}
             for p in sorted(checkpoint.rglob("*")) if p.is_file() and p.name != MANIFEST}
    tmp = checkpoint / f".{MANIFEST}.tmp"
    tmp.write_text(json.dumps({"files": files}, indent=1, sort_keys=True))
    os.replace(tmp, checkpoint / MANIFEST)


def problem(checkpoint: Path) -> str | None:
    """What is wrong with ``checkpoint`` (None: it is whole)."""
    manifest = checkpoint / MANIFEST
    if not manifest.is_file():
        try:
            json.loads((checkpoint / "trainer_state.json").read_text())
        except (OSError, ValueError):
            return ("no manifest and no readable trainer_state.json: interrupted while "
                    "being saved")
        return None
    try:
        files = json.loads(manifest.read_text())["files"]
    except (OSError, ValueError, KeyError):
        return f"{MANIFEST} is unreadable"
    for name, want in files.items():
        path = checkpoint / name
        if not path.is_file():
            return f"{name} is missing"
        size = path.stat().st_size
        if size != want["bytes"]:
            return (f"{name} has {size} bytes, its manifest says {want['bytes']} (cut short: "
                    "a crash or a full disk while saving, or changed since)")
        if _sha256(path) != want["sha256"]:
            return f"{name} does not match its manifest's SHA-256 (corrupted or changed since)"
    return None


def _step(checkpoint: Path) -> int | None:
    tail = checkpoint.name.split("-")[-1]
    return int(tail) if checkpoint.name.startswith("checkpoint-") and tail.isdigit() else None


def last_checkpoint(output_dir: Path, set_aside: bool = True) -> Path | None:
    """The newest whole checkpoint-N in ``output_dir``; damaged ones newer than it are moved
    into ``output_dir/damaged/`` with a warning naming the file (``set_aside``: the one
    process of a run that writes). If there are checkpoints and none is whole, QerlError
    says which file is damaged and what to do."""
    found = sorted((p for p in output_dir.glob("checkpoint-*")
                    if p.is_dir() and _step(p) is not None), key=_step, reverse=True)
    damaged = []
    for checkpoint in found:
        why = problem(checkpoint)
        if why is None:
            for bad, bad_why in damaged if set_aside else ():
                _set_aside(bad, f"not resuming from it: {bad_why}")
            return checkpoint
        damaged.append((checkpoint, why))
    if damaged:
        detail = "; ".join(f"{c.name}: {why}" for c, why in damaged)
        raise QerlError(f"{output_dir} holds checkpoints but none is whole ({detail}). Move "
                        f"them out of {output_dir} to start the run over, or restore the "
                        "damaged files from a copy")
    return None


def _set_aside(checkpoint: Path, reason: str) -> None:
    aside = checkpoint.parent / DAMAGED / checkpoint.name
    n = 1
    while aside.exists():
        aside = checkpoint.parent / DAMAGED / f"{checkpoint.name}.{n}"
        n += 1
    aside.parent.mkdir(exist_ok=True)
    checkpoint.rename(aside)
    log.warning("%s: %s; moved it to %s", checkpoint, reason, aside)


def save_staged(trainer, trial, save: Callable[[], None]) -> None:
    """Run transformers' checkpoint save ``save`` into ``output_dir/.staging/``, then (once
    every process has written its files: each saves its own RNG state) write the manifest
    and rename the checkpoint into place, rotating as transformers would."""
    from transformers.trainer import rotate_checkpoints

    run_dir = Path(trainer._get_output_dir(trial=trial))
    name = f"checkpoint-{trainer.state.global_step}"
    staging = run_dir / STAGING
    main = trainer.is_world_process_zero()
    if main:
        shutil.rmtree(staging, ignore_errors=True)  # what a killed save left (ours alone)
    _barrier()
    trainer._get_output_dir = lambda trial=None: str(staging)  # shadows the method
    try:
        save()
    finally:
        del trainer._get_output_dir
    _barrier()
    if main:
        write_manifest(staging / name)
        if (run_dir / name).exists():  # the step saved again after a resume
            _set_aside(run_dir / name, "replaced by a new save of its step")
        (staging / name).rename(run_dir / name)
        staging.rmdir()
        rotate_checkpoints(output_dir=str(run_dir), save_total_limit=trainer.args.save_total_limit,
                           best_model_checkpoint=trainer.state.best_model_checkpoint,
                           use_mtime=True)
    _barrier()


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
