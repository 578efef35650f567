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
import pkgutil
import sys
from collections.abc import Sequence
from types import ModuleType

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


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``sv-attention`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "_run"):
        parser.print_help()
        return 0
    return int(args._run(args) or 0)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
