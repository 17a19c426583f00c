"""``qerl eval``: sample k answers per problem with the rollout engine, score them with the
training reward (math-verify), and report avg@k, pass@1 and pass@k.

    out_dir/
      settings.json     what was sampled and how (a resumed run must match it)
      <bench>.jsonl     one line per (problem, sample): the problem's position (id) and
                        the dataset's own id (source_id), prompt, completion, extracted
                        answer, gold answer, score — appended batch by batch, so a killed
                        run resumes where it stopped
      summary.json/csv  per benchmark: problems, samples, avg@k, pass@1, pass@k, with the
                        card, library versions, model, adapter and sampling settings

The policy is evaluated as trained: an adapter is applied (unmerged, like in training) to
its base — BF16, NVFP4 or NF4 — so what is measured is what was trained.
"""

from __future__ import annotations

import json
import os
import zlib
from pathlib import Path

from tqdm import tqdm

from qerl.atomic import claim, make_directory
from qerl.cpu_threads import CPUThreads
from qerl.errors import QerlError
from qerl.eval.metrics import summarize
from qerl.eval.settings import EvalSettings
from qerl.record import provenance
from qerl.rl.rewards import matches, parse_answer
from qerl.rollout import Engine, SamplingParams

SUMMARY = "summary"
# The procedural task at level N, as a held-out test: its own problem draw (seed -1; training
# draws with the run's seed), --limit problems (default 500). Level 1 has only 100 distinct
# sums, so there it measures the trained skill on fresh samples, not unseen problems.
ARITHMETIC = tuple(f"arithmetic-{level}" for level in range(1, 6))
ARITHMETIC_SEED, ARITHMETIC_SIZE = -1, 500


class EvalError(QerlError):
    """An evaluation that cannot run as asked."""


def _done(path: Path) -> dict[tuple[int, int], dict]:
    """The records already in ``path``; a last line cut short by a kill is dropped from
    the file (its sample is redone)."""
    if not path.is_file():
        return {}
    lines = path.read_text().splitlines(keepends=True)
    records = {}
    for number, line in enumerate(lines, 1):
        try:
            record = json.loads(line)
        except ValueError:
            if number < len(lines):
                raise EvalError(f"{path}:{number} is not JSON; delete the file to start "
                                "over") from None
            path.write_text("".join(lines[:-1]))
            break
        records[(record["id"], record["sample"])] = record
    return records


def _append(path: Path, records: list[dict]) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records)
    with path.open("a") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())


def _check_settings(out_dir: Path, settings: EvalSettings, what: dict) -> None:
    """A resumed evaluation must sample as its samples were; an output that holds no sample
    yet (a run that failed before its first batch) takes the new settings."""
    path = out_dir / "settings.json"
    current = {**settings.model_dump(), **what}
    if path.is_file() and any(p.stat().st_size for p in out_dir.glob("*.jsonl")):
        before = json.loads(path.read_text())
        changed = sorted(k for k in current if before.get(k) != current[k])
        if changed:
            raise EvalError(f"{out_dir} holds an evaluation with other settings ({changed}); "
                            "use another output directory")
    make_directory(out_dir)
    path.write_text(json.dumps(current, indent=2))


def evaluate_bench(name: str, task, policy, tokenizer, out_dir: Path,
                   settings: EvalSettings, threads: CPUThreads | None = None) -> dict:
    """Sample what ``out_dir/<name>.jsonl`` lacks, then summarize the file; on a CPU,
    ``threads`` sets torch's thread count before each batch."""
    path = out_dir / f"{name}.jsonl"
    records = _done(path)
    texts = tokenizer.apply_chat_template(list(task["prompt"]), tokenize=False,
                                          add_generation_prompt=True)
    prompt_ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    pending = [(i, s) for i in range(len(task)) for s in range(settings.samples)
               if (i, s) not in records]
    if pending:
        longest = max(len(prompt_ids[i]) for i, _ in pending)
        engine = _engine(policy, settings, min(settings.batch, len(pending)),
                         longest + settings.max_tokens, out_dir)
        stops = stop_tokens(policy, tokenizer)
        bar = tqdm(total=len(pending), desc=name, unit="sample")
        for first in range(0, len(pending), engine.max_batch):
            chunk = pending[first:first + engine.max_batch]
            if threads is not None:
                threads.adjust()
            params = SamplingParams(max_new_tokens=settings.max_tokens,
                                    temperature=settings.temperature, top_p=settings.top_p,
                                    stop_token_ids=stops,
                                    seed=zlib.crc32(f"{settings.seed}/{name}/{chunk[0]}"
                                                    .encode()))
            out = engine.generate([prompt_ids[i] for i, _ in chunk], params)
            batch = []
            for (i, s), tokens in zip(chunk, out.tokens, strict=True):
                completion = tokenizer.decode(tokens, skip_special_tokens=True)
                extracted = parse_answer(completion)
                batch.append({"id": i, "source_id": task[i]["source_id"], "sample": s,
                              "prompt": texts[i],
                              "completion": completion,
                              "extracted": str(extracted[-1]) if extracted else None,
                              "answer": task[i]["answer"],
                              "score": float(matches(extracted, task[i]["answer"]))})
            _append(path, batch)
            records.update({(r["id"], r["sample"]): r for r in batch})
            bar.update(len(chunk))
        bar.close()
    scores: dict[int, list[float]] = {}
    for (i, _), record in sorted(records.items()):
        scores.setdefault(i, []).append(record["score"])
    return {"bench": name, **summarize(scores, settings.samples)}


