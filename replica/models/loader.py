"""Load and save the target in HF format (config.json + safetensors), no pickle, no remote code.

- Layouts read: `Qwen3_5ForCausalLM` / `Qwen3ForCausalLM` (`model.` prefix),
  the multimodal wrapper `Qwen3_5ForConditionalGeneration` (`text_config`,
  `model.language_model.` prefix; vision `model.visual.*` and `mtp.*` skipped),
  single-file or sharded (`model.safetensors.index.json`) safetensors.
- All checkpoint renames live in `hf_to_local()`; the model is built on `meta`
  and filled with `load_state_dict(assign=True)`.
- `save_target()` writes `Qwen3_5ForCausalLM` / `Qwen3ForCausalLM` layout.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from .target import TargetModel
from .target_config import TargetArgs

_TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "model.")
_SKIPPED_PREFIXES = ("model.visual.", "visual.", "mtp.", "model.mtp.")


def hf_to_local(name: str) -> str | None:
    """HF tensor name -> our parameter name, or None for tensors the text model does not use."""
    if name.startswith(_SKIPPED_PREFIXES):
        return None
    if name == "lm_head.weight":
        return name
    for prefix in _TEXT_PREFIXES:
        if name.startswith(prefix):
            return name[len(prefix):]
    return None


def local_to_hf(name: str) -> str:
    return name if name.startswith("lm_head.") else "model." + name


def _safetensors_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [path / f for f in sorted(set(weight_map.values()))]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {path} (pickle checkpoints are not supported)")
    return files


def load_target(path, device="cpu", dtype: torch.dtype = torch.float32) -> TargetModel:
    """Read config.json + safetensors from directory `path`; the args are on `model.args`."""
    path = Path(path)
    config = json.loads((path / "config.json").read_text())
    args = TargetArgs.from_hf_config(config)
    with torch.device("meta"):
        model = TargetModel(args)
    expected = model.state_dict()
    state: dict[str, torch.Tensor] = {}
    for file in _safetensors_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                local = hf_to_local(name)
                if local is None or local not in expected:
                    if local is not None and not (local == "lm_head.weight" and args.tie_word_embeddings):
                        raise ValueError(f"{file.name}: tensor {name!r} has no place in a {args.model_type} target")
                    continue
                t = f.get_tensor(name)
                if tuple(t.shape) != tuple(expected[local].shape):
                    raise ValueError(f"{file.name}: {name!r} has shape {tuple(t.shape)}, expected "
                                     f"{tuple(expected[local].shape)} from config.json")
                state[local] = t.to(device=device, dtype=dtype)
    missing = sorted(set(expected) - set(state))
    if missing:
        raise ValueError(f"checkpoint {path} lacks {len(missing)} tensors, e.g. {missing[:5]}")
    model.load_state_dict(state, strict=True, assign=True)
    model.reset_buffers(torch.device(device))
    return model.eval()


def save_target(model: TargetModel, path, max_shard_bytes: int | None = None) -> None:
    """Write config.json + model.safetensors (HF names; tied LM head not stored)."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(model.args.to_hf_config(), indent=2) + "\n")
    tensors = {local_to_hf(k): v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    if max_shard_bytes is None:
        save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
        return
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_shard_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name] = t
        size += nbytes
    shards.append(current)
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(path / fname), metadata={"format": "pt"})
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
