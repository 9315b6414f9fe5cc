"""int8 weight quantization of the base model's linear layers (`LORAMUX_QUANTIZATION=int8`).

Semantics. A linear weight W, stored [in, out] as in `MergedLinear`, becomes q [out, in] int8 plus one
float32 scale per output channel, symmetric: s[j] = max_i |W[i, j]| / 127 and q[j, i] = round(W[i, j] / s[j])
(so |q| <= 127). The layer computes y = x @ (q * s)^T + b: weight-only quantization, the activations keep
(close to) float precision. Only the base weights are quantized: LoRA deltas are still added to y in the
activation dtype by `MergedLinear`, and the embedding lookup stays float (a lookup reads a few rows; the
LM head, which reads the whole table every decode step, is quantized).

Kernels, one per model, chosen by `choose_kernel`: a fixed order of preference (`candidate_kernels`; not a
race at load between close kernels, whose per-shape timings flip from run to run on a shared VM; the
measurements behind the order are in docs/performance.md), skipping a kernel that fails its probes or runs
grossly slow on this CPU (`kernel_is_fast`):
- "onednn" (CPU with VNNI or AMX) and "fbgemm" (other x86 CPUs): torch's CPU build has no fast weight-only
  int8 matmul, only integer ones (u8 activations x s8 weights -> int32). To keep float-like activations,
  each row of x is split into two integer rows (`split_activations`): x ~= (hi + lo / (2 * qmax)) * step,
  with step = max|x_row| / qmax. Both rows go through one integer matmul (at decode sizes reading the weight
  once costs the same for 2x the rows) and the two results are merged. That is ~15 significant bits per
  row; a single int8 pass per row measured 3x more greedy-token mismatches on SmolLM2, and one grid per
  tensor would let one request's activations set another's precision. "onednn" feeds the integers (s8) to
  `onednn::qlinear_pointwise` (AMX / VNNI); "fbgemm" feeds them to `quantized::linear_dynamic` with one
  extra row that pins its dynamic grid to step 1, so that its own quantization of them is exact. Without
  VNNI, fbgemm sums u8 x s8 pairs in int16, which would saturate at 8 bits, so activations use qmax = 63
  (7 bits, ~13 significant bits over the two passes) there; oneDNN is only chosen with VNNI or AMX.
- "int8pack": `aten::_weight_int8pack_mm`, weight-only in the kernel. Used on CUDA; on CPU in this torch it
  is far slower than float32 (a scalar loop).
- "dequant": cast q to the activation dtype, matmul, scale the output columns. Correct on every device
  and dtype, with int8 at rest but no speed gain; the fallback.
The chosen kernel is checked once per (kernel, device, dtype) against "dequant" on small probes (one of
them built to saturate int16 pair sums); a kernel that errs or disagrees falls back to "dequant".
"""
from __future__ import annotations

import time
import warnings
from contextlib import contextmanager
from functools import cache

import torch
import torch.nn.functional as F

MODES = ("none", "int8")
KERNELS = ("onednn", "fbgemm", "int8pack", "dequant")
TWO_PASS = ("onednn", "fbgemm")  # the kernels that split activations into two integer rows
QMAX = 127
SLOW_FACTOR = 3.0  # a kernel this many times slower than "dequant" on the probe is not chosen
DECODE_ROWS_HINT = 16  # oneDNN packs for this many rows: batch-8 decode, two passes


def check_mode(mode: str) -> str:
    """Return `mode` if it is a known quantization mode, else raise a ValueError naming the choices."""
    if mode not in MODES:
        raise ValueError(f"quantization {mode!r} is not one of {', '.join(MODES)}")
    return mode