def _engine(policy, settings: EvalSettings, batch: int, seq_len: int, out_dir: Path):
    if settings.backend == "vllm":
        from qerl.rollout.vllm_backend import VLLMEngine

        return VLLMEngine(policy, out_dir / "vllm", max_batch=batch, max_seq_len=seq_len)
    return Engine(policy, max_batch=batch, max_seq_len=seq_len)


def stop_tokens(policy, tokenizer) -> tuple[int, ...]:
    """Where a completion ends: the tokenizer's EOS and the model's generation EOS tokens
    (chat models end a turn with the latter)."""
    eos = getattr(policy.base_model.generation_config, "eos_token_id", None)
    eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
    return tuple(sorted({t for t in (tokenizer.eos_token_id, *eos) if t is not None}))


def evaluate(model: str, benches: list[str], out_dir: Path, settings: EvalSettings,
             adapter: str | None = None, method: str | None = None,
             tokenizer: str | None = None, data: dict[str, str] | None = None,
             fields: dict[str, str] | None = None, limit: int | None = None,
             device: str = "cpu") -> list[dict]:
    """Evaluate ``model`` (with ``adapter``) on ``benches``; returns the summary rows.
    ``method`` defaults to qerl for an NVFP4 checkpoint, lora with an adapter, full
    otherwise. ``data`` maps a benchmark to a local file, ``fields`` its columns."""
    import torch

    from qerl.policy import build_policy, default_method, load_adapter
    from qerl.rl.data import HUB, load_task
    from qerl.tokenizer import policy_tokenizer

    unknown = [b for b in benches if b not in (*HUB, *ARITHMETIC)]
    if unknown:
        raise EvalError(f"unknown benchmark(s) {unknown}; known: "
                        f"{', '.join((*HUB, *ARITHMETIC))}")
    if set(data or {}) & set(ARITHMETIC):
        raise EvalError("the arithmetic benchmarks are generated; they take no data file")
    stray = sorted(set(data or {}) - set(benches))
    if stray:
        raise EvalError(f"data files given for benchmarks not asked for: {stray}")
    if fields and not data:
        raise EvalError("fields name the columns of local data files: give them with data")
    method = method or default_method(model, adapter)
    if adapter and method == "full":
        raise EvalError("an adapter needs a LoRA method (qerl, lora or qlora), not full")
    tasks = {b: load_task(b, path=(data or {}).get(b), split=None, limit=limit,
                          fields=fields if (data or {}).get(b) else None)
             if b in HUB else
             load_task("arithmetic", level=int(b.split("-")[1]),
                       size=limit or ARITHMETIC_SIZE, seed=ARITHMETIC_SEED)
             for b in benches}
    with claim(out_dir, "qerl eval"), torch.no_grad():
        _check_settings(out_dir, settings, {"model": str(model), "adapter": adapter,
                                            "method": method, "limit": limit})
        policy = build_policy(method, model, device=device)
        if adapter:
            load_adapter(policy, adapter)
        tok = policy_tokenizer(policy, out_dir / "tokenizer", tokenizer,
                               cpu=device == "cpu")
        context = {**provenance(device), "model": str(model), "adapter": adapter,
                   "method": method, "temperature": settings.temperature,
                   "top_p": settings.top_p, "max_tokens": settings.max_tokens}
        threads = CPUThreads() if torch.device(device).type == "cpu" else None
        rows = []
        try:
            for bench in benches:
                rows.append({**context, **evaluate_bench(bench, tasks[bench], policy, tok,
                                                         out_dir, settings, threads)})
                write_summary(out_dir, rows)  # a run cut short keeps its finished benchmarks'
        finally:
            if threads is not None:
                threads.restore()
    return rows


def write_summary(out_dir: Path, rows: list[dict]) -> None:
    import pandas as pd

    (out_dir / f"{SUMMARY}.json").write_text(json.dumps(rows, indent=2))
    pd.DataFrame(rows).to_csv(out_dir / f"{SUMMARY}.csv", index=False)
