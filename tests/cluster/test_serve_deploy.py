"""`dspine deploy` (strict check + `serve deploy`) of the shipped config on a `ray start --head` cluster."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dspine.cluster.cli import main
from dspine.cluster.client import DSpineClient
from dspine.cluster.serve_config import SHIPPED_CONFIG
from dspine_testing.ray_cluster import free_port, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
BIN = Path(sys.executable).parent


def _config_on_ports(tmp_path, grpc_port: int, http_port: int) -> Path:
    doc = yaml.safe_load(SHIPPED_CONFIG.read_text())
    doc["grpc_options"]["port"] = grpc_port
    doc["http_options"]["port"] = http_port
    args = doc["applications"][0]["args"]
    args.update(grpc_port=grpc_port, http_port=http_port)
    args["replicas"]["num_replicas"] = 1  # one replica is enough to show the deploy path
    path = tmp_path / "serve_config.yaml"
    path.write_text(yaml.safe_dump(doc))
    return path


def test_dspine_deploy_on_ray_start_head(tmp_path):
    gcs, dashboard, grpc_port, http_port = (free_port() for _ in range(4))
    config = _config_on_ports(tmp_path, grpc_port, http_port)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    head = subprocess.Popen([str(BIN / "ray"), "start", "--head", f"--port={gcs}", f"--dashboard-port={dashboard}",
                             "--dashboard-host=127.0.0.1", "--num-cpus=4", "--block"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    try:
        def dashboard_up():
            import urllib.error
            import urllib.request
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{dashboard}/api/version", timeout=2)
            except urllib.error.HTTPError:
                return True  # answered (token auth refuses anonymous calls)
            except OSError:
                return False
            return True

        wait_for(dashboard_up, 90, "the Ray dashboard")
        assert main(["deploy", str(config), "--address", f"http://127.0.0.1:{dashboard}"]) == 0
        with DSpineClient(f"127.0.0.1:{grpc_port}", timeout=30) as client:
            deadline = time.monotonic() + 120
            while True:
                try:
                    result = client.generate("import os\n", max_new_tokens=8)
                    break
                except Exception:  # noqa: BLE001 - not deployed yet
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(1)
            assert len(result.token_ids) == 8
        status = subprocess.run([str(BIN / "dspine"), "status", "--address", f"127.0.0.1:{gcs}", "--json"],
                                capture_output=True, text=True, timeout=120, env=env)
        assert status.returncode == 0, status.stderr[-2000:]
        report = json.loads(status.stdout)
        assert report["status"] == "RUNNING"
        assert [r["healthy"] for r in report["replicas"]] == [True]
        assert report["replicas"][0]["max_concurrency"] == 8 and report["replicas"][0]["num_finished"] >= 1
    finally:
        head.terminate()
        subprocess.run([str(BIN / "ray"), "stop", "--force"], capture_output=True, timeout=120)
        head.wait(30)
