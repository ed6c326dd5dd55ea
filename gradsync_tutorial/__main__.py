"""``python -m gradsync_tutorial <command>``: the course's command line.

    python -m gradsync_tutorial doctor      # is this machine ready for the course?
    python -m gradsync_tutorial lab         # the course in JupyterLab (what `make lab` runs)

Each command is a module with ``main(argv) -> int``; this file only dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import sys

#: command -> (module that implements it, one-line help)
COMMANDS = {
    "doctor": ("gradsync_tutorial.doctor", "check that this machine can run the course"),
    "lab": ("gradsync_tutorial.lab", "open the course in JupyterLab, as root or over SSH too"),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m gradsync_tutorial")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (_, help_) in COMMANDS.items():
        commands.add_parser(name, help=help_, add_help=False)
    args, rest = parser.parse_known_args(argv)
    return importlib.import_module(COMMANDS[args.command][0]).main(rest)


if __name__ == "__main__":
    sys.exit(main())
