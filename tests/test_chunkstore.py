"""ChunkStore: round trip, integrity (corrupt file, foreign entry), processes writing one chunk, size cap."""

from __future__ import annotations

import multiprocessing as mp
import os
import warnings

import pytest
import torch

import families
from kvpass import ConfigError
from kvpass.chunks.chunkstore import ChunkStore, ChunkStoreWarning
from kvpass.chunks.rope import layer_keys, rotate

IDS = list(range(3, 40))


@pytest.fixture(scope="module")
def model():
    return families.build("llama")


def test_round_trip_memory_and_disk(model, tmp_path):
    store = ChunkStore(tmp_path, model)
    (key,) = store.put([IDS])
    assert key == store.key(IDS) and IDS in store and len(store) == 1
    mem = store.get(IDS)
    assert mem.source == "memory"
    fresh = ChunkStore(tmp_path, model)  # a new process: the disk tier only
    disk = fresh.get(IDS)
    assert disk.source == "disk" and disk.tokens == len(IDS)
    for a, b in zip(mem.k + mem.v, disk.k + disk.v):
        assert torch.equal(a, b)
    # the keys are pre-RoPE: rotated back to 0..n-1 they are what the model's own cache holds
    pos = torch.arange(len(IDS))
    cache = layer_keys(model, torch.tensor([IDS]), pos[None])
    for i, (k, v) in enumerate(cache):
        assert torch.allclose(rotate(disk.k[i], store.rotary.tables(i, pos)), k[0], atol=1e-5)
        assert torch.equal(disk.v[i], v[0])
    s = fresh.stats()
    assert (s["disk_hits"], s["misses"], s["disk_entries"]) == (1, 0, 1) and s["load_s"] > 0
    assert "ChunkStore(" in repr(fresh) and "StoredChunk(" in repr(disk)


def test_put_texts_needs_a_tokenizer(model, tmp_path):
    with pytest.raises(ConfigError, match="tokenizer"):
        ChunkStore(tmp_path, model).put(["some text"])
    with pytest.raises(ConfigError, match="max_bytes"):
        ChunkStore(tmp_path, model, max_bytes=0)


@pytest.mark.parametrize("damage", ["flip", "truncate", "garbage"])
def test_corrupt_file_is_a_miss_with_a_warning(model, tmp_path, damage):
    store = ChunkStore(tmp_path, model, memory_bytes=0)
    (key,) = store.put([IDS])
    path = store._file(key)
    raw = bytearray(open(path, "rb").read())
    if damage == "flip":
        raw[-7] ^= 0x40
    elif damage == "truncate":
        raw = raw[: len(raw) // 2]
    else:
        raw = bytearray(b"not a safetensors file")
    open(path, "wb").write(bytes(raw))
    with pytest.warns(ChunkStoreWarning, match="unusable"):
        assert store.get(IDS) is None
    assert not os.path.exists(path) and len(store) == 0 and store.stats()["corrupt"] == 1
    assert store.get_or_compute(IDS).source == "computed"  # recomputed and stored again
    assert ChunkStore(tmp_path, model).get(IDS).source == "disk"


def test_fingerprint_mismatch(model, tmp_path):
    other = families.build("llama", seed=1)  # same config, other weights
    a, b = ChunkStore(tmp_path, model), ChunkStore(tmp_path, other)
    assert a.fingerprint != b.fingerprint and a.key(IDS) != b.key(IDS)
    a.put([IDS])
    assert b.get(IDS) is None  # another model's entry is never found
    # an entry copied under the other model's key (or a hash collision) fails the metadata check
    os.makedirs(os.path.dirname(b._file(b.key(IDS))), exist_ok=True)
    with open(a._file(a.key(IDS)), "rb") as f, open(b._file(b.key(IDS)), "wb") as g:
        g.write(f.read())
    with pytest.warns(ChunkStoreWarning, match="fingerprint"):
        assert b.get(IDS) is None
    # ids that do not match the entry's are refused too
    wrong = IDS[:-1] + [IDS[-1] + 1]
    os.makedirs(os.path.dirname(a._file(a.key(wrong))), exist_ok=True)
    with open(a._file(a.key(IDS)), "rb") as f, open(a._file(a.key(wrong)), "wb") as g:
        g.write(f.read())
    with pytest.warns(ChunkStoreWarning, match="token ids"):
        assert ChunkStore(tmp_path, model).get(wrong) is None


def _writer(path, seed, barrier, out):
    torch.manual_seed(seed)
    model = families.build("llama")
    store = ChunkStore(path, model, memory_bytes=0)
    barrier.wait()
    store.put([IDS, list(range(50, 60 + seed))])
    out.put((store.key(IDS), store.stats()["written"]))


def test_two_processes_write_the_same_chunk(tmp_path):
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(2), ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(str(tmp_path), s, barrier, out)) for s in (0, 1)]
    for p in procs:
        p.start()
    results = [out.get(timeout=240) for _ in procs]
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    assert results[0][0] == results[1][0]
    model = families.build("llama")
    store = ChunkStore(tmp_path, model)
    assert len(store) == 3  # the shared chunk once, one own chunk each
    with warnings.catch_warnings():
        warnings.simplefilter("error", ChunkStoreWarning)  # every file is whole and valid
        assert store.get(IDS).source == "disk"
    leftovers = [f for _, _, files in os.walk(tmp_path) for f in files if f.endswith(".tmp")]
    assert leftovers == []


