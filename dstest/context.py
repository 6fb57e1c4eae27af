"""The per-rank context a spec receives as its first argument."""

from __future__ import annotations

import contextlib
import threading
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    import numpy as np

    from dstest.groups import GroupBuilder
    from dstest.targets.base import Target
    from dstest.trace import CommView

__all__ = ["RankContext", "current_context", "rank_seed"]


def rank_seed(seed: int, rank: int) -> int:
    """The seed of rank ``rank``'s generator: distinct per rank, identical run after run (E5)."""
    return zlib.crc32(f"{seed}:{rank}".encode()) & 0x7FFF_FFFF


_CURRENT = threading.local()
_GENERATOR_LOCK = threading.Lock()


def current_context() -> RankContext | None:
    """The RankContext of the rank running on this thread (or process), if any."""
    return getattr(_CURRENT, "ctx", None)


@dataclass(kw_only=True)
class RankContext:
    """What one rank of a world knows about itself.

    ``generator`` is this rank's own seeded RNG (E5). Threads of one process share torch's global RNG, so
    draw through ``ctx.randn``/``ctx.rand``/``ctx.randint`` (or pass ``generator=ctx.generator``) to get
    numbers that do not depend on how the ranks were scheduled.

    Worlds make the context; the spec layer binds the system under test onto it (:meth:`bind_target`)
    before the body runs, so ``ctx.target`` is whatever ``--dstest-target`` / ``dstest.run(target=)``
    named (``target_name`` is its name).
    """

    rank: int
    world_size: int
    world: str
    device: torch.device
    seed: int = 0
    target_name: str | None = field(default=None, init=False)
    _generator: torch.Generator | None = field(default=None, init=False, repr=False)
    _groups: GroupBuilder | None = field(default=None, init=False, repr=False)
    _target: Target | None = field(default=None, init=False, repr=False)
    _target_factory: Callable[[], Target] | None = field(default=None, init=False, repr=False)
    _comm: CommView | None = field(default=None, init=False, repr=False)

    @property
    def generator(self) -> torch.Generator:
        """This rank's own CPU generator, seeded with :func:`rank_seed` (E5); made on first use (a run whose
        body never draws from it does not pay for it)."""
        generator = self._generator
        if generator is None:
            with _GENERATOR_LOCK:  # a rank's helper thread may ask at the same time: one generator per context
                if self._generator is None:
                    made = torch.Generator(device="cpu")
                    made.manual_seed(rank_seed(self.seed, self.rank))
                    self._generator = made
                generator = self._generator
        return generator

    # -- random data -----------------------------------------------------------------------------
    def randn(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Normal samples from this rank's generator, on this rank's device."""
        return torch.randn(*shape, generator=self.generator, dtype=dtype).to(self.device)

    def rand(self, *shape: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return torch.rand(*shape, generator=self.generator, dtype=dtype).to(self.device)

    def randint(self, low: int, high: int, shape: Sequence[int], dtype: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.randint(low, high, tuple(shape), generator=self.generator, dtype=dtype).to(self.device)

    def numpy_rng(self) -> np.random.Generator:
        import numpy as np

        return np.random.default_rng([self.seed, self.rank])

    # -- helpers bound to this rank ---------------------------------------------------------------
    @property
    def groups(self) -> GroupBuilder:
        """Builders for the hard group topologies (absent, single-rank, non-member, subgroups)."""
        if self._groups is None:
            from dstest.groups import GroupBuilder

            self._groups = GroupBuilder(rank=self.rank, world_size=self.world_size)
        return self._groups

    @property
    def target(self) -> Target:
        """The system under test of this run (``--dstest-target``, ``dstest.run(..., target=)``; default impl).

        Made on first use, on this rank. Raises :class:`dstest.errors.InvalidSpec` when none is bound: a
        function run by ``World.run`` directly gets no target (worlds know nothing of targets); run it
        with :func:`dstest.run` or as a ``@dstest.spec``.
        """
        if self._target is None:
            factory = self._target_factory
            if factory is None:
                from dstest.errors import InvalidSpec

                raise InvalidSpec(
                    f"ctx.target on rank {self.rank} of the {self.world!r} world: no system under test is bound; "
                    "World.run runs a function and knows no targets: run it with dstest.run(fn, world_size, "
                    "target=...) or as a @dstest.spec"
                )
            self._target = factory()
        return self._target

    @property
    def comm(self) -> CommView:
        """Counts and bytes of this rank's collectives and transfers in this run (G2), in every world.

        Per rank::

            with ctx.comm.window() as w:             # only what the block posts
                dist.all_gather_into_tensor(out, shard)
            w.count("all_gather_into_tensor") == 1
            w.numel("all_gather_into_tensor") == out.numel()   # W x shard.numel()
            w.bytes() == out.numel() * out.element_size()

        ``ctx.comm.counts()`` is ``{op: calls}`` of the run so far; ``group=`` narrows any count to one
        process group. What each collective counts is listed in :mod:`dstest.trace`.
        """
        if self._comm is None:
            from dstest.errors import InvalidSpec

            raise InvalidSpec(
                f"ctx.comm on rank {self.rank} of the {self.world!r} world: this world records no collectives "
                "(dstest's threaded, fake and process (gloo) worlds do; a plug-in world attaches a recorder "
                "with ctx.attach_comm)"
            )
        return self._comm

    @property
    def records_comm(self) -> bool:
        """Whether this world records collectives (``ctx.comm`` works): threaded, fake, process (gloo)."""
        return self._comm is not None

    # -- replica checks (G4) -------------------------------------------------------------------------
    def assert_replicas(
        self,
        module_or_tensors: object,
        group: Any = None,
        *,
        rtol: float = 0.0,
        atol: float = 0.0,
        what: str | None = None,
    ) -> None:
        """Raise :class:`dstest.errors.ReplicasDiverge` on every rank of ``group`` if the replicas that must be
        identical differ: a module's parameters and buffers (DDP unwrapped; DTensors by their ``Replicate``
        mesh dimensions), a tensor, or a dict or list of tensors. A collective: every rank of ``group``
        (default: the world) calls it. Bit for bit unless ``rtol``/``atol`` are given. See
        :mod:`dstest.replicas` and docs/replicas.md.
        """
        from dstest.replicas import assert_replicas

        assert_replicas(module_or_tensors, group, rtol=rtol, atol=atol, what=what)

    def replicas_checked(
        self, module: object, group: Any = None, *, rtol: float = 0.0, atol: float = 0.0
    ) -> contextlib.AbstractContextManager[None]:
        """A context manager: while active, :meth:`assert_replicas` of ``module`` after every ``optimizer.step()``
        of an optimizer that steps its parameters (each check a collective over ``group``)."""
        from dstest.replicas import replicas_checked

        return replicas_checked(module, group, rtol=rtol, atol=atol)

    def attach_comm(self, view: CommView) -> None:
        """Make ``view`` this rank's ``ctx.comm`` (worlds call this when they make the context)."""
        self._comm = view

    def bind_target(self, name: str, factory: Callable[[], Target]) -> None:
        """Make ``factory()`` (made on first use) this rank's ``ctx.target``; the spec layer calls this."""
        self.target_name = name
        self._target_factory = factory
        self._target = None

    def bind(self) -> Any:
        """Make this context the current one on this thread; returns a token for ``unbind``."""
        previous = getattr(_CURRENT, "ctx", None)
        _CURRENT.ctx = self
        return previous

    @staticmethod
    def unbind(token: Any) -> None:
        _CURRENT.ctx = token
