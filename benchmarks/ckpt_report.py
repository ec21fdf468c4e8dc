"""The benchmark's result: assembling it, checking its schema, printing and plotting it.

GB is 10**9 bytes. A measurement's time is the median over repeats of the slowest rank's time.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterator
from typing import Any

from ckpt_measure import RankTimes

SCHEMA_VERSION = 1
GB = 1e9

# Keys whose numbers may be zero (everything else numeric must be finite and > 0).
NON_NEGATIVE_KEYS = {"small_tensors", "rank_peak_extra_bytes", "rank_fraction_of_state_bytes", "max_fraction"}

MEASUREMENT_KEYS = ("bytes", "rank_bytes", "times_s", "rank_times_s", "median_s", "min_s", "gbps", "rank_gbps")
ASYNC_KEYS = (
    "bytes", "rank_bytes", "blocking_times_s", "total_times_s", "median_blocking_s", "median_total_s",
    "min_blocking_s", "min_total_s", "gbps", "blocking_gbps", "rank_gbps",
)  # fmt: skip
RESHARD_EXTRA_KEYS = ("saved_world_size", "rank_read_bytes", "rank_needed_bytes", "rank_read_amplification")
FOOTPRINT_KEYS = ("files", "directories", "bytes")
MEMORY_KEYS = ("rank_peak_extra_bytes", "rank_fraction_of_state_bytes", "max_fraction")
CONFIG_KEYS = (
    "layers", "hidden", "vocab", "dtype", "world_size", "backend", "threads", "repeats", "target", "kinds",
    "small_tensors", "reshard_from", "host",
)  # fmt: skip
HOST_KEYS = ("cpu_count", "torch_version")


def timing_entry(total_bytes: int, rank_bytes: list[int], runs: list[RankTimes]) -> dict[str, Any]:
    """One measurement from its repeats: raw times, median, aggregate and per-rank GB/s."""
    times = [run.max_s for run in runs]
    per_rank_median = [statistics.median(run.per_rank_s[r] for run in runs) for r in range(len(rank_bytes))]
    median_s = statistics.median(times)
    return {
        "bytes": total_bytes,
        "rank_bytes": rank_bytes,
        "times_s": times,
        "rank_times_s": [run.per_rank_s for run in runs],
        "median_s": median_s,
        "min_s": min(times),
        "gbps": total_bytes / median_s / GB,
        # Each rank's bytes over its own time: shows a rank that is slow because it writes more (e.g. deduped items).
        "rank_gbps": [b / t / GB for b, t in zip(rank_bytes, per_rank_median)],
    }


def async_entry(
    total_bytes: int, rank_bytes: list[int], blocking: list[RankTimes], total: list[RankTimes]
) -> dict[str, Any]:
    entry = timing_entry(total_bytes, rank_bytes, total)
    blocking_s = [run.max_s for run in blocking]
    return {
        "bytes": total_bytes,
        "rank_bytes": rank_bytes,
        "blocking_times_s": blocking_s,
        "total_times_s": entry["times_s"],
        "median_blocking_s": statistics.median(blocking_s),
        "median_total_s": entry["median_s"],
        "min_blocking_s": min(blocking_s),
        "min_total_s": entry["min_s"],
        "gbps": entry["gbps"],
        # State-dict bytes over the time training is stopped: what the caller experiences.
        "blocking_gbps": total_bytes / statistics.median(blocking_s) / GB,
        "rank_gbps": entry["rank_gbps"],
    }


def memory_entry(extra_bytes: list[int], rank_bytes: list[int]) -> dict[str, Any]:
    fractions = [extra / max(1, b) for extra, b in zip(extra_bytes, rank_bytes)]
    return {"rank_peak_extra_bytes": extra_bytes, "rank_fraction_of_state_bytes": fractions,
            "max_fraction": max(fractions)}


def compute_ratios(measurements: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Ratios > 1 mean zarr is faster (they are time(other) / time(zarr))."""

    def median_s(name: str) -> float | None:
        entry = measurements.get(name)
        return None if entry is None else entry["median_s"]

    pairs = {
        "save_speedup_zarr_vs_fs": ("save/fs", "save/zarr"),
        "save_zarr_fraction_of_raw": ("save/raw", "save/zarr"),
        "save_fs_fraction_of_raw": ("save/raw", "save/fs"),
        "load_speedup_zarr_vs_fs": ("load/fs", "load/zarr"),
        "small_tensors_save_speedup_zarr_vs_fs": ("small/fs", "small/zarr"),
        "reshard_load_speedup_zarr_vs_fs": ("reshard/fs", "reshard/zarr"),
    }
    ratios = {}
    for name, (numerator, denominator) in pairs.items():
        top, bottom = median_s(numerator), median_s(denominator)
        if top is not None and bottom is not None:
            ratios[name] = top / bottom
    if "async/zarr" in measurements:
        entry = measurements["async/zarr"]
        ratios["async_blocking_fraction"] = entry["median_blocking_s"] / entry["median_total_s"]
    return ratios


