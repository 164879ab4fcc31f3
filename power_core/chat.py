"""Chat prompts: a model's own ``tokenizer.chat_template`` rendered in a sandboxed Jinja environment.

Instruct models are trained on their chat format; given bare text, SmolLM2-Instruct emits its
end-of-turn token at once. :class:`ChatTemplate` renders the template the GGUF ships, the way
Hugging Face ``transformers`` and llama-cpp-python do: ``jinja2.sandbox.ImmutableSandboxedEnvironment``
(templates are data from a downloaded file: no attribute access to Python internals, no mutation of
the arguments), ``trim_blocks``/``lstrip_blocks``, the ``loopcontrols`` extension, ``raise_exception``,
``strftime_now``, a ``tojson`` that keeps non-ASCII text, ``add_generation_prompt=True`` and the
vocabulary's ``bos_token``/``eos_token`` texts.

BOS: many templates write the BOS text themselves, and llama.cpp's tokenizer also adds BOS when the
vocabulary says so (``tokenizer.ggml.add_bos_token``). Like llama.cpp's server, a rendered prompt that
starts with the BOS text loses that text when the tokenizer will add BOS anyway, so the model never
sees two. Special tokens in the rendered text (``<|im_start|>``) are parsed as special tokens by the
tokenizer (llama.cpp ``parse_special``), not spelled out.
"""

from __future__ import annotations

import functools
import json
import os
import stat
from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any

import attrs

from power_core.errors import ArtifactError, ConfigError

__all__ = ["ChatTemplate", "Message", "check_messages"]

#: one chat turn: ``{"role": "system" | "user" | "assistant" | ..., "content": str}``
Message = Mapping[str, Any]


def check_messages(messages: Sequence[Message]) -> list[dict[str, Any]]:
    """Validate and copy chat messages (a list of ``{"role": str, "content": str}`` mappings)."""
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence) or not messages:
        raise ConfigError("messages", messages, 'a non-empty list of {"role": ..., "content": ...} mappings',
                          "for plain text use generate()/stream() instead of chat()")
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or not isinstance(m.get("role"), str) or "content" not in m:
            raise ConfigError(f"messages[{i}]", m, 'a mapping with a string "role" and a "content"')
        out.append(dict(m))
    return out


def _raise_exception(message: str) -> None:
    from jinja2.exceptions import TemplateError

    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None, separators: Any = None, sort_keys: bool = False,
            ensure_ascii: bool = False) -> str:
    # as transformers: JSON that keeps non-ASCII text (Jinja's own tojson escapes for HTML)
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _generation_extension() -> Any:
    """``{% generation %}...{% endgeneration %}``: transformers' marker of the assistant's own tokens
    (for training masks); rendering it is rendering its body."""
    from jinja2.ext import Extension

    class Generation(Extension):
        tags = {"generation"}

        def parse(self, parser: Any) -> Any:
            next(parser.stream)
            return parser.parse_statements(("name:endgeneration",), drop_needle=True)

    return Generation


def _environment() -> Any:
    """The sandboxed Jinja environment chat templates compile in (as transformers')."""
    try:
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError as exc:  # pragma: no cover - jinja2 is a dependency
        raise ConfigError("chat_template", "jinja2", "jinja2 installed", "pip install jinja2") from exc
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=["jinja2.ext.loopcontrols", _generation_extension()])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


