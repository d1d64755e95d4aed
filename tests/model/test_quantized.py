"""Release precision kept in memory: an engine on the release form holds MXFP8 linears and
MXFP4 experts as stored and maps its Engram tables from the checkpoint. It gives the
greedy tokens of its dequantized twin (`--quantization deepinfer_dequantized`, the old
load) with sampled logprobs within LOGPROB_TOLERANCE of the twin's (the two multiply the
same values in different tiles), and both match the dense reference forward within the
fidelity tolerance, near ties of its top-k selections taken either way (a tie the tiling
flips moves a prompt row's logprobs further than rounding); text and vision-language."""

import pytest

from fixtures.reference import ReferenceV41
from helpers import assert_matches_reference, close_llm, generate, make_llm, random_prompts

pytestmark = pytest.mark.engine

LOGPROB_TOLERANCE = 1e-3
"""fp32 engines, sampled tokens: the same dequantized values, multiplied in other tiles."""


def held(model) -> dict:
    """What the worker's model holds: the bytes of its routed experts and grouped output
    projections, the experts' and a linear's storage, and the file each Engram table is
    mapped from."""
    # vLLM's CPU linear layers hand their dense weights to oneDNN (the parameter is left
    # empty), so the experts and wo_a, which are the model's own tensors, are counted.
    quantized_bytes = sum(
        param.nbytes
        for name, param in model.named_parameters()
        if ".ffn.experts." in name or ".attn.wo_a" in name
    )
    layers = model.model.layers
    maps = []
    with open("/proc/self/maps") as f:
        for line in f:
            fields = line.split()
            if len(fields) == 6:
                start, end = (int(bound, 16) for bound in fields[0].split("-"))
                maps.append((start, end, fields[5]))
    tables = [
        next(path for start, end, path in maps if start <= layer.engram.table.data_ptr() < end)
        for layer in layers
        if layer.engram is not None
    ]
    return {
        "quantized_bytes": quantized_bytes,
        "experts": str(layers[2].ffn.experts.w13.dtype),
        "wq_b": str(layers[2].attn.wq_b.weight.dtype),
        "tables": tables,
    }


@pytest.mark.parametrize("checkpoint", ["quantized_checkpoint", "quantized_vision_checkpoint"])
def test_release_precision_gives_its_dequantized_twins_tokens(request, checkpoint):
    path = request.getfixturevalue(checkpoint)
    prompts = random_prompts((7, 60, 150), seed=13)
    results = {}
    for quantization in (None, "deepinfer_dequantized"):
        llm = make_llm(path, quantization=quantization)
        try:
            results[quantization] = (generate(llm, prompts), llm.apply_model(held)[0])
        finally:
            close_llm(llm)
    (kept, kept_held), (twin, twin_held) = results[None], results["deepinfer_dequantized"]
    assert kept_held["experts"] == "torch.int8" and kept_held["wq_b"] == "torch.float8_e4m3fn"
    assert twin_held["experts"] == "torch.float32" and twin_held["wq_b"] == "torch.float32"
    # Engram tables are mapped from the checkpoint's file in both, never copied.
    assert kept_held["tables"] and all(f.startswith(path) for f in kept_held["tables"])
    assert twin_held["tables"] == kept_held["tables"]
    # No dequantized copy held: about 0.53 (MXFP4) and 1.03 (MXFP8) bytes a value against
    # the twin's 4 (fp32).
    assert kept_held["quantized_bytes"] < 0.25 * twin_held["quantized_bytes"]
    reference = ReferenceV41(path)
    for prompt, ours, theirs in zip(prompts, kept, twin):
        assert list(ours.outputs[0].token_ids) == list(theirs.outputs[0].token_ids)
        for a, b in zip(ours.outputs[0].logprobs, theirs.outputs[0].logprobs):
            (token,) = a
            assert abs(a[token].logprob - b[token].logprob) < LOGPROB_TOLERANCE
        assert_matches_reference(reference, prompt, ours)
        assert_matches_reference(reference, prompt, theirs)


