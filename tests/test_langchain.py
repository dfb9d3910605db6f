"""langchain-openai's ChatOpenAI against the gateway and a real daemon: structured output by each of its
methods, and bound tools."""

from __future__ import annotations

import pytest
from daemon_fixtures import DaemonProcess
from gateway_fixtures import daemon_fixture  # noqa: F401
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, Field


class Person(BaseModel):
    """A person."""

    name: str = Field(max_length=8)
    age: int = Field(ge=0, le=120)


class Weather(BaseModel):
    """The weather in a city."""

    city: str = Field(max_length=10)


@pytest.fixture(scope="module")
def llm(daemon: DaemonProcess) -> ChatOpenAI:
    with daemon.client() as client:
        model = client.info()["model"]
    return ChatOpenAI(
        model=model, base_url=f"{daemon.base_url}/v1", api_key="unused", max_tokens=120, seed=1, max_retries=0
    )


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_structured_output_into_a_pydantic_model(llm: ChatOpenAI, method: str):
    person = llm.with_structured_output(Person, method=method).invoke("Describe someone")
    assert isinstance(person, Person) and len(person.name) <= 8 and 0 <= person.age <= 120


def test_structured_output_in_json_mode(llm: ChatOpenAI):
    # json_mode asks for any JSON object; greedy, the random model closes it soon.
    parsed = llm.bind(temperature=0).with_structured_output(method="json_mode").invoke("Answer in JSON")
    assert isinstance(parsed, dict)


def test_bound_tools_return_tool_calls(llm: ChatOpenAI):
    reply = llm.bind_tools([Weather], tool_choice="Weather", parallel_tool_calls=False).invoke(
        "Weather in Paris?"
    )
    (call,) = reply.tool_calls
    assert call["name"] == "Weather" and call["id"].startswith("call_")
    assert len(Weather(**call["args"]).city) <= 10
    streamed = None
    for chunk in llm.bind_tools([Weather], tool_choice="required").stream("Weather in Paris?"):
        streamed = chunk if streamed is None else streamed + chunk
    assert streamed.tool_calls and all(c["name"] == "Weather" for c in streamed.tool_calls)
    Weather(**streamed.tool_calls[0]["args"])
