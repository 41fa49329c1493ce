"""Building an engine: weights, the memory-plan checks, the pools and the retrieval choice.

``Engine.from_pretrained`` (the :class:`EngineLoading` mixin) checks the memory plan from the
config files alone, loads the models on the engine's device thread and hands them to
``Engine.__init__``, which builds its runtime with :func:`build_runtime`: the memory plan
against the real weights, the draft KV pool and tail tables, the target's K/V pool, the model
runner and the admission ledger over those pools. An optional second, sampled drafter
(replica/drafters.py) must have the greedy one's geometry; it shares the draft KV pool and
gets tail tables of its own.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from .admission import DraftPoolCapacity, MemoryAdmission, PagedKvCapacity, TargetTokenCapacity
from .config import EngineConfig
from .device_thread import DeviceThread
from .drafters import check_drafter_pair, describe_drafters
from .memory_plan import MemoryPlan, MemoryPlanError, draft_pool_slots, plan_for_engine
from .model_runner import ModelRunner

logger = logging.getLogger(__name__)


def check_memory_plan(target_args, draft_args, config: EngineConfig, max_seq_len: int,
                      target_weight_bytes: int | None = None, num_drafters: int = 1) -> MemoryPlan:
    """The engine's memory plan; raises :class:`MemoryPlanError` when it does not fit (and the check is on).
    ``num_drafters``: 2 with a sampled drafter (its weights and tail tables counted too)."""
    plan = plan_for_engine(target_args, draft_args, config, max_seq_len, target_weight_bytes, num_drafters)
    if config.memory_check and not plan.fits:
        raise MemoryPlanError(plan)
    logger.info("%s", plan.format())
    return plan


def precheck_memory_plan(target_dir, draft_dir, config: EngineConfig, sampled_draft_dir=None) -> None:
    """The plan from the config files alone, so that a misfit (or two drafters of different
    geometry) fails before gigabytes are loaded."""
    from .models.dspine_checkpoint import load_draft_args
    from .models.target_config import TargetArgs

    target_args = TargetArgs.from_hf_config(json.loads((Path(target_dir) / "config.json").read_text()))
    draft_args = load_draft_args(draft_dir) if draft_dir is not None else None
    check_drafter_pair(draft_args, load_draft_args(sampled_draft_dir) if sampled_draft_dir is not None else None)
    check_memory_plan(target_args, draft_args, config, config.max_seq_len or target_args.max_position_embeddings,
                      num_drafters=2 if sampled_draft_dir is not None else 1)


def load_models(target_dir, draft_dir, config: EngineConfig, device_thread: DeviceThread):
    """``(target, drafter or None)`` loaded on ``device_thread`` (where the engine will run them)."""
    from .models.loader import load_target

    def load():
        target = load_target(target_dir, device=config.torch_device, dtype=config.torch_dtype)
        return target, _load_drafter(draft_dir, target, config)

    return device_thread.call(load)


def load_sampled_drafter(sampled_draft_dir, target, config: EngineConfig, device_thread: DeviceThread):
    """The sampled drafter (or None), sharing ``target``'s embedding and LM head, on ``device_thread``."""
    return device_thread.call(_load_drafter, sampled_draft_dir, target, config)


def _load_drafter(draft_dir, target, config: EngineConfig):
    if draft_dir is None:
        return None
    from .models.dspine_checkpoint import load_drafter

    return load_drafter(draft_dir, target.embed_tokens, target.lm_head_weight,
                        device=config.torch_device, dtype=config.torch_draft_dtype)


@dataclass
class EngineRuntime:
    """What ``Engine.__init__`` builds around the models."""

    memory_plan: MemoryPlan
    runner: ModelRunner
    admission: MemoryAdmission


