"""The engine: admits requests, steps the scheduler and model, and samples; the output processor turns each
step's tokens into increments, pool_sizing.py sizes the KV pool."""

from __future__ import annotations

import gc
import itertools
import logging
import time
from collections.abc import Hashable
from dataclasses import asdict, replace
from typing import TYPE_CHECKING

import llguidance
import torch

from kvd.distributed.shard import WHOLE
from kvd.distributed.shm import slot_bytes
from kvd.engine.block_manager import BlockManager, BlockUsage
from kvd.engine.chat_prompt import encode_chat
from kvd.engine.detokenizer import IncrementalDetokenizer
from kvd.engine.engine_args import EngineArgs, EngineArgsError
from kvd.engine.engine_request import EngineRequest
from kvd.engine.errors import RequestRejectedError, RequestTooLongError
from kvd.engine.gpu_memory import DeviceMemory
from kvd.engine.grammar import LIBRARY, GrammarCompiler, GrammarError
from kvd.engine.metrics import EngineMetrics
from kvd.engine.model_runner import ModelRunner
from kvd.engine.output_processor import OutputProcessor
from kvd.engine.outputs import EngineStepOutput, RequestOutput
from kvd.engine.pool_sizing import PoolPlan, plan_pool
from kvd.engine.pooling import EmbeddingState, choose_pooling
from kvd.engine.prompt_logprobs import PromptLogprobs
from kvd.engine.reasoning_gate import ReasoningGate, gate
from kvd.engine.sampler import SamplingRow, sample
from kvd.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from kvd.engine.sequence import Sequence
from kvd.engine.speculative import Speculator
from kvd.engine.state_slots import StateSlots
from kvd.kernels.native_build import native_isa
from kvd.model.config import LINEAR
from kvd.model.decoder import CausalLM
from kvd.model.huge_pages import return_freed_heap
from kvd.model.layers.attention.native_attention import NativeAttentionBackend
from kvd.model.layers.attention.selector import resolve_block_size
from kvd.model.layers.kv_cache import kv_cache_bytes_per_block
from kvd.model.layers.moe import describe_experts
from kvd.parallel.group import fingerprint, weight_bytes
from kvd.request.harmony import HARMONY_MARKERS, HARMONY_REASONING, HarmonyParser, detect_harmony
from kvd.request.reasoning import ReasoningParser, ReasoningRequest, check_reasoning, detect_reasoning
from kvd.request.sampling_params import SamplingParams
from kvd.request.tool_render import detect_tool_template
from kvd.request.tool_validate import Tool

if TYPE_CHECKING:
    from kvd.parallel.launch import TensorParallel
from kvd.model.loader import load_model, preload_tokenizer

logger = logging.getLogger("kvd.engine")


