"""torch.compile: sparge_attention's custom operator and SpargeProcessor inside compiled diffusers transformers
(CPU: the float32 reference path behind the operator; the GPU test runs the Triton kernels)."""

import dataclasses
import warnings

import pytest
import torch

from sparge_diffusers import relative_l1, sparge_attention, sparge_attention_op

diffusers = pytest.importorskip("diffusers")

from sparge_diffusers.pipelines import SpargeSettings, apply  # noqa: E402

from test_pipelines import MODELS, run  # noqa: E402

SPARSE = SpargeSettings(simthreshd1=-1.0, cdfthreshd=0.9, pvthreshd=None, permutation="hilbert")


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_custom_op_matches_sparge_attention_and_passes_opcheck(layout):
    torch.manual_seed(0)
    shape = (1, 4, 200, 64) if layout == "HND" else (1, 200, 4, 64)
    kv_shape = (1, 2, 200, 64) if layout == "HND" else (1, 200, 2, 64)  # grouped-query heads
    q, k, v = torch.randn(shape), torch.randn(kv_shape), torch.randn(kv_shape)
    kw = dict(simthreshd1=[0.2, -1.0, 0.5, 0.6], cdfthreshd=0.5, pvthreshd=8.0, tensor_layout=layout)
    out = sparge_attention_op(q, k, v, **kw)
    assert out.is_contiguous() and out.shape == q.shape
    assert torch.equal(out, sparge_attention(q, k, v, **kw))
    args = (q, k, v, False, 0.125, [0.2, -1.0, 0.5, 0.6], [0.5], [8.0], False, layout)
    torch.library.opcheck(torch.ops.sparge_diffusers.sparge_attention.default, args)
    with pytest.raises(ValueError, match="cdfthreshd"):
        sparge_attention_op(q, k, v, cdfthreshd="high", tensor_layout=layout)


def _compile_and_run(model, inputs, backend):
    """Two calls of the compiled model as one graph (fullgraph) that must not recompile; their outputs and
    the warnings they raised."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with warnings.catch_warnings(record=True) as caught, torch._dynamo.config.patch(error_on_recompile=True):
        warnings.simplefilter("always")
        first, second = run(compiled, inputs), run(compiled, inputs)
    return first, second, [str(w.message) for w in caught]


@pytest.mark.parametrize("name,backend", [("flux", "aot_eager"), ("sd3", "aot_eager"), ("cogvideox", "aot_eager"),
                                          ("flux", "inductor")])
def test_compiled_model_is_one_graph_and_matches_the_eager_sparse_step(name, backend):
    torch.manual_seed(7)
    model, inputs = MODELS[name]()
    native = run(model, inputs)
    processor = apply(model, SPARSE, dense_steps=1)
    run(model, inputs)  # the dense warm-up step
    eager = run(model, inputs)  # eager sparse; also gives Flux its token grid (read from img_ids)
    records = len(processor.stats)
    first, second, messages = _compile_and_run(model, inputs, backend)
    assert relative_l1(eager, native) > 1e-3, "the settings must make the sparse step differ from dense"
    tolerance = 0 if backend == "aot_eager" else 1e-5  # inductor fuses the float32 projections differently
    assert relative_l1(first, eager) <= tolerance and torch.equal(first, second)
    assert not any("falling back" in m for m in messages), messages
    assert sum("dense_steps has no effect under torch.compile" in m for m in messages) >= 1, messages
    with pytest.warns(UserWarning, match="record no statistics"):
        assert len(processor.stats) == records  # compiled calls record nothing; eager ones still do
    run(model, inputs)
    assert len(processor._records) > records


def test_compiling_flux_before_any_eager_step_warns_that_it_has_no_token_grid():
    """Flux's token grid comes from img_ids on the device, which a compiled graph cannot read: without an
    eager step first the permutation is skipped, with a warning while compiling."""
    torch.manual_seed(8)
    model, inputs = MODELS["flux"]()
    apply(model, SPARSE)
    first, _, messages = _compile_and_run(model, inputs, "aot_eager")
    assert any("no token grid" in m for m in messages), messages
    unpermuted = dataclasses.replace(SPARSE, permutation=None)
    model2, _ = MODELS["flux"]()
    model2.load_state_dict(model.state_dict())
    apply(model2, unpermuted)
    assert torch.equal(first, run(model2, inputs))


def test_compiled_mochi_matches_the_eager_sparse_step():
    """Mochi's native processor graph-breaks on its text mask (a data-dependent nonzero), compiled or not
    with SpargeProcessor: no fullgraph, the same result."""
    torch.manual_seed(9)
    model, inputs = MODELS["mochi"]()
    apply(model, SPARSE)
    eager = run(model, inputs)
    torch._dynamo.reset()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        compiled = run(torch.compile(model, backend="aot_eager"), inputs)
    assert torch.equal(compiled, eager)


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flux", "sd3"])
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_model_on_gpu_matches_the_eager_sparse_step(name, mode):
    torch.manual_seed(10)
    model, inputs = MODELS[name]()
    model = model.to("cuda", torch.bfloat16)
    inputs = {k: v.to("cuda", torch.bfloat16 if v.is_floating_point() and not k.endswith("_ids") else v.dtype)
              for k, v in inputs.items()}
    processor = apply(model, SPARSE)
    eager = run(model, inputs)
    assert max(s["sparsity"] for s in processor.stats) > 0
    processor.enabled = False
    native = run(model, inputs)
    processor.enabled = True
    torch._dynamo.reset()
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = [run(compiled, inputs).clone() for _ in range(3)]  # reduce-overhead records, then replays
    messages = [str(w.message) for w in caught]
    assert not any("falling back" in m for m in messages), messages
    for out in outs:
        assert torch.isfinite(out).all()
        # bf16 projections fused differently by inductor; the attention kernels are the same
        assert relative_l1(out, eager) < 2e-2
    assert relative_l1(outs[-1], native) > relative_l1(outs[-1], eager), "the compiled path must be the sparse one"
