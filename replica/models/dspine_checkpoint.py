"""DSpine drafter checkpoints: safetensors layout, save / load, random init.

A checkpoint is a directory with two files:

``config.json``
    ``{"model_type": "dspine", "architectures": ["DSpineDrafter"], ...}`` plus
    every init field of `DraftArgs` (block_size, feature_layers, hidden_size,
    intermediate_size, num_heads, num_kv_heads, head_dim, num_layers, window,
    rope_base, code_dim, message_dim, head_topk, num_retrieve, vocab_size,
    norm_eps, bridge_eps, qk_norm).

``model.safetensors``  (l = 0 .. num_layers-1; shapes with the 27B sizes in words)
    fc.weight                           [H, F*H]   context fusion
    hidden_norm.weight                  [H]        RMSNorm after the fusion
    mask_embedding                      [H]        placeholder input of rows 1..BS-1
    layers.{l}.attn_norm.weight         [H]
    layers.{l}.attn.q_proj.weight       [Hq*hd, H]
    layers.{l}.attn.k_proj.weight       [Hkv*hd, H]
    layers.{l}.attn.v_proj.weight       [Hkv*hd, H]
    layers.{l}.attn.o_proj.weight       [H, Hq*hd]
    layers.{l}.attn.q_norm.weight       [hd]       (qk_norm only)
    layers.{l}.attn.k_norm.weight       [hd]       (qk_norm only)
    layers.{l}.mlp_norm.weight          [H]
    layers.{l}.mlp.gate_proj.weight     [FFN, H]
    layers.{l}.mlp.up_proj.weight       [FFN, H]
    layers.{l}.mlp.down_proj.weight     [H, FFN]
    bridge.codebook                     [V, D]     token codes, unit rows (c = sqrt(D) * row)
    bridge.gate_recv                    [M, D]     G
    bridge.gate_pred                    [M, D]     Gp
    bridge.value_proj                   [M, D]     A
    bridge.gate_bias                    [M]        b
    bridge.read_proj.{l}                [D, H]     R_l
    bridge.write_proj.{l}               [H, M]     W_l
    norm.weight                         [H]        final RMSNorm

The target's token embedding and LM head are NOT stored: the drafter shares
the target's (pass them to `load_drafter`).
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from dspine.replica.models.dspine import DSpineDrafter
from dspine.replica.models.dspine_config import DraftArgs

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def save_drafter(drafter: DSpineDrafter, path) -> Path:
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / CONFIG_NAME).write_text(json.dumps(drafter.args.to_config(), indent=2) + "\n")
    tensors = {k: v.detach().contiguous().cpu() for k, v in drafter.state_dict().items()}
    # One metadata key: safetensors writes metadata from a hash map, so with two keys their order
    # (and the file's bytes) changed from save to save. The model type lives in config.json.
    save_file(tensors, str(path / WEIGHTS_NAME), metadata={"format": "pt"})
    return path


def load_draft_args(path) -> DraftArgs:
    cfg_path = Path(path) / CONFIG_NAME
    try:
        cfg = json.loads(cfg_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read DSpine config {cfg_path}: {e}") from e
    return DraftArgs.from_config(cfg)


def load_drafter(path, embed_tokens, lm_head_weight, device="cpu", dtype: torch.dtype | None = None) -> DSpineDrafter:
    """Build on meta, load model.safetensors with assign=True; weights land on `device` in `dtype`
    (default: the stored dtype). Missing or unexpected tensor names raise."""
    path = Path(path)
    args = load_draft_args(path)
    with torch.device("meta"):
        drafter = DSpineDrafter(args)
    state = load_file(str(path / WEIGHTS_NAME), device=str(device))
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    try:
        drafter.load_state_dict(state, strict=True, assign=True)
    except RuntimeError as e:
        raise ValueError(f"{path / WEIGHTS_NAME} does not match the DSpine layout: {e}") from e
    drafter.set_shared(embed_tokens, lm_head_weight)
    return drafter.eval()


def init_random_drafter(target_model_or_args, args: DraftArgs | None = None, seed: int = 0,
                        device="cpu", dtype: torch.dtype = torch.float32) -> DSpineDrafter:
    """A randomly initialised drafter sharing a target's embedding and LM head.

    `target_model_or_args` is a target model (anything with `embed_tokens`,
    `lm_head_weight` and `args`) or target args alone, in which case a random
    embedding and head of the right shape are made (seeded) and shared.
    `args` defaults to `DraftArgs.for_target(target args)`.
    """
    gen = torch.Generator().manual_seed(seed)
    if hasattr(target_model_or_args, "embed_tokens"):
        target = target_model_or_args
        targs = getattr(target, "args", None)
        embed, head = target.embed_tokens, target.lm_head_weight
    else:
        targs, target = target_model_or_args, None
        embed = torch.nn.Embedding(targs.vocab_size, targs.hidden_size, device=device, dtype=dtype)
        with torch.no_grad():
            embed.weight.copy_(torch.randn(embed.weight.shape, generator=gen))
        head = embed.weight
    if args is None:
        if targs is None:
            raise ValueError("pass args= when the target has no .args")
        args = DraftArgs.for_target(targs)
    drafter = DSpineDrafter(args, embed, head)
    drafter.init_weights(gen)
    return drafter.to(device=device, dtype=dtype).eval()
