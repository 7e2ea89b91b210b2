"""A model's own Hugging Face tokenizer, loaded from a local directory.

Why: clients count tokens with the Hugging Face tokenizer of the model they think they
talk to (vLLM's benchmarks do, and so does anyone using ``AutoTokenizer``). Serving with
the same files — ``tokenizer.json`` through ``tokenizers`` as vLLM does, the
``chat_template`` rendered with jinja2 the way transformers renders it — makes
``/tokenize``, ``usage`` and streamed text agree with such a client exactly.

:class:`HFTokenizer` has the interface of the emulator's ``model.Tokenizer`` (``encode``,
``decode``, ``check_ids``, ``vocab_size``, ``bos_token_id``, ``eos_token_id``) plus
:meth:`HFTokenizer.render_chat` and :meth:`HFTokenizer.detokenizer` for streaming. There
is no model hub here: only a local directory loads, anything else is refused by path.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
import jinja2.nodes
import jinja2.sandbox
from tokenizers import Tokenizer as _RustTokenizer

from bidir_kv.engine.model import ChatTemplateError, content_text
from bidir_kv.errors import ConfigError

__all__ = ["HFTokenizer", "IncrementalDetokenizer", "TokenizerLoadError"]

# The named special tokens transformers hands a chat template as variables.
_TEMPLATE_TOKENS = (
    "bos_token",
    "eos_token",
    "unk_token",
    "sep_token",
    "pad_token",
    "cls_token",
    "mask_token",
)
_REPLACEMENT = "\ufffd"


class TokenizerLoadError(ConfigError):
    """A tokenizer directory that cannot be loaded; the message names the path."""


class _GenerationTag(jinja2.ext.Extension):
    """``{% generation %}...{% endgeneration %}`` marks assistant text for training
    masks in some templates; for serving it renders its body unchanged."""

    tags = {"generation"}  # noqa: RUF012 - jinja's Extension API declares it so

    def parse(self, parser: Any) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    @staticmethod
    def _body(caller: Callable[[], str]) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(
    x: Any,
    ensure_ascii: bool = False,
    indent: Any = None,
    separators: Any = None,
    sort_keys: bool = False,
) -> str:
    # transformers' variant: no HTML escaping, non-ASCII kept (jinja's own escapes both)
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> jinja2.Environment:
    env = jinja2.sandbox.ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[_GenerationTag, jinja2.ext.loopcontrols],
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env


def _token_text(value: Any) -> str | None:
    """A special token as ``tokenizer_config.json`` stores it: a string or an AddedToken."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return str(value["content"])
    return None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise TokenizerLoadError(f"cannot read {path}: {exc}") from None
    if not isinstance(data, dict):
        raise TokenizerLoadError(f"{path} must hold a JSON object")
    return data


def _find_template(directory: Path, config: Mapping[str, Any]) -> str | None:
    """``chat_template`` of the config (a string, or named templates: the default one),
    else ``chat_template.jinja`` beside it (where transformers 5 saves it)."""
    tpl = config.get("chat_template")
    if isinstance(tpl, list):
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, Mapping)}
        tpl = named.get("default")
    if isinstance(tpl, str):
        return tpl
    jinja_file = directory / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    return None


def _template_messages(messages: Any) -> list[dict[str, Any]]:
    """Validated copies: keys whose value is None dropped (as transformers does), content
    flattened to a string."""
    if not isinstance(messages, list) or not messages:
        raise ChatTemplateError("messages must be a non-empty list")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, Mapping) or not isinstance(msg.get("role"), str):
            raise ChatTemplateError(f"messages[{i}] must be an object with a string 'role'")
        copy = {str(k): v for k, v in msg.items() if v is not None}
        copy["content"] = content_text(msg.get("content"), i, separator="\n")
        out.append(copy)
    return out


