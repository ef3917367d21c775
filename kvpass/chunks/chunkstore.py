"""``ChunkStore``: a persistent store of per-chunk KV caches, keys before RoPE.

    store = kvpass.ChunkStore("/data/kv", model, tokenizer=tok)
    store.put(["first document ...", "second document ..."])   # computes and stores what is missing
    kv = store.get(tok.encode("first document ...", add_special_tokens=False))  # StoredChunk or None

What a chunk's entry holds: for every layer, the keys **before RoPE** and the values of the chunk
computed alone (a plain forward of its tokens at positions ``0..n-1`` on an empty cache), so that a
request can rotate the keys to whatever positions the chunk takes in it (``kvpass.chunks.rope``).

**How pre-RoPE keys are obtained without touching model code.** The chunk is run through the model
as it is; its cache holds keys rotated to ``0..n-1``. Each layer's keys are then rotated back with
the inverse of that layer's own rotation (``kvpass.chunks.rope.RotaryMap``: the model's rotary module,
with its scaling type, found and checked per layer by a one-token calibration). For every RoPE
variant whose rotation is a per-position rotation (default, linear, llama3, YaRN, LongRoPE below
its switch) the result is exactly the model's pre-RoPE key. Dynamic NTK scaling changes the
frequencies with the request length; there the chunk's keys are those of the chunk computed at the
original frequencies (what any precomputed cache must assume).

**Key.** ``sha256(model fingerprint, chunk token ids)``; ``put`` returns the keys, and ``get`` and ``in`` take
them as they take a chunk. The fingerprint hashes the model's config (private ``_*`` fields and the
transformers version left out) and a weights digest: every persistent tensor's name, shape, dtype, float64
sum and 256 strided samples. The digest is sampled: an edit that keeps every sum and avoids every sampled
element goes unnoticed; pass ``fingerprint=`` to pin it yourself (e.g. a checkpoint's own hash; the store
adds the model's dtype to it, so a checkpoint run in two dtypes keeps two sets of entries).

**The fingerprint follows the weights.** Every ``get``, ``put``, ``key`` and ``in`` first reads
``weights_version``: per parameter and persistent buffer its address and dtype (``model.to`` changes them)
and autograd's version counter (every in-place write through torch moves it: ``param.mul_``,
``load_state_dict``). When it differs from the one the fingerprint was taken at, the digest is taken again
and the memory tier emptied, so neither tier serves the KV of earlier weights. The check walks the modules
and reads no tensor's data, so it stays small beside loading a chunk; taking the digest again reads every
weight once, which happens only after the weights changed. Writes that bypass the version counter are not
seen: through ``param.data`` (``param.data.add_(delta)``) or a NumPy view; after those, build a new
``ChunkStore``.

**Layout on disk** (``path``): ``<key[:2]>/<key>.safetensors`` (tensors ``k.<layer>``,
``v.<layer>``; metadata: format, fingerprint, token ids, CRC-32 of the tensor bytes),
``index.json`` (key -> bytes, tokens), ``.lock``. Writes go to a temporary file in the store and
are renamed into place (``os.replace``), so a reader sees a whole file or none. The index and
eviction run under an exclusive ``fcntl`` lock, so several processes may read and write one store;
two processes computing the same chunk both write identical bytes and the second one is skipped.
Reads take no lock: a file removed under a reader is a miss.

**Integrity.** Every load parses the header, checks the fingerprint, the token ids and the CRC-32
of the tensor bytes. Anything wrong (truncated, flipped bits, another model's entry, an id
collision) is a miss with a ``ChunkStoreWarning``, and the file is removed: never wrong KV.

**Tiers.** An in-memory LRU tier (``memory_bytes``, tensors kept on the model's device) sits in
front of the disk. The disk tier is capped at ``max_bytes``; past the cap the least recently used
entries (file mtime, refreshed on every disk hit) are removed. An entry larger than the cap alone
is not kept.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import numbers
import os
import re
import struct
import tempfile
import time
import warnings
import zlib
from collections import OrderedDict
from dataclasses import dataclass, field

import torch
from torch import Tensor

from kvpass.generate.token_ids import token_ids, vocab_size
from kvpass.policies.contract import ConfigError

FORMAT = "kvpass-chunk/1"
INDEX = "index.json"
LOCK = ".lock"
KEY = re.compile(r"[0-9a-f]{64}")  # what put() returns: a sha256 in hex


class ChunkStoreWarning(UserWarning):
    """A stored chunk could not be used (corrupt, foreign, unreadable); it counts as a miss."""


@dataclass
class StoredChunk:
    """One chunk's KV as the store holds it: per layer ``k [H_kv, n, D]`` (before RoPE) and ``v [H_kv, n, Dv]``.
    (The ChunkKV eviction policy is another thing: ``kvpass.policies.prefill.chunkkv.ChunkKV``.)"""

    key: str
    ids: Tensor  # [n] token ids
    k: list[Tensor]
    v: list[Tensor]
    source: str = "computed"  # "computed" | "memory" | "disk"

    @property
    def tokens(self) -> int:
        return int(self.ids.numel())

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)

    def to(self, device) -> "StoredChunk":
        return StoredChunk(
            self.key, self.ids, [t.to(device) for t in self.k], [t.to(device) for t in self.v], self.source
        )

    def __repr__(self) -> str:
        return (
            f"StoredChunk(key={self.key[:12]}..., tokens={self.tokens}, layers={len(self.k)}, "
            f"bytes={self.nbytes}, source={self.source!r})"
        )


def _crc(tensors: dict[str, Tensor]) -> int:
    crc = 0
    for name in sorted(tensors):
        t = tensors[name].detach().contiguous().cpu()
        if t.numel():
            crc = zlib.crc32(t.view(torch.uint8).numpy().data, crc)
    return crc


def model_fingerprint(model) -> str:
    """sha256 of the model's config and a sampled weights digest (see the module docstring)."""
    h = hashlib.sha256()
    cfg = model.config.to_dict()
    cfg = {k: v for k, v in cfg.items() if not k.startswith("_") and k != "transformers_version"}
    h.update(json.dumps(cfg, sort_keys=True, default=str).encode())
    with torch.no_grad():
        for name, t in model.state_dict().items():
            t = t.to_local() if hasattr(t, "to_local") else t  # a DTensor: this rank's shard
            h.update(f"{name}:{tuple(t.shape)}:{t.dtype}".encode())
            flat = t.detach().reshape(-1)
            if flat.numel() == 0:
                continue
            n = flat.numel()
            k = min(256, n)
            idx = torch.arange(k, device=flat.device) * (n - 1) // max(k - 1, 1)  # exact integer strides
            sample = flat[idx].double().cpu()
            h.update(sample.numpy().tobytes())
            h.update(struct.pack("<d", float(flat.sum(dtype=torch.float64))))
    return h.hexdigest()


