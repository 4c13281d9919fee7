"""Kernel launches with less host time than ``kernel[grid](...)``.

Why: an eager diffusion step calls attention once per layer, and at 1024px image sizes a call's host time is of
the order of its GPU time (benchmarks/host_time.py): a step whose host time exceeds its GPU time runs at the
host's pace. Per launch, ``JITFunction.run`` binds and specialises every argument, turns the options into a
string key, looks up the device and stream, checks the kernel's globals and builds launch metadata before it
calls the compiled kernel's launcher; on an H100 host that is 15-45 us per launch of ours, four per call.

:func:`launch` keeps, per kernel, the compiled kernel that each *launch key* ran and calls its launcher
directly, through ``CompiledKernel.run(grid_x, grid_y, grid_z, stream, function, packed_metadata,
launch_metadata, enter_hook, exit_hook, *args)`` (the entry point PyTorch's inductor calls too). Every launch
asks for FP fusion (``FP_FUSION``) unless it sets ``enable_fp_fusion``.

Correctness rests on the key being at least as fine as Triton's specialisation, so that one key never stands
for two kernels Triton would compile apart. Triton specialises tensors on dtype and 16-byte alignment, Python
scalars on type, value 1 and divisibility by 16, tensor descriptors on their block shape, layout and dtype; the
key holds each tensor's dtype and address modulo 128, each scalar's type and exact value, every field of a
descriptor but its base plus the base's dtype and address modulo 128, the launch options, Triton's debug and
instrumentation switches, and the device.
A key not seen before runs the normal path (which compiles, or finds Triton's cached kernel) and records the
kernel it returned. A key function is written per tuple of argument kinds (tensor, descriptor, value) and tried
first with the kinds of a kernel's first launch; a value where a tensor was keys on the object, and such a
launch takes the normal path unrecorded. The normal path also runs whenever launch hooks or pre-run hooks are set
(profilers), under the interpreter, and when ``ENABLED`` is False. Either path runs on the tensors' GPU: a launch
whose tensors live on another GPU than the current one first makes theirs current (see :func:`launch`). The
normal path runs a kernel that does not fit the GPU's shared memory with fewer pipeline stages
(:func:`launch_fitting`), and the key records the kernel that fit.

Used by the attention kernels and by the permutations' row gather; it knows neither.
"""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable

import torch

try:  # absent or renamed in other Triton versions: then every launch takes the normal path
    from triton import knobs as _knobs
    from triton.runtime.driver import driver as _driver
    from triton.runtime.jit import JITFunction as _JITFunction
except ImportError:  # pragma: no cover
    _knobs = _driver = _JITFunction = None
from triton.runtime.errors import OutOfResources  # (in every Triton since 2.x)

# Tests and benchmarks set this to False to compare with the normal path.
ENABLED = True
# Keys kept per kernel; past this the table is cleared (a workload uses a handful of shapes).
MAX_KEYS = 256
# Address bits in the key: Triton specialises on 16-byte alignment; 128 leaves room for a finer rule.
ADDRESS_BITS = 127
# Triton's pipeline depth on CUDA where a launch does not set num_stages.
DEFAULT_STAGES = 3
# FP fusion (FMA contraction), asked for by every launch that does not set it: every kernel here was tuned and
# checked with it, Triton's default through 3.9, whose first compile of each kernel warns that 3.10 turns it off.
# TRITON_FORCE_DISABLE_FP_FUSION still turns it off.
FP_FUSION = True


