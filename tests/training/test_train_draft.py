"""The drafter recipe end to end on a tiny target: distil, reload through the engine, generate losslessly."""
from __future__ import annotations

import json

import pytest
import torch

from dspine.replica import Engine, EngineConfig
from dspine.replica.models.dspine_checkpoint import load_draft_args
from dspine.replica.sampling import SamplingParams
from dspine.training.draft import DraftTrainConfig, sample_continuations, train_draft
from dspine.training.draft.anchors import sample_anchors
from dspine.training.draft.labels import block_labels
from dspine.training.draft.losses import row_weights
from dspine.training.target import TargetTrainConfig, train_target

TINY_TARGET = (("hidden_size", 64), ("intermediate_size", 128), ("num_layers", 3), ("feature_layers", (0, 1, 2)),
               ("num_heads", 2), ("num_kv_heads", 1), ("linear_num_key_heads", 2), ("linear_num_value_heads", 4))
TINY_DRAFTER = (("feature_layers", (0, 1, 2)), ("intermediate_size", 128), ("num_heads", 2), ("num_kv_heads", 1), ("head_dim", 32),
                ("code_dim", 32), ("message_dim", 16), ("window", 48))


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (and do not fight a busy machine for cores)."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def target_dir(tmp_path_factory, one_thread):
    out = tmp_path_factory.mktemp("target")
    torch.manual_seed(0)
    train_target(TargetTrainConfig(out_dir=str(out), steps=30, batch_size=8, seq_len=64, vocab_size=512,
                                   max_files=6, warmup_steps=5, model_overrides=TINY_TARGET), log=lambda *_: None)
    return out


def _config(target_dir, out, **kw):
    base = dict(target_dir=str(target_dir), out_dir=str(out), steps=60, max_files=6, num_sequences=48, seq_len=64,
                prompt_lens=(16, 24), gen_batch=16, eval_sequences=8, eval_prompt_len=20, eval_new_tokens=24, batch_size=8, anchors_per_seq=4,
                warmup_steps=5, log_every=10, model_overrides=TINY_DRAFTER)
    base.update(kw)
    return DraftTrainConfig(**base)


def test_distil_reload_and_generate_losslessly(target_dir, tmp_path):
    lines = []
    summary = train_draft(_config(target_dir, tmp_path / "draft"), log=lines.append)
    assert summary["final_loss"] < summary["first_loss"]
    saved = json.loads((tmp_path / "draft" / "train_summary.json").read_text())
    assert saved["steps"] == 60 and saved["seed"] == 0 and saved["train_seconds"] > 0
    assert load_draft_args(tmp_path / "draft").code_dim == 32
    assert any("saved to" in line for line in lines)

    engine = Engine.from_pretrained(target_dir, tmp_path / "draft", EngineConfig(device="cpu", dtype="float32"))
    assert engine.drafter is not None
    params = SamplingParams(max_new_tokens=40, ignore_eos=True)
    prompts = [engine.tokenizer.encode("def main(argv):\n    return"), engine.tokenizer.encode("import os\n")]
    base = engine.generate_many(prompts, params, speculative=False)
    spec = engine.generate_many(prompts, params, speculative=True)
    assert [r.token_ids for r in spec] == [r.token_ids for r in base]
    assert all(len(r.token_ids) == 40 for r in spec)

    # a rerun reads the cached continuations and is deterministic for the seed
    lines2 = []
    again = train_draft(_config(target_dir, tmp_path / "draft2", cache_dir=str(tmp_path / "draft" / "distill_cache")),
                        log=lines2.append)
    assert any("cached" in line for line in lines2)
    assert again["final_loss"] == summary["final_loss"]


def test_labels_are_the_target_greedy_continuation(target_dir):
    from dspine.replica.models.loader import load_target
    from dspine.replica.reference import reference_generate

    target = load_target(target_dir).eval()
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, target.args.vocab_size, (3, 7), generator=g)
    out = sample_continuations(target, prompts, 20)  # temperature 0: greedy
    for b in range(3):
        assert out[b, 7:].tolist() == reference_generate(target, prompts[b].tolist(), 13)
    # sampled (the test suite's quick distillation): the prompt kept, the draws the generator's
    def sampled(seed):
        return sample_continuations(target, prompts, 20, temperature=1.0, generator=torch.Generator().manual_seed(seed))

    first = sampled(1)
    assert torch.equal(first[:, :7], prompts) and torch.equal(sampled(1), first)
    assert not torch.equal(first, out) and not torch.equal(sampled(2), first)


