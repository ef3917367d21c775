"""The decoding loop ``kvpass.compile`` gives ``generate``: HF's sampling loop without its per-step stall.

HF's loop (``GenerationMixin._sample``) asks the device after every token whether every row has finished
(``unfinished.max() == 0``), so the host waits for each step to end before it prepares the next. On a
decode step replayed as a CUDA graph the host's work per step (the replay's launch, HF's own Python,
Dynamo's guards) is then paid on top of the device's instead of beside it: HF's loop 12.56 ms a step against
the queued step's 8.74 ms at 32 layers and 33k on an H100 (``bench/results/fastpath_decode_loop_2026-11-27``).

``decode`` reads that flag one step late: it is copied to pinned host memory without blocking, and read
after the next step has been queued. When it says that every row had finished, the step queued
meanwhile is undone: its token is dropped (the cache is kvpass's own, reset by the next call). A step
that reaches ``max_length`` is known on the host and stops at once. The tokens are HF's: the same
logits processors and stopping criteria, the same pad rule for finished rows, and the same random draws
in the same order.

The loop's own device work is 9 operations a step: the tokens go into one buffer (HF's loop concatenates a
new sequence tensor each step), the max-length rule is the host's, the finished flags reuse two pinned
buffers. transformers builds a 4-D attention mask for every step of a compileable cache (about 20 operations);
a SlotCache decode graph reads the slots by position and never reads it, so while every graph the backend
compiled other than a prefill is such a whole decode step (``Backend.decode_ignores_mask``), each step is
given the mask built for the first one (``forward``), guarded so that it never reaches code that reads it.

It returns token ids. A call that wants more (``return_dict_in_generate``) runs HF's own loop. ``generate``
hands a ``custom_generate`` callable no streamer and no ``synced_gpus`` (transformers 5.14 .. 5.24), so
``FastGenerate`` does not pass this loop to a call that has them (``usable``). The flag is read before the
queued step's logits are processed: the undone step runs no logits processor, no stopping criterion and no random
draw, so a caller's processor or criterion is called as often as in HF's loop, and a next call draws what it would
after HF's loop.

``run_config`` is the one place that turns a caller's generation arguments into the configuration a call runs
(``FastGenerate`` and ``kvpass.RequestQueue`` read it): transformers' own merge of the caller's keywords, the
caller's ``GenerationConfig``, the model's ``generation_config`` and transformers' global defaults (``top_k=50``
among them).
"""

from __future__ import annotations

import contextlib

import torch
from transformers.generation.stopping_criteria import MaxLengthCriteria

from kvpass.cache.slots import MaskReused, reused_mask
from kvpass.errors import ConfigError
from kvpass.generate import reconstruct
from kvpass.generate.direct_steps import DirectSteps, callers_code

# GenerationMixin methods this loop calls, present on transformers 5.14 .. 5.24
_USES = ("_prefill", "_update_model_kwargs_for_generation", "prepare_inputs_for_generation", "_sample")


class Late:
    """Pinned host memory that a device tensor is copied to without blocking (``put``) and read later, waiting
    for that copy (``read``: its values as Python numbers; a 0-d tensor gives one number). Its buffer and event
    are allocated once: ``Late.ring(2, like)`` gives a decoding loop two to alternate between, instead of
    allocating pinned memory and an event every step."""

    def __init__(self, like: torch.Tensor) -> None:
        pinned = like.device.type == "cuda"
        self.host = torch.empty(like.shape, dtype=like.dtype, pin_memory=pinned)
        self.ready = torch.cuda.Event() if pinned else None

    @classmethod
    def ring(cls, n: int, like: torch.Tensor) -> list["Late"]:
        return [cls(like) for _ in range(n)]

    def put(self, t: torch.Tensor) -> "Late":
        self.host.copy_(t, non_blocking=self.ready is not None)
        if self.ready is not None:  # on the tensor's device's stream, whichever device is current
            self.ready.record(torch.cuda.current_stream(t.device))
        return self

    def read(self):
        if self.ready is not None:
            self.ready.synchronize()
        return self.host.tolist()


def usable(model, kwargs: dict) -> bool:
    """Whether a ``generate`` call with these keyword arguments may run ``decode``: no streamer, no
    ``synced_gpus`` (which ``generate`` would not pass on), no decoding method of the caller's own, and a
    model with the generation methods ``decode`` calls."""
    try:
        from transformers.integrations import is_deepspeed_zero3_enabled

        zero3 = is_deepspeed_zero3_enabled()
    except ImportError:  # pragma: no cover
        zero3 = False
    return (
        kwargs.get("streamer") is None
        and not kwargs.get("synced_gpus")
        and not zero3
        and kwargs.get("custom_generate") is None
        and all(hasattr(model, name) for name in _USES)
    )


