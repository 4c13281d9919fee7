"""Input checking and layout handling shared by every attention entry point.

Everything here is device-agnostic: the Triton launchers and the float32 reference both call
:func:`check_attention_inputs`, so a shape that one path accepts the other accepts too.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Literal, Sequence, Union

import torch
from typing_extensions import TypeIs

from .._launch import triton_launch_reason

# Block sizes of the block mask, the same as upstream SpargeAttn (b_q = 128 query rows, b_k = 64 keys).
# The attention kernel's tiles equal these, so one mask entry is exactly one Q.K^T tile product.
BLOCK_Q = 128
BLOCK_K = 64

TensorLayout = Literal["HND", "NHD"]
# Where the causal mask sits when query and key lengths differ, in the words of PyTorch's
# ``torch.nn.attention.bias.CausalVariant``: "upper_left" (SDPA's ``is_causal``) lets query i see keys 0..i;
# "lower_right" (FlashAttention's, what chunked prefill and a KV cache need) aligns the last query with the last
# key, so query i sees keys 0..i + Nkv - Nq.
CausalVariant = Literal["upper_left", "lower_right"]
Backend = Literal["auto", "triton", "reference"]
PerHead = Union[float, int, Sequence[float], torch.Tensor]

KERNEL_DTYPES = (torch.float16, torch.bfloat16)
_CALL_DTYPES = KERNEL_DTYPES + (torch.float32,)  # float32 runs the reference on the CPU
MIN_HEAD_DIM, MAX_HEAD_DIM = 16, 256


# The kernels' runtime window argument where there is no sliding window: wider than any sequence they take
# (positions stay far from int32's limits when it is subtracted from them).
NO_WINDOW = 2**30


@dataclass(frozen=True)
class AttentionShape:
    """Sizes of one attention call, whatever the layout."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int
    head_dim: int
    # under causal masking, query row i sits at key position i + causal_offset (0 for equal lengths and for the
    # upper-left variant, Nkv - Nq for the lower-right one; negative offsets leave the first rows no key)
    causal_offset: int = 0
    # under causal masking with a sliding window of W keys, the query at position p sees keys p - W + 1 .. p
    # (transformers' ``sliding_window``; FlashAttention's ``window_size=(W - 1, 0)``); None: every earlier key
    sliding_window: int | None = None

    @property
    def window_arg(self) -> int:
        """The window as the kernels take it: a runtime int, ``NO_WINDOW`` (wider than any sequence) for none."""
        return NO_WINDOW if self.sliding_window is None else self.sliding_window

    @property
    def q_blocks(self) -> int:
        return math.ceil(self.q_len / BLOCK_Q)

    @property
    def k_blocks(self) -> int:
        return math.ceil(self.kv_len / BLOCK_K)

    @property
    def last_row_position(self) -> int:
        """The causal position of the last query row (past the last key in an upper-left call with more queries
        than keys): where the last row's sliding window starts from."""
        return self.q_len - 1 + self.causal_offset

    @property
    def last_query_position(self) -> int:
        """The causal position of the last query row, capped at the last key: no query block sees past it."""
        return min(self.q_len - 1 + self.causal_offset, self.kv_len - 1)


def to_hnd(x: torch.Tensor, layout: TensorLayout) -> torch.Tensor:
    """A (B, H, N, D) view of ``x`` (no copy): kernels address it through strides."""
    return x if layout == "HND" else x.transpose(1, 2)


# The largest element offset a Triton kernel may compute in int32 from a (batch, head) base pointer.
INT32_OFFSET_MAX = 2**31 - 1


def wide_offsets(*views: torch.Tensor) -> bool:
    """Whether some (B, H, N, D) view's rows of one (batch, head) reach past int32 offsets: its last element lies
    more than ``INT32_OFFSET_MAX`` elements after the first of its head. The Triton kernels take batch and head
    offsets in int64 always, and row offsets in int64 only then (a constexpr: other calls keep their code). Reached
    by long sequences stored token-major: transformers hands over (B, H, N, D) views of (B, N, H * D) projections,
    whose row stride H * D = 4096 (Llama-3.1-8B) passes it from 524,289 tokens on; int32 offsets there made every
    kernel of stage 1 read out of bounds (H100: an illegal memory access). Host cost 1.3 us for two views (a plain
    loop: any() over a generator took 2.0)."""
    for t in views:
        n, d = t.shape[2:]
        stride_n, stride_d = t.stride()[2:]
        if (n - 1) * abs(stride_n) + (d - 1) * abs(stride_d) > INT32_OFFSET_MAX and t.numel():
            return True
    return False


