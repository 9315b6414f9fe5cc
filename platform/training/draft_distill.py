"""A draft model made from the served base model itself: its embedding, its first N decoder layers, its final
norm and its LM head (tied as in the base), fine-tuned to imitate the full model.

Training is distillation on the base's own greedy answers to a prompt set (`self_distilled`): the loss is
KL(teacher || draft) over the full model's next-token distribution, on answer tokens only. The decoder layers
and the final norm train (AdamW); the embedding and the head stay the base's. The teacher (the full model) runs
once over every conversation, keeping its final hidden states at the answer positions; each batch's teacher
logits are those states through the head. A share of the prompts is held out: the KL and the draft's top-1
agreement with the teacher on their answers, before and after training, say what the draft is worth (top-1
agreement is the acceptance rate of greedy speculation, token by token).

The result is an HF directory (config.json with num_hidden_layers=N, model.safetensors, tokenizer files,
generation_config.json) that transformers and loramux's `build_model` both load; serve it with
LORAMUX_DRAFT_MODEL=DIR.
"""

from __future__ import annotations

import json
import math
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

from loramux.training.defaults import DEFAULT_LAYERS, DEFAULT_LR
from loramux.training.self_distill import Conversation

__all__ = [
    "DistillOptions",
    "DistillReport",
    "distill_draft",
    "evaluate",
    "teacher_states",
    "truncated_draft",
    "write_draft",
]


@dataclass
class DistillOptions:
    layers: int = DEFAULT_LAYERS  # decoder layers the draft keeps (the base's first ones)
    epochs: float = 1.0  # passes over the training answers (ignored when `steps` is set)
    steps: int | None = None  # optimizer steps (cycling through the data)
    batch_size: int = 8  # conversations per step
    lr: float = DEFAULT_LR  # AdamW peak learning rate (linear warm-up over 5 % of the steps, cosine decay)
    weight_decay: float = 0.0
    held_out: float = 0.1  # share of the conversations kept for evaluation
    seed: int = 0


@dataclass
class DistillReport:
    layers: int
    base_layers: int
    train_conversations: int
    held_out_conversations: int
    eval_tokens: int  # answer tokens the figures below are measured on (held-out answers; training ones if none)
    steps: int
    kl_before: float  # mean KL(teacher || draft) per answer token, nats
    kl_after: float
    agreement_before: float  # share of answer positions where the draft's argmax is the teacher's
    agreement_after: float
    train_kl_before: float  # the same KL on the training answers
    train_kl_after: float
    seconds: dict[str, float] = field(default_factory=dict)

    def summary(self) -> str:
        return (
            f"draft of {self.layers}/{self.base_layers} layers, {self.steps} steps on "
            f"{self.train_conversations} answers; on {self.held_out_conversations} held-out answers "
            f"({self.eval_tokens} tokens): KL(teacher||draft) {self.kl_before:.3f} -> {self.kl_after:.3f} nats, "
            f"top-1 agreement {self.agreement_before:.1%} -> {self.agreement_after:.1%}; training KL "
            f"{self.train_kl_before:.3f} -> {self.train_kl_after:.3f}"
        )


def truncated_draft(teacher, layers: int):
    """A new HF causal LM with the teacher's config cut to its first `layers` decoder layers, holding copies of
    the teacher's embedding, those layers, final norm and head (tied when the teacher's are)."""
    from transformers import AutoModelForCausalLM

    base_layers = teacher.config.num_hidden_layers
    if not 1 <= layers <= base_layers:
        raise ValueError(f"--layers must be between 1 and the base model's {base_layers} layers, got {layers}")
    config = teacher.config.__class__.from_dict(teacher.config.to_dict())
    config.num_hidden_layers = layers
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:layers]
    student = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    state = {k: v for k, v in teacher.state_dict().items() if _layer_index(k) is None or _layer_index(k) < layers}
    missing, unexpected = student.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (k == "lm_head.weight" and config.tie_word_embeddings)]
    if missing or unexpected:
        raise ValueError(f"draft weights do not match the base's: missing {missing[:4]}, unexpected {unexpected[:4]}")
    if config.tie_word_embeddings:
        student.tie_weights()
    return student.eval()


