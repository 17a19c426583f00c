"""The trained policy, built the same way for QeRL and its three baselines:

- ``qerl``: frozen NVFP4 base (NVFP4Linear, fused kernels) + BF16 LoRA;
- ``lora``: frozen BF16 base + LoRA;
- ``qlora``: frozen bitsandbytes NF4 base with double quantization + LoRA (QLoRA's recipe);
- ``full``: every weight trained, BF16.

Models come from a Hugging Face directory or hub id, a GGUF file, an NVFP4 checkpoint
directory (``qerl quantize``'s output; dequantized for the baselines) or a named
architecture with random weights. The dense weights are BF16 on a GPU and, holding the
same values, fp32 on a CPU (``compute_dtype``). Weights are loaded one tensor (or one
fusion group) at a time straight to the target device, so a 7B ``qerl`` policy never holds
a BF16 copy of its projections. LoRA goes through PEFT, so adapters are standard PEFT
files.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from accelerate import init_empty_weights
from peft import LoraConfig, PeftModel, get_peft_model
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig

from qerl.archs import MODEL_TYPES
from qerl.config import LoraSettings
from qerl.errors import ArchitectureError, QerlError
from qerl.formats import nvfp4
from qerl.formats.nvfp4_checkpoint import FORMAT, NVFP4Checkpoint, load_checkpoint, read_json
from qerl.kernels.device_facts import interpreting
from qerl.methods import METHODS
from qerl.nn import NVFP4Linear
from qerl.nn.host_embedding import embedding_to_host
from qerl.nn.nvfp4_lora import register_lora_layers
from qerl.noise import AdaptiveQuantizationNoise, AQNSettings
from qerl.quantize import KEEP_DENSE, fusion_groups, quantize_group
from qerl.sources import Source, copy_extras, open_source

NORMS_FILE = "norms.safetensors"
# PEFT's name of the adapter we train. With beta > 0 TRL adds a frozen "ref" copy beside it,
# which PEFT would save into a ref/ subfolder of every adapter folder: saves name ours alone.
ADAPTER = "default"
NF4_BLOCK = 64  # bitsandbytes' 4-bit quantization block


def compute_dtype(device: str | torch.device) -> torch.dtype:
    """The dtype a policy's dense weights and activations take on ``device``: BF16 where
    the NVFP4 kernels run (a GPU, or Triton's CPU interpreter in the tests), fp32 elsewhere.
    A CPU without BF16 arithmetic (AVX2, the common case) converts every BF16 product
    first, so its BF16 GEMMs run slower than its fp32 ones; a BF16 weight is exact in fp32."""
    kernels = torch.device(device).type == "cuda" or interpreting()
    return torch.bfloat16 if kernels else torch.float32


class PolicyError(QerlError):
    """A policy that cannot be built as asked."""


def peft_config(lora: LoraSettings, method: str) -> LoraConfig:
    """PEFT's configuration of ``lora`` on ``method``'s base."""
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), bias="none",
                        task_type="CAUSAL_LM")
    return _with_lora_layers(config, method)


def _with_lora_layers(config: LoraConfig, method: str) -> LoraConfig:
    """``config`` with our LoRA layers registered for ``method``'s base; QLoRA's NF4 layers
    keep PEFT's."""
    return config if method == "qlora" else register_lora_layers(config, method == "qerl")


@dataclass
class Policy:
    """A built policy: ``model`` is a PeftModel (a plain model for ``full``)."""

    method: str
    model: nn.Module
    config: PretrainedConfig
    source: str
    lora: LoraSettings | None = None
    aqn: AdaptiveQuantizationNoise | None = None
    # Writes the source's tokenizer and generation files into an export directory.
    save_extras: Callable[[Path], None] | None = field(default=None, repr=False)

    @property
    def base_model(self) -> nn.Module:
        """The transformers model (with LoRA layers injected, for the LoRA methods)."""
        return self.model.get_base_model() if isinstance(self.model, PeftModel) else self.model

    def trainable_parameters(self) -> dict[str, nn.Parameter]:
        return {n: p for n, p in self.model.named_parameters() if p.requires_grad}

    def norm_weights(self) -> dict[str, torch.Tensor]:
        """Every RMSNorm weight, by its name in the base model's state dict."""
        return {f"{name}.weight": m.weight for name, m in self.base_model.named_modules()
                if type(m).__name__.endswith("RMSNorm")}

    def save_adapter(self, directory: str | Path) -> Path:
        """PEFT's adapter files (adapter_config.json, adapter_model.safetensors), plus
        norms.safetensors when the norms train."""
        from safetensors.torch import save_file

        if self.lora is None:
            raise PolicyError(f"method {self.method!r} has no adapter; export the model")
        directory = Path(directory)
        self.model.save_pretrained(directory, selected_adapters=[ADAPTER])
        if self.lora.train_norms:
            save_file({n: w.detach().contiguous() for n, w in self.norm_weights().items()},
                      directory / NORMS_FILE)
        return directory


def build_policy(method: str, model: str | Path | None = None, *, arch: str | None = None,
                 seed: int = 0, lora: LoraSettings | None = None, aqn: AQNSettings | None = None,
                 total_steps: int | None = None, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None, embedding_on_host: bool = False) -> Policy:
    """Build ``method``'s policy from ``model`` (directory, hub id, .gguf file, NVFP4
    checkpoint directory) or ``arch`` (random weights drawn from ``seed``). ``aqn`` needs
    ``total_steps``, the run's number of optimizer steps, to place its stages; its noise is
    drawn from ``seed`` too. ``dtype``: the dense weights' (default ``compute_dtype``).
    ``embedding_on_host``: the input embedding's table in host memory
    (qerl.nn.host_embedding), never on ``device``."""
    if method not in METHODS:
        raise PolicyError(f"unknown method {method!r}; choose one of {', '.join(METHODS)}")
    if aqn is not None and total_steps is None:
        raise PolicyError("AQN needs total_steps (the run's optimizer steps) for its stages")
    device = torch.device(device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise PolicyError("device cuda was asked for, but no CUDA GPU is available")
    base, description, extras = load_base(method, model, arch=arch, seed=seed, device=device,
                                          dtype=dtype, embedding_on_host=embedding_on_host)
    lora = None if method == "full" else (lora or LoraSettings())
    if lora is None:
        for p in base.parameters():
            p.requires_grad_(True)
        wrapped = base
    else:
        _check_targets(base, lora.target_modules)
        for p in base.parameters():
            p.requires_grad_(False)
        wrapped = _stable(get_peft_model(base, peft_config(lora, method)))
    policy = Policy(method, wrapped, base.config, description, lora, save_extras=extras)
    if lora is not None and lora.train_norms:
        for w in policy.norm_weights().values():
            w.requires_grad_(True)
    if aqn is not None:
        policy.aqn = AdaptiveQuantizationNoise(policy.base_model, aqn, total_steps, seed)
    return policy


def _stable(model: PeftModel) -> PeftModel:
    """PEFT keeps target_modules as a set, which it saves in the process's hash order: a
    rerun would write a different adapter_config.json. Sorted lists save the same bytes."""
    for config in model.peft_config.values():
        for name, value in vars(config).items():
            if isinstance(value, set):
                setattr(config, name, sorted(value))
    return model


def load_adapter(policy: Policy, directory: str | Path, trainable: bool = False) -> Policy:
    """Load a saved adapter (and norms) onto a freshly built policy's base in place of its
    own LoRA; returns the policy."""
    from safetensors.torch import load_file

    directory = Path(directory)
    if policy.lora is None:
        raise PolicyError(f"method {policy.method!r} takes no adapter")
    if not directory.is_dir():
        raise PolicyError(f"no adapter directory at {directory}")
    if not (directory / "adapter_config.json").is_file():
        raise PolicyError(f"{directory}: no adapter_config.json; not a PEFT adapter")
    config = _with_lora_layers(LoraConfig.from_pretrained(directory), policy.method)
    base = policy.model.unload() if isinstance(policy.model, PeftModel) else policy.model
    try:
        policy.model = _stable(PeftModel.from_pretrained(base, directory, config=config,
                                                         is_trainable=trainable))
    except (RuntimeError, ValueError, KeyError) as e:  # PEFT's shape and target errors
        # torch lists every mismatching tensor, one per line: name the first.
        problems = [line.strip() for line in str(e).splitlines()[1:] if line.strip()]
        detail = problems[0] if problems else str(e)
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise PolicyError(f"{directory}: the adapter does not fit this base model: "
                          f"{detail}{more}") from e
    norms = directory / NORMS_FILE
    if norms.is_file():
        current = policy.norm_weights()
        with torch.no_grad():
            for name, value in load_file(norms).items():
                if name not in current:
                    raise PolicyError(f"{norms}: {name} is not a norm of this model")
                current[name].copy_(value)
    return policy


# ---- the base model -----------------------------------------------------------------------

def load_base(method: str, model: str | Path | None, *, arch: str | None = None,
              seed: int = 0, device: str | torch.device = "cpu",
              dtype: torch.dtype | None = None, embedding_on_host: bool = False
              ) -> tuple[nn.Module, str, Callable[[Path], None]]:
    """(model, description, writer of its tokenizer files) for ``method``, its dense
    weights in ``dtype`` (default ``compute_dtype(device)``), the input embedding in host
    memory with ``embedding_on_host``."""
    device = torch.device(device)
    dtype = dtype or compute_dtype(device)
    if model is not None and is_nvfp4_checkpoint(Path(model)):
        ckpt = load_checkpoint(model, device)
        config = _config_from_dict(ckpt.config)
        built = _from_checkpoint(method, ckpt, config, device, dtype, embedding_on_host)
        return built, f"{model} (NVFP4 checkpoint)", partial(copy_extras, Path(model))
    source = open_source(None if model is None else str(model), arch=arch, seed=seed)
    _check_architecture(source.config, source.description)
    return (_from_source(method, source, device, dtype, embedding_on_host),
            source.description, source.save_extras)


def base_config(model: str | Path | None, *, arch: str | None = None) -> PretrainedConfig:
    """The transformers config of the base ``load_base`` would build, read without building
    it (nothing goes to a GPU; a GGUF file is read whole, on the CPU)."""
    if model is not None and is_nvfp4_checkpoint(Path(model)):
        return _config_from_dict(read_json(Path(model) / "config.json"))
    config = open_source(None if model is None else str(model), arch=arch).config
    _check_architecture(config, str(model or arch))
    return config


def is_nvfp4_checkpoint(path: Path) -> bool:
    """Whether ``path`` is a checkpoint in qerl's (compressed-tensors NVFP4) format."""
    if not (path / "config.json").is_file():
        return False
    qc = read_json(path / "config.json").get("quantization_config") or {}
    return qc.get("format") == FORMAT


def default_method(model: str | Path, adapter: str | Path | None) -> str:
    """The method a saved model is read with when none is named: qerl for an NVFP4
    checkpoint, lora for a BF16 base with an adapter, full for a plain model."""
    return "qerl" if is_nvfp4_checkpoint(Path(model)) else "lora" if adapter else "full"


def _config_from_dict(config: dict) -> PretrainedConfig:
    config = {k: v for k, v in config.items() if k != "quantization_config"}
    model_type = config.pop("model_type", None)
    try:
        built = AutoConfig.for_model(model_type, **config)
    except (ValueError, KeyError) as e:
        raise ArchitectureError(f"unknown architecture (model_type {model_type!r}): {e}") from e
    _check_architecture(built, f"model_type {model_type!r}")
    return built


def _check_architecture(config: PretrainedConfig, where: str) -> None:
    if config.model_type not in MODEL_TYPES:
        raise ArchitectureError(f"{where}: architecture {config.model_type!r} is not supported "
                                f"(supported: {', '.join(MODEL_TYPES)})")


def _skeleton(config: PretrainedConfig, dtype: torch.dtype) -> nn.Module:
    """The model with its parameters on the meta device (buffers such as rotary tables are
    real, on the CPU)."""
    config.dtype = dtype
    with init_empty_weights(include_buffers=False):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _linear_names(model: nn.Module) -> list[str]:
    return [name for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and name.rpartition(".")[2] not in KEEP_DENSE]


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent), leaf, module)


