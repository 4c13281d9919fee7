"""Triton kernels (interpreter on CPU) against the float32 reference, and the public API's contracts."""

import math

import pytest
import torch
import torch.nn.functional as F

from sparge_diffusers import BLOCK_K, BLOCK_Q, block_sparse_attention, predict_block_mask, relative_l1
from sparge_diffusers import compact_block_mask, s2o_attention, sparge_attention
from sparge_diffusers.kernels._inputs import causal_offset, check_attention_inputs
from sparge_diffusers.kernels.predict import block_statistics_triton, qk_block_statistics_triton
from sparge_diffusers.kernels.reference import reference_block_statistics, reference_prediction_details
from sparge_diffusers.testing import llm_like_qkv, video_like_qkv

# bf16 keeps 8 mantissa bits: rounding the output alone gives a relative L1 of about 2e-3 to 5e-3.
L1_TOL = {torch.bfloat16: 1.2e-2, torch.float16: 2e-3}


def make_qkv(B, H, HK, Nq, Nkv, D, dtype, layout, seed):
    g = torch.Generator().manual_seed(seed)

    def rnd(h, n):
        x = torch.randn(B, h, n, D, generator=g).to(dtype)
        return x if layout == "HND" else x.transpose(1, 2).contiguous()

    return rnd(H, Nq), rnd(HK, Nkv), rnd(HK, Nkv)


def dense_reference(q, k, v, is_causal, layout):
    if layout == "NHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    g = q.shape[1] // k.shape[1]
    out = F.scaled_dot_product_attention(q.float(), k.float().repeat_interleave(g, 1),
                                         v.float().repeat_interleave(g, 1), is_causal=is_causal)
    return out if layout == "HND" else out.transpose(1, 2)


