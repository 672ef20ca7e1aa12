"""The README's example and the getting-started page's session, run for real on local clusters.

- The README's Python example (a LocalCluster of two nodes, a 2 x 8 gang through the SDK) runs as it is written,
  with its state directory moved into the test's.
- The getting-started page's "A first gang" and "A first preemption": its `phalanx cluster up` line starts the
  cluster (on a free port and a state directory of the test's: the only changes), then its shell blocks run through
  bash as written, with the cluster's address for 127.0.0.1:50051 and the test's directory for /tmp/first-preemption.
  When `jq` is not installed, a stand-in that reads `-r .FIELD` is put on PATH.

Not run: `./scripts/demo` (tests/e2e/test_demo.py runs `phalanx demo`, what it executes) and `./scripts/test` (the
whole suite); tests/unit/test_docs.py parses every documented command and runs the `--help` forms.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = [pytest.mark.timeout(240)]

ROOT = Path(__file__).resolve().parents[2]
VENV_BIN = Path(sys.executable).parent


def _blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", path.read_text(encoding="utf-8"), re.S | re.M)


def _env(extra_path: Path | None = None) -> dict[str, str]:
    env = dict(os.environ)
    path = [str(VENV_BIN), env.get("PATH", "")]
    if extra_path is not None:
        path.insert(0, str(extra_path))
    env["PATH"] = os.pathsep.join(path)
    for name in ("PHALANX_TOKEN", "PHALANX_TLS_CA", "PHALANX_TLS_CERT", "PHALANX_TLS_KEY"):
        env.pop(name, None)
    return env


def test_readme_python_example_runs(tmp_path):
    (example,) = _blocks(ROOT / "README.md", "python")
    assert 'state_dir="/tmp/phalanx-hello"' in example
    code = example.replace('"/tmp/phalanx-hello"', repr(str(tmp_path / "hello")))
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=200, cwd=tmp_path, env=_env()
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert proc.stdout.startswith("SUCCEEDED 2 x 8 GPUs on 2 nodes under one leaf"), proc.stdout


def _jq_stand_in(directory: Path) -> Path | None:
    """A `jq -r .FIELD` for hosts without jq (the page's only use of it); None where jq is installed."""
    if shutil.which("jq"):
        return None
    directory.mkdir()
    script = directory / "jq"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, sys\n"
        "assert sys.argv[1] == '-r' and sys.argv[2].startswith('.'), sys.argv\n"
        "print(json.load(sys.stdin)[sys.argv[2][1:]])\n"
    )
    script.chmod(0o755)
    return directory


def test_getting_started_first_gang_and_first_preemption(tmp_path):
    page = ROOT / "docs" / "getting-started.md"
    text = page.read_text(encoding="utf-8")
    gang = text.split("## A first gang", 1)[1]
    blocks = _blocks_of(gang)
    cluster_block, gang_block, preemption_block = blocks[0], blocks[1], blocks[2]

    # The cluster, from the page's own command line: a free port and the test's state directory.
    (up_line,) = [line for line in cluster_block.splitlines() if "cluster up" in line]
    argv = shlex.split(up_line, comments=True)
    assert argv[:3] == ["phalanx", "cluster", "up"], argv
    state = tmp_path / "first"
    i = argv.index("--state-dir")
    argv[i + 1] = str(state)
    argv += ["--port", "0"]
    out = tmp_path / "cluster.log"
    with out.open("w") as log:
        cluster = subprocess.Popen(
            [str(VENV_BIN / "phalanx"), *argv[1:]],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env=_env(),
            start_new_session=True,
        )
    try:
        address = _wait_for_cluster(state, cluster, out)
        script = "set -euo pipefail\n" + gang_block + preemption_block
        script = script.replace("127.0.0.1:50051", address)
        results = tmp_path / "first-preemption"
        script = script.replace("/tmp/first-preemption", str(results))
        proc = subprocess.run(
            ["bash", "-c", script],
            capture_output=True,
            text=True,
            timeout=180,
            cwd=ROOT,
            env=_env(_jq_stand_in(tmp_path / "bin")),
        )
        output = proc.stdout + proc.stderr
        assert proc.returncode == 0, output[-6000:] + out.read_text()[-3000:]
        # A first gang: 16 ranks ran and their output came back.
        assert "first SUCCEEDED" in output, output[-4000:]
        assert "[rank 15] rank 15 of 16" in output, output[-4000:]
        # A first preemption: the trainer was preempted, the urgent gang ran, the trainer resumed and counted exactly.
        assert re.search(r"trainer PREEMPTING", output), output[-4000:]
        assert "urgent SUCCEEDED" in output and "trainer SUCCEEDED" in output, output[-4000:]
        (rank0,) = results.glob("*/rank-0.json")
        result = json.loads(rank0.read_text())
        assert result["count"] == 100 and result["attempt"] >= 2, result  # resumed (or, preempted early, restarted)
    finally:
        os.killpg(cluster.pid, signal.SIGTERM)
        try:
            cluster.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(cluster.pid, signal.SIGKILL)
            cluster.wait(timeout=10)


def _blocks_of(markdown: str) -> list[str]:
    return re.findall(r"^```bash\n(.*?)^```", markdown, re.S | re.M)


def _wait_for_cluster(state: Path, cluster: subprocess.Popen, log: Path) -> str:
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if cluster.poll() is not None:
            pytest.fail(f"phalanx cluster up exited {cluster.returncode}: {log.read_text()[-3000:]}")
        info = state / "cluster.json"
        if info.exists() and "running; Ctrl-C" in log.read_text():
            return str(json.loads(info.read_text())["scheduler"])
        time.sleep(0.3)
    pytest.fail(f"the cluster did not come up in 90 s: {log.read_text()[-3000:]}")