def _set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    parent, _, leaf = name.rpartition(".")
    owner = model.get_submodule(parent)
    if leaf in owner._parameters:
        owner._parameters[leaf] = nn.Parameter(value, requires_grad=False)
    else:
        owner._buffers[leaf] = value


def _dense_linear(weight: torch.Tensor, bias: torch.Tensor | None,
                  dtype: torch.dtype) -> nn.Linear:
    out_features, in_features = weight.shape
    with init_empty_weights():
        layer = nn.Linear(in_features, out_features, bias=bias is not None)
    layer.weight = nn.Parameter(_bf16_in(weight, dtype), requires_grad=False)
    if bias is not None:
        layer.bias = nn.Parameter(_bf16_in(bias, dtype), requires_grad=False)
    return layer


def _bf16_in(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A float weight as BF16 holds it, in ``dtype``: the same values on a CPU (fp32) as
    the GPU's BF16 policy has."""
    return t.to(torch.bfloat16).to(dtype) if t.is_floating_point() else t


def _from_source(method: str, source: Source, device: torch.device,
                 dtype: torch.dtype, embedding_on_host: bool = False) -> nn.Module:
    model = _skeleton(source.config, dtype)
    names = set(source.names())
    linears = _linear_names(model)
    missing = sorted({f"{n}.weight" for n in linears} - names)
    if missing:
        raise ArchitectureError(f"{source.description} lacks tensor(s) {missing[:5]}")
    for group in fusion_groups(linears):
        wanted = [f"{n}.{p}" for n in group for p in ("weight", "bias") if f"{n}.{p}" in names]
        tensors = source.load(wanted, device)
        weights = {n: tensors[f"{n}.weight"] for n in group}
        quantized = quantize_group(weights)[0] if method == "qerl" else {}
        for n in group:
            bias = tensors.get(f"{n}.bias")
            if n in quantized:
                layer = NVFP4Linear(quantized[n], None if bias is None else bias.to(torch.bfloat16))
            else:
                layer = _dense_linear(weights[n], bias, dtype)
            _set_module(model, n, layer)
        del tensors, weights, quantized
    consumed = {f"{n}.{p}" for n in linears for p in ("weight", "bias")}
    # The rest (embeddings, lm_head, norms) made in host memory and cast there, and moved by
    # _finish: a budget's cap is on while the model is built, and random weights are drawn
    # in fp32 before the cast (7B's lm_head drawn on the GPU beside its bf16 copy ran a
    # capped build out of memory: results/bench/budget_*.csv, 7B at 8 GB on the H100); an
    # input embedding kept in host memory never reaches the GPU.
    for name in sorted(names - consumed):
        t = source.load([name], torch.device("cpu"))[name]
        _set_tensor(model, name, _bf16_in(t, dtype))
    return _finish(model, method, device, source.description, dtype, embedding_on_host)


def _from_checkpoint(method: str, ckpt: NVFP4Checkpoint, config: PretrainedConfig,
                     device: torch.device, dtype: torch.dtype,
                     embedding_on_host: bool = False) -> nn.Module:
    model = _skeleton(config, dtype)
    for name in _linear_names(model):
        bias = ckpt.dense.get(f"{name}.bias")
        if name in ckpt.quantized:
            q = ckpt.quantized[name]
            layer = (NVFP4Linear(q, bias) if method == "qerl"
                     else _dense_linear(nvfp4.dequantize(q, torch.bfloat16), bias, dtype))
        elif f"{name}.weight" in ckpt.dense:  # listed in the checkpoint's ignore
            layer = _dense_linear(ckpt.dense[f"{name}.weight"], bias, dtype)
        else:
            raise ArchitectureError(f"the checkpoint has no weight for {name}")
        _set_module(model, name, layer)
    linear_tensors = {f"{n}.{p}" for n in _linear_names(model) for p in ("weight", "bias")}
    for name, t in ckpt.dense.items():
        if name not in linear_tensors:
            _set_tensor(model, name, _bf16_in(t, dtype))
    return _finish(model, method, device, "the NVFP4 checkpoint", dtype, embedding_on_host)


def _finish(model: nn.Module, method: str, device: torch.device, where: str,
            dtype: torch.dtype, embedding_on_host: bool = False) -> nn.Module:
    if getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
    if method == "qlora":
        _to_nf4(model, device, dtype)
    if embedding_on_host:
        if method == "full":
            raise PolicyError("method full trains the input embedding; it cannot stay in "
                              "host memory")
        model.get_input_embeddings().weight.requires_grad_(False)  # LoRA freezes the base
        embedding_to_host(model)  # refuses a tied table; .to(device) below leaves it there
    model.to(device)
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()]
            if t.device.type == "meta"]
    if left:
        raise ArchitectureError(f"{where} lacks tensor(s) {left[:5]}")
    model.eval()  # no dropout in rollouts; the trainer switches modes as it needs
    return model


