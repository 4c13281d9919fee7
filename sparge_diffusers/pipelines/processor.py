"""SpargeProcessor: diffusers attention processors whose attention product is SpargeAttn.

The seam. Everything the native processor does (projections, norms, rotary embeddings, joint text+image
attention, Mochi's text padding, output projections) stays the native processor's own code: SpargeProcessor
calls it while its ``F.scaled_dot_product_attention`` calls are answered with :func:`sparge_attention`. In
diffusers 0.42 that is the one attention call of all four models: SD3 (JointAttnProcessor2_0), CogVideoX
(CogVideoXAttnProcessor2_0) and Mochi (MochiAttnProcessor2_0) call SDPA directly, and Flux (FluxAttnProcessor)
reaches it through ``dispatch_attention_fn``'s native backend. The tests compare every model against its native
processors, so an upgrade that moves the call fails loudly.

How the call is answered: eagerly, ``torch.nn.functional.scaled_dot_product_attention`` points to a router for
the duration of the native call, and the router answers the calling thread's SDPA calls (other threads pass
through to SDPA). Under torch.compile a thread-local ``TorchFunctionMode`` answers instead (Dynamo traces modes;
the compiled graph keeps none of its cost). The router replaced the mode in eager calls because a mode sees
every torch call of the native processor: on the H100 machine's CPU a full-size Flux attention layer took
330 us of host time to enqueue natively and 440-454 us under a mode that only passes calls through; through
SpargeProcessor 711 us with the router against 882 us with the mode (fastest of three alternated rounds, one
run; natively 355 us in that run).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import numbers
import os
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, cast

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .._compile import compiling, warn_once
from ..kernels import sparge_attention
from ..kernels.library import CUDAGRAPH_UNSAFE, _as_list, sparge_attention_op
from ..kernels._inputs import THRESHOLD_RANGES, check_flag, check_threshold_values, resolve_scale, unsupported_reason
from ..permutations import ORDERS, permuted, visual_token_permutation
from .settings_file import LayerSettingsFile


@dataclass
class SpargeSettings:
    """Thresholds of one layer (upstream SpargeAttn names; see :func:`sparge_attention`): one value for the
    layer or a list with one per head (as ``tune`` writes them)."""

    simthreshd1: float | list[float] = 0.6
    cdfthreshd: float | list[float] = 0.98
    pvthreshd: float | list[float] | None = 50
    dense: bool = False  # run this layer densely (native SDPA)
    permutation: str | None = None  # reorder visual tokens: "hilbert", "rowmajor", "colmajor", "timemajor", "random"

    def __post_init__(self):
        # checked when made (or read from a settings file), not at the model's first attention call
        for name in (*THRESHOLD_RANGES, "permutation", "dense"):
            self._check(name, getattr(self, name))

    def __setattr__(self, name: str, value: Any) -> None:
        if name in THRESHOLD_RANGES or name in ("permutation", "dense"):  # set later (settings.x = ...): checked too
            self._check(name, value)
        object.__setattr__(self, name, value)

    @staticmethod
    def _check(name: str, value: Any) -> None:
        if name in THRESHOLD_RANGES:
            check_threshold_values(name, value)
        elif name == "dense":  # a string such as "false" from a hand-edited file is truthy: it would run dense
            check_flag(value, name)
        elif value is not None and (not isinstance(value, str) or value not in ORDERS):
            raise ValueError(f"unknown permutation {value!r}; choose from {sorted(ORDERS)} or None")


def infer_token_grid(
    transformer: torch.nn.Module, args: tuple, kwargs: dict
) -> tuple[tuple[int, int, int], str] | None:
    """The (T, H, W) grid of visual tokens of one forward call, and where the text tokens sit in the joint
    sequence ("before" or "after" the visual ones), from the latent shape and patch size (a registry by class).
    """
    hs = kwargs.get("hidden_states", args[0] if args else None)
    name = type(transformer).__name__
    cfg = getattr(transformer, "config", None)
    if hs is None or cfg is None:
        return None
    if name == "FluxTransformer2DModel":  # packed latents: the positions come from img_ids (t, row, col)
        ids = kwargs.get("img_ids")
        if ids is None:
            return None
        ids = ids.reshape(-1, ids.shape[-1])
        rows, cols = int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1
        return ((1, rows, cols), "before") if rows * cols == hs.shape[1] else None
    if name == "SD3Transformer2DModel":  # (B, C, H, W); joint attention is [image; text]
        p = cfg.patch_size
        return (1, hs.shape[-2] // p, hs.shape[-1] // p), "after"
    if name == "CogVideoXTransformer3DModel":  # (B, F, C, H, W); attention is [text; video]
        p, pt = cfg.patch_size, getattr(cfg, "patch_size_t", None) or 1
        return (-(-hs.shape[1] // pt), hs.shape[-2] // p, hs.shape[-1] // p), "before"
    if name == "MochiTransformer3DModel":  # (B, C, F, H, W); attention is [video; valid text]
        p = cfg.patch_size
        return (hs.shape[2], hs.shape[-2] // p, hs.shape[-1] // p), "after"
    return None


def _capturing() -> bool:
    """Whether the current CUDA stream is capturing a graph (then nothing may synchronise with the GPU).
    Asked only once CUDA is initialised (a capture needs it), so a CPU run never creates a CUDA context."""
    return torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()


def _native_processor(attn: torch.nn.Module, called_without_text: bool = False, model_class: str | None = None):
    """The processor diffusers 0.42 gives this attention module by default (a small registry, by class, and for
    ``Attention`` by how the model calls it, where known: CogVideoX passes its text to a module without text
    projections, SD3.5's image-only attention passes none). ``detach`` has no call to go by and gives the
    transformer's class instead."""
    from diffusers.models import attention_processor as ap

    name = type(attn).__name__
    if name == "FluxAttention":
        from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

        return FluxAttnProcessor()
    if name == "MochiAttention":
        return ap.MochiAttnProcessor2_0()
    if name == "Attention":
        if getattr(attn, "add_k_proj", None) is not None:  # SD3's joint text+image attention
            return ap.JointAttnProcessor2_0()
        if getattr(attn, "is_cross_attention", False) is False and getattr(attn, "norm_q", None) is not None:
            # SD3.5 Medium's dual-attention layers add an image-only self-attention (attn2) with QK norms, called
            # without text, and JointAttnProcessor2_0 in diffusers; CogVideoX's attention gets its text
            if called_without_text or model_class == "SD3Transformer2DModel":
                return ap.JointAttnProcessor2_0()
            return ap.CogVideoXAttnProcessor2_0()
    raise ValueError(f"SpargeProcessor does not know the native processor of {name}; pass native=..., or use "
                     "sparge_diffusers.apply(...), which delegates to the processor each module has")


# Where diffusers (0.42) attaches an IP-Adapter's image projection to a transformer (SD3: image_proj, Flux:
# encoder_hid_proj). SD3's is a resampler with attention modules of its own: not the model's attention, so they
# keep their processor.
_IP_ADAPTER_PROJECTIONS = ("image_proj.", "encoder_hid_proj.")
# The name under which an IP-Adapter processor replaced by SpargeProcessor stays registered on its attention
# module, so that .to(), dtype casts and offloading hooks still move its to_k_ip/to_v_ip weights.
_KEPT_NATIVE = "sparge_native_processor"


def _ip_adapter_covers(attn: torch.nn.Module) -> bool:
    """Whether diffusers' IP-Adapter loaders give this attention module an IP-Adapter processor: every attention
    module of SD3, and Flux's double-stream blocks (with text projections) but not its single-stream ones, which the
    model hands the image-prompt features all the same."""
    return not (type(attn).__name__ == "FluxAttention" and getattr(attn, "added_kv_proj_dim", None) is None)


def _call_parameters(native: Any) -> frozenset[str]:
    """The named parameters of a processor's ``__call__``, as diffusers' modules read them to decide what to pass
    (its processors' ``**kwargs`` swallow what they ignore). Cached per processor class: it is read on every
    attention call that carries IP-Adapter arguments."""
    function = getattr(native.__call__, "__func__", None)  # a processor object's method: one entry per class
    if function is None:  # a plain function or another callable
        return frozenset(inspect.signature(native).parameters)
    return _function_parameters(function)


@functools.cache
def _function_parameters(function: Any) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)


