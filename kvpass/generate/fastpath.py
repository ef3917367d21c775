"""``kvpass.compile``: the fast path in one call.

    be = kvpass.compile(model, "snapkv", budget=2048)
    model.generate(ids, max_new_tokens=256)          # any prompt length, no cache to size by hand

It compiles ``model.forward`` with a kvpass backend (``dynamic=True``; on a GPU with Inductor,
``mode="reduce-overhead"``: the decode step replays as a CUDA graph) and gives ``model.generate`` a
``kvpass.SlotCache`` whenever the call does not bring its own cache, and a decoding loop that queues the
next step before it asks whether the last one finished (``kvpass.generate.decode_loop``). The cache is sized in buckets
(``bucket``: a quarter of an octave, so at most a quarter of it is never used) and kept: the next call
that fits it resets and reuses it, so its slots keep their addresses and the recorded CUDA graphs
replay. A capacity never enters the compiled code, nor does a batch of two or more rows (the slots' capacity and
row dimensions are symbolic, ``kvpass.cache.slots``), so every prompt length runs on the one prefill graph and the
one decode graph of its batch kind (one row; more). A prompt given as ``inputs_embeds`` runs on the SlotCache too.
The forward is compiled on a code object of its own (``own_code``) and ``generate`` runs with Dynamo's recompile
limit at least ``RECOMPILE_LIMIT``, as does a plain call of the compiled forward: the limit counts graphs per code
object.

A call whose output carries the cache (``return_dict_in_generate=True``) gives it to that output: the caller
may continue from it, and the next call builds another. A ``cache_implementation`` in the model's own
generation config (a hub model's default) gives way to the SlotCache. A call that brings ``past_key_values``
(a SlotCache is checked against its size, and for a hole in the attention mask, which its slots are read
without), asks for no cache (``use_cache=False``) or for one of transformers' (a ``cache_implementation``
keyword, or in a generation config passed), or that ``generate`` cannot run on a SlotCache (beam search,
assisted decoding), goes to the model's own ``generate`` unchanged; the compiled forward still applies the
policy where it can, and refuses where it cannot (a SlotCache of the caller's that already holds as many tokens
as the prompt is refused: transformers would read the prompt as a continuation). A model whose graph kvpass
leaves unchanged (attention it does not recognise; a policy that refuses a site) cannot read a SlotCache right
(``kvpass.errors.SlotCacheUnrewritten``): from the call that finds it on, generate runs the model's own cache,
warned once. ``output_attentions=True`` is
refused: the model's attention is replaced, and so is ``prefill_chunk_size`` where the policy keeps part of the
prompt (it selects from the whole prompt at once). A list of prompts goes through a ``RequestQueue``; its
``max_length`` means what ``generate``'s does (prompt plus new tokens, per prompt). Calls run one at a time (a
lock).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import re
import threading
import types

import torch

from kvpass.cache.argument import cache_kwarg
from kvpass.cache.slots import SlotCache
from kvpass.compiler.backend import Backend, backend
from kvpass.errors import ConfigError, SlotCacheUnrewritten, warn_once
from kvpass.generate import decode_loop, reconstruct
from kvpass.generate.requests import RequestQueue
from kvpass.generate.token_ids import check_values, vocab_size

# generate() arguments whose decoding a SlotCache does not run (it holds one sequence per row)
_OWN_DECODING = ("num_beams", "assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit")


_FAST_PATH_NOTE = (
    "kvpass: this generate() call ran on kvpass.compile's fast path: a kvpass.SlotCache, whose shapes "
    "are static as a StaticCache's (transformers gives the model a 4-D attention mask). A model that "
    "cannot run on such a cache can still generate with its own DynamicCache: pass "
    "past_key_values=DynamicCache(config=model.config), and the compiled policy runs where it can"
)


def bucket(n: int, floor: int = 64) -> int:
    """The capacity bucket of ``n`` tokens: ``floor`` or more, rounded up to a multiple of a quarter of
    ``n``'s power of two (64, 80, 96, 112, 128, 160, ..., 1024, 1280, ...)."""
    if n <= floor:
        return floor
    step = 1 << max(n.bit_length() - 3, 0)
    return -(-n // step) * step


def free_memory(device: torch.device) -> int | None:
    """Bytes a new tensor can take on ``device``: CUDA's free memory plus what torch's allocator holds unused, the
    CPU's ``MemAvailable`` (Linux); None where not known."""
    if device.type == "cuda":
        unused = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return torch.cuda.mem_get_info(device)[0] + unused
    try:
        with open("/proc/meminfo") as f:
            return next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError):
        return None


