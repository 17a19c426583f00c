"""qerl: reproduce and benchmark QeRL (NVFP4 weights + LoRA reinforcement learning)."""

import logging

__version__ = "0.1.0"

# bitsandbytes' CPU backend (imported with peft) logs at every start, on CPUs with
# AVX512-BF16, that it could not fetch an optional kernel from the Hugging Face Hub (the
# `kernels` package); its own fallback then runs. It is noise in every log of every run.
_OPTIONAL_KERNEL = "Failed to load CPU gemm_4bit_forward from kernels-community"
logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(
    lambda record: not record.getMessage().startswith(_OPTIONAL_KERNEL))
