# Shared by every rule file: where things go, which model is which, side environments, and
# the checks that make a bad configuration fail before any job runs.
import os
import shlex
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path

import jsonschema
import yaml
from snakemake.exceptions import WorkflowError

SCHEMA = "workflows/schemas/config.schema.yaml"


def _validate(config):
    """The configuration against its schema, a line per problem (key path: what is wrong),
    where Snakemake's own validate prints the whole schema."""
    schema = yaml.safe_load(Path(workflow.basedir, SCHEMA).read_text())
    problems = sorted(jsonschema.Draft202012Validator(schema).iter_errors(config),
                      key=lambda e: list(map(str, e.absolute_path)))
    if problems:
        lines = (f"  {'.'.join(map(str, e.absolute_path)) or '(top level)'}: {e.message}"
                 for e in problems)
        raise WorkflowError(f"the configuration does not fit {SCHEMA}:\n" + "\n".join(lines))


_validate(config)

WORK = config["work_dir"]  # intermediate files: models, runs (checkpoints), tool outputs
RESULTS = config["results_dir"]  # what the report reads
DEVICE = config["device"]
MODELS = config["models"]  # name -> directory, hub id, .gguf, packaged GGUF name or arch:NAME
DATA = config.get("data", {})  # benchmark or task -> local file (else the hub)
PACKAGED_GGUF = {"smollm2-135m-instruct"}
USES_GPU = int(DEVICE == "cuda")
# What a job asks for (Snakemake's mem_mb) by its weight: a model's quantization, training,
# evaluation or benchmark (large), its science or side-tool runs (medium), the rest (small).
# A configuration of small models says less (job_memory_mb), so that the requests fit the
# machine it runs on.
MEM_MB = {"large": 64000, "medium": 32000, "small": 16000, **config.get("job_memory_mb", {})}
# GPU jobs take one of a GPU's gpu_jobs slots (Snakemake counts slots, --resources gpu=N,
# but does not assign GPUs); timed and memory-hungry ones take all of a GPU's slots.
GPU_JOBS = config.get("gpu_jobs", 1)
_SLOT = (f"python workflows/scripts/gpu_slot.py {shlex.quote(f'{WORK}/gpu-locks')} "
         f"--share {GPU_JOBS}")
ON_GPU = f"{_SLOT} -- " if USES_GPU else ""
ON_WHOLE_GPU = f"{_SLOT} --whole -- " if USES_GPU else ""
WHOLE_GPU = USES_GPU * GPU_JOBS  # the slots such a job counts for


def _commit() -> str | None:
    """The checkout's commit, "-dirty" when tracked files differ from it. A copy without git
    (the Docker image leaves .git out) has the one it was built from in QERL_COMMIT, else
    None."""
    def git(*args):
        try:
            return subprocess.run(["git", "-C", workflow.basedir, *args], capture_output=True,
                                  text=True, timeout=60)
        except FileNotFoundError:  # no git installed
            return subprocess.CompletedProcess(args, 1)

    head = git("rev-parse", "HEAD")
    if head.returncode:
        return os.environ.get("QERL_COMMIT") or None
    dirty = git("status", "--porcelain", "--untracked-files=no").stdout.strip()
    return head.stdout.strip() + ("-dirty" if dirty else "")


def _shared_commit() -> str | None:
    """The commit, handed to every job too (qerl.record.provenance reads QERL_COMMIT): runs
    of two versions can differ by more than their seeds do."""
    commit = _commit()
    if commit:
        os.environ.update(QERL_COMMIT=commit)
    return commit


COMMIT = _shared_commit()


