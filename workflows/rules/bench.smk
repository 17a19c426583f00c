# Benchmarks (config["bench"]: name -> its options). Each writes CSVs named after the card
# into its own folder; `qerl bench NAME --help` lists the options.
BENCH = config.get("bench", {})
FILE_OUTPUT = {"quantize", "fidelity"}  # these take --out FILE, the others --out-dir
CPU_CAPABLE = {"quantize", "fidelity"}
CPU_ONLY = {"fidelity"}  # runs on the CPU wherever it is: no GPU held while it does


def bench_args(wildcards):
    return BENCH[wildcards.bench] or ""


def bench_out(wildcards, output):
    if wildcards.bench in FILE_OUTPUT:
        return f"--out {output[0]}/{wildcards.bench}.csv"
    return f"--out-dir {output[0]}"


def bench_gpu(wildcards):
    """Benchmarks time the GPU: they hold one alone (every slot of it)."""
    if wildcards.bench in CPU_ONLY:
        return 0
    return max(int(wildcards.bench not in CPU_CAPABLE), WHOLE_GPU)


def bench_on_gpu(wildcards):
    return "" if wildcards.bench in CPU_ONLY else ON_WHOLE_GPU


rule bench:
    output: directory(f"{RESULTS}/bench/{{bench}}")
    params: args=bench_args, out=bench_out, on_gpu=bench_on_gpu
    log: f"{WORK}/logs/bench/{{bench}}.log"
    benchmark: f"{WORK}/benchmarks/bench/{{bench}}.tsv"
    resources: gpu=bench_gpu, mem_mb=MEM_MB["large"]
    shell: "mkdir -p {output} && {params.on_gpu}qerl bench {wildcards.bench} {params.args} {params.out} > {log} 2>&1"