class _Kernel:
    """What :func:`launch` keeps per kernel: its parameters, its key function, and the compiled kernels by key."""

    def __init__(self, fn) -> None:
        self.fn = fn
        params = inspect.signature(fn.fn).parameters
        self.names = tuple(params)
        self.name_set = frozenset(self.names)
        self.defaults = {n: p.default for n, p in params.items() if p.default is not inspect.Parameter.empty}
        # one key function per tuple of argument kinds, numbered in the order met (the first launch's is 0)
        self.key_functions: dict[tuple[str, ...], tuple[int, Callable[..., tuple]]] = {}
        self.first: tuple[tuple[str, ...], int, Callable[..., tuple]] | None = None
        self.compiled: dict[tuple, tuple] = {}

    def key_function(self, kinds: tuple[str, ...]) -> tuple[int, Callable[..., tuple]]:
        found = self.key_functions.get(kinds)
        if found is None:
            found = self.key_functions[kinds] = (len(self.key_functions), _key_function(kinds))
        return found


_KERNELS: dict[int, _Kernel] = {}


def _kind(x) -> str:
    """How an argument enters the key: 'tensor', 'descriptor' or 'value' (hashable Python values)."""
    if isinstance(x, torch.Tensor):
        return "tensor"
    if hasattr(x, "base") and hasattr(x, "block_shape") and isinstance(getattr(x, "base"), torch.Tensor):
        return "descriptor"
    return "value"


def _frozen(x):
    return tuple(x) if isinstance(x, list) else x


def _descriptor_key(d) -> tuple:
    """Every field of a tensor descriptor but its base (lists as tuples), plus the base's dtype and alignment."""
    fields = tuple(_frozen(v) for name, v in vars(d).items() if name != "base")
    return (type(d), d.base.dtype, d.base.data_ptr() & ADDRESS_BITS) + fields


def _key_function(kinds: tuple[str, ...]) -> Callable[..., tuple]:
    """A function of the positional arguments returning the launch key, written out per argument kind (one
    expression each, no per-argument call: the key is computed on every launch)."""
    args = [f"a{i}" for i in range(len(kinds))]
    parts = []
    for a, kind in zip(args, kinds):
        if kind == "tensor":
            parts.append(f"{a}.dtype, {a}.data_ptr() & {ADDRESS_BITS}")
        elif kind == "descriptor":
            parts.append(f"_descriptor_key({a})")
        else:  # type and value: True and 1, or 1 and 1.0, differ in type
            parts.append(f"{a}.__class__, {a}")
    source = f"def launch_key({', '.join(args)}):\n    return ({', '.join(parts)},)\n"
    namespace = {"_descriptor_key": _descriptor_key}
    exec(source, namespace)
    return namespace["launch_key"]


def _no_hook(hook) -> bool:
    return hook is None or getattr(hook, "calls", None) == []  # Triton 3.9 holds an empty HookChain, 3.6 None


def _device_index(args: tuple) -> int | None:
    """The CUDA device of a launch's first tensor (or tensor descriptor) argument; None if it has none or it is
    on the CPU (the interpreter)."""
    for x in args:
        t = x if isinstance(x, torch.Tensor) else getattr(x, "base", None)
        if isinstance(t, torch.Tensor):
            index = t.get_device()  # -1 on the CPU; one call, cheaper than reading .is_cuda and .device
            return index if index >= 0 else None
    return None


