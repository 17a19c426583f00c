"""GPU-only benchmarks say so on a machine without one, instead of timing the CPU."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from qerl.cli import main
from qerl.report.collect import collect

pytestmark = pytest.mark.usefixtures("reference_kernels")

RESULTS = Path(__file__).resolve().parents[1] / "results" / "bench"


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a GPU")
@pytest.mark.parametrize("what", ["kernels", "kernel-paths", "token-tiles", "memory", "rollout",
                                  "decode-step", "step", "budget"])
def test_gpu_benchmarks_name_the_missing_gpu(what):
    with pytest.raises(SystemExit, match="needs a CUDA GPU"):
        main(["bench", what])


def test_the_step_benchmark_times_each_phase_against_lora(tmp_path, capsys):
    """qerl bench step's logic on the CPU (its GPU run is the same code): one child
    process per method, every phase timed, its table's speed relative to LoRA printed."""
    import pandas as pd

    from qerl.rl.phases import PHASES

    main(["bench", "step", "--archs", "tiny-llama", "--methods", "lora,qerl", "--prompts",
          "1", "--generations", "2", "--completion", "4", "--micro-batch", "2", "--steps",
          "2", "--device", "cpu", "--out-dir", str(tmp_path)])
    rows = pd.read_csv(next(tmp_path.glob("efficiency_*.csv")))
    assert list(rows.method) == ["lora", "qerl"] and set(rows.status) == {"ok"}
    assert (rows[[f"{p}_s" for p in PHASES]] > 0).all().all()
    assert rows.step_s.tolist() == pytest.approx(
        rows[[f"{p}_s" for p in PHASES]].sum(axis=1).tolist(), abs=2e-3)
    table = capsys.readouterr().out
    assert "speed_vs_lora" in table and table.count("| tiny-llama ") == 2


def test_the_step_benchmark_gives_each_child_one_of_the_visible_gpus(monkeypatch):
    from qerl.bench.step import gpu_env

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6,7")
    assert [e["CUDA_VISIBLE_DEVICES"] for e in gpu_env(["0", "2"])] == ["4", "7"]
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert [e["CUDA_VISIBLE_DEVICES"] for e in gpu_env(["1"])] == ["1"]


def test_the_step_benchmark_refuses_a_micro_batch_that_does_not_divide(tmp_path):
    with pytest.raises(SystemExit):
        main(["bench", "step", "--prompts", "1", "--generations", "2", "--micro-batch", "3"])


def test_the_entropy_benchmark_compares_weight_formats(chat_model, tmp_path):
    import pandas as pd

    out = tmp_path / "science/tiny/entropy"
    main(["bench", "entropy", "--model", str(chat_model), "--data",
          "tests/data/gsm8k_test.jsonl", "--prompts", "4", "--tokens", "4", "--weights",
          "bf16,nvfp4,nvfp4+aqn", "--device", "cpu", "--out-dir", str(out)])
    rows = pd.read_csv(next(out.glob("entropy_*.csv"))).set_index("weights")
    assert list(rows.index) == ["bf16", "nvfp4", "nvfp4+aqn"]
    assert (rows.own_low <= rows.own_entropy).all() and (rows.own_entropy <= rows.own_high).all()
    assert rows.loc["bf16", "shared_minus_bf16"] == 0  # BF16 scores its own completions
    assert rows.loc["nvfp4+aqn", "sigma"] == 0.01 and rows.loc["nvfp4", "sigma"] == 0
    # Where the workflow puts it, so that qerl report reads it.
    assert collect(tmp_path).frames["entropy"].method.tolist() == list(rows.index)


def test_the_entropy_benchmark_refuses_unknown_weights():
    with pytest.raises(SystemExit):
        main(["bench", "entropy", "--data", "x.jsonl", "--weights", "bf16,int3"])