def test_anchor_range_and_row_weights():
    g = torch.Generator().manual_seed(0)
    plen = torch.tensor([1, 16, 49])
    lo = (plen[:, None] - 1).clamp(min=1)
    a = sample_anchors(plen, 64, 16, 200, g, early_frac=0.5, early_span=8, text_anchors=True)
    assert (a >= 1).all() and (a <= 64 - 16).all()
    early = a[:, :100]
    assert (early >= lo).all() and (early <= lo + 7).all()
    assert early[2].unique().tolist() == [48]
    assert len(a[1, 100:].unique()) > 30  # text anchors: the rest covers the whole sequence
    assert (a[1, 100:] < 15).any()
    # default (the shipped recipe): uniform over the continuation only, one rand draw of [B, per_seq]
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    a = sample_anchors(plen, 64, 16, 200, g1)
    assert (a >= lo).all() and (a <= 64 - 16).all()
    u = torch.rand(3, 200, generator=g2)
    span = 64 - 16 - lo + 1
    assert torch.equal(a, lo + (u * span).long())
    w = row_weights(15, 7.0)
    assert torch.isclose(w.sum(), torch.tensor(1.0)) and (w[1:] < w[:-1]).all()


def test_tail_loss_scores_equal_serving_tail_tables():
    """tail_hidden (the tail loss) scores exactly what the serving tail's conditional tables score."""
    from dspine.replica.models.dspine_checkpoint import init_random_drafter
    from dspine.replica.models.dspine_config import DraftArgs
    from dspine.replica.models.target_config import TargetArgs
    from dspine.replica.tail import TailTables, conditional_tables
    from dspine.training.draft.losses import tail_hidden

    targs = TargetArgs.from_name("tiny-qwen3")
    d = init_random_drafter(targs, DraftArgs.for_target(targs, window=32, feature_layers=(0, 1)), seed=1)
    g = torch.Generator().manual_seed(5)
    feats = torch.randn(1, 40, 2, d.args.hidden_size, generator=g)
    tokens = torch.randint(0, d.args.vocab_size, (1, 40), generator=g)
    anchors = torch.tensor([[7, 20]])
    with torch.no_grad():
        out = d.forward_train(feats, tokens, anchors)
        BS = d.args.block_size
        idx = anchors[..., None] + torch.arange(BS)
        block = tokens[0, idx[0]]  # [A, BS]
        loss_logits = d.logits(tail_hidden(d, out, block[None, :, :-1]))[0]  # [A, BS-1, V]
        tables = TailTables.from_drafter(d, retrieval="exact")
        K = d.args.head_topk
        cand = torch.randint(0, d.args.vocab_size, (2, BS - 1, K), generator=g)
        cand[:, :, 0] = block[:, 1:]  # the true token is candidate 0; row t-1's true token is its slot 0
        flat = type("O", (), {"x_last": out.x_last[0], "rms": out.rms[0], "codes": out.codes[0]})
        scores = conditional_tables(flat, tables, block[:, 0], cand)  # [A, BS-1, K (pred j), K (recv i)]
    # predecessor slot 0 = the true previous token (row 1: the anchor) -> must match the loss's logits
    torch.testing.assert_close(scores[:, :, 0, :], loss_logits.gather(-1, cand), rtol=1e-4, atol=1e-4)


def test_block_labels_follow_the_target_greedy_path():
    # greedy[t] = the target's argmax after x[..t]; the text agrees with it at t = 1, 2 and 5 only
    tokens = torch.tensor([[10, 11, 12, 13, 14, 15, 16, 17]])
    greedy = torch.tensor([[11, 12, 99, 98, 15, 97, 96, 95]])
    labels, preds, valid = block_labels(tokens, greedy, torch.tensor([[0, 3]]), block_size=4)
    assert preds.tolist() == [[[10, 11, 12], [13, 14, 15]]]
    assert labels.tolist() == [[[11, 12, 99], [98, 15, 97]]]
    # anchor 0: rows 1, 2 are on the path and row 3's label is the target's token 99 (text says 13)
    # anchor 3: row 1's label 98 != text 14, so rows 2, 3 are not the target's continuation
    assert valid.tolist() == [[[True, True, True], [True, False, False]]]


