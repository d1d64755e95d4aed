"""The sampling-parameter matrix: one batch holding a request per parameter set and
prompt, run on an engine of each feature path (speculative decoding, bounded replay,
batch invariance) and checked against the same batch on a plain engine. Greedy requests
give the plain engine's tokens; sampled tokens lie inside the sampler's top-k / top-p
support; what vLLM does not support on a path is refused by name."""

import math
import re

NEW_TOKENS = 10
TOP_LOGPROBS = 20
REGEX = r"[a-z]{2,4}( [a-z]{2,4}){1,2}"
# Refused by vLLM with speculative decoding, accepted without.
SPECULATION_REFUSES = {"min_p": dict(min_p=0.1), "logit_bias": dict(logit_bias={5: 3.0})}


def parameter_sets():
    """name -> SamplingParams keyword arguments; the greedy ones must equal decoding
    without speculation, the sampled ones stay in their support."""
    greedy = dict(temperature=0.0)
    return {
        "greedy": dict(greedy),
        "penalties": dict(
            greedy, presence_penalty=1.5, frequency_penalty=0.5, repetition_penalty=1.3
        ),
        "stop_token": dict(greedy),  # its stop id is set from the greedy output below
        "top_k_1": dict(temperature=0.8, top_k=1, seed=5),
        "top_k": dict(temperature=0.8, top_k=5, seed=3),
        "top_k_unseeded": dict(temperature=0.8, top_k=5),
        "top_p": dict(temperature=1.0, top_p=0.02, seed=4),
        "top_k_top_p": dict(temperature=0.7, top_k=8, top_p=0.5, seed=6),
        "temperature": dict(temperature=1.3, seed=9),
        "n": dict(temperature=1.0, top_k=4, n=2, seed=2),
        "structured": dict(greedy),
    }


def make_params(name, stop_token):
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    options = dict(
        parameter_sets()[name], max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=TOP_LOGPROBS
    )
    if name == "stop_token":
        options.update(stop_token_ids=[stop_token], ignore_eos=False)
    if name == "structured":
        options.update(structured_outputs=StructuredOutputsParams(regex=REGEX), ignore_eos=False)
    return SamplingParams(**options)


def run_matrix(llm, prompts, stop_token):
    """{(name, prompt index): [(tokens, logprobs) per choice]}, all in one batch."""
    from vllm.inputs import TokensPrompt

    requests, params, keys = [], [], []
    for name in parameter_sets():
        for i, prompt in enumerate(prompts):
            requests.append(TokensPrompt(prompt_token_ids=prompt))
            params.append(make_params(name, stop_token))
            keys.append((name, i))
    outputs = llm.generate(requests, params, use_tqdm=False)
    return {
        key: [(list(c.token_ids), c.logprobs) for c in output.outputs]
        for key, output in zip(keys, outputs)
    }


def greedy_tokens(llm, prompt) -> list[int]:
    """Greedy tokens of `prompt` (a prefix-cache hit once the engine has seen it)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    output = llm.generate(
        [TokensPrompt(prompt_token_ids=prompt)],
        SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True),
        use_tqdm=False,
    )
    return list(output[0].outputs[0].token_ids)


def refusals(llm, prompt) -> dict[str, str]:
    """What each parameter of SPECULATION_REFUSES gives: '' accepted, else the error."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    outcome = {}
    for name, options in SPECULATION_REFUSES.items():
        try:
            llm.generate(
                [TokensPrompt(prompt_token_ids=prompt)],
                SamplingParams(temperature=0.8, max_tokens=4, **options),
                use_tqdm=False,
            )
            outcome[name] = ""
        except Exception as exc:  # noqa: BLE001 - vLLM's validation error
            outcome[name] = str(exc)
    return outcome


def rank_and_mass(logprobs_at_step, token):
    """The sampled token's rank by the raw distribution and the probability mass of the
    tokens ranked above it (from the top-TOP_LOGPROBS returned)."""
    entry = logprobs_at_step[token]
    above = sum(
        math.exp(lp.logprob)
        for t, lp in logprobs_at_step.items()
        if lp.rank is not None and lp.rank < entry.rank and t != token
    )
    return entry.rank, above


def assert_in_support(name, choices, options):
    for tokens, logprobs in choices:
        assert len(tokens) == NEW_TOKENS, name
        for step, token in zip(logprobs, tokens):
            rank, above = rank_and_mass(step, token)
            if options.get("top_k"):
                assert rank <= options["top_k"], (name, rank)
            if options.get("top_p") and options.get("temperature") == 1.0:
                # The nucleus keeps a token while the mass ranked above it is below top_p.
                assert above < options["top_p"] + 1e-4, (name, rank, above)


def assert_matrix(results, plain, stop_token, tokenizer, logprob_tolerance):
    """`results` (run_matrix on a feature path) against `plain` (the same batch on the
    plain engine): greedy tokens equal and their logprobs within `logprob_tolerance`,
    the stop token and the regex obeyed, top-k 1 greedy, sampled tokens in support."""
    sets = parameter_sets()
    for key, choices in results.items():
        name, prompt = key
        options = sets[name]
        if options.get("temperature") == 0.0:
            ((tokens, logprobs),) = choices
            ((want_tokens, want_logprobs),) = plain[key]
            assert tokens == want_tokens, key
            for got, want, token in zip(logprobs, want_logprobs, tokens):
                assert abs(got[token].logprob - want[token].logprob) < logprob_tolerance, key
            if name == "stop_token" and prompt == 0:
                assert tokens[-1] == stop_token and len(tokens) <= NEW_TOKENS // 2 + 1
            if name == "structured":
                # Decoded alone: the output's text can carry bytes of a random prompt.
                text = tokenizer.decode(tokens, skip_special_tokens=True)
                assert re.fullmatch(REGEX, text), text
        elif name == "top_k_1":
            # Top-k 1 at any temperature is greedy: no draw decides anything.
            assert choices[0][0] == plain[key][0][0], key
        else:
            assert len(choices) == options.get("n", 1), key
            assert_in_support(key, choices, options)
