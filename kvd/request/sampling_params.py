"""Per-request sampling parameters, validated at construction with errors that name the field at fault."""

from __future__ import annotations

from dataclasses import dataclass, field

MAX_SEED = 2**63 - 1
MAX_LOGPROBS = 20
MAX_LOGIT_BIAS = 512  # entries; OpenAI's own limit is lower
LOGIT_BIAS_RANGE = 100.0
# The structured-output fields: at most one per request (docs/protocol.md, Structured output).
STRUCTURED_FIELDS = ("json_schema", "json_object", "regex", "grammar")
# Below this temperature a request samples greedily: dividing logits by a smaller one overflows float32 to inf,
# and the softmax of that is NaN, not the one-hot distribution the limit tends to.
GREEDY_TEMPERATURE = 1e-5
# A repetition penalty multiplies or divides logits; outside this range it overflows or erases them.
MIN_REPETITION_PENALTY = 0.01


class SamplingParamsError(ValueError):
    """A sampling parameter is out of range or of the wrong type; `field` names it."""

    def __init__(self, field_name: str, message: str) -> None:
        super().__init__(f"{field_name}: {message}")
        self.field = field_name


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled (-1, vLLM's word for it, is taken as 0)
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int = 16
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # number of top alternatives per sampled token
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> added to its logit
    prompt_logprobs: int | None = None  # top alternatives per prompt token; the prompt's own logprobs too
    # Structured output (at most one): a JSON schema (a dict, or JSON text), any JSON object, a regex, or a
    # Lark grammar; the output is constrained token by token to what it describes.
    json_schema: dict | str | None = None
    json_object: bool = False
    regex: str | None = None
    grammar: str | None = None
    # False: no speculative drafts for this request (they never change its tokens, only how many a step gives).
    speculative: bool = True
    # False: special tokens' text stays in the output's (a harmony chat's, which its parser splits at them).
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check every field (again: a caller may have changed one since construction); SamplingParamsError
        names the field at fault."""
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        for name in ("stop", "stop_token_ids"):
            if not isinstance(getattr(self, name), list | tuple):
                raise SamplingParamsError(name, f"must be a list, got {type(getattr(self, name)).__name__}")
        self.stop = list(self.stop)
        self.stop_token_ids = list(self.stop_token_ids)
        _number("temperature", self.temperature, 0.0, 100.0)
        _number("top_p", self.top_p, 0.0, 1.0, low_open=True)
        _integer("top_k", self.top_k, -1, 2**31 - 1)
        self.top_k = max(self.top_k, 0)
        _number("min_p", self.min_p, 0.0, 1.0)
        if self.seed is not None:
            _integer("seed", self.seed, 0, MAX_SEED)
        _integer("max_tokens", self.max_tokens, 1, 2**31 - 1)
        for s in self.stop:
            if not isinstance(s, str) or not s:
                raise SamplingParamsError("stop", "each stop sequence must be a non-empty string")
        for t in self.stop_token_ids:
            _integer("stop_token_ids", t, 0, 2**31 - 1)
        for name in ("ignore_eos", "speculative"):
            if not isinstance(getattr(self, name), bool):
                raise SamplingParamsError(name, "must be a boolean")
        if self.logprobs is not None:
            _integer("logprobs", self.logprobs, 0, MAX_LOGPROBS)
        _number("presence_penalty", self.presence_penalty, -2.0, 2.0)
        _number("frequency_penalty", self.frequency_penalty, -2.0, 2.0)
        _number("repetition_penalty", self.repetition_penalty, MIN_REPETITION_PENALTY, 10.0)
        self._check_logit_bias()
        if self.prompt_logprobs is not None:
            _integer("prompt_logprobs", self.prompt_logprobs, 0, MAX_LOGPROBS)
        self._check_structured()

    def _check_logit_bias(self) -> None:
        if not isinstance(self.logit_bias, dict):
            raise SamplingParamsError("logit_bias", "must be a map of token id to bias")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingParamsError(
                "logit_bias", f"has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS}"
            )
        for token, bias in self.logit_bias.items():
            _integer("logit_bias", token, 0, 2**31 - 1)
            _number("logit_bias", bias, -LOGIT_BIAS_RANGE, LOGIT_BIAS_RANGE)

    def _check_structured(self) -> None:
        if not isinstance(self.json_object, bool):
            raise SamplingParamsError("json_object", "must be a boolean")
        if self.json_schema is not None and not isinstance(self.json_schema, dict | str):
            raise SamplingParamsError("json_schema", "must be a map (a JSON schema) or its JSON text")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise SamplingParamsError(name, "must be a non-empty string")
        given = [name for name in STRUCTURED_FIELDS if getattr(self, name) not in (None, False)]
        if len(given) > 1:
            raise SamplingParamsError(given[1], f"give at most one of {', '.join(STRUCTURED_FIELDS)}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE

    @property
    def structured(self) -> tuple[str, object] | None:
        """(field name, value) of the structured-output field set, or None."""
        for name in STRUCTURED_FIELDS:
            value = getattr(self, name)
            if value not in (None, False):
                return name, value
        return None

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0


def _number(name: str, value: object, low: float, high: float, low_open: bool = False) -> None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise SamplingParamsError(name, f"must be a number, got {type(value).__name__}")
    if value != value or value > high or value < low or (low_open and value == low):
        bracket = "(" if low_open else "["
        raise SamplingParamsError(name, f"must be in {bracket}{low}, {high}], got {value}")


def _integer(name: str, value: object, low: int, high: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise SamplingParamsError(name, f"must be an integer, got {type(value).__name__}")
    if not low <= value <= high:
        raise SamplingParamsError(name, f"must be in [{low}, {high}], got {value}")