def size_or_one(size: int) -> str:
    """How an error message names a dimension that may also broadcast from 1: "4 or 1", or "1"."""
    return "1" if size == 1 else f"{size} or 1"


def check_positive_int(value: Any, name: str) -> int:
    """``value`` where it is an int >= 1 (not a bool), else ValueError naming ``name``: sizes and counts that a
    float would silently truncate or a bool pass as 1."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive int, got {value!r}")
    return value


def check_layout(layout: str) -> None:
    if layout not in ("HND", "NHD"):
        raise ValueError(f"tensor_layout must be 'HND' (B, H, N, D) or 'NHD' (B, N, H, D), got {layout!r}")


def check_attention_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor | None,
    *,
    tensor_layout: TensorLayout,
    is_causal: bool,
    causal_variant: CausalVariant | None = None,
    sliding_window: int | None = None,
) -> AttentionShape:
    """Validate q/k/v and return their sizes; raises ValueError naming the problem.

    ``causal_variant``: see :data:`CausalVariant`; needed by causal calls whose query and key lengths differ
    (None: such a call raises, since SDPA and FlashAttention align it differently). ``sliding_window``: see
    :attr:`AttentionShape.sliding_window`; a positive int, with ``is_causal`` only."""
    check_layout(tensor_layout)
    check_flag(is_causal, "is_causal")
    tensors = {"q": q, "k": k} if v is None else {"q": q, "k": k, "v": v}
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D ({'B, H, N, D' if tensor_layout == 'HND' else 'B, N, H, D'}), "
                             f"got shape {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"q and {name} are on different devices ({q.device} vs {t.device})")
        if t.dtype != q.dtype:
            raise ValueError(f"q and {name} have different dtypes ({q.dtype} vs {t.dtype})")
    if q.dtype not in KERNEL_DTYPES + (torch.float32,):
        raise ValueError(f"unsupported dtype {q.dtype}: use torch.float16 or torch.bfloat16 "
                         "(torch.float32 only on CPU, where the reference runs)")
    qh, kh = to_hnd(q, tensor_layout), to_hnd(k, tensor_layout)
    B, H, Nq, D = qh.shape
    Bk, HK, Nkv, Dk = kh.shape
    if Bk != B:
        raise ValueError(f"batch sizes differ: q has {B}, k has {Bk}")
    if Dk != D:
        raise ValueError(f"head dims differ: q has {D}, k has {Dk}")
    if v is not None:
        vh = to_hnd(v, tensor_layout)
        if tuple(vh.shape) != tuple(kh.shape):
            raise ValueError(f"k and v shapes differ: {tuple(k.shape)} vs {tuple(v.shape)}")
    if min(B, H, HK, Nq, Nkv) == 0:  # before the head test, which would blame a zero head count on GQA
        raise ValueError(f"empty input: q shape {tuple(q.shape)}, k shape {tuple(k.shape)}")
    if H % HK != 0:
        raise ValueError(f"number of q heads ({H}) must be a multiple of the number of k/v heads ({HK})")
    if not (MIN_HEAD_DIM <= D <= MAX_HEAD_DIM and D % 8 == 0):
        raise ValueError(f"head dim {D} is not supported: use a multiple of 8 between {MIN_HEAD_DIM} and "
                         f"{MAX_HEAD_DIM} (64, 128 and 256 are the tuned ones)")
    if v is not None:  # attention outputs only: a predicted mask or block selection has no gradient anyway
        check_no_grad(q, k, v)
    return AttentionShape(B, H, HK, Nq, Nkv, D, causal_offset(Nq, Nkv, is_causal, causal_variant),
                          check_sliding_window(sliding_window, is_causal))


def check_flag(value: bool, name: str) -> bool:
    """``value`` if it is True or False, else ValueError: as SDPA's ``is_causal``, a flag takes no other value (a
    string "False", a number or a tensor would otherwise be read by its truth, is_causal="False" as causal)."""
    if not isinstance(value, bool):
        raise ValueError(f"{name} must be True or False, got {type(value).__name__} {str(value)[:40]!r}")
    return value


def check_sliding_window(sliding_window: int | None, is_causal: bool) -> int | None:
    """The window of a call (None: none), or ValueError: a positive int, with causal masking only."""
    if sliding_window is None:
        return None
    if isinstance(sliding_window, bool) or not isinstance(sliding_window, int) or sliding_window <= 0:
        raise ValueError(f"sliding_window must be a positive int (keys each query sees, itself included), got "
                         f"{sliding_window!r}")
    if not is_causal:
        raise ValueError("sliding_window needs is_causal=True (the window counts keys back from the query's own "
                         "position)")
    return sliding_window if sliding_window < NO_WINDOW else None


def check_softcap(softcap: float | None) -> float | None:
    """A call's logit soft-capping (None: none): a positive finite number c, the scores then c * tanh(s / c) (Gemma
    2's ``attn_logit_softcapping``, FlashAttention's ``softcap``); ValueError otherwise."""
    if softcap is None:
        return None
    if isinstance(softcap, bool) or not _is_number(softcap) or not math.isfinite(softcap) or softcap <= 0:
        raise ValueError(f"softcap must be a positive finite number (scores become c * tanh(s / c)), got {softcap!r}")
    return float(softcap)


def check_sink_logits(sink_logits: torch.Tensor | None, shape: AttentionShape, device: torch.device
                      ) -> torch.Tensor | None:
    """A call's learned attention-sink logits (None: none), as the kernels read them: a 1-D tensor of one logit per
    query head, float32/float16/bfloat16, on the inputs' device, with unit stride; ValueError otherwise.

    Each row's softmax then takes one more term, exp(sink_logits[h]), that has no value vector: gpt-oss's
    ``sinks`` (transformers passes them as ``s_aux``), FlashAttention 3's ``s_aux``. The logits are in the units of
    the scaled scores (``scale * q . k``). Their values are not checked (that would be a device sync per call): a
    NaN logit gives NaN rows, -inf one is no sink."""
    if sink_logits is None:
        return None
    if not isinstance(sink_logits, torch.Tensor):
        raise ValueError(f"sink_logits must be a torch.Tensor of {shape.heads} logits (one per query head), got "
                         f"{type(sink_logits).__name__}")
    if sink_logits.dim() != 1 or sink_logits.shape[0] != shape.heads:
        raise ValueError(f"sink_logits must have shape ({shape.heads},): one logit per query head, got "
                         f"{tuple(sink_logits.shape)}")
    if sink_logits.dtype not in _CALL_DTYPES:
        raise ValueError(f"sink_logits must be float32, float16 or bfloat16, got {sink_logits.dtype}")
    if sink_logits.device != device:
        raise ValueError(f"sink_logits is on {sink_logits.device}, q on {device}")
    if torch.is_grad_enabled() and sink_logits.requires_grad:
        raise ValueError("sink_logits requires grad and the sparse kernels have no backward pass: call it under "
                         "torch.no_grad() or torch.inference_mode(), or detach them (for training, use SDPA)")
    return sink_logits if sink_logits.stride(0) == 1 else sink_logits.contiguous()


def causal_offset(q_len: int, kv_len: int, is_causal: bool, causal_variant: CausalVariant | None) -> int:
    """The key position of query row 0 under causal masking (:attr:`AttentionShape.causal_offset`); raises
    ValueError for a variant without causal masking, an unknown variant, or unequal lengths without a variant."""
    if causal_variant is not None:
        if causal_variant not in ("upper_left", "lower_right"):
            raise ValueError(f"causal_variant must be 'upper_left', 'lower_right' or None, got {causal_variant!r}")
        if not is_causal:
            raise ValueError(f"causal_variant={causal_variant!r} needs is_causal=True")
    if not is_causal or q_len == kv_len:
        return 0
    if causal_variant is None:
        raise ValueError(f"is_causal=True with {q_len} queries and {kv_len} keys: pass causal_variant='lower_right' "
                         f"(the last query sees every key, as FlashAttention and a KV cache's chunked prefill align "
                         f"it) or 'upper_left' (query i sees keys 0..i, as SDPA's is_causal does)")
    return kv_len - q_len if causal_variant == "lower_right" else 0


def grad_reason(*tensors: torch.Tensor) -> str | None:
    """Why these attention inputs cannot take the kernels: autograd records through one of them (None when it
    does not). The kernels have no backward pass, so their output would carry no gradient: a training step would
    silently leave attention out of the backward pass (the custom operators would raise only at backward)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in tensors):
        return "q, k or v requires grad and the sparse kernels have no backward pass"
    return None


