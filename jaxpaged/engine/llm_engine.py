"""`Engine`: requests in, one scheduled and executed step at a time, `RequestOutput`s out.

The engine owns the host state (requests, scheduler, block manager) and the `ModelRunner` (device state); what a
request gives back (detokenization, stop conditions, output kinds) is the `OutputProcessor`'s.
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
from jaxpaged.core.request import Sequence
from jaxpaged.core.scheduler import Scheduler, SchedulerOutput
from jaxpaged.engine.beam_search import BeamSearchParams, BeamState
from jaxpaged.engine.detokenizer import Detokenizer
from jaxpaged.engine.output_processor import OutputProcessor
from jaxpaged.engine.setup import EngineConfig, build_runner
from jaxpaged.engine.structured_output import GrammarCache, ban, bitmask_words, fill_bitmask
from jaxpaged.models import check_model, families
from jaxpaged.outputs import CompletionOutput, RequestOutput
from jaxpaged.sampling_params import RequestOutputKind, SamplingParams
from jaxpaged.worker.sampler import MAX_BANNED, MAX_LOGPROBS

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """A device operation failed after the KV pool was donated to it: the engine has no pool and takes no work."""


@dataclasses.dataclass
class _Request:
    request_id: str
    prompt: str | None
    seqs: list[Sequence]
    detokenizers: list[Detokenizer]
    seed: int
    arrival_time: float
    beam: BeamState | None = None
    beam_results: dict[int, list[tuple[int, float]]] = dataclasses.field(default_factory=dict)  # seq_id -> top
    grammar: object | None = None  # structured output: a fresh matcher, copied for each sequence
    matchers: dict[int, object] = dataclasses.field(default_factory=dict)  # seq_id -> its advancing matcher
    bad_words_ids: list[list[int]] = dataclasses.field(default_factory=list)  # token sequences not to generate
    sent: dict[int, tuple[int, int]] = dataclasses.field(default_factory=dict)  # DELTA: seq_id -> (tokens, chars) out

    def matcher(self, seq: Sequence):
        """The sequence's grammar matcher (None if unconstrained), made on first use: n > 1 samples each get one."""
        if self.grammar is None:
            return None
        m = self.matchers.get(seq.seq_id)
        if m is None:
            m = self.matchers[seq.seq_id] = self.grammar.deep_copy()
            if seq.output_token_ids and not m.consume_tokens(seq.output_token_ids):
                raise ValueError(f"structured output: the grammar rejects the tokens so far: {m.get_error()}")
        return m

    def seed_of(self, seq: Sequence) -> int:
        """Sample i of a seeded request draws from its own stream, reproducibly."""
        return (self.seed + seq.sample_index * 0x9E3779B97F4A7C15) % 2**63

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.seqs)


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
        self.tokenizer = tokenizer
        t0 = time.perf_counter()
        self.runner, self.cache_config, self.scheduler_config, self.max_model_len = build_runner(model, config)
        self.block_manager = BlockManager(self.runner.num_blocks, self.cache_config.block_size,
                                          self.cache_config.enable_prefix_caching,
                                          num_cpu_blocks=self._num_cpu_blocks(self.cache_config),
                                          reserve_tokens=self.max_model_len if config.kv_allocation == "contiguous"
                                          else 0)
        self.scheduler = Scheduler(self.scheduler_config, self.cache_config, self.block_manager,
                                   mixed_steps=getattr(self.runner.attn, "mixes_steps", False))
        self.eos_token_ids = set(self.model_config.eos_token_ids)
        if tokenizer is not None and tokenizer.eos_token_id is not None:
            self.eos_token_ids.add(tokenizer.eos_token_id)
        self.requests: dict[str, _Request] = {}
        self.outputs = OutputProcessor(tokenizer, self.eos_token_ids, self.max_model_len)
        self.grammars = GrammarCache(tokenizer, self.model_config.vocab_size, sorted(self.eos_token_ids))
        self.dead: str | None = None  # why the engine can no longer run (see EngineDeadError)
        self._host_pool: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # host block id -> (k, v) [L, BS, Hkv, D]
        self._rng = np.random.default_rng(config.seed)
        self.counters = {"steps": 0, "prefill_steps": 0, "decode_steps": 0, "prompt_tokens": 0,
                         "generation_tokens": 0, "finished_requests": 0, "aborted_requests": 0, "failed_requests": 0}
        self.startup_times = {"setup_s": time.perf_counter() - t0, "compile_s": 0.0}
        self.step_times = {"host_s": 0.0, "device_s": 0.0}  # summed over the steps that ran the model
        if config.precompile:
            self.startup_times["compile_s"] = self.runner.warm_up(progress=config.show_progress)
            logger.info("start-up: setup %.1f s, compile %d step shapes %.1f s", self.startup_times["setup_s"],
                        len(self.runner.all_shapes()), self.startup_times["compile_s"])

    def _num_cpu_blocks(self, cache: CacheConfig) -> int:
        if cache.swap_space <= 0:
            return 0
        return int(cache.swap_space * 2**30 // self.runner.host_block_bytes)

    # ---- requests -----------------------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queues a request. Raises ValueError / TypeError naming the problem for bad input; the engine state is then
        unchanged."""
        self.enqueue(self.make_request(request_id, prompt, params, arrival_time))

    def make_request(self, request_id: str, prompt: str | list[int] | dict, params: SamplingParams | None = None,
                     arrival_time: float | None = None) -> _Request:
        """Checks and tokenizes a request without queueing it (`enqueue` does), so a batch can be all or nothing."""
        params = SamplingParams() if params is None else params
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__} {params!r}")
        self._check_request_id(request_id)
        text, token_ids = self._tokenize(prompt)
        self._check_prompt(token_ids)
        params.check_against_model(self.model_config.vocab_size)
        if len(params.stop_token_ids) + len(self.eos_token_ids) > MAX_BANNED and params.min_tokens:
            raise ValueError(f"min_tokens with more than {MAX_BANNED} EOS + stop_token_ids is not supported")
        if params.n > self.scheduler_config.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds max_num_seqs={self.scheduler_config.max_num_seqs}")
        arrival = arrival_time or time.monotonic()
        seed = params.seed if params.seed is not None else int(self._rng.integers(0, 2**63))
        so = params.structured_outputs
        grammar = self.grammars.matcher(so.kind, so.spec) if so is not None else None
        bad_words_ids = self._bad_words_ids(params.bad_words)
        parent = Sequence(request_id, token_ids, params, arrival_time=arrival, fork_pending=params.n - 1)
        return _Request(request_id, text, [parent], [self.outputs.detokenizer(params)], seed, arrival, grammar=grammar,
                        bad_words_ids=bad_words_ids)

    def _bad_words_ids(self, words: list[str]) -> list[list[int]]:
        """Each bad word's tokens, alone and after a space (vLLM's rule: a word is banned at the start of the text and
        in its middle)."""
        if not words:
            return []
        if self.tokenizer is None:
            raise ValueError("bad_words needs a tokenizer; this engine has none")
        out: list[list[int]] = []
        for word in words:
            for prefix in ("", " "):
                ids = list(self.tokenizer.encode(prefix + word.lstrip(), add_special_tokens=False))
                if ids and ids not in out:
                    out.append(ids)
        return out

    def make_beam_request(self, request_id: str, prompt: str | list[int] | dict,
                          params: BeamSearchParams) -> _Request:
        """A beam search, checked and not yet queued; its one RequestOutput holds the beam_width best hypotheses."""
        if not isinstance(params, BeamSearchParams):
            raise TypeError(f"params must be a BeamSearchParams, got {type(params).__name__}")
        self._check_request_id(request_id)
        state = BeamState(params, frozenset(self.eos_token_ids))
        if state.num_candidates > MAX_LOGPROBS:
            raise ValueError(f"beam_width={params.beam_width} needs {state.num_candidates} candidates per beam; "
                             f"at most {MAX_LOGPROBS} are computed")
        if params.beam_width > self.scheduler_config.max_num_seqs:
            raise ValueError(f"beam_width={params.beam_width} exceeds "
                             f"max_num_seqs={self.scheduler_config.max_num_seqs}")
        text, token_ids = self._tokenize(prompt)
        self._check_prompt(token_ids)
        if len(token_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(token_ids)} tokens) + max_tokens={params.max_tokens} exceeds "
                             f"max_model_len={self.max_model_len}")
        # Greedy rows with the top-20 log-probs: the host picks the beams from those.
        sp = SamplingParams(temperature=0.0, max_tokens=None, logprobs=MAX_LOGPROBS, ignore_eos=True)
        parent = Sequence(request_id, token_ids, sp, extra_beams=params.beam_width - 1)
        return _Request(request_id, text, [parent], [], 0, parent.arrival_time, beam=state)

    def add_beam_request(self, request_id: str, prompt: str | list[int] | dict, params: BeamSearchParams) -> None:
        self.enqueue(self.make_beam_request(request_id, prompt, params))

    def enqueue(self, req: _Request) -> None:
        """Queues a request made by `make_request` / `make_beam_request`."""
        self._check_request_id(req.request_id)
        self.requests[req.request_id] = req
        self.scheduler.add(req.seqs[0])

    def _check_request_id(self, request_id: str) -> None:
        if request_id in self.requests:
            raise ValueError(f"request_id {request_id!r} is already in use")

    def _advance_beams(self, req: _Request) -> RequestOutput | None:
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
        outs = [CompletionOutput(i, self.outputs.decode(h.token_ids), h.token_ids, h.cum_logprob, None,
                                 "stop" if h.token_ids[-1] in eos and not req.beam.params.ignore_eos else "length")
                for i, h in enumerate(req.beam.results())]
        self.requests.pop(req.request_id, None)
        self.counters["finished_requests"] += 1
        return RequestOutput(req.request_id, req.prompt, list(old[0].prompt_token_ids), outs, True,
                             old[0].num_cached_prompt_tokens, {"arrival_time": req.arrival_time})

    def _add_forked(self, forked: list[tuple[Sequence, list[Sequence]]]) -> None:
        """The n - 1 other samples the scheduler forked from their parents join their requests' outputs."""
        for parent, children in forked:
            req = self.requests[parent.request_id]
            req.seqs += children
            req.detokenizers += [self.outputs.detokenizer(parent.params) for _ in children]

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise ValueError("the prompt is empty: it must have at least one token")
        vocab = self.model_config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab}); got one outside")
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"the prompt is {len(token_ids)} tokens, longer than the context: max_model_len="
                             f"{self.max_model_len} leaves no room to generate")

    def _tokenize(self, prompt) -> tuple[str | None, list[int]]:
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids"}
            if unknown:
                raise ValueError(f"a dict prompt takes 'prompt' or 'prompt_token_ids'; unknown key(s) "
                                 f"{', '.join(map(repr, sorted(unknown)))}")
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), _token_ids(prompt["prompt_token_ids"], "prompt_token_ids")
            if "prompt" not in prompt:
                raise ValueError("a dict prompt needs 'prompt' or 'prompt_token_ids'")
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise TypeError(f"'prompt' must be a string, got {type(prompt).__name__}")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass {'prompt_token_ids': [...]}")
            return prompt, list(self.tokenizer(prompt)["input_ids"])
        if isinstance(prompt, (list, tuple, np.ndarray)):
            return None, _token_ids(prompt, "prompt")
        raise TypeError(f"a prompt must be a string, a list of token ids or a dict; got {type(prompt).__name__}")

    def abort_request(self, request_id: str) -> None:
        """Stops a request and frees its blocks at once. Unknown or finished ids are ignored."""
        req = self.requests.pop(request_id, None)
        if req is None:
            return
        for seq in req.seqs:
            if not seq.finished:
                self.scheduler.finish(seq, "abort")
        self.counters["aborted_requests"] += 1

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step -----------------------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Schedules and runs one step; returns an output for every request that progressed, finished or failed.

        A failure that can be traced to requests fails those requests only (their output has `error` set) and the
        step goes on for the others: a row the host cannot lay out, a device step whose pool survived (its
        requests), a request whose output processing raised. A device operation that raised after the pool was
        donated leaves no pool: the engine is dead from then on and every call raises EngineDeadError.
        """
        if self.dead is not None:
            raise EngineDeadError(self.dead)
        t_start = time.perf_counter()
        out = self.scheduler.schedule()
        if out is None:
            return []
        self._add_forked(out.forked)
        failed: list[RequestOutput] = []
        with self._device_guard(out, failed):
            self._swap(out.blocks_to_swap_out, out.blocks_to_swap_in)
            self.runner.copy_blocks(out.blocks_to_copy)
        if failed or not out.scheduled:
            return failed
        batch = self._prepare(out, failed)
        if batch is None:
            return failed
        t_device = time.perf_counter()
        with self._device_guard(out, failed):
            result = self.runner.execute(batch)
        if failed:
            return failed
        t_host = time.perf_counter()
        self.scheduler.observe_step(out, t_host - t_device)

        self.counters["steps"] += 1
        self.counters["prefill_steps" if out.is_prefill else "decode_steps"] += 1
        now = time.monotonic()
        touched: dict[str, _Request] = {}
        finished_beams: list[RequestOutput] = []
        for i, sched in enumerate(out.scheduled):
            seq, samples = sched.seq, sched.samples
            if seq.is_prefill:
                self.counters["prompt_tokens"] += sched.num_new_tokens
            seq.num_computed_tokens += sched.num_new_tokens
            req = self.requests.get(seq.request_id)
            if not samples or req is None:  # None: failed earlier in this loop
                continue
            try:
                if req.beam is not None:
                    req.beam_results[seq.seq_id] = list(zip(result["top_ids"][i].tolist(),
                                                            result["top_logprobs"][i].tolist(), strict=True))
                    if len(req.beam_results) == len(req.seqs):
                        done = self._advance_beams(req)
                        finished_beams += [done] if done is not None else []
                    continue
                self._append_token(req, seq, int(result["tokens"][i]), result, i)
            except Exception as e:
                logger.exception("output processing failed for request %s", req.request_id)
                touched.pop(req.request_id, None)
                failed.append(self._fail(req, e, unwritten=False))
                continue
            if seq.first_token_time is None:
                seq.first_token_time = now
            touched[req.request_id] = req
        outputs = [self._output(req) for req in touched.values()
                   if req.finished or req.seqs[0].params.output_kind != RequestOutputKind.FINAL_ONLY]
        # Host time of the step (scheduling, batch building, output processing) and the device step's wall time.
        self.step_times["host_s"] += (t_device - t_start) + (time.perf_counter() - t_host)
        self.step_times["device_s"] += t_host - t_device
        return outputs + finished_beams + failed

    def _prepare(self, out: SchedulerOutput, failed: list[RequestOutput]):
        """The step's device batch. If laying it out raises, the rows that raise on their own are failed (their
        requests) and the batch is built from the rest; None when nothing is left."""
        try:
            return self._prepare_rows(out)
        except Exception as e:
            first_error = e
        culprits: dict[str, Exception] = {}
        for sched in out.scheduled:
            try:
                self._prepare_rows(dataclasses.replace(out, scheduled=[sched]))
            except Exception as e:
                culprits.setdefault(sched.seq.request_id, e)
        if not culprits:  # only the batch as a whole fails: every request in it
            culprits = {s.seq.request_id: first_error for s in out.scheduled}
        for request_id, e in culprits.items():
            logger.error("request %s cannot be laid out for the device: %r", request_id, e)
            failed.append(self._fail(self.requests[request_id], e))
        out.scheduled = [s for s in out.scheduled if s.seq.request_id not in culprits]
        return self._prepare_rows(out) if out.scheduled else None

    def _prepare_rows(self, out: SchedulerOutput):
        tables = [self.block_manager.block_table(s.seq.seq_id) for s in out.scheduled]
        seeds = [self.requests[s.seq.request_id].seed_of(s.seq) for s in out.scheduled]
        banned = [self._banned(s.seq) for s in out.scheduled]
        bitmasks = [self._bitmask(self.requests[s.seq.request_id], s.seq) if s.samples else None
                    for s in out.scheduled]
        return self.runner.prepare(out, tables, seeds, banned, bitmasks)

    def _bitmask(self, req: _Request, seq: Sequence) -> np.ndarray | None:
        """The tokens seq may sample next, [ceil(V / 32)] int32, or None when it may sample any: its grammar's
        allowed tokens, minus its bad words (one-token words always, longer ones when the rest was just generated).
        """
        matcher = req.matcher(seq)
        if matcher is None and not req.bad_words_ids:
            return None
        mask = np.full(bitmask_words(self.model_config.vocab_size), -1, np.int32)
        if matcher is not None:
            fill_bitmask(matcher, mask)
        out = seq.output_token_ids
        ban(mask, [w[-1] for w in req.bad_words_ids
                   if len(w) == 1 or (len(out) >= len(w) - 1 and out[len(out) - len(w) + 1:] == w[:-1])])
        return mask

    @contextlib.contextmanager
    def _device_guard(self, out: SchedulerOutput, failed: list[RequestOutput]):
        """A device operation that raises: with the pool gone, or multi-host, the engine is dead; with the pool
        intact the requests of this step fail (which of them caused it cannot be known) and the engine goes on."""
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
            logger.exception("a device step failed; failing its %d requests", len(out.scheduled))
            for request_id in dict.fromkeys(s.seq.request_id for s in out.scheduled):
                if request_id in self.requests:
                    failed.append(self._fail(self.requests[request_id], e))

    def _fail(self, req: _Request, error: Exception, unwritten: bool = True) -> RequestOutput:
        """Ends a request with an error. unwritten: this step allocated slots its K/V never reached, so the blocks
        it alone holds must not stay in the prefix cache."""
        self.requests.pop(req.request_id, None)
        for seq in req.seqs:
            if not seq.finished:
                if unwritten:
                    self.block_manager.forget_unwritten(seq.seq_id, seq.num_computed_tokens)
                self.scheduler.finish(seq, "error")
        self.counters["failed_requests"] += 1
        message = f"{type(error).__name__}: {error}"
        outs = [CompletionOutput(i, "", list(seq.output_token_ids), None, None, "error")
                for i, seq in enumerate(req.seqs)]
        return RequestOutput(req.request_id, req.prompt, list(req.seqs[0].prompt_token_ids), outs, True,
                             metrics={"arrival_time": req.arrival_time}, error=message)

    def _banned(self, seq: Sequence) -> list[int]:
        """Below min_tokens, EOS and the stop token ids may not be sampled (unless a grammar decides when to end)."""
        p = seq.params
        if len(seq.output_token_ids) >= p.min_tokens or p.structured_outputs is not None:
            return []
        eos = [] if p.ignore_eos else sorted(self.eos_token_ids)
        return eos + p.stop_token_ids

    def _append_token(self, req: _Request, seq: Sequence, token: int, result, row: int) -> None:
        self.counters["generation_tokens"] += 1
        matcher = req.matcher(seq)
        if matcher is not None and not matcher.consume_token(token):
            raise ValueError(f"structured output: the grammar rejects token {token}: {matcher.get_error()}")
        reason, stop_reason = self.outputs.add_token(
            seq, req.detokenizers[req.seqs.index(seq)], token, result, row,
            grammar_stopped=matcher is not None and matcher.is_stopped())  # the grammar allows nothing more
        if reason is not None:
            seq.stop_reason = stop_reason
            req.matchers.pop(seq.seq_id, None)
            self.scheduler.finish(seq, reason)

    def _output(self, req: _Request) -> RequestOutput:
        out = self.outputs.request_output(req.request_id, req.prompt, req.seqs, req.detokenizers, req.sent,
                                          req.arrival_time)
        if out.finished:
            self.requests.pop(req.request_id, None)
            self.counters["finished_requests"] += 1
        return out

    def _swap(self, swap_out: list[tuple[int, int]], swap_in: list[tuple[int, int]]) -> None:
        # Swap-ins first: the scheduler swaps in before it preempts, so a host block a swap-in frees this step may
        # already be the target of this step's swap-out.
        if swap_in:
            k = np.stack([self._host_pool[h][0] for h, _ in swap_in], axis=1)
            v = np.stack([self._host_pool[h][1] for h, _ in swap_in], axis=1)
            self.runner.write_blocks([d for _, d in swap_in], k, v)
            for h, _ in swap_in:
                del self._host_pool[h]
        if swap_out:
            k, v = self.runner.read_blocks([d for d, _ in swap_out])
            for j, (_, h) in enumerate(swap_out):
                self._host_pool[h] = (k[:, j], v[:, j])

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
        """Pool, scheduler and throughput counters (a plain dict, for logs, tests and /metrics)."""
        b = self.block_manager.stats()
        bs = self.cache_config.block_size
        live = [s for s in self.scheduler.running]
        logical_blocks = sum(len(self.block_manager.block_table(s.seq_id)) for s in live)
        slots_allocated = b.num_used * bs  # distinct blocks: a shared block counts once
        tokens_held = sum(min(s.num_computed_tokens, self.block_manager.num_tokens(s.seq_id)) for s in live)
        return {
            **dataclasses.asdict(b),
            "block_size": bs,
            # token slots holding real tokens / slots in allocated blocks (shared tokens count once per holder, so
            # with sharing this can pass 1: the pool holds more tokens than it has slots)
            "kv_utilization": tokens_held / slots_allocated if slots_allocated else 0.0,
            "prefix_cache_hit_rate": b.prefix_cache_hits / b.prefix_cache_queries if b.prefix_cache_queries else 0.0,
            # blocks the running sequences would hold without sharing, minus what the pool holds for them
            "bytes_saved_by_sharing": max(0, logical_blocks - b.num_used) * self.runner.block_bytes,
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_swapped": len(self.scheduler.swapped),
            "preemptions": sum(self.scheduler.num_preemptions.values()),
            "preemptions_recompute": self.scheduler.num_preemptions["recompute"],
            "preemptions_swap": self.scheduler.num_preemptions["swap"],
            **self.counters,
            **self.startup_times,
            **self.step_times,
            **getattr(self.runner, "weight_info", {}),  # quantization, weight_bytes, weight_format(s)
        }


def _token_ids(ids, field: str) -> list[int]:
    """Token ids exactly as given: ints only (no bools, floats or strings, which int() would quietly convert)."""
    if isinstance(ids, np.ndarray):
        if ids.ndim != 1 or not np.issubdtype(ids.dtype, np.integer):
            raise TypeError(f"{field} must be a 1-D array of integers, got {ids.dtype} with shape {ids.shape}")
        return [int(t) for t in ids]
    if not isinstance(ids, (list, tuple)):
        raise TypeError(f"{field} must be a list of token ids, got {type(ids).__name__}")
    for t in ids:
        if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
            raise TypeError(f"{field} must hold integer token ids; got {type(t).__name__} {t!r}")
    return [int(t) for t in ids]


__all__ = ["Engine", "EngineConfig", "EngineDeadError"]