class LLMEngine:
    def __init__(self, args: EngineArgs | None = None, **kwargs: object) -> None:
        self.args = args = args or EngineArgs(**kwargs)
        if args.num_threads is not None:
            torch.set_num_threads(args.num_threads)
        self.device = torch.device(args.device)
        # Tensor parallel: the other ranks start (or are met) first, so that every rank loads its shard at once.
        self.tp = _start_tensor_parallel(args)
        try:
            self._start(args)
        except BaseException:
            self.close()
            raise

    def _start(self, args: EngineArgs) -> None:
        baseline = DeviceMemory.read(self.device) if self.device.type == "cuda" else None
        loaded = load_model(
            args.model,
            dtype=args.dtype,
            device=self.device,
            attention_backend=args.attention_backend,
            quantization=args.quantization,
            batch_invariant=args.batch_invariant,
            shard=self.tp.shard if self.tp else WHOLE,
        )
        self.attention_backend = loaded.model.attention_backend.name
        _check_speculative(args, loaded.model)
        # Unset, the block size is the backend's default (flash-attn reads 256-token pages).
        self.args = args = replace(
            args, block_size=resolve_block_size(self.attention_backend, args.block_size)
        )
        self.model_name = loaded.name
        self.config = loaded.config
        self.tokenizer = loaded.tokenizer
        self.dtype = loaded.dtype
        self.dtype_reason = loaded.dtype_reason
        self.kv_dtype = _kv_dtype(args.kv_cache_dtype, loaded.model, self.dtype)
        self.quantization = loaded.quantization
        self.eos_token_ids = _eos_token_ids(loaded.config, loaded.tokenizer)
        self.grammars = GrammarCompiler(loaded.tokenizer, loaded.config.vocab_size, self.eos_token_ids)
        self.pooling, self.pooling_reason = choose_pooling(args.pooling, loaded.path, loaded.name)
        chat_template = getattr(loaded.tokenizer, "chat_template", None)
        self.tool_template = detect_tool_template(chat_template, loaded.tokenizer)
        # OpenAI's developer role reaches a template without one as system.
        self.developer_role = "developer" in (chat_template or "")
        self.reasoning = detect_reasoning(self.tokenizer, chat_template)
        self.harmony = detect_harmony(self.tokenizer, chat_template)  # gpt-oss's channels
        # Its other special tokens, taken out of a harmony chat's text (which keeps them all when decoded).
        self.harmony_drops = tuple(t for t in self.tokenizer.all_special_tokens if t not in HARMONY_MARKERS)
        self.reads_effort = "reasoning_effort" in (chat_template or "")  # gpt-oss's template does
        max_model_len = self.config.cap_max_model_len(args.max_model_len)
        self.pool = plan_pool(args, loaded.model, self.kv_dtype, self.dtype, max_model_len, baseline)
        self.num_blocks = self.pool.num_blocks
        groups = loaded.model.kv_groups
        pool_tokens = groups.max_tokens(self.num_blocks, args.block_size)
        if pool_tokens < 1:
            raise RequestRejectedError(
                f"the KV pool's {self.num_blocks} blocks do not hold the sliding-window layers' windows; "
                "raise kv_cache_memory",
                "kv_cache_memory",
            )
        self.max_model_len = min(max_model_len, pool_tokens)
        self.block_manager = BlockManager(
            self.num_blocks,
            args.block_size,
            args.enable_prefix_caching,
            group_windows=groups.release_windows,
            states=_state_slots(self.pool, args),
        )
        self.speculator = Speculator(args, self.max_model_len) if args.speculative != "none" else None
        self.scheduler = Scheduler(
            self.block_manager,
            args.max_num_seqs,
            args.max_num_batched_tokens,
            drafter=self._draft if self.speculator else None,
            max_drafting_seqs=args.speculative_max_seqs,
        )
        self.weight_bytes = weight_bytes(loaded.model)
        self.file_types = loaded.file_types
        if self.tp:
            self.tp.finish_startup(
                {
                    "num_blocks": self.num_blocks,
                    "block_size": args.block_size,
                    "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
                    "max_model_len": self.max_model_len,
                    "max_num_seqs": args.max_num_seqs,
                    "fingerprint": fingerprint(loaded.model, self.dtype, self.quantization, self.config),
                },
                slot_bytes(
                    self.config.hidden_size,
                    loaded.model.config.vocab_size,
                    args.max_num_batched_tokens,
                    args.max_num_seqs,
                ),
            )
        self.runner = ModelRunner(
            loaded.model,
            loaded.model.config,  # this rank's slice: its KV heads in its pool
            self.num_blocks,
            args.block_size,
            self.kv_dtype,
            self.device,
            max_num_seqs=args.max_num_seqs,
            max_model_len=self.max_model_len,
            enforce_eager=args.enforce_eager,
            channel=self.tp.channel if self.tp else None,
            num_state_slots=self.pool.num_live_states + self.pool.num_checkpoints,
            state_dtype=self.dtype,
        )
        self.kv_cache_bytes = self.runner.pool_bytes()
        self.metrics = EngineMetrics()
        self.output_processor = OutputProcessor(self.scheduler, self.eos_token_ids, self.max_model_len)
        self.requests: dict[Hashable, EngineRequest] = {}
        self._by_seq_id: dict[int, EngineRequest] = {}
        logger.info(
            "KV pool: %d blocks x %d tokens in %d group(s) (%.0f MiB, %s); max_model_len %d; %s attention",
            self.num_blocks,
            args.block_size,
            groups.num_groups,
            self.num_blocks
            * kv_cache_bytes_per_block(loaded.model.config, args.block_size, self.kv_dtype)
            / 2**20,
            self.kv_dtype,
            self.max_model_len,
            self.attention_backend,
        )

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer(prompt)["input_ids"]
        return list(prompt)

    def apply_chat_template(
        self, messages: list[dict], tools: list[Tool] | None = None, reasoning: ReasoningRequest | None = None
    ) -> list[int]:
        """The prompt of a conversation: tools rendered by the model's template, or by kvd's own tool prompt
        when the template has none (kvd.request.tool_render); earlier calls and results included. Only the template
        writes control tokens: a special token's text in the client's messages or tools is tokenized as plain
        text, so a message cannot forge a turn boundary (kvd.engine.chat_prompt). `reasoning`'s think and effort
        go to the template as its variables."""
        kwargs = reasoning.template_kwargs() if reasoning is not None else {}
        return encode_chat(
            self.tokenizer, messages, tools or [], self.tool_template, self.developer_role, kwargs
        )

    def check_reasoning(self, request: ReasoningRequest) -> None:
        """ReasoningError if this model cannot do what a chat asks of its reasoning."""
        check_reasoning(request, self.reasoning, self.reads_effort, always_reasons=self.harmony)

    def chat_params(self, params: SamplingParams) -> SamplingParams:
        """A chat's sampling parameters on this model: a harmony chat's text keeps its markers (its parser's)."""
        return replace(params, skip_special_tokens=False) if self.harmony else params

    def chat_parser(
        self, prompt_ids: list[int], calls: frozenset[str]
    ) -> ReasoningParser | HarmonyParser | None:
        """What splits a chat's output into its reasoning and its answer on this model (None: it does not reason);
        `calls`: the names of the chat's tools whose calls the answer's parser reads."""
        if self.harmony:
            return HarmonyParser(calls, self.harmony_drops)
        if self.reasoning is not None:
            return ReasoningParser(self.reasoning, self.reasoning.opened_by(prompt_ids))
        return None

    def chat_constraint(
        self, matcher: llguidance.LLMatcher | None, prompt_ids: list[int], reasoning: ReasoningRequest
    ) -> ReasoningGate | llguidance.LLMatcher | None:
        """A chat's constraint on this model: where it may reason first, its grammar (`matcher`) holds for the
        answer after the thinking section, and the section keeps to the request's budget (kvd.engine.reasoning_gate)."""
        return gate(self.reasoning, prompt_ids, reasoning.token_budget, matcher, sorted(self.eos_token_ids))

    def add_request(
        self,
        request_id: Hashable,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        cache_salt: str | None = None,
        matcher: llguidance.LLMatcher | None = None,
    ) -> None:
        """Queue a generation. `matcher`: the request's grammar compiled already (`grammars.matcher(params)`,
        as the daemon does off its loop); otherwise it is compiled here."""
        self._check_new_id(request_id)
        params = params or SamplingParams()
        token_ids = self.encode(prompt)
        self._check_prompt(token_ids)
        self.check_params(params)
        if matcher is None:
            matcher = self.compile_grammar(params)
        seq = Sequence(
            token_ids, self.args.block_size, cache_salt, reads_prefix_cache=params.prompt_logprobs is None
        )
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed)
        detok = IncrementalDetokenizer(self.tokenizer, token_ids, params.stop, params.skip_special_tokens)
        request = EngineRequest(request_id, seq, params, detok, generator, matcher=matcher)
        if self.speculator and params.speculative:
            self.speculator.start(request)
        if params.prompt_logprobs is not None:
            request.prompt_logprobs = PromptLogprobs(params.prompt_logprobs, token_ids)
        self._queue(request)

    def add_embed_request(
        self, request_id: Hashable, prompt: str | list[int], cache_salt: str | None = None
    ) -> None:
        """Queue an embedding: the prompt is computed (never read from the prefix cache) and pooled into one
        vector, the `embedding` of the request's only output."""
        self._check_new_id(request_id)
        token_ids = self.encode(prompt)
        self._check_prompt(token_ids)
        seq = Sequence(token_ids, self.args.block_size, cache_salt, reads_prefix_cache=False)
        request = EngineRequest(request_id, seq, SamplingParams(max_tokens=1), None, None)
        request.embedding = EmbeddingState(self.pooling)
        self._queue(request)

    def compile_grammar(
        self, params: SamplingParams, namespace: str = "", chat: bool = False
    ) -> llguidance.LLMatcher | None:
        """A fresh matcher for the request's structured-output field (None without one); thread-safe.
        `namespace`: whose grammar cache (GrammarCompiler.matcher). In a harmony model's `chat` a JSON answer
        is its final message, after any analysis."""
        try:
            return self.grammars.matcher(params, namespace, harmony=chat and self.harmony)
        except GrammarError as e:
            raise RequestRejectedError(str(e), e.field) from None

    def check_params(self, params: SamplingParams) -> None:
        """The fields again (they may have changed since construction), and what SamplingParams cannot check
        alone: token ids against this model's vocabulary."""
        if not isinstance(params, SamplingParams):
            raise TypeError(f"params must be a kvd.SamplingParams, got {type(params).__name__}")
        params.validate()
        vocab = self.config.vocab_size
        for name, ids in (("logit_bias", params.logit_bias), ("stop_token_ids", params.stop_token_ids)):
            if any(t >= vocab for t in ids):
                raise RequestRejectedError(f"{name}: token ids must lie in [0, {vocab})", name)

    def _check_new_id(self, request_id: Hashable) -> None:
        if request_id in self.requests:
            raise RequestRejectedError(f"request id {request_id!r} is already in flight; use a new id")

    def _queue(self, request: EngineRequest) -> None:
        self.requests[request.request_id] = request
        self._by_seq_id[request.seq.seq_id] = request
        self.scheduler.add(request.seq)

    def _check_prompt(self, token_ids: list[int]) -> None:
        if not token_ids:
            raise RequestRejectedError("the prompt is empty: give at least one token")
        if len(token_ids) >= self.max_model_len:
            raise RequestTooLongError(
                f"the prompt has {len(token_ids)} tokens but max_model_len is {self.max_model_len} "
                "(prompt plus at least one generated token); shorten the prompt"
            )
        vocab = self.config.vocab_size
        if min(token_ids) < 0 or max(token_ids) >= vocab:
            raise RequestRejectedError(f"prompt token ids must lie in [0, {vocab})")

    def check_workers(self) -> None:
        """Raise TensorParallelError if another rank died or stopped answering; a no-op without them."""
        if self.tp:
            self.tp.check()

    def close(self) -> None:
        """Stop the other tensor-parallel ranks (a no-op without them); the engine cannot step afterwards."""
        tp, self.tp = getattr(self, "tp", None), None
        if tp:
            tp.close()

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def abort(self, request_id: Hashable) -> bool:
        """Drop a request in any state and free its blocks at once; False if it is unknown or finished."""
        request = self.requests.get(request_id)
        if request is None:
            return False
        self.output_processor.release(request)
        self._forget(request_id)
        return True

    def step(self) -> EngineStepOutput:
        """Schedule, run and sample one batch; what it produced, and which requests it preempted."""
        started = time.perf_counter()
        out = self.scheduler.schedule()
        preempted = [self._by_seq_id[s.seq_id].request_id for s in out.preempted]
        prefill_tokens = sum(c.num_new_tokens for c in out.chunks if c.seq.is_prefilling)
        processor = self.output_processor
        outputs = [processor.finish(self._by_seq_id[s.seq_id], "length") for s in out.out_of_memory]
        forward_s, num_sampled = 0.0, 0
        if out.chunks:
            forward_started = time.perf_counter()
            hidden, starts = self.runner.run(out.chunks)
            requests, rows, drafts, embedded = [], [], [], []
            for chunk, start in zip(out.chunks, starts, strict=True):
                request = self._by_seq_id[chunk.seq.seq_id]
                self._take_prompt_outputs(request, chunk, hidden, start)
                if chunk.samples and request.embedding is not None:
                    embedded.append(request)
                elif chunk.samples:
                    requests.append(request)
                    first = start + chunk.num_new_tokens - 1
                    rows.extend(range(first, first + 1 + len(chunk.draft)))
                    drafts.append(chunk.draft)
            logits = self.runner.logits(hidden, rows)
            forward_s = time.perf_counter() - forward_started
            sampled, num_sampled = self._sample(out, requests, drafts, logits)
            outputs.extend(sampled)
            outputs.extend(processor.on_embedded(r) for r in embedded)
        for output in outputs:
            if output.finished:  # its sequence is released already: only the engine's records of it remain
                self._forget(output.request_id)
        self.metrics.record_step(
            num_prefill_tokens=prefill_tokens,
            num_generated=num_sampled,  # sampled this step (stop strings may hold some back from outputs)
            step_s=time.perf_counter() - started,
            forward_s=forward_s,
        )
        return EngineStepOutput(outputs, preempted)

    def _sample(
        self,
        out: SchedulerOutput,
        requests: list[EngineRequest],
        drafts: list[list[int]],
        logits: torch.Tensor,
    ) -> tuple[list[RequestOutput], int]:
        """Each request's tokens of this step, one increment per request, and the number sampled.

        The rows are sampled position by position, as plain decoding samples them step by step (see
        kvd.engine.speculative): first every request's next token, then, for each whose draft's next token it
        was, the token after it from the row that token fed, and so on."""
        if not requests:
            self.scheduler.postprocess(out, {})
            return [], 0
        processor = self.output_processor
        accepted = [0] * len(requests)
        firsts = list(itertools.accumulate((1 + len(d) for d in drafts), initial=0))[:-1]
        tokens = sample(
            logits if len(firsts) == logits.shape[0] else logits[firsts],
            [self._sampling_row(r) for r in requests],
        )
        self.scheduler.postprocess(
            out, {r.seq.seq_id: t.token_id for r, t in zip(requests, tokens, strict=True)}
        )
        outputs = [processor.on_token(r, t) for r, t in zip(requests, tokens, strict=True)]
        num_sampled, depth = len(tokens), 1
        live = [i for i, t in enumerate(tokens) if _continues(outputs[i], drafts[i], 0, t.token_id)]
        while live:
            rows = [firsts[i] + depth for i in live]
            tokens = sample(logits[rows], [self._sampling_row(requests[i]) for i in live])
            num_sampled += len(tokens)
            for i, token in zip(live, tokens, strict=True):
                self.scheduler.accept_draft_token(requests[i].seq, token.token_id)
                accepted[i] += 1
                outputs[i] = outputs[i].then(processor.on_token(requests[i], token))
            live = [
                i
                for i, t in zip(live, tokens, strict=True)
                if _continues(outputs[i], drafts[i], depth, t.token_id)
            ]
            depth += 1
        for request, draft, output, n in zip(requests, drafts, outputs, accepted, strict=True):
            if draft:
                self.speculator.record(request, len(draft), n)
                output.num_draft_tokens = request.num_draft_tokens
                output.num_accepted_tokens = request.num_accepted_tokens
                if not output.finished:
                    self.scheduler.settle_draft(request.seq)
        return outputs, num_sampled

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    def kv_usage(self) -> BlockUsage:
        return self.block_manager.usage()

    def num_blocks_allocated(self, request_id: Hashable) -> int:
        """KV blocks the request holds right now; 0 if unknown or waiting."""
        request = self.requests.get(request_id)
        if request is None:
            return 0
        return sum(
            len(t) - n for t, n in zip(request.seq.block_tables, request.seq.num_released, strict=True)
        )

    def decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids)

    def _speculative_info(self) -> dict | None:
        args = self.args
        if self.speculator is None:
            return None
        return {
            "method": args.speculative,
            "tokens": args.speculative_tokens,
            "ngram_min": args.ngram_min,
            "ngram_max": args.ngram_max,
            "max_seqs": args.speculative_max_seqs,
        }

    def _draft(self, seq: Sequence, most: int) -> list[int]:
        """The scheduler's drafter: the speculator's draft for the request of `seq`."""
        return self.speculator.draft(self._by_seq_id[seq.seq_id], most)

    def _sampling_row(self, request: EngineRequest) -> SamplingRow:
        seq = request.seq
        return SamplingRow(
            request.params, request.generator, seq.token_ids, seq.num_prompt_tokens, request.matcher
        )

    def _take_prompt_outputs(
        self, request: EngineRequest, chunk: ScheduledChunk, hidden: torch.Tensor, start: int
    ) -> None:
        """What a prompt chunk yields besides K/V: prompt logprobs and an embedding's hidden states."""
        begin = chunk.seq.num_computed_tokens
        if request.prompt_logprobs is not None:
            wanted = request.prompt_logprobs.positions_wanted(begin, begin + chunk.num_new_tokens)
            rows = [start + p - begin for p in wanted]
            # A slice of rows at a time: a whole chunk's logits (up to max_num_batched_tokens x vocab floats,
            # gigabytes on a large vocabulary) would sit outside the memory profile, which covers the
            # sampler's max_num_seqs rows of logits and their log-softmax.
            size = self.args.max_num_seqs
            for i in range(0, len(rows), size):
                request.prompt_logprobs.add(wanted.start + i, self.runner.logits(hidden, rows[i : i + size]))
        if request.embedding is not None:
            last = start + chunk.num_new_tokens
            first = start if request.embedding.pooling == "mean" else last - 1
            request.embedding.add(begin, hidden[first:last])

    def _forget(self, request_id: Hashable) -> None:
        request = self.requests.pop(request_id)
        del self._by_seq_id[request.seq.seq_id]

    def stats(self) -> dict:
        usage = self.block_manager.usage()
        cache = self.block_manager.prefix_cache_stats()
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "num_preemptions": self.scheduler.num_preemptions,
            "kv_cache": asdict(usage) | {"total_blocks": self.num_blocks},
            "prefix_cache": vars(cache),
            "speculative": self.speculator.counts.summary() if self.speculator else None,
            **self.metrics.summary(),
        }

    def _recurrent_info(self) -> dict | None:
        """A linear-attention model's state slots: how many sequences hold one at once, and their bytes."""
        pool, states = self.pool, self.block_manager.states
        if states is None:
            return None
        return {
            "linear_layers": self.config.layer_types.count(LINEAR),
            "slots": pool.num_live_states,
            "checkpoints": pool.num_checkpoints,
            "checkpoints_held": states.num_held,
            "checkpoint_interval_tokens": states.interval,
            "bytes_per_slot": pool.state_bytes,
            "bytes": pool.state_bytes * (pool.num_live_states + pool.num_checkpoints),
        }

    def info(self) -> dict:
        return {
            "model": self.model_name,
            "dtype": str(self.dtype).removeprefix("torch."),
            "dtype_reason": self.dtype_reason,
            "kv_cache_dtype": str(self.kv_dtype).removeprefix("torch."),
            "quantization": self.quantization,
            "batch_invariant": self.args.batch_invariant,
            "cpu_kernels": native_isa(),
            "device": str(self.device),
            "max_model_len": self.max_model_len,
            "block_size": self.args.block_size,
            "attention_backend": self.attention_backend,
            "num_blocks": self.num_blocks,
            "kv_groups": self.runner.model.kv_groups.describe(),
            "max_num_seqs": self.args.max_num_seqs,
            "max_num_batched_tokens": self.args.max_num_batched_tokens,
            "speculative": self._speculative_info(),
            "vocab_size": self.config.vocab_size,
            "hidden_size": self.config.hidden_size,
            "pooling": self.pooling,
            "pooling_reason": self.pooling_reason,
            "structured_output": LIBRARY,
            "reasoning": HARMONY_REASONING if self.harmony else self.reasoning and self.reasoning.info(),
            "tools": {
                "format": self.tool_template.format.value,
                "template": "model" if self.tool_template.native else "kvd",
            },
            "threads": torch.get_num_threads(),
            "weight_bytes": self.weight_bytes,
            "kv_cache_bytes": self.kv_cache_bytes,  # the pool and any recurrent state slots
            "experts": describe_experts(self.runner.model, self.weight_bytes),
            "recurrent_state": self._recurrent_info(),
            "file_types": {name: {"tensors": n, "bytes": b} for name, (n, b) in self.file_types.items()},
            "tensor_parallel": self.tp.info(torch.get_num_threads(), self.weight_bytes) if self.tp else None,
        }


