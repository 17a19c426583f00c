# qerl eval of every trained policy and of each base model (BF16 and NVFP4, no adapter).
# The eval folder under WORK keeps every sample: a rerun resumes it. Summaries -> RESULTS.
from qerl.eval.settings import BENCHES

EVAL = config.get("eval", {})


def eval_args():
    """The options the configuration sets; qerl eval's own defaults for the rest."""
    benches = EVAL.get("benches", BENCHES)
    args = [f"--bench {','.join(benches)}", f"--device {DEVICE}"]
    args += [f"--{option.replace('_', '-')} {EVAL[option]}"
             for option in ("samples", "max_tokens", "batch", "limit") if option in EVAL]
    args += [f"--data {bench}={DATA[bench]}" for bench in benches if DATA.get(bench)]
    return " ".join(args)


def trained_policy_args(wildcards):
    """A full fine-tune is a whole model; the other methods are an adapter on their base."""
    final = f"{WORK}/runs/{wildcards.model}/{wildcards.recipe}/{wildcards.method}/final"
    if wildcards.method == "full":
        return f"--model {final} --method full"
    return (f"--model {policy_model(wildcards)} --adapter {final} "
            f"--method {run_method(wildcards.method)}")


def tokenizer_arg(wildcards):
    tokenizer = config.get("tokenizers", {}).get(wildcards.model)
    return f"--tokenizer {tokenizer}" if tokenizer else ""


rule eval_trained:
    input:
        policy_model_input,
        final=f"{WORK}/runs/{{model}}/{{recipe}}/{{method}}/final",
    output: f"{RESULTS}/eval/{{model}}/{{recipe}}/{{method}}/summary.csv"
    params:
        on_gpu=ON_GPU,
        policy=trained_policy_args,
        tokenizer=tokenizer_arg,
        settings=eval_args(),
        out=f"{WORK}/eval/{{model}}/{{recipe}}/{{method}}",
    log: f"{WORK}/logs/eval/{{model}}/{{recipe}}/{{method}}.log"
    benchmark: f"{WORK}/benchmarks/eval/{{model}}/{{recipe}}/{{method}}.tsv"
    resources: gpu=USES_GPU, mem_mb=MEM_MB["large"]
    shell:
        "{params.on_gpu}qerl eval {params.policy} {params.tokenizer} {params.settings} --out {params.out} "
        "> {log} 2>&1 && cp {params.out}/summary.csv $(dirname {output})/"


def base_weights_input(wildcards):
    if wildcards.weights == "nvfp4":
        return [f"{WORK}/models/{wildcards.model}/nvfp4"]
    return base_model_input(wildcards)


def base_weights_args(wildcards):
    if wildcards.weights == "nvfp4":
        return f"--model {WORK}/models/{wildcards.model}/nvfp4 --method qerl"
    return f"--model {base_model(wildcards.model)} --method full"


rule eval_base:
    input: base_weights_input
    output: f"{RESULTS}/eval/{{model}}/base/{{weights}}/summary.csv"
    wildcard_constraints: weights="bf16|nvfp4"
    params:
        on_gpu=ON_GPU,
        policy=base_weights_args,
        tokenizer=tokenizer_arg,
        settings=eval_args(),
        out=f"{WORK}/eval/{{model}}/base/{{weights}}",
    log: f"{WORK}/logs/eval_base/{{model}}/{{weights}}.log"
    benchmark: f"{WORK}/benchmarks/eval_base/{{model}}/{{weights}}.tsv"
    resources: gpu=USES_GPU, mem_mb=MEM_MB["large"]
    shell:
        "{params.on_gpu}qerl eval {params.policy} {params.tokenizer} {params.settings} --out {params.out} "
        "> {log} 2>&1 && cp {params.out}/summary.csv $(dirname {output})/"
