"""The workflow's shell commands keep every value from the configuration whole: a path or a
setting that holds a space or a ``;`` reaches qerl as one argument, and runs nothing else."""

from __future__ import annotations

import os
import shlex
import subprocess

from tests.test_workflow import ROOT, config, shell_commands, snakemake

# A qerl that records its arguments, one a line, and writes what the rule copies out of
# its output_dir.
FAKE_QERL = """#!/bin/sh
printf '%s\\n' "$@" > "$QERL_ARGS"
for arg in "$@"; do
  case "$arg" in output_dir=*) dir="${arg#output_dir=}"; mkdir -p "$dir"
    touch "$dir/metrics.csv" "$dir/config.yaml" "$dir/provenance.json";; esac
done
"""


def test_train_commands_quote_every_value_from_the_configuration(tmp_path):
    odd = tmp_path / "a b;touch pwned"  # a space, and a command after a ;
    smoke = config("smoke")
    smoke |= {"work_dir": str(odd / "work"), "results_dir": str(odd / "results")}
    smoke["train"]["set"] = {**smoke["train"]["set"], "data.path": f"{odd}/my data.jsonl"}
    done = snakemake("train_all", "-n", "-p", "--forceall", config=smoke, tmp=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    command = next(c for c in shell_commands(done) if "qerl train" in c and "method=lora" in c)
    command = command.removeprefix("Shell command:").strip()

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "qerl").write_text(FAKE_QERL)
    (bin_dir / "qerl").chmod(0o755)
    logs = odd / "work/logs/train/tiny/arithmetic"
    results = odd / "results/train/tiny/arithmetic/lora"
    logs.mkdir(parents=True)
    results.mkdir(parents=True)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "QERL_ARGS": str(tmp_path / "args")}
    ran = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=60)
    assert ran.returncode == 0, ran.stderr
    args = (tmp_path / "args").read_text().splitlines()
    assert f"data.path={odd}/my data.jsonl" in args
    assert f"output_dir={odd}/work/runs/tiny/arithmetic/lora" in args
    assert "rl.mask_truncated_completions=False" in args  # values as YAML writes them
    assert args[:2] == ["train", "--config"] and (ROOT / args[2]).is_file()
    assert not list(tmp_path.rglob("pwned*"))  # nothing after a ; ran
    assert (results / "metrics.csv").is_file()  # the copy reached the results folder
    assert shlex.split(command)  # and the line is well-formed for a shell reader

