"""The Snakemake workflow, without running it (CI runs the smoke configuration end to end):
each configuration's dry run lists its jobs, bad configurations fail before any job, and
the lint finds nothing but what we chose to accept."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).parents[1]
SNAKEMAKE = shutil.which("snakemake") or str(Path(sys.executable).parent / "snakemake")
# Accepted lints: the image (Dockerfile) is the environment of every rule, and small input
# functions live beside the rules that use them.
ACCEPTED = ("Specify a conda environment or container", "Mixed rules and functions",
            "Absolute path", "is a prefix of input or output file but hardcoded")


def snakemake(*args, config: dict | None = None, tmp: Path | None = None,
              env: dict | None = None):
    """Snakemake in the repository, with ``config`` (written under ``tmp``) and the
    environment changed by ``env`` (a None value unsets that variable)."""
    command = [SNAKEMAKE, *args]
    if config is not None:
        path = tmp / "config.yaml"
        path.write_text(yaml.safe_dump(config))
        command += ["--configfile", str(path)]
    environment = {k: v for k, v in {**os.environ, **(env or {})}.items() if v is not None}
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300,
                          env=environment)


def shell_commands(done) -> list[str]:
    """The shell commands a dry run with -p printed."""
    return [line for line in (done.stdout + done.stderr).splitlines()
            if line.startswith("Shell command:")]


def job_counts(output: str) -> dict[str, int]:
    lines = output.split("Job stats:")[1].splitlines()[3:]
    counts = {}
    for line in lines:
        parts = line.split()
        if len(parts) != 2 or not parts[1].isdigit():
            break
        counts[parts[0]] = int(parts[1])
    return counts


def config(name: str) -> dict:
    return yaml.safe_load((ROOT / "workflows" / "config" / f"{name}.yaml").read_text())


@pytest.mark.parametrize("name, expected", [
    ("smoke", {"export_bf16": 1, "quantize": 1, "train": 4, "eval_trained": 4,
               "eval_base": 2, "report": 1}),
    ("gpu", {"quantize": 1, "train": 3, "eval_trained": 3, "eval_base": 2,
             "lm_eval_gsm8k": 1, "lighteval_math": 1, "base_eval_summary": 1, "bench": 6,
             "science_train": None}),  # the study is a configuration of its own
    # 4 methods x 2 learning rates, and LoRA at qerl's higher rate on the BF16 weights, on
    # the NVFP4 ones dequantized and on noised ones, and qerl with TIS, x 3 seeds, each with
    # its held-out evaluation; the entropy study; on top of gpu's model and data.
    ("gpu science", {"science_train": 36, "science_held_out": 36, "science_entropy": 1,
                     "nvfp4_dequantized": 1, "nvfp4_noised": 1}),
    # The paper's DAG at two random shapes: 2 models x 2 recipes x 3 methods, and a full
    # fine-tune (3B GSM8K); five benchmarks from local files; base evaluations at 3B.
    ("rehearsal", {"export_bf16": 2, "quantize": 2, "train": 13, "eval_trained": 13,
                   "eval_base": 4, "lm_eval_gsm8k": 1, "lighteval_math": 1, "bench": 5,
                   "report": 1}),
    # 4 models x 2 recipes x 4 methods, less the 7 full fine-tunes the paper did not run.
    ("paper", {"quantize": 4, "train": 25, "eval_trained": 25, "eval_base": 8,
               "lm_eval_gsm8k": 4, "lighteval_math": 4, "side_env": 2, "bench": 5}),
])
def test_each_configuration_lists_its_jobs(name, expected):
    files = [f"workflows/config/{part}.yaml" for part in name.split()]
    done = snakemake("-n", "--forceall", "--configfile", *files)
    assert done.returncode == 0, done.stderr[-3000:]
    counts = job_counts(done.stdout + done.stderr)
    assert {job: counts.get(job) for job in expected} == expected


def test_a_recipes_own_settings_reach_its_runs_only():
    done = snakemake("-n", "-p", "--forceall", "--configfile",
                     "workflows/config/rehearsal.yaml", "--",
                     "results/rehearsal/train/qwen2.5-3b/bigmath/lora/metrics.csv",
                     "results/rehearsal/train/qwen2.5-3b/gsm8k/lora/metrics.csv")
    assert done.returncode == 0, done.stderr[-3000:]
    commands = [line for line in (done.stdout + done.stderr).splitlines()
                if "qerl train" in line]
    bigmath, gsm8k = (next(c for c in commands if f"/{r}/lora" in c) for r in ("bigmath", "gsm8k"))
    assert "--set data.path=tests/data/dapo_math_17k_head200.jsonl" in bigmath
    assert "--set data.path=tests/data/gsm8k_train_head200.jsonl" in gsm8k
    assert "dapo" not in gsm8k and "--set train.max_steps=2" in gsm8k


def test_the_rehearsal_shares_its_gpu_but_times_alone():
    """Two jobs a GPU (gpu_jobs: 2); benchmarks and full fine-tuning take the whole GPU; the
    base evaluations cap their generations and run without network."""
    done = snakemake("-n", "-p", "--forceall", "--configfile", "workflows/config/rehearsal.yaml")
    assert done.returncode == 0, done.stderr[-3000:]
    commands = [line for line in shell_commands(done) if "gpu_slot.py" in line]
    whole = [line for line in commands if "--share 2 --whole --" in line]
    shared = [line for line in commands if "--share 2 -- " in line]
    assert len(whole) + len(shared) == len(commands)
    assert {line.split(" -- ")[1].split()[:3][1] for line in whole} == {"bench", "train"}
    assert all("--set method=full" in line for line in whole if " qerl train " in line)
    assert sum(" qerl train " in line for line in whole) == 1  # 3B's full fine-tune
    lm_eval = next(line for line in shared if "lm_eval run" in line)
    assert "--gen_kwargs max_gen_toks=64" in lm_eval and "--batch_size 8" in lm_eval
    assert any("workflows/scripts/lighteval_offline.py accelerate" in line for line in shared)


def test_a_method_trained_again_on_vllm_runs_beside_the_engines_run(tmp_path):
    """train.vllm_methods: qerl a second time as qerl-vllm, with vLLM's rollouts and qerl's
    own base and learning rate, on a GPU of its own, evaluated as qerl; the report reads it."""
    rehearsal = config("rehearsal")
    rehearsal["train"] = {**rehearsal["train"], "vllm_methods": ["qerl"]}
    done = snakemake("-n", "-p", "--forceall", config=rehearsal, tmp=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    commands = shell_commands(done)
    train = [c for c in commands if " qerl train " in c]
    assert sum("--set engine.backend=vllm" in c for c in train) == 4  # 2 models x 2 recipes
    (vllm,) = [c for c in train if "qwen2.5-3b/gsm8k/qerl-vllm " in c]
    (engine,) = [c for c in train if "qwen2.5-3b/gsm8k/qerl " in c]
    assert "--set engine.backend=vllm" in vllm and "engine.backend" not in engine
    assert "--share 2 --whole --" in vllm and "--set method=qerl " in vllm
    assert "/runs/qwen2.5-3b/gsm8k/qerl-vllm " in vllm
    for same in ("--set model=", "--set train.learning_rate="):
        assert vllm.split(same)[1].split()[0] == engine.split(same)[1].split()[0]
    (evaluation,) = [c for c in commands
                     if " qerl eval " in c and "qwen2.5-3b/gsm8k/qerl-vllm/final" in c]
    assert "--method qerl " in evaluation
    report = (done.stdout + done.stderr).split("rule report:")[1]
    assert "train/qwen2.5-3b/gsm8k/qerl-vllm/metrics.csv" in report.split("output:")[0]


def stand_in_nvidia_smi(tmp: Path) -> Path:
    """An nvidia-smi that lists two GPUs, as `-L` and as the workflow's query print them."""
    smi = tmp / "bin" / "nvidia-smi"
    smi.parent.mkdir()
    smi.write_text('#!/bin/sh\nif [ "$1" = -L ]; then\n'
                   "  echo 'GPU 0: Stand-in (UUID: GPU-aaa)'\n"
                   "  echo 'GPU 1: Stand-in (UUID: GPU-bbb)'\n"
                   "else echo '0, GPU-aaa, Stand-in'; echo '1, GPU-bbb, Stand-in'; fi\n")
    smi.chmod(0o755)
    return smi


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU is visible")
def test_the_local_profile_runs_the_gpu_configuration_on_one_gpu(tmp_path):
    """The profile's documented command with gpu.yaml passes the slots check (its GPU
    slots match gpu.yaml's gpu_jobs) and runs a job."""
    smi = stand_in_nvidia_smi(tmp_path)
    gpu = {**config("gpu"), "work_dir": str(tmp_path / "work"),
           "results_dir": str(tmp_path / "results")}
    target = tmp_path / "work/eval/lighteval-data/aime24/train.jsonl"
    done = snakemake(str(target), "--profile", "workflows/profiles/local", config=gpu,
                     tmp=tmp_path, env={"PATH": f"{smi.parent}:{os.environ['PATH']}",
                                        "CUDA_VISIBLE_DEVICES": "0"})
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    assert target.read_text() == (ROOT / "tests/data/aime24_test.jsonl").read_text()


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU is visible")
def test_shared_gpus_need_the_slots_to_match(tmp_path):
    """gpu_jobs: 2 with --resources gpu=1 could never start a benchmark: it says so before
    any job (on a machine a stand-in nvidia-smi says has GPUs, whichever
    CUDA_VISIBLE_DEVICES leaves; MIG instances it cannot map leave them all)."""
    smi = stand_in_nvidia_smi(tmp_path)
    gpu = {**config("gpu"), "gpu_jobs": 2, "work_dir": str(tmp_path / "work"),
           "results_dir": str(tmp_path / "results")}
    for visible in (None, "1", "GPU-bbb", "MIG-ccc"):  # a GPU left visible: the slots check
        done = snakemake("--cores", "1", "--resources", "gpu=1", config=gpu, tmp=tmp_path,
                         env={"PATH": f"{smi.parent}:{os.environ['PATH']}",
                              "CUDA_VISIBLE_DEVICES": visible})
        assert done.returncode != 0
        assert "pass --resources gpu=2 per GPU" in done.stdout + done.stderr, visible
        assert not (tmp_path / "work").exists()  # no job started


