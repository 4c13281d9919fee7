"""torch.compile: sparge_attention's custom operator and SpargeProcessor inside compiled diffusers transformers
(CPU: the float32 reference path behind the operator; the GPU test runs the Triton kernels)."""

import dataclasses
import warnings

import pytest
import torch
import torch.nn.functional as F

from sparge_diffusers import relative_l1, sparge_attention, sparge_attention_op

diffusers = pytest.importorskip("diffusers")

from sparge_diffusers.pipelines import SpargeSettings, apply  # noqa: E402

from test_pipelines import MODELS, run  # noqa: E402

SPARSE = SpargeSettings(simthreshd1=-1.0, cdfthreshd=0.9, pvthreshd=None, permutation="hilbert")


def test_operator_wrappers_refuse_what_int_truncated():
    """The *_op wrappers passed their int arguments through int(): segment=256.5, check_every=2.5, top_k=2.7 and
    the like ran as 256, 2 and 2 where the eager functions refuse them. NumPy ints still convert."""
    import numpy as np

    from sparge_diffusers import s2o_attention_op, select_key_blocks_op, selected_block_attention_op
    from sparge_diffusers.llm import pbs_sparge_attention_op

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 200, 16, generator=g) for _ in range(3))
    idx = torch.zeros(1, 2, 200, 1, dtype=torch.int32)
    calls = {
        "segment": lambda x: s2o_attention_op(q, k, v, segment=x),
        "check_every": lambda x: s2o_attention_op(q, k, v, check_every=x),
        "block_size": lambda x: selected_block_attention_op(q, k, v, idx, block_size=x),
        "max_partial_bytes": lambda x: selected_block_attention_op(q, k, v, idx, max_partial_bytes=x),
        "top_k": lambda x: select_key_blocks_op(q, k, top_k=x),
        "sink_blocks": lambda x: select_key_blocks_op(q, k, top_k=2, sink_blocks=x),
        "local_blocks": lambda x: select_key_blocks_op(q, k, top_k=2, local_blocks=x),
        "pbs segment": lambda x: pbs_sparge_attention_op(q, k, v, segment=x),
    }
    good = {"segment": 256, "check_every": 2, "block_size": 32, "max_partial_bytes": 1 << 20, "top_k": 2,
            "sink_blocks": 1, "local_blocks": 1, "pbs segment": 128}
    for name, call in calls.items():
        want = call(good[name])
        assert torch.equal(call(np.int64(good[name])), want)
        for bad in (good[name] + 0.5, float(good[name]), True):
            with pytest.raises(ValueError, match=f"{name.split()[-1]} must be"):
                call(bad)


def test_operator_wrappers_and_stage_functions_take_the_defaults_of_the_functions_they_stand_for():
    """Each *_op wrapper takes "the same arguments" as its eager function: every argument both name has the same
    default (a wrapper repeats each default in its own signature). pbs_sparge_attention_op's thresholds are those
    of sparge_attention, to which pbs_sparge_attention passes them. Stage 1 and stage 2 alone default to the whole
    method's settings."""
    import inspect

    from sparge_diffusers import (block_sparse_attention, predict_block_mask, s2o_attention, s2o_attention_op,
                                  select_key_blocks, select_key_blocks_op, selected_block_attention,
                                  selected_block_attention_op)
    from sparge_diffusers.llm import pbs_sparge_attention, pbs_sparge_attention_op

    def defaults(function):
        return {name: p.default for name, p in inspect.signature(function).parameters.items()
                if p.default is not inspect.Parameter.empty}

    # the arguments with defaults that both take (a wrapper has no backend, out or statistics; sparge's has dense)
    for op, eager, n_shared in ((sparge_attention_op, sparge_attention, 11), (s2o_attention_op, s2o_attention, 11),
                                (selected_block_attention_op, selected_block_attention, 8),
                                (select_key_blocks_op, select_key_blocks, 7),
                                (pbs_sparge_attention_op, pbs_sparge_attention, 3),
                                (pbs_sparge_attention_op, sparge_attention, 8)):
        got, want = defaults(op), defaults(eager)
        shared = sorted(got.keys() & want.keys())
        assert len(shared) == n_shared, (op.__name__, shared)
        assert [got[name] for name in shared] == [want[name] for name in shared], (op.__name__, eager.__name__)
    sparge = defaults(sparge_attention)
    for function, names in ((predict_block_mask, ("is_causal", "simthreshd1", "cdfthreshd", "attention_sink")),
                            (block_sparse_attention, ("is_causal", "return_sparsity", "tensor_layout"))):
        assert [defaults(function)[name] for name in names] == [sparge[name] for name in names], function.__name__


