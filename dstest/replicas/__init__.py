"""Replica checks (G4): what must be identical on every rank of a group, compared across the group.

The quietest bugs of data-parallel code leave no error and no hang: a parameter left out of DDP's
reduction, a buffer never broadcast, a rank-dependent op in an update, a ZeRO shard applied twice, a
replicated LayerNorm weight of a tensor-parallel block whose gradient was never all-reduced. Each leaves
replicas that should be identical slightly different, and the loss curve hides it for thousands of steps.
:func:`assert_replicas` compares them, bit for bit by default, and names the first tensor that differs,
the ranks grouped by value, and the largest difference.

It is a collective: every rank of ``group`` calls it, with the same structure of tensors. It uses only
ordinary ``torch.distributed`` collectives, so it runs the same on the threaded world, the process world and
NCCL. To stay cheap it exchanges, per tensor, a digest of its bytes (SHA-256, 128 bits of it: no change of bits
can cancel out in it, as it could in a sum) and gathers a tensor's values only when digests differ. Tensors are
matched by name (a dict by key, in any order) and compared as the values they stand for (conjugate and negative
views resolved, any strides). Every rank ends with the same verdict and raises the same
:class:`~dstest.errors.ReplicasDiverge` (or, for names it cannot tell apart, the same
:class:`~dstest.errors.InvalidArgument`), so no rank is left behind in a collective.

What each layout compares:

* a plain tensor (a parameter, buffer, or an entry of a dict/list): the tensor, across ``group``;
* a DTensor: for each mesh dimension whose placement is ``Replicate`` (and whose group lies within
  ``group``), its local tensor across that dimension's group; ``Shard`` and ``Partial`` dimensions hold
  different data by design and are not compared. If the DTensor's mesh is a strict part of ``group``
  (several copies of the mesh, as with FSDP2 inside each replica of a hand-made HSDP), also its full
  tensor (``full_tensor()``, a collective over the mesh) across ``group``;
* so for FSDP2 (``fully_shard``) on a mesh that covers the group: the parameters' full tensors are one
  all-gather and equal by construction; what can drift are buffers (compared as plain tensors) and the
  replicated mesh dimensions (HSDP's replicate dimension, tensor parallel's replicated parameters);
* an ``nn.Module``: every parameter and buffer by name (a ``DistributedDataParallel`` wrapper is
  unwrapped to its ``.module``), each by the rules above.

The package, one module per job: :mod:`~.layouts` (what is compared: the :class:`~.layouts.Entry` of each
tensor, by the rules above), :mod:`~.structure` (the same tensors, shapes and dtypes on every rank),
:mod:`~.values` (digests, the values gathered where they differ, the text of a difference) and :mod:`~.check`
(the exchanges that find the first difference and agree on the verdict; :func:`assert_replicas` and
:func:`replicas_checked`).
"""

from __future__ import annotations

from dstest.replicas.check import assert_replicas, replicas_checked

__all__ = ["assert_replicas", "replicas_checked"]