def test_soft_labels_read_the_labels_position_and_reduce_to_cross_entropy():
    from dspine.training.draft.labels import SoftLabels
    from dspine.training.draft.losses import soft_cross_entropy

    g = torch.Generator().manual_seed(0)
    n, length, k, vocab = 2, 40, 5, 30
    logp = torch.randn(n, length, vocab, generator=g).log_softmax(-1)
    top = logp.topk(k, dim=-1)
    soft = SoftLabels(top.indices.int(), top.values.bfloat16())
    anchors = torch.tensor([[3, 10], [0, 20]])
    ids, probs = soft.at_blocks(anchors, block_size=6)
    assert ids.shape == probs.shape == (2, 2, 5, k)
    assert torch.equal(ids[1, 1, 2], top.indices[1, 20 + 2].long())  # row 3 of anchor 20 reads position 22
    torch.testing.assert_close(probs.sum(-1), torch.ones(2, 2, 5))
    logits = torch.randn(7, vocab, generator=g)
    labels = torch.randint(0, vocab, (7,), generator=g)
    one_hot = torch.ones(7, 1)
    torch.testing.assert_close(soft_cross_entropy(logits, labels[:, None], one_hot),
                               torch.nn.functional.cross_entropy(logits, labels, reduction="none"))


def test_distil_with_soft_labels(target_dir, tmp_path):
    summary = train_draft(_config(target_dir, tmp_path / "draft", soft_label_topk=8, steps=40, eval_sequences=0),
                          log=lambda *_: None)
    assert summary["final_loss"] < summary["first_loss"]
    with pytest.raises(ValueError, match="soft_label_weight"):
        train_draft(_config(target_dir, tmp_path / "bad", soft_label_weight=1.5), log=lambda *_: None)


def test_streamed_features_train_the_same_drafter(target_dir, tmp_path):
    """Features and labels recomputed per step (memory independent of the data size) are the tensors
    the stored path keeps, so the run is the same step for step (up to the target forward's batch
    shape: the stored pass runs chunks of 16 sequences, the streamed one each step's batch)."""
    cache = str(tmp_path / "cache")
    kw = dict(steps=12, eval_sequences=0, soft_label_topk=8, cache_dir=cache, threads=1)
    stored_lines, streamed_lines = [], []
    stored = train_draft(_config(target_dir, tmp_path / "stored", **kw), log=stored_lines.append)
    streamed = train_draft(_config(target_dir, tmp_path / "streamed", stream_features=True, **kw),
                           log=streamed_lines.append)
    assert any("features streamed per step" in line for line in streamed_lines)
    assert not any("features streamed" in line for line in stored_lines)
    assert streamed["first_loss"] == pytest.approx(stored["first_loss"], rel=1e-3)
    assert streamed["final_loss"] == pytest.approx(stored["final_loss"], rel=1e-2)
    from safetensors.torch import load_file

    a = load_file(tmp_path / "stored" / "model.safetensors")
    b = load_file(tmp_path / "streamed" / "model.safetensors")
    assert a.keys() == b.keys()
    worst = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert worst < 0.02, worst  # bf16 weights after 12 steps, lr 2e-3


