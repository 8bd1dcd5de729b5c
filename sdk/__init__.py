"""The async Python SDK: `AsyncClient` over HTTP (OpenAI routes, SSE streaming; the wire
types are `phalanx.openai_types`, shared with the server). It imports nothing of the
server: the same methods over a backend started in this process, without HTTP, are the
server's `phalanx.server.LocalClient` / `start_local(...)`.
"""

from .client import AsyncClient
from .errors import APIConnectionError, APIError, APITimeoutError
from ..openai_types import (ChatChoice, ChatCompletion, ChatCompletionChunk, ChatDelta, ChatMessage,
                    Completion, CompletionChoice, Model, ModelList, Usage)

__all__ = ["AsyncClient", "APIError", "APIConnectionError",
           "APITimeoutError", "Completion", "CompletionChoice", "ChatCompletion", "ChatCompletionChunk", "ChatChoice",
           "ChatDelta", "ChatMessage", "Model", "ModelList", "Usage"]
