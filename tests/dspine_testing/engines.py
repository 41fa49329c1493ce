"""Engines over tiny models for tests: a random drafter, every step speculating, fp32 on the CPU."""

from __future__ import annotations

from dspine.replica import Engine, EngineConfig
from dspine.replica.models.dspine_checkpoint import init_random_drafter
from dspine.replica.models.dspine_config import DraftArgs
from dspine.replica.models.target import TargetModel


def make_engine(target: TargetModel, window: int = 8, seed: int = 0, with_drafter: bool = True,
                **config) -> Engine:
    """An engine over ``target`` with a random drafter (``window``, ``seed``) unless ``with_drafter`` is False;
    ``config`` overrides EngineConfig fields."""
    drafter = None
    if with_drafter:
        args = DraftArgs.for_target(target.args, window=window, num_retrieve=min(32, target.args.vocab_size))
        drafter = init_random_drafter(target, args, seed=seed).eval()
    # The random drafter almost never gets a row right, so adaptive speculation would soon stop
    # drafting; tests of the verification path need every step to speculate. Policy tests and the
    # distilled-drafter equivalence tests run with it on.
    config.setdefault("adaptive_speculation", False)
    config.setdefault("device", "cpu")
    config.setdefault("dtype", "float32")
    return Engine(target, drafter, None, EngineConfig(**config))