def test_a_larger_run_extends_a_smaller_cache_exactly(target_dir, tmp_path):
    from dspine.replica.models.loader import load_target
    from dspine.replica.tokenizer import Tokenizer
    from dspine.training.draft.data import distillation_data

    target, tokenizer = load_target(target_dir).eval(), Tokenizer.from_dir(target_dir)
    cfg = _config(target_dir, tmp_path)

    def data(count, cache, settings, lines):
        return distillation_data(target, tokenizer, "train", count, cfg, 0, cache, lines.append, settings)

    scratch, _ = data(48, None, None, [])
    small, _ = data(32, tmp_path / "c" / "train-a.safetensors", "S", [])
    lines_other = []
    data(48, tmp_path / "c" / "train-b.safetensors", "T", lines_other)  # other settings: from scratch
    lines = []
    extended, prompt_len = data(48, tmp_path / "c" / "train-c.safetensors", "S", lines)
    assert any("first 32 sequences" in line for line in lines)
    assert not any("first" in line for line in lines_other)
    assert sum("generated" in line for line in lines) == 1  # one batch of 16, not three
    assert torch.equal(small, scratch[:32]) and torch.equal(extended, scratch)
    assert prompt_len.tolist() == [16] * 16 + [24] * 16 + [16] * 16


# ------------------------------------------------------------------ the sampled drafter's recipe
def test_sampled_continuations_are_seeded_per_batch_and_extend_their_cache(target_dir, tmp_path):
    """Sampled continuations draw from one seeded generator per generation batch: the same run twice is
    the same data, a larger run starts from a smaller cache exactly, and the tokens are not the greedy ones."""
    from dspine.replica.models.loader import load_target
    from dspine.replica.tokenizer import Tokenizer
    from dspine.training.draft.data import distillation_data

    target, tokenizer = load_target(target_dir).eval(), Tokenizer.from_dir(target_dir)
    sampled_cfg = _config(target_dir, tmp_path, continuation_temperature=0.7, soft_label_topk=8)

    def data(cfg, count, cache=None, settings=None, lines=None):
        return distillation_data(target, tokenizer, "train", count, cfg, 0, cache,
                                 (lines if lines is not None else []).append, settings)[0]

    scratch = data(sampled_cfg, 48)
    assert torch.equal(scratch, data(sampled_cfg, 48))
    greedy = data(_config(target_dir, tmp_path), 48)
    prompt_len = 16  # the first batch's prompts: identical in both, continuations not
    assert torch.equal(scratch[:16, :prompt_len], greedy[:16, :prompt_len])
    assert (scratch[:, prompt_len:] != greedy[:, prompt_len:]).float().mean() > 0.3
    small = data(sampled_cfg, 32, tmp_path / "c" / "train-a.safetensors", "S")
    lines = []
    extended = data(sampled_cfg, 48, tmp_path / "c" / "train-b.safetensors", "S", lines)
    assert any("first 32 sequences" in line for line in lines)
    assert torch.equal(small, scratch[:32]) and torch.equal(extended, scratch)


def test_soft_labels_at_a_temperature_are_the_target_distribution_at_it():
    """at_blocks(T) is softmax(logits / T) restricted to the stored top k and renormalised (a sampled request
    at T accepts against exactly that distribution); the stored log-probabilities are those of T = 1."""
    from dspine.training.draft.labels import SoftLabels

    g = torch.Generator().manual_seed(1)
    n, length, k, vocab, T = 2, 30, 6, 40, 0.7
    logits = 3 * torch.randn(n, length, vocab, generator=g)
    top = logits.log_softmax(-1).topk(k, dim=-1)
    soft = SoftLabels(top.indices.int(), top.values.float().bfloat16())
    anchors = torch.tensor([[2, 11], [0, 17]])
    ids, probs = soft.at_blocks(anchors, block_size=5, temperature=T)
    position = anchors[..., None] + torch.arange(4)  # row k reads position a + k - 1
    expected = (logits / T).softmax(-1)
    expected = expected.gather(-1, top.indices)  # [n, L, k]
    expected = expected / expected.sum(-1, keepdim=True)
    want = expected.gather(1, position.flatten(1)[..., None].expand(-1, -1, k)).view(*position.shape, k)
    torch.testing.assert_close(probs, want, atol=2e-2, rtol=0)  # bf16 storage
    assert not torch.allclose(probs, soft.at_blocks(anchors, block_size=5)[1], atol=2e-2)  # T matters


