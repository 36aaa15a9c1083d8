"""Started as root: bind a privileged port, then serve as an unprivileged user for good."""

from __future__ import annotations

import http.client
import json
import os
import pwd
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from tests.conftest import wait_for_port

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root to start as root")


def privileged_port() -> int:
    for port in range(900, 1000):
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no free privileged port")


def test_binds_443_class_port_then_runs_as_nobody() -> None:
    folder = Path(tempfile.mkdtemp(prefix="migratory-priv-"))
    folder.chmod(0o755)  # the unprivileged user must reach its log and state folders
    port = privileged_port()
    conf = folder / "m.conf"
    conf.write_text(
        f"Listen = 127.0.0.1:{port}\nWorkers = 2\nRunAsUser = nobody\n"
        f"LogFolder = {folder}/logs\nStateFolder = {folder}/state\n"
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "migratory_cli.main", "serve", "-c", str(conf)],
        stderr=subprocess.PIPE,
        start_new_session=True,
    )
    try:
        wait_for_port("127.0.0.1", port, proc=proc)
        nobody = pwd.getpwnam("nobody").pw_uid
        time.sleep(1.0)
        pids = [proc.pid, *map(int, Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split())]
        assert len(pids) == 3
        for pid in pids:
            uids = next(
                line for line in Path(f"/proc/{pid}/status").read_text().splitlines() if line.startswith("Uid:")
            )
            assert uids.split()[1:] == [str(nobody)] * 4, (pid, uids)  # real, effective, saved, fs
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        conn.request("POST", "/publish?subject=/p/r", b"as-nobody")
        assert json.loads(conn.getresponse().read()) == {"status": "NO_SUBSCRIBER"}
        conn.request("GET", "/snapshot?subject=/p/r")
        assert conn.getresponse().read() == b"as-nobody"
    finally:
        proc.terminate()
        proc.wait(15)
    assert proc.returncode == 0
    assert (folder / "logs" / "access.log").stat().st_uid == pwd.getpwnam("nobody").pw_uid
    shutil.rmtree(folder)


def test_unknown_user_is_a_clear_error(tmp_path: Path) -> None:
    conf = tmp_path / "m.conf"
    conf.write_text(
        f"Listen = 127.0.0.1:{privileged_port()}\nRunAsUser = no-such-user-here\n"
        f"LogFolder = {tmp_path}/logs\nStateFolder = {tmp_path}/state\n"
    )
    result = subprocess.run(
        [sys.executable, "-m", "migratory_cli.main", "serve", "-c", str(conf)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert "RunAsUser: no such user 'no-such-user-here'" in result.stderr
