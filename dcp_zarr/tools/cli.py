"""The ``dcp-zarr`` command: inspect, verify, convert and diff checkpoints without a process group.

Exit status: 0 success; 1 the check failed (``verify`` found problems, ``diff`` found differences); 2 the command
could not run (bad path, not a checkpoint, unreachable store, refused overwrite, bad arguments).

Nothing here imports torch at module level, and ``inspect``, ``verify`` and ``diff`` of zarr stores never do: they
start in a fraction of a second and run where torch is not installed. ``convert`` and reading DCP directories need
it; without it they fail with one line saying so.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import sys

from dcp_zarr.errors import (
    IncompleteCheckpointError,
    MalformedMetadataError,
    NotACheckpointError,
    ZarrCheckpointError,
)

OK, FAILED, ERROR = 0, 1, 2
_SIZE_UNITS = {"": 1, "B": 1, "KB": 1000, "MB": 1000**2, "GB": 1000**3, "TB": 1000**4,
               "KIB": 1024, "MIB": 1024**2, "GIB": 1024**3, "TIB": 1024**4}


class UsageError(Exception):
    """A command-line argument the command cannot use."""


def main(argv: list[str] | None = None) -> int:
    args = _finish_args(_parser().parse_args(argv))
    try:
        return args.run(args)
    except KeyboardInterrupt:
        print("dcp-zarr: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        # The reader went away (``dcp-zarr inspect ... | head``): stop quietly, as tools killed by SIGPIPE do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141
    except (ZarrCheckpointError, UsageError, OSError) as exc:
        # Expected failures (bad paths, foreign stores, refused overwrites, unreachable endpoints): a message, no
        # traceback. Anything else is a bug and keeps its traceback.
        print(f"dcp-zarr {args.command}: error: {exc}", file=sys.stderr)
        return ERROR
    except ImportError as exc:
        from dcp_zarr.tools.convert import torch_importable

        if torch_importable():  # some other missing module: a broken install, keep the traceback
            raise
        print(f"dcp-zarr {args.command}: error: this needs torch, which cannot be imported here ({exc})",
              file=sys.stderr)
        return ERROR
    except BaseException as exc:
        if type(exc).__name__ == "CheckpointException":  # DCP's wrapper (a BaseException) around per-rank errors
            print(f"dcp-zarr {args.command}: error: {_checkpoint_exception_reason(exc)}", file=sys.stderr)
            return ERROR
        raise


# -- commands ---------------------------------------------------------------------------------------------------------


def _inspect(args) -> int:
    from dcp_zarr.offline import open_checkpoint
    from dcp_zarr.tools.inspection import format_summary, summarize

    try:
        ckpt = open_checkpoint(args.path, args.storage_options)
    except NotACheckpointError:
        _refuse_a_mixed_folder(args.path, args.storage_options)
        raise
    summary = summarize(ckpt, patterns=args.filter, depth=args.depth)
    # entries a filter picks are listed: asking for them is asking to see them
    print(json.dumps(summary, indent=1) if args.json else format_summary(summary, tree=args.tree or bool(args.filter)))
    return OK


def _verify(args) -> int:
    from dcp_zarr.offline import open_checkpoint
    from dcp_zarr.tools.verify import verify_checkpoint

    try:
        ckpt = open_checkpoint(args.path, args.storage_options)
    except IncompleteCheckpointError as exc:
        _emit_verify(args, {"ok": False, "complete": False, "problems": [{"message": str(exc)}]},
                     f"INCOMPLETE: {exc}")
        return FAILED
    except MalformedMetadataError as exc:  # a check that failed: the manifest itself is damaged
        _emit_verify(args, {"ok": False, "complete": True, "problems": [{"message": str(exc)}]}, f"CORRUPT: {exc}")
        return FAILED
    report = verify_checkpoint(ckpt, thread_count=args.threads, progress=args.progress)
    problems = [{"fqn": p.fqn, "node": p.node, "chunk": p.chunk, "message": p.message, "text": str(p)}
                for p in report.problems]
    document = {"ok": report.ok, "complete": True, "path": report.url, "entries": report.entries,
                "chunks": report.chunks, "bytes_read": report.bytes_read, "problems": problems}
    if report.ok:
        text = f"OK: {report.url}: {report.entries} entries, {report.chunks} chunks, {report.bytes_read} bytes verified"
    else:
        lines = [f"CORRUPT: {report.url}: {len(problems)} problem(s) in {report.chunks} chunks checked"]
        lines += [f"  {p['text']}" for p in problems]
        text = "\n".join(lines)
    _emit_verify(args, document, text)
    return OK if report.ok else FAILED


def _refuse_a_mixed_folder(path: str, storage_options: dict | None) -> None:
    """A folder holding DCP's files beside a committed dcp_zarr store is refused as a DCP directory; say it holds
    both, and how to keep one."""
    from dcp_zarr.lifecycle.root import CheckpointRoot
    from dcp_zarr.offline import is_dcp_directory
    from dcp_zarr.storage import directory_of
    from dcp_zarr.tools.root_report import mixed_folder

    directory = directory_of(path)
    if directory is None or not is_dcp_directory(directory):
        return
    parent, name = os.path.split(directory.rstrip(os.sep))
    root = CheckpointRoot(parent, storage_options)
    mixed = mixed_folder(root, name) if root.is_complete(name) else None
    if mixed:
        raise NotACheckpointError(f"{directory} {mixed}")


def _emit_verify(args, document: dict, text: str) -> None:
    print(json.dumps(document, indent=1) if args.json else text)


def _convert(args) -> int:
    from dcp_zarr.tools.convert import DEFAULT_SAFETENSORS_SHARD_BYTES, convert

    options = {}
    if args.to == "safetensors":
        options["max_shard_bytes"] = args.max_shard_size or DEFAULT_SAFETENSORS_SHARD_BYTES
        if args.prefix is not None:
            options["prefix"] = tuple(p for p in args.prefix.split("/") if p)
    elif args.prefix is not None or args.max_shard_size is not None:
        raise UsageError("--prefix and --max-shard-size apply to --to safetensors only")
    if args.to == "zarr":
        options["compression"] = args.compression or "keep"
        _note(args, f"reading {args.src} whole into memory, then writing {args.dst}")
    elif args.compression is not None:
        raise UsageError("--compression applies to --to zarr only")
    written = convert(args.src, args.dst, args.to, overwrite=args.overwrite, storage_options=args.storage_options,
                      progress=args.progress, **options)
    for path in written:
        print(path)
    return OK


def _diff(args) -> int:
    from dcp_zarr.tools.convert import open_source
    from dcp_zarr.tools.diff import EQUAL, diff_checkpoints

    a = open_source(args.a, args.storage_options)
    b = open_source(args.b, args.storage_options)
    report = diff_checkpoints(a, b, atol=args.atol, progress=args.progress)
    if args.json:
        entries = [{"fqn": e.fqn, "status": e.status, "detail": e.detail, "differing": e.differing,
                    "numel": e.numel, "max_abs_diff": _json_float(e.max_abs_diff)} for e in report.entries]
        print(json.dumps({"a": report.a, "b": report.b, "same": report.same, "counts": report.counts(),
                          "entries": entries}, indent=1))
    else:
        print(f"A: {report.a}\nB: {report.b}")
        shown = [e for e in report.entries if args.all or e.status != EQUAL]
        width = max((len(e.status) for e in shown), default=0)
        for e in shown:
            print(f"  {e.status.ljust(width)}  {e.fqn}" + (f"  ({e.detail})" if e.detail else ""))
        counts = ", ".join(f"{n} {status}" for status, n in report.counts().items() if n)
        print(f"{len(report.entries)} entries: {counts or 'none'}")
    return OK if report.same else FAILED


def _list_root(args) -> int:
    from dcp_zarr.tools.root_report import format_root_list, list_root

    listing = list_root(_checkpoint_root(args))
    print(json.dumps(listing, indent=1) if args.json else format_root_list(listing))
    return OK


def _prune_root(args) -> int:
    from dcp_zarr.tools.root_report import format_prune, prune_root

    result = prune_root(_checkpoint_root(args), args.keep_last, args.keep_every, args.dry_run)
    print(json.dumps(result, indent=1) if args.json else format_prune(result))
    return OK


def _checkpoint_root(args):
    from dcp_zarr.lifecycle.root import CheckpointRoot
    from dcp_zarr.storage import directory_of

    directory = directory_of(args.root)
    if directory is not None and not os.path.isdir(directory):
        what = "is a file" if os.path.exists(directory) else "does not exist"
        raise UsageError(f"{args.root} {what}; expected the directory a CheckpointManager saves into")
    return CheckpointRoot(args.root, args.storage_options)


# -- arguments -------------------------------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    from dcp_zarr.version import __version__

    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("-o", "--storage-option", dest="storage_options", action="append", type=_storage_option,
                        metavar="KEY=VALUE", default=None,
                        help="fsspec option for URLs, e.g. endpoint_url=http://127.0.0.1:9000 or "
                             "'config_kwargs={\"connect_timeout\": 5}' (VALUE is JSON when it parses); repeatable")
    progress = common.add_mutually_exclusive_group()
    progress.add_argument("--progress", dest="progress", action="store_const", const=True, default=None,
                          help="always show progress bars on stderr (default: only on a terminal)")
    progress.add_argument("--no-progress", dest="progress", action="store_const", const=False)

    parser = argparse.ArgumentParser(
        prog="dcp-zarr",
        description="Inspect, verify, convert and diff checkpoints without a process group; list and prune the "
                    "roots CheckpointManager saves into.",
        epilog="Exit status: 0 success; 1 verify found problems or diff found differences; 2 the command could not "
               "run (bad path, not a checkpoint, unreachable store, refused overwrite, bad arguments).")
    parser.add_argument("--version", action="version", version=f"dcp-zarr {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = commands.add_parser("inspect", parents=[common],
                            help="a summary (groups, bytes, dtypes, values) and the saving context; every entry with "
                                 "--tree")
    p.add_argument("path", help="checkpoint directory or URL (s3://bucket/ckpt.zarr)")
    p.add_argument("--json", action="store_true", help="machine-readable output: every entry, whatever the view")
    view = p.add_mutually_exclusive_group()
    view.add_argument("--tree", action="store_true",
                      help="every entry: dtype, shape, bytes, chunks and shards, DTensor placements, values")
    view.add_argument("--depth", type=_positive_int, metavar="N",
                      help="groups of names by their first N dot-separated components, with entry counts and bytes "
                           "(like du --max-depth)")
    p.add_argument("--filter", action="append", type=_glob, metavar="PATTERN",
                   help="list only entries whose whole name matches this shell-style glob, e.g. '*.exp_avg' "
                        "(* matches dots too), as a tree (or as --depth groups); repeatable: any of them")
    p.set_defaults(run=_inspect)

    p = commands.add_parser("verify", parents=[common], help="complete, every chunk present and its crc32c intact?")
    p.add_argument("path")
    p.add_argument("--json", action="store_true")
    p.add_argument("--threads", type=int, default=8, help="concurrent chunk reads (default 8)")
    p.set_defaults(run=_verify)

    p = commands.add_parser("convert", parents=[common],
                            help="DCP directory or zarr store -> zarr (compressed or not); checkpoint -> torch.save "
                                 "file or safetensors")
    p.add_argument("src", help="a DCP directory (.metadata + .distcp files) or a dcp_zarr store")
    p.add_argument("dst")
    p.add_argument("--to", required=True, choices=["zarr", "torch", "safetensors"])
    p.add_argument("--overwrite", action="store_true", help="replace an existing output (after the new one is written)")
    p.add_argument("--prefix", default=None,
                   help="safetensors: the state-dict group holding the weights (default 'model' when present)")
    p.add_argument("--max-shard-size", type=_size, default=None, metavar="SIZE",
                   help="safetensors: largest shard, e.g. 5GB (the default) or 500MiB")
    p.add_argument("--compression", type=_compression, default=None, metavar="NAME",
                   help="zarr: compress floating-point arrays with the compressor NAME (zstd: smallest, lz4: "
                        "fastest; a NAME it does not know lists them all), or none; default: as the source (a DCP "
                        "directory: none)")
    p.set_defaults(run=_convert)

    p = commands.add_parser("diff", parents=[common], help="per-entry equality / max abs difference of two checkpoints")
    p.add_argument("a")
    p.add_argument("b")
    p.add_argument("--atol", type=float, default=0.0, help="differences up to this count as 'close' (exit 0)")
    p.add_argument("--all", action="store_true", help="list equal entries too")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_diff)

    p = commands.add_parser("list", parents=[common],
                            help="a CheckpointManager root: its steps, sizes, complete or not, leftovers, who holds it")
    p.add_argument("root", help="the directory or URL a CheckpointManager saves into")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_list_root)

    p = commands.add_parser("prune", parents=[common],
                            help="delete a CheckpointManager root's older checkpoints, as keep_last/keep_every would")
    p.add_argument("root")
    p.add_argument("--keep-last", type=_positive_int, required=True, metavar="N",
                   help="keep the newest N complete checkpoints")
    p.add_argument("--keep-every", type=_positive_int, default=None, metavar="K",
                   help="also keep every checkpoint whose step is a multiple of K")
    p.add_argument("--dry-run", action="store_true", help="say what would be deleted; delete nothing")
    p.add_argument("--json", action="store_true")
    p.set_defaults(run=_prune_root)

    return parser


def _finish_args(args):
    args.storage_options = dict(args.storage_options) if args.storage_options else None
    return args


def _glob(text: str) -> str:
    from dcp_zarr.tools.listing import check_glob

    try:
        return check_glob(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"bad glob pattern: {exc}") from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive number of name components, got {text!r}")
    return value


def _compression(text: str) -> str:
    from dcp_zarr.format.compression import COMPRESSORS

    choices = ("keep", "none", *COMPRESSORS)
    if text not in choices:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(choices)}, got {text!r}")
    return text


def _storage_option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        return key, json.loads(value)
    except ValueError:
        return key, value


def _size(text: str) -> int:
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not match or match.group(2).upper() not in _SIZE_UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 5GB or 500MiB, got {text!r}")
    size = int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])
    if size <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return size


def _note(args, text: str) -> None:
    if args.progress or (args.progress is None and sys.stderr.isatty()):
        print(f"dcp-zarr: {text}", file=sys.stderr)


def _json_float(value):
    return "nan" if value is not None and math.isnan(value) else value  # JSON has no NaN


def _checkpoint_exception_reason(exc) -> str:
    """The last line of each rank's traceback in DCP's CheckpointException."""
    failures = getattr(exc, "failures", {}) or {}
    reasons = sorted({f"{type(f).__name__}: {f}" for f in failures.values()}) or [str(exc)]
    return "; ".join(reasons)


if __name__ == "__main__":
    sys.exit(main())
