"""Per-process state of veRL's workers: clients built once per event loop, not once per trajectory.

veRL builds an agent loop object and calls the reward function once per trajectory, in long-lived Ray
actors with their own event loops; HTTP clients are kept per running loop for the worker's lifetime.
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
