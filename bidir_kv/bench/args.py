"""argparse value types shared by ``bench`` and ``plan``: lists of numbers, distributions."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TypeVar

from bidir_kv.bench.distributions import Distribution, DistributionError

__all__ = ["distribution", "float_list", "int_list"]

T = TypeVar("T")


def _number_list(text: str, convert: Callable[[str], T]) -> list[T]:
    try:
        values = [convert(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers, got {text!r}"
        ) from None
    if not values:
        raise argparse.ArgumentTypeError("expected at least one number")
    return values


def int_list(text: str) -> list[int]:
    """``"2000,4e3"`` -> ``[2000, 4000]``."""
    return _number_list(text, lambda x: int(float(x)))


def float_list(text: str) -> list[float]:
    return _number_list(text, float)


def distribution(text: str) -> Distribution:
    try:
        return Distribution.parse(text)
    except DistributionError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