def _named_parameters(native: Any) -> frozenset[str]:
    """The parameter names of ``native.__call__`` as diffusers reads them (``inspect.signature(processor.__call__)``),
    without ``*args``/``**kwargs``: the keyword arguments a diffusers module hands that processor."""
    target = native if inspect.isfunction(native) else native.__call__
    kinds = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    return frozenset(name for name, p in inspect.signature(target).parameters.items() if p.kind not in kinds)


def _ip_adapter_arguments(native: Any, attn: torch.nn.Module, given: dict[str, Any]) -> dict[str, Any]:
    """The IP-Adapter keyword arguments (``ip_hidden_states``, ``ip_adapter_masks``, ``temb``) to hand the native
    processor: the given ones its ``__call__`` names (diffusers drops the others, the first two quietly). Raises
    where the model passes image-prompt features to a module an IP-Adapter covers but the native processor cannot
    take them: its IP-Adapter processor, with the adapter's weights, was replaced (``set_attn_processor`` discards
    it), and running on would ignore the image prompt."""
    given = {k: v for k, v in given.items() if v is not None}
    if not given:
        return {}
    parameters = _call_parameters(native)
    if "ip_hidden_states" in given and "ip_hidden_states" not in parameters and _ip_adapter_covers(attn):
        raise ValueError(
            f"the model passes IP-Adapter image features to a {type(attn).__name__} whose processor "
            f"({type(native).__name__}) cannot take them: its IP-Adapter processor was replaced, and with it the "
            "adapter's weights (set_attn_processor discards them). Load the IP-Adapter, then call "
            "sparge_diffusers.apply(pipe): it keeps each module's IP-Adapter processor and runs its attention sparse")
    return {k: v for k, v in given.items() if k in parameters}


def _is_key_padding_mask(mask: torch.Tensor, query: torch.Tensor, key: torch.Tensor) -> bool:
    """Whether an SDPA mask is a boolean key-padding mask: (B or 1, 1, 1, N_kv), True = attend, the same for every
    head and query (QwenImage's and HunyuanVideo's text padding)."""
    return (mask.dtype == torch.bool and mask.dim() == 4 and mask.shape[1:3] == (1, 1)
            and mask.shape[3] == key.shape[2] and mask.shape[0] in (1, query.shape[0]))


def _kept_keys(mask: torch.Tensor) -> list[int | torch.Tensor | None] | None:
    """Per mask row (batch row, or one for the batch): None where every key is kept, an int L where the first L are
    (trailing padding, as HunyuanVideo's), else the kept key positions on the mask's device (QwenImage's padding
    ends its text, before the image). None instead of the list where a row keeps no key (SDPA gives it NaN; left
    to SDPA). One read-back of the (B, N_kv) mask."""
    rows: list[int | torch.Tensor | None] = []
    for row in mask[:, 0, 0, :].cpu():
        n = int(row.sum())
        if n == 0:
            return None
        if n == row.numel():
            rows.append(None)
        elif bool(row[:n].all()):
            rows.append(n)
        else:
            rows.append(row.nonzero().squeeze(1).to(mask.device))
    return rows


def _attend_kept_keys(attention, query, key, value, kept, collect: bool, thresholds: dict):
    """SDPA under a key-padding mask as sparse calls on the kept keys only: one call per batch row (one for the
    batch where the mask has one row or none pads), each on its keys cut (a view) or gathered (a copy of the kept
    K/V). Masked keys get no weight under SDPA's mask either, so this is the same attention. Returns the (B, H, N, D)
    output, and with ``collect`` the rows' stats joined (:meth:`SparsityStats.concat`)."""
    from ..kernels import SparsityStats

    def keys_of(k, v, row):
        if row is None:
            return k, v
        if isinstance(row, int):
            return k[:, :, :row], v[:, :, :row]
        return k.index_select(2, row), v.index_select(2, row)

    if all(row is None for row in kept):
        kept = [None]  # no padding anywhere: the batch in one call
    batches = [slice(None)] if len(kept) == 1 else [slice(b, b + 1) for b in range(query.shape[0])]
    outs, parts = [], []
    for rows, row in zip(batches, kept):
        k, v = keys_of(key[rows], value[rows], row)
        result = attention(query[rows], k, v, return_sparsity=collect, **thresholds)
        outs.append(result[0] if collect else result)
        if collect:
            parts.append(result[1])
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return (out, SparsityStats.concat(parts)) if collect else out


