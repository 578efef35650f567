"""The ``sv-attention`` command.

Subcommands are discovered from the modules in :mod:`sv_attention.commands`. Each module defines

``COMMAND``
    ``"name"`` for a top-level subcommand, or ``"group name"`` (e.g. ``"bench deletion"``,
    ``"reproduce forgetting"``) for a member of a group.
``HELP``
    a one-line help text.
``add_arguments(parser)``
    adds its flags to an ``argparse.ArgumentParser``.
``run(args) -> int``
    does the work and returns the exit status.

So a new subcommand is a new file; no central table needs editing.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import pkgutil
import sys
from collections.abc import Sequence
from types import ModuleType

from sv_attention.errors import SVAttentionError

GROUP_HELP = {
    "bench": "speed / accuracy benchmarks (ratios measured side by side in one run)",
    "reproduce": "reproduce the paper's experiments; each writes results/NAME.json and a figure",
}


def _command_modules() -> list[ModuleType]:
    import sv_attention.commands as pkg

    mods = []
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda i: i.name):
        if info.name.startswith("_"):
            continue
        mod = importlib.import_module(f"{pkg.__name__}.{info.name}")
        if hasattr(mod, "COMMAND") and hasattr(mod, "run"):
            mods.append(mod)
    return mods


def build_parser() -> argparse.ArgumentParser:
    """Build the argument parser with every discovered subcommand."""
    from sv_attention import __version__

    parser = argparse.ArgumentParser(
        prog="sv-attention",
        description="Support-vector attention with certified KV eviction and exact deletion; the ceq operator.",
    )
    parser.add_argument("--version", action="version", version=f"sv-attention {__version__}")
    top = parser.add_subparsers(dest="command", metavar="COMMAND")
    groups: dict[str, argparse._SubParsersAction] = {}
    for mod in _command_modules():
        words = mod.COMMAND.split()
        help_text = mod.HELP.replace("%", "%%")  # argparse formats help strings with %
        if len(words) == 1:
            sub = top.add_parser(words[0], help=help_text, description=help_text)
        else:
            group, name = words
            if group not in groups:
                gp = top.add_parser(group, help=GROUP_HELP.get(group, group))
                groups[group] = gp.add_subparsers(dest="subcommand", metavar="NAME", required=True)
            sub = groups[group].add_parser(name, help=help_text, description=help_text)
        if hasattr(mod, "add_arguments"):
            mod.add_arguments(sub)
        sub.set_defaults(_run=mod.run)
    return parser


TRACEBACK_ENV = "SV_ATTENTION_TRACEBACK"
"""Set this environment variable to 1 to see the full traceback of a command error."""


def error_line(exc: BaseException) -> str:
    """One line saying what went wrong: the typed error's message, or the OS / value error's own words
    (a missing file names the file)."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return f"cannot open {exc.filename}: {exc.strerror}"
    if isinstance(exc, json.JSONDecodeError):
        return f"invalid JSON ({exc.msg} at line {exc.lineno}, column {exc.colno})"
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if isinstance(exc, SVAttentionError) else f"{type(exc).__name__}: {text}"


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``sv-attention`` console script.

    A command that fails with one of the project's typed errors, an OS error (a missing or unreadable file)
    or a value error (invalid JSON, an invalid config) prints ``sv-attention CMD: error: ...`` on one line
    of stderr and exits with status 2, without a traceback (set ``SV_ATTENTION_TRACEBACK=1`` to see it).
    Argument values are validated by argparse (usage line, error line, status 2).
    """
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "_run"):
        parser.print_help()
        return 0
    try:
        return int(args._run(args) or 0)
    except (SVAttentionError, OSError, ValueError) as exc:
        if os.environ.get(TRACEBACK_ENV, "") not in ("", "0"):
            raise
        name = " ".join(w for w in (getattr(args, "command", None), getattr(args, "subcommand", None)) if w)
        print(f"sv-attention {name}: error: {error_line(exc)}", file=sys.stderr)
        return 2


def read_json(path: str, what: str = "JSON file") -> object:
    """Parse the JSON file at ``path``; a missing file raises ``FileNotFoundError`` (reported with its name by
    :func:`main`), invalid JSON an :class:`~sv_attention.errors.InvalidInputError` naming the file."""
    from pathlib import Path

    from sv_attention.errors import InvalidInputError

    text = Path(path).read_text()
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidInputError(f"{what} {path} is not valid JSON ({exc.msg} at line {exc.lineno}, column "
                                f"{exc.colno})") from exc


def positive_int(minimum: int = 1):
    """An argparse ``type``: an integer ``>= minimum`` (argparse reports anything else as a usage error)."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}") from exc
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
