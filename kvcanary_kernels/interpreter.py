"""Whether the canary's Triton kernels run in Triton's interpreter, the only way they take CPU
tensors."""

from __future__ import annotations


def interpreted() -> bool:
    """Whether the kernels were built for Triton's interpreter (TRITON_INTERPRET on when their
    modules were first imported; this loads them)."""
    from .view_verify import _verify_view_kernel

    return type(_verify_view_kernel).__name__ == "InterpretedFunction"