def test_operator_wrappers_take_the_default_scale_of_the_head_dim_and_refuse_boolean_thresholds():
    """Each wrapper resolves the default scale itself, 1 / sqrt(q's last size): with every other size of q unlike the
    head dim, each gives its eager function's output. A bool in a list of thresholds is refused, as the eager
    per_head refuses it (True was taken as 1.0)."""
    from sparge_diffusers import (s2o_attention, s2o_attention_op, select_key_blocks, select_key_blocks_op,
                                  selected_block_attention, selected_block_attention_op)
    from sparge_diffusers.llm import pbs_sparge_attention, pbs_sparge_attention_op

    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 200, 16, generator=g)
    k, v = (torch.randn(1, 1, 200, 16, generator=g) for _ in range(2))
    idx = select_key_blocks(q, k, top_k=2)
    q_long, k_long = torch.randn(1, 2, 600, 16, generator=g), torch.randn(1, 1, 600, 16, generator=g)
    assert not torch.equal(select_key_blocks(q_long, k_long, top_k=4, scale=1.0),
                           select_key_blocks(q_long, k_long, top_k=4)), "the scale must change this selection"
    for name, op, eager in (
            ("sparge", lambda: sparge_attention_op(q, k, v), lambda: sparge_attention(q, k, v)),
            ("s2o", lambda: s2o_attention_op(q, k, v), lambda: s2o_attention(q, k, v)),
            ("selected", lambda: selected_block_attention_op(q, k, v, idx),
             lambda: selected_block_attention(q, k, v, idx)),
            ("select", lambda: select_key_blocks_op(q_long, k_long, top_k=4),  # 10 blocks, 2 forced: 2 by score
             lambda: select_key_blocks(q_long, k_long, top_k=4)),
            ("pbs", lambda: pbs_sparge_attention_op(q, k, v, segment=128),
             lambda: pbs_sparge_attention(q, k, v, segment=128))):
        assert torch.equal(op(), eager()), name
    for call in (lambda: sparge_attention_op(q, k, v, simthreshd1=[True, 0.5]),
                 lambda: s2o_attention_op(q, k, v, tau=[0.001, False])):
        with pytest.raises(ValueError, match="must be a number or a sequence of numbers"):
            call()


def test_warn_once_warns_once_per_set_at_the_frame_its_stacklevel_counts_from_its_caller():
    """``warn_once``'s stacklevel counts from its caller, as ``warnings.warn``'s does: 1 names the line that called
    it, 2 that line's caller (the processor passes the depth that reaches the model code)."""
    import inspect

    from sparge_diffusers._compile import warn_once

    seen = set()

    def nested():
        warn_once("from nested", seen, stacklevel=2)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        warn_once("direct", seen, stacklevel=1)
        line = inspect.currentframe().f_lineno - 1
        nested()
        nested_line = inspect.currentframe().f_lineno - 1
        warn_once("direct", seen, stacklevel=1)  # once per set
    assert [(str(w.message), w.filename, w.lineno) for w in caught] == \
        [("direct", __file__, line), ("from nested", __file__, nested_line)]


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
    processor = apply(model, SPARSE, dense_steps=1, collect_stats=True)
    run(model, inputs)  # the dense warm-up step
    inputs = dict(inputs, timestep=inputs["timestep"] * 0.5)  # a later step: a lower timestep
    eager = run(model, inputs)  # eager sparse; also gives Flux its token grid (read from img_ids)
    records = len(processor.stats)
    first, second, messages = _compile_and_run(model, inputs, backend)
    assert relative_l1(eager, native) > 1e-3, "the settings must make the sparse step differ from dense"
    tolerance = 0 if backend == "aot_eager" else 1e-5  # inductor fuses the float32 projections differently
    assert relative_l1(first, eager) <= tolerance and torch.equal(first, second)
    assert not any("falling back" in m for m in messages), messages
    assert not any("dense_steps" in m for m in messages), messages
    with pytest.warns(UserWarning, match="record no statistics") as caught:
        assert len(processor.stats) == records  # compiled calls record nothing; eager ones still do
    assert caught[0].filename == __file__, "the warning names the line that read the stats"
    run(model, inputs)
    assert len(processor._records) > records