def quantize_weight(weight_in_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [in, out] -> (q [out, in] int8, scales [out] float32), symmetric per output channel."""
    w = weight_in_out.detach().t().float()
    scales = (w.abs().amax(dim=1) / QMAX).clamp_min(torch.finfo(torch.float32).tiny)
    q = torch.round(w / scales[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q.contiguous(), scales


def dequantize_weight(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """(q [out, in], scales [out]) -> W [in, out] float32, the weight the int8 layer stands for."""
    return (q.float() * scales[:, None].float()).t()


def has_vnni() -> bool:
    """Whether integer dot products accumulate u8 x s8 in int32 directly (VNNI, AMX), without int16 pairs."""
    caps = torch.cpu.get_capabilities()
    return any(caps.get(flag, False) for flag in ("avx512_vnni", "avx_vnni", "amx_int8"))


def activation_qmax() -> int:
    """Largest |integer| per activation pass: 127, or 63 where int16 pair sums could saturate."""
    return QMAX if has_vnni() else 63


def split_activations(x: torch.Tensor, qmax: int, extra_rows: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, in] float32 -> (ints [2 * rows + extra_rows, in], peak [rows, 1]), integer values in
    [-qmax, qmax] with x ~= (ints[:rows] + ints[rows:2 * rows] / (2 * qmax)) * peak / qmax: each row on its
    own grid (peak = max |x_row|), then the rounding residual (at most half a step) on a grid 2 * qmax
    times finer. The extra rows are left for the caller to fill. Written for few ops: each one costs
    microseconds at decode sizes, and every linear layer runs these."""
    rows = x.shape[0]
    peak = x.abs().amax(dim=-1, keepdim=True).clamp_min_(torch.finfo(torch.float32).tiny)
    a = torch.div(x, peak).mul_(qmax)
    ints = x.new_empty(2 * rows + extra_rows, x.shape[1])
    hi = torch.round(a, out=ints[:rows])
    torch.sub(a, hi, out=ints[rows:2 * rows]).mul_(2 * qmax).round_()
    return ints, peak


def merge_passes(y: torch.Tensor, peak: torch.Tensor, rows: int, qmax: int) -> torch.Tensor:
    """The rows of x @ W from y = ints @ (W / qmax) (`split_activations`; rows past 2 * rows ignored)."""
    return torch.add(y[:rows], y[rows:2 * rows], alpha=1 / (2 * qmax)).mul_(peak)


def qint8_per_channel(q: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """q as a torch.qint8 per-channel tensor, the input fbgemm's prepack takes."""
    with warnings.catch_warnings():
        # torch 2.13 flags quantized dtypes as deprecated (https://github.com/pytorch/pytorch/issues/184982);
        # fbgemm's ops still need one.
        # If a later torch drops them, `kernel_works` fails and the model falls back to another kernel.
        warnings.simplefilter("ignore", UserWarning)
        zero_points = torch.zeros_like(scales, dtype=torch.long)
        return torch._make_per_channel_quantized_tensor(q, scales.double(), zero_points, 0)


@contextmanager
def _quantized_engine(name: str):
    # fbgemm's prepack follows the global quantized engine; set it only for the call.
    old = torch.backends.quantized.engine
    torch.backends.quantized.engine = name
    try:
        yield
    finally:
        torch.backends.quantized.engine = old


class Int8Linear:
    """y = x @ (q * s)^T + bias through one kernel (see the module docstring); x [rows, in].

    `qmax` overrides `activation_qmax()` for the two-pass kernels (tests use it to run the 7-bit path).
    """

    def __init__(self, weight_in_out: torch.Tensor, bias: torch.Tensor | None, kernel: str, qmax: int | None = None):
        if kernel not in KERNELS:
            raise ValueError(f"int8 kernel {kernel!r} is not one of {', '.join(KERNELS)}")
        self.kernel = kernel
        self.in_features, self.out_features = weight_in_out.shape
        device = weight_in_out.device
        q, scales = quantize_weight(weight_in_out)
        self.scales = scales.to(device)
        self.bias = None if bias is None else bias.detach()
        self.qmax = qmax or (activation_qmax() if kernel in TWO_PASS else QMAX)
        self.q = self.packed = None  # the packed kernels keep their own copy of q only
        # The integer kernels scale their int32 sums by these: 1 / qmax of `split_activations` folded in.
        kernel_scales = scales / self.qmax
        if kernel == "onednn":
            self.packed = torch.ops.onednn.qlinear_prepack(q, [DECODE_ROWS_HINT, self.in_features])
            self.kernel_scales = kernel_scales
            self.zero_points = torch.zeros(self.out_features, dtype=torch.long)
        elif kernel == "fbgemm":
            with _quantized_engine("fbgemm"):
                self.packed = torch.ops.quantized.linear_prepack(qint8_per_channel(q, kernel_scales), None)
            # fbgemm quantizes its input on the grid spanning the tensor's min and max; this row spans
            # [-(qmax + 1), qmax], which makes that grid step 1 (zero point qmax + 1): the integers pass exactly.
            self.pin = torch.zeros(self.in_features)
            self.pin[0], self.pin[-1] = -(self.qmax + 1), self.qmax
        else:
            self.q = q.to(device)
            self.act_scales = self.scales.to(weight_in_out.dtype)  # the model's dtype: no cast per call

    @property
    def nbytes(self) -> int:
        """Bytes of the quantized weight at rest: one per parameter plus a float32 scale per channel."""
        return self.in_features * self.out_features + 4 * self.out_features

    def int8_weight(self) -> torch.Tensor:
        """q [out, in] int8, unpacked from the kernel's layout where a kernel holds it."""
        if self.kernel == "onednn":
            return self.packed.to_dense().t()  # oneDNN's plain layout is [in, out]
        if self.kernel == "fbgemm":
            qweight, _ = torch.ops.quantized.linear_unpack(self.packed)
            return qweight.int_repr()
        return self.q

    def dequantized(self) -> torch.Tensor:
        """W [in, out] float32 that this layer stands for (for references and tests)."""
        return dequantize_weight(self.int8_weight(), self.scales)

    def _two_pass(self, x: torch.Tensor) -> torch.Tensor:
        """x [rows, in] float32 -> x @ (q * s)^T through `split_activations` and one integer matmul."""
        rows = x.shape[0]
        if self.kernel == "onednn":
            ints, peak = split_activations(x, self.qmax)
            # s8 activations, zero point 0; oneDNN scales the int32 sums by kernel_scales.
            y = torch.ops.onednn.qlinear_pointwise(ints.to(torch.int8), 1.0, 0, self.packed, self.kernel_scales,
                                                   self.zero_points, None, 1.0, 0, torch.float32, "none", [], "")
        else:
            ints, peak = split_activations(x, self.qmax, extra_rows=1)
            ints[-1] = self.pin
            y = torch.ops.quantized.linear_dynamic(ints, self.packed, self.qmax < QMAX)
        return merge_passes(y, peak, rows, self.qmax)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernel in TWO_PASS:
            if x.shape[0] == 0:
                y = x.new_zeros(0, self.out_features)
            else:
                y = self._two_pass(x.float()).to(x.dtype)
        elif self.kernel == "int8pack":
            y = torch.ops.aten._weight_int8pack_mm(x, self.q, self.act_scales)
        else:
            y = F.linear(x, self.q.to(x.dtype)) * self.act_scales
        return y if self.bias is None else y + self.bias


def onednn_qlinear_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")


def candidate_kernels(device: torch.device) -> list[str]:
    """The rule (see the module docstring), in order of preference: on CPU onednn with VNNI / AMX, then
    fbgemm; int8pack on CUDA. "dequant", always correct, is the fallback after these."""
    if device.type == "cuda":
        return ["int8pack"]
    kernels = []
    if device.type == "cpu":
        if has_vnni() and onednn_qlinear_available():
            kernels.append("onednn")
        if "fbgemm" in torch.backends.quantized.supported_engines:
            kernels.append("fbgemm")
    return kernels


def preferred_kernel(device: torch.device) -> str:
    """The rule's first choice on `device` ("dequant" where it has none)."""
    return (candidate_kernels(device) or ["dequant"])[0]


def _probes(device_type: str, dtype: torch.dtype):
    """(weight [in, out], x) pairs: random values, and all-maximal ones whose int16 pair sums would
    saturate on a CPU without VNNI if 8-bit activations were used there."""
    gen = torch.Generator().manual_seed(0)
    yield torch.randn(64, 48, generator=gen), torch.randn(5, 64, generator=gen)
    yield torch.ones(64, 48), torch.ones(3, 64)


@cache
def kernel_works(kernel: str, device_type: str, dtype: torch.dtype) -> bool:
    """Whether `kernel` runs here and agrees with the dequant reference on the probes."""
    if kernel == "dequant":
        return True
    tol = 1e-3 if dtype == torch.float32 else 3e-2
    for w, x in _probes(device_type, dtype):
        w, x = w.to(device_type, dtype), x.to(device_type, dtype)
        try:
            layer = Int8Linear(w, None, kernel)
            got = layer(x).float()
        except (RuntimeError, NotImplementedError, AttributeError):  # AttributeError: op absent from this torch
            return False
        ref = x.float() @ layer.dequantized().to(device_type)
        if got.shape != ref.shape or not bool(torch.allclose(got, ref, rtol=tol, atol=tol * ref.abs().max().item())):
            return False
    return True


def _probe_seconds(kernel: str, device_type: str, dtype: torch.dtype) -> float:
    """Best of three calls of `kernel` on a decode-shaped probe (8 rows x [512, 1024]), after one warm-up."""
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(512, 1024, generator=gen).to(device_type, dtype)
    x = torch.randn(8, 512, generator=gen).to(device_type, dtype)
    layer = Int8Linear(w, None, kernel)
    best = float("inf")
    for _ in range(4):
        start = time.perf_counter()
        layer(x)
        if device_type == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return best


@cache
def kernel_is_fast(kernel: str, device_type: str, dtype: torch.dtype) -> bool:
    """Whether `kernel` is at most SLOW_FACTOR x slower than "dequant" on a decode-shaped probe. Not a race
    between close kernels (timings of those flip on a shared VM): a guard against a kernel that runs a
    reference code path on this CPU, e.g. oneDNN's int8 matmul on an AMD EPYC with AVX-512 VNNI measured
    about 1000x slower than fbgemm, 300x float32 (docs/performance.md)."""
    if kernel == "dequant":
        return True
    return _probe_seconds(kernel, device_type, dtype) <= SLOW_FACTOR * _probe_seconds("dequant", device_type, dtype)


def choose_kernel(device: torch.device | str, dtype: torch.dtype) -> str:
    """The first of `candidate_kernels` that passes its probes on this device and dtype and is not grossly
    slow there (`kernel_is_fast`); else "dequant"."""
    device = torch.device(device)
    for kernel in candidate_kernels(device):
        if kernel_works(kernel, device.type, dtype) and kernel_is_fast(kernel, device.type, dtype):
            return kernel
    return "dequant"
