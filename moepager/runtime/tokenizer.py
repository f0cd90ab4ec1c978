"""Tokenizer from tokenizer.json (the `tokenizers` library), chat template from tokenizer_config.json.

The chat template is rendered with jinja2 the way transformers renders it (sandboxed, trim_blocks,
lstrip_blocks, `raise_exception`), so `--chat` produces the same prompt text.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from jinja2.exceptions import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from moepager.errors import CheckpointError, InvalidRequestError


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as strings or as {"content": ...} dicts."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


class Tokenizer:
    def __init__(self, directory: Path):
        path = directory / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(f"'{directory}' has no tokenizer.json; text prompts need one")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception on malformed files
            raise CheckpointError(f"{path} could not be read: {e}") from e
        cfg_path = directory / "tokenizer_config.json"
        try:
            self.config: dict[str, Any] = json.loads(cfg_path.read_text(encoding="utf-8")) if cfg_path.exists() else {}
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path} is not valid JSON: {e}") from e
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.chat_template: str | None = self.config.get("chat_template")

    @functools.cached_property
    def max_token_chars(self) -> int:
        """The most characters one token spans (its vocabulary string's length: a byte-level token's string has one
        character per byte, and a character is at least one byte). A text of n characters is at least
        n / max_token_chars tokens: what lets a server refuse an overlong prompt without tokenising it."""
        return max((len(t) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.token_to_id(self.eos_token) if self.eos_token else None

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=True)

    def apply_chat_template(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise InvalidRequestError("this model's tokenizer_config.json has no chat_template; drop --chat")
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env.globals["raise_exception"] = raise_exception
        try:
            return env.from_string(self.chat_template).render(
                messages=list(messages), add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as e:
            raise InvalidRequestError(f"chat template failed: {e}") from e
