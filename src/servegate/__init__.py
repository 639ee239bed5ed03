"""servegate: an OpenAI-compatible LLM inference gateway with an endpoint picker."""

__version__ = "0.1.0"
