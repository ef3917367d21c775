"""``kvpass.RequestQueue``: many prompts of many lengths on one GPU, admitted one at a time into a decoding batch.

    be = kvpass.compile(model, "snapkv", budget=2048)
    outs = model.generate([ids_a, ids_b, ids_c], max_new_tokens=256, max_batch=2)   # a list in, a list out

    queue = kvpass.RequestQueue(model, max_batch=32)
    for ids in prompts:
        queue.add(ids, max_new_tokens=256)
    outs = queue.run()                       # a progress bar; queue.stats says what it cost

The batch is a ``SlotCache`` of ``max_batch`` rows. Each request is prefilled alone, on a one-row staging
cache of the same capacities (so the prefill's peak is one request's, whatever the batch), and its row is
copied into a free row of the batch (``SlotCache.admit``). Every step decodes all the rows together (one
compiled decode graph, a CUDA graph under ``kvpass.compile``'s default mode), each at its own position
(``SlotCache.row_positions``). A finished row is refilled by the next request while the others go on; a row
with no request left decodes a copy of a live row (its tokens are dropped), so the batch shape and the
recorded graph never change and every row always holds a valid sequence.

The host learns each step's tokens one step late: they are copied to pinned memory without blocking and read
after the next step is queued (as ``kvpass.generate.decode_loop``), so the device does not wait for the host
between steps. A row that finished (its end-of-sequence token or its ``max_new_tokens``) has then run one step
more, whose token is dropped; the room for it is in the cache (a row stops at ``prompt + max_new_tokens``
entries at most).

Decoding: greedy, or sampling with ``temperature``, ``top_k`` and ``top_p``. The options are merged as
``generate`` merges them (``kvpass.generate.decode_loop.run_config``: the caller's, over the generation config
given, over the model's, over transformers' defaults such as ``top_k=50``), and the tokens are drawn through the
logits processors transformers builds from them. Any other option that changes the tokens (repetition penalty,
beams, ...) is refused.

Runs. ``run`` takes the requests waiting when it starts and returns their outputs, nothing else; a request added
meanwhile (from another thread) waits for the next ``run``. A ``run`` and ``generate`` calls of the model go one at
a time: they share the caches ``kvpass.compile`` keeps. A request whose prefill fails, or the requests of a decode
step that fails, end the run with ``RequestFailed``: it names them, they are marked ``stopped="failed"`` and not run
again (add one again to retry it), its ``results`` holds the outputs of the requests that finished, and the others
wait, their tokens dropped, for the next ``run``, which decodes them from their prompts.
"""

from __future__ import annotations

import dataclasses
import threading
import time

import torch
from torch import Tensor

from kvpass.errors import ConfigError
from kvpass.generate import reconstruct
from kvpass.generate.decode_loop import Late, run_config
from kvpass.generate.token_ids import token_ids, vocab_size

# generation options this queue runs; those below at a value other than a neutral one, and any other, are refused
_RUNS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id")
_CHANGES_TOKENS = {  # option -> its values that change nothing (None and empty ones too)
    "num_beams": (1,),
    "num_return_sequences": (1,),
    "repetition_penalty": (1.0,),
    "no_repeat_ngram_size": (0,),
    "bad_words_ids": (),
    "min_length": (0,),
    "min_new_tokens": (0,),
    "encoder_repetition_penalty": (1.0,),
    "typical_p": (1.0,),
    "epsilon_cutoff": (0.0,),
    "eta_cutoff": (0.0,),
    "min_p": (0.0,),
    "sequence_bias": (),
    "suppress_tokens": (),
    "begin_suppress_tokens": (),
    "forced_bos_token_id": (),
    "forced_eos_token_id": (),
    "guidance_scale": (1.0,),
    "stop_strings": (),
    "watermarking_config": (),
    "renormalize_logits": (False,),
    "top_h": (),
    "remove_invalid_values": (False,),
    "exponential_decay_length_penalty": (),
    "max_time": (),
}
_DONE = ("eos", "length")  # a request's ``stopped`` once it finished


