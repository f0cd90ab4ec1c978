"""The model geometry moepager needs, parsed from a Hugging Face config.json.

Each architecture file turns the raw dict into a `ModelConfig` (common fields) and keeps the raw dict for the
few settings only it reads (router flavour, MLA ranks ...). Both the transformers 5 spelling
(`rope_parameters`) and the 4.x / Hub spelling (`rope_theta` + `rope_scaling`) are accepted.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from moepager.errors import CheckpointError


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding settings."""

    theta: float
    """Base wavelength."""
    dim: int
    """Number of rotated channels per head."""
    scaling: Mapping[str, Any] | None = None
    """`rope_type` plus its parameters when not the default rotation (yarn, linear), else None."""


@dataclass(frozen=True)
class ModelConfig:
    """Geometry of a decoder-only MoE transformer."""

    architecture: str
    """The HF `architectures[0]` string."""
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool
    moe_layers: tuple[int, ...]
    """Indices of the decoder layers whose MLP is a routed MoE block."""
    num_experts: int
    top_k: int
    expert_intermediate_size: int
    """F: hidden width of one routed expert."""
    dense_intermediate_size: int
    """Hidden width of the MLP of non-MoE layers."""
    shared_intermediate_size: int = 0
    """Hidden width of the always-on shared expert(s); 0 when the model has none."""
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    raw: Mapping[str, Any] = field(default_factory=dict, repr=False, compare=False)
    """The whole config.json, for architecture-specific settings."""

    def __post_init__(self) -> None:
        """The architecture's invariants, checked when config.json is read (a bad value otherwise surfaces as a
        traceback at the first forward, or as a model that silently computes something else)."""
        positive = {"vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
                    "num_hidden_layers": self.num_layers, "num_attention_heads": self.num_heads,
                    "num_key_value_heads": self.num_kv_heads, "head_dim": self.head_dim,
                    "max_position_embeddings": self.max_position_embeddings}
        for key, value in positive.items():
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise CheckpointError(f"config.json: {key} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
                                  f"num_key_value_heads ({self.num_kv_heads})")
        if any(not 0 <= layer < self.num_layers for layer in self.moe_layers):
            raise CheckpointError(f"config.json: MoE layers {list(self.moe_layers)} lie outside the model's "
                                  f"{self.num_layers} layers")
        if self.moe_layers:
            if self.num_experts < 1 or self.expert_intermediate_size < 1:
                raise CheckpointError(f"config.json: a MoE model needs experts (num_experts {self.num_experts}, "
                                      f"expert intermediate size {self.expert_intermediate_size})")
            if not 1 <= self.top_k <= self.num_experts:
                raise CheckpointError(f"config.json: num_experts_per_tok ({self.top_k}) must be between 1 and the "
                                      f"number of experts ({self.num_experts})")
        if self.sliding_window is not None and self.sliding_window < 1:
            raise CheckpointError(f"config.json: sliding_window must be positive, got {self.sliding_window}")

    @property
    def num_moe_layers(self) -> int:
        return len(self.moe_layers)


def get(raw: Mapping[str, Any], key: str | tuple[str, ...], default: Any = ..., *,
        kind: type | tuple[type, ...] | None = None) -> Any:
    """Read `key` from config.json; a missing required key or a wrong type is a CheckpointError naming it.

    A tuple of keys means synonyms (the Hub and transformers 5 spell some keys differently): the first present
    one is read.
    """
    if isinstance(key, tuple):
        key = next((k for k in key if raw.get(k) is not None), key[0])
    if key not in raw or raw[key] is None:
        if default is ...:
            raise CheckpointError(f"config.json lacks required key '{key}'")
        return default
    value = raw[key]
    if kind is not None and not isinstance(value, kind):
        raise CheckpointError(f"config.json key '{key}' should be {kind}, got {value!r}")
    return value


def rope_from_raw(raw: Mapping[str, Any], dim: int, default_theta: float = 10000.0) -> RopeConfig:
    """Rotary settings from either config spelling; only default, linear and yarn rotations are supported."""
    params = dict(raw.get("rope_parameters") or {})
    legacy = raw.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", raw.get("rope_theta", default_theta)))
    scaling = {k: v for k, v in {**legacy, **params}.items() if k != "rope_theta"}
    rope_type = scaling.pop("rope_type", scaling.pop("type", "default"))
    if rope_type == "default":
        return RopeConfig(theta=theta, dim=dim)
    if rope_type not in ("linear", "yarn"):
        raise CheckpointError(f"rope type '{rope_type}' is not supported; supported: default, linear, yarn")
    return RopeConfig(theta=theta, dim=dim, scaling={"rope_type": rope_type, **scaling})


def eos_ids(raw: Mapping[str, Any]) -> tuple[int, ...]:
    eos = raw.get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
