"""Every configuration error kvpass reports, and that each is raised by ``kvpass.backend(...)``
itself: before anything is compiled, and without leaving a registered runtime behind.
"""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

import kvpass
from kvpass.cache import runtime
from kvpass.policies import POLICIES, Needs, Param, Policy, make_policy
from kvpass.policies.compose import Composed
from kvpass.policies.streamingllm import StreamingLLM

RANGE_BUDGET = "int in [2, 16777216]"
KNOWN = ", ".join(sorted(POLICIES))  # every message about a policy name lists the known ones

# (backend kwargs, fragments the message must contain)
CASES = {
    # policy names
    "unknown policy": (dict(policy="nope"), ["unknown policy 'nope'", "full", "streamingllm"]),
    "unknown policy, wrong case": (dict(policy="Full"), ["unknown policy 'Full'", KNOWN]),
    "unknown member of a composition": (dict(policy="full+nope"), ["unknown policy 'nope'", KNOWN]),
    "empty policy": (dict(policy=""), ["policy must be a non-empty string", KNOWN]),
    "policy is not a string": (dict(policy=None), ["policy must be a non-empty string", "got None"]),
    # parameter values
    "budget below range": (dict(policy="streamingllm", budget=0), ["'budget'", RANGE_BUDGET, "got 0"]),
    "budget above range": (dict(policy="streamingllm", budget=1 << 25), ["'budget'", RANGE_BUDGET, "got 33554432"]),
    "sinks below range": (dict(policy="streamingllm", sinks=-1), ["'sinks'", "int in [0, 1048576]", "got -1"]),
    "budget out of range in a composition": (dict(policy="full+streamingllm", budget=1), ["'budget'", RANGE_BUDGET]),
    "a float that is NaN": (dict(policy="raas", alpha=float("nan")), ["'alpha'", "float in [0.0, 1.0]", "got nan"]),
    "a NaN converted to an int": (dict(policy="h2o", heavy=float("nan")), ["'heavy'", "got nan"]),
    # parameter types
    "budget is a str": (dict(policy="streamingllm", budget="x"), ["'budget'", RANGE_BUDGET, "got str 'x'"]),
    "budget is a float": (dict(policy="streamingllm", budget=2.5), ["'budget'", RANGE_BUDGET, "got float 2.5"]),
    "budget is an integral float": (dict(policy="streamingllm", budget=8.0), ["'budget'", "got float 8.0"]),
    "budget is a bool": (dict(policy="streamingllm", budget=True), ["'budget'", RANGE_BUDGET, "got bool True"]),
    # parameter names
    "unknown parameter": (dict(policy="streamingllm", bugdet=8), ["no parameter 'bugdet'", "budget, sinks"]),
    "parameter of a parameterless policy": (
        dict(policy="full", budget=8),
        ["policy 'full' has no parameter 'budget'", "none"],
    ),
    "unknown parameter of a composition": (
        dict(policy="full+streamingllm", foo=1),
        ["policy 'full+streamingllm' has no parameter 'foo'", "budget, sinks"],
    ),
    # cross-parameter checks
    "sinks equal to budget": (
        dict(policy="streamingllm", budget=8, sinks=8),
        ["'sinks' must be < budget (8)", "got 8"],
    ),
    "sinks above budget": (dict(policy="streamingllm", budget=8, sinks=20), ["'sinks' must be < budget (8)", "got 20"]),
    "default sinks above a small budget": (
        dict(policy="streamingllm", budget=3),
        ["'sinks' must be < budget (3)", "got 4"],
    ),
    "sinks >= budget in a composition": (
        dict(policy="full+streamingllm", budget=4, sinks=4),
        ["'sinks' must be < budget (4)"],
    ),
    # composition
    "same policy twice": (dict(policy="full+full"), ["policy 'full+full' names a policy twice"]),
    "same evicting policy twice": (dict(policy="streamingllm+streamingllm"), ["names a policy twice"]),
    # the compiler
    "bad compiler": (dict(policy="full", compiler="tvm"), ["'compiler'", "inductor, aot_eager, eager", "got 'tvm'"]),
    "bad compiler, good policy params": (
        dict(policy="streamingllm", compiler="Inductor", budget=8),
        ["'compiler'", "got 'Inductor'"],
    ),
}


