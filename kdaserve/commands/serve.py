"""`kdaserve serve`: the OpenAI-compatible HTTP server (FastAPI + uvicorn) around one engine.

    kdaserve serve --model tiny --port 8000
    curl localhost:8000/v1/completions -d '{"prompt": "Hello", "max_tokens": 8}' -H 'content-type: application/json'
"""

from __future__ import annotations

import argparse
import logging
import sys

from kdaserve.engine.args import add_engine_args, engine_kwargs_from_args
from kdaserve.server.media import DEFAULT_MAX_IMAGE_BYTES, DEFAULT_MAX_IMAGE_PIXELS, MediaSettings

DEFAULT_MAX_BODY_BYTES = 16 << 20   # = kdaserve.server.access.DEFAULT_MAX_BODY_BYTES (no server import here)
DEFAULT_SEND_BUFFER_BYTES = 256 << 10   # = kdaserve.server.connections.DEFAULT_SEND_BUFFER_BYTES


def register(sub) -> None:
    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (/v1/completions, /v1/chat/completions, ...)")
    p.add_argument("--served-model-name", default=None, help="the model id clients send (default: the engine's model name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1; 0.0.0.0 for every interface)")
    p.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
    p.add_argument(
        "--max-queued-requests",
        type=int,
        default=1024,
        help="requests that may wait beyond --max-num-seqs; past that, new requests get 503",
    )
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="the server's and the engine's log level (default: info)")
    p.add_argument("--api-key", action="append", default=None, metavar="KEY",
                   help="require `Authorization: Bearer KEY` on /v1/* and the tokenizer routes (repeat for several "
                        "keys; default: the VLLM_API_KEY or KDASERVE_API_KEY environment variable, else none)")
    p.add_argument("--allowed-hosts", default=None,
                   help="comma-separated Host names to answer besides loopback ones (a loopback-bound server answers "
                        "only those: DNS-rebinding protection); on a public address, the only names answered")
    p.add_argument("--max-request-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                   help="larger request bodies get 413 (default: %(default)s)")
    p.add_argument("--enable-docs", action="store_true",
                   help="serve the interactive /docs and /redoc pages and the /openapi.json schema (behind --api-key)")
    p.add_argument("--allowed-origins", default=None,
                   help="comma-separated origins browsers may call from (CORS); default: none (no CORS headers)")
    p.add_argument("--root-path", default="", help="the path prefix when behind a proxy that routes a sub-path here")
    p.add_argument("--ssl-keyfile", default=None, help="serve HTTPS with this private key (and --ssl-certfile)")
    p.add_argument("--ssl-certfile", default=None, help="serve HTTPS with this certificate (and --ssl-keyfile)")
    p.add_argument("--uvicorn-log-level", default=None, choices=["critical", "error", "warning", "info", "debug", "trace"],
                   help="uvicorn's own log level (default: --log-level)")
    p.add_argument("--chat-template", default=None,
                   help="a jinja2 chat template, or the path of a file holding one, instead of the checkpoint's")
    p.add_argument("--enable-request-id-headers", action="store_true",
                   help="a client's X-Request-Id becomes the id of its completion (it is echoed either way)")
    p.add_argument("--return-tokens-as-token-ids", action="store_true",
                   help='log-probs name tokens as "token_id:{id}" instead of their text (which several tokens can share)')
    p.add_argument("--stream-write-timeout", type=float, default=30.0,
                   help="seconds a stream may wait on a client that reads nothing; then the request is aborted and "
                        "its slots freed (default: 30)")
    p.add_argument("--generation-config", default="auto",
                   help="sampling defaults: auto (the checkpoint's generation_config.json, when it has one), vllm "
                        "(none), or a folder holding a generation_config.json; a request's own values win")
    p.add_argument("--enable-tokenizer-info-endpoint", action="store_true",
                   help="serve GET /tokenizer_info (special tokens and chat template) for remote tokenizers such as "
                        "lm-eval's; off by default, as in vLLM, since it shows the chat template")
    p.add_argument("--send-buffer-bytes", type=int, default=DEFAULT_SEND_BUFFER_BYTES,
                   help="each connection's kernel send buffer (SO_SNDBUF): what a client that stops reading can leave "
                        "queued before --stream-write-timeout starts counting (default: 262144; 0: the kernel's "
                        "autotuning, several MB: minutes of tokens)")
    p.add_argument("--header-timeout", type=float, default=10.0,
                   help="seconds a connection has to deliver a request's headers, from its opening or its previous "
                        "response; then it is closed (idle and slowloris connections; default: 10)")
    p.add_argument("--timeout-keep-alive", type=float, default=5.0,
                   help="uvicorn's: seconds an idle keep-alive connection stays open after a response (default: 5)")
    p.add_argument("--limit-concurrency", type=int, default=None,
                   help="uvicorn's: connections and tasks at once; past it new connections get 503 (default: none)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help='tool_choice "auto": the model decides whether to call tools; needs --tool-call-parser')
    p.add_argument("--tool-call-parser", default=None, choices=["kimi_k2"],
                   help="how the model writes tool calls (kimi_k2: Kimi-K2 and Kimi-Linear's special tokens); "
                        "used by tool_choice \"auto\"")
    p.add_argument("--allowed-local-media-path", default=None, metavar="DIR",
                   help="read file:// image URLs under this directory (default: none are read)")
    p.add_argument("--allowed-media-domains", default=None, metavar="HOST[,HOST...]",
                   help="fetch http(s) image URLs from these hosts (default: none: only data: URLs and, with "
                        "--allowed-local-media-path, files)")
    p.add_argument("--max-image-bytes", type=int, default=DEFAULT_MAX_IMAGE_BYTES,
                   help=f"largest encoded image accepted, in bytes (default {DEFAULT_MAX_IMAGE_BYTES})")
    p.add_argument("--max-image-pixels", type=int, default=DEFAULT_MAX_IMAGE_PIXELS,
                   help=f"largest decoded image accepted, width x height (default {DEFAULT_MAX_IMAGE_PIXELS}); the "
                        f"model's processor then fits it into its token budget")
    p.add_argument("--enable-per-request-metrics", action="store_true",
                   help="each response carries vLLM's per-request `metrics` (time to first token, queue and generation "
                        "time, mean inter-token latency, tokens per second); speculative acceptance is there regardless")
    p.add_argument("--enable-prompt-tokens-details", action="store_true",
                   help="usage.prompt_tokens_details.cached_tokens in responses: prompt tokens the prefix cache held")
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=True,
                   help="run the engine in a process of its own, as vLLM runs its engine core (default), so the "
                        "server's per-token HTTP work and the engine's steps do not share one interpreter lock; "
                        "--no-engine-process steps it in a thread of the server's process")
    p.add_argument("--api-server-count", "-asc", type=int, default=1,
                   help="API server processes in front of the one engine process, as vLLM's: they share the port and "
                        "split the streams (each stream's per-token HTTP work is Python; at many streams one process "
                        "falls behind the engine). Needs --engine-process (default: 1)")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL",
                   help="the model, as vLLM's `vllm serve MODEL` takes it (same as --model)")
    add_engine_args(p, model="nano")   # the trained model shipped in the package
    p.set_defaults(func=run)


