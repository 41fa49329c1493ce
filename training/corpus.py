"""The training text: the running interpreter's standard-library .py sources.

Every machine with Python has it, so the embedded pair can be rebuilt
anywhere. Files are split by a stable hash of their path relative to the
stdlib root, so the held-out set is the same on every machine with the same
Python version, and never changes when files are added elsewhere.
"""

from __future__ import annotations

import hashlib
import sysconfig
from pathlib import Path

HELD_OUT_PERCENT = 3  # files whose path hash falls in the first 3% are never trained on


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def _is_held_out(relative: str) -> bool:
    digest = hashlib.sha256(relative.encode()).digest()
    return int.from_bytes(digest[:4], "big") % 100 < HELD_OUT_PERCENT


def source_files(split: str, root: Path | None = None) -> list[Path]:
    """Sorted .py files of the split ("train" or "heldout"); site-packages excluded."""
    if split not in ("train", "heldout"):
        raise ValueError(f"split: must be 'train' or 'heldout', got {split!r}")
    root = root or stdlib_root()
    files = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if "site-packages" in relative or "dist-packages" in relative:
            continue
        if _is_held_out(relative) == (split == "heldout"):
            files.append(path)
    return files


def read_texts(split: str, root: Path | None = None, max_files: int | None = None) -> list[str]:
    """File contents of the split (undecodable files skipped)."""
    texts = []
    for path in source_files(split, root)[:max_files]:
        try:
            texts.append(path.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, OSError):
            continue
    return texts