def _continues(output: RequestOutput, draft: list[int], depth: int, token: int) -> bool:
    """The row after `depth` stands: the request goes on and the token sampled at `depth` is the draft's."""
    return not output.finished and depth < len(draft) and draft[depth] == token


def release_memory() -> None:
    """After an engine is dropped: its tensors freed now (not at some later collection) and the heap's free
    pages handed back to the system, so that an unloaded model's memory shows as free."""
    gc.collect()
    return_freed_heap()


def read_tokenizer_ahead(model: str | None) -> None:
    """Parse a model's tokenizer now, for an engine of it later (a daemon's model loaded on demand: the parse holds
    the interpreter's lock, which the daemon's streams need)."""
    preload_tokenizer(model)


def _state_slots(pool: PoolPlan, args: EngineArgs) -> StateSlots | None:
    """A linear-attention model's state slots for the block manager, checkpoints every interval's blocks."""
    if not pool.num_live_states:
        return None
    interval = args.state_checkpoint_interval * args.block_size
    return StateSlots(pool.num_live_states, pool.num_checkpoints, interval)


def _check_speculative(args: EngineArgs, model: CausalLM) -> None:
    """Drafts leave every output the same bits only where a row's logits do not depend on the rows beside it."""
    backend = model.attention_backend
    if args.speculative != "none" and not (
        isinstance(backend, NativeAttentionBackend) and backend.batch_invariant
    ):
        raise EngineArgsError(
            "speculative decoding keeps every output the same bits only where batch invariance holds, with the "
            f"native CPU attention (this engine runs {backend.name} attention): use --speculative none, or "
            "attention_backend native on a CPU with a C compiler"
        )