def _steps(model, inputs, timesteps):
    """One output per step, the timestep set to each of ``timesteps`` in turn (a rise starts a generation)."""
    outs = []
    for t in timesteps:
        step = dict(inputs, timestep=torch.full_like(inputs["timestep"], t))
        outs.append(run(model, step).clone())  # CUDA-graph replays overwrite their outputs
    return outs


@pytest.mark.parametrize("name,backend,generation", [("sd3", "aot_eager", [9, 7, 5, 3]),
                                                     ("cogvideox", "inductor", [9, 7, 5, 3]),
                                                     ("sd3", "aot_eager", [3, 5, 7, 9])])  # rising, as Mochi's
def test_compiled_model_runs_the_dense_warm_up_steps(name, backend, generation):
    """dense_steps under torch.compile: the graph counts steps on CPU tensors and the operator reads the flag at
    run time, so each step of two generations equals the eager step (dense, then sparse) with one graph."""
    torch.manual_seed(11)
    model, inputs = MODELS[name]()
    timesteps = generation * 2  # two generations of four steps
    native = _steps(model, inputs, timesteps)
    processor = apply(model, SPARSE, dense_steps=2, collect_stats=True)
    eager = _steps(model, inputs, timesteps)
    processor.enabled = False
    assert all(torch.equal(e, n) for e, n in zip(eager[:2] + eager[4:6], native[:2] + native[4:6]))
    assert all(relative_l1(e, n) > 1e-3 for e, n in zip(eager[2:4] + eager[6:], native[2:4] + native[6:]))
    processor.enabled = True
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=backend, fullgraph=True)
    with warnings.catch_warnings(record=True) as caught, torch._dynamo.config.patch(error_on_recompile=True):
        warnings.simplefilter("always")
        outs = _steps(compiled, inputs, timesteps)
    assert not any("dense_steps" in str(w.message) or "falling back" in str(w.message) for w in caught)
    for i, (out, ref) in enumerate(zip(outs, eager)):
        # inductor fuses the float32 projections differently; the warm-up steps' SDPA gets the graph's copies
        # of q, k, v (other strides than the native call's, so possibly another CPU kernel): float rounding
        dense_step = i % 4 < 2
        tolerance = 1e-5 if backend == "inductor" else (1e-6 if dense_step else 0)
        assert relative_l1(out, ref) <= tolerance, i
    assert int(processor._step_t) == 4 and not bool(processor._dense_now)
    # compiled and eager calls share one count: two compiled steps of a new generation (each forward twice, as
    # true CFG runs them: one step each), then an eager third
    _steps(compiled, inputs, [generation[0]] * 2 + [generation[1]] * 2)
    assert int(processor._step_t) == 2
    assert torch.equal(_steps(model, inputs, generation[2:3])[0], eager[2]), "the eager call goes on as step 3"


def test_regional_compilation_neither_recompiles_per_step_nor_skips_the_warm_up():
    """diffusers' regional compilation (compile_repeated_blocks: Flux's blocks compiled, the model's forward and
    so the step hook eager) once recompiled every block at every step: the processor read its step count inside
    the compiled region, a guard on a Python int. Each step of two generations now equals the eager one, dense
    warm-up steps included, with one graph per block."""
    torch.manual_seed(12)
    model, inputs = MODELS["flux"]()
    timesteps = [9, 7, 5, 3] * 2
    native = _steps(model, inputs, timesteps)
    processor = apply(model, SPARSE, dense_steps=2, collect_stats=True)
    eager = _steps(model, inputs, timesteps)
    torch._dynamo.reset()
    model.compile_repeated_blocks(backend="aot_eager", fullgraph=True)
    with warnings.catch_warnings(record=True) as caught, torch._dynamo.config.patch(error_on_recompile=True):
        warnings.simplefilter("always")
        outs = _steps(model, inputs, timesteps)
    assert not any("falling back" in str(w.message) for w in caught)
    for i, (out, ref, dense) in enumerate(zip(outs, eager, native)):
        assert relative_l1(out, ref) <= 1e-6, i
        assert (relative_l1(out, dense) <= 1e-6) == (i % 4 < 2), i  # dense exactly in the warm-up steps
    assert processor.step == 4


