"""HF-format checkpoints (single, sharded, multimodal wrapper) load through `load_target`; `save_target` round-trips."""
import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from dspine.replica.models.loader import hf_to_local, load_target, save_target
from dspine.replica.models.target import TargetArgs, TargetModel

transformers = pytest.importorskip("transformers")

TEXT = dict(vocab_size=160, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=8, layer_types=["linear_attention"] * 3 + ["full_attention"],
            linear_conv_kernel_dim=3, linear_key_head_dim=8, linear_value_head_dim=8, linear_num_key_heads=2,
            linear_num_value_heads=4, tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})


@pytest.fixture(scope="module")
def hf():
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**TEXT))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.15)
    return model.eval()


IDS = torch.tensor([[5, 17, 99, 3, 42, 42, 7]])


def rel_rms(a, b):
    return ((a - b).pow(2).mean().sqrt() / b.pow(2).mean().sqrt()).item()


def check_same_logits(hf, ours):
    with torch.no_grad():
        ref = hf(IDS).logits
    assert rel_rms(ours(IDS).logits, ref) < 1e-4


def test_single_file(hf, tmp_path):
    hf.save_pretrained(tmp_path, safe_serialization=True)
    model = load_target(tmp_path)
    assert model.args.layer_types == tuple(TEXT["layer_types"]) and model.args.rotary_dim == 2
    assert not any(p.is_meta for p in model.parameters()) and not model.inv_freq.is_meta
    check_same_logits(hf, model)


def test_sharded(hf, tmp_path):
    hf.save_pretrained(tmp_path, safe_serialization=True, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    check_same_logits(hf, load_target(tmp_path))


def test_multimodal_wrapper_layout(hf, tmp_path):
    """Qwen3_5ForConditionalGeneration layout: text_config, model.language_model.* names, vision + mtp skipped."""
    src = tmp_path / "src"
    hf.save_pretrained(src, safe_serialization=True)
    text_cfg = json.loads((src / "config.json").read_text())
    tensors = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in load_file(src / "model.safetensors").items()}
    tensors["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    tensors["mtp.fc.weight"] = torch.zeros(2, 2)
    dst = tmp_path / "mm"
    dst.mkdir()
    half = len(tensors) // 2
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    for fname, keys in shards.items():
        save_file({k: tensors[k].contiguous() for k in keys}, dst / fname)
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (dst / "model.safetensors.index.json").write_text(json.dumps(index))
    text_cfg.pop("architectures", None)
    wrapper = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
               "text_config": text_cfg, "vision_config": {"depth": 1}, "tie_word_embeddings": False}
    (dst / "config.json").write_text(json.dumps(wrapper))
    check_same_logits(hf, load_target(dst))


def test_save_target_roundtrip_through_transformers(hf, tmp_path):
    hf.save_pretrained(tmp_path / "a", safe_serialization=True)
    ours = load_target(tmp_path / "a")
    save_target(ours, tmp_path / "b")
    back = transformers.Qwen3_5ForCausalLM.from_pretrained(tmp_path / "b").eval()
    check_same_logits(back, ours)
    save_target(ours, tmp_path / "c", max_shard_bytes=20_000)
    again = load_target(tmp_path / "c")
    for (n1, p1), (n2, p2) in zip(ours.state_dict().items(), again.state_dict().items()):
        assert n1 == n2 and torch.equal(p1, p2)


def test_save_target_tiny_preset_loads_in_transformers(tmp_path):
    torch.manual_seed(0)
    model = TargetModel.from_name("tiny-qwen3")
    save_target(model, tmp_path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    with torch.no_grad():
        assert rel_rms(model(IDS).logits, back(IDS).logits) < 1e-4


def test_dtype_and_tied_head(hf, tmp_path):
    cfg = transformers.Qwen3_5TextConfig(**{**TEXT, "tie_word_embeddings": True})
    tied = transformers.Qwen3_5ForCausalLM(cfg)
    tied.save_pretrained(tmp_path, safe_serialization=True)
    model = load_target(tmp_path, dtype=torch.bfloat16)
    assert model.lm_head is None and model.lm_head_weight is model.embed_tokens.weight
    assert model.embed_tokens.weight.dtype == torch.bfloat16


def test_errors(hf, tmp_path):
    hf.save_pretrained(tmp_path, safe_serialization=True)
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.norm.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match="lacks 1 tensors"):
        load_target(tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="pickle"):
        load_target(tmp_path)
    with pytest.raises(ValueError, match="model_type"):
        TargetArgs.from_hf_config({"model_type": "llama"})


def test_hf_to_local_names():
    assert hf_to_local("model.layers.0.mlp.up_proj.weight") == "layers.0.mlp.up_proj.weight"
    assert hf_to_local("model.language_model.norm.weight") == "norm.weight"
    assert hf_to_local("lm_head.weight") == "lm_head.weight"
    assert hf_to_local("model.visual.blocks.0.norm1.weight") is None
    assert hf_to_local("mtp.layers.0.mlp.up_proj.weight") is None


def test_presets():
    big = TargetArgs.from_name("Qwen3.8-27B")
    assert (big.num_layers, big.hidden_size, big.vocab_size) == (64, 5120, 248_320)
    assert big.full_layer_ids == tuple(range(3, 64, 4)) and big.feature_layers == (1, 16, 31, 46, 61)
    with torch.device("meta"):
        n = sum(p.numel() for p in TargetModel(big).parameters())
    assert 26e9 < n < 28e9
    old_style = TargetArgs.from_hf_config({"model_type": "qwen3", "vocab_size": 10, "hidden_size": 8,
                                           "intermediate_size": 8, "num_hidden_layers": 1,
                                           "num_attention_heads": 2, "rope_theta": 5e5})
    assert old_style.rope_theta == 5e5 and old_style.rotary_dim == 4 and old_style.num_kv_heads == 2
    with pytest.raises(ValueError, match="unknown target preset"):
        TargetArgs.from_name("nope")
