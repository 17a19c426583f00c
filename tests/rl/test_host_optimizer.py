"""HostAdamW (qerl.rl.host_optimizer) against torch.optim.AdamW on the same parameters:
gradient accumulation, clipping of the device gradients before the step, a parameter left
without a gradient, two groups of different weight decay, an LR schedule, a resume from a
saved state dict, and a transformers Trainer that builds it from its arguments."""

from __future__ import annotations

import io
import math

import pytest
import torch
from torch import nn

from qerl.rl.host_optimizer import STEPPED_DTYPES, HostAdamW, host_adamw_cls_and_kwargs
from tests.conftest import fresh_seed

LR, DECAY, EPS, MAX_NORM = 0.05, 0.1, 1e-3, 0.05
ACCUMULATION = 3


class Net(nn.Module):
    """Linear layers of odd shapes; ``side`` takes part only on even steps, so on odd steps
    its parameters have no gradient and AdamW must leave them (and their state) alone."""

    def __init__(self):
        super().__init__()
        self.body = nn.Sequential(nn.Linear(7, 13), nn.Tanh(), nn.Linear(13, 5), nn.Tanh(),
                                  nn.Linear(5, 3))
        self.side = nn.Linear(7, 3)

    def forward(self, x, step: int):
        y = self.body(x)
        return y + self.side(x) if step % 2 == 0 else y


def _net(seed: int, device="cpu") -> Net:
    torch.manual_seed(seed)
    return Net().to(device)


def _groups(model: nn.Module) -> list[dict]:
    """Weights decayed, biases not: the two groups a transformers Trainer makes."""
    named = list(model.named_parameters())
    return [{"params": [p for n, p in named if not n.endswith("bias")], "weight_decay": DECAY},
            {"params": [p for n, p in named if n.endswith("bias")], "weight_decay": 0.0}]


def _train(model, optimizer, seed: int, steps: range, scheduler=None,
           max_norm: float = MAX_NORM) -> list[float]:
    """Steps ``steps`` (each from its own inputs, so a resumed run sees the same data) with
    ACCUMULATION micro-batches and the device gradients clipped before the step; the
    gradient norms before clipping."""
    device = next(model.parameters()).device
    norms = []
    for step in steps:
        gen = torch.Generator().manual_seed(seed + step)
        for _ in range(ACCUMULATION):
            x = torch.randn(4, 7, generator=gen).to(device)
            target = torch.randn(4, 3, generator=gen).to(device)
            loss = (model(x, step) - target).square().mean() / ACCUMULATION
            loss.backward()
        norms.append(nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        optimizer.step()
        if scheduler is not None:
            scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    return norms


def _assert_params_equal(model, reference, msg):
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), f"{msg}: {name} differs by {(p - q).abs().max().item():.3g}"


# HostAdamW's options and torch.optim.AdamW's that run the same CPU kernel: by default the
# host step is the fused kernel, which torch.optim.AdamW runs on CPU only when asked.
KERNELS = [({}, {"fused": True}), ({"foreach": True}, {"foreach": True}),
           ({"foreach": False}, {"foreach": False}),
           ({"foreach": False, "amsgrad": True}, {"foreach": False, "amsgrad": True})]


@pytest.mark.parametrize(("host_options", "reference_options"), KERNELS)
def test_steps_equal_torch_adamw_bit_for_bit(host_options, reference_options):
    seed, init = fresh_seed(), fresh_seed()
    model, reference = _net(init), _net(init)
    optimizer = HostAdamW(_groups(model), lr=LR, eps=EPS, **host_options)
    ref_optimizer = torch.optim.AdamW(_groups(reference), lr=LR, eps=EPS, **reference_options)
    norms = _train(model, optimizer, seed, range(5))
    _train(reference, ref_optimizer, seed, range(5))
    assert min(norms) > MAX_NORM, "the clipping must act for this test to check it"
    _assert_params_equal(model, reference, f"seed {seed}, init {init}")
    # The moments and step counts too (odd steps left `side` out: fewer steps there).
    state, ref_state = optimizer.state_dict()["state"], ref_optimizer.state_dict()["state"]
    assert state.keys() == ref_state.keys()
    for i in state:
        for key, value in ref_state[i].items():
            assert torch.equal(state[i][key], value), f"seed {seed}: state {i} {key}"
    side = [i for i, p in enumerate(p for g in _groups(model) for p in g["params"])
            if any(p is q for q in model.side.parameters())]
    assert {state[i]["step"].item() for i in side} == {3.0}
    # The state lives in host memory, keyed by the host copies.
    assert all(t.device.type == "cpu" for s in optimizer.state.values() for t in s.values())