def check_room(model, be: Backend, rows: int, length: int, room: int, new: int) -> None:
    """Refuse a SlotCache of ``rows`` x ``length`` tokens (``room`` of them new) that the model's device has no room
    for, before it is allocated (sized on the meta device): the fast path sizes its cache for every token a call
    may generate, and the uncompiled model, stopping at eos, may never need them."""
    device = next(model.parameters()).device
    free = free_memory(device) if device.type in ("cpu", "cuda") else None
    if free is None:
        return
    sized = SlotCache(model, be, max_length=length, batch_size=rows, max_new_tokens=room, device="meta")
    need = sum(t.numel() * t.element_size() for layer in sized.layers for t in layer.tensors())
    if need > free:
        raise ConfigError(
            f"kvpass.compile: generate(max_new_tokens={new}) needs a SlotCache of {length} tokens x "
            f"{rows} row(s), {need / 2**30:.1f} GiB, and {device} has {free / 2**30:.1f} GiB free: "
            f"the fast path allocates the cache for every token max_new_tokens (or max_length) allows "
            f"before it generates, eos or not. Pass a max_new_tokens whose cache fits, or generate on a "
            f"cache that grows: past_key_values=DynamicCache(config=model.config)"
        )


# Dynamo's recompile limit while a generate call runs (the user's, where higher): the graphs of ordinary use are a
# prefill and a decode graph for a batch of one and for a symbolic batch, a left-padded prefill and one from
# inputs_embeds per batch kind (up to 8), and the limit counts per forward (each compiled model has its own, own_code)
RECOMPILE_LIMIT = 16


