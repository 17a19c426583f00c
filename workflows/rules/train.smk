# RL runs: model x method x recipe (config["train"]). A run's folder under WORK keeps its
# checkpoints: a rerun resumes from the last one (qerl train), so it is never an output that
# Snakemake would delete. What the report reads is copied to RESULTS.
TRAIN = config.get("train", {})


def policy_model(wildcards):
    return method_base(wildcards.model, wildcards.method)


def policy_model_input(wildcards):
    return made_here(policy_model(wildcards))


def recipe_file(wildcards):
    return TRAIN["recipes"][wildcards.recipe]


def set_options(sets: dict) -> str:
    """``--set KEY=VALUE`` for each setting, each quoted for the shell: a value or path in
    the configuration may hold a space or a ``;``."""
    return " ".join(f"--set {shlex.quote(f'{key}={value}')}" for key, value in sets.items())


def train_overrides(wildcards):
    """--set options: the model, method (and rollout backend), run folder, the method's
    learning rate and the configuration's own overrides (e.g. fewer steps in smoke), then
    the recipe's (e.g. its data from a local file)."""
    sets = {"model": policy_model(wildcards), "method": run_method(wildcards.method),
            "output_dir": f"{WORK}/runs/{wildcards.model}/{wildcards.recipe}/{wildcards.method}",
            "device": DEVICE, **TRAIN.get("set", {}),
            **TRAIN.get("recipe_set", {}).get(wildcards.recipe, {})}
    if wildcards.method.endswith(VLLM_RUN):
        sets["engine.backend"] = "vllm"
    rate = TRAIN.get("learning_rates", {}).get(run_method(wildcards.method))
    if rate is not None:
        sets["train.learning_rate"] = rate
    tokenizer = config.get("tokenizers", {}).get(wildcards.model)
    if tokenizer:
        sets["tokenizer"] = tokenizer
    return set_options(sets)


def alone(wildcards):
    """Full fine-tuning holds its GPU alone (its optimizer state alone fills most of one),
    and so does a run with vLLM's rollouts (vLLM takes a fixed share of the card's memory
    when it starts, whatever the jobs beside it hold)."""
    return wildcards.method == "full" or wildcards.method.endswith(VLLM_RUN)


rule train:
    input: policy_model_input, recipe=recipe_file
    output:
        metrics=f"{RESULTS}/train/{{model}}/{{recipe}}/{{method}}/metrics.csv",
        final=directory(f"{WORK}/runs/{{model}}/{{recipe}}/{{method}}/final"),
    params:
        on_gpu=lambda wildcards: ON_WHOLE_GPU if alone(wildcards) else ON_GPU,
        sets=train_overrides,
        run=f"{WORK}/runs/{{model}}/{{recipe}}/{{method}}",
    log: f"{WORK}/logs/train/{{model}}/{{recipe}}/{{method}}.log"
    benchmark: f"{WORK}/benchmarks/train/{{model}}/{{recipe}}/{{method}}.tsv"
    resources:
        gpu=lambda wildcards: WHOLE_GPU if alone(wildcards) else USES_GPU,
        mem_mb=MEM_MB["large"],
    shell:  # params.sets comes quoted; every path from the configuration is quoted (:q)
        "{params.on_gpu}qerl train --config {input.recipe:q} {params.sets} > {log:q} 2>&1 && "
        "cp {params.run:q}/metrics.csv {params.run:q}/config.yaml {params.run:q}/provenance.json "
        "\"$(dirname {output.metrics:q})/\""
