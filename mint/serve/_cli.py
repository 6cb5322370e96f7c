"""The `mint serve` command line: its flags, passed on to `serve` (mint/serve/_server.py) as keywords.

Only the standard library at import: `mint --help` builds this parser without loading the server.
"""

from __future__ import annotations

import os

from mint.errors import MintError


def add_parsers(sub) -> None:
    """Register `serve` on the `mint` subparsers."""
    p = sub.add_parser("serve", help="OpenAI-compatible server that hot-loads revisions from a catalog")
    p.add_argument(
        "--catalog", default=os.environ.get("MINT_CATALOG"), help="catalog directory (default: $MINT_CATALOG)"
    )
    p.add_argument("--base", required=True, help="base model: local path, hub id, or tiny:<family>")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000, help="0 picks a free port (printed on the first stdout line)")
    p.add_argument("--load", action="append", default=[], metavar="NAME=REV", help="load a revision at start")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    p.add_argument("--served-model-name", default=None, help="model id of the base (default: --base)")
    p.add_argument("--max-resident", type=int, default=8, help="most revisions resident at once")
    p.add_argument(
        "--adapter-root", default=None, help="also load exported adapter directories from under DIR (none outside it)"
    )
    p.add_argument("--max-batch", type=int, default=64, help="most requests decoded in one batch (1: one at a time)")
    p.add_argument("--max-queue", type=int, default=256, help="most requests waiting; more get 429")
    p.add_argument("--batch-wait-ms", type=float, default=2.0, help="how long a new batch waits for a burst to gather")
    p.add_argument("--request-timeout", type=float, default=600.0, help="seconds a request may take in all (504)")
    p.add_argument("--read-timeout", type=float, default=30.0, help="seconds a request body may take to arrive (408)")
    p.add_argument("--max-tokens", type=int, default=4096, help="largest max_tokens a request may ask for")
    p.add_argument(
        "--enable-return-routed-experts",
        action="store_true",
        help="every whole response of an MoE base carries routed_experts (vLLM's flag and encoding)",
    )
    p.add_argument("--verbose", action="store_true", help="log each request to stderr")


def run_command(args) -> int:
    """Run `mint serve` (until SIGINT/SIGTERM); a MintError when no catalog is given."""
    from mint.serve._server import serve

    if not args.catalog:
        raise MintError("no catalog: pass --catalog DIR or set MINT_CATALOG")
    serve(
        args.base,
        args.catalog,
        host=args.host,
        port=args.port,
        load=args.load,
        verbose=args.verbose,
        dtype=args.dtype,
        device=args.device,
        served_name=args.served_model_name,
        max_resident=args.max_resident,
        adapter_root=args.adapter_root,
        max_batch=args.max_batch,
        max_queue=args.max_queue,
        batch_wait_ms=args.batch_wait_ms,
        request_timeout=args.request_timeout,
        read_timeout=args.read_timeout,
        max_tokens=args.max_tokens,
        enable_return_routed_experts=args.enable_return_routed_experts,
    )
    return 0