class FastGenerate:
    """``model.generate`` with a reused, bucket-sized ``kvpass.SlotCache`` (see the module docstring).
    ``caches`` holds the caches kept, one per (rows, dtype, device, staging); ``original`` is the model's own
    ``generate``."""

    def __init__(self, model, be: Backend, original) -> None:
        self.model, self.backend, self.original = model, be, original
        self.caches: dict[tuple, SlotCache] = {}
        self.own_cache = ""  # why generate runs the model's own cache: kvpass left the model's graph unchanged
        # one call at a time: calls share the kept caches (two threads' generations wrote into one cache) and the
        # decoding loop sets torch's process-wide compile stance around its steps
        self.lock = threading.RLock()
        self.cache_kwarg = cache_kwarg(model)
        self.keeps_logits = "logits_to_keep" in inspect.signature(type(model).forward).parameters
        functools.update_wrapper(self, original)
        self.compiled_forward = model.__dict__.get("forward")  # what kvpass.compile set (direct steps check it)

    def cache_for(
        self, rows: int, prompt: int, new: int, like: SlotCache | None = None, exact: bool = False
    ) -> SlotCache:
        """A reset cache for ``rows`` sequences of ``prompt`` tokens and ``new`` new ones: the one kept
        for these rows when it fits, else a new one of the next bucket (which replaces it). With ``like``,
        one of exactly ``like``'s sizes (a staging cache whose rows ``like.admit`` takes); ``exact``: sized
        ``prompt + new`` and ``new``, not in buckets."""
        p = next(self.model.parameters())
        key = (rows, p.dtype, p.device, like is not None)  # a staging cache is kept apart from a batch of one
        cache = self.caches.get(key)
        if like is not None:
            length, room = like.max_length, like.max_new_tokens
        elif exact:
            length, room = prompt + new, new
        else:
            length, room = bucket(prompt + new), bucket(new, floor=16)
        if (
            cache is None
            or not cache.fits(prompt + new, new, rows)  # else any kept cache that fits serves
            or (exact or like is not None)
            and cache.max_length != length
            or like is not None
            and cache.capacities != like.capacities
        ):
            self.caches.pop(key, None)  # its memory goes back before the larger one is allocated
            check_room(self.model, self.backend, rows, length, room, new)
            cache = SlotCache(self.model, self.backend, max_length=length, batch_size=rows, max_new_tokens=room)
            self.caches[key] = cache
        cache.reset()
        return cache

    def __call__(self, inputs=None, *args, **kwargs):
        """``generate``: the fast path, or the model's own ``generate`` (module docstring). Calls from several
        threads run one after another."""
        with self.lock, recompile_floor():
            self.backend.last_direct_steps = None  # kvpass's decoding loop sets it; a call without it took none
            return self._generate(inputs, *args, **kwargs)

    def _generate(self, inputs=None, *args, **kwargs):
        ids = kwargs.get("input_ids", inputs)
        if isinstance(ids, (list, tuple)) and not args and (not ids or not isinstance(ids[0], int)):
            return self.many(ids, **kwargs) if ids else []  # no prompts, no outputs (as RequestQueue.run)
        if "max_batch" in kwargs:
            raise ConfigError(
                "kvpass.compile: generate(max_batch=...) batches a list of prompts (1-D tensors or lists of ids, "
                "no padding); a 2-D tensor's rows decode together as one batch: drop max_batch, or pass the "
                "prompts as a list"
            )
        config, _ = decode_loop.run_config(self.model, kwargs)  # the options as generate() merges them

        def option(name):
            return getattr(config, name, None)

        if option("output_attentions"):
            raise ConfigError(
                "kvpass.compile: generate(output_attentions=True): kvpass replaces the model's attention, "
                "so there are no attention weights of the model's own to return (a decode step's would "
                "span the SlotCache's slots); generate with an uncompiled copy of the model for them"
            )
        given = next((kwargs[k] for k in ("past_key_values", "cache") if kwargs.get(k) is not None), None)
        embeds = kwargs.get("inputs_embeds")
        if ids is None and isinstance(embeds, torch.Tensor) and embeds.dim() == 3:
            ids = embeds[:, :, 0]  # the prompt's [rows, length], for sizing the cache (generate reads the embeddings)
        else:
            _check_ids(ids, vocab_size(self.model))
        _check_prompt(ids, kwargs.get("attention_mask"))
        if isinstance(given, SlotCache) and isinstance(ids, torch.Tensor) and ids.dim() == 2:
            self._check_continuation(given, ids.shape[1], new_tokens(kwargs, config, ids.shape[1]))
            self._check_no_holes(ids, kwargs.get("attention_mask"), option("pad_token_id"), option("eos_token_id"))
        own = [k for k in _OWN_DECODING if option(k) not in (None, 1, False)]
        chosen = kwargs.get("cache_implementation") or getattr(
            kwargs.get("generation_config"), "cache_implementation", None
        )
        if (
            args
            or not isinstance(ids, torch.Tensor)
            or ids.dim() != 2
            or own
            or given is not None
            or option("use_cache") is False  # no cache: every step reruns the whole sequence
            or chosen is not None  # the caller chose one of transformers' caches
            or self.own_cache
        ):
            return self._original(inputs, *args, **kwargs)
        asked = dict(kwargs)
        prompt = ids.shape[1]
        new = new_tokens(kwargs, config, prompt)
        if new < 1:
            raise ConfigError(
                f"kvpass.compile: generate() was asked for {new} new tokens after a {prompt}-token "
                f"prompt; pass max_new_tokens >= 1"
            )
        rows = ids.shape[0] * (option("num_return_sequences") or 1)
        cache = self.cache_for(rows, prompt, new)
        chunk = option("prefill_chunk_size")
        if chunk and chunk < prompt and not cache.holds_all(prompt + new, new):
            raise ConfigError(
                f"kvpass.compile: generate(prefill_chunk_size={chunk}) prefills the {prompt}-token "
                f"prompt in chunks, and policy '{self.backend.policy.name}' keeps only part of a prompt, "
                f"chosen from the whole prompt at once (a later chunk would overflow the cache); drop "
                f"prefill_chunk_size (kvpass's prefill never builds the [prompt, prompt] scores)"
            )
        if decode_loop.usable(self.model, kwargs):
            kwargs["custom_generate"] = decode_loop.decode
        elif self.backend.policy.needs.reconstructs:
            raise ConfigError(
                f"kvpass.compile: policy '{self.backend.policy.name}' scores the prompt with repeat "
                f"passes that kvpass's decoding loop runs before the prefill, and this generate() call "
                f"cannot take that loop (a streamer, synced_gpus or a custom_generate of the caller's); "
                f"generate without them"
            )
        if kwargs.get("compile_config") is None and "disable_compile" not in kwargs:
            # the forward is compiled already; HF's own compile of model.__call__ around it would only add a Dynamo
            # frame (and its guards) per step. On a copy of a caller's generation config, since transformers warns
            # of keywords passed beside one as if the caller had passed them
            if kwargs.get("generation_config") is not None:
                kwargs["generation_config"] = copy.copy(kwargs["generation_config"])
                kwargs["generation_config"].disable_compile = True
            else:
                kwargs["disable_compile"] = True
        # A cache_implementation in the model's own generation config (a hub model may ship "static") is a default
        # that kvpass's SlotCache replaces; transformers refuses a cache passed beside one, and fills a caller's
        # generation config from the model's, so it is set aside for the call
        defaults = self.model.generation_config
        shipped, defaults.cache_implementation = getattr(defaults, "cache_implementation", None), None
        try:
            out = self._original(inputs, *args, **{self.cache_kwarg: cache}, **kwargs)
        except Exception as e:
            refused = _slot_refusal(e)  # raised by the pass, wrapped or not on its way out of Dynamo
            if refused is None:
                # the model's code may not run on a static-shape cache (Falcon's ALiBi); transformers' own check of
                # the call's arguments (a misspelt keyword) has nothing to do with the cache
                unused = "are not used by the model" in str(e)
                if not isinstance(e, ConfigError) and not unused and hasattr(e, "add_note"):  # Python >= 3.11
                    e.add_note(_FAST_PATH_NOTE)
                raise
            self._take_own_cache(refused)  # kvpass leaves the graph unchanged: the model's own cache reads it right
        finally:
            defaults.cache_implementation = shipped
        if self.own_cache:  # (after the model's generation config has its own cache_implementation back)
            return self._original(inputs, *args, **asked)
        if getattr(out, self.cache_kwarg, None) is cache:
            # the output carries the cache (return_dict_in_generate): it is the caller's now, to read or to continue
            # from; reusing it for the next call would change it under them. The next call builds another
            self.caches = {k: c for k, c in self.caches.items() if c is not cache}
        return out

    @staticmethod
    def _check_no_holes(ids: torch.Tensor, mask, pad, eos) -> None:
        """A continuation on a SlotCache appends its new tokens by position and reads the slots without the attention
        mask: a row whose mask has a 0 after its first 1 (a pad token inside the text, which transformers masks when
        it infers the mask from the ids, or a mask passed with a hole) would attend to what the mask hides. Left
        padding (0s before a row's first 1) is what the cache's prefill already keeps out."""
        if mask is None and pad is not None:  # transformers' inference: ids != pad, unless pad is an eos token
            eos = [] if eos is None else [eos] if isinstance(eos, int) else list(eos)
            mask = None if pad in eos else ids.ne(pad)
        if mask is None or mask.dim() != 2:
            return
        started = mask.bool().cummax(dim=-1).values
        if (started & ~mask.bool()).any():
            raise ConfigError(
                "kvpass.compile: generate() continues a SlotCache with an attention mask that has a 0 "
                "after a row's first token (a pad token inside the sequence: transformers masks it when "
                "it infers the mask from the ids). A SlotCache reads its slots by position, without the "
                "mask, so it would attend to that token; continue without the cache (the whole sequence "
                "is prefilled with its mask), or on a DynamicCache"
            )

    @staticmethod
    def _check_continuation(cache: SlotCache, length: int, new: int) -> None:
        """A SlotCache passed back to ``generate`` continues a sequence: ``length`` tokens (the whole sequence so
        far plus the new prompt tokens) and ``new`` more must fit it, and it must hold fewer than ``length``."""
        seen = cache.seen
        if seen >= length:
            raise ConfigError(
                f"kvpass.compile: generate() got a SlotCache that already holds {seen} tokens "
                f"and a {length}-token prompt: continuing a generation passes the whole "
                f"sequence so far plus the new tokens; for a new prompt call cache.reset() first"
            )
        if length + new > cache.max_length:
            raise ConfigError(
                f"kvpass.compile: generate() continues a SlotCache built for {cache.max_length} tokens "
                f"(a cache an earlier generate() returned is sized for that call) with {length} tokens "
                f"and {new} new ones; to go further, call generate() on the whole sequence without the "
                f"cache (it is prefilled again into a cache sized for it), or build a "
                f"kvpass.SlotCache(model, backend, max_length=...) of your own"
            )

    def _original(self, *args, **kwargs):
        """The model's own ``generate``, with Dynamo's recompile-limit failure told as kvpass's advice and kvpass's
        errors raised inside Dynamo's compile given as they are."""
        try:
            return self.original(*args, **kwargs)
        except torch._dynamo.exc.FailOnRecompileLimitHit as e:  # the limit was lowered after a graph compiled
            raise ConfigError(self.backend.recompile_advice()) from e
        except torch._dynamo.exc.BackendCompilerFailed as e:  # kvpass's own refusal, unwrapped
            if isinstance(e.inner_exception, ConfigError):
                raise e.inner_exception from None
            raise

    def many(self, prompts, max_batch: int = 8, progress: bool = False, **generation) -> list[torch.Tensor]:
        """``generate`` over a list of prompts of any lengths (1-D tensors or lists of ids, no padding): up to
        ``max_batch`` decode together, each prefilled alone and admitted into a free row as one finishes
        (``kvpass.RequestQueue``, which documents ``generation``'s options). Returns each prompt followed by its
        new tokens, 1-D, in order."""
        generation.pop("input_ids", None)
        if generation.pop("attention_mask", None) is not None:
            raise ConfigError(
                "kvpass.compile: generate() over a list of prompts takes no attention_mask (the "
                "prompts are not padded: pass each one's tokens alone)"
            )
        with self.lock:  # max_length keeps generate's meaning there: prompt + new tokens, per prompt
            if not self.own_cache:
                try:  # the queue's refusals, named by the call the user made
                    queue = RequestQueue.like_generate(
                        self.model,
                        max_batch=min(max_batch, len(prompts)) if isinstance(max_batch, int) else max_batch,
                        **generation,
                    )
                except ConfigError as e:
                    raise _as_list_generate(e) from None
                for i, p in enumerate(prompts):
                    try:
                        queue.add(p)
                    except ConfigError as e:
                        raise _as_list_generate(e, i) from None
                try:
                    return queue.run(progress=progress)
                except Exception as e:  # the queue's RequestFailed, from Dynamo's BackendCompilerFailed
                    if (refused := _slot_refusal(e)) is None:
                        raise
                    self._take_own_cache(refused)
            device = self.model.device  # one prompt at a time, each on the model's own cache
            return [self._original(torch.as_tensor(p, device=device)[None], **generation)[0] for p in prompts]

    def _take_own_cache(self, refused: SlotCacheUnrewritten) -> None:
        """From now on generate runs the model's own cache (kvpass leaves the model's graph unchanged), said once."""
        self.own_cache, self.caches = refused.reason, {}
        warn_once(
            f"kvpass.compile: generate() runs on the model's own cache (a SlotCache is read right only by the "
            f"attention kvpass rewrites, and kvpass leaves this model's graph unchanged: {refused.reason})",
            self.backend,
        )

    def __repr__(self) -> str:
        held = ", ".join(
            f"{rows} rows x {c.max_length}{' (staging)' if staging else ''}"
            for (rows, _, _, staging), c in self.caches.items()
        )
        if self.own_cache:  # the fast path is off for this model
            return f"kvpass.FastGenerate(policy={self.backend.policy.name!r}, the model's own cache: {self.own_cache})"
        return f"kvpass.FastGenerate(policy={self.backend.policy.name!r}, caches=[{held}])"


