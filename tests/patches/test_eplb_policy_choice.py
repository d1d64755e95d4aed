"""`--eplb-config` selects the plugin's EPLB policy by name once the patch applied, and
still refuses names no policy is registered under."""

import pytest
from vllm.config.parallel import ParallelConfig
from vllm.distributed.eplb.policy import EPLB_POLICIES
from vllm.engine.arg_utils import EngineArgs
from vllm.utils.argparse_utils import FlexibleArgumentParser

from vllm_deepinfer.eplb.policy import DeepInferEplbPolicy
from vllm_deepinfer.patches import eplb_policy_choice

pytestmark = pytest.mark.unit


def test_the_policy_is_selectable_from_the_command_line():
    eplb_policy_choice.apply()
    assert EPLB_POLICIES["deepinfer"] is DeepInferEplbPolicy
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--eplb-config", '{"policy": "deepinfer", "use_async": false}'])
    config = ParallelConfig(eplb_config=args.eplb_config)
    assert config.eplb_config.policy == "deepinfer"
    assert eplb_policy_choice.apply()  # idempotent, still reported active


def test_unknown_policies_are_still_refused_naming_the_registered_ones():
    eplb_policy_choice.apply()
    with pytest.raises(ValueError, match="'default' or 'deepinfer'"):
        ParallelConfig(eplb_config={"policy": "greedy", "use_async": False})