def _layer_index(name: str) -> int | None:
    parts = name.split(".")
    if "layers" in parts:
        i = parts.index("layers")
        if i + 1 < len(parts) and parts[i + 1].isdigit():
            return int(parts[i + 1])
    return None


def _trainable(student) -> list[torch.nn.Parameter]:
    """The decoder layers and the final norm; embedding and head stay frozen."""
    params = []
    for name, param in student.named_parameters():
        train = ".layers." in f".{name}" or name.endswith("norm.weight") and _layer_index(name) is None
        train = train and "embed_tokens" not in name and "lm_head" not in name
        param.requires_grad_(train)
        if train:
            params.append(param)
    return params


def _batch(convs: list[Conversation], pad_id: int):
    """(input ids [B, L], attention mask [B, L], flat indices into [B*L] of the answer-predicting positions)."""
    length = max(len(c.token_ids) for c in convs)
    ids = torch.full((len(convs), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(convs), length), dtype=torch.long)
    rows = []
    for b, conv in enumerate(convs):
        tokens = conv.token_ids
        ids[b, : len(tokens)] = torch.tensor(tokens)
        mask[b, : len(tokens)] = 1
        start = len(conv.prompt_ids) - 1  # logits at position i predict token i + 1
        rows.extend(b * length + p for p in range(start, start + len(conv.answer_ids)))
    return ids, mask, torch.tensor(rows, dtype=torch.long)


def _hidden(model, convs: list[Conversation], pad_id: int) -> torch.Tensor:
    """Final (normed) hidden states of `model` at the answer-predicting positions of `convs`, [T, hidden]."""
    ids, mask, rows = _batch(convs, pad_id)
    states = model.model(input_ids=ids, attention_mask=mask).last_hidden_state
    return states.reshape(-1, states.shape[-1]).index_select(0, rows)


def _logits(model, hidden: torch.Tensor) -> torch.Tensor:
    logits = model.lm_head(hidden).float()
    cap = getattr(model.config, "final_logit_softcapping", None)
    return torch.tanh(logits / cap) * cap if cap else logits


def teacher_states(
    teacher, convs: list[Conversation], pad_id: int, batch_size: int = 8, progress: bool = True
) -> list[torch.Tensor]:
    """Per conversation, the teacher's final hidden states at its answer-predicting positions [A, hidden]."""
    out: list[torch.Tensor] = []
    with (
        torch.no_grad(),
        tqdm(total=len(convs), desc="teacher", unit="answer", disable=not progress, file=sys.stderr) as bar,
    ):
        for i in range(0, len(convs), batch_size):
            part = convs[i : i + batch_size]
            states = _hidden(teacher, part, pad_id)
            for conv in part:
                out.append(states[: len(conv.answer_ids)].clone())
                states = states[len(conv.answer_ids) :]
            bar.update(len(part))
    return out


def _kl(student_logits: torch.Tensor, teacher_logits: torch.Tensor) -> torch.Tensor:
    """Summed KL(teacher || student) over rows."""
    teacher_logp = F.log_softmax(teacher_logits, dim=-1)
    student_logp = F.log_softmax(student_logits, dim=-1)
    return F.kl_div(student_logp, teacher_logp, log_target=True, reduction="sum")


def evaluate(
    teacher, student, convs: list[Conversation], states: list[torch.Tensor], pad_id: int, batch_size: int = 8
) -> tuple[float, float, int]:
    """(mean KL(teacher || draft) per answer token, top-1 agreement, answer tokens) over `convs`."""
    kl, agree, count = 0.0, 0, 0
    with torch.no_grad():
        for i in range(0, len(convs), batch_size):
            part = convs[i : i + batch_size]
            teacher_logits = _logits(teacher, torch.cat(states[i : i + batch_size]))
            student_logits = _logits(student, _hidden(student, part, pad_id))
            kl += _kl(student_logits, teacher_logits).item()
            agree += (student_logits.argmax(-1) == teacher_logits.argmax(-1)).sum().item()
            count += teacher_logits.shape[0]
    return kl / max(count, 1), agree / max(count, 1), count


