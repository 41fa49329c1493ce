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


def resolve_sampled_draft_dir(target: str | None, draft: str | None, sampled_draft: str | None) -> str | None:
    """The sampled drafter's directory: the one given, else the embedded one when the embedded pair
    stands in (neither target nor draft given) and it is shipped, else None (one drafter)."""
    if sampled_draft is not None:
        return sampled_draft
    if target is None and draft is None and embedded.available() and embedded.sampled_available():
        return str(embedded.SAMPLED_DRAFT_DIR)
    return None
