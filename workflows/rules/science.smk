# The small-scale study (config["science"]): policy entropy by weight format, and reward
# growth of each method over several seeds, identical but for the method (and the learning
# rate the paper recommends for it). Runs keep their checkpoints under WORK (resumable).
SCIENCE = config.get("science", {})


def science_targets():
    if not SCIENCE:
        return []
    model = SCIENCE["model"]
    runs = [f"{RESULTS}/science/{model}/{variant}/seed{seed}/metrics.csv"
            for variant in SCIENCE["variants"] for seed in SCIENCE["seeds"]]
    held_out = [path.replace("metrics.csv", "eval/summary.csv") for path in runs]
    return runs + held_out + [f"{RESULTS}/science/{model}/entropy"]


def science_variant(wildcards):
    return SCIENCE["variants"][wildcards.variant]


def science_model(wildcards):
    variant = science_variant(wildcards)
    if "base" in variant:  # a control's start: nvfp4-dequantized or nvfp4-noised
        return f"{WORK}/models/{wildcards.model}/{variant['base']}"
    return method_base(wildcards.model, variant["method"])


def science_model_input(wildcards):
    return made_here(science_model(wildcards))


def science_sets(wildcards):
    variant = science_variant(wildcards)
    sets = {"model": science_model(wildcards), "method": variant["method"],
            "seed": wildcards.seed, "device": DEVICE,
            "output_dir": f"{WORK}/science/{wildcards.model}/{wildcards.variant}/"
                          f"seed{wildcards.seed}",
            "train.learning_rate": variant["learning_rate"]}
    if "aqn" in variant:
        sets["aqn.enabled"] = variant["aqn"]
    sets |= variant.get("set", {})
    return set_options(sets)


def science_adapter_args(wildcards):
    variant = science_variant(wildcards)
    run = f"{WORK}/science/{wildcards.model}/{wildcards.variant}/seed{wildcards.seed}"
    return (f"--model {science_model(wildcards)} --adapter {run}/final "
            f"--method {variant['method']}")


def model_source(wildcards):
    return MODELS[wildcards.model]


rule nvfp4_dequantized:
    """The NVFP4 checkpoint's weights dequantized to BF16 (qerl export, merged layout):
    the function qerl starts from, without the 4-bit forward."""
    input: f"{WORK}/models/{{model}}/nvfp4"
    output: directory(f"{WORK}/models/{{model}}/nvfp4-dequantized")
    params: device=DEVICE, on_gpu=ON_GPU
    log: f"{WORK}/logs/nvfp4_dequantized/{{model}}.log"
    benchmark: f"{WORK}/benchmarks/nvfp4_dequantized/{{model}}.tsv"
    resources: gpu=USES_GPU, mem_mb=MEM_MB["medium"]
    shell:
        "{params.on_gpu}qerl export --model {input} --method qerl --layout merged "
        "--device {params.device} --out {output} > {log} 2>&1"


rule nvfp4_noised:
    """The BF16 model moved as far as NVFP4 moves it, by Gaussian noise with the norm of
    each quantized Linear's NVFP4 error (qerl export --perturb nvfp4-gaussian)."""
    input: base_model_input
    output: directory(f"{WORK}/models/{{model}}/nvfp4-noised")
    params: model=base_model_of, device=DEVICE, on_gpu=ON_GPU
    log: f"{WORK}/logs/nvfp4_noised/{{model}}.log"
    benchmark: f"{WORK}/benchmarks/nvfp4_noised/{{model}}.tsv"
    resources: gpu=USES_GPU, mem_mb=MEM_MB["medium"]
    shell:
        "{params.on_gpu}qerl export --model {params.model} --method full "
        "--perturb nvfp4-gaussian --seed 0 --device {params.device} --out {output} > {log} 2>&1"


rule science_train:
    input: science_model_input, recipe=SCIENCE.get("recipe", [])
    output: f"{RESULTS}/science/{{model}}/{{variant}}/seed{{seed}}/metrics.csv"
    params:
        on_gpu=ON_GPU,
        sets=science_sets,
        run=f"{WORK}/science/{{model}}/{{variant}}/seed{{seed}}",
    log: f"{WORK}/logs/science_train/{{model}}/{{variant}}/seed{{seed}}.log"
    benchmark: f"{WORK}/benchmarks/science_train/{{model}}/{{variant}}/seed{{seed}}.tsv"
    resources: gpu=USES_GPU, mem_mb=MEM_MB["medium"]
    shell:
        "{params.on_gpu}qerl train --config {input.recipe} {params.sets} > {log} 2>&1 && "
        "cp {params.run}/metrics.csv {params.run}/config.yaml {params.run}/provenance.json "
        "$(dirname {output})/"


def held_out_settings():
    held_out = SCIENCE.get("held_out", {"benches": ["arithmetic-1"], "problems": 500})
    data = [f"--data {bench}={DATA[bench]}" for bench in held_out["benches"]
            if DATA.get(bench)]
    return " ".join([f"--bench {','.join(held_out['benches'])} --limit {held_out['problems']}",
                     "--samples 4 --max-tokens 256 --batch 512", f"--device {DEVICE}",
                     *data])


rule science_held_out:
    """Held-out accuracy at the end, the adapter on its base (settings: science.held_out)."""
    input: science_model_input, f"{RESULTS}/science/{{model}}/{{variant}}/seed{{seed}}/metrics.csv"
    output: f"{RESULTS}/science/{{model}}/{{variant}}/seed{{seed}}/eval/summary.csv"
    params:
        on_gpu=ON_GPU,
        policy=science_adapter_args,
        settings=held_out_settings(),
        out=f"{WORK}/science/{{model}}/{{variant}}/seed{{seed}}/eval",
    log: f"{WORK}/logs/science_held_out/{{model}}/{{variant}}/seed{{seed}}.log"
    benchmark: f"{WORK}/benchmarks/science_held_out/{{model}}/{{variant}}/seed{{seed}}.tsv"
    resources: gpu=USES_GPU, mem_mb=MEM_MB["medium"]
    shell:
        "{params.on_gpu}qerl eval {params.policy} {params.settings} --out {params.out} > {log} 2>&1 && "
        "cp {params.out}/summary.csv $(dirname {output})/"


rule science_entropy:
    output: directory(f"{RESULTS}/science/{{model}}/entropy")
    params:
        on_gpu=ON_GPU,
        source=model_source,
        args=SCIENCE.get("entropy", ""),
        data=f"--data {DATA['gsm8k']}" if DATA.get("gsm8k") else "",
        device=DEVICE,
    log: f"{WORK}/logs/science_entropy/{{model}}.log"
    benchmark: f"{WORK}/benchmarks/science_entropy/{{model}}.tsv"
    resources: gpu=USES_GPU, mem_mb=MEM_MB["medium"]
    shell:
        "{params.on_gpu}qerl bench entropy --model {params.source} {params.data} {params.args} "
        "--device {params.device} --out-dir {output} > {log} 2>&1"
