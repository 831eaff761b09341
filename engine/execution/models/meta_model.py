"""A model's modules built on the meta device with torch's initializers skipped.

Why skipped: a GGUF file's tensors replace every parameter, so the initial values are never
read; and on meta, `nn.init.normal_` (an embedding's reset) runs through torch's Python
reference ops, whose first call imports torch._dynamo and sympy: 150 MB of resident modules in
a serving process that compiles nothing (issue 60's bound leaves 0.5 GB for all that is neither
weights nor KV pool)."""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

# torch.nn.init's in-place initializers: every module's reset_parameters reaches its tensors through these
_INITIALIZERS = ("constant_", "dirac_", "eye_", "kaiming_normal_", "kaiming_uniform_", "normal_", "ones_",
                 "orthogonal_", "sparse_", "trunc_normal_", "uniform_", "xavier_normal_", "xavier_uniform_", "zeros_")


def meta_model(model_class: Callable[[Any], nn.Module], config: Any) -> nn.Module:
    """model_class(config) with every parameter and buffer on the meta device, no initializer run."""
    with torch.device("meta"), _initializers_skipped():
        return model_class(config)


def _untouched(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


@contextmanager
def _initializers_skipped() -> Iterator[None]:
    # Module attributes, restored on exit: the engine builds its model on one thread, before any step.
    saved = {name: getattr(nn.init, name) for name in _INITIALIZERS}
    try:
        for name in saved:
            setattr(nn.init, name, _untouched)
        yield
    finally:
        for name, initializer in saved.items():
            setattr(nn.init, name, initializer)