def test_the_footprint_estimate_matches_the_measured_steps(tmp_path):
    """The estimate against every `qerl bench step` run on the H100 (committed results):
    within 10% at 3B-72B, QLoRA included; the runs that ran out of memory estimated above
    the card's 80 GB. The weights term is the NVFP4 checkpoint's size (5.85 GB)."""
    import pandas as pd

    from qerl.bench.footprint import estimate, measured_peaks

    assert estimate("qwen2.5-7b", "qerl", 2, 8, 2048, 8)["weights"] == pytest.approx(5.85,
                                                                                     rel=0.01)
    peaks = measured_peaks(RESULTS / "efficiency_NVIDIA_H100_80GB_HBM3.csv")
    assert len(peaks) >= 12
    for (model, method, p, g, length, micro_batch, rank), (status, peak) in peaks.items():
        total = estimate(model, method, p, g, length, micro_batch, rank=rank)["total"]
        if status == "oom":
            assert total > 80, model
        else:
            assert total == pytest.approx(peak, rel=0.1), (model, method)
    main(["bench", "footprint", "--archs", "qwen2.5-72b", "--methods", "qerl", "--prompts",
          "1", "--micro-batch", "8,1", "--out-dir", str(tmp_path)])
    rows = pd.read_csv(tmp_path / "footprint_P1_G8_L2048.csv")
    assert rows.total.iloc[0] > 80 > rows.total.iloc[1]  # a smaller micro-batch fits
    assert rows.checkpointed.iloc[0] == pytest.approx(8 * rows.checkpointed.iloc[1], rel=0.01)


def test_the_footprint_shows_what_each_memory_measure_saves(tmp_path):
    """--measures: after each step, the same with a budget's measures taken one by one. At
    7B (untied; vocab 152064 x hidden 3584 in BF16) the embedding saves its table, the
    released cache leaves the larger of the cache and the training's activations, and the
    host optimizer half the adapters' 16 bytes a parameter, the offloaded layer inputs all
    but the one layer's brought back; the measured peak stays with the step that took none.
    3B ties its embedding: no embedding row."""
    import pandas as pd

    main(["bench", "footprint", "--archs", "qwen2.5-7b,qwen2.5-3b", "--methods", "qerl",
          "--prompts", "1", "--micro-batch", "1", "--measures", "--out-dir", str(tmp_path)])
    rows = pd.read_csv(tmp_path / "footprint_P1_G8_L2048.csv")
    seven = rows[rows.model == "qwen2.5-7b"].set_index("measures")
    assert list(seven.index) == [
        "none", "offload.embedding", "offload.embedding+engine.release_cache",
        "offload.embedding+engine.release_cache+offload.optimizer",
        "offload.embedding+engine.release_cache+offload.optimizer+offload.activations"]
    none, emb, released, host, inputs = (seven.iloc[i] for i in range(5))
    assert none.weights - emb.weights == pytest.approx(152064 * 3584 * 2 / 1e9, abs=0.01)
    training = released.checkpointed + max(released.layer, released.logprob)
    assert released.total == pytest.approx(
        released.weights + released.lora + max(released.kv_cache, training), abs=0.02)
    assert host.lora == pytest.approx(released.lora / 2, abs=0.01)
    assert inputs.checkpointed == pytest.approx(host.checkpointed / 28, abs=0.01)  # a layer's
    assert list(rows[rows.model == "qwen2.5-3b"].measures) == [
        "none", "engine.release_cache", "engine.release_cache+offload.optimizer",
        "engine.release_cache+offload.optimizer+offload.activations"]


def test_the_footprint_refuses_what_it_does_not_model(tmp_path):
    with pytest.raises(SystemExit, match="methods are"):
        main(["bench", "footprint", "--methods", "full", "--out-dir", str(tmp_path)])
    with pytest.raises(SystemExit, match="does not exist"):
        main(["bench", "footprint", "--measured", str(tmp_path / "x.csv")])


def test_layer_sweeps_refuse_a_layer_a_model_lacks_before_measuring():
    from qerl.bench.layer_sweep import model_layers

    grid = model_layers("kernel-paths", "qwen2.5-7b,qwen2.5-32b", "gate_up,down")
    assert [(arch, layer) for arch, layer, _ in grid] == [
        ("qwen2.5-7b", "gate_up"), ("qwen2.5-7b", "down"), ("qwen2.5-32b", "gate_up"),
        ("qwen2.5-32b", "down")]
    assert grid[0][2] == (37888, 3584)
    with pytest.raises(SystemExit, match=r"qerl bench token-tiles: no layer \['gateup'\]"):
        model_layers("token-tiles", "qwen2.5-7b", "gate_up,gateup")


