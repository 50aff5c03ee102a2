"""Addresses and names with ``..``, ``/``, NUL and other surprising characters.

Addresses never name objects in the store (chunks are named by digest) and checkpoint names are
checked before any path is formed: neither can reach outside the store, and a manifest whose
addresses are not the canonical form of its tree's keys is refused.
"""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

import treestore
from treestore._format import paths as _paths

from ..support import hostile
from ._harness import check_readers, guarded

SURPRISING = [
    "..",
    ".",
    "../../outside/secret.txt",
    "/etc/passwd",
    "a/../../b",
    "a\x00b",
    "\x00",
    "%2e%2e%2f",
    "%",
    '"',
    '""',
    "\\..\\..\\x",
    "C:\\Windows",
    " ",
    "",
    "\n",
    "\u202e\u0000",
    "😀",
    "~",
    "$HOME",
    "{0}",
    "#1",
    ".attr",
    "*",
    "[a-z]",
    "x" * 5000,
]


@pytest.mark.timeout(60)
def test_tree_keys_with_surprising_characters_round_trip(tmp_path):
    """A legitimate checkpoint whose dict keys look like paths: saved, listed, loaded (also by
    select), diffed and verified without touching anything but the store."""
    url = str(tmp_path / "store")
    tree = {k: {k: np.full(3, i, np.int32)} for i, k in enumerate(SURPRISING)}
    tree["big"] = np.arange(100_000, dtype=np.float32)
    treestore.save(url, tree, "good")
    treestore.save(url, {**tree, "big": np.zeros(3)}, "bad")
    out = check_readers(url)
    got = out["load"].value
    assert sorted(got) == sorted(tree)
    for k in SURPRISING:
        assert list(got[k]) == [k]
    addresses = list(treestore.open(url, "bad").leaves)
    with guarded([url]) as g:
        for a in addresses[:10]:
            treestore.load(url, "bad", select=a.replace("[", "[[]").replace("*", "[*]").replace("?", "[?]"))
    assert not g.violations


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "address", [a for a in SURPRISING if a] + ["py//n", "/py/n", "py/n/", "py\\n", "py/./n"]
)
def test_leaf_address_that_is_not_its_tree_position(store, address):
    store.mutate_manifest(
        lambda m: next(x for x in m["leaves"] if x["address"] == "py/n").update(address=address)
    )
    out = store.check(ops=["manifest", "load", "verify"])
    assert isinstance(out["load"].error, treestore.errors.ManifestDamagedError)


