"""benchmarks/throughput.py's measuring order: the long-context rows, and the KV space
they need, come only once the engines without them are shut down (with all four alive,
the plugin's worker was killed for memory on a 24 GiB machine), and every row still gets
one figure per round."""

import argparse
import importlib
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture
def throughput(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    module = importlib.import_module("throughput")
    monkeypatch.setattr(module, "SETTLE_S", 0)
    return module


def test_context_rows_run_after_the_short_row_engines_close(throughput):
    log: list[tuple] = []
    engines: list = []

    class Engine(throughput.VllmSystem):
        """A vLLM system that records what it is asked instead of running an engine."""

        def __init__(self, name: str, context_rows: bool):
            self.name, self.context_rows, self.open = name, context_rows, True

        def prefill_rate(self, batch, prompt_len):
            assert self.open
            log.append((self.name, "prefill", batch))
            return 1.0

        def decode_rate(self, batch, prompt_len, new_tokens):
            assert self.open
            log.append((self.name, "decode", batch))
            return 2.0

        def grow_for_context(self):
            alive = [e.name for e in engines if e.open]
            log.append((self.name, "grow", tuple(alive)))

        def context_decode_rate(self, batch, prompt_len, new_tokens):
            alive = [e.name for e in engines if e.open]
            log.append((self.name, "context", prompt_len, tuple(alive)))
            return 3.0

        def close(self):
            self.open = False
            log.append((self.name, "close"))

    class Reference:
        name, batched = "reference", False

        def prefill_rate(self, batch, prompt_len):
            return 4.0

        def decode_rate(self, batch, prompt_len, new_tokens):
            return 5.0

    engines += [
        Engine("plugin", True),
        Engine("llama", True),
        Engine("plugin_eager", False),
        Engine("plugin_bi", False),
    ]
    args = argparse.Namespace(
        batch_sizes=[1, 2],
        prefill_len=4,
        decode_prompt_len=2,
        decode_tokens=2,
        context_lens=[8, 16],
        context_batch=2,
        rounds=2,
    )
    results = throughput.measure([*engines, Reference()], args)

    contexts = [entry for entry in log if entry[1] == "context"]
    assert contexts and all(alive == ("plugin", "llama") for *_, alive in contexts)
    # The long rows' KV space is taken only once the other engines are shut down.
    grown = [entry for entry in log if entry[1] == "grow"]
    assert [entry[0] for entry in grown] == ["plugin", "llama"]
    assert all(alive == ("plugin", "llama") for *_, alive in grown)
    first_context = log.index(contexts[0])
    closed = [entry[0] for entry in log[:first_context] if entry[1] == "close"]
    assert sorted(closed) == ["plugin_bi", "plugin_eager"]
    # One unrecorded run per engine at the shortest context, then every length per round.
    assert [(e[0], e[2]) for e in contexts[:2]] == [("plugin", 8), ("llama", 8)]
    for name in ("plugin", "llama"):
        for length in (8, 16):
            assert results[(name, "context", length)] == [3.0, 3.0]
    for name in ("plugin", "llama", "plugin_eager", "plugin_bi", "reference"):
        for batch in (1, 2):
            assert len(results[(name, "decode", batch)]) == 2
            assert len(results[(name, "prefill", batch)]) == 2
    assert not any(
        key[0] in ("plugin_eager", "plugin_bi") and key[1] == "context" for key in results
    )
