"""The vision-language arch patch: a V4.1 config with vision layers resolves to the
plugin's vision-language class; a text-only one, or any other architecture, is left as
it is."""

from types import SimpleNamespace

import pytest

from vllm_deepinfer.model.deepseek_v41.registration import ARCH, VL_ARCH
from vllm_deepinfer.patches import vision_language_arch

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    "layers,architectures,expected",
    [
        (2, [ARCH], [VL_ARCH]),
        (0, [ARCH], [ARCH]),
        (2, ["DSparkDraftModel"], ["DSparkDraftModel"]),
    ],
)
def test_convertor_chooses_the_class_from_the_vision_layers(layers, architectures, expected):
    from vllm.transformers_utils.model_arch_config_convertor import MODEL_ARCH_CONFIG_CONVERTORS

    assert vision_language_arch.apply()
    assert vision_language_arch.apply()  # idempotent
    config = SimpleNamespace(
        vision_n_layers=layers, architectures=list(architectures), model_type="deepseek_v41"
    )
    convertor = MODEL_ARCH_CONFIG_CONVERTORS["deepseek_v41"](config, config)
    assert config.architectures == expected
    assert convertor.get_architectures() == expected


def test_refuses_when_vllm_brings_its_own_convertor(monkeypatch):
    from vllm.transformers_utils import model_arch_config_convertor as convertors

    table = dict(convertors.MODEL_ARCH_CONFIG_CONVERTORS)
    table["deepseek_v41"] = convertors.ModelArchConfigConvertorBase
    monkeypatch.setattr(convertors, "MODEL_ARCH_CONFIG_CONVERTORS", table)
    with pytest.raises(vision_language_arch.PatchUnavailable, match="now has a convertor"):
        vision_language_arch.apply()
