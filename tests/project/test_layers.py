"""The layers docs/design.md describes, held by walking every import of dcp_zarr (lazy ones inside functions too).

A unit (a subpackage, or a top-level module) may import the units of lower layers and its own modules; never a
unit of its own layer or of a higher one. So no package imports another that imports it back, and each layer can
be read, and tested, knowing only the layers below it.
"""

from __future__ import annotations

import ast
import re
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dcp_zarr"

# Bottom to top. Units of one layer are siblings: neither imports the other.
LAYERS = [
    ["errors", "gc_pause"],  # every error class | the garbage collector paused for a step
    ["version", "json_documents", "progress", "torch_floor"],  # helpers with no knowledge of checkpoints
    ["torch_private"],  # torch's private names, checked for the floor first
    ["format", "storage"],  # pure: bytes and documents in, typed values out | bytes to and from a backend
    ["store_io"],  # a checkpoint store's bytes through storage: chunks, entries, the root document, the commit
    ["placement"],  # which rank holds which box
    ["collective"],  # collective I/O: aggregated writes, reads done once
    ["planning"],  # planning a save (locally on every rank, or by DCP's coordinator) and a load's read items
    ["staging", "saving", "loading"],  # the writer as DCP's AsyncStager | one save | one load
    ["writer", "reader"],  # DCP's StorageWriter and StorageReader
    ["optim"],  # optimizer state across key forms
    ["offline", "lifecycle"],  # reading without a process group | a training job's checkpoints
    ["integrations", "tools"],  # training frameworks | the dcp-zarr command
    ["testing"],  # fixtures for tests and benchmarks
    ["__init__", "__main__"],  # the public face, the command's entry
]
LAYER_OF = {unit: i for i, units in enumerate(LAYERS) for unit in units}
# The modules whose names are public (docs/api.md documents each): the face, the errors, the extension points and the
# framework adapters. Every other module is implementation.
PUBLIC_MODULES = {"dcp_zarr", "dcp_zarr.errors", "dcp_zarr.storage", "dcp_zarr.testing.storage_contract",
                  "dcp_zarr.format.codecs", "dcp_zarr.integrations.torchtitan", "dcp_zarr.integrations.lightning",
                  "dcp_zarr.integrations.accelerate", "dcp_zarr.tools.convert"}


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _unit(module: str) -> str:
    parts = module.split(".")
    if len(parts) == 1:
        return "__init__"
    return parts[1]


def _imported(path: Path, module: str) -> set[str]:
    """The dcp_zarr modules ``path`` imports anywhere in it (functions included)."""
    found = set()
    is_package = path.name == "__init__.py"
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
    return {name for name in found if name == "dcp_zarr" or name.startswith("dcp_zarr.")}


def _modules() -> dict[str, Path]:
    return {_module_name(path): path for path in PACKAGE.rglob("*.py")}


def _known(name: str, modules: dict[str, Path]) -> str | None:
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name if name in modules else None


def _edges() -> dict[str, set[str]]:
    modules = _modules()
    edges: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        for name in _imported(path, module):
            target = _known(name, modules)
            if target is not None and target != module:
                edges[module].add(target)
    return edges


def test_every_unit_has_a_layer():
    units = {_unit(module) for module in _modules()}
    assert units - set(LAYER_OF) == set(), "a new package or top-level module needs its place in LAYERS"
    assert set(LAYER_OF) - units == set(), "LAYERS names a unit that no longer exists"


def test_no_unit_imports_its_own_layer_or_one_above():
    wrong = []
    for module, targets in sorted(_edges().items()):
        unit = _unit(module)
        for target in sorted(targets):
            other = _unit(target)
            if other != unit and LAYER_OF[other] >= LAYER_OF[unit]:
                how = "a sibling" if LAYER_OF[other] == LAYER_OF[unit] else "a higher layer"
                wrong.append(f"{module} imports {target} ({how})")
    assert wrong == [], "\n".join(wrong)


def test_no_package_cycle():
    graph: dict[str, set[str]] = defaultdict(set)
    for module, targets in _edges().items():
        graph[_unit(module)].update(_unit(t) for t in targets if _unit(t) != _unit(module))
    assert _cycles(graph) == []


def test_no_module_imports_itself_back_at_import_time():
    """Within a package too: a module-level import cycle works or breaks by import order alone. An import under
    ``if TYPE_CHECKING:`` counts: a cycle that only type checkers follow still ties the two modules together."""
    assert _cycles(_import_time_graph(_modules())) == []


def test_an_import_cycle_through_type_checking_is_found(tmp_path):
    """The walk above sees imports under a module-level ``if TYPE_CHECKING:`` (as folders.py once imported root.py,
    which imported folders.py)."""
    (tmp_path / "root.py").write_text("from dcp_zarr.lifecycle.folders import folder_state\n")
    (tmp_path / "folders.py").write_text("from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n"
                                         "    from dcp_zarr.lifecycle.root import CheckpointRoot\n")
    (tmp_path / "lazy.py").write_text("def f():\n    from dcp_zarr.lifecycle.root import CheckpointRoot\n")
    modules = {f"dcp_zarr.lifecycle.{name}": tmp_path / f"{name}.py" for name in ("root", "folders", "lazy")}
    assert _cycles(_import_time_graph(modules)) == [["dcp_zarr.lifecycle.folders", "dcp_zarr.lifecycle.root"]]


