"""A GPU's memory in use as the driver counts it (NVML: the CUDA context, the libraries'
workspaces, the kernels' modules and torch's allocator together), at its highest while a
block of code runs, less what was in use before it: what a process added, where it holds
the GPU alone.

    with DriverPeak(uuid) as driver:   # before this process touches CUDA
        ...
    driver.peak_gb

A thread samples every ``every_s`` seconds, so a peak shorter than that can be missed;
torch's caching allocator keeps what it reserves until the process ends, so its peaks
last. Needs NVML's Python bindings (nvidia-ml-py).
"""

from __future__ import annotations

import threading

SAMPLE_S = 0.005


class DriverPeak:
    """The peak memory in use on the GPU of ``uuid`` (``GPU-...``, as CUDA_VISIBLE_DEVICES
    and NVML name it) while the block runs, less its use when the block began."""

    def __init__(self, uuid: str, every_s: float = SAMPLE_S):
        self.uuid, self.every_s = uuid, every_s
        self.baseline = self.peak = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> DriverPeak:
        try:
            import pynvml
        except ImportError as e:
            raise SystemExit("the driver's memory is read through NVML: pip install "
                             "nvidia-ml-py") from e
        self._nvml = pynvml
        pynvml.nvmlInit()
        self._handle = pynvml.nvmlDeviceGetHandleByUUID(self.uuid)
        self.baseline = self.peak = self._used()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()
        return self

    def _used(self) -> int:
        return self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used

    def _watch(self) -> None:
        while not self._stop.wait(self.every_s):
            self.peak = max(self.peak, self._used())

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self._used())
        self._nvml.nvmlShutdown()

    @property
    def peak_gb(self) -> float:
        return (self.peak - self.baseline) / 1e9
