"""Hook helpers shared by the gradient reducers and the stage-3 runtime."""

from __future__ import annotations

import weakref

__all__ = ["WeakHook"]


class WeakHook:
    """A tensor hook that does not keep its owner alive.

    Hooks on parameters are held from C++ autograd metadata, which Python's garbage collector cannot
    traverse: a hook that referenced the runtime (and through it the parameters) would make the whole
    model uncollectable.  This one holds weak references and does nothing once its owner is gone.
    """

    def __init__(self, method, *args) -> None:
        self.method = weakref.WeakMethod(method)
        self.args = [weakref.ref(a) for a in args]

    def __call__(self, *hook_args):
        method = self.method()
        args = [a() for a in self.args]
        if method is None or any(a is None for a in args):
            return None
        return method(*args, *hook_args)
