"""RoPE re-rotation: kernels vs references (Triton interpreter), opcheck, and the property that stored
pre-RoPE keys re-rotated to any offset equal the keys the model computes there, across scaling types."""

from __future__ import annotations

import pytest
import torch
import transformers as tf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import families
from kvpass import ConfigError
from kvpass.chunks.rope import RotaryMap, layer_keys, rotate, unrotate
from kvpass.kernels import rope_rotate as K

SETTINGS = dict(max_examples=8, deadline=None, suppress_health_check=list(HealthCheck))


def _tables(length, r, scale=1.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    ang = torch.rand(length, r // 2, generator=g) * 50
    return (torch.cat([ang.cos(), ang.cos()], -1) * scale, torch.cat([ang.sin(), ang.sin()], -1) * scale)


@settings(**SETTINGS)
@given(
    m=st.integers(1, 6),
    length=st.integers(1, 40),
    d=st.sampled_from([8, 16, 24, 64]),
    partial=st.sampled_from([1.0, 0.5, 0.25]),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    scale=st.sampled_from([1.0, 1.2]),
    seed=st.integers(0, 1000),
)
def test_rotate_kernel_equals_reference(m, length, d, partial, dtype, scale, seed):
    r = max(2, int(d * partial) // 2 * 2)
    x = torch.randn(m, length, d, generator=torch.Generator().manual_seed(seed)).to(dtype)
    cos, sin = _tables(length, r, scale, seed)
    ref = K.rotate_reference(x, cos, sin)
    out = K.rotate_triton(x, cos, sin, block=16, rows=3)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)
    # the inverse tables undo the rotation (attention factor included)
    back = K.rotate_reference(ref.float(), *K.rope_inverse_tables(cos, sin))
    torch.testing.assert_close(back, x.float(), atol=1e-5 if dtype == torch.float32 else 5e-2, rtol=1e-3)


def test_rotate_kernel_strided_input():
    x = torch.randn(4, 10, 32)[:, ::2]  # a strided view of rows
    cos, sin = _tables(5, 32)
    torch.testing.assert_close(K.rotate_triton(x, cos, sin), K.rotate_reference(x, cos, sin))


@settings(**SETTINGS)
@given(
    m=st.integers(1, 5),
    n=st.integers(1, 30),
    d=st.sampled_from([8, 16, 48]),
    frac=st.floats(0.0, 1.0),
    seed=st.integers(0, 1000),
)
def test_scatter_kernel_equals_reference(m, n, d, frac, seed):
    g = torch.Generator().manual_seed(seed)
    dst = torch.randn(m, n, d, generator=g)
    idx = torch.randperm(n, generator=g)[: int(frac * n)]
    src = torch.randn(m, idx.numel(), d, generator=g)
    torch.testing.assert_close(K.scatter_triton(dst, idx, src, block=8), K.scatter_reference(dst, idx, src))


def test_ops_opcheck():
    x = torch.randn(3, 7, 16)
    cos, sin = _tables(7, 8)
    for op in (torch.ops.kvpass.rope_rotate_ref.default, torch.ops.kvpass.rope_rotate.default):
        torch.library.opcheck(op, (x, cos, sin))
    dst, idx, src = torch.randn(3, 9, 16), torch.tensor([7, 1, 4]), torch.randn(3, 3, 16)
    for op in (torch.ops.kvpass.scatter_rows_ref.default, torch.ops.kvpass.scatter_rows.default):
        torch.library.opcheck(op, (dst, idx, src))


def test_cache_overwrite_op():
    import kvpass

    be = kvpass.backend("pie", compiler="eager")
    kp, vp = torch.randn(1, 2, 9, 8), torch.randn(1, 2, 9, 8)
    kn, vn = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 3, 8)
    h = be.runtime.handle
    with pytest.raises(RuntimeError, match="ChunkFusion"):
        torch.ops.kvpass.cache_overwrite(kp, vp, kn, vn, h, 0)
    be.runtime.state.fusion = torch.tensor([2, 5, 8])
    k, v, kv_pos, q_pos = torch.ops.kvpass.cache_overwrite(kp, vp, kn, vn, h, 0)
    expect = kp.clone()
    expect[:, :, [2, 5, 8]] = kn
    assert torch.equal(k, expect) and torch.equal(kv_pos[0, 0], torch.arange(9))
    assert q_pos.tolist() == [[2, 5, 8]]
    torch.library.opcheck(torch.ops.kvpass.cache_overwrite.default, (kp, vp, kn, vn, h, 0))


SCALINGS = {
    "default": dict(rope_type="default"),
    "linear": dict(rope_type="linear", factor=2.0),
    "llama3": dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=64
    ),
    "yarn": dict(rope_type="yarn", factor=4.0, original_max_position_embeddings=64),
    "dynamic": dict(rope_type="dynamic", factor=2.0),
}
# frequencies that change with the sequence length: deeper layers match only inside the original range
LENGTH_DEPENDENT = {"dynamic": 256}

