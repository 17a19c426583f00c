"""`qerl eval` on CPU with a tiny model: the outputs, resume without recomputing, the
adapter really applied, avg@k/pass@k, and bad requests refused before any sampling."""

from __future__ import annotations

import json

import pytest

from qerl.cli import main as cli
from qerl.config import LoraSettings
from qerl.eval.metrics import pass_at_k, summarize
from qerl.eval.run import EvalError, evaluate
from qerl.eval.settings import EvalSettings
from qerl.policy import PolicyError, build_policy
from qerl.rl.data import DataError
from tests.conftest import save_tiny_model
from tests.rl.test_rewards import DATA
from tests.test_policy import randomize_adapter

GSM8K = {"gsm8k": str(DATA / "gsm8k_test.jsonl")}
MATH500 = str(DATA / "math500_test.jsonl")
FAST = EvalSettings(samples=2, max_tokens=4, batch=4)


def lines(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_pass_at_k_and_avg_at_k():
    assert pass_at_k(5, 0, 1) == 0.0 and pass_at_k(5, 5, 3) == 1.0
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)
    assert pass_at_k(5, 2, 2) == pytest.approx(1 - 3 / 10)
    summary = summarize({0: [1.0, 0.0], 1: [0.0, 0.0], 2: [1.0, 1.0]}, k=2)
    assert summary["avg@2"] == pytest.approx(0.5) and summary["pass@1"] == pytest.approx(0.5)
    assert summary["pass@2"] == pytest.approx(2 / 3)
    with pytest.raises(ValueError, match="same number of samples"):
        summarize({0: [1.0], 1: [0.0, 1.0]}, k=1)


def test_eval_writes_every_sample_and_resumes_where_it_stopped(chat_model, tmp_path):
    rows = evaluate(str(chat_model), ["gsm8k"], tmp_path, FAST, data=GSM8K, limit=3)
    records = lines(tmp_path / "gsm8k.jsonl")
    assert sorted((r["id"], r["sample"]) for r in records) == [(i, s) for i in range(3)
                                                               for s in range(2)]
    assert {"prompt", "completion", "extracted", "answer", "score"} <= set(records[0])
    assert records[0]["source_id"] == "0"  # GSM8K has no id of its own: its position
    assert records[0]["answer"] == "18" and rows[0]["problems"] == 3
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary[0]["bench"] == "gsm8k" and "pass@2" in summary[0]
    assert {"card", "torch", "model", "method", "temperature"} <= set(summary[0])
    assert (tmp_path / "summary.csv").is_file()
    # Killed mid-write: two whole lines kept, the third cut short.
    text = (tmp_path / "gsm8k.jsonl").read_text().splitlines(keepends=True)
    (tmp_path / "gsm8k.jsonl").write_text("".join(text[:2]) + text[2][:10])
    evaluate(str(chat_model), ["gsm8k"], tmp_path, FAST, data=GSM8K, limit=3)
    again = lines(tmp_path / "gsm8k.jsonl")
    assert len(again) == 6 and again[:2] == records[:2]  # finished samples not redone
    with pytest.raises(EvalError, match="other settings"):
        evaluate(str(chat_model), ["gsm8k"], tmp_path, EvalSettings(samples=3), data=GSM8K,
                 limit=3)


def test_a_run_cut_short_keeps_its_finished_benchmarks_summary(chat_model, tmp_path,
                                                             monkeypatch):
    from qerl.eval import run

    finish = run.evaluate_bench

    def cut_at_math500(name, *args):
        if name == "math500":
            raise KeyboardInterrupt
        return finish(name, *args)

    monkeypatch.setattr(run, "evaluate_bench", cut_at_math500)
    with pytest.raises(KeyboardInterrupt):
        evaluate(str(chat_model), ["gsm8k", "math500"], tmp_path, FAST, limit=2,
                 data={"gsm8k": GSM8K["gsm8k"], "math500": MATH500})
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [row["bench"] for row in summary] == ["gsm8k"]