def _check_ids(ids, vocab: int | None) -> None:
    """Refuse a tensor of prompt ids that the model would fail on or misread: not ``[batch, length]``, not of an
    integer dtype (Dynamo's trace fails on it, with ``_check_prompt``'s consequence), or an id outside the
    vocabulary (a compiled embedding's bounds check aborts the process on a CPU; on a GPU it is a device assert)."""
    if not isinstance(ids, torch.Tensor):
        return
    if ids.dim() != 2:
        raise ConfigError(
            f"kvpass.compile: generate()'s parameter 'input_ids' must be a [batch, length] tensor, got shape "
            f"{tuple(ids.shape)}; pass ids[None] for one prompt, or a list of 1-D prompts"
        )
    check_values(ids, "kvpass.compile: generate()", "input_ids", vocab)
    if ids.dtype not in (torch.int64, torch.int32):  # the embedding takes no other integers
        raise ConfigError(
            f"kvpass.compile: generate()'s parameter 'input_ids' must be torch.long (or torch.int32), got "
            f"{ids.dtype}; pass input_ids.long()"
        )


def _check_prompt(ids, mask) -> None:
    """Refuse, before Dynamo traces anything, a prompt the model cannot run: Dynamo's own failure on it would mark
    the forward's frame to be skipped, and every later call would compile the model's layers piecemeal, with the
    policy applied to some of them."""
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        return
    if ids.shape[1] == 0:
        raise ConfigError(
            f"kvpass.compile: generate() got an empty prompt (input_ids of shape {tuple(ids.shape)}); pass at "
            f"least one token per row"
        )
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and tuple(mask.shape) != tuple(ids.shape):
        raise ConfigError(
            f"kvpass.compile: generate()'s parameter 'attention_mask' must have the prompt's shape "
            f"{tuple(ids.shape)} (one entry per token), got {tuple(mask.shape)}"
        )


