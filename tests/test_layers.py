"""The pure libraries stay pure, and NVIDIA's names live in one package.

Imports are read from the source (module level and inside functions alike), so
a lazy import cannot hide a dependency.
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PURE_PACKAGES = ["runners/scheduler", "runners/backends", "runners/nvidia", "runners/workloads"]
PORTAL_APPS = {"portal", "tenants", "quotas", "runners", "frontend"}
PURE_MODULE_PREFIXES = tuple(path.replace("/", ".") for path in PURE_PACKAGES)


def _imports(path: Path) -> list[tuple[int, str]]:
    """Every module a file imports, with the line, relative imports resolved."""
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1]) if path.is_relative_to(REPO) else ""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                module = ".".join([*base, node.module] if node.module else base)
            else:
                module = node.module or ""
            found.append((node.lineno, module))
    return found


def _python_files(folder: str) -> list[Path]:
    return sorted(p for p in (REPO / folder).rglob("*.py") if "migrations" not in p.parts)


@pytest.mark.parametrize("package", PURE_PACKAGES)
def test_the_pure_libraries_import_neither_django_nor_a_portal_app(package):
    offending = []
    for path in _python_files(package):
        for line, module in _imports(path):
            top = module.split(".")[0]
            if top == "django" or top == "rest_framework" or top == "celery":
                offending.append(f"{path.relative_to(REPO)}:{line} imports {module}")
            elif top in PORTAL_APPS and not module.startswith(PURE_MODULE_PREFIXES):
                offending.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not offending, "Pure libraries must stay free of Django and the apps:\n" + "\n".join(offending)


def test_the_checker_sees_imports_inside_functions(tmp_path):
    sample = REPO / "runners" / "nvidia" / "_layer_probe.py"
    try:
        sample.write_text("def f():\n    from django.conf import settings\n    return settings\n")
        assert (2, "django.conf") in _imports(sample)
    finally:
        sample.unlink()


def test_no_nvidia_name_is_spelled_outside_runners_nvidia():
    offending = []
    for folder in ["portal", "tenants", "quotas", "runners", "frontend", "bench"]:
        for path in sorted((REPO / folder).rglob("*")):
            if not path.is_file() or path.suffix not in {".py", ".html", ".js", ".yaml", ".txt", ".css"}:
                continue
            relative = path.relative_to(REPO)
            if "migrations" in relative.parts or relative.parts[:2] == ("runners", "nvidia"):
                continue
            for number, text in enumerate(path.read_text().splitlines(), start=1):
                if "nvidia.com/" in text:
                    offending.append(f"{relative}:{number}: {text.strip()}")
    assert not offending, "Import the name from runners.nvidia.names instead:\n" + "\n".join(offending)


# Apps from the bottom up. An app may import those below it, the pure libraries, and the
# portal's shared modules; never one above it, at module level or inside a function.
LAYERS = ["tenants", "quotas", "runners", "frontend"]
# The project package's top: the router, the URLs and the commands import every app.
PORTAL_TOP = ("portal.api", "portal.urls", "portal.management", "portal.wsgi", "portal.celery")


def _layer_of(module: str) -> str | None:
    """The app layer a module belongs to (None for the pure libraries and everything else)."""
    if module.startswith(PURE_MODULE_PREFIXES):
        return None
    top = module.split(".")[0]
    return top if top in LAYERS else None


def _app_files(app: str) -> list[Path]:
    return [path for path in _python_files(app) if not str(path.relative_to(REPO)).startswith(tuple(PURE_PACKAGES))]


def _model_references(path: Path) -> list[tuple[int, str]]:
    """String references to another app's model ("runners.PartitionProfile"), as foreign keys use them."""
    import re

    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = re.fullmatch(r"(tenants|quotas|runners|frontend)\.[A-Z]\w*", node.value)
            if match:
                found.append((node.lineno, match.group(1)))
    return found


@pytest.mark.parametrize("app", LAYERS[:-1])
def test_apps_depend_one_way(app):
    above = set(LAYERS[LAYERS.index(app) + 1 :])
    offending = []
    for path in _app_files(app):
        relative = path.relative_to(REPO)
        for line, module in _imports(path):
            if _layer_of(module) in above or module.startswith(PORTAL_TOP):
                offending.append(f"{relative}:{line} imports {module}")
        for line, target in _model_references(path):
            if target in above:
                offending.append(f"{relative}:{line} refers to a model of {target}")
    assert not offending, f"{app} sits below {', '.join(sorted(above))} and must not reach up:\n" + "\n".join(offending)


def test_the_layer_checker_catches_a_lazy_import_and_a_model_string(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('def f():\n    from runners.services import inventory_sync\n\nFK = "runners.PartitionProfile"\n')
    assert [_layer_of(module) for _line, module in _imports(probe)] == ["runners"]
    assert _model_references(probe) == [(4, "runners")]
    assert _layer_of("runners.nvidia.names") is None and _layer_of("quotas.models") == "quotas"