@pytest.mark.parametrize("dtype", STEPPED_DTYPES)
def test_each_dtype_it_takes_steps_as_adamw_does(dtype):
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    params = [nn.Parameter(torch.randn(3, 5, generator=gen).to(dtype)) for _ in range(2)]
    reference = [nn.Parameter(p.detach().clone()) for p in params]
    optimizer = HostAdamW(params, lr=LR)
    ref_optimizer = torch.optim.AdamW(reference, lr=LR, fused=True)
    for _ in range(3):
        for p, q in zip(params, reference, strict=True):
            p.grad = torch.randn(p.shape, generator=gen).to(dtype)
            q.grad = p.grad.clone()
        optimizer.step()
        ref_optimizer.step()
    for p, q in zip(params, reference, strict=True):
        assert p.dtype == dtype and torch.equal(p, q), f"seed {seed}"


def test_reading_the_gradients_before_clipping_would_show():
    """The clipping changes AdamW's result here (a per-step factor, and eps of the size of
    the clipped gradients), so the bit-for-bit test would catch unclipped gradients."""
    seed, init = fresh_seed(), fresh_seed()
    clipped, unclipped = _net(init), _net(init)
    _train(clipped, torch.optim.AdamW(_groups(clipped), lr=LR, eps=EPS), seed, range(3))
    _train(unclipped, torch.optim.AdamW(_groups(unclipped), lr=LR, eps=EPS), seed, range(3),
           max_norm=math.inf)
    gap = max((p - q).abs().max().item()
              for p, q in zip(clipped.parameters(), unclipped.parameters(), strict=True))
    assert gap > 1e-3, f"seed {seed}, init {init}: clipping moved nothing ({gap:.3g})"


def _schedule(step: int) -> float:
    """Warm-up then decay: the learning rate differs at every step."""
    return (step + 1) / 3 if step < 3 else 0.7 ** (step - 2)


def test_an_lr_scheduler_changes_both_alike():
    seed, init = fresh_seed(), fresh_seed()
    model, reference = _net(init), _net(init)
    optimizer = HostAdamW(_groups(model), lr=LR, eps=EPS)
    ref_optimizer = torch.optim.AdamW(_groups(reference), lr=LR, eps=EPS, fused=True)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule)
    ref_scheduler = torch.optim.lr_scheduler.LambdaLR(ref_optimizer, _schedule)
    lrs, ref_lrs = [], []
    for step in range(6):
        _train(model, optimizer, seed, range(step, step + 1), scheduler)
        _train(reference, ref_optimizer, seed, range(step, step + 1), ref_scheduler)
        lrs.append([g["lr"] for g in optimizer.param_groups])
        ref_lrs.append([g["lr"] for g in ref_optimizer.param_groups])
    assert lrs == ref_lrs
    assert len({lr for lr, _ in lrs}) == len(lrs)
    _assert_params_equal(model, reference, f"seed {seed}, init {init}")


