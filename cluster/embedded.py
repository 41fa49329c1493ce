"""Which model directories a CLI command uses when the user names none."""

from __future__ import annotations

from dspine import embedded


def resolve_model_dirs(target: str | None, draft: str | None, speculative_needed: bool):
    """Return (target_dir, draft_dir); the embedded pair stands in for a target not given."""
    if target is not None:
        return target, draft
    if not embedded.available():
        raise FileNotFoundError(
            "no --target given and the embedded model is not in this installation; "
            "train it with `dspine train target` / `dspine train draft` or pass --target DIR"
        )
    return str(embedded.TARGET_DIR), (draft or str(embedded.DRAFT_DIR))
