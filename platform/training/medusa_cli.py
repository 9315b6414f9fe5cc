"""`loramux medusa train`: Medusa-1 heads for the served model, or for one adapter on it."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from loramux.settings import DEFAULT_MODEL

__all__ = ["add_medusa_parser"]


def add_medusa_parser(sub, model_opts) -> None:
    m = sub.add_parser("medusa", help="Medusa speculative-decoding heads")
    msub = m.add_subparsers(dest="medusa_command", required=True)
    t = msub.add_parser("train", help="train Medusa-1 heads on the model's own answers (backbone frozen)",
                        formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    model_opts(t)
    t.add_argument("--out", help="directory to write (default: ./medusa-<adapter or base>)")
    t.add_argument("--adapter", help="a PEFT adapter directory, or a name in LORAMUX_ADAPTERS: heads for that "
                                     "adapter's requests, trained on its answers")
    t.add_argument("--heads", type=int, default=3, help="number of heads (draft length they propose)")
    t.add_argument("--prompts", help="a text file, one prompt per line (default: the built-in set of 335)")
    t.add_argument("--limit", type=int, help="use only the first N prompts")
    t.add_argument("--max-tokens", type=int, default=128, help="answer length per prompt")
    t.add_argument("--epochs", type=int, default=2)
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--ship", action="store_true", help="write the heads the embedded model ships with (float16, "
                                                       "into the package; maintainers only)")
    t.set_defaults(func=cmd_medusa_train)


def _adapter_path(spec: str | None, settings) -> tuple[str | None, Path | None]:
    if spec is None:
        return None, None
    named = settings.adapter_dirs()
    if spec in named:
        return spec, Path(named[spec])
    path = Path(spec)
    if not (path / "adapter_config.json").is_file():
        raise ValueError(f"--adapter {spec!r} is neither a name in LORAMUX_ADAPTERS nor a PEFT adapter directory")
    return path.name, path


def cmd_medusa_train(args, settings) -> int:
    import torch
    from transformers import AutoModelForCausalLM

    from loramux.engine.engine import LLMEngine
    from loramux.model.loader import resolve_model_dir
    from loramux.model.medusa import shipped_medusa_dir
    from loramux.training.medusa_train import hidden_features, train_heads
    from loramux.training.prompts import builtin_prompts, read_prompts
    from loramux.training.self_distill import self_distilled

    if not 1 <= args.heads <= 8:
        raise ValueError(f"--heads must be from 1 to 8, got {args.heads}")
    if args.ship and (settings.model != DEFAULT_MODEL or args.adapter):
        raise ValueError("--ship writes the embedded model's base heads: no --model or --adapter with it")
    name, adapter_dir = _adapter_path(args.adapter, settings)
    prompts = read_prompts(args.prompts) if args.prompts else builtin_prompts()
    prompts = prompts[:args.limit] if args.limit else prompts
    out = shipped_medusa_dir() if args.ship else Path(args.out or f"medusa-{name or 'base'}")

    settings = settings.model_copy(update={"speculative_tokens": 0, "dtype": "float32"})
    engine = LLMEngine.from_settings(settings, load_adapters=False)
    if adapter_dir is not None:
        engine.load_adapter_dir(adapter_dir, name, allow_base_mismatch=False)
    print(f"answering {len(prompts)} prompts ({args.max_tokens} tokens at most each)", file=sys.stderr)
    conversations = self_distilled(engine, prompts, args.max_tokens, adapter=name)
    del engine

    model_dir = resolve_model_dir(settings.model, Path(settings.cache_dir))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if adapter_dir is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter_dir)
    model.eval()
    hidden, labels = hidden_features(model, conversations, args.heads)
    lm_head = model.get_output_embeddings().weight
    result = train_heads(hidden, labels, lm_head, epochs=args.epochs, lr=args.lr)
    result.save(out, base_model=settings.model, adapter=name, dtype=torch.float16 if args.ship else torch.float32)
    print(f"trained {args.heads} heads on {result.positions} positions in {result.seconds:.0f} s; held-out top-1 "
          f"accuracy per head: {', '.join(f'{a:.2f}' for a in result.accuracy)}; heads 1..k all right: "
          f"{', '.join(f'{a:.2f}' for a in result.chain_accuracy)}", file=sys.stderr)
    print(out)
    return 0
