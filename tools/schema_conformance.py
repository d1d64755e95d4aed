"""Whether an output satisfies its so_args constraint, strictly: JSON through strict
`json.loads` and `jsonschema`, regexes as a full match, EBNF accepted by its grammar.

Run as a module it is the conformance suite over the vendored real-world schemas
(data/schemas/SOURCE/*.json): each schema is refused up front with a reason, or compiled
as the engine compiles it and decoded by the model given, and every output that ends
with EOS must validate.

    python -m tools.schema_conformance --model CKPT [--json counts.json]
"""

from __future__ import annotations

import argparse
import json
import os
import re
from collections import Counter
from pathlib import Path

import xgrammar as xgr

from vllm_deepinfer.logger import init_logger

logger = init_logger(__name__)
SCHEMA_DIR = Path(__file__).resolve().parents[1] / "data" / "schemas"


def conformance_error(so_args: dict, text: str) -> str | None:
    """None when `text` satisfies the constraint, else what is wrong."""
    kind, schema = so_args["schema_type"], so_args["schema"]
    if kind == "json":
        import jsonschema

        try:
            value = json.loads(text)
        except json.JSONDecodeError as e:
            return f"not strict JSON: {e}"
        schema = json.loads(schema) if isinstance(schema, str) else schema
        error = jsonschema.exceptions.best_match(_validator(schema).iter_errors(value))
        return None if error is None else f"violates the schema: {error.message}"
    if kind == "regex":
        return None if re.fullmatch(schema, text) else f"does not fully match /{schema}/"
    grammar = xgr.Grammar.from_ebnf(schema)
    # xgrammar's helper runs its matcher over the characters of a whole string.
    if not xgr.testing._is_grammar_accept_string(grammar, text):
        return "not accepted by the EBNF grammar"
    return None


def _validator(schema: dict):
    """jsonschema's validator for the schema's draft, matching `pattern` and
    `patternProperties` with RE2 (linear time: a hostile pattern cannot hang it)."""
    import jsonschema

    base = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    return jsonschema.validators.extend(
        base, {"pattern": _pattern, "patternProperties": _pattern_properties}
    )(schema)


def _search(pattern: str, text: str) -> bool:
    import re2

    return re2.search(pattern, text) is not None


def _pattern(validator, pattern, instance, schema):
    from jsonschema import ValidationError

    if validator.is_type(instance, "string") and not _search(pattern, instance):
        yield ValidationError(f"{instance!r} does not match {pattern!r}")


def _pattern_properties(validator, patterns, instance, schema):
    if not validator.is_type(instance, "object"):
        return
    for pattern, subschema in patterns.items():
        for name, value in instance.items():
            if _search(pattern, name):
                yield from validator.descend(value, subschema, path=name, schema_path=pattern)


def refusal_class(reason: str) -> str:
    """The kind of an up-front refusal, for counting: the keyword, else the check."""
    keyword = re.match(r"unsupported JSON Schema keyword '([^']+)'", reason)
    if keyword:
        return f"keyword {keyword.group(1)}"
    for prefix, name in (
        ("unsupported JSON Schema at", "vLLM request check"),
        ("invalid JSON Schema", "xgrammar compile"),
        ("unresolvable $ref", "unresolvable $ref"),
        ("unsatisfiable", "unsatisfiable"),
        ("invalid string length", "invalid length limits"),
    ):
        if reason.startswith(prefix):
            return name
    return "other"


def suite_llm(model: str, max_tokens: int = 256):
    """The engine the suite decodes with: structured outputs on xgrammar, no free
    whitespace (a random model otherwise pads until the length limit)."""
    from vllm import LLM

    return LLM(
        model=model,
        dtype="float32",
        max_model_len=max_tokens + 64,
        enforce_eager=True,
        max_num_seqs=64,
        seed=0,
        structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
    )


def run_suite(
    llm, schema_dir: Path = SCHEMA_DIR, max_tokens: int = 256, names: set[str] | None = None
) -> dict:
    """Counts per source (only the schemas in `names`, where given), with the name and
    reason of every schema the engine refused after acceptance and of every EOS-finished
    output that failed validation."""
    from vllm_deepinfer import envs
    from vllm_deepinfer.structured.compile_pool import GrammarCompilePool

    results = {}
    for source in sorted(p.name for p in schema_dir.iterdir() if p.is_dir()):
        # The server's way: compiled by vLLM's backend in a worker, then only deserialized
        # by the engine (the grammar cache patch), so each grammar is compiled once. A
        # worker per source: its in-memory compiler cache grows by gigabytes per hundred.
        pool = GrammarCompilePool(llm.llm_engine.vllm_config, envs.load().grammar_cache_dir)
        try:
            results[source] = _run_source(llm, pool, schema_dir / source, max_tokens, names)
        finally:
            pool.shutdown()
    return results