@pytest.fixture
def no_runtime_leak():
    before = dict(runtime._RUNTIMES)
    yield
    assert runtime._RUNTIMES == before, "a failed kvpass.backend(...) call left a runtime registered"


@pytest.mark.parametrize("kwargs,fragments", CASES.values(), ids=list(CASES))
def test_backend_rejects_bad_configuration(kwargs, fragments, no_runtime_leak, monkeypatch):
    kwargs = dict(kwargs)
    policy = kwargs.pop("policy")
    with pytest.raises(kvpass.ConfigError) as err:
        kvpass.backend(policy, **kwargs)
    message = str(err.value)
    assert message.startswith("kvpass"), message  # the user tells kvpass's refusal from torch's or transformers'
    for fragment in fragments:
        assert fragment in message, f"{fragment!r} missing from: {message}"


def test_config_error_is_a_value_error():
    assert issubclass(kvpass.ConfigError, ValueError)
    assert str(kvpass.ConfigError("policy 'x': bad")) == "kvpass: policy 'x': bad"
    assert str(kvpass.ConfigError("kvpass.SlotCache: bad")) == "kvpass.SlotCache: bad"


def test_errors_come_before_compiling(no_runtime_leak):
    """The error is raised by kvpass.backend(...) itself: torch.compile is never reached."""
    import torch

    compiled = []
    with pytest.raises(kvpass.ConfigError):
        compiled.append(torch.compile(lambda x: x + 1, backend=kvpass.backend("streamingllm", budget=0)))
    assert compiled == []


# ----------------------------------------------------------------------------------------------
# two evicting policies: only streamingllm evicts today, so a second evicting policy is registered
# for the test
# ----------------------------------------------------------------------------------------------


class KeepFirst(Policy):
    """A stand-in second eviction policy."""

    name = "keepfirst"
    needs = Needs(evicts=True)


class KeepLast(Policy):
    name = "keeplast"
    needs = Needs(evicts=True)


@pytest.fixture
def two_more_evictors(monkeypatch):
    monkeypatch.setitem(POLICIES, KeepFirst.name, KeepFirst)
    monkeypatch.setitem(POLICIES, KeepLast.name, KeepLast)


def test_two_evicting_policies_through_backend(two_more_evictors, no_runtime_leak):
    with pytest.raises(
        kvpass.ConfigError,
        match=re.escape(
            "policy 'streamingllm+keepfirst': streamingllm and keepfirst both evict; "
            "compose at most one eviction policy"
        ),
    ):
        kvpass.backend("streamingllm+keepfirst", budget=8)
    with pytest.raises(kvpass.ConfigError, match="keepfirst and keeplast both evict"):
        kvpass.backend("full+keepfirst+keeplast")


def test_one_evicting_policy_composes(two_more_evictors):
    be = kvpass.backend("full+keepfirst", compiler="eager")
    assert be.policy.needs.evicts and be.policy.evictor.name == "keepfirst"


def test_two_evicting_policies_composed_directly():
    with pytest.raises(kvpass.ConfigError, match="streamingllm and keepfirst both evict"):
        Composed([StreamingLLM(budget=8), KeepFirst()])


# ----------------------------------------------------------------------------------------------
# Policy objects
# ----------------------------------------------------------------------------------------------


def test_policy_object_with_backend_parameters(no_runtime_leak):
    with pytest.raises(kvpass.ConfigError, match="pass parameters to the Policy object itself"):
        kvpass.backend(StreamingLLM(budget=8), budget=4)


def test_policy_object_validates_on_construction():
    with pytest.raises(kvpass.ConfigError, match="'budget' must be int in"):
        StreamingLLM(budget=0)
    with pytest.raises(kvpass.ConfigError, match="has no parameter 'window'"):
        StreamingLLM(window=4)


