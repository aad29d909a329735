"""The pure libraries stay pure, and NVIDIA's names live in one package.

Imports are read from the source (module level and inside functions alike), so
a lazy import cannot hide a dependency.
"""

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.unit

PURE_PACKAGES = ["runners/scheduler", "runners/backends", "runners/nvidia", "runners/workloads", "runners/storage"]
PORTAL_APPS = {"common", "portal", "tenants", "quotas", "runners", "audit", "frontend"}
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


# Apps from the bottom up. An app may import those below it, the pure libraries and the ground
# floor (common); never one above it, at module level or inside a function. The audit log sits on
# tenants (whose changes it hears through tenants.signals) and below every app whose changes it
# records. The apps inside runners/ are layers of their own: the inventory, then environments on it,
# jobs in them, inference endpoints whose replicas are jobs, the cycle that schedules jobs (training
# gangs and replicas), the metering of all of it (utilization, usage and cost), which listens to the
# others' signals, and the notifications (mail and webhooks), which listen to them too.
LAYERS = [
    "common", "tenants", "audit", "quotas", "runners.bundles", "runners.datasets",
    "runners.clusters", "runners.environments", "runners.jobs", "runners.registry", "runners.inference",
    "runners.workspaces", "runners.nodecache", "runners.scheduling",
    "runners.usage", "runners.notifications",
    # The edge: not a Django app (no models), a process of its own that reads the apps below it.
    "runners.edge", "frontend", "portal",
]
# runners itself holds only the migration history from before the split (and its pure libraries).
PROJECT_PACKAGES = ["common", "portal", "tenants", "audit", "quotas", "runners", "frontend"]
MODEL_APP_LABELS = {"tenants": "tenants", "audit": "audit", "quotas": "quotas", "bundles": "runners.bundles",
                    "datasets": "runners.datasets", "registry": "runners.registry", "nodecache": "runners.nodecache",
                    "clusters": "runners.clusters",
                    "environments": "runners.environments", "jobs": "runners.jobs", "scheduling": "runners.scheduling",
                    "inference": "runners.inference", "workspaces": "runners.workspaces", "usage": "runners.usage",
                    "notifications": "runners.notifications", "runners": "runners"}


def _layer_of(module: str) -> str | None:
    """The app layer a module belongs to (None for the pure libraries and everything else)."""
    if module.startswith(PURE_MODULE_PREFIXES):
        return None
    for layer in sorted(LAYERS, key=len, reverse=True):
        if module == layer or module.startswith(layer + "."):
            return layer
    return "runners" if module == "runners" or module.startswith("runners.") else None


def _model_references(path: Path) -> list[tuple[int, str]]:
    """String references to another app's model ("jobs.Job"), as foreign keys use them: (line, layer)."""
    import re

    found = []
    labels = "|".join(MODEL_APP_LABELS)
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            match = re.fullmatch(rf"({labels})\.[A-Z]\w*", node.value)
            if match:
                found.append((node.lineno, MODEL_APP_LABELS[match.group(1)]))
    return found


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _project_files() -> list[Path]:
    return [path for package in PROJECT_PACKAGES for path in _python_files(package)]


@pytest.mark.parametrize("layer", LAYERS[:-1])
def test_apps_depend_one_way(layer):
    above = set(LAYERS[LAYERS.index(layer) + 1 :]) | {"runners"}
    offending = []
    for path in _project_files():
        module = _module_name(path)
        if _layer_of(module) != layer:
            continue
        relative = path.relative_to(REPO)
        for line, imported in _imports(path):
            if _layer_of(imported) in above:
                offending.append(f"{relative}:{line} imports {imported}")
        for line, target in _model_references(path):
            if target in above:
                offending.append(f"{relative}:{line} refers to a model of {target}")
    assert not offending, f"{layer} sits below {', '.join(sorted(above))} and must not reach up:\n" + "\n".join(offending)


