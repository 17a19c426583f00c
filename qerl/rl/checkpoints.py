"""Training checkpoints that cannot look complete unless they are: each checkpoint-N gets a
manifest of every file's size and SHA-256, written last and atomically once transformers
has saved it; resuming takes the newest checkpoint whose files match their manifest, moves
newer damaged ones aside into ``damaged/`` (never deleting a user's files) and says which
file was wrong. Checkpoints written before manifests existed count as whole when their
trainer_state.json (transformers writes it last) reads.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

from transformers import TrainerCallback

from qerl.errors import QerlError

MANIFEST = "manifest.json"
DAMAGED = "damaged"
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


def last_checkpoint(output_dir: Path) -> Path | None:
    """The newest whole checkpoint-N in ``output_dir``; damaged ones newer than it are moved
    into ``output_dir/damaged/`` with a warning naming the file. If there are checkpoints
    and none is whole, QerlError says which file is damaged and what to do."""
    found = sorted((p for p in output_dir.glob("checkpoint-*")
                    if p.is_dir() and _step(p) is not None), key=_step, reverse=True)
    damaged = []
    for checkpoint in found:
        why = problem(checkpoint)
        if why is None:
            for bad, bad_why in damaged:
                _set_aside(bad, bad_why)
            return checkpoint
        damaged.append((checkpoint, why))
    if damaged:
        detail = "; ".join(f"{c.name}: {why}" for c, why in damaged)
        raise QerlError(f"{output_dir} holds checkpoints but none is whole ({detail}). Move "
                        f"them out of {output_dir} to start the run over, or restore the "
                        "damaged files from a copy")
    return None


def _set_aside(checkpoint: Path, why: str) -> None:
    aside = checkpoint.parent / DAMAGED / checkpoint.name
    n = 1
    while aside.exists():
        aside = checkpoint.parent / DAMAGED / f"{checkpoint.name}.{n}"
        n += 1
    aside.parent.mkdir(exist_ok=True)
    checkpoint.rename(aside)
    log.warning("not resuming from %s: %s; moved it to %s", checkpoint, why, aside)


class Manifests(TrainerCallback):
    """Writes each checkpoint's manifest once transformers has saved it: in a distributed
    run after every process has written its files (each writes its own RNG state)."""

    def on_save(self, args, state, control, **kwargs):
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        if state.is_world_process_zero:
            write_manifest(Path(args.output_dir) / f"checkpoint-{state.global_step}")
