# Base-model numbers as the paper took them: lm-eval for GSM8K (5-shot; strict and flexible
# matching) and lighteval for MATH-500, AIME24 and AIME25, each in its own environment
# (their pins clash with math-verify's: workflows/envs/). `qerl eval-import` reads both into
# one summary beside qerl eval's. Settings: config["base_eval"]; local data: config["data"].
BASE_EVAL = config.get("base_eval", {})
LIGHTEVAL_TASKS = BASE_EVAL.get("lighteval_tasks", ["math_500", "aime24", "aime25"])
LIGHTEVAL_SPLIT = {"math_500": "test", "aime24": "train", "aime25": "train"}
LOCAL_GSM8K = bool(DATA.get("gsm8k_train") and DATA.get("gsm8k"))
# lm-eval's GSM8K task stops its answers at 256 tokens: the protocol the paper's base numbers
# follow. max_tokens may lower that cap (a rehearsal), never raise it: at 1024 a 135M model's
# looping answers made lm-eval the longest job of the gpu configuration (14 min on an H200).
LM_EVAL_GSM8K_TOKENS = 256


def lm_eval_task_input(wildcards):
    return [f"{WORK}/eval/lm-eval-tasks/gsm8k_local.yaml"] if LOCAL_GSM8K else []


def lighteval_data_input(wildcards):
    """Local files of the lighteval tasks that have one (the rest read the hub)."""
    return [f"{WORK}/eval/lighteval-data/{task}/{LIGHTEVAL_SPLIT[task]}.jsonl"
            for task in LIGHTEVAL_TASKS if DATA.get(task.replace("_", ""))]


def lighteval_source(wildcards):
    return DATA[wildcards.task.replace("_", "")]


rule lm_eval_local_task:
    input:
        env_python("lm-eval"),
        train=DATA.get("gsm8k_train", []),
        test=DATA.get("gsm8k", []),
    output: f"{WORK}/eval/lm-eval-tasks/gsm8k_local.yaml"
    log: f"{WORK}/logs/lm_eval_local_task.log"
    params: bin=env_bin("lm-eval")
    shell:
        "{params.bin}/python workflows/scripts/lm_eval_task.py {input.train} {input.test} "
        "$(dirname {output}) > {log} 2>&1"


rule lm_eval_gsm8k:
    input: base_model_input, lm_eval_task_input, env_python("lm-eval")
    output: directory(f"{WORK}/eval/{{model}}/base/lm-eval")
    log: f"{WORK}/logs/lm_eval_gsm8k/{{model}}.log"
    benchmark: f"{WORK}/benchmarks/lm_eval_gsm8k/{{model}}.tsv"
    params:
        on_gpu=ON_GPU,
        bin=env_bin("lm-eval"),
        model=base_model_of,
        tasks=(f"--include_path {WORK}/eval/lm-eval-tasks --tasks gsm8k_local" if LOCAL_GSM8K
               else "--tasks gsm8k"),
        batch=BASE_EVAL.get("batch_size", "auto"),
        limit=f"--limit {BASE_EVAL['limit']}" if BASE_EVAL.get("limit") else "",
        gen=(f"--gen_kwargs max_gen_toks={BASE_EVAL['max_tokens']}"
             if BASE_EVAL.get("max_tokens", LM_EVAL_GSM8K_TOKENS) < LM_EVAL_GSM8K_TOKENS
             else ""),
        device=DEVICE,
    resources: gpu=USES_GPU, mem_mb=MEM_MB["medium"]
    # Through the environment's python, the input checked before any job runs: an
    # environment given in the configuration may lack console scripts.
    shell:
        "{params.on_gpu}{params.bin}/python -m lm_eval run --model hf "
        "--model_args pretrained={params.model},dtype=bfloat16 --device {params.device} "
        "--batch_size {params.batch} {params.tasks} {params.limit} {params.gen} --seed 0 "
        "--log_samples "
        "--output_path {output} > {log} 2>&1"


rule lighteval_data:
    """lighteval reads a folder per task: link the configured local file into one."""
    input: lighteval_source
    output: f"{WORK}/eval/lighteval-data/{{task}}/{{split}}.jsonl"
    log: f"{WORK}/logs/lighteval_data/{{task}}_{{split}}.log"
    shell: "ln -sf $(realpath {input}) {output} 2> {log}"


rule lighteval_math:
    input: base_model_input, lighteval_data_input, env_python("lighteval")
    output: directory(f"{WORK}/eval/{{model}}/base/lighteval")
    log: f"{WORK}/logs/lighteval_math/{{model}}.log"
    benchmark: f"{WORK}/benchmarks/lighteval_math/{{model}}.tsv"
    params:
        on_gpu=ON_GPU,
        bin=env_bin("lighteval"),
        model=base_model_of,
        batch=BASE_EVAL.get("batch_size_lighteval", 8),
        tasks=",".join(f"{task}_qerl|0" for task in LIGHTEVAL_TASKS),
        samples=f"--max-samples {BASE_EVAL['limit']}" if BASE_EVAL.get("limit") else "",
        max_tokens=BASE_EVAL.get("max_tokens", 32768),
        data=f"{WORK}/eval/lighteval-data",
        device=DEVICE,
    resources: gpu=USES_GPU, mem_mb=MEM_MB["medium"]
    shell:
        "{params.on_gpu}env QERL_LIGHTEVAL_DATA={params.data} "
        "QERL_LIGHTEVAL_MAX_TOKENS={params.max_tokens} {params.bin}/python "
        "workflows/scripts/lighteval_offline.py accelerate "
        "'model_name={params.model},device={params.device},dtype=bfloat16,"
        "batch_size={params.batch},generation_parameters={{temperature:0.0}}' "
        "'{params.tasks}' --custom-tasks workflows/scripts/lighteval_tasks.py "
        "{params.samples} --output-dir {output} > {log} 2>&1"


rule base_eval_summary:
    input:
        lm_eval=f"{WORK}/eval/{{model}}/base/lm-eval",
        lighteval=f"{WORK}/eval/{{model}}/base/lighteval",
    output: f"{RESULTS}/eval/{{model}}/base/external/summary.csv"
    params: out=f"{WORK}/eval/{{model}}/base/external"
    log: f"{WORK}/logs/base_eval_summary/{{model}}.log"
    shell:
        "qerl eval-import {input.lm_eval} {input.lighteval} --out {params.out} > {log} 2>&1 "
        "&& cp {params.out}/summary.csv {output}"