def _kv_dtype(setting: str, model: CausalLM, dtype: torch.dtype) -> torch.dtype:
    """The pool's element type; an 8-bit pool only where the native attention reads every query of it."""
    if setting == "auto":
        return dtype
    backend = model.attention_backend
    if not isinstance(backend, NativeAttentionBackend):
        raise EngineArgsError(
            f"kv_cache_dtype int8 needs the native CPU attention (this engine runs {backend.name} attention): "
            "use kv_cache_dtype auto, or attention_backend native on a CPU with a C compiler"
        )
    if not backend.batch_invariant:
        raise EngineArgsError(
            "kv_cache_dtype int8 needs batch invariance on (its attention reads the pool one query at a time): "
            "drop --no-batch-invariance, or use kv_cache_dtype auto"
        )
    return torch.int8


def _start_tensor_parallel(args: EngineArgs) -> TensorParallel | None:
    if args.tensor_parallel_size == 1:
        return None
    from kvd.parallel.launch import TensorParallel

    return TensorParallel.start(args)


def _eos_token_ids(config: object, tokenizer: object) -> set[int]:
    ids: set[int] = set()
    # Every id the config lists (ModelConfig.eos_token_id is the first alone: Gemma's <end_of_turn> and gpt-oss's
    # <|call|> come after it), and the tokenizer's.
    for value in (getattr(config, "eos_token_ids", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list | tuple):
            ids.update(v for v in value if isinstance(v, int))
    return ids
