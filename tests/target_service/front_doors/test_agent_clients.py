"""Agent frameworks nobody here wrote, unchanged against the OpenAI door: the OpenAI Agents SDK runs
its tool loop on the Responses API and on chat completions, and langchain-openai's bind_tools gets a
call whose arguments follow the tool's schema."""
from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from agents import (Agent, ModelSettings, OpenAIChatCompletionsModel, OpenAIResponsesModel, Runner, function_tool,
                    set_tracing_disabled)
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from openai import AsyncOpenAI

MODEL = "smollm2-135m"
RESULT = {"temperature_c": 18, "sky": "clear"}


@pytest.mark.parametrize("api", [OpenAIResponsesModel, OpenAIChatCompletionsModel])
def test_the_agents_sdk_calls_the_tool_and_answers(front_doors, api):
    cities: list[str] = []

    @function_tool
    def get_weather(city: str) -> str:
        """The weather now in a city."""
        cities.append(city)
        return json.dumps({"city": city, **RESULT})

    async def run() -> str:
        set_tracing_disabled(True)
        client = AsyncOpenAI(base_url=front_doors.http_url, api_key="unused", max_retries=0)
        # The first turn must call; then the agent's choice is free (reset_tool_choice), as agents run.
        agent = Agent(name="weather", instructions="Use the tool, then answer with its result.", tools=[get_weather],
                      model=api(MODEL, client), reset_tool_choice=True,
                      model_settings=ModelSettings(tool_choice="required", temperature=0, max_tokens=80))
        result = await Runner.run(agent, "What is the weather in Paris?", max_turns=6)
        return result.final_output

    answer = asyncio.run(run())
    assert cities and cities[0] == "Paris", cities
    assert isinstance(answer, str) and answer


def test_langchain_bind_tools_with_a_named_tool_returns_a_valid_call(front_doors):
    @tool
    def get_weather(city: str, unit: str) -> str:
        """The weather now in a city, in celsius or fahrenheit."""
        return json.dumps(RESULT)

    chat = ChatOpenAI(model=MODEL, base_url=front_doors.http_url, api_key="unused", temperature=0, max_tokens=60,
                      max_retries=0)
    # strict closes the arguments object (additionalProperties: false), as OpenAI's strict mode does;
    # left open, the schema lets the 135M model add keys until max_tokens, and the call stays text.
    bound = chat.bind_tools([get_weather], tool_choice="get_weather", strict=True)
    reply = bound.invoke("What is the weather in Paris?")
    [call] = reply.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    jsonschema.validate(call["args"], get_weather.tool_call_schema.model_json_schema())
