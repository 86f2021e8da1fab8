"""Hooks on the user's model that do not keep the engine alive.

The engine registers hooks on the model's parameters and modules, and the model usually
outlives the engine (a notebook or a hyperparameter loop builds several). A hook holding a bound
method of the gradient reducer or of the stage-3 parameters would keep their buffers and shards
alive, so each hook holds its method weakly and does nothing once the object is gone.
"""
from __future__ import annotations

import weakref
from typing import Any, Callable


class WeakHook:
    """Calls `method(*bound, *hook_args)` while the method's object lives; afterwards a no-op
    (returns None: torch then leaves the hook's input or output as it is)."""

    def __init__(self, method: Callable[..., Any], *bound: Any) -> None:
        self.method = weakref.WeakMethod(method)
        self.bound = bound  # plain values only (an index): anything here is held strongly

    def __call__(self, *hook_args: Any) -> Any:
        method = self.method()
        return None if method is None else method(*self.bound, *hook_args)
