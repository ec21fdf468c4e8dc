"""The GPU check's result: per-measurement summaries, the issue's targets, the Markdown table, the schema check.

GB is 10**9 bytes, MiB 2**20. A measurement's time is the median of its repeats (world size 1: one rank's time).
Ratios are time(other) / time(zarr), so above 1 means dcp_zarr is faster.
"""

from __future__ import annotations

import math
import statistics

SCHEMA = "gpu_check/1"
GB = 1e9
MIB = 1 << 20

# The targets of issue 26 (measured on the GPU): a target that is not met is reported, never hidden or failed on.
SAVE_VS_FS_AT_LEAST = 1.5
SAVE_FRACTION_OF_RAW_AT_LEAST = 0.8
LOAD_VS_FS_AT_LEAST = 1.5
ASYNC_BLOCKED_VS_COPY_AT_MOST = 1.2

MEASUREMENT_KEYS = ("bytes", "times_s", "median_s", "min_s", "gbps", "peak_rss_extra_bytes", "peak_gpu_extra_bytes")
ASYNC_KEYS = (
    "bytes", "first_blocking_s", "first_total_s", "blocking_times_s", "total_times_s", "median_blocking_s",
    "median_total_s", "copy_times_s", "median_copy_s", "copy_gbps", "blocking_vs_copy", "peak_rss_extra_bytes",
    "peak_gpu_extra_bytes", "loads_equal",
)  # fmt: skip
TOP_KEYS = (
    "schema", "dry_run", "commit", "date", "torch", "cuda", "device", "python", "zarr", "backend", "threads",
    "repeats", "state", "targets", "async", "ratios", "targets_met", "steps", "elapsed_s",
)  # fmt: skip


def measurement(nbytes: int, times_s: list[float], peak_rss_extra: int, peak_gpu_extra: int | None) -> dict:
    median_s = statistics.median(times_s)
    return {
        "bytes": nbytes,
        "times_s": times_s,
        "median_s": median_s,
        "min_s": min(times_s),
        "gbps": nbytes / median_s / GB,
        "peak_rss_extra_bytes": peak_rss_extra,  # max over the repeats, beyond the RSS before each
        "peak_gpu_extra_bytes": peak_gpu_extra,  # None without CUDA
    }


def _ratio(numerator: dict | None, denominator: dict | None) -> float | None:
    if not numerator or not denominator:
        return None
    return numerator["median_s"] / denominator["median_s"]


def target_ratios(target: dict) -> dict[str, float | None]:
    save, load = target.get("save", {}), target.get("load", {})
    return {
        "save_zarr_vs_fs": _ratio(save.get("fs"), save.get("zarr")),
        "save_zarr_fraction_of_raw": _ratio(save.get("raw"), save.get("zarr")),
        "load_zarr_vs_fs": _ratio(load.get("fs"), load.get("zarr")),
    }


def targets_met(ratios: dict[str, dict[str, float | None]], async_result: dict | None,
                gpu_bound_bytes: int | None, gpu_extra_bytes: int | None) -> dict[str, bool | None]:
    """Each target of the issue: True, False, or None where it was not measured (a skipped target, no CUDA)."""

    def at_least(value: float | None, bound: float) -> bool | None:
        return None if value is None else value >= bound

    met: dict[str, bool | None] = {}
    for name, r in ratios.items():
        met[f"{name}: save >= {SAVE_VS_FS_AT_LEAST}x FileSystemWriter"] = at_least(r["save_zarr_vs_fs"],
                                                                                 SAVE_VS_FS_AT_LEAST)
        met[f"{name}: save >= {SAVE_FRACTION_OF_RAW_AT_LEAST}x raw"] = at_least(r["save_zarr_fraction_of_raw"],
                                                                               SAVE_FRACTION_OF_RAW_AT_LEAST)
        met[f"{name}: load >= {LOAD_VS_FS_AT_LEAST}x FileSystemReader"] = at_least(r["load_zarr_vs_fs"],
                                                                                 LOAD_VS_FS_AT_LEAST)
    blocked = async_result["blocking_vs_copy"] if async_result else None
    met[f"async: blocked <= {ASYNC_BLOCKED_VS_COPY_AT_MOST}x device-to-pinned copy"] = (
        None if blocked is None else blocked <= ASYNC_BLOCKED_VS_COPY_AT_MOST)
    met["zarr: GPU memory beyond the state dict <= one inner chunk per IO thread"] = (
        None if gpu_bound_bytes is None or gpu_extra_bytes is None else gpu_extra_bytes <= gpu_bound_bytes)
    return met