class HFTokenizer:
    """``tokenizer.json`` + ``tokenizer_config.json`` of a local model directory."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        directory = Path(path).expanduser()
        if not directory.is_dir():
            raise TokenizerLoadError(
                f"tokenizer {os.fspath(path)!r}: {directory.absolute()} is not a local "
                "directory (no model hub here: pass a directory holding tokenizer.json)"
            )
        tok_file = directory / "tokenizer.json"
        if not tok_file.is_file():
            raise TokenizerLoadError(f"tokenizer: {tok_file.absolute()} does not exist")
        try:
            self._tok = _RustTokenizer.from_file(str(tok_file))
        except Exception as exc:  # tokenizers raises a bare Exception on bad files
            raise TokenizerLoadError(f"cannot load {tok_file}: {exc}") from None
        cfg_file = directory / "tokenizer_config.json"
        config = _read_json(cfg_file) if cfg_file.is_file() else {}
        self.path = directory
        self.vocab_size: int = self._tok.get_vocab_size(with_added_tokens=True)
        self.special_tokens: dict[str, str] = {
            k: t for k in _TEMPLATE_TOKENS if (t := _token_text(config.get(k))) is not None
        }
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.pad_token = self.special_tokens.get("pad_token")
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)
        self.pad_token_id = self._id_of(self.pad_token)
        limit = config.get("model_max_length")
        self.model_max_length: int | None = limit if isinstance(limit, int) else None
        self.chat_template = _find_template(directory, config)
        self._template: jinja2.Template | None = None
        self._word_ids: tuple[int, ...] | None = None
        if self.chat_template is not None:
            try:
                self._template = _environment().from_string(self.chat_template)
            except jinja2.TemplateError as exc:
                raise TokenizerLoadError(f"chat template of {directory}: {exc}") from None

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def __repr__(self) -> str:
        return f"HFTokenizer({os.fspath(self.path)!r}, vocab_size={self.vocab_size})"

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` applies the post-processor (BOS)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids`` (incomplete UTF-8 becomes U+FFFD); out-of-vocabulary ids raise."""
        return self._tok.decode(self.check_ids(ids), skip_special_tokens=skip_special_tokens)

    def check_ids(self, ids: Sequence[Any]) -> list[int]:
        """Validate a token-id prompt; raise naming the first bad id."""
        out = []
        for i, t in enumerate(ids):
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < self.vocab_size:
                raise ValueError(
                    f"prompt token {i} is {t!r}; token ids must be ints in [0, {self.vocab_size})"
                )
            out.append(t)
        return out

    def token_strs(self, ids: Sequence[int]) -> list[str]:
        """The vocabulary entries of ``ids`` (``/tokenize``'s ``token_strs``)."""
        return [self._tok.id_to_token(t) or "" for t in self.check_ids(ids)]

    def word_ids(self) -> tuple[int, ...]:
        """Ids of whole words (a space, then letters) that are their own encoding.

        Why: the emulator generates by sampling ids; any concatenation of these decodes
        to text that re-encodes to the very same ids, so a multi-turn client's next
        prompt stays a token-exact continuation (prefix-cache hits) as with
        ``model.WORDS``. Computed once (about 4 µs an id).
        """
        if self._word_ids is None:
            words = []
            for i in range(self.vocab_size):
                text = self._tok.decode([i], skip_special_tokens=True)
                if (
                    len(text) > 1
                    and text[0] == " "
                    and text[1:].isalpha()
                    and self._tok.encode(text, add_special_tokens=False).ids == [i]
                ):
                    words.append(i)
            self._word_ids = tuple(words)
        return self._word_ids

    def render_chat(
        self, messages: Any, add_generation_prompt: bool = True, **template_vars: Any
    ) -> str:
        """The prompt text of ``messages`` under the directory's chat template.

        Variables are those transformers passes (``messages``, ``add_generation_prompt``,
        ``tools``, ``documents``, the named special tokens); ``template_vars`` (a request's
        ``chat_template_kwargs``) override them. Raises :class:`ChatTemplateError`.
        """
        if self._template is None:
            raise ChatTemplateError(f"the tokenizer at {self.path} has no chat_template")
        variables: dict[str, Any] = {"tools": None, "documents": None, **self.special_tokens}
        variables.update(template_vars)
        variables.update(
            messages=_template_messages(messages), add_generation_prompt=add_generation_prompt
        )
        try:
            return self._template.render(**variables)
        except (jinja2.TemplateError, TypeError, ValueError, LookupError, AttributeError) as exc:
            raise ChatTemplateError(f"chat template failed: {exc}") from None

    def detokenizer(
        self, skip_special_tokens: bool = True, context: Sequence[int] = ()
    ) -> IncrementalDetokenizer:
        """A streaming decoder for one sequence; see :class:`IncrementalDetokenizer`."""
        return IncrementalDetokenizer(self.decode, skip_special_tokens, context)


class IncrementalDetokenizer:
    """Token-by-token text whose pieces concatenate to the full decode.

    Each step decodes a short window of recent ids twice — without and with the new
    ones — and emits the difference. Text ending in U+FFFD (a character whose UTF-8
    bytes are split across tokens) is held back until the next token completes it;
    :meth:`flush` releases whatever is still held at the end. Decoding a window rather
    than single tokens also keeps decoders that strip a leading space (SentencePiece)
    right. ``context`` (e.g. the prompt's last ids) only primes the window; it is never
    emitted.
    """

    _CONTEXT = 4

    def __init__(
        self,
        decode: Callable[[Sequence[int], bool], str],
        skip_special_tokens: bool = True,
        context: Sequence[int] = (),
    ) -> None:
        self._decode = decode
        self._skip = skip_special_tokens
        self._ids: list[int] = list(context[-self._CONTEXT :]) if context else []
        self._prefix = 0  # window start
        self._read = len(self._ids)  # ids before this are emitted
        self.text = ""

    def push(self, token_id: int) -> str:
        """Add one generated id; return the text it completes (may be empty)."""
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix : self._read], self._skip)
        after = self._decode(self._ids[self._prefix :], self._skip)
        if len(after) <= len(before) or after.endswith(_REPLACEMENT):
            return ""
        piece = after[len(before) :]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += piece
        return piece

    def flush(self) -> str:
        """Text still held back (incomplete characters, as U+FFFD) at the end."""
        before = self._decode(self._ids[self._prefix : self._read], self._skip)
        after = self._decode(self._ids[self._prefix :], self._skip)
        piece = after[len(before) :]
        self._prefix = self._read = len(self._ids)
        self.text += piece
        return piece
