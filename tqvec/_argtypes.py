"""argparse types shared by the command line (cli.py) and its bench subcommand (benchmark.py)."""

from __future__ import annotations

import argparse


def positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {v}")
    return v


def bit_list(allowed: range):
    """A type for comma-separated bit widths, each in ``allowed``."""
    def parse(text: str) -> list[int]:
        try:
            bits = [int(s) for s in text.split(",")]
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"must be comma-separated integers, e.g. 1,2,4, got {text!r}") from None
        bad = [b for b in bits if b not in allowed]
        if bad:
            raise argparse.ArgumentTypeError(
                f"must be in {allowed.start}..{allowed.stop - 1}, got {bad}")
        return bits
    return parse
