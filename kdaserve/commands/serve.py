"""`kdaserve serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) around one engine.

    kdaserve serve --model tiny --port 8000
    curl localhost:8000/v1/completions -d '{"prompt": "Hello", "max_tokens": 8}' -H 'content-type: application/json'
"""

from __future__ import annotations

import logging
import sys


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)")
    p.add_argument("--model", default="tiny", help="a built-in model (tiny, bench) or a checkpoint directory")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the engine's model name)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--kda-prefill-backend", default="auto", help="KDA prefill backend (auto picks the fastest eligible)")
    p.add_argument("--kda-decode-backend", default="auto", help="KDA decode backend (auto picks the fastest eligible)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="requests in one running batch")
    p.add_argument("--max-model-len", type=int, default=4096, help="prompt + completion tokens per request")
    p.add_argument("--max-num-batched-tokens", type=int, default=None, help="token budget of one engine step")
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests that may wait beyond --max-num-seqs; past that, new requests get 503",
    )
    p.add_argument("--device", default=None, help="cuda, cpu, ... (default: the GPU when there is one)")
    p.add_argument("--dtype", default=None, help="bfloat16, float16 or float32 (default: the model's)")
    p.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the start-up warm-up that compiles the kernels' variants before the first request (GPU only)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"])
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
        engine = LLMEngine(
            args.model,
            kda_prefill_backend=args.kda_prefill_backend,
            kda_decode_backend=args.kda_decode_backend,
            max_num_seqs=args.max_num_seqs,
            max_model_len=args.max_model_len,
            max_num_batched_tokens=args.max_num_batched_tokens,
            device=args.device,
            dtype=args.dtype,
            enforce_eager=args.enforce_eager,
            warmup=not args.no_warmup,
            seed=args.seed,
        )
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
