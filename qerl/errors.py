"""Errors that name their cause; the CLI prints them without a traceback."""


class QerlError(Exception):
    """Base class for errors caused by the user's input rather than a bug."""


class QuantizationError(QerlError):
    """A weight cannot be quantized (wrong shape, K % 16 != 0, NaN/Inf)."""


class GroupSizeError(QuantizationError):
    """A weight's input dim K is not a multiple of the NVFP4 group size (16)."""


class CheckpointError(QerlError):
    """A checkpoint is missing, corrupt, truncated or not in the expected format."""


class ArchitectureError(QerlError):
    """An architecture is unknown or not supported."""