@dataclasses.dataclass
class Request:
    """One prompt in the queue: its ``index`` in ``RequestQueue.requests``, ``ids`` (1-D), the tokens wanted, and
    once run the tokens made and why it stopped (``"eos"``, ``"length"``, or ``"failed"``: see ``RequestFailed``)."""

    index: int
    ids: Tensor
    max_new_tokens: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    stopped: str | None = None

    def output(self) -> Tensor:
        """The prompt followed by the new tokens (1-D, on the prompt's device)."""
        return torch.cat([self.ids, torch.tensor(self.tokens, dtype=self.ids.dtype, device=self.ids.device)])


class RequestFailed(RuntimeError):
    """``RequestQueue.run`` stopped: a request's prefill, or a decode step of the requests in the batch, raised
    (the error raised is ``__cause__``).

    ``failed``: the requests named, marked ``stopped="failed"`` (not run again). ``requests``: the run's requests in
    the order added; ``results``: each one's output (prompt + new tokens) where it finished, else None. The
    requests that did not finish and did not fail wait for the next ``run``."""

    def __init__(self, message: str, requests: list[Request], failed: list[Request]) -> None:
        super().__init__(message)
        self.requests, self.failed = requests, failed
        self.results = [r.output() if r.stopped in _DONE else None for r in requests]


class _Sampler:
    """Next tokens ``[B]`` from last-position logits ``[B, V]``: argmax, or a draw, after the logits processors
    transformers builds from the run's configuration (as ``generate``); refuses a configuration that builds one
    that reads more than the scores (the rows' earlier tokens, or their lengths)."""

    def __init__(self, model, config, device) -> None:
        from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        self.sample = bool(config.do_sample)
        self.processors = model._get_logits_processor(config, input_ids_seq_length=1, device=device)
        other = [
            type(p).__name__
            for p in self.processors
            if not isinstance(p, (TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper))
        ]
        if other:
            raise ConfigError(
                f"kvpass.RequestQueue: the generation configuration builds the logits processors "
                f"{other}, which the queue does not run (it runs temperature, top_k and top_p); "
                f"leave the options that build them at their defaults or call generate() one prompt "
                f"batch at a time"
            )

    def __call__(self, logits: Tensor) -> Tensor:
        scores = self.processors(None, logits.float())  # the processors kept read the scores alone
        if not self.sample:
            return scores.argmax(-1)
        return torch.multinomial(torch.softmax(scores, -1), 1).squeeze(1)


