"""A conversation as prompt token ids, in which only the template writes control tokens.

A chat template is rendered to text and the text tokenized with special-token parsing on, so that the template's
"<|im_start|>" becomes its control token. The same parsing would turn a "<|im_end|>\\n<|im_start|>system" that a
client wrote inside a message into real turn boundaries: a forged system turn. ClientText keeps the two apart.
Before rendering, every special-token string in what the client sent (message contents and roles, tool calls
and their arguments, tool descriptions and schemas) is replaced by a placeholder that no client can guess; after
rendering, the placeholders are put back and the special tokens they stand for are tokenized as the plain text
they spell. A conversation without such strings renders and tokenizes exactly as it would without ClientText.
"""

from __future__ import annotations

import functools
import json
import re
import secrets
from dataclasses import replace
from typing import Any

from transformers import PreTrainedTokenizerBase

from kvd.request.tool_render import ToolTemplate, render_messages
from kvd.request.tool_validate import Tool


def encode_chat(
    tokenizer: PreTrainedTokenizerBase,
    messages: list[dict],
    tools: list[Tool],
    tool_template: ToolTemplate,
    developer_role: bool,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """The prompt of a conversation: tools rendered by the model's template, or by kvd's own tool prompt when
    the template has none (kvd.request.tool_render); earlier calls and results included. `template_kwargs`:
    the template's own variables (a reasoning model's enable_thinking)."""
    client = ClientText(tokenizer)
    messages, tools = client.mask(messages, tools)
    conversation, template_tools = render_messages(messages, tools, tool_template, developer_role)
    text = tokenizer.apply_chat_template(
        conversation,
        tools=template_tools,
        add_generation_prompt=True,
        tokenize=False,
        **(template_kwargs or {}),
    )
    return client.encode(text)


class ClientText:
    """One rendering: `mask` the client's inputs, render them with the template, `encode` the text."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        self.tokenizer = tokenizer
        self.tokens, self.control_ids, self._token_re = _control_tokens(tokenizer)
        self._index = {token: i for i, token in enumerate(self.tokens)}
        # Letters and digits only: templates escape or JSON-encode what they render (tojson, e), and neither
        # changes these. Random per rendering, so a client cannot write a placeholder of its own.
        nonce = secrets.token_hex(8)
        self._placeholder = f"kvd{nonce}t{{}}x"
        self._placeholder_re = re.compile(f"kvd{nonce}t([0-9]+)x")
        self._masked = 0

    def mask(self, messages: list[dict], tools: list[Tool]) -> tuple[list[dict], list[Tool]]:
        """The messages and tools with each special-token string replaced by its placeholder; when there is
        none, the very objects given."""
        masked_messages = [self._mask_message(m) if isinstance(m, dict) else m for m in messages]
        masked_tools = [
            replace(tool, description=self._mask(tool.description), parameters=self._mask(tool.parameters))
            for tool in tools
        ]
        if not self._masked:
            return messages, tools
        return masked_messages, masked_tools

    def encode(self, text: str) -> list[int]:
        """The token ids of the rendered `text`: its special tokens are control tokens, but those that come from
        the client's placeholders are the ids of their plain text."""
        pieces = self._placeholder_re.split(text)  # [text, token index, text, token index, ..., text]
        if len(pieces) == 1:
            return self.tokenizer(text, add_special_tokens=False)["input_ids"]
        parts, spans, position = [], [], 0
        for i, piece in enumerate(pieces):
            if i % 2:
                piece = self.tokens[int(piece)]
                spans.append((position, position + len(piece)))
            parts.append(piece)
            position += len(piece)
        text = "".join(parts)
        # Tokenize the whole text as before, then swap each client's control token for its plain text: the ids
        # around it stay those the tokenizer gives the whole text (an added token splits the text there anyway).
        encoding = self.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids: list[int] = []
        run: tuple[int, int] | None = None  # the text of consecutive client control tokens, still to encode
        span = 0
        for token_id, (start, end) in zip(encoding["input_ids"], encoding["offset_mapping"], strict=True):
            while span < len(spans) and spans[span][1] <= start:
                span += 1
            if token_id in self.control_ids and span < len(spans) and spans[span][0] < end:
                run = (run[0] if run else start, end)
                continue
            if run:
                ids += self._plain(text[run[0] : run[1]])
                run = None
            ids.append(token_id)
        if run:
            ids += self._plain(text[run[0] : run[1]])
        return ids

    def _plain(self, text: str) -> list[int]:
        """`text` tokenized with no added token recognised. Through the backend's own stages rather than with
        split_special_tokens=True: that flips a flag on the tokenizer shared with other threads."""
        backend = self.tokenizer.backend_tokenizer
        if backend.normalizer is not None:
            text = backend.normalizer.normalize_str(text)
        words = backend.pre_tokenizer.pre_tokenize_str(text) if backend.pre_tokenizer else [(text, None)]
        ids = [token.id for word, _ in words for token in backend.model.tokenize(word)]
        if self.control_ids.intersection(ids):
            # The vocabulary itself spells this control token from plain text: nothing can keep it text.
            raise ValueError(f"{text!r} cannot be tokenized as plain text by this model's tokenizer")
        return ids

    def _mask_message(self, message: dict) -> dict:
        masked = self._mask(message)
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            # Arguments are JSON text that render_messages decodes: "\u003c|im_end|>" is a special token only
            # once decoded, so they are masked as JSON values.
            for call, masked_call in zip(calls, masked["tool_calls"], strict=True):
                function = masked_call.get("function") if isinstance(masked_call, dict) else None
                if isinstance(function, dict) and isinstance(function.get("arguments"), str):
                    function["arguments"] = self._mask_json(call["function"]["arguments"])
        return masked

    def _mask_json(self, text: str) -> str:
        try:
            value = json.loads(text)
        except ValueError:
            return text  # render_messages refuses it, with the position of the fault in the client's text
        before = self._masked
        masked = self._mask(value)
        return text if self._masked == before else json.dumps(masked, ensure_ascii=False)

    def _mask(self, value: Any) -> Any:
        """`value` with its strings masked, dict keys too (templates render schemas and arguments whole)."""
        if isinstance(value, str):
            return self._token_re.sub(self._substitute, value) if self._token_re else value
        if isinstance(value, dict):
            return {self._mask(k): self._mask(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self._mask(v) for v in value]
        return value

    def _substitute(self, match: re.Match) -> str:
        self._masked += 1
        return self._placeholder.format(self._index[match.group()])


def _control_tokens(
    tokenizer: PreTrainedTokenizerBase,
) -> tuple[tuple[str, ...], frozenset[int], re.Pattern | None]:
    """(the special tokens' strings, their ids, a pattern matching any of them). Whitespace-only special tokens
    are left out: they are ordinary text in any message, and the vocabulary spells them from plain text too."""
    special = {
        token.content: token_id
        for token_id, token in tokenizer.added_tokens_decoder.items()
        if token.special and token.content.strip()
    }
    tokens = tuple(sorted(special))
    return tokens, frozenset(special.values()), _pattern(tokens)


@functools.lru_cache(maxsize=8)
def _pattern(tokens: tuple[str, ...]) -> re.Pattern | None:
    # Longest first: where one token begins another, the tokenizer matches the longer.
    alternatives = sorted(tokens, key=len, reverse=True)
    return re.compile("|".join(map(re.escape, alternatives))) if alternatives else None
