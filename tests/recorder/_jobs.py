"""What the tests that launch real torchrun jobs share: a free port, and killing a job's leftover workers."""

from __future__ import annotations

import os
import signal
import socket


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def kill_leftovers(pids_dir, script: str) -> None:
    """torchrun starts each worker in its own session: kill, by pid, any worker of ``script`` still alive (each
    worker writes ``{pid}.pid`` into ``pids_dir``)."""
    for name in os.listdir(pids_dir):
        pid = int(name.split(".")[0])
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                if script.encode() not in fh.read():
                    continue
            os.kill(pid, signal.SIGKILL)
        except (FileNotFoundError, ProcessLookupError):
            pass


def finish(proc, pids_dir, script: str, timeout: float) -> tuple[int, str]:
    """Wait for a job started in its own session (``start_new_session=True``) with its output piped; its exit code
    and output.  No worker outlives it: the session is killed if it overran, then any leftover worker."""
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        kill_leftovers(pids_dir, script)
    return proc.returncode, out