def _check_installed_qerl():
    """Jobs run the qerl installed beside Snakemake, and their rows carry this checkout's
    commit (COMMIT): an install older or newer than the checkout would put one version's
    numbers under another's name. Refused unless both hold the same source
    (qerl.record.source_digest); a copy of the workflow without qerl/ is not checked."""
    checkout = Path(workflow.basedir, "qerl")
    if not checkout.is_dir():
        return
    probe = ("import sys, qerl.record as r; "
             "print(r.source_digest(), r.source_digest(sys.argv[1]), r.__file__)")
    # From / so that the interpreter finds the installed package, not the checkout.
    done = subprocess.run([sys.executable, "-c", probe, str(checkout)], cwd="/",
                          capture_output=True, text=True, timeout=300)
    if done.returncode:
        raise WorkflowError(f"qerl is not importable by {sys.executable}, which runs the "
                            f"jobs: install it (pip install .)\n{done.stderr.strip()}")
    installed, here, where = done.stdout.split()
    if installed != here:
        raise WorkflowError(
            f"the installed qerl ({Path(where).parent}, source {installed}) is not this "
            f"checkout's ({checkout}, source {here}): its rows would be labelled with this "
            "checkout's commit. Install the checkout (pip install --no-deps .), or rebuild "
            "the image from it.")


_check_installed_qerl()


def _check_models():
    tokenizers = config.get("tokenizers", {})
    for name, source in MODELS.items():
        source = str(source)
        if source.startswith("arch:"):
            if not tokenizers.get(name):
                raise WorkflowError(f"model {name}: random weights need tokenizers.{name}")
            continue
        if source in PACKAGED_GGUF:
            continue
        local = source.startswith((".", "/", "~")) or source.endswith(".gguf")
        if local and not Path(source).expanduser().exists():
            raise WorkflowError(f"model {name}: {source} does not exist")
        if not local and source.count("/") != 1:
            raise WorkflowError(f"model {name}: {source!r} is neither a local path, a "
                                "hub id (org/name), a packaged GGUF name nor arch:NAME")