def exact_attention(q, k, v, allowed, scale=None, sinks=None, softcap=None, dtype=torch.float32):
    """Attention by its definition, in ``dtype``, of (B, H, N, D) inputs with grouped K/V heads: scores
    scale * q . k, soft-capped to softcap * tanh(s / softcap) where given, hidden where ``allowed`` is False, learned
    ``sinks`` (one logit per query head) as one more column dropped after the softmax; rows that see no key (and
    have no sink) are zero."""
    group = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    k, v = (t.to(dtype).repeat_interleave(group, 1) for t in (k, v))
    scores = (q.to(dtype) @ k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        scores = torch.cat([scores, sinks.to(dtype).view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    return probs[..., :k.shape[2]] @ v


def poisoned_like(q):
    return torch.full_like(q, float("nan"))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("N,D,block", [(200, 64, BLOCK_Q), (77, 128, BLOCK_K), (64, 72, BLOCK_K), (5, 64, BLOCK_Q)])
def test_block_statistics_match_reference(layout, N, D, block):
    q, _, _ = make_qkv(2, 3, 3, N, N, D, torch.bfloat16, layout, seed=N + D)
    qh = q if layout == "HND" else q.transpose(1, 2)
    means, sim = block_statistics_triton(qh, block)
    ref_means, ref_sim = reference_block_statistics(qh, block)
    torch.testing.assert_close(means, ref_means, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(sim, ref_sim, atol=1e-5, rtol=1e-4)
    # a block of identical tokens has similarity 1, and small ones (norms about 0.1) too: cosines ignore scale
    for scale in (1.0, 0.01):
        same = torch.full((1, 1, 2 * block, D), scale, dtype=torch.bfloat16)
        for statistics in (block_statistics_triton, reference_block_statistics):
            assert torch.allclose(statistics(same, block)[1], torch.ones(1, 1, 2))


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("B,H,HK,Nq,Nkv,D", [(2, 4, 2, 200, 77, 64), (1, 3, 1, 5, 300, 128), (1, 2, 2, 129, 65, 72)])
def test_qk_block_statistics_in_one_launch_match_reference(layout, B, H, HK, Nq, Nkv, D, monkeypatch):
    """Q's and K's statistics from the one launch stage 1 makes: GQA, N_q != N_kv, odd and sub-block lengths,
    strided (NHD) views, every output written (the launcher's allocations are NaN-poisoned)."""
    q, k, _ = make_qkv(B, H, HK, Nq, Nkv, D, torch.float16, layout, seed=Nq + Nkv)
    qh, kh = (t if layout == "HND" else t.transpose(1, 2) for t in (q, k))
    empty = torch.empty

    def poisoned_empty(*args, **kwargs):
        t = empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", poisoned_empty)
    (q_means, q_sim), (k_means, k_sim) = qk_block_statistics_triton(qh, kh)
    monkeypatch.undo()
    for (means, sim), x, block in (((q_means, q_sim), qh, BLOCK_Q), ((k_means, k_sim), kh, BLOCK_K)):
        ref_means, ref_sim = reference_block_statistics(x, block)
        torch.testing.assert_close(means, ref_means, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(sim, ref_sim, atol=1e-5, rtol=1e-4)


MASK_CASES = [
    # B, H, HK, Nq, Nkv, D, causal
    (1, 2, 2, 300, 300, 64, False),
    (2, 4, 2, 257, 257, 64, True),  # GQA, odd length
    (1, 2, 1, 100, 450, 128, False),  # Nq != Nkv, Nq shorter than one block
    (1, 2, 2, 600, 600, 128, True),
    (1, 2, 1, 300, 300, 256, True),  # Gemma 2 / 3's head dim
    (1, 2, 2, 300, 333, 96, False),  # padded head dim: the means' rows are 96 apart, loaded 128 wide
]


def stage1_borderline(details: dict, theta: torch.Tensor, tau: torch.Tensor, rel: float = 2e-3,
                      slack: float = 1e-4) -> torch.Tensor:
    """The blocks whose stage-1 decision sits on a threshold, where the kernel's rounding (another summation order,
    tf32x3 products) may tip it against the float32 reference: a query or key block whose self-similarity lies
    within ``slack`` of θ; a key block whose TopCdf mass could lie on either side of τ (within ``slack``) once
    probabilities within ``rel`` of each other swap places (ties: a saturated soft cap makes whole rows of equal
    scores); two or more key blocks within ``rel`` of their row's most probable one (the one kept as the row's
    maximum may change)."""
    p = details["probability"]
    H = theta.numel()
    t = tau.to(p).view(1, H, 1, 1)
    others, own = p[..., None, :], p[..., :, None]  # [..., j, i]: block i against block j of the same row
    low = (others * (others > own * (1 + rel))).sum(-1) + p  # blocks surely above j, and j
    high = (others * (others >= own * (1 - rel))).sum(-1)  # every block that may be at or above j
    border = (low <= t + slack) & (high >= t - slack)
    near_top = (p > 0) & (p >= p.amax(-1, keepdim=True) * (1 - rel))
    border |= near_top & (near_top.sum(-1, keepdim=True) > 1)  # which of them is the row's maximum may change
    border |= ((details["q_similarity"] - theta.to(p).view(1, H, 1)).abs() < slack)[..., None]
    border |= ((details["k_similarity"] - theta.to(p).view(1, H, 1)).abs() < slack)[:, :, None, :]
    return border


def assert_stage1_agrees(mask, q, k, *, theta, tau, causal, layout, causal_variant=None, sliding_window=None,
                         softcap=None, key_segment=BLOCK_K) -> torch.Tensor:
    """A predicted mask equals the reference's but where a decision sits on a threshold (``stage1_borderline``);
    returns the reference mask. ``key_segment``: PBS's permuted keys (``PermutedKeys.segment``)."""
    seq = 2 if layout == "HND" else 1
    offset = causal_offset(q.shape[seq], k.shape[seq], causal, causal_variant)
    details = reference_prediction_details(q, k, scale=q.shape[-1] ** -0.5, simthreshd1=theta, cdfthreshd=tau,
                                           attention_sink=False, is_causal=causal, tensor_layout=layout,
                                           causal_offset=offset, sliding_window=sliding_window, softcap=softcap,
                                           key_segment=key_segment)
    ref = details["mask"].to(mask.device)
    differ = (mask != ref) & ~stage1_borderline(details, theta, tau).to(mask.device)
    assert differ.sum() == 0, f"{int(differ.sum())} blocks differ off every threshold, at {differ.nonzero()[:5]}"
    return ref


def test_prediction_details_are_the_compressed_softmax_and_its_masses():
    """The reference's probability and mass, which ``stage1_borderline`` reads to excuse decisions on a threshold:
    each row's softmax over the compressed scores of its self-similar key blocks, and the mass at or above each
    entry."""
    q, k, _ = make_qkv(1, 2, 2, 300, 500, 64, torch.float32, "HND", seed=3)
    q, k = q + 1.0, k + 1.5
    theta = torch.tensor([0.1, 0.7])  # the key blocks' similarities: 0.68-0.71
    details = reference_prediction_details(q, k, scale=0.125, simthreshd1=theta, cdfthreshd=torch.full((2,), 0.9),
                                           attention_sink=False, is_causal=False)
    (q_means, _), (k_means, k_sim) = reference_block_statistics(q, BLOCK_Q), reference_block_statistics(k, BLOCK_K)
    similar = k_sim > theta.view(1, 2, 1)
    assert similar.any() and not similar.all(), "some key blocks left out of the softmax"
    p = torch.softmax(((q_means @ k_means.transpose(-1, -2)) * 0.125).masked_fill(~similar[:, :, None], -math.inf), -1)
    torch.testing.assert_close(details["probability"], p)
    torch.testing.assert_close(details["mass"], (p[..., None, :] * (p[..., None, :] >= p[..., :, None])).sum(-1))


def assert_mask_matches_reference(mask, q, k, *, theta, tau, causal, layout):
    """Only decisions that sit on a threshold may differ; the case keeps some blocks and drops others."""
    ref = assert_stage1_agrees(mask, q, k, theta=theta, tau=tau, causal=causal, layout=layout)
    assert mask.any(-1).all(), "every query block keeps at least one key block"
    assert 0 < ref.float().mean() < 1, "the case should exercise selection"


@pytest.mark.parametrize("B,H,HK,Nq,Nkv,D,causal", MASK_CASES)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_predict_block_mask_matches_reference(B, H, HK, Nq, Nkv, D, causal, layout, dtype):
    q, k, _ = make_qkv(B, H, HK, Nq, Nkv, D, dtype, layout, seed=Nq * 7 + D)
    # give q and k a shared mean so that some blocks are self-similar and TopCdf has work to do
    q, k = q + 1.0, k + 1.5
    theta = torch.linspace(0.1, 0.5, H)
    tau = torch.linspace(0.5, 0.95, H)
    kw = dict(is_causal=causal, simthreshd1=theta, cdfthreshd=tau, tensor_layout=layout)
    mask = predict_block_mask(q, k, backend="triton", **kw)
    assert mask.shape == (B, H, math.ceil(Nq / BLOCK_Q), math.ceil(Nkv / BLOCK_K)) and mask.dtype == torch.bool
    assert_mask_matches_reference(mask, q, k, theta=theta, tau=tau, causal=causal, layout=layout)


@pytest.mark.gpu
@pytest.mark.parametrize("Nq,Nkv,causal", [(3000, 3000, False), (4608, 4608, False), (9000, 9000, True),
                                           (700, 12000, False)])
def test_gpu_predict_block_mask_matches_reference(Nq, Nkv, causal):
    """Stage 1 on the GPU against the reference: D = 128, GQA, both layouts, N_q != N_kv, rows of 47-188 key
    blocks (both sides of topcdf_rows' switch at 128)."""
    for layout in ("HND", "NHD"):
        q, k, _ = (t.cuda() for t in make_qkv(1, 4, 2, Nq, Nkv, 128, torch.bfloat16, layout, seed=Nkv))
        q, k = q + 1.0, k + 1.5
        theta, tau = torch.linspace(0.1, 0.5, 4), torch.linspace(0.5, 0.95, 4)
        mask = predict_block_mask(q, k, is_causal=causal, simthreshd1=theta, cdfthreshd=tau, tensor_layout=layout)
        assert_mask_matches_reference(mask, q.cpu(), k.cpu(), theta=theta, tau=tau, causal=causal, layout=layout)


def test_stage1_borderline_flags_decisions_on_a_threshold_and_no_other():
    """The tests' tolerance for stage 1 (stage1_borderline): ties across TopCdf's cut, a mass at τ and a block
    similarity at θ are borderline; a row's single most probable block and masses away from τ are not."""
    p = torch.tensor([[0.25, 0.25, 0.25, 0.25],  # equal probabilities across the cut: any of them may tip
                      [0.6, 0.25, 0.1, 0.05],  # masses 0.6, 0.85, 0.95, 1.0: none within 1e-4 of 0.9
                      [0.5, 0.4, 0.1, 0.0],  # the second block's mass is 0.9 itself
                      [0.6, 0.25, 0.1, 0.05]])  # its query block's self-similarity sits at θ
    details = {"probability": p.view(1, 1, 4, 4), "q_similarity": torch.tensor([[[0.9, 0.9, 0.9, 0.50005]]]),
               "k_similarity": torch.full((1, 1, 4), 0.9)}
    expected = torch.tensor([[True] * 4, [False] * 4, [False, True, False, False], [True] * 4])
    assert torch.equal(stage1_borderline(details, torch.tensor([0.5]), torch.tensor([0.9]))[0, 0], expected)


def test_topcdf_keeps_the_smallest_prefix_reaching_tau():
    # one head, one query block; keys with hand-made compressed scores: the kept set must be exactly the
    # most probable blocks whose cumulative probability stays within tau
    D, nk = 64, 6
    q = torch.zeros(1, 1, BLOCK_Q, D)
    q[..., 0] = 1.0
    logits = torch.tensor([3.0, 0.0, 2.0, -1.0, 1.0, -2.0])
    k = torch.zeros(1, 1, nk * BLOCK_K, D)
    k[..., 0] = logits.repeat_interleave(BLOCK_K) * math.sqrt(D)
    k[..., 1] = 1.0  # keep every key block self-similar
    p = torch.softmax(logits, 0)
    for tau in (0.5, 0.7, 0.9, 0.99):
        order = torch.argsort(p, descending=True)
        n_keep = max(1, int((torch.cumsum(p[order], 0) <= tau).sum()))
        expected = torch.zeros(nk, dtype=torch.bool)
        expected[order[:n_keep]] = True
        for backend in ("triton", "reference"):
            got = predict_block_mask(q.half(), k.half(), simthreshd1=-1.0, cdfthreshd=tau, backend=backend)
            assert torch.equal(got[0, 0, 0], expected), (tau, backend)



def test_topcdf_and_similarity_rules_at_their_edges():
    """Edges of stage 1's rules that random inputs never hit, on hand-made blocks whose statistics are exact:
    a block's mass at exactly tau * total is kept; tau = 1 keeps blocks whose probability underflows to 0 (the
    bisection's threshold is then 0); a block whose self-similarity equals theta is forced (similar means above
    theta), a query block's row and a key block's column alike."""
    from sparge_diffusers.kernels._inputs import AttentionShape
    from sparge_diffusers.kernels.predict import topcdf_block_mask_triton

    nk, D = 4, 64
    shape = AttentionShape(1, 1, 1, BLOCK_Q, nk * BLOCK_K, D)
    scores = torch.tensor([0.0, -1.0, -2.0, -2.0]).view(1, 1, 1, nk)  # log2 units: probabilities 1/2, 1/4, 1/8, 1/8
    similar = dict(q_sim=torch.ones(1, 1, 1), k_sim=torch.ones(1, 1, nk), simthreshd1=torch.tensor([0.5]))
    for tau, kept in ((0.75, [True, True, False, False]), (0.74, [True, False, False, False]),
                      (0.875, [True, True, False, False]), (1.0, [True] * 4)):
        mask, _ = topcdf_block_mask_triton(scores, similar["q_sim"], similar["k_sim"], shape, is_causal=False,
                                           simthreshd1=similar["simthreshd1"], cdfthreshd=torch.tensor([tau]),
                                           attention_sink=False)
        assert mask[0, 0, 0].bool().tolist() == kept, tau
    # probabilities 1/2 and one float below it: the bisection must end on the float itself (30 halvings of the bit
    # patterns below 1.0 find it exactly), or it drops the 1/2 that tau = 0.8 keeps
    one_below = torch.nextafter(torch.tensor(-1.0), torch.tensor(-2.0)).item()
    scores = torch.tensor([0.0, -1.0, one_below, -4.0, -5.0, -6.0]).view(1, 1, 1, 6)
    mask, _ = topcdf_block_mask_triton(scores, similar["q_sim"], torch.ones(1, 1, 6),
                                       AttentionShape(1, 1, 1, BLOCK_Q, 6 * BLOCK_K, D), is_causal=False,
                                       simthreshd1=similar["simthreshd1"], cdfthreshd=torch.tensor([0.8]),
                                       attention_sink=False)
    assert mask[0, 0, 0].bool().tolist() == [True, True, False, False, False, False]

    def qk(logits):  # one query block of e1 tokens; key block j's tokens (8 * logit_j, 1): compressed score logit_j
        q = torch.zeros(1, 1, BLOCK_Q, D)
        q[..., 0] = 1.0
        k = torch.zeros(1, 1, len(logits) * BLOCK_K, D)
        k[..., 0] = torch.tensor(logits).repeat_interleave(BLOCK_K) * math.sqrt(D)
        k[..., 1] = 1.0
        return q, k

    q, k = qk([3.0, 0.0, -200.0, -300.0])  # exp(-203) is 0 in float32
    for backend in ("triton", "reference"):
        got = predict_block_mask(q.half(), k.half(), simthreshd1=-1.0, cdfthreshd=1.0, backend=backend)
        assert got.all(), backend
        got = predict_block_mask(q.half(), k.half(), simthreshd1=-1.0, cdfthreshd=0.5, backend=backend)
        assert got[0, 0, 0].tolist() == [True, False, False, False], backend
    q, k = qk([100.0, 99.0, 98.0, -50.0])  # scores whose exp overflows float32 unless the row max goes first
    for backend in ("triton", "reference"):  # probabilities 0.67, 0.24, 0.09, 0: masses 0.67, 0.91, 1, 1
        got = predict_block_mask(q.half(), k.half(), simthreshd1=-1.0, cdfthreshd=0.95, backend=backend)
        assert got[0, 0, 0].tolist() == [True, True, False, False], backend

    # a query block of 64 e1 and 64 e2 tokens: cosine self-similarity exactly 0.5 (half the pairs 1, half 0)
    q, k = qk([3.0, 0.0, 2.0, -1.0])
    q[:, :, BLOCK_Q // 2:] = 0.0
    q[:, :, BLOCK_Q // 2:, 1] = 1.0
    # a key block of 32 -8 e1 and 32 8 e2 tokens: self-similarity exactly 0.5, a compressed score far below the rest
    k[:, :, 3 * BLOCK_K:] = 0.0
    k[:, :, 3 * BLOCK_K:3 * BLOCK_K + BLOCK_K // 2, 0] = -8.0
    k[:, :, 3 * BLOCK_K + BLOCK_K // 2:, 1] = 8.0
    q_sim, k_sim = reference_block_statistics(q, BLOCK_Q)[1], reference_block_statistics(k, BLOCK_K)[1]
    assert q_sim.item() == 0.5 and k_sim[0, 0, 3].item() == 0.5
    assert block_statistics_triton(q.half(), BLOCK_Q)[1].item() == 0.5
    assert block_statistics_triton(k.half(), BLOCK_K)[1][0, 0, 3].item() == 0.5
    for backend in ("triton", "reference"):  # theta = 0.5: the query block is forced, its whole row kept
        got = predict_block_mask(q.half(), k.half(), simthreshd1=0.5, cdfthreshd=0.5, backend=backend)
        assert got.all(), backend
        got = predict_block_mask(q.half(), k.half(), simthreshd1=0.4999, cdfthreshd=0.5, backend=backend)
        assert got[0, 0, 0].tolist() == [True, False, False, False], backend  # just below: neither is forced
    q[:, :, BLOCK_Q // 2:] = q[:, :, :BLOCK_Q // 2]  # all e1 now: similar; the key block alone is forced at 0.5
    for backend in ("triton", "reference"):
        got = predict_block_mask(q.half(), k.half(), simthreshd1=0.5, cdfthreshd=0.5, backend=backend)
        assert got[0, 0, 0].tolist() == [True, False, False, True], backend


def test_reference_topcdf_keeps_a_block_whose_mass_is_exactly_tau_of_the_total():
    """The reference's side of the edge above (the kernel's is tested on hand-made log2 scores). The reference
    takes q and k and uses exp, so the masses are exact only at scale ln 2 (rounded to float32: exp(-scale) is then
    0.5 and exp(-2 scale) 0.25, each within 0.03 ulp): key blocks of scores 0, -1, -2, -2 (before the scale)
    give probabilities 1, 1/2, 1/4, 1/4 (unnormalised), masses 1, 1.5, 1.75, 2 of a total 2."""
    D = 64
    scale = torch.tensor(math.log(2)).item()  # float32's ln 2
    assert torch.exp(torch.tensor([-scale, -2 * scale])).tolist() == [0.5, 0.25]
    q = torch.zeros(1, 1, BLOCK_Q, D)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 4 * BLOCK_K, D)
    k[..., 0] = torch.tensor([0.0, -1.0, -2.0, -2.0]).repeat_interleave(BLOCK_K)
    for tau, kept in ((0.75, [True, True, False, False]), (0.7499, [True, False, False, False])):
        got = predict_block_mask(q.half(), k.half(), scale=scale, simthreshd1=-1.0, cdfthreshd=tau,
                                 backend="reference")
        assert got[0, 0, 0].tolist() == kept, tau


def test_topcdf_rows_per_program_are_the_measured_choice():
    """``topcdf_rows``' docstring: 1 query block per program up to a padded width of 128 key blocks and from 1024
    (fastest on an H100 at Flux, nk 72, and Mochi, nk 700), 4 between (fastest at Llama-32K, nk 512)."""
    from sparge_diffusers.kernels.predict import topcdf_rows

    nks = (1, 9, 72, 128, 129, 278, 512, 513, 700, 1024, 2000)
    assert [topcdf_rows(nk) for nk in nks] == [1, 1, 1, 1, 4, 4, 4, 1, 1, 1, 1]


@pytest.mark.parametrize("rows", [2, 4])
@pytest.mark.parametrize("causal", [False, True])
def test_topcdf_rows_per_program_change_no_output(rows, causal, monkeypatch):
    """Query blocks per TopCdf program is a speed choice (1 at the sizes tests reach, 4 at 129-512 key blocks):
    with 2 or 4 and five query blocks (not a multiple), the mask and its compacted walk are those of one row per
    program, and the mask is the reference's."""
    from sparge_diffusers.kernels import predict
    from sparge_diffusers.kernels._inputs import AttentionShape

    Nq, Nkv = 610, (610 if causal else 400)
    q, k, _ = make_qkv(2, 3, 3, Nq, Nkv, 64, torch.bfloat16, "HND", seed=rows)
    shape = AttentionShape(2, 3, 3, Nq, Nkv, 64)
    kw = dict(is_causal=causal, scale=0.125, simthreshd1=torch.tensor([-1.0, 0.01, 0.6]),
              cdfthreshd=torch.tensor([0.5, 0.8, 0.95]), attention_sink=False)
    mask, (index, count, n_full) = predict.predict_block_mask_triton(q, k, shape, **kw)
    monkeypatch.setattr(predict, "topcdf_rows", lambda nk: rows)
    got_mask, (got_index, got_count, got_full) = predict.predict_block_mask_triton(q, k, shape, **kw)
    assert torch.equal(got_mask, mask) and torch.equal(got_count, count) and torch.equal(got_full, n_full)
    used = torch.arange(index.shape[-1]) < count[..., None]  # entries past a row's count are unused
    assert torch.equal(got_index[used], index[used])
    want = reference_prediction_details(q, k, **kw)["mask"]
    assert torch.equal(mask, want) and not want.all()


ATTN_CASES = [
    # B, H, HK, Nq, Nkv, D, causal
    (1, 2, 2, 200, 200, 64, False),
    (2, 4, 2, 300, 300, 64, True),  # GQA
    (1, 2, 1, 77, 333, 128, False),  # Nq != Nkv, shorter than a block
    (1, 1, 1, 129, 129, 128, True),
    (1, 2, 2, 150, 150, 96, False),  # padded head dim
    # D > 64 without stage 2 takes kept blocks in pairs (128-key tiles gathered from two blocks)
    (1, 2, 1, 260, 1000, 128, False),
    (1, 2, 2, 650, 650, 128, True),
    (1, 2, 1, 150, 200, 256, False),  # Gemma 2 / 3's head dim: 64-key tiles, no pairs
    (1, 2, 1, 190, 190, 256, True),
]


@pytest.mark.parametrize("B,H,HK,Nq,Nkv,D,causal", ATTN_CASES)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("pvthreshd", [None, 4.0])
def test_block_sparse_attention_matches_reference(B, H, HK, Nq, Nkv, D, causal, layout, dtype, pvthreshd):
    q, k, v = make_qkv(B, H, HK, Nq, Nkv, D, dtype, layout, seed=Nq + Nkv + D)
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(B, H, math.ceil(Nq / BLOCK_Q), math.ceil(Nkv / BLOCK_K), generator=g) < 0.6
    mask[..., 0] = True
    kw = dict(is_causal=causal, pvthreshd=pvthreshd, tensor_layout=layout, return_sparsity=True)
    out, stats = block_sparse_attention(q, k, v, mask, backend="triton", out=poisoned_like(q), **kw)
    ref, ref_stats = block_sparse_attention(q, k, v, mask, backend="reference", **kw)
    assert not torch.isnan(out).any(), "every output element must be written, and never NaN"
    assert relative_l1(out, ref) < L1_TOL[dtype]
    torch.testing.assert_close(stats.qk_skipped, ref_stats.qk_skipped)
    torch.testing.assert_close(stats.pv_skipped, ref_stats.pv_skipped)


@pytest.fixture
def tma_io_forced(monkeypatch):
    """Run the Q-load / output-store path through TMA tensor descriptors (GPUs choose it by a rule); returns the
    list of tensors given descriptors, so a test can tell that the path ran (its output alone cannot: the pointer
    path gives the same)."""
    from sparge_diffusers.kernels import attention

    monkeypatch.setattr(attention, "TMA_IO_OVERRIDE", True)
    described = []
    make = attention._tma_descriptor
    monkeypatch.setattr(attention, "_tma_descriptor", lambda t: described.append(t) or make(t))
    return described


@pytest.mark.parametrize("B,H,HK,Nq,Nkv,D,causal", [c for c in ATTN_CASES if c[5] != 96])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_tma_io_path_matches_reference_and_writes_only_its_rows(B, H, HK, Nq, Nkv, D, causal, layout, dtype,
                                                                  tma_io_forced):
    q, k, v = make_qkv(B, H, HK, Nq, Nkv, D, dtype, layout, seed=Nq + Nkv + D)
    g = torch.Generator().manual_seed(1)
    mask = torch.rand(B, H, math.ceil(Nq / BLOCK_Q), math.ceil(Nkv / BLOCK_K), generator=g) < 0.6
    mask[..., 0] = True
    # the output is a view into a larger poisoned buffer: a tile past Nq must not spill into the next head
    seq_dim = 2 if layout == "HND" else 1
    big = poisoned_like(torch.cat([q, q[:, :5] if seq_dim == 1 else q[:, :, :5]], dim=seq_dim))
    out = big.narrow(seq_dim, 0, Nq)
    for block_mask in (mask, None):
        tma_io_forced.clear()
        block_sparse_attention(q, k, v, block_mask, is_causal=causal, tensor_layout=layout, backend="triton",
                               out=out)
        assert len(tma_io_forced) == 2, "Q and the output go through tensor descriptors"
        ref = block_sparse_attention(q, k, v, block_mask, is_causal=causal, tensor_layout=layout,
                                     backend="reference")
        assert not torch.isnan(out).any()
        assert relative_l1(out, ref) < L1_TOL[dtype]
        assert torch.isnan(big.narrow(seq_dim, Nq, 5)).all(), "rows past Nq were written"


def test_tma_io_rule_needs_a_hopper_gpu_and_no_causal_mask():
    from sparge_diffusers.kernels.attention import use_tma_io

    q = torch.zeros(1, 2, 256, 128, dtype=torch.bfloat16)
    shape = check_attention_inputs(q, q, q, tensor_layout="HND", is_causal=False)
    assert not use_tma_io(q, q, shape, is_causal=False)  # CPU tensors: the pointer path
    if torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0):
        qc = q.cuda()
        assert use_tma_io(qc, qc, shape, is_causal=False)
        assert not use_tma_io(qc, qc, shape, is_causal=True)
        misaligned = torch.zeros(2 * 256 * 128 + 1, dtype=torch.bfloat16, device="cuda")[1:].view(1, 2, 256, 128)
        assert not use_tma_io(misaligned, qc, shape, is_causal=False)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_keeping_every_block_equals_sdpa(causal, layout, dtype):
    q, k, v = make_qkv(1, 4, 2, 333, 333, 64, dtype, layout, seed=3)
    dense = dense_reference(q, k, v, causal, layout)
    for backend in ("triton", "reference"):
        out, stats = sparge_attention(q, k, v, is_causal=causal, cdfthreshd=1.0, pvthreshd=None,
                                      tensor_layout=layout, return_sparsity=True, backend=backend,
                                      out=poisoned_like(q))
        assert relative_l1(out, dense) < L1_TOL[dtype], backend
        assert stats.sparsity == 0.0
    out = block_sparse_attention(q, k, v, None, is_causal=causal, tensor_layout=layout, backend="triton",
                                 out=poisoned_like(q))
    assert relative_l1(out, dense) < L1_TOL[dtype]


@pytest.mark.parametrize("B,H,HK,Nq,Nkv,D,causal", [
    (1, 2, 2, 333, 333, 128, True),  # dense mode walks 128-key tiles at D > 64
    (2, 4, 2, 300, 461, 96, False),  # GQA, Nq != Nkv, head dim padded to 128
    (1, 2, 1, 70, 70, 128, True),  # shorter than one tile
])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_dense_mode_with_wide_tiles_equals_sdpa(B, H, HK, Nq, Nkv, D, causal, layout):
    q, k, v = make_qkv(B, H, HK, Nq, Nkv, D, torch.bfloat16, layout, seed=Nq + D)
    out, stats = block_sparse_attention(q, k, v, None, is_causal=causal, tensor_layout=layout, backend="triton",
                                        out=poisoned_like(q), return_sparsity=True)
    assert not torch.isnan(out).any()
    assert relative_l1(out, dense_reference(q, k, v, causal, layout)) < L1_TOL[torch.bfloat16]
    assert stats.sparsity == 0.0 and float(stats.pv_skipped.max()) == 0.0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paired_tiles_cover_every_pairing(causal, dtype):
    # Rows with an odd and even number of mask-free blocks, pairs of non-adjacent blocks, a row with a single
    # block, one with none: the paired walk (D > 64, no stage 2) must equal the reference on each.
    from sparge_diffusers.kernels.attention import pair_tiles

    assert pair_tiles(128, True, False) and not pair_tiles(128, True, True) and not pair_tiles(64, True, False)
    N = 8 * BLOCK_K + 17
    q, k, v = make_qkv(1, 4, 2, N, N, 128, dtype, "NHD", seed=21)
    nq, nk = math.ceil(N / BLOCK_Q), math.ceil(N / BLOCK_K)
    mask = torch.zeros(1, 4, nq, nk, dtype=torch.bool)
    mask[:, 0] = True  # every block
    mask[:, 1, :, ::3] = True  # non-adjacent pairs
    mask[:, 2, :, 1] = True  # one block (under causal masking, rows 0-63 of the first query block see none)
    mask[:, 3, 1:, 2:7] = True  # the first query block keeps nothing: a zero output
    out = block_sparse_attention(q, k, v, mask, is_causal=causal, tensor_layout="NHD", backend="triton",
                                 out=poisoned_like(q))
    ref = block_sparse_attention(q, k, v, mask, is_causal=causal, tensor_layout="NHD", backend="reference")
    assert not torch.isnan(out).any()
    assert relative_l1(out, ref) < L1_TOL[dtype]


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_compact_block_mask_is_reusable_and_checked(backend, monkeypatch):
    from sparge_diffusers.kernels import api

    q, k, v = make_qkv(2, 4, 2, 300, 300, 128, torch.float16, "NHD", seed=4)
    mask = torch.rand(2, 1, 3, 5, generator=torch.Generator().manual_seed(2)) < 0.5
    mask[..., 0] = True
    compact = compact_block_mask(mask, q, k, is_causal=True, tensor_layout="NHD", backend=backend)
    assert (compact.index is None) == (backend == "reference")
    assert (compact.kernel_walk is None) == (backend == "reference")
    kw = dict(is_causal=True, tensor_layout="NHD", backend=backend, return_sparsity=True)
    want, want_stats = block_sparse_attention(q, k, v, mask, **kw)

    def compaction(*args, **kwargs):
        raise AssertionError("a prebuilt walk was compacted again")

    monkeypatch.setattr(api, "block_mask_to_index", compaction)  # the calls below read the walk built above
    for _ in range(2):
        got, stats = block_sparse_attention(q, k, v, compact, out=poisoned_like(q), **kw)
        assert torch.equal(got, want)
        torch.testing.assert_close(stats.qk_skipped, want_stats.qk_skipped)
    with pytest.raises(ValueError, match="is_causal"):
        block_sparse_attention(q, k, v, compact, tensor_layout="NHD", backend=backend)
    with pytest.raises(ValueError, match="q_len"):
        block_sparse_attention(q[:, :200], k[:, :200], v[:, :200], compact, is_causal=True, tensor_layout="NHD",
                               backend=backend)
    with pytest.raises(ValueError, match="block_mask shape"):
        compact_block_mask(mask[..., :4], q, k, tensor_layout="NHD", backend=backend)
    # both default to non-causal attention: a mask compacted with the defaults serves a call with them
    monkeypatch.undo()
    plain = block_sparse_attention(q, k, v, compact_block_mask(mask, q, k, tensor_layout="NHD", backend=backend),
                                   tensor_layout="NHD", backend=backend)
    assert torch.equal(plain, block_sparse_attention(q, k, v, mask, tensor_layout="NHD", backend=backend))


@pytest.mark.parametrize("D", [64, 128])
def test_pv_filter_skips_tiles_far_below_the_running_max(D):
    # Row maxima of the second key block are 20 (log2 units) below the first block's: with pvthreshd 10 the
    # P.V product of that tile is skipped, and the result still matches dense attention closely. At D=128 the
    # dense mode without stage 2 walks 128-key tiles; with stage 2 it must keep one decision per 64-key block.
    q = torch.zeros(1, 1, BLOCK_Q, D)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 2 * BLOCK_K, D)
    k[:, :, :BLOCK_K, 0] = 20 * math.log(2) * math.sqrt(D)
    v = torch.randn(1, 1, 2 * BLOCK_K, D)
    q, k, v = q.half(), k.half(), v.half()
    for backend in ("triton", "reference"):
        out, stats = block_sparse_attention(q, k, v, None, pvthreshd=10.0, return_sparsity=True,
                                            backend=backend)
        assert stats.pv_skipped_stage2.item() == pytest.approx(0.5)
        assert relative_l1(out, dense_reference(q, k, v, False, "HND")) < 2e-3
        for form in ([10.0], (10.0,), torch.tensor(10.0), torch.tensor([10.0]), [torch.tensor(10.0)]):
            got, stats = block_sparse_attention(q, k, v, None, pvthreshd=form, return_sparsity=True,
                                                backend=backend)
            assert torch.equal(got, out) and stats.pv_skipped_stage2.item() == pytest.approx(0.5), form
        _, stats = block_sparse_attention(q, k, v, None, pvthreshd=30.0, return_sparsity=True, backend=backend)
        assert stats.pv_skipped_stage2.item() == 0.0
        # blocks 0, 2 and 3 high, 1 low: one skip in four. A walk deciding per 128-key tile (blocks 0-1, 2-3)
        # skips nothing here; above, its one tile over two blocks read as 0.5 skipped by chance.
        k4 = torch.cat([k, k], dim=2)
        k4[:, :, 2 * BLOCK_K:, 0] = k[0, 0, 0, 0]
        v4 = torch.randn(1, 1, 4 * BLOCK_K, D).half()
        out4, stats = block_sparse_attention(q, k4, v4, None, pvthreshd=10.0, return_sparsity=True, backend=backend)
        assert stats.pv_skipped_stage2.item() == pytest.approx(0.25), backend
        assert relative_l1(out4, dense_reference(q, k4, v4, False, "HND")) < 2e-3
    # 30 below: skipped under any pvthreshd up to 30, but from PV_TEST_LIMIT (24) on the Triton kernel leaves the
    # test out (what it could skip is below float32 rounding), so its statistics count no skip; the reference's do
    k[:, :, :BLOCK_K, 0] = 30 * math.log(2) * math.sqrt(D)
    for pvthreshd, triton_skips in ((23.9, 0.5), (24.0, 0.0)):
        for backend, skipped in (("triton", triton_skips), ("reference", 0.5)):
            _, stats = block_sparse_attention(q, k, v, None, pvthreshd=pvthreshd, return_sparsity=True,
                                              backend=backend)
            assert stats.pv_skipped_stage2.item() == pytest.approx(skipped), (pvthreshd, backend)


@pytest.mark.parametrize("backend", ["triton", "reference"])
@pytest.mark.parametrize("walk", ["mask", "s2o"])
def test_pv_filter_skips_a_tile_whose_row_max_is_exactly_pvthreshd_below(backend, walk):
    """The documented edge of stage 2: a tile is skipped when its largest row-max gap is at most -pvthreshd, so a
    gap of exactly -pvthreshd skips it. Random inputs never tie; here the scores are 0 (key block 0) and -8 (key
    block 1) at scale 1, so the gap is -8 * log2(e) rounded once to float32 (8 is a power of two: the same value
    whether the scale and log2 e are multiplied first or not), and pvthreshd is that float. One float above it
    computes the tile."""
    D = 64
    q = torch.zeros(1, 1, 1, D)
    q[..., 0] = 1.0
    k = torch.zeros(1, 1, 2 * BLOCK_K, D)
    k[:, :, BLOCK_K:, 0] = -8.0
    v = torch.randn(1, 1, 2 * BLOCK_K, D, generator=torch.Generator().manual_seed(0))
    q, k, v = q.half(), k.half(), v.half()
    gap = torch.tensor(-8.0) * math.log2(math.e)  # float32, as the walks compute it
    for pvthreshd, skipped in ((-gap.item(), 0.5), (torch.nextafter(-gap, torch.tensor(math.inf)).item(), 0.0)):
        kw = dict(scale=1.0, pvthreshd=pvthreshd, return_sparsity=True, backend=backend)
        if walk == "mask":
            _, stats = block_sparse_attention(q, k, v, None, **kw)
        else:  # every block visited (tau None), block 0 first: its compressed score is the higher
            _, stats = s2o_attention(q, k, v, tau=None, simthreshd1=-1.0, **kw)
        assert stats.pv_skipped_stage2.item() == skipped, pvthreshd


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_cdfthreshd_in_every_form_selects_the_same_blocks(backend, monkeypatch):
    """Stage 1 is skipped only where cdfthreshd >= 1 is read from Python numbers (a tensor would cost a read-back):
    a tensor or list of 0.5 must still run it, and at 1 every form keeps every block."""
    from sparge_diffusers.kernels import api

    stage_1_calls = []
    predict = api._predict_checked
    monkeypatch.setattr(api, "_predict_checked", lambda *a, **kw: stage_1_calls.append(1) or predict(*a, **kw))
    q, k, v = video_like_qkv((2, 8, 8), heads=2, head_dim=64, seed=3)
    for value in (0.5, 1.0):
        stage_1_calls.clear()
        want, want_stats = sparge_attention(q, k, v, cdfthreshd=value, return_sparsity=True, backend=backend)
        assert (want_stats.sparsity > 0.05) == (value < 1), value
        assert len(stage_1_calls) == (value < 1), value  # the number 1 runs the dense walk alone
        for form in (torch.tensor(value), torch.tensor([value, value]), [value, value], (value, torch.tensor(value))):
            stage_1_calls.clear()
            got, stats = sparge_attention(q, k, v, cdfthreshd=form, return_sparsity=True, backend=backend)
            assert stats.sparsity == want_stats.sparsity, (value, form)
            assert len(stage_1_calls) == (value < 1 or not isinstance(form, list)), (value, form)
            # at 1 the number takes the dense walk, whose tiles may be wider: the same blocks, rounded otherwise
            assert torch.equal(got, want) if value < 1 else relative_l1(got, want) < 1e-3, (value, form)


def test_kernel_launcher_refuses_permuted_keys_or_a_window_without_a_causal_index():
    """Below the public checks, ``sparse_attention_triton`` itself refuses permuted keys and a sliding window unless
    the call is causal and walks an index: its dense mode's contiguous walk follows plain causal extents, so either
    one missing would give a wrong answer, not an error."""
    from sparge_diffusers.kernels import attention
    from sparge_diffusers.kernels._inputs import check_attention_inputs

    q = torch.zeros(1, 1, 200, 64, dtype=torch.float16)
    index = (torch.zeros(1, 1, 2, 4, dtype=torch.int32),) * 3  # never read: the checks come first
    for window, positions, what in ((None, torch.arange(200, dtype=torch.int32).view(1, 1, 200), "key_positions"),
                                    (100, None, "a sliding window")):
        shape = check_attention_inputs(q, q, q, tensor_layout="HND", is_causal=True, sliding_window=window)
        for is_causal, idx in ((False, index), (True, None), (False, None)):
            with pytest.raises(ValueError, match=f"{what} needs a causal call"):
                attention.sparse_attention_triton(q, q, q, torch.empty_like(q), shape, is_causal=is_causal, scale=0.125,
                                                  index=idx, pvthreshd=None, return_counts=False, on_hopper=False,
                                                  key_positions=positions)


@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_an_integer_block_mask_keeps_its_nonzero_blocks(backend):
    """``block_mask`` may be of any integer dtype, nonzero meaning kept (as documented): each gives its bool mask's
    output and statistics, passed directly or compacted first, including values whose low byte is zero."""
    q, k, v = make_qkv(1, 2, 1, 300, 450, 64, torch.float16, "HND", seed=5)
    kept = torch.rand(1, 2, 3, 8, generator=torch.Generator().manual_seed(5)) < 0.5
    want, want_stats = block_sparse_attention(q, k, v, kept, return_sparsity=True, backend=backend)
    for dtype, value in ((torch.int64, 2 ** 40), (torch.int32, 256), (torch.int16, -256), (torch.int8, -1),
                         (torch.uint8, 255), (torch.int32, 1)):
        mask = torch.where(kept, value, 0).to(dtype)
        for given in (mask, compact_block_mask(mask, q, k, backend=backend)):
            got, stats = block_sparse_attention(q, k, v, given, return_sparsity=True, backend=backend)
            assert torch.equal(got, want) and stats.as_dict() == want_stats.as_dict(), (dtype, value)


def test_empty_mask_rows_give_zeros_not_nan():
    q, k, v = make_qkv(1, 2, 2, 256, 256, 64, torch.float16, "HND", seed=5)
    mask = torch.ones(1, 2, 2, 4, dtype=torch.bool)
    mask[:, 1, 0] = False
    for backend in ("triton", "reference"):
        out = block_sparse_attention(q, k, v, mask, backend=backend, out=poisoned_like(q))
        assert not torch.isnan(out).any()
        assert (out[:, 1, :BLOCK_Q] == 0).all()
        assert (out[:, 0] != 0).any()
    # a head whose whole mask is empty: zeros, every product skipped, none of them by stage 2 (it computed none)
    mask[:, 1] = False
    for backend in ("triton", "reference"):
        out, stats = block_sparse_attention(q, k, v, mask, backend=backend, out=poisoned_like(q),
                                            return_sparsity=True)
        assert (out[:, 1] == 0).all() and not torch.isnan(out).any()
        assert stats.qk_skipped[1] == stats.pv_skipped[1] == 1.0 and stats.pv_skipped_stage2[1] == 0.0, backend


def keys_scoring_far_below_zero(B, H, HK, Nq, Nkv, D, device="cpu", seed=0):
    """bf16 q, k, v (HND) whose every scaled score is about -2 sqrt(D): a key read past the last one, zero-filled
    (score 0, value 0: what a TMA load past a tensor's end returns), would outweigh a row's real keys by about
    e^(2 sqrt(D)) / Nkv and pull its output to zero. Values have mean 1, so that pull is near 1 in relative L1. On
    random inputs one such key moves a row by well under the tolerance (its weight is about one key's)."""
    g = torch.Generator().manual_seed(seed)
    q = 1 + 0.1 * torch.randn(B, H, Nq, D, generator=g)
    k = -2 * (1 + 0.1 * torch.randn(B, HK, Nkv, D, generator=g))
    v = 1 + torch.randn(B, HK, Nkv, D, generator=g)
    return tuple(t.to(torch.bfloat16).to(device) for t in (q, k, v))


def mask_keeping_the_last_key_block(shape, kept: int, g) -> torch.Tensor:
    """A mask keeping, in every query block, the last key block (ragged where kv_len is not a multiple of BLOCK_K)
    and ``kept`` - 1 others at random: with a count of 1 the last block ends a masked pair stage alone, with 2 it is
    the pair's second half, with an odd count of 3 or more it fills the Hopper kernel's 64-key stage."""
    score = torch.rand(shape.batch, shape.heads, shape.q_blocks, shape.k_blocks, generator=g, device=g.device)
    score[..., -1] = -1.0  # sorts first: always kept
    mask = torch.zeros(score.shape, dtype=torch.bool, device=g.device)
    return mask.scatter_(-1, score.argsort(dim=-1)[..., :kept], True)


def check_no_key_past_the_last(q, k, v, mask, out) -> None:
    """``out`` (a kernel's, on ``q, k, v`` from ``keys_scoring_far_below_zero``) against the reference, after
    checking that the reference with one zero key appended past the last would be far off: the inputs make such
    a key visible."""
    ref = block_sparse_attention(q.cpu(), k.cpu(), v.cpu(), None if mask is None else mask.cpu(), backend="reference")
    zero = torch.zeros_like(k[:, :, :1]).cpu()
    with_one_more = block_sparse_attention(q.cpu(), torch.cat([k.cpu(), zero], 2), torch.cat([v.cpu(), zero], 2),
                                           None if mask is None else mask.cpu(), backend="reference")
    assert relative_l1(with_one_more, ref) > 0.5
    assert not torch.isnan(out).any()
    assert relative_l1(out.cpu(), ref) < L1_TOL[torch.bfloat16]


@pytest.mark.parametrize("kept", [1, 2, 3, None])  # None: the dense walk
@pytest.mark.parametrize("Nkv", [200, 129])  # last key blocks of 8 keys and of 1
def test_no_key_past_the_last_is_read(kept, Nkv):
    """The Triton kernel on inputs where one key read past the end would show (the Hopper kernel's GPU form:
    ``test_gpu_hopper_kernel_reads_no_key_past_the_last``)."""
    q, k, v = keys_scoring_far_below_zero(1, 2, 1, 130, Nkv, 64, seed=Nkv)
    shape = check_attention_inputs(q, k, v, tensor_layout="HND", is_causal=False)
    mask = None if kept is None else mask_keeping_the_last_key_block(shape, kept, torch.Generator().manual_seed(kept))
    out = block_sparse_attention(q, k, v, mask, backend="triton", out=poisoned_like(q))
    check_no_key_past_the_last(q, k, v, mask, out)


def test_non_contiguous_inputs_and_broadcast_mask():
    q, k, v = make_qkv(2, 4, 4, 200, 200, 64, torch.float16, "HND", seed=9)
    qn, kn, vn = (t.transpose(1, 2).contiguous().transpose(1, 2) for t in (q, k, v))  # same values, NHD storage
    kn = kn[..., :].clone().as_strided(kn.shape, kn.stride())
    assert not qn.is_contiguous()
    mask = torch.rand(1, 1, 2, 4) < 0.7
    mask[..., 0] = True
    a = block_sparse_attention(qn, kn, vn, mask, backend="triton")
    b = block_sparse_attention(q, k, v, mask.expand(2, 4, 2, 4).contiguous(), backend="reference")
    assert relative_l1(a, b) < L1_TOL[torch.float16]
    # as SDPA's, the output is laid out as q (what diffusers passes: HND views of NHD projections), so the
    # caller's transpose back to (B, N, H*D) is a view, not a copy
    assert a.stride() == qn.stride()
    full = sparge_attention(qn, kn, vn, simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None, backend="triton")
    assert full.stride() == qn.stride() and torch.isfinite(full).all()
    assert relative_l1(full, dense_reference(q, k, v, False, "HND")) < L1_TOL[torch.float16]
    assert a.transpose(1, 2).flatten(2, 3).data_ptr() == a.data_ptr(), "the transpose back must be a view"
    # views with a channel stride of 2 (copied first, for unit-stride loads) give the same output
    qs, ks, vs = (torch.stack([t, torch.zeros_like(t)], -1)[..., 0] for t in (q, k, v))
    assert qs.stride(-1) == 2
    dense_mask = mask.expand(2, 4, 2, 4)
    assert torch.equal(block_sparse_attention(qs, ks, vs, dense_mask, backend="triton", out=poisoned_like(q)),
                       block_sparse_attention(q, k, v, dense_mask, backend="triton"))
    assert torch.equal(s2o_attention(qs, ks, vs, backend="triton", out=poisoned_like(q)),
                       s2o_attention(q, k, v, backend="triton"))
    # a mask stored key-block-major (its last stride 2, the query blocks): the compaction reads it by its strides
    fixed = torch.tensor([[True, False, True, True], [True, True, False, False]]).expand(2, 4, 2, 4)
    stored_by_key_block = fixed.transpose(-1, -2).contiguous().transpose(-1, -2)
    assert stored_by_key_block.stride(-1) == 2
    assert torch.equal(block_sparse_attention(q, k, v, stored_by_key_block, backend="triton"),
                       block_sparse_attention(q, k, v, fixed.contiguous(), backend="triton"))


@pytest.mark.parametrize("maker,causal", [
    (lambda: video_like_qkv((4, 16, 16), heads=4, head_dim=64, text_tokens=20, seed=1), False),
    (lambda: llm_like_qkv(1300, heads=4, kv_heads=2, head_dim=64, seed=1), True),
])
def test_structured_inputs_are_sparse_and_accurate(maker, causal):
    q, k, v = maker()
    dense = dense_reference(q, k, v, causal, "HND")
    out, stats = sparge_attention(q, k, v, is_causal=causal, return_sparsity=True, backend="triton",
                                  out=poisoned_like(q))
    ref, ref_stats = sparge_attention(q, k, v, is_causal=causal, return_sparsity=True, backend="reference")
    assert stats.sparsity > 0.05, "the structured generators must give something to skip"
    assert relative_l1(out, ref) < L1_TOL[torch.bfloat16]
    assert abs(stats.sparsity - ref_stats.sparsity) < 0.02
    assert relative_l1(out, dense) < 0.1


@pytest.mark.parametrize("n", [1, 2, 3])
def test_structured_generators_take_sequences_of_a_few_tokens(n):
    """Until session 56 a one-token sequence broke both generators: llm_like_qkv raised a RuntimeError (no key
    after the sink to put a stripe on; found by a random PBS call) and video_like_qkv gave NaN (the std of one
    token)."""
    q, k, v = llm_like_qkv(n, heads=4, kv_heads=2, head_dim=64, seed=n)
    assert q.shape == (1, 4, n, 64) and k.shape == v.shape == (1, 2, n, 64)
    assert all(torch.isfinite(t).all() for t in (q, k, v))
    q, k, v = video_like_qkv((1, 1, n), heads=2, head_dim=64, seed=n)
    assert q.shape == (1, 2, n, 64) and all(torch.isfinite(t).all() for t in (q, k, v))


@pytest.mark.parametrize("head_dim", [3, 6, 10, 18])
def test_structured_generators_take_head_dims_whose_half_is_odd(head_dim):
    """Until session 89 both generators raised a RuntimeError from inside torch at head dims 3, 6, 10, 18: the
    rotary half was rounded down to even and no channel took up the one left over."""
    q, k, v = llm_like_qkv(70, heads=4, kv_heads=2, head_dim=head_dim, seed=1)
    assert q.shape == (1, 4, 70, head_dim) and k.shape == v.shape == (1, 2, 70, head_dim)
    q, k, v = video_like_qkv((2, 3, 5), heads=2, head_dim=head_dim, text_tokens=4, seed=1)
    assert q.shape == k.shape == v.shape == (1, 2, 34, head_dim)
    assert all(torch.isfinite(t).all() for t in (q, k, v))


def test_structured_generators_refuse_sizes_they_cannot_build():
    """Until session 89 video_like_qkv(heads=1, kv_heads=2) returned a q with no heads (heads // kv_heads = 0) and
    kv_heads=0 was read as kv_heads=heads; zero or float sizes failed inside torch."""
    cases = [
        (lambda: video_like_qkv((1, 4, 4), heads=1, kv_heads=2), "multiple of kv_heads"),
        (lambda: video_like_qkv((1, 4, 4), heads=4, kv_heads=3), "multiple of kv_heads"),
        (lambda: video_like_qkv((1, 4, 4), heads=2, kv_heads=0), "kv_heads must be a positive int"),
        (lambda: video_like_qkv((0, 4, 4)), "T must be a positive int"),
        (lambda: video_like_qkv((1, 2.5, 4)), "H must be a positive int"),
        (lambda: video_like_qkv((4, 4)), "grid must be"),
        (lambda: video_like_qkv((1, 4, 4), batch=0), "batch must be a positive int"),
        (lambda: video_like_qkv((1, 4, 4), head_dim=0), "head_dim must be a positive int"),
        (lambda: video_like_qkv((1, 4, 4), text_tokens=-1), "text_tokens must be"),
        (lambda: llm_like_qkv(0), "seq_len must be a positive int"),
        (lambda: llm_like_qkv(16, kv_heads=0), "kv_heads must be a positive int"),
        (lambda: llm_like_qkv(16, batch=0), "batch must be a positive int"),
        (lambda: llm_like_qkv(16, heads=True, kv_heads=1), "heads must be a positive int"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_sparsity_stats_count_causal_blocks():
    q, k, v = make_qkv(1, 2, 2, 512, 512, 64, torch.float16, "HND", seed=2)
    # dense causal: query block i (128 rows) sees key blocks 0..2i+1 (64 keys each) -> 2+4+6+8 = 20 blocks
    mask = torch.ones(1, 1, 4, 8, dtype=torch.bool)
    mask[..., 1] = False  # block 1 is visible to every query block: 4 of 20 products skipped
    for backend in ("triton", "reference"):
        _, stats = block_sparse_attention(q, k, v, mask, is_causal=True, return_sparsity=True, backend=backend)
        assert stats.dense_blocks == 20
        torch.testing.assert_close(stats.qk_skipped, torch.full((2,), 4 / 20))
        torch.testing.assert_close(stats.pv_skipped, torch.full((2,), 4 / 20))


def test_bad_inputs_raise_value_error_naming_the_problem():
    q, k, v = make_qkv(1, 4, 2, 100, 100, 64, torch.float16, "HND", seed=0)
    cases = [
        (lambda: sparge_attention(q, k[:, :, :50], v), "k and v shapes differ"),
        (lambda: sparge_attention(q, k.float(), v), "different dtypes"),
        (lambda: sparge_attention(q[:, :3], k, v), "multiple of the number of k/v heads"),
        (lambda: sparge_attention(q, k, v, simthreshd1=float("nan")), "simthreshd1 contains NaN"),
        (lambda: sparge_attention(q, k, v, cdfthreshd=[0.9, 0.9]), "one per head"),
        (lambda: sparge_attention(q, k, v, cdfthreshd=[0.9, float("nan"), 0.9, 0.9]), "cdfthreshd contains NaN"),
        (lambda: sparge_attention(q, k, v, simthreshd1=[0.5, 0.5, 1.5, 0.5]), "must lie in"),
        (lambda: sparge_attention(q, k, v, simthreshd1=-1.01), r"simthreshd1 .*must lie in \[-1"),
        (lambda: predict_block_mask(q, k, cdfthreshd=-0.01), r"cdfthreshd .*must lie in \[0"),
        (lambda: sparge_attention(q, k, v, pvthreshd=0.0), "pvthreshd must be positive"),
        (lambda: sparge_attention(q, k, v, tensor_layout="BHSD"), "tensor_layout"),
        (lambda: sparge_attention(q, k, v, scale=float("nan")), "scale"),
        (lambda: sparge_attention(q, k, v, scale=0.0), "scale must be a positive finite number, got 0.0"),
        (lambda: block_sparse_attention(q, k, v, None, scale=-0.125), "scale must be a positive finite number"),
        # float() took these: True as a scale of 1, a string as its number
        (lambda: sparge_attention(q, k, v, scale=True), "scale must be a positive finite number, got True"),
        (lambda: s2o_attention(q, k, v, scale="0.125"), "scale must be a positive finite number, got '0.125'"),
        (lambda: sparge_attention(q.float(), k.float(), v.float(), backend="triton"), "float16 or torch.bfloat16"),
        (lambda: sparge_attention(q[..., :60], k[..., :60], v[..., :60]), "head dim 60"),
        (lambda: sparge_attention(q, k[:, :, :90], v[:, :, :90], is_causal=True), "causal_variant"),
        (lambda: sparge_attention(q[0], k[0], v[0]), "must be 4-D"),
        (lambda: sparge_attention(q[:0], k[:0], v[:0]), r"empty input: q shape \(0, 4, 100, 64\)"),
        (lambda: block_sparse_attention(q, k[:, :, :0], v[:, :, :0], None), r"k shape \(1, 2, 0, 64\)"),
        # zero heads are empty input, not a GQA mismatch (the head test came first and blamed "k/v heads (0)")
        (lambda: sparge_attention(q[:, :0], k[:, :0], v[:, :0]), r"empty input: q shape \(1, 0, 100, 64\)"),
        (lambda: sparge_attention(q, k[:, :0], v[:, :0]), r"empty input: .*k shape \(1, 0, 100, 64\)"),
        (lambda: block_sparse_attention(q, k, v, torch.ones(1, 1, 3, 2, dtype=torch.bool)),
         r"block_mask shape \(1, 1, 3, 2\) does not match the inputs: expected \(1, 4 or 1, 1, 2\)"),
        (lambda: block_sparse_attention(q, k, v, torch.ones(1, 1, 1, 2)), "bool or integer"),
        (lambda: sparge_attention(q, k, v, out=torch.empty(3)), "out must match q"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


def test_inputs_of_the_wrong_type_device_or_dtype_raise_value_error_naming_the_problem():
    """The checks of types, devices, dtypes, head dims and per-head tensors that the test above leaves out
    (none of them ran in the suite before session 84). A tensor on the meta device stands in for one on another
    device, as CI has only the CPU."""
    import dataclasses

    from sparge_diffusers import PermutedKeys, build_selection_index, selected_block_attention

    q, k, v = make_qkv(1, 4, 2, 100, 100, 64, torch.float16, "HND", seed=0)
    meta_k = k.to("meta")
    compact = compact_block_mask(torch.ones(1, 1, 1, 2, dtype=torch.bool), q, k)
    indices = torch.zeros(1, 2, 100, 1, dtype=torch.int32)
    index = build_selection_index(torch.zeros(1, 2, 100, 1, dtype=torch.int32), q_len=100, kv_len=300,
                                  block_size=64, is_causal=True)  # built for 300 keys, called with 100
    cases = [
        (lambda: sparge_attention(q.tolist(), k, v), "q must be a torch.Tensor, got list"),
        (lambda: sparge_attention(q, meta_k, v), r"q and k are on different devices \(cpu vs meta\)"),
        (lambda: sparge_attention(q.double(), k.double(), v.double()), "unsupported dtype torch.float64"),
        (lambda: sparge_attention(q, k[..., :32], v[..., :32]), "head dims differ: q has 64, k has 32"),
        (lambda: sparge_attention(q, k, v, backend="cuda"), "backend must be 'auto', 'triton' or 'reference'"),
        (lambda: sparge_attention(q.to("meta"), meta_k, v.to("meta")), "device meta is not supported"),
        (lambda: sparge_attention(q, k, v, cdfthreshd=torch.tensor([0.9, 0.9])),
         r"cdfthreshd needs one value or one per head \(4\), got 2"),
        (lambda: sparge_attention(q, k, v, simthreshd1=torch.tensor([0.5, math.nan, 0.5, 0.5])),
         "simthreshd1 contains NaN"),
        (lambda: sparge_attention(q, k, v, cdfthreshd=torch.tensor(1.5)),
         r"cdfthreshd must lie in \[0.0, 1.0\], got \[1.5, 1.5, 1.5, 1.5\]"),
        (lambda: block_sparse_attention(q, k, v, [[[[True, True]]]]), "block_mask must be a 4-D tensor"),
        (lambda: block_sparse_attention(q, k, v, torch.ones(1, 1, 1, 2, dtype=torch.bool, device="meta")),
         "block_mask is on meta, q on cpu"),
        (lambda: block_sparse_attention(q, k, v, dataclasses.replace(compact, mask=compact.mask.to("meta"))),
         "CompactBlockMask is on meta, q on cpu"),
        (lambda: block_sparse_attention(q, k, v, None, is_causal=True, permuted_keys="segments of 128"),
         "permuted_keys must be a PermutedKeys, got str"),
        (lambda: block_sparse_attention(q, k, v, None, is_causal=True,
                                        permuted_keys=PermutedKeys(torch.arange(100, device="meta")[None, None], 64)),
         "permuted_keys.positions is on meta, q on cpu"),
        (lambda: selected_block_attention(q, k, v, indices.tolist()), "block_indices must be a torch.Tensor"),
        (lambda: selected_block_attention(q, k, v, indices.to("meta")), "block_indices is on meta, q on cpu"),
        (lambda: selected_block_attention(q, k, v, index, backend="reference"),
         "a SelectionIndex runs on the Triton backend only"),
        (lambda: selected_block_attention(q, k, v, index, backend="triton"),
         "the SelectionIndex was built for a different key length"),
    ]
    for call, message in cases:
        with pytest.raises(ValueError, match=message):
            call()


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def test_flags_take_true_or_false_only():
    """As SDPA's is_causal: every entry point's flags take True or False. is_causal="False" (a string from a
    config, say) was read by its truth and ran causal attention; the operator wrappers passed flags through bool()."""
    from sparge_diffusers import (build_selection_index, s2o_attention_op, select_key_blocks, select_key_blocks_op,
                                  selected_block_attention, selected_block_attention_op, selection_sparsity,
                                  sparge_attention_op)
    from sparge_diffusers.llm import pbs_sparge_attention, pbs_sparge_attention_op

    q, k, v = make_qkv(1, 2, 2, 200, 200, 64, torch.float32, "HND", seed=3)
    mask = torch.ones(1, 1, 2, 4, dtype=torch.bool)
    idx = torch.zeros(1, 2, 200, 1, dtype=torch.int32)
    calls = {
        "sparge_attention": lambda **f: sparge_attention(q, k, v, **f),
        "predict_block_mask": lambda **f: predict_block_mask(q, k, **f),
        "block_sparse_attention": lambda **f: block_sparse_attention(q, k, v, mask, **f),
        "compact_block_mask": lambda **f: compact_block_mask(mask, q, k, **f),
        "s2o_attention": lambda **f: s2o_attention(q, k, v, **f),
        "selected_block_attention": lambda **f: selected_block_attention(q, k, v, idx, **f),
        "build_selection_index": lambda **f: build_selection_index(idx, q_len=200, kv_len=200, block_size=64, **f),
        "selection_sparsity": lambda **f: selection_sparsity(idx, heads=2, kv_len=200, **f),
        "select_key_blocks": lambda **f: select_key_blocks(q, k, top_k=2, **f),
        "sparge_attention_op": lambda **f: sparge_attention_op(q, k, v, **f),
        "sparge_attention_op(dense)": lambda **f: sparge_attention_op(q, k, v, dense=torch.tensor([False]), **f),
        "s2o_attention_op": lambda **f: s2o_attention_op(q, k, v, **f),
        "selected_block_attention_op": lambda **f: selected_block_attention_op(q, k, v, idx, **f),
        "select_key_blocks_op": lambda **f: select_key_blocks_op(q, k, top_k=2, **f),
    }
    flags = {name: ["is_causal"] for name in calls}
    calls["pbs_sparge_attention_op"] = lambda **f: pbs_sparge_attention_op(q, k, v, segment=128, **f)  # causal
    flags["pbs_sparge_attention_op"] = ["attention_sink"]
    calls["pbs_sparge_attention"] = lambda **f: pbs_sparge_attention(q, k, v, segment=128, **f)
    flags["pbs_sparge_attention"] = ["return_sparsity"]  # "False" returned a tuple where a tensor was expected
    for name in ("sparge_attention", "block_sparse_attention", "s2o_attention"):
        flags[name].append("return_sparsity")
    for name in ("sparge_attention", "predict_block_mask", "s2o_attention", "sparge_attention_op",
                 "sparge_attention_op(dense)", "s2o_attention_op"):
        flags[name].append("attention_sink")
    flags["selected_block_attention"].append("validate")
    flags["selected_block_attention_op"].append("validate")
    for name, call in calls.items():
        for flag in flags[name]:
            call(**{flag: True})  # taken
            for bad in ("False", 0, 1, None, torch.tensor(True)):
                with pytest.raises(ValueError, match=f"{flag} must be True or False"):
                    call(**{flag: bad})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_an_out_buffer_that_aliases_the_inputs_raises(layout, device):
    """The kernels' programs read K/V (and Q) rows while others write their output rows, so an ``out`` sharing
    memory with q, k or v would race on the GPU (while the CPU reference, which copies its result in, would be
    right): every entry point taking ``out`` refuses one whose address range meets theirs, and an expanded
    ``out`` whose rows coincide. A separate part of the buffer that holds q, k and v is fine."""
    from sparge_diffusers import s2o_attention, selected_block_attention

    shape = (1, 4, 150, 64) if layout == "HND" else (1, 150, 4, 64)
    workspace = torch.randn(4, *shape, generator=torch.Generator().manual_seed(7)).to(device, torch.bfloat16)
    q, k, v, spare = workspace.unbind(0)
    q, k, v = q.transpose(1, 2).contiguous().transpose(1, 2), k, v  # q non-contiguous, in its own memory
    mask = torch.ones(1, 1, 2, 3, dtype=torch.bool, device=device)
    indices = torch.zeros(1, 4, 150, 1, dtype=torch.int32, device=device)
    calls = {
        "sparge_attention": lambda out: sparge_attention(q, k, v, out=out, tensor_layout=layout),
        "block_sparse_attention": lambda out: block_sparse_attention(q, k, v, mask, out=out, tensor_layout=layout),
        "s2o_attention": lambda out: s2o_attention(q, k, v, out=out, tensor_layout=layout),
        "selected_block_attention": lambda out: selected_block_attention(q, k, v, indices, out=out,
                                                                         tensor_layout=layout),
    }
    interleaved = torch.empty(*shape[:-1], 3, 64, dtype=torch.bfloat16, device=device)  # fused q, k and out slots
    straddling = workspace[1:3].flatten()[100:][: k.numel()].view(shape)  # k's end and v's start
    last_of_k = workspace[1:3].flatten()[k.numel() - 1:][: k.numel()].view(shape)  # k's last element, then v
    for name, call in calls.items():
        for alias, which in ((q, "q"), (k, "k"), (v, "v"), (straddling, "k"), (last_of_k, "k")):
            with pytest.raises(ValueError, match=f"out overlaps {which} in memory"):
                call(alias)
        with pytest.raises(ValueError, match="zero stride"):
            call(torch.empty(shape[0], 1, *shape[2:], dtype=q.dtype, device=device).expand(shape))
        spare.fill_(float("nan"))
        assert call(spare) is spare and torch.isfinite(spare).all(), name  # spare starts where v ends
        before_k = workspace[0].fill_(float("nan"))  # q's first slot, ending where k starts
        assert call(before_k) is before_k and torch.equal(before_k, spare), name
        # the same kernel on CPU; on the GPU another output layout may pick another kernel (bf16 rounding)
        assert relative_l1(spare, call(None)) <= (0 if device == "cpu" else 1e-2), name
        # a zero stride on a dimension of size 1 repeats no element: taken
        rows = torch.full(shape[1:], float("nan"), dtype=q.dtype, device=device)
        batch_view = rows.as_strided(shape, (0, *rows.stride()))
        assert batch_view.stride()[0] == 0 and call(batch_view) is batch_view and torch.equal(batch_view, spare), name
    heads = 1 if layout == "HND" else 2  # two heads written through one zero stride: both onto the same rows
    two = [t.narrow(heads, 0, 2) for t in (q, k, v)]
    with pytest.raises(ValueError, match="zero stride"):
        sparge_attention(*two, out=torch.empty_like(two[0].narrow(heads, 0, 1)).expand(two[0].shape),
                         tensor_layout=layout)
    fused_q, fused_k, fused_out = interleaved.unbind(-2)
    fused_q.copy_(q), fused_k.copy_(k)
    with pytest.raises(ValueError, match="out overlaps q in memory"):  # no shared element: the test is conservative
        sparge_attention(fused_q, fused_k, fused_k, out=fused_out, tensor_layout=layout)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_broadcast_inputs_with_zero_strides_give_their_copies_outputs(layout, device):
    """Expanded views (stride 0: one prompt's q repeated over the batch, one K/V head over the K/V heads) are read
    through their strides, by the Triton kernels and the Hopper kernel's TMA descriptors alike: every entry point
    gives exactly the output of the same call on contiguous copies."""
    from sparge_diffusers import s2o_attention, selected_block_attention
    from sparge_diffusers.llm import pbs_sparge_attention

    g = torch.Generator().manual_seed(11)
    B, H, HK, N, D = 2, 4, 2, 300, 128
    one_q = torch.randn(1, H, N, D, generator=g).to(device, torch.bfloat16)
    one_k, one_v = (torch.randn(B, 1, N, D, generator=g).to(device, torch.bfloat16) for _ in range(2))
    q, k, v = one_q.expand(B, H, N, D), one_k.expand(B, HK, N, D), one_v.expand(B, HK, N, D)
    if layout == "NHD":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    assert 0 in q.stride() and 0 in k.stride() and 0 in v.stride()
    backend = dict(backend="triton") if device == "cpu" else {}
    mask = torch.rand(B, H, 3, 5, generator=g).to(device) < 0.5
    indices = torch.zeros(B, HK, N, 1, dtype=torch.int32, device=device)
    calls = {
        "sparge_attention": lambda *t: sparge_attention(*t, tensor_layout=layout, **backend),
        "sparge_attention causal": lambda *t: sparge_attention(*t, is_causal=True, tensor_layout=layout, **backend),
        "sparge_attention dense": lambda *t: sparge_attention(*t, simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None,
                                                              tensor_layout=layout, **backend),
        "block_sparse_attention": lambda *t: block_sparse_attention(*t, mask, tensor_layout=layout, **backend),
        "s2o_attention": lambda *t: s2o_attention(*t, tensor_layout=layout, **backend),
        "selected_block_attention": lambda *t: selected_block_attention(*t, indices, tensor_layout=layout,
                                                                        **backend),
    }
    if layout == "HND":
        calls["pbs_sparge_attention"] = lambda *t: pbs_sparge_attention(*t, segment=128)
    for name, call in calls.items():
        out = call(q, k, v)
        assert torch.isfinite(out).all(), name
        assert torch.equal(out, call(*(t.contiguous() for t in (q, k, v)))), name


def _every_triton_entry_point(layout, backend):
    """Each entry point that launches Triton kernels reading q/k/v rows, as f(q, k, v) -> a float tensor."""
    from sparge_diffusers import s2o_attention, select_key_blocks, selected_block_attention

    def selected(q, k, v):
        return selected_block_attention(q, k, v, select_key_blocks(q, k, top_k=3, tensor_layout=layout, **backend),
                                        tensor_layout=layout, **backend)

    return {
        "predict_block_mask": lambda q, k, v: predict_block_mask(q, k, tensor_layout=layout, **backend).float(),
        "sparge_attention": lambda q, k, v: sparge_attention(q, k, v, tensor_layout=layout, **backend),
        "sparge_attention stage 2": lambda q, k, v: sparge_attention(q, k, v, pvthreshd=8.0, tensor_layout=layout,
                                                                      **backend),
        "sparge_attention causal": lambda q, k, v: sparge_attention(q, k, v, is_causal=True, tensor_layout=layout,
                                                                     **backend),
        "dense": lambda q, k, v: block_sparse_attention(q, k, v, None, tensor_layout=layout, **backend),
        "s2o_attention": lambda q, k, v: s2o_attention(q, k, v, is_causal=True, tensor_layout=layout, **backend),
        "selected_block_attention": selected,
    }


def test_wide_offsets_rule_and_its_int64_row_path(monkeypatch):
    """Row offsets go int64 exactly where a (batch, head)'s rows reach past int32 (Llama-3.1-8B's q views:
    from 524,289 tokens on), and that path computes what the int32 one does (forced on here: every call wide)."""
    from sparge_diffusers.kernels import _inputs

    def q_view(n, heads=32, d=128):  # transformers' (B, H, N, D) view of a (B, N, H * D) projection
        return torch.empty(1, n, heads * d, device="meta").view(1, n, heads, d).transpose(1, 2)

    assert not _inputs.wide_offsets(q_view(524_288)) and _inputs.wide_offsets(q_view(524_289))
    assert not _inputs.wide_offsets(q_view(524_289).contiguous())
    last = 2**31 - 1  # int32's largest offset: a view whose last element lies exactly there is not wide, one past it is

    def strided(stride_n, stride_d, n):
        return torch.empty(1, device="meta").as_strided((1, 1, n, 128), (0, 0, stride_n, stride_d))

    assert not _inputs.wide_offsets(strided(last - 127, 1, 2)) and _inputs.wide_offsets(strided(last - 126, 1, 2))
    assert not _inputs.wide_offsets(strided(1, last // 127, 1)) and _inputs.wide_offsets(strided(1, last // 127 + 1, 1))
    q, k, v = make_qkv(1, 4, 2, 200, 200, 64, torch.bfloat16, "NHD", seed=12)
    calls = _every_triton_entry_point("NHD", dict(backend="triton"))
    narrow = {name: call(q, k, v) for name, call in calls.items()}
    monkeypatch.setattr(_inputs, "INT32_OFFSET_MAX", 0)
    assert _inputs.wide_offsets(q.transpose(1, 2))
    for name, call in calls.items():
        assert torch.equal(call(q, k, v), narrow[name]), name


@pytest.mark.gpu
def test_rows_past_int32_offsets_give_their_copies_outputs():
    """q, k and v as views of one (1, N, W) buffer whose rows are W elements apart, (N - 1) W > 2^31 (4.3 GB):
    every entry point gives exactly the output of the same call on contiguous copies (before the int64 row path,
    stage 1 ended in an illegal memory access on the H100)."""
    N, H, HK, D = 5000, 2, 1, 128
    W = -(-(2**31 + 2**20) // (N - 1) // 64) * 64
    g = torch.Generator(device="cuda").manual_seed(13)
    buffer = torch.randn(1, N, W, device="cuda", dtype=torch.bfloat16, generator=g)
    heads = buffer[:, :, :(H + 2 * HK) * D].unflatten(-1, (H + 2 * HK, D))  # (1, N, heads, D), NHD views
    q, k, v = heads[:, :, :H], heads[:, :, H:H + HK], heads[:, :, H + HK:]
    copies = [t.contiguous() for t in (q, k, v)]
    for name, call in _every_triton_entry_point("NHD", {}).items():
        out = call(q, k, v)
        torch.cuda.synchronize()
        assert torch.equal(out, call(*copies)), name
    out = torch.full((1, N, W), float("nan"), device="cuda", dtype=torch.bfloat16)[:, :, :H * D].unflatten(-1, (H, D))
    sparge_attention(*copies, is_causal=True, tensor_layout="NHD", out=out)
    assert torch.equal(out, sparge_attention(*copies, is_causal=True, tensor_layout="NHD"))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("backend", ["triton", "reference"])
def test_inputs_that_require_grad_raise_instead_of_losing_the_gradient(backend, device):
    """The kernels have no backward pass: an output computed while autograd records through q, k or v would
    carry no gradient (a training step silently without attention), so every attention entry point raises."""
    from sparge_diffusers import s2o_attention, selected_block_attention
    from sparge_diffusers.llm import pbs_sparge_attention

    q, k, v = (t.to(device) for t in make_qkv(1, 4, 2, 150, 150, 64, torch.bfloat16, "HND", seed=5))
    mask = torch.ones(1, 1, 2, 3, dtype=torch.bool, device=device)
    indices = torch.zeros(1, 2, 150, 1, dtype=torch.int32, device=device)
    calls = {
        "sparge_attention": lambda q, k, v: sparge_attention(q, k, v, backend=backend),
        "block_sparse_attention": lambda q, k, v: block_sparse_attention(q, k, v, mask, backend=backend),
        "s2o_attention": lambda q, k, v: s2o_attention(q, k, v, backend=backend),
        "selected_block_attention": lambda q, k, v: selected_block_attention(q, k, v, indices, backend=backend),
        "pbs_sparge_attention": lambda q, k, v: pbs_sparge_attention(q, k, v, segment=128, backend=backend),
    }
    for name, call in calls.items():
        for which in range(3):  # any one of the three, e.g. LoRA on the value projection only
            inputs = [q, k, v]
            inputs[which] = inputs[which].clone().requires_grad_()
            with pytest.raises(ValueError, match="requires grad.*no backward pass.*torch.no_grad"):
                call(*inputs)
            with torch.no_grad():
                assert not call(*inputs).requires_grad, name
    # the mask prediction has no gradient to lose: it takes such inputs
    grad_q, grad_k = q.clone().requires_grad_(), k.clone().requires_grad_()
    assert torch.equal(predict_block_mask(grad_q, grad_k, backend=backend), predict_block_mask(q, k, backend=backend))


@pytest.mark.parametrize("capability", [(7, 0), (7, 5), (8, 0), (8, 9), (9, 0), (12, 0)])
def test_gpus_older_than_ampere_are_refused_with_their_capability(monkeypatch, capability):
    """Below compute capability 8.0 the attention kernel does not fit even at one pipeline stage: 'auto' and
    'triton' raise naming the GPU's capability and what to use instead; the reference stays available."""
    from sparge_diffusers.kernels import _inputs

    monkeypatch.setattr(_inputs, "_capability_of_index", lambda index: capability)
    gpu = torch.device("cuda", 0)
    refused = capability < (8, 0)
    for backend in ("auto", "triton"):
        if refused:
            with pytest.raises(ValueError, match=rf"cuda:0 has compute capability {capability[0]}\.{capability[1]}; "
                                                 r"the Triton kernels need 8\.0 or newer.*backend='reference'"):
                _inputs.pick_backend(backend, gpu)
        else:
            assert _inputs.pick_backend(backend, gpu) == "triton"
    assert _inputs.pick_backend("reference", gpu) == "reference"
    assert (_inputs.gpu_reason(gpu) is not None) == refused


def test_amd_gpus_are_refused_by_name(monkeypatch):
    """ROCm's PyTorch names AMD GPUs "cuda": untested there, the kernels refuse them rather than run."""
    from sparge_diffusers.kernels import _inputs

    monkeypatch.setattr(torch.version, "hip", "6.4.0")
    monkeypatch.setattr(_inputs, "_capability_of_index", lambda index: (9, 4))  # what an MI300 reports
    with pytest.raises(ValueError, match=r"cuda:0 is an AMD GPU \(ROCm\); .*NVIDIA GPUs only.*backend='reference'"):
        _inputs.pick_backend("auto", torch.device("cuda", 0))
    assert _inputs.pick_backend("reference", torch.device("cuda", 0)) == "reference"


@pytest.mark.parametrize("setting", ["0", "false", "off"])
def test_backend_triton_refuses_tensors_it_cannot_launch_on(setting, monkeypatch):
    """Until session 89 backend="triton" on CPU tensors without Triton's interpreter failed inside Triton with
    "0 active drivers ([]). There should only be one.", and s2o_visit_order ran its PyTorch path for any backend
    name. TRITON_INTERPRET is read as Triton reads it ("false" is off)."""
    from sparge_diffusers import _launch, s2o_visit_order
    from sparge_diffusers.kernels._inputs import AttentionShape, pick_backend
    from sparge_diffusers.permutations import last_block_key_importance

    class Driver:
        def __init__(self, present: bool):
            self.present = present

        @property
        def active(self):
            if not self.present:
                raise RuntimeError("0 active drivers ([]). There should only be one.")
            return self

    q, k, v = make_qkv(1, 2, 1, 150, 150, 64, torch.float16, "HND", seed=0)
    monkeypatch.setenv("TRITON_INTERPRET", setting)
    # a driver set by hand compiles for a target without a GPU (benchmarks/shared_memory.py): left to Triton
    monkeypatch.setattr(_launch, "_driver", Driver(present=True))
    assert pick_backend("triton", torch.device("cpu")) == "triton"
    monkeypatch.setattr(_launch, "_driver", Driver(present=False))  # a machine without a GPU
    launch = "backend='triton': the Triton kernels run on CUDA tensors"
    for call in (lambda: sparge_attention(q, k, v, backend="triton"),
                 lambda: predict_block_mask(q, k, backend="triton"),
                 lambda: block_sparse_attention(q, k, v, None, backend="triton"),
                 lambda: s2o_attention(q, k, v, backend="triton")):
        with pytest.raises(ValueError, match=launch + r".*got tensors on cpu; use backend='reference'"):
            call()
    with pytest.raises(ValueError, match=launch + r".*use backend='torch'"):
        last_block_key_importance(q, k, backend="triton")
    shape = AttentionShape(1, 2, 1, 150, 150, 64)
    stats = (torch.zeros(1, 2, 2, 64), torch.zeros(1, 1, 3, 64), torch.ones(1, 2, 2), torch.ones(1, 1, 3))
    order_args = dict(is_causal=False, scale=0.125, simthreshd1=torch.full((2,), 0.6), segment=2048,
                      attention_sink=False)
    for backend, message in (("triton", launch), ("bogus", "backend must be 'auto', 'triton' or 'reference'")):
        with pytest.raises(ValueError, match=message):
            s2o_visit_order(*stats, shape, backend=backend, **order_args)
    assert s2o_visit_order(*stats, shape, backend="reference", **order_args)[0].shape == (1, 2, 2, 3)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    with pytest.raises(ValueError, match="Triton's interpreter .* runs on CPU tensors, got tensors on meta"):
        sparge_attention(*(t.to("meta") for t in (q, k, v)), backend="triton")


def test_the_capability_test_traces_without_a_graph_break_or_warning(monkeypatch):
    """The seams ask ``unsupported_reason`` inside compiled models: the capability lookup must trace (fullgraph)
    and must not warn (Dynamo warns about calls through functools.lru_cache wrappers)."""
    import collections
    import warnings

    from sparge_diffusers.kernels import _inputs

    properties = collections.namedtuple("properties", "major minor")  # a value Dynamo can hold, as it holds CUDA's
    for capability, expected in (((7, 5), 1.0), ((9, 0), 2.0)):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index, c=capability: properties(*c))
        torch._dynamo.reset()
        step = torch.compile(lambda x: x + (1 if _inputs.gpu_reason(torch.device("cuda", 0)) else 2), fullgraph=True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            assert step(torch.zeros(2)).tolist() == [expected] * 2
        assert not [w for w in caught if "lru_cache" in str(w.message)]


@pytest.mark.parametrize("shared,head_dim,refused", [(101376, 256, True), (101376, 128, False), (101376, 136, True),
                                                    (166912, 256, False), (232448, 256, False),
                                                    (147456, 256, False), (147455, 256, True)])  # the bound
def test_head_dims_above_128_need_the_shared_memory_of_an_a100_or_h100(monkeypatch, shared, head_dim, refused):
    """Compiled for sm89 at D = 256 the mask walk needs 112 KB with one stage, more than the 99 KB per block of GPUs
    of compute capability 8.6 / 8.9 / 12.0: there such head dims raise (naming both sizes) and ``unsupported_reason``
    names them, so the seams fall back to SDPA; A100s (163 KB) and H100s (227 KB) run them."""
    from sparge_diffusers.kernels import _inputs

    gpu = torch.device("cuda", 0)
    monkeypatch.setattr(torch.version, "hip", None)
    monkeypatch.setattr(_inputs, "_capability_of_index", lambda index: (8, 9) if shared < 110000 else (9, 0))
    monkeypatch.setattr(_inputs, "_shared_memory_of_index", lambda index: shared)
    if refused:
        with pytest.raises(ValueError, match=rf"head dim {head_dim} needs 144 KB .* cuda:0 allows {shared // 1024} KB"):
            _inputs.pick_backend("auto", gpu, head_dim)
    else:
        assert _inputs.pick_backend("auto", gpu, head_dim) == "triton"
    assert (_inputs.gpu_reason(gpu, head_dim) is not None) == refused
    assert _inputs.gpu_reason(gpu) is None  # no head dim given: the device alone
    assert _inputs.pick_backend("reference", gpu, head_dim) == "reference"


def test_every_entry_point_hands_the_backend_rule_its_head_dim(monkeypatch):
    """The backend rule refuses head dims above 128 on GPUs with 99 KB of shared memory per block (the test above),
    so each entry point must hand it q's head dim (its last size in either layout), not another of q's sizes: a
    wrong size there would launch a kernel that cannot fit, or refuse one that can. Recorded on the CPU, where the
    rule then picks the reference whatever it is given."""
    from sparge_diffusers import llm, select_key_blocks, selected_block_attention
    from sparge_diffusers.kernels import api, block_selection, compact, selected

    seen = []
    for module in (api, block_selection, compact, selected, llm):
        monkeypatch.setattr(module, "pick_backend", lambda backend, device, head_dim=None, _name=module.__name__,
                            _rule=module.pick_backend: seen.append((_name.split(".")[-1], head_dim)) or
                            _rule(backend, device, head_dim or 0))
    for layout in ("HND", "NHD"):  # every size of q other than the head dim differs from it
        q, k, v = make_qkv(1, 2, 1, 200, 200, 16, torch.float16, layout, seed=0)
        seen.clear()
        mask = predict_block_mask(q, k, tensor_layout=layout, is_causal=True)
        for call in (lambda: sparge_attention(q, k, v, tensor_layout=layout),
                     lambda: block_sparse_attention(q, k, v, mask, tensor_layout=layout, is_causal=True),
                     lambda: s2o_attention(q, k, v, tensor_layout=layout),
                     lambda: compact_block_mask(mask, q, k, tensor_layout=layout, is_causal=True),
                     lambda: selected_block_attention(q, k, v, select_key_blocks(q, k, top_k=2, tensor_layout=layout),
                                                      tensor_layout=layout)):
            call()
        if layout == "HND":
            llm.pbs_sparge_attention(q, k, v, segment=128)
        modules = {"api", "block_selection", "compact", "selected"} | ({"llm"} if layout == "HND" else set())
        assert {name for name, _ in seen} == modules, seen
        assert all(head_dim == 16 for _, head_dim in seen), (layout, seen)


def test_threshold_ranges_are_closed_in_every_form_a_threshold_takes():
    """per_head (every call's check, Python and tensor paths) and check_threshold_values (settings, tuning grids,
    the LLM function's options) take both ends of each range and refuse values past them."""
    from sparge_diffusers.kernels._inputs import check_threshold_values, per_head

    for name, (low, high) in (("simthreshd1", (-1.0, 1.0)), ("cdfthreshd", (0.0, 1.0))):
        for value in (low, high, [low, high], torch.tensor([low, high]), torch.tensor(high)):
            assert per_head(value, 2, name, "cpu", low=low, high=high).tolist() in ([low, high], [low] * 2,
                                                                                    [high] * 2)
        for value in (low, high, [low, high], (high,)):
            check_threshold_values(name, value)
        for bad in (low - 0.5, high + 0.5, math.nan):
            for form in (bad, [low, bad], torch.tensor([low, bad])):
                with pytest.raises(ValueError, match=name):
                    per_head(form, 2, name, "cpu", low=low, high=high)
            for form in (bad, [low, bad]):
                with pytest.raises(ValueError, match=name):
                    check_threshold_values(name, form)
        for form in (None, [], "0.5", [None], True):
            with pytest.raises(ValueError, match=name):
                check_threshold_values(name, form)
    for value in (None, math.inf, 1e-3, [50.0, math.inf]):
        check_threshold_values("pvthreshd", value)
    for bad in (0, 0.0, -1.0, [1.0, 0.0], math.nan, [None]):
        with pytest.raises(ValueError, match="pvthreshd"):
            check_threshold_values("pvthreshd", bad)
    # a bool is no threshold, as check_threshold_values has it: per_head read True as 1.0 (cdfthreshd=True kept every
    # block), and so did the operators' list of floats; a string failed inside torch with a TypeError
    from sparge_diffusers import sparge_attention_op
    from sparge_diffusers.kernels.library import _as_list

    for bad in (True, [0.5, True], torch.tensor([True, False]), "0.5", ["0.5", 0.5], None, {"a": 0.5}):
        with pytest.raises(ValueError, match="cdfthreshd must be a number, one per head or a tensor of them"):
            per_head(bad, 2, "cdfthreshd", "cpu", low=0.0, high=1.0)
    for bad in (True, [True, True], torch.tensor([True, True]), "0.5"):
        with pytest.raises(ValueError, match="cdfthreshd must be a number or a sequence of numbers"):
            _as_list(bad, "cdfthreshd")
    q = torch.randn(1, 2, 64, 16, dtype=torch.float16)
    with pytest.raises(ValueError, match="pvthreshd must be a number or a sequence"):
        sparge_attention_op(q, q, q, pvthreshd=[True, True])
    assert _as_list(torch.tensor([0.5, 1.0]), "cdfthreshd") == [0.5, 1.0] and _as_list(0.5, "cdfthreshd") == [0.5]
    for value in (None, 0, 0.0, 5e-4, math.inf, [0.0, 1e-3]):  # S2O's tau, as s2o_attention's per_head takes it
        check_threshold_values("tau", value)
    for bad in (-1e-6, [0.1, -0.2], math.nan, [], "0.1", True):
        with pytest.raises(ValueError, match="tau"):
            check_threshold_values("tau", bad)


@pytest.mark.gpu
def test_every_entry_point_refuses_a_gpu_older_than_ampere_and_the_seams_fall_back(monkeypatch):
    """The same on a real GPU told it is a 7.5 (a T4): every attention entry point raises before any launch, the
    reference backend still runs, and ``unsupported_reason`` (the diffusers and transformers seams' test) names
    it, so they fall back to SDPA."""
    from sparge_diffusers import s2o_attention, selected_block_attention
    from sparge_diffusers.kernels import _inputs
    from sparge_diffusers.llm import pbs_sparge_attention

    q, k, v = (t.cuda() for t in make_qkv(1, 4, 2, 150, 150, 64, torch.bfloat16, "HND", seed=5))
    monkeypatch.setattr(_inputs, "_capability_of_index", lambda index: (7, 5))
    mask = torch.ones(1, 1, 2, 3, dtype=torch.bool, device="cuda")
    indices = torch.zeros(1, 2, 150, 1, dtype=torch.int32, device="cuda")
    calls = {
        "sparge_attention": lambda **b: sparge_attention(q, k, v, **b),
        "predict_block_mask": lambda **b: predict_block_mask(q, k, **b),
        "block_sparse_attention": lambda **b: block_sparse_attention(q, k, v, mask, **b),
        "s2o_attention": lambda **b: s2o_attention(q, k, v, **b),
        "selected_block_attention": lambda **b: selected_block_attention(q, k, v, indices, **b),
        "pbs_sparge_attention": lambda **b: pbs_sparge_attention(q, k, v, segment=128, **b),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="compute capability 7.5"):
            call()
        assert call(backend="reference") is not None, name
    assert "compute capability 7.5" in _inputs.unsupported_reason(q, k, v)


def test_unsupported_reason_names_what_the_kernels_refuse_and_passes_the_rest():
    """The seams' test (diffusers and transformers fall back to SDPA where it names a reason): head dims 16-256 in
    steps of 8, non-empty 4-D inputs of one batch size, k and v alike, causal with unequal lengths only with a
    variant, no autograd; None where the kernels run, non-causal calls by default."""
    from sparge_diffusers.kernels._inputs import unsupported_reason

    def qkv(D=64, nq=100, nkv=100, B=(1, 1)):
        return torch.randn(B[0], 4, nq, D), torch.randn(B[1], 2, nkv, D), torch.randn(B[1], 2, nkv, D)

    for D in (16, 24, 256):
        assert unsupported_reason(*qkv(D)) is None, D
    for D in (8, 20, 264):
        assert unsupported_reason(*qkv(D)) == f"head dim {D}"
    q, k, v = qkv(nq=60)
    assert unsupported_reason(q, k, v) is None  # non-causal by default: unequal lengths are fine
    assert "causal_variant" in unsupported_reason(q, k, v, is_causal=True)
    assert unsupported_reason(q, k, v, is_causal=True, causal_variant="lower_right") is None
    assert "empty input" in unsupported_reason(*qkv(nq=0))
    assert "batch sizes differ" in unsupported_reason(*qkv(B=(2, 1)))
    assert "must be 4-D" in unsupported_reason(q[0], k[0], v[0])
    assert "k and v shapes differ" in unsupported_reason(q, k, v[:, :, :50])
    assert "requires grad" in unsupported_reason(q.requires_grad_(), k, v)


def test_cpu_float32_runs_the_reference():
    q, k, v = make_qkv(1, 2, 2, 130, 130, 64, torch.float32, "HND", seed=4)
    out = sparge_attention(q, k, v, cdfthreshd=1.0, pvthreshd=None)
    assert out.dtype == torch.float32
    assert relative_l1(out, dense_reference(q, k, v, False, "HND")) < 1e-5


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gpu_kernels_match_reference(causal, dtype):
    q, k, v = llm_like_qkv(3000, heads=8, kv_heads=2, head_dim=128, dtype=dtype, device="cuda", seed=2)
    out, stats = sparge_attention(q, k, v, is_causal=causal, pvthreshd=8, return_sparsity=True,
                                  out=poisoned_like(q))
    mask = predict_block_mask(q, k, is_causal=causal)
    ref, ref_stats = block_sparse_attention(q.cpu(), k.cpu(), v.cpu(), mask.cpu(), is_causal=causal,
                                            pvthreshd=8, return_sparsity=True, backend="reference")
    assert not torch.isnan(out).any()
    assert relative_l1(out.cpu(), ref) < L1_TOL[dtype]
    torch.testing.assert_close(stats.qk_skipped.cpu(), ref_stats.qk_skipped)


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_head_dim_256_matches_reference_in_every_kernel(causal):
    """Head dim 256 (Gemma 2 / 3) on a GPU, where the Triton kernels run it (64-key tiles, two stages): the whole
    method with stage 2, a random mask, the dense mode, a cap with sink logits (under a sliding window when causal),
    S2O and FSA, each against the float32 reference with its output poisoned first."""
    from sparge_diffusers import s2o_attention, select_key_blocks, selected_block_attention

    q, k, v = llm_like_qkv(2500, heads=8, kv_heads=2, head_dim=256, dtype=torch.bfloat16, device="cuda", seed=3)
    mask = torch.rand(1, 8, math.ceil(2500 / BLOCK_Q), math.ceil(2500 / BLOCK_K), device="cuda") < 0.3
    sinks = torch.linspace(-2.0, 3.0, 8, device="cuda")
    window = 700 if causal else None
    blocks = select_key_blocks(q, k, top_k=8, is_causal=causal)
    calls = {
        "whole": lambda **b: sparge_attention(q, k, v, is_causal=causal, pvthreshd=8, **b),
        "mask": lambda **b: block_sparse_attention(q, k, v, mask, is_causal=causal, **b),
        "dense": lambda **b: block_sparse_attention(q, k, v, None, is_causal=causal, **b),
        "cap, sinks": lambda **b: block_sparse_attention(q, k, v, None if causal else mask, is_causal=causal,
                                                         sliding_window=window, softcap=20.0, sink_logits=sinks, **b),
        "s2o": lambda **b: s2o_attention(q, k, v, is_causal=causal, **b),
        "fsa": lambda **b: selected_block_attention(q, k, v, blocks, is_causal=causal, **b),
    }
    for name, call in calls.items():
        out = call(out=poisoned_like(q))
        assert not torch.isnan(out).any(), name
        assert relative_l1(out.float(), call(backend="reference").float()) < L1_TOL[torch.bfloat16], name


@pytest.mark.gpu
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_gpu_tma_io_path_equals_pointer_path(D, layout, monkeypatch):
    from sparge_diffusers.kernels import attention, attention_hopper

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs sm90")
    monkeypatch.setattr(attention_hopper, "OVERRIDE", False)  # the Triton kernel's two paths
    B, H, N = 2, 6, 3000  # N not a multiple of the 128-row tile
    q, k, v = (t.cuda() for t in make_qkv(B, H, H, N, N, D, torch.bfloat16, layout, seed=D))
    mask = torch.rand(B, H, math.ceil(N / BLOCK_Q), math.ceil(N / BLOCK_K), device="cuda") < 0.3
    seq_dim = 2 if layout == "HND" else 1
    outs = []
    for forced in (True, False):
        monkeypatch.setattr(attention, "TMA_IO_OVERRIDE", forced)
        big = poisoned_like(torch.cat([q, q.narrow(seq_dim, 0, 7)], dim=seq_dim))
        for block_mask in (mask, None):
            out = block_sparse_attention(q, k, v, block_mask, tensor_layout=layout, out=big.narrow(seq_dim, 0, N))
            assert torch.isnan(big.narrow(seq_dim, N, 7)).all(), "rows past N were written"
            assert not torch.isnan(out).any()
            outs.append(out.clone())
    assert torch.equal(outs[0], outs[2]) and torch.equal(outs[1], outs[3])


@pytest.mark.gpu
def test_gpu_tma_io_follows_its_rule(monkeypatch):
    """``use_tma_io`` on an sm90 GPU: TMA for non-causal calls on 16-byte aligned tiles of a power-of-two head dim,
    the pointer path for anything else (a descriptor of a misaligned tensor or of a 96-wide box cannot be built or
    gives a wrong tile). The test above forces each path; this checks the choice, which no output shows."""
    from sparge_diffusers.kernels import attention
    from sparge_diffusers.kernels._inputs import check_attention_inputs

    if torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("TMA needs sm90")

    def chooses_tma(q, out=None, causal=False):
        shape = check_attention_inputs(q, q, q, tensor_layout="HND", is_causal=causal)
        return attention.use_tma_io(q, q if out is None else out, shape, causal)

    q = torch.zeros(2, 3, 300, 128, device="cuda", dtype=torch.bfloat16)
    assert chooses_tma(q) and chooses_tma(q.transpose(1, 2).contiguous().transpose(1, 2))  # NHD storage
    assert chooses_tma(torch.zeros(2, 3, 300, 64, device="cuda", dtype=torch.float16))
    assert not chooses_tma(q, causal=True)
    assert not chooses_tma(torch.zeros(2, 3, 300, 96, device="cuda", dtype=torch.bfloat16))
    flat = torch.zeros(2 * 3 * 300 * 128 + 8, device="cuda", dtype=torch.bfloat16)
    assert not chooses_tma(flat[1:].narrow(0, 0, q.numel()).view(q.shape))  # base 2 bytes off
    assert chooses_tma(flat[8:].narrow(0, 0, q.numel()).view(q.shape))  # base 16 bytes on
    assert not chooses_tma(q, out=flat[1:].narrow(0, 0, q.numel()).view(q.shape))  # the output's base
    rows = torch.zeros(2, 3, 300, 132, device="cuda", dtype=torch.bfloat16)[..., :128]  # 264-byte rows
    assert not chooses_tma(rows)
    assert not chooses_tma(q.cpu())
    for forced in (True, False):
        monkeypatch.setattr(attention, "TMA_IO_OVERRIDE", forced)
        assert chooses_tma(q, causal=True) is forced


@pytest.mark.parametrize("causal", [False, True])
def test_fused_index_equals_mask_to_index(causal):
    from sparge_diffusers.kernels._inputs import check_attention_inputs
    from sparge_diffusers.kernels.attention import block_mask_to_index
    from sparge_diffusers.kernels.attention_hopper import new_tail_schedule
    from sparge_diffusers.kernels.predict import predict_block_mask_triton

    q, k, _ = make_qkv(1, 2, 1, 450, 450, 64, torch.float16, "HND", seed=11)
    q, k = q + 1.0, k + 1.5
    shape = check_attention_inputs(q, k, None, tensor_layout="HND", is_causal=causal)
    theta, tau = torch.full((2,), 0.3), torch.full((2,), 0.8)
    tail, ref_tail = (new_tail_schedule(shape, q.device, 3)[0] for _ in range(2))
    mask, (index, count, n_full) = predict_block_mask_triton(q, k, shape, is_causal=causal, scale=0.125,
                                                             simthreshd1=theta, cdfthreshd=tau,
                                                             attention_sink=False, tail=tail)
    ref_index, ref_count, ref_full = block_mask_to_index(mask, shape, causal, tail=ref_tail)
    assert torch.equal(tail.sizes, ref_tail.sizes) and sum(tail.sizes.tolist()) == 3
    for bucket, size in enumerate(tail.sizes.tolist()):  # the same tiles in each bucket (any order)
        assert sorted(tail.tiles[bucket, :size].tolist()) == sorted(ref_tail.tiles[bucket, :size].tolist())
    assert torch.equal(count, ref_count) and torch.equal(n_full, ref_full)
    assert torch.equal(count, mask.sum(-1).int())
    for b, h, i in zip(*torch.nonzero(count >= 0, as_tuple=True)):
        c = count[b, h, i]
        assert torch.equal(index[b, h, i, :c], ref_index[b, h, i, :c])
        assert torch.equal(index[b, h, i, :c].long(), torch.nonzero(mask[b, h, i]).flatten())


@pytest.mark.parametrize("B,H,nq_len,nkv,causal,broadcast", [(2, 3, 1000, 777, False, False),
                                                             (1, 2, 1100, 1100, True, True),
                                                             (1, 1, 50, 50, True, False)])
def test_block_mask_to_index_keeps_the_visible_blocks_in_order(B, H, nq_len, nkv, causal, broadcast):
    """The compaction kernel (interpreter) against a restatement: the mask's visible kept blocks ascending,
    their count, and n_full = the blocks needing no element masking (not the ragged last block, not a causal
    diagonal block), which come first. The mask may broadcast over the batch."""
    from sparge_diffusers.kernels import attention
    from sparge_diffusers.kernels._inputs import causal_block_straddles, causal_block_visible, check_attention_inputs

    shape = check_attention_inputs(torch.zeros(B, H, nq_len, 64), torch.zeros(B, H, nkv, 64), None,
                                   tensor_layout="HND", is_causal=causal)
    nq, nk = shape.q_blocks, shape.k_blocks
    g = torch.Generator().manual_seed(nq_len)
    mask = torch.rand(1 if broadcast else B, H, nq, nk, generator=g) < 0.4
    index, count, n_full = attention.block_mask_to_index(mask, shape, causal)
    visible = torch.ones(nq, nk, dtype=torch.bool)
    needs_masking = torch.zeros(nq, nk, dtype=torch.bool)
    needs_masking[:, -1] = nkv % BLOCK_K != 0
    if causal:
        visible = causal_block_visible(nq, nk, nkv, torch.device("cpu"))
        needs_masking |= causal_block_straddles(nq, nk, nkv, torch.device("cpu"))
    kept = mask.expand(B, H, nq, nk) & visible
    assert torch.equal(count, kept.sum(-1).int())
    assert torch.equal(n_full, (kept & ~needs_masking).sum(-1).int())
    for b in range(B):
        for h in range(H):
            for i in range(nq):
                blocks = index[b, h, i, :count[b, h, i]].long()
                assert torch.equal(blocks, torch.nonzero(kept[b, h, i]).flatten())
                assert not needs_masking[i, blocks[:n_full[b, h, i]]].any()


def test_relative_l1_compares_equal_shapes_only():
    """An HND output against an NHD reference with one head broadcast to a (N, N) comparison and gave a number;
    two all-zero tensors gave inf (maximal error) for identical outputs."""
    out = torch.randn(1, 1, 20, 8)
    with pytest.raises(ValueError, match=r"equal shapes, got \(1, 1, 20, 8\) and \(1, 20, 1, 8\)"):
        relative_l1(out, out.transpose(1, 2))
    assert relative_l1(out, out) == 0 and relative_l1(torch.zeros(3), torch.zeros(3)) == 0
    assert relative_l1(torch.ones(3), torch.zeros(3)) == math.inf
    assert math.isnan(relative_l1(torch.tensor([math.nan]), torch.ones(1)))
    assert relative_l1(2 * out, out) == pytest.approx(1.0)
    assert relative_l1(torch.tensor([0.3]), torch.tensor([0.2])) == pytest.approx(0.5)  # a reference summing below 1


def test_sampled_relative_l1_matches_the_full_metric_and_wants_hnd():
    """The benchmarks' row-sampled metric: with every row sampled it is relative_l1 against exact attention;
    an NHD output would have been indexed along its heads."""
    from sparge_diffusers.workloads import sampled_relative_l1

    q, k, v = (torch.randn(1, 2, 100, 64) for _ in range(3))
    out = sparge_attention(q, k, v, simthreshd1=-1.0, cdfthreshd=0.5, backend="reference")
    exact = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double())
    assert sampled_relative_l1(out, q, k, v, False, rows=100) == pytest.approx(relative_l1(out, exact), rel=1e-5)
    with pytest.raises(ValueError, match="out must be"):
        sampled_relative_l1(out.transpose(1, 2), q, k, v, False)
    for rows in (0, -5, True, 2.5):  # until session 89: NaN, all rows but five, one row, a TypeError
        with pytest.raises(ValueError, match="rows must be a positive int"):
            sampled_relative_l1(out, q, k, v, False, rows=rows)