def test_the_adapter_is_applied(chat_model, tmp_path):
    policy = build_policy("lora", chat_model, lora=LoraSettings(rank=4, alpha=8))
    randomize_adapter(policy, 1)
    policy.save_adapter(tmp_path / "adapter")
    greedy = EvalSettings(samples=1, temperature=0, max_tokens=6, batch=8)
    outputs = {}
    for name, adapter in (("base", None), ("lora", str(tmp_path / "adapter"))):
        evaluate(str(chat_model), ["gsm8k"], tmp_path / name, greedy, adapter=adapter,
                 data=GSM8K, limit=8)
        outputs[name] = [r["completion"] for r in lines(tmp_path / name / "gsm8k.jsonl")]
    assert outputs["base"] != outputs["lora"]


def test_bad_requests_are_refused_up_front(chat_model, tmp_path):
    with pytest.raises(EvalError, match="unknown benchmark"):
        evaluate(str(chat_model), ["gsm9k"], tmp_path, FAST)
    with pytest.raises(DataError, match=r"no column\(s\) \['solution'\]"):
        evaluate(str(chat_model), ["gsm8k"], tmp_path, FAST, data=GSM8K,
                 fields={"question": "question", "answer": "solution"})
    other = tmp_path / "wider"
    save_tiny_model(other, hidden=128, hard_values=False)
    policy = build_policy("lora", other, lora=LoraSettings(rank=4, alpha=8))
    policy.save_adapter(tmp_path / "wide-adapter")
    with pytest.raises(PolicyError, match="does not fit this base model.*q_proj"):
        evaluate(str(chat_model), ["gsm8k"], tmp_path / "x", FAST, data=GSM8K,
                 adapter=str(tmp_path / "wide-adapter"))
    with pytest.raises(EvalError, match="fields name the columns"):
        evaluate(str(chat_model), ["gsm8k"], tmp_path, FAST, fields={"question": "q",
                                                                     "answer": "a"})
    assert cli(["eval", "--model", str(chat_model), "--bench", "aime24,nope",
                "--out", str(tmp_path / "y")]) == 2


def test_local_files_with_a_column_mapping(chat_model, tmp_path):
    file = tmp_path / "amc.jsonl"
    file.write_text("".join(json.dumps({"q": f"What is {i} + 1?", "a": str(i + 1)}) + "\n"
                            for i in range(3)))
    rows = evaluate(str(chat_model), ["amc23"], tmp_path / "out", FAST,
                    data={"amc23": str(file)}, fields={"question": "q", "answer": "a"})
    assert rows[0]["problems"] == 3
    assert [r["answer"] for r in lines(tmp_path / "out" / "amc23.jsonl")][::2] == ["1", "2", "3"]


@pytest.mark.usefixtures("fake_vllm")
def test_the_vllm_backend_samples_with_the_adapter(chat_model, tmp_path):
    """--backend vllm (against the stand-in vllm module: real vLLM is not installed here):
    the policy's export is served with its adapter."""
    from tests.fake_vllm import FakeLLM

    settings = EvalSettings(samples=1, max_tokens=4, batch=4, backend="vllm")
    rows = evaluate(str(chat_model), ["gsm8k"], tmp_path, settings, method="lora",
                    data=GSM8K, limit=3)
    assert rows[0]["problems"] == 3
    calls = [c for c in FakeLLM.instances[-1].calls if c[0] == "generate"]
    assert calls and calls[0][2].lora_path.startswith(str(tmp_path / "vllm"))


