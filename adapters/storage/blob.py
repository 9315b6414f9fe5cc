"""The stored form of one adapter version: a single canonical safetensors blob, addressed by its sha256.

Tensors are named `layers.<i>.<target>.lora_A|B` (and `.lora_magnitude` for DoRA; an embedding LoRA
`embed_tokens.lora_A|B`, trained heads `heads.<name>`, LoRA on routed experts `experts.<i>.<gate_up|down>.lora_A|B`
as [E, R, d_in] / [E, d_out, R]: see `pack`) and keep their uploaded dtype (each module
at its own rank: the shapes say it); the normalised LoRA config (r, lora_alpha, use_rslora, target_modules;
`module_scales` {"<layer>.<target>": scale} where rank_pattern / alpha_pattern gave a module another scale;
use_dora: true for a DoRA adapter; the last two absent otherwise, so a plain adapter's blob keeps its bytes and
digest) rides in the safetensors metadata. Every download is
checked against the digest before it is parsed, so a corrupt or substituted object is never served.
"""
from __future__ import annotations

import hashlib
import json

import torch
from safetensors.torch import load as load_safetensors_bytes

from loramux.adapters.formats.peft import TARGETS, AdapterFormatError, LoRAAdapter, float_heads

FORMAT = "loramux-lora/1"


class DigestMismatchError(AdapterFormatError):
    """The bytes do not hash to the digest they were stored under (corrupt or substituted object)."""


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pack(rank: int, alpha: float, use_rslora: bool, target_modules, tensors,
         module_scales: dict | None = None, magnitudes: dict | None = None, *, embedding=None,
         heads=None, experts=None) -> tuple[bytes, str]:
    """Serialise validated weights {(layer, target): (A, B)}, the modules' own scales {(layer, target): scale}
    (where they differ from alpha / r) and, for DoRA, `magnitudes` {(layer, target): m}; returns (blob, sha256
    hex digest). `embedding` (A, B) and `heads` {name: tensor} are an adapter's embedding LoRA and trained heads
    (see adapters/formats/heads.py): stored as `embed_tokens.lora_A|B` and `heads.<name>`; a head that is the same
    tensor as another (a tied head) is stored once and named in the metadata's `aliases`. `experts`
    {(layer, "gate_up" | "down"): (A [E, R, d_in], B [E, d_out, R])} is LoRA on routed experts
    (adapters/formats/experts.py), stored as `experts.<layer>.<name>.lora_A|B`."""
    config = {"r": int(rank), "lora_alpha": float(alpha), "use_rslora": bool(use_rslora),
              "target_modules": [t for t in TARGETS if t in set(target_modules)]}
    if module_scales:  # floats round-trip through JSON exactly (repr)
        config["module_scales"] = {f"{layer}.{target}": float(scale) for (layer, target), scale in
                                   sorted(module_scales.items(), key=lambda kv: (kv[0][0], TARGETS.index(kv[0][1])))}
    magnitudes = magnitudes or {}
    if magnitudes:
        config["use_dora"] = True
    header: dict = {"__metadata__": {"config": json.dumps(config, sort_keys=True), "format": FORMAT}}
    named = []
    for (layer, target), (a, b) in sorted(tensors.items(), key=lambda kv: (kv[0][0], TARGETS.index(kv[0][1]))):
        parts = (("lora_A", a), ("lora_B", b))
        if (layer, target) in magnitudes:
            parts += (("lora_magnitude", magnitudes[(layer, target)]),)
        named += [(f"layers.{layer}.{target}.{kind}", tensor) for kind, tensor in parts]
    if embedding is not None:
        named += [("embed_tokens.lora_A", embedding[0]), ("embed_tokens.lora_B", embedding[1])]
    for (layer, name), (a, b) in sorted((experts or {}).items()):
        named += [(f"experts.{layer}.{name}.lora_A", a), (f"experts.{layer}.{name}.lora_B", b)]
    aliases, flags, first = {}, [], {}
    for name, tensor in sorted((heads or {}).items()):
        if tensor.numel() == 0:  # a marker (e.g. heads.TIED_LORA)
            flags.append(name)
        elif id(tensor) in first:
            aliases[name] = first[id(tensor)]
        else:
            first[id(tensor)] = name
            named.append((f"heads.{name}", tensor))
    if aliases or flags:
        header["__metadata__"]["heads"] = json.dumps({"aliases": aliases, "flags": flags}, sort_keys=True)
    chunks, offset = [], 0
    for name, tensor in named:
        data = tensor.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": _DTYPE_NAMES[tensor.dtype], "shape": list(tensor.shape),
                        "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    # Written by hand, not with safetensors.save: its header order is not stable across processes, and
    # the digest must be a function of the content alone.
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    blob = len(text).to_bytes(8, "little") + text + b"".join(chunks)
    return blob, sha256_hex(blob)