_MODELS: dict = {}


def _model(kind):
    if kind not in _MODELS:
        cfg = tf.LlamaConfig(**families.COMMON, rope_parameters=dict(SCALINGS[kind], rope_theta=10000.0))
        cfg._attn_implementation = "sdpa"
        torch.manual_seed(0)
        model = tf.LlamaForCausalLM(cfg).eval()
        _MODELS[kind] = (model, RotaryMap(model))
    return _MODELS[kind]


@settings(**SETTINGS)
@given(
    kind=st.sampled_from(sorted(SCALINGS)), n=st.integers(1, 12), offset=st.integers(0, 360), seed=st.integers(0, 1000)
)
def test_rerotated_keys_equal_the_models_keys(kind, n, offset, seed):
    """Keys of a chunk computed at 0..n-1, un-rotated and rotated to offset.., equal the keys the model
    computes for the chunk at offset.. (alone: RoPE attention is relative, so everything else is equal)."""
    model, rot = _model(kind)
    ids = torch.randint(3, 90, (1, n), generator=torch.Generator().manual_seed(seed))
    p0, pk = torch.arange(n), torch.arange(n) + offset
    at0, atk = layer_keys(model, ids, p0[None]), layer_keys(model, ids, pk[None])
    limit = LENGTH_DEPENDENT.get(kind)
    for i, ((k0, _), (kk, _)) in enumerate(zip(at0, atk)):
        moved = rotate(unrotate(k0[0], rot.tables(i, p0)), rot.tables(i, pk))
        if i == 0 or limit is None or offset + n <= limit:
            torch.testing.assert_close(moved, kk[0], atol=2e-5, rtol=1e-4)


@pytest.mark.parametrize("family", ["phi3", "gpt_neox", "qwen3"])
def test_rotary_map_partial_rotary_and_qk_norm(family):
    model = families.build(family)
    rot = RotaryMap(model)
    assert "RotaryMap(" in repr(rot) and len(rot.layers) == model.config.num_hidden_layers
    ids = torch.randint(3, 90, (1, 6))
    p0, pk = torch.arange(6), torch.arange(6) + 40
    for i, ((k0, _), (kk, _)) in enumerate(zip(layer_keys(model, ids, p0[None]), layer_keys(model, ids, pk[None]))):
        torch.testing.assert_close(
            rotate(unrotate(k0[0], rot.tables(i, p0)), rot.tables(i, pk)), kk[0], atol=2e-5, rtol=1e-4
        )


def test_unknown_rotation_is_refused(monkeypatch):
    model = families.build("llama")
    # pretend the model rotates interleaved pairs: no candidate reproduces it
    import kvpass.chunks.rope as R

    real = R.layer_keys

    def scrambled(m, ids, pos):
        return [(k.flip(-1) if int(pos.max()) > 0 else k, v) for k, v in real(m, ids, pos)]

    monkeypatch.setattr(R, "layer_keys", scrambled)
    with pytest.raises(ConfigError, match="cannot reproduce the key rotation"):
        RotaryMap(model)
