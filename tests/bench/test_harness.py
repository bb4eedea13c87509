"""The harness's process starter: a server in a session of its own or in the caller's (one CPU
share under the kernel's autogroups: docs/benchmarks-history.md "Behind vLLM-CPU: vLLM and the
router in one CPU share"), a process group of its own either way, and a kill that takes its
children with it."""

import os
import sys

import pytest

from harness.procs import free_port, group_alive, start

# serves 200 on every GET and starts a child that outlives nothing: the kill must take it too
SERVER = """
import http.server, subprocess, sys
subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler).serve_forever()
"""


@pytest.mark.parametrize("new_session", [True, False])
def test_a_server_gets_its_own_group_and_the_session_asked_for(tmp_path, new_session):
    port = free_port()
    server = start(
        [sys.executable, "-c", SERVER, str(port)],
        f"http://127.0.0.1:{port}",
        tmp_path / "server.log",
        timeout=30,
        new_session=new_session,
    )
    pid = server.proc.pid
    try:
        assert os.getpgid(pid) == pid  # signals to our group do not reach it
        assert (os.getsid(pid) == pid) is new_session
        assert (os.getsid(pid) == os.getsid(0)) is not new_session
        assert len(group_alive(pid)) == 2  # the server and its child
    finally:
        server.kill(timeout=10)
    assert group_alive(pid) == []