def _tensor_state(t: Tensor) -> tuple:
    address = t.data_ptr()
    if not address and hasattr(t, "to_local"):  # a DTensor has no storage of its own: its shard's address
        address = t.to_local().data_ptr()
    return address, t.dtype, None if t.is_inference() else t._version  # an inference tensor has no counter


def weights_version(model) -> tuple:
    """What moves when a tensor ``model_fingerprint`` hashes is written in place through torch (autograd's version
    counter), replaced or moved (its address) or cast (its dtype): one entry per parameter and persistent buffer.
    It walks the modules without naming them (``model.modules()`` builds every name: slower)."""
    state, stack = [], [model]
    while stack:
        module = stack.pop()
        stack += [m for m in module._modules.values() if m is not None]
        state += [_tensor_state(t) for t in module._parameters.values() if t is not None]
        skip = module._non_persistent_buffers_set
        state += [_tensor_state(t) for name, t in module._buffers.items() if t is not None and name not in skip]
    return tuple(state)


def _one_chunk(chunks) -> bool:
    """Whether ``put``'s argument is one chunk (a text, a tensor or array, a list of numbers), not a list of them."""
    if isinstance(chunks, str) or hasattr(chunks, "shape"):
        return True
    first = chunks[0] if isinstance(chunks, (list, tuple)) and len(chunks) else None
    return isinstance(first, numbers.Number) or isinstance(first, Tensor) and first.dim() == 0


