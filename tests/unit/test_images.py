"""Each image installs its component's extra of pyproject.toml, and that extra (with the base
dependencies) holds every distribution the component's modules import when they load: an
image built from it can import its component (docker/*.Dockerfile, docs/operator.md)."""

from __future__ import annotations

import ast
import importlib.metadata as metadata
import re
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]

# component -> (its extra, the package its image runs)
COMPONENTS = {
    "worker": ("worker", REPO / "worker/src/loraplane/worker"),
    "controlplane": ("controlplane", REPO / "controlplane/src/loraplane/controlplane"),
    "operator": ("operator", REPO / "operator/src/loraplane/operator"),
    "cluster": ("cluster", REPO / "operator/src/loraplane/devcluster"),
}
IMAGES = ("worker", "controlplane", "operator")


def _requirements(extra: str | None) -> list[Requirement]:
    """The base dependencies plus `extra`, with `loraplane[...]` references expanded."""
    out: list[Requirement] = []
    pending = [*PROJECT["dependencies"], *PROJECT["optional-dependencies"].get(extra, [])]
    seen: set[str] = set()
    while pending:
        req = Requirement(pending.pop())
        if canonicalize_name(req.name) == "loraplane":
            for name in req.extras - seen:
                seen.add(name)
                pending.extend(PROJECT["optional-dependencies"][name])
        else:
            out.append(req)
    return out


def _closure(reqs: list[Requirement]) -> set[str]:
    """Every installed distribution these requirements pull in, transitively."""
    found: set[str] = set()
    pending = [(r.name, r.extras) for r in reqs if r.marker is None or r.marker.evaluate()]
    while pending:
        name, extras = pending.pop()
        key = canonicalize_name(name)
        if key in found:
            continue
        found.add(key)
        for line in metadata.requires(name) or []:
            req = Requirement(line)
            env = [{"extra": e} for e in extras] or [{"extra": ""}]
            if req.marker is None or any(req.marker.evaluate(e) for e in env):
                pending.append((req.name, req.extras))
    return found


def _module_level_imports(package: Path) -> dict[str, str]:
    """Top-level module -> a file importing it at module level (imports inside functions are
    the optional ones: `check parity`'s HF reference, the serving bench's NVML)."""
    out: dict[str, str] = {}
    for path in sorted(package.rglob("*.py")):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("loraplane", "__future__"):
                    out.setdefault(top, str(path.relative_to(REPO)))
    return out


@pytest.mark.parametrize("component", sorted(COMPONENTS))
def test_the_extra_holds_what_the_component_imports(component: str) -> None:
    extra, package = COMPONENTS[component]
    allowed = _closure(_requirements(extra))
    providers = metadata.packages_distributions()
    missing = {
        module: where
        for module, where in _module_level_imports(package).items()
        if not {canonicalize_name(d) for d in providers.get(module, [module])} & allowed
    }
    assert not missing, f"pyproject.toml's [{extra}] extra lacks what these import: {missing}"


def test_the_extras_leave_torch_out_of_the_slim_images() -> None:
    for extra in ("controlplane", "operator"):
        assert "torch" not in _closure(_requirements(extra)), extra


@pytest.mark.parametrize("component", IMAGES)
def test_the_image_installs_its_extra_and_pins_nothing_by_hand(component: str) -> None:
    dockerfile = (REPO / "docker" / f"{component}.Dockerfile").read_text()
    installs = re.findall(r"pip install ([^\\\n]*)", dockerfile)
    assert installs == [installs[0]], installs  # one install: the extra, nothing beside it
    assert f'".[{component}]"' in installs[0], installs[0]
    assert "==" not in dockerfile, "a pin belongs in pyproject.toml"