_DTYPE_NAMES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.int64: "I64"}


def check_digest(blob: bytes, digest: str) -> None:
    """DigestMismatchError unless `blob` hashes to `digest` (every stored blob is checked before it is parsed)."""
    actual = sha256_hex(blob)
    if actual != digest:
        raise DigestMismatchError(f"the stored bytes hash to {actual[:12]}…, expected {digest[:12]}… "
                                  "(corrupt object in the store)")


def unpack(blob: bytes, name: str, digest: str | None = None) -> LoRAAdapter:
    """Parse a blob written by `pack` into a float32 LoRAAdapter; verify `digest` first when given."""
    if digest is not None:
        check_digest(blob, digest)
    header_len = int.from_bytes(blob[:8], "little")
    metadata = json.loads(blob[8:8 + header_len]).get("__metadata__", {})
    if metadata.get("format") != FORMAT:
        raise AdapterFormatError(f"adapter {name!r}: not a {FORMAT} blob")
    config = json.loads(metadata["config"])
    tensors = load_safetensors_bytes(blob)
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = {}
    magnitudes: dict[tuple[int, str], torch.Tensor] = {}
    for key in tensors:
        if not key.startswith("layers."):
            continue
        _, layer, target, kind = key.split(".")
        if kind == "lora_A":
            b = tensors[key[:-1] + "B"]
            weights[(int(layer), target)] = (tensors[key].float().contiguous(), b.float().contiguous())
        elif kind == "lora_magnitude":
            magnitudes[(int(layer), target)] = tensors[key].float().contiguous()
    if bool(config.get("use_dora")) != bool(magnitudes) or (magnitudes and set(magnitudes) != set(weights)):
        raise AdapterFormatError(f"adapter {name!r}: the blob's DoRA magnitudes do not match its config")
    module_scales = {(int(key.split(".")[0]), key.split(".")[1]): float(scale)
                     for key, scale in config.get("module_scales", {}).items()}
    embedding = (tensors["embed_tokens.lora_A"], tensors["embed_tokens.lora_B"]) \
        if "embed_tokens.lora_A" in tensors else None
    heads = {key[len("heads."):]: tensor for key, tensor in tensors.items() if key.startswith("heads.")}
    extra = json.loads(metadata.get("heads", "{}"))
    heads.update({alias: heads[source] for alias, source in extra.get("aliases", {}).items()})
    heads.update({flag: torch.empty(0) for flag in extra.get("flags", [])})
    embedding, heads = float_heads(embedding, heads)
    experts = {}
    for key in tensors:
        if key.startswith("experts.") and key.endswith(".lora_A"):
            _, layer, expert_name, _ = key.split(".")
            experts[(int(layer), expert_name)] = (tensors[key].float().contiguous(),
                                                  tensors[key[:-1] + "B"].float().contiguous())
    return LoRAAdapter(name=name, rank=config["r"], alpha=config["lora_alpha"], use_rslora=config["use_rslora"],
                       target_modules=tuple(config["target_modules"]), weights=weights,
                       digest=digest or sha256_hex(blob), module_scales=module_scales, magnitudes=magnitudes,
                       embedding=embedding, heads=heads, experts=experts)