def launch(fn, grid: tuple[int, ...], *args, **kwargs) -> None:
    """``fn[grid](*args, **kwargs)``, the compiled kernel's launcher called directly once this key has run.

    The kernel runs on its tensors' device, on that device's current stream, whichever device is current: Triton
    launches on the current device, so tensors on cuda:1 while cuda:0 is current would otherwise be read by a
    kernel on cuda:0's stream, unordered with the work that wrote them (PyTorch's own ops guard the device)."""
    kwargs.setdefault("enable_fp_fusion", FP_FUSION)
    target, device = _device_index(args), None
    if target is not None and _driver is not None:
        device = _driver.active.get_current_device()  # read once: the direct path below launches on it
        if target != device:
            with torch.cuda.device(target):
                launch(fn, grid, *args, **kwargs)
            return
    runtime: Any = _knobs.runtime if _knobs is not None else None  # None only with _JITFunction None too
    if not (ENABLED and _JITFunction is not None and isinstance(fn, _JITFunction) and not fn.pre_run_hooks
            and _no_hook(runtime.launch_enter_hook) and _no_hook(runtime.launch_exit_hook)):
        launch_fitting(fn, grid, args, kwargs)
        return
    state = _KERNELS.get(id(fn))  # by id: a JITFunction hashes its source on every lookup
    if state is None or state.fn is not fn:
        state = _KERNELS[id(fn)] = _Kernel(fn)
    bound = list(args)
    for name in state.names[len(args):]:
        bound.append(kwargs[name] if name in kwargs else state.defaults[name])
    # in the call's order: another order at another call site is only another key
    options = tuple([(k, v) for k, v in kwargs.items() if k not in state.name_set])
    if device is None:
        device = _driver.active.get_current_device()
    # Triton's compile switches, read from the environment at each launch as JITFunction.run reads them
    switches = (runtime.debug, getattr(_knobs.compilation, "instrumentation_mode", None))
    if state.first is None:
        kinds = tuple(_kind(x) for x in bound)
        state.first = (kinds, *state.key_function(kinds))
    kinds, number, key_of = state.first
    try:
        values = key_of(*bound)
    except (AttributeError, TypeError):  # an argument of another kind than the first launch's: its own function
        kinds = tuple(_kind(x) for x in bound)
        number, key_of = state.key_function(kinds)
        values = key_of(*bound)
    try:
        key = (device, switches, options, number, values)  # the number: keys of two functions never meet
        entry = state.compiled.get(key)
    except TypeError:  # an unhashable value
        key, entry = None, None
    if entry is not None and (not fn.used_global_vals or _globals_unchanged(fn)):
        run, function, packed_metadata = entry
        stream = _driver.active.get_current_stream(device)
        g = tuple(grid) + (1, 1)
        run(g[0], g[1], g[2], stream, function, packed_metadata, None, runtime.launch_enter_hook,
            runtime.launch_exit_hook, *bound)
        return
    kernel = launch_fitting(fn, grid, args, kwargs)
    # Recorded only for arguments of the kinds the key function was written for: its key then determines
    # every input of Triton's specialisation (a tensor where a scalar was would key on the object instead).
    if key is not None and kernel is not None and tuple(_kind(x) for x in bound) == kinds:
        if len(state.compiled) >= MAX_KEYS:
            state.compiled.clear()
        state.compiled[key] = (kernel.run, kernel.function, kernel.packed_metadata)


def launch_fitting(fn, grid: tuple[int, ...], args: tuple, kwargs: dict):
    """``fn[grid](*args, **kwargs)``, or, where the compiled kernel needs more shared memory per block than the GPU
    has, the same launch with fewer pipeline stages: one fewer at a time, down to one (then Triton's error).

    Why: our launch settings are tuned on an H100 (227 KB per block). GPUs with 99 KB (sm86, sm89, sm120: RTX
    3090/4090/5090, A10, L4, L40S) cannot run the attention kernel's 3-stage setting at head dims above 64: it
    compiles to 160 KB for sm89, its 2-stage setting to 96 KB (README, "Supported inputs"). A stage count says
    how many tiles' loads are in flight, not how any product is computed, so the output does not change (checked
    bitwise on an H100 by tests/test_shared_memory.py). Triton raises before the launch, so nothing ran; the
    kernel that fits is the one :func:`launch` records for the original key."""
    while True:
        try:
            return fn[grid](*args, **kwargs)
        except OutOfResources as error:
            stages = kwargs.get("num_stages", DEFAULT_STAGES)
            if error.name != "shared memory" or stages <= 1:
                raise
            kwargs = {**kwargs, "num_stages": stages - 1}