# --- schema -------------------------------------------------------------------------------------------------------


def expected_measurements(config: dict[str, Any]) -> list[str]:
    kinds = config["kinds"]
    names = [f"save/{k}" for k in kinds]
    names += [f"load/{k}" for k in kinds if k != "raw"]
    if "zarr" in kinds:
        names.append("async/zarr")
    if config["small_tensors"] > 0:
        names += [f"small/{k}" for k in kinds if k != "raw"]
    if config["reshard_from"]:
        names += [f"reshard/{k}" for k in kinds if k != "raw"]
    return names


def expected_ratios(config: dict[str, Any]) -> list[str]:
    kinds = set(config["kinds"])
    names = []
    if {"zarr", "fs"} <= kinds:
        names += ["save_speedup_zarr_vs_fs", "load_speedup_zarr_vs_fs"]
        if config["small_tensors"] > 0:
            names.append("small_tensors_save_speedup_zarr_vs_fs")
        if config["reshard_from"]:
            names.append("reshard_load_speedup_zarr_vs_fs")
    if "raw" in kinds:
        names += [f"save_{k}_fraction_of_raw" for k in ("zarr", "fs") if k in kinds]
    if "zarr" in kinds:
        names.append("async_blocking_fraction")
    return names


def _numbers(tree: Any, path: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, dict):
        for key, value in tree.items():
            yield from _numbers(value, f"{path}.{key}" if path else str(key))
    elif isinstance(tree, list):
        for i, value in enumerate(tree):
            yield from _numbers(value, f"{path}[{i}]")
    elif isinstance(tree, (int, float)) and not isinstance(tree, bool):
        yield path, tree


def _missing(entry: Any, keys: tuple[str, ...], where: str) -> list[str]:
    if not isinstance(entry, dict):
        return [f"{where} is missing or not an object"]
    return [f"{where}.{key} is missing" for key in keys if key not in entry]


def validate_result(d: dict[str, Any]) -> dict[str, Any]:
    """Check a result against the schema: every expected key present, every number finite and > 0.

    Which measurements are expected follows from the config (``kinds``, ``small_tensors``, ``reshard_from``).
    Memory deltas may be 0. Raises ValueError listing every problem; returns ``d`` when it is valid.
    """
    sections = ("schema_version", "config", "state_dict", "measurements", "ratios", "memory", "footprint", "checks")
    problems = _missing(d, sections, "result")
    if problems:
        raise ValueError("; ".join(problems))
    config = d["config"]
    problems += _missing(config, CONFIG_KEYS, "config")
    problems += _missing(config.get("host"), HOST_KEYS, "config.host")
    if problems:
        raise ValueError("; ".join(problems))
    problems += _missing(d["state_dict"], ("total_bytes", "rank_bytes", "tensors"), "state_dict")

    for name in expected_measurements(config):
        keys = ASYNC_KEYS if name.startswith("async/") else MEASUREMENT_KEYS
        if name.startswith("reshard/"):
            keys += RESHARD_EXTRA_KEYS
        entry = d["measurements"].get(name)
        problems += _missing(entry, keys, f"measurements[{name!r}]")
        if isinstance(entry, dict):
            for key in ("rank_bytes", "rank_gbps"):
                if len(entry.get(key, ())) != config["world_size"]:
                    problems.append(f"measurements[{name!r}].{key} should have world_size entries")
            for key in ("times_s", "blocking_times_s", "total_times_s"):
                if key in entry and len(entry[key]) != config["repeats"]:
                    problems.append(f"measurements[{name!r}].{key} should have one entry per repeat")
    for name in expected_ratios(config):
        if name not in d["ratios"]:
            problems.append(f"ratios.{name} is missing")
    for kind in config["kinds"]:
        problems += _missing(d["memory"].get(f"save/{kind}"), MEMORY_KEYS, f"memory['save/{kind}']")
    for name in expected_measurements(config):
        if name.startswith(("save/", "small/")):
            problems += _missing(d["footprint"].get(name), FOOTPRINT_KEYS, f"footprint[{name!r}]")
    for name, passed in d["checks"].items():
        if not isinstance(passed, bool):
            problems.append(f"checks[{name!r}] is not a boolean")

    numeric = ("config", "state_dict", "measurements", "ratios", "memory", "footprint")
    for path, value in _numbers({k: d[k] for k in numeric}):
        key = path.rsplit(".", 1)[-1].split("[", 1)[0]
        if not math.isfinite(value):
            problems.append(f"{path} = {value} is not finite")
        elif value < 0 or (value == 0 and key not in NON_NEGATIVE_KEYS):
            problems.append(f"{path} = {value} is not positive")
    if problems:
        raise ValueError("; ".join(problems))
    return d


