"""The engine's ipc socket files: named after the server's pid, and those of servers that died without closing
them (killed outright) swept up when a server starts an engine."""
import os
import subprocess
import sys

from server.engine_client import SOCKET_FILE, _ipc_addresses, remove_stale_socket_files


def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_addresses_name_the_server_pid():
    address = _ipc_addresses()[0]
    match = SOCKET_FILE.fullmatch(os.path.basename(address.removeprefix("ipc://")))
    assert match is not None and int(match.group(1)) == os.getpid()


def test_only_the_files_of_servers_no_longer_running_are_removed(tmp_path):
    dead, alive = _dead_pid(), os.getpid()
    names = [f"specserve-{dead}-0123456789ab-in", f"specserve-{dead}-0123456789ab-out",
             f"specserve-{alive}-ba9876543210-in", "specserve-0123456789ab-in", "unrelated-1-0123456789ab-in"]
    for name in names:
        (tmp_path / name).write_text("")
    removed = remove_stale_socket_files(str(tmp_path))
    assert sorted(os.path.basename(path) for path in removed) == sorted(names[:2])
    assert sorted(os.listdir(tmp_path)) == sorted(names[2:])
