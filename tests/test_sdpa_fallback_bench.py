"""The helpers of benchmarks/sdpa_fallback.py that decide its figures (CPU; the timing itself needs a GPU): the calls
it builds take the fallback's copying branch, and its float32 reference is the attention those calls ask for."""

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import sdpa_fallback  # noqa: E402  (a broken import must fail here, not skip)

from sparge_diffusers import relative_l1  # noqa: E402

pytest.importorskip("transformers")


@pytest.mark.parametrize("case", [(2, 4, 64, 40, 40, 0), (1, 2, 64, 13, 37, 9)], ids=["left-padded", "window"])
def test_both_answers_match_the_benchmarks_reference_and_the_copy_is_taken(case, monkeypatch):
    module, q, k, v, mask, real = sdpa_fallback.fallback_call(*case, "cpu", torch.Generator().manual_seed(0))
    batch, heads, _, queries, keys, window = case
    assert mask.shape == (batch, 1, queries, keys) and k.shape[1] == 1 and real.shape == (batch, queries)
    if not window:  # prompt b is padded by b * keys // 8 positions: those query rows see no key
        assert real.sum(-1).tolist() == [queries - b * (keys // 8) for b in range(batch)]
    exact, rows = sdpa_fallback.exact_rows(q, k, v, mask, real)
    assert bool(real[:, rows].all())
    copies = []
    original = torch.Tensor.contiguous

    def counting(self, *args, **kwargs):
        copies.append(self.stride(1))
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "contiguous", counting)
    for name, fn in sdpa_fallback.variants(module, q, k, v, mask).items():
        copies.clear()
        with sdpa_fallback.dispatch("no_cudnn"):
            out = fn()
        assert out.shape == (batch, queries, heads, q.shape[-1])
        assert relative_l1(out[:, rows].transpose(1, 2).float(), exact) < 0.01, name  # bf16 inputs and output
        if name == "copy":
            assert copies[:2] == [0, 0]  # K and V: head-stride-0 views made contiguous, the branch measured
