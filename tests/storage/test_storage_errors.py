"""How the generic storage layer reads what fsspec backends report: object times in the forms
they give them, and which errors are worth a retry (network failures, throttling, 5xx) or mean a
byte range past an object's end."""

from __future__ import annotations

import datetime as dt
import errno

import pytest

from treestore._storage import base

T = 1_700_000_000.0  # 2023-11-14T22:13:20Z


@pytest.mark.parametrize(
    ("info", "expected"),
    [
        ({"mtime": T}, T),
        ({"mtime": int(T)}, T),
        ({"LastModified": dt.datetime.fromtimestamp(T, dt.timezone.utc)}, T),  # botocore
        (
            {"last_modified": dt.datetime.fromtimestamp(T, dt.timezone.utc).replace(tzinfo=None)},
            T,
        ),  # naive: UTC
        ({"updated": "2023-11-14T22:13:20Z"}, T),  # GCS, ISO 8601 text
        ({"created": "2023-11-14T22:13:20+00:00"}, T),
        ({"mtime": "yesterday", "updated": "2023-11-14T22:13:20Z"}, T),  # the next key that parses
        ({"mtime": "yesterday"}, None),
        ({"mtime": None}, None),
        ({}, None),
    ],
    ids=lambda v: repr(v)[:40],
)
def test_object_times_in_every_form_a_backend_gives(info, expected):
    assert base._mtime(info) == expected


class _Status(Exception):
    def __init__(self, status: int) -> None:
        super().__init__(f"HTTP {status}")
        self.status = status


class _Botocore(Exception):
    def __init__(self, code: int) -> None:
        super().__init__("An error occurred")
        self.response = {"ResponseMetadata": {"HTTPStatusCode": code}}


def _caused(outer: Exception, cause: BaseException) -> Exception:
    outer.__cause__ = cause
    return outer


@pytest.mark.parametrize(
    ("exc", "transient"),
    [
        (ConnectionResetError("reset by peer"), True),
        (TimeoutError(), True),
        (PermissionError("denied"), False),
        (ValueError("bad"), False),
        (_Status(503), True),
        (_Status(429), True),
        (_Status(404), False),
        (_Status(403), False),
        (_Botocore(500), True),
        (_Botocore(400), False),
        (_caused(RuntimeError("wrapped"), _Status(502)), True),  # the status of its cause
        (OSError("Response payload is not completed"), True),
        (OSError("server said: 503 slow"), True),
        (OSError("no such bucket"), False),
    ],
    ids=lambda v: repr(v)[:50],
)
def test_which_errors_are_worth_a_retry(exc, transient):
    assert base._transient(exc) is transient


@pytest.mark.parametrize(
    ("exc", "past"),
    [
        (_Status(416), True),
        (OSError(errno.EINVAL, "Invalid argument"), True),  # s3fs's InvalidRange
        (OSError("InvalidRange: the range is not satisfiable"), True),
        (_Status(404), False),
        (OSError(errno.ENOENT, "missing"), False),
    ],
    ids=lambda v: repr(v)[:50],
)
def test_a_range_past_the_end_is_told_from_other_errors(exc, past):
    assert base._past_end(exc) is past
