"""Chat messages -> prompt text.

The model's tokenizer renders them (`apply_chat_template`: a checkpoint's own template when it
ships one, kdaserve's simple template for built-in models). A tokenizer without that method gets the
same simple template from here: each turn is `<|role|>\\n{content}\\n`, and the prompt ends with
`<|assistant|>\\n` so the model continues as the assistant.
"""

from __future__ import annotations

from kdaserve.server.errors import bad_request

ROLES = ("system", "user", "assistant", "tool", "developer")


def message_text(content) -> str:
    """A message's content as text: a string, or OpenAI's list of content parts (text only)."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        kind = part.get("type")
        if kind != "text" or not isinstance(part.get("text"), str):
            raise bad_request(f"only text content parts are supported, got a part of type {kind!r}", param="messages")
        texts.append(part["text"])
    return "".join(texts)


def plain_messages(messages) -> list[dict[str, str]]:
    out = []
    for i, m in enumerate(messages):
        if m.role not in ROLES:
            raise bad_request(f"messages[{i}].role must be one of {', '.join(ROLES)}; got {m.role!r}", param="messages")
        out.append({"role": m.role, "content": message_text(m.content)})
    return out


def simple_chat_prompt(messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
    text = "".join(f"<|{m['role']}|>\n{m['content']}\n" for m in messages)
    return text + ("<|assistant|>\n" if add_generation_prompt else "")


def render_chat(tokenizer, messages, add_generation_prompt: bool = True) -> str:
    plain = plain_messages(messages)
    apply = getattr(tokenizer, "apply_chat_template", None)
    if apply is None:
        return simple_chat_prompt(plain, add_generation_prompt)
    try:
        return apply(plain, add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # noqa: BLE001 - a checkpoint template may reject these messages
        raise bad_request(f"the chat template could not render these messages: {type(exc).__name__}: {exc}", param="messages") from None