@torch.library.custom_op("sparge_diffusers::key_padded_sparge_attention", mutates_args=(), tags=CUDAGRAPH_UNSAFE)
def _key_padded_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, dense: torch.Tensor | None,
                   scale: float, simthreshd1: list[float], cdfthreshd: list[float],
                   pvthreshd: list[float] | None) -> torch.Tensor:
    """A compiled model's SDPA call under a boolean key-padding mask: the mask is read when the operator runs (a
    read-back, hence opaque to the compiler and kept out of CUDA graphs) and the call runs as an eager one does
    (:func:`_attend_kept_keys`); SDPA under the mask where a row has no kept key or ``dense`` (the warm-up steps'
    flag) holds True. Returns a contiguous (B, H, N, D) output."""
    kept = None if dense is not None and bool(dense.item()) else _kept_keys(mask)
    if kept is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale).contiguous()
    thresholds = dict(scale=scale, simthreshd1=simthreshd1, cdfthreshd=cdfthreshd, pvthreshd=pvthreshd)
    return _attend_kept_keys(sparge_attention, q, k, v, kept, False, thresholds).contiguous()


@_key_padded_op.register_fake
def _(q, k, v, mask, dense, scale, simthreshd1, cdfthreshd, pvthreshd):
    return q.new_empty(q.shape)


class _SparseSDPA(TorchFunctionMode):
    """Answers F.scaled_dot_product_attention with sparge_attention, or falls back to it with a reason: as a
    TorchFunctionMode under torch.compile, through :func:`_sdpa_answered_by`'s router in eager calls."""

    def __init__(self, processor: "SpargeProcessor", layer: str, settings: SpargeSettings):
        super().__init__()
        self.processor, self.layer, self.settings = processor, layer, settings
        self.answered = False  # whether the native processor called SDPA at all

    def answer(self, sdpa, args: tuple, kwargs: dict):
        self.answered = True
        return self.processor._attention(self.layer, self.settings, sdpa, *args, **kwargs)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention:
            if func is torch.Tensor.unflatten and compiling():
                # Dynamo (torch <= 2.13) cannot trace the super() call inside Tensor.unflatten once a mode
                # hands it on (pytorch/pytorch#179853): a graph break per layer. As a method call (this mode
                # is off inside its own handler) Dynamo traces it.
                tensor, *rest = args
                return tensor.unflatten(*rest, **kwargs)
            return func(*args, **kwargs)
        return self.answer(func, args, kwargs)


_NATIVE_SDPA = F.scaled_dot_product_attention
_ROUTE = threading.local()  # .seam: the _SparseSDPA answering this thread's SDPA calls, if any
_ROUTE_LOCK = threading.Lock()
_routed_calls = 0  # native calls in flight, all threads, while the router is installed
_displaced = _NATIVE_SDPA  # what the router replaced (SDPA, unless someone else had replaced it)


def _routed_sdpa(*args, **kwargs):
    """Stands in for F.scaled_dot_product_attention while a native processor runs: the calling thread's seam
    answers; without one (other threads, and inside the answer itself) SDPA runs."""
    seam = getattr(_ROUTE, "seam", None)
    if seam is None:
        return _displaced(*args, **kwargs)
    _ROUTE.seam = None  # the answer (a fallback, the tuner's exact outputs) may call SDPA itself
    try:
        return seam.answer(_displaced, args, kwargs)
    finally:
        _ROUTE.seam = seam


@contextlib.contextmanager
def _sdpa_answered_by(seam: _SparseSDPA):
    """Route this thread's F.scaled_dot_product_attention calls to ``seam`` inside the block. The module
    attribute is swapped once for all threads' blocks in flight and put back when the last one ends (unless
    something else replaced it meanwhile); the router passes other threads' calls through."""
    global _routed_calls, _displaced
    with _ROUTE_LOCK:
        if _routed_calls == 0 and F.scaled_dot_product_attention is not _routed_sdpa:
            _displaced = F.scaled_dot_product_attention
            F.scaled_dot_product_attention = _routed_sdpa
        _routed_calls += 1
    outer = getattr(_ROUTE, "seam", None)
    _ROUTE.seam = seam
    try:
        yield seam
    finally:
        _ROUTE.seam = outer
        with _ROUTE_LOCK:
            _routed_calls -= 1
            if _routed_calls == 0 and F.scaled_dot_product_attention is _routed_sdpa:
                F.scaled_dot_product_attention = _displaced


_FLAGS = ("collect_stats", "strict", "enabled")
_CHECKED_OPTIONS = ("settings", "layer_settings", "dense_steps", *_FLAGS)