# --- the Markdown table ---------------------------------------------------------------------------------------------


def _mib(value: int | None) -> str:
    return "n/a" if value is None else f"{value / MIB:,.0f}"


def _times(entry: dict | None) -> tuple[str, str, str, str]:
    if not entry:
        return "", "", "", ""
    return (f"{entry['median_s']:.3f}", f"{entry['gbps']:.2f}", _mib(entry["peak_gpu_extra_bytes"]),
            _mib(entry["peak_rss_extra_bytes"]))


def to_markdown(result: dict) -> str:
    state = result["state"]
    lines = [
        f"# GPU check{' (dry run on CPU: sizes and timings mean nothing)' if result['dry_run'] else ''}",
        "",
        f"commit {result['commit']}, {result['date']}, torch {result['torch']}, CUDA {result['cuda']}, "
        f"{result['device']}, zarr {result['zarr']}, Python {result['python']}; backend {result['backend']}, "
        f"world size 1, {result['threads']} IO threads, medians of {result['repeats']}",
        "",
        f"State dict: {state['bytes'] / GB:.2f} GB in {state['tensors']} tensors ("
        + ", ".join(f"{dtype} {nbytes / GB:.2f} GB" for dtype, nbytes in state["bytes_by_dtype"].items()) + ").",
        "",
        "| target | kind | save s | save GB/s | load s | load GB/s | save GPU extra MiB | save RSS extra MiB "
        "| load GPU extra MiB | load RSS extra MiB |",
        "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name, target in result["targets"].items():
        if "save" not in target:
            why = f"skipped: {target['skipped']}" if target.get("skipped") else f"failed: {target.get('failed')}"
            lines.append(f"| {name} | {why} | | | | | | | | |")
            continue
        for kind in ("zarr", "fs", "raw"):
            save_s, save_gbps, save_gpu, save_rss = _times(target["save"].get(kind))
            load_s, load_gbps, load_gpu, load_rss = _times(target["load"].get(kind))
            lines.append(f"| {name} | {kind} | {save_s} | {save_gbps} | {load_s} | {load_gbps} | {save_gpu} "
                         f"| {save_rss} | {load_gpu} | {load_rss} |")
    lines += ["", "| target | save zarr vs fs | save zarr / raw | load zarr vs fs |", "| --- | ---: | ---: | ---: |"]
    for name, r in result["ratios"].items():
        cells = ["n/a" if r[k] is None else f"{r[k]:.2f}x" for k in
                 ("save_zarr_vs_fs", "save_zarr_fraction_of_raw", "load_zarr_vs_fs")]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    a = result["async"]
    if a:
        lines += [
            "",
            f"`dcp.async_save`, ZarrWriter(cache_staged_state_dict=True), to {a['target']}: blocked "
            f"{a['median_blocking_s']:.3f} s, total {a['median_total_s']:.3f} s (first save, allocating the staging "
            f"buffers: {a['first_blocking_s']:.3f} s / {a['first_total_s']:.3f} s); a plain device-to-pinned copy of "
            f"the same bytes {a['median_copy_s']:.3f} s ({a['copy_gbps']:.2f} GB/s): blocked = "
            f"{a['blocking_vs_copy']:.2f}x the copy; GPU extra {_mib(a['peak_gpu_extra_bytes'])} MiB, RSS extra "
            f"{_mib(a['peak_rss_extra_bytes'])} MiB.",
        ]
    judged = " (a dry run's figures judge nothing)" if result["dry_run"] else ""
    lines += ["", f"Targets (issue 26){judged}:", ""]
    for name, met in result["targets_met"].items():
        lines.append(f"- {name}: {'not measured' if met is None else 'met' if met else 'NOT met'}")
    for failure in result.get("failures", []):
        lines.append(f"- FAILED: {failure}")
    lines += ["", f"Elapsed {result['elapsed_s']:.1f} s: " + ", ".join(
        f"{step['name']} {step['elapsed_s']:.1f} s" for step in result["steps"]) + "."]
    return "\n".join(lines) + "\n"


# --- the schema check -----------------------------------------------------------------------------------------------


def _positive_times(where: str, values: list[float]) -> None:
    if not values or not all(isinstance(v, float) and math.isfinite(v) and v > 0 for v in values):
        raise ValueError(f"{where}: expected finite positive times, got {values!r}")


def _check_measurement(where: str, entry: dict, cuda: bool) -> None:
    missing = [k for k in MEASUREMENT_KEYS if k not in entry]
    if missing:
        raise ValueError(f"{where}: missing {missing}")
    _positive_times(f"{where}.times_s", entry["times_s"])
    _positive_times(f"{where}.median_s/gbps", [entry["median_s"], entry["gbps"]])
    if not (isinstance(entry["bytes"], int) and entry["bytes"] > 0):
        raise ValueError(f"{where}.bytes: expected a positive int, got {entry['bytes']!r}")
    if not (isinstance(entry["peak_rss_extra_bytes"], int) and entry["peak_rss_extra_bytes"] >= 0):
        raise ValueError(f"{where}.peak_rss_extra_bytes: expected an int >= 0, got {entry['peak_rss_extra_bytes']!r}")
    gpu = entry["peak_gpu_extra_bytes"]
    if cuda != isinstance(gpu, int) or (cuda and gpu < 0):
        raise ValueError(f"{where}.peak_gpu_extra_bytes: expected {'an int >= 0' if cuda else 'None'}, got {gpu!r}")


def validate_result(result: dict) -> None:
    """Raise ValueError naming the first field that is missing or wrong; every timing must be finite and > 0."""
    missing = [k for k in TOP_KEYS if k not in result]
    if missing:
        raise ValueError(f"result: missing {missing}")
    if result["schema"] != SCHEMA:
        raise ValueError(f"result.schema: expected {SCHEMA!r}, got {result['schema']!r}")
    cuda = result["backend"] != "gloo"
    measured = 0
    if result.get("failures"):
        raise ValueError(f"result.failures: {result['failures']}")
    for name, target in result["targets"].items():
        if target.get("skipped"):
            continue
        for op, kinds in (("save", ("zarr", "fs", "raw")), ("load", ("zarr", "fs"))):
            for kind in kinds:
                entry = target.get(op, {}).get(kind)
                if entry is None:
                    raise ValueError(f"targets.{name}.{op}.{kind}: missing")
                _check_measurement(f"targets.{name}.{op}.{kind}", entry, cuda)
                measured += 1
        if target.get("loads_equal") is not True:
            raise ValueError(f"targets.{name}.loads_equal: a load did not give back the saved state")
    if not measured:
        raise ValueError("targets: every target was skipped, nothing was measured")
    a = result["async"]
    if a is not None:
        missing = [k for k in ASYNC_KEYS if k not in a]
        if missing:
            raise ValueError(f"async: missing {missing}")
        _positive_times("async.blocking_times_s", a["blocking_times_s"])
        _positive_times("async.total_times_s", a["total_times_s"])
        _positive_times("async.copy_times_s", a["copy_times_s"])
        if a["loads_equal"] is not True:
            raise ValueError("async.loads_equal: the async checkpoint did not load back equal")
    _positive_times("steps", [step["elapsed_s"] for step in result["steps"]] + [result["elapsed_s"]])
