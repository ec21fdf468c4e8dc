"""Object stores: a real S3 server (radosgw) on 127.0.0.1 through obstore (the default) and s3fs, and ``memory://``
through fsspec."""

from __future__ import annotations

import subprocess
import time
import uuid

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from dcp_zarr import NotACheckpointError, ZarrCheckpointError, ZarrReader, ZarrSavePlanner, ZarrWriter
from dcp_zarr.offline import open_checkpoint
from dcp_zarr.storage import open_storage, storage_class
from dcp_zarr.storage.zarr_store import REQUESTS_IN_FLIGHT
from dcp_zarr.tools.cli import main as cli_main
from dcp_zarr.tools.verify import verify_checkpoint
from tests.support.compare import assert_state_equal
from tests.support.models import load_fresh, train_and_save
from tests.support.ranks import run_ranks

pytestmark = [pytest.mark.filterwarnings("ignore:torch.distributed is disabled"),
              pytest.mark.usefixtures("aws_environment")]


def fresh_url(s3, name: str) -> str:
    return f"s3://{s3.bucket}/{name}-{uuid.uuid4().hex[:8]}.zarr"


def _train_and_save(rank, world_size, url, options):
    return train_and_save(rank, world_size, "fsdp2", ZarrWriter(url, storage_options=options))[0]


def _load_fresh(rank, world_size, url, options):
    return load_fresh(rank, world_size, "fsdp2", ZarrReader(url, storage_options=options))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.s3
def test_two_ranks_save_to_s3_and_three_ranks_load_it_resharded(s3):
    url, options = fresh_url(s3, "fsdp2"), s3.storage_options()

    saved = run_ranks(_train_and_save, 2, url, options)[0]
    loaded = run_ranks(_load_fresh, 3, url, options)[0]

    assert_state_equal(loaded, saved)
    ckpt = open_checkpoint(url, options)
    assert ckpt.saved_world_size == 2
    assert_state_equal(ckpt.load_full_state_dict(), saved)
    assert verify_checkpoint(ckpt).ok


# Small chunks are the common case (biases, norms, optimizer steps: thousands of them in an LLM checkpoint); on an
# object store each is a round trip, so they must be in flight together, not batched one after another.
@pytest.mark.s3
@pytest.mark.parametrize("numel", [pytest.param(256, id="1KiB-chunks"), pytest.param(1 << 18, id="1MiB-chunks")])
def test_uploads_within_one_rank_overlap(s3, numel):
    state = {f"w{i}": torch.full((numel,), float(i)) for i in range(12)}
    with s3.slow_puts(0.05) as peak_in_flight:
        dcp.save(state, planner=ZarrSavePlanner(),
                 storage_writer=ZarrWriter(fresh_url(s3, "concurrent"), storage_options=s3.storage_options(),
                                                  thread_count=4))
        assert peak_in_flight() >= 3


@pytest.mark.slow
@pytest.mark.s3
def test_an_object_store_keeps_more_requests_in_flight_than_the_threads_asked_for(s3):
    """thread_count sizes the CPU work; on an object store each request mostly waits on the network, so a rank keeps
    REQUESTS_IN_FLIGHT of them going (s3fs's connection pool, 10 by default, is widened to match)."""
    state = {f"w{i}": torch.full((256,), float(i)) for i in range(3 * REQUESTS_IN_FLIGHT)}
    with s3.slow_puts(0.2) as peak_in_flight:
        dcp.save(state, planner=ZarrSavePlanner(),
                 storage_writer=ZarrWriter(fresh_url(s3, "in-flight"), storage_options=s3.storage_options(),
                                                  thread_count=2))
        assert peak_in_flight() > 10, f"{peak_in_flight()} PUTs in flight at most"


