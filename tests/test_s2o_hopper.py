"""S2O's ordered walk on the Gluon kernel for Hopper: when it is chosen, that it compiles for sm90 (CPU, offline
compile), and on an sm90 GPU that it matches the Triton walk and the float32 reference, stops where they stop,
and writes every element."""

import pytest
import torch

from sparge_diffusers import BLOCK_K, BLOCK_Q, s2o_attention
from sparge_diffusers.kernels import attention_hopper, s2o_hopper
from sparge_diffusers.kernels._inputs import check_attention_inputs
from sparge_diffusers.kernels.s2o import CHECK_EVERY
from sparge_diffusers.testing import llm_like_qkv, video_like_qkv

from test_attention_hopper import compile_gluon_offline, descriptor_type, run_offline_compile
from test_kernels import L1_TOL, dense_reference, poisoned_like, relative_l1
from test_s2o import a_late_key_outscores_every_earlier_one, future_keys_outscore_the_past, one_dominant_key_block


def test_rule_names_why_the_walk_cannot_run(monkeypatch):
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    shape = check_attention_inputs(q, q, q, tensor_layout="HND", is_causal=False)
    kw = dict(pv_test=False, early_stop=True, check_every=16)
    assert s2o_hopper.why_not_usable(q, q, q, q, shape, **kw) is not None  # CPU tensors, the interpreter
    assert not s2o_hopper.usable(q, q, q, q, shape, **kw)
    monkeypatch.setattr(attention_hopper, "_why_not_on", lambda device: None)  # as on an sm90 GPU
    assert s2o_hopper.why_not_usable(q, q, q, q, shape, **kw) is None
    for every in (1, 2, 3, 5, 15):  # the stop test must fall between two 128-key stages, two or more apart
        assert "check_every" in s2o_hopper.why_not_usable(q, q, q, q, shape, **dict(kw, check_every=every))
        assert s2o_hopper.why_not_usable(q, q, q, q, shape, **dict(kw, check_every=every, early_stop=False)) is None
    for every in (4, 6, 16, CHECK_EVERY):  # even and >= 4: the walk runs, at the default too
        assert s2o_hopper.why_not_usable(q, q, q, q, shape, **dict(kw, check_every=every)) is None
    assert "stage-2" in s2o_hopper.why_not_usable(q, q, q, q, shape, **dict(kw, pv_test=True))
    q96 = torch.zeros(1, 2, 256, 96, dtype=torch.bfloat16)
    shape96 = check_attention_inputs(q96, q96, q96, tensor_layout="HND", is_causal=False)
    assert "head dim" in s2o_hopper.why_not_usable(q96, q96, q96, q96, shape96, **kw)


def test_forcing_the_walk_where_it_cannot_run_raises(monkeypatch):
    monkeypatch.setattr(s2o_hopper, "OVERRIDE", True)
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    shape = check_attention_inputs(q, q, q, tensor_layout="HND", is_causal=False)
    with pytest.raises(RuntimeError, match="forced but cannot run"):
        s2o_hopper.usable(q, q, q, q, shape, pv_test=False, early_stop=True, check_every=16)


def test_override_forbids_forces_or_leaves_the_choice(monkeypatch):
    """The tests compare this walk with the Triton walk by setting ``OVERRIDE``: False must keep this walk off even
    where it could run, or both sides of those comparisons would be this walk."""
    monkeypatch.setattr(attention_hopper, "_why_not_on", lambda device: None)  # as on an sm90 GPU
    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    shape = check_attention_inputs(q, q, q, tensor_layout="HND", is_causal=False)
    kw = dict(pv_test=False, early_stop=True, check_every=16)
    for override, expected in ((None, True), (False, False), (True, True)):
        monkeypatch.setattr(s2o_hopper, "OVERRIDE", override)
        assert s2o_hopper.usable(q, q, q, q, shape, **kw) is expected, override