@attrs.frozen
class ChatTemplate:
    """A model's chat template with the vocabulary facts its rendering needs.

    The Jinja source is compiled once, on the first :meth:`compile` or :meth:`render`, and the
    compiled template is kept with the object: build one per model (a server builds one per server)
    and render it per request."""

    source: str
    bos_token: str = ""
    eos_token: str = ""
    #: the tokenizer prepends BOS itself (``tokenizer.ggml.add_bos_token``)
    add_bos: bool = False
    bos_id: int | None = None
    #: who it belongs to, for error messages
    model: str = "model"
    #: the compiled Jinja template (set once, by the first compile; two racing threads compile the same)
    _compiled: Any = attrs.field(default=None, init=False, repr=False, eq=False)

    @classmethod
    def from_gguf(cls, path: str | os.PathLike[str], *, source: str | None = None) -> ChatTemplate:
        """Read ``tokenizer.chat_template`` and the BOS/EOS texts from a GGUF header.

        ``source`` (a ``--chat-template`` file's text) replaces the file's template; the BOS/EOS
        texts, ``add_bos`` and the BOS id still come from the file, so ``{{ bos_token }}`` and
        ``{{ eos_token }}`` render the model's tokens. Raises :class:`~power_core.errors.ConfigError`
        when neither ``source`` nor the file gives a template.
        """
        from power_core.artifacts.reader import parse_gguf

        raw = parse_gguf(path)
        meta = raw.metadata
        name = str(meta.get("general.name") or os.path.basename(os.fspath(path)))
        if source is None:
            source = meta.get("tokenizer.chat_template")
            if not isinstance(source, str) or not source.strip():
                raise no_template(f"{name} ({os.fspath(path)})")
        tokens = meta.get("tokenizer.ggml.tokens") or ()

        def text(key: str) -> tuple[str, int | None]:
            tid = meta.get(key)
            if isinstance(tid, int) and 0 <= tid < len(tokens):
                return str(tokens[tid]), tid
            return "", None

        bos, bos_id = text("tokenizer.ggml.bos_token_id")
        eos, _ = text("tokenizer.ggml.eos_token_id")
        add_bos = meta.get("tokenizer.ggml.add_bos_token")
        if add_bos is None:  # llama.cpp's default per vocabulary type: SentencePiece adds BOS
            add_bos = meta.get("tokenizer.ggml.model") == "llama"
        return cls(source=source, bos_token=bos, eos_token=eos, add_bos=bool(add_bos), bos_id=bos_id, model=name)

    def compile(self) -> Any:
        """The compiled Jinja template (compiled on the first call, then kept).

        Raises :class:`~power_core.errors.ConfigError` when the source is not a valid template."""
        from jinja2 import TemplateError

        try:
            return self._template()
        except TemplateError as exc:
            raise ConfigError("chat_template", self.model, "a Jinja template that compiles",
                              f"jinja said: {exc}") from None

    def _template(self) -> Any:
        compiled = self._compiled
        if compiled is None:
            compiled = _environment().from_string(self.source)
            object.__setattr__(self, "_compiled", compiled)  # a cache, not state: eq/hash ignore it
        return compiled

    def render(self, messages: Sequence[Message], *, add_generation_prompt: bool = True, **extra: Any) -> str:
        """The prompt text for ``messages`` (``extra`` reaches the template as variables, e.g. ``tools``).

        Raises :class:`~power_core.errors.ConfigError` when the template fails or rejects the
        conversation (its ``raise_exception``, e.g. roles that do not alternate), also when it fails
        on a value it did not expect (a ``TypeError`` inside the template, e.g. ``tojson`` of a generator).
        """
        from jinja2 import TemplateError

        msgs = check_messages(messages)
        try:
            return self._template().render(messages=msgs, add_generation_prompt=add_generation_prompt,
                                           bos_token=self.bos_token, eos_token=self.eos_token, **extra)
        except (TemplateError, TypeError, ValueError, KeyError, AttributeError, IndexError) as exc:
            raise ConfigError("messages", f"{len(msgs)} messages", f"a conversation {self.model}'s chat template "
                              "accepts", f"the template said: {exc}") from None

    def prompt_text(self, rendered: str) -> str:
        """The rendered text as it should reach a tokenizer that adds BOS per ``add_bos``."""
        if self.add_bos and self.bos_token and rendered.startswith(self.bos_token):
            return rendered[len(self.bos_token):]
        return rendered

    def dedupe_bos(self, tokens: Sequence[int]) -> Sequence[int]:
        """Drop a doubled leading BOS (a template's BOS spelled differently from the vocabulary's)."""
        if self.bos_id is not None and len(tokens) >= 2 and tokens[0] == tokens[1] == self.bos_id:
            return tokens[1:]
        return tokens


def no_template(model: str) -> ConfigError:
    return ConfigError("chat", model, "a model whose GGUF carries tokenizer.chat_template",
                       "this model has no chat template: pass a plain prompt (generate/stream, "
                       "power run without --chat), or give chat_template= explicitly")


def template_for(model_path: str | None, override: str | ChatTemplate | None) -> ChatTemplate:
    """The chat template of a loaded model: ``override`` (Jinja source or a ChatTemplate) or its GGUF's.

    Jinja source gets the GGUF's BOS/EOS facts like the file's own template (a model that is no GGUF
    file, e.g. the reference backend's, gets none), and the same source for the same file gives the
    same :class:`ChatTemplate`, compiled once."""
    if isinstance(override, ChatTemplate):
        return override
    if isinstance(override, str):
        stamp = _file_stamp(model_path)
        return _with_source(model_path if stamp else None, stamp, override, model_path or "model")
    if not model_path or not os.path.isfile(model_path):
        raise no_template(model_path or "this model")
    try:
        return ChatTemplate.from_gguf(model_path)
    except ArtifactError as exc:
        raise ConfigError("chat", model_path, "a readable GGUF with tokenizer.chat_template", str(exc)) from None


def _file_stamp(path: str | None) -> tuple[int, int] | None:
    """A regular file's (mtime, size); None when ``path`` names no file (e.g. ``reference:...``)."""
    if not path:
        return None
    try:
        st = os.stat(path)
    except (OSError, ValueError):
        return None
    return (st.st_mtime_ns, st.st_size) if stat.S_ISREG(st.st_mode) else None


@functools.lru_cache(maxsize=32)
def _with_source(path: str | None, stamp: tuple[int, int] | None, source: str, model: str) -> ChatTemplate:
    """``source`` with ``path``'s vocabulary facts (``stamp``: the file's mtime and size, so a replaced
    file is read again); cached, so a caller passing source text per request compiles it once."""
    if path is None:
        return ChatTemplate(source=source, model=model)
    try:
        return ChatTemplate.from_gguf(path, source=source)
    except ArtifactError as exc:
        raise ConfigError("chat", path, "a readable GGUF (its BOS/EOS tokens)", str(exc)) from None