def gpu_names() -> list[str]:
    """The GPUs this run may use, by name: those nvidia-smi lists, narrowed to
    CUDA_VISIBLE_DEVICES where it names GPUs by index or UUID; none where nvidia-smi is
    missing or fails."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return []
    try:
        listed = subprocess.run([smi, "--query-gpu=index,uuid,name", "--format=csv,noheader"],
                                capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = [[field.strip() for field in line.split(",", 2)] for line in listed.splitlines()]
    gpus = [gpu for gpu in gpus if len(gpu) == 3 and gpu[2]]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    wanted = [name.strip() for name in (visible or "").split(",") if name.strip()]
    # MIG instances (MIG-...) are not in this list: with them, every GPU counts.
    if visible is not None and all(w.isdigit() or w.startswith("GPU-") for w in wanted):
        gpus = [gpu for gpu in gpus
                if any(w == gpu[0] or (w.startswith("GPU-") and gpu[1].startswith(w))
                       for w in wanted)]
    return [name for _, _, name in gpus]


def check_gpu():
    """A GPU configuration on a machine without one fails before its first job (onstart:
    real runs only), unless jobs run on other machines (a cluster executor)."""
    if DEVICE != "cuda" or not workflow.is_main_process:
        return
    plugin = workflow.executor_plugin
    if plugin is not None and plugin.name not in ("local", "touch"):
        return
    if not gpu_names():
        raise WorkflowError("this configuration runs on a CUDA GPU (device: cuda) and none is "
                            "visible here: use the smoke config, a GPU machine, or a cluster "
                            "profile (--profile workflows/profiles/slurm)")
    slots = workflow.global_resources.get("gpu")
    slots = getattr(slots, "value", slots)  # a Resource in Snakemake 9
    if GPU_JOBS > 1 and slots is not None and slots < GPU_JOBS:
        raise WorkflowError(f"gpu_jobs: {GPU_JOBS} jobs share a GPU, and --resources gpu={slots} "
                            f"counts fewer slots than one GPU has: pass --resources "
                            f"gpu={GPU_JOBS} per GPU (benchmarks take all of a GPU's slots)")


def _check_names():
    """Every model a stage names must be among `models`, every recipe among the recipes."""
    named = {"train.models": config.get("train", {}).get("models", []),
             "eval.base_models": config.get("eval", {}).get("base_models", []),
             "base_eval.models": config.get("base_eval", {}).get("models", []),
             "science.model": [config["science"]["model"]] if "science" in config else []}
    for where, names in named.items():
        for name in names:
            if name not in MODELS:
                raise WorkflowError(f"{where} names {name!r}, which is not in models "
                                    f"({', '.join(MODELS)})")
    train = config.get("train", {})
    recipes = train.get("recipes", {})
    for recipe in train.get("recipe_set", {}):
        if recipe not in recipes:
            raise WorkflowError(f"train.recipe_set names {recipe!r}, which is not in "
                                f"train.recipes ({', '.join(recipes)})")


_check_models()
_check_names()


def needs_export(model):
    """Random weights and GGUF files become a BF16 Hugging Face folder first: every tool
    downstream (qerl, lm-eval, lighteval) then reads the same thing."""
    source = str(MODELS[model])
    return source.startswith("arch:") or source.endswith(".gguf") or source in PACKAGED_GGUF


def base_model(model):
    """What tools read as the BF16 model: the exported folder or the configured source."""
    return f"{WORK}/models/{model}/bf16" if needs_export(model) else MODELS[model]


# A run named METHOD-vllm (train.vllm_methods) trains METHOD with vLLM's rollouts, beside
# the run of METHOD on the embedded engine: its curves and mismatch show next to that run's.
VLLM_RUN = "-vllm"


def run_method(run):
    """The qerl method a run trains: qerl-vllm trains qerl."""
    return run.removesuffix(VLLM_RUN)


def method_base(model, method):
    """What a method (or a run of it) trains on: qerl the NVFP4 checkpoint, the others the
    BF16 model."""
    return f"{WORK}/models/{model}/nvfp4" if run_method(method) == "qerl" else base_model(model)


def made_here(path):
    """``path`` as a job input if a rule makes it (under WORK), else nothing to wait for."""
    return [path] if path.startswith(f"{WORK}/") else []


def base_model_of(wildcards):
    return base_model(wildcards.model)


def base_model_input(wildcards):
    return [base_model(wildcards.model)] if needs_export(wildcards.model) else []


def export_args(wildcards):
    source = str(MODELS[wildcards.model])
    if source.startswith("arch:"):
        tokenizer = config["tokenizers"][wildcards.model]
        return f"--arch {source.removeprefix('arch:')} --tokenizer {tokenizer}"
    return f"--model {source}"


def env_bin(name):
    """The bin/ folder of a side environment (prebuilt in the image, else made by side_env)."""
    return config.get("envs", {}).get(name, f".venvs/{name}/bin")


def env_python(name):
    return f"{env_bin(name)}/python"


# Side environments install from a folder of wheels alone where there is no package index
# (config wheelhouse; fill it where an index is reachable: pip download -r FILE -d DIR).
WHEELHOUSE = config.get("wheelhouse")
if WHEELHOUSE and not Path(WHEELHOUSE).expanduser().is_dir():
    raise WorkflowError(f"wheelhouse {WHEELHOUSE} is not a folder")


def pip_source():
    return f"--no-index --find-links {shlex.quote(WHEELHOUSE)}" if WHEELHOUSE else ""


rule side_env:
    """A side environment from workflows/envs/NAME.txt (every version pinned but torch's) with
    the torch of this one: the sets leave torch to the installation, one torch for all."""
    input: "workflows/envs/{name}.txt"
    output: ".venvs/{name}/bin/python"
    log: f"{WORK}/logs/side_env/{{name}}.log"
    params: source=pip_source(), torch=f"torch=={version('torch').split('+')[0]}"
    shell:
        "(python3 -m venv .venvs/{wildcards.name} && .venvs/{wildcards.name}/bin/pip install "
        "{params.source} -r {input} {params.torch}) > {log} 2>&1"


rule export_bf16:
    """A BF16 Hugging Face folder of a GGUF model or of random weights (arch:NAME)."""
    output: directory(f"{WORK}/models/{{model}}/bf16")
    params: source=export_args, device=DEVICE, on_gpu=ON_GPU
    log: f"{WORK}/logs/export_bf16/{{model}}.log"
    benchmark: f"{WORK}/benchmarks/export_bf16/{{model}}.tsv"
    resources: mem_mb=MEM_MB["small"], gpu=USES_GPU
    shell: "{params.on_gpu}qerl export {params.source} --device {params.device} --out {output} > {log} 2>&1"
