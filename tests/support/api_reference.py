"""docs/api.md, made from the public names' signatures and docstrings: ``python -m tests.support.api_reference``
writes it, tests/project/test_api_reference.py fails when it differs from what the code says now."""

from __future__ import annotations

import importlib
import inspect
import re
import sys
import textwrap
from pathlib import Path

import dcp_zarr
from dcp_zarr import errors

PAGE = Path(__file__).resolve().parents[2] / "docs" / "api.md"

# The public face, in sections; every name of dcp_zarr.__all__ is in one of them (the test checks).
SECTIONS = [
    ("Saving and loading", "DCP's storage writer and reader, and the planners made for them ([usage](usage.md)).",
     ["ZarrWriter", "ZarrReader", "ZarrSavePlanner", "ZarrLoadPlanner"]),
    ("Compression", "[compression](compression.md)", ["Compression"]),
    ("Async saves' staging memory", "[async saves](usage.md#async-saves)",
     ["staging_memory_held", "release_staging_memory", "set_staging_memory_limit"]),
    ("A training job's checkpoints",
     "[checkpoint manager](checkpoint-manager.md), [optimizer state](optimizer-state.md)",
     ["CheckpointManager", "SaveReport", "assert_step_present"]),
    ("Reading without a process group", "[offline and CLI](offline-and-cli.md)", ["open_checkpoint", "Checkpoint"]),
    ("Names that drift", "[names that drift](names-that-drift.md)",
     ["PrefixTolerantLoadPlanner", "WrapperPrefixLoadMixin", "strip_wrapper_prefixes"]),
    ("Object stores", "[object stores](object-stores.md)", ["RetryPolicy"]),
]
# The adapters of dcp_zarr.integrations: each imports its framework, so each is its own module ([frameworks]).
INTEGRATIONS = [
    ("dcp_zarr.integrations.torchtitan", ["ZarrCheckpointManager"]),
    ("dcp_zarr.integrations.lightning", ["ZarrModelParallelStrategy", "ZarrFSDPStrategy",
                                         "ZarrFabricModelParallelStrategy", "ZarrFabricFSDPStrategy"]),
    ("dcp_zarr.integrations.accelerate", ["ZarrAccelerator"]),
]
# Where dcp_zarr is extended rather than used: public modules with names of their own, each documented here. A planner
# is extended by subclassing ZarrSavePlanner or ZarrLoadPlanner (above).
EXTENSIONS = [
    ("dcp_zarr.storage", ["Storage", "register_storage", "unregister_storage"]),
    ("dcp_zarr.testing.storage_contract", ["StorageContract"]),
    ("dcp_zarr.format.codecs", ["Codec", "CodecEntry"]),
]
# DCP calls these classes' methods (their protocol, documented by torch); users construct them and pass them in.
DCP_PROTOCOL = {"ZarrWriter", "ZarrReader", "ZarrSavePlanner", "ZarrLoadPlanner", "PrefixTolerantLoadPlanner",
                "WrapperPrefixLoadMixin"}


def _doc(obj) -> str:
    return inspect.cleandoc(obj.__doc__ or "").strip().replace("``", "`")


def _markdown(doc: str) -> str:
    """A docstring as Markdown: its ``Args:`` section a list, one item per argument; the rest as written."""
    out: list[str] = []
    in_args = False
    for line in doc.split("\n"):
        if line.strip() in ("Args:", "Arguments:"):
            in_args = True
            out += ["Arguments:", ""]
            continue
        if in_args and line.startswith("    ") and not line.startswith("        ") and ":" in line:
            name, _, text = line.strip().partition(":")
            out.append(f"- `{name}`:{text}")
        elif in_args and line.startswith("        "):
            out[-1] += " " + line.strip()
        else:
            in_args = in_args and line.startswith("    ")
            out.append(line)
    return "\n".join(out)


def _signature(name: str, obj) -> str:
    try:
        signature = str(inspect.signature(obj))
    except (TypeError, ValueError):
        signature = "(...)"
    text = re.sub(r" at 0x[0-9a-f]+>", ">", f"{name}{signature}")  # a sentinel default's repr: no address
    return "\n".join(textwrap.wrap(text, 116, subsequent_indent="    ", break_long_words=False,
                                   break_on_hyphens=False))


