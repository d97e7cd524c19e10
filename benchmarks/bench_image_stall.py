"""Does a large image request stall the other streams? (issue 62: decoding must stay off the event
loop). A real server (`glm-tiny`, its engine in a thread or a process of its own) streams a long
text completion; meanwhile, chat requests carrying one large PNG as a data: URL arrive (body size
given, under --max-request-body-bytes). The PNG is a small picture with large metadata, so that
what is measured is the bytes' handling, not the model's work on a large image (a large image is a
long prefill, which delays other streams as any long prompt does, within chunked prefill's step
budget). The table: the stream's largest gap between chunks and its median, alone and with the
image requests, per engine mode.

    PYTHONPATH=$PWD python3 benchmarks/bench_image_stall.py [--image-mb 11] [--images 3]
"""

from __future__ import annotations

import argparse
import base64
import io
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def _png(megabytes: float) -> bytes:
    """A 64 x 64 image (16 tokens: next to nothing for the engine) carrying about `megabytes` of
    text metadata, which the server reads, parses and decodes past like any image's bytes: the
    request's cost is its size, not the model's work on it."""
    from PIL import Image, PngImagePlugin

    info = PngImagePlugin.PngInfo()
    info.add_text("padding", "x" * int(megabytes * 2**20))
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)).save(buf, format="PNG",
                                                                                                 pnginfo=info)
    return buf.getvalue()


def _stream_gaps(url: str, tokens: int, started: threading.Event) -> list[float]:
    body = {"model": "glm-tiny", "prompt": "Count:", "max_tokens": tokens, "ignore_eos": True, "stream": True,
            "temperature": 0}
    gaps, last = [], None
    with httpx.Client(timeout=300) as c, c.stream("POST", url + "/v1/completions", json=body) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            elif not started.is_set():
                started.set()
            last = now
    return gaps


def _send_images(url: str, data_url: str, count: int, out: list) -> None:
    body = {"model": "glm-tiny", "max_tokens": 1, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "What is this?"}, {"type": "image_url", "image_url": {"url": data_url}}]}]}
    with httpx.Client(timeout=300) as c:
        for _ in range(count):
            t0 = time.perf_counter()
            r = c.post(url + "/v1/chat/completions", json=body)
            out.append((r.status_code, time.perf_counter() - t0))


def main() -> None:
    from kdaserve.engine.engine_process import EngineProcess
    from kdaserve.engine.llm_engine import LLMEngine
    from kdaserve.server.app import build_app
    from kdaserve.server.launch import BackgroundServer
    from kdaserve.server.media import MediaSettings

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--image-mb", type=float, default=11.0, help="PNG size (the base64 body is 4/3 of it)")
    ap.add_argument("--images", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=400)
    args = ap.parse_args()
    png = _png(args.image_mb)
    data_url = "data:image/png;base64," + base64.b64encode(png).decode()
    rows = []
    for mode in ("thread", "process"):
        kw = dict(model="glm-tiny", max_num_seqs=8, limit_mm_per_prompt={"image": 1})
        engine = EngineProcess(kw) if mode == "process" else LLMEngine(**kw)
        media = MediaSettings(max_image_bytes=64 << 20, max_image_pixels=64_000_000)
        with BackgroundServer(build_app(engine, media=media)) as srv:
            for with_images in (False, True):
                started, sent = threading.Event(), []
                result: list = []
                t = threading.Thread(target=lambda: result.append(_stream_gaps(srv.url, args.tokens, started)))
                t.start()
                started.wait(60)
                if with_images:
                    _send_images(srv.url, data_url, args.images, sent)
                t.join()
                gaps = result[0]
                rows.append((mode, len(data_url) / 2**20, args.images if with_images else 0, max(gaps) * 1e3,
                             statistics.median(gaps) * 1e3, [s for s, _ in sent], [round(d, 2) for _, d in sent]))
                print(rows[-1], flush=True)
    print(f"\nglm-tiny on this machine's CPU; one streamed completion of {args.tokens} tokens, image requests of a "
          f"{len(png) / 2**20:.1f} MiB PNG ({len(data_url) / 2**20:.1f} MiB as a data: URL) sent one after another")
    print("| engine | image requests | stream's largest gap ms | median gap ms | statuses | seconds each |")
    print("|---|---|---|---|---|---|")
    for mode, _, n, worst, med, statuses, secs in rows:
        print(f"| {mode} | {n} | {worst:.1f} | {med:.1f} | {statuses} | {secs} |")


if __name__ == "__main__":
    main()
