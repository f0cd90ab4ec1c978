"""User-facing errors: each carries one actionable line; the CLI prints it without a traceback."""


class MoepagerError(Exception):
    """Base class of every error caused by bad input rather than a bug."""


class CheckpointError(MoepagerError):
    """A checkpoint directory, its config or its safetensors files are missing, unreadable or inconsistent."""


class UnsupportedArchitectureError(MoepagerError):
    """config.json names an architecture moepager has no model code for."""


class InvalidRequestError(MoepagerError):
    """A prompt or sampling parameter is out of range."""


class BudgetError(MoepagerError):
    """A memory budget is malformed, below the minimum the model needs, or larger than the machine has."""


class NumericalError(MoepagerError):
    """A forward pass produced NaN or infinity (corrupt weights, or a dtype that overflows)."""


class ConfigError(MoepagerError):
    """An option, or a combination of options, that this model or machine cannot run."""


class Unavailable(MoepagerError):
    """The engine can no longer run requests (a worker process it needs was lost): a server answers 503 from then on."""