class RequestQueue:
    """Prompts decoded together in a batch of ``max_batch`` rows, each request prefilled alone and admitted
    into a free row (see the module docstring).

    Args:
        model: a model compiled with ``kvpass.compile`` (its ``generate`` is kvpass's).
        max_batch: rows decoded together (1 .. 4096).
        max_length: the cache's capacity in tokens per row, exactly (``prompt + max_new_tokens`` of the longest
            request at most), with room for the queue's ``max_new_tokens`` new tokens (or a request's, if more):
            a policy whose capacity splits prompt and new tokens (raas) gets the same caches, and the same
            compiled graphs, for any requests queued; default: sized at ``run`` from the requests queued, in
            ``kvpass.compile``'s buckets (up to a quarter more).
        **generation: ``max_new_tokens`` (the default of ``add``), ``do_sample``, ``temperature``, ``top_k``,
            ``top_p``, ``eos_token_id`` and ``generation_config``, merged as ``generate`` merges them (unset ones
            come from ``generation_config``, then ``model.generation_config``, then transformers' defaults).

    ``requests``: every request added, in order (``Request.index`` is its place); ``waiting``: those the next
    ``run`` takes. ``stats`` (after ``run``):
    requests, prompt and new tokens, steps, seconds in prefill and in all, and the tokens per second (new tokens
    over the whole run; ``decode_tokens_per_s`` over the time outside prefills).
    """

    def __init__(self, model, max_batch: int = 8, max_length: int | None = None, **generation) -> None:
        fast = getattr(model, "generate", None)
        if not hasattr(fast, "cache_for"):
            raise ConfigError(
                "kvpass.RequestQueue: parameter 'model' must be compiled with kvpass.compile first "
                "(its generate allocates the SlotCaches the queue decodes in)"
            )
        if not isinstance(max_batch, int) or not 1 <= max_batch <= 4096:
            raise ConfigError(
                f"kvpass.RequestQueue: parameter 'max_batch' must be an int in 1..4096, got {max_batch!r}"
            )
        if max_length is not None and (not isinstance(max_length, int) or max_length < 2):
            raise ConfigError(f"kvpass.RequestQueue: parameter 'max_length' must be an int >= 2, got {max_length!r}")
        self.model, self.fast, self.max_batch, self.max_length = model, fast, max_batch, max_length
        self.device = next(model.parameters()).device
        self.one_logit = fast.keeps_logits  # the forward takes logits_to_keep: a prefill returns one row of logits
        self.vocab_size = vocab_size(model)
        self._configure(generation)
        self.requests: list[Request] = []
        self.waiting: list[Request] = []  # added and not yet taken by a run, in order
        self._lock = threading.Lock()  # guards requests and waiting (add may run while run decodes)
        self.stats: dict = {}

    @classmethod
    def like_generate(cls, model, max_batch: int = 8, **generation) -> "RequestQueue":
        """The queue ``generate`` over a list of prompts builds: ``generation`` means what ``generate``'s
        keywords mean, ``max_length`` among them (prompt plus new tokens, per prompt); the caches are sized at
        ``run``."""
        total = generation.pop("max_length", None)
        queue = cls(model, max_batch=max_batch, **generation)
        if total is not None:
            queue._configure({**generation, "max_length": total})
        return queue

    def _configure(self, generation: dict) -> None:
        self.config = _generation_config(self.model, generation)
        eos = self.config.eos_token_id
        self.eos = set([] if eos is None else [eos] if isinstance(eos, int) else eos)
        self.sampler = _Sampler(self.model, self.config, self.device)

    def add(self, ids, max_new_tokens: int | None = None) -> int:
        """Queue a prompt (a 1-D tensor or list of integer token ids, or a ``[1, L]`` tensor) for the next
        ``run``; returns its index in ``requests``, by which errors name it (for a queue run once, its place in
        ``run``'s result). ``max_new_tokens``: default the queue's (else ``max_length`` minus the prompt, where the
        generation config sets a ``max_length`` and no ``max_new_tokens``)."""
        ids = token_ids(ids, "kvpass.RequestQueue.add", vocab_size=self.vocab_size)
        new = max_new_tokens
        if new is None and self.config.max_new_tokens is None:  # the generation config's max_length: the total
            total = self.config.max_length
            if not isinstance(total, int) or isinstance(total, bool):
                raise ConfigError(
                    f"kvpass.RequestQueue: generation parameter 'max_length' must be an int (prompt "
                    f"plus new tokens), got {total!r}; pass max_new_tokens or an int max_length"
                )
            new = total - ids.numel()
            if new < 1:
                raise ConfigError(
                    f"kvpass.RequestQueue.add: max_length={self.config.max_length} (prompt plus new "
                    f"tokens) leaves no new token after a {ids.numel()}-token prompt; pass "
                    f"max_new_tokens or a larger max_length"
                )
        elif new is None:
            new = self.config.max_new_tokens
        if not isinstance(new, int) or isinstance(new, bool) or new < 1:
            raise ConfigError(f"kvpass.RequestQueue.add: parameter 'max_new_tokens' must be an int >= 1, got {new!r}")
        if self.max_length is not None and ids.numel() + new > self.max_length:
            raise ConfigError(
                f"kvpass.RequestQueue.add: a {ids.numel()}-token prompt with max_new_tokens={new} "
                f"exceeds max_length={self.max_length}"
            )
        with self._lock:
            req = Request(len(self.requests), ids.to(self.device), new)
            self.requests.append(req)
            self.waiting.append(req)
        return req.index

    @torch.no_grad()
    def run(self, progress: bool = True) -> list[Tensor]:
        """Decode the requests waiting when it starts; returns their outputs (prompt + new tokens, 1-D) in the
        order added, and only theirs: a request added while it runs (from another thread) waits for the next
        ``run``. ``progress`` shows a bar (tqdm) of the requests finished.

        Raises ``RequestFailed`` where a request's prefill or a decode step fails: it names the requests, carries
        the outputs of those that finished (``results``), marks the requests named ``stopped="failed"``, and the
        others wait for the next ``run``, which decodes them from their prompts. Runs and the model's ``generate``
        calls go one at a time (they share the kept caches)."""
        with self.fast.lock:
            with self._lock:
                todo, self.waiting = self.waiting, []
            busy: list = []  # what runs: "prefill" or "decode", then its requests
            try:
                self._run(todo, progress, busy)
            except BaseException as e:
                failed = self._requeue(todo, busy[1:] if isinstance(e, Exception) else [])  # an interrupt: none
                if not failed:
                    raise
                raise RequestFailed(_failure(e, busy[0], failed, len(self.waiting)), todo, failed) from e
        return [r.output() for r in todo]

    def _requeue(self, todo: list[Request], named: list[Request]) -> list[Request]:
        """After a run of ``todo`` stopped: the requests ``named`` that had not finished are marked failed (and
        returned); the others that had not finished wait again, their tokens dropped."""
        failed = [r for r in named if r.stopped is None]
        for req in failed:
            req.stopped = "failed"
        again = [r for r in todo if r.stopped is None]
        for req in again:
            req.tokens = []
        with self._lock:
            self.waiting = sorted(again + self.waiting, key=lambda r: r.index)
        return failed

    def _run(self, todo: list[Request], progress: bool, busy: list) -> None:
        """Decode ``todo``; ``busy`` holds, while each prefill or decode step runs, its kind and requests."""
        if not todo:
            return
        length = self.max_length or max(r.ids.numel() + r.max_new_tokens for r in todo)
        new = max(r.max_new_tokens for r in todo)
        if self.max_length is not None and self.config.max_new_tokens:  # room for the queue's max_new_tokens too,
            longest = max(r.ids.numel() for r in todo)  # where the longest prompt leaves it: the same caches for a
            new = max(new, min(self.config.max_new_tokens, length - longest))  # warm-up and the real requests
        batch = self.fast.cache_for(self.max_batch, length - new, new, exact=self.max_length is not None)
        staging = self.fast.cache_for(1, length - new, new, like=batch)
        bar = _bar(len(todo), progress)
        t0, prefill_s, steps, made = time.perf_counter(), 0.0, 0, 0
        waiting = list(reversed(todo))
        rows: list[Request | None] = [None] * self.max_batch
        since = [0] * self.max_batch  # the step from which a row's tokens are its request's
        parked: list[tuple | None] = [None] * self.max_batch  # an idle row's (source row, its request)
        tokens = torch.zeros(self.max_batch, dtype=torch.long, device=self.device)
        sample, eos = self.sampler, self.eos
        pending: Late | None = None
        ring = Late.ring(2, tokens)  # the step's tokens on their way to the host: two buffers, allocated once
        while True:
            for row in range(self.max_batch):  # free rows take the next requests, each prefilled alone
                while rows[row] is None and waiting:
                    req = waiting.pop()
                    busy[:] = ["prefill", req]
                    t = time.perf_counter()
                    staging.reset()
                    with reconstruct.repeat_passes(self.model, self.fast.backend, req.ids[None], None, self.one_logit):
                        first = sample(self._forward(req.ids[None], staging).logits[:, -1])
                    batch.admit(row, staging)
                    tokens[row] = first[0]
                    req.tokens.append(int(first[0]))  # waits for the prefill
                    prefill_s += time.perf_counter() - t
                    made += 1
                    rows[row], since[row], parked[row] = req, steps, None
                    if self._finished(req, eos):
                        rows[row] = None
                        bar.update(1)
            live = [i for i, r in enumerate(rows) if r is not None]
            if not live:
                break
            busy[:] = ["decode", *(rows[i] for i in live)]
            for row in range(self.max_batch):  # an idle row decodes a copy of a live row (copied once)
                if rows[row] is None and (parked[row] is None or rows[parked[row][0]] is not parked[row][1]):
                    batch.admit(row, batch, source=live[0])
                    tokens[row] = tokens[live[0]]
                    parked[row] = (live[0], rows[live[0]])
            torch.compiler.cudagraph_mark_step_begin()
            tokens = sample(self._forward(tokens[:, None], batch, batch.row_positions()).logits[:, -1])
            steps += 1
            late, pending = pending, ring[steps % 2].put(tokens)  # the step before's buffer is read below
            if late is None:
                continue
            made += self._collect(late.read(), steps - 1, rows, since, eos, bar)
        if pending is not None:
            made += self._collect(pending.read(), steps, rows, since, eos, bar)
        for row, copied in enumerate(parked):  # an idle row's copy is no request's: emptied, so be.state counts
            if copied is not None:  # the rows that hold requests
                batch.reset_row(row)
        busy.clear()
        bar.close()
        wall = time.perf_counter() - t0
        self.stats = {
            "requests": len(todo),
            "max_batch": self.max_batch,
            "max_length": batch.max_length,
            "prompt_tokens": sum(r.ids.numel() for r in todo),
            "new_tokens": made,
            "steps": steps,
            "prefill_s": round(prefill_s, 3),
            "wall_s": round(wall, 3),
            "tokens_per_s": round(made / wall, 1),
            "decode_tokens_per_s": round((made - len(todo)) / max(wall - prefill_s, 1e-9), 1),
        }

    def _forward(self, ids: Tensor, cache, positions: Tensor | None = None):
        kw = {self.fast.cache_kwarg: cache}
        if self.one_logit:
            kw["logits_to_keep"] = 1
        if positions is not None:
            kw["position_ids"] = positions
        return self.model(input_ids=ids, use_cache=True, **kw)

    @staticmethod
    def _finished(req: Request, eos: set[int]) -> bool:
        if req.tokens[-1] in eos:
            req.stopped = "eos"
        elif len(req.tokens) >= req.max_new_tokens:
            req.stopped = "length"
        return req.stopped is not None

    def _collect(self, host: list[int], step: int, rows, since, eos, bar) -> int:
        """Step ``step``'s tokens (read late) into their requests; frees the rows that finished."""
        made = 0
        for row, req in enumerate(rows):
            if req is None or since[row] >= step:
                continue  # an idle row's copy, or a request admitted after this step was queued
            req.tokens.append(host[row])
            made += 1
            if self._finished(req, eos):
                rows[row] = None
                bar.update(1)
        return made

    def __len__(self) -> int:
        return len(self.requests)

    def __repr__(self) -> str:
        done = sum(r.stopped is not None for r in self.requests)
        return (
            f"kvpass.RequestQueue(policy={self.fast.backend.policy.name!r}, max_batch={self.max_batch}, "
            f"requests={len(self.requests)}, done={done})"
        )