def run_config(model, kwargs: dict, where: str = "kvpass.compile: generate()"):
    """The generation configuration a ``generate(**kwargs)`` call of ``model`` runs, and the keywords that are not
    generation options (the model's): transformers' own merge (``_prepare_generation_config``) of the caller's
    keywords over the caller's ``generation_config`` (a copy), over ``model.generation_config``, over transformers'
    global defaults (``top_k=50``, ``max_length=20``, ...), as ``generate`` merges them. Where no ``max_length``
    was set (by a keyword or either generation config) and no ``max_new_tokens``, transformers generates its
    default length as new tokens: ``max_new_tokens`` is set to it, so that ``max_new_tokens`` set means new
    tokens and unset means ``max_length`` is the total, prompt included. ``where``: the caller, for an error."""
    options = dict(kwargs)
    given = options.pop("generation_config", None)
    new = options["max_new_tokens"] if "max_new_tokens" in options else getattr(given, "max_new_tokens", None)
    if isinstance(new, (int, float)) and not isinstance(new, bool) and new < 1:  # transformers' bare ValueError
        raise ConfigError(
            f"{where} parameter 'max_new_tokens' must be an int >= 1, got {new!r}; pass max_new_tokens >= 1"
        )
    length_unset = (
        options.get("max_length") is None
        and getattr(given, "max_length", None) is None
        and getattr(model.generation_config, "max_length", None) is None
    )
    config, model_kwargs = model._prepare_generation_config(given, **options)
    if length_unset and config.max_new_tokens is None:
        config.max_new_tokens = config.max_length
    return config, model_kwargs


