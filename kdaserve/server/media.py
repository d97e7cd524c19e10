"""Images in requests: where their bytes may come from, how large they may be, and their decoding,
all off the event loop (vLLM's rules and flags).

    data:image/...;base64,...   always (the body limit bounds it)
    file:///path                only under --allowed-local-media-path DIR (symlinks resolved first)
    http(s)://host/...          only when --allowed-media-domains names the host

Every refusal is a 400 that says what was wrong and what is accepted. Fetching, decoding (Pillow)
and processing (the model's rules) run in worker threads, and the decoded size is checked from the
image's header before its pixels are decoded (a small file may expand to gigapixels)."""

from __future__ import annotations

import asyncio
import base64
import binascii
import io
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path


def bad_request(message: str, param: str):
    """A 400 (imported here: `kdaserve serve --help` reads this module's defaults without fastapi)."""
    from kdaserve.server.errors import bad_request as _bad_request

    return _bad_request(message, param=param)

DEFAULT_MAX_IMAGE_BYTES = 20 << 20        # one image's encoded bytes
DEFAULT_MAX_IMAGE_PIXELS = 40_000_000     # one image's width x height once decoded
DEFAULT_FETCH_TIMEOUT = 10.0              # seconds for an http(s) image (vLLM: VLLM_IMAGE_FETCH_TIMEOUT)


@dataclass(frozen=True)
class MediaSettings:
    allowed_local_media_path: Path | None = None
    allowed_media_domains: tuple[str, ...] = ()
    max_image_bytes: int = DEFAULT_MAX_IMAGE_BYTES
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    fetch_timeout: float = DEFAULT_FETCH_TIMEOUT

    def __post_init__(self):
        path = self.allowed_local_media_path
        if path is not None:
            resolved = Path(path).resolve()
            if not resolved.is_dir():
                raise ValueError(f"--allowed-local-media-path {path}: not a directory")
            object.__setattr__(self, "allowed_local_media_path", resolved)
        for name in ("max_image_bytes", "max_image_pixels"):
            if getattr(self, name) < 1:
                raise ValueError(f"invalid {name}: got {getattr(self, name)}; expected >= 1")


async def image_bytes(url: str, settings: MediaSettings, param: str) -> bytes:
    """The encoded bytes an image part's URL names, by the rules above."""
    if not isinstance(url, str) or not url:
        raise bad_request("an image_url part needs {\"url\": \"data:...\" | \"file://...\" | \"http(s)://...\"}", param=param)
    scheme = url.split(":", 1)[0].lower() if ":" in url else ""
    if scheme == "data":   # base64 of up to --max-image-bytes: decoded off the loop too
        return await asyncio.to_thread(_data_url, url, settings, param)
    if scheme == "file":
        return await asyncio.to_thread(_local_file, url, settings, param)
    if scheme in ("http", "https"):
        host = (urllib.parse.urlsplit(url).hostname or "").lower()
        if host not in settings.allowed_media_domains:
            allowed = ", ".join(settings.allowed_media_domains) or "none (start the server with --allowed-media-domains)"
            raise bad_request(f"image URLs from {host or url!r} are not fetched: allowed domains are {allowed}; send the "
                              f"image inline as a data: URL (base64) instead", param=param)
        return await asyncio.to_thread(_fetch, url, settings, param)
    raise bad_request(f"unsupported image URL scheme {scheme!r}: expected data:, file:// (with "
                      f"--allowed-local-media-path) or http(s):// (with --allowed-media-domains)", param=param)


def _data_url(url: str, settings: MediaSettings, param: str) -> bytes:
    header, sep, payload = url.partition(",")
    if not sep or not header.lower().startswith("data:image/") or not header.lower().endswith(";base64"):
        raise bad_request("a data: image URL must be data:image/<format>;base64,<data>", param=param)
    if len(payload) * 3 // 4 > settings.max_image_bytes:
        raise bad_request(f"the image has about {len(payload) * 3 // 4} bytes; at most {settings.max_image_bytes} are "
                          f"accepted (--max-image-bytes)", param=param)
    try:
        return base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise bad_request("the data: image URL's payload is not valid base64", param=param) from None


def _local_file(url: str, settings: MediaSettings, param: str) -> bytes:
    root = settings.allowed_local_media_path
    if root is None:
        raise bad_request("file:// image URLs are not read: the server was started without --allowed-local-media-path; "
                          "send the image inline as a data: URL (base64)", param=param)
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise bad_request(f"a file:// URL names a local path (file:///path), got host {parts.netloc!r}", param=param)
    path = Path(urllib.parse.unquote(parts.path)).resolve()
    if not path.is_relative_to(root):
        raise bad_request(f"file:// image URLs must point under {root} (--allowed-local-media-path)", param=param)
    if not path.is_file():
        raise bad_request(f"no image file at {path}", param=param)
    size = path.stat().st_size
    if size > settings.max_image_bytes:
        raise bad_request(f"the image has {size} bytes; at most {settings.max_image_bytes} are accepted "
                          f"(--max-image-bytes)", param=param)
    return path.read_bytes()


def _fetch(url: str, settings: MediaSettings, param: str) -> bytes:
    class NoRedirect(urllib.request.HTTPRedirectHandler):   # a redirect could leave the allowed domains
        def redirect_request(self, *args, **kwargs):
            return None

    opener = urllib.request.build_opener(NoRedirect)
    try:
        with opener.open(url, timeout=settings.fetch_timeout) as response:
            data = response.read(settings.max_image_bytes + 1)
    except Exception as exc:  # noqa: BLE001 - any failure to fetch is the request's problem
        raise bad_request(f"could not fetch the image at {url}: {type(exc).__name__}: {exc}", param=param) from None
    if len(data) > settings.max_image_bytes:
        raise bad_request(f"the image at {url} has more than {settings.max_image_bytes} bytes (--max-image-bytes)",
                          param=param)
    return data


def decode_image(data: bytes, settings: MediaSettings, param: str):
    """Encoded bytes -> a loaded PIL image; its size is checked from the header before decoding."""
    from PIL import Image, UnidentifiedImageError

    try:
        image = Image.open(io.BytesIO(data))
    except (UnidentifiedImageError, OSError, ValueError):
        raise bad_request("the image could not be decoded: expected PNG, JPEG, WebP, GIF or BMP data", param=param) from None
    width, height = image.size
    if width * height > settings.max_image_pixels:
        raise bad_request(f"the image is {width} x {height} = {width * height} pixels; at most {settings.max_image_pixels} "
                          f"are accepted (--max-image-pixels)", param=param)
    try:
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as exc:
        raise bad_request(f"the image could not be decoded: {exc}", param=param) from None
    return image