def _as_list_generate(error: ConfigError, prompt: int | None = None) -> ConfigError:
    """A ``RequestQueue`` refusal as ``generate`` over a list of prompts gives it: labelled with that call (and the
    prompt it concerns) rather than the queue the call builds."""
    where = "kvpass.compile: generate() over a list of prompts (a kvpass.RequestQueue)"
    where += "" if prompt is None else f", prompt {prompt}"
    return ConfigError(re.sub(r"^kvpass\.RequestQueue(\.\w+)?:", where + ":", str(error), count=1))


def _slot_refusal(e: BaseException | None) -> SlotCacheUnrewritten | None:
    """The ``SlotCacheUnrewritten`` behind ``e`` (raised in Dynamo's compile, wrapped on its way out), if any."""
    while e is not None and not isinstance(e, SlotCacheUnrewritten):
        e = getattr(e, "inner_exception", None) or e.__cause__
    return e


def new_tokens(kwargs: dict, config, prompt: int) -> int:
    """The most new tokens ``generate(**kwargs)`` may produce after a ``prompt``-token prompt, for sizing its cache:
    ``max_new_tokens`` first (a keyword, then the generation config: transformers takes it over a ``max_length``
    keyword, with a warning), then a ``max_length`` keyword (the total); a ``max_length`` only in the generation
    config is read as new tokens, since transformers versions take it as the total (5.24) or, when it is the
    model's default, as new tokens (5.14): room for either; else transformers' default of 20 new tokens. A length
    that is not an int is refused by name (transformers runs a float, comparing lengths with it)."""
    for name in ("max_new_tokens", "max_length"):
        for value in (kwargs.get(name), getattr(config, name, None)):
            if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
                raise ConfigError(
                    f"kvpass.compile: generate() parameter '{name}' must be an int >= 1, got "
                    f"{type(value).__name__} {value!r}; pass a whole number of tokens"
                )
    if kwargs.get("max_new_tokens") is not None:
        return kwargs["max_new_tokens"]
    if getattr(config, "max_new_tokens", None) is not None:
        return config.max_new_tokens
    if kwargs.get("max_length") is not None:
        return kwargs["max_length"] - prompt
    if getattr(config, "max_length", None) is not None:
        return config.max_length
    return 20


