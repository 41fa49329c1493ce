"""Package layout: one import package `dspine`, no top-level `kernels`/`cluster`, layers point one way."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"embedded": "dspine.embedded", "replica": "dspine.replica", "kernels": "dspine.kernels",
           "cluster": "dspine.cluster", "protos": "dspine.protos"}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())


def test_every_package_folder_is_listed():
    listed = set(_pyproject()["tool"]["setuptools"]["packages"])
    found = {"dspine"}
    for folder, package in FOLDERS.items():
        for init in (ROOT / folder).rglob("__init__.py"):
            relative = init.parent.relative_to(ROOT / folder).parts
            found.add(".".join((package, *relative)))
    assert found - listed == set(), "add these to [tool.setuptools] packages in pyproject.toml"


@pytest.mark.parametrize("name", ["kernels", "cluster", "replica", "protos"])
def test_generic_top_level_names_are_not_ours(name, tmp_path):
    # run from elsewhere: from the repository root, `python -c` would see the folders themselves
    code = (f"import importlib.util, sys; spec = importlib.util.find_spec({name!r}); "
            f"print(spec.origin if spec else 'none')")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    assert str(ROOT) not in out.stdout


FORBIDDEN = {"replica": ("ray", "grpc", "opentelemetry", "transformers"),
             "kernels": ("ray", "grpc", "opentelemetry", "transformers")}


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_engine_layers_do_not_import_the_edge(folder):
    pattern = re.compile(r"^\s*(?:from|import)\s+(" + "|".join(FORBIDDEN[folder]) + r")\b", re.M)
    offenders = []
    for path in (ROOT / folder).rglob("*.py"):
        text = path.read_text()
        for match in pattern.finditer(text):
            # bench.py compares against transformers as an optional, dev-only baseline
            if path.name == "bench.py" and match.group(1) == "transformers":
                continue
            offenders.append(f"{path.relative_to(ROOT)}: {match.group(0).strip()}")
    assert offenders == []


def test_cli_entry_point_is_declared():
    assert _pyproject()["project"]["scripts"]["dspine"] == "dspine.cluster.cli:main"


def test_engine_runs_without_triton(tmp_path):
    """`pip install .` on a CPU machine has no triton: every kernel module must import without it
    and the engine must still decode speculatively (the README's run command)."""
    script = tmp_path / "no_triton.py"
    script.write_text(
        "import sys\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name == 'triton' or name.startswith('triton.'):\n"
        "            raise ImportError('triton blocked for this test')\n"
        "sys.meta_path.insert(0, Block())\n"
        "import torch\n"
        "from dspine import embedded, kernels\n"
        "from dspine.replica import Engine, EngineConfig, SamplingParams\n"
        "assert 'triton' not in sys.modules\n"
        "engine = Engine.from_pretrained(embedded.TARGET_DIR, embedded.DRAFT_DIR, EngineConfig(device='cpu'))\n"
        "prompt = engine.tokenizer.encode('def fibonacci(n):')\n"
        "params = SamplingParams(max_new_tokens=12, ignore_eos=True)\n"
        "spec = engine.generate(prompt, params, speculative=True)\n"
        "base = engine.generate(prompt, params, speculative=False)\n"
        "assert spec.token_ids == base.token_ids and spec.stats.spec.num_cycles >= 1\n"
        "print('ok')\n")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().endswith("ok")
