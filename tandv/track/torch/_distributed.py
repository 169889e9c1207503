"""The PyTorch side of distributed tracking: ``torch.distributed`` collectives for the
cross-rank merge (:mod:`tandv.track.common.distributed`), DDP and FSDP2 unwrapping, and
each tensor's role.

Roles (what each rank holds of a tensor), under the assumption that plain tensors are
data parallel:

* a ``DTensor`` (FSDP2's parameters, gradients and optimizer state; tensor-parallel
  weights and activations) is summarized through its local shard (``to_local()``; the
  full tensor is never gathered), role :class:`~tandv.track.common.distributed.Shard`
  with an id that names the shard: its coordinates on the mesh dimensions that shard it,
  so that replicas over the ``Replicate`` dimensions count once. An activation's id also
  names its mesh's ranks (another data-parallel group holds other data at the same
  coordinates); a parameter's does not (another data-parallel group holds a replica).
  A ``Partial`` placement (pending sums) is not a tensor of its own and is skipped.
* a plain parameter, its gradient or optimizer state is the same on every rank (DDP
  all-reduces the gradients before the optimizer): ``REPLICATED``.
* a plain activation or output gradient is this rank's part of the global batch:
  ``LOCAL``.
"""

from __future__ import annotations

import functools
import hashlib
import sys
import warnings
from datetime import timedelta
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

from ..common.distributed import LOCAL, REPLICATED, RankMerger, Role, Shard
from ..common.rows import TensorKey

__all__ = ["TorchCollectives", "TorchRanks", "distributed_world", "unwrap_ddp", "module_type"]


def distributed_world() -> bool:
    """Whether ``torch.distributed`` is initialized with more than one rank."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def unwrap_ddp(module: nn.Module) -> nn.Module:
    """The module a ``DistributedDataParallel`` (or ``DataParallel``) wraps, else ``module``:
    its rows carry the model's own paths, without the ``module.`` prefix."""
    from torch.nn.parallel import DataParallel, DistributedDataParallel

    while isinstance(module, (DistributedDataParallel, DataParallel)):
        module = module.module
    return module


def module_type(m: nn.Module) -> str:
    """The class name of ``m`` for its rows: FSDP2 (``fully_shard``) swaps a module's class
    for a generated ``FSDP<Class>``; the rows name the model's own class, as unsharded."""
    cls = type(m)
    fsdp = _fsdp_module_class()
    if fsdp is not None and issubclass(cls, fsdp):
        for base in cls.__bases__:
            if base is not fsdp and not issubclass(base, fsdp):
                return base.__name__
    return cls.__name__


@functools.cache
def _fsdp_module_class() -> type | None:
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - older torch
        return None
    return FSDPModule


@functools.cache
def _dtensor_class() -> type | None:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # pragma: no cover - older torch
        return None
    return DTensor


def is_dtensor(x: torch.Tensor) -> bool:
    """Whether ``x`` is a DTensor (none can exist before their module is imported: a
    single-process run never imports it for this check)."""
    if "torch.distributed.tensor" not in sys.modules:
        return False
    cls = _dtensor_class()
    return cls is not None and isinstance(x, cls)


def _shard_id(x: Any, batch_split: bool) -> int | None:
    """The id of the shard ``x`` (a DTensor) holds on this rank (see the module notes), or
    ``None`` when a placement is ``Partial``."""
    return _placement_id(x.device_mesh, tuple(x.placements), batch_split)


