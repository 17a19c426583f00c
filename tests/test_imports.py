"""What importing qerl does to the environment: the top-level kernels/ folder never stands in
for the PyPI package `kernels`, and bitsandbytes' optional-kernel notice stays out of logs."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str) -> subprocess.CompletedProcess:
    # From the repository's root, where `python -m qerl.cli` and Snakemake's jobs run.
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, check=True)


def test_the_kernels_folder_does_not_shadow_the_pypi_package():
    out = _run("import importlib.util as u; s = u.find_spec('kernels'); "
               "print(s is None or s.origin is None)")
    assert out.stdout.strip() == "True"  # absent, or at most a namespace portion
    assert _run("import qerl.kernels.nvfp4_layout").returncode == 0


def test_importing_peft_after_qerl_logs_no_optional_kernel_notice():
    out = _run("import qerl, peft")
    assert "kernels-community" not in out.stderr
