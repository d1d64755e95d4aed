"""previous_response_id on a live server: a reply continues the stored conversation;
unknown, unstored or malformed ids are refused."""

import openai
import pytest

from helpers import SERVED_NAME

pytestmark = pytest.mark.server
REQUEST = dict(
    model=SERVED_NAME, max_output_tokens=4, temperature=0.0, reasoning={"effort": "none"}
)


def test_a_reply_continues_its_previous_response(oa):
    first = oa.responses.create(**REQUEST, input="Hello")
    assert first.store is True
    follow = oa.responses.create(**REQUEST, input="And then?", previous_response_id=first.id)
    assert follow.previous_response_id == first.id
    history = [
        {"role": "user", "content": "Hello"},
        *[item.model_dump(exclude_none=True) for item in first.output],
        {"role": "user", "content": "And then?"},
    ]
    spelled_out = oa.responses.create(**REQUEST, input=history)
    assert follow.usage.input_tokens == spelled_out.usage.input_tokens
    assert follow.usage.input_tokens > first.usage.input_tokens
    assert follow.output[-1].content[0].text == spelled_out.output[-1].content[0].text
    # A streamed reply is stored too, and chains go on.
    streamed = list(
        oa.responses.create(**REQUEST, input="More", stream=True, previous_response_id=follow.id)
    )
    last = streamed[-1].response
    third = oa.responses.create(**REQUEST, input="Go on", previous_response_id=last.id)
    assert third.usage.input_tokens > last.usage.input_tokens


def test_unknown_and_unstored_ids_are_404(oa):
    with pytest.raises(openai.NotFoundError) as error:
        oa.responses.create(**REQUEST, input="Hi", previous_response_id="resp_unknown")
    assert error.value.body["code"] == "previous_response_not_found"
    assert error.value.body["param"] == "previous_response_id"
    unstored = oa.responses.create(**REQUEST, input="Hi", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        oa.responses.create(**REQUEST, input="Hi", previous_response_id=unstored.id)
    with pytest.raises(openai.BadRequestError, match="previous_response_id must be a string"):
        oa.responses.create(**REQUEST, input="Hi", extra_body={"previous_response_id": 7})
