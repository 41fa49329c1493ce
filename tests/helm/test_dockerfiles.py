"""The images can't be built here (no registry): check what they promise against the chart and the CLI."""

from __future__ import annotations

import json
import re
import tomllib
from pathlib import Path

import pytest
import yaml

from dspine.cluster.cli import build_parser, cluster_config_from_args

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILES = [ROOT / "docker" / "Dockerfile", ROOT / "docker" / "Dockerfile.cpu"]


def _instructions(path: Path) -> dict[str, list[str]]:
    text = path.read_text().replace("\\\n", " ")
    found: dict[str, list[str]] = {}
    for line in text.splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            word, _, rest = line.strip().partition(" ")
            found.setdefault(word.upper(), []).append(rest.strip())
    return found


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_ports_match_the_chart(path):
    values = yaml.safe_load((ROOT / "helm" / "dspine" / "values.yaml").read_text())
    template = (ROOT / "helm" / "dspine" / "templates" / "_helpers.tpl").read_text()
    declared = {int(p) for line in _instructions(path)["EXPOSE"] for p in line.split()}
    fixed = {int(p) for p in re.findall(r"containerPort: (\d+)", template)}
    assert declared == fixed | {values["cluster"]["grpc_port"], values["cluster"]["http_port"]}


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_command_is_a_valid_dspine_serve_on_the_charts_port(path):
    command = json.loads(_instructions(path)["CMD"][0])
    assert command[0] == "dspine"
    config = cluster_config_from_args(build_parser().parse_args(command[1:]))
    assert config.grpc_port == 9000


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_install_lines_name_real_extras(path):
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    runs = " ".join(_instructions(path)["RUN"])
    assert "/opt/dspine/src" in runs
    for extra in re.findall(r"/opt/dspine/src\[([a-z,]+)\]", runs):
        assert set(extra.split(",")) <= extras, extra
    pins = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    if "rayproject/ray:" in path.read_text():  # the base's Ray must be the pinned one
        base = re.search(r"rayproject/ray:(\d+\.\d+\.\d+)", path.read_text()).group(1)
        assert f"ray[serve]=={base}" in pins
