"""The OpenAI API's request bodies (the fields moepager honours) and how they become sampling parameters.

Unset sampling fields take llama.cpp's defaults (runtime/sampling.py LLAMA_CPP_SAMPLING); `temperature: 0`
is greedy. Beyond OpenAI's fields, llama.cpp's and vLLM's `top_k`, `min_p` and `repetition_penalty` are accepted.
Range checks live in SamplingParams, so the server and the Python API refuse the same values the same way.

Bodies are validated strictly: a field of the wrong JSON type (`"max_tokens": "5"`, `"stream": "yes"`) is refused,
not coerced; an unknown field is refused with its name; OpenAI fields this server does not implement (`echo`,
`best_of`, `suffix`, `tools`, ...) are refused with the reason unless they carry their neutral value; `model` is
required, as OpenAI requires it. `user` is accepted and ignored (OpenAI's end-user id, for abuse monitoring).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from moepager.errors import InvalidRequestError
from moepager.runtime.sampling import SamplingParams, llama_cpp_sampling

STRICT = ConfigDict(extra="forbid", strict=True)
UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "echo": (False, "echo is not supported (the response holds the completion only)"),
    "best_of": (1, "best_of must be 1 (one completion per request)"),
    "suffix": (None, "suffix is not supported (no fill-in-the-middle)"),
    "logit_bias": (None, "logit_bias is not supported"),
    "tools": (None, "tools are not supported (no function calling)"),
    "tool_choice": (None, "tool_choice is not supported (no function calling)"),
    "parallel_tool_calls": (None, "parallel_tool_calls is not supported (no function calling)"),
    "functions": (None, "functions are not supported (no function calling)"),
    "function_call": (None, "function_call is not supported (no function calling)"),
    "response_format": (None, "response_format is not supported (no constrained decoding)"),
}
"""OpenAI request fields this server knows and does not implement: (the neutral value it accepts, why it refuses any
other)."""


UNSUPPORTED_ERROR = "unsupported_field"
"""The validation error type of such a field (the server answers 400 with its reason; `ctx.field` names it)."""



class StreamOptions(BaseModel):
    model_config = STRICT

    include_usage: bool = False
    """A last chunk, with no choices, carries the request's token usage."""


class Sampling(BaseModel):
    model_config = STRICT

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    ignore_eos: bool = False
    user: str | None = None
    """OpenAI's end-user id: accepted, not used."""

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for name, (neutral, reason) in UNSUPPORTED.items():
                value = data.get(name)
                if value is not None and value != neutral and value not in ([], {}):
                    raise PydanticCustomError(UNSUPPORTED_ERROR, reason, {"field": name})
            data = {k: v for k, v in data.items() if k not in UNSUPPORTED}
        return data

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        if self.n != 1:
            raise InvalidRequestError(f"n must be 1 (one completion per request), got {self.n}")
        stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        return llama_cpp_sampling(self.temperature, self.top_k, self.top_p, self.min_p, max_tokens=max_tokens,
                                  presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                                  repetition_penalty=self.repetition_penalty, seed=self.seed, stop=stop,
                                  ignore_eos=self.ignore_eos, logprobs=logprobs)


class CompletionRequest(Sampling):
    prompt: str | list[int] | list[str]
    max_tokens: int | None = 16
    """OpenAI's default for completions."""
    logprobs: int | None = None

    def prompt_value(self) -> str | list[int]:
        if isinstance(self.prompt, list) and self.prompt and isinstance(self.prompt[0], str):
            if len(self.prompt) != 1:
                raise InvalidRequestError("one prompt per request (a list of several prompts is not supported)")
            return self.prompt[0]  # type: ignore[return-value]
        if isinstance(self.prompt, list) and not self.prompt:
            raise InvalidRequestError("prompt is empty")
        return self.prompt  # type: ignore[return-value]


class TextPart(BaseModel):
    model_config = STRICT

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = STRICT

    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[TextPart]
    name: str | None = None
    """OpenAI's participant name: accepted, not used by chat templates here."""

    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class ChatCompletionRequest(Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None

    def chat_logprobs(self) -> int | None:
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequestError("top_logprobs needs logprobs: true")
        return (self.top_logprobs or 0) if self.logprobs else None
