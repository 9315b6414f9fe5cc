"""Trained embeddings and heads in a PEFT LoRA adapter, exactly as PEFT 0.21 serves them.

Three kinds of tensors outside the decoder projections, each named in `adapter_config.json`:

* **Embedding LoRA** (`embed_tokens` in `target_modules`): `lora_embedding_A` [r, vocab] and
  `lora_embedding_B` [hidden, r]; a token t's embedding gets `(A[:, t] @ B^T) * scale` added (PEFT's
  `lora.Embedding`; with Gemma's scaled embeddings the delta is scaled too, after the base rows are).
  `LoRAAdapter.embedding = (A, B)`; its scale is `LoRAAdapter.scale_of(EMBED_KEY)`.
* **Trained modules** (`modules_to_save` of `lm_head` / `embed_tokens`, PEFT's ModulesToSaveWrapper): a full
  replacement weight [vocab, hidden] for that adapter. `heads["lm_head"]`, `heads["embed_tokens"]`.
* **Trainable tokens** (`trainable_token_indices`, PEFT's TrainableTokensLayer): only some rows replaced;
  `heads["<module>.token_indices"]` (int64 [n]) and `heads["<module>.token_rows"]` ([n, hidden]).

Tied-embedding models (`tie_word_embeddings`) follow PEFT's rules: a `modules_to_save` copy or an embedding
LoRA changes only its own module, unless `ensure_weight_tying` is set, in which case PEFT keeps the head tied
(one replacement for both: `heads["lm_head"] is heads["embed_tokens"]`; the embedding LoRA also applies to
the head, as the tied Linear LoRA `logits += (h @ B) @ A * scale`, recorded as `heads["lm_head.lora"]`, an
empty marker). Trainable tokens of the embedding are shared with a tied head unless the config gives the
head its own, different indices (PEFT's `indices_mismatch`).

PEFT also saves the base weight of a module it wrapped with a LoRA (`get_peft_model_state_dict`:
`save_embedding_layers="auto"` when target_modules names embed_tokens and there are no trainable tokens, or
`save_embedding_layers=True`, which the config does not record): `embed_tokens.base_layer.weight` next to an
embedding LoRA, and `lm_head.base_layer.weight` when the head is tied with `ensure_weight_tying` (PEFT then
wraps the head with the tied LoRA too). Those are the only places such a copy is accepted; anywhere else
(`lm_head.base_layer.weight` on an untied model, either copy without an embedding LoRA) it is refused by name
(unknown_tensor), since loading it would silently replace the base weights. Loading one into PEFT overwrites
the base weights; here each is kept as `heads["<module>.base"]` and the device pool compares it with the
served weights once: equal (the usual case) it is dropped, different it serves as that adapter's replacement
(`head_slots.absorb_base_copies`). The upload summary counts each as the replacement it may become
(adapters/formats/summary.py). PEFT's plain copies without a LoRA (`embed_tokens.weight`, `lm_head.weight`, written by
`save_embedding_layers=True` without modules_to_save) are refused as unknown tensors.

Refused by name: LoRA on `lm_head` itself, other `modules_to_save` (e.g. a classifier `score`), and any
embedding or head whose row count differs from the base vocabulary (added tokens: `vocab_mismatch`).
"""
from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass, field

from loramux.adapters.formats.validation_common import CONFIG_FILE, fail, show

EMBED, HEAD = "embed_tokens", "lm_head"
HEAD_MODULES = (EMBED, HEAD)
EMBED_KEY = (-1, EMBED)  # `LoRAAdapter.scale_of` key of the embedding LoRA (per-module patterns may set it)
TIED_LORA = "lm_head.lora"  # heads marker: the embedding LoRA also applies to the tied head (ensure_weight_tying)

# PEFT's tensor names for the head modules (the adapter-name suffix `.default` is optional, as for projections).
# A multimodal model's language model holds them under `model.language_model.` (transformers 4.x Gemma 3:
# `language_model.model.embed_tokens`, `language_model.lm_head`).
_HEAD_TENSOR = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.language_model\.|language_model\.model\.|language_model\.|model\.)?"
    r"(embed_tokens|lm_head)\."
    r"(lora_embedding_A|lora_embedding_B|lora_A\.weight|lora_B\.weight|lora_A|lora_B|base_layer\.weight|"
    r"weight|modules_to_save\.weight|token_adapter\.trainable_tokens_delta)$")
_SUFFIX = re.compile(r"\.default(?=\.|$)")

_VOCAB_HELP = ("adapters that add tokens to the vocabulary (resize_token_embeddings) are not supported: train "
               "without new tokens, or give existing (e.g. reserved) token ids new rows with "
               "trainable_token_indices")


