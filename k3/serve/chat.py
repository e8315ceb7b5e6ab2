"""Chat prompts: OpenAI ``messages`` → prompt token ids, by the model's own chat format.

Which format (``chat_format``):

1. a Jinja ``chat_template`` shipped with the checkpoint (``tokenizer_config.json``'s ``chat_template``, or a
   ``chat_template.jinja`` file) — rendered with jinja2 in a sandbox, as Hugging Face does, with ``messages``,
   ``add_generation_prompt=True``, ``bos_token``/``eos_token``; the text is encoded with special tokens allowed;
2. else K3's own renderer (``K3Tokenizer.chat_prompt``, the released model's "XTML" format) for a K3 tokenizer;
3. else (byte and other tokenizers of ``k3 train`` runs) the plain format below, with ``\\nUser:`` and
   ``\\nSystem:`` as extra stop strings::

       [bos]System: TEXT\\n\\nUser: TEXT\\n\\nAssistant: TEXT\\n\\nUser: TEXT\\n\\nAssistant:
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

__all__ = ["ChatFormat", "chat_format", "check_messages", "find_chat_template", "PLAIN_STOPS"]

ROLES = ("system", "user", "assistant", "tool")
PLAIN_STOPS = ("\nUser:", "\nSystem:")
_MAX_TEMPLATE_BYTES = 1 << 20


def check_messages(messages: Any) -> list[dict[str, Any]]:
    """OpenAI chat messages validated (``ValueError`` naming the bad one); content parts of type "text" are joined."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} objects")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            raise ValueError(f"messages[{i}] must be an object with role one of {', '.join(ROLES)}")
        content = m.get("content")
        if isinstance(content, list):  # [{"type": "text", "text": ...}, ...]
            if not all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                       for p in content):
                raise ValueError(f"messages[{i}].content: only text parts are supported")
            content = "".join(p["text"] for p in content)
        if content is not None and not isinstance(content, str):
            raise ValueError(f"messages[{i}].content must be a string or a list of text parts")
        if content is None and m["role"] != "assistant":
            raise ValueError(f"messages[{i}].content is required")
        msg = {"role": m["role"], "content": content or ""}
        for key in ("name", "tool", "reasoning_content"):
            if isinstance(m.get(key), str):
                msg[key] = m[key]
        out.append(msg)
    return out


def find_chat_template(folder: str | Path | None) -> str | None:
    """The Jinja chat template a checkpoint folder ships, if any (``chat_template.jinja`` or the
    ``chat_template`` of ``tokenizer_config.json``: a string, or a list of named templates whose "default" wins)."""
    if folder is None:
        return None
    folder = Path(folder)
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        if jinja.stat().st_size > _MAX_TEMPLATE_BYTES:
            raise ValueError(f"{jinja} is larger than {_MAX_TEMPLATE_BYTES} bytes")
        return jinja.read_text(encoding="utf-8")
    cfg = folder / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    try:
        t = json.loads(cfg.read_text(encoding="utf-8")).get("chat_template")
    except (OSError, json.JSONDecodeError, AttributeError) as e:
        raise ValueError(f"{cfg} is not a valid JSON object: {e}") from None
    if isinstance(t, list):
        named = {x.get("name"): x.get("template") for x in t if isinstance(x, dict)}
        t = named.get("default") or next(iter(named.values()), None)
    return t if isinstance(t, str) and t.strip() else None


class ChatFormat:
    """``render(messages) → ids`` and the stop strings the format implies. ``kind``: "jinja", "k3" or "plain"."""

    def __init__(self, tokenizer: Any, template: str | None = None) -> None:
        self.tokenizer = tokenizer
        self.stops: tuple[str, ...] = ()
        if template is not None:
            from jinja2.sandbox import ImmutableSandboxedEnvironment  # noqa: PLC0415 (only for templates)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
            env.globals["raise_exception"] = _raise
            self._template = env.from_string(template)
            self.kind = "jinja"
        elif hasattr(tokenizer, "chat_prompt"):
            self.kind = "k3"
        else:
            self.kind = "plain"
            self.stops = PLAIN_STOPS

    def render(self, messages: Sequence[dict[str, Any]]) -> list[int]:
        msgs = check_messages(list(messages))
        tok = self.tokenizer
        if self.kind == "k3":
            return list(tok.chat_prompt(msgs))
        if self.kind == "jinja":
            text = self._template.render(messages=msgs, add_generation_prompt=True, tools=None,
                                         bos_token=_special_text(tok, "bos_id"), eos_token=_special_text(tok, "eos_id"))
            try:
                return list(tok.encode(text, allow_special=True))
            except TypeError:  # a tokenizer without the flag encodes its specials by name already
                return list(tok.encode(text))
        body = "".join(f"{m['role'].capitalize()}: {m['content']}\n\n" for m in msgs) + "Assistant:"
        bos = getattr(tok, "bos_id", None)
        return ([bos] if bos is not None else []) + list(tok.encode(body))


def chat_format(tokenizer: Any, folder: str | Path | None = None) -> ChatFormat:
    """The chat format of a model whose checkpoint (tokenizer) files are in ``folder`` (see the module docstring)."""
    return ChatFormat(tokenizer, find_chat_template(folder))


def _special_text(tok: Any, attr: str) -> str:
    i = getattr(tok, attr, None)
    names = getattr(tok, "specials", None)
    if i is None or not isinstance(names, dict):
        return ""
    return next((name for name, j in names.items() if j == i), "")


def _raise(message: str) -> None:
    raise ValueError(f"chat template: {message}")
