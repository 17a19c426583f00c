"""AdamW whose state lives in host memory and whose step runs on the CPU.

A memory-budgeted RL step on a small GPU keeps only the trainable parameters and their
gradients on the device; ``HostAdamW`` holds a host copy of each parameter, a gradient
buffer and AdamW's two moments, all in the host's memory. One ``step()``:

    grads, params  device -> host   (pinned buffers, non-blocking, then one synchronize)
    torch.optim.AdamW.step()        on the host copies (the CPU's fused kernel by default)
    params         host -> device   (non-blocking, then synchronize before returning)

The gradients are read when ``step()`` runs, so they are the Trainer's: after every
gradient-accumulation micro-batch and after ``clip_grad_norm_`` on the device gradients.
torchao's CPUOffloadOptimizer copies each gradient in a post-accumulate-grad hook during
backward, so the clipping never reaches its copy: that is why this module exists.

The device parameters stay the one source of truth, as with ``torch.optim.AdamW``: their
values are copied to the host at every step, so a write to them between steps (a
checkpoint's weights loaded after the optimizer was built, a restore) is what the step
starts from, and the result is that of ``torch.optim.AdamW`` run on the host copies. With
the same ``fused``/``foreach`` choice on CPU parameters that is bit for bit
``torch.optim.AdamW``; on a GPU it differs from a device AdamW by fp32 rounding only.

``param_groups`` and ``state`` are the inner AdamW's (the state keyed by the host copies),
so an LR scheduler's ``lr`` is the one the step reads, and ``state_dict()`` is the inner's,
in the format ``torch.optim.AdamW`` writes (indexed by position, no device in it).

Not for fp16 with a GradScaler: the scaler unscales the gradients of ``param_groups``,
which here are the host copies, not the device gradients the step reads.

A Trainer builds it from its arguments through ``optimizer_cls_and_kwargs``::

    trainer.optimizer_cls_and_kwargs = host_adamw_cls_and_kwargs(trainer.args)
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import ParamsT

# The dtypes the CPU's AdamW kernels (fused, foreach and single-tensor) step.
STEPPED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class HostAdamW(torch.optim.Optimizer):
    """``torch.optim.AdamW`` over host copies of device parameters (see the module).

    Takes AdamW's arguments. ``fused``/``foreach`` choose the host step's implementation;
    by default the CPU's fused kernel. ``amsgrad``, ``maximize`` and the per-group
    options work as in AdamW; ``capturable`` and ``differentiable`` do not apply to a host
    step and are not taken."""

    def __init__(self, params: ParamsT, lr: float | torch.Tensor = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8,
                 weight_decay: float = 1e-2, amsgrad: bool = False, *,
                 maximize: bool = False, foreach: bool | None = None,
                 fused: bool | None = None) -> None:
        if fused is None and foreach is None:
            fused = True
        defaults = dict(lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                        amsgrad=amsgrad, maximize=maximize, foreach=foreach, fused=fused)
        self._inner: torch.optim.AdamW | None = None
        self._device: torch.device | None = None
        # (device param, host copy, host gradient buffer), in param_groups order.
        self._pairs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []
        self._seen: set[torch.Tensor] = set()
        # Calls add_param_group for each group, which builds the inner AdamW.
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group of device parameters; each gets its host copy in the inner AdamW."""
        if not isinstance(param_group, dict):
            raise TypeError(f"param_group must be a dict, not {type(param_group).__name__}")
        entries = param_group["params"]
        if isinstance(entries, torch.Tensor):
            entries = [entries]
        elif isinstance(entries, set):
            raise TypeError("HostAdamW's parameters must be an ordered collection (a list), "
                            "not a set: a set's order changes between runs")
        entries = [e if isinstance(e, tuple) else (None, e) for e in entries]
        group = len(self._inner.param_groups) if self._inner is not None else 0
        device = self._device
        taken = set(self._seen)
        for i, (name, param) in enumerate(entries):
            what = f"parameter {name!r}" if name else f"parameter {i} of group {group}"
            _check(param, what, taken)
            if device is None:
                device = param.device
            elif param.device != device:
                raise ValueError(f"HostAdamW needs all parameters on one device: {what} of "
                                 f"shape {tuple(param.shape)} is on {param.device}, the "
                                 f"first on {device}")
            taken.add(param)
        pairs = [(param, *_host_buffers(param)) for _, param in entries]
        host_group = {**param_group, "params": [host if name is None else (name, host)
                                                for (name, _), (_, host, _) in
                                                zip(entries, pairs, strict=True)]}
        if self._inner is None:
            self._inner = torch.optim.AdamW([host_group], **self.defaults)
        else:
            self._inner.add_param_group(host_group)
        self._device = device
        self._pairs.extend(pairs)
        self._seen = taken
        self._share_inner()

    def _share_inner(self) -> None:
        # The inner AdamW's groups are this optimizer's: a scheduler's lr is the step's lr.
        self.param_groups = self._inner.param_groups
        self.state = self._inner.state
        self.defaults = self._inner.defaults

    def _synchronize(self) -> None:
        if self._device.type == "cuda":
            torch.cuda.synchronize(self._device)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """One AdamW step on the device parameters' current gradients (see the module)."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # Non-blocking only into pinned memory; other copies must be synchronous.
        async_copy = self._device.type == "cuda"
        stepped = []
        for param, host, grad in self._pairs:
            if param.grad is None:  # skipped, as AdamW skips it: no state, no decay
                host.grad = None
                continue
            if param.grad.is_sparse:
                raise RuntimeError("HostAdamW, like AdamW, does not take sparse gradients; "
                                   f"a parameter of shape {tuple(param.shape)} has one")
            host.copy_(param, non_blocking=async_copy)
            grad.copy_(param.grad, non_blocking=async_copy)
            host.grad = grad
            stepped.append((param, host))
        self._synchronize()
        self._inner.step()
        for param, host in stepped:
            param.copy_(host, non_blocking=async_copy)
        # Wait so that the device parameters hold the new values when step() returns,
        # whichever stream reads them next, and so that the next step does not write a
        # host copy that a transfer still reads.
        self._synchronize()
        return loss

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the device parameters' gradients (the host buffers are overwritten at
        each step)."""
        for param, _, _ in self._pairs:
            if param.grad is None:
                continue
            if set_to_none:
                param.grad = None
            else:
                if param.grad.grad_fn is not None:
                    param.grad.detach_()
                else:
                    param.grad.requires_grad_(False)
                param.grad.zero_()

    def state_dict(self) -> dict[str, Any]:
        """The inner AdamW's state dict (moments and step counts, indexed by position)."""
        return self._inner.state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load an AdamW state dict into the host state. The parameters' values are not in
        it: they are read from the device at each step."""
        self._inner.load_state_dict(state_dict)
        # AdamW.load_state_dict replaces its param_groups list and state dict.
        self._share_inner()


def _check(param, what: str, taken: set[torch.Tensor]) -> None:
    """Refuse what the host step cannot stand in for, naming the parameter."""
    if not isinstance(param, torch.Tensor):
        raise TypeError(f"HostAdamW optimizes tensors; {what} is {type(param).__name__}")
    if param.dtype not in STEPPED_DTYPES:
        raise TypeError(f"HostAdamW steps floating-point parameters "
                        f"({', '.join(map(str, STEPPED_DTYPES))}); {what} of shape "
                        f"{tuple(param.shape)} is {param.dtype}")
    if not param.is_leaf:
        raise ValueError(f"HostAdamW cannot optimize a non-leaf tensor ({what})")
    if param in taken:
        raise ValueError(f"{what} (shape {tuple(param.shape)}) is given twice; each "
                         f"parameter belongs to one group once")


def _host_buffers(param: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A host copy of ``param`` and a host buffer for its gradient, allocated once."""
    # Pinned memory lets the copies to and from a CUDA device run asynchronously.
    pin = param.device.type == "cuda"
    host = torch.empty_like(param, device="cpu", pin_memory=pin).copy_(param.detach())
    return host, torch.empty_like(host, pin_memory=pin)


def host_adamw_cls_and_kwargs(args) -> tuple[type[HostAdamW], dict[str, Any]]:
    """``(HostAdamW, kwargs)`` for a transformers Trainer's ``optimizer_cls_and_kwargs``:
    the kwargs that ``args.optim`` (``adamw_torch`` or ``adamw_torch_fused``) would give
    ``torch.optim.AdamW`` (lr, betas, eps; weight decay comes in the Trainer's groups)."""
    from transformers import Trainer  # a heavy import, needed only here

    cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(args)
    if cls is not torch.optim.AdamW:
        raise ValueError(f"HostAdamW stands in for torch.optim.AdamW (optim 'adamw_torch' or "
                         f"'adamw_torch_fused'); optim {str(args.optim)!r} builds "
                         f"{cls.__module__}.{cls.__qualname__}")
    return HostAdamW, dict(kwargs)
