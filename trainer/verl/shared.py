"""Per-process state of veRL's workers: clients built once per event loop, not once per trajectory.

veRL builds a new agent loop object for every trajectory and calls the reward function once per
trajectory, each in a long-lived Ray actor with its own event loop. HTTP clients (the retriever for the
rollout, the generator and judge for the reward) are therefore kept per running event loop and reused by
every trajectory that loop serves; they live as long as the worker process.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Callable
from typing import Any, TypeVar

T = TypeVar("T")

_RESOURCES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, dict[str, Any]] = weakref.WeakKeyDictionary()


def per_loop(name: str, factory: Callable[[], T]) -> T:
    """The running loop's `name` resource, built by `factory` on first use."""
    resources = _RESOURCES.setdefault(asyncio.get_running_loop(), {})
    if name not in resources:
        resources[name] = factory()
    return resources[name]  # type: ignore[no-any-return]
