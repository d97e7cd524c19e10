"""`kdaserve serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) around one engine.

    kdaserve serve --model tiny --port 8000
    curl localhost:8000/v1/completions -d '{"prompt": "Hello", "max_tokens": 8}' -H 'content-type: application/json'
"""

from __future__ import annotations

import logging
import sys

from kdaserve.engine.args import add_engine_args, engine_kwargs_from_args


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the engine's model name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests that may wait beyond --max-num-seqs; past that, new requests get 503",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
    add_engine_args(p)
    p.set_defaults(func=run)


def run(args) -> int:
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from kdaserve.server.app import build_app
        from kdaserve.server.launch import serve_forever
    except ImportError as exc:
        print(f"kdaserve serve needs the server extra: pip install 'kdaserve[serve]' ({exc})", file=sys.stderr)
        return 2
    from kdaserve.engine.llm_engine import LLMEngine

    try:
        engine = LLMEngine(**engine_kwargs_from_args(args))
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        # Startup errors (unmet backend requirements, a bad checkpoint path) are for a person.
        print(f"kdaserve serve: cannot start the engine: {exc}", file=sys.stderr)
        return 1
    app = build_app(
        engine,
        served_model_name=args.served_model_name,
        model_root=args.model,
        max_queued_requests=args.max_queued_requests,
    )
    serve_forever(app, args.host, args.port, log_level=args.log_level)
    return 0