def _key(fingerprint: str, ids: Tensor) -> str:
    h = hashlib.sha256(fingerprint.encode())
    h.update(ids.numpy().astype("<i8").tobytes())
    return h.hexdigest()


def _split_header(raw: bytes) -> tuple[dict, int]:
    """The JSON header of a safetensors file and the offset of its data section."""
    if len(raw) < 8:
        raise ValueError("file shorter than a safetensors header")
    (n,) = struct.unpack("<Q", raw[:8])
    if n > len(raw) - 8:
        raise ValueError("header length beyond the end of the file")
    return json.loads(raw[8 : 8 + n]), 8 + n


@dataclass
class _Stats:
    memory_hits: int = 0
    disk_hits: int = 0
    misses: int = 0
    computed: int = 0
    written: int = 0
    corrupt: int = 0
    evicted: int = 0
    load_s: float = 0.0
    compute_s: float = 0.0
    loaded_bytes: int = 0
    extra: dict = field(default_factory=dict)


class ChunkStore:
    """Per-chunk KV of one model, on disk (safetensors + index) with an in-memory LRU tier.

    Args:
        path: the store's directory (created if missing). Several processes may share it.
        model: the HF decoder whose KV is stored; its fingerprint keys every entry.
        tokenizer: used by ``put``/``ids`` when chunks are given as text.
        max_bytes: cap of the disk tier (least recently used entries are removed past it).
        memory_bytes: cap of the in-memory tier (0 disables it).
        fingerprint: use this string (with the model's dtype added) instead of hashing the model's weights (e.g. a
            checkpoint hash); the store then trusts it while the weights change.
        durable: ``fsync`` every file before it is renamed into place.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        model,
        *,
        tokenizer=None,
        max_bytes: int = 16 << 30,
        memory_bytes: int = 2 << 30,
        fingerprint: str | None = None,
        durable: bool = True,
    ) -> None:
        if not isinstance(max_bytes, int) or max_bytes < 1:
            raise ConfigError(f"parameter 'max_bytes' must be int in [1, inf], got {max_bytes!r}")
        if not isinstance(memory_bytes, int) or memory_bytes < 0:
            raise ConfigError(f"parameter 'memory_bytes' must be int in [0, inf], got {memory_bytes!r}")
        self.path = os.fspath(path)
        os.makedirs(self.path, exist_ok=True)
        self.model = model
        self.tokenizer = tokenizer
        self.max_bytes = max_bytes
        self.memory_bytes = memory_bytes
        self.durable = durable
        self._pinned = fingerprint
        self._rank = ""
        ranks = getattr(model, "tp_size", None) or 1
        if ranks > 1:  # a split model: each rank stores its own heads' KV, under its own key (a pinned one too)
            import torch.distributed as dist

            self._rank = f"/tensor parallel rank {dist.get_rank()} of {ranks}"
        self._rotary = None
        self._memory: OrderedDict[str, StoredChunk] = OrderedDict()
        self._memory_used = 0
        self._stats = _Stats()
        self._version: tuple | None = None
        self._fingerprint = ""
        self.fingerprint  # taken now: a model it cannot hash fails here

    # -- identity ---------------------------------------------------------------------------------

    @property
    def fingerprint(self) -> str:
        """What keys this model's entries, for its weights as they are now: taken again (and the memory tier
        emptied) whenever ``weights_version`` moved since it was taken (module docstring)."""
        version = weights_version(self.model)
        if version != self._version:
            if self._pinned:
                dtype = next((p.dtype for p in self.model.parameters() if p.is_floating_point()), None)
                fingerprint = f"{self._pinned}/{dtype}"
            else:
                fingerprint = model_fingerprint(self.model)
            self._fingerprint, self._version = fingerprint + self._rank, version
            self._memory.clear()  # KV of other weights, or on another device
            self._memory_used = 0
        return self._fingerprint

    @property
    def rotary(self):
        """The model's per-layer rotation (``kvpass.chunks.rope.RotaryMap``), calibrated on first use."""
        if self._rotary is None:
            from kvpass.chunks.rope import RotaryMap

            self._rotary = RotaryMap(self.model)
        return self._rotary

    def ids(self, chunk) -> Tensor:
        """Token ids ``[n]`` (int64, CPU) of one chunk: a text, a list of ids, or a tensor ``[n]`` (or ``[1, n]``)."""
        if isinstance(chunk, str):
            if self.tokenizer is None and KEY.fullmatch(chunk):
                raise ConfigError(
                    f"kvpass ChunkStore: parameter 'chunk' is a store key ({chunk[:12]}...) with no "
                    f"entry for the model's current weights (never stored, evicted, or stored before "
                    f"the weights changed); pass the chunk's token ids"
                )
            if self.tokenizer is None:
                raise ConfigError("parameter 'tokenizer' must be given to the ChunkStore to store chunks as text")
            chunk = self.tokenizer.encode(chunk, add_special_tokens=False)
        return token_ids(chunk, "kvpass ChunkStore", "chunk", vocab_size(self.model)).cpu()

    def key(self, chunk) -> str:
        """The store key of a chunk: sha256 of the model fingerprint and the token ids."""
        return _key(self.fingerprint, self.ids(chunk))

    def _file(self, key: str) -> str:
        return os.path.join(self.path, key[:2], key + ".safetensors")

    # -- public API -------------------------------------------------------------------------------

    def get(self, chunk) -> StoredChunk | None:
        """The stored KV of ``chunk`` (text, ids, or a key ``put`` returned), from memory or disk; None when it
        is not stored for the model's current weights (or its entry failed the integrity check, which also
        warns)."""
        ids = self._resolve(chunk)
        if ids is None:
            self._stats.misses += 1
            return None
        fingerprint = self.fingerprint
        key = _key(fingerprint, ids)
        hit = self._memory.get(key)
        if hit is not None:
            self._memory.move_to_end(key)
            self._stats.memory_hits += 1
            return StoredChunk(hit.key, hit.ids, hit.k, hit.v, "memory")
        kv = self._load(key, ids, fingerprint)
        if kv is None:
            self._stats.misses += 1
            return None
        self._stats.disk_hits += 1
        kv = kv.to(self._device())
        self._remember(kv)
        return kv

    def get_or_compute(self, chunk) -> StoredChunk:
        """``get``, or compute the chunk's KV, store it and return it."""
        kv = self.get(chunk)
        if kv is not None:
            return kv
        ids = self.ids(chunk)
        kv = self.compute(ids)
        self._write(kv)
        self._remember(kv)
        return kv

    def put(self, chunks) -> list[str]:
        """Compute and store every chunk (texts or id lists) not stored yet; returns their keys."""
        if _one_chunk(chunks):
            chunks = [chunks]
        return [self.get_or_compute(c).key for c in chunks]

    def __contains__(self, chunk) -> bool:
        """Whether ``chunk`` (text, ids, or a key ``put`` returned) is stored for the model's current weights."""
        ids = self._resolve(chunk)
        if ids is None:
            return False
        key = self.key(ids)
        return key in self._memory or os.path.exists(self._file(key))

    def _resolve(self, chunk) -> Tensor | None:
        """The token ids of ``chunk``; of a key (64 hex digits), those of its entry for the current weights, or
        None without one. A key-shaped string that names no entry is read as text where there is a tokenizer."""
        if isinstance(chunk, str) and KEY.fullmatch(chunk):
            ids = self._entry_ids(chunk)
            if ids is not None or self.tokenizer is None:
                return ids
        return self.ids(chunk)

    def _entry_ids(self, key: str) -> Tensor | None:
        """The token ids the entry under ``key`` holds, from the memory tier or its file's header, when it was
        stored for the model's current weights; else None."""
        fingerprint = self.fingerprint  # first: a change of weights empties the memory tier
        hit = self._memory.get(key)
        if hit is not None:
            return hit.ids
        try:
            with open(self._file(key), "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                meta = json.loads(f.read(n)).get("__metadata__") or {}
            ids = torch.tensor([int(i) for i in meta["ids"].split(",")], dtype=torch.long)
        except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error):
            return None
        if meta.get("fingerprint") != fingerprint or _key(fingerprint, ids) != key:
            return None
        return ids

    def compute(self, chunk) -> StoredChunk:
        """The chunk's KV computed alone at positions ``0..n-1``, keys rotated back to before RoPE."""
        from kvpass.chunks.rope import layer_keys, unrotate

        ids = self.ids(chunk)
        t0 = time.perf_counter()
        dev = self._device()
        pos = torch.arange(ids.numel(), device=dev)
        kvs = layer_keys(self.model, ids[None].to(dev), pos[None])
        rot = self.rotary
        ks, vs = [], []
        for i, (k, v) in enumerate(kvs):
            ks.append(unrotate(k[0], rot.tables(i, pos)).to(k.dtype).contiguous())
            vs.append(v[0].contiguous())
        self._stats.computed += 1
        self._stats.compute_s += time.perf_counter() - t0
        return StoredChunk(self.key(ids), ids, ks, vs, "computed")

    def stats(self) -> dict:
        """Hit/miss counters, time spent loading from disk and computing, and both tiers' sizes."""
        s = self._stats
        index = self._read_index()
        return {
            "memory_hits": s.memory_hits,
            "disk_hits": s.disk_hits,
            "misses": s.misses,
            "computed": s.computed,
            "written": s.written,
            "corrupt": s.corrupt,
            "evicted": s.evicted,
            "load_s": s.load_s,
            "compute_s": s.compute_s,
            "loaded_bytes": s.loaded_bytes,
            "memory_entries": len(self._memory),
            "memory_bytes": self._memory_used,
            "disk_entries": len(index),
            "disk_bytes": sum(e["bytes"] for e in index.values()),
            "max_bytes": self.max_bytes,
        }

    def clear(self, memory_only: bool = False) -> None:
        """Remove every entry (of this store's directory, all models) and empty the memory tier."""
        self._memory.clear()
        self._memory_used = 0
        if memory_only:
            return
        with self._lock():
            for key in list(self._read_index()):
                self._remove(key)
            for sub in os.listdir(self.path):
                d = os.path.join(self.path, sub)
                if os.path.isdir(d):
                    for f in os.listdir(d):
                        if f.endswith(".safetensors") or f.endswith(".tmp"):
                            with contextlib.suppress(FileNotFoundError):
                                os.remove(os.path.join(d, f))
            self._write_index({})

    def __len__(self) -> int:
        return len(self._read_index())

    def __repr__(self) -> str:
        s = self.stats()
        return (
            f"ChunkStore(path={self.path!r}, fingerprint={self.fingerprint[:12]}..., "
            f"disk={s['disk_entries']} entries/{s['disk_bytes']} B of {self.max_bytes} B, "
            f"memory={s['memory_entries']} entries/{s['memory_bytes']} B, "
            f"hits={s['memory_hits']}+{s['disk_hits']}, misses={s['misses']})"
        )

    # -- memory tier ------------------------------------------------------------------------------

    def _device(self):
        return next(self.model.parameters()).device

    def _remember(self, kv: StoredChunk) -> None:
        if self.memory_bytes <= 0 or kv.nbytes > self.memory_bytes or kv.key in self._memory:
            return
        self._memory[kv.key] = kv
        self._memory_used += kv.nbytes
        while self._memory_used > self.memory_bytes:
            _, old = self._memory.popitem(last=False)
            self._memory_used -= old.nbytes

    # -- disk tier --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def _lock(self):
        fd = os.open(os.path.join(self.path, LOCK), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)

    def _read_index(self) -> dict:
        try:
            with open(os.path.join(self.path, INDEX)) as f:
                index = json.load(f)
            return index if isinstance(index, dict) else {}
        except (FileNotFoundError, json.JSONDecodeError):
            return {}

    def _atomic_write(self, dest: str, data: bytes) -> None:
        os.makedirs(os.path.dirname(dest), exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=os.path.dirname(dest), suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                if self.durable:
                    os.fsync(f.fileno())
            os.replace(tmp, dest)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.remove(tmp)
            raise

    def _write_index(self, index: dict) -> None:
        self._atomic_write(os.path.join(self.path, INDEX), json.dumps(index, sort_keys=True).encode())

    def _serialise(self, kv: StoredChunk) -> bytes:
        from safetensors.torch import save

        tensors = {}
        for i, (k, v) in enumerate(zip(kv.k, kv.v)):
            tensors[f"k.{i}"] = k.detach().contiguous().cpu()
            tensors[f"v.{i}"] = v.detach().contiguous().cpu()
        meta = {
            "format": FORMAT,
            "fingerprint": self.fingerprint,
            "layers": str(len(kv.k)),
            "ids": ",".join(map(str, kv.ids.tolist())),
            "crc32": str(_crc(tensors)),
        }
        return save(tensors, metadata=meta)

    def _write(self, kv: StoredChunk) -> None:
        data = self._serialise(kv)
        dest = self._file(kv.key)
        with self._lock():
            index = self._read_index()
            if kv.key in index and os.path.exists(dest):
                os.utime(dest)  # written by another process meanwhile: identical bytes
                return
            self._atomic_write(dest, data)
            self._stats.written += 1
            index[kv.key] = {"bytes": len(data), "tokens": kv.tokens}
            self._evict(index)
            self._write_index(index)
        if kv.key not in index:
            warnings.warn(
                f"kvpass ChunkStore: a chunk of {len(data)} bytes exceeds max_bytes={self.max_bytes} "
                f"and was not kept on disk",
                ChunkStoreWarning,
                stacklevel=3,
            )

    def _evict(self, index: dict) -> None:
        """Drop least recently used entries until the index fits ``max_bytes`` (lock held)."""
        total = sum(e["bytes"] for e in index.values())
        if total <= self.max_bytes:
            return
        ages = []
        for key in index:
            try:
                ages.append((os.stat(self._file(key)).st_mtime_ns, key))
            except FileNotFoundError:
                ages.append((-1, key))
        for _, key in sorted(ages):
            if total <= self.max_bytes:
                break
            total -= index.pop(key)["bytes"]
            self._remove(key)
            self._stats.evicted += 1

    def _remove(self, key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.remove(self._file(key))
        kv = self._memory.pop(key, None)
        if kv is not None:
            self._memory_used -= kv.nbytes

    def _load(self, key: str, ids: Tensor, fingerprint: str) -> StoredChunk | None:
        from safetensors.torch import load

        path = self._file(key)
        t0 = time.perf_counter()
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            return None
        try:
            header, _ = _split_header(raw)
            meta = header.get("__metadata__") or {}
            if meta.get("format") != FORMAT:
                raise ValueError(f"format {meta.get('format')!r}, expected {FORMAT!r}")
            if meta.get("fingerprint") != fingerprint:
                raise ValueError("stored for another model (fingerprint mismatch)")
            if meta.get("ids") != ",".join(map(str, ids.tolist())):
                raise ValueError("stored token ids differ from the chunk's")
            tensors = load(raw)
            if str(_crc(tensors)) != meta.get("crc32"):
                raise ValueError("CRC-32 of the tensor bytes does not match")
            layers = int(meta["layers"])
            k = [tensors[f"k.{i}"] for i in range(layers)]
            v = [tensors[f"v.{i}"] for i in range(layers)]
        except Exception as e:  # noqa: BLE001 - any failure to read an entry is a miss, never wrong KV
            self._stats.corrupt += 1
            warnings.warn(
                f"kvpass ChunkStore: entry {key[:12]}... at {path} is unusable ({e}); treating it as "
                f"a miss and removing it",
                ChunkStoreWarning,
                stacklevel=3,
            )
            with self._lock():
                index = self._read_index()
                index.pop(key, None)
                self._remove(key)
                self._write_index(index)
            return None
        with contextlib.suppress(FileNotFoundError):
            os.utime(path)  # LRU clock of the disk tier
        self._stats.load_s += time.perf_counter() - t0
        self._stats.loaded_bytes += len(raw)
        return StoredChunk(key, ids, k, v, "disk")
