"""`Engine`: requests in, scheduled and executed steps, each request's new tokens out.

The step loop (`step`), asynchronous by default: each call schedules, lays out and dispatches the next step, then
reads the tokens of the step dispatched before it, so the device has the next step queued while the host reads,
appends and checks the last one's tokens (stop conditions apply one step late; a sequence that stopped gets one
extra token computed, which is dropped). Requests that need each token on the host before the next step is laid out
(a grammar's bitmask, bad words of several tokens, beam search) make the loop synchronous while they run; where
the sampler runs apart from the step (a GPU), a bitmask is computed after its step is dispatched instead, once the
previous step's tokens are in (*late bitmasks*), and only beam search makes the loop synchronous.

The engine hands out token ids (`EngineOutput`), not text: detokenization, stop strings and output kinds are the
output processor's (`jaxpaged.engine.output_processor`), which runs beside the loop (the server's reader tasks) or
after it (`LLM.generate` decodes once at the end).

It is not thread-safe: the offline `LLM` calls it from one thread, the async engine from its one loop thread.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time

import numpy as np
from flax import nnx

from jaxpaged.config import CacheConfig, ModelConfig
from jaxpaged.core.block_manager import BlockManager
from jaxpaged.core.pool_view import MAX_CELLS, pool_view
from jaxpaged.core.request import Request, Sequence, SequenceStatus
from jaxpaged.core.sched_output import SchedulerOutput
from jaxpaged.core.scheduler import Scheduler
from jaxpaged.engine.beam_search import BeamSearchParams
from jaxpaged.engine.input_processor import InputProcessor
from jaxpaged.engine.reasoning import ANSWER, THINKING, UNDECIDED, reasoning_parser
from jaxpaged.engine.reasoning import END as THINK_END
from jaxpaged.engine.reasoning import START as THINK_START
from jaxpaged.engine.setup import EngineConfig, build_runner
from jaxpaged.engine.structured_output import (
    GrammarCache,
    GrammarError,
    advance,
    allow,
    ban,
    bitmask_words,
    fill_bitmask,
)
from jaxpaged.models import check_model, families
from jaxpaged.outputs import EngineOutput, PositionLogprobs, SeqDelta
from jaxpaged.sampling_params import SamplingParams
from jaxpaged.spec_decode import ngram
from jaxpaged.spec_decode.gate import SpeculationGate
from jaxpaged.worker.kv_quant import kv_stats
from jaxpaged.worker.model_runner import StepHandle, StepResult
from jaxpaged.worker.sampler import TokenLogprobs

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """A device operation failed after the KV pool was donated to it: the engine has no pool and takes no work."""


@dataclasses.dataclass
class StepTimes:
    """Seconds of host work per part of the step loop, summed over steps (benchmarks/host_overhead.py splits a
    step's host time with these), and the time spent waiting for the device's tokens."""

    schedule_s: float = 0.0  # Scheduler.schedule
    prepare_s: float = 0.0  # swaps and copies queued, the persistent batch updated, the step laid out
    dispatch_s: float = 0.0  # the step queued on the device
    wait_s: float = 0.0  # blocked on a step's tokens
    output_s: float = 0.0  # tokens appended, stop conditions, the step's outputs built
    steps: int = 0

    @property
    def host_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.dispatch_s + self.output_s


@dataclasses.dataclass
class _InFlight:
    """A dispatched step whose tokens the host has not read yet."""

    out: SchedulerOutput
    handle: StepHandle
    # late bitmasks: the step's [S, W] bitmask, laid out all ones, and (row, sequence) of the rows to fill in once
    # the previous step's tokens are in
    bitmask: np.ndarray | None = None
    late_masks: list[tuple[int, Sequence]] = dataclasses.field(default_factory=list)


class Engine:
    def __init__(self, model_config: ModelConfig, params: dict | nnx.State, tokenizer,
                 config: EngineConfig | None = None):
        """The architecture's model (`jaxpaged.models.families`: the Llama family, Gemma 3) from its config and
        parameters (`jaxpaged.loader`'s layout, a dict or nnx.State)."""
        self._setup(families.from_params(model_config, params), tokenizer, config)

    @classmethod
    def from_model(cls, model: nnx.Module, tokenizer, config: EngineConfig | None = None) -> Engine:
        """Any nnx module that follows the model contract (`jaxpaged.models.contract`)."""
        self = cls.__new__(cls)
        self._setup(model, tokenizer, config)
        return self

    def _setup(self, model: nnx.Module, tokenizer, config: EngineConfig | None) -> None:
        check_model(model)
        config = config or EngineConfig()
        self.config = config
        self.model_config = model.config  # ModelConfig, or a BYO model's ModelSpec fields
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        # vLLM's generation_config="auto": the sampling fields the model's generation_config.json sets are the
        # defaults of requests that leave them unset (SamplingParams' own defaults otherwise)
        model_defaults = getattr(self.model_config, "generation_defaults", None) or {}
        self.generation_defaults: dict[str, float | int] = (dict(model_defaults) if config.generation_config == "auto"
                                                            else {})
        if self.generation_defaults:
            logger.info("requests that leave them unset sample with the model's generation_config.json values %s "
                        "(generation_config='vllm' keeps vLLM's defaults)", self.generation_defaults)
        t0 = time.perf_counter()
        self.runner, self.cache_config, self.scheduler_config, self.max_model_len = build_runner(model, config)
        self.block_manager = BlockManager(self.runner.num_blocks, self.cache_config.block_size,
                                          self.cache_config.enable_prefix_caching,
                                          num_cpu_blocks=self._num_cpu_blocks(self.cache_config),
                                          reserve_tokens=self.max_model_len if config.kv_allocation == "contiguous"
                                          else 0)
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config, self.block_manager,
                                   mixed_steps=getattr(self.runner.attn, "mixes_steps", False))
        # Speculative decoding: proposals need each step's tokens on the host, so the loop is synchronous with it.
        self.spec = config.speculative()
        self.spec_gate = SpeculationGate(self.spec, self.scheduler_config.max_num_seqs) if self.spec else None
        self.async_scheduling = config.async_scheduling and self.spec is None
        # With speculation, plain decode steps still run asynchronously while no row may speculate (more than
        # disable_by_batch_size running): a large batch keeps the host work hidden behind the device.
        self._async_unless_speculating = config.async_scheduling and self.spec is not None
        self.requests: dict[str, Request] = {}
        self.grammars = GrammarCache(tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids))
        self.inputs = InputProcessor(tokenizer, self.model_config.vocab_size, self.eos_token_ids, self.max_model_len,
                                     self.scheduler_config.max_num_seqs, self.grammars,
                                     num_blocks=self.block_manager.num_blocks,
                                     block_size=self.cache_config.block_size, spec=self.spec,
                                     drafts=self.runner.drafts, seed=config.seed,
                                     policy=self.scheduler_config.policy,
                                     default_params=SamplingParams(**self.generation_defaults),
                                     reasoning=reasoning_parser(config.reasoning_parser))
        if config.reasoning_parser is not None and tokenizer is not None and self.inputs.think_tokens() is None:
            logger.warning("reasoning_parser=%s: the tokenizer has no %s and %s of one token each, so a request's "
                           "structured output constrains its whole output, reasoning included",
                           config.reasoning_parser, THINK_START, THINK_END)
        self.dead: str | None = None  # why the engine can no longer run (see EngineDeadError)
        # The host pool of swapped-out blocks, one array per pool array (K, V[, a draft model's K, V]):
        # [L, num_cpu_blocks, BS, Hkv, D], made at the first swap-out, indexed by host block id.
        self._host_pool: list[np.ndarray] = []
        self._inflight: _InFlight | None = None
        self._last_step_done = 0.0  # when the host last saw a step's tokens arrive
        self._sync_requests = 0  # unfinished requests whose steps must run synchronously (Request.needs_host_tokens)
        self._late_mask_requests = 0  # of those, the ones that need the tokens only for a bitmask (masks_need_tokens)
        # Late bitmasks: with the sampler apart from the step (runner.split_sampler), a step's bitmasks can be computed
        # after it is dispatched, so grammars and bad words keep the loop asynchronous.
        self._late_masks = self.async_scheduling and self.runner.split_sampler
        self._masked_requests = 0  # unfinished requests with a grammar or bad words (a bitmask per sampling row)
        self._special_requests = 0  # unfinished requests whose tokens need more than appending (not Request.plain)
        self._streaming_requests = 0  # unfinished requests with an output at every step (Request.streams)
        self._scoring_requests = 0  # unfinished requests that want their prompt's log-probs (prompt_logprobs)
        self.counters = {"steps": 0, "prefill_steps": 0, "decode_steps": 0, "prompt_tokens": 0,
                         "generation_tokens": 0, "finished_requests": 0, "aborted_requests": 0, "failed_requests": 0,
                         "spec_verify_steps": 0, "spec_proposed_tokens": 0, "spec_accepted_tokens": 0}
        self.startup_times = {"setup_s": time.perf_counter() - t0, "compile_s": 0.0}
        self.step_times = StepTimes()
        if config.precompile:
            self.startup_times["compile_s"] = self.runner.warm_up(progress=config.show_progress)
            logger.info("start-up: setup %.1f s, compile %d step shapes %.1f s", self.startup_times["setup_s"],
                        len(self.runner.all_shapes()), self.startup_times["compile_s"])

    @property
    def gates_grammars(self) -> bool:
        """A request's grammar waits for the end of its reasoning (reasoning_parser, with <think> and </think> each
        one token of the tokenizer); else it constrains the whole output."""
        return self.inputs.think_tokens() is not None

    @property
    def default_sampling_params(self) -> SamplingParams:
        """What a request given no SamplingParams samples with: vLLM's defaults, over which the model's
        generation_config.json sets some (EngineConfig.generation_config)."""
        return self.inputs.default_params

    @property
    def tokenizer(self):
        """The tokenizer prompts are encoded with (the input processor's; None for an engine of token ids only)."""
        return self.inputs.tokenizer

    @tokenizer.setter
    def tokenizer(self, tokenizer) -> None:
        self.inputs.tokenizer = tokenizer

    def _num_cpu_blocks(self, cache: CacheConfig) -> int:
        if cache.swap_space <= 0:
            return 0
        return int(cache.swap_space * 2**30 // self.runner.host_block_bytes)

    # ---- requests -----------------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    arrival_time: float | None = None, priority: int = 0) -> None:
        """Queues a request. Raises ValueError / TypeError naming the problem for bad input; the engine state is then
        unchanged. priority: lower runs first, under scheduling_policy="priority" (else it must be 0)."""
        self.enqueue(self.make_request(request_id, prompt, params, arrival_time, priority))

    def make_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                     arrival_time: float | None = None, priority: int = 0) -> Request:
        """Checks and tokenizes a request without queueing it (`enqueue` does), so a batch can be all or nothing."""
        self._check_request_id(request_id)
        return self.inputs.request(request_id, prompt, params, arrival_time, priority)

    def make_beam_request(self, request_id: str, prompt: str | list[int] | dict,
                          params: BeamSearchParams) -> Request:
        """A beam search, checked and not yet queued; its one output holds the beam_width best hypotheses."""
        self._check_request_id(request_id)
        return self.inputs.beam_request(request_id, prompt, params)

    def add_beam_request(self, request_id: str, prompt: str | list[int] | dict, params: BeamSearchParams) -> None:
        self.enqueue(self.make_beam_request(request_id, prompt, params))

    def enqueue(self, req: Request) -> None:
        """Queues a request made by `make_request` / `make_beam_request`."""
        self._check_request_id(req.request_id)
        self.requests[req.request_id] = req
        self._sync_requests += req.needs_host_tokens
        self._late_mask_requests += req.masks_need_tokens
        self._masked_requests += _masked(req)
        self._special_requests += not req.plain
        self._streaming_requests += req.streams
        self._scoring_requests += req.prompt_logprobs is not None
        self.scheduler.add(req.seqs[0])

    def _check_request_id(self, request_id: str) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def abort_request(self, request_id: str) -> None:
        """Stops a request and frees its blocks at once. Unknown or finished ids are ignored."""
        req = self._forget(request_id)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "abort")
        self.counters["aborted_requests"] += 1

    def stop_sequences(self, request_id: str, indices: list[int]) -> EngineOutput | None:
        """The output processor found a stop string: those sequences (sample indices) end now, as "stop". The
        request's remaining output is the output processor's; the engine gives no more for them. Returns, when this
        ended the request (a finished request, not an aborted one), its final output without tokens: each sequence's
        finish reason, for the caller's metrics."""
        req = self.requests.get(request_id)
        if req is None:
            return None
        for seq in req.seqs:
            if seq.sample_index in indices and not seq.finished:
                self.scheduler.finish(seq, "stop")
        if not req.finished:
            return None
        self._forget(request_id)
        self.counters["finished_requests"] += 1
        return EngineOutput(request_id, [SeqDelta(s.sample_index, [], finish_reason=s.finish_reason) for s in req.seqs],
                            True)

    def _forget(self, request_id: str) -> Request | None:
        req = self.requests.pop(request_id, None)
        if req is not None:
            self._sync_requests -= req.needs_host_tokens
            self._late_mask_requests -= req.masks_need_tokens
            self._masked_requests -= _masked(req)
            self._special_requests -= not req.plain
            self._streaming_requests -= req.streams
            self._scoring_requests -= req.prompt_logprobs is not None
        return req

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    # ---- one step -----------------------------------------------------------------------------------------------

    def step(self) -> list[EngineOutput]:
        """Schedules and dispatches the next step, then reads the previous one's tokens (asynchronous scheduling; with
        `async_scheduling=False`, or while a request needs its tokens on the host, the step just dispatched is read
        at once). Returns an output for every request that finished or failed, and for every request whose new
        tokens its caller streams (output kind not FINAL_ONLY, or stop strings to look for).

        A failure that can be traced to requests fails those requests only (their output has `error` set) and the
        loop goes on for the others: a row the host cannot lay out, a device step whose pool survived (its
        requests), a request whose output processing raised. A device operation that raised after the pool was
        donated leaves no pool: the engine is dead from then on and every call raises EngineDeadError.
        """
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        outputs: list[EngineOutput] = []
        times = self.step_times
        sync = self._synchronous()
        if self._inflight is not None and sync:
            outputs += self._complete(self._inflight)
            self._inflight = None
        t0 = time.perf_counter()
        if self.spec is not None:
            self._propose()
        out = self.scheduler.schedule()
        if out is not None and self.spec is not None and getattr(self.runner, "draft", None) is not None:
            self._skip_draft(out)
        times.schedule_s += time.perf_counter() - t0
        late = not sync and self._late_mask_requests > 0
        launched = self._launch(out, outputs, late) if out is not None else None
        if self._inflight is not None:
            outputs += self._complete(self._inflight)
        if launched is not None and launched.late_masks:
            self._sample_late(launched, outputs)
        self._inflight = launched
        # (a verifying step, spec_width > 0, is read at once: its rows' rollback sets their computed
        # tokens, which the next step must see)
        if launched is not None and (sync or launched.handle.layout.spec_width):
            outputs += self._complete(launched)
            self._inflight = None
        return outputs

    def _synchronous(self) -> bool:
        """Whether this step is read before the next one is scheduled: async_scheduling off, a request that needs
        its tokens on the host, or speculation that may propose (proposals need the last tokens)."""
        if self._sync_requests > (self._late_mask_requests if self._late_masks else 0):
            return True
        if self.async_scheduling:
            return False
        return not (self._async_unless_speculating and not self.spec_gate.batch_enabled(len(self.scheduler.running)))

    def _launch(self, out: SchedulerOutput, failed: list[EngineOutput], late: bool = False) -> _InFlight | None:
        """Queues the step's swaps, copies and the step itself on the device; None when nothing runs. late: its
        bitmasks are laid out all ones and filled in by `_sample_late`."""
        t0 = time.perf_counter()
        self.runner.apply_diffs(out)  # whatever happens to the step below: the scheduler hands each diff over once
        self._add_forked(out.forked)
        num_failed = len(failed)
        with self._device_guard(out, failed):
            self._swap(out.blocks_to_swap_out, out.blocks_to_swap_in)
            self.runner.copy_blocks(out.blocks_to_copy)
        if not out.seqs or len(failed) > num_failed:
            return None
        prepared = self._prepare(out, failed, late)
        if prepared is None:
            return None
        out, inputs, rows = prepared
        late_masks = [(i, seq) for i, seq in enumerate(out.seqs)  # (no pass over the rows unless late)
                      if out.samples[i] and _masked(self.requests[seq.request_id])] if late else []
        t1 = time.perf_counter()
        handle = None
        with self._device_guard(out, failed):
            handle = self.runner.dispatch(inputs, rows)
        t2 = time.perf_counter()
        self.step_times.prepare_s += t1 - t0
        self.step_times.dispatch_s += t2 - t1
        if handle is None:
            return None
        self.counters["steps"] += 1
        self.counters["prefill_steps" if out.is_prefill else "decode_steps"] += 1
        self.counters["prompt_tokens"] += out.prompt_tokens
        return _InFlight(out, handle, inputs.extras.get("bitmask"), late_masks)

    def _sample_late(self, inflight: _InFlight, failed: list[EngineOutput]) -> None:
        """Late bitmasks: the dispatched step's masked rows get their bitmasks, now that the tokens they depend on
        (the step before's) are in, and its sampler is queued. A request whose bitmask raises fails alone (its row
        samples freely, and its token is dropped with it); a sequence that has finished meanwhile keeps all ones."""
        t0 = time.perf_counter()
        mask = inflight.bitmask
        for i, seq in inflight.late_masks:
            req = self.requests.get(seq.request_id)
            if req is None or seq.finished:
                continue
            try:
                row = self._bitmask(req, seq)
            except Exception as e:
                (logger.warning if isinstance(e, GrammarError) else logger.exception)(
                    "request %s: its bitmask failed: %s", req.request_id, e)
                failed.append(self._fail(req, e, unwritten=False))
                continue
            if row is not None:
                mask[i] = row
        with self._device_guard(inflight.out, failed):
            self.runner.sample_pending(inflight.handle, mask)
        self.step_times.prepare_s += time.perf_counter() - t0

    @staticmethod
    def _unschedule(out: SchedulerOutput) -> None:
        """The step did not run: its sequences' computed tokens and placeholders go back to before it."""
        for seq, n, sampled in zip(out.seqs, out.num_new_tokens, out.samples, strict=True):
            seq.num_computed_tokens -= n
            seq.num_placeholders -= sampled

    def _prepare(self, out: SchedulerOutput, failed: list[EngineOutput], late: bool = False):
        """The step as it will run and its inputs, (SchedulerOutput, StepInputs, StepRows). A request whose rows
        cannot be laid out (its grammar's bitmask raises; or the layout raises and, tried alone, its rows do) fails
        alone, and the step goes on without it; None when nothing is left. late: masked rows are laid out with all
        tokens allowed (`_sample_late` fills them in)."""
        culprits: dict[str, Exception] = {}
        bitmasks: dict[int, np.ndarray] = {}  # seq_id -> the tokens it may sample
        anything = np.full(bitmask_words(self.model_config.vocab_size), -1, np.int32) if late else None
        for i, seq in enumerate(out.seqs if self._masked_requests else ()):
            req = self.requests[seq.request_id]
            if _masked(req) and out.samples[i]:
                try:
                    mask = anything if late else self._bitmask(req, seq)
                except Exception as e:
                    culprits.setdefault(seq.request_id, e)
                    continue
                if mask is not None:
                    bitmasks[seq.seq_id] = mask
        out = self._without(out, culprits, failed)
        if not out.seqs:
            return None
        tables = self.block_manager.tables
        try:
            return out, *self._runner_prepare(out, tables, bitmasks)
        except Exception as e:
            logger.exception("the step could not be laid out; finding the requests whose rows raise")
            first_error = e
        for request_id in dict.fromkeys(s.request_id for s in out.seqs):  # which requests' rows raise on their own
            alone = self._without(out, {r: None for r in self.requests if r != request_id}, None)
            try:
                self.runner.prepare(alone, tables, self._seed_of, bitmasks)
            except Exception as e:
                culprits[request_id] = e
        out = self._without(out, culprits or {s.request_id: first_error for s in out.seqs}, failed)
        if not out.seqs:
            return None
        return out, *self._runner_prepare(out, tables, bitmasks)

    def _without(self, out: SchedulerOutput, culprits: dict[str, Exception | None],
                 failed: list[EngineOutput] | None) -> SchedulerOutput:
        """The step without the culprits' sequences; with `failed`, the culprits fail (their outputs go there)."""
        if not culprits:
            return out
        if failed is not None:
            self._unschedule(self._without(out, {s.request_id: None for s in out.seqs if s.request_id not in culprits},
                                           None))  # the culprits' part of the step will not run
            for request_id, e in culprits.items():
                if request_id in self.requests:
                    (logger.warning if isinstance(e, GrammarError) else logger.error)(
                        "request %s cannot be laid out for the device: %s", request_id, e)
                    failed.append(self._fail(self.requests[request_id], e))
        keep = [i for i, s in enumerate(out.seqs) if s.request_id not in culprits]
        return dataclasses.replace(out, **{name: [getattr(out, name)[i] for i in keep]
                                           for name in ("seqs", "num_new_tokens", "starts", "samples", "num_spec",
                                                        "drafts")})

    def _runner_prepare(self, out: SchedulerOutput, tables: dict, bitmasks: dict):
        scored = None
        if self._scoring_requests and out.is_prefill:  # the sequences whose prompt chunks it scores (prompt_logprobs)
            requests = self.requests
            scored = {seq.seq_id for seq in out.seqs if (req := requests.get(seq.request_id)) is not None
                      and req.prompt_logprobs is not None and len(req.prompt_logprobs) < seq.num_prompt_tokens}
        prepared = self.runner.prepare(out, tables, self._seed_of, bitmasks, scored)
        if self.spec_gate is not None:  # rows that now hold new sequences start with an empty acceptance window
            self.spec_gate.reset(np.array(self.runner.input_batch.take_added_rows(), np.int64))
        return prepared

    def _seed_of(self, seq: Sequence) -> int:
        """The seed of a sequence that gets a row in the persistent batch (a new one, or one that left the running set
        and came back: preempted, then prefilled again)."""
        return self.requests[seq.request_id].seed_of(seq)

    def _bitmask(self, req: Request, seq: Sequence) -> np.ndarray | None:
        """The tokens seq may sample next, [ceil(V / 32)] int32, or None when it may sample any: its grammar's
        allowed tokens (once its reasoning is over, `_phase`; and <think> too while a first token may start it), and
        its allowed_token_ids, minus its bad words (one-token words always, longer ones when the rest was just
        generated). GrammarError (the request's own fault) when that leaves no token."""
        phase = self._phase(req, seq)
        matcher = self._matcher(req, seq) if phase != THINKING else None
        if matcher is None and not req.bad_words_ids and req.allowed_mask is None:
            return None
        mask = np.full(bitmask_words(self.model_config.vocab_size), -1, np.int32)
        if matcher is not None:
            fill_bitmask(matcher, mask)
            if phase == UNDECIDED:
                allow(mask, [req.think.start])
        if req.allowed_mask is not None:
            mask &= req.allowed_mask
        out = seq.output_token_ids
        ban(mask, [w[-1] for w in req.bad_words_ids
                   if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:] == w[:-1])])
        if (req.allowed_mask is not None or req.bad_words_ids) and not mask.any():
            raise GrammarError("no token may follow: allowed_token_ids, bad words and the grammar leave none")
        return mask

    @staticmethod
    def _phase(req: Request, seq: Sequence) -> str:
        """Where seq is with its reasoning (engine.reasoning: UNDECIDED, THINKING, or ANSWER, which the grammar
        constrains); ANSWER from the first token for a request without a reasoning gate."""
        return req.think_phase.get(seq.seq_id, req.think_start)

    @staticmethod
    def _matcher(req: Request, seq: Sequence):
        """The sequence's grammar matcher (None if unconstrained), made on first use: n > 1 samples each get one. It
        has consumed the sequence's answer so far (after its reasoning, if any)."""
        if req.grammar is None:
            return None
        m = req.matchers.get(seq.seq_id)
        if m is None:
            m = req.matchers[seq.seq_id] = req.grammar.deep_copy()
            answer = seq.output_token_ids[req.answer_from.get(seq.seq_id, 0):]
            if answer and not m.consume_tokens(answer):
                raise ValueError(f"structured output: the grammar rejects the tokens so far: {m.get_error()}")
        return m

    @staticmethod
    def _advance_phase(req: Request, seq: Sequence, token: int) -> bool:
        """A reasoning-gated sequence's phase after `token` was appended; whether the grammar takes the token (it is
        part of the answer)."""
        phase = Engine._phase(req, seq)
        if phase == ANSWER:
            return True
        think = req.think
        if phase == UNDECIDED and token != think.start:  # no think block: the answer started with this token
            req.think_phase[seq.seq_id], req.answer_from[seq.seq_id] = ANSWER, len(seq.output_token_ids) - 1
            return True
        if phase == UNDECIDED:
            req.think_phase[seq.seq_id] = THINKING
        elif token == think.end:  # the answer starts after it
            req.think_phase[seq.seq_id], req.answer_from[seq.seq_id] = ANSWER, len(seq.output_token_ids)
        return False

    def _complete(self, inflight: _InFlight) -> list[EngineOutput]:
        """Reads a dispatched step's tokens (waiting for the device), appends them and applies the stop conditions;
        returns the step's outputs."""
        out, handle = inflight.out, inflight.handle
        failed: list[EngineOutput] = []
        t0 = time.perf_counter()
        result = None
        with self._device_guard(out, failed):
            result = self.runner.fetch(handle)
        t1 = time.perf_counter()
        times = self.step_times
        times.wait_s += t1 - t0
        times.steps += 1
        if result is None:
            return failed
        # The step's device time, roughly: from when it could start (dispatched, and the one before it done).
        self.scheduler.observe_step(out, t1 - max(handle.dispatched_at, self._last_step_done))
        self._last_step_done = t1
        if result.prompt_scores is not None:
            self._add_prompt_logprobs(handle.rows.scored, result.prompt_scores)
        outputs = self._apply_tokens(out, result, failed)
        times.output_s += time.perf_counter() - t1
        return outputs + failed

    def _apply_tokens(self, out: SchedulerOutput, result: StepResult, failed: list[EngineOutput]
                      ) -> list[EngineOutput]:
        now = time.monotonic()
        touched: dict[str, Request] = {}  # requests with outputs to give this step
        ended: set[str] = set()  # requests a sequence of which finished this step
        finished_beams: list[EngineOutput] = []
        requests = self.requests
        tokens = result.tokens.tolist()
        verifying = result.emitted is not None  # speculative decoding: a row emits one token or more
        if not verifying and not self._special_requests:  # the common step: its own tight pass
            return self._apply_plain(out, tokens)
        generated = 0
        finished = SequenceStatus.FINISHED
        for i, (seq, sampled, token) in enumerate(zip(out.seqs, out.samples, tokens, strict=True)):
            if not sampled or seq.status is finished:
                continue
            req = requests.get(seq.request_id)
            if req is None:  # aborted or failed after this step began
                continue
            try:
                if req.beam is not None:
                    seq.num_placeholders -= 1  # a beam's token becomes a new beam's, chosen with its group
                    row = (i, 0) if verifying else i
                    top_ids, top_lps = result.lp.top_ids[row], result.lp.top_logprobs[row]
                    req.beam_results[seq.seq_id] = list(zip(top_ids.tolist(), top_lps.tolist(), strict=True))
                    if len(req.beam_results) == len(req.seqs):
                        done = self._advance_beams(req)
                        finished_beams += [done] if done is not None else []
                    continue
                emitted = self._verified(out, result, i, seq) if verifying else [tokens[i]]
                seq.num_placeholders -= 1
                for j, token in enumerate(emitted):
                    seq.token_ids.append(token)
                    generated += 1
                    if seq.params.logprobs is not None:
                        self._append_logprobs(seq, token, result, (i, j) if verifying else i)
                    reason, stop_reason = self._stop(req, seq, token)
                    if reason is not None:
                        seq.stop_reason = stop_reason
                        req.matchers.pop(seq.seq_id, None)
                        self.scheduler.finish(seq, reason)
                        ended.add(req.request_id)
                        break  # tokens a verified run emitted past the end are dropped
            except Exception as e:
                if isinstance(e, GrammarError):  # the request's own grammar, not the engine
                    logger.warning("request %s: %s", req.request_id, e)
                else:
                    logger.exception("output processing failed for request %s", req.request_id)
                touched.pop(req.request_id, None)
                failed.append(self._fail(req, e, unwritten=False))
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
            if req.streams or req.request_id in ended:
                touched[req.request_id] = req
        self.counters["generation_tokens"] += generated
        outputs = [self._output(req, req.request_id in ended and req.finished) for req in touched.values()]
        return outputs + finished_beams

    def _apply_plain(self, out: SchedulerOutput, tokens: list[int]) -> list[EngineOutput]:
        """`_apply_tokens` of the most common step: every request is plain (no beam, grammar or log-probs) and
        nothing was verified, so each sampling row gains one token. One tight pass appends the tokens (it runs for
        every row of every step); the rows that may stop (a stop id, or at their length limit) and the requests that
        stream are handled after it."""
        now = time.monotonic()
        finished = SequenceStatus.FINISHED
        may_stop: list[Sequence] = []
        generated = 0
        for seq, sampled, token in zip(out.seqs, out.samples, tokens, strict=True):
            if not sampled or seq.status is finished:  # a prompt chunk; aborted, failed or stopped since the step began
                continue
            generated += 1
            token_ids = seq.token_ids
            token_ids.append(token)
            seq.num_placeholders -= 1
            if token in seq.stop_ids or len(token_ids) >= seq.token_limit:
                may_stop.append(seq)
            if seq.first_token_time is None:
                seq.first_token_time = now
        self.counters["generation_tokens"] += generated
        requests = self.requests
        touched: dict[str, Request] = {}
        ended: set[str] = set()
        for seq in may_stop:
            req = requests.get(seq.request_id)
            reason, stop_reason = self._stop(req, seq, seq.token_ids[-1]) if req is not None else (None, None)
            if reason is not None:
                seq.stop_reason = stop_reason
                self.scheduler.finish(seq, reason)
                ended.add(req.request_id)
                touched[req.request_id] = req
        if self._streaming_requests:  # every streaming request has an output, in row order
            touched = {}
            for seq in out.seqs:
                req = requests.get(seq.request_id)
                if req is not None and (req.streams or req.request_id in ended):
                    touched[req.request_id] = req
        return [self._output(req, req.request_id in ended and req.finished) for req in touched.values()]

    def _stop(self, req: Request, seq: Sequence, token: int) -> tuple[str | None, int | None]:
        """(finish reason, stop reason) after `token` was appended: ("stop", None) for EOS or a grammar that allows
        nothing more, ("stop", token) for a stop token, ("length", None) at max_tokens or the context length,
        (None, None) while it goes on. EOS and stop tokens count only from min_tokens on; stop strings are the
        output processor's."""
        if token in seq.stop_ids and len(seq.token_ids) - seq.num_prompt_tokens >= seq.params.min_tokens:
            return "stop", (token if token in seq.params.stop_token_ids else None)
        if req.grammar is not None and self._advance_phase(req, seq, token):
            matcher = self._matcher(req, seq)
            advance(matcher, token)  # GrammarError: this request fails alone, with a short message
            if matcher.is_stopped():  # the grammar allows nothing more
                return "stop", None
        if len(seq.token_ids) >= seq.token_limit:
            return "length", None
        return None, None

    @staticmethod
    def _append_logprobs(seq: Sequence, token: int, result: StepResult, row: int | tuple[int, int]) -> None:
        seq.output_top_logprobs.append(_position_logprobs(result.lp, row, seq.params.logprobs, token))

    def _add_prompt_logprobs(self, scored: list[tuple[Sequence, int, int, int]], scores: TokenLogprobs) -> None:
        """A scoring step's prompt log-probs, appended to each scored request's (position by position: a chunk
        scored again after a recompute adds nothing)."""
        for seq, start, r0, count in scored:
            req = self.requests.get(seq.request_id)
            if req is None or req.prompt_logprobs is None or len(req.prompt_logprobs) < start + 1:
                continue  # aborted or failed meanwhile (chunks are scored in order: never a gap)
            k, have = req.params.prompt_logprobs, req.prompt_logprobs
            for j in range(len(have) - start - 1, count):  # the positions not scored yet
                have.append(_position_logprobs(scores, r0 + j, k, seq.token_ids[start + j + 1]))

    def _output(self, req: Request, finished: bool) -> EngineOutput:
        """The request's new tokens since its last output (all of them, once, for FINAL_ONLY)."""
        seqs = req.seqs
        if len(seqs) == 1 and req.plain and not finished:  # a streamed one-sequence request mid-way: the common case
            seq = seqs[0]
            start, done = seq.num_emitted, len(seq.token_ids) - seq.num_prompt_tokens
            seq.num_emitted = done
            delta = SeqDelta(0, seq.token_ids[seq.num_prompt_tokens + start:])
            return EngineOutput(req.request_id, [delta], False, seq.num_cached_prompt_tokens, seq.first_token_time)
        deltas = []
        for seq in seqs:
            done = len(seq.token_ids) - seq.num_prompt_tokens
            if done == seq.num_emitted and not (finished and seq.finish_reason is not None):
                continue
            start = seq.num_emitted
            seq.num_emitted = done
            logprobs = seq.params.logprobs is not None
            deltas.append(SeqDelta(seq.sample_index, seq.token_ids[seq.num_prompt_tokens + start:],
                                   seq.output_top_logprobs[start:] if logprobs else None,
                                   seq.finish_reason, seq.stop_reason))
        prompt_logprobs = None
        if req.prompt_logprobs is not None and not req.prompt_logprobs_sent and (
                len(req.prompt_logprobs) == req.seqs[0].num_prompt_tokens):
            prompt_logprobs, req.prompt_logprobs_sent = req.prompt_logprobs, True
        if finished:
            self._forget(req.request_id)
            self.counters["finished_requests"] += 1
        return EngineOutput(req.request_id, deltas, finished, req.seqs[0].num_cached_prompt_tokens,
                            req.seqs[0].first_token_time, prompt_logprobs=prompt_logprobs)

    def _advance_beams(self, req: Request) -> EngineOutput | None:
        """Every live beam has its next-token log-probs: pick the next beams, fork them, free the old ones."""
        old = req.seqs
        tops = [req.beam_results.pop(s.seq_id) for s in old]
        new = req.beam.advance([(s.output_token_ids, s.cum_logprob) for s in old], tops)
        req.seqs = []
        if not req.beam.done:
            for cand in new:
                parent = old[cand.parent]
                child = parent.fork(output_token_ids=parent.output_token_ids + [cand.token],
                                    cum_logprob=cand.cum_logprob)
                self.scheduler.fork(parent, [child])
                req.seqs.append(child)
        for seq in old:
            self.scheduler.finish(seq, "beam")
        self.counters["generation_tokens"] += len(old)
        if not req.beam.done:
            return None
        eos = self.eos_token_ids
        deltas = [SeqDelta(i, h.token_ids, finish_reason="stop" if h.token_ids[-1] in eos and
                           not req.beam.params.ignore_eos else "length", cumulative_logprob=h.cum_logprob)
                  for i, h in enumerate(req.beam.results())]
        self._forget(req.request_id)
        self.counters["finished_requests"] += 1
        return EngineOutput(req.request_id, deltas, True, old[0].num_cached_prompt_tokens)

    def _add_forked(self, forked: list[tuple[Sequence, list[Sequence]]]) -> None:
        """The n - 1 other samples the scheduler forked from their parents join their requests."""
        for parent, children in forked:
            self.requests[parent.request_id].seqs += children
            for child in children:
                child.spec_lookahead = parent.spec_lookahead

    # ---- speculative decoding -----------------------------------------------------------------------------------

    def _propose(self) -> None:
        """Before a step is scheduled: each running sequence that may speculate gets its proposals (n-gram, from its
        tokens; a draft's were set by the step before) and the draft loop's slots; the others get none. The step
        then verifies them (`Scheduler._schedule_decodes`, `step._verify`)."""
        spec, gate = self.spec, self.spec_gate
        running = self.scheduler.running
        on = gate.batch_enabled(len(running))
        row_of = self.runner.input_batch.row_of
        k, draft = spec.num_speculative_tokens, self.runner.drafts
        for seq in running:
            req = self.requests.get(seq.request_id)
            row = row_of.get(seq.seq_id)
            ok = (on and req is not None and req.speculates and not seq.draft_stale
                  and len(seq.token_ids) - seq.num_prompt_tokens >= seq.params.min_tokens
                  and (row is None or bool(gate.allowed([row])[0])))
            if draft:
                seq.spec_lookahead = k if ok else 0
                if not ok:
                    seq.spec_tokens.clear()
                continue
            seq.spec_tokens.clear()
            if ok and seq.num_placeholders == 0 and len(seq.token_ids) - seq.num_computed_tokens == 1 and \
                    len(seq.token_ids) > seq.num_prompt_tokens:
                seq.spec_tokens += ngram.propose(np.asarray(seq.token_ids, np.int32), k=k,
                                                 min_n=spec.prompt_lookup_min, max_n=spec.prompt_lookup_max).tolist()

    def _skip_draft(self, out: SchedulerOutput) -> None:
        """A separate draft model's run over a step's tokens only keeps its K/V current for proposals to come: above
        disable_by_batch_size none come soon, and the step (prompt chunks too) runs without it and without its loop.
        Its sequences' draft K/V then has holes, so they do not speculate again (catching the draft up would be a
        prefill of every skipped position, for the few tokens left once the batch has shrunk below the threshold;
        docs/speculative.md), and their blocks from there stay out of the prefix cache: a later request finding them
        cached would draft from the holes, for as long as they stay cached."""
        if self.spec_gate.batch_enabled(len(self.scheduler.running)):
            return
        out.draft_kv = False
        for seq, start in zip(out.seqs, out.starts, strict=True):
            if not seq.draft_stale:
                seq.draft_stale = True
                self.block_manager.withhold(seq.seq_id, start)

    def _verified(self, out: SchedulerOutput, result: StepResult, i: int, seq: Sequence) -> list[int]:
        """A verifying step's row i: the tokens it emits (accepted proposals, then the target's), after the
        rollback of its rejected proposals and of the draft loop's slots; the draft's next proposals kept."""
        a = int(result.num_accepted[i])
        n = out.num_spec[i]
        emit_pos = out.starts[i] + out.num_new_tokens[i] - n  # where the first emitted token sits
        seq.num_computed_tokens = emit_pos + a  # rejected proposals' K/V are not the sequence's
        # A separate draft's loop wrote its K/V for the k positions from here (the last token, then its proposals):
        # the blocks holding them stay, so the next step verifies without a draft run over the accepted ones.
        looped = out.drafts[i] and out.draft_kv and getattr(self.runner, "draft", None) is not None
        seq.draft_loop_from = seq.num_computed_tokens if looped else -1
        keep = seq.num_computed_tokens + (self.spec.num_speculative_tokens if looped else 0)
        self.block_manager.truncate(seq.seq_id, keep)
        if n:
            self.counters["spec_verify_steps"] += 1
            self.counters["spec_proposed_tokens"] += n
            self.counters["spec_accepted_tokens"] += a
            row = self.runner.input_batch.row_of.get(seq.seq_id)
            if row is not None:
                self.spec_gate.record(np.array([row]), np.array([n]), np.array([a]))
        seq.spec_tokens.clear()
        if out.drafts[i]:
            seq.spec_tokens += result.proposals[i].tolist()
        return result.emitted[i, :a + 1].tolist()

    @contextlib.contextmanager
    def _device_guard(self, out: SchedulerOutput, failed: list[EngineOutput]):
        """A device operation of step `out` that raises: with the pool gone, or multi-host, the engine is dead; with
        the pool intact the requests of this step fail (which of them caused it cannot be known; the step's tokens
        count as unwritten) and the engine goes on."""
        try:
            yield
        except Exception as e:
            if getattr(self.runner, "multihost", False):
                # the other processes may have run the op, or part of it: they cannot be brought back in step
                self.dead = f"a device op failed across processes: {type(e).__name__}: {e}"
                logger.exception("the engine is dead")
                raise EngineDeadError(self.dead) from e
            if not self.runner.pool_alive():
                self.dead = f"a device step failed after its KV pool was donated: {type(e).__name__}: {e}"
                logger.exception("the engine is dead")
                raise EngineDeadError(self.dead) from e
            logger.exception("a device step failed; failing its requests")
            self._unschedule(out)
            for request_id in dict.fromkeys(s.request_id for s in out.seqs):
                if request_id in self.requests:
                    failed.append(self._fail(self.requests[request_id], e))

    def _fail(self, req: Request, error: Exception, unwritten: bool = True) -> EngineOutput:
        """Ends a request with an error. unwritten: a step allocated slots its K/V never reached, so the blocks it
        alone holds must not stay in the prefix cache."""
        self._forget(req.request_id)
        so = req.params.structured_outputs
        if isinstance(error, GrammarError) and so is not None:
            self.grammars.evict(so.kind, so.spec)
        for seq in req.seqs:
            if not seq.finished:
                if unwritten:
                    self.block_manager.forget_unwritten(seq.seq_id, seq.num_computed_tokens)
                self.scheduler.finish(seq, "error")
        self.counters["failed_requests"] += 1
        message = f"{type(error).__name__}: {error}"
        deltas = [SeqDelta(seq.sample_index, seq.output_token_ids[seq.num_emitted:], finish_reason="error")
                  for seq in req.seqs]
        return EngineOutput(req.request_id, deltas, True, error=message)

    def _swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        """Swap-ins (host block, device block) read from the host pool, then swap-outs (device block, host block)
        written to it: the scheduler swaps in before it preempts, so a host block a swap-in frees this step may
        already be a swap-out's target. A host block whose sequence ended needs nothing: the slot is written again
        when the block manager hands it out."""
        if swap_in:
            hosts = np.array([h for h, _ in swap_in], np.int64)
            self.runner.write_blocks([d for _, d in swap_in], *(pool[:, hosts] for pool in self._host_pool))
        if swap_out:
            arrays = self.runner.read_blocks([d for d, _ in swap_out])
            if not self._host_pool:  # np.empty: pages are taken from the OS as blocks are first written
                n = self.block_manager.num_cpu_blocks
                self._host_pool = [np.empty((a.shape[0], n, *a.shape[2:]), a.dtype) for a in arrays]
            hosts = np.array([h for _, h in swap_out], np.int64)
            for pool, a in zip(self._host_pool, arrays, strict=True):
                pool[:, hosts] = a

    # ---- observability ------------------------------------------------------------------------------------------

    def pool_view(self, max_cells: int = MAX_CELLS) -> dict:
        """The KV pool cell by cell for the watch page (see `pool_view.py`), the requests that hold blocks (cells'
        `owner` indexes them, oldest first) and the scheduler's counts. Host Python only; like every Engine method
        it must be called from the thread that steps the engine."""
        bm = self.block_manager
        holders, seq_owner = [], {}
        for req in sorted(self.requests.values(), key=lambda r: r.arrival_time):
            seq_ids = [s.seq_id for s in req.seqs if s.seq_id in bm.tables or bm.is_swapped(s.seq_id)]
            if not seq_ids:
                continue
            for seq_id in seq_ids:
                seq_owner[seq_id] = len(holders)
            device = {b for s in seq_ids for b in bm.block_table(s)}
            holders.append({"id": req.request_id, "num_seqs": len(seq_ids), "blocks": len(device),
                            "swapped": any(bm.is_swapped(s) for s in seq_ids),
                            "tokens": max(bm.num_tokens(s) for s in seq_ids)})
        view = pool_view(bm, seq_owner, max_cells)
        b = bm.stats()
        view.update(
            requests=holders, num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            num_swapped=len(self.scheduler.swapped), preemptions=sum(self.scheduler.num_preemptions.values()),
            prefix_cache_hit_rate=b.prefix_cache_hits / b.prefix_cache_queries if b.prefix_cache_queries else 0.0,
            prefix_cache_queries=b.prefix_cache_queries, prefix_cache_hits=b.prefix_cache_hits,
            steps=self.counters["steps"])
        return view

    def stats(self) -> dict:
        """Pool, scheduler and throughput counters (a plain dict, for logs, tests and /metrics). O(1): every figure
        is a counter kept as it changes, so the server can take it after every step."""
        bm = self.block_manager
        b = bm.stats()
        bs = self.cache_config.block_size
        slots_allocated = b.num_used * bs  # distinct blocks: a shared block counts once
        times = self.step_times
        return {
            **dataclasses.asdict(b),
            "block_size": bs,
            **kv_stats(self.runner),  # kv_cache_dtype, kv_bytes_per_token
            # token slots holding real tokens / slots in allocated blocks (shared tokens count once per holder, so
            # with sharing this can pass 1: the pool holds more tokens than it has slots)
            "kv_utilization": bm.num_device_tokens / slots_allocated if slots_allocated else 0.0,
            "prefix_cache_hit_rate": b.prefix_cache_hits / b.prefix_cache_queries if b.prefix_cache_queries else 0.0,
            # blocks the sequences would hold without sharing, minus what the pool holds for them
            "bytes_saved_by_sharing": max(0, bm.num_table_blocks - b.num_used) * self.runner.block_bytes,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_swapped": len(self.scheduler.swapped),
            "preemptions": sum(self.scheduler.num_preemptions.values()),
            "preemptions_recompute": self.scheduler.num_preemptions["recompute"],
            "preemptions_swap": self.scheduler.num_preemptions["swap"],
            **self.counters,
            # speculative decoding: tokens a verifying sequence emitted per step (accepted proposals + 1)
            "spec_mean_accepted_length": (1 + self.counters["spec_accepted_tokens"] / self.counters["spec_verify_steps"]
                                          if self.counters["spec_verify_steps"] else 0.0),
            **self.startup_times,
            "host_s": times.host_s,
            "device_wait_s": times.wait_s,
            **getattr(self.runner, "weight_info", {}),  # quantization, weight_bytes, weight_format(s)
        }


def _position_logprobs(lp: TokenLogprobs, row: int | tuple[int, int], k: int, token: int) -> PositionLogprobs:
    """Row `row` of a step's log-probs (on the host) for `token`, with the row's top k."""
    return PositionLogprobs(token, float(lp.logprobs[row]), int(lp.ranks[row]), lp.top_ids[row][:k].tolist(),
                            lp.top_logprobs[row][:k].tolist())


def _masked(req: Request) -> bool:
    """Its sampling rows take a bitmask (a grammar, bad words, allowed_token_ids)."""
    return req.grammar is not None or bool(req.bad_words_ids) or req.allowed_mask is not None


__all__ = ["Engine", "EngineConfig", "EngineDeadError", "StepTimes"]
