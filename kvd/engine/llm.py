"""The embeddable offline API: `kvd.LLM(model).generate(prompts, params)`."""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace

from tqdm.auto import tqdm

from kvd.engine.engine_args import EngineArgs
from kvd.engine.llm_engine import LLMEngine
from kvd.engine.outputs import CompletionOutput, RequestOutput
from kvd.request.reasoning import parse_reasoning
from kvd.request.sampling_params import SamplingParams
from kvd.request.tool_grammar import tool_call_grammar
from kvd.request.tool_parse import ToolCallParser
from kvd.request.tool_validate import Tool, check_history, parse_tool_choice, parse_tools

Prompt = str | list[int]
Conversation = list[dict[str, str]]


class LLM:
    def __init__(self, model: str | None = None, **engine_args: object) -> None:
        self.engine = LLMEngine(EngineArgs(model=model, **engine_args))
        self._ids = itertools.count()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[CompletionOutput]:
        """Complete every prompt; results come back in the prompts' order."""
        return self._complete(_as_list(prompts), params, use_tqdm)

    def _complete(
        self,
        prompts: list[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        use_tqdm: bool,
        constraints: list | None = None,
    ) -> list[CompletionOutput]:
        results = {i: CompletionOutput(prompt=p) for i, p in enumerate(prompts)}
        ids = self._submit(prompts, params, constraints)
        index = {rid: i for i, rid in enumerate(ids)}
        with tqdm(total=len(prompts), desc="generate", unit="req", disable=not use_tqdm) as bar:
            started = time.perf_counter()
            generated = 0
            for out in self._drain():
                results[index[out.request_id]].add(out)
                generated += len(out.new_token_ids)
                if out.finished:
                    bar.update(1)
                    bar.set_postfix_str(f"{generated / (time.perf_counter() - started):.0f} tok/s")
        return [results[i] for i in range(len(prompts))]

    def chat(
        self,
        conversations: Conversation | Sequence[Conversation],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        tools: list[dict] | list[Tool] | None = None,
        tool_choice: str | dict | None = None,
        parallel_tool_calls: bool = True,
        think: bool | None = None,
        reasoning_effort: str | None = None,
        reasoning_budget: int | None = None,
    ) -> list[CompletionOutput]:
        """Apply the tokenizer's chat template to each conversation and generate the assistant's reply.

        `tools` (OpenAI's form, [{"type": "function", "function": {...}}]), `tool_choice` and
        `parallel_tool_calls` as in the protocol's chat: each output's calls are in its `tool_calls`, their text
        is not in `text`, and "required" or a named function is enforced by a grammar. A reasoning model's
        thinking section is in `reasoning`, not in `text`; `think`, `reasoning_effort` and `reasoning_budget`
        as in the protocol's chat (a grammar holds for the answer after the section)."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        if tools and not isinstance(tools[0], Tool):
            tools = parse_tools(tools)
        tools = tools or []
        choice = parse_tool_choice(tool_choice, tools)
        reasoning = parse_reasoning(think, reasoning_effort, reasoning_budget)
        self.engine.check_reasoning(reasoning)
        for conversation in conversations:
            check_history(list(conversation))
        prompts = [self.engine.apply_chat_template(list(c), tools or None, reasoning) for c in conversations]
        parsed = (
            bool(tools) and choice.mode != "none"
        )  # as the daemon: nothing is parsed without tools to call
        grammar = (
            tool_call_grammar(tools, choice, self.engine.tool_template, parallel_tool_calls)
            if parsed
            else None
        )
        params = [self.engine.chat_params(p) for p in _per_prompt(params, len(prompts))]
        if grammar is not None:
            params = [replace(p, grammar=grammar) for p in params]
        constraints = [
            self.engine.chat_constraint(self.engine.compile_grammar(p, chat=True), ids, reasoning)
            for p, ids in zip(params, prompts, strict=True)
        ]
        outputs = self._complete(prompts, params, use_tqdm, constraints)
        for out, ids in zip(outputs, prompts, strict=True):
            parser = self.engine.chat_parser(ids, frozenset(t.name for t in tools if parsed))
            if parser is not None:
                thought, answer = parser.feed(out.text)
                last, rest = parser.finish()
                out.reasoning, out.text = thought + last, answer + rest
            if parsed:
                tool_parser = ToolCallParser(self.engine.tool_template, tools, grammar is not None)
                content = tool_parser.feed(out.text)
                rest, out.tool_calls, out.finish_reason = tool_parser.finish(out.finish_reason)
                out.text = content + rest
        return outputs

    def embed(self, inputs: Prompt | Sequence[Prompt], use_tqdm: bool = True) -> list[list[float]]:
        """One L2-normalised vector per input (text or token ids): the pooled final hidden states
        (`engine.pooling`); batched like generations, never read from the prefix cache."""
        inputs = _as_list(inputs)
        ids = []
        try:
            for prompt in inputs:
                rid = next(self._ids)
                self.engine.add_embed_request(rid, prompt)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        index = {rid: i for i, rid in enumerate(ids)}
        vectors: list[list[float]] = [[] for _ in inputs]
        with tqdm(total=len(inputs), desc="embed", unit="input", disable=not use_tqdm) as bar:
            for out in self._drain():
                vectors[index[out.request_id]] = out.embedding
                bar.update(1)
        return vectors

    def stream(
        self,
        prompts: Prompt | Sequence[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> Iterator[tuple[int, RequestOutput]]:
        """Yield (prompt index, increment) as tokens are produced; abandoning the iterator aborts what is left."""
        ids = self._submit(_as_list(prompts), params)
        index = {rid: i for i, rid in enumerate(ids)}
        try:
            for out in self._drain():
                yield index[out.request_id], out
        finally:
            for rid in ids:
                self.engine.abort(rid)

    def _submit(
        self,
        prompts: list[Prompt],
        params: SamplingParams | Sequence[SamplingParams] | None,
        constraints: list | None = None,
    ) -> list[int]:
        """Queue each prompt; `constraints`: each one's compiled grammar or reasoning gate (else compiled here)."""
        params = _per_prompt(params, len(prompts))
        ids = []
        try:
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True)):
                rid = next(self._ids)
                self.engine.add_request(rid, prompt, p, matcher=constraints[i] if constraints else None)
                ids.append(rid)
        except Exception:
            for rid in ids:
                self.engine.abort(rid)
            raise
        return ids

    def _drain(self) -> Iterator[RequestOutput]:
        while self.engine.has_unfinished():
            yield from self.engine.step().outputs


def _per_prompt(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
    """One SamplingParams for each of n prompts: the one given (or the defaults) for all, or one each."""
    if params is None or isinstance(params, SamplingParams):
        return [params or SamplingParams()] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; give one or one each")
    return list(params)


def _as_list(prompts: Prompt | Sequence[Prompt]) -> list[Prompt]:
    """One prompt (a text, or one sequence of token ids) or a sequence of them, as a list of prompts."""
    if isinstance(prompts, str):
        return [prompts]
    prompts = list(prompts)
    if prompts and isinstance(prompts[0], int):
        return [prompts]
    return [p if isinstance(p, str) else list(p) for p in prompts]