def _entry(name: str, obj, module: str = "dcp_zarr") -> list[str]:
    kind = "class" if inspect.isclass(obj) else "function"
    lines = [f"### `{name}`", "", f"{kind} in `{module}`", "", "```text", _signature(name, obj), "```", ""]
    doc = _doc(obj)
    if doc:
        lines += [_markdown(doc), ""]
    if inspect.isclass(obj) and name not in DCP_PROTOCOL:
        for member, value in vars(obj).items():
            if member.startswith("_") or not (inspect.isfunction(value) or isinstance(value, property)):
                continue
            first = _doc(value).split("\n\n")[0].replace("\n", " ")
            what = "property" if isinstance(value, property) else f"`{_signature(member, value)}`".replace("\n", " ")
            lines.append(f"- `{member}`: {first}" if isinstance(value, property) else f"- {what}: {first}")
        if lines[-1] != "":
            lines.append("")
    return lines


def _errors() -> list[str]:
    names = errors.__all__
    lines = ["## Errors and warnings", "",
             "Every error dcp_zarr raises on purpose is a `ZarrCheckpointError`, and also the standard exception it "
             "behaves like; each names the path, key, array or chunk at fault. DCP wraps what `save`/`load` raise in "
             "`CheckpointException` (a `BaseException`), with each rank's error in `.failures`.", "",
             "All of them are in `dcp_zarr.errors` (`from dcp_zarr.errors import ReplicaMismatchError`); the ones "
             "users catch most are in `dcp_zarr.__all__` too: "
             + ", ".join(f"`{n}`" for n in dcp_zarr.__all__ if n.endswith(("Error", "Warning"))) + ".", "",
             "| name | also a | what it means |", "| --- | --- | --- |"]
    for name in names:
        cls = getattr(errors, name)
        bases = ", ".join(f"`{b.__name__}`" for b in cls.__bases__ if b.__name__ != "ZarrCheckpointError") or "-"
        lines.append(f"| `{name}` | {bases} | {_doc(cls).replace(chr(10), ' ')} |")
    return lines + [""]


def render() -> str:
    lines = ["# API reference", "",
             "<!-- Made by `python -m tests.support.api_reference` from the signatures and docstrings; "
             "tests/project/test_api_reference.py fails when it is out of date. -->", "",
             "The public face of dcp-zarr: what `from dcp_zarr import ...` offers (`dcp_zarr.__all__`), the "
             "errors, the [extension points](#extension-points) and the adapters of `dcp_zarr.integrations`. "
             "Everything else is implementation ([design](design.md)); tests/project/test_layers.py lists the public "
             "modules and holds this page to them.", ""]
    for title, about, names in SECTIONS:
        lines += [f"## {title}", "", about, ""]
        for name in names:
            lines += _entry(name, getattr(dcp_zarr, name))
    lines += _errors()
    lines += [f"`dcp_zarr.__version__`: the package's version ({dcp_zarr.__version__!r} here).", "",
              "## Extension points", "",
              "Public modules for what extends dcp_zarr: a storage backend (its base class, the registry of URL "
              "schemes, and the contract suite its tests subclass: "
              "[where a change goes](design.md#where-a-change-goes)), a codec (a row of "
              "`dcp_zarr.format.codecs.CODECS`: [adding a codec](format.md#adding-a-codec)), a "
              "planner (a subclass of `ZarrSavePlanner` or `ZarrLoadPlanner`). Their names stay importable where "
              "they are; any other module is implementation, free to change.", ""]
    for module, names in EXTENSIONS:
        imported = importlib.import_module(module)
        for name in names:
            lines += _entry(name, getattr(imported, name), module)
    lines += ["## Conversions", "",
              "[conversions](offline-and-cli.md#conversions); `dcp-zarr convert` on the command line. (One more module "
              "is imported by name, for what importing it does: `import dcp_zarr.format.zarr_dtypes` gives zarr 3.1 "
              "to 3.3 the `bfloat16` and `float8_*` data types outside a group's opening.)", ""]
    lines += _entry("convert", importlib.import_module("dcp_zarr.tools.convert").convert, "dcp_zarr.tools.convert")
    lines += ["## Training frameworks", "",
              "One module each; importing one imports its framework ([frameworks](frameworks.md)).", ""]
    for module, names in INTEGRATIONS:
        imported = importlib.import_module(module)
        for name in names:
            lines += _entry(name, getattr(imported, name), module)
    return "\n".join(lines).rstrip() + "\n"


def documented_names() -> set[str]:
    """The names of dcp_zarr.__all__ the page documents: each in a section, or in the errors' table."""
    return {n for _, _, names in SECTIONS for n in names} | set(errors.__all__) | {"__version__"}


if __name__ == "__main__":
    PAGE.write_text(render())
    sys.stdout.write(f"wrote {PAGE}\n")
