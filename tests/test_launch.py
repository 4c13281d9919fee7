"""sparge_diffusers._launch: the direct launch path takes a recorded kernel only for a key it recorded, and the normal
path in every other case. CPU: a JITFunction whose normal path and compiled kernel are stubs; the GPU test runs
real kernels both ways and compares the outputs."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from triton.runtime.jit import JITFunction

from sparge_diffusers import _launch


def _kernel_source(X, Y, n, scale, FLAG, BLOCK=16):  # the parameters are what matter here
    pass


class _Compiled:
    """Stands in for a CompiledKernel: records what its launcher was called with."""

    def __init__(self, calls):
        self.calls, self.function, self.packed_metadata = calls, "function", "metadata"

    def run(self, *args):
        self.calls.append(("direct", args))


class _Driver:
    class active:
        @staticmethod
        def get_current_device():
            return 0

        @staticmethod
        def get_current_stream(device):
            return 1234


@pytest.fixture()
def stub(monkeypatch):
    """(fn, calls): a JITFunction whose normal path records ('normal', args, kwargs) and returns a stub kernel."""
    fn = JITFunction(_kernel_source)
    calls = []
    compiled = _Compiled(calls)

    def normal_run(*args, grid, warmup, **kwargs):
        calls.append(("normal", args, kwargs))
        return compiled

    monkeypatch.setattr(fn, "run", normal_run)
    monkeypatch.setattr(_launch, "_driver", _Driver)
    monkeypatch.setattr(_launch, "ENABLED", True)
    _launch.clear()
    yield fn, calls
    _launch.clear()


def _paths(calls):
    return [c[0] for c in calls]


def test_second_launch_is_direct_with_every_argument_in_order(stub):
    fn, calls = stub
    x, y = torch.zeros(8), torch.zeros(8)
    for _ in range(2):
        _launch.launch(fn, (3, 2), x, y, 5, 0.5, FLAG=True, num_warps=4)
    assert _paths(calls) == ["normal", "direct"]
    _, args = calls[1]
    assert args[:4] == (3, 2, 1, 1234)  # grid padded to 3-D, the current stream
    assert args[4:7] == ("function", "metadata", None)
    assert args[9:] == (x, y, 5, 0.5, True, 16)  # the default of BLOCK filled in, in signature order


@pytest.mark.parametrize("change", ["dtype", "alignment", "int value", "bool for int", "float value", "constexpr",
                                    "option", "debug switch"])
def test_a_changed_key_takes_the_normal_path(stub, change, monkeypatch):
    fn, calls = stub
    base = torch.zeros(64)
    args = dict(X=base[:32], Y=torch.zeros(8), n=16, scale=0.5, FLAG=True, num_warps=4)
    _launch.launch(fn, (1,), **args)
    changed = dict(args)
    if change == "dtype":
        changed["X"] = base[:32].half()
    elif change == "alignment":
        changed["X"] = base[1:33]  # 4 bytes off: Triton specialises on 16-byte alignment
    elif change == "int value":
        changed["n"] = 17
    elif change == "bool for int":
        changed["n"] = True
    elif change == "float value":
        changed["scale"] = 0.25
    elif change == "constexpr":
        changed["FLAG"] = False
    elif change == "option":
        changed["num_warps"] = 8
    else:
        monkeypatch.setattr(_launch._knobs.runtime, "debug", not _launch._knobs.runtime.debug)
    _launch.launch(fn, (1,), **changed)
    _launch.launch(fn, (1,), **changed)
    assert _paths(calls) == ["normal", "normal", "direct"]


def test_arguments_of_other_kinds_get_their_own_keys_or_none(stub):
    fn, calls = stub
    x = torch.zeros(8)
    _launch.launch(fn, (1,), x, x, 4, 1.0, FLAG=True)
    for _ in range(2):  # a tensor where an int was: it would key on the object, so it is never recorded
        _launch.launch(fn, (1,), x, x, x, 1.0, FLAG=True)
    for _ in range(2):  # an int where a tensor was: a key function of its own kinds, recorded
        _launch.launch(fn, (1,), 3, x, 4, 1.0, FLAG=True)
    _launch.launch(fn, (1,), x, x, 4, 1.0, FLAG=True)  # the first kinds still hit
    assert _paths(calls) == ["normal"] * 4 + ["direct", "direct"]
    state = _launch._KERNELS[id(fn)]
    assert len(state.compiled) == 2 and len(state.key_functions) == 2


def test_hooks_disabled_and_changed_globals_take_the_normal_path(stub, monkeypatch):
    fn, calls = stub
    x = torch.zeros(8)
    go = lambda: _launch.launch(fn, (1,), x, x, 4, 1.0, FLAG=True)  # noqa: E731
    go()
    go()
    assert _paths(calls) == ["normal", "direct"]
    monkeypatch.setattr(_launch, "ENABLED", False)
    go()
    monkeypatch.setattr(_launch, "ENABLED", True)
    hook = _launch._knobs.runtime.launch_enter_hook
    monkeypatch.setattr(_launch._knobs.runtime, "launch_enter_hook", lambda metadata: None)
    go()
    monkeypatch.setattr(_launch._knobs.runtime, "launch_enter_hook", hook)
    namespace = {"LIMIT": 1}
    monkeypatch.setattr(fn, "used_global_vals", {("LIMIT", id(namespace)): (1, namespace)})
    go()
    namespace["LIMIT"] = 2
    go()
    assert _paths(calls) == ["normal", "direct", "normal", "normal", "direct", "normal"]


@dataclasses.dataclass
class _Descriptor:
    base: torch.Tensor
    shape: list
    strides: list
    block_shape: list
    layout: str = "swizzled"


def test_descriptors_key_on_every_field_but_the_base(stub):
    fn, calls = stub
    store = torch.zeros(256)
    x, other = store[:64], store[128:192]  # 512 bytes apart: one alignment class
    desc = lambda t, block=(1, 16), layout="swizzled": _Descriptor(t, [4, 16], [16, 1], list(block), layout)  # noqa: E731,E501
    _launch.launch(fn, (1,), desc(x), x, 4, 1.0, FLAG=True)
    _launch.launch(fn, (1,), desc(other), x, 4, 1.0, FLAG=True)  # another base of the same kind: direct
    _launch.launch(fn, (1,), desc(x, block=(2, 16)), x, 4, 1.0, FLAG=True)
    _launch.launch(fn, (1,), desc(x, layout="other"), x, 4, 1.0, FLAG=True)
    _launch.launch(fn, (1,), desc(x.half()), x, 4, 1.0, FLAG=True)
    assert _paths(calls) == ["normal", "direct", "normal", "normal", "normal"]


def test_the_table_is_bounded(stub, monkeypatch):
    fn, calls = stub
    monkeypatch.setattr(_launch, "MAX_KEYS", 4)
    x = torch.zeros(8)
    for n in range(10):
        _launch.launch(fn, (1,), x, x, n, 1.0, FLAG=True)
    assert len(_launch._KERNELS[id(fn)].compiled) <= 4


@pytest.mark.gpu
@pytest.mark.parametrize("head_dim", [64, 128])
def test_direct_launches_equal_normal_ones_on_the_gpu(monkeypatch, head_dim):
    """Every kernel of the sparse, dense and S2O calls through both paths, on aligned and misaligned views:
    equal outputs and statistics."""
    from sparge_diffusers import block_sparse_attention, s2o_attention, sparge_attention
    from sparge_diffusers.testing import video_like_qkv

    q, k, v = video_like_qkv((4, 8, 12), heads=4, head_dim=head_dim, text_tokens=7, device="cuda", seed=3)
    store = torch.empty(q.numel() + 9, device="cuda", dtype=q.dtype)
    shifted_16 = store[8:-1].view_as(q).copy_(q)  # the same values 16 bytes further: aligned alike for Triton
    shifted_2 = store[1:-8].view_as(q).copy_(q)  # 2 bytes further: not 16-byte aligned (and no TMA)
    calls = {
        "sparge": lambda query: sparge_attention(query, k, v, return_sparsity=True),
        "sparge stage 2": lambda query: sparge_attention(query, k, v, pvthreshd=8, return_sparsity=True),
        "dense": lambda query: (block_sparse_attention(query, k, v, None), None),
        "s2o": lambda query: s2o_attention(query, k, v, return_sparsity=True),
    }
    results = {}
    for enabled in (False, True, True):
        monkeypatch.setattr(_launch, "ENABLED", enabled)
        for name, call in calls.items():
            for alignment, query in (("aligned", q), ("16 bytes on", shifted_16), ("2 bytes on", shifted_2)):
                out, stats = call(query)
                results.setdefault((name, alignment), []).append((out, None if stats is None else stats.qk_skipped))
    for runs in results.values():
        for out, skipped in runs[1:]:
            torch.testing.assert_close(out, runs[0][0], rtol=0, atol=0)
            if skipped is not None:
                torch.testing.assert_close(skipped, runs[0][1], rtol=0, atol=0)
    assert sum(len(state.compiled) for state in _launch._KERNELS.values()) >= 5


def test_descriptors_from_cached_fields_equal_built_ones_and_keep_no_tensor():
    import gc
    import weakref

    from triton.tools.tensor_descriptor import TensorDescriptor

    _launch.clear()

    def made(t):
        box = (1, 1, 16, t.shape[-1])
        return _launch.tensor_descriptor(TensorDescriptor, t, box, lambda: TensorDescriptor(
            t, list(t.shape), list(t.stride()), list(box)))

    first = torch.randn(2, 3, 40, 64)
    alive = weakref.ref(first)
    made(first)
    del first
    gc.collect()
    assert alive() is None, "the cache keeps no tensor alive"
    for t in (torch.randn(2, 3, 40, 64), torch.randn(2, 40, 3, 64).transpose(1, 2)):
        got = made(t)
        want = TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, 16, 64])
        assert got.base is t and vars(got) == vars(want)
    assert len(_launch._DESCRIPTOR_FIELDS) == 2  # one per (shape, strides, dtype, box)
    _launch.clear()
