# Base-model numbers as the paper took them: lm-eval for GSM8K (5-shot; strict and flexible
# matching) and lighteval for MATH-500, AIME24 and AIME25, each in its own environment
# (their pins clash with math-verify's: workflows/envs/). `qerl eval-import` reads both into
# one summary beside qerl eval's. Settings: config["base_eval"]; local data: config["data"].
BASE = config.get("base_eval", {})
DATA = config.get("data", {})


def model_inputs(w):
    return [f"{WORK}/models/{w.model}/bf16"] if needs_export(w.model) else []


def lm_eval_task_args():
    if DATA.get("gsm8k_train") and DATA.get("gsm8k"):
        return f"--include_path {WORK}/eval/lm-eval-tasks --tasks gsm8k_local"
    return "--tasks gsm8k"


rule lm_eval_local_task:
    input:
        env_marker("lm-eval"),
        train=DATA.get("gsm8k_train", []),
        test=DATA.get("gsm8k", []),
    output: f"{WORK}/eval/lm-eval-tasks/gsm8k_local.yaml"
    log: f"{WORK}/logs/lm_eval_local_task.log"
    params: bin=env_bin("lm-eval")
    shell:
        "{params.bin}/python workflows/scripts/lm_eval_task.py {input.train} {input.test} "
        "$(dirname {output}) > {log} 2>&1"


rule lm_eval_gsm8k:
    input:
        model_inputs,
        env_marker("lm-eval"),
        task=lambda w: ([f"{WORK}/eval/lm-eval-tasks/gsm8k_local.yaml"]
                        if "gsm8k_local" in lm_eval_task_args() else []),
    output: directory(f"{WORK}/eval/{{model}}/base/lm-eval")
    log: f"{WORK}/logs/lm_eval_gsm8k/{{model}}.log"
    params:
        bin=env_bin("lm-eval"),
        model=lambda w: hf_model(w.model),
        tasks=lm_eval_task_args(),
        device=config.get("device", "cuda"),
        batch=BASE.get("batch_size", "auto"),
        limit=f"--limit {BASE['limit']}" if BASE.get("limit") else "",
    resources: gpu=lambda w: int(config.get("device", "cuda") == "cuda"), mem_mb=32000
    shell:
        "{params.bin}/lm_eval run --model hf "
        "--model_args pretrained={params.model},dtype=bfloat16 --device {params.device} "
        "--batch_size {params.batch} {params.tasks} {params.limit} --seed 0 --log_samples "
        "--output_path {output} > {log} 2>&1"


rule lighteval_data:
    """lighteval reads a folder per task: link the configured local files into one."""
    input: lambda w: DATA.get(w.task.replace("_", ""), [])
    output: f"{WORK}/eval/lighteval-data/{{task}}/{{split}}.jsonl"
    shell: "ln -sf $(realpath {input}) {output}"


def lighteval_inputs(w):
    split = {"math_500": "test", "aime24": "train", "aime25": "train"}
    return [f"{WORK}/eval/lighteval-data/{task}/{split[task]}.jsonl"
            for task in BASE.get("lighteval_tasks", ["math_500", "aime24", "aime25"])
            if DATA.get(task.replace("_", ""))]


rule lighteval_math:
    input: model_inputs, lighteval_inputs, env_marker("lighteval"),
    output: directory(f"{WORK}/eval/{{model}}/base/lighteval")
    log: f"{WORK}/logs/lighteval_math/{{model}}.log"
    params:
        bin=env_bin("lighteval"),
        model=lambda w: hf_model(w.model),
        device=config.get("device", "cuda"),
        batch=BASE.get("batch_size_lighteval", 8),
        tasks=",".join(f"{t}_qerl|0" for t in
                       BASE.get("lighteval_tasks", ["math_500", "aime24", "aime25"])),
        samples=f"--max-samples {BASE['limit']}" if BASE.get("limit") else "",
        max_tokens=BASE.get("max_tokens", 32768),
        data=f"{WORK}/eval/lighteval-data",
    resources: gpu=lambda w: int(config.get("device", "cuda") == "cuda"), mem_mb=32000
    shell:
        "QERL_LIGHTEVAL_DATA={params.data} QERL_LIGHTEVAL_MAX_TOKENS={params.max_tokens} "
        "{params.bin}/lighteval accelerate "
        "'model_name={params.model},device={params.device},dtype=bfloat16,"
        "batch_size={params.batch},generation_parameters={{temperature:0.0}}' "
        "'{params.tasks}' --custom-tasks workflows/scripts/lighteval_tasks.py "
        "{params.samples} --output-dir {output} > {log} 2>&1"


rule base_eval_summary:
    input:
        lm_eval=f"{WORK}/eval/{{model}}/base/lm-eval",
        lighteval=f"{WORK}/eval/{{model}}/base/lighteval",
    output: f"{RESULTS}/eval/{{model}}/base/summary.csv"
    log: f"{WORK}/logs/base_eval_summary/{{model}}.log"
    shell:
        "qerl eval-import {input.lm_eval} {input.lighteval} --out $(dirname {output}) "
        "> {log} 2>&1"