@pytest.mark.s3
def test_verify_finds_a_corrupted_object(s3):
    url = fresh_url(s3, "corrupt")
    dcp.save({"w": torch.arange(1000, dtype=torch.float32)},
             storage_writer=ZarrWriter(url, storage_options=s3.storage_options()), planner=ZarrSavePlanner())
    fs = s3.filesystem()
    key = url.removeprefix("s3://") + "/w/c.0"
    data = bytearray(fs.cat_file(key))
    data[10] ^= 1
    fs.pipe_file(key, bytes(data))

    problems = verify_checkpoint(open_checkpoint(url, s3.storage_options())).problems

    assert [(p.node, p.chunk) for p in problems] == [("w", "c.0")]
    assert "crc32c mismatch" in problems[0].message


@pytest.mark.s3
def test_the_cli_takes_storage_options(s3, capsys):
    url = fresh_url(s3, "cli")
    dcp.save({"model": {"w": torch.ones(3, 2)}}, planner=ZarrSavePlanner(),
             storage_writer=ZarrWriter(url, storage_options=s3.storage_options()))
    options = ["-o", f"endpoint_url={s3.endpoint}", "-o", "key=testing", "-o", "secret=testing"]

    assert cli_main(["inspect", url, *options]) == 0
    assert "float32" in capsys.readouterr().out
    assert cli_main(["verify", url, *options]) == 0
    assert cli_main(["inspect", url + "-missing", *options]) == 2
    assert "not a dcp_zarr checkpoint" in capsys.readouterr().err


@pytest.mark.s3
def test_the_cli_says_an_interrupted_s3_save_is_incomplete_and_how_to_remove_it_with_a_working_command(s3, capsys,
                                                                                                    monkeypatch):
    root = f"s3://{s3.bucket}/cli-root-{uuid.uuid4().hex[:8]}"
    url = f"{root}/step-00000007.zarr"
    dcp.save({"model": {"w": torch.ones(3, 2)}, "optim": {"step": torch.tensor(7.0)}}, planner=ZarrSavePlanner(),
             storage_writer=ZarrWriter(url, storage_options=s3.storage_options()))
    storage = open_storage(url, s3.storage_options())
    for document in ("zarr.json", "model/zarr.json", "optim/zarr.json"):  # as a save killed before its documents
        storage.remove(document)
    options = ["-o", f"endpoint_url={s3.endpoint}", "-o", "key=testing", "-o", "secret=testing"]

    assert cli_main(["verify", url, *options]) == 1, "an interrupted save is a check that failed, as documented"
    assert "INCOMPLETE" in capsys.readouterr().out
    assert cli_main(["list", root, *options]) == 0
    listed = " ".join(capsys.readouterr().out.split())  # the report wraps its lines
    command = listed.split("Remove it once no job saves here: ", 1)[1].split(" (with the storage_options", 1)[0]
    assert command.startswith("python -c ") and "rm -r" not in listed, listed
    for name, value in {"AWS_ENDPOINT_URL": s3.endpoint, "AWS_ALLOW_HTTP": "true", "AWS_ACCESS_KEY_ID": "testing",
                        "AWS_SECRET_ACCESS_KEY": "testing"}.items():
        monkeypatch.setenv(name, value)
    subprocess.run(command, shell=True, check=True)  # the suggestion works as printed
    assert storage.first_keys(10) == [], "the interrupted save is gone"


@pytest.mark.s3
def test_a_local_dcp_directory_converts_into_s3(s3, tmp_path, capsys):
    state = {"model": {"w": torch.randn(4, 3)}, "epoch": 2}
    dcp.save(state, storage_writer=FileSystemWriter(tmp_path / "dcp"), no_dist=True)
    url = fresh_url(s3, "converted")
    options = ["-o", f"endpoint_url={s3.endpoint}", "-o", "key=testing", "-o", "secret=testing"]

    assert cli_main(["convert", str(tmp_path / "dcp"), url, "--to", "zarr", *options]) == 0
    assert cli_main(["diff", str(tmp_path / "dcp"), url, *options]) == 0
    assert_state_equal(open_checkpoint(url, s3.storage_options()).load_full_state_dict(), state)
    assert cli_main(["convert", str(tmp_path / "dcp"), url, "--to", "zarr", *options]) == 2
    assert "already holds a checkpoint" in capsys.readouterr().err


