"""Requests, sampling, tokenization, generation and the user-facing `LLM` API."""
