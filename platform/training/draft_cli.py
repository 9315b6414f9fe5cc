"""`loramux draft distill`: make a draft model for speculative decoding from the served base model itself (see
loramux.training.draft_distill)."""

from __future__ import annotations

import gc
import hashlib
import json
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from loramux.settings import DEFAULT_MODEL, Settings
from loramux.training.defaults import DEFAULT_LAYERS, DEFAULT_LR

if TYPE_CHECKING:
    from loramux.training.self_distill import Conversation

__all__ = ["add_draft_parser", "answers_for"]

# Every CLI start builds this parser: torch and transformers are imported only when the command runs.


def add_draft_parser(subparsers) -> None:
    draft = subparsers.add_parser("draft", help="draft models for speculative decoding (LORAMUX_DRAFT_MODEL)")
    dsub = draft.add_subparsers(dest="draft_command", required=True)
    d = dsub.add_parser(
        "distill", help="make a draft from the base model's first layers, distilled on its own answers to a prompt set"
    )
    d.add_argument("--out", required=True, help="directory to write the draft to (an HF model directory)")
    d.add_argument("--model", help=f"base model: {DEFAULT_MODEL} (default), a .gguf file or an HF directory")
    d.add_argument(
        "--layers",
        type=int,
        default=DEFAULT_LAYERS,
        help=f"decoder layers the draft keeps, the base's first ones (default {DEFAULT_LAYERS})",
    )
    d.add_argument("--prompts", help="prompt file, one prompt per line (default: the built-in set)")
    d.add_argument("--max-prompts", type=int, help="use only the first N prompts")
    d.add_argument("--max-tokens", type=int, default=128, help="length of the base model's answers (default 128)")
    d.add_argument("--epochs", type=float, default=1.0, help="passes over the answers (default 1)")
    d.add_argument("--steps", type=int, help="optimizer steps instead of --epochs")
    d.add_argument("--batch-size", type=int, default=8, help="conversations per step (default 8)")
    d.add_argument("--lr", type=float, default=DEFAULT_LR, help="AdamW peak learning rate")
    d.add_argument("--held-out", type=float, default=0.1, help="share of prompts kept for evaluation (default 0.1)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument(
        "--no-answer-cache",
        action="store_true",
        help="generate the base model's answers again even when the cache dir has them",
    )
    d.set_defaults(func=cmd_distill)


def answers_for(
    settings: Settings, model_dir: Path, prompts: list[str], max_tokens: int, use_cache: bool = True
) -> list[Conversation]:
    """The base model's greedy answers to `prompts` (an engine built from `settings`), kept in the cache dir
    under a key of the model's weights, the prompts and `max_tokens`, so drafts of other sizes reuse them."""
    from loramux.engine.engine import LLMEngine
    from loramux.training.self_distill import Conversation, self_distilled

    weights = sorted(model_dir.glob("*.safetensors"))
    key = hashlib.sha256(
        json.dumps(
            [
                str(model_dir.resolve()),
                [(w.name, w.stat().st_size, w.stat().st_mtime_ns) for w in weights],
                prompts,
                max_tokens,
                settings.dtype,
                settings.quantization,
            ]
        ).encode()
    )
    path = Path(settings.cache_dir) / "distill" / f"answers-{key.hexdigest()[:16]}.json"
    if use_cache and path.is_file():
        data = json.loads(path.read_text())
        print(f"base model answers: {len(data)} from {path}", file=sys.stderr)
        return [Conversation(c["prompt_ids"], c["answer_ids"]) for c in data]
    # Prompt lookup speculation is off for these requests anyway; a draft model must not be loaded to make one.
    engine = LLMEngine.from_settings(settings.model_copy(update={"draft_model": None}), load_adapters=False)
    try:
        convs = self_distilled(engine, prompts, max_tokens)
    finally:
        del engine
        gc.collect()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps([{"prompt_ids": c.prompt_ids, "answer_ids": c.answer_ids} for c in convs]))
    return convs


def cmd_distill(args, settings: Settings) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from loramux.model.loader import resolve_model_dir
    from loramux.training.draft_distill import DistillOptions, distill_draft, write_draft
    from loramux.training.prompts import builtin_prompts, read_prompts

    if args.layers < 1 or args.max_tokens < 1 or args.batch_size < 1 or not 0 <= args.held_out < 1:
        print("error: --layers, --max-tokens and --batch-size must be positive, --held-out in [0, 1)", file=sys.stderr)
        return 2
    t0 = time.perf_counter()
    model_dir = resolve_model_dir(settings.model, Path(settings.cache_dir))
    prompts = read_prompts(args.prompts) if args.prompts else builtin_prompts()
    if args.max_prompts:
        prompts = prompts[: args.max_prompts]
    convs = answers_for(settings, model_dir, prompts, args.max_tokens, use_cache=not args.no_answer_cache)
    t_answers = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    teacher = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    if args.layers > teacher.config.num_hidden_layers:
        print(
            f"error: --layers {args.layers} is more than the base model's {teacher.config.num_hidden_layers}",
            file=sys.stderr,
        )
        return 2
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    options = DistillOptions(
        layers=args.layers,
        epochs=args.epochs,
        steps=args.steps,
        batch_size=args.batch_size,
        lr=args.lr,
        held_out=args.held_out,
        seed=args.seed,
    )
    student, report = distill_draft(teacher, convs, pad_id, options)
    report.seconds["answers"] = round(t_answers - t0, 1)
    out = write_draft(student, tokenizer, Path(args.out), model_dir, report)
    report.seconds["total"] = round(time.perf_counter() - t0, 1)
    (out / "distill.json").write_text(
        json.dumps({**json.loads((out / "distill.json").read_text()), "seconds": report.seconds}, indent=2) + "\n"
    )
    print(report.summary())
    print(f"seconds: {', '.join(f'{k} {v}' for k, v in report.seconds.items())}")
    print(f"wrote {out}: serve it with LORAMUX_DRAFT_MODEL={out}")
    return 0
