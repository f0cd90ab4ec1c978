"""moepager: run Mixture-of-Experts LLMs whose experts do not fit in fast memory."""

from moepager.runtime.llm import LLM
from moepager.runtime.sampling import SamplingParams

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"