@functools.cache
def _placement_id(mesh: Any, placements: tuple[Any, ...], batch_split: bool) -> int | None:
    """:func:`_shard_id` by mesh and placements, computed once per pair on this rank (the
    parameters of one model share a few: the step does not hash each tensor again)."""
    from torch.distributed.tensor import Replicate, Shard

    coord = mesh.get_coordinate()
    parts: list[Any] = []
    for i, p in enumerate(placements):
        if isinstance(p, Shard):
            parts.append((i, p.dim, -1 if coord is None else coord[i]))
        elif not isinstance(p, Replicate):  # Partial: a pending sum, not the tensor's values
            return None
    if coord is None:  # this rank is outside the mesh: it holds nothing of the tensor
        parts.append(("outside", dist.get_rank()))
    if batch_split:
        parts.append(tuple(mesh.mesh.flatten().tolist()))
    digest = hashlib.blake2b(repr(parts).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 12  # 52 bits: exact in a float64


class TorchCollectives:
    """The merge's collectives (:class:`~tandv.track.common.distributed.Collectives`) over a
    gloo group of all ranks, created for the tracker with timeout ``timeout`` seconds
    (summaries are host arrays: gloo carries them whatever the training backend, NCCL
    included, and its collectives give up after the timeout)."""

    def __init__(self, timeout: float) -> None:
        if not dist.is_gloo_available():  # pragma: no cover - builds without gloo
            raise RuntimeError(
                "tandv: merging a distributed run's summaries needs torch.distributed's gloo "
                "backend, which this PyTorch build lacks; pass distributed=False to track "
                "each rank alone"
            )
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        self.timeout = float(timeout)
        self.group: Any = dist.new_group(backend="gloo", timeout=timedelta(seconds=self.timeout))

    def all_gather_ints(self, values: np.ndarray) -> np.ndarray:
        t = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        out = [torch.empty_like(t) for _ in range(self.world_size)]
        dist.all_gather(out, t, group=self._open_group())
        return torch.stack(out).numpy()

    def gather(self, vector: np.ndarray, dst: int) -> list[np.ndarray] | None:
        t = torch.from_numpy(np.ascontiguousarray(vector, dtype=np.float64))
        out = [torch.empty_like(t) for _ in range(self.world_size)] if self.rank == dst else None
        dist.gather(t, out, dst=dst, group=self._open_group())
        return None if out is None else [o.numpy() for o in out]

    def broadcast_text(self, text: str | None, src: int) -> str:
        box: list[Any] = [text]
        dist.broadcast_object_list(box, src=src, group=self._open_group())
        return str(box[0])

    def _open_group(self) -> Any:
        """The group (``None`` would mean the default group: refused after :meth:`close`)."""
        if self.group is None:
            raise RuntimeError("tandv: the tracker is closed: its gloo group was destroyed")
        return self.group

    def close(self) -> None:
        """Destroy the tracker's gloo group and drop it (idempotent). A gloo group that has
        run collectives and lives until the interpreter exits can abort the process there
        (its worker threads outlive Python: "terminate called without an active
        exception"; 7 exits in 20 measured with torch 2.13), and torch leaves the
        destruction to whoever created the group. Nothing is left to do when the program
        destroyed every group first (``destroy_process_group()``)."""
        group, self.group = self.group, None
        if group is not None and dist.is_initialized():
            dist.destroy_process_group(group)


class TorchRanks:
    """One tracker's view of a distributed run: the merger handed to its recorder, and
    the role of each row this rank observed (noted as its tensors are summarized)."""

    def __init__(self, timeout: float, rank_logs: bool) -> None:
        self.comm = TorchCollectives(timeout)
        self._roles: dict[TensorKey, Role] = {}
        self.merger = RankMerger(self.comm, self._role_of, rank_logs=rank_logs)

    def _role_of(self, key: TensorKey) -> Role:
        return self._roles[key]

    def note(self, key: TensorKey, role: Role) -> None:
        self._roles[key] = role


_warned_partial: set[str] = set()


def local_part(
    x: torch.Tensor, key: TensorKey, batch_split: bool, ranks: TorchRanks | None
) -> torch.Tensor | None:
    """The tensor to summarize for ``x`` on this rank (its local shard for a DTensor), its
    role noted in ``ranks``; ``None`` to skip it (a ``Partial`` DTensor). ``batch_split``:
    ``x`` is an activation or output gradient (``LOCAL`` when plain)."""
    if not is_dtensor(x):
        if ranks is not None:
            ranks.note(key, LOCAL if batch_split else REPLICATED)
        return x
    dt: Any = x  # a DTensor
    sid = _shard_id(dt, batch_split)
    if sid is None:
        if key.name not in _warned_partial:
            _warned_partial.add(key.name)
            warnings.warn(
                f"tandv: {key.name!r} ({key.tensor_type}) is a DTensor with a Partial "
                f"placement {tuple(dt.placements)}: its local values are pending sums, not the "
                f"tensor; it is not tracked",
                RuntimeWarning,
                stacklevel=4,
            )
        return None
    if ranks is not None:
        ranks.note(key, Shard(sid))
    return dt.to_local()
