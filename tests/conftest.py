"""Test set-up: Triton runs in its interpreter where there is no GPU.

TRITON_INTERPRET must be set before any kernel module is imported (triton.jit reads it when a
kernel is defined), so it is set here, at collection time, and never in library code.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def sigint_deliverable():
    """For tests that Ctrl-C a job subprocess: a shell starts background commands with SIGINT ignored, a child
    inherits that, and Python then installs no KeyboardInterrupt handler, so the test would depend on how pytest was
    launched. Handled (not ignored) here, SIGINT reaches the children's Python at its default."""
    import signal

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.fixture(scope="session")
def ray_cluster(tmp_path_factory):
    """One local Ray head for the rollout tests (`ray start --head`), shared by the in-process pool tests, the
    job subprocesses (`ray.address=...`) and `ray job submit` (through its dashboard): a Ray start-up costs ~10 s
    on 2 cores, so the tests pay it once. Yields {"gcs": host:port, "dashboard": http URL}."""
    import shutil
    import socket
    import subprocess

    def free_port() -> int:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            return s.getsockname()[1]

    port, dashboard_port = free_port(), free_port()
    ray_bin = shutil.which("ray")
    assert ray_bin, "the ray CLI is not installed"
    # Token auth (on by default in Ray 2.60) is for shared clusters; this one is private to the test run, and the
    # job subprocesses inherit these variables.
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    env = dict(os.environ)
    subprocess.run([ray_bin, "start", "--head", f"--port={port}", "--num-cpus=4", "--include-dashboard=true",
                    "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard_port}", "--disable-usage-stats"],
                   check=True, env=env, capture_output=True, timeout=180)
    try:
        yield {"gcs": f"127.0.0.1:{port}", "dashboard": f"http://127.0.0.1:{dashboard_port}"}
    finally:
        subprocess.run([ray_bin, "stop", "--force"], env=env, capture_output=True, timeout=120)


@pytest.fixture(scope="session")
def ray_head(ray_cluster) -> str:
    """The shared head's GCS address."""
    return ray_cluster["gcs"]
