"""sparge_diffusers._launch: the direct launch path takes a recorded kernel only for a key it recorded, and the normal
path in every other case. CPU: a JITFunction whose normal path and compiled kernel are stubs; the GPU test runs
real kernels both ways and compares the outputs."""

from __future__ import annotations

import contextlib
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
    _launch.launch(fn, (7,), x, y, 5, 0.5, FLAG=True, num_warps=4)  # the grid is not in the key
    assert calls[-1][0] == "direct" and calls[-1][1][:3] == (7, 1, 1)  # a 1-D grid padded with ones too


def test_launches_ask_for_fp_fusion_unless_they_set_it(stub, monkeypatch):
    """Every kernel here was tuned and checked with FP fusion, Triton's default through 3.9 (3.9 warns that 3.10
    turns it off): each launch asks for it, on both paths, and a launch that sets it keeps its own value."""
    fn, calls = stub
    x, y = torch.zeros(8), torch.zeros(8)
    _launch.launch(fn, (1,), x, y, 5, 0.5, FLAG=True)
    _launch.launch(fn, (1,), x, y, 5, 0.5, FLAG=True, enable_fp_fusion=False)
    assert _paths(calls) == ["normal", "normal"]  # the option is part of the key
    assert calls[0][2]["enable_fp_fusion"] is True and calls[1][2]["enable_fp_fusion"] is False
    monkeypatch.setattr(_launch, "ENABLED", False)
    _launch.launch(fn, (1,), x, y, 5, 0.5, FLAG=True)
    assert calls[2][2]["enable_fp_fusion"] is True


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


def _refusing(calls, compiled, fits_from: int, resource: str = "shared memory"):
    """A normal path that refuses (as Triton does before a launch) every setting of more than ``fits_from``
    pipeline stages."""
    def normal_run(*args, grid, warmup, **kwargs):
        stages = kwargs.get("num_stages", _launch.DEFAULT_STAGES)
        calls.append(("normal", stages))
        if stages > fits_from:
            raise _launch.OutOfResources(stages * 32768, fits_from * 32768, resource)
        return compiled
    return normal_run


@pytest.mark.parametrize("options", [{"num_stages": 3}, {}])  # {}: Triton's default depth, 3
def test_a_kernel_that_does_not_fit_runs_with_fewer_stages_and_is_recorded_under_its_key(stub, monkeypatch,
                                                                                        options):
    fn, calls = stub
    monkeypatch.setattr(fn, "run", _refusing(calls, _Compiled(calls), fits_from=1))
    x = torch.zeros(8)
    for _ in range(2):
        _launch.launch(fn, (1,), x, x, 4, 1.0, FLAG=True, **options)
    assert [c[:2] for c in calls] == [("normal", 3), ("normal", 2), ("normal", 1), ("direct", calls[3][1])]
    monkeypatch.setattr(_launch, "ENABLED", False)  # the normal path alone retries the same way
    calls.clear()
    _launch.launch(fn, (1,), x, x, 4, 1.0, FLAG=True, **options)
    assert calls == [("normal", 3), ("normal", 2), ("normal", 1)]


@pytest.mark.parametrize("resource, fits_from", [("shared memory", 0), ("threads", 2)])
def test_other_refusals_and_one_stage_that_does_not_fit_raise_tritons_error(stub, monkeypatch, resource, fits_from):
    fn, calls = stub
    monkeypatch.setattr(fn, "run", _refusing(calls, _Compiled(calls), fits_from=fits_from, resource=resource))
    with pytest.raises(_launch.OutOfResources, match=resource):
        _launch.launch(fn, (1,), torch.zeros(8), torch.zeros(8), 4, 1.0, FLAG=True, num_stages=3)
    assert calls == ([("normal", 3), ("normal", 2), ("normal", 1)] if resource == "shared memory"
                     else [("normal", 3)])


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
    def desc(t, block=(1, 16), layout="swizzled"):
        return _Descriptor(t, [4, 16], [16, 1], list(block), layout)

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


class _OnCuda1(torch.Tensor):
    """A CPU tensor that says it lives on cuda:1 (what ``_device_index`` reads), for the CPU tests."""

    index = 1

    def get_device(self) -> int:
        return self.index


class _OnCuda0(_OnCuda1):
    index = 0


