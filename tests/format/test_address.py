"""Addresses: unambiguous, reversible, stable, and safe."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from jax.tree_util import DictKey, FlattenedIndexKey, GetAttrKey, SequenceKey

import treestore
from treestore import format_address, parse_address
from treestore._format.address import canonical_segment, format_key

keys = st.one_of(
    st.integers(0, 10**6).map(SequenceKey),
    st.text(max_size=12).map(DictKey),
    st.integers(-(10**12), 10**12).map(DictKey),
    st.booleans().map(DictKey),
    st.from_regex(r"[A-Za-z_][A-Za-z0-9_]{0,8}", fullmatch=True).map(GetAttrKey),
    st.integers(0, 10**6).map(FlattenedIndexKey),
)
paths = st.lists(keys, max_size=6).map(tuple)


def typed(path):
    """Keys with the type of their value, since DictKey(True) == DictKey(1) in Python."""
    return [(type(k).__name__, type(getattr(k, "key", None)).__name__, k) for k in path]


@given(paths)
def test_parse_inverts_format(path):
    assert typed(parse_address(format_address(path))) == typed(path)


@given(paths, paths)
def test_different_paths_have_different_addresses(a, b):
    if typed(a) != typed(b):
        assert format_address(a) != format_address(b)


@given(paths)
def test_addresses_never_contain_raw_control_characters(path):
    address = format_address(path)
    assert all(ch.isprintable() for ch in address)
    assert len(address.split("/")) == max(len(path), 1) or path == ()


def test_list_index_int_key_and_str_key_differ():
    found = {format_address((k,)) for k in (SequenceKey(0), DictKey(0), DictKey("0"), DictKey(False))}
    assert found == {"0", "{0}", '"0"', "{false}"}


@pytest.mark.parametrize(
    ("path", "address"),
    [
        ((), ""),
        (
            (DictKey("params"), DictKey("layers"), SequenceKey(0), DictKey("weights")),
            "params/layers/0/weights",
        ),
        ((GetAttrKey("layers"), SequenceKey(2), GetAttrKey("weight")), ".layers/2/.weight"),
        ((DictKey("a/b"),), '"a%2Fb"'),
        ((DictKey(".."),), '".."'),
        ((DictKey("x\x00y"),), '"x%00y"'),
        ((DictKey('q"uote'),), '"q%22uote"'),
        ((DictKey(-3),), "{-3}"),
        ((FlattenedIndexKey(1),), "#1"),
        ((DictKey("encoder.layer.0"),), "encoder.layer.0"),
    ],
)
def test_golden_addresses(path, address):
    # Addresses are part of the on-disk format: these must never change.
    assert format_address(path) == address
    assert parse_address(address) == path


@pytest.mark.parametrize(
    "bad",
    [
        *["a//b", "[0]", "{x}", '"unterminated', '"%zz"', ".1x", "#-1", "a/", "-1", "01"],
        # forms that would parse to a key whose canonical text differs: parsing stays injective
        *["{-0}", "{+1}", "{01}", "{ 1}", "{True}", "#01", "#+1", "+1", "1_0"],
        *['"a%2fb"', '"%u00e9"', '"%U01f600"', '"%2F"x', '"%"', '"%4"', '"%u12"', '"%U110000"'],
    ],
)
def test_malformed_addresses_are_rejected(bad):
    with pytest.raises(treestore.InvalidInputError):
        parse_address(bad)


@pytest.mark.parametrize(
    "segment",
    ['"py"', '"_a"', '"a.b-c"', '"%41"', '"%E9"', '"a%20b"', '"%u0041"', '"%U000041"'],
)
def test_non_canonical_segments_are_refused_in_manifests(segment):
    """Readers take only the canonical text of a key (SPEC.md §7): a quoted form of a bare key,
    or an escape of a printable character, parses but is not canonical."""
    with pytest.raises(treestore.InvalidInputError):
        canonical_segment(segment)


@given(st.text(max_size=12) | st.sampled_from(['"py"', '"%41"', "{-0}", '"%2f"', "{1}", "#1", ".a", '"a b"']))
def test_canonical_segments_are_exactly_the_formatted_ones(text):
    try:
        key = canonical_segment(text)
    except treestore.InvalidInputError:
        return
    assert format_key(key) == text


@given(paths)
def test_formatted_segments_are_canonical(path):
    for key in path:
        segment = format_key(key)
        assert typed([canonical_segment(segment)]) == typed([key])


@pytest.mark.parametrize("key", [1.5, None, (1, 2), b"bytes"])
def test_unsupported_dict_keys_name_the_path(key):
    with pytest.raises(treestore.errors.UnsupportedKeyError, match=r"params/0: dict key"):
        format_address((DictKey("params"), SequenceKey(0), DictKey(key)))


def test_unsupported_key_entry_type():
    class Odd:
        pass

    with pytest.raises(treestore.errors.UnsupportedKeyError, match="cannot become an address"):
        format_address((Odd(),))
