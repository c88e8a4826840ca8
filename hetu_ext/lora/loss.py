"""LobRA's loss: each token's loss weighted by its tenant, so every adapter trains as its tenant alone.

    L = sum over tenants t of (sum of t's token losses) / (t's tokens in the global batch)

(``normalisation="global"``, a negative control for tests: one token mean over every tenant's tokens.)
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch


def token_weights(counts: np.ndarray, normalisation: str) -> torch.Tensor:
    """Per tenant, the weight of each of its tokens' losses: 1 / its tokens in the global batch (0 if absent),
    or (``global``) 1 / all tenants' tokens. ``counts``: each tenant's training tokens of the step."""
    if normalisation == "tenant":
        return torch.tensor([1.0 / n if n else 0.0 for n in counts], dtype=torch.float32)
    return torch.full((len(counts),), 1.0 / float(counts.sum()), dtype=torch.float32)


def tenant_forward_step(routing, weights, num_tenants, data_iterator, model):
    """Megatron's forward_step_func for one pack of tenants' tokens: route the tokens, run the stage."""
    batch = next(data_iterator)
    ids = batch["tenant_ids"]
    routing.set(ids)
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"],
                   packed_seq_params=batch.get("packed_seq_params"))
    return output, partial(_tenant_loss, ids, batch["loss_mask"], weights, num_tenants)


def _tenant_loss(ids, loss_mask, weights, num_tenants, per_token_loss):
    """sum_i w[tenant(i)] l_i (w = 1 / tenant's tokens in the global batch); reports the plain sums per tenant."""
    ids, mask = ids.reshape(-1), loss_mask.reshape(-1).float()
    losses = per_token_loss.reshape(-1).float() * mask  # (t,)
    loss = torch.sum(losses * weights[ids])
    plain = torch.zeros(num_tenants, dtype=torch.float32, device=losses.device).index_add(0, ids, losses.detach())
    tokens = torch.zeros(num_tenants, dtype=torch.float32, device=losses.device).index_add(0, ids, mask)
    num_tokens = mask.sum().to(torch.int)
    report = torch.stack([losses.detach().sum(), mask.sum()])
    return loss, num_tokens, {"lm loss": report, "tenant loss": torch.cat([plain, tokens])}