def _run_source(llm, pool, folder: Path, max_tokens: int, names: set[str] | None) -> dict:
    from vllm.inputs import TokensPrompt

    from vllm_deepinfer.structured.so_args import StructuredOutputError, sampling_params

    paths = sorted(p for p in folder.glob("*.json") if names is None or p.name in names)
    counts = {
        "total": len(paths),
        "refused": Counter(),
        "accepted": 0,
        "engine_refused": [],
        "stop": 0,
        "invalid_outputs": [],
        "length": 0,
    }
    accepted = []
    for path in paths:
        schema = json.loads(path.read_text())
        try:
            params = sampling_params(
                so_args={"schema_type": "json", "schema": schema},
                max_tokens=max_tokens,
                temperature=1.0,
                seed=len(accepted),
            )
        except StructuredOutputError as e:
            counts["refused"][refusal_class(str(e))] += 1
            continue
        accepted.append((path.name, schema, params, pool.compile(params.structured_outputs)))
    counts["accepted"] = len(accepted)
    batch = []
    for name, schema, params, compiled in accepted:
        try:
            compiled.result()
        except Exception as e:  # noqa: BLE001 - the engine's compiler refused it
            counts["engine_refused"].append({"schema": name, "reason": str(e)[:300]})
            continue
        batch.append((name, schema, params))
    logger.info("%s: %d compiled, decoding", folder.name, len(batch))
    prompts = [
        TokensPrompt(prompt_token_ids=list(range(3 + i % 50, 40 + i % 50)))
        for i in range(len(batch))
    ]
    outputs = _generate(llm, prompts, [params for _, _, params in batch], counts, batch)
    for (name, schema, _), output in zip(batch, outputs):
        if output is None:
            continue
        completion = output.outputs[0]
        if completion.finish_reason != "stop":
            counts["length"] += 1
            continue
        counts["stop"] += 1
        error = conformance_error({"schema_type": "json", "schema": schema}, completion.text)
        if error is not None:
            counts["invalid_outputs"].append(
                {"schema": name, "error": error[:300], "text": completion.text[:300]}
            )
    counts["refused"] = dict(counts["refused"].most_common())
    logger.info("%s: %s", folder.name, summary(counts))
    return counts


def _generate(llm, prompts, params, counts, batch):
    """The batch's outputs; where vLLM refuses the batch, each request alone, so the
    refused ones are counted and the rest still run."""
    try:
        return llm.generate(prompts, params, use_tqdm=False)
    except Exception:  # noqa: BLE001 - attributed to its requests below
        outputs = []
        for (name, _, _), prompt, one in zip(batch, prompts, params):
            try:
                outputs += llm.generate([prompt], [one], use_tqdm=False)
            except Exception as e:  # noqa: BLE001 - the engine refused this one
                counts["engine_refused"].append({"schema": name, "reason": str(e)[:300]})
                outputs.append(None)
        return outputs


def summary(counts: dict) -> dict:
    """The counts alone, without the per-schema lists."""
    return {
        "total": counts["total"],
        "refused_up_front": sum(counts["refused"].values()),
        "refused_by_reason": dict(counts["refused"]),
        "accepted": counts["accepted"],
        "accepted_then_refused_by_engine": len(counts["engine_refused"]),
        "stop_finished": counts["stop"],
        "stop_finished_failing_validation": len(counts["invalid_outputs"]),
        "length_truncated": counts["length"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    parser.add_argument("--model", required=True, help="checkpoint directory")
    parser.add_argument("--schemas", type=Path, default=SCHEMA_DIR)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--json", type=Path, help="write the counts (and failures) here")
    args = parser.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB; the tiny model needs little
    results = run_suite(suite_llm(args.model, args.max_tokens), args.schemas, args.max_tokens)
    for source, counts in results.items():
        print(source, json.dumps(summary(counts)))
        for failure in counts["engine_refused"] + counts["invalid_outputs"]:
            print("  FAIL", json.dumps(failure))
    if args.json:
        args.json.write_text(
            json.dumps(
                {
                    s: {
                        **summary(c),
                        "engine_refused": c["engine_refused"],
                        "invalid_outputs": c["invalid_outputs"],
                    }
                    for s, c in results.items()
                },
                indent=1,
            )
        )
    failed = any(c["engine_refused"] or c["invalid_outputs"] for c in results.values())
    raise SystemExit(1 if failed else 0)


if __name__ == "__main__":
    main()
