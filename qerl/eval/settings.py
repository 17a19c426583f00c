"""How ``qerl eval`` samples: its settings and their defaults, which the command line and
the workflow read from here."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from qerl.settings import Settings

BENCHES = ("gsm8k", "math500")  # what `qerl eval` evaluates unless told otherwise


class EvalSettings(Settings):
    """How answers are sampled: k ``samples`` a problem at the paper's temperature 0.6 and
    top-p 0.95, up to ``max_tokens`` each, ``batch`` sequences an engine call."""

    samples: int = Field(1, ge=1, description="answers per problem (k)")
    temperature: float = Field(0.6, ge=0)
    top_p: float = Field(0.95, gt=0, le=1)
    max_tokens: int = Field(4096, ge=1, description="tokens per answer, at most")
    batch: int = Field(64, ge=1, description="sequences per engine call")
    seed: int = 0
    backend: Literal["embedded", "vllm"] = Field(
        "embedded", description="vllm: when installed, for qerl and lora policies")
