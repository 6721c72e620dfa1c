"""Starting and stopping an SGLang (or vLLM) server for a benchmark, keeping its log.

    with LaunchedServer(sglang_command(python, "--model-path /models/K --tp-size 8", 30000),
                        log_path, "http://127.0.0.1:30000") as server:
        ... requests to server.url ...

The server runs in its own process group (so that its scheduler and detokenizer processes stop
with it), its stdout and stderr go to `log_path`, and readiness is polled on `/model_info`
(never `/health`, which runs a generation). If the process exits before it is ready, the error
quotes the end of its log. On exit the group gets SIGTERM, then SIGKILL after a grace period.
"""

from __future__ import annotations

import asyncio
import logging
import os
import shlex
import signal
import subprocess
import time
from pathlib import Path

import aiohttp

from eagle3.core.server import MODEL_INFO_PATHS, ServerError, ServerExitedError, wait_ready

log = logging.getLogger(__name__)


class LaunchError(RuntimeError):
    """A server that could not be started; the message quotes its log."""


def sglang_command(python: str, launch_args: str, port: int,
                   extra: list[str] | None = None) -> list[str]:
    """`python -m sglang.launch_server <launch_args> --port <port> <extra>`."""
    args = shlex.split(launch_args)
    if "--port" in args or any(a.startswith("--port=") for a in args):
        raise ValueError("--launch-args must not set --port: pass --port to 05_benchmark.py")
    return [python, "-m", "sglang.launch_server", *args, "--port", str(port), *(extra or [])]


def log_tail(path: Path, lines: int = 30) -> str:
    if not Path(path).exists():
        return "(no log)"
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-lines:])


class LaunchedServer:
    """A server process started by us, ready on enter, stopped on exit."""

    def __init__(self, command: list[str], log_path: Path, url: str,
                 ready_timeout_s: float = 3600.0, stop_timeout_s: float = 60.0,
                 ready_paths: tuple[str, ...] = MODEL_INFO_PATHS, env: dict | None = None):
        self.command, self.log_path, self.url = command, Path(log_path), url
        self.env = env or {}  # set on top of this process's environment
        self.ready_paths = ready_paths  # vLLM: ("/v1/models",)
        self.ready_timeout_s, self.stop_timeout_s = ready_timeout_s, stop_timeout_s
        self.proc: subprocess.Popen | None = None

    def __enter__(self) -> LaunchedServer:
        self.start()
        self.wait()
        return self

    def start(self) -> None:
        """Start the process (not yet ready: `wait`); several servers started before any is
        waited for load side by side."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        log.info("starting %s (log: %s)", shlex.join(self.command), self.log_path)
        with self.log_path.open("ab") as out:
            self.proc = subprocess.Popen(self.command, stdout=out, stderr=subprocess.STDOUT,
                                         start_new_session=True,
                                         env={**os.environ, **self.env})
        self._t0 = time.time()

    def wait(self) -> None:
        """Block until the started server answers; LaunchError (server stopped) otherwise."""
        try:
            asyncio.run(self._wait_ready())
            log.info("%s ready after %.0fs", self.url, time.time() - self._t0)
        except BaseException:
            self.stop()
            raise

    def __exit__(self, *exc) -> None:
        self.stop()

    async def _wait_ready(self) -> None:
        async with aiohttp.ClientSession() as session:
            try:
                await wait_ready(session, self.url, self.ready_paths,
                                 timeout_s=self.ready_timeout_s, poll_s=1.0,
                                 request_timeout_s=5.0, process=self.proc)
            except ServerExitedError:
                raise LaunchError(f"the server exited with status {self.proc.returncode} "
                                  f"before it was ready; end of {self.log_path}:\n"
                                  f"{log_tail(self.log_path)}") from None
            except ServerError:
                raise LaunchError(f"{self.url} not ready after {self.ready_timeout_s:.0f}"
                                  f"s; end of {self.log_path}:\n"
                                  f"{log_tail(self.log_path)}") from None

    def stop(self) -> None:
        """SIGTERM to the server's process group, SIGKILL if it lingers."""
        if self.proc is None or self.proc.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, self.stop_timeout_s), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(self.proc.pid, sig)  # the group we created (start_new_session)
            except ProcessLookupError:
                return
            try:
                self.proc.wait(timeout=wait_s)
                log.info("stopped %s (status %s)", self.url, self.proc.returncode)
                return
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop after %s; escalating", self.url, sig.name)
