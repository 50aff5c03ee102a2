"""Nothing in a store names code that a reader runs: type names of custom nodes are informational,
dtypes and kinds are looked up in fixed tables, and bytes that look like pickles stay bytes.

The guards of _harness.py fail a case on any new import, exec, compile or unpickling during a read;
on top, modules with side effects on import must still be absent afterwards.
"""

from __future__ import annotations

import pickle
import sys

import msgpack
import pytest

import treestore

EVIL_MODULES = ["antigravity", "this", "turtle", "webbrowser"]


@pytest.fixture(autouse=True)
def _unimported():
    """Each test starts with none of EVIL_MODULES imported (a client library run by an earlier
    test may have imported webbrowser), so that finding one afterwards means this test did."""
    for m in EVIL_MODULES:
        sys.modules.pop(m, None)


class Boom:
    def __reduce__(self):
        return (exec, ("import antigravity",))


PICKLE = pickle.dumps(Boom())


@pytest.mark.timeout(30)
@pytest.mark.parametrize("node_type", ["custom", "namedtuple"])
@pytest.mark.parametrize(
    "type_name", ["antigravity.geohash", "this", "os.system", "builtins.eval", "pickle.loads", "__import__"]
)
def test_node_type_names_are_never_imported(store, node_type, type_name):
    def change(m):
        node = m["tree"]["children"][[k[1] for k in m["tree"]["keys"]].index("small")]
        node["type"] = node_type
        node["name"] = type_name

    store.mutate_manifest(change)
    out = store.check(ops=["load", "open", "verify", "diff"])
    assert isinstance(out["load"].value["small"], dict)  # without a template: a dict of the keys
    assert not any(m in sys.modules for m in EVIL_MODULES)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where", ["metadata", "value", "codec"])
def test_pickles_and_ext_types_stay_data(store, where):
    payload = {"p": PICKLE, "e": msgpack.ExtType(1, PICKLE), "s": PICKLE.decode("latin-1")}

    def change(m):
        m["metadata"] = payload  # the commit record below carries it too: they must agree
        if where == "codec":
            m["codec"] = {"name": PICKLE, "level": payload}
        else:
            next(x for x in m["leaves"] if x["address"] == "py/b")["value"] = PICKLE

    store.mutate_manifest(change)
    store.write_ref({**store.ref_record(), "metadata": payload})
    out = store.check(ops=["list", "manifest", "load", "open", "verify"])
    if where == "value":
        assert out["load"].value["py"]["b"] == PICKLE
    assert not any(m in sys.modules for m in EVIL_MODULES)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("dtype", ["O", "object", "|O", "V", "pickle"])
def test_object_dtypes_are_refused_not_unpickled(store, dtype):
    """A chunk of pickled objects declared as an object array."""
    store.chunk_file("w").write_bytes(PICKLE)
    store.mutate_manifest(lambda m: next(x for x in m["leaves"] if x["address"] == "w").update(dtype=dtype))
    out = store.check(ops=["load", "open", "verify"])
    assert isinstance(out["load"].error, treestore.UnsupportedFormatError)
    assert not any(m in sys.modules for m in EVIL_MODULES)


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("breach", "reported"),
    [
        ("import", "import tabnanny"),
        ("unpickle", "pickle"),
        ("read outside", "outside/secret.txt"),
        ("write inside", "a reader opened"),
        ("exec", "compile"),
        ("escape", "ValueError escaped"),
    ],
)
def test_the_guards_catch_what_they_guard(store, monkeypatch, breach, reported):
    """The harness itself: a reader that misbehaves in each guarded way is reported."""
    from treestore._engine.reading import load as _load

    real = _load.restore_array

    def misbehave(*args, **kwargs):
        if breach == "import":
            import tabnanny  # noqa: F401
        elif breach == "unpickle":
            pickle.loads(PICKLE)
        elif breach == "read outside":
            (store.outside / "secret.txt").read_bytes()
        elif breach == "write inside":
            (store.root / "x").write_bytes(b"x")
        elif breach == "exec":
            exec("1")
        else:
            raise ValueError("not a TreestoreError")
        return real(*args, **kwargs)

    monkeypatch.setattr(_load, "restore_array", misbehave)
    sys.modules.pop("tabnanny", None)
    with pytest.raises(AssertionError, match=reported):
        store.check(ops=["load"])
