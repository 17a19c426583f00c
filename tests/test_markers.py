"""A test that only a CUDA device runs carries the ``gpu`` mark, so that ``pytest -m gpu``
on a GPU machine selects it. Read from the source: a skip on ``not
torch.cuda.is_available()``, given to the test, to a marker variable it uses or to its
module's ``pytestmark``, needs ``pytest.mark.gpu`` beside it."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

TESTS = Path(__file__).parent
NO_CUDA = "not torch.cuda.is_available()"


def _marks(node: ast.expr, named: dict[str, list[ast.expr]]) -> list[ast.expr]:
    """A decorator or pytestmark value as the marks it stands for (lists and marker
    variables resolved)."""
    if isinstance(node, ast.List | ast.Tuple):
        return [m for element in node.elts for m in _marks(element, named)]
    if isinstance(node, ast.Name) and node.id in named:
        return named[node.id]
    return [node]


def _cuda_only(mark: ast.expr) -> bool:
    return (isinstance(mark, ast.Call) and ast.unparse(mark.func) == "pytest.mark.skipif"
            and bool(mark.args) and ast.unparse(mark.args[0]) == NO_CUDA)


def _gpu(mark: ast.expr) -> bool:
    return ast.unparse(mark) == "pytest.mark.gpu"


def unmarked_gpu_tests(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    named: dict[str, list[ast.expr]] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 \
                and isinstance(node.targets[0], ast.Name):
            named[node.targets[0].id] = _marks(node.value, named)
    module = named.get("pytestmark", [])
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
            marks = module + [m for d in node.decorator_list for m in _marks(d, named)]
            if any(map(_cuda_only, marks)) and not any(map(_gpu, marks)):
                found.append(f"{path.relative_to(TESTS)}::{node.name}")
    return found


def test_every_cuda_only_test_is_marked_gpu():
    found = [t for path in sorted(TESTS.rglob("test_*.py")) for t in unmarked_gpu_tests(path)]
    assert not found, f"CUDA-only tests without the gpu mark: {found}"


def test_the_check_sees_a_skip_given_through_a_marker_variable(tmp_path):
    source = tmp_path / "test_x.py"
    source.write_text("import pytest, torch\n"
                      f"GPU = pytest.mark.skipif({NO_CUDA}, reason='r')\n"
                      "@GPU\ndef test_a(): pass\n"
                      "@pytest.mark.gpu\n@GPU\ndef test_b(): pass\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(f"{__name__}.TESTS", tmp_path)
        assert unmarked_gpu_tests(source) == ["test_x.py::test_a"]
