"""The embedded default model: a tiny trained Qwen3.5-style hybrid target and its DSpine drafter.

Shipped as package data in exactly the formats the loaders read for real
checkpoints (an HF-format target directory, a DSpine draft directory).
Rebuild them with ``dspine train target`` and ``dspine train draft``.
"""

from pathlib import Path

TARGET_DIR = Path(__file__).parent / "target"
DRAFT_DIR = Path(__file__).parent / "draft"
# The drafter distilled on sampled continuations (same DraftArgs as DRAFT_DIR, other weights): served
# to requests with temperature >= EngineConfig.sampled_draft_min_temperature when present.
SAMPLED_DRAFT_DIR = Path(__file__).parent / "draft-sampled"


def available() -> bool:
    """True when the trained pair is present in this installation."""
    return (TARGET_DIR / "config.json").exists() and (DRAFT_DIR / "config.json").exists()


def sampled_available() -> bool:
    """True when the sampled drafter is shipped too (its config.json exists)."""
    return (SAMPLED_DRAFT_DIR / "config.json").exists()
