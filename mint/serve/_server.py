"""The server's process: logging, the listening socket, uvicorn, and a clean exit on SIGINT/SIGTERM.

`serve` assembles the parts (`AdapterHost`, `Scheduler`, the FastAPI app) and runs until stopped.
"""

from __future__ import annotations

import contextlib
import json
import logging
import signal
import socket
import sys

import uvicorn

from mint.errors import MintError
from mint.hub import Catalog
from mint.serve._api import HttpError

MAX_BODY = 1 << 20
# uvicorn answers 503 past this many open connections plus tasks; the queue (429) is the real bound on work.
LIMIT_CONCURRENCY = 1024
BACKLOG = 2048


class _Server(uvicorn.Server):
    """uvicorn re-raises a captured SIGTERM after its graceful shutdown, which would end the process by the signal;
    `mint serve` stops on it and exits 0 instead."""

    @contextlib.contextmanager
    def capture_signals(self):
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)


def serve(
    base: str,
    catalog_dir: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    load: list[str] = (),
    verbose: bool = False,
    *,
    dtype: str = "float32",
    device: str | None = None,
    served_name: str | None = None,
    max_resident: int = 8,
    adapter_root: str | None = None,
    max_batch: int = 64,
    max_queue: int = 256,
    batch_wait_ms: float = 2.0,
    request_timeout: float = 600.0,
    read_timeout: float = 30.0,
    max_tokens: int = 4096,
    max_n: int = 64,
    enable_return_routed_experts: bool = False,
) -> None:
    """Run until SIGINT/SIGTERM (then exit cleanly). Prints one JSON line with the URL once the socket listens
    (port 0: any free one)."""
    from mint.serve._http import build_app
    from mint.serve._model import AdapterHost
    from mint.serve._sched import Scheduler

    logging.basicConfig(
        level=logging.INFO if verbose else logging.WARNING,
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    # asyncio warns on every write to a socket whose client already left, until Starlette cancels that stream
    logging.getLogger("asyncio").setLevel(logging.ERROR)
    if max_batch < 1 or max_queue < 1:
        raise MintError(f"--max-batch and --max-queue must be >= 1, got {max_batch} and {max_queue}")
    catalog = Catalog(catalog_dir, create=False)
    model = AdapterHost(
        base,
        catalog,
        dtype=dtype,
        device=device,
        served_name=served_name,
        max_resident=max_resident,
        adapter_root=adapter_root,
    )
    for item in load:
        name, sep, ref = item.partition("=")
        try:
            model.load(name if sep else ref, ref if sep else name)
        except HttpError as err:
            raise MintError(f"--load {item}: {err.message}") from None
    sched = Scheduler(model, max_batch=max_batch, max_queue=max_queue, batch_wait_s=batch_wait_ms / 1000)
    app = build_app(
        model,
        sched,
        max_body=MAX_BODY,
        read_timeout=read_timeout,
        request_timeout=request_timeout,
        max_tokens=max_tokens,
        max_n=max_n,
        return_routes=enable_return_routed_experts,
    )

    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    config = uvicorn.Config(
        app,
        log_level="info" if verbose else "warning",
        access_log=verbose,
        backlog=BACKLOG,
        limit_concurrency=LIMIT_CONCURRENCY,
        timeout_keep_alive=30,
        timeout_graceful_shutdown=5,
        lifespan="off",
    )
    server = _Server(config)
    url = f"http://{host}:{sock.getsockname()[1]}"
    print(json.dumps({"event": "listening", "url": url, "base": model.base_path, "catalog": str(catalog.root)}))
    sys.stdout.flush()
    try:
        server.run(sockets=[sock])
    finally:
        sched.stop()
        sock.close()
        catalog.close()