def test_layer_sweeps_record_each_layer_as_it_is_measured(tmp_path):
    import pandas as pd

    from qerl.bench.layer_sweep import model_layers, record_sweep

    grid = model_layers("kernel-paths", "qwen2.5-7b", "o,qkv")
    path = tmp_path / "sweep.csv"
    record_sweep(path, {"card": "cpu"}, grid, lambda n, k: [{"M": m, "N": n, "K": k}
                                                           for m in (1, 64)], copy_gbps=2.5)
    rows = pd.read_csv(path)
    assert list(rows.columns) == ["card", "copy_gbps", "layer", "M", "N", "K"]
    assert list(rows.layer) == ["qwen2.5-7b.o"] * 2 + ["qwen2.5-7b.qkv"] * 2
    assert list(rows.N) == [3584, 3584, 4608, 4608] and set(rows.copy_gbps) == {2.5}


def assert_fresh_prompts(calls: list[list[list[int]]], batches: list[int], length: int,
                         group: int = 1):
    """Three calls a batch (warm-up, first token, timed), each with prompts no other call
    had (vLLM's prefix cache would otherwise skip the later calls' prefill), each prompt
    ``group`` times in a row."""
    assert [len(c) for c in calls] == [b for b in batches for _ in range(3)]
    assert all(len(p) == length for c in calls for p in c)
    for c in calls:
        assert all(c[i] == c[i - i % group] for i in range(len(c)))
    seen = [tuple(p) for c in calls for p in c[::group]]
    assert len(set(seen)) == len(seen)


def test_vllm_rows_serve_our_exports_with_and_without_an_adapter(fake_vllm, tmp_path):
    """vLLM's rollout rows (stand-in vLLM, CPU): the NVFP4 rows serve qerl's export, the BF16
    rows vLLM's dummy weights of the shape; rank 0 serves no adapter; every sequence is
    asked for and checked at the full length; the exports go when the rows are made."""
    from qerl.bench.vllm_rollout import WARM_UP_TOKENS, bench_vllm
    from tests.fake_vllm import FakeLLM

    for kind, load in (("vllm-nvfp4", "auto"), ("vllm-bf16", "dummy")):
        FakeLLM.instances = []
        rows = bench_vllm("tiny-llama", kind, [0, 16], [1, 3], [5], 40, tmp_path / kind,
                          device="cpu", isolate=False)
        assert [(r["lora_rank"], r["batch"], r["gen_len"]) for r in rows] == [
            (0, 1, 40), (0, 3, 40), (16, 1, 40), (16, 3, 40)]
        assert all(r["tok_per_s"] > 0 and r["peak_gb"] is None for r in rows)
        without, with_lora = FakeLLM.instances
        assert without.kwargs["load_format"] == with_lora.kwargs["load_format"] == load
        assert not without.kwargs["enable_lora"] and with_lora.kwargs["enable_lora"]
        assert with_lora.kwargs["max_lora_rank"] == 16
        assert ("nvfp4" in with_lora.config_text) == (kind == "vllm-nvfp4")
        weights = [f for f in with_lora.files if f.endswith(".safetensors")]
        assert bool(weights) == (kind == "vllm-nvfp4")  # dummy BF16: the shape alone
        # Each batch: a short warm-up (vLLM captured its graphs at start), a call to the
        # first token, then the timed call, every sequence asked for the full length.
        lengths = [{(one["min_tokens"], one["max_tokens"]) for one in sampling}
                   for _, sampling, _ in with_lora.calls]
        assert lengths == [{(WARM_UP_TOKENS, WARM_UP_TOKENS)}, {(1, 1)}, {(40, 40)}] * 2
        assert_fresh_prompts(with_lora.prompts, [1, 3], 5)
        assert all(r["first_token_s"] >= 0 and r["step_ms"] is not None for r in rows)
        _, sampling, request = with_lora.calls[-1]
        assert all(one["ignore_eos"] for one in sampling)
        assert request.lora_path.endswith("r16/adapter")
        assert without.calls[-1][2] is None
        assert list((tmp_path / kind).iterdir()) == []


