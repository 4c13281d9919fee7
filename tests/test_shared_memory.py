"""Our kernels on GPUs with less shared memory per block than the H100 whose launch settings they carry.

An H100 allows 227 KB per block, an A100 163 KB, GPUs of compute capability 8.6, 8.9 and 12.0 (RTX 3090 / 4090 /
5090, A10, L4, L40S) 99 KB. The attention kernel's 3-stage setting at head dims above 64 needs 160 KB there, and
``_launch.launch_fitting`` runs such a launch with fewer stages. The CPU tests compile the public calls for sm89
and sm80 without a GPU (benchmarks/shared_memory.py: each launch compiled by Triton for the target, and refused
where it would not fit, as Triton's launcher refuses it). The GPU test runs the same calls on an H100 under a 99 KB
limit, against the calls without it, bitwise.
"""

from __future__ import annotations

import json
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
import shared_memory  # noqa: E402  (a broken import must fail here, not skip)
from shared_memory import SHARED_PER_BLOCK, public_calls  # noqa: E402


@pytest.mark.parametrize("capability", [89, 80])
def test_every_launch_fits_the_shared_memory_of_smaller_gpus(capability):
    """Compiled for sm89 (99 KB per block, as sm86 and sm120) and sm80 (163 KB): the attention kernel's 3-stage
    setting at D = 128 needs 160 KB, so on sm89 each of its launches runs with 2 stages instead, and every kernel
    that runs fits."""
    attempts = shared_memory.attempts_for(capability)
    limit = SHARED_PER_BLOCK[capability]
    refused = [i for i, (*_, shared) in enumerate(attempts) if shared > limit]
    for i in refused:  # tried again at once, one stage fewer
        assert attempts[i + 1][:3] == [*attempts[i][:2], attempts[i][2] - 1], attempts[i:i + 2]
    assert all(shared <= limit for i, (*_, shared) in enumerate(attempts) if i not in refused)
    if capability == 80:
        assert not refused
    else:
        assert {tuple(attempts[i][:3]) for i in refused} == {("_sparse_attention_kernel", 128, 3)}
        assert len(refused) >= 4  # the mask walks and the dense mode, causal or not


def test_head_dim_256_fits_an_a100_and_not_a_99_kb_gpu():
    """At head dim 256 every launch compiled for sm80 fits its 163 KB, within the 144 KB that ``_inputs`` asks of a GPU
    before running such head dims (``WIDE_HEAD_SHARED_BYTES``); for sm89 (99 KB) the mask walk does not fit even with
    one stage, which is why such GPUs are refused there instead of launched."""
    from sparge_diffusers.kernels._inputs import WIDE_HEAD_SHARED_BYTES

    attempts = shared_memory.attempts_for(80, head_dims=(256,))
    assert attempts and max(shared for *_, shared in attempts) <= min(WIDE_HEAD_SHARED_BYTES, SHARED_PER_BLOCK[80])
    assert WIDE_HEAD_SHARED_BYTES > SHARED_PER_BLOCK[89]
    with pytest.raises(RuntimeError, match="out of resource: shared memory"):
        shared_memory.attempts_for(89, head_dims=(256,))


def test_committed_table_is_the_committed_results():
    results_dir = os.path.join(os.path.dirname(__file__), "..", "benchmarks", "results")
    with open(os.path.join(results_dir, "shared-memory.json")) as f:
        results = json.load(f)
    with open(os.path.join(results_dir, "shared-memory.txt")) as f:
        assert shared_memory.format_table(results) + "\n" == f.read()
    for capability in ("86", "89", "120"):  # the 99 KB GPUs: only the mask walk's 3-stage setting at D = 128
        refused = [row for row in results["targets"][capability]["rows"] if row["refused"]]
        assert [(r["kernel"], r["head_dim"], r["stages"]) for r in refused] == [("_sparse_attention_kernel", 128, 3)]


def _limit_shared_memory(limit: int) -> None:
    """Make this process's Triton launcher see ``limit`` bytes of shared memory per block (the smaller of that and
    the GPU's: it reads the limit from the driver before each first launch), with the sm90-only kernels off."""
    import triton.compiler.compiler as triton_compiler

    from sparge_diffusers.kernels import attention_hopper, s2o_hopper

    device_limit = triton_compiler.max_shared_mem  # AttributeError: this Triton reads its limit elsewhere
    triton_compiler.max_shared_mem = lambda device: min(device_limit(device), limit)
    attention_hopper.OVERRIDE = s2o_hopper.OVERRIDE = False


