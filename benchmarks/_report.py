"""Shared by the benchmark scripts: print the table, write the JSON results and the table beside them."""

import time

from sparge_diffusers._json import write_json


def save_report(results: dict, table: str, out: str | None) -> None:
    """Print ``table``; with ``out`` (a .json path) write ``results`` there and the table to the .txt beside it."""
    print(table)
    if out:
        write_json(out, results)
        with open(out.rsplit(".", 1)[0] + ".txt", "w") as f:
            f.write(table + "\n")


def graph_ms(fn) -> float:
    """Median kernel ms of ``fn`` from CUDA-graph replays (Triton's do_bench_cudagraph, as benchmarks/attention.py
    times): no host time in it, for every method alike."""
    import triton.testing

    return float(triton.testing.do_bench_cudagraph(fn, rep=100, return_mode="median"))


def fastest_graph_ms(calls: dict, rounds: int = 3) -> dict[str, float]:
    """Per name of ``calls`` (no-argument callables), the fastest of ``rounds`` interleaved :func:`graph_ms`
    timings (each round times every call once, so a drift of the GPU's clocks spreads over all of them)."""
    times: dict[str, float] = {}
    for _ in range(rounds):
        for name, fn in calls.items():
            times[name] = min(times.get(name, float("inf")), graph_ms(fn))
    return times


def exact_causal_rows(q, k, v, rows, *, window: int = 0, chunk: int = 0, sinks=None, softcap: float | None = None):
    """float32 causal attention of (B, H, N, D) inputs (grouped-query heads) for the query rows ``rows`` only, the
    accuracy reference of the LLM-shaped benchmarks: under a sliding window of ``window`` keys (0: none), within
    chunks of ``chunk`` positions (0: none; Llama 4's chunked attention), with the scores soft-capped
    (c * tanh(s / c)) and learned sink logits (one more logit per row, its weight dropped) where given."""
    import math

    import torch

    group = q.shape[1] // k.shape[1]
    keys = torch.arange(k.shape[2], device=q.device)
    allowed = keys[None, :] <= rows[:, None]
    if window:
        allowed &= keys[None, :] > rows[:, None] - window
    if chunk:
        allowed &= keys[None, :] // chunk == rows[:, None] // chunk
    scores = (q[:, :, rows].float() @ k.float().repeat_interleave(group, 1).transpose(-1, -2)) * q.shape[-1] ** -0.5
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    scores = scores.masked_fill(~allowed, -math.inf)
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().view(1, -1, 1, 1).expand(*scores.shape[:3], 1)], dim=-1)
    return torch.softmax(scores, dim=-1)[..., :k.shape[2]] @ v.float().repeat_interleave(group, 1)


def sampled_rows(n: int, count: int = 1024):
    """``count`` query rows of ``n`` drawn once (seed 0), ascending, on the GPU: where the references are computed."""
    import torch

    rows = torch.randperm(n, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0))[:count]
    return rows.sort().values


def cases_arguments(doc: str, default_cases: str, argv=None, default_heads: str | None = None):
    """The ``--cases N:W,...`` and ``--out`` arguments of the length-by-window benchmarks, and with ``default_heads``
    a ``--heads H:H_KV:D`` argument (query heads, K/V heads, head dim; parsed into ``heads`` as three ints)."""
    import argparse

    ap = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=default_cases)
    ap.add_argument("--out", default=None)
    if default_heads is not None:
        ap.add_argument("--heads", default=default_heads, type=lambda s: tuple(int(x) for x in s.split(":")))
    return ap.parse_args(argv)


def timed(fn, reps: int = 5, warmup: int = 3) -> float:
    """Median wall ms of ``fn`` on CUDA (synchronised around each call) after ``warmup`` calls.

    Whole diffusers steps settle over their first calls (H100, SD3's sparse step: 114, 111, 107, then 104 ms),
    so one warm-up call and a median of 3 had left run-to-run swings of 126-185 ms in the pipelines table."""
    import torch

    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(1000 * (time.perf_counter() - start))
    return sorted(times)[len(times) // 2]