@dataclass
class SpargeProcessor:
    """A diffusers attention processor that computes attention with SpargeAttn.

    Use ``transformer.set_attn_processor(SpargeProcessor())`` where the model has that method (Flux, SD3,
    CogVideoX), or :func:`sparge_diffusers.apply` for any of the four models (Mochi has none in 0.42). With
    ``layer_settings`` or ``dense_steps``, follow ``set_attn_processor`` with :meth:`bind` (``apply`` does both):
    an unbound processor with either refuses its first call rather than ignore them.

    Args:
        settings: thresholds for every layer.
        layer_settings: per-layer overrides keyed by module name (e.g. ``"transformer_blocks.3.attn"``),
            or the path of a settings file written by :func:`sparge_diffusers.tune` (or a loaded
            :class:`LayerSettingsFile`). Names are checked when :meth:`bind` (or ``apply``) sees the model: a
            file for another model class or naming layers the model lacks is refused; layers a file does not
            cover use ``settings``, with a warning (an error when ``strict``).
        dense_steps: run the first k denoising steps of every generation densely (counted by ``bind``'s
            hook from the timestep: a generation's first two timesteps set its direction, falling (Flux, SD3,
            CogVideoX) or rising (Mochi's inverted sigmas), and a move against it restarts the count; a forward
            with the previous forward's timestep belongs to the same step, as in pipelines that call the
            transformer twice per step, e.g. Flux's true CFG; under ``torch.compile`` the graph counts on CPU
            tensors and the attention operator reads the count at run time).
        collect_stats: record sparsity per layer and step in ``self.stats`` (kept on the GPU until read). Off by
            default, as SDPA records nothing: each recorded call costs host time (0.02-0.08 ms at the Flux shape on
            the H100 machine, benchmarks/host_time.py) and a small reduction on the GPU, and the records (one per
            sparse call, 1596 for a 28-step Flux image) stay until :meth:`reset_stats`.
        strict: raise instead of falling back to native attention when a call cannot run sparse.
        native: the processor to delegate to; by default the model's diffusers 0.42 native processor.

    SDPA calls under a boolean key-padding mask ((B or 1, 1, 1, N_kv): QwenImage's and HunyuanVideo's text
    padding) run sparse on each batch row's kept keys (one read-back of the mask per call; under torch.compile
    inside an operator that reads it at run time); other masks go to the native attention, with a warning.

    A step can be captured in a CUDA graph after eager warm-up calls (the forward hook then reads nothing
    back from the GPU); replays skip the per-layer host time that makes eager 1024px image steps host-bound.
    Statistics are not recorded and ``dense_steps`` does not apply inside a graph (each warned once).
    Under ``torch.compile`` the attention goes through the custom operator of
    :mod:`sparge_diffusers.kernels.library` (one graph node; Flux, SD3 and CogVideoX compile with
    ``fullgraph=True``): no statistics, and Flux's token grid is the last eager call's. ``dense_steps`` does
    apply there: the operator switches to exact attention at run time while the step count says so (with
    ``mode="reduce-overhead"`` that operator then stays out of CUDA graphs).
    """

    settings: SpargeSettings = field(default_factory=SpargeSettings)
    layer_settings: dict[str, SpargeSettings] | str | os.PathLike | LayerSettingsFile = field(default_factory=dict)
    dense_steps: int = 0
    collect_stats: bool = False
    strict: bool = False
    native: Any = None
    enabled: bool = True
    step: int = 0
    grid: tuple | None = None  # ((T, H, W), "before" | "after") of the current forward call, set by bind's hook
    _records: list = field(default_factory=list, repr=False)
    _names: dict[int, str] = field(default_factory=dict, repr=False)
    _natives: dict[int, Any] = field(default_factory=dict, repr=False)
    # ids of the modules with entries above, each watched by a weakref.finalize that drops them (_track)
    _tracked: set = field(default_factory=set, repr=False, compare=False)
    _warned: set = field(default_factory=set, repr=False)
    _settings_file: LayerSettingsFile | None = field(default=None, repr=False)
    _hook: Any = field(default=None, repr=False)
    _bound: Any = field(default=None, repr=False, compare=False)  # weakref to the model bind() last saw
    _stats_missed: bool = field(default=False, repr=False)
    # The step count as CPU tensors, for compiled models: a graph updates them in place and hands the flag to
    # the attention operator, which reads it at run time (a Python int would be a guard: a recompile per step).
    # One element each, not 0-dim: Dynamo (torch 2.13) dropped a compiled graph's in-place write to a 0-dim
    # float64 tensor attribute under aot_eager.
    _step_t: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.int64), repr=False,
                                  compare=False)
    _last_timestep_t: torch.Tensor = field(default_factory=lambda: torch.full((1,), math.inf, dtype=torch.float64),
                                           repr=False, compare=False)
    # the current generation's timestep direction: -1 falling, +1 rising, 0 not known yet (its first step)
    _direction_t: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.float64), repr=False,
                                       compare=False)
    _dense_now: torch.Tensor = field(default_factory=lambda: torch.zeros(1, dtype=torch.bool), repr=False,
                                     compare=False)

    def __post_init__(self):
        for name in _CHECKED_OPTIONS:
            object.__setattr__(self, name, self._checked_option(name, getattr(self, name)))

    def __setattr__(self, name: str, value: Any) -> None:
        # the options are checked when set later too (processor.settings = ... is the documented way to change
        # them): a dict or a path there failed at the model's first attention call, dense_steps = -1 ran no warm-up,
        # and settings the bound model cannot take (unknown layers, other head counts) went unnoticed
        if name not in _CHECKED_OPTIONS or "_bound" not in self.__dict__:  # (during __init__: __post_init__)
            object.__setattr__(self, name, value)
            return
        before = {n: self.__dict__[n] for n in ("settings", "layer_settings", "_settings_file")}
        object.__setattr__(self, name, self._checked_option(name, value))
        model = self._bound() if self._bound is not None else None
        if model is not None and name in ("settings", "layer_settings"):
            try:
                with warnings.catch_warnings():
                    if name == "settings":  # the file's coverage warning belongs to setting layer_settings
                        warnings.simplefilter("ignore")
                    self.check_model(model)
            except ValueError:
                for n, v in before.items():
                    object.__setattr__(self, n, v)
                raise

    @property
    def _layers(self) -> dict[str, SpargeSettings]:
        """``layer_settings`` as held: a dict (a settings file's layers, loaded when set)."""
        return cast("dict[str, SpargeSettings]", self.layer_settings)

    def _checked_option(self, name: str, value: Any) -> Any:
        """``value`` for the option ``name``, checked, in the form the processor reads (a settings file loaded)."""
        if name == "settings":
            value = SpargeSettings() if value is None else value
            if not isinstance(value, SpargeSettings):
                raise ValueError(f"settings must be SpargeSettings, got {type(value).__name__}")
        elif name == "layer_settings":
            if isinstance(value, (str, os.PathLike)):
                value = LayerSettingsFile.load(value)
            settings_file = value if isinstance(value, LayerSettingsFile) else None
            value = dict(settings_file.layers) if settings_file is not None else value
            if not isinstance(value, dict):
                raise ValueError(f"layer_settings must be a dict, a settings file's path or a LayerSettingsFile, "
                                 f"got {type(value).__name__}")
            wrong = [n for n, s in value.items() if not isinstance(s, SpargeSettings)]
            if wrong:
                raise ValueError(f"settings must be SpargeSettings (per layer too); not so for {wrong[:3]}")
            object.__setattr__(self, "_settings_file", settings_file)
        elif name in _FLAGS:  # enabled="False" (a string from a config) was read as True: sparse where dense was meant
            check_flag(value, name)
        elif isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:  # dense_steps
            # a negative count ran no warm-up without a word, a string failed at the first step
            raise ValueError(f"dense_steps must be an int >= 0, got {value!r}")
        return value

    def check_model(self, transformer: torch.nn.Module) -> None:
        """Raise ValueError where :meth:`bind` would (a settings file tuned for another model class, layer settings
        naming layers the model lacks, per-head thresholds of another head count), binding and installing nothing."""
        names = [name for name, _ in _attention_modules(transformer)]
        if self._settings_file is not None:
            self._settings_file.check_model(transformer, names, self.strict)
        unknown = set(self._layers) - set(names)
        if unknown:
            raise ValueError(f"layer_settings name layers the model does not have: {sorted(unknown)[:5]}")
        for name, module in _attention_modules(transformer):  # per-head lists: checked here, not at the first call
            heads, settings = getattr(module, "heads", None), self._layers.get(name, self.settings)
            for field_name in THRESHOLD_RANGES if isinstance(heads, int) else ():
                values = getattr(settings, field_name)
                if isinstance(values, (list, tuple)) and len(values) not in (1, heads):
                    raise ValueError(f"{name}: {field_name} has {len(values)} values, one per head of another "
                                     f"model? The layer has {heads} heads (give one value or {heads})")

    def bind(self, transformer: torch.nn.Module) -> "SpargeProcessor":
        """Learn the module names (for per-layer settings and stats) and count denoising steps."""
        earlier = self._bound() if self._bound is not None else None
        if earlier is not None and earlier is not transformer and installed_processor(earlier) is self:
            # its step hook would move here, so the first model's dense_steps would follow the second's steps
            raise ValueError(f"this SpargeProcessor still runs a {type(earlier).__name__} it is bound to: one "
                             "processor counts one model's steps; call .detach(...) on that model first, or give this "
                             "model a SpargeProcessor of its own")
        self.check_model(transformer)
        self._bound = weakref.ref(transformer)
        for name, module in _attention_modules(transformer):
            self._track(module)
            self._names[id(module)] = name
        if self._hook is not None:
            self._hook.remove()
        self._hook = transformer.register_forward_pre_hook(self._on_forward, with_kwargs=True)
        return self

    def _accept_arguments_of(self, native: Any) -> None:
        """Make this processor's ``__call__`` signature, as diffusers reads it, name every keyword argument the
        native processor names. A diffusers attention module hands its processor only the keyword arguments that
        ``inspect.signature(processor.__call__)`` names (the others are dropped with a logged warning), so a native
        parameter SpargeProcessor does not name never reached the native processor: QwenImage's
        ``encoder_hidden_states_mask`` was dropped and its padded text tokens attended to, silently. The widened
        signature belongs to this instance alone: its class becomes a subclass whose ``__call__`` (the same method)
        carries it, where diffusers' eager lookup and torch.compile's tracing of that lookup both read it (an
        instance attribute was seen eagerly but not by Dynamo). The four models' native processors name nothing
        new, so their processors keep the class. :meth:`__call__` hands each native only the extra arguments it
        names."""
        extra = _named_parameters(native) - _named_parameters(self)
        if not extra:
            return
        base = type(self)
        own = inspect.signature(base.__call__)
        params = list(own.parameters.values())
        at = next(i for i, p in enumerate(params) if p.kind == inspect.Parameter.VAR_KEYWORD)
        added = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=None) for name in sorted(extra)]

        def __call__(self, *args, **kwargs):
            return SpargeProcessor.__call__(self, *args, **kwargs)

        signature = own.replace(parameters=params[:at] + added + params[at:])
        __call__.__signature__ = signature  # type: ignore[attr-defined]  # read by inspect.signature
        widened = type(base.__name__, (base,), {"__call__": __call__, "__module__": base.__module__,
                                                "__qualname__": base.__qualname__, "__doc__": base.__doc__})
        object.__setattr__(self, "__class__", widened)

    def _track(self, module: torch.nn.Module) -> None:
        """Drop ``module``'s entries in ``_names`` and ``_natives`` when it is garbage collected. They are keyed
        by id(), and CPython hands a dead module's id to new objects: a processor reused on a second model (say a
        Flux model deleted, then an SD3 one given the same processor) gave its attention modules a dead module's
        native processor (FluxAttnProcessor on SD3's Attention: AttributeError) and layer name (another layer's
        settings)."""
        key = id(module)
        if key not in self._tracked:
            self._tracked.add(key)
            weakref.finalize(module, _forget_module, (self._names, self._natives), self._tracked, key).atexit = False

    def _refuse_unbound_call(self, attn: torch.nn.Module) -> None:
        """Raise for a call from a module :meth:`bind` never saw (``set_attn_processor`` tells the processor
        nothing of the model) when the processor has per-layer settings, found by layer name, or dense warm-up
        steps, counted by the bound model's step hook. Without bind, every layer silently ran ``settings`` (a
        tuned file ignored) and, with ``dense_steps``, every step stayed dense (the count never moved)."""
        needs = [what for what, given in (("layer_settings", bool(self.layer_settings)),
                                          (f"dense_steps={self.dense_steps}", bool(self.dense_steps))) if given]
        raise ValueError(f"SpargeProcessor with {' and '.join(needs)} was called by a {type(attn).__name__} of a "
                         "model it was not bound to (set_attn_processor does not tell it the model's layer names "
                         "or steps): call processor.bind(pipe.transformer) after set_attn_processor, or use "
                         "sparge_diffusers.apply(pipe, ...), which does both")

    def detach(self, transformer: torch.nn.Module) -> None:
        """Undo :func:`apply`: give every attention module back the processor it had, remove the step hook."""
        model_class = type(transformer).__name__
        for _, module in _attention_modules(transformer):
            if module.processor is self:
                module._modules.pop(_KEPT_NATIVE, None)  # an IP-Adapter processor goes back to its own place
                # a module never called since set_attn_processor: its native is known by class only
                _set_processor(module, self._natives.get(id(module)) or _native_processor(module, False, model_class))
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._bound = None

    def _on_forward(self, module, args, kwargs):
        """Count denoising steps and note the token grid of this call (for token permutations).

        Within one generation the timestep moves one way: down in most pipelines, up in Mochi's (its scheduler
        inverts the sigmas, so its timesteps rise from 0). The first two timesteps of a generation set the
        direction, and a move against it starts a new generation, whose count (hence the dense warm-up) starts
        again (with a falling direction assumed, every step of a Mochi generation would restart the count and
        run dense). The same timestep again is the same step (a second forward of it: true CFG's negative prompt,
        which must run as its positive one did). A forward without a timestep counts as a step. This reads one
        number per forward. A generation of one step followed by another is taken for the two steps of one
        generation.
        While a CUDA graph is being captured nothing may be read back from the GPU: see ``_on_captured_forward``.
        """
        if compiling() or _capturing():
            self._on_captured_forward(module, args, kwargs)
            return
        self._count_step(kwargs.get("timestep"))  # the count compiled calls keep too (CPU tensors)
        self.step = int(self._step_t[0])
        self.grid = infer_token_grid(module, args, kwargs)

    def _on_captured_forward(self, module, args, kwargs) -> None:
        """The forward hook while a CUDA graph captures the step (``torch.cuda.graph``) or torch.compile traces
        it. Capture follows eager warm-up calls, whose step count and token grid stand: the graph records the
        attention path of the step being captured, and replays do not run this hook, so ``dense_steps`` cannot
        switch a replayed graph between dense and sparse (warned once). A compiled model counts steps inside its
        graph instead (``_count_step``; a Python counter would make it recompile at each step). Flux's
        grid comes from its img_ids on the GPU, which cannot be read here: the last eager call's grid is kept when
        its token count matches, else no permutation (with the usual warning)."""
        if self.dense_steps and compiling():
            self._count_step(kwargs.get("timestep"))
        elif self.dense_steps:
            self._warn_capture("dense_steps has no effect on CUDA-graph replays (the graph records the path of the "
                               "captured step); capture one graph for the dense steps and one for the rest")
        if type(module).__name__ == "FluxTransformer2DModel":
            hs = kwargs.get("hidden_states", args[0] if args else None)
            (t, h, w), _ = self.grid or ((0, 0, 0), None)
            if hs is None or t * h * w != hs.shape[1]:
                self.grid = None
        else:  # read from shapes only
            self.grid = infer_token_grid(module, args, kwargs)

    def _count_step(self, timestep: Any) -> None:
        """:meth:`_on_forward`'s step count (see there) as operations on CPU tensors, the same in eager calls and
        in a compiled graph (one read of the timestep per step): the count and the dense flag are updated in
        place, and every attention operator of the step reads the flag when it runs."""
        if isinstance(timestep, torch.Tensor) and timestep.numel():
            t = timestep.detach().flatten()[:1].to("cpu", torch.float64)
            last, direction = self._last_timestep_t, self._direction_t
            first = torch.isinf(last)  # no forward seen yet
            repeat = t == last  # the same step again (true CFG's second forward)
            moved = torch.sign(t - last)
            restart = ~first & ~repeat & (direction != 0) & (moved != direction)  # a new generation
            step = torch.where(restart, 1, torch.where(repeat, self._step_t, self._step_t + 1))
            self._direction_t.copy_(torch.where(restart | first, 0.0, torch.where(repeat, direction, moved)))
            self._step_t.copy_(step)
            self._last_timestep_t.copy_(t)
        else:
            self._step_t.add_(1)
        self._dense_now.copy_(self._step_t <= self.dense_steps)

    def _warn_capture(self, message: str) -> None:
        self._warn(f"SpargeProcessor: {message}")

    def _warn_once(self, reason: str, what: str = "attention") -> None:
        fallback = "native attention" if what == "attention" else "no token permutation"
        if self.strict:
            raise ValueError(f"SpargeProcessor: {reason}; strict=True forbids falling back to {fallback}")
        self._warn(f"SpargeProcessor: falling back to {fallback}: {reason}")

    def _warn(self, message: str) -> None:
        warn_once(message, self._warned, stacklevel=5)

    def fallback_reason(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                        attn_mask: torch.Tensor | None = None, dropout_p: float = 0.0,
                        is_causal: bool = False) -> str | None:
        """Why this SDPA call cannot run sparse (None when it can)."""
        if attn_mask is not None:
            return "an attention mask other than a boolean key-padding mask (the kernels take block masks only)"
        if dropout_p:
            return "dropout"
        return unsupported_reason(query, key, value, is_causal=is_causal)

    def sparse_attention_fn(self, settings: SpargeSettings, query: torch.Tensor, compiled: bool = False,
                            key: torch.Tensor | None = None) -> Callable[..., Any]:
        """sparge_attention (its custom operator when ``compiled``), wrapped in the layer's token permutation
        when it has one and the grid is known. Calls whose keys are other tokens than the queries (an IP-Adapter's
        image-prompt attention) run unpermuted: the permutation orders the layer's own tokens."""
        attention = sparge_attention_op if compiled else sparge_attention
        if settings.permutation is not None and (key is None or key.shape[2] == query.shape[2]):
            perm = self._permutation(settings.permutation, query.shape[2], query.device)
            if perm is not None:
                return permuted(attention, perm)
        return attention

    def _attention(self, layer, settings, sdpa, query, key, value, attn_mask=None, dropout_p=0.0,
                   is_causal=False, scale=None, enable_gqa=False):
        kept = None  # with a key-padding mask read eagerly: the keys each batch row attends to (_kept_keys)
        if attn_mask is not None and not is_causal and _is_key_padding_mask(attn_mask, query, key):
            reason = self.fallback_reason(query, key, value, None, dropout_p, is_causal)
            if not reason and settings.permutation is not None:
                reason = "a key-padding mask with a token permutation (which orders all of the layer's tokens)"
            if not reason and compiling():
                # an operator that reads the mask when it runs; no statistics under compile (as for every call)
                if self.collect_stats:
                    self._stats_missed = True
                return torch.ops.sparge_diffusers.key_padded_sparge_attention(
                    query, key, value, attn_mask, self._dense_now if self.dense_steps else None,
                    resolve_scale(scale, query.shape[-1]), _as_list(settings.simthreshd1, "simthreshd1"),
                    _as_list(settings.cdfthreshd, "cdfthreshd"), _as_list(settings.pvthreshd, "pvthreshd"))
            if not reason and _capturing():
                reason = "a key-padding mask during CUDA-graph capture (reading it back would break the capture)"
            if not reason:
                kept = _kept_keys(attn_mask)  # one read-back
                if kept is None:
                    reason = "a key-padding mask that hides every key of a batch row"
        else:
            reason = self.fallback_reason(query, key, value, attn_mask, dropout_p, is_causal)
        if reason:
            self._warn_once(reason)
            return sdpa(query, key, value, attn_mask=attn_mask, dropout_p=dropout_p, is_causal=is_causal,
                        scale=scale, enable_gqa=enable_gqa)
        thresholds = dict(is_causal=is_causal, scale=scale, simthreshd1=settings.simthreshd1,
                          cdfthreshd=settings.cdfthreshd, pvthreshd=settings.pvthreshd)
        compiled = compiling()
        attention = self.sparse_attention_fn(settings, query, compiled, key)
        if compiled:
            # one opaque node of the compiled graph; its outputs are reused buffers under CUDA graphs
            # (mode="reduce-overhead"), so no statistics: noted here, warned when they are read
            if self.collect_stats:
                self._stats_missed = True  # a write, never a read: no guard, no recompile
            # with dense warm-up steps the operator reads the step's flag at run time and runs SDPA while set
            return attention(query, key, value, dense=self._dense_now if self.dense_steps else None, **thresholds)
        collect = self.collect_stats
        if collect and _capturing():
            # a graph's tensors are overwritten by every replay: records taken here would all show the last one
            self._warn_capture("statistics are not recorded while a CUDA graph is captured (every replay would "
                               "overwrite them); read them from an eager step")
            collect = False
        if kept is not None:
            result = _attend_kept_keys(attention, query, key, value, kept, collect, thresholds)
        else:
            result = attention(query, key, value, return_sparsity=collect, **thresholds)
        if not collect:
            return result
        out, stats = result
        self._records.append((layer, self.step, stats))  # device tensors: read later, no sync per call
        return out

    def _permutation(self, order: str, seq_len: int, device: torch.device):
        """The permutation of this call's joint sequence, or None (with a one-time warning) if unknown."""
        if self.grid is None:
            self._warn_once("no token grid for permutation (use apply() or bind(); model not recognised)", "perm")
            return None
        (T, H, W), text_at = self.grid
        n_text = seq_len - T * H * W
        if n_text < 0:
            self._warn_once(f"sequence of {seq_len} tokens is shorter than the {T}x{H}x{W} grid", "perm")
            return None
        return visual_token_permutation((T, H, W), order, device=device, text_before=n_text if text_at == "before"
                                        else 0, text_after=n_text if text_at == "after" else 0)

    # The keyword parameters are spelled out on purpose: diffusers' attention modules pass a processor only
    # the keyword arguments its __call__ signature names, so a bare **kwargs would silently drop
    # image_rotary_emb (and rotary models would give wrong results) and the IP-Adapter arguments (image prompts
    # ignored). They are keyword-only so that a module calling its processor positionally (Wan: encoder states,
    # mask, rotary_emb) reaches the native processor with the same positions, whatever the native names them.
    def __call__(self, attn: torch.nn.Module, hidden_states: torch.Tensor, *args: Any,
                 encoder_hidden_states: torch.Tensor | None = None, attention_mask: torch.Tensor | None = None,
                 image_rotary_emb: Any = None, ip_hidden_states: Any = None, ip_adapter_masks: Any = None,
                 temb: torch.Tensor | None = None, **kwargs):
        by_position = ("encoder_hidden_states", "attention_mask")[:len(args)]  # diffusers' order after hidden_states
        for name, value in (("encoder_hidden_states", encoder_hidden_states), ("attention_mask", attention_mask)):
            if name not in by_position and (value is not None or not args):
                kwargs[name] = value
        if args:
            encoder_hidden_states = args[0]
        if image_rotary_emb is not None:
            kwargs["image_rotary_emb"] = image_rotary_emb
        native = self.native or self._natives.get(id(attn))
        if native is None:
            native = _native_processor(attn, encoder_hidden_states is None)
            if not compiling():  # kept only where a finalizer can be registered (compiled calls rebuild it)
                self._track(attn)
                self._natives[id(attn)] = native
        if not kwargs.keys() <= _OWN_PARAMETERS:
            # arguments named only by a widened signature (_accept_arguments_of): each native gets the ones it
            # names, as diffusers would have handed them to it
            kwargs = {k: v for k, v in kwargs.items() if k in _OWN_PARAMETERS or k in _call_parameters(native)}
        if ip_hidden_states is not None or ip_adapter_masks is not None or temb is not None:
            kwargs.update(_ip_adapter_arguments(native, attn, dict(ip_hidden_states=ip_hidden_states,
                                                                   ip_adapter_masks=ip_adapter_masks, temb=temb)))
        layer = self._names.get(id(attn))
        if layer is None:
            if self.layer_settings or self.dense_steps:  # these need the layer names and the step hook
                self._refuse_unbound_call(attn)
            layer = f"<unbound {type(attn).__name__} {id(attn):x}>"
        settings = self._layers.get(layer, self.settings)
        # compiling() first: a compiled region that read self.step would guard on it and recompile every step
        # (regional compilation: compile_repeated_blocks compiles the blocks, and the step hook runs eagerly)
        warm_up = self.dense_steps and not compiling() and self.step <= self.dense_steps
        if not self.enabled or settings.dense or warm_up:
            return native(attn, hidden_states, *args, **kwargs)
        seam = _SparseSDPA(self, layer, settings)
        with seam if compiling() else _sdpa_answered_by(seam):
            out = native(attn, hidden_states, *args, **kwargs)
        if not seam.answered:
            # e.g. Flux after set_attention_backend("flash"): dispatch_attention_fn then calls that backend, not
            # SDPA. Nothing is wrong with the output, but the layer ran dense: say so rather than stay silent.
            backend = getattr(native, "_attention_backend", None)
            self._warn_once(f"{type(native).__name__} made no F.scaled_dot_product_attention call"
                            + (f" (its attention backend is {getattr(backend, 'value', backend)!r})" if backend else "")
                            + "; the layer ran without sparse attention")
        return out

    @property
    def stats(self) -> list[dict]:
        """One record per sparse attention call: layer, step and the SparsityStats figures (eager calls with
        ``collect_stats`` on only)."""
        return self._stats_records(stacklevel=3)

    def _stats_records(self, stacklevel: int) -> list[dict]:
        """:attr:`stats`, warning where nothing was recorded; ``stacklevel`` 3 names the line that called the public
        method or property that called this one (the user's, not ours)."""
        if not self._records and not self.collect_stats:
            warnings.warn("SpargeProcessor: no statistics recorded: collection is off by default; set "
                          "collect_stats=True (or processor.collect_stats = True) before the run",
                          stacklevel=stacklevel)
        if self._stats_missed:
            warnings.warn("SpargeProcessor: calls made by a torch.compile'd model record no statistics; run a step "
                          "without torch.compile to read them", stacklevel=stacklevel)
        return [{"layer": layer, "step": step, **st.as_dict()} for layer, step, st in self._records]

    @property
    def recorded_calls(self) -> int:
        """How many sparse attention calls :attr:`stats` holds (read nothing back from the GPU)."""
        return len(self._records)

    def reset_stats(self) -> None:
        """Forget the recorded calls' statistics, e.g. between two generations measured separately."""
        self._records.clear()

    def sparsity_by_layer(self) -> dict[str, float]:
        """Mean sparsity of each layer over the recorded calls."""
        out: dict[str, list[float]] = {}
        for s in self._stats_records(stacklevel=3):
            out.setdefault(s["layer"], []).append(s["sparsity"])
        return {k: sum(v) / len(v) for k, v in out.items()}


