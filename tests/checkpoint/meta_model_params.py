"""Builds the plugin's DeepseekV41ForCausalLM for a config directory on the meta device
and prints {parameter name: shape} as one JSON line (used by test_layout)."""

import json
import sys

import torch
from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
from vllm.distributed import init_distributed_environment, initialize_model_parallel
from vllm.utils.network_utils import get_open_port

from vllm_deepinfer.model.deepseek_v41.model import DeepseekV41ForCausalLM
from vllm_deepinfer.model.deepseek_v41.registration import register_deepseek_v41


def main(config_dir: str) -> None:
    register_deepseek_v41()
    vllm_config = VllmConfig(
        model_config=ModelConfig(
            model=config_dir, skip_tokenizer_init=True, dtype="bfloat16", max_model_len=4096
        )
    )
    with set_current_vllm_config(vllm_config):
        init_distributed_environment(
            world_size=1,
            rank=0,
            local_rank=0,
            backend="gloo",
            distributed_init_method=f"tcp://127.0.0.1:{get_open_port()}",
        )
        initialize_model_parallel(1, 1)
        with torch.device("meta"):
            model = DeepseekV41ForCausalLM(vllm_config=vllm_config)
    print(json.dumps({name: list(p.shape) for name, p in model.named_parameters()}))


if __name__ == "__main__":
    main(sys.argv[1])
