"""The async Python SDK: `AsyncClient` over HTTP (OpenAI routes, SSE streaming).

An in-process client over a cluster started from Python (no HTTP, same methods) is
planned beside it.
"""

from .client import AsyncClient
from .errors import APIConnectionError, APIError, APITimeoutError
from .types import (ChatChoice, ChatCompletion, ChatCompletionChunk, ChatDelta, ChatMessage,
                    Completion, CompletionChoice, Model, ModelList, Usage)

__all__ = ["AsyncClient", "APIError", "APIConnectionError", "APITimeoutError", "Completion",
           "CompletionChoice", "ChatCompletion", "ChatCompletionChunk", "ChatChoice",
           "ChatDelta", "ChatMessage", "Model", "ModelList", "Usage"]