@pytest.mark.s3
def test_an_existing_checkpoint_on_s3_is_not_replaced_without_overwrite(s3):
    url, options = fresh_url(s3, "exists"), s3.storage_options()
    dcp.save({"w": torch.ones(2)}, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(url, storage_options=options))

    with pytest.raises(BaseException, match="already holds a checkpoint"):
        dcp.save({"w": torch.zeros(2)}, planner=ZarrSavePlanner(),
                 storage_writer=ZarrWriter(url, storage_options=options))
    assert torch.equal(open_checkpoint(url, options).read_tensor("w"), torch.ones(2))
    dcp.save({"w": torch.zeros(2)}, planner=ZarrSavePlanner(),
             storage_writer=ZarrWriter(url, storage_options=options, overwrite=True))
    assert torch.equal(open_checkpoint(url, options).read_tensor("w"), torch.zeros(2))


def test_memory_urls_work_in_one_process():
    url = f"memory://ckpt-{uuid.uuid4().hex[:8]}.zarr"
    state = {"model": {"w": torch.randn(5, 3), "b": torch.randn(3).to(torch.bfloat16)}, "step": 7}

    dcp.save(state, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(url))
    loaded = {"model": {"w": torch.zeros(5, 3), "b": torch.zeros(3, dtype=torch.bfloat16)}, "step": 0}
    dcp.load(loaded, storage_reader=ZarrReader(url))

    assert_state_equal(loaded, state)
    assert_state_equal(open_checkpoint(url).load_full_state_dict(), state)
    with pytest.raises(NotACheckpointError):
        open_checkpoint("memory://nothing-here.zarr")


@pytest.mark.slow
@pytest.mark.parametrize("client, says", [("obstore", r"cannot reach the object store at http://127\.0\.0\.1:9 "
                                                      r"\(connection refused\)"),
                                          ("fsspec", "Could not connect to the endpoint")])
def test_an_unreachable_endpoint_fails_with_a_clear_error_in_bounded_time(client, says):
    # Port 9 (discard) on localhost: connections are refused at once. The README's "quick answer" options (a small
    # connect timeout, the client's own retries kept at 3); tests/storage/test_unreachable_endpoints.py has the
    # defaults.
    options = {"endpoint_url": "http://127.0.0.1:9", "key": "x", "secret": "x", "client": client,
               "config_kwargs": {"connect_timeout": 5, "read_timeout": 60, "retries": {"max_attempts": 3}}}
    start = time.monotonic()

    unreachable = rf"(?=.*'zarr\.json')(?=.*{says})s3://ckpts/any\.zarr"
    with pytest.raises(ZarrCheckpointError, match=unreachable):
        open_checkpoint("s3://ckpts/any.zarr", options)

    assert time.monotonic() - start < 10  # a store that never answered is not retried (it took 40 s before)


@pytest.mark.s3
def test_an_s3_store_copies_within_the_server_and_says_so(s3):
    base = f"s3://{s3.bucket}/links-{uuid.uuid4().hex[:8]}"
    source, target = (open_storage(f"{base}/{name}", s3.storage_options()) for name in ("step-1", "step-2"))
    assert source.links_objects and target.links_objects, "an S3 store links: CopyObject"
    source.write("model/w/c.0.0", [bytes(range(256)) * 512])
    with s3.counting() as traffic:
        target.link_from(source, "model/w/c.0.0")
    assert traffic.requests["PUT"] == 1 and traffic.bytes_in == 0 and traffic.bytes_out == 0, traffic
    assert target.read("model/w/c.0.0") == bytes(range(256)) * 512


