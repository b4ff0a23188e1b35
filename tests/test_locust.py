"""A seconds-long headless Locust run against a real mesh: the locustfile works and nothing fails.

Locust patches sockets with gevent, so it runs as its own process (never imported here)."""

import csv
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.services.servers import running_server

LOCUSTFILE = Path(__file__).resolve().parent.parent / "bench" / "locustfile.py"


def test_headless_locust_smoke_run(tiny_dir, tmp_path):
    locust = shutil.which("locust", path=str(Path(sys.executable).parent))
    if locust is None:
        pytest.skip("locust is not installed (it comes with the dev extra)")
    with running_server(tiny_dir, "E1+P1+D1", tmp_path / "serve.log") as base:
        run = subprocess.run(
            [
                locust,
                "-f",
                str(LOCUSTFILE),
                "--headless",
                "-u",
                "3",
                "-r",
                "3",
                "-t",
                "8s",
                "--host",
                base,
                "--csv",
                str(tmp_path / "locust"),
                "--exit-code-on-error",
                "1",
                "--only-summary",
                "--stop-timeout",
                "20",
            ],
            capture_output=True,
            text=True,
            timeout=120,
            env={"EPDMESH_MAX_TOKENS": "8", "PATH": str(Path(sys.executable).parent)},
        )
    assert run.returncode == 0, run.stderr[-3000:]
    rows = {(r["Type"], r["Name"]): r for r in csv.DictReader(open(tmp_path / "locust_stats.csv"))}
    chat = rows[("POST", "chat (stream)")]
    assert int(chat["Request Count"]) > 0 and int(chat["Failure Count"]) == 0, chat
    ttft = rows[("TTFT", "chat (stream)")]
    assert int(ttft["Request Count"]) > 0 and 0 < float(ttft["Median Response Time"]) < 60_000