def test_vllm_rows_serve_each_kv_cache_format_as_vllms_own_option(fake_vllm, tmp_path):
    """Our fp8 KV cache is vLLM's kv_cache_dtype "fp8" (no scales given: vLLM's default),
    BF16's its "auto" (the model's dtype), each in an engine of its own from one export, and
    each row names the format (stand-in vLLM, CPU)."""
    from qerl.bench.vllm_rollout import VLLM_KV_CACHE, bench_vllm
    from qerl.formats.kv_cache import KV_CACHES
    from tests.fake_vllm import FakeLLM

    assert set(VLLM_KV_CACHE) == set(KV_CACHES)
    rows = bench_vllm("tiny-llama", "vllm-nvfp4", [0], [1], [5], 4, tmp_path, device="cpu",
                      isolate=False, caches=("fp8", "bf16"))
    assert [llm.kwargs["kv_cache_dtype"] for llm in FakeLLM.instances] == ["fp8", "auto"]
    assert not any("kv_scale" in key for llm in FakeLLM.instances for key in llm.kwargs)
    assert [(r["kv_cache"], r["batch"]) for r in rows] == [("fp8", 1), ("bf16", 1)]
    FakeLLM.instances = []
    bench_vllm("tiny-llama", "vllm-bf16", [0], [1], [5], 4, tmp_path, device="cpu",
               isolate=False)
    assert [llm.kwargs["kv_cache_dtype"] for llm in FakeLLM.instances] == ["auto"]


def test_vllm_rows_refuse_a_wrong_length_and_a_missing_vllm(fake_vllm, tmp_path, monkeypatch):
    import sys

    from qerl.bench.vllm_rollout import VLLMBenchError, _isolated, bench_vllm
    from tests.fake_vllm import FakeLLM

    FakeLLM.length_factor = 0
    with pytest.raises(VLLMBenchError, match=r"generated \[0\] tokens a sequence, not 4"):
        bench_vllm("tiny-llama", "vllm-bf16", [0], [2], [5], 4, tmp_path, device="cpu",
                   isolate=False)
    assert list(tmp_path.iterdir()) == []  # the export went anyway
    # In a process of its own (as on a GPU), a failure there comes back as an error here.
    with pytest.raises(VLLMBenchError, match="vLLM's run failed: ModuleNotFoundError"):
        _isolated((tmp_path, None, 0, "vllm-bf16", [1], [5], 4, 100, 0.5))
    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(VLLMBenchError, match=r"pip install 'qerl\[vllm\]'"):
        bench_vllm("tiny-llama", "vllm-bf16", [0], [1], [5], 4, tmp_path, device="cpu")


def test_the_rollout_benchmark_makes_its_vllm_workdir(tmp_path, monkeypatch):
    """A --workdir that does not exist yet is made before any row runs (it was found missing
    only after the engine's rows, and the vLLM rows were lost)."""
    import qerl.bench.rollout as rollout

    made = []
    monkeypatch.setattr(rollout.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rollout, "provenance", lambda device: {"card": "Stand-in"})
    monkeypatch.setattr(rollout, "bench_vllm",
                        lambda *args, **kwargs: made.append(args[-1].parent) or [])
    monkeypatch.setattr(rollout, "summary", lambda *args, **kwargs: "")
    work = tmp_path / "not" / "yet"
    rollout.main(["--archs", "qwen2.5-7b", "--weights", "vllm-bf16", "--batches", "1",
                  "--prompt-lens", "8", "--workdir", str(work), "--out-dir", str(tmp_path)])
    assert made == [work]


