"""The warp-specialised Gluon kernel for Hopper: when it is chosen, that it compiles for sm90 (CPU, offline
compile), and on an sm90 GPU that it matches the float32 reference and the Triton kernel."""

import ast
import math
import re
from pathlib import Path

import pytest
import torch

from sparge_diffusers import BLOCK_K, BLOCK_Q, _launch, block_sparse_attention, relative_l1
from sparge_diffusers.kernels import attention_hopper
from sparge_diffusers.kernels._inputs import causal_block_visible, check_attention_inputs

from test_kernels import (L1_TOL, check_no_key_past_the_last, keys_scoring_far_below_zero, make_qkv,
                          mask_keeping_the_last_key_block, poisoned_like)


def test_rule_names_why_the_hopper_kernel_cannot_run():
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    shape = check_attention_inputs(q, q, q, tensor_layout="HND", is_causal=False)
    reason = attention_hopper.why_not_usable(q, q, q, q, shape, pv_test=False)
    assert reason is not None  # CPU tensors (and, under the test suite, TRITON_INTERPRET)
    assert not attention_hopper.usable(q, q, q, q, shape, pv_test=False)


def test_forcing_the_hopper_kernel_where_it_cannot_run_raises(monkeypatch):
    monkeypatch.setattr(attention_hopper, "OVERRIDE", True)
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    shape = check_attention_inputs(q, q, q, tensor_layout="HND", is_causal=False)
    with pytest.raises(RuntimeError, match="forced but cannot run"):
        attention_hopper.usable(q, q, q, q, shape, pv_test=False)


def test_device_rule_names_the_first_thing_missing(monkeypatch):
    cpu = torch.device("cpu")
    if attention_hopper.GLUON_IMPORT_ERROR is None:  # Triton with Gluon: the interpreter, then the device
        assert "TRITON_INTERPRET" in attention_hopper._why_not_on(cpu)
        monkeypatch.setattr(attention_hopper, "interpreting", lambda: False)
        assert "sm90" in attention_hopper._why_not_on(cpu)
        cuda = torch.device("cuda", 0)  # a device object only: nothing runs on it
        older_or_newer = "needs an sm90 (Hopper) GPU"
        for capability, expected in (((9, 0), None), ((8, 0), older_or_newer), ((10, 0), older_or_newer)):
            monkeypatch.setattr(attention_hopper, "device_capability", lambda index, c=capability: c)
            assert attention_hopper._why_not_on(cuda) == expected, capability
    monkeypatch.setattr(attention_hopper, "GLUON_IMPORT_ERROR", "no gluon here")
    assert attention_hopper._why_not_on(cpu) == "Gluon unavailable (no gluon here)"


def test_rule_checks_what_tma_needs_once_the_device_allows(monkeypatch):
    """With the device check passed (as on an sm90 GPU), each of ``why_not_usable``'s other rules on CPU tensors."""
    monkeypatch.setattr(attention_hopper, "_why_not_on", lambda device: None)

    def reason(q, pv_test=False):
        shape = check_attention_inputs(q, q, q, tensor_layout="HND", is_causal=False)
        return attention_hopper.why_not_usable(q, q, q, q, shape, pv_test=pv_test)

    assert reason(torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)) is None
    assert reason(torch.zeros(1, 2, 256, 64, dtype=torch.float16)) is None
    assert reason(torch.zeros(1, 2, 256, 72, dtype=torch.bfloat16)[..., :64]) is None  # rows 144 bytes apart
    assert "stage-2" in reason(torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16), pv_test=True)
    assert "head dim 96" in reason(torch.zeros(1, 2, 256, 96, dtype=torch.bfloat16))
    rows_129_apart = torch.zeros(1, 2, 256, 129, dtype=torch.bfloat16)[..., :128]  # 258-byte row stride
    every_other_column = torch.zeros(1, 2, 256, 256, dtype=torch.bfloat16)[..., ::2]  # D stride 2
    off_by_one_element = torch.zeros(2 * 256 * 128 + 1, dtype=torch.bfloat16)[1:].view(1, 2, 256, 128)
    for view in (rows_129_apart, every_other_column, off_by_one_element):
        assert "TMA" in reason(view), view.stride()


def test_usable_takes_the_override_then_the_rules_then_the_preference(monkeypatch):
    """``usable`` with the device check passed (as on an sm90 GPU): OVERRIDE False forbids, True forces (over the
    Triton kernel's preference, raising where a rule refuses), None follows the rules and the preference."""
    monkeypatch.setattr(attention_hopper, "_why_not_on", lambda device: None)
    q64, q128 = (torch.zeros(1, 2, 256, d, dtype=torch.bfloat16) for d in (64, 128))

    def usable(q, **kw):
        shape = check_attention_inputs(q, q, q, tensor_layout="HND", is_causal=kw.get("is_causal", False))
        return attention_hopper.usable(q, q, q, q, shape, **kw)

    for override, masked, dense_d64, dense_d64_causal in ((None, True, False, True), (True, True, True, True),
                                                          (False, False, False, False)):
        monkeypatch.setattr(attention_hopper, "OVERRIDE", override)
        assert usable(q128, pv_test=False) is masked, override
        assert usable(q64, pv_test=False, dense=True) is dense_d64, override
        assert usable(q64, pv_test=False, dense=True, is_causal=True) is dense_d64_causal, override
    monkeypatch.setattr(attention_hopper, "OVERRIDE", None)
    assert usable(q128, pv_test=True) is False
    monkeypatch.setattr(attention_hopper, "OVERRIDE", True)
    with pytest.raises(RuntimeError, match="stage-2 test"):
        usable(q128, pv_test=True)