BF16_LOGPROB_TOLERANCE = 0.35
"""bf16: the twin multiplies in vLLM's oneDNN bf16 GEMM; the release form through the C
kernel at decode-sized products and, on a CPU without native bf16, fp32 tiles rounded to
bf16. The tiny random model is sensitive to rounding: both bf16 runs sit up to 0.6 from
the fp32 engine's logprob, and up to 0.29 from each other (measured on an AVX2 machine).
Exactness is the fp32 tests' to show; this one shows bf16 serves the same distribution."""
NEAR_TIE = 0.07
"""Tokens whose logprobs the twin puts this close are tied for a bf16 engine: its logits
are bf16, one step apart is 0.0625 for logits between 8 and 16, and on an AMX machine
(oneDNN's bf16 GEMM through AMX) the twin's top two came exactly one step apart."""
TOP = 5


def test_bf16_engine_on_the_release_form(quantized_checkpoint):
    """bf16, as CPU users serve: each prompt's first greedy token is the dequantized
    twin's, or a near tie in the twin's own distribution (NEAR_TIE); its logprob within
    BF16_LOGPROB_TOLERANCE of the twin's for the same token."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    prompts = random_prompts((9, 80, 130), seed=12)
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=TOP, ignore_eos=True)
    first = []
    for quantization in (None, "deepinfer_dequantized"):
        llm = make_llm(quantized_checkpoint, quantization=quantization, dtype="bfloat16")
        try:
            outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params)
        finally:
            close_llm(llm)
        first.append([(o.outputs[0].token_ids[0], o.outputs[0].logprobs[0]) for o in outputs])
    for (ours, ours_logprobs), (theirs, theirs_logprobs) in zip(*first):
        if ours != theirs:
            assert ours in theirs_logprobs, "not in the twin's top tokens"
            margin = theirs_logprobs[theirs].logprob - theirs_logprobs[ours].logprob
            assert margin < NEAR_TIE, f"the twin prefers {theirs} by {margin}"
        difference = ours_logprobs[ours].logprob - theirs_logprobs[ours].logprob
        assert abs(difference) < BF16_LOGPROB_TOLERANCE


# Flash's format and expert count, narrow elsewhere: the routed experts dominate the file.
WIDE_EXPERTS = {
    "hidden_size": 256,
    "num_attention_heads": 4,
    "q_lora_rank": 128,
    "o_lora_rank": 64,
    "o_groups": 2,
    "sliding_window": 32,
    "candidate_topk_blocks": 4,
    "candidate_block_size": 8,
    "index_n_heads": 4,
    "index_topk": 16,
    "moe_intermediate_size": 1024,
    "engram_n_heads": 2,
    "engram_head_dim": 32,
}


def test_a_release_checkpoint_loads_without_a_dequantized_copy(tmp_path, quantized_checkpoint):
    """Two layers of 384 MXFP4 experts of 1024 x 256: 0.32 GB as stored, 2.4 GB
    dequantized to fp32. The worker's peak resident memory (VmHWM, load and first
    forwards included) grows from the tiny checkpoint's by about the stored bytes, far
    below what any moment holding a dequantized copy of the experts would need."""
    from fixtures.real_width import write_real_width

    wide = write_real_width(str(tmp_path / "wide"), engram_rows=48_000, widths=WIDE_EXPERTS)
    peaks = []
    for path in (quantized_checkpoint, wide):
        llm = make_llm(path, max_model_len=256)
        try:
            peaks.append(llm.apply_model(lambda model: _peak_resident_bytes())[0])
        finally:
            close_llm(llm)
    experts = 2 * 384 * 3 * 1024 * 256
    stored, dequantized = experts * (0.5 + 1 / 32), experts * 4
    grown = peaks[1] - peaks[0]
    assert grown < stored + (256 << 20), (grown, stored)
    assert grown < dequantized / 4, (grown, dequantized)


def _peak_resident_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmHWM:"))
