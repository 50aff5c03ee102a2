"""Entry point of the ``treestore`` command: the command group, global options, error handling.

Every error ends as one line on stderr, ``treestore: error: <message>``, and exit status 2 (a
traceback too with ``--debug``); commands that compare or check exit 1 to say "different" or
"problems found".
"""

from __future__ import annotations

import re
import sys
import traceback
from collections.abc import Sequence
from typing import Any

import click

import treestore

from .commands_demo import demo
from .commands_derive import derive
from .commands_follow import timeline, watch
from .commands_inspect import diff, health, ls, show
from .commands_interop import export, import_
from .commands_store import cp, gc, rm, verify
from .context import Settings, parse_option

ERROR = 2


# The library's messages name its arguments; on the command line the flags are meant.
_SPELLINGS = (
    (re.compile(r"\b[a-z_]+=\S* \((--[a-z-]+)\)"), r"\1"),  # overwrite=True (--overwrite)
    (re.compile(r"\([a-z_]+=\S*, (--[a-z-]+)\)"), r"(\1)"),  # (nest=False, --flat)
    (re.compile(r"\bpass overwrite=True\b"), "pass --overwrite"),
)


def cli_spelling(message: str) -> str:
    """``message`` with the library's argument spellings turned into the command's flags.

    >>> cli_spelling("'a' exists; pass overwrite=True (--overwrite) to replace it")
    "'a' exists; pass --overwrite to replace it"
    """
    for pattern, flag in _SPELLINGS:
        message = pattern.sub(flag, message)
    return message


def _fail(message: str, settings: Settings, exc: BaseException | None = None) -> int:
    if exc is not None and settings.debug:
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
    first, *rest = message.strip().splitlines() or [""]
    click.echo(f"treestore: error: {first}", err=True)
    for line in rest:  # errors that list several problems keep one per line
        click.echo(f"  {line.strip()}", err=True)
    return ERROR


_GLOBAL_FLAGS = {"-q", "--quiet", "--debug"}
_GLOBAL_VALUED = {"-o", "--storage-option"}


def globals_first(args: Sequence[str]) -> list[str]:
    """``args`` with the global options moved before the subcommand, so that they may be given
    anywhere (``treestore ls DIR -q``); nothing after ``--`` moves.

    >>> globals_first(["ls", "DIR", "-q", "-o", "anon=true", "--", "-q"])
    ['-q', '-o', 'anon=true', 'ls', 'DIR', '--', '-q']
    """
    front: list[str] = []
    rest: list[str] = []
    items = list(args)
    i = 0
    while i < len(items):
        a = items[i]
        if a == "--":
            rest += items[i:]
            break
        if a in _GLOBAL_FLAGS or a.startswith("--storage-option=") or (a.startswith("-o") and a != "-o"):
            front.append(a)
        elif a in _GLOBAL_VALUED and i + 1 < len(items):
            front += items[i : i + 2]
            i += 1
        else:
            rest.append(a)
        i += 1
    return front + rest


class TreestoreGroup(click.Group):
    """A click group whose ``main`` turns every failure into one line and an exit status."""

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        settings = Settings()
        args = globals_first(sys.argv[1:] if args is None else args)
        try:
            code = super().main(
                args, prog_name or "treestore", complete_var, standalone_mode=False, obj=settings, **extra
            )
            code = 0 if code is None else int(code)
        except click.exceptions.NoArgsIsHelpError as exc:  # bare `treestore`: help, as --help does
            click.echo(exc.ctx.get_help() if exc.ctx is not None else exc.format_message())
            code = 0
        except click.UsageError as exc:
            hint = f" (see '{exc.ctx.command_path} --help')" if exc.ctx is not None else ""
            code = _fail(exc.format_message() + hint, settings, exc)
        except click.ClickException as exc:
            code = _fail(exc.format_message(), settings, exc)
        except click.Abort as exc:  # click turns Ctrl-C (KeyboardInterrupt) into Abort
            if isinstance(exc.__cause__, KeyboardInterrupt):
                click.echo("treestore: interrupted", err=True)
                code = 130
            else:
                code = _fail("aborted", settings)
        except treestore.TreestoreError as exc:
            code = _fail(cli_spelling(str(exc)), settings, exc)
        except OSError as exc:  # a local file the command was given: missing, unwritable, ...
            code = _fail(str(exc), settings, exc)
        except Exception as exc:  # a bug, or a failure the library did not classify
            code = _fail(f"{type(exc).__name__}: {exc} (run with --debug for a traceback)", settings, exc)
        if standalone_mode:
            sys.exit(code)
        return code


def _storage_options(ctx: click.Context, param: click.Parameter, values: tuple[str, ...]) -> dict[str, Any]:
    return dict(parse_option(v) for v in values)


@click.group("treestore", cls=TreestoreGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("-q", "--quiet", is_flag=True, help="No progress bars or notes; results only.")
@click.option("--debug", is_flag=True, help="Print a traceback with errors.")
@click.option(
    "-o",
    "--storage-option",
    "storage_options",
    multiple=True,
    metavar="KEY=VALUE",
    callback=_storage_options,
    help="An fsspec storage option for the filesystem of every URL (repeatable; values are read "
    "as JSON when they are JSON), for example -o anon=true -o endpoint_url=http://localhost:9000.",
)
@click.version_option(treestore.__version__, prog_name="treestore")
@click.pass_context
def cli(ctx: click.Context, quiet: bool, debug: bool, storage_options: dict[str, Any]) -> None:
    """Chunked, compressed, content-addressed checkpoints for JAX pytrees.

    \b
    A store is a folder at a URL: a local path or any fsspec URL
    (s3://bucket/run, gs://bucket/run, memory://x, ...).
    A checkpoint is named URL (the store's newest checkpoint) or URL#NAME.
    Addresses name leaves by their key path: params/layers/0/w.

    \b
    Exit status: 0 success; 1 differences (diff) or problems (verify; a damaged
    checkpoint in ls or timeline); 2 errors.
    Try `treestore demo` first.
    """
    settings = ctx.ensure_object(Settings)
    settings.quiet = quiet
    settings.debug = debug
    settings.storage_options = storage_options


def _plain(text: str | None) -> str | None:
    """Help text without the docstrings' RST markup (``x`` prints as `x`)."""
    return None if text is None else text.replace("``", "`")


for command in (ls, show, diff, health, verify, gc, rm, cp, import_, export, demo, watch, timeline, derive):
    command.help = _plain(command.help)
    for param in command.params:
        if isinstance(param, click.Option):
            param.help = _plain(param.help)
    cli.add_command(command)


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``); returns the exit status."""
    return int(cli.main(list(argv) if argv is not None else None, standalone_mode=False))


if __name__ == "__main__":
    raise SystemExit(main())