_OWN_PARAMETERS = _named_parameters(SpargeProcessor.__call__)  # what SpargeProcessor's own signature names


def apply(pipe_or_transformer: Any, settings: SpargeSettings | None = None, **options: Any) -> SpargeProcessor:
    """Make a diffusers pipeline or transformer (Flux, SD3, CogVideoX, Mochi) use SpargeAttn.

    Sets one :class:`SpargeProcessor` on every attention module (through ``set_processor``, which also
    works for Mochi, whose transformer lacks ``set_attn_processor`` in diffusers 0.42), binds it to the
    model, and returns it: with ``collect_stats=True`` read ``.stats`` after a run; set ``.enabled = False`` to switch
    back to dense.
    ``options`` are SpargeProcessor's fields (layer_settings, dense_steps, strict, ...).
    """
    return install(pipe_or_transformer, SpargeProcessor(settings=settings or SpargeSettings(), **options))


def _forget_module(tables: tuple[dict, ...], tracked: set, key: int) -> None:
    """A dead module's entries (``SpargeProcessor._track``)."""
    for table in tables:
        table.pop(key, None)
    tracked.discard(key)


def install(pipe_or_transformer: Any, processor: SpargeProcessor) -> SpargeProcessor:
    """Set ``processor`` on every attention module of the model and bind it (``apply`` with a ready processor)."""
    transformer = getattr(pipe_or_transformer, "transformer", pipe_or_transformer)
    modules = [m for _, m in _attention_modules(transformer)]
    if not modules:
        raise ValueError(f"{type(transformer).__name__} has no attention modules with a processor")
    # A second processor would wrap the first as the layers' "native" one: the first would answer every call with
    # its own settings while the second saw none, and tune() would take the first's sparse output for exact
    earlier = installed_processor(transformer)
    if earlier is not None and earlier is not processor:
        raise ValueError(f"{type(transformer).__name__} already runs a SpargeProcessor (an earlier apply() or "
                         "set_attn_processor): call its .detach(transformer) first, or change its settings")
    processor.bind(transformer)  # checks the names first, so a refused settings file changes nothing
    for m in modules:
        native = m.processor
        if native is processor:
            continue
        processor._natives[id(m)] = native  # delegate to what the model had, whatever it was (IP-Adapters too)
        processor._accept_arguments_of(native)  # before set_processor: diffusers reads the signature per call
        _set_processor(m, processor)
        if isinstance(native, torch.nn.Module):  # set_processor unregistered it: keep its weights on the module
            m.add_module(_KEPT_NATIVE, native)
    return processor


def installed_processor(pipe_or_transformer: Any) -> SpargeProcessor | None:
    """The :class:`SpargeProcessor` the model's attention modules hold (from :func:`apply` or
    ``set_attn_processor``), or None."""
    transformer = getattr(pipe_or_transformer, "transformer", pipe_or_transformer)
    return next((m.processor for _, m in _attention_modules(transformer) if isinstance(m.processor, SpargeProcessor)),
                None)


def _set_processor(module: torch.nn.Module, processor: Any) -> None:
    setter = getattr(module, "set_processor", None)
    if setter is not None:
        setter(processor)
    else:  # MochiAttention in diffusers 0.42 has a processor attribute but no setter
        if not isinstance(processor, torch.nn.Module):
            module._modules.pop("processor", None)  # as set_processor does: a plain object cannot replace a child
        module.processor = processor


def _attention_modules(transformer: torch.nn.Module):
    """(name, module) of every attention module of the model: those that hold a callable ``processor``, IP-Adapter
    processors (modules with weights) included, the attention inside an IP-Adapter's image projection excluded."""
    return [(n, m) for n, m in transformer.named_modules()
            if callable(getattr(m, "processor", None)) and not n.startswith(_IP_ADAPTER_PROJECTIONS)]