def test_valid_configurations_build():
    """The counterpart: what the cases above get wrong, done right, builds without error."""
    for policy, params in [
        ("full", {}),
        ("streamingllm", dict(budget=8, sinks=2)),
        ("streamingllm", dict(budget=2, sinks=0)),
        ("full+streamingllm", dict(budget=8)),
        (" streamingllm + full ", dict(budget=8)),
    ]:
        kvpass.backend(policy, compiler="eager", **params)
    assert make_policy("streamingllm", budget=16).config == {"budget": 16, "sinks": 4}


def test_versions_below_the_floor_are_named(monkeypatch):
    """An older transformers or torch than the supported floor fails at import with the version it
    needs, not with an ImportError from inside transformers; the floors are pyproject.toml's. The versions
    are read from the packages' metadata, so ``import kvpass`` imports neither (``kvpass --help`` is fast)."""
    import importlib.metadata
    from pathlib import Path

    text = (Path(__file__).parents[1] / "pyproject.toml").read_text()
    assert re.search(r'"transformers>=([0-9.]+)"', text).group(1) == kvpass.TRANSFORMERS_FLOOR
    assert re.search(r'"torch>=([0-9.]+)"', text).group(1) == kvpass.TORCH_FLOOR
    installed = {"torch": "2.13.0", "transformers": "5.2.0"}
    monkeypatch.setattr(importlib.metadata, "version", lambda name: installed[name])
    with pytest.raises(ImportError, match=r"kvpass needs transformers >= 5\.14\.1, found 5\.2\.0"):
        kvpass._check_versions()
    installed.update(transformers=kvpass.TRANSFORMERS_FLOOR, torch="2.10.0+cpu")
    with pytest.raises(ImportError, match=r"kvpass needs torch >= 2\.11, found 2\.10\.0\+cpu"):
        kvpass._check_versions()


def test_a_policy_declaring_needs_as_loose_attributes_is_refused():
    """Before the Needs descriptor a policy said ``evicts = True``; now that attribute would be ignored, so a
    class that still sets it is refused at definition, naming the fix."""
    with pytest.raises(TypeError, match=r"declare evicts, slot_rule as Needs fields or parameter fields"):

        class Old(Policy):  # noqa: F841
            name = "old"
            evicts = True
            slot_rule = "append"

    with pytest.raises(TypeError, match=r"declare params as"):  # parameters are fields now

        class OldParams(Policy):  # noqa: F841
            name = "oldparams"
            params = (Param("budget", int, 8, 1, 64),)


def test_parameters_are_fields_with_their_ranges():
    """``budget`` is a field of the policy class: its value is checked against its range when the policy is
    built, an unknown keyword names the parameters, and ``params`` lists them for the CLI and compositions."""
    assert [f.name for f in dataclasses.fields(StreamingLLM)] == ["budget", "sinks"]
    assert StreamingLLM(budget=64).budget == 64
    with pytest.raises(kvpass.ConfigError, match=r"'budget' must be int in \[2, 16777216\], got 1"):
        StreamingLLM(budget=1)
    with pytest.raises(kvpass.ConfigError, match="has no parameter 'budgett'; its parameters are: budget, sinks"):
        StreamingLLM(budgett=64)
    assert {p.name for p in POLICIES["fastkv"].params} == {"budget", "window", "kernel", "layer"}  # no hidden tau


def test_device_asserts_go_through_the_length_check():
    """On a GPU torch refuses a device assert's message of 255 characters or more, at the call, even when
    the condition holds: every DynamicCache generate of an evicting policy failed on an H100 while the CPU
    suite passed. Every device assert in kvpass goes through ``device_assert``, which checks the length on
    every device, so the CPU suite fails on a long message."""
    from pathlib import Path

    from kvpass.errors import device_assert

    root = Path(kvpass.__file__).parent
    direct = [
        str(p.relative_to(root))
        for p in root.rglob("*.py")
        if "torch._assert_async(" in p.read_text() and p.name != "errors.py"
    ]
    assert not direct, direct
    device_assert(torch.tensor(True), "x" * 254)
    with pytest.raises(ValueError, match="device assert's message is 255 characters"):
        device_assert(torch.tensor(True), "x" * 255)


