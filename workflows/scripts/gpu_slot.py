"""Run a command on a GPU, sharing it with at most SHARE - 1 other jobs of this workflow.

    python workflows/scripts/gpu_slot.py LOCK_DIR [--share K [--whole]] -- qerl train ...

Snakemake counts GPU slots (`--resources gpu=N`: how many GPU jobs run at once) but does not
say which GPU a job gets, so without this every job would land on the first one. Each visible
GPU (CUDA_VISIBLE_DEVICES if set, else every GPU nvidia-smi lists) has SHARE slots (default
1: a GPU a job holds alone), a lock file each in LOCK_DIR; a job takes one slot, or with
--whole every slot of one GPU (timings, or a job that needs all its memory). The command runs
with CUDA_VISIBLE_DEVICES set to that GPU, and the locks go when it ends, however it ends.
With no slot free it waits. With no GPU at all the command runs as it is (the CPU
configurations). Exits with the command's status.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

WAIT_S = 2.0


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as CUDA_VISIBLE_DEVICES names them."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [g for g in visible.split(",") if g.strip()]
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    listed = subprocess.run([smi, "-L"], capture_output=True, text=True).stdout
    return [str(i) for i, line in enumerate(listed.splitlines()) if line.startswith("GPU ")]


def _lock(path: Path):
    """The open, locked file at path, or None where another process holds it."""
    handle = path.open("w")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.close()
        return None
    return handle


def _try(lock_dir: Path, gpu: str, share: int, whole: bool) -> list | None:
    """The locks of one free slot of gpu (every slot with whole), or None."""
    held = []
    for slot in range(share):
        handle = _lock(lock_dir / f"gpu{gpu}.{slot}.lock")
        if handle is not None:
            held.append(handle)
            if not whole:
                return held
        elif whole:
            break
    if whole and len(held) == share:
        return held
    for handle in held:
        handle.close()
    return None


def take(lock_dir: Path, gpus: list[str], share: int = 1, whole: bool = False):
    """(gpu, open lock files) for the first GPU with a free slot (all free, with whole),
    waiting while there is none."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    while True:
        for gpu in gpus:
            held = _try(lock_dir, gpu, share, whole)
            if held is not None:
                return gpu, held
        time.sleep(WAIT_S)


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print(__doc__, file=sys.stderr)
        return 2
    split = argv.index("--")
    parser = argparse.ArgumentParser(usage=__doc__)
    parser.add_argument("lock_dir", type=Path)
    parser.add_argument("--share", type=int, default=1)
    parser.add_argument("--whole", action="store_true")
    args = parser.parse_args(argv[:split])
    command = argv[split + 1:]
    if args.share < 1 or not command:
        parser.error("--share takes 1 or more, and a command follows --")
    gpus = visible_gpus()
    if not gpus:
        return subprocess.run(command).returncode
    gpu, held = take(args.lock_dir, gpus, args.share, args.whole)
    with contextlib.ExitStack() as stack:  # the locks go when their files close
        for handle in held:
            stack.enter_context(handle)
        return subprocess.run(command, env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
                              ).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