def test_launches_switch_to_their_tensors_device_and_back(stub, monkeypatch):
    fn, calls = stub
    current = [0]

    @contextlib.contextmanager
    def device(index):  # torch.cuda.device's effect on the driver's current device
        before, current[0] = current[0], index
        try:
            yield
        finally:
            current[0] = before

    seen = []

    def get_current_device():
        seen.append(current[0])
        return current[0]

    streams_of = []

    def get_current_stream(index):
        streams_of.append(index)
        return 1234

    monkeypatch.setattr(_Driver.active, "get_current_device", staticmethod(get_current_device))
    monkeypatch.setattr(_Driver.active, "get_current_stream", staticmethod(get_current_stream))
    monkeypatch.setattr(torch.cuda, "device", device)
    x = torch.zeros(8)._make_subclass(_OnCuda1, torch.zeros(8))
    for _ in range(2):
        _launch.launch(fn, (3,), x, x, 5, 0.5, FLAG=True)
    assert _paths(calls) == ["normal", "direct"]
    # per launch: the guard reads cuda:0 and switches; its second look reads cuda:1, which the launch then uses
    assert seen == [0, 1] * 2 and current == [0] and streams_of == [1]  # the direct launch: cuda:1's stream
    y = torch.zeros(8)
    for _ in range(2):  # CPU tensors: no switch (a normal launch, then a direct one on the current device)
        _launch.launch(fn, (3,), y, y, 5, 0.5, FLAG=True)
    assert current == [0] and seen[4:] == [0, 0] and streams_of == [1, 0]


def test_device_index_is_that_of_the_first_tensor_argument():
    cpu = torch.zeros(2)
    assert _launch._device_index((3, cpu, 0.5)) is None  # a CPU tensor (the interpreter): no device to guard
    assert _launch._device_index((3, 0.5)) is None
    assert _launch._device_index((3, cpu._make_subclass(_OnCuda1, cpu))) == 1
    # cuda:0 is a device like any other: None there would launch its tensors on whichever device is current
    assert _launch._device_index((cpu._make_subclass(_OnCuda0, cpu), cpu)) == 0

    class Descriptor:
        base = cpu._make_subclass(_OnCuda1, cpu)

    assert _launch._device_index((Descriptor(), cpu)) == 1


@pytest.mark.gpu
def test_kernels_run_on_their_tensors_device_whichever_is_current():
    """Inputs on cuda:1 while cuda:0 is current: every entry point's kernels run on cuda:1, on its current stream
    (ordered after the work that wrote the inputs, which a sleep holds back), and give the cuda:0 result."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs two CUDA GPUs")
    from sparge_diffusers import (block_sparse_attention, compact_block_mask, predict_block_mask, relative_l1,
                                  s2o_attention, select_key_blocks, selected_block_attention, sparge_attention)
    from sparge_diffusers.llm import pbs_sparge_attention
    from sparge_diffusers.testing import llm_like_qkv, video_like_qkv

    video = video_like_qkv((2, 24, 24), heads=4, head_dim=128, text_tokens=30, device="cuda:0", seed=1)
    video64 = tuple(t[..., :64].contiguous() for t in video)
    llm = llm_like_qkv(3000, heads=8, kv_heads=2, head_dim=128, device="cuda:0", seed=2)

    def fsa(q, k, v):
        return selected_block_attention(q, k, v, select_key_blocks(q, k, top_k=8), is_causal=True)

    calls = {
        "sparge (Hopper kernel on sm90)": (video, lambda q, k, v: sparge_attention(q, k, v)),
        "sparge, stage 2 (Triton kernel)": (video, lambda q, k, v: sparge_attention(q, k, v, pvthreshd=8)),
        "sparge D 64": (video64, lambda q, k, v: sparge_attention(q, k, v)),
        "dense mode": (video, lambda q, k, v: block_sparse_attention(q, k, v, None)),
        "prebuilt mask": (video, lambda q, k, v: block_sparse_attention(
            q, k, v, compact_block_mask(predict_block_mask(q, k), q, k))),
        "s2o": (video, lambda q, k, v: s2o_attention(q, k, v)),
        "causal sparge": (llm, lambda q, k, v: sparge_attention(q, k, v, is_causal=True)),
        "pbs": (llm, lambda q, k, v: pbs_sparge_attention(q, k, v)),
        "fsa": (llm, fsa),
    }
    for name, (inputs, call) in calls.items():
        expected = call(*inputs)
        with torch.cuda.device(0):
            with torch.cuda.device(1):
                torch.cuda._sleep(100_000_000)  # cuda:1's stream busy for ~50 ms before the inputs land
                moved = tuple(t.to("cuda:1", non_blocking=True) for t in inputs)
            got = call(*moved)
            assert torch.cuda.current_device() == 0, name
        assert got.device == torch.device("cuda:1"), name
        assert not torch.isnan(got).any() and relative_l1(got.to("cuda:0"), expected) < 1e-3, name


def test_host_grid_helpers_equal_tritons():
    # cdiv / next_power_of_2 stand in for Triton's (constexpr functions, 2-3 us per host call on the H100 host)
    import triton

    from sparge_diffusers._launch import cdiv, next_power_of_2

    for a in range(0, 700):
        for b in (1, 2, 3, 16, 64, 128, 129):
            assert cdiv(a, b) == triton.cdiv(a, b)
    for n in range(1, 5000):
        assert next_power_of_2(n) == triton.next_power_of_2(n)