def test_triton_kernel_is_preferred_only_for_the_non_causal_dense_mode_at_d64():
    for D, dense, causal, expected in ((64, True, False, True), (64, True, True, False), (64, False, False, False),
                                       (128, True, False, False)):
        q = torch.zeros(1, 2, 256, D, dtype=torch.bfloat16)
        shape = check_attention_inputs(q, q, q, tensor_layout="HND", is_causal=causal)
        assert attention_hopper.prefer_triton(shape, dense, causal) == expected, (D, dense, causal)


def test_launcher_refuses_what_it_cannot_walk_and_hands_the_kernel_the_rest(monkeypatch):
    """The launch's host side on CPU tensors (the kernel itself needs an sm90 GPU): the calls it refuses, then the
    grid, arguments and flags it hands the kernel, recorded in place of the launch. The GPU tests see only outputs,
    and some of these (a sink or tail array passed where none was asked for) leave outputs alone."""
    launches = []
    monkeypatch.setattr(attention_hopper, "launch", lambda kernel, grid, *args, **kw: launches.append((grid, args, kw)))
    monkeypatch.setattr(attention_hopper, "_descriptor", lambda t, rows: (t, rows))
    monkeypatch.setattr(attention_hopper, "_sm_count", lambda device: 132)
    from sparge_diffusers.kernels.attention import block_mask_to_index

    q, k = torch.zeros(2, 4, 1000, 128, dtype=torch.bfloat16), torch.zeros(2, 2, 1000, 128, dtype=torch.bfloat16)
    out = torch.empty_like(q)

    def run(shape, **kw):
        attention_hopper.hopper_block_sparse_attention(q, k, k, out, shape, scale=0.5, **kw)
        grid, args, flags = launches.pop()
        assert not launches and [a[1] for a in args[:4]] == [BLOCK_Q, BLOCK_K, BLOCK_K, BLOCK_Q // 2]
        assert all(type(a[1]) is int for a in args[:4]) and all(a[0] is t for a, t in zip(args, (q, k, k, out)))
        ticket = args[7]
        assert ticket.dtype == torch.int32 and ticket.tolist() == [0]
        assert (args[18:27] == (4, 2, 8, 16, 1000, shape.causal_offset, shape.last_query_position,
                                shape.window_arg, 64))  # heads, group, blocks, lengths, window, 2 x 4 x 8 tiles
        assert all(type(a) is int for a in args[18:27])  # the kernel's integer arithmetic takes ints
        return grid, args, flags, ticket

    plain = check_attention_inputs(q, k, k, tensor_layout="HND", is_causal=False)
    causal = check_attention_inputs(q, k, k, tensor_layout="HND", is_causal=True)
    windowed = check_attention_inputs(q, k, k, tensor_layout="HND", is_causal=True, sliding_window=300)
    mask = torch.rand(2, 4, 8, 16, generator=torch.Generator().manual_seed(0)) < 0.5
    positions = torch.arange(2 * 2 * 1000, dtype=torch.int32).view(2, 2, 1000) % 1000
    with pytest.raises(ValueError, match="key_positions needs a causal call"):
        attention_hopper.hopper_block_sparse_attention(q, k, k, out, causal, scale=0.5, is_causal=True, index=None,
                                                       key_positions=positions)
    with pytest.raises(ValueError, match="key_positions needs a causal call"):
        attention_hopper.hopper_block_sparse_attention(q, k, k, out, plain, scale=0.5, is_causal=False,
                                                       index=block_mask_to_index(mask, plain, False),
                                                       key_positions=positions)
    with pytest.raises(ValueError, match="a sliding window needs"):
        attention_hopper.hopper_block_sparse_attention(q, k, k, out, windowed, scale=0.5, is_causal=True, index=None)
    other, _ = attention_hopper.new_tail_schedule(check_attention_inputs(q[:1], k[:1], k[:1], tensor_layout="HND",
                                                                        is_causal=True), q.device)
    with pytest.raises(ValueError, match=r"covers tickets 0\.\.31, this call has 64 tiles"):
        attention_hopper.hopper_block_sparse_attention(q, k, k, out, causal, scale=0.5, is_causal=True,
                                                       index=block_mask_to_index(mask, causal, True), tail=other)
    assert not launches

    # the dense mode: no index, tail, key positions, sinks or cap; the fresh counter stands in for each array
    grid, args, flags, ticket = run(plain, is_causal=False, index=None)
    assert grid == (64,)
    assert all(args[i] is ticket for i in (4, 5, 6, 8, 9, 10, 13)) and args[11:13] == (0, 0) and args[14] == 64
    assert args[15:18] == attention_hopper.softcap_args(0.5, None)
    assert flags["USE_INDEX"] is flags["USE_TAIL"] is flags["PERMUTED_KEYS"] is flags["WINDOWED"] is False
    assert flags["IS_CAUSAL"] is flags["HAS_SINKS"] is flags["SOFTCAP"] is False

    # a causal index with its tail order and key positions, on a given counter, with fewer SMs than tiles
    monkeypatch.setattr(attention_hopper, "_sm_count", lambda device: 16)
    tail, given = attention_hopper.new_tail_schedule(causal, q.device, with_counter=True)
    index = block_mask_to_index(mask, causal, True, tail=tail)
    grid, args, flags, ticket = run(causal, is_causal=True, index=index, tail=tail, ticket=given,
                                    key_positions=positions)
    assert grid == (16,) and ticket is given
    assert all(args[i] is a for i, a in zip((4, 5, 6, 8, 9, 10), (*index, tail.sizes, tail.tiles, positions)))
    assert args[11:13] == (2000, 1000) and args[14] == tail.start
    assert flags["USE_INDEX"] is flags["USE_TAIL"] is flags["PERMUTED_KEYS"] is flags["IS_CAUSAL"] is True

    # a window, sinks and a cap; then a tail without an index (the dense mode reads none)
    sinks = torch.zeros(4)
    grid, args, flags, ticket = run(windowed, is_causal=True, index=block_mask_to_index(mask, windowed, True),
                                    sink_logits=sinks, softcap=30.0)
    assert flags["WINDOWED"] is flags["HAS_SINKS"] is flags["SOFTCAP"] is True and args[13] is sinks
    assert args[15:18] == attention_hopper.softcap_args(0.5, 30.0)
    tail, _ = attention_hopper.new_tail_schedule(plain, q.device)
    grid, args, flags, ticket = run(plain, is_causal=False, index=None, tail=tail)
    assert flags["USE_TAIL"] is False and args[8] is args[9] is ticket and args[14] == 64


def test_a_compacted_mask_carries_a_tail_schedule_only_where_the_hopper_kernel_can_run(monkeypatch):
    from sparge_diffusers import compact_block_mask

    q = torch.zeros(1, 2, 300, 64, dtype=torch.bfloat16)
    shape = check_attention_inputs(q, q, q, tensor_layout="HND", is_causal=False)
    mask = torch.rand(1, 2, shape.q_blocks, shape.k_blocks, generator=torch.Generator().manual_seed(0)) < 0.5
    assert not attention_hopper.runs_on(q.device)
    assert compact_block_mask(mask, q, q, backend="triton").tail is None
    monkeypatch.setattr(attention_hopper, "_why_not_on", lambda device: None)  # as on an sm90 GPU
    assert attention_hopper.runs_on(q.device)
    tail = compact_block_mask(mask, q, q, backend="triton").tail
    assert tail is not None
    assert sorted(attention_hopper.tail_tickets(tail)) == list(range(tail.start, 2 * shape.q_blocks))
    # a head dim this kernel does not take: the Triton kernel runs the call and reads no schedule
    q96 = torch.zeros(1, 2, 300, 96, dtype=torch.bfloat16)
    assert compact_block_mask(mask, q96, q96, backend="triton").tail is None


def test_stage_1_fills_a_tail_schedule_only_where_the_hopper_kernel_can_run(monkeypatch):
    from sparge_diffusers.kernels import api

    g = torch.Generator().manual_seed(1)

    def predict(d):
        q = torch.randn(1, 2, 300, d, generator=g).to(torch.bfloat16)
        return api._predict(q, q, is_causal=False, scale=None, simthreshd1=0.6, cdfthreshd=0.98,
                            attention_sink=False, tensor_layout="HND", backend="triton")

    assert predict(64).tail is None
    monkeypatch.setattr(attention_hopper, "_why_not_on", lambda device: None)  # as on an sm90 GPU
    tail = predict(64).tail
    assert tail is not None
    assert sorted(attention_hopper.tail_tickets(tail)) == list(range(tail.start, 2 * 3))  # 2 heads x 3 q blocks
    assert predict(96).tail is None  # a head dim the Hopper kernel does not take


def descriptor_type(dtype: str, rows: int) -> str:
    """The signature string of a [1, 1, rows, PANEL]-box tensor descriptor, as the launchers build them."""
    from triton.experimental.gluon import language as gl

    gl_dtype = {"bf16": gl.bfloat16, "fp16": gl.float16}[dtype]
    layout = gl.NVMMASharedLayout.get_default_for([1, 1, rows, attention_hopper.PANEL], gl_dtype)
    return f"tensordesc<{dtype}[1,1,{rows},{attention_hopper.PANEL}],{layout!r}>"


# a reinterpret op's source type: its shape, and the allocation's shape where that differs
MEMDESC_REINTERPRET = re.compile(r"ttg\.memdesc_reinterpret %\S+ : "
                                 r"!ttg\.memdesc<([0-9x]+)x[a-z0-9]+, [^>]*?(?:, ([0-9x]+))?>")


def reinterpreted_subviews(ttgir: str) -> list[str]:
    """The reinterpret ops of ``ttgir`` whose source is a subview (a slice: its shape is not the trailing dims of
    the allocation it views). Triton 3.8 refuses them ("source and result must not be subviews"), so a kernel
    compiled by a Triton that takes them (3.6, 3.9) must not have any either."""
    found = []
    for match in MEMDESC_REINTERPRET.finditer(ttgir):
        shape = match.group(1).split("x")
        alloc = match.group(2).split("x") if match.group(2) else shape
        if alloc[-len(shape):] != shape:
            found.append(match.group(0))
    return found


def test_reinterpreted_subviews_are_found():
    view = "ttg.memdesc_reinterpret %17 : !ttg.memdesc<64x64xbf16, #shared1, #smem, mutable, 64x128>"
    whole = "ttg.memdesc_reinterpret %8 : !ttg.memdesc<64x128xbf16, #shared1, #smem, mutable, 3x64x128>"
    plain = "ttg.memdesc_reinterpret %8 : !ttg.memdesc<64x128xbf16, #shared1, #smem, mutable>"
    assert reinterpreted_subviews(view + " -> !ttg.memdesc<1x1x64x64xbf16, #shared, #smem, mutable>") == [view]
    assert reinterpreted_subviews(whole + " -> !ttg.memdesc<2x1x1x64x64xbf16, #shared, #smem, mutable>") == []
    assert reinterpreted_subviews(plain + " -> !ttg.memdesc<2x1x1x64x64xbf16, #shared, #smem, mutable>") == []


# PTX lines of a shared-memory store, a barrier that orders the lanes' memory operations, and an mbarrier arrive
PTX_SHARED_STORE = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:st\.shared|stmatrix\.[\w.]*shared)")
PTX_BARRIER = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:bar\.warp\.sync|bar\.sync|barrier\.sync|barrier\.cta\.sync)\b")
PTX_ARRIVE = re.compile(r"^\s*(?:@!?%p\d+\s+)?mbarrier\.arrive\b")