def test_the_arithmetic_task_has_a_held_out_draw(chat_model, tmp_path):
    from qerl.rl.data import arithmetic_problems

    evaluate(str(chat_model), ["arithmetic-2"], tmp_path, FAST, limit=5)
    records = lines(tmp_path / "arithmetic-2.jsonl")
    assert len(records) == 10 and "What is" in records[0]["prompt"]
    held_out = [r["answer"] for r in records[::2]]
    assert held_out == [a for _, a in arithmetic_problems(2, 5, seed=-1)]
    training = {q for q, _ in arithmetic_problems(2, 4096, seed=0)}  # one run's draw
    questions = {q for q, _ in arithmetic_problems(2, 500, seed=-1)}
    assert len(questions - training) > 0.7 * len(questions)  # mostly unseen at level 2
    with pytest.raises(EvalError, match="generated"):
        evaluate(str(chat_model), ["arithmetic-1"], tmp_path / "x", FAST,
                 data={"arithmetic-1": "x.jsonl"})


def test_bad_sampling_settings_on_the_command_line_are_named(tmp_path, capsys):
    from qerl.cli import main

    assert main(["eval", "--model", "m", "--samples", "0", "--out", str(tmp_path)]) == 2
    assert "EvalSettings: samples: Input should be greater than or equal to 1" in (
        capsys.readouterr().err)


def test_an_evaluation_being_written_is_not_written_twice(chat_model, tmp_path):
    from qerl.errors import QerlError
    from tests.test_atomic import holder

    out = tmp_path / "eval"
    proc = holder(out)
    try:
        with pytest.raises(QerlError, match="being written by another process"):
            evaluate(str(chat_model), ["gsm8k"], out, FAST, data=GSM8K, limit=3)
        assert not (out / "settings.json").exists()
    finally:
        proc.kill()
        proc.wait()


def test_the_same_evaluation_writes_the_same_samples(chat_model, tmp_path):
    """Samples and scores repeat byte for byte (the summary also records when and where it
    ran, so only its measurements are compared)."""
    rows = [evaluate(str(chat_model), ["gsm8k"], tmp_path / run, FAST, data=GSM8K, limit=3)
            for run in ("a", "b")]
    assert (tmp_path / "a" / "gsm8k.jsonl").read_bytes() == (
        tmp_path / "b" / "gsm8k.jsonl").read_bytes()
    same = {"bench", "problems", "pass@1", "pass@2"}
    assert [{k: r[k] for k in same & set(r)} for r in rows[0]] == [
        {k: r[k] for k in same & set(r)} for r in rows[1]]


def test_a_failed_run_leaves_settings_a_corrected_command_may_replace(chat_model, tmp_path,
                                                                      capsys):
    """A wrong --adapter (missing: named as missing) fails before any sample; the corrected
    command then runs in the same --out, its settings taking the failed run's place."""
    out = tmp_path / "eval"
    command = ["eval", "--model", str(chat_model), "--bench", "gsm8k", "--data",
               f"gsm8k={GSM8K['gsm8k']}", "--limit", "2", "--samples", "1",
               "--max-tokens", "2", "--out", str(out)]
    assert cli([*command, "--adapter", str(tmp_path / "no-such-adapter")]) == 2
    assert f"no adapter directory at {tmp_path / 'no-such-adapter'}" in capsys.readouterr().err
    assert cli(command) == 0
    assert json.loads((out / "settings.json").read_text())["adapter"] is None
    assert len(lines(out / "gsm8k.jsonl")) == 2
    # Once samples exist, other settings are refused, as before.
    with pytest.raises(EvalError, match="other settings"):
        evaluate(str(chat_model), ["gsm8k"], out, EvalSettings(samples=1, max_tokens=3),
                 data=GSM8K, limit=2)


@pytest.mark.parametrize("where", ["under-a-file", "virtual"])
def test_an_output_that_cannot_be_made_is_named(tmp_path, capsys, where):
    (tmp_path / "file").write_text("")
    out = {"under-a-file": tmp_path / "file" / "eval", "virtual": "/proc/qerl-eval"}[where]
    assert cli(["eval", "--model", "m", "--bench", "gsm8k", "--data",
                f"gsm8k={GSM8K['gsm8k']}", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert (f"{tmp_path / 'file'} is a file" in err if where == "under-a-file"
            else "/proc takes no" in err), err
