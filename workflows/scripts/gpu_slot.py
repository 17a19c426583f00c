"""Run a command on a GPU no other job of this workflow holds.

    python workflows/scripts/gpu_slot.py LOCK_DIR -- qerl train ...

Snakemake counts GPUs (`--resources gpu=4` lets four GPU jobs run at once) but does not say
which GPU a job gets, so without this every job would land on the first one. Each visible
GPU (CUDA_VISIBLE_DEVICES if set, else every GPU nvidia-smi lists) has a lock file in
LOCK_DIR; the command runs with CUDA_VISIBLE_DEVICES set to the GPU whose lock it took, and
the lock goes when the command ends, however it ends. With no GPU free it waits. With no GPU
at all the command runs as it is (the CPU configurations). Exits with the command's status.
"""

from __future__ import annotations

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


def take(lock_dir: Path, gpus: list[str]):
    """(gpu, open lock file) for the first GPU free, waiting while none is."""
    lock_dir.mkdir(parents=True, exist_ok=True)
    while True:
        for gpu in gpus:
            handle = (lock_dir / f"gpu{gpu}.lock").open("w")
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                handle.close()
                continue
            return gpu, handle
        time.sleep(WAIT_S)


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print(__doc__, file=sys.stderr)
        return 2
    lock_dir, command = Path(argv[0]), argv[2:]
    gpus = visible_gpus()
    if not gpus:
        return subprocess.run(command).returncode
    gpu, handle = take(lock_dir, gpus)
    with handle:  # the lock is released when the file closes
        return subprocess.run(command, env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu}
                              ).returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
