"""Imports run down the stack, never up (docs/architecture.md, "Layers"):

    entry      CLI, app factories and deployments: they wire everything
    routes     tenant routes (server.routes), admin routes (admin.routes), the console; independent of each other
    deps       the typed FastAPI dependencies every route group uses
    serving    a tenant request from admission to its ledger record
    intake     parsing and checking what a generation request asks for
    http       HTTP plumbing: error shape, bodies, SSE, downloads, the ingress middleware
    services   one module per resource: the operations admin API, console and CLI share; training speculators
    domain     engine (and its remote client), adapters, tenancy, rate limits, ledger and billing
    base       db, model, kernels, settings and small leaf modules

A module may import its own layer and any layer below it. The HTTP side (routes, deps, serving, intake, http) never
imports `loramux.engine.engine` (it pulls in torch and the whole engine): what the engine gives is in
`loramux.engine.outputs`, and the route groups import nothing else of the engine. Every `import` counts, lazy ones
inside functions and TYPE_CHECKING ones too: each is a dependency a reader has to follow. The route groups may
not import one another (the console reaches admin operations through the service layer).
"""
from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = {"platform": "loramux", "adapters": "loramux.adapters", "kernels": "loramux.kernels",
            "admin": "loramux.admin"}

LAYERS: list[tuple[str, tuple[str, ...]]] = [  # top to bottom; a module is in the layer of its longest prefix
    ("entry", ("loramux.cli", "loramux.tenancy.cli", "loramux.plan", "loramux.admin.cli", "loramux.server.app",
               "loramux.server.error_handlers", "loramux.cluster.app", "loramux.cluster.replica",
               "loramux.cluster.ingress_services", "loramux.testing", "loramux.training.medusa_cli",
               "loramux.training.draft_cli")),
    ("routes", ("loramux.server.routes", "loramux.admin.routes", "loramux.admin.deps", "loramux.admin.uploads",
                "loramux.console")),
    ("deps", ("loramux.server.deps",)),
    ("serving", ("loramux.server.serving",)),
    ("intake", ("loramux.server.intake",)),
    ("http", ("loramux.server.http",)),
    ("services", ("loramux.services", "loramux.training")),
    ("domain", ("loramux.engine", "loramux.cluster", "loramux.adapters", "loramux.tenancy", "loramux.billing",
                "loramux.admin", "loramux.request_rates")),
    ("base", ("loramux",)),  # db, model, kernels, settings, names, text, durable_files, histogram, ...
]
BASE_PACKAGES = ("loramux.db", "loramux.model", "loramux.kernels", "loramux.migrations")
ROUTE_GROUPS = ("loramux.server.routes", "loramux.admin.routes", "loramux.console")
HTTP_SIDE = ("routes", "deps", "serving", "intake", "http")
ENGINE, ENGINE_MODULE, ENGINE_TYPES = "loramux.engine", "loramux.engine.engine", "loramux.engine.outputs"


def layer_of(module: str) -> int:
    """Index in LAYERS of the longest prefix that `module` falls under."""
    best, best_len = len(LAYERS) - 1, -1
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best_len:
                best, best_len = index, len(prefix)
    if any(module == p or module.startswith(p + ".") for p in BASE_PACKAGES):
        return len(LAYERS) - 1
    return best


def route_group(module: str) -> str | None:
    return next((g for g in ROUTE_GROUPS if module == g or module.startswith(g + ".")), None)


def module_name(root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    tail = [p for p in parts[1:] if p != "__init__"]
    return ".".join([PACKAGES[parts[0]], *tail])


def imports_of(path: Path, module: str) -> list[tuple[int, str]]:
    """(line, imported module) for every import of a loramux module in `path`, relative ones resolved."""
    found = []
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            if name.startswith("loramux"):
                found.append((node.lineno, name))
        elif isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if a.name.startswith("loramux")]
    return found


