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
    package = ".".join(path.relative_to(REPO).with_suffix("").parts[:-1])
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