def test_engine_rows_time_the_first_token_and_a_step_on_fresh_prompts(monkeypatch):
    """The engine's rollout rows (CPU, a tiny model): a warm-up, a call to the first token
    and the timed call, each on prompts of its own; the row has the first token's time and
    the decode step's (the rest of the timed call over its other tokens)."""
    from qerl.bench import rollout
    from qerl.rollout import Engine
    from tests.rollout.test_engine import tiny

    calls = []
    generate = Engine.generate

    def recorded(self, prompts, params):
        calls.append((prompts, params.max_new_tokens))
        return generate(self, prompts, params)

    monkeypatch.setattr(Engine, "generate", recorded)
    model = tiny("qwen2", torch.float32, 0)
    rows = rollout.bench_engine(model, [1, 3], [5], 6, fused=False)
    assert [n for _, n in calls] == [6, 1, 6] * 2
    assert_fresh_prompts([p for p, _ in calls], [1, 3], 5)
    assert [(r["batch"], r["gen_len"]) for r in rows] == [(1, 6), (3, 6)]
    calls.clear()
    rollout.bench_engine(model, [2, 6], [5], 6, fused=False, group=2)  # GRPO-shaped
    assert_fresh_prompts([p for p, _ in calls], [2, 6], 5, group=2)
    with pytest.raises(ValueError, match="a batch of 3 is not a whole number of groups of 2"):
        rollout.bench_engine(model, [3], [5], 6, fused=False, group=2)
    for r in rows:
        assert 0 < r["first_token_s"] < r["seconds"]
        # From the unrounded times: the two roundings to 1 ms move it by up to 0.2 ms.
        assert r["step_ms"] == pytest.approx(
            (r["seconds"] - r["first_token_s"]) / 5 * 1e3, abs=0.21)


def test_the_rollout_benchmark_refuses_a_group_that_splits_a_batch(capsys):
    """Said before anything runs (on this CPU-only machine too)."""
    import qerl.bench.rollout as rollout

    with pytest.raises(SystemExit):
        rollout.main(["--batches", "8,12", "--group", "8"])
    assert "--group 8 must divide every batch (8,12)" in capsys.readouterr().err


def test_rollout_benchmarks_measure_the_batches_whose_cache_fits(monkeypatch, capsys):
    """A batch too large for the card is named and skipped, and the smaller ones are still
    measured: an out-of-memory error had ended the run and lost their rows."""
    from qerl.bench.throughput import largest_engine
    from qerl.rollout import engine as engine_module
    from tests.rollout.test_engine import tiny

    model = tiny("qwen2", torch.float32, 0)
    per_token = 2 * 2 * 2 * 16 * 4  # k and v, 2 layers, 2 kv heads, head_dim 16, fp32
    monkeypatch.setattr(engine_module, "free_bytes", lambda device: 2 * 100 * per_token)
    engine, fit = largest_engine(model, [1, 2, 4, 8], 100)
    assert engine.max_batch == 2 and fit == [1, 2]
    said = capsys.readouterr().out
    assert "batch 8: not measured: a KV cache for 8 sequences" in said
    assert "batch 4: not measured" in said
    monkeypatch.setattr(engine_module, "free_bytes", lambda device: 99 * per_token)
    assert largest_engine(model, [1, 2], 100) == (None, [])