def test_size_cap_evicts_least_recently_used(model, tmp_path):
    store = ChunkStore(tmp_path, model, memory_bytes=0)
    chunks = [list(range(3 + i, 23 + i)) for i in range(4)]
    store.put(chunks[:1])
    one = store.stats()["disk_bytes"]
    capped = ChunkStore(tmp_path, model, memory_bytes=0, max_bytes=int(2.5 * one))
    capped.put(chunks[1:2])
    os.utime(capped._file(capped.key(chunks[0])), ns=(1, 1))  # chunk 0 is the oldest ...
    assert capped.get(chunks[1]) is not None  # ... and chunk 1 was just used
    capped.put(chunks[2:3])
    s = capped.stats()
    assert s["disk_entries"] == 2 and s["disk_bytes"] <= capped.max_bytes and s["evicted"] == 1
    assert chunks[0] not in capped and chunks[1] in capped and chunks[2] in capped
    tiny = ChunkStore(tmp_path, model, memory_bytes=0, max_bytes=one // 2)
    with pytest.warns(ChunkStoreWarning, match="exceeds max_bytes"):
        tiny.put(chunks[3:4])
    assert len(tiny) == 0
    store.clear()
    assert len(store) == 0 and store.get(chunks[1]) is None


def test_memory_tier_is_lru(model, tmp_path):
    store = ChunkStore(tmp_path, model)
    a, b = list(range(3, 20)), list(range(30, 47))
    size = store.get_or_compute(a).nbytes
    store.memory_bytes = int(1.5 * size)
    store.get_or_compute(b)
    assert store.get(b).source == "memory" and store.get(a).source == "disk"


def test_fingerprint_follows_weights_and_handles_large_tensors(model):
    from kvpass.chunks.chunkstore import model_fingerprint

    class Big(torch.nn.Module):  # float32 linspace would index past the end of this one
        def __init__(self):
            super().__init__()
            self.config = model.config
            self.w = torch.nn.Parameter(torch.zeros(28311552))

    big = Big()
    before = model_fingerprint(big)
    with torch.no_grad():
        big.w[12345] = 1.0  # not a sampled element: the float64 sum changes
    assert model_fingerprint(big) != before
    other = families.build("llama")
    assert model_fingerprint(other) == model_fingerprint(model)  # same seed, same weights


def test_weights_changed_in_place_are_never_served_stale_kv(tmp_path):
    """The fingerprint follows the weights: after an in-place write, neither tier serves the old KV."""
    model = families.build("llama")
    stores = [ChunkStore(tmp_path / "both", model), ChunkStore(tmp_path / "disk", model, memory_bytes=0)]
    for store in stores:
        store.put([IDS])
    with torch.no_grad():
        model.model.layers[0].self_attn.v_proj.weight.mul_(2.0)
    fresh = ChunkStore(tmp_path / "fresh", model).compute(IDS)
    for store in stores:
        assert IDS not in store and store.get(IDS) is None
        kv = store.get_or_compute(IDS)
        assert all(torch.equal(a, b) for a, b in zip(kv.k + kv.v, fresh.k + fresh.v))
        assert store.get(IDS) is not None


def test_pie_after_an_in_place_weight_change_equals_a_full_prefill(tmp_path):
    import kvpass

    model = families.build("llama")
    chunk, question = list(range(3, 15)), [40, 41, 42, 43]
    fusion = kvpass.ChunkFusion(model, ChunkStore(tmp_path, model), "pie", compiler="eager")
    for scale in (1.0, 1.5):
        with torch.no_grad():
            model.model.layers[1].mlp.up_proj.weight.mul_(scale)
            model.model.layers[0].self_attn.k_proj.weight.mul_(scale)
            ref = model(torch.tensor([chunk + question])).logits[:, -1]
        logits, fused = fusion.prefill([chunk], question)
        torch.testing.assert_close(logits, ref, atol=2e-5, rtol=1e-4)
        assert fused.sources == {"computed": 1}  # never the KV of the weights before


def test_a_model_cast_to_another_dtype_gets_kv_of_its_dtype(tmp_path):
    model = families.build("llama")
    store = ChunkStore(tmp_path / "auto", model)
    store.put([IDS])
    pinned = ChunkStore(tmp_path / "pinned", model, fingerprint="checkpoint-abc")
    pinned.put([IDS])
    model.to(torch.bfloat16)
    assert ChunkStore(tmp_path / "pinned", model, fingerprint="checkpoint-abc").get(IDS) is None
    for s in (store, pinned):
        assert s.get(IDS) is None  # the float32 entries are not this model's KV
        assert all(t.dtype == torch.bfloat16 for t in s.get_or_compute(IDS).k + s.get(IDS).v)


class _Tokenizer:
    def encode(self, text, add_special_tokens=False):
        return [3 + ord(c) % 80 for c in text]


def test_keys_from_put_work_with_get_and_in(model, tmp_path):
    for tok, chunk in ((None, IDS), (_Tokenizer(), "a text chunk"), (_Tokenizer(), IDS)):
        store = ChunkStore(tmp_path / str(tok is None) / str(type(chunk)), model, tokenizer=tok)
        (key,) = store.put([chunk])
        assert key in store and store.get(key).key == key
        assert ChunkStore(store.path, model, tokenizer=tok).get(key).source == "disk"
        assert store.get(key).ids.tolist() == store.ids(chunk).tolist()
        missing = "0" * 64
        assert missing not in store and store.get(missing) is None
    with pytest.raises(ConfigError, match="parameter 'chunk'.*key"):
        ChunkStore(tmp_path / "none", model).get_or_compute("0" * 64)


def test_a_chunk_is_one_row_of_integer_token_ids(model, tmp_path):
    store = ChunkStore(tmp_path, model)
    assert store.ids(torch.tensor([IDS])).tolist() == IDS  # one row [1, n] is one chunk
    two_rows = torch.arange(3, 23).reshape(2, 10)
    for bad in (two_rows, two_rows.tolist(), torch.zeros(1, 2, 3, dtype=torch.long)):
        with pytest.raises(ConfigError, match=r"kvpass ChunkStore: parameter 'chunk' must be a non-empty 1-D"):
            store.ids(bad)
    with pytest.raises(ConfigError, match="parameter 'chunk' must be a non-empty 1-D"):
        store.put(two_rows)
    for bad in ([3.7, 4.2], torch.tensor([3.0, 4.0]), [True, False]):
        with pytest.raises(ConfigError, match="parameter 'chunk' must hold integer token ids"):
            store.put(bad)
        with pytest.raises(ConfigError, match="integer token ids"):
            store.get(bad)
    assert len(store) == 0


def test_stored_chunk_is_public_and_the_chunkkv_name_is_a_deprecated_alias(model, tmp_path):
    import kvpass
    from kvpass.chunks.chunkstore import StoredChunk
    from kvpass.policies.prefill.chunkkv import ChunkKV

    assert kvpass.StoredChunk is StoredChunk and "StoredChunk" in kvpass.__all__
    assert "ChunkKV" not in kvpass.__all__
    assert isinstance(ChunkStore(tmp_path, model).get_or_compute(IDS), kvpass.StoredChunk)
    for _ in range(2):  # every access warns, not only the first
        with pytest.warns(DeprecationWarning, match=r"kvpass\.ChunkKV .*kvpass\.StoredChunk"):
            alias = kvpass.ChunkKV
        assert alias is StoredChunk and alias is not ChunkKV  # the policy keeps its own name
    with pytest.warns(DeprecationWarning, match=r"kvpass\.StoredChunk"):
        from kvpass import ChunkKV as imported
    assert imported is StoredChunk
