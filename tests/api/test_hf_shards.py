"""Hugging Face's shard set: export with max_shard_size, import of the folder."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid
from pathlib import Path

import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy
from click.testing import CliRunner
from safetensors import safe_open

import treestore
from tests.api.test_interop import MINILM
from tests.support.helpers import same_bytes
from treestore._api.interop import hf_shards
from treestore._api.interop.importing import read_file
from treestore_cli.main import cli

INDEX = "model.safetensors.index.json"


def memory() -> str:
    return f"memory://treestore-tests/{uuid.uuid4().hex}"


@pytest.fixture(scope="module")
def minilm(tmp_path_factory) -> str:
    """A store holding the MiniLM weights as checkpoint ``m``."""
    url = str(tmp_path_factory.mktemp("minilm") / "store")
    treestore.import_file(MINILM, f"{url}#m")
    return url


def shards_of(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name != INDEX)


def check_shard_set(folder: Path, limit: int) -> dict:
    """The index of ``folder``, after checking it against the shards: every tensor in exactly
    one shard, the one it names; total_size right; every shard within ``limit`` unless alone."""
    index = json.loads((folder / INDEX).read_text())
    weight_map = index["weight_map"]
    files = sorted(set(weight_map.values()))
    assert shards_of(folder) == files
    n = len(files)
    assert files == [f"model-{i:05d}-of-{n:05d}.safetensors" for i in range(1, n + 1)]
    held: dict[str, str] = {}
    total = 0
    for file in files:
        found, _, _ = hf_shards._formats.safetensors_header(folder / file)
        safetensors.numpy.load_file(folder / file)  # the safetensors package reads it
        for key in found:
            assert key not in held
            held[key] = file
        data = sum(t.stop - t.start for t in found.values())
        assert data <= limit or len(found) == 1, (file, data)
        total += data
    assert held == weight_map
    assert index["metadata"] == {"total_size": total}
    return index


def test_minilm_sharded_export_and_import_are_bit_exact(minilm, tmp_path):
    original = safetensors.numpy.load_file(MINILM)
    folder = tmp_path / "hf"
    seen = []
    r = treestore.export_file(
        f"{minilm}#m", f"{folder}/", max_shard_size="20MB", progress=lambda d, t: seen.append((d, t))
    )
    assert r.shards == 5 and r.tensors == 104 and r.path == str(folder / INDEX)
    assert seen[-1] == (r.nbytes, r.nbytes)
    index = check_shard_set(folder, 20_000_000)
    assert set(index["weight_map"]) == set(original)
    assert index["metadata"]["total_size"] == r.nbytes == sum(a.nbytes for a in original.values())
    ckpt = treestore.open(minilm, "m")
    for file in shards_of(folder):
        shard = safetensors.numpy.load_file(folder / file)
        assert all(same_bytes(shard[k], original[k]) for k in shard)
        assert all(same_bytes(shard[k], ckpt[k.replace(".", "/")].read()) for k in list(shard)[:3])
        with safe_open(str(folder / file), framework="np") as f:
            assert f.metadata() == {"format": "pt"}  # what the imported file carried
    back = treestore.import_file(folder, f"{minilm}#back")
    assert back.leaves == 104 and back.name == "back"
    assert treestore.open(minilm, "back").metadata["source"] == {
        "format": "safetensors",
        "file": INDEX,
        "metadata": {"format": "pt"},
        "shards": 5,
        "separator": ".",
    }
    out = tmp_path / "single.safetensors"
    treestore.export_file(f"{minilm}#back", out)
    assert out.read_bytes() == MINILM.read_bytes()  # every tensor came back bit-exact
    assert treestore.import_file(folder / INDEX, memory()).name == "model"  # the index itself


def test_fits_in_one_shard_writes_one_plain_file(minilm, tmp_path):
    r = treestore.export_file(f"{minilm}#m", tmp_path, format="safetensors")  # 5GB by default
    assert r.shards == 1 and os.listdir(tmp_path) == ["model.safetensors"]
    assert (tmp_path / "model.safetensors").read_bytes() == MINILM.read_bytes()
    out = tmp_path / "w.safetensors"  # a file path: shards go next to it, named after it
    r = treestore.export_file(f"{minilm}#m", out, max_shard_size=50_000_000)
    assert r.shards == 2 and not out.exists()
    assert sorted(os.listdir(tmp_path)) == [
        "model.safetensors",
        "w-00001-of-00002.safetensors",
        "w-00002-of-00002.safetensors",
        "w.safetensors.index.json",
    ]


def test_overwrite_replaces_every_file_of_the_earlier_export(minilm, tmp_path):
    treestore.export_file(f"{minilm}#m", f"{tmp_path}/", max_shard_size="20MB")
    with pytest.raises(treestore.InvalidInputError, match=r"model.safetensors.index.json. exists"):
        treestore.export_file(f"{minilm}#m", f"{tmp_path}/", max_shard_size="30MB")
    r = treestore.export_file(f"{minilm}#m", f"{tmp_path}/", max_shard_size="30MB", overwrite=True)
    assert r.shards == 4 and len(shards_of(tmp_path)) == 4  # the five old shards are gone
    check_shard_set(tmp_path, 30_000_000)
    treestore.export_file(f"{minilm}#m", f"{tmp_path}/", max_shard_size="1GB", overwrite=True)
    assert os.listdir(tmp_path) == ["model.safetensors"]  # index and shards gone


def test_a_leaf_read_back_in_another_shape_stops_the_export_and_leaves_nothing(minilm, tmp_path, monkeypatch):
    """The export checks each tensor it writes against the manifest's shape and size: a read that
    gave other bytes (a reader's fault, simulated here) is a DamagedError naming the address, and
    the folder holds no shard, no index and no temporary file afterwards."""
    from treestore._api.lazy_leaf import LazyLeaf

    read = LazyLeaf.__array__
    monkeypatch.setattr(LazyLeaf, "__array__", lambda self, *a, **k: read(self, *a, **k).reshape(-1)[:-1])
    with pytest.raises(treestore.DamagedError, match=r"read \(\d+,\) .* its manifest says") as caught:
        treestore.export_file(f"{minilm}#m", f"{tmp_path}/", max_shard_size="20MB")
    assert caught.value.address and os.listdir(tmp_path) == []


def test_overwrite_refuses_a_folder_under_an_old_shards_name_before_writing(minilm, tmp_path):
    """A folder under the name of an earlier export's shard: refused with a clear error before
    any file is written, and the earlier export still imports."""
    treestore.export_file(f"{minilm}#m", f"{tmp_path}/", max_shard_size="20MB")
    before = sorted(os.listdir(tmp_path))
    (tmp_path / "model-00002-of-00005.safetensors").unlink()
    (tmp_path / "model-00002-of-00005.safetensors").mkdir()
    with pytest.raises(treestore.InvalidInputError, match="is a folder"):
        treestore.export_file(f"{minilm}#m", f"{tmp_path}/", max_shard_size="30MB", overwrite=True)
    assert sorted(os.listdir(tmp_path)) == before


def test_sizes_and_shard_plan(tmp_path):
    assert hf_shards.parse_size("5GB") == 5 * 10**9
    assert hf_shards.parse_size("500MB") == 500 * 10**6
    assert hf_shards.parse_size("10kb") == 10_000
    assert hf_shards.parse_size("10KiB") == 10_240
    assert hf_shards.parse_size("1.5GB") == 1_500_000_000
    assert hf_shards.parse_size(123) == 123
    assert hf_shards.parse_size("3.000000000000000001KB") == 3000  # exact, not through a float
    huge = ("1" * 400, "1" * 5000, "9" * 20 + "TB", 10**400, "²", "١٢")  # too big; digits outside ASCII
    for bad in ("5 parsecs", "GB", "", 0, -1, True, 1.5, *huge):
        with pytest.raises(treestore.InvalidInputError, match="max_shard_size"):
            hf_shards.parse_size(bad)  # type: ignore[arg-type]
    url = memory()
    tree = {"a": np.ones(25, np.float32), "b": np.ones(25, np.float32), "big": np.ones(1000, np.uint8)}
    tree["c"] = np.ones(25, np.float32)
    tree["d"] = np.ones(10, np.float32)
    treestore.save(url, tree, "t")
    r = treestore.export_file(f"{url}#t", f"{tmp_path}/", max_shard_size=250)
    weight_map = json.loads((tmp_path / INDEX).read_text())["weight_map"]
    assert r.shards == 3
    # address order (a, b, big, c, d); "big" (1000 bytes > 250) alone in its own shard
    assert weight_map == {
        "a": "model-00001-of-00003.safetensors",
        "b": "model-00001-of-00003.safetensors",
        "big": "model-00002-of-00003.safetensors",
        "c": "model-00003-of-00003.safetensors",
        "d": "model-00003-of-00003.safetensors",
    }
    with pytest.raises(treestore.InvalidInputError, match="only, not npz"):
        treestore.export_file(f"{url}#t", tmp_path / "x.npz", max_shard_size=250)


def test_bf16_and_extended_floats_are_exact(tmp_path):
    rng = np.random.default_rng(1)
    tree = {
        "a": {"bf16": rng.standard_normal((33, 7)).astype(ml_dtypes.bfloat16)},
        "f8": rng.standard_normal(101).astype(ml_dtypes.float8_e4m3fn),
        "i8": np.arange(-50, 51, dtype=np.int8),
        "f64": rng.standard_normal(40),
        "mask": np.array([True, False, True]),
        "scalar": np.float16(3.5),
    }
    url = memory()
    treestore.save(url, tree, "t")
    r = treestore.export_file(f"{url}#t", f"{tmp_path}/", max_shard_size=300)
    assert r.shards > 1
    back = {}
    for file in shards_of(tmp_path):
        found, _, _ = hf_shards._formats.safetensors_header(tmp_path / file)
        assert all(t.start % t.dtype.itemsize == 0 for t in found.values())  # each tensor aligned
        back.update(read_file(tmp_path / file, nest_keys=False)[0])
    flat = {"a.bf16": tree["a"]["bf16"], **{k: v for k, v in tree.items() if k != "a"}}
    assert sorted(back) == sorted(flat)
    assert all(same_bytes(back[k], v) for k, v in flat.items())
    treestore.import_file(tmp_path, f"{url}#back")
    loaded = treestore.load(url, "back")
    assert same_bytes(loaded["a"]["bf16"], tree["a"]["bf16"])
    assert all(same_bytes(loaded[k], np.asarray(tree[k])) for k in flat if k != "a.bf16")


# --- hostile shard sets -------------------------------------------------------------------------------
def shard_set(folder: Path, shards: dict[str, dict[str, np.ndarray]], weight_map=None, total=None) -> Path:
    """Shards written by the safetensors package and an index (by default, the true one)."""
    folder.mkdir(exist_ok=True)
    for file, arrays in shards.items():
        safetensors.numpy.save_file(arrays, folder / file)
    if weight_map is None:
        weight_map = {k: file for file, arrays in shards.items() for k in arrays}
    if total is None:
        total = sum(a.nbytes for arrays in shards.values() for a in arrays.values())
    (folder / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))
    return folder


A, B, C = (f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))


def two(x="x", y="y") -> dict[str, dict[str, np.ndarray]]:
    return {A: {x: np.ones(4, np.float32)}, B: {y: np.zeros(3, np.float32)}}


def refused(folder: Path, error: type, match: str) -> None:
    url = memory()
    with pytest.raises(error, match=match):
        treestore.import_file(folder, f"{url}#t")
    assert treestore.Store(url).list() == []  # nothing saved


def test_hostile_shard_sets_are_refused_naming_file_and_tensor(tmp_path):
    ok = shard_set(tmp_path / "ok", two())
    treestore.import_file(ok, memory() + "#t")  # the baseline imports
    f = shard_set(tmp_path / "missing", two(), {"x": A, "y": B, "z": C})
    refused(f, treestore.DamagedError, rf"names shard {C}, which is missing")
    f = shard_set(tmp_path / "twice", {A: {"x": np.ones(2), "y": np.ones(2)}, B: {"y": np.ones(2)}})
    refused(f, treestore.DamagedError, rf"tensor 'y' is in two shards, {A} and {B}")
    f = shard_set(
        tmp_path / "moved",
        {A: {"x": np.ones(2), "z": np.ones(2)}, B: {"y": np.ones(2)}},
        {"x": B, "y": B, "z": A},
    )
    refused(f, treestore.DamagedError, rf"tensor 'x' should be in {B}, but it is in {A}")
    f = shard_set(tmp_path / "absent", two(), {"x": A, "y": B, "w": A})
    refused(f, treestore.DamagedError, rf"tensor 'w' should be in {A}, but no shard holds it")
    f = shard_set(
        tmp_path / "extra", {A: {"x": np.ones(2), "q": np.ones(2)}, B: {"y": np.ones(2)}}, {"x": A, "y": B}
    )
    refused(f, treestore.DamagedError, rf"{A}: holds tensor 'q', which {INDEX} does not name")
    f = shard_set(tmp_path / "unnamed", two(), {"x": B, "y": B})  # x is in A, not in the index
    refused(f, treestore.DamagedError, rf"{A}: a shard file .* that the index does not name")
    f = shard_set(tmp_path / "unnamed2", two())
    safetensors.numpy.save_file({"z": np.ones(2)}, f / C)
    refused(f, treestore.DamagedError, rf"{C}: a shard file .* that the index does not name")
    f = shard_set(tmp_path / "total", two(), total=29)
    refused(f, treestore.DamagedError, r"total_size is 29 bytes, but its tensors hold 28")
    for bad in ("28", -1, 28.0, True):  # not a number of bytes: refused before any shard is read
        f = shard_set(tmp_path / f"total-{bad}", two(), total=bad)
        refused(f, treestore.UnsupportedFormatError, rf"total_size is {bad!r}, not a number of bytes")
    f = shard_set(tmp_path / "escape", two(), {"x": "../ok/" + A, "y": B})
    refused(f, treestore.UnsupportedFormatError, r"tensor 'x' is in '../ok/.*not a file name")
    f = shard_set(tmp_path / "offsets", two())
    data = (f / B).read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + n].replace(b"[0,12]", b"[0,9999]")
    (f / B).write_bytes(len(header).to_bytes(8, "little") + header + data[8 + n :])
    refused(f, treestore.UnsupportedFormatError, rf"{B}: tensor 'y' declares 12 bytes at offsets \[0, 9999\)")
    f = shard_set(tmp_path / "device", two())
    (f / B).unlink()
    (f / B).symlink_to("/dev/zero")
    refused(f, treestore.UnsupportedFormatError, rf"{B}: expected a regular file, found a character device")
    f = shard_set(tmp_path / "junk", two())
    (f / INDEX).write_text("{not json")
    refused(f, treestore.UnsupportedFormatError, rf"{INDEX} is not JSON")
    (f / INDEX).write_text('{"weight_map": {"x": 1}}')
    refused(f, treestore.UnsupportedFormatError, rf"{INDEX}: expected a safetensors index")


def test_deeply_nested_json_is_refused_with_a_clear_error(tmp_path):
    """An index or a safetensors header nested 100,000 deep: the format error, not RecursionError."""
    deep = "[" * 100_000 + "]" * 100_000
    folder = tmp_path / "index"
    folder.mkdir()
    (folder / INDEX).write_text(deep)
    refused(folder, treestore.UnsupportedFormatError, "nested too deep")
    text = deep.encode()
    path = tmp_path / "deep.safetensors"
    path.write_bytes(len(text).to_bytes(8, "little") + text)
    with pytest.raises(treestore.UnsupportedFormatError, match="nested too deep"):
        read_file(path)


def test_index_over_its_cap(tmp_path, monkeypatch):
    f = shard_set(tmp_path / "big", two())
    monkeypatch.setattr(hf_shards, "INDEX_BYTES", 50)
    refused(f, treestore.UnsupportedFormatError, r"more than the 50 bytes treestore reads")


def test_two_indexes_in_a_folder(tmp_path):
    f = shard_set(tmp_path / "two", two())
    (f / "other.safetensors.index.json").write_text((f / INDEX).read_text())
    refused(f, treestore.InvalidInputError, r"holds 2 safetensors indexes .*import one of them")


# --- a failed or killed export ---------------------------------------------------------------------
def test_failed_export_leaves_no_index_and_no_shard(minilm, tmp_path, monkeypatch):
    real = hf_shards._write_shard
    calls = []

    def failing(ckpt, fd, shard, metadata, advance):
        calls.append(fd)
        if len(calls) == 3:
            os.write(fd, b"partial")
            os.close(fd)
            raise OSError("disk full")
        real(ckpt, fd, shard, metadata, advance)

    monkeypatch.setattr(hf_shards, "_write_shard", failing)
    with pytest.raises(OSError, match="disk full"):
        treestore.export_file(f"{minilm}#m", f"{tmp_path}/", max_shard_size="20MB")
    assert len(calls) == 3 and os.listdir(tmp_path) == []  # the two shards written are gone too


KILLED = """
import os, sys, time, treestore
from treestore._api.interop import hf_shards
real, calls = hf_shards._write_shard, []
def slow(ckpt, fd, shard, metadata, advance):
    calls.append(fd)
    if len(calls) == 3:
        os.write(fd, b"partial")
        print("ready", flush=True)
        time.sleep(600)
    real(ckpt, fd, shard, metadata, advance)
hf_shards._write_shard = slow
treestore.export_file(sys.argv[1], sys.argv[2], max_shard_size=sys.argv[3], overwrite=True)
"""


def test_killed_export_leaves_no_index(minilm, tmp_path):
    """An export killed with SIGKILL in its third shard, over an earlier complete export: no
    index is left (the old one went first), and every shard visible is complete."""
    treestore.export_file(f"{minilm}#m", f"{tmp_path}/", max_shard_size="30MB")
    env = dict(os.environ)
    here = str(Path(treestore.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    child = subprocess.Popen(
        [sys.executable, "-c", KILLED, f"{minilm}#m", f"{tmp_path}/", "20MB"],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "ready"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(60)
        if child.stdout is not None:
            child.stdout.close()
    assert not (tmp_path / INDEX).exists()
    visible = [p for p in tmp_path.iterdir() if not p.name.startswith(".")]
    assert any("-of-00005" in p.name for p in visible)  # the new export had put shards in place
    for p in visible:
        safetensors.numpy.load_file(p)  # complete, as the safetensors package checks it
    with pytest.raises(treestore.TreestoreError):
        treestore.import_file(tmp_path, memory() + "#t")
    left = [p.name for p in tmp_path.iterdir() if p.name.startswith(".")]
    assert len(left) == 1 and left[0].startswith(".model.tmp-")  # the killed export's partial shard
    treestore.export_file(f"{minilm}#m", f"{tmp_path}/", max_shard_size="30MB", overwrite=True)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []  # a later export removed it
    assert treestore.import_file(tmp_path, memory() + "#t")


def test_export_does_not_follow_links_planted_at_temporary_names(minilm, tmp_path, monkeypatch):
    """Another user who can write into the output folder plants links where an export writes its
    temporaries, at the name this process would have used before and at the exact random names it
    will try (forced here): the files the links point to are untouched, and the export is whole."""
    from treestore._api.interop import temporary

    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    out = tmp_path / "out"
    out.mkdir()
    tokens = iter(["a" * 12, "b" * 12] * 3 + [f"{i:012x}" for i in range(100)])
    monkeypatch.setattr(temporary.secrets, "token_hex", lambda n: next(tokens))
    for stem in ("model", "model.safetensors", "w.npz"):
        os.symlink(victim, out / f".{stem}.tmp-{os.getpid()}")
        for token in ("a" * 12, "b" * 12):
            os.symlink(victim, out / f".{stem}.tmp-{os.getpid()}-{token}")
    treestore.export_file(f"{minilm}#m", f"{out}/", max_shard_size="20MB")
    tokens = iter(["a" * 12, "b" * 12] + [f"{i:012x}" for i in range(100, 200)])
    treestore.export_file(f"{minilm}#m", out / "w.npz")
    assert victim.read_text() == "precious"
    assert treestore.import_file(out, memory() + "#t")
    assert treestore.import_file(out / "w.npz", memory() + "#t")


def test_abandoned_temporaries_of_running_processes_are_kept(tmp_path):
    """Only a temporary whose process has ended is removed: another export may still be writing."""
    from treestore._api.interop import temporary

    done = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    dead = int(done.stdout)
    (tmp_path / f".model.tmp-{dead}-{'c' * 12}").write_bytes(b"partial")
    (tmp_path / f".model.tmp-{os.getppid()}-{'d' * 12}").write_bytes(b"in progress")
    (tmp_path / f".other.tmp-{dead}-{'e' * 12}").write_bytes(b"not this stem")
    temporary.remove_abandoned(tmp_path, "model")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [f".model.tmp-{os.getppid()}-{'d' * 12}", f".other.tmp-{dead}-{'e' * 12}"]
    )


# --- command line ----------------------------------------------------------------------------------
def test_cli_export_max_shard_size_and_import_folder(minilm, tmp_path):
    folder = tmp_path / "hf"
    r = CliRunner().invoke(cli, ["export", f"{minilm}#m", f"{folder}/", "--max-shard-size", "20MB", "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["shards"] == 5
    check_shard_set(folder, 20_000_000)
    r = CliRunner().invoke(cli, ["export", f"{minilm}#m", f"{folder}/", "--max-shard-size", "30000000"])
    assert r.exit_code == 2 and "exists" in r.stderr
    r = CliRunner().invoke(cli, ["import", str(folder), f"{minilm}#cli"])
    assert r.exit_code == 0 and "104 leaves" in r.stdout, r.output
    original = safetensors.numpy.load_file(MINILM)
    loaded = treestore.load(minilm, "cli")
    weight = loaded["encoder"]["layer"]["0"]["attention"]["self"]["query"]["weight"]
    assert same_bytes(weight, original["encoder.layer.0.attention.self.query.weight"])
    r = CliRunner().invoke(
        cli, ["export", f"{minilm}#m", str(tmp_path / "x"), "--max-shard-size", "5 parsecs"]
    )
    assert r.exit_code == 2 and "not a size" in r.stderr
    for bad in ("²", "1" * 5000, "1" * 400):  # a usage error, not a crash that asks for --debug
        r = CliRunner().invoke(cli, ["export", f"{minilm}#m", str(tmp_path / "x"), "--max-shard-size", bad])
        assert r.exit_code == 2 and "not a size" in r.stderr and "--debug" not in r.stderr, r.output


def test_shard_set_to_and_from_a_store_on_s3(s3_backend, tmp_path):
    """The store may be on any backend: export from a store on S3 (moto) to a local folder of
    shards, import the folder into another S3 store, and the tensors come back exactly."""
    opts = s3_backend.storage_options
    rng = np.random.default_rng(3)
    tree = {"emb": rng.standard_normal((300, 64)).astype(np.float32), "bias": np.arange(7.0)}
    src = s3_backend.url("hf-src")
    treestore.Store(src, storage_options=opts).save(tree, "m")
    folder = tmp_path / "hf"
    result = treestore.export_file(f"{src}#m", f"{folder}/", max_shard_size="40KB", storage_options=opts)
    assert result.shards == 2
    dst = s3_backend.url("hf-dst")
    treestore.import_file(folder, f"{dst}#back", storage_options=opts)
    back = treestore.load(f"{dst}#back", storage_options=opts)
    assert same_bytes(back["emb"], tree["emb"]) and same_bytes(back["bias"], tree["bias"])


def test_import_from_an_fsspec_url(minilm, tmp_path, s3_backend):
    """A shard set (its folder or its index) or a single file at an fsspec URL is copied
    to a temporary folder, streamed, and imported as a local one: from memory:// and from S3."""
    import fsspec

    folder = tmp_path / "hf"
    treestore.export_file(f"{minilm}#m", f"{folder}/", max_shard_size="20MB")
    original = treestore.load(f"{minilm}#m")
    mem = fsspec.filesystem("memory")
    hub = f"/hub-{uuid.uuid4().hex}/model"
    for p in folder.iterdir():
        mem.pipe_file(f"{hub}/{p.name}", p.read_bytes())
    dst = memory()
    assert treestore.import_file(f"memory://{hub}", dst).name == "model"
    assert treestore.import_file(f"memory://{hub}/{INDEX}", f"{dst}#by-index").leaves == 104
    for name in ("model", "by-index"):
        back = treestore.load(f"{dst}#{name}")
        assert all(same_bytes(a, b) for a, b in zip(jax_leaves(back), jax_leaves(original), strict=True))
    opts = s3_backend.storage_options
    s3 = fsspec.filesystem("s3", **opts)
    bucket = s3_backend.url("hub").split("://", 1)[1]
    single = tmp_path / "w.safetensors"
    treestore.export_file(f"{minilm}#m", single)
    s3.put_file(str(single), f"{bucket}/w.safetensors")
    r = treestore.import_file(f"s3://{bucket}/w.safetensors", dst, source_storage_options=opts)
    assert r.name == "w" and r.leaves == 104
    via_cli = CliRunner().invoke(cli, ["import", f"memory://{hub}", f"{dst}#cli"])
    assert via_cli.exit_code == 0 and "104 leaves" in via_cli.output, via_cli.output
    mem.rm(hub, recursive=True)
    with pytest.raises(treestore.NotFoundError):
        treestore.import_file(f"memory://{hub}", memory())


def jax_leaves(tree):
    import jax

    return jax.tree_util.tree_leaves(tree)


def test_cli_export_with_a_shard_size_to_a_bare_name_writes_a_folder(minilm, tmp_path):
    """``export STORE hf2 --max-shard-size 20MB``: a destination without a file suffix is the
    folder of the shard set, as ``hf2/`` is (it failed: "cannot tell the format of 'hf2'")."""
    r = CliRunner().invoke(cli, ["export", f"{minilm}#m", str(tmp_path / "hf2"), "--max-shard-size", "20MB"])
    assert r.exit_code == 0, r.output
    check_shard_set(tmp_path / "hf2", 20_000_000)
    r = CliRunner().invoke(
        cli, ["export", f"{minilm}#m", str(tmp_path / "one.safetensors"), "--max-shard-size", "20MB"]
    )
    assert r.exit_code == 0, r.output  # a .safetensors path stays a file name: its shards beside it
    assert (tmp_path / "one.safetensors.index.json").is_file()
    assert len(list(tmp_path.glob("one-0000?-of-00005.safetensors"))) == 5


def test_abandoned_temporaries_of_unknowable_processes_are_kept(tmp_path):
    """A temporary whose process id cannot be asked about (beyond the system's pid range) is
    kept, as one of a running process is; a folder that cannot be listed removes nothing."""
    from treestore._api.interop import temporary

    huge = f".model.tmp-{2**70}-{'f' * 12}"
    (tmp_path / huge).write_bytes(b"whose?")
    temporary.remove_abandoned(tmp_path, "model")
    assert [p.name for p in tmp_path.iterdir()] == [huge]
    temporary.remove_abandoned(tmp_path / "no-such-folder", "model")  # nothing to list: no error
