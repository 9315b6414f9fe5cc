"""Grammar engines for structured output: per-token mask cost of xgrammar (what loramux uses) vs llguidance.

Workload: SmolLM2-135M-Instruct's tokenizer (49152 tokens), three JSON schemas (a flat record, a nested order
with arrays of objects, an enum/nullable-heavy form), compiled the way loramux compiles them: no free
whitespace, separators ", " and ": ", strict (no extra properties). One valid document per schema, tokenized
with the model's tokenizer, stands in for what a model generates. A batch of B rows (row i follows schema
i % 3) steps through its documents in lockstep; at every step each row fills its row of one [B, V/32] int32
bitmask with the tokens allowed next, then accepts its next token. That is the work a decode step adds per
constrained row (loramux fills row by row on the engine thread, so both engines run one row after the
other on one thread here; neither's thread pool is used). Time per token = wall time / (rows x tokens).

Rows reported:
  xgrammar    GrammarMatcher.fill_next_token_bitmask + accept_token
  loramux     loramux.engine.structured.constraint.Constraint.accept: xgrammar's fill + accept, plus the engine's own
              work per token (the control-character mask AND, the "only a stop token is left" check)
  llguidance  llguidance.torch.fill_next_token_bitmask + LLMatcher.consume_token (pip install llguidance,
              or `pip install -e '.[bench]'`; the row is skipped, with that hint, when it is missing)
Compile time (first compile of each schema, median over the schemas) is printed too.

Default: B = 8 and 32, 5 rounds (medians), whole documents; --quick: 1 round, the first 16 tokens of each
document (a smoke run of a few seconds). Ends with FIGURE lines: grammar_mask_us_<engine>_b<B> (microseconds
per token and row, lower is better) and grammar_compile_ms_<engine>.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from loramux.testing import describe_cpu

SCHEMAS = {
    "flat": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 40}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "email": {"type": "string", "pattern": "^[a-z.]+@[a-z]+\\.[a-z]{2,4}$"}, "active": {"type": "boolean"},
        "score": {"type": "number"}}, "required": ["name", "age", "email", "active", "score"]},
    "nested": {"type": "object", "properties": {
        "customer": {"type": "object", "properties": {"id": {"type": "integer"}, "tags": {
            "type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 5}}, "required": ["id", "tags"]},
        "items": {"type": "array", "minItems": 1, "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}, "price": {"type": "number"}},
            "required": ["sku", "qty", "price"]}}}, "required": ["customer", "items"]},
    "form": {"type": "object", "properties": {
        "country": {"enum": ["France", "Germany", "Italy", "Spain", "Portugal"]},
        "size": {"enum": ["XS", "S", "M", "L", "XL"]}, "note": {"type": ["string", "null"]},
        "newsletter": {"type": ["boolean", "null"]}, "rating": {"type": "integer", "minimum": 1, "maximum": 5},
        "comment": {"type": "string", "maxLength": 200}},
        "required": ["country", "size", "note", "newsletter", "rating", "comment"]},
}
DOCUMENTS = {
    "flat": {"name": "Ada Lovelace", "age": 36, "email": "ada.lovelace@example.org", "active": True,
             "score": 97.25},
    "nested": {"customer": {"id": 48213, "tags": ["priority", "wholesale", "eu"]},
               "items": [{"sku": "AB-1234", "qty": 3, "price": 19.99}, {"sku": "ZX-0007", "qty": 12, "price": 2.5},
                         {"sku": "QQ-5555", "qty": 1, "price": 149.0}]},
    "form": {"country": "Portugal", "size": "M", "note": None, "newsletter": False, "rating": 4,
             "comment": "Quick delivery, the fit is true to size and the fabric feels good."},
}


def load_tokenizer():
    from transformers import AutoTokenizer

    from loramux.model.loader import resolve_model_dir
    from loramux.settings import DEFAULT_MODEL, Settings

    return AutoTokenizer.from_pretrained(resolve_model_dir(DEFAULT_MODEL, Path(Settings().cache_dir)))


class XGrammar:
    name = "xgrammar"

    def __init__(self, tokenizer, vocab: int):
        import xgrammar as xgr

        self.xgr = xgr
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)

    def compile(self, schema: dict):
        return self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def step(self, matcher, bitmask, row: int, token: int) -> bool:
        matcher.fill_next_token_bitmask(bitmask, row)
        return matcher.accept_token(token)


class Loramux:
    name = "loramux"

    def __init__(self, tokenizer, vocab: int):
        from loramux.engine.sampling.params import StructuredOutput
        from loramux.engine.structured.grammar import GrammarCache

        self.cache = GrammarCache(tokenizer, vocab, [tokenizer.eos_token_id])
        self.spec = lambda schema: StructuredOutput("json_schema", json.dumps(schema))

    def compile(self, schema: dict):
        self.cache.compile(self.spec(schema))
        return schema

    def matcher(self, schema):
        from loramux.engine.structured.constraint import Constraint

        return Constraint(self.cache, self.spec(schema))

    def step(self, constraint, bitmask, row: int, token: int) -> bool:
        bitmask[row] = constraint.mask[0]  # what batch_masker gathers for the step
        return constraint.accept(token)  # accept, then fill the next mask (+ the engine's checks)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tokenizer, vocab: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch

        self.llg = llguidance
        self.tokenizer = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab)

    def compile(self, schema: dict):
        options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
        grammar = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults=options)
        matcher = self.llg.LLMatcher(self.tokenizer, grammar)  # llguidance compiles lazily, per matcher
        if matcher.is_error():
            raise RuntimeError(matcher.get_error())
        return grammar

    def matcher(self, grammar):
        return self.llg.LLMatcher(self.tokenizer, grammar)

    def step(self, matcher, bitmask, row: int, token: int) -> bool:
        self.llg.torch.fill_next_token_bitmask(matcher, bitmask, row)
        return matcher.consume_token(token) and not matcher.is_error()


def run_round(engine, compiled: dict, docs: dict[str, list[int]], batch: int, vocab: int) -> float:
    """Seconds per (row, token) for one pass of `batch` fresh matchers over their documents."""
    import torch

    names = list(SCHEMAS)
    rows = [(engine.matcher(compiled[names[i % len(names)]]), docs[names[i % len(names)]]) for i in range(batch)]
    bitmask = torch.full((batch, (vocab + 31) // 32), -1, dtype=torch.int32)
    steps = max(len(d) for _, d in rows)
    count = 0
    t0 = time.perf_counter()
    for t in range(steps):
        for i, (matcher, doc) in enumerate(rows):
            if t < len(doc):
                if not engine.step(matcher, bitmask, i, doc[t]):
                    raise RuntimeError(f"{engine.name} rejected token {t} of its {names[i % len(names)]} document")
                count += 1
    return (time.perf_counter() - t0) / count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="1 round over the first 16 tokens (a smoke run)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32])
    args = parser.parse_args()
    rounds, cap = (1, 16) if args.quick else (args.rounds, None)

    import torch

    torch.set_num_threads(1)
    print(describe_cpu())
    print("one thread")
    tokenizer = load_tokenizer()
    vocab = len(tokenizer)
    docs = {n: tokenizer.encode(json.dumps(d), add_special_tokens=False)[:cap] for n, d in DOCUMENTS.items()}
    print(f"tokenizer: SmolLM2, {vocab} tokens; documents: "
          + ", ".join(f"{n} {len(d)} tokens" for n, d in docs.items()) + f"; {rounds} round(s), medians")

    engines = []
    for cls in (XGrammar, Loramux, LLGuidance):
        try:
            engines.append(cls(tokenizer, vocab))
        except ImportError as exc:
            print(f"{cls.name}: not installed ({exc.name}); pip install llguidance, or pip install -e '.[bench]'")
    figures: dict[str, float] = {}
    for engine in engines:
        compiled, compile_s = {}, []
        for name, schema in SCHEMAS.items():
            t0 = time.perf_counter()
            compiled[name] = engine.compile(schema)
            compile_s.append(time.perf_counter() - t0)
        figures[f"grammar_compile_ms_{engine.name}"] = statistics.median(compile_s) * 1e3
        for batch in args.batches:
            per_token = statistics.median(run_round(engine, compiled, docs, batch, vocab) for _ in range(rounds))
            figures[f"grammar_mask_us_{engine.name}_b{batch}"] = per_token * 1e6
            print(f"{engine.name:11s} b{batch:<3d} {per_token * 1e6:8.1f} us per token and row "
                  f"({per_token * batch * 1e3:.2f} ms per decode step of {batch} constrained rows)", flush=True)
        print(f"{engine.name:11s} compile {figures[f'grammar_compile_ms_{engine.name}']:.1f} ms (median of the "
              f"{len(SCHEMAS)} schemas)")
    for name in sorted(figures, key=lambda n: (not n.startswith("grammar_mask"), n)):
        print(f"FIGURE {name} {figures[name]:.2f}")


if __name__ == "__main__":
    main()