@pytest.mark.timeout(60)
@pytest.mark.parametrize(("a", "b"), [("small/a", "small/s"), ("w", "ids"), ("py/n", "py/t")])
def test_two_leaves_with_swapped_addresses(store, a, b):
    """Each of two leaf entries takes the other's (canonical, existing) address: every address
    is valid and distinct, but neither leaf sits at its tree position; refused, since by address
    (open, select, diff) each would read as the other."""

    def change(m):
        x, y = (next(e for e in m["leaves"] if e["address"] == k) for k in (a, b))
        x["address"], y["address"] = b, a

    store.mutate_manifest(change)
    out = store.check(ops=["manifest", "load", "open", "verify"])
    assert isinstance(out["load"].error, treestore.errors.ManifestDamagedError), out["load"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("key", ["../../outside", "a/b", "\x00", "x" * 5000, "😀"])
def test_consistently_renamed_key(store, key):
    """A hostile store may rename a key everywhere (tree and address): that is just another tree,
    loaded with the new key and nothing else."""
    from jax.tree_util import DictKey

    from treestore import format_address

    def change(m):
        i = [k[1] for k in m["tree"]["keys"]].index("py")
        m["tree"]["keys"][i] = ["dict", key]
        for leaf in m["leaves"]:
            if leaf["address"].startswith("py/"):
                leaf["address"] = format_address((DictKey(key),)) + leaf["address"][2:]

    store.mutate_manifest(change)
    out = store.check(ops=["load", "open", "verify", "diff"])
    assert key in out["load"].value and "py" not in out["load"].value


NAMES = ["...", "-x", "_x", ".x", " x", "x y", "ü", "x" * 201, ".tmp-abc", "x\n", "x\\y", "x%2Fy"]


@pytest.mark.timeout(60)
def test_objects_in_checkpoints_that_are_not_checkpoint_names(store):
    """Files under checkpoints/ whose names are not valid checkpoint names are not checkpoints:
    readers ignore them, even when they hold a valid commit record."""
    for name in NAMES:
        rec = {**store.ref_record(), "name": name}
        (store.root / "checkpoints" / name).write_bytes(msgpack.packb(rec, use_bin_type=True))
    out = store.check(ops=["list", "latest", "load", "verify all"])
    assert [c.name for c in out["list"].value] == ["good", "bad"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize(
    "name", ["../outside/secret.txt", "../../x", "x/../bad", "/etc/passwd", "", "a\x00", "x" * 201]
)
def test_hostile_checkpoint_names_from_the_caller(store, name):
    calls = [
        lambda: treestore.load(store.url, name),
        lambda: treestore.open(store.url, name),
        lambda: treestore.Store(store.url).delete(name),
        lambda: treestore.Store(store.url).exists(name),
        lambda: treestore.save(store.url, {"a": 1}, name),
    ]
    if name:  # "URL#" means the newest checkpoint
        calls.append(lambda: treestore.verify(f"{store.url}#{name}"))
        calls.append(lambda: treestore.diff(f"{store.url}#{name}", f"{store.url}#bad"))
    with guarded([store.root]) as g:
        for fn in calls:
            with pytest.raises(treestore.InvalidInputError):
                fn()
    assert not g.violations
    assert store.untouched()


@pytest.mark.timeout(60)
def test_manifest_that_names_another_checkpoint(store):
    """The commit record of "bad" points at the manifest of "good": refused (a hostile store
    cannot make one checkpoint read as another)."""
    good = store.ref_record("good")
    store.write_ref(
        {**store.ref_record(), "manifest": good["manifest"], "manifest_size": good["manifest_size"]}
    )
    out = store.check(ops=["load", "verify"])
    assert isinstance(out["load"].error, treestore.errors.ManifestDamagedError)
    assert "good" in str(out["load"].error)


@pytest.mark.timeout(60)
def test_commit_record_under_another_name(store):
    """checkpoints/bad holds the record of "good": refused."""
    (store.root / _paths.record_path("bad")).write_bytes(store.ref_bytes("good"))
    out = store.check(ops=["list", "load", "verify all"])
    assert isinstance(out["load"].error, treestore.errors.ManifestDamagedError)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("index", [2**31, 2**32, 2**63, 2**64 - 1])
@pytest.mark.parametrize("kind", ["seq", "flat"])
def test_key_records_with_indices_beyond_32_bits(store, index, kind):
    """A custom node keyed by ["seq", i] or ["flat", i] with a huge i. The child under that key
    is None, so no leaf address holds the index and address checks cannot catch it first: the
    key record's own range check must (jax's key classes take 32-bit ints and raise TypeError)."""

    def change(m):
        node = m["tree"]["children"][[k[1] for k in m["tree"]["keys"]].index("list")]
        assert node["type"] == "list" and node["children"][1] == {"type": "none"}, node
        node.update(type="custom", name="x.Y", keys=[["seq", 0], [kind, index], ["seq", 2]])

    store.mutate_manifest(change)
    out = store.check(ops=["manifest", "load", "verify"])
    assert isinstance(out["load"].error, treestore.errors.ManifestDamagedError), out["load"]
    assert "key" in str(out["load"].error)


@pytest.mark.timeout(30)
def test_key_records_in_range_load(store):
    """The control of the test above: the same custom node with an index in range loads, with
    the node as a dict keyed by its keys' values (so the test above fails only at the index)."""

    def change(m):
        node = m["tree"]["children"][[k[1] for k in m["tree"]["keys"]].index("list")]
        node.update(type="custom", name="x.Y", keys=[["seq", 0], ["flat", 2**31 - 1], ["seq", 2]])

    store.mutate_manifest(change)
    out = store.check(ops=["manifest", "load", "verify"])
    assert out["load"].error is None, out["load"].error
    assert list(out["load"].value["list"]) == [0, 2**31 - 1, 2]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "address",
    [
        '"py"/n',  # quoted where the bare form is canonical
        'py/"n"',
        '"p%79"/n',  # an escape of a printable character
        "py/.n",  # another key type
    ],
)
def test_leaf_address_of_the_right_path_in_another_form(store, address):
    """An address that parses to the leaf's key path, or one like it, but is not the canonical
    text of its tree position: refused (a manifest must use canonical addresses, SPEC.md §7)."""
    store.mutate_manifest(
        lambda m: next(x for x in m["leaves"] if x["address"] == "py/n").update(address=address)
    )
    out = store.check(ops=["manifest", "load", "verify"])
    assert isinstance(out["load"].error, treestore.errors.ManifestDamagedError), out["load"]


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "address", ["2147483648", "py/9223372036854775808", "#2147483648", "py/#99999999999"]
)
def test_address_segments_with_indices_beyond_32_bits(store, address):
    store.mutate_manifest(
        lambda m: next(x for x in m["leaves"] if x["address"] == "py/n").update(address=address)
    )
    out = store.check(ops=["manifest", "load", "verify"])
    assert isinstance(out["load"].error, treestore.errors.ManifestDamagedError)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("text", ["2147483648", "a/4294967296", "#2147483648", "{18446744073709551615}"])