def _uses_left_open(ptx: str, opens: re.Pattern, closes: re.Pattern, uses: re.Pattern) -> list[tuple[int, int]]:
    """(line, use line) of each line matching ``uses`` whose nearest line matching ``opens`` before it (in the PTX's
    text) has no line matching ``closes`` between them."""
    found, opened = [], None
    for number, line in enumerate(ptx.splitlines(), 1):
        if opens.match(line):
            opened = number
        elif closes.match(line):
            opened = None
        elif uses.match(line) and opened is not None:
            found.append((opened, number))
    return found


def arrives_after_unordered_stores(ptx: str) -> list[tuple[int, int]]:
    """(store line, arrive line) of each mbarrier arrive whose nearest shared-memory store before it (in the PTX's
    text) has no barrier between them. One lane arrives, and its release covers its own stores only: the tile
    number every lane of a loader stores for its consumers (``_publish_tile``) is theirs to read only if a barrier
    (``bar.warp.sync`` at least) orders those stores before the arrive. compute-sanitizer's racecheck flags this
    handoff whatever the order (docs/testing.md, "Sanitizers on the GPU"); this checks the order. Triton 3.9 (the
    tests' pin) puts the barrier there itself; 3.6 left it out before ``mbarrier.expect``, which ``_publish_tile``'s
    own barrier now covers (without it, the offline compiles under 3.6 fail here)."""
    return _uses_left_open(ptx, PTX_SHARED_STORE, PTX_BARRIER, PTX_ARRIVE)


