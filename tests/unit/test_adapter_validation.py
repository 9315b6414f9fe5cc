"""Adapter upload validation: a fuzz corpus of hostile uploads, each refused with its own code and message."""
from __future__ import annotations

import hashlib
import io
import json
import pickle
import pickletools
import struct
import time
import tracemalloc
from pathlib import Path

import pytest
import torch
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save as save_safetensors_bytes

from loramux.adapters.formats.peft import AdapterFormatError, build_adapter, load_adapter_dir
from loramux.adapters.formats.validation import (
    ALLOWED_FILENAMES,
    AdapterValidationError,
    UploadLimits,
    ValidatedAdapter,
    validate_adapter_files,
)
from loramux.model.config import ModelConfig
from loramux.testing import write_peft_adapter

CONFIG, WEIGHTS = ALLOWED_FILENAMES
TARGETS = ["q_proj", "v_proj", "down_proj"]
RANK = 4

BASE = ModelConfig(model_type="llama", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                   num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=10000.0,
                   max_position_embeddings=512, tie_word_embeddings=False, attention_bias=False)


@pytest.fixture(autouse=True)
def no_unpickling(monkeypatch):
    """Nothing in validation may unpickle or torch.load: make every such call fail the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("validation must never unpickle or torch.load anything")

    for obj, attr in [(pickle, "load"), (pickle, "loads"), (pickle, "Unpickler"), (torch, "load")]:
        monkeypatch.setattr(obj, attr, refuse)


@pytest.fixture(scope="module")
def adapter(tmp_path_factory) -> dict[str, bytes]:
    """A valid rank-4 float32 adapter for BASE, as upload bytes."""
    path = write_peft_adapter(tmp_path_factory.mktemp("adapter"), BASE, RANK, TARGETS, seed=0)
    return {CONFIG: (path / CONFIG).read_bytes(), WEIGHTS: (path / WEIGHTS).read_bytes()}


# ------------------------------------------------------------------------------------------------ builders

def split(blob: bytes) -> tuple[dict, bytes]:
    n = struct.unpack("<Q", blob[:8])[0]
    return json.loads(blob[8:8 + n]), blob[8 + n:]


def safetensors_blob(header: dict, data: bytes) -> bytes:
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    return struct.pack("<Q", len(raw)) + raw + data


def edit_header(blob: bytes, edit) -> bytes:
    header, data = split(blob)
    edit(header)
    return safetensors_blob(header, data)


def edit_config(files: dict, **changes) -> dict:
    config = json.loads(files[CONFIG])
    config.update(changes)
    return {**files, CONFIG: json.dumps(config).encode()}


def edit_tensors(files: dict, edit) -> dict:
    tensors = load_safetensors_bytes(files[WEIGHTS])
    edit(tensors)
    return {**files, WEIGHTS: save_safetensors_bytes(tensors)}


def tensor_names(blob: bytes) -> list[str]:
    return sorted(n for n in split(blob)[0] if n != "__metadata__")


class Payload:
    """Unpickling this creates (truncates) the marker file: what a hostile adapter_model.bin would do."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return open, (self.marker, "w")


def hostile_pickle(marker: Path) -> bytes:
    blob = pickle.dumps(Payload(marker))
    ops = {op.name for op, _, _ in pickletools.genops(blob)}  # inspect the opcodes, never execute them
    assert "REDUCE" in ops and str(marker).encode() in blob
    return blob