def violations(root: Path) -> list[str]:
    """Every import in the source tree under `root` that runs against LAYERS or between route groups."""
    problems = []
    for folder in PACKAGES:
        for path in sorted((root / folder).rglob("*.py")):
            module = module_name(root, path)
            mine, group = layer_of(module), route_group(module)
            for line, imported in imports_of(path, module):
                theirs, other = layer_of(imported), route_group(imported)
                where = f"{path.relative_to(root)}:{line}"
                in_engine = imported == ENGINE or imported.startswith(ENGINE + ".")
                if LAYERS[mine][0] in HTTP_SIDE and imported == ENGINE_MODULE:
                    problems.append(f"{where}: {module} ({LAYERS[mine][0]}) imports {ENGINE_MODULE}: take the "
                                    f"engine's types from {ENGINE_TYPES}")
                elif group and in_engine and imported != ENGINE_TYPES:
                    problems.append(f"{where}: route {module} imports {imported}: routes take the engine's types "
                                    f"from {ENGINE_TYPES} only")
                if theirs < mine:
                    problems.append(f"{where}: {module} ({LAYERS[mine][0]}) imports {imported} "
                                    f"({LAYERS[theirs][0]}, a layer above it)")
                elif group and other and group != other:
                    problems.append(f"{where}: route group {group} imports route group {other}: "
                                    "share the operation through loramux.services")
    return problems


def test_imports_run_down_the_stack():
    problems = violations(REPO)
    assert not problems, "imports against the layers (tests/unit/test_import_layers.py):\n" + "\n".join(problems)


def test_every_module_has_a_layer_and_the_layers_name_real_modules():
    modules = {module_name(REPO, p) for folder in PACKAGES for p in (REPO / folder).rglob("*.py")}
    for _, prefixes in LAYERS:
        for prefix in prefixes:
            assert any(m == prefix or m.startswith(prefix + ".") for m in modules), f"no module {prefix}"


@pytest.mark.parametrize("importer, source, complaint", [
    ("platform/engine/wrong.py", "from loramux.server.http.errors import ApiError",
     "loramux.engine.wrong (domain) imports loramux.server.http.errors (http, a layer above it)"),
    ("platform/services/wrong.py", "def f():\n    from loramux.admin.routes import tenants",
     "loramux.services.wrong (services) imports loramux.admin.routes (routes, a layer above it)"),
    ("platform/console/routes/wrong.py", "from loramux.admin.routes import adapters",
     "route group loramux.console imports route group loramux.admin.routes: share the operation through "
     "loramux.services"),
    ("platform/server/serving/wrong.py", "from loramux.engine.engine import RequestOutput",
     "loramux.server.serving.wrong (serving) imports loramux.engine.engine: take the engine's types from "
     "loramux.engine.outputs"),
    ("platform/server/routes/wrong.py", "from loramux.engine.tokens import template_takes_tools",
     "route loramux.server.routes.wrong imports loramux.engine.tokens: routes take the engine's types from "
     "loramux.engine.outputs only"),
    ("admin/ledger_wrong.py", "from ..server.serving.running import Running",
     "loramux.admin.ledger_wrong (domain) imports loramux.server.serving.running (serving, a layer above it)"),
])
def test_a_wrong_import_is_caught(tmp_path, importer, source, complaint):
    for folder in PACKAGES:
        (tmp_path / folder).mkdir()
    target = tmp_path / importer
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(textwrap.dedent(source) + "\n")
    assert [p.split(": ", 1)[1] for p in violations(tmp_path)] == [complaint]


def test_imports_down_the_stack_pass(tmp_path):
    for folder in PACKAGES:
        (tmp_path / folder).mkdir()
    (tmp_path / "platform/server/routes").mkdir(parents=True)
    (tmp_path / "platform/server/routes/ok.py").write_text(
        "from loramux.services import tenants\nfrom loramux.server.http.errors import ApiError\nimport loramux.db\n"
        "from loramux.engine.outputs import RequestOutput\n")
    assert violations(tmp_path) == []


def test_the_architecture_page_shows_these_layers():
    """docs/architecture.md's layer table names the same layers, in the same order, with the same modules."""
    page = (REPO / "docs" / "architecture.md").read_text()
    table = page[page.index("| layer | packages | holds |"):].split("\n\n", 1)[0].splitlines()[2:]
    documented = []
    for row in table:
        layer, packages = (cell.strip() for cell in row.strip("|").split("|")[:2])
        documented.append((layer, tuple(p.strip("`") for p in packages.split(", ") if p.startswith("`"))))
    expected = [(name, prefixes + (BASE_PACKAGES if name == "base" else ())) for name, prefixes in LAYERS]
    expected = [(name, tuple(p for p in prefixes if p != "loramux")) for name, prefixes in expected]
    assert documented == expected
