"""Pipeline point-to-point for a plan's stages, as a Megatron ``P2PCommunicator`` (the schedules' seam).

Megatron's communicator pairs stage i's TP rank t with stage i+1's TP rank t, which needs equal TP degrees. Here
each rank's peers come from the plan (``hetu_ext.plan.neighbours``), so adjacent stages may differ in TP degree;
everything else (the schedule, its 1F1B order, the tensors' shapes) is Megatron's.

Under sequence parallelism a stage's TP ranks each hold ``1/tp`` of the sequence of its input and output
(``[s/tp, b, h]``). Adjacent stages may differ in TP degree or not use it at all, so what goes on the wire is
always the whole sequence: a sequence-parallel stage all-gathers its slices over its TP group before it sends
(activations forward, gradients backward) and keeps its own slice of what it receives. The wire is then the same
as without sequence parallelism, and the peers of :func:`hetu_ext.plan.neighbours` hold.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core.pipeline_parallel.p2p_communication import P2PCommunicator

from hetu_ext.plan.core.plan import Neighbours


class StagePosition:
    """What the schedules read from ``p2p_communicator.pp_group``: this stage's index and the stage count."""

    def __init__(self, stage: int, num_stages: int) -> None:
        self._stage, self._num = stage, num_stages

    def rank(self) -> int:
        return self._stage

    def size(self) -> int:
        return self._num


class StageP2P(P2PCommunicator):
    """Sends and receives a stage's activations and gradients to and from the plan's neighbours."""

    def __init__(self, peers: Neighbours, config, dtype: torch.dtype, device: torch.device,
                 sequence_group: dist.ProcessGroup | None = None) -> None:
        # Megatron's __init__ derives next/prev ranks from a real pp group; ours come from the plan
        self.pp_group = StagePosition(peers.stage, peers.num_stages)
        self.config = config
        self.virtual_pipeline_model_parallel_size = None
        self.peers = peers
        self.dtype, self.device = dtype, device
        self.sequence_group = sequence_group
        """The stage's TP group when it runs sequence parallelism (its tensors hold 1/tp of the sequence)."""

    def _communicate(self, *, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape,
                     wait_on_reqs: bool = True):
        if self.sequence_group is not None:
            tensor_send_next, tensor_send_prev = self._gather(tensor_send_next), self._gather(tensor_send_prev)
            if tensor_shape is not None:  # Megatron's shape is this rank's slice; the wire carries the sequence
                tensor_shape = (tensor_shape[0] * self.sequence_group.size(), *tuple(tensor_shape)[1:])
        from_prev, from_next, _ = self._send_receive(tensor_send_next, tensor_send_prev, recv_prev, recv_next,
                                                     tensor_shape)
        if self.sequence_group is not None:
            from_prev, from_next = self._own_slice(from_prev), self._own_slice(from_next)
        return from_prev, from_next, None

    def _gather(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """``[s/tp, ...]`` slices of the stage's TP ranks -> ``[s, ...]`` in rank order."""
        if tensor is None:
            return None
        tensor = tensor.detach().contiguous()
        with torch.no_grad():
            out = torch.empty((tensor.size(0) * self.sequence_group.size(), *tensor.shape[1:]), dtype=tensor.dtype,
                              device=tensor.device)
            dist.all_gather_into_tensor(out, tensor, group=self.sequence_group)
        return out

    def _own_slice(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        """This rank's ``[s/tp, ...]`` rows of a received ``[s, ...]``, a leaf the schedule can take gradients of."""
        if tensor is None:
            return None
        rows = tensor.size(0) // self.sequence_group.size()
        start = self.sequence_group.rank() * rows
        return tensor.detach()[start:start + rows].clone().requires_grad_(tensor.requires_grad)

    def _send_receive(self, tensor_send_next, tensor_send_prev, recv_prev, recv_next, tensor_shape):
        prev_shape = next_shape = tuple(tensor_shape) if tensor_shape is not None else None
        if self.config.variable_seq_lengths:  # packs differ in length: shapes go first, as in Megatron's
            got_prev, got_next = self._exchange(
                self._shape(tensor_send_next), self._shape(tensor_send_prev),
                self._empty((3,), torch.int64) if recv_prev else None,
                self._empty((3,), torch.int64) if recv_next else None)
            prev_shape = tuple(got_prev.tolist()) if recv_prev else None
            next_shape = tuple(got_next.tolist()) if recv_next else None
        from_prev, from_next = self._exchange(
            tensor_send_next, tensor_send_prev,
            self._empty(prev_shape, self.dtype, requires_grad=True) if recv_prev else None,
            self._empty(next_shape, self.dtype, requires_grad=True) if recv_next else None)
        return from_prev, from_next, None

    def _exchange(self, send_next, send_prev, recv_prev, recv_next):
        """One batch of sends to and receives (into the given buffers) from the plan's neighbours."""
        ops = []
        if recv_prev is not None:
            ops.append(dist.P2POp(dist.irecv, recv_prev, self.peers.recv_forward_from))
        if recv_next is not None:
            ops.append(dist.P2POp(dist.irecv, recv_next, self.peers.recv_backward_from))
        if send_next is not None:
            ops += [dist.P2POp(dist.isend, send_next, r) for r in self.peers.send_forward_to]
        if send_prev is not None:
            ops += [dist.P2POp(dist.isend, send_prev, r) for r in self.peers.send_backward_to]
        if ops:
            for req in dist.batch_isend_irecv(ops):
                req.wait()
        return recv_prev, recv_next

    def _empty(self, shape: tuple[int, ...], dtype: torch.dtype, requires_grad: bool = False) -> torch.Tensor:
        return torch.empty(shape, dtype=dtype, device=self.device, requires_grad=requires_grad)

    def _shape(self, tensor: torch.Tensor | None) -> torch.Tensor | None:
        return None if tensor is None else torch.tensor(tensor.shape, dtype=torch.int64, device=self.device)
