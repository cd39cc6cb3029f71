"""The onebit optimizers, each listed once, with the names the rest of onebit knows it by.

``onebit train``, the DeepSpeed config translation and the error messages read this list; an
optimizer added to onebit is its own module plus one line here.
"""

from __future__ import annotations

from dataclasses import dataclass

from .adam import OnebitAdam
from .base import CompressedOptimizer
from .lamb import OnebitLamb
from .zero_one_adam import ZeroOneAdam

__all__ = ["OPTIMIZERS", "Entry"]


@dataclass(frozen=True)
class Entry:
    """One optimizer and its names.

    Attributes:
        cls: the optimizer class.
        name: ``onebit train --optimizer``'s name for it.
        deepspeed: the ``"type"`` of DeepSpeed's optimizer it replaces (DeepSpeed matched it
            ignoring case).
        title: the algorithm's name in messages.
        reference: ``onebit train``'s name of the uncompressed optimizer it is measured against.
        freezes: whether it has a warmup of ``freeze_step`` exact steps, which
            ``warmup_compression`` can quantize, before it freezes the variance.
    """

    cls: type[CompressedOptimizer]
    name: str
    deepspeed: str
    title: str
    reference: str
    freezes: bool


OPTIMIZERS: tuple[Entry, ...] = (
    Entry(OnebitAdam, "onebit-adam", "OneBitAdam", "1-bit Adam", "adamw", freezes=True),
    Entry(ZeroOneAdam, "zero-one-adam", "ZeroOneAdam", "0/1 Adam", "adamw", freezes=False),
    Entry(OnebitLamb, "onebit-lamb", "OneBitLamb", "1-bit LAMB", "lamb", freezes=True),
)