def build_runtime(target, drafter, config: EngineConfig, max_seq_len: int,
                  device_thread: DeviceThread, sampled_drafter=None) -> EngineRuntime:
    """Check the memory plan, then build the pools (on ``device_thread``), the runner and the ledger.
    ``sampled_drafter``: a second drafter of the same geometry (replica/drafters.py) sharing the pool."""
    block_size = drafter.args.block_size if drafter is not None else 0
    device = config.torch_device
    check_drafter_pair(drafter.args if drafter is not None else None,
                       sampled_drafter.args if sampled_drafter is not None else None)
    # Before the draft pool and tail tables exist: a configuration that cannot fit is refused here.
    weight_bytes = sum(p.numel() * p.element_size() for p in target.parameters())
    plan = check_memory_plan(target.args, drafter.args if drafter is not None else None, config, max_seq_len,
                             weight_bytes, num_drafters=2 if sampled_drafter is not None else 1)
    draft_pool, tail_tables = device_thread.call(_build_draft_side, drafter, config, max_seq_len)
    sampled_tail_tables = None
    if sampled_drafter is not None:
        sampled_tail_tables = device_thread.call(_build_sampled_tail_tables, sampled_drafter, tail_tables, config)
    target_kv_pool = device_thread.call(_build_target_kv_pool, target, config, max_seq_len, block_size)
    runner = ModelRunner(target, drafter, tail_tables, draft_pool, config, device, target_kv_pool=target_kv_pool,
                         sampled_drafter=sampled_drafter, sampled_tail_tables=sampled_tail_tables)
    logger.info("drafters: %s", describe_drafters(runner.drafters, config.sampled_draft_min_temperature))
    # Admission by memory (replica/admission.py): the target's K/V (its paged pool, or for the
    # contiguous layout a configured token bound) and the draft KV pool.
    if target_kv_pool is not None:
        pools = [PagedKvCapacity(target_kv_pool, verify_rows=max(block_size - 1, 0))]
    else:
        pools = [TargetTokenCapacity(config.target_kv_tokens, runner.target_tokens_in_use)]
    if draft_pool is not None:
        pools.append(DraftPoolCapacity(draft_pool))
    admission = MemoryAdmission(pools, max_seq_len, config.admission_reservation, block_size)
    return EngineRuntime(plan, runner, admission)


def _build_target_kv_pool(target, config: EngineConfig, max_seq_len: int, block_size: int):
    from .models.paged_kv_pool import build_target_kv_pool

    return build_target_kv_pool(target, config, max_seq_len, block_size, config.torch_device)


def _build_draft_side(drafter, config: EngineConfig, max_seq_len: int):
    """``(draft KV pool, tail tables)``, or ``(None, None)`` without a drafter."""
    if drafter is None:
        return None, None
    from .draft_kv_pool import DraftKVPool, RingDraftKVPool

    args = drafter.args
    # The default sizes hold every admitted request at its largest; the + 1 is the pool's
    # padding sink (slot 0, never allocated). Without it 8 ring requests that all reach a full
    # window need one slot more than exists, and one of them fails.
    slots = draft_pool_slots(config.draft_pool, config.max_concurrency, max_seq_len, args.window,
                             config.draft_pool_tokens)
    pool_type = RingDraftKVPool if config.draft_pool == "ring" else DraftKVPool
    pool = pool_type(args, slots, device=config.torch_device, dtype=config.torch_draft_dtype)
    return pool, _build_tail_tables(drafter, config)


def _build_tail_tables(drafter, config: EngineConfig):
    from .tail import TailTables

    return TailTables.from_drafter(drafter, retrieval=config.retrieval_mode)


def _build_sampled_tail_tables(sampled_drafter, greedy_tables, config: EngineConfig):
    """The sampled drafter's own tail tables; the retrieval scan copy of the LM head (FP8 or bf16,
    [V, H]) is the greedy tables' when both drafters share the target's head (as loaded drafters do)."""
    import dataclasses

    from .tail import TailTables
    from .types import RetrievalMode

    head, shared = sampled_drafter.lm_head_weight, greedy_tables.head
    if not (head.data_ptr() == shared.data_ptr() and head.shape == shared.shape and head.dtype == shared.dtype):
        return _build_tail_tables(sampled_drafter, config)
    own = TailTables.from_drafter(sampled_drafter, retrieval=RetrievalMode.EXACT)  # no second copy made
    return dataclasses.replace(own, retrieval=greedy_tables.retrieval, head_fp8=greedy_tables.head_fp8,
                               head_scale=greedy_tables.head_scale, head_bf16=greedy_tables.head_bf16)


class EngineLoading:
    """The ``from_pretrained`` constructor of ``Engine`` (a mixin)."""

    @classmethod
    def from_pretrained(cls, target_dir: str | Path, draft_dir: str | Path | None = None,
                        config: EngineConfig = EngineConfig(), sampled_draft_dir: str | Path | None = None):
        """Load an HF-format target directory and optionally a DSpine draft directory (the greedy
        drafter) and a second one for sampled requests (``sampled_draft_dir``, same DraftArgs)."""
        from .tokenizer import Tokenizer

        precheck_memory_plan(target_dir, draft_dir, config, sampled_draft_dir)  # before any weight is loaded

        device_thread = DeviceThread(num_threads=config.num_threads)
        target, drafter = load_models(target_dir, draft_dir, config, device_thread)
        sampled_drafter = load_sampled_drafter(sampled_draft_dir, target, config, device_thread)
        tokenizer = Tokenizer.from_dir(target_dir) if (Path(target_dir) / "tokenizer.json").exists() else None
        return cls(target, drafter, tokenizer, config, device_thread, sampled_drafter=sampled_drafter)