def test_expected_sampled_acceptance_is_sum_of_min_p_q_chained_over_rows():
    """The recipe's sampled-acceptance statistic against a brute-force computation over the whole
    vocabulary: q is the tail's softmax(tail / T) over the parallel logits' top-K candidates (zero
    elsewhere), a row accepts with sum_x min(p(x), q(x)), the expected length chains the rows."""
    from dspine.training.draft.losses import _expected_sampled_accept

    g = torch.Generator().manual_seed(2)
    shape, vocab, K, T = (2, 3, 4), 12, 5, 0.7
    logits, tail = torch.randn(*shape, vocab, generator=g), torch.randn(*shape, vocab, generator=g)
    p = (2 * torch.randn(*shape, vocab, generator=g)).softmax(-1)
    ids = torch.arange(vocab).expand(*shape, vocab)  # the target's "top k" is the whole vocabulary here
    got = _expected_sampled_accept(logits, tail, ids, p, T, K)
    expected_lengths = []
    for b in range(shape[0]):
        for a in range(shape[1]):
            length, alive = 0.0, 1.0
            for row in range(shape[2]):
                cand = logits[b, a, row].topk(K).indices
                q = torch.zeros(vocab)
                q[cand] = (tail[b, a, row, cand] / T).softmax(-1)
                alive *= torch.minimum(p[b, a, row], q).sum().item()
                length += alive
            expected_lengths.append(length)
    assert got.item() == pytest.approx(sum(expected_lengths) / len(expected_lengths), rel=1e-5)


def test_held_out_sampled_blocks_chain_min_p_q_over_the_full_distribution(target_dir):
    """The held-out sampled figure against a brute-force loop: row t of the block at anchor a reads the
    target's FULL distribution after x[..a+t-1] (not renormalised over a top k, which overstates it;
    not one position off), q is the tail's softmax over the parallel logits' top-K at the temperature."""
    from dspine.replica.models.dspine_checkpoint import init_random_drafter
    from dspine.replica.models.dspine_config import DraftArgs
    from dspine.replica.models.loader import load_target
    from dspine.training.draft.evaluate import expected_sampled_blocks, target_probabilities
    from dspine.training.draft.losses import tail_hidden
    from dspine.training.draft.target_pass import target_pass

    target = load_target(target_dir)
    args = DraftArgs.for_target(target.args, **dict(TINY_DRAFTER))
    drafter = init_random_drafter(target, args, seed=3).eval()
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, target.args.vocab_size, (3, 40), generator=g)
    T, prompt_len, new_tokens, BS, K = 0.7, 12, 6, args.block_size, args.head_topk
    features, _, _ = target_pass(target, tokens, tuple(args.feature_layers), dtype=torch.float32)
    probs = target_probabilities(target, tokens, T)
    got = expected_sampled_blocks(drafter, features, tokens, probs, prompt_len, new_tokens, T)
    lengths, row1 = [], []
    with torch.no_grad():
        for b in range(tokens.shape[0]):
            for a in range(prompt_len, prompt_len + new_tokens):
                out = drafter.forward_train(features[b : b + 1], tokens[b : b + 1], torch.tensor([[a]]))
                preds = tokens[b, a : a + BS - 1].view(1, 1, -1)
                logits = drafter.logits(out.hidden[:, :, 1:])[0, 0]
                tail = drafter.logits(tail_hidden(drafter, out, preds))[0, 0]
                length, alive = 0.0, 1.0
                for row in range(BS - 1):
                    cand = logits[row].topk(K).indices
                    q = torch.zeros(target.args.vocab_size)
                    q[cand] = (tail[row, cand] / T).softmax(-1)
                    p = (target(tokens[b : b + 1, : a + row + 1]).logits[0, -1].float() / T).softmax(-1)
                    alpha = torch.minimum(p, q).sum().item()
                    row1 += [alpha] if row == 0 else []
                    alive *= alpha
                    length += alive
                lengths.append(length)
    assert got["blocks"] == len(lengths)
    assert got["block_accept_expected"] == pytest.approx(sum(lengths) / len(lengths), rel=1e-4)
    assert got["row_accept"][0] == pytest.approx(sum(row1) / len(row1), abs=1e-4)


