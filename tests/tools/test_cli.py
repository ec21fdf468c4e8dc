"""The ``dcp-zarr`` command: inspect, verify, convert, diff; exit statuses; errors without tracebacks."""

from __future__ import annotations

import json
import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
import zarr
from torch.distributed.checkpoint import FileSystemWriter

from dcp_zarr import ZarrSavePlanner, ZarrWriter
from dcp_zarr.tools.cli import main
from tests.support.models import build, save_checkpoint, train_steps
from tests.support.ranks import run_ranks

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
BIN = os.path.dirname(sys.executable)
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _train_and_save_both(rank, world_size, zarr_path, dcp_path):
    model, optim = build("fsdp2", world_size)
    train_steps(model, optim, 2)
    save_checkpoint(model, optim, ZarrWriter(zarr_path))
    save_checkpoint(model, optim, FileSystemWriter(dcp_path))


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The same 2-rank FSDP2 state saved as a zarr store and as a DCP directory."""
    root = tmp_path_factory.mktemp("cli")
    run_ranks(_train_and_save_both, 2, str(root / "ckpt.zarr"), str(root / "dcp"))
    return root / "ckpt.zarr", root / "dcp"


@pytest.fixture
def copy(saved, store_copy):
    return store_copy(saved[0])


def run(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


# -- the installed entry points -------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_the_console_script_and_python_m_both_run_the_command(saved):
    # Both at once: each pays for importing torch.
    script = subprocess.Popen([os.path.join(BIN, "dcp-zarr"), "verify", str(saved[0])], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True)
    module = subprocess.Popen([sys.executable, "-m", "dcp_zarr", "inspect", str(saved[0] / "missing")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    script_out, _ = script.communicate(timeout=60)
    _, module_err = module.communicate(timeout=60)

    assert (script.returncode, script_out.split(":")[0]) == (0, "OK")
    assert module.returncode == 2 and "does not exist" in module_err and "Traceback" not in module_err


# -- without torch ----------------------------------------------------------------------------------------------------


def _save_looking_set(root):
    """Two small stores that differ in a bfloat16 tensor and an object entry, their DCP directory, a corrupt copy."""
    def state(scale, size):
        return {"model": {"w": torch.ones(3, 4, dtype=torch.bfloat16) * scale,
                          "f8": torch.ones(2, dtype=torch.float8_e4m3fn)},
                "extra": {"size": torch.Size(size), "same": torch.Size([1])}, "lr": 0.1}

    _save(root / "a.zarr", state(1.0, [2, 3]))
    _save(root / "b.zarr", state(1.5, [2, 4]))
    dcp.save(state(1.0, [2, 3]), storage_writer=FileSystemWriter(root / "a-dcp"), no_dist=True)
    shutil.copytree(root / "a.zarr", root / "bad.zarr")
    for chunk in (root / "bad.zarr" / "model" / "w" / "c.0.0", root / "bad.zarr" / "extra" / "size" / "c.0"):
        data = bytearray(chunk.read_bytes())
        data[1] ^= 0x01
        chunk.write_bytes(bytes(data))
    blocker = root / "no-torch" / "torch"  # first on sys.path: `import torch` fails as if it were not installed
    blocker.mkdir(parents=True)
    (blocker / "__init__.py").write_text("raise ImportError('torch is blocked for this test')\n")


def _without_torch(root, *argv) -> subprocess.CompletedProcess:
    path = [str(root / "no-torch"), REPO, *filter(None, [os.environ.get("PYTHONPATH")])]  # this checkout's dcp_zarr
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(path))
    return subprocess.run([sys.executable, "-m", "dcp_zarr", *map(str, argv)], cwd=root, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.slow
def test_help_inspect_verify_and_diff_of_zarr_stores_run_where_torch_cannot_be_imported(tmp_path):
    _save_looking_set(tmp_path)

    assert _without_torch(tmp_path, "--help").returncode == 0
    done = _without_torch(tmp_path, "inspect", "a.zarr")
    assert done.returncode == 0, done.stderr
    assert "bfloat16" in done.stdout and "extra.size = torch.save bytes, " in done.stdout
    done = _without_torch(tmp_path, "inspect", "a.zarr", "--tree")
    assert done.returncode == 0, done.stderr
    assert "bfloat16" in done.stdout and "object  " in done.stdout and "(torch.save bytes)" in done.stdout
    done = _without_torch(tmp_path, "inspect", "a.zarr", "--json")
    assert done.returncode == 0 and {e["fqn"] for e in json.loads(done.stdout)["entries"]} >= {"model.w", "extra.size"}

    done = _without_torch(tmp_path, "verify", "a.zarr")
    assert done.returncode == 0 and done.stdout.startswith("OK: "), done.stderr
    done = _without_torch(tmp_path, "verify", "bad.zarr")  # every crc32c is still checked, objects' too
    assert done.returncode == 1 and "Traceback" not in done.stderr
    assert "array 'model/w' chunk c.0.0" in done.stdout and "array 'extra/size' chunk c.0" in done.stdout

    done = _without_torch(tmp_path, "diff", "a.zarr", "b.zarr", "--all")
    assert done.returncode == 1, done.stderr
    assert "different  model.w  (max abs diff 0.5, 12 of 12 elements differ)" in done.stdout  # bf16, in numpy
    assert "equal      model.f8" in done.stdout and "equal      extra.same" in done.stdout  # same torch.save bytes
    assert "different  extra.size  (the stored torch.save bytes differ; not decoded" in done.stdout
    done = _without_torch(tmp_path, "diff", "a.zarr", "a.zarr")
    assert done.returncode == 0 and done.stdout.splitlines()[-1] == "5 entries: 5 equal"

    # What does need torch says so in one line.
    done = _without_torch(tmp_path, "diff", "a-dcp", "a.zarr")
    assert done.returncode == 2 and done.stderr.count("\n") == 1
    assert "a-dcp is a torch.distributed.checkpoint directory" in done.stderr and "needs torch" in done.stderr
    done = _without_torch(tmp_path, "convert", "a.zarr", "full.pt", "--to", "torch")
    assert done.returncode == 2 and done.stderr.startswith("dcp-zarr convert: error: this needs torch")
    assert done.stderr.count("\n") == 1 and not (tmp_path / "full.pt").exists()


def test_with_torch_diff_decodes_differing_torch_save_bytes(tmp_path, capsys):
    _save_looking_set(tmp_path)

    code, out, _ = run(capsys, "diff", tmp_path / "a.zarr", tmp_path / "b.zarr")

    assert code == 1 and "different  extra.size  (torch.Size([2, 3]) vs torch.Size([2, 4]))" in out


def test_the_looking_modules_do_not_import_torch():
    script = ("import sys, dcp_zarr.tools.cli, dcp_zarr.offline, dcp_zarr.tools.inspection, dcp_zarr.tools.verify, "
              "dcp_zarr.tools.diff; "
              "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60, check=True)

    assert done.stdout.strip() == "[]"


# -- inspect ----------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_inspect_tree_shows_shapes_dtypes_chunks_and_the_saving_context(saved, capsys):
    code, out, _ = run(capsys, "inspect", saved[0], "--tree")

    assert code == 0
    assert "saved world size: 2, state_dict_type: sharded, meshes: 2" in out
    assert "steps: 2 (16 entries)" in out  # every trained parameter's Adam step
    lines = out.splitlines()
    assert "model/" in lines and "optim/" in lines
    embed = next(line for line in lines if line.strip().startswith("embed.weight"))
    assert "float32" in embed and "[17, 13]" in embed
    assert "1 shard 18x13, chunks 9x13" in embed and "DTensor(S(0))" in embed


@pytest.mark.slow
@pytest.mark.distributed
def test_inspect_json_is_machine_readable(saved, capsys):
    code, out, _ = run(capsys, "inspect", saved[0], "--json")

    summary = json.loads(out)
    assert code == 0 and summary["saved_world_size"] == 2 and summary["state_dict_type"] == "sharded"
    assert summary["steps"]["optim.state.head.weight.step"] == 2.0
    embed = next(e for e in summary["entries"] if e["fqn"] == "model.embed.weight")
    assert (embed["shape"], embed["dtype"], embed["chunk_shape"], embed["chunks"]) == ([17, 13], "float32", [18, 13], 1)


@pytest.mark.slow
@pytest.mark.distributed
def test_inspect_gives_the_stored_bytes_of_a_two_rank_save_without_reading_them(saved, capsys):
    # FSDP2's shards: one file per array written by both ranks at offsets, chunks per rank, 0-d steps, objects
    code, out, _ = run(capsys, "inspect", saved[0], "--json")

    summary = json.loads(out)
    assert code == 0 and summary["tensor_stored_unknown"] == 0 and summary["compressed_tensor_count"] == 0
    for entry in summary["entries"]:
        folder = saved[0] / entry["node"]
        if entry["kind"] == "value":
            assert entry["stored_bytes"] == 0
            continue
        files = sum(f.stat().st_size for f in folder.iterdir() if f.name != "zarr.json")
        assert entry["stored_bytes"] == files, entry["fqn"]
    assert summary["tensor_stored_bytes"] > summary["tensor_bytes"]


@pytest.fixture(scope="module")
def layered(tmp_path_factory):
    """Names whose digit runs sort differently as text (layers.10 < layers.2) than as numbers; saved out of order."""
    path = tmp_path_factory.mktemp("layered") / "layers.zarr"
    model = {f"layers.{i}.{p}": torch.zeros(4 if p == "w" else 2) for i in (10, 2, 1) for p in ("w", "b")}
    optim = {f"layers.{i}.w": {"exp_avg": torch.zeros(4), "step": torch.tensor(3.0)} for i in (10, 2, 1)}
    _save(path, {"model": model, "optim": {"state": optim}, "lr": 0.5})
    return path


def _listed(out: str) -> list[str]:
    return [line.split()[0] for line in out.splitlines() if line.startswith("  layers.")]


def test_inspect_sorts_names_naturally_in_the_tree_and_the_json(layered, capsys):
    code, out, _ = run(capsys, "inspect", layered, "--tree")

    assert code == 0
    assert _listed(out)[:6] == ["layers.1.b", "layers.1.w", "layers.2.b", "layers.2.w", "layers.10.b", "layers.10.w"]
    assert out.index("  layers.2.w/") < out.index("  layers.10.w/")  # optim's groups too
    code, out, _ = run(capsys, "inspect", layered, "--json")
    summary = json.loads(out)
    model = [e["fqn"] for e in summary["entries"] if e["path"][0] == "model"]
    assert model == [f"model.layers.{i}.{p}" for i in (1, 2, 10) for p in ("b", "w")]
    assert list(summary["steps"]) == [f"optim.state.layers.{i}.w.step" for i in (1, 2, 10)]


def test_inspect_filter_lists_only_entries_matching_a_glob(layered, capsys):
    code, out, _ = run(capsys, "inspect", layered, "--filter", "*.exp_avg", "--filter", "lr")

    assert code == 0 and "  entries: 13 (" in out  # the header still describes the whole checkpoint
    assert "  matching '*.exp_avg' or 'lr': 4 entries, 48 B" in out
    assert _listed(out) == [] and "exp_avg" in out and "lr  " in out and "step" not in out.split("matching")[1]
    code, out, _ = run(capsys, "inspect", layered, "--json", "--filter", "model.layers.?.w")
    summary = json.loads(out)
    assert [e["fqn"] for e in summary["entries"]] == ["model.layers.1.w", "model.layers.2.w"]
    assert (summary["filter"], summary["matched_count"], summary["matched_bytes"]) == (["model.layers.?.w"], 2, 32)
    code, out, _ = run(capsys, "inspect", layered, "--json", "--filter", "nothing.*")
    assert code == 0 and json.loads(out)["entries"] == [] and json.loads(out)["matched_count"] == 0


def test_inspect_depth_groups_names_by_their_first_components(layered, capsys):
    code, out, _ = run(capsys, "inspect", layered, "--depth", "3")

    rows = [line.split() for line in out.split("\n\n", 1)[1].splitlines()]
    assert code == 0 and rows[0][:4] == ["first", "3", "name", "components"]
    assert [r[0] for r in rows[1:]] == ["lr", "model.layers.1", "model.layers.2", "model.layers.10",
                                        "optim.state.layers"]
    assert rows[2] == ["model.layers.1", "2", "2", "24", "B"]  # w (16 B) and b (8 B)
    code, out, _ = run(capsys, "inspect", layered, "--depth", "1", "--json", "--filter", "*.w")
    summary = json.loads(out)
    assert "entries" not in summary and summary["depth"] == 1
    assert summary["groups"] == [{"name": "model", "entries": 3, "tensors": 3, "nbytes": 48}]


@pytest.fixture(scope="module")
def large(tmp_path_factory):
    """817 entries (a 100-layer model's 200 tensors, AdamW's 600 and its param group, a trainer's values), saved with
    the optimizer's state dict nested and flattened (2,205 hyperparameter values, one per parameter)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(4, 4) for _ in range(100)])
    optim = torch.optim.AdamW(model.parameters(), lr=3e-4)
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    root = tmp_path_factory.mktemp("large")
    for form in ("nested", "flat"):
        model_sd, optim_sd = get_state_dict(model, optim,
                                            options=StateDictOptions(flatten_optimizer_state_dict=form == "flat"))
        _save(root / f"{form}.zarr", {"model": model_sd, "optim": optim_sd,
                                      "train_state": {"step": 10, "ntokens_seen": 1280},
                                      "dataloader": {"dp_rank_0": pickle.dumps({"position": 7}), "world_size": 1},
                                      "lr_scheduler": {"last_epoch": 10}})
    return root


def test_inspect_of_800_entries_fits_a_screen_with_groups_dtypes_and_values(large, capsys):
    code, out, _ = run(capsys, "inspect", large / "nested.zarr")

    lines = out.splitlines()
    assert code == 0 and len(lines) <= 60, out
    assert "  entries: 817 (800 tensors, 24.2 KiB; 17 other values)" in lines
    table = lines[lines.index("") + 1:lines.index("values:") - 1]
    assert table[0].split() == ["group", "entries", "tensors", "bytes", "dtypes"]
    assert [row.split()[:3] for row in table[1:]] == [
        ["dataloader", "2", "0"], ["lr_scheduler", "1", "0"], ["model", "200", "200"],
        ["optim.param_groups", "12", "0"], ["optim.state", "600", "600"], ["train_state", "2", "0"]]
    assert table[3].endswith("7.8 KiB  float32")
    for line in ("  train_state.step = 10", "  train_state.ntokens_seen = 1280", "  lr_scheduler.last_epoch = 10",
                 "  optim.param_groups.0.lr = 0.0003", "  optim.param_groups.0.betas = (0.9, 0.999)",
                 f"  dataloader.dp_rank_0 = {len(pickle.dumps({'position': 7}))} bytes"):
        assert line in lines, line
    assert lines[-1].startswith("every entry: --tree; ")
    code, out, _ = run(capsys, "inspect", large / "nested.zarr", "--tree")
    assert code == 0 and len(out.splitlines()) > 817


def test_inspect_merges_a_flattened_optimizers_hyperparameters_under_a_glob(large, capsys):
    code, out, _ = run(capsys, "inspect", large / "flat.zarr")

    lines = out.splitlines()
    assert code == 0 and len(lines) <= 60, out
    assert "  optim.param_groups.*.lr = 0.0003  (x200)" in lines
    assert ["optim.param_groups", "2200", "0", "0", "B", "-"] in [line.split() for line in lines]
    code, out, _ = run(capsys, "inspect", large / "flat.zarr", "--json", "--filter", "optim.param_groups.*.lr")
    assert json.loads(out)["matched_count"] == 200  # the glob shown is one --filter takes


def test_inspect_names_chunks_and_shards_as_zarr_python_does(tmp_path, capsys):
    path = tmp_path / "sharded.zarr"
    dcp.save({"w": torch.randn(64, 32), "v": torch.randn(6, 2), "s": torch.tensor(1.0)}, planner=ZarrSavePlanner(),
             storage_writer=ZarrWriter(path, inner_chunk_bytes=1024))  # w: one shard of 8-row chunks
    arrays = zarr.open_group(path, mode="r")
    w, v = arrays["w"], arrays["v"]
    assert (w.chunks, w.shards, v.chunks, v.shards) == ((8, 32), (64, 32), (6, 2), None)

    code, out, _ = run(capsys, "inspect", path, "--tree")
    rows = {line.split()[0]: line for line in out.split("\n\n", 1)[1].splitlines()}  # the tree, below the header
    assert code == 0 and rows["w"].endswith("1 shard 64x32, chunks 8x32")
    assert rows["v"].endswith("1 chunk 6x2") and rows["s"].endswith("1 chunk (a scalar)")
    code, out, _ = run(capsys, "inspect", path, "--json")
    entries = {e["fqn"]: e for e in json.loads(out)["entries"]}
    assert (entries["w"]["zarr_chunks"], entries["w"]["zarr_shards"]) == ([8, 32], [64, 32])
    assert (entries["v"]["zarr_chunks"], entries["v"]["zarr_shards"]) == ([6, 2], None)


def test_the_summary_keeps_the_largest_groups_when_the_first_names_alone_are_too_many():
    from dcp_zarr.tools.summary import summary_groups

    rows = [{"fqn": f"w{i}", "kind": "tensor", "nbytes": i, "dtype": "float32"} for i in range(30)]

    groups = summary_groups(rows, limit=5)

    assert [g["name"] for g in groups] == ["w26", "w27", "w28", "w29", "(26 others)"]
    assert (groups[-1]["entries"], groups[-1]["nbytes"], groups[-1]["dtypes"]) == (26, sum(range(26)), ["float32"])


def test_the_summary_shows_the_values_nearest_the_root_when_not_all_fit():
    from dcp_zarr.tools.summary import shown_values, summary_values

    rows = [{"fqn": f"optim.param_groups.0.k{i}", "kind": "value", "nbytes": 0, "value": i} for i in range(30)]
    rows += [{"fqn": "train_state.step", "kind": "value", "nbytes": 0, "value": 10}]

    shown, left_out = shown_values(summary_values(rows), limit=5)

    assert [v["name"] for v in shown] == [f"optim.param_groups.0.k{i}" for i in range(3)] + ["train_state.step"]
    assert left_out == 27


@pytest.mark.parametrize("argv, message", [
    (["--tree", "--depth", "2"], "argument --depth: not allowed with argument --tree"),
    (["--filter", "layers.[12"], "argument --filter: bad glob pattern: 'layers.[12' has an unclosed '['"),
    (["--filter", ""], "argument --filter: bad glob pattern: the pattern is empty"),
    (["--depth", "0"], "argument --depth: expected a positive number of name components, got '0'"),
    (["--depth", "-2"], "argument --depth: expected a positive number of name components, got '-2'"),
    (["--depth", "two"], "argument --depth: expected a positive number of name components, got 'two'"),
])
def test_bad_filter_patterns_and_depths_exit_2_naming_the_option(layered, capsys, argv, message):
    with pytest.raises(SystemExit) as exited:
        main(["inspect", str(layered), *argv])

    assert exited.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.distributed
def test_a_file_given_as_the_checkpoint_gets_one_line(saved, tmp_path, capsys):
    path = tmp_path / "model.pt"
    path.write_bytes(b"not a checkpoint")
    line = f"{path} is a file, not a checkpoint directory (a zarr store or a DCP directory)\n"

    for command, *rest in (["inspect"], ["verify"], ["diff", saved[0]],
                           ["convert", tmp_path / "o.zarr", "--to", "zarr"],
                           ["convert", tmp_path / "o.safetensors", "--to", "safetensors"]):
        code, _, err = run(capsys, command, path, *rest)
        assert (code, err) == (2, f"dcp-zarr {command}: error: {line}")
    code, _, err = run(capsys, "diff", saved[0], path)
    assert (code, err) == (2, f"dcp-zarr diff: error: {line}")


# -- verify -----------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_verify_passes_an_intact_checkpoint(saved, capsys):
    code, out, _ = run(capsys, "verify", saved[0])

    assert code == 0 and out.startswith("OK:")


@pytest.mark.slow
@pytest.mark.distributed
def test_verify_names_every_missing_or_corrupt_chunk_and_exits_1(copy, capsys):
    os.remove(copy / "model" / "head.weight" / "c.0.0")  # one shard both ranks wrote
    chunk = copy / "optim" / "state" / "norm.bias" / "exp_avg" / "c.0"
    data = bytearray(chunk.read_bytes())
    data[0] ^= 0x40
    chunk.write_bytes(bytes(data))

    code, out, _ = run(capsys, "verify", copy)

    assert code == 1 and out.startswith("CORRUPT:")
    assert "array 'model/head.weight' chunk c.0.0 (entry 'model.head.weight'): chunk is missing" in out
    assert ("array 'optim/state/norm.bias/exp_avg' chunk c.0 inner chunk 0 (entry 'optim.state.norm.bias.exp_avg'): "
            "crc32c") in out
    code, out, _ = run(capsys, "verify", copy, "--json")
    assert code == 1 and len(json.loads(out)["problems"]) == 2


def test_verify_and_diff_name_the_bad_inner_chunk_of_a_large_array(tmp_path, capsys):
    good, bad = tmp_path / "good.zarr", tmp_path / "bad.zarr"
    dcp.save({"w": torch.randn(64, 32)}, planner=ZarrSavePlanner(),
             storage_writer=ZarrWriter(good, inner_chunk_bytes=1024))  # 8 rows a chunk
    shutil.copytree(good, bad)
    shard = bad / "w" / "c.0.0"
    data = bytearray(shard.read_bytes())
    data[2 * (8 * 32 * 4 + 4) + 7] ^= 1  # inner chunks are stored in order, each followed by its crc32c
    shard.write_bytes(bytes(data))

    code, out, _ = run(capsys, "verify", bad)
    assert code == 1 and "array 'w' chunk c.0.0 inner chunk 2 (entry 'w'): crc32c mismatch" in out
    code, out, _ = run(capsys, "diff", good, bad)
    assert code == 1 and "unreadable  w" in out and "inner chunk 2" in out


@pytest.mark.slow
@pytest.mark.distributed
def test_verify_reports_an_interrupted_save_as_incomplete(copy, capsys):
    os.remove(copy / "zarr.json")

    code, out, _ = run(capsys, "verify", copy)

    assert code == 1 and out.startswith("INCOMPLETE:")


@pytest.mark.slow
@pytest.mark.distributed
def test_paths_that_are_not_checkpoints_exit_2_with_a_message(saved, tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    zarr.open_group(tmp_path / "plain.zarr", mode="w").create_array("x", shape=(2,), dtype="f4")
    for path in (tmp_path / "nowhere", tmp_path / "empty", tmp_path / "plain.zarr", saved[1]):
        for command in ("inspect", "verify"):
            code, _, err = run(capsys, command, path)
            assert code == 2 and err.startswith(f"dcp-zarr {command}: error: ")
    _, _, err = run(capsys, "inspect", saved[1])
    assert "torch.distributed.checkpoint directory" in err and "dcp-zarr convert" in err


def test_bad_arguments_exit_2(capsys):
    with pytest.raises(SystemExit) as exited:
        main(["convert", "a", "b"])  # --to is required
    assert exited.value.code == 2
    with pytest.raises(SystemExit):
        main(["inspect", "x", "-o", "no-equals-sign"])
    assert "expected KEY=VALUE" in capsys.readouterr().err


# -- convert ----------------------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.distributed
def test_convert_a_dcp_directory_then_refuse_to_overwrite_it_without_the_flag(saved, tmp_path, capsys):
    out = tmp_path / "converted.zarr"

    assert run(capsys, "convert", saved[1], out, "--to", "zarr")[0] == 0
    assert run(capsys, "diff", saved[1], out)[0] == 0
    code, _, err = run(capsys, "convert", saved[1], out, "--to", "zarr")
    assert code == 2 and "already holds a checkpoint" in err
    assert run(capsys, "convert", saved[1], out, "--to", "zarr", "--overwrite")[0] == 0


@pytest.mark.slow
@pytest.mark.distributed
def test_convert_names_the_missing_distcp_file(saved, tmp_path, capsys):
    broken = tmp_path / "broken"
    shutil.copytree(saved[1], broken)
    os.remove(broken / "__0_0.distcp")

    code, _, err = run(capsys, "convert", broken, tmp_path / "out.zarr", "--to", "zarr")

    assert code == 2 and "__0_0.distcp" in err and not (tmp_path / "out.zarr").exists()


@pytest.mark.slow
@pytest.mark.distributed
def test_convert_to_torch_and_safetensors(saved, tmp_path, capsys):
    code, out, _ = run(capsys, "convert", saved[0], tmp_path / "full.pt", "--to", "torch")
    assert code == 0 and out.strip() == str(tmp_path / "full.pt")
    assert sorted(torch.load(tmp_path / "full.pt", weights_only=True)) == ["model", "optim"]

    code, out, _ = run(capsys, "convert", saved[0], tmp_path / "hf", "--to", "safetensors", "--max-shard-size", "1KiB")
    assert code == 0 and any(line.endswith("model.safetensors.index.json") for line in out.splitlines())
    code, _, err = run(capsys, "convert", saved[0], tmp_path / "x.pt", "--to", "torch", "--max-shard-size", "1KB")
    assert code == 2 and "safetensors only" in err


# -- diff -------------------------------------------------------------------------------------------------------------


def _save(path, state):
    dcp.save(state, planner=ZarrSavePlanner(), storage_writer=ZarrWriter(path))


def test_diff_reports_each_differing_entry_with_its_max_abs_difference(tmp_path, capsys):
    w = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    _save(tmp_path / "a.zarr", {"w": w, "b": torch.zeros(2), "lr": 0.1, "gone": torch.ones(1)})
    _save(tmp_path / "b.zarr", {"w": w + torch.tensor([0.0, 0.0, 0.5, 0.0]), "b": -torch.zeros(2), "lr": 0.2,
                                "new": torch.ones(1)})

    code, out, _ = run(capsys, "diff", tmp_path / "a.zarr", tmp_path / "b.zarr")

    assert code == 1
    assert "different  w  (max abs diff 0.5, 3 of 12 elements differ)" in out
    assert "close      b" in out  # -0.0 vs 0.0: different bits, no numeric difference
    assert "different  lr  (0.1 vs 0.2)" in out
    assert "only in A  gone" in out and "only in B  new" in out
    assert out.splitlines()[-1] == "5 entries: 1 close, 2 different, 1 only in A, 1 only in B"
    code, out, _ = run(capsys, "diff", tmp_path / "a.zarr", tmp_path / "b.zarr", "--json")
    entries = {e["fqn"]: e for e in json.loads(out)["entries"]}
    assert entries["w"]["max_abs_diff"] == 0.5 and entries["w"]["differing"] == 3


@pytest.mark.filterwarnings("error::RuntimeWarning")
def test_diff_of_a_signalling_and_a_quiet_nan_says_close_without_numpy_warnings(tmp_path, capsys):
    signalling, quiet = (torch.tensor([bits, 0x3F800000], dtype=torch.int32).view(torch.float32)
                         for bits in (0x7FA00000, 0x7FC00000))
    _save(tmp_path / "a.zarr", {"w": signalling})
    _save(tmp_path / "b.zarr", {"w": quiet})

    code, out, _ = run(capsys, "diff", tmp_path / "a.zarr", tmp_path / "b.zarr")

    assert code == 0 and "close  w  (max abs diff 0, 1 of 2 elements differ)" in out, out  # NaN's bits differ only


def test_diff_within_atol_exits_0(tmp_path, capsys):
    _save(tmp_path / "a.zarr", {"w": torch.ones(4)})
    _save(tmp_path / "b.zarr", {"w": torch.ones(4) + 1e-3})

    assert run(capsys, "diff", tmp_path / "a.zarr", tmp_path / "b.zarr")[0] == 1
    assert run(capsys, "diff", tmp_path / "a.zarr", tmp_path / "b.zarr", "--atol", "1e-2")[0] == 0


@pytest.mark.slow
@pytest.mark.distributed
def test_diff_of_a_checkpoint_with_itself_lists_equal_entries_only_on_request(saved, capsys):
    code, out, _ = run(capsys, "diff", saved[0], saved[0])
    lines = out.splitlines()
    assert code == 0 and len(lines) == 3  # the two paths, then straight to the summary
    assert lines[2].endswith(" equal") and lines[2].split()[0] == lines[2].split()[2]  # "79 entries: 79 equal"
    code, out, _ = run(capsys, "diff", saved[0], saved[0], "--all")
    assert code == 0 and "  equal  model.embed.weight" in out


@pytest.mark.slow
@pytest.mark.distributed
def test_progress_bars_go_to_stderr_when_asked_for(saved, capsys):
    code, out, err = run(capsys, "verify", saved[0], "--progress")

    assert code == 0 and "verifying" in err and "verifying" not in out
