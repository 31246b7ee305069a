"""The official `openai` client's structured output: `parse(response_format=PydanticModel)`.

The client turns the model class into a strict JSON schema (`strict: true`, every property
required, `additionalProperties: false`, a `title` per field, nested models as `$defs`
reached by `$ref`, Optional fields as `anyOf` with null, enums and literals as `enum`) and
reads the reply back into the class. Both spellings, `client.chat.completions.parse` and
`client.beta.chat.completions.parse`, must give an instance against `minserve serve`.
"""

from __future__ import annotations

from collections.abc import Iterator
from enum import StrEnum
from typing import Annotated, Literal

import pytest
from openai import OpenAI
from openai.lib._parsing._completions import type_to_response_format_param
from pydantic import BaseModel, Field

from minserve import LLM
from minserve.server.app import build_server
from minserve.server.background import BackgroundServer
from minserve.server.serving import ServerConfig

MODEL = "smollm2"
ASK = [{"role": "user", "content": "Describe a customer as JSON."}]


class Tier(StrEnum):
    free = "free"
    pro = "pro"


Short = Annotated[str, Field(max_length=12)]  # unbounded, SmolLM2 may ramble to max_tokens


class Address(BaseModel):
    city: str = Field(max_length=12)
    zip_code: str = Field(pattern=r"^[0-9]{5}$")


class Customer(BaseModel):
    name: str = Field(max_length=12)
    age: int = Field(ge=18, le=99)
    tier: Tier
    channel: Literal["email", "phone"]
    address: Address
    tags: list[Short] = Field(min_length=1, max_length=2)
    nickname: Short | None


@pytest.fixture(scope="module")
def client() -> Iterator[OpenAI]:
    served = LLM(num_blocks=128)
    with BackgroundServer(build_server(served.engine, ServerConfig(MODEL))) as url:
        yield OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)


def test_the_client_sends_a_strict_schema_with_defs_and_refs() -> None:
    sent = type_to_response_format_param(Customer)["json_schema"]
    assert sent["strict"] is True
    assert sent["schema"]["additionalProperties"] is False
    assert set(sent["schema"]["$defs"]) == {"Address", "Tier"}
    assert sent["schema"]["properties"]["address"] == {"$ref": "#/$defs/Address"}


@pytest.mark.slow
@pytest.mark.parametrize("beta", [True, False], ids=["beta", "stable"])
def test_parse_returns_an_instance_of_a_nested_pydantic_model(client: OpenAI, beta) -> None:
    completions = client.beta.chat.completions if beta else client.chat.completions
    reply = completions.parse(
        model=MODEL, messages=ASK, temperature=0, max_tokens=256, response_format=Customer
    )
    choice = reply.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    customer = choice.message.parsed
    assert isinstance(customer, Customer)
    assert isinstance(customer.address, Address) and isinstance(customer.tier, Tier)
    assert 18 <= customer.age <= 99 and 1 <= len(customer.tags) <= 2
    assert Customer.model_validate_json(choice.message.content) == customer
