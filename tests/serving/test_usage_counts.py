"""Usage from the engine's token counts, in each protocol's own shape."""
import pytest

from vllm_deepinfer.serving.usage import TokenCounts

pytestmark = pytest.mark.unit
END = 7  # </think>


def test_reasoning_counts_tokens_up_to_the_end_of_thinking():
    counts = TokenCounts(1, END)
    counts.add(0, [1, 2, 3])
    counts.add(0, [END, 4, 5])
    assert counts.completion == [6] and counts.reasoning == [3]


def test_without_thinking_nothing_is_reasoning():
    counts = TokenCounts(1, None)
    counts.add(0, [1, END, 2])
    assert counts.completion == [3] and counts.reasoning == [0]


def test_chat_usage_rewritten_in_place_of_the_recipes():
    counts = TokenCounts(2, END)
    counts.add(0, [1, 2, END, 3])
    counts.add(1, [4, 5, 6])
    recipe = {"prompt_tokens": 10, "completion_tokens": 3, "total_tokens": 13,
              "prompt_tokens_details": {"cached_tokens": 4},
              "completion_tokens_details": {"reasoning_tokens": 93},
              "prompt_cache_hit_tokens": 4, "prompt_cache_miss_tokens": 6}
    assert counts.usage(recipe, 0) == {**recipe, "completion_tokens": 4, "total_tokens": 14,
                                       "completion_tokens_details": {"reasoning_tokens": 2}}
    assert counts.usage(recipe) == {**recipe, "completion_tokens": 7, "total_tokens": 17,
                                    "completion_tokens_details": {"reasoning_tokens": 5}}
    assert recipe["completion_tokens"] == 3  # the recipe's object is not changed


def test_responses_and_messages_events_rewritten_where_they_hold_usage():
    counts = TokenCounts(1, None)
    counts.add(0, [1, 2, 3, 4])
    responses = {"type": "response.completed", "response": {"usage": {
        "input_tokens": 9, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 3,
        "output_tokens_details": {"reasoning_tokens": 12}, "total_tokens": 12}}}
    assert counts.rewrite(responses)["response"]["usage"] == {
        "input_tokens": 9, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 4,
        "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 13}
    delta = {"type": "message_delta", "usage": {"input_tokens": 5, "output_tokens": 3,
                                                "cache_read_input_tokens": 4}}
    assert counts.rewrite(delta)["usage"] == {"input_tokens": 5, "output_tokens": 4,
                                              "cache_read_input_tokens": 4}
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 5,
                                                            "output_tokens": 0}}}
    assert counts.rewrite(start)["message"]["usage"]["output_tokens"] == 4
    assert counts.rewrite({"type": "content_block_delta"}) == {"type": "content_block_delta"}
