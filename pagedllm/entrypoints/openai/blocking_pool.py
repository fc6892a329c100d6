"""A small fixed pool of threads for a request's blocking work (tokenizing prompts, rendering chat
templates, decoding token lists), so that the event loop keeps answering other requests and /health
while a 15 MB prompt is tokenized. The tokenizers library releases the GIL while it encodes, and a
chat-template render is bounded in time (chat_render), so a few threads are enough and none is held
for long."""
from __future__ import annotations

import asyncio
import contextvars
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")

# Fixed, not per core: the work is mostly outside the GIL or short, and more threads would only let
# more large requests hold memory at once.
NUM_WORKERS = 4

_pool: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=NUM_WORKERS, thread_name_prefix="pagedllm-request-work")
    return _pool


async def run_blocking(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """fn(*args, **kwargs) on the pool; its exception, if any, is raised here."""
    call = functools.partial(contextvars.copy_context().run, fn, *args, **kwargs)
    return await asyncio.get_running_loop().run_in_executor(_executor(), call)
