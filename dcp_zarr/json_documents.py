"""JSON documents as dcp_zarr writes and reads them: compact, strict (no NaN or infinities written), and decoded with
the garbage collector paused. Below both the format (which makes documents) and storage (which moves their bytes).
Implementation."""

from __future__ import annotations

import json

from dcp_zarr.gc_pause import collector_paused

# One encoder for every document, as json.dumps keeps one for its defaults: a save encodes a zarr.json per array,
# and making an encoder for each would add a fixed cost to every document, not small beside encoding a few hundred
# bytes.
_JSON_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)


def json_text(document) -> str:
    """``document`` as the compact JSON every ``zarr.json`` is written in; NaN and infinities refused."""
    return _JSON_ENCODER.encode(document)


def decode_json(data: bytes | str):
    """``json.loads(data)`` with the cyclic garbage collector paused: decoding makes no reference cycles, and a root
    ``zarr.json`` is thousands of dicts and lists (20 a tensor), most freed right after it is read (node_copies.py
    keeps text). Collected while the decoder still held them, they would be promoted to the oldest generation and
    set off a full collection of the whole process, torch's objects included, in most loads of hundreds of tensors
    (what a full collection costs: benchmarks/reports/performance.md, "Many entries, files and requests")."""
    with collector_paused():
        return json.loads(data)