def test_a_decode_steps_kernel_time_is_summed_by_the_part_it_does(monkeypatch):
    """Kernels named as an H200's profiles name them fall in their part of the step (the
    rest in "other"), the parts add up to the step's kernel time, and the sampling of the
    step's tokens is profiled on its own (CPU, a tiny engine, the profiler's events given)."""
    from types import SimpleNamespace

    from qerl.bench import decode_step
    from qerl.rollout import Engine
    from tests.rollout.test_engine import tiny

    names = {"nvjet_sm90_tst_320x64_64x4_4x1_v_bz_TNT": "matmul",
             "void (anonymous namespace)::nvfp4_gemm_kernel<tr": "matmul",
             "void cublasLt::splitKreduce_kernel<32, 16, int, ": "matmul",
             "void cutlass::Kernel2<cutlass_80_simt_sgemm_64x6": "matmul",
             "lora_shrink_kernel": "lora", "lora_expand_kernel": "lora",
             "decode_split_kernel": "attention",
             "cudnn_generated_fort_native_sdpa_sm80_flash_fpro": "attention",
             "rms_norm_kernel": "norm", "rotary_cache_kernel": "norm",
             "void at::native::unrolled_elementwise_kernel<at:": "other"}
    assert {name: decode_step.part_of(name) for name in names} == names

    def event(key, us, count=1):
        return SimpleNamespace(key=key, device_time_total=us, count=count)

    step = [event(name, 100.0 * (i + 1)) for i, name in enumerate(names)]
    step.append(event("cudaLaunchKernel", 0.0))  # an API call: no device time
    profiles = iter([step, [event("sample_partial_kernel", 30.0),
                            event("sample_combine_kernel", 20.0)]])

    def profiled(fn):
        fn()
        return SimpleNamespace(key_averages=lambda: next(profiles))

    monkeypatch.setattr(decode_step, "_profiled", profiled)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    engine = Engine(tiny("qwen2", torch.float32, 0), max_batch=2, max_seq_len=16, fused=False)
    ids = torch.zeros((2, 1), dtype=torch.long)
    kernels, kernel_ms, top, parts = decode_step._kernels(engine, ids, 4, torch.tensor(4), 2)
    assert kernels == len(names) and top.startswith("void at::native::unrolled")
    assert kernel_ms == pytest.approx(sum(100.0 * (i + 1) for i in range(len(names))) / 1e3)
    assert parts == pytest.approx({"matmul": 1.0, "lora": 1.1, "attention": 1.5, "norm": 1.9,
                                   "other": 1.1, "sampling": 0.05})
    assert sum(v for k, v in parts.items() if k != "sampling") == pytest.approx(kernel_ms)


