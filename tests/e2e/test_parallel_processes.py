"""The processes of a parallel engine leave nothing behind: not when the handle closes them, not
when the process that started them (a test's xdist worker) is killed outright. Linux: a process's
exit is awaited through a pidfd, and the children are read from /proc."""

from __future__ import annotations

import os
import select
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.skipif(not hasattr(os, "pidfd_open"), reason="needs Linux (pidfd_open, /proc)")

START = """
import os
import threading

from pytest_kvcanary.config import CanaryConfig
from pytest_kvcanary.reference_engine import EngineConfig, ModelConfig
from pytest_kvcanary.reference_engine.parallel.shard import ReferenceShards
from pytest_kvcanary.reference_engine.parallel.topology import Topology
from pytest_kvcanary.handles.parallel import ParallelHandle
from pytest_kvcanary.handles.rank import RankSpec

def start():
    engine = EngineConfig(model=ModelConfig(max_context=32), num_slots=64, max_batch_tokens=32)
    return ParallelHandle(RankSpec("single", ReferenceShards(engine), CanaryConfig(kernels="torch"), Topology(tp=2),
                                   ("cpu", "cpu")))

def fail_on_rank_1(context):
    if context.rank == 1:
        raise RuntimeError("rank 1 gave up")

def busy(context):
    os.write(1, f"rank {context.rank} busy\\n".encode())  # one write: the ranks share the pipe
    threading.Event().wait()

if __name__ == "__main__":
    handle = start()
    assert handle.generate([[1, 2, 3]], 2)
    print(handle.processes.port, flush=True)
    handle.call(busy)  # until killed
"""


def _children(pid: int) -> set[int]:
    """The live processes whose parent is `pid`."""
    found = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[1]) == pid:
            found.add(int(stat.parent.name))
    return found


def _await_exit(pids: set[int], timeout_s: float) -> set[int]:
    """Wait for the processes to exit; the ones still running after timeout_s."""
    fds = {}
    for pid in pids:
        try:
            fds[os.pidfd_open(pid)] = pid
        except ProcessLookupError:
            continue
    try:
        pending = set(fds)
        while pending:
            ready, _, _ = select.select(list(pending), [], [], timeout_s)
            if not ready:
                break
            pending -= set(ready)
        return {fds[fd] for fd in pending}
    finally:
        for fd in fds:
            os.close(fd)


def _port_is_free(port: int) -> bool:
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def test_killing_the_parent_takes_the_ranks_and_the_port_with_it(tmp_path: Path) -> None:
    """Killed while its ranks are busy in a command (not reading from it): they go too."""
    script = tmp_path / "parent.py"
    script.write_text(START)
    env = {**os.environ, "TRITON_INTERPRET": "1", "OMP_NUM_THREADS": "1"}
    parent = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                              env=env)
    try:
        port = int(parent.stdout.readline())
        assert sorted(parent.stdout.readline() for _ in range(2)) == ["rank 0 busy\n", "rank 1 busy\n"]
        children = _children(parent.pid)
        assert len(children) >= 2, "the two ranks run as the parent's children"
        assert not _port_is_free(port)
    finally:
        parent.kill()
        parent.wait()
    assert _await_exit(children, timeout_s=60) == set(), "rank processes outlived their parent"
    assert _port_is_free(port)


def test_closing_the_handle_stops_the_ranks_and_frees_the_port(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "parallel_start.py").write_text(START)
    from parallel_start import start

    handle = start()
    processes, port = handle.processes.processes, handle.processes.port
    with pytest.raises(ValueError, match="prompt is empty"):  # refused by rank 0, before the ranks run it
        handle.generate([[1, 2], []], 2)
    assert handle.generate([[1, 2, 3]], 2) and handle.healthy()
    handle.close()
    assert [p.exitcode for p in processes] == [0, 0]
    assert _children(os.getpid()) & {p.pid for p in processes} == set()
    assert _port_is_free(port)


def test_a_rank_that_fails_takes_the_engine_down_with_its_traceback(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "parallel_fail.py").write_text(START)
    from parallel_fail import fail_on_rank_1, start

    from pytest_kvcanary.handles.parallel import RankFailure

    handle = start()
    processes, port = handle.processes.processes, handle.processes.port
    with pytest.raises(RankFailure, match=r"(?s)a rank of the parallel engine died \(rank 0 .*\nrank 1: Traceback.*"
                                          r"rank 1 gave up"):
        handle.call(fail_on_rank_1)
    assert not any(p.is_alive() for p in processes) and not handle.healthy()
    handle.close()
    assert _port_is_free(port)
