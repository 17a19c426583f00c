# Shared by every rule file: where things go, which model is which, side environments.
from pathlib import Path

WORK = config.get("work_dir", "work")  # intermediate files (models, runs, tool outputs)
RESULTS = config.get("results_dir", "results")
MODELS = config["models"]  # name -> directory, hub id, .gguf file or a packaged GGUF name
PACKAGED_GGUF = {"smollm2-135m-instruct"}


def needs_export(model):
    """lm-eval and lighteval read Hugging Face models: a GGUF is exported to BF16 first."""
    source = str(MODELS[model])
    return source.endswith(".gguf") or source in PACKAGED_GGUF


def hf_model(model):
    return f"{WORK}/models/{model}/bf16" if needs_export(model) else MODELS[model]


def env_bin(name):
    """The bin/ folder of a side environment (prebuilt in the image, else made by side_env)."""
    return config.get("envs", {}).get(name, f".venvs/{name}/bin")


def env_marker(name):
    """What a rule waits for before using an environment: its python, once it exists."""
    return f"{env_bin(name)}/python"


rule side_env:
    """A side environment from workflows/envs/NAME.txt (every version pinned)."""
    input: "workflows/envs/{name}.txt"
    output: ".venvs/{name}/bin/python"
    log: f"{WORK}/logs/side_env/{{name}}.log"
    shell:
        "(python3 -m venv .venvs/{wildcards.name} && "
        ".venvs/{wildcards.name}/bin/pip install -r {input}) > {log} 2>&1"


rule export_bf16:
    """A BF16 Hugging Face copy of a GGUF model, for the external evaluators."""
    output: directory(f"{WORK}/models/{{model}}/bf16")
    params: source=lambda w: MODELS[w.model]
    log: f"{WORK}/logs/export_bf16/{{model}}.log"
    resources: mem_mb=16000
    shell: "qerl export --model {params.source} --out {output} > {log} 2>&1"
