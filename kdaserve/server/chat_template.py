"""Chat messages -> prompt text.

The model's tokenizer renders them (`apply_chat_template`: a checkpoint's own template when it
ships one, kdaserve's simple template for built-in models). A tokenizer without that method gets the
same simple template from here: each turn is `<|role|>\\n{content}\\n`, and the prompt ends with
`<|assistant|>\\n` so the model continues as the assistant.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable

from kdaserve.server.errors import bad_request

ROLES = ("system", "user", "assistant", "tool", "developer")


def message_text(content, images: list | None = None) -> str | list[dict]:
    """A message's content as the template reads it: a string, or OpenAI's list of content parts
    joined into one text. With `images` (a list the image parts' URLs are appended to, in order),
    a message holding image parts keeps its parts, each image as {"type": "image"} (vLLM's form for
    templates that render parts); without, image parts are refused."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts, parts = [], []
    for part in content:
        kind = part.get("type")
        if kind in IMAGE_PART_TYPES and images is not None:
            images.append(image_part_url(part))
            parts.append({"type": "image"})
            continue
        if kind in IMAGE_PART_TYPES or kind in MEDIA_PART_TYPES:
            what = "images" if kind in IMAGE_PART_TYPES else kind
            raise bad_request(f"this model takes text content parts only, not {what}" if kind in IMAGE_PART_TYPES else
                              f"content parts of type {kind!r} are not supported: send text and image_url parts",
                              param="messages")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"content parts are text or image_url ones, got a part of type {kind!r}", param="messages")
        texts.append(part["text"])
        parts.append({"type": "text", "text": part["text"]})
    if len(parts) > len(texts):   # images among them: the parts, for the template to place
        return parts
    return "".join(texts)


IMAGE_PART_TYPES = ("image_url", "image")
MEDIA_PART_TYPES = ("video_url", "input_audio", "audio_url", "video", "file", "input_image_embeds", "image_embeds")


def image_part_url(part: dict) -> str:
    """The URL of an image part: {"type": "image_url", "image_url": {"url": ...}} (or the URL as a
    string, as vLLM also takes it)."""
    value = part.get("image_url", part.get("image"))
    url = value.get("url") if isinstance(value, dict) else value
    if not isinstance(url, str) or not url:
        raise bad_request('an image_url part needs "image_url": {"url": "data:image/...;base64,..."}', param="messages")
    return url


def _text_of(content) -> str:
    return content if isinstance(content, str) else "".join(p.get("text", "") for p in content)


def plain_messages(messages, images: list | None = None) -> list[dict]:
    """Messages as the template reads them: role and content (text, or parts where a message holds
    images and `images` collects their URLs), plus an assistant turn's `tool_calls` and a tool
    turn's `tool_call_id` and `name` where given."""
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {m.role!r}", param="messages")
        plain = {"role": m.role, "content": message_text(m.content, images)}
        if getattr(m, "tool_calls", None):
            plain["tool_calls"] = [c.model_dump() for c in m.tool_calls]
        for key in ("tool_call_id", "name"):
            if getattr(m, key, None) is not None:
                plain[key] = getattr(m, key)
        out.append(plain)
    return out


def _structured_text(plain: list[dict], tools: list[dict] | None) -> str:
    """Every string a template may copy besides message content: tool calls, ids, names, tools."""
    extra = [{k: v for k, v in m.items() if k not in ("role", "content")} for m in plain]
    return json.dumps([extra, tools or []], ensure_ascii=False)


def simple_chat_prompt(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    text = "".join(f"<|{m['role']}|>\n{_text_of(m['content'])}\n" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def chat_prompt_ids(tokenizer, messages, add_generation_prompt: bool, encode: Callable[[str], list[int]],
                    check_chars: Callable[[int], None] = lambda n: None, tools: list[dict] | None = None,
                    images: list | None = None) -> list[int]:
    """The prompt's token ids. Special tokens come only from the template: a message whose text
    holds a special token's string (say the end-of-turn token, to forge a turn) keeps it as text.
    Such messages are rendered as unique markers, the output split at them, the template's pieces
    encoded as usual and the messages' text with specials as plain text. Messages without such
    strings are encoded exactly as the whole rendered prompt (no change to tokenization).
    `check_chars(n)` refuses a prompt of n characters before anything is tokenized. `tools`
    (OpenAI's function definitions) go to the template as its `tools` variable; they and the
    messages' tool calls may not hold special tokens' strings (a 400: they are not copied as
    plain text, so they could forge turns)."""
    plain = plain_messages(messages, images)
    specials = [s for s in getattr(tokenizer, "special_token_strings", ()) if s]
    structured = _structured_text(plain, tools)
    forged = sorted({s for s in specials if s in structured})
    if forged:
        raise bad_request(f"tools or tool calls contain the control token(s) {forged}; remove them", param="messages")
    risky = [i for i, m in enumerate(plain) if any(s in _text_of(m["content"]) for s in specials)]
    with_images = [i for i in risky if not isinstance(plain[i]["content"], str)]
    if with_images:
        names = sorted({s for i in with_images for s in specials if s in _text_of(plain[i]["content"])})
        raise bad_request(f"a message with images contains the control token(s) {names}; remove them", param="messages")
    extra = {"tools": tools} if tools else {}
    if not risky or not hasattr(tokenizer, "encode_text"):
        return encode(_render(tokenizer, plain, add_generation_prompt, **extra))
    # "KddK": letters of both cases in an order that upper, lower, title, capitalize and swapcase all
    # change, so a template that changes the case of message text always changes the marker too
    # (a hex nonce may hold no letter).
    nonce = secrets.token_hex(8)
    marks = {f"\ue000KddK{nonce}:{i}\ue001": i for i in risky}
    masked = [dict(m, content=next(k for k, v in marks.items() if v == i)) if i in risky else m for i, m in enumerate(plain)]
    pieces = re.split("(" + "|".join(map(re.escape, marks)) + ")", _render(tokenizer, masked, add_generation_prompt, **extra))
    found = [p for p in pieces if p in marks]
    if sorted(found) != sorted(marks):
        names = sorted({s for i in risky for s in specials if s in plain[i]["content"]})
        raise bad_request(f"messages contain the control token(s) {names}, and this chat template does not copy message "
                          f"text verbatim, so they cannot be kept as text; remove them from the messages", param="messages")
    check_chars(sum(len(plain[marks[p]]["content"]) if p in marks else len(p) for p in pieces))
    ids: list[int] = []
    for piece in pieces:
        if piece in marks:
            ids += tokenizer.encode_text(plain[marks[piece]]["content"])
        elif piece:
            ids += encode(piece)
    return ids


def _render(tokenizer, plain: list[dict], add_generation_prompt: bool, **variables) -> str:
    apply = getattr(tokenizer, "apply_chat_template", None)
    if apply is None:
        return simple_chat_prompt(plain, add_generation_prompt)
    try:
        return apply(plain, add_generation_prompt=add_generation_prompt, **variables)
    except Exception as exc:  # noqa: BLE001 - a checkpoint template may reject these messages
        raise bad_request(f"the chat template could not render these messages: {type(exc).__name__}: {exc}",
                          param="messages") from None