def backward_hooked(model) -> str | None:
    """Where ``model`` has a module-level backward hook (``register_full_backward_hook`` or
    ``register_full_backward_pre_hook``), as ``"module 'name'"`` for the first such submodule, or ``"every module
    (...)"`` for a global one; None without. Dynamo breaks the graph at such a module."""
    import torch.nn.modules.module as mm

    if mm._global_backward_hooks or mm._global_backward_pre_hooks:
        return "every module (a global backward hook, torch.nn.modules.module.register_module_full_backward_hook)"
    for name, module in model.named_modules():
        if module._backward_hooks or module._backward_pre_hooks:
            return f"module '{name or type(module).__name__}'"
    return None


def own_code(forward):
    """``forward`` (a bound method) on a copy of its function with a code object of its own. Dynamo keeps a
    frame's graphs, and counts its recompile limit, per code object, and every model of a class shares its
    forward's (every transformers forward under one decorator shares the decorator's wrapper): without a copy,
    the graphs of models compiled earlier in the process count against this model's limit and their guards are
    checked at every call of this one."""
    fn = getattr(forward, "__func__", None)
    if not isinstance(fn, types.FunctionType):
        return forward  # not a plain bound method (a caller's wrapper): compiled as it is
    copy = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    copy.__kwdefaults__, copy.__qualname__ = fn.__kwdefaults__, fn.__qualname__
    copy.__dict__.update(fn.__dict__)  # functools.wraps' __wrapped__, so inspect.signature reads the forward's
    return types.MethodType(copy, forward.__self__)


