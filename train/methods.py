"""Which trainer trains each draft kind: the registry names it (``DraftKind.trainer``), this module resolves it. A light
module: the CLI's ``--help`` lists the methods without loading torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from specdec_kit.runtime.registry import draft_kind, trainable_kinds, zoo_heads


@dataclass(frozen=True)
class Trainer:
    """How heads of some kinds are trained: their settings, the training loop, and the data it can read."""

    make_spec: Callable[..., Any]  # (method, **settings) -> the trainer's settings (a ``Schedule``)
    train: Callable[..., dict]  # (target, data, spec, out_dir, base_model=, save_dtype=, ...) -> its training log
    options: tuple[str, ...] = ()  # the ``specdec-train-head`` options it reads beside the schedule's
    cached_features: str | None = None  # why it cannot train from ``--cache-features`` (None: it can)
    # the layers whose entering hidden states a feature cache holds for it, given (spec, target layers); None: the
    # last layer's features alone
    cache_taps: Callable[[Any, int], list[int]] | None = None
    # the target layers it reads from self-distilled data, given (spec, target layers); None: it cannot train on them
    distilled_layers: Callable[[Any, int], list[int]] | None = None


def methods() -> tuple[str, ...]:
    """The methods ``specdec-train-head`` trains: the registered kinds that name a trainer."""
    return trainable_kinds()


def method_kind(name: str) -> str:
    """The draft kind a recipe's head trains: its own name, or the kind of a zoo variant (``moa_tli0`` -> moa)."""
    return zoo_heads().get(name, (name, name))[0]


def trainer_for(method: str) -> Trainer:
    """The trainer of ``method`` (a draft kind or a zoo variant's name); a ValueError naming the choices otherwise."""
    kind = draft_kind(method_kind(method))
    if kind.trainer is None:
        raise ValueError(
            f"{kind.name} has no trainer of its own (its heads are another kind's weights); train one of {list(methods())}"
        )
    return kind.trainer.resolve()
