"""The command lines' argument parser: a bad argument is one line on stderr and exit 2."""

from __future__ import annotations

import argparse
import sys
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """argparse, with its usage error on one line: `prog: error: what (see prog --help)`. Its
    subcommands' parsers are of this class too (argparse makes them with the parent's class)."""

    def error(self, message: str) -> NoReturn:
        line = " ".join(message.split())
        sys.stderr.write(f"{self.prog}: error: {line} (see {self.prog} --help)\n")
        sys.exit(2)
