"""Run by a Python that may have nothing of ours (tests/readers/test_foreign_readers.py): what zarr-python, and where
installed xarray and the zarrs codec pipeline, read of a store. Prints JSON; imports nothing of this repository.

    python zarr_read.py STORE NODE...
"""

import hashlib
import importlib.util
import json
import sys
import warnings

import zarr


def described(array) -> list:
    data = array[...]
    return [str(data.dtype), list(data.shape), hashlib.sha256(data.tobytes()).hexdigest()]


def read_each(group, nodes: list[str]) -> dict:
    found = {}
    for node in nodes:
        try:
            found[node] = described(group[node])
        except Exception as exc:  # noqa: BLE001 - what the reader says is the result
            found[node] = f"error: {type(exc).__name__}: {exc}"
    return found


def main() -> None:
    store, nodes = sys.argv[1], sys.argv[2:]
    report = {"zarr": zarr.__version__, "python": sys.version.split()[0],
              "torch_installed": importlib.util.find_spec("torch") is not None,
              "dcp_zarr_installed": importlib.util.find_spec("dcp_zarr") is not None}
    group = zarr.open_group(store, mode="r")  # zarr-python's defaults
    report["arrays"] = read_each(group, nodes)
    try:
        report["listing"] = sorted(name for name, _ in group.members(max_depth=None))
    except Exception as exc:  # noqa: BLE001
        report["listing"] = f"error: {type(exc).__name__}: {exc}"
    if importlib.util.find_spec("zarrs") is not None:
        with zarr.config.set({"codec_pipeline.path": "zarrs.ZarrsCodecPipeline"}):
            report["zarrs"] = read_each(zarr.open_group(store, mode="r"), nodes)
    if importlib.util.find_spec("xarray") is not None:
        import xarray as xr

        with warnings.catch_warnings():
            warnings.simplefilter("error")  # consolidated=False: nothing to warn about
            tree = xr.open_datatree(store, engine="zarr", consolidated=False)
        found = {}
        for node in nodes:
            parent, _, name = node.rpartition("/")
            values = tree[parent][name].values
            found[node] = [str(values.dtype), list(values.shape), hashlib.sha256(values.tobytes()).hexdigest()]
        report["xarray"] = found
    print(json.dumps(report))


if __name__ == "__main__":
    main()