def compile_offline(causal: bool, early_stop: bool, dtype: str, head_dim: int, return_counts: bool,
                    sinks: str | None = None) -> None:
    """Compile the ordered walk for sm90 without a GPU (``sinks``: the sink logits' element type, e.g. "bf16")."""
    sig = {"q_desc": descriptor_type(dtype, BLOCK_Q), "k_desc": descriptor_type(dtype, BLOCK_K),
           "v_desc": descriptor_type(dtype, BLOCK_K), "o_desc": descriptor_type(dtype, BLOCK_Q // 2),
           "INDEX": "*i32", "N_UNMASKED": "*i32", "N_FORCED": "*i32", "COUNT": "*i32", "TAU": "*fp32",
           "VISITED": "*i32", "TICKET": "*i32", "SINKS": f"*{sinks or 'i32'}", "qk_scale": "fp32"}
    sig.update({name: "i32" for name in ("H", "GROUP", "NQ", "NK", "q_len", "kv_len", "q_offset", "n_tiles")})
    consts = {"HEAD_DIM": head_dim, "STAGES": attention_hopper.STAGES, "IS_CAUSAL": causal, "EARLY_STOP": early_stop,
              "CHECK_STAGES": 8, "RETURN_COUNTS": return_counts, "HAS_SINKS": sinks is not None,
              "NUM_WARPS": attention_hopper.NUM_WARPS,
              "CONSUMER_REGS": attention_hopper.CONSUMER_REGS}
    compile_gluon_offline(s2o_hopper._hopper_ordered_kernel, sig, consts)


@pytest.mark.parametrize("causal,early_stop,dtype,head_dim,return_counts,sinks",
                         [(False, True, "bf16", 128, False, None), (True, True, "fp16", 64, True, "fp32"),
                          (True, False, "bf16", 128, True, "bf16")])
def test_walk_compiles_for_sm90_offline(causal, early_stop, dtype, head_dim, return_counts, sinks):
    """Catches Gluon compile errors without a GPU (needs a Triton whose Gluon compiles offline)."""
    run_offline_compile(f"import test_s2o_hopper as t; t.compile_offline({causal}, {early_stop}, {dtype!r}, "
                        f"{head_dim}, {return_counts}, {sinks!r})")


def _on_hopper():
    if not torch.cuda.is_available() or not attention_hopper.runs_on(torch.device("cuda")):
        pytest.skip("needs an sm90 GPU with Gluon")


def _structured(B, H, HK, Nq, Nkv, D, causal, dtype, layout, seed):
    """LLM-like inputs for causal calls (the last Nq queries: a lower-right chunk where Nq < Nkv), video-like
    ones otherwise (the first Nq queries and Nkv keys of one sequence). Views, as a caller's slices are."""
    seq = 2 if layout == "HND" else 1
    if causal:
        q, k, v = llm_like_qkv(Nkv, batch=B, heads=H, kv_heads=HK, head_dim=D, dtype=dtype, seed=seed,
                               tensor_layout=layout)
        return q.narrow(seq, Nkv - Nq, Nq), k, v
    q, k, v = video_like_qkv((1, 1, max(Nq, Nkv)), batch=B, heads=H, kv_heads=HK, head_dim=D, dtype=dtype, seed=seed,
                             tensor_layout=layout)
    return q.narrow(seq, 0, Nq), k.narrow(seq, 0, Nkv), v.narrow(seq, 0, Nkv)


# B, H, HK, Nq, Nkv, D, causal, segment, tau, check_every, simthreshd1, attention_sink
GPU_CASES = [
    (1, 4, 4, 1500, 1500, 128, False, 512, 0.01, 16, 0.6, False),
    (1, 4, 2, 1500, 1500, 128, True, 512, 0.01, 16, 0.6, False),
    (2, 3, 3, 777, 777, 64, False, 128, 0.02, 4, 0.3, False),
    (1, 2, 2, 50, 50, 128, True, 128, 0.0, 16, 0.6, False),  # shorter than one block
    (1, 2, 1, 1000, 1000, 64, True, 256, 0.05, 4, 0.3, True),
    (1, 4, 2, 400, 1300, 128, True, 256, 0.05, 4, -1.0, False),  # a lower-right chunk against a KV cache
    (2, 4, 2, 2500, 1999, 128, False, 512, 0.005, 8, 0.3, False),  # Nq != Nkv
    (1, 4, 4, 3000, 3000, 128, False, 512, None, 16, 0.6, False),  # no stop test
    (1, 4, 4, 3000, 3000, 128, False, 512, 0.2, 4, -1.0, False),  # most tiles stop early
    # 1024 tiles, about eight per program on 132 SMs (tiles go by ticket; at least one program takes eight): Q slots
    # turn over several times (at most two tiles per program above); no stop test, so no borderline stop parts the walks
    (1, 32, 8, 4096, 4096, 128, False, 512, None, 8, 0.6, False),
]


@pytest.mark.gpu
@pytest.mark.parametrize("B,H,HK,Nq,Nkv,D,causal,segment,tau,check_every,theta,sink", GPU_CASES)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_walk_matches_triton_walk_and_reference(B, H, HK, Nq, Nkv, D, causal, segment, tau, check_every, theta,
                                                    sink, layout, dtype, monkeypatch):
    _on_hopper()
    q, k, v = (t.cuda() for t in _structured(B, H, HK, Nq, Nkv, D, causal, dtype, layout, seed=Nq + Nkv + D))
    kw = dict(is_causal=causal, causal_variant="lower_right" if causal and Nq != Nkv else None, tau=tau,
              segment=segment, check_every=check_every, simthreshd1=theta, attention_sink=sink, tensor_layout=layout,
              return_sparsity=True)
    results = []
    for forced in (True, False):  # this walk, then the Triton walk on the same call
        monkeypatch.setattr(s2o_hopper, "OVERRIDE", forced)
        out = poisoned_like(q)
        result, stats = s2o_attention(q, k, v, out=out, **kw)
        assert result is out and not torch.isnan(out).any(), "every element written"
        results.append((out, stats))
    (out, stats), (triton_out, triton_stats) = results
    # the same stops (float32 rounding could move a borderline one; none of these cases has one)
    torch.testing.assert_close(stats.qk_skipped, triton_stats.qk_skipped, rtol=0, atol=0)
    assert relative_l1(out, triton_out) < L1_TOL[dtype] / 2
    if Nq * Nkv * H * B <= 10_000_000:  # the float32 reference walk on the CPU
        ref, ref_stats = s2o_attention(q.cpu(), k.cpu(), v.cpu(), backend="reference", **kw)
        assert relative_l1(out.cpu(), ref) < L1_TOL[dtype]
        torch.testing.assert_close(stats.qk_skipped.cpu(), ref_stats.qk_skipped, rtol=0, atol=0)
    if tau == 0.2:
        assert stats.sparsity > 0.5  # the stop path and its release of the stage issued after a check
    monkeypatch.setattr(s2o_hopper, "OVERRIDE", True)
    assert torch.equal(s2o_attention(q, k, v, **{**kw, "return_sparsity": False}), out)  # deterministic


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("n_key_blocks,tau,skipped", [(8, 0.0, 0.0), (6, 0.01, 2 / 6)])
def test_gpu_stop_test_where_later_tiles_add_exactly_nothing(n_key_blocks, tau, skipped, D, monkeypatch):
    """test_s2o's corners of the stop test, on this walk and the Triton one (check_every=4: two 128-key stages per
    check): at tau = 0 a stage that adds exactly 0 is no stop (the sum of gains >= tau * rows); and with six ranked
    blocks in three stages the check after the second stage, one before the last, stops the walk."""
    _on_hopper()
    q, k, v = (t.cuda() for t in one_dominant_key_block(n_key_blocks, head_dim=D))
    expected = dense_reference(q, k, v, False, "HND")
    for forced in (True, False):
        monkeypatch.setattr(s2o_hopper, "OVERRIDE", forced)
        out, stats = s2o_attention(q, k, v, tau=tau, check_every=4, simthreshd1=-1.0, return_sparsity=True,
                                   out=poisoned_like(q))
        torch.testing.assert_close(stats.qk_skipped.cpu(), torch.full((2,), skipped), rtol=0, atol=1e-6)
        assert relative_l1(out, expected) < L1_TOL[torch.bfloat16], forced


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("late_score", [160.0, 14.0])
def test_gpu_a_late_tile_that_outscores_every_earlier_one_is_a_large_gain(late_score, D, monkeypatch):
    """test_s2o's calls where block 3, ranked fourth, outscores every earlier key: the check after the second stage
    (blocks 2 and 3) sees l_before = l_new - (block 3's sum) = 0 exactly (late score 160: an infinite gain) or about
    1.6e-4 (14: a gain about 6300), so neither walk stops at tau = 100 (``before >= 0`` took the first as 1 and
    stopped with a stage left)."""
    _on_hopper()
    q, k, v = (t.cuda() for t in a_late_key_outscores_every_earlier_one(late_score, head_dim=D))
    expected = dense_reference(q, k, v, False, "HND")
    for forced in (True, False):
        monkeypatch.setattr(s2o_hopper, "OVERRIDE", forced)
        out, stats = s2o_attention(q, k, v, tau=100.0, check_every=4, simthreshd1=-1.0, return_sparsity=True,
                                   out=poisoned_like(q))
        torch.testing.assert_close(stats.qk_skipped.cpu(), torch.zeros(2), rtol=0, atol=0)
        assert relative_l1(out, expected) < L1_TOL[torch.bfloat16], forced


@pytest.mark.gpu
def test_gpu_walk_masks_a_stage_pairing_the_sink_with_the_diagonal(monkeypatch):
    """test_s2o's sink-and-diagonal call on this walk and the Triton one: each query block m >= 1 has one forced
    block seen whole (the sink) before its two diagonal ones, so its first stage pairs the sink with a diagonal
    block and must be masked (``first + 1 >= n_unmasked``); a future key outscores every visible one."""
    _on_hopper()
    q, k, v = (t.cuda() for t in future_keys_outscore_the_past(1000))
    expected = dense_reference(q, k, v, True, "HND")
    for forced in (True, False):
        monkeypatch.setattr(s2o_hopper, "OVERRIDE", forced)
        out = s2o_attention(q, k, v, is_causal=True, attention_sink=True, segment=128, simthreshd1=-1.0, tau=None,
                            out=poisoned_like(q))
        assert relative_l1(out, expected) < L1_TOL[torch.bfloat16], forced


@pytest.mark.gpu
def test_gpu_s2o_attention_takes_this_walk_where_it_can(monkeypatch):
    _on_hopper()
    calls = []
    original = s2o_hopper.hopper_ordered_attention
    monkeypatch.setattr(s2o_hopper, "hopper_ordered_attention", lambda *a, **kw: calls.append(kw) or original(*a, **kw))
    q, k, v = (t.cuda() for t in _structured(1, 2, 2, 600, 600, 128, False, torch.bfloat16, "HND", seed=1))
    s2o_attention(q, k, v)  # defaults: tau 0.0005, every 16 ranked tiles, stage 2 off
    assert len(calls) == 1
    s2o_attention(q, k, v, check_every=3)  # a test inside a stage: the Triton walk
    s2o_attention(q, k, v, pvthreshd=4.0)  # stage 2's P.V test: the Triton walk
    assert len(calls) == 1