def head_tensor(name: str) -> tuple[str, str] | None:
    """(module, kind) of a head-module tensor name, or None. Kinds: lora_A, lora_B (embedding LoRA),
    head_lora_A, head_lora_B (LoRA on the Linear lm_head), base (a saved copy of the base weight),
    weight (a modules_to_save copy), tokens (trainable token rows)."""
    match = _HEAD_TENSOR.match(_SUFFIX.sub("", name))
    if match is None:
        return None
    module, rest = match.groups()
    kind = {"lora_embedding_A": "lora_A", "lora_embedding_B": "lora_B", "lora_A.weight": "head_lora_A",
            "lora_B.weight": "head_lora_B", "lora_A": "head_lora_A", "lora_B": "head_lora_B",
            "base_layer.weight": "base", "weight": "weight", "modules_to_save.weight": "weight",
            "token_adapter.trainable_tokens_delta": "tokens"}[rest]
    return module, kind


@dataclass
class HeadConfig:
    """What `adapter_config.json` asks of the embedding and the head."""

    embedding_lora: bool = False  # embed_tokens among target_modules
    modules_to_save: frozenset = frozenset()  # of HEAD_MODULES
    token_indices: dict = field(default_factory=dict)  # module -> tuple of token ids
    ensure_weight_tying: bool = False

    @property
    def any(self) -> bool:
        return self.embedding_lora or bool(self.modules_to_save) or bool(self.token_indices)


def _module_of(name, what: str) -> str:
    if not isinstance(name, str):
        raise fail("bad_option", f"{what} must name modules as strings, got {show(name)}")
    last = name.split(".")[-1]
    if last not in HEAD_MODULES:
        raise fail("unsupported_option",
                   f"{what} names {show(name)}; only lm_head and embed_tokens can be trained in full or by token "
                   "here (a classification head such as 'score' needs a sequence-classification server)")
    return last


def _indices(value, module: str) -> tuple[int, ...]:
    if not isinstance(value, list) or not value or not all(isinstance(i, int) and not isinstance(i, bool)
                                                           for i in value):
        raise fail("bad_option", f"trainable_token_indices for {module} must be a non-empty list of token ids, "
                                  f"got {show(value)}")
    if len(set(value)) != len(value):
        raise fail("bad_option", f"trainable_token_indices for {module} lists a token id twice; give each once")
    return tuple(value)


def head_config(config: Mapping, embedding_targeted: bool) -> HeadConfig:
    """Check and read the head options of a config (`embedding_targeted`: target_modules selects
    embed_tokens). Raises AdapterValidationError."""
    modules = config.get("modules_to_save") or []
    if not isinstance(modules, list):
        raise fail("bad_option", f"modules_to_save must be a list of module names, got {show(modules)}")
    saved = frozenset(_module_of(m, "modules_to_save") for m in modules)
    raw = config.get("trainable_token_indices")
    tokens: dict[str, tuple[int, ...]] = {}
    if isinstance(raw, list):
        tokens[EMBED] = _indices(raw, EMBED)
    elif isinstance(raw, dict):
        for name, value in raw.items():
            module = _module_of(name, "trainable_token_indices")
            tokens[module] = _indices(value, module)
    elif raw is not None:
        raise fail("bad_option", f"trainable_token_indices must be a list of token ids or a dict of module name "
                                  f"to token ids, got {show(raw)}")
    if both := saved & set(tokens):
        raise fail("bad_option", f"{sorted(both)[0]} is in modules_to_save and in trainable_token_indices; train it "
                                  "in full or by token, not both (PEFT refuses this too)")
    ensure = config.get("ensure_weight_tying", False)
    if ensure not in (True, False):
        raise fail("bad_option", f"ensure_weight_tying must be true or false, got {show(ensure)}")
    return HeadConfig(embedding_targeted, saved, tokens, bool(ensure))


@dataclass
class HeadPlan:
    """Which tensor of the upload each head entry comes from, after PEFT's tie rules."""

    expected: dict = field(default_factory=dict)  # (module, kind) -> shape the file must hold
    optional: set = field(default_factory=set)  # (module, kind) that may be absent (base copies, tied LoRA)
    tied_full: bool = False  # one replacement for embedding and head (modules_to_save + ensure_weight_tying)
    tied_tokens: bool = False  # the head shares the embedding's trainable tokens
    tied_lora: bool = False  # the embedding LoRA applies to the tied head too