def compile_options(be: Backend, mode: str | None) -> dict:
    """``torch.compile``'s ``options`` for a forward compiled with ``be`` in ``mode``: the mode's own settings
    (torch.compile takes a mode or options, not both) and ``be.spec_guards`` as the ``guard_filter_fn``, which
    drops Dynamo's guard on a tensor-parallel weight's spec where the compiled callable checks that spec itself
    (``kvpass.compiler.local_weights``)."""
    options = {"guard_filter_fn": be.spec_guards}
    if mode not in (None, "default"):
        from torch._inductor import list_mode_options

        try:
            options.update(list_mode_options(mode))
        except RuntimeError as e:  # torch's list of modes
            raise ConfigError(f"kvpass.compile: parameter 'mode' ({mode!r}): {e}; or pass mode='auto'") from None
    return options


def compile(
    model,
    policy="full",
    *,
    mode: str | None = "auto",
    compiler: str = "inductor",
    prefill_compiler: str | None = None,
    fullgraph: bool = False,
    direct_steps: bool | str = "auto",
    **params,
) -> Backend:
    """Compile ``model`` with the KV-cache ``policy`` and give its ``generate`` the fast path.

    Args:
        model: a HuggingFace decoder (``PreTrainedModel``), not compiled yet.
        policy: a policy name, a composition ``"a+b"`` or a ``Policy`` (as ``kvpass.backend``).
        mode: ``torch.compile``'s mode; ``"auto"`` (default) is ``"reduce-overhead"`` (CUDA-graph decode)
            on a GPU with ``compiler="inductor"``, else None.
        compiler: ``"inductor"`` (default), ``"aot_eager"`` or ``"eager"`` (as ``kvpass.backend``).
        prefill_compiler: what compiles the prefill graph when not ``compiler`` (as ``kvpass.backend``).
        fullgraph: passed to ``torch.compile``.
        direct_steps: within a ``generate`` call, once two decode steps have shown the same compiled graph, the
            same arguments and no Python side effects, call that graph directly, without Dynamo's frame (its
            guards and the bytecode around the graph: on a tensor-parallel model, most of a step's host time).
            ``"auto"`` (default): so, unless the call runs a logits processor or stopping criterion of the
            caller's own between steps; ``True``: so in any call, with a warning when they stop or never begin;
            ``False``: never. What it checks and what it does not is in ``kvpass.generate.direct_steps``;
            ``be.last_direct_steps`` says whether the last call used it and why not.
        **params: the policy's parameters, checked here (``ConfigError`` names a bad one), and
            ``share_layers`` (as ``kvpass.backend``).

    Returns the ``kvpass.Backend``: ``be.reports``, ``be.plans()``, ``be.state`` as usual. ``model.generate``
    becomes a ``FastGenerate`` (``model.generate.original`` is the model's own). Policies without a
    SlotCache decode (chunk fusion: ``kvpass.ChunkFusion``) are refused.
    """
    if not isinstance(model, torch.nn.Module) or not hasattr(model, "generate") or not hasattr(model, "config"):
        raise ConfigError(
            f"kvpass.compile: parameter 'model' must be a transformers model with generate() (e.g. "
            f"AutoModelForCausalLM.from_pretrained(...)), got {type(model).__name__} {model!r:.60}; load the model "
            f"first and pass it"
        )
    if hasattr(model.forward, "_torchdynamo_orig_callable") or isinstance(
        model, torch._dynamo.eval_frame.OptimizedModule
    ):
        raise ConfigError(
            "kvpass.compile: the model is already compiled; pass the uncompiled model "
            "(kvpass.compile compiles model.forward itself)"
        )
    hooked = backward_hooked(model)
    if hooked is not None:
        raise ConfigError(
            f"kvpass.compile: {hooked} of the model has a module-level backward hook, which Dynamo cannot "
            f"trace without compiled autograd: the forward would split into several graphs and the policy could not "
            f"run on them. transformers' tensor-parallel plan registers such hooks on some versions (5.17 for "
            f"'replicated_with_grad_allreduce' modules, e.g. Qwen3's q_norm / k_norm; 5.24 uses parameter hooks, "
            f"which Dynamo traces); remove the hook or use a transformers version without it"
        )
    if not (isinstance(direct_steps, bool) or direct_steps == "auto"):
        raise ConfigError(
            f"kvpass.compile: parameter 'direct_steps' must be True, False or 'auto', got {direct_steps!r}"
        )
    be = backend(policy, compiler=compiler, prefill_compiler=prefill_compiler, **params)
    be.direct_steps = direct_steps
    be.policy.check_model(model.config)
    needs = be.policy.needs
    if needs.slot_rule is None or not needs.slot_prefill:
        raise ConfigError(
            f"kvpass.compile: policy '{be.policy.name}' has no SlotCache decode of its own "
            f"(chunk fusion runs through kvpass.ChunkFusion); use kvpass.backend with torch.compile"
        )
    if mode == "auto":
        on_gpu = next(model.parameters()).device.type == "cuda"
        mode = "reduce-overhead" if on_gpu and compiler == "inductor" else None
    forward = own_code(model.forward)
    model.forward = compiled_forward(
        torch.compile(forward, backend=be, dynamic=True, fullgraph=fullgraph, options=compile_options(be, mode)),
        getattr(forward, "__code__", None),  # a caller's callable object (not own_code's copy) may have none
        # kvzip: the repeat passes a prefill waits for run as its forward returns, before any decode step
        functools.partial(reconstruct.finish, be) if needs.reconstructs else None,
        vocab_size(model),
    )
    model.generate = FastGenerate(model, be, model.generate)
    return be