def torch_save_bytes() -> bytes:
    buffer = io.BytesIO()
    torch.save({"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(RANK, 64)}, buffer)
    return buffer.getvalue()


def overlap(header: dict) -> None:  # the second lora_A of q_proj reuses the first one's bytes
    a0 = header["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    header["base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"]["data_offsets"] = a0["data_offsets"]


def first(header: dict) -> dict:
    return header[min(n for n in header if n != "__metadata__")]


def out_of_bounds(header: dict) -> None:
    entry = first(header)
    begin, end = entry["data_offsets"]
    entry["data_offsets"] = [begin + 10**6, end + 10**6]


def lying_span(header: dict) -> None:
    entry = first(header)
    entry["data_offsets"] = [entry["data_offsets"][0], entry["data_offsets"][0] + 16]


def set_first(header: dict, **fields) -> None:
    first(header).update(fields)


def nan_in(name_part: str, value: float):
    def edit(tensors):
        name = next(n for n in sorted(tensors) if name_part in n)
        tensors[name][0, 0] = value
    return edit


# ------------------------------------------------------------------------------------------------ the corpus
# Each case: files -> (files, limits or None, base_model_id or None); then the expected code and a message part.

LAYER_0_ONLY = r"model\.layers\.0\..*(q|v|down)_proj"


def case(build, code: str, fragment: str, limits: UploadLimits | None = None, base_model_id: str | None = None):
    return build, code, fragment, limits, base_model_id


CASES = {
    # file names
    "pickle-named-bin": case(lambda f, m: {CONFIG: f[CONFIG], "adapter_model.bin": hostile_pickle(m)},
                             "pickle_refused", "pickle weights are refused: save the adapter as safetensors"),
    "pickle-named-pt": case(lambda f, m: {**f, "adapter_model.PT": hostile_pickle(m)},
                            "pickle_refused", "pickle weights are refused"),
    "pickle-as-safetensors": case(lambda f, m: {**f, WEIGHTS: hostile_pickle(m)},
                                  "pickle_refused", "holds a pickle file"),
    "pickle-protocol-2-as-safetensors": case(lambda f, m: {**f, WEIGHTS: pickle.dumps(Payload(m), protocol=2)},
                                             "pickle_refused", "holds a pickle file"),
    "torch-save-zip-as-safetensors": case(lambda f, m: {**f, WEIGHTS: torch_save_bytes()},
                                          "pickle_refused", "zip (torch.save)"),
    "dotdot-name": case(lambda f, m: {**f, "../adapter_model.safetensors": f[WEIGHTS]},
                        "bad_filename", "'../adapter_model.safetensors' is not allowed"),
    "absolute-name": case(lambda f, m: {**f, "/etc/passwd": b"root:x:0:0"}, "bad_filename", "without directories"),
    "nested-dotdot-name": case(lambda f, m: {**f, "a/../../x": b"x"}, "bad_filename", "'a/../../x'"),
    "nul-in-name": case(lambda f, m: {CONFIG: f[CONFIG], "adapter_model.safetensors\x00.txt": f[WEIGHTS]},
                        "bad_filename", "control characters"),
    "backslash-name": case(lambda f, m: {**f, "..\\adapter_config.json": f[CONFIG]}, "bad_filename", "not allowed"),
    "drive-letter-name": case(lambda f, m: {**f, "C:evil": b"x"}, "bad_filename", "not allowed"),
    "extra-file": case(lambda f, m: {**f, "README.md": b"# hi"}, "unexpected_file", "unexpected file 'README.md'"),
    "missing-weights": case(lambda f, m: {CONFIG: f[CONFIG]}, "missing_file",
                            "adapter_model.safetensors is missing"),
    "missing-config": case(lambda f, m: {WEIGHTS: f[WEIGHTS]}, "missing_file", "adapter_config.json is missing"),
    # sizes
    "oversized-weights": case(lambda f, m: f, "too_large", "above this server's limit of 1000 bytes",
                              limits=UploadLimits(max_total_bytes=1000)),
    "oversized-config": case(lambda f, m: {**f, CONFIG: f[CONFIG][:-1] + b', "notes": "' + b"x" * 70000 + b'"}'},
                             "config_too_large", "above this server's limit of 65536 bytes"),
    # safetensors structure
    "truncated-length": case(lambda f, m: {**f, WEIGHTS: b"\x10\x00\x00"}, "truncated", "too short for the 8-byte"),
    "header-longer-than-file": case(lambda f, m: {**f, WEIGHTS: struct.pack("<Q", 1000) + b"{}" + b" " * 18},
                                    "truncated", "declares 1000 bytes but only 20 follow"),
    "header-over-cap": case(lambda f, m: {**f, WEIGHTS: struct.pack("<Q", 2**62) + b"{}"},
                            "header_too_large", "above this server's limit of 16777216 bytes"),
    "header-over-small-cap": case(lambda f, m: f, "header_too_large", "limit of 64 bytes",
                                  limits=UploadLimits(max_header_bytes=64)),
    "header-not-json": case(lambda f, m: {**f, WEIGHTS: struct.pack("<Q", 9) + b"{not json"},
                            "bad_header", "header is not valid JSON"),
    "header-not-utf8": case(lambda f, m: {**f, WEIGHTS: struct.pack("<Q", 4) + b'{"\xff"'},
                            "bad_header", "not UTF-8"),
    "header-is-a-list": case(lambda f, m: {**f, WEIGHTS: struct.pack("<Q", 2) + b"[]"},
                             "bad_header", "must be a JSON object"),
    "header-deeply-nested": case(lambda f, m: {**f, WEIGHTS: struct.pack("<Q", 200000) + b"[" * 200000},
                                 "bad_header", "not valid JSON"),
    "header-duplicate-key": case(lambda f, m: {**f, WEIGHTS: struct.pack("<Q", 16) + b'{"a":{},"a":{}} '},
                                 "bad_header", "repeats a key"),
    "header-missing-field": case(lambda f, m: {**f, WEIGHTS: edit_header(f[WEIGHTS], lambda h: first(h).pop("shape"))},
                                 "bad_header", "must have exactly dtype, shape and data_offsets"),
    "header-negative-shape": case(lambda f, m: {**f, WEIGHTS: edit_header(f[WEIGHTS], lambda h: set_first(
        h, shape=[-4, 64]))}, "bad_header", "list of non-negative integers"),
    "header-bad-metadata": case(lambda f, m: {**f, WEIGHTS: edit_header(f[WEIGHTS], lambda h: h.update(
        __metadata__={"format": 1}))}, "bad_header", "__metadata__ must map strings to strings"),
    "overlapping-tensors": case(lambda f, m: {**f, WEIGHTS: edit_header(f[WEIGHTS], overlap)},
                                "overlapping_tensors", "share bytes of the data section"),
    "offsets-outside-file": case(lambda f, m: {**f, WEIGHTS: edit_header(f[WEIGHTS], out_of_bounds)},
                                 "offset_out_of_bounds", "of the data section, which has only"),
    "lying-span": case(lambda f, m: {**f, WEIGHTS: edit_header(f[WEIGHTS], lying_span)},
                       "span_mismatch", "but its data_offsets span 16 bytes"),
    "dtype-i64": case(lambda f, m: {**f, WEIGHTS: edit_header(f[WEIGHTS], lambda h: set_first(h, dtype="I64"))},
                      "bad_dtype", "has dtype 'I64'; LoRA weights must be F32, F16, BF16"),
    "trailing-bytes": case(lambda f, m: {**f, WEIGHTS: f[WEIGHTS] + b"\x80\x04junk"},
                           "data_gap", "6 bytes after the last tensor belong to no tensor"),
    "too-many-tensors-small-cap": case(lambda f, m: f, "too_many_tensors", "more than 5 tensors",
                                       limits=UploadLimits(max_tensors=5)),
    # config
    "config-not-json": case(lambda f, m: {**f, CONFIG: b"{'r': 4}"}, "bad_json", "adapter_config.json is not valid"),
    "config-not-object": case(lambda f, m: {**f, CONFIG: b"[1, 2]"}, "bad_json", "must hold a JSON object"),
    # json.loads(bytes) read UTF-16/32 too; PEFT reads the file as UTF-8 text
    "config-utf16": case(lambda f, m: {**f, CONFIG: f[CONFIG].decode().encode("utf-16")}, "bad_json", "not UTF-8"),
    "config-utf32-deep": case(lambda f, m: {**f, CONFIG: ("[" * 10_000).encode("utf-32")}, "bad_json", "not UTF-8"),
    "config-utf8-bom": case(lambda f, m: {**f, CONFIG: b"\xef\xbb\xbf" + f[CONFIG]}, "bad_json", "BOM"),
    "auto-map": case(lambda f, m: edit_config(f, auto_map={"AutoModel": "evil.Model"}), "code_hook",
                     "sets 'auto_map'"),
    "trust-remote-code": case(lambda f, m: edit_config(f, trust_remote_code=True), "code_hook", "trust_remote_code"),
    "hydra-target": case(lambda f, m: edit_config(f, init={"_target_": "os.system"}), "code_hook", "'_target_'"),
    "not-lora": case(lambda f, m: edit_config(f, peft_type="IA3"), "not_lora", "peft_type must be LORA, got 'IA3'"),
    "dora-without-magnitudes": case(lambda f, m: edit_config(f, use_dora=True), "missing_tensor", "DoRA magnitude"),
    "rank-zero": case(lambda f, m: edit_config(f, r=0), "rank_out_of_range", "r must be a positive integer, got 0"),
    "rank-above-max": case(lambda f, m: edit_config(f, r=65), "rank_out_of_range",
                           "rank 65 is above this server's maximum LoRA rank 64"),
    "rank-not-int": case(lambda f, m: edit_config(f, r="4"), "bad_rank", "r must be a positive integer, got '4'"),
    "alpha-zero": case(lambda f, m: edit_config(f, lora_alpha=0), "bad_alpha", "lora_alpha must be a positive"),
    "alpha-nan": case(lambda f, m: edit_config(f, lora_alpha=float("nan")), "bad_alpha", "got nan"),
    "alpha-inf": case(lambda f, m: edit_config(f, lora_alpha=float("inf")), "bad_alpha", "got inf"),
    "base-model-mismatch": case(lambda f, m: edit_config(f, base_model_name_or_path="meta-llama/Llama-3.1-8B"),
                                "base_model_mismatch", "'meta-llama/Llama-3.1-8B' (base_model_name_or_path) but "
                                "this server serves 'SmolLM2-135M-Instruct'",
                                base_model_id="/srv/models/HuggingFaceTB/SmolLM2-135M-Instruct"),
    "base-model-other-hub-model": case(lambda f, m: edit_config(f, base_model_name_or_path="meta-llama/Llama-2-7b-hf"),
                                       "base_model_mismatch", "set base_model_name_or_path in adapter_config.json to "
                                       "'SmolLM2-135M-Instruct' (or to the local path of the copy it was trained "
                                       "from); if you know the shapes and weights match, upload it with "
                                       "allow_base_mismatch=true", base_model_id="SmolLM2-135M-Instruct"),
    "base-model-not-text": case(lambda f, m: edit_config(f, base_model_name_or_path=["a", "b"]), "bad_option",
                                "base_model_name_or_path must be a string", base_model_id="SmolLM2-135M-Instruct"),
    # tensors against the base model
    "wrong-shapes": case(lambda f, m: edit_config(f, r=8), "shape_mismatch", "for r=8 on this base model"),
    "unknown-tensor": case(lambda f, m: edit_tensors(f, lambda t: t.update(extra=torch.zeros(2))),
                           "unknown_tensor", "unexpected tensor 'extra'"),
    "lm-head": case(lambda f, m: edit_tensors(f, lambda t: t.update(
        {"base_model.model.lm_head.lora_A.weight": torch.zeros(RANK, 64)})), "unsupported_target", "lm_head"),
    "layer-out-of-range": case(lambda f, m: edit_tensors(f, lambda t: t.update(
        {"base_model.model.model.layers.7.self_attn.q_proj.lora_A.weight": torch.zeros(RANK, 64)})),
        "layer_out_of_range", "is for layer 7, the base model has 2 layers"),
    "missing-tensor": case(lambda f, m: edit_tensors(f, lambda t: t.pop(
        "base_model.model.model.layers.1.mlp.down_proj.lora_B.weight")), "missing_tensor", "layer 1 down_proj lacks"),
    "declared-targets-differ": case(lambda f, m: edit_config(f, target_modules=["q_proj"]), "target_mismatch",
                                    "must be the same projections"),
    # target_modules regexes: RE2 (linear time), matched whole against the base model's module names
    "redos-target-pattern": case(lambda f, m: edit_config(f, target_modules="(?:.*){60}z"), "target_mismatch",
                                 "the target_modules pattern '(?:.*){60}z' selects [] of this base model"),
    "target-pattern-lookaround": case(lambda f, m: edit_config(f, target_modules=r"(?=.*q_proj).*"), "bad_option",
                                      "is not a supported regular expression"),
    "target-pattern-backreference": case(lambda f, m: edit_config(f, target_modules=r"(.)\1.*"), "bad_option",
                                         "RE2 syntax (no lookaround or backreferences"),
    "target-pattern-huge-repeat": case(lambda f, m: edit_config(f, target_modules="((a{100}){100}){100}"),
                                       "bad_option", "invalid repetition size"),
    "target-pattern-too-long": case(lambda f, m: edit_config(f, target_modules="a|" * 600 + ".*"), "bad_option",
                                    "target_modules pattern is 1202 characters, above the limit of 1000"),
    "target-pattern-bare-names": case(lambda f, m: edit_config(f, target_modules="q_proj|v_proj|down_proj"),
                                      "target_mismatch", "matched whole (fullmatch, as PEFT does)"),
    "target-pattern-misses-a-target": case(lambda f, m: edit_config(f, target_modules=r".*\.(q_proj|v_proj)"),
                                           "target_mismatch", "selects ['q_proj', 'v_proj']"),
    "target-pattern-layer-subset": case(lambda f, m: edit_config(f, target_modules=LAYER_0_ONLY), "target_mismatch",
                                        "is for layer 1 "),  # layer 1's tensors: a module the regex leaves out
    "nan-weights": case(lambda f, m: edit_tensors(f, nan_in("layers.1.self_attn.v_proj.lora_B", float("nan"))),
                        "non_finite", "'base_model.model.model.layers.1.self_attn.v_proj.lora_B.weight' has NaN"),
    "inf-weights": case(lambda f, m: edit_tensors(f, nan_in("layers.0.mlp.down_proj.lora_A", float("-inf"))),
                        "non_finite", "down_proj.lora_A.weight' has NaN or infinite values"),
}


def as_paths(files: dict, folder: Path) -> dict:
    """The same upload as server temp files (named by the server, not by the client)."""
    folder.mkdir()
    paths = {}
    for i, (name, content) in enumerate(files.items()):
        paths[name] = folder / f"upload-{i}.tmp"
        paths[name].write_bytes(content)
    return paths


@pytest.mark.parametrize("as_path", [False, True], ids=["bytes", "paths"])
@pytest.mark.parametrize("name", list(CASES))
def test_hostile_upload_is_refused(adapter, tmp_path, name, as_path):
    build, code, fragment, limits, base_model_id = CASES[name]
    marker = tmp_path / "pwned"
    files = build(adapter, marker)
    if as_path:
        files = as_paths(files, tmp_path / "uploads")
    with pytest.raises(AdapterValidationError) as info:
        validate_adapter_files(files, BASE, limits or UploadLimits(), base_model_id=base_model_id)
    assert info.value.code == code, str(info.value)
    assert fragment in str(info.value)
    assert str(tmp_path) not in str(info.value) and "/srv/models" not in str(info.value)
    assert isinstance(info.value, AdapterFormatError) and isinstance(info.value, ValueError)
    assert not marker.exists()  # the pickle payload never ran


def test_hundred_thousand_tiny_tensors_are_refused_fast_in_bounded_memory(adapter):
    header = {f"base_model.model.model.layers.0.self_attn.q_proj.t{i}": {
        "dtype": "F32", "shape": [1], "data_offsets": [4 * i, 4 * i + 4]} for i in range(100_000)}
    blob = safetensors_blob(header, bytes(4 * 100_000))
    assert len(blob) < UploadLimits().max_header_bytes
    files = {CONFIG: adapter[CONFIG], WEIGHTS: blob}
    del header
    tracemalloc.start()
    try:
        start = time.thread_time()  # this thread's CPU: what the refusal costs, whatever else the machine runs
        with pytest.raises(AdapterValidationError) as info:
            validate_adapter_files(files, BASE)
        cpu_s = time.thread_time() - start
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert info.value.code == "too_many_tensors"
    assert "more than 4096 tensors" in str(info.value)
    assert cpu_s < 2.0, cpu_s
    assert peak < 64 * 1024**2, peak


def bf16(files: dict) -> dict:
    return edit_tensors(files, lambda t: t.update({n: v.to(torch.bfloat16) for n, v in t.items()}))


@pytest.mark.parametrize("as_path", [False, True], ids=["bytes", "paths"])
@pytest.mark.parametrize("dtype", ["F32", "BF16"])
def test_valid_adapter_is_returned_with_its_tensors(adapter, tmp_path, dtype, as_path):
    files = adapter if dtype == "F32" else bf16(adapter)
    expected = load_safetensors_bytes(files[WEIGHTS])
    upload = as_paths(files, tmp_path / "uploads") if as_path else files
    result = validate_adapter_files(upload, BASE)
    assert isinstance(result, ValidatedAdapter)
    assert result.rank == RANK and result.alpha == 2.0 * RANK and result.use_rslora is False
    assert result.target_modules == ("q_proj", "v_proj", "down_proj")
    assert result.config == json.loads(files[CONFIG])
    assert sorted(result.tensors) == sorted((layer, t) for layer in range(BASE.num_layers) for t in TARGETS)
    torch_dtype = {"F32": torch.float32, "BF16": torch.bfloat16}[dtype]
    for (layer, target), (a, b) in result.tensors.items():
        section = "mlp" if target == "down_proj" else "self_attn"
        prefix = f"base_model.model.model.layers.{layer}.{section}.{target}"
        for got, kind in [(a, "A"), (b, "B")]:
            assert got.dtype == torch_dtype and got.device.type == "cpu" and got.is_contiguous()
            assert torch.equal(got, expected[f"{prefix}.lora_{kind}.weight"])
    assert result.nbytes == sum(t.numel() * t.element_size() for t in expected.values())


@pytest.mark.parametrize("claimed", ["HuggingFaceTB/SmolLM2-135M-Instruct", "smollm2-135m-instruct",
                                     "/home/me/models/SmolLM2-135M-Instruct/", None, ""])
def test_base_model_name_matches_on_last_path_component(adapter, claimed):
    files = edit_config(adapter, base_model_name_or_path=claimed)
    assert validate_adapter_files(files, BASE, base_model_id="SmolLM2-135M-Instruct").rank == RANK


# Adapters trained from a local copy of the base model record that copy's path: the shapes prove they fit.
LOCAL_COPIES = ["/home/alice/checkpoints/base", "/data/models/smol-2025-01/", "./base-model", "../models/smol",
                "~/hf/smollm2", "C:\\Users\\bob\\models\\smol", "/mnt/a/b/c/d/Llama-2-7b-hf",
                "models/cache/SmolLM2", "Llama-2-7b-hf", "checkpoint-500"]


@pytest.mark.parametrize("claimed", LOCAL_COPIES)
def test_an_adapter_trained_from_a_local_copy_of_the_base_is_accepted_and_its_claim_recorded(adapter, claimed):
    files = edit_config(adapter, base_model_name_or_path=claimed)
    result = validate_adapter_files(files, BASE, base_model_id="SmolLM2-135M-Instruct")
    assert result.rank == RANK and result.base_model == claimed


def test_another_hub_model_is_refused_unless_the_caller_allows_it(adapter):
    files = edit_config(adapter, base_model_name_or_path="meta-llama/Llama-2-7b-hf")
    with pytest.raises(AdapterValidationError) as info:
        validate_adapter_files(files, BASE, base_model_id="SmolLM2-135M-Instruct")
    assert info.value.code == "base_model_mismatch" and "allow_base_mismatch=true" in str(info.value)
    allowed = validate_adapter_files(files, BASE, base_model_id="SmolLM2-135M-Instruct", allow_base_mismatch=True)
    assert allowed.base_model == "meta-llama/Llama-2-7b-hf"
    odd = edit_config(adapter, base_model_name_or_path="/home/\x00me/\ud800" + "x" * 900)
    recorded = validate_adapter_files(odd, BASE, base_model_id="SmolLM2-135M-Instruct").base_model
    assert recorded.startswith("/home/?me/?x") and len(recorded) == 500  # printable and capped for SQL


def test_a_local_adapter_directory_follows_the_same_base_model_rule(adapter, tmp_path):
    """`loramux generate --adapter DIR` (load_adapter_dir) and build_adapter use the upload's rule."""
    folder = tmp_path / "dir"
    folder.mkdir()
    (folder / WEIGHTS).write_bytes(adapter[WEIGHTS])
    for claimed, ok in [("/home/alice/smol-local", True), ("HuggingFaceTB/SmolLM2-135M-Instruct", True),
                        ("meta-llama/Llama-2-7b-hf", False)]:
        config = edit_config(adapter, base_model_name_or_path=claimed)[CONFIG]
        (folder / CONFIG).write_bytes(config)
        for load in (lambda **kw: load_adapter_dir(folder, BASE, **kw),
                     lambda config=config, **kw: build_adapter("a", config, adapter[WEIGHTS], BASE, **kw)):
            if ok:
                assert load(base_model_id="SmolLM2-135M-Instruct").rank == RANK
                continue
            with pytest.raises(AdapterValidationError) as info:
                load(base_model_id="SmolLM2-135M-Instruct")
            assert info.value.code == "base_model_mismatch"
            assert load(base_model_id="SmolLM2-135M-Instruct", allow_base_mismatch=True).rank == RANK


@pytest.mark.timeout(120)
def test_a_catastrophic_backtracking_pattern_is_refused_in_well_under_a_second(adapter):
    files = edit_config(adapter, target_modules="(?:.*){60}z")
    start = time.thread_time()  # this thread's CPU (a backtracking matcher would burn minutes), not wall time
    with pytest.raises(AdapterValidationError) as info:
        validate_adapter_files(files, BASE)
    assert time.thread_time() - start < 1.0
    assert info.value.code == "target_mismatch"


@pytest.mark.parametrize("pattern", [r".*\.(q_proj|v_proj|down_proj)", r".*(q_proj|v_proj|down_proj)$",
                                     r"model\.layers\.\d+\.(self_attn\.[qv]_proj|mlp\.down_proj)",
                                     r"^model\.layers\.[0-9]+\..*\.(?:q|v|down)_proj$"])
def test_regex_target_modules_select_the_modules_peft_would(adapter, pattern):
    result = validate_adapter_files(edit_config(adapter, target_modules=pattern), BASE)
    assert result.target_modules == ("q_proj", "v_proj", "down_proj")


def test_safetensors_header_length_that_looks_like_a_pickle_is_not_refused_as_one(adapter):
    # A header of 0x10280 bytes: the file starts with 80 02, the bytes of a pickle protocol 2 prefix.
    header, data = split(adapter[WEIGHTS])
    header["__metadata__"] = {"format": "pt"}
    raw = json.dumps(header, separators=(",", ":")).encode()
    header["__metadata__"]["pad"] = "x" * (0x10280 - len(raw) - len(',"pad":""'))
    blob = safetensors_blob(header, data)
    assert blob[:2] == b"\x80\x02"
    assert validate_adapter_files({**adapter, WEIGHTS: blob}, BASE).rank == RANK


def test_peft_format_goes_through_the_validator(adapter, tmp_path):
    lora = build_adapter("a", adapter[CONFIG], adapter[WEIGHTS], BASE)
    config = json.loads(adapter[CONFIG])
    canonical = json.dumps(config, sort_keys=True, separators=(",", ":")).encode()
    expected = hashlib.sha256(hashlib.sha256(canonical).digest() + hashlib.sha256(adapter[WEIGHTS]).digest())
    assert lora.digest == expected.hexdigest()
    assert all(a.dtype == torch.float32 and b.dtype == torch.float32 for a, b in lora.weights.values())
    folder = tmp_path / "dir"
    folder.mkdir()
    (folder / CONFIG).write_bytes(adapter[CONFIG])
    (folder / WEIGHTS).write_bytes(bf16(adapter)[WEIGHTS])
    (folder / "README.md").write_text("PEFT writes one; a directory load ignores it")
    loaded = load_adapter_dir(folder, BASE)
    assert loaded.name == "dir" and loaded.weights[(0, "q_proj")][0].dtype == torch.float32
    with pytest.raises(AdapterValidationError) as info:
        build_adapter("a", adapter[CONFIG], adapter[WEIGHTS] + b"x", BASE)
    assert info.value.code == "data_gap"
    (folder / WEIGHTS).unlink()
    (folder / "model.pt").write_bytes(torch_save_bytes())
    with pytest.raises(AdapterValidationError) as info:
        load_adapter_dir(folder, BASE)
    assert info.value.code == "pickle_refused"
    (folder / "model.pt").unlink()
    with pytest.raises(AdapterValidationError, match="^dir: adapter_model.safetensors is missing") as info:
        load_adapter_dir(folder, BASE)
    assert info.value.code == "missing_file"


def test_validation_error_keeps_its_code_across_pickling(monkeypatch):
    error = AdapterValidationError("non_finite", "tensor 'x' has NaN or infinite values")
    monkeypatch.undo()  # lift no_unpickling for this trusted round trip of our own object
    copy = pickle.loads(pickle.dumps(error))
    assert copy.code == "non_finite" and str(copy) == str(error) and type(copy) is AdapterValidationError


def test_every_hostile_upload_leaves_nothing_in_sql_or_the_store(adapter, database, tmp_path):
    """The whole corpus through the registry, on SQLite and PostgreSQL: refused, no rows, no blobs."""
    from sqlalchemy import func, select

    from loramux.adapters.storage.registry import AdapterRegistry
    from loramux.adapters.storage.store import FileStore
    from loramux.db import Adapter, AdapterVersion, Tenant

    store = FileStore(tmp_path / "blobs")
    tenant = AdapterRegistry(database, store, BASE, "base").tenancy.create_tenant("acme")
    for name, (build, code, _, limits, base_model_id) in CASES.items():
        marker = tmp_path / f"pwned-{name}"
        registry = AdapterRegistry(database, store, BASE, base_model_id or "any-base", limits or UploadLimits())
        with pytest.raises(AdapterValidationError) as info:
            registry.register(tenant.id, "bot", build(adapter, marker))
        assert info.value.code == code, name
        assert not marker.exists(), name
    with database.session() as s:
        counts = [s.scalar(select(func.count()).select_from(t)) for t in (Tenant, Adapter, AdapterVersion)]
    assert counts == [1, 0, 0] and store.list_keys() == []