def _to_nf4(model: nn.Module, device: torch.device, dtype: torch.dtype) -> None:
    """QLoRA's base: every decoder Linear as bitsandbytes NF4 with double quantization,
    computing in the policy's dtype (BF16 on a GPU)."""
    try:
        import bitsandbytes as bnb
    except ImportError as e:
        raise PolicyError("method 'qlora' needs bitsandbytes: pip install 'qerl[qlora]'") from e
    for name in _linear_names(model):
        dense = model.get_submodule(name)
        if device.type == "cpu" and dense.in_features % NF4_BLOCK:
            raise PolicyError(f"bitsandbytes' CPU NF4 matmul needs in_features % {NF4_BLOCK} "
                              f"== 0; {name} has {dense.in_features} (use a GPU)")
        layer = bnb.nn.Linear4bit(dense.in_features, dense.out_features,
                                  bias=dense.bias is not None, compute_dtype=dtype,
                                  compress_statistics=True, quant_type="nf4", device="meta")
        layer.weight = bnb.nn.Params4bit(dense.weight.data, requires_grad=False,
                                         compress_statistics=True, quant_type="nf4")
        if dense.bias is not None:
            layer.bias = nn.Parameter(dense.bias.data, requires_grad=False)
        try:
            layer = layer.to(device)  # bitsandbytes quantizes on the move
        except (RuntimeError, NotImplementedError, ValueError) as e:
            raise PolicyError(f"bitsandbytes {bnb.__version__} cannot quantize NF4 on "
                              f"{device}: {e}") from e
        # On CPUs with AVX512-BF16, bitsandbytes repacks the weight the first time the
        # layer runs in eval mode (a rollout) and keeps its inference path afterwards,
        # which then fails in training (0.50: the bias is added in place on a tensor that
        # needs grad). The policy alternates the two, so it stays on the training path.
        layer.support_avx512bf16_for_cpu = False
        _set_module(model, name, layer)


def _check_targets(model: nn.Module, targets: tuple[str, ...]) -> None:
    leaves = {name.rpartition(".")[2] for name, _ in model.named_modules()}
    unknown = [t for t in targets if t not in leaves]
    if unknown:
        linears = sorted({n.rpartition(".")[2] for n in _linear_names(model)})
        raise PolicyError(f"LoRA target module(s) {unknown} match nothing in the model; its "
                          f"projections are {linears}")
