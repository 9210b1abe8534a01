"""shape ops."""

from __future__ import annotations

from ._op import OpKernel

OPS: list[OpKernel] = []