@pytest.mark.s3
def test_the_server_counts_copies_apart_from_the_bodies_put_and_got_per_object(s3):
    """What the incremental tests count on (tests/incremental/test_incremental_s3.py): a CopyObject is a PUT with no
    body, counted as a copy from its source; a PUT's and a GET's body bytes are counted for their object."""
    base = f"s3://{s3.bucket}/counts-{uuid.uuid4().hex[:8]}"
    source, target = (open_storage(f"{base}/{name}", s3.storage_options()) for name in ("step 1", "step-2"))
    payload = bytes(range(256)) * 64
    with s3.counting() as traffic:
        source.write("model/w/c.0.0", [payload])
        target.link_from(source, "model/w/c.0.0")
        assert target.read("model/w/c.0.0") == payload
    name = base.removeprefix("s3://")
    assert traffic.copies == {(f"{name}/step 1/model/w/c.0.0", f"{name}/step-2/model/w/c.0.0"): 1}, traffic.copies
    assert traffic.put_bytes == {f"{name}/step 1/model/w/c.0.0": len(payload)}, traffic.put_bytes
    assert traffic.get_bytes == {f"{name}/step-2/model/w/c.0.0": len(payload)}, traffic.get_bytes
    assert traffic.requests["PUT"] == 2 and traffic.bytes_in == traffic.bytes_out == len(payload), traffic


@pytest.mark.s3
def test_a_store_reached_with_other_options_is_read_and_written_not_copied_in_place(s3):
    """Another endpoint or other credentials may not reach the source: a server-side copy is only tried within one
    file system (fsspec compares the options it was made with)."""
    base = f"s3://{s3.bucket}/links-{uuid.uuid4().hex[:8]}"
    source = open_storage(f"{base}/step-1", s3.storage_options(default_block_size=1 << 20))
    target = open_storage(f"{base}/step-2", s3.storage_options())
    source.write("model/w/c.0.0", [b"x" * 4096])
    with s3.counting() as traffic:
        target.link_from(source, "model/w/c.0.0")
    assert traffic.bytes_out >= 4096 and traffic.bytes_in >= 4096, traffic
    assert target.read("model/w/c.0.0") == b"x" * 4096


def test_a_memory_url_store_does_not_claim_to_link():
    storage = open_storage(f"memory://links-{uuid.uuid4().hex[:8]}")
    assert not storage.links_objects and storage_class("memory://x").links_objects is False


@pytest.mark.slow
@pytest.mark.s3
def test_a_shard_above_the_servers_single_put_limit_is_uploaded_in_parts_and_read_back_in_ranges(s3):
    from dcp_zarr.storage import obstore_storage

    if s3.backend != "radosgw":
        pytest.skip(f"the single-PUT limit is radosgw's ('rgw max put size'); this run's server is {s3.backend}")
    from dcp_zarr.testing import radosgw

    limit = radosgw.shared().max_put_bytes
    assert obstore_storage.MULTIPART_ABOVE < limit
    url = fresh_url(s3, "large")
    storage = open_storage(url, s3.storage_options())
    import obstore

    with pytest.raises(Exception, match="EntityTooLarge"):  # the limit is real: one PUT above it is refused
        obstore.put(storage.raw, f"probe-{uuid.uuid4().hex[:8]}", b"x" * (limit + 1), use_multipart=False)
    state = {"w": torch.arange((limit + (8 << 20)) // 4, dtype=torch.float32)}  # one shard, 8 MiB above the limit
    with s3.counting() as saved:
        dcp.save(state, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(url, storage_options=s3.storage_options()),
                 no_dist=True)
    shard = next(o for (method, o), n in saved.object_requests.items() if method == "POST" and o.endswith("/w/c.0"))
    assert saved.put_bytes[shard] > limit and saved.object_requests[("POST", shard)] >= 2, "create and complete"
    loaded = {"w": torch.zeros_like(state["w"])}
    with s3.counting() as read:
        dcp.load(loaded, storage_reader=ZarrReader(url, storage_options=s3.storage_options()), no_dist=True)
    assert torch.equal(loaded["w"], state["w"])
    assert read.object_requests[("GET", shard)] >= 2, "a large read is several ranged GETs"
    import zarr
    from zarr.storage import FsspecStore

    store = FsspecStore.from_url(url, storage_options={**s3.storage_options(), "skip_instance_cache": True},
                                 read_only=True)
    assert (zarr.open_array(store, path="w", mode="r")[:] == state["w"].numpy()).all(), "zarr-python reads it"
    assert storage.size("w/c.0") > limit
