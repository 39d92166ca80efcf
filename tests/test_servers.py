"""The test harness's own guarantees, which every server test leans on: a port handed out to one
test process is never handed to another (pytest-xdist runs several), and a server whose port
another process answers on is reported, not silently replaced by that other process."""
import subprocess
import sys

import pytest

from tests.servers import REPO_ROOT, ServerStartError, _claim, free_port, run_process

HOLD_A_PORT = ("import sys; from tests.servers import free_port; "
               "print(free_port(), flush=True); sys.stdin.read()")


def test_a_port_handed_out_in_one_process_is_never_handed_out_in_another():
    child = subprocess.Popen([sys.executable, "-c", HOLD_A_PORT], cwd=REPO_ROOT, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        port = int(child.stdout.readline())
        assert not _claim(port)                      # the other process holds it while it lives
        assert free_port() != port
    finally:
        child.stdin.close()
        child.wait(10)
    assert _claim(port)                              # its claim ended with it: nothing to clean up


def test_a_server_whose_port_another_process_answers_on_is_reported():
    port = free_port()
    squatter = subprocess.Popen([sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
                                cwd=REPO_ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        # `sleep` never listens: the 200 comes from the squatter's directory listing
        with pytest.raises(ServerStartError, match="answered by another process"):
            with run_process(["sleep", "30"], f"http://127.0.0.1:{port}/", port=port, startup_timeout_s=10):
                pass
    finally:
        squatter.kill()
        squatter.wait(10)
