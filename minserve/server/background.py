"""Run a server under uvicorn in a background thread: for notebooks, tests and benchmarks.

    with BackgroundServer(build_server(llm.engine, ServerConfig("tiny"))) as url:
        OpenAI(base_url=url + "/v1", api_key="none").completions.create(...)

Port 0 asks the OS for a free port, so two servers never collide.
"""

from __future__ import annotations

import threading
import time

import uvicorn

from minserve.server.app import Server


class BackgroundServer:
    """uvicorn + the engine loop, started on enter and always stopped on exit."""

    def __init__(
        self,
        server: Server,
        host: str = "127.0.0.1",
        port: int = 0,
        log_level: str = "warning",
        start_engine: bool = True,
    ) -> None:
        """`start_engine=False`: the caller runs the engine loop (`server.engine.run()`)."""
        self.server = server
        self.start_engine = start_engine
        config = uvicorn.Config(server.app, host=host, port=port, log_level=log_level)
        self._uvicorn = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._uvicorn.run, name="uvicorn", daemon=True)

    @property
    def url(self) -> str:
        host, port = self._uvicorn.servers[0].sockets[0].getsockname()[:2]
        return f"http://{host}:{port}"

    def start(self, timeout_s: float = 30.0) -> str:
        if self.start_engine:
            self.server.start()
        self._thread.start()
        deadline = time.monotonic() + timeout_s
        while not self._uvicorn.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("uvicorn did not start (see its log above)")
            time.sleep(0.01)
        return self.url

    def stop(self) -> None:
        self._uvicorn.should_exit = True
        if self._thread.is_alive():
            self._thread.join(timeout=30)
        self.server.shutdown()

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
