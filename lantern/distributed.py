"""Data parallelism across processes: which images each rank makes, and how rank 0 gets them.

``torchrun --nproc_per_node N`` and ``accelerate launch`` both start one process per device and
tell each its place through the environment (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``); a plain
``python -m lantern.cli`` sets none of them and is rank 0 of 1. The rule that shares out a
request (:func:`shard`) depends only on the image count and the rank count, and every image keeps
its own seed (``lantern.run.image_seed`` of its place in the request), so the set of images
is the same whatever the number of processes. Ranks exchange Python objects through
``torch.distributed`` (gloo on CPUs, NCCL on GPUs); rank 0 alone writes the outputs.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from lantern.errors import LanternError, check


@dataclass(frozen=True)
class DistContext:
    """This process's place among the ranks of one job."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> DistContext:
        """From ``RANK`` / ``WORLD_SIZE`` / ``LOCAL_RANK`` (torchrun, accelerate); rank 0 of 1 when unset."""
        env = dict(os.environ) if env is None else env
        values = {}
        for name, default in (("RANK", 0), ("WORLD_SIZE", 1), ("LOCAL_RANK", 0)):
            text = env.get(name, str(default))
            try:
                values[name] = int(text)
            except ValueError:
                raise LanternError(f"environment variable {name} must be an integer, got {text!r}") from None
        ctx = cls(values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"])
        check(ctx.world_size >= 1 and 0 <= ctx.rank < ctx.world_size and ctx.local_rank >= 0,
              f"RANK={ctx.rank} / WORLD_SIZE={ctx.world_size} / LOCAL_RANK={ctx.local_rank}: expected "
              "0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0")
        return ctx

    def device(self, device: str) -> str:
        """This rank's device: ``cuda`` (or ``cuda:0``) becomes ``cuda:LOCAL_RANK`` under several
        ranks, so each process of a node drives its own GPU; other devices are kept."""
        if not self.enabled or not device.startswith("cuda"):
            return device
        return f"cuda:{self.local_rank}"


def shard(num_items: int, rank: int, world_size: int) -> range:
    """The request positions of ``rank``: contiguous blocks, the first ``num_items % world_size``
    ranks one item longer (5 items on 2 ranks: 0-2 and 3-4). Contiguous blocks keep each rank's
    images in request order, so rank 0 reassembles the request by concatenation."""
    base, extra = divmod(num_items, world_size)
    lo = rank * base + min(rank, extra)
    return range(lo, lo + base + (1 if rank < extra else 0))


def check_enough_items(num_items: int, ctx: DistContext, what: str = "images") -> None:
    """Every rank must get work: an idle rank means a launch the user did not intend."""
    check(num_items >= ctx.world_size,
          f"{num_items} {what} cannot be shared by {ctx.world_size} processes (WORLD_SIZE): launch at most "
          f"{num_items} processes, or request more {what}")


@contextlib.contextmanager
def process_group(ctx: DistContext, device: str) -> Iterator[None]:
    """The default process group for the body (gloo on CPUs, NCCL on GPUs), destroyed afterwards;
    nothing for a single process. A rank that fails stops the others at their next exchange
    (the launcher then ends them), so a bad input never hangs a job."""
    if not ctx.enabled:
        yield
        return
    import torch
    import torch.distributed as dist

    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.set_device(ctx.local_rank)
    if dist.is_initialized():  # someone else's (an embedding program's): theirs to destroy
        yield
        return
    before_process_group()
    dist.init_process_group("nccl" if cuda else "gloo", rank=ctx.rank, world_size=ctx.world_size,
                            timeout=datetime.timedelta(minutes=30))
    failed = True
    try:
        yield
        failed = False
    finally:
        end_process_group(failed=failed)


def before_process_group() -> None:
    """Call before creating the default process group, so that :func:`end_process_group` can free it.

    ``torch.distributed.nn.functional`` declares ``group=group.WORLD`` defaults, evaluated when the
    module is first imported. ``torch._dynamo`` imports it, and creating an optimizer or compiling
    imports ``torch._dynamo``, so in a training run it is first imported after the group exists.
    Its defaults then hold the group for good: ``destroy_process_group`` drops every other
    reference, but the gloo threads live on to interpreter exit, and there now and then end the
    process (issue 30). Imported first, the defaults are None.
    """
    import torch.distributed as dist

    if dist.is_available() and not dist.is_initialized():
        import torch.distributed.nn.functional  # noqa: F401


def end_process_group(*, failed: bool = False) -> None:
    """Destroy the default process group now, if there is one (issue 30).

    Left to interpreter exit, the group and its gloo threads (``gloo_tcp_loop``,
    ``pt_gloo_runloop``) outlive Python: a C++ thread that then drops a tensor takes the GIL of
    a finalizing interpreter, which ends the thread with ``pthread_exit``; that unwind through a
    ``noexcept`` destructor is ``std::terminate``, "terminate called without an active
    exception", now and then, when exit is slow (a loaded machine). Destroying the group here
    joins those threads while Python is whole, provided nothing else holds the group
    (:func:`before_process_group`).

    No barrier first: a rank whose peers are done with it may leave (rank 0 still evaluating and
    writing must not hold the others up to the timeout, nor hang them if it fails). After a
    failure, only gloo is torn down (locally; the peers see the sockets close and fail at once):
    NCCL's teardown may wait on peers that never come.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return
    if failed and dist.get_backend() != "gloo":
        return
    dist.destroy_process_group()


def all_gather(obj: Any, ctx: DistContext) -> list[Any]:
    """Every rank's ``obj``, in rank order, on every rank (``[obj]`` for a single process)."""
    if not ctx.enabled:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * ctx.world_size
    dist.all_gather_object(out, obj)
    return out


def gather_to_main(obj: Any, ctx: DistContext) -> list[Any] | None:
    """Every rank's ``obj``, in rank order, on rank 0 (None elsewhere): what only rank 0 writes
    need not travel to every rank."""
    if not ctx.enabled:
        return [obj]
    import torch.distributed as dist

    out: list[Any] | None = [None] * ctx.world_size if ctx.is_main else None
    dist.gather_object(obj, out, dst=0)
    return out


def agree(error: str | None, ctx: DistContext) -> None:
    """Raise on every rank if any rank has an error (the lowest rank's message): a check that
    one rank makes (rank 0 reads the output folder) fails the whole job, not one process."""
    errors = [e for e in all_gather(error, ctx) if e is not None]
    if errors:
        raise LanternError(errors[0])