def _generation_config(model, given: dict):
    """The run's configuration from the options ``given`` (``run_config``: merged as ``generate`` merges them);
    refuses an option this queue does not run, given or from a generation config."""
    # pad_token_id: each request's tokens end at its own end, so the queue pads nothing
    unknown = sorted(
        set(given) - {"generation_config", "max_length", "pad_token_id"} - set(_RUNS) - set(_CHANGES_TOKENS)
    )
    if unknown:
        raise ConfigError(
            f"kvpass.RequestQueue: generation option(s) {unknown} are not run by the queue (it runs "
            f"{list(_RUNS)}); call generate() one prompt batch at a time for them"
        )
    config, _ = run_config(model, given, "kvpass.RequestQueue:")
    changed = [
        k for k, neutral in _CHANGES_TOKENS.items() if getattr(config, k, None) not in (None, [], {}, "", *neutral)
    ]
    if changed:
        raise ConfigError(
            f"kvpass.RequestQueue: {changed} (given, or from the model's generation config) change "
            f"the tokens in a way the queue does not run (it runs greedy search and sampling with "
            f"temperature, top_k and top_p); leave them at their defaults or call generate() one "
            f"prompt batch at a time"
        )
    return config


def _failure(error: BaseException, phase: str, failed: list[Request], waiting: int) -> str:
    """``RequestFailed``'s message: the requests ``failed`` (``phase``: their prefill or a decode step), the
    error, and what the queue kept."""
    named = ", ".join(
        f"request {r.index} (a {r.ids.numel()}-token prompt, max_new_tokens={r.max_new_tokens})" for r in failed
    )
    where = "its prefill" if phase == "prefill" else "a decode step of the batch"
    return (
        f"kvpass.RequestQueue.run: {named} failed in {where}: {type(error).__name__}: {error}. "
        f"{'It is' if len(failed) == 1 else 'They are'} marked stopped='failed' and not run again (add "
        f"{'it' if len(failed) == 1 else 'them'} again to retry, after fixing the cause); this error's results "
        f"hold the outputs of the requests that finished, and {waiting} request(s) wait for the next run()"
    )


def _bar(total: int, show: bool):
    from tqdm.auto import tqdm  # a dependency of transformers

    return tqdm(total=total, unit="req", desc="kvpass", disable=not show)
