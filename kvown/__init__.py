"""kvown: KV-transfer ownership runtime for disaggregated LLM inference."""
__version__ = "0.1.0"
