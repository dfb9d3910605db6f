"""Log-probabilities in OpenAI's two shapes (completions, chat), with token texts from the daemon."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from kvd_client import AsyncClient, TokenLogprob


class TokenTexts:
    """The text of single tokens, asked of the daemon once per token id (the vocabulary never changes)."""

    def __init__(self, client: AsyncClient, model: str | None = None) -> None:
        self.client = client
        self.model = model  # whose vocabulary
        self._texts: dict[int, str] = {}

    async def fill(self, logprobs: Sequence[TokenLogprob | None], token_ids: Sequence[int] = ()) -> None:
        """Ask for the texts of these entries' tokens and alternatives, and of `token_ids`."""
        logprobs = [lp for lp in logprobs if lp is not None]
        wanted = {lp.token_id for lp in logprobs} | {t for lp in logprobs for t, _ in lp.top_logprobs}
        wanted |= set(token_ids)
        missing = sorted(wanted - self._texts.keys())
        texts = await asyncio.gather(*(self.client.detokenize([t], self.model) for t in missing))
        self._texts.update(zip(missing, texts, strict=True))

    def __getitem__(self, token_id: int) -> str:
        return self._texts[token_id]


def completion_logprobs(
    tokens: Sequence[tuple[int, TokenLogprob | None]], texts: TokenTexts, offset: int
) -> dict:
    """/v1/completions: parallel lists over (token id, its entry: None for an echoed prompt's first token);
    `offset` is where the first token starts in the choice's text."""
    strings = [texts[token_id] for token_id, _ in tokens]
    offsets = []
    for token in strings:
        offsets.append(offset)
        offset += len(token)
    return {
        "tokens": strings,
        "token_logprobs": [None if lp is None else lp.logprob for _, lp in tokens],
        "top_logprobs": [
            None if lp is None else {texts[t]: v for t, v in lp.top_logprobs} for _, lp in tokens
        ],
        "text_offset": offsets,
    }


def chat_logprobs(logprobs: Sequence[TokenLogprob], texts: TokenTexts) -> dict:
    """/v1/chat/completions: {"content": [{"token", "logprob", "bytes", "top_logprobs"}]}."""
    return {
        "content": [
            {
                **_entry(texts[lp.token_id], lp.logprob),
                "top_logprobs": [_entry(texts[t], v) for t, v in lp.top_logprobs],
            }
            for lp in logprobs
        ]
    }


def _entry(token: str, logprob: float) -> dict:
    return {"token": token, "logprob": logprob, "bytes": list(token.encode())}
