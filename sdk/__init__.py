"""The async Python SDK: `AsyncClient` over HTTP (OpenAI routes, SSE streaming), and
`LocalClient` / `start_local(...)`: the same methods over a backend (one engine, or a
cluster of rank actors) started in this process, without HTTP.
"""

from .client import AsyncClient
from .errors import APIConnectionError, APIError, APITimeoutError
from .local import LocalClient, start_local
from .types import (ChatChoice, ChatCompletion, ChatCompletionChunk, ChatDelta, ChatMessage,
                    Completion, CompletionChoice, Model, ModelList, Usage)

__all__ = ["AsyncClient", "LocalClient", "start_local", "APIError", "APIConnectionError",
           "APITimeoutError", "Completion", "CompletionChoice", "ChatCompletion", "ChatCompletionChunk", "ChatChoice",
           "ChatDelta", "ChatMessage", "Model", "ModelList", "Usage"]