def test_parse_address_of_big_indices(text):
    """parse_address is public: a big index is a valid address or an InvalidInputError."""
    try:
        path = treestore.parse_address(text)
    except treestore.InvalidInputError:
        return
    assert treestore.format_address(path) == text


@pytest.mark.timeout(120)
def test_a_deep_chain_of_long_keys_is_refused_before_its_addresses_are_built(store):
    """A 480-deep chain of dicts keyed by one 8 KiB segment, with 300 leaves at the bottom: a
    manifest of a few KiB whose addresses would take 1.2 GB (every node's, each leaf's 4 MB).
    Every reader refuses it (its addresses are over the bound) within a small memory bound."""
    tree: object = {"k": list(range(300))}
    for _ in range(480):
        tree = {"k": tree}
    treestore.Store(store.url).save(tree, "deep")

    def longer(rec, arrays):
        assert "k" in rec["segments"]
        rec["segments"] = ["k" * 8192 if s == "k" else s for s in rec["segments"]]

    hostile.mutate_v2_manifest(store.url, "deep", longer)
    out = store.check(name="deep", ops=["manifest", "load", "open", "verify"], memory=64 * 2**20)
    for op in ("manifest", "load", "open"):
        assert isinstance(out[op].error, treestore.errors.ManifestDamagedError), (op, out[op])
        assert "address" in str(out[op].error) and "'deep'" in str(out[op].error)
    assert not out["verify"].value.ok


def test_a_save_refuses_an_address_over_the_bound(store_url):
    """What save commits every reader accepts: an address over MAX_ADDRESS_CHARS is refused
    at save, naming where it starts; one just under it round-trips."""
    from treestore._format.limits import MAX_ADDRESS_CHARS

    ok = {"a" * (MAX_ADDRESS_CHARS // 2 - 1): {"b" * (MAX_ADDRESS_CHARS // 2 - 1): 1}}
    treestore.save(store_url, ok, "ok")
    assert treestore.load(store_url + "#ok") == ok
    with pytest.raises(treestore.InvalidInputError, match="address") as info:
        treestore.save(store_url, {"a" * MAX_ADDRESS_CHARS: {"b": 1}}, "long")
    assert str(MAX_ADDRESS_CHARS) in str(info.value) and info.value.address.startswith("aaaa")
    assert not treestore.Store(store_url).exists("long")


@pytest.mark.timeout(120)
def test_many_leaves_under_one_long_key_are_refused_by_their_addresses_together(store):
    """20,000 leaves under one key of 16,000 characters: each address is within the bound of one,
    but together they are 320 million characters, from a manifest of a few hundred KiB. Every
    reader refuses it by the bound on all addresses together, within a small memory bound."""
    from treestore._format.limits import MAX_ADDRESS_CHARS, MAX_ADDRESSES_CHARS

    treestore.Store(store.url).save({"k": list(range(20_000))}, "wide")
    long_key = "k" * (MAX_ADDRESS_CHARS - 400)
    assert 20_000 * len(long_key) > MAX_ADDRESSES_CHARS

    def longer(rec, arrays):
        rec["segments"] = [long_key if s == "k" else s for s in rec["segments"]]

    hostile.mutate_v2_manifest(store.url, "wide", longer)
    assert (
        len(store.storage.read(_paths.manifest_path(hostile.commit_record(store.url, "wide")["manifest"])))
        < 2**20
    )
    out = store.check(name="wide", ops=["manifest", "load", "open", "verify"], memory=128 * 2**20)
    for op in ("manifest", "load", "open"):
        assert isinstance(out[op].error, treestore.errors.ManifestDamagedError), (op, out[op])
        assert "addresses add up to" in str(out[op].error) and "'wide'" in str(out[op].error)
    assert not out["verify"].value.ok