def test_arrives_after_unordered_stores_are_found():
    store = "\tst.shared.b32 \t[%r189+229712], %r2384;"
    stmatrix = "\tstmatrix.sync.aligned.m8n8.x4.shared.b16 [%r1], {%r2};"
    arrive = "\t@%p16 mbarrier.arrive.shared::cta.b64 _, [%r317];"
    expect = "\t@%p16 mbarrier.arrive.expect_tx.shared::cta.b64 _, [%r1], 8;"
    assert arrives_after_unordered_stores("\n".join([store, "\tadd.s32 %r1, %r2, 3;", arrive])) == [(1, 3)]
    assert arrives_after_unordered_stores("\n".join([stmatrix, expect])) == [(1, 2)]
    for barrier in ("\tbar.warp.sync \t-1;", "\tbar.sync \t0, 128;", "\tbarrier.sync \t1;"):
        assert arrives_after_unordered_stores("\n".join([store, barrier, arrive, expect])) == []
    assert arrives_after_unordered_stores("\n".join([arrive, store])) == []  # a store after the arrive: not its release


def test_publishing_a_tile_ends_with_a_warp_barrier():
    """The barrier that orders every lane's store of the tile number before the loader's arrive is the kernel's own:
    Triton 3.9 (the tests' pin) would insert one anyway, so the offline compiles here pass without it, while Triton
    3.6 (torch 2.11's) leaves it out before ``mbarrier.expect`` (docs/testing.md, "Sanitizers on the GPU")."""
    tree = ast.parse(Path(attention_hopper.__file__).read_text())
    publish = next(node for node in ast.walk(tree)
                   if isinstance(node, ast.FunctionDef) and node.name == "_publish_tile")
    last = publish.body[-1]
    assert isinstance(last, ast.Expr) and isinstance(last.value, ast.Call), ast.dump(last)
    assert ast.unparse(last.value.func) == "_partition_barrier", ast.unparse(last)
    assert ".store(" in ast.unparse(publish.body[-2])  # after the store, not before it


PTX_PROXY_FENCE = re.compile(r"^\s*fence\.proxy\.async\b")
PTX_TMA_STORE = re.compile(r"^\s*(?:@!?%p\d+\s+)?cp\.async\.bulk\.tensor\.\w+\.global\.shared")


def tma_stores_of_unfenced_data(ptx: str) -> list[tuple[int, int]]:
    """(store line, TMA store line) of each TMA store from shared memory whose nearest shared-memory store before it
    (in the PTX's text) is not followed by a proxy fence and then a barrier before it. The threads write the output
    tile through the generic proxy; the TMA unit reads it through the async proxy, which sees those writes only
    after ``fence.proxy.async`` (``fence_async_shared``), and the one thread that issues the copy sees the other
    threads' writes only after a barrier. Triton 3.9 inserts that fence itself; under 3.6 ours is the only one
    (without it, this finds every output store of both kernels unfenced)."""
    found, last_store, fenced = [], None, False
    for number, line in enumerate(ptx.splitlines(), 1):
        if PTX_SHARED_STORE.match(line):
            last_store, fenced = number, False
        elif PTX_PROXY_FENCE.match(line) and last_store is not None:
            fenced = True
        elif PTX_BARRIER.match(line) and fenced:
            last_store = None
        elif PTX_TMA_STORE.match(line) and last_store is not None:
            found.append((last_store, number))
    return found


