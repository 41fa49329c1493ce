"""Package layout: one import package `dspine`, no top-level `kernels`/`cluster`, layers point one way."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = {"embedded": "dspine.embedded", "replica": "dspine.replica", "kernels": "dspine.kernels",
           "cluster": "dspine.cluster", "protos": "dspine.protos", "training": "dspine.training",
           "benchmarks": "dspine.benchmarks"}


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
    # A third-party package may own the name (transformers>=5.25 installs Hugging Face's `kernels`,
    # into a venv that CI keeps inside the repository), so the test asks who owns the module, not
    # only where it lies: not our source folder, and not a top-level name our distribution installs.
    # Run from elsewhere: from the repository root, `python -c` would see the folders themselves.
    code = (f"import importlib.metadata, importlib.util, json; spec = importlib.util.find_spec({name!r}); "
            f"owners = importlib.metadata.packages_distributions().get({name!r}, []); "
            f"print(json.dumps([spec.origin if spec else None, owners]))")
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=True)
    origin, owners = json.loads(out.stdout)
    assert "dspine-serve" not in owners and "dspine_serve" not in owners, f"dspine-serve installs a top-level {name!r}"
    if origin is not None:
        assert not Path(origin).resolve().is_relative_to(ROOT / name), f"{name!r} resolves to our folder: {origin}"


FORBIDDEN = {"replica": ("ray", "grpc", "opentelemetry", "transformers"),
             "kernels": ("ray", "grpc", "opentelemetry", "transformers")}
# Training and the benches are not serving: no serving package imports them. The CLI's `train` and
# `bench` commands do (lazily, inside the command functions).
NOT_SERVING = ("dspine.training", "dspine.benchmarks")
SERVING = ("replica", "kernels", "cluster", "protos", "embedded")
CLI = ("cluster/cli.py", "cluster/cli/")


def _imports(root: Path, folder: str, modules: tuple[str, ...]) -> list[str]:
    """``path: statement`` of each import of ``modules`` (absolute, ``from dspine import x`` or relative
    ``from ..x``) in the .py files under ``root / folder``."""
    names = "|".join(re.escape(m) for m in modules)
    short = "|".join(re.escape(m.split(".", 1)[1]) for m in modules if m.startswith("dspine."))
    forms = [rf"(?:from|import)\s+(?:{names})\b"]
    if short:
        forms += [rf"from\s+dspine\s+import\s+(?:{short})\b", rf"from\s+\.\.+(?:{short})\b"]
    pattern = re.compile(r"^\s*(?:" + "|".join(forms) + ")", re.M)
    found = []
    for path in sorted((root / folder).rglob("*.py")):
        found += [f"{path.relative_to(root).as_posix()}: {m.group(0).strip()}" for m in pattern.finditer(path.read_text())]
    return found


@pytest.mark.parametrize("folder", sorted(FORBIDDEN))
def test_engine_layers_do_not_import_the_edge(folder):
    assert _imports(ROOT, folder, FORBIDDEN[folder]) == []


def test_transformers_is_imported_only_by_its_dev_only_baseline():
    offenders = [hit for folder in FOLDERS for hit in _imports(ROOT, folder, ("transformers",))]
    assert {hit.split(":")[0] for hit in offenders} == {"benchmarks/transformers_baseline.py"}


@pytest.mark.parametrize("folder", SERVING)
def test_serving_packages_do_not_import_training_or_benchmarks(folder):
    offenders = [hit for hit in _imports(ROOT, folder, NOT_SERVING) if not hit.startswith(CLI)]
    assert offenders == []


def test_the_import_scan_finds_every_form(tmp_path):
    # what the two tests above would miss if the pattern were too narrow
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text("import os\nfrom dspine.training.draft import train_draft\n"
                                           "def f():\n    from ..benchmarks import engine\n")
    (tmp_path / "pkg" / "b.py").write_text("from dspine import benchmarks\nimport dspine.trainingx\n")
    assert _imports(tmp_path, "pkg", NOT_SERVING) == [
        "pkg/a.py: from dspine.training", "pkg/a.py: from ..benchmarks", "pkg/b.py: from dspine import benchmarks"]


def test_the_engine_loads_without_training_or_benchmarks():
    code = ("import sys; from dspine.replica import Engine; import dspine.kernels, dspine.embedded; "
            "print(sorted(m for m in sys.modules if m.startswith(('dspine.training', 'dspine.benchmarks'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"


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