# ------------------------------------------------------------------------------------------------
# kvpass.compile: what a compiled model refuses or does, by name
# ------------------------------------------------------------------------------------------------

IDS = torch.tensor([list(range(3, 15))])


@pytest.fixture
def compiled():
    import families

    model = families.build("llama")
    kvpass.compile(model, "full", compiler="eager")
    return model


@pytest.mark.parametrize("compiler", ["eager", "aot_eager"])
def test_training_through_kvpass_says_it_is_for_inference(compiler):
    import families

    model = families.build("llama")
    kvpass.compile(model, "full", compiler=compiler)
    says = r"kvpass.*inference.*torch\.no_grad\(\).*torch\.inference_mode\(\).*without kvpass"
    with pytest.raises(Exception, match=says) as e:  # eager: at the backward; AOT traces it at the forward
        model(IDS, labels=IDS).loss.backward()
    assert (
        isinstance(e.value, kvpass.ConfigError)
        or isinstance(e.value.__cause__, kvpass.ConfigError)
        or "ConfigError" in str(e.value)
    )
    with torch.no_grad():
        assert model(IDS).logits.shape == (1, 12, 96)


def test_a_deep_copy_of_a_compiled_model_is_an_uncompiled_model(compiled):
    import copy

    ref = compiled.generate(IDS, max_new_tokens=4, do_sample=False)
    twin = copy.deepcopy(compiled)
    assert "forward" not in twin.__dict__ and "generate" not in twin.__dict__
    assert twin.generate(IDS, max_new_tokens=4, do_sample=False).tolist() == ref.tolist()
    with torch.no_grad():
        twin.lm_head.weight.mul_(-1.0)  # the copy's weights are its own: the original is unchanged
    assert compiled.generate(IDS, max_new_tokens=4, do_sample=False).tolist() == ref.tolist()
    kvpass.compile(twin, "streamingllm", compiler="eager", budget=8)  # and can be compiled again
    assert twin.generate(IDS, max_new_tokens=2, do_sample=False).shape == (1, 14)


@pytest.mark.parametrize("value", [2.5, True])
def test_max_new_tokens_must_be_an_int(compiled, value):
    with pytest.raises(kvpass.ConfigError, match=r"kvpass\.compile.*'max_new_tokens' must be an int >= 1.*got"):
        compiled.generate(IDS, max_new_tokens=value)


def test_a_cache_too_large_for_the_device_is_refused_before_it_is_allocated(compiled):
    says = r"kvpass\.compile.*max_new_tokens=1000000000.*SlotCache of \d+ tokens.*GiB.*free.*max_new_tokens"
    with pytest.raises(kvpass.ConfigError, match=says):
        compiled.generate(IDS, max_new_tokens=10**9, eos_token_id=2)
    out = compiled.generate(IDS, max_new_tokens=3, do_sample=False)  # still generates
    assert out.shape == (1, 15)


def test_an_encoder_decoder_is_refused_by_kvpass_compile():
    import transformers as tf

    cfg = tf.T5Config(vocab_size=96, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, decoder_start_token_id=0)
    model = tf.T5ForConditionalGeneration(cfg).eval()
    with pytest.raises(
        kvpass.ConfigError,
        match=r"kvpass\.compile: parameter 'model' is an encoder-decoder.*"
        r"is_encoder_decoder.*decoder-only",
    ):
        kvpass.compile(model, "full", compiler="eager")
    assert "forward" not in model.__dict__ and "generate" not in model.__dict__


def test_an_unknown_mode_is_refused_by_kvpass_compile_before_compiling():
    import families

    model = families.build("llama")
    with pytest.raises(kvpass.ConfigError, match=r"kvpass\.compile: parameter 'mode' \('bogus'\).*reduce-overhead"):
        kvpass.compile(model, "snapkv", budget=64, mode="bogus")
    assert "forward" not in model.__dict__ and "generate" not in model.__dict__