def test_custom_op_dense_flag_switches_to_exact_attention():
    torch.manual_seed(1)
    q, k, v = torch.randn(1, 4, 150, 64), torch.randn(1, 2, 150, 64), torch.randn(1, 2, 150, 64)
    kw = dict(simthreshd1=-1.0, cdfthreshd=0.3)
    flag = torch.tensor(True)
    exact = F.scaled_dot_product_attention(q, k, v, enable_gqa=True)
    assert torch.equal(sparge_attention_op(q, k, v, dense=flag, **kw), exact)
    nhd = [x.transpose(1, 2).contiguous() for x in (q, k, v)]
    out = sparge_attention_op(*nhd, dense=flag, tensor_layout="NHD", **kw)
    assert torch.equal(out.transpose(1, 2), exact)
    causal = sparge_attention_op(q[:, :, 100:], k, v, dense=flag, is_causal=True, causal_variant="lower_right", **kw)
    assert torch.allclose(causal, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[:, :, 100:],
                          atol=1e-6)
    # more queries than keys, lower-right: rows before the first key are zeros, as the kernels write them
    keep_all = dict(simthreshd1=1.0, pvthreshd=None)
    for variant in ("lower_right", "upper_left"):
        long_q = dict(is_causal=True, causal_variant=variant, **keep_all)
        out = sparge_attention_op(q, k[:, :, :100], v[:, :, :100], dense=flag, **long_q)
        assert not out.isnan().any() and relative_l1(out, sparge_attention(q, k[:, :, :100], v[:, :, :100],
                                                                            **long_q)) < 1e-6, variant
    # grouped heads where another pair of sizes is equal (batch and K/V heads; q's heads and the batch; queries and
    # K/V heads; q's heads and keys), so that comparing the wrong sizes would leave SDPA's enable_gqa off
    for B, H, HK, Nq, Nkv in ((2, 4, 2, 2, 4), (4, 4, 2, 3, 5)):
        g = torch.Generator().manual_seed(B)
        qg = torch.randn(B, H, Nq, 64, generator=g)
        kg, vg = (torch.randn(B, HK, Nkv, 64, generator=g) for _ in range(2))
        assert torch.equal(sparge_attention_op(qg, kg, vg, dense=flag, **kw),
                           F.scaled_dot_product_attention(qg, kg, vg, enable_gqa=True)), (B, H, HK, Nq, Nkv)
    flag.fill_(False)
    assert torch.equal(sparge_attention_op(q, k, v, dense=flag, **kw), sparge_attention(q, k, v, **kw))
    args = (q, k, v, flag, False, 0.125, [-1.0], [0.3], [50.0], False, "HND")
    torch.library.opcheck(torch.ops.sparge_diffusers.sparge_attention_or_exact.default, args)
    for bad in (torch.tensor([True, False]), torch.tensor(1), torch.tensor(True, device="meta")):
        with pytest.raises(ValueError, match="one-element bool tensor on the CPU"):
            sparge_attention_op(q, k, v, dense=bad)
    # the dense step checks what the sparse one does: these ran SDPA's upper-left mask, or failed inside SDPA
    for dense in (True, False):
        flag.fill_(dense)
        for bad, match in ((dict(is_causal=True), "pass causal_variant"),
                           (dict(is_causal=True, causal_variant="lower-right"), "causal_variant"),
                           (dict(tensor_layout="BHSD"), "tensor_layout")):
            with pytest.raises(ValueError, match=match):
                sparge_attention_op(q[:, :, 100:], k, v, dense=flag, **kw, **bad)


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


def test_compiling_before_any_eager_step_builds_the_permutation_in_the_trace():
    """SD3's token grid comes from shapes; the Hilbert permutation, never built eagerly, is built while tracing
    (its tensors become graph constants): one graph, no break, the eager sparse step's output."""
    from sparge_diffusers.permutations import orders

    torch.manual_seed(12)
    model, inputs = MODELS["sd3"]()
    apply(model, SPARSE)
    orders._PERMUTATIONS.clear()
    first, second, messages = _compile_and_run(model, inputs, "aot_eager")
    assert len(orders._PERMUTATIONS) == 1 and torch.equal(first, second)
    assert not any("falling back" in m or "no token" in m for m in messages), messages
    assert torch.equal(first, run(model, inputs))


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


def _on_gpu(model, inputs):
    model = model.to("cuda", torch.bfloat16)
    return model, {k: v.to("cuda", torch.bfloat16 if v.is_floating_point() and not k.endswith("_ids") else v.dtype)
                   for k, v in inputs.items()}


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["flux", "sd3"])
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_model_on_gpu_matches_the_eager_sparse_step(name, mode):
    torch.manual_seed(10)
    model, inputs = _on_gpu(*MODELS[name]())
    processor = apply(model, SPARSE, collect_stats=True)
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


