"""balanced-loader: plan data and parallelism together for LLM training on variable-length data.

The command line (contract 3). Each subcommand lives in ``balanced_loader/cli/<name>.py`` with
``add_arguments(parser)`` and ``run(args) -> int``; modules are imported only when their
command runs, so ``--help`` is fast. User mistakes (``ValueError``, missing files) print one
line on stderr and exit 2, never a traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# name -> (module under balanced_loader.cli, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "build-shards": ("cmd_build_shards", "tokenize files into webdataset shards plus a length index"),
    "analyze": ("cmd_analyze", "length statistics, histogram and advice for a dataset"),
    "plan": ("cmd_plan", "plan global batches with a policy and write plan JSON"),
    "simulate": ("cmd_simulate", "modeled step time, bubbles and skew of a plan"),
    "trace": ("cmd_trace", "a plan's modeled run as a Chrome/Perfetto trace (and a Gantt PNG)"),
    "compare": ("cmd_compare", "plan the same batches with several policies and compare"),
    "candidates": ("cmd_candidates", "Hydraulis candidate strategies from a length histogram"),
    "waves": ("cmd_waves", "Spindle wavefront schedule of a multi-task graph"),
    "presets": ("cmd_presets", "list cost, model and hardware presets"),
    "verify": ("cmd_verify", "check a shard folder fully: index, shard and per-doc checksums, tar headers"),
    "index": ("cmd_index", "rebuild a shard folder's length index, checked against its recorded checksums"),
}


class UsageError(Exception):
    """A command-line mistake argparse found (bad option, bad number): one line, exit 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but an error is one line (no usage block) raised to :func:`main`, not ``sys.exit``."""

    def error(self, message: str):  # type: ignore[override]
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


def _parser(with_commands: str | None = None) -> argparse.ArgumentParser:
    p = _Parser(prog="balanced-loader", description=__doc__.splitlines()[0])
    from balanced_loader import __version__

    p.add_argument("--version", action="version", version=f"balanced-loader {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name, (mod, help_) in COMMANDS.items():
        sp = sub.add_parser(name, help=help_, description=help_)
        if name == with_commands:
            importlib.import_module(f"balanced_loader.cli.{mod}").add_arguments(sp)
    return p


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    cmd = next((a for a in argv if not a.startswith("-")), None)
    if cmd is not None and cmd not in COMMANDS:
        print(f"balanced-loader: error: unknown command '{cmd}'; choose one of: {', '.join(COMMANDS)}",
              file=sys.stderr)
        return 2
    if cmd is not None:
        try:
            importlib.import_module(f"balanced_loader.cli.{COMMANDS[cmd][0]}")
        except ModuleNotFoundError as e:
            if e.name and e.name.startswith("balanced_loader.cli"):
                print(f"balanced-loader: error: command '{cmd}' is not available in this build", file=sys.stderr)
                return 2
            raise
    parser = _parser(cmd)
    try:
        args = parser.parse_args(argv)
    except UsageError as e:
        print(e, file=sys.stderr)
        return 2
    if args.command is None:
        parser.print_help()
        return 0
    mod = importlib.import_module(f"balanced_loader.cli.{COMMANDS[args.command][0]}")
    try:
        return int(mod.run(args) or 0)
    except BrokenPipeError:
        return 0
    except (ValueError, OSError) as e:  # OSError: a file the user named (missing, a folder, exists, no access)
        if isinstance(e, ValueError) or not e.strerror:
            msg = str(e)
        else:  # a write error of outputs.files names the path in strerror already; filename is then None
            msg = f"{e.strerror}: {e.filename}" if e.filename else e.strerror
        print(f"balanced-loader {args.command}: error: {msg}", file=sys.stderr)
        return 2
    except RecursionError:  # a deeply nested JSON/YAML input
        print(f"balanced-loader {args.command}: error: an input file is nested too deeply to be read",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("balanced-loader: interrupted", file=sys.stderr)
        return 130