def interpreting() -> bool:
    """Whether Triton runs kernels in its interpreter (TRITON_INTERPRET set), where Gluon kernels and inline PTX do
    not run. Read as Triton reads it ("1", "true", "on", "yes" in any case; "false" or "2" are off), through its
    knobs where this Triton has them."""
    if _knobs is not None:
        return bool(_knobs.runtime.interpret)
    return os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on", "yes")  # pragma: no cover


def triton_launch_reason(device: torch.device) -> str | None:
    """Why this process cannot launch Triton kernels on tensors of ``device``, None where it can: compiled kernels
    run on CUDA tensors, the interpreter (TRITON_INTERPRET) on CPU tensors. CPU tensors without the interpreter are
    left to Triton where it has a driver: one set by hand compiles for a target without a GPU
    (benchmarks/shared_memory.py), and a GPU's refuses CPU pointers itself. Without one Triton's own error was
    "0 active drivers ([]). There should only be one." """
    interpret = interpreting()
    if device.type == ("cpu" if interpret else "cuda"):
        return None
    if interpret:
        return f"Triton's interpreter (TRITON_INTERPRET is set) runs on CPU tensors, got tensors on {device}"
    if device.type == "cpu" and _has_driver():
        return None
    return (f"the Triton kernels run on CUDA tensors (on CPU tensors only under TRITON_INTERPRET=1, Triton's "
            f"interpreter), got tensors on {device}")


def _has_driver() -> bool:
    """Whether Triton has an active driver (a GPU's, or one set by hand); it raises RuntimeError without one."""
    if _driver is None:  # pragma: no cover
        return True  # (this Triton's driver is not where we look: leave the launch to it)
    try:
        _driver.active
    except RuntimeError:
        return False
    return True


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host-side grid sizes. Triton (3.6 and 3.9) makes ``triton.cdiv`` and
    ``triton.next_power_of_2`` constexpr functions, whose calls from Python cost 2-3 us each on the H100 host
    (argument unwrapping; host-time-H100.txt, session 44); a sparge_attention call made nine."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """The smallest power of two >= n, for n >= 1 (as ``triton.next_power_of_2``, without its host cost)."""
    return 1 << (n - 1).bit_length()


def _globals_unchanged(fn) -> bool:
    """Triton's own check that the globals a kernel read at compile time still hold their values (it raises
    where they changed; the normal path then says so)."""
    missing = object()
    return all(g.get(name, missing) == val for (name, _), (val, g) in fn.used_global_vals.items())


_DESCRIPTOR_FIELDS: dict[tuple, dict] = {}
MAX_DESCRIPTOR_KEYS = 64


def tensor_descriptor(cls: type, t: torch.Tensor, block_shape: tuple[int, ...], build: Callable[[], Any]):
    """A ``cls`` descriptor of ``t`` (Triton's or Gluon's TensorDescriptor) with this box, made without
    building one per call.

    Building one validates every field (~13 us of host time on the H100 host). For given sizes, strides, dtype
    and box two descriptors differ only in their base, so ``build()`` runs once per such key, the fields but
    the base are kept (no tensor kept alive), and later calls copy them under ``t`` as base. The one
    base-dependent check, 16-byte alignment, is left to the callers, which make it before they take the
    descriptor path (attention.use_tma_io, attention_hopper.why_not_usable).
    """
    key = (cls, t.shape, t.stride(), t.dtype, block_shape)
    fields = _DESCRIPTOR_FIELDS.get(key)
    if fields is None:
        fields = {name: value for name, value in vars(build()).items() if name != "base"}
        if len(_DESCRIPTOR_FIELDS) >= MAX_DESCRIPTOR_KEYS:
            _DESCRIPTOR_FIELDS.clear()
        _DESCRIPTOR_FIELDS[key] = fields
    descriptor: Any = object.__new__(cls)
    descriptor.__dict__["base"] = t
    descriptor.__dict__.update(fields)
    return descriptor


def clear() -> None:
    """Forget every recorded kernel and descriptor (tests)."""
    _KERNELS.clear()
    _DESCRIPTOR_FIELDS.clear()
