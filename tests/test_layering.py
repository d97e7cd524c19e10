"""The layers of the house: data flows down, nothing imports upward (kernels know nothing of
backends, layers, models, the engine, the server or the test helpers)."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kdaserve"
ORDER = ["ops", "backends", "layers", "models", "engine", "server"]


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.add(node.module)
    return names


@pytest.mark.parametrize("layer", ORDER[:-1])
def test_no_upward_imports(layer):
    above = {f"kdaserve.{name}" for name in ORDER[ORDER.index(layer) + 1:]} | {"kdaserve.testing", "kdaserve.evidence",
                                                                             "kdaserve.commands", "kdaserve.cli"}
    if layer == "ops":
        above.add("kdaserve.backends")
    bad = [(str(p.relative_to(PACKAGE)), m) for p in sorted((PACKAGE / layer).rglob("*.py")) for m in _imports(p)
           if any(m == a or m.startswith(a + ".") for a in above)]
    assert not bad, f"kdaserve/{layer} imports upward: {bad}"