def run(args) -> int:
    if args.model_tag is not None:
        args.model = args.model_tag
    for flag, value in (("--header-timeout", args.header_timeout), ("--timeout-keep-alive", args.timeout_keep_alive),
                        ("--stream-write-timeout", args.stream_write_timeout)):
        if not value > 0:
            print(f"kdaserve serve: {flag} must be seconds > 0, got {value}", file=sys.stderr)
            return 2
    if args.send_buffer_bytes < 0:
        print(f"kdaserve serve: --send-buffer-bytes must be >= 0 (0: the kernel's), got {args.send_buffer_bytes}",
              file=sys.stderr)
        return 2
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        print("kdaserve serve: --enable-auto-tool-choice needs --tool-call-parser (kimi_k2)", file=sys.stderr)
        return 2
    if args.api_server_count < 1:
        print(f"kdaserve serve: --api-server-count must be at least 1, got {args.api_server_count}", file=sys.stderr)
        return 2
    if args.api_server_count > 1 and not args.engine_process:
        print("kdaserve serve: --api-server-count > 1 needs the engine in its own process (drop --no-engine-process)",
              file=sys.stderr)
        return 2
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        print("kdaserve serve: --ssl-keyfile and --ssl-certfile go together", file=sys.stderr)
        return 2
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from kdaserve.server.app import build_app
        from kdaserve.server.launch import serve_forever
    except ImportError as exc:
        print(f"kdaserve serve needs the server extra: pip install 'kdaserve[serve]' ({exc})", file=sys.stderr)
        return 2
    from kdaserve.engine.llm_engine import LLMEngine

    try:
        if args.engine_process:
            from kdaserve.engine.engine_process import EngineProcess

            engine = EngineProcess(engine_kwargs_from_args(args), log_level=args.log_level.upper(),
                                   api_clients=args.api_server_count)
        else:
            engine = LLMEngine(**engine_kwargs_from_args(args))
    except (ValueError, RuntimeError, FileNotFoundError) as exc:
        # Startup errors (unmet backend requirements, a bad checkpoint path) are for a person.
        print(f"kdaserve serve: cannot start the engine: {exc}", file=sys.stderr)
        return 1
    from kdaserve.server.access import AccessSettings

    if args.chat_template:
        from pathlib import Path

        path = Path(args.chat_template)
        # A path names a file; anything else is the template itself (as vLLM takes it).
        engine.info.tokenizer.chat_template = path.read_text() if path.is_file() else args.chat_template

    from kdaserve.server.generation_config import load_generation_defaults

    try:
        defaults = load_generation_defaults(args.generation_config, args.model)
        # As vLLM: a parser without --enable-auto-tool-choice leaves tool_choice "auto" off.
        tool_parser = args.tool_call_parser if args.enable_auto_tool_choice else None
        if tool_parser:
            from kdaserve.server.tool_parsers import make_tool_parser

            make_tool_parser(tool_parser, engine.info.tokenizer)   # the tokenizer has the parser's tokens
        media = MediaSettings(allowed_local_media_path=args.allowed_local_media_path,
                              allowed_media_domains=tuple(d.strip().lower() for d in (args.allowed_media_domains or "").split(",")
                                                          if d.strip()),
                              max_image_bytes=args.max_image_bytes, max_image_pixels=args.max_image_pixels)
        access = AccessSettings.for_server(args.host, args.api_key,
                                           (args.allowed_hosts or "").split(",") if args.allowed_hosts else None,
                                           args.max_request_body_bytes)
    except ValueError as exc:
        print(f"kdaserve serve: {exc}", file=sys.stderr)
        return 2
    # Requests may name the model as served or as given to --model; /v1/models shows the served name only.
    app_kwargs = dict(served_model_name=args.served_model_name, model_root=args.model,
                      max_queued_requests=args.max_queued_requests, access=access, enable_docs=args.enable_docs,
                      allowed_origins=args.allowed_origins.split(",") if args.allowed_origins else None,
                      request_id_headers=args.enable_request_id_headers,
                      return_tokens_as_token_ids=args.return_tokens_as_token_ids,
                      stream_write_timeout=args.stream_write_timeout, sampling_defaults=defaults,
                      enable_tokenizer_info_endpoint=args.enable_tokenizer_info_endpoint, tool_parser=tool_parser,
                      enable_per_request_metrics=args.enable_per_request_metrics,
                      enable_prompt_tokens_details=args.enable_prompt_tokens_details, media=media)
    uvicorn_options = dict(log_level=args.uvicorn_log_level or args.log_level, root_path=args.root_path,
                           ssl_keyfile=args.ssl_keyfile, ssl_certfile=args.ssl_certfile, header_timeout=args.header_timeout,
                           send_buffer_bytes=args.send_buffer_bytes,
                           timeout_keep_alive=args.timeout_keep_alive, limit_concurrency=args.limit_concurrency)
    if args.api_server_count > 1:
        from kdaserve.server.api_servers import APIServers

        try:
            servers = APIServers(engine, args.api_server_count, app_kwargs, args.host, args.port,
                                 log_level=args.log_level, uvicorn_options=uvicorn_options)
        except OSError as exc:
            engine.close()
            print(f"kdaserve serve: {exc}", file=sys.stderr)
            return 1
        return servers.wait()
    app = build_app(engine, **app_kwargs)
    engine_error = serve_forever(app, args.host, args.port, **uvicorn_options)
    if engine_error is not None:   # a supervisor should restart the server, as after vLLM's exits
        print(f"kdaserve serve: the engine stopped ({engine_error}); exiting", file=sys.stderr)
        return 1
    return 0