def plan_heads(hc: HeadConfig, rank: int, vocab: int, hidden: int, tied: bool) -> HeadPlan:
    """The tensors a config with `hc` needs in the file, per PEFT 0.21 (see the module docstring)."""
    plan = HeadPlan()
    if hc.embedding_lora:
        plan.expected[(EMBED, "lora_A")] = (rank, vocab)
        plan.expected[(EMBED, "lora_B")] = (hidden, rank)
        plan.optional.add((EMBED, "base"))
        if tied and hc.ensure_weight_tying:
            plan.tied_lora = True
            plan.optional.update({(HEAD, "base"), (HEAD, "head_lora_A"), (HEAD, "head_lora_B")})
    saved = set(hc.modules_to_save)
    if tied and hc.ensure_weight_tying and saved:  # PEFT trains the embedding's copy and ties the head to it
        saved, plan.tied_full = {EMBED}, True
        plan.optional.add((HEAD, "weight"))  # saved too, as the tied copy: checked equal, then dropped
    for module in saved:
        plan.expected[(module, "weight")] = (vocab, hidden)
    token_modules = set(hc.token_indices)
    if tied and EMBED in hc.token_indices:
        own = hc.token_indices.get(HEAD)
        if own is None or own == hc.token_indices[EMBED]:
            plan.tied_tokens = True
            token_modules.discard(HEAD)
    for module in token_modules:
        plan.expected[(module, "tokens")] = (len(hc.token_indices[module]), hidden)
    return plan


def check_head_tensors(found: Mapping, plan: HeadPlan, hc: HeadConfig, vocab: int, hidden: int) -> None:
    """`found[(module, kind)]` = (tensor name, shape) of every head tensor in the file; refuse what the config
    does not account for, shapes that do not fit (added tokens by name) and missing tensors."""
    for (module, kind), (name, shape) in found.items():
        if kind in ("head_lora_A", "head_lora_B") and (module, kind) not in plan.optional:
            raise fail("unsupported_target", f"tensor {show(name)} is a LoRA on {module}; LoRA on the output head "
                                              "is not supported (train it with modules_to_save=[\"lm_head\"], "
                                              "or with trainable_token_indices for a few tokens)")
        want = plan.expected.get((module, kind))
        if kind == "base":
            if (module, kind) not in plan.optional:
                raise fail("unknown_tensor", _stray_base_copy(name, module, hc))
            want = (vocab, hidden)
        if want is None and (module, kind) not in plan.optional:
            hint = (" (save_pretrained(..., save_embedding_layers=True) writes such a copy of the base weight: "
                    "save with save_embedding_layers=False)") if kind == "weight" else ""
            raise fail("unknown_tensor", f"unexpected tensor {show(name)}: {CONFIG_FILE} does not ask for it "
                                          f"({_asked(hc)}); remove it or fix the config{hint}")
        if kind in ("weight", "base") and len(shape) == 2 and shape[0] != vocab and shape[1] == hidden:
            raise fail("vocab_mismatch", f"tensor {show(name)} has {shape[0]} token rows but the base model's "
                                          f"vocabulary has {vocab}: {_VOCAB_HELP}")
        if kind == "lora_A" and len(shape) == 2 and shape[1] != vocab:
            raise fail("vocab_mismatch", f"tensor {show(name)} covers {shape[1]} tokens but the base model's "
                                          f"vocabulary has {vocab}: {_VOCAB_HELP}")
        if want is not None and tuple(shape) != tuple(want):
            raise fail("shape_mismatch", f"tensor {show(name)} has shape {tuple(shape)}, expected {tuple(want)} "
                                          "on this base model")
    for module, indices in hc.token_indices.items():
        if bad := [i for i in indices if not 0 <= i < vocab]:
            raise fail("vocab_mismatch", f"trainable_token_indices for {module} names token id {bad[0]}, outside "
                                          f"the base vocabulary [0, {vocab}): {_VOCAB_HELP}")
    for key in plan.expected:
        if key not in found:
            raise fail("missing_tensor", f"{CONFIG_FILE} asks for {_what(key)} but {key[0]} has no such tensor in "
                                          "the weights file")


def _asked(hc: HeadConfig) -> str:
    parts = (["embed_tokens in target_modules"] if hc.embedding_lora else []) + \
        [f"modules_to_save={sorted(hc.modules_to_save)}"] * bool(hc.modules_to_save) + \
        [f"trainable_token_indices for {sorted(hc.token_indices)}"] * bool(hc.token_indices)
    return "; ".join(parts) or "it names no embed_tokens / lm_head change in target_modules, modules_to_save or " \
        "trainable_token_indices"


