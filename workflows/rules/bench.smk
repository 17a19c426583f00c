# Benchmarks (config["bench"]: name -> its options). Each writes CSVs named after the card
# into its own folder; `qerl bench NAME --help` lists the options. Which benchmarks the bench
# rule runs, and how: qerl.bench.registry.
from qerl.bench.registry import BENCHMARKS

BENCH = config.get("bench", {})
RUNS = {b.command: b for b in BENCHMARKS if b.rule == "bench"}


def _check_bench():
    unknown = sorted(set(BENCH) - set(RUNS))
    if unknown:
        raise WorkflowError(f"bench names {unknown}, which the bench rule does not run "
                            f"(it runs {', '.join(RUNS)})")


_check_bench()


def bench_args(wildcards):
    return BENCH[wildcards.bench] or ""


def bench_out(wildcards, output):
    if RUNS[wildcards.bench].out == "file":
        return f"--out {output[0]}/{wildcards.bench}.csv"
    return f"--out-dir {output[0]}"


def bench_gpu(wildcards):
    """Benchmarks time the GPU: they hold one alone (every slot of it)."""
    device = RUNS[wildcards.bench].device
    if device == "cpu":
        return 0
    return max(int(device == "cuda"), WHOLE_GPU)


def bench_on_gpu(wildcards):
    return "" if RUNS[wildcards.bench].device == "cpu" else ON_WHOLE_GPU


rule bench:
    output: directory(f"{RESULTS}/bench/{{bench}}")
    params: args=bench_args, out=bench_out, on_gpu=bench_on_gpu
    log: f"{WORK}/logs/bench/{{bench}}.log"
    benchmark: f"{WORK}/benchmarks/bench/{{bench}}.tsv"
    resources: gpu=bench_gpu, mem_mb=MEM_MB["large"]
    shell: "mkdir -p {output} && {params.on_gpu}qerl bench {wildcards.bench} {params.args} {params.out} > {log} 2>&1"