def test_tma_stores_of_unfenced_data_are_found():
    store = "\tstmatrix.sync.aligned.m8n8.x4.shared.b16 [%r1], {%r2};"
    fence, barrier = "\tfence.proxy.async.shared::cta;", "\tbar.sync \t0, 128;"
    tma = "\t@%p230 cp.async.bulk.tensor.4d.global.shared::cta.bulk_group [%rd1, {%r2, %r3, %r4, %r5}], [%r6];"
    assert tma_stores_of_unfenced_data("\n".join([store, fence, barrier, tma, tma])) == []
    assert tma_stores_of_unfenced_data("\n".join([store, barrier, tma])) == [(1, 3)]  # no fence
    assert tma_stores_of_unfenced_data("\n".join([store, fence, tma])) == [(1, 3)]  # no barrier after it
    assert tma_stores_of_unfenced_data("\n".join([store, barrier, fence, tma])) == [(1, 4)]  # barrier first
    assert tma_stores_of_unfenced_data("\n".join([store, fence, barrier, store, tma])) == [(4, 5)]


PTX_WGMMA = re.compile(r"^\s*wgmma\.mma_async\b")
PTX_WGMMA_WAIT_ALL = re.compile(r"^\s*wgmma\.wait_group\.sync\.aligned\s+0\s*;")


def arrives_while_wgmma_reads(ptx: str) -> list[tuple[int, int]]:
    """(wgmma line, arrive line) of each mbarrier arrive with a warpgroup product issued before it (in the PTX's
    text) and not yet waited for (``wgmma.wait_group 0``). The product reads its operands from shared memory
    asynchronously; an arrive on a stage's (or Q buffer's) empty barrier while it may still read them lets the
    loader overwrite them under it."""
    return _uses_left_open(ptx, PTX_WGMMA, PTX_WGMMA_WAIT_ALL, PTX_ARRIVE)


def test_arrives_while_wgmma_reads_are_found():
    product = "\twgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%f1}, %rd1, %rd2, p, 1, 1, 1, 1;"
    wait_all, wait_one = "\twgmma.wait_group.sync.aligned 0;", "\twgmma.wait_group.sync.aligned 1;"
    arrive = "\t@%p239 mbarrier.arrive.shared::cta.b64 _, [%r2241];"
    assert arrives_while_wgmma_reads("\n".join([product, wait_all, arrive])) == []
    assert arrives_while_wgmma_reads("\n".join([product, arrive, wait_all])) == [(1, 2)]
    assert arrives_while_wgmma_reads("\n".join([product, wait_one, arrive])) == [(1, 3)]  # one may still run


