# Every model's frozen NVFP4 base (what qerl trains on and samples from).


rule quantize:
    input: base_model_input
    output: directory(f"{WORK}/models/{{model}}/nvfp4")
    params: model=base_model_of, device=DEVICE, on_gpu=ON_GPU
    log: f"{WORK}/logs/quantize/{{model}}.log"
    benchmark: f"{WORK}/benchmarks/quantize/{{model}}.tsv"
    resources: gpu=USES_GPU, mem_mb=MEM_MB["large"]
    shell:
        "{params.on_gpu}qerl quantize --model {params.model} --out {output} --device {params.device} --quiet "
        "> {log} 2>&1"