def test_a_prefill_is_timed_with_the_time_its_kernels_run(monkeypatch):
    """The decode-step benchmark's prefill (CPU, a tiny engine, the profiler's kernels
    given): its wall time, and the union of its kernels' spans; the call fills the cache of
    as many prompts as asked, after a warm-up of the same shape; its wall time is the median of
    as many calls as its budget holds."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from qerl.bench import decode_step
    from qerl.rollout import Engine
    from tests.rollout.test_engine import tiny

    def kernel(start, end):
        return SimpleNamespace(device_type=DeviceType.CUDA,
                               time_range=SimpleNamespace(start=start, end=end))

    def profiled(fn):
        fn()
        host = SimpleNamespace(device_type=DeviceType.CPU,
                               time_range=SimpleNamespace(start=0.0, end=5000.0))
        return SimpleNamespace(events=lambda: [host, kernel(0.0, 300.0), kernel(100.0, 400.0),
                                               kernel(1000.0, 1200.0)])

    monkeypatch.setattr(decode_step, "_profiled", profiled)
    engine = Engine(tiny("qwen2", torch.float32, 0), max_batch=3, max_seq_len=16, fused=False)
    prefills = []
    run = Engine._prefill
    monkeypatch.setattr(Engine, "_prefill",
                        lambda self, ids, pad: prefills.append(ids.shape) or run(self, ids, pad))
    wall, busy = decode_step._prefill_ms(engine, 3, 7, budget_s=0.0)
    assert prefills == [(3, 7)] * 3 and busy == pytest.approx(0.6) and wall > 0
    prefills.clear()
    times = iter([0.1, 0.3, 0.9, 0.2, 5.0, 0.4])
    monkeypatch.setattr(decode_step, "timed", lambda fn: fn() or next(times))
    wall, _ = decode_step._prefill_ms(engine, 3, 7, budget_s=0.5, most=5)
    # the first call (0.1 s) says five fit in 0.5 s; their median, not their mean, is kept
    assert prefills == [(3, 7)] * 7 and wall == pytest.approx(400.0)


def test_decode_step_runs_the_engines_asked_for(monkeypatch, tmp_path, capsys):
    """--fused picks the engines measured (ours, the model's own modules or both); anything
    else is refused before a GPU is looked for."""
    from qerl.bench import decode_step, rollout

    for bench in (decode_step, rollout):  # one flag, one check (bench/throughput.py)
        with pytest.raises(SystemExit):
            bench.main(["--fused", "2"])
        assert "--fused takes 1, 0 or both" in capsys.readouterr().err
    seen = []
    monkeypatch.setattr(decode_step.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(decode_step, "provenance", lambda device: {"card": "card"})
    monkeypatch.setattr(decode_step, "measure",
                        lambda *args: seen.append(args[-2]) or [])
    decode_step.main(["--out-dir", str(tmp_path), "--weights", "bf16", "--fused", "1"])
    decode_step.main(["--out-dir", str(tmp_path), "--weights", "bf16"])
    assert seen == [(True,), (True, False)]


def test_the_rollout_benchmarks_take_kv_cache_formats(monkeypatch, tmp_path, capsys):
    """--kv-cache takes a comma list of engine.kv_cache's formats (default BF16's alone),
    each measured in order; an unknown or repeated one is refused by the option's name
    before a GPU is looked for."""
    from qerl.bench import decode_step, rollout

    for bench in (decode_step, rollout):  # one option, one check (bench/throughput.py)
        for bad in ("int8", "bf16,fp4", "fp8,fp8", ""):
            with pytest.raises(SystemExit):
                bench.main(["--kv-cache", bad])
            assert "--kv-cache takes each of bf16, fp8 at most once" in capsys.readouterr().err
    seen = []
    monkeypatch.setattr(decode_step.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(decode_step, "provenance", lambda device: {"card": "card"})
    monkeypatch.setattr(decode_step, "measure", lambda *args: seen.append(args[-1]) or [])
    for given in ([], ["--kv-cache", "fp8"], ["--kv-cache", "fp8,bf16"]):
        decode_step.main(["--out-dir", str(tmp_path), "--weights", "bf16", *given])
    assert seen == [("bf16",), ("fp8",), ("fp8", "bf16")]


@pytest.fixture
def engines_made(monkeypatch) -> list[tuple]:
    """(kv_cache, the cache's dtype, fused) of each Engine made from now on."""
    from qerl.rollout import Engine

    made, init = [], Engine.__init__

    def spied(self, *args, **kwargs):
        init(self, *args, **kwargs)
        made.append((self.kv_cache, self.cache.k.dtype, self.decoder.fused))

    monkeypatch.setattr(Engine, "__init__", spied)
    return made


def test_a_decode_step_is_measured_in_each_kv_cache_format(monkeypatch, engines_made):
    """Each format asked for gets an engine of its own, in that format, for every batch,
    and each row names its format (CPU, a tiny model; the profiler's events and the
    prefill's time given)."""
    from types import SimpleNamespace

    from qerl.bench import decode_step
    from tests.rollout.test_engine import tiny

    model = tiny("qwen2", torch.float32, 0)
    monkeypatch.setattr(decode_step, "build_policy", lambda *args, **kwargs: model)
    def profiled(fn):
        fn()
        return SimpleNamespace(key_averages=lambda: [], events=lambda: [])

    monkeypatch.setattr(decode_step, "_profiled", profiled)
    monkeypatch.setattr(decode_step, "_prefill_ms", lambda engine, batch, length: (1.0, 0.5))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    rows = decode_step.measure("tiny", "bf16", 4, [1, 2], 6, 5, engines=(False,),
                               caches=("bf16", "fp8"))
    assert engines_made == [("bf16", torch.float32, False),
                            ("fp8", torch.float8_e4m3fn, False)]
    assert [(r["kv_cache"], r["batch"], r["fused"]) for r in rows] == [
        ("bf16", 1, 0), ("bf16", 2, 0), ("fp8", 1, 0), ("fp8", 2, 0)]


def test_the_rollout_benchmark_runs_each_engine_in_each_kv_cache_format(
        monkeypatch, tmp_path, engines_made):
    """The engine's rows in the format asked for (CPU, a tiny model); in a run, every row
    names its format: the engine's and vLLM's each format asked for, Hugging Face
    generate's its own BF16 cache."""
    from types import SimpleNamespace

    import pandas as pd

    import qerl.bench.rollout as rollout
    from tests.rollout.test_engine import tiny

    rollout.bench_engine(tiny("qwen2", torch.float32, 0), [2], [5], 3, fused=False,
                         kv_cache="fp8")
    assert engines_made == [("fp8", torch.float8_e4m3fn, False)]
    engine_calls, vllm_calls = [], []

    def engine_rows(policy, batches, prompt_lens, gen_len, fused, group, kv_cache):
        engine_calls.append((kv_cache, fused))
        return [{"batch": 1, "tok_per_s": 1.0}]

    def vllm_rows(*args, caches, **kwargs):
        vllm_calls.append(caches)
        return [{"lora_rank": 0, "kv_cache": c, "batch": 1, "tok_per_s": 2.0} for c in caches]

    monkeypatch.setattr(rollout.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(rollout, "provenance", lambda device: {"card": "Stand-in"})
    monkeypatch.setattr(rollout, "build_policy",
                        lambda *args, **kwargs: SimpleNamespace(model=None))
    monkeypatch.setattr(rollout, "bench_engine", engine_rows)
    monkeypatch.setattr(rollout, "bench_hf",
                        lambda *args: [{"batch": 1, "tok_per_s": 0.5}])
    monkeypatch.setattr(rollout, "bench_vllm", vllm_rows)
    monkeypatch.setattr(rollout, "summary", lambda *args, **kwargs: "")
    rollout.main(["--archs", "qwen2.5-7b", "--weights", "nvfp4,hf-bf16,vllm-bf16",
                  "--ranks", "32", "--batches", "1", "--prompt-lens", "8", "--fused", "1,0",
                  "--kv-cache", "bf16,fp8", "--out-dir", str(tmp_path)])
    assert engine_calls == [("bf16", True), ("bf16", False), ("fp8", True), ("fp8", False)]
    assert vllm_calls == [("bf16", "fp8")]
    rows = pd.read_csv(next(tmp_path.glob("rollout_*.csv")))
    assert list(zip(rows.weights, rows.kv_cache, rows.fused.fillna(-1), strict=True)) == [
        ("nvfp4", "bf16", 1), ("nvfp4", "bf16", 0), ("nvfp4", "fp8", 1), ("nvfp4", "fp8", 0),
        ("hf-bf16", "bf16", 0), ("vllm-bf16", "bf16", -1), ("vllm-bf16", "fp8", -1)]


def _children_running(code: str) -> int:
    """This process's children whose command line holds ``code`` (read from /proc)."""
    import os

    found = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            ppid = int(stat.read_text().rsplit(")", 1)[1].split()[1])
            cmdline = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except (OSError, IndexError, ValueError):
            continue  # ended while read
        found += ppid == os.getpid() and code in cmdline
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_busy_neighbours_run_while_a_measurement_does_and_end_with_it():
    from qerl.bench.step import BUSY_LOOP, busy_processes

    with busy_processes(2):
        assert _children_running(BUSY_LOOP) == 2
    assert _children_running(BUSY_LOOP) == 0


@pytest.mark.parametrize("busy", ["1", "x", "0,-1"])
def test_busy_neighbours_are_a_cpu_measurements_counts(busy, capsys):
    device = ["--device", "cpu"] if busy != "1" else []  # 1 on a GPU: refused too
    with pytest.raises(SystemExit):
        main(["bench", "step", *device, "--busy", busy])
    assert "--busy takes counts of processes" in capsys.readouterr().err


def test_a_step_of_a_named_model_trains_it_with_its_own_tokenizer(tmp_path):
    """--model: that model (here the packaged SmolLM2's name), its tokenizer, the prompt
    length asked for; the configuration is one qerl train accepts."""
    import argparse

    from qerl.bench.step import run_config, step_arguments
    from qerl.config import parse_config

    parser = argparse.ArgumentParser()
    step_arguments(parser, prompts=2)
    args = parser.parse_args(["--generations", "4", "--completion", "16", "--rank", "16"])
    args.__dict__.update(model="smollm2-135m-instruct", prompt_tokens=128, device="cpu",
                         steps=3, micro_batch=8, grad_ckpt=False, memory_gb=None,
                         kv_cache="bf16")
    config = run_config(args, args.model, "qerl", tmp_path)
    assert config["model"] == "smollm2-135m-instruct" and "tokenizer" not in config
    assert config["rl"]["max_prompt_length"] == 128
    parsed = parse_config(config)
    assert (parsed.rl.num_generations, parsed.rl.max_completion_length) == (4, 16)