def run_under_limit(limit: int, path: str) -> None:
    """Make the public calls on the GPU under ``limit`` (``_limit_shared_memory``); save the outputs to ``path``
    and print each kernel compiled on the way: [kernel, stages asked, stages run, bytes]."""
    from sparge_diffusers import _launch

    _limit_shared_memory(limit)
    fitting, compiled = _launch.launch_fitting, []

    def recording(fn, grid, args, kwargs):
        kernel = fitting(fn, grid, args, kwargs)
        compiled.append((fn.fn.__name__, kwargs.get("num_stages", _launch.DEFAULT_STAGES), kernel.metadata.num_stages,
                         kernel.metadata.shared))
        return kernel

    _launch.launch_fitting = recording
    with torch.no_grad():
        outputs = {name: call().cpu() for name, call in public_calls("cuda", backend="auto").items()}
    torch.save(outputs, path)
    print("COMPILED" + json.dumps(compiled))


@pytest.mark.gpu
def test_calls_under_a_99_kb_limit_equal_the_calls_without_it_on_the_gpu(tmp_path, monkeypatch):
    """On an H100 told it has 99 KB per block (the Triton kernels only, as on sm89), the launches that do not fit
    run with fewer stages (compiled for sm90, the mask walk's 128-key tiles at D = 128 need 224 KB with 3 stages,
    160 KB with 2 and 64 KB with 1; S2O's walk 128 KB with 3 and 96 KB with 2), and every output is bitwise the
    output of the same call without the limit."""
    from sparge_diffusers.kernels import attention_hopper, s2o_hopper

    monkeypatch.setattr(attention_hopper, "OVERRIDE", False)
    monkeypatch.setattr(s2o_hopper, "OVERRIDE", False)
    with torch.no_grad():
        expected = {name: call().cpu() for name, call in public_calls("cuda", backend="auto").items()}
    path = str(tmp_path / "outputs.pt")
    compiled = shared_memory.json_from_fresh_process(
        f"import test_shared_memory as t; t.run_under_limit({SHARED_PER_BLOCK[89]}, {path!r})", "COMPILED",
        os.path.dirname(os.path.abspath(__file__)))
    outputs = torch.load(path)
    assert outputs.keys() == expected.keys()
    differ = {name: (out.float() - expected[name].float()).abs().max().item() for name, out in outputs.items()
              if not torch.equal(out, expected[name])}
    assert not differ, differ
    assert all(shared <= SHARED_PER_BLOCK[89] for *_, shared in compiled)
    fewer = {(name, ran) for name, asked, ran, _ in compiled if ran < asked}
    assert {"_sparse_attention_kernel", "_ordered_attention_kernel"} <= {name for name, _ in fewer}, compiled


def random_calls_under_limit(limit: int, first: int, count: int) -> None:
    """Run test_gpu_random_calls.py's seeds first .. first + count - 1 under ``limit``; print pytest's exit code."""
    os.environ.update(SPARGE_GPU_RANDOM_FIRST=str(first), SPARGE_GPU_RANDOM_CALLS=str(count))
    _limit_shared_memory(limit)
    code = pytest.main(["-q", "-p", "no:cacheprovider", os.path.join(os.path.dirname(__file__),
                                                                     "test_gpu_random_calls.py")])
    print("EXIT" + json.dumps(int(code)))


@pytest.mark.gpu
def test_random_calls_pass_under_a_99_kb_limit_on_the_gpu():
    """test_gpu_random_calls.py's checks against the float32 reference (odd lengths, GQA, causal variants, masks,
    S2O, PBS) on the Triton kernels under a 99 KB limit, where they run with 1 or 2 stages. Seeds 0-29 passed on
    an H100 (session 49); six here."""
    code = shared_memory.json_from_fresh_process(
        f"import test_shared_memory as t; t.random_calls_under_limit({SHARED_PER_BLOCK[89]}, 0, 6)", "EXIT",
        os.path.dirname(os.path.abspath(__file__)))
    assert code == 0