def compile_gluon_offline(fn, sig: dict, consts: dict) -> None:
    """Compile a Gluon kernel of ours for sm90 without a GPU, as launched (``num_warps``, ``maxnreg``); run in a
    process without TRITON_INTERPRET (under the interpreter, gluon.jit makes functions that cannot be compiled)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    sig = dict(sig, **{name: "constexpr" for name in consts})
    sig = {name: sig[name] for name in fn.arg_names}
    src = GluonASTSource(fn, sig, constexprs={(fn.arg_names.index(k),): v for k, v in consts.items()})
    kernel = triton.compile(src, target=GPUTarget("cuda", 90, 32),
                            options={"num_warps": attention_hopper.NUM_WARPS, "maxnreg": attention_hopper.MAXNREG,
                                     "enable_fp_fusion": _launch.FP_FUSION})  # as every launch asks
    assert "warp_specialize" in kernel.asm["ttgir"]
    assert not reinterpreted_subviews(kernel.asm["ttgir"]), reinterpreted_subviews(kernel.asm["ttgir"])[:2]
    assert not arrives_after_unordered_stores(kernel.asm["ptx"]), arrives_after_unordered_stores(kernel.asm["ptx"])
    assert not tma_stores_of_unfenced_data(kernel.asm["ptx"]), tma_stores_of_unfenced_data(kernel.asm["ptx"])
    assert not arrives_while_wgmma_reads(kernel.asm["ptx"]), arrives_while_wgmma_reads(kernel.asm["ptx"])
    assert kernel.metadata.shared <= 232448, kernel.metadata.shared  # an H100's shared memory per block
    print("compiled", kernel.metadata.shared)


def compile_offline(causal: bool, use_index: bool, dtype: str, head_dim: int, use_tail: bool = False,
                    permuted_keys: bool = False, windowed: bool = False, sinks: str | None = None,
                    softcap: bool = False) -> None:
    """Compile the mask walk for sm90 without a GPU (``sinks``: the sink logits' element type, e.g. "bf16")."""
    sig = {"q_desc": descriptor_type(dtype, BLOCK_Q), "k_desc": descriptor_type(dtype, BLOCK_K),
           "v_desc": descriptor_type(dtype, BLOCK_K), "o_desc": descriptor_type(dtype, BLOCK_Q // 2),
           "INDEX": "*i32", "COUNT": "*i32", "NFULL": "*i32", "TICKET": "*i32", "TAIL_SIZES": "*i32",
           "TAIL_TILES": "*i32", "KPOS": "*i32", "SINKS": f"*{sinks or 'i32'}", "qk_scale": "fp32", "cap_in": "fp32",
           "cap_out": "fp32"}
    sig.update({name: "i32" for name in ("stride_pb", "stride_ph", "tail_start", "H", "GROUP", "NQ", "NK", "kv_len",
                                         "q_offset", "last_position", "window", "n_tiles")})
    consts = {"HEAD_DIM": head_dim, "STAGES": attention_hopper.STAGES, "USE_INDEX": use_index,
              "IS_CAUSAL": causal, "PERMUTED_KEYS": permuted_keys, "WINDOWED": windowed, "HAS_SINKS": sinks is not None,
              "SOFTCAP": softcap, "USE_TAIL": use_tail,
              "BUCKETS": attention_hopper.TAIL_BUCKETS, "NUM_WARPS": attention_hopper.NUM_WARPS,
              "CONSUMER_REGS": attention_hopper.CONSUMER_REGS}
    compile_gluon_offline(attention_hopper._hopper_attention_kernel, sig, consts)


def run_offline_compile(call: str) -> None:
    """Run ``call`` (a compile function of a test module, as source) in a fresh process without TRITON_INTERPRET;
    skip where Gluon cannot compile offline."""
    import os
    import subprocess
    import sys

    if attention_hopper.GLUON_IMPORT_ERROR is not None:
        pytest.skip(attention_hopper.GLUON_IMPORT_ERROR)
    try:
        from triton.experimental.gluon._runtime import GluonASTSource  # noqa: F401
    except ImportError as e:
        pytest.skip(f"this Triton has no offline Gluon compile: {e}")
    tests_dir = os.path.dirname(os.path.abspath(__file__))
    code = f"import sys; sys.path.insert(0, {tests_dir!r}); {call}"
    env = dict(os.environ, TRITON_INTERPRET="0")
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and "compiled" in run.stdout, run.stderr[-3000:]


@pytest.mark.parametrize("causal,use_index,dtype,head_dim,use_tail,permuted_keys,windowed,sinks,softcap",
                         [(False, True, "bf16", 128, True, False, False, None, False),
                          (True, False, "fp16", 64, False, False, False, "fp32", True),
                          (True, True, "bf16", 128, True, True, False, None, False),
                          (True, True, "fp16", 64, True, False, True, "bf16", True)])
def test_kernel_compiles_for_sm90_offline(causal, use_index, dtype, head_dim, use_tail, permuted_keys, windowed, sinks,
                                          softcap):
    """Catches Gluon compile errors without a GPU (needs a Triton whose Gluon compiles offline)."""
    run_offline_compile(f"import test_attention_hopper as t; t.compile_offline({causal}, {use_index}, {dtype!r}, "
                        f"{head_dim}, {use_tail}, {permuted_keys}, {windowed}, {sinks!r}, {softcap})")


@pytest.mark.parametrize("B,H,nq,nkv,width,causal", [(1, 24, 36, 4608, 264, False), (2, 3, 5, 300, 7, False),
                                                   (1, 2, 3, 100, 264, True), (2, 4, 50, 6400, 1, True),
                                                   (1, 3, 9, 40000, 20, False)])
def test_compaction_fills_the_tail_schedule_longest_first(B, H, nq, nkv, width, causal):
    """The compaction kernel (interpreter) puts each of the last ``width`` tickets' tiles in one count bucket,
    most kept blocks first; the kernel's ticket -> tile mapping (restated by tail_tickets) is then a
    permutation of the tail's tickets ordered by kept blocks up to a bucket's width."""
    from sparge_diffusers.kernels.attention import block_mask_to_index

    nq_len = nq * BLOCK_Q - 5
    if causal:
        nkv = nq_len
    shape = check_attention_inputs(torch.zeros(B, H, nq_len, 64), torch.zeros(B, H, nkv, 64), None,
                                   tensor_layout="HND", is_causal=causal)
    g = torch.Generator().manual_seed(B * 100 + nq)
    density = torch.rand(B, H, shape.q_blocks, 1, generator=g)  # rows of every length
    mask = torch.rand(B, H, shape.q_blocks, shape.k_blocks, generator=g) < density
    tail, counter = attention_hopper.new_tail_schedule(shape, torch.device("cpu"), width, with_counter=True)
    _, count, _ = block_mask_to_index(mask, shape, causal, tail=tail)
    n_tiles = B * H * shape.q_blocks
    assert tail.start == n_tiles - min(width, n_tiles) and counter.tolist() == [0]
    tiles = attention_hopper.tail_tickets(tail)
    assert sorted(tiles) == list(range(tail.start, n_tiles))  # a permutation of the tail's tickets
    nb, nk, nqb = attention_hopper.TAIL_BUCKETS, shape.k_blocks, shape.q_blocks
    # ticket t is (b*H + h, query block nqb-1-t%nqb): the kernel's _tile_of
    kept = [count.reshape(-1)[(t // nqb) * nqb + nqb - 1 - t % nqb].item() for t in tiles]
    buckets = [nb - 1 - min(c * nb // (nk + 1), nb - 1) for c in kept]
    assert buckets == sorted(buckets)  # bucket by bucket, most kept first
    assert all(ka > kb for ka, kb, ba, bb in zip(kept, kept[1:], buckets, buckets[1:]) if ba != bb)
    for bucket in set(buckets):  # a bucket spans at most its width of counts
        in_bucket = [c for c, b in zip(kept, buckets) if b == bucket]
        assert max(in_bucket) - min(in_bucket) <= nk // nb + 1


# B, H, HK, Nq, Nkv, causal: odd lengths, GQA, Nq != Nkv, shorter than one key block, several tiles per SM
GPU_CASES = [
    (1, 2, 2, 1000, 1000, False),
    (2, 4, 2, 777, 777, True),
    (1, 3, 1, 130, 2100, False),
    (1, 2, 2, 50, 50, True),
    (2, 8, 8, 4608, 4608, False),
    (1, 8, 2, 3000, 3000, True),
]


def _on_hopper():
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("the Gluon kernel needs an sm90 GPU")
    q = torch.zeros(1, 1, 128, 128, device="cuda", dtype=torch.bfloat16)
    shape = check_attention_inputs(q, q, q, tensor_layout="HND", is_causal=False)
    reason = attention_hopper.why_not_usable(q, q, q, q, shape, pv_test=False)
    if reason is not None:
        pytest.skip(reason)


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,HK,Nq,Nkv,causal", GPU_CASES)
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_hopper_kernel_matches_reference_and_writes_only_its_rows(B, H, HK, Nq, Nkv, causal, D, layout, dtype,
                                                                      monkeypatch):
    _on_hopper()
    q, k, v = (t.cuda() for t in make_qkv(B, H, HK, Nq, Nkv, D, dtype, layout, seed=Nq + Nkv + H + D))
    g = torch.Generator(device="cuda").manual_seed(Nq)
    mask = torch.rand(B, H, math.ceil(Nq / BLOCK_Q), math.ceil(Nkv / BLOCK_K), generator=g, device="cuda") < 0.3
    if mask.shape[2] > 1:
        mask[..., 1, :] = False  # a query block with no kept key block: zeros, never NaN
    seq_dim = 2 if layout == "HND" else 1
    launched = []  # the outputs are alike whichever kernel runs: count the Gluon kernel's launches
    run_hopper = attention_hopper.hopper_block_sparse_attention
    monkeypatch.setattr(attention_hopper, "hopper_block_sparse_attention",
                        lambda *a, **kw: launched.append(1) or run_hopper(*a, **kw))
    for block_mask in (mask, None):
        ref = block_sparse_attention(q.cpu(), k.cpu(), v.cpu(), None if block_mask is None else block_mask.cpu(),
                                     is_causal=causal, tensor_layout=layout, backend="reference")
        outs = []
        for forced in (True, False):  # the Gluon kernel, then the Triton kernel on the same call
            monkeypatch.setattr(attention_hopper, "OVERRIDE", forced)
            big = poisoned_like(torch.cat([q, q.narrow(seq_dim, 0, 7)], dim=seq_dim))
            launched.clear()
            out = block_sparse_attention(q, k, v, block_mask, is_causal=causal, tensor_layout=layout,
                                         out=big.narrow(seq_dim, 0, Nq))
            assert len(launched) == int(forced), "OVERRIDE True runs the Gluon kernel, False the Triton one"
            assert torch.isnan(big.narrow(seq_dim, Nq, 7)).all(), "rows past Nq were written"
            assert not torch.isnan(out).any()
            outs.append(out.cpu())
        assert relative_l1(outs[0], ref) < L1_TOL[dtype]
        assert relative_l1(outs[0], outs[1]) < L1_TOL[dtype] / 2


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,HK,Nq,Nkv,causal", GPU_CASES)
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_hopper_kernel_with_a_reordered_tail_gives_the_same_output(B, H, HK, Nq, Nkv, causal, D):
    """Each tile is computed the same way whichever program takes it: the tail order changes no bit. A
    narrow tail width also exercises tickets on both sides of its start."""
    _on_hopper()
    q, k, v = (t.cuda() for t in make_qkv(B, H, HK, Nq, Nkv, D, torch.bfloat16, "HND", seed=Nq + D))
    shape = check_attention_inputs(q, k, v, tensor_layout="HND", is_causal=causal)
    g = torch.Generator(device="cuda").manual_seed(Nq)
    mask = torch.rand(B, H, shape.q_blocks, shape.k_blocks, generator=g, device="cuda") < 0.4
    from sparge_diffusers.kernels.attention import block_mask_to_index
    outs = []
    for width in (0, None, 5):  # no tail order, two waves, 5 tickets
        tail = None if width == 0 else attention_hopper.new_tail_schedule(shape, q.device, width)[0]
        index = block_mask_to_index(mask, shape, causal, tail=tail)
        out = poisoned_like(q)
        attention_hopper.hopper_block_sparse_attention(q, k, v, out, shape, is_causal=causal, scale=D ** -0.5,
                                                       index=index, tail=tail)
        assert not torch.isnan(out).any()
        outs.append(out)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])


def _exactly_kept(shape, kept: int, causal: bool, g) -> torch.Tensor:
    """A mask keeping ``kept`` distinct key blocks per query block (fewer where fewer are visible), at random
    causally visible positions."""
    nq, nk = shape.q_blocks, shape.k_blocks
    device = g.device
    visible = (causal_block_visible(nq, nk, shape.kv_len, device) if causal
               else torch.ones(nq, nk, dtype=torch.bool, device=device))
    score = torch.rand(shape.batch, shape.heads, nq, nk, generator=g, device=device).masked_fill(~visible, 2.0)
    mask = torch.zeros(shape.batch, shape.heads, nq, nk, dtype=torch.bool, device=device)
    return mask.scatter_(-1, score.argsort(dim=-1)[..., :kept], True) & visible  # invisible blocks sort last


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,HK,Nq,Nkv,causal", [(1, 4, 2, 1000, 1000, False), (2, 4, 2, 777, 777, True),
                                                  (1, 8, 2, 3000, 3000, True)])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("kept", [1, 2, 3, 5])
def test_gpu_hopper_kernel_on_each_count_parity(B, H, HK, Nq, Nkv, causal, D, kept, monkeypatch):
    """Odd counts of 3 or more end on a 64-key stage, a count of 1 on a masked pair stage, even counts on pairs:
    each path against the reference and the Triton kernel, most tiles of the call on the path under test."""
    _on_hopper()
    q, k, v = (t.cuda() for t in make_qkv(B, H, HK, Nq, Nkv, D, torch.bfloat16, "HND", seed=Nq + D + kept))
    shape = check_attention_inputs(q, k, v, tensor_layout="HND", is_causal=causal)
    mask = _exactly_kept(shape, kept, causal, torch.Generator(device="cuda").manual_seed(Nq + kept))
    from sparge_diffusers.kernels.attention import block_mask_to_index
    index = block_mask_to_index(mask, shape, causal)
    assert (index[1] == kept).float().mean() > 0.5  # most tiles take the path under test
    _check_hopper_kernel_on_index(q, k, v, mask, index, shape, causal, monkeypatch)


def _check_hopper_kernel_on_index(q, k, v, mask, index, shape, causal, monkeypatch):
    """The Gluon kernel walking ``index`` (compacted from ``mask``) against the reference and the Triton kernel."""
    out = poisoned_like(q)
    attention_hopper.hopper_block_sparse_attention(q, k, v, out, shape, is_causal=causal,
                                                   scale=shape.head_dim ** -0.5, index=index)
    assert not torch.isnan(out).any()
    ref = block_sparse_attention(q.cpu(), k.cpu(), v.cpu(), mask.cpu(), is_causal=causal, backend="reference")
    monkeypatch.setattr(attention_hopper, "OVERRIDE", False)
    triton_out = block_sparse_attention(q, k, v, mask, is_causal=causal)
    assert relative_l1(out.cpu(), ref) < L1_TOL[torch.bfloat16]
    assert relative_l1(out, triton_out) < L1_TOL[torch.bfloat16] / 2


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,HK,Nq,Nkv", [(1, 4, 2, 1000, 1000), (2, 2, 1, 300, 100), (1, 3, 1, 130, 2100)])
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_hopper_kernel_on_rows_that_keep_every_key_block(B, H, HK, Nq, Nkv, D, monkeypatch):
    """Rows keeping all nk key blocks read their index to its last slot: the last pair stage at even nk (16 here)
    and, at nk = 2, the pair the loader holds a tile ahead; 33 ends on a single block. No random mask at the other
    tests' densities keeps a whole row: a kernel reading slot nk - 2 for nk - 1 there passed them all."""
    _on_hopper()
    q, k, v = (t.cuda() for t in make_qkv(B, H, HK, Nq, Nkv, D, torch.bfloat16, "HND", seed=Nq + Nkv + D))
    shape = check_attention_inputs(q, k, v, tensor_layout="HND", is_causal=False)
    mask = torch.ones(B, H, shape.q_blocks, shape.k_blocks, dtype=torch.bool, device="cuda")
    mask[:, 0, -1, 0] = False  # one row a block short: the other count parity next to the full rows
    from sparge_diffusers.kernels.attention import block_mask_to_index
    index = block_mask_to_index(mask, shape, False)
    assert (index[1] == shape.k_blocks).float().mean() > 0.5
    _check_hopper_kernel_on_index(q, k, v, mask, index, shape, False, monkeypatch)


@pytest.mark.gpu
@pytest.mark.parametrize("kept", [1, 2, 3, 5, None])  # None: the dense walk
@pytest.mark.parametrize("Nkv", [1000, 1025])  # last key blocks of 40 keys and of 1
@pytest.mark.parametrize("D", [64, 128])
def test_gpu_hopper_kernel_reads_no_key_past_the_last(kept, Nkv, D):
    """TMA fills rows past the keys' end with zeros. A stage whose mask let one such key through (``cols <= kv_len``
    in the pair stage or the 64-key stage) gave each row one extra key of score 0 and value 0, which on random
    inputs moves an output by 0.3-0.5% in relative L1 (under the bf16 tolerance): the Hopper sweep's mutants of both
    masks passed the GPU tests they ran against. Here every real score is about -2 sqrt(D), so that key would take
    nearly all of each row's weight. The last key block ends a masked pair alone (1 kept), as its second half (2),
    in the 64-key stage (3, 5), and the dense walk's last stage."""
    _on_hopper()
    q, k, v = keys_scoring_far_below_zero(2, 4, 2, 300, Nkv, D, device="cuda", seed=Nkv + D)
    shape = check_attention_inputs(q, k, v, tensor_layout="HND", is_causal=False)
    mask, index = None, None
    if kept is not None:
        mask = mask_keeping_the_last_key_block(shape, kept, torch.Generator(device="cuda").manual_seed(kept))
        from sparge_diffusers.kernels.attention import block_mask_to_index
        index = block_mask_to_index(mask, shape, False)
    out = poisoned_like(q)
    attention_hopper.hopper_block_sparse_attention(q, k, v, out, shape, is_causal=False, scale=D ** -0.5, index=index)
    check_no_key_past_the_last(q, k, v, mask, out)


@pytest.mark.gpu
def test_gpu_hopper_kernel_is_chosen_where_it_measured_faster():
    _on_hopper()
    # the Triton kernel keeps only the non-causal dense mode at D = 64
    for D, dense, causal, expected in ((128, True, False, True), (128, False, True, True), (64, False, False, True),
                                       (64, True, True, True), (64, True, False, False)):
        q = torch.zeros(1, 2, 256, D, device="cuda", dtype=torch.bfloat16)
        shape = check_attention_inputs(q, q, q, tensor_layout="HND", is_causal=causal)
        assert attention_hopper.usable(q, q, q, q, shape, pv_test=False, dense=dense, is_causal=causal) == expected, \
            (D, dense, causal)
        assert not attention_hopper.usable(q, q, q, q, shape, pv_test=True, dense=dense)  # stage 2: Triton
    q = torch.zeros(1, 2, 256, 96, device="cuda", dtype=torch.bfloat16)
    shape = check_attention_inputs(q, q, q, tensor_layout="HND", is_causal=False)
    assert not attention_hopper.usable(q, q, q, q, shape, pv_test=False)
