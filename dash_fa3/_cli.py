"""What the package's command lines share: one-line argument errors and bounded argument types.

A bad argument ends a run before any work with exit status 2 and one line on stderr
(``PROG: error: ... (see --help)``), never a traceback or a result computed from
a non-finite or absurd value. The types raise :class:`argparse.ArgumentTypeError`,
which argparse reports as ``argument --x: <message>``.
"""

from __future__ import annotations

import argparse
import math
import os

from . import variants


class OneLineParser(argparse.ArgumentParser):
    """argparse whose errors are one line (no usage block) and exit with status 2."""

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")


def bounded_int(low: int, high: int):
    """An argument type: an integer in [low, high]."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"must be between {low} and {high}, got {value}")
        return value
    return parse


def bounded_float(low: float, high: float, *, strict: bool = False):
    """An argument type: a finite number in [low, high] (``strict``: in (low, high])."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value) or value < low or (strict and value == low) or value > high:
            raise argparse.ArgumentTypeError(f"must be a finite number {'>' if strict else '>='} {low:g} and "
                                             f"<= {high:g}, got {text!r}")
        return value
    return parse


def headdim(text: str) -> int:
    """An argument type: a head dim the API has kernels for (:func:`.variants.check_head_dims`)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    try:
        variants.check_head_dims(value, value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value


def folder_problem(path: str, what: str) -> str | None:
    """Make folder ``path`` (and its parents); why it cannot be made or written into, or None."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        return f"{what} {path!r}: {e.strerror or e}"
    if not os.access(path, os.W_OK | os.X_OK):
        return f"{what} {path!r} is not writable"
    return None