def _import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (a `from package import module` counts as the module)."""
    files = {_module_name(path): path for path in _project_files()}
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            targets = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
                    base = ".".join([*package[: len(package) - node.level + 1], *([node.module] if node.module else [])])
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in files else base for alias in node.names]
            for target in targets:
                while target and target not in files:
                    target = target.rpartition(".")[0]
                if target and target != module:
                    edges.add(target)
        graph[module] = edges
    return graph


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each a circle of imports."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for child in graph.get(node, ()):
            if child not in index:
                visit(child)
                low[node] = min(low[node], low[child])
            elif child in on_stack:
                low[node] = min(low[node], index[child])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_every_app_of_the_project_has_its_layer():
    """Each installed app of the project, and each top-level package, is in LAYERS (or is runners itself)."""
    from django.conf import settings

    ours = {app for app in settings.INSTALLED_APPS if app.split(".")[0] in PORTAL_APPS}
    packages = {path.parent.name for path in REPO.glob("*/apps.py")} | {"common"}
    missing = sorted((ours | packages) - set(LAYERS) - {"runners"})
    assert not missing, f"Give these apps a layer in LAYERS: {missing}"
    assert set(PROJECT_PACKAGES) == {layer.split(".")[0] for layer in LAYERS}
    assert PORTAL_APPS == set(PROJECT_PACKAGES)


def _app_graph() -> dict[str, set[str]]:
    """app layer -> the app layers it imports or names a model of."""
    graph: dict[str, set[str]] = {}
    for path in _project_files():
        layer = _layer_of(_module_name(path))
        if layer is None:
            continue
        edges = graph.setdefault(layer, set())
        edges |= {_layer_of(module) for _line, module in _imports(path)}
        edges |= {target for _line, target in _model_references(path)}
        edges -= {None, layer}
    return graph


def test_no_circle_among_the_apps():
    """An app reaching another that reaches back (through an import or a model's name) is a circle."""
    circles = _circles(_app_graph())
    assert not circles, "App circles:\n" + "\n".join(" <-> ".join(circle) for circle in circles)


def test_no_import_circle_among_the_projects_modules():
    """Counting imports inside functions: a lazy import that closes a circle is still a circle."""
    circles = _circles(_import_graph())
    assert not circles, "Import circles:\n" + "\n".join(" <-> ".join(circle) for circle in circles)


def test_the_circle_finder_finds_a_circle_through_a_lazy_import():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_the_ground_floor_and_the_apps_import_nothing_of_the_portal_package():
    """portal/ is the top only (settings, URLs, the router, Celery, WSGI, middleware, health, schema,
    commands): no app imports a helper from it."""
    offending = [
        f"{path.relative_to(REPO)}:{line} imports {module}"
        for path in _project_files() if _layer_of(_module_name(path)) not in ("portal", None)
        for line, module in _imports(path) if module == "portal" or module.startswith("portal.")
    ]
    assert not offending, "\n".join(offending)


def test_tasks_modules_are_imported_by_nothing_but_celery():
    """Services send tasks by name through common.dispatch; a tasks module is loaded by autodiscovery."""
    offending = []
    for path in _project_files():
        for line, module in _imports(path):
            if module.endswith(".tasks") and module != "common.dispatch":
                offending.append(f"{path.relative_to(REPO)}:{line} imports {module}")
    assert not offending, "\n".join(offending)


def test_the_layer_checker_catches_a_lazy_import_and_a_model_string(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text('def f():\n    from runners.jobs.services import job_submit\n\nFK = "jobs.Job"\n')
    assert [_layer_of(module) for _line, module in _imports(probe)] == ["runners.jobs"]
    assert _model_references(probe) == [(4, "runners.jobs")]
    assert _layer_of("runners.nvidia.names") is None and _layer_of("quotas.models") == "quotas"
    assert _layer_of("runners.clusters.services") == "runners.clusters" and _layer_of("common.errors") == "common"


def _app_of(module: str) -> str:
    """The app a module belongs to: runners.jobs.services -> runners.jobs; tenants.models -> tenants."""
    parts = module.split(".")
    return ".".join(parts[:2]) if parts[0] == "runners" and len(parts) > 1 else parts[0]


def _private_uses_across_apps(path: Path, module: str, name: str) -> list[str]:
    """Names with a leading underscore that this file (module, shown as name) takes from another app's
    module: imported by name, or read as an attribute of a module it imported."""
    tree = ast.parse(path.read_text(), filename=str(path))
    aliases: dict[str, str] = {}  # local name -> the project module (or name) it stands for
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] in PORTAL_APPS and alias.asname:
                    aliases[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").split(".")[0] in PORTAL_APPS:
            for alias in node.names:
                if alias.name.startswith("_") and _app_of(node.module) != _app_of(module):
                    found.append(f"{name}:{node.lineno}: imports {node.module}.{alias.name}")
                aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    for node in ast.walk(tree):
        if (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")
                and node.attr != "_meta"  # Django's public way to a model's options
                and isinstance(node.value, ast.Name) and node.value.id in aliases
                and _app_of(aliases[node.value.id]) != _app_of(module)):
            found.append(f"{name}:{node.lineno}: reads {aliases[node.value.id]}.{node.attr}")
    return found


def test_no_app_reaches_into_another_apps_private_names():
    """What an app offers others is its public names; a leading underscore is its own business."""
    found = []
    for folder in sorted(PORTAL_APPS):
        for path in _python_files(folder):
            module = ".".join(path.relative_to(REPO).with_suffix("").parts)
            found += _private_uses_across_apps(path, module, str(path.relative_to(REPO)))
    assert found == [], "\n".join(found)


def test_the_private_name_check_sees_an_attribute_and_an_import(tmp_path):
    source = tmp_path / "services.py"
    source.write_text("from runners.jobs import services as jobs\nfrom quotas.services import _hidden\n"
                      "from runners.inference import _own\njobs._image('x')\n")
    found = _private_uses_across_apps(source, "runners.inference.services", "x.py")
    assert found == ["x.py:2: imports quotas.services._hidden", "x.py:4: reads runners.jobs.services._image"]
