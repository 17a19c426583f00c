"""Settings: frozen pydantic models, checked in full when they are made. Unknown keys,
wrong types and out-of-range values are refused by name: pydantic's ValidationError from
code (``LoraSettings(rank=0)``), ConfigError with the key's path (``lora.rank: ...``) from a
configuration file (qerl.config) or the command line. Each default is written once, in the
model that owns it; the configuration file, the command line and the library all read it
from there."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, ValidationError

from qerl.errors import QerlError


class ConfigError(QerlError):
    """Settings that cannot be used as written."""


def describe(error: ValidationError) -> str:
    """Each problem as ``key.path: message (got value)``."""
    return describe_errors(error.errors())


def describe_errors(errors: list[dict]) -> str:
    """``describe`` of some of a ValidationError's ``errors()``."""
    return "; ".join(
        f"{'.'.join(map(str, err['loc'])) or '(top level)'}: {err['msg']}"
        + (f" (got {err['input']!r})" if err["type"] != "missing"
           and not isinstance(err["input"], dict) else "")
        for err in errors)


class Settings(BaseModel):
    """A group of settings: frozen, no unknown keys."""

    model_config = ConfigDict(extra="forbid", frozen=True)
