# The paper end to end: quantize -> train -> evaluate -> benchmark -> tables.
#   snakemake --cores all                                        # smoke (CPU, tiny)
#   snakemake --cores all --configfile workflows/config/gpu.yaml # or paper.yaml
# Rules live in workflows/rules/, settings in workflows/config/ (see workflows/README.md).

configfile: "workflows/config/smoke.yaml"


include: "workflows/rules/common.smk"
include: "workflows/rules/base_eval.smk"


rule all:
    input:
        expand(f"{RESULTS}/eval/{{model}}/base/summary.csv",
               model=config.get("base_eval", {}).get("models", [])),
