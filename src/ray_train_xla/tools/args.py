"""What the subcommands of ``ray-train-xla`` share: the exit statuses, the error a user can fix,
the argument types several of them take, and where a command runs."""

from __future__ import annotations

import argparse
import math

EXIT_FAILED = 1  # the command ran and failed
EXIT_USAGE = 2  # the command line is wrong
TIMEOUT_MAX_S = 86_400.0


class CommandError(Exception):
    """An error the user can fix, printed as one line; ``exit_code``: EXIT_USAGE (the command
    line is wrong) or EXIT_FAILED (the command ran and failed)."""

    def __init__(self, message: str, exit_code: int = EXIT_USAGE):
        super().__init__(message)
        self.exit_code = exit_code


def positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def _positive_number(text: str, at_most: float, what: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (0 < value <= at_most and math.isfinite(value)):  # also refuses nan and inf
        raise argparse.ArgumentTypeError(f"{text!r} is not a {what}")
    return value


def positive_seconds(text: str) -> float:
    return _positive_number(text, TIMEOUT_MAX_S, f"positive number of seconds (at most {TIMEOUT_MAX_S:g})")


def positive_float(text: str) -> float:
    """A finite number > 0 (``--peak-tflops``)."""
    return _positive_number(text, math.inf, "positive number")


def where(args: argparse.Namespace) -> str:
    return f"the Ray cluster at {args.address}" if args.address else "an embedded local Ray"