def _import_time_graph(modules: dict[str, Path]) -> dict[str, set[str]]:
    """Which module each of ``modules`` imports when it is imported (module level, ``if TYPE_CHECKING:`` blocks
    included; an import inside a function is lazy and left out)."""
    graph: dict[str, set[str]] = defaultdict(set)
    for module, path in modules.items():
        for node in _module_level_imports(ast.parse(path.read_text()).body):
            holder = ast.Module(body=[node], type_ignores=[])
            for name in _imported_from(holder, module, path.name == "__init__.py"):
                target = _known(name, modules)
                if target is not None and target != module and not module.startswith(target + "."):
                    graph[module].add(target)
    return graph


def _module_level_imports(body: list[ast.stmt]) -> list[ast.Import | ast.ImportFrom]:
    found: list[ast.Import | ast.ImportFrom] = []
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            found.append(node)
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            found += _module_level_imports(node.body)
    return found


def _is_type_checking(test: ast.expr) -> bool:
    """``TYPE_CHECKING`` or ``typing.TYPE_CHECKING``."""
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imported_from(tree: ast.Module, module: str, is_package: bool) -> set[str]:
    found = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            found.update(f"{base}.{alias.name}" for alias in node.names)
            found.add(base)
    return {name for name in found if name.startswith("dcp_zarr")}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
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


_COLLECTIVES = {"all_gather", "all_gather_object", "all_reduce", "all_to_all", "barrier", "batch_isend_irecv",
                "broadcast", "broadcast_object_list", "gather", "gather_object", "irecv", "isend", "recv",
                "reduce_scatter", "scatter", "scatter_object_list", "send"}


@pytest.mark.parametrize("unit", ["format", "storage", "store_io", "placement"])
def test_the_floor_sends_no_message(unit):
    """format/ and storage/ read bytes and documents, store_io/ moves a store's, placement/ derives boxes from
    meshes in arithmetic: none calls a collective (collective I/O and planning do, above them)."""
    calls = []
    for path in (PACKAGE / unit).rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in _COLLECTIVES:
                calls.append(f"{path.name}:{node.lineno}: {node.func.attr}")
    assert calls == []


def test_storage_moves_bytes_and_knows_no_tensors():
    imports = []
    for path in (PACKAGE / "storage").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                imports += [(path.name, a.name) for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                imports.append((path.name, node.module or ""))
    assert [(f, m) for f, m in imports if m == "torch" or m.startswith("torch.")] == []


def test_no_class_is_longer_than_250_lines():
    """A class a maintainer must hold in mind at once stays readable: a longer one is split (as ZarrWriter was, into
    a front and one object per save)."""
    long = []
    for module, path in _modules().items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > 250:
                long.append(f"{module}.{node.name}: {node.end_lineno - node.lineno + 1} lines")
    assert not long, long


def test_the_lifecycle_asks_storage_what_it_can_do_never_which_backend_it_is():
    """A checkpoint root on a new backend works as soon as the backend answers Storage's calls: lifecycle/ neither
    imports zarr nor names a backend class nor asks whether a location is local."""
    found = []
    for path in (PACKAGE / "lifecycle").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                found += [f"{path.name}: import {a.name}" for a in node.names if a.name.split(".")[0] == "zarr"]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "zarr":
                found.append(f"{path.name}: from {node.module}")
            elif isinstance(node, (ast.Name, ast.Attribute)):
                name = node.id if isinstance(node, ast.Name) else node.attr
                if name in ("is_local", "LocalStorage", "ZarrStoreStorage"):
                    found.append(f"{path.name}:{node.lineno}: {name}")
    assert found == []


def test_torch_private_names_are_imported_in_torch_private_alone():
    """torch's private modules and names (a component or a name starting with ``_``) are imported by
    dcp_zarr/torch_private.py alone, in a layer below every unit that needs one: the day a torch release moves one,
    one module changes (docs/compatibility.md), and no layer imports planning/ to reach torch."""
    private = []
    for module, path in _modules().items():
        if module == "dcp_zarr.torch_private":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names if alias.name.split(".")[0] == "torch"]
                private += [f"{module}: import {n}" for n in names if any(p.startswith("_") for p in n.split("."))]
            elif isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
                parts = node.module.split(".")  # type: ignore[union-attr]
                for alias in node.names:
                    if any(p.startswith("_") for p in parts) or alias.name.startswith("_"):
                        private.append(f"{module}: from {node.module} import {alias.name}")
    assert private == [], "\n".join(private)


def test_every_module_that_is_not_public_says_plainly_that_it_is_implementation():
    """The public modules are PUBLIC_MODULES; every other says so, in its own docstring or its package's."""
    import ast

    def says(path: Path) -> bool:
        return "implementation" in (ast.get_docstring(ast.parse(path.read_text())) or "").lower()

    silent = [module for module, path in _modules().items() if module not in PUBLIC_MODULES and not says(path)
              and not (path.name != "__init__.py" and path.parent != PACKAGE and says(path.parent / "__init__.py"))]
    assert silent == [], silent


def test_the_api_reference_documents_the_public_modules_and_no_other():
    page = (PACKAGE.parent / "docs" / "api.md").read_text()
    documented = set(re.findall(r"^(?:class|function) in `([\w.]+)`$", page, flags=re.M)) | {"dcp_zarr.errors"}
    assert documented == PUBLIC_MODULES
    assert "in `dcp_zarr.errors`" in page
    assert PUBLIC_MODULES <= set(_modules())
