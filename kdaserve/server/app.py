"""The FastAPI application: routes of the OpenAI-compatible API around one engine."""

from __future__ import annotations

import asyncio
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from kdaserve.engine.engine_process import EngineClient
from kdaserve.server.access import AccessGuard, AccessSettings
from kdaserve.server.chat import ChatHandler
from kdaserve.server.chat_template import chat_prompt_ids
from kdaserve.server.completions import CompletionHandler
from kdaserve.server.engine_loop import EngineLoop, ProcessEngineLoop
from kdaserve.server.errors import APIError, bad_request, install_error_handlers
from kdaserve.server.media import MediaSettings
from kdaserve.server.metrics import ServerMetrics
from kdaserve.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from kdaserve.server.serving import DEFAULT_STREAM_WRITE_TIMEOUT, ServerState, check_model, parse_body
from kdaserve.server.tool_parsers import make_tool_parser


def build_app(
    engine,
    *,
    served_model_name: str | None = None,
    model_root: str | None = None,
    max_queued_requests: int = 1024,
    access: AccessSettings | None = None,
    enable_docs: bool = False,
    allowed_origins: list[str] | None = None,
    request_id_headers: bool = False,
    return_tokens_as_token_ids: bool = False,
    stream_write_timeout: float = DEFAULT_STREAM_WRITE_TIMEOUT,
    sampling_defaults: dict | None = None,
    enable_tokenizer_info_endpoint: bool = False,
    tool_parser: str | None = None,
    enable_per_request_metrics: bool = False,
    enable_prompt_tokens_details: bool = False,
    api_server: tuple[int, int] = (0, 1),
    media: MediaSettings | None = None,
):
    """An app serving `engine`: an `LLMEngine` (stepped by a thread of this process while the app
    is up), an `EngineProcess` (its own process; stopped when the app stops) or one of its
    `EngineClient`s (closed when the app stops; the engine process serves on).
    `access`: API keys, Host check and body limit (server/access.py; default: no key, no Host
    check, the default body limit). The interactive `/docs` and `/redoc` pages and the
    `/openapi.json` schema only with `enable_docs` (and, with a key, behind it). CORS headers only for
    `allowed_origins` (none by default: a web page cannot read the API's answers). `tool_parser`:
    the parser of tool_choice "auto" (`--enable-auto-tool-choice --tool-call-parser`; ValueError
    when unknown or the tokenizer lacks its tokens). `api_server`: (index, count) of this app among
    the API server processes sharing one engine (`--api-server-count`, server/api_servers.py):
    each admits its share of the request limit, the metrics are the processes' sum, and the
    engine-wide counters are kept by the first. `media`: where image bytes may come from and how
    large they may be (server/media.py; default: data: URLs only, the default limits)."""
    index, count = api_server
    if not stream_write_timeout > 0:
        raise ValueError(f"invalid stream_write_timeout: got {stream_write_timeout}; expected seconds > 0")
    info = engine.info   # all the server reads of the engine
    name = served_model_name or info.model_name
    cfg = info.config
    metrics = ServerMetrics(name, cache_info={
        "block_size": cfg.block_size, "num_gpu_blocks": info.num_kv_blocks,
        "cache_dtype": str(cfg.dtype).removeprefix("torch."), "num_state_slots": info.num_state_slots,
        "mamba_ssm_cache_dtype": str(cfg.state_dtype).removeprefix("torch."),
        "gpu_memory_utilization": cfg.gpu_memory_utilization,
        "enable_prefix_caching": cfg.enable_prefix_caching, "mamba_block_size": cfg.mamba_block_size,
        "prefix_caching_hash_algo": cfg.prefix_caching_hash_algo,
    }, num_speculative_tokens=cfg.num_spec_tokens, multiprocess=count > 1, engine_counters=index == 0)
    parser = make_tool_parser(tool_parser, info.tokenizer) if tool_parser else None
    # An EngineProcess or one of its clients (kdaserve serve's default) steps in its own process; an
    # LLMEngine in a thread here.
    loop_type = ProcessEngineLoop if isinstance(engine, EngineClient) else EngineLoop
    engine_loop = loop_type(engine, max_queued_requests=max_queued_requests, metrics=metrics, api_server_count=count)
    state = ServerState(
        engine_loop=engine_loop,
        tokenizer=info.tokenizer,
        model_name=name,
        model_root=model_root or name,
        max_model_len=info.max_model_len,
        request_id_headers=request_id_headers,
        tokens_as_ids=return_tokens_as_token_ids,
        stream_write_timeout=stream_write_timeout,
        sampling_defaults=dict(sampling_defaults or {}),
        tool_parser=parser,
        tool_call_id_style=getattr(parser, "tool_call_id_style", None),
        per_request_metrics=enable_per_request_metrics,
        prompt_tokens_details=enable_prompt_tokens_details,
        image_token_id=info.image_token_id,
        image_rules=info.image_rules,
        max_images=cfg.max_images_per_prompt if info.image_token_id is not None else 0,
        media=media or MediaSettings(),
    )

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        engine_loop.start()
        try:
            yield
        finally:
            engine_loop.shutdown()

    # The schema maps every route and field: served only with the docs (and behind the API key).
    app = FastAPI(title="kdaserve", lifespan=lifespan, docs_url="/docs" if enable_docs else None,
                  redoc_url="/redoc" if enable_docs else None, openapi_url="/openapi.json" if enable_docs else None)
    app.state.server = state
    install_error_handlers(app)
    completions = CompletionHandler(state)
    chat = ChatHandler(state)

    def model_card() -> dict:
        return {
            "id": state.model_name,
            "object": "model",
            "created": state.created,
            "owned_by": "kdaserve",
            "root": state.model_name,   # never the checkpoint's path (model_root is accepted, not shown)
            "parent": None,
            "max_model_len": state.max_model_len,
        }

    @app.get("/health")
    async def health():
        if not engine_loop.is_alive:
            raise APIError(503, "the engine is not running", code="engine_unavailable")
        return Response(status_code=200)

    @app.get("/ping")
    async def ping():
        return await health()

    @app.get("/v1/models")
    async def list_models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def get_model(model_id: str):
        check_model(state, model_id)
        return model_card()

    @app.post("/v1/completions", openapi_extra=_json_body(CompletionRequest))
    async def create_completion(request: Request):
        return await completions(request, await parse_body(request, CompletionRequest, engine_loop))

    @app.post("/v1/chat/completions", openapi_extra=_json_body(ChatCompletionRequest))
    async def create_chat_completion(request: Request):
        return await chat(request, await parse_body(request, ChatCompletionRequest, engine_loop))

    if enable_tokenizer_info_endpoint:
        @app.get("/tokenizer_info")
        async def tokenizer_info():
            """The tokenizer's special tokens and chat template, for clients that tokenize through
            this server (lm-eval's remote tokenizer); off unless asked for, as in vLLM, since it
            shows the chat template."""
            info = dict(state.tokenizer.info()) if hasattr(state.tokenizer, "info") else {}
            return {**info, "model_max_length": state.max_model_len}

    @app.post("/tokenize", openapi_extra=_json_body(TokenizeRequest))
    async def tokenize(request: Request):
        req = await parse_body(request, TokenizeRequest)
        check_model(state, req.model)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("give exactly one of `prompt` and `messages`")
        if req.prompt is not None:
            tokens = await asyncio.to_thread(state.encode, req.prompt, "prompt")
        else:
            tokens = await asyncio.to_thread(chat_prompt_ids, state.tokenizer, req.messages, req.add_generation_prompt,
                                             lambda text: state.encode(text, param="messages"),
                                             lambda n: state.check_chars(n, param="messages"))
        return {"count": len(tokens), "max_model_len": state.max_model_len, "tokens": tokens}

    @app.post("/detokenize", openapi_extra=_json_body(DetokenizeRequest))
    async def detokenize(request: Request):
        req = await parse_body(request, DetokenizeRequest)
        check_model(state, req.model)
        vocab = info.vocab_size
        bad = next((t for t in req.tokens if not 0 <= t < vocab), None)
        if bad is not None:
            raise bad_request(f"token id {bad} is not in the vocabulary [0, {vocab})", param="tokens")
        try:
            return {"prompt": state.tokenizer.decode(req.tokens)}
        except (ValueError, IndexError, OverflowError, TypeError) as exc:
            raise bad_request(f"cannot decode these tokens: {exc}", param="tokens") from None

    @app.get("/metrics")
    async def prometheus_metrics():
        return Response(metrics.render(), media_type=metrics.content_type)

    @app.get("/version")
    async def version():
        from kdaserve import __version__

        return JSONResponse({"version": __version__})

    if allowed_origins:
        from fastapi.middleware.cors import CORSMiddleware

        app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type", "X-Request-Id"])
    app.state.access = access or AccessSettings()
    guarded = AccessGuard(app, app.state.access)
    guarded.state, guarded.fastapi = app.state, app   # the app's state and routes, reached through the guard
    return guarded


def _json_body(model) -> dict:
    """The OpenAPI description of a route's JSON body. Handlers parse bodies themselves (in a
    worker thread, with the errors of serving.parse_body), so FastAPI cannot derive it; without it
    clients and fuzzers see routes that take nothing. Nested models are inlined (no $refs)."""
    schema = model.model_json_schema()
    defs = schema.pop("$defs", {})

    def inline(node):
        if isinstance(node, dict):
            ref = node.get("$ref")
            if isinstance(ref, str) and ref.startswith("#/$defs/"):
                return inline(defs[ref.rsplit("/", 1)[1]])
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    return {"requestBody": {"required": True, "content": {"application/json": {"schema": inline(schema)}}}}
