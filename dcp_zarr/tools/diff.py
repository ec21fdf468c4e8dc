"""``dcp-zarr diff``: entry by entry, are two checkpoints (zarr stores or DCP directories) the same?

Tensors are compared in row blocks, so two checkpoints larger than memory can be compared. "equal" means
bit-identical; "close" means not bit-identical but numerically within ``atol`` (``-0.0`` vs ``0.0``, or a
reduced-precision round trip with a tolerance); NaNs in the same places count as equal.

Tensors are compared as numpy arrays (``read_array``; ml_dtypes' types for bfloat16 and float8), so comparing two
zarr stores needs no torch. Values saved as ``torch.save`` bytes are equal when their stored bytes are; bytes that
differ are decoded and compared as values, which needs torch: where it cannot be imported they are reported as
different, saying that they were not decoded.
"""

from __future__ import annotations

import io
import math
import sys
from dataclasses import dataclass, field

import numpy as np

from dcp_zarr.errors import CorruptChunkError, TorchNotImportableError
from dcp_zarr.format.manifest import OBJECT, TENSOR, VALUE
from dcp_zarr.offline import Entry
from dcp_zarr.progress import progress_bar

EQUAL, CLOSE, DIFFERENT, ONLY_A, ONLY_B, MISMATCH = "equal", "close", "different", "only in A", "only in B", "mismatch"
UNREADABLE = "unreadable"  # a chunk is missing or corrupt on either side: run `dcp-zarr verify` on it
_BLOCK_BYTES = 64 << 20


@dataclass
class EntryDiff:
    fqn: str
    status: str
    detail: str = ""
    max_abs_diff: float | None = None
    differing: int = 0  # elements whose bits differ
    numel: int = 0


@dataclass
class DiffReport:
    a: str
    b: str
    entries: list[EntryDiff] = field(default_factory=list)

    @property
    def same(self) -> bool:
        return all(e.status in (EQUAL, CLOSE) for e in self.entries)

    def counts(self) -> dict[str, int]:
        counts = {s: 0 for s in (EQUAL, CLOSE, DIFFERENT, MISMATCH, ONLY_A, ONLY_B, UNREADABLE)}
        for e in self.entries:
            counts[e.status] += 1
        return counts


def diff_checkpoints(a, b, *, atol: float = 0.0, progress: bool | None = False) -> DiffReport:
    """Compare every entry of ``a`` and ``b`` (each an ``checkpoint.Checkpoint`` or ``dcp_dir.DcpCheckpoint``)."""
    report = DiffReport(a.url, b.url)
    names = list(a.entries) + [n for n in b.entries if n not in a.entries]
    total = sum(a.entries[n].nbytes for n in names if n in a.entries and n in b.entries)
    with progress_bar(total, "comparing", enabled=progress) as bar:
        for name in names:
            if name not in b.entries:
                report.entries.append(EntryDiff(name, ONLY_A))
            elif name not in a.entries:
                report.entries.append(EntryDiff(name, ONLY_B))
            else:
                try:
                    report.entries.append(_diff_entry(a, b, a.entries[name], b.entries[name], atol))
                except CorruptChunkError as exc:
                    report.entries.append(EntryDiff(name, UNREADABLE, str(exc)))
                bar.update(a.entries[name].nbytes)
    return report


def _diff_entry(a, b, ea: Entry, eb: Entry, atol: float) -> EntryDiff:
    if (ea.kind == TENSOR) != (eb.kind == TENSOR):
        return EntryDiff(ea.fqn, MISMATCH, f"{_kind(ea)} vs {_kind(eb)}")
    if ea.kind != TENSOR:
        return _diff_value(a, b, ea, eb)
    if ea.dtype_name != eb.dtype_name or ea.shape != eb.shape:
        return EntryDiff(ea.fqn, MISMATCH, f"{_kind(ea)} vs {_kind(eb)}")
    return _diff_tensor(a, b, ea, eb, atol)


def _diff_value(a, b, ea: Entry, eb: Entry) -> EntryDiff:
    if ea.kind == eb.kind == VALUE and _stored_json(a, ea) == _stored_json(b, eb) is not None:
        return EntryDiff(ea.fqn, EQUAL)  # the same tagged JSON: exact, and nothing to decode
    if ea.kind == eb.kind == OBJECT and a.read_object_bytes(ea) == b.read_object_bytes(eb):
        return EntryDiff(ea.fqn, EQUAL)  # the same torch.save bytes load as the same value: nothing to unpickle
    try:
        va, vb = a.read_value(ea), b.read_value(eb)
    except TorchNotImportableError:
        what = "the stored torch.save bytes differ" if ea.kind == eb.kind else f"{_kind(ea)} vs {_kind(eb)}"
        return EntryDiff(ea.fqn, DIFFERENT, f"{what}; not decoded to compare the values: torch cannot be imported")
    if _same_value(va, vb):
        return EntryDiff(ea.fqn, EQUAL)
    return EntryDiff(ea.fqn, DIFFERENT, f"{_short(va)} vs {_short(vb)}")