def recompile_floor():
    """Dynamo's recompile limit at least ``RECOMPILE_LIMIT`` while it lasts (the caller's own where higher: then
    nothing is patched, so a forward inside ``generate`` adds only this check)."""
    if torch._dynamo.config.recompile_limit >= RECOMPILE_LIMIT:
        return contextlib.nullcontext()
    return torch._dynamo.config.patch(recompile_limit=RECOMPILE_LIMIT)


def compiled_forward(forward, code, after=None, vocab: int | None = None):
    """The compiled ``forward`` (Dynamo's frames of ``code``, or None) as ``model.forward`` calls it, then
    ``after()`` (a reconstructing policy's ``reconstruct.finish``) when given:

    * a call of several tokens (a prompt) with ``input_ids`` outside the vocabulary of ``vocab`` ids is refused by
      name (``token_ids.check_values``) before Dynamo runs it: the compiled embedding's bounds check ends the
      process on a CPU, and is a device assert on a GPU. One-token calls (decode steps) are checked on a CPU only:
      on an accelerator a check reads the ids back to the host, a sync each step;

    * under ``recompile_floor`` (as ``generate`` is): a plain ``model(ids)`` after a few ``generate`` calls of other
      shapes finds the graphs they compiled counted against its limit too;
    * after a call that raised, with Dynamo's default handling of the forward's frame: where Dynamo cannot trace
      a call (a fake-tensor failure on an argument the model cannot run), it marks the frame to be skipped for good
      and runs the forward uncompiled, where the call fails; every later call would compile the model's layers
      piecemeal, with the policy on some of them and other tokens. The next call runs the forward's graphs again
      (the backend counts only compiles that gave a graph against the recompile limit); an argument that fails
      still fails, each time. A call Dynamo cannot trace whose uncompiled run succeeds still leaves the frame
      skipped (kvpass then warns of graphs without attention sites)."""

    @functools.wraps(forward)
    def call(*args, **kwargs):
        ids = kwargs.get("input_ids", args[0] if args else None)
        if (
            vocab is not None
            and isinstance(ids, torch.Tensor)
            and ids.dim() == 2
            and (ids.shape[1] > 1 or ids.device.type == "cpu")
        ):
            check_values(ids, "kvpass.compile: model.forward()", "input_ids", vocab)
        try:
            with recompile_floor():
                out = forward(*args, **kwargs)
                if after is not None:
                    after()
                return out
        except BaseException:
            if code is not None:
                unskip(code)
            raise

    return call


def unskip(code) -> None:
    """Dynamo's default handling for frames of ``code`` (compile, or run a cached graph), whatever Dynamo had set:
    a skip after a failed trace, or running cached graphs only past the recompile limit (set again at the next
    compile that reaches it)."""
    from torch._C._dynamo.eval_frame import set_code_exec_strategy
    from torch._dynamo.types import FrameAction, FrameExecStrategy

    set_code_exec_strategy(code, FrameExecStrategy(FrameAction.DEFAULT, FrameAction.DEFAULT))
