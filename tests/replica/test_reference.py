"""Greedy target-only decoding: oracle vs transformers' generate, stateful loop vs oracle, batch vs alone."""
import pytest
import torch

from dspine.replica.models.loader import load_target
from dspine.replica.models.target import TargetModel
from dspine.replica.reference import reference_generate

transformers = pytest.importorskip("transformers")

V = 211


@pytest.fixture(scope="module", params=["qwen3_5", "qwen3"])
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    common = dict(vocab_size=V, hidden_size=48, intermediate_size=64, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16)
    if request.param == "qwen3_5":
        cfg = transformers.Qwen3_5TextConfig(
            num_hidden_layers=4, layer_types=["linear_attention", "linear_attention", "full_attention",
                                              "linear_attention"],
            linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=12, linear_num_key_heads=2,
            linear_num_value_heads=4, **common)
        hf = transformers.Qwen3_5ForCausalLM(cfg)
    else:
        hf = transformers.Qwen3ForCausalLM(transformers.Qwen3Config(num_hidden_layers=2, **common))
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.2)
    path = tmp_path_factory.mktemp(request.param)
    hf.eval().save_pretrained(path, safe_serialization=True)
    return hf, load_target(path)


def stateful_greedy(model: TargetModel, prompts: list[list[int]], n: int) -> list[list[int]]:
    """Batched prefill (different lengths), then one token per request per step."""
    states = [model.new_state() for _ in prompts]
    out = model.forward_step([torch.tensor(p) for p in prompts], states)
    model.commit(states, [len(p) for p in prompts])
    gen = [[int(out.logits[b, len(p) - 1].argmax())] for b, p in enumerate(prompts)]
    for _ in range(n - 1):
        out = model.forward_step(torch.tensor([[g[-1]] for g in gen]), states)
        model.commit(states, [1] * len(states))
        for b, g in enumerate(gen):
            g.append(int(out.logits[b, 0].argmax()))
    return gen


def _transformers_uses_fla_on_cpu(hf) -> bool:
    # With flash-linear-attention installed (the `gpu` extra), transformers' Qwen3.5 runs its Gated
    # DeltaNet through fla's Triton kernels, which need a GPU: the peer is then broken on CPU, not us.
    if torch.cuda.is_available() or type(hf).__name__ != "Qwen3_5ForCausalLM":
        return False
    import importlib.util

    return importlib.util.find_spec("fla") is not None


def test_reference_matches_transformers_generate(pair):
    hf, ours = pair
    if _transformers_uses_fla_on_cpu(hf):
        pytest.skip("flash-linear-attention is installed on a CPU machine: transformers' Qwen3.5 needs a GPU "
                    "then (do not install the gpu extra on CPU machines)")
    prompt = [3, 14, 15, 92, 65, 35]
    with torch.no_grad():
        hf_out = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False, pad_token_id=0,
                             eos_token_id=None)
    expected = hf_out[0, len(prompt):].tolist()
    assert len(expected) == 10
    assert reference_generate(ours, prompt, 10) == expected
    assert stateful_greedy(ours, [prompt], 10) == [expected]


def test_batch_of_eight_equals_alone(pair):
    _, ours = pair
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, V, (n,), generator=g).tolist() for n in (1, 7, 3, 12, 5, 9, 2, 6)]
    together = stateful_greedy(ours, prompts, 8)
    alone = [stateful_greedy(ours, [p], 8)[0] for p in prompts]
    assert together == alone
    assert together[3] == reference_generate(ours, prompts[3], 8)


def test_eos_stops_and_is_kept(pair):
    _, ours = pair
    prompt = [1, 2, 3]
    free = reference_generate(ours, prompt, 6)
    stop = free[2]
    cut = reference_generate(ours, prompt, 6, eos_token_ids=[stop])
    assert cut == free[: free.index(stop) + 1]
    assert reference_generate(ours, prompt, 0) == []
    with pytest.raises(ValueError, match="empty"):
        reference_generate(ours, [], 3)