def _diff_tensor(a, b, ea: Entry, eb: Entry, atol: float) -> EntryDiff:
    assert ea.shape is not None and ea.dtype_name is not None  # recorded for every tensor entry
    numel = math.prod(ea.shape)
    result = EntryDiff(ea.fqn, EQUAL, numel=numel)
    if numel == 0:
        return result
    blocks: list[tuple[slice, ...] | None]
    if not ea.shape:
        blocks = [None]
    else:
        rows = max(1, _BLOCK_BYTES // max(1, ea.nbytes // ea.shape[0]))
        blocks = [(slice(r, min(r + rows, ea.shape[0])),) for r in range(0, ea.shape[0], rows)]
    worst = 0.0
    for region in blocks:
        xa, xb = a.read_array(ea, region), b.read_array(eb, region)
        bits_a, bits_b = _bits(xa), _bits(xb)
        if np.array_equal(bits_a, bits_b):
            continue
        result.differing += int((bits_a != bits_b).any(axis=1).sum())
        block_worst = _max_abs_diff(xa, xb, ea.dtype_name)
        worst = float("nan") if math.isnan(worst) or math.isnan(block_worst) else max(worst, block_worst)
    if result.differing:
        result.max_abs_diff = worst
        result.status = CLOSE if worst <= atol else DIFFERENT  # False for NaN: a NaN on one side only differs
        result.detail = f"max abs diff {worst:.6g}, {result.differing} of {numel} elements differ"
    return result


def _bits(x: np.ndarray) -> np.ndarray:
    """One row of raw bytes per element."""
    flat = np.ascontiguousarray(x).reshape(-1)
    return flat.view(np.uint8).reshape(flat.size, -1)


def _max_abs_diff(xa: np.ndarray, xb: np.ndarray, dtype_name: str) -> float:
    # By torch's name: numpy calls ml_dtypes' bfloat16 and float8 kind "V", not floating.
    is_complex, is_float = "complex" in dtype_name, "float" in dtype_name
    wide = np.complex128 if is_complex else np.float64
    # invalid: widening a signalling NaN, and inf - inf; over: overflowing differences; all handled below
    with np.errstate(invalid="ignore", over="ignore"):
        da, db = xa.astype(wide), xb.astype(wide)
        diff = np.abs(da - db)
        same = (da == db) | (np.isnan(da) & np.isnan(db))  # equal infinities give inf - inf = nan
    diff = np.where(same, 0.0, diff)
    worst = float(diff.max())  # NaN when a NaN faces a number
    if not (is_float or is_complex):
        worst = max(worst, 1.0)  # integers that differ differ by >= 1, even where float64 rounds (beyond 2**53)
    return worst


def _stored_json(ckpt, entry: Entry):
    """The tagged JSON document of a value entry of a zarr checkpoint (None for a DCP directory's)."""
    manifest = getattr(ckpt, "manifest", None)
    return None if manifest is None else manifest.entries[entry.fqn].value


def _same_value(x, y) -> bool:
    torch = sys.modules.get("torch")  # a value holding tensors was made by torch, so it is imported already
    if torch is not None and (isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor)):
        return (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and x.dtype == y.dtype
                and x.shape == y.shape and torch.equal(_tensor_bits(x), _tensor_bits(y)))
    if type(x) is not type(y):
        return False
    if isinstance(x, (np.ndarray, np.generic)):  # by their bits: == is elementwise, and NaN != NaN
        return x.dtype == y.dtype and np.shape(x) == np.shape(y) and x.tobytes() == y.tobytes()
    if isinstance(x, io.BytesIO):
        return x.getvalue() == y.getvalue()
    if isinstance(x, dict):
        return x.keys() == y.keys() and all(_same_value(x[k], y[k]) for k in x)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_same_value(p, q) for p, q in zip(x, y))
    if isinstance(x, float) and math.isnan(x) and math.isnan(y):
        return True
    try:
        return bool(x == y)
    except Exception:  # a type whose == is not a truth value: not known to be equal
        return False


def _tensor_bits(t):
    flat = t.contiguous().reshape(-1)
    return flat.view(sys.modules["torch"].uint8).reshape(flat.numel(), -1)


def _kind(entry: Entry) -> str:
    if entry.kind == OBJECT:
        return "torch.save bytes"
    if entry.kind != TENSOR:
        return "a non-tensor value"
    assert entry.dtype_name is not None and entry.shape is not None  # recorded for every tensor entry
    return f"{entry.dtype_name.removeprefix('torch.')}[{', '.join(map(str, entry.shape))}]"


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