def test_a_resumed_run_equals_an_uninterrupted_one():
    seed, init = fresh_seed(), fresh_seed()
    first = _net(init)
    optimizer = HostAdamW(_groups(first), lr=LR, eps=EPS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule)
    _train(first, optimizer, seed, range(3), scheduler)
    saved = io.BytesIO()  # as a Trainer writes a checkpoint: torch.save of the state dicts
    torch.save({"model": first.state_dict(), "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict()}, saved)
    saved.seek(0)
    checkpoint = torch.load(saved, weights_only=True)

    # A fresh process: another initialisation, the optimizer built before the weights are
    # loaded into the model, so its host copies start out different from the parameters.
    resumed = _net(fresh_seed())
    optimizer = HostAdamW(_groups(resumed), lr=LR, eps=EPS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule)
    resumed.load_state_dict(checkpoint["model"])
    optimizer.load_state_dict(checkpoint["optimizer"])
    scheduler.load_state_dict(checkpoint["scheduler"])
    _train(resumed, optimizer, seed, range(3, 5), scheduler)

    reference = _net(init)
    ref_optimizer = torch.optim.AdamW(_groups(reference), lr=LR, eps=EPS, fused=True)
    ref_scheduler = torch.optim.lr_scheduler.LambdaLR(ref_optimizer, _schedule)
    _train(reference, ref_optimizer, seed, range(5), ref_scheduler)
    _assert_params_equal(resumed, reference, f"seed {seed}, init {init}")


def test_refuses_what_it_cannot_step():
    weight = nn.Parameter(torch.zeros(2, 3))
    with pytest.raises(TypeError, match=r"parameter 1 of group 0 of shape \(4,\) is torch.int64"):
        HostAdamW([weight, torch.zeros(4, dtype=torch.int64)])
    on_meta = nn.Parameter(torch.zeros(5, device="meta"))
    with pytest.raises(ValueError, match="one device: parameter 0 of group 1 of shape "
                                         r"\(5,\) is on meta, the first on cpu"):
        HostAdamW([{"params": [weight]}, {"params": [on_meta]}])
    with pytest.raises(ValueError, match="given twice"):
        HostAdamW([{"params": [weight]}, {"params": [weight], "weight_decay": 0.0}])


def _trainer(model, optim: str, output_dir, seed: int):
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(
        output_dir=str(output_dir), use_cpu=True, optim=optim, max_steps=2, seed=seed,
        per_device_train_batch_size=4, gradient_accumulation_steps=2, learning_rate=LR,
        weight_decay=DECAY, adam_epsilon=EPS, max_grad_norm=0.01, logging_steps=1,
        save_strategy="no", report_to="none", dataloader_num_workers=0)
    gen = torch.Generator().manual_seed(seed)
    data = [{"x": torch.randn(7, generator=gen), "labels": torch.randn(3, generator=gen)}
            for _ in range(16)]
    return Trainer(model=model, args=args, train_dataset=data)


class Regressor(nn.Module):
    """A Trainer's model: returns its loss."""

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(7, 11), nn.Tanh(), nn.Linear(11, 3))

    def forward(self, x, labels):
        return {"loss": (self.net(x) - labels).square().mean()}


@pytest.mark.parametrize("optim", ["adamw_torch", "adamw_torch_fused"])
def test_a_trainer_builds_it_from_its_arguments(tmp_path, optim):
    seed, init = fresh_seed(), fresh_seed()
    torch.manual_seed(init)
    initial = Regressor()
    models = {name: Regressor() for name in ("host", "torch")}
    for model in models.values():
        model.load_state_dict(initial.state_dict())
    host = _trainer(models["host"], optim, tmp_path / "host", seed)
    host.optimizer_cls_and_kwargs = host_adamw_cls_and_kwargs(host.args)
    host.train()
    reference = _trainer(models["torch"], optim, tmp_path / "torch", seed)
    reference.train()

    assert isinstance(host.optimizer.optimizer, HostAdamW)  # inside accelerate's wrapper
    assert [len(g["params"]) for g in host.optimizer.param_groups] == [2, 2]
    norms = [log["grad_norm"] for log in reference.state.log_history if "grad_norm" in log]
    assert len(norms) == 2 and min(norms) > reference.args.max_grad_norm
    moved = max((p - q).abs().max().item() for p, q in
                zip(models["torch"].parameters(), initial.parameters(), strict=True))
    assert moved > LR / 2
    msg = f"seed {seed}, init {init}"
    if optim == "adamw_torch_fused":
        # The same CPU kernel on both sides: bit for bit.
        _assert_params_equal(models["host"], models["torch"], msg)
    else:
        # adamw_torch on CPU is AdamW's single-tensor loop, the host step the fused kernel:
        # the same formula in another order of fp32 operations. They part by an ulp or two
        # of weights below 1 (ulp <= 1.2e-7); 1e-6 is far below one step's move (~LR).
        for p, q in zip(models["host"].parameters(), models["torch"].parameters(),
                        strict=True):
            torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=msg)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_it_equals_a_device_adamw():
    seed, init = fresh_seed(), fresh_seed()
    model, reference = _net(init, "cuda"), _net(init, "cuda")
    optimizer = HostAdamW(_groups(model), lr=LR, eps=EPS)
    ref_optimizer = torch.optim.AdamW(_groups(reference), lr=LR, eps=EPS)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _schedule)
    ref_scheduler = torch.optim.lr_scheduler.LambdaLR(ref_optimizer, _schedule)
    norms = _train(model, optimizer, seed, range(5), scheduler)
    _train(reference, ref_optimizer, seed, range(5), ref_scheduler)
    assert min(norms) > MAX_NORM
    hosts = [p for g in optimizer.param_groups for p in g["params"]]
    assert all(p.device.type == "cpu" and p.is_pinned() for p in hosts)
    assert all(t.device.type == "cpu" for s in optimizer.state.values() for t in s.values())
    # A device AdamW and the CPU's fused kernel: the same formula in another order of fp32
    # operations, five steps of it. A few ulps of weights below 1 (ulp <= 1.2e-7); 1e-6 is
    # far below one step's move (~LR).
    for p, q in zip(model.parameters(), reference.parameters(), strict=True):
        assert p.device.type == "cuda"
        torch.testing.assert_close(p, q, rtol=0, atol=1e-6, msg=f"seed {seed}, init {init}")
