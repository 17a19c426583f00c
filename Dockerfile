# syntax=docker/dockerfile:1
# qerl in one image: the Snakemake workflow of the paper and every Python environment it uses
# (Ubuntu 24.04's Python 3.12, venvs, no conda; every package version pinned).
#
# Build, from the repository root:
#   docker build --build-arg QERL_COMMIT=$(git rev-parse HEAD) -t qerl .
# Run (needs the NVIDIA Container Toolkit and a driver for CUDA 13.0, i.e. 580 or newer):
#   docker run --gpus all -v $PWD/results:/workspace/results qerl snakemake --cores all --resources gpu=3 --configfile workflows/config/gpu.yaml workflows/config/docker.yaml
#   docker run --gpus all -v $PWD/results:/workspace/results qerl snakemake --cores all --configfile workflows/config/paper.yaml workflows/config/docker.yaml
#   docker run qerl        # the default command: the CPU-sized smoke configuration
# workflows/config/docker.yaml points the workflow at the side environments built here
# (/opt/envs/NAME/bin) instead of building them under .venvs/ at run time. Add
# -v $HOME/.cache/huggingface:/root/.cache/huggingface to keep downloaded models.
#
# Layout: /opt/venv (qerl, Snakemake; on PATH) from requirements/main.txt; side environments
# /opt/envs/{lm-eval,lighteval,llmcompressor} from workflows/envs/NAME.txt, each its own venv
# (their pins clash with the main one's); the repository in /workspace (the workflow's rules,
# configurations and tests), qerl installed from it as users install it (not editable).
# requirements/constraints.txt pins what the frozen sets leave out: the CUDA packages of the
# torch wheel, and setuptools.
#
# CUDA: PyPI's torch 2.13.0 Linux wheel is the CUDA 13.0 build and brings its own CUDA
# libraries as pip packages; the base image's CUDA matches it, so a host driver too old for
# CUDA 13 stops the container at start (NVIDIA_REQUIRE_CUDA) instead of leaving torch
# without a GPU. The tag is pinned exactly; pinning its digest as well
# (nvidia/cuda:TAG@sha256:...) is the stricter option.
FROM nvidia/cuda:13.0.1-runtime-ubuntu24.04

ARG DEBIAN_FRONTEND=noninteractive
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

# Python 3.12 is Ubuntu 24.04's python3. gcc, libc6-dev and python3-dev: Triton compiles
# a small C launcher for its kernels at run time. cuda-nvcc and cuda-cudart-dev (from the
# base image's NVIDIA apt repository): nvcc and the CUDA headers, for qerl's CUDA
# kernels (kernels/nvfp4_gemv.cu, and kernels/nvfp4_gemm.cu for Hopper), built below for the
# common GPU architectures.
# DL3008 (pin apt versions) is ignored on purpose: the versions are those that the Ubuntu
# 24.04 archive serves at build time over the base image's own packages; Ubuntu drops
# superseded -updates/-security versions from its index, so exact pins would make the
# build fail within weeks of a security update.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        ca-certificates \
        cuda-cudart-dev-13-0 \
        cuda-nvcc-13-0 \
        gcc \
        libc6-dev \
        python3 \
        python3-dev \
        python3-venv \
    && rm -rf /var/lib/apt/lists/*

WORKDIR /workspace

# Side environments first (large, rarely changed): a new main.txt does not rebuild them.
# setuptools goes in first, pinned, and builds the few sdists (--no-build-isolation), so no
# build backend floats either.
COPY requirements/constraints.txt requirements/
COPY workflows/envs/lm-eval.txt workflows/envs/lighteval.txt workflows/envs/llmcompressor.txt workflows/envs/
RUN set -e; \
    for env in lm-eval lighteval llmcompressor; do \
        python3 -m venv "/opt/envs/$env"; \
        "/opt/envs/$env/bin/pip" install --no-cache-dir setuptools==84.2.1; \
        "/opt/envs/$env/bin/pip" install --no-cache-dir --no-build-isolation \
            -r "workflows/envs/$env.txt" -c requirements/constraints.txt; \
    done

# The main environment, the default on PATH.
ENV VIRTUAL_ENV=/opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY requirements/main.txt requirements/
RUN python3 -m venv /opt/venv \
    && pip install --no-cache-dir setuptools==84.2.1 \
    && pip install --no-cache-dir --no-build-isolation \
        -r requirements/main.txt -c requirements/constraints.txt

# The training environment for `engine.backend: vllm` (qerl[vllm]): vLLM pins other
# transformers, compressed-tensors and numpy versions than main.txt (requirements/vllm.txt
# says which vLLM goes with which torch). Fully pinned, torch's CUDA packages included, so
# without the constraints (vLLM's CUDA bindings need another cuda-bindings). Run
# /opt/envs/vllm/bin/qerl train ... for rollouts on vLLM.
COPY requirements/vllm.txt requirements/
RUN python3 -m venv /opt/envs/vllm \
    && /opt/envs/vllm/bin/pip install --no-cache-dir setuptools==84.2.1 \
    && /opt/envs/vllm/bin/pip install --no-cache-dir --no-build-isolation -r requirements/vllm.txt

# The repository, and qerl itself from it (its dependencies are all in main.txt); then the
# installed package's CUDA kernel (-P: not the source tree in the working directory) for
# Ampere, Ada, Hopper and Blackwell (no GPU needed to build), so that a container's first
# rollout does not wait for nvcc.
# The commit the image holds (its copy has no .git), for each run's record (run.json).
ARG QERL_COMMIT=
ENV CUDA_HOME=/usr/local/cuda QERL_CACHE=/opt/qerl-cache QERL_COMMIT=$QERL_COMMIT
COPY . /workspace
RUN pip install --no-cache-dir --no-deps --no-build-isolation /workspace \
    && /opt/envs/vllm/bin/pip install --no-cache-dir --no-deps --no-build-isolation /workspace \
    && python3 -P -m qerl.kernels.cuda_build 80 86 89 90 100 120

CMD ["snakemake", "--cores", "all"]
