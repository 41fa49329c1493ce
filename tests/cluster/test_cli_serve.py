"""`dspine serve --standalone` in a subprocess, driven by `dspine generate --server`."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys

from dspine.cluster.cli import main
from dspine.cluster.client import DSpineClient
from dspine.replica.models.loader import save_target

from .conftest import make_target


def test_serve_standalone_and_generate_via_server(tmp_path, tokenizer_dir, capsys):
    target_dir = tmp_path / "tiny-target"
    save_target(make_target(), target_dir)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, target_dir / name)

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "dspine.cluster.cli", "serve", "--standalone", "--target", str(target_dir),
               "--port", "0", "--device", "cpu", "--dtype", "float32", "--max-concurrency", "2", "--max-seq-len", "64"]
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env) as proc:
        try:
            line = proc.stdout.readline()
            assert "serving on" in line, (line, proc.stderr.read() if proc.poll() is not None else "")
            address = line.strip().rsplit(" ", 1)[-1]
            with DSpineClient(address, timeout=60) as client:
                info = client.info()
                assert (info.target_name, info.max_concurrency, info.max_context, info.has_drafter) == (
                    "tiny-target", 2, 64, False)
                expected = client.generate("def f():", max_new_tokens=3)
            capsys.readouterr()
            assert main(["generate", "--server", address, "--prompt", "def f():", "--max-new-tokens", "3",
                         "--no-spec", "--json"]) == 0
            printed = json.loads(capsys.readouterr().out)
            assert printed["token_ids"] == expected.token_ids and printed["finish_reason"] == expected.finish_reason
        finally:
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(30) == 0, proc.stderr.read()
