"""Float32 PyTorch reference of every kernel, written for clarity rather than speed.

The tests use these functions as the oracle, and on CPU tensors the public functions run them
(so pipelines can be tested without a GPU). They follow SpargeAttn (arXiv 2502.18137) Sec. 3.2-3.4 and
Algorithm 1, with the same deliberate choices as the Triton kernels (each marked "departure" below).
"""

from __future__ import annotations

import math

import torch

from ._inputs import (
    BLOCK_K,
    BLOCK_Q,
    AttentionShape,
    TensorLayout,
    causal_block_straddles,
    causal_block_visible,
    key_blocks_needing_masking,
    to_hnd,
)
from .stats import SparsityStats, sparsity_stats

LOG2E = 1.4426950408889634


def _normalised(acc: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """acc / l per row; rows without a finite score (l == 0: no visible key, or -inf on every one) give zeros, as
    SDPA does (torch's safe softmax), and a NaN normaliser (NaN or inf in q or k) stays NaN as in SDPA instead of
    turning into zeros."""
    return torch.where(l[..., None] == 0, 0.0, acc / torch.where(l == 0, 1.0, l)[..., None])


def _with_sink(acc: torch.Tensor, l: torch.Tensor, m: torch.Tensor, sink: torch.Tensor
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """(acc, l) of an online softmax whose running max is ``m`` (log2 units), after one more term exp2(sink) that
    has no value vector (a learned attention sink, in the same units): both rescaled to max(m, sink), the sink's
    weight added to l. A row that saw no key keeps acc = 0, so its output stays zero."""
    top = torch.maximum(m, sink)
    top = torch.where(top == -math.inf, 0.0, top)  # no key and no sink (a -inf logit): nothing to rescale
    alpha = torch.exp2(m - top)
    return acc * alpha[..., None], l * alpha + torch.exp2(sink - top)


def _row_max(s: torch.Tensor) -> torch.Tensor:
    """Each row's largest score (last dim), ignoring NaN, -inf for a row of NaN only: the kernels' tl.max does the
    same (maxnum on the GPU, numpy's nanmax in Triton's interpreter). A row holding a NaN score (NaN in a key it
    sees) thus keeps a finite running max and counts in stage 2's test as in the kernel; its output is NaN
    all the same, through its P."""
    return torch.where(s.isnan(), -math.inf, s).amax(-1)


def _tile_gap(m_local: torch.Tensor, m_new: torch.Tensor) -> torch.Tensor:
    """Each row's m_local - m_new for stage 2's test, -inf for rows that must not count, as in the kernel: rows
    with no visible key in the tile or only NaN scores (m_local = -inf) and rows with a +inf score, now or in an
    earlier tile (m_local or m_new = +inf; their output is NaN). torch's max propagates NaN, so without this one
    such row makes the tile's gap NaN, the test ``gap > -pvthreshd`` False, and the other rows of the query block
    lose the tile's P.V (finite, wrong outputs: the reference did this until session 76; the kernel never did)."""
    ok = torch.isfinite(m_local) & torch.isfinite(m_new)
    return torch.where(ok, m_local - m_new, -math.inf)


def reference_block_statistics(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block mean token and mean pairwise cosine similarity (the paper's CosSim, upstream's "meansim").

    Args:
        x: (B, H, N, D) tensor.
        block_size: tokens per block; the last block may be shorter and is averaged over its own tokens.
    Returns:
        means (B, H, nblocks, D) float32 and similarity (B, H, nblocks) float32, where the similarity of a
        block X with n rows is mean_{a,b} cos(x_a, x_b) over all n^2 ordered pairs (diagonal included).
    """
    xp, counts = _padded_blocks(x, block_size)
    means = xp.sum(dim=3) / counts[:, None]
    unit = xp / xp.norm(dim=-1, keepdim=True).clamp(min=1e-12)  # padded rows stay zero
    gram = unit @ unit.transpose(-1, -2)
    similarity = gram.sum(dim=(-1, -2)) / counts**2
    return means, similarity


def _padded_blocks(x: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (B, H, N, D) in float32, zero-padded to whole blocks: (B, H, nblocks, block_size, D), and each block's
    count of real tokens (nblocks,)."""
    B, H, N, D = x.shape
    nb = math.ceil(N / block_size)
    xp = torch.nn.functional.pad(x.float(), (0, 0, 0, nb * block_size - N)).view(B, H, nb, block_size, D)
    counts = torch.full((nb,), float(block_size), device=x.device)
    counts[-1] = N - (nb - 1) * block_size
    return xp, counts


def _mass_at_or_above(p: torch.Tensor) -> torch.Tensor:
    """For each entry p_j of the last dim: sum of all entries >= p_j (TopCdf's cumulative mass)."""
    asc, _ = torch.sort(p, dim=-1)
    suffix = asc.flip(-1).cumsum(-1).flip(-1)
    first_ge = torch.searchsorted(asc.contiguous(), p.contiguous(), right=False)
    # a NaN entry (a query block holding NaN, whose row stage 1 forces on anyway) finds no place: clamp it
    return torch.gather(suffix, -1, first_ge.clamp(max=p.shape[-1] - 1))


def reference_prediction_details(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    is_causal: bool,
    scale: float,
    simthreshd1: torch.Tensor,
    cdfthreshd: torch.Tensor,
    attention_sink: bool,
    tensor_layout: TensorLayout = "HND",
    key_segment: int = BLOCK_K,
    causal_offset: int = 0,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> dict[str, torch.Tensor]:
    """Stage 1 with every intermediate exposed (used by tests to locate borderline decisions).
    ``key_segment``: keys permuted within segments of that many positions (``_inputs.PermutedKeys``);
    ``causal_offset``: query row i sits at causal position i + causal_offset (``AttentionShape.causal_offset``);
    ``sliding_window``: blocks wholly outside every query's window are hidden, as under causal masking;
    ``softcap``: the compressed scores soft-capped (c * tanh(s / c)) as the attention scores are."""
    qh, kh = to_hnd(q, tensor_layout), to_hnd(k, tensor_layout)
    B, H, Nq, D = qh.shape
    HK, Nkv = kh.shape[1], kh.shape[2]
    q_means, q_sim = reference_block_statistics(qh, BLOCK_Q)
    k_means, k_sim = reference_block_statistics(kh, BLOCK_K)
    group = H // HK
    k_means = k_means.repeat_interleave(group, dim=1)
    k_sim = k_sim.repeat_interleave(group, dim=1)
    nq, nk = q_means.shape[2], k_means.shape[2]
    theta = simthreshd1.view(1, H, 1).to(q_sim.device)
    q_similar = q_sim > theta  # (B, H, nq)
    k_similar = k_sim > theta  # (B, H, nk)

    scores = (q_means @ k_means.transpose(-1, -2)) * scale  # compressed Q.K^T, (B, H, nq, nk)
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    visible = torch.ones(nq, nk, dtype=torch.bool, device=q.device)
    if is_causal:
        visible = causal_block_visible(nq, nk, Nkv, q.device, key_segment, q_len=Nq, causal_offset=causal_offset,
                                       sliding_window=sliding_window)
    # Non-self-similar key blocks are not represented by their mean: keep them out of the softmax.
    scores = scores.masked_fill(~k_similar[:, :, None, :] | ~visible, -math.inf)
    row_max = scores.amax(-1, keepdim=True)
    p = torch.exp(scores - torch.where(torch.isinf(row_max), 0.0, row_max))  # unnormalised softmax
    total = p.sum(-1, keepdim=True)
    mass = _mass_at_or_above(p)
    tau = cdfthreshd.view(1, H, 1, 1).to(p.device)
    # TopCdf: keep the top entries whose cumulative probability reaches tau. Departure from the paper's
    # sort-based code: entries with equal probability are kept or dropped together.
    selected = (mass <= tau * total) | (tau >= 1)
    # Like upstream, a row always keeps its most probable block (the paper's TopCdf can select none).
    selected |= (p == p.amax(-1, keepdim=True)) & (total > 0)
    mask = selected & k_similar[:, :, None, :] & visible
    mask |= ~q_similar[:, :, :, None]  # Eq. 5: rows of non-self-similar query blocks are computed in full
    mask |= ~k_similar[:, :, None, :]  # Eq. 5: columns of non-self-similar key blocks too
    if attention_sink:
        mask[..., 0] = True
    if is_causal:
        # Departure: the diagonal key blocks are always kept, so every query row sees at least itself (with
        # permuted keys: every block of the segments the query block overlaps, as PBS-Attn computes them).
        mask |= causal_block_straddles(nq, nk, Nkv, q.device, key_segment, q_len=Nq, causal_offset=causal_offset)
        mask &= visible
    return {
        "mask": mask,
        "q_similarity": q_sim,
        "k_similarity": k_sim,
        "probability": p / total.clamp(min=1e-30),
        "mass": mass / total.clamp(min=1e-30),
        "visible": visible,
    }


def reference_predict_block_mask(q, k, **kwargs) -> torch.Tensor:
    """Stage 1: the block mask M_g, (B, H, ceil(Nq/128), ceil(Nkv/64)) bool."""
    return reference_prediction_details(q, k, **kwargs)["mask"]


def reference_block_sparse_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    block_mask: torch.Tensor,
    *,
    shape: AttentionShape,
    is_causal: bool,
    scale: float,
    pvthreshd: torch.Tensor | None,
    tensor_layout: TensorLayout = "HND",
    key_positions: torch.Tensor | None = None,
    key_segment: int = BLOCK_K,
    sink_logits: torch.Tensor | None = None,
    softcap: float | None = None,
) -> tuple[torch.Tensor, SparsityStats]:
    """Block-sparse FlashAttention with the sparse online softmax (stage 2), tile by tile, in float32.

    ``key_positions`` (B|1, H_kv|1, Nkv) and ``key_segment``: keys stored permuted within segments
    (``_inputs.PermutedKeys``); the causal test then compares each key's original position with the query's.
    Query row i sits at causal position i + ``shape.causal_offset``.

    Key blocks of each query block are visited in the kernel's order (``attention.block_mask_to_index``): those
    that need no element masking, then the masked ones, each in ascending order. Only a sliding window makes this
    differ from Algorithm 1's ascending order (the window's first blocks are masked), and stage 2's test depends on
    the order (CPU statistics seed 35714: a window's edge walked first here, last in the kernel, until session
    112). For each tile the running max, normaliser and output rescale are updated as in Eq. 1; the P.V product
    is skipped when max over the tile's rows of (m_local - m_new) * scale * log2(e) <= -pvthreshd (upstream's
    units; the paper's lambda = -pvthreshd * ln 2; rows with no visible key or with NaN or inf scores left out).
    Departure: the granularity is the whole 128-row tile rather than a warp's 16 rows. Following Algorithm 1
    line 13, the row sums still enter the normaliser when P.V is skipped. Query rows that see no key get a zero
    output. ``sink_logits`` (H,): each row's softmax also takes exp(sink_logits[h]) with no value vector
    (gpt-oss's learned sinks), added to the normaliser at the end. ``softcap`` c: the scores are
    c * tanh(s / c) before masking (Gemma 2's logit soft-capping).
    """
    qh, kh, vh = (to_hnd(t, tensor_layout).float() for t in (q, k, v))
    B, H, Nq, D = qh.shape
    group = H // kh.shape[1]
    kh = kh.repeat_interleave(group, dim=1)
    vh = vh.repeat_interleave(group, dim=1)
    if key_positions is None:
        key_positions = torch.arange(shape.kv_len, device=q.device).view(1, 1, -1)
    key_positions = key_positions.to(q.device).long().expand(B, kh.shape[1] // group, -1)
    key_positions = key_positions.repeat_interleave(group, dim=1)  # (B, H, Nkv)
    nq, nk = shape.q_blocks, shape.k_blocks
    mask = block_mask.to(torch.bool).expand(B, H, nq, nk)
    if is_causal:
        mask = mask & causal_block_visible(nq, nk, shape.kv_len, q.device, key_segment, q_len=shape.q_len,
                                           causal_offset=shape.causal_offset, sliding_window=shape.sliding_window)
    thr = None if pvthreshd is None else pvthreshd.view(1, H).to(q.device)
    sink = None if sink_logits is None else (sink_logits.to(q.device).float() * LOG2E).view(1, H, 1)
    out = torch.zeros_like(qh)
    qk_counts = mask.sum(-1).to(torch.int64)
    pv_counts = torch.zeros(B, H, nq, dtype=torch.int64, device=q.device)
    needs_masking = key_blocks_needing_masking(nq, nk, shape.kv_len, torch.device("cpu"), key_segment,
                                               is_causal=is_causal, q_len=shape.q_len,
                                               causal_offset=shape.causal_offset,
                                               sliding_window=shape.sliding_window).tolist()
    for i in range(nq):
        rows = slice(i * BLOCK_Q, min((i + 1) * BLOCK_Q, Nq))
        qi = qh[:, :, rows]
        n_rows = qi.shape[2]
        m = torch.full((B, H, n_rows), -math.inf, device=q.device)
        l = torch.zeros(B, H, n_rows, device=q.device)
        acc = torch.zeros(B, H, n_rows, D, device=q.device)
        q_pos = torch.arange(rows.start, rows.stop, device=q.device) + shape.causal_offset  # causal positions
        for j in sorted(range(nk), key=lambda j: (needs_masking[i][j], j)):  # the kernel's walk
            active = mask[:, :, i, j]  # (B, H)
            if not active.any():
                continue
            cols = slice(j * BLOCK_K, min((j + 1) * BLOCK_K, shape.kv_len))
            s = (qi @ kh[:, :, cols].transpose(-1, -2)) * scale
            if softcap is not None:
                s = softcap * torch.tanh(s / softcap)
            s = s * LOG2E  # log2 domain, like the kernel
            if is_causal:
                k_pos = key_positions[:, :, cols]  # (B, H, keys): original positions
                hidden = k_pos[:, :, None, :] > q_pos[:, None]
                if shape.sliding_window is not None:  # the query at position p sees keys p - W + 1 .. p
                    hidden |= k_pos[:, :, None, :] <= q_pos[:, None] - shape.sliding_window
                s = s.masked_fill(hidden, -math.inf)
            m_local = _row_max(s)
            m_new = torch.maximum(m, m_local)
            # rows without a finite score yet (no visible key, or -inf on every one: the tile adds nothing to
            # them, as in the kernel); a row with a +inf score keeps it, as in the kernel, so that its P
            # (inf - inf) and output are NaN as in SDPA, even where stage 2 skips its P.V
            m_use = torch.where(m_new == -math.inf, 0.0, m_new)
            alpha = torch.exp2(m - m_use)
            p = torch.exp2(s - m_use[..., None])
            do_pv = active
            if thr is not None:
                gap = _tile_gap(m_local, m_new).amax(-1)  # (B, H): the tile's largest row-max gap
                do_pv = active & (gap > -thr)
            a = active[..., None]
            l = torch.where(a, l * alpha + p.sum(-1), l)
            acc = torch.where(a[..., None], acc * alpha[..., None], acc)
            acc = torch.where(do_pv[..., None, None], acc + p @ vh[:, :, cols], acc)
            m = torch.where(a, m_new, m)
            pv_counts[:, :, i] += do_pv
        if sink is not None:
            acc, l = _with_sink(acc, l, m, sink)
        out[:, :, rows] = _normalised(acc, l)
    stats = sparsity_stats(qk_counts, pv_counts, shape, is_causal)
    out = out.to(q.dtype)
    return (out if tensor_layout == "HND" else out.transpose(1, 2)), stats


def reference_ordered_attention(q, k, v, order: tuple[torch.Tensor, ...], *, shape: AttentionShape,
                                is_causal: bool, scale: float, tau: torch.Tensor | None,
                                pvthreshd: torch.Tensor | None, check_every: int = 16,
                                sink_logits: torch.Tensor | None = None
                                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Float32 reference of the S2O ordered walk (kernels/s2o.py), one (batch, head, query block) at a time,
    (B, H, N, D) inputs, visiting order (index, n_unmasked, n_forced, count) from ``s2o_visit_order``.

    Same order, same online softmax in the log2 domain, same stop rule (mean relative gain of the last tile
    below tau, tested every ``check_every`` ranked tiles), same PV skip. Query row i sits at causal position
    i + ``shape.causal_offset``. ``sink_logits`` (H,): learned sinks added to each row's normaliser after the walk
    (the stop test weighs the keys' normaliser only). Returns (out float32, visited, pv_count) on q's device.

    The walk runs on the CPU whatever the inputs' device: it is a loop of tile-sized steps with a data-dependent
    stop, which on a GPU would be thousands of tiny launches and a sync per test.
    """
    device = q.device
    qh, kh, vh = (t.detach().float().cpu() for t in (q, k, v))
    tau = None if tau is None else tau.cpu()
    pvthreshd = None if pvthreshd is None else pvthreshd.cpu()
    sinks = None if sink_logits is None else sink_logits.detach().float().cpu() * LOG2E
    B, H, Nq, D = qh.shape
    group = H // kh.shape[1]
    kh, vh = kh.repeat_interleave(group, 1), vh.repeat_interleave(group, 1)
    index, n_unmasked, n_forced, count = (t.cpu() for t in order)
    out = torch.zeros_like(qh)
    visited = torch.zeros(B, H, shape.q_blocks, dtype=torch.int64)
    pv_count = torch.zeros_like(visited)
    c = scale * LOG2E
    for b in range(B):
        for h in range(H):
            for i in range(shape.q_blocks):
                rows = torch.arange(i * BLOCK_Q, min((i + 1) * BLOCK_Q, Nq))
                positions = rows + shape.causal_offset
                qi = qh[b, h, rows]
                m = torch.full((len(rows),), -math.inf)
                l = torch.zeros(len(rows))
                acc = torch.zeros(len(rows), D)
                n = 0
                while n < int(count[b, h, i]):
                    j = int(index[b, h, i, n])
                    cols = torch.arange(j * BLOCK_K, min((j + 1) * BLOCK_K, shape.kv_len))
                    s = (qi @ kh[b, h, cols].T) * c
                    if is_causal:
                        s = s.masked_fill(cols[None, :] > positions[:, None], -math.inf)
                    m_local = _row_max(s)
                    m_new = torch.maximum(m, m_local)
                    m_use = torch.where(m_new == -math.inf, 0.0, m_new)  # as in reference_block_sparse_attention
                    alpha = torch.exp2(m - m_use)
                    p = torch.exp2(s - m_use[:, None])
                    before = l * alpha
                    l = before + p.sum(-1)
                    acc = acc * alpha[:, None]
                    gap = _tile_gap(m_local, m_new).max()
                    if pvthreshd is None or gap > -float(pvthreshd[h]):
                        acc = acc + p @ vh[b, h, cols]
                        pv_count[b, h, i] += 1
                    m = m_new
                    n += 1
                    ranked = n - int(n_forced[b, h, i])
                    if tau is not None and ranked > 0 and ranked % check_every == 0:
                        gain = torch.where(before > 0, (l - before) / before.clamp(min=1e-30),
                                           torch.where(l > 0, math.inf, 0.0))
                        # a row without a finite score or with a NaN normaliser (NaN or inf in its q, or in a key it
                        # saw) counts zero, as in the kernel (s2o.py's notes)
                        gain = torch.where(l.isnan(), 0.0, gain)
                        if not float(gain.mean()) >= float(tau[h]):
                            break
                visited[b, h, i] = n
                if sinks is not None:
                    acc, l = _with_sink(acc, l, m, sinks[h])
                out[b, h, rows] = _normalised(acc, l)
    return out.to(device), visited.to(device), pv_count.to(device)


def reference_selected_block_attention(q, k, v, block_indices: torch.Tensor, *, shape: AttentionShape,
                                       block_size: int, is_causal: bool, scale: float,
                                       tensor_layout: TensorLayout = "HND", causal_offset: int = 0,
                                       sink_logits: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of each query over the keys of its own selected blocks (``kernels/selected.py``), in float32.

    The selection becomes a dense (Nq, Nkv) key mask per KV head (indices < 0 or past the last block select
    nothing; repeats are harmless), intersected with the causal mask (query row i at key position i +
    ``causal_offset``); a query that sees no key, or scores -inf on every key, gets a zero row. ``sink_logits``
    (H,): one more logit per row, its weight dropped (learned attention sinks).
    """
    qh, kh, vh = (to_hnd(t, tensor_layout).float() for t in (q, k, v))
    B, H, Nq, D = qh.shape
    HK, Nkv = kh.shape[1], kh.shape[2]
    group = H // HK
    n_blocks = math.ceil(Nkv / block_size)
    idx = block_indices.to(q.device).long()
    chosen = torch.zeros(B, HK, Nq, n_blocks + 1, dtype=torch.bool, device=q.device)
    chosen.scatter_(-1, torch.where((idx >= 0) & (idx < n_blocks), idx, n_blocks), True)
    keys = chosen[..., :n_blocks].repeat_interleave(block_size, dim=-1)[..., :Nkv]  # (B, HK, Nq, Nkv)
    if is_causal:
        keys = keys & torch.ones(Nq, Nkv, dtype=torch.bool, device=q.device).tril(diagonal=causal_offset)
    keys = keys.repeat_interleave(group, dim=1)
    s = (qh @ kh.repeat_interleave(group, dim=1).transpose(-1, -2)) * scale
    s = s.masked_fill(~keys, -math.inf)
    if sink_logits is not None:
        s = torch.cat([s, sink_logits.to(q.device).float().view(1, H, 1, 1).expand(B, H, Nq, 1)], dim=-1)
    # rows with no finite score (no visible key, or -inf on every one) get zeros, as SDPA's safe softmax gives
    # (plain softmax gives NaN: until session 77 this reference did); NaN from NaN or inf inputs stays, as in SDPA
    p = torch.softmax(s, dim=-1)[..., :Nkv].masked_fill((s == -math.inf).all(-1, keepdim=True), 0.0)
    out = (p @ vh.repeat_interleave(group, dim=1)).to(q.dtype)
    return out if tensor_layout == "HND" else out.transpose(1, 2)


def reference_block_importance(q, k, *, block_size: int, is_causal: bool, scale: float, sink_blocks: int,
                               local_blocks: int, tensor_layout: TensorLayout = "HND", q_start: int = 0,
                               block_means: torch.Tensor | None = None) -> torch.Tensor:
    """Each query token's importance of each key block (``kernels/block_selection.py``), in float32.

    Importance = the softmax over visible blocks of ``scale * q . mean(K_block)``, summed over the query heads
    of the token's KV head group (in [0, group]); forced blocks (the first ``sink_blocks``, and under causal
    masking the token's own block and the ``local_blocks - 1`` before it) get ``group + 1``; blocks the token
    cannot see get -1. ``q_start``: the position of q's first token (a chunk of the queries). ``block_means``:
    (B, H_kv, n_blocks, D) means to score with instead of k's exact ones (the tests pass the kernel's, rounded
    to its input dtype, to check it at its own precision). Returns (B, H_kv, Nq, n_blocks).
    """
    qh, kh = to_hnd(q, tensor_layout).float(), to_hnd(k, tensor_layout)
    B, H, Nq, D = qh.shape
    HK = kh.shape[1]
    group = H // HK
    if block_means is None:
        keys, counts = _padded_blocks(kh, block_size)  # in float32
        k_means = keys.sum(3) / counts[:, None]  # (B, HK, n_blocks, D)
    else:
        expected = (B, HK, math.ceil(kh.shape[2] / block_size), D)
        if tuple(block_means.shape) != expected:
            raise ValueError(f"block_means must have shape {expected}, got {tuple(block_means.shape)}")
        k_means = block_means.float()
    n_blocks = k_means.shape[2]
    blocks = torch.arange(n_blocks, device=q.device)
    positions = torch.arange(q_start, q_start + Nq, device=q.device)
    visible = (blocks[None, :] * block_size <= positions[:, None]) if is_causal else \
        torch.ones(Nq, n_blocks, dtype=torch.bool, device=q.device)
    scores = (qh.view(B, HK, group, Nq, D) @ k_means[:, :, None].transpose(-1, -2)) * scale
    importance = torch.softmax(scores.masked_fill(~visible, -math.inf), dim=-1).sum(2)  # (B, HK, Nq, n_blocks)
    forced = (blocks[None, :] < sink_blocks) & visible
    if is_causal:
        own = positions // block_size
        forced |= (blocks[None, :] <= own[:, None]) & (blocks[None, :] > own[:, None] - local_blocks)
    importance = torch.where(forced, group + 1.0, importance)
    return importance.masked_fill(~visible, -1.0)


def reference_select_key_blocks(q, k, *, top_k: int, block_size: int, is_causal: bool, scale: float,
                                sink_blocks: int, local_blocks: int, tensor_layout: TensorLayout = "HND",
                                query_chunk: int = 2048, causal_offset: int = 0) -> torch.Tensor:
    """The ``top_k`` most important visible blocks of each query token (see :func:`reference_block_importance`),
    best first, ties to the lower block (a stable sort), -1 past the visible ones; ``query_chunk`` tokens at a
    time; query row i at key position i + ``causal_offset``. Returns (B, H_kv, Nq, top_k) int32."""
    qh = to_hnd(q, tensor_layout)
    kh = to_hnd(k, tensor_layout)
    B, Nq = qh.shape[0], qh.shape[2]
    HK, n_blocks = kh.shape[1], math.ceil(kh.shape[2] / block_size)
    picks = min(top_k, n_blocks)
    result = torch.full((B, HK, Nq, top_k), -1, dtype=torch.int32, device=q.device)
    for start in range(0, Nq, query_chunk):
        stop = min(start + query_chunk, Nq)
        importance = reference_block_importance(qh[:, :, start:stop], kh, block_size=block_size,
                                                is_causal=is_causal, scale=scale, sink_blocks=sink_blocks,
                                                local_blocks=local_blocks, q_start=start + causal_offset)
        values, chosen = importance.sort(dim=-1, descending=True, stable=True)
        values, chosen = values[..., :picks], chosen[..., :picks]
        # A NaN importance (NaN in q, or in a key block the token sees) sorts first and is kept, as in the kernel,
        # whose NaN keys are the largest: a block that may hold the NaN stays selected, so the NaN shows as it
        # does in SDPA (a test of values >= 0 alone once dropped such blocks and their rows came out finite)
        kept = (values >= 0) | values.isnan()
        result[:, :, start:stop, :picks] = torch.where(kept, chosen, -1).to(torch.int32)
    return result
