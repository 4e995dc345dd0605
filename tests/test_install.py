"""What `make serve` installs is what serving needs: the package without its dev extras
(test clients, agent SDKs, Playwright), so a newcomer's first start does not wait for
them; and nothing the server imports comes only with those extras."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
SERVING = ("server", "scheduler", "engines", "tandem")  # bench/ is a dev tool


def make_dry_run(target: str) -> str:
    return subprocess.run(
        ["make", "-n", "-B", target, "VENV=/nonexistent-venv"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
    ).stdout


def test_make_serve_installs_the_package_without_dev_extras():
    serve = make_dry_run("serve")
    installs = [line for line in serve.splitlines() if " install " in line]
    assert any(re.search(r"pip install -q -e \.$", line) for line in installs), serve
    assert "[dev]" not in serve, serve
    assert "[dev]" in make_dry_run("test")


def _requirements(distribution: str, seen: set[str]) -> None:
    """The distribution and everything it requires (no extras), by normalized name."""
    name = re.sub(r"[-_.]+", "-", distribution).lower()
    if name in seen:
        return
    seen.add(name)
    try:
        requires = metadata.requires(distribution) or []
    except metadata.PackageNotFoundError:
        return
    marker_env = {"extra": ""}
    for line in requires:
        requirement = Requirement(line)
        if requirement.marker is not None and not requirement.marker.evaluate(marker_env):
            continue
        _requirements(requirement.name, seen)


def _imported_top_levels() -> dict[str, str]:
    """Every top-level module imported anywhere in the serving packages (lazy imports
    inside functions too) -> a file importing it."""
    found: dict[str, str] = {}
    for package in SERVING:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(ast.parse(path.read_text(), str(path))):
                if isinstance(node, ast.Import):
                    names = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    found.setdefault(name.split(".")[0], str(path.relative_to(ROOT)))
    return found


# Modules the server imports only where an optional extra installed them: mlx-vlm, for
# vision-language models (`engines.model.vision.vision_support` says when it is missing,
# and the model is served text-only).
OPTIONAL = {"mlx_vlm": "vision"}


def test_optional_imports_come_with_their_extra():
    requires = metadata.requires("tandem-serve") or []
    for module, extra in OPTIONAL.items():
        name = module.replace("_", "-")
        assert any(r.startswith(name) and f'extra == "{extra}"' in r for r in requires), requires


def test_the_server_imports_nothing_that_only_the_dev_extras_install():
    base: set[str] = set()
    _requirements("tandem-serve", base)
    providers = metadata.packages_distributions()
    ours = set(SERVING) | {"bench", "tests"}
    outside = {}
    for module, where in _imported_top_levels().items():
        if module in ours or module in sys.stdlib_module_names or module == "__future__":
            continue
        if module in OPTIONAL:
            continue
        distributions = {re.sub(r"[-_.]+", "-", d).lower() for d in providers.get(module, [])}
        if not distributions & base:
            outside[module] = (where, sorted(distributions))
    assert not outside, f"imported by the server but not installed by `make serve`: {outside}"