def test_soft_labels_count_on_rows_past_the_greedy_path():
    """The soft label is the target's distribution after the true prefix, defined after any prefix: with
    soft labels only, the loss does not depend on the greedy labels (a sampled continuation leaves the
    greedy path at once, which masks every later greedy label); the greedy part still masks those rows."""
    from dspine.replica.models.dspine_checkpoint import init_random_drafter
    from dspine.replica.models.dspine_config import DraftArgs
    from dspine.replica.models.target_config import TargetArgs
    from dspine.training.draft.labels import SoftLabels
    from dspine.training.draft.losses import block_losses

    torch.manual_seed(0)
    target_args = TargetArgs.from_name("tiny")
    drafter = init_random_drafter(target_args, DraftArgs.for_target(target_args, window=64))
    F_, H, V, BS = len(drafter.args.feature_layers), target_args.hidden_size, target_args.vocab_size, drafter.args.block_size
    n, length = 2, BS + 24
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, V, (n, length), generator=g)
    features = torch.randn(n, length, F_, H, generator=g)
    top = torch.randn(n, length, V, generator=g).log_softmax(-1).topk(8, dim=-1)
    soft = SoftLabels(top.indices.int(), top.values.bfloat16())
    anchors = torch.tensor([[3, 8], [5, 1]])
    weights = row_weights(BS - 1, 7.0)
    on_path = torch.cat([tokens[:, 1:], tokens[:, :1]], dim=1)  # greedy == the next token: every row valid
    off_path = torch.randint(0, V, (n, length), generator=g)  # rows past the first departure masked
    with torch.no_grad():
        soft_only = [block_losses(drafter, features, tokens, greedy, anchors, weights, soft, 1.0, 0.7)
                     for greedy in (on_path, off_path)]
        hard_only = [block_losses(drafter, features, tokens, greedy, anchors, weights, soft, 0.0, 0.7)
                     for greedy in (on_path, off_path)]
    assert soft_only[0]["main"].item() == pytest.approx(soft_only[1]["main"].item(), rel=1e-6)
    assert soft_only[0]["tail"].item() == pytest.approx(soft_only[1]["tail"].item(), rel=1e-6)
    assert hard_only[1]["main"].item() < 0.5 * hard_only[0]["main"].item()  # most greedy rows masked
    assert 0 <= soft_only[0]["accept_sampled"].item() <= BS - 1  # its value: the brute-force test above


def test_sampled_recipe_starts_from_a_trained_drafter(target_dir, tmp_path):
    """init_from copies every trained weight (the recipe then fine-tunes it); the sampled recipe reports its
    own acceptance statistic, refuses sampled continuations without soft labels, and the CLI's --recipe
    sampled is the config's SAMPLED_RECIPE."""
    from safetensors.torch import load_file

    from dspine.training.draft import SAMPLED_RECIPE

    greedy_dir = tmp_path / "greedy"
    train_draft(_config(target_dir, greedy_dir, steps=10, eval_sequences=0), log=lambda *_: None)
    copied = tmp_path / "copied"
    lines = []
    summary = train_draft(_config(target_dir, copied, steps=0, eval_sequences=0, init_from=str(greedy_dir),
                                  stream_features=True), log=lines.append)
    assert any("initialised from" in line for line in lines)
    a, b = load_file(greedy_dir / "model.safetensors"), load_file(copied / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    # the test's tiny geometry with the recipe's own tail (32 candidates per row)
    sampled = {**SAMPLED_RECIPE, "gen_batch": 16, "soft_label_topk": 8,
               "model_overrides": TINY_DRAFTER + SAMPLED_RECIPE["model_overrides"]}
    summary = train_draft(_config(target_dir, tmp_path / "sampled", steps=6, eval_sequences=4,
                                  init_from=str(greedy_dir), **sampled), log=lambda *_: None)
    assert 0 < summary["final_train_accept_sampled"] <= 15
    # and its held-out figure, on text the target sampled at the recipe's temperature
    assert load_draft_args(tmp_path / "sampled").head_topk == 32
    held_out = summary["heldout_sampled"]
    assert held_out["temperature"] == 0.7 and held_out["blocks"] == 4 * 24
    assert 0 < held_out["block_accept_expected"] <= 15
    with pytest.raises(ValueError, match="soft_label_topk"):
        train_draft(_config(target_dir, tmp_path / "bad", continuation_temperature=0.7), log=lambda *_: None)