def distill_draft(teacher, convs: list[Conversation], pad_id: int, options: DistillOptions, progress: bool = True):
    """Train a draft of `options.layers` layers on `convs` (the teacher's own answers): (draft, report)."""
    t0 = time.perf_counter()
    convs = [c for c in convs if c.answer_ids]
    if not convs:
        raise ValueError("no answers to distill on (every answer was empty)")
    rng = random.Random(options.seed)
    order = list(range(len(convs)))
    rng.shuffle(order)
    n_held = int(len(convs) * options.held_out) if len(convs) > 1 else 0
    held = [convs[i] for i in order[:n_held]]
    train = [convs[i] for i in order[n_held:]]
    teacher.eval()
    for param in teacher.parameters():
        param.requires_grad_(False)
    train_states = teacher_states(teacher, train, pad_id, options.batch_size, progress)
    held_states = teacher_states(teacher, held, pad_id, options.batch_size, progress) if held else []
    t_teacher = time.perf_counter()

    torch.manual_seed(options.seed)
    student = truncated_draft(teacher, options.layers)
    eval_convs, eval_states = (held, held_states) if held else (train, train_states)
    kl_before, agree_before, eval_tokens = evaluate(
        teacher, student, eval_convs, eval_states, pad_id, options.batch_size
    )
    train_kl_before = evaluate(teacher, student, train, train_states, pad_id, options.batch_size)[0]

    batches_per_epoch = math.ceil(len(train) / options.batch_size)
    steps = options.steps if options.steps is not None else max(1, round(options.epochs * batches_per_epoch))
    params = _trainable(student)
    optimizer = torch.optim.AdamW(params, lr=options.lr, weight_decay=options.weight_decay)
    warmup = max(1, steps // 20)

    def lr_at(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    student.train()
    batches: list[list[int]] = []
    with tqdm(
        total=steps, desc=f"distilling {options.layers}-layer draft", unit="step", disable=not progress, file=sys.stderr
    ) as bar:
        for _ in range(steps):
            if not batches:
                idx = list(range(len(train)))
                rng.shuffle(idx)
                batches = [idx[i : i + options.batch_size] for i in range(0, len(idx), options.batch_size)]
            picked = batches.pop(0)
            part = [train[i] for i in picked]
            with torch.no_grad():
                teacher_logits = _logits(teacher, torch.cat([train_states[i] for i in picked]))
            student_logits = _logits(student, _hidden(student, part, pad_id))
            loss = _kl(student_logits, teacher_logits) / teacher_logits.shape[0]
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
            scheduler.step()
            bar.set_postfix(kl=f"{loss.item():.3f}")
            bar.update()
    student.eval()
    for param in student.parameters():
        param.requires_grad_(False)
    t_train = time.perf_counter()
    kl_after, agree_after, _ = evaluate(teacher, student, eval_convs, eval_states, pad_id, options.batch_size)
    train_kl_after = evaluate(teacher, student, train, train_states, pad_id, options.batch_size)[0]
    report = DistillReport(
        layers=options.layers,
        base_layers=teacher.config.num_hidden_layers,
        train_conversations=len(train),
        held_out_conversations=len(held),
        eval_tokens=eval_tokens,
        steps=steps,
        kl_before=kl_before,
        kl_after=kl_after,
        agreement_before=agree_before,
        agreement_after=agree_after,
        train_kl_before=train_kl_before,
        train_kl_after=train_kl_after,
        seconds={
            "teacher": round(t_teacher - t0, 1),
            "train": round(t_train - t_teacher, 1),
            "evaluate": round(time.perf_counter() - t_train, 1),
        },
    )
    return student, report


def write_draft(student, tokenizer, out: Path, base_dir: Path | None = None, report: DistillReport | None = None):
    """Save the draft as an HF directory: config.json, model.safetensors (a tied head is stored once, as the
    embedding), the tokenizer files, generation_config.json (the base's when it has one) and distill.json
    (the report)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    student.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    base_generation = base_dir / "generation_config.json" if base_dir is not None else None
    if base_generation is not None and base_generation.is_file():
        (out / "generation_config.json").write_text(base_generation.read_text())
    elif not (out / "generation_config.json").is_file():
        from transformers import GenerationConfig

        GenerationConfig.from_model_config(student.config).save_pretrained(out)
    if report is not None:
        (out / "distill.json").write_text(json.dumps(asdict(report), indent=2) + "\n")
    return out