def check_no_grad(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Raise ValueError where :func:`grad_reason` finds autograd recording through q, k or v. Entry points that
    transform their inputs before :func:`check_attention_inputs` sees them (PBS ranks and gathers the keys) call it
    on the caller's tensors first."""
    reason = grad_reason(q, k, v)
    if reason is not None:
        raise ValueError(f"{reason}: call it under torch.no_grad() or torch.inference_mode(), or detach q, k and v "
                         f"(for training, use SDPA)")


def unsupported_reason(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *, is_causal: bool = False,
                       causal_variant: CausalVariant | None = None) -> str | None:
    """Why a call with these inputs' dtype, head dim, device, autograd state and shapes cannot take the sparse path
    (None when it can): for callers that fall back to dense attention instead of raising, as the diffusers and
    transformers seams do (their fallback, SDPA, has a backward pass and takes shapes the kernels refuse: not
    4-D, a value head dim unlike q's, batch sizes to broadcast, causal with unequal lengths and no variant)."""
    reason = grad_reason(query, key, value)
    if reason is not None:
        return reason
    if query.device.type == "cuda":
        if query.dtype not in KERNEL_DTYPES:
            return f"dtype {query.dtype} on CUDA (the kernels take float16/bfloat16)"
        reason = gpu_reason(query.device, query.shape[-1])
        if reason is not None:
            return reason
    if not (MIN_HEAD_DIM <= query.shape[-1] <= MAX_HEAD_DIM and query.shape[-1] % 8 == 0):
        return f"head dim {query.shape[-1]}"
    if query.device.type not in ("cuda", "cpu"):
        return f"device {query.device}"
    # Shapes SDPA takes and the kernels refuse. Only these few comparisons run on every call (the seams ask on
    # every attention call, and the kernel call repeats the full check, ~4.6 us of host time); the full check
    # runs when one fails, for its message. What both refuse (mismatched dtypes, devices or q/k head dims,
    # head counts that do not divide) is left to the kernel call's error, as SDPA would raise too.
    plain = (query.dim() == key.dim() == value.dim() == 4 and key.shape == value.shape
             and query.shape[0] == key.shape[0] and query.numel() > 0 and key.numel() > 0
             and query.dtype in _CALL_DTYPES
             and (not is_causal or causal_variant is not None or query.shape[2] == key.shape[2]))
    if not plain:
        try:
            check_attention_inputs(query, key, value, tensor_layout="HND", is_causal=is_causal,
                                   causal_variant=causal_variant)
        except ValueError as e:
            return str(e)
    return None


def resolve_scale(scale: float | None, head_dim: int) -> float:
    if scale is None:
        return head_dim ** -0.5
    if isinstance(scale, (bool, str)):  # float() read True as a scale of 1 and "0.1" as 0.1
        raise ValueError(f"scale must be a positive finite number, got {scale!r}")
    scale = float(scale)
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite number, got {scale}")
    return scale


def per_head(value: PerHead, heads: int, name: str, device: torch.device | str, *,
             low: float = -math.inf, high: float = math.inf) -> torch.Tensor:
    """A float32 tensor of one threshold per q head, from a scalar or a length-H sequence.

    Checked on the CPU before the copy to ``device``, so a call costs no GPU->CPU synchronisation
    (a CUDA tensor argument is read back once).
    """
    if _is_number(value):
        return _python_per_head((float(value),), heads, name, str(device), low, high)
    if isinstance(value, (list, tuple)) and all(_is_number(x) for x in value):  # e.g. from a settings file
        return _python_per_head(tuple(float(x) for x in value), heads, name, str(device), low, high)
    # (after the fast paths: no host time added to a plain call) True was read as 1.0, cdfthreshd=True keeping every
    # block, as check_threshold_values refuses it; a string failed inside torch with a TypeError
    flags = value if isinstance(value, (list, tuple)) else (value,)
    if any(isinstance(x, (bool, str)) for x in flags) or (isinstance(value, torch.Tensor)
                                                          and value.dtype == torch.bool):
        raise ValueError(f"{name} must be a number, one per head or a tensor of them, got {value!r}")
    try:
        t = torch.as_tensor(value, dtype=torch.float32).detach().flatten().cpu()
    except (TypeError, ValueError, RuntimeError) as e:
        raise ValueError(f"{name} must be a number, one per head or a tensor of them, got {value!r}") from e
    if t.numel() == 1:
        t = t.expand(heads).contiguous()
    if t.numel() != heads:
        raise ValueError(f"{name} needs one value or one per head ({heads}), got {t.numel()}")
    if torch.isnan(t).any():
        raise ValueError(f"{name} contains NaN")
    if (t < low).any() or (t > high).any():
        raise ValueError(f"{name} must lie in [{low}, {high}], got {t.tolist()}")
    return _on_device(tuple(t.tolist()), str(device))


THRESHOLD_RANGES = {"simthreshd1": (-1.0, 1.0), "cdfthreshd": (0.0, 1.0), "pvthreshd": (0.0, math.inf)}
# what check_threshold_values takes: SpargeAttn's thresholds and S2O's early-stop tau (None: no early stop)
_CHECKED_RANGES = {**THRESHOLD_RANGES, "tau": (0.0, math.inf)}


def check_threshold_values(name: str, value: Any) -> None:
    """Raise ValueError unless ``value`` is a threshold the kernels take, whatever the head count: a number or a
    non-empty sequence of numbers in ``name``'s range (pvthreshd: > 0, inf or None for stage 2 off; S2O's ``tau``:
    >= 0 or None for no early stop). For callers that hold thresholds before any call (settings, tuning grids); a
    tensor is left to the call's own check."""
    if isinstance(value, torch.Tensor) or (name in ("pvthreshd", "tau") and value is None):
        return
    values = value if isinstance(value, (list, tuple)) else (value,)
    low, high = _CHECKED_RANGES[name]
    if not values:
        raise ValueError(f"{name} must be a number or a non-empty list of numbers, got {value!r}")
    for x in values:
        if not (_is_number(x) and low <= x <= high) or (name == "pvthreshd" and x == 0):  # NaN fails the range
            span = {"pvthreshd": "(0, inf] (inf or None: stage 2 off)",
                    "tau": "[0.0, inf] (None: no early stop)"}.get(name, f"[{low}, {high}]")
            raise ValueError(f"{name} values must lie in {span}, got {x!r}")


def _is_number(x: object) -> TypeIs[float | int]:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


@functools.lru_cache(maxsize=1024)
def _python_per_head(values: tuple[float, ...], heads: int, name: str, device: str, low: float, high: float
                     ) -> torch.Tensor:
    """Python numbers (one, or one per head) checked and cached without any tensor op: every attention call
    of every layer passes its thresholds, and the tensor path costs ~45 us of host time per argument."""
    if len(values) == 1:
        values = values * heads
    if len(values) != heads:
        raise ValueError(f"{name} needs one value or one per head ({heads}), got {len(values)}")
    if any(math.isnan(x) for x in values):
        raise ValueError(f"{name} contains NaN")
    if any(not low <= x <= high for x in values):
        raise ValueError(f"{name} must lie in [{low}, {high}], got {list(values)}")
    return _on_device(values, device)


@functools.lru_cache(maxsize=256)
def _on_device(values: tuple[float, ...], device: str) -> torch.Tensor:
    """Threshold tensors are cached by value: repeated calls (every layer, every step) copy nothing."""
    return torch.tensor(values, dtype=torch.float32, device=device)


# Oldest GPUs the Triton kernels run on: Ampere. Compiled for sm75 (64 KB of shared memory per block) and sm70
# (96 KB) the attention kernel at D = 128 needs 128 KB even with one pipeline stage (benchmarks/shared_memory.py
# with those targets added), and bf16 tensor-core products start at sm80.
MIN_CAPABILITY = (8, 0)


@functools.lru_cache(maxsize=16)
def _capability_of_index(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def device_capability(device_index: int | None) -> tuple[int, int]:
    """Compute capability of a CUDA device (None: the current one), looked up once per device: the kernels ask on
    every call. While torch.compile traces (the seams ask ``unsupported_reason``), the device's properties are read
    directly: Dynamo folds that call to a constant, where the cache's wrapper would make it warn."""
    index = device_index if device_index is not None else torch.cuda.current_device()
    if torch.compiler.is_compiling():
        properties = torch.cuda.get_device_properties(index)
        return properties.major, properties.minor
    return _capability_of_index(index)


# Head dims above 128 (Gemma 2 and 3 use 256) need more shared memory per block than GPUs of compute capability 8.6,
# 8.9 and 12.0 allow (99 KB): compiled offline at D = 256 (session 54), the kernels' launches need up to 144 KB for
# sm80 at their settings (the mask walk and S2O's walk, two stages each), and for sm89 the mask walk needs 112 KB even
# with one stage.
WIDE_HEAD_DIM = 128
WIDE_HEAD_SHARED_BYTES = 147456


@functools.lru_cache(maxsize=16)
def _shared_memory_of_index(device_index: int) -> int:
    return _opt_in_shared_memory(device_index)


def _opt_in_shared_memory(device_index: int) -> int:
    properties: Any = torch.cuda.get_device_properties(device_index)  # (torch's stubs lack the field)
    return properties.shared_memory_per_block_optin


def shared_memory_per_block(device_index: int) -> int:
    """The opt-in maximum of shared memory per block of a CUDA device, in bytes (looked up once per device; read
    directly while torch.compile traces, as ``device_capability`` does)."""
    if torch.compiler.is_compiling():
        return _opt_in_shared_memory(device_index)
    return _shared_memory_of_index(device_index)


def gpu_reason(device: torch.device, head_dim: int = 0) -> str | None:
    """Why the Triton kernels cannot run on this CUDA device (None where they can), at ``head_dim`` where given. ROCm
    builds of PyTorch call AMD GPUs "cuda" too: the kernels' settings, shared-memory sizes and Hopper paths are
    NVIDIA's, and no AMD GPU has run them, so those are refused rather than trusted."""
    if torch.version.hip is not None:
        return f"{device} is an AMD GPU (ROCm); the kernels are written and tested for NVIDIA GPUs only"
    major, minor = device_capability(device.index)
    if (major, minor) < MIN_CAPABILITY:
        return (f"{device} has compute capability {major}.{minor}; the Triton kernels need "
                f"{MIN_CAPABILITY[0]}.{MIN_CAPABILITY[1]} or newer (Ampere and later)")
    if head_dim > WIDE_HEAD_DIM:
        index = device.index if device.index is not None else torch.cuda.current_device()
        shared = shared_memory_per_block(index)
        if shared < WIDE_HEAD_SHARED_BYTES:
            return (f"head dim {head_dim} needs {WIDE_HEAD_SHARED_BYTES // 1024} KB of shared memory per block and "
                    f"{device} allows {shared // 1024} KB; head dims up to {WIDE_HEAD_DIM} run there")
    return None


def pick_backend(backend: Backend, device: torch.device, head_dim: int = 0) -> Literal["triton", "reference"]:
    """'auto': Triton on CUDA, the float32 reference on CPU (documented fallback for tests and tiny models). A GPU
    older than :data:`MIN_CAPABILITY`, or one with too little shared memory for ``head_dim`` (above 128 on GPUs with
    99 KB per block), raises ValueError for 'auto' and 'triton' (there the reference is the only path:
    ``backend="reference"``, float32 and slow; or SDPA)."""
    if backend not in ("auto", "triton", "reference"):
        raise ValueError(f"backend must be 'auto', 'triton' or 'reference', got {backend!r}")
    if backend == "reference":
        return backend
    if device.type == "cuda":
        reason = gpu_reason(device, head_dim)
        if reason is not None:
            raise ValueError(f"{reason}: use backend='reference' (float32, slow) or SDPA on this GPU")
        return "triton"
    if backend == "triton":  # CPU tensors under TRITON_INTERPRET (the tests)
        reason = triton_launch_reason(device)
        if reason is not None:
            raise ValueError(f"backend='triton': {reason}; use backend='reference' or 'auto'")
        return backend
    if device.type == "cpu":
        return "reference"
    raise ValueError(f"device {device} is not supported: use a CUDA GPU, or CPU tensors for the reference path")


def check_kernel_dtype(dtype: torch.dtype) -> None:
    if dtype not in KERNEL_DTYPES:
        raise ValueError(f"the Triton kernels take torch.float16 or torch.bfloat16, got {dtype}; "
                         "cast the inputs (e.g. q.to(torch.bfloat16)) or use backend='reference'")


def _key_segment_start(k_blocks: int, key_segment: int, device: torch.device) -> torch.Tensor:
    """First position of the segment holding each key block: the smallest original position its keys may have
    (``key_segment`` = BLOCK_K: keys in order, the block's own first position)."""
    return torch.arange(k_blocks, device=device) * BLOCK_K // key_segment * key_segment


def causal_block_visible(q_blocks: int, k_blocks: int, kv_len: int, device: torch.device,
                         key_segment: int = BLOCK_K, *, q_len: int | None = None, causal_offset: int = 0,
                         sliding_window: int | None = None) -> torch.Tensor:
    """[q_blocks, k_blocks] bool: key block j may hold a key that some query of block i sees (with keys permuted
    within segments of ``key_segment`` positions: its segment starts at or before the block's last query).
    Query row r sits at position r + ``causal_offset``; ``q_len`` defaults to ``kv_len``. With a
    ``sliding_window`` W (keys in order only), the block's last key must also lie within W of the block's first
    query (``attention._key_block_flags`` states the same rule for the kernels; change both together)."""
    q_len = kv_len if q_len is None else q_len
    last_position = min(q_len - 1 + causal_offset, kv_len - 1)
    first_q = torch.arange(q_blocks, device=device) * BLOCK_Q + causal_offset
    last_q = torch.clamp(first_q + BLOCK_Q - 1, max=last_position)
    visible = _key_segment_start(k_blocks, key_segment, device)[None, :] <= last_q[:, None]
    if sliding_window is not None:  # a ragged last block ends at the last key, not at its padded end
        last_k = torch.clamp(torch.arange(k_blocks, device=device) * BLOCK_K + BLOCK_K - 1, max=kv_len - 1)
        visible &= last_k[None, :] > first_q[:, None] - sliding_window
    return visible


def causal_block_straddles(q_blocks: int, k_blocks: int, kv_len: int, device: torch.device,
                           key_segment: int = BLOCK_K, *, q_len: int | None = None, causal_offset: int = 0
                           ) -> torch.Tensor:
    """[q_blocks, k_blocks] bool: visible key blocks that some query of block i may not fully see (the diagonal;
    with permuted keys, every block of the segments the query block overlaps). Arguments as
    :func:`causal_block_visible`'s."""
    first_q = torch.arange(q_blocks, device=device) * BLOCK_Q + causal_offset
    last_k = _key_segment_start(k_blocks, key_segment, device) + key_segment - 1
    return (causal_block_visible(q_blocks, k_blocks, kv_len, device, key_segment, q_len=q_len,
                                 causal_offset=causal_offset)
            & (last_k[None, :] > first_q[:, None]))


def key_blocks_needing_masking(q_blocks: int, k_blocks: int, kv_len: int, device: torch.device,
                               key_segment: int = BLOCK_K, *, is_causal: bool, q_len: int | None = None,
                               causal_offset: int = 0, sliding_window: int | None = None) -> torch.Tensor:
    """[q_blocks, k_blocks] bool: the key blocks whose tiles the kernels walk with element masking, after the
    kept blocks that need none (``attention._walk_positions``): the ragged last block and, under causal masking,
    the diagonal (with permuted keys, every block of the segments the query block overlaps) and, with a
    ``sliding_window``, blocks that start before the window of the block's last query. Arguments as
    :func:`causal_block_visible`'s (``attention._key_block_flags`` states the rule for the kernels; change both
    together)."""
    q_len = kv_len if q_len is None else q_len
    ragged = torch.arange(k_blocks, device=device) * BLOCK_K + BLOCK_K > kv_len
    masked = ragged[None, :].expand(q_blocks, k_blocks).clone()
    if not is_causal:
        return masked
    # the diagonal of the blocks a query block sees (the others are never walked)
    masked |= causal_block_straddles(q_blocks, k_blocks, kv_len, device, key_segment, q_len=q_len,
                                     causal_offset=causal_offset)
    if sliding_window is not None:  # the last row's own position, not capped at the last key (as the kernels)
        first_q = torch.arange(q_blocks, device=device) * BLOCK_Q + causal_offset
        last_q = torch.clamp(first_q + BLOCK_Q - 1, max=q_len - 1 + causal_offset)
        masked |= _key_segment_start(k_blocks, key_segment, device)[None, :] <= last_q[:, None] - sliding_window
    return masked


@dataclass(frozen=True, eq=False)
class PermutedKeys:
    """Keys and values stored in a permuted order for causal attention (PBS-Attn's segmented permutation).

    The sequence is cut into aligned segments of ``segment`` positions ([0, S), [S, 2S), ...; the last one may
    be shorter), and each segment's keys (with their values) may be reordered within it; queries stay in
    order. A query at position i sees the key in slot r when ``positions[..., r] <= i`` (with fewer queries than
    keys, query row j sits at position j + Nkv - Nq under ``causal_variant="lower_right"``, a chunk against its
    KV cache, and at j under "upper_left"). Blocks of earlier
    segments are then wholly visible and blocks of later ones wholly hidden, so block skipping works as in
    plain causal attention; only the blocks of the segments a query block overlaps need element masking.

    Attributes:
        positions: (B or 1, H_kv or 1, Nkv) integer tensor: the original position of the key in each slot. It
            must be a permutation within each segment (checked on CPU calls and by :meth:`verify`; a CUDA call
            checks only its shape, dtype and device, to stay free of a device sync).
        segment: positions per segment, a positive multiple of 64 (the key block); 64 means keys in order.
    """

    positions: torch.Tensor
    segment: int

    def __post_init__(self):
        if not isinstance(self.segment, int) or isinstance(self.segment, bool) or self.segment <= 0 \
                or self.segment % BLOCK_K:
            raise ValueError(f"PermutedKeys.segment must be a positive multiple of {BLOCK_K}, got {self.segment!r}")
        p = self.positions
        if not isinstance(p, torch.Tensor) or p.dim() != 3 or p.dtype not in (torch.int32, torch.int64):
            raise ValueError("PermutedKeys.positions must be a 3-D (B|1, H_kv|1, Nkv) int32/int64 tensor, got "
                             f"{type(p).__name__ if not isinstance(p, torch.Tensor) else (tuple(p.shape), p.dtype)}")

    def verify(self) -> None:
        """Raise ValueError unless ``positions`` permutes keys within their segments (reads the tensor back:
        a device sync on CUDA)."""
        p = self.positions.long()
        n = p.shape[-1]
        slots = torch.arange(n, device=p.device)
        segment_of = slots // self.segment
        if not bool(((p >= 0) & (p < n) & (p // self.segment == segment_of)).all()):
            raise ValueError(f"PermutedKeys.positions moves a key out of its segment of {self.segment} positions "
                             f"(or out of [0, {n}))")
        if not bool((p.sort(dim=-1).values == slots).all()):
            raise ValueError("PermutedKeys.positions repeats a position: it must be a permutation")


def check_permuted_keys(permuted_keys: PermutedKeys | None, shape: AttentionShape, device: torch.device,
                        is_causal: bool) -> int:
    """The key segment of a call (``BLOCK_K`` without permuted keys); raises ValueError naming the problem."""
    if permuted_keys is None:
        return BLOCK_K
    if not isinstance(permuted_keys, PermutedKeys):
        raise ValueError(f"permuted_keys must be a PermutedKeys, got {type(permuted_keys).__name__}")
    if not is_causal:
        raise ValueError("permuted_keys needs is_causal=True (without causal masking the order of the keys does "
                         "not change the result: permute k and v and leave this argument out)")
    p = permuted_keys.positions
    b, h, n = p.shape
    if n != shape.kv_len or b not in (1, shape.batch) or h not in (1, shape.kv_heads):
        raise ValueError(f"permuted_keys.positions has shape {tuple(p.shape)}, expected "
                         f"({size_or_one(shape.batch)}, {size_or_one(shape.kv_heads)}, {shape.kv_len})")
    if p.device != device:
        raise ValueError(f"permuted_keys.positions is on {p.device}, q on {device}")
    if shape.sliding_window is not None:
        raise ValueError("permuted_keys cannot be combined with sliding_window (a window's edge cuts through "
                         "permuted segments)")
    if device.type == "cpu":
        permuted_keys.verify()
    return permuted_keys.segment
