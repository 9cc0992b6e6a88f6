"""Use a model without training it: no gradients for it, and no gradient communication."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from torch import nn

from fabric_multimodel.ddp.models import ddp_of


@contextmanager
def frozen(*modules: nn.Module) -> Iterator[None]:
    """Run ``modules`` as fixed functions: their parameters get no gradient and, under DDP, their
    forwards prepare no gradient reduction (no allreduce, no "unused parameters" error).

    Gradients still flow *through* the modules to their inputs, which is what a GAN's generator
    step needs from the discriminator. On exit, also by exception, every parameter's previous
    ``requires_grad`` is restored exactly. The DDP part only takes effect for forwards run inside
    the block, so put the forward inside it, not only the backward.

    Example::

        with frozen(disc):
            g_loss = loss_fn(disc(gen(z)), ones)
        fabric.backward(g_loss)  # allreduces gen's gradients only
    """
    for module in modules:
        if not isinstance(module, nn.Module):
            raise TypeError(f"frozen: expected torch.nn.Module arguments, got {type(module).__name__}.")
    params = list({id(p): p for m in modules for p in m.parameters()}.values())
    saved = [p.requires_grad for p in params]
    with ExitStack() as stack:
        for module in modules:
            ddp = ddp_of(module)
            if ddp is not None:
                # Without this DDP's forward prepares a reduction of this model's gradients that the
                # backward never completes (its parameters get none): the reducer is left waiting,
                # and with find_unused_parameters it allreduces zeros instead.
                stack.enter_context(ddp.no_sync())
        try:
            for p in params:
                p.requires_grad_(False)
            yield
        finally:
            for p, flag in zip(params, saved):
                p.requires_grad_(flag)
