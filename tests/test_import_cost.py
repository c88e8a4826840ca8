"""``import hetu_ext`` (and its pure planners) must not import torch.distributed users or any host framework."""

import subprocess
import sys


def test_import_is_cheap():
    code = ("import sys, hetu_ext, hetu_ext.plan, hetu_ext.plan.core.batches, hetu_ext.data.tokenizer; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('megatron', 'deepspeed', 'diffusers', "
            "'torch')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def test_the_launch_decision_imports_no_framework():
    """hetu_ext.megatron.launch_plan (the launchers check a run before any rank starts) imports neither torch nor
    megatron: importing the adapter package only arranges how megatron.core will be imported."""
    code = ("import sys, hetu_ext.megatron.launch_plan; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'megatron', 'torch', 'deepspeed'}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"


def _printed(code: str) -> list[str]:
    """What ``code`` prints in a fresh interpreter (warnings off), as words."""
    return subprocess.run([sys.executable, "-W", "ignore", "-c", code], capture_output=True, text=True,
                          check=True).stdout.split()


def test_megatron_core_imports_without_the_compiler_and_leaves_torch_compile_alone():
    """hetu_ext.megatron imports Megatron-core with torch.compile deferred (patches/megatron_import.py): its
    jit_fuser functions exist, but TorchDynamo's frame converter and Inductor are not imported until one runs."""
    code = ("import sys, torch; real = torch.compile; import hetu_ext.megatron, megatron.core.models.gpt; "
            "assert type(sys.modules['megatron.core'].__loader__).__name__ == '_DeferringLoader'; "
            "from megatron.core.fusions.fused_bias_swiglu import bias_swiglu; "
            "print(torch.compile is real, getattr(bias_swiglu, '__hetu_deferred_compile__', False), "
            "'torch._dynamo.convert_frame' in sys.modules, 'torch._inductor.compile_fx' in sys.modules)")
    assert _printed(code) == ["True", "True", "False", "False"]


def test_a_deferred_compile_makes_the_same_call_once_at_first_use(monkeypatch):
    import torch

    from hetu_ext.patches.megatron_import import _deferring, deferred_compile

    calls = []

    def compile_fn(model, **kwargs):
        calls.append((model, kwargs))
        return lambda x: model(x) + 1

    def double(x):
        return 2 * x

    deferred = _deferring(compile_fn)
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "0")
    fn = deferred(double, mode="max-autotune")
    assert calls == [] and fn.__name__ == "double"
    assert fn(3) == 7 and fn(4) == 9
    assert calls == [(double, {"mode": "max-autotune"})]
    decorated = deferred(dynamic=True)(double)
    assert decorated(1) == 3 and calls[-1] == (double, {"dynamic": True})
    module = torch.nn.Linear(2, 2)
    deferred(module)
    assert calls[-1] == (module, {})  # modules are compiled at once, as before
    real = torch.compile
    with deferred_compile():
        eager = torch.compile(double, backend="eager")
    assert torch.compile is real
    assert torch.equal(eager(torch.arange(3.0)), torch.arange(3.0) * 2)
    # with TorchDynamo disabled torch.compile returns the function itself: so does the first call, compiling nothing
    monkeypatch.setenv("TORCHDYNAMO_DISABLE", "1")
    assert torch.compile(double) is double
    count = len(calls)
    plain = deferred(double)
    assert plain(5) == 10 and len(calls) == count


def test_megatron_lms_jit_warmup_on_cpu_imports_no_compiler():
    """With TorchDynamo disabled (as on CPU), calling a fused function, as Megatron-LM's _warmup_jit_function does
    at start-up, runs it eagerly without importing the compiler (it would have returned the function itself)."""
    code = ("import sys, os, torch; os.environ['TORCHDYNAMO_DISABLE'] = '1'; import hetu_ext.megatron; "
            "from megatron.core.fusions.fused_bias_swiglu import bias_swiglu; "
            "x = torch.rand(4, 2, 6); b = torch.rand(6); y = bias_swiglu(x, b); "
            "a, g = torch.chunk(x + b, 2, -1); "
            "print(torch.equal(y, torch.nn.functional.silu(a) * g), 'torch._inductor.compile_fx' in sys.modules)")
    assert _printed(code) == ["True", "False"]