def _stray_base_copy(name: str, module: str, hc: HeadConfig) -> str:
    """Why a `<module>.base_layer.weight` the config does not explain is refused: PEFT writes one only for a
    module it wrapped with a LoRA (see the module docstring), and loading it would replace that module."""
    if module == EMBED:
        where, but = "next to a LoRA on embed_tokens (embed_tokens in target_modules)", f"{CONFIG_FILE} asks for none"
    else:
        where = ("on a model with tied embeddings (tie_word_embeddings), next to a LoRA on embed_tokens with "
                 "ensure_weight_tying: true")
        but = ("this base model does not tie its embeddings" if hc.embedding_lora and hc.ensure_weight_tying else
               f"{CONFIG_FILE} does not ask for that")
    return (f"unexpected tensor {show(name)}: a copy of the base {module} weight, which PEFT saves only {where}; "
            f"{but} ({_asked(hc)}), and loading it would replace the base {module}. Remove it (save with "
            f"save_embedding_layers=False), or to train {module} in full give modules_to_save=[\"{module}\"] "
            f"(saved as {module}.modules_to_save.weight)")


def _what(key: tuple[str, str]) -> str:
    module, kind = key
    return {"lora_A": "a LoRA on embed_tokens (lora_embedding_A)", "lora_B": "a LoRA on embed_tokens "
            "(lora_embedding_B)", "weight": f"a fully trained {module} (modules_to_save)",
            "tokens": f"trained token rows of {module} (trainable_token_indices)"}.get(kind, f"{module} {kind}")


def drop_tied_copies(tensors: dict, plan: HeadPlan) -> None:
    """PEFT also saves the tied head's view of weights it shares with the embedding (ensure_weight_tying):
    `lm_head.weight` beside the trained embedding, `lm_head.lora_A|B` = the embedding LoRA's B^T, A^T. Each
    must equal what it is tied to (else PEFT's loading would make the two disagree); then it is dropped."""
    import torch

    pairs = []
    if plan.tied_full:
        pairs.append(((HEAD, "weight"), lambda: tensors[(EMBED, "weight")]))
    if plan.tied_lora:
        pairs += [((HEAD, "head_lora_A"), lambda: tensors[(EMBED, "lora_B")].t()),
                  ((HEAD, "head_lora_B"), lambda: tensors[(EMBED, "lora_A")].t())]
    for key, tied_to in pairs:
        if key not in tensors:
            continue
        got, want = tensors.pop(key), tied_to()
        if got.shape != want.shape or not torch.equal(got, want.to(got.dtype)):
            raise fail("unsupported_option", f"{HEAD} is tied to {EMBED} (ensure_weight_tying) but its saved "
                                              f"{key[1].replace('head_', '')} differs from the {EMBED} weights it is "
                                              "tied to; save the adapter again from the tied model")


def assemble(tensors: Mapping, plan: HeadPlan, hc: HeadConfig):
    """(embedding, heads) for `LoRAAdapter` from the file's head tensors `tensors[(module, kind)]`."""
    import torch

    embedding = (tensors[(EMBED, "lora_A")], tensors[(EMBED, "lora_B")]) if hc.embedding_lora else None
    heads: dict = {}
    for module in HEAD_MODULES:
        if (module, "weight") in tensors:
            heads[module] = tensors[(module, "weight")]
        if (module, "base") in tensors:
            heads[f"{module}.base"] = tensors[(module, "base")]
        if (module, "tokens") in tensors:
            heads[f"{module}.token_indices"] = torch.tensor(hc.token_indices[module], dtype=torch.int64)
            heads[f"{module}.token_rows"] = tensors[(module, "tokens")]
    if plan.tied_full:
        heads[HEAD] = heads[EMBED]
    if plan.tied_tokens:
        heads[f"{HEAD}.token_indices"] = heads[f"{EMBED}.token_indices"]
        heads[f"{HEAD}.token_rows"] = heads[f"{EMBED}.token_rows"]
    if plan.tied_lora:
        heads[TIED_LORA] = torch.empty(0)
    return embedding, heads


def heads_nbytes(embedding, heads: Mapping) -> int:
    """Host bytes of an adapter's embedding LoRA and heads (a tensor shared by two heads counted once)."""
    seen, total = set(), 0
    for t in [*(embedding or ()), *heads.values()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def describe(embedding, heads: Mapping) -> list[str]:
    """Short words for what an adapter changes outside the projections (validation summaries, the console)."""
    out = []
    if embedding is not None:
        out.append(f"embed_tokens LoRA r={embedding[0].shape[0]}" + (" (tied lm_head too)" if TIED_LORA in heads
                                                                      else ""))
    for module in HEAD_MODULES:
        if module in heads:
            tied = module == HEAD and heads.get(HEAD) is heads.get(EMBED)
            out.append(f"{module} trained in full" + (" (tied to embed_tokens)" if tied else ""))
        if f"{module}.token_indices" in heads:
            out.append(f"{module}: {heads[f'{module}.token_indices'].numel()} trained token rows")
    return out