def test_one_target_reruns_alone():
    done = snakemake("-n", "--forceall", "work/smoke/results/eval/tiny/base/nvfp4/summary.csv")
    counts = job_counts(done.stdout + done.stderr)
    assert done.returncode == 0 and set(counts) <= {"export_bf16", "quantize", "eval_base",
                                                    "total"}



def test_the_gpu_configuration_asks_for_memory_a_gpu_host_has():
    """Three jobs a GPU at once: their requests fit a 128 GB host (one H100's)."""
    done = snakemake("-n", "--forceall", "--configfile", "workflows/config/gpu.yaml")
    asked = [int(m) for m in re.findall(r"mem_mb=(\d+)", done.stdout + done.stderr)]
    assert asked and max(asked) * config("gpu")["gpu_jobs"] <= 96_000


def test_the_smoke_run_asks_for_memory_a_small_machine_has():
    done = snakemake("-n", "--forceall")
    asked = [int(m) for m in re.findall(r"mem_mb=(\d+)", done.stdout + done.stderr)]
    assert asked and max(asked) <= 4000  # CI's machine has 24 GiB


def test_side_environments_install_from_a_wheelhouse_without_an_index(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    done = snakemake("-n", "-p", "--forceall", ".venvs/lm-eval/bin/python",
                     config={**config("gpu"), "wheelhouse": str(wheels)}, tmp=tmp_path)
    assert done.returncode == 0, done.stderr[-2000:]
    torch = version("torch").split("+")[0]  # the sets leave torch out: this environment's
    assert (f"pip install --no-index --find-links {wheels} -r workflows/envs/lm-eval.txt "
            f"torch=={torch}") in done.stdout + done.stderr
    missing = snakemake("-n", config={**config("smoke"), "wheelhouse": str(tmp_path / "no")},
                        tmp=tmp_path)
    assert missing.returncode != 0 and "is not a folder" in missing.stdout + missing.stderr

@pytest.mark.parametrize("change, message", [
    (lambda c: c.pop("models"), "'models' is a required property"),
    (lambda c: c.update(device="tpu"), "'tpu' is not one of"),
    (lambda c: c["train"].update(method=["qerl"]), "Additional properties"),
    (lambda c: c.update(models={"m": "./no/such/model"}), "does not exist"),
    (lambda c: c["train"].update(models=["other"]), "train.models names 'other'"),
    (lambda c: c.update(tokenizers={}), "random weights need tokenizers.tiny"),
    (lambda c: c["train"].update(recipe_set={"arithmtic": {}}),
     "train.recipe_set names 'arithmtic', which is not in train.recipes"),
    (lambda c: c.update(bench={"kernel": ""}),
     "bench names ['kernel'], which the bench rule does not run"),
])
def test_bad_configurations_fail_before_any_job(tmp_path, change, message):
    bad = config("smoke")  # a whole configuration: given files replace smoke.yaml
    change(bad)
    done = snakemake("-n", config=bad, tmp=tmp_path)
    assert done.returncode != 0
    assert message in done.stdout + done.stderr
    assert "$schema" not in done.stdout + done.stderr  # the problem, not the schema


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU is visible")
@pytest.mark.parametrize("visible", ["", "7", "GPU-zzz"])
def test_gpus_hidden_by_cuda_visible_devices_are_not_used(tmp_path, visible):
    """The run uses (and run.json names) the GPUs CUDA_VISIBLE_DEVICES leaves, not every
    GPU nvidia-smi lists: with none left, the run fails before any job."""
    smi = stand_in_nvidia_smi(tmp_path)
    gpu = {**config("gpu"), "work_dir": str(tmp_path / "work"),
           "results_dir": str(tmp_path / "results")}
    done = snakemake("--cores", "1", config=gpu, tmp=tmp_path,
                     env={"PATH": f"{smi.parent}:{os.environ['PATH']}",
                          "CUDA_VISIBLE_DEVICES": visible})
    assert done.returncode != 0
    assert "none is visible here" in done.stdout + done.stderr
    assert not (tmp_path / "work").exists()


@pytest.mark.skipif(shutil.which("nvidia-smi") is not None, reason="a GPU is visible")
def test_a_gpu_configuration_without_a_gpu_fails_at_once(tmp_path):
    gpu = {**config("gpu"), "work_dir": str(tmp_path / "work"),
           "results_dir": str(tmp_path / "results")}
    done = snakemake("--cores", "1", config=gpu, tmp=tmp_path)
    assert done.returncode != 0
    assert "none is visible here" in done.stdout + done.stderr
    assert not (tmp_path / "work").exists()  # no job started


def test_a_checkout_the_installed_qerl_was_not_built_from_is_refused(tmp_path):
    """Jobs run the installed qerl and label their rows with the checkout's commit: a
    checkout whose qerl/ differs from the installed one (here by one comment) fails before
    any job, naming both, and the same copy with the installed source runs."""
    shutil.copy(ROOT / "Snakefile", tmp_path)
    shutil.copytree(ROOT / "workflows", tmp_path / "workflows")
    shutil.copytree(ROOT / "qerl", tmp_path / "qerl", symlinks=False,
                    ignore=shutil.ignore_patterns("__pycache__"))

    def dry_run():
        return subprocess.run([SNAKEMAKE, "-n"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)

    assert dry_run().returncode == 0
    with (tmp_path / "qerl" / "record.py").open("a") as f:
        f.write("# a change the installed qerl lacks\n")
    done = dry_run()
    said = done.stdout + done.stderr
    assert done.returncode != 0
    assert "is not this checkout's" in said
    assert str(tmp_path / "qerl") in said and "pip install --no-deps ." in said


def test_lint_finds_only_accepted_lints():
    done = snakemake("--lint")  # text: this version ignores --lint=json
    found, where = [], None
    for line in (done.stdout + done.stderr).splitlines():
        if line.startswith("Lints for "):
            where = line.removeprefix("Lints for ").rstrip(":")
        elif line.startswith("    * ") and not any(ok in line for ok in ACCEPTED):
            found.append(f"{where}: {line[6:]}")
    assert not found, "\n".join(found)


def gpu_job(tmp: Path, name: str, visible: str | None, seconds: float = 0.0,
            status: int = 0, share: int = 1, whole: bool = False) -> subprocess.Popen:
    """A job through gpu_slot.py that writes the GPU it was given."""
    env = {k: v for k, v in os.environ.items() if k != "CUDA_VISIBLE_DEVICES"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    body = (f"import os, sys, time; open({str(tmp / name)!r}, 'w').write("
            f"os.environ.get('CUDA_VISIBLE_DEVICES', '-')); time.sleep({seconds}); "
            f"sys.exit({status})")
    return subprocess.Popen([sys.executable, str(ROOT / "workflows/scripts/gpu_slot.py"),
                             str(tmp / "locks"), "--share", str(share),
                             *(["--whole"] if whole else []), "--", sys.executable, "-c", body],
                            env=env)


def test_gpu_jobs_share_a_gpu_up_to_its_slots_and_whole_jobs_wait_for_all(tmp_path):
    two = [gpu_job(tmp_path, f"job{i}", "4", seconds=1.5, share=2) for i in range(2)]
    time.sleep(0.5)
    whole = gpu_job(tmp_path, "whole", "4", share=2, whole=True)  # waits for both slots
    time.sleep(0.5)
    assert (tmp_path / "job0").exists() and (tmp_path / "job1").exists()
    assert not (tmp_path / "whole").exists()
    after = gpu_job(tmp_path, "after", "4", seconds=0.0, share=2)
    assert [job.wait() for job in (*two, whole, after)] == [0, 0, 0, 0]
    assert (tmp_path / "whole").read_text() == "4"


def test_gpu_jobs_each_take_a_gpu_no_other_job_holds(tmp_path):
    first = [gpu_job(tmp_path, f"job{i}", "3,5", seconds=1.5) for i in range(2)]
    time.sleep(0.5)
    third = gpu_job(tmp_path, "job2", "3,5")  # both GPUs held: it waits for one
    time.sleep(0.5)
    assert not (tmp_path / "job2").exists()
    assert [job.wait() for job in (*first, third)] == [0, 0, 0]
    given = [(tmp_path / f"job{i}").read_text() for i in range(3)]
    assert sorted(given[:2]) == ["3", "5"] and given[2] in ("3", "5")
    assert gpu_job(tmp_path, "failed", "3", status=7).wait() == 7  # the command's status
    assert gpu_job(tmp_path, "cpu", "").wait() == 0  # no GPU: runs as it is
    assert (tmp_path / "cpu").read_text() == ""


def test_gpu_jobs_of_a_gpu_configuration_go_through_the_gpu_slot():
    """Every GPU job of the gpu configuration takes its own GPU; the study's held-out check
    is the arithmetic task's held-out draw."""
    done = snakemake("-n", "-p", "--forceall", "--configfile", "workflows/config/gpu.yaml",
                     "workflows/config/science.yaml", "--", "science_all")
    commands = shell_commands(done)
    assert done.returncode == 0 and commands
    assert all("gpu_slot.py" in line for line in commands if " qerl " in line)
    held_out = [line for line in commands if " qerl eval " in line]
    assert held_out and all("--bench arithmetic-1,arithmetic-2 --limit 500" in line
                            for line in held_out)
    # The controls: their starts, and a variant's own settings.
    train = {variant: line for line in commands if " qerl train " in line
             for variant in re.findall(r"/science/[^/]+/([^/]+)/seed0 ", line)}
    models = "--set model=work/gpu/models/smollm2-135m-instruct"
    assert f"{models}/nvfp4-dequantized --set method=lora " in train["lora-nvfp4-start"]
    assert f"{models}/nvfp4-noised --set method=lora " in train["lora-noised-start"]
    assert "--set rl.tis=True" in train["qerl-10x-tis"]
    assert "rl.tis" not in train["qerl-10x"]
    smoke = snakemake("-n", "-p", "--forceall")
    assert "gpu_slot.py" not in smoke.stdout + smoke.stderr  # CPU configurations run as is


def test_the_one_gpu_configurations_base_evaluations_batch_their_generations():
    """lm-eval's "auto" batch probes with full-length generations first, and lighteval's
    default batch of 8 takes ~60 rounds of 1024 tokens for MATH500: the gpu configuration
    sets both, so that its whole run stays near half an hour."""
    done = snakemake("-n", "-p", "--forceall", "--configfile", "workflows/config/gpu.yaml",
                     "--", "base_eval_all")
    commands = shell_commands(done)
    lm_eval = [line for line in commands if "lm_eval run" in line]
    lighteval = [line for line in commands if "lighteval_offline.py accelerate" in line]
    assert done.returncode == 0 and lm_eval and lighteval
    settings = config("gpu")["base_eval"]
    assert all(f"--batch_size {settings['batch_size']}" in line for line in lm_eval)
    # through the environment's python, the file the rule checks (not a console script)
    assert all(".venvs/lm-eval/bin/python -m lm_eval run" in line for line in lm_eval)
    assert all(f"batch_size={settings['batch_size_lighteval']}," in line for line in lighteval)
    # lm-eval's GSM8K keeps its own 256-token cap above which max_tokens (1024) would go
    assert settings["max_tokens"] > 256 and not any("max_gen_toks" in line for line in lm_eval)
    # Every lighteval task reads the repository's copy (a task without one goes to the hub).
    copies = [line for line in commands if "lighteval_data" in line or "lighteval-data/" in line]
    for task in ("math_500", "aime24", "aime25"):
        assert any(f"lighteval-data/{task}/" in line for line in copies), task


def test_a_benchmark_that_runs_on_the_cpu_holds_no_gpu():
    """The fidelity benchmark runs on the CPU wherever it is (it once held the GPU alone for
    four minutes of a GPU run); the others hold a GPU alone."""
    done = snakemake("-n", "-p", "--forceall", "--configfile", "workflows/config/gpu.yaml",
                     "--", "bench_all")
    commands = shell_commands(done)
    assert done.returncode == 0
    fidelity = [line for line in commands if "qerl bench fidelity" in line]
    timed = [line for line in commands if "qerl bench " in line and line not in fidelity]
    assert fidelity and timed
    assert all("gpu_slot.py" not in line for line in fidelity)
    assert all("gpu_slot.py" in line and "--whole" in line for line in timed)


def test_the_schema_names_the_methods_qerl_trains():
    """The schema (JSON Schema, read by Snakemake) lists the methods as qerl.methods does."""
    from qerl.methods import METHODS

    schema = yaml.safe_load((ROOT / "workflows/schemas/config.schema.yaml").read_text())
    train = schema["properties"]["train"]["properties"]["methods"]["items"]["enum"]
    variants = schema["properties"]["science"]["properties"]["variants"]
    assert train == list(METHODS)
    assert variants["additionalProperties"]["properties"]["method"]["enum"] == list(METHODS)


def test_lightevals_benchmark_download_fails_softly_offline(monkeypatch):
    """Offline, lighteval's import-time fetch of tinyBenchmarks.pkl gets the 503 lighteval
    already handles; any other request still raises. (lighteval itself is not in this
    environment: its own, workflows/envs/lighteval.txt, ran the wrapper offline.)"""
    import importlib.util

    import requests

    spec = importlib.util.spec_from_file_location(
        "lighteval_offline", ROOT / "workflows/scripts/lighteval_offline.py")
    offline = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(offline)
    asked = []

    def unreachable(url, *args, **kwargs):
        asked.append((url, kwargs))
        raise requests.ConnectionError(f"cannot resolve {url}")

    monkeypatch.setattr(offline, "_get", unreachable)
    pkl = offline.TINY_BENCHMARKS + "main/tinyBenchmarks/tinyBenchmarks.pkl"
    response = offline.get(pkl)
    assert response.status_code == 503 and response.url == pkl
    assert asked[-1][1]["timeout"] == 10  # a dead network costs seconds, not minutes
    with pytest.raises(requests.ConnectionError):
        offline.get("https://huggingface.co/api/datasets/x")
