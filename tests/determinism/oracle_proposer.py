"""A `method="custom_class"` proposer for the tests: it drafts each request's reference
continuation (what decoding without speculation produced, read from the JSON file named
by ORACLE_CONTINUATIONS), so drafts are accepted and every verification pass checks
several positions at once."""

import json
import os


class OracleProposer:
    def __init__(self, vllm_config):
        self.size = vllm_config.speculative_config.num_speculative_tokens
        with open(os.environ["ORACLE_CONTINUATIONS"]) as f:
            self.references = [(entry["prompt"], entry["continuation"]) for entry in json.load(f)]

    def load_model(self, *args, **kwargs) -> None:
        """Nothing to load."""

    def propose(
        self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu=None, slot_mappings=None
    ) -> list[list[int]]:
        drafts = []
        for row, sampled in enumerate(sampled_token_ids):
            tokens = [] if not sampled else token_ids_cpu[row, : num_tokens_no_spec[row]].tolist()
            drafts.append(self._continuation(tokens))
        return drafts

    def _continuation(self, tokens: list[int]) -> list[int]:
        for prompt, continuation in self.references:
            produced = tokens[len(prompt) :]
            if tokens[: len(prompt)] == prompt and continuation[: len(produced)] == produced:
                return continuation[len(produced) : len(produced) + self.size]
        return []
