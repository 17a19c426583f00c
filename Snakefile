# The paper end to end: quantize -> train -> evaluate -> benchmark -> tables.
#   snakemake --cores all                                          # smoke: CPU, tiny model
#   snakemake --cores all --configfile workflows/config/gpu.yaml   # one GPU (or paper.yaml)
#   snakemake --profile workflows/profiles/slurm --configfile workflows/config/paper.yaml
#   snakemake train_all | eval_all | base_eval_all | bench_all | science_all  # one stage
#   snakemake results/eval/M/R/qerl/summary.csv                    # one target
# Rules: workflows/rules/; settings and their schema: workflows/config/, workflows/schemas/.
from snakemake.utils import min_version

min_version("9.0")


# smoke unless --configfile names others: they replace it rather than merge into it.
if not workflow.overwrite_configfiles:

    configfile: "workflows/config/smoke.yaml"


include: "workflows/rules/common.smk"
include: "workflows/rules/quantize.smk"
include: "workflows/rules/train.smk"
include: "workflows/rules/eval.smk"
include: "workflows/rules/base_eval.smk"
include: "workflows/rules/bench.smk"
include: "workflows/rules/science.smk"
include: "workflows/rules/report.smk"


onstart:
    check_gpu()


onsuccess:
    write_run_record()
    say_where_results_are()


onerror:
    record_failed_report()


rule all:
    input: f"{RESULTS}/tables/values.csv"
    default_target: True


rule train_all:
    input: train_targets()


rule eval_all:
    input: eval_targets()


rule base_eval_all:
    input: base_eval_targets()


rule bench_all:
    input: bench_targets()


rule science_all:
    input: science_targets()
