"""The gated delta rule (Gated DeltaNet's token mixer), recurrent and chunked.

Each value head keeps a state S of [key_dim, value_dim]. A token first decays it by a = exp(g)
(g <= 0), then corrects what S predicts for its key towards its value, at strength beta:

    S <- a * S;    S <- S + beta * k (v - S^T k)^T;    o = S^T q

The recurrent form applies that once per token: decode, one token per sequence. The chunked form
handles C tokens of a sequence with matrix products, so a long prefill is not a Python loop per
token. Writing S_i = gamma_i S_0 + sum_{j<=i} (gamma_i / gamma_j) k_j u_j^T inside a chunk
(gamma_i the decay accumulated since the chunk began), the corrected values u solve the unit
lower-triangular system u_i + beta_i sum_{j<i} (gamma_i / gamma_j)(k_i . k_j) u_j
= beta_i v_i - beta_i gamma_i k_i^T S_0, so u = W - Y S_0 with W and Y solved once for every
chunk; only S crosses from one chunk to the next.

Both forms take q and k already L2-normalised (q also scaled) and work in float32. Zero rows
(k = v = q = 0, beta = 0, g = 0) leave the state unchanged, so sequences of a batch can be
padded at their ends.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK_SIZE = 64


def recurrent_gated_delta_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence. q, k: [B, H, Dk]; v: [B, H, Dv]; g, beta: [B, H];
    state: [B, H, Dk, Dv]. Returns the output [B, H, Dv] and the new state."""
    state = state * g.exp()[..., None, None]
    predicted = (k[..., None, :] @ state).squeeze(-2)  # [B, H, Dv]
    correction = (v - predicted) * beta[..., None]
    state = state + k[..., :, None] * correction[..., None, :]
    out = (q[..., None, :] @ state).squeeze(-2)
    return out, state


def chunked_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    chunk_size: int = CHUNK_SIZE,
) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of sequences of L tokens. q, k: [B, L, H, Dk]; v: [B, L, H, Dv];
    g, beta: [B, L, H]; state: [B, H, Dk, Dv] before the first token.
    Returns the outputs [B, L, H, Dv] and the state after the last token."""
    batch, length, heads, _ = k.shape
    value_dim = v.shape[-1]
    size = min(chunk_size, length)
    pad = -length % size

    def chunks(x: torch.Tensor) -> torch.Tensor:  # [B, L, H, ...] -> [B, H, N, C, ...]
        x = x.transpose(1, 2)
        if pad:
            x = F.pad(x, (0, 0, 0, pad) if x.dim() == 4 else (0, pad))
        return x.reshape(batch, heads, -1, size, *x.shape[3:])

    q, k, v, g, beta = (chunks(x) for x in (q, k, v, g, beta))
    log_decay = g.cumsum(-1)  # [B, H, N, C]: log gamma_i
    causal = torch.ones(size, size, dtype=torch.bool, device=q.device).tril()
    # pair_decay[i, j] = gamma_i / gamma_j for j <= i, 0 above the diagonal.
    pair_decay = log_decay[..., :, None] - log_decay[..., None, :]
    pair_decay = pair_decay.masked_fill(~causal, -torch.inf).exp()
    k_beta = k * beta[..., None]
    # Only the strictly lower triangle is read: the system's diagonal is one.
    system = (k_beta @ k.transpose(-1, -2)) * pair_decay
    w = torch.linalg.solve_triangular(system, v * beta[..., None], upper=False, unitriangular=True)
    y = torch.linalg.solve_triangular(
        system, k_beta * log_decay.exp()[..., None], upper=False, unitriangular=True
    )
    q_from_start = q * log_decay.exp()[..., None]
    scores = (q @ k.transpose(-1, -2)) * pair_decay
    k_to_end = k * (log_decay[..., -1:] - log_decay).exp()[..., None]
    chunk_decay = log_decay[..., -1].exp()[..., None, None]  # [B, H, N, 1, 1]

    out = torch.empty(batch, heads, q.shape[2], size, value_dim, dtype=q.dtype, device=q.device)
    for n in range(q.shape[2]):
        u = w[:, :, n] - y[:, :, n] @ state
        out[:, :, n] = q_from_start[:, :, n] @ state + scores[:, :, n] @ u
        state = state * chunk_decay[:, :, n] + k_to_end[:, :, n].transpose(-1, -2) @ u
    out = out.reshape(batch, heads, -1, value_dim)[:, :, :length]
    return out.transpose(1, 2), state
