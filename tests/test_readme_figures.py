"""The README's description of the embedded pair is what ships: each stated figure is recomputed
from embedded/*/config.json, the loaded models and the weight files, and must appear in the README's
bullet as printed here (so a retrained pair or an edited README that disagree fail)."""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from dspine import embedded
from dspine.replica import Engine, EngineConfig

README = Path(__file__).resolve().parents[1] / "README.md"


def _bullet(label: str) -> str:
    """The README's ``- **label**: ...`` bullet as one line of text."""
    match = re.search(rf"^- \*\*{label}\*\*: (.*?)(?=^- |^\n|\Z)", README.read_text(), re.S | re.M)
    assert match, f"README has no '- **{label}**:' bullet"
    return " ".join(match.group(1).split())


def _parameters(module: torch.nn.Module) -> int:
    """Trainable parameters as the README counts them: each tensor once (the target's tied
    embedding / LM head once; the drafter's shared head and embedding belong to the target)."""
    return sum(p.numel() for p in module.parameters())  # parameters() already yields a tied tensor once


def _millions(n: int) -> str:
    return f"{n / 1e6:.1f}M parameters"


def _dtypes(directory: Path) -> set[str]:
    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return {str(f.get_slice(k).get_dtype()) for k in f.keys()}


@pytest.fixture(scope="module")
def engine():
    return Engine.from_pretrained(embedded.TARGET_DIR, embedded.DRAFT_DIR, EngineConfig(device="cpu", dtype="float32"))


def test_target_figures(engine):
    config = json.loads((embedded.TARGET_DIR / "config.json").read_text())
    tokenizer = json.loads((embedded.TARGET_DIR / "tokenizer.json").read_text())
    target = engine.target
    layers = config["layer_types"]
    # "6 layers (Gated DeltaNet x2, gated full attention, repeated)"
    assert len(layers) == config["num_hidden_layers"] == len(target.layers) == 6
    assert layers == ["linear_attention", "linear_attention", "full_attention"] * 2
    mixers = [type(next(iter(layer.children()))).__name__ for layer in target.layers]
    assert mixers == ["GatedDeltaNet", "GatedDeltaNet", "Attention"] * 2
    assert target.args.attn_output_gate  # the full attention is gated
    # "hidden 256, vocab 4,096 (byte-level BPE)"
    assert config["hidden_size"] == target.args.hidden_size == 256
    assert config["vocab_size"] == target.args.vocab_size == len(tokenizer["model"]["vocab"]) == 4096
    assert tokenizer["model"]["type"] == "BPE" and tokenizer["pre_tokenizer"]["type"] == "ByteLevel"
    # "6.2M parameters, BF16": the tied embedding is counted once
    assert config["tie_word_embeddings"] and target.lm_head_weight is target.embed_tokens.weight
    n = _parameters(target)
    assert n == json.loads((embedded.TARGET_DIR / "train_summary.json").read_text())["parameters"]
    assert _millions(n) == "6.2M parameters"
    assert _dtypes(embedded.TARGET_DIR) == {"BF16"}

    text = _bullet("Target")
    for phrase in (f"{len(layers)} layers (Gated DeltaNet x2, gated full attention, repeated)",
                   f"hidden {config['hidden_size']}", f"vocab {config['vocab_size']:,} (byte-level BPE)",
                   _millions(n), "BF16"):
        assert phrase in text, (phrase, text)


def test_drafter_figures(engine):
    config = json.loads((embedded.DRAFT_DIR / "config.json").read_text())
    drafter = engine.drafter
    args = drafter.args
    stated = dict(block_size=16, num_layers=2, feature_layers=(1, 2, 3, 4, 5), code_dim=128, message_dim=64,
                  head_topk=16, num_retrieve=128, window=512)
    assert {k: tuple(v) if isinstance(v, list) else v for k, v in config.items() if k in stated} == stated
    assert {k: getattr(args, k) for k in stated} == stated
    assert len(drafter.layers) == args.num_layers
    # "2.5M parameters, BF16": the drafter's own tensors; the LM head and the embedding it shares
    # with the target are not its parameters, and the draft checkpoint holds exactly these
    assert engine.drafter.lm_head_weight is engine.target.lm_head_weight
    own = {id(p) for p in drafter.parameters()}
    assert id(engine.target.lm_head_weight) not in own
    n = _parameters(drafter)
    with safe_open(str(embedded.DRAFT_DIR / "model.safetensors"), "pt") as f:
        assert n == sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys())
    assert n == json.loads((embedded.DRAFT_DIR / "train_summary.json").read_text())["parameters"]
    assert _millions(n) == "2.5M parameters"
    assert _dtypes(embedded.DRAFT_DIR) == {"BF16"}

    text = _bullet("Drafter")
    for phrase in (f"DSpine block {args.block_size}", f"{args.num_layers} layers",
                   f"taps {tuple(args.feature_layers)}", f"code width {args.code_dim}",
                   f"message width {args.message_dim}", f"head_topk {args.head_topk}",
                   f"retrieval {args.num_retrieve}", f"window {args.window}", _millions(n), "BF16"):
        assert phrase in text, (phrase, text)


def test_distillation_and_perplexity_figures():
    draft = json.loads((embedded.DRAFT_DIR / "train_summary.json").read_text())
    target = json.loads((embedded.TARGET_DIR / "train_summary.json").read_text())
    text = " ".join(README.read_text().split())
    # "greedy continuations of 16,384 train-split prompts"; the rebuild command's --steps 750
    assert f"{draft['num_sequences']:,} train-split prompts" in text
    assert f"dspine train target --out runs/target --steps {target['steps']}" in text
    # the figures table: "target held-out perplexity (BF16 weights) | 35.3"
    assert re.search(rf"held-out perplexity \(BF16 weights\) \| {target['heldout_perplexity_bf16_weights']:.1f} \|", text)