@torch.no_grad()
def decode(model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
    """``generate``'s decoding method for greedy search and sampling (passed as ``custom_generate``);
    the arguments are those ``generate`` gives ``GenerationMixin._sample``, less the streamer and
    ``synced_gpus`` (see ``usable``). A policy that scores the prompt with repeat passes gets them first
    (``kvpass.generate.reconstruct``)."""
    fast = model.generate  # kvpass.compile's FastGenerate
    be = getattr(fast, "backend", None)
    with reconstruct.repeat_passes(
        model, be, input_ids, model_kwargs.get("attention_mask"), getattr(fast, "keeps_logits", True)
    ):
        return _decode(be, model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs)


def _decode(be, model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs):
    """``decode``'s loop; ``be`` is kvpass.compile's backend (None for a model it did not compile)."""
    # the maximum length is the host's rule (HF's MaxLengthCriteria answers every row alike from the length):
    # it is checked on the host, the other criteria on the device
    limits = [c.max_length for c in stopping_criteria if isinstance(c, MaxLengthCriteria)]
    on_device = [c for c in stopping_criteria if not isinstance(c, MaxLengthCriteria)]
    if generation_config.return_dict_in_generate or not limits:
        return type(model)._sample(
            model, input_ids, logits_processor, stopping_criteria, generation_config, **model_kwargs
        )
    cfg = generation_config
    pad = cfg._pad_token_tensor
    if pad is not None:
        pad = pad.to(input_ids.device)
    has_eos = any(hasattr(c, "eos_token_id") for c in stopping_criteria)
    rows, length = input_ids.shape
    max_length = min(limits)
    # the sequence so far is a view of one buffer that each step writes a column of (HF's loop concatenates a
    # new tensor every step)
    ids = input_ids.new_empty(rows, max(max_length, length + 1))
    ids[:, :length] = input_ids
    finished = torch.zeros(rows, dtype=torch.bool, device=input_ids.device)
    flags = Late.ring(2, finished.all()) if on_device else None
    previous = None  # the step before's "every row finished", read one step late
    cache = model_kwargs.get("cache", model_kwargs.get("past_key_values"))
    layers = len(getattr(cache, "layers", ()))
    mask = None  # the attention mask of the step before, passed again while no decode graph reads it
    reuse = be is not None
    optimize = getattr(model, "_optimize_model_for_decode", contextlib.nullcontext)
    direct = None
    if reuse and be.direct_steps and cache is not None:
        auto = be.direct_steps == "auto"
        direct = DirectSteps(
            model,
            cache,
            be,
            asked=not auto,
            refused=callers_code(logits_processor, stopping_criteria) if auto else None,
            forward=getattr(model.generate, "compiled_forward", None),
        )
    if reuse:
        be.last_direct_steps = direct  # None: this call took none (direct_steps=False)
    outputs = model._prefill(input_ids, cfg, model_kwargs)
    with optimize(), contextlib.closing(direct) if direct is not None else contextlib.nullcontext():
        while True:
            # every row had finished before the step queued last: HF's loop stopped there, so it is undone before
            # its logits reach a processor, a criterion or a random draw (the host waits for the step before only)
            if previous is not None and previous.read():
                break
            model_kwargs = model._update_model_kwargs_for_generation(
                outputs, model_kwargs, is_encoder_decoder=model.config.is_encoder_decoder
            )
            logits = outputs.logits[:, -1].to(copy=True, dtype=torch.float32, device=input_ids.device)
            del outputs  # a prefill's logits can be large
            scores = logits_processor(input_ids, logits)
            if cfg.do_sample:
                tokens = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            else:
                tokens = torch.argmax(scores, dim=-1)
            if has_eos:  # a row that finished before this step gets padding (HF's rule)
                tokens = torch.where(finished, pad, tokens)
            ids[:, length] = tokens
            length += 1
            input_ids = ids[:, :length]
            for criterion in on_device:  # scores None, as HF's loop passes them without return_dict_in_generate
                torch.logical_or(finished, criterion(input_ids, None), out=finished)
            if length >= max_length:
                break
            if flags is not None:
                previous = flags[length % 2].put(finished.all())
            outputs, mask, eager = forward(model, input_ids, model_kwargs, mask, direct)
            reuse = reuse and not eager  # a forward run outside the compiled graph: not for this call again
            if not reuse or not be.decode_ignores_mask(layers):
                mask = None
                if direct is not None:  # direct steps take the first step's mask: none this call, and why
                    direct.stop(no_reused_mask(reuse))
    return ids[:, :length].contiguous()


_RECOMPILE = "Detected recompile when torch.compile stance is 'fail_on_recompile'"


def no_reused_mask(reuse: bool) -> str:
    """Why the decode steps of this call build their attention mask anew (so none is a direct step)."""
    if not reuse:
        return "a step ran outside the compiled graph"
    return (
        "a decode graph this backend compiled reads the attention mask or is not a whole decode step (a "
        "RequestQueue's, a forward of your own, a graph break), so each step builds its mask anew through Dynamo"
    )


def forward(model, input_ids, model_kwargs: dict, mask=None, direct: DirectSteps | None = None):
    """One decode step: HF's input preparation, then the compiled forward; returns the outputs, the attention
    mask passed and whether a reused mask was refused because the forward ran outside a compiled graph.

    With ``mask`` (the one transformers built for an earlier step, passed while no graph the backend compiled
    other than a prefill reads it: a SlotCache decode reads the slots by position),
    transformers does not build its 4-D mask again (the model's ``create_masks_for_generate`` hands it back,
    for this call only), and the step runs under ``set_stance("fail_on_recompile")`` and ``reused_mask``: a step
    that would compile a graph (which might read the mask) or run a SlotCache update outside a compiled graph (the
    model's own attention reads the mask) is refused before it writes anything and rerun with the mask built
    anew."""
    step, eager = (1 if model_kwargs.get("use_cache") else None), False
    if mask is not None:
        own = model.__dict__.get("create_masks_for_generate")
        model.create_masks_for_generate = lambda *args, **kwargs: mask
        try:
            inputs = model.prepare_inputs_for_generation(input_ids, next_sequence_length=step, **model_kwargs)
        finally:
            if own is None:
                del model.create_masks_for_generate
            else:
                model.create_masks_for_generate = own
        if direct is not None:  # the decode graph called without Dynamo's frame, once two steps agreed
            with reused_mask():
                outputs = direct.step(inputs)
            if outputs is not None:
                return outputs, mask, False
        try:
            with (
                torch.compiler.set_stance("fail_on_recompile"),
                reused_mask(),
                direct.watch() if direct is not None else contextlib.nullcontext() as calls,
            ):
                outputs = model(**inputs, return_dict=True)
            if direct is not None:
                direct.saw(inputs, outputs, calls)
            return outputs, mask, False
        except MaskReused:
            eager = True
        except RuntimeError as e:
            if _RECOMPILE not in str(e):
                raise
    inputs = model.prepare_inputs_for_generation(input_ids, next_sequence_length=step, **model_kwargs)
    return model(**inputs, return_dict=True), inputs.get("attention_mask"), eager
