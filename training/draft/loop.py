"""The drafter recipe end to end: data, target pass, optimisation, the saved drafter and its summary."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import time
from dataclasses import asdict
from pathlib import Path

import torch

from dspine.progress import Progress
from dspine.replica.models.dspine import DSpineDrafter
from dspine.replica.models.dspine_checkpoint import save_drafter
from dspine.replica.models.dspine_config import DraftArgs
from dspine.replica.models.loader import load_target
from dspine.replica.tokenizer import Tokenizer

from .anchors import sample_anchors
from .config import TINY_DRAFTER, DraftTrainConfig
from .data import distillation_data, target_fingerprint
from .evaluate import expected_sampled_blocks, simulate_greedy_cycles, target_probabilities
from .losses import block_losses, row_weights
from .schedule import build_optimizer, lr_at
from .target_pass import target_pass

_print = functools.partial(print, flush=True)  # the CLI's log usually goes to a file


def train_draft(cfg: DraftTrainConfig, log=_print) -> dict:
    """Generate (or load) the distillation data, train the drafter, save it to ``cfg.out_dir``."""
    if cfg.soft_label_topk < 0 or not 0.0 <= cfg.soft_label_weight <= 1.0:
        raise ValueError(f"soft_label_topk / soft_label_weight: need topk >= 0 and weight in [0, 1], got "
                         f"{cfg.soft_label_topk} / {cfg.soft_label_weight}")
    if cfg.soft_label_temperature <= 0 or cfg.continuation_temperature < 0:
        raise ValueError(f"soft_label_temperature / continuation_temperature: need > 0 / >= 0, got "
                         f"{cfg.soft_label_temperature} / {cfg.continuation_temperature}")
    if cfg.continuation_temperature > 0 and cfg.soft_label_topk == 0:
        raise ValueError("continuation_temperature > 0 needs soft labels (soft_label_topk > 0): the greedy label "
                         "of a sampled continuation is masked after its first departure from the greedy path")
    t0 = time.time()
    if cfg.threads:
        torch.set_num_threads(cfg.threads)
    torch.manual_seed(cfg.seed)
    target_dir, out = Path(cfg.target_dir), Path(cfg.out_dir)
    target = load_target(target_dir).eval().requires_grad_(False)
    tokenizer = Tokenizer.from_dir(target_dir)
    args = DraftArgs.for_target(target.args, **{**TINY_DRAFTER, **dict(cfg.model_overrides)})
    taps = tuple(args.feature_layers)
    if max(*cfg.prompt_lens, cfg.eval_prompt_len) > cfg.seq_len - args.block_size + 1:
        raise ValueError(f"prompt_lens {cfg.prompt_lens} / eval_prompt_len {cfg.eval_prompt_len}: need "
                         f"<= seq_len - block_size + 1 = {cfg.seq_len - args.block_size + 1} (labels are target output)")

    cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else out / "distill_cache"
    # Every data setting but the count; the cache file's name adds the count.
    settings = [target_fingerprint(target_dir), cfg.seq_len, list(cfg.prompt_lens), cfg.gen_batch, cfg.seed,
                cfg.max_files]
    if cfg.continuation_temperature > 0:  # greedy runs keep the cache key they always had
        settings.append(cfg.continuation_temperature)
    settings = json.dumps(settings)
    tag = hashlib.sha256(json.dumps([settings, cfg.num_sequences]).encode()).hexdigest()[:12]
    tokens, prompt_len = distillation_data(target, tokenizer, "train", cfg.num_sequences, cfg, cfg.seed,
                                           cache_dir / f"train-{tag}.safetensors", log, settings)
    gen_seconds = time.time() - t0
    made = "target-greedy" if cfg.continuation_temperature == 0 else f"target-sampled (T={cfg.continuation_temperature:g})"
    if cfg.stream_features:
        features = greedy = soft = None  # each step's batch gets its own target pass
        log(f"distillation data: {tokens.shape[0]} sequences x {tokens.shape[1]} tokens "
            f"({int((tokens.shape[1] - prompt_len).sum()):,} {made} tokens); features streamed per step; "
            f"data ready after {time.time() - t0:.0f} s")
    else:
        features, greedy, soft = target_pass(target, tokens, taps, soft_topk=cfg.soft_label_topk)
        on_path = (tokens[:, 1:] == greedy[:, :-1]).float().mean()
        log(f"distillation data: {tokens.shape[0]} sequences x {tokens.shape[1]} tokens "
            f"({int((tokens.shape[1] - prompt_len).sum()):,} {made} tokens; {100 * on_path:.1f}% of all next "
            f"tokens equal the target's argmax), features {tuple(features.shape)} bf16; "
            f"data ready after {time.time() - t0:.0f} s")

    drafter = DSpineDrafter(args, target.embed_tokens, target.lm_head_weight)
    drafter.init_weights(torch.Generator().manual_seed(cfg.seed))
    if cfg.init_from:
        _load_initial_weights(drafter, Path(cfg.init_from), target, log)
    drafter.train()
    n_params = sum(p.numel() for p in drafter.parameters())
    log(f"drafter: {n_params:,} parameters ({args.num_layers} layers, H {args.hidden_size}, D {args.code_dim}, "
        f"M {args.message_dim}, window {args.window}, taps {taps})")
    optimizer = build_optimizer(drafter, cfg)
    weights = row_weights(args.block_size - 1, cfg.decay_gamma)
    g = torch.Generator().manual_seed(cfg.seed + 1)
    N, L = tokens.shape
    history, first, last = [], None, None
    train_start = time.time()
    progress = Progress(cfg.steps, "train draft", unit="steps")
    for step in range(cfg.steps):
        lr = lr_at(step, cfg)
        for group in optimizer.param_groups:
            group["lr"] = lr
        idx = torch.randint(0, N, (min(cfg.batch_size, N),), generator=g)
        anchors = sample_anchors(prompt_len[idx], L, args.block_size, cfg.anchors_per_seq, g,
                                 cfg.early_frac, cfg.early_span, cfg.text_anchors)
        if features is None:
            batch_features, batch_greedy, batch_soft = target_pass(target, tokens[idx], taps, chunk=len(idx),
                                                                   soft_topk=cfg.soft_label_topk)
        else:
            batch_features, batch_greedy = features[idx], greedy[idx]
            batch_soft = soft[idx] if soft is not None else None
        res = block_losses(drafter, batch_features.float(), tokens[idx], batch_greedy, anchors, weights,
                           batch_soft, cfg.soft_label_weight, cfg.soft_label_temperature)
        loss = res["main"] + cfg.tail_weight * res["tail"]
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(drafter.parameters(), cfg.grad_clip)
        optimizer.step()
        row = {"step": step, "loss": loss.item(), "main": res["main"].item(), "tail": res["tail"].item(),
               "accept": res["accept"].item(), "accept_main": res["accept_main"].item(),
               **({"accept_sampled": res["accept_sampled"].item()} if "accept_sampled" in res else {})}
        first = first or row
        history.append(row)
        if step % cfg.log_every == 0 or step == cfg.steps - 1:
            recent = history[-cfg.log_every:]
            mean = {k: sum(r[k] for r in recent) / len(recent) for k in recent[-1] if k != "step"}
            rate = (time.time() - train_start) / (step + 1)
            sampled = (f"  accept at T={cfg.soft_label_temperature:g} {mean['accept_sampled']:.2f}"
                       if "accept_sampled" in mean else "")
            log(f"step {step:5d}  loss {mean['loss']:.3f} (main {mean['main']:.3f}, tail {mean['tail']:.3f})  "
                f"accept {mean['accept']:.2f}{sampled}  lr {lr:.2e}  {rate:.2f} s/step")
            last = mean
        progress.update(1, loss=round(row["loss"], 3), accept=round(row["accept"], 2))
    progress.close()
    train_seconds = time.time() - train_start
    drafter.eval()
    # The shipped weights are BF16; the held-out estimate below reads exactly those.
    save_drafter(drafter.to(torch.bfloat16), out)
    drafter.float()

    summary = {
        "steps": cfg.steps, "seed": cfg.seed, "parameters": n_params,
        "first_loss": first["loss"] if first else None, "final_loss": last["loss"] if last else None,
        "final_train_accept": last["accept"] if last else None,
        "final_train_accept_sampled": last.get("accept_sampled") if last else None,
        "num_sequences": int(N), "seq_len": int(L), "data_seconds": gen_seconds,
        "train_seconds": train_seconds, "config": {k: (list(v) if isinstance(v, tuple) else v)
                                                   for k, v in asdict(cfg).items()},
        "draft_args": args.to_config(),
    }
    if cfg.eval_sequences:
        ev_len = cfg.eval_prompt_len + cfg.eval_new_tokens + args.block_size
        # The replay is greedy speculative decoding, so its held-out continuations are greedy in every recipe.
        ev_cfg = dataclasses.replace(cfg, prompt_lens=(cfg.eval_prompt_len,), seq_len=ev_len,
                                     continuation_temperature=0.0)
        ev_tag = f"{tag}-{cfg.eval_sequences}-{cfg.eval_prompt_len}-{ev_len}"
        ev_tokens, _ = distillation_data(target, tokenizer, "heldout", cfg.eval_sequences, ev_cfg, cfg.seed,
                                         cache_dir / f"heldout-{ev_tag}.safetensors", log)
        ev_feats, ev_greedy, _ = target_pass(target, ev_tokens, taps)
        ev = simulate_greedy_cycles(drafter, ev_feats, ev_tokens, ev_greedy, cfg.eval_prompt_len, cfg.eval_new_tokens)
        summary["heldout"] = ev
        log(f"held-out greedy speculative decoding replayed offline ({cfg.eval_sequences} prompts of "
            f"{cfg.eval_prompt_len} tokens, {cfg.eval_new_tokens} new tokens): mean accepted length "
            f"{ev['cycle_accept']:.2f} per cycle over {ev['cycles']} cycles")
        if cfg.continuation_temperature > 0:  # the sampled recipe: also its own figure, on sampled held-out text
            summary["heldout_sampled"] = _heldout_sampled(drafter, target, tokenizer, taps, cfg, ev_len,
                                                          cache_dir / f"heldout-{ev_tag}-T{cfg.continuation_temperature:g}"
                                                                      ".safetensors", log)
    summary["total_seconds"] = time.time() - t0
    (out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    log(f"drafter saved to {out} ({summary['total_seconds']:.0f} s)")
    return summary


def _heldout_sampled(drafter, target, tokenizer, taps, cfg: DraftTrainConfig, ev_len: int, cache: Path, log) -> dict:
    """The expected sampled acceptance of blocks on held-out continuations the target sampled at the
    recipe's temperature (``expected_sampled_blocks``: the target's full p, not the top-k labels)."""
    temperature = cfg.continuation_temperature
    ev_cfg = dataclasses.replace(cfg, prompt_lens=(cfg.eval_prompt_len,), seq_len=ev_len)
    tokens, _ = distillation_data(target, tokenizer, "heldout", cfg.eval_sequences, ev_cfg, cfg.seed, cache, log)
    features, _, _ = target_pass(target, tokens, taps)
    probs = target_probabilities(target, tokens, temperature)
    ev = expected_sampled_blocks(drafter, features, tokens, probs, cfg.eval_prompt_len, cfg.eval_new_tokens,
                                 temperature)
    log(f"held-out sampled blocks at T={temperature:g} ({cfg.eval_sequences} prompts, {ev['blocks']} blocks): "
        f"expected accepted length {ev['block_accept_expected']:.2f}, rows 1-4 accepted "
        f"{', '.join(f'{a:.2f}' for a in ev['row_accept'])}")
    return ev


def _load_initial_weights(drafter: DSpineDrafter, draft_dir: Path, target, log) -> None:
    """Copy a trained drafter's weights (same geometry) into ``drafter`` (fp32, ready to train)."""
    from dspine.replica.models.dspine_checkpoint import load_drafter

    from dspine.replica.drafters import check_same_geometry

    trained = load_drafter(draft_dir, target.embed_tokens, target.lm_head_weight)
    try:  # the tail's candidate counts are no weights: the recipe's own apply
        check_same_geometry(trained.args, drafter.args)
    except ValueError as e:
        raise ValueError(f"init_from {draft_dir}: its geometry differs from the recipe's "
                         f"({trained.args} vs {drafter.args})") from e
    with torch.no_grad():
        own = dict(drafter.named_parameters())
        for name, param in trained.named_parameters():
            if param is not own[name]:  # the shared (frozen) embedding and head are the same tensors
                own[name].copy_(param.float())
    log(f"drafter initialised from {draft_dir}")