# --- presentation ---------------------------------------------------------------------------------------------------


def summary_lines(d: dict[str, Any]) -> list[str]:
    c = d["config"]
    lines = [
        f"{c['world_size']} rank(s), {c['backend']}, {c['threads']} threads, {c['repeats']} repeats, "
        f"state dict {d['state_dict']['total_bytes'] / GB:.3f} GB, target {c['target']}",
        f"{'measurement':<16}{'median s':>10}{'GB/s':>9}   per-rank GB/s",
    ]
    for name, entry in d["measurements"].items():
        if name.startswith("async/"):
            lines.append(
                f"{name + ' block':<16}{entry['median_blocking_s']:>10.4f}{entry['blocking_gbps']:>9.3f}"
            )
            lines.append(f"{name + ' total':<16}{entry['median_total_s']:>10.4f}{entry['gbps']:>9.3f}")
            continue
        per_rank = " ".join(f"{g:.3f}" for g in entry["rank_gbps"])
        lines.append(f"{name:<16}{entry['median_s']:>10.4f}{entry['gbps']:>9.3f}   {per_rank}")
    lines += [f"ratio {name}: {value:.3f}" for name, value in d["ratios"].items()]
    for name, entry in d["memory"].items():
        lines.append(f"peak extra RSS {name}: max {entry['max_fraction']:.3f} x rank state bytes "
                     f"({', '.join(f'{b / 2**20:.1f} MiB' for b in entry['rank_peak_extra_bytes'])})")  # fmt: skip
    for name, entry in d["footprint"].items():
        lines.append(f"footprint {name}: {entry['files']} files, {entry['directories']} directories, "
                     f"{entry['bytes'] / 2**20:.1f} MiB")  # fmt: skip
    for name, entry in d["measurements"].items():
        if name.startswith("reshard/"):
            amp = ", ".join(f"{a:.2f}" for a in entry["rank_read_amplification"])
            lines.append(f"{name} read/needed bytes per rank: {amp} (from world size {entry['saved_world_size']})")
    failed = [name for name, ok in d["checks"].items() if not ok]
    lines.append(f"checks: {'all passed' if not failed else 'FAILED: ' + ', '.join(failed)}")
    return lines


KIND_COLOURS = {"zarr": "tab:blue", "fs": "tab:orange", "raw": "tab:gray"}


def plot_result(d: dict[str, Any], path: str) -> None:
    """Bar chart of median GB/s per measurement, ratios written beside it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels, values, colours = [], [], []
    for name, entry in d["measurements"].items():
        kind = name.split("/", 1)[1]
        if name.startswith("async/"):
            pairs = [(f"{name} (blocking)", entry["blocking_gbps"]), (f"{name} (total)", entry["gbps"])]
        else:
            pairs = [(name, entry["gbps"])]
        for label, value in pairs:
            labels.append(label)
            values.append(value)
            colours.append(KIND_COLOURS.get(kind, "tab:green"))

    fig, (ax, text_ax) = plt.subplots(1, 2, figsize=(13, 0.45 * len(labels) + 2.5), width_ratios=(3, 2))
    bars = ax.barh(labels[::-1], values[::-1], color=colours[::-1])
    ax.bar_label(bars, fmt="%.3f", padding=3, fontsize=8)
    ax.set_xlabel("GB/s (state-dict bytes / median time; small/* use their own bytes)")
    ax.margins(x=0.15)
    c = d["config"]
    ax.set_title(
        f"{c['layers']}L h{c['hidden']} v{c['vocab']} {c['dtype']}, "
        f"{d['state_dict']['total_bytes'] / GB:.3f} GB, {c['world_size']} rank(s) {c['backend']}, "
        f"{c['threads']} threads",
        fontsize=10,
    )
    ratio_lines = ["ratios (speedup > 1: zarr faster;", "fraction_of_raw: raw time / writer time)"]
    ratio_lines += [f"{k}: {v:.2f}" for k, v in d["ratios"].items()]
    ratio_lines += ["", "peak extra RSS during save"]
    ratio_lines += [f"{k}: {v['max_fraction']:.2f} x state bytes" for k, v in d["memory"].items()]
    text_ax.axis("off")
    text_ax.text(0, 1, "\n".join(ratio_lines), va="top", family="monospace", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
