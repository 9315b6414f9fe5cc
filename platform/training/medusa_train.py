"""Training Medusa-1 heads for the served model (optionally with an adapter), with the backbone frozen.

Data: the model's own greedy answers to a prompt set (`self_distill`), so head k learns to predict the token
the model itself will emit k + 1 places after the current one. Features: the final hidden state at every
answer position, computed once with HF transformers (and PEFT for an adapter: the same hidden states the
engine produces, within float32 tolerance). Head k's loss is cross-entropy of
`lm_head(h_t + silu(W_k h_t + b_k))` against token t + 1 + k; W_k and b_k start at zero, so each head starts
as the model's own next-token prediction. The LM head is shared and frozen.
"""
from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm import tqdm

from loramux.adapters.formats.medusa import save_medusa_dir
from loramux.training.self_distill import Conversation

__all__ = ["MedusaTrainingResult", "hidden_features", "train_heads"]


@dataclass
class MedusaTrainingResult:
    blocks: list[tuple[torch.Tensor, torch.Tensor]]
    accuracy: list[float]  # held-out top-1 accuracy of each head
    chain_accuracy: list[float]  # held-out: heads 1..k all right (what a chain of k drafts needs)
    positions: int  # training positions
    seconds: float

    def save(self, path: Path | str, base_model: str | None, adapter: str | None, dtype=torch.float32) -> Path:
        blocks = [(w.to(dtype), b.to(dtype)) for w, b in self.blocks]
        return save_medusa_dir(path, blocks, base_model=base_model, adapter=adapter,
                               extra={"heldout_top1": [round(a, 4) for a in self.accuracy],
                                      "heldout_chain": [round(a, 4) for a in self.chain_accuracy],
                                      "training_positions": self.positions})


@torch.no_grad()
def hidden_features(model, conversations: list[Conversation], num_heads: int, batch_size: int = 8,
                    progress: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden [N, H] float32, labels [N, K]) over every answer position t of every conversation: the HF
    `model`'s final (normed) hidden state at t, and the tokens at t + 2 .. t + 1 + K (-100 past the end).
    Position t runs from the prompt's last token to the answer's second-to-last (the positions whose next
    token is part of the answer)."""
    feats, labels = [], []
    order = sorted(range(len(conversations)), key=lambda i: len(conversations[i].token_ids))
    for start in tqdm(range(0, len(order), batch_size), desc="hidden states", disable=not progress):
        group = [conversations[i] for i in order[start:start + batch_size]]
        width = max(len(c.token_ids) for c in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for row, conv in enumerate(group):
            ids[row, :len(conv.token_ids)] = torch.tensor(conv.token_ids)
            mask[row, :len(conv.token_ids)] = 1
        out = model(input_ids=ids, attention_mask=mask, output_hidden_states=True)
        last = out.hidden_states[-1].float()
        for row, conv in enumerate(group):
            tokens, first = conv.token_ids, len(conv.prompt_ids) - 1
            for t in range(first, len(tokens) - 2):
                feats.append(last[row, t])
                labels.append([tokens[t + 1 + k] if t + 1 + k < len(tokens) else -100 for k in range(1, num_heads + 1)])
    if not feats:
        raise ValueError("no answer positions to train on: the answers are too short")
    return torch.stack(feats), torch.tensor(labels, dtype=torch.long)


def train_heads(hidden: torch.Tensor, labels: torch.Tensor, lm_head: torch.Tensor, epochs: int = 2,
                lr: float = 1e-3, batch_size: int = 256, heldout: float = 0.1, seed: int = 0,
                progress: bool = True) -> MedusaTrainingResult:
    """Train K = labels.shape[1] heads on (hidden, labels) with the LM head `lm_head` [V, H] frozen (AdamW,
    cosine decay); report top-1 accuracies on a `heldout` fraction kept out of training (heldout=0: on the
    training positions themselves)."""
    t0 = time.monotonic()
    gen = torch.Generator().manual_seed(seed)
    n, k = labels.shape
    h_dim = hidden.shape[1]
    perm = torch.randperm(n, generator=gen)
    n_test = max(1, int(n * heldout)) if n > 10 and heldout > 0 else 0
    test, train = perm[:n_test], perm[n_test:]
    weight = torch.zeros(k, h_dim, h_dim, requires_grad=True)
    bias = torch.zeros(k, h_dim, requires_grad=True)
    lm_head = lm_head.detach().float()
    opt = torch.optim.AdamW([weight, bias], lr=lr, weight_decay=0.0)
    steps = max(1, epochs * math.ceil(len(train) / batch_size))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    rng = random.Random(seed)
    with tqdm(total=steps, desc="medusa heads", disable=not progress) as bar:
        for _ in range(epochs):
            order = train[torch.tensor(rng.sample(range(len(train)), len(train)))] if len(train) else train
            for start in range(0, len(order), batch_size):
                idx = order[start:start + batch_size]
                logits = _head_logits(hidden[idx], weight, bias, lm_head)
                loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels[idx].reshape(-1),
                                                         ignore_index=-100)
                opt.zero_grad()
                loss.backward()
                opt.step()
                sched.step()
                bar.set_postfix(loss=f"{loss.item():.3f}")
                bar.update(1)
    judged = test if n_test else train
    accuracy, chain = _evaluate(hidden[judged], labels[judged], weight.detach(), bias.detach(), lm_head, k)
    blocks = [(weight[i].detach().clone(), bias[i].detach().clone()) for i in range(k)]
    return MedusaTrainingResult(blocks, accuracy, chain, len(train), time.monotonic() - t0)


def _head_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, lm_head: torch.Tensor) -> torch.Tensor:
    """[n, H] -> [n, K, V]: each head's residual block, then the shared LM head."""
    z = torch.einsum("nh,koh->nko", h, weight) + bias
    return (h[:, None, :] + torch.nn.functional.silu(z)) @ lm_head.t()


@torch.no_grad()
def _evaluate(h, labels, weight, bias, lm_head, k) -> tuple[list[float], list[float]]:
    if len(h) == 0:
        return [0.0] * k, [0.0] * k
    right = torch.cat([_head_logits(h[i:i + 512], weight, bias, lm_head).argmax(-1) for i in range(0, len(h), 512)])
    right = right == labels
    valid = labels != -100
    accuracy = [float(right[:, j][valid[:, j]].float().mean()) if valid[:, j].any() else 0.0 for j in range(k)]
    all_right = torch.cumprod(right.long(), dim=1).bool()
    chain = [float(all_right[:, j][valid[:, j]].float().mean()) if valid[:, j].any() else 0.0 for j in range(k)]
    return accuracy, chain