def _native_then_eager_sparse_on_gpu(name, seed):
    """A tiny model on the GPU, its native outputs over two 4-step runs, then apply() with 2 dense warm-up steps
    and its eager outputs; dynamo reset so that the caller's compilation starts clean."""
    torch.manual_seed(seed)
    model, inputs = _on_gpu(*MODELS[name]())
    timesteps = [9, 7, 5, 3] * 2
    native = _steps(model, inputs, timesteps)
    apply(model, SPARSE, dense_steps=2)
    eager = _steps(model, inputs, timesteps)
    torch._dynamo.reset()
    return model, inputs, timesteps, native, eager


def _assert_dense_in_warm_up_then_sparse(outs, native, eager):
    """Steps 0-1 of each 4-step run are dense warm-up: the native processors' output (bf16 projections fused
    differently, hence the tolerance); the rest are the eager sparse output, nearer to it than to the native."""
    for i, out in enumerate(outs):
        assert torch.isfinite(out).all()
        if i % 4 < 2:
            assert relative_l1(out, native[i]) < 2e-2, i
        else:
            assert relative_l1(out, eager[i]) < 2e-2, i
            assert relative_l1(out, native[i]) > relative_l1(out, eager[i]), i


@pytest.mark.gpu
@pytest.mark.parametrize("mode", [None, "reduce-overhead"])
def test_compiled_model_on_gpu_runs_the_dense_warm_up_steps(mode):
    """Inductor on the GPU: dense warm-up steps give the native output, the others the eager sparse one; under
    reduce-overhead the switching operator stays out of CUDA graphs (tagged cudagraph_unsafe), so replays do not
    repeat one path."""
    from torch._dynamo.utils import counters

    model, inputs, timesteps, native, eager = _native_then_eager_sparse_on_gpu("sd3", seed=13)
    counters.clear()
    compiled = torch.compile(model, fullgraph=True, mode=mode)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        outs = _steps(compiled, inputs, timesteps)
    print(f"mode={mode}: cudagraph skips {dict(counters['inductor'].get('cudagraph_skips', {}) or {})}, "
          f"inductor counters {dict(counters['inductor'])}")
    assert not any("falling back" in str(w.message) for w in caught)
    _assert_dense_in_warm_up_then_sparse(outs, native, eager)


@pytest.mark.gpu
def test_regional_compilation_on_gpu_runs_the_warm_up_and_sparse_steps_without_recompiling():
    """compile_repeated_blocks with inductor on the GPU (Triton kernels inside the compiled blocks): dense warm-up
    steps give the native output, the others the eager sparse one, and no block recompiles."""
    model, inputs, timesteps, native, eager = _native_then_eager_sparse_on_gpu("flux", seed=15)
    model.compile_repeated_blocks(fullgraph=True)
    with warnings.catch_warnings(record=True) as caught, torch._dynamo.config.patch(error_on_recompile=True):
        warnings.simplefilter("always")
        outs = _steps(model, inputs, timesteps)
    assert not any("falling back" in str(w.message) for w in caught)
    _assert_dense_in_warm_up_then_sparse(outs, native, eager)


@pytest.mark.gpu
def test_compiled_model_on_gpu_builds_the_permutation_while_tracing():
    torch.manual_seed(14)
    model, inputs = _on_gpu(*MODELS["sd3"]())
    apply(model, SPARSE)
    from sparge_diffusers.permutations import orders

    orders._PERMUTATIONS.clear()
    torch._dynamo.reset()
    compiled = run(torch.compile(model, fullgraph=True), inputs).clone()
    assert len(orders._PERMUTATIONS) == 1
    assert relative_l1(compiled, run(model, inputs)) < 2e-2


@pytest.mark.parametrize("name", ["flux", "sd3"])
def test_set_attn_processor_alone_compiles_as_one_graph(name):
    """Through set_attn_processor alone (no apply, no eager call first) the processor makes each module's native
    processor while Dynamo traces: rebuilt per trace rather than cached (a cache entry needs a finalizer, which is
    registered in eager calls only); one graph, no recompile, the native result."""
    from sparge_diffusers.pipelines import SpargeProcessor

    torch.manual_seed(7)
    model, inputs = MODELS[name]()
    native = run(model, inputs)
    processor = SpargeProcessor(settings=SpargeSettings(simthreshd1=-1.0, cdfthreshd=1.0, pvthreshd=None))
    model.set_attn_processor(processor)
    first, second, _ = _compile_and_run(model, inputs, "aot_eager")
    assert relative_l1(first, native) < 1e-5 and torch.equal(first, second)
    assert processor._natives == {}, "natives made while tracing are not kept"
